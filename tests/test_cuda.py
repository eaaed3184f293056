"""CUDA tests: the math and flash kernels, forward and backward (dense and varlen), against the float64
reference; results on a non-default stream; dropout (the same stream as the CPU kernels, its
statistics, the backward replaying the forward's mask, fresh masks on each CUDA graph replay); the
deterministic backward bit for bit over repeated runs; fully masked rows.

Each correctness test runs on two devices: "cuda" (marked `cuda`, skipped without a GPU; one command
on a GPU machine: `python -m pytest -m cuda tests/`) and "emu" (marked `cuda_emu`): CPU tensors through
the CUDA emulator (ATTN_BACKENDS_CUDA_EMULATE, docs/cuda.md), which runs the same kernels on every CI
run, on shapes small enough for it.  The emulator's own checks (bounds, barriers, which kernel
variants ran) are in test_cuda_emu.py."""

import dataclasses
import math
import os

import pytest
import torch

import attn_backends as ab
from attn_backends import _dispatch, _providers
from attn_backends._ops import ops
from attn_backends._testing import (Case, cases, check_2x, check_against_reference, check_out_and_grads_2x,
                                    keep_mask_for_next_call, make_inputs, make_packed, reference_attention,
                                    varlen_reference)

from cuda_devices import DEVICES, both

pytestmark = pytest.mark.usefixtures("cuda_flash_on")


@pytest.fixture
def cuda_flash_on():
    # our CUDA flash kernels and the CUDA math backward are opt-in until verified
    # (ATTN_BACKENDS_CUDA_FLASH=1); these tests verify them
    ab._C.enable_cuda_flash(True)
    _dispatch.reset_caches()
    yield
    ab._C.enable_cuda_flash(os.environ.get("ATTN_BACKENDS_CUDA_FLASH", "0") == "1")
    _dispatch.reset_caches()


def run_math(q, k, v, mask, case):
    return ab.attention(q, k, v, backend="math", causal=case.causal, attn_mask=mask, window=case.window,
                        softcap=case.softcap, return_lse=True, strict=True)


def _small(case):
    """The grid's cases the emulator runs in CI (it is ~1000x slower than a GPU): the ones with at
    most 64 x 64 scores per head."""
    return case.Sq * case.Sk <= 64 * 64


@pytest.mark.parametrize("dev, case", both(list(cases()), [c for c in cases(quick=True) if _small(c)]),
                         indirect=["dev"])
def test_cuda_math_forward_matches_reference(dev, case, gen):
    check_against_reference(case, run_math, grad=False, device=dev.type, generator=gen)


@pytest.mark.parametrize("backend, S, D, dtype, tol", [
    ("math", 1024, 64, torch.float32, 1e-4),
    ("flash", 2048, 128, torch.bfloat16, 2e-2),  # the CUDA flash forward (opt-in, see cuda_flash_on)
])
@pytest.mark.cuda
def test_cuda_kernel_runs_on_the_current_stream(backend, S, D, dtype, tol):
    q, k, v = (torch.randn(4, h, S, D, device="cuda", dtype=dtype) for h in (8, 2, 2))
    ref, _ = reference_attention(q, k, v, causal=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # keep the side stream busy: a kernel on the wrong stream races
        out = ab.attention(q, k, v, backend=backend, causal=True, strict=True)
    torch.cuda.current_stream().wait_stream(side)
    assert (out.double() - ref).abs().max().item() < tol


@pytest.mark.parametrize("dev", DEVICES, indirect=True)
def test_cuda_dropout_draws_the_same_mask_as_cpu(dev):
    q, k, v = (torch.randn(2, 3, 37, 16, dtype=torch.float64) for _ in range(3))
    torch.manual_seed(11)
    with dev.off():  # the CPU kernels
        cpu = ab.attention(q, k, v, dropout_p=0.4)
    torch.manual_seed(11)
    gpu = ab.attention(dev(q), dev(k), dev(v), dropout_p=0.4, backend="math", strict=True)
    torch.testing.assert_close(gpu.cpu(), cpu)


@pytest.mark.cuda
def test_cuda_training_uses_eager_with_correct_gradients(gen):
    case = Case(B=2, Hq=4, Hkv=2, Sq=33, Sk=65, D=64, causal="bottom_right", mask="bool_rows")
    check_against_reference(
        case, lambda q, k, v, m, c: ab.attention(q, k, v, causal=c.causal, attn_mask=m, return_lse=True),
        grad=True, device="cuda", generator=gen)


@pytest.mark.parametrize("dev", DEVICES, indirect=True)
def test_cuda_fully_masked_rows_are_zero(dev):
    q, k, v = (torch.randn(1, 2, 9, 32, device=dev.type, dtype=torch.bfloat16) for _ in range(3))
    mask = torch.ones(9, 9, dtype=torch.bool, device=dev.type)
    mask[3] = False
    out, lse = ab.attention(q, k, v, attn_mask=mask, return_lse=True, backend="math", strict=True)
    assert torch.all(out[:, :, 3] == 0) and torch.all(lse[:, :, 3] == -math.inf)
    assert not torch.isnan(out).any()


@pytest.mark.cuda
def test_cuda_device_report():
    cc, ok, why, smem = ab._C.cuda_device(torch.cuda.current_device())
    assert smem == torch.cuda.get_device_properties(torch.cuda.current_device()).shared_memory_per_block_optin
    major, minor = torch.cuda.get_device_capability()
    assert cc == major * 10 + minor
    assert ok or why
    ready = _dispatch.cuda_math_ready(torch.cuda.current_device())
    assert (ready == "") == (ok and cc >= 80), ready


# ---- saturated rows: the backward's delta -------------------------------------------------------


@pytest.mark.parametrize("dev", DEVICES, indirect=True)
@pytest.mark.parametrize("backend, dtype", [("flash", torch.float16), ("flash", torch.bfloat16),
                                            ("math", torch.bfloat16), ("math", torch.float32)])
def test_cuda_gradients_of_saturated_rows(dev, backend, dtype, gen):
    # test_fidelity's saturated rows (one weight near 1 in each row) on the CUDA kernels: the flash
    # backward took delta = dout . out with out rounded to 16 bits, and P from the float32 lse without
    # the row's sum, and dq reached 3x torch's error and more (0.375 against the rule's 0.126 in
    # bfloat16; 3e-4 where the true dq is 2e-11 in float16)
    from test_fidelity import _check_large

    for Sq, Sk, D in [(1, 3, 96), (2, 40, 40), (5, 9, 128), (17, 23, 64)]:
        for kind in ("scale2", "scale3.5", "onehot0.3", "onehot1.0"):
            for _ in range(3):
                _check_large(backend, dtype, Sq, Sk, D, kind, gen, Hq=2, Hkv=2, grad_grow=dtype == torch.float32,
                             device=dev.type)


@pytest.mark.parametrize("dev", DEVICES, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_flash_block_backward_calls_sum_to_the_whole_row(dev, dtype, gen):
    # the ring's backward (test_distributed.py's property) on the CUDA flash kernels: a call with a block
    # of keys and the whole row's out and lse, and no stats, takes delta from out, so the blocks' dq add
    # up to the whole call's and their dk, dv are its rows (with the forward's stats delta would be
    # summed over the block's keys alone)
    from attn_backends import _ring

    q, k, v, dout = (dev(torch.randn(*s, generator=gen).to(dtype))
                     for s in ((2, 4, 9, 64), (2, 2, 14, 64), (2, 2, 14, 64), (2, 4, 9, 64)))
    out, lse = _ring.kernel_fwd("flash", q, k, v, 0, 0.25, -1, -1, 0.0)
    whole = _ring.kernel_bwd(dout, q, k, v, out, lse, None, 0, 0.25, -1, -1, 0.0, False)
    halves = [_ring.kernel_bwd(dout, q, k[:, :, s], v[:, :, s], out, lse, None, 0, 0.25, -1, -1, 0.0, False)
              for s in (slice(0, 5), slice(5, 14))]
    assert torch.allclose(halves[0][0].float() + halves[1][0].float(), whole[0].float(), atol=2e-2)
    for i in (1, 2):
        assert torch.equal(torch.cat([h[i] for h in halves], 2), whole[i])


# ---- flash on CUDA (csrc/cuda/flash_fwd*.cu): forward only, float16/bfloat16, no mask ------------


def _flash_cases(emulated=False):
    """The grid's problems the CUDA flash forward serves (half dtypes, D in 32..256 by 8, Dv == D, no
    mask, any layout), each in float16 and bfloat16, plus long and odd ones.  Emulated: the grid's
    small ones, and every instantiated head dim (and the padded 40, 96, 200) on short sequences."""
    seen = set()
    for case in cases():
        if case.mask != "none" or case.dv != case.D or case.D % 8 or not 32 <= case.D <= 256:
            continue
        if emulated and not _small(case):
            continue
        for dt in (torch.float16, torch.bfloat16):
            c = dataclasses.replace(case, dtype=dt)
            if c not in seen:
                seen.add(c)
                yield c
    if emulated:
        for i, D in enumerate((32, 40, 64, 96, 128, 160, 192, 200, 224, 256)):
            dt = (torch.bfloat16, torch.float16)[i % 2]
            yield Case(B=1, Hq=2, Hkv=1, Sq=67, Sk=130, D=D, dtype=dt, causal=("bottom_right", True)[i % 2])
        yield Case(B=1, Hq=2, Hkv=2, Sq=1, Sk=200, D=128, dtype=torch.float16)  # decode
        yield Case(B=1, Hq=2, Hkv=2, Sq=96, Sk=96, D=64, dtype=torch.bfloat16, window=(7, 3), causal="bottom_right")
        yield Case(B=1, Hq=2, Hkv=2, Sq=70, Sk=70, D=64, dtype=torch.float16, causal=True, softcap=5.0)
        yield Case(B=1, Hq=2, Hkv=2, Sq=100, Sk=40, D=64, dtype=torch.float16, causal="bottom_right")  # empty rows
        return
    for D in (32, 64, 96, 128, 160, 200, 256):  # every instantiated width, and one padded (200)
        yield Case(B=2, Hq=4, Hkv=1, Sq=300, Sk=517, D=D, dtype=torch.bfloat16, causal="bottom_right")
    yield Case(B=1, Hq=2, Hkv=2, Sq=1, Sk=4099, D=128, dtype=torch.float16)  # decode
    yield Case(B=1, Hq=2, Hkv=2, Sq=2048, Sk=2048, D=128, dtype=torch.bfloat16, causal=True, softcap=30.0)
    yield Case(B=1, Hq=2, Hkv=2, Sq=200, Sk=100, D=64, dtype=torch.float16, causal="bottom_right")  # empty rows


def run_flash(q, k, v, mask, case):
    return ab.attention(q, k, v, backend="flash", causal=case.causal, attn_mask=mask, window=case.window,
                        softcap=case.softcap, return_lse=True, strict=True)


@pytest.mark.parametrize("dev, case", both(list(_flash_cases()), list(_flash_cases(emulated=True))), indirect=["dev"])
def test_cuda_flash_forward_matches_reference(dev, case, gen):
    assert ab.explain(*(torch.empty(1, 1, 1, case.D, device=dev.type, dtype=case.dtype),) * 3,
                      backend="flash").chosen == "flash"
    check_against_reference(case, run_flash, grad=False, device=dev.type, generator=gen)


@pytest.mark.parametrize("dev", DEVICES, indirect=True)
def test_cuda_flash_fully_masked_rows_are_zero(dev):
    # bottom-right causal with Sq > Sk: the first Sq - Sk rows see no key
    q = torch.randn(1, 2, 40, 64, device=dev.type, dtype=torch.float16)
    k, v = (torch.randn(1, 2, 25, 64, device=dev.type, dtype=torch.float16) for _ in range(2))
    out, lse = ab.attention(q, k, v, causal="bottom_right", backend="flash", return_lse=True, strict=True)
    assert torch.all(out[:, :, :15] == 0) and torch.all(lse[:, :, :15] == -math.inf)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dev", DEVICES, indirect=True)
@pytest.mark.parametrize("grad", [False, True])
def test_cuda_flash_takes_empty_views_of_any_strides(dev, grad):
    # no key (Sk = 0) with v a strided view: torch's contiguous() keeps an empty view's strides, and the
    # launcher refused it ("needs v's last dim contiguous"); a random problem on the emulator found it
    q = dev(torch.randn(1, 2, 3, 32)).to(torch.bfloat16).requires_grad_(grad)
    k = dev(torch.randn(1, 2, 0, 32)).to(torch.bfloat16).requires_grad_(grad)
    v = dev(torch.randn(1, 2, 0, 64)).to(torch.bfloat16)[..., ::2].requires_grad_(grad)
    out, lse = ab.attention(q, k, v, backend="flash", return_lse=True, strict=True)
    assert torch.all(out == 0) and torch.all(lse == -math.inf)
    if grad:
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        assert torch.all(dq == 0) and dk.shape == k.shape and dv.shape == v.shape


@pytest.mark.parametrize("dev", DEVICES, indirect=True)
def test_cuda_flash_with_a_mask_falls_back(dev):
    q, k, v = (torch.randn(1, 2, 33, 64, device=dev.type, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    bias = torch.randn(33, 33, device=dev.type, dtype=torch.bfloat16)
    assert ab.explain(q, k, v, backend="flash", attn_mask=bias).chosen != "flash"  # no masks in CUDA flash
    with pytest.raises(RuntimeError):
        ab.attention(q, k, v, backend="flash", attn_mask=bias, strict=True)


def _varlen_lens(dev):
    # sequences of 0 and 1 rows, one with no key, and (on a GPU) long ones
    if dev.emulated:
        return [1, 70, 0, 33, 5], [5, 70, 9, 100, 0]
    return [1, 130, 0, 67, 513], [5, 130, 9, 300, 513]


@pytest.mark.parametrize("dev", DEVICES, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal, window", [(False, None), (True, None), ("bottom_right", (16, 0))])
def test_cuda_flash_varlen_matches_reference(dev, dtype, causal, window, gen):
    lens_q, lens_k = _varlen_lens(dev)
    q, k, v, cu_q, cu_k = make_packed(lens_q, lens_k, 4, 2, 128, 128, dtype, gen)
    q, k, v = dev(q), dev(k), dev(v)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = ab.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), backend="flash_varlen",
                                   causal=causal, window=window, return_lse=True, strict=True)
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    r_out, r_lse = varlen_reference(*leaves64, cu_q, cu_k, causal=causal, window=window)
    d_out, d_lse = varlen_reference(*leaves, cu_q, cu_k, dtype=dtype, causal=causal, window=window)
    check_2x("out", out, r_out, d_out, 2, dtype)
    check_2x("lse", lse, r_lse, d_lse, 2, dtype)
    g = dev(torch.randn(out.shape, generator=gen).to(dtype=dtype))
    ours = torch.autograd.grad(out, (q, k, v), g)
    ref = torch.autograd.grad(r_out, leaves64, g.double())
    same = torch.autograd.grad(d_out, leaves, g)
    for name, a, r, d in zip(("dq", "dk", "dv"), ours, ref, same):
        check_2x(name, a, r, d, 3, dtype)


@pytest.mark.cuda
def test_cuda_varlen_reads_the_callers_device_cu_seqlens(gen):
    # int32 cu_seqlens on the GPU go to the kernels as they are (no host-to-device copy per call); host
    # ones take the copy; both give the same bits; int64 ones are refused by name, as in flash-attn
    # (DESIGN.md: cu_seqlens int32), and so is a malformed device pair
    lens = [5, 33, 1]
    q, k, v, cu_q, cu_k = make_packed(lens, lens, 4, 2, 64, 64, torch.bfloat16, gen)
    q, k, v = (t.cuda().requires_grad_() for t in (q, k, v))
    outs = []
    for cq, ck in ((cu_q.cuda(), cu_k.cuda()), (cu_q, cu_k)):
        out = ab.attention_varlen(q, k, v, cq, ck, 33, 33, causal=True, backend="flash_varlen", strict=True)
        outs.append((out, *torch.autograd.grad(out.float().sum(), (q, k, v))))
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    with pytest.raises(TypeError, match="cu_seqlens_q must be int32"):
        ab.attention_varlen(q, k, v, cu_q.cuda().long(), cu_k.cuda().long(), 33, 33, backend="flash_varlen")
    with pytest.raises(RuntimeError, match="cu_seqlens_k_device"):
        ops.flash_varlen_fwd(q.detach(), k.detach(), v.detach(), cu_q, cu_k, 33, 33, None, 1, 0.125, -1, -1, 0.0,
                             0.0, None, None, cu_q.cuda(), cu_k.cuda()[:-1])


# ---- backward (csrc/cuda/math_bwd.cu, flash_bwd*.cu) ---------------------------------------------


@pytest.mark.parametrize("dev, case", both(list(cases(quick=True)), [c for c in cases(quick=True) if _small(c)]),
                         indirect=["dev"])
def test_cuda_math_backward_matches_reference(dev, case, gen):
    check_against_reference(case, run_math, grad=True, device=dev.type, generator=gen)


def _flash_backward_cases(emulated=False):
    if not emulated:
        return [c for c in _flash_cases() if c.Sq * c.Sk <= 2048 * 2048]
    # every backward head dim (64, 128, 192, 256; 40 and 96 padded), both dtypes, the masking variants
    out = [c for c in _flash_cases(emulated=True) if c.D in (40, 64, 96, 192) or c.Sq * c.Sk <= 64 * 64]
    out.append(Case(B=1, Hq=2, Hkv=1, Sq=70, Sk=130, D=128, dtype=torch.bfloat16, causal=True))
    out.append(Case(B=1, Hq=2, Hkv=1, Sq=65, Sk=66, D=256, dtype=torch.float16, causal="bottom_right"))
    return out


@pytest.mark.parametrize("dev, case", both(_flash_backward_cases(), _flash_backward_cases(emulated=True)),
                         indirect=["dev"])
def test_cuda_flash_backward_matches_reference(dev, case, gen):
    check_against_reference(case, run_flash, grad=True, device=dev.type, generator=gen)


@pytest.mark.parametrize("dev", DEVICES, indirect=True)
@pytest.mark.parametrize("backend", ["math", "flash"])
def test_cuda_backward_with_lse_gradient_and_broadcast_grad_out(dev, backend, gen):
    # sum() hands the backward a stride-0 grad_out; lse's gradient flows into delta
    case = Case(B=2, Hq=4, Hkv=2, Sq=70, Sk=130, D=64, dtype=torch.bfloat16, causal="bottom_right")
    q, k, v, _ = make_inputs(case, device=dev.type, requires_grad=True, generator=gen)
    out, lse = ab.attention(q, k, v, backend=backend, causal=case.causal, return_lse=True, strict=True)
    ours = torch.autograd.grad(out.float().sum() + lse.sum(), (q, k, v))
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    r_out, r_lse = reference_attention(*leaves64, causal=case.causal)
    ref = torch.autograd.grad(r_out.sum() + r_lse.sum(), leaves64)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    d_out, d_lse = reference_attention(*leaves, causal=case.causal, dtype=case.dtype)
    same = torch.autograd.grad(d_out.float().sum() + d_lse.sum(), leaves)
    for name, a, r, d in zip(("dq", "dk", "dv"), ours, ref, same):
        check_2x(name, a, r, d, 3, case.dtype)


@pytest.mark.parametrize("dev", DEVICES, indirect=True)
def test_cuda_math_float_mask_gradient(dev, gen):
    q = dev(torch.randn(2, 4, 7, 16, generator=gen)).requires_grad_()
    k, v = (dev(torch.randn(2, 2, 11, 16, generator=gen)).requires_grad_() for _ in range(2))
    bias = dev(torch.randn(1, 4, 7, 11, generator=gen)).requires_grad_()
    out = ab.attention(q, k, v, attn_mask=bias, causal=True, softcap=4.0, backend="math", strict=True)
    g = dev(torch.randn(out.shape, generator=gen))
    ours = torch.autograd.grad(out, (q, k, v, bias), g)
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
    r_out, _ = reference_attention(*leaves64[:3], attn_mask=leaves64[3], causal=True, softcap=4.0)
    ref = torch.autograd.grad(r_out, leaves64, g.double())
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, bias)]
    d_out, _ = reference_attention(*leaves[:3], attn_mask=leaves[3], causal=True, softcap=4.0, dtype=torch.float32)
    same = torch.autograd.grad(d_out, leaves, g)
    for name, a, r, d in zip(("dq", "dk", "dv", "dmask"), ours, ref, same):
        check_2x(name, a, r, d, 3, torch.float32)


@pytest.mark.parametrize("dev", DEVICES, indirect=True)
def test_cuda_fully_masked_rows_get_zero_gradient(dev):
    q = torch.randn(1, 2, 40, 64, device=dev.type, dtype=torch.float16, requires_grad=True)
    k, v = (torch.randn(1, 2, 25, 64, device=dev.type, dtype=torch.float16, requires_grad=True) for _ in range(2))
    for backend in ("flash", "math"):
        out = ab.attention(q, k, v, causal="bottom_right", backend=backend, strict=True)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        assert torch.all(dq[:, :, :15] == 0), backend  # rows 0..14 see no key
        assert all(torch.isfinite(t).all() for t in (dq, dk, dv)), backend


def _grads(fn, q, k, v, g):
    out = fn(q, k, v)
    return torch.cat([t.flatten().float() for t in torch.autograd.grad(out, (q, k, v), g)])


@pytest.mark.parametrize("dev", DEVICES, indirect=True)
@pytest.mark.parametrize("how", ["argument", "torch_flag"])
@pytest.mark.parametrize("D, causal, Hkv", [(64, False, 4), (128, True, 1), (256, "bottom_right", 2)])
def test_cuda_flash_deterministic_backward_is_bitwise_reproducible(dev, how, D, causal, Hkv):
    # emulated: fewer rows, but still several query and key tiles (the emulator draws a new schedule,
    # and a new order of the atomics, on every launch)
    B, Sq, Sk = (1, 65, 129) if dev.emulated else (2, 777, 1029)
    q = torch.randn(B, 4, Sq, D, device=dev.type, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, Hkv, Sk, D, device=dev.type, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    g = torch.randn(B, 4, Sq, D, device=dev.type, dtype=torch.bfloat16)
    det = how == "argument"

    def fn(q, k, v):
        return ab.attention(q, k, v, causal=causal, backend="flash", strict=True, deterministic=det)

    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(how == "torch_flag" or before)
    try:
        first = _grads(fn, q, k, v, g)
        for _ in range(1 if dev.emulated else 4):
            assert torch.equal(_grads(fn, q, k, v, g), first)
    finally:
        torch.use_deterministic_algorithms(before)
    # the fast (atomic) path computes the same gradients up to the order of float32 additions
    fast = _grads(lambda q, k, v: ab.attention(q, k, v, causal=causal, backend="flash", strict=True), q, k, v, g)
    assert (fast - first).abs().max().item() <= 2e-2 * first.abs().max().item()


@pytest.mark.parametrize("dev", DEVICES, indirect=True)
def test_cuda_math_backward_is_bitwise_reproducible(dev):
    S = 70 if dev.emulated else 300
    q, k, v = (torch.randn(1, 4, S, 64, device=dev.type, dtype=torch.float32, requires_grad=True) for _ in range(3))
    g = torch.randn(1, 4, S, 64, device=dev.type)

    def fn(q, k, v):
        return ab.attention(q, k, v, causal=True, dropout_p=0.2, backend="math", strict=True)

    torch.manual_seed(3)
    first = _grads(fn, q, k, v, g)
    for _ in range(3):
        torch.manual_seed(3)
        assert torch.equal(_grads(fn, q, k, v, g), first)


# ---- dropout on CUDA -----------------------------------------------------------------------------


@pytest.mark.parametrize("dev", DEVICES, indirect=True)
def test_cuda_dropout_mask_is_the_cpu_mask(dev):
    rng = _providers.draw_rng_state()
    for shape in [(2, 3, 37, 41), (1, 1, 5, 4099), (1, 2, 1, 1)]:
        with dev.off():  # the CPU kernel
            cpu = ops.dropout_mask(rng, *shape, 0.3)
        gpu = ops.dropout_mask(dev(rng), *shape, 0.3)  # the CUDA kernel (emulated: on the CPU)
        assert gpu.device.type == dev.type and torch.equal(gpu.cpu(), cpu)


@pytest.mark.parametrize("dev", DEVICES, indirect=True)
def test_cuda_dropout_keep_fraction_matches_p(dev):
    n_rows, Sk = (256, 253) if dev.emulated else (1024, 1021)
    for p in (0.1, 0.5, 0.9):
        keep = ops.dropout_mask(dev(_providers.draw_rng_state()), 1, 1, n_rows, Sk, p).double()
        sigma = math.sqrt(p * (1 - p) / keep.numel())
        assert abs(keep.mean().item() - (1 - p)) < 6 * sigma, p
        cols = keep.mean(dim=(0, 1, 2))
        assert (cols - (1 - p)).abs().max() < 6 * math.sqrt(p * (1 - p) / n_rows)


@pytest.mark.parametrize("dev", DEVICES, indirect=True)
@pytest.mark.parametrize("backend, dtype, D", [("math", torch.float32, 40), ("math", torch.float64, 24),
                                               ("flash", torch.bfloat16, 64), ("flash", torch.float16, 128),
                                               ("flash", torch.bfloat16, 256)])
@pytest.mark.parametrize("p", [0.1, 0.6])
def test_cuda_dropout_forward_and_backward_replay_the_mask(dev, backend, dtype, D, p, gen):
    case = Case(B=2, Hq=4, Hkv=2, Sq=77, Sk=130, D=D, dtype=dtype, causal=True)
    q, k, v, _ = make_inputs(case, device=dev.type, requires_grad=True, generator=gen)
    with dev.off():  # the mask of the CPU kernels, which the CUDA ones must draw too
        keep = dev(keep_mask_for_next_call(99, case.B, case.Hq, case.Sq, case.Sk, p))
    torch.manual_seed(99)
    out = ab.attention(q, k, v, causal=True, dropout_p=p, backend=backend, strict=True)
    g = dev(torch.randn(out.shape, generator=gen).to(dtype=dtype))
    ours = torch.autograd.grad(out, (q, k, v), g)
    check_out_and_grads_2x(out, ours, (q, k, v), g, dtype, causal=True, keep=keep, dropout_p=p)


@pytest.mark.parametrize("dev", DEVICES, indirect=True)
def test_cuda_dropout_same_seed_same_output_on_cpu_and_cuda(dev):
    # the same torch.manual_seed draws the same (seed, offset) and the same mask on both devices
    q, k, v = (torch.randn(2, 4, 50, 64, dtype=torch.float32) for _ in range(3))
    torch.manual_seed(5)
    with dev.off():
        cpu = ab.attention(q, k, v, dropout_p=0.3, backend="math", strict=True)
    for backend, dtype in (("math", torch.float32), ("flash", torch.bfloat16)):
        torch.manual_seed(5)
        out = ab.attention(*(dev(t).to(dtype) for t in (q, k, v)), dropout_p=0.3, backend=backend, strict=True)
        assert (out.float().cpu() - cpu).abs().max().item() < (1e-5 if dtype == torch.float32 else 5e-2), backend


@pytest.mark.parametrize("dev", DEVICES, indirect=True)
def test_cuda_flash_varlen_dropout_matches_its_padded_dense_twin(dev, gen):
    # packed and dense calls number dropout rows alike ((b * Hq + h) * max_seqlen_q + i)
    lens = [37, 64, 5]
    q, k, v, cu_q, cu_k = make_packed(lens, lens, 4, 2, 64, 64, torch.bfloat16, gen)
    q, k, v = dev(q), dev(k), dev(v)
    torch.manual_seed(21)
    packed = ab.attention_varlen(q, k, v, cu_q, cu_k, 64, 64, dropout_p=0.4, causal=True, backend="flash_varlen",
                                 strict=True)
    torch.manual_seed(21)
    padded = ab.attention_varlen(q, k, v, cu_q, cu_k, 64, 64, dropout_p=0.4, causal=True, backend="math",
                                 strict=True)
    assert (packed.float() - padded.float()).abs().max().item() < 5e-2


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["math", "flash"])
def test_cuda_dropout_advances_on_each_cuda_graph_replay(backend):
    q, k, v = (torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.bfloat16)

    def step():
        out = ab.attention(q, k, v, dropout_p=0.5, backend=backend, strict=True)
        out.backward(g)
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the graph (allocations, plans)
        step()
    torch.cuda.current_stream().wait_stream(side)
    for t in (q, k, v):
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    results = []
    for _ in range(3):
        for t in (q, k, v):
            t.grad.zero_()
        graph.replay()
        torch.cuda.synchronize()
        results.append((out.clone(), v.grad.clone()))
    assert not torch.equal(results[0][0], results[1][0]) and not torch.equal(results[1][0], results[2][0])
    assert not torch.equal(results[0][1], results[1][1])  # the backward follows the fresh mask
    for o, dv in results:
        assert torch.isfinite(o).all() and torch.isfinite(dv).all()
