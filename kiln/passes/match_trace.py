"""Patterns written as Python functions: tracing them, turning graphs into patterns, splicing.

* ``fwd_only(fn, args)`` traces ``fn`` with ``make_fx`` and kiln's decompositions;
  ``joint_fwd_bwd(fn, args)`` traces forward and backward together with AOTAutograd (the graph
  kiln's joint passes see: ``primals``, ``tangents_1..``, outputs then gradients).
* ``fx_to_pattern(gm)`` turns a traced graph into a pattern; ``gen_pattern`` does both and caches
  the result, so registering the same pattern again (every compile, say) traces nothing.
* ``replace_with_graph`` splices a traced replacement in for a match; ``replace_by_example``
  traces the replacement on the match's fake values first.
"""
from __future__ import annotations

import functools
import inspect
import itertools
from typing import Any, Dict, Sequence

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from kiln.lowerings import fake_values, propagate_val
from kiln.passes.match import (CallFunction, ExclusiveKeywordArg, Ignored, KeywordArg, Match,
                               MultiOutputPattern, PatternExpr)

aten = torch.ops.aten


class PatternTraceError(RuntimeError):
    """A search or replacement function could not be turned into a pattern (it uses modules,
    attributes or methods, or its first output is not a call). Write it with torch functions on its
    arguments only."""


@functools.lru_cache(maxsize=1)
def _core_table():
    return dict(torch._decomp.core_aten_decompositions())


def decomposition_table() -> Dict[Any, Any]:
    """kiln's table (``kiln.capture.decomp.decomposition_table()``) when it exists, else core ATen's."""
    try:
        from kiln.capture.decomp import decomposition_table as kiln_table
    except ImportError:
        return _core_table()
    return kiln_table()


def remove_noop_aliases(graph: fx.Graph) -> int:
    """Drop ``aten.alias`` nodes (AOTAutograd adds them around saved values); return how many."""
    count = 0
    for node in list(graph.find_nodes(op="call_function", target=aten.alias.default)):
        node.replace_all_uses_with(node.args[0])
        graph.erase_node(node)
        count += 1
    return count


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


def fx_to_pattern(gm, ignore_types=(), argnames=(), scalar_workaround=None,
                  exclusive_arg_names=()) -> PatternExpr:
    """Convert a traced graph to a pattern: placeholders become KeywordArgs named by ``argnames``
    (else by their target, e.g. ``tangents_1``), constants of ``ignore_types`` become ``Ignored()``,
    floats listed in ``scalar_workaround`` become KeywordArgs, each call keeps its user count."""
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    inv_scalar = {v: k for k, v in (scalar_workaround or {}).items()}
    argnum = itertools.count()
    env: Dict[fx.Node, Any] = {}

    def process_arg(x):
        if isinstance(x, fx.Node):
            return env[x]
        if isinstance(x, float) and x in inv_scalar:
            return KeywordArg(inv_scalar[x])
        if isinstance(x, (list, tuple)):
            items = [process_arg(v) for v in x]
            if items and all(isinstance(v, Ignored) for v in items):
                return Ignored()
            if type(x) in ignore_types or list in ignore_types and isinstance(x, list):
                return [v if isinstance(v, PatternExpr) else Ignored() for v in items] or Ignored()
            return type(x)(items) if isinstance(x, tuple) else items
        if type(x) in ignore_types:
            return Ignored()
        return x

    output = None
    for node in graph.nodes:
        if node.op == "placeholder":
            n = next(argnum)
            name = argnames[n] if n < len(argnames) else node.target
            env[node] = ExclusiveKeywordArg(name) if name in exclusive_arg_names else KeywordArg(name)
        elif node.op == "call_function":
            args = tuple(process_arg(a) for a in node.args)
            kwargs = {k: process_arg(v) for k, v in node.kwargs.items()}
            env[node] = CallFunction(node.target, *args, _users=len(node.users), **kwargs)
        elif node.op == "output":
            output = node.args[0]
        else:
            raise PatternTraceError(f"fx_to_pattern: {node.op} {node.target} cannot be part of a pattern")
    if isinstance(output, (list, tuple)):
        outs = [env[o] if isinstance(o, fx.Node) else None for o in output]
        if len(outs) == 1:
            return outs[0]
        if not isinstance(outs[0], CallFunction):
            raise PatternTraceError(f"fx_to_pattern: the first output must be a computed value, got {outs[0]!r}")
        return MultiOutputPattern(outs)
    return env[output]


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
        hash(v)
        return True
    except TypeError:
        return False


def _value_key(v):
    if isinstance(v, torch.Tensor):
        return ("T", tuple(v.shape), tuple(v.stride()), v.dtype, v.device.type, v.requires_grad)
    if isinstance(v, (list, tuple)):
        return tuple(_value_key(x) for x in v)
    return (type(v), v) if _hashable(v) else ("id", id(v))


_PATTERN_CACHE: Dict[Any, Any] = {}
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
    if key is not None and key in _PATTERN_CACHE:
        CACHE_STATS["hits"] += 1
        return _PATTERN_CACHE[key]
    CACHE_STATS["traces"] += 1
    gm = trace_fn(fn, list(args))
    if key is not None:
        _PATTERN_CACHE[key] = gm
    return gm


def search_inputs(search_fn, example_inputs, scalar_workaround) -> tuple:
    """Argument names of ``search_fn`` and its flat inputs (scalar_workaround values filled in)."""
    argnames = list(inspect.signature(search_fn).parameters)
    scalar_workaround = dict(scalar_workaround or {})
    it = iter(example_inputs)
    flat = [scalar_workaround[name] if name in scalar_workaround else next(it) for name in argnames]
    return argnames, flat


def gen_pattern(search_fn, example_inputs, trace_fn, scalar_workaround=(), exclusive_arg_names=(),
                ignore_types=(int, float, list, torch.device, torch.dtype)) -> PatternExpr:
    """Trace ``search_fn`` (cached) and convert it to a pattern with shapes and scalars ignored."""
    argnames, flat = search_inputs(search_fn, example_inputs, scalar_workaround)
    gm = traced(search_fn, flat, trace_fn)
    key = ("pattern", id(gm), tuple(sorted(dict(scalar_workaround or {}).items())),
           tuple(exclusive_arg_names), tuple(ignore_types))
    if key not in _PATTERN_CACHE or _PATTERN_CACHE[key][0] is not gm:
        pattern = fx_to_pattern(gm, ignore_types=ignore_types, argnames=argnames,
                                scalar_workaround=dict(scalar_workaround or {}),
                                exclusive_arg_names=exclusive_arg_names)
        _PATTERN_CACHE[key] = (gm, pattern)
    return _PATTERN_CACHE[key][1]


def _replace_uses(old: fx.Node, new) -> None:
    if isinstance(new, fx.Node):
        old.replace_all_uses_with(new)
        return
    for user in list(old.users):
        user.args = fx.map_arg(user.args, lambda n: new if n is old else n)
        user.kwargs = fx.map_arg(user.kwargs, lambda n: new if n is old else n)


def replace_with_graph(match: Match, graph: fx.Graph, replacement, args: Sequence[Any]) -> bool:
    """Splice ``replacement`` (GraphModule or Graph; its placeholders bind ``args`` in order) in place
    of ``match.output_nodes()``, then erase matched nodes left without users.

    New nodes go just before the first matched output when every argument is defined there;
    otherwise (joint graphs, where a tangent is computed after the forward output) each new node
    goes right after its latest input. Returns False, leaving the graph as it was, when a new
    output would still come after a user of the output it replaces.
    """
    rgraph = replacement.graph if isinstance(replacement, fx.GraphModule) else replacement
    outputs = match.output_nodes()
    first_out = min(n for n in outputs if n is not None)
    arg_nodes = [n for n in _nodes(args) if n.graph is graph]
    simple = not arg_nodes or max(arg_nodes) < first_out
    env: Dict[fx.Node, Any] = {}
    placeholders = iter(args)
    inserted: list = []
    result = None
    for n in rgraph.nodes:
        if n.op == "placeholder":
            env[n] = next(placeholders)
        elif n.op == "output":
            result = fx.map_arg(n.args[0], env.__getitem__)
        else:
            inputs = [x for x in _nodes(fx.map_arg((n.args, n.kwargs), env.__getitem__)) if x.graph is graph]
            where = (graph.inserting_before(first_out) if simple or not inputs
                     else graph.inserting_after(max(inputs)))
            with where:
                env[n] = new = _copy_in(graph, replacement, n, env)
            inserted.append(new)
    results = list(result) if isinstance(result, (list, tuple)) else [result]
    if len(outputs) == 1 and len(results) != 1:
        results = [result]
    pairs = [(old, new) for old, new in zip(outputs, results) if old is not None and new is not None and old is not new]
    if any(isinstance(new, fx.Node) and not all(new < u for u in old.users) for old, new in pairs):
        for node in reversed(inserted):
            graph.erase_node(node)
        return False
    for old, new in pairs:
        _replace_uses(old, new)
    match.erase_nodes()
    return True


def _copy_in(graph: fx.Graph, replacement, n: fx.Node, env) -> fx.Node:
    """Copy one replacement node into ``graph`` at the current insertion point."""
    if n.op == "get_attr":
        value = getattr(replacement, n.target, None) if isinstance(replacement, fx.GraphModule) else None
        owner = graph.owning_module
        if owner is None or value is None:
            raise PatternTraceError("the replacement needs a constant but the graph has no owning module")
        name = _free_attr(owner, "_kiln_constant")
        if isinstance(value, torch.Tensor):
            owner.register_buffer(name, value, persistent=False)
        else:
            setattr(owner, name, value)
        return graph.get_attr(name)
    new = graph.node_copy(n, env.__getitem__)
    # the traced values may belong to another fake mode (cached traces): recompute them
    new.meta.pop("val", None)
    new.meta.pop("tensor_meta", None)
    propagate_val(new)
    return new


def _nodes(value) -> list:
    out: list = []
    fx.map_arg(value, lambda n: out.append(n) or n)
    return out


def _free_attr(owner, prefix: str) -> str:
    for i in itertools.count():
        if not hasattr(owner, f"{prefix}{i}"):
            return f"{prefix}{i}"


def example_value(value):
    """The fake value behind an FX argument (``meta['val']`` or ``['example_value']``)."""
    if isinstance(value, fx.Node):
        v = value.meta.get("val", value.meta.get("example_value"))
        if v is None:
            raise PatternTraceError(f"{value.name} has no meta['val']; run fake-tensor propagation first")
        return v
    if isinstance(value, (list, tuple)):
        return type(value)(example_value(v) for v in value)
    return value


def replace_by_example(match: Match, fn, args, trace_fn=None, run_functional_passes=True) -> bool:
    """Trace ``fn`` on the example values of ``args`` and splice the result in for ``match``."""
    mode, vals = fake_values([example_value(a) for a in args])
    with mode:
        if trace_fn is None:
            gm = fwd_only(fn, vals, run_functional_passes=run_functional_passes)
        else:
            gm = trace_fn(fn, vals)
    return replace_with_graph(match, match.graph, gm, args)
