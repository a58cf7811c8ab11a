"""This machine's memory bandwidth, STREAM-style, printed by ``kiln bench`` with its rows.

Two of STREAM's kernels on fp32 arrays of ``4 x`` the last-level cache (at least 64 MiB each), run by
ATen on the bench's threads: copy ``c = a`` (8 bytes an element: one read, one write) and triad
``a = b + s * c`` (12 bytes). As in STREAM, the best of ``repeats`` runs counts and write-allocate
traffic does not. A memory-bound row's GB/s (``case.min_bytes`` over its median step time) is printed
as a fraction of the larger of the two: a fraction above 1 means the case's working set stayed in cache.
"""
from __future__ import annotations

import glob
import time

import torch

MiB = 2 ** 20


def llc_bytes(default: int = 32 * MiB) -> int:
    """The largest CPU cache of this host (Linux sysfs), else ``default``."""
    best = 0
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = open(path).read().strip().upper()
        except OSError:
            continue
        scale = {"K": 2 ** 10, "M": MiB, "G": 2 ** 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * scale)
    return best or default


def _best(fn, sync, repeats: int) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def bandwidth(device: str = "cpu", array_bytes: int = 0, repeats: int = 10) -> dict:
    """``{"copy": GB/s, "triad": GB/s, "peak": the larger, "array_mib", "threads"}`` on ``device``."""
    nbytes = array_bytes or max(4 * llc_bytes(), 64 * MiB)
    if device == "cuda":
        nbytes = array_bytes or 1 << 30
    n = nbytes // 4
    a = torch.ones(n, device=device)
    b = torch.full_like(a, 2.0)
    c = torch.empty_like(a)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    copy = _best(lambda: c.copy_(a), sync, repeats)
    triad = _best(lambda: torch.add(b, c, alpha=3.0, out=a), sync, repeats)
    out = {"copy": 8 * n / copy / 1e9, "triad": 12 * n / triad / 1e9, "array_mib": nbytes / MiB,
           "threads": torch.get_num_threads()}
    out["peak"] = max(out["copy"], out["triad"])
    return out


def describe(bw: dict) -> str:
    """One line for the console and RESULTS.md."""
    return (f"memory bandwidth (STREAM-style, ATen, {bw['threads']} threads, {bw['array_mib']:.0f} MiB arrays): "
            f"copy {bw['copy']:.1f} GB/s, triad {bw['triad']:.1f} GB/s")


__all__ = ["bandwidth", "describe", "llc_bytes"]
