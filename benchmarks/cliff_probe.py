"""The random-op cliff of #31, measured directly (GPU): a model trained as its library builds it (dropout and
stochastic depth on), eager / inductor / kiln in one process, median step time, host time per step (from the
step's start until its last launch returns, no synchronization inside) and peak memory.

    PYTHONPATH=. python3 benchmarks/cliff_probe.py [swin|vit|convnext|bert|gpt2 ...] [--steps 20]

``kiln bench --suite zoo`` is the full harness; this probe is the quick check of one or two rows.
"""
from __future__ import annotations

import argparse

import torch

from probe_step import first_call, times   # benchmarks/ is the script's folder


def _swin():
    import timm
    return timm.create_model("swin_tiny_patch4_window7_224"), "image"


def _vit():
    import timm
    return timm.create_model("vit_base_patch16_224", drop_path_rate=0.1), "image"


def _convnext():
    import timm
    return timm.create_model("convnext_tiny", drop_path_rate=0.1), "image"


def _bert():
    import transformers
    return transformers.BertForMaskedLM(transformers.BertConfig()), "text"


def _gpt2():
    import transformers
    return transformers.GPT2LMHeadModel(transformers.GPT2Config()), "text"


MODELS = {"swin": _swin, "vit": _vit, "convnext": _convnext, "bert": _bert, "gpt2": _gpt2}


def _step_fn(model, kind, device):
    if kind == "image":
        x = torch.randn(32, 3, 224, 224, device=device)
        y = torch.randint(0, 1000, (32,), device=device)
        loss = lambda f: torch.nn.functional.cross_entropy(f(x), y)  # noqa: E731
    else:
        ids = torch.randint(0, 30000, (8, 512), device=device)
        loss = lambda f: f(input_ids=ids, labels=ids).loss  # noqa: E731
    return loss


def measure(name, backend, steps):
    import copy
    torch.manual_seed(0)
    make = MODELS[name]
    model, kind = make()
    model = copy.deepcopy(model).cuda().train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    f = model if backend == "eager" else torch.compile(model, backend=backend)
    loss_of = _step_fn(model, kind, "cuda")

    def step():
        with torch.autocast("cuda", torch.bfloat16):
            loss = loss_of(f)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    first = first_call(step)
    torch.cuda.reset_peak_memory_stats()
    step_ms, host_ms, worst_ms = times(step, steps)
    peak = torch.cuda.max_memory_allocated() / 2 ** 20
    del f, model, opt
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return dict(step=step_ms, worst=worst_ms, host=host_ms, peak=peak, first=first)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*", default=["swin"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--backends", default="eager,inductor,kiln")
    args = ap.parse_args()
    import kiln  # noqa: F401  (registers the backend)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| model | backend | step ms | worst ms | host ms | peak MiB | first call s |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models:
        for b in args.backends.split(","):
            try:
                r = measure(name, b, args.steps)
                print(f"| {name} | {b} | {r['step']:.2f} | {r['worst']:.2f} | {r['host']:.2f} | {r['peak']:.0f} | "
                      f"{r['first']:.1f} |", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"| {name} | {b} | error: {type(e).__name__}: {str(e)[:200]} |", flush=True)


if __name__ == "__main__":
    main()
