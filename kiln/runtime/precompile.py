"""Compile a graph's Triton kernels in worker processes before their first launch (CUDA only).

Without this, each kernel compiles at its first launch, one after another (a few hundred ms each).
``warm(gm, opts)`` records each new kernel's launches on the graph's fake inputs, then has a pool of
spawned processes without a CUDA context ``JITFunction.warmup`` each into Triton's on-disk cache, keyed
with the parent's ptxas version (``key_state``), host launchers built too. An optimization only: a kernel
not warmed compiles at its first launch. Option ``compile_workers`` (-1: half the cores, up to 8; 0: off).
"""
import concurrent.futures as cf
import contextlib
import os
import sys
import threading
import time
import types

import torch
import torch.fx as fx

from kiln.codegen.text.source import KernelRef
from kiln.debug import counters, log
from kiln.runtime import launch
from kiln.runtime.kernels import import_file, module_file, on_reset, subdir

_POOL: list = []     # [executor] once started
_DONE: set = set()   # kernel names already handed to the pool in this process
on_reset(_DONE.clear)
_LOCK = threading.Lock()
_ENV = ("TRITON_CACHE_DIR", "TRITON_HOME", "KILN_KERNEL_DIR")


def n_workers(opts) -> int:
    """Worker processes to use for ``opts`` (0: precompiling is off)."""
    n = getattr(opts, "compile_workers", -1)
    if n is None or n < 0:
        if not torch.cuda.is_available():
            return 0
        n = min(8, max(1, (os.cpu_count() or 2) // 2))
    return int(n)


def _arg(a):
    if isinstance(a, torch.Tensor):
        return a.dtype   # warm-up turns a dtype into a mock tensor with an aligned pointer
    if isinstance(a, bool) or not isinstance(a, int):
        raise TypeError(type(a).__name__)
    return int(a)


def tasks(gm: fx.GraphModule) -> list:
    """``(path, module name, kernel name, args, constexprs, warps)`` per launch of the graph's new kernels."""
    out = []
    for node in gm.graph.nodes:
        k = node.target
        if not isinstance(k, KernelRef) or k.interpret or k.name in _DONE:
            continue
        _DONE.add(k.name)
        example = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in node.args]
        if any(isinstance(v, torch.SymInt) or (isinstance(v, torch.Tensor) and
               any(isinstance(s, torch.SymInt) for s in (*v.shape, *v.stride()))) for v in example):
            continue
        try:
            path = module_file(k.name, k.source)   # the file the runtime loads (kernel._load_module)
            for fn, args, (xb, rb, warps), _ in record_launches(compiled_module(k), example):
                consts = {"XBLOCK": xb, **({"RBLOCK": rb} if "RBLOCK" in fn.arg_names else {})}
                out.append((path, f"kiln_kernels.{k.name}", fn.__name__, [_arg(a) for a in args], consts, warps))
        except Exception as e:   # nothing to warm for this one: it compiles at its first launch
            log(2, f"precompile: {k.name} not warmed ({type(e).__name__}: {e})")
    return out


def compiled_module(kernel):
    """The kernel's module executed with ``@triton.jit`` building compiled (not interpreted) kernels."""
    path = module_file(kernel.name, kernel.source, subdir("check"), overwrite=True)
    return import_file(f"kiln_check.{kernel.name}", path, interpret=False, source=kernel.source)


def record_launches(mod, example_args):
    """Run ``mod.call`` with launches recorded instead of run: [(jit fn, args, cfg, meta)]."""
    launches = []

    def fake_run(fn, args, xnumel, rnumel, cfg, meta):
        cfg = cfg or launch.default_config(meta, max(int(xnumel), 1), rnumel, False)
        launches.append((fn, args, cfg, meta))

    def fake_launch(fn, args, grid, consts, warps):   # a launch fixed at generation time
        launches.append((fn, args, (consts[0], consts[-1] if len(consts) > 1 else 1, warps), {}))

    def fake_empty(size, stride, dtype):   # torch's C++ helper would allocate real CUDA memory
        return torch.empty_strided(size, stride, dtype=dtype, device="cuda")

    # ``mod`` is a private copy of the module: only its own ``launch`` name is replaced, so kernels
    # launching meanwhile on other threads (a backward compiling while another runs) are untouched
    mod.launch = types.SimpleNamespace(**{
        **vars(launch), "run": fake_run, "launch": fake_launch, "empty_cuda": fake_empty,
        "cuda_here": lambda: torch.device("cuda", 0),
        "semaphore": lambda cache, device: torch.zeros(1, dtype=torch.int32, device=device)})
    mode = next((a.fake_mode for a in example_args if hasattr(a, "fake_mode")), None)
    if mode is None:   # a kernel without tensor inputs still allocates CUDA outputs
        from torch._subclasses.fake_tensor import FakeTensorMode
        mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        mod.call(*example_args)
    return launches


def target_only_driver(target):
    """A Triton driver knowing the GPU target only: enough for ``JITFunction.warmup``, without a CUDA
    context (hundreds of MB of GPU memory per worker)."""
    from triton.backends.nvidia.driver import CudaDriver

    class TargetOnly(CudaDriver):
        def __init__(self):
            pass

        def get_current_target(self):
            return target

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cuda", 0)
    return TargetOnly()


def _current_target():
    """``(backend, arch, warp_size)`` of the active Triton driver (the GPU kiln compiles for)."""
    from triton.runtime.driver import driver
    t = driver.active.get_current_target()
    return (t.backend, t.arch, t.warp_size)


def key_state(target) -> dict:
    """The parts of Triton's cache key held in the parent's memory: the ptxas version, computed once per
    process (Inductor repoints ``TRITON_PTXAS_PATH`` later), and a libdevice path set in ``triton.knobs``."""
    import triton
    from triton.backends.nvidia import compiler as nvc
    return {"ptxas_version": nvc.get_ptxas_version(target[1]),
            "libdevice_path": getattr(triton.knobs.nvidia, "libdevice_path", None)}


def worker_view(target) -> dict:
    """``key_state`` and ``TRITON_PTXAS_PATH`` as a process sees them (a worker's, for comparison)."""
    return {**key_state(target), "TRITON_PTXAS_PATH": os.environ.get("TRITON_PTXAS_PATH")}


def _warm(task, env, target=None, state=None) -> bool:
    """Worker: compile one launch into Triton's cache (no launch), keyed and linked as the parent does."""
    path, modname, fn_name, args, consts, warps = task
    os.environ.update(env)
    if state and state.get("ptxas_version") is not None:
        from triton.backends.nvidia import compiler as nvc
        nvc.get_ptxas_version = lambda arch=80, version=state["ptxas_version"]: version
    if state and state.get("libdevice_path"):
        import triton
        triton.knobs.nvidia.libdevice_path = state["libdevice_path"]
    if target is not None:
        from triton.backends.compiler import GPUTarget
        from triton.runtime.driver import driver
        if driver._active is None:
            driver.set_active(target_only_driver(GPUTarget(*target)))
    mod = import_file(modname, path, interpret=False)
    fn = getattr(mod, fn_name)   # with the options its launches use (``launch._jit_launch``: device asserts)
    compiled = fn.warmup(*args, grid=(1,), num_warps=warps, **consts, **(getattr(fn, "kiln_options", None) or {}))
    build_launcher(compiled)
    return True


def build_launcher(compiled) -> bool:
    """Build a compiled kernel's host launcher (a C extension Triton otherwise compiles, about a second,
    at the first launch; cached on disk). Needs the CUDA driver library, not a CUDA context."""
    try:
        from triton.backends.nvidia.driver import CudaLauncher
        CudaLauncher(compiled.src, compiled.metadata)
        return True
    except Exception as e:   # no libcuda here, another backend, a Triton without it: built at launch
        log(3, f"precompile: launcher not built ({type(e).__name__}: {e})")
        return False


def _ready() -> bool:
    """Worker start-up work done ahead of the first task: the imports a warm-up needs."""
    import triton.compiler  # noqa: F401
    from kiln.runtime import kernels  # noqa: F401
    return True


def start(opts) -> None:
    """Start the worker pool in the background (spawning takes seconds, which then overlap tracing)."""
    n = n_workers(opts)
    if n <= 0 or _POOL:
        return
    try:
        with _hidden_main():
            pool = _pool(n)
            for _ in range(n):
                pool.submit(_ready)
    except Exception as e:   # no pool here: warm() reports it when it needs one
        log(2, f"precompile: pool not started early ({type(e).__name__}: {e})")


@contextlib.contextmanager
def _hidden_main():
    """Start workers without re-running the user's script (``__main__`` hides its file and spec meanwhile)."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
    try:
        if main is not None:
            main.__dict__.pop("__file__", None)
            main.__dict__["__spec__"] = None
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)
            if "__spec__" not in saved:
                main.__dict__.pop("__spec__", None)


def _pool(n: int):
    with _LOCK:
        if not _POOL:
            import atexit
            import multiprocessing as mp
            _POOL.append(cf.ProcessPoolExecutor(max_workers=n, mp_context=mp.get_context("spawn")))
            atexit.register(_shutdown)   # before module teardown, or the executor's callbacks complain
        return _POOL[0]


def _shutdown():
    if _POOL:
        _POOL.pop().shutdown(wait=False, cancel_futures=True)


def warm(gm: fx.GraphModule, opts) -> int:
    """Precompile the new kernels of fused graph ``gm``; returns how many launches were warmed."""
    n = n_workers(opts)
    if n <= 0:
        return 0
    todo = tasks(gm)
    if not todo or (not _POOL and len({t[1] for t in todo}) < opts.tuning.precompile_min_kernels):
        return 0   # a few kernels compile as fast in place as a new pool starts (a started one: use it)
    env = {k: os.environ[k] for k in _ENV if k in os.environ}
    t0 = time.perf_counter()
    try:
        target = _current_target()
        state = key_state(target)
        with _hidden_main():   # workers start on demand, at a submit
            futures = [_pool(n).submit(_warm, t, env, target, state) for t in todo]
    except Exception as e:   # no GPU target, no pool (a sandbox without spawning): compile at launch
        log(1, f"precompile: not started ({type(e).__name__}: {e}); kernels compile at first launch")
        return 0
    done, _ = cf.wait(futures, timeout=opts.tuning.precompile_timeout_s)   # then the JIT compiles the rest
    ok = sum(1 for f in done if f.exception() is None)
    for f in done:
        if f.exception() is not None:
            log(2, f"precompile: a launch was not warmed ({f.exception()})")
    counters["codegen"]["precompiled"] += ok
    log(1, f"precompile: {ok}/{len(todo)} launches of {len({t[1] for t in todo})} kernels compiled on "
           f"{n} workers in {time.perf_counter() - t0:.1f} s")
    return ok
