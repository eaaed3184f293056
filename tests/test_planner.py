"""The planner, without the hardware: described calls on described devices (CPU with and without
AVX-512, MPS, CUDA 6.1 / 7.5 / 8.0 / 8.6 / 9.0, a build without CUDA) get the expected backend and
reasons; every accepted name serves a real CPU call (falling back with one warning where it must);
strict mode raises with every backend's reason; use() and the environment set the default."""

import logging
import os
import subprocess
import sys
import threading

import pytest
import torch

import attn_backends as ab
from attn_backends import _C, _names, _planner
from attn_backends._testing import Case, check_against_reference

CPU, CUDA, MPS, OTHER = 0, 1, 2, 3
DT = {"float32": 0, "float16": 1, "bfloat16": 2, "float64": 3}


def plan(device=CPU, cc=0, lib=1, dtype="float32", D=64, Dv=None, gqa=0, square=1, mask=0, mask_grad=0,
         causal=0, window=0, softcap=0, dropout=0, need_grad=0, deterministic=0, want_lse=0, varlen=0,
         mps_fix=1, requested="auto", isa=2, units=0, smem=0, vendor=0, few=0, family=25):
    # family: CPUID's display family, 25 (AMD Zen 3 and Zen 4) unless a test says otherwise, whatever this CPU is
    call = _planner.new_call(device, cc, lib, DT[dtype], D, D if Dv is None else Dv, gqa, square, mask, mask_grad,
                             causal, window, softcap, dropout, need_grad, deterministic, want_lse, varlen, mps_fix,
                             _names.ID[ab.resolve(requested)], isa, units, smem, cpu_vendor=vendor, few_queries=few,
                             cpu_family=family)
    return _planner.build(call)


AMX_BF16, AMX_FP16, AMX_INT8 = 1, 2, 4


# ---- described devices --------------------------------------------------------------------------

ISAS = ["generic", "avx2", "avx512", "amx", "amx_emu"]


@pytest.mark.parametrize("isa", range(len(ISAS)), ids=ISAS)
def test_cpu_auto_uses_our_kernels_whatever_the_isa(isa):
    p = plan(device=CPU, isa=isa, need_grad=1, mask=2, mask_grad=1, causal=2, window=1, softcap=1, dropout=1,
             want_lse=1, gqa=1, Dv=40)
    assert p.chosen == "flash"
    assert p.path == "cpu " + ISAS[isa]
    assert p.order == ("flash", "flash_varlen", "math", "eager")
    # float64 is math's; packed sequences are flash_varlen's
    assert plan(device=CPU, isa=isa, dtype="float64").chosen == "math"
    assert "no float64 support" in plan(device=CPU, isa=isa, dtype="float64").reasons["flash"]
    p = plan(device=CPU, isa=isa, varlen=1, causal=2, need_grad=1)
    assert p.chosen == "flash_varlen" and "packed" in p.reasons["flash"]
    assert "no bool attn_mask" in plan(device=CPU, varlen=1, mask=1, requested="flash_varlen").reasons["flash_varlen"]


# ---- auto is never slower than torch SDPA: CPU matrix units torch uses and our paths do not -------

# the amx paths too: their tile kernels are unverified on AMX hardware, so no measurement says they
# beat torch yet (ab_our_cpu_units, csrc/ab_registry.c)
@pytest.mark.parametrize("isa", range(len(ISAS)), ids=ISAS)
@pytest.mark.parametrize("dtype,unit", [("bfloat16", AMX_BF16), ("float16", AMX_FP16)])
def test_auto_prefers_torch_where_it_computes_on_amx(isa, dtype, unit):
    all_units = AMX_BF16 | AMX_FP16 | AMX_INT8
    for need_grad in (0, 1):
        p = plan(device=CPU, isa=isa, dtype=dtype, units=all_units, need_grad=need_grad, causal=1, gqa=1)
        assert p.chosen == "sdpa" and p.path == "torch"
        assert p.order[:2] == ("sdpa", "flash")
        assert dtype in p.note and ("AMX-BF16" if unit == AMX_BF16 else "AMX-FP16") in p.note
        assert "note:" in str(p)
        # only the unit for this dtype counts (causal: no class of ab_torch_cpu_faster's either)
        p = plan(device=CPU, isa=isa, dtype=dtype, units=all_units & ~unit, need_grad=need_grad, causal=1)
        assert p.chosen == "flash" and not p.note


def test_torch_first_only_where_torch_keeps_its_advantage():
    amx = AMX_BF16 | AMX_FP16 | AMX_INT8
    # float32 runs on FMA units in both: ours
    assert plan(dtype="float32", units=amx).chosen == "flash"
    # what torch's fast CPU path cannot do, or does without its advantage: ours
    assert plan(dtype="bfloat16", units=amx, dropout=1, need_grad=1).chosen == "flash"
    assert plan(dtype="bfloat16", units=amx, window=1).chosen == "flash"
    # what torch SDPA cannot serve at all still reaches our kernels (softcap, lse, packed)
    for kw in (dict(softcap=1), dict(want_lse=1), dict(varlen=1)):
        p = plan(dtype="bfloat16", units=amx, **kw)
        assert p.chosen in ("flash", "flash_varlen") and p.order[0] == "sdpa" and p.reasons["sdpa"]
    # a named backend is served as named
    assert plan(dtype="bfloat16", units=amx, requested="flash").chosen == "flash"
    # the rule is the CPU's: CUDA calls never see it
    assert not plan(device=CUDA, cc=90, dtype="bfloat16", units=amx).note


def test_decode_through_the_plain_api_stays_ours_in_bfloat16_on_amx():
    # a bfloat16 forward of few query tokens that flash hands to the decode kernel (ab_planner.c decode_route) keeps
    # our kernel on the avx512 and amx paths even where torch computes bfloat16 on AMX: the decode kernel ran
    # 1.66-4.65x torch's speed there (docs/benchmarks.md, "Decode through ab.attention on the AMX Xeon")
    amx = AMX_BF16 | AMX_FP16 | AMX_INT8
    for isa in (2, 3):
        for kw in (dict(), dict(causal=2, square=0), dict(causal=1, square=1), dict(mask=1), dict(gqa=1),
                   dict(window=1, causal=2, square=0)):
            p = plan(dtype="bfloat16", units=amx, isa=isa, few=1, **kw)
            assert p.chosen == "flash" and not p.note, (isa, kw)
    # calls the route does not take (a gradient, Dv != D, top-left causal with Sq != Sk, more tokens), the other
    # paths (generic, avx2, amx_emu) and float16 (not measured) keep torch first
    for kw in (dict(need_grad=1), dict(Dv=32), dict(causal=1, square=0), dict(few=0), dict(isa=0), dict(isa=1),
               dict(isa=4), dict(dtype="float16")):
        args = dict(dtype="bfloat16", units=amx, isa=2, few=1)
        args.update(kw)
        p = plan(**args)
        assert p.chosen == "sdpa" and p.note.startswith("torch SDPA first"), kw


def test_torch_first_where_its_fma_kernel_measured_faster():
    # float32 forward, no grad, no causal, no mask, no GQA, D >= 128: torch's fused kernel measured
    # faster than ours on the same FMA units (csrc/ab_registry.c ab_torch_cpu_faster), on every path
    for isa in range(len(ISAS)):
        for units in (0, AMX_BF16 | AMX_FP16 | AMX_INT8):
            for D in (128, 256):
                p = plan(dtype="float32", D=D, units=units, isa=isa)
                assert p.chosen == "sdpa" and p.order[:2] == ("sdpa", "flash")
                assert "float32 forward at D >= 128" in p.note and "note:" in str(p)
    # everything else keeps our kernel on the avx512 path: each condition alone flips it back
    for kw in (dict(D=64), dict(D=96), dict(need_grad=1), dict(causal=1), dict(causal=2), dict(mask=1),
               dict(mask=2), dict(gqa=1), dict(dtype="float16"), dict(dtype="bfloat16"), dict(requested="flash")):
        args = dict(dtype="float32", D=128)
        args.update(kw)
        p = plan(**args)
        assert p.chosen == "flash" and not p.note, kw
    # what torch cannot serve never gets there
    for kw in (dict(softcap=1), dict(want_lse=1), dict(window=1), dict(dropout=1, need_grad=0)):
        assert plan(dtype="float32", D=128, **kw).chosen == "flash", kw
    assert plan(dtype="float32", D=128, varlen=1).chosen == "flash_varlen"
    assert not plan(device=CUDA, cc=90, dtype="float32", D=128).note


AVX2 = ISAS.index("avx2")


def test_torch_first_on_the_avx2_path_where_it_measured_faster():
    # the avx2 path (measured on an AMD EPYC, Zen 3): the bfloat16 forward at D >= 64, and the
    # float32 forward+backward at D >= 128, both with no causal mask, go to torch SDPA as well
    for D in (64, 128, 256):
        p = plan(dtype="bfloat16", D=D, isa=AVX2)
        assert p.chosen == "sdpa" and "bfloat16 forward at D >= 64 on the avx2 path" in p.note, D
    p = plan(dtype="float32", D=128, need_grad=1, isa=AVX2)
    assert p.chosen == "sdpa" and "float32 forward+backward at D >= 128 on the avx2 path" in p.note
    # with a float attn_mask (HF's additive one): the bfloat16 forward at D >= 64 and the float32 one at D >= 128
    # (measured 0.80-0.93x torch's speed on the Zen 3); a bool mask measured at parity and stays ours
    for D in (64, 128):
        p = plan(dtype="bfloat16", D=D, isa=AVX2, mask=2)
        assert p.chosen == "sdpa" and "bfloat16 forward at D >= 64 on the avx2 path" in p.note, D
    for D in (128, 256):
        p = plan(dtype="float32", D=D, isa=AVX2, mask=2)
        assert p.chosen == "sdpa" and "float32 forward at D >= 128 with a float attn_mask on the avx2 path" in p.note
    for kw in (dict(dtype="float32", D=128, mask=1), dict(dtype="float32", D=64, mask=2),
               dict(dtype="bfloat16", mask=2, mask_grad=1, need_grad=1), dict(dtype="bfloat16", mask=2, causal=1),
               dict(dtype="float16", mask=2), dict(dtype="bfloat16", D=32, mask=2)):
        p = plan(isa=AVX2, **kw)
        assert p.chosen == "flash" and not p.note, kw
    for isa in range(len(ISAS)):
        if isa != AVX2:
            assert plan(dtype="bfloat16", isa=isa, mask=2).chosen == "flash", ISAS[isa]
    # what measured at par or faster there stays ours: causal calls, the bfloat16 backward, float16,
    # float32 at D=64 (forward and backward), and every other path
    keep = (dict(dtype="bfloat16", causal=1), dict(dtype="bfloat16", causal=2), dict(dtype="bfloat16", need_grad=1),
            dict(dtype="bfloat16", D=32), dict(dtype="float16"), dict(dtype="float16", need_grad=1),
            dict(dtype="float32", D=64), dict(dtype="float32", D=64, need_grad=1),
            dict(dtype="float32", D=128, need_grad=1, causal=1), dict(dtype="bfloat16", gqa=1),
            dict(dtype="bfloat16", mask=1), dict(dtype="bfloat16", requested="flash"))
    for kw in keep:
        p = plan(isa=AVX2, **kw)
        assert p.chosen == "flash" and not p.note, kw
    for isa in range(len(ISAS)):
        if isa != AVX2:
            assert plan(dtype="bfloat16", isa=isa).chosen == "flash", ISAS[isa]
            assert plan(dtype="float32", D=128, need_grad=1, isa=isa).chosen == "flash", ISAS[isa]
    # and never what torch SDPA cannot serve
    for kw in (dict(softcap=1), dict(want_lse=1), dict(window=1)):
        assert plan(dtype="bfloat16", isa=AVX2, **kw).chosen == "flash", kw


INTEL, AMD = _planner.VENDOR_NAMES.index("Intel"), _planner.VENDOR_NAMES.index("AMD")


def test_torch_first_for_the_bfloat16_backward_on_amds_avx512_path():
    # measured on an AMD EPYC with AVX-512 and AVX512_BF16 (Zen 4): torch's bfloat16 forward+backward
    # faster than ours at D >= 128 with no causal mask; on Intel's AVX-512 CPU ours was 1.8x torch there
    for D in (128, 256):
        p = plan(dtype="bfloat16", D=D, need_grad=1, vendor=AMD)
        assert p.chosen == "sdpa" and p.order[:2] == ("sdpa", "flash"), D
        assert "bfloat16 forward+backward at D >= 128 on the avx512 path of an AMD CPU" in p.note
        assert p.call["cpu_vendor"] == "AMD"
        for mask in (1, 2):  # HF's padding masks too, bool or float (measured 0.72-0.98x torch's time there)
            assert plan(dtype="bfloat16", D=D, need_grad=1, vendor=AMD, mask=mask).chosen == "sdpa", (D, mask)
        # the forward only with a float mask (0.91-0.95x; with a bool one or none ours measured at par or faster)
        p = plan(dtype="bfloat16", D=D, vendor=AMD, mask=2)
        assert p.chosen == "sdpa" and "with a float attn_mask" in p.note, D
        for mask in (0, 1):
            assert plan(dtype="bfloat16", D=D, vendor=AMD, mask=mask).chosen == "flash", (D, mask)
        assert plan(dtype="bfloat16", D=D, vendor=AMD, mask=2, mask_grad=1).chosen == "flash", D
    # the same call elsewhere, and what measured at par or faster on that CPU, stays ours
    for kw in (dict(vendor=INTEL), dict(vendor=0), dict(isa=AVX2, vendor=AMD),
               dict(isa=ISAS.index("generic"), vendor=AMD), dict(D=64, vendor=AMD), dict(need_grad=0, vendor=AMD),
               dict(causal=1, vendor=AMD), dict(causal=2, vendor=AMD), dict(gqa=1, vendor=AMD),
               dict(mask=2, mask_grad=1, vendor=AMD), dict(dtype="float16", vendor=AMD),
               dict(requested="flash", vendor=AMD)):
        args = dict(dtype="bfloat16", D=128, need_grad=1)
        args.update(kw)
        p = plan(**args)
        assert p.chosen == "flash" and not p.note, kw
    for kw in (dict(softcap=1), dict(want_lse=1), dict(window=1), dict(dropout=1)):
        assert plan(dtype="bfloat16", D=128, need_grad=1, vendor=AMD, **kw).chosen == "flash", kw


def test_zen_5_keeps_our_avx512_kernels_where_zen_4_sent_calls_to_torch():
    # on a Zen 5 (AMD family 26: full-width AVX-512 units) our avx512 path measured 1.3-2.0x torch in every
    # avx512 torch-faster row (csrc/ab_registry.c amd_family_below), its avx2 path at parity (those rows hold)
    rows = (dict(dtype="float32", D=128), dict(dtype="float32", D=256), dict(dtype="bfloat16", D=128, need_grad=1),
            dict(dtype="bfloat16", D=256, need_grad=1, mask=1), dict(dtype="bfloat16", D=128, mask=2))
    for kw in rows:
        assert plan(vendor=AMD, family=25, **kw).chosen == "sdpa", kw
        for family in (26, 27):
            p = plan(vendor=AMD, family=family, **kw)
            assert p.chosen == "flash" and not p.note and p.call["cpu_family"] == family, (kw, family)
    # the float32 forward row holds for every family on the other makers' CPUs and on the other paths
    assert plan(dtype="float32", D=128, vendor=INTEL, family=26).chosen == "sdpa"
    assert plan(dtype="float32", D=128, vendor=0, family=26).chosen == "sdpa"
    for isa in range(len(ISAS)):
        if isa != ISAS.index("avx512"):
            assert plan(dtype="float32", D=128, vendor=AMD, family=26, isa=isa).chosen == "sdpa", ISAS[isa]
    assert plan(dtype="bfloat16", D=128, vendor=AMD, family=26, isa=AVX2).chosen == "sdpa"


def test_the_rows_measured_without_a_mask_leave_masked_calls_to_us():
    # a row holds for the mask kinds it was measured with: the avx2 path's bfloat16 forward with a float mask too
    # (test_torch_first_on_the_avx2_path_where_it_measured_faster), not with a bool one
    for kw, torch_masks in ((dict(dtype="float32", D=128), ()), (dict(dtype="bfloat16", D=64, isa=AVX2), (2,)),
                            (dict(dtype="float32", D=128, need_grad=1, isa=AVX2), ())):
        assert plan(**kw).chosen == "sdpa", kw
        for mask in (1, 2):
            assert plan(mask=mask, **kw).chosen == ("sdpa" if mask in torch_masks else "flash"), (kw, mask)


def test_decode_calls_keep_our_kernel_where_long_queries_go_to_torch():
    # the torch-faster classes were measured on long queries; a dense call of a few query tokens goes to the
    # decode kernel (csrc/cpu/flash_cpu.c), 0.58x torch's time in float32 MHA decode at D=128 on a Zen 4
    for kw in (dict(dtype="float32", D=128), dict(dtype="bfloat16", D=64, isa=AVX2)):
        assert plan(**kw).chosen == "sdpa", kw
        p = plan(few=1, square=0, **kw)
        assert p.chosen == "flash" and not p.note, kw
        assert "Sq <= 4 (decode)" in p.describe_call()
        # Dv != D: flash's tiles, not decode; and no torch row either, because torch's fused CPU kernel takes one
        # head dim and runs such a call on its math path (3.3x our flash's time at Sq=1 Sk=4096 H=32 D=128 Dv=64)
        assert plan(few=1, square=0, Dv=kw["D"] // 2, **kw).chosen == "flash", kw
    # a call that needs a gradient keeps flash's own forward (its backward reads the row statistics): the rows
    # measured with a backward still hold for it
    for kw in (dict(dtype="float32", D=128, need_grad=1, isa=AVX2),
               dict(dtype="bfloat16", D=128, need_grad=1, vendor=AMD)):
        assert plan(few=1, square=0, **kw).chosen == "sdpa", kw


@pytest.mark.parametrize("Sq", [1, 4, 5])
def test_few_queries_is_sq_up_to_four_on_both_paths(Sq, torch_first_path):
    # the Python path's descriptor and the fast path's agree (else the fast path would never serve the call)
    q, k = torch.randn(1, 4, Sq, 128), torch.randn(1, 4, 300, 128)
    plan_ = ab.explain(q, k, k)
    assert plan_.call["few_queries"] == (Sq <= _C.FEW_QUERIES) and _C.FEW_QUERIES == 4
    assert plan_.chosen == ("flash" if Sq <= 4 else "sdpa")  # float32 D=128 non-causal: torch for long queries
    ab.attention(q, k, k)
    before = _C.fast_calls()
    ab.attention(q, k, k)
    assert _C.fast_calls() - before == (Sq <= 4)  # the fast path serves our kernel's plans only


def test_this_process_plans_as_its_descriptor_says():
    # the planner end to end on this CPU's own path, vendor and family: what the described call plans (on a
    # Zen 5's avx512 path, ours for the float32 forward at D >= 128; torch SDPA on the CPUs the row holds on)
    q = torch.randn(1, 2, 8, 128)
    want = plan(D=128, isa=_C.cpu_isa_index(), vendor=_planner.CPU_VENDOR, family=_planner.CPU_FAMILY,
                units=_C.cpu_units())
    assert ab.explain(q, q, q).chosen == want.chosen and ab.explain(q, q, q).note == want.note


def test_the_vendor_reaches_the_call():
    assert _planner.new_call().cpu_vendor == _C.cpu_vendor()
    assert _planner.new_call().cpu_family == _C.cpu_features()["family"] == _planner.CPU_FAMILY
    expect = {"GenuineIntel": "Intel", "AuthenticAMD": "AMD"}.get(_C.cpu_features()["vendor"], "other")
    assert _planner.VENDOR_NAMES[_C.cpu_vendor()] == expect
    with pytest.raises(ValueError, match="out of range"):
        _C.plan(_planner.new_call(cpu_vendor=len(_planner.VENDOR_NAMES)))
    with pytest.raises(ValueError, match="out of range"):  # the mask kinds the torch-faster rows name: 0, 1, 2
        _C.plan(_planner.new_call(mask=3))


def test_torch_first_for_fma_calls_end_to_end(torch_first_path):
    q = torch.randn(1, 2, 8, 128)
    p = ab.explain(q, q, q)
    assert p.chosen == "sdpa" and p.note
    assert ab.explain(q, q, q, causal=True).chosen == "flash"
    # with a gradient: ours, but on the avx2 path, where torch's forward+backward measured faster at D >= 128
    on_avx2 = torch_first_path == "avx2"
    assert ab.explain(q.requires_grad_(), q, q).chosen == ("sdpa" if on_avx2 else "flash")
    qd = q.detach()
    assert ab.explain(qd[..., :64], qd[..., :64], qd[..., :64]).chosen == "flash"
    torch.testing.assert_close(ab.attention(qd, qd, qd), torch.nn.functional.scaled_dot_product_attention(qd, qd, qd))


def test_this_cpu_units_reach_the_plan():
    q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    p = ab.explain(q, q, q, causal=True)  # causal: no class of ab_torch_cpu_faster's, on any path
    assert p.call["cpu_units"] == tuple(n for i, n in enumerate(_planner.UNIT_NAMES) if _C.cpu_units() >> i & 1)
    assert (p.chosen == "sdpa") == bool(_C.cpu_units() & AMX_BF16)
    assert _C.cpu_features()["amx_state"]
    # one decode token: the decode kernel on the avx512 and amx paths, AMX or not (ab_planner.c decode_route)
    k = torch.randn(1, 2, 64, 16, dtype=torch.bfloat16)
    p = ab.explain(q[:, :, :1], k, k)
    assert (p.chosen == "sdpa") == (bool(_C.cpu_units() & AMX_BF16) and _C.cpu_isa() not in ("avx512", "amx"))


def test_report_says_when_auto_prefers_torch_on_this_cpu(monkeypatch):
    from attn_backends import _report

    monkeypatch.setattr(_planner, "CPU_UNITS", AMX_BF16)  # as on a Xeon with AMX
    assert "bfloat16 on AMX-BF16" in _report.auto_cpu_note(torch.bfloat16)
    assert _report.auto_cpu_note(torch.float16) == ""
    assert "auto, bfloat16" in _report.report()
    monkeypatch.setattr(_planner, "CPU_UNITS", 0)
    # without AMX only the avx2 path's measured class is left (ab_torch_cpu_faster)
    on_avx2 = _planner.ISA_NAMES[_planner.cpu_isa()] == "avx2"
    assert ("auto, bfloat16" in _report.report()) == on_avx2


def test_plans_follow_the_cpu_isa_switch():
    q = torch.randn(1, 2, 8, 16)
    before = _C.cpu_isa()
    try:
        assert _C.set_cpu_isa("generic")
        assert ab.explain(q, q, q).path == "cpu generic"
        assert ab.explain(q, q, q).call["cpu_isa"] == "generic"
    finally:
        _C.set_cpu_isa(before)
    assert ab.explain(q, q, q).path == f"cpu {before}"


@pytest.mark.parametrize("cc", [61, 75])
def test_old_gpus_route_to_torch_sdpa_then_eager(cc):
    p = plan(device=CUDA, cc=cc, lib=0)
    assert p.chosen == "sdpa"
    assert "compute capability >= 8.0" in p.reasons["math"]
    assert f"this GPU is {cc // 10}.{cc % 10}" in p.reasons["math"]
    # what sdpa cannot do (softcap, lse) goes to eager
    assert plan(device=CUDA, cc=cc, lib=0, softcap=1).chosen == "eager"
    assert plan(device=CUDA, cc=cc, lib=0, want_lse=1).chosen == "eager"
    # torch's own kernels keep their limits
    assert "compute capability >= 8.0" in plan(device=CUDA, cc=cc, dtype="float16", requested="_native_flash").reasons["_native_flash"]


@pytest.mark.parametrize("cc", [80, 86, 90])
def test_ampere_and_newer_use_our_kernels_for_what_they_serve(cc):
    # inference: sdpa first while our CUDA flash is opt-in (slower than torch's); our math serves lse calls exactly
    p = plan(device=CUDA, cc=cc, dtype="bfloat16")
    assert p.chosen == "sdpa" and p.reasons["flash"].startswith("the CUDA flash kernel is slower than torch's flash")
    assert plan(device=CUDA, cc=cc, want_lse=1).chosen == "math"
    assert plan(device=CUDA, cc=cc, softcap=1, requested="math").chosen == "math"
    # math on CUDA is forward only: training falls along its chain to eager
    p = plan(device=CUDA, cc=cc, softcap=1, need_grad=1, requested="math")
    assert p.chosen == "eager" and p.reasons["math"] == "forward only, and this call needs a gradient"


def test_build_without_cuda_library():
    p = plan(device=CUDA, cc=90, lib=0, want_lse=1)
    assert p.reasons["math"] == "the CUDA library is not built for compute capability 9.0"
    assert p.chosen == "eager"


def test_mps_padding_mask_in_evaluation_goes_to_eager(caplog):
    assert plan(device=MPS).chosen == "sdpa"
    p = plan(device=MPS, mask=1)
    assert p.chosen == "eager" and p.reasons["sdpa"].startswith("torch SDPA on MPS gives NaN")
    assert plan(device=MPS, mask=1, mps_fix=0).chosen == "sdpa"  # --disable_mps_fix
    assert plan(device=MPS, mask=1, need_grad=1).chosen == "sdpa"  # training is not affected
    assert plan(device=MPS, dtype="float64").chosen is None  # MPS has no float64 at all
    assert "no kernel for MPS" in plan(device=MPS, requested="math").reasons["math"]
    assert plan(device=MPS, requested="math").chosen == "eager"


@pytest.mark.parametrize("call", [dict(causal=2, square=0), dict(causal=2), dict(window=1), dict(causal=1, window=1)],
                         ids=["bottom_right", "bottom_right_square", "window", "top_left_window"])
def test_mps_calls_that_torch_sdpa_gets_as_a_mask_go_to_eager_in_evaluation(call):
    # the sdpa runner passes bottom-right causal and windows as an explicit bool mask (sdpa_mask), with rows
    # that see no key when Sq > Sk: they went to torch SDPA on MPS, where such a mask gives NaN
    p = plan(device=MPS, **call)
    assert p.chosen == "eager" and p.reasons["sdpa"].startswith("torch SDPA on MPS gives NaN")
    assert plan(device=MPS, mps_fix=0, **call).chosen == "sdpa"  # --disable_mps_fix
    assert plan(device=MPS, need_grad=1, **call).chosen == "sdpa"  # training is not affected
    assert plan(device=MPS, causal=1, square=0).chosen == "sdpa"  # top-left causal stays is_causal: no mask
    # the call as it arrives from a tensor: only the device is faked (a meta tensor read as MPS)
    from attn_backends import _dispatch

    q, k = torch.empty(1, 2, 8, 16, device="meta"), torch.empty(1, 2, 4, 16, device="meta")
    real = _dispatch._DEVICE_IDS
    try:
        _dispatch._DEVICE_IDS = {**real, "meta": MPS}
        assert ab.explain(q, k, k, causal="bottom_right").chosen == "eager"
        assert ab.explain(q, k, k, causal=True).chosen == "sdpa"
    finally:
        _dispatch._DEVICE_IDS = real


def test_other_devices_use_eager():
    p = plan(device=OTHER, mask=2, causal=1)
    assert p.chosen == "eager"
    assert p.order == ("eager",)


def test_forward_only_and_lossy_backends():
    _C.set_provider(_names.ID["sageattention_pkg"], True, "")
    ab._dispatch.reset_caches()
    try:
        p = plan(device=CUDA, cc=90, dtype="bfloat16", causal=1)
        assert p.chosen != "sageattention_pkg"
        assert "lossy" in p.reasons["sageattention_pkg"]
        assert plan(device=CUDA, cc=90, dtype="bfloat16", requested="sageattention_pkg").chosen == "sageattention_pkg"
        p = plan(device=CUDA, cc=90, dtype="bfloat16", need_grad=1, requested="sageattention_pkg")
        assert p.reasons["sageattention_pkg"] == "forward only, and this call needs a gradient"
        assert p.order[:3] == ("sageattention_pkg", "sage", "flash")
    finally:
        _planner._detect_providers()
        ab._dispatch.reset_caches()


def test_deterministic_mode_excludes_nondeterministic_backwards():
    p = plan(device=CUDA, cc=80, dtype="float16", need_grad=1, deterministic=1, requested="_native_efficient")
    assert "not deterministic" in p.reasons["_native_efficient"]
    assert p.chosen == "sdpa"
    assert plan(device=CUDA, cc=80, dtype="float16", need_grad=1, requested="_native_efficient").chosen == "_native_efficient"


def test_flash_attn_package_alignment_rule():
    _C.set_provider(_names.ID["flash_attn_pkg"], True, "")
    ab._dispatch.reset_caches()
    try:
        ok = plan(device=CUDA, cc=80, dtype="float16", causal=1, square=1, requested="flash_attn_pkg")
        assert ok.chosen == "flash_attn_pkg"
        bad = plan(device=CUDA, cc=80, dtype="float16", causal=1, square=0, requested="flash_attn_pkg")
        assert "bottom-right" in bad.reasons["flash_attn_pkg"]
        assert plan(device=CUDA, cc=80, dtype="float16", causal=2, square=0, requested="flash_attn_pkg").chosen == "flash_attn_pkg"
        assert "no float32" in plan(device=CUDA, cc=80, requested="flash_attn_pkg").reasons["flash_attn_pkg"]
        assert "head dim 512" in plan(device=CUDA, cc=80, dtype="float16", D=512, requested="flash_attn_pkg").reasons["flash_attn_pkg"]
    finally:
        _planner._detect_providers()
        ab._dispatch.reset_caches()


def test_reasons_cover_every_feature():
    p = plan(device=CUDA, cc=80, dtype="float16", mask=2, mask_grad=1, requested="_native_cudnn")
    assert p.reasons["_native_cudnn"] == "no float attn_mask support"
    assert "no sliding window" in plan(device=CUDA, cc=80, dtype="float16", window=1, requested="_native_cudnn").reasons["_native_cudnn"]
    assert "no dropout" in plan(device=CPU, dropout=1, requested="flex").reasons["flex"]
    assert "cannot return lse" in plan(want_lse=1, requested="sdpa").reasons["sdpa"]
    assert "no softcap" in plan(softcap=1, requested="sdpa").reasons["sdpa"]
    assert "gradient of a float attn_mask" in plan(mask=2, mask_grad=1, need_grad=1, requested="flex").reasons["flex"]
    assert "Dv 32 != D 64" in plan(Dv=32, requested="flex").reasons["flex"]
    assert "no grouped-query" in plan(device=CUDA, cc=80, gqa=1, requested="_native_efficient").reasons["_native_efficient"]
    assert "not a multiple of 8" in plan(device=CUDA, cc=80, D=36, requested="_native_efficient").reasons["_native_efficient"]


def test_named_backend_chains():
    assert plan(requested="_native_efficient").order[:2] == ("_native_efficient", "sdpa")
    assert plan(requested="_native_efficient").chosen == "sdpa"
    assert plan(requested="flex", dropout=1).chosen == "sdpa"
    assert plan(requested="sdpa", softcap=1).chosen == "flash"  # CPU: on to our kernels
    assert plan(requested="paged_attention").chosen == "flash"
    assert plan(requested="sage", need_grad=1).order[:3] == ("sage", "flash", "flash_varlen")
    assert plan(requested="flash_varlen").chosen == "flash"  # a dense call named for varlen
    assert plan(requested="eager", softcap=1, dropout=1, mask=2).chosen == "eager"


# ---- every accepted name on a real CPU call -----------------------------------------------------

CPU_CASE = Case(B=2, Hq=4, Hkv=2, Sq=9, Sk=13, D=16, causal="bottom_right", mask="bool_rows")


def _run(name, strict=False):
    def fn(q, k, v, mask, c):
        out = ab.attention(q, k, v, backend=name, causal=c.causal, attn_mask=mask, strict=strict)
        return out, None
    return fn


@pytest.mark.parametrize("name", _names.ALL_NAMES)
def test_every_name_serves_a_cpu_float32_call(name, caplog, gen):
    caplog.set_level(logging.INFO, logger="attn_backends")
    ab._dispatch.reset_caches()
    check_against_reference(CPU_CASE, _run(name), grad=True, check_lse=False, generator=gen)
    shapes = ((2, 4, 9, 16), (2, 2, 13, 16), (2, 2, 13, 16))
    p = ab.explain(*[torch.empty(s, requires_grad=True) for s in shapes], backend=name,
                   causal="bottom_right", attn_mask=torch.ones(2, 1, 9, 13, dtype=torch.bool))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    if p.requested in ("auto", p.chosen):
        assert not warnings
    else:
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        msg = warnings[0].getMessage()
        assert repr(p.requested) in msg and repr(p.chosen) in msg and p.reasons[p.requested] in msg


@pytest.mark.parametrize("name", _names.ALL_NAMES)
def test_strict_raises_for_names_that_cannot_serve(name, gen):
    q, k, v = (torch.randn(2, 4, 9, 16), torch.randn(2, 2, 13, 16), torch.randn(2, 2, 13, 16))
    p = ab.explain(q, k, v, backend=name, causal="bottom_right")
    if p.fell_back:
        with pytest.raises(RuntimeError, match="every backend and why not") as e:
            ab.attention(q, k, v, backend=name, causal="bottom_right", strict=True)
        for other in _names.CANONICAL[1:]:
            assert f"  {other}: " in str(e.value)
    else:
        ab.attention(q, k, v, backend=name, causal="bottom_right", strict=True)


def test_strict_from_the_environment():
    code = ("import attn_backends as ab, torch\n"
            "q = torch.randn(1, 1, 4, 8)\n"
            "try:\n    ab.attention(q, q, q, backend='paged_attention')\nexcept RuntimeError as e:\n    print('raised')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, ATTN_BACKENDS_STRICT="1"))
    assert "raised" in res.stdout, res.stderr


@pytest.mark.parametrize("value,on", [("1", True), ("TRUE", True), (" on ", True), ("yes", True), ("0", False),
                                      ("false", False), ("Off", False), ("no", False), ("", None), ("maybe", None)])
def test_on_off_variables_read_every_spelling_alike(value, on, monkeypatch, caplog):
    # 1/true/yes/on and 0/false/no/off, any case; unset, empty or anything else: the default, with a
    # warning for anything else (ATTN_BACKENDS_CUDA_DECODE=false used to leave the kernel on)
    monkeypatch.setenv("ATTN_BACKENDS_TEST_SWITCH", value)
    for default in (False, True):
        caplog.clear()
        assert _planner._env_switch("ATTN_BACKENDS_TEST_SWITCH", default) is (default if on is None else on)
        assert ("ignoring ATTN_BACKENDS_TEST_SWITCH" in caplog.text) is (value == "maybe")


def test_cuda_decode_off_from_the_environment_in_any_spelling():
    code = ("import attn_backends as ab\n"
            "print([b.devices for b in ab.backends() if b.name == 'paged_attention'][0])\n")
    for value, want in (("false", "('cpu',)"), ("no", "('cpu',)")):
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=dict(os.environ, ATTN_BACKENDS_CUDA_DECODE=value))
        assert res.stdout.strip() == want, (value, res.stdout, res.stderr)


def test_kv_cache_calls_on_cuda_go_to_torch_in_16_bit_types_where_it_reads_the_cache_in_place():
    # our CUDA decode kernel ran at 0.18-0.56x torch SDPA in bfloat16 on the GPU measured, 2.2-5.8x in
    # float32 (ab_planner.c torch_first_kv); mask 0: a KV-cache call torch reads in place
    on = os.environ.get("ATTN_BACKENDS_CUDA_DECODE", "1").strip().lower() not in ("0", "false", "no", "off")
    try:
        _C.enable_cuda_decode(True)
        ab._dispatch.reset_caches()
        kv = dict(device=CUDA, cc=90, varlen=2, gqa=1, causal=2, square=0)
        for dtype in ("bfloat16", "float16"):
            p = plan(dtype=dtype, **kv)
            assert p.chosen == "sdpa" and p.note.startswith("torch SDPA first: our CUDA decode kernel"), p.note
        # the kernel keeps float32, calls torch would need a mask for, lse, softcap, sinks, ALiBi, and
        # the calls that name it; the CPU is unchanged
        for other in (dict(dtype="float32"), dict(mask=1), dict(mask=2), dict(want_lse=1), dict(softcap=1),
                      dict(requested="paged_attention")):
            p = plan(**{**kv, "dtype": "bfloat16", **other})
            assert p.chosen == "paged_attention" and not p.note, other
        # named, sdpa serves what it reads in place, and leaves the rest to the kernel with its reason
        assert plan(**{**kv, "dtype": "bfloat16", "requested": "sdpa"}).chosen == "sdpa"
        # a causal call of several tokens (mask 2) too: only the CPU's chunked prefill takes torch's causal mask
        for other, why in ((dict(mask=1), "reads a KV cache only in place"),
                           (dict(mask=2), "causal only for one query token"), (dict(want_lse=1), "cannot return lse"),
                           (dict(softcap=1), "no softcap")):
            p = plan(**{**kv, "dtype": "bfloat16", "requested": "sdpa", **other})
            assert p.chosen == "paged_attention" and why in p.reasons["sdpa"], (other, p.reasons["sdpa"])
        # on the CPU it serves only chunked prefill (the decode kernel ran 5.6-34x faster than torch at 4096
        # keys; test_kv_cache_chunked_prefill_on_an_amx_cpu_goes_to_torch)
        p = plan(**{**kv, "device": CPU, "cc": 0, "dtype": "bfloat16", "requested": "sdpa"})
        assert p.chosen == "paged_attention" and "only from 256 query rows per KV head" in p.reasons["sdpa"]
        # off the CPU, torch never takes a causal call of several tokens over a mask (MPS without its fix, too)
        mps = dict(device=MPS, dtype="float16", varlen=2, gqa=1, causal=2, square=0, mask=2, mps_fix=0)
        assert plan(**mps).chosen == "eager"
        assert plan(**{**kv, "device": CPU, "cc": 0, "dtype": "bfloat16"}).chosen == "paged_attention"
        for extra in (dict(sinks=True), dict(alibi=True)):
            call = _planner.new_call(CUDA, 90, 1, DT["bfloat16"], 64, 64, True, False, 0, False, 2, False, False,
                                     False, False, False, False, 2, None, 0, None, None, 0, **extra)
            assert _planner.build(call).chosen == "paged_attention", extra
        # switched off, the gathered float64 path follows torch
        _C.enable_cuda_decode(False)
        ab._dispatch.reset_caches()  # plans are kept per call
        assert [b for b in plan(dtype="bfloat16", **kv).order][:2] == ["sdpa", "paged_attention"]
        assert plan(dtype="bfloat16", **{**kv, "mask": 1}).chosen == "eager"
    finally:
        _C.enable_cuda_decode(on)
        ab._dispatch.reset_caches()


def test_kv_cache_calls_on_mps_go_to_torch_sdpa_unless_they_need_a_mask():
    # torch's kernels are all MPS has; with a mask in evaluation torch SDPA gives NaN there (mps_fix)
    kv = dict(device=MPS, dtype="float16", varlen=2, gqa=1, causal=2, square=0)
    assert plan(**kv).chosen == "sdpa"
    assert plan(**{**kv, "mask": 1}).chosen == "eager"
    # torch reads a KV cache only in place, whatever the MPS rule says
    assert plan(**{**kv, "mask": 1, "mps_fix": 0}).chosen == "eager"
    assert plan(**{**kv, "want_lse": 1}).chosen == "eager"


def _run_with_isa(isa: str, code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, ATTN_BACKENDS_CPU_ISA=isa))


def test_cpu_isa_from_the_environment_reaches_kernels_plans_and_report():
    code = ("import attn_backends as ab, torch\n"
            "q = torch.randn(1, 1, 4, 8)\n"
            "print(ab._C.cpu_isa(), ab.explain(q, q, q).path, ab.attention(q, q, q, backend='flash').shape)\n"
            "from attn_backends._report import report\n"
            "print([l for l in report().splitlines() if 'CPU kernel path' in l][0])\n")
    res = _run_with_isa("generic", code)
    assert res.returncode == 0, res.stderr
    assert "generic cpu generic torch.Size([1, 1, 4, 8])" in res.stdout
    assert "CPU kernel path        generic" in res.stdout


def test_generic_isa_from_the_environment_reaches_every_answer():
    # ATTN_BACKENDS_CPU_ISA=generic: the C core's path is the one the report, the plans (their call,
    # their path, the report's backend rows) and the kernels use; Python keeps no copy of its own
    code = ("import attn_backends as ab, torch\n"
            "from attn_backends import _planner\n"
            "q = torch.randn(1, 1, 4, 8)\n"
            "p = ab.explain(q, q, q, backend='flash')\n"
            "print(_planner.ISA_NAMES[_planner.cpu_isa()], p.call['cpu_isa'], p.path, p.chosen)\n"
            "rows = {r.name: r for r in ab.backends()}\n"
            "print(rows['flash'].available, rows['flash_varlen'].available, rows['sage'].available)\n"
            "cu = torch.tensor([0, 4], dtype=torch.int32)\n"
            "pv = ab.attention_varlen(q[0].transpose(0, 1), q[0].transpose(0, 1), q[0].transpose(0, 1), cu, cu, 4, 4,"
            " backend='flash_varlen', strict=True)\n"
            "print(ab._C.sage_cpu_isa(), tuple(pv.shape))\n")
    res = _run_with_isa("generic", code)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "generic generic cpu generic flash", res.stdout
    assert lines[1] == "True True True", res.stdout
    assert lines[2] == "generic (4, 1, 8)", res.stdout


# (where the CPU has AMX the amx request is honoured instead: tests/test_amx.py)
@pytest.mark.parametrize("isa,why", [("amx", "ATTN_BACKENDS_CPU_ISA=amx: ")] * (not _C.cpu_isa_supported("amx"))
                         + [("avx9000", "unknown path")])
def test_cpu_isa_the_cpu_cannot_honour_is_a_clear_error(isa, why):
    code = ("import attn_backends as ab, torch\n"
            "q = torch.randn(1, 1, 4, 8)\n"
            "for b in ('flash', 'sage'):\n"
            "    try:\n        ab.attention(q, q, q, backend=b, strict=True)\n"
            "    except RuntimeError as e:\n        print('raised:', e)\n"
            "kc = torch.zeros(1, 16, 1, 8)\n"
            "try:\n    ab.attention_with_kvcache(q.transpose(1, 2)[:, :1], kc, kc, cache_seqlens=4,"
            " backend='paged_attention', strict=True)\n"
            "except RuntimeError as e:\n    print('raised:', e)\n"
            "print('math ok', ab.attention(q, q, q, backend='math').shape)\n"
            "from attn_backends._report import report\n"
            "print([l for l in report().splitlines() if 'CPU kernel error' in l][0])\n")
    res = _run_with_isa(isa, code)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("raised:") == 3 and why in res.stdout, res.stdout
    assert "math ok" in res.stdout  # the math kernel has no ISA paths
    if isa == "amx" and not _C.cpu_features()["amx_tile"]:
        assert _C.cpu_features()["amx_state"] in res.stdout


def test_one_warning_per_requested_chosen_reason(caplog):
    ab._dispatch.reset_caches()
    caplog.set_level(logging.INFO, logger="attn_backends")
    q = torch.randn(1, 2, 5, 8)
    for _ in range(3):
        ab.attention(q, q, q, backend="paged_attention")
    ab.attention(q, q, q[..., :4], backend="paged_attention")  # another signature, same (requested, chosen, reason)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    assert len(warnings) == 1
    assert len(infos) == 2 and all("flash serves" in r.getMessage() for r in infos)


def test_plans_are_cached_by_signature():
    q = torch.randn(1, 2, 5, 8)
    ab.attention(q, q, q, causal=True)
    n = len(_planner._plans)
    for S in (5, 6, 7):
        q = torch.randn(1, 2, S, 8)
        ab.attention(q, q, q, causal=True)
    assert len(_planner._plans) == n  # sequence length is not part of the signature


# ---- defaults: use(), environment ---------------------------------------------------------------

def test_use_sets_the_default_and_nests():
    q = torch.randn(1, 1, 4, 8)
    assert ab.explain(q, q, q).requested == "auto"
    with ab.use("flash_attention_2") as name:
        assert name == "flash"
        assert ab.explain(q, q, q).requested == "flash"
        with ab.use("sdpa"):
            assert ab.explain(q, q, q).requested == "sdpa"
            assert ab.explain(q, q, q, backend="math").requested == "math"  # explicit wins
        assert ab.explain(q, q, q).requested == "flash"
    assert ab.explain(q, q, q).requested == "auto"
    with pytest.raises(ValueError, match="unknown backend"):
        with ab.use("nope"):
            pass


def test_use_is_thread_local():
    q = torch.randn(1, 1, 4, 8)
    seen = {}
    barrier = threading.Barrier(3)

    def worker(name):
        with ab.use(name):
            barrier.wait()
            seen[name] = ab.explain(q, q, q).requested
            barrier.wait()

    threads = [threading.Thread(target=worker, args=(n,)) for n in ("math", "sdpa", "eager")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"math": "math", "sdpa": "sdpa", "eager": "eager"}


def test_default_backend_from_the_environment():
    code = ("import attn_backends as ab, torch\nq = torch.randn(1, 1, 4, 8)\n"
            "print(ab.explain(q, q, q).requested)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, ATTN_BACKENDS_BACKEND="Flash-Attn"))
    assert res.stdout.strip() == "flash", res.stderr


# ---- registry, explain, backends ----------------------------------------------------------------

def test_c_and_python_name_resolution_agree():
    for name in _names.ALL_NAMES:
        for typed in (name, name.upper(), name.replace("_", "-")):
            assert _C.lookup(typed) == ab.resolve(typed)
    assert _C.lookup("nope") is None


def test_explain_renders_a_table():
    q = torch.randn(2, 4, 9, 16)
    k = torch.randn(2, 2, 9, 16)
    p = ab.explain(q.double(), k.double(), k.double(), backend="flash", causal=True, softcap=5.0)
    text = str(p)
    assert "requested: flash" in text and "chosen:    math (cpu " in text
    for name in _names.CANONICAL[1:]:
        assert f"  {name} " in text
    assert "no: no float64 support here (supports float16, bfloat16, float32)" in text
    assert p.reasons["paged_attention"] and f"no: {p.reasons['paged_attention']}" in text
    assert "GQA" in text and "causal=top_left" in text and "softcap" in text


def test_backends_lists_every_backend():
    rows = ab.backends()
    assert [r.name for r in rows] == list(_names.CANONICAL)
    by = {r.name: r for r in rows}
    assert by["math"].available and by["math"].supports_backward and "cpu" in by["math"].devices
    assert by["eager"].available and set(by["eager"].devices) == {"cpu", "cuda", "mps", "other"}
    assert by["paged_attention"].available and not by["paged_attention"].supports_backward
    assert by["sage"].lossy and by["sageattention_pkg"].lossy
    assert not by["sageattention_pkg"].supports_backward
    assert by["flash"].aliases and "flash_attention_2" in by["flash"].aliases
    for r in rows:
        assert r.available or r.why_not, r


def test_report_says_flash_varlen_serves_packed_calls():
    # flash_varlen takes packed sequences only: the report asks it about a packed call, so it is
    # available, as attention_varlen(..., backend="flash_varlen", strict=True) shows
    from attn_backends._report import report

    row = {r.name: r for r in ab.backends()}["flash_varlen"]
    assert row.available and row.why_not == "" and row.devices == ("cpu",) and row.supports_backward
    q = torch.randn(9, 2, 16)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    assert ab.attention_varlen(q, q, q, cu, cu, 5, 5, backend="flash_varlen", strict=True).shape == (9, 2, 16)
    line = next(x for x in report().splitlines() if x.strip().startswith("flash_varlen "))
    assert "  available  " in line and "packed (varlen) calls only" in line and "no:" not in line, line
    # a dense call: explain says why it is not the one, and flash serves it
    d = torch.randn(1, 2, 5, 16)
    p = ab.explain(d, d, d, backend="flash_varlen")
    assert p.chosen == "flash" and p.reasons["flash_varlen"] == "takes packed (varlen) sequences only"
    with pytest.raises(RuntimeError, match="takes packed"):
        ab.attention(d, d, d, backend="flash_varlen", strict=True)
    # the KV-cache-only backend is asked about a KV-cache call the same way
    line = next(x for x in report().splitlines() if x.strip().startswith("paged_attention "))
    assert "  available  " in line and "KV-cache calls only" in line, line


def test_support_matrix_in_docs_is_generated_from_the_registry():
    from attn_backends._report import support_matrix_markdown

    path = os.path.join(os.path.dirname(__file__), "..", "docs", "backends.md")
    with open(path) as f:
        text = f.read()
    assert support_matrix_markdown() in text, "docs/backends.md is stale: run python docs/generate_backends.py"


@pytest.fixture
def cuda_flash_on():
    _C.enable_cuda_flash(True)
    ab._dispatch.reset_caches()
    yield
    _C.enable_cuda_flash(False)
    ab._dispatch.reset_caches()


def test_cuda_flash_opt_in_serves_what_it_supports(cuda_flash_on):
    # ATTN_BACKENDS_CUDA_FLASH=1: our flash forward first for half dtypes, D 32..256 by 8, sm_80+
    p = plan(device=CUDA, cc=90, dtype="bfloat16", causal=2, window=1, softcap=1, want_lse=1, gqa=1)
    assert p.chosen == "flash"
    assert plan(device=CUDA, cc=90, dtype="float16", varlen=1, causal=1).chosen == "flash_varlen"
    # what it does not serve goes down the chain, with the reason
    assert plan(device=CUDA, cc=90, dtype="float32").chosen != "flash"
    assert "float32" in plan(device=CUDA, cc=90, dtype="float32").reasons["flash"]
    assert plan(device=CUDA, cc=90, dtype="bfloat16", mask=1).chosen != "flash"
    assert plan(device=CUDA, cc=90, dtype="bfloat16", D=40).chosen == "flash"  # padded to 64 inside
    assert plan(device=CUDA, cc=90, dtype="bfloat16", D=36).chosen != "flash"  # not a multiple of 8
    assert plan(device=CUDA, cc=90, dtype="bfloat16", D=264).chosen != "flash"
    assert plan(device=CUDA, cc=90, dtype="bfloat16", D=64, Dv=32).chosen != "flash"
    assert plan(device=CUDA, cc=75, dtype="bfloat16").chosen != "flash"
    assert plan(device=CUDA, cc=90, lib=0, dtype="bfloat16").chosen != "flash"


def test_cuda_flash_opt_in_serves_training_dropout_and_deterministic(cuda_flash_on):
    # the CUDA flash backward (csrc/cuda/flash_bwd*.cu) and dropout, dense and packed
    for varlen, name in ((0, "flash"), (1, "flash_varlen")):
        p = plan(device=CUDA, cc=90, dtype="bfloat16", need_grad=1, dropout=1, causal=1, window=1, softcap=1,
                 gqa=1, varlen=varlen, D=128)
        assert p.chosen == name, p.reasons[name]
        assert plan(device=CUDA, cc=80, dtype="float16", need_grad=1, deterministic=1, varlen=varlen,
                    D=256).chosen == name
    # still nothing it does not have: masks, float32, Dv != D
    assert plan(device=CUDA, cc=90, dtype="bfloat16", need_grad=1, mask=2, mask_grad=1).chosen != "flash"
    assert plan(device=CUDA, cc=90, dtype="float32", need_grad=1).chosen != "flash"


SMEM_99K, SMEM_163K, SMEM_227K = 101376, 166912, 232448  # what sm_86/89/120, sm_80 and sm_90 report


@pytest.mark.parametrize("cc", [86, 89, 120])
def test_cuda_flash_backward_head_dims_on_99k_shared_memory_gpus(cuda_flash_on, cc):
    # the backward's tiles for D > 128 need more than the 99 KiB a block gets on these GPUs (as the
    # device reports it): the planner falls back for training there, and serves inference (the
    # forward's largest tile, 101376 bytes, fits exactly) and D <= 128
    big = plan(device=CUDA, cc=cc, smem=SMEM_99K, dtype="bfloat16", need_grad=1, D=192)
    assert big.chosen != "flash"
    assert ("flash backward on CUDA: head dim 192 needs 121344 bytes of shared memory per block, this device "
            "allows 101376") in big.reasons["flash"]
    assert plan(device=CUDA, cc=cc, smem=SMEM_99K, dtype="bfloat16", need_grad=0, D=256).chosen == "flash"
    assert plan(device=CUDA, cc=cc, smem=SMEM_99K, dtype="bfloat16", need_grad=1, D=128).chosen == "flash"
    assert plan(device=CUDA, cc=90, smem=SMEM_227K, dtype="bfloat16", need_grad=1, D=256).chosen == "flash"


def test_cuda_kernels_are_weighed_against_the_shared_memory_the_device_reports(cuda_flash_on):
    # the rule is the device's answer, not a list of compute capabilities: the same sm_90 with less
    # shared memory is refused what does not fit, and one never asked (0) is not weighed
    for smem, fits in ((SMEM_227K, True), (SMEM_163K, True), (SMEM_99K, False), (0, True)):
        p = plan(device=CUDA, cc=90, smem=smem, dtype="float16", need_grad=1, D=256)
        assert (p.chosen == "flash") == fits, (smem, p.reasons["flash"])
    p = plan(device=CUDA, cc=90, smem=90000, dtype="float16", D=256)  # the forward's 101376 bytes
    assert p.chosen != "flash" and "head dim 256 needs 101376 bytes" in p.reasons["flash"]
    # sage's tiles are smaller: its D = 256 needs 69376 bytes
    _C.enable_cuda_sage(True)
    ab._dispatch.reset_caches()
    try:
        assert plan(device=CUDA, cc=90, smem=90000, dtype="float16", D=256, requested="sage").chosen == "sage"
        p = plan(device=CUDA, cc=90, smem=60000, dtype="float16", D=256, requested="sage")
        assert "sage on CUDA: head dim 256 needs 69376 bytes" in p.reasons["sage"]
    finally:
        _C.enable_cuda_sage(os.environ.get("ATTN_BACKENDS_CUDA_SAGE", "0") == "1")
        ab._dispatch.reset_caches()


def test_cuda_head_dims_are_the_launchers_rule(cuda_flash_on):
    # multiples of 8 up to 256, each padded up to a kernel's head dim (8, 16 and 24 run the 32 kernel);
    # the registry used to say 32..256 while the launcher took any multiple of 8
    for D in (8, 16, 24, 40, 256):
        assert plan(device=CUDA, cc=90, smem=SMEM_227K, dtype="bfloat16", D=D).chosen == "flash", D
    for D in (4, 36, 264):
        p = plan(device=CUDA, cc=90, smem=SMEM_227K, dtype="bfloat16", D=D)
        assert p.chosen != "flash" and "head dim" in p.reasons["flash"], D
    caps = {r[0]: r for r in _C.backend_table()}["flash"][6][CUDA]  # the table now, with the opt-in on
    assert caps[0] is None and caps[3:6] == (8, 256, 8)  # min, max, multiple: the launchers' numbers


def test_cpu_flash_dtype_rule_is_the_kernels():
    # the registry's CPU dtypes for flash and flash_varlen and the kernel family's own answer agree
    for name in ("flash", "flash_varlen"):
        dtypes = {r[0]: r for r in _C.backend_table()}[name][6][CPU][1]
        for dt in DT:
            p = plan(device=CPU, dtype=dt, varlen=int(name == "flash_varlen"), requested=name)
            assert (p.reasons[name] == "") == (dt in dtypes), (name, dt, p.reasons[name])


def test_cuda_math_backward_is_opt_in_with_the_cuda_kernels(cuda_flash_on):
    # csrc/cuda/math_bwd.cu is unverified like the flash kernels, so the same switch serves it
    p = plan(device=CUDA, cc=90, dtype="float64", need_grad=1, mask=2, mask_grad=1, dropout=1, requested="math")
    assert p.chosen == "math", p.reasons["math"]
    _C.enable_cuda_flash(False)
    ab._dispatch.reset_caches()
    p = plan(device=CUDA, cc=90, dtype="float64", need_grad=1, requested="math")
    assert p.chosen != "math" and "gradient" in p.reasons["math"]
    assert plan(device=CUDA, cc=90, dtype="float64", requested="math").chosen == "math"  # the forward stays


def test_deterministic_argument_reaches_the_planner():
    q, k, v = (torch.randn(1, 2, 8, 16, requires_grad=True) for _ in range(3))
    assert ab.explain(q, k, v, deterministic=True).call["deterministic"]
    assert not ab.explain(q, k, v).call["deterministic"]
    # on the CPU every kernel is deterministic: the same gradients, bit for bit
    grads = []
    for det in (False, True):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        ab.attention(qq, kk, vv, causal=True, deterministic=det).sum().backward()
        grads.append(torch.cat([t.grad.flatten() for t in (qq, kk, vv)]))
    assert torch.equal(grads[0], grads[1])


@pytest.fixture
def cuda_sage_on():
    _C.enable_cuda_sage(True)
    ab._dispatch.reset_caches()
    yield
    _C.enable_cuda_sage(False)
    ab._dispatch.reset_caches()


def test_cuda_sage_is_opt_in():
    # without ATTN_BACKENDS_CUDA_SAGE=1, a named sage on CUDA falls back along its chain, saying why
    p = plan(device=CUDA, cc=90, dtype="bfloat16", requested="sage")
    assert p.chosen != "sage" and "ATTN_BACKENDS_CUDA_SAGE=1" in p.reasons["sage"]


def test_cuda_sage_opt_in_serves_inference_only(cuda_sage_on):
    # ATTN_BACKENDS_CUDA_SAGE=1: named sage on CUDA serves half dtypes, D 32..256 by 8, sm_80+, dense
    # and packed, causal both ways, window, softcap, GQA, lse -- when no gradient is needed
    p = plan(device=CUDA, cc=80, dtype="bfloat16", causal=2, window=1, softcap=1, want_lse=1, gqa=1,
             requested="sage")
    assert p.chosen == "sage"
    assert plan(device=CUDA, cc=90, dtype="float16", varlen=1, causal=1, requested="sage").chosen == "sage"
    assert plan(device=CUDA, cc=90, dtype="bfloat16", D=40, requested="sage").chosen == "sage"  # padded to 64
    # lossy: auto never picks it, whatever else is on
    p = plan(device=CUDA, cc=90, dtype="bfloat16")
    assert p.chosen != "sage" and "lossy" in p.reasons["sage"]
    # forward only: a call needing a gradient goes down the chain (sage -> flash -> ...), with the reason
    p = plan(device=CUDA, cc=90, dtype="bfloat16", need_grad=1, requested="sage")
    assert p.chosen != "sage" and p.reasons["sage"] == "forward only, and this call needs a gradient"
    assert p.order[:2] == ("sage", "flash")
    # what the CUDA kernel does not serve falls back too, each with its reason
    for kw, why in ((dict(dtype="float32"), "float32"), (dict(dtype="bfloat16", mask=1), "attn_mask"),
                    (dict(dtype="bfloat16", mask=2), "attn_mask"), (dict(dtype="bfloat16", dropout=1), "dropout"),
                    (dict(dtype="bfloat16", D=36), "multiple of 8"), (dict(dtype="bfloat16", D=264), "head dim"),
                    (dict(dtype="bfloat16", D=64, Dv=32), "value head dim"),
                    (dict(dtype="bfloat16", cc=75), "compute capability"),
                    (dict(dtype="bfloat16", lib=0), "not built for")):
        kw.setdefault("cc", 90)
        p = plan(device=CUDA, requested="sage", **kw)
        assert p.chosen != "sage" and why in p.reasons["sage"], (kw, p.reasons["sage"])
    # the CPU row is untouched: masks and float32 are served there
    assert plan(device=CPU, mask=1, requested="sage").chosen == "sage"


def test_cuda_sage_switch_leaves_cuda_flash_alone(cuda_sage_on):
    # each unverified CUDA kernel has its own switch
    assert plan(device=CUDA, cc=90, dtype="bfloat16", requested="flash").chosen != "flash"


def test_cuda_sage_stays_forward_only_beside_the_cuda_flash_backward(cuda_flash_on, cuda_sage_on):
    # both switches on: flash serves training and dropout on CUDA, sage still neither
    p = plan(device=CUDA, cc=90, dtype="bfloat16", need_grad=1, requested="sage")
    assert p.chosen == "flash" and p.reasons["sage"] == "forward only, and this call needs a gradient"
    p = plan(device=CUDA, cc=90, dtype="bfloat16", dropout=1, requested="sage")
    assert p.chosen == "flash" and "dropout" in p.reasons["sage"]
    assert plan(device=CUDA, cc=90, dtype="bfloat16", requested="sage").chosen == "sage"


# ---- the call descriptor -------------------------------------------------------------------------

def test_the_call_descriptor_is_read_by_field_name():
    q = torch.randn(2, 4, 5, 16)
    k = torch.randn(2, 2, 7, 16)
    _, call = ab._dispatch.prepare(q, k, k, "math", "bottom_right", None, 0.0, None, (3, 0), 0.0, True)
    assert isinstance(call, _C.Call)
    assert _planner.FIELDS == _C.call_fields() and len(call) == len(_planner.FIELDS)
    assert (call.device, call.dtype, call.D, call.gqa, call.square, call.causal, call.window, call.want_lse,
            call.requested) == (_planner.DEVICE_IDS["cpu"], _planner.DTYPE_IDS[torch.float32], 16, 1, 0, 2, 1, 1,
                                _names.ID["math"])
    d = _planner.describe(call)
    assert d["device"] == "cpu" and d["dtype"] == "float32" and d["causal"] == "bottom_right"
    assert ab.explain(q, k, k, backend="math", causal="bottom_right", window=(3, 0), return_lse=True).call == d


def test_the_enums_come_from_the_c_core():
    names = _C.enum_names()
    assert _planner.DEVICE_NAMES == names["device"] == ("cpu", "cuda", "mps", "other")
    assert _planner.DTYPE_NAMES == names["dtype"] == ("float32", "float16", "bfloat16", "float64")
    assert _planner.CAUSAL_NAMES == names["causal"] and _planner.ISA_NAMES == names["cpu_isa"]
    assert _C.cpu_isa() == _planner.ISA_NAMES[_C.cpu_isa_index()]


def test_a_malformed_call_descriptor_is_refused():
    with pytest.raises(TypeError, match="Call"):
        _C.plan((0,) * (len(_planner.FIELDS) - 2))  # a signature of the old, shorter layout
    with pytest.raises(ValueError, match="out of range"):
        _C.plan(_planner.new_call(device=9))


def test_auto_keeps_our_kernel_for_dv_other_than_d():
    # torch's fused CPU kernel takes one head dim for q, k and v; with Dv != D torch runs its math path (2.8x our
    # flash's time, float32 D=128 Dv=64), where auto's "torch faster" rows sent the call
    q, k = torch.randn(1, 2, 64, 128), torch.randn(1, 2, 64, 128)
    v = torch.randn(1, 2, 64, 64)
    assert int(torch._fused_sdp_choice(q, k, v)) == 0  # torch: math
    assert ab.explain(q, k, v).chosen == "flash"


def _chunked_prefill(**fields):
    """The plan of a bfloat16 KV-cache call on the avx2 path of a CPU with AMX-BF16 (a path whose decode kernel leaves
    the tiles unused), bottom-right causal over many query rows (many_rows; mask 2: only a causal mask of its
    sizes), with fields replaced."""
    kw = dict(device=CPU, dtype=DT["bfloat16"], gqa=True, square=False, mask=2, causal=2, varlen=2, cpu_isa=1,
              cpu_units=AMX_BF16, many_rows=True, cpu_vendor=1, cpu_family=6)
    kw.update(fields)
    return _planner.build(_planner.new_call(**kw))


def test_kv_cache_chunked_prefill_goes_to_torch_where_our_decode_kernel_leaves_amx_unused():
    # from 256 query rows per KV head and 32 tokens (many_rows) a KV-cache call in bfloat16 goes to torch SDPA on
    # a CPU where torch computes bfloat16 on AMX and our decode kernel does not (ab_planner.c torch_first_kv): the
    # generic and avx2 paths, and amx_emu (emulated tiles); there the kernel took 2.2-3x torch's time (docs/decode.md,
    # "Chunked prefill on an AMX CPU").  The avx512 and amx paths take such calls on the tiles
    # (ab_our_kv_cpu_units), 1.02-3x torch's speed: the kernel keeps them, named sdpa or not
    for isa in (0, 4):
        assert _chunked_prefill(cpu_isa=isa).chosen == "sdpa", isa
    for isa in (2, 3):
        p = _chunked_prefill(cpu_isa=isa)
        assert p.chosen == "paged_attention" and not p.note, isa
        p = _chunked_prefill(cpu_isa=isa, requested=_names.ID["sdpa"])
        assert p.chosen == "paged_attention" and "that our decode kernel leaves unused" in p.reasons["sdpa"], isa
    p = _chunked_prefill()
    assert p.chosen == "sdpa" and p.order[:2] == ("sdpa", "paged_attention")
    assert p.note.startswith("torch SDPA first: from 256 query rows per KV head and 32 tokens it computes bfloat16 "
                             "on AMX-BF16"), p.note
    assert _chunked_prefill(mask=0, causal=0).chosen == "sdpa"  # several tokens without causal: no mask at all
    # the kernel keeps decode and short chunks, float32 and float16 (no unit of torch's for them here), CPUs
    # without AMX-BF16, calls torch would need the index values or a mask for, and lse, softcap, sinks, ALiBi
    for other in (dict(many_rows=False), dict(dtype=DT["float32"]), dict(dtype=DT["float16"]), dict(cpu_units=0),
                  dict(cpu_units=AMX_INT8), dict(mask=1), dict(window=True, mask=1), dict(want_lse=True),
                  dict(softcap=True), dict(sinks=True), dict(alibi=True)):
        p = _chunked_prefill(**other)
        assert p.chosen == "paged_attention" and not p.note, other
    # named (or the process default), sdpa serves the same calls and leaves the rest to the kernel with its reason:
    # a process default of sdpa does not send decode steps, or chunked prefill the kernel serves faster, to torch
    assert _chunked_prefill(requested=_names.ID["sdpa"]).chosen == "sdpa"
    for other in (dict(many_rows=False), dict(dtype=DT["float32"]), dict(cpu_units=0)):
        p = _chunked_prefill(requested=_names.ID["sdpa"], **other)
        assert p.chosen == "paged_attention", other
        assert "only from 256 query rows per KV head and 32 tokens, in bfloat16 on AMX-BF16" in p.reasons["sdpa"], other
