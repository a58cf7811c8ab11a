"""Launching kernels: autotuning, the launch fast path and the helpers generated kernel modules call
(``run``, ``launch``, ``restride``, ``empty_cuda``, ``semaphore``)."""
import threading

import torch

from kiln.codegen.text.blocks import Blocks, candidates, config, grid_of, next_pow2
from kiln.compat import empty_strided_fn, triton_c_launcher_ok
from kiln.debug import log
from kiln.runtime.kernels import on_reset


_TUNED: dict = {}
_INTERPRETER = threading.Lock()   # one interpreted kernel at a time (Triton 3.6's interpreter is not thread-safe)


def run(kernel, args, xnumel, rnumel, cfg, meta):
    """Launch ``kernel`` over ``xnumel`` rows (skipped when empty)."""
    xnumel = int(xnumel)
    if xnumel <= 0:
        return
    kind = meta["kind"]
    if meta.get("autotune") and not meta.get("interpret"):
        cfg = _autotune(kernel, args, xnumel, rnumel, meta)
    elif cfg is None:
        cfg = default_config(meta, xnumel, rnumel, meta.get("interpret"))
    xb, rb, warps = cfg
    grid = grid_of(xnumel, xb, meta)
    consts = (xb,) if kind == "pointwise" else (xb, rb)
    if meta.get("interpret"):
        with _INTERPRETER:   # Triton's interpreter patches the language module while a kernel runs
            _jit_launch(kernel, grid, args, consts, warps)
    else:
        _launch(kernel, grid, args, consts, warps)


def default_config(meta, xnumel, rnumel, interpret):
    """The heuristic configuration of a launch chosen at run time, from the tuning its module carries."""
    return config(meta["kind"], xnumel, int(rnumel), meta["persistent"], meta["inner"], interpret,
                  meta.get("narrow", False), Blocks(*meta["blocks"]))


def _jit_launch(kernel, grid, args, consts, warps):
    """Launch through Triton's JIT, with the compile options a module set on its kernel (``kiln_options``)."""
    blocks = dict(zip(("XBLOCK", "RBLOCK"), consts))
    return kernel[grid](*args, **blocks, num_warps=warps, **(getattr(kernel, "kiln_options", None) or {}))


# -- the fast path: Triton's ``kernel[grid](...)`` re-specializes every argument at every launch (tens of
# microseconds); kiln keeps the compiled kernel and calls its C launcher while the arguments specialize
# the same way (dtypes, 16-byte alignment, integers equal to 1, divisible by 16 or wider than 32 bits).
_COMPILED: dict = {}
_STREAM = []
on_reset(_COMPILED.clear)
on_reset(_TUNED.clear)


def _triton_stream():
    if not _STREAM:
        from triton.runtime.driver import driver
        active = driver.active
        _STREAM.append((active.get_current_device, active.get_current_stream))
    device, stream = _STREAM[0]
    return stream(device())


# the current device and its raw stream without torch.cuda's Python; Triton's where torch has no CUDA
_device = getattr(torch._C, "_cuda_getDevice", None) or (lambda: _STREAM[0][0]() if _STREAM else 0)
_stream_of = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (lambda dev: _triton_stream())


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


class Sites:
    """The launch-site fast path over a driver given as functions (``device()``, ``stream_of(device)``,
    ``hooks_on()``, ``general(kernel, grid, args, consts, warps)`` returning the compiled kernel,
    ``c_launcher_ok()``); tests make their own with stand-ins."""

    def __init__(self, device, stream_of, hooks_on, general, c_launcher_ok):
        self.device, self.stream_of, self.hooks_on = device, stream_of, hooks_on
        self.general, self.c_launcher_ok = general, c_launcher_ok

    def launch(self, kernel, args, grid, consts, warps):
        """A launch whose grid and block sizes were fixed when the module was generated: a site keeps the
        kernel compiled for 16-byte aligned tensors and unspecialized integers on one device; other
        arguments, another device or an installed launch hook take the general path."""
        site = getattr(kernel, "_kiln_site", None)
        if site is not None:
            dev, fn, head, pm, nt = site
            p = 0
            for a in args[:nt]:
                p |= a.data_ptr()
            if not p & 15 and (nt == len(args) or _generic_ints(args, nt)) and self.device() == dev \
                    and not self.hooks_on():
                fn(grid[0], 1, 1, self.stream_of(dev), *head, pm, None, None, None, *args, *consts)
                return
        ck = self.general(kernel, grid, args, consts, warps)
        nt = 0
        while nt < len(args) and isinstance(args[nt], torch.Tensor):
            nt += 1
        if ck is not None and site is None and all(isinstance(a, int) and not isinstance(a, bool) for a in args[nt:]) \
                and _generic_ints(args, nt) and all(a.data_ptr() & 15 == 0 for a in args[:nt]):
            try:
                kernel._kiln_site = (self.device(), *self.launcher(ck), nt)
            except AttributeError:   # an object that takes no attributes: no site, the general path
                pass

    def launcher(self, ck):
        """(fn, head, packed_metadata) such that ``fn(gx, 1, 1, stream, *head, pm, None, None, None, *args)``
        launches ``ck``: Triton's C launcher itself when the kernel needs no scratch memory, else ``run``."""
        run = ck.run
        c_launch = getattr(run, "launch", None)
        if c_launch is not None and self.c_launcher_ok() and not getattr(run, "global_scratch_size", 1) \
                and not getattr(run, "profile_scratch_size", 1) and hasattr(run, "launch_pdl"):
            return c_launch, (ck.function, run.launch_cooperative_grid, run.launch_pdl, None, None), ck.packed_metadata
        return run, (ck.function,), ck.packed_metadata


def _c_launcher_ok() -> bool:
    import triton
    return triton_c_launcher_ok(getattr(triton, "__version__", ""))


def _generic_ints(args, nt) -> bool:
    for v in args[nt:]:
        if v == 1 or not v & 15 or not -2 ** 31 <= v < 2 ** 31:
            return False
    return True


_RUNTIME: list = []


def _hooks_on() -> bool:
    """Whether a Triton launch hook is installed (Triton 3.6 keeps an empty ``HookChain`` when none is): one
    call per launch, the knobs object looked up once."""
    if not _RUNTIME:
        import triton
        _RUNTIME.append(getattr(getattr(triton, "knobs", None), "runtime", None))
    rt = _RUNTIME[0]
    if rt is None:
        return True
    enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
    return enter is not None and bool(getattr(enter, "calls", True)) or \
        leave is not None and bool(getattr(leave, "calls", True))


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
    ck.run(grid[0], 1, 1, _stream_of(_device()), ck.function, ck.packed_metadata, None, None, None, *args, *consts)
    return ck


launch = Sites(_device, _stream_of, _hooks_on, _launch, _c_launcher_ok).launch


def _autotune(kernel, args, xnumel, rnumel, meta):
    key = (id(kernel), xnumel, int(rnumel))
    best = _TUNED.get(key)
    if best is not None:
        return best
    from triton.testing import do_bench
    kind = meta["kind"]
    timings = []
    blocks = Blocks(*meta["blocks"])
    for cfg in candidates(kind, xnumel, rnumel, meta["persistent"], meta["inner"], meta.get("narrow", False), blocks):
        if meta["persistent"] and cfg[1] != next_pow2(rnumel):
            continue
        try:
            ms = do_bench(lambda: run(kernel, args, xnumel, rnumel, cfg, {**meta, "autotune": False}), warmup=5, rep=20)
        except Exception:  # a config that does not compile (too many registers) is skipped
            continue
        timings.append((ms, cfg))
    best = min(timings)[1] if timings else default_config(meta, xnumel, rnumel, False)
    log(4, f"autotune {getattr(kernel, '__name__', kernel)} xnumel={xnumel} rnumel={rnumel}: {best}")
    _TUNED[key] = best
    return best


def restride(t: torch.Tensor, shape, stride):
    """``t`` with the strides a kernel was compiled for (a copy only when they differ)."""
    st = t.stride()
    if st == stride or all(a == b for s, a, b in zip(shape, st, stride) if s != 1):
        return t
    return torch.empty_strided(shape, stride, dtype=t.dtype, device=t.device).copy_(t)


empty_cuda = empty_strided_fn()   # (size, stride, dtype) on the current CUDA device


_HERE: dict = {}


def cuda_here() -> torch.device:
    """The current CUDA device (one ``torch.device`` per index, made once)."""
    i = _device()
    d = _HERE.get(i)
    if d is None:
        d = _HERE[i] = torch.device("cuda", i)
    return d


def semaphore(cache: dict, device) -> torch.Tensor:
    """A kernel's zeroed int32 counter for ``device`` and the current stream (the kernel resets it)."""
    key = (device, _stream_of(device.index)) if device.type == "cuda" else device
    s = cache.get(key)
    if s is None:
        s = cache[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return s

