"""``kiln bench``: kiln against eager PyTorch and TorchInductor, measured side by side.

Layout: ``cli`` (arguments, progress, output) -> ``suites`` (cases) -> ``runner`` (one case, every
backend) -> ``measure`` (timers, memory, check) -> ``report`` / ``plot`` (markdown, JSON, PNG).
``models`` holds the built-in GPT and CNN that ``kiln demo`` reuses.
"""
