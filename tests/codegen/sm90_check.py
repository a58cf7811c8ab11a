"""Compile generated kernels for a GPU target without a GPU: ``compile_for_target(kernel, args)`` (tests).

Triton's frontend (Python AST -> TTIR), its MLIR passes and ``ptxas`` (shipped in the wheel) all
run on the CPU, so a kernel that would fail with ``CompilationError`` at its first launch on an
H100/H200 fails here too. The check executes the kernel module in compiled (not interpreter) mode,
runs its ``call`` launcher on fake/meta ``example_args`` with its launches recorded
(``kiln.runtime.precompile.record_launches``), and hands every recorded launch (kernel, argument types,
block sizes, warps) to ``triton.compile`` for ``GPUTarget('cuda', arch, 32)``.
"""
from __future__ import annotations

import torch

from kiln.runtime.precompile import compiled_module, record_launches

_TL = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
       torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
       torch.bool: "i1"}


class TargetCompileError(RuntimeError):
    """A generated kernel does not compile for the GPU target; the message holds Triton's error and
    the kernel source. This is a kiln codegen bug: fix the emitter (kiln/codegen/to_triton/) or make
    the lowering raise ``Unsupported`` for the construct so the group stays ATen."""


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


def compile_for_target(kernel, example_args, arch: int = 90) -> None:
    """Compile every launch of ``kernel`` (a ``kernel.Kernel`` generated for CUDA, i.e. not for
    the interpreter) for ``sm_<arch>`` on the CPU; raises ``TargetCompileError`` with the source."""
    import triton
    from triton.backends.compiler import GPUTarget
    if kernel.interpret:
        raise ValueError(f"check: {kernel.name} was generated for Triton's interpreter; "
                         "trace the graph on (fake) CUDA tensors to get compiled-mode kernels")
    mod = compiled_module(kernel)
    for fn, args, (xb, rb, warps), meta in record_launches(mod, list(example_args)):
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
