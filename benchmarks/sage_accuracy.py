"""sage's worst accuracy over the test grid, per CPU path and kind of K: the table in docs/sage.md.

Runs the cases of tests/test_sage.py::test_sage_matches_reference (every dtype for every case, not
the rotating third the tests use) on every CPU path this machine has, for random K, K with three
channels offset by +20 and K with three channels scaled by 10, and prints the worst cosine
similarity, relative L1 and lse error against the float64 reference.

    python benchmarks/sage_accuracy.py
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import test_sage as T  # noqa: E402  (the grid, the outlier recipes and the metrics of the tests)

from attn_backends import _C  # noqa: E402
from attn_backends._testing import cpu_isas, make_inputs, reference_attention  # noqa: E402


def worst(kind: str) -> tuple[float, float, float, float]:
    cos_min, l1_max, lse_max, lse_mean = 1.0, 0.0, 0.0, 0.0
    for case in T.GRID:
        for dtype in T.DTYPES:
            gen = torch.Generator().manual_seed(1234)
            c = dataclasses.replace(case, dtype=dtype)
            q, k, v, mask = make_inputs(c, generator=gen)
            k = T.with_outliers(k, gen, kind)
            out, lse = T.run_sage(q, k, v, mask, c)
            ref, ref_lse = reference_attention(q, k, v, dtype=torch.float64, causal=c.causal, attn_mask=mask,
                                               window=c.window, softcap=c.softcap)
            cos, l1 = T.sage_metrics(out, ref)
            err = (lse.double() - ref_lse)[~torch.isinf(ref_lse)].abs()
            cos_min, l1_max = min(cos_min, cos), max(l1_max, l1)
            if err.numel():
                lse_max, lse_mean = max(lse_max, float(err.max())), max(lse_mean, float(err.mean()))
    return cos_min, l1_max, lse_max, lse_mean


def main() -> None:
    before = _C.cpu_isa()
    print("| path | K | worst cosine | worst relative L1 | lse error max | lse error mean (worst case) |")
    print("|---|---|---|---|---|---|")
    try:
        for isa in cpu_isas():
            _C.set_cpu_isa(isa)
            for kind in ("none", "offset", "scale"):
                print(f"| {_C.sage_cpu_isa()} | {kind} | " + " | ".join(f"{x:.5g}" for x in worst(kind)) + " |")
    finally:
        _C.set_cpu_isa(before)


if __name__ == "__main__":
    main()
