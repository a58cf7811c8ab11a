"""Fold eval BatchNorm into the convolution before it.

In eval mode BatchNorm is an affine map per channel: ``y = x * s + t`` with ``s = gamma / sqrt(var + eps)``
and ``t = beta - mean * s``. After ``conv(x, W, b)`` it folds into the convolution:
``W' = W * s[:, None, ...]`` and ``b' = b * s + t``. Module ``nn.BatchNorm`` and functional
``F.batch_norm(training=False)`` both reach the ATen graph as ``_native_batch_norm_legit_no_training``.

A fold needs: constant weight, bias and statistics; a non-transposed convolution whose only user is the
BatchNorm (a convolution feeding two different BatchNorms, or feeding other ops too, stays as it is:
folding would mean running the convolution twice); the same dtype in and out. The folded weights are
new constants, so a weight shared with another convolution is never changed. Math runs in float32 for
float16/bfloat16 weights and is cast back once.

``bn_to_affine`` rewrites the BatchNorms that did not fold into ``x * s + t`` with constant ``s`` and
``t`` (for fusing targets, which want pointwise ops rather than a library call).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from kiln.debug import log
from kiln.passes.constant_fold import add_constant, compute_dtype, constant_value, fake_mode_of, infer_val, like

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
    x, gamma, beta, mean, var = args[:5]
    vals = []
    for a in (gamma, beta, mean, var):
        v = constant_value(gm, a)
        if a is not None and v is None:
            return None
        vals.append(v)
    if vals[2] is None or vals[3] is None:
        return None
    return (x, *vals, float(args[eps_at]))


def _only_output_zero(bn: fx.Node) -> "list | None":
    """The getitem(bn, 0) users, or None when some other output of the BatchNorm is used."""
    outs = []
    for u in bn.users:
        if u.op != "call_function" or u.target is not operator.getitem:
            return None
        if u.args[1] != 0:
            if u.users:
                return None
            continue
        outs.append(u)
    return outs


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
    w = constant_value(gm, conv.args[1])
    b = constant_value(gm, conv.args[2]) if conv.args[2] is not None else None
    if w is None or (conv.args[2] is not None and b is None):
        return None
    cv, bv = conv.meta.get("val"), bn.meta.get("val")
    bv = bv[0] if isinstance(bv, (tuple, list)) else bv
    if cv is None or bv is None or cv.dtype != bv.dtype or not w.is_floating_point():
        return None
    return w, b


def _constant_bns(gm: fx.GraphModule):
    """Yield ``(bn, parts, outs)`` for each eval BatchNorm with constant statistics whose only used
    output is the normalised tensor (the ones both rewrites below can replace)."""
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
        wb = _foldable_conv(gm, conv, bn)
        if wb is None:
            continue
        w, b = wb
        with unset_fake_temporarily(), torch.no_grad():
            dt = compute_dtype(w.dtype)
            s, t = scale_shift(gamma, beta, mean, var, eps, dt)
            new_w = like(w.to(dt) * s.reshape([-1] + [1] * (w.dim() - 1)), w)
            new_b = (b.to(dt) * s + t if b is not None else t).to(w.dtype)
        w_node = add_constant(gm, new_w, fake_mode)
        b_node = add_constant(gm, new_b, fake_mode)
        with gm.graph.inserting_before(conv):
            new = gm.graph.call_function(aten.convolution.default,
                                         (conv.args[0], w_node, b_node, *conv.args[3:]), dict(conv.kwargs))
        new.meta.update(conv.meta)
        for o in outs:
            o.replace_all_uses_with(new)
        for o in list(bn.users):
            gm.graph.erase_node(o)
        gm.graph.erase_node(bn)
        gm.graph.erase_node(conv)
        folded += 1
        log(5, f"conv_bn: folded {bn.name} into {new.name}")
    if folded:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return folded


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
        g = gm.graph
        with g.inserting_before(bn):
            y = x
            if dt != xv.dtype:
                y = g.call_function(prims.convert_element_type.default, (x, dt))
                infer_val(y, fake_mode)
            y = g.call_function(aten.mul.Tensor, (y, s_node))
            infer_val(y, fake_mode)
            y = g.call_function(aten.add.Tensor, (y, t_node))
            infer_val(y, fake_mode)
            if dt != xv.dtype:
                y = g.call_function(prims.convert_element_type.default, (y, xv.dtype))
                infer_val(y, fake_mode)
        for o in outs:
            o.replace_all_uses_with(y)
        changed += 1
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return changed
