"""One-token decode by GQA group size: our kernel (attention_with_kvcache) against torch SDPA over contiguous
(B, H, S, D) copies (enable_gqa), the same cache every call (from the CPU's caches where it fits them),
for the group sizes models use (G = Hq / Hkv: 1 MHA, 2 Gemma, 3 SmolLM, 4 Llama 3, 6 and 7 Qwen2.5, 8).

Medians of interleaved rounds; "torch / ours" above 1 means ours is faster; "ns" is our time per key and
KV head per thread.  Meant for comparing two builds of the kernel too: run it under each in turn.

    python benchmarks/decode_groups.py --dtypes bfloat16,float32 --hkv 4 --keys 8192 \
        --json benchmarks/results/decode_groups.json
"""

import argparse
import json
import random
import statistics
import time

import torch
import torch.nn.functional as F

from bench_kv_prefill import header  # the machine line: versions, CPU, flags, threads, path

import attn_backends as ab


def run(G: int, hkv: int, keys: int, d: int, dtype, rounds: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    hq = hkv * G
    q = torch.randn(1, 1, hq, d, generator=gen).to(dtype)
    k, v = (torch.randn(1, keys, hkv, d, generator=gen).to(dtype) for _ in range(2))
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    fns = {"ours": lambda: ab.attention_with_kvcache(q, k, v),
           "torch": lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=G > 1)}
    per_round = max(3, int(4e7 / (keys * hq * d)))
    with torch.inference_mode():
        for f in fns.values():  # warm, past the kernel's first timing of its prefetch sets
            for _ in range(300):
                f()
        times = {name: [] for name in fns}
        for _ in range(rounds):
            for name in random.sample(list(fns), len(fns)):
                t0 = time.perf_counter()
                for _ in range(per_round):
                    fns[name]()
                times[name].append((time.perf_counter() - t0) / per_round)
    med = {name: statistics.median(t) for name, t in times.items()}
    return {"G": G, "Hq": hq, "Hkv": hkv, "keys": keys, "D": d, "dtype": str(dtype).replace("torch.", ""),
            "ours_us": med["ours"] * 1e6, "torch_us": med["torch"] * 1e6, "torch_over_ours": med["torch"] / med["ours"],
            "ns_per_key_head_thread": med["ours"] * 1e9 * torch.get_num_threads() / (keys * hkv)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--groups", default="1,2,3,4,5,6,7,8")
    ap.add_argument("--hkv", type=int, default=4)
    ap.add_argument("--keys", type=int, default=8192)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(header())
    print(f"{'dtype':9} {'G':>2} {'Hq/Hkv':>7} {'ours us':>9} {'torch us':>9} {'torch/ours':>10} {'ns':>6}")
    rows = []
    for dt in args.dtypes.split(","):
        for G in (int(g) for g in args.groups.split(",")):
            r = run(G, args.hkv, args.keys, args.d, getattr(torch, dt), args.rounds)
            rows.append(r)
            print(f"{dt:9} {G:>2} {r['Hq']:>3}/{r['Hkv']:<3} {r['ours_us']:9.1f} {r['torch_us']:9.1f} "
                  f"{r['torch_over_ours']:9.2f}x {r['ns_per_key_head_thread']:6.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"header": header(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "args": vars(args), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
