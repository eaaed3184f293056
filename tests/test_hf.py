"""HF transformers: every registered name is one transformers takes for every model; tiny random
models of each attention family (Llama, Mistral, Qwen2, Gemma2, GPT-2, BERT, T5, MPT, GPT-OSS) match
HF's eager in float64 under the DESIGN.md rule, forward and backward, with and without padding;
T5's position bias, GPT-OSS's sinks, sliding windows and softcap are honoured; packed sequences
equal each sequence run alone; generate matches eager; a keyword the function cannot honour
raises.  Models are built from configs: nothing is downloaded."""

import copy
import inspect
import logging

import pytest
import torch

import attn_backends as ab
from attn_backends import _names, _transformers
from attn_backends._testing import check_2x, reference_attention

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
        # bidirectional sliding windows on every other layer (local_attention 8: |i - j| <= 4)
        "modernbert": lambda: T.ModernBertConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                 num_attention_heads=4, local_attention=8, global_attn_every_n_layers=2,
                                                 pad_token_id=0, attention_dropout=0.0, mlp_dropout=0.0,
                                                 embedding_dropout=0.0),
        "bart": lambda: T.BartConfig(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2),
        "gpt_oss": lambda: T.GptOssConfig(**{**small, "intermediate_size": 32}, head_dim=8, sliding_window=4,
                                          num_local_experts=2, num_experts_per_tok=1),
        # sinks through lse (sigmoid(lse - sink)), one sliding layer
        "granite_swa": lambda: T.GraniteSWAConfig(**small, sliding_window=4, bos_token_id=0, eos_token_id=0),
        # q.k head dim 12, values 8; sinks on the sliding layer only
        "mimo_v2_flash": lambda: T.MiMoV2FlashConfig(**small, head_dim=12, v_head_dim=8, sliding_window=4,
                                                     moe_intermediate_size=16, n_routed_experts=2,
                                                     num_experts_per_tok=1),
    }[arch]()


MOE = ("gpt_oss", "mimo_v2_flash")


def _model(arch, impl, like=None):
    T = transformers
    auto = {"bert": T.AutoModel, "modernbert": T.AutoModel, "t5": T.AutoModelForSeq2SeqLM,
            "bart": T.AutoModelForSeq2SeqLM}.get(arch, T.AutoModelForCausalLM)
    extra = {"experts_implementation": "eager"} if arch in MOE else {}  # grouped_mm has no float64
    model = auto.from_config(_config(arch), attn_implementation=impl, **extra)
    if like is not None:
        model.load_state_dict(like.state_dict())
    elif arch in ("gpt_oss", "granite_swa", "mimo_v2_flash"):
        with torch.no_grad():  # sinks large enough that ignoring them shows
            for layer in model.model.layers:
                if layer.self_attn.sinks is not None:
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


def _check_model(arch, impl, ids, mask, gen):
    """ours (float32) against eager in float64, with eager in float32 as the same-dtype baseline.  The
    weights come from the test's generator (from_config draws them from torch's global one, whose state
    depends on the tests run before: the same test could pass in one run and fail in another)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(torch.randint(2**31 - 1, (1,), generator=gen)))
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


def test_the_flash_api_name_is_taken_by_hf_name_and_the_flags():
    # attn_backends_flash_attention_2 is registered and documented as an attn_implementation: the name
    # helpers give it back (as they do for the continuous-batching names it stands for), not "unknown backend"
    import argparse

    api = _transformers.FLASH_API
    assert ab.hf_name(api) == ab.hf_name("paged|" + api) == ab.hf_name("paged|eager") == api
    parser = ab.add_argparse_args(argparse.ArgumentParser())
    args = parser.parse_args(["--attn_implementation", api])
    try:
        assert ab.apply_args(args, for_hf=True) == api
    finally:
        ab.apply_args(argparse.Namespace(attn_implementation="auto"))


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

ARCHS = ["llama", "mistral", "qwen2", "gemma2", "gpt2", "bert", "t5", "mpt", "gpt_oss"]


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
        _check_model(arch, "attn_backends", ids, mask, gen)
    if arch == "mpt":  # its attention is its own code: eager's mask, and a warning that says so
        assert not spy
    else:
        assert spy and set(spy) == {"attention"}


@pytest.mark.parametrize("arch", ["llama", "bert", "t5", "gpt_oss"])
def test_varlen_name_unpads_a_padded_batch(arch, gen, spy):
    # transformers' flash_attention_2 path: the padding mask turns each row into one packed
    # sequence; T5's position bias needs the dense kernel, and gets it
    ab.register_transformers()
    ids = torch.randint(1, V, (2, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    _check_model(arch, "attn_backends_fa_varlen", ids, mask, gen)
    assert ("attention" if arch == "t5" else "attention_varlen") in spy


@pytest.mark.parametrize("arch, side", [("modernbert", "right"), ("modernbert", "left"), ("bart", "right")])
def test_varlen_name_keeps_the_masks_semantics_where_transformers_flash_path_differs(arch, side, gen):
    """ModernBERT's bidirectional sliding window (the sliding_window keyword is flash's, |i - j| < it: the
    model passes its window + 1), right- and left-padded (a window is counted in token positions, so the
    queries are packed as the keys: before, a left-padded row's queries kept their padded positions against
    the packed keys), and BART's cross-attention over a padded encoder, whose decoder queries are all real
    (transformers' flash path takes the encoder's padding for them and zeroes the decoder's rows past each
    encoder row's length): the varlen name matches eager in float64 there."""
    ab.register_transformers()
    ids = torch.randint(3, V, (3, 20), generator=gen)
    mask = torch.ones_like(ids)
    if side == "left":
        mask[0, :8] = 0
        mask[2, :3] = 0
    else:
        mask[0, -8:] = 0
        mask[2, -3:] = 0
    kw = dict(input_ids=ids, attention_mask=mask)
    if arch == "bart":  # a shorter decoder input than the encoder's, unpadded
        kw.update(decoder_input_ids=torch.randint(3, V, (3, 12), generator=gen), use_cache=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(torch.randint(2**31 - 1, (1,), generator=gen)))
        ref = _model(arch, "eager").eval()

    def run(model):
        with torch.no_grad():
            out = model(**kw)
        return out.logits if hasattr(out, "logits") else out.last_hidden_state

    x64, x32 = run(copy.deepcopy(ref).double()), run(ref)
    x = run(_model(arch, "attn_backends_fa_varlen", like=ref).eval())
    keep = mask.bool() if arch == "modernbert" else torch.ones(x.shape[:2], dtype=torch.bool)
    check_2x("logits", x[keep], x64[keep], x32[keep], 2, torch.float32)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("extra", ["window", "alibi"])
def test_varlen_name_on_a_padded_batch_counts_positions_in_tokens(extra, side, gen):
    # bidirectional self-attention whose scores depend on distance (a sliding window, ALiBi), under the
    # varlen name's padding mask: each row's real rows equal attention over its real tokens alone, whichever
    # side pads (the queries used to keep their padded positions: left padding broke the window, right
    # padding ALiBi, whose alignment is bottom-right)
    from attn_backends import _transformers

    class Module(torch.nn.Module):
        is_causal = False

    B, H, S, D = 2, 2, 9, 16
    q, k, v = (torch.randn(B, H, S, D, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, slice(None, 3) if side == "left" else slice(-3, None)] = 0
    slopes = torch.rand(H, generator=gen) + 0.5  # float32, as flash-attn takes them
    # HF's sliding_window counts the query itself: 3 is |i - j| <= 2
    kw, opt = (({"sliding_window": 3}, dict(window=(2, 2))) if extra == "window"
               else ({"alibi_slopes": slopes}, dict(alibi_slopes=slopes)))
    out = _transformers._forward("flash_varlen", Module(), q, k, v, mask, 0.0, None, False, kw)
    for b in range(B):
        real = mask[b].bool()
        ref, _ = reference_attention(q[b:b + 1, :, real], k[b:b + 1, :, real], v[b:b + 1, :, real], **opt)
        assert torch.allclose(out[b, real].transpose(0, 1), ref[0], atol=1e-12, rtol=0), (b, side, extra)


@pytest.mark.parametrize("arch", ["gpt_oss", "granite_swa", "mimo_v2_flash"])
def test_flash_api_name_serves_models_that_list_their_flash_kernels(arch, gen, monkeypatch, hf_flash_reload):
    # these models list flash-attn 3/4 builds (they take sinks) in _compatible_flash_implementations, and
    # transformers rewrites any other flash name to the first, a hub kernel; FLASH_API is kept, and
    # transformers' flash path runs them on attn_backends.flash_attn, sinks, windows and Dv != D included
    if not hasattr(transformers, {"gpt_oss": "GptOssConfig", "granite_swa": "GraniteSWAConfig",
                                  "mimo_v2_flash": "MiMoV2FlashConfig"}[arch]):
        pytest.skip(f"this transformers release has no {arch}")
    from attn_backends import flash_attn as fa

    ab.register_transformers()
    sinks = []
    real = fa.flash_attn_varlen_func

    def spy(*a, **kw):
        sinks.append(kw.get("s_aux") is not None)
        return real(*a, **kw)

    spy.__signature__ = inspect.signature(real)
    monkeypatch.setattr(fa, "flash_attn_varlen_func", spy)
    model = _model(arch, _transformers.FLASH_API)
    assert type(model)._compatible_flash_implementations  # the list transformers rewrites by
    assert model.config._attn_implementation == _transformers.FLASH_API
    assert "_compatible_flash_implementations" not in model.__dict__  # the model is left as it was
    ids = torch.randint(1, V, (2, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    _check_model(arch, _transformers.FLASH_API, ids, mask, gen)
    assert True in sinks  # the sliding layers' sinks reached our function


def test_flash_api_name_leaves_other_kernel_lists_to_transformers():
    # a model that lists only a kernel of another kind (MiniMax-M3's sparse "MiniMaxAI/msa") is
    # rewritten by transformers as before: here to a hub kernel that cannot load
    ab.register_transformers()

    class SparseOnly(transformers.LlamaForCausalLM):
        _compatible_flash_implementations = ["someorg/sparse-kernel"]

    model = SparseOnly(_config("llama"))
    with pytest.raises(Exception):
        model.set_attn_implementation(_transformers.FLASH_API)
    assert model.config._attn_implementation != _transformers.FLASH_API
    check = transformers.PreTrainedModel._check_and_adjust_attn_implementation
    ab.register_transformers()
    assert transformers.PreTrainedModel._check_and_adjust_attn_implementation is check  # wrapped once


def test_varlen_name_refuses_position_bias_on_packed_sequences():
    forward = _forward("attn_backends_fa_varlen")  # registers first: alone, this test found no such name
    module = torch.nn.Module()
    q = torch.randn(1, 2, 6, 8)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="position_bias cannot be applied to packed sequences"):
        forward(module, q, q, q, None, position_bias=torch.zeros(1, 2, 6, 6), cu_seq_lens_q=cu, cu_seq_lens_k=cu)


# ---- the attention function's keywords ---------------------------------------------------------

def _forward(name="attn_backends"):
    ab.register_transformers()
    return transformers.AttentionInterface._global_mapping[name]


class _Module(torch.nn.Module):
    def __init__(self, is_causal=True):
        super().__init__()
        self.is_causal = is_causal


def _ref_sinks(q, k, v, sinks, mask=None, scale=None, dtype=torch.float64):
    """Softmax over [scores, sink]: the sink joins the denominator and adds no value."""
    q, k, v, s = (t.to(dtype) for t in (q, k, v, sinks))
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    scores = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = s[None, :, None, None].expand(*scores.shape[:-1], 1)
    p = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    return p @ v


@pytest.mark.parametrize("packed", [False, True])
def test_sinks_are_exact_forward_and_backward(packed, gen):
    # a fully masked row (dense) stays 0, with finite gradients
    B, Hq, Hkv, S, D = 2, 4, 2, 7, 8
    inputs = [torch.randn(B, Hq, S, D, generator=gen), torch.randn(B, Hkv, S, D, generator=gen),
              torch.randn(B, Hkv, S, D, generator=gen), 2 * torch.randn(Hq, generator=gen)]
    mask = torch.rand(B, 1, S, S, generator=gen) > 0.3
    mask[1, :, 2] = False
    g = torch.randn(B, Hq, S, D, generator=gen)

    def ours(q, k, v, s):
        if not packed:
            return _transformers._attend(q, k, v, s, attn_mask=mask)
        # each batch row as one packed sequence, causal per sequence
        cu = torch.tensor([0, S, 2 * S], dtype=torch.int32)
        flat = [t.transpose(1, 2).reshape(B * S, t.shape[1], D) for t in (q, k, v)]
        out = _transformers._attend(*flat, s, (cu, cu, S, S), causal=True)
        return out.view(B, S, Hq, D).transpose(1, 2)

    m = mask if not packed else torch.ones(S, S, dtype=torch.bool).tril()
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = ours(*leaves)
    grads = torch.autograd.grad(out, leaves, g)
    ref_leaves = [t.double().requires_grad_() for t in inputs]
    r = _ref_sinks(*ref_leaves, mask=m)
    r_grads = torch.autograd.grad(r, ref_leaves, g.double())
    same_leaves = [t.clone().requires_grad_() for t in inputs]
    s32 = _ref_sinks(*same_leaves, mask=m, dtype=torch.float32)
    s_grads = torch.autograd.grad(s32, same_leaves, g)
    if not packed:
        assert torch.equal(out[1, :, 2], torch.zeros_like(out[1, :, 2]))
    check_2x("out", out, r, s32, 2, torch.float32)
    for name, a, b, c in zip(("dq", "dk", "dv", "dsinks"), grads, r_grads, s_grads):
        check_2x(name, a, b, c, 3, torch.float32)


def test_position_bias_joins_the_mask_and_gets_its_gradient(gen):
    forward = _forward()
    B, H, Sq, Sk, D = 2, 4, 5, 7, 8
    q, k, v = (torch.randn(B, H, s, D, generator=gen) for s in (Sq, Sk, Sk))
    bias = torch.randn(1, H, Sq, Sk, generator=gen)
    mask = torch.rand(B, 1, Sq, Sk, generator=gen) > 0.3
    mask[0, :, 1] = False  # a fully masked row: 0, no NaN
    g = torch.randn(B, Sq, H, D, generator=gen)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    out, weights = forward(_Module(False), *leaves[:3], mask, position_bias=leaves[3])
    assert weights is None
    grads = torch.autograd.grad(out, leaves, g)
    assert torch.equal(out[0, 1], torch.zeros_like(out[0, 1]))
    float_mask = lambda b: b.masked_fill(~mask, float("-inf"))
    refs = []
    for dtype in (torch.float64, torch.float32):
        rl = [t.to(dtype).requires_grad_() for t in (q, k, v, bias)]
        r, _ = reference_attention(*rl[:3], attn_mask=float_mask(rl[3]), dtype=dtype)
        r = r.transpose(1, 2)
        refs.append((r, torch.autograd.grad(r, rl, g.to(dtype))))
    (r64, g64), (r32, g32) = refs
    check_2x("out", out, r64, r32, 2, torch.float32)
    for name, a, b, c in zip(("dq", "dk", "dv", "dbias"), grads, g64, g32):
        check_2x(name, a, b, c, 3, torch.float32)


@pytest.mark.parametrize("case", ["prefill", "decode", "bidirectional"])
def test_sliding_window_and_softcap_without_a_mask(case, gen):
    # HF passes no mask when causality alone would do; the window then comes from sliding_window, in
    # flash's terms: key j is visible to query i when i - j < sliding_window (bidirectional: |i - j| <
    # it, transformers' flash path's window_size (sw - 1, sw - 1))
    forward = _forward()
    sw, cap, S = 3, 5.0, 8
    Sq = 1 if case == "decode" else S
    q = torch.randn(1, 4, Sq, 8, generator=gen) * 3
    k, v = (torch.randn(1, 2, S, 8, generator=gen) for _ in range(2))
    out, _ = forward(_Module(case != "bidirectional"), q, k, v, None, sliding_window=sw, softcap=cap)
    i = torch.arange(S - Sq, S)[:, None]
    j = torch.arange(S)[None]
    vis = (i - j < sw) & (j <= i) if case != "bidirectional" else (i - j).abs() < sw
    kk, vv = (t.repeat_interleave(2, 1) for t in (k, v))
    r64, _ = reference_attention(q, kk, vv, attn_mask=vis, softcap=cap, dtype=torch.float64)
    r32, _ = reference_attention(q, kk, vv, attn_mask=vis, softcap=cap, dtype=torch.float32)
    check_2x("out", out, r64.transpose(1, 2), r32.transpose(1, 2), 2, torch.float32)


def test_a_keyword_it_cannot_honour_raises_naming_it():
    forward = _forward()
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(TypeError, match="'head_mask'.*cannot honour"):
        forward(_Module(), q, q, q, None, head_mask=torch.ones(2))
    with pytest.raises(TypeError, match="'block_table', 'cache'"):
        forward(_Module(), q, q, q, None, cache=object(), block_table=torch.zeros(1))
    # keywords that do not change the result, and absent (None) ones, are fine
    out, _ = forward(_Module(), q, q, q, None, position_ids=torch.arange(3)[None], use_cache=True,
                     encoder_hidden_states=None, softcap=None, sliding_window=None, s_aux=None)
    assert out.shape == (1, 3, 2, 8)
    with pytest.raises(ValueError, match="cu_seq_lens_q and cu_seq_lens_k, got only cu_seq_lens_q"):
        forward(_Module(), q, q, q, None, cu_seq_lens_q=torch.tensor([0, 3]))


def test_output_attentions_warns_once_and_returns_none(caplog):
    forward = _forward()
    _transformers._warned_output_attentions[0] = False
    q = torch.randn(1, 2, 3, 8)
    with caplog.at_level(logging.WARNING, logger="attn_backends"):
        for _ in range(2):
            _, weights = forward(_Module(), q, q, q, None, output_attentions=True)
            assert weights is None
    assert sum("output_attentions=True" in r.getMessage() for r in caplog.records) == 1


# ---- packed sequences -------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["varlen name, position_ids", "varlen name, cu_seq_lens",
                                 "dense name, cu_seq_lens", "dense name, position_ids without a cache"])
def test_packed_sequences_equal_each_sequence_alone(how, gen, spy):
    # padding-free training: three sequences in one row, position_ids restarting at 0 (qwen2: one
    # sliding layer, window 4)
    ab.register_transformers()
    lens = [4, 6, 3]
    seqs = [torch.randint(1, V, (1, n), generator=gen) for n in lens]
    ids = torch.cat(seqs, 1)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    cu = torch.tensor([0, 4, 10, 13], dtype=torch.int32)
    ref = _model("qwen2", "eager")
    impl = "attn_backends_fa_varlen" if how.startswith("varlen") else "attn_backends"
    ours = _model("qwen2", impl, like=ref)
    kw = dict(position_ids=pos, use_cache="without a cache" not in how)
    if "cu_seq_lens" in how:
        kw.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=6, max_length_k=6)
    g = torch.randn(1, 13, V, generator=gen)

    def run(model, pieces):
        outs = [model(input_ids=i, **k).logits for i, k in pieces]
        out = torch.cat(outs, 1)
        return out, torch.autograd.grad(out, list(model.parameters()), g.to(out.dtype))

    alone = [(s, dict(use_cache=False)) for s in seqs]
    x64, g64 = run(copy.deepcopy(ref).double(), alone)
    x32, g32 = run(ref, alone)
    x, grads = run(ours, [(ids, kw)])
    check_2x("logits", x, x64, x32, 2, torch.float32)
    for (name, _), a, r, s in zip(ref.named_parameters(), grads, g64, g32):
        check_2x(f"d {name}", a, r, s, 3, torch.float32)
    assert ("attention_varlen" in spy) == ("position_ids without a cache" not in how)


# ---- generate ---------------------------------------------------------------------------------

@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("arch", ["mistral", "gpt_oss"])
def test_generate_matches_eager(arch, cache, gen):
    # left padding, a window (4) shorter than prompt + generation, GPT-OSS's sinks in every step
    ab.register_transformers()
    ref = _model(arch, "eager").eval()
    ids = torch.randint(1, V, (2, 7), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    if cache == "static":
        kw["cache_implementation"] = "static"
    want = ref.generate(ids, **kw)
    for impl in ("attn_backends", "attn_backends_fa_varlen"):
        got = _model(arch, impl, like=ref).eval().generate(ids, **kw)
        assert torch.equal(got, want), impl



# ---- HF's own "sdpa", patched -----------------------------------------------------------------

def test_patched_sdpa_serves_hf_sdpa_models(gen, spy):
    # attn_implementation="sdpa" keeps meaning HF's implementation; ab.patched_sdpa routes the
    # F.scaled_dot_product_attention it calls through our backends
    model = _model("llama", "sdpa")
    ids = torch.randint(1, V, (2, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    keep = mask.bool()
    want, want_grads = _run(model, ids, mask, "llama")
    with ab.patched_sdpa("flash"):
        got, grads = _run(model, ids, mask, "llama")
    assert spy.count("attention") == 2  # both layers
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-4, atol=1e-5)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("padded", [False, True])
def test_alibi_slopes_from_a_model_reach_the_kernel(padded, gen):
    # no ALiBi model of transformers 5.x calls the attention interface (MPT, Bloom and Falcon attend in their
    # own code); a model that hands over flash-attn-style slopes gets them applied, not ignored
    forward = _forward("attn_backends_fa_varlen" if padded else "attn_backends")
    B, Hq, Hkv, S, D = 2, 4, 2, 9, 8
    q = torch.randn(B, Hq, S, D, generator=gen)
    k, v = (torch.randn(B, Hkv, S, D, generator=gen) for _ in range(2))
    slopes = torch.rand(Hq, generator=gen)
    pad = torch.ones(B, S, dtype=torch.bool)
    out, _ = forward(_Module(True), q, k, v, pad if padded else None, alibi_slopes=slopes)
    kk, vv = (t.repeat_interleave(2, 1) for t in (k, v))
    r64, _ = reference_attention(q, kk, vv, causal=True, alibi_slopes=slopes, dtype=torch.float64)
    r32, _ = reference_attention(q, kk, vv, causal=True, alibi_slopes=slopes, dtype=torch.float32)
    check_2x("out", out, r64.transpose(1, 2), r32.transpose(1, 2), 2, torch.float32)


@pytest.mark.parametrize("impl", ["attn_backends", "attn_backends_fa_varlen"])
def test_autocast_with_a_float32_model(impl, gen):
    # Trainer(bf16=True)'s setting: under autocast a float32 model's q and k leave RoPE in float32 beside a
    # bfloat16 v; the names raised "q, k and v must have the same dtype".  They run in autocast's dtype, as
    # HF's sdpa (an autocast op) and flash paths do.
    ab.register_transformers()
    ref = _model("llama", "eager").double()
    ids = torch.randint(1, V, (2, 9), generator=gen)
    with torch.no_grad():
        want64 = ref(input_ids=ids).logits
    outs = {}
    for name in ("sdpa", impl):
        model = _model("llama", name, like=ref.float())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=ids).logits
        logits.float().square().mean().backward()
        assert all(p.grad is not None and bool(p.grad.isfinite().all()) for p in model.parameters() if p.requires_grad)
        outs[name] = logits.detach()
    assert outs[impl].dtype == outs["sdpa"].dtype
    check_2x("logits under autocast", outs[impl].double(), want64, outs["sdpa"].double(), 2, torch.bfloat16)


def test_flash_api_name_refuses_models_without_flash_support():
    # transformers checks flash support only for names matching flash_attention_N: T5 took the flash-path name
    # and its flash path dropped the position bias (logits 0.18 off eager)
    ab.register_transformers()
    with pytest.raises(ValueError, match="does not support Flash Attention.*'attn_backends_fa'"):
        _model("t5", "attn_backends_flash_attention_2")
    _model("llama", "attn_backends_flash_attention_2")  # a model that supports it still takes it


def test_varlen_name_keeps_mask_patterns_beyond_causal_and_windows(gen):
    # Llama 4's chunked attention reaches the mask function as a chunked overlay, not use_vmap: the varlen
    # name dropped it and ran plain causal attention (logits 0.24 off sdpa)
    ab.register_transformers()
    T = transformers
    if not hasattr(T, "Llama4TextConfig"):
        pytest.skip("this transformers has no Llama 4")
    cfg = T.Llama4TextConfig(vocab_size=V, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                             num_local_experts=1, num_experts_per_tok=1, attention_chunk_size=4, moe_layers=[],
                             interleave_moe_layer_step=0, layer_types=["chunked_attention", "full_attention"],
                             no_rope_layers=[1, 0])
    torch.manual_seed(0)
    model = T.Llama4ForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()
    ids = torch.randint(3, V, (2, 11), generator=gen)
    with torch.no_grad():
        want = model(input_ids=ids).logits
        model.set_attn_implementation("attn_backends_fa_varlen")
        got = model(input_ids=ids).logits
    assert (got - want).abs().max() < 1e-5
