"""Under fresh caches every compiled row starts cold: its own Triton and kernel directories, and kiln
forgets the kernels it built for earlier rows."""
import os

from kiln_bench import backends as B
from kiln.runtime import kernels as kernel


def test_each_row_gets_cold_caches():
    with B.fresh_caches(True) as root:
        kernel._CACHE["kiln_pw_dummy"] = object()
        with B.scope("kiln", 0.5):
            first = os.environ["TRITON_CACHE_DIR"], os.environ["KILN_KERNEL_DIR"]
            assert "kiln_pw_dummy" not in kernel._CACHE
        with B.scope("inductor"):
            second = os.environ["TRITON_CACHE_DIR"], os.environ["KILN_KERNEL_DIR"]
        assert first != second and all(p.startswith(root) for p in first + second)
        with B.scope("eager"):
            assert os.environ["TRITON_CACHE_DIR"] == os.path.join(root, "triton")
    assert B.FRESH_ROOT not in os.environ
