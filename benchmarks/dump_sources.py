"""Every wrapper and kernel source kiln writes for bench cases, without a GPU, and a comparison of two dumps.

    PYTHONPATH=. python benchmarks/dump_sources.py dump OUT triton gpt softmax ...   # CUDA kernels, fake tensors
    PYTHONPATH=. python benchmarks/dump_sources.py dump OUT cpp gpt softmax ...      # C++ units and launchers
    PYTHONPATH=. python benchmarks/dump_sources.py compare BEFORE AFTER [--names]

A case's graphs are captured on meta tensors (``kiln_bench.offline.capture``) and compiled on fake CPU tensors:
the Triton target for CUDA (``emit_for='cuda'``, GPU sizes) or the C++ target (CPU sizes; each unit is
built). ``OUT/<target>/<case>/`` holds each source as ``<sha256[:12]>.py`` with ``order.txt`` (generation
order) and the C++ units (``unit_*``). ``compare`` pairs sources by order; ``--names`` first renames buffers
(``bufN``) by order of appearance, for a change that numbers buffers differently. Run each case in a
fresh process (buffer numbers count per process).
"""
from __future__ import annotations

import contextlib
import difflib
import glob
import hashlib
import os
import re
import shutil
import sys
import tempfile

import torch


def dump(out: str, target: str, cases) -> None:
    import torch._functorch.config as fconfig
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    from kiln_bench.offline import _to_cpu, capture
    from kiln_bench.profile import _case
    from kiln.options import Options
    from kiln.pipeline import compile_graph
    from kiln.runtime.load import collect_sources
    for name in cases:
        case = _case(name)
        torch.manual_seed(0)
        with torch.device("meta"):
            wl = case.build("meta", "fp32", "gpu" if target == "triton" else "cpu")
        autocast = getattr(wl, "autocast", None)
        if hasattr(wl, "_loss"):
            wl.autocast = None
            call = lambda f, b: (wl._loss(f) if wl.train else wl.call(f, b))  # noqa: E731
        else:
            call = lambda f, b: f(*b)  # noqa: E731
        grad = contextlib.nullcontext() if getattr(wl, "train", True) else torch.no_grad()
        with grad:
            graphs, _ = capture(wl.model, call, wl.inputs, autocast)
        where = os.path.join(out, target, name)
        os.makedirs(where, exist_ok=True)
        units = tempfile.mkdtemp(prefix="kiln_dump_")   # the C++ units come through KILN_DUMP
        opts = Options().replace(codegen=target, **({"emit_for": "cuda"} if target == "triton" else
                                                    {"dump_dir": units}))
        with collect_sources() as sources:
            amp = torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext()
            with amp, grad, fconfig.patch(force_non_lazy_backward_lowering=True), _use_lazy_graph_module(True):
                for gm, ins in graphs:
                    with FakeTensorMode(allow_non_fake_inputs=True):
                        args = [torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="cpu")
                                .requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in ins]
                    compile_graph(_to_cpu(gm), args, opts)
        order = []
        for src in sources:
            order.append(hashlib.sha256(src.encode()).hexdigest()[:12])
            with open(os.path.join(where, f"{order[-1]}.py"), "w") as f:
                f.write(src)
        for p in sorted(glob.glob(os.path.join(units, "**", "*kernels_*.cpp"), recursive=True)):
            shutil.copy(p, os.path.join(where, "unit_" + os.path.relpath(p, units).replace(os.sep, "__")))
        shutil.rmtree(units)
        with open(os.path.join(where, "order.txt"), "w") as f:
            f.write("\n".join(order) + "\n")
        print(f"{target}/{name}: {len(graphs)} graph(s), {len(set(order))} sources", flush=True)


def _renamed(text: str) -> str:
    seen: dict = {}
    return re.sub(r"buf\d+\b", lambda m: seen.setdefault(m.group(0), f"BUF{len(seen)}"), text)


def compare(before: str, after: str, names: bool = False) -> int:
    """Print each case as 'same' or with its first differences; returns the number of differing cases."""
    bad = 0
    for target in sorted(os.listdir(before)):
        for case in sorted(os.listdir(os.path.join(before, target))):
            b, a = os.path.join(before, target, case), os.path.join(after, target, case)
            if not os.path.exists(os.path.join(a, "order.txt")):
                print(f"{target}/{case}: missing after")
                bad += 1
                continue
            ob, oa = (open(os.path.join(d, "order.txt")).read().split() for d in (b, a))
            pairs = [(os.path.join(b, x + ".py"), os.path.join(a, y + ".py")) for x, y in zip(ob, oa)]
            pairs += list(zip(sorted(glob.glob(os.path.join(b, "unit_*"))), sorted(glob.glob(os.path.join(a, "unit_*")))))
            text = (lambda p: _renamed(open(p).read())) if names else (lambda p: open(p).read())  # noqa: E731
            differ = [(x, y) for x, y in pairs if text(x) != text(y)]
            if len(ob) != len(oa):
                differ.append(("(count)", f"{len(ob)} sources before, {len(oa)} after"))
            print(f"{target}/{case}: {'same' if not differ else f'{len(differ)} differ'} ({len(ob)} sources)")
            for x, y in differ[:2]:
                if x != "(count)":
                    print("\n".join(list(difflib.unified_diff(open(x).read().splitlines(), open(y).read().splitlines(),
                                                              x, y, lineterm="", n=1))[:30]))
            bad += bool(differ)
    return bad


if __name__ == "__main__":
    if sys.argv[1] == "dump":
        dump(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        sys.exit(1 if compare(sys.argv[2], sys.argv[3], "--names" in sys.argv) else 0)
