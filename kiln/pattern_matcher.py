"""``kiln.pattern_matcher``: the pattern-matching API in one import, under the names Inductor's users know
(the engine is ``kiln/passes/match/``; ``CACHE_STATS`` counts pattern traces and trace-cache hits).
"""
from kiln.passes.match.entries import (DuplicatePatternError, GraphPatternEntry,  # noqa: F401
                                       LoweringPatternEntry, PatternEntry, PatternMatcherPass,
                                       ReplacementPatternEntry)
from kiln.passes.match.fx_lowerings import LoweringError, lowerings, register_lowering  # noqa: F401
from kiln.passes.match.nodes import CallFunction, CallMethod, CallModule, ListOf, MultiOutputPattern  # noqa: F401
from kiln.passes.match.pattern import (MULTIPLE, Arg, ExclusiveKeywordArg, FailedMatch, Ignored,  # noqa: F401
                                       KeywordArg, Match, MatchContext, PatternExpr, is_match,
                                       replace_with_graph)
from kiln.passes.match.register import (PatternError, fx_to_pattern, gen_pattern,  # noqa: F401
                                        register_graph_pattern, register_lowering_pattern, register_replacement)
from kiln.passes.match.trace import (CACHE_STATS, PatternTraceError, fwd_only, joint_fwd_bwd,  # noqa: F401
                                     remove_noop_aliases)
