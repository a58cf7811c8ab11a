"""Inspectability: the KILN_DEBUG ladder (1 stages and times, 2 graphs, 3 remat decisions, 4 kernels, 5
rules), counters, KILN_DUMP, the per-region ``Trace``. Messages go through torch's logging; a compile the
cache will store keeps a ``Record`` of all it shows, which a hit replays (``Trace.replay``).
"""
import collections
import contextlib
import logging
import os
import pickle
import sys
import time
import traceback
import zlib

import torch.fx as fx

from kiln import compat, logs, options
from kiln.options import UserError


class Counters(collections.defaultdict):
    """``kiln.counters[group][name]``: how often something happened, e.g. ``['fallback']['eager_graphs']``."""


counters = Counters(collections.Counter)


def level() -> int:
    """The debug level in force (options scope first, then KILN_DEBUG)."""
    try:
        return options.active().debug
    except Exception:  # bad env must not break logging
        return int(os.environ.get("KILN_DEBUG", "0") or 0)


def _py_level(lvl: int) -> int:
    return logging.INFO if lvl <= 1 else logging.DEBUG


def log(lvl: int, msg: str, artifact: str | None = None) -> None:
    """Hand ``msg`` to the ``kiln`` log (level 1 as INFO, higher as DEBUG), or to ``artifact``'s; print it to
    stderr at debug level ``lvl`` when torch's settings do not show it. Recorded for the compile cache."""
    record = logs.recording()
    if record is not None:
        f = sys._getframe(1)
        record.add("log", lvl, msg, artifact, (f.f_code.co_filename, f.f_lineno, f.f_code.co_name))
    _emit(lvl, msg, artifact, stacklevel=2)


def _emit(lvl: int, msg: str, artifact: str | None = None, origin=None, stacklevel: int = 1) -> None:
    """``log``'s output, from the caller's frame ``stacklevel`` or a replayed message's ``origin``."""
    py = _py_level(lvl)
    if logs.enabled(py, artifact):
        lg = logs.logger(artifact)
        if origin is None:
            lg.log(py, msg, stacklevel=stacklevel + 1)
        else:
            lg.handle(lg.makeRecord(lg.name, py, origin[0], origin[1], msg, (), None, origin[2]))
    elif level() >= lvl:
        print(f"[kiln] {msg}", file=sys.stderr)


def wanted(lvl: int, artifact: str | None = None) -> bool:
    """Whether ``log(lvl, ..., artifact)`` would show or record anything (to skip building costly messages)."""
    return level() >= lvl or logs.enabled(_py_level(lvl), artifact) or logs.recording() is not None


def inspecting(trace=None) -> bool:
    """Whether anything reads what a compile shows (KILN_DEBUG, logging, explain, a trace, a dump folder)."""
    return (level() >= 1 or logs.enabled(logging.INFO) or bool(_EXPLAIN_SINKS) or logs.tracing()
            or any(logs.enabled(logging.DEBUG, a) for a in ("output_code", *logs.ARTIFACTS))
            or (trace is not None and trace.dir is not None))


class Record:
    """What one compile showed, in order, for the compile cache: ``("log", ...)``, ``("stage", ...)``,
    ``("explain", ...)``, ``("dump", ...)``, ``("trace", ...)`` events, as ``Trace.replay`` reads them."""

    def __init__(self):
        self.events: list = []
        self.open = True

    def add(self, *event) -> None:
        if self.open:
            self.events.append(event)

    def pack(self) -> bytes:
        """The events, pickled and compressed (``unpack`` reads them); the record takes no more."""
        data = zlib.compress(pickle.dumps(self.events, protocol=pickle.HIGHEST_PROTOCOL), 6)
        self.close()
        return data

    def close(self) -> None:
        self.open, self.events = False, []

    @staticmethod
    def unpack(data: bytes) -> list:
        return pickle.loads(zlib.decompress(data))


# -- stages ------------------------------------------------------------------------------------
_EXPLAIN_SINKS: list = []  # lists of (stage, graph text) while kiln.explain runs
_OBSERVERS: list = []      # callables (event, data) while ``observe`` scopes run


@contextlib.contextmanager
def observe(fn):
    """Call ``fn(event, data)`` for ``"graph"`` (``{trace, stage, gm}``) and ``"partition"`` (``{joint, saved,
    num_fwd_outputs}``) in this scope: tools read the pipeline so, never patch it."""
    _OBSERVERS.append(fn)
    try:
        yield fn
    finally:
        _OBSERVERS.remove(fn)


def notify(event: str, **data) -> None:
    for fn in list(_OBSERVERS):
        fn(event, data)


class Trace:
    """Per compiled region: numbers, times, shows, verifies and dumps stages; ``fail``, ``report``, ``replay``."""
    _count = 0

    def __init__(self, opts, kind: str = "graph"):
        Trace._count += 1
        self.id = Trace._count
        self.name = f"{kind}_{self.id}"
        self.opts, self.step = opts, 0
        self.dir = _dump_dir(os.fspath(opts.dump_dir), kind) if opts.dump_dir else None
        self.phase = "forward"            # "backward" while the backward compiles
        self.stages: list = []            # (phase, stage, seconds) in order
        self.clock: collections.Counter = collections.Counter()   # seconds, see ``timed``
        self._open: set = set()
        self.error = None                 # the exception ``fail`` recorded
        self.cid = logs.compile_id()      # Dynamo's compile id, for entries written after the compile
        self.frames = len(compat.dynamo_frame_times())   # Dynamo frame compiles finished before this one
        self.record = None                # a ``Record`` of what this compile shows, for the compile cache
        self.cached = None                # "entry kiln_<key>": a compile cache hit, what it replayed

    def stage(self, name: str, fn, *args, **kwargs):
        """Run one pipeline stage, time it, and show / verify / dump its result (its error if it raises)."""
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            result = fn(*args, **kwargs)
        except Exception as e:
            self.fail(e, name)
            raise
        s, cpu = time.perf_counter() - t0, (time.process_time() - c0) * 1e3
        self.stages.append((self.phase, name, s))
        counters["stage_ms"][name] += s * 1e3
        if self.record is not None:
            self.record.add("stage", self.phase, name, s, cpu)
        _emit(1, f"{self.name} stage {name}: {s * 1e3:.1f} ms (cpu {cpu:.1f} ms)")
        if isinstance(result, int) and args:  # an in-place pass returns its change count
            self.show(name, args[0], note=f"{result} changed")
        else:
            self.show(name, result)
        return result

    def show(self, name: str, result, note: str = "") -> None:
        gms = [r for r in (result if isinstance(result, (tuple, list)) else (result,)) if isinstance(r, fx.GraphModule)]
        for i, gm in enumerate(gms):
            label = name if len(gms) == 1 else f"{name}_{'fw' if i == 0 else 'bw'}"
            if _OBSERVERS:
                notify("graph", trace=self, stage=label, gm=gm)
            if self.opts.verify or level() >= 1:
                verify(gm, label)
            if not wanted(2) and not _EXPLAIN_SINKS and self.dir is None and not logs.tracing():
                continue   # nobody reads the text: printing a large graph costs seconds
            text = f"# after: {label} ({len(gm.graph.nodes)} nodes{', ' + note if note else ''})\n" + \
                gm.print_readable(print_output=False, include_stride=True, include_device=True)
            log(2, text)
            for sink in list(_EXPLAIN_SINKS):
                sink.append((label, text))
            if self.record is not None:
                self.record.add("explain", label, text)
            self.dump(f"{label}.py", text)
            self.trace(f"kiln_{label}", text)

    def trace(self, name: str, text: str) -> None:
        logs.trace(name, lambda: text, cid=self.cid)

    def dump(self, filename: str, text: str, numbered: bool = True):
        """Write ``text`` to the dump folder as ``NN_filename`` (or ``filename``); returns the path, or None."""
        if self.record is not None:
            self.record.add("dump", filename, text, numbered)
        if self.dir is None:
            return None
        path = os.path.join(self.dir, f"{self.step:02d}_{filename}" if numbered else filename)
        self.step += numbered
        try:
            with open(path, "w") as f:
                f.write(text)
        except OSError as e:   # a debugging aid never stops a compile
            log(1, f"KILN_DUMP: cannot write {path} ({e}); dumping stops for this region")
            self.dir = None
            return None
        return path

    @contextlib.contextmanager
    def timed(self, key: str):
        """Add the block's wall time to ``clock[key]``: ``backend`` (kiln's backend call), ``aot`` (AOTAutograd
        in it), ``kiln`` and ``backward`` (kiln's compilers, which ``kiln_in_aot`` counts inside ``aot``)."""
        t0 = time.perf_counter()
        self._open.add(key)
        scope = logs.active(self) if key in ("backend", "backward") else contextlib.nullcontext()
        try:
            with scope:   # the compile runs on this thread: what it logs goes to ``record`` too
                yield
        finally:
            self._open.discard(key)
            dt = time.perf_counter() - t0
            self.clock[key] += dt
            if key in ("kiln", "backward") and "aot" in self._open:
                self.clock["kiln_in_aot"] += dt

    def fail(self, error: BaseException, stage: str | None = None) -> None:
        """Record once that compiling raised ``error``: ``error.txt`` in the dump folder, a ``kiln_error`` entry."""
        if _same_error(error, self.error):
            return
        self.error = error
        where = f"in stage {stage}" if stage else "outside kiln's stages"
        text = (f"kiln: {self.name} failed {where} ({self.phase} compile)\n{type(error).__name__}: {error}\n\n"
                + "".join(traceback.format_exception(error)))
        self.trace("kiln_error", text)
        path = self.dump("error.txt", text, numbered=False)
        if path:
            log(1, f"{self.name}: compiling failed {where}; the error is in {path}")

    def on_first_call(self, fn):
        """``fn``, reporting the compile's times at its first call (Dynamo has finished the frame by then)."""
        if not (wanted(1) or logs.tracing()):
            return fn
        pending = [True]

        def run(*args, **kwargs):
            if pending:
                pending.clear()
                with options.using(self.opts):
                    self.report()
            return fn(*args, **kwargs)
        run._boxed_call = getattr(fn, "_boxed_call", False)
        return run

    def report(self) -> None:
        """Where the forward compile's time went: Dynamo, AOTAutograd (less kiln's compilers), kiln, the total."""
        frames = compat.dynamo_frame_times()
        backend = self.clock["backend"]
        frame = frames[self.frames] if len(frames) > self.frames and frames[self.frames] >= backend else None
        aot = max(self.clock["aot"] - self.clock["kiln_in_aot"], 0.0)
        kiln = backend - aot
        stages = [(n, s) for p, n, s in self.stages if p == "forward"]
        total = frame if frame is not None else backend
        dynamo = f"{frame - backend:.2f} s" if frame is not None else "unknown (no frame time from torch)"
        how = f"from the compile cache, {self.cached}: no stage ran" if self.cached else _stage_list(stages, kiln)
        log(1, f"{self.name} compiled in {total:.2f} s: Dynamo {dynamo}, AOTAutograd {aot:.2f} s, kiln {kiln:.2f} s "
               f"({how})")
        logs.trace("kiln_stage_times", lambda: self._cached({
            "region": self.name, "total_s": total, "dynamo_s": None if frame is None else frame - backend,
            "aot_autograd_s": aot, "kiln_s": kiln, "stages_s": dict(stages)}), "json", cid=self.cid)

    def report_backward(self) -> None:
        """The backward compile's kiln time and stages (at the first ``.backward()``)."""
        kiln = self.clock["backward"]
        stages = [(n, s) for p, n, s in self.stages if p == "backward"]
        log(1, f"{self.name} backward loaded from the compile cache with the forward ({self.cached})" if self.cached
            else f"{self.name} backward compiled by kiln in {kiln:.2f} s ({_stage_list(stages, kiln)})")
        logs.trace("kiln_stage_times_backward", lambda: self._cached({"region": self.name, "kiln_s": kiln,
                                                                      "stages_s": dict(stages)}), "json", cid=self.cid)

    def _cached(self, times: dict) -> dict:
        return {**times, "from_cache": self.cached} if self.cached else times

    def replay(self, events: list, source: str) -> None:
        """Show what the compile that stored a cache entry showed (its ``Record``), each under a header."""
        self.cached = source
        _emit(1, f"{self.name}: compile cache hit ({source}); what follows is what the compile that stored it showed")
        backward = False
        for event in events:
            kind = event[0]
            if kind == "log":
                _, lvl, msg, artifact, origin = event
                _emit(lvl, _marked(msg, source) if "\n" in msg else msg, artifact, origin)
            elif kind == "stage":
                _, phase, name, s, cpu = event
                backward |= phase == "backward"
                _emit(1, f"{self.name} stage {name}: {s * 1e3:.1f} ms (cpu {cpu:.1f} ms), from the compile cache")
            elif kind == "explain":
                for sink in list(_EXPLAIN_SINKS):
                    sink.append((event[1], _marked(event[2], source)))
            elif kind == "dump":
                _, filename, text, numbered = event
                self.dump(filename, _marked(text, source, filename), numbered)
            elif kind == "trace":
                _, name, payload, encoding = event
                marked = _marked(payload, source, name) if isinstance(payload, str) else \
                    {**payload, "from_cache": source} if isinstance(payload, dict) else payload
                logs.trace(name, lambda m=marked: m, encoding, cid=self.cid)
        _emit(1, f"{self.name}: end of what the compile cache replayed ({source})")
        if backward:
            self.report_backward()


def _marked(text: str, source: str, name: str = "") -> str:
    """``text`` under a comment line saying it came from the compile cache (``//`` for C++ ``name``s)."""
    comment = "//" if name.endswith((".cpp", "_cpp")) else "#"
    return f"{comment} from the compile cache ({source})\n{text}"


def _stage_list(stages, kiln: float) -> str:
    done = sum(s for _, s in stages)
    parts = ", ".join(f"{n} {s * 1e3:.1f} ms" for n, s in stages)
    return f"stages {done:.2f} s: {parts or 'none'}; other kiln work {max(kiln - done, 0.0):.2f} s"


def _same_error(error, recorded) -> bool:
    """Whether ``error`` is ``recorded`` or was raised from it (a wrapper of the same failure)."""
    seen = 0
    while error is not None and seen < 20:
        if error is recorded:
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def _dump_dir(root: str, kind: str):
    """A new folder ``root/<kind>_NNN`` (``mkdir`` is atomic: processes never share one), or None (logged)."""
    try:
        os.makedirs(root, exist_ok=True)
        for n in range(1, 100000):
            path = os.path.join(root, f"{kind}_{n:03d}")
            try:
                os.mkdir(path)
            except FileExistsError:
                continue
            print(f"[kiln] KILN_DUMP: writing {kind} stages to {os.path.abspath(path)}", file=sys.stderr)
            return path
    except OSError as e:
        log(1, f"KILN_DUMP: cannot write under {root} ({e}); compiling without dumps")
    return None


class VerifyError(RuntimeError, UserError):
    """A stage produced an ill-formed graph (use before definition, dangling node); the message names the
    stage. Rerun with KILN_DEBUG=2 to see the graph."""


def verify(gm, stage: str) -> None:
    """Lint ``gm``'s graph; raise VerifyError naming the stage if it is malformed."""
    try:
        gm.graph.lint()
    except Exception as e:  # fx raises RuntimeError or AssertionError
        raise VerifyError(f"{stage}: graph failed lint: {e}") from e
