"""The torch integration: ops pass torch.library.opcheck, torch.compile(fullgraph=True) traces
forward and backward with no graph break, the package imports on a CPU-only torch without
touching CUDA, and `python -m attn_backends` reports the environment."""

import os
import subprocess
import sys

import pytest
import torch

import attn_backends as ab
from attn_backends import _providers

ops = torch.ops.attn_backends


def _inputs(requires_grad=True, dtype=torch.float32):
    q = torch.randn(2, 4, 9, 16, dtype=dtype, requires_grad=requires_grad)
    k = torch.randn(2, 2, 11, 16, dtype=dtype, requires_grad=requires_grad)
    v = torch.randn(2, 2, 11, 8, dtype=dtype, requires_grad=requires_grad)
    return q, k, v


@pytest.mark.parametrize(
    "variant",
    ["plain", "causal_softcap_window", "float_mask_grad", "bool_mask_dropout", "float64"],
)
def test_opcheck_forward(variant):
    q, k, v = _inputs(dtype=torch.float64 if variant == "float64" else torch.float32)
    rng = _providers.draw_rng_state()
    args = {
        "plain": (q, k, v, None, None, 0, 0.25, -1, -1, 0.0, 0.0),
        "causal_softcap_window": (q, k, v, None, None, 2, 0.25, 3, 1, 5.0, 0.0),
        "float_mask_grad": (q, k, v, torch.randn(1, 4, 9, 11, requires_grad=True), None, 1, 0.25, -1, -1, 0.0, 0.0),
        "bool_mask_dropout": (q, k, v, torch.rand(2, 1, 9, 11) > 0.2, rng, 0, 0.25, -1, -1, 0.0, 0.3),
        "float64": (q, k, v, None, rng, 1, 0.25, -1, -1, 0.0, 0.2),
    }[variant]
    torch.library.opcheck(ops.math_fwd.default, args)


def test_opcheck_backward_and_dropout_mask():
    q, k, v = _inputs(requires_grad=False)
    mask = torch.randn(9, 11)
    out, lse = ops.math_fwd(q, k, v, mask, None, 1, 0.25, -1, -1, 0.0, 0.0)
    dout = torch.randn_like(out)
    torch.library.opcheck(ops.math_bwd.default,
                          (dout, q, k, v, out, lse, torch.randn_like(lse), mask, None, 1, 0.25, -1, -1, 0.0, 0.0, True))
    torch.library.opcheck(ops.dropout_mask.default, (_providers.draw_rng_state(), 2, 3, 5, 7, 0.3))


def _grads(fn, q, k, v, **kw):
    out = fn(q, k, v, **kw)
    g = torch.autograd.grad(out.square().sum(), (q, k, v))
    return out.detach(), g


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_forward_and_backward(backend):
    torch._dynamo.reset()
    q, k, v = _inputs()

    def f(q, k, v):
        return ab.attention(q, k, v, causal="bottom_right", softcap=3.0, window=(4, -1))

    compiled = torch.compile(f, fullgraph=True, backend=backend)
    out_c, g_c = _grads(compiled, q, k, v)
    out_e, g_e = _grads(f, q, k, v)
    torch.testing.assert_close(out_c, out_e)
    for a, b in zip(g_c, g_e):
        torch.testing.assert_close(a, b)


def test_compile_fullgraph_with_mask_grad_dropout_and_lse():
    torch._dynamo.reset()
    q, k, v = _inputs()
    bias = torch.randn(1, 4, 9, 11, requires_grad=True)

    def f(q, k, v, bias):
        out, lse = ab.attention(q, k, v, attn_mask=bias, dropout_p=0.2, return_lse=True)
        return out.square().sum() + lse.sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    loss = compiled(q, k, v, bias)
    grads = torch.autograd.grad(loss, (q, k, v, bias))
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)
    assert grads[3].shape == bias.shape


def test_compile_dynamic_shapes_and_no_grad():
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: ab.attention(q, k, v, causal=True), fullgraph=True,
                             backend="aot_eager", dynamic=True)
    for S in (5, 9, 17):
        q = torch.randn(1, 2, S, 8)
        with torch.no_grad():
            torch.testing.assert_close(compiled(q, q, q), ab.attention(q, q, q, causal=True))


def _fa(x, softcap, scale):
    from attn_backends import flash_attn as fa

    return fa.flash_attn_func(x.transpose(1, 2), x.transpose(1, 2), x.transpose(1, 2), softmax_scale=scale,
                              causal=True, softcap=softcap)


_DYNAMIC_CALLS = {
    "attention": lambda x, sc, s: ab.attention(x, x, x, causal=True, softcap=sc, scale=s, window=(3, 0)),
    "attention_dropout": lambda x, sc, s: ab.attention(x, x, x, scale=s, dropout_p=sc / 100).isfinite().all(),
    "sdpa": lambda x, sc, s: ab.sdpa(x, x, x, is_causal=True, scale=s),
    "sdpa_strided": lambda x, sc, s: ab.sdpa(*[x.reshape(1, x.shape[2], 2, 16).transpose(1, 2)] * 3, scale=s),
    "flash_attn_func": _fa,
}


@pytest.mark.parametrize("name", sorted(_DYNAMIC_CALLS))
def test_compile_dynamic_with_float_arguments(name):
    # dynamic=True makes the float arguments (softcap, scale, dropout_p) symbolic as well as the sizes:
    # the checks (no math.isfinite), the plan (constants by branches) and sdpa's output strides (no
    # sorted() on strides) still trace in one graph, and each call equals eager's
    torch._dynamo.reset()
    f = _DYNAMIC_CALLS[name]
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=True)
    for S, softcap, scale in ((5, 30.0, 0.2), (9, 20.0, 0.3), (17, 20.0, None)):
        x = torch.randn(1, 2, S, 16)
        with torch.no_grad():
            want, got = f(x, softcap, scale), compiled(x, softcap, scale)
        assert got.shape == want.shape and got.stride() == want.stride()
        assert torch.equal(got, want), f"{name}: differs from eager (S={S}, softcap={softcap}, scale={scale})"


def _packed(lens_q, lens_k, g):
    cq, ck = (torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32) for lens in (lens_q, lens_k))
    q = torch.randn(int(cq[-1]), 4, 16, generator=g).requires_grad_()
    k, v = (torch.randn(int(ck[-1]), 2, 16, generator=g).requires_grad_() for _ in range(2))
    return q, k, v, cq, ck


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_traces_packed_calls_in_one_graph(dynamic):
    # attention_varlen read cu_seqlens on the host (checks, lengths) and broke the graph there; traced, the
    # flash_varlen kernel takes the caller's bounds and checks cu_seqlens in its op.  Forward, lse and
    # gradients equal eager's bit for bit, loose bounds included; cu_seqlens_q may be cu_seqlens_k
    def f(q, k, v, cq, ck, mq, mk):
        return ab.attention_varlen(q, k, v, cq, ck, mq, mk, causal="bottom_right", window=(3, 1), softcap=20.0,
                                   return_lse=True)

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    for lens_q, lens_k, slack in (([3, 5], [3, 5], 0), ([4, 9, 2], [4, 12, 2], 7), ([1, 1], [70, 3], 1000)):
        q, k, v, cq, ck = _packed(lens_q, lens_k, g)
        if lens_q == lens_k:
            ck = cq
        args = (q, k, v, cq, ck, max(lens_q) + slack, max(lens_k) + slack)
        (out, lse), (w_out, w_lse) = compiled(*args), f(*args)
        assert torch.equal(out, w_out) and torch.equal(lse, w_lse)
        gout = torch.randn(out.shape, generator=g)
        got = torch.autograd.grad((out * gout).sum() + lse.sum(), (q, k, v))
        want = torch.autograd.grad((w_out * gout).sum() + w_lse.sum(), (q, k, v))
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_compile_packed_calls_off_the_flash_varlen_kernel_run_eagerly():
    # a packed call planned to another backend (padding by the lengths on the host) or with dropout (rows
    # numbered by the longest sequence) breaks the graph, as before, and equals eager
    g = torch.Generator().manual_seed(1)
    q, k, v, cq, ck = _packed([3, 6], [5, 2], g)
    for kw in (dict(backend="math"), dict(backend="eager"), dict(dropout_p=0.3)):
        torch._dynamo.reset()
        f = lambda q, k, v: ab.attention_varlen(q, k, v, cq, ck, 6, 5, causal=True, **kw)  # noqa: E731
        torch.manual_seed(5)
        got = torch.compile(f, backend="aot_eager")(q, k, v)
        torch.manual_seed(5)
        assert torch.equal(got, f(q, k, v)), kw
        with pytest.raises(torch._dynamo.exc.Unsupported):
            torch._dynamo.reset()
            torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v)


def test_compile_packed_calls_check_cu_seqlens_in_the_op():
    # traced, the values of cu_seqlens are checked when the op runs (in C), with the same arguments named
    g = torch.Generator().manual_seed(2)
    q, k, v, _, _ = _packed([3, 5], [3, 5], g)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, cu, m: ab.attention_varlen(q, k, v, cu, cu, m, m), fullgraph=True,
                             backend="aot_eager")
    for cu, m, msg in (([0, 3, 7], 8, r"cu_seqlens_q\[-1\] = 7"), ([0, 5, 8], 4, "max_seqlen"),
                       ([1, 3, 8], 8, r"cu_seqlens_q\[0\] must be 0")):
        with pytest.raises(RuntimeError, match=msg):
            compiled(q, torch.tensor(cu, dtype=torch.int32), m)


@pytest.mark.parametrize("backend", ["flash", "math"])
def test_compile_self_attention_passes_one_tensor_three_times(backend):
    # ab.attention(x, x, x) with a gradient: dynamo refuses an autograd Function given one tensor twice
    # ("duplicate tensor input") and fullgraph=True failed; repeats now go in as views of themselves
    torch._dynamo.reset()
    x = torch.randn(1, 2, 5, 16, requires_grad=True)
    compiled = torch.compile(lambda x: ab.attention(x, x, x, backend=backend), fullgraph=True, backend="aot_eager")
    (got,) = torch.autograd.grad(compiled(x).square().sum(), x)
    (want,) = torch.autograd.grad(ab.attention(x, x, x, backend=backend).square().sum(), x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # dq + dk + dv summed in another order


def test_import_touches_no_cuda():
    code = (
        "import attn_backends as ab, torch\n"
        "q = torch.randn(1, 1, 4, 8)\n"
        "ab.attention(q, q, q)\n"
        "maps = open('/proc/self/maps').read()\n"
        "assert 'libattn_backends_cuda' not in maps, 'CUDA library loaded'\n"
        "assert 'libcuda.so' not in maps, 'CUDA driver loaded'\n"
        "print('ok')\n"
    )
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    assert "ok" in res.stdout


def test_report_lists_versions_devices_features_and_backends():
    res = subprocess.run([sys.executable, "-m", "attn_backends"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    text = res.stdout
    for needle in ("attn_backends", "torch", "python", "torch stable ABI", "target 2.10", "devices", "cpu",
                   "cpu features", "backends"):
        assert needle in text
    for name in ab._names.CANONICAL:
        assert f"  {name} " in text
    assert "math" in text and "available" in text


def test_build_info_and_cpu_features():
    info = ab._C.build_info()
    assert info["version"] == ab.__version__
    assert info["torch_target_version"] == "2.10"
    feats = ab._C.cpu_features()
    assert isinstance(feats["avx2"], bool)
    if feats["avx512f"]:
        assert feats["avx2"], "AVX-512 without AVX2 means the OS-support check is wrong"


def test_the_cpu_family_and_model_are_the_ones_linux_reports():
    # family decides the decode kernel's head-by-head scores from DRAM on AMD (csrc/cpu/decode_cpu.c
    # scores_by_head: off on Zen 5, family 26); Linux decodes the same CPUID leaf 1 for /proc/cpuinfo
    feats = ab._C.cpu_features()
    assert isinstance(feats["family"], int) and isinstance(feats["model"], int)
    try:
        with open("/proc/cpuinfo") as f:
            info = dict(line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines() if ":" in line)
    except OSError:
        pytest.skip("no /proc/cpuinfo here")
    info = {k.strip(): v.strip() for k, v in info.items()}
    if "cpu family" not in info or "model" not in info:
        pytest.skip("/proc/cpuinfo names no x86 family and model here")
    assert (feats["family"], feats["model"]) == (int(info["cpu family"]), int(info["model"]))


def test_the_l3_size_is_the_one_linux_reports():
    # l3_bytes (CPUID's cache parameters) decides the decode kernel's next-keys prefetch on AMD's AVX-512
    # path (csrc/cpu/decode_cpu.c keys_next); Linux reads the same CPUID leaves for sysfs
    l3 = ab._C.cpu_features()["l3_bytes"]
    assert isinstance(l3, int) and 0 <= l3 < 2**40
    index3 = "/sys/devices/system/cpu/cpu0/cache/index3"
    if l3 == 0 or not os.path.exists(index3):
        pytest.skip("neither CPUID nor sysfs names an L3 here")
    with open(os.path.join(index3, "level")) as f:
        assert f.read().strip() == "3"
    with open(os.path.join(index3, "size")) as f:
        size = f.read().strip()
    assert size.endswith("K") and int(size[:-1]) * 1024 == l3, (size, l3)


@pytest.mark.parametrize("name", ["sdpa", "_native_math", "flash", "eager"])
def test_compile_fullgraph_through_the_planner(name):
    torch._dynamo.reset()
    q, k, v = _inputs()

    def f(q, k, v):
        return ab.attention(q, k, v, backend=name, causal="bottom_right")

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out_c, g_c = _grads(compiled, q, k, v)
    out_e, g_e = _grads(f, q, k, v)
    torch.testing.assert_close(out_c, out_e)
    for a, b in zip(g_c, g_e):
        torch.testing.assert_close(a, b)


def test_compile_fullgraph_inside_use():
    torch._dynamo.reset()
    q, k, v = _inputs(requires_grad=False)
    compiled = torch.compile(lambda q, k, v: ab.attention(q, k, v), fullgraph=True, backend="aot_eager")
    with ab.use("sdpa"):
        out = compiled(q, k, v)
    torch.testing.assert_close(out, ab.attention(q, k, v))


def test_eager_calls_of_new_kinds_do_not_recompile_a_compiled_caller():
    # the plan cache's length was read before the compiling check, so dynamo guarded every graph on it: each
    # eager call of a new kind recompiled the compiled callers, and fullgraph=True failed at the recompile limit
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("aot_eager")
    f = torch.compile(lambda q, k, v: ab.attention(q, k, v, causal=True), backend=cnt, fullgraph=True)
    q = torch.randn(1, 2, 8, 16)
    with torch.no_grad():
        want = f(q, q, q)
        for backend in ("math", "flash", "eager", "sdpa", "flex"):
            for causal in (False, "bottom_right"):
                ab.attention(q, q, q, backend=backend, causal=causal)
                assert torch.equal(f(q, q, q), want)
    assert cnt.frame_count == 1


@pytest.mark.parametrize("backend", ["sdpa", "_native_math", "flash"])
def test_compile_dynamic_gqa_through_torch_sdpa(backend):
    # under dynamic=True, Hq != Hkv is a SymBool, which F.sdpa's enable_gqa refused: the torch routes broke the
    # graph (fullgraph=True raised)
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v: ab.attention(q, k, v, backend=backend, causal=True), backend="aot_eager",
                      fullgraph=True, dynamic=True)
    for S in (16, 24):
        q, k, v = torch.randn(2, 8, S, 32), torch.randn(2, 2, S, 32), torch.randn(2, 2, S, 32)
        with torch.no_grad():
            torch.testing.assert_close(f(q, k, v), ab.attention(q, k, v, backend=backend, causal=True), atol=1e-6,
                                       rtol=0)


def test_compile_decode_loop_with_an_int_cache_seqlens_does_not_recompile_each_step():
    # the op's `int cache_seqlen` specialized the graph on its value: one recompile per decode step, and
    # FailOnRecompileLimitHit under fullgraph=True after eight; while compiling, the int goes in as a tensor
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("aot_eager")

    def step(q, kc, vc, k, v, n):
        return ab.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=n, causal=True)

    compiled = torch.compile(step, backend=cnt, fullgraph=True, dynamic=True)
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.zeros(1, 64, 2, 16), torch.zeros(1, 64, 2, 16)
    kc_e, vc_e = kc.clone(), vc.clone()
    for n in range(12):
        q, k, v = (torch.randn(1, 1, 2, 16, generator=g) for _ in range(3))
        with torch.no_grad():
            got, want = compiled(q, kc, vc, k, v, n), step(q, kc_e, vc_e, k, v, n)
        assert torch.equal(got, want) and torch.equal(kc, kc_e) and torch.equal(vc, vc_e)
    assert cnt.frame_count <= 2


def test_compile_varlen_with_0d_tensor_bounds_matches_eager():
    # a 0-d tensor max_seqlen (allowed) became an unbacked SymInt under the trace, which the op's int refused:
    # BackendCompilerFailed; such bounds now take the graph break to the eager path
    torch._dynamo.reset()
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(8, 4, 16, generator=g), torch.randn(8, 2, 16, generator=g), torch.randn(8, 2, 16, generator=g)
    m = torch.tensor(5)

    def f(q, k, v, m):
        return ab.attention_varlen(q, k, v, cu, cu, m, m, causal=True)

    with torch.no_grad():
        assert torch.equal(torch.compile(f, backend="aot_eager")(q, k, v, m), f(q, k, v, m))
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v, m)


def test_compile_dynamic_varlen_does_not_recompile_per_max_seqlen():
    # the packed ops took max_seqlen as `int`: under dynamic=True each distinct value specialized the graph, and
    # fullgraph=True failed at the recompile limit; the schemas take SymInt now (csrc/torch_shim.cpp)
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("aot_eager")

    def fn(q, k, v, cu, m):
        return ab.attention_varlen(q, k, v, cu, cu, m, m, causal=True)

    compiled = torch.compile(fn, backend=cnt, fullgraph=True, dynamic=True)
    g = torch.Generator().manual_seed(0)
    for n in range(3, 14):
        cu = torch.tensor([0, n, 2 * n + 1], dtype=torch.int32)
        x = torch.randn(2 * n + 1, 2, 16, generator=g, requires_grad=True)
        out = compiled(x, x, x, cu, n + 1)
        (gx,) = torch.autograd.grad(out.square().sum(), x)
        y = x.detach().clone().requires_grad_()
        want = fn(y, y, y, cu, n + 1)
        assert torch.equal(out, want)
        torch.testing.assert_close(gx, torch.autograd.grad(want.square().sum(), y)[0])
    assert cnt.frame_count <= 2
