"""Indirect indexing (gather, index, embedding) and scatters (scatter_add, index_put accumulate)."""
import torch
import torch.nn.functional as F

from tests.codegen.util import check, fused, kernels


def test_gather_index_select_embedding_fuse_with_producers():
    def fn(x, i, j, w, k):
        return (torch.gather(x.exp(), 1, i) + 1, x[j] * 2, torch.index_select(x, 1, j.abs()) - 1,
                F.embedding(k, w) * 2)
    x = torch.randn(4, 8)
    i = torch.randint(0, 8, (4, 3))
    j = torch.tensor([3, 0, -1])
    w, k = torch.randn(10, 4), torch.randint(0, 10, (2, 3))
    gm = check(fn, x, i, j, w, k)
    assert len(kernels(gm)) <= 4


def test_advanced_index_two_tensors_and_slices():
    def fn(x, a, b):
        return x[a, :, b] + 1, x[:, a] * 2
    x = torch.randn(5, 6, 7)
    check(fn, x, torch.tensor([0, 4, 2]), torch.tensor([6, 0, -2]))


def test_index_put_accumulate_and_set():
    def fn(x, i, v):
        return x.index_put((i,), v, accumulate=True), x.index_put((i[:2],), v[:2] * 3)
    x = torch.randn(5, 3)
    check(fn, x, torch.tensor([0, 1, 1, 4]), torch.ones(4, 3))


def test_scatter_add_and_index_add():
    def fn(x, i, v, j):
        return x.scatter_add(0, i, v) * 2, x.index_add(0, j, v[:2], alpha=2.0)
    x, v = torch.zeros(5, 8), torch.randn(4, 8)
    check(fn, x, torch.randint(0, 5, (4, 8)), v, torch.tensor([4, 4]), atol=1e-5, rtol=1e-5)


def test_embedding_backward_accumulates_duplicates():
    def fn(w, idx, g):
        w = w.detach().requires_grad_()
        return torch.autograd.grad(F.embedding(idx, w, padding_idx=0), w, g)
    w, idx = torch.randn(6, 4), torch.tensor([[1, 1, 0], [5, 1, 2]])
    gm, n = fused(fn, w, idx, torch.randn(2, 3, 4))
    torch.testing.assert_close(gm(w, idx, g := torch.randn(2, 3, 4))[0], fn(w, idx, g)[0])
    assert n >= 1
