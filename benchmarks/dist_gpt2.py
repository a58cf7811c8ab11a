"""GPT-2 medium training on several GPUs under DDP or FSDP2, run by eager, inductor or kiln (issue #22).

One combination per torchrun call; rank 0 writes the JSON (every rank's numbers):
    torchrun --nproc_per_node=2 benchmarks/dist_gpt2.py --mode ddp --backend kiln --steps 20 --out $OUT/ddp_kiln.json
The summary compares the files, each backend's losses against eager's of the same mode:
    python benchmarks/dist_gpt2.py --summarize $OUT/*.json --md $OUT/dist_gpt2.md
``benchmarks/dist_gpt2.sh`` runs the six combinations and the summary. A CPU smoke test (gloo, tiny model):
    torchrun --nproc_per_node=2 benchmarks/dist_gpt2.py --device cpu --tiny --mode fsdp2 --backend kiln --steps 4

The model has random weights from a fixed seed, built offline: HuggingFace's GPT2LMHeadModel when transformers
is installed, else kiln's built-in GPT of the same shape. Dropout is off, so that backends see the same
computation; every step draws a new global batch from a seeded generator and each rank takes its rows.
bf16 autocast, AdamW. DDP compiles the whole DDP module (Dynamo's DDP optimizer splits the graph at bucket
bounds); FSDP2 shards each block and the root and compiles the whole model: Dynamo compiles the blocks
(the loop over them breaks graphs) and the code before and after the loop.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

MEDIUM = dict(n_layer=24, n_embd=1024, n_head=16, vocab=50257, batch=8, seq=1024)
TINY = dict(n_layer=2, n_embd=64, n_head=2, vocab=512, batch=2, seq=32)


@dataclass
class Built:
    model: nn.Module
    blocks: nn.ModuleList   # FSDP2's units
    hf: bool                # HuggingFace (forward(input_ids, labels)) or kiln's GPT (forward(ids, targets))


def build_model(shape: dict, device, seed: int, kind: str = "auto") -> Built:
    """GPT-2 of ``shape`` with random weights, on ``device``: ``kind`` 'hf' (transformers), 'kiln' (kiln's
    built-in GPT) or 'auto' (hf when transformers is installed)."""
    torch.manual_seed(seed)
    if kind == "auto":
        kind = "hf" if importlib.util.find_spec("transformers") else "kiln"
    with torch.device(device):
        model = hf_gpt2(shape) if kind == "hf" else kiln_gpt(shape)
    return Built(model, model.transformer.h if kind == "hf" else model.blocks, hf=kind == "hf")


def hf_gpt2(shape: dict) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    last = shape["vocab"] - 1
    cfg = GPT2Config(n_layer=shape["n_layer"], n_embd=shape["n_embd"], n_head=shape["n_head"],
                     vocab_size=shape["vocab"], n_positions=max(1024, shape["seq"]), resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=last, eos_token_id=last)
    return GPT2LMHeadModel(cfg)


def kiln_gpt(shape: dict) -> nn.Module:
    from kiln_bench.models import GPT, GPTConfig
    return GPT(GPTConfig(vocab=shape["vocab"], seq=shape["seq"], n_layer=shape["n_layer"], n_head=shape["n_head"],
                         n_embd=shape["n_embd"], batch=shape["batch"], sdpa=True))


def forward_loss(fn, tokens, hf: bool):
    """The mean next-token loss of ``tokens`` (batch x seq+1)."""
    if hf:
        return fn(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss
    return fn(tokens[:, :-1], tokens[:, 1:])


def fully_shard_fn():
    """FSDP2's ``fully_shard``: public in ``torch.distributed.fsdp`` since torch 2.6, in ``_composable`` before."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def wrap(built: Built, mode: str, device, bucket_mb: float) -> nn.Module:
    """The DDP module, or the model sharded by FSDP2 (each block, then the root)."""
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(built.model, device_ids=[device.index] if device.type == "cuda" else None,
                   bucket_cap_mb=bucket_mb)
    fully_shard = fully_shard_fn()
    for block in built.blocks:
        fully_shard(block)
    fully_shard(built.model)
    if device.type == "cpu":   # gloo's reduce-scatter AVG summed in some releases (pytorch#162338)
        for m in built.model.modules():
            if hasattr(m, "set_force_sum_reduction_for_comms"):
                m.set_force_sum_reduction_for_comms(True)
    return built.model


def compiled(module: nn.Module, backend: str):
    """``module`` as ``backend`` runs it (compilation happens at the first step)."""
    if backend == "eager":
        return module
    if backend == "inductor":
        return torch.compile(module)
    import kiln  # noqa: F401  registers the "kiln" backend
    return torch.compile(module, backend="kiln")


def global_batch(step: int, seed: int, world: int, rank: int, shape: dict, device):
    """This rank's rows of step ``step``'s global batch (the same on every backend and world size)."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    tokens = torch.randint(0, shape["vocab"], (world * shape["batch"], shape["seq"] + 1), generator=g)
    return tokens[rank * shape["batch"]:(rank + 1) * shape["batch"]].to(device)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def kiln_graphs(counts: dict):
    """Count the Dynamo graphs kiln compiles in this scope into ``counts['kiln_graphs']``."""
    counts["kiln_graphs"] = 0
    try:
        from kiln.debug import observe
    except ImportError:
        yield
        return

    def on(event, data):
        if event == "graph" and data["stage"] == "capture":
            counts["kiln_graphs"] += 1
    with observe(on):
        yield


def train(fn, built: Built, opt, args, shape, device, rank: int, world: int) -> dict:
    """``args.steps`` steps; per step its wall time (s) and the global mean loss; on CUDA the peak memory
    of the warm-up steps (compiles included) and of the steps after."""
    times, losses, rec = [], [], {}
    for step in range(args.steps):
        tokens = global_batch(step, args.seed, world, rank, shape, device)
        if step == args.warmup and device.type == "cuda":
            rec["peak_warmup_mib"] = torch.cuda.max_memory_allocated(device) / 2 ** 20
            torch.cuda.reset_peak_memory_stats(device)
        sync(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
            loss = forward_loss(fn, tokens, built.hf)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach().float()
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
        sync(device)
        times.append(time.perf_counter() - t0)
    if device.type == "cuda":
        rec["peak_mib"] = torch.cuda.max_memory_allocated(device) / 2 ** 20
    return dict(rec, step_s=times, losses=losses)


def shape_of(args) -> dict:
    """The model and batch shape: GPT-2 medium (or tiny) with ``--batch``/``--seq`` where given."""
    return dict(TINY if args.tiny else MEDIUM, **{k: getattr(args, k) for k in ("batch", "seq") if getattr(args, k)})


def device_of(args) -> torch.device:
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" else torch.device("cpu")


def measure(args) -> dict:
    """One rank's record of one combination."""
    rank, world, device, shape = dist.get_rank(), dist.get_world_size(), device_of(args), shape_of(args)
    built = build_model(shape, device, args.seed, args.model)
    fn = compiled(wrap(built, args.mode, device, args.bucket_mb), args.backend)
    opt = torch.optim.AdamW(built.model.parameters(), lr=args.lr)
    counts: dict = {}
    with kiln_graphs(counts):
        rec = train(fn, built, opt, args, shape, device, rank, world)
    from torch._dynamo.utils import counters
    rec.update(counts, rank=rank, model="hf" if built.hf else "kiln-gpt",
               dynamo_graphs=counters["stats"]["unique_graphs"], graph_breaks=sum(counters["graph_break"].values()))
    return rec


def summary_of(ranks: list, args, shape: dict) -> dict:
    """The combination's record: rank 0's losses and times, every rank's peak memory."""
    r0 = ranks[0]
    steady = r0["step_s"][args.warmup:] or r0["step_s"]
    q = statistics.quantiles(steady, n=4) if len(steady) > 1 else [steady[0]] * 3
    med = statistics.median(steady)
    return {"mode": args.mode, "backend": args.backend, "world": len(ranks), "device": args.device,
            "model": r0["model"], "shape": shape, "steps": args.steps,
            "warmup": args.warmup, "dtype": args.dtype, "bucket_mb": args.bucket_mb,
            "first_step_s": r0["step_s"][0], "compile_s": r0["step_s"][0] - med, "median_step_ms": 1e3 * med,
            "p25_ms": 1e3 * q[0], "p75_ms": 1e3 * q[2], "min_ms": 1e3 * min(steady), "max_ms": 1e3 * max(steady),
            "losses": r0["losses"], "peak_mib": [r.get("peak_mib") for r in ranks],
            "peak_warmup_mib": [r.get("peak_warmup_mib") for r in ranks],
            "kiln_graphs": [r["kiln_graphs"] for r in ranks], "dynamo_graphs": r0["dynamo_graphs"],
            "graph_breaks": r0["graph_breaks"], "ranks": ranks}


def run(args) -> None:
    """Train one combination on this rank; rank 0 writes the JSON and prints its summary row."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")   # NVLink multicast off
    if args.device == "cuda":
        torch.cuda.set_device(device_of(args))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", timeout=datetime.timedelta(minutes=5))
    try:
        rec = measure(args)
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, rec)
    finally:
        dist.destroy_process_group()
    if rec["rank"] == 0:
        out = summary_of(ranks, args, shape_of(args))
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
        print(row_text(out, None))


# -- the summary -------------------------------------------------------------------------------------
def max_rel_diff(losses: list, ref: list) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(losses, ref))


def row_text(r: dict, eager) -> str:
    peak = "/".join(f"{p:.0f}" if p is not None else "-" for p in r["peak_mib"])
    diff = f"{max_rel_diff(r['losses'], eager['losses']):.2e}" if eager and eager is not r else "-"
    return (f"| {r['mode']} | {r['backend']} | {r['compile_s']:.1f} | {r['median_step_ms']:.1f} "
            f"({r['p25_ms']:.1f}-{r['p75_ms']:.1f}, {r['min_ms']:.1f}-{r['max_ms']:.1f}) | {peak} | "
            f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} | {diff} | {r['dynamo_graphs']}, {r['graph_breaks']} | "
            f"{'/'.join(map(str, r['kiln_graphs']))} |")


HEADER = ("| mode | backend | compile s (first step - median) | median step ms (p25-p75, min-max) | "
          "peak MiB per rank after warm-up | loss first -> last | max rel. loss diff vs eager | "
          "Dynamo graphs, breaks (rank 0) | kiln graphs per rank |\n|---|---|---|---|---|---|---|---|---|")


def summarize(paths: list) -> str:
    rows = []
    for p in paths:
        with open(p) as f:
            rows.append(json.load(f))
    rows.sort(key=lambda r: (r["mode"], ["eager", "inductor", "kiln"].index(r["backend"])))
    eager = {r["mode"]: r for r in rows if r["backend"] == "eager"}
    lines = [HEADER] + [row_text(r, eager.get(r["mode"])) for r in rows]
    if rows:
        r = rows[0]
        lines.append(f"\n{r['world']} ranks on {r['device']}, model {r['model']} {r['shape']}, {r['dtype']} autocast, "
                     f"AdamW, {r['steps']} steps (median over the steps after {r['warmup']}), DDP buckets "
                     f"{r['bucket_mb']} MB. Loss diff: max over steps of |loss - eager| / eager, same data.")
    for mode in sorted(eager):
        lines.append(f"\n{mode} losses per step:")
        lines += [f"- {r['backend']}: " + " ".join(f"{v:.4f}" for v in r["losses"]) for r in rows if r["mode"] == mode]
    return "\n".join(lines)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("ddp", "fsdp2"), default="ddp")
    p.add_argument("--backend", choices=("eager", "inductor", "kiln"), default="kiln")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model for a CPU smoke test")
    p.add_argument("--model", choices=("auto", "hf", "kiln"), default="auto",
                   help="HuggingFace GPT2LMHeadModel or kiln's built-in GPT (auto: hf when transformers is installed)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the median step time")
    p.add_argument("--batch", type=int, default=0, help="sequences per rank (default: 8, tiny 2)")
    p.add_argument("--seq", type=int, default=0, help="tokens per sequence (default: 1024, tiny 32)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="autocast dtype")
    p.add_argument("--bucket-mb", dest="bucket_mb", type=float, default=100.0, help="DDP bucket_cap_mb")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="JSON file rank 0 writes")
    p.add_argument("--summarize", nargs="*", help="JSON files to compare (no training)")
    p.add_argument("--md", help="with --summarize: write the Markdown table here too")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if args.summarize is not None:
        text = summarize(args.summarize)
        print(text)
        if args.md:
            with open(args.md, "w") as f:
                f.write(text + "\n")
        return 0
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
