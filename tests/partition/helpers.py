"""Shared helpers for partition tests: compile with aot_function + kiln's partition_joint."""
from __future__ import annotations

import torch
from torch._functorch.aot_autograd import aot_function, make_boxed_func

from kiln.options import current
from kiln.partition import partition_joint


class Capture:
    """fw/bw compilers that record the graphs they get and run them eagerly."""

    def __init__(self):
        self.fw = None
        self.bw = None
        self.bw_inputs = None

    def fw_compiler(self, gm, inputs):
        self.fw = gm
        return make_boxed_func(gm.forward)

    def bw_compiler(self, gm, inputs):
        self.bw = gm
        self.bw_inputs = inputs
        return make_boxed_func(gm.forward)


def aot(fn, *, dynamic=False, cap=None, decompositions=None, **opts):
    """``fn`` compiled by AOTAutograd with kiln's partitioner under ``opts``; returns (compiled, capture)."""
    cap = cap or Capture()
    o = current(**opts)

    def part(joint, joint_inputs, **kw):
        return partition_joint(joint, joint_inputs, opts=o, **kw)

    return aot_function(fn, fw_compiler=cap.fw_compiler, bw_compiler=cap.bw_compiler,
                        partition_fn=part, dynamic=dynamic, decompositions=decompositions), cap


def leaves(*tensors):
    return [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]


def check_grads(fn, args, *, dynamic=False, atol=1e-5, rtol=1e-4, decompositions=None, **opts):
    """Compile ``fn``, run forward+backward, compare outputs and grads with eager. Returns the capture."""
    compiled, cap = aot(fn, dynamic=dynamic, decompositions=decompositions, **opts)
    ea, ca = leaves(*args), leaves(*args)
    torch.manual_seed(0)
    eo = fn(*ea)
    torch.manual_seed(0)
    co = compiled(*ca)
    eo = eo if isinstance(eo, (tuple, list)) else (eo,)
    co = co if isinstance(co, (tuple, list)) else (co,)
    for e, c in zip(eo, co):
        torch.testing.assert_close(c, e, atol=atol, rtol=rtol)
    loss_e = sum((o.float() * (i + 1)).sum() for i, o in enumerate(eo) if o.requires_grad)
    loss_c = sum((o.float() * (i + 1)).sum() for i, o in enumerate(co) if o.requires_grad)
    loss_e.backward()
    loss_c.backward()
    for e, c in zip(ea, ca):
        if e.requires_grad:
            torch.testing.assert_close(c.grad, e.grad, atol=atol, rtol=rtol)
    return cap
