"""``no_random``: every kind of dropout probability is 0 inside the scope and restored after it."""
import pytest
import torch
import torch.nn as nn

from kiln_bench.dropout import RandomOpsLeftError, no_random, random_sites
from tests.bench.dropnet import DropNet, build

KINDS = [nn.Dropout(0.1), nn.Dropout1d(0.2), nn.Dropout2d(0.3), nn.Dropout3d(0.4), nn.AlphaDropout(0.5),
         nn.FeatureAlphaDropout(0.6)]


def _probs(m: DropNet) -> dict:
    return {"drop.p": m.drop.p, "path.drop_prob": m.path.drop_prob, "depth.p": m.depth.p,
            "attn.attention_dropout": m.attn.attention_dropout, "config.hidden_dropout": m.config.hidden_dropout}


def test_every_kind_is_zeroed_and_restored():
    m = DropNet()
    before = _probs(m)
    assert all(v > 0 for v in before.values())
    assert sorted(w for *_, w in random_sites(m)) == sorted(
        ["drop.p", "path.drop_prob", "depth.p", "attn.attention_dropout", "DropNet.config.hidden_dropout"])
    with no_random(m) as n:
        assert n == 5
        assert set(_probs(m).values()) == {0.0}
        assert random_sites(m) == []
        assert m.config.eps == 1e-5 and m.bn.eps == 1e-5      # other floats are no dropout
    assert _probs(m) == before


def test_torch_dropout_modules_and_multihead_attention():
    seq = nn.Sequential(*KINDS, nn.MultiheadAttention(8, 2, dropout=0.25))
    with no_random(seq) as n:
        assert n == len(KINDS) + 1
        assert [k.p for k in KINDS] == [0.0] * len(KINDS) and seq[-1].dropout == 0.0
        assert all(k.inplace is False for k in KINDS)          # bools are left alone
    assert [k.p for k in KINDS] == [0.1, 0.2, 0.3, 0.4, 0.5, 0.6] and seq[-1].dropout == 0.25


def test_restored_when_the_scope_raises():
    m = DropNet()
    with pytest.raises(ValueError):
        with no_random(m):
            raise ValueError("check failed")
    assert _probs(m)["path.drop_prob"] == 0.2 and m.drop.p == 0.1


def test_the_scope_makes_training_deterministic_without_eval_mode():
    """Inside the scope two training forwards agree and match the model with its probabilities set to 0 by
    hand, BatchNorm still in training mode (batch statistics); outside they differ."""
    wl = build()
    a, b = wl.fresh(), wl.fresh()
    x = wl.inputs[0]
    with no_random(a.model):
        one, two = a.model(x), a.model(x)
    assert torch.equal(one, two) and a.model.bn.training
    for mod, name in [(b.model.drop, "p"), (b.model.path, "drop_prob"), (b.model.depth, "p"),
                      (b.model.attn, "attention_dropout"), (b.model.config, "hidden_dropout")]:
        setattr(mod, name, 0.0)
    torch.testing.assert_close(one, b.model(x), rtol=0, atol=0)
    torch.manual_seed(1)
    r1 = a.model(x)
    r2 = a.model(x)
    assert not torch.equal(r1, r2)


def test_check_runs_without_dropout_and_steps_with_it():
    wl = build()
    seen = []

    def f(x):
        seen.append(len(random_sites(wl.model)))
        return wl.model(x)
    wl.check(f)
    wl.step(f)
    assert seen == [0, 5]


class _Stuck(nn.Module):
    """A probability that ignores assignment."""

    def __init__(self):
        super().__init__()
        self.__dict__["drop_rate"] = 0.3

    def __setattr__(self, k, v):
        if k != "drop_rate":
            super().__setattr__(k, v)


def test_a_probability_that_stays_on_is_an_error():
    m = _Stuck()
    with pytest.raises(RandomOpsLeftError, match="drop_rate"):
        with no_random(m):
            pass
    assert m.drop_rate == 0.3


def test_plain_functions_have_no_sites():
    with no_random(torch.sin) as n:
        assert n == 0
