"""The emulation of the AMX tile instructions (csrc/cpu/ab_amx.h) against a model of the instruction
reference written here independently (float32 chains, DAZ and FTZ, VNNI pairs, int32 wraparound),
bit for bit, and its faults where the hardware faults."""

import subprocess
import sys

import numpy as np
import pytest

from attn_backends import _C


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
