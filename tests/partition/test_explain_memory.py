"""kiln.explain_memory explains the graph kiln compiles (kiln/memory.py): the joint graph comes through
the pipeline's own AOTAutograd set-up, with kiln's decompositions for the target and its pre-grad and
joint passes, and the saved set is the one the pipeline's partition picks."""
import torch

import kiln
from kiln.debug import observe


def softmax_mm(x, w):
    return (torch.softmax(x @ w, dim=-1) * x).sum()


def _args():
    torch.manual_seed(0)
    return torch.randn(16, 16, requires_grad=True), torch.randn(16, 16, requires_grad=True)


def _ops(rep):
    return {r.op for r in rep.saved + rep.recomputed}


def test_the_targets_decompositions_shape_the_explained_graph():
    # the fusing targets take softmax apart (capture/decomp.py FUSION_EXTRA); the ATen target keeps it whole,
    # as AOTAutograd without kiln's table does
    fused = kiln.explain_memory(softmax_mm, *_args(), codegen="cpp")
    whole = kiln.explain_memory(softmax_mm, *_args(), codegen="aten")
    assert "aten._softmax.default" in _ops(whole), _ops(whole)
    assert not any("softmax" in op for op in _ops(fused)), _ops(fused)
    assert "aten.exp.default" in _ops(fused) or "aten.div.Tensor" in _ops(fused), _ops(fused)


def test_pre_grad_and_joint_passes_run():
    seen = []
    kiln.explain_memory(softmax_mm, *_args(), codegen="aten",
                        pre_grad_custom_pass=lambda g: seen.append(("pre_grad", len(g.nodes))),
                        joint_custom_pre_pass=lambda g: seen.append(("joint", len(g.nodes))))
    assert [s for s, _ in seen] == ["pre_grad", "joint"], seen


def _compiled_cut(fn, args, **options):
    """The saved set (name, op) the pipeline's partition picks when kiln.compile runs ``fn``."""
    cuts = []
    torch._dynamo.reset()
    with observe(lambda event, data: cuts.append(data) if event == "partition" else None):
        kiln.compile(fn, cache=False, **options)(*args).backward()   # (a cache hit would not partition)
    torch._dynamo.reset()
    assert len(cuts) == 1
    return [(n.name, str(n.target)) for n in cuts[0]["saved"]]


def test_saved_set_is_the_compiles():
    for options in ({"codegen": "aten"}, {"codegen": "aten", "activation_memory_budget": 0.3},
                    {"codegen": "cpp"}):
        rep = kiln.explain_memory(softmax_mm, *_args(), **options)
        assert [(r.name, r.op) for r in rep.saved] == _compiled_cut(softmax_mm, _args(), **options), options
    # the budget changes the cut, so the comparison above can tell two cuts apart
    full, low = (kiln.explain_memory(softmax_mm, *_args(), codegen="aten", activation_memory_budget=b)
                 for b in (1.0, 0.0))
    assert low.activation_bytes < full.activation_bytes


def test_each_call_traces_afresh():
    """More calls on one function than Dynamo's recompile limit (8) allows: each is explained."""
    x, w = _args()
    for i in range(10):
        rep = kiln.explain_memory(softmax_mm, x, w, codegen="aten", activation_memory_budget=(1.0, 0.0)[i % 2])
        assert (rep.activation_bytes > 0) == (i % 2 == 0), (i, rep.activation_bytes)
