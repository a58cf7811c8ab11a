"""The compile cache: graphs compiled by one process, reused by the next.

``open_graph`` decides whether a Dynamo graph may use the cache and keys it; ``Session.load`` returns a hit
(its shape guards checked and added to Dynamo's); on a miss the session stores the compiled graphs once
complete, signed. A directory that is not private, or an entry that cannot be written, turns the cache off.
Counters (``kiln.counters['cache']``): ``hit``, ``miss``, ``saved``, ``bypass``, ``off``, ``damaged``,
``guard_miss``, ``load_failed``, ``write_failed``, ``replayed``; a hit also adds the compile's
``counters['random']`` (random ops fused or left to ATen).
"""
import pickle
import threading

import torch

from kiln import compat
from kiln.cache import identity, key, serial, store
from kiln.debug import Record, counters, inspecting, log
from kiln.runtime import private


def status(opts):
    """``(directory, reason)``: the cache's directory (checked, made) and why the cache is off ('' when on)."""
    path = opts.cache_dir or store.default_dir()
    try:
        path = store.directory(opts.cache_dir)
    except (OSError, store.CacheDirError) as e:
        return path, f"directory not usable: {e}"
    return path, "" if opts.cache else "cache=False (KILN_CACHE=0)"


def open_graph(gm, inputs, opts, options_key: str, target: str, frozen: bool = False, registered=()):
    """A ``Session`` for this graph, or None when the cache is off or the graph is not cacheable."""
    if not opts.cache:
        return None
    why = key.bypass(gm, inputs, opts, frozen, registered)
    try:
        ident = "" if why else identity.graph_identity(gm)
    except identity.Unkeyable as e:
        why = str(e)
    except Exception as e:   # noqa: BLE001  (an object of the user's that fails to describe itself)
        why = f"the graph's identity could not be computed ({type(e).__name__}: {e})"
    if why:
        counters["cache"]["bypass"] += 1
        log(1, f"cache: not cached ({why})")
        return None
    try:
        root = store.directory(opts.cache_dir)
    except (OSError, store.CacheDirError) as e:
        private.warn_once(f"kiln: compile cache disabled: {e} (or turn it off: cache=False, KILN_CACHE=0)")
        counters["cache"]["off"] += 1
        return None
    return Session(root, key.graph_key(gm, inputs, opts, options_key, target, ident), opts, inputs)


class Session:
    def __init__(self, root: str, k: str, opts, inputs):
        # the SymInts only: the session lives as long as the compiled function; the tensors are real values
        self.root, self.key, self.opts = root, k, opts
        self.symints = [x for x in inputs if isinstance(x, torch.SymInt) and getattr(x.node, "hint", None) is not None]
        self.recorder = Recorder(self._guards_expr)
        self.random = dict(counters["random"])   # the random ops this compile fuses: counted again on a hit
        self.record = Record()   # what the compile shows, for a later hit to replay

    def _guards_expr(self):
        symints = self.symints
        if not symints:
            return None
        env = symints[0].node.shape_env
        pruned = getattr(env, "get_pruned_guards", None)
        guards = pruned(symints) if pruned is not None else None
        return env.produce_guards_expression(placeholders=symints, guards=guards)

    def load(self, trace=None):
        """The compiled callable of a hit (replaying what its compile showed to ``trace``), else None."""
        fn, shown = self._load()
        if fn is None:
            counters["cache"]["miss"] += 1
            if trace is not None:
                trace.record = self.record
        elif trace is not None and shown is not None and inspecting(trace):
            counters["cache"]["replayed"] += 1
            try:
                trace.replay(Record.unpack(shown), f"entry {private.PREFIX}{self.key}")
            except Exception as e:   # noqa: BLE001  (a debugging aid never fails a hit)
                log(1, f"cache: entry {self.key}: its compile's output could not be replayed ({type(e).__name__}: {e})")
        return fn

    def _load(self):
        """(the compiled callable, the stored ``Record``'s bytes) of a hit, else (None, None): a miss."""
        payload, why = store.read(self.root, self.key)
        if payload is None:
            if why != "missing":
                counters["cache"]["damaged"] += 1
                log(1, f"cache: entry {self.key} was damaged ({why}); deleted, compiling again")
            return None, None
        try:
            entry = pickle.loads(payload)
            symints = self.symints
            if entry["guards"] is not None:
                env = symints[0].node.shape_env
                if not env.evaluate_guards_expression(entry["guards"], [s.node.hint for s in symints]):
                    counters["cache"]["guard_miss"] += 1
                    log(2, f"cache: entry {self.key} holds other shapes")
                    return None, None
            parts = {k: serial.unpack(v, self.opts) for k, v in entry["parts"].items()}
            fn = rebuild(entry, parts.get("forward"), parts.get("backward"), parts.get("inference"))
            if entry["guards"] is not None:   # the same guards as a compile would add, now in Dynamo's
                env.evaluate_guards_expression(entry["guards"], symints)
        except Exception as e:   # noqa: BLE001  (a stale or foreign entry: compile as without the cache)
            counters["cache"]["load_failed"] += 1
            log(1, f"cache: entry {self.key} did not load ({type(e).__name__}: {e}); compiling again")
            return None, None
        counters["cache"]["hit"] += 1
        counters["random"].update(entry.get("random", {}))
        log(1, f"cache: hit {self.key}")
        return fn, entry.get("shown")

    def traced(self) -> None:
        """AOTAutograd is done with this graph (its metadata is final): save when complete."""
        self.recorder.traced = True
        self.save()

    def add(self, kind: str, compiled, units=()) -> None:
        """A compiled graph of this miss (``kind``: forward, backward, inference); saves when complete."""
        try:
            self.recorder.add(kind, serial.pack(compiled, units))
        except serial.NotCacheable as e:
            self.recorder.failed = str(e)
        self.save()

    def save(self) -> None:
        rec = self.recorder
        if rec.closed or not rec.traced:
            return
        entry = rec.entry()
        if entry is None:
            if rec.failed:
                rec.closed = True
                self.record.close()
                counters["cache"]["bypass"] += 1
                log(2, f"cache: not stored ({rec.failed})")
            return
        rec.closed = True
        rec.parts.clear()
        entry["shown"] = self.record.pack()
        entry["random"] = {k: n - self.random.get(k, 0) for k, n in counters["random"].items()}
        try:
            payload = serial.dumps(entry)
        except serial.NotCacheable as e:
            counters["cache"]["bypass"] += 1
            log(2, f"cache: not stored ({e})")
            return
        try:
            store.write(self.root, self.key, payload)
            store.evict(self.root, self.opts.cache_size_mb * (1 << 20))
        except OSError as e:
            counters["cache"]["write_failed"] += 1
            private.warn_once(f"kiln: compile cache: cannot write an entry to {self.root} ({e.strerror or e}); graphs "
                              f"compile again in every process. Set {store.HOW} to a writable directory of your own "
                              "(or turn the cache off: cache=False, KILN_CACHE=0)")
            log(1, f"cache: could not write entry {self.key}: {e}")
            return
        counters["cache"]["saved"] += 1
        log(2, f"cache: saved {self.key} ({len(payload)} bytes)")


# -- what AOTAutograd knows about a compiled graph --------------------------------------------------------
# AOTAutograd's runtime wrappers are built from its ``ViewAndMutationMeta`` and a few counts: ``Recorder``
# collects them on a miss; a hit runs the same post-compile steps (``compat.aot_runtime_wrappers``).
class Recorder:
    """Collects a miss's parts; ``entry()``: what the cache stores, once they are all there."""

    def __init__(self, guards_expr_fn):
        self.parts, self.counts, self.meta, self.guards_expr_fn = {}, {}, None, guards_expr_fn
        self.lock = threading.Lock()
        self.failed = ""   # why this graph cannot be stored
        self.closed = False   # stored, or given up
        self.traced = False   # AOTAutograd has returned (its metadata made runtime-safe)

    def metadata(self):
        """Take the metadata AOTAutograd set for the graph being compiled (that its wrappers use)."""
        ctx = torch._guards.TracingContext.try_get()
        self.meta = getattr(ctx, "fw_metadata", None)
        if self.meta is None:
            self.failed = "no AOTAutograd metadata in the tracing context"

    def forward_graph(self, gm, n_user: int) -> None:
        """The forward's saved values, counted as AOTAutograd does (before kiln lowers the graph)."""
        saved = list(gm.graph.output_node().args[0])[n_user:]
        self.counts["n_saved"] = len(saved)
        self.counts["n_symints"] = sum(1 for o in saved if isinstance(getattr(o, "meta", {}).get("val"),
                                                                   (torch.SymInt, torch.SymFloat, torch.SymBool)))

    def backward_graph(self, gm) -> None:
        """Inputs AOTAutograd detaches: non-leaf inputs that require grad and get no gradient."""
        from torch._functorch._aot_autograd.schemas import MutationType
        info = self.meta.input_info if self.meta is not None else []
        self.counts["detach"] = [
            i for i, (o, inp) in enumerate(zip(gm.graph.output_node().args[0], info))
            if o is None and inp.requires_grad and not inp.is_leaf and not (
                getattr(inp, "mutation_type", None) == MutationType.MUTATED_IN_GRAPH
                and getattr(inp, "mutates_storage_metadata", False))]

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


def rebuild(entry: dict, forward, backward, inference):
    """The (non-boxed) callable AOTAutograd would have returned, from ``entry`` and the loaded graphs."""
    counts, training = entry["counts"], inference is None
    fn = compat.aot_runtime_wrappers(
        forward if training else inference, backward if training else None, entry["meta"],
        n_saved=counts.get("n_saved"), n_symints=counts.get("n_symints", 0), detach=counts.get("detach", []))

    def forward_call(*args):
        return fn(list(args))
    log(2, f"cache: rebuilt AOTAutograd's wrappers ({'training' if training else 'inference'})")
    return torch._dynamo.disable(forward_call, reason="kiln: a graph loaded from the compile cache")
