"""FX-level lowerings: ``lowerings[op](*args)`` inserts a call of ``op`` (or what a registered lowering
builds) before the node of ``inserting(graph, before)``, else after its latest FX argument (with neither,
the op runs eagerly), and returns its ``fx.Node``, with a fake value from the arguments' when known.
"""
import contextlib
import contextvars
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.fx as fx


class LoweringError(RuntimeError):
    """A lowering could not place its nodes: the arguments come from different graphs, or a node argument is defined
    after the insertion point. Fix the pattern handler so that it only passes values available at the matched node."""


_INSERT: contextvars.ContextVar[Optional[Tuple[fx.Graph, fx.Node]]] = contextvars.ContextVar(
    "kiln_lowering_insert", default=None)


@contextlib.contextmanager
def inserting(graph: fx.Graph, before: fx.Node):
    """Within this scope, lowerings insert their nodes into ``graph`` just before ``before``."""
    token = _INSERT.set((graph, before))
    try:
        yield
    finally:
        _INSERT.reset(token)


def nodes_in(value) -> list:
    out: list = []
    fx.map_arg(value, lambda n: out.append(n) or n)
    return out


def _meta_key(nodes) -> str:
    """'example_value' for Dynamo's torch-level graphs, 'val' otherwise."""
    return next(("val" if "val" in n.meta else "example_value" for n in nodes
                 if "val" in n.meta or "example_value" in n.meta), "val")


_FALLBACK_MODE = []


def fake_values(values):
    """``(mode, values)`` with every tensor a fake of one ``FakeTensorMode``: as given when they share one,
    else new fakes in a shared fallback mode. ValueError for symbolic sizes from several modes."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    flat, spec = torch.utils._pytree.tree_flatten(values)
    tensors = [v for v in flat if isinstance(v, torch.Tensor)]
    with contextlib.suppress(AssertionError):
        mode = detect_fake_mode(tensors)
        if mode is not None and all(isinstance(t, FakeTensor) for t in tensors):
            return mode, values
    if not _FALLBACK_MODE:
        _FALLBACK_MODE.append(FakeTensorMode(allow_non_fake_inputs=True))
    mode = _FALLBACK_MODE[0]
    out = []
    for v in flat:
        if isinstance(v, torch.Tensor):
            if any(isinstance(s, torch.SymInt) for s in (*v.shape, *v.stride())):
                raise ValueError("symbolic sizes from several fake modes cannot be unified")
            with mode:
                v = torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device=v.device,
                                        requires_grad=v.requires_grad)
        out.append(v)
    return mode, torch.utils._pytree.tree_unflatten(out, spec)


def propagate_val(node: fx.Node) -> None:
    """Set ``node``'s fake value by running its target on its inputs' fake values (best effort)."""
    inputs = nodes_in((node.args, node.kwargs))
    key = _meta_key(inputs)
    if key in node.meta or node.op != "call_function":
        return
    vals = {n: n.meta.get(key) for n in inputs}
    if any(v is None for v in vals.values()):
        return
    try:
        mode, fakes = fake_values(list(vals.values()))
    except ValueError:
        return
    fakes = dict(zip(vals, fakes))
    args, kwargs = fx.map_arg((node.args, node.kwargs), fakes.__getitem__)
    with contextlib.suppress(Exception), mode:   # an op without a fake kernel: the value stays unknown
        node.meta[key] = node.target(*args, **kwargs)


def emit(op, *args, **kwargs):
    """Insert ``op(*args, **kwargs)`` as an FX node and return it (or run it eagerly, see module doc)."""
    # an OpOverloadPacket stands for its ``.default`` overload when it has one
    target = op.default if isinstance(op, torch._ops.OpOverloadPacket) and "default" in op.overloads() else op
    where = _INSERT.get()
    inputs = nodes_in((args, kwargs))
    if where is None:
        if not inputs:
            return target(*args, **kwargs)
        graph = inputs[0].graph
        if any(n.graph is not graph for n in inputs):
            raise LoweringError(f"lowering {op}: arguments come from different graphs")
        last = max(inputs)
        ctx = graph.inserting_after(last)
    else:
        graph, before = where
        late = [n for n in inputs if n.graph is graph and not n < before]
        if late:
            raise LoweringError(f"lowering {op}: argument {late[0].name} is defined after the insertion "
                                f"point {before.name}; pass only values available there")
        ctx = graph.inserting_before(before)
    with ctx:
        node = graph.call_function(target, tuple(args), dict(kwargs))
    propagate_val(node)
    return node


class Lowerings:
    """Op (or its packet) -> lowering function, by default ``emit``; ``register(op)`` installs a custom one."""

    def __init__(self):
        self._table: Dict[Any, Callable] = {}

    def register(self, op, fn: Optional[Callable] = None):
        def deco(f):
            ops = op if isinstance(op, (list, tuple)) else [op]
            for o in ops:
                self._table[o] = f
            return f
        return deco(fn) if fn is not None else deco

    def __getitem__(self, op) -> Callable:
        fn = self._table.get(op)
        if fn is None and isinstance(op, torch._ops.OpOverload):
            fn = self._table.get(op.overloadpacket)
        if fn is not None:
            return fn
        if not callable(op):
            raise KeyError(f"no lowering for {op!r}: not a callable op")
        return lambda *args, **kwargs: emit(op, *args, **kwargs)

    def __contains__(self, op) -> bool:
        return op in self._table or callable(op)


lowerings = Lowerings()
register_lowering = lowerings.register
