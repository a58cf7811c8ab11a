"""kiln's memory-facing entry points, on the pipeline's AOTAutograd set-up: ``kiln.memory_efficient_fusion``
compiles without Dynamo, one graph per input signature (``aot_function`` silently reuses its first graph);
``kiln.explain_memory`` explains the partition of a training graph (``partition/report.py``).
"""
import functools
from typing import Optional, Sequence

import torch
import torch.utils._pytree

from kiln import passes
from kiln.debug import Trace, observe
from kiln.options import current, using
from kiln.partition.mincut import user_path
from kiln.partition.report import MemoryReport, report
from kiln.passes.freeze import _source, _source_text
from kiln.codegen.target import resolve
from kiln.pipeline import aot_compilers


def explain_memory(fn, *args, budgets: Optional[Sequence[float]] = None, png: Optional[str] = None,
                   **options) -> MemoryReport:
    """Report the partition of ``fn(*args)``'s first graph (Dynamo reset first) under the options plus
    ``options``; ``budgets``: sweep these too (1.0..0.0 with ``png``); ``png``: plot the sweep there."""
    opts = current(**options)
    cut = capture_partition(fn, args, opts)
    return report(cut["joint"], cut["saved"], cut["num_fwd_outputs"], opts, budgets, png, cut["inputs"])


def capture_partition(fn, args, opts) -> dict:
    """Run ``fn(*args)`` through kiln's pipeline up to the partition; returns its first cut (as ``observe``,
    plus ``inputs``: the user's name of each of AOTAutograd's flat inputs, ``layers.0.weight``)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    cuts: list = []
    names: list = [[]]

    def seen(event, data):
        if event == "partition":
            cuts.append({**data, "inputs": names[-1]})

    def as_traced(gm, example_inputs):   # no code generation: the report needs the partition only
        return make_boxed_func(gm.forward)

    def backend(gm, example_inputs):
        with using(opts):
            trace = Trace(opts, "explain_memory")
            registered = passes.snapshot()
            target = resolve(opts, example_inputs)
            trace.stage("pre_grad", passes.pre_grad, gm, opts, registered)
            # AOTAutograd's flat inputs: the module's own parameters and buffers (if any), then Dynamo's
            state = (*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False))
            names.append([k for k, _ in state] + [user_path(_source_text(_source(p)) or p.name)
                                                  for p in gm.graph.find_nodes(op="placeholder")])
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


# -- memory_efficient_fusion ----------------------------------------------------------------------------
def _signature(args, kwargs=None) -> tuple:
    """What a compiled graph depends on: positional and keyword arguments, tensors by layout."""
    flat, spec = torch.utils._pytree.tree_flatten((args, kwargs or {}))
    return (str(spec), *((tuple(a.shape), tuple(a.stride()), a.dtype, a.device, a.requires_grad)
                         if isinstance(a, torch.Tensor) else (type(a), a) for a in flat))


def memory_efficient_fusion(fn, **options):
    """Return a compiled version of ``fn`` (a function or nn.Module) that trains with less memory."""
    from torch._functorch.aot_autograd import aot_function

    opts = current(**options)
    compiled: dict = {}

    def get(args, kwargs):
        key = _signature(args, kwargs)
        if key not in compiled:
            leaves = torch.utils._pytree.tree_leaves((args, kwargs))
            target = resolve(opts, [a for a in leaves if isinstance(a, torch.Tensor)])
            kw = aot_compilers(opts, target, Trace(opts, "mef"))
            compiled[key] = aot_function(_functional(fn) if isinstance(fn, torch.nn.Module) else fn, **kw)
        return compiled[key]

    if isinstance(fn, torch.nn.Module):
        class _Compiled(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.orig_module = fn

            def forward(self, *args, **kwargs):
                state = _state(fn)
                return _run(get((state, *args), kwargs), (state, *args), kwargs)
        return _Compiled()

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return _run(get(args, kwargs), args, kwargs)
    return wrapper


def _state(module: torch.nn.Module) -> tuple:
    """The module's parameters and buffers, read at every call (the compiled module sees replaced tensors)."""
    return dict(module.named_parameters()), dict(module.named_buffers())


def _functional(module: torch.nn.Module):
    """``module`` as a function of ``(parameters, buffers)`` and its inputs, tied weights kept tied."""
    def call(state, *args, **kwargs):
        return torch.func.functional_call(module, state, args, kwargs, tie_weights=True)
    return call


def _run(compiled, args, kwargs):
    from torch._subclasses.fake_tensor import DataDependentOutputException
    try:
        return compiled(*args, **kwargs)
    except DataDependentOutputException as e:
        raise TypeError(
            f"kiln.memory_efficient_fusion: the function reads a tensor's value while tracing ({e}: an "
            f"``.item()``, a ``bool(tensor)``, a data-dependent shape). Without Dynamo there is no graph "
            f"break to run that part eagerly: use kiln.compile(fn) (or torch.compile(fn, backend='kiln')), "
            f"which splits the function there.") from e
    except AssertionError as e:
        if "FakeTensor" not in str(e):
            raise
        raise TypeError(
            "kiln.memory_efficient_fusion: the function reads a tensor that is not one of its arguments "
            "(a module's parameter captured by a closure, say), so its gradient could not flow. Pass the "
            "nn.Module itself to memory_efficient_fusion, or make the tensor an argument.") from e
