"""Running programs in this process: render, execute with the harness, time. The runner's children
loop over ``serve``; tests and ``--inline`` call ``run_program`` directly."""
from __future__ import annotations

import importlib
import linecache
import re
import time

from kiln_bench.fuzz.program import Program


def namespace(program: Program, name: str = "<fuzz program>") -> dict:
    """Execute ``program.source()`` and return its globals (``make_inputs``, ``program``)."""
    import torch
    import torch.nn.functional as F
    from kiln_bench.fuzz import harness
    src = program.source()
    linecache.cache[name] = (len(src), None, src.splitlines(True), name)
    ns = {"torch": torch, "F": F, "make_input": harness.make_input, "leaf": harness.leaf}
    exec(compile(src, name, "exec"), ns)
    return ns


def run_program(program: Program, target: str, name: str = "<fuzz program>", options=None) -> dict:
    """Check ``program`` on ``target`` (with kiln ``options`` besides the target); the result as a dict
    (``harness.Result.to_dict``) with its 'signature' and total 'seconds'."""
    from kiln_bench.fuzz import harness
    t = time.perf_counter()
    ns = namespace(program, name)
    res = harness.check_program(ns["make_inputs"], ns["program"], target, program.train, program.dynamic,
                                options=options, zero_sign=zero_sign(program))
    out = res.to_dict()
    out["signature"] = list(res.signature()) + (["upstream"] if res.upstream else [])
    if res.status == "pass" and res.fallbacks:   # what shrinking a fallback (``--strict``) keeps
        out["signature"] = ["fallback", fallback_kind(res.fallback_reasons)]
    out["seconds"]["total"] = time.perf_counter() - t
    return out


def fallback_kind(reasons: list) -> str:
    """The error of the first kernel that fell back to ATen (or C++ build that failed), its numbers masked:
    'InterpreterError: ...'."""
    for line in reasons:
        m = re.search(r"running its ATen nodes instead \((.*)\)$", line) or re.search(
            r"C\+\+ build failed \((.*)\); the graph runs ATen", line)
        if m:   # without folders and generated names (a C++ build's file), which change as a program shrinks
            text = re.sub(r"(/[^\s/:]+)+/", "", m.group(1))
            return re.sub(r"\d+", "#", re.sub(r"kiln_[0-9a-f]+", "kiln_#", text))[:80]
    return "?"


def zero_sign(program: Program) -> bool:
    """Whether ``program``'s zeros have signs eager defines (no ``compare.SIGN_FREE`` op in it: min/max
    and matrix products)."""
    from kiln_bench.fuzz.compare import SIGN_FREE
    return not re.search(SIGN_FREE, " ".join(op.text for op in program.ops))


def load_hook(spec: str | None):
    """``'module:function'`` -> the function (``fn(program, index) -> program``), or None."""
    if not spec:
        return None
    mod, _, fn = spec.partition(":")
    return getattr(importlib.import_module(mod), fn)
