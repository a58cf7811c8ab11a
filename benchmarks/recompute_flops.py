"""Recompute FLOPs of kiln's and Inductor's partitioners at the same activation memory budgets, offline.

Issue #5's target asks that kiln spend no more recompute FLOPs than Inductor to reach a given peak.
FLOPs do not depend on the device, so this runs on a machine without a GPU: it captures a bench case
on meta tensors (as ``kiln_bench.offline`` does, under CPU bf16 autocast), partitions the joint graph
with kiln's partitioner (kiln's whole pipeline, the backward graph recorded before post-grad passes)
and with Inductor's (``min_cut_rematerialization_partition`` with Inductor's decompositions), and
counts the matmul/attention FLOPs of each backward graph with FlopCounterMode.

    recompute FLOPs(budget) = backward FLOPs(budget) - backward FLOPs(budget 1.0), per partitioner.

It lives outside ``kiln/`` because it imports Inductor's partitioner as the baseline.
Usage: PYTHONPATH=. python benchmarks/recompute_flops.py gpt2 --budgets 1,0.5,0.1
"""
import argparse
import contextlib
import copy
import functools
import sys

import torch
import torch.utils._pytree


def _flops(gm) -> int:
    """Matmul/conv/attention FLOPs of ``gm``, from each node's shapes (``node.meta["val"]``) through
    FlopCounterMode's formulas (nothing runs)."""
    from torch.utils.flop_counter import flop_registry
    total = 0
    for n in gm.graph.nodes:
        if n.op != "call_function" or not hasattr(n.target, "overloadpacket"):
            continue
        fn = flop_registry.get(n.target.overloadpacket)
        if fn is None:
            continue
        val = lambda a: a.meta.get("val") if isinstance(a, torch.fx.Node) else a   # noqa: E731
        args = torch.utils._pytree.tree_map(val, n.args)
        kwargs = torch.utils._pytree.tree_map(val, n.kwargs)
        total += fn(*args, **kwargs, out_val=n.meta.get("val"))
    return total


def _fake_args(example_inputs):
    from torch._subclasses.fake_tensor import FakeTensorMode
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        return [torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="cpu").requires_grad_(a.requires_grad)
                if isinstance(a, torch.Tensor) else a for a in example_inputs]


def kiln_backward(gm, ins, budget):
    """kiln's backward graphs (as partitioned) for one captured graph."""
    import importlib

    from kiln_bench import offline
    kc = importlib.import_module("kiln.compile")   # ``kiln.compile`` the attribute is the function
    got, orig = [], kc.lower

    def spy(g, inputs, opts, trace, kind, target, *a, **k):
        if kind == "backward":
            got.append(g)
        return orig(g, inputs, opts, trace, kind, target, *a, **k)
    kc.lower = spy
    try:
        offline.compile_for_gpu(gm, ins, activation_memory_budget=budget)
    finally:
        kc.lower = orig
    return got


def inductor_backward(gm, ins, budget):
    """Inductor's partitioner and decompositions on the same captured graph: its backward graphs."""
    import torch._functorch.config as fconfig
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    from kiln_bench import offline
    got = []

    def fw(g, inputs):
        return g

    def bw(g, inputs):
        got.append(g)
        return g
    with fconfig.patch(activation_memory_budget=budget, force_non_lazy_backward_lowering=True):
        aot_module_simplified(offline._to_cpu(gm), _fake_args(ins), fw_compiler=fw, bw_compiler=bw,
                              partition_fn=functools.partial(min_cut_rematerialization_partition,
                                                             compiler="inductor"),
                              decompositions=select_decomp_table())
    return got


def main(argv=None):
    from kiln_bench import offline
    from kiln_bench.profile import _case
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("case")
    p.add_argument("--budgets", default="1,0.5,0.1")
    a = p.parse_args(argv)
    budgets = [float(b) for b in a.budgets.split(",")]
    case = _case(a.case)
    torch.manual_seed(0)
    with torch.device("meta"):
        wl = case.build("meta", "fp32", "gpu")
    autocast, wl.autocast = wl.autocast, None
    graphs, _ = offline.capture(wl.model, lambda f, b: (wl._loss(f) if wl.train else wl.call(f, b)), wl.inputs,
                                autocast)
    amp = torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext()
    rows = {}
    for name, fn in (("kiln", kiln_backward), ("inductor", inductor_backward)):
        for b in budgets:
            torch._dynamo.reset()
            with amp:
                bws = [g for gm, ins in graphs for g in fn(copy.deepcopy(gm), ins, b)]
            rows[(name, b)] = sum(_flops(g) for g in bws)
    base = {n: rows[(n, 1.0)] for n in ("kiln", "inductor") if (n, 1.0) in rows}
    print(f"{'budget':>6} {'kiln bw GFLOP':>14} {'recompute':>10} {'inductor bw GFLOP':>18} {'recompute':>10}")
    for b in budgets:
        k, i = rows[("kiln", b)], rows[("inductor", b)]
        print(f"{b:6.2f} {k / 1e9:14.1f} {(k - base.get('kiln', k)) / 1e9:10.1f} {i / 1e9:18.1f} "
              f"{(i - base.get('inductor', i)) / 1e9:10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
