"""How the C++ emitter walks a plan's rows (``to_cpp/rows.py``), cases found by fuzzing the cpp target."""
import pytest
import torch

from kiln.options import current
from kiln.runtime import cpp_build
from tests.codegen.test_cpp import check

pytestmark = pytest.mark.skipif(not cpp_build.find_compiler(current()), reason="no C++ compiler (g++, clang++, $CXX)")


@pytest.mark.parametrize("col_block", [64, 4])
def test_column_reduction_stores_a_value_at_every_row(col_block):
    """A reduction over a non-innermost dim (column blocks) whose kernel also stores a per-column value
    at every row of its column: ``lt(amax(x, 0), x)`` with ``x`` expanded along dim 0 (the loads do not
    depend on the row). That store had no loop over rows around it: g++ failed ('r' was not declared)
    and the graph ran ATen (fuzz seed 12, program 30)."""
    x = torch.randn(1, 7, 2).expand(4, 7, 2)
    check(lambda x: torch.lt(torch.aminmax(x, dim=0).max, x), x, n_kernels=1, exact=True,   # (a max is exact
          tuning={"cpp_col_block": col_block})                                             # in any order)
    check(lambda x: (x.amax(0), x.amax(0) * 2 + x.sum(0, keepdim=True) - x), x, n_kernels=1,
          tuning={"cpp_col_block": col_block})


@pytest.mark.parametrize("double", [True, False])
def test_column_sums_as_accurate_as_eagers(double):
    """A residual block trained on the C++ target goes channels-last, so its BatchNorms' backward sums run down
    columns of 1024 rows; under an average pool's nearly constant gradient they cancel, and float accumulation
    put the gradients ~100x further from float64 than eager's (the bench's CNN training check failed,
    2026-11-28). Summed in double (``cpp_double_columns``) they stay within 4x of eager's error; the float
    control shows the test can fail."""
    import copy

    import kiln
    from kiln_bench.models import ResBlock
    torch.manual_seed(0)
    model = torch.nn.Sequential(ResBlock(64, 128, 2), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                torch.nn.Linear(128, 10))
    x = torch.randn(16, 64, 16, 16)

    def grads(m, x, compiled=False):
        m = copy.deepcopy(m)
        (torch.compile(m, backend="kiln") if compiled else m)(x).sum().backward()
        return [p.grad.double() for p in m.parameters()]
    ref = grads(model.double(), x.double())
    model.float()
    eager = grads(model, x)
    torch._dynamo.reset()
    with kiln.config.patch(codegen="cpp", **{"tuning.cpp_double_columns": double}):
        got = grads(model, x, compiled=True)
    rel = [((a - r).norm() / r.norm()).item() for a, r in zip(got, ref)]
    worst = [((e - r).norm() / r.norm()).item() for e, r in zip(eager, ref)]
    assert all(g <= 4 * e + 1e-7 for g, e in zip(rel, worst)) == double, (rel, worst)
