"""Short queries through the plain APIs: ab.attention and flash_attn_varlen_func with a few query tokens
per sequence against a longer key range (decode through HF's "attn_backends" name, a patched SDPA or
transformers' flash path), which the CPU flash forward hands to the decode kernel
(csrc/cpu/flash_cpu.c, "short queries").

Per row, interleaved rounds of: "route" (as shipped), "python" (the same with the fast paths in C off:
_C.attention for ab.attention, _C.attention_varlen for flash_attn_varlen_func, which tries it itself
and again through ab.attention_varlen; what a call costs on the Python path), "flash" (ATTN_BACKENDS_FLASH_DECODE=0: the flash kernel, as before the route) and
torch SDPA on the same dense tensors (enable_gqa; bottom-right
causal as a bool mask when Sq > 1).  Packed rows time flash_attn_varlen_func on B sequences of Sq
queries and Sk keys each, and torch on the dense equivalent.  "ab.attention + mask" rows pass the
4-D bool mask HF's sdpa attention builds for a padded batch, (B, 1, Sq, Sk) with the bottom-right
causal triangle and the last batch row's first Sk / 4 keys hidden (left padding), and torch gets the
same mask.  Medians; "torch / route" above 1 means ours is faster.  CPU only.

    python benchmarks/bench_short_queries.py --json benchmarks/results/short_queries.json
    python benchmarks/bench_short_queries.py --calls "ab.attention + mask"
"""

import argparse
import json
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils import benchmark

import attn_backends as ab
from attn_backends import flash_attn as fa

SHAPES = [  # B, Hq, Hkv, Sk, D
    (8, 8, 2, 64, 64),
    (1, 32, 8, 1024, 128),
    (4, 32, 8, 4096, 128),
    (2, 16, 16, 512, 64),
]


CALLS = ("ab.attention", "flash_attn_varlen_func", "ab.attention + mask")


class python_path:
    """The fast paths in C switched off (each returns None: the Python path serves the call)."""

    def __enter__(self):
        # flash_attn_varlen_func tries its own, then ab.attention_varlen's: both off
        self.saved = ab._fast_attention, ab._fast_attention_varlen, fa._fast_varlen
        ab._fast_attention = ab._fast_attention_varlen = fa._fast_varlen = lambda *args: None

    def __exit__(self, *exc):
        ab._fast_attention, ab._fast_attention_varlen, fa._fast_varlen = self.saved


def timeit(fn):
    t = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return t.blocked_autorange(min_run_time=0.2).median * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="1,2,4,8")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", default=",".join(CALLS), help="which of: " + ", ".join(CALLS))
    p.add_argument("--json")
    args = p.parse_args()
    wanted = args.calls.split(",")
    if set(wanted) - set(CALLS):
        p.error(f"--calls takes {', '.join(CALLS)}")
    cpu = ab._C.cpu_features()["brand"].strip() or platform.processor() or platform.machine()
    print(f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}, isa {ab._C.cpu_isa()}")
    print("| call | dtype | B Hq/Hkv Sk D | Sq | route ms | python ms | flash ms | torch ms | python / route | "
          "flash / route | **torch / route** |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    g = torch.Generator().manual_seed(0)
    for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
        for B, Hq, Hkv, Sk, D in SHAPES:
            for Sq in (int(t) for t in args.tokens.split(",")):
                q = torch.randn(B, Sq, Hq, D, generator=g).to(dtype)
                k = torch.randn(B, Sk, Hkv, D, generator=g).to(dtype)
                v = torch.randn(B, Sk, Hkv, D, generator=g).to(dtype)
                qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # flash-attn's layout, seen as (B, H, S, D)
                mask = None if Sq == 1 else torch.ones(Sq, Sk, dtype=torch.bool).tril(Sk - Sq)
                padded = torch.ones(B, 1, Sq, Sk, dtype=torch.bool).tril(Sk - Sq)  # HF's mask of a padded batch
                padded[-1, :, :, : Sk // 4] = False
                kc, vc = kt.contiguous(), vt.contiguous()  # torch's best layout
                cu_q = torch.arange(B + 1, dtype=torch.int32) * Sq
                cu_k = torch.arange(B + 1, dtype=torch.int32) * Sk
                qp, kp, vp = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
                torch_call = lambda: F.scaled_dot_product_attention(qt, kc, vc, attn_mask=mask, enable_gqa=True)
                calls = {  # ours, torch's
                    "ab.attention": (lambda: ab.attention(qt, kt, vt, causal="bottom_right"), torch_call),
                    "flash_attn_varlen_func": (lambda: fa.flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, Sq, Sk,
                                                                                causal=True), torch_call),
                    "ab.attention + mask": (lambda: ab.attention(qt, kt, vt, attn_mask=padded),
                                            lambda: F.scaled_dot_product_attention(qt, kc, vc, attn_mask=padded,
                                                                                   enable_gqa=True)),
                }
                for name, (fn, torch_fn) in calls.items():
                    if name not in wanted:
                        continue
                    with torch.no_grad():
                        res = {"route": [], "python": [], "flash": [], "torch": []}
                        for _ in range(args.rounds):
                            os.environ.pop("ATTN_BACKENDS_FLASH_DECODE", None)
                            res["route"].append(timeit(fn))
                            with python_path():
                                res["python"].append(timeit(fn))
                            os.environ["ATTN_BACKENDS_FLASH_DECODE"] = "0"
                            res["flash"].append(timeit(fn))
                            os.environ.pop("ATTN_BACKENDS_FLASH_DECODE", None)
                            res["torch"].append(timeit(torch_fn))
                    m = {key: statistics.median(val) for key, val in res.items()}
                    rows.append(dict(call=name, dtype=str(dtype)[6:], B=B, Hq=Hq, Hkv=Hkv, Sk=Sk, D=D, Sq=Sq, **m))
                    print(f"| {name} | {str(dtype)[6:]} | {B} {Hq}/{Hkv} {Sk} {D} | {Sq} | {m['route']:.3f} | "
                          f"{m['python']:.3f} | {m['flash']:.3f} | {m['torch']:.3f} | "
                          f"{m['python'] / m['route']:.2f} | {m['flash'] / m['route']:.2f} | "
                          f"**{m['torch'] / m['route']:.2f}** |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu, "threads": torch.get_num_threads(), "torch": torch.__version__,
                       "isa": ab._C.cpu_isa(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
