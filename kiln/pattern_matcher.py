"""``kiln.pattern_matcher``: the pattern-matching API in one import (the names Inductor's users know).

Patterns: ``Arg, Ignored, KeywordArg, ExclusiveKeywordArg, CallFunction, CallMethod, CallModule,
ListOf, MultiOutputPattern, MULTIPLE``. Passes: ``PatternMatcherPass``. Registration:
``register_graph_pattern, register_lowering_pattern, register_replacement``; tracers ``fwd_only``,
``joint_fwd_bwd``. FX-level lowerings used by lowering patterns: ``lowerings`` (``L[op](...)``),
``register_lowering``. ``CACHE_STATS`` counts pattern traces and trace-cache hits. The engine lives in
``kiln/passes/match/``.
"""
from kiln.passes.match.entries import (DuplicatePatternError, GraphPatternEntry,  # noqa: F401
                                       LoweringPatternEntry, PatternEntry, PatternMatcherPass,
                                       ReplacementPatternEntry)
from kiln.passes.match.fx_lowerings import LoweringError, lowerings, register_lowering  # noqa: F401
from kiln.passes.match.nodes import CallFunction, CallMethod, CallModule, ListOf, MultiOutputPattern  # noqa: F401
from kiln.passes.match.pattern import (MULTIPLE, Arg, ExclusiveKeywordArg, FailedMatch, Ignored,  # noqa: F401
                                       KeywordArg, Match, MatchContext, PatternExpr, is_match)
from kiln.passes.match.register import (PatternError, register_graph_pattern,  # noqa: F401
                                        register_lowering_pattern, register_replacement)
from kiln.passes.match.replace import replace_with_graph  # noqa: F401
from kiln.passes.match.to_pattern import fx_to_pattern, gen_pattern  # noqa: F401
from kiln.passes.match.trace import (CACHE_STATS, PatternTraceError, fwd_only, joint_fwd_bwd,  # noqa: F401
                                     remove_noop_aliases)

__all__ = [
    "Arg", "CallFunction", "CallMethod", "CallModule", "DuplicatePatternError", "ExclusiveKeywordArg",
    "FailedMatch", "GraphPatternEntry", "Ignored", "KeywordArg", "ListOf", "LoweringError",
    "LoweringPatternEntry", "MULTIPLE", "Match", "MatchContext", "MultiOutputPattern", "PatternEntry",
    "PatternError", "PatternExpr", "PatternMatcherPass", "PatternTraceError", "ReplacementPatternEntry",
    "fwd_only", "fx_to_pattern", "gen_pattern", "is_match", "joint_fwd_bwd", "lowerings",
    "register_graph_pattern", "register_lowering", "register_lowering_pattern", "register_replacement",
    "remove_noop_aliases", "replace_with_graph",
]
