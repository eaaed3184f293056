"""HF transformers: every registered name is one transformers takes for every model, and
``ab.hf_name`` maps every accepted name to it.  Models are built from configs: nothing is
downloaded."""

import pytest
import torch

import attn_backends as ab
from attn_backends import _names, _transformers

transformers = pytest.importorskip("transformers")

V = 97


def _config(arch):
    T = transformers
    small = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                 intermediate_size=64, vocab_size=V)
    return {
        "llama": lambda: T.LlamaConfig(**small),
        "mistral": lambda: T.MistralConfig(**small, sliding_window=4),
        "qwen2": lambda: T.Qwen2Config(**small, use_sliding_window=True, sliding_window=4, max_window_layers=1),
        "gemma2": lambda: T.Gemma2Config(**small, head_dim=8, sliding_window=4, attn_logit_softcapping=2.0),
        "gpt2": lambda: T.GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=V, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
        "bert": lambda: T.BertConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=32, intermediate_size=64,
                                     vocab_size=V, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
        "t5": lambda: T.T5Config(num_layers=2, num_decoder_layers=2, num_heads=4, d_model=32, d_kv=8, d_ff=64,
                                 vocab_size=V, decoder_start_token_id=0, dropout_rate=0.0),
        "mpt": lambda: T.MptConfig(n_layers=2, n_heads=4, d_model=32, vocab_size=V, max_seq_len=16),
        "gpt_oss": lambda: T.GptOssConfig(**{**small, "intermediate_size": 32}, head_dim=8, sliding_window=4,
                                          num_local_experts=2, num_experts_per_tok=1),
    }[arch]()


def _model(arch, impl, like=None):
    T = transformers
    auto = {"bert": T.AutoModel, "t5": T.AutoModelForSeq2SeqLM}.get(arch, T.AutoModelForCausalLM)
    extra = {"experts_implementation": "eager"} if arch == "gpt_oss" else {}  # grouped_mm has no float64
    model = auto.from_config(_config(arch), attn_implementation=impl, **extra)
    if like is not None:
        model.load_state_dict(like.state_dict())
    elif arch == "gpt_oss":
        with torch.no_grad():  # sinks large enough that ignoring them shows
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 2.0)
    return model



# ---- names ------------------------------------------------------------------------------------

def test_names_read_well_and_carry_nothing_transformers_reads():
    names = ab.register_transformers()
    assert set(names) == set(_names.CANONICAL)
    assert names["auto"] == "attn_backends" and names["flash"] == "attn_backends_fa"
    assert names["flash_varlen"] == "attn_backends_fa_varlen" and names["sdpa"] == "attn_backends_torch"
    assert names["_native_flash"] == "attn_backends_torch_fa" and names["flash_attn_pkg"] == "attn_backends_fa_pkg"
    for hf in names.values():
        assert _transformers.hf_accepts(hf), hf
        assert "__" not in hf and not hf.endswith("_") and hf.count("_pkg") <= 1, hf
    registered = transformers.AttentionInterface._global_mapping
    assert "attn_backends_sdpa" not in registered  # an old name transformers refuses for some models
    assert "attn_backends__native_fa" in registered  # old names it takes stay, as aliases


def test_hf_name_for_every_accepted_name():
    for name in _names.ALL_NAMES:
        assert ab.hf_name(name) == _transformers.NAMES[ab.resolve(name)]
    assert ab.hf_name("flash_attention_2") == ab.hf_name("FA2") == "attn_backends_fa"
    assert ab.hf_name("sdpa") == "attn_backends_torch" and ab.hf_name("eager") == "attn_backends_eager"
    assert ab.hf_name("attn_backends_fa") == "attn_backends_fa"
    assert ab.hf_name("attn_backends_sdpa") == ab.hf_name("torch") == "attn_backends_torch"  # old spellings
    assert ab.hf_name("attn_backends__native_fa") == ab.hf_name("_native_flash") == "attn_backends_torch_fa"
    with pytest.raises(ValueError, match="unknown backend 'flash_attn_9'; valid names are"):
        ab.hf_name("flash_attn_9")


@pytest.mark.parametrize("arch", ["gemma2", "mpt", "gpt_oss"])
def test_every_name_is_taken_for_models_that_refuse_sdpa(arch):
    names = ab.register_transformers()
    for hf in list(names.values()) + [a for a in _transformers.ALIASES if _transformers.hf_accepts(a)]:
        model = _model(arch, hf)
        assert model.config._attn_implementation == hf

