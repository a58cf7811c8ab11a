"""FlexAttention's backward kernels (Triton's interpreter) against the fp64 dense reference's autograd:
dq, dk, dv and the gradient of a captured bias table, with a loss on both the output and the
log-sum-exp (so the lse's own gradient flows). The op is called directly: torch's public function refuses
FlexAttention's backward on CPU tensors."""
from __future__ import annotations

import pytest
import torch

from tests.flex.util import Count, block_mask, cases, close, compiled_hop, dense, inputs, kiln, params_of, tol

# name: (B, H, S, D, BlockMask block size)
SHAPES = {
    "causal": (1, 2, 40, 16, 16),
    "document": (2, 2, 50, 16, 16),
    "alibi": (1, 2, 48, 16, 16),
    "softcap": (1, 2, 40, 24, 32),
    "relbias": (1, 2, 45, 16, 16),
    "gqa": (1, 4, 40, 16, 16),
}


def _grads(out, lse, wo, wl, tensors):
    loss = (out * wo).sum() + (torch.where(torch.isinf(lse), 0.0, lse) * wl).sum()
    return torch.autograd.grad(loss, tensors)


@pytest.mark.parametrize("name", list(SHAPES))
def test_backward(name):
    B, H, S, D, bs = SHAPES[name]
    case = cases(S, H)[name]
    p = params_of(case)
    q, k, v = inputs(B, H, S, D, case.hkv, grad=True)
    bm = block_mask(case, p, B, H, S, bs)
    wo, wl = torch.randn(B, H, S, D), torch.randn(B, H, S)
    learned = [p[n] for n in case.grad]
    with kiln.config.patch(codegen="triton"), Count() as c:
        out, lse = compiled_hop(case, p, bm, q, k, v)(q, k, v)
        got = _grads(out, lse, wo, wl, [q, k, v] + learned)
    p64 = params_of(case, torch.float64)
    t64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = dense(*t64, case, p64)
    want = _grads(ref_out, ref_lse, wo.double(), wl.double(), t64 + [p64[n] for n in case.grad])
    close(out, ref_out, tol(S, D))
    close(lse, ref_lse, tol(S, D))
    for g, w, what in zip(got, want, ["dq", "dk", "dv"] + list(case.grad)):
        assert g is not None, what
        close(g, w, 4 * tol(S, D))
    assert c.kernels == {"flex": 1, "flex_backward": 1}, (c.kernels, c.fallbacks)
    assert not c.fallbacks


def test_cpp_backward_falls_back():
    """The C++ target has no backward (torch has none on the CPU either): the backward op keeps its dense
    implementation, logged and counted, and the forward still runs kiln's kernel."""
    B, H, S, D = 1, 2, 32, 16
    case = cases(S, H)["causal"]
    q, k, v = inputs(B, H, S, D, grad=True)
    bm = block_mask(case, {}, B, H, S, 16)
    with kiln.config.patch(codegen="cpp"), Count() as c:
        out, lse = compiled_hop(case, {}, bm, q, k, v)(q, k, v)
        dq, = torch.autograd.grad(out.sum(), [q])
    t64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = dense(*t64, case, {})
    close(out, ref, tol(S, D))
    close(dq, torch.autograd.grad(ref.sum(), [t64[0]])[0], 4 * tol(S, D))
    assert c.kernels == {"flex_cpp": 1} and c.fallbacks == {"flex_attention_backward": 1}


def test_broadcast_kv_batch_value_dim_and_dead_rows():
    """Keys and values of batch 1 under queries of batch 2 (dk, dv summed over the query batches), a value
    head dim unlike the query's, a score_mod reading the batch index, and rows with every key masked
    (zero output, lse -inf, zero gradients): the interpreter's forward and backward, and the C++ forward."""
    from tests.flex.util import Case
    B, H, S, D, DV = 2, 2, 40, 16, 24
    keep = lambda b, h, q, kv: (q >= kv) & (q % 7 != 3)  # noqa: E731
    case = Case("dead", mask=lambda p: keep, score=lambda p: lambda s, b, h, q, kv: s * (1 + b))
    bm = block_mask(case, {}, B, H, S, 16)
    q = torch.randn(B, H, S, D, requires_grad=True)
    k, v = torch.randn(1, H, S, D, requires_grad=True), torch.randn(1, H, S, DV, requires_grad=True)
    wo, wl = torch.randn(B, H, S, DV), torch.randn(B, H, S)
    with kiln.config.patch(codegen="triton"), Count() as c:
        out, lse = compiled_hop(case, {}, bm, q, k, v)(q, k, v)
        got = _grads(out, lse, wo, wl, [q, k, v])
    t64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = dense(t64[0], t64[1].expand(B, -1, -1, -1), t64[2].expand(B, -1, -1, -1), case, {})
    want = _grads(ref, ref_lse, wo.double(), wl.double(), t64)
    close(out, ref, tol(S, D))
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)) and torch.isinf(lse).any()
    for g, w in zip(got, want):
        close(g, w, 4 * tol(S, D))
    assert c.kernels == {"flex": 1, "flex_backward": 1} and not c.fallbacks
    with torch.no_grad(), kiln.config.patch(codegen="cpp"), Count() as c:
        close(compiled_hop(case, {}, bm, q, k, v)(q, k, v)[0], ref, tol(S, D))
    assert c.kernels == {"flex_cpp": 1}
