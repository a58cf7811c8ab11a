"""The decomposition table AOTAutograd uses, by target: the ATen target keeps composite ops whole (fewer,
faster library calls); the fusing targets (Triton, C++) decompose to the core ATen set plus the forward
norms, softmax and activations, so the fusion scheduler sees pointwise ops and simple reductions.
"""
import functools

import torch
import torch._prims  # noqa: F401  (registers the prims namespace)
from torch._decomp import core_aten_decompositions, get_decompositions
from torch._prims_common import make_contiguous_strides_for
from torch.fx.experimental.symbolic_shapes import statically_known_true

aten = torch.ops.aten
prims = torch.ops.prims

# Small composite ops that AOTAutograd would otherwise keep and that run faster decomposed even on ATen.
ATEN_EXTRA = [
    aten.hardsigmoid_backward, aten.hardswish_backward, aten.silu_backward, aten.mish_backward,
    aten.softplus_backward, aten.sigmoid_backward, aten.tanh_backward, aten.threshold_backward,
]

# Ops the fusing target wants in pieces, on top of the core table.
FUSION_EXTRA = [
    aten.native_layer_norm, aten.native_layer_norm_backward, aten._softmax, aten._log_softmax,
    aten._softmax_backward_data, aten._log_softmax_backward_data, aten.gelu, aten.gelu_backward,
    aten.native_dropout, aten.embedding, aten.embedding_dense_backward, aten.nll_loss_forward,
    aten.nll_loss_backward, aten._native_batch_norm_legit_functional,
    aten.native_batch_norm_backward,
    aten.native_group_norm, aten.native_group_norm_backward, aten.mean, aten.var_mean, aten.addcmul,
    aten.linalg_vector_norm,   # wrapped by _vector_norm
]

# native_batch_norm is left out: on torch 2.11 its decomposition (and eval BatchNorm's) goes through the
# mutating _native_batch_norm_legit, which AOTAutograd rejects; the fusing target gets ``_batch_norm_eval``.


def _batch_norm_eval(x, weight, bias, running_mean, running_var, momentum, eps):
    """``_native_batch_norm_legit_no_training`` as pointwise ops (math in float32 for half inputs, as ATen),
    so that eval BatchNorm fuses; the statistics outputs are eager's (CPU: empty tensors)."""
    acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    shape = [1, -1] + [1] * (x.dim() - 2)
    invstd = torch.rsqrt(running_var.to(acc) + eps)
    scale = invstd * weight.to(acc) if weight is not None else invstd
    out = (x.to(acc) - running_mean.to(acc).reshape(shape)) * scale.reshape(shape)
    out = out + bias.to(acc).reshape(shape) if bias is not None else out
    if x.device.type == "cpu":
        return out.to(x.dtype), x.new_zeros((0,)), x.new_zeros((0,))
    return out.to(x.dtype), running_mean.to(acc, copy=True), invstd


def _broadcast_in_dim(a, shape, broadcast_dimensions):
    """``prims.broadcast_in_dim`` (keepdim reductions) as ``unsqueeze`` and ``expand``: AOTAutograd cannot
    functionalize a view-returning prim, so compiled autograd could not retrace a graph holding it."""
    out = a
    for d in range(len(shape)):
        if d not in broadcast_dimensions:
            out = aten.unsqueeze.default(out, d)
    if not all(statically_known_true(s == t) for s, t in zip(out.shape, shape)):
        out = aten.expand.default(out, list(shape))
    return out


def _vector_norm(decomposition):
    """torch's ``linalg_vector_norm`` with eager's shape (2.11's keeps size-1 reduced dims; fuzz seed 10 #5563)."""
    def decompose(x, ord=2, dim=None, keepdim=False, *, dtype=None):
        out = decomposition(x, ord, dim, keepdim, dtype=dtype)
        if keepdim or out.dim() != x.dim() or x.dim() == 0:
            return out
        dims = range(x.dim()) if dim is None or (isinstance(dim, (list, tuple)) and not dim) else \
            [dim] if isinstance(dim, int) else dim
        gone = {d % x.dim() for d in dims}
        return out.reshape([s for i, s in enumerate(x.shape) if i not in gone])
    return decompose


def _pair(v, default=None):
    if v is None or (isinstance(v, (list, tuple)) and len(v) == 0):
        return default
    return (v, v) if isinstance(v, int) else (v[0], v[len(v) > 1])


def _max_pool2d_with_indices(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    """2-D max pooling as a running maximum of strided slices with ATen's flat indices (first maximum, NaN
    wins), fusing with the ReLU before it. Dilation, 3-D and integer inputs keep the ATen kernel; symbolic
    heights or widths keep the node, which ``codegen/lower/index.py`` lowers alike (its ~80 ops traced over
    symbolic sizes took seconds a graph, #35)."""
    kh, kw = _pair(kernel_size)
    sh, sw = _pair(stride, (kh, kw))
    ph, pw = _pair(padding)
    if _pair(dilation) != (1, 1) or x.dim() != 4 or not x.is_floating_point() \
            or not all(isinstance(v, int) for v in (kh, kw, sh, sw, ph, pw, *x.shape[-2:])):
        return NotImplemented
    H, W = x.shape[-2:]

    def size(n, k, s, p):   # output length; ceil mode keeps a window that starts inside the input or left padding
        o = -(-(n + 2 * p - k) // s) + 1 if ceil_mode else (n + 2 * p - k) // s + 1
        return o - 1 if ceil_mode and (o - 1) * s >= n + p else o
    oh, ow = size(H, kh, sh, ph), size(W, kw, sw, pw)
    eh, ew = max(0, (oh - 1) * sh + kh - H - 2 * ph), max(0, (ow - 1) * sw + kw - W - 2 * pw)
    xp = aten.constant_pad_nd(x, [pw, pw + ew, ph, ph + eh], float("-inf")) if ph or pw or eh or ew else x
    rows = torch.arange(oh, device=x.device).mul(sh).sub(ph).reshape(oh, 1)
    cols = torch.arange(ow, device=x.device).mul(sw).sub(pw).reshape(1, ow)
    base = rows * W + cols   # the flat index of each window's top-left corner
    best = where = None
    for i in range(kh):
        for j in range(kw):
            v, idx = xp[:, :, i:i + sh * (oh - 1) + 1:sh, j:j + sw * (ow - 1) + 1:sw], base + (i * W + j)
            if best is None:
                best, where = v, idx.expand(v.shape)
                continue
            take = (v > best) | torch.isnan(v)
            best, where = torch.where(take, v, best), torch.where(take, idx, where)
    if ph or pw:
        # a maximum of -inf may sit on the padding: ATen starts each window at its first real element
        # and keeps it then, so the index points inside the input (the backward writes through it)
        first = rows.clamp(min=0) * W + cols.clamp(min=0)
        where = torch.where(best == float("-inf"), first, where)
    return best, where


# Ops that must stay whole: library calls no decomposition beats (eval BatchNorm: on the ATen target only).
KEEP = [aten.convolution, aten.convolution_backward, aten.mm, aten.addmm, aten.bmm, aten.baddbmm,
        aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_efficient_attention,
        aten._scaled_dot_product_cudnn_attention, aten._scaled_dot_product_flash_attention_for_cpu,
        aten._native_batch_norm_legit_no_training]


def _scatter_into_dense(op):
    """``op`` (slice/select/diagonal_scatter) with an expanded input made dense first: torch 2.11's meta keeps
    the zero strides eager drops, and kernels wrote every element to one address (fuzz seed 10 #409)."""
    def decompose(x, *args, **kwargs):
        if not any(st == 0 and statically_known_true(n > 1) for n, st in zip(x.shape, x.stride())):   # not expanded
            return NotImplemented
        return op(aten.clone.default(x, memory_format=torch.contiguous_format), *args, **kwargs)
    return decompose


DENSE_RESULT = [aten.slice_scatter.default, aten.select_scatter.default, aten.diagonal_scatter.default]


def _angle(x):
    """Complex ``angle`` as ``atan2(imag, real)``: its meta keeps the input's strides where eager returns a
    dense result, and kernels read the wrong elements (fuzz seed 10 #467). Real inputs keep the op whole."""
    return aten.atan2.default(aten.imag.default(x), aten.real.default(x)) if x.is_complex() else NotImplemented


@functools.lru_cache(maxsize=None)
def _table(fusion: bool):
    table = {**core_aten_decompositions(), **get_decompositions(FUSION_EXTRA)} if fusion else \
        dict(get_decompositions(ATEN_EXTRA))
    for op in [getattr(packet, name) for packet in KEEP for name in packet.overloads()]:
        table.pop(op, None)
    if fusion:
        table[aten._native_batch_norm_legit_no_training.default] = _batch_norm_eval
        table[aten.max_pool2d_with_indices.default] = _max_pool2d_with_indices
        table[aten.linalg_vector_norm.default] = _vector_norm(table[aten.linalg_vector_norm.default])
        table = {op: _real_only(fn, DECLINE.get(op)) for op, fn in table.items()}
    table[prims.broadcast_in_dim.default] = _broadcast_in_dim   # the references of keepdim reductions call it
    # before the table's own decomposition, if it has one (complex inputs too: not wrapped by _real_only)
    for op, first in [(aten.angle.default, _angle)] + [(op, _scatter_into_dense(op)) for op in DENSE_RESULT]:
        table[op] = _then(first, table[op]) if table.get(op) is not None else first
    return table


def _then(first, second):
    """``first``, or ``second`` where ``first`` declines."""
    def decompose(*args, **kwargs):
        out = first(*args, **kwargs)
        return second(*args, **kwargs) if out is NotImplemented else out
    return decompose


# Inputs on which torch's decomposition of an op is wrong, so the op stays one ATen call: index_add of a
# bool source with ``alpha``, index_add / index_copy into or from an empty tensor (its index_put checks
# indices eager never reads: fuzz seed 10 #1016, 11 #4177); softmax of an integer tensor; index_fill of a
# tensor without contiguous strides (torch 2.11 restores them with an in-place copy AOTAutograd rejects).
DECLINE = {aten.index_add.default: lambda x, dim, index, source, *, alpha=1:
           (x.dtype == torch.bool and alpha != 1) or x.numel() == 0,
           aten.index_copy.default: lambda x, dim, index, source, *a, **k:
           x.numel() == 0 or source.numel() == 0,
           **dict.fromkeys((aten._softmax.default, aten._log_softmax.default),
                           lambda x, *a, **k: not x.is_floating_point()),
           **dict.fromkeys((aten.index_fill.int_Scalar, aten.index_fill.int_Tensor), lambda x, *a, **k:
                           tuple(x.stride()) != tuple(make_contiguous_strides_for(x.shape)))}


def _complex(value) -> bool:
    return value.is_complex() if isinstance(value, torch.Tensor) else \
        isinstance(value, (list, tuple)) and any(_complex(v) for v in value)


def _real_only(decomposition, declines=None):
    """``decomposition``, declining (``NotImplemented``) on complex tensors (no kernel computes them; some of
    torch's decompositions fail on them) and where ``declines(*args, **kwargs)`` (``DECLINE``)."""
    @functools.wraps(decomposition)
    def decompose(*args, **kwargs):
        declined = _complex(args) or _complex(tuple(kwargs.values())) or (declines and declines(*args, **kwargs))
        return NotImplemented if declined else decomposition(*args, **kwargs)
    return decompose


def _fma(a, b, c):
    """``prims.fma`` (Dynamo's ``addcmul_``/``addcdiv_``/``add_`` of Adam steps) as ATen ops that fuse."""
    return aten.add.Tensor(aten.mul.Tensor(a, b), c)


def decomposition_table(fusion: bool = False) -> dict:
    """The op -> decomposition dict of the ATen target, or with ``fusion`` of the fusing targets (a fresh
    copy); the ``fma`` prim exists once Dynamo has registered it, so it is looked up at each call."""
    table = dict(_table(fusion))
    if fusion:
        table.update(_foreach_table())
    fma = getattr(getattr(torch.ops.prims, "fma", None), "default", None)
    if fma is not None:
        table[fma] = _fma
    return table


# torch.optim's multi-tensor steps (its default on CUDA) as one op per tensor, so that each parameter's update
# fuses into one kernel (torch has no decomposition for them). addcmul/addcdiv's ``.Tensor`` overloads hold one
# scalar per tensor in a tensor: they stay ATen calls.
_FOREACH = ("add", "sub", "mul", "div", "addcmul", "addcdiv", "lerp", "sqrt", "rsqrt", "exp", "log", "neg", "abs",
            "reciprocal", "sign", "sigmoid", "tanh", "maximum", "minimum", "clamp_min", "clamp_max", "pow", "copy")


def _per_tensor(base, positional=None):
    """The foreach op as ``base`` per tensor; its arguments after the first ``positional`` (None: all are
    positional) are keywords of ``base`` (addcmul's ``value``)."""
    def decompose(*args, **kwargs):
        n = next(len(a) for a in args if isinstance(a, (list, tuple)))
        kwargs.update(zip(("value",), args[positional:] if positional is not None else ()))
        at = lambda a, j: a[j] if isinstance(a, (list, tuple)) else a   # noqa: E731
        return [base(*(at(a, j) for a in args[:positional]), **{k: at(v, j) for k, v in kwargs.items()})
                for j in range(n)]
    return decompose


@functools.lru_cache(None)
def _foreach_table() -> dict:
    table = {}
    for name in _FOREACH:
        packet, base = getattr(aten, f"_foreach_{name}", None), getattr(aten, name, None)
        for ov in packet.overloads() if packet is not None and base is not None else ():
            if "out" not in ov and not (ov == "Tensor" and name in ("addcmul", "addcdiv")):
                table[getattr(packet, ov)] = _per_tensor(base, 3 if name in ("addcmul", "addcdiv") else None)
    return table
