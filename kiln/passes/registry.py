"""User graph passes by stage, scoped like options.

    handle = kiln.passes.register("joint_post", my_pass)    # until handle.remove()
    with kiln.passes.register("post_grad_pre", other):      # until the block ends
        torch.compile(fn, backend="kiln")(x)

A pass is ``fn(graph: torch.fx.Graph)`` editing the graph in place; passes of a stage run in registration
order. Registrations live in a context variable; ``cache_key()`` keys them (by ``uuid()``, else source).
"""
import contextvars
import hashlib
import inspect
import time
from typing import Callable, List, Optional, Tuple

import torch.fx as fx

from kiln.debug import log
from kiln.options import UserError

STAGES = ("pre_grad", "joint_pre", "joint_post", "post_grad_pre", "post_grad_post")


class RegistryError(ValueError, UserError):
    """A pass was registered for an unknown stage or is not callable; the message lists the stages."""


class PassHandle:
    """One registration: ``.remove()`` ends it; as a context manager it ends with the block."""

    def __init__(self, stage: str, fn: Callable, name: str):
        self.stage, self.fn, self.name = stage, fn, name

    def remove(self) -> None:
        _PASSES.set(tuple(h for h in _PASSES.get() if h is not self))

    def __enter__(self) -> "PassHandle":
        return self

    def __exit__(self, *exc) -> bool:
        self.remove()
        return False

    def __repr__(self):
        return f"PassHandle({self.stage!r}, {self.name!r})"


_PASSES: contextvars.ContextVar[Tuple[PassHandle, ...]] = contextvars.ContextVar("kiln_passes", default=())


def _check_stage(stage: str) -> None:
    if stage not in STAGES:
        raise RegistryError(f"unknown pass stage {stage!r}; choose one of {list(STAGES)}")


def register(stage: str, fn: Callable, name: Optional[str] = None) -> PassHandle:
    """Run ``fn(graph)`` at ``stage`` from now on (in this context); returns a removable handle."""
    _check_stage(stage)
    if not callable(fn):
        raise RegistryError(f"pass for stage {stage!r} must be callable(graph), got {type(fn).__name__}")
    handle = PassHandle(stage, fn, name or getattr(fn, "__name__", None) or type(fn).__name__)
    _PASSES.set(_PASSES.get() + (handle,))
    return handle


def snapshot() -> Tuple[PassHandle, ...]:
    """The registrations in force here (a compile keeps them for all of its graphs, the backward too)."""
    return _PASSES.get()


def passes_for(stage: str, registered=None) -> List[Tuple[str, Callable]]:
    """``[(name, fn), ...]`` registered for ``stage`` (in ``registered``, a ``snapshot``; None: here), in order."""
    _check_stage(stage)
    return [(h.name, h.fn) for h in (_PASSES.get() if registered is None else registered) if h.stage == stage]


def pass_identity(fn: Callable) -> str:
    """What a compile cache should hash for ``fn``: its ``uuid()``, else its source, else its name."""
    uuid = getattr(fn, "uuid", None)
    if callable(uuid):
        return f"uuid:{uuid()}"
    target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn)
    try:
        return "src:" + hashlib.sha256(inspect.getsource(target).encode()).hexdigest()[:16]
    except (OSError, TypeError):
        return f"name:{getattr(target, '__qualname__', repr(target))}"


def cache_key(registered=None) -> str:
    """A hash of every registered pass (stage, name, identity), in order (``registered``: a ``snapshot``)."""
    h = hashlib.sha256()
    for handle in (_PASSES.get() if registered is None else registered):
        h.update(f"{handle.stage}|{handle.name}|{pass_identity(handle.fn)};".encode())
    return h.hexdigest()[:16]


def run_stage(stage: str, graph_module: fx.GraphModule, hook_from_options: Optional[Callable] = None,
              registered=None) -> None:
    """Run the passes of ``stage`` on ``graph_module`` (each as ``fn(gm.graph)``), then recompile. The options
    hook runs before the registered passes, after them in ``*_post`` stages; KILN_DEBUG >= 2 logs each one."""
    passes = passes_for(stage, registered)
    if hook_from_options is not None:
        head, _, tail = stage.rpartition("_")   # joint_pre -> options.joint_custom_pre_pass
        hook = [(f"options.{head}_custom_{tail}_pass" if tail in ("pre", "post") else
                 f"options.{stage}_custom_pass", hook_from_options)]
        passes = passes + hook if tail == "post" else hook + passes
    if not passes:
        return
    graph = graph_module.graph
    for name, fn in passes:
        before = len(graph.nodes)
        start = time.perf_counter()
        try:
            fn(graph)
        except Exception as e:   # the traceback (on_error='raise', a failing backward) names the pass
            e.add_note(f"kiln: raised by custom pass {name!r} of stage {stage!r}")
            raise
        log(2, f"{stage}: pass {name}: {before} -> {len(graph.nodes)} nodes "
               f"({len(graph.nodes) - before:+d}) in {(time.perf_counter() - start) * 1000:.1f} ms")
    graph_module.recompile()
