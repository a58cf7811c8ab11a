"""How each backend compiles a model, applies a memory budget, and gets fresh caches.

- ``eager``: the model itself.
- ``inductor``: ``torch.compile(model, options=case_options)``; the budget is applied with
  ``torch._functorch.config.patch(activation_memory_budget=b)`` around every call.
- ``kiln``: ``torch.compile(model, backend="kiln", options={**case_options, "activation_memory_budget": b})``.
- ``kiln-cg`` / ``inductor-cg``: the same with ``mode="reduce-overhead"`` (CUDA graphs).
- ``kiln-auto``: kiln with ``cuda_graphs="auto"`` (a graph is captured where a timed call shows it host-bound).

``fresh_caches()`` points Inductor, Triton and kiln at an empty temporary cache so that "cold"
compile times are cold; it links Inductor's precompiled C++ headers from the user's cache, since
they depend on the toolchain, not on the graph.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile

import torch

BACKENDS = ("eager", "inductor", "kiln", "inductor-cg", "kiln-cg", "kiln-auto", "aot_eager")
FRESH_ROOT = "KILN_BENCH_FRESH_ROOT"   # set by fresh_caches: rows make their own cache dirs under it


class UnknownBackendError(ValueError):
    """A ``--backends`` name is not one of BACKENDS; the message lists them."""


def check_names(names) -> list:
    """Validate backend names; returns them as a list."""
    bad = [n for n in names if n not in BACKENDS]
    if bad:
        raise UnknownBackendError(f"unknown backend(s) {bad}; choose from {list(BACKENDS)}")
    return list(names)


def compile_model(backend: str, model, options=None, budget=None):
    """The callable to measure for ``backend`` (compilation happens at its first call)."""
    options = dict(options or {})
    if backend == "eager":
        return model
    if backend == "inductor":
        return torch.compile(model, options=options or None)
    if backend == "aot_eager":   # Dynamo and AOTAutograd alone: the floor both compilers stand on
        return torch.compile(model, backend="aot_eager")
    if backend == "inductor-cg":
        return torch.compile(model, mode="reduce-overhead") if not options else \
            torch.compile(model, options={**options, "triton.cudagraphs": True})
    if backend in ("kiln", "kiln-cg", "kiln-auto"):
        import kiln  # noqa: F401  registers the "kiln" backend with Dynamo
        if budget is not None:
            options["activation_memory_budget"] = budget
        if backend == "kiln-cg":
            options["mode"] = "reduce-overhead"
        if backend == "kiln-auto":
            options["cuda_graphs"] = "auto"
        return torch.compile(model, backend="kiln", options=options or None)
    raise UnknownBackendError(f"unknown backend {backend!r}; choose from {list(BACKENDS)}")


@contextlib.contextmanager
def scope(backend: str, budget=None, dirs=None):
    """Context in force while ``backend`` compiles and runs: Inductor reads its budget from functorch;
    under ``fresh_caches`` each compiled row gets its own empty Triton and kiln kernel directories, and
    kiln forgets the kernels it compiled for earlier rows, so that every row's cold compile is cold
    (Inductor's in-process caches cannot be reset from here: its later rows may be warmer). Yields the
    directories (None without ``fresh_caches``); ``dirs``: enter a row's directories again (a warm compile)."""
    with contextlib.ExitStack() as stack:
        if backend.startswith("inductor") and budget is not None:
            import torch._functorch.config as fconfig
            stack.enter_context(fconfig.patch(activation_memory_budget=budget))
        root = os.environ.get(FRESH_ROOT)
        if root and backend != "eager":
            dirs = dirs or {"TRITON_CACHE_DIR": tempfile.mkdtemp(prefix="triton-", dir=root),
                            "KILN_KERNEL_DIR": tempfile.mkdtemp(prefix="kernels-", dir=root)}
            stack.enter_context(_env(**dirs))
            if backend.startswith("kiln"):
                from kiln_bench._internal import kernels as kernel
                kernel.reset()
        yield dirs


@contextlib.contextmanager
def _env(**values):
    """Set environment variables for the scope, restoring (or removing) them afterwards."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def versions() -> dict:
    """Versions of torch, triton and kiln (None where missing)."""
    out = {"torch": torch.__version__, "triton": None, "kiln": None}
    try:
        import triton
        out["triton"] = triton.__version__
    except Exception:
        pass
    try:
        import kiln
        out["kiln"] = getattr(kiln, "__version__", "?")
    except Exception as e:  # kiln not importable yet: the kiln rows will say why
        out["kiln"] = f"unavailable: {type(e).__name__}"
    return out


def _prime_fn(x):
    return torch.sigmoid(x) * x + 1.0


def prime(backends, device: str) -> dict:
    """Compile one trivial function per backend so process start-up (imports, worker pools,
    toolchain checks) is not charged to the first case. Returns ``{backend: error or None}``."""
    errors = {}
    for b in backends:
        if b == "eager":
            continue
        torch._dynamo.reset()
        try:
            x = torch.randn(64, device=device, requires_grad=True)
            compile_model(b, _prime_fn)(x).sum().backward()
            errors[b] = None
        except Exception as e:
            errors[b] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    torch._dynamo.reset()
    return errors


def _template_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kiln-bench", f"inductor-primed-{torch.__version__}")


def save_template(root) -> None:
    """Keep the primed Inductor cache (toolchain checks and the trivial prime function only) so the
    next fresh run starts from it instead of re-running Inductor's C++ ISA checks."""
    if root is None:
        return
    src, dst = os.path.join(root, "inductor"), _template_dir()
    if os.path.isdir(src) and not os.path.isdir(dst):
        tmp = dst + f".tmp{os.getpid()}"
        try:
            shutil.copytree(src, tmp, symlinks=True)
            os.rename(tmp, dst)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)


def _default_inductor_cache() -> str:
    """Inductor's default cache folder (its documented default), without importing Inductor."""
    import getpass
    env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if env:
        return env
    user = re.sub(r"[\\/:*?\"<>|]", "_", getpass.getuser())
    return os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")


@contextlib.contextmanager
def fresh_caches(enabled: bool = True):
    """Point TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR and KILN_CACHE_DIR at a new temp dir.

    The Inductor dir starts as a copy of the primed template when one exists (see ``save_template``),
    else empty with the user's precompiled C++ headers linked in; no graph of any case is cached.
    """
    if not enabled:
        yield None
        return
    root = tempfile.mkdtemp(prefix="kiln-bench-")
    ind = os.path.join(root, "inductor")
    try:
        if os.path.isdir(_template_dir()):
            shutil.copytree(_template_dir(), ind, symlinks=True)
        else:
            pch = os.path.join(_default_inductor_cache(), "precompiled_headers")
            os.makedirs(pch, exist_ok=True)
            os.makedirs(ind)
            os.symlink(pch, os.path.join(ind, "precompiled_headers"))
    except Exception:
        os.makedirs(ind, exist_ok=True)
    try:
        with _env(TORCHINDUCTOR_CACHE_DIR=ind, TRITON_CACHE_DIR=os.path.join(root, "triton"),
                  KILN_CACHE_DIR=os.path.join(root, "kiln"), **{FRESH_ROOT: root}):
            yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)
