"""Slow eager entry points are swapped for equal fast functions in generated wrappers."""
import torch

from kiln.codegen.wrapper import broadcast_in_dim


def test_broadcast_in_dim_matches_the_prim_and_is_a_view():
    a = torch.randn(3, 5)
    for shape, dims in [((3, 4, 5), (0, 2)), ((2, 3, 5), (1, 2)), ((3, 5, 1), (0, 1))]:
        ref = torch.ops.prims.broadcast_in_dim.default(a, shape, dims)
        out = broadcast_in_dim(a, shape, dims)
        assert out.shape == ref.shape and out.stride() == ref.stride()
        torch.testing.assert_close(out, ref)
        assert out.data_ptr() == a.data_ptr()
