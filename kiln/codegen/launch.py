"""Launching kernels: configurations, autotuning, the launch fast path and the run-time helpers that
generated kernel modules call (``run``, ``launch``, ``restride``, ``empty_cuda``, ``semaphore``,
``seed``). The text of those modules is written by ``modsource.py``.
"""
from __future__ import annotations

import torch

from kiln.compat import empty_strided_cuda_fn, triton_c_launcher_ok


def next_pow2(n: int) -> int:
    n = max(int(n), 1)
    return 1 << (n - 1).bit_length()


def config(kind, xnumel, rnumel, persistent, inner, interpret, narrow=False):
    """(XBLOCK, RBLOCK, num_warps) from a small heuristic. ``narrow``: the kernel reads or writes
    2-byte elements (a pointwise thread then takes 8 of them: 16-byte accesses)."""
    if kind == "pointwise":
        if interpret:
            return min(next_pow2(xnumel), 1 << 14), 1, 1
        xb = min(PW_XBLOCK, max(next_pow2(xnumel), 16))
        warps = PW_WARPS_NARROW if narrow else PW_WARPS
        return xb, 1, warps if xb >= 1024 else (4 if xb >= 256 else 2)
    if persistent:
        rb = next_pow2(rnumel)
        budget = (1 << 14) if interpret else (4096 if inner else 2048)
        xb = max(1, min(next_pow2(xnumel), budget // rb, 1024 if interpret else 64))
        warps = 1 if interpret else max(1, min(8, (xb * rb) // 256))
        return xb, rb, warps
    if interpret:
        rb = min(next_pow2(rnumel), 1024)
        return max(1, min(next_pow2(xnumel), 4096 // rb)), rb, 1
    if inner:
        return 1, min(next_pow2(rnumel), 2048), 8
    # outer reductions: columns along the tile's first axis; autotuning on an H200 preferred
    # 16 warps for long columns (65536x512 column sum: 138 us with 4 warps, 46 us with 16)
    return (min(OUTER_XBLOCK, next_pow2(xnumel)), min(next_pow2(rnumel), OUTER_RBLOCK),
            OUTER_WARPS if rnumel >= 1024 else 4)


# pointwise kernels: a tile of 1024 elements, 4 per thread (16 bytes of fp32) or 8 per thread for 2-byte
# data (an H200 probe of a bf16 GELU backward at 8192x3072: 4 warps 6% faster than 8; fp32 rows alike)
PW_XBLOCK, PW_WARPS, PW_WARPS_NARROW = 1024, 8, 4
OUTER_XBLOCK, OUTER_RBLOCK, OUTER_WARPS = 32, 64, 16   # column reductions' tile: columns, rows, warps


def candidates(kind, xnumel, rnumel, persistent, inner, narrow=False):
    """Configurations tried under ``max_autotune``."""
    base = config(kind, xnumel, rnumel, persistent, inner, False, narrow)
    out = {base}
    xb, rb, w = base
    for f in (2, 4):
        if kind == "pointwise":
            out.add((max(16, xb // f), 1, max(1, w // 2)))
            out.add((min(4096, xb * f), 1, min(16, w * 2)))
        else:
            if xb // f >= 1:
                out.add((xb // f, rb, w))
            out.add((min(xb * f, 256), rb, w))
            if not persistent and rb // f >= 16:
                out.add((xb, rb // f, w))
    for wf in (4, 8, 16):
        out.add((xb, rb, wf))
    return sorted(out)


_TUNED: dict = {}


def run(kernel, args, xnumel, rnumel, cfg, meta):
    """Launch ``kernel`` over ``xnumel`` rows (skipped when empty)."""
    xnumel = int(xnumel)
    if xnumel <= 0:
        return
    kind = meta["kind"]
    if meta.get("autotune") and not meta.get("interpret"):
        cfg = _autotune(kernel, args, xnumel, rnumel, meta)
    elif cfg is None:
        cfg = config(kind, xnumel, rnumel, meta["persistent"], meta["inner"], meta.get("interpret"),
                     meta.get("narrow", False))
    xb, rb, warps = cfg
    grid = grid_of(xnumel, xb, meta)
    consts = (xb,) if kind == "pointwise" else (xb, rb)
    if meta.get("interpret"):
        _jit_launch(kernel, grid, args, consts, warps)
    else:
        _launch(kernel, grid, args, consts, warps)


def grid_of(xnumel: int, xblock: int, meta) -> tuple:
    """The launch grid: one program for a kernel that walks all rows itself (``outer``), one per chunk
    of rows for folded column partials (``programs``), else one per block of XBLOCK rows."""
    if meta.get("programs"):
        return (meta["programs"],)
    return (1,) if meta.get("outer") else ((xnumel + xblock - 1) // xblock,)


def _jit_launch(kernel, grid, args, consts, warps):
    """Launch through Triton's JIT entry point (binds, specializes, compiles when new)."""
    if len(consts) == 1:
        return kernel[grid](*args, XBLOCK=consts[0], num_warps=warps)
    return kernel[grid](*args, XBLOCK=consts[0], RBLOCK=consts[1], num_warps=warps)


# -- the fast path ------------------------------------------------------------------------------
# Triton's ``kernel[grid](...)`` re-binds and re-specializes every argument on every launch (tens
# of microseconds of Python). A launch site repeats the same kernel, grid and block sizes, so kiln
# keeps the compiled kernel Triton returned and calls its C launcher directly, as long as the
# arguments specialize the same way: tensor dtypes and 16-byte alignment, integers equal to 1,
# divisible by 16, or wider than 32 bits. The site lives on the kernel object (a dict keyed by
# Triton's JITFunction would run its Python ``__hash__`` at every launch).
_COMPILED: dict = {}
_STREAM = []


def _triton_stream():
    if not _STREAM:
        from triton.runtime.driver import driver
        active = driver.active
        _STREAM.append((active.get_current_device, active.get_current_stream))
    device, stream = _STREAM[0]
    return stream(device())


# the current device and its raw stream, as Triton's driver reads them, without torch.cuda's Python
# (``current_device`` runs ``_lazy_init`` on every call); Triton's own functions where torch has no CUDA
_device = getattr(torch._C, "_cuda_getDevice", None) or (lambda: _STREAM[0][0]() if _STREAM else 0)
_stream_of = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (lambda dev: _triton_stream())


def _stream():
    return _stream_of(_device())


def _spec(args):
    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.dtype, a.data_ptr() & 15 == 0))
        elif isinstance(a, bool) or not isinstance(a, int):
            key.append(type(a))
        else:
            key.append((a == 1, a & 15 == 0, -2 ** 31 <= a < 2 ** 31))
    return tuple(key)


def launch(kernel, args, grid, consts, warps):
    """A launch whose grid and block sizes were fixed when the module was generated.

    The common case costs one attribute read, one ``data_ptr`` per tensor and the C launcher: a
    site remembers the kernel compiled for 16-byte aligned tensors and integers that Triton does
    not specialize (not 1, not a multiple of 16, 32-bit: the philox seeds), on one device; any
    other arguments, another device, or an installed launch hook take the general path."""
    site = getattr(kernel, "_kiln_site", None)
    if site is not None:
        dev, fn, head, pm, nt = site
        p = 0
        for a in args[:nt]:
            p |= a.data_ptr()
        if not p & 15 and (nt == len(args) or _generic_ints(args, nt)) and _device() == dev and not _hooks_on():
            fn(grid[0], 1, 1, _stream_of(dev), *head, pm, None, None, None, *args, *consts)
            return
    ck = _launch(kernel, grid, args, consts, warps)
    nt = 0
    while nt < len(args) and isinstance(args[nt], torch.Tensor):
        nt += 1
    if ck is not None and site is None and all(isinstance(a, int) and not isinstance(a, bool) for a in args[nt:]) \
            and _generic_ints(args, nt) and all(a.data_ptr() & 15 == 0 for a in args[:nt]):
        try:
            kernel._kiln_site = (_device(), *_launcher(ck), nt)
        except AttributeError:   # an object that takes no attributes: no site, the general path
            pass


def _c_launcher_ok() -> bool:
    import triton
    return triton_c_launcher_ok(getattr(triton, "__version__", ""))


def _launcher(ck):
    """(fn, head, packed_metadata) such that ``fn(gx, 1, 1, stream, *head, pm, None, None, None, *args)``
    launches ``ck``: Triton's C launcher itself when the kernel needs no scratch memory (the
    Python ``CudaLauncher.__call__`` around it only allocates scratch), else its ``run``."""
    run = ck.run
    c_launch = getattr(run, "launch", None)
    if c_launch is not None and _c_launcher_ok() and not getattr(run, "global_scratch_size", 1) \
            and not getattr(run, "profile_scratch_size", 1) and hasattr(run, "launch_pdl"):
        return c_launch, (ck.function, run.launch_cooperative_grid, run.launch_pdl, None, None), ck.packed_metadata
    return run, (ck.function,), ck.packed_metadata


def _generic_ints(args, nt) -> bool:
    for v in args[nt:]:
        if v == 1 or not v & 15 or not -2 ** 31 <= v < 2 ** 31:
            return False
    return True


_RUNTIME: list = []


def _runtime():
    import triton
    _RUNTIME.append(getattr(getattr(triton, "knobs", None), "runtime", None))
    return _RUNTIME[0]


def _hooks_on() -> bool:
    rt = _RUNTIME[0] if _RUNTIME else _runtime()
    if rt is None:
        return True
    return _hooked(rt.launch_enter_hook) or _hooked(rt.launch_exit_hook)


def _hooked(hook) -> bool:
    """Whether a Triton launch hook is installed (Triton 3.6 keeps an empty ``HookChain``)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _launch(kernel, grid, args, consts, warps):
    if _hooks_on():
        return _jit_launch(kernel, grid, args, consts, warps)   # launch hooks want Triton's metadata
    key = (id(kernel), _device(), grid, consts, warps, _spec(args))
    hit = _COMPILED.get(key)
    if hit is None or hit[0] is not kernel:
        ck = _jit_launch(kernel, grid, args, consts, warps)
        if ck is not None and not hasattr(ck, "result"):
            ck.run   # noqa: B018  loads the module and function handles
            _COMPILED[key] = (kernel, ck)
        return ck
    ck = hit[1]
    ck.run(grid[0], 1, 1, _stream(), ck.function, ck.packed_metadata, None, None, None, *args, *consts)
    return ck


def _autotune(kernel, args, xnumel, rnumel, meta):
    key = (id(kernel), xnumel, int(rnumel))
    best = _TUNED.get(key)
    if best is not None:
        return best
    from triton.testing import do_bench
    kind = meta["kind"]
    timings = []
    for cfg in candidates(kind, xnumel, rnumel, meta["persistent"], meta["inner"], meta.get("narrow", False)):
        if meta["persistent"] and cfg[1] != next_pow2(rnumel):
            continue
        try:
            ms = do_bench(lambda: run(kernel, args, xnumel, rnumel, cfg, {**meta, "autotune": False}),
                          warmup=5, rep=20)
        except Exception:  # a config that does not compile (too many registers) is skipped
            continue
        timings.append((ms, cfg))
    best = min(timings)[1] if timings else config(kind, xnumel, rnumel, meta["persistent"], meta["inner"], False,
                                                  meta.get("narrow", False))
    from kiln.debug import log
    log(4, f"autotune {getattr(kernel, '__name__', kernel)} xnumel={xnumel} rnumel={rnumel}: {best}")
    _TUNED[key] = best
    return best


def restride(t: torch.Tensor, shape, stride):
    """``t`` with the strides a kernel was compiled for (a copy only when they differ)."""
    st = t.stride()
    if st == stride or all(a == b for s, a, b in zip(shape, st, stride) if s != 1):
        return t
    out = torch.empty_strided(shape, stride, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


empty_cuda = empty_strided_cuda_fn()   # (size, stride, dtype) on the current CUDA device


def cuda_here() -> torch.device:
    return torch.device("cuda", _device())


def semaphore(cache: dict, device) -> torch.Tensor:
    """A kernel's zeroed int32 counter for ``device`` and, on CUDA, the current stream (made once; the
    kernel sets it back to 0; launches on two streams at once count on two counters)."""
    key = (device, _stream_of(device.index)) if device.type == "cuda" else device
    s = cache.get(key)
    if s is None:
        s = cache[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return s


def seed() -> int:
    """A fresh philox seed from torch's default generator (repeatable under manual_seed)."""
    return int(torch.randint(0, 2 ** 31 - 1, (), dtype=torch.int64).item())


# -- module text --------------------------------------------------------------------------
