"""A kernel call whose inputs have their recorded layouts at run time (kernel outputs, graph inputs, views of
these) passes ``known=True`` and its launcher skips the stride checks; any other input (a backward's tangent)
keeps them, and a tangent in another layout is restrided and gives eager's gradients."""
import re

import pytest
import torch

import kiln
from kiln.codegen.text import launcher


def f(x, w):
    y = torch.relu(x @ w)
    return (y * 2).sum(-1, keepdim=True) * y + y.t().contiguous()[0]


@pytest.mark.parametrize("codegen", ["cpp", "triton"])
def test_known_layouts(codegen):
    torch.manual_seed(0)
    x = torch.randn(16, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)
    torch._dynamo.reset()
    c = torch.compile(f, backend="kiln", options={"codegen": codegen})
    g = torch.randn(16, 16).t()   # the backward's tangent in the layout the caller made: transposed

    def step():
        out = c(x, w)
        out.backward(g)
        return out
    out, code = kiln.run_and_get_code(step)
    src = "\n".join(code)
    calls = [ln for ln in src.splitlines() if re.search(r"= kiln_\w+\(", ln)]
    known = [ln for ln in calls if "known=True" in ln]
    assert known, src                       # the forward's kernels read kernel outputs and matmul results
    assert "if not known:" in src           # launchers still check when not told
    xe, we = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = f(xe, we)
    ref.backward(g)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, xe.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(w.grad, we.grad, rtol=1e-4, atol=1e-4)
    backward = src.split("kiln wrapper: backward")[1]
    tangent_calls = [ln for ln in backward.splitlines() if "tangents_1" in ln and re.search(r"kiln_\w+\(", ln)]
    assert tangent_calls and all("known=True" not in ln for ln in tangent_calls), tangent_calls


def test_layouts_of_static_inputs_only():
    import sympy

    class B:
        def __init__(self, shape, stride):
            self.shape, self.stride = shape, stride
    s = sympy.Symbol("s0")
    bufs = {"a": B((4, 8), (8, 1)), "b": B((s, 8), (8, 1))}
    assert launcher.layouts(["a", "b"], bufs) == (((4, 8), (8, 1)), None)
    assert launcher.layouts(["b"], bufs) == ()
    lines = launcher.restrides(["a", "b"], bufs, "fix")
    assert lines[0] == "if not known:" and "in0.stride() != (8, 1, )" in lines[1]
    assert launcher.restrides(["b"], bufs, "fix") == []
