"""The CUDA sage kernel (csrc/cuda/sage_fwd*.cu; docs/sage.md, "CUDA"), marked `cuda` and skipped
without a GPU.  Against the float64 reference with the sage rule (cosine >= 0.999, relative L1 <= 0.02;
K channels scaled by 10, which smoothing only halves in log terms, to their own measured bound), against
the float64 emulation of its own recipe (attn_backends._testing.sage_recipe: lse to float rounding,
which catches any indexing or scale mix-up), against the CPU sage kernel on the same inputs, packed
against dense, the head-dim paddings, fully masked rows and empty shapes, NaN confinement, the current
stream, the caller's tensors left untouched, and the planner's rules on a real device (forward only;
auto never picks it).  One command on a GPU machine: `python -m pytest -m cuda tests/test_sage_cuda.py`.
Each test also runs on the CUDA emulator ("emu", marked `cuda_emu`: CPU tensors, the same kernels;
tests/cuda_devices.py), on shorter sequences."""

import dataclasses
import logging
import math
import os

import pytest
import torch

import attn_backends as ab
from attn_backends import _dispatch
from attn_backends._testing import Case, make_inputs, make_packed, reference_attention, sage_recipe, varlen_reference

from cuda_devices import DEVICES, both
from test_sage import check_packed_equals_dense, check_sage, sage_metrics, with_outliers

pytestmark = pytest.mark.usefixtures("cuda_sage_on")

# K channels scaled by 10: the float64 emulation of the recipe measures relative L1 up to 0.021 at
# Sk = 4096 (docs/sage.md, "CUDA"); 16-bit P adds a little
SCALED = dict(rel_l1_max=0.03, lse_max=0.2, lse_mean=0.03)


@pytest.fixture
def cuda_sage_on():
    # our CUDA sage forward is opt-in until verified (ATTN_BACKENDS_CUDA_SAGE=1); these tests verify it
    ab._C.enable_cuda_sage(True)
    _dispatch.reset_caches()
    yield
    ab._C.enable_cuda_sage(os.environ.get("ATTN_BACKENDS_CUDA_SAGE", "0") == "1")
    _dispatch.reset_caches()


def run_sage(q, k, v, case, **kw):
    return ab.attention(q, k, v, backend="sage", causal=case.causal, window=case.window, softcap=case.softcap,
                        return_lse=True, strict=True, **kw)


def cuda_inputs(dev, case, gen, outliers="none"):
    q, k, v, _ = make_inputs(case, generator=gen)
    k = with_outliers(k, gen, outliers)
    return dev(q), dev(k), dev(v)


GRID = [
    Case(B=2, Hq=4, Hkv=4, Sq=17, Sk=23, D=40),                                     # padded to 64
    Case(B=1, Hq=1, Hkv=1, Sq=1, Sk=300, D=128),                                    # decode-like
    Case(B=1, Hq=3, Hkv=1, Sq=257, Sk=129, D=96, causal=True),                      # MQA, padded to 128
    Case(B=2, Hq=4, Hkv=2, Sq=70, Sk=200, D=256, causal="bottom_right"),            # GQA
    Case(B=1, Hq=2, Hkv=2, Sq=200, Sk=100, D=64, causal="bottom_right"),            # 100 rows see no key
    Case(B=1, Hq=2, Hkv=2, Sq=96, Sk=96, D=64, window=(7, 3), causal="bottom_right"),
    Case(B=1, Hq=2, Hkv=2, Sq=64, Sk=80, D=64, softcap=5.0),
    Case(B=1, Hq=2, Hkv=1, Sq=33, Sk=65, D=160, layout="bshd", window=(-1, 4)),    # padded to 256
    Case(B=1, Hq=2, Hkv=2, Sq=40, Sk=50, D=32, layout="strided_d", causal=True),    # copied to rows of 16 B
    Case(B=1, Hq=4, Hkv=2, Sq=1024, Sk=4096, D=128, causal="bottom_right"),         # long
    Case(B=1, Hq=2, Hkv=1, Sq=2048, Sk=2048, D=128, causal=True, softcap=30.0),
]
# the emulator's: the grid without its long sequences (every head dim, padding, masking variant stays),
# and keys past one K-statistics chunk (256 keys: the prepass's partial sums are then reduced)
EMU_GRID = [c for c in GRID if c.Sq * c.Sk <= 257 * 129] + [Case(B=1, Hq=2, Hkv=1, Sq=33, Sk=600, D=64,
                                                                  causal="bottom_right")]


@pytest.mark.parametrize("outliers", ["none", "offset", "scale"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dev, case", both(GRID, EMU_GRID), indirect=["dev"])
def test_cuda_sage_matches_reference(dev, case, dtype, outliers, gen):
    case = dataclasses.replace(case, dtype=dtype)
    q, k, v = cuda_inputs(dev, case, gen, outliers)
    assert ab.explain(q, k, v, backend="sage", causal=case.causal).chosen == "sage"
    out, lse = run_sage(q, k, v, case)
    check_sage(out, lse, q, k, v, causal=case.causal, window=case.window, softcap=case.softcap,
               **(SCALED if outliers == "scale" else {}))


@pytest.mark.parametrize("dev, case", both(GRID, EMU_GRID), indirect=["dev"])
def test_cuda_sage_computes_its_recipe(dev, case, gen):
    # the kernel's own arithmetic in float64: lse (fp32 sums, no 16-bit rounding) agrees to float
    # rounding (and the odd int8 value rounded the other way); out up to P's and out's bf16 rounding
    case = dataclasses.replace(case, dtype=torch.bfloat16)
    q, k, v = cuda_inputs(dev, case, gen, "offset")
    out, lse = run_sage(q, k, v, case)
    r_out, r_lse = sage_recipe(q, k, v, causal=case.causal, window=case.window, softcap=case.softcap)
    live = ~torch.isinf(r_lse)
    assert torch.equal(torch.isinf(lse), ~live)
    err = (lse.double() - r_lse)[live].abs()
    if err.numel():
        assert float(err.max()) <= 0.02 and float(err.mean()) <= 1e-3, (float(err.max()), float(err.mean()))
    cos, rel_l1 = sage_metrics(out, r_out)
    assert cos >= 0.9999 and rel_l1 <= 0.008, (cos, rel_l1)


@pytest.mark.parametrize("dev", DEVICES, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cpu_and_cuda_sage_agree(dev, dtype, gen):
    # the same recipe on both devices: each is within the sage rule of the reference, so of each other
    Sq, Sk = (70, 200) if dev.emulated else (300, 1000)
    case = Case(B=2, Hq=4, Hkv=2, Sq=Sq, Sk=Sk, D=128, dtype=dtype, causal="bottom_right")
    q, k, v, _ = make_inputs(case, generator=gen)
    k = with_outliers(k, gen, "offset")
    with dev.off():  # the CPU sage kernel
        cpu, cpu_lse = run_sage(q, k, v, case)
    gpu, gpu_lse = run_sage(dev(q), dev(k), dev(v), case)
    cos, rel_l1 = sage_metrics(gpu.cpu(), cpu)
    assert cos >= 0.999 and rel_l1 <= 0.02, (cos, rel_l1)
    assert float((gpu_lse.cpu() - cpu_lse).abs().max()) <= 0.1


VARLEN = [
    dict(lens_q=[5, 17, 1, 33], lens_k=[5, 17, 1, 33], causal=True),
    dict(lens_q=[3, 40, 0, 7, 300], lens_k=[9, 140, 4, 70, 700], causal="bottom_right"),
    dict(lens_q=[64, 65, 2], lens_k=[64, 1, 100], causal=False, window=(4, 2), softcap=3.0),
    dict(lens_q=[130, 0, 513], lens_k=[0, 9, 513], causal=False),  # a sequence with no key: zeros, lse -inf
]
EMU_VARLEN = [
    VARLEN[0],
    dict(lens_q=[3, 40, 0, 7, 70], lens_k=[9, 140, 4, 70, 100], causal="bottom_right"),
    VARLEN[2],
    dict(lens_q=[70, 0, 33], lens_k=[0, 9, 300], causal=False),
]


@pytest.mark.parametrize("dev, spec", both(VARLEN, EMU_VARLEN, lambda s: f"{s['lens_q']}x{s['lens_k']}"),
                         indirect=["dev"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_sage_varlen_matches_reference_and_dense(dev, spec, dtype, gen):
    spec = dict(spec)
    lens_q, lens_k = spec.pop("lens_q"), spec.pop("lens_k")
    q, k, v, cu_q, cu_k = make_packed(lens_q, lens_k, 4, 2, 128, 128, dtype, generator=gen)
    k = with_outliers(k, gen, "offset")
    q, k, v = dev(q), dev(k), dev(v)
    out, lse = ab.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), backend="sage",
                                   return_lse=True, strict=True, **spec)
    r_out, r_lse = varlen_reference(q, k, v, cu_q, cu_k, **spec)
    cos, rel_l1 = sage_metrics(out, r_out)
    assert cos >= 0.999 and rel_l1 <= 0.02, (cos, rel_l1)
    live = ~torch.isinf(r_lse)
    assert torch.equal(torch.isinf(lse), ~live)
    assert bool((out[(~live).T] == 0).all()), "a row with no visible key is not exactly 0"
    check_packed_equals_dense(out, q, k, v, cu_q, cu_k, **spec)


@pytest.mark.parametrize("dev", DEVICES, indirect=True)
def test_cuda_sage_fully_masked_rows_and_empty_shapes(dev, gen):
    q = torch.randn(1, 2, 40, 64, device=dev.type, dtype=torch.float16)
    k, v = (torch.randn(1, 2, 25, 64, device=dev.type, dtype=torch.float16) for _ in range(2))
    out, lse = ab.attention(q, k, v, causal="bottom_right", backend="sage", return_lse=True, strict=True)
    assert torch.all(out[:, :, :15] == 0) and torch.all(lse[:, :, :15] == -math.inf)
    assert torch.isfinite(out).all()
    # Sk = 0: zeros and lse -inf; B or Sq = 0: empty results
    out, lse = ab.attention(q, k[:, :, :0], v[:, :, :0], backend="sage", return_lse=True, strict=True)
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())
    for qq, kk, vv in ((q[:0], k[:0], v[:0]), (q[:, :, :0], k, v)):
        out, lse = ab.attention(qq, kk, vv, backend="sage", return_lse=True, strict=True)
        assert out.numel() == 0 and out.shape == qq.shape and lse.shape == qq.shape[:3]


@pytest.mark.parametrize("dev", DEVICES, indirect=True)
def test_cuda_sage_nan_in_a_query_row_stays_in_that_row(dev):
    q, k, v = (torch.randn(1, 1, 70, 64, device=dev.type, dtype=torch.bfloat16) for _ in range(3))
    q[0, 0, 2, 5] = math.nan
    out = ab.attention(q, k, v, backend="sage", strict=True)
    assert bool(torch.isnan(out[0, 0, 2]).all())
    rest = torch.cat([out[0, 0, :2], out[0, 0, 3:]])
    assert not bool(torch.isnan(rest).any())


@pytest.mark.parametrize("dev", DEVICES, indirect=True)
def test_cuda_sage_leaves_its_inputs_alone(dev, gen):
    case = Case(B=2, Hq=4, Hkv=2, Sq=33, Sk=47, D=64, dtype=torch.bfloat16, layout="bshd")
    q, k, v = cuda_inputs(dev, case, gen, "offset")
    saved = [t.clone() for t in (q, k, v)]
    run_sage(q, k, v, case)
    for a, b in zip((q, k, v), saved):
        assert torch.equal(a, b)


@pytest.mark.cuda
def test_cuda_sage_runs_on_the_current_stream():
    q, k, v = (torch.randn(4, h, 2048, 128, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2))
    ref, _ = reference_attention(q, k, v, causal=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # keep the side stream busy: a kernel on the wrong stream races
        out = ab.attention(q, k, v, backend="sage", causal=True, strict=True)
    torch.cuda.current_stream().wait_stream(side)
    cos, rel_l1 = sage_metrics(out, ref)
    assert cos >= 0.999 and rel_l1 <= 0.02


@pytest.mark.parametrize("dev", DEVICES, indirect=True)
def test_cuda_sage_is_forward_only_and_never_auto(dev, caplog):
    q, k, v = (torch.randn(1, 2, 33, 64, device=dev.type, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    p = ab.explain(q, k, v, backend="sage")
    assert p.chosen != "sage" and p.reasons["sage"] == "forward only, and this call needs a gradient"
    with pytest.raises(RuntimeError, match="forward only"):
        ab.attention(q, k, v, backend="sage", strict=True)
    caplog.set_level(logging.WARNING, logger="attn_backends")
    out = ab.attention(q, k, v, backend="sage")  # falls back with a warning, and trains
    out.sum().backward()
    assert q.grad is not None
    with torch.no_grad():
        assert ab.explain(q, k, v, backend="sage").chosen == "sage"
        assert ab.explain(q, k, v).chosen != "sage"  # lossy: never auto
