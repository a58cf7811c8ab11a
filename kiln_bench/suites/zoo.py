"""The zoo suite (``kiln bench --suite zoo``): models nobody tuned kiln for, from transformers, timm and
torchvision, built from configs with random weights (never downloaded).

The families are chosen for breadth: decoders with learned, rotary and partial-rotary positions and
sequential or parallel residuals, encoders, encoder-decoders, windowed and shifted attention, plain and
depthwise-separable convolutions, squeeze-excitation, dense concatenation, channel shuffle, MLP mixing.
Training rows run a step under bf16 autocast (fused AdamW, cross-entropy or the model's own loss);
inference rows run fp16 weights under ``no_grad``. Models train as users train them: every config and
constructor keeps its library's default dropout, attention dropout and drop path (timm's Swin-T: stochastic
depth 0.1; HF GPT-2, BERT, OPT, T5, BART, DistilBERT: dropout 0.1). The check against eager runs in a pass
of its own with those probabilities at 0 (``kiln_bench.dropout.no_random``); the timed steps keep them on.
``size='gpu'`` is the measured size: most rows have a few layers of the real widths, so a row compiles in
seconds; the ``*_full`` rows are the models at full depth as their libraries build them (GPT-2 small,
BERT-base, ViT-B/16, Swin-T, ConvNeXt-T), where a shrunk model would hide how host time and compile time
grow with depth. ``'tiny'`` is for tests on a CPU (every row, full ones included, is small there).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kiln_bench.case import Case
from kiln_bench.suites.models import _big, _finish, _images, _own_labels, _xent


# --- transformers ------------------------------------------------------------------------------------
def _hf(config_name, model_name, **cfg):
    import transformers
    return getattr(transformers, model_name)(getattr(transformers, config_name)(**cfg))


def _dims(big, layers=4, hidden=768, heads=12, ffn=3072):
    return (layers, hidden, heads, ffn) if big else (2, 64, 2, 128)


def _ids(vocab, big, device, shape=(8, 512)):
    return torch.randint(0, vocab, shape if big else (2, 32), device=device)


def _decoder(config_name, model_name, make_cfg, device, dtype, size, train=True, layers=4):
    """A causal LM: train on its own next-token loss; inference returns the logits."""
    big = _big(device, size)
    torch.manual_seed(0)
    cfg = make_cfg(*_dims(big, layers))
    model = _hf(config_name, model_name, use_cache=False, **cfg).to(device)
    ids = _ids(cfg["vocab_size"], big, device)
    if train:
        return _own_labels(model, ids, device)
    return _finish(model, (ids,), device, False, None, None, call=lambda f, b: f(input_ids=b[0]).logits)


def _gpt2_cfg(L, d, h, ffn):
    return dict(vocab_size=50257, n_layer=L, n_embd=d, n_head=h, n_positions=1024)


def _llama_cfg(L, d, h, ffn):
    return dict(vocab_size=32000, hidden_size=d, intermediate_size=ffn * 2 // 3 // 64 * 64 or 128,
                num_hidden_layers=L, num_attention_heads=h, num_key_value_heads=max(1, h // 4),
                max_position_embeddings=2048)


def _neox_cfg(L, d, h, ffn):   # rotary on a quarter of each head, attention and MLP in parallel
    return dict(vocab_size=50304, hidden_size=d, intermediate_size=ffn, num_hidden_layers=L,
                num_attention_heads=h, rotary_pct=0.25, use_parallel_residual=True, max_position_embeddings=2048)


def _phi_cfg(L, d, h, ffn):    # partial rotary, one layer norm feeding attention and MLP in parallel
    return dict(vocab_size=51200, hidden_size=d, intermediate_size=ffn, num_hidden_layers=L,
                num_attention_heads=h, partial_rotary_factor=0.5, max_position_embeddings=2048)


def _opt_cfg(L, d, h, ffn):    # ReLU MLP, learned positions with an offset
    return dict(vocab_size=50272, hidden_size=d, ffn_dim=ffn, num_hidden_layers=L, num_attention_heads=h,
                word_embed_proj_dim=d, max_position_embeddings=2048)


def _qwen2_cfg(L, d, h, ffn):  # biased q/k/v, GQA, SwiGLU
    return dict(vocab_size=32000, hidden_size=d, intermediate_size=ffn, num_hidden_layers=L,
                num_attention_heads=h, num_key_value_heads=max(1, h // 6), max_position_embeddings=2048)


def _mlm(config_name, model_name, extra, device, dtype, size, train=True, layers=4):
    """A bidirectional encoder: masked-LM loss on its own ids (train) or the last hidden state (infer)."""
    big = _big(device, size)
    L, d, h, ffn = _dims(big, layers)
    torch.manual_seed(0)
    model = _hf(config_name, model_name, **extra(L, d, h, ffn)).to(device)
    ids = _ids(model.config.vocab_size, big, device, (16, 512))
    if train:
        return _own_labels(model, ids, device)
    return _finish(model, (ids,), device, False, None, None, call=lambda f, b: f(input_ids=b[0])[0])


def _bert_cfg(L, d, h, ffn):
    return dict(hidden_size=d, num_hidden_layers=L, num_attention_heads=h, intermediate_size=ffn)


def _distilbert_cfg(L, d, h, ffn):
    return dict(dim=d, n_layers=L, n_heads=h, hidden_dim=ffn)


def _albert_cfg(L, d, h, ffn):  # one layer's weights shared by every layer, factorized embeddings
    return dict(hidden_size=d, num_hidden_layers=L, num_attention_heads=h, intermediate_size=ffn,
                embedding_size=128 if d > 128 else 32)


def _seq2seq(config_name, model_name, extra, device, dtype, size):
    """An encoder-decoder trained on a copy task: source ids in, the same ids as labels."""
    big = _big(device, size)
    L, d, h, ffn = _dims(big)
    torch.manual_seed(0)
    model = _hf(config_name, model_name, use_cache=False, **extra(L, d, h, ffn)).to(device)
    return _own_labels(model, _ids(model.config.vocab_size, big, device), device)


def _t5_cfg(L, d, h, ffn):      # RMSNorm, relative position buckets, gated-GELU (v1.1 style)
    return dict(vocab_size=32128, d_model=d, d_kv=d // h, d_ff=ffn * 2 // 3, num_layers=L,
                num_decoder_layers=L, num_heads=h, feed_forward_proj="gated-gelu",
                decoder_start_token_id=0, pad_token_id=0)


def _bart_cfg(L, d, h, ffn):
    return dict(vocab_size=50265, d_model=d, encoder_layers=L, decoder_layers=L, encoder_attention_heads=h,
                decoder_attention_heads=h, encoder_ffn_dim=ffn, decoder_ffn_dim=ffn, max_position_embeddings=1024)


# --- vision: timm and torchvision ------------------------------------------------------------------
def _vision(make, device, dtype, size, train=True, hw=224):
    """An image classifier: cross-entropy train step (SGD with momentum) or inference logits."""
    big = _big(device, size)
    torch.manual_seed(0)
    model = make(big).to(device)
    bs = (32 if train else 64) if big else 2
    hw = hw if big else min(hw, 64)
    x = torch.randn(bs, 3, hw, hw, device=device)
    y = torch.randint(0, 1000, (bs,), device=device)
    opt = functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9)
    return _finish(model, (x, y) if train else (x,), device, train, _xent if train else None,
                   opt if train else None, call=_images)


def _kwargs(kw: dict, tiny: dict, big: bool) -> dict:
    return dict(kw) if big else {**kw, **tiny}


def _timm(name, tiny=None, **kw):
    def make(big):
        import timm
        return timm.create_model(name, pretrained=False, **_kwargs(kw, tiny or {}, big))
    return make


def _tv(name, tiny=None, **kw):
    def make(big):
        import torchvision
        return getattr(torchvision.models, name)(weights=None, **_kwargs(kw, tiny or {}, big))
    return make


_TINY_VIT = dict(img_size=64)


def _case(name, build, train, needs, about):
    return Case(name, "zoo", build, ("auto",), ("cuda", "cpu"), train, needs=needs, about=about)


_TF = ("transformers",)
_TIMM = ("timm", "torchvision")
_TV = ("torchvision",)


def _dec(cfg_name, model_name, make_cfg, train=True, layers=4):
    return functools.partial(_decoder, cfg_name, model_name, make_cfg, train=train, layers=layers)


def _enc(cfg_name, model_name, make_cfg, train=True, layers=4):
    return functools.partial(_mlm, cfg_name, model_name, make_cfg, train=train, layers=layers)


def _vis(make, train=True, hw=224):
    return functools.partial(_vision, make, train=train, hw=hw)


TRAIN = [
    _case("zoo_gpt2", _dec("GPT2Config", "GPT2LMHeadModel", _gpt2_cfg), True, _TF,
          "GPT-2 (4 layers, d 768, dropout 0.1), bs 8 x 512, learned positions, GELU-tanh MLP"),
    _case("zoo_gpt2_full", _dec("GPT2Config", "GPT2LMHeadModel", _gpt2_cfg, layers=12), True, _TF,
          "GPT-2 small at full depth (12 layers, d 768, dropout 0.1), bs 8 x 512"),
    _case("zoo_llama", _dec("LlamaConfig", "LlamaForCausalLM", _llama_cfg), True, _TF,
          "Llama (4 layers, d 768, GQA 12/3), rotary, RMSNorm, SwiGLU, bs 8 x 512"),
    _case("zoo_neox", _dec("GPTNeoXConfig", "GPTNeoXForCausalLM", _neox_cfg), True, _TF,
          "GPT-NeoX/Pythia (4 layers, d 768): partial rotary, parallel residual, bs 8 x 512"),
    _case("zoo_phi", _dec("PhiConfig", "PhiForCausalLM", _phi_cfg), True, _TF,
          "Phi (4 layers, d 768): partial rotary, parallel attention + MLP, bs 8 x 512"),
    _case("zoo_opt", _dec("OPTConfig", "OPTForCausalLM", _opt_cfg), True, _TF,
          "OPT (4 layers, d 768): ReLU MLP, learned positions, bs 8 x 512"),
    _case("zoo_qwen2", _dec("Qwen2Config", "Qwen2ForCausalLM", _qwen2_cfg), True, _TF,
          "Qwen2 (4 layers, d 768, GQA 12/2, biased qkv), bs 8 x 512"),
    _case("zoo_bert", _enc("BertConfig", "BertForMaskedLM", _bert_cfg), True, _TF,
          "BERT masked-LM (4 layers, d 768, dropout 0.1), bs 16 x 512"),
    _case("zoo_bert_full", _enc("BertConfig", "BertForMaskedLM", _bert_cfg, layers=12), True, _TF,
          "BERT-base masked-LM at full depth (12 layers, d 768, dropout 0.1), bs 16 x 512"),
    _case("zoo_albert", _enc("AlbertConfig", "AlbertForMaskedLM", _albert_cfg), True, _TF,
          "ALBERT masked-LM (4 layers sharing one set of weights, d 768, factorized embeddings), bs 16 x 512"),
    _case("zoo_t5", functools.partial(_seq2seq, "T5Config", "T5ForConditionalGeneration", _t5_cfg), True, _TF,
          "T5 v1.1-style encoder-decoder (4+4 layers, d 768, gated GELU, relative positions), bs 8 x 512"),
    _case("zoo_bart", functools.partial(_seq2seq, "BartConfig", "BartForConditionalGeneration", _bart_cfg),
          True, _TF, "BART encoder-decoder (4+4 layers, d 768), bs 8 x 512"),
    _case("zoo_vit", _vis(_timm("vit_base_patch16_224", depth=6, tiny=_TINY_VIT)), True, _TIMM,
          "timm ViT-B/16 (6 blocks), bs 32, 224"),
    _case("zoo_vit_full", _vis(_timm("vit_base_patch16_224", tiny=dict(_TINY_VIT, depth=2))), True, _TIMM,
          "timm ViT-B/16 at full depth (12 blocks) as timm builds it, bs 32, 224"),
    _case("zoo_swin_full", _vis(_timm("swin_tiny_patch4_window7_224", tiny=dict(img_size=64, window_size=2))),
          True, _TIMM, "timm Swin-T as timm builds it (stochastic depth 0.1): windowed and shifted attention, "
                       "bs 32, 224"),
    _case("zoo_convnext_full", _vis(_timm("convnext_tiny")), True, _TIMM,
          "timm ConvNeXt-T as timm builds it: 7x7 depthwise convolutions, channels-last LayerNorm, bs 32, 224"),
    _case("zoo_efficientnet", _vis(_timm("efficientnet_b0")), True, _TIMM,
          "timm EfficientNet-B0: depthwise-separable convolutions, squeeze-excitation, SiLU, bs 32, 224"),
    _case("zoo_mixer", _vis(_timm("mixer_b16_224", tiny=_TINY_VIT)), True, _TIMM,
          "timm MLP-Mixer B/16: token- and channel-mixing MLPs, bs 32, 224"),
    _case("zoo_resnet50", _vis(_tv("resnet50")), True, _TV, "torchvision ResNet-50, bs 32, 224"),
    _case("zoo_mobilenetv3", _vis(_tv("mobilenet_v3_large")), True, _TV,
          "torchvision MobileNetV3-L: depthwise, squeeze-excitation, hard-swish, bs 32, 224"),
    _case("zoo_shufflenet", _vis(_tv("shufflenet_v2_x1_0")), True, _TV,
          "torchvision ShuffleNetV2: channel shuffle, split and concat, bs 32, 224"),
    _case("zoo_regnety", _vis(_tv("regnet_y_400mf")), True, _TV,
          "torchvision RegNetY-400MF: grouped convolutions, squeeze-excitation, bs 32, 224"),
]

INFER = [
    _case("zoo_gpt2_infer", _dec("GPT2Config", "GPT2LMHeadModel", _gpt2_cfg, train=False), False, _TF,
          "GPT-2 (4 layers) logits, fp16, bs 8 x 512"),
    _case("zoo_distilbert_infer", _enc("DistilBertConfig", "DistilBertModel", _distilbert_cfg, train=False),
          False, _TF, "DistilBERT (4 layers) hidden states, fp16, bs 16 x 512"),
    _case("zoo_bert_infer", _enc("BertConfig", "BertModel", _bert_cfg, train=False), False, _TF,
          "BERT (4 layers) hidden states, fp16, bs 16 x 512"),
    _case("zoo_resnet50_infer", _vis(_tv("resnet50"), train=False), False, _TV, "torchvision ResNet-50, fp16, bs 64"),
    _case("zoo_mobilenetv3_infer", _vis(_tv("mobilenet_v3_large"), train=False), False, _TV,
          "torchvision MobileNetV3-L, fp16, bs 64"),
    _case("zoo_efficientnet_infer", _vis(_tv("efficientnet_b0"), train=False), False, _TV,
          "torchvision EfficientNet-B0, fp16, bs 64"),
    _case("zoo_densenet_infer", _vis(_tv("densenet121"), train=False), False, _TV,
          "torchvision DenseNet-121: dense concatenation, fp16, bs 64"),
    _case("zoo_squeezenet_infer", _vis(_tv("squeezenet1_1"), train=False), False, _TV,
          "torchvision SqueezeNet 1.1: fire modules (concat), fp16, bs 64"),
    _case("zoo_vgg_infer", _vis(_tv("vgg16_bn"), train=False), False, _TV, "torchvision VGG-16-BN, fp16, bs 64"),
    _case("zoo_vit_infer", _vis(_tv("vit_b_16", tiny=dict(image_size=64)), train=False), False, _TV,
          "torchvision ViT-B/16 (12 blocks), fp16, bs 64"),
    _case("zoo_swin_infer", _vis(_tv("swin_t"), train=False), False, _TV,
          "torchvision Swin-T: windowed and shifted attention, fp16, bs 64"),
    _case("zoo_convnext_infer", _vis(_tv("convnext_tiny"), train=False), False, _TV,
          "torchvision ConvNeXt-T, fp16, bs 64"),
    _case("zoo_mobilevit_infer", _vis(_timm("mobilevit_s"), train=False, hw=256), False, _TIMM,
          "timm MobileViT-S: convolutions and unfolded-patch attention, fp16, bs 64, 256"),
]

CASES = TRAIN + INFER
