"""The CUDA decode kernel (csrc/cuda/decode.cu, docs/decode.md "The CUDA kernel") behind
ab.attention_with_kvcache(backend="paged_attention"): through the CUDA emulator on every run (marked
`cuda_emu`: CPU tensors run the unchanged kernel sources on the CPU) and on a GPU when there is one
(marked `cuda`, skipped without).  test_kvcache.py's cases and reference: out and lse against the
float64 reference by the 2x rule, and against the CPU decode kernel (our error at most twice the CPU
kernel's); the caches bit for bit where flash-attn writes them and bit for bit as the CPU kernel
writes them (rotary included); split-KV on and off; every kernel variant the launcher can pick, the
tensor-core attention (attend_mma_kernel, ATTN_BACKENDS_CUDA_DECODE_KERNEL=mma) beside the default
one; the planner's route; bad input rejected with the CPU path's errors and nothing written."""

import logging
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attn_backends as ab
from attn_backends import _C, _dispatch
from attn_backends._testing import check_2x

from cuda_devices import both, emulator, launched, launched_blocks
from test_kvcache import (BAD, EXTREME_SCALES, GARBAGE_CASES, KV, NAN_PLACES, Call, _base, _ref64, _sdpa_bshd,
                          check_extreme_scale, check_garbage_outside_rows, check_nan_and_inf, kv_calls)

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32

# small shapes: the emulator runs every thread of every block on the CPU
CASES = [
    KV(),  # decode, GQA 4/2, dense, lengths 0, random and full
    KV(B=3, Hq=8, Hkv=1, D=128, S=300, snew=1, causal=True, dtype=BF16),  # MQA: 8 rows per block
    KV(B=2, Sq=4, Hq=4, Hkv=4, D=40, S=70, snew=4, causal=True, rotary="interleaved", dtype=F16),  # MHA, D=40
    KV(B=2, Sq=3, Hq=6, Hkv=2, D=64, S=90, snew=2, causal=True, rotary="neox", leftpad=True),  # 9 rows: 2 tiles
    KV(B=2, Sq=2, Hq=4, Hkv=2, D=64, S=150, block=16, snew=2, causal=True, dtype=BF16),
    KV(B=2, Sq=1, Hq=4, Hkv=2, D=32, S=200, block=48, snew=1, causal=True),  # a block size not a power of 2
    KV(B=3, Sq=2, Hq=8, Hkv=2, D=128, S=200, block=32, snew=1, causal=True, rotary="neox", alibi="bh"),
    KV(B=2, Sq=4, Hq=2, Hkv=1, D=96, S=80, block=16, window=(7, 0), softcap=4.0, dtype=F16),
    KV(B=2, Sq=1, Hq=4, Hkv=2, D=64, S=64, batch_idx=True, snew=1, rotary="interleaved", alibi="h", dtype=BF16),
    KV(B=1, Sq=4, Hq=4, Hkv=2, D=64, S=40, seqlens=0, snew=3, causal=True),  # Sq > keys: rows see nothing
    KV(B=2, Sq=2, Hq=4, Hkv=2, D=64, S=50, seqlens=None, window=(5, 3), leftpad=True, dtype=BF16),
    KV(B=2, Sq=4, Hq=4, Hkv=1, D=32, S=33, seqlens=20, snew=2, causal=True, window=(3, -1), softcap=2.0),
    KV(B=2, Sq=1, Hq=2, Hkv=2, D=256, S=48, block=16, leftpad=True, alibi="h"),  # D=256 float32: 2 loads a lane
    KV(B=2, Sq=1, Hq=2, Hkv=1, D=8, S=70, block=32, snew=1, rotary="neox", dtype=F16),  # D=8: 32 keys a warp
    # attention sinks (GPT-OSS): paged decode, and a dense chunked prefill whose rows see nothing (lse = sink)
    KV(B=2, Sq=1, Hq=8, Hkv=2, D=64, S=60, block=16, snew=1, causal=True, sinks=True, dtype=BF16),
    # 20 query rows per KV head: the tensor-core attention's two row tiles, the first with rows 8-15
    KV(B=2, Sq=5, Hq=8, Hkv=2, D=64, S=150, block=32, snew=5, causal=True, rotary="neox", dtype=BF16),
    KV(B=1, Sq=4, Hq=4, Hkv=2, D=40, S=30, seqlens=0, snew=3, causal=True, sinks=True, alibi="h"),
]
SPLIT_CASES = [
    KV(B=1, Hq=8, Hkv=2, D=64, S=700, block=16, snew=1, causal=True, dtype=BF16),
    KV(B=2, Hq=4, Hkv=4, D=32, S=500, block=80, dtype=F32),  # blocks of 80: not a power of 2
    KV(B=2, Sq=3, Hq=4, Hkv=4, D=128, S=300, leftpad=True, window=(100, -1), dtype=F16),
    KV(B=1, Sq=2, Hq=4, Hkv=2, D=64, S=600, snew=1, causal=True, sinks=True, alibi="bh", dtype=F16),  # sink once
]


def switch_decode(on: bool) -> None:
    """Our CUDA decode kernel on or off for a GPU (on unless ATTN_BACKENDS_CUDA_DECODE=0); plans forgotten."""
    _C.enable_cuda_decode(on)
    _dispatch.reset_caches()


def decode_default() -> bool:
    return os.environ.get("ATTN_BACKENDS_CUDA_DECODE", "1").strip() != "0"


@pytest.fixture
def decode(dev):
    """dev, with our CUDA decode kernel switched on for a GPU."""
    switch_decode(True)
    try:
        yield dev
    finally:
        switch_decode(decode_default())


@pytest.fixture(autouse=True)
def _lanes_unless_asked(monkeypatch):
    """attend_kernel for every test here that does not ask for a kernel (`kernel`), whatever the
    environment and the default rule say (decode.cu variant_of): their split counts and launch labels are
    attend_kernel's."""
    monkeypatch.setenv("ATTN_BACKENDS_CUDA_DECODE_KERNEL", "lanes")


@pytest.fixture
def emu_lib():
    """The emulator's library with its launch log reset; the emulated device (tests set its compute
    capability) back to the default sm_80 afterwards."""
    lib = emulator()
    lib.ab_cuda_emu_reset_launch_log()
    yield lib
    lib.ab_cuda_emu_set_device_cc(80)


KERNELS = ["lanes", "mma"]


@pytest.fixture
def kernel(request, monkeypatch):
    """The attention kernel decode.cu launches for a 16-bit call (ATTN_BACKENDS_CUDA_DECODE_KERNEL, read
    at every call), parametrized indirectly: attend_kernel ("lanes") or attend_mma_kernel ("mma", tensor
    cores); unset, decode.cu picks by the query rows of a KV head.  float32 calls take attend_kernel either way, so they are not run twice."""
    monkeypatch.setenv("ATTN_BACKENDS_CUDA_DECODE_KERNEL", request.param)
    return request.param


def kernels_for(dtype) -> list:
    """The attentions a call of dtype can take: both for 16-bit calls, attend_kernel alone for float32."""
    return KERNELS if dtype != F32 else ["lanes"]


def both_kernels(gpu_cases, emu_cases) -> list:
    """(dev, case, kernel) parameters: both()'s, each with every attention its case's dtype can take."""
    return [pytest.param(*p.values, k, marks=p.marks, id=f"{k}-{p.id}")
            for p in both(gpu_cases, emu_cases, name=str) for k in kernels_for(p.values[1].dtype)]


def attended_by(dev, kernel, dtype):
    """Checks, on the emulator, that the call since the launch log's reset ran the kernel asked for."""
    if not dev.emulated:
        return
    ran = launched(emulator())
    want = "attend_mma_kernel" if kernel == "mma" and dtype != F32 else "attend_kernel"
    assert any(want in label and (want == "attend_mma_kernel" or "mma" not in label) for label in ran), ran


def run(dev, call: Call, **extra):
    """call through paged_attention on dev's tensors; the caches written back into call's (CPU) ones."""
    kw = {k: dev(t) if isinstance(t, torch.Tensor) else t for k, t in call.kwargs().items()}
    k_cache, v_cache = dev(call.k_cache), dev(call.v_cache)
    new = [dev(t) if t is not None else None for t in (call.k, call.v)]
    out, lse = ab.attention_with_kvcache(dev(call.q), k_cache, v_cache, *new, **kw, return_softmax_lse=True,
                                         backend="paged_attention", strict=True, **extra)
    if k_cache is not call.k_cache:
        call.k_cache.copy_(k_cache.cpu())
        call.v_cache.copy_(v_cache.cpu())
    return out.cpu(), lse.cpu()


def cpu_kernel(dev, call: Call, **extra):
    """The CPU decode kernel on the same call (caches reset before and after)."""
    call.reset()
    with dev.off():
        _dispatch.reset_caches()
        out, lse = call.run("paged_attention", **extra)
    _dispatch.reset_caches()
    caches = call.k_cache.clone(), call.v_cache.clone()
    call.reset()
    return out, lse, caches


@pytest.mark.parametrize("dev, case, kernel", both_kernels(CASES, CASES), indirect=["dev", "kernel"])
def test_matches_the_reference_and_the_cpu_kernel_and_writes_the_cache(decode, kernel, case, gen):
    call = Call(case, gen)
    cpu_out, cpu_lse, cpu_caches = cpu_kernel(decode, call)
    if decode.emulated:
        emulator().ab_cuda_emu_reset_launch_log()
    out, lse = run(decode, call)
    attended_by(decode, kernel, case.dtype)
    call.check(out, lse)  # the float64 rule, dead rows 0 / -inf, the caches where flash-attn writes
    ref_out, ref_lse = call.reference(torch.float64)
    check_2x("out against the CPU kernel", out, ref_out, cpu_out, 2, case.dtype)
    check_2x("lse against the CPU kernel", lse, ref_lse, cpu_lse, 2, case.dtype)
    assert torch.equal(call.k_cache, cpu_caches[0]) and torch.equal(call.v_cache, cpu_caches[1])


@pytest.mark.parametrize("dev, case, kernel", both_kernels(GARBAGE_CASES, GARBAGE_CASES), indirect=["dev", "kernel"])
def test_garbage_outside_the_rows_changes_nothing(decode, kernel, case, gen):
    # test_kvcache's case on the CUDA kernels: NaN and infs where no row reads (past a row's end, before its
    # leftpad, unused blocks) give the bits of finite values there
    check_garbage_outside_rows(case, gen, lambda call: run(decode, call))


@pytest.mark.parametrize("dev, case, kernel", both_kernels(SPLIT_CASES, SPLIT_CASES), indirect=["dev", "kernel"])
def test_split_and_unsplit_agree(decode, kernel, case, gen):
    call = Call(case, gen)
    outs = {}
    # 0: the launcher's choice from the SM count and the cache length; 70: more splits than a warp has
    # lanes (the merge reduces them across warps), some with no key of a short row
    for splits in (1, 3, 0, 70):
        out, lse = run(decode, call.reset(), num_splits=splits)
        call.check(out, lse)
        outs[splits] = out.double(), lse.double()
    for splits in (3, 0, 70):
        assert torch.allclose(outs[splits][0], outs[1][0], atol=4 * torch.finfo(case.dtype).eps, rtol=0)
        assert torch.allclose(outs[splits][1], outs[1][1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("dev", [pytest.param("emu", marks=pytest.mark.cuda_emu),
                                 pytest.param("cuda", marks=pytest.mark.cuda)], indirect=True)
@pytest.mark.parametrize("dtype, kernel", [(dt, k) for dt in (F32, BF16) for k in kernels_for(dt)],
                         indirect=["kernel"], ids=lambda x: str(x)[6:] if isinstance(x, torch.dtype) else x)
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("Sq", [2, 8])
@pytest.mark.parametrize("where", NAN_PLACES)
def test_nan_and_inf_reach_the_rows_that_see_them(decode, kernel, where, Sq, splits, dtype, gen):
    # test_kvcache's NaN and inf case on the CUDA kernels.  Both once turned a row whose every score
    # was NaN (a NaN in q) into out 0, lse -inf: its max stayed -inf, so the warps' merge took it for
    # a row that saw no key; attend_kernel also made NaN of a row whose first visible score was -inf.
    check_nan_and_inf(where, Sq, splits, gen, dtype, decode, atol=1e-5 if dtype == F32 else 2e-2,
                      backend="paged_attention", strict=True)


@pytest.mark.parametrize("dev", [pytest.param("emu", marks=pytest.mark.cuda_emu),
                                 pytest.param("cuda", marks=pytest.mark.cuda)], indirect=True)
@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
@pytest.mark.parametrize("scale", EXTREME_SCALES)
def test_scores_past_float32_before_the_scale_stay_finite(decode, kernel, scale, gen):
    # test_kvcache's case on both CUDA kernels (bfloat16, 2 and 4 query rows a KV head: the tensor-core
    # attention takes both); its tensor-core attention once made these rows NaN
    for Hq in (4, 8):
        check_extreme_scale(scale, gen, torch.bfloat16, decode, Hq=Hq, backend="paged_attention", strict=True)


@pytest.mark.fuzz
@pytest.mark.cuda_emu
@pytest.mark.parametrize("dev", ["emu"], indirect=True)
@settings(max_examples=max(5, settings.default.max_examples * 30 // 100),
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # the fixtures hold for every example
@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
@given(kv_calls("paged_attention"), st.integers(0, 2**31 - 1), st.sampled_from([0, 1, 3]))
def test_random_calls_on_the_cuda_kernels(decode, kernel, case, seed, splits):
    """test_kvcache's random mixes of every option on the CUDA kernels, emulated, both attentions."""
    call = Call(case, torch.Generator().manual_seed(seed))
    call.check(*run(decode, call, num_splits=splits))


@pytest.mark.cuda_emu
@pytest.mark.parametrize("dev", ["emu"], indirect=True)
def test_every_kernel_variant_runs(decode, gen, monkeypatch, emu_lib):
    lib = emu_lib
    names = {F16: "__half", BF16: "__nv_bfloat16", F32: "float"}
    expect = set()
    for dt in (F16, BF16, F32):
        # query rows per KV head 1, 2, 4 and 8: the four row tiles; dense and paged (attend_kernel<..., true>
        # reads the block table a step ahead)
        for Sq, Hq, Hkv in ((1, 2, 2), (2, 2, 2), (1, 8, 2), (2, 4, 1)):
            for block, paged in ((None, "false"), (16, "true")):
                call = Call(KV(B=1, Sq=Sq, Hq=Hq, Hkv=Hkv, D=16, S=40, block=block, snew=1, dtype=dt), gen)
                call.check(*run(decode, call, num_splits=2))
                rows = min(8, Sq * Hq // Hkv)
                expect.add(f"launch_attend<T = {names[dt]}, int kRows = {rows}>: attend_kernel<T, kRows, {paged}>")
        expect.add(f"run<T = {names[dt]}>: append_kernel<T>")
        expect.add(f"run<T = {names[dt]}>: merge_kernel<T>")
    # the tensor-core attention, 16-bit: head dims rounded up to 64, 128 and 256; 3 stages where the
    # device gives a block the shared memory (the emulated sm_90), else 2
    monkeypatch.setenv("ATTN_BACKENDS_CUDA_DECODE_KERNEL", "mma")
    for dt in (F16, BF16):
        for D, kd, stages, cc in ((16, 64, 4, 80), (72, 128, 2, 80), (72, 128, 3, 90),
                                  (136, 256, 2, 80), (136, 256, 3, 90)):
            lib.ab_cuda_emu_set_device_cc(cc)
            call = Call(KV(B=1, Sq=2, Hq=4, Hkv=2, D=D, S=70, snew=1, dtype=dt), gen)
            call.check(*run(decode, call, num_splits=2))
            expect.add(f"launch_attend_mma<T = {names[dt]}, int kD = {kd}, int kStages = {stages}>: "
                       "attend_mma_kernel<T, kD, kStages>")
    ran = launched(lib)
    missing = sorted(e for e in expect if not any(e in label for label in ran))
    assert not missing, f"not launched: {missing}\nlaunched: {sorted(ran)}"


@pytest.mark.cuda_emu
@pytest.mark.parametrize("dev", ["emu"], indirect=True)
def test_the_tensor_core_attention_needs_the_shared_memory_of_its_stages(decode, gen, monkeypatch, emu_lib):
    # head dim 256 takes 148.5 KiB a block: an sm_86 gives 99 KiB, so attend_kernel serves the call there
    # (head dims up to 128 take 76.5 KiB and keep attend_mma_kernel)
    monkeypatch.setenv("ATTN_BACKENDS_CUDA_DECODE_KERNEL", "mma")
    lib = emu_lib
    lib.ab_cuda_emu_set_device_cc(86)
    for D, want in ((136, "attend_kernel"), (128, "attend_mma_kernel")):
        lib.ab_cuda_emu_reset_launch_log()
        call = Call(KV(B=1, Sq=1, Hq=4, Hkv=2, D=D, S=40, snew=1, dtype=BF16), gen)
        call.check(*run(decode, call))
        ran = launched(lib)
        assert any(want in label and (want != "attend_kernel" or "mma" not in label) for label in ran), ran


@pytest.mark.cuda_emu
@pytest.mark.parametrize("dev", ["emu"], indirect=True)
def test_the_default_attention_follows_the_query_rows_of_a_kv_head(decode, gen, monkeypatch):
    # unset (or any other value): 16-bit calls with at least 2 query rows per KV head (tokens x query heads
    # of a KV head) take the tensor-core attention, the H200's faster one there; one row (MHA decode) and
    # float32 keep attend_kernel; "lanes" and "mma" force one
    lib = emulator()
    for env in (None, "auto"):
        if env is None:
            monkeypatch.delenv("ATTN_BACKENDS_CUDA_DECODE_KERNEL")
        else:
            monkeypatch.setenv("ATTN_BACKENDS_CUDA_DECODE_KERNEL", env)
        for Sq, Hq, Hkv, dt, want in ((1, 4, 4, BF16, "attend_kernel"), (1, 4, 2, BF16, "attend_mma_kernel"),
                                      (2, 2, 2, F16, "attend_mma_kernel"), (1, 8, 2, F32, "attend_kernel"),
                                      (1, 2, 2, F16, "attend_kernel")):
            lib.ab_cuda_emu_reset_launch_log()
            call = Call(KV(B=1, Sq=Sq, Hq=Hq, Hkv=Hkv, D=32, S=40, snew=1, dtype=dt), gen)
            call.check(*run(decode, call))
            ran = launched(lib)
            assert any(want in label and (want != "attend_kernel" or "mma" not in label) for label in ran), (
                env, Sq, Hq, Hkv, dt, ran)
    for env, want in (("lanes", "attend_kernel"), ("mma", "attend_mma_kernel")):
        monkeypatch.setenv("ATTN_BACKENDS_CUDA_DECODE_KERNEL", env)
        for Sq, Hq, Hkv in ((1, 4, 4), (1, 4, 2)):
            lib.ab_cuda_emu_reset_launch_log()
            call = Call(KV(B=1, Sq=Sq, Hq=Hq, Hkv=Hkv, D=32, S=40, snew=1, dtype=BF16), gen)
            call.check(*run(decode, call))
            ran = launched(lib)
            assert any(want in label and (want != "attend_kernel" or "mma" not in label) for label in ran), (
                env, Hq, Hkv, ran)


@pytest.mark.cuda_emu
@pytest.mark.parametrize("dev", ["emu"], indirect=True)
@pytest.mark.parametrize("cc,B,D,S,rotary,blocks", [
    # 64 (batch row, KV head) blocks; with rotary tables (the queries' lo half too) 78 KiB a block, two an
    # SM, 264 places: 4 splits (5 made 320: 1.2 waves); without them 75 KiB, three an SM, 396 places: 6
    (90, 16, 64, 2048, "neox", 256),
    (90, 16, 64, 2048, None, 384),
    (80, 28, 64, 768, None, 336),   # 112 blocks, 216 places: 3 splits, two waves of 4 tiles a block (2
                                    # made 224 blocks: two waves of 6 tiles, the second of 8 blocks)
    (80, 2, 64, 768, None, 24),     # 8 blocks: 3 splits, the most 768 positions allow (256 each)
    (80, 25, 256, 512, None, 100),  # head dim 256, 141 KiB a block: one an SM, 108 places: no split
])
def test_the_tensor_core_attention_splits_in_whole_waves(decode, gen, monkeypatch, emu_lib, cc, B, D, S, rotary,
                                                          blocks):
    """attend_mma_kernel's blocks hold so much shared memory that an SM runs three, two (head dim 64: 75
    or 78 KiB a block) or one (head dim 256 on an A100): the launcher counts its splits so that the
    blocks fill whole waves of the SMs' places (the emulated H100's 132 SMs, the A100's 108) rather than
    spill a few into a second wave."""
    monkeypatch.setenv("ATTN_BACKENDS_CUDA_DECODE_KERNEL", "mma")
    emu_lib.ab_cuda_emu_set_device_cc(cc)
    call = Call(KV(B=B, Hq=16, Hkv=4, D=D, S=S, seqlens=S - 1, snew=1, rotary=rotary, dtype=BF16), gen)
    call.check(*run(decode, call))
    ran = launched_blocks(emu_lib)
    assert sum(n for label, n in ran.items() if "attend_mma_kernel" in label) == blocks, ran
    assert any("merge_kernel" in label for label in ran) == (blocks > B * 4), ran


@pytest.mark.cuda_emu
@pytest.mark.parametrize("dev", ["emu"], indirect=True)
@pytest.mark.parametrize("forced,stages", [(None, 3), ("2", 2), ("3", 3), ("5", 3)])
def test_the_tensor_core_attention_stages_can_be_forced(decode, gen, monkeypatch, emu_lib, forced, stages):
    """ATTN_BACKENDS_CUDA_DECODE_STAGES=2 or 3 picks attend_mma_kernel's stages at head dim 128 (the
    emulated sm_90 takes 3 by default); other values are ignored.  The result is the same call's."""
    monkeypatch.setenv("ATTN_BACKENDS_CUDA_DECODE_KERNEL", "mma")
    if forced is not None:
        monkeypatch.setenv("ATTN_BACKENDS_CUDA_DECODE_STAGES", forced)
    emu_lib.ab_cuda_emu_set_device_cc(90)
    call = Call(KV(B=2, Hq=8, Hkv=2, D=128, S=300, seqlens=290, snew=1, dtype=BF16), gen)
    call.check(*run(decode, call))
    ran = launched(emu_lib)
    assert [label for label in ran if "attend_mma_kernel" in label] == [
        f"{{anonymous}}::launch_attend_mma<T = __nv_bfloat16, int kD = 128, int kStages = {stages}>: "
        "attend_mma_kernel<T, kD, kStages>"], ran


@pytest.mark.cuda_emu
@pytest.mark.parametrize("dev", ["emu"], indirect=True)
def test_the_lane_attention_splits_by_the_occupancy_the_runtime_gives(decode, gen, emu_lib):
    """attend_kernel's split count fills whole waves of the places the runtime's occupancy gives
    (cudaOccupancyMaxActiveBlocksPerMultiprocessor: on the H200 4 blocks an SM with one query row, 2 with
    more, its registers binding; the emulator, which knows no registers, answers from threads and
    shared memory: 16 blocks of 128 threads on the emulated A100's 108 SMs, 12 on sm_86's 84).  Before,
    it aimed at 4 blocks an SM rounding up.  The launcher keeps the answers per device and asks again
    when the device's compute capability changes (the emulator's devices do)."""
    lib = emu_lib
    for cc, S, blocks in (
        (80, 1024, 800),  # 100 blocks, 1728 places: 8 splits, the most 1024 positions allow (128 each)
        (80, 2048, 1600),  # 16 splits, one wave
        (86, 2048, 800),  # 1008 places: 8 splits, one wave (10 would give no block fewer tiles)
    ):
        lib.ab_cuda_emu_set_device_cc(cc)
        lib.ab_cuda_emu_reset_launch_log()
        call = Call(KV(B=50, Hq=2, Hkv=2, D=16, S=S, seqlens=S - 1, snew=1, dtype=BF16), gen)
        call.check(*run(decode, call))
        ran = launched_blocks(lib)
        assert sum(n for label, n in ran.items() if "attend_kernel" in label) == blocks, (cc, S, ran)


@pytest.mark.cuda_emu
@pytest.mark.parametrize("dev", ["emu"], indirect=True)
def test_the_launcher_splits_a_long_cache_when_blocks_are_few(decode, gen):
    # one block (B = Hkv = 1) for the emulated A100's 108 SMs: split, keeping >= 128 positions a split
    lib = emulator()
    for S, splits in ((600, True), (300, True), (200, False)):
        lib.ab_cuda_emu_reset_launch_log()
        call = Call(KV(B=1, Hq=2, Hkv=1, D=16, S=S, seqlens=S - 1, snew=1, dtype=BF16), gen)
        call.check(*run(decode, call))
        assert any("merge_kernel" in label for label in launched(lib)) == splits


@pytest.mark.cuda_emu
@pytest.mark.parametrize("dev", ["emu"], indirect=True)
def test_the_emulation_routes_paged_attention_and_says_so(decode, gen, caplog):
    caplog.set_level(logging.INFO, logger="attn_backends")
    lib = emulator()
    lib.ab_cuda_emu_reset_launch_log()
    call = Call(KV(B=1, D=16, S=20, snew=1), gen)
    call.check(*call.run("paged_attention"))
    assert any("attend_kernel" in label for label in launched(lib))
    served = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any(m.startswith("attn_backends: paged_attention serves cpu") and "cuda emulated on cpu" in m
               for m in served), served
    # a head dim the CUDA kernel does not take falls back as on a GPU; strict raises naming why
    odd = Call(KV(B=1, D=12, S=20, snew=1), gen)
    with pytest.raises(RuntimeError, match="head dim 12 is not a multiple of 8"):
        odd.run("paged_attention")
    # without the emulation the CPU kernel serves, and nothing is emulated
    with decode.off():
        lib.ab_cuda_emu_reset_launch_log()
        call.reset()
        call.check(*call.run("paged_attention"))
        assert launched(lib) == {}


@pytest.mark.cuda_emu
@pytest.mark.parametrize("dev", ["emu"], indirect=True)
@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
@pytest.mark.parametrize("block", [None, 16])
def test_sinks_run_in_the_cuda_kernel_split_or_not(decode, kernel, block, gen):
    # the CUDA decode kernel takes sinks (csrc/ab_registry.c CUDA_DECODE): the sink joins each row once, where
    # the unsplit attention writes it or after the split-KV merge; a strict call runs the kernel
    lib = emulator()
    call = Call(KV(B=2, Sq=2, Hq=4, Hkv=2, D=16, S=40, block=block, snew=1, causal=True, sinks=True, dtype=BF16),
                gen)
    for splits in (1, 3):
        lib.ab_cuda_emu_reset_launch_log()
        call.check(*run(decode, call.reset(), num_splits=splits))
        ran = launched(lib)
        attended_by(decode, kernel, BF16)
        assert any("merge_kernel" in label for label in ran) == (splits > 1), ran


@pytest.mark.cuda_emu
@pytest.mark.parametrize("dev", ["emu"], indirect=True)
def test_caches_whose_rows_are_not_16_byte_aligned_go_to_eager(decode, gen, caplog):
    call = Call(KV(B=2, D=16, S=20, snew=1), gen)
    for name in ("k_cache", "v_cache"):  # the same values, one float into a buffer: 4-byte aligned rows
        t = getattr(call, name)
        shifted = torch.empty(t.numel() + 1)[1:].view(t.shape)
        setattr(call, name, shifted.copy_(t))
    lib = emulator()
    lib.ab_cuda_emu_reset_launch_log()
    ab._kvcache._warned.clear()
    call.check(*call.run("paged_attention"))
    assert launched(lib) == {}
    assert any("not 16-byte aligned, so eager serves the call" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("dev", [pytest.param("emu", marks=pytest.mark.cuda_emu),
                                 pytest.param("cuda", marks=pytest.mark.cuda)], indirect=True)
@pytest.mark.parametrize("what,over,exc,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_named_and_writes_nothing(decode, what, over, exc, msg, gen, monkeypatch):
    # on a GPU the index values are checked on the host under ATTN_BACKENDS_KVCACHE_CHECK only (the
    # next test: without it, their rows come out NaN)
    monkeypatch.setattr(ab._kvcache, "CHECK_DEVICE_VALUES", True)
    call, args = _base(gen)
    replaced = over(call)
    args.update(replaced)
    args = {k: decode(t) if isinstance(t, torch.Tensor) else t for k, t in args.items()}
    with pytest.raises(exc, match=msg):
        ab.attention_with_kvcache(**args, backend="paged_attention")
    assert torch.equal(call.k_cache, call.before[0]) and torch.equal(call.v_cache, call.before[1])
    if "k_cache" not in replaced and "v_cache" not in replaced:  # on a GPU: the device copies
        assert torch.equal(args["k_cache"].cpu(), call.before[0]) and torch.equal(args["v_cache"].cpu(), call.before[1])


# (what, overrides, the batch rows whose values are out of range): test_kvcache.BAD's value cases
UNCHECKED = [
    ("seqlens past the cache", lambda c: dict(cache_seqlens=torch.tensor([3, 48], dtype=torch.int32)), [1]),
    ("negative seqlens", lambda c: dict(cache_seqlens=torch.tensor([-1, 3], dtype=torch.int32)), [0]),
    ("a padding block in use", lambda c: dict(block_table=torch.tensor([[0, -1, -1], [1, 2, -1]], dtype=torch.int32),
                                              cache_seqlens=torch.tensor([20, 3], dtype=torch.int32)), [0]),
    ("a block past the cache", lambda c: dict(block_table=torch.tensor([[0, 99, -1], [1, 2, -1]], dtype=torch.int32),
                                              cache_seqlens=torch.tensor([20, 3], dtype=torch.int32)), [0]),
    ("leftpad past the length", lambda c: dict(cache_leftpad=torch.tensor([0, 9], dtype=torch.int32),
                                               cache_seqlens=torch.tensor([4, 5], dtype=torch.int32)), [1]),
    ("short rotary tables", lambda c: dict(rotary_cos=torch.ones(4, 4), rotary_sin=torch.zeros(4, 4),
                                           cache_seqlens=torch.tensor([2, 9], dtype=torch.int32)), [1]),
]


@pytest.mark.parametrize("dev", [pytest.param("emu", marks=pytest.mark.cuda_emu),
                                 pytest.param("cuda", marks=pytest.mark.cuda)], indirect=True)
@pytest.mark.parametrize("what,over,bad", UNCHECKED, ids=[u[0] for u in UNCHECKED])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
def test_unchecked_index_values_make_their_rows_nan(decode, kernel, what, over, bad, splits, gen, monkeypatch):
    # index values on the GPU are not read back (no synchronisation per call): the kernel bounds them.
    # A batch row with values out of range writes nothing into the cache, and its out and lse are NaN;
    # the other rows are what a call of the other rows alone gives, bit for bit, caches included.
    # Emulated, the host check that CPU tensors get is switched off to reach the kernel's own bounds.
    monkeypatch.setattr(ab._kvcache, "CHECK_DEVICE_VALUES", False)
    if decode.emulated:
        monkeypatch.setattr(ab._kvcache, "host_rows", lambda c: None)
    call, args = _base(gen)
    args.update(over(call))
    if kernel == "mma":  # attend_mma_kernel takes 16-bit calls
        args.update({k: args[k].to(BF16) for k in ("q", "k", "v", "k_cache", "v_cache")})
    good = [b for b in range(2) if b not in bad]

    def run_on(a):
        a = {k: decode(t.clone() if k in ("k_cache", "v_cache") else t) if isinstance(t, torch.Tensor) else t
             for k, t in a.items()}
        out, lse = ab.attention_with_kvcache(**a, num_splits=splits, return_softmax_lse=True,
                                             backend="paged_attention", strict=True)
        return out.cpu(), lse.cpu(), a["k_cache"].cpu(), a["v_cache"].cpu()

    out, lse, kc, vc = run_on(args)
    assert out[bad].isnan().all() and lse[bad].isnan().all()
    sub = {k: t[good] if isinstance(t, torch.Tensor) and k in ("q", "k", "v", "cache_seqlens", "cache_leftpad",
                                                                  "block_table") else t for k, t in args.items()}
    out1, lse1, kc1, vc1 = run_on(sub)
    assert torch.equal(out[good], out1) and torch.equal(lse[good], lse1)
    assert torch.equal(kc, kc1) and torch.equal(vc, vc1)


@pytest.mark.cuda
def test_without_the_switch_eager_serves_cuda(gen, caplog):
    caplog.set_level(logging.INFO, logger="attn_backends")
    switch_decode(False)
    try:
        call = Call(KV(B=1, D=16, S=20, snew=1), gen)
        q, kc, vc, k, v = (t.cuda() for t in (call.q, call.k_cache, call.v_cache, call.k, call.v))
        ab.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=call.cache_seqlens.cuda())
        assert any(r.getMessage().startswith("attn_backends: eager serves cuda") for r in caplog.records)
    finally:
        switch_decode(decode_default())


@pytest.mark.cuda
@pytest.mark.parametrize("case", [KV(B=3, Hq=8, Hkv=2, D=128, S=300, seqlens=250, snew=1, causal=True,
                                     rotary="neox", dtype=torch.bfloat16),
                                  KV(B=2, Sq=3, Hq=4, Hkv=4, D=64, S=70, seqlens=20, snew=2, dtype=torch.float16)],
                         ids=str)
def test_auto_sends_16_bit_calls_torch_reads_in_place_to_torch(case, gen, caplog):
    # ab_planner.c torch_first_kv: on CUDA, 16-bit calls with an int cache_seqlens on a dense cache go
    # to torch SDPA over the cache's view (our kernel ran at 0.18-0.56x torch's speed in bfloat16)
    caplog.set_level(logging.INFO, logger="attn_backends")
    _dispatch.reset_caches()
    call = Call(case, gen)
    q, kc, vc, k, v = (t.cuda() for t in (call.q, call.k_cache, call.v_cache, call.k, call.v))
    cos, sin = (t.cuda() if t is not None else None for t in (call.cos, call.sin))
    out = ab.attention_with_kvcache(q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=call.cache_seqlens,
                                    causal=case.causal, rotary_interleaved=case.rotary != "neox")
    assert any(r.getMessage().startswith("attn_backends: sdpa serves cuda") for r in caplog.records)
    call.k_cache.copy_(kc.cpu())
    call.v_cache.copy_(vc.cpu())
    call.check_out(out.cpu())


# ---- HF transformers' decode fast path on the CUDA kernels --------------------------------------

@pytest.mark.parametrize("dev", [pytest.param("emu", marks=pytest.mark.cuda_emu),
                                 pytest.param("cuda", marks=pytest.mark.cuda)], indirect=True)
@pytest.mark.parametrize("arch, dtype, kernel", [(a, dt, k) for a, dt in (("llama", F32), ("llama", BF16), ("gpt_oss", F32))
                                                  for k in kernels_for(dt)],
                         indirect=["kernel"], ids=lambda x: str(x)[6:] if isinstance(x, torch.dtype) else x)
def test_hf_continuous_batching_fast_path_runs_on_the_cuda_kernels(decode, kernel, arch, dtype, monkeypatch):
    # generate_batch under attn_backends_flash_attention_2 (tests/test_flash_attn_api.py has the CPU
    # path): the prompts through flash_attn_varlen_func (CUDA flash, or math for float32), each decode
    # step through flash_attn_with_kvcache (the CUDA append and attend kernels writing and reading HF's
    # paged cache through its block table); the tokens are HF's own paged sdpa's on the same device.
    # Emulated, transformers' device gate (CUDA or XPU only) is answered yes; nothing else is changed.
    # GPT-OSS: its sinks in every call, the tokens eager's prompt by prompt (in float32 only: in
    # bfloat16 eager's own rounding moves a token of this random model)
    transformers = pytest.importorskip("transformers")
    from attn_backends._testing import continuous_batching_config

    from attn_backends import _transformers

    ab.register_transformers()
    torch.manual_seed(0)
    if arch == "llama":
        cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
        model = transformers.LlamaForCausalLM(cfg)
    else:  # sinks in every call (GPT-OSS keeps the flash name: tests/test_hf.py); full attention: the fast path
        cfg = transformers.GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
                                        layer_types=["full_attention", "full_attention"])
        model = transformers.GptOssForCausalLM(cfg)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.0)
    model = model.eval().to(device=decode.type, dtype=dtype)
    gen_cfg = transformers.GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=-1, pad_token_id=0)
    prompts = [[1, 5, 9, 3], [7, 8], [2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22]]

    def generate(**kw):
        cb_cfg = continuous_batching_config(16, num_blocks=32, max_batch_tokens=64,
                                            auto_switch_to_flash=False, use_cuda_graph=False, **kw)
        out = model.generate_batch(inputs=prompts, generation_config=gen_cfg, continuous_batching_config=cb_cfg)
        return {k: r.generated_tokens for k, r in out.items()}

    with decode.off():
        if arch == "llama":  # HF's own paged sdpa
            model.set_attn_implementation("sdpa")
            hf = generate()
        else:  # GPT-OSS refuses sdpa: eager, prompt by prompt
            model.set_attn_implementation("eager")
            hf = {f"req_{i}": model.generate(input_ids=torch.tensor([p], device=decode.type),
                                             generation_config=gen_cfg)[0, len(p):].tolist()
                  for i, p in enumerate(prompts)}
    if decode.emulated:
        import transformers.generation.continuous_batching.initialization as cb_init

        monkeypatch.setattr(cb_init, "is_torch_xpu_available", lambda *a, **k: True)
        lib = emulator()
        lib.ab_cuda_emu_reset_launch_log()
    model.set_attn_implementation(_transformers.FLASH_API)
    assert generate(max_blocks_per_request=8) == hf
    if decode.emulated:
        ran = launched(lib)
        asked = "attend_mma_kernel" if kernel == "mma" else "attend_kernel"  # the attention asked for
        attend = sum(n for label, n in ran.items() if f": {asked}<" in label)
        append = sum(n for label, n in ran.items() if "append_kernel" in label)
        assert attend == append == 18, ran  # 9 decode steps x 2 layers
        if arch == "gpt_oss":  # float32 with sinks: no CUDA prefill kernel takes both, eager serves it
            assert set(ran) == {label for label in ran if "attend_kernel" in label or "append_kernel" in label}, ran
        else:
            prefill = "math_fwd_kernel" if dtype == F32 else "ab_flash::fwd"
            assert sum(n for label, n in ran.items() if prefill in label) == 2, ran


# ---- the op called directly: one check of shapes and dtypes for both kernels ----------------------

def _op_args(B=2, Sq=1, Hq=4, Hkv=2, D=16, S=32, **over):
    """kvcache_fwd's arguments in its order (attn_backends/_kvcache.py _kernel_op), as a dict."""
    g = torch.Generator().manual_seed(3)
    args = dict(q=torch.randn(B, Sq, Hq, D, generator=g), k_cache=torch.randn(B, S, Hkv, D, generator=g),
                v_cache=torch.randn(B, S, Hkv, D, generator=g), k=torch.randn(B, 1, Hkv, D, generator=g),
                v=torch.randn(B, 1, Hkv, D, generator=g), cos=None, sin=None,
                seqlens=torch.full((B,), 5, dtype=torch.int32), seqlen=-1, batch_idx=None, leftpad=None,
                block_table=None, alibi=None, scale=D ** -0.5, causal=True, wl=-1, wr=-1, softcap=0.0,
                interleaved=True, num_splits=0, sinks=None)
    args.update(over)
    return args


# each once too short for the call's B or Hq, or of a dtype the kernel would read as another: the CUDA
# launcher used to read past these tensors (the emulator's guard pages caught it)
OP_BAD = [
    ("cache_seqlens of 1 for B=2", dict(seqlens=torch.tensor([5], dtype=torch.int32)), r"cache_seqlens must be \(B,\)"),
    ("cache_leftpad of 1 for B=2", dict(leftpad=torch.tensor([0], dtype=torch.int32)), r"cache_leftpad must be \(B,\)"),
    ("alibi_slopes of 1 for Hq=4", dict(alibi=torch.tensor([0.5])), r"alibi_slopes must be \(Hq,\) or \(B, Hq\)"),
    ("uint8 rotary tables", dict(cos=torch.ones(40, 4, dtype=torch.uint8), sin=torch.ones(40, 4, dtype=torch.uint8)),
     "rotary_cos and rotary_sin must be floating point"),
]


@pytest.mark.parametrize("emulated", [False, pytest.param(True, marks=pytest.mark.cuda_emu)], ids=["cpu", "emu"])
@pytest.mark.parametrize("what,over,msg", OP_BAD, ids=[b[0] for b in OP_BAD])
def test_the_op_called_directly_gets_one_check_for_both_kernels(what, over, msg, emulated):
    from cuda_devices import emulation_default, set_emulation

    args = _op_args(**over)
    before = (args["k_cache"].clone(), args["v_cache"].clone())
    set_emulation(emulated)
    try:
        with pytest.raises(RuntimeError, match=msg):
            torch.ops.attn_backends.kvcache_fwd(*args.values())
    finally:
        set_emulation(emulation_default())
    assert torch.equal(args["k_cache"], before[0]) and torch.equal(args["v_cache"], before[1])


@pytest.mark.cuda_emu
def test_the_cuda_op_refuses_a_pool_of_2_31_blocks():
    """attend_kernel keeps the blocks it reads a step ahead in 32 bits: a pool of 2**31 blocks (here a
    stride-0 view, no memory behind it) is refused by the launcher with a clear error, not read at a
    wrapped block id (attn_backends' own calls take the exact route before it: _cuda_kernel_takes)."""
    from cuda_devices import emulation_default, set_emulation

    pool = torch.zeros(1, 16, 2, 16).expand(2**31, 16, 2, 16)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    args = _op_args(k_cache=pool, v_cache=pool, k=None, v=None, block_table=table)
    set_emulation(True)
    try:
        with pytest.raises(RuntimeError, match="paged caches of fewer than 2\\^31 blocks"):
            torch.ops.attn_backends.kvcache_fwd(*args.values())
    finally:
        set_emulation(emulation_default())


@pytest.mark.parametrize("limit", ["grid", "keys", "blocks"])
@pytest.mark.parametrize("dev", [pytest.param("emu", marks=pytest.mark.cuda_emu)], indirect=True)
def test_a_call_past_the_cuda_grids_takes_the_exact_route_over_the_gathered_cache(limit, decode, monkeypatch, gen):
    """The CUDA kernel's grids take B and Hkv * row tiles up to 65535 (a very long chunked prefill has
    more), and it counts a row's keys in 32 bits: a call past either takes the exact route over the
    gathered cache (torch ops, any dtype) instead of failing in the launcher or wrapping a key
    offset; so does a paged pool of 2**31 blocks or more (attend_kernel names a block in 32 bits).  The
    limits are lowered here so that a small call crosses them."""
    from attn_backends import _kvcache

    call = Call(KV(B=2, Sq=3, Hq=4, Hkv=2, D=16, S=40, snew=3, causal=True, block=16 if limit == "blocks" else None),
                gen)
    want = cpu_kernel(decode, call)
    if limit == "grid":  # 2 KV heads x 1 row tile (6 rows a head, tiles of 8) = 2 > 1
        monkeypatch.setattr(_kvcache, "_GRID_Y", 1)
    elif limit == "keys":  # 40 positions a row
        monkeypatch.setattr(_kvcache, "_KEYS_32", 40)
    else:  # the pool's blocks
        assert call.k_cache.shape[0] >= 6
        monkeypatch.setattr(_kvcache, "_BLOCKS_32", call.k_cache.shape[0])
    emulator().ab_cuda_emu_reset_launch_log()
    out, lse = run(decode, call)
    ran = launched(emulator())
    assert not any("decode" in label or "attend_" in label for label in ran), ran
    call.check(out, lse)
    assert torch.equal(call.k_cache, want[2][0]) and torch.equal(call.v_cache, want[2][1])


@pytest.mark.parametrize("dev", [pytest.param("emu", marks=pytest.mark.cuda_emu),
                                 pytest.param("cuda", marks=pytest.mark.cuda)], indirect=True)
def test_splits_merge_without_the_lse_rounding(decode):
    # test_kvcache.py's case on the CUDA kernel: scores near 3000 that float32 holds exactly.  merge_kernel
    # weighed the splits by exp(lse_s - max), and a float32 lse is off by |lse| 2**-24; it now weighs them by
    # each split's own sum and running max, as the CPU merge does
    g = torch.Generator().manual_seed(0)
    B, Sk, H, D = 1, 4096, 1, 32
    q = torch.ones(B, 1, H, D)
    k = torch.zeros(B, Sk, H, D)
    k[..., 0] = 3000.0 + torch.randint(-3, 1, (B, Sk, H), generator=g).float()
    v = torch.randn(B, Sk, H, D, generator=g)
    ref = _ref64(q, k, v, scale=1.0)
    torch_out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                 v.transpose(1, 2), scale=1.0).transpose(1, 2)
    lib = emulator() if decode.emulated else None
    for splits in (1, 8):
        if lib is not None:
            lib.ab_cuda_emu_reset_launch_log()
        with torch.no_grad():
            out = ab.attention_with_kvcache(decode(q), decode(k), decode(v), softmax_scale=1.0, num_splits=splits,
                                            backend="paged_attention", strict=True).cpu()
        if lib is not None:
            assert any("merge_kernel" in label for label in launched(lib)) == (splits > 1)
        check_2x(f"out, {splits} splits", out, ref, torch_out, 2, F32, 1e-6)


@pytest.mark.parametrize("dev", [pytest.param("emu", marks=pytest.mark.cuda_emu),
                                 pytest.param("cuda", marks=pytest.mark.cuda)], indirect=True)
@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
def test_a_q_that_the_scale_makes_subnormal(decode, kernel, gen):
    # test_kvcache's bfloat16 case (q near 1e-37 against keys near 1e37: scores of order 1) on both CUDA
    # kernels: q times 2**qe (the scale's power of two) is a bfloat16 subnormal here, which the CPU's
    # vdpbf16ps reads as 0.  The tensor-core products must keep it; the emulator does, and a GPU run
    # (-m cuda) checks the hardware.  4 query rows a KV head: the tensor-core attention takes them.
    q = (torch.randn(1, 1, 8, 64, generator=gen) * 1e-37).bfloat16()
    k = (torch.randn(1, 256, 2, 64, generator=gen) * 1e37).bfloat16()
    v = torch.randn(1, 256, 2, 64, generator=gen).bfloat16()
    assert bool(((q.float() / 8).bfloat16().float().abs() < torch.finfo(torch.float32).tiny).any())
    lib = emulator() if decode.emulated else None
    for splits in (1, 3):
        if lib is not None:
            lib.ab_cuda_emu_reset_launch_log()
        with torch.no_grad():
            out = ab.attention_with_kvcache(decode(q), decode(k), decode(v), num_splits=splits,
                                            backend="paged_attention", strict=True).cpu()
        if lib is not None:  # the kernel asked for ran
            assert any(("attend_mma" in label) == (kernel == "mma") and "attend_" in label
                       for label in launched(lib)), launched(lib)
        check_2x(f"out, {splits} splits", out, _ref64(q, k, v), _sdpa_bshd(q, k, v), 2, BF16, 1e-3)
