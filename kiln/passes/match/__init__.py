"""The pattern-matching engine; its public face is ``kiln.pattern_matcher``. Bottom-up, each module imports
only those before it: fx_lowerings (``L[op](...)``, fake values), trace (tracing pattern functions, their
cache), pattern (``Match``, leaf patterns, splicing a replacement in), nodes (``CallFunction``
and friends), entries (``PatternMatcherPass``), register (and traced graphs as patterns). This file
imports nothing, so that loading one module does not load the others.
"""
