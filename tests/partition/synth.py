"""Hand-built joint graphs (no tracing): any size for partitioner scaling tests, any node order for the
budget property tests.

``chain_joint(layers)`` is the joint graph of ``h = cos(mm(h, w_i))`` repeated, with its backward:
9 nodes per layer plus inputs, each value an (n x n) float tensor (one shared fake value).
"""
import random

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


def branches_joint(branches, unit: int = 2, rows: int = 1, x_cos: bool = False, order_seed=None):
    """The joint graph of ``sum_b sum(h_b)``, branch ``b`` being the chain ``h = cos(mm(h, W))`` over
    widths ``branches[b]`` (in ``unit`` columns) that starts at the input ``x`` (``rows * unit`` by
    ``unit``, after a ``cos`` when ``x_cos``), with its backward.

    One-layer branches are seed 001's uneven chain (``[[11], [3], [4], [2]]``: its matmuls cost FLOPs
    in proportion to their bytes, so the budget's knapsack is a subset sum). ``order_seed``: lay the
    forward nodes out in a random topological order, then the backward nodes in another (None: in the
    order they are built: each branch's matmuls, cos and sum in turn, then the adds; the backward from
    the last layer back). Values are fake tensors; every placeholder is a forward input or
    ``tangents_1`` and no input is mutated (the output node's ``meta['desc']`` says so).
    """
    ops, prim = {}, [("primals_1", (rows * unit, unit))]
    fwd, bwd = [], []

    def op(names, name, target, *args):
        ops[name] = (target, args)
        names.append(name)
        return name

    h0 = op(fwd, "xcos", aten.cos.default, "primals_1") if x_cos else "primals_1"
    layers, ends = [], []
    for b, widths in enumerate(branches):
        h, prev = h0, 1
        for i, w in enumerate(widths):
            wn = f"primals_{len(prim) + 1}"
            prim.append((wn, (prev * unit, w * unit)))
            m = op(fwd, f"mm_{b}_{i}", aten.mm.default, h, wn)
            layers.append((b, i, h, wn, m))
            h, prev = op(fwd, f"cos_{b}_{i}", aten.cos.default, m), w
        ends.append((h, op(fwd, f"sum_{b}", aten.sum.default, h)))
    loss = ends[0][1]
    for j, (_, s) in enumerate(ends[1:]):
        loss = op(fwd, f"add_{j}", aten.add.Tensor, loss, s)
    grad_h = {h: op(bwd, f"expand_{h}", aten.expand.default, "tangents_1", ("shape of", h)) for h, _ in ends}
    grad_w, grad_x = {}, []
    for b, i, h, wn, m in reversed(layers):
        g = grad_h[f"cos_{b}_{i}"]
        d = op(bwd, f"mul_{b}_{i}", aten.mul.Tensor, g,
               op(bwd, f"neg_{b}_{i}", aten.neg.default, op(bwd, f"sin_{b}_{i}", aten.sin.default, m)))
        grad_w[wn] = op(bwd, f"gw_{b}_{i}", aten.mm.default, op(bwd, f"th_{b}_{i}", aten.t.default, h), d)
        gh = op(bwd, f"gh_{b}_{i}", aten.mm.default, d, op(bwd, f"tw_{b}_{i}", aten.t.default, wn))
        if i > 0:
            grad_h[h] = gh
        elif x_cos:
            sin_x = op(bwd, f"sx_{b}", aten.sin.default, "primals_1")
            grad_x.append(op(bwd, f"gx_{b}", aten.mul.Tensor, gh, op(bwd, f"nx_{b}", aten.neg.default, sin_x)))
        else:
            grad_x.append(gh)
    gx = grad_x[0]
    for j, g in enumerate(grad_x[1:]):
        gx = op(bwd, f"gxadd_{j}", aten.add.Tensor, gx, g)
    if order_seed is not None:
        rng = random.Random(order_seed)
        fwd, bwd = _shuffled(fwd, ops, rng), _shuffled(bwd, ops, rng)
    return _emit(ops, prim, fwd + bwd, [loss, gx] + [grad_w[n] for n, _ in prim[1:]])


def _shuffled(names, ops, rng):
    """``names`` in a random topological order (each step takes a random ready node)."""
    inside, done, out, pending = set(names), set(), [], list(names)
    deps = {n: {a for a in ops[n][1] if isinstance(a, str) and a in inside} for n in names}
    while pending:
        ready = [n for n in pending if deps[n] <= done]
        n = rng.choice(ready)
        pending.remove(n)
        done.add(n)
        out.append(n)
    return out


def _emit(ops, prim, order, outputs):
    """The GraphModule of ``ops`` (name -> (target, args)) in ``order``, with fake values."""
    g, env = fx.Graph(), {}
    with FakeTensorMode():
        for name, shape in prim + [("tangents_1", ())]:
            env[name] = g.placeholder(name)
            env[name].meta["val"] = torch.empty(shape)
        for name in order:
            target, args = ops[name]
            args = tuple(list(env[a[1]].meta["val"].shape) if isinstance(a, tuple) else env[a] for a in args)
            node = env[name] = g.call_function(target, args)
            node.meta["val"] = target(*(a.meta["val"] if isinstance(a, fx.Node) else a for a in args))
    g.output([env[o] for o in outputs]).meta["desc"] = []
    return fx.GraphModule(torch.nn.Module(), g)
