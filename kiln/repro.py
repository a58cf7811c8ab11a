"""Standalone repros under KILN_DUMP, and ``kiln.resume`` to feed a dump back in: ``graph.pt``, ``inputs.pt``
and ``repro.py``, which runs the region eagerly and through kiln and exits non-zero on a mismatch, or when
the original compile failed (``error.txt``) and this run did not. What cannot be written to a file
(callable options, registered passes) is named in it and in a warning it prints.
"""
import ast
import builtins
import inspect
import os

import torch
import torch.fx as fx

from kiln.debug import log
from kiln.options import FIELDS, flat_options

REPRO = '''\
"""kiln repro for {name}: runs the captured graph eagerly and through kiln, then compares."""
import os, sys
import torch
import kiln

here = os.path.dirname(os.path.abspath(__file__))
options = {options!r}
{omitted_comment}OMITTED = {omitted!r}


def main():
    if OMITTED:
        print("kiln repro: warning: this repro omits what the original compile used and cannot be saved: "
              + "; ".join(f"{{k}} = {{v}}" for k, v in OMITTED.items()), file=sys.stderr)
    gm, inputs = kiln.resume(here, compile=False)
    grad = any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)
    ref_in = [t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
              for t in inputs]
    with torch.enable_grad() if grad else torch.no_grad():
        torch.manual_seed(0)
        ref = gm(*ref_in)
        torch.manual_seed(0)
        out = kiln.compile(gm, **options)(*inputs)
    ok = True
    for r, o in zip(ref, out):
        if isinstance(r, torch.Tensor) and not torch.allclose(r, o, rtol=1e-4, atol=1e-5, equal_nan=True):
            ok = False
            print("output mismatch: max abs diff", (r - o).abs().max().item())
    tensors = [(r, o) for r, o in zip(ref, out) if grad and isinstance(r, torch.Tensor) and r.requires_grad]
    if tensors:
        sum(r.float().sum() for r, _ in tensors).backward()
        sum(o.float().sum() for _, o in tensors).backward()
        for a, b in zip(ref_in, inputs):
            if (isinstance(a, torch.Tensor) and a.grad is not None
                    and not torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-5)):
                ok = False
                print("gradient mismatch: max abs diff", (a.grad - b.grad).abs().max().item())
    if ok and os.path.exists(os.path.join(here, "error.txt")):
        print("repro NOT REPRODUCED: the original compile failed (error.txt) but this run did not"
              + (" (the omitted entries above may be why)" if OMITTED else ""))
        return 2
    print("repro", "OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
'''


def _concrete(x):
    if isinstance(x, torch.Tensor):
        y = x.detach().clone()
        return y.requires_grad_(x.requires_grad) if y.is_floating_point() or y.is_complex() else y
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        from kiln.compat import size_hint
        return size_hint(x)
    return x


def write_repro(trace, gm: fx.GraphModule, example_inputs, opts, registered=()) -> None:
    """Write graph.pt, inputs.pt and repro.py into the trace's dump folder (best effort, logged)."""
    if trace.dir is None:
        return
    try:
        torch.save(gm, os.path.join(trace.dir, "graph.pt"))
        torch.save([_concrete(x) for x in example_inputs], os.path.join(trace.dir, "inputs.pt"))
    except Exception as e:  # a graph holding unpicklable objects still gets its stage dumps
        log(1, f"repro: could not save graph {trace.id}: {type(e).__name__}: {e}")
        return
    keep, omitted = _plain_options(opts)
    keep["on_error"] = "raise"   # a compile that fails raises in the repro, not falls back
    for h in registered:
        omitted[f"kiln.passes.register({h.stage!r}, {h.name})"] = _describe(h.fn)
    if omitted:
        log(1, f"repro: {trace.name}'s repro.py omits {', '.join(omitted)} (cannot be saved)")
    comment = "".join(f"#   {k} = {v}\n" for k, v in omitted.items())
    if comment:
        comment = "# Left out of this repro (they cannot be written to a file): pass them to kiln.compile yourself.\n" + comment
    with open(os.path.join(trace.dir, "repro.py"), "w") as f:
        f.write(REPRO.format(name=trace.name, options=keep, omitted=omitted, omitted_comment=comment))


def _plain_options(opts) -> tuple:
    """``(kept, omitted)``: non-default options that can be written as literals, and those that cannot, described."""
    kept, omitted = {}, {}
    for name, value in flat_options(opts).items():
        if name in ("dump_dir", "debug") or value == FIELDS[name].default:
            continue
        if _literal(value):
            kept[name] = value
        else:
            omitted[name] = _describe(value)
    return kept, omitted


def _literal(value) -> bool:
    """Whether ``repr(value)`` reads back as an equal value (what repro.py can hold)."""
    if callable(value):
        return False
    try:
        return ast.literal_eval(repr(value)) == value
    except Exception:
        return False


def _describe(value) -> str:
    """A callable as ``module.qualname (file:line)``; anything else by its (shortened) repr."""
    if not callable(value):
        return repr(value)[:200]
    target = value if inspect.isfunction(value) or inspect.ismethod(value) else type(value)
    name = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}"
    try:
        return f"{name} ({inspect.getsourcefile(target)}:{inspect.getsourcelines(target)[1]})"
    except (OSError, TypeError):
        return name


def resume(path: str, compile: bool = True, **options):
    """Load a dump back in: for a dump folder ``(module, inputs)``, the module kiln-compiled unless
    ``compile=False``; for one stage file (``NN_stage.py``) an instance of the GraphModule it defines."""
    if os.path.isdir(path):
        gm = torch.load(os.path.join(path, "graph.pt"), weights_only=False)
        inputs = torch.load(os.path.join(path, "inputs.pt"), weights_only=False)
        if compile:
            gm = torch.compile(gm, backend="kiln", options=options or None)
        return gm, inputs
    namespace = {"torch": torch, "device": torch.device, "inf": float("inf"), "nan": float("nan")}
    with open(path) as f:
        src = f.read()
    exec(builtins.compile(src, path, "exec"), namespace)
    return namespace["GraphModule"]()
