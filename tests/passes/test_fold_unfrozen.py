"""Constant folding without freezing: subgraphs that read no graph input fold into constants."""
import pytest
import torch

import kiln


def shifted_window_mask(x):
    """torchvision Swin's attention mask: Python numbers written into slices of a new zeros tensor."""
    m = x.new_zeros(8, 8)
    count = 0
    for h in ((0, 4), (4, 6), (6, None)):
        for w in ((0, 4), (4, 6), (6, None)):
            m[h[0]:h[1], w[0]:w[1]] = count
            count += 1
    m = m.view(2, 4, 2, 4).permute(0, 2, 1, 3).reshape(4, 16)
    d = m.unsqueeze(1) - m.unsqueeze(2)
    return x + d.masked_fill(d != 0, -100.0).masked_fill(d == 0, 0.0)


def _wrapper(fn, x, **options):
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="kiln", options=options)
    _, sources = kiln.run_and_get_code(compiled, x)
    torch.testing.assert_close(compiled(x), fn(x))
    return next(s for s in sources if "def call(args)" in s)


@pytest.mark.parametrize("codegen", ["cpp", "triton"])
def test_an_input_free_mask_folds_into_one_constant(codegen):
    """The nine slice writes, the window permutation and the pairwise difference fold; the graph keeps one
    kernel (the add and the two masked fills over the folded difference). Without folding: three."""
    x = torch.randn(4, 16, 16)
    folded = _wrapper(shifted_window_mask, x, codegen=codegen)
    assert folded.count("_frozen_param") >= 1 and folded.count("kiln_") == 1, folded
    plain = _wrapper(shifted_window_mask, x, codegen=codegen, fold_constants=False)
    assert "_frozen_param" not in plain and plain.count("kiln_") > 1


def test_a_lone_constructor_is_not_stored():
    """zeros/arange read by input-dependent nodes stay constructors (a cheap kernel, no stored memory)."""
    def f(x):
        return x + torch.arange(16, dtype=x.dtype)
    assert "_frozen_param" not in _wrapper(f, torch.randn(16), codegen="cpp")


def test_values_of_constructors_alone_stay_computed():
    """``arange(n)[None, :] == t[:, None]`` keeps its arange: a stored constant would hide the row index
    the C++ emitter's one-hot row sums read (cross-entropy's backward)."""
    def f(t):
        r = torch.arange(16).view(1, 16)
        return (r == t[:, None]).float().sum(-1)
    assert "_frozen_param" not in _wrapper(f, torch.tensor([1, 3, 20]), codegen="cpp")


def test_constructors_that_meet_no_constant_are_not_evaluated():
    """A fold evaluates only what it could store: input-free ``full`` and ``arange`` that no constant meets are
    never run at compile time (a logits-sized buffer would be allocated at every compile); once a constant
    meets them, they and what reads them are."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from kiln.passes.constant_fold import _worth_evaluating
    gm = make_fx(lambda x: x + torch.full((4, 4), 2.0) * torch.arange(4.0))(torch.randn(4, 4))
    assert _worth_evaluating(gm) == (set(), set())
    gm.register_buffer("c", torch.ones(4))
    full = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.full.default)
    with gm.graph.inserting_after(full):
        c = gm.graph.get_attr("c")
    with gm.graph.inserting_after(c):
        scaled = gm.graph.call_function(torch.ops.aten.mul.Tensor, (full, c))
    full.replace_all_uses_with(scaled, delete_user_cb=lambda u: u is not scaled)
    names = {n.name for n in _worth_evaluating(gm)[0]}
    assert names == {full.name, scaled.name, "arange", "mul"}, names   # mul: scaled * arange
