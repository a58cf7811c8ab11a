"""Concatenate linears that share an input into one matmul (better for small N; the input is read once):
``addmm(b1, x, W1t), mm(x, W2t)`` -> ``y = addmm(cat[b1, 0], x, cat[W1t, W2t])``, sliced in columns.
A linear joins when its weight is a constant 2-D matrix with the group's K, dtype and device and its bias
a constant row. A slice a view cannot reinterpret, or the graph returns, is copied (eager's strides).
"""
import torch
import torch.fx as fx

from kiln.debug import log
from kiln.passes.channels_last import view_breaks
from kiln.passes.constant_fold import add_constant, call, constant_value, fake_mode_of, infer_val, recompiled

aten = torch.ops.aten
VIEWS = (aten.view.default, aten._unsafe_view.default)
MIN_GROUP = 2


def _linear(gm, n: fx.Node):
    """(x, Wt, bias-or-None) when ``n`` is a linear with constant weights, else None."""
    if n.op != "call_function" or n.kwargs or n.target not in (aten.addmm.default, aten.mm.default):
        return None
    b, x, w = n.args if n.target is aten.addmm.default else (None, *n.args)
    bt, wt = constant_value(gm, b), constant_value(gm, w)
    if (b is not None and bt is None) or wt is None or wt.dim() != 2 or not wt.is_floating_point():
        return None
    if bt is not None and (bt.dtype != wt.dtype or bt.dim() > 2 or bt.numel() != wt.shape[1]):
        return None
    return x, wt, bt


def _input_key(x):
    """Linears on 3-D inputs each flatten the input with their own view: those views are one input."""
    if isinstance(x, fx.Node) and x.target in VIEWS and not x.kwargs:
        shape = tuple(a if not isinstance(a, fx.Node) else ("node", a) for a in x.args[1])
        return ("view", x.args[0], shape)
    return x


def _groups(gm) -> list:
    groups: dict = {}
    for n in gm.graph.nodes:
        if (lin := _linear(gm, n)) is not None:
            x, wt, _ = lin
            groups.setdefault((_input_key(x), wt.shape[0], wt.dtype, wt.device), []).append((n, lin))
    return [g for g in groups.values() if len(g) >= MIN_GROUP]


def _concat(gm, group, fake_mode) -> None:
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    g = gm.graph
    nodes = [n for n, _ in group]
    x = group[0][1][0]
    widths = [lin[1].shape[1] for _, lin in group]
    with unset_fake_temporarily(), torch.no_grad():
        ws = [lin[1] for _, lin in group]
        transposed = all(w.stride() == (1, w.shape[0]) for w in ws)   # views of [N, K] weights: keep that
        w_cat = torch.cat([w.t() for w in ws], 0).t() if transposed else torch.cat(ws, 1)
        b_cat = torch.cat([lin[2].reshape(-1) if lin[2] is not None else
                           torch.zeros(lin[1].shape[1], dtype=lin[1].dtype, device=lin[1].device)
                           for _, lin in group])
    first = next(n for n in g.nodes if n in set(nodes))
    w_node, b_node = add_constant(gm, w_cat, fake_mode), add_constant(gm, b_cat, fake_mode)
    big = call(g, fake_mode, aten.addmm.default, b_node, x, w_node, before=first)
    slices, start = [], 0
    for width in widths:
        slices.append(call(g, fake_mode, aten.slice.Tensor, big, 1, start, start + width, before=first))
        start += width
    for n, s in zip(nodes, slices):
        for user in list(n.users):
            src = s   # copied where the user cannot take a column slice for a contiguous matrix
            if user.op == "output" or user.target in VIEWS and view_breaks(user, s.meta.get("val")):
                src = call(g, fake_mode, aten.clone.default, s, memory_format=torch.contiguous_format, before=user)
            user.replace_input_with(n, src)
            if src is s:   # the user now reads a strided slice: its value (and its views') change layout
                _refresh(user, fake_mode)
        g.erase_node(n)


def _refresh(node: fx.Node, fake_mode) -> None:
    """Recompute ``node``'s example value and those of the views that read it, transitively."""
    stack = [node]
    while stack:
        n = stack.pop()
        if n.op != "call_function":
            continue
        infer_val(n, fake_mode)
        stack.extend(u for u in n.users if u.target in VIEWS or getattr(u.target, "is_view", False))


def concat_linears(gm: fx.GraphModule, fake_mode=None) -> int:
    """Merge linears sharing an input into one addmm; edits ``gm``, returns how many linears merged."""
    fake_mode = fake_mode or fake_mode_of(gm)
    merged = 0
    for group in _groups(gm):
        _concat(gm, group, fake_mode)
        merged += len(group)
        log(5, f"concat_linear: {len(group)} linears on {group[0][1][0]} merged")
    return recompiled(gm, merged, dead_code=True)
