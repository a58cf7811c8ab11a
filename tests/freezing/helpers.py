"""Modules from seed 004 (test_inductor_freezing) and small helpers for the freezing tests."""
import contextlib

import pytest
import torch

import kiln

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def cuda_ok(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")


class ConvBN(torch.nn.Module):
    def __init__(self, in_channels, out_channels, bias=False, **kwargs):
        super().__init__()
        self.conv = torch.nn.Conv2d(in_channels, out_channels, bias=bias, **kwargs)
        self.bn = torch.nn.BatchNorm2d(out_channels, eps=0.001, dtype=torch.float)

    def forward(self, x):
        return self.bn(self.conv(x))


class ConvFunctionalBN(torch.nn.Module):
    def __init__(self, in_channels, out_channels, bias=False, kernel_size=3, stride=2, running_mean=None,
                 running_var=None, weight=None, bn_bias=None):
        super().__init__()
        self.conv = torch.nn.Conv2d(in_channels, out_channels, bias=bias, kernel_size=kernel_size, stride=stride)
        self.running_mean = running_mean
        self.running_var = running_var
        self.weight = weight
        self.bias = bn_bias

    def forward(self, x):
        return torch.nn.functional.batch_norm(self.conv(x), self.running_mean, self.running_var, self.weight,
                                              self.bias, False, 0.1, 1e-5)


class ConvMultiBN(torch.nn.Module):
    def __init__(self, in_channels, out_channels, bias=False, **kwargs):
        super().__init__()
        self.conv = torch.nn.Conv2d(in_channels, out_channels, bias=bias, **kwargs)
        self.bn = torch.nn.BatchNorm2d(out_channels, eps=0.001, dtype=torch.float)
        self.bn2 = torch.nn.BatchNorm2d(out_channels, eps=0.1, dtype=torch.float)

    def forward(self, x):
        tmp = self.bn(self.conv(x))
        tmp2 = self.bn2(self.conv(x))
        return tmp + tmp2


class ConvMultiFunctionalBN(torch.nn.Module):
    def __init__(self, in_channels, out_channels, bias=False, kernel_size=3, stride=2, running_mean=None,
                 running_var=None, weight=None, bn_bias=None, running_mean2=None):
        super().__init__()
        self.conv = torch.nn.Conv2d(in_channels, out_channels, bias=bias, kernel_size=kernel_size, stride=stride)
        self.running_mean = running_mean
        self.running_var = running_var
        self.weight = weight
        self.bias = bn_bias
        self.running_mean2 = running_mean2

    def forward(self, x):
        F = torch.nn.functional
        tmp = F.batch_norm(self.conv(x), self.running_mean, self.running_var, self.weight, self.bias,
                           False, 0.1, 1e-5)
        tmp2 = F.batch_norm(self.conv(x), self.running_mean2, self.running_var, self.weight, self.bias,
                            False, 0.1, 1e-5)
        return tmp + tmp2


def randomize_bn(mod):
    """Give every BatchNorm non-trivial statistics and affine parameters (so folding is visible)."""
    g = torch.Generator().manual_seed(1)
    for m in mod.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            with torch.no_grad():
                m.running_mean.copy_(torch.randn(m.num_features, generator=g))
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.weight.copy_(torch.randn(m.num_features, generator=g))
                m.bias.copy_(torch.randn(m.num_features, generator=g))
    return mod


def compiled(fn, **options):
    """``torch.compile(fn, backend="kiln")`` (options apply on top of the config scope in force)."""
    return torch.compile(fn, backend="kiln", options=options or None)


SEED_CONFIG = dict(freezing=True, freezing_discard_parameters=True)


@contextlib.contextmanager
def seed_config(**extra):
    """The seed's class-level config: freezing with discarded parameters."""
    with kiln.config.patch(**{**SEED_CONFIG, **extra}):
        yield


@pytest.fixture(autouse=True)
def seed_scope():
    """Autouse in the seed test modules (imported there): fresh counters, the seed's config, and
    fp32 CUDA convolutions and matmuls without TF32: kiln's channels-last convolutions may run other
    cuDNN algorithms than eager's NCHW ones, and under TF32 (10-bit mantissa) two algorithms differ
    by about 1e-3, above the seed's 1e-4 tolerances."""
    kiln.counters.clear()
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with seed_config():
            yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def wrapper_code(code):
    """The inference wrapper among ``run_and_get_code``'s sources."""
    wrappers = [c for c in code if c.startswith("# kiln wrapper: inference")]
    assert wrappers, f"no inference wrapper in {len(code)} sources"
    return wrappers[-1]


def calls(src: str, name: str) -> list:
    """Lines of a wrapper source that call something whose global name contains ``name``."""
    return [ln for ln in src.splitlines() if "=" in ln and name in ln.split("=", 1)[1].split("(")[0]]


def aten_graph(fn, *inputs):
    """An ATen graph of ``fn`` in which the tensors it closes over are ``get_attr`` constants."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    with torch.no_grad():
        gm = make_fx(fn)(*inputs)
        mode = FakeTensorMode(allow_non_fake_inputs=True)  # one fake mode for every val, as in AOTAutograd
        FakeTensorProp(gm, mode).propagate(*[mode.from_tensor(t) for t in inputs])
    return gm


def ops(gm, target) -> int:
    """How many nodes of ``gm`` call ``target`` (an OpOverload or an overload packet)."""
    return sum(1 for n in gm.graph.nodes if n.op == "call_function"
               and (n.target == target or getattr(n.target, "overloadpacket", None) == target))
