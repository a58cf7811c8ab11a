"""``kiln.pattern_matcher``: the pattern-matching API in one import (the names Inductor's users know).

Patterns: ``Arg, Ignored, KeywordArg, ExclusiveKeywordArg, CallFunction, CallMethod, CallModule,
ListOf, MultiOutputPattern, MULTIPLE``. Passes: ``PatternMatcherPass``. Registration:
``register_graph_pattern, register_lowering_pattern, register_replacement``; tracers ``fwd_only``,
``joint_fwd_bwd``. Lowerings used by lowering patterns: ``kiln.lowerings.lowerings``.
"""
from kiln.lowerings import LoweringError, lowerings, register_lowering  # noqa: F401
from kiln.passes.match import (MULTIPLE, Arg, CallFunction, CallMethod, CallModule,  # noqa: F401
                               ExclusiveKeywordArg, FailedMatch, Ignored, KeywordArg, ListOf, Match,
                               MatchContext, MultiOutputPattern, PatternExpr, is_match)
from kiln.passes.match_pass import (DuplicatePatternError, GraphPatternEntry,  # noqa: F401
                                    LoweringPatternEntry, PatternEntry, PatternMatcherPass,
                                    ReplacementPatternEntry)
from kiln.passes.match_register import (PatternError, register_graph_pattern,  # noqa: F401
                                        register_lowering_pattern, register_replacement)
from kiln.passes.match_trace import (PatternTraceError, fwd_only, fx_to_pattern, gen_pattern,  # noqa: F401
                                     joint_fwd_bwd, remove_noop_aliases, replace_with_graph)

__all__ = [
    "Arg", "CallFunction", "CallMethod", "CallModule", "DuplicatePatternError", "ExclusiveKeywordArg",
    "FailedMatch", "GraphPatternEntry", "Ignored", "KeywordArg", "ListOf", "LoweringError",
    "LoweringPatternEntry", "MULTIPLE", "Match", "MatchContext", "MultiOutputPattern", "PatternEntry",
    "PatternError", "PatternExpr", "PatternMatcherPass", "PatternTraceError", "ReplacementPatternEntry",
    "fwd_only", "fx_to_pattern", "gen_pattern", "is_match", "joint_fwd_bwd", "lowerings",
    "register_graph_pattern", "register_lowering", "register_lowering_pattern", "register_replacement",
    "remove_noop_aliases", "replace_with_graph",
]
