"""Tracing pattern and replacement functions: ``fwd_only`` (``make_fx``), ``joint_fwd_bwd`` (AOTAutograd's
joint graph), and ``traced``, cached so that registering a pattern again traces nothing (``CACHE_STATS``).
"""
from typing import Any, Dict, Sequence

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from kiln.capture.decomp import decomposition_table

aten = torch.ops.aten


class PatternTraceError(RuntimeError):
    """A search or replacement function could not be turned into a pattern (it uses modules, attributes or methods, or
    its first output is not a call). Write it with torch functions on its arguments only."""


def remove_noop_aliases(graph: fx.Graph) -> int:
    """Drop ``aten.alias`` nodes (AOTAutograd adds them around saved values); return how many."""
    nodes = list(graph.find_nodes(op="call_function", target=aten.alias.default))
    for node in nodes:
        node.replace_all_uses_with(node.args[0])
        graph.erase_node(node)
    return len(nodes)


def fwd_only(fn, args, *, run_functional_passes: bool = True, get_decomp_fn=None) -> fx.GraphModule:
    """Trace ``fn(*args)`` to an ATen graph (with ``make_fx`` and the decomposition table)."""
    decomps = get_decomp_fn() if get_decomp_fn is not None else decomposition_table()
    gm = make_fx(fn, decomps, tracing_mode="real")(*args)
    if run_functional_passes:
        remove_noop_aliases(gm.graph)
        gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


class _JointCaptured(Exception):
    def __init__(self, gm):
        self.gm = gm


def joint_fwd_bwd(fn, args) -> fx.GraphModule:
    """Trace ``fn`` forward and backward into one joint graph (inputs: primals then tangents)."""
    from torch._functorch.aot_autograd import aot_function, make_boxed_func

    def capture(joint, _inputs, **_kw):
        raise _JointCaptured(joint)

    try:
        with torch._guards.tracing(None):
            aot_function(fn, lambda g, _i: make_boxed_func(g), partition_fn=capture,
                         decompositions=decomposition_table(), keep_inference_input_mutations=True)(*args)
    except _JointCaptured as got:
        gm = got.gm
    else:
        raise PatternTraceError("joint_fwd_bwd: no joint graph was produced; give the search function "
                                "at least one input with requires_grad=True")
    remove_noop_aliases(gm.graph)
    gm.graph._codegen = fx.graph.CodeGen()
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


# -- the trace cache ----------------------------------------------------------------------------------
def _fn_key(fn):
    """A cache key for a function that survives re-creation of nested functions and closures."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return ("obj", id(fn))
    cells = []
    for c in fn.__closure__ or ():
        try:
            v = c.cell_contents
            hash(v)
            cells.append(v if not isinstance(v, torch.Tensor) else ("t", id(v)))
        except (TypeError, ValueError):
            cells.append(("id", id(c)))
    return (code, tuple(cells), fn.__defaults__ if _hashable(fn.__defaults__) else id(fn))


def _hashable(v) -> bool:
    try:
        return hash(v) is not None
    except TypeError:
        return False


def _value_key(v):
    if isinstance(v, torch.Tensor):
        return ("T", tuple(v.shape), tuple(v.stride()), v.dtype, v.device.type, v.requires_grad)
    if isinstance(v, (list, tuple)):
        return tuple(_value_key(x) for x in v)
    return (type(v), v) if _hashable(v) else ("id", id(v))


_TRACES: Dict[Any, fx.GraphModule] = {}
CACHE_STATS = {"hits": 0, "traces": 0}


def traced(fn, args: Sequence[Any], trace_fn) -> fx.GraphModule:
    """``trace_fn(fn, args)``, cached on (function, argument metadata, tracer) for concrete shapes."""
    try:
        key = ("gm", _fn_key(fn), _value_key(list(args)), trace_fn)
        hash(key)
    except TypeError:
        key = None
    if any(isinstance(s, torch.SymInt) for a in args if isinstance(a, torch.Tensor) for s in a.shape):
        key = None
    if key is not None and key in _TRACES:
        CACHE_STATS["hits"] += 1
        return _TRACES[key]
    CACHE_STATS["traces"] += 1
    gm = trace_fn(fn, list(args))
    if key is not None:
        _TRACES[key] = gm
    return gm


def example_value(value):
    """The fake value behind an FX argument (``meta['val']`` or ``['example_value']``)."""
    if isinstance(value, fx.Node):
        v = value.meta.get("val", value.meta.get("example_value"))
        if v is None:
            raise PatternTraceError(f"{value.name} has no meta['val']; run fake-tensor propagation first")
        return v
    return type(value)(example_value(v) for v in value) if isinstance(value, (list, tuple)) else value
