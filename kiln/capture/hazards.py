"""Dynamo graphs that torch's own capture gets wrong, which kiln runs as eager does: a write through a view of
``unfold`` (AOTAutograd's ``unfold_backward`` write-back zeroes elements no window covers: fuzz seed 10
#4399), a write into an input sharing memory with another (synthetic bases: seed 13 #3204, #603).
"""
import operator

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

# methods and functions whose result shares its input's memory (first argument)
_VIEWS = {"view", "view_as", "reshape", "reshape_as", "t", "transpose", "permute", "select", "narrow", "diagonal",
          "squeeze", "unsqueeze", "expand", "expand_as", "flatten", "unflatten", "unfold", "as_strided", "movedim",
          "swapaxes", "swapdims", "unbind", "split", "chunk", "real", "imag", "view_as_real", "view_as_complex",
          "__getitem__", "getitem", "contiguous", "detach", "T", "mT", "mH", "H"}
_INPLACE_OPS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift,
                operator.irshift, operator.setitem}


def _name(n: fx.Node) -> str:
    return n.target if n.op == "call_method" else getattr(n.target, "__name__", "") if n.op == "call_function" else ""


def _writes(n: fx.Node) -> bool:
    name = _name(n)
    return (n.op == "call_function" and n.target in _INPLACE_OPS or n.kwargs.get("inplace") is True
            or "out" in n.kwargs or name.endswith("_") and not name.endswith("__") and name != "requires_grad_")


def upstream_hazard(gm: fx.GraphModule, example_inputs=()) -> str:
    """Why AOTAutograd would compute ``gm`` wrongly ('' when no known hazard is there)."""
    shared = _sharing_inputs(gm, example_inputs)
    unfolded, root = set(), {}   # nodes viewing the result of an unfold; node -> the input it views
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            root[n] = n
        if n.op not in ("call_method", "call_function") or not n.args or not isinstance(n.args[0], fx.Node):
            continue
        base, name = n.args[0], _name(n)
        if name == "unfold" or (name in _VIEWS and base in unfolded):
            unfolded.add(n)
        if name in _VIEWS and base in root:
            root[n] = root[base]
        elif _writes(n) and base in unfolded:
            return (f"an in-place write ({name} at node {n.name}) through a view of unfold: AOTAutograd writes "
                    "it back with unfold_backward, which drops the elements no window covers (a torch bug)")
        elif _writes(n) and root.get(base) in shared:
            return (f"an in-place write ({name} at node {n.name}) into input {root[base].name}, whose memory "
                    "other inputs share: AOTAutograd's synthetic bases can return wrong shapes and values")
    return ""


def _sharing_inputs(gm: fx.GraphModule, example_inputs) -> set:
    groups = {}
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n, x in zip(holders, example_inputs):
        if isinstance(x, torch.Tensor) and x.layout == torch.strided:
            try:
                key = StorageWeakRef(x.untyped_storage())
            except (NotImplementedError, RuntimeError):   # tensors without a storage (subclasses)
                continue
            groups.setdefault(key, []).append(n)
    return {n for group in groups.values() if len(group) > 1 for n in group}
