"""Benchmark suites: ``micro`` (fused elementwise and normalisation kernels), ``models``, ``zoo``,
``flex`` (FlexAttention) and ``user`` (ordinary models as a user brings them to a CPU).

``select(suite, device, names)`` returns the cases to run and the ones skipped, with the reason.
"""
from __future__ import annotations

import fnmatch

from kiln_bench.suites import flex, micro, models, user, zoo

SUITES = {"micro": micro.CASES, "models": models.CASES, "zoo": zoo.CASES, "flex": flex.CASES,
          "user": user.CASES}


class UnknownCaseError(ValueError):
    """A ``--cases`` pattern matched no case; the message lists the case names."""


def all_cases(suite: str = "all") -> list:
    """Every case of ``suite`` ('micro', 'models', 'zoo', 'flex', 'user', 'all': micro and models, or 'every')."""
    if suite in ("all", "every"):
        return [c for name, cases in SUITES.items() if suite == "every" or name in ("micro", "models") for c in cases]
    return list(SUITES[suite])


def select(suite: str, device: str, names=None):
    """``(cases, skipped)`` for ``suite`` on ``device``; ``names`` are fnmatch patterns (``gpt*``).

    A case is skipped (with a reason) when it does not run on ``device`` or needs a missing module.
    """
    cases = all_cases(suite)
    if names:
        picked = [c for c in cases if any(fnmatch.fnmatchcase(c.name, p) for p in names)]
        unmatched = [p for p in names if not any(fnmatch.fnmatchcase(c.name, p) for c in cases)]
        if unmatched:
            raise UnknownCaseError(f"--cases {unmatched} matched nothing in suite {suite!r}; "
                                   f"cases: {[c.name for c in cases]}")
        cases = picked
    run, skipped = [], []
    for c in cases:
        if device not in c.devices:
            skipped.append((c.name, f"runs on {'/'.join(c.devices)} only"))
        elif c.missing():
            skipped.append((c.name, f"needs {', '.join(c.missing())} (not installed)"))
        else:
            run.append(c)
    return run, skipped
