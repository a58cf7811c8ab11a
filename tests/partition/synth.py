"""Hand-built joint graphs of any size (no tracing), for partitioner scaling tests.

``chain_joint(layers)`` is the joint graph of ``h = cos(mm(h, w_i))`` repeated, with its backward:
9 nodes per layer plus inputs, each value an (n x n) float tensor (one shared fake value).
"""
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

aten = torch.ops.aten


def chain_joint(layers: int, n: int = 64):
    mode = FakeTensorMode()
    with mode:
        val = torch.empty(n, n)
        scalar = torch.empty(())
    g = fx.Graph()

    def op(target, *args):
        node = g.call_function(target, args)
        node.meta["val"] = scalar if target is aten.sum.default else val
        return node

    x = g.placeholder("primals_1")
    x.meta["val"] = val
    ws = []
    for i in range(layers):
        w = g.placeholder(f"primals_{i + 2}")
        w.meta["val"] = val
        ws.append(w)
    tangent = g.placeholder("tangents_1")
    tangent.meta["val"] = scalar
    hs, pre = [x], []
    h = x
    for w in ws:
        m = op(aten.mm.default, h, w)
        h = op(aten.cos.default, m)
        pre.append(m)
        hs.append(h)
    loss = op(aten.sum.default, h)
    grad = op(aten.expand.default, tangent, [n, n])
    grads = []
    for i in reversed(range(layers)):
        d = op(aten.mul.Tensor, grad, op(aten.neg.default, op(aten.sin.default, pre[i])))
        grads.append(op(aten.mm.default, op(aten.t.default, hs[i]), d))
        grad = op(aten.mm.default, d, op(aten.t.default, ws[i]))
    g.output([loss, grad] + grads[::-1])
    return fx.GraphModule(torch.nn.Module(), g)
