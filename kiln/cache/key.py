"""The compile cache's key (``graph_key``): Dynamo's code, ``identity.graph_identity``, the inputs, the global
state a trace reads, options, passes, the target's share, the versions (kiln's source too); ``bypass``
says why a graph is not cached at all.
"""
import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import os
import platform

import torch

from kiln.cache import identity
from kiln.options import Options

KILN_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.lru_cache(maxsize=None)
def kiln_source_hash() -> str:
    root, h = KILN_ROOT, hashlib.sha256()
    for d, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(d, f)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as fh:
                    h.update(fh.read())
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def _versions() -> str:
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = "none"
    return f"kiln={kiln_source_hash()}|torch={torch.__version__}|triton={triton}|py={platform.python_version()}"


def _input(x, fake=None) -> str:
    if isinstance(x, torch.Tensor):
        t = x if fake is None else fake   # Dynamo's symbolic sizes, where ``symbolic`` gives them
        return (f"T({x.dtype},{x.device},{tuple(str(s) for s in t.shape)},{tuple(str(s) for s in t.stride())},"
                f"{t.storage_offset()},{x.requires_grad},{x.layout},{type(x).__name__ == 'Parameter'},"
                f"conj={x.is_conj()},neg={x.is_neg()},view={x._is_view()},inference={x.is_inference()})")
    sym = isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool))
    return f"S({type(x).__name__},{x.node.expr})" if sym else f"{type(x).__name__}({x!r})"


def _devices(inputs) -> str:
    cuda = sorted({t.device.index or 0 for t in inputs if isinstance(t, torch.Tensor) and t.device.type == "cuda"})
    return "|".join(f"cuda{i}={torch.cuda.get_device_name(i)}|{torch.cuda.get_device_capability(i)}" for i in cuda)


def _flags() -> list:
    """``torch.backends`` settings that change numerics or the kernels a trace picks (those this torch has)."""
    b = torch.backends
    names = ["cuda.matmul.allow_tf32", "cuda.matmul.allow_fp16_reduced_precision_reduction",
             "cuda.matmul.allow_bf16_reduced_precision_reduction", "cuda.matmul.allow_fp16_accumulation",
             "cuda.matmul.fp32_precision", "cudnn.enabled", "cudnn.allow_tf32", "cudnn.deterministic",
             "cudnn.benchmark", "cudnn.fp32_precision", "cudnn.conv.fp32_precision", "cudnn.rnn.fp32_precision",
             "mkldnn.enabled", "mkldnn.fp32_precision", "mkldnn.matmul.fp32_precision",
             "mkldnn.conv.fp32_precision", "fp32_precision", "opt_einsum.enabled", "opt_einsum.strategy"]
    out = [f"{name}={functools.reduce(lambda o, a: getattr(o, a, None), name.split('.'), b)}" for name in names]
    for sdp in ("flash", "mem_efficient", "math", "cudnn"):
        fn = getattr(b.cuda, f"{sdp}_sdp_enabled", None)
        out.append(f"sdp.{sdp}={fn() if fn is not None else None}")
    return out


def _state() -> str:
    """The global state that changes what a trace produces (as Dynamo, AOTAutograd and Inductor key it)."""
    auto = []
    for dev in ("cpu", "cuda", "xpu", "mps"):
        with contextlib.suppress(AttributeError, RuntimeError, TypeError):
            if torch.is_autocast_enabled(dev):
                auto.append(f"{dev}:{torch.get_autocast_dtype(dev)}")
    functorch = torch._functorch.config.get_config_copy()
    aot = sorted(f"{k}={v!r}" for k, v in functorch.items()
                 if isinstance(v, (type(None), bool, int, float, str)) and not k.startswith("_"))
    fill = getattr(getattr(torch.utils, "deterministic", None), "fill_uninitialized_memory", None)
    return "|".join([f"grad={torch.is_grad_enabled()}", f"autocast={auto}",
                     f"det={torch.are_deterministic_algorithms_enabled()}",
                     f"det_warn={torch.is_deterministic_algorithms_warn_only_enabled()}", f"det_fill={fill}",
                     f"dtype={torch.get_default_dtype()}", f"device={torch.get_default_device()}",
                     f"matmul={torch.get_float32_matmul_precision()}", *_flags(), *aot])


def symbolic(gm: torch.fx.GraphModule, inputs) -> list:
    """Per input, Dynamo's fake tensor where each symbol of its sizes is a SymInt input (the entry's guards check
    those), else None: a graph gone dynamic then hits at every size they admit, not at the example's alone (#35)."""
    free = lambda v: v.node.expr.free_symbols if isinstance(v, torch.SymInt) else set()   # noqa: E731
    known, fakes = set().union(*map(free, inputs)), [n.meta.get("example_value") for n in gm.graph.nodes
                                                     if n.op == "placeholder"]
    fakes = [f if isinstance(x, torch.Tensor) and isinstance(f, torch.Tensor) and f.dim() == x.dim() else None
             for x, f in zip(inputs, fakes if len(fakes) == len(inputs) else [None] * len(inputs))]
    syms = [f is not None and set().union(*map(free, (*f.shape, *f.stride(), f.storage_offset()))) for f in fakes]
    return [f if s and s <= known else None for f, s in zip(fakes, syms)]


def graph_key(gm: torch.fx.GraphModule, inputs, opts, options_key: str, target: str, ident: str = None) -> str:
    """``options_key``: ``pipeline.cache_key``; ``ident``: ``identity.graph_identity(gm)`` (None: computed here)."""
    ident = identity.graph_identity(gm) if ident is None else ident
    parts = [gm.code, ident, *map(_input, inputs, symbolic(gm, inputs)), _state(), options_key, target, _versions(),
             _devices(inputs)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


# options holding callables: the custom passes, a runtime estimator
CALLABLE_OPTIONS = tuple(f.name for f in dataclasses.fields(Options)
                         if isinstance(f.metadata.get("choices"), tuple) and "callable" in f.metadata["choices"])


def unkeyed_pass(fn) -> str:
    """Why custom pass (or callable option) ``fn`` cannot key a stored compile ('' when it can): only its
    ``uuid()`` keys it, as under Inductor (its source would miss helpers, closures and bound state)."""
    uuid, name = getattr(fn, "uuid", None), getattr(fn, "__qualname__", type(fn).__name__)
    if callable(uuid):
        try:
            value = uuid()
        except Exception as e:   # noqa: BLE001  (the user's method)
            return f"custom pass {name}: uuid() raised {type(e).__name__}: {e}"
        return "" if value is not None else f"custom pass {name}: uuid() returned None"
    return (f"custom pass {name} has no uuid() method (a pass is keyed by its uuid(); give it one "
            f"that changes whenever the pass or a helper it calls changes)")


def bypass(gm: torch.fx.GraphModule, inputs, opts, frozen: bool, registered=()) -> str:
    """Why this graph is compiled without the cache ('' when it may use it)."""
    hooks = [getattr(opts, h) for h in CALLABLE_OPTIONS]
    for fn in [h for h in hooks if callable(h) and not isinstance(h, str)] + [p.fn for p in registered]:
        why = unkeyed_pass(fn)
        if why:
            return why
    if frozen:
        return "freezing turns this process's parameters into constants"
    if opts.graphs_asked:
        return "CUDA graphs record this process's memory"
    if next(iter(gm.parameters()), None) is not None or next(iter(gm.buffers()), None) is not None:
        return "the graph holds parameters or buffers of its own"
    seen = {}
    for i, x in enumerate(inputs):
        if isinstance(x, torch.Tensor):
            if type(x) not in (torch.Tensor, torch.nn.Parameter) and type(x).__name__ != "FakeTensor":
                return f"input {i} is a tensor subclass ({type(x).__name__})"
            try:
                ref = x.untyped_storage()._cdata
            except Exception:   # noqa: BLE001  (storage of a subclass or of a functional tensor)
                return f"input {i} has no plain storage"
            if ref in seen:
                return f"inputs {seen[ref]} and {i} share storage"
            seen[ref] = i
        elif not isinstance(x, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)):
            return f"input {i} is a {type(x).__name__}"
    return "functionalized random ops" if torch._functorch.config.functionalize_rng_ops else ""
