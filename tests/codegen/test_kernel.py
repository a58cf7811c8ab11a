"""Kernel objects: naming, caching and deduplication, dynamic sizes, the interpreter switch."""
import os

import torch
import torch.nn.functional as F

from kiln.runtime.kernels import interpret_mode
from kiln.options import Options
from tests.codegen.util import check, fuse_graph, fused, kernels


def test_kernel_interface():
    gm, n = fused(lambda x, y: (x * y).sin(), torch.randn(16), torch.randn(16))
    (k,) = kernels(gm)
    assert n == 1 and k.name.isidentifier() and "@triton.jit" in k.source and f"def {k.name}(" in k.source
    node = next(nd for nd in gm.graph.nodes if nd.target is k)
    assert node.meta["val"].shape == (16,)
    x, y = torch.randn(16), torch.randn(16)
    torch.testing.assert_close(k(x, y), (x * y).sin())


def test_identical_layers_share_one_kernel():
    ws = [torch.randn(32, 32) / 6 for _ in range(12)]

    def model(x, *ws):
        for w in ws:   # matmuls stay ATen calls, so each layer's norm + gelu is its own kernel
            x = torch.mm(F.gelu(F.layer_norm(x, (32,))), w)
        return x
    gm = check(model, torch.randn(4, 32), *ws, atol=1e-4, rtol=1e-4)
    ks = kernels(gm)
    # one call site per layer (each with its own ATen fallback), all sharing one compiled Kernel
    assert len(ks) == 12 and len({id(k.kernel) for k in ks}) == 1


def test_row_local_layers_fuse_into_one_kernel():
    ws = [torch.randn(32) for _ in range(4)]

    def model(x, *ws):
        for w in ws:
            x = F.gelu(F.layer_norm(x, (32,), w, None)) + x
        return x
    check(model, torch.randn(4, 32), *ws, n_kernels=1, atol=1e-4, rtol=1e-4)


def test_dynamic_sizes_are_kernel_arguments():
    def fn(x, w):
        return F.layer_norm(x * 2, (x.shape[-1],), w, None), (x + 1).sum(0)
    gm = check(fn, torch.randn(5, 16), torch.randn(16), mode="symbolic", atol=1e-4, rtol=1e-4)
    for shape in [(7, 16), (2, 40)]:
        x, w = torch.randn(*shape), torch.randn(shape[1])
        out = gm(x, w)
        torch.testing.assert_close(out[0], F.layer_norm(x * 2, (shape[1],), w, None), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out[1], (x + 1).sum(0), atol=1e-4, rtol=1e-4)


def test_codegen_option_modes():
    from torch.fx.experimental.proxy_tensor import make_fx
    gm = make_fx(lambda x: x.sin() + 1, tracing_mode="fake")(torch.randn(4))
    from kiln.codegen.target import resolve
    assert fuse_graph(gm, [torch.randn(4)], Options(codegen="aten")).kernels == 0
    assert resolve(Options(codegen="auto"), [torch.randn(4)]).name in ("cpp", "aten")   # a CPU graph: no Triton
    assert fuse_graph(gm, [torch.randn(4)], Options(codegen="triton")).kernels == 1


def test_interpret_mode_restores_environment():
    before = os.environ.get("TRITON_INTERPRET")
    with interpret_mode(True):
        assert os.environ["TRITON_INTERPRET"] == "1"
    assert os.environ.get("TRITON_INTERPRET") == before


def test_input_with_unexpected_strides_is_copied():
    gm, _ = fused(lambda x: x * 2, torch.randn(4, 6))
    x = torch.randn(6, 4).t()          # same shape, transposed strides
    torch.testing.assert_close(gm(x), x * 2)


def test_multi_output_kernel_getitems():
    def fn(x):
        y = x.exp()
        return y + 1, y * 2, y.sum(1)
    gm = check(fn, torch.randn(4, 8), n_kernels=1)
    getitems = [n for n in gm.graph.nodes if n.target.__name__ == "getitem"] if False else \
        [n for n in gm.graph.nodes if "getitem" in str(n.target)]
    assert len(getitems) == 3
