"""Code generation, in parts that import one way (``tests/test_layers.py`` draws the arrows):

- ``ir``: the loop-level IR (``loops``: Exprs, buffers, pointwise values and reductions; ``indexing``);
- ``lower``: a post-grad ATen graph -> loop-IR values (one module per op family);
- ``schedule``: how reductions split (``split``), fusion (``fuse``), kernel plans (``plan``: plain data,
  the same for every target; ``planner`` makes them), chained kernels (``chain``);
- ``text``: kernel sources as values and their naming (``source``), the one expression printer
  (``printer``), the launcher every kernel module has (``launcher``), what both expression writers share
  (``writer``), Triton's launch configurations (``blocks``);
- ``to_triton``, ``to_cpp``: plan -> text (the emitters; neither imports the other);
- ``generate`` (a graph's kernels as data), ``rewrite`` (the FX surgery putting them into the graph),
  ``wrapper`` (the Python wrapper around kernels and library calls), ``views``, ``fallback``;
- ``target``: one ``Target`` per generator (ATen, Triton, C++), resolved once per graph: its
  decompositions, graph passes, emitter, build and cache key. It alone sits above ``kiln/runtime``, which
  builds, binds and launches what code generation made.
"""
