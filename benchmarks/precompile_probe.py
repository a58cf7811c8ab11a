"""GPU probe: do the runtime's first launches hit what the precompile workers compiled?

Compiles GPT-2 (bench case, bf16 autocast) with kiln under empty caches, records every Triton
compilation in this process (cache hit or not, with the specialization of each), then re-runs
the worker's warm-up in-process for kernels that missed, to show which side's key differs.
Usage (device tool): PYTHONPATH=. python3 benchmarks/precompile_probe.py [--case gpt2] > $OUT/probe.log
"""
import argparse
import collections
import os
import sys
import tempfile
import time

root = tempfile.mkdtemp(prefix="kiln-probe-")
os.environ["TRITON_CACHE_DIR"] = os.path.join(root, "triton")
os.environ["KILN_KERNEL_DIR"] = os.path.join(root, "kernels")

import torch  # noqa: E402
import triton  # noqa: E402

import kiln  # noqa: E402,F401
from kiln_bench.suites import models as suite  # noqa: E402
from kiln.codegen import precompile  # noqa: E402
from kiln.debug import counters  # noqa: E402

RECS = []


def listener(src=None, metadata=None, metadata_group=None, times=None, cache_hit=False, **kw):
    fn = getattr(src, "fn", None)
    RECS.append(dict(name=getattr(fn, "__name__", str(src)), hit=cache_hit,
                     s=(times.total / 1e6 if times is not None else 0.0),
                     attrs=str(getattr(src, "attrs", None)), sig=str(getattr(src, "signature", None)),
                     consts=str(getattr(src, "constants", None)),
                     opts={k: metadata.get(k) for k in ("num_warps", "num_stages", "arch", "enable_fp_fusion",
                                                         "maxnreg", "num_ctas", "hash")}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="gpt2")
    ap.add_argument("--workers", type=int, default=-1)
    ap.add_argument("--inductor-first", action="store_true",
                    help="compile a small function with Inductor first, as the bench's earlier rows do")
    a = ap.parse_args()
    if a.inductor_first:
        x = torch.randn(64, device="cuda", requires_grad=True)
        torch.compile(lambda t: torch.sigmoid(t) * t + 1.0)(x).sum().backward()
        torch._dynamo.reset()
        target = precompile._current_target()
        print("parent after Inductor:", {k: (str(v)[-70:] if v else v) for k, v in
                                         {**precompile.key_state(target),
                                          "TRITON_PTXAS_PATH": os.environ.get("TRITON_PTXAS_PATH")}.items()})
        from kiln.options import Options
        precompile.start(Options())
        view = precompile._POOL[0].submit(precompile.worker_view, target).result()
        print("a worker's own view:  ", {k: (str(v)[-70:] if v else v) for k, v in view.items()})
    triton.knobs.compilation.listener = listener
    tasks = []
    orig = precompile.tasks

    def spy(gm):
        t = orig(gm)
        tasks.extend(t)
        return t
    precompile.tasks = spy
    build = {"gpt2": suite._gpt2}[a.case]
    wl = build("cuda", "amp_bf16", "gpu")
    t0 = time.perf_counter()
    f = torch.compile(wl.model, backend="kiln", options={"compile_workers": a.workers})
    wl.check(f)
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    hits = [r for r in RECS if r["hit"]]
    miss = [r for r in RECS if not r["hit"]]
    print(f"first call {total:.1f} s; Triton in this process: {len(miss)} compiled "
          f"({sum(r['s'] for r in miss):.1f} s), {len(hits)} cache hits; {len(tasks)} tasks warmed")
    print("kiln stages (s):", {k: round(v / 1e3, 2) for k, v in counters["stage_ms"].items() if v > 100})
    by = collections.Counter(r["name"] for r in miss)
    print("missed kernels:", len(by), dict(list(by.items())[:10]))
    names = {t[2]: t for t in tasks}
    shown = 0
    for r in miss:
        t = names.get(r["name"])
        if t is None or shown >= 3:
            continue
        shown += 1
        print("\n== runtime miss:", r["name"], "\n  attrs", r["attrs"], "\n  sig", r["sig"], "\n  consts",
              r["consts"], "\n  opts", r["opts"])
        n0 = len(RECS)
        ok = precompile._warm(t, {}, None)
        for w in RECS[n0:]:
            print("  in-process warm-up (real driver):", "hit" if w["hit"] else "MISS", "\n  attrs", w["attrs"],
                  "\n  sig", w["sig"], "\n  consts", w["consts"], "\n  opts", w["opts"])
        print("  task args", t[3], t[4], "warps", t[5], "->", ok)
    not_warmed = [r["name"] for r in miss if r["name"] not in names]
    print("\nmissed and never handed to workers:", len(not_warmed), not_warmed[:12])
    sys.stdout.flush()


if __name__ == "__main__":
    main()
