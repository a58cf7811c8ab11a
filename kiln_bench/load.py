"""Is this machine busy? The load average against the cores and the threads a measurement uses, and the
spread of the step times.

Timings taken while other processes compete for the cores are slow and noisy, and on the CPU far worse than
the load suggests: an OpenMP step whose threads wait for a busy core waits out the scheduler's time slices at
every parallel region (a 2-core machine running a 2-thread step beside one other busy process measured eager
steps 20 to 50 times slower than alone). ``kiln demo`` and ``kiln bench`` say so next to their figures
(``verdict``) instead of presenting them as results.

The one-minute load average counts this process's own running threads too: a sample taken while it measures
says how many (``own``), and only the load beyond them counts as other work.
"""
from __future__ import annotations

import os

SLACK = 0.5    # other work may take half a core beyond what the measurement leaves free
SPREAD = 0.10  # half the interquartile range above 10% of the median: the step time is not settled


def cores() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:   # not Linux
        return os.cpu_count() or 1


def sample(own: int = 0) -> dict | None:
    """``{"load1": one-minute load average, "cores": usable CPUs, "own": threads of this process that ran
    in the last minute}``; None where the OS keeps no load average."""
    try:
        return {"load1": round(os.getloadavg()[0], 2), "cores": cores(), "own": own}
    except (AttributeError, OSError):
        return None


def others(s: dict) -> float:
    """The load of a sample beyond this process's own threads."""
    return max(0.0, s["load1"] - s.get("own", 0))


def verdict(load: dict | None, threads: int = 1, spreads=(), slack: float = SLACK, max_spread: float = SPREAD) -> list:
    """The reasons the figures are unreliable (empty when none): other work that, beside the ``threads`` the
    measurement runs, asks for more than the cores plus ``slack``; step-time spreads (half-IQR over median,
    one per measured row) above ``max_spread``."""
    why = []
    if load and others(load) + threads > load["cores"] + slack:
        why.append(f"load average {load['load1']:.1f} on {load['cores']} cores: other processes ask for about "
                   f"{others(load):.1f} of them beside the {threads} thread{'s' * (threads != 1)} measured")
    spreads = [s for s in spreads if s is not None]
    wide = [s for s in spreads if s > max_spread]
    if wide:
        why.append(f"{len(wide)} of {len(spreads)} step times spread more than ±{max_spread:.0%} "
                   f"(widest ±{max(wide):.0%})")
    return why
