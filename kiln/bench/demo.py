"""``kiln demo``: compile a small GPT's training step and a small CNN's inference, check both against
eager, and print eager vs kiln step time, compile time and saved-activation memory.

Runs on the GPU when there is one, else on the CPU. Finishes in about a minute on 2 CPU cores.
"""
from __future__ import annotations

import argparse
import copy
import time

import torch


def _train_case(device: str, size: str, steps: int):
    from kiln.bench.measure import saved_bytes, step_times, summarize
    from kiln.bench.models import build_gpt
    import kiln

    model, (ids, targets) = build_gpt(size, device=device)
    eager = model
    compiled_model = copy.deepcopy(model)
    compiled = kiln.compile(compiled_model)

    def fwd(m):
        return lambda: m(ids, targets)

    t0 = time.perf_counter()
    loss_k = compiled(ids, targets)
    loss_k.backward()
    compile_s = time.perf_counter() - t0
    loss_e = eager(ids, targets)
    loss_e.backward()
    grads_ok = all(torch.allclose(p.grad, q.grad, rtol=1e-3, atol=1e-5)
                   for p, q in zip(eager.parameters(), compiled_model.parameters()))
    ok = torch.allclose(loss_e, loss_k, rtol=1e-4) and grads_ok
    rows = {}
    for name, m in (("eager", eager), ("kiln", compiled)):
        step = lambda m=m: m(ids, targets).backward()
        rows[name] = {
            "ms": summarize(step_times(step, device, warmup=1, min_iters=steps, max_iters=steps))["ms"],
            "saved": saved_bytes(fwd(m), lambda out: out.backward(), [ids, targets])["saved_bytes"],
        }
    rows["kiln"]["compile_s"] = compile_s
    return ok, rows


def _infer_case(device: str, size: str, steps: int):
    from kiln.bench.measure import step_times, summarize
    from kiln.bench.models import build_cnn
    import kiln

    model, (x, _) = build_cnn(size, device=device)
    model.eval()
    with torch.no_grad():
        ref = model(x)
        compiled = kiln.compile(copy.deepcopy(model))
        t0 = time.perf_counter()
        out = compiled(x)
        compile_s = time.perf_counter() - t0
        ok = torch.allclose(ref, out, rtol=1e-3, atol=1e-4)
        rows = {}
        for name, m in (("eager", model), ("kiln", compiled)):
            rows[name] = {"ms": summarize(step_times(lambda m=m: m(x), device, warmup=1,
                                                     min_iters=steps, max_iters=steps))["ms"]}
    rows["kiln"]["compile_s"] = compile_s
    return ok, rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="kiln demo", description=__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args(argv)
    size = "tiny" if args.device == "cpu" else "cpu"
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"kiln demo on {args.device} (torch {torch.__version__})")
    table = Table("case", "backend", "step ms", "compile s", "saved activations", "matches eager")
    all_ok = True
    for label, fn in (("GPT train step", _train_case), ("CNN inference", _infer_case)):
        ok, rows = fn(args.device, size, args.steps)
        all_ok &= ok
        for backend, r in rows.items():
            saved = f"{r['saved'] / 2**20:.2f} MiB" if "saved" in r else "-"
            comp = f"{r['compile_s']:.1f}" if "compile_s" in r else "-"
            table.add_row(label, backend, f"{r['ms']:.2f}", comp, saved,
                          ("yes" if ok else "NO") if backend == "kiln" else "")
    console.print(table)
    return 0 if all_ok else 1
