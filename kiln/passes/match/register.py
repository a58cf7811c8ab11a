"""Registering rewrites into pattern passes (see ``entries.py`` for how they run).

The top of ``kiln.passes.match``: ``register_graph_pattern``, ``register_lowering_pattern`` and
``register_replacement`` build entries (``entries.py``) from patterns (``pattern.py``, ``nodes.py``,
``to_pattern.py``) and traced functions (``trace.py``).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from kiln.debug import log
from kiln.passes.match.entries import (DuplicatePatternError, GraphPatternEntry, LoweringPatternEntry,
                                      PatternMatcherPass, ReplacementPatternEntry, _return_true)
from kiln.passes.match.fx_lowerings import fake_values
from kiln.passes.match.pattern import PatternExpr
from kiln.passes.match.to_pattern import fx_to_pattern, gen_pattern, search_inputs
from kiln.passes.match.trace import PatternTraceError, example_value, joint_fwd_bwd, traced
from kiln.options import UserError


class PatternError(RuntimeError, UserError):
    """A registered pattern is inconsistent with its search function (an argument of the search
    function never reaches the pattern, so a match cannot bind it). Use every argument, or list
    the unused one in ``scalar_workaround``."""


def register_graph_pattern(pattern: PatternExpr, extra_check: Callable = _return_true, *, pass_dict,
                           prepend: bool = False):
    """Decorator: ``handler(match, *args, **kwargs)`` edits the graph for every match of ``pattern``."""
    def decorator(handler):
        GraphPatternEntry(pattern, handler, extra_check).register(pass_dict, prepend=prepend)
        return handler
    return decorator


def register_lowering_pattern(pattern: PatternExpr, extra_check: Callable = _return_true, *, pass_dict,
                              prepend: bool = False):
    """Decorator: ``handler(match, *args, **kwargs)`` returns the replacement of the match root, built
    with the FX lowerings (``kiln.pattern_matcher.lowerings``: ``L[op](...)`` inserts nodes just before
    the root)."""
    def decorator(handler):
        LoweringPatternEntry(pattern, handler, extra_check).register(pass_dict, prepend=prepend)
        return handler
    return decorator


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
    """Replace every occurrence of ``search_fn``'s graph by ``replace_fn``'s.

    Both are traced with ``trace_fn`` (``fwd_only`` or ``joint_fwd_bwd``) on ``example_inputs``; the
    search graph becomes a pattern with shapes, ints, floats, devices and dtypes ignored (cached, so
    registering again is cheap). At a match, the search function is traced again on the matched
    values' shapes (also cached) and must match exactly; only then ``extra_check(specific_match)``
    runs and ``replace_fn`` is traced on those shapes and spliced in. Floats named in
    ``scalar_workaround`` ({argname: example_float}) are bound as KeywordArgs instead of ignored.
    Returns the search pattern, or False when skipped (a joint pattern under inference mode, or a
    duplicate with ``skip_duplicates=True``).
    """
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
        values = [match.kwargs[n] for n in argnames]
        try:
            vals = [example_value(v) for v in values]
        except PatternTraceError:
            vals = None
        if vals is None:  # no fake values: only an exact match of the example trace is safe
            sm = specific_match(flat, match)
            if sm and extra_check(sm):
                match.replacement_graph = traced(replace_fn, flat, trace_fn)
                return True
            return False
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
                    v = torch.empty_strided(v.size(), v.stride(), dtype=v.dtype, device=v.device,
                                            requires_grad=grad)
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
