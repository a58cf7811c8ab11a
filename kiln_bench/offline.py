"""Compile a bench case for CUDA on a machine without a GPU, to read the kernels kiln would launch.

``python -m kiln_bench.offline gpt2 --dump DIR`` captures the case's Dynamo graphs on meta tensors,
moves them to fake CPU tensors and runs kiln's whole pipeline (partition, fusion, Triton emitter)
with the backward compiled eagerly. Nothing runs: the forward and backward wrappers and every kernel
land in ``DIR`` (as ``KILN_DUMP`` writes them), and a table lists each kernel with its kind, sizes
and the ATen ops it fuses, so profiles taken on the GPU machine can be read here by kernel name.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch


def capture(model, call, inputs, autocast=None):
    """[(gm, example_inputs)] of every Dynamo graph of ``call(model, inputs)`` on meta tensors."""
    graphs = []

    def grab(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    f = torch.compile(model, backend=grab)
    ctx = torch.autocast("cpu", dtype=autocast) if autocast is not None else torch.autocast("cpu", enabled=False)
    with ctx:
        out = call(f, inputs)
    return graphs, out


def _to_cpu(gm):
    def fix(a):
        if isinstance(a, torch.device) and a.type == "meta":
            return torch.device("cpu")
        return "cpu" if a == "meta" else a
    for n in gm.graph.nodes:
        n.kwargs = {k: fix(v) for k, v in n.kwargs.items()}
        n.args = tuple(fix(a) for a in n.args)
    gm.recompile()
    return gm


def compile_for_gpu(gm, example_inputs, **options):
    """Run kiln's pipeline on ``gm`` over fake CPU inputs, emitting the kernels a GPU would get
    (compiled-mode Triton, not interpreter kernels) and lowering the backward at once.

    Autograd cannot run on fake CUDA tensors without a CUDA runtime, so the graph is traced on
    the CPU, under CPU autocast: its op lists differ slightly from CUDA's (a few ops may differ).
    """
    import torch._functorch.config as fconfig
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kiln import Options
    from kiln_bench._internal import compile_graph
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        args = []
        for a in example_inputs:
            if isinstance(a, torch.Tensor):
                t = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="cpu")
                args.append(t.requires_grad_(a.requires_grad))
            else:
                args.append(a)
    from torch.fx._lazy_graph_module import _use_lazy_graph_module
    # Dynamo calls its backend with lazy GraphModules on (recompiles deferred until the code is
    # needed); do the same, so that the compile time measured here is the one torch.compile sees
    opts = Options().replace(codegen="triton", emit_for="cuda", **options)
    with fconfig.patch(force_non_lazy_backward_lowering=True), _use_lazy_graph_module(True):
        return compile_graph(_to_cpu(gm), args, opts)


def main(argv=None):
    start, cstart = time.perf_counter(), time.process_time()
    from kiln_bench.profile import _case
    p = argparse.ArgumentParser(prog="python -m kiln_bench.offline", description=__doc__.splitlines()[0])
    p.add_argument("case")
    p.add_argument("--dump", default=None, help="directory for every stage's graph, wrappers and kernels")
    p.add_argument("--sources", default=None,
                   help="directory for the generated wrappers and kernels only, written after compiling "
                        "(so that profiles of the compile do not count file writes)")
    p.add_argument("--debug", type=int, default=0, help="kiln debug level (1 prints stage times)")
    p.add_argument("--profile", default=None, help="write a cProfile of the compile (not the capture) here")
    p.add_argument("--budget", type=float, default=None)
    p.add_argument("--set", action="append", default=[], metavar="OPTION=VALUE",
                   help="a kiln option for this compile, e.g. pad_matmuls=always (pad_mm acts on CUDA only)")
    a = p.parse_args(argv)
    case = _case(a.case)
    torch.manual_seed(0)
    with torch.device("meta"):
        wl = case.build("meta", "fp32", "gpu")
    autocast = getattr(wl, "autocast", None)   # autocast for CUDA is entered by capture()
    if hasattr(wl, "_loss"):   # a model case
        wl.autocast = None
        call = lambda f, b: (wl._loss(f) if wl.train else wl.call(f, b))  # noqa: E731
    else:                      # a micro case: a function of leaf inputs
        call = lambda f, b: f(*b)  # noqa: E731
    grad = contextlib.nullcontext() if getattr(wl, "train", True) else torch.no_grad()   # inference: no backward
    with grad:
        graphs, _ = capture(wl.model, call, wl.inputs, autocast)
    opts = {"debug": a.debug}
    if a.dump:
        os.makedirs(a.dump, exist_ok=True)
        opts["dump_dir"] = a.dump
    if a.budget is not None:
        opts["activation_memory_budget"] = a.budget
    from kiln.config import parse_value
    for item in a.set:
        key, _, value = item.partition("=")
        opts[key] = parse_value(key, value)
    from kiln_bench._internal import collect_sources
    prof = None
    if a.profile:
        import cProfile
        prof = cProfile.Profile()
    t0, c0 = time.perf_counter(), time.process_time()
    with collect_sources() as sources:
        if prof:
            prof.enable()
        amp = torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext()
        with amp, grad:   # as torch.compile under CUDA autocast: AOTAutograd traces the casts too
            for gm, ins in graphs:
                compile_for_gpu(gm, ins, **opts)
        if prof:
            prof.disable()
    t1, c1 = time.perf_counter(), time.process_time()
    if prof:
        prof.dump_stats(a.profile)
    print(f"{len(graphs)} graph(s) compiled in {t1 - t0:.1f} s, cpu {c1 - c0:.1f} s (after {t0 - start:.1f} s, "
          f"cpu {c0 - cstart:.1f} s, of imports, model building and capture)"
          + (f"; wrappers and kernels under {a.dump}" if a.dump else ""))
    if a.sources:
        write_sources(a.sources, sources)


def write_sources(directory: str, sources: list) -> None:
    """Write each generated source once as ``<sha256[:12]>.py`` plus ``order.txt`` listing them in
    generation order, so that two compiles can be compared with ``diff -r``."""
    import hashlib
    os.makedirs(directory, exist_ok=True)
    order = []
    for src in sources:
        name = hashlib.sha256(src.encode()).hexdigest()[:12]
        order.append(name)
        with open(os.path.join(directory, f"{name}.py"), "w") as f:
            f.write(src)
    with open(os.path.join(directory, "order.txt"), "w") as f:
        f.write("\n".join(order) + "\n")
    print(f"{len(set(order))} distinct sources ({len(order)} in all) under {directory}")


if __name__ == "__main__":
    main()
