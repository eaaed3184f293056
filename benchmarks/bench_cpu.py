"""CPU benchmark: our flash vs torch SDPA, interleaved in one run.

Forward and forward+backward, float32 and bfloat16, D in {64, 128}, causal and not, S in
{512, 1024, 2048, 4096} with B=4 H=16 (override with flags).  Each round times every candidate
once, in turn, so machine drift hits all of them alike; the table shows medians over rounds,
GFLOP/s (4 B H S^2 D forward, half with causal; backward 2.5x forward; `--passes bwd` times the
backward alone) and ratio = torch / ours (> 1: ours is faster).  A measurement of this CPU's FMA
peak (an AVX-512/AVX2 loop of independent FMAs on every thread), taken in every round beside the
two candidates, puts each row's GFLOP/s in proportion: "% peak" for ours and for torch, against
that row's median peak, so a drifting machine moves both sides of the fraction together.

    python benchmarks/bench_cpu.py --json benchmarks/results/cpu.json
    python benchmarks/bench_cpu.py --quick                         # S=2048 only, fewer rounds
    python benchmarks/bench_cpu.py --memory                        # forward peak memory at S=16384
    python benchmarks/bench_cpu.py --threads 1 --batch 1 --heads 4 --passes fwd   # one core
    python benchmarks/bench_cpu.py --sage --json benchmarks/results/cpu_sage.json
                                  # sage (INT8 Q.K^T) vs flash vs torch SDPA, forward, S=2048 D=128,
                                  # with sage's accuracy against the float64 reference
    python benchmarks/bench_cpu.py --ceiling --isa amx --json benchmarks/results/cpu_amx.json
                                  # bfloat16: torch SDPA, our flash and sage, and a bf16 matmul
                                  # (torch.matmul 4096^2, the matrix units' ceiling as torch reaches
                                  # it) timed in the same rounds; each kernel as a ratio to torch and
                                  # a % of that ceiling.  --isa picks our kernels' path (amx: AMX
                                  # tiles, where the CPU has them; docs/amx.md)

The header names the CPU, our kernels' path and the AMX state (`_C.cpu_features()["amx_state"]`).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import attn_backends as ab


def flops(B, H, S, D, causal, pas):
    f = 4.0 * B * H * S * S * D / (2 if causal else 1)
    return f * {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}[pas]


def fma_peak_gflops() -> float:
    """This CPU's float32 FMA peak: independent FMA chains on every thread torch uses, in C on the
    same ISA path as the kernels (ab_cpu_fma_peak); best of three."""
    return max(ab._C.fma_peak(0.3, torch.get_num_threads()) for _ in range(3)) / 1e9


def peak_sample() -> float:
    """One short FMA-peak sample (flop/s) on the threads torch uses, taken between timings."""
    return ab._C.fma_peak(0.05, torch.get_num_threads())


def qkv(B, H, S, D, dtype, bwd, layout="bhsd"):
    """Leaves and q, k, v (B, H, S, D): contiguous, or with layout "bshd" views of (B, S, H, D) leaves, as a
    model's projections hand them over (rows H * D elements apart); both sides get the same tensors."""
    shape = (B, S, H, D) if layout == "bshd" else (B, H, S, D)
    leaves = [torch.randn(shape, dtype=dtype, requires_grad=bwd) for _ in range(3)]
    return leaves, [t.transpose(1, 2) if layout == "bshd" else t for t in leaves]


def run_case(B, H, S, D, dtype, causal, pas, rounds, layout="bhsd"):
    """Medians (seconds) of ours and torch, and of the FMA peak (flop/s) sampled in the same rounds.
    pas: "fwd", "fwd+bwd", or "bwd" (the backward alone: gradients of one forward's output, kept)."""
    bwd = pas != "fwd"
    leaves, (q, k, v) = qkv(B, H, S, D, dtype, bwd, layout)
    g = torch.randn(B, H, S, D, dtype=dtype)
    kept = {}
    if pas == "bwd":
        kept["ours"] = ab.attention(q, k, v, causal=causal, backend="flash", strict=True)
        kept["torch"] = F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def ours():
        if pas == "bwd":
            torch.autograd.grad(kept["ours"], (q, k, v), g, retain_graph=True)
            return
        out = ab.attention(q, k, v, causal=causal, backend="flash", strict=True)
        if bwd:
            out.backward(g)

    def theirs():
        if pas == "bwd":
            torch.autograd.grad(kept["torch"], (q, k, v), g, retain_graph=True)
            return
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        if bwd:
            out.backward(g)

    fns = {"ours": ours, "torch": theirs}
    for fn in fns.values():  # warm-up
        fn()
    times = {name: [] for name in fns}
    peaks = []
    for _ in range(rounds):
        for name, fn in fns.items():
            if bwd:
                for t in leaves:
                    t.grad = None
            gc.collect()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        peaks.append(peak_sample())
    return {**{name: statistics.median(ts) for name, ts in times.items()}, "peak": statistics.median(peaks)}


def matmul_operands(n: int):
    """bfloat16 operands of the ceiling: torch.matmul (n x n) @ (n x n), on the matrix units where the
    CPU has them (oneDNN's AMX kernels on an AMX CPU)."""
    return torch.randn(n, n, dtype=torch.bfloat16), torch.randn(n, n, dtype=torch.bfloat16)


def matmul_sample(a, b) -> float:
    """One timing of the ceiling, in flop/s."""
    t0 = time.perf_counter()
    torch.matmul(a, b)
    return 2.0 * a.shape[0] * a.shape[1] * b.shape[1] / (time.perf_counter() - t0)


def run_ceiling_case(B, H, S, D, dtype, causal, pas, rounds, mm):
    """Medians (seconds) of torch SDPA, our flash and (forward only) sage, and of the bf16 matmul
    ceiling (flop/s), every one timed once per round, in turn."""
    bwd = pas != "fwd"
    q, k, v = (torch.randn(B, H, S, D, dtype=dtype, requires_grad=bwd) for _ in range(3))
    g = torch.randn(B, H, S, D, dtype=dtype)

    def call(fn):
        def run():
            if not bwd:
                with torch.inference_mode():
                    fn()
                return
            for t in (q, k, v):
                t.grad = None
            fn().backward(g)
        return run

    fns = {"torch": call(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)),
           "flash": call(lambda: ab.attention(q, k, v, causal=causal, backend="flash", strict=True))}
    if not bwd:
        fns["sage"] = call(lambda: ab.attention(q, k, v, causal=causal, backend="sage", strict=True))
    for fn in fns.values():  # warm-up
        fn()
    matmul_sample(*mm)
    times = {name: [] for name in fns}
    ceil = []
    for _ in range(rounds):
        for name, fn in fns.items():
            gc.collect()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        ceil.append(matmul_sample(*mm))
    return {**{name: statistics.median(ts) for name, ts in times.items()}, "ceiling": statistics.median(ceil)}


def ceiling_main(args):
    mm = matmul_operands(args.ceiling_n)
    print(f"ceiling: torch.matmul bfloat16 {args.ceiling_n}^2, timed in every round")
    print(f"{'pass':<9}{'dtype':<9}{'D':>4}{'S':>6} {'causal':<7}{'torch ms':>9}{'flash ms':>9}{'sage ms':>9}"
          f"{'ceil GF/s':>10}{'torch %':>8}{'flash %':>8}{'sage %':>8}{'flash x':>8}{'sage x':>8}")
    rows = []
    for pas in args.passes.split(","):
        for dt_name in args.dtypes.split(","):
            dtype = getattr(torch, dt_name)
            for D in (int(x) for x in args.dims.split(",")):
                for S in (int(x) for x in args.seqlens.split(",")):
                    for causal in (False, True):
                        t = run_ceiling_case(args.batch, args.heads, S, D, dtype, causal, pas, args.rounds, mm)
                        fl = flops(args.batch, args.heads, S, D, causal, pas)
                        row = dict(pass_=pas, dtype=dt_name, D=D, S=S, causal=causal,
                                   ceiling_gflops=t["ceiling"] / 1e9)
                        for name in ("torch", "flash", "sage"):
                            if name in t:
                                row[f"{name}_ms"] = t[name] * 1e3
                                row[f"{name}_gflops"] = fl / t[name] / 1e9
                                row[f"{name}_pct_ceiling"] = 100 * fl / t[name] / t["ceiling"]
                                row[f"{name}_speedup"] = t["torch"] / t[name]  # > 1: faster than torch
                        rows.append(row)
                        cell = lambda key, fmt: format(row[key], fmt) if key in row else "-"  # noqa: E731
                        print(f"{pas:<9}{dt_name:<9}{D:>4}{S:>6} {str(causal):<7}{row['torch_ms']:>9.1f}"
                              f"{row['flash_ms']:>9.1f}{cell('sage_ms', '.1f'):>9}{row['ceiling_gflops']:>10.0f}"
                              f"{row['torch_pct_ceiling']:>7.0f}%{row['flash_pct_ceiling']:>7.0f}%"
                              f"{cell('sage_pct_ceiling', '.0f') + '%' if 'sage_ms' in row else '-':>8}"
                              f"{row['flash_speedup']:>8.2f}{cell('sage_speedup', '.2f'):>8}", flush=True)
    print("%: of the matmul ceiling; x: torch ms / kernel ms (> 1: faster than torch SDPA)")
    return rows


def run_sage_case(B, H, S, D, dtype, causal, rounds):
    """Forward medians of sage, flash and torch SDPA on the same inputs, interleaved round by round."""
    q, k, v = (torch.randn(B, H, S, D, dtype=dtype) for _ in range(3))
    fns = {"sage": lambda: ab.attention(q, k, v, causal=causal, backend="sage", strict=True),
           "flash": lambda: ab.attention(q, k, v, causal=causal, backend="flash", strict=True),
           "torch": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)}
    with torch.inference_mode():
        for fn in fns.values():  # warm-up
            fn()
        times = {name: [] for name in fns}
        for _ in range(rounds):
            for name, fn in fns.items():
                gc.collect()
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def sage_accuracy(S, D, dtype, causal, outlier=False):
    """Cosine similarity and relative L1 of sage's output against the float64 reference, on one
    (batch, 2 heads) slice of the benchmark shape; outlier adds +20 to 3 channels of K."""
    from attn_backends._testing import reference_attention

    q, k, v = (torch.randn(1, 2, S, D).to(dtype) for _ in range(3))
    if outlier:
        k[..., :3] += 20
    out = ab.attention(q, k, v, causal=causal, backend="sage", strict=True).double().flatten()
    ref = reference_attention(q, k, v, causal=causal)[0].flatten()
    cos = float(F.cosine_similarity(out, ref, dim=0))
    return cos, float((out - ref).abs().sum() / ref.abs().sum())


def sage_main(args, peak):
    print(f"{'dtype':<9}{'D':>4}{'S':>6} {'causal':<7}{'sage ms':>9}{'flash ms':>10}{'torch ms':>10}"
          f"{'sage GF/s':>11}{'flash/sage':>12}{'torch/sage':>12}{'cos':>9}{'rel L1':>8}{'cos*':>9}{'rel L1*':>9}")
    rows = []
    for dt_name in args.dtypes.split(","):
        dtype = getattr(torch, dt_name)
        for D in (int(x) for x in args.dims.split(",")):
            for S in (int(x) for x in args.seqlens.split(",")):
                for causal in (False, True):
                    t = run_sage_case(args.batch, args.heads, S, D, dtype, causal, args.rounds)
                    cos, l1 = sage_accuracy(S, D, dtype, causal)
                    cos_o, l1_o = sage_accuracy(S, D, dtype, causal, outlier=True)
                    fl = flops(args.batch, args.heads, S, D, causal, "fwd")
                    row = dict(dtype=dt_name, D=D, S=S, causal=causal, sage_ms=t["sage"] * 1e3,
                               flash_ms=t["flash"] * 1e3, torch_ms=t["torch"] * 1e3,
                               sage_gflops=fl / t["sage"] / 1e9, flash_over_sage=t["flash"] / t["sage"],
                               torch_over_sage=t["torch"] / t["sage"], cos=cos, rel_l1=l1, cos_outlier=cos_o,
                               rel_l1_outlier=l1_o)
                    rows.append(row)
                    print(f"{dt_name:<9}{D:>4}{S:>6} {str(causal):<7}{row['sage_ms']:>9.1f}{row['flash_ms']:>10.1f}"
                          f"{row['torch_ms']:>10.1f}{row['sage_gflops']:>11.1f}{row['flash_over_sage']:>12.2f}"
                          f"{row['torch_over_sage']:>12.2f}{cos:>9.5f}{l1:>8.4f}{cos_o:>9.5f}{l1_o:>9.4f}", flush=True)
    print("cos*, rel L1*: with +20 on 3 channels of K")
    return rows


def peak_memory_forward(S=16384, D=128, H=1, dtype=torch.float32):
    """How much one flash forward at length S raises resident memory beyond its inputs and outputs:
    in a fresh process, the high-water mark is reset just before the call (/proc/self/clear_refs)
    and compared with the resident size before it."""
    import subprocess

    code = f"""
import torch, attn_backends as ab
def status(key):
    for line in open('/proc/self/status'):
        if line.startswith(key):
            return int(line.split()[1])  # kB
q, k, v = (torch.randn(1, {H}, {S}, {D}, dtype={dtype}) for _ in range(3))
ab.attention(q[:, :, :64], k[:, :, :64], v[:, :, :64], backend="flash")  # load everything once
before = status('VmRSS:')
open('/proc/self/clear_refs', 'w').write('5')  # reset VmHWM to the current RSS
out = ab.attention(q, k, v, backend="flash", strict=True)
print(before, status('VmHWM:'))
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, peak = (int(x) for x in res.stdout.split())
    elem = torch.finfo(dtype).bits // 8
    inputs = 3 * H * S * D * elem
    outputs = H * S * D * elem + H * S * 4  # out and lse
    return dict(S=S, D=D, H=H, dtype=str(dtype).replace("torch.", ""), inputs_mib=inputs / 2**20,
                outputs_mib=outputs / 2**20, call_peak_mib=(peak - before) / 1024,
                extra_mib=(peak - before) / 1024 - outputs / 2**20)


def main(argv=None):
    ap = argparse.ArgumentParser(description="CPU flash vs torch SDPA")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seqlens", default="512,1024,2048,4096")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--passes", default="fwd,fwd+bwd", help="comma-separated: fwd, fwd+bwd, bwd (backward alone)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--quick", action="store_true", help="S=2048 only, 3 rounds")
    ap.add_argument("--memory", action="store_true", help="also measure forward peak memory at S=16384")
    ap.add_argument("--sage", action="store_true",
                    help="sage vs flash vs torch, forward only (defaults: S=2048, D=128, 5 rounds)")
    ap.add_argument("--ceiling", action="store_true",
                    help="torch SDPA, flash, sage and the bf16 matmul ceiling in the same rounds (defaults: "
                         "bfloat16, fwd, S=512,2048)")
    ap.add_argument("--ceiling-n", type=int, default=4096, help="matmul ceiling size n (n x n @ n x n)")
    ap.add_argument("--isa", default=None,
                    help="our kernels' CPU path: generic, avx2, avx512, amx (AMX tiles), amx_emu (emulated tiles)")
    ap.add_argument("--layout", default="bhsd", choices=["bhsd", "bshd"],
                    help="bshd: q, k, v as (B, H, S, D) views of (B, S, H, D) tensors (default: contiguous)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", default=None, metavar="JSON", help="print a results JSON as a markdown table")
    args = ap.parse_args(argv)
    if args.markdown:
        print(markdown(args.markdown))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.seqlens, args.rounds = "2048", 3
    if args.sage and "--seqlens" not in " ".join(sys.argv):
        args.seqlens = "2048"
    if args.sage and "--dims" not in " ".join(sys.argv):
        args.dims = "128"
    given = " ".join(sys.argv if argv is None else argv)
    if args.ceiling:
        if "--dtypes" not in given:
            args.dtypes = "bfloat16"
        if "--passes" not in given:
            args.passes = "fwd"
        if "--seqlens" not in given and not args.quick:
            args.seqlens = "512,2048"
    if args.isa and not ab._C.set_cpu_isa(args.isa):
        raise SystemExit(f"--isa {args.isa}: this CPU or build cannot run that path (AMX: "
                         f"{ab._C.cpu_features()['amx_state']})")
    peak = fma_peak_gflops()
    features = ab._C.cpu_features()
    print(f"{features['brand'].strip() or platform.processor() or platform.machine()}, {torch.get_num_threads()} "
          f"threads, torch {torch.__version__}, attn_backends {ab.__version__} ({ab._C.cpu_isa()} path, sage "
          f"{ab._C.sage_cpu_isa()}); AMX {features['amx_state']}; FMA peak {peak:.0f} GFLOP/s")
    if args.ceiling:
        rows = ceiling_main(args)
        if args.json:
            write_json(args.json, "cpu_ceiling", peak, [{("pass" if k == "pass_" else k): v for k, v in r.items()}
                                                        for r in rows],
                       sage_isa=ab._C.sage_cpu_isa(), ceiling_n=args.ceiling_n)
        return
    if args.sage:
        rows = sage_main(args, peak)
        if args.json:
            write_json(args.json, "cpu_sage", peak, rows, sage_isa=ab._C.sage_cpu_isa())
        return
    head = f"{'pass':<9}{'dtype':<9}{'D':>4}{'S':>6} {'causal':<7}{'ours ms':>9}{'torch ms':>10}{'ours GF/s':>11}" \
           f"{'torch GF/s':>11}{'% peak':>8}{'torch %':>8}{'ratio':>7}"
    print(head)
    rows = []
    for pas in args.passes.split(","):
        for dt_name in args.dtypes.split(","):
            dtype = getattr(torch, dt_name)
            for D in (int(x) for x in args.dims.split(",")):
                for S in (int(x) for x in args.seqlens.split(",")):
                    for causal in (False, True):
                        t = run_case(args.batch, args.heads, S, D, dtype, causal, pas, args.rounds, args.layout)
                        fl = flops(args.batch, args.heads, S, D, causal, pas)
                        row = dict(pass_=pas, dtype=dt_name, D=D, S=S, causal=causal, ours_ms=t["ours"] * 1e3,
                                   torch_ms=t["torch"] * 1e3, ours_gflops=fl / t["ours"] / 1e9,
                                   torch_gflops=fl / t["torch"] / 1e9, ratio=t["torch"] / t["ours"])
                        row["peak_gflops"] = t["peak"] / 1e9
                        row["pct_peak"] = 100 * row["ours_gflops"] / row["peak_gflops"]
                        row["torch_pct_peak"] = 100 * row["torch_gflops"] / row["peak_gflops"]
                        rows.append(row)
                        print(f"{pas:<9}{dt_name:<9}{D:>4}{S:>6} {str(causal):<7}{row['ours_ms']:>9.1f}"
                              f"{row['torch_ms']:>10.1f}{row['ours_gflops']:>11.1f}{row['torch_gflops']:>11.1f}"
                              f"{row['pct_peak']:>7.0f}%{row['torch_pct_peak']:>7.0f}%{row['ratio']:>7.2f}", flush=True)
    mem = None
    if args.memory:
        mem = peak_memory_forward()
        print(f"forward at S={mem['S']} D={mem['D']} H={mem['H']} {mem['dtype']}: inputs {mem['inputs_mib']:.1f} MiB, "
              f"outputs {mem['outputs_mib']:.1f} MiB; the call raised peak resident memory by "
              f"{mem['call_peak_mib']:.1f} MiB, {mem['extra_mib']:.1f} MiB beyond its outputs")
    if args.json:
        write_json(args.json, "cpu", peak, [{("pass" if k == "pass_" else k): v for k, v in r.items()} for r in rows],
                   memory=mem, layout=args.layout)


def write_json(path: str, benchmark: str, peak: float, results: list, **extra) -> None:
    """The results with what produced them: date, command, CPU, kernel path, threads, torch, FMA peak."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(dict(benchmark=benchmark, date=time.strftime("%Y-%m-%d"),
                       command=" ".join([os.path.basename(sys.executable)] + sys.argv),
                       cpu=ab._C.cpu_features()["brand"].strip(), isa=ab._C.cpu_isa(),
                       amx_state=ab._C.cpu_features()["amx_state"], **extra,
                       threads=torch.get_num_threads(), torch=torch.__version__, fma_peak_gflops=peak,
                       results=results), f, indent=2)


def markdown(path: str) -> str:
    """The results JSON of a run as a markdown table (docs/benchmarks.md embeds it)."""
    with open(path) as f:
        d = json.load(f)
    if d["benchmark"] == "cpu_sage":
        return sage_markdown(d)
    if d["benchmark"] == "cpu_ceiling":
        return ceiling_markdown(d)
    lines = [f"`{d['command']}` on {d['cpu']} ({d['threads']} threads, {d['isa']} path), torch {d['torch']}, "
             f"{d['date']}; FMA peak {d['fma_peak_gflops']:.0f} GFLOP/s.", "",
             "| pass | dtype | D | S | causal | ours ms | torch ms | ours GFLOP/s | torch GFLOP/s | % peak | torch % peak "
             "| torch / ours |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in d["results"]:
        # older runs measured the peak once per run, not per row
        torch_pct = f"{r['torch_pct_peak']:.0f}%" if "torch_pct_peak" in r else \
            f"{100 * r['torch_gflops'] / d['fma_peak_gflops']:.0f}%"
        lines.append(f"| {r['pass']} | {r['dtype']} | {r['D']} | {r['S']} | {'yes' if r['causal'] else 'no'} | "
                     f"{r['ours_ms']:.1f} | {r['torch_ms']:.1f} | {r['ours_gflops']:.0f} | {r['torch_gflops']:.0f} | "
                     f"{r['pct_peak']:.0f}% | {torch_pct} | {r['ratio']:.2f} |")
    return "\n".join(lines)


def ceiling_markdown(d) -> str:
    lines = [f"`{d['command']}` on {d['cpu']} ({d['threads']} threads, {d['isa']} path, sage {d['sage_isa']}; "
             f"AMX {d['amx_state']}), torch {d['torch']}, {d['date']}; ceiling: torch.matmul bfloat16 "
             f"{d['ceiling_n']}^2 in every round.", "",
             "| pass | dtype | D | S | causal | torch ms | flash ms | sage ms | ceiling GFLOP/s | torch % | flash % "
             "| sage % | flash / torch speed | sage / torch speed |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in d["results"]:
        sage = r.get("sage_ms")
        lines.append(f"| {r['pass']} | {r['dtype']} | {r['D']} | {r['S']} | {'yes' if r['causal'] else 'no'} | "
                     f"{r['torch_ms']:.1f} | {r['flash_ms']:.1f} | {'-' if sage is None else f'{sage:.1f}'} | "
                     f"{r['ceiling_gflops']:.0f} | {r['torch_pct_ceiling']:.0f}% | {r['flash_pct_ceiling']:.0f}% | "
                     f"{'-' if sage is None else format(r['sage_pct_ceiling'], '.0f') + '%'} | "
                     f"{r['flash_speedup']:.2f} | {'-' if sage is None else format(r['sage_speedup'], '.2f')} |")
    return "\n".join(lines)


def sage_markdown(d) -> str:
    lines = [f"`{d['command']}` on {d['cpu']} ({d['threads']} threads, {d['isa']} path, sage {d['sage_isa']}), "
             f"torch {d['torch']}, {d['date']}; FMA peak {d['fma_peak_gflops']:.0f} GFLOP/s.", "",
             "| dtype | D | S | causal | sage ms | flash ms | torch ms | sage GFLOP/s | flash / sage | torch / sage "
             "| cos | rel L1 | cos (K outliers) | rel L1 (K outliers) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in d["results"]:
        lines.append(f"| {r['dtype']} | {r['D']} | {r['S']} | {'yes' if r['causal'] else 'no'} | {r['sage_ms']:.1f} | "
                     f"{r['flash_ms']:.1f} | {r['torch_ms']:.1f} | {r['sage_gflops']:.0f} | "
                     f"**{r['flash_over_sage']:.2f}** | {r['torch_over_sage']:.2f} | {r['cos']:.5f} | "
                     f"{r['rel_l1']:.4f} | {r['cos_outlier']:.5f} | {r['rel_l1_outlier']:.4f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
