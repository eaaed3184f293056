"""Attention sinks and ALiBi in our CPU kernels (math, and flash on every ISA path), dense and packed,
against the float64 reference (DESIGN.md section 5: 2x the same-dtype error for out and lse, 3x for
dq, dk, dv and d sinks): odd shapes, GQA, both causal alignments, windows, masks with fully masked
rows, softcap, non-contiguous views, dropout; gradcheck in float64 on math; the planner's "why not"
for the backends that take neither; fake kernels (opcheck); errors that name the argument.  The CUDA
flash kernels (forward and backward, the sinks' gradient included) on the CUDA emulator (marked
`cuda_emu`) and on a GPU (marked `cuda`, skipped without one)."""

import dataclasses
import math
import os

import pytest
import torch

import attn_backends as ab
from attn_backends._ops import ops
from attn_backends._testing import (EMULATED_ISAS, Case, check_2x, cpu_isas, keep_mask_for_next_call,
                                   make_inputs, make_packed, reference_attention, varlen_reference)

import cuda_devices


def _sinks(Hq, gen, requires_grad=True):
    # logits of the scores' size, so the sink takes a real share of each row (GPT-OSS's are learned)
    return (torch.randn(Hq, generator=gen) * 2).requires_grad_(requires_grad)


def _slopes(kind, B, Hq, gen):
    if kind is None:
        return None
    return torch.rand((Hq,) if kind == "h" else (B, Hq), generator=gen) * 0.5


def _check(case, backend, sinks_on, alibi, gen, dropout_p=0.0, device="cpu", deterministic=False):
    """One call with sinks and/or ALiBi: out, lse, dq, dk, dv (and d sinks) against the reference.
    Returns (out, lse, sinks, the gradients of q, k, v (and sinks))."""
    q, k, v, mask = make_inputs(case, device=device, requires_grad=True, generator=gen)
    sinks = _sinks(case.Hq, gen) if sinks_on else None
    if sinks_on and case.dtype == torch.float64:  # float64 calls keep float64 sinks (their gradient too)
        sinks = sinks.detach().double().requires_grad_()
    if sinks_on:
        sinks = sinks.detach().to(device).requires_grad_()
    slopes = _slopes(alibi, case.B, case.Hq, gen)
    slopes = slopes.to(device) if slopes is not None else None
    keep = None
    if dropout_p:
        keep = keep_mask_for_next_call(1234, case.B, case.Hq, case.Sq, case.Sk, dropout_p)
        torch.manual_seed(1234)
    out, lse = ab.attention(q, k, v, backend=backend, causal=case.causal, attn_mask=mask, window=case.window,
                            softcap=case.softcap, dropout_p=dropout_p, return_lse=True, strict=True, sinks=sinks,
                            alibi_slopes=slopes, deterministic=deterministic)
    opts = dict(causal=case.causal, attn_mask=mask, window=case.window, softcap=case.softcap, alibi_slopes=slopes,
                keep=keep, dropout_p=dropout_p)
    inputs = [q, k, v] + ([sinks] if sinks_on else [])

    def ref(dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in inputs]
        o, l_ = reference_attention(*leaves[:3], dtype=dtype, sinks=leaves[3] if sinks_on else None, **opts)
        return leaves, o, l_

    l64, r_out, r_lse = ref(torch.float64)
    ld, d_out, d_lse = ref(case.dtype)
    check_2x("out", out, r_out, d_out, 2, case.dtype)
    check_2x("lse", lse, r_lse, d_lse, 2, case.dtype)
    g = torch.randn(out.shape, generator=gen).to(out)
    outs, grads_out = [out], [g]
    refs, same = [r_out], [d_out]
    if sinks_on:  # lse is finite everywhere with a sink: its gradient (dlse) is checked too
        gl = torch.randn(lse.shape, generator=gen).to(lse)
        outs, grads_out = [out, lse], [g, gl]
        refs, same = [r_out, r_lse], [d_out, d_lse]
    ours = torch.autograd.grad(outs, inputs, grads_out)
    r = torch.autograd.grad(refs, l64, [t.double() for t in grads_out])
    s = torch.autograd.grad(same, ld, [t.to(case.dtype) for t in grads_out])
    for name, a, b, c in zip(("dq", "dk", "dv", "dsinks"), ours, r, s):
        check_2x(name, a, b, c, 3, case.dtype)
    return out, lse, sinks, ours


# shapes and options of the shared grid (odd sizes, GQA, Dv != D, both alignments, windows, masks with fully
# masked rows, softcap, non-contiguous layouts), each with sinks, ALiBi or both
GRID = [
    (Case(B=1, Hq=1, Hkv=1, Sq=1, Sk=1, D=8), True, None),
    (Case(B=2, Hq=4, Hkv=2, Sq=17, Sk=23, D=40, Dv=24), True, "h"),
    (Case(B=2, Hq=4, Hkv=2, Sq=17, Sk=23, D=40, causal=True, mask="bool_rows"), True, "bh"),
    (Case(B=1, Hq=3, Hkv=1, Sq=67, Sk=129, D=96, causal="bottom_right"), True, "h"),
    (Case(B=2, Hq=2, Hkv=1, Sq=64, Sk=17, D=64, causal="bottom_right"), True, None),  # rows with no key
    (Case(B=1, Hq=2, Hkv=2, Sq=33, Sk=65, D=128, Dv=64, mask="float_rows", causal=True), True, "bh"),
    (Case(B=1, Hq=2, Hkv=2, Sq=40, Sk=40, D=64, window=(5, 0)), False, "h"),
    (Case(B=2, Hq=4, Hkv=2, Sq=21, Sk=37, D=32, window=(3, 7), causal="bottom_right"), True, "bh"),
    (Case(B=1, Hq=2, Hkv=1, Sq=19, Sk=70, D=64, softcap=5.0, mask="bool"), True, "h"),
    (Case(B=2, Hq=2, Hkv=2, Sq=17, Sk=23, D=40, layout="bshd", causal=True), True, "h"),
    (Case(B=1, Hq=4, Hkv=2, Sq=30, Sk=30, D=48, layout="strided_d"), False, "bh"),
    (Case(B=1, Hq=2, Hkv=2, Sq=50, Sk=90, D=64), False, "h"),  # not causal: |i - j| on both sides
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _grid(dtypes):
    for i, (case, s, a) in enumerate(GRID):
        for j, dt in enumerate(dtypes):
            if (i + j) % len(dtypes) == 0 or dt == torch.float32:  # every case in float32, others rotating
                yield dataclasses.replace(case, dtype=dt), s, a


def _ids(x):
    if isinstance(x, Case):
        return str(x)
    if isinstance(x, bool):
        return "sinks" if x else "nosinks"
    return f"alibi_{x}" if x else "noalibi"


MATH_GRID = list(_grid(DTYPES + [torch.float64]))
FLASH_GRID = list(_grid(DTYPES))
# the emulated AMX tiles hand sinks and ALiBi to the vector kernel: a few 16-bit cases show it
EMULATED_GRID = [c for c in FLASH_GRID if c[0].dtype == torch.bfloat16][:3]


@pytest.mark.parametrize("case, sinks_on, alibi", MATH_GRID, ids=_ids)
def test_math_matches_reference(case, sinks_on, alibi, gen):
    _check(case, "math", sinks_on, alibi, gen)


@pytest.mark.parametrize("isa, case, sinks_on, alibi",
                         [(isa, *c) for isa in cpu_isas() for c in (EMULATED_GRID if isa in EMULATED_ISAS else FLASH_GRID)],
                         ids=_ids, indirect=["isa"])
def test_flash_matches_reference(isa, case, sinks_on, alibi, gen):
    _check(case, "flash", sinks_on, alibi, gen)


@pytest.mark.parametrize("backend", ["math", "flash"])
def test_a_row_that_sees_no_key_puts_its_weight_on_the_sink(backend, gen):
    # causal bottom-right with Sq > Sk: the first rows see nothing.  flash-attn / FA3 leave such rows 0;
    # with a sink the row's softmax is the sink alone: out 0, lse = s_h, no gradient to q, and d s_h = dlse
    q = torch.randn(1, 2, 9, 16, generator=gen, requires_grad=True)
    k, v = torch.randn(1, 2, 4, 16, generator=gen), torch.randn(1, 2, 4, 16, generator=gen)
    sinks = _sinks(2, gen)
    out, lse = ab.attention(q, k, v, causal="bottom_right", backend=backend, strict=True, return_lse=True,
                            sinks=sinks)
    dead = slice(0, 5)
    assert (out[:, :, dead] == 0).all()
    torch.testing.assert_close(lse[:, :, dead], sinks.detach().view(1, 2, 1).expand(1, 2, 5))
    gl = torch.zeros_like(lse)
    gl[:, :, dead] = 1.0
    dq, ds = torch.autograd.grad([out, lse], [q, sinks], [torch.zeros_like(out), gl])
    assert (dq[:, :, dead] == 0).all()
    torch.testing.assert_close(ds, torch.full((2,), 5.0))


def test_without_keys_the_sink_is_everything(gen):
    q = torch.randn(2, 3, 4, 8, generator=gen)
    k, v = torch.randn(2, 3, 0, 8), torch.randn(2, 3, 0, 8)
    sinks = torch.randn(3, generator=gen)
    for backend in ("math", "flash"):
        out, lse = ab.attention(q, k, v, backend=backend, strict=True, return_lse=True, sinks=sinks)
        assert (out == 0).all()
        torch.testing.assert_close(lse, sinks.view(1, 3, 1).expand(2, 3, 4))


@pytest.mark.parametrize("backend", ["math", "flash"])
def test_dropout_composes_with_sinks_and_alibi(backend, gen):
    case = Case(B=2, Hq=4, Hkv=2, Sq=23, Sk=31, D=32, causal="bottom_right")
    _check(case, backend, True, "bh", gen, dropout_p=0.3)


def test_gradcheck_math_float64(gen):
    q = torch.randn(1, 2, 5, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 7, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 7, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(2, generator=gen, dtype=torch.float64, requires_grad=True)
    slopes = torch.rand(1, 2, generator=gen) * 0.5
    mask = torch.rand(1, 1, 5, 7, generator=gen) > 0.3
    mask[:, :, 1] = False  # a fully masked row: all its weight on the sink

    def fn(q, k, v, sinks):
        return ab.attention(q, k, v, backend="math", strict=True, causal="bottom_right", window=(4, 1),
                            attn_mask=mask, softcap=3.0, return_lse=True, sinks=sinks, alibi_slopes=slopes)

    assert torch.autograd.gradcheck(fn, (q, k, v, sinks))


def test_flash_gradient_of_sinks_is_deterministic(gen):
    q = torch.randn(3, 4, 70, 32, generator=gen, requires_grad=True)
    k, v = torch.randn(3, 2, 70, 32, generator=gen), torch.randn(3, 2, 70, 32, generator=gen)
    sinks = _sinks(4, gen)
    g = torch.randn(3, 4, 70, 32, generator=gen)
    got = []
    for threads in (1, 2):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            out = ab.attention(q, k, v, backend="flash", strict=True, causal=True, sinks=sinks)
            got.append(torch.autograd.grad(out, [q, sinks], g))
        finally:
            torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*got))


# ---- packed sequences -------------------------------------------------------------------------------

VARLEN = [
    ([5, 1, 17], [9, 0, 17], 4, 2, 32, False, True, "bh"),
    ([13, 7], [13, 20], 2, 2, 40, "bottom_right", True, "h"),
    ([8, 3, 30], [3, 8, 30], 4, 1, 64, "bottom_right", False, "bh"),  # rows that see nothing
]


@pytest.mark.parametrize("backend", ["flash_varlen", "math", "eager"])
@pytest.mark.parametrize("lens_q, lens_k, Hq, Hkv, D, causal, sinks_on, alibi", VARLEN)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_matches_reference(backend, lens_q, lens_k, Hq, Hkv, D, causal, sinks_on, alibi, dtype, gen):
    q, k, v, cu_q, cu_k = make_packed(lens_q, lens_k, Hq, Hkv, D, D, dtype, generator=gen)
    inputs = [t.requires_grad_() for t in (q, k, v)]
    sinks = _sinks(Hq, gen) if sinks_on else None
    if sinks_on:
        inputs.append(sinks)
    slopes = _slopes(alibi, len(lens_q), Hq, gen)
    out, lse = ab.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), backend=backend, strict=True,
                                   causal=causal, window=(6, -1), return_lse=True, sinks=sinks,
                                   alibi_slopes=slopes)

    def ref(dtype_):
        leaves = [t.detach().to(dtype_).requires_grad_() for t in inputs]
        o, l_ = varlen_reference(*leaves[:3], cu_q, cu_k, dtype=dtype_, causal=causal, window=(6, -1),
                                 alibi_slopes=slopes, sinks=leaves[3] if sinks_on else None)
        return leaves, o, l_

    l64, r_out, r_lse = ref(torch.float64)
    ld, d_out, d_lse = ref(dtype)
    check_2x("out", out, r_out, d_out, 2, dtype)
    check_2x("lse", lse, r_lse, d_lse, 2, dtype)
    g = torch.randn(out.shape, generator=gen).to(dtype)
    for name, a, b, c in zip(("dq", "dk", "dv", "dsinks"), torch.autograd.grad(out, inputs, g),
                             torch.autograd.grad(r_out, l64, g.double()), torch.autograd.grad(d_out, ld, g)):
        check_2x(name, a, b, c, 3, dtype)


# ---- planning and fallback --------------------------------------------------------------------------

def test_explain_says_which_backends_take_sinks_and_alibi():
    q = k = v = torch.randn(1, 2, 8, 16)
    plan = ab.explain(q, k, v, sinks=torch.zeros(2), alibi_slopes=torch.ones(2))
    assert plan.chosen == "flash"
    assert plan.reasons["sdpa"] == "no attention sinks"
    assert plan.reasons["flex"] == "no attention sinks"
    assert plan.reasons["math"] == "" and plan.reasons["eager"] == ""
    assert "sinks" in plan.describe_call() and "ALiBi" in plan.describe_call()
    plan = ab.explain(q, k, v, alibi_slopes=torch.ones(2), backend="sage")
    assert plan.reasons["sage"] == "no ALiBi (alibi_slopes)"


def test_a_backend_that_cannot_take_sinks_falls_back_or_raises_when_strict(caplog, gen):
    ab._dispatch.reset_caches()
    q, k, v = (torch.randn(1, 2, 9, 16, generator=gen) for _ in range(3))
    sinks = torch.randn(2, generator=gen)
    with caplog.at_level("WARNING", logger="attn_backends"):
        out = ab.attention(q, k, v, backend="sdpa", sinks=sinks)
    assert any("no attention sinks" in r.getMessage() for r in caplog.records)
    ref, _ = reference_attention(q, k, v, sinks=sinks)
    same, _ = reference_attention(q, k, v, sinks=sinks, dtype=torch.float32)
    check_2x("out", out, ref, same, 2, torch.float32)
    with pytest.raises(RuntimeError, match="no attention sinks"):
        ab.attention(q, k, v, backend="sdpa", sinks=sinks, strict=True)


EMU_CASES = [
    (Case(B=2, Hq=4, Hkv=2, Sq=70, Sk=90, D=64, dtype=torch.float16, causal="bottom_right"), True, "bh"),
    (Case(B=1, Hq=2, Hkv=2, Sq=33, Sk=17, D=32, dtype=torch.bfloat16, causal="bottom_right", window=(5, 0)), True,
     None),  # rows that see no key: out 0, lse = sink
    (Case(B=1, Hq=2, Hkv=1, Sq=40, Sk=129, D=128, dtype=torch.float16, softcap=5.0), False, "h"),  # not causal
]


@pytest.mark.cuda_emu
@pytest.mark.parametrize("case, sinks_on, alibi", EMU_CASES, ids=_ids)
def test_cuda_flash_forward_on_the_emulator(case, sinks_on, alibi, gen):
    # the CUDA flash forward takes sinks and ALiBi (csrc/cuda/flash_fwd_kernel.cuh): run on the emulator
    q, k, v, _ = make_inputs(case, generator=gen)
    sinks = _sinks(case.Hq, gen, requires_grad=False) if sinks_on else None
    slopes = _slopes(alibi, case.B, case.Hq, gen)
    opts = dict(causal=case.causal, window=case.window, softcap=case.softcap)
    cuda_devices.set_emulation(True)
    try:
        plan = ab.explain(q, k, v, sinks=sinks, alibi_slopes=slopes, **opts)
        assert plan.chosen == "flash" and plan.path == "cuda emulated on cpu"
        out, lse = ab.attention(q, k, v, sinks=sinks, alibi_slopes=slopes, return_lse=True, **opts)
    finally:
        cuda_devices.set_emulation(cuda_devices.emulation_default())
    ref, r_lse = reference_attention(q, k, v, sinks=sinks, alibi_slopes=slopes, **opts)
    same, s_lse = reference_attention(q, k, v, sinks=sinks, alibi_slopes=slopes, dtype=case.dtype, **opts)
    check_2x("out", out, ref, same, 2, case.dtype)
    check_2x("lse", lse, r_lse, s_lse, 2, case.dtype)


@pytest.mark.cuda_emu
def test_cuda_flash_varlen_forward_on_the_emulator(gen):
    q, k, v, cu_q, cu_k = make_packed([5, 40, 1], [9, 33, 0], 4, 2, 64, 64, torch.float16, generator=gen)
    sinks, slopes = _sinks(4, gen, requires_grad=False), _slopes("bh", 3, 4, gen)
    cuda_devices.set_emulation(True)
    try:
        out, lse = ab.attention_varlen(q, k, v, cu_q, cu_k, 40, 33, causal="bottom_right", return_lse=True,
                                       sinks=sinks, alibi_slopes=slopes, backend="flash_varlen", strict=True)
    finally:
        cuda_devices.set_emulation(cuda_devices.emulation_default())
    opts = dict(causal="bottom_right", sinks=sinks, alibi_slopes=slopes)
    ref, r_lse = varlen_reference(q, k, v, cu_q, cu_k, **opts)
    same, s_lse = varlen_reference(q, k, v, cu_q, cu_k, dtype=torch.float16, **opts)
    check_2x("out", out, ref, same, 2, torch.float16)
    check_2x("lse", lse, r_lse, s_lse, 2, torch.float16)


# ---- the CUDA flash backward: sinks' gradient and ALiBi (csrc/cuda/flash_bwd*.cu) ------------------------
# On the emulator (marked cuda_emu: CPU tensors run the CUDA kernels, docs/cuda.md) on small shapes, since it runs
# every GPU thread on the CPU; on a GPU (marked cuda, skipped without one) the same checks on longer sequences.
# Each entry: (case, sinks, ALiBi, deterministic backward).  The kernel takes float16 and bfloat16 only.
F16, BF16 = torch.float16, torch.bfloat16
BWD_EMU = [
    # GQA, D = 40 (padded to 64), odd lengths, bottom-right causal, slopes per (batch, head)
    (Case(B=2, Hq=4, Hkv=2, Sq=37, Sk=45, D=40, dtype=F16, causal="bottom_right"), True, "bh", False),
    # a window that leaves the first rows no key: their weight is all on the sink (out 0, lse = sink)
    (Case(B=1, Hq=2, Hkv=1, Sq=33, Sk=17, D=64, dtype=BF16, causal="bottom_right", window=(5, 0)), True, None, True),
    # not causal (ALiBi penalises both sides), softcap, a transposed (B, S, H, D) view
    (Case(B=2, Hq=2, Hkv=2, Sq=19, Sk=70, D=32, dtype=F16, softcap=5.0, layout="bshd"), True, "h", False),
    # top-left causal with Sq != Sk (ALiBi still bottom-right), ALiBi alone, two query tiles
    (Case(B=1, Hq=2, Hkv=1, Sq=67, Sk=50, D=64, dtype=BF16, causal=True), False, "h", True),
]
BWD_GPU = [
    (Case(B=2, Hq=8, Hkv=2, Sq=257, Sk=300, D=40, dtype=F16, causal="bottom_right"), True, "bh", False),
    (Case(B=2, Hq=4, Hkv=1, Sq=300, Sk=129, D=128, dtype=BF16, causal="bottom_right", window=(17, 0)), True, None,
     True),
    (Case(B=2, Hq=4, Hkv=4, Sq=129, Sk=513, D=96, dtype=F16, softcap=5.0, layout="bshd"), True, "h", False),
    (Case(B=1, Hq=4, Hkv=2, Sq=400, Sk=257, D=256, dtype=BF16, causal=True), False, "h", True),
    (Case(B=3, Hq=6, Hkv=3, Sq=200, Sk=200, D=64, dtype=BF16, window=(33, 7)), True, "bh", True),
]


def _bwd_id(entry):
    case, sinks_on, alibi, det = entry
    return "-".join([str(case), _ids(sinks_on), _ids(alibi)] + (["deterministic"] if det else []))


@pytest.fixture
def cuda_flash_on():
    # our CUDA flash kernels are opt-in on a GPU until verified (ATTN_BACKENDS_CUDA_FLASH=1); the emulated
    # device always offers them
    ab._C.enable_cuda_flash(True)
    ab._dispatch.reset_caches()
    yield
    ab._C.enable_cuda_flash(os.environ.get("ATTN_BACKENDS_CUDA_FLASH", "0") == "1")
    ab._dispatch.reset_caches()


@pytest.mark.parametrize("dev, entry", cuda_devices.both(BWD_GPU, BWD_EMU, name=_bwd_id), indirect=["dev"])
def test_cuda_flash_backward_matches_reference(dev, entry, cuda_flash_on, gen):
    case, sinks_on, alibi, det = entry
    probe_q, probe_k, probe_v, _ = make_inputs(case, device=dev.type)
    slopes = _slopes(alibi, case.B, case.Hq, gen)
    plan = ab.explain(probe_q.requires_grad_(), probe_k, probe_v, causal=case.causal, window=case.window,
                      softcap=case.softcap, sinks=torch.zeros(case.Hq, device=dev.type) if sinks_on else None,
                      alibi_slopes=dev(slopes) if slopes is not None else None)
    if not dev.emulated and "shared memory" in plan.reasons.get("flash", ""):
        pytest.skip(f"this GPU's shared memory: {plan.reasons['flash']}")  # D > 128 on a 99 KiB device
    assert plan.chosen == "flash" and plan.path.startswith("cuda"), (plan.chosen, plan.path, plan.reasons)
    lib = cuda_devices.emulator() if dev.emulated else None
    if lib is not None:
        lib.ab_cuda_emu_reset_launch_log()
    _check(case, "flash", sinks_on, alibi, gen, device=dev.type, deterministic=det)
    if lib is not None:  # the CUDA backward ran (not a CPU fallback), with the sinks' reduction when asked
        ran = cuda_devices.launched(lib)
        assert any(label.endswith(": dkv") for label in ran), ran
        assert any(label.endswith(": dq") for label in ran) == det, ran  # deterministic: the dQ kernel, no atomics
        assert any("sinks_grad_kernel" in label for label in ran) == sinks_on, ran


VARLEN_BWD_EMU = [([5, 20, 1], [9, 13, 0], 4, 2, 40, "bottom_right", True, "bh", False),  # a sequence with no keys
                  ([17, 3], [30, 3], 2, 1, 64, True, True, "h", True)]
VARLEN_BWD_GPU = [([100, 3, 257, 1], [120, 0, 300, 64], 8, 2, 128, "bottom_right", True, "bh", False),
                  ([70, 130], [130, 70], 4, 4, 64, True, True, "h", True)]


@pytest.mark.parametrize("dev, entry", cuda_devices.both(VARLEN_BWD_GPU, VARLEN_BWD_EMU, name=lambda e: str(e[:2])),
                         indirect=["dev"])
def test_cuda_flash_varlen_backward_matches_reference(dev, entry, cuda_flash_on, gen):
    lens_q, lens_k, Hq, Hkv, D, causal, sinks_on, alibi, det = entry
    dtype = torch.float16
    q, k, v, cu_q, cu_k = make_packed(lens_q, lens_k, Hq, Hkv, D, D, dtype, generator=gen)
    inputs = [dev(t).requires_grad_() for t in (q, k, v)]
    sinks = _sinks(Hq, gen) if sinks_on else None
    if sinks_on:
        sinks = dev(sinks.detach()).requires_grad_()
        inputs.append(sinks)
    slopes = _slopes(alibi, len(lens_q), Hq, gen)
    slopes = dev(slopes) if slopes is not None else None
    opts = dict(causal=causal, window=(6, -1), alibi_slopes=slopes)
    out, lse = ab.attention_varlen(*inputs[:3], cu_q, cu_k, max(lens_q), max(lens_k), backend="flash_varlen",
                                   strict=True, return_lse=True, sinks=sinks, deterministic=det, **opts)

    def ref(dtype_):
        leaves = [t.detach().to(dtype_).requires_grad_() for t in inputs]
        o, l_ = varlen_reference(*leaves[:3], cu_q, cu_k, dtype=dtype_, sinks=leaves[3] if sinks_on else None,
                                 **opts)
        return leaves, o, l_

    l64, r_out, r_lse = ref(torch.float64)
    ld, d_out, d_lse = ref(dtype)
    check_2x("out", out, r_out, d_out, 2, dtype)
    check_2x("lse", lse, r_lse, d_lse, 2, dtype)
    g, gl = torch.randn(out.shape, generator=gen).to(out), torch.randn(lse.shape, generator=gen).to(lse)
    for name, a, b, c in zip(("dq", "dk", "dv", "dsinks"), torch.autograd.grad([out, lse], inputs, [g, gl]),
                             torch.autograd.grad([r_out, r_lse], l64, [g.double(), gl.double()]),
                             torch.autograd.grad([d_out, d_lse], ld, [g, gl.to(dtype)])):
        check_2x(name, a, b, c, 3, dtype)


@pytest.mark.parametrize("dev", cuda_devices.DEVICES, indirect=True)
def test_cuda_flash_backward_with_sinks_and_alibi_is_bitwise_deterministic(dev, cuda_flash_on, gen):
    # deterministic=True: the dQ kernel without atomics, and the sinks' fixed-order reduction (used on both paths)
    S = 70 if dev.emulated else 700
    q = dev(torch.randn(2, 4, S, 64, generator=gen)).to(torch.bfloat16).requires_grad_()
    k, v = (dev(torch.randn(2, 2, S + 9, 64, generator=gen)).to(torch.bfloat16).requires_grad_() for _ in range(2))
    sinks = dev(_sinks(4, gen, requires_grad=False)).to(torch.bfloat16).requires_grad_()
    slopes = dev(_slopes("bh", 2, 4, gen))
    g = dev(torch.randn(2, 4, S, 64, generator=gen)).to(torch.bfloat16)
    got = []
    for _ in range(2):
        out = ab.attention(q, k, v, backend="flash", strict=True, causal="bottom_right", sinks=sinks,
                           alibi_slopes=slopes, deterministic=True)
        got.append(torch.autograd.grad(out, [q, k, v, sinks], g))
    assert got[0][3].dtype == torch.bfloat16  # the sinks' gradient in the caller's dtype
    assert all(torch.equal(a, b) for a, b in zip(*got))


# ---- the ops ---------------------------------------------------------------------------------------------

def test_opcheck_with_sinks_and_alibi(gen):
    q = torch.randn(2, 4, 9, 16, generator=gen, requires_grad=True)
    k = torch.randn(2, 2, 11, 16, generator=gen, requires_grad=True)
    v = torch.randn(2, 2, 11, 16, generator=gen, requires_grad=True)
    sinks = torch.randn(4, generator=gen, requires_grad=True)
    slopes = torch.rand(2, 4, generator=gen)
    for fwd in (ops.flash_fwd.default, ops.math_fwd.default):
        torch.library.opcheck(fwd, (q, k, v, None, None, 2, 0.25, -1, -1, 0.0, 0.0, sinks, slopes))
    out, lse, stats = ops.flash_fwd(q, k, v, None, None, 2, 0.25, -1, -1, 0.0, 0.0, sinks, slopes)
    g = torch.randn_like(out)
    # the backward op has no autograd of its own
    q, k, v, out, lse, stats, sinks = (t.detach() for t in (q, k, v, out, lse, stats, sinks))
    torch.library.opcheck(ops.flash_bwd.default, (g, q, k, v, out, lse, None, None, None, 2, 0.25, -1, -1, 0.0, 0.0,
                                                  False, False, stats, sinks, slopes))
    qp, kp, vp, cu_q, cu_k = make_packed([3, 6], [5, 6], 4, 2, 16, 16, torch.float32, generator=gen)
    torch.library.opcheck(ops.flash_varlen_fwd.default, (qp, kp, vp, cu_q, cu_k, 6, 6, None, 2, 0.25, -1, -1, 0.0,
                                                         0.0, sinks, slopes))


@pytest.mark.parametrize("what, value, exc, msg", [
    ("sinks", torch.zeros(3), ValueError, r"sinks must have shape \(Hq,\) = \(2,\)"),
    ("sinks", torch.zeros(2, dtype=torch.int32), TypeError, "sinks must be floating"),
    ("sinks", [0.0, 0.0], TypeError, "sinks must be a torch.Tensor"),
    ("alibi_slopes", torch.zeros(2, dtype=torch.float64), TypeError, "alibi_slopes must be float32"),
    ("alibi_slopes", torch.zeros(3, 2), ValueError, r"alibi_slopes must have shape \(Hq,\) = \(2,\) or \(B, Hq\)"),
])
def test_bad_sinks_and_slopes_are_named(what, value, exc, msg):
    q = k = v = torch.randn(1, 2, 4, 8)
    with pytest.raises(exc, match=msg):
        ab.attention(q, k, v, **{what: value})
    qp, cu = torch.randn(4, 2, 8), torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(exc, match=msg):
        ab.attention_varlen(qp, qp, qp, cu, cu, 4, 4, **{what: value})


def test_the_op_refuses_sinks_of_the_wrong_shape(gen):
    q = k = v = torch.randn(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="sinks has size 3 in dim 0, expected 2"):
        ops.math_fwd(q, k, v, None, None, 0, 0.3, -1, -1, 0.0, 0.0, torch.zeros(3), None)
    with pytest.raises(RuntimeError, match="alibi_slopes must be float32"):
        ops.flash_fwd(q, k, v, None, None, 0, 0.3, -1, -1, 0.0, 0.0, None, torch.zeros(2, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="sage takes no sinks"):
        ops.sage_fwd(q, k, v, None, None, 0, 0.3, -1, -1, 0.0, 0.0, torch.zeros(2), None)


@pytest.mark.parametrize("backend", ["flash", "auto"])
def test_compiled_fullgraph_with_sinks_that_need_a_gradient(backend, gen):
    # the sinks' cast for the kernels asked _C.cuda_emulation(), a builtin dynamo cannot trace: with
    # fullgraph=True the call raised, without it a graph break
    q = torch.randn(2, 4, 19, 40, generator=gen, requires_grad=True)
    k = torch.randn(2, 2, 27, 40, generator=gen, requires_grad=True)
    v = torch.randn(2, 2, 27, 24, generator=gen, requires_grad=True)
    sinks = _sinks(4, gen)
    slopes = _slopes("bh", 2, 4, gen)

    def f(q, k, v, sinks):
        return ab.attention(q, k, v, backend=backend, causal="bottom_right", sinks=sinks, alibi_slopes=slopes,
                            softcap=4.0, return_lse=True)

    torch._dynamo.reset()
    out, lse = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v, sinks)
    ref_out, ref_lse = f(q, k, v, sinks)
    go, gl = torch.randn(out.shape, generator=gen), torch.randn(lse.shape, generator=gen)
    got = torch.autograd.grad([out, lse], [q, k, v, sinks], [go, gl])
    want = torch.autograd.grad([ref_out, ref_lse], [q, k, v, sinks], [go, gl])
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
