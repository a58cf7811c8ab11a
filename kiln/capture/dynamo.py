"""The ``torch.compile`` backend named "kiln" (found through the ``torch_dynamo_backends`` entry point, so users
never import kiln first); Dynamo calls it as ``backend(gm, example_inputs, options=..., mode=...)``.
"""
from kiln.options import OptionError, Options, current


def backend(gm, example_inputs, options=None, mode=None, **unused):
    """Compile one Dynamo graph with the options in scope, overridden by ``torch.compile(options=...)``:
    torch hands a string backend its options only here, at the first graph, so their check names them."""
    extra = dict(options or {})
    try:
        Options().replace(**extra)
    except OptionError as e:
        raise type(e)(f"torch.compile(backend='kiln', options={extra!r}): {e}") from None
    if mode is not None and mode != "default":
        extra["mode"] = mode
    from kiln.pipeline import compile_graph   # here, not at the top: ``import kiln`` stays light
    return compile_graph(gm, example_inputs, current(**extra))


class Bound:
    """kiln's backend with options bound (``kiln.compile``), named ``kiln`` in Dynamo's messages."""

    def __init__(self, options: dict):
        self.options, self.__name__ = dict(options), "kiln"

    def __call__(self, gm, example_inputs, **kwargs):
        return backend(gm, example_inputs, options=self.options, **kwargs)

    def __repr__(self):
        return f"kiln(options={self.options!r})" if self.options else "kiln"


def register() -> None:
    """Register "kiln" with Dynamo, unless its entry point will (``import kiln`` need not import Dynamo)."""
    import sys
    from importlib.metadata import entry_points
    if "torch._dynamo" not in sys.modules and entry_points(group="torch_dynamo_backends", name="kiln"):
        return
    from torch._dynamo.backends import registry
    if "kiln" in registry._COMPILER_FNS or registry._BACKENDS.get("kiln") is not None:
        return
    registry.register_backend(compiler_fn=backend, name="kiln")
