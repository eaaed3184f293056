"""One-token MHA decode from DRAM: the runs of keys, the chunks and torch SDPA over the same calls.

The kernel's one-token MHA rule (csrc/cpu/decode_cpu.c, mha_runs) sends a call to the runs of keys or to the chunks
by the call's own size; the runs are faster with the cache in the caches and slower from DRAM.  This times both
(ATTN_BACKENDS_DECODE_MHA_RUNS=1 and =0) and torch SDPA twice: over contiguous (B, H, S, D) copies, the layout it
likes best ("torch"), and over the transposed view of a (B, S, H, D) cache like the kernel's, the call a user
holding such a cache makes ("view").  Each candidate has its own --copies caches and reads a different one every
call, so that no call finds its cache in the CPU's caches (before 2026-12-07 16:40 UTC the runs and the chunks read
the same copy in a round, and the second of the two could find it in the L2 or the L3); the candidates are
shuffled call by call in one process, and the copies allocated in turn, copy by copy (memory a process allocated
first can read slower: benchmarks/alloc_order.py).  Medians in us and the ratios torch / runs, view / runs and
runs / chunks.  The line the rule draws was set from this (docs/benchmarks.md, "Reading the runs
key by key, and the runs' call limit at 2**21 elements").

    python benchmarks/mha_runs_dram.py [--shapes "1,32,256,128;1,12,1024,64"] [--dtypes bfloat16,float32]
        [--copies 150] [--calls 600] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch
import torch.nn.functional as F

import attn_backends as ab
from bench_decode import cpu_name, variable_restored

VAR = "ATTN_BACKENDS_DECODE_MHA_RUNS"


CANDIDATES = ("chunks", "runs", "torch", "view")


def time_shape(B, H, Sk, D, dtype, copies, calls, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 1, H, D, generator=gen).to(dtype)
    qc = q.transpose(1, 2).contiguous()
    pools = {name: [] for name in CANDIDATES}  # each candidate's own caches, (B, S, H, D) but torch's
    for _ in range(copies):  # in turn, candidate by candidate
        for name in CANDIDATES:
            k, v = (torch.randn(B, Sk, H, D, generator=gen).to(dtype) for _ in range(2))
            pools[name].append(tuple(t.transpose(1, 2).contiguous() for t in (k, v)) if name == "torch" else (k, v))
    seqlens = torch.full((B,), Sk, dtype=torch.int32)
    times = {name: [] for name in CANDIDATES}
    with variable_restored(VAR), torch.inference_mode():
        k0, v0 = pools["runs"][0]
        want = F.scaled_dot_product_attention(qc, k0.transpose(1, 2), v0.transpose(1, 2)).transpose(1, 2).float()
        for name, flag in (("runs", "1"), ("chunks", "0")):
            os.environ[VAR] = flag
            got = ab.attention_with_kvcache(q, k0, v0, cache_seqlens=seqlens).float()
            err = (got - want).abs().max().item()
            assert err < (1e-4 if dtype == torch.float32 else 2e-2), f"{name}: {err} from torch SDPA"
        for i in range(calls):
            names = list(CANDIDATES)
            random.shuffle(names)
            for name in names:
                k, v = pools[name][i % copies]
                if name in ("torch", "view"):
                    if name == "view":
                        k, v = k.transpose(1, 2), v.transpose(1, 2)
                    t0 = time.perf_counter()
                    F.scaled_dot_product_attention(qc, k, v)
                else:
                    os.environ[VAR] = "1" if name == "runs" else "0"
                    t0 = time.perf_counter()
                    ab.attention_with_kvcache(q, k, v, cache_seqlens=seqlens)
                times[name].append(time.perf_counter() - t0)
    return {n: statistics.median(t) * 1e6 for n, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1,32,256,128;1,12,1024,64;4,12,256,64", help="B,H,Sk,D;... (MHA)")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--copies", type=int, default=150, help="copies per candidate (default: %(default)s)")
    ap.add_argument("--calls", type=int, default=600, help="calls per candidate (default: %(default)s)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    machine = (f"attn_backends {ab.__version__}, torch {torch.__version__}, {cpu_name()}, "
               f"{torch.get_num_threads()} threads, CPU path {ab._C.cpu_isa()}")
    print(machine)
    print(f"{'B H Sk D':<16}  {'dtype':<8}  {'MiB':>4}  {'chunks':>8}  {'runs':>8}  {'torch':>8}  {'view':>8}  "
          "torch/runs  view/runs  runs/chunks")
    rows = []
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        for shape in args.shapes.split(";"):
            B, H, Sk, D = (int(x) for x in shape.split(","))
            mib = 2 * B * H * Sk * D * torch.finfo(dtype).bits // 8 / 2**20
            med = time_shape(B, H, Sk, D, dtype, args.copies, args.calls)
            print(f"{shape.replace(',', ' '):<16}  {str(dtype)[6:]:<8}  {mib:4.0f}  {med['chunks']:8.1f}  "
                  f"{med['runs']:8.1f}  {med['torch']:8.1f}  {med['view']:8.1f}  {med['torch'] / med['runs']:10.2f}  "
                  f"{med['view'] / med['runs']:9.2f}  "
                  f"{med['runs'] / med['chunks']:11.2f}", flush=True)
            rows.append(dict(B=B, H=H, Sk=Sk, D=D, dtype=str(dtype)[6:], mib=mib, copies=args.copies,
                             **{f"{n}_us": t for n, t in med.items()}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=machine, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           calls=args.calls, rows=rows), f, indent=1)
        print("wrote", args.json)


if __name__ == "__main__":
    main()
