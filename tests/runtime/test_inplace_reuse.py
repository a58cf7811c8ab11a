"""A kernel writes its output into an input that dies at the call (``KernelPlan.reusable``,
``wrapper._Emitter._into``): same values as eager, less memory, and never where the input lives on."""
import re

import pytest
import torch
import torch.nn as nn

import kiln
from kiln.codegen import wrapper as W
from tests.numerics import assert_close_to_fp64


def _compile(fn, *args, **options):
    torch._dynamo.reset()
    f = torch.compile(fn, backend="kiln", options={"codegen": "triton", **options})   # (options may name "cpp")
    out, code = kiln.run_and_get_code(f, *args)
    src = "\n".join(c for c in code if c.startswith("# kiln wrapper"))
    return f, out, src


def _intos(src):
    """The arguments handed to kernels as ``into`` (one per output, None where none)."""
    return [a.strip(",") for m in re.findall(r"into=\(([^)]*)\)", src) for a in m.split(", ") if a.strip(",") != "None"]


@pytest.mark.parametrize("codegen", ["triton", "cpp"])
def test_a_dying_library_result_takes_the_kernel_output(codegen):
    def fn(x, w, b):
        h = x @ w            # a library call's fresh result, read by one kernel only
        return torch.relu(h + b) * 2
    x, w, b = torch.randn(8, 16), torch.randn(16, 16), torch.randn(16)
    f, out, src = _compile(fn, x, w, b, codegen=codegen)
    torch.testing.assert_close(out, fn(x, w, b))
    assert len(_intos(src)) == 1, src


@pytest.mark.parametrize("codegen", ["triton", "cpp"])
@pytest.mark.parametrize("case", ["graph_input", "returned", "read_later", "read_by_a_later_kernel",
                                  "view_alive", "flipped"])
def test_never_where_the_input_lives_on_or_is_read_elsewhere(case, codegen):
    many = {"tuning.xblock_max": 16}   # many programs: a program must not overwrite what a later one reads

    def fn(x, w):
        h = x @ w
        if case == "graph_input":
            return torch.relu(x * 2)
        if case == "returned":
            return torch.relu(h * 2), h
        if case == "read_later":
            return torch.relu(h * 2) @ h
        if case == "read_by_a_later_kernel":
            return torch.relu(h * 2), torch.sigmoid(h[:, :8].flip(0)) * 3
        if case == "view_alive":
            return torch.relu(h * 2), h.t()[0]
        return torch.relu(h.flip(0) * 2)   # the kernel reads h at another element than it writes
    x, w = torch.randn(16, 16), torch.randn(16, 16)
    f, out, src = _compile(fn, x, w, codegen=codegen, **many)
    ref = fn(x.clone(), w)
    for o, r in zip(out if isinstance(out, tuple) else (out,), ref if isinstance(ref, tuple) else (ref,)):
        torch.testing.assert_close(o, r)
    assert _intos(src) == [], src
    torch.testing.assert_close(x, x.clone())   # the input was not written


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)

    def forward(self, x):
        return torch.relu(self.b2(self.c2(torch.relu(self.b1(self.c1(x))))) + x)


def test_inference_peak_falls_and_values_match():
    """Residual conv blocks in inference: each BN/ReLU kernel writes over the convolution's result."""
    from kiln_bench.livemem import measure_peak
    net = nn.Sequential(*[_Block() for _ in range(3)]).eval()
    x = torch.randn(2, 8, 24, 24)
    with torch.no_grad():   # six convolutions: eager's and kiln's batch norms round differently in between
        ref, exact = net(x), __import__("copy").deepcopy(net).double()(x.double())
    peaks = {}
    for reuse in (False, True):
        with torch.no_grad():
            f, out, src = _compile(net, x, **{"tuning.reuse_inputs": reuse})
            assert_close_to_fp64(out, ref, exact, atol=1e-5, rtol=1e-5)
            assert_close_to_fp64(f(x), ref, exact, atol=1e-5, rtol=1e-5)   # and again
            peaks[reuse] = measure_peak(lambda: f(x)).peak
        assert bool(_intos(src)) == reuse
    assert peaks[True] < peaks[False], peaks


def test_training_matches_eager_with_reuse():
    net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 4))
    ref, exact = __import__("copy").deepcopy(net), __import__("copy").deepcopy(net).double()
    x = torch.randn(8, 16)
    torch._dynamo.reset()
    f = torch.compile(net, backend="kiln", options={"codegen": "triton"})
    for _ in range(2):
        f(x).square().sum().backward()
        ref(x).square().sum().backward()
        exact(x.double()).square().sum().backward()
    for p, q, e in zip(net.parameters(), ref.parameters(), exact.parameters()):
        assert_close_to_fp64(p.grad, q.grad, e.grad, atol=1e-5, rtol=1e-5)


def test_fresh_results_are_told_from_views():
    aten = torch.ops.aten
    assert W._fresh_result(aten.mm.default) and W._fresh_result(aten.convolution.default)
    assert not W._fresh_result(aten.permute.default) and not W._fresh_result(aten.add_.Tensor)
    assert not W._fresh_result(aten.split_with_sizes.default)
    from kiln.codegen.views import is_view_op
    assert W._fresh_result(aten._unsafe_view.default) and is_view_op(aten._unsafe_view.default)  # hence both


@pytest.mark.parametrize("looped", [False, True], ids=["persistent", "looped"])
def test_a_softmax_writes_over_the_scores_it_reads(looped):
    """Attention in inference: the softmax row kernel stores its output in its last loop over each row,
    which its program owns, so the output may take the dying scores' memory (one [B, H, S, S] buffer,
    not two)."""
    opts = {"tuning.xblock_max": 4, **({"tuning.persistent_max": 16} if looped else {})}

    def fn(q, k, v):
        s = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
        return s @ v
    q, k, v = (torch.randn(2, 64, 16) for _ in range(3))
    with torch.no_grad():
        f, out, src = _compile(fn, q, k, v, **opts)
    torch.testing.assert_close(out, fn(q, k, v), atol=1e-5, rtol=1e-5)
    assert len(_intos(src)) == 1, src


def test_a_row_reduction_reading_other_rows_keeps_its_own_output():
    """A kernel that reads its input at another element than it writes (a flipped row) may not write
    over it."""
    def fn(a, b):
        s = a @ b
        return torch.softmax(s.flip(-1), dim=-1) @ b
    a, b = torch.randn(32, 32), torch.randn(32, 32)
    with torch.no_grad():
        f, out, src = _compile(fn, a, b, **{"tuning.xblock_max": 4})
    torch.testing.assert_close(out, fn(a, b), atol=1e-5, rtol=1e-5)
    assert _intos(src) == [], src
