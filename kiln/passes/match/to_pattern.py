"""Traced graphs as patterns: patterns written as Python functions.

* ``fx_to_pattern(gm)`` turns a traced graph into a pattern.
* ``gen_pattern(search_fn, example_inputs, trace_fn)`` traces ``search_fn`` (``trace.traced``, cached)
  and converts it once, so registering the same pattern again (every compile, say) builds nothing.
"""
from __future__ import annotations

import inspect
import itertools
from typing import Any, Dict

import torch
import torch.fx as fx

from kiln.passes.match.nodes import CallFunction, MultiOutputPattern
from kiln.passes.match.pattern import ExclusiveKeywordArg, Ignored, KeywordArg, PatternExpr
from kiln.passes.match.trace import PatternTraceError, traced


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


def search_inputs(search_fn, example_inputs, scalar_workaround) -> tuple:
    """Argument names of ``search_fn`` and its flat inputs (scalar_workaround values filled in)."""
    argnames = list(inspect.signature(search_fn).parameters)
    scalar_workaround = dict(scalar_workaround or {})
    it = iter(example_inputs)
    flat = [scalar_workaround[name] if name in scalar_workaround else next(it) for name in argnames]
    return argnames, flat


_PATTERNS: Dict[Any, Any] = {}   # (id of the traced graph, conversion arguments) -> (graph, pattern)


def gen_pattern(search_fn, example_inputs, trace_fn, scalar_workaround=(), exclusive_arg_names=(),
                ignore_types=(int, float, list, torch.device, torch.dtype)) -> PatternExpr:
    """Trace ``search_fn`` (cached) and convert it to a pattern with shapes and scalars ignored."""
    argnames, flat = search_inputs(search_fn, example_inputs, scalar_workaround)
    gm = traced(search_fn, flat, trace_fn)
    key = ("pattern", id(gm), tuple(sorted(dict(scalar_workaround or {}).items())),
           tuple(exclusive_arg_names), tuple(ignore_types))
    if key not in _PATTERNS or _PATTERNS[key][0] is not gm:
        pattern = fx_to_pattern(gm, ignore_types=ignore_types, argnames=argnames,
                                scalar_workaround=dict(scalar_workaround or {}),
                                exclusive_arg_names=exclusive_arg_names)
        _PATTERNS[key] = (gm, pattern)
    return _PATTERNS[key][1]
