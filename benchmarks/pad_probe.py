"""A misaligned matmul's variants side by side (GPU): plain (cuBLAS on the misaligned shape), kiln's column
blocks (``mm_cols``), padded then copied contiguous, padded and left strided; GPU ms (CUDA events) and host
us per call.

    PYTHONPATH=. python3 benchmarks/pad_probe.py M K N [M K N ...]
"""
import sys
import time

import torch
import torch.nn.functional as F

from kiln.passes.pad_mm import mm_cols


def timed(fn, n=50):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host = 0.0
    e0.record()
    for _ in range(n):
        t = time.perf_counter()
        fn()
        host += time.perf_counter() - t
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / n, host / n * 1e6


def main():
    dims = list(map(int, sys.argv[1:]))
    for m, k, n in zip(dims[::3], dims[1::3], dims[2::3]):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)   # a Linear's weight: b = w.t()
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        pn = -n % 8
        wp, bp = F.pad(w, (0, 0, 0, pn)), F.pad(bias, (0, pn))
        g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        gp = F.pad(g, (0, pn))
        variants = {
            "plain": lambda: torch.addmm(bias, a, w.t()),
            "mm_cols": lambda: mm_cols(a, w.t(), bias, 8, (-(-n // 8) + 7) // 8 * 8, False),
            "pad+copy": lambda: torch.addmm(F.pad(bias, (0, pn)), a, F.pad(w, (0, 0, 0, pn)).t())[:, :n].contiguous(),
            "pad strided": lambda: torch.addmm(F.pad(bias, (0, pn)), a, F.pad(w, (0, 0, 0, pn)).t())[:, :n],
            "pre-padded w": lambda: torch.addmm(bp, a, wp.t())[:, :n],
            "bwd dX plain": lambda: torch.mm(g, w),
            "bwd dX padded": lambda: torch.mm(F.pad(g, (0, pn)), wp),
            "bwd dX gp": lambda: torch.mm(gp, wp),
            "bwd dW plain": lambda: torch.mm(g.t(), a),
            "bwd dW padded": lambda: torch.mm(gp.t(), a)[:n],
        }
        ref = variants["plain"]().float()
        for name, fn in variants.items():
            if not name.startswith("bwd"):
                err = (fn().float() - ref).abs().max().item()
            else:
                err = 0.0
            ms, us = timed(fn)
            print(f"{m}x{k}x{n} {name:14s} GPU {ms * 1e3:8.1f} us  host {us:7.1f} us  err {err:.3g}", flush=True)


if __name__ == "__main__":
    main()
