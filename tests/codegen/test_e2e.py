"""End to end through ``kiln.compile(..., codegen='triton')``: forward and backward on the CPU
(kernels run in Triton's interpreter) match eager, and the generated code is Triton."""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln
from tests.numerics import assert_close_to_fp64


class Block(nn.Module):
    def __init__(self, d=32, classes=10):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)
        self.head = nn.Linear(d, classes)

    def forward(self, x, t):
        h = x + F.gelu(self.fc(self.ln(x)))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return F.cross_entropy(self.head(torch.softmax(h, -1) * 4), t)


def test_train_step_matches_eager():
    """Loss and gradients against eager's and a float64 step's (``assert_close_to_fp64``: the norms, softmax
    and cross-entropy sum in the interpreter's order, eager's in the host's)."""
    torch.manual_seed(0)
    m = Block()
    x, t = torch.randn(8, 32, requires_grad=True), torch.randint(0, 10, (8,))
    m64, x64 = copy.deepcopy(m).double(), x.detach().double().requires_grad_()
    exact = m64(x64, t)
    exact.backward()
    ref = m(x, t)
    ref.backward()
    grads = [p.grad.clone() for p in m.parameters()] + [x.grad.clone()]
    m.zero_grad()
    x.grad = None
    before = kiln.counters["codegen"]["kernels"]
    out = kiln.compile(m, codegen="triton")(x, t)
    out.backward()
    assert_close_to_fp64(out, ref, exact, atol=1e-5, rtol=1e-5)
    exact_grads = [p.grad for p in m64.parameters()] + [x64.grad]
    for g, r, e in zip([p.grad for p in m.parameters()] + [x.grad], grads, exact_grads):
        assert_close_to_fp64(g, r, e, atol=1e-5, rtol=1e-5)
    assert kiln.counters["codegen"]["kernels"] - before >= 4


def test_run_and_get_code_shows_triton_kernels():
    def fn(x, w):
        return F.layer_norm(x, (16,), w, None).relu()
    x, w = torch.randn(4, 16), torch.randn(16)
    out, code = kiln.run_and_get_code(kiln.compile(fn, codegen="triton"), x, w)
    text = "\n".join(code)
    assert "@triton.jit" in text and "tl.store" in text
    torch.testing.assert_close(out, fn(x, w), atol=1e-5, rtol=1e-5)


def Attention():
    """The e2e transformer block with its attention written out, so the softmax is fused."""
    from tests.e2e.test_models import Block
    return Block(sdpa=False)


def test_transformer_block_forward_backward():
    from tests.e2e.helpers import check_train
    torch.manual_seed(0)
    check_train(Attention(), [torch.randn(2, 8, 32, requires_grad=True)], rtol=1e-4, atol=1e-4, codegen="triton")


def test_cnn_batchnorm_train_step():
    from tests.e2e.helpers import check_train
    from tests.e2e.test_models import CNN
    torch.manual_seed(0)
    check_train(CNN().train(), [torch.randn(2, 3, 8, 8, requires_grad=True)], rtol=1e-4, atol=1e-4, codegen="triton")


def test_dynamic_sizes_divide_by_a_symbolic_product():
    """Embedding + layer norm over a strided slice of ids with dynamic sizes: the fused kernel indexes
    the ids through ``(r + 32*x) // (32*s)``, which once printed as ``... // 32*s`` (read out of bounds:
    a segfault in the interpreter, garbage on a GPU)."""
    import torch.nn.functional as F

    def f(ids, emb, pos, w, b, W):
        h = F.embedding(ids, emb) + F.embedding(torch.arange(ids.shape[1]), pos)
        return (F.layer_norm(h, (32,), w, b).view(-1, 32) @ W).sum()

    torch.manual_seed(0)
    params = [torch.randn(128, 32), torch.randn(64, 32), torch.randn(32), torch.randn(32), torch.randn(32, 8)]
    params = [p.requires_grad_() for p in params]
    base = torch.randint(0, 128, (2, 16))
    cf = torch.compile(f, backend="kiln", dynamic=True, options={"codegen": "triton"})
    for seq in (16, 12, 9):
        ids = base[:, :seq]
        out = cf(ids, *params)
        got = torch.autograd.grad(out, params)
        ref = f(ids, *params)
        want = torch.autograd.grad(ref, params)
        torch.testing.assert_close(out, ref, atol=1e-3, rtol=1e-5)
        for g, r in zip(got, want):
            torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)


def test_constant_index_load_under_a_mask():
    """RoPE's rotate_half on gathered rows: a one-element index is loaded inside the masked halves of a
    ``cat``, so its address is broadcast to a block. That used ``tl.zeros``, a jit function of Triton's
    standard library that an interpreted kernel cannot call unless Triton was imported in interpreter
    mode (HF Falcon failed so)."""
    def f(x, idx, w):
        t = x[idx] * w
        return torch.cat([-t[..., 8:], t[..., :8]], -1)

    x, idx, w = torch.randn(4, 16), torch.tensor([2]), torch.randn(16)
    out, code = kiln.run_and_get_code(kiln.compile(f, codegen="triton"), x, idx, w)
    torch.testing.assert_close(out, f(x, idx, w))
    assert any("tl.full([XBLOCK], 0, tl.int32)" in c for c in code)
