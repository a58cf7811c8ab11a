"""The pattern-matching engine (public face: ``kiln.pattern_matcher``). Each module imports only those before
it: fx_lowerings, trace, pattern, nodes, entries, register. This file imports nothing.
"""
