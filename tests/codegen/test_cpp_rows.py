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
