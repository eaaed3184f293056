"""attn_backends.flash_attn: flash-attn's flash_attn_func, flash_attn_varlen_func and
flash_attn_with_kvcache over our backends, and transformers' flash path (its continuous batching
included) running on them.

The references build flash-attn's visibility themselves (causal and windows aligned bottom-right,
with or without causal), so a wrong alignment in the wrappers cannot hide behind ours."""

import inspect
import logging

import pytest
import torch

import attn_backends as ab
from attn_backends import flash_attn as fa
from attn_backends._testing import check_2x, make_packed, max_err, reference_attention

DTYPES = [torch.float32, torch.bfloat16]


def fa_visible(Sq, Sk, causal, window):
    """flash-attn's rule: query i sits at i + Sk - Sq; causal hides keys after it, the window
    (left, right) keeps keys within left before and right after it (-1: unbounded)."""
    i = torch.arange(Sq).view(-1, 1) + (Sk - Sq)
    j = torch.arange(Sk).view(1, -1)
    ok = torch.ones(Sq, Sk, dtype=torch.bool)
    if causal:
        ok &= j <= i
    left, right = window
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok


def ref_bshd(q, k, v, causal, window, dtype=torch.float64, **opts):
    """(out (B, Sq, Hq, Dv), lse (B, Hq, Sq)) of flash-attn's rule, inputs in its (B, S, H, D) layout."""
    mask = fa_visible(q.shape[1], k.shape[1], causal, window)
    out, lse = reference_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                   dtype=dtype, **opts)
    return out.transpose(1, 2), lse


# ---- flash_attn_func --------------------------------------------------------------------------

WINDOWS = [(-1, -1), (3, 0), (2, 5), (-7, 4), (0, -1)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Sq,Sk", [(6, 6), (3, 11), (10, 4)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS)
def test_func_aligns_causal_and_windows_as_flash_attn(dtype, Sq, Sk, causal, window, monkeypatch):
    g = torch.Generator().manual_seed(Sq * 100 + Sk)
    q = torch.randn(2, Sq, 4, 24, generator=g).to(dtype)
    k = torch.randn(2, Sk, 2, 24, generator=g).to(dtype)
    v = torch.randn(2, Sk, 2, 24, generator=g).to(dtype)
    served = []  # the backend the plan gives each call, read off the call flash_attn_func makes
    attention = ab.attention

    def planned(*args, **kw):
        served.append(ab.explain(*args, **kw).chosen)
        return attention(*args, **kw)

    monkeypatch.setattr(ab, "attention", planned)
    out, lse, none = fa.flash_attn_func(q, k, v, causal=causal, window_size=window, return_attn_probs=True)
    assert none is None and out.shape == (2, Sq, 4, 24) and lse.shape == (2, 4, Sq) and lse.dtype == torch.float32
    r_out, r_lse = ref_bshd(q, k, v, causal, window)
    d_out, d_lse = ref_bshd(q, k, v, causal, window, dtype=dtype)
    check_2x("out", out, r_out, d_out, 2, dtype)
    check_2x("lse", lse, r_lse, d_lse.float(), 2, torch.float32)
    # a row flash-attn's rule hides entirely gives 0 (and lse -inf)
    dead = ~fa_visible(Sq, Sk, causal, window).any(-1)
    assert (out[:, dead] == 0).all() and (lse[..., dead] == float("-inf")).all()
    # without return_attn_probs: the same output alone, bit for bit where the same backend serves both (on
    # CPUs where auto sends a call without lse to torch SDPA first, bfloat16 on AMX, the 2x rule instead)
    alone = fa.flash_attn_func(q, k, v, causal=causal, window_size=window)
    assert len(served) == 2
    if served[0] == served[1]:
        assert torch.equal(alone, out)
    else:
        check_2x("out alone", alone, r_out, d_out, 2, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_func_softcap_alibi_sinks_scale_and_gradients(dtype):
    g = torch.Generator().manual_seed(3)
    # non-contiguous (B, S, H, D) views, as a model's projections hand them over
    q = torch.randn(2, 4, 7, 16, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(2, 2, 9, 16, generator=g).to(dtype).transpose(1, 2)
    v = torch.randn(2, 2, 9, 16, generator=g).to(dtype).transpose(1, 2)
    slopes = torch.rand(4, generator=g) * 0.3
    sinks = torch.randn(4, generator=g)
    opts = dict(softmax_scale=0.3, causal=True, window_size=(4, 0), softcap=2.5, alibi_slopes=slopes)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    sink_leaf = sinks.clone().requires_grad_()
    out = fa.flash_attn_func(*leaves, s_aux=sink_leaf, **opts)
    gout = torch.randn(out.shape, generator=g).to(dtype)
    grads = torch.autograd.grad(out, leaves + [sink_leaf], gout)

    def ref(dt):
        rl = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
        rs = sinks.to(dt if dt == torch.float64 else torch.float32).requires_grad_()
        o, _ = ref_bshd(*rl, True, (4, 0), dtype=dt, scale=0.3, softcap=2.5, alibi_slopes=slopes, sinks=rs)
        return o, torch.autograd.grad(o, rl + [rs], gout.to(dt))

    r_out, r_grads = ref(torch.float64)
    d_out, d_grads = ref(dtype)
    check_2x("out", out, r_out, d_out, 2, dtype)
    for name, a, r, s in zip(("dq", "dk", "dv", "dsinks"), grads, r_grads, d_grads):
        check_2x(name, a, r, s, 3, dtype)
    for t, t0 in zip((q, k, v), leaves):
        assert torch.equal(t, t0.detach())  # the caller's tensors are left as they were


def test_func_takes_flash_attn_positional_order_and_bad_input_names_the_argument():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 5, 2, 8, generator=g) for _ in range(3))
    by_kw = fa.flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=0.5, causal=True, window_size=(2, 0))
    assert torch.equal(fa.flash_attn_func(q, k, v, 0.0, 0.5, True, (2, 0)), by_kw)
    # any negative side is unbounded, as in flash-attn
    assert torch.equal(fa.flash_attn_func(q, k, v, causal=True, window_size=(-5, -2)),
                       fa.flash_attn_func(q, k, v, causal=True))
    with pytest.raises(ValueError, match="window_size must be a pair"):
        fa.flash_attn_func(q, k, v, window_size=3)
    with pytest.raises(TypeError, match="causal must be a bool"):
        fa.flash_attn_func(q, k, v, causal="yes")
    with pytest.raises(TypeError, match=r"window_size\[0\]"):
        fa.flash_attn_func(q, k, v, window_size=(1.5, 0))



def test_errors_name_softmax_scale_and_s_aux_as_the_caller_wrote_them():
    # our checks say "scale" and "sinks"; a flash-attn caller passed softmax_scale and s_aux (until 2026-12-06
    # the errors named ours)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(1, 5, 2, 8, generator=g)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    calls = {"func": lambda **kw: fa.flash_attn_func(q, q, q, **kw),
             "varlen": lambda **kw: fa.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 5, 5, **kw),
             "qkvpacked": lambda **kw: fa.flash_attn_qkvpacked_func(torch.stack([q, q, q], 2), **kw)}
    for name, call in calls.items():
        with pytest.raises(ValueError, match=r"^softmax_scale must be finite"):
            call(softmax_scale=float("nan"))
        with pytest.raises(TypeError, match=r"^softmax_scale must be a float"):
            call(softmax_scale="x")
        with pytest.raises(ValueError, match=r"^softmax_scale must be within float32's range \(\|softmax_scale\| <="):
            call(softmax_scale=1e39)
        with pytest.raises(ValueError, match=r"^s_aux must have shape \(Hq,\)"):
            call(s_aux=torch.randn(3))
        with pytest.raises(TypeError, match=r"^s_aux must be floating"):
            call(s_aux=torch.zeros(2, dtype=torch.int32))
    kc = torch.randn(1, 8, 2, 8, generator=g)
    with pytest.raises(ValueError, match=r"^s_aux must have shape"):
        fa.flash_attn_with_kvcache(q[:, :1], kc, kc, cache_seqlens=4, s_aux=torch.randn(3))
    # the other messages are left as they are
    with pytest.raises(ValueError, match="window_size must be a pair"):
        fa.flash_attn_func(q, q, q, window_size=3)

def test_signatures_are_flash_attn_2s():
    # transformers reads the parameter names (inspect.signature) to decide what to pass: flash-attn
    # 2's names in its order, then our two keywords
    names = lambda f: list(inspect.signature(f).parameters)
    common = ["dropout_p", "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes", "deterministic",
              "return_attn_probs"]
    assert names(fa.flash_attn_func) == ["q", "k", "v"] + common + ["s_aux", "backend"]
    assert names(fa.flash_attn_varlen_func) == (["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                                                 "max_seqlen_k"] + common + ["block_table", "s_aux", "backend"])
    assert names(fa.flash_attn_with_kvcache) == [
        "q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens", "cache_batch_idx",
        "cache_leftpad", "block_table", "softmax_scale", "causal", "window_size", "softcap", "rotary_interleaved",
        "alibi_slopes", "num_splits", "return_softmax_lse", "s_aux", "backend"]


# ---- flash_attn_varlen_func -------------------------------------------------------------------

def varlen_ref(q, k, v, cu_q, cu_k, causal, window, dtype=torch.float64, **opts):
    outs, lses = [], []
    for b in range(cu_q.numel() - 1):
        o, lse = ref_bshd(q[None, cu_q[b]:cu_q[b + 1]], k[None, cu_k[b]:cu_k[b + 1]], v[None, cu_k[b]:cu_k[b + 1]],
                          causal, window, dtype=dtype, **opts)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(-1, -1), (3, 1), (0, 4)])
@pytest.mark.parametrize("lens", [([3, 0, 5, 1], [7, 2, 5, 4]), ([4, 6], [4, 6])])
def test_varlen_aligns_each_sequence_as_flash_attn(dtype, causal, window, lens):
    lens_q, lens_k = lens
    g = torch.Generator().manual_seed(len(lens_q) * 7 + sum(lens_k))
    q, k, v, cu_q, cu_k = make_packed(lens_q, lens_k, 4, 2, 16, 16, dtype, generator=g)
    out, lse, none = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                               window_size=window, return_attn_probs=True)
    assert none is None and lse.shape == (4, sum(lens_q))
    r_out, r_lse = varlen_ref(q, k, v, cu_q, cu_k, causal, window)
    d_out, d_lse = varlen_ref(q, k, v, cu_q, cu_k, causal, window, dtype=dtype)
    check_2x("out", out, r_out, d_out, 2, dtype)
    check_2x("lse", lse, r_lse, d_lse.float(), 2, torch.float32)


def paged(x, cu, block, g):
    """x's sequences (rows cu[b]..cu[b+1]) written into shuffled blocks of a paged cache, and the
    block table (-1 past each sequence's blocks)."""
    B = cu.numel() - 1
    lens = (cu[1:] - cu[:-1]).tolist()
    per = [(n + block - 1) // block for n in lens]
    nb = sum(per) + 2
    order = torch.randperm(nb, generator=g).tolist()
    cache = torch.randn(nb, block, *x.shape[1:], generator=g).to(x.dtype)  # garbage where no key is
    table = torch.full((B, max(per) + 1), -1, dtype=torch.int32)
    used = 0
    for b in range(B):
        for i in range(per[b]):
            blk = order[used]
            used += 1
            table[b, i] = blk
            rows = x[cu[b] + i * block: cu[b] + min((i + 1) * block, lens[b])]
            cache[blk, :rows.shape[0]] = rows
    return cache, table


@pytest.mark.parametrize("block", [1, 4, 16])
def test_varlen_reads_a_paged_cache_through_block_table(block):
    g = torch.Generator().manual_seed(block)
    lens_q, lens_k = [2, 1, 3], [9, 0, 5]
    q, k, v, cu_q, cu_k = make_packed(lens_q, lens_k, 4, 2, 16, 16, torch.float32, generator=g)
    # the same generator state for both: the same shuffled blocks
    kc, table_k = paged(k, cu_k, block, torch.Generator().manual_seed(100 + block))
    vc, table_v = paged(v, cu_k, block, torch.Generator().manual_seed(100 + block))
    assert torch.equal(table_k, table_v)
    dense = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 9, causal=True)
    got = fa.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, 3, 9, causal=True, block_table=table_k)
    assert torch.equal(got, dense)
    bad = table_k.clone()
    bad[0, 0] = kc.shape[0]
    with pytest.raises(ValueError, match=r"block_table\[0\] names blocks outside"):
        fa.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, 3, 9, block_table=bad)
    bad = table_k.clone()
    bad[2, 0] = -1  # the third sequence's first block (the second has no keys, so no block of its is read)
    with pytest.raises(ValueError, match=r"block_table\[2\] names blocks outside .* within its 5 keys"):
        fa.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, 3, 9, block_table=bad)
    bad = table_k.clone()
    bad[1, :] = 10**6  # a sequence with no keys reads none of its entries
    assert torch.equal(fa.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, 3, 9, causal=True, block_table=bad), dense)
    with pytest.raises(ValueError, match="block_table has 2 rows for 3 sequences"):
        fa.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, 3, 9, block_table=table_k[:2])
    with pytest.raises(ValueError, match="k with block_table must be a paged cache"):
        fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 9, block_table=table_k)


@pytest.mark.parametrize("spare", ["q", "k", "both"])
def test_varlen_takes_rows_past_the_last_sequence(spare, gen):
    # a fixed-size buffer (static shapes): flash-attn takes rows past cu_seqlens[-1] and leaves their output
    # unspecified; ours refused it ("cu_seqlens_q[-1] = 9 must equal the number of packed rows, 16")
    q, k, v, cu_q, cu_k = make_packed([4, 5], [6, 3], 4, 2, 16, 16, torch.float32, generator=gen)
    extra_q, extra_k = (7 if spare != "k" else 0), (5 if spare != "q" else 0)
    qp = torch.cat([q, torch.randn(extra_q, 4, 16, generator=gen)]).requires_grad_()
    kp, vp = (torch.cat([t, torch.randn(extra_k, 2, 16, generator=gen)]).requires_grad_() for t in (k, v))
    out, lse, _ = fa.flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, 5, 6, causal=True, return_attn_probs=True)
    want, want_lse, _ = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 6, causal=True, return_attn_probs=True)
    assert out.shape == qp.shape and lse.shape == (4, qp.shape[0])
    assert torch.equal(out[:9], want) and torch.equal(lse[:, :9], want_lse)
    assert not out[9:].any() and bool((lse[:, 9:] == float("-inf")).all())
    dq, dk, dv = torch.autograd.grad(out.square().sum(), (qp, kp, vp))
    q2, k2, v2 = (t.clone().requires_grad_() for t in (q, k, v))
    wq, wk, wv = torch.autograd.grad(fa.flash_attn_varlen_func(q2, k2, v2, cu_q, cu_k, 5, 6, causal=True).square().sum(),
                                     (q2, k2, v2))
    assert torch.equal(dq[:9], wq) and torch.equal(dk[:9], wk) and torch.equal(dv[:9], wv)
    assert not dq[9:].any() and not dk[9:].any() and not dv[9:].any()
    with pytest.raises(ValueError, match="cu_seqlens_q"):  # fewer rows than the sequences need: still refused
        fa.flash_attn_varlen_func(q[:8], k, v, cu_q, cu_k, 5, 6, causal=True)
    with pytest.raises(ValueError, match="k and v must have the same number of rows"):  # spare rows in k alone
        fa.flash_attn_varlen_func(q, torch.cat([k, k[:2]]), v, cu_q, cu_k, 5, 6, causal=True)
    with pytest.raises(ValueError, match="cu_seqlens_q must be on the CPU or on q's device"):
        fa.flash_attn_varlen_func(qp, kp, vp, cu_q.to("meta"), cu_k, 5, 6, causal=True)


def test_varlen_paths_that_read_the_lengths_compile_with_inductor():
    # a paged call, and a window without causal where a sequence's query and key lengths differ, read
    # cu_seqlens on the host: inductor failed on them ("NameError: name 's25' is not defined" in its code)
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(9, 4, 16, generator=g), torch.randn(12, 2, 16, generator=g), torch.randn(12, 2, 16, generator=g)
    cu_q, cu_k = torch.tensor([0, 4, 9], dtype=torch.int32), torch.tensor([0, 5, 12], dtype=torch.int32)
    window = torch.compile(lambda *a: fa.flash_attn_varlen_func(*a, cu_q, cu_k, 5, 7, window_size=(2, 2)))
    assert torch.equal(window(q, k, v), fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 7, window_size=(2, 2)))
    kc, table = paged(k, cu_k, 4, torch.Generator().manual_seed(1))
    vc, _ = paged(v, cu_k, 4, torch.Generator().manual_seed(1))
    pages = torch.compile(lambda *a: fa.flash_attn_varlen_func(*a, cu_q, cu_k, 5, 7, causal=True, block_table=table))
    assert torch.equal(pages(q, kc, vc), fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 7, causal=True))


# ---- flash_attn_with_kvcache ------------------------------------------------------------------

def test_with_kvcache_is_attention_with_kvcache_in_flash_attn_order():
    g = torch.Generator().manual_seed(11)
    B, S, Hq, Hkv, D = 2, 12, 4, 2, 16
    q = torch.randn(B, 1, Hq, D, generator=g)
    kc, vc = torch.randn(B, S, Hkv, D, generator=g), torch.randn(B, S, Hkv, D, generator=g)
    k, v = torch.randn(B, 1, Hkv, D, generator=g), torch.randn(B, 1, Hkv, D, generator=g)
    cos, sin = torch.rand(S, D // 2, generator=g), torch.rand(S, D // 2, generator=g)
    seqlens = torch.tensor([3, 7], dtype=torch.int32)
    sinks = torch.randn(Hq, generator=g)
    kc2, vc2 = kc.clone(), vc.clone()
    ours = fa.flash_attn_with_kvcache(q, kc, vc, k, v, cos, sin, seqlens, None, None, None, 0.4, True, (5, 0), 0.0,
                                      False, None, 0, True, s_aux=sinks)
    want = ab.attention_with_kvcache(q, kc2, vc2, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens,
                                     softmax_scale=0.4, causal=True, window_size=(5, 0), rotary_interleaved=False,
                                     return_softmax_lse=True, sinks=sinks)
    assert torch.equal(ours[0], want[0]) and torch.equal(ours[1], want[1])
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)  # the same writes into the caches


def test_with_kvcache_runs_without_a_graph_as_flash_attn_does():
    # flash-attn's has no backward and runs whatever its inputs require; ours raised "no backward" for a
    # decode loop outside torch.no_grad() (q from a Linear that requires grad)
    g = torch.Generator().manual_seed(3)
    proj = torch.nn.Linear(64, 64)
    q = proj(torch.randn(2, 1, 64, generator=g)).view(2, 1, 4, 16)
    kc, vc = torch.zeros(2, 32, 2, 16), torch.zeros(2, 32, 2, 16)
    k, v = torch.randn(2, 1, 2, 16, generator=g), torch.randn(2, 1, 2, 16, generator=g)
    kc2, vc2 = kc.clone(), vc.clone()
    out = fa.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=3, causal=True)
    assert not out.requires_grad and not kc.requires_grad
    with torch.no_grad():
        want = ab.attention_with_kvcache(q, kc2, vc2, k, v, cache_seqlens=3, causal=True)
    assert torch.equal(out, want) and torch.equal(kc, kc2) and torch.equal(vc, vc2)


# ---- transformers' flash path on these functions ----------------------------------------------

def _tiny_llama(transformers):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return transformers.LlamaForCausalLM(cfg).eval()


def _counting(monkeypatch):
    """Counts the calls transformers makes into attn_backends.flash_attn (same signatures kept)."""
    calls = {}
    for name in ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"):
        f = getattr(fa, name)

        def counted(*a, _f=f, _n=name, **kw):
            calls[_n] = calls.get(_n, 0) + 1
            return _f(*a, **kw)

        counted.__signature__ = inspect.signature(f)
        monkeypatch.setattr(fa, name, counted)
    return calls


def test_hf_continuous_batching_runs_on_our_varlen_and_kvcache_pair(monkeypatch, hf_flash_reload):
    transformers = pytest.importorskip("transformers")
    from attn_backends._testing import continuous_batching_config

    from attn_backends import _transformers

    ab.register_transformers()
    model = _tiny_llama(transformers)
    gen_cfg = transformers.GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=-1, pad_token_id=0)
    prompts = [[1, 5, 9, 3], [7, 8], [2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22]]

    def generate(**kw):
        cb_cfg = continuous_batching_config(16, num_blocks=32, max_batch_tokens=64,
                                            auto_switch_to_flash=False, **kw)
        out = model.generate_batch(inputs=prompts, generation_config=gen_cfg, continuous_batching_config=cb_cfg)
        return {k: r.generated_tokens for k, r in out.items()}

    model.set_attn_implementation("sdpa")
    hf = generate()  # HF's own paged sdpa
    calls = _counting(monkeypatch)
    model.set_attn_implementation(_transformers.FLASH_API)
    # on the CPU transformers keeps its index-based cache: prefill and decode through the varlen function
    assert generate() == hf and all(len(t) == 10 for t in hf.values())
    assert set(calls) == {"flash_attn_varlen_func"} and calls["flash_attn_varlen_func"] >= 20
    # the decode fast path (block table, the cache written by flash_attn_with_kvcache), which
    # transformers turns on only on CUDA or XPU: its device gate answered yes here, nothing else changed
    import transformers.generation.continuous_batching.initialization as cb_init

    monkeypatch.setattr(cb_init, "is_torch_xpu_available", lambda *a, **k: True)
    calls.clear()
    assert generate(max_blocks_per_request=8) == hf
    # prefill (one varlen call per layer), then 9 decode steps x 2 layers against the block table
    assert calls == {"flash_attn_varlen_func": 2, "flash_attn_with_kvcache": 18}


@pytest.mark.parametrize("layers", ["sliding_attention", "full_attention"])
def test_hf_continuous_batching_runs_gpt_oss_with_its_sinks(monkeypatch, hf_flash_reload, layers):
    # GPT-OSS lists flash-attn 3/4 builds as its flash kernels (they take its sinks, s_aux) and
    # transformers would rewrite any other flash name to one of them; FLASH_API is kept (one of
    # flash-attn's interfaces), so continuous batching runs GPT-OSS on our pair, sinks in every call.
    # Its tokens are eager's, prompt by prompt.  Sliding layers have no block table, so transformers
    # keeps them off the decode fast path; with full attention only, the fast path runs.
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "GptOssConfig"):
        pytest.skip("this transformers release has no GPT-OSS")
    from attn_backends._testing import continuous_batching_config

    from attn_backends import _transformers

    ab.register_transformers()
    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                    num_experts_per_tok=2, sliding_window=4, max_position_embeddings=256,
                                    layer_types=[layers, "full_attention"])
    model = transformers.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
    gen_cfg = transformers.GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=-1, pad_token_id=0)
    prompts = [[1, 5, 9, 3], [7, 8], [2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22]]
    model.set_attn_implementation("eager")
    want = [model.generate(input_ids=torch.tensor([p]), generation_config=gen_cfg)[0, len(p):].tolist()
            for p in prompts]

    sinks = []
    for name in ("flash_attn_varlen_func", "flash_attn_with_kvcache"):
        real = getattr(fa, name)

        def spy(*a, _real=real, _n=name, **kw):
            sinks.append((_n, kw.get("s_aux") is not None))
            return _real(*a, **kw)

        spy.__signature__ = inspect.signature(real)
        monkeypatch.setattr(fa, name, spy)
    model.set_attn_implementation(_transformers.FLASH_API)
    assert model.config._attn_implementation == _transformers.FLASH_API
    fast = layers == "full_attention"
    if fast:
        import transformers.generation.continuous_batching.initialization as cb_init

        monkeypatch.setattr(cb_init, "is_torch_xpu_available", lambda *a, **k: True)
    cb_cfg = continuous_batching_config(16, num_blocks=32, max_batch_tokens=64, auto_switch_to_flash=False,
                                        max_blocks_per_request=8)
    out = model.generate_batch(inputs=prompts, generation_config=gen_cfg, continuous_batching_config=cb_cfg)
    assert [out[f"req_{i}"].generated_tokens for i in range(3)] == want
    assert sinks and all(s for _, s in sinks)
    names = {n for n, _ in sinks}
    assert names == ({"flash_attn_varlen_func", "flash_attn_with_kvcache"} if fast else {"flash_attn_varlen_func"})


def test_hf_generate_on_the_flash_api_name_matches_sdpa():
    # plain generate() with a padded batch: transformers' flash path unpads through the varlen function
    transformers = pytest.importorskip("transformers")
    from attn_backends import _transformers

    ab.register_transformers()
    model = _tiny_llama(transformers)
    ids = torch.tensor([[0, 0, 5, 9, 3, 7], [1, 5, 9, 3, 2, 8]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    model.set_attn_implementation("sdpa")
    want = model.generate(**kw)
    model.set_attn_implementation(_transformers.FLASH_API)
    assert torch.equal(model.generate(**kw), want)
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=mask).logits
        model.set_attn_implementation("sdpa")
        b = model(input_ids=ids, attention_mask=mask).logits
    assert max_err(a[mask.bool()], b[mask.bool()]) < 1e-5


def test_hf_flash_api_name_runs_a_model_without_linear_layers_in_float32(hf_flash_reload):
    # transformers' flash path casts a float32 query to the dtype of the attention module's first nn.Linear:
    # GPT-2 (Conv1D) raised StopIteration, and generate_batch swallowed it into empty results
    transformers = pytest.importorskip("transformers")
    from attn_backends import _transformers

    ab.register_transformers()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                                                                 bos_token_id=0, eos_token_id=0)).eval()
    ids = torch.tensor([[1, 5, 9, 3, 7, 2]])
    with torch.no_grad():
        model.set_attn_implementation("eager")
        want = model(ids).logits
        model.set_attn_implementation(_transformers.FLASH_API)
        got = model(ids).logits
    assert got.dtype == torch.float32 and max_err(got, want) < 1e-5


def _tiny_generate_batch(transformers, model, prompts, **kw):
    from attn_backends._testing import continuous_batching_config

    gen_cfg = transformers.GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb_cfg = continuous_batching_config(16, num_blocks=32, max_batch_tokens=64, auto_switch_to_flash=False, **kw)
    out = model.generate_batch(inputs=prompts, generation_config=gen_cfg, continuous_batching_config=cb_cfg)
    return {k: (r.generated_tokens, r.error) for k, r in out.items()}


@pytest.mark.parametrize("name", ["attn_backends", "attn_backends_torch", "attn_backends_paged", "attn_backends_math"])
def test_hf_continuous_batching_takes_our_other_names(name, hf_flash_reload, caplog):
    # generate_batch takes "paged|eager", "sdpa" and flash names only, and refused every other name of ours
    # ("Implementation attn_backends is not supported for continuous batching"): a batching script broke
    # once --attn_implementation went through ab.apply_args.  Such a model runs on FLASH_API (one warning),
    # and gets its name back afterwards.
    transformers = pytest.importorskip("transformers")
    from attn_backends import _transformers

    ab.register_transformers()
    model = _tiny_llama(transformers)
    prompts = [[1, 5, 9, 3], [7, 8]]
    model.set_attn_implementation("paged|eager")
    want = _tiny_generate_batch(transformers, model, prompts)
    model.set_attn_implementation(name)
    caplog.set_level(logging.WARNING, logger="attn_backends")
    assert _tiny_generate_batch(transformers, model, prompts) == want
    assert model.config._attn_implementation == name
    said = [r.getMessage() for r in caplog.records if "continuous batching takes" in r.getMessage()]
    assert len(said) == 1 and repr(_transformers.FLASH_API) in said[0], said


def test_hf_continuous_batching_on_a_model_without_flash_support_takes_paged_eager(hf_flash_reload, caplog):
    transformers = pytest.importorskip("transformers")
    ab.register_transformers()
    model = _tiny_llama(transformers)
    model._supports_flash_attn = False  # as T5, Doge, ...: FLASH_API is refused for such a model
    prompts = [[1, 5, 9, 3], [7, 8]]
    model.set_attn_implementation("paged|eager")
    want = _tiny_generate_batch(transformers, model, prompts)
    model.set_attn_implementation("attn_backends")
    caplog.set_level(logging.WARNING, logger="attn_backends")
    assert _tiny_generate_batch(transformers, model, prompts) == want
    assert model.config._attn_implementation == "attn_backends"
    assert any("as 'paged|eager'" in r.getMessage() for r in caplog.records)


def test_register_keeps_other_loaders_and_is_idempotent():
    pytest.importorskip("transformers")
    import transformers.modeling_flash_attention_utils as fau

    from attn_backends import _transformers

    ab.register_transformers()
    first = fau._lazy_imports
    ab.register_transformers()
    assert fau._lazy_imports is first  # not wrapped twice
    funcs = fau._lazy_imports(_transformers.FLASH_API)
    assert funcs[:3] == (fa.flash_attn_func, fa.flash_attn_varlen_func, fa.flash_attn_with_kvcache)
    # any other name still reaches transformers' own loader (here: no flash-attn package, no kernels)
    with pytest.raises(Exception):
        fau._lazy_imports("flash_attention_2")


# ---- the packed forms -------------------------------------------------------------------------

def test_packed_forms_are_views_of_the_unpacked_calls_with_gradients_to_the_packed_tensor():
    g = torch.Generator().manual_seed(17)
    qkv = torch.randn(2, 7, 3, 4, 16, generator=g, requires_grad=True)
    out = fa.flash_attn_qkvpacked_func(qkv, causal=True, window_size=(3, 0))
    q, k, v = (t.detach().requires_grad_() for t in qkv.unbind(2))
    want = fa.flash_attn_func(q, k, v, causal=True, window_size=(3, 0))
    assert torch.equal(out, want)
    gout = torch.randn(out.shape, generator=g)
    (dqkv,) = torch.autograd.grad(out, qkv, gout)
    assert torch.equal(dqkv, torch.stack(torch.autograd.grad(want, (q, k, v), gout), dim=2))

    qq = torch.randn(2, 3, 4, 16, generator=g)
    kv = torch.randn(2, 9, 2, 2, 16, generator=g)
    res = fa.flash_attn_kvpacked_func(qq, kv, causal=True, return_attn_probs=True)
    ref = fa.flash_attn_func(qq, kv[:, :, 0], kv[:, :, 1], causal=True, return_attn_probs=True)
    assert torch.equal(res[0], ref[0]) and torch.equal(res[1], ref[1]) and res[2] is None

    q, k, v, cu_q, cu_k = make_packed([3, 5], [3, 5], 4, 4, 16, 16, torch.float32, generator=g)
    assert torch.equal(fa.flash_attn_varlen_qkvpacked_func(torch.stack([q, k, v], 1), cu_q, 5, causal=True),
                       fa.flash_attn_varlen_func(q, k, v, cu_q, cu_q, 5, 5, causal=True))
    q, k, v, cu_q, cu_k = make_packed([2, 1], [6, 4], 4, 2, 16, 16, torch.float32, generator=g)
    assert torch.equal(fa.flash_attn_varlen_kvpacked_func(q, torch.stack([k, v], 1), cu_q, cu_k, 2, 6),
                       fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 2, 6))
    with pytest.raises(ValueError, match=r"qkv must be \(B, S, 3, H, D\)"):
        fa.flash_attn_qkvpacked_func(torch.randn(2, 7, 2, 4, 16))
    with pytest.raises(ValueError, match=r"kv must be \(total, 2, H, D\)"):
        fa.flash_attn_varlen_kvpacked_func(q, torch.randn(10, 2, 16), cu_q, cu_k, 2, 6)


def test_a_transformers_release_without_the_loader_gets_a_warning_not_an_error(monkeypatch, caplog):
    pytest.importorskip("transformers")
    import transformers.modeling_flash_attention_utils as fau
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from attn_backends import _transformers

    monkeypatch.delattr(fau, "_lazy_imports")
    caplog.set_level(logging.WARNING, logger="attn_backends")
    assert _transformers._register_flash_api(AttentionInterface, AttentionMaskInterface) is False
    assert any("attn_backends_flash_attention_2" in r.getMessage() and "_lazy_imports" in r.getMessage()
               for r in caplog.records)


def test_every_path_checks_its_arguments_as_the_packed_path_does():
    g = torch.Generator().manual_seed(23)
    q, k, v, cu_q, cu_k = make_packed([2, 4], [3, 5], 2, 2, 8, 8, torch.float32, generator=g)
    # the non-causal window with Sq != Sk goes sequence by sequence: the same checks first
    for kw in ({"window_size": (1, 1)}, {}):
        # (fewer: spare rows, which flash-attn takes; test_varlen_takes_rows_past_the_last_sequence)
        with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\] = 8 must equal the number of packed rows, 6"):
            fa.flash_attn_varlen_func(q, k, v, torch.tensor([0, 2, 8], dtype=torch.int32), cu_k, 6, 5, **kw)
        with pytest.raises(ValueError, match="must be non-decreasing"):
            fa.flash_attn_varlen_func(q, k, v, torch.tensor([0, 5, 4, 6], dtype=torch.int32),
                                      torch.tensor([0, 3, 5, 8], dtype=torch.int32), 5, 5, **kw)
        with pytest.raises(ValueError, match="more than max_seqlen_q = 2"):
            fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 2, 5, **kw)
        with pytest.raises(TypeError, match="cu_seqlens_q must be a torch.Tensor"):
            fa.flash_attn_varlen_func(q, k, v, [0, 2, 6], cu_k, 4, 5, **kw)
        with pytest.raises(ValueError, match="alibi_slopes"):
            fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 5, alibi_slopes=torch.rand(3, 2), **kw)
    # the paged form: the caches' shapes agree, cu_seqlens_k is checked before it is read
    kc, table = paged(k, cu_k, 4, torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="must have the same"):
        fa.flash_attn_varlen_func(q, kc, torch.randn(8, 2, 2, 8), cu_q, cu_k, 4, 5, block_table=table)
    with pytest.raises(ValueError, match="must be non-decreasing"):
        fa.flash_attn_varlen_func(q, kc, kc, cu_q, torch.tensor([0, 5, 3], dtype=torch.int32), 4, 5,
                                  block_table=table)
    # the dense function names flash-attn's layout
    with pytest.raises(ValueError, match=r"q must be 4-D \(batch, seqlen_q, nheads, headdim\), as in flash-attn"):
        fa.flash_attn_func(torch.randn(5, 2, 8), torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8))
