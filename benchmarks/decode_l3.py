"""Our CPU decode kernel with its cache in the L3: one dense cache read by every call, one query token.

Prints GB/s of K and V and ns per key and KV head per thread. Meant for comparing two builds of the
kernel with the memory system out of the way: run it under each build in turn, alternating, several
times, and compare medians (a build cannot be swapped inside one process).

    python benchmarks/decode_l3.py bfloat16 --hkv 8 --sk 2048 --threads 1
"""
import argparse
import time

import torch

import attn_backends as ab


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dtype", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--sk", type=int, default=2048)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--calls", type=int, default=3000)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dt = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, args.hq, args.d, generator=gen).to(dt)
    k = torch.randn(1, args.sk, args.hkv, args.d, generator=gen).to(dt)
    v = torch.randn(1, args.sk, args.hkv, args.d, generator=gen).to(dt)
    lens = torch.full((1,), args.sk, dtype=torch.int32)

    def call():
        return ab.attention_with_kvcache(q, k, v, cache_seqlens=lens)

    for _ in range(max(args.calls // 10, 10)):
        call()
    t = time.perf_counter()
    for _ in range(args.calls):
        call()
    sec = (time.perf_counter() - t) / args.calls
    nbytes = 2 * k.numel() * k.element_size()
    threads = torch.get_num_threads()
    print(f"{args.dtype} Hq={args.hq} Hkv={args.hkv} Sk={args.sk} D={args.d} threads={threads}: "
          f"{sec * 1e6:.1f} us, {nbytes / sec / 1e9:.1f} GB/s, "
          f"{sec * 1e9 * threads / (args.sk * args.hkv):.2f} ns per key and KV head per thread")


if __name__ == "__main__":
    main()
