"""The errors of out-of-range indirect indices, as eager raises them (``codegen/ir/bounds.py`` checks them).

A generated C++ kernel with checks returns the number of its first failed check (0: none) and writes the
offending index, after wrapping, into a cell its launcher passes (``error_cell``); an interpreted Triton
kernel writes a flag and the raw index per check into a small tensor. Either launcher then calls
``fail``/``check_tensor`` with its checks' descriptions, which raise eager's exception and message:

    kind        eager ops                          exception     message (the index, dim and size vary)
    index       x[i], index_put, index_fill        IndexError    index 10 is out of bounds for dimension 0 with size 5
    gather      gather                             RuntimeError  (as index)
    scatter     scatter(_add), index_add (>= 2-D)  RuntimeError  (as index)
    index_copy  index_copy                         IndexError    index_copy_(): (as index)
    self        embedding, index_select,           IndexError    index out of range in self
                index_add (1-D)
    dim1        index_select over dim 1            RuntimeError  INDICES element is out of DATA bounds, id=9 axis_dim=3
    nll         nll_loss, cross_entropy            IndexError    Target 7 is out of bounds.
    take        take                               IndexError    out of range: tried to access index 15 on a tensor
                                                                 of 15 elements.

A compiled (GPU) Triton kernel asserts on the device instead, as eager's CUDA kernels do.
"""
from __future__ import annotations

import ctypes

MESSAGES = {
    "index": (IndexError, "index {value} is out of bounds for dimension {dim} with size {size}"),
    "gather": (RuntimeError, "index {value} is out of bounds for dimension {dim} with size {size}"),
    "scatter": (RuntimeError, "index {value} is out of bounds for dimension {dim} with size {size}"),
    "self": (IndexError, "index out of range in self"),
    "dim1": (RuntimeError, "INDICES element is out of DATA bounds, id={value} axis_dim={size}"),
    "nll": (IndexError, "Target {value} is out of bounds."),
    "index_copy": (IndexError, "index_copy_(): index {value} is out of bounds for dimension {dim} with size {size}"),
    "take": (IndexError, "out of range: tried to access index {value} on a tensor of {size} elements."),
}


def error(kind: str, value: int, dim: int, size: int) -> Exception:
    """Eager's exception for index ``value`` (as the user wrote it) out of range for op ``kind``."""
    cls, text = MESSAGES.get(kind, (IndexError, MESSAGES["index"][1]))
    exc = cls(text.format(value=value, dim=dim, size=size))
    exc.kiln_index_check = True   # not a failed kernel (``kernels.KernelCall`` runs no ATen fallback for it)
    return exc


def error_cell():
    """(cell, its address): where a C++ kernel writes the index that failed its check. One per launcher
    module: two threads failing in one kernel at once may report each other's index in the message."""
    cell = (ctypes.c_int64 * 1)()
    return cell, ctypes.addressof(cell)


def fail(code: int, cell, checks) -> None:
    """Raise for C++ check ``code`` (1-based) of ``checks`` (per check: kind, dim, size, wraps), its
    wrapped index in ``cell``."""
    kind, dim, size, wraps = checks[code - 1]
    value = int(cell[0])
    if wraps and value < 0:   # wrapped as value + size: the index as written
        value -= size
    raise error(kind, value, dim, size)


def check_tensor(err, checks) -> None:
    """Raise for the first check of ``checks`` an interpreted Triton kernel flagged in ``err`` (int64,
    per check a flag then the raw index)."""
    flags = err.tolist()
    for k, (kind, dim, size, _) in enumerate(checks):
        if flags[2 * k]:
            raise error(kind, flags[2 * k + 1], dim, size)


__all__ = ["MESSAGES", "error", "error_cell", "fail", "check_tensor"]
