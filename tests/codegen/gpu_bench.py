"""Time kiln's fused kernels against eager on CUDA: python -m tests.codegen.gpu_bench"""
import torch
import torch.nn.functional as F
from triton.testing import do_bench

from tests.codegen.test_pointwise import gelu_bias
from tests.codegen.test_reduction import layer_norm, rms_norm
from tests.codegen.util import fused


def bench(name, fn, *args, **opts):
    gm, n = fused(fn, *args, **opts)
    gm(*args)
    t_eager = do_bench(lambda: fn(*args))
    t_kiln = do_bench(lambda: gm(*args))
    nbytes = sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))
    print(f"{name:28s} kernels={n}  eager {t_eager * 1e3:8.1f} us  kiln {t_kiln * 1e3:8.1f} us  "
          f"speedup {t_eager / t_kiln:5.2f}x  inputs {nbytes / 2**20:.0f} MiB")


if __name__ == "__main__":
    d = "cuda"
    bench("gelu_bias 16M fp32", gelu_bias, torch.randn(1 << 24, device=d), torch.randn(1 << 24, device=d))
    x = torch.randn(8192, 1024, device=d, dtype=torch.bfloat16)
    w, b = torch.randn(1024, device=d, dtype=torch.bfloat16), torch.randn(1024, device=d, dtype=torch.bfloat16)
    bench("layer_norm 8192x1024 bf16", layer_norm, x, w, b)
    bench("rms_norm 8192x1024 bf16", rms_norm, x, w)
    bench("softmax 8192x1024 bf16", lambda x: torch.softmax(x, -1), x)
    x32 = torch.randn(4096, 32000, device=d)
    t = torch.randint(0, 32000, (4096,), device=d)
    bench("cross_entropy 4096x32000", lambda x, t: F.cross_entropy(x, t), x32, t)
    bench("layer_norm 64x65536 fp32 (looped)", layer_norm, torch.randn(64, 65536, device=d),
          torch.randn(65536, device=d), torch.randn(65536, device=d))
    g = torch.randn(65536, 512, device=d)
    bench("column sum 65536x512", lambda g: g.sum(0), g)
    bench("column sum (autotuned)", lambda g: g.sum(0), g, max_autotune=True)
    bench("sum of 64M", lambda g: g.sum(), torch.randn(1 << 26, device=d))
    bench("ln bwd 16384x1024 (w, b grads)", lambda g, x: ((g * x).sum(0), g.sum(0)), torch.randn(16384, 1024, device=d),
          torch.randn(16384, 1024, device=d))
    from kiln.runtime import launch
    print("autotuned:", launch._TUNED)
