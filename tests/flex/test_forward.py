"""FlexAttention's forward through kiln's kernels against an fp64 dense reference: the C++ target and
Triton's interpreter, for the mod family (tests/flex/util.py), sequence lengths that the BlockMask's
blocks do not divide, padded head dims, GQA and ``return_lse``. Each compiled graph must hold kiln's
kernel and no dense fallback."""
from __future__ import annotations

import pytest
import torch

from tests.flex.util import Count, block_mask, cases, close, compiled_forward, dense, inputs, kiln, params_of, tol

# name: (B, H, S, D, BlockMask block size, return_lse); Triton's interpreter takes shorter sequences
SHORT = {"causal": 70, "sliding": 70, "document": 60, "prefix_lm": 50, "relbias": 50, "gqa": 70, "none": 40}
SHAPES = {
    "none": (1, 2, 40, 16, 16, False),
    "causal": (2, 2, 100, 32, 32, True),
    "sliding": (1, 2, 130, 16, 32, False),
    "document": (2, 2, 100, 24, 16, False),
    "prefix_lm": (2, 2, 70, 16, 16, False),
    "alibi": (1, 2, 64, 32, 32, True),
    "softcap": (1, 2, 50, 16, 16, False),
    "relbias": (1, 2, 90, 16, 32, False),
    "gqa": (2, 4, 100, 16, 32, True),
}


# the interpreter's forward of the other mods is checked by test_backward.py (values and lse)
PAIRS = [("cpp", n) for n in SHAPES] + [("triton", n) for n in ("none", "sliding", "prefix_lm", "gqa")]


@pytest.mark.parametrize("target,name", PAIRS)
def test_forward(target, name):
    B, H, S, D, bs, lse = SHAPES[name]
    S = SHORT.get(name, S) if target == "triton" else S
    case = cases(S, H)[name]
    p = params_of(case, grad=False)
    q, k, v = inputs(B, H, S, D, case.hkv)
    bm = block_mask(case, p, B, H, S, bs)
    with torch.no_grad(), kiln.config.patch(codegen=target), Count() as c:
        got = compiled_forward(case, p, bm, return_lse=lse, gqa=bool(case.hkv))(q, k, v)
    want = dense(q.double(), k.double(), v.double(), case, params_of(case, torch.float64, grad=False))
    if lse:
        close(got[0], want[0], tol(S, D))
        close(got[1], want[1], tol(S, D))
    else:
        close(got, want[0], tol(S, D))
    assert c.kernels == {"flex_cpp" if target == "cpp" else "flex": 1}, (c.kernels, c.fallbacks)
    assert not c.fallbacks


def test_kernel_options_and_fully_masked_rows():
    """Block sizes from kernel_options (here smaller than the mask's blocks); rows whose every key is
    masked give zeros and a log-sum-exp of -inf, as eager's."""
    B, H, S, D = 1, 2, 48, 16
    keep = lambda b, h, q, kv: (q >= kv) & (q % 7 != 3)  # noqa: E731
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from tests.flex.util import Case
    bm = create_block_mask(keep, B, H, S, S, device="cpu", BLOCK_SIZE=32)
    q, k, v = inputs(B, H, S, D)

    def fn(q, k, v):
        return flex_attention(q, k, v, block_mask=bm, return_lse=True, kernel_options={"BLOCK_M": 16, "BLOCK_N": 16})
    with torch.no_grad(), kiln.config.patch(codegen="triton"), Count() as c:
        out, lse = torch.compile(fn, backend="kiln")(q, k, v)
    ref_out, ref_lse = dense(q.double(), k.double(), v.double(), Case("m", mask=lambda p: keep), {})
    close(out, ref_out, tol(S, D))
    dead = (torch.arange(S) % 7) == 3
    assert torch.all(out[:, :, dead] == 0) and torch.all(torch.isneginf(lse[:, :, dead]))
    close(lse[:, :, ~dead], ref_lse[:, :, ~dead], tol(S, D))
    assert c.kernels == {"flex": 1}


def test_untranslatable_mod_falls_back_with_reason():
    """A score_mod op kiln cannot write (a sort) keeps FlexAttention's dense implementation, counted."""
    B, H, S, D = 1, 2, 32, 16
    table = torch.randn(8)

    def weird(s, b, h, q, kv):
        return s + torch.sort(table)[0][h]
    from torch.nn.attention.flex_attention import flex_attention
    q, k, v = inputs(B, H, S, D)
    with torch.no_grad(), kiln.config.patch(codegen="triton"), Count() as c:
        got = torch.compile(lambda q, k, v: flex_attention(q, k, v, score_mod=weird), backend="kiln")(q, k, v)
    torch.testing.assert_close(got, flex_attention(q, k, v, score_mod=weird), atol=1e-5, rtol=1e-5)
    assert c.fallbacks == {"flex_attention": 1} and not c.kernels


@pytest.mark.parametrize("qlen", [1, 3])
def test_decoding_split_kv(qlen):
    """A few query tokens over a 300-long cache take the split-KV decoding pair (interpreter), GQA heads sharing
    a program, a per-sequence cache length in a captured tensor, and the log-sum-exp."""
    from tests.flex.util import Case
    from torch.nn.attention.flex_attention import create_block_mask
    B, HQ, HKV, S, D = 2, 4, 2, 300, 16
    lens = torch.tensor([300, 77])
    case = Case("cache", mask=lambda p: lambda b, h, q, kv: kv < p["lens"][b] - q, params={"lens": lens})
    q = torch.randn(B, HQ, qlen, D)
    k, v = torch.randn(B, HKV, S, D), torch.randn(B, HKV, S, D)
    bm = create_block_mask(case.mask(case.params), B, None, qlen, S, device="cpu", BLOCK_SIZE=64)
    with torch.no_grad(), kiln.config.patch(codegen="triton"), Count() as c:
        out, lse = compiled_forward(case, case.params, bm, return_lse=True, gqa=True)(q, k, v)
    ref, ref_lse = dense(q.double(), k.double(), v.double(), case, case.params)
    close(out, ref, tol(S, D))
    close(lse, ref_lse, tol(S, D))
    assert c.kernels == {"flex_decode": 1}, c.kernels
