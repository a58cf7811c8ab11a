"""Worker processes for the OpInfo sweep: a crash (segfault, abort) or a hang costs one sample, not
the sweep.

A task is one op in one dtype on a list of backends. Its worker runs the op's samples one unit at a time
(a unit: sample, mode, backend, see ``units``), announcing each unit before it runs and sending its
record after, as JSON lines on a private pipe (stdout is sent to the worker's log, so stray prints
cannot corrupt the protocol). When a worker dies or a unit runs past the timeout, the pool records that
unit as ``crash`` or ``timeout`` (with the signal and the last line of the worker's log), starts a fresh
worker and resubmits the task without the units already done.

``python -m kiln_bench.opinfo_pool`` is the worker's entry point; ``Pool(n).run(tasks, on_record)``
drives n of them.
"""
from __future__ import annotations

import json
import os
import queue
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time

import kiln

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(kiln.__file__)))
WORKER = [sys.executable, "-m", "kiln_bench.opinfo_pool"]


def units(n_samples_modes, backends) -> list:
    """[(sample, mode, backend)] in the order a worker runs them, from [(sample, [modes])]."""
    return [(i, m, b) for i, modes in n_samples_modes for m in modes for b in backends]


# -- the worker --------------------------------------------------------------------------------
def worker_main() -> int:
    """Read tasks (JSON lines) on stdin; write ``{"unit": ...}`` then its record per unit, and
    ``{"done": true}`` per task, on the protocol pipe (the original stdout)."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)   # stray prints (torch, Triton, compilers) go to the log
    import torch
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from kiln_bench import opinfo_cases as cases
    from kiln_bench import opinfo_sample
    cases.op_db()
    proto.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        task = json.loads(line)
        skip = {tuple(u) for u in task.get("skip", ())}
        dtype = cases.DTYPES[task["dtype"]]
        try:
            op = cases.find(task["op"])
            found = cases.samples(op, dtype, task["samples"], task.get("device", "cpu"))
        except Exception as e:   # the op's sample generator failed
            proto.write(json.dumps({"record": _skip_record(task, f"sample inputs: {opinfo_sample.error_text(e)}")})
                        + "\n")
            found = []
        plan = units([(i, opinfo_sample.modes(s)) for i, s in enumerate(found)], task["backends"])
        for i, mode, backend in plan:
            if (i, mode, backend) in skip:
                continue
            proto.write(json.dumps({"unit": [i, mode, backend]}) + "\n")
            try:
                rec = opinfo_sample.run(op, found[i], dtype, backend, i, mode)
            except Exception as e:   # a failure of the sweep itself, not of the backend
                rec = dict(op=task["op"], dtype=task["dtype"], backend=backend, sample=i, mode=mode,
                           status="error", where="harness", error=opinfo_sample.error_text(e))
            proto.write(json.dumps({"record": rec}, default=str) + "\n")
        proto.write(json.dumps({"done": True}) + "\n")
    return 0


def _skip_record(task, why):
    return dict(op=task["op"], dtype=task["dtype"], backend="*", sample=None, mode=None, status="skip",
                error=why)


# -- the pool ----------------------------------------------------------------------------------
class Worker:
    """One worker process and its log file."""

    def __init__(self, cmd, env, log_dir):
        self.cmd, self.env, self.log_dir = cmd, env, log_dir
        self.proc = None
        self.tasks = 0

    def start(self, timeout):
        self.log = tempfile.NamedTemporaryFile("w+b", dir=self.log_dir, prefix="worker-", suffix=".log",
                                               delete=False)
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, env=self.env, cwd=ROOT)
        self.buf = b""
        msg = self.read(timeout)
        if not (msg and msg.get("ready")):
            raise RuntimeError(f"opinfo worker failed to start: {self.tail() or self.proc.poll()}")

    def send(self, task):
        self.proc.stdin.write((json.dumps(task) + "\n").encode())
        self.proc.stdin.flush()
        self.tasks += 1

    def read(self, timeout):
        """The next message, None when the process died, "timeout" after ``timeout`` seconds."""
        end = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = end - time.monotonic()
            if left <= 0:
                return "timeout"
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    self.proc.wait()
                    return None
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def death(self) -> str:
        rc = self.proc.wait()
        what = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"worker exited with code {rc}"
        tail = self.tail()
        return f"{what}{': ' + tail if tail else ''}"

    def tail(self) -> str:
        try:
            self.log.flush()
            with open(self.log.name, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log.name) - 4096))
                lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
            return lines[-1][:300] if lines else ""
        except OSError:
            return ""

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        if getattr(self, "log", None) is not None:
            self.log.close()
            os.unlink(self.log.name)
            self.log = None


class Pool:
    """``workers`` worker processes; ``run(tasks, on_record)`` calls ``on_record(record)`` (from the
    pool's threads, one at a time) for every unit of every task."""

    def __init__(self, workers: int = 2, timeout: float = 300.0, cmd=None, env=None, max_tasks: int = 100,
                 start_timeout: float = 120.0):
        self.workers, self.timeout, self.max_tasks, self.start_timeout = workers, timeout, max_tasks, start_timeout
        self.cmd = list(cmd or WORKER)
        self.env = dict(os.environ if env is None else env)
        self.env.setdefault("OMP_NUM_THREADS", "1")
        self.env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [self.env.get("PYTHONPATH")] if p])
        self.lock = threading.Lock()

    def run(self, tasks, on_record) -> None:
        todo: queue.Queue = queue.Queue()
        for t in tasks:
            todo.put(t)
        log_dir = tempfile.mkdtemp(prefix="opinfo-logs-")
        errors: list = []

        def emit(rec):
            with self.lock:
                on_record(rec)

        def serve():
            w = Worker(self.cmd, self.env, log_dir)
            try:
                while True:
                    try:
                        task = todo.get_nowait()
                    except queue.Empty:
                        return
                    self._task(w, task, emit)
            except BaseException as e:   # surface it in the caller's thread
                errors.append(e)
            finally:
                w.stop()

        threads = [threading.Thread(target=serve, daemon=True) for _ in range(max(1, self.workers))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        try:
            os.rmdir(log_dir)
        except OSError:
            pass
        if errors:
            raise errors[0]

    def _task(self, w: Worker, task: dict, emit) -> None:
        """Run ``task`` on ``w`` to its end, restarting the worker after a crash or timeout."""
        task = dict(task, skip=list(task.get("skip", ())))
        while True:
            if w.proc is None or w.proc.poll() is not None or w.tasks >= self.max_tasks:
                w.stop()
                w.tasks = 0
                w.start(self.start_timeout)
            w.send(task)
            unit, progress = None, False
            while True:
                msg = w.read(self.timeout)
                if msg is None or msg == "timeout":
                    status = "crash" if msg is None else "timeout"
                    why = w.death() if msg is None else f"no result after {self.timeout:.0f} s"
                    w.stop()
                    if unit is None and progress:   # died between units: resume
                        break
                    if unit is None:   # died before its first unit (the op's samples)
                        emit(dict(op=task["op"], dtype=task["dtype"], backend="*", sample=None, mode=None,
                                  status=status, error=why))
                        return
                    i, mode, backend = unit
                    emit(dict(op=task["op"], dtype=task["dtype"], backend=backend, sample=i, mode=mode,
                              status=status, error=why))
                    task["skip"].append(unit)
                    break   # restart and resume after the unit
                if "unit" in msg:
                    unit = msg["unit"]
                elif "record" in msg:
                    emit(msg["record"])
                    progress = True
                    if unit is not None:
                        task["skip"].append(unit)
                    unit = None
                elif msg.get("done"):
                    return


if __name__ == "__main__":
    sys.exit(worker_main())
