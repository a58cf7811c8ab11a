"""Fold eval BatchNorm (``x * s + t`` per channel) into the convolution before it: ``W' = W * s[:, None]``,
``b' = b * s + t``, for constant weights and statistics, the BatchNorm as the only user, one dtype (float32
math for half weights). ``bn_to_affine`` rewrites the BatchNorms left as ``x * s + t`` for fusing targets.
"""
import operator

import torch
import torch.fx as fx

from kiln.debug import log
from kiln.passes.constant_fold import (add_constant, call, compute_dtype, constant_value, fake_mode_of, like,
                                       recompiled)

aten = torch.ops.aten
prims = torch.ops.prims

# Eval BatchNorm ops: op -> (position of eps, predicate on args saying it is in eval mode).
BATCH_NORMS = {
    aten._native_batch_norm_legit_no_training.default: (6, lambda args: True),
    aten.native_batch_norm.default: (7, lambda args: args[5] is False),
}


def _bn_parts(gm: fx.GraphModule, bn: fx.Node):
    """(x, gamma, beta, mean, var, eps) as tensors (gamma/beta may be None), or None if not constant."""
    eps_at, is_eval = BATCH_NORMS[bn.target]
    args = list(bn.args)
    if len(args) <= eps_at or bn.kwargs or not is_eval(args):
        return None
    vals = [constant_value(gm, a) for a in args[1:5]]
    if any(a is not None and v is None for a, v in zip(args[1:5], vals)) or vals[2] is None or vals[3] is None:
        return None
    return (args[0], *vals, float(args[eps_at]))


def _only_output_zero(bn: fx.Node) -> "list | None":
    """The getitem(bn, 0) users, or None when some other output of the BatchNorm is used."""
    if any(u.op != "call_function" or u.target is not operator.getitem or u.args[1] != 0 and u.users for u in bn.users):
        return None
    return [u for u in bn.users if u.args[1] == 0]


def scale_shift(gamma, beta, mean, var, eps: float, dtype: torch.dtype):
    """BatchNorm's per-channel affine map ``(s, t)`` computed in ``dtype``."""
    s = torch.rsqrt(var.to(dtype) + eps)
    if gamma is not None:
        s = s * gamma.to(dtype)
    t = -mean.to(dtype) * s
    if beta is not None:
        t = t + beta.to(dtype)
    return s, t


def _foldable_conv(gm: fx.GraphModule, conv, bn: fx.Node):
    if not isinstance(conv, fx.Node) or conv.target is not aten.convolution.default:
        return None
    if len(conv.users) != 1 or conv.args[6]:  # shared output or transposed
        return None
    w, b = constant_value(gm, conv.args[1]), constant_value(gm, conv.args[2])
    if w is None or (conv.args[2] is not None and b is None):
        return None
    cv, bv = conv.meta.get("val"), bn.meta.get("val")
    bv = bv[0] if isinstance(bv, (tuple, list)) else bv
    if cv is None or bv is None or cv.dtype != bv.dtype or not w.is_floating_point():
        return None
    return w, b


def _constant_bns(gm: fx.GraphModule):
    """``(bn, parts, outs)`` of each eval BatchNorm with constant statistics and only its output 0 used."""
    for bn in [n for n in gm.graph.nodes if n.op == "call_function" and n.target in BATCH_NORMS]:
        parts = _bn_parts(gm, bn)
        outs = _only_output_zero(bn)
        if parts is not None and outs is not None:
            yield bn, parts, outs


def fold_conv_bn(gm: fx.GraphModule, fake_mode=None) -> int:
    """Fold each eval BatchNorm that follows a convolution into it; edits ``gm``, returns the fold count."""
    fake_mode = fake_mode or fake_mode_of(gm)
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    folded = 0
    for bn, parts, outs in _constant_bns(gm):
        conv, gamma, beta, mean, var, eps = parts
        if (wb := _foldable_conv(gm, conv, bn)) is None:
            continue
        w, b = wb
        with unset_fake_temporarily(), torch.no_grad():
            dt = compute_dtype(w.dtype)
            s, t = scale_shift(gamma, beta, mean, var, eps, dt)
            new_w = like(w.to(dt) * s.reshape([-1] + [1] * (w.dim() - 1)), w)
            new_b = (b.to(dt) * s + t if b is not None else t).to(w.dtype)
        w_node, b_node = add_constant(gm, new_w, fake_mode), add_constant(gm, new_b, fake_mode)
        with gm.graph.inserting_before(conv):
            new = gm.graph.call_function(aten.convolution.default,
                                         (conv.args[0], w_node, b_node, *conv.args[3:]), dict(conv.kwargs))
        new.meta.update(conv.meta)
        for o in outs:
            o.replace_all_uses_with(new)
        for o in [*bn.users, bn, conv]:
            gm.graph.erase_node(o)
        folded += 1
        log(5, f"conv_bn: folded {bn.name} into {new.name}")
    return recompiled(gm, folded, dead_code=True)


def bn_to_affine(gm: fx.GraphModule, fake_mode=None) -> int:
    """Rewrite each constant eval BatchNorm left in ``gm`` as ``x * s + t``; returns how many changed."""
    fake_mode = fake_mode or fake_mode_of(gm)
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    changed = 0
    for bn, parts, outs in _constant_bns(gm):
        xv = bn.args[0].meta.get("val") if isinstance(bn.args[0], fx.Node) else None
        if xv is None or xv.dim() < 2:
            continue
        x, gamma, beta, mean, var, eps = parts
        dt = compute_dtype(xv.dtype)
        with unset_fake_temporarily(), torch.no_grad():
            s, t = scale_shift(gamma, beta, mean, var, eps, dt)
            shape = [-1] + [1] * (xv.dim() - 2)
            s, t = s.reshape(shape).contiguous(), t.reshape(shape).contiguous()
        s_node, t_node = add_constant(gm, s, fake_mode), add_constant(gm, t, fake_mode)
        g, y = gm.graph, x
        with g.inserting_before(bn):
            if dt != xv.dtype:
                y = call(g, fake_mode, prims.convert_element_type.default, x, dt)
            y = call(g, fake_mode, aten.add.Tensor, call(g, fake_mode, aten.mul.Tensor, y, s_node), t_node)
            if dt != xv.dtype:
                y = call(g, fake_mode, prims.convert_element_type.default, y, xv.dtype)
        for o in outs:
            o.replace_all_uses_with(y)
        changed += 1
    return recompiled(gm, changed, dead_code=True)
