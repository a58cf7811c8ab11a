"""What AOTAutograd knows about a compiled graph, recorded on a miss and put back together on a hit.

AOTAutograd wraps the compiled forward and backward in runtime wrappers: an ``autograd.Function``
that saves what the backward needs and detaches inputs whose gradient is None, and the code that
replays input mutations and regenerates aliased outputs. Those come from its metadata
(``ViewAndMutationMeta``) and a few counts, all known after a miss: ``Recorder`` collects them
from kiln's own compilers (the metadata from the tracing context, the counts from the forward and
backward graphs, as AOTAutograd computes them). A hit runs the same post-compile steps, in the
order AOTAutograd runs them, on the stored compiled graphs, so no tracing, no pass and no
partitioning happens (``compat.aot_runtime_wrappers`` hides the differences between torch releases).
"""
from __future__ import annotations

import threading

import torch

from kiln import compat
from kiln.debug import log


class Recorder:
    """Collects a miss's parts; ``entry()`` is the dict the cache stores once they are all there
    (forward and backward, or inference)."""

    def __init__(self, guards_expr_fn):
        self.parts: dict = {}
        self.meta = None
        self.counts: dict = {}
        self.guards_expr_fn = guards_expr_fn
        self.lock = threading.Lock()
        self.failed = ""   # why this graph cannot be stored
        self.closed = False   # stored, or given up
        self.traced = False   # AOTAutograd has returned (its metadata made runtime-safe)

    def metadata(self):
        """Take the metadata of the graph being compiled (set by AOTAutograd before it calls the
        forward or inference compiler; with no tensor subclass, the metadata its wrappers use)."""
        ctx = torch._guards.TracingContext.try_get()
        self.meta = getattr(ctx, "fw_metadata", None)
        if self.meta is None:
            self.failed = "no AOTAutograd metadata in the tracing context"

    def forward_graph(self, gm, n_user: int) -> None:
        """The forward's saved values, counted as AOTAutograd does (before kiln lowers the graph)."""
        outs = gm.graph.output_node().args[0]
        saved = list(outs)[n_user:]
        self.counts["n_saved"] = len(saved)
        self.counts["n_symints"] = sum(1 for o in saved if isinstance(getattr(o, "meta", {}).get("val"),
                                                                   (torch.SymInt, torch.SymFloat, torch.SymBool)))

    def backward_graph(self, gm) -> None:
        """Inputs AOTAutograd detaches: non-leaf inputs that require grad and get no gradient."""
        outs = list(gm.graph.output_node().args[0])
        info = self.meta.input_info if self.meta is not None else []
        detach = []
        for i, (o, inp) in enumerate(zip(outs, info)):
            in_graph = getattr(inp, "mutation_type", None) == _mutated_in_graph() and \
                getattr(inp, "mutates_storage_metadata", False)
            if o is None and not in_graph and inp.requires_grad and not inp.is_leaf:
                detach.append(i)
        self.counts["detach"] = detach

    def add(self, kind: str, part) -> None:
        with self.lock:
            self.parts[kind] = part

    def entry(self):
        """The entry to store, or None while parts are missing or when the graph cannot be stored."""
        kinds = set(self.parts)
        if self.failed or self.meta is None or not (kinds == {"inference"} or kinds == {"forward", "backward"}):
            return None
        try:
            expr = self.guards_expr_fn()
        except Exception as e:   # noqa: BLE001  (a guard torch cannot print)
            self.failed = f"guards: {type(e).__name__}: {e}"
            return None
        return {"parts": dict(self.parts), "meta": self.meta, "counts": dict(self.counts), "guards": expr}


def _mutated_in_graph():
    from torch._functorch._aot_autograd.schemas import MutationType
    return MutationType.MUTATED_IN_GRAPH


def rebuild(entry: dict, forward, backward, inference):
    """The callable AOTAutograd would have returned, from stored ``entry`` and the graphs loaded
    again (``runtime.load.Compiled``); non-boxed, as ``aot_module_simplified``'s."""
    meta = entry["meta"]
    counts = entry["counts"]
    training = inference is None
    fn = compat.aot_runtime_wrappers(
        forward if training else inference, backward if training else None, meta,
        n_saved=counts.get("n_saved"), n_symints=counts.get("n_symints", 0),
        detach=counts.get("detach", []))

    def forward_call(*args):
        return fn(list(args))
    log(2, f"cache: rebuilt AOTAutograd's wrappers ({'training' if training else 'inference'})")
    return torch._dynamo.disable(forward_call, reason="kiln: a graph loaded from the compile cache")
