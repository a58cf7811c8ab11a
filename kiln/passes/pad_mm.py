"""Pad matmul dimensions that break tensor-core alignment.

cuBLAS runs its fast kernels only when K and every leading dimension are multiples of 16 bytes; GPT-2's
vocabulary (50257) misses that and its lm_head matmuls ran 4-7x slower (H200: 3.1 ms against 0.52 padded).
``mm(a, b)`` becomes ``mm(pad(a), pad(b))[:M, :N]`` with zeros, exactly the original values; a transposed
operand is padded in storage order, so one copy serves every reader. A 2-D product the graph returns is
computed in ``tuning.pad_mm_out_blocks`` blocks (``mm_rows``, ``mm_cols``), not materialized twice.
It pays (``tuning.pad_mm_*``) from 80 FLOPs per byte copied, each kernel it adds counted as 30 MB (padding
saves 1.5 / 300e12 s per FLOP, costs 1 / 2.5e12 s per byte and ~12 us per launch), which rejects memory-bound
shapes (decode-time logits) and small products (Mixer's 196 tokens: H200, 33 us plain, 69 padded and copied).
"""
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

from kiln.debug import log
from kiln.options import Tuning
from kiln.passes.constant_fold import fake_mode_of, infer_val, val

aten = torch.ops.aten

ALIGN = {torch.float16: 8, torch.bfloat16: 8, torch.float32: 4}
MATMULS = (aten.mm.default, aten.addmm.default, aten.bmm.default)
_PERMUTES = (aten.permute.default, aten.t.default, aten.transpose.int)


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _operands(node):
    """(a, b, bias-or-None) of a matmul node."""
    a = node.args
    return (a[1], a[2], a[0]) if node.target is aten.addmm.default else (a[0], a[1], None)


def plan(node: fx.Node, devices=("cuda",), kernel_bytes: float = Tuning.pad_mm_kernel_bytes,
         min_flops_per_byte: float = Tuning.pad_mm_min_flops_per_byte, out_blocks: int = Tuning.pad_mm_out_blocks):
    """(pad_m, pad_k, pad_n) for a matmul worth padding, else None (``devices=None``: any device)."""
    if node.op != "call_function" or node.target not in MATMULS:
        return None
    a, b, bias = _operands(node)
    av, bv, biasv, out = map(val, (a, b, bias, node))
    tensors = [v for v in (av, bv, out) if isinstance(v, torch.Tensor)]
    if len(tensors) != 3 or (bias is not None and not isinstance(biasv, torch.Tensor)):
        return None
    every = tensors + ([biasv] if bias is not None else [])
    if any(not isinstance(v, FakeTensor) or not all(isinstance(s, int) for s in (*v.shape, *v.stride()))
           for v in every):   # real constants, symbolic shapes: skip
        return None
    align = ALIGN.get(av.dtype)
    if align is None or bv.dtype != av.dtype or out.dtype != av.dtype or \
            (devices is not None and any(v.device.type not in devices for v in tensors)):
        return None
    batch = av.shape[0] if av.dim() == 3 else 1
    m, k = av.shape[-2:]
    n = bv.shape[-1]
    column_major = av.shape[-2] > 1 and av.stride(-2) == 1 and av.stride(-1) != 1
    pad_m = _round_up(m, align) - m if column_major else 0
    pad_k = _round_up(k, align) - k
    pad_n = _round_up(n, align) - n
    if not (pad_m or pad_k or pad_n):
        return None
    flops, size = 2 * batch * m * n * k, av.element_size()
    copies = [batch * (m * k + (m + pad_m) * (k + pad_k)) * size if pad_m or pad_k else 0,
              batch * (k * n + (k + pad_k) * (n + pad_n)) * size if pad_k or pad_n else 0,
              2 * batch * m * n * size if pad_n or (pad_m and av.dim() == 3) else 0]   # a sliced output's copy
    kernels = 2 * out_blocks if _blocked(node, pads := (pad_m, pad_k, pad_n)) else sum(c > 0 for c in copies)
    copied = sum(copies) + kernel_bytes * kernels
    if flops < min_flops_per_byte * copied:
        log(5, f"pad_mm: {node.name} misaligned but too small to pay ({flops:.3g} FLOPs, "
               f"{copied:.3g} bytes copied, launches counted)")
        return None
    return pads


def _blocked(node, pads) -> bool:
    """Whether the padded product goes by blocks (``mm_rows``, ``mm_cols``): 2-D, returned, misaligned in N."""
    return bool(pads[2] and not pads[0] and node.target is not aten.bmm.default and _returned(node)
                and node.meta["val"].is_contiguous())


class _Builder:
    """Creates nodes before ``anchor`` with their meta['val'] and shares padded tensors."""

    def __init__(self, gm: fx.GraphModule, fake_mode):
        self.g, self.fake_mode = gm.graph, fake_mode
        self.memo: dict = {}
        self.anchor = None

    def call(self, target, args, kwargs=None, like=None):
        with self.g.inserting_before(self.anchor):
            n = self.g.call_function(target, tuple(args), kwargs or {})
        if like is not None and "stack_trace" in like.meta:
            n.meta["stack_trace"] = like.meta["stack_trace"]
        infer_val(n, self.fake_mode)
        return n

    def padded(self, x: fx.Node, pads) -> fx.Node:
        """``x`` with ``pads[d]`` zeros appended on each dim d, padded in storage order."""
        if not any(pads):
            return x
        src, perm = _strip_permutes(x)
        sv = src.meta["val"]
        src_pads = [0] * sv.dim()
        for i, p in enumerate(perm):
            src_pads[p] = pads[i]
        phys = sorted(range(sv.dim()), key=lambda d: -sv.stride(d))   # outermost first, stable
        key = (src, tuple(phys), tuple(src_pads[d] for d in phys))
        if key not in self.memo:
            y = src if phys == sorted(phys) else self.call(aten.permute.default, (src, phys), like=x)
            flat = [x for d in reversed(range(len(phys))) for x in (0, src_pads[phys[d]])]
            while flat and flat[-1] == 0:
                flat = flat[:-2]
            self.memo[key] = self.call(aten.constant_pad_nd.default, (y, flat, 0.0), like=x)
        q = [phys.index(p) for p in perm]
        padded = self.memo[key]
        return padded if q == sorted(q) else self.call(aten.permute.default, (padded, q), like=x)


def _strip_permutes(x: fx.Node):
    """(src, perm) with ``x == src.permute(perm)``, looking through permute / t / transpose nodes."""
    perm = list(range(x.meta["val"].dim()))
    while isinstance(x, fx.Node) and x.op == "call_function" and x.target in _PERMUTES and not x.kwargs:
        y = x.args[0]
        if not isinstance(y, fx.Node) or not isinstance(y.meta.get("val"), torch.Tensor):
            break
        nd = y.meta["val"].dim()
        if nd != len(perm):
            break
        if x.target is aten.permute.default:
            p = [d % nd for d in x.args[1]]
        else:
            p = list(range(nd))
            d0, d1 = (0, 1) if x.target is aten.t.default else (x.args[1] % nd, x.args[2] % nd)
            if nd >= 2:
                p[d0], p[d1] = p[d1], p[d0]
        perm = [p[i] for i in perm]
        x = y
    return x, perm


def _bias_pads(biasv, out_shape, pad_m, pad_n):
    """Pads for an addmm bias broadcast to ``out_shape`` [M, N]: only dims that are not 1."""
    return [0 if biasv.shape[-i] == 1 else pad_n if i == 1 else pad_m for i in range(biasv.dim(), 0, -1)]


def _per_row(bias, m: int) -> bool:
    """Whether ``bias`` has a row per output row (sliced with the rows of a block), not broadcast over them."""
    return bias is not None and bias.dim() == 2 and bias.shape[0] == m and m > 1


def mm_rows(a: torch.Tensor, b: torch.Tensor, bias, n: int, rows: int, beta=1, alpha=1) -> torch.Tensor:
    """``beta * bias + alpha * a @ b`` (``bias`` None: mm) for ``b`` padded to [K, N'], as a contiguous [M, n]
    result made ``rows`` rows at a time: one block's padded product is alive, not a second result."""
    m = a.shape[0]
    out = a.new_empty((m, n))
    per_row = _per_row(bias, m)
    for i in range(0, m, rows):
        p = torch.mm(a[i:i + rows], b) if bias is None else \
            torch.addmm(bias[i:i + rows] if per_row else bias, a[i:i + rows], b, beta=beta, alpha=alpha)
        out[i:i + rows].copy_(p[:, :n])
        del p   # before the next block's product is allocated
    return out


def mm_cols(a: torch.Tensor, b: torch.Tensor, bias, align: int, cols: int, in_place: bool = True, beta=1,
            alpha=1) -> torch.Tensor:
    """``mm_rows`` for an unpadded ``b`` misaligned in N only, by blocks of ``cols`` columns, each in result
    rows not yet computed (``in_place``: ``_cols_into``) or in one allocated block."""
    out = a.new_empty((a.shape[0], b.shape[1]))
    if in_place:
        _cols_into(out, a, b, bias, align, cols, beta, alpha, levels=2)
    else:
        _col_blocks(out, a, b, bias, align, cols, beta, alpha, out.shape[0], lambda w: a.new_empty((a.shape[0], w)))
    return out


def _cols_into(out, a, b, bias, align, cols, beta, alpha, levels):
    """Fill ``out`` ([M, N], N misaligned) by blocks of ``cols`` columns through scratch in the rows not yet
    computed, then those rows so (``levels`` times), the last few in one misaligned product in place."""
    m, n = out.shape
    tail = -(-(m * cols + align) // (n + cols))   # rows whose storage holds R * cols elements, aligned
    if levels == 0 or tail >= m:
        if bias is None:
            torch.mm(a, b, out=out)
        else:
            torch.addmm(bias, a, b, beta=beta, alpha=alpha, out=out)
        return
    r = m - tail
    start, flat = _round_up(r * n, align), out.view(-1)
    _col_blocks(out, a, b, bias, align, cols, beta, alpha, r, lambda w: flat[start:start + r * w].view(r, w))
    _cols_into(out[r:], a[r:], b, bias[r:] if _per_row(bias, m) else bias, align, cols, beta, alpha, levels - 1)


def _col_blocks(out, a, b, bias, align, cols, beta, alpha, r, scratch_of):
    """Rows [0, r) of ``out`` by blocks of columns, each computed into ``scratch_of(width)``, then copied."""
    n, per_row = out.shape[1], _per_row(bias, out.shape[0])
    for j in range(0, n, cols):
        w = min(cols, n - j)
        pad = -w % align
        if b.stride(0) == 1 and pad and n >= w + pad:   # a Linear's transposed weight (its leading dimension K
            j, w, pad = n - w - pad, w + pad, 0          # is aligned): the last block widened leftwards, aligned
        bj = b[:, j:j + w]
        if pad or bj.stride(0) != 1:   # a misaligned width (cuBLAS's slow kernels, whatever the strides) or
            bj = torch.nn.functional.pad(bj, (0, pad))   # leading dimension (row-major, N): an aligned copy
        scratch = scratch_of(w + pad)
        if bias is None:
            torch.mm(a[:r], bj, out=scratch)
        else:
            cj = bias[:r] if per_row else bias
            cj = cj[..., j:j + w] if cj.shape[-1] == n and n > 1 else cj
            cj = torch.nn.functional.pad(cj, (0, pad)) if pad and cj.shape[-1] == w else cj
            torch.addmm(cj, a[:r], bj, beta=beta, alpha=alpha, out=scratch)
        out[:r, j:j + w].copy_(scratch[:, :w])
        del scratch   # before the next block's is allocated


_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _returned(node: fx.Node) -> bool:
    """Whether the graph returns ``node`` or a view of it (GPT-2's logits are ``mm(...).view(B, S, V)``)."""
    return any(u.op == "output" or (u.op == "call_function" and u.target in _VIEWS and _returned(u))
               for u in node.users)


def _rewrite(b: _Builder, node: fx.Node, pads, out_blocks: int = Tuning.pad_mm_out_blocks,
             in_place: bool = True) -> None:
    pad_m, pad_k, pad_n = pads
    a, bmat, bias = _operands(node)
    lead = [0] if node.target is aten.bmm.default else []
    b.anchor = node
    old, kwargs = node.meta["val"], dict(node.kwargs)
    m, n = old.shape[-2:]
    blocks = _blocked(node, pads)
    if blocks and not pad_k:   # blocks of columns: no padded copy of ``b``
        align = ALIGN[old.dtype]
        cols = _round_up(-(-n // out_blocks), align)
        out = b.call(mm_cols, (a, bmat, bias, align, cols, in_place), kwargs, like=node)
    else:
        new_a = b.padded(a, lead + [pad_m, pad_k])
        new_b = b.padded(bmat, lead + [pad_k, pad_n])
        new_bias = None if bias is None else b.padded(bias, _bias_pads(bias.meta["val"], old.shape, pad_m, pad_n))
        if blocks:   # K padded too: blocks of rows of the padded operands
            out = b.call(mm_rows, (new_a, new_b, new_bias, n, -(-m // out_blocks)), kwargs, like=node)
        else:
            args = (new_a, new_b) if bias is None else (new_bias, new_a, new_b)
            out = b.call(node.target, args, kwargs, like=node)
            if pad_m:
                out = b.call(aten.slice.Tensor, (out, -2, 0, m), like=node)
            if pad_n:
                out = b.call(aten.slice.Tensor, (out, -1, 0, n), like=node)
            if out.meta["val"].stride() != old.stride():
                out = b.call(aten.clone.default, (out,), {"memory_format": torch.contiguous_format}, like=node)
            new = out.meta["val"]
            assert (old.shape, old.stride(), old.dtype) == (new.shape, new.stride(), new.dtype), (old, new)
    node.replace_all_uses_with(out)
    b.g.erase_node(node)


def pad_matmuls(gm: fx.GraphModule, devices=("cuda",), *, kernel_bytes: float = Tuning.pad_mm_kernel_bytes,
                min_flops_per_byte: float = Tuning.pad_mm_min_flops_per_byte,
                out_blocks: int = Tuning.pad_mm_out_blocks, in_place: bool = True) -> int:
    """Pad misaligned mm / addmm / bmm nodes of ``gm`` in place where they pay (operands on ``devices``, any
    when None; the keywords: ``tuning.pad_mm_*``); returns how many. Needs fake values in meta['val']."""
    fake_mode = fake_mode_of(gm)
    if fake_mode is None:
        return 0
    todo = [(n, p) for n in gm.graph.nodes if (p := plan(n, devices, kernel_bytes, min_flops_per_byte, out_blocks))]
    if not todo:
        return 0
    builder = _Builder(gm, fake_mode)
    for node, pads in todo:
        log(5, f"pad_mm: {node.name} {tuple(node.meta['val'].shape)} padded by (M, K, N) = {pads}")
        _rewrite(builder, node, pads, out_blocks, in_place)
    gm.graph.eliminate_dead_code()   # views the old matmuls read
    gm.graph.lint()
    gm.recompile()
    return len(todo)
