"""Shared checks: run a model eagerly and through kiln, compare values and gradients."""
import copy

import torch


def clone_inputs(inputs):
    return [x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
            for x in inputs]


def assert_same(a, b, rtol=1e-4, atol=1e-5):
    if isinstance(a, torch.Tensor):
        torch.testing.assert_close(b, a, rtol=rtol, atol=atol)
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y, rtol, atol)
    else:
        assert a == b


def check_train(model, inputs, rtol=1e-4, atol=1e-5, **options):
    """Forward + backward through eager and kiln; outputs, input grads and param grads must match."""
    import kiln
    ref_model = model
    kiln_model = copy.deepcopy(model)
    ref_in, kiln_in = clone_inputs(inputs), clone_inputs(inputs)
    ref = ref_model(*ref_in)
    out = kiln.compile(kiln_model, **options)(*kiln_in)
    assert_same(ref, out, rtol, atol)
    loss_ref = sum(r.float().sum() for r in _flat(ref) if r.requires_grad)
    loss_out = sum(r.float().sum() for r in _flat(out) if r.requires_grad)
    loss_ref.backward()
    loss_out.backward()
    for a, b in zip(ref_in, kiln_in):
        if isinstance(a, torch.Tensor) and a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, rtol=rtol, atol=atol)
    for (n, p), (_, q) in zip(ref_model.named_parameters(), kiln_model.named_parameters()):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=rtol, atol=atol, msg=f"grad of {n}")
    for (n, p), (_, q) in zip(ref_model.named_buffers(), kiln_model.named_buffers()):
        torch.testing.assert_close(q, p, rtol=rtol, atol=atol, msg=f"buffer {n}")
    return out


def _flat(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for y in x for t in _flat(y)]
    return []
