"""Lowering: a post-grad ATen graph -> loop-IR values and buffers (``Lowering``, in ``base``). The op
families register themselves in ``LOWERINGS`` when imported, which this package does.
"""
from kiln.codegen.lower import index, misc, pointwise, prims, reduce, view  # noqa: F401  (registration)
from kiln.codegen.lower.base import LOWERINGS, Lowering, is_tensor, register  # noqa: F401

__all__ = ["LOWERINGS", "Lowering", "is_tensor", "register"]
