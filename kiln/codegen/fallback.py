"""The ATen fallback of a kernel: the original nodes its group replaced, as a small graph.

``generate`` gives each kernel node a ``Fallback`` (``extract``): a graph computing the same outputs
from the same arguments with the ATen nodes the kernel replaced. The runtime's ``KernelCall``
(``kiln/runtime/kernels.py``) runs it if the kernel fails on its first call.
"""
from __future__ import annotations

import torch
import torch.fx as fx


class NoFallback(Exception):
    """The group's outputs cannot be recomputed from its arguments with the original nodes (an
    output has no graph node, or needs a graph input that is not a kernel argument)."""


def extract(inputs, outputs, multi: bool, position=None) -> "Fallback":
    """A (lazily built) GraphModule computing original nodes ``outputs`` from original nodes ``inputs`` (its
    placeholders, in order), copying every node in between; a tuple when ``multi``.
    ``position``: node -> index in the graph, to order the copies without walking the graph."""
    if any(o is None for o in outputs):
        raise NoFallback("a kernel output is a buffer without a graph node")
    env, sizes = {}, {}
    graph = fx.Graph()
    for i, n in enumerate(inputs):
        p = graph.placeholder(f"arg{i}")
        # an input without a graph node (a buffer internal to the lowering) stays unused: the
        # walk below recomputes what it needs from graph nodes, or finds it cannot
        if n is not None and n not in env:
            env[n] = p
            if size_expr(n) is not None:
                sizes.setdefault(size_expr(n), p)
    needed, stack = set(), list(outputs)
    while stack:
        n = stack.pop()
        if n in env or n in needed:
            continue
        if n.op != "call_function" and size_expr(n) in sizes:
            env[n] = sizes[size_expr(n)]   # a size placeholder: the argument of the same size
            continue
        if n.op != "call_function":
            raise NoFallback(f"{n.name} ({n.op}) is needed but is not a kernel argument")
        needed.add(n)
        stack.extend(n.all_input_nodes)
    if position is None:
        position = {n: i for i, n in enumerate(outputs[0].graph.nodes)}
    for n in sorted(needed, key=position.__getitem__):   # graph order is a topological order
        env[n] = graph.node_copy(n, lambda a: env[a])
    vals = [env[o] for o in outputs]
    graph.output(tuple(vals) if multi else vals[0])
    graph.lint()
    return Fallback(graph)


def size_expr(n):
    """The expression of a node holding a SymInt (a size), else None."""
    v = n.meta.get("val")
    return v.node.expr if isinstance(v, torch.SymInt) else None


def graph_inputs(inputs, outputs) -> list:
    """The placeholders that computing ``outputs`` from ``inputs`` with the graph's nodes reads beside
    ``inputs`` (a declined kernel's ATen nodes may recompute what other kernels hold in registers)."""
    have, seen, out = set(inputs), set(), []
    stack = [o for o in outputs if o is not None]
    while stack:
        n = stack.pop()
        if n in have or n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            out.append(n)
        elif n.op == "call_function":
            stack.extend(n.all_input_nodes)
    return out


class Fallback:
    """The extracted graph, made a ``GraphModule`` (Python code generated and compiled, about a
    millisecond) only when it first runs: most kernels never fail, and a GPT-2 has ~300 of them."""

    def __init__(self, graph: fx.Graph):
        self.graph, self._gm = graph, None
        self.__name__ = "aten_fallback"   # a graph node's target when its kernel was declined

    @property
    def module(self) -> fx.GraphModule:
        if self._gm is None:
            self._gm = fx.GraphModule({}, self.graph, class_name="KilnFallback")
        return self._gm

    def __call__(self, *args):
        return self.module(*args)
