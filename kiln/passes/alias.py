"""Which storages each FX node may live in and which it writes, so that mutations block only the rewrites
(CSE, the pattern matcher) they affect. ATen graphs: the schemas' alias annotations decide (real-mode
``make_fx`` loses views in ``meta['val']``). Dynamo's graphs: fake values share storages exactly when they
alias; writes are read from names (``add_``, ``inplace=True``, ``out=``, ``setitem``). ``symbolic_trace``
graphs: torch functions resolve to the ATen op of the same name; an unknown callable may alias its inputs.
"""
import contextlib
import functools
import itertools
import operator
from typing import Dict, FrozenSet, List, Tuple

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

aten = torch.ops.aten
EMPTY: FrozenSet = frozenset()

INPLACE_OPERATORS = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                     operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior,
                     operator.ixor, operator.ilshift, operator.irshift, operator.imatmul, operator.delitem}
# torch-level ops known to return a view of (or the same object as) their first argument
PASSTHROUGH = {operator.getitem}


def target_name(node: fx.Node) -> str:
    """The op's short name: ``aten.add_.Tensor`` -> ``add_``, ``torch.rand`` -> ``rand``."""
    t = node.target
    if isinstance(t, str):
        if node.op == "call_module" and node.graph.owning_module is not None:
            try:
                return type(node.graph.owning_module.get_submodule(t)).__name__.lower()
            except AttributeError:
                return t
        return t
    if isinstance(t, torch._ops.OpOverload):
        return t.overloadpacket.__name__
    if isinstance(t, torch._ops.OpOverloadPacket):
        return t.__name__
    return getattr(t, "__name__", "") or ""


def _aten_packet(name: str):
    if not name or name.startswith("__"):
        return None
    try:
        pkt = getattr(aten, name)
    except (AttributeError, RuntimeError):
        return None
    return pkt if isinstance(pkt, torch._ops.OpOverloadPacket) else None


def _overloads(node: fx.Node) -> List[torch._ops.OpOverload]:
    """ATen overloads that describe ``node``'s target (empty when unknown)."""
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return [t]
    if isinstance(t, torch._ops.OpOverloadPacket):
        pkt = t
    elif node.op == "call_method" or (node.op == "call_function" and _is_torch_callable(t)):
        pkt = _aten_packet(target_name(node))
    else:
        return []
    out = []
    for name in pkt.overloads() if pkt is not None else ():
        with contextlib.suppress(AttributeError, RuntimeError):
            out.append(getattr(pkt, name))
    return out


def _is_torch_callable(t) -> bool:
    """torch.*, torch.nn.functional.*, Tensor methods and the operator module."""
    if isinstance(t, type(torch.Tensor.add)):  # method_descriptor of TensorBase
        return True
    mod = getattr(t, "__module__", None) or ""
    return mod == "_operator" or mod == "torch" or mod.startswith("torch.nn.functional") or mod in (
        "torch._C._nn", "torch._C._linalg", "torch._C._special", "torch._C._fft", "torch.functional")


def _arg_by_schema(node: fx.Node, index: int, name: str):
    return node.args[index] if index < len(node.args) else node.kwargs.get(name)


def _nodes_in(value) -> List[fx.Node]:
    """FX nodes inside an argument (nested lists, tuples, dicts, slices)."""
    if type(value) is fx.Node:
        return [value]
    out: List[fx.Node] = []
    stack = [value]
    while stack:
        v = stack.pop()
        if type(v) is fx.Node:
            out.append(v)
        elif isinstance(v, (list, tuple)):
            stack.extend(reversed(v))
        elif isinstance(v, dict):
            stack.extend(reversed(list(v.values())))
        elif isinstance(v, slice):
            stack.extend((v.step, v.stop, v.start))
    return out


@functools.lru_cache(maxsize=None)
def schema_aliasing(op: torch._ops.OpOverload) -> Tuple[tuple, tuple, bool]:
    """``(written, aliased, returns_alias)``: the ``(index, name)`` of the arguments an ATen overload writes, of
    those with any alias annotation, and whether a return aliases."""
    args = op._schema.arguments
    written = tuple((i, a.name) for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write)
    aliased = tuple((i, a.name) for i, a in enumerate(args) if a.alias_info is not None)
    return written, aliased, any(r.alias_info is not None for r in op._schema.returns)


def written_args(node: fx.Node) -> List[fx.Node]:
    """The FX nodes whose storage ``node`` writes (empty for functional nodes)."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return []
    t = node.target
    schema_ops = _overloads(node) if isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) else []
    out: List[fx.Node] = []
    for op in schema_ops:
        for i, name in schema_aliasing(op)[0]:
            out += _nodes_in(_arg_by_schema(node, i, name))
    if schema_ops:
        return out
    name, mod = target_name(node), None
    if node.op == "call_module" and node.graph.owning_module is not None:
        with contextlib.suppress(AttributeError):
            mod = node.graph.owning_module.get_submodule(t)
    if (t in INPLACE_OPERATORS or (name.endswith("_") and not name.endswith("__"))
            or node.kwargs.get("inplace") is True or getattr(mod, "inplace", False)):
        out += _nodes_in(node.args[0] if node.args else node.kwargs.get("input", node.kwargs.get("self")))
    if "out" in node.kwargs:
        out += _nodes_in(node.kwargs["out"])
    return out


def _val(node: fx.Node):
    return node.meta["val"] if "val" in node.meta else node.meta.get("example_value")


def _val_storages(val) -> FrozenSet:
    if isinstance(val, torch.Tensor):
        if val.is_sparse or getattr(val, "is_nested", False):
            return frozenset([("t", id(val))])
        try:
            return frozenset([StorageWeakRef(val.untyped_storage())])
        except Exception:  # tensors without storage (functional wrappers, subclasses)
            return frozenset([("t", id(val))])
    if isinstance(val, (list, tuple)):
        return frozenset().union(*(_val_storages(v) for v in val)) if val else EMPTY
    return EMPTY


class AliasAnalysis:
    """Storages per node (``storages[n]``), written per node (``writes[n]``) and written anywhere (``mutated``)."""

    def __init__(self, graph: fx.Graph):
        self._fresh = itertools.count()
        self.storages: Dict[fx.Node, FrozenSet] = {}
        self.writes: Dict[fx.Node, FrozenSet] = {}
        for node in graph.nodes:
            self.add(node)
        self.mutated: FrozenSet = frozenset().union(*self.writes.values()) if self.writes else EMPTY

    def of(self, value) -> FrozenSet:
        """Storages of an FX argument (a node, or a list/tuple/dict holding nodes)."""
        if isinstance(value, fx.Node):
            s = self.storages.get(value)
            if s is None:  # a node created after the analysis: be conservative
                self.add(value)
                s = self.storages[value]
            return s
        nodes = _nodes_in(value)
        return frozenset().union(*(self.of(n) for n in nodes)) if nodes else EMPTY

    def reads(self, node: fx.Node) -> FrozenSet:
        return self.of((node.args, node.kwargs))

    def add(self, node: fx.Node) -> None:
        self.storages[node] = self._compute(node)
        t = node.target
        if isinstance(t, torch._ops.OpOverload) and not schema_aliasing(t)[0]:
            return
        w = written_args(node)
        if w:
            self.writes[node] = frozenset().union(*(self.of(n) for n in w))

    def _new(self) -> FrozenSet:
        return frozenset([next(self._fresh)])

    def _compute(self, node: fx.Node) -> FrozenSet:
        if node.op == "output":
            return EMPTY
        t = node.target
        if isinstance(t, torch._ops.OpOverload):
            return self._from_schema(node, t)
        if t in PASSTHROUGH and node.args and isinstance(node.args[0], fx.Node):
            src = node.args[0]
            if isinstance(src.target, torch._ops.OpOverload) or _val(src) is None or _val(node) is None:
                return self.of(src)
        val = _val(node)
        if val is not None:
            return _val_storages(val)
        if node.op in ("placeholder", "get_attr"):
            return self._new()
        written = written_args(node)
        if written:  # in-place ops (add_, inplace=True, out=) return what they wrote
            return self._new() | self.of(written)
        ops = [op for op in _overloads(node) if not op._schema.is_mutable]
        if ops and not any(r.alias_info for op in ops for r in op._schema.returns):
            return self._new()
        # unknown callable: it may return any of its inputs
        return self._new() | self.of((node.args, node.kwargs))

    def _from_schema(self, node: fx.Node, op: torch._ops.OpOverload) -> FrozenSet:
        _, aliased, returns_alias = schema_aliasing(op)
        out = self._new()
        for i, name in aliased if returns_alias else ():
            out = out | self.of(_arg_by_schema(node, i, name))
        return out


def storages_of_outputs(graph: fx.Graph, analysis: AliasAnalysis) -> FrozenSet:
    out = EMPTY
    for node in graph.find_nodes(op="output"):
        out = out | analysis.of(node.args)
    return out
