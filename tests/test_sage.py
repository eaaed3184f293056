"""The CPU sage kernel (INT8 Q.K^T, SageAttention recipe; docs/sage.md) on every instruction-set
path this machine supports, against the float64 reference (DESIGN.md section 5, the sage rule):
cosine similarity >= 0.999 and relative L1 <= 0.02 on the output, over random inputs and inputs
with large per-channel outliers in K (which the smoothing absorbs), long sequences, odd shapes,
GQA, both causal alignments, windows, softcap, masks with fully masked rows (exactly 0, lse -inf),
non-contiguous views and packed sequences; lse close to the exact one; the caller's tensors left
untouched; and the planner's rules: sage is forward only and lossy, so a call needing a gradient
falls back to flash with one warning (strict raises), and auto never picks it."""

import dataclasses
import logging
import math

import pytest
import torch

import attn_backends as ab
from attn_backends import _C
from attn_backends._testing import Case, cpu_isas, make_inputs, make_packed, reference_attention, varlen_reference


COS_MIN = 0.999
REL_L1_MAX = 0.02
# lse = m + log(l) sees the int8 score error through a log-sum-exp: an average over the row's keys,
# well under the score error itself (measured: max 0.027, mean 0.0034 over the grid)
LSE_MAX_ABS = 0.1
LSE_MEAN_ABS = 0.01
# K channels *scaled* by 10 are outliers smoothing cannot remove (it subtracts the mean; a scale is
# not an offset).  The channel factors c = sqrt(amax) move half of that range into Q, which brings
# the multi-row cases within the rule (measured over 150 seeds: relative L1 <= 0.017), but the
# scores those channels dominate are sharper, and a single decode row (Sq = 1) then varies more from
# seed to seed: median 0.014, 99th percentile 0.035, max 0.040 over 150 seeds.  Those cases keep a
# measured bound; lse moves more too (max 0.064, mean 0.011 over the grid).
SCALED = dict(lse_mean=0.02)
SCALED_DECODE = dict(SCALED, rel_l1_max=0.05)


# One wrong row would vanish in the whole output's error: each row is held to its own bound too
# (measured worst over the grid, 5 seeds: 0.025 for random and offset K, 0.078 for scaled K).
ROW_REL_L1_MAX = 0.1


def sage_metrics(out: torch.Tensor, ref: torch.Tensor):
    """(cosine similarity, relative L1 = sum|out - ref| / sum|ref|) in float64."""
    o, r = out.detach().double().flatten(), ref.detach().double().flatten()
    assert not torch.isnan(o).any(), "NaN in the output"
    s = float(r.abs().max()) or 1.0  # cosine_similarity's eps would swamp tiny outputs: rescale first
    cos = float(torch.nn.functional.cosine_similarity(o / s, r / s, dim=0))
    rel_l1 = float((o - r).abs().sum() / r.abs().sum())
    return cos, rel_l1


def check_sage(out, lse, q, k, v, rel_l1_max=REL_L1_MAX, lse_max=LSE_MAX_ABS, lse_mean=LSE_MEAN_ABS, **opts):
    """The sage rule on out, and lse near the exact lse (same -inf rows)."""
    r_out, r_lse = reference_attention(q, k, v, dtype=torch.float64, **opts)
    assert out.shape == r_out.shape and out.dtype == q.dtype
    cos, rel_l1 = sage_metrics(out, r_out)
    assert cos >= COS_MIN and rel_l1 <= rel_l1_max, f"cos {cos:.6f}, rel L1 {rel_l1:.4f}"
    o, r = out.detach().double(), r_out.double()
    num, den = (o - r).abs().sum(-1), r.abs().sum(-1)
    rows = num[den > 0] / den[den > 0]
    assert rows.numel() == 0 or float(rows.max()) <= ROW_REL_L1_MAX, f"a row's rel L1 is {float(rows.max()):.4f}"
    dead = torch.isinf(r_lse)
    assert torch.equal(torch.isinf(lse), dead) and bool((lse[dead] < 0).all())
    assert bool((out.double()[dead] == 0).all()), "a fully masked row is not exactly 0"
    err = (lse.double() - r_lse)[~dead].abs()
    if err.numel():
        assert float(err.max()) <= lse_max and float(err.mean()) <= lse_mean, \
            f"lse error max {float(err.max()):.3g}, mean {float(err.mean()):.3g}"
    return cos, rel_l1


def with_outliers(k: torch.Tensor, gen, kind: str) -> torch.Tensor:
    """K with a few channels made huge: offset by +20 (what smoothing removes) or scaled by 10."""
    chans = torch.randperm(k.shape[-1], generator=gen)[:3]
    k = k.clone()
    if kind == "offset":
        k[..., chans] += 20.0
    elif kind == "scale":
        k[..., chans] *= 10.0
    return k


def check_packed_equals_dense(out, q, k, v, cu_q, cu_k, **opts):
    """Each packed sequence is smoothed and quantized on its own: sage's packed output for it is a
    dense sage call on that sequence alone (CPU and CUDA tests alike)."""
    for b in range(len(cu_q) - 1):
        sq, sk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if sq.stop == sq.start:
            continue
        dense = ab.attention(q[sq].transpose(0, 1)[None], k[sk].transpose(0, 1)[None], v[sk].transpose(0, 1)[None],
                             backend="sage", strict=True, **opts)
        torch.testing.assert_close(out[sq], dense[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


def run_sage(q, k, v, mask, case, **kw):
    return ab.attention(q, k, v, backend="sage", causal=case.causal, attn_mask=mask, window=case.window,
                        softcap=case.softcap, return_lse=True, strict=True, **kw)


GRID = [
    Case(B=2, Hq=4, Hkv=4, Sq=17, Sk=23, D=40),
    Case(B=1, Hq=1, Hkv=1, Sq=1, Sk=300, D=128),  # decode-like: one query row
    Case(B=1, Hq=3, Hkv=1, Sq=257, Sk=129, D=96, causal=True),  # MQA
    Case(B=2, Hq=4, Hkv=2, Sq=70, Sk=200, D=256, Dv=64, causal="bottom_right"),  # GQA, Dv != D
    Case(B=1, Hq=2, Hkv=2, Sq=130, Sk=130, D=128, mask="bool_rows"),
    Case(B=2, Hq=2, Hkv=1, Sq=65, Sk=90, D=64, mask="float_rows", causal=True),
    Case(B=1, Hq=2, Hkv=2, Sq=96, Sk=96, D=64, window=(7, 3), causal="bottom_right"),
    Case(B=1, Hq=2, Hkv=2, Sq=64, Sk=80, D=64, softcap=5.0, mask="key_padding"),
    Case(B=1, Hq=2, Hkv=1, Sq=33, Sk=65, D=96, layout="bshd"),
    Case(B=1, Hq=2, Hkv=2, Sq=40, Sk=50, D=40, layout="strided_d", causal=True),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("outliers", ["none", "offset", "scale"])
@pytest.mark.parametrize("case", GRID, ids=str)
def test_sage_matches_reference(isa, case, outliers, gen):
    # every case in float32; the half types on a rotating third, so each appears on every path
    dtype = DTYPES[(GRID.index(case) + ["none", "offset", "scale"].index(outliers)) % 3]
    case = dataclasses.replace(case, dtype=dtype)
    q, k, v, mask = make_inputs(case, generator=gen)
    k = with_outliers(k, gen, outliers)
    out, lse = run_sage(q, k, v, mask, case)
    check_sage(out, lse, q, k, v, causal=case.causal, attn_mask=mask, window=case.window, softcap=case.softcap,
               **({} if outliers != "scale" else SCALED_DECODE if case.Sq == 1 else SCALED))


def test_smoothing_absorbs_a_shared_offset_in_k(gen):
    # +20 on every channel of K changes no softmax weight (a per-row constant): sage's output barely
    # moves, because the offset never reaches the int8 grid
    q, k, v = (torch.randn(1, 2, 64, 64, generator=gen) for _ in range(3))
    base = ab.attention(q, k, v, backend="sage", strict=True)
    shifted, lse = ab.attention(q, k + 20.0, v, backend="sage", strict=True, return_lse=True)
    cos, rel_l1 = sage_metrics(shifted, base)
    assert cos > 0.99999 and rel_l1 < 2e-3
    check_sage(shifted, lse, q, k + 20.0, v)


def test_long_sequence_with_outliers(isa, gen):
    q = torch.randn(1, 2, 64, 64, generator=gen)
    k = with_outliers(torch.randn(1, 1, 4096, 64, generator=gen), gen, "offset")
    v = torch.randn(1, 1, 4096, 64, generator=gen)
    out, lse = ab.attention(q, k, v, backend="sage", return_lse=True, strict=True)
    check_sage(out, lse, q, k, v)
    out, lse = ab.attention(q, k, v, backend="sage", causal="bottom_right", return_lse=True, strict=True)
    check_sage(out, lse, q, k, v, causal="bottom_right")


def test_pv_fixed_point_keeps_outlier_values_and_small_weights(isa, gen):
    # P.V runs in int16 with scales per key block: a V channel with a few huge values only coarsens
    # its own block, and an attention sink (one key far above the rest) does not round the other
    # keys' small weights to zero, because each block's P is scaled by its own largest weight
    q, k = (torch.randn(1, 2, 48, 64, generator=gen) for _ in range(2))
    k = torch.randn(1, 2, 3000, 64, generator=gen)
    v = torch.randn(1, 2, 3000, 64, generator=gen)
    v[:, :, torch.randperm(3000, generator=gen)[:5], 7] = 300.0
    sink = torch.zeros(1, 1, 48, 3000)
    sink[..., 0] = 12.0
    out, lse = ab.attention(q, k, v, backend="sage", attn_mask=sink, return_lse=True, strict=True)
    check_sage(out, lse, q, k, v, attn_mask=sink)
    # the weights the sink leaves the other keys (about e^-12 relative each, 3000 of them) still
    # reach the output: without them it would be within 2e-3 of v[0]
    assert float((out - v[:, :, :1]).abs().max()) > 0.01


def test_nan_in_v_stays_in_its_channel(gen):
    q, k, v = (torch.randn(1, 1, 8, 16, generator=gen) for _ in range(3))
    v[0, 0, 5, 3] = math.nan
    out = ab.attention(q, k, v, backend="sage", strict=True)
    ref, _ = reference_attention(q, k, v, dtype=torch.float64)
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert bool(torch.isnan(out[..., 3]).all())


def test_key_blocks_that_start_before_the_first_visible_key(isa, gen):
    # a window past the first block: the key blocks start on V's 64-key grid, before the row's
    # first visible key (masked like any other); with GQA and Dv = 40 (not a whole vector)
    case = Case(B=1, Hq=4, Hkv=2, Sq=300, Sk=300, D=64, Dv=40, causal=True, window=(100, 0))
    q, k, v, _ = make_inputs(case, generator=gen)
    out, lse = run_sage(q, k, v, None, case)
    check_sage(out, lse, q, k, v, causal=True, window=(100, 0))


def test_fixed_point_sums_at_their_largest(isa):
    # q = 0: every weight is 1, so P is 4096 for all 64 keys of each block, and V's channels at
    # +-8191 after quantization: each block's sum is 64 * 4096 * 8191, just under 2^31
    q = torch.zeros(1, 1, 4, 32)
    k = torch.randn(1, 1, 200, 32)
    v = torch.ones(1, 1, 200, 32)
    v[..., 1::2] = -1.0
    out = ab.attention(q, k, v, backend="sage", strict=True)
    assert torch.equal(out, v[:, :, :4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_values_are_quantized_not_lost(isa, dtype, gen):
    # 8191 / amax overflows float32 when V's magnitudes are below about 2e-35: they are scaled up
    # by 2^64 first.  Q rows that small likewise (their scores are then all ~0: uniform weights).
    q, k, v = (torch.randn(1, 2, 8, 32, generator=gen).to(dtype) for _ in range(3))
    k = torch.randn(1, 2, 100, 32, generator=gen).to(dtype)
    v = (torch.randn(1, 2, 100, 32, generator=gen) * 1e-36).to(dtype)
    for qq in (q, (q.float() * 1e-37).to(dtype)):
        out, lse = ab.attention(qq, k, v, backend="sage", return_lse=True, strict=True)
        check_sage(out, lse, qq, k, v)


def test_nan_in_v_stays_in_its_channel_and_block(gen):
    # causal, NaN in V at key 100 of channel 3: rows that read none of key 100's block (64..127) stay
    # finite, and no other channel is touched (exact attention makes the channel NaN in every row)
    q, k, v = (torch.randn(1, 1, 200, 16, generator=gen) for _ in range(3))
    v[0, 0, 100, 3] = math.nan
    out = ab.attention(q, k, v, backend="sage", causal=True, strict=True)
    nan = torch.isnan(out[0, 0])
    assert not bool(nan[:64].any()) and bool(nan[100:, 3].all())
    assert not bool(nan[:, [c for c in range(16) if c != 3]].any())


def test_sage_path_follows_the_cpu_path(isa):
    f = _C.cpu_features()
    avx512 = "avx512_vnni" if f["avx512_vnni"] else "avx2"
    want = {"generic": "generic", "avx2": "avx2", "avx512": avx512, "amx": "amx_int8" if f["amx_int8"] else avx512,
            "amx_emu": "amx_emu"}[isa]
    assert _C.sage_cpu_isa() == want


def test_isa_paths_compute_the_same_integer_products(gen):
    # every path sums the same int8 products in int32: outputs differ only by float rounding (and the
    # odd Q value rounded the other way), far below the quantization error itself.  The AMX tile
    # paths run P.V in bfloat16 rather than int16 fixed point: their outputs differ by that rounding
    # (still 100x below the quantization error), their lse (the scores alone) by float rounding.
    case = Case(B=1, Hq=4, Hkv=2, Sq=100, Sk=150, D=96, causal=True)
    q, k, v, _ = make_inputs(case, generator=gen)
    before = _C.cpu_isa()
    outs = {}
    try:
        for isa in cpu_isas():
            assert _C.set_cpu_isa(isa)
            outs[isa] = ab.attention(q, k, v, backend="sage", causal=True, return_lse=True, strict=True)
    finally:
        _C.set_cpu_isa(before)
    out0, lse0 = outs.pop("generic")
    for isa, (o, lse) in outs.items():
        tiles = isa.startswith("amx")
        assert sage_metrics(o, out0)[0] > (0.99999 if tiles else 0.999999), isa
        assert float((lse - lse0).abs().max()) < 1e-5, isa


def test_inputs_are_not_modified(isa, gen):
    case = Case(B=2, Hq=4, Hkv=2, Sq=33, Sk=47, D=64, dtype=torch.bfloat16, layout="bshd", mask="float")
    q, k, v, mask = make_inputs(case, generator=gen)
    k = with_outliers(k, gen, "offset")
    saved = [t.clone() for t in (q, k, v, mask)]
    run_sage(q, k, v, mask, case)
    for a, b in zip((q, k, v, mask), saved):
        assert torch.equal(a, b)


def test_fully_masked_rows_and_empty_shapes(isa, gen):
    q, k, v = (torch.randn(1, 2, 20, 32, generator=gen) for _ in range(3))
    mask = torch.rand(1, 1, 20, 20, generator=gen) > 0.5
    mask[:, :, 3] = False
    mask[:, :, 11] = False
    out, lse = ab.attention(q, k, v, backend="sage", attn_mask=mask, return_lse=True, strict=True)
    assert torch.equal(out[:, :, [3, 11]], torch.zeros(1, 2, 2, 32))
    assert bool(torch.isneginf(lse[:, :, [3, 11]]).all())
    check_sage(out, lse, q, k, v, attn_mask=mask)
    # a window that leaves the first rows of a bottom-right call with no key at all
    qs = torch.randn(1, 2, 30, 32, generator=gen)
    out, lse = ab.attention(qs, k, v, backend="sage", causal="bottom_right", return_lse=True, strict=True)
    assert torch.equal(out[:, :, :10], torch.zeros(1, 2, 10, 32)) and bool(torch.isneginf(lse[:, :, :10]).all())
    # Sk = 0: zeros and lse -inf; B, H or Sq = 0: empty results
    out, lse = ab.attention(q, k[:, :, :0], v[:, :, :0], backend="sage", return_lse=True, strict=True)
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())
    for qq, kk, vv in ((q[:0], k[:0], v[:0]), (q[:, :, :0], k, v)):
        out, lse = ab.attention(qq, kk, vv, backend="sage", return_lse=True, strict=True)
        assert out.numel() == 0 and out.shape == qq.shape and lse.shape == qq.shape[:3]


def test_nan_in_nan_out(gen):
    q, k, v = (torch.randn(1, 1, 8, 16, generator=gen) for _ in range(3))
    q[0, 0, 2, 5] = math.nan
    out = ab.attention(q, k, v, backend="sage", strict=True)
    assert bool(torch.isnan(out[0, 0, 2]).all()) and not bool(torch.isnan(out[0, 0, 3:]).any())


VARLEN = [
    dict(lens_q=[5, 17, 1, 33], lens_k=[5, 17, 1, 33], causal=True),
    dict(lens_q=[3, 40, 0, 7], lens_k=[9, 140, 4, 70], causal="bottom_right"),
    dict(lens_q=[64, 65, 2], lens_k=[64, 1, 100], causal=False, window=(4, 2), softcap=3.0),
    # a window past the first key block, D = 256 and Dv = 40 (not a whole vector on any path)
    dict(lens_q=[70, 1, 130], lens_k=[100, 37, 130], causal="bottom_right", window=(70, 3), shape=(6, 2, 256, 40)),
]


@pytest.mark.parametrize("spec", VARLEN, ids=lambda s: f"{s['lens_q']}x{s['lens_k']}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_matches_reference_and_dense_sage(isa, spec, dtype, gen):
    spec = dict(spec)
    lens_q, lens_k = spec.pop("lens_q"), spec.pop("lens_k")
    Hq, Hkv, D, Dv = spec.pop("shape", (4, 2, 64, 48))
    q, k, v, cu_q, cu_k = make_packed(lens_q, lens_k, Hq, Hkv, D, Dv, dtype, generator=gen)
    k = with_outliers(k, gen, "offset")
    out, lse = ab.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), backend="sage",
                                   return_lse=True, strict=True, **spec)
    r_out, r_lse = varlen_reference(q, k, v, cu_q, cu_k, **spec)
    cos, rel_l1 = sage_metrics(out, r_out)
    assert cos >= COS_MIN and rel_l1 <= REL_L1_MAX, f"cos {cos:.6f}, rel L1 {rel_l1:.4f}"
    live = ~torch.isinf(r_lse)
    assert torch.equal(torch.isinf(lse), ~live)
    assert float((lse.double() - r_lse)[live].abs().max()) <= LSE_MAX_ABS
    check_packed_equals_dense(out, q, k, v, cu_q, cu_k, **spec)


def test_sage_results_do_not_depend_on_thread_count(gen):
    q, k, v, _ = make_inputs(Case(B=2, Hq=8, Hkv=2, Sq=200, Sk=150, D=64), generator=gen)
    n = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, max(2, n)):
            torch.set_num_threads(threads)
            outs.append(ab.attention(q, k, v, causal=True, backend="sage", strict=True))
    finally:
        torch.set_num_threads(n)
    assert torch.equal(outs[0], outs[1])


def test_op_passes_opcheck(gen):
    q, k, v = torch.randn(1, 2, 9, 16, generator=gen), torch.randn(1, 1, 13, 16, generator=gen), \
        torch.randn(1, 1, 13, 8, generator=gen)
    torch.library.opcheck(torch.ops.attn_backends.sage_fwd.default,
                          (q, k, v, None, None, 2, 0.25, -1, -1, 0.0, 0.0),
                          test_utils=("test_schema", "test_faketensor"))


def test_direct_op_calls_are_checked(gen):
    from attn_backends import _providers

    q, k, v = (torch.randn(1, 2, 9, 16, generator=gen) for _ in range(3))
    op = torch.ops.attn_backends.sage_fwd.default
    with pytest.raises(RuntimeError, match="inference only: no dropout"):
        op(q, k, v, None, _providers.draw_rng_state(), 0, 0.25, -1, -1, 0.0, 0.1)
    with pytest.raises(RuntimeError, match="k has size 8 in dim 3"):
        op(q, k[..., :8], v, None, None, 0, 0.25, -1, -1, 0.0, 0.0)
    with pytest.raises(RuntimeError, match="float16, bfloat16 or float32"):
        op(q.double(), k.double(), v.double(), None, None, 0, 0.25, -1, -1, 0.0, 0.0)


# ---- the planner ----------------------------------------------------------------------------------

def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_named_sage_serves_inference_and_explain_shows_it():
    q = torch.randn(1, 2, 8, 16)
    p = ab.explain(q, q, q, backend="sage", causal=True, softcap=2.0, return_lse=True)
    assert p.chosen == "sage" and p.path.startswith("cpu ")
    for alias in ("sageattention", "sage_varlen", "_sage_qk_int8_pv_fp16_cuda"):
        assert ab.explain(q, q, q, backend=alias).chosen == "sage"
    assert "sage" in str(p)


def test_call_needing_a_gradient_falls_back_to_flash_with_one_warning(caplog, gen):
    ab._dispatch.reset_caches()
    caplog.set_level(logging.INFO, logger="attn_backends")
    q = torch.randn(1, 2, 8, 16, generator=gen, requires_grad=True)
    k, v = torch.randn(1, 2, 8, 16, generator=gen), torch.randn(1, 2, 8, 16, generator=gen)
    p = ab.explain(q, k, v, backend="sage")
    assert p.chosen == "flash" and p.reasons["sage"] == "forward only, and this call needs a gradient"
    for _ in range(2):
        out = ab.attention(q, k, v, backend="sage")
    (dq,) = torch.autograd.grad(out.sum(), q)  # flash served it, so there is a gradient
    assert dq.shape == q.shape
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "'sage'" in warnings[0] and "'flash'" in warnings[0] and "forward only" in warnings[0]
    with pytest.raises(RuntimeError, match="forward only"):
        ab.attention(q, k, v, backend="sage", strict=True)
    with torch.no_grad():  # the same tensors in inference: sage serves
        assert ab.explain(q, k, v, backend="sage").chosen == "sage"
        ab.attention(q, k, v, backend="sage", strict=True)


def test_unsupported_calls_fall_back_or_raise(gen):
    q = torch.randn(1, 2, 8, 16, dtype=torch.float64)
    p = ab.explain(q, q, q, backend="sage")
    assert p.chosen != "sage" and "no float64 support" in p.reasons["sage"]
    with pytest.raises(RuntimeError, match="no float64 support"):
        ab.attention(q, q, q, backend="sage", strict=True)
    q = torch.randn(1, 2, 8, 16)
    p = ab.explain(q, q, q, backend="sage", dropout_p=0.1)
    assert p.chosen == "flash" and p.reasons["sage"] == "no dropout"


def test_auto_never_picks_sage():
    q = torch.randn(1, 2, 8, 16)
    for kw in (dict(), dict(causal=True), dict(return_lse=True), dict(softcap=1.0)):
        p = ab.explain(q, q, q, **kw)
        assert p.chosen == "flash" and "lossy" in p.reasons["sage"]
    with ab.use("sage"):  # a context default is a named backend, not auto
        assert ab.explain(q, q, q).chosen == "sage"
    row = {r.name: r for r in ab.backends()}["sage"]
    assert row.available and row.lossy and not row.supports_backward and "cpu" in row.devices


def test_varlen_needing_a_gradient_falls_back_to_flash_varlen(gen):
    q, k, v, cu_q, cu_k = make_packed([5, 9], [7, 9], 2, 2, 16, 16, torch.float32, generator=gen)
    q.requires_grad_(True)
    with pytest.raises(RuntimeError, match="forward only"):
        ab.attention_varlen(q, k, v, cu_q, cu_k, 9, 9, backend="sage", strict=True)
    out = ab.attention_varlen(q, k, v, cu_q, cu_k, 9, 9, backend="sage")
    assert out.requires_grad
