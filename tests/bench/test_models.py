"""Built-in models and model workloads: shapes, finite losses, optimizer steps on fresh copies."""
import torch

from kiln_bench import models
from kiln_bench.suites import models as suite
from kiln_bench.suites import select


def test_gpt_tiny_trains():
    model, (ids, targets) = models.build_gpt("tiny")
    assert model(ids).shape == (2, 32, 256)
    loss = model(ids, targets)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_gpt_sdpa_matches_explicit_attention():
    a, (ids, _) = models.build_gpt("tiny")
    b, _ = models.build_gpt("tiny", sdpa=True)
    b.load_state_dict(a.state_dict())
    torch.testing.assert_close(a(ids), b(ids), atol=1e-5, rtol=1e-5)


def test_cnn_tiny_shapes():
    model, (x, y) = models.build_cnn("tiny")
    assert model(x).shape == (2, 10)


def test_model_workload_fresh_copies_are_independent():
    case = next(c for c in suite.CASES if c.name == "gpt")
    wl = case.build("cpu", "auto", "tiny")
    a, b = wl.fresh(), wl.fresh()
    before = [p.clone() for p in b.model.parameters()]
    ra = a.check(a.model)
    a.step(a.model)                       # AdamW step changes a's weights only
    assert all(torch.equal(p, q) for p, q in zip(before, b.model.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(before, a.model.parameters()))
    rb = b.check(b.model)
    assert all(torch.equal(x, y) for x, y in zip(ra, rb))
    assert all(p.grad is None for p in b.model.parameters())


def test_select_skips_gpu_only_and_missing():
    """bert (inference) runs on CUDA only; gpt2 runs on the CPU too where transformers is installed, and is
    skipped, naming it, where not (a fresh clone's test environment)."""
    import importlib.util
    cases, skipped = select("models", "cpu", ["gpt*", "bert"])
    reasons = dict(skipped)
    assert reasons["bert"] == "runs on cuda only"
    if importlib.util.find_spec("transformers") is None:
        assert [c.name for c in cases] == ["gpt"] and "transformers" in reasons["gpt2"]
    else:
        assert [c.name for c in cases] == ["gpt", "gpt2"] and "gpt2" not in reasons
