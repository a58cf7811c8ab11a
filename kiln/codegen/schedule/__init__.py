"""Scheduling: fused groups of buffers (``fuse``), folded column reductions (``fold``, ``colpart``),
kernel plans (``plan``) and chained kernels (``chain``)."""
