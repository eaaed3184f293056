"""How each backend is called once the planner has chosen it: one module per family, one runner
signature, runners looked up by backend id.

Every runner takes one Attn, the validated call (dense, or packed when cu_q is given), and returns
(out, lse or None).  The planner only routes a call to a runner whose registry row says it can serve
it exactly, so runners do not re-check capabilities: a family that takes no packed calls is never
handed one, and only the families whose rows claim sinks and ALiBi (ours, eager) see them.

    ours.py        our kernels: flash (the direct CPU call, the ops, autograd), flash_varlen, sage,
                   math, eager; the dropout stream (draw_rng_state)
    torch_sdpa.py  torch's SDPA, and each of its kernels forced
    flex.py        torch's FlexAttention
    packages.py    the optional packages: flash_attn, xformers, sageattention
    packed.py      a packed call served by a dense runner (pad, one mask per sequence, unpad)
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .._names import CANONICAL, ID
from . import flex, ours, packages, packed, torch_sdpa
from .ours import direct_ok, draw_rng_state, read_guards  # noqa: F401  (public to the package's users)
from .torch_sdpa import ORIGINAL_SDPA  # noqa: F401


class Attn(NamedTuple):
    """One call as the runners read it.  causal: 0 none, 1 top-left, 2 bottom-right; wl, wr: the
    window (-1 unbounded); p: dropout; det: the call's own request for a reproducible backward
    (torch's global flag is read as well).  Packed calls also carry cu_q/cu_k (on q's device),
    their host copies, the sequence lengths and the longest of each; dense calls leave them None."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: Optional[torch.Tensor] = None
    causal: int = 0
    scale: float = 1.0
    wl: int = -1
    wr: int = -1
    softcap: float = 0.0
    p: float = 0.0
    need_grad: bool = False
    want_lse: bool = False
    det: bool = False
    sinks: Optional[torch.Tensor] = None
    alibi: Optional[torch.Tensor] = None
    cu_q: Optional[torch.Tensor] = None
    cu_k: Optional[torch.Tensor] = None
    hcu_q: Optional[torch.Tensor] = None
    hcu_k: Optional[torch.Tensor] = None
    len_q: Optional[list] = None
    len_k: Optional[list] = None
    max_q: int = 0
    max_k: int = 0


new_attn = tuple.__new__  # new_attn(Attn, (all 23 fields)): the per-call constructor, no defaults to fill

_BY_NAME = {
    "flash": ours.run_flash,
    "flash_varlen": ours.run_flash,
    "sage": ours.run_sage,
    "math": ours.run_math,
    "eager": ours.run_eager,
    "paged_attention": None,  # KV-cache calls only: attn_backends/_kvcache.py runs them
    "sdpa": torch_sdpa.runner(None),
    "_native_flash": torch_sdpa.runner("FLASH_ATTENTION"),
    "_native_efficient": torch_sdpa.runner("EFFICIENT_ATTENTION"),
    "_native_cudnn": torch_sdpa.runner("CUDNN_ATTENTION"),
    "_native_math": torch_sdpa.runner("MATH"),
    "flex": flex.run_flex,
    "flash_attn_pkg": packages.run_flash_attn_pkg,
    "xformers": packages.run_xformers,
    "sageattention_pkg": packages.run_sage_pkg,
}
# RUNNERS[backend id] -> runner(Attn) -> (out, lse or None); None for "auto" and paged_attention
RUNNERS = tuple(_BY_NAME.get(name) for name in CANONICAL)
assert all(name in _BY_NAME for name in CANONICAL[1:]), "a backend in the registry has no runner here"
assert RUNNERS[ID["flash"]] is ours.run_flash
