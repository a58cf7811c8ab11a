"""kiln on two gloo ranks (CPU): DDP and FSDP2 training against single-process eager on the full batch,
the activation budget on each rank, and ranks sharing one kernel cache directory (issue #22).

Two rank processes are spawned once for the module (``Ranks``): starting one costs seconds (torch,
Dynamo, kiln). Each test hands both ranks a job, a function of this module run as ``job(rank, **kwargs)``,
and waits for both answers for at most ``JOB_TIMEOUT_S``: a hang or a dead rank fails the test, and the
next test starts new ranks.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import os
import queue
import re
import socket
import time
import traceback
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

WORLD = 2
JOB_TIMEOUT_S = 240
STEPS = 3

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="needs torch.distributed with the gloo backend")


# -- the model, its data and its training loop ------------------------------------------------------
class Block(nn.Module):
    """Pre-norm MLP block: x + out(gelu(fc(ln(x))))."""

    def __init__(self, d: int):
        super().__init__()
        self.ln, self.fc, self.out = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.out(F.gelu(self.fc(self.ln(x))))


class Net(nn.Module):
    """Linear, blocks, Linear. At d=256 each block Linear holds 1 MiB of weights: the smallest bucket
    Dynamo's DDP optimizer accepts is 1 MiB (DDP's first bucket)."""

    def __init__(self, d: int = 256, n_in: int = 32, n_out: int = 8, n_blocks: int = 2):
        super().__init__()
        self.inp = nn.Linear(n_in, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_blocks))
        self.head = nn.Linear(d, n_out)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build() -> Net:
    torch.manual_seed(0)
    return Net()


def full_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)


def my_half(rank: int):
    """This rank's share of the full batch: DDP and FSDP average the gradients of the two halves."""
    return tuple(t.chunk(WORLD)[rank] for t in full_batch())


def train(fn, params, x, y) -> list:
    """``STEPS`` SGD steps (momentum) on the mean squared error of ``fn(x)``; returns the losses."""
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    losses = []
    for _ in range(STEPS):
        loss = F.mse_loss(fn(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@functools.lru_cache(maxsize=None)
def eager_reference():
    """(state dict, losses) of single-process eager training on the full batch."""
    model = build()
    losses = train(model, model.parameters(), *full_batch())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def fully_shard_fn():
    """FSDP2's ``fully_shard``: public in ``torch.distributed.fsdp`` since torch 2.6, in ``_composable`` before."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def shard(model: Net) -> None:
    """FSDP2 per block, then the root. Gradients are reduced with SUM and FSDP's own division: gloo's
    reduce-scatter with ``ReduceOp.AVG`` summed without dividing in some torch releases (pytorch#162338)."""
    fully_shard = fully_shard_fn()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    for m in model.modules():
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)


# -- what the ranks run ---------------------------------------------------------------------------
@contextlib.contextmanager
def watch():
    """What kiln compiles in this scope: ``graphs`` (Dynamo graphs it received) and ``saved_bytes`` (per
    training graph, the activation bytes its forward saves for the backward: the ``partition`` events)."""
    from kiln.debug import observe
    from kiln.partition.estimate import size_bytes
    seen = {"graphs": 0, "saved_bytes": []}

    def on(event, data):
        if event == "graph" and data["stage"] == "capture":
            seen["graphs"] += 1
        elif event == "partition":
            seen["saved_bytes"].append(sum(size_bytes(n) for n in data["saved"] if n.op != "placeholder"))

    with observe(on):
        yield seen


def plain(state: dict) -> dict:
    """Tensors as numpy arrays, to cross the process boundary by value."""
    return {k: v.detach().numpy().copy() for k, v in state.items()}


def job_ddp(rank: int, bucket_cap_mb: float = 25, budget: float = 1.0, codegen: str = "auto") -> dict:
    """DDP training compiled whole by kiln; Dynamo's DDP optimizer splits the graph at bucket bounds."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = build()
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    compiled = torch.compile(ddp, backend="kiln", options={"activation_memory_budget": budget, "codegen": codegen})
    with torch._dynamo.config.patch(optimize_ddp=True), watch() as seen:
        losses = train(compiled, model.parameters(), *my_half(rank))
    return dict(seen, losses=losses, state=plain(model.state_dict()))


def job_fsdp(rank: int, codegen: str = "auto") -> dict:
    """FSDP2 training compiled by kiln (Dynamo compiles each block: the root's loop over the FSDP blocks
    has graph breaks, so Dynamo runs the root eagerly)."""
    model = build()
    shard(model)
    compiled = torch.compile(model, backend="kiln", options={"codegen": codegen})
    with watch() as seen:
        losses = train(compiled, model.parameters(), *my_half(rank))
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}   # a collective: every rank
    return dict(seen, losses=losses, state=plain(full))


def job_shared_cache(rank: int, directory: str) -> dict:
    """A block compiled with the Triton target (interpreted on the CPU) by both ranks at once, writing
    kernel modules into the same ``directory``: its output and gradients beside eager's, and the source of
    each kernel it ran by name."""
    import kiln
    from kiln.runtime.kernels import reset
    torch.manual_seed(rank)
    block, x = Block(8), torch.randn(4, 8)
    compiled = torch.compile(block, backend="kiln", options={"codegen": "triton"})
    before = kiln.counters["codegen"]["runtime_fallback"]

    def step(fn):
        out = fn(x)
        out.square().sum().backward()
        grads = [p.grad.clone() for p in block.parameters()]
        block.zero_grad()
        return [out.detach(), *grads]

    reset()   # cold: every kernel module is written to the directory again
    with mock.patch.dict(os.environ, KILN_KERNEL_DIR=directory):
        dist.barrier()   # both ranks compile at the same moment
        got, sources = kiln.run_and_get_code(step, compiled)
    kernels = {m.group(1): text for text in sources
               for m in [re.search(r"def (kiln_(?:pw|red|scatter)_[0-9a-f]{12})\(", text)] if m}
    return dict(got=[t.numpy() for t in got], want=[t.numpy() for t in step(block)], kernels=kernels,
                fallbacks=kiln.counters["codegen"]["runtime_fallback"] - before)


def serve(rank: int, port: int, jobs, results) -> None:
    """A rank: join the gloo group, then run ``(job name, kwargs)`` from ``jobs`` until None arrives."""
    os.environ["TRITON_INTERPRET"] = "1"   # before anything imports triton: kernels run on CPU tensors
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=JOB_TIMEOUT_S))
    try:
        for job, kwargs in iter(jobs.get, None):
            torch._dynamo.reset()
            try:
                results.put((rank, True, globals()[job](rank, **kwargs)))
            except Exception:
                results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()
    results.close()
    results.join_thread()   # the answers are sent; skip the interpreter's teardown (seconds with torch loaded)
    os._exit(0)


# -- the parent's side ------------------------------------------------------------------------------
class RankError(RuntimeError):
    """A job failed on a rank (its traceback follows), a rank died, or the ranks did not answer in time."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ranks:
    """``WORLD`` spawned processes in one gloo group, started on the first ``run``."""

    def __init__(self):
        self.procs = None

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        self.results, self.jobs = ctx.Queue(), [ctx.Queue() for _ in range(WORLD)]
        self.procs = [ctx.Process(target=serve, args=(r, port, self.jobs[r], self.results), daemon=True)
                      for r in range(WORLD)]
        for p in self.procs:
            p.start()

    def run(self, job: str, **kwargs) -> list:
        """``job(rank, **kwargs)`` on every rank; returns the answers in rank order."""
        if self.procs is None:
            self.start()
        for q in self.jobs:
            q.put((job, kwargs))
        answers, deadline = {}, time.monotonic() + JOB_TIMEOUT_S
        while len(answers) < WORLD:
            try:
                rank, ok, value = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.close()
                    raise RankError(f"{job}: rank {dead} died" if dead else
                                    f"{job}: no answer from every rank within {JOB_TIMEOUT_S} s")
                continue
            if not ok:
                self.close()
                raise RankError(f"{job} failed on rank {rank}:\n{value}")
            answers[rank] = value
        return [answers[r] for r in range(WORLD)]

    def close(self) -> None:
        """Stop the ranks: ask, then kill those still running after 10 s (stuck in a collective)."""
        if self.procs is None:
            return
        for q in self.jobs:
            q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        self.procs = None


@pytest.fixture(scope="module")
def ranks():
    pool = Ranks()
    yield pool
    pool.close()


def assert_trained_like_eager(answers) -> None:
    """Every rank's parameters equal eager's after ``STEPS`` steps on the full batch, and the mean of the
    ranks' losses (on their halves) is eager's loss at every step."""
    state, losses = eager_reference()
    for rank, a in enumerate(answers):
        for name, want in state.items():
            torch.testing.assert_close(torch.from_numpy(a["state"][name]), want,
                                       msg=lambda m: f"rank {rank}, {name}: {m}")
    mean = [sum(ls) / WORLD for ls in zip(*(a["losses"] for a in answers))]
    torch.testing.assert_close(torch.tensor(mean), torch.tensor(losses))


# -- the tests --------------------------------------------------------------------------------------
def test_ddp_buckets_are_separate_kiln_graphs_and_train_like_eager(ranks):
    answers = ranks.run("job_ddp", bucket_cap_mb=1)
    assert_trained_like_eager(answers)
    for rank, a in enumerate(answers):
        assert a["graphs"] > 1, f"rank {rank}: the DDP optimizer's split reached kiln as one graph"
        assert len(a["saved_bytes"]) == a["graphs"], f"rank {rank}: each split is a training graph kiln cuts"
    assert answers[0]["graphs"] == answers[1]["graphs"]


def test_fsdp2_trains_like_eager(ranks):
    answers = ranks.run("job_fsdp")
    assert_trained_like_eager(answers)
    assert all(a["graphs"] >= 1 and a["saved_bytes"] for a in answers), "kiln compiled no training graph"


def test_activation_budget_applies_on_each_rank(ranks):
    full = ranks.run("job_ddp", budget=1.0)
    half = ranks.run("job_ddp", budget=0.5)
    assert_trained_like_eager(half)
    for rank in range(WORLD):
        assert full[rank]["graphs"] == half[rank]["graphs"]
        saved_full, saved_half = sum(full[rank]["saved_bytes"]), sum(half[rank]["saved_bytes"])
        assert saved_half < saved_full, f"rank {rank}: budget 0.5 saves {saved_half} B, 1.0 saves {saved_full} B"


@pytest.mark.slow
@pytest.mark.parametrize("job, kwargs", [("job_ddp", {"bucket_cap_mb": 1}), ("job_fsdp", {})], ids=["ddp", "fsdp2"])
def test_triton_target_trains_like_eager(ranks, job, kwargs):
    """The extra sweep: DDP and FSDP2 with kiln's Triton target (interpreted on the CPU)."""
    pytest.importorskip("triton")
    assert_trained_like_eager(ranks.run(job, codegen="triton", **kwargs))


def test_ranks_share_one_kernel_cache_dir(ranks, tmp_path):
    """Both ranks write the same kernel modules (KILN_KERNEL_DIR) at once: each file holds its whole source
    and no temporary file is left."""
    pytest.importorskip("triton")
    directory = tmp_path / "kernels"
    answers = ranks.run("job_shared_cache", directory=str(directory))
    for rank, a in enumerate(answers):
        for got, want in zip(a["got"], a["want"]):
            torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(want), rtol=1e-5, atol=1e-5)
        assert a["fallbacks"] == 0, f"rank {rank}: a kernel fell back to ATen"
    kernels = answers[0]["kernels"]
    assert kernels and answers[1]["kernels"] == kernels, "the ranks generated different kernels"
    files = [p.relative_to(directory) for p in directory.rglob("*") if p.is_file()]
    assert sorted(p.stem for p in files if len(p.parts) == 1 and p.suffix == ".py") == sorted(kernels)
    for name, source in kernels.items():
        assert (directory / f"{name}.py").read_text() == source, f"{name}.py does not hold the kernel's source"
    partial = [str(p) for p in files if not (p.suffix == ".py" and len(p.parts) == 1 or
                                              p.suffix == ".pyc" and p.parts[0] == "__pycache__")]
    assert not partial, f"partial or temporary files left in the kernel cache: {partial}"
