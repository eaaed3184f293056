"""Decode benchmark: ab.attention_with_kvcache (the paged_attention kernel) vs torch SDPA, and both
against the machine's read bandwidth, in one run.

Decode reads the whole KV cache once per query token and computes little per byte, so the ceiling
is memory bandwidth.  Each round measures that ceiling (a sum over a 256 MiB float32 buffer on the
threads torch uses) beside the candidates, interleaved, so a drifting or shared machine moves all
of them alike; the table shows medians over rounds:

  - ours: one query token (Sq = 1) against a dense cache (B, Sk, Hkv, D), cache_seqlens = Sk;
  - paged: the same cache as pages of 16 (and 256) positions under a shuffled block_table;
  - sdpa: torch.nn.functional.scaled_dot_product_attention on the dense equivalent, q (B, Hq, 1, D)
    and contiguous k, v (B, Hkv, Sk, D) with enable_gqa (the layout torch likes best);
  - GB/s = K and V bytes / time, and its % of the measured read bandwidth; ratio = sdpa / ours and
    paged = paged / dense; each of the three the median over rounds of its value within one round
    (the % since 2026-12-04: before, the median GB/s over the median probe, which a probe that moves
    between rounds moves too).

Every candidate reads a different copy of its cache than the call before it, with enough copies
that they do not fit in the last-level cache, so each call streams from memory; the copies of all
candidates are allocated in turn, copy by copy (memory a process allocated first can read slower).  Shapes (issue
19): B=1 Hq=32 Hkv=8 Sk=16384; B=8 Hq=32 Hkv=8 Sk=2048; MHA B=4 Hq=Hkv=32 Sk=2048; D=128; bfloat16
and float32.  --sweep adds time against cache length (B=1 Hq=32 Hkv=8 D=128) for a plot: a CSV
always, a PNG when matplotlib is installed.

    python benchmarks/bench_decode.py --json benchmarks/results/decode.json --sweep
    python benchmarks/bench_decode.py --quick          # one shape per dtype, few rounds: a check only
    python benchmarks/bench_decode.py --threads 1      # one core
    python benchmarks/bench_decode.py --tokens 1,4,8,12,16 --json benchmarks/results/decode_tokens.json

--tokens times several query tokens per call instead (speculative decoding, chunked prefill):
B=1 Hq=32 Hkv=8 D=128 against --tokens-cache keys in a dense cache, causal bottom-right, Sq tokens
(Sq x 4 query rows per KV head).  Candidates: "kernel" (the decode kernel, forced), "flash" (our
flash over the cache's view, backend="flash"), "auto" (what attention_with_kvcache picks) and torch
SDPA on contiguous (B, H, S, D) caches with the bottom-right causal mask as a bool attn_mask;
ratio = torch / auto.
    python benchmarks/bench_decode.py --device cuda --json benchmarks/results/gpu/decode_cuda.json
    python benchmarks/bench_decode.py --device cuda --graph   # the kernels alone, in CUDA graphs

--layers times a model's decode step instead: one query token against each of N layers' caches in
turn (B=1 Hq=32 Hkv=8 Sk 512 and 2048, B=4 Sk=1024; D=128), our kernel with the next-keys prefetch
forced off, on, and as the kernel picks (by its working set against the L3, docs/decode.md), and
torch SDPA; ratio = sdpa / auto.  One layer's cache may fit the L3 where all of them do not.
    python benchmarks/bench_decode.py --layers 1,32 --json benchmarks/results/decode_layers.json

--small times small decode calls instead, where the cache stays in the caches and a call's fixed cost
counts (a small model's decode step): one query token against the same dense cache at every call, ours
(auto) against torch SDPA twice, on contiguous (B, H, S, D) copies of the cache (the layout torch likes
best, as above) and on the cache's own (B, S, H, D) tensors transposed (what a caller holding a
flash-attn cache would pass); ratios = torch / ours.
    python benchmarks/bench_decode.py --small --json benchmarks/results/decode_small.json

--small-layers times small MHA models' decode steps instead: one query token against each layer's own cache
(B=1, H, Sk, D in torch's (B, H, S, D) layout) in turn through ab.attention, 6 to 512 MiB of caches in all: auto,
the runs of keys forced on and off (ATTN_BACKENDS_DECODE_MHA_RUNS, docs/decode.md), and torch SDPA; ratio =
torch / auto.  Where the layers' caches together outgrow the caches, one-token MHA goes by chunks.
    python benchmarks/bench_decode.py --small-layers --json benchmarks/results/decode_small_layers.json

--pool-layouts times our kernel alone over the decode shapes' caches, dense and as pools laid out four
ways (blocks of 16 under a shuffled table, in order, shuffled in pairs so that each 32-key chunk of the
kernel is one contiguous run, and blocks of 32 shuffled), the same data and bits in each; layout / dense
is the median of each round's ratio.  It separates what a paged cache's cost follows: the block size,
the table's order, or where a chunk jumps.
    python benchmarks/bench_decode.py --pool-layouts --json benchmarks/results/decode_pool_layouts.json

--switch NAME times our kernel alone with one of its switches (ATTN_BACKENDS_DECODE_<NAME>, docs/environment.md)
forced off or on call by call, drawn at random, in one process: over the decode shapes' caches, dense and as 16-
and 256-key blocks under a shuffled table, and over one cache the L3 holds; on / off is the ratio of the medians
(200 calls per --rounds), with its spread over eight slices of the calls.
    python benchmarks/bench_decode.py --switch SCORES_BY_HEAD --json benchmarks/results/decode_switch.json

--device cuda times our CUDA decode kernel (csrc/cuda/decode.cu, on by default since its H200 run and
switched on here even under ATTN_BACKENDS_CUDA_DECODE=0) against torch SDPA on the GPU, with CUDA events, and the
probe sums a 1 GiB buffer on the GPU (its read bandwidth, far above the L2).  It also times auto with an int
cache_seqlens ("auto_int"): in 16-bit types that is torch SDPA over the cache's view, where the kernel
measured slower than torch (csrc/ab_planner.c torch_first_kv), so its line says whether auto keeps up with
torch there.

Numbers are only meaningful on a quiet machine: the candidates and the bandwidth probe share it.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import platform
import random
import statistics
import time

import torch
import torch.nn.functional as F

import attn_backends as ab
from attn_backends._planner import DTYPE_NAMES
from attn_backends._testing import decode_bf16_products

SHAPES = [  # (label, B, Hq, Hkv, Sk)
    ("B1 GQA 32/8 Sk16384", 1, 32, 8, 16384),
    ("B8 GQA 32/8 Sk2048", 8, 32, 8, 2048),
    ("B4 MHA 32/32 Sk2048", 4, 32, 32, 2048),
]
D = 128
PROBE_BYTES = 256 << 20
GPU_PROBE_BYTES = 1 << 30
LLC_GUESS = 512 << 20  # copies of a cache add up to at least this, so a call never finds it cached
DEVICE = "cpu"  # --device
GRAPH = False  # --graph
GRAPH_CALLS = 16  # calls captured in one CUDA graph (--graph)


def read_bandwidth_probe():
    n = GPU_PROBE_BYTES if DEVICE == "cuda" else PROBE_BYTES
    buf = torch.ones(n // 4, dtype=torch.float32, device=DEVICE)

    def run():
        return n / timed(buf.sum, 1)

    run()
    return run


def paged_copy(k, v, block, gen):
    """The dense cache (B, Sk, Hkv, D) as pages of `block` positions in shuffled order."""
    B, Sk = k.shape[:2]
    nb = -(-Sk // block)
    perm = torch.randperm(B * nb, generator=gen)
    table = perm.view(B, nb).to(torch.int32)
    pages_k = torch.empty(B * nb, block, *k.shape[2:], dtype=k.dtype)
    pages_v = torch.empty_like(pages_k)
    pad = nb * block - Sk
    kp = torch.cat([k, k.new_zeros(B, pad, *k.shape[2:])], 1).view(B * nb, block, *k.shape[2:])
    vp = torch.cat([v, v.new_zeros(B, pad, *v.shape[2:])], 1).view(B * nb, block, *v.shape[2:])
    pages_k[perm] = kp
    pages_v[perm] = vp
    return pages_k, pages_v, table


class Case:
    """Copies of one shape's inputs for every candidate, and the candidates as callables."""

    def __init__(self, B, Hq, Hkv, Sk, dtype, blocks=(16, 256), seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.kv_bytes = 2 * B * Sk * Hkv * D * torch.finfo(dtype).bits // 8
        copies = max(2, -(-LLC_GUESS // self.kv_bytes))
        self.q = torch.randn(B, 1, Hq, D, generator=gen).to(DEVICE, dtype)
        self.seqlens = torch.full((B,), Sk, dtype=torch.int32, device=DEVICE)
        self.dense, self.sdpa, self.paged = [], [], {b: [] for b in blocks}
        # each copy's dense, torch and paged caches allocated together, so that no candidate's memory is all
        # allocated before another's: on a KVM guest the first gigabyte a process allocated read 1.15-1.25x
        # slower than what it allocated next, the same layout (docs/benchmarks.md, "Allocation order")
        for _ in range(copies):
            k = torch.randn(B, Sk, Hkv, D, generator=gen).to(DEVICE, dtype)
            v = torch.randn(B, Sk, Hkv, D, generator=gen).to(DEVICE, dtype)
            self.dense.append((k, v))
            self.sdpa.append((k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()))
            for block in blocks:
                self.paged[block].append(tuple(t.to(DEVICE) for t in paged_copy(k.cpu(), v.cpu(), block, gen)))
        self.q_sdpa = self.q.transpose(1, 2).contiguous()
        self.turn = 0
        self.gqa = Hq != Hkv

    def _next(self, seq):
        self.turn += 1
        return seq[self.turn % len(seq)]

    def ours(self):
        k, v = self._next(self.dense)
        return ab.attention_with_kvcache(self.q, k, v, cache_seqlens=self.seqlens, backend="paged_attention",
                                         strict=True)

    def paged_fn(self, block):
        def run():
            k, v, table = self._next(self.paged[block])
            return ab.attention_with_kvcache(self.q, k, v, cache_seqlens=self.seqlens, block_table=table,
                                             backend="paged_attention", strict=True)
        return run

    def torch_sdpa(self):
        k, v = self._next(self.sdpa)
        return F.scaled_dot_product_attention(self.q_sdpa, k, v, enable_gqa=self.gqa)

    def auto_int(self):
        """What auto serves with an int cache_seqlens (--device cuda): torch SDPA over the cache's view in
        16-bit types (csrc/ab_planner.c torch_first_kv), the kernel in float32."""
        k, v = self._next(self.dense)
        return ab.attention_with_kvcache(self.q, k, v, cache_seqlens=k.shape[1])

    def check(self):
        """Ours (dense and paged) against torch on the same data before timing anything."""
        k, v = self.dense[0]
        want = F.scaled_dot_product_attention(self.q_sdpa.double(), k.transpose(1, 2).double(),
                                              v.transpose(1, 2).double(), enable_gqa=self.gqa).transpose(1, 2)
        got = [ab.attention_with_kvcache(self.q, k, v, cache_seqlens=self.seqlens, backend="paged_attention",
                                         strict=True)]
        for block, copies in self.paged.items():
            pk, pv, table = copies[0]
            got.append(ab.attention_with_kvcache(self.q, pk, pv, cache_seqlens=self.seqlens, block_table=table,
                                                 backend="paged_attention", strict=True))
        tol = 1e-4 if self.q.dtype == torch.float32 else 2e-2
        for g in got:
            err = (g.double() - want).abs().max().item()
            assert err < tol, f"decode result differs from the reference by {err}"


class TokensCase:
    """Sq query tokens (causal, bottom-right) against a dense cache of Sk keys, B=1 Hq=32 Hkv=8."""

    def __init__(self, Sq, Sk, dtype, B=1, Hq=32, Hkv=8, seed=0):
        gen = torch.Generator().manual_seed(seed)
        kv_bytes = 2 * B * Sk * Hkv * D * torch.finfo(dtype).bits // 8
        copies = max(2, -(-LLC_GUESS // kv_bytes))
        self.q = torch.randn(B, Sq, Hq, D, generator=gen).to(dtype)
        self.q_sdpa = self.q.transpose(1, 2).contiguous()
        self.dense = [tuple(torch.randn(B, Sk, Hkv, D, generator=gen).to(dtype) for _ in range(2))
                      for _ in range(copies)]
        self.sdpa = [tuple(t.transpose(1, 2).contiguous() for t in kv) for kv in self.dense]
        # query t sits at position Sk - Sq + t and sees the keys up to it
        self.mask = torch.ones(Sq, Sk, dtype=torch.bool).tril(Sk - Sq)
        self.turn = 0

    def _next(self, seq):
        self.turn += 1
        return seq[self.turn % len(seq)]

    def call(self, backend):
        def run():
            k, v = self._next(self.dense)
            return ab.attention_with_kvcache(self.q, k, v, causal=True, backend=backend)
        return run

    def kernel(self):
        k, v = self._next(self.dense)
        c = ab._kvcache.check(self.q, k, v, None, None, None, None, None, None, None, None, None, True, (-1, -1),
                              0.0, True, None, 0)
        return ab._kvcache._kernel_op(c)

    def torch_sdpa(self):
        k, v = self._next(self.sdpa)
        return F.scaled_dot_product_attention(self.q_sdpa, k, v, attn_mask=self.mask, enable_gqa=True)

    def check(self):
        k, v = self.sdpa[0]
        want = F.scaled_dot_product_attention(self.q_sdpa.double(), k.double(), v.double(), attn_mask=self.mask,
                                              enable_gqa=True).transpose(1, 2)
        tol = 1e-4 if self.q.dtype == torch.float32 else 2e-2
        for name, fn in self.candidates().items():
            if name == "torch":
                continue
            self.turn = -1  # the candidate's call reads copy 0
            out = fn()
            out = out[0] if isinstance(out, tuple) else out
            err = (out.double() - want).abs().max().item()
            assert err < tol, f"{name}: {err} from the reference"

    def candidates(self):
        return {"kernel": self.kernel, "flash": self.call("flash"), "auto": self.call("auto"),
                "torch": self.torch_sdpa}


# calls that take a CPU decode call's kind through the kernel's first timing of its prefetch requests
# (csrc/cpu/decode_tune.h: up to AB_TUNE_MAX_ARMS = 16 sets, AB_TUNE_ROUNDS = 4 calls each, then
# AB_TUNE_KEEP_CALLS = 512 calls take the set kept), with a few to spare
TUNE_SETTLE_CALLS = 72


def settle(fn, seconds=3.0):
    """Warms a candidate past the CPU kernel's first timing (TUNE_SETTLE_CALLS calls, or `seconds`), as the
    first steps of a decode loop do: the rounds then time the set kept, as the next 512 steps would.  (The
    timing comes back every 512 calls; a round's few dozen calls would otherwise all fall into the first
    one, whose calls try every set, and at 16 sets that costs float32 MHA 3-6%, docs/benchmarks.md.)"""
    if DEVICE == "cuda":
        return
    end = time.perf_counter() + seconds
    for _ in range(TUNE_SETTLE_CALLS):
        fn()
        if time.perf_counter() > end:
            break


def interleaved_rounds(cands, lead, rounds, seconds, least):
    """Seconds per call of each candidate (name -> fn) in each of `rounds` rounds in which every candidate
    runs in turn, each time `reps` calls: enough for about `seconds` of the `lead` candidate, at least
    `least`.  Every candidate is warmed first, past the CPU kernel's first timing (settle)."""
    for fn in cands.values():
        fn()
        fn()
        settle(fn)
    reps = max(least, int(seconds / max(timed(cands[lead], 1), 1e-7)))
    times = {n: [] for n in cands}
    for _ in range(rounds):
        for name, fn in cands.items():
            times[name].append(timed(fn, reps))
    return times


def interleaved_medians(cands, lead, rounds, seconds, least):
    """interleaved_rounds' medians: seconds per call of each candidate."""
    return {n: statistics.median(t) for n, t in interleaved_rounds(cands, lead, rounds, seconds, least).items()}


def tokens_table(tokens, Sk, dtypes, rounds):
    """Medians over interleaved rounds for each token count and dtype; prints the table."""
    print(f"B=1 Hq=32 Hkv=8 D=128, {Sk} keys (dense, a new copy per call), causal bottom-right; ms per call; "
          "ratio = torch / auto")
    print(f"{'Sq (rows/KV head)':<18}  {'dtype':<8}  {'kernel':>8}  {'flash':>8}  {'auto':>8}  {'torch':>8}  ratio")
    rows = []
    for dtype in dtypes:
        for Sq in tokens:
            case = TokensCase(Sq, Sk, dtype)
            case.check()
            cands = case.candidates()
            med = {n: t * 1e3 for n, t in interleaved_medians(cands, "auto", rounds, 0.05, 1).items()}
            print(f"{f'{Sq} ({Sq * 4})':<18}  {str(dtype)[6:]:<8}  {med['kernel']:8.3f}  {med['flash']:8.3f}  "
                  f"{med['auto']:8.3f}  {med['torch']:8.3f}  {med['torch'] / med['auto']:5.2f}x", flush=True)
            rows.append(dict(Sq=Sq, Sk=Sk, dtype=str(dtype)[6:], **{f"{n}_ms": t for n, t in med.items()}))
            del case
    return rows


SMALL_SHAPES = [  # (B, Hq, Hkv, Sk, D): small decode calls (--small)
    (1, 1, 1, 1, 8),
    (1, 4, 1, 16, 32),
    (1, 8, 2, 64, 64),
    (1, 12, 12, 64, 64),
    (1, 12, 12, 256, 64),
    (1, 12, 12, 1024, 64),
    (4, 12, 12, 256, 64),
    (1, 16, 16, 256, 64),
    (1, 32, 8, 256, 128),
    (1, 32, 32, 256, 128),
]


def small_table(dtypes, rounds):
    """--small: medians over interleaved rounds of ours and torch SDPA (contiguous copies, and the cache's
    transposed view) for SMALL_SHAPES; prints the table."""
    print("one query token, the same dense cache every call; us per call; ratios = torch / ours")
    print(f"{'B Hq Hkv Sk D':<20}  {'dtype':<8}  {'ours':>8}  {'torch':>8}  {'t. view':>8}  ratio  view")
    rows = []
    gen = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        for B, Hq, Hkv, Sk, Ds in SMALL_SHAPES:
            q = torch.randn(B, 1, Hq, Ds, generator=gen).to(dtype)
            k, v = (torch.randn(B, Sk, Hkv, Ds, generator=gen).to(dtype) for _ in range(2))
            qc, kc, vc = (t.transpose(1, 2).contiguous() for t in (q, k, v))
            gqa = Hq != Hkv
            cands = {"ours": lambda: ab.attention_with_kvcache(q, k, v),
                     "torch": lambda: F.scaled_dot_product_attention(qc, kc, vc, enable_gqa=gqa),
                     "view": lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                    v.transpose(1, 2), enable_gqa=gqa)}
            want = cands["torch"]().transpose(1, 2).float()
            err = (cands["ours"]().float() - want).abs().max().item()
            assert err < (1e-4 if dtype == torch.float32 else 2e-2), f"{err} from torch SDPA"
            med = {n: t * 1e6 for n, t in interleaved_medians(cands, "ours", rounds, 0.02, 5).items()}
            print(f"{f'{B} {Hq} {Hkv} {Sk} {Ds}':<20}  {str(dtype)[6:]:<8}  {med['ours']:8.1f}  {med['torch']:8.1f}  "
                  f"{med['view']:8.1f}  {med['torch'] / med['ours']:5.2f}  {med['view'] / med['ours']:5.2f}",
                  flush=True)
            rows.append(dict(B=B, Hq=Hq, Hkv=Hkv, Sk=Sk, D=Ds, dtype=str(dtype)[6:],
                             **{f"{n}_us": t for n, t in med.items()}))
    return rows


@contextlib.contextmanager
def variable_restored(var):
    """Runs the block, then puts the environment variable var back as it was (set or unset)."""
    saved = os.environ.get(var)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = saved


SMALL_MODELS = [  # (layers, heads, Sk, D): small MHA models' decode steps (--small-layers), 6 to 512 MiB of caches
    (8, 12, 256, 64),
    (12, 12, 256, 64),
    (12, 12, 1024, 64),
    (24, 16, 1024, 64),
    (8, 32, 256, 128),
    (32, 32, 1024, 128),
]


def small_layers_table(dtypes, rounds):
    """--small-layers: one decode step of a small MHA model, one query token against each layer's own
    (B=1, H, Sk, D) cache in turn through ab.attention (the layout HF passes): auto, the runs of keys forced on
    and off (ATTN_BACKENDS_DECODE_MHA_RUNS), and torch SDPA on the same tensors; medians over interleaved rounds;
    ratio = torch / auto."""
    var = "ATTN_BACKENDS_DECODE_MHA_RUNS"
    print("one decode step, layers in turn; us per step; ratio = torch / auto")
    print(f"{'layers H Sk D (MiB)':<24}  {'dtype':<8}  {'auto':>9}  {'runs':>9}  {'chunks':>9}  {'torch':>9}  ratio")
    rows = []
    gen = torch.Generator().manual_seed(0)
    with variable_restored(var):
        for dtype in dtypes:
            for L, H, Sk, Ds in SMALL_MODELS:
                qs = [torch.randn(1, H, 1, Ds, generator=gen).to(dtype) for _ in range(L)]
                kv = [tuple(torch.randn(1, H, Sk, Ds, generator=gen).to(dtype) for _ in range(2)) for _ in range(L)]

                def ours(setting):
                    def step():
                        if setting is None:
                            os.environ.pop(var, None)
                        else:
                            os.environ[var] = setting
                        for q, (k, v) in zip(qs, kv):
                            out = ab.attention(q, k, v)
                        return out
                    return step

                def sdpa():
                    for q, (k, v) in zip(qs, kv):
                        out = F.scaled_dot_product_attention(q, k, v)
                    return out

                cands = {"auto": ours(None), "runs": ours("1"), "chunks": ours("0"), "torch": sdpa}
                want = cands["torch"]().float()
                for name in ("auto", "runs", "chunks"):
                    err = (cands[name]().float() - want).abs().max().item()
                    assert err < (1e-4 if dtype == torch.float32 else 2e-2), f"{name}: {err} from torch SDPA"
                med = {n: t * 1e6 for n, t in interleaved_medians(cands, "auto", rounds, 0.05, 3).items()}
                mib = L * 2 * H * Sk * Ds * torch.finfo(dtype).bits / 8 / 2**20
                print(f"{f'{L} {H} {Sk} {Ds} ({mib:.0f})':<24}  {str(dtype)[6:]:<8}  {med['auto']:9.1f}  "
                      f"{med['runs']:9.1f}  {med['chunks']:9.1f}  {med['torch']:9.1f}  "
                      f"{med['torch'] / med['auto']:5.2f}", flush=True)
                rows.append(dict(layers=L, H=H, Sk=Sk, D=Ds, MiB=mib, dtype=str(dtype)[6:],
                                 **{f"{n}_us": t for n, t in med.items()}))
    return rows


def paged_layout(k, v, block, order, gen):
    """The dense cache (B, Sk, Hkv, D) as pages of `block` positions: "shuffled" (paged_copy's), "in order"
    (row b's block i at b * nb + i: one contiguous run per row) or "pairs" (two neighbouring blocks kept
    together, the pairs shuffled: with blocks of 16, each 32-key chunk of the kernel is contiguous)."""
    if order == "shuffled":
        return paged_copy(k, v, block, gen)
    B, Sk = k.shape[:2]
    nb = Sk // block
    assert Sk % block == 0 and (order == "in order" or B * nb % 2 == 0), "whole blocks (and pairs) only"
    if order == "in order":
        slots = torch.arange(B * nb)
    else:
        pairs = torch.randperm(B * nb // 2, generator=gen)
        slots = torch.stack([2 * pairs, 2 * pairs + 1], 1).reshape(-1)
    pages = [torch.empty(B * nb, block, *t.shape[2:], dtype=t.dtype) for t in (k, v)]
    for page, t in zip(pages, (k, v)):
        page[slots] = t.reshape(B * nb, block, *t.shape[2:])
    return pages[0], pages[1], slots.view(B, nb).to(torch.int32)


POOL_LAYOUTS = [  # (label, block, order): --pool-layouts
    ("p16 shuffled", 16, "shuffled"),
    ("p16 in order", 16, "in order"),
    ("p16 pairs", 16, "pairs"),
    ("p32 shuffled", 32, "shuffled"),
]


def decode_inputs(B, Hq, Hkv, Sk, dtype, copies=None):
    """A seeded generator, one query token q (B, 1, Hq, D), int32 cache_seqlens = Sk, and `copies` dense
    caches (k, v), each (B, Sk, Hkv, D) (by default enough that they do not fit in the last-level cache):
    --pool-layouts' and --switch's inputs."""
    gen = torch.Generator().manual_seed(0)
    if copies is None:
        copies = max(2, -(-LLC_GUESS // (2 * B * Sk * Hkv * D * torch.finfo(dtype).bits // 8)))
    q = torch.randn(B, 1, Hq, D, generator=gen).to(dtype)
    seqlens = torch.full((B,), Sk, dtype=torch.int32)
    dense = [tuple(torch.randn(B, Sk, Hkv, D, generator=gen).to(dtype) for _ in range(2)) for _ in range(copies)]
    return gen, q, seqlens, dense


def pool_layouts_table(dtypes, rounds, shapes):
    """--pool-layouts: our kernel over the decode shapes' caches, dense and as pools of several layouts (the
    same data, a new copy per call as in the main table); medians over interleaved rounds, and each
    layout's time over dense as the median of its rounds' ratios."""
    print("one query token, ms per call; layout / dense: the median of each round's ratio")
    print(f"{'shape':<22}  {'dtype':<8}  {'dense':>8}  " + "  ".join(f"{n:>19}" for n, _, _ in POOL_LAYOUTS))
    rows = []
    for dtype in dtypes:
        for label, B, Hq, Hkv, Sk in shapes:
            gen, q, seqlens, dense = decode_inputs(B, Hq, Hkv, Sk, dtype)
            pools = {"dense": [(k, v, None) for k, v in dense]}
            for name, block, order in POOL_LAYOUTS:
                pools[name] = [paged_layout(k, v, block, order, gen) for k, v in dense]
            turn = [0]

            def caller(seq):
                def run():
                    turn[0] += 1
                    k, v, table = seq[turn[0] % len(seq)]
                    return ab.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, block_table=table,
                                                     backend="paged_attention", strict=True)
                return run

            cands = {n: caller(seq) for n, seq in pools.items()}
            turn[0] = -1
            want = cands["dense"]()
            for n, fn in cands.items():  # every layout reads copy 0 here: the same bits as dense
                turn[0] = -1
                assert torch.equal(fn(), want), f"{n}: not dense's result"
            times = interleaved_rounds(cands, "dense", rounds, 0.05, 1)
            med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
            over = {n: statistics.median(a / b for a, b in zip(t, times["dense"])) for n, t in times.items()}
            print(f"{label:<22}  {str(dtype)[6:]:<8}  {med['dense']:8.3f}  "
                  + "  ".join(f"{med[n]:8.3f} ms {over[n]:5.2f}x" for n, _, _ in POOL_LAYOUTS), flush=True)
            rows.append(dict(shape=label, B=B, Hq=Hq, Hkv=Hkv, Sk=Sk, D=D, dtype=str(dtype)[6:],
                             **{f"{n}_ms": t for n, t in med.items()},
                             **{f"{n}_over_dense": r for n, r in over.items() if n != "dense"}))
            del pools, cands, dense
    return rows


SWITCH_CALLS_PER_ROUND = 200  # --switch: calls per --rounds, both settings together
SLICES = 8  # --switch: the calls cut into this many consecutive slices, each slice's ratio printed as a spread


def shuffled_calls(cands, calls, before=None, seed=0):
    """Seconds of each call of each candidate (name -> fn): `calls` calls in all, each one's candidate drawn at
    random (before(name), untimed, first).  Rounds of a few dozen calls per candidate in a fixed order (the
    other tables) let what drifts within a round, or follows a candidate's place in it, fall on one of them:
    drawn call by call, both see the same machine (docs/benchmarks.md, "Switches timed call by call").  Every
    candidate is warmed first, past the kernel's first timing (settle)."""
    for name, fn in cands.items():
        if before:
            before(name)
        fn()
        settle(fn)
    rng = random.Random(seed)
    names = list(cands)
    times = {n: [] for n in names}
    for _ in range(calls):
        name = rng.choice(names)
        if before:
            before(name)
        t = time.perf_counter()
        cands[name]()
        times[name].append(time.perf_counter() - t)
    return times


def slice_ratios(a, b):
    """The ratio of the medians of a and b over each of SLICES consecutive slices of the calls (in order)."""
    return [statistics.median(a[i * len(a) // SLICES:(i + 1) * len(a) // SLICES])
            / statistics.median(b[i * len(b) // SLICES:(i + 1) * len(b) // SLICES]) for i in range(SLICES)]


# switches that change the sums, so the bits (the others may not): the AMX tiles for the products
# (csrc/cpu/decode_cpu.c decode_table, amx_tiles), the bfloat16 products themselves, one-token MHA in runs of keys
# (mha_runs: the sums in another order)
BITS_CHANGING = ("AMX", "BF16_DOT", "MHA_RUNS")


def switch_table(switch, dtypes, rounds, shapes, tokens=1):
    """--switch NAME: our kernel over the decode shapes' caches (dense, and 16- and 256-key blocks shuffled; a new
    copy per call as in the main table) and over one cache the L3 holds (B=1 Hq=32 Hkv=8 Sk=1024, the same copy
    every call), with ATTN_BACKENDS_DECODE_<NAME> forced to 0 or to 1 call by call, drawn at random
    (shuffled_calls), in one process; on / off is the ratio of the medians.  The two settings' bits are checked
    equal first (the values, for BITS_CHANGING).  tokens > 1: that many query tokens per call, causal, and no
    L3 row."""
    var = "ATTN_BACKENDS_DECODE_" + switch
    what = "one query token" if tokens == 1 else f"{tokens} query tokens (causal)"
    print(f"{what}, ms per call with {var}=0 and =1, the calls shuffled (shuffled_calls); on / off: the "
          f"ratio of the medians, and its least and greatest over {SLICES} slices of the calls in their order")
    print(f"{'shape':<24}  {'dtype':<8}  {'cache':<6}  {'off':>8}  {'on':>8}  {'on/off':>6}  slices")
    rows = []
    resident = ("B1 GQA 32/8 Sk1024 (L3)", 1, 32, 8, 1024)
    with variable_restored(var):
        for dtype in dtypes:
            for label, B, Hq, Hkv, Sk in list(shapes) + ([resident] if tokens == 1 else []):
                gen, q, seqlens, dense = decode_inputs(B, Hq, Hkv, Sk, dtype, 1 if label == resident[0] else None)
                if tokens > 1:
                    q = torch.randn(B, tokens, Hq, D, generator=gen).to(dtype)
                pools = {"dense": [(k, v, None) for k, v in dense]}
                if len(dense) > 1:
                    pools["p16"] = [paged_copy(k, v, 16, gen) for k, v in dense]
                    pools["p256"] = [paged_copy(k, v, 256, gen) for k, v in dense]
                for cache, seq in pools.items():
                    turn = [0]

                    def run(seq=seq, turn=turn):  # the setting is the variable's, set before the call
                        turn[0] += 1
                        k, v, table = seq[turn[0] % len(seq)]
                        return ab.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, block_table=table,
                                                         causal=tokens > 1, backend="paged_attention", strict=True)

                    def setting(name):
                        os.environ[var] = "1" if name == "on" else "0"

                    cands = {"off": run, "on": run}
                    outs = []
                    for name, fn in cands.items():
                        setting(name)
                        turn[0] = -1
                        outs.append(fn())
                    if switch in BITS_CHANGING:  # another product's sums: the same values within bfloat16's rounding
                        torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=2e-2, rtol=2e-2)
                    else:
                        assert torch.equal(outs[0], outs[1]), f"{label} {cache}: the switch changed the bits"
                    times = shuffled_calls(cands, SWITCH_CALLS_PER_ROUND * rounds, setting)
                    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
                    ratio = med["on"] / med["off"]
                    spread = slice_ratios(times["on"], times["off"])
                    print(f"{label:<24}  {str(dtype)[6:]:<8}  {cache:<6}  {med['off']:8.3f}  {med['on']:8.3f}  "
                          f"{ratio:6.3f}  {min(spread):.3f}-{max(spread):.3f}", flush=True)
                    rows.append(dict(shape=label, B=B, Hq=Hq, Hkv=Hkv, Sk=Sk, D=D, Sq=tokens, dtype=str(dtype)[6:],
                                     cache=cache,
                                     off_ms=med["off"], on_ms=med["on"], on_over_off=ratio,
                                     on_over_off_slices=spread, calls=[len(times["off"]), len(times["on"])]))
                del pools, dense
    return rows


LAYER_SHAPES = [  # (label, B, Hq, Hkv, Sk): a layer's cache; the step reads one per layer
    ("B1 GQA 32/8 Sk512", 1, 32, 8, 512),
    ("B1 GQA 32/8 Sk2048", 1, 32, 8, 2048),
    ("B4 GQA 32/8 Sk1024", 4, 32, 8, 1024),
]


class LayersCase:
    """A model's decode step: one query token against each of `layers` caches in turn (each layer has its
    own), for our kernel under each setting of the next-keys prefetch, and torch SDPA."""

    def __init__(self, layers, B, Hq, Hkv, Sk, dtype, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.q = torch.randn(B, 1, Hq, D, generator=gen).to(dtype)
        self.q_sdpa = self.q.transpose(1, 2).contiguous()
        self.dense = [tuple(torch.randn(B, Sk, Hkv, D, generator=gen).to(dtype) for _ in range(2))
                      for _ in range(layers)]
        self.sdpa = [tuple(t.transpose(1, 2).contiguous() for t in kv) for kv in self.dense]
        self.seqlens = torch.full((B,), Sk, dtype=torch.int32)
        self.layer_bytes = 2 * B * Sk * Hkv * D * torch.finfo(dtype).bits // 8
        self.gqa = Hq != Hkv

    def ours(self, keys_next, tune=None):
        def step():
            # ATTN_BACKENDS_DECODE_KEYS_NEXT and _TUNE (csrc/cpu/decode_cpu.c keys_next, tune) are read at every call
            for var, value in (("ATTN_BACKENDS_DECODE_KEYS_NEXT", keys_next), ("ATTN_BACKENDS_DECODE_TUNE", tune)):
                if value is None:
                    os.environ.pop(var, None)
                else:
                    os.environ[var] = value
            for k, v in self.dense:
                ab.attention_with_kvcache(self.q, k, v, cache_seqlens=self.seqlens, backend="paged_attention",
                                          strict=True)
        return step

    def torch_sdpa(self):
        for k, v in self.sdpa:
            F.scaled_dot_product_attention(self.q_sdpa, k, v, enable_gqa=self.gqa)

    def check(self):
        k, v = self.dense[0]
        want = F.scaled_dot_product_attention(self.q_sdpa.double(), k.transpose(1, 2).double(),
                                              v.transpose(1, 2).double(), enable_gqa=self.gqa).transpose(1, 2)
        got = ab.attention_with_kvcache(self.q, k, v, cache_seqlens=self.seqlens, backend="paged_attention")
        err = (got.double() - want).abs().max().item()
        assert err < (2e-2 if self.q.dtype == torch.bfloat16 else 1e-4), f"decode differs from the reference by {err}"

    def candidates(self):
        return {"auto": self.ours(None), "rules": self.ours(None, "0"), "off": self.ours("0", "0"),
                "on": self.ours("1", "0"), "sdpa": self.torch_sdpa}


def layers_table(layer_counts, dtypes, rounds):
    """Medians over interleaved rounds (the order turning each round) of one decode step per candidate."""
    variables = ("ATTN_BACKENDS_DECODE_KEYS_NEXT", "ATTN_BACKENDS_DECODE_TUNE")
    before = {var: os.environ.get(var) for var in variables}
    print("ms per decode step (one token against every layer's cache); auto: the kernel's own choice (from DRAM the "
          "prefetch requests timed against each other), rules: the rules alone (ATTN_BACKENDS_DECODE_TUNE=0), "
          "off/on: the rules with the next-keys prefetch forced off/on; ratio = sdpa / auto")
    print(f"{'layers':>6}  {'cache per layer':<20}  {'dtype':<8}  {'MiB':>5}  {'auto':>8}  {'rules':>8}  {'off':>8}  "
          f"{'on':>8}  {'sdpa':>8}  auto/rules  on/off  ratio")
    rows = []
    try:
        for dtype in dtypes:
            for layers in layer_counts:
                for label, B, Hq, Hkv, Sk in LAYER_SHAPES:
                    case = LayersCase(layers, B, Hq, Hkv, Sk, dtype)
                    case.check()
                    cands = case.candidates()
                    reps = max(1, -(-64 // layers))  # the kernel's working set window is its last 64 calls
                    for fn in cands.values():
                        timed(fn, reps)
                    times = {n: [] for n in cands}
                    names = list(cands)
                    for r in range(rounds):
                        for name in names[r % len(names):] + names[:r % len(names)]:
                            timed(cands[name], reps)  # the window filled with this candidate's calls
                            times[name].append(timed(cands[name], reps))
                    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
                    mib = layers * case.layer_bytes / 2**20
                    print(f"{layers:>6}  {label:<20}  {str(dtype)[6:]:<8}  {mib:5.0f}  {med['auto']:8.3f}  "
                          f"{med['rules']:8.3f}  {med['off']:8.3f}  {med['on']:8.3f}  {med['sdpa']:8.3f}  "
                          f"{med['auto'] / med['rules']:10.2f}  {med['on'] / med['off']:6.2f}  "
                          f"{med['sdpa'] / med['auto']:5.2f}x", flush=True)
                    rows.append(dict(layers=layers, shape=label, B=B, Hq=Hq, Hkv=Hkv, Sk=Sk, D=D,
                                     dtype=str(dtype)[6:], MiB=mib, **{f"{n}_ms": t for n, t in med.items()}))
                    del case, cands
    finally:
        for var, value in before.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
    return rows


def bf16_products() -> str:
    """Whether the CPU decode kernel multiplies a bfloat16 cache with AVX512_BF16 (docs/decode.md): for every call,
    none, or (Intel) calls of at most 2 query rows per KV head."""
    if not decode_bf16_products(torch.bfloat16, 1):
        return "off"
    return "on" if decode_bf16_products(torch.bfloat16, 2**62) else "on up to 2 query rows per KV head"


def timed(fn, reps):
    """Seconds per call: wall clock on the CPU, CUDA events around the calls on a GPU."""
    if DEVICE == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / reps
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def cuda_attention_kernel() -> str:
    """The CUDA decode kernel's attention for 16-bit calls (csrc/cuda/decode.cu variant_of): "mma" (tensor
    cores) or "lanes" as ATTN_BACKENDS_CUDA_DECODE_KERNEL forces, else "by rows" (mma where a KV head has
    two query rows or more: GQA, several tokens; lanes for one-token MHA); float32 calls take "lanes"."""
    env = os.environ.get("ATTN_BACKENDS_CUDA_DECODE_KERNEL")
    return env if env in ("mma", "lanes") else "by rows"


def as_graph(fn, calls):
    """fn called `calls` times (each on its own copy of the cache), captured in one CUDA graph: its
    replay runs the kernels without the host's per-call work (Python, dispatch, launch), as a decode
    step captured in a graph does (HF's continuous batching, vLLM)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph.replay


def measure(case: Case, rounds: int, probe, blocks):
    """Medians over rounds of seconds per call for each candidate, of the read bandwidth, of each
    candidate's time over ours in the same round, and of each candidate's GB/s of K and V over the read
    bandwidth of the same round (a round's ratio cancels what drifts between rounds: the machine's
    bandwidth moves by tens of percent here)."""
    cands = {"ours": case.ours, "sdpa": case.torch_sdpa}
    for b in blocks:
        cands[f"paged{b}"] = case.paged_fn(b)
    if DEVICE == "cuda":  # auto with an int cache_seqlens: what torch_first_kv sends to torch
        cands["auto_int"] = case.auto_int
    per = dict.fromkeys(cands, 1)
    if GRAPH:
        for n, fn in cands.items():
            try:
                cands[n], per[n] = as_graph(fn, GRAPH_CALLS), GRAPH_CALLS
            except RuntimeError as e:  # timed outside a graph then, and said so
                print(f"  {n}: not captured in a CUDA graph ({str(e).splitlines()[0]}); timed call by call")
    for name, fn in cands.items():  # warm-up: thread pool, allocator, page faults
        fn()
        fn()
        if name == "ours" or name.startswith("paged"):
            settle(fn)  # past the kernel's first timing of its prefetch requests
    reps = max(1, int(0.05 / max(timed(cands["ours"], 1), 1e-6)))  # about 50 ms of calls per sample
    times = {n: [] for n in cands}
    bw = []
    for _ in range(rounds):
        bw.append(probe())
        for name, fn in cands.items():
            times[name].append(timed(fn, reps) / per[name])
    ratios = {n: statistics.median(a / b for a, b in zip(t, times["ours"])) for n, t in times.items() if n != "ours"}
    reads = {n: statistics.median(case.kv_bytes / a / r for a, r in zip(t, bw)) for n, t in times.items()}
    return {n: statistics.median(t) for n, t in times.items()}, statistics.median(bw), ratios, reads


def table_row(label, dtype, med, bw, kv_bytes, blocks, ratios, reads):
    cells = [f"{label:<22}", f"{str(dtype)[6:]:<8}", f"{bw / 1e9:6.1f}"]
    for name in ["ours", "sdpa"] + [f"paged{b}" for b in blocks]:
        gbs = kv_bytes / med[name]
        cells.append(f"{med[name] * 1e3:8.3f} {gbs / 1e9:6.1f} {100 * reads[name]:4.0f}%")
    cells.append(f"{ratios['sdpa']:5.2f}x")
    cells += [f"{ratios[f'paged{b}']:5.2f}" for b in blocks]
    return "  ".join(cells)


def sweep(dtype, rounds, probe, lengths, out_dir, stem):
    rows = []
    for Sk in lengths:
        case = Case(1, 32, 8, Sk, dtype, blocks=(16,))
        med, bw, _, _ = measure(case, rounds, probe, (16,))
        rows.append(dict(Sk=Sk, dtype=str(dtype)[6:], ours_ms=med["ours"] * 1e3, paged16_ms=med["paged16"] * 1e3,
                         sdpa_ms=med["sdpa"] * 1e3, read_GBps=bw / 1e9, kv_bytes=case.kv_bytes))
        print(f"  Sk {Sk:>6}  ours {med['ours'] * 1e3:8.3f} ms  paged16 {med['paged16'] * 1e3:8.3f} ms  "
              f"sdpa {med['sdpa'] * 1e3:8.3f} ms", flush=True)
        del case
    path = os.path.join(out_dir, f"{stem}_sweep_{str(dtype)[6:]}.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"  wrote {path}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  (matplotlib is not installed: no plot, the CSV has the numbers)")
        return rows
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["Sk"] for r in rows]
    for key, label in (("ours_ms", "ours (dense)"), ("paged16_ms", "ours (paged, 16)"), ("sdpa_ms", "torch SDPA")):
        ax.plot(xs, [r[key] for r in rows], marker="o", label=label)
    ax.plot(xs, [r["kv_bytes"] / (r["read_GBps"] * 1e9) * 1e3 for r in rows], "k--", label="K+V at read bandwidth")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("cache length Sk")
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"decode, B=1 Hq=32 Hkv=8 D=128 {str(dtype)[6:]}, {torch.get_num_threads()} threads")
    ax.legend()
    fig.tight_layout()
    png = os.path.join(out_dir, f"{stem}_sweep_{str(dtype)[6:]}.png")
    fig.savefig(png, dpi=120)
    print(f"  wrote {png}")
    return rows


def cpu_name() -> str:
    """The CPU as this machine names it: the brand string, and on Linux its family and model (a KVM guest's
    brand may be only "AMD EPYC", which the two tell apart: family 25 model 1 is a Zen 3, model 17 a Zen 4),
    then the ISA features the kernels look for."""
    feats = ab._C.cpu_features()
    name = feats.get("brand", "").strip() or platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            info = dict((a.strip(), b.strip()) for a, _, b in (line.partition(":") for line in f.read().split("\n\n")[0]
                                                                 .splitlines()))
        name += f" (family {info['cpu family']} model {info['model']})"
    except (OSError, KeyError):
        pass
    flags = " ".join(k for k, v in feats.items() if v is True)
    return f"{name}, {flags}"


def huge_pages() -> str:
    """Whether the caches can sit on 2 MiB pages: the system's transparent huge pages setting, and whether torch's
    allocator asks for them (THP_MEM_ALLOC_ENABLE=1).  On the AMX Xeon the probe and torch read 1.2-1.3x faster on
    them and our kernel did not (docs/benchmarks.md, "Decode on the AMX Xeon against cache length, with huge pages,
    and the kernel's own ceiling"), so a table names its pages."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        mode = "unknown"
    asked = os.environ.get("THP_MEM_ALLOC_ENABLE", "") not in ("", "0")
    return f"transparent huge pages {mode}" + (", torch asks for them (THP_MEM_ALLOC_ENABLE)" if asked else "")


def run_cpu_table(path, rounds, key, table, line, **record):
    """--layers, --small, --tokens: prints the machine's line (plus `line`), runs table() in inference mode
    and, with --json, writes its rows under `key` beside the machine's record (and `record`)."""
    print(f"attn_backends {ab.__version__}, torch {torch.__version__}, {cpu_name()}, "
          f"{torch.get_num_threads()} threads, CPU path {ab._C.cpu_isa()}{line}, {huge_pages()}")
    with torch.inference_mode():
        rows = table()
    tuned = tune_report()
    if path:
        with open(path, "w") as f:
            json.dump(dict(machine=platform.platform(), processor=platform.processor(), cpu=cpu_name(), device="cpu",
                           threads=torch.get_num_threads(), torch=torch.__version__, cpu_path=ab._C.cpu_isa(),
                           pages=huge_pages(), **record, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           rounds=rounds, **{key: rows}, tuned=tuned), f, indent=1)
        print(f"wrote {path}")


TUNE_SWITCHES = ((1, "keys_next"), (2, "values_ahead"), (4, "pages_ahead"), (8, "pv_keys"), (16, "scores_by_head"))


def tune_report():
    """The prefetch requests the CPU kernel kept for each kind of call it timed (csrc/cpu/decode_tune.c), printed
    and returned as rows: the rule's set, the set kept, each arm's calls."""
    rows = []
    for k in ab._C.decode_tune_state():
        def spell(bits):
            return "+".join(n for b, n in TUNE_SWITCHES if bits & b) or "none"
        row = dict(dtype=DTYPE_NAMES[k["dtype"]], group=k["group"], block_size=k["block_size"],
                   one_token=k["one_token"], rule=spell(k["rule"]), timed=spell(k["free"]),
                   kept=spell(k["kept"]) if k["chosen"] >= 0 else None, timings=k["timings"], arm_calls=k["arm_calls"])
        rows.append(row)
        print(f"tuned: dtype {row['dtype']} G={row['group']} {'blocks of ' + str(row['block_size']) if row['block_size'] else 'dense'}: rule {row['rule']}, "
              f"kept {row['kept']} ({row['timings']} timings, calls per arm {row['arm_calls']})")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="first shape only, 3 rounds: a check, not a measurement")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--sweep", action="store_true", help="also time against cache length (CSV, PNG)")
    ap.add_argument("--sweep-lengths", default="512,1024,2048,4096,8192,16384,32768")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--tokens", default=None, help="query tokens per call, e.g. 1,4,8,12,16: the several-token "
                    "table instead of the decode shapes")
    ap.add_argument("--tokens-cache", type=int, default=4096, help="keys in the cache for --tokens")
    ap.add_argument("--layers", default=None, help="layer counts, e.g. 1,32: a model's decode step (one cache "
                    "per layer, read in turn) instead of the decode shapes: auto, the rules alone, the next-keys prefetch off/on")
    ap.add_argument("--small", action="store_true", help="small decode calls, the cache in the caches: ours "
                    "against torch SDPA on contiguous copies and on the cache's transposed view")
    ap.add_argument("--small-layers", action="store_true", help="small MHA models' decode steps (a cache per "
                    "layer, read in turn through ab.attention): auto, the runs of keys forced on and off, torch SDPA")
    ap.add_argument("--pool-layouts", action="store_true", help="our kernel over the decode shapes, dense "
                    "and as pools of 16- and 32-key blocks in several orders (shuffled, in order, in pairs)")
    ap.add_argument("--switch", default=None, help="a kernel switch, e.g. SCORES_BY_HEAD: our kernel over the "
                    "decode shapes with ATTN_BACKENDS_DECODE_<switch> forced 0 and 1 in turn, in one process")
    ap.add_argument("--switch-shapes", default=None, help="--switch over these shapes instead, B,Hq,Hkv,Sk each, "
                    "separated by ';' (e.g. '8,16,8,2048;1,32,8,8192')")
    ap.add_argument("--switch-tokens", type=int, default=1, help="--switch with this many query tokens per call "
                    "(causal)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cuda: our CUDA decode kernel (switched on here) against torch SDPA on the GPU")
    ap.add_argument("--graph", action="store_true",
                    help=f"cuda: time replays of CUDA graphs of {GRAPH_CALLS} calls each (the kernels alone)")
    args = ap.parse_args(argv)
    global DEVICE, GRAPH
    DEVICE = args.device
    GRAPH = args.graph
    if GRAPH and DEVICE != "cuda":
        ap.error("--graph needs --device cuda")
    if DEVICE == "cuda":
        ab._C.enable_cuda_decode(True)  # on by default; on here even under ATTN_BACKENDS_CUDA_DECODE=0
        ab._dispatch.reset_caches()
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds = 3 if args.quick else args.rounds
    shapes = SHAPES[:1] if args.quick else SHAPES
    switch_shapes = shapes
    if args.switch_shapes:
        switch_shapes = []
        for spec in args.switch_shapes.split(";"):
            B, Hq, Hkv, Sk = (int(x) for x in spec.split(","))
            switch_shapes.append((f"B{B} {Hq}/{Hkv} Sk{Sk}", B, Hq, Hkv, Sk))
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    blocks = (16, 256)
    if args.layers:
        if DEVICE != "cpu" or args.tokens:
            ap.error("--layers times the CPU kernel, alone")
        run_cpu_table(args.json, rounds, "layers",
                      lambda: layers_table([int(x) for x in args.layers.split(",")], dtypes, rounds),
                      f", bfloat16 products {bf16_products()}, L3 {ab._C.cpu_features()['l3_bytes'] >> 20} MiB",
                      cpu_features=ab._C.cpu_features(), bf16_products=bf16_products())
        return
    if args.small:
        if DEVICE != "cpu" or args.tokens or args.layers:
            ap.error("--small times the CPU calls, alone")
        run_cpu_table(args.json, rounds, "small", lambda: small_table(dtypes, rounds), "",
                      cpu_features=ab._C.cpu_features())
        return
    if args.small_layers:
        if DEVICE != "cpu" or args.tokens or args.layers or args.small:
            ap.error("--small-layers times the CPU calls, alone")
        run_cpu_table(args.json, rounds, "small_layers", lambda: small_layers_table(dtypes, rounds), "",
                      cpu_features=ab._C.cpu_features())
        return
    if args.pool_layouts:
        if DEVICE != "cpu" or args.tokens or args.layers or args.small:
            ap.error("--pool-layouts times the CPU kernel, alone")
        run_cpu_table(args.json, rounds, "pool_layouts", lambda: pool_layouts_table(dtypes, rounds, shapes),
                      f", bfloat16 products {bf16_products()}", cpu_features=ab._C.cpu_features(),
                      bf16_products=bf16_products())
        return
    if args.switch:
        if DEVICE != "cpu" or args.tokens or args.layers or args.small or args.pool_layouts:
            ap.error("--switch times the CPU kernel, alone")
        run_cpu_table(args.json, rounds, "switch",
                      lambda: switch_table(args.switch, dtypes, rounds, switch_shapes, args.switch_tokens),
                      f", bfloat16 products {bf16_products()}", cpu_features=ab._C.cpu_features(),
                      bf16_products=bf16_products(), variable="ATTN_BACKENDS_DECODE_" + args.switch)
        return
    if args.tokens:
        if DEVICE != "cpu":
            ap.error("--tokens times the CPU paths")
        run_cpu_table(args.json, rounds, "tokens",
                      lambda: tokens_table([int(x) for x in args.tokens.split(",")], args.tokens_cache, dtypes,
                                           rounds),
                      f", bfloat16 products {bf16_products()}", bf16_products=bf16_products())
        return
    probe = read_bandwidth_probe()
    where = (f"{torch.cuda.get_device_name()}, attention kernel {cuda_attention_kernel()}" if DEVICE == "cuda"
             else f"{cpu_name()}, {torch.get_num_threads()} threads, "
                  f"CPU path {ab._C.cpu_isa()}, bfloat16 products {bf16_products()}, {huge_pages()}")
    print(f"attn_backends {ab.__version__}, torch {torch.__version__}, {where}"
          + (f", CUDA graphs of {GRAPH_CALLS} calls" if GRAPH else ""))
    print("per candidate: ms per call, GB/s of K and V (medians over rounds), % of the read bandwidth; "
          "ratio = sdpa / ours, paged = paged / dense time (the % and the ratios: medians of each round's)")
    print(f"{'shape':<22}  {'dtype':<8}  {'read':>6}  {'ours':>21}  {'sdpa':>21}  {'paged16':>21}  {'paged256':>21}"
          f"  ratio  p16   p256")
    results = []
    with torch.inference_mode():
        for dtype in dtypes:
            for label, B, Hq, Hkv, Sk in shapes:
                case = Case(B, Hq, Hkv, Sk, dtype, blocks)
                case.check()
                med, bw, ratios, reads = measure(case, rounds, probe, blocks)
                print(table_row(label, dtype, med, bw, case.kv_bytes, blocks, ratios, reads), flush=True)
                if "auto_int" in med:
                    print(f"{'':<22}  auto, int cache_seqlens: {med['auto_int'] * 1e3:.3f} ms, "
                          f"{ratios['sdpa'] / ratios['auto_int']:.2f}x torch's speed", flush=True)
                results.append(dict(shape=label, B=B, Hq=Hq, Hkv=Hkv, Sk=Sk, D=D, dtype=str(dtype)[6:],
                                    read_GBps=bw / 1e9, kv_bytes=case.kv_bytes,
                                    **{f"{n}_ms": t * 1e3 for n, t in med.items()},
                                    **{f"{n}_over_ours": r for n, r in ratios.items()},
                                    **{f"{n}_of_read": r for n, r in reads.items()}))
                del case
        sweeps = {}
        if args.sweep:
            out_dir = os.path.dirname(args.json) if args.json else "."
            stem = os.path.splitext(os.path.basename(args.json))[0] if args.json else "decode"
            lengths = [int(x) for x in args.sweep_lengths.split(",")]
            for dtype in dtypes:
                print(f"sweep {str(dtype)[6:]} (B=1 Hq=32 Hkv=8 D=128):")
                sweeps[str(dtype)[6:]] = sweep(dtype, rounds, probe, lengths, out_dir or ".", stem)
    tuned = tune_report() if DEVICE == "cpu" else []
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=platform.platform(), processor=platform.processor(), cpu=cpu_name(), device=DEVICE,
                           gpu=torch.cuda.get_device_name() if DEVICE == "cuda" else None, graph=GRAPH,
                           cuda_attention_kernel=cuda_attention_kernel() if DEVICE == "cuda" else None,
                           threads=torch.get_num_threads(), torch=torch.__version__, cpu_path=ab._C.cpu_isa(),
                           bf16_products=bf16_products() if DEVICE == "cpu" else None,
                           pages=huge_pages() if DEVICE == "cpu" else None, date=time.strftime("%Y-%m-%d"),
                           rounds=rounds, results=results, sweeps=sweeps, tuned=tuned),
                      f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
