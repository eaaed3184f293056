"""The routes a KV-cache call can take, side by side, call by call: which one `auto` should pick where.

For one decode token (B, Hq, Hkv, Sk as bench_decode.py's shapes, D=128) against a full cache:

  - torch:  torch SDPA on contiguous (B, H, S, D) caches (the dense equivalent, no KV-cache API);
  - kern_t: the decode kernel (paged_attention), a tensor cache_seqlens, a dense cache;
  - sdpa_t: what torch SDPA needs for the same call (backend="sdpa" served it so until 2026-11-27; it
    now reads a cache only in place): the lengths on the host (a synchronisation on a GPU) and a bool
    mask over the cache's view;
  - kern_p / sdpa_p: the same over pages of 16 positions under a shuffled block_table (torch's gathers
    the pages into a dense copy first);
  - auto_i: auto with an int cache_seqlens on a dense cache (on CUDA in 16-bit types: torch SDPA over
    the cache's view, csrc/ab_planner.c torch_first_kv; elsewhere the kernel).

Times are medians over rounds of the mean of `--calls` calls (CUDA events on a GPU, the host clock
on a CPU), so they include each route's host work: Python, planning, launches.  maxerr is each
route's largest difference from torch's output.

    python benchmarks/bench_kv_routes.py --device cuda --json benchmarks/results/gpu/kv_routes.json
    python benchmarks/bench_kv_routes.py --shapes 1,32,8,2048 --dtypes float32   # on the CPU
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

import attn_backends as ab

SHAPES = ((1, 32, 8, 16384), (8, 32, 8, 2048), (4, 32, 32, 2048))
D = 128


def timer(device, fn, calls, rounds):
    for _ in range(5):
        fn()
    times = []
    for _ in range(rounds):
        if device == "cuda":
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(calls):
                fn()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) / 1e3 / calls)
        else:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def routes(B, Hq, Hkv, Sk, dtype, device, gen):
    q = torch.randn(B, 1, Hq, D, generator=gen).to(device, dtype)
    k = torch.randn(B, Sk, Hkv, D, generator=gen).to(device, dtype)
    v = torch.randn(B, Sk, Hkv, D, generator=gen).to(device, dtype)
    seq = torch.full((B,), Sk, dtype=torch.int32, device=device)
    bs, nb = 16, Sk // 16
    perm = torch.randperm(B * nb, generator=gen).to(device)
    table = perm.view(B, nb).to(torch.int32)
    kp, vp = torch.empty(B * nb, bs, Hkv, D, device=device, dtype=dtype), torch.empty(B * nb, bs, Hkv, D,
                                                                                     device=device, dtype=dtype)
    kp[perm], vp[perm] = k.reshape(B * nb, bs, Hkv, D), v.reshape(B * nb, bs, Hkv, D)
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    kv = ab.attention_with_kvcache

    def torch_masked(kc, vc, tab):
        """torch SDPA over a view (or, paged, a gathered copy) of the cache, the lengths as a bool mask."""
        lengths = seq.tolist()  # on the host: a synchronisation on a GPU
        if tab is not None:
            kc, vc = (c[tab.long()].reshape(B, -1, Hkv, D) for c in (kc, vc))
        S = max(lengths)
        mask = (torch.arange(S, device=device)[None] < torch.tensor(lengths, device=device)[:, None])[:, None, None]
        return F.scaled_dot_product_attention(q.transpose(1, 2), kc[:, :S].transpose(1, 2), vc[:, :S].transpose(1, 2),
                                              attn_mask=mask, enable_gqa=Hq != Hkv).transpose(1, 2)

    return {
        "torch": lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=Hq != Hkv).transpose(1, 2),
        "kern_t": lambda: kv(q, k, v, cache_seqlens=seq, backend="paged_attention", strict=True),
        "sdpa_t": lambda: torch_masked(k, v, None),
        "kern_p": lambda: kv(q, kp, vp, cache_seqlens=seq, block_table=table, backend="paged_attention", strict=True),
        "sdpa_p": lambda: torch_masked(kp, vp, table),
        "auto_i": lambda: kv(q, k, v, cache_seqlens=Sk),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--shapes", default=None, help="B,Hq,Hkv,Sk;... (default: bench_decode.py's three)")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    shapes = SHAPES if not args.shapes else [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")]
    where = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
    print(f"attn_backends {ab.__version__}, torch {torch.__version__}, {where}; us per call (medians), call by call")
    gen = torch.Generator().manual_seed(0)
    rows = []
    with torch.inference_mode():
        for name in args.dtypes.split(","):
            dtype = getattr(torch, name)
            for B, Hq, Hkv, Sk in shapes:
                cands = routes(B, Hq, Hkv, Sk, dtype, args.device, gen)
                ref = cands["torch"]().float()
                err = {n: (f().float() - ref).abs().max().item() for n, f in cands.items() if n != "torch"}
                t = {n: timer(args.device, f, args.calls, args.rounds) for n, f in cands.items()}
                print(f"{name:8} B{B} {Hq}/{Hkv} Sk{Sk}: " + "  ".join(f"{n} {t[n] * 1e6:7.1f}" for n in cands)
                      + "  maxerr " + " ".join(f"{err[n]:.0e}" for n in err), flush=True)
                rows.append(dict(dtype=name, B=B, Hq=Hq, Hkv=Hkv, Sk=Sk, D=D, **{f"{n}_us": t[n] * 1e6 for n in t},
                                 **{f"{n}_maxerr": err[n] for n in err}))
                del cands
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=args.device, where=where, torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
                           calls=args.calls, rounds=args.rounds, rows=rows), f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
