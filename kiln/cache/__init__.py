"""The compile cache: graphs compiled by one process, reused by the next.

``open_graph`` decides whether a Dynamo graph may use the cache and computes its key
(``key.graph_key``: the code of the graph and of its subgraphs, the identity of what it calls
(``identity``), its inputs, the global state and options that change a trace; a graph calling something
without an identity across processes, or compiled with a custom pass without ``uuid()``, bypasses the
cache, logged). ``Session.load`` returns the compiled callable of a hit: the stored wrappers,
kernels and C++ libraries loaded (``serial``), AOTAutograd's runtime wrappers put back together
(``aot``), the stored shape guards checked and added to Dynamo's; tracing, passes, partitioning and
code generation are skipped. On a miss the pipeline compiles as usual; kiln's compilers hand their
results to ``Session.recorder`` and ``Session.save`` writes the entry once the graph is complete (a
training graph when its backward compiles, at its first ``backward()``). Entries live in ``store``'s
directory (``cache_dir``, ``KILN_CACHE_DIR``; by default ``graphs/`` in the user's cache directory),
authenticated with the directory's key; a directory that is not private or takes no file turns the cache
off with one warning naming the option (``status`` says why), and so does an entry that cannot be written;
``kiln cache info|clear`` reads and empties it.

An entry also keeps what its compile showed (``debug.Record``: each stage's graph, the remat decisions, the
kernel plans, kernels and wrappers, compressed); a hit replays it to the channels a compile uses (the kiln
log, ``output_code``, KILN_DEBUG, KILN_DUMP, TORCH_TRACE, ``kiln.explain``) when any of them is on, under a
header naming the entry, and does not even decompress it otherwise.

Counters (``kiln.counters['cache']``): ``hit``, ``miss``, ``saved``, ``bypass`` (not cacheable),
``off`` (the directory is refused or read-only),
``damaged`` (an entry failed its check and was deleted), ``guard_miss`` (stored for other shapes),
``load_failed`` (an entry that did not load: compiled again), ``write_failed`` (an entry not written),
``replayed`` (a hit that showed its compile's output: something inspects).
"""
from __future__ import annotations

import pickle

import torch

from kiln.cache import aot, identity, key, serial, store
from kiln.debug import Record, counters, inspecting, log
from kiln.runtime import private


def status(opts):
    """``(directory, reason)``: the cache's directory (checked, made when missing) and '' when it is in
    use, else why the cache is off (``cache=False``, a directory refused or read-only)."""
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


def _backed_symints(inputs) -> list:
    return [x for x in inputs if isinstance(x, torch.SymInt) and getattr(x.node, "hint", None) is not None]


class Session:
    def __init__(self, root: str, k: str, opts, inputs):
        # the SymInts only: a session lives as long as the compiled function (its lazy backward compile
        # records into it), and the example tensors are a first call's real values (a logits input)
        self.root, self.key, self.opts, self.symints = root, k, opts, _backed_symints(inputs)
        self.recorder = aot.Recorder(self._guards_expr)
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
        """The compiled callable of a hit, else None (a miss: compile, and ``save``). ``trace``: the
        compile's ``debug.Trace``; a hit replays to it what the compile that stored the entry showed, a miss
        records into it what this compile shows."""
        fn, shown = self._load()
        if trace is not None and fn is None:
            trace.record = self.record
        elif trace is not None and shown is not None and inspecting(trace):
            counters["cache"]["replayed"] += 1
            try:
                trace.replay(Record.unpack(shown), f"entry {private.PREFIX}{self.key}")
            except Exception as e:   # noqa: BLE001  (a debugging aid never fails a hit)
                log(1, f"cache: entry {self.key}: its compile's output could not be replayed ({type(e).__name__}: {e})")
        return fn

    def _load(self):
        """(the compiled callable, the stored ``Record``'s bytes) of a hit, else (None, None)."""
        payload, why = store.read(self.root, self.key)
        if payload is None:
            if why != "missing":
                counters["cache"]["damaged"] += 1
                log(1, f"cache: entry {self.key} was damaged ({why}); deleted, compiling again")
            counters["cache"]["miss"] += 1
            return None, None
        try:
            entry = pickle.loads(payload)
            symints = self.symints
            if entry["guards"] is not None:
                env = symints[0].node.shape_env
                if not env.evaluate_guards_expression(entry["guards"], [s.node.hint for s in symints]):
                    counters["cache"]["guard_miss"] += 1
                    counters["cache"]["miss"] += 1
                    log(2, f"cache: entry {self.key} holds other shapes")
                    return None, None
            parts = {k: serial.unpack(v, self.opts) for k, v in entry["parts"].items()}
            fn = aot.rebuild(entry, parts.get("forward"), parts.get("backward"), parts.get("inference"))
            if entry["guards"] is not None:   # the same guards as a compile would add, now in Dynamo's
                env.evaluate_guards_expression(entry["guards"], symints)
        except Exception as e:   # noqa: BLE001  (a stale or foreign entry: compile as without the cache)
            counters["cache"]["load_failed"] += 1
            counters["cache"]["miss"] += 1
            log(1, f"cache: entry {self.key} did not load ({type(e).__name__}: {e}); compiling again")
            return None, None
        counters["cache"]["hit"] += 1
        log(1, f"cache: hit {self.key}")
        return fn, entry.get("shown")

    def traced(self) -> None:
        """AOTAutograd is done with this graph (its metadata is final): save when complete."""
        self.recorder.traced = True
        self.save()

    def add(self, kind: str, compiled, units=()) -> None:
        """A compiled graph of this miss (``kind``: forward, backward, inference); saves the entry
        once it is complete and AOTAutograd is done (``traced``)."""
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
