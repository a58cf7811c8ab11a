"""Code generation, in layers; each imports only the ones above it (``tests/test_layers.py`` checks):

- ``ir``: the loop-level IR (``loops``: Exprs, buffers, pointwise values and reductions; ``indexing``);
- ``lower``: a post-grad ATen graph -> loop-IR values (one module per op family);
- ``schedule``: fusion (``fuse``), folded column reductions (``fold``, ``colpart``), kernel plans
  (``plan``: plain data, the same for every target; ``planner`` makes them) and chained kernels (``chain``);
- ``to_triton``: plan -> Triton module text (the emitter);
- ``fuse_graph`` (the entry point, which rewrites the FX graph with kernel calls), ``wrapper`` (the
  Python wrapper around kernels and library calls), ``views``, ``fallback``.

What runs at launch time lives in ``kiln/runtime``.
"""
