"""The user suite (``kiln bench --suite user --device cpu``): ordinary models as a user brings them to a CPU.

Issue #37 measured ten such workloads and found kiln no faster than eager on them, while the README quoted
micro cases; these are those workloads, written as users write them (``torch.nn`` layers, their default
dropout, ``torch.utils.checkpoint``, AdamW), at sizes where a step takes milliseconds on a 2-core CPU:

- a ``TransformerEncoderLayer`` trained (AdamW), in inference, and in inference under bf16 autocast;
- an MLP with dropout trained; a 1D-convolution audio classifier trained (M5-style, raw waveform);
- a small CNN trained, in inference, and in inference with ``options={"freezing": True}``;
- four residual MLP blocks, each under ``torch.utils.checkpoint`` (non-reentrant), trained;
- a small causal language model trained with AdamW (the optimizer step is part of every timed step);
- ``torch.compile(opt.step)``: a compiled AdamW step over eight Linear layers.

Training rows keep their dropout on in the timed steps; the check against eager runs with it off
(``kiln_bench.dropout.no_random``). ``size='tiny'`` is for tests; every other size builds the CPU shapes.
"""
from __future__ import annotations

import copy
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from kiln_bench.case import Case, ModelWorkload, Workload


def _tiny(size) -> bool:
    return size == "tiny"


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def _xent(out, batch):
    return F.cross_entropy(out.float(), batch[1])


def _mse(out, batch):
    return F.mse_loss(out.float(), batch[1])


def _first(f, batch):
    return f(batch[0])   # the rest of the batch is the loss's (labels, targets)


# --- the encoder layer -----------------------------------------------------------------------------------
def _encoder(device, dtype, size, train=True, bf16=False):
    """``nn.TransformerEncoderLayer`` (d 128, 4 heads, FFN 512, dropout 0.1, batch first) on 8 x 64 tokens:
    train on an MSE regression with AdamW, or inference (fp32, or bf16 autocast)."""
    torch.manual_seed(0)
    d, ffn, heads, (b, t) = (32, 64, 2, (2, 8)) if _tiny(size) else (128, 512, 4, (8, 64))
    layer = nn.TransformerEncoderLayer(d, heads, ffn, dropout=0.1, batch_first=True).to(device)
    x = torch.randn(b, t, d, device=device)
    if train:
        return ModelWorkload(layer, (x, torch.randn(b, t, d, device=device)), "fp32", loss=_mse,
                             optimizer=_adamw, call=_first)
    return ModelWorkload(layer, (x,), "amp_bf16" if bf16 else "fp32", train=False,
                         autocast=torch.bfloat16 if bf16 else None)


# --- an MLP with dropout ---------------------------------------------------------------------------------
def _mlp(device, dtype, size):
    """Linear 256-512-512-10 with GELU and dropout 0.1 after each hidden layer, batch 64, cross-entropy, AdamW."""
    torch.manual_seed(0)
    i, h, b = (16, 32, 4) if _tiny(size) else (256, 512, 64)
    model = nn.Sequential(nn.Linear(i, h), nn.GELU(), nn.Dropout(0.1), nn.Linear(h, h), nn.GELU(),
                          nn.Dropout(0.1), nn.Linear(h, 10)).to(device)
    batch = (torch.randn(b, i, device=device), torch.randint(0, 10, (b,), device=device))
    return ModelWorkload(model, batch, "fp32", loss=_xent, optimizer=_adamw, call=_first)


# --- a 1D-convolution audio classifier -------------------------------------------------------------------
class AudioNet(nn.Module):
    """M5-style classifier on a raw waveform: a strided wide first convolution, then conv-BN-ReLU-maxpool
    stages, global average pooling over time and a linear head."""

    def __init__(self, width: int = 32, classes: int = 10):
        super().__init__()
        w = width

        def stage(cin, cout, k, stride=1):   # no conv bias before BatchNorm (its gradient is zero: noise)
            return [nn.Conv1d(cin, cout, k, stride=stride, bias=False), nn.BatchNorm1d(cout), nn.ReLU(),
                    nn.MaxPool1d(4)]
        self.features = nn.Sequential(*stage(1, w, 80, 4), *stage(w, w, 3), *stage(w, 2 * w, 3),
                                      *stage(2 * w, 2 * w, 3))
        self.head = nn.Linear(2 * w, classes)

    def forward(self, x):
        return self.head(self.features(x).mean(-1))


def _audio(device, dtype, size):
    """AudioNet (width 32) on 8 half-second 8 kHz waveforms, cross-entropy, SGD with momentum."""
    torch.manual_seed(0)
    w, b, n = (8, 2, 2000) if _tiny(size) else (32, 8, 4000)
    model = AudioNet(w).to(device)
    batch = (torch.randn(b, 1, n, device=device), torch.randint(0, 10, (b,), device=device))
    return ModelWorkload(model, batch, "fp32", loss=_xent, optimizer=_sgd, call=_first)


# --- a small CNN -----------------------------------------------------------------------------------------
class SmallCNN(nn.Module):
    """Three VGG-style stages (two conv3x3-BN-ReLU, then max-pool) of 16/32/64 channels, average pool, linear."""

    def __init__(self, width: int = 16, classes: int = 10):
        super().__init__()
        layers, cin = [], 3
        for cout in (width, 2 * width, 4 * width):
            for _ in range(2):
                layers += [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]
                cin = cout
            layers.append(nn.MaxPool2d(2))
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(cin, classes)

    def forward(self, x):
        return self.head(torch.flatten(F.adaptive_avg_pool2d(self.features(x), 1), 1))


def _cnn(device, dtype, size, train=True):
    """SmallCNN on 16 images of 32x32 (train: cross-entropy, SGD with momentum; inference: the logits)."""
    torch.manual_seed(0)
    w, b, hw = (4, 2, 8) if _tiny(size) else (16, 16, 32)
    model = SmallCNN(w).to(device)
    x = torch.randn(b, 3, hw, hw, device=device)
    if train:
        return ModelWorkload(model, (x, torch.randint(0, 10, (b,), device=device)), "fp32", loss=_xent,
                             optimizer=_sgd, call=_first)
    return ModelWorkload(model, (x,), "fp32", train=False)


# --- checkpointed blocks ---------------------------------------------------------------------------------
class CheckpointedMLP(nn.Module):
    """Residual blocks ``x + fc2(dropout(gelu(fc1(ln(x)))))``, each run under ``torch.utils.checkpoint``
    (non-reentrant): its activations are recomputed in the backward instead of saved."""

    def __init__(self, d: int, hidden: int, blocks: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, hidden), nn.GELU(), nn.Dropout(0.1),
                                                  nn.Linear(hidden, d)) for _ in range(blocks))

    def forward(self, x):
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=False)
        return x


def _checkpointed(device, dtype, size):
    """CheckpointedMLP (4 blocks, d 128, hidden 512) on 8 x 32 tokens, MSE regression, AdamW."""
    torch.manual_seed(0)
    d, h, (b, t) = (16, 32, (2, 8)) if _tiny(size) else (128, 512, (8, 32))
    model = CheckpointedMLP(d, h).to(device)
    batch = (torch.randn(b, t, d, device=device), torch.randn(b, t, d, device=device))
    return ModelWorkload(model, batch, "fp32", loss=_mse, optimizer=_adamw, call=_first)


# --- a small language model ------------------------------------------------------------------------------
class SmallLM(nn.Module):
    """Token and learned position embeddings, a causal ``nn.TransformerEncoder`` (pre-norm, dropout 0.1),
    a final LayerNorm and a linear head; ``forward(ids)`` returns the logits."""

    def __init__(self, vocab: int, d: int, heads: int, layers: int, seq: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.1, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, ids):
        t = ids.shape[1]
        x = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=ids.device)
        return self.head(self.ln(self.blocks(x, mask=mask, is_causal=True)))


def _next_token(out, batch):
    ids = batch[0]
    return F.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]).float(), ids[:, 1:].reshape(-1))


def _lm(device, dtype, size):
    """SmallLM (vocab 2048, d 128, 4 heads, 2 layers) on 4 x 64 tokens, next-token loss, AdamW step included."""
    torch.manual_seed(0)
    v, d, h, n, (b, t) = (64, 16, 2, 1, (2, 8)) if _tiny(size) else (2048, 128, 4, 2, (4, 64))
    model = SmallLM(v, d, h, n, t).to(device)
    ids = torch.randint(0, v, (b, t), device=device)
    return ModelWorkload(model, (ids,), "fp32", loss=_next_token, optimizer=_adamw, call=_first)


# --- a compiled AdamW step -------------------------------------------------------------------------------
class AdamWStep(Workload):
    """``torch.compile(opt.step)`` for AdamW over the parameters of a stack of Linear layers, each with a
    fixed (seeded) gradient: the measured callable is ``opt.step`` itself (``model``), compiled by the backend.

    The optimizer's state is created at build time (one step with zero gradients, then undone), so the first
    compiled call traces the steady step. ``check`` restores parameters and state in place (step 0, zero
    moments) and returns the parameters after one step; the timed steps keep stepping."""
    train = False

    def __init__(self, net: nn.Module, dtype: str = "fp32"):
        self.net, self.dtype, self.inputs = net, dtype, ()
        gen = torch.Generator().manual_seed(1)
        self.grads = [torch.randn(p.shape, generator=gen, dtype=p.dtype).to(p.device) for p in net.parameters()]
        self._setup()

    def _setup(self) -> None:
        params = list(self.net.parameters())
        self.initial = [p.detach().clone() for p in params]
        for p in params:
            p.grad = torch.zeros_like(p)
        self.opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
        self.opt.step()   # creates the state (moments, step counters)
        for p, g in zip(params, self.grads):
            p.grad = g.to(p.dtype)
        self._restore()
        self.model = self.opt.step

    def _restore(self) -> None:
        with torch.no_grad():
            for p, p0 in zip(self.net.parameters(), self.initial):
                p.copy_(p0)
                for t in self.opt.state[p].values():
                    t.zero_()

    def fresh(self) -> "AdamWStep":
        new = copy.copy(self)
        new.net = copy.deepcopy(self.net)
        new._setup()
        return new

    def _to64(self) -> None:
        self.net.double()
        self.grads = [g.double() for g in self.grads]
        self._setup()

    def state(self) -> list:
        return list(self.net.parameters()) + [t for s in self.opt.state.values() for t in s.values()]

    def check(self, f) -> list:
        """The parameters after one step from the initial parameters and a zero state."""
        self._restore()
        f()
        return [p.detach().clone() for p in self.net.parameters()]

    def step(self, f) -> None:
        f()


def _adamw_step(device, dtype, size):
    """AdamW (lr 1e-3, weight decay 0.01) over 8 Linear(512, 512) layers (2.1 M parameters)."""
    torch.manual_seed(0)
    d = 16 if _tiny(size) else 512
    return AdamWStep(nn.Sequential(*(nn.Linear(d, d) for _ in range(8))).to(device))


def _case(name, build, train, about, **kw):
    return Case(name, "user", build, ("auto",), ("cpu", "cuda"), train, about=about, **kw)


CASES = [
    _case("user_encoder_train", _encoder, True,
          "TransformerEncoderLayer (d 128, 4 heads, FFN 512, dropout 0.1) train step, bs 8 x 64, MSE, AdamW"),
    _case("user_encoder_infer", functools.partial(_encoder, train=False), False,
          "the same TransformerEncoderLayer, inference (eval, no_grad), fp32"),
    _case("user_encoder_infer_bf16", functools.partial(_encoder, train=False, bf16=True), False,
          "the same TransformerEncoderLayer, inference under torch.autocast(bfloat16)"),
    _case("user_mlp_dropout", _mlp, True,
          "MLP 256-512-512-10, GELU, dropout 0.1, bs 64, cross-entropy, AdamW"),
    _case("user_audio_conv1d", _audio, True,
          "M5-style 1D-conv audio net (width 32, BN, max-pool) on 8 x 4000 samples, cross-entropy, SGD"),
    _case("user_cnn_train", functools.partial(_cnn, train=True), True,
          "VGG-style CNN (16/32/64 channels, BN) train step, bs 16, 32x32, cross-entropy, SGD"),
    _case("user_cnn_infer", functools.partial(_cnn, train=False), False,
          "the same CNN, inference (eval, no_grad), bs 16, 32x32"),
    _case("user_cnn_infer_freezing", functools.partial(_cnn, train=False), False,
          "the same CNN, inference with options={'freezing': True}", options={"freezing": True}),
    _case("user_checkpointed", _checkpointed, True,
          "4 residual MLP blocks (d 128, hidden 512, dropout 0.1) under torch.utils.checkpoint, bs 8 x 32, AdamW"),
    _case("user_small_lm", _lm, True,
          "causal LM (vocab 2048, d 128, 2 pre-norm layers, dropout 0.1), bs 4 x 64, AdamW step included"),
    _case("user_adamw_step", _adamw_step, False,
          "torch.compile(opt.step): AdamW over 8 Linear(512, 512) layers (2.1 M parameters)"),
]
