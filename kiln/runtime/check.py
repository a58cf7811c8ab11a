"""Compile generated kernels for a GPU target without a GPU: ``compile_for_target(kernel, args)``.

Triton's frontend (Python AST -> TTIR), its MLIR passes and ``ptxas`` (shipped in the wheel) all
run on the CPU, so a kernel that would fail with ``CompilationError`` at its first launch on an
H100/H200 fails here too. The check executes the kernel module in compiled (not interpreter) mode,
runs its ``call`` launcher on fake/meta ``example_args`` with ``launch.run``/``launch.launch`` replaced by a recorder,
and hands every recorded launch (kernel, argument types, block sizes, warps) to ``triton.compile``
for ``GPUTarget('cuda', arch, 32)``.
"""
from __future__ import annotations

import torch

from kiln.codegen.to_triton.config import Blocks, config
from kiln.runtime import launch
from kiln.runtime.kernels import import_file, module_file, subdir

_TL = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
       torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
       torch.bool: "i1"}


class TargetCompileError(RuntimeError):
    """A generated kernel does not compile for the GPU target; the message holds Triton's error and
    the kernel source. This is a kiln codegen bug: fix the emitter (kiln/codegen/to_triton/) or make
    the lowering raise ``Unsupported`` for the construct so the group stays ATen."""


def _exec_compiled(kernel):
    """The kernel's module executed with ``@triton.jit`` building compiled (not interpreted) kernels."""
    path = module_file(kernel.name, kernel.source, subdir("check"), overwrite=True)
    return import_file(f"kiln_check.{kernel.name}", path, interpret=False, source=kernel.source)


def _sig(v):
    if isinstance(v, torch.Tensor):
        return "*" + _TL[v.dtype]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, torch.SymInt):   # a dynamic size: typed by its example value
        v = int(v.node.hint) if v.node.hint is not None else 1
    if isinstance(v, int):
        return "i32" if -2 ** 31 <= v < 2 ** 31 else "i64"
    if isinstance(v, float):
        return "fp32"
    raise TypeError(f"check: cannot type kernel argument {type(v).__name__}")


def _record(mod, example_args):
    """Run ``mod.call`` with launches recorded instead of run: [(jit fn, args, cfg, meta)]."""
    launches = []

    def fake_run(fn, args, xnumel, rnumel, cfg, meta):
        xnumel = int(xnumel)
        if cfg is None:
            cfg = config(meta["kind"], max(xnumel, 1), int(rnumel), meta["persistent"], meta["inner"], False,
                         meta.get("narrow", False), Blocks(*meta["blocks"]))
        launches.append((fn, args, cfg, meta))

    def fake_launch(fn, args, grid, consts, warps):   # a launch fixed at generation time
        launches.append((fn, args, (consts[0], consts[-1] if len(consts) > 1 else 1, warps), {}))

    # ``mod`` is a private copy of the module: only its own ``launch`` name is replaced, so kernels
    # launching meanwhile on other threads (a backward compiling while another runs) are untouched
    mod.launch = _Recorder(run=fake_run, launch=fake_launch, empty_cuda=_fake_empty,
                           cuda_here=lambda: torch.device("cuda", 0),
                           semaphore=lambda cache, device: torch.zeros(1, dtype=torch.int32, device=device))
    mode = next((a.fake_mode for a in example_args if hasattr(a, "fake_mode")), None)
    if mode is None:   # a kernel without tensor inputs still allocates CUDA outputs
        from torch._subclasses.fake_tensor import FakeTensorMode
        mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        mod.call(*example_args)
    return launches


def _fake_empty(size, stride, dtype):
    """``launch.empty_cuda`` under fake mode (torch's C++ helper would allocate real CUDA memory)."""
    return torch.empty_strided(size, stride, dtype=dtype, device="cuda")


class _Recorder:
    """``kiln.runtime.launch`` with the functions ``_record`` passes replaced."""

    def __init__(self, **overrides):
        self.__dict__.update(overrides)

    def __getattr__(self, name):
        return getattr(launch, name)


def compile_for_target(kernel, example_args, arch: int = 90) -> None:
    """Compile every launch of ``kernel`` (a ``kernel.Kernel`` generated for CUDA, i.e. not for
    the interpreter) for ``sm_<arch>`` on the CPU; raises ``TargetCompileError`` with the source."""
    import triton
    from triton.backends.compiler import GPUTarget
    if kernel.interpret:
        raise ValueError(f"check: {kernel.name} was generated for Triton's interpreter; "
                         "trace the graph on (fake) CUDA tensors to get compiled-mode kernels")
    mod = _exec_compiled(kernel)
    for fn, args, (xb, rb, warps), meta in _record(mod, list(example_args)):
        names = fn.arg_names
        consts = {"XBLOCK": xb}
        if "RBLOCK" in names:
            consts["RBLOCK"] = rb
        sig = {}
        values = iter(args)
        for n in names:
            sig[n] = "constexpr" if n in consts else _sig(next(values))
        try:
            src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts)
            options = {"num_warps": warps, **(getattr(fn, "kiln_options", None) or {})}   # device asserts
            triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
        except Exception as e:
            first = (str(e).strip().splitlines() or [""])[0]
            raise TargetCompileError(
                f"check: kernel {kernel.name} does not compile for sm_{arch} "
                f"({type(e).__name__}: {first})\n{e}\n--- source ---\n{kernel.source}") from e
