"""Fold ``add``/``sub``/``mul``/``div`` by a constant into the convolution or linear before it:
``conv(x, W, b) * c -> conv(x, W * c[:, None, ...], b * c)``, likewise ``+`` into the bias and for ``addmm``
/ ``mm`` (through a ``view`` keeping the last dim). Needs constant weights, the binary op as the only user,
``c`` constant along the channel dim only, and no type promotion.
"""
import torch
import torch.fx as fx

from kiln.debug import log
from kiln.passes.constant_fold import add_constant, compute_dtype, constant_value, fake_mode_of, like, recompiled
from kiln.passes.constant_fold import val as _val

aten = torch.ops.aten

# op -> (kind, commutative)
BINARY = {
    aten.add.Tensor: ("add", True), aten.add.Scalar: ("add", True),
    aten.sub.Tensor: ("sub", False), aten.sub.Scalar: ("sub", False),
    aten.mul.Tensor: ("mul", True), aten.mul.Scalar: ("mul", True),
    aten.div.Tensor: ("div", False), aten.div.Scalar: ("div", False),
}
VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _channel_vector(gm, c, out_shape, dim: int, channels: int, dtype):
    """``c`` as a vector of ``channels`` values when it varies along ``dim`` of ``out_shape`` only."""
    if isinstance(c, (int, float)) and not isinstance(c, bool):
        return torch.full([channels], float(c), dtype=dtype)
    t = constant_value(gm, c)
    if t is None or t.dim() > len(out_shape) or not (t.is_floating_point() or t.dtype in (torch.int64, torch.int32)):
        return None
    shape, dim = [1] * (len(out_shape) - t.dim()) + list(t.shape), dim % len(out_shape)
    if any(s != 1 for i, s in enumerate(shape) if i != dim) or shape[dim] not in (1, channels):
        return None
    return t.reshape(-1).to(dtype).expand(channels).clone()


def _producer(n: fx.Node):
    """(matmul-or-conv node, view between or None, channel dim of the binary op's operand) or None."""
    for pi, ci in [(0, 1)] + ([(1, 0)] if BINARY[n.target][1] else []):
        p = n.args[pi] if pi < len(n.args) else None
        if not isinstance(p, fx.Node) or len(p.users) != 1:
            continue
        view = None
        if p.target in VIEWS and isinstance(p.args[0], fx.Node) and len(p.args[0].users) == 1:
            view, p = p, p.args[0]
        if p.target is aten.convolution.default and view is None and not p.args[6]:
            return p, None, n.args[ci], 1
        if p.target in (aten.addmm.default, aten.mm.default) and not p.kwargs:
            vv, pv = _val(view), _val(p)
            if view is not None and (vv is None or pv is None or vv.shape[-1] != pv.shape[-1]):
                continue
            return p, view, n.args[ci], -1
    return None


def _weights(gm, p):
    """(weight, bias-or-None, weight arg index, bias arg index or None) of a conv/addmm/mm node."""
    if p.target is aten.convolution.default:
        w, b = constant_value(gm, p.args[1]), constant_value(gm, p.args[2])
        return (w, b, 1, 2) if w is not None and (p.args[2] is None or b is not None) else None
    if p.target is aten.addmm.default:
        w, b = constant_value(gm, p.args[2]), constant_value(gm, p.args[0])
        return (w, b, 2, 0) if w is not None and b is not None else None
    w = constant_value(gm, p.args[1])
    return (w, None, 1, None) if w is not None else None


def _fold_one(gm, n: fx.Node, fake_mode) -> bool:
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    found = _producer(n)
    if found is None or n.kwargs:
        return False
    p, view, c, dim = found
    parts = _weights(gm, p)
    pv, nv = _val(p), _val(n)
    if parts is None or pv is None or nv is None or nv.dtype != pv.dtype or not parts[0].is_floating_point():
        return False
    if list(nv.shape) != list((_val(view) if view is not None else pv).shape):
        return False
    w, b, wi, bi = parts
    kind = BINARY[n.target][0]
    out_shape = list(nv.shape)
    channels = w.shape[0] if dim == 1 else w.shape[1]
    with unset_fake_temporarily(), torch.no_grad():
        dt = compute_dtype(w.dtype)
        vec = _channel_vector(gm, c, out_shape, dim, channels, dt)
        if vec is None or not bool(torch.isfinite(vec).all()) or (kind == "div" and bool((vec == 0).any())):
            return False  # inf/nan scales do not commute with the convolution's sums
        vec = vec.to(w.device)
        new_w, new_b = w, b
        if kind in ("mul", "div"):
            op = torch.mul if kind == "mul" else torch.div
            scale = vec.reshape([-1] + [1] * (w.dim() - 1)) if dim == 1 else vec.reshape(1, -1)
            new_w = like(op(w.to(dt), scale), w)
            new_b = None if b is None else op(b.to(dt), vec).to(b.dtype)
        else:
            sign = 1.0 if kind == "add" else -1.0
            new_b = (vec * sign if b is None else b.to(dt) + sign * vec).to(w.dtype)
    g = gm.graph
    args = list(p.args)
    if new_w is not w:
        args[wi] = add_constant(gm, new_w, fake_mode)
    target = p.target
    if new_b is not None and (bi is None):  # mm gains a bias: addmm(b, x, Wt)
        target, args = aten.addmm.default, [add_constant(gm, new_b, fake_mode), *args]
    elif new_b is not None and new_b is not b:
        args[bi] = add_constant(gm, new_b, fake_mode)
    with g.inserting_before(p):
        new = g.call_function(target, tuple(args), dict(p.kwargs))
    new.meta.update(p.meta)
    result = new
    if view is not None:
        with g.inserting_before(view):
            result = g.call_function(view.target, (new, *view.args[1:]), dict(view.kwargs))
        result.meta.update(view.meta)
    n.replace_all_uses_with(result)
    for dead in (n, view, p):
        if dead is not None:
            g.erase_node(dead)
    log(5, f"binary_fold: {kind} {n.name} folded into {new.name}")
    return True


def fold_binary(gm: fx.GraphModule, fake_mode=None) -> int:
    """Fold binary ops by constants into the conv/linear before them; edits ``gm``, returns the count."""
    fake_mode = fake_mode or fake_mode_of(gm)
    todo = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in BINARY]
    return recompiled(gm, sum(_fold_one(gm, n, fake_mode) for n in todo), dead_code=True)
