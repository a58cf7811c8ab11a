"""One-hot scatters (cross-entropy's backward) become pointwise compares before partitioning."""
import torch
import torch.nn.functional as F

import kiln
from kiln.passes.onehot import scatter_to_where
from torch.fx.experimental.proxy_tensor import make_fx


def _onehot(idx, n):
    return torch.zeros(idx.shape[0], n).scatter(1, idx[:, None], -1.0)


def test_scatter_into_zeros_becomes_where():
    idx = torch.tensor([3, 0, 6, 6])
    gm = make_fx(_onehot, tracing_mode="fake")(idx, 7)
    assert scatter_to_where(gm) == 1
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.scatter.value not in targets and torch.ops.aten.where.self in targets
    torch.testing.assert_close(gm(idx, 7), _onehot(idx, 7), rtol=0, atol=0)


def test_partial_scatter_is_left_alone():
    def fn(idx):   # two indices per row: not a one-hot
        return torch.zeros(4, 7).scatter(1, idx, 1.0)
    gm = make_fx(fn, tracing_mode="fake")(torch.zeros(4, 2, dtype=torch.long))
    assert scatter_to_where(gm) == 0


def test_cross_entropy_saves_no_onehot_and_matches_eager():
    logits = torch.randn(16, 37, requires_grad=True)
    target = torch.randint(0, 37, (16,))
    target[3] = -100   # ignore_index rows too
    saved = []

    def joint_post(graph):
        saved.append(sum(n.target is torch.ops.aten.scatter.value for n in graph.nodes))
    f = torch.compile(lambda x, t: F.cross_entropy(x, t), backend="kiln",
                      options={"joint_custom_post_pass": joint_post, "codegen": "triton"})
    loss = f(logits, target)
    loss.backward()
    ref_x = logits.detach().clone().requires_grad_(True)
    ref = F.cross_entropy(ref_x, target)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(logits.grad, ref_x.grad)
    assert saved == [0]


def test_symbolic_sizes_the_shapes_prove_equal():
    """Under dynamic shapes (logits and labels with sizes of their own symbols, as after a graph break in a
    Hugging Face loss) the one-hot still becomes a compare: cross-entropy's checks make the row counts
    provably equal; the compare's length is read from the logits, so nothing logits-sized is saved."""
    saved = []

    def joint_post(graph):
        saved.append(sum(n.target is torch.ops.aten.scatter.value for n in graph.nodes))
    f = torch.compile(lambda x, t: F.cross_entropy(x.flatten(0, 1), t.flatten()), backend="kiln",
                      dynamic=True, options={"joint_custom_post_pass": joint_post, "codegen": "cpp"})
    for b, s in ((2, 5), (3, 7)):
        logits = torch.randn(b, s, 37, requires_grad=True)
        target = torch.randint(0, 37, (b, s))
        ref_x = logits.detach().clone().requires_grad_(True)
        loss = f(logits, target)
        loss.backward()
        ref = F.cross_entropy(ref_x.flatten(0, 1), target.flatten())
        ref.backward()
        torch.testing.assert_close(loss, ref)
        torch.testing.assert_close(logits.grad, ref_x.grad)
    assert saved == [0]
