"""AOTAutograd's graph text (kiln/compat.py ``aot_call``): not formatted when nothing reads it; formatted, logged
and traced when TORCH_LOGS shows AOTAutograd's graphs or a structured trace is written."""
import os
import sys

import pytest
import torch
from torch._functorch._aot_autograd.schemas import AOTConfig

import kiln
from tests.test_logs import _Entries


@pytest.fixture
def formatted(monkeypatch):
    """Where AOTAutograd (torch/_functorch) prints a graph to text (``GraphModule.print_readable``) from now on;
    Dynamo's own structured-trace entry, which pytest's log capture reads, is not counted."""
    if os.environ.get("KILN_DEBUG") or os.environ.get("TORCH_LOGS") or os.environ.get("TORCH_TRACE"):
        pytest.skip("a debug variable is set: graphs are formatted for it")
    names, real = [], torch.fx.GraphModule.print_readable

    def counting(self, *args, **kwargs):
        caller = sys._getframe(1).f_code
        if "_functorch" in caller.co_filename:
            names.append(caller.co_name)
        return real(self, *args, **kwargs)
    monkeypatch.setattr(torch.fx.GraphModule, "print_readable", counting)
    return names


def _train():
    """Compile and run forward and backward of a small graph (a joint, a forward and a backward graph); values
    and gradients against eager's."""
    def fn(x, w):
        return (x.sin() @ w).tanh().sum()
    x, w = torch.randn(4, 3, requires_grad=True), torch.randn(3, 2, requires_grad=True)
    out = kiln.compile(fn)(x, w)
    out.backward()
    x0, w0 = x.detach().requires_grad_(), w.detach().requires_grad_()
    expected = fn(x0, w0)
    expected.backward()
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close((x.grad, w.grad), (x0.grad, w0.grad))
    assert torch._functorch.aot_autograd.AOTConfig is AOTConfig   # torch's own again after the compile


def test_no_log_no_graph_text(formatted):
    _train()
    assert formatted == []


def test_torch_logs_aot_graphs_still_formats_and_logs(formatted, capfd):
    torch._logging.set_logs(aot_graphs=True)
    try:
        _train()
    finally:
        torch._logging.set_logs()
    err = capfd.readouterr().err
    assert "Forward graph" in err and "Backward graph" in err, err[-2000:]
    assert len(formatted) >= 3, formatted   # joint, forward, backward: what AOTAutograd's cache would keep


def test_structured_trace_still_has_aot_graphs(formatted):
    with _Entries() as entries:
        _train()
    found = {next(iter(m)): p for m, p in entries.records}
    for name in ("aot_joint_graph", "aot_forward_graph", "aot_backward_graph"):
        assert isinstance(found.get(name), str) and "def forward" in found[name], (name, sorted(found))
    assert len(formatted) >= 3, formatted
