"""The CPU flash forward hands calls of a few query tokens per sequence to the decode kernel
(csrc/cpu/flash_cpu.c, "short queries"; packed calls without a gradient through
attn_backends/_providers/ours.py): decode through ab.attention, a patched SDPA or
flash_attn_varlen_func.  Those calls still follow the design's semantics, checked against the
float64 reference under the 2x rule (odd shapes, GQA and MHA, Sq > Sk, every causal alignment the
route takes, windows, softcap, sinks, ALiBi, masks, rows and sequences that see no key,
non-contiguous views); bit-for-bit equality with attention_with_kvcache on the same tensors shows the
decode kernel served them.  Calls the route leaves to flash (a top-left alignment that differs, more
tokens, a gradient) are checked to be right as well."""

import pytest
import torch

import attn_backends as ab
from attn_backends import _C
from attn_backends._testing import (check_2x, check_out_and_grads_2x, make_packed, reference_attention,
                                    varlen_reference)

pytestmark = pytest.mark.skipif(_C.cuda_emulation(), reason="CPU tensors take the emulated CUDA kernels")

F32, BF16 = torch.float32, torch.bfloat16


def _bshd(B, S, H, D, dtype, gen):
    # flash-attn's layout seen as (B, H, S, D): a non-contiguous view, as transformers hands them over
    return torch.randn(B, S, H, D, generator=gen).to(dtype).transpose(1, 2)


def _opts(case, gen, Hq, B):
    opts = {}
    if "softcap" in case:
        opts["softcap"] = 4.0
    if "sinks" in case:
        opts["sinks"] = torch.randn(Hq, generator=gen)
    if "alibi" in case:
        opts["alibi_slopes"] = torch.rand(B, Hq, generator=gen) * 0.3
    if "window" in case:
        opts["window"] = (3, 0)
    return opts


def _via_kvcache(q, k, v, causal, opts):
    # the same call as attention_with_kvcache sees it: (B, S, H, D) views, bottom-right alignment
    w = opts.get("window")
    return ab.attention_with_kvcache(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                     causal=bool(causal), window_size=w if w else (-1, -1),
                                     softcap=opts.get("softcap", 0.0), alibi_slopes=opts.get("alibi_slopes"),
                                     sinks=opts.get("sinks"), return_softmax_lse=True)


DENSE = [  # B, Hq, Hkv, Sq, Sk, D
    (2, 4, 1, 1, 37, 16),   # MQA, one token
    (1, 8, 2, 3, 50, 40),   # GQA, three tokens, odd D
    (3, 6, 6, 4, 19, 24),   # MHA, four tokens
    (2, 4, 2, 4, 3, 16),    # Sq > Sk: bottom-right leaves the first row without a key
    (1, 4, 2, 2, 2, 8),     # Sq == Sk: top-left is bottom-right
]


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("causal", [False, "bottom_right", True])
@pytest.mark.parametrize("case", ["plain", "softcap+sinks", "alibi+window"])
@pytest.mark.parametrize("shape", DENSE)
def test_dense_short_queries_match_the_reference(shape, case, causal, dtype, gen):
    B, Hq, Hkv, Sq, Sk, D = shape
    if "window" in case and causal is not True and causal != "bottom_right":
        causal = "bottom_right"  # a window alone aligns top-left: the route leaves it to flash (below)
    q, k, v = (_bshd(B, S, H, D, dtype, gen) for S, H in ((Sq, Hq), (Sk, Hkv), (Sk, Hkv)))
    opts = _opts(case, gen, Hq, B)
    with torch.no_grad():
        out, lse = ab.attention(q, k, v, causal=causal, return_lse=True, **opts)
    ref_opts = dict(opts)
    ref64, lse64 = reference_attention(q, k, v, causal=causal, **ref_opts)
    same, _ = reference_attention(q, k, v, causal=causal, dtype=dtype, **ref_opts)
    check_2x("out", out, ref64, same, 2, dtype)
    check_2x("lse", lse, lse64, lse64.float(), 2, F32)
    routed = causal in (False, "bottom_right") or Sq == Sk
    if routed:  # the decode kernel served it: the same bits as attention_with_kvcache
        kv_out, kv_lse = _via_kvcache(q, k, v, causal, opts)
        assert torch.equal(out, kv_out.transpose(1, 2)) and torch.equal(lse, kv_lse)


def _mask(kind, B, Hq, Sq, Sk, dtype, gen):
    """Masks as models pass them: HF's (B, 1, Sq, Sk) padding masks (bool, or additive in q's dtype with
    the dtype's min), a per-head bool one, a float32 (Sq, Sk) bias; row 0 of batch row 0 hides every key."""
    if kind == "bool_heads":
        m = torch.rand(B, Hq, Sq, Sk, generator=gen) > 0.4
    elif kind == "bias_2d":
        return torch.randn(Sq, Sk, generator=gen)  # broadcast over B and H: zero strides; nothing hidden
    else:
        m = (torch.rand(B, 1, Sq, Sk, generator=gen) > 0.3)
        m[-1, :, :, : Sk // 3] = False  # left padding of the last batch row
    m[0, :, 0] = False
    if kind == "bool":
        return m
    return torch.zeros(m.shape, dtype=dtype).masked_fill(~m, torch.finfo(dtype).min if kind == "min" else -torch.inf)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("kind", ["bool", "bool_heads", "min", "ninf", "bias_2d"])
@pytest.mark.parametrize("case", ["plain", "causal+softcap+sinks", "alibi+window"])
@pytest.mark.parametrize("shape", DENSE[:4])
def test_dense_short_queries_with_a_mask_match_the_reference(shape, case, kind, dtype, gen):
    # the decode kernel applies the mask as flash does (after softcap and ALiBi; bool hides, floating adds)
    B, Hq, Hkv, Sq, Sk, D = shape
    causal = "bottom_right" if "causal" in case or "window" in case else False
    q, k, v = (_bshd(B, S, H, D, dtype, gen) for S, H in ((Sq, Hq), (Sk, Hkv), (Sk, Hkv)))
    opts = _opts(case, gen, Hq, B)
    mask = _mask(kind, B, Hq, Sq, Sk, dtype, gen)
    with torch.no_grad():
        out, lse = ab.attention(q, k, v, causal=causal, attn_mask=mask, return_lse=True, **opts)
    ref64, lse64 = reference_attention(q, k, v, causal=causal, attn_mask=mask, **opts)
    same, _ = reference_attention(q, k, v, causal=causal, attn_mask=mask, dtype=dtype, **opts)
    check_2x("out", out, ref64, same, 2, dtype)
    check_2x("lse", lse, lse64, lse64.float(), 2, F32)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("kind", ["bool", "bool_heads", "ninf", "bias_2d"])
@pytest.mark.parametrize("shape", [(1, 16, 2, 2, 70, 32), (2, 8, 2, 8, 45, 32)], ids=str)
def test_masked_tiles_of_many_rows_match_the_reference(shape, kind, dtype, isa, gen):
    # 16 and 32 query rows per KV head: the decode kernel's tiled products (without bfloat16 products) apply the
    # mask on their transposed scores, every CPU path; in bfloat16 on the AMX paths with both products on tiles
    # (decode_cpu_impl.h, "tiles of many rows")
    B, Hq, Hkv, Sq, Sk, D = shape
    q, k, v = (_bshd(B, S, H, D, dtype, gen) for S, H in ((Sq, Hq), (Sk, Hkv), (Sk, Hkv)))
    mask = _mask(kind, B, Hq, Sq, Sk, dtype, gen)
    opts = dict(softcap=4.0, alibi_slopes=torch.rand(Hq, generator=gen) * 0.3)
    with torch.no_grad():
        # flash named: auto may send bfloat16 to torch SDPA (AMX CPUs)
        out, lse = ab.attention(q, k, v, causal="bottom_right", attn_mask=mask, return_lse=True, backend="flash",
                                **opts)
        one = torch.ones(Sq, Sk, dtype=torch.bool)  # hides nothing: the bits of the unmasked call, the kernel's
        assert torch.equal(ab.attention(q, k, v, causal="bottom_right", attn_mask=one, backend="flash", **opts),
                           ab.attention(q, k, v, causal="bottom_right", backend="flash", **opts))
    ref64, lse64 = reference_attention(q, k, v, causal="bottom_right", attn_mask=mask, **opts)
    same, _ = reference_attention(q, k, v, causal="bottom_right", attn_mask=mask, dtype=dtype, **opts)
    check_2x("out", out, ref64, same, 2, dtype)
    check_2x("lse", lse, lse64, lse64.float(), 2, F32)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_a_mask_that_hides_nothing_gives_the_decode_kernels_bits(dtype, gen):
    # the masked call runs on the decode kernel: an all-true mask, or a zero bias, changes no bit of the
    # unmasked call's result (which is attention_with_kvcache's, test_dense_short_queries_match_the_reference);
    # flash itself sums in another order
    B, Hq, Hkv, Sq, Sk, D = 2, 8, 2, 2, 300, 40
    q, k, v = (_bshd(B, S, H, D, dtype, gen) for S, H in ((Sq, Hq), (Sk, Hkv), (Sk, Hkv)))
    with torch.no_grad():
        plain = ab.attention(q, k, v, causal="bottom_right", return_lse=True)
        for mask in (torch.ones(B, 1, Sq, Sk, dtype=torch.bool), torch.zeros(Sq, Sk, dtype=dtype),
                     torch.ones(B, Hq, Sk, Sq, dtype=torch.bool).transpose(2, 3)):  # a non-contiguous one
            got = ab.attention(q, k, v, causal="bottom_right", attn_mask=mask, return_lse=True)
            assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1])


def test_a_window_without_causal_keeps_its_top_left_alignment(gen):
    # Sq != Sk: the decode kernel would align the window bottom-right; flash serves it, top-left
    q, k, v = (_bshd(1, S, 4, 16, F32, gen) for S in (2, 30, 30))
    with torch.no_grad():
        out = ab.attention(q, k, v, window=(2, 1))
    ref64, _ = reference_attention(q, k, v, window=(2, 1))
    same, _ = reference_attention(q, k, v, window=(2, 1), dtype=F32)
    check_2x("out", out, ref64, same, 2, F32)
    assert out[0, :, 0].abs().sum() > 0 and not torch.equal(out, _via_kvcache(q, k, v, False, {"window": (2, 1)})[0]
                                                            .transpose(1, 2))


@pytest.mark.parametrize("Sq", [5, 8])
def test_longer_queries_masks_and_gradients_stay_on_flash_and_right(Sq, gen):
    q, k, v = (_bshd(2, S, H, 16, F32, gen) for S, H in ((Sq, 4), (40, 2), (40, 2)))
    mask = torch.rand(2, 1, Sq, 40, generator=gen) > 0.3
    ref64, _ = reference_attention(q, k, v, causal="bottom_right")
    same, _ = reference_attention(q, k, v, causal="bottom_right", dtype=F32)
    with torch.no_grad():
        check_2x("out", ab.attention(q, k, v, causal="bottom_right"), ref64, same, 2, F32)
        m64, _ = reference_attention(q, k, v, attn_mask=mask)
        m32, _ = reference_attention(q, k, v, attn_mask=mask, dtype=F32)
        check_2x("masked out", ab.attention(q, k, v, attn_mask=mask), m64, m32, 2, F32)
    # one token with a gradient: the flash forward and backward (its row statistics kept)
    leaves = [t.detach().clone().requires_grad_() for t in (q[:, :, :1], k, v)]
    out = ab.attention(*leaves, causal="bottom_right")
    g = torch.randn(out.shape, generator=gen)
    check_out_and_grads_2x(out, torch.autograd.grad(out, leaves, g), leaves, g, F32, causal="bottom_right")


def test_the_route_covers_only_a_few_tokens(monkeypatch):
    """_C.flash_decode_route: the CPU flash forward's rule, which ours.py asks for the op's calls."""
    def route(Hq, Hkv, Sq, Sk, D=64, mask=False, p=0.0, causal=2, wl=-1, wr=-1, dtype=F32, Dv=None):
        q, k = torch.empty(1, Hq, Sq, D, dtype=dtype), torch.empty(1, Hkv, Sk, D, dtype=dtype)
        v = torch.empty(1, Hkv, Sk, Dv or D, dtype=dtype)
        return _C.flash_decode_route(q, k, v, mask, p, causal, wl, wr, None, None)

    assert route(16, 4, 8, 4096) == 8 and route(16, 4, 9, 4096) == 0  # groups of 4 or more: 8 tokens
    assert route(4, 4, 4, 64) == 4 and route(4, 4, 5, 64) == 0  # MHA: 4
    # MHA: 8 where the decode kernel measured faster (dense float32 over 2048 keys or more)
    assert route(4, 4, 8, 2048) == 8 and route(4, 4, 9, 2048) == 0 and route(4, 4, 5, 1024) == 0
    assert route(4, 4, 5, 4096, dtype=torch.bfloat16) == 0 and route(4, 2, 5, 4096) == 0  # a group of 2: 4
    assert route(4, 4, 1, 64, mask=True) == 1 and route(4, 4, 1, 64, p=0.1) == 0  # a mask rides along
    assert route(4, 4, 1, 64, Dv=32) == 0
    assert route(4, 4, 2, 64, causal=1) == 0 and route(4, 4, 2, 2, causal=1) == 2  # top-left: the same if square
    assert route(4, 4, 2, 64, causal=0, wl=8) == 0 and route(4, 4, 2, 64, causal=2, wl=8) == 2
    # transposed keys (last dim not contiguous) stay with flash
    q, k = torch.empty(1, 4, 1, 64), torch.empty(1, 4, 64, 64).transpose(2, 3)
    assert _C.flash_decode_route(q, k, k, False, 0.0, 2, -1, -1, None, None) == 0

    def packed(lens_q, lens_k, causal=2, Hq=4, Hkv=4, D=16, dtype=F32):
        cu = lambda lens: torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        q = torch.empty(sum(lens_q), Hq, D, dtype=dtype)
        k = torch.empty(sum(lens_k), Hkv, D, dtype=dtype)
        return _C.flash_decode_route(q, k, k, False, 0.0, causal, -1, -1, cu(lens_q), cu(lens_k))

    assert packed([2, 2], [10, 5]) == 2 and packed([1, 2], [10, 5]) == 0  # every sequence its Sq queries
    assert packed([2, 2], [2, 2], causal=1) == 2 and packed([2, 2], [2, 3], causal=1) == 0
    assert packed([1, 1, 1], [0, 7, 3]) == 1  # a sequence with no key
    lens = torch.tensor([0, 1, 2], dtype=torch.int32)
    assert _C.flash_decode_route(torch.empty(2, 4, 16), torch.empty(2, 4, 16), torch.empty(2, 4, 16), True, 0.0, 2,
                                 -1, -1, lens, lens) == 0  # packed calls take no mask
    # packed MHA: 8 tokens from 1024 keys (the longest sequence's), 2-byte dtypes from 256
    assert packed([8, 8], [1024, 5]) == 8 and packed([5, 5], [1023, 5]) == 0
    assert packed([8, 8], [256, 5], dtype=torch.bfloat16) == 8 and packed([5, 5], [255, 5], dtype=torch.float16) == 0
    monkeypatch.setenv("ATTN_BACKENDS_FLASH_DECODE", "0")  # the switch, read at every call
    assert route(16, 4, 8, 4096) == 0 and packed([2, 2], [10, 5]) == 0


VARLEN = [  # lens_k per sequence (every sequence has sq queries), Hq, Hkv, D
    ([5, 0, 17, 1], 4, 2, 16),  # a sequence with no key: its rows output 0 (lse -inf, or the sink)
    ([33, 8], 6, 6, 24),
    ([3], 8, 1, 40),
]


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("causal", [False, "bottom_right"])
@pytest.mark.parametrize("case", ["plain", "sinks+softcap", "alibi+window"])
@pytest.mark.parametrize("sq", [1, 3])
@pytest.mark.parametrize("packed", VARLEN)
def test_packed_short_queries_match_the_reference(packed, sq, case, causal, dtype, gen):
    lens_k, Hq, Hkv, D = packed
    if "window" in case:
        causal = "bottom_right"
    B = len(lens_k)
    q, k, v, cu_q, cu_k = make_packed([sq] * B, lens_k, Hq, Hkv, D, D, dtype, generator=gen)
    opts = _opts(case, gen, Hq, B)
    with torch.no_grad():
        out, lse = ab.attention_varlen(q, k, v, cu_q, cu_k, sq, max(lens_k), causal=causal, return_lse=True, **opts)
    ref64, lse64 = varlen_reference(q, k, v, cu_q, cu_k, causal=causal, **opts)
    same, _ = varlen_reference(q, k, v, cu_q, cu_k, dtype=dtype, causal=causal, **opts)
    check_2x("out", out, ref64, same, 2, dtype)
    check_2x("lse", lse, lse64, lse64.float(), 2, F32)
    # the decode kernel served it: the same bits as attention_with_kvcache over the packed keys
    w = opts.get("window")
    kv_out, kv_lse = ab.attention_with_kvcache(
        q.unflatten(0, (B, sq)), k[None], v[None], cache_seqlens=cu_k[1:], cache_leftpad=cu_k[:-1],
        cache_batch_idx=torch.zeros(B, dtype=torch.int32), causal=bool(causal), window_size=w if w else (-1, -1),
        softcap=opts.get("softcap", 0.0), alibi_slopes=opts.get("alibi_slopes"), sinks=opts.get("sinks"),
        return_softmax_lse=True)
    assert torch.equal(out, kv_out.flatten(0, 1)) and torch.equal(lse, kv_lse.transpose(0, 1).flatten(1))


@pytest.mark.parametrize("dtype, lens_k, sq", [(BF16, [300, 7], 8), (F32, [1030, 0], 5), (torch.float16, [256], 6)])
def test_packed_mha_takes_the_route_up_to_8_tokens_over_many_keys(dtype, lens_k, sq, gen):
    B, H, D = len(lens_k), 3, 24
    q, k, v, cu_q, cu_k = make_packed([sq] * B, lens_k, H, H, D, D, dtype, generator=gen)
    with torch.no_grad():
        out, lse = ab.attention_varlen(q, k, v, cu_q, cu_k, sq, max(lens_k), causal="bottom_right", return_lse=True)
    ref64, lse64 = varlen_reference(q, k, v, cu_q, cu_k, causal="bottom_right")
    same, _ = varlen_reference(q, k, v, cu_q, cu_k, dtype=dtype, causal="bottom_right")
    check_2x("out", out, ref64, same, 2, dtype)
    check_2x("lse", lse, lse64, lse64.float(), 2, F32)
    kv_out, kv_lse = ab.attention_with_kvcache(q.unflatten(0, (B, sq)), k[None], v[None], cache_seqlens=cu_k[1:],
                                               cache_leftpad=cu_k[:-1], cache_batch_idx=torch.zeros(B, dtype=torch.int32),
                                               causal=True, return_softmax_lse=True)
    assert torch.equal(out, kv_out.flatten(0, 1)) and torch.equal(lse, kv_lse.transpose(0, 1).flatten(1))


def test_dense_mha_float32_takes_the_route_up_to_8_tokens_over_2048_keys(gen):
    q, k, v = (_bshd(1, S, 2, 16, F32, gen) for S in (7, 2048, 2048))
    with torch.no_grad():
        out, lse = ab.attention(q, k, v, causal="bottom_right", return_lse=True)
    ref64, lse64 = reference_attention(q, k, v, causal="bottom_right")
    same, _ = reference_attention(q, k, v, causal="bottom_right", dtype=F32)
    check_2x("out", out, ref64, same, 2, F32)
    kv_out, kv_lse = _via_kvcache(q, k, v, "bottom_right", {})
    assert torch.equal(out, kv_out.transpose(1, 2)) and torch.equal(lse, kv_lse)


def test_packed_calls_the_route_leaves_to_flash_are_right(gen):
    # sequences of different query lengths, and a top-left causal that differs from bottom-right
    for lens_q, lens_k, causal in (([1, 2], [9, 4], "bottom_right"), ([2, 2], [9, 4], True)):
        q, k, v, cu_q, cu_k = make_packed(lens_q, lens_k, 4, 2, 16, 16, F32, generator=gen)
        with torch.no_grad():
            out = ab.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal)
        ref64, _ = varlen_reference(q, k, v, cu_q, cu_k, causal=causal)
        same, _ = varlen_reference(q, k, v, cu_q, cu_k, dtype=F32, causal=causal)
        check_2x("out", out, ref64, same, 2, F32)


def test_packed_short_queries_with_a_gradient_take_flash(gen):
    q, k, v, cu_q, cu_k = make_packed([1, 1], [9, 4], 4, 2, 16, 16, F32, generator=gen)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ab.attention_varlen(*leaves, cu_q, cu_k, 1, 9, causal="bottom_right")
    g = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad(out, leaves, g)
    l64 = [t.detach().double().requires_grad_() for t in leaves]
    r, _ = varlen_reference(*l64, cu_q, cu_k, causal="bottom_right")
    r_grads = torch.autograd.grad(r, l64, g.double())
    l32 = [t.detach().clone().requires_grad_() for t in leaves]
    s, _ = varlen_reference(*l32, cu_q, cu_k, dtype=F32, causal="bottom_right")
    s_grads = torch.autograd.grad(s, l32, g)
    check_2x("out", out, r, s, 2, F32)
    for name, a, b, c in zip(("dq", "dk", "dv"), grads, r_grads, s_grads):
        check_2x(name, a, b, c, 3, F32)
