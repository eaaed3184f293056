"""HF transformers: every registered name is one transformers takes for every model, and
``ab.hf_name`` maps every accepted name to it; tiny random models of each attention family match
HF's eager in float64 under the DESIGN.md rule, forward and backward, with and without padding,
models that compute attention in their own code (MPT) included.  Models are built from configs:
nothing is downloaded."""

import copy
import logging

import pytest
import torch

import attn_backends as ab
from attn_backends import _names, _transformers
from attn_backends._testing import check_2x

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


def _run(model, ids, mask, arch):
    kw = dict(input_ids=ids, attention_mask=mask, use_cache=False)
    if arch == "t5":
        kw["decoder_input_ids"] = ids
    out = model(**kw)
    x = out.logits if hasattr(out, "logits") else out.last_hidden_state
    loss = (x.double().square() * mask[..., None]).sum()
    params = [p for p in model.parameters() if p.requires_grad]
    return x, torch.autograd.grad(loss, params, allow_unused=True)


def _check_model(arch, impl, ids, mask):
    """ours (float32) against eager in float64, with eager in float32 as the same-dtype baseline."""
    ref = _model(arch, "eager")
    x64, g64 = _run(copy.deepcopy(ref).double(), ids, mask, arch)
    x32, g32 = _run(ref, ids, mask, arch)
    x, g = _run(_model(arch, impl, like=ref), ids, mask, arch)
    keep = mask.bool()
    check_2x("logits", x[keep], x64[keep], x32[keep], 2, torch.float32)
    names = [n for n, p in ref.named_parameters() if p.requires_grad]
    for name, a, r, s in zip(names, g, g64, g32):
        if r is not None:
            check_2x(f"d {name}", a, r, s, 3, torch.float32)


@pytest.fixture
def spy(monkeypatch):
    """Counts the calls that reach our dispatcher, dense and packed."""
    calls = []
    for fn in ("attention", "attention_varlen"):
        real = getattr(ab._dispatch, fn)

        def counting(*args, _real=real, _fn=fn, **kwargs):
            calls.append(_fn)
            return _real(*args, **kwargs)

        monkeypatch.setattr(ab._dispatch, fn, counting)
    return calls


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


def test_models_that_compute_attention_themselves_are_told_apart():
    # the question transformers itself asks before letting a model switch implementation
    assert _transformers._computes_attention_itself(_config("mpt"))
    assert not _transformers._computes_attention_itself(_config("llama"))
    assert not _transformers._computes_attention_itself(_config("t5"))


# ---- models against eager ---------------------------------------------------------------------

ARCHS = ["llama", "mistral", "qwen2", "gemma2", "gpt2", "bert", "mpt"]


@pytest.mark.parametrize("padding", ["none", "right"])
@pytest.mark.parametrize("arch", ARCHS)
def test_models_match_eager_forward_and_backward(arch, padding, gen, spy, caplog):
    # 9 tokens against a window of 4: the sliding layers' window bites.  Right padding: eager in
    # float64 turns left padding's fully masked rows into NaN (finfo.min + score = -inf)
    ab.register_transformers()
    ids = torch.randint(1, V, (2, 9), generator=gen)
    mask = torch.ones_like(ids)
    if padding == "right":
        mask[1, -3:] = 0
    with caplog.at_level(logging.WARNING, logger="attn_backends"):
        _check_model(arch, "attn_backends", ids, mask)
    if arch == "mpt":  # its attention is its own code: eager's mask, and a warning that says so
        assert not spy
    else:
        assert spy and set(spy) == {"attention"}
