"""The fuzz runner: child processes check programs one at a time; the parent attributes every result,
crash and hang to its program, restarts dead children, shrinks failures and writes the report.

    python -m kiln_bench.fuzz --target triton --programs 1000 --seed 0 --workers 2 --out DIR

The parent sends a child one task at a time, ('run', target, index) or ('check', target, program), and
waits for its answers: the program (sent before it runs, so a crash leaves it behind) and then its
result. A child that dies (segfault, abort) or outlives ``timeout`` seconds is a crash or timeout of the
program it held; it is replaced and the run goes on. Each failure is shrunk (``reduce.shrinker``, with
the children as the oracle) and written as a reproducer under ``DIR/failures``.
"""
from __future__ import annotations

import collections
import json
import multiprocessing as mp
import os
import re
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import wait

from kiln_bench.fuzz import reduce, report
from kiln_bench.fuzz.child import zero_sign
from kiln_bench.fuzz.program import Program


@dataclass
class Config:
    targets: tuple = ("triton",)
    programs: int = 100
    seed: int = 0
    workers: int = 2
    out: str = "fuzz_out"
    timeout: float = 300.0         # seconds one task may take
    max_ops: int = 8
    hook: str | None = None        # 'module:function', fn(program, index) -> program, applied in the child
    shrink: bool = True
    shrink_tries: int = 40         # candidates per failure
    shrink_per_group: int = 2      # failures shrunk per failure group (the others are written as found)
    tasks_per_child: int = 150     # a fresh child after this many tasks (bounds caches and leaks)
    start: int = 0                 # first program index
    indices: tuple = ()            # these program indices instead of start..start+programs
    quiet: bool = False
    env: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict)   # kiln options besides the target (values may be callables)
    strict: bool = False           # a kernel that fell back to ATen at run time is a failure ('fallback')
    deadline: float | None = None  # seconds: then no new program starts, shrinking ends with what it has,
    grace: float = 20.0            # and after this many more seconds programs still running are abandoned
    summary_every: float = 60.0    # seconds between the summaries written while the run goes on
    inline: bool = False           # run the programs in this process (no child: a crash ends the run)


STARTUP = 300.0   # seconds a child may take to start (import torch and kiln) before its first program


def serve(conn, cfg: dict) -> None:
    """A child: answer tasks until told to stop (None)."""
    import warnings
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # the parent stops its children (a Ctrl-C or a
    signal.signal(signal.SIGTERM, signal.SIG_IGN)   # `timeout` reaches the whole group): no false crashes
    warnings.filterwarnings("ignore")
    import torch
    torch.set_num_threads(1)
    from kiln_bench.fuzz.child import load_hook
    hook = load_hook(cfg.get("hook"))
    while True:
        task = conn.recv()
        if task is None:
            return
        try:
            prog = program_of(task, cfg["seed"], cfg["max_ops"], hook)
        except Exception as e:   # the fuzzer could not make the program (an import, the generator)
            conn.send(("result", _harness_error(e)))
            continue
        conn.send(("program", prog.to_dict()))   # before it runs: a crash leaves it behind; its clock starts
        conn.send(("result", answer(prog, task, cfg["options"])))


def program_of(task: dict, seed: int, max_ops: int, hook=None) -> Program:
    """The program a task runs: program ``index`` of the run (through ``hook``), or the candidate sent."""
    if task["kind"] != "run":
        return Program.from_dict(task["program"])
    from kiln_bench.fuzz.generate import program_for
    prog = program_for(seed, task["index"], max_ops)
    return hook(prog, task["index"]) if hook else prog


def answer(prog: Program, task: dict, options: dict) -> dict:
    """The result of ``prog`` on the task's target (``child.run_program``)."""
    from kiln_bench.fuzz.child import run_program
    try:
        return run_program(prog, task["target"], f"<fuzz {task['target']} {task['index']}>", options)
    except Exception as e:   # a bug of the fuzzer, not of kiln: reported apart
        return _harness_error(e)


def _harness_error(e) -> dict:
    error = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
    return {"status": "harness_error", "error": error[:300], "signature": ["harness"], "problems": [],
            "seconds": {}, "fallbacks": 0}


class Worker:
    """One child process and the task it holds."""

    def __init__(self, ctx, cfg: Config):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, asdict(cfg)), daemon=True)
        self.proc.start()
        child.close()
        self.task, self.program, self.session, self.since, self.done = None, None, None, 0.0, 0
        self.started = False   # whether the task's program started (the child then sent it)

    def send(self, task: dict) -> None:
        self.task, self.program, self.since, self.started = task, task.get("program"), time.monotonic(), False
        self.conn.send(task)

    def left(self, timeout: float) -> float:
        """Seconds until the task is late: ``timeout`` from its start, plus ``STARTUP`` before it starts."""
        return timeout + (0.0 if self.started else STARTUP) - (time.monotonic() - self.since)

    def stop(self, kill=False) -> None:
        try:
            if kill:
                self.proc.kill()
            else:
                self.conn.send(None)
            self.proc.join(10)
        except (OSError, BrokenPipeError):
            pass
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def _death(exitcode) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


class Session:
    """The shrinking of one failure: its ``reduce.shrinker`` and the candidate waiting for a child."""

    def __init__(self, target, index, rec, original: Program, cfg: Config, shrink=True):
        self.target, self.index, self.rec, self.original = target, index, rec, original
        sig = tuple(rec.get("signature") or (rec["status"],))
        self.gen = reduce.shrinker(original, sig, cfg.shrink_tries) if shrink else None
        self.sig, self.best, self.best_rec, self.busy = sig, original, None, False
        self.pending = self.advance(None, first=True) if shrink else None

    def advance(self, res, first=False):
        """The next candidate after ``res`` (the last one's result), or None when shrinking is over."""
        signature = tuple((res or {}).get("signature") or ())
        if signature == self.sig and res.get("status") != "pass":   # kept: the reproducer shows its result
            self.best_rec = {**self.rec, **{k: res[k] for k in ("status", "problems", "error") if k in res}}
            self.best = self.pending   # the shrinker keeps it too (known here if shrinking is cut short)
        try:
            return next(self.gen) if first else self.gen.send(signature)
        except StopIteration as stop:
            self.best = stop.value or self.original
            return None


class Run:
    """The parent's state: the queue of programs, shrink sessions, records, failures."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        indices = cfg.indices or range(cfg.start, cfg.start + cfg.programs)
        self.todo = collections.deque(("run", t, i) for t in cfg.targets for i in indices)
        self.sessions: list[Session] = []
        self.records, self.failures, self.shrunk_per_group = [], [], collections.Counter()
        self.t0, self.closed, self.stopped, self.unstarted, self.unfinished = time.monotonic(), False, "", 0, 0
        os.makedirs(os.path.join(cfg.out, "failures"), exist_ok=True)
        self.log = open(os.path.join(cfg.out, "results.jsonl"), "a")

    def next_task(self):
        """A shrink candidate if one waits, else the next program, else None; with its session."""
        for s in self.sessions:
            if s.pending is not None and not s.busy:
                s.busy = True
                return {"kind": "check", "target": s.target, "index": s.index, "program": s.pending.to_dict()}, s
        if self.todo:
            kind, target, index = self.todo.popleft()
            return {"kind": kind, "target": target, "index": index}, None
        return None, None

    def deliver(self, task: dict, session, program, res: dict) -> None:
        """Record ``res``, the answer to ``task`` (``program``: what the child ran)."""
        if session is not None:
            session.busy = False
            session.pending = session.advance(res)
            if self.closed:
                session.pending = None
            if session.pending is None:
                self.sessions.remove(session)
                self.finish(session)
            return
        rec = {"target": task["target"], "index": task["index"], "task": "run", **res, "program": program}
        if self.cfg.strict and rec["status"] == "pass" and rec.get("fallbacks"):
            rec["status"], rec["error"] = "fallback", rec["signature"][1]
        self.records.append(rec)
        self.log.write(json.dumps({k: v for k, v in rec.items() if k != "traceback"}, default=str) + "\n")
        self.log.flush()
        if not self.cfg.quiet:
            line = report.describe(rec) if rec["status"] != "pass" else ""
            print(f"[fuzz] {task['target']} {task['index']}: {rec['status']}"
                  f"{' (upstream)' if rec.get('upstream') else ''} {line[:160]}"
                  f"{' fallbacks=%d' % rec['fallbacks'] if rec.get('fallbacks') else ''}", flush=True)
        if rec["status"] not in report.FAILING + ("fallback",):
            return
        if program is None:   # the child died while drawing the program (in eager code)
            rec["repro"] = f"python -c 'from kiln_bench.fuzz.generate import program_for; " \
                           f"program_for({self.cfg.seed}, {task['index']}, {self.cfg.max_ops})'"
            self.failures.append(rec)
            return
        group = (task["target"],) + report.key(rec)
        prog = Program.from_dict(program)
        shrink = (self.cfg.shrink and not rec.get("upstream")   # upstream ones: written as found
                  and self.shrunk_per_group[group] < self.cfg.shrink_per_group)
        self.shrunk_per_group[group] += shrink
        s = Session(task["target"], task["index"], rec, prog, self.cfg, shrink)
        if s.pending is None:
            self.finish(s)
        else:
            self.sessions.append(s)

    def close(self, why: str) -> None:
        """Start nothing new (``why``: 'deadline', 'signal'); shrinking ends with the smallest program found."""
        self.closed, self.stopped = True, self.stopped or why
        self.unstarted += len(self.todo)
        self.todo.clear()
        for s in [s for s in self.sessions if not s.busy]:
            self.sessions.remove(s)
            self.finish(s)

    def summary(self, workers: int, final: bool = False) -> dict:
        """Write ``summary.md`` and ``summary.json`` for the records so far; returns the summary."""
        cfg = self.cfg
        config = {k: (v if k != "options" else {n: repr(o) for n, o in v.items()})
                  for k, v in asdict(cfg).items() if k not in ("env", "quiet")}
        state = {"running": not final, "stopped": self.stopped, "unstarted": self.unstarted,
                 "unfinished": self.unfinished, "shrinking": len(self.sessions)}
        return report.write_summary(cfg.out, self.records, self.failures, time.monotonic() - self.t0, workers,
                                    config, state)

    def finish(self, s: Session) -> None:
        rec = s.rec
        kind = re.sub(r"[^A-Za-z0-9]+", "_", "_".join(str(x) for x in report.key(rec)[:2])).strip("_")
        sub = "upstream" if rec.get("upstream") else "failures"
        path = os.path.join(self.cfg.out, sub, f"{s.target}_{s.index:05d}_{kind}.py")
        report.write_repro(path, s.best, s.best_rec or rec, s.target, len(s.original.ops), self.cfg.options,
                           zero_sign(s.best))
        rec["repro"], rec["shrunk_ops"] = path, len(s.best.ops)
        self.failures.append(rec)


def main(cfg: Config) -> dict:
    """Run ``cfg.programs`` programs per target; returns the summary (also written under ``cfg.out``)."""
    os.makedirs(cfg.out, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("KILN_KERNEL_DIR", os.path.join(os.path.abspath(cfg.out), "kernels"))
    os.environ.update(cfg.env)
    ctx = mp.get_context("spawn")
    run, workers = Run(cfg), []
    main_thread = threading.current_thread() is threading.main_thread()
    _pending.clear()
    old = signal.signal(signal.SIGTERM, _stopped) if main_thread else None
    try:
        if cfg.inline:
            _inline(run)
        else:
            workers += [Worker(ctx, cfg) for _ in range(max(1, cfg.workers))]
            _loop(run, workers, ctx)
    except (Stopped, KeyboardInterrupt) as e:   # `timeout`, kill, Ctrl-C: the summary is still written
        run.close("signal")
        run.stopped = f"signal ({type(e).__name__})"
    finally:   # the summary first: stopping many children takes a while, and `timeout -k` may not wait
        run.unfinished += sum(1 for w in workers if w.task is not None and w.session is None)
        for s in list(run.sessions):   # shrinking cut short: each failure as found (or as far as it shrank)
            run.sessions.remove(s)
            run.finish(s)
        summary = run.summary(max(len(workers), 1), final=True)
        _stop_all(workers)
        run.log.close()
        if main_thread:
            signal.signal(signal.SIGTERM, old)
    return summary


def _stop_all(workers: list, wait_s: float = 10.0) -> None:
    """Stop the children together: busy ones killed, idle ones told to stop, any left after ``wait_s`` killed."""
    for w in workers:
        try:
            w.proc.kill() if w.task is not None else w.conn.send(None)
        except (OSError, BrokenPipeError):
            pass
    end = time.monotonic() + wait_s
    for w in workers:
        w.proc.join(max(0.1, end - time.monotonic()))
        if w.proc.is_alive():
            w.proc.kill()
            w.proc.join(5)


class Stopped(BaseException):
    """SIGTERM reached the runner: it stops its children and writes the summary (a BaseException, as
    KeyboardInterrupt: no ``except Exception`` of a program's check swallows it)."""


_pending: list = []   # signals received: raised again between programs, since a raise that lands in a gc
                      # callback (hypothesis installs one) is printed and ignored


def _stopped(signum, frame):
    _pending.append(signum)
    raise Stopped()


def _check_signal() -> None:
    if _pending:
        raise Stopped()


def _inline(run: Run) -> None:
    """Run every task in this process, one after the other (``Config.inline``)."""
    from kiln_bench.fuzz.child import load_hook
    cfg = run.cfg
    hook = load_hook(cfg.hook)
    while True:
        _check_signal()
        if cfg.deadline is not None and time.monotonic() - run.t0 > cfg.deadline and not run.closed:
            run.close("deadline")
        task, session = run.next_task()
        if task is None:
            return
        run.unfinished += session is None   # until its result is in (a signal may end the run first)
        prog = program_of(task, cfg.seed, cfg.max_ops, hook)
        res = answer(prog, task, cfg.options)
        run.unfinished -= session is None
        run.deliver(task, session, prog.to_dict(), res)


def _loop(run: Run, workers: list, ctx) -> None:
    cfg, written = run.cfg, time.monotonic()
    while True:
        _check_signal()
        now = time.monotonic()
        if cfg.deadline is not None and now - run.t0 > cfg.deadline and not run.closed:
            run.close("deadline")
        if cfg.deadline is not None and now - run.t0 > cfg.deadline + cfg.grace:
            return   # main() abandons what still runs
        if now - written > cfg.summary_every:
            run.summary(len(workers))
            written = now
        for i, w in enumerate(workers):
            if w.task is None:
                if w.done >= run.cfg.tasks_per_child:
                    w.stop()
                    workers[i] = w = Worker(ctx, run.cfg)
                task, session = run.next_task()
                if task is not None:
                    w.send(task)
                    w.session = session
        busy = [w for w in workers if w.task is not None]
        if not busy:
            return
        left = min([w.left(cfg.timeout) for w in busy] + [cfg.summary_every]
                   + ([cfg.deadline - (time.monotonic() - run.t0)] if not run.closed and cfg.deadline else [])
                   + ([cfg.deadline + cfg.grace - (time.monotonic() - run.t0)] if run.closed and cfg.deadline else []))
        ready = wait([w.conn for w in busy] + [w.proc.sentinel for w in busy], timeout=max(left, 0.01))
        for i, w in enumerate(workers):
            if w.task is None:
                continue
            if w.conn in ready:
                try:
                    kind, payload = w.conn.recv()
                except (EOFError, OSError):
                    kind, payload = None, None
                if kind == "program":
                    w.program, w.since, w.started = payload, time.monotonic(), True
                    continue
                if kind == "result":
                    task, w.task, w.done = w.task, None, w.done + 1
                    run.deliver(task, w.session, w.program, payload)
                    continue
            late = w.left(cfg.timeout) < 0
            if not w.proc.is_alive() or late:
                dead = not w.proc.is_alive()
                w.stop(kill=True)
                status = "crash" if dead else "timeout"
                detail = _death(w.proc.exitcode) if dead else f"no answer after {run.cfg.timeout:.0f} s"
                res = {"status": status, "detail": detail, "error": f"child {detail}", "signature": [status],
                       "problems": [], "seconds": {"total": time.monotonic() - w.since}, "fallbacks": 0}
                if not w.started:   # it never began the program (start-up, imports): the fuzzer's failure
                    res = _harness_error(f"child {detail} before its program started")
                task, session, program = w.task, w.session, w.program
                workers[i] = Worker(ctx, run.cfg)
                run.deliver(task, session, program, res)
