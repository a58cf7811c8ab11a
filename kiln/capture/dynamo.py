"""The ``torch.compile`` backend named "kiln".

``torch.compile(model, backend="kiln")`` finds it through the ``torch_dynamo_backends`` entry point,
so users never import kiln first. Dynamo calls it as ``backend(gm, example_inputs, options=..., mode=...)``.
"""
from __future__ import annotations

from kiln.options import current


def backend(gm, example_inputs, options=None, mode=None, **unused):
    """Compile one Dynamo graph with the options in scope, overridden by ``torch.compile(options=...)``."""
    extra = dict(options or {})
    if mode is not None and mode != "default":
        extra["mode"] = mode
    from kiln.pipeline import compile_graph   # here, not at the top: ``import kiln`` stays light
    return compile_graph(gm, example_inputs, current(**extra))


def register() -> None:
    """Register "kiln" with Dynamo unless its entry point is being loaded (that path registers it)."""
    from torch._dynamo.backends import registry
    if "kiln" in registry._COMPILER_FNS or registry._BACKENDS.get("kiln") is not None:
        return
    registry.register_backend(compiler_fn=backend, name="kiln")
