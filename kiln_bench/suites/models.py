"""The models suite: the built-in GPT and CNN, and (when installed) GPT-2 small, BERT-base and
torchvision ResNet-18/50, all built from configs with random weights (never downloaded).

Precision follows the anchors: on the GPU training runs under bf16 autocast and inference in fp16;
on the CPU everything is fp32. The HF models keep their default dropout (0.1) in the timed steps; the
correctness check runs with it off (``kiln_bench.dropout.no_random``).
The HuggingFace and ResNet-50 cases run on the GPU only (a 2-core CPU would take minutes per step).
"""
from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F

from kiln_bench import models
from kiln_bench.case import Case, ModelWorkload


def _precision(device, train):
    """(dtype label, autocast dtype, cast model to) for this device and mode."""
    if device == "cpu":
        return "fp32", None, None
    return ("amp_bf16", torch.bfloat16, None) if train else ("fp16", None, torch.float16)


def _size(device, size):
    return size or ("gpu" if device == "cuda" else "cpu")


def _big(device, size) -> bool:
    """Whether the case builds its measured GPU size (else the small CPU / test size)."""
    return _size(device, size) == "gpu"


def _adamw(device):
    fused = device == "cuda"
    return functools.partial(torch.optim.AdamW, lr=1e-4, fused=fused) if fused else \
        functools.partial(torch.optim.AdamW, lr=1e-4)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def _anchor_sgd(params):   # the anchor's ResNet-50 train step: plain SGD, no momentum
    return torch.optim.SGD(params, lr=0.01)


def _sum_loss(out, batch):   # ... and the sum of the fp32 logits as the loss
    return out.float().sum()


def _xent(out, batch):
    return F.cross_entropy(out.float(), batch[1])


def _finish(model, batch, device, train, loss, optimizer, call=None):
    label, autocast, cast = _precision(device, train)
    if cast is not None:
        model = model.to(cast)
        batch = tuple(b.to(cast) if b.is_floating_point() else b for b in batch)
    return ModelWorkload(model, batch, label, loss=loss, optimizer=optimizer, autocast=autocast,
                         train=train, call=call)


# --- built-in ----------------------------------------------------------------------------------------
def _gpt(device, dtype, size):
    model, batch = models.build_gpt(_size(device, size), device)
    return _finish(model, batch, device, True, lambda out, b: out, _adamw(device))


def _images(f, batch):
    return f(batch[0])  # labels, when present, are for the loss only


def _cnn(device, dtype, size, train=True):
    model, batch = models.build_cnn(_size(device, size), device)
    if not train:
        batch = batch[:1]
    return _finish(model, batch, device, train, _xent if train else None, _sgd if train else None, call=_images)


# --- HuggingFace transformers ------------------------------------------------------------------------
def _own_labels(model, ids, device):
    """A train step of an HF model on ``ids`` with the same ids as its labels (causal and masked LMs,
    encoder-decoders on a copy task): its own loss, fused AdamW on the GPU."""
    return _finish(model, (ids,), device, True, lambda out, b: out.loss, _adamw(device),
                   call=lambda f, b: f(input_ids=b[0], labels=b[0]))


def _causal_lm(model_class, cfg, batch, device):
    """A seeded HF causal LM train step on random ids of shape ``batch``: the loss against the ids."""
    torch.manual_seed(0)
    model = model_class(cfg).to(device)
    return _own_labels(model, torch.randint(0, cfg.vocab_size, batch, device=device), device)


def _gpt2(device, dtype, size):
    from transformers import GPT2Config, GPT2LMHeadModel
    big = _big(device, size)
    cfg = GPT2Config(n_layer=12 if big else 2, n_embd=768 if big else 64, n_head=12 if big else 2,
                     n_positions=1024, use_cache=False)
    return _causal_lm(GPT2LMHeadModel, cfg, (8, 1024) if big else (2, 64), device)


def _llama(device, dtype, size):
    from transformers import LlamaConfig, LlamaForCausalLM
    big = _big(device, size)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024 if big else 64, intermediate_size=2816 if big else 128,
                      num_hidden_layers=8 if big else 2, num_attention_heads=16 if big else 2,
                      num_key_value_heads=4 if big else 1, max_position_embeddings=2048, use_cache=False)
    return _causal_lm(LlamaForCausalLM, cfg, (4, 1024) if big else (2, 64), device)


def _bert(device, dtype, size):
    from transformers import BertConfig, BertModel
    big = _big(device, size)
    cfg = BertConfig() if big else BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                              intermediate_size=128)
    bs, seq = (16, 512) if big else (2, 64)
    torch.manual_seed(0)
    model = BertModel(cfg).to(device)
    ids = torch.randint(0, cfg.vocab_size, (bs, seq), device=device)
    return _finish(model, (ids,), device, False, None, None, call=lambda f, b: f(input_ids=b[0]))


def _bert_mlm(device, dtype, size):
    from transformers import BertConfig, BertForMaskedLM
    big = _big(device, size)
    cfg = BertConfig() if big else BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                              intermediate_size=128)
    bs, seq = (16, 512) if big else (2, 64)
    torch.manual_seed(0)
    model = BertForMaskedLM(cfg).to(device)
    return _own_labels(model, torch.randint(0, cfg.vocab_size, (bs, seq), device=device), device)


# --- torchvision -------------------------------------------------------------------------------------
def _resnet(arch, train, device, dtype, size):
    torch.manual_seed(0)
    if arch == "resnet18" and importlib.util.find_spec("torchvision") is None:
        model = models.ResNet18().to(device)   # the same architecture, written in the bench
    else:
        import torchvision
        model = getattr(torchvision.models, arch)().to(device)
    big = _big(device, size)
    bs, hw = (64, 224) if big else ((8, 224) if size != "tiny" else (2, 64))
    x = torch.randn(bs, 3, hw, hw, device=device)
    y = torch.randint(0, 1000, (bs,), device=device)
    batch = (x, y) if train else (x,)
    return _finish(model, batch, device, train, _sum_loss if train else None, _anchor_sgd if train else None,
                   call=_images)


def _resnet_cases(arch, devices_infer):
    tv = () if arch == "resnet18" else ("torchvision",)   # resnet18: models.ResNet18 without torchvision
    train = functools.partial(_resnet, arch, True)
    infer = functools.partial(_resnet, arch, False)
    return [
        Case(f"{arch}_train", "models", train, ("auto",), ("cuda",), True, needs=tv,
             about=f"torchvision {arch} train step, bf16 autocast, sum loss, SGD, bs 64 (as the anchor)"),
        Case(f"{arch}_infer", "models", infer, ("auto",), devices_infer, False, needs=tv,
             about=f"torchvision {arch} inference, fp16 (gpu) / fp32 bs 8 (cpu)"),
        Case(f"{arch}_infer_freezing", "models", infer, ("auto",), devices_infer, False,
             options={"freezing": True}, needs=tv, about=f"{arch} inference with options={{'freezing': True}}"),
    ]


CASES = [
    Case("gpt", "models", _gpt, ("auto",), train=True,
         about="built-in GPT train step (AdamW); cpu: 2 layers d64 seq128 fp32, gpu: 6 layers d768 seq1024 bf16"),
    Case("cnn", "models", _cnn, ("auto",), train=True, about="built-in ResNet-style CNN train step (SGD)"),
    Case("cnn_infer", "models", functools.partial(_cnn, train=False), ("auto",), train=False,
         about="built-in CNN inference"),
    Case("cnn_infer_freezing", "models", functools.partial(_cnn, train=False), ("auto",), train=False,
         options={"freezing": True}, about="built-in CNN inference with freezing"),
    Case("gpt2", "models", _gpt2, ("auto",), ("cpu", "cuda"), True, needs=("transformers",),
         about="HF GPT-2 small train step, bs 8 seq 1024, bf16 autocast, fused AdamW, dropout 0.1 "
               "(cpu: 2 layers, d 64, bs 2 x 64, fp32)"),
    Case("llama", "models", _llama, ("auto",), ("cuda",), True, needs=("transformers",),
         about="HF Llama-style decoder train step (8 layers, d 1024, GQA 16/4 heads, SwiGLU 2816), bs 4 seq 1024, "
               "bf16 autocast, fused AdamW"),
    Case("bert_train", "models", _bert_mlm, ("auto",), ("cpu", "cuda"), True, needs=("transformers",),
         about="HF BERT masked-LM train step, dropout 0.1, AdamW; gpu: BERT-base bs 16 x 512, bf16 autocast; "
               "cpu: 2 layers, d 64, bs 2 x 64, fp32"),
    Case("bert", "models", _bert, ("auto",), ("cuda",), False, needs=("transformers",),
         about="HF BERT-base inference, bs 16 seq 512, fp16"),
    *_resnet_cases("resnet18", ("cpu", "cuda")),
    *_resnet_cases("resnet50", ("cuda",)),
]
