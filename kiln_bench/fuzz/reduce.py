"""Shrinking a failing program: a greedy reduce-and-retry loop over simpler candidates.

``shrinker(program, signature)`` is a generator: it yields candidate programs and is sent back the
signature of each one's result (``harness.Result.signature()``, or ('crash',), ('timeout',)); a candidate
that fails the same way replaces the program and the search starts over from it. It returns the smallest
program found when no candidate fails alike or the budget of tries is spent. The runner drives it with
its child processes as the oracle, so a crash can be shrunk too (each crashing candidate costs a restart).

Candidates, most promising first (each without dead statements): return one value only, drop a statement
(its later uses read its first operand), drop a returned value, no gradients, static shapes, then per
input: no alias, contiguous, no special values, no grad, float32 instead of 16-bit floats, smaller sizes.
"""
from __future__ import annotations

import dataclasses

from kiln_bench.fuzz.program import Program


def candidates(p: Program):
    """Programs simpler than ``p`` (some of which eager may reject), without dead statements."""
    for c in _candidates(p):
        yield c.simplified()


def _candidates(p: Program):
    if len(p.returns) > 1:
        for r in p.returns:
            yield dataclasses.replace(p, returns=(r,))
    for i in reversed(range(len(p.ops))):
        yield p.without_op(i)
    if len(p.returns) > 1:
        for r in p.returns:
            yield dataclasses.replace(p, returns=tuple(x for x in p.returns if x != r))
    if p.train:
        yield dataclasses.replace(p, train=False)
    if p.dynamic:
        yield dataclasses.replace(p, dynamic=False)
    for i, x in enumerate(p.inputs):
        if x.alias is not None:
            yield p.with_input(i, alias=None)
        if x.layout != "contiguous":
            yield p.with_input(i, layout="contiguous")
        if x.special:
            yield p.with_input(i, special=False)
        if x.grad:
            yield p.with_input(i, grad=False)
        if x.dtype in ("bfloat16", "float16"):
            yield p.with_input(i, dtype="float32")
        if x.alias is None:
            for d, s in enumerate(x.shape):
                for smaller in sorted({1, s // 2} - {s}):
                    if 0 < smaller < s:
                        yield p.with_input(i, shape=x.shape[:d] + (smaller,) + x.shape[d + 1:])


def size(p: Program) -> tuple:
    """How big a program is, to order equally failing ones."""
    return (len(p.ops), len(p.inputs), len(p.returns), p.train, p.dynamic,
            sum((x.layout != "contiguous") + x.special + x.grad + (x.alias is not None)
                + (x.dtype in ("bfloat16", "float16")) for x in p.inputs),
            sum(sum(x.shape) for x in p.inputs))


def shrinker(program: Program, signature: tuple, max_tries: int = 60):
    """Yield candidates, receive their signatures; return the smallest program failing with ``signature``."""
    best, tries, seen = program, 0, {program}
    improved = True
    while improved and tries < max_tries:
        improved = False
        for cand in candidates(best):
            if cand in seen or size(cand) >= size(best):
                continue
            seen.add(cand)
            tries += 1
            got = yield cand
            if tuple(got or ()) == tuple(signature):
                best, improved = cand, True
                break
            if tries >= max_tries:
                break
    return best
