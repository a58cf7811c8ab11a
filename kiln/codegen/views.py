"""Which views of a graph the wrapper may emit as one reinterpret call, and which layouts it may trust.

A static view is written as ``reinterpret(x, sizes, strides, offset)`` (0.7 us against 2.8 for
``aten.view``) when its recorded value is what the op makes of its input's (``consistent``, replayed on the
meta device) and the input's strides at run time are the recorded ones (``known``: kernel outputs, dense
matmul results, graph inputs, trusted saved values and views of these). A view of anything else gets a
stride check at run time, with the ATen op as fallback.
"""
import operator

import torch
import torch.fx as fx

from kiln.codegen.text.source import KernelRef

_aten = torch.ops.aten
# ops returning several views of their input: their elements can reinterpret the input directly
SPLITS = {_aten.split_with_sizes.default, _aten.split.Tensor, _aten.unbind.int}


def is_view_op(target) -> bool:
    """An op whose result is one strided view of its input's storage: its schema says it aliases
    (``view``, ``permute``, ``slice``, ...), or ``_unsafe_view`` (a view whose schema does not say so)."""
    return target is _aten._unsafe_view.default or (bool(getattr(target, "is_view", False)) and target not in SPLITS)


# externs whose outputs are dense row-major: at run time their strides are the recorded ones
DENSE_EXTERNS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default}


def is_kernel(target) -> bool:
    """A fused kernel call made by kiln's emitters (its outputs are allocated at the recorded strides)."""
    return isinstance(target, KernelRef)


class ViewPlan:
    """Answers, per node of one graph: ``base`` (the tensor a view reads), ``static`` (a view the
    wrapper may reinterpret) and ``known`` (run-time strides are the recorded ones).
    ``trusted``: placeholder names to treat as known (a backward's saved values)."""

    def __init__(self, trusted=frozenset()):
        self.trusted, self._known, self._consistent = trusted, {}, {}

    def base(self, n: fx.Node):
        """The tensor node view ``n`` reads: its input, or for an element of a split, the split's input."""
        if n.op != "call_function" or not n.args or not isinstance(n.args[0], fx.Node):
            return None
        if is_view_op(n.target):
            return n.args[0]
        if n.target is operator.getitem and n.args[0].op == "call_function" and n.args[0].target in SPLITS \
                and isinstance(n.args[0].args[0], fx.Node):
            return n.args[0].args[0]
        return None

    def static(self, n: fx.Node, need_known: bool = True) -> bool:
        """A view of static sizes, its recorded value consistent (``need_known``: its input's known)."""
        base = self.base(n)
        if base is None:
            return False
        val, src = n.meta.get("val"), base.meta.get("val")
        if not (isinstance(val, torch.Tensor) and isinstance(src, torch.Tensor)) or val.dtype != src.dtype:
            return False
        if val.is_conj() != src.is_conj() or val.is_neg() != src.is_neg():
            return False   # _conj, _neg_view: a view that flips a bit reinterpret would drop
        if not all(isinstance(x, int) for t in (val, src) for x in (*t.shape, *t.stride(), t.storage_offset())):
            return False
        return self.consistent(n, base) and (not need_known or self.known(base) is not None)

    def consistent(self, n: fx.Node, base: fx.Node) -> bool:
        """Whether ``n``'s recorded value is what its op makes of ``base``'s, replayed on the meta device."""
        if n in self._consistent:
            return self._consistent[n]
        val, src = n.meta["val"], base.meta["val"]
        try:
            span = 1 + sum((size - 1) * st for size, st in zip(src.shape, src.stride()) if size > 0)
            store = torch.empty(src.storage_offset() + max(span, 0), dtype=src.dtype, device="meta")
            x = store.as_strided(src.shape, src.stride(), src.storage_offset())
            if n.target is operator.getitem:   # an element of a split
                split = n.args[0]
                out = split.target(x, *split.args[1:], **split.kwargs)[n.args[1]]
            else:
                out = n.target(x, *n.args[1:], **n.kwargs)
            ok = (tuple(out.shape) == tuple(val.shape) and tuple(out.stride()) == tuple(val.stride())
                  and out.storage_offset() - x.storage_offset() == val.storage_offset() - src.storage_offset())
        except Exception:   # an argument that is not a plain value, an op that refuses: no reinterpret
            ok = False
        self._consistent[n] = ok
        return ok

    def known(self, n: fx.Node):
        """``"output"``, ``"input"`` or None: why ``n``'s strides at run time are the recorded ones."""
        if n in self._known:
            return self._known[n]
        kind = None
        if n.op == "placeholder":
            # tangents are left out: AOTAutograd may hand them over in another layout than traced
            kind = "input" if n.name.startswith(("primals", "arg")) or n.name in self.trusted else None
        elif n.op == "call_function" and self.static(n):
            kind = self.known(self.base(n))
        elif n.op == "call_function" and n.target is operator.getitem:
            kind = "output" if isinstance(n.args[0], fx.Node) and is_kernel(n.args[0].target) else None
        elif n.op == "call_function" and is_kernel(n.target):
            kind = "output"
        elif n.op == "call_function" and n.target in DENSE_EXTERNS:
            val = n.meta.get("val")
            kind = "output" if isinstance(val, torch.Tensor) and val.is_contiguous() and \
                val.storage_offset() == 0 else None
        self._known[n] = kind
        return kind
