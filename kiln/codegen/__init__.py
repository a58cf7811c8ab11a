"""Code generation, in parts that import one way (``tests/test_layers.py`` draws the arrows): ``ir`` (the
loop IR) <- ``lower`` (ATen -> loop IR) <- ``schedule`` (fusion, kernel plans) <- ``text`` (sources, naming,
the printer, launchers) <- ``to_triton``, ``to_cpp`` (plan -> text; neither imports the other) <-
``generate``, ``rewrite``, ``wrapper``, ``views``, ``fallback`` <- ``target`` (one per generator), which
alone sits above ``kiln/runtime``.
"""
