"""``create_block_mask`` compiled by kiln (a vmapped mask_mod, then reductions, sorts and casts): the
BlockMask's tensors equal eager's, whether the user compiles ``create_block_mask`` itself or calls it
with ``_compile=True`` inside a compiled function; and the flex bench suite's CPU case runs."""
from __future__ import annotations

import warnings

import torch
from torch.nn.attention.flex_attention import create_block_mask

import kiln
from kiln.debug import counters


def _mask(S):
    doc = (torch.arange(S) // 70).to(torch.int32)

    def mask(b, h, q, kv):
        return (doc[q] == doc[kv]) & (q >= kv) & (q - kv < 100 + h)
    return mask


def _same(want, got):
    for a, b in zip(want.as_tuple()[:-1], got.as_tuple()[:-1]):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), (a, b)
        else:
            assert a == b


def test_create_block_mask_compiled():
    B, H, S = 2, 2, 200
    mask = _mask(S)
    want = create_block_mask(mask, B, H, S, S, device="cpu", BLOCK_SIZE=32)
    before = counters["fallback"]["eager_graphs"]
    with kiln.config.patch(codegen="cpp"):
        got = torch.compile(create_block_mask, backend="kiln")(mask, B, H, S, S, device="cpu", BLOCK_SIZE=32)
        _same(want, got)
        torch._dynamo.reset()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            fn = torch.compile(lambda: create_block_mask(mask, B, H, S, S, device="cpu", BLOCK_SIZE=32, _compile=True),
                               backend="kiln")
            _same(want, fn())
    assert counters["fallback"]["eager_graphs"] == before


def test_flex_suite_cpu_case_runs():
    from kiln_bench.suites.flex import CASES
    case = next(c for c in CASES if c.name == "flex_doc_causal_cpu")
    wl = case.build("cpu", "fp32", "tiny")
    want = wl.check(wl.model)
    with kiln.config.patch(codegen="cpp"):
        got = wl.check(torch.compile(wl.model, backend="kiln"))
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    assert {c.name for c in CASES} == {"flex_doc_causal", "flex_sliding_8k", "flex_decode", "flex_doc_causal_cpu"}
