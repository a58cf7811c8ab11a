"""Splicing a replacement graph in for a match.

* ``replace_with_graph(match, graph, replacement, args)`` copies a traced replacement into ``graph``
  in place of ``match.output_nodes()`` and erases the matched nodes left without users.
* ``replace_by_example(match, fn, args)`` traces ``fn`` on the fake values of ``args`` first.

``Match.replace_with_graph`` and ``Match.replace_by_example`` (``pattern.py``) call these. A match is
used only through ``graph``, ``output_nodes()`` and ``erase_nodes()``, so this module sits below the
patterns and imports none of them.
"""
from __future__ import annotations

import itertools
from typing import Any, Dict, Sequence

import torch
import torch.fx as fx

from kiln.passes.match.fx_lowerings import fake_values, propagate_val
from kiln.passes.match.trace import PatternTraceError, example_value, fwd_only


def _replace_uses(old: fx.Node, new) -> None:
    if isinstance(new, fx.Node):
        old.replace_all_uses_with(new)
        return
    for user in list(old.users):
        user.args = fx.map_arg(user.args, lambda n: new if n is old else n)
        user.kwargs = fx.map_arg(user.kwargs, lambda n: new if n is old else n)


def replace_with_graph(match, graph: fx.Graph, replacement, args: Sequence[Any]) -> bool:
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


def replace_by_example(match, fn, args, trace_fn=None, run_functional_passes=True) -> bool:
    """Trace ``fn`` on the example values of ``args`` and splice the result in for ``match``."""
    mode, vals = fake_values([example_value(a) for a in args])
    with mode:
        if trace_fn is None:
            gm = fwd_only(fn, vals, run_functional_passes=run_functional_passes)
        else:
            gm = trace_fn(fn, vals)
    return replace_with_graph(match, match.graph, gm, args)
