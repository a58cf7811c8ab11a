"""``kiln.memory_efficient_fusion``: compile a function or nn.Module without Dynamo.

Uses AOTAutograd's function/module entry points with kiln's decompositions, partitioner (min-cut
rematerialization) and code generator. Unlike ``aot_function``, which traces once and silently reuses
that graph for any later input, kiln keeps one compiled graph per input signature (shapes, strides,
dtypes, devices, requires_grad).
"""
from __future__ import annotations

import functools

import torch

from kiln.debug import Trace
from kiln.options import current, using


def _signature(args) -> tuple:
    sig = []
    for a in args:
        if isinstance(a, torch.Tensor):
            sig.append((tuple(a.shape), tuple(a.stride()), a.dtype, a.device, a.requires_grad))
        else:
            sig.append((type(a), a))
    return tuple(sig)


def _devices_target(opts, args) -> str:
    from kiln.compile import resolve_target
    return resolve_target(opts, [a for a in args if isinstance(a, torch.Tensor)])


def _aot_kwargs(opts, target, trace):
    from kiln import partition, passes
    from kiln.capture.decomp import decomposition_table
    from kiln.compile import lower

    def partition_fn(joint, joint_inputs, *, num_fwd_outputs, **kw):
        with using(opts):
            return _partition(joint, joint_inputs, num_fwd_outputs, **kw)

    def _partition(joint, joint_inputs, num_fwd_outputs, **kw):
        trace.stage("joint", passes.joint, joint, opts)
        return trace.stage("partition", partition.partition_joint, joint, joint_inputs,
                           num_fwd_outputs=num_fwd_outputs, opts=opts, **kw)

    def inference_compiler(g, inputs):
        trace.stage("joint", passes.joint, g, opts)
        return lower(g, inputs, opts, trace, "inference", target)

    return dict(
        fw_compiler=lambda g, inputs: lower(g, inputs, opts, trace, "forward", target),
        bw_compiler=lambda g, inputs: lower(g, inputs, opts, trace, "backward", target),
        inference_compiler=inference_compiler,
        partition_fn=partition_fn,
        decompositions=decomposition_table(target),
    )


def memory_efficient_fusion(fn, **options):
    """Return a compiled version of ``fn`` (a function or nn.Module) that trains with less memory."""
    from torch._functorch.aot_autograd import aot_function, aot_module

    opts = current(**options)
    compiled: dict = {}

    def get(args):
        key = _signature(args)
        if key not in compiled:
            target = _devices_target(opts, args)
            trace = Trace(opts, "mef")
            kw = _aot_kwargs(opts, target, trace)
            if isinstance(fn, torch.nn.Module):
                compiled[key] = aot_module(fn, **kw)
            else:
                compiled[key] = aot_function(fn, **kw)
        return compiled[key]

    if isinstance(fn, torch.nn.Module):
        class _Compiled(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.orig_module = fn

            def forward(self, *args):
                return get(args)(*args)
        return _Compiled()

    @functools.wraps(fn)
    def wrapper(*args):
        return get(args)(*args)
    return wrapper
