"""torch.compile(model, backend="kiln") trains a small GPT for 20 steps with eager's losses."""
import copy

import torch

from kiln_bench.models import build_gpt


def test_gpt_20_steps_match_eager():
    model, (ids, targets) = build_gpt("tiny")
    kiln_model = copy.deepcopy(model)
    compiled = torch.compile(kiln_model, backend="kiln")
    opt_e = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt_k = torch.optim.AdamW(kiln_model.parameters(), lr=1e-3)
    for step in range(20):
        loss_e = model(ids, targets)
        loss_k = compiled(ids, targets)
        rel = abs(loss_e.item() - loss_k.item()) / abs(loss_e.item())
        assert rel < 1e-4, f"step {step}: eager {loss_e.item()} kiln {loss_k.item()}"
        for opt, loss in ((opt_e, loss_e), (opt_k, loss_k)):
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert loss_k.item() < 5.6  # it learned something (log(256) = 5.55 at init)
