"""GPU kernel time of micro cases under several settings of kiln's options (GPU).

    PYTHONPATH=. python benchmarks/kernel_probe.py --cases layer_norm,colsum768 \\
        --variant base: --variant p2048:tuning.persistent_max=2048 [--inductor]

A variant is ``name:option=value,option=value`` (empty after the colon: the defaults); the options are
those ``kiln options`` lists, code-generation constants being ``tuning.<name>``.
Each case is compiled afresh under each variant in this one process and its forward+backward is
profiled: the figure is the sum of the GPU kernels' times per step (``torch.profiler``), which does
not depend on the host's speed the way step times do, so variants compare within one call.
Besides the micro suite, GPT-2-shaped cases: ``colsum768`` (a bias gradient's column sum),
``gelu_bias`` at 8192x3072 bf16 (``gelu_bias3072``) and ``ln768`` (layer norm, 8192x768 bf16).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from kiln_bench.case import FnWorkload


def _extra(name):
    gen = torch.Generator().manual_seed(0)

    def leaf(*shape, grad=True):
        t = torch.randn(*shape, generator=gen).to("cuda", torch.bfloat16)
        return t.requires_grad_(grad)
    if name == "colsum768":
        return FnWorkload(lambda x: x.float().sum(0), [leaf(8192, 768, grad=False)], "bf16", train=False)
    if name == "gelu_bias3072":
        return FnWorkload(lambda x, b: F.gelu(x + b, approximate="tanh"), [leaf(8192, 3072), leaf(3072)], "bf16")
    if name == "ln768":
        return FnWorkload(lambda x, w, b: F.layer_norm(x, (768,), w, b), [leaf(8192, 768), leaf(768), leaf(768)],
                          "bf16")
    from kiln_bench.suites import all_cases
    for c in all_cases("all"):
        if c.name == name:
            return c.build("cuda", "fp32", "gpu")
    raise SystemExit(f"unknown case {name!r}")


def _options(spec) -> dict:
    """``option=value,...`` as option overrides (values read as the option's type)."""
    from kiln.options import parse_value
    out = {}
    for item in filter(None, spec.split(",")):
        name, value = item.split("=")
        out[name] = parse_value(name, value)
    return out


def gpu_ms(wl, backend, steps=5):
    """(kernel ms per step, [(ms, kernel name)] top 4) of ``wl`` compiled with ``backend``."""
    from torch.profiler import ProfilerActivity, profile

    from kiln_bench import backends as B
    torch._dynamo.reset()
    f = B.compile_model(backend, wl.model)
    for _ in range(3):
        wl.step(f)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            wl.step(f)
        torch.cuda.synchronize()
    per = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            d = e.device_time if hasattr(e, "device_time") else e.cuda_time
            per[e.name] = per.get(e.name, 0.0) + d
    total = sum(per.values()) / steps / 1e3
    top = sorted(((us / steps / 1e3, n[:40]) for n, us in per.items()), reverse=True)[:4]
    return total, top


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default="layer_norm,t5_rmsnorm,softmax,cross_entropy")
    p.add_argument("--variant", action="append", default=[])
    p.add_argument("--inductor", action="store_true", help="also time inductor once per case")
    p.add_argument("--verbose", action="store_true", help="print each row's top kernels")
    a = p.parse_args(argv)
    import kiln   # registers the backend; kiln.config.patch scopes each variant
    variants = a.variant or ["base:"]
    cases = a.cases.split(",")
    table = {}
    for case in cases:
        wl = _extra(case)
        if a.inductor:
            table[(case, "inductor")] = gpu_ms(wl, "inductor")
        for v in variants:
            name, spec = v.split(":", 1)
            try:
                with kiln.config.patch(**_options(spec)):
                    table[(case, name)] = gpu_ms(wl, "kiln")
            except Exception as e:   # a variant that breaks compilation is a result too
                table[(case, name)] = (float("nan"), [(0.0, f"{type(e).__name__}: {e}"[:80])])
            print(f"{case:14} {name:12} {table[(case, name)][0]:.4f} ms", flush=True)
        del wl
        torch.cuda.empty_cache()
    cols = (["inductor"] if a.inductor else []) + [v.split(":", 1)[0] for v in variants]
    print("\n| case | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for case in cases:
        print(f"| {case} | " + " | ".join(f"{table[(case, c)][0]:.4f}" for c in cols) + " |")
    if a.verbose:
        for (case, c), (_, top) in table.items():
            print(case, c, "; ".join(f"{ms:.4f} {n}" for ms, n in top))


if __name__ == "__main__":
    main()
