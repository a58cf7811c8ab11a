"""kiln.memory_efficient_fusion beyond the seed: keyword arguments, tied weights, clear errors."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln
from tests.numerics import assert_close_to_fp64


class TiedLM(nn.Module):
    """An embedding whose weight is also the output projection (as in most language models)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.ln = nn.LayerNorm(16)
        self.out = nn.Linear(16, 50, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids, labels=None, scale=1.0):
        logits = self.out(self.ln(self.emb(ids))) * scale
        return logits if labels is None else F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_module_with_tied_weights_and_keyword_arguments():
    torch.manual_seed(0)
    m = TiedLM()
    ids, labels = torch.randint(0, 50, (2, 8)), torch.randint(0, 50, (2, 8))
    m64 = __import__("copy").deepcopy(m).double()   # float64: the norm and the loss sum in the host's order
    exact = m64(ids, labels=labels, scale=0.5)
    exact.backward()
    ref = m(ids, labels=labels, scale=0.5)
    ref.backward()
    want = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    f = kiln.memory_efficient_fusion(m)
    for _ in range(2):
        m.zero_grad()
        got = f(ids, labels=labels, scale=0.5)
        got.backward()
    assert_close_to_fp64(got, ref, exact, atol=1e-5, rtol=1.3e-6)
    for p, w, e in zip(m.parameters(), want, m64.parameters()):
        assert_close_to_fp64(p.grad, w, e.grad, atol=1e-5, rtol=1e-5)
    # another keyword set is another graph, not the first one reused
    assert_close_to_fp64(f(ids), m(ids), m64(ids), atol=1e-5, rtol=1.3e-6)


def test_parameters_captured_by_a_closure_are_an_error():
    m = nn.Linear(4, 4)
    f = kiln.memory_efficient_fusion(lambda x: m(x).sum())
    with pytest.raises(TypeError, match="Pass the\\s+nn.Module itself"):
        f(torch.randn(2, 4, requires_grad=True))


def test_reading_a_tensor_value_names_kiln_compile():
    def fn(x):
        return x * 2 if x.sum() > 0 else x * 3
    f = kiln.memory_efficient_fusion(fn)
    with pytest.raises(TypeError, match="kiln.compile"):
        f(torch.randn(4, requires_grad=True))
    x = torch.randn(4, requires_grad=True)
    torch.testing.assert_close(kiln.compile(fn)(x), fn(x))
