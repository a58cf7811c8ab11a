"""FlexAttention's GPU kernels compile for sm_90, checked on the CPU: the modules are generated as for CUDA
(``emit_for='cuda'``), their ``call`` runs with launches recorded instead of run, and every launch goes
through Triton's frontend and ``ptxas`` for sm_90 at the sizes the H100 defaults pick (bf16, head dims
64/128/256; fp32; the split-KV decoding pair). A kernel whose shared memory would not fit an H100 fails."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from tests.flex.util import block_mask, cases, compiled_forward, compiled_hop, inputs, kiln, params_of

H100_SHARED = 232448   # bytes of shared memory one block may use on an H100


def _toolchain_missing():
    try:
        import triton
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except Exception as e:  # pragma: no cover - environment
        return f"triton is not importable ({e})"
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    return None if os.path.exists(ptxas) or shutil.which("ptxas") else "no ptxas"


pytestmark = pytest.mark.skipif(_toolchain_missing() is not None, reason=str(_toolchain_missing()))


def _sources(fn, *args):
    _, sources = kiln.run_and_get_code(fn, *args)
    return [s for s in sources if s.startswith("# kiln generated kernel (FlexAttention)")]


def _compile_launches(source: str, args) -> list:
    """Import ``source`` compiled-mode, record its launches on ``args`` and compile each for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from kiln.runtime.kernels import cache_dir, import_file, module_file
    name = "flexcheck_" + str(abs(hash(source)))
    folder = os.path.join(cache_dir(), "check")
    os.makedirs(folder, exist_ok=True)
    mod = import_file(name, module_file(name, source, folder, True), interpret=False)
    launches = []
    mod._run = lambda fn, grid, nt, a, blocks, warps, stages: launches.append((fn, a, blocks, warps, stages))
    mod.call(*args)
    done = []
    for fn, a, blocks, warps, stages in launches:
        sig, values = {}, iter(a)
        for n in fn.arg_names:
            if n in blocks:
                sig[n] = "constexpr"
                continue
            x = next(values)
            sig[n] = ("*" + {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
                             torch.int32: "i32", torch.int64: "i64"}[x.dtype]) if isinstance(x, torch.Tensor) else "i32"
        opts = {"num_warps": warps, "num_stages": stages}
        k = triton.compile(triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=blocks),
                           target=GPUTarget("cuda", 90, 32), options=opts)
        assert k.metadata.shared <= H100_SHARED, (fn.__name__, k.metadata.shared)
        done.append(fn.__name__)
    return done


def _mask_args(bm, backward=True):
    return [bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
            bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices]


@pytest.mark.slow   # 15-30 s each: ptxas on the forward and backward kernels (pytest -m slow)
@pytest.mark.parametrize("dtype,D,name", [(torch.bfloat16, 64, "document"), (torch.bfloat16, 128, "relbias"),
                                          (torch.bfloat16, 256, "alibi"), (torch.float32, 64, "softcap")])
def test_training_kernels_compile_for_sm90(dtype, D, name):
    B, H, S = 1, 2, 256
    case = cases(S, H)[name]
    p = params_of(case)
    q, k, v = inputs(B, H, S, D, dtype=dtype, grad=True)
    bm = block_mask(case, p, B, H, S, 128) or block_mask(cases(S, H)["causal"], p, B, H, S, 128)

    def run(q, k, v):
        out, lse = compiled_hop(case, p, bm, q, k, v)(q, k, v)
        out.float().sum().backward()
    with kiln.config.patch(codegen="triton", emit_for="cuda"):
        fwd, bwd = _sources(run, q, k, v)
    bufs = [p[n] for n in case.params]
    out = torch.empty_like(q)
    lse = torch.zeros(B, H, S)
    names = _compile_launches(fwd, [q.detach(), k.detach(), v.detach()] + _mask_args(bm, False) + bufs)
    assert len(names) == 1
    names = _compile_launches(bwd, [q.detach(), k.detach(), v.detach(), out, lse, torch.randn_like(out), None]
                              + _mask_args(bm, True) + bufs)
    assert [n.rsplit("_", 1)[-1] for n in names] == ["pre", "dqkv"]


def test_decoding_kernels_compile_for_sm90():
    B, H, S, D = 2, 8, 1024, 128
    case = cases(S, H)["sliding"]
    q = torch.randn(B, H, 1, D, dtype=torch.bfloat16)
    k, v = (torch.randn(B, 2, S, D, dtype=torch.bfloat16) for _ in range(2))
    from torch.nn.attention.flex_attention import create_block_mask
    bm = create_block_mask(lambda b, h, q_, kv: kv > S - 300 + q_, None, None, 1, S, device="cpu")
    with torch.no_grad(), kiln.config.patch(codegen="triton", emit_for="cuda"):
        fwd, = _sources(compiled_forward(case, {}, bm, gqa=True), q, k, v)
    assert "_combine" in fwd
    names = _compile_launches(fwd, [q, k, v] + _mask_args(bm, False))
    assert len(names) == 2 and names[1].endswith("_combine")
