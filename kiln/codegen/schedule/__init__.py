"""Scheduling: fused groups of buffers (``fuse``), folded column reductions (``fold``, ``colpart``),
kernel plans (``plan``, made by ``planner``) and chained kernels (``chain``)."""
