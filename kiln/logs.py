"""kiln in torch's logging (``torch._logging``): the ``kiln`` log, kiln's artifacts, structured-trace entries.

``TORCH_LOGS=kiln`` shows kiln's INFO messages, ``+kiln`` the DEBUG ones too. torch rejects artifact names
it does not know while ``import torch`` reads ``TORCH_LOGS`` (pytorch/pytorch#173759): kiln's are named in
a program, ``torch._logging.set_logs(modules={"kiln_plans": True})``. What a compile the cache will store
logs and traces goes to its record too (``active``, ``recording``).
"""
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
    """Register the ``kiln`` log and kiln's artifacts with torch's logging (once; True when registered)."""
    try:
        from torch._logging import _internal as tl
        registry = tl.log_registry
        fresh = not registry.is_log(NAME)
        if fresh:
            tl.register_log(NAME, NAME)
        for name, help in ARTIFACTS.items():
            if not registry.is_artifact(name):
                tl.register_artifact(name, help, visible=True)
        # torch set up its handlers before kiln was imported (unless TORCH_LOGS names kiln: it imports it now)
        if fresh and not re.search(r"(^|,)\s*[+-]?kiln(\.|\s*,|\s*$)", os.environ.get("TORCH_LOGS", "")):
            tl._init_logs()
        return True
    except Exception:   # a debugging aid never stops kiln from loading
        return False


def logger(artifact: str | None = None) -> logging.Logger:
    """The ``kiln`` log, or the logger of one artifact (``kiln_plans``, ``kiln_remat``, ``output_code``)."""
    lg = _LOGGERS.get(artifact)
    if lg is None:
        lg = logging.getLogger(NAME)
        if artifact is not None:
            with contextlib.suppress(Exception):   # not registered (an older torch): the kiln log itself
                from torch._logging import getArtifactLogger
                lg = getArtifactLogger(NAME, artifact)
        _LOGGERS[artifact] = lg
    return lg


def enabled(py_level: int, artifact: str | None = None) -> bool:
    """Whether torch's logging settings show a ``py_level`` message of ``artifact`` (None: the kiln log)."""
    lg = logger(artifact)
    return lg.isEnabledFor(py_level) and lg.hasHandlers()


def tracing() -> bool:
    """Whether a structured trace is being written; pytest's capture handlers and torch's lazy handler without
    a folder (it removes itself on its first record outside Meta's servers) do not count."""
    try:
        from torch._logging._internal import trace_log
    except ImportError:
        return False
    return any(not type(h).__module__.startswith("_pytest") and getattr(h, "root_dir", "") is not None
               for h in trace_log.handlers)


@contextlib.contextmanager
def active(compile_):
    """The scope in which ``compile_`` (a ``kiln.debug.Trace``) compiles on this thread."""
    stack = _ACTIVE.__dict__.setdefault("stack", [])
    stack.append(compile_)
    try:
        yield
    finally:
        stack.pop()


def recording():
    """The record (``kiln.debug.Record``) of the compile running on this thread, or None."""
    stack = getattr(_ACTIVE, "stack", None)
    return stack[-1].record if stack else None


def compile_id():
    """The id of the Dynamo compile in progress (None outside one), for entries written after it."""
    try:
        import torch._guards
        return torch._guards.CompileContext.current_compile_id()
    except Exception:
        return None


def trace(name: str, payload_fn, encoding: str = "string", cid=None) -> None:
    """A structured-trace ``artifact`` entry ``name`` of ``payload_fn()`` (text, or a dict if ``json``),
    computed only when a trace is written or this thread's compile records (``recording``)."""
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
