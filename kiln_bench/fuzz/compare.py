"""Comparing kiln's run of a fuzz program with eager's and the float64 arbiter's (``harness.Run``s).

Shapes and dtypes equal; integers and bools exactly; NaN positions equal; values within a dtype's
tolerance of eager's (the looser of the value's dtype and a less precise float dtype it was computed through:
``precision``), or no more than ``WORSE`` times as far from the arbiter as eager's; zeros' signs
equal where eager and the arbiter agree on them (outputs and mutated inputs of real dtypes only). A
16-bit value where eager and kiln disagree on a NaN is kiln's to give where kiln has the arbiter's NaN or
value (rounded to that dtype): eager rounds each 16-bit partial result (``_arbiter_agrees``); a value
equal to the arbiter's, infinities included, is right.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# (rtol, atol) against eager, by the dtype of the compared value
TOL = {torch.float32: (1e-4, 1e-5), torch.float64: (1e-7, 1e-7), torch.bfloat16: (1.6e-2, 1e-2),
       torch.float16: (2e-3, 1e-3)}
WORSE = 3.0   # kiln may be this many times eager's distance from the arbiter (plus the tolerance)
# ops whose zero's sign is the implementation's choice: max(-0.0, 0.0) may be either (relu6(-0.0) is -0.0 in
# eager, +0.0 in a kernel using a different comparison); programs using them skip the signed-zero check
MINMAX = r"relu|hardtanh|clamp|maximum|minimum|fmax|fmin|amax|amin|aminmax|\bmax\(|\bmin\(|\.max\b|\.min\b"
# so is a matrix product's: a sum started at +0.0 (BLAS, bmm) turns a -0.0 product into +0.0, while eager's
# matmul of a K=1 product may multiply without summing (fuzz seed 13 #9227: (5, 1, 1) @ (1, 16), eager -0.0,
# the traced bmm +0.0, aot_eager alike)
PRODUCTS = r"matmul|\bmm\(|bmm\(|addmm|addbmm|baddbmm|addmv|\bmv\(|einsum|tensordot|\blinear\(|\bdot\(|inner\(|outer\(| @ "
SIGN_FREE = MINMAX + "|" + PRODUCTS


@dataclass
class Problem:
    where: str      # 'output 0', 'grad of a1', 'input a2'
    what: str       # 'meta', 'value', 'nan', 'signed_zero'
    detail: str

    def __str__(self):
        return f"{self.where}: {self.what}: {self.detail}"


def _floats(t):
    t = t.resolve_conj().resolve_neg() if t.is_complex() else t
    return torch.view_as_real(t) if t.is_complex() else t


def _arbiter_agrees(e, k, r, low):
    """Where eager and kiln disagree on a NaN and the value is a 16-bit float (or went through one): True
    where kiln's value is the arbiter's (NaN, or its value rounded to that dtype). Eager rounds each
    16-bit partial result: its float16 ``prod`` overflows to inf and underflows to 0 along the way (NaN;
    fuzz seed 11 #5258, #9256), a bf16 ``log_softmax`` rounded to exactly 0 turns ``xlogy(x, -0.0)``'s
    gradient finite (seed 11 #7896); kiln keeps float32 between fused ops."""
    half = low if low in (torch.float16, torch.bfloat16) else e.dtype
    if half not in (torch.float16, torch.bfloat16):
        return torch.zeros_like(e, dtype=torch.bool)
    rounded = r.to(half).double()
    same_nan = k.isnan() & r.isnan()
    same_value = ~k.isnan() & ~r.isnan() & ((k.double() == rounded) | torch.isclose(
        k.double(), rounded, rtol=TOL[half][0], atol=TOL[half][1]))
    return (e.isnan() != k.isnan()) & (same_nan | same_value)


def compare_tensor(e, k, r=None, zero_sign=True, low=None) -> tuple | None:
    """(what, detail) if kiln's ``k`` is wrong against eager's ``e`` (``r``: the arbiter's or None);
    ``zero_sign``: check the signs of zeros too; ``low``: a less precise float dtype the value went through
    (``precision.Precision``), whose tolerance then applies if it is the looser one."""
    if not isinstance(e, torch.Tensor):
        return None if (e == k if not isinstance(k, torch.Tensor) else False) else ("meta", f"{k!r} != {e!r}")
    if not isinstance(k, torch.Tensor):
        return ("meta", f"kiln returned {type(k).__name__}, eager a tensor")
    if k.shape != e.shape or k.dtype != e.dtype:
        return ("meta", f"kiln {k.dtype}{list(k.shape)}, eager {e.dtype}{list(e.shape)}")
    if e.numel() == 0:
        return None
    if not (e.is_floating_point() or e.is_complex()):
        if torch.equal(e, k):
            return None
        bad = (e != k).nonzero()[0].tolist()
        return ("value", f"{int((e != k).sum())} of {e.numel()} differ; at {bad}: eager {e[tuple(bad)].item()} "
                         f"kiln {k[tuple(bad)].item()}")
    rtol, atol = max(TOL.get(e.dtype if e.is_floating_point() else e.real.dtype, TOL[torch.float32]),
                     TOL.get(low, (0.0, 0.0)))
    if not (isinstance(r, torch.Tensor) and r.shape == e.shape and r.is_complex() == e.is_complex()
            and (r.is_floating_point() or r.is_complex())):
        r = None
    complex_ = e.is_complex()
    e, k, r = _floats(e), _floats(k), (_floats(r) if r is not None else None)
    en, kn = e.isnan(), k.isnan()
    if not torch.equal(en, kn) and r is not None and not complex_:
        e = torch.where(_arbiter_agrees(e, k, r, low), k, e)   # eager's rounding NaNs: the arbiter judges
        en = e.isnan()
    if not torch.equal(en, kn):
        at = (en != kn).nonzero()[0].tolist()
        return ("nan", f"NaN at {int((en != kn).sum())} places; at {at}: eager {e[tuple(at)].item()} "
                       f"kiln {k[tuple(at)].item()}")
    e64, k64 = e.double(), k.double()
    bad = ~torch.isclose(k64, e64, rtol=rtol, atol=atol, equal_nan=True)
    if r is not None and bad.any():
        r64 = r.double()
        err_k, err_e = (k64 - r64).abs(), (e64 - r64).abs()
        fine = ((err_k <= WORSE * err_e + atol + rtol * r64.abs()) & r64.isfinite()) | (k64 == r64)
        bad &= ~fine
    if bad.any():
        at = bad.nonzero()[0].tolist()
        diff = (k64 - e64).abs()[bad].max().item()
        return ("value", f"{int(bad.sum())} of {e.numel()} differ, max |diff| {diff:.3g}; at {at}: eager "
                         f"{e[tuple(at)].item()} kiln {k[tuple(at)].item()}"
                         + (f" fp64 {r[tuple(at)].item()}" if r is not None else ""))
    if not zero_sign or complex_:   # a complex zero's sign depends on how the product was expanded
        return None
    z = (e == 0) & (k == 0)
    if r is not None:
        z &= (r == 0) & (r.signbit() == e.signbit())
    wrong = z & (e.signbit() != k.signbit())
    if wrong.any():
        at = wrong.nonzero()[0].tolist()
        return ("signed_zero", f"{int(wrong.sum())} zeros of the wrong sign; at {at}: eager {e[tuple(at)].item()} "
                               f"kiln {k[tuple(at)].item()}")
    return None


def compare(eager, got, ref, zero_sign=True) -> list:
    """Every Problem of kiln's run ``got`` against ``eager`` (and the arbiter ``ref``). The signs of zeros
    are checked (``zero_sign``) in outputs and inputs, never in gradients: autograd's formulas and their
    decompositions (``grad * mask`` against ``where(mask, grad, 0)``) legitimately differ there."""
    problems = []
    if len(got.outs) != len(eager.outs):
        return [Problem("outputs", "meta", f"kiln returned {len(got.outs)} values, eager {len(eager.outs)}")]
    pick = lambda run, field, i: getattr(run, field)[i] if run is not None else None  # noqa: E731
    for field, label in (("outs", "output {}"), ("grads", "grad of a{}"), ("inputs", "input a{}")):
        for i, e in enumerate(getattr(eager, field)):
            k, r = getattr(got, field)[i], pick(ref, field, i)
            if field == "grads":
                if e is None and k is None:
                    continue
                e = torch.zeros_like(k) if e is None else e
                k = torch.zeros_like(e) if k is None else k
            low = (eager.low.get(field) or [None] * (i + 1))[i] if hasattr(eager, "low") else None
            bad = compare_tensor(e, k, r, zero_sign and field != "grads", low)
            if bad:
                problems.append(Problem(label.format(i), *bad))
    return problems


def same_tensor(x, y) -> bool:
    """Whether two values agree exactly (tensors: NaN equal to NaN)."""
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        x, y = _floats(x), _floats(y)
        return x.shape == y.shape and x.dtype == y.dtype and bool(((x == y) | (x.isnan() & y.isnan())).all()) \
            if x.is_floating_point() else torch.equal(x, y)
    return (x is None and y is None) or x == y


def same(a, b) -> bool:
    """Whether two ``harness.Run``s agree exactly (NaN equal to NaN)."""
    return all(same_tensor(x, y) for f in ("outs", "grads", "inputs") for x, y in zip(getattr(a, f), getattr(b, f)))
