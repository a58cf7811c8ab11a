"""Grouped kernels (``schedule.group``, ``to_triton.group``): independent pointwise kernels that read graph
inputs only (a training step's weight casts) run as one launch, at their first member's place; equal values
and gradients, fewer launches; and kernels whose results only the graph returns, once their inputs are ready;
dependent kernels are never grouped; the bound on bytes kept alive and the size cap hold."""
import re

import pytest
import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

import kiln
from kiln.codegen.schedule.group import GroupPlan
from kiln.options import current
from kiln.runtime.precompile import compiled_module, record_launches
from tests.codegen.util import assert_close, decompositions, fuse_graph, kernels
from tests.numerics import fp64


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 24), nn.Linear(24, 8)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _step(model, x):
    with torch.autocast(x.device.type, torch.bfloat16):
        return model(x).float().square().mean()


def _launches(code) -> int:
    return sum(len(re.findall(r"= kiln_\w+\(", src)) for src in code if src.startswith("# kiln wrapper"))


def _train(model, x, group: bool):
    """(loss, grads, generated sources) of one compiled step of ``model`` with grouping on or off."""
    model.zero_grad()
    c = torch.compile(lambda x: _step(model, x), backend="kiln",
                      options={"codegen": "triton", "tuning": {"group_kernels": group}})

    def step():
        loss = c(x)
        loss.backward()
        return loss
    loss, code = kiln.run_and_get_code(step)
    return loss, [p.grad.clone() for p in model.parameters()], code


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_mlp_casts_grouped_fewer_launches_same_values(device):
    torch.manual_seed(0)
    model, x = MLP().to(device), torch.randn(4, 16, device=device)
    loss, grads, code = _train(model, x, True)
    loss_off, grads_off, code_off = _train(model, x, False)
    src = "\n".join(code)
    assert "kiln_grp_" in src and "kiln_grp_" not in "\n".join(code_off)
    assert _launches(code) < _launches(code_off) - 4, (_launches(code), _launches(code_off))   # 7 casts -> 1
    # grouping changes which launch computes a value, never the value
    assert torch.equal(loss, loss_off) and all(torch.equal(g, h) for g, h in zip(grads, grads_off))
    model.zero_grad()
    ref = _step(model, x)
    ref.backward()
    exact_model = MLP().to(device).double()
    exact_model.load_state_dict(fp64(model.state_dict()))
    exact = exact_model(x.double()).square().mean()
    exact.backward()
    # bf16 products: within eager's own error of the float64 result, twice over
    tol = 2 * (ref.double() - exact).abs() + 1e-6
    assert (loss.double() - exact).abs() <= tol
    torch.testing.assert_close(loss, ref, rtol=2e-2, atol=1e-3)
    for g, p, e in zip(grads, model.parameters(), exact_model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=2e-2, atol=1e-3)
        assert (g.double() - e.grad).abs().max() <= 2 * (p.grad.double() - e.grad).abs().max() + 1e-4


def _plans(f, *args, **tuning):
    """(fused graph, its kernel plans) of ``f`` traced on ``args``, Triton target, ``tuning`` set."""
    gm = make_fx(f, decomposition_table=decompositions(), tracing_mode="fake")(*args)
    return gm, fuse_graph(gm, args, current(codegen="triton", tuning=tuning)).plans


def _groups(plans):
    return [p for p in plans if isinstance(p, GroupPlan)]


def test_dependent_kernels_are_not_grouped():
    """``a`` and ``c`` read inputs only: one group, first; ``b`` reads a product of ``a``'s output and ``d`` a
    cumsum of ``c``'s, and the graph only returns theirs: another group, after the product and the cumsum."""
    def f(w, v, u):
        a = w.sin()
        b = (a @ v).cos()
        c = u.exp()
        d = torch.cumsum(c, 0).tanh()
        return b, c, d

    args = (torch.randn(8, 8), torch.randn(8, 8), torch.randn(6, 5))
    gm, plans = _plans(f, *args)
    early, late = sorted(_groups(plans), key=lambda g: "cos" in g.describe())
    assert len(early.plans) == len(late.plans) == 2 and len(_groups(plans)) == 2, [p.describe() for p in plans]
    assert all(op in early.describe() and op not in late.describe() for op in ("sin", "exp"))
    assert all(op in late.describe() and op not in early.describe() for op in ("cos", "tanh"))
    for g in early, late:   # no member reads what another stores
        for p in g.plans:
            assert not p.reads & {b.name for q in g.plans if q is not p for b in q.stored}
    nodes = list(gm.graph.nodes)
    groups = [i for i, n in enumerate(nodes) if getattr(n.target, "__name__", "").startswith("kiln_grp_")]
    extern = [i for i, n in enumerate(nodes) if n.target in (torch.ops.aten.mm.default, torch.ops.aten.cumsum.default)]
    assert len(groups) == 2 and groups[0] < min(extern) and groups[1] > max(extern), (groups, extern)
    assert_close(gm(*args), f(*args))


def test_late_group_launches_after_its_members_producers():
    """``r1``'s kernel comes before the scatter in launch order, ``r2``'s after it (it reads the scatter): the
    group of both launches in ``r2``'s turn (in ``r1``'s, the scatter's result would not exist yet)."""
    def f(x, y, idx):
        r1 = (x @ x).float()
        s = torch.zeros(8, 8).index_add(0, idx, (x @ y)[:5].float())
        return r1, s.exp()

    args = (torch.randn(8, 8, dtype=torch.bfloat16), torch.randn(8, 8, dtype=torch.bfloat16),
            torch.tensor([0, 3, 3, 7, 1]))
    gm, plans = _plans(f, *args)
    assert len(_groups(plans)) == 1 and isinstance(plans[-1], GroupPlan), [p.describe() for p in plans]
    assert_close(gm(*args), f(*args))


def _products(*ws):
    """Per weight, its bf16 cast (a kernel reading an input only: 4 KiB) and the float32 cast of a product of
    it that the graph returns (a kernel reading a 2 KiB product), for 32x64 weights."""
    return [(b @ b.t()).float() for b in (w.to(torch.bfloat16) for w in ws)]


def test_live_bytes_bound_and_size_cap():
    ws = [torch.randn(32, 64) for _ in range(6)]
    cast, product = 32 * 64 * 2, 32 * 32 * 2

    def sizes(plans):
        groups = _groups(plans)
        early = [g for g in groups if g.plans[0].stored[0].dtype == torch.bfloat16]
        return [len(g.plans) for g in early], [len(g.plans) for g in groups if g not in early]
    _, plans = _plans(_products, *ws)
    assert sizes(plans) == ([6], [6])
    for bound, expected in [(product, ([], [2, 2, 2])), (cast, ([2, 2, 2], [3, 3])), (product - 1, ([], []))]:
        gm, plans = _plans(_products, *ws, group_live_bytes=bound)
        assert sizes(plans) == expected, bound
        for g in _groups(plans):   # early members' results made before their time, late ones' inputs kept
            early = g.plans[0].stored[0].dtype == torch.bfloat16
            kept = [b for p in g.plans[1:] for b in p.stored] if early else \
                [p.buffers[n] for p in g.plans[:-1] for n in p.reads]
            assert sum(b.numel * b.dtype.itemsize for b in kept) <= bound
        for out, ref in zip(gm(*ws), _products(*ws)):
            assert torch.equal(out, ref)
    _, plans = _plans(_products, *ws, group_max=4)
    assert sizes(plans) == ([4, 2], [4, 2])
    _, plans = _plans(_products, *ws, group_kernels=False)
    assert not _groups(plans)


def test_grouped_kernel_compiles_for_sm90_and_is_precompiled():
    """The compiled-mode module (constant sizes, ``launch.launch`` with a fixed grid) compiles for sm_90 with
    Triton's real frontend and ptxas, through the launches the precompile workers record."""
    from tests.codegen.test_compile_sm90 import _compile_all, _toolchain_missing
    if _toolchain_missing() is not None:
        pytest.skip(_toolchain_missing())
    gm = _compile_all(lambda *ws: [w.to(torch.bfloat16) for w in ws], [(32, 64), (16, 48), (8, 8)])
    groups = [k for k in kernels(gm) if k.name.startswith("kiln_grp_")]
    assert len(groups) == 1 and "launch.launch(" in groups[0].source, [k.name for k in kernels(gm)]
    node = next(n for n in gm.graph.nodes if n.target is groups[0])
    launches = record_launches(compiled_module(groups[0]), [a.meta["val"] for a in node.args])
    assert len(launches) == 1 and launches[0][2][0] == 1024   # one launch, one block size for all members
