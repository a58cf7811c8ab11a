"""The ATen fallback of a kernel (``extract``): the original nodes its group replaced, as a small graph
computing the same outputs from the same arguments, run if the kernel fails on its first call.
"""
import torch
import torch.fx as fx


class NoFallback(Exception):
    """The group's outputs cannot be recomputed from its arguments with the original nodes (an
    output has no graph node, or needs a graph input that is not a kernel argument)."""


def extract(inputs, outputs, multi: bool, position=None) -> "Fallback":
    """A (lazily built) GraphModule computing original nodes ``outputs`` from ``inputs`` (its placeholders,
    in order), copying every node in between; a tuple when ``multi``. ``position``: node -> graph index."""
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
    needed = set()
    for n in _upstream(outputs, env):
        if n.op != "call_function" and size_expr(n) in sizes:
            env[n] = sizes[size_expr(n)]   # a size placeholder: the argument of the same size
            continue
        if n.op != "call_function":
            raise NoFallback(f"{n.name} ({n.op}) is needed but is not a kernel argument")
        needed.add(n)
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
    return [n for n in _upstream([o for o in outputs if o is not None], set(inputs)) if n.op == "placeholder"]


def _upstream(outputs, stop):
    """The nodes ``outputs`` are computed from, depth first, up to those of ``stop`` (through calls only)."""
    seen, stack = set(), list(outputs)
    while stack:
        n = stack.pop()
        if n not in stop and n not in seen:
            seen.add(n)
            yield n
            if n.op == "call_function":
                stack.extend(n.all_input_nodes)


class Fallback:
    """The extracted graph, made a ``GraphModule`` (about a millisecond) only when it first runs."""

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
