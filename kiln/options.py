"""kiln's options: one frozen dataclass, scoped overrides through a context variable.

Every field has a default, one line of help and an environment variable (``KILN_<NAME>``).
``kiln.config.patch(**overrides)`` is a context manager and a decorator; it never mutates a
module global, so overrides end with their scope and do not leak between threads or compiles.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import inspect
import os
from dataclasses import dataclass, field
from typing import Any, Optional


class OptionError(ValueError):
    """An option name or value is not valid; the message lists what is."""


def _opt(default, help, choices=None, env=True, cache=True):
    return field(default=default, metadata={"help": help, "choices": choices, "env": env, "cache": cache})


HOOK = (type(None), "callable")


@dataclass(frozen=True)
class Options:
    # graph passes
    pattern_matcher: bool = _opt(True, "run kiln's built-in pattern rewrites (user hooks always run)")
    cse: bool = _opt(True, "common-subexpression elimination on the joint and inference graphs")
    pad_matmuls: str = _opt("auto", "pad misaligned large matmuls to tensor-core alignment: 'auto' (CUDA only), "
                            "'always' (any device), 'never'", ("auto", "always", "never"))
    pre_grad_custom_pass: Any = _opt(None, "callable(graph) run on Dynamo's torch-level graph", HOOK, env=False)
    joint_custom_pre_pass: Any = _opt(None, "callable(graph) run first on the joint graph", HOOK, env=False)
    joint_custom_post_pass: Any = _opt(None, "callable(graph) run last on the joint graph", HOOK, env=False)
    post_grad_custom_pre_pass: Any = _opt(None, "callable(graph) run first on forward/backward graphs", HOOK, env=False)
    post_grad_custom_post_pass: Any = _opt(None, "callable(graph) run last on forward/backward graphs", HOOK, env=False)
    # freezing and layout
    freezing: bool = _opt(False, "inference: turn parameters into constants and fold them")
    freezing_discard_parameters: bool = _opt(False, "with freezing: drop the eager module's parameters")
    layout_optimization: bool = _opt(True, "pick channels-last for convolution nets")
    keep_output_stride: bool = _opt(True, "user-visible outputs keep eager strides")
    cpp_wrapper: bool = _opt(False, "accepted for compatibility; kiln runs its Python wrapper")
    # partitioner
    activation_memory_budget: float = _opt(1.0, "fraction of the runtime-optimal saved bytes to keep, in [0, 1]")
    activation_memory_budget_runtime_estimator: Any = _opt(
        "flops", "how recompute cost is estimated: 'flops', 'profile' or callable(node)",
        ("flops", "profile", "callable"))
    activation_memory_limit: Any = _opt(None, "cap on modelled peak activation memory, bytes or '4GiB'")
    partitioner: str = _opt("mincut", "'mincut' (remat) or 'default' (save what the backward needs)",
                            ("mincut", "default"))
    # code generation
    codegen: str = _opt("auto", "kernel target: 'auto' (triton on cuda, aten on cpu), 'aten', 'triton'",
                        ("auto", "aten", "triton"))
    max_autotune: bool = _opt(False, "benchmark launch configurations for generated kernels")
    compile_workers: int = _opt(-1, "processes compiling Triton kernels before their first launch: "
                                    "-1 auto (CUDA only), 0 off")
    mode: Optional[str] = _opt(None, "torch.compile mode: None, 'default', 'reduce-overhead', 'max-autotune'",
                               (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"))
    # debugging
    debug: int = _opt(0, "0..5: stage names, graphs, remat decisions, kernels, rules", cache=False)
    dump_dir: Optional[str] = _opt(None, "write every stage's graph, kernels and a repro here", cache=False)
    verify: bool = _opt(False, "run graph lint after every stage", cache=False)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            _check_value(f, getattr(self, f.name))

    def replace(self, **overrides) -> "Options":
        _check_names(overrides)
        return dataclasses.replace(self, **overrides)

    def cache_key(self) -> str:
        """Hash of every field that changes the output (user passes by their uuid() or source)."""
        h = hashlib.sha256()
        for f in dataclasses.fields(self):
            if f.metadata.get("cache"):
                h.update(f"{f.name}={_stable_repr(getattr(self, f.name))};".encode())
        from kiln.passes.registry import cache_key as registered_passes_key
        h.update(registered_passes_key().encode())
        return h.hexdigest()[:16]


ENV_NAMES = {f.name: "KILN_" + f.name.upper() for f in dataclasses.fields(Options)}
ENV_NAMES["debug"] = "KILN_DEBUG"
ENV_NAMES["dump_dir"] = "KILN_DUMP"


def _stable_repr(value) -> str:
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if hasattr(value, "uuid"):
        return f"uuid:{value.uuid()}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_stable_repr(v) for v in value) + "]"
    try:
        return "src:" + hashlib.sha256(inspect.getsource(value).encode()).hexdigest()[:16]
    except (OSError, TypeError):
        return f"id:{id(value)}"


def _check_names(overrides):
    valid = {f.name for f in dataclasses.fields(Options)}
    for name in overrides:
        if name not in valid:
            near = [v for v in sorted(valid) if name.split("_")[0] in v]
            raise OptionError(f"unknown kiln option {name!r}"
                              + (f"; did you mean one of {near}?" if near else "")
                              + f"; valid options: {sorted(valid)}")


def _check_value(f, value):
    choices = f.metadata.get("choices")
    name = f.name
    if name == "activation_memory_budget":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            raise OptionError(f"activation_memory_budget={value!r} is outside the valid range [0, 1]")
        return
    if name == "activation_memory_limit":
        if value is not None:
            parse_bytes(value)
        return
    if choices is HOOK:
        if value is not None and not callable(value):
            raise OptionError(f"{name}={value!r} must be None or a callable taking a torch.fx.Graph")
        return
    if choices is not None:
        ok = value in choices or ("callable" in choices and callable(value))
        if not ok:
            raise OptionError(f"{name}={value!r} is not valid; choose one of {list(choices)}")
        return
    default = f.default
    if isinstance(default, bool) and not isinstance(value, bool):
        raise OptionError(f"{name}={value!r} must be True or False")
    if name == "debug" and not (isinstance(value, int) and 0 <= value <= 5):
        raise OptionError(f"debug={value!r} must be an integer in 0..5")
    if isinstance(default, int) and not isinstance(default, bool) and (isinstance(value, bool) or not isinstance(value, int)):
        raise OptionError(f"{name}={value!r} must be an integer")
    if name == "compile_workers" and value < -1:
        raise OptionError(f"compile_workers={value!r}: use -1 (as many as suit the machine), 0 (off) or a "
                          f"number of processes")


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(value) -> int:
    """'4GiB' -> 4294967296; an int passes through."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        s = value.strip().upper().replace(" ", "")
        num = s.rstrip("KMGTIB")
        unit = s[len(num):]
        if num and unit in _UNITS:
            try:
                return int(float(num) * _UNITS[unit])
            except ValueError:
                pass
    raise OptionError(f"activation_memory_limit={value!r} is not a byte count; use an int or a string "
                      f"like '4GiB' or '512MB' (units: {sorted(k for k in _UNITS if k)})")


def parse_value(name: str, raw: str):
    """Option ``name``'s value from text (an environment variable, a command line): read as the type
    of its default (bools accept 1/true/yes/on)."""
    _check_names([name])
    default = {f.name: f.default for f in dataclasses.fields(Options)}[name]
    if isinstance(default, bool):
        return raw.lower() in ("1", "true", "yes", "on")
    if isinstance(default, int):
        return int(raw)
    if isinstance(default, float):
        return float(raw)
    return raw


def _from_env() -> dict:
    out = {}
    for f in dataclasses.fields(Options):
        if not f.metadata.get("env"):
            continue
        raw = os.environ.get(ENV_NAMES[f.name])
        if raw is None or raw == "":
            continue
        out[f.name] = parse_value(f.name, raw)
    return out


_OVERRIDES: contextvars.ContextVar[dict] = contextvars.ContextVar("kiln_options", default={})


_ACTIVE: contextvars.ContextVar[Optional[Options]] = contextvars.ContextVar("kiln_active", default=None)


@contextlib.contextmanager
def using(opts: Options):
    """Mark ``opts`` as the options of the compile running in this scope (read by kiln.debug)."""
    token = _ACTIVE.set(opts)
    try:
        yield opts
    finally:
        _ACTIVE.reset(token)


def active() -> Options:
    """The options of the compile in progress, else ``current()``."""
    opts = _ACTIVE.get()
    return opts if opts is not None else current()


def current(**extra) -> Options:
    """The options in force here: defaults < environment < config.patch scopes < extra."""
    merged = {**_from_env(), **_OVERRIDES.get(), **extra}
    _check_names(merged)
    return Options(**merged)


class _Patch(contextlib.ContextDecorator):
    def __init__(self, overrides):
        _check_names(overrides)
        Options(**{**_OVERRIDES.get(), **overrides})  # validate values now
        self.overrides = overrides
        self._tokens = []

    def __enter__(self):
        self._tokens.append(_OVERRIDES.set({**_OVERRIDES.get(), **self.overrides}))
        return self

    def __exit__(self, *exc):
        _OVERRIDES.reset(self._tokens.pop())
        return False


def patch(**overrides) -> _Patch:
    """Override options within a scope: ``with kiln.config.patch(freezing=True): ...`` or as a decorator."""
    return _Patch(overrides)


def describe() -> str:
    """One line per option: name, default, env var, help."""
    rows = []
    for f in dataclasses.fields(Options):
        env = ENV_NAMES[f.name] if f.metadata.get("env") else "-"
        rows.append(f"{f.name:45s} {f.default!r:10} {env:45s} {f.metadata['help']}")
    return "\n".join(rows)
