"""drop_empty_masks: an attention mask built from constants that masks nothing is dropped before AOTAutograd
(SDPA may then pick its flash kernel); any other mask stays, and values match eager either way."""
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.debug import observe


def _sdpa_masks(stage="pre_grad"):
    """Observer collecting, for each graph after ``stage``, whether each SDPA call there has a mask."""
    seen = []

    def fn(event, data):
        if event == "graph" and data["stage"] == stage:
            for n in data["gm"].graph.nodes:
                if n.target is F.scaled_dot_product_attention:
                    m = n.kwargs.get("attn_mask", n.args[3] if len(n.args) > 3 else None)
                    seen.append(m is not None)
    return fn, seen


def _qkv(grad):
    torch.manual_seed(0)
    return [torch.randn(2, 4, 16, 8, requires_grad=grad) for _ in range(3)]


def _ones_mask(q, dtype):
    """transformers' legacy encoder mask for a call without attention_mask: zeros, from torch.ones."""
    m = torch.ones(q.shape[0], q.shape[2])[:, None, None, :].expand(q.shape[0], 1, q.shape[2], q.shape[2])
    inv = torch.tensor(1.0, dtype=dtype) - m.to(dtype)
    return inv.masked_fill(inv.to(torch.bool), torch.finfo(dtype).min)


def _run(f, args, **opts):
    torch._dynamo.reset()
    fn, seen = _sdpa_masks()
    with observe(fn):
        out = kiln.compile(f, **opts)(*args)
    ref = f(*args)
    torch.testing.assert_close(out, ref)
    if ref.requires_grad:
        g = torch.randn_like(ref)
        got = torch.autograd.grad(out, args, g)
        want = torch.autograd.grad(ref, args, g)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
    return seen


@pytest.mark.parametrize("grad", [False, True])
def test_a_constant_mask_of_zeros_is_dropped(grad):
    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_ones_mask(q, q.dtype)) * 2
    assert _run(f, _qkv(grad)) == [False]


def test_a_constant_boolean_mask_of_true_is_dropped_positional_too():
    def f(q, k, v):
        keep = torch.arange(q.shape[2])[:, None] >= 0          # all True, from a constructor
        return F.scaled_dot_product_attention(q, k, v, keep)
    assert _run(f, _qkv(False)) == [False]


def test_masks_that_mask_something_or_read_inputs_stay():
    def causal(q, k, v):
        n = q.shape[2]
        return F.scaled_dot_product_attention(q, k, v, torch.ones(n, n, dtype=torch.bool).tril())

    def from_input(q, k, v, pad):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=pad[:, None, None, :])

    def written_after(q, k, v):   # the write comes after the ones: evaluating the ones alone would be wrong
        m = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool)
        m[0, 1:] = False
        return F.scaled_dot_product_attention(q, k, v, m)
    args = _qkv(False)
    assert _run(causal, args) == [True]
    pad = torch.ones(2, 16, dtype=torch.bool)
    pad[1, 10:] = False
    assert _run(from_input, args + [pad]) == [True]
    assert _run(written_after, args) == [True]


def test_the_option_turns_it_off_and_the_byte_limit_is_kept():
    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_ones_mask(q, q.dtype))
    args = _qkv(False)
    assert _run(f, args, drop_empty_masks=False) == [True]
    assert _run(f, args, **{"tuning.empty_mask_max_bytes": 100}) == [True]
    assert _run(f, args, **{"tuning.empty_mask_max_bytes": 2 * 16 * 16 * 4}) == [False]
