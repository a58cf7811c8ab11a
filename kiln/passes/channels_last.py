"""Channels-last for convolution nets (option ``layout_devices``), and the layouts of freezing (at the end).

cuDNN's fp16/bf16 convolutions run in NHWC and transpose NCHW tensors in and out: here every 4-D
convolution (and ``convolution_backward``) reads channels-last inputs, so the pointwise work between them
is stored in NHWC, and a KxK weight is converted once, not at every call. Outputs whose strides moved get
eager's back (a copy, or ``as_strided`` where only size-1 dims moved). Symbolic shapes are left alone.
"""
import operator

import torch
import torch.fx as fx

from kiln.options import active
from kiln.passes.constant_fold import call, fake_mode_of, infer_val, recompiled
from kiln.passes.constant_fold import val as _val

aten = torch.ops.aten
CL = torch.channels_last
LAYOUT_DEVICES = {"auto": ("cuda",), "cuda": ("cuda",), "any": None}   # layout_devices -> device types (None: any)
VIEWS = (aten.view.default, aten._unsafe_view.default)
STRIDED = (aten.as_strided.default,)   # reads storage through explicit strides
# convolution op -> (index of the activation whose device decides, indices that should be NHWC)
CONVS = {aten.convolution.default: (0, (0, 1)),
         aten.convolution_backward.default: (1, (0, 1, 2))}   # (grad_output, input, weight, ...)
WEIGHT = {aten.convolution.default: 1, aten.convolution_backward.default: 2}   # which of those is the weight


def _is_cl(v) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() == 4 and v.is_contiguous(memory_format=CL) and not v.is_contiguous()


def devices(opts=None):
    """Device types where the layout passes act (None: any); ``opts`` default: ``kiln.options.active()``."""
    return LAYOUT_DEVICES[(opts if opts is not None else active()).layout_devices]


def _convs(gm, on) -> dict:
    """{convolution node: argument indices to make channels-last} for the 4-D convolutions on ``on``."""
    out = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in CONVS:
            at, idx = CONVS[n.target]
            v = _val(n.args[at])
            if isinstance(v, torch.Tensor) and v.dim() == 4 and (on is None or v.device.type in on):
                out[n] = idx
    return out


def copy_before(gm, before, x, fmt, fake):
    """A new ``aten.clone(x, memory_format=fmt)`` node right before ``before``, with its fake value."""
    return call(gm.graph, fake, aten.clone.default, x, memory_format=fmt, before=before)


def view_breaks(node, val) -> bool:
    shape = [_val(a) if isinstance(a, fx.Node) else a for a in node.args[1]]
    try:
        torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta").view(shape)
    except (RuntimeError, ValueError):   # torch 2.13 raises ValueError on the meta device
        return True
    return False


def _eager_format(old, new):
    """The memory format that gives ``new`` back ``old``'s strides, or None (unchanged, or not dense)."""
    if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)) or old.stride() == new.stride():
        return None
    fmt = CL if _is_cl(old) else torch.contiguous_format
    return fmt if old.is_contiguous(memory_format=fmt) else None


def _same_but_size_one(old, new) -> bool:
    """Strides differ only where a dimension has size 1 (the same memory order: a view fixes them)."""
    return old.shape == new.shape and old.stride() != new.stride() and \
        all(a == b for n, a, b in zip(old.shape, old.stride(), new.stride()) if n != 1)


def restore_before(gm, before, x, old, fake):
    """Give ``before`` ``x`` with the eager strides ``old`` had: a view where only size-1 dims differ, else a copy."""
    new = _val(x)
    if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)):
        return None
    if _same_but_size_one(old, new):
        c = call(gm.graph, fake, aten.as_strided.default, x, list(old.shape), list(old.stride()),
                 new.storage_offset(), before=before)
    else:
        fmt = _eager_format(old, new)
        c = copy_before(gm, before, x, fmt, fake) if fmt is not None else None
    if c is not None:
        before.replace_input_with(x, c)
    return c


def _same_layout(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype \
            and a.storage_offset() == b.storage_offset()
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_layout(x, y) for x, y in zip(a, b))
    return not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor)


def to_channels_last(gm: fx.GraphModule, opts=None) -> int:
    """Rewrite ``gm`` in place as described above; returns how many convolution inputs changed."""
    convs = _convs(gm, devices(opts))
    if not convs or any(isinstance(s, torch.SymInt) for n in convs  # symbolic shapes: left alone
                        for v in [_val(n.args[CONVS[n.target][0]])] for s in (*v.shape, *v.stride())):
        return 0
    fake = fake_mode_of(gm)
    eager = {n: _val(n) for n in gm.graph.nodes}
    nhwc = {}   # value -> its channels-last copy (a convolution's input is shared with its backward)
    changed = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function":
            continue
        for i in convs.get(n, ()):
            a, v = n.args[i], _val(n.args[i])
            if i == WEIGHT[n.target]:   # a computed or input 4-D weight not NHWC already (a 1x1 one is both)
                convert = isinstance(a, fx.Node) and a.op != "get_attr" and isinstance(v, torch.Tensor) \
                    and v.dim() == 4 and not v.is_contiguous(memory_format=CL)
            else:
                convert = isinstance(a, fx.Node) and not _is_cl(v)
            if convert:
                if a not in nhwc:
                    nhwc[a] = copy_before(gm, n, a, CL, fake)
                n.update_arg(i, nhwc[a])
                changed += 1
        if n.target in VIEWS and _is_cl(_val(n.args[0])) and view_breaks(n, _val(n.args[0])):
            n.replace_input_with(n.args[0], copy_before(gm, n, n.args[0], torch.contiguous_format, fake))
        if n.target in STRIDED and isinstance(n.args[0], fx.Node):
            a = n.args[0]
            fmt = _eager_format(eager.get(a), _val(a))
            if fmt is not None and not _same_but_size_one(eager[a], _val(a)):
                n.replace_input_with(a, copy_before(gm, n, a, fmt, fake))
        if (n.target is operator.getitem or isinstance(n.target, torch._ops.OpOverload)) \
                and any(_val(a) is not eager.get(a) for a in n.all_input_nodes) \
                and _same_layout(infer_val(n, fake), eager[n]):
            n.meta["val"] = eager[n]   # unchanged: later nodes need no new fake value either
    if not changed:
        return 0
    nhwc_reductions(gm, fake)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    for a in list(out.all_input_nodes):
        restore_before(gm, out, a, eager.get(a), fake)
    gm.recompile()
    return changed


# -- reductions over N, H, W of a channels-last tensor (batch norm's statistics and its backward) --------
prims = torch.ops.prims
PRIM_REDUCTIONS = {prims.sum.default, prims.var.default, prims.amax.default, prims.amin.default}  # no keepdim
REDUCTIONS = {aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default,
              aten.var_mean.correction, aten.var.correction} | PRIM_REDUCTIONS
TO_NHWC, TO_NCHW = [0, 2, 3, 1], [0, 3, 1, 2]
NHWC_POS = {0: 0, 2: 1, 3: 2, 1: 3}   # NCHW dim -> its position in the NHWC view


def _dims_keepdim(n):
    dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", n.kwargs.get("dims"))
    if n.target in PRIM_REDUCTIONS:
        return dims, False
    positional = n.target not in (aten.var_mean.correction, aten.var.correction)
    keep = n.args[2] if positional and len(n.args) > 2 else n.kwargs.get("keepdim", False)
    return dims, bool(keep)


def nhwc_reductions(gm: fx.GraphModule, fake) -> int:
    """Reduce channels-last tensors through their NHWC view (``permute(x, [0, 2, 3, 1])``), reading
    contiguously (ResNet-50's BN statistics by rows strided by C ran 3x slower); returns how many."""
    done = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target not in REDUCTIONS or not _is_cl(_val(n.args[0])):
            continue
        dims, keep = _dims_keepdim(n)
        if dims is None:
            continue
        dims = sorted(d % 4 for d in dims)
        kept = [d for d in range(4) if d not in dims]
        if 1 in dims or 3 not in dims or (not keep and kept != [d for d in TO_NHWC if d in kept]):
            continue
        new_dims = sorted(NHWC_POS[d] for d in dims)
        g = gm.graph
        with g.inserting_before(n):
            view = call(g, fake, aten.permute.default, n.args[0], TO_NHWC)
            args, kwargs = list(n.args), dict(n.kwargs)
            args[0] = view
            if len(args) > 1:
                args[1] = new_dims
            else:
                kwargs["dims" if "dims" in kwargs else "dim"] = new_dims
            red = call(g, fake, n.target, *args, **kwargs)

            def back(v):
                return call(g, fake, aten.permute.default, v, TO_NCHW) if keep else v
            if isinstance(_val(n), (tuple, list)):
                for u in list(n.users):
                    if u.target is not operator.getitem:
                        break
                    with g.inserting_before(u):
                        u.replace_all_uses_with(back(call(g, fake, operator.getitem, red, u.args[1])))
                    g.erase_node(u)
                if n.users:   # a user other than getitem: leave it (both forms compute the same)
                    continue
            else:
                n.replace_all_uses_with(back(red))
        g.erase_node(n)
        done += 1
    return done


# -- layouts under freezing (freeze.py) ----------------------------------------------------------------
def convert_conv_weights(gm: fx.GraphModule, opts) -> int:
    """Make 4-D constant conv weights channels-last (folding stores them so) where the activations are too."""
    if not opts.layout_optimization:
        return 0
    fake, changed, on = fake_mode_of(gm), 0, devices(opts)
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not aten.convolution.default:
            continue
        w = n.args[1]
        val = _val(w)
        if w.op != "get_attr" or val is None or val.dim() != 4 or (on is not None and val.device.type not in on):
            continue
        n.replace_input_with(w, copy_before(gm, n, w, CL, fake))
        changed += 1
    return recompiled(gm, changed)


# Producers whose output layout is the library's choice, not meta['val']'s (oneDNN's channels-last
# convolutions); ops whose output layout does not follow their inputs'; ops that read through strides.
FREE_LAYOUT = {"mkldnn._convolution_pointwise.default"}
RESETS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.convolution.default, aten.clone.default,
          aten.contiguous.default}
ALL_STRIDED = {aten.as_strided.default, aten.as_strided_.default, aten.as_strided_scatter.default}


def _memory_format(val):
    if not isinstance(val, torch.Tensor):
        return None
    if val.is_contiguous():
        return torch.contiguous_format
    return CL if val.dim() == 4 and val.is_contiguous(memory_format=CL) else None


def pin_eager_strides(gm: fx.GraphModule, fake_mode=None) -> int:
    """Before each stride-sensitive reader (``as_strided``, a view the other layout breaks, the output) of a
    FREE_LAYOUT result: ``aten.contiguous(x, memory_format=<eager>)``, in place; returns how many."""
    fake_mode = fake_mode or fake_mode_of(gm)
    free: set = set()
    for n in gm.graph.nodes:
        name = f"{getattr(n.target, 'namespace', '')}.{getattr(n.target, '_opname', '')}." \
               f"{getattr(n.target, '_overloadname', '')}"
        if n.op == "call_function" and (name in FREE_LAYOUT or (n.target not in RESETS and
                                                                any(a in free for a in n.all_input_nodes))):
            free.add(n)
    pinned = 0
    for n in list(gm.graph.nodes) if free else ():
        is_call = n.op == "call_function"
        for a in [a for a in n.all_input_nodes if a in free]:
            val = a.meta.get("val")
            sensitive = n.op == "output" or is_call and n.target in ALL_STRIDED or (
                is_call and n.target in VIEWS and n.args[0] is a and val is not None and val.dim() == 4
                and view_breaks(n, torch.empty(list(val.shape), dtype=val.dtype, device="meta").to(memory_format=CL)))
            fmt = _memory_format(val)
            if not sensitive or fmt is None:
                continue
            n.replace_input_with(a, call(gm.graph, fake_mode, aten.contiguous.default, a, memory_format=fmt, before=n))
            pinned += 1
    return recompiled(gm, pinned)
