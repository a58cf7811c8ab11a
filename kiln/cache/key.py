"""The compile cache's key: everything a compiled graph depends on, hashed.

- the graph: the code of Dynamo's GraphModule (its node names come from the user's source, so they are
  the same in every process) and, per input, its kind, dtype, device, sizes and strides (symbols by
  name under dynamic shapes), storage offset and whether it requires grad;
- the state a trace reads: grad mode, autocast, deterministic algorithms;
- the options that change what a compile produces (``Options.cache_key``) with the passes registered
  through ``kiln.passes.register`` (by their uuid() or source), and the resolved target;
- the versions: kiln's own source (a hash of its files, so an edited checkout misses), torch, Triton,
  Python, and for C++ kernels the compiler and the host's CPU flags; the CUDA device's name and
  capability for CUDA graphs.

``bypass`` says why a graph is not cached at all (the cache stores no AOTAutograd wrappers for input
subclasses, aliased inputs or module-held parameters; freezing and CUDA graphs keep process state).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import inspect
import os
import platform

import torch

from kiln.options import HOOK, Options
from kiln.runtime import cpp_build

KILN_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.lru_cache(maxsize=None)
def kiln_source_hash() -> str:
    """A hash of every kiln source file: a checkout that changed compiles afresh."""
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


def _input(x) -> str:
    if isinstance(x, torch.Tensor):
        return (f"T({x.dtype},{x.device},{tuple(str(s) for s in x.shape)},{tuple(str(s) for s in x.stride())},"
                f"{x.storage_offset()},{x.requires_grad},{x.layout},{type(x).__name__ == 'Parameter'})")
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"S({type(x).__name__},{x.node.expr})"
    return f"{type(x).__name__}({x!r})"


def _devices(inputs, target: str, opts) -> str:
    out = []
    if target == "cpp":
        cxx = cpp_build.find_compiler(opts)
        out.append(f"cxx={cpp_build.compiler_version(cxx) if cxx else ''}|isa={cpp_build.host_isa()}")
    for i in sorted({t.device.index or 0 for t in inputs if isinstance(t, torch.Tensor) and t.device.type == "cuda"}):
        out.append(f"cuda{i}={torch.cuda.get_device_name(i)}|{torch.cuda.get_device_capability(i)}")
    return "|".join(out)


def _state() -> str:
    auto = []
    for dev in ("cpu", "cuda"):
        try:
            if torch.is_autocast_enabled(dev):
                auto.append(f"{dev}:{torch.get_autocast_dtype(dev)}")
        except (AttributeError, RuntimeError, TypeError):
            pass
    return f"grad={torch.is_grad_enabled()}|autocast={auto}|det={torch.are_deterministic_algorithms_enabled()}"


def graph_key(gm: torch.fx.GraphModule, inputs, opts, options_key: str, target: str) -> str:
    """``options_key``: ``pipeline.cache_key`` (the options and the registered passes)."""
    parts = [gm.code, *(_input(x) for x in inputs), _state(), options_key, target, _versions(),
             _devices(inputs, target, opts)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


HOOKS = tuple(f.name for f in dataclasses.fields(Options) if f.metadata.get("choices") is HOOK)   # custom passes


def unkeyed_pass(fn) -> str:
    """Why custom pass ``fn`` cannot key a stored compile ('' when it can): a pass is known by its
    ``uuid()``, or by its source when it is a plain function; a closure or bound state could differ
    between processes behind the same source."""
    if callable(getattr(fn, "uuid", None)):
        return ""
    if inspect.isfunction(fn) and not fn.__closure__ and not fn.__defaults__ and not fn.__kwdefaults__:
        return ""
    return f"custom pass {getattr(fn, '__qualname__', type(fn).__name__)} has no uuid() (closures and objects need one)"


def bypass(gm: torch.fx.GraphModule, inputs, opts, frozen: bool, registered=()) -> str:
    """Why this graph is compiled without the cache ('' when it may use it). ``registered``: the
    passes registered through ``kiln.passes.register`` (a snapshot)."""
    for fn in [getattr(opts, h) for h in HOOKS] + [p.fn for p in registered]:
        why = unkeyed_pass(fn) if fn is not None else ""
        if why:
            return why
    if frozen:
        return "freezing turns this process's parameters into constants"
    if opts.mode == "reduce-overhead":
        return "CUDA graphs record this process's memory"
    if next(iter(gm.parameters()), None) is not None or next(iter(gm.buffers()), None) is not None:
        return "the graph holds parameters or buffers of its own"
    seen = {}
    for i, x in enumerate(inputs):
        if isinstance(x, torch.Tensor):
            if type(x) not in (torch.Tensor, torch.nn.Parameter) and not _is_fake(x):
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
    if torch._functorch.config.functionalize_rng_ops:
        return "functionalized random ops"
    return ""


def _is_fake(x) -> bool:
    return type(x).__name__ == "FakeTensor"
