"""Hooks for the fuzz runner's own tests (imported by its child processes by name)."""
import functools

import torch

from kiln_bench.fuzz.program import Input, Op, Program

CRASH, WRONG, HANG = 1, 2, 3   # program indices the hook replaces


@functools.cache
def _warm_up() -> None:
    """Run one trivial program through the harness, once per child. A child's first program pays for Dynamo's,
    AOTAutograd's and the harness's first use (about 5 s on a quiet core, over 8 s under load), which the
    runner's clock counts as the program's time; a hook runs before that clock starts."""
    from kiln_bench.fuzz.child import run_program
    run_program(Program((Input((3,)),), (Op("{0} + 1", ("a0",), "v0"),), ("v0",), note="warm-up"), "aten")


def crash_and_mul(program: Program, index: int) -> Program:
    """Program CRASH segfaults its child (in eager, first statement); program WRONG is ``a0 * a1``,
    which ``add_for_mul`` miscompiles; program HANG sleeps for ten minutes. Each child warms up first, so that
    a short ``timeout`` tells the hang from the others on a loaded machine too."""
    _warm_up()
    if index == CRASH:
        return Program((Input((3,)),), (Op("__import__('ctypes').string_at(0)", family="hook"),
                                        Op("{0} + 1", ("a0",), "v0")), ("v0",), note=f"crash {index}")
    if index == WRONG:
        return Program((Input((3, 4)), Input((4,), seed=1)), (Op("{0} * {1}", ("a0", "a1"), "v0"),), ("v0",),
                       note=f"wrong {index}")
    if index == HANG:
        return Program((Input((3,)),), (Op("__import__('time').sleep(600)", family="hook"),
                                        Op("{0} + 1", ("a0",), "v0")), ("v0",), note=f"hang {index}")
    return program


def add_for_mul(graph) -> None:
    """A broken post-grad pass: every ``aten.mul.Tensor`` becomes ``aten.add.Tensor``."""
    for n in graph.nodes:
        if n.op == "call_function" and n.target is torch.ops.aten.mul.Tensor:
            n.target = torch.ops.aten.add.Tensor


def broken_generator(program: Program, index: int) -> Program:
    """The fuzzer itself failing to make program 0 (as a child missing a module would)."""
    if index == 0:
        raise ImportError("No module named 'hypothesis._native'")
    return program
