"""The CUDA emulator itself (csrc/cuda/emu, docs/cuda.md; marked `cuda_emu`): that it catches what it
exists to catch (an out-of-range store or ldmatrix, named by kernel, thread and offset; a misaligned
vector store; a missing
__syncthreads; a read of cp.async'd memory before the wait), that every kernel variant the launcher
tables can select runs under it and passes the float64 rule, that the switch routes through the
normal op path (planner, explain, report) and that without it nothing changes.  The kernels'
correctness on the test grid is in test_cuda.py and test_sage_cuda.py (their "emu" cases)."""

import ctypes
import math
import os
import subprocess
import sys

import pytest
import torch

import attn_backends as ab
from attn_backends._ops import ops
from attn_backends._testing import check_2x, check_out_and_grads_2x, keep_mask_for_next_call, reference_attention

from cuda_devices import cuda_kernels, emulator, launched, set_emulation
from test_sage import check_sage

pytestmark = pytest.mark.cuda_emu


@pytest.fixture
def emu():
    with cuda_kernels():
        lib = emulator()
        lib.ab_cuda_emu_reset_launch_log()
        try:
            yield lib
        finally:
            lib.ab_cuda_emu_set_device_cc(80)


def selftest(lib, which):
    msg = ctypes.create_string_buffer(2048)
    return lib.ab_cuda_emu_selftest(which.encode(), msg, len(msg)), msg.value.decode()


def test_an_out_of_range_store_fails_the_call_naming_kernel_thread_and_offset(emu):
    wrong, msg = selftest(emu, "oob_store")  # 129 threads store into 128 floats
    assert wrong == -1
    assert "oob_store" in msg and "thread 128" in msg and "element 128" in msg and "'out'" in msg, msg
    assert "past its end" in msg, msg


def test_a_misaligned_vector_store_fails_the_call(emu):
    # x86 would store a uint4 at a 4-byte boundary; a GPU refuses, and so does the emulator
    wrong, msg = selftest(emu, "misaligned_store")
    assert wrong == -1 and "misaligned_store" in msg and "misaligned" in msg and "thread" in msg, msg


def test_an_out_of_range_ldmatrix_fails_the_call(emu):
    wrong, msg = selftest(emu, "ldmatrix_past_end")
    assert wrong == -1 and "ldmatrix" in msg and "offset 512" in msg and "out of range" in msg, msg


def test_a_launch_over_48k_of_shared_memory_needs_the_attribute(emu):
    wrong, msg = selftest(emu, "smem_over_48k_unset")
    assert wrong == -1 and "65536 bytes of dynamic shared memory" in msg and "cudaFuncSetAttribute" in msg, msg


def test_a_missing_syncthreads_shows_up_as_wrong_values(emu):
    # warps run in a random order between barriers: without one, some read before the write
    assert selftest(emu, "exchange")[0] > 0
    assert selftest(emu, "exchange_synced") == (0, "")


def test_cp_async_lands_at_the_wait(emu):
    assert selftest(emu, "copy_then_read")[0] == 128  # read before the wait: stale (0xff) shared memory
    assert selftest(emu, "copy_wait_read") == (0, "")


def _check(q, k, v, out, lse, **opts):
    r_out, r_lse = reference_attention(*(t.double() for t in (q, k, v)), **opts)
    d_out, d_lse = reference_attention(q, k, v, dtype=q.dtype, **opts)
    check_2x("out", out, r_out, d_out, 2, q.dtype)
    check_2x("lse", lse, r_lse, d_lse, 2, q.dtype)


HALF = (torch.float16, torch.bfloat16)
DT_NAME = {torch.float16: "__half", torch.bfloat16: "__nv_bfloat16", torch.float32: "float", torch.float64: "double"}


def test_every_kernel_variant_runs_and_matches_the_reference(emu, gen):
    # every (dtype, padded head dim, dropout) the launchers' tables select, on one small problem each
    expect = set()
    for dt in HALF:
        T = DT_NAME[dt]
        for D in (32, 64, 96, 128, 160, 192, 224, 256):  # flash forward, with and without dropout
            q, k, v = (torch.randn(1, 2, 20, D, generator=gen).to(dt) for _ in range(3))
            out, lse = ab.attention(q, k, v, backend="flash", causal=True, return_lse=True, strict=True)
            _check(q, k, v, out, lse, causal=True)
            keep = keep_mask_for_next_call(7, 1, 2, 20, 20, 0.2)
            torch.manual_seed(7)
            out = ab.attention(q, k, v, backend="flash", dropout_p=0.2, strict=True)
            r_out, _ = reference_attention(q.double(), k.double(), v.double(), keep=keep, dropout_p=0.2)
            d_out, _ = reference_attention(q, k, v, dtype=dt, keep=keep, dropout_p=0.2)
            check_2x("out", out, r_out, d_out, 2, dt)
            bm = 128 if D <= 128 else 64
            expect.add(f"fwd_launch_config<T = {T}, int kD = {D}, int kBM = {bm}, int kBN = 64, bool kDropout = false>")
            expect.add(f"fwd_launch_config<T = {T}, int kD = {D}, int kBM = 64, int kBN = 64, bool kDropout = true>")
        for D in (64, 128, 192, 256):  # flash backward: dK/dV (+ atomic dQ), deterministic dQ
            q, k, v = (torch.randn(1, 2, 20, D, generator=gen).to(dt).requires_grad_() for _ in range(3))
            g = torch.randn(1, 2, 20, D, generator=gen).to(dt)
            for det in (False, True):
                out = ab.attention(q, k, v, backend="flash", causal=True, strict=True, deterministic=det)
                grads = torch.autograd.grad(out, (q, k, v), g)
                check_out_and_grads_2x(out, grads, (q, k, v), g, dt, causal=True)
            expect.add(f"bwd_launch<T = {T}, int kD = {D}>: delta")
            expect.add(f"bwd_launch<T = {T}, int kD = {D}>: dkv")
            expect.add(f"bwd_launch<T = {T}, int kD = {D}>: dq")
        expect.add(f"run<T = {T}>: convert_kernel<T>")
        for D in (64, 128, 256):  # sage: the K prepass and the attention kernel
            q, k, v = (torch.randn(1, 2, 20, D, generator=gen).to(dt) for _ in range(3))
            out, lse = ab.attention(q, k, v, backend="sage", return_lse=True, strict=True)
            check_sage(out, lse, q, k, v)
            for kernel in ("k_stats_kernel<T, kD>", "k_finalize_kernel<kD>", "k_quant_kernel<T, kD>", "kernel"):
                expect.add(f"sage_launch<T = {T}, int kD = {D}>: {kernel}")
    for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64):  # math, forward and backward
        q, k, v = (torch.randn(1, 2, 9, 16, generator=gen).to(dt).requires_grad_() for _ in range(3))
        out, lse = ab.attention(q, k, v, backend="math", return_lse=True, strict=True)
        g = torch.randn(out.shape, generator=gen).to(dt)
        check_out_and_grads_2x(out, torch.autograd.grad(out, (q, k, v), g), (q, k, v), g, dt)
        acc = "double" if dt == torch.float64 else "float"
        expect.add(f"launch<T = {DT_NAME[dt]}, Acc = {acc}>: math_fwd_kernel<T, Acc>")
        expect.add(f"launch<T = {DT_NAME[dt]}, Acc = {acc}>: dq_kernel<T, Acc>")
        expect.add(f"launch<T = {DT_NAME[dt]}, Acc = {acc}>: dkv_kernel<T, Acc>")
    ops.dropout_mask(torch.tensor([1, 2]), 1, 1, 3, 5, 0.5)
    expect.add("ab_cuda_dropout_mask: mask_kernel")
    ran = launched(emu)
    missing = sorted(e for e in expect if not any(e in label for label in ran))
    assert not missing, f"not launched: {missing}\nlaunched: {sorted(ran)}"


def test_a_device_with_less_shared_memory_makes_the_launcher_refuse(emu):
    # sm_86 gives a block 99 KiB: the flash backward at head dim 192 needs 119 KiB (flash_bwd.cuh)
    emu.ab_cuda_emu_set_device_cc(86)
    q, k, v = (torch.randn(1, 1, 8, 192, dtype=torch.float16) for _ in range(3))
    out, lse, _ = ops.flash_fwd(q, k, v, None, None, 0, 0.1, -1, -1, 0.0, 0.0)  # 75 KiB: fits
    _check(q, k, v, out, lse, scale=0.1)
    with pytest.raises(RuntimeError, match="head dim 192 needs 121344 bytes of shared memory per block, this "
                                           "device allows 101376"):
        ops.flash_bwd(out, q, k, v, out, lse, None, None, None, 0, 0.1, -1, -1, 0.0, 0.0, False, False)


def test_the_planner_weighs_the_emulated_devices_shared_memory(emu):
    # the planner asks the device (here the emulated one) how much shared memory a block gets, and the
    # launchers' configs (csrc/cuda/ab_cuda_limits.h) how much they need: on an emulated sm_86 the
    # backward at head dim 192 does not fit and training goes elsewhere, before any launch refuses it
    q = torch.randn(1, 1, 8, 192, dtype=torch.bfloat16, requires_grad=True)
    ab._dispatch.reset_caches()
    try:
        assert ab.explain(q, q, q, backend="flash").chosen == "flash"  # sm_80: 163 KiB
        emu.ab_cuda_emu_set_device_cc(86)
        ab._dispatch.reset_caches()
        p = ab.explain(q, q, q, backend="flash")
        assert p.chosen != "flash"
        assert "head dim 192 needs 121344 bytes of shared memory per block, this device allows 101376" in \
            p.reasons["flash"], p.reasons["flash"]
        with torch.no_grad():
            assert ab.explain(q, q, q, backend="flash").chosen == "flash"  # the forward's 75 KiB fit
    finally:
        ab._dispatch.reset_caches()


def test_a_faulting_call_leaves_the_planners_device_queries_working(emu):
    # a kernel fault made the emulated device sticky past the end of its call, so the planner's query of
    # its shared memory failed and read as "not known": after a faulting self-test, the emulated sm_86
    # still planned the backward at head dim 192 on flash (test_the_planner_weighs_... failed when run
    # after one)
    assert selftest(emu, "oob_store")[0] == -1
    q = torch.randn(1, 1, 8, 192, dtype=torch.bfloat16, requires_grad=True)
    emu.ab_cuda_emu_set_device_cc(86)
    ab._dispatch.reset_caches()
    try:
        assert "this device allows 101376" in ab.explain(q, q, q, backend="flash").reasons["flash"]
    finally:
        ab._dispatch.reset_caches()


def test_the_switch_routes_through_the_planner_and_says_so(emu):
    q, k, v = (torch.randn(1, 2, 20, 64, dtype=torch.bfloat16) for _ in range(3))
    plan = ab.explain(q, k, v, backend="flash")
    assert plan.chosen == "flash" and plan.path == "cuda emulated on cpu", str(plan)
    assert "cuda emulated on cpu" in str(plan)
    # the emulated device serves what a GPU does: flash has no float32, so math serves it there
    plan = ab.explain(q.float(), k.float(), v.float(), backend="flash")
    assert plan.chosen == "math" and plan.path == "cuda emulated on cpu", str(plan)
    assert "no float32 support" in plan.reasons["flash"]
    emu.ab_cuda_emu_reset_launch_log()
    ab.attention(q, k, v, backend="flash", strict=True)
    assert any("fwd_launch_config" in label for label in launched(emu))
    # eager runs the math kernel on the CPU: the emulated one
    assert ab.explain(q, k, v, backend="eager").path == "cuda emulated on cpu"
    emu.ab_cuda_emu_reset_launch_log()
    ab.attention(q, k, v, backend="eager", strict=True)
    assert any("math_fwd_kernel" in label for label in launched(emu))


def test_without_the_switch_nothing_changes(emu):
    set_emulation(False)
    q, k, v = (torch.randn(1, 2, 20, 64, dtype=torch.bfloat16) for _ in range(3))
    plan = ab.explain(q, k, v, backend="flash")
    assert plan.chosen == "flash" and plan.path.startswith("cpu "), str(plan)
    assert ab.explain(q.float(), k.float(), v.float(), backend="flash").chosen == "flash"  # the CPU kernel
    emu.ab_cuda_emu_reset_launch_log()
    ab.attention(q, k, v, backend="flash", strict=True)
    ab.attention(q, k, v, backend="math", strict=True)
    assert launched(emu) == {}


def test_the_environment_variable_turns_it_on_and_the_report_says_so():
    env = dict(os.environ, ATTN_BACKENDS_CUDA_EMULATE="1")
    code = ("import torch, attn_backends as ab, attn_backends._report as r\n"
            "q = torch.randn(1, 1, 8, 32, dtype=torch.float16)\n"
            "print(ab.explain(q, q, q, backend='flash').path)\n"
            "print(r.report())\n")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "cuda emulated on cpu"
    setting = [line.split(None, 2)[2] for line in lines if line.split()[:2] == ["CUDA", "emulation"]]
    assert setting == ["True (ATTN_BACKENDS_CUDA_EMULATE): CPU tensors of flash, flash_varlen, sage, math and "
                       "paged_attention run the CUDA kernels on the emulator"], res.stdout
    assert any(line.split()[:2] == ["CUDA", "emulator"] and line.endswith("libattn_backends_cuda_emu.so")
               for line in lines), res.stdout



def test_settings_that_are_not_integers_keep_the_defaults_and_say_so():
    # strtoull read "junk" as 0: seed 0 and compute capability 0 (48 KiB of shared memory), without a word
    env = dict(os.environ, ATTN_BACKENDS_CUDA_EMULATE="1", ATTN_BACKENDS_CUDA_EMULATE_SEED="junk",
               ATTN_BACKENDS_CUDA_EMULATE_SM="8x")
    code = ("import torch, attn_backends as ab\n"
            "q = torch.randn(1, 2, 20, 64, dtype=torch.bfloat16)\n"
            "ref = ab.attention(q.double(), q.double(), q.double(), backend='math')\n"
            "out = ab.attention(q, q, q, backend='flash', strict=True)\n"
            "print(float((out.double() - ref).abs().max()))\n")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert float(res.stdout.split()[-1]) < 2e-2, res.stdout
    for name, value in (("ATTN_BACKENDS_CUDA_EMULATE_SEED", "junk"), ("ATTN_BACKENDS_CUDA_EMULATE_SM", "8x")):
        assert f"{name}={value} is not a non-negative integer; the default is kept" in res.stderr, res.stderr

def test_fully_masked_rows_and_nan_stay_where_they_are(emu):
    # the epilogue's special cases through the emulated kernels: no visible key -> 0 and lse -inf
    q = torch.randn(1, 2, 40, 64, dtype=torch.float16)
    k, v = (torch.randn(1, 2, 25, 64, dtype=torch.float16) for _ in range(2))
    q[0, 1, 30, 3] = math.nan
    out, lse = ab.attention(q, k, v, causal="bottom_right", backend="flash", return_lse=True, strict=True)
    assert torch.all(out[:, :, :15] == 0) and torch.all(lse[:, :, :15] == -math.inf)
    assert bool(torch.isnan(out[0, 1, 30]).all()) and torch.isfinite(out[0, 0]).all()
