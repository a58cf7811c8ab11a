"""partition_joint with both partitioners through aot_function: values and grads match eager."""
import pytest
import torch
import torch.nn.functional as F

from kiln.partition.extract import is_sym
from tests.partition.helpers import aot, check_grads

PARTS = ["default", "mincut"]


def mlp(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2).tanh()


def mlp_args(n=8):
    return (torch.randn(n, 16, requires_grad=True), torch.randn(32, 16, requires_grad=True),
            torch.randn(32, requires_grad=True), torch.randn(4, 32, requires_grad=True),
            torch.randn(4, requires_grad=True))


def _bw_contract(cap):
    """Every backward placeholder has meta['val']; SymInts come first; free symbols are bound."""
    from torch.fx.experimental.symbolic_shapes import free_symbols
    ph = [n for n in cap.bw.graph.nodes if n.op == "placeholder"]
    assert all("val" in p.meta for p in ph)
    flags = [is_sym(p) for p in ph]
    assert flags == sorted(flags, reverse=True), "SymInt placeholders must come first"
    bound = {p.meta["val"].node.expr for p in ph if isinstance(p.meta["val"], torch.SymInt)}
    for p in ph:
        assert free_symbols(p.meta["val"]) <= bound, p.name
    outs = cap.fw.graph.output_node().args[0]
    syms = [is_sym(o) for o in outs if isinstance(o, torch.fx.Node)]
    assert syms == sorted(syms), "saved SymInts must come last in the forward outputs"


@pytest.mark.parametrize("part", PARTS)
def test_mlp(part):
    cap = check_grads(mlp, mlp_args(), partitioner=part)
    _bw_contract(cap)


@pytest.mark.parametrize("part", PARTS)
def test_mlp_dynamic(part):
    compiled, cap = aot(mlp, dynamic=True, partitioner=part)
    for n in (8, 5):
        args = mlp_args(n)
        ref = [a.detach().clone().requires_grad_() for a in args]
        compiled(*args).sum().backward()
        mlp(*ref).sum().backward()
        for a, r in zip(args, ref):
            torch.testing.assert_close(a.grad, r.grad, atol=1e-5, rtol=1e-4)
    _bw_contract(cap)
    assert any(isinstance(p.meta["val"], torch.SymInt) for p in cap.bw.graph.nodes if p.op == "placeholder")


def dropout_fn(x, w):
    return F.dropout(torch.mm(x, w).relu(), 0.5, training=True).sum(1)


@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize("dynamic", [False, True])
def test_dropout(part, dynamic):
    cap = check_grads(dropout_fn, (torch.randn(6, 8, requires_grad=True), torch.randn(8, 5, requires_grad=True)),
                      dynamic=dynamic, partitioner=part)
    assert not any("dropout" in str(n.target) and "backward" not in str(n.target) for n in cap.bw.graph.nodes), \
        "the random op must not be recomputed in the backward"
    _bw_contract(cap)


def multi(x, y):
    a = x.sin() * y
    return a.cos(), (a @ y.t()).relu(), x.shape[0] * 2


@pytest.mark.parametrize("part", PARTS)
def test_multiple_outputs(part):
    compiled, cap = aot(multi, partitioner=part)
    x, y = torch.randn(4, 6, requires_grad=True), torch.randn(4, 6, requires_grad=True)
    xr, yr = x.detach().clone().requires_grad_(), y.detach().clone().requires_grad_()
    o1, o2, k = compiled(x, y)
    r1, r2, kr = multi(xr, yr)
    assert k == kr
    torch.testing.assert_close(o1, r1)
    torch.testing.assert_close(o2, r2)
    (o1.sum() + 3 * o2.sum()).backward()
    (r1.sum() + 3 * r2.sum()).backward()
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(y.grad, yr.grad)


def mutate(x, buf):
    buf.add_(1)
    return (x * buf).sin()


@pytest.mark.parametrize("part", PARTS)
def test_input_mutation(part):
    x = torch.randn(5, requires_grad=True)
    buf, buf_ref = torch.zeros(5), torch.zeros(5)
    xr = x.detach().clone().requires_grad_()
    compiled, _ = aot(mutate, partitioner=part)
    out = compiled(x, buf)
    ref = mutate(xr, buf_ref)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(buf, buf_ref)
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)


@pytest.mark.parametrize("part", PARTS)
def test_inplace_on_requires_grad_input_view(part):
    def f(x, w):
        y = x * 2
        y.mul_(w)
        return y.exp()
    check_grads(f, (torch.randn(3, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)), partitioner=part)


def test_default_saves_sizes_not_tensors_dynamic():
    """Backward that needs only a size of an intermediate saves the SymInt, not the tensor."""
    def f(x):
        return x.exp().sum()
    x = torch.randn(7, 3, requires_grad=True)
    _f, cap = aot(f, dynamic=True, partitioner="default")
    _f(x).backward()
    torch.testing.assert_close(x.grad, x.detach().exp())
    outs = cap.fw.graph.output_node().args[0]
    names = [o.name for o in outs[1:]]
    assert "primals_1" not in names, names  # only its sizes are needed
    assert any(n.startswith("sym_size") for n in names), names
    assert any(n.startswith(("exp", "detach")) for n in names), names  # exp's backward needs exp's value
    _bw_contract(cap)


def test_default_saves_only_what_backward_uses():
    def f(x, w):
        return torch.mm(x.cos(), w).sum()
    _f, cap = aot(f, partitioner="default")
    x, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    _f(x, w).backward()
    saved = {o.name for o in cap.fw.graph.output_node().args[0][1:]}
    assert saved == {"primals_1", "primals_2", "cos"}, saved
