"""kiln's tools, beside the compiler and on its public API (the internals they read are listed in
``_internal``): ``kiln bench``, ``kiln demo``, ``kiln check-ops`` (``opinfo``), ``kiln bench-compile``
(``compile_times``), the fuzzer (``python -m kiln_bench.fuzz``), the offline dumps (``offline``,
``graph_peak``), ``profile``, ``peak_sweep``, ``live_at_peak``. kiln never imports them: its command line
loads one when its command runs.

``kiln bench``: kiln against eager PyTorch and TorchInductor, measured side by side.

Layout: ``cli`` (arguments, progress, output) -> ``suites`` (cases) -> ``runner`` (one case, every
backend) -> ``measure`` (timers, memory, check) -> ``report`` / ``plot`` (markdown, JSON, PNG).
``models`` holds the built-in GPT and CNN that ``kiln demo`` reuses.
"""
