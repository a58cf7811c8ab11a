"""The errors of out-of-range indirect indices, as eager raises them (``codegen/ir/bounds.py`` checks them).

A C++ kernel with checks returns the number of its first failed check and writes the wrapped index into a
cell its launcher passes (``error_cell``); an interpreted Triton kernel writes a flag and the raw index per
check into a small tensor. The launcher then calls ``fail``/``check_tensor``, which raise eager's exception
and message per kind of op (``MESSAGES``: index for x[i], index_put, index_fill; gather; scatter and
index_add >= 2-D; self for embedding, index_select, 1-D index_add; dim1 for index_select over dim 1; nll
for nll_loss, cross_entropy; index_copy; take). A compiled Triton kernel asserts on the device instead.
"""
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
    """(cell, its address): where a C++ kernel writes the index that failed its check (one per module)."""
    cell = (ctypes.c_int64 * 1)()
    return cell, ctypes.addressof(cell)


def fail(code: int, cell, checks) -> None:
    """Raise for C++ check ``code`` (1-based) of ``checks``, its wrapped index in ``cell``."""
    kind, dim, size, wraps = checks[code - 1]
    value = int(cell[0])
    if wraps and value < 0:   # wrapped as value + size: the index as written
        value -= size
    raise error(kind, value, dim, size)


def check_tensor(err, checks) -> None:
    """Raise for the first check an interpreted Triton kernel flagged in ``err`` (a flag, the raw index)."""
    flags = err.tolist()
    for k, (kind, dim, size, _) in enumerate(checks):
        if flags[2 * k]:
            raise error(kind, flags[2 * k + 1], dim, size)

