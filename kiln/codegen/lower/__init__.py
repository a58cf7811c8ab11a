"""Lowering: a post-grad ATen graph -> loop-IR values and buffers (``Lowering``).

``base`` is the driver and the helpers every lowering uses; the op families register themselves in
``LOWERINGS`` when imported, which this package does: ``pointwise``, ``reduce`` (reductions, norms,
losses and the split of long reductions), ``index`` (gathers, scatters, embedding), ``view``,
``misc`` and ``prims``.
"""
from kiln.codegen.lower import index, misc, pointwise, prims, reduce, view  # noqa: F401  (registration)
from kiln.codegen.lower.base import LOWERINGS, Lowering, is_tensor, register  # noqa: F401

__all__ = ["LOWERINGS", "Lowering", "is_tensor", "register"]
