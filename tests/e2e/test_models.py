"""Values and gradients against eager for the models users write first."""
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.e2e.helpers import check_train
from tests.numerics import assert_close_to_fp64


def _fp64(m):
    """A float64 copy of module ``m`` (the exact reference of ``assert_close_to_fp64``)."""
    import copy
    return copy.deepcopy(m).double()


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.l2(F.gelu(self.l1(x))).log_softmax(-1)


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(x, 2)
        x = F.relu(self.bn2(self.conv2(x))) + x
        return self.fc(x.mean((2, 3)))


class Block(nn.Module):
    """A pre-norm transformer block, attention through SDPA or written out (``sdpa=False``)."""

    def __init__(self, d=32, heads=4, sdpa=True):
        super().__init__()
        self.heads, self.sdpa = heads, sdpa
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # written out: masked scores, softmax, weighted sum
            s = (q @ k.transpose(-1, -2)) / (d // self.heads) ** 0.5
            s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
            y = torch.softmax(s, -1) @ v
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def test_mlp_train():
    check_train(MLP(), [torch.randn(8, 16, requires_grad=True)])


def test_cnn_batchnorm_train_mode():
    check_train(CNN().train(), [torch.randn(2, 3, 8, 8, requires_grad=True)], rtol=1e-4, atol=1e-4)


def test_cnn_batchnorm_eval_mode():
    check_train(CNN().eval(), [torch.randn(2, 3, 8, 8, requires_grad=True)], rtol=1e-4, atol=1e-4)


def test_transformer_block_sdpa():
    check_train(Block(), [torch.randn(2, 8, 32, requires_grad=True)], rtol=1e-4, atol=1e-4)


def test_inference_no_grad():
    import kiln
    m = CNN().eval()
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        ref, exact = m(x), _fp64(m)(x.double())
        out = kiln.compile(m)(x)
    assert_close_to_fp64(out, ref, exact, rtol=1e-4, atol=1e-4)
    assert not out.requires_grad


def test_triton_codegen_on_cpu_block_and_eval_cnn():
    """The fusing target (Triton under the interpreter on CPU) agrees with eager too."""
    check_train(Block(), [torch.randn(2, 8, 32, requires_grad=True)], rtol=1e-4, atol=1e-4,
                codegen="triton")
    check_train(CNN().eval(), [torch.randn(2, 3, 8, 8, requires_grad=True)], rtol=1e-4, atol=1e-4,
                codegen="triton")


def test_eval_batchnorm_fuses_into_kernels_on_the_fusing_target():
    """Eval BatchNorm becomes pointwise work fused with the ReLU and the residual add (torch's
    decomposition of it is not functional on torch 2.11, so kiln brings its own); values match
    eager in float32, and in float16 they are no further from a float64 run than eager's."""
    import kiln

    class Res(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(8, 8, 3, padding=1, bias=False)
            self.bn = nn.BatchNorm2d(8)

        def forward(self, x):
            return F.relu(self.bn(self.conv(x)) + x)

    torch.manual_seed(0)
    m = Res().eval()
    with torch.no_grad():   # statistics that are not the identity
        m.bn.running_mean.uniform_(-1, 1)
        m.bn.running_var.uniform_(0.5, 2)
        m.bn.weight.uniform_(0.5, 1.5)
        m.bn.bias.uniform_(-0.5, 0.5)
    x = torch.randn(2, 8, 6, 6)
    code = []
    with torch.no_grad():
        out, code = kiln.run_and_get_code(kiln.compile(m, codegen="triton"), x)
        assert_close_to_fp64(out, m(x), _fp64(m)(x.double()), rtol=1e-5, atol=1e-5)
    wrapper = next(c for c in code if c.startswith("# kiln wrapper"))
    assert "batch_norm" not in wrapper and wrapper.count("= kiln_") == 1, wrapper

    ref = m.double()(x.double())
    half, xh = Res().eval(), x.half()
    half.load_state_dict(m.state_dict())
    half = half.half()
    with torch.no_grad():
        got = kiln.compile(half, codegen="triton")(xh).double()
        eager = half(xh).double()
    assert (got - ref).abs().max() <= 2 * (eager - ref).abs().max() + 1e-3


@pytest.mark.parametrize("codegen", ["aten", "triton"])
def test_batchnorm_statistics_update_in_the_graph(codegen):
    """Training BatchNorm's running statistics are input mutations kept in the forward graph; the
    wrapper writes them with one foreach copy (the batch counters: one kernel writes both in place, but
    with codegen="aten"), and after three steps every buffer equals eager's."""
    import copy

    import kiln
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4))
    ref, exact = copy.deepcopy(m), _fp64(m)
    f = kiln.compile(m, codegen=codegen)
    for i in range(3):
        x = torch.randn(2, 3, 8, 8)
        exact(x.double())
        if i == 0:
            out, code = kiln.run_and_get_code(f, x)
            fw = next(c for c in code if c.startswith("# kiln wrapper: forward"))
            counters = re.search(r"into=\(primals_\d+, primals_\d+\)\)", fw)
            assert bool(counters) == (codegen == "triton"), fw
            assert fw.count("foreach_copy(") == 1 and f"{4 if counters else 6} input mutations" in fw, fw
            assert fw.count("copy__default") == (2 if counters else 0), fw
        else:
            out = f(x)
        out.sum().backward()
        ref(x).sum().backward()
    for (name, a), b, e in zip(m.state_dict().items(), ref.state_dict().values(), exact.state_dict().values()):
        assert_close_to_fp64(a, b, e, rtol=1e-5, atol=1e-5, msg=name)
    assert int(m[1].num_batches_tracked) == 3


def test_convolution_bias_fuses_into_the_next_kernel():
    """On the fusing target a convolution runs without its bias, which is added in the kernel after
    it (cuDNN would add it in a kernel of its own); values and gradients match eager, frozen too."""
    import kiln

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.bn = nn.BatchNorm2d(8)

        def forward(self, x):
            return F.relu(self.bn(self.conv(x)))

    torch.manual_seed(0)
    m = Net().eval()
    with torch.no_grad():
        m.bn.running_mean.uniform_(-1, 1)
        m.bn.running_var.uniform_(0.5, 2)
    x = torch.randn(2, 3, 8, 8)
    for opts in ({}, {"freezing": True}):
        torch._dynamo.reset()
        with torch.no_grad():
            out, code = kiln.run_and_get_code(kiln.compile(m, codegen="triton", **opts), x)
            assert_close_to_fp64(out, m(x), _fp64(m)(x.double()), rtol=1e-5, atol=1e-5)
        wrapper = next(c for c in code if c.startswith("# kiln wrapper"))
        conv_lines = [line for line in wrapper.splitlines() if "= aten_convolution" in line]
        assert conv_lines and all(", None, [" in line for line in conv_lines), wrapper
        assert wrapper.count("= kiln_") == 1, wrapper
    torch._dynamo.reset()
    check_train(Net().train(), [torch.randn(2, 3, 8, 8, requires_grad=True)], rtol=1e-4, atol=1e-4,
                codegen="triton")
