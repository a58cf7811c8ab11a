"""Dynamo writes ``addcmul_(..., value=)``, ``addcdiv_(..., value=)`` and ``add_`` with a tensor ``alpha`` as
Inductor's ``fma`` prim (torch 2.13: every Adam/AdamW step); kiln decomposes it so it fuses (#36)."""
import copy

import pytest
import torch

import kiln


@pytest.mark.parametrize("target", ["cpp", "aten"])
def test_compiled_adamw_steps_match_eager_with_no_fma_left(target):
    torch.manual_seed(0)
    ms = [torch.nn.Linear(16, 8) for _ in range(2)]
    ref = copy.deepcopy(ms)
    params = [p for m in ms for p in m.parameters()]
    ref_params = [p for m in ref for p in m.parameters()]
    opt, ref_opt = torch.optim.AdamW(params, lr=1e-2), torch.optim.AdamW(ref_params, lr=1e-2)
    torch._dynamo.reset()
    with kiln.config.patch(codegen=target):
        step = torch.compile(opt.step, backend="kiln")
        for i in range(3):
            grads = [torch.randn_like(p) for p in params]
            for p, q, g in zip(params, ref_params, grads):
                p.grad, q.grad = g.clone(), g.clone()
            if i == 2:
                _, sources = kiln.run_and_get_code(step)
            else:
                step()
            ref_opt.step()
    for p, q in zip(params, ref_params):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    wrappers = [s for s in sources if s.startswith("# kiln wrapper")]
    assert wrappers and not any("fma" in w for w in wrappers), wrappers
