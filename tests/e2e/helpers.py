"""Shared checks: run a model eagerly and through kiln, compare values and gradients."""
import copy

import torch

from tests.numerics import assert_close_to_fp64


def clone_inputs(inputs, dtype=None):
    """Fresh leaves of ``inputs`` (their requires_grad kept); with ``dtype``, floating ones converted."""
    def one(x):
        if not isinstance(x, torch.Tensor):
            return x
        y = x.detach().to(dtype) if dtype is not None and x.is_floating_point() else x.detach().clone()
        return y.requires_grad_(x.requires_grad)
    return [one(x) for x in inputs]


def assert_same(a, b, rtol=1e-4, atol=1e-5, exact=None):
    """kiln's ``b`` against eager's ``a``: with ``exact`` (the float64 run of the same model and inputs), float32
    values within the tolerance of ``exact`` widened by eager's own error (``assert_close_to_fp64``: which
    order a matmul, a convolution or a reduction sums in is the host's: its BLAS, its vector width, its
    thread count), else within the tolerance of ``a``."""
    if isinstance(a, torch.Tensor):
        assert_close_to_fp64(b, a, exact, atol, rtol)
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, rtol, atol, exact[i] if exact is not None else None)
    else:
        assert a == b


def check_train(model, inputs, rtol=1e-4, atol=1e-5, **options):
    """Forward + backward through eager and kiln; outputs, input grads, param grads and buffers must match
    (float32 ones against a float64 copy of the model, ``assert_same``). The model must draw no random
    numbers (the float64 copy would draw others)."""
    import kiln
    ref_model = model
    kiln_model = copy.deepcopy(model)
    exact_model = copy.deepcopy(model).double()
    ref_in, kiln_in, exact_in = clone_inputs(inputs), clone_inputs(inputs), clone_inputs(inputs, torch.float64)
    ref = ref_model(*ref_in)
    exact = exact_model(*exact_in)
    out = kiln.compile(kiln_model, **options)(*kiln_in)
    assert_same(ref, out, rtol, atol, exact)
    for outs, dtype in ((ref, torch.float32), (exact, torch.float64), (out, torch.float32)):
        sum(r.to(dtype).sum() for r in _flat(outs) if r.requires_grad).backward()
    for a, b, e in zip(ref_in, kiln_in, exact_in):
        if isinstance(a, torch.Tensor) and a.grad is not None:
            assert_close_to_fp64(b.grad, a.grad, e.grad, atol, rtol, msg="grad of an input")
    models = zip(ref_model.named_parameters(), kiln_model.parameters(), exact_model.parameters())
    for (n, p), q, e in models:
        if p.grad is not None:
            assert_close_to_fp64(q.grad, p.grad, e.grad, atol, rtol, msg=f"grad of {n}")
    for (n, p), q, e in zip(ref_model.named_buffers(), kiln_model.buffers(), exact_model.buffers()):
        assert_close_to_fp64(q, p, e, atol, rtol, msg=f"buffer {n}")
    return out


def _flat(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for y in x for t in _flat(y)]
    return []
