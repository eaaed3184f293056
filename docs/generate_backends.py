"""Writes docs/backends.md from the C registry and this machine's report.

    python docs/generate_backends.py

The names table and the support matrix come from the registry (csrc/ab_registry.c), never by
hand; tests/test_planner.py fails when the page is stale.  The report section is the output of
`python -m attn_backends` on the machine that ran this script.
"""

import datetime
import os
import subprocess
import sys

from attn_backends._report import names_markdown, support_matrix_markdown

HERE = os.path.dirname(os.path.abspath(__file__))

INTRO = """# Backends

Every name below works wherever a backend is named (`backend=`, `ab.use(...)`,
`ATTN_BACKENDS_BACKEND`, `--attn_implementation`), case-insensitively, with `-` and `_` alike.
`ab.resolve(name)` gives the canonical name; an unknown name raises a ValueError listing these.

## How a backend is chosen

The planner (`csrc/ab_planner.c`) takes a description of the call (device and compute capability,
whether our CUDA library has code for it, dtype, head dims, GQA, mask kind, causal alignment,
window, softcap, dropout, whether a gradient is needed, deterministic mode, whether lse is wanted,
attention sinks, ALiBi) and tries, in order: the named backend, its chain, then the device's list.

| device | auto's list |
|---|---|
| CPU | flash, flash_varlen, math, eager |
| CUDA | flash, flash_varlen (our kernels need 8.0+ and a library built for the GPU), sdpa, math, eager |
| MPS | sdpa, eager (a mask in evaluation skips sdpa: torch SDPA gives NaN there) |
| other | eager |

Chains: flash <-> flash_varlen; sage, xformers, flash_attn_pkg -> flash; sageattention_pkg -> sage ->
flash; `_native_*`, flex -> sdpa; math -> eager; then the device's list. Lossy backends (sage) are
never chosen by `auto`; forward-only ones never when a gradient is needed. A fallback logs one
WARNING per (requested, chosen, reason) on the `attn_backends` logger and an INFO line names the
backend used; `strict=True` or `ATTN_BACKENDS_STRICT=1` raises instead, listing every backend and
why. `ab.explain(q, k, v, **kwargs)` prints the plan for a call.

`auto` is never slower than torch SDPA on the same machine. The registry lists, per dtype, the CPU
matrix units torch's own CPU SDPA computes on (bfloat16 on AMX-BF16 tiles, float16 on AMX-FP16), and
per ISA path of our CPU kernels the units they use (none yet: every path converts to float32 and uses
FMA). When the CPU has a unit torch uses for the call's dtype and our path does not, `auto` puts
`sdpa` first; our kernels still serve what torch SDPA cannot (packed sequences, softcap, lse), and
calls where torch leaves its fast path keep ours (dropout sends torch's CPU SDPA to its unfused math
path; a window reaches it as a dense mask). The plan's `note:` line in `ab.explain(...)` says so, and
`python -m attn_backends` prints it under "cpu features". Measured on a Xeon with AMX: torch's
bfloat16 forward was 2.0-3.8x our AVX-512 kernel (2 cores, B=2 H=16 S=2048). On the same FMA units,
some classes of calls measured faster in torch's kernel, each with no causal mask, no attn_mask, no GQA,
and none of the features torch's fused kernel lacks; `auto` sends those to `sdpa` too
(`ab_torch_cpu_faster`, a table per ISA path of our kernels): on every path, a float32 forward at head
dim >= 128 (ours 0.85-0.97x on two AVX-512 CPUs without AMX, 0.79-0.90x on an AMD EPYC, Zen 3); on the
avx2 path, also a bfloat16 forward at head dim >= 64 (0.74-0.89x) and a float32 forward+backward at head
dim >= 128 (0.67-0.91x). Elsewhere our kernels measured at par or faster in float32, bfloat16 and
float16 (docs/benchmarks.md, "auto against torch, per dtype" and "... on an AVX2 CPU").

## Accepted names

"""

MATRIX = """

## Support matrix (generated from the registry)

The CUDA rows are the defaults: our CUDA flash and sage kernels are opt-in, slower than torch's on the
GPU measured (docs/benchmarks.md, "GPU"), so their rows read `-`. Opted in
(`ATTN_BACKENDS_CUDA_FLASH=1`), `flash` and `flash_varlen` on CUDA take sinks and ALiBi forward and
backward (the sinks' gradient included). `paged_attention` on CUDA is on by default
(`ATTN_BACKENDS_CUDA_DECODE=0` switches it off).

"""


def main():
    report = subprocess.run([sys.executable, "-m", "attn_backends"], capture_output=True, text=True,
                            check=True).stdout
    text = (INTRO + names_markdown() + MATRIX + support_matrix_markdown() +
            f"\n\n## The report on the machine that generated this page ({datetime.date.today()})\n\n"
            "`python -m attn_backends`:\n\n```\n" + report.rstrip() + "\n```\n")
    with open(os.path.join(HERE, "backends.md"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
