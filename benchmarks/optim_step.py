"""A compiled optimizer step against eager and TorchInductor (issue #36 item 4), on the CPU or a GPU.

    PYTHONPATH=. python benchmarks/optim_step.py [--threads 1,2] [--steps 50] [--opts sgd,adam,adamw]
        [--models 4x1024,8x256,64x32] [--backends eager,inductor,kiln] [--codegen cpp]
        [--variant before:tuning.write_mutations=False,tuning.merge_updates=0 ...] [--device cuda]

For each optimizer (SGD momentum 0.9, Adam, AdamW; foreach default, capturable=False) over each model
(N x Linear(d, d)), the step is compiled the way users write it (``@torch.compile(backend=...) def step():
opt.step()``), warmed up, then timed interleaved: eager, inductor and kiln take turns step by step, and each
figure is the median over ``--steps`` steps. Per step: compiled kernel calls + top-level ATen ops +
allocations (``count_step``).
``ok``: after 3 steps from the same start, parameters and optimizer state equal eager's within a tolerance
derived from a float64 run of eager (|compiled - fp64| <= 4 * |eager32 - fp64| + 1e-6 relative).
``--variant name:option=value,...`` adds a kiln column compiled with those options (``kiln options``).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import kiln

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3),
}


DEVICE = ["cpu"]


def make_model(spec: str, dtype=torch.float32):
    """'4x1024' -> 4 x Linear(1024, 1024) with gradients set (on ``DEVICE[0]``)."""
    n, d = (int(x) for x in spec.split("x"))
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(d, d) for _ in range(n)]).to(DEVICE[0], dtype)
    for p in m.parameters():
        p.grad = torch.randn_like(p)
    return m


def setup(opt_name: str, spec: str, backend, dtype=torch.float32, codegen=None):
    """(model, optimizer, step function) for one backend; ``backend=None``: eager; a dict: kiln's options."""
    m = make_model(spec, dtype)
    opt = OPTIMIZERS[opt_name](list(m.parameters()))
    if backend is None:
        return m, opt, opt.step

    def step():
        opt.step()
    if isinstance(backend, dict) or (backend == "kiln" and codegen):
        options = dict(backend) if isinstance(backend, dict) else {}
        return m, opt, kiln.compile(step, **options, **({"codegen": codegen} if codegen else {}))
    return m, opt, torch.compile(step, backend=backend)


def state_of(m, opt):
    """The parameters and every optimizer state tensor, in a fixed order."""
    out = [p.detach() for p in m.parameters()]
    for p in m.parameters():
        for k, v in sorted(opt.state[p].items()):
            if isinstance(v, torch.Tensor):
                out.append(v)
    return out


def check(opt_name, spec, backend, codegen=None, steps=3):
    """Max violation of |compiled - fp64| <= 4 |eager - fp64| + 1e-6 (1 + |fp64|) after ``steps`` steps (<= 0: ok)."""
    runs = {}
    torch._dynamo.reset()
    for key, be, dt in (("ref", None, torch.float64), ("eager", None, torch.float32), ("got", backend, torch.float32)):
        m, opt, step = setup(opt_name, spec, be, dt, codegen)
        for _ in range(steps):
            step()
        runs[key] = [t.double() for t in state_of(m, opt)]
    worst = 0.0
    for r, e, g in zip(runs["ref"], runs["eager"], runs["got"]):
        bound = 4 * (e - r).abs() + 1e-6 * (1 + r.abs())
        worst = max(worst, float(((g - r).abs() - bound).max()))
    return worst


def count_step(step) -> tuple:
    """(compiled kernel calls, top-level ATen ops, allocations) of one step: kiln's kernel launchers (Python
    functions of ``kiln_kernels.*`` modules) and inductor's C++ kernels (builtins named ``kernel``) are counted
    by ``sys.setprofile``; ATen ops not nested in another ATen op by ``torch.profiler`` (``empty*``: allocations)."""
    calls = [0]

    def hook(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "call" and \
                str(frame.f_globals.get("__name__", "")).startswith("kiln_kernels."):
            calls[0] += 1
        elif event == "c_call" and getattr(arg, "__name__", "") == "kernel" and \
                not str(getattr(arg, "__module__", "")).startswith(("torch", "builtins")):
            calls[0] += 1   # inductor's C++ kernels; its Triton kernels: CachingAutotuner.run
        elif event == "call" and frame.f_code.co_name == "run" and "triton_heuristics" in frame.f_code.co_filename:
            calls[0] += 1
    sys.setprofile(hook)
    try:
        step()
    finally:
        sys.setprofile(None)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    ops = allocs = 0
    for e in prof.events():
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if e.name.startswith("aten::") and parent is None:
            if e.name.startswith("aten::empty"):
                allocs += 1
            else:
                ops += 1
    return calls[0], ops, allocs


def bench(opt_name, spec, backends, n_steps, codegen=None, variants=None):
    """{backend: (median ms, kernels per step, check)} with the steps interleaved across backends."""
    runs, kernels = {}, {}
    variants = variants or {}
    torch._dynamo.reset()
    for be in backends:
        runs[be] = setup(opt_name, spec, None if be == "eager" else variants.get(be, be), codegen=codegen)
        for _ in range(3):   # compiles (SGD's first step makes its momentum buffers: a second graph)
            runs[be][2]()
        kernels[be] = count_step(runs[be][2])
    times = {be: [] for be in backends}
    for _ in range(n_steps):
        for be in backends:
            sync()
            t0 = time.perf_counter()
            runs[be][2]()
            sync()
            times[be].append((time.perf_counter() - t0) * 1e3)
    oks = {be: check(opt_name, spec, variants.get(be, be), codegen) if be != "eager" else 0.0 for be in backends}
    return {be: (statistics.median(times[be]), kernels[be], oks[be]) for be in backends}


def sync():
    if DEVICE[0] != "cpu":
        torch.cuda.synchronize()


def _value(text: str):
    """An option's value from the command line: a bool, int, float or the string."""
    if text in ("True", "False"):
        return text == "True"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--opts", default="sgd,adam,adamw")
    ap.add_argument("--models", default="4x1024,8x256,64x32")
    ap.add_argument("--backends", default="eager,inductor,kiln")
    ap.add_argument("--codegen", default=None, help="kiln's codegen option (cpp, triton)")
    ap.add_argument("--variant", action="append", default=[], help="name:option=value,... (a kiln column)")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args(argv)
    DEVICE[0] = a.device
    backends = a.backends.split(",")
    variants = {}
    for v in a.variant:
        name, _, sets = v.partition(":")
        variants[name] = {k: _value(x) for k, _, x in (kv.partition("=") for kv in sets.split(",") if kv)}
        backends.append(name)
    print("| threads | optimizer | params | " + " | ".join(f"{b} ms" for b in backends) + " | "
          + " | ".join(f"{b} kernels+ops+allocs" for b in backends) + " | ok |")
    print("|" + "---|" * (3 + 2 * len(backends) + 1))
    counts = [int(t) for t in a.threads.split(",")]
    for threads in counts if a.device == "cpu" else counts[:1]:
        torch.set_num_threads(threads)
        for opt_name in a.opts.split(","):
            for spec in a.models.split(","):
                r = bench(opt_name, spec, backends, a.steps, a.codegen, variants)
                ok = all(r[b][2] <= 0 for b in backends)
                bad = ", ".join(f"{b} {r[b][2]:.2g}" for b in backends if r[b][2] > 0)
                counted = " | ".join("+".join(map(str, r[b][1])) for b in backends)
                print(f"| {threads} | {opt_name} | {spec} | " + " | ".join(f"{r[b][0]:.3f}" for b in backends)
                      + f" | {counted} | {'yes' if ok else 'NO: ' + bad} |", flush=True)


if __name__ == "__main__":
    main()
