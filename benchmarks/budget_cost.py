"""The price of a memory budget (issue #36 item 5): step time against saved bytes, kiln and Inductor.

A ``TransformerEncoderLayer(256, 4, 1024)`` (batch first, dropout 0.1) trains on 8 x 128 tokens (MSE, SGD) on
one CPU thread, compiled by kiln and by Inductor at each budget (Inductor reads
``torch._functorch.config.activation_memory_budget`` while it compiles, as ``kiln_bench.backends.scope``).
Printed per row: step times (min, 20th percentile and median of steps run one per row in turn, so a burst of
another process slows every row of a cycle alike), the ratio to kiln at the first budget within each cycle,
and the bytes saved for the backward (``kiln_bench.measure.saved_bytes``: distinct storages, inputs and
parameters excluded). Inductor rows compile with their own backend callable (see ``compiled``).

``--analyze`` times nothing: at each budget it cuts kiln's joint graph with kiln's partitioner and runs
Inductor's own decompositions and partitioner on the layer (no code generation; ``-v``: also Inductor's
partitioner on kiln's joint graph), and prints each backward's saved bytes and the forward ops it recomputes,
by kind. It lives outside ``kiln/`` because it imports Inductor's partitioner as the baseline.

Usage: PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/budget_cost.py [--analyze] [--budgets 1,0.5,0.2,0]
       [--backends kiln,inductor] [--cycles 60] [--small]
"""
import argparse
import collections
import contextlib
import copy
import statistics
import time

import torch
import torch.nn as nn


_null = contextlib.nullcontext


def workload(small=False):
    torch.manual_seed(0)
    d, heads, ffn, (b, t) = (128, 4, 512, (8, 64)) if small else (256, 4, 1024, (8, 128))
    layer = nn.TransformerEncoderLayer(d, heads, ffn, dropout=0.1, batch_first=True)
    return layer, torch.randn(b, t, d), torch.randn(b, t, d)


def compiled(backend, budget, layer):
    """(module copy, compiled module, scope to compile and run in). Each Inductor row gets its own backend
    callable: Dynamo would otherwise reuse the first row's graph (same backend, guards that do not tell the
    module copies apart), whatever the budget."""
    import torch._functorch.config as fconfig
    model = copy.deepcopy(layer)
    if backend == "kiln":
        return model, torch.compile(model, backend="kiln", options={"activation_memory_budget": budget}), _null
    from torch._inductor.compile_fx import compile_fx

    def inductor(gm, example_inputs):
        return compile_fx(gm, example_inputs)
    return model, torch.compile(model, backend=inductor), lambda: fconfig.patch(activation_memory_budget=budget)


def make_step(model, fn, x, y, scope):
    """One training step, run inside ``scope`` (a recompile sees the row's budget)."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        with scope():
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(fn(x), y).backward()
            opt.step()
    return step


def saved(model, fn, x, y):
    from kiln_bench.measure import saved_bytes
    inputs = [x, *model.parameters()]
    return saved_bytes(lambda: fn(x), lambda out: nn.functional.mse_loss(out, y).backward(), inputs)["saved_bytes"]


def time_all(rows, cycles):
    """``cycles`` cycles of one step per row, rows interleaved step by step: per row its step times (ms). On a
    shared machine another process's burst then slows every row of a cycle alike."""
    per = collections.defaultdict(list)
    for _ in range(cycles):
        for key, step in rows.items():
            t0 = time.perf_counter()
            step()
            per[key].append((time.perf_counter() - t0) * 1e3)
    return per


def _q(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_timing(args):
    torch.set_num_threads(1)
    torch._dynamo.config.cache_size_limit = 64
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 64
    layer, x, y = workload(args.small)
    rows, mib = {}, {}
    for backend in args.backends.split(","):
        for b in args.budgets:
            model, fn, scope = compiled(backend, b, layer)
            t0 = time.perf_counter()
            step = make_step(model, fn, x, y, scope)
            step()
            with scope():
                mib[(backend, b)] = saved(model, fn, x, y) / 2 ** 20
            for _ in range(3):
                step()
            print(f"compiled {backend} budget {b} in {time.perf_counter() - t0:.0f} s", flush=True)
            rows[(backend, b)] = step
    per = time_all(rows, args.cycles)
    base = per.get(("kiln", args.budgets[0]))
    print(f"\n{args.cycles} cycles of one step per row, interleaved. ms: min, 20th percentile and median of the "
          f"row's steps; ratio: to kiln at budget {args.budgets[0]} in the same cycle, median (IQR)")
    print("| backend | budget | min ms | p20 ms | median ms | ratio | ratio IQR | saved MiB |\n|---|---|---|---|---|---|---|---|")
    for (backend, b), ms in per.items():
        r = [m / k for m, k in zip(ms, base)] if base else [float("nan")]
        print(f"| {backend} | {b} | {min(ms):.1f} | {_q(ms, 0.2):.1f} | {statistics.median(ms):.1f} | "
              f"{statistics.median(r):.3f} | {_q(r, 0.25):.3f}-{_q(r, 0.75):.3f} | {mib[(backend, b)]:.2f} |")


# -- --analyze: the two partitioners on one joint graph ---------------------------------------------------
def _kind(n):
    return str(getattr(n.target, "__name__", n.target)).split(".")[0]


def backward_facts(bw):
    """(saved activation bytes, recomputed op kinds) of a backward graph: its non-tangent placeholders that are
    no primals, and its call nodes that read no tangent (views and getitems left out)."""
    from kiln.partition.estimate import size_bytes
    from kiln.partition.extract import is_tangent
    tang, kinds, act, names = set(), collections.Counter(), 0, []
    for n in bw.graph.nodes:
        if n.op == "placeholder":
            if is_tangent(n):
                tang.add(n)
            elif not n.name.startswith("primals"):
                act += size_bytes(n)
        elif any(a in tang for a in n.all_input_nodes):
            tang.add(n)
        elif n.op == "call_function" and not getattr(n.target, "is_view", False) and "getitem" not in n.name:
            kinds[_kind(n)] += 1
            names.append(n.name)
    return act, kinds, names


def inductor_pipeline(layer, x, budget):
    """Inductor's own decompositions and partitioner on Dynamo's graph of ``layer(x)`` (no code generation):
    its backward graph."""
    import functools
    import torch._functorch.config as fconfig
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table
    got = []

    def bw(g, ins):
        got.append(g)
        return make_boxed_func(g.forward)
    backend = aot_autograd(fw_compiler=lambda g, ins: make_boxed_func(g.forward), bw_compiler=bw,
                           partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"),
                           decompositions=select_decomp_table())
    torch._dynamo.reset()
    with fconfig.patch(activation_memory_budget=budget):
        torch.compile(layer, backend=backend)(x).sum().backward()
    return got[0]


def run_analysis(args):
    import kiln
    from kiln.memory import capture_partition
    from kiln.partition.extract import extract
    from kiln.partition.limit import choose_saved
    from kiln.partition.peak import model_peak
    torch.set_num_threads(1)
    layer, x, y = workload(args.small)
    opts = kiln.Options()
    cut = capture_partition(layer, (x,), opts)
    joint, n_out = cut["joint"], cut["num_fwd_outputs"]
    for b in args.budgets:
        k = choose_saved(joint, num_fwd_outputs=n_out, opts=opts.replace(activation_memory_budget=b))
        _, kbw = extract(joint, k, num_fwd_outputs=n_out)
        q = model_peak(joint, k, n_out)
        print(f"budget {b} kiln: modelled peak {q.peak / 2 ** 20:.2f} MiB, recompute {q.recompute_flops / 1e6:.0f} "
              f"MFLOP{'' if getattr(k, 'hold', None) is None else f', the backward rebuilds {len(k.hold)} values first'}")
        rows = [("kiln", kbw), ("inductor", inductor_pipeline(layer, x, b))]
        if args.verbose:
            rows.append(("ind@kiln", _inductor_on(joint, n_out, b)))
        for who, bw in rows:
            act, kinds, names = backward_facts(bw)
            print(f"budget {b} {who:8s}: saves {act / 2 ** 20:.2f} MiB; recomputes {sum(kinds.values())} ops: "
                  f"{dict(sorted(kinds.items()))}")
            if args.verbose or who == "kiln":
                print("   recomputed:", names)
            if args.verbose:
                print("   saved:", [f"{n.name}" for n in bw.graph.nodes if n.op == "placeholder"
                                    and "tangent" not in n.name and not n.name.startswith("primals")])


def _inductor_on(joint, n_out, budget):
    """Inductor's partitioner on kiln's joint graph: its backward graph."""
    import torch._functorch.config as fconfig
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    gm = copy.deepcopy(joint)
    ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
    with fconfig.patch(activation_memory_budget=budget):
        fw, bw = min_cut_rematerialization_partition(gm, [p.meta.get("val") for p in ph], num_fwd_outputs=n_out)
    return bw


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--analyze", action="store_true")
    p.add_argument("--budgets", default="1,0.5,0.2,0")
    p.add_argument("--backends", default="kiln,inductor")
    p.add_argument("--cycles", type=int, default=60)
    p.add_argument("--small", action="store_true", help="the bench's size: d 128, FFN 512, 8 x 64")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args()
    args.budgets = [float(b) for b in args.budgets.split(",")]
    (run_analysis if args.analyze else run_timing)(args)


if __name__ == "__main__":
    main()
