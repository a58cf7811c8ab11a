"""Inspectability: the KILN_DEBUG ladder, counters, and KILN_DUMP.

Levels: 1 stage names and times, 2 the graph after each stage, 3 remat decisions,
4 generated kernels and wrappers, 5 every rule that fired.
"""
from __future__ import annotations

import collections
import contextlib
import os
import sys
import time

import torch.fx as fx

from kiln import options
from kiln.options import UserError


class Counters(collections.defaultdict):
    """``kiln.counters[group][name]``: how often something happened, e.g. ``['fallback']['eager_graphs']``
    (graphs run as captured). ``kiln.counters.clear()`` starts over."""


counters = Counters(collections.Counter)


def level() -> int:
    """The debug level in force (options scope first, then KILN_DEBUG)."""
    try:
        return options.active().debug
    except Exception:  # bad env must not break logging
        return int(os.environ.get("KILN_DEBUG", "0") or 0)


def log(lvl: int, msg: str) -> None:
    """Print ``msg`` to stderr when the debug level is at least ``lvl``."""
    if level() >= lvl:
        print(f"[kiln] {msg}", file=sys.stderr)


# -- stages ------------------------------------------------------------------------------------
_EXPLAIN_SINKS: list = []  # lists of (stage, graph text) while kiln.explain runs
_OBSERVERS: list = []      # callables (event, data) while ``observe`` scopes run


@contextlib.contextmanager
def observe(fn):
    """Call ``fn(event, data)`` with what the pipeline does in this scope: ``"graph"`` with
    ``{trace, stage, gm}`` for every graph a stage produces, ``"partition"`` with ``{joint, saved,
    num_fwd_outputs}`` for every cut of a joint graph. Tools (``kiln.bench.graph_peak``,
    ``peak_sweep``) read the pipeline this way instead of patching it."""
    _OBSERVERS.append(fn)
    try:
        yield fn
    finally:
        _OBSERVERS.remove(fn)


def notify(event: str, **data) -> None:
    """Hand ``event`` to the observers in scope (``observe``)."""
    for fn in list(_OBSERVERS):
        fn(event, data)


class Trace:
    """Per compiled region: numbers stages, prints them, dumps them under KILN_DUMP, feeds explain."""
    _count = 0

    def __init__(self, opts, kind: str = "graph"):
        Trace._count += 1
        self.id = Trace._count
        self.opts = opts
        self.kind = kind
        self.step = 0
        self.dir = _dump_dir(os.fspath(opts.dump_dir), kind) if opts.dump_dir else None

    def stage(self, name: str, fn, *args, **kwargs):
        """Run one pipeline stage, time it, and show / verify / dump its result."""
        t0, c0 = time.perf_counter(), time.process_time()
        result = fn(*args, **kwargs)
        ms, cpu = (time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3
        counters["stage_ms"][name] += ms
        log(1, f"{self.kind}_{self.id} stage {name}: {ms:.1f} ms (cpu {cpu:.1f} ms)")
        if isinstance(result, int) and args:  # an in-place pass returns its change count
            self.show(name, args[0], note=f"{result} changed")
        else:
            self.show(name, result)
        return result

    def show(self, name: str, result, note: str = "") -> None:
        gms = [r for r in (result if isinstance(result, (tuple, list)) else (result,))
               if isinstance(r, fx.GraphModule)]
        for i, gm in enumerate(gms):
            label = name if len(gms) == 1 else f"{name}_{'fw' if i == 0 else 'bw'}"
            if _OBSERVERS:
                notify("graph", trace=self, stage=label, gm=gm)
            lvl = level()
            if self.opts.verify or lvl >= 1:
                verify(gm, label)
            if lvl < 2 and not _EXPLAIN_SINKS and self.dir is None:
                continue   # nobody reads the text: printing a large graph costs seconds
            text = graph_text(gm, label, note)
            log(2, text)
            for sink in list(_EXPLAIN_SINKS):
                sink.append((label, text))
            self.dump(f"{label}.py", text)

    def dump(self, filename: str, text: str) -> None:
        if self.dir is None:
            return
        path = os.path.join(self.dir, f"{self.step:02d}_{filename}")
        self.step += 1
        try:
            with open(path, "w") as f:
                f.write(text)
        except OSError as e:   # a debugging aid never stops a compile
            log(1, f"KILN_DUMP: cannot write {path} ({e}); dumping stops for this region")
            self.dir = None


def _dump_dir(root: str, kind: str):
    """A new folder ``root/<kind>_NNN`` for one compiled region: the first number not taken, made with
    ``mkdir`` (atomic), so that processes sharing ``root`` never write into each other's folders. None
    (with the reason logged) when ``root`` cannot hold it."""
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


def graph_text(gm, stage: str, note: str = "") -> str:
    """Runnable Python for ``gm`` with shapes as comments, under a ``# after: stage`` header."""
    n = len(gm.graph.nodes)
    header = f"# after: {stage} ({n} nodes{', ' + note if note else ''})\n"
    try:
        body = gm.print_readable(print_output=False, include_stride=True, include_device=True)
    except TypeError:  # older signatures
        body = gm.print_readable(print_output=False)
    return header + body


class VerifyError(RuntimeError, UserError):
    """A stage produced an ill-formed graph (use before definition, dangling node). The message names
    the stage; rerun with KILN_DEBUG=2 to see the graph it produced."""


def verify(gm, stage: str) -> None:
    """Lint ``gm``'s graph; raise VerifyError naming the stage if it is malformed."""
    try:
        gm.graph.lint()
    except Exception as e:  # fx raises RuntimeError or AssertionError
        raise VerifyError(f"{stage}: graph failed lint: {e}") from e
