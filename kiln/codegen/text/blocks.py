"""Launch configurations of Triton kernels: block sizes, warps and grids, read by the Triton emitter (static
sizes: constants of the module) and by ``kiln.runtime.launch`` (dynamic sizes, autotuning).
"""
from typing import NamedTuple

from kiln.options import Tuning


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


class Blocks(NamedTuple):
    """The tuning fields a launch configuration reads (``Options.tuning``)."""
    pw_xblock: int
    pw_warps: int
    pw_warps_narrow: int
    outer_xblock: int
    outer_rblock: int
    outer_warps: int
    xblock_max: int

    @classmethod
    def of(cls, tuning: Tuning) -> "Blocks":
        return cls(*(getattr(tuning, f) for f in cls._fields))


def config(kind, xnumel, rnumel, persistent, inner, interpret, narrow, blocks: Blocks):
    """(XBLOCK, RBLOCK, num_warps) from a small heuristic (``narrow``: 2-byte elements)."""
    xb, rb, warps = _config(kind, xnumel, rnumel, persistent, inner, interpret, narrow, blocks)
    return min(xb, blocks.xblock_max), rb, warps


def _config(kind, xnumel, rnumel, persistent, inner, interpret, narrow, blocks: Blocks):
    if kind == "pointwise":
        if interpret:
            return min(next_pow2(xnumel), 1 << 14), 1, 1
        # a tile of 1024 elements, 4 per thread (16 bytes of fp32) or 8 per thread for 2-byte data (an
        # H200 probe of a bf16 GELU backward at 8192x3072: 4 warps 6% faster than 8; fp32 rows alike)
        xb = min(blocks.pw_xblock, max(next_pow2(xnumel), 16))
        warps = blocks.pw_warps_narrow if narrow else blocks.pw_warps
        return xb, 1, warps if xb >= 1024 else (4 if xb >= 256 else 2)
    if persistent:
        rb = next_pow2(rnumel)
        budget = (1 << 14) if interpret else (4096 if inner else 2048)
        xb = max(1, min(next_pow2(xnumel), budget // rb, 1024 if interpret else 64))
        warps = 1 if interpret else max(1, min(8, (xb * rb) // 256))
        return xb, rb, warps
    if interpret:
        rb = min(next_pow2(rnumel), 1024)
        return max(1, min(next_pow2(xnumel), 4096 // rb)), rb, 1
    if inner:
        return 1, min(next_pow2(rnumel), 2048), 8
    # outer reductions: columns along the tile's first axis; autotuning on an H200 preferred
    # 16 warps for long columns (65536x512 column sum: 138 us with 4 warps, 46 us with 16)
    return (min(blocks.outer_xblock, next_pow2(xnumel)), min(next_pow2(rnumel), blocks.outer_rblock),
            blocks.outer_warps if rnumel >= 1024 else 4)


def candidates(kind, xnumel, rnumel, persistent, inner, narrow, blocks: Blocks):
    """Configurations tried under ``max_autotune``."""
    base = config(kind, xnumel, rnumel, persistent, inner, False, narrow, blocks)
    out = {base}
    xb, rb, w = base
    for f in (2, 4):
        if kind == "pointwise":
            out.add((max(16, xb // f), 1, max(1, w // 2)))
            out.add((min(4096, xb * f), 1, min(16, w * 2)))
        else:
            if xb // f >= 1:
                out.add((xb // f, rb, w))
            out.add((min(xb * f, 256), rb, w))
            if not persistent and rb // f >= 16:
                out.add((xb, rb // f, w))
    for wf in (4, 8, 16):
        out.add((xb, rb, wf))
    return sorted(out)


def grid_of(xnumel: int, xblock: int, meta) -> tuple:
    """The launch grid: one program (``outer``), ``programs`` (column partials), or one per XBLOCK rows."""
    if meta.get("programs"):
        return (meta["programs"],)
    return (1,) if meta.get("outer") else ((xnumel + xblock - 1) // xblock,)
