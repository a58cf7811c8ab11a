"""Every kernel kiln generates for CUDA must compile for sm_90, checked on the CPU.

Graphs are traced on fake CUDA tensors (no GPU needed) so the Triton target emits compiled-mode
kernels, and ``sm90_check.compile_for_target`` runs Triton's real frontend and ``ptxas`` on each. A
failure here is the ``CompilationError`` a user would hit at the kernel's first launch on a GPU.
"""
from __future__ import annotations

import math
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from kiln.options import Tuning
from tests.codegen.sm90_check import compile_for_target
from tests.codegen.util import decompositions, fuse, kernels


def _toolchain_missing():
    try:
        import triton
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except Exception as e:  # pragma: no cover - environment
        return f"triton is not importable ({e})"
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not (os.path.exists(ptxas) or shutil.which("ptxas")):
        return f"no ptxas (looked for {ptxas} and on PATH)"
    return None


pytestmark = pytest.mark.skipif(_toolchain_missing() is not None, reason=str(_toolchain_missing()))


def _grad(fn, n_diff):
    """fn's outputs and the gradients of its first ``n_diff`` inputs (one traced graph)."""
    def run(*args):
        diff = args[:n_diff]
        out = fn(*args)
        outs = out if isinstance(out, tuple) else (out,)
        loss = sum(o.float().sum() for o in outs)
        return outs + tuple(torch.autograd.grad(loss, diff))
    return run


def _to_cuda(gm):
    """Point every device argument of ``gm`` at CUDA (graphs are first traced on the CPU, where
    autograd can run without a CUDA runtime)."""
    cpu = torch.device("cpu")
    for n in gm.graph.nodes:
        if n.kwargs.get("device") in (cpu, "cpu"):
            n.kwargs = {**n.kwargs, "device": torch.device("cuda", 0)}
    gm.recompile()
    return gm


def _compile_all(fn, shapes, dtype=torch.float32, n_diff=0, int_args=(), autocast=False, extra=()):
    """Trace ``fn`` (with its backward) on the CPU, retrace the ATen graph on fake CUDA tensors,
    fuse it and compile every kernel for sm_90."""
    cpu_args = [torch.randn(s, dtype=dtype) for s in shapes] + [torch.randint(0, hi, s) for s, hi in int_args]
    for a in cpu_args[:n_diff]:
        a.requires_grad_(True)
    f = _grad(fn, n_diff) if n_diff else fn
    if extra:   # parameters after integer inputs: differentiate them, not the integers
        params = [torch.randn(s, dtype=dtype, requires_grad=True) for s in extra]
        n_int = len(cpu_args)

        def f(*a):
            out = fn(*a)
            return (out,) + torch.autograd.grad(out, a[n_int:])
        cpu_args += params
    if autocast:
        inner = f

        def f(*a):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return inner(*a)
    gm = _to_cuda(make_fx(f, decomposition_table=decompositions(), tracing_mode="fake")(*cpu_args))
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        args = [torch.empty(a.shape, dtype=a.dtype, device="cuda") for a in cpu_args]
        gm = make_fx(gm, decomposition_table=decompositions())(*args)
    n = fuse(gm, args)
    assert n > 0 and kernels(gm)
    done = set()
    for node in gm.graph.nodes:
        k = node.target
        if hasattr(k, "source") and k.name not in done:
            assert not k.interpret
            done.add(k.name)
            compile_for_target(k, [a.meta["val"] if hasattr(a, "meta") else a for a in node.args])
    return gm


def _attn(q, k, v, causal=True):
    T = q.shape[-2]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        mask = torch.tril(torch.ones(T, T, device=q.device, dtype=torch.bool))
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ v


def _gpt2_block(x, w_ln1, b_ln1, w_qkv, b_qkv, w_proj, w_ln2, b_ln2, w_fc, w_out):
    B, T, C = x.shape
    H = 2
    h = F.layer_norm(x, (C,), w_ln1, b_ln1)
    q, k, v = (h @ w_qkv + b_qkv).split(C, dim=2)
    q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
    s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(C // H))
    mask = torch.tril(torch.ones(T, T, device=x.device)).view(1, 1, T, T)
    s = s.masked_fill(mask == 0, float("-inf"))
    p = F.dropout(torch.softmax(s, dim=-1), 0.1, True)
    a = (p @ v).transpose(1, 2).contiguous().view(B, T, C)
    x = x + F.dropout(a @ w_proj, 0.1, True)
    h = F.gelu(F.layer_norm(x, (C,), w_ln2, b_ln2) @ w_fc, approximate="tanh")
    return x + F.dropout(h @ w_out, 0.1, True)


GPT2_SHAPES = [(2, 8, 32), (32,), (32,), (32, 96), (96,), (32, 32), (32,), (32,), (32, 128), (128, 32)]


def test_pointwise_fp32_bf16():
    def f(x, y):
        xb, yb = x.to(torch.bfloat16), y.to(torch.bfloat16)
        return ((F.silu(x) * y + 1).tanh() + torch.where(x > y, x.exp(), y.abs()),
                (F.silu(xb) * yb + 1).tanh().float() + (xb > 0).to(torch.int32))
    _compile_all(f, [(33, 17), (33, 17)])


def test_layer_norm_fwd_bwd():
    _compile_all(lambda x, w, b: F.layer_norm(x, (64,), w, b), [(8, 64), (64,), (64,)], n_diff=3)


def test_long_row_reductions():
    _compile_all(lambda x: (torch.softmax(x, -1), x.sum(0), x.amax(-1)), [(4, 5000)], n_diff=1)


def test_softmax_cross_entropy():
    _compile_all(lambda x, y: F.cross_entropy(x, y) + torch.log_softmax(x, -1).mean(), [(8, 100)],
                 n_diff=1, int_args=[((8,), 100)])


def test_chained_tail_and_last_program_kernels():
    """A layer norm backward at 8192x4096: dx by rows with the weight and bias gradients' partials
    folded into the row kernel (one program per chunk of rows), then their final pass; a split full
    sum whose final pass is chained into its partial kernel; a loss whose mean over 8192 rows is
    combined by the row kernel's last program: the counter, the barrier, the helper call and the .cg
    loads compile."""
    def bwd(g, x, mean, rstd, w, b):
        return torch.ops.aten.native_layer_norm_backward.default(g, x, [x.shape[-1]], mean, rstd, w, b,
                                                                 [True, True, True])
    gm = _compile_all(bwd, [(8192, 4096), (8192, 4096), (8192, 1), (8192, 1), (4096,), (4096,)])
    assert len(kernels(gm)) == 2   # dx and the column partials by rows; the partials' final pass
    assert any("xpid" in k.source and "_col0" in k.source for k in kernels(gm))
    gm = _compile_all(lambda x: x.sum(), [(4096, 1024)])
    assert len(kernels(gm)) == 1 and "_tail(" in kernels(gm)[0].source
    gm = _compile_all(lambda x, y: F.cross_entropy(x, y), [(8192, 50257)], int_args=[((8192,), 50257)])
    assert len(kernels(gm)) == 1
    _compile_all(lambda x, y: F.cross_entropy(x, y), [(8192, 1000)], n_diff=1, int_args=[((8192,), 1000)])
    import kiln.runtime.kernels as K
    sources = [k.source for k in K._CACHE.values() if not k.interpret]
    assert any("_tail(" in s and "cache_modifier='.cg'" in s for s in sources)
    assert any("part_ptr0" in s and "atomic_xchg" in s for s in sources)
    # a split column sum too wide to fold (5000 columns): its chained final steps over the columns in
    # tiles of tuning.tail_tile elements (64 columns at most, before)
    import re
    gm = _compile_all(lambda x: x.sum(0), [(65536, 5000)])
    calls = re.findall(r"_tail\((?:\w+, )+(\d+), (\d+)\)", kernels(gm)[0].source)
    assert len(kernels(gm)) == 1 and calls and int(calls[0][0]) * int(calls[0][1]) >= Tuning().tail_tile, calls


def test_rms_norm_bf16():
    def rms(x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w
    _compile_all(rms, [(8, 64), (64,)], torch.bfloat16, n_diff=2)


def test_embedding_index():
    def emb(w, pos, idx):
        return F.embedding(idx, w) + pos[torch.arange(idx.shape[1], device=idx.device)]
    _compile_all(emb, [(50, 16), (8, 16)], n_diff=2, int_args=[((2, 8), 50)])


def test_attention_block():
    def block(x, wq, wk, wv):
        q, k, v = x @ wq, x @ wk, x @ wv
        return F.layer_norm(x + _attn(q, k, v), (16,))
    _compile_all(block, [(2, 8, 16), (16, 16), (16, 16), (16, 16)], n_diff=4)


def test_gpt2_block_bf16_autocast():
    _compile_all(_gpt2_block, GPT2_SHAPES, n_diff=len(GPT2_SHAPES), autocast=True)


def _hf_gpt2(ids, labels, wte, wpe, ln_w, ln_b, c_attn_w, c_attn_b, c_proj_w, c_proj_b, fc_w, fc_b, out_w, out_b):
    """HuggingFace GPT-2's ops: Conv1D (addmm), gelu_new (pow 3.0), finfo.min causal mask,
    tied lm_head and a shifted cross-entropy over a 50257-word vocabulary."""
    B, T = ids.shape
    C = wte.shape[1]
    H = 2
    pos = torch.arange(0, T, dtype=torch.long, device=ids.device).unsqueeze(0)
    x = F.dropout(wte[ids] + wpe[pos], 0.1, True)
    h = F.layer_norm(x, (C,), ln_w, ln_b, 1e-5)
    qkv = torch.addmm(c_attn_b, h.view(-1, C), c_attn_w).view(B, T, 3 * C)
    q, k, v = (t.view(B, T, H, C // H).permute(0, 2, 1, 3) for t in qkv.split(C, dim=2))
    w = torch.matmul(q, k.transpose(-1, -2)) / torch.full([], v.size(-1) ** 0.5, dtype=q.dtype, device=q.device)
    causal = torch.tril(torch.ones((T, T), dtype=torch.bool, device=ids.device)).view(1, 1, T, T)
    w = torch.where(causal, w.to(q.dtype), torch.full([], torch.finfo(w.dtype).min, dtype=w.dtype, device=w.device))
    w = F.dropout(F.softmax(w, dim=-1).type(v.dtype), 0.1, True)
    a = torch.matmul(w, v).permute(0, 2, 1, 3).contiguous().view(B, T, C)
    x = x + F.dropout(torch.addmm(c_proj_b, a.view(-1, C), c_proj_w).view(B, T, C), 0.1, True)
    h = torch.addmm(fc_b, F.layer_norm(x, (C,), ln_w, ln_b, 1e-5).view(-1, C), fc_w)
    h = 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))
    x = x + F.dropout(torch.addmm(out_b, h, out_w).view(B, T, C), 0.1, True)
    logits = F.layer_norm(x, (C,), ln_w, ln_b, 1e-5) @ wte.t()
    shift = logits[..., :-1, :].contiguous()
    return F.cross_entropy(shift.view(-1, shift.size(-1)), labels[..., 1:].contiguous().view(-1), ignore_index=-100)


HF_SHAPES = [(50257, 32), (64, 32), (32,), (32,), (32, 96), (96,), (32, 32), (32,), (32, 128), (128,), (128, 32), (32,)]


def test_hf_gpt2_like():
    _compile_all(lambda ids, labels, *p: _hf_gpt2(ids, labels, *p), [], n_diff=0,
                 int_args=[((2, 16), 50257), ((2, 16), 50257)], extra=HF_SHAPES)


def test_integer_and_bool_reductions():
    def f(x, i):
        return (x.argmax(-1), x.argmin(0), i.amax(-1), i.amin(-1), (x > 0).any(-1), (x > 0).all(-1),
                x.prod(-1), i.sum(-1), torch.where(i > 50, i, torch.iinfo(torch.int64).min).amax(-1))
    _compile_all(f, [(16, 40)], int_args=[((16, 40), 100)])


@pytest.mark.parametrize("cols", [64, 5000])   # persistent and looped rows
def test_scalar_load_in_masked_region(cols):
    """The GPT-2 crash: a load at a constant address (the loss normaliser) inside a padded
    (masked) region got the block mask on a scalar pointer, which Triton rejects at compile time."""
    def f(x, s):
        y = F.pad(x / s, (0, 1, 0, 1))
        return y, y.sum(-1)
    _compile_all(f, [(8, cols), ()])


def test_scatter_add_to_one_row():
    """index_put with accumulate (embedding backward), including every value going to one row."""
    def f(w, v, i, j):
        z = torch.zeros_like(w)
        return (torch.ops.aten.index_put(z, [i], v, True),
                torch.ops.aten.index_put(z[:, 0], [j[:1]], v[:1, 0] * 2, True))
    _compile_all(f, [(10, 8), (12, 8)], int_args=[((12,), 10), ((12,), 10)])


def test_max_pool_forward_and_backward():
    """kiln's max-pool decomposition (window slices, flat int64 indices) and its backward."""
    def f(x):
        y, i = F.max_pool2d(torch.relu(x), 3, 2, 1, return_indices=True)
        return y * 2, i
    assert kernels(_compile_all(f, [(2, 4, 9, 9)], n_diff=1))
