"""Twenty-three HuggingFace architectures (tiny configs, dropout off) train one step with kiln as with eager:
the loss and every gradient, with ATen code generation and with Triton kernels in the interpreter.
Slow (about 7 minutes here) and needs ``transformers``: ``pytest -m slow tests/e2e/test_hf_models.py``."""
import pytest
import torch

try:
    import transformers as T
except ImportError:   # an optional test dependency: the tests below say so when they run
    T = None

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(T is None, reason="needs transformers: pip install transformers")]

V = 128   # vocabulary
SMALL = dict(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
             max_position_embeddings=64)
NO_DROPOUT = dict(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
SEQ2SEQ = dict(vocab_size=V, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
               decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, **NO_DROPOUT)

MODELS = {
    "bert": lambda: T.BertForMaskedLM(T.BertConfig(**SMALL)),
    "gpt2": lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=V, n_embd=32, n_layer=1, n_head=2, n_positions=64)),
    "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**SMALL, num_key_value_heads=1)),
    "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(**SMALL, num_key_value_heads=1)),
    "opt": lambda: T.OPTForCausalLM(T.OPTConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                ffn_dim=64, max_position_embeddings=64, word_embed_proj_dim=32,
                                                layerdrop=0.0, **NO_DROPOUT)),
    "t5": lambda: T.T5ForConditionalGeneration(T.T5Config(vocab_size=V, d_model=32, d_kv=16, d_ff=64, num_layers=1,
                                                          num_decoder_layers=1, num_heads=2, dropout_rate=0.0,
                                                          decoder_start_token_id=0, pad_token_id=0)),
    "bart": lambda: T.BartForConditionalGeneration(T.BartConfig(**SEQ2SEQ, max_position_embeddings=64,
                                                                encoder_layerdrop=0.0, decoder_layerdrop=0.0)),
    "roberta": lambda: T.RobertaForMaskedLM(T.RobertaConfig(**SMALL, pad_token_id=1)),
    "distilbert": lambda: T.DistilBertForMaskedLM(T.DistilBertConfig(vocab_size=V, dim=32, n_layers=1, n_heads=2,
                                                                     hidden_dim=64, max_position_embeddings=64)),
    "vit": lambda: T.ViTForImageClassification(T.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                           intermediate_size=64, image_size=16, patch_size=4,
                                                           num_labels=5)),
    "gemma": lambda: T.GemmaForCausalLM(T.GemmaConfig(**SMALL, num_key_value_heads=1, head_dim=16)),
    "qwen2": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**SMALL, num_key_value_heads=1)),
    "phi": lambda: T.PhiForCausalLM(T.PhiConfig(**SMALL)),
    "electra": lambda: T.ElectraForMaskedLM(T.ElectraConfig(vocab_size=V, embedding_size=32, hidden_size=32,
                                                            num_hidden_layers=1, num_attention_heads=2,
                                                            intermediate_size=64, max_position_embeddings=64)),
    "whisper": lambda: T.WhisperForConditionalGeneration(T.WhisperConfig(
        **SEQ2SEQ, num_mel_bins=8, max_source_positions=16, max_target_positions=32, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)),
    "gpt_neox": lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**SMALL, hidden_dropout=0.0, attention_dropout=0.0)),
    "bloom": lambda: T.BloomForCausalLM(T.BloomConfig(vocab_size=V, hidden_size=32, n_layer=1, n_head=2,
                                                      hidden_dropout=0.0, attention_dropout=0.0)),
    "deberta": lambda: T.DebertaV2ForMaskedLM(T.DebertaV2Config(**SMALL, hidden_dropout_prob=0.0,
                                                                attention_probs_dropout_prob=0.0)),
    "falcon": lambda: T.FalconForCausalLM(T.FalconConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1,
                                                         num_attention_heads=2, hidden_dropout=0.0,
                                                         attention_dropout=0.0)),
    "mixtral": lambda: T.MixtralForCausalLM(T.MixtralConfig(**SMALL, num_key_value_heads=1, num_local_experts=4,
                                                            num_experts_per_tok=2)),
    "swin": lambda: T.SwinForImageClassification(T.SwinConfig(
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[1, 2], window_size=4, num_labels=5,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0)),
    "clip_text": lambda: T.CLIPTextModel(T.CLIPTextConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1,
                                                          num_attention_heads=2, intermediate_size=64,
                                                          max_position_embeddings=64)),
    "wav2vec2": lambda: T.Wav2Vec2ForCTC(T.Wav2Vec2Config(
        vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2, hidden_dropout=0.0, attention_dropout=0.0, feat_proj_dropout=0.0,
        layerdrop=0.0, mask_time_prob=0.0, ctc_loss_reduction="mean")),
}


def _loss(out):
    """The model's loss, or for a bare encoder the mean square of its last hidden state."""
    return out.loss if getattr(out, "loss", None) is not None else out.last_hidden_state.pow(2).mean()


def _inputs(name):
    ids = torch.randint(2, V, (2, 16))
    if name == "vit":
        return dict(pixel_values=torch.randn(2, 3, 16, 16), labels=torch.randint(0, 5, (2,)))
    if name in ("t5", "bart"):
        return dict(input_ids=ids, labels=torch.randint(2, V, (2, 8)))
    if name == "whisper":
        return dict(input_features=torch.randn(2, 8, 32), labels=torch.randint(2, V, (2, 8)))
    if name == "swin":
        return dict(pixel_values=torch.randn(2, 3, 32, 32), labels=torch.randint(0, 5, (2,)))
    if name == "clip_text":
        return dict(input_ids=ids)
    if name == "wav2vec2":
        return dict(input_values=torch.randn(2, 400), labels=torch.randint(1, V, (2, 5)))
    return dict(input_ids=ids, labels=ids)


def _model(name):
    torch.manual_seed(0)
    model = MODELS[name]().train()
    for mod in model.modules():
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0
    return model


@pytest.mark.parametrize("codegen", ["aten", "triton"])
@pytest.mark.parametrize("name", list(MODELS))
def test_train_step_matches_eager(name, codegen, monkeypatch):
    if codegen == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = _model(name)
    x = _inputs(name)
    loss = _loss(model(**x))
    loss.backward()
    ref = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="kiln", options={"codegen": codegen})
    for _ in range(2):   # the second step runs the cached code
        model.zero_grad(set_to_none=True)
        got_loss = _loss(compiled(**x))
        got_loss.backward()
    got = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(got) == len(ref)
    torch.testing.assert_close(got_loss, loss, atol=1e-4, rtol=1e-4)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, atol=1e-4 * max(1.0, r.abs().max().item()), rtol=1e-3)


@pytest.mark.parametrize("codegen", ["aten", "triton"])
@pytest.mark.parametrize("name", ["gpt2", "llama", "opt", "t5", "qwen2"])
def test_dynamic_sequence_lengths(name, codegen, monkeypatch):
    """``dynamic=True``, three sequence lengths taken as strided slices of one batch of ids: losses and
    gradients match eager at each (a symbolic divisor once printed without parentheses read out of
    bounds here)."""
    if codegen == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = _model(name)
    compiled = torch.compile(model, backend="kiln", options={"codegen": codegen}, dynamic=True)
    torch._dynamo.reset()
    full = _inputs(name)
    for seq in (16, 12, 9):
        x = dict(full, input_ids=full["input_ids"][:, :seq])
        if name != "t5":
            x["labels"] = x["input_ids"]
        model.zero_grad(set_to_none=True)
        ref = model(**x).loss
        ref.backward()
        want = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        model.zero_grad(set_to_none=True)
        got = compiled(**x).loss
        got.backward()
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
        for g, r in zip([p.grad for p in model.parameters() if p.grad is not None], want):
            torch.testing.assert_close(g, r, atol=1e-4 * max(1.0, r.abs().max().item()), rtol=1e-3)


@pytest.mark.parametrize("codegen", ["aten", "triton"])
@pytest.mark.parametrize("name", ["bert", "llama", "opt", "t5", "vit", "whisper"])
def test_frozen_inference_matches_eager(name, codegen, monkeypatch):
    """``freezing=True`` inference (constant folding, merged q/k/v linears): logits match eager."""
    if codegen == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = _model(name).eval()
    x = _inputs(name)
    torch._dynamo.reset()
    with torch.no_grad():
        ref = model(**x).logits
        got = torch.compile(model, backend="kiln", options={"codegen": codegen, "freezing": True})(**x).logits
    torch.testing.assert_close(got, ref, atol=1e-4 * max(1.0, ref.abs().max().item()), rtol=1e-4)
