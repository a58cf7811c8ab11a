"""``Watch``: a dispatch mode over eager's run of a fuzz program that records what the comparison needs
to know about how eager computed.

- Precision: a float32 value can pass through float16 or bfloat16 on its way (``x.half().norm()``'s
  gradient with respect to a float32 ``x``), a float64 one through float32 (``cos`` of an integer
  tensor is float32): it then holds that dtype's rounding, which kiln need not repeat step by step
  (kiln rounded once, eager at each step: one half-precision ulp apart; its cos and eager's may differ
  by an ulp), and the float64 arbiter cannot settle it, since the program's own casts and type
  promotion take it through the same dtype.
  ``compare`` checks such a value at the tolerance of the least precise float dtype it went through.
- Writes through memory that overlaps itself: an op writing a tensor two of whose elements share a
  location (``masked_fill_`` of an expanded view, ``select_scatter`` of an overlapping input, which
  clones it with its strides). The values left there depend on the order of eager's writes; the program
  means something else, which kiln computes (inductor agrees with kiln, aot_eager with eager), so the
  harness discards such a program.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

LOW = (torch.bfloat16, torch.float16, torch.float32)   # least precise first


def least(dtypes) -> torch.dtype | None:
    """The least precise of ``dtypes`` among ``LOW`` (a complex dtype counts as its real part's), or None."""
    real = [d.to_real() if isinstance(d, torch.dtype) and d.is_complex else d for d in dtypes]
    found = [d for d in real if d in LOW]
    return min(found, key=LOW.index) if found else None


def overlaps(t) -> bool:
    """Whether two elements of ``t`` share a memory location (exact: its offsets, counted)."""
    if t.numel() < 2 or t.is_contiguous():
        return False
    offsets = torch.zeros((), dtype=torch.int64)
    for size, stride in zip(t.shape, t.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(size) * stride
    return offsets.unique().numel() < t.numel()


class Watch(TorchDispatchMode):
    """Records, per tensor an op writes, the least precise float dtype among the op's tensors and
    the precisions its inputs were computed in (``of(t)``: None when none); and ``overlapping``: the ops
    that wrote a tensor whose elements share memory (an in-place op's operand, a new output; not a view)."""

    def __init__(self):
        super().__init__()
        self._low = WeakIdKeyDictionary()
        self.overlapping: list[str] = []

    def of(self, t) -> torch.dtype | None:
        return self._low.get(t) if isinstance(t, torch.Tensor) else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        written = [a for a, s in zip(args, schema.arguments)
                   if isinstance(a, torch.Tensor) and s.alias_info is not None and s.alias_info.is_write]
        fresh = [t for t, r in zip(out if isinstance(out, (tuple, list)) else [out], schema.returns)
                 if isinstance(t, torch.Tensor) and r.alias_info is None]
        if any(overlaps(t) for t in written + fresh) and len(self.overlapping) < 3:
            self.overlapping.append(func.__name__)
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        low = least([t.dtype for t in ins + outs] + [self.of(t) for t in ins])
        if low is not None:
            written += [a._base for a in written if a._base is not None]   # a write into a view of it
            for t in outs + written:
                self._low[t] = least([low, self.of(t)])
        return out
