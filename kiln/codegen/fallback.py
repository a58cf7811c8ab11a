"""Runtime fallback: a kernel call site that can run its group's original ATen nodes instead.

``fuse_graph`` targets each kernel node at a ``KernelCall``: the shared ``kernel.Kernel`` plus a
small ``fx.GraphModule`` (``extract``) that computes the same outputs from the same arguments with
the ATen nodes the group replaced. If the kernel raises on its first call (Triton's
``CompilationError``, ``OutOfResources``, a module that does not import, ...) kiln logs the reason,
counts ``counters['codegen']['runtime_fallback']``, marks the kernel failed and runs the fallback
from then on, at every call site of that kernel. Errors after a kernel has run once propagate.
"""
from __future__ import annotations

import torch.fx as fx

from kiln.debug import counters, log


class NoFallback(Exception):
    """The group's outputs cannot be recomputed from its arguments with the original nodes (an
    output has no graph node, or needs a graph input that is not a kernel argument)."""


def extract(inputs, outputs, multi: bool, position=None) -> "Fallback":
    """A (lazily built) GraphModule computing original nodes ``outputs`` from original nodes ``inputs`` (its
    placeholders, in order), copying every node in between; a tuple when ``multi``.
    ``position``: node -> index in the graph, to order the copies without walking the graph."""
    if any(o is None for o in outputs):
        raise NoFallback("a kernel output is a buffer without a graph node")
    env = {}
    graph = fx.Graph()
    for i, n in enumerate(inputs):
        p = graph.placeholder(f"arg{i}")
        # an input without a graph node (a buffer internal to the lowering) stays unused: the
        # walk below recomputes what it needs from graph nodes, or finds it cannot
        if n is not None and n not in env:
            env[n] = p
    needed, stack = set(), list(outputs)
    while stack:
        n = stack.pop()
        if n in env or n in needed:
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


class Fallback:
    """The extracted graph, made a ``GraphModule`` (Python code generated and compiled, about a
    millisecond) only when it first runs: most kernels never fail, and a GPT-2 has ~300 of them."""

    def __init__(self, graph: fx.Graph):
        self.graph, self._gm = graph, None

    @property
    def module(self) -> fx.GraphModule:
        if self._gm is None:
            self._gm = fx.GraphModule({}, self.graph, class_name="KilnFallback")
        return self._gm

    def __call__(self, *args):
        return self.module(*args)


class KernelCall:
    """The FX target of one kernel node: calls ``kernel``, or ``fallback`` once the kernel failed
    on its first call. Attributes of the kernel (``name``, ``source``...) read through."""

    def __init__(self, kernel, fallback):
        self.kernel, self.fallback = kernel, fallback
        self.__name__ = kernel.name

    def __getattr__(self, attr):
        if attr == "kernel":   # not set yet (unpickling, copying)
            raise AttributeError(attr)
        return getattr(self.kernel, attr)

    def __call__(self, *args, **kwargs):
        """``kwargs``: ``into`` (a buffer the kernel may write its output into), which the fallback,
        computing new tensors, does without."""
        k = self.kernel
        if k.ran:
            return k(*args, **kwargs)
        if k.failed is not None and self.fallback is not None:
            return self.fallback(*args)
        try:
            out = k(*args, **kwargs)
        except Exception as e:
            if self.fallback is None:
                raise
            if k.failed is None:
                k.failed = e
                first = (str(e).strip().splitlines() or [""])[0]
                counters["codegen"]["runtime_fallback"] += 1
                log(1, f"codegen: kernel {k.name} failed on its first call, running its ATen nodes "
                       f"instead ({type(e).__name__}: {first})")
            return self.fallback(*args)
        k.ran = True
        return out

    def __repr__(self):
        return f"<kiln kernel call {self.kernel.name}{'' if self.fallback is not None else ' (no fallback)'}>"
