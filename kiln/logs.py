"""kiln in torch's logging (``torch._logging``): the ``kiln`` log, kiln's artifacts, structured-trace entries.

``TORCH_LOGS=kiln`` shows kiln's INFO messages (stages and times, the compile-time report, fallbacks), ``+kiln``
the DEBUG ones too (graphs, remat decisions, kernel plans, rules). Artifacts: torch's ``output_code`` (kiln's
wrappers and kernels), ``kiln_plans`` and ``kiln_remat`` (also shown under ``+kiln``). torch rejects names it does
not know while ``import torch`` reads ``TORCH_LOGS``, before kiln can add its own (pytorch/pytorch#173759): kiln's
artifacts are named in a program, ``torch._logging.set_logs(modules={"kiln_plans": True})``. ``KILN_DEBUG``
prints what torch's settings do not show (``kiln.debug.log``). A structured trace (``TORCH_TRACE``, tlparse) gets
``artifact`` entries named ``kiln_*`` under the compile that made them (``trace``).

While a compile that the compile cache will store runs on a thread (``active``), what it logs and traces is
also added to its record (``recording``), which a cache hit replays (``kiln.debug.Trace.replay``).
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import threading

NAME = "kiln"
ARTIFACTS = {
    "kiln_plans": "kiln's fused kernel plans (what each generated kernel loads, reduces and stores)",
    "kiln_remat": "kiln's partitioner: which activations are saved and which the backward recomputes",
}

_LOGGERS: dict = {}   # artifact name (None: the kiln log) -> logging.Logger
_ACTIVE = threading.local()   # .stack: the compiles running on this thread (objects with .record), innermost last


def register() -> bool:
    """Register the ``kiln`` log and kiln's artifacts with torch's logging (once; True when registered).
    A torch whose logging lacks these functions leaves kiln printing through ``KILN_DEBUG`` alone."""
    try:
        from torch._logging import _internal as tl
        registry = tl.log_registry
        fresh = not registry.is_log(NAME)
        if fresh:
            tl.register_log(NAME, NAME)
        for name, help in ARTIFACTS.items():
            if not registry.is_artifact(name):
                tl.register_artifact(name, help, visible=True)
        # torch set up its handlers before kiln was imported; when TORCH_LOGS names kiln, torch itself is
        # importing kiln now and sets up the kiln log after this returns
        if fresh and not _named_in_torch_logs():
            tl._init_logs()
        return True
    except Exception:   # a debugging aid never stops kiln from loading
        return False


def _named_in_torch_logs() -> bool:
    return re.search(r"(^|,)\s*[+-]?kiln(\.|\s*,|\s*$)", os.environ.get("TORCH_LOGS", "")) is not None


def logger(artifact: str | None = None) -> logging.Logger:
    """The ``kiln`` log, or the logger of one artifact (``kiln_plans``, ``kiln_remat``, ``output_code``)."""
    lg = _LOGGERS.get(artifact)
    if lg is None:
        lg = logging.getLogger(NAME)
        if artifact is not None:
            try:
                from torch._logging import getArtifactLogger
                lg = getArtifactLogger(NAME, artifact)
            except Exception:   # not registered (an older torch): the kiln log itself
                pass
        _LOGGERS[artifact] = lg
    return lg


def enabled(py_level: int, artifact: str | None = None) -> bool:
    """Whether torch's logging settings show a ``py_level`` message of ``artifact`` (None: the kiln log)."""
    lg = logger(artifact)
    return lg.isEnabledFor(py_level) and lg.hasHandlers()


def tracing() -> bool:
    """Whether a structured trace is being written (``TORCH_TRACE``, ``TORCH_COMPILE_DEBUG``, a handler a
    test added): the payloads of ``trace`` entries are only computed then."""
    try:
        from torch._logging._internal import trace_log
    except ImportError:
        return False
    return any(_writes_trace(h) for h in trace_log.handlers)


def _writes_trace(handler) -> bool:
    if type(handler).__module__.startswith("_pytest"):   # pytest's capture handlers join every non-propagating log
        return False
    # torch's lazy handler without a folder removes itself on its first record (outside Meta's servers)
    return getattr(handler, "root_dir", "") is not None


@contextlib.contextmanager
def active(compile_):
    """The scope in which ``compile_`` (a ``kiln.debug.Trace``) compiles on this thread: ``recording`` returns
    its ``record`` there."""
    stack = _ACTIVE.__dict__.setdefault("stack", [])
    stack.append(compile_)
    try:
        yield
    finally:
        stack.pop()


def recording():
    """The record (``kiln.debug.Record``) of the compile running on this thread, None when there is none or
    nothing records it (the compile cache is off, or this is a hit)."""
    stack = getattr(_ACTIVE, "stack", None)
    return stack[-1].record if stack else None


def compile_id():
    """The id of the Dynamo compile in progress (None outside one): entries written later, a first call's
    report or a backward's, name it so that tlparse files them under their compile."""
    try:
        import torch._guards
        return torch._guards.CompileContext.current_compile_id()
    except Exception:
        return None


def trace(name: str, payload_fn, encoding: str = "string", cid=None) -> None:
    """A structured-trace ``artifact`` entry ``name`` (``kiln_*``) whose payload is ``payload_fn()`` (text,
    or a dict with ``encoding="json"``); nothing is computed unless a trace is being written or the compile
    running on this thread records for the compile cache (``recording``)."""
    record = recording()
    if record is not None:
        payload = payload_fn()
        record.add("trace", name, payload, encoding)
        payload_fn = lambda: payload   # noqa: E731
    if not tracing():
        return
    name = re.sub(r"[^\w.-]", "_", name)   # tlparse names files after entries
    try:
        from torch._logging import trace_structured
        from torch._guards import CompileContext
        kwargs = {} if CompileContext.current_trace_id() is not None or cid is None else {"compile_id": cid}
        trace_structured("artifact", metadata_fn=lambda: {"name": name, "encoding": encoding},
                         payload_fn=payload_fn, **kwargs)
    except Exception as e:   # a debugging aid never stops a compile
        logger().debug("structured trace entry %s not written: %s", name, e)


register()
