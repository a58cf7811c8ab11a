"""Parallel precompile (codegen/precompile.py), checked on the CPU with a stand-in CUDA driver.

Triton's JIT needs an active driver only for the device, the stream and the target; a driver that
answers sm_90 lets ``JITFunction.warmup`` compile kiln's real kernels here (frontend, MLIR, ptxas).
The test warms every launch the way a worker does, then replays the launches the way the runtime's
first call does (real, 16-byte aligned tensors, through the JIT) and checks that Triton's cache
gained no entry: the runtime would load what the workers compiled.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from kiln.codegen import precompile
from kiln.codegen.fuse import fuse_graph
from kiln.options import Options
from tests.codegen.test_compile_sm90 import _grad, _to_cuda, _toolchain_missing
from tests.codegen.util import decompositions

pytestmark = pytest.mark.skipif(_toolchain_missing() is not None, reason=str(_toolchain_missing()))


@pytest.fixture
def sm90_driver(monkeypatch, tmp_path):
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaDriver
    from triton.runtime.driver import driver

    class StandIn(CudaDriver):
        def __init__(self):   # no CUDA runtime to open
            pass

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cuda", 0)

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    saved = driver.active if driver._active is not None else None
    driver.set_active(StandIn())
    yield tmp_path / "triton"
    driver._active = saved


def _fused_cuda_graph():
    def f(x, w, b):
        return F.gelu(F.layer_norm(x, (64,), w, b)) * 2
    cpu = [torch.randn(16, 64, requires_grad=True), torch.randn(64, requires_grad=True),
           torch.randn(64, requires_grad=True)]
    gm = _to_cuda(make_fx(_grad(f, 3), decomposition_table=decompositions(), tracing_mode="fake")(*cpu))
    with FakeTensorMode(allow_non_fake_inputs=True):
        args = [torch.empty(a.shape, device="cuda") for a in cpu]
        gm = make_fx(gm, decomposition_table=decompositions())(*args)
    fuse_graph(gm, args, Options(codegen="triton"), strict=True)
    return gm


def _entries(d):
    return len(os.listdir(d)) if os.path.isdir(d) else 0


def test_warmed_launches_are_the_runtime_launches(sm90_driver):
    gm = _fused_cuda_graph()
    precompile._DONE.clear()
    todo = precompile.tasks(gm)
    assert len({t[1] for t in todo}) >= 2 and all(isinstance(t[3][0], torch.dtype) for t in todo)
    for t in todo:
        assert precompile._warm(t, {})
    warmed = _entries(sm90_driver)
    assert warmed >= len({t[1] for t in todo})
    # the runtime's first launch: the same module file, real aligned tensors, launch.py's keywords
    import importlib.util
    for path, modname, fn_name, args, consts, warps in todo:
        spec = importlib.util.spec_from_file_location(modname + "_runtime", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        real = [torch.empty(64, dtype=a) if isinstance(a, torch.dtype) else a for a in args]
        assert all(r.data_ptr() % 16 == 0 for r in real if isinstance(r, torch.Tensor))
        getattr(mod, fn_name).warmup(*real, grid=(1,), num_warps=warps, **consts)
    assert _entries(sm90_driver) == warmed   # every launch hit what the workers compiled


def test_no_gpu_no_workers_and_failures_are_harmless(monkeypatch):
    if not torch.cuda.is_available():
        assert precompile.n_workers(Options()) == 0
    assert precompile.n_workers(Options(compile_workers=0)) == 0
    gm = _fused_cuda_graph()
    precompile._DONE.clear()
    monkeypatch.setattr(precompile, "MIN_KERNELS", 1)
    # spawned workers have no CUDA driver here, so every compile fails: warm() reports 0, raises nothing
    assert precompile.warm(gm, Options(compile_workers=1)) == 0
    assert precompile._POOL   # the pool was really started


def test_workers_do_not_rerun_an_unguarded_user_script(tmp_path):
    """A spawned worker imports the parent's __main__; a training script without a __main__ guard
    must still run once (precompile hides the main module while workers start)."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = tmp_path / "train.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {root!r})\n"
        "print('SCRIPT RUNS', flush=True)\n"
        "from kiln.codegen import precompile\n"
        "from kiln.options import Options\n"
        "import tests.codegen.test_precompile as T\n"
        "precompile.MIN_KERNELS = 1\n"
        "print('warmed', precompile.warm(T._fused_cuda_graph(), Options(compile_workers=2)), flush=True)\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout
    assert out.count("SCRIPT RUNS") == 1, out
    assert "warmed 0" in out, out
