"""kiln_bench.graph_peak: the static peak of a graph from its fake values."""
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from kiln_bench.graph_peak import graph_peak

MB = 1024 * 1024 * 4   # bytes of a 1024x1024 fp32 tensor


def test_values_live_from_definition_to_last_use():
    def f(x, y):
        a = x + 1          # x, y, a (x dies here: the wrapper drops inputs after their last use)
        b = a * y          # y, a, b: the peak (a and y die here)
        c = b.sum()        # b
        return c
    gm = make_fx(f, tracing_mode="fake")(torch.empty(1024, 1024), torch.empty(1024, 1024))
    p = graph_peak(gm)
    assert p.peak == 3 * MB
    assert p.at == "add"
    assert sorted(n for _, n in p.top) == ["add", "x_1", "y_1"]


def test_views_and_split_pieces_share_their_base():
    def f(x):
        a = x * 3
        v = a.view(-1)                  # no new memory
        p, q = a.split(512)             # pieces of a: no new memory
        return (v.sum() + p.sum() + q.sum(),)
    gm = make_fx(f, tracing_mode="fake")(torch.empty(1024, 1024))
    assert graph_peak(gm).peak == 2 * MB


def test_outputs_stay_alive_to_the_end():
    def f(x):
        a = x + 1
        b = x * 2          # a is an output: it is still alive here
        return a, b.sum()
    gm = make_fx(f, tracing_mode="fake")(torch.empty(1024, 1024))
    assert graph_peak(gm).peak == 3 * MB
