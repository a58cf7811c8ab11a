"""kiln: a small PyTorch compiler. ``torch.compile(model, backend="kiln")`` or ``kiln.compile(model)``;
the public names are ``__all__``.
"""
import torch

from kiln import compat, config
from kiln.capture.dynamo import Bound as _Bound, register as _register
from kiln.debug import counters
from kiln.options import OptionError, Options, OptionTypeError, UserError, current as _current

__version__ = "0.1.0"
__all__ = ["compile", "config", "Options", "OptionError", "OptionTypeError", "UserError", "counters",
           "run_and_get_code", "explain", "explain_memory", "resume", "memory_efficient_fusion", "passes",
           "fx_graph_cse", "pattern_matcher", "lowerings", "__version__"]


def compile(model=None, *, dynamic=None, fullgraph: bool = False, mode=None, **options):
    """``kiln.compile(fn, activation_memory_budget=0.5)``; options are checked now, applied over ``config.patch``."""
    if mode is not None:
        options["mode"] = mode
    _current(**options)  # validate eagerly
    be = _Bound(options)
    if model is None:
        return lambda m: torch.compile(m, backend=be, dynamic=dynamic, fullgraph=fullgraph)
    return torch.compile(model, backend=be, dynamic=dynamic, fullgraph=fullgraph)


def run_and_get_code(fn, *args, **kwargs):
    """``(fn(*args), [source of each wrapper and kernel generated meanwhile])``, Dynamo reset first (as
    inductor's); the backward compiles at its first ``.backward()``: call that inside ``fn`` to see it."""
    from kiln.runtime.load import collect_sources
    torch._dynamo.reset()
    with collect_sources() as sources:
        result = fn(*args, **kwargs)
    return result, sources


def explain(fn, *args, **kwargs):
    """Compile and run ``fn`` with kiln and return the list of ``(stage, graph text)`` pairs it went through."""
    from kiln import debug
    stages: list = []
    debug._EXPLAIN_SINKS.append(stages)
    try:
        torch._dynamo.reset()
        compiled = fn if hasattr(fn, "_torchdynamo_orig_callable") else compile(fn)
        compiled(*args, **kwargs)
    finally:
        debug._EXPLAIN_SINKS.remove(stages)
    return stages


def __getattr__(name):
    # Late imports keep ``import kiln`` light and let each stage load only when used.
    lazy = {"fx_graph_cse": ("kiln.passes.cse", "fx_graph_cse"), "pattern_matcher": ("kiln.pattern_matcher", None),
            "lowerings": ("kiln.passes.match.fx_lowerings", None), "passes": ("kiln.passes", None),
            "memory_efficient_fusion": ("kiln.memory", "memory_efficient_fusion"),
            "explain_memory": ("kiln.memory", "explain_memory"), "resume": ("kiln.repro", "resume")}
    if name not in lazy:
        raise AttributeError(f"module 'kiln' has no attribute {name!r}")
    import importlib
    mod_name, attr = lazy[name]
    mod = importlib.import_module(mod_name)
    return getattr(mod, attr) if attr else mod


compat.check_torch_version()
_register()
