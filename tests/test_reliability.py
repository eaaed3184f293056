"""Reliability: leaks, threads, the GIL, hostile inputs (docs/reliability.md).

The leak checks here run a few thousand calls of each kind; benchmarks/leak_check.py runs a million
and its figures are in docs/reliability.md.  The sanitizer run (.ci/sanitize) executes this file too.
"""

import ctypes
import math
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import attn_backends as ab
from attn_backends import _dispatch
from attn_backends._names import CANONICAL
from attn_backends._testing import (check_2x, leak_check, leak_workloads, make_packed, reference_attention,
                                    varlen_reference)

ops = torch.ops.attn_backends
MiB = 1 << 20

# ---- leaks ---------------------------------------------------------------------------------------

LEAK_CALLS = 3000
RSS_SLACK = 2 * MiB  # a leak of ~700 bytes per call or more shows; tensors must not grow at all


@pytest.mark.leak
@pytest.mark.parametrize("kind", list(leak_workloads()))
def test_many_small_calls_hold_no_memory(kind):
    r = leak_check(kind, LEAK_CALLS, warmup=300)
    assert r["tensor_growth"] == 0, f"{kind}: {r['tensor_growth']} more live tensors after {LEAK_CALLS} calls"
    assert r["rss_growth"] < RSS_SLACK, f"{kind}: RSS grew {r['rss_growth'] / MiB:.2f} MiB over {LEAK_CALLS} calls"


@pytest.mark.leak
def test_the_leak_check_sees_leaks():
    # the detector itself: a workload that keeps its outputs, and one that leaks C heap memory
    kept = []
    q = torch.randn(1, 1, 16, 64)

    def keeps_outputs():
        kept.append(ab.attention(q, q, q))

    r = leak_check(keeps_outputs, LEAK_CALLS, warmup=0)
    assert r["tensor_growth"] == LEAK_CALLS
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    lost = []

    def leaks_heap():
        # 4 KiB a call, 12 MiB in all: free chunks that earlier tests left in the heap (a few MiB
        # after the whole suite) are reused before RSS grows, and must not hide the leak
        p = libc.malloc(4096)
        ctypes.memset(p, 1, 4096)
        lost.append(p)

    r = leak_check(leaks_heap, LEAK_CALLS, warmup=0)
    assert r["rss_growth"] >= RSS_SLACK
    for p in lost:
        libc.free(ctypes.c_void_p(p))


# ---- threads -------------------------------------------------------------------------------------

JOBS = [
    # (how the backend is chosen, backend, shape B H/Hkv Sq Sk D, dtype, causal, grad)
    ("use", "math", (2, 4, 2, 33, 47, 64), torch.float32, True, False),
    ("use", "flash", (1, 8, 8, 130, 130, 128), torch.float32, False, True),
    ("use", "eager", (2, 2, 1, 17, 9, 40), torch.float32, "bottom_right", False),
    ("use", "sdpa", (1, 4, 4, 64, 64, 64), torch.float32, True, False),
    ("arg", "flash", (1, 2, 1, 257, 100, 96), torch.bfloat16, "bottom_right", False),
    ("arg", "math", (1, 3, 3, 40, 40, 24), torch.float64, False, True),
    ("arg", "flash", (3, 2, 2, 1, 300, 64), torch.float16, False, False),
    ("arg", "eager", (1, 2, 2, 29, 29, 32), torch.float32, True, True),
]


def _job_inputs(j):
    _, _, (B, Hq, Hkv, Sq, Sk, D), dtype, causal, grad = JOBS[j]
    g = torch.Generator().manual_seed(100 + j)
    return [torch.randn(B, h, s, D, generator=g).to(dtype).requires_grad_(grad)
            for h, s in ((Hq, Sq), (Hkv, Sk), (Hkv, Sk))]


def _run_job(j, q, k, v, served):
    how, name, _, _, causal, grad = JOBS[j]
    if how == "use":
        with ab.use(name):
            out = ab.attention(q, k, v, causal=causal)
    else:
        with ab.use("math" if name != "math" else "eager"):  # the explicit argument wins over the context
            out = ab.attention(q, k, v, causal=causal, backend=name)
    served.append((j, threading.get_ident(), _last.name))
    if not grad:
        return out.detach(), ()
    return out.detach(), tuple(torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))


_last = threading.local()


@pytest.fixture
def record_runner(monkeypatch):
    # which runner served each call, per thread
    def wrap(fn, name):
        def wrapped(a):
            _last.name = name
            return fn(a)
        return wrapped

    monkeypatch.setattr(_dispatch, "RUNNERS", tuple(None if fn is None else wrap(fn, name)
                                                    for fn, name in zip(_dispatch.RUNNERS, CANONICAL)))
    fast = ab._fast_attention

    def fast_wrapped(*args):  # ab.attention's fast path (csrc/ab_direct.c) serves flash only
        res = fast(*args)
        if res is not None:
            _last.name = "flash"
        return res

    monkeypatch.setattr(ab, "_fast_attention", fast_wrapped)
    _dispatch.reset_caches()
    yield
    _dispatch.reset_caches()


def test_threads_with_different_backends_shapes_and_contexts(record_runner):
    inputs = [_job_inputs(j) for j in range(len(JOBS))]
    serial, served = [], []
    for j, (q, k, v) in enumerate(inputs):
        serial.append(_run_job(j, q, k, v, served))
        out, grads = serial[-1]
        _, _, _, dtype, causal, grad = JOBS[j]
        r = reference_attention(q.detach(), k.detach(), v.detach(), causal=causal)[0]
        d = reference_attention(q.detach(), k.detach(), v.detach(), causal=causal, dtype=dtype)[0]
        check_2x(f"job {j} out", out, r, d, 2, dtype)
    assert [s[2] for s in served] == [job[1] for job in JOBS]

    order = [j for j in range(len(JOBS)) for _ in range(6)]
    random.Random(0).shuffle(order)
    served.clear()
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda j: (j, _run_job(j, *inputs[j], served)), order))
    assert len({t for _, t, _ in served}) > 1, "the jobs did not run on several threads"
    for j, name in ((j, n) for j, _, n in served):
        assert name == JOBS[j][1], f"job {j} ran on {name}, not {JOBS[j][1]}"
    for j, (out, grads) in results:
        ref_out, ref_grads = serial[j]
        if JOBS[j][1] in ("math", "flash"):  # ours: the same bits whatever runs beside them
            assert torch.equal(out, ref_out), f"job {j}: a concurrent run changed the output"
            assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads)), f"job {j}: gradients changed"
        else:
            torch.testing.assert_close(out, ref_out)
            for a, b in zip(grads, ref_grads):
                torch.testing.assert_close(a, b)


def _kv_job(j):
    """Decode call j of test_kvcache_calls_on_threads: its own caches (dense or 16-key pages under a
    shuffled table), written in place by the call; three dtypes, GQA and MHA, 1-3 query tokens."""
    g = torch.Generator().manual_seed(j)
    dtype = (torch.float32, torch.bfloat16, torch.float16)[j % 3]
    B, Hq, Hkv, D, S = 2, 8, (2, 8, 4)[j % 3], 64, 300 + 37 * j

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    q, k, v = rand(B, 1 + j % 3, Hq, D), rand(B, 2, Hkv, D), rand(B, 2, Hkv, D)
    extra = {}
    if j % 2:
        nb = -(-S // 16)
        shape = (B * nb, 16, Hkv, D)
        extra["block_table"] = torch.randperm(B * nb, generator=g).view(B, nb).to(torch.int32)
    else:
        shape = (B, S, Hkv, D)
    k_cache, v_cache = rand(*shape), rand(*shape)
    out, lse = ab.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor(
        [S // 2, S - 5], dtype=torch.int32), causal=True, return_softmax_lse=True, num_splits=2, **extra)
    return out, lse, k_cache, v_cache


@pytest.mark.parametrize("tune", ["0", "1"])
def test_kvcache_calls_on_threads_match_the_same_calls_alone(monkeypatch, tune):
    # decode serving several requests from threads at once: the kernel's shared state (the thread
    # pool, the timings of its prefetch switches, ATTN_BACKENDS_DECODE_TUNE=1 times them in every call,
    # the record of recent working sets) must not leak from one call into another: the same output,
    # lse and cache writes, bit for bit, as each call run alone (a fixed split count)
    monkeypatch.setenv("ATTN_BACKENDS_DECODE_TUNE", tune)
    alone = [_kv_job(j) for j in range(12)]
    order = [j for j in range(12) for _ in range(6)]
    random.Random(1).shuffle(order)
    threads = set()

    def job(j):
        threads.add(threading.get_ident())
        return j, _kv_job(j)

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(job, order))
    assert len(threads) > 1, "the calls did not run on several threads"
    for j, got in results:
        for name, a, b in zip(("out", "lse", "k_cache", "v_cache"), got, alone[j]):
            assert torch.equal(a, b), f"call {j}: {name} differs from the same call run alone"


def test_use_context_does_not_leak_into_other_threads():
    q = torch.randn(1, 2, 8, 16)
    seen = {}

    def worker():
        seen["worker"] = ab.explain(q, q, q).chosen

    with ab.use("eager"):
        t = threading.Thread(target=worker)
        t.start()
        t.join()
        seen["main"] = ab.explain(q, q, q).chosen
    assert seen == {"main": "eager", "worker": "flash"}


@pytest.mark.parametrize("backend", ["math", "flash"])
def test_gil_is_released_while_a_kernel_runs(backend):
    # one thread runs a long kernel; the main thread must keep running Python meanwhile
    q = torch.randn(1, 16, 1024, 128)
    ab.attention(q[:, :1, :64], q[:, :1, :64], q[:, :1, :64], backend=backend)  # warm up
    start = time.perf_counter()
    ab.attention(q, q, q, backend=backend)
    alone = time.perf_counter() - start
    done = threading.Event()
    window = []

    def kernel():
        window.append(time.perf_counter())
        ab.attention(q, q, q, backend=backend)
        window.append(time.perf_counter())
        done.set()

    ticks = []
    t = threading.Thread(target=kernel)
    t.start()
    while not done.is_set():
        ticks.append(time.perf_counter())
        sum(range(200))  # pure Python: needs the GIL
    t.join()
    inside = [x for x in ticks if window[0] < x < window[1]]
    gaps = [b - a for a, b in zip([window[0]] + inside, inside + [window[1]])]
    # held GIL: the main thread stalls for the whole kernel (one gap ~ the kernel time)
    assert len(inside) > 10 and max(gaps) < 0.5 * (window[1] - window[0]), (
        f"main thread stalled {max(gaps) * 1e3:.1f} ms of a {(window[1] - window[0]) * 1e3:.1f} ms kernel "
        f"({alone * 1e3:.1f} ms alone)")


# ---- hostile inputs ------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["math", "flash", "eager"])
def test_storage_offsets_zero_strides_and_overlap(backend):
    g = torch.Generator().manual_seed(1)
    base = torch.randn(100_000, generator=g)
    q = base[13:13 + 2 * 4 * 33 * 40].view(2, 4, 33, 40)  # storage offset
    k = torch.randn(1, 2, 1, 40, generator=g).expand(2, 2, 29, 40)  # batch and sequence stride 0
    v = base.as_strided((2, 2, 29, 24), (7, 3, 11, 1), 17)  # rows overlap in memory
    mask = (torch.rand(29, generator=g) > 0.3).expand(2, 4, 33, 29)  # stride 0 everywhere but keys
    before = base.clone()
    out = ab.attention(q, k, v, attn_mask=mask, causal="bottom_right", backend=backend, strict=True)
    ref = reference_attention(q, k, v, attn_mask=mask, causal="bottom_right")[0]
    same = reference_attention(q, k, v, attn_mask=mask, causal="bottom_right", dtype=torch.float32)[0]
    check_2x("out", out, ref, same, 2, torch.float32)
    assert torch.equal(base, before)


def test_gradients_through_expanded_and_overlapping_views():
    leaf = torch.randn(1, 2, 9, 16, requires_grad=True)
    x = leaf.expand(3, 2, 9, 16)
    out = ab.attention(x, x, x, backend="flash", causal=True, strict=True)
    (g,) = torch.autograd.grad(out.sum(), leaf)
    leaf64 = leaf.detach().double().requires_grad_()
    x64 = leaf64.expand(3, 2, 9, 16)
    (g64,) = torch.autograd.grad(reference_attention(x64, x64, x64, causal=True)[0].sum(), leaf64)
    torch.testing.assert_close(g.double(), g64, rtol=1e-4, atol=1e-5)


def _big_problem():
    B, H, S, D = 16385, 8, 128, 128  # q has 2^31 + 2^17 elements: offsets past int32
    q = torch.empty(B, H, S, D, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    block = torch.randn(64, H, S, D, generator=g).to(torch.bfloat16)
    for i in range(0, B, 64):
        q[i:i + 64] = block[:min(64, B - i)]
    k = torch.randn(B, 1, 8, D, generator=g).to(torch.bfloat16)  # MQA, 8 keys: cheap to compute
    v = torch.randn(B, 1, 8, D, generator=g).to(torch.bfloat16)
    return q, k, v


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 0


@pytest.mark.slow
@pytest.mark.skipif(_available_memory() < 14 << 30, reason="needs 14 GiB of free memory (q and out are 4 GiB each)")
@pytest.mark.parametrize("backend", ["flash", "math"])
def test_more_than_2_to_the_31_elements(backend):
    q, k, v = _big_problem()
    assert q.numel() > 2**31
    out = ab.attention(q, k, v, causal="bottom_right", backend=backend, strict=True)
    for b in (0, 1, 8191, 16383, 16384):  # the last rows start past element 2^31
        ref = reference_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], causal="bottom_right")[0]
        same = reference_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], causal="bottom_right", dtype=torch.bfloat16)[0]
        check_2x(f"out[{b}]", out[b:b + 1], ref, same, 2, torch.bfloat16)


@pytest.mark.slow
@pytest.mark.skipif(_available_memory() < 14 << 30, reason="needs 14 GiB of free memory (q and out are 4 GiB each)")
def test_varlen_with_more_than_2_to_the_31_elements():
    q, k, v = _big_problem()
    B, H, S, D = q.shape
    qp = q.transpose(1, 2).reshape(B * S, H, D)  # a copy: 4 GiB, packed rows
    del q
    kp, vp = (t.transpose(1, 2).reshape(B * 8, 1, D) for t in (k, v))
    cu_q = torch.arange(0, B * S + 1, S, dtype=torch.int32)
    cu_k = torch.arange(0, B * 8 + 1, 8, dtype=torch.int32)
    out = ab.attention_varlen(qp, kp, vp, cu_q, cu_k, S, 8, causal="bottom_right", backend="flash_varlen",
                              strict=True)
    for b in (0, 16384):
        rows = slice(b * S, (b + 1) * S)
        seq = [qp[rows], kp[b * 8:(b + 1) * 8], vp[b * 8:(b + 1) * 8]]
        cu = (torch.tensor([0, S], dtype=torch.int32), torch.tensor([0, 8], dtype=torch.int32))
        ref = varlen_reference(*seq, *cu, causal="bottom_right")[0]
        same = varlen_reference(*seq, *cu, causal="bottom_right", dtype=torch.bfloat16)[0]
        check_2x(f"sequence {b}", out[rows], ref, same, 2, torch.bfloat16)


CU_CASES = [
    # (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, python error, C core error)
    ([0, 4, 12], [0, 4, 9], 8, 5, r"cu_seqlens_q\[-1\] = 12 must equal the number of packed rows, 9",
     r"cu_seqlens_q\[-1\] = 12 must equal the total number of rows, 9"),  # overruns q
    ([0, 4, 9], [0, 4, 99], 5, 95, r"cu_seqlens_k\[-1\] = 99 must equal the number of packed rows, 9",
     r"cu_seqlens_k\[-1\] = 99 must equal the total number of rows, 9"),  # overruns k
    ([0, 6, 4, 9], [0, 3, 6, 9], 6, 5, r"cu_seqlens_q must be non-decreasing",
     r"cu_seqlens_q must be non-decreasing, but cu_seqlens_q\[1\] = 6 > cu_seqlens_q\[2\] = 4"),
    ([-3, 4, 9], [0, 4, 9], 7, 5, r"cu_seqlens_q must start at 0, got -3", r"cu_seqlens_q\[0\] must be 0, got -3"),
    ([0, 4, 9], [0, 4, 9], 4, 5, r"sequence 1 has 5 rows in cu_seqlens_q, more than max_seqlen_q = 4",
     r"sequence 1 has length 5 > max_seqlen 4 \(cu_seqlens_q\)"),  # disagrees with max_seqlen
    ([0, 4, 9], [0, 9], 5, 9, r"cu_seqlens_q and cu_seqlens_k must describe the same batch, got lengths 3 and 2",
     r"cu_seqlens_q and cu_seqlens_k must have the same length"),
    ([0, 4, 9], [0, 4, 9], 5, -1, r"max_seqlen_k must be a non-negative int, got -1", r"max_seqlen_k must be >= 0, got -1"),
]


@pytest.mark.parametrize("cu_q, cu_k, max_q, max_k, py_err, c_err", CU_CASES)
def test_hostile_cu_seqlens(cu_q, cu_k, max_q, max_k, py_err, c_err):
    q, k, v, _, _ = make_packed([4, 5], [4, 5], 2, 1, 16, 16, torch.float32)
    cu_q, cu_k = torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32)
    for backend in ("flash_varlen", "math", "eager"):
        with pytest.raises(ValueError, match=py_err):
            ab.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, backend=backend)
    # the op itself, called directly past the Python checks, is checked again in C
    with pytest.raises(RuntimeError, match=c_err):
        ops.flash_varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, None, 0, 0.25, -1, -1, 0.0, 0.0)
