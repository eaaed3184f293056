"""The CPU flash kernel on every instruction-set path this machine supports (generic C, AVX2,
AVX-512), against the float64 reference (DESIGN.md section 5): output, lse and gradients over the
shared grid; dropout drawing the same stream as math; packed (varlen) calls equal to padded dense
ones; bad cu_seqlens rejected; results independent of the thread count."""

import dataclasses
import math

import pytest
import torch

import attn_backends as ab
from attn_backends import _providers
from attn_backends._testing import (EMULATED_ISAS, Case, cases, check_2x, check_against_reference, check_out_and_grads_2x,
                                   cpu_isas, make_packed, reference_attention, varlen_reference)



def run_flash(q, k, v, mask, case):
    return ab.attention(q, k, v, backend="flash", causal=case.causal, attn_mask=mask, window=case.window,
                        softcap=case.softcap, return_lse=True, strict=True)


FLASH_CASES = [c for c in cases() if c.dtype != torch.float64]
# The emulated tile path (slow) gets the grid's 16-bit cases, one per (shape, variant): every mask,
# alignment, window, softcap, GQA and layout on tiles; and one float32 case, which it hands to the
# vector kernel (the generic path runs the rest of them).
EMULATED_CASES = [c for c in FLASH_CASES if c.dtype != torch.float32] + [
    next(c for c in FLASH_CASES if c.dtype == torch.float32 and c.Hq != c.Hkv)]


def isa_params(full, emulated):
    """(isa, *item) for the `isa` fixture: the full list on the vector and real tile paths, the
    reduced one on the emulated paths (an item is a case or a tuple of parameters)."""
    return [(isa, *(c if isinstance(c, tuple) else (c,))) for isa in cpu_isas()
            for c in (emulated if isa in EMULATED_ISAS else full)]


@pytest.mark.parametrize("isa, case", isa_params(FLASH_CASES, EMULATED_CASES), ids=str, indirect=["isa"])
def test_flash_matches_reference(isa, case, gen):
    check_against_reference(case, run_flash, grad=True, generator=gen)


# Rows that see a single key have softmax exactly 1 and an exact dq of 0.  Flash, as
# FlashAttention-2, takes delta = rowsum(dO * O) from the stored output instead of summing
# P * dP, so in float32 it leaves a residue of a few 1e-6 there, where the float32 reference
# (which sums P * dP) cancels exactly.  Those cases get a float32 gradient floor of 1e-5.
SINGLE_KEY_FLOOR = 1e-5


EDGE_CASES = [
    (Case(B=1, Hq=2, Hkv=2, Sq=1, Sk=300, D=64), None),  # decode-like: one query row
    (Case(B=1, Hq=4, Hkv=1, Sq=97, Sk=1, D=32, causal="bottom_right"), SINGLE_KEY_FLOOR),
    (Case(B=2, Hq=2, Hkv=2, Sq=129, Sk=129, D=8, Dv=72, causal=True, mask="bool_rows"), SINGLE_KEY_FLOOR),
    (Case(B=1, Hq=2, Hkv=1, Sq=70, Sk=200, D=256, window=(1, 0)), SINGLE_KEY_FLOOR),
    (Case(B=1, Hq=1, Hkv=1, Sq=65, Sk=65, D=40, dtype=torch.bfloat16, softcap=2.0, causal=True,
          layout="strided_d"), None),
]
# on the emulated tiles, the same shapes in bfloat16 (float32 would run the vector kernel)
EDGE_EMULATED = [(dataclasses.replace(c, dtype=torch.bfloat16), None) for c, _ in EDGE_CASES]


@pytest.mark.parametrize("isa, case, grad_floor", isa_params(EDGE_CASES, EDGE_EMULATED),
                         ids=lambda x: str(x) if isinstance(x, (Case, str)) else "", indirect=["isa"])
def test_flash_edge_shapes(isa, case, grad_floor, gen):
    check_against_reference(case, run_flash, grad=True, generator=gen,
                            grad_floor=grad_floor if case.dtype == torch.float32 else None)


def test_single_visible_key_gives_that_value_and_near_zero_dq(isa, gen):
    # window (0, 0): each row sees one key, softmax is exactly 1, the exact dq is 0; flash leaves
    # the float32 residue described at SINGLE_KEY_FLOOR.
    q = torch.randn(1, 2, 70, 256, generator=gen, requires_grad=True)
    k = torch.randn(1, 2, 200, 256, generator=gen)
    v = torch.randn(1, 2, 200, 256, generator=gen)
    out = ab.attention(q, k, v, window=(0, 0), backend="flash", strict=True)
    torch.testing.assert_close(out, v[:, :, :70], rtol=0, atol=1e-6)
    (dq,) = torch.autograd.grad(out, q, torch.randn(out.shape, generator=gen))
    assert dq.abs().max() < 1e-5


def test_flash_and_math_draw_the_same_dropout(isa, gen):
    case = Case(B=2, Hq=4, Hkv=2, Sq=70, Sk=45, D=32, causal="bottom_right", mask="float_rows")
    q, k, v, mask = [t for t in _inputs(case, gen)]
    outs, grads = [], []
    for backend in ("flash", "math"):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        torch.manual_seed(5)
        out = ab.attention(qq, kk, vv, backend=backend, causal=case.causal, attn_mask=mask, dropout_p=0.3, strict=True)
        outs.append(out)
        grads.append(torch.autograd.grad(out.square().sum(), (qq, kk, vv)))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def _inputs(case, gen):
    from attn_backends._testing import make_inputs

    return make_inputs(case, generator=gen)


@pytest.mark.parametrize("keys", ["strided", "contiguous"])
@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.bool])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masks_of_any_dtype_and_stride_match_the_reference(isa, mask_dtype, dtype, keys, gen):
    # the mask is read row by row with one loop per mask dtype (cpu_tiles_impl.h mask_scores): a mask of
    # another dtype than q, and one whose keys are not contiguous (a transposed view), forward and backward.
    # Contiguous keys: AVX2 reads a float32 mask in place, eight keys of eight rows at a time, and the last
    # keys of a block (150 = 2 x 64 + 22, 22 = 2 x 8 + 6) and the rows past a chunk's end one by one
    B, Hq, Hkv, Sq, D = 2, 4, 2, 37, 32
    Sk = 45 if keys == "strided" else 150
    q, k, v = (torch.randn(B, h, s, D, generator=gen).to(dtype) for h, s in ((Hq, Sq), (Hkv, Sk), (Hkv, Sk)))
    seen = torch.rand(B, Hq, Sk, Sq, generator=gen) > 0.3
    seen[0, :, :, 3] = False  # query row 3 of batch row 0 sees nothing
    mask = seen if mask_dtype == torch.bool else torch.randn(B, Hq, Sk, Sq, generator=gen).masked_fill(~seen,
                                                                                                      -torch.inf)
    mask = mask.to(mask_dtype).transpose(2, 3)  # (B, Hq, Sq, Sk), keys strided
    if keys == "contiguous":
        mask = mask.contiguous()
    assert (mask.stride(-1) == 1) == (keys == "contiguous")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ab.attention(*leaves, attn_mask=mask, backend="flash", strict=True)
    g = torch.randn(out.shape, generator=gen).to(dtype)
    check_out_and_grads_2x(out, torch.autograd.grad(out, leaves, g), leaves, g, dtype, attn_mask=mask)


def test_flash_does_not_serve_float64():
    q = torch.randn(1, 1, 4, 8, dtype=torch.float64)
    p = ab.explain(q, q, q, backend="flash")
    assert p.chosen == "math" and "no float64 support" in p.reasons["flash"]
    with pytest.raises(RuntimeError, match="no float64 support"):
        ab.attention(q, q, q, backend="flash", strict=True)


def test_auto_uses_flash_on_cpu():
    q = torch.randn(1, 2, 8, 16)
    assert ab.explain(q, q, q).chosen == "flash"
    assert ab.explain(q, q, q, attn_mask=torch.randn(8, 8), causal=True, softcap=3.0, dropout_p=0.1).chosen == "flash"


def test_flash_results_do_not_depend_on_thread_count(isa):
    case = Case(B=2, Hq=8, Hkv=2, Sq=200, Sk=150, D=64, causal=True)
    from attn_backends._testing import make_inputs

    q, k, v, _ = make_inputs(case, requires_grad=True)
    results = []
    n = torch.get_num_threads()
    try:
        for threads in (1, max(2, n)):
            torch.set_num_threads(threads)
            out = ab.attention(q, k, v, causal=True, backend="flash")
            results.append((out.detach(), *torch.autograd.grad(out.square().sum(), (q, k, v))))
    finally:
        torch.set_num_threads(n)
    for a, b in zip(*results):
        assert torch.equal(a, b)


# Strided key rows (a projection's (B, S, H, D) seen as (B, H, S, D), packed (T, H, D) rows): the forward
# copies a head's rows once where several row chunks or query heads read them, else prefetches them
# (flash_fwd_impl.h, kv_rows); either way the bits are those of the same values in contiguous rows.
STRIDED = [
    # several row chunks, GQA, a window that slides the rows a chunk reads, D and Dv with tails
    dict(dtype=torch.float32, B=2, Hq=6, Hkv=2, Sq=70, Sk=100, D=40, Dv=24, causal="bottom_right", window=(9, 3)),
    dict(dtype=torch.bfloat16, B=2, Hq=6, Hkv=2, Sq=70, Sk=100, D=40, Dv=24, causal=True, softcap=5.0),
    dict(dtype=torch.float16, B=1, Hq=4, Hkv=4, Sq=100, Sk=130, D=64, Dv=64),
    # one row chunk per head (MHA): read in place, with prefetches
    dict(dtype=torch.float32, B=2, Hq=3, Hkv=3, Sq=5, Sk=300, D=32, Dv=32, causal="bottom_right"),
    # more rows than a thread copies (KV_ROWS_BYTES): read in place, with prefetches
    dict(dtype=torch.float32, B=1, Hq=2, Hkv=2, Sq=40, Sk=16500, D=64, Dv=64, causal="bottom_right"),
]


@pytest.mark.parametrize("spec", STRIDED, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_strided_key_rows_give_contiguous_rows_bits(isa, spec, gen, monkeypatch):
    monkeypatch.setenv("ATTN_BACKENDS_FLASH_DECODE", "0")  # the flash kernel, whatever the query length
    spec = dict(spec)
    dtype, B, Hq, Hkv, Sq, Sk, D, Dv = (spec.pop(n) for n in ("dtype", "B", "Hq", "Hkv", "Sq", "Sk", "D", "Dv"))

    def bshd(S, H, d):  # (B, H, S, d) views of (B, S, H, d) storage: rows H * d elements apart
        return torch.randn(B, S, H, d, generator=gen).to(dtype).transpose(1, 2)

    q, k, v = bshd(Sq, Hq, D), bshd(Sk, Hkv, D), bshd(Sk, Hkv, Dv)
    n = torch.get_num_threads()
    try:
        for threads in (1, max(2, n)):  # with two, a thread's range can start inside a head
            torch.set_num_threads(threads)
            strided = ab.attention(q, k, v, backend="flash", return_lse=True, strict=True, **spec)
            dense = ab.attention(q.contiguous(), k.contiguous(), v.contiguous(), backend="flash", return_lse=True,
                                 strict=True, **spec)
            assert torch.equal(strided[0], dense[0]) and torch.equal(strided[1], dense[1])
    finally:
        torch.set_num_threads(n)


def test_packed_rows_give_each_sequences_dense_bits(isa, gen, monkeypatch):
    monkeypatch.setenv("ATTN_BACKENDS_FLASH_DECODE", "0")
    lens_q, lens_k = [40, 3, 70], [50, 9, 70]
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, cu_q, cu_k = make_packed(lens_q, lens_k, 6, 2, 40, 24, dtype, gen)
        out = ab.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal="bottom_right",
                                  backend="flash_varlen", strict=True)
        for b in range(len(lens_q)):
            rows_q, rows_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            one = [t[rows].transpose(0, 1)[None].contiguous() for t, rows in ((q, rows_q), (k, rows_k), (v, rows_k))]
            dense = ab.attention(*one, causal="bottom_right", backend="flash", strict=True)
            assert torch.equal(out[rows_q], dense[0].transpose(0, 1))


# ---- packed (varlen) sequences ------------------------------------------------------------------

VARLEN = [
    dict(lens_q=[5, 17, 1, 33], lens_k=[5, 17, 1, 33], causal=True),
    dict(lens_q=[3, 40, 7], lens_k=[9, 40, 70], causal="bottom_right"),
    dict(lens_q=[64, 65, 0, 2], lens_k=[64, 1, 3, 100], causal=False, window=(4, 2)),
    dict(lens_q=[31, 12], lens_k=[31, 20], causal="bottom_right", window=(3, 0), softcap=3.0),
]


@pytest.mark.parametrize("spec", VARLEN, ids=lambda s: f"{s['lens_q']}x{s['lens_k']}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_matches_per_sequence_reference(isa, spec, dtype, gen):
    spec = dict(spec)
    lens_q, lens_k = spec.pop("lens_q"), spec.pop("lens_k")
    q, k, v, cu_q, cu_k = make_packed(lens_q, lens_k, 4, 2, 24, 16, dtype, gen)
    for t in (q, k, v):
        t.requires_grad_(True)
    out, lse = ab.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), backend="flash_varlen",
                                   return_lse=True, strict=True, **spec)
    assert out.shape == (sum(lens_q), 4, 16) and lse.shape == (4, sum(lens_q))
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    r_out, r_lse = varlen_reference(*leaves64, cu_q, cu_k, **spec)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    d_out, d_lse = varlen_reference(*leaves, cu_q, cu_k, dtype=dtype, **spec)
    check_2x("out", out, r_out, d_out, 2, dtype)
    check_2x("lse", lse, r_lse, d_lse, 2, dtype)
    g = torch.randn(out.shape, generator=gen).to(dtype)
    for name, a, r, s in zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), g),
                             torch.autograd.grad(r_out, leaves64, g.double()), torch.autograd.grad(d_out, leaves, g)):
        check_2x(name, a, r, s, 3, dtype)


@pytest.mark.parametrize("backend", ["flash_varlen", "math", "eager"])
def test_varlen_equals_padded_dense_including_dropout(backend, gen):
    lens_q, lens_k = [7, 19, 3], [11, 19, 25]
    q, k, v, cu_q, cu_k = make_packed(lens_q, lens_k, 2, 1, 16, 16, torch.float32, gen)
    B, Sq, Sk = 3, max(lens_q), max(lens_k)
    torch.manual_seed(3)
    out = ab.attention_varlen(q, k, v, cu_q, cu_k, Sq, Sk, causal="bottom_right", dropout_p=0.25 if backend != "eager" else 0.0,
                              backend=backend, strict=True)
    # the padded dense call: each sequence in its own batch row, a mask per sequence (bottom-right
    # causal is per sequence, so it goes in the mask), the same seed
    qd, kd, vd = (torch.zeros(B, 2 if t is q else 1, S, 16) for t, S in ((q, Sq), (k, Sk), (v, Sk)))
    mask = torch.zeros(B, 1, Sq, Sk, dtype=torch.bool)
    for b in range(B):
        qd[b, :, :lens_q[b]] = q[cu_q[b]:cu_q[b + 1]].transpose(0, 1)
        kd[b, :, :lens_k[b]] = k[cu_k[b]:cu_k[b + 1]].transpose(0, 1)
        vd[b, :, :lens_k[b]] = v[cu_k[b]:cu_k[b + 1]].transpose(0, 1)
        i = torch.arange(lens_q[b])[:, None]
        j = torch.arange(lens_k[b])[None, :]
        mask[b, 0, :lens_q[b], :lens_k[b]] = j <= i + lens_k[b] - lens_q[b]
    torch.manual_seed(3)
    dense = ab.attention(qd, kd, vd, attn_mask=mask, dropout_p=0.25 if backend != "eager" else 0.0,
                         backend="math", strict=True)
    for b in range(B):
        torch.testing.assert_close(out[cu_q[b]:cu_q[b + 1]], dense[b, :, :lens_q[b]].transpose(0, 1),
                                   rtol=1e-5, atol=1e-5)


def test_varlen_auto_and_fallbacks(gen):
    q, k, v, cu_q, cu_k = make_packed([4, 6], [4, 6], 2, 2, 8, 8, torch.float64, gen)
    p = ab._dispatch.prepare_varlen(q, k, v, cu_q, cu_k, 6, 6, "auto", True, 0.0, None, None, 0.0, False)
    assert ab._planner.build(p[1]).chosen == "math"  # float64: flash_varlen cannot, math pads
    out = ab.attention_varlen(q, k, v, cu_q, cu_k, 6, 6, causal=True)
    ref, _ = varlen_reference(q, k, v, cu_q, cu_k, causal=True)
    assert (out - ref).abs().max() < 1e-12
    q32, k32, v32 = (t.float() for t in (q, k, v))
    sig = ab._dispatch.prepare_varlen(q32, k32, v32, cu_q, cu_k, 6, 6, "auto", True, 0.0, None, None, 0.0, False)[1]
    assert ab._planner.build(sig).chosen == "flash_varlen"


@pytest.mark.parametrize(
    "cu_q, cu_k, max_q, max_k, exc, match",
    [
        ([0, 4, 9], [0, 4, 9], 5, 5, None, None),
        ([1, 4, 9], [0, 4, 9], 5, 5, ValueError, r"cu_seqlens_q must start at 0, got 1"),
        ([0, 6, 4, 9], [0, 3, 6, 9], 6, 5, ValueError, r"cu_seqlens_q must be non-decreasing, but cu_seqlens_q\[1\] = 6 > cu_seqlens_q\[2\] = 4"),
        ([0, 4, 8], [0, 4, 9], 5, 5, ValueError, r"cu_seqlens_q\[-1\] = 8 must equal the number of packed rows, 9"),
        ([0, 4, 12], [0, 4, 9], 5, 5, ValueError, r"must equal the number of packed rows"),
        ([0, 4, 9], [0, 4, 9], 4, 5, ValueError, r"sequence 1 has 5 rows in cu_seqlens_q, more than max_seqlen_q = 4"),
        ([0, 9], [0, 4, 9], 9, 5, ValueError, r"must describe the same batch"),
        ([0.0, 4.0, 9.0], [0, 4, 9], 5, 5, TypeError, r"cu_seqlens_q must be int32"),
        ([0, 4, 9], [0, 4, 9], -1, 5, ValueError, r"max_seqlen_q must be a non-negative int"),
    ],
)
def test_bad_cu_seqlens(cu_q, cu_k, max_q, max_k, exc, match):
    q = torch.randn(9, 2, 8)
    k = torch.randn(9, 2, 8)
    dt = torch.float32 if isinstance(cu_q[0], float) else torch.int32
    cq = torch.tensor(cu_q, dtype=dt)
    ck = torch.tensor(cu_k, dtype=torch.int32)
    if exc is None:
        ab.attention_varlen(q, k, k, cq, ck, max_q, max_k)
        return
    with pytest.raises(exc, match=match):
        ab.attention_varlen(q, k, k, cq, ck, max_q, max_k)


def test_varlen_op_checks_cu_seqlens_too():
    q = torch.randn(9, 2, 8)
    bad = torch.tensor([0, 6, 4, 9], dtype=torch.int32)
    good = torch.tensor([0, 3, 6, 9], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="cu_seqlens_q must be non-decreasing"):
        torch.ops.attn_backends.flash_varlen_fwd(q, q, q, bad, good, 9, 9, None, 0, 0.3, -1, -1, 0.0, 0.0)
    with pytest.raises(RuntimeError, match=r"sequence 0 has length 3 > max_seqlen 2"):
        torch.ops.attn_backends.flash_varlen_fwd(q, q, q, good, good, 2, 9, None, 0, 0.3, -1, -1, 0.0, 0.0)


def test_opcheck_flash_ops():
    q, k, v = (torch.randn(2, 4, 9, 16, requires_grad=True), torch.randn(2, 2, 11, 16, requires_grad=True),
               torch.randn(2, 2, 11, 8, requires_grad=True))
    rng = _providers.draw_rng_state()
    torch.library.opcheck(torch.ops.attn_backends.flash_fwd.default,
                          (q, k, v, torch.randn(1, 4, 9, 11, requires_grad=True), rng, 2, 0.25, 3, -1, 2.0, 0.2))
    qv, kv = torch.randn(12, 4, 16, requires_grad=True), torch.randn(15, 2, 16, requires_grad=True)
    vv = torch.randn(15, 2, 8, requires_grad=True)
    cu_q = torch.tensor([0, 5, 12], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 15], dtype=torch.int32)
    torch.library.opcheck(torch.ops.attn_backends.flash_varlen_fwd.default,
                          (qv, kv, vv, cu_q, cu_k, 7, 9, rng, 2, 0.25, -1, -1, 0.0, 0.1))


def test_varlen_ops_take_device_cu_seqlens_and_the_cpu_kernels_ignore_them(gen):
    # cu_seqlens_q_device / _k_device are what the CUDA kernels read (no copy per call); on the CPU key
    # the kernels read the host copies, so passing them changes nothing
    q, k, v, cu_q, cu_k = make_packed([4, 7, 1], [6, 7, 3], 4, 2, 16, 16, torch.float32, gen)
    ops = torch.ops.attn_backends
    base = ops.flash_varlen_fwd(q, k, v, cu_q, cu_k, 7, 7, None, 1, 0.25, -1, -1, 0.0, 0.0)
    given = ops.flash_varlen_fwd(q, k, v, cu_q, cu_k, 7, 7, None, 1, 0.25, -1, -1, 0.0, 0.0, None, None,
                                 cu_q.clone(), cu_k.clone())
    assert all(torch.equal(a, b) for a, b in zip(base, given))
    sage = ops.sage_varlen_fwd(q, k, v, cu_q, cu_k, 7, 7, None, 1, 0.25, -1, -1, 0.0, 0.0, None, None, cu_q, cu_k)
    assert torch.equal(sage[0], ops.sage_varlen_fwd(q, k, v, cu_q, cu_k, 7, 7, None, 1, 0.25, -1, -1, 0.0, 0.0)[0])
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    torch.library.opcheck(ops.flash_varlen_fwd.default,
                          (qg, kg, vg, cu_q, cu_k, 7, 7, None, 1, 0.25, -1, -1, 0.0, 0.0, None, None, cu_q, cu_k))
