"""The AMX tile kernels (csrc/cpu/flash_amx_{fwd,bwd}_impl.h, sage_amx_impl.h; docs/amx.md) on every
CPU, through the emulation of the tile instructions (csrc/cpu/ab_amx.h, the "amx_emu" path), and on
real tiles where the CPU has them (the "amx" path runs the same tests):

- the emulation itself against a model of the instruction reference written here independently
  (float32 chains, DAZ and FTZ, VNNI pairs, int32 wraparound), bit for bit, and its faults;
- what the shared grids of test_flash_cpu.py and test_sage.py do not reach on tiles: several key
  panels and blocks, float16 on AMX-FP16, dropout replayed by the backward, the float mask's
  gradient, results independent of the thread count, the caller's tensors left untouched;
- the path's selection: never the default, float32 on the vector kernel, a clear error where
  ATTN_BACKENDS_CPU_ISA asks for AMX the CPU lacks.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import attn_backends as ab
from attn_backends import _C
from attn_backends._testing import (Case, check_2x, check_against_reference, check_out_and_grads_2x,
                                   keep_mask_for_next_call, make_inputs, reference_attention)

TILE_ISAS = [isa for isa in ("amx", "amx_emu") if _C.cpu_isa_supported(isa)]


@pytest.fixture(params=TILE_ISAS)
def tiles(request):
    before = _C.cpu_isa()
    assert _C.set_cpu_isa(request.param)
    yield request.param
    _C.set_cpu_isa(before)


# ---- the emulated instructions against the instruction reference ---------------------------------

F32_MIN = np.float32(2.0**-126)
OPS = {"tdpbf16ps": 0, "tdpfp16ps": 1, "tdpbssd": 2, "tdpbusd": 3}


def ftz(x):
    """Denormal float32 values to signed zero (DAZ on inputs, FTZ on results)."""
    x = np.asarray(x, dtype=np.float32)
    return np.where(np.abs(x) < F32_MIN, np.copysign(np.float32(0.0), x), x).astype(np.float32)


def model_dp_half(c, a, b, fp16):
    """TDPBF16PS / TDPFP16PS as the SDM writes them: per row of C, even and odd elements of the pairs
    in two float32 chains from 0 over k, then C += even + odd; bfloat16 inputs DAZ, float16 exact."""
    M, N = c.shape
    K = b.shape[0]
    if fp16:
        A, B = a.view(np.float16).astype(np.float32), b.view(np.float16).astype(np.float32)
    else:
        A = ftz((a.astype(np.uint32) << 16).view(np.float32))
        B = ftz((b.astype(np.uint32) << 16).view(np.float32))
    out = c.copy()
    for m in range(M):
        even, odd = np.zeros(N, np.float32), np.zeros(N, np.float32)
        for k in range(K):
            even = ftz(even + A[m, 2 * k] * B[k, 0::2])
            odd = ftz(odd + A[m, 2 * k + 1] * B[k, 1::2])
        out[m] = ftz(ftz(out[m]) + ftz(even + odd))
    return out


def model_dp_int8(c, a, b, a_unsigned):
    """TDPBSSD / TDPBUSD: 4-byte groups, int32 sums with wraparound."""
    M, N = c.shape
    K = b.shape[0]
    A = a.view(np.uint8 if a_unsigned else np.int8).astype(np.int64).reshape(M, K, 4)
    B = b.view(np.int8).astype(np.int64).reshape(K, N, 4)
    s = c.astype(np.int64) + np.einsum("mki,kni->mn", A, B)
    return ((s + 2**31) % 2**32 - 2**31).astype(np.int32)


def halves(rng, shape, fp16):
    """16-bit floats with every kind of value a product meets: ordinary, tiny (products that
    underflow), denormal (DAZ for bfloat16, exact for float16), zeros of both signs."""
    x = rng.standard_normal(shape).astype(np.float32) * np.float32(3.0)
    kind = rng.integers(0, 10, shape)
    x = np.where(kind == 0, x * np.float32(1e-20 if not fp16 else 1e-3), x)
    x = np.where(kind == 1, x * np.float32(1e-39 if not fp16 else 1e-6), x)
    x = np.where(kind == 2, np.float32(-0.0), x)
    if fp16:
        return x.astype(np.float16).view(np.uint16)
    u = x.view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


@pytest.mark.parametrize("M, N, K", [(16, 16, 16), (5, 3, 7)])
@pytest.mark.parametrize("op", ["tdpbf16ps", "tdpfp16ps"])
def test_emulated_float_products_follow_the_instruction_reference(op, M, N, K):
    rng = np.random.default_rng(M * 100 + N)
    fp16 = op == "tdpfp16ps"
    a, b = halves(rng, (M, 2 * K), fp16), halves(rng, (K, 2 * N), fp16)
    c = rng.standard_normal((M, N)).astype(np.float32)
    c[0, 0] = np.float32(1e-40)  # a denormal accumulator is read as zero
    c[-1, -1] = np.float32(-3e-39)
    shape = (M, 4 * N, M, 4 * K, K, 4 * N)
    got = np.frombuffer(_C._amx_emu_dot(OPS[op], a.tobytes(), b.tobytes(), c.tobytes(), shape), np.float32)
    want = model_dp_half(c, a, b, fp16)
    assert np.array_equal(got.view(np.uint32), want.reshape(-1).view(np.uint32))


@pytest.mark.parametrize("M, N, K", [(16, 16, 16), (5, 3, 7)])
@pytest.mark.parametrize("op", ["tdpbssd", "tdpbusd"])
def test_emulated_int8_products_wrap_around_in_int32(op, M, N, K):
    rng = np.random.default_rng(M + N)
    a = rng.integers(0, 256, (M, 4 * K), dtype=np.uint8)
    b = rng.integers(0, 256, (K, 4 * N), dtype=np.uint8)
    c = rng.integers(-(2**31), 2**31, (M, N), dtype=np.int64).astype(np.int32)
    c[0, :], c[1, :] = 2**31 - 5, -(2**31) + 5  # next to either end: sums cross it
    shape = (M, 4 * N, M, 4 * K, K, 4 * N)
    got = np.frombuffer(_C._amx_emu_dot(OPS[op], a.tobytes(), b.tobytes(), c.tobytes(), shape), np.int32)
    want = model_dp_int8(c, a, b, op == "tdpbusd")
    assert np.array_equal(got, want.reshape(-1))
    exact = c.astype(np.int64) + (model_dp_int8(np.zeros_like(c), a, b, op == "tdpbusd").astype(np.int64))
    assert ((exact > 2**31 - 1) | (exact < -(2**31))).any()  # some sum did wrap


@pytest.mark.parametrize("shape, what", [
    ((5, 12, 5, 28, 6, 12), "tdpbf16ps: A's 4-byte groups per row differ from B's rows"),
    ((17, 4, 17, 4, 1, 4), "ldtilecfg: tile larger than 16 rows x 64 bytes"),
])
def test_emulated_instructions_fault_where_the_hardware_does(shape, what):
    code = ("from attn_backends import _C\n"
            f"s = {shape!r}\n"
            "_C._amx_emu_dot(0, bytes(s[2] * s[3]), bytes(s[4] * s[5]), bytes(s[0] * s[1]), s)\n"
            "print('no fault')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode != 0 and "no fault" not in res.stdout
    assert f"emulated AMX fault: {what}" in res.stderr, res.stderr


# ---- the kernels on tiles: what the shared grids do not reach ------------------------------------


def run_flash(q, k, v, mask, case):
    return ab.attention(q, k, v, backend="flash", causal=case.causal, attn_mask=mask, window=case.window,
                        softcap=case.softcap, return_lse=True, strict=True)


# forward panels are 256 keys and backward blocks 64: these cross several of each, with the scale
# folded into the exponential (no softcap, no float mask) and applied first (the others)
LONG = [
    Case(B=1, Hq=4, Hkv=1, Sq=70, Sk=600, D=64, dtype=torch.bfloat16, causal="bottom_right"),
    Case(B=1, Hq=2, Hkv=2, Sq=1, Sk=300, D=128, dtype=torch.bfloat16),
    Case(B=1, Hq=2, Hkv=1, Sq=300, Sk=300, D=40, Dv=72, dtype=torch.bfloat16, causal=True, window=(100, 3),
         softcap=3.0, mask="float_rows"),
    Case(B=2, Hq=2, Hkv=1, Sq=65, Sk=1, D=8, dtype=torch.bfloat16, causal="bottom_right", layout="bshd"),
    Case(B=1, Hq=2, Hkv=2, Sq=40, Sk=520, D=96, dtype=torch.float16, mask="key_padding", layout="strided_d"),
]


@pytest.mark.parametrize("case", LONG, ids=str)
def test_flash_on_tiles_across_panels_and_blocks(tiles, case, gen):
    check_against_reference(case, run_flash, grad=True, generator=gen)


@pytest.mark.parametrize("p", [0.2])
def test_dropout_is_replayed_by_the_backward_on_tiles(tiles, p, gen):
    case = Case(B=2, Hq=4, Hkv=2, Sq=41, Sk=300, D=24, dtype=torch.bfloat16, causal=True, mask="float_rows")
    q, k, v, mask = make_inputs(case, requires_grad=True, generator=gen)
    keep = keep_mask_for_next_call(99, case.B, case.Hq, case.Sq, case.Sk, p)
    torch.manual_seed(99)
    out = ab.attention(q, k, v, causal=True, attn_mask=mask, dropout_p=p, backend="flash", strict=True)
    g = torch.randn(out.shape, generator=gen).to(case.dtype)
    grads = torch.autograd.grad(out, (q, k, v), g)
    check_out_and_grads_2x(out, grads, (q, k, v), g, case.dtype, causal=True, attn_mask=mask, keep=keep,
                           dropout_p=p)


def test_float_mask_gradient_on_tiles(tiles, gen):
    q = torch.randn(2, 4, 37, 32, generator=gen).bfloat16().requires_grad_()
    k = torch.randn(2, 2, 90, 32, generator=gen).bfloat16().requires_grad_()
    v = torch.randn(2, 2, 90, 32, generator=gen).bfloat16().requires_grad_()
    bias = torch.randn(2, 1, 37, 90, generator=gen).bfloat16().requires_grad_()
    out = ab.attention(q, k, v, attn_mask=bias, causal="bottom_right", softcap=4.0, backend="flash", strict=True)
    g = torch.randn(out.shape, generator=gen).bfloat16()
    ours = torch.autograd.grad(out, (q, k, v, bias), g)
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
    r_out, _ = reference_attention(*leaves64[:3], attn_mask=leaves64[3], causal="bottom_right", softcap=4.0)
    ref = torch.autograd.grad(r_out, leaves64, g.double())
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, bias)]
    d_out, _ = reference_attention(*leaves[:3], attn_mask=leaves[3], causal="bottom_right", softcap=4.0,
                                   dtype=torch.bfloat16)
    same = torch.autograd.grad(d_out, leaves, g)
    for name, a, r, s in zip(("dq", "dk", "dv", "dmask"), ours, ref, same):
        check_2x(name, a, r, s, 3, torch.bfloat16)


def test_results_do_not_depend_on_thread_count(tiles, gen):
    q, k, v, _ = make_inputs(Case(B=2, Hq=4, Hkv=2, Sq=100, Sk=280, D=64, dtype=torch.bfloat16),
                             requires_grad=True, generator=gen)
    results = []
    n = torch.get_num_threads()
    try:
        for threads in (1, max(2, n)):
            torch.set_num_threads(threads)
            out = ab.attention(q, k, v, causal=True, backend="flash", strict=True)
            grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
            with torch.no_grad():
                sage = ab.attention(q, k, v, causal=True, backend="sage", strict=True)
            results.append((out.detach(), *grads, sage))
    finally:
        torch.set_num_threads(n)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_inputs_are_not_modified_on_tiles(tiles, gen):
    case = Case(B=2, Hq=4, Hkv=2, Sq=33, Sk=47, D=40, dtype=torch.bfloat16, layout="bshd", mask="float_rows")
    q, k, v, mask = make_inputs(case, requires_grad=True, generator=gen)
    mask.requires_grad_(True)
    before = [t.detach().clone() for t in (q, k, v, mask)]
    out = ab.attention(q, k, v, attn_mask=mask, causal=True, softcap=2.0, dropout_p=0.2, backend="flash", strict=True)
    out.float().sum().backward()
    with torch.no_grad():
        ab.attention(q, k, v, attn_mask=mask.detach(), backend="sage", strict=True)
    for a, b in zip(before, (q, k, v, mask)):
        assert torch.equal(a, b.detach())


# ---- the path: selectable, never the default, float32 on the vector kernel --------------------------


def test_tile_paths_are_never_the_default():
    res = subprocess.run([sys.executable, "-c", "from attn_backends import _C; print(_C.cpu_isa())"],
                         capture_output=True, text=True, env={k: v for k, v in os.environ.items()
                                                              if k != "ATTN_BACKENDS_CPU_ISA"})
    assert res.returncode == 0 and res.stdout.strip() in ("generic", "avx2", "avx512")


def test_float32_runs_the_vector_kernel_on_the_tile_paths(tiles, gen):
    # the vector kernel the tile path sits on computes float32 as it is: far closer to the vector path
    # than the 16-bit rounding of a tile product would be
    q, k, v = (torch.randn(1, 2, 40, 24, generator=gen) for _ in range(3))
    out = ab.attention(q, k, v, causal=True, backend="flash", strict=True)
    _C.set_cpu_isa("generic" if tiles == "amx_emu" else "avx512")
    try:
        torch.testing.assert_close(out, ab.attention(q, k, v, causal=True, backend="flash", strict=True),
                                   rtol=1e-6, atol=1e-6)
    finally:
        _C.set_cpu_isa(tiles)


@pytest.mark.parametrize("isa", TILE_ISAS)
def test_tile_path_from_the_environment(isa):
    code = ("import attn_backends as ab, torch\n"
            "q = torch.randn(1, 1, 20, 32, dtype=torch.bfloat16)\n"
            "print(ab._C.cpu_isa(), ab.explain(q, q, q, backend='flash').path)\n"
            "print(ab.attention(q, q, q, backend='flash', strict=True).shape, ab._C.cpu_isa_error())\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, ATTN_BACKENDS_CPU_ISA=isa))
    assert res.returncode == 0, res.stderr
    assert f"{isa} cpu {isa}" in res.stdout and "torch.Size([1, 1, 20, 32]) None" in res.stdout


@pytest.mark.skipif(_C.cpu_isa_supported("amx"), reason="this CPU has AMX: the request is honoured")
def test_amx_is_refused_where_absent():
    assert not _C.set_cpu_isa("amx")
    code = ("import attn_backends as ab, torch\n"
            "q = torch.randn(1, 1, 4, 8, dtype=torch.bfloat16)\n"
            "try:\n    ab.attention(q, q, q, backend='flash', strict=True)\n"
            "except RuntimeError as e:\n    print('raised:', e)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, ATTN_BACKENDS_CPU_ISA="amx"))
    assert res.returncode == 0, res.stderr
    assert "raised: attn_backends: ATTN_BACKENDS_CPU_ISA=amx: " in res.stdout


def test_backward_on_tiles_reads_the_forward_row_statistics(tiles, gen):
    # the tile backward takes P from the forward's two-part row statistics (max, log sum) when it
    # has them, as the vector backward does (lse's float32 rounding grows with |lse|), and from lse
    # alone otherwise (the ring's calls): an lse that disagrees with the stats shows which one it read
    from attn_backends._ops import ops

    q = torch.randn(2, 4, 45, 72, generator=gen).to(torch.bfloat16)
    k = torch.randn(2, 2, 70, 72, generator=gen).to(torch.bfloat16)
    v = torch.randn(2, 2, 70, 40, generator=gen).to(torch.bfloat16)
    out, lse, stats = ops.flash_fwd(q, k, v, None, None, 1, 0.3, -1, -1, 0.0, 0.0)
    g = torch.randn(out.shape, generator=gen).to(torch.bfloat16)

    def bwd(lse_, stats_):
        return ops.flash_bwd(g, q, k, v, out, lse_, None, None, None, 1, 0.3, -1, -1, 0.0, 0.0, False, False, stats_)[:3]

    with_stats = bwd(lse, stats)
    for a, b in zip(with_stats, bwd(lse + 3.0, stats)):
        assert torch.equal(a, b)  # the stats were read, not lse
    lse_only, shifted = bwd(lse, None), bwd(lse + 3.0, None)
    assert not torch.equal(lse_only[2], shifted[2])  # without stats, lse is read
    # both within the rule of the float64 reference (the two differ by lse's rounding alone)
    for grads in (with_stats, lse_only):
        check_out_and_grads_2x(out, grads, (q, k, v), g, torch.bfloat16, causal=True, scale=0.3)
