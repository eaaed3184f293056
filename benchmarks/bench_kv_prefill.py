"""Chunked prefill against a KV cache on the CPU: the decode kernel's products against torch SDPA, side by side.

For B=1, D=128 and a dense cache filled to --keys positions, each shape "Hq,Hkv,tokens" (tokens new query tokens at
the cache's end, causal bottom-right) is timed, in interleaved rounds (each round times every candidate once; the
median per candidate is reported, in ms):

  - tiles: the decode kernel (backend="paged_attention") with ATTN_BACKENDS_DECODE_AMX_ROWS=1, both products of
    every tile on AMX tiles where the CPU path has them (docs/decode.md, "Tiles of many rows");
  - vector: the same call with ATTN_BACKENDS_DECODE_AMX_ROWS=0 (the kernel's vector products);
  - view: torch SDPA over the cache's own (B, S, H, D) memory seen as (B, H, S, D), with the causal mask;
  - contig: torch SDPA over contiguous (B, H, S, D) copies (its best layout; the copies are made once).

    python benchmarks/bench_kv_prefill.py --json benchmarks/results/kv_prefill.json
    python benchmarks/bench_kv_prefill.py --keys 2048 --shapes "32,8,2048;32,32,2048"
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

import attn_backends as ab
from attn_backends import _C

SHAPES = "32,8,16;32,8,32;32,8,48;32,8,64;32,8,128;32,8,256;32,4,32;32,4,64;32,2,32;32,2,64;32,2,128;" \
         "32,32,32;32,32,128;32,32,256"
D = 128
SWITCH = "ATTN_BACKENDS_DECODE_AMX_ROWS"


def header() -> str:
    f = _C.cpu_features()
    flags = " ".join(k for k, v in f.items() if v is True)
    return (f"attn_backends {ab.__version__}, torch {torch.__version__}, {f.get('brand')} (family {f.get('family')} "
            f"model {f.get('model')}), {flags}, {torch.get_num_threads()} threads, CPU path {_C.cpu_isa()}, "
            f"{platform.machine()}")


def run_shape(Hq: int, Hkv: int, tokens: int, keys: int, dtype, rounds: int) -> dict:
    q = torch.randn(1, tokens, Hq, D).to(dtype)
    k = torch.randn(1, keys, Hkv, D).to(dtype)
    v = torch.randn(1, keys, Hkv, D).to(dtype)
    visible = torch.arange(keys).view(1, -1) <= torch.arange(tokens).view(-1, 1) + keys - tokens
    qv, kv, vv = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    qc, kc, vc = qv.contiguous(), kv.contiguous(), vv.contiguous()

    def kernel(on):
        def call():
            os.environ[SWITCH] = on
            return ab.attention_with_kvcache(q, k, v, cache_seqlens=keys, causal=True, backend="paged_attention")
        return call

    fns = {"tiles": kernel("1"), "vector": kernel("0"),
           "view": lambda: F.scaled_dot_product_attention(qv, kv, vv, attn_mask=visible, enable_gqa=True),
           "contig": lambda: F.scaled_dot_product_attention(qc, kc, vc, attn_mask=visible, enable_gqa=True)}
    before = os.environ.get(SWITCH)
    try:
        with torch.no_grad():
            ref = fns["contig"]().transpose(1, 2).double()
            err = {n: (f().double() - ref).abs().max().item() for n, f in fns.items() if n in ("tiles", "vector")}
            times = {n: [] for n in fns}
            for _ in range(rounds):
                for n, f in fns.items():
                    t0 = time.perf_counter()
                    f()
                    times[n].append((time.perf_counter() - t0) * 1e3)
    finally:
        if before is None:
            os.environ.pop(SWITCH, None)
        else:
            os.environ[SWITCH] = before
    ms = {n: statistics.median(t) for n, t in times.items()}
    return {"Hq": Hq, "Hkv": Hkv, "tokens": tokens, "rows": tokens * Hq // Hkv, "keys": keys, "ms": ms,
            "maxerr_vs_torch": err}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=SHAPES, help='"Hq,Hkv,tokens;..." (default: %(default)s)')
    ap.add_argument("--keys", type=int, default=4096, help="positions in the cache (default: %(default)s)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    print(header())
    print(f"B=1 D={D} {args.dtype}, {args.keys} keys (dense), causal bottom-right; median ms of {args.rounds} "
          "interleaved rounds; x = torch's time / the kernel's with tiles")
    print("Hq/Hkv  tokens  rows |   tiles  vector    view  contig | view x  contig x")
    rows = []
    for spec in args.shapes.split(";"):
        Hq, Hkv, tokens = (int(x) for x in spec.split(","))
        r = run_shape(Hq, Hkv, tokens, args.keys, dtype, args.rounds)
        m = r["ms"]
        print(f"{Hq}/{Hkv:<5} {tokens:6d} {r['rows']:5d} | {m['tiles']:7.2f} {m['vector']:7.2f} {m['view']:7.2f} "
              f"{m['contig']:7.2f} | {m['view'] / m['tiles']:5.2f}x {m['contig'] / m['tiles']:6.2f}x", flush=True)
        rows.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header(), "dtype": args.dtype, "rounds": args.rounds,
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}, f, indent=1)
        print("wrote", args.json)


if __name__ == "__main__":
    main()
