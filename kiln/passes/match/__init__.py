"""The pattern-matching engine (its public face is ``kiln.pattern_matcher``).

Modules, each importing only those above it:

  fx_lowerings.py  ``lowerings[op](...)``: FX-level lowerings that lowering patterns build their
                   replacement with (not the loop-IR lowerings of ``kiln/codegen``); fake values
  trace.py         tracing pattern functions: ``fwd_only``, ``joint_fwd_bwd``, the trace cache
  replace.py       splicing a replacement in for a match: ``replace_with_graph``, ``replace_by_example``
  pattern.py       ``Match``, ``MatchContext``, ``PatternExpr`` and the leaf patterns (``Arg``, ``KeywordArg``..)
  nodes.py         ``CallFunction``, ``CallMethod``, ``CallModule``, ``ListOf``, ``MultiOutputPattern``
  to_pattern.py    traced graphs as patterns: ``fx_to_pattern``, ``gen_pattern``
  entries.py       ``PatternMatcherPass`` and its entries (how a match is applied)
  register.py      ``register_graph_pattern``, ``register_lowering_pattern``, ``register_replacement``

This file imports nothing, so that loading one module does not load the others.
"""
