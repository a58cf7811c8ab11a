"""``kiln.memory_efficient_fusion``: compile a function or nn.Module without Dynamo.

Uses AOTAutograd's function/module entry points with kiln's decompositions, partitioner (min-cut
rematerialization) and code generator. Unlike ``aot_function``, which traces once and silently reuses
that graph for any later input, kiln keeps one compiled graph per input signature (shapes, strides,
dtypes, devices, requires_grad).
"""
from __future__ import annotations

import functools

import torch
import torch.utils._pytree

from kiln.codegen.target import resolve
from kiln.debug import Trace
from kiln.options import current
from kiln.pipeline import aot_compilers


def _signature(args, kwargs=None) -> tuple:
    """What a compiled graph depends on: positional and keyword arguments, tensors by layout."""
    flat, spec = torch.utils._pytree.tree_flatten((args, kwargs or {}))
    sig = [str(spec)]
    for a in flat:
        if isinstance(a, torch.Tensor):
            sig.append((tuple(a.shape), tuple(a.stride()), a.dtype, a.device, a.requires_grad))
        else:
            sig.append((type(a), a))
    return tuple(sig)


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
    """The module's parameters and buffers, each tied tensor once (read at every call, so the compiled
    module sees updates and replaced tensors)."""
    return dict(module.named_parameters()), dict(module.named_buffers())


def _functional(module: torch.nn.Module):
    """``module`` as a function of ``(parameters, buffers)`` and its inputs, tied weights kept tied
    (AOTAutograd's ``aot_module`` passes both names of a tied weight and ``functional_call`` refuses)."""
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
