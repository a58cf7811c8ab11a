"""Registering rewrites into pattern passes: ``register_graph_pattern``, ``register_lowering_pattern``,
``register_replacement``; traced graphs as patterns (``fx_to_pattern``, ``gen_pattern``, cached).
"""
import inspect
import itertools
from typing import Any, Callable, Dict, Sequence

import torch
import torch.fx as fx

from kiln.debug import log
from kiln.passes.match.entries import (DuplicatePatternError, GraphPatternEntry, LoweringPatternEntry,
                                      PatternMatcherPass, ReplacementPatternEntry, _return_true)
from kiln.passes.match.fx_lowerings import fake_values
from kiln.passes.match.nodes import CallFunction, MultiOutputPattern
from kiln.passes.match.pattern import ExclusiveKeywordArg, Ignored, KeywordArg, PatternExpr
from kiln.passes.match.trace import PatternTraceError, example_value, joint_fwd_bwd, traced
from kiln.options import UserError


def fx_to_pattern(gm, ignore_types=(), argnames=(), scalar_workaround=None, exclusive_arg_names=()) -> PatternExpr:
    """A traced graph as a pattern: placeholders become KeywordArgs (named by ``argnames``, else their
    target), constants of ``ignore_types`` ``Ignored()``, ``scalar_workaround`` floats KeywordArgs."""
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


class PatternError(RuntimeError, UserError):
    """A registered pattern is inconsistent with its search function (an argument of the search function never reaches
    the pattern, so a match cannot bind it). Use every argument, or list the unused one in ``scalar_workaround``."""


def _registrar(entry, doc: str):
    def register(pattern: PatternExpr, extra_check: Callable = _return_true, *, pass_dict, prepend: bool = False):
        def decorator(handler):
            entry(pattern, handler, extra_check).register(pass_dict, prepend=prepend)
            return handler
        return decorator
    register.__doc__ = doc
    return register


register_graph_pattern = _registrar(GraphPatternEntry, "Decorator: ``handler(match, *args, **kwargs)`` edits "
                                                       "the graph for every match of ``pattern``.")
register_lowering_pattern = _registrar(LoweringPatternEntry, "Decorator: ``handler(match, *args, **kwargs)`` returns "
                                                             "the root's replacement, built with ``L[op](...)``.")


def _check_duplicate(pass_dicts, pattern, skip_duplicates: bool) -> bool:
    """Record ``pattern`` in each PatternMatcherPass; False when it is already there and skippable."""
    dicts = [pass_dicts] if isinstance(pass_dicts, (dict, PatternMatcherPass)) else list(pass_dicts)
    text = repr(pattern)
    for d in dicts:
        seen = getattr(d, "seen_patterns", None)
        if seen is None:
            continue
        if text in seen:
            if skip_duplicates:
                return False
            raise DuplicatePatternError(f"{d.name}: pattern already registered:\n{text}")
        seen.add(text)
    return True


def register_replacement(search_fn, replace_fn, example_inputs: Sequence[Any], trace_fn, pass_dicts,
                         extra_check: Callable = _return_true, scalar_workaround=(), exclusive_arg_names=(),
                         search_fn_pattern=None, skip_duplicates: bool = False):
    """Replace each match of ``search_fn``'s graph (traced by ``trace_fn``; shapes, scalars ignored) by
    ``replace_fn``'s, both traced again on the matched shapes (the search must match exactly), after
    ``extra_check``. Returns the pattern, or False when skipped (joint in inference mode, duplicate)."""
    if trace_fn is joint_fwd_bwd and torch.is_inference_mode_enabled():
        return False
    scalar_workaround = dict(scalar_workaround or {})
    argnames, flat = search_inputs(search_fn, example_inputs, scalar_workaround)
    requires_grad = [isinstance(x, torch.Tensor) and x.requires_grad for x in flat]
    pattern = search_fn_pattern or gen_pattern(search_fn, example_inputs, trace_fn, scalar_workaround,
                                               exclusive_arg_names)
    if not _check_duplicate(pass_dicts, pattern, skip_duplicates):
        return False

    def specific_match(args, match):
        """Match the search function traced on ``args`` exactly (only scalars stay KeywordArgs)."""
        gm = traced(search_fn, args, trace_fn)
        scalars = {name: match.kwargs[name] for name in scalar_workaround}
        pattern = fx_to_pattern(gm, argnames=argnames, scalar_workaround=scalars,
                                exclusive_arg_names=exclusive_arg_names)
        sm = pattern.match(match.output_nodes()[0])
        if sm:
            for k, v in match.kwargs.items():
                sm.kwargs.setdefault(k, v)
        return sm

    def check_fn(match) -> bool:
        missing = [n for n in argnames if n not in match.kwargs]
        if missing:
            raise PatternError(f"register_replacement({search_fn.__name__}): arguments {missing} are not in "
                               f"the pattern (bound: {sorted(match.kwargs)})")
        try:
            vals = [example_value(match.kwargs[n]) for n in argnames]
        except PatternTraceError:   # no fake values: only an exact match of the example trace is safe
            sm = specific_match(flat, match)
            ok = bool(sm and extra_check(sm))
            if ok:
                match.replacement_graph = traced(replace_fn, flat, trace_fn)
            return ok
        try:
            mode, vals = fake_values(vals)
        except ValueError:
            return False
        with mode:
            args = []
            for v, grad in zip(vals, requires_grad):
                if isinstance(v, torch.Tensor):
                    if grad and not (v.dtype.is_floating_point or v.dtype.is_complex):
                        return False
                    v = torch.empty_strided(v.size(), v.stride(), dtype=v.dtype, device=v.device, requires_grad=grad)
                args.append(v)
            try:
                sm = specific_match(args, match)
                if not (sm and extra_check(sm)):
                    return False
                match.replacement_graph = traced(replace_fn, args, trace_fn)
            except (PatternError, DuplicatePatternError):
                raise
            except Exception as e:  # e.g. a shape the search function cannot trace with
                log(5, f"register_replacement({search_fn.__name__}): retrace failed: {e}")
                return False
        return True

    def normalize_args(**kwargs):
        args = [kwargs.pop(name) for name in argnames]
        i = 1
        while f"tangents_{i}" in kwargs:
            args.append(kwargs.pop(f"tangents_{i}"))
            i += 1
        if kwargs:
            raise PatternError(f"register_replacement({search_fn.__name__}): leftover bound values {sorted(kwargs)}")
        return args

    ReplacementPatternEntry(pattern, check_fn, normalize_args).register(pass_dicts)
    return pattern
