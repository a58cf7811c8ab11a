"""FX-level lowerings for lowering patterns: ``lowerings[op](*args)`` inserts FX nodes and returns the new node.

Not the loop-IR lowerings of ``kiln/codegen`` (FX nodes -> loops): this table stays in FX. Inductor's
lowerings build its loop IR; kiln's graph-level lowering patterns stay in FX, so a lowering here emits
a call of ``op`` (or of whatever a registered lowering builds, e.g. a decomposition) at the current
insertion point and returns the resulting ``fx.Node``::

    from kiln.pattern_matcher import lowerings as L      # also kiln.lowerings.lowerings
    L[aten.relu](x)                                        # -> relu node
    L[torch.ops.mkldnn._convolution_pointwise.default](x, w, b, pad, stride, dil, 1, "relu", [], "")

The insertion point is set by ``inserting(graph, before=node)`` (lowering patterns do this for
their handler); without one, nodes go right after the latest FX node among the arguments. With no
FX node among the arguments and no insertion point, the op simply runs eagerly.
New nodes get ``meta['val']`` (or ``'example_value'`` in Dynamo graphs) by running the op on the
arguments' fake values when those are known (``fake_values``, ``propagate_val``: also used by the
rest of the pattern matcher). The bottom of ``kiln.passes.match``: it imports nothing from kiln.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.fx as fx


class LoweringError(RuntimeError):
    """A lowering could not place its nodes: the arguments come from different graphs, or a
    node argument is defined after the insertion point. Fix the pattern handler so that it only
    passes values available at the matched node."""


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


def _nodes_in(value) -> list:
    out: list = []
    fx.map_arg(value, lambda n: out.append(n) or n)
    return out


def _meta_key(graph: fx.Graph, nodes) -> str:
    """'example_value' for Dynamo's torch-level graphs, 'val' otherwise."""
    for n in nodes:
        if "val" in n.meta:
            return "val"
        if "example_value" in n.meta:
            return "example_value"
    return "val"


_FALLBACK_MODE = []


def fake_values(values):
    """``(mode, values)`` with every tensor of ``values`` a fake tensor of one ``FakeTensorMode``.

    Values already in a single mode are returned as they are; otherwise (real tensors, or the
    per-node modes ``make_fx`` leaves in real tracing mode) fresh fakes with the same size, stride,
    dtype and device are made in a shared fallback mode. Raises ValueError for symbolic sizes
    spread over several modes.
    """
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    flat, spec = torch.utils._pytree.tree_flatten(values)
    tensors = [v for v in flat if isinstance(v, torch.Tensor)]
    try:
        mode = detect_fake_mode(tensors)
        if mode is not None and all(isinstance(t, FakeTensor) for t in tensors):
            return mode, values
    except AssertionError:
        pass
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
    inputs = _nodes_in((node.args, node.kwargs))
    key = _meta_key(node.graph, inputs)
    if key in node.meta or node.op != "call_function":
        return
    vals = {}
    for n in inputs:
        v = n.meta.get(key)
        if v is None:
            return
        vals[n] = v
    try:
        mode, fakes = fake_values(list(vals.values()))
    except ValueError:
        return
    fakes = dict(zip(vals, fakes))
    args, kwargs = fx.map_arg((node.args, node.kwargs), fakes.__getitem__)
    try:
        with mode:
            node.meta[key] = node.target(*args, **kwargs)
    except Exception:  # an op without a fake kernel: leave the value unknown
        pass


def _resolve(op):
    """An OpOverloadPacket stands for its ``.default`` overload when it has one."""
    if isinstance(op, torch._ops.OpOverloadPacket) and "default" in op.overloads():
        return op.default
    return op


def emit(op, *args, **kwargs):
    """Insert ``op(*args, **kwargs)`` as an FX node and return it (or run it eagerly, see module doc)."""
    target = _resolve(op)
    where = _INSERT.get()
    inputs = _nodes_in((args, kwargs))
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
    """Op -> lowering function. Every op has a lowering: by default, ``emit`` a call of it.

    ``register(op)`` (a decorator) installs a custom lowering, e.g. one that emits a decomposition
    through other lowerings. Lookup tries the op, then its overload packet.
    """

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

    def registered(self):
        """The ops with a custom lowering."""
        return list(self._table)


lowerings = Lowerings()
register_lowering = lowerings.register
