"""Does memory a process allocated first read slower?  The same decode call over sets of cache copies allocated in turn.

Four sets ("A" first, then "B", "C", "D") of --copies dense caches each (B=8 Hq=32 Hkv=8 Sk=2048 D=128 bfloat16 by
default, 64 MiB a copy), identical in shape and layout, are allocated one after the other; then our decode kernel
(backend="paged_attention") is timed over each set, a different copy every call so that each call streams from
memory, the order of the sets turning each round.  Medians in ms.  On a KVM guest (2026-12-07, docs/benchmarks.md
"Allocation order") set A read 1.15-1.25x slower than the others, which is why bench_decode.py allocates every
candidate's copies in turn, copy by copy, rather than one candidate's after another's.

    python benchmarks/alloc_order.py [--rounds 10] [--copies 16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import attn_backends as ab


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--copies", type=int, default=16, help="copies per set (default: %(default)s)")
    ap.add_argument("--shape", default="8,32,8,2048,128", help="B,Hq,Hkv,Sk,D (default: %(default)s)")
    args = ap.parse_args()
    B, Hq, Hkv, Sk, D = (int(x) for x in args.shape.split(","))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, 1, Hq, D, generator=gen).bfloat16()
    seqlens = torch.full((B,), Sk, dtype=torch.int32)
    sets = {name: [tuple(torch.randn(B, Sk, Hkv, D, generator=gen).bfloat16() for _ in range(2))
                   for _ in range(args.copies)] for name in "ABCD"}

    def runner(copies):
        turn = [0]

        def call():
            turn[0] += 1
            k, v = copies[turn[0] % len(copies)]
            return ab.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, backend="paged_attention", strict=True)
        return call

    calls = {name: runner(copies) for name, copies in sets.items()}
    names = list(calls)
    times = {name: [] for name in names}
    reps = max(2, args.copies // 2)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            calls[name]()
            t0 = time.perf_counter()
            for _ in range(reps):
                calls[name]()
            times[name].append((time.perf_counter() - t0) / reps * 1e3)
    print(f"B={B} Hq={Hq} Hkv={Hkv} Sk={Sk} D={D} bfloat16, {args.copies} copies a set, {torch.get_num_threads()} "
          f"threads; median ms per call over {args.rounds} rounds, sets in the order allocated")
    print("  ".join(f"{name} {statistics.median(t):.3f}" for name, t in times.items()))


if __name__ == "__main__":
    main()
