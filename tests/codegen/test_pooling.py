"""Max pooling on the fusing target: kiln's decomposition into the running maximum of strided
window slices gives ATen's values, flat indices (first maximum on ties, NaN wins) and gradients."""
import pytest
import torch
import torch.nn.functional as F

import kiln


def _pool(x, k=3, s=2, p=1):
    y, i = F.max_pool2d(torch.relu(x), k, s, p, return_indices=True)
    return y * 2, i


@pytest.mark.parametrize("shape,k,s,p,cl", [((2, 4, 9, 9), 3, 2, 1, False), ((2, 4, 8, 8), 3, 2, 1, True),
                                            ((1, 3, 6, 7), 2, 2, 0, False), ((1, 2, 7, 5), 3, 1, 1, False)])
def test_max_pool_matches_eager_values_indices_and_grads(shape, k, s, p, cl):
    torch._dynamo.reset()
    torch.manual_seed(0)
    x = torch.randn(shape)
    if cl:
        x = x.to(memory_format=torch.channels_last)
    x.requires_grad_(True)

    def f(x):
        return _pool(x, k, s, p)
    (out, idx), code = kiln.run_and_get_code(kiln.compile(f, codegen="triton"), x)
    ref, ref_idx = f(x)
    assert torch.equal(idx, ref_idx)   # relu's zeros make many ties
    torch.testing.assert_close(out, ref)
    assert out.stride() == ref.stride()
    g, = torch.autograd.grad(out.sum(), x)
    rg, = torch.autograd.grad(ref.sum(), x)
    torch.testing.assert_close(g, rg)
    forward = next(c for c in code if c.startswith("# kiln wrapper: forward"))
    assert "max_pool" not in forward, forward


def test_max_pool_nan_wins_and_inference_fuses():
    torch._dynamo.reset()
    x = torch.randn(1, 2, 6, 6)
    x[0, 1, 2, 3] = float("nan")
    x[0, 0, 4, 4] = float("nan")
    with torch.no_grad():
        out, code = kiln.run_and_get_code(kiln.compile(lambda x: F.max_pool2d(x, 3, 2, 1), codegen="triton"), x)
        torch.testing.assert_close(out, F.max_pool2d(x, 3, 2, 1), equal_nan=True)
    wrapper = next(c for c in code if c.startswith("# kiln wrapper"))
    assert "max_pool" not in wrapper and wrapper.count("= kiln_") <= 2, wrapper


def test_dilated_pools_keep_the_aten_kernel():
    torch._dynamo.reset()
    x = torch.randn(1, 2, 9, 9)
    with torch.no_grad():
        out, code = kiln.run_and_get_code(kiln.compile(lambda x: F.max_pool2d(x, 3, 2, 1, dilation=2),
                                                       codegen="triton"), x)
    torch.testing.assert_close(out, F.max_pool2d(x, 3, 2, 1, dilation=2))
    assert "max_pool2d_with_indices" in next(c for c in code if c.startswith("# kiln wrapper"))


@pytest.mark.parametrize("hw,k,s,p", [((8, 8), 3, 2, 0), ((9, 10), 3, 2, 0), ((7, 7), 3, 2, 1), ((6, 5), 2, 2, 0),
                                      ((5, 5), 3, 3, 1), ((55, 55), 3, 2, 0)])
def test_ceil_mode_pools_fuse_and_match_eager(hw, k, s, p):
    """SqueezeNet's pools (ceil_mode=True): the last window hangs over the edge; values, indices and
    gradients are eager's, and inference stores no int64 indices (the ATen kernel allocated them)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    x = torch.relu(torch.randn(2, 3, *hw)).requires_grad_(True)

    def f(x):
        return F.max_pool2d(x, k, s, p, ceil_mode=True, return_indices=True)
    (out, idx), code = kiln.run_and_get_code(kiln.compile(f, codegen="triton"), x)
    ref, ref_idx = f(x)
    assert out.shape == ref.shape and torch.equal(idx, ref_idx)
    torch.testing.assert_close(out, ref)
    go = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, x, go)[0], torch.autograd.grad(ref, x, go)[0])
    assert "max_pool" not in next(c for c in code if c.startswith("# kiln wrapper: forward"))
    torch._dynamo.reset()
    with torch.no_grad():
        out, code = kiln.run_and_get_code(kiln.compile(lambda x: F.max_pool2d(x, k, s, p, ceil_mode=True),
                                                       codegen="triton"), x)
    torch.testing.assert_close(out, F.max_pool2d(x, k, s, p, ceil_mode=True))
    wrapper = next(c for c in code if c.startswith("# kiln wrapper"))
    assert "max_pool" not in wrapper and "i64" not in wrapper, wrapper


def test_max_pool_window_of_minus_infinity_points_inside_the_input():
    """A border window whose real values are all -inf: the index is its first real element, as
    ATen's (a padded position would send the backward's gradient out of bounds)."""
    torch._dynamo.reset()
    x = torch.randn(1, 2, 6, 6)
    x[:, :, :2, :2] = float("-inf")
    x.requires_grad_(True)

    def f(x):
        return F.max_pool2d(x, 3, 2, 1, return_indices=True)
    (out, idx), _ = kiln.run_and_get_code(kiln.compile(f, codegen="triton"), x)
    ref, ref_idx = f(x)
    assert torch.equal(idx, ref_idx) and idx.min() >= 0
    torch.testing.assert_close(out, ref)
    g, = torch.autograd.grad(out[out.isfinite()].sum(), x)
    rg, = torch.autograd.grad(ref[ref.isfinite()].sum(), x)
    torch.testing.assert_close(g, rg)


def test_max_pool_gradients_through_the_decomposed_forward():
    """Gradients through kiln's pooling (its indices feed the backward, which the partitioner may
    recompute from the input) equal eager's."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    for shape, k, s, p in [((2, 4, 9, 9), 3, 2, 1), ((1, 3, 6, 7), 2, 2, 0), ((1, 2, 7, 5), 3, 1, 1)]:
        x = torch.randn(shape, requires_grad=True)

        def f(x):
            return F.max_pool2d(torch.relu(x), k, s, p) * 2
        out = kiln.compile(f, codegen="triton")(x)
        go = torch.randn_like(out)
        g, = torch.autograd.grad(out, x, go)
        rg, = torch.autograd.grad(f(x), x, go)
        torch.testing.assert_close(g, rg)
        torch._dynamo.reset()


@pytest.mark.parametrize("codegen", ["cpp", "triton"])
def test_symbolic_heights_and_widths_keep_one_pool_node_that_fuses(codegen):
    """Height and width symbolic (the fully dynamic CNN): the decomposition declines (its ~80 ops cost seconds
    of symbolic-shape tracing a graph, #35) and the one ``max_pool2d_with_indices`` node lowers to the same
    fused running maximum: ATen's values, indices (ties, NaN, an all -inf padded window) and gradients at two
    sizes of one compile, no ATen pool call in the forward."""
    f, graphs = kiln.compile(_pool, dynamic=True, codegen=codegen), torch._dynamo.utils.counters["stats"]
    for n, shape in enumerate([(2, 3, 9, 8), (3, 2, 7, 10)]):
        x = torch.randn(shape)
        x[0, 0, :2, :2], x[0, 1, 3, 3] = float("-inf"), float("nan")
        x.requires_grad_(True)
        if n == 0:   # Dynamo reset, then one compile
            (out, idx), code = kiln.run_and_get_code(f, x)
            before = graphs["unique_graphs"]
        else:
            out, idx = f(x)
        ref, ref_idx = _pool(x)
        assert torch.equal(idx, ref_idx)
        torch.testing.assert_close(out, ref, equal_nan=True)
        go = torch.randn_like(out)
        torch.testing.assert_close(torch.autograd.grad(out, x, go)[0], torch.autograd.grad(ref, x, go)[0],
                                   equal_nan=True)
    assert graphs["unique_graphs"] == before, "one compile serves both sizes"
    forward = next(c for c in code if c.startswith("# kiln wrapper: forward"))
    assert "max_pool" not in forward, forward
    joint = [g for stage, g in kiln.explain(f, x) if stage == "joint"][-1]
    assert joint.count("max_pool2d_with_indices.default(") == 1 and "isnan" not in joint, joint
