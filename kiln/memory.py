"""``kiln.explain_memory(fn, *args)``: the partition kiln makes of ``fn``'s training graph, explained.

The joint graph is the one kiln compiles: Dynamo's graph goes through kiln's pre-grad passes, AOTAutograd
traces it with kiln's decompositions for the target its inputs resolve to, and the joint passes and the
partition run as in a compile, through the pipeline's own AOTAutograd set-up (``pipeline.aot_compilers``,
as ``kiln.memory_efficient_fusion`` uses it). Only code generation is left out: the forward and backward
graphs run as traced. ``partition/report.py`` then explains the saved set the pipeline chose (bytes,
reason, source line), what the backward recomputes, the modelled peak and a sweep of budgets.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from kiln import passes
from kiln.debug import Trace, observe
from kiln.options import current, using
from kiln.partition.report import MemoryReport, report
from kiln.pipeline import aot_compilers, resolve_target


def explain_memory(fn, *args, budgets: Optional[Sequence[float]] = None, png: Optional[str] = None,
                   **options) -> MemoryReport:
    """Report the partition kiln makes of ``fn(*args)`` under the kiln options in force plus ``options``
    (for the first graph, when Dynamo splits ``fn`` into several). Dynamo is reset first (as by
    ``kiln.explain``): functions compiled earlier compile again at their next call.

    ``budgets``: also sweep these activation_memory_budget values (default 1.0..0.0 by 0.1 when ``png``
    is given). ``png``: write the budget -> (peak bytes, recompute FLOPs) plot there (matplotlib, Agg).
    """
    opts = current(**options)
    cut = capture_partition(fn, args, opts)
    return report(cut["joint"], cut["saved"], cut["num_fwd_outputs"], opts, budgets=budgets, png=png)


def capture_partition(fn, args, opts) -> dict:
    """Run ``fn(*args)`` once through kiln's pipeline up to the partition (see the module docstring) and
    return the first cut it made: ``{joint, saved, num_fwd_outputs}``, as ``kiln.debug.observe`` reports it."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    cuts: list = []

    def seen(event, data):
        if event == "partition":
            cuts.append(data)

    def as_traced(gm, example_inputs):   # no code generation: the report needs the partition only
        return make_boxed_func(gm.forward)

    def backend(gm, example_inputs):
        with using(opts):
            trace = Trace(opts, "explain_memory")
            registered = passes.snapshot()
            target = resolve_target(opts, example_inputs)
            trace.stage("pre_grad", passes.pre_grad, gm, opts, registered)
            # no precompile workers: no kernel is compiled (compile_workers changes no graph)
            kw = aot_compilers(opts.replace(compile_workers=0), target, trace, registered=registered)
            kw.update({k: as_traced for k in ("fw_compiler", "bw_compiler", "inference_compiler") if k in kw})
            return aot_autograd(**kw)(gm, example_inputs)

    torch._dynamo.reset()   # as kiln.explain: each call traces afresh (not stopped by Dynamo's recompile limit)
    with torch.enable_grad(), observe(seen):
        torch.compile(fn, backend=backend, fullgraph=False)(*args)
    if not cuts:
        raise ValueError("explain_memory: no joint graph was traced; does any input or parameter require grad?")
    return cuts[0]
