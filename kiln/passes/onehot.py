"""One-hot scatters as pointwise compares: ``scatter(full(c), d, index, v)`` -> ``where(iota == index, v, c)``
when the index has size 1 along ``d`` and the output's size elsewhere. Cross-entropy's backward scatters so
into a logits-sized buffer (GPT-2: 1.6 GB saved and read again); a compare is recomputed for free.
"""
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from kiln.passes.constant_fold import call, fake_mode_of, recompiled

aten = torch.ops.aten
FILLS = {aten.full_like.default: 1, aten.full.default: 1, aten.zeros_like.default: None, aten.zeros.default: None}


def scatter_to_where(gm: fx.GraphModule) -> int:
    """Rewrite one-hot ``aten.scatter.value`` nodes in place; returns how many."""
    fake = fake_mode_of(gm)
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.scatter.value or node.kwargs:
            continue
        base, dim, index, value = node.args
        if not (isinstance(base, fx.Node) and base.op == "call_function" and base.target in FILLS):
            continue
        fill = 0 if FILLS[base.target] is None else base.args[FILLS[base.target]]   # what the fresh tensor holds
        out, idx = node.meta.get("val"), getattr(index, "meta", {}).get("val")
        if out is None or idx is None or isinstance(fill, fx.Node) or isinstance(value, fx.Node):
            continue
        dim = dim % out.dim()
        # symbolic sizes: equal only where the shapes already prove it (no guard of kiln's own)
        if idx.dim() != out.dim() or not _equal(idx.shape[dim], 1) \
                or not all(_equal(idx.shape[d], out.shape[d]) for d in range(out.dim()) if d != dim):
            continue
        g = gm.graph
        with g.inserting_before(node):
            end = out.shape[dim] if isinstance(out.shape[dim], int) else _size_node(g, fake, base, dim)
            if end is None:
                continue
            iota = call(g, fake, aten.arange.start_step, 0, end, 1, dtype=idx.dtype, device=out.device)
            view = call(g, fake, aten.view.default, iota, [end if d == dim else 1 for d in range(out.dim())])
            hit = call(g, fake, aten.eq.Tensor, view, index)
            on = call(g, fake, aten.scalar_tensor.default, value, dtype=out.dtype, device=out.device)
            off = call(g, fake, aten.scalar_tensor.default, fill, dtype=out.dtype, device=out.device)
            res = call(g, fake, aten.where.self, hit, on, off)
        node.replace_all_uses_with(res)
        g.erase_node(node)
        if not base.users:
            g.erase_node(base)
        count += 1
    return recompiled(gm, count)


def _equal(a, b) -> bool:
    return a == b if isinstance(a, int) and isinstance(b, int) else statically_known_true(a == b)


def _size_node(g, fake, base, dim):
    """A node of the fill's size along ``dim`` that does not keep the fill alive: its ``*_like`` source's
    ``sym_size``, or the entry of ``full``/``zeros``'s size list (None when there is neither)."""
    src = base.args[0]
    if base.target in (aten.full_like.default, aten.zeros_like.default):
        return call(g, fake, aten.sym_size.int, src, dim) if isinstance(src, fx.Node) else None
    return src[dim] if isinstance(src, (list, tuple)) and isinstance(src[dim], (int, fx.Node)) else None
