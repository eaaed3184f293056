"""attn_backends: one attention library for every backend name people already use.

    import attn_backends as ab
    out = ab.attention(q, k, v, causal=True)            # (B, H, S, D), like F.scaled_dot_product_attention

The public API is defined here; everything else is private (modules starting with ``_``).
Semantics shared by every backend: docs/semantics.md.  Architecture: docs/architecture.md.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List, NamedTuple, Optional, Tuple, Union

import torch  # loads libtorch before our module registers its ops


def _has_extension(package_dir: str) -> bool:
    import os

    return os.path.isdir(package_dir) and any(n.startswith("_C.") for n in os.listdir(package_dir))


def _missing_extension_error() -> ImportError:
    """The error for a package directory without its built `_C`. Most often it is the repository's
    source tree, first on sys.path (Python puts the current directory there) and so shadowing a
    non-editable install; Python's own message for it speaks of a circular import."""
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    installed = [os.path.join(p, "attn_backends") for p in sys.path
                 if os.path.abspath(p or os.curdir) != root and _has_extension(os.path.join(p or os.curdir,
                                                                                            "attn_backends"))]
    if os.path.exists(os.path.join(root, "setup.py")):
        what = (f"attn_backends was imported from the source tree {here}, which has no built extension "
                f"(_C): {root} comes first on sys.path (Python puts the current directory there)")
        what += (f", so the sources shadow the package installed at {installed[0]}" if installed else
                 ", and no built attn_backends was found elsewhere on sys.path")
    else:
        what = f"attn_backends at {here} has no built extension (_C): the install is incomplete"
    return ImportError(f"{what}. Either install it editable from the repository root, `pip install "
                       f"--no-build-isolation -e .` (which builds _C in the source tree), or run Python from "
                       f"another directory.", name=__name__, path=here)


try:
    from . import _C
except ImportError:
    if _has_extension(__path__[0]):
        raise  # _C is there but does not load (e.g. built against another torch): that error says why
    raise _missing_extension_error() from None  # Python's own message blames a circular import
from . import _ops  # noqa: F401  (registers ops, fake kernels, autograd)
from . import _dispatch, _integrations, _kvcache, _planner, _report
from ._merge import merge_attention_states
from ._names import resolve as _resolve
from ._planner import Plan

_fast_attention = _dispatch.fast_attention
_fast_attention_varlen = _dispatch.fast_attention_varlen
_is_compiling = torch.compiler.is_compiling
_fast_kvcache = _C.kvcache

__version__ = _C.__version__

__all__ = [
    "attention", "attention_varlen", "attention_with_kvcache", "sdpa", "patch_sdpa", "unpatch_sdpa", "patched_sdpa",
    "use", "resolve", "backends", "explain", "add_argparse_args", "apply_args", "register_transformers",
    "register_diffusers", "hf_name", "merge_attention_states",
    "Plan", "BackendInfo", "__version__",
]

Causal = Union[bool, str]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    backend: Optional[str] = "auto",
    causal: Causal = False,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    scale: Optional[float] = None,
    window: Optional[Tuple[int, int]] = None,
    softcap: float = 0.0,
    return_lse: bool = False,
    strict: bool = False,
    deterministic: bool = False,
    sinks: Optional[torch.Tensor] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
):
    """Scaled dot-product attention, served by the best backend for the call.

    Args:
        q: (B, Hq, Sq, D) query, float16 / bfloat16 / float32 / float64.  Any strides.
        k: (B, Hkv, Sk, D) keys; Hq must be a multiple of Hkv (GQA / MQA).
        v: (B, Hkv, Sk, Dv) values.
        backend: any accepted name (``"auto"``, ``"flash"``, ``"flash_attention_2"``, ``"math"``, ...),
            case-insensitive.  ``"auto"`` means the ``use(...)`` context's backend, else
            ATTN_BACKENDS_BACKEND, else the planner's choice.  A named backend that cannot serve the
            call falls back along its chain with one warning (``explain`` shows the plan).  An
            unknown name raises ValueError listing the valid ones.
        causal: False, True (== "top_left": query i sees keys j <= i) or "bottom_right"
            (query i sees keys j <= i + Sk - Sq, the KV-cache convention).
        attn_mask: bool (True = may attend) or float (added to the scores), broadcastable to
            (B, Hq, Sq, Sk); combined with causal and window when both are given.
        dropout_p: probability of dropping an attention weight (kept ones are scaled by
            1 / (1 - p)); the stream comes from torch's generator (torch.manual_seed reproduces it).
        scale: multiplies q.k; default 1 / sqrt(D).
        window: None or (left, right): query i sees keys i' - left <= j <= i' + right, with
            i' = i + Sk - Sq when causal == "bottom_right" and i' = i otherwise; -1 = unbounded.
        softcap: > 0 applies softcap * tanh(score / softcap) before the mask and softmax.
        return_lse: also return lse (B, Hq, Sq), the natural log of the softmax denominator
            (float32; float64 for float64 inputs).  Rows with no visible key have lse = -inf.
        strict: raise instead of falling back when the named backend cannot serve the call
            (also ATTN_BACKENDS_STRICT=1); the error lists every backend and why not.
        deterministic: the backward must give bitwise identical results run after run, as under
            torch.use_deterministic_algorithms(True) (which is honoured without this): backends
            whose backward is not reproducible are not chosen, and our CUDA flash takes its
            atomic-free dQ path.
        sinks: (Hq,) floating, attention sinks (FA3's / vLLM's / GPT-OSS's ``s_aux``): one learnable
            logit per query head that joins every row's softmax denominator and contributes no
            value; lse includes it.  Differentiable (its gradient too).  A row that sees no key then
            outputs 0 with lse = sinks[h].
        alibi_slopes: (Hq,) or (B, Hq) float32, ALiBi as flash-attn defines it: the score of query
            i and key j gets -slope * |i + Sk - Sq - j| (bottom-right alignment, causal or not),
            after softcap.  No gradient (as in flash-attn).

    Returns:
        out (B, Hq, Sq, Dv) in q's dtype, or (out, lse) with return_lse=True.  A query row with no
        visible key outputs exactly 0 and gets zero gradient.
    """
    if not dropout_p and not deterministic and (strict is False or strict is True) and not _is_compiling():
        # the fast path (csrc/ab_direct.c): a plain eager CPU forward whose plan is known, all in C (masks,
        # windows, softcap, sinks and ALiBi too); None hands the call to the Python path.  (A strict that is
        # not a bool is the Python path's to read: its truth may raise, or differ from the plan's.)
        res = _fast_attention(q, k, v, backend, causal, scale, return_lse, window, softcap, sinks, alibi_slopes,
                              attn_mask)
        if res is not None:
            return res
    return _dispatch.attention(q, k, v, backend, causal, attn_mask, dropout_p, scale, window, softcap,
                               return_lse, strict, deterministic, sinks, alibi_slopes)


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    backend: Optional[str] = "auto",
    causal: Causal = False,
    dropout_p: float = 0.0,
    scale: Optional[float] = None,
    window: Optional[Tuple[int, int]] = None,
    softcap: float = 0.0,
    return_lse: bool = False,
    strict: bool = False,
    deterministic: bool = False,
    sinks: Optional[torch.Tensor] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
):
    """Attention over packed variable-length sequences, as flash-attn's ``flash_attn_varlen_func``.

    Args:
        q: (total_q, Hq, D): the query rows of every sequence, one after another.
        k: (total_k, Hkv, D); v: (total_k, Hkv, Dv).
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,): sequence b is rows cu[b] .. cu[b+1].  Checked
            on the host: start at 0, never decrease, end at the total, same batch for q and k (under
            torch.compile, by the kernel's op when it runs: nothing is read on the host while tracing).
        max_seqlen_q, max_seqlen_k: upper bounds of the lengths (a longer sequence is an error).
        Other arguments as in ``attention``; causal, window and ALiBi align per sequence
        (alibi_slopes (B, Hq): one row per sequence).

    Returns:
        out (total_q, Hq, Dv), or (out, lse) with lse (Hq, total_q) float32, as flash-attn.
    """
    if not dropout_p and not deterministic and (strict is False or strict is True) and not _is_compiling():
        # the packed calls' fast path (csrc/ab_direct.c), as attention's above (windows, softcap, sinks and
        # ALiBi too)
        res = _fast_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, backend, causal,
                                     scale, window, softcap, return_lse, sinks, alibi_slopes)
        if res is not None:
            return res
    return _dispatch.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, backend,
                                      causal, dropout_p, scale, window, softcap, return_lse, strict, deterministic,
                                      sinks, alibi_slopes)


def attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    *,
    rotary_cos: Optional[torch.Tensor] = None,
    rotary_sin: Optional[torch.Tensor] = None,
    cache_seqlens: Optional[Union[int, torch.Tensor]] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Optional[torch.Tensor] = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    backend: Optional[str] = "auto",
    strict: bool = False,
    sinks: Optional[torch.Tensor] = None,
):
    """Attention against a KV cache (decode, speculative decoding, chunked prefill), as flash-attn's
    ``flash_attn_with_kvcache``: same arguments, layouts and semantics (docs/decode.md).

    If k and v are given they are written into k_cache and v_cache *in place* at positions
    cache_seqlens[b], cache_seqlens[b] + 1, ... (rotated first when rotary_cos/sin are given), then
    every query attends to its row's keys [cache_leftpad[b], cache_seqlens[b] + Sk_new).  A call that
    fails a check writes nothing.  Inference only: a call that needs a gradient raises.  On a GPU, index
    tensors (cache_seqlens, cache_leftpad, cache_batch_idx, block_table) are not read back to check
    their values (no synchronisation per call; CUDA graphs capture it): a batch row whose values are out
    of range writes nothing and comes out NaN (ATTN_BACKENDS_KVCACHE_CHECK=1 checks them on the host,
    with the same errors as on the CPU; docs/decode.md, "The CUDA kernel").

    Args:
        q: (B, Sq, Hq, D), float16 / bfloat16 / float32 (float64 through math).
        k_cache, v_cache: (B_cache, S_cache, Hkv, D), or with block_table a paged cache
            (num_blocks, block_size, Hkv, D), any block_size; q's dtype, last dim contiguous.
        k, v: (B, Sk_new, Hkv, D) new keys and values to append (both or neither; need cache_seqlens).
        rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2): rotate the new keys at their positions
            and q at cache_seqlens + t (causal or a window shorter than the cache) or at cache_seqlens
            (otherwise); dims past rotary_dim are left as they are.  Only with k and v.
        cache_seqlens: int, or (B,) int32: tokens already in each cache row (default: the whole cache).
        cache_batch_idx: (B,) int32: the cache row of each batch row (dense caches).
        cache_leftpad: (B,) int32: each row's keys start at this position.
        block_table: (B, max_blocks) int32: the blocks of each row, in order; entries past a row's
            last position may be anything (-1 padding).
        softmax_scale: multiplies q.k; default 1 / sqrt(D).
        causal: bottom-right aligned: query t sits at position t + end - Sq, end = cache_seqlens[b] +
            Sk_new, and sees keys at positions <= its own.
        window_size: (left, right), query at position i sees keys i - left .. i + right; -1 (any
            negative, as flash-attn) = unbounded.
        softcap: > 0 applies softcap * tanh(score / softcap) before ALiBi and the softmax.
        rotary_interleaved: rotate pairs (2i, 2i + 1); False: GPT-NeoX halves (i, i + rotary_dim / 2).
        alibi_slopes: (Hq,) or (B, Hq) float32: adds -slope * |query position - key position|.
        num_splits: splits of each row's keys processed in parallel and merged (0 or less: chosen from the
            thread count, or the GPU's SM count; results can then differ in the last bits between
            thread counts).  The kernels' only: torch SDPA's route ignores it.
        return_softmax_lse: also return lse (B, Hq, Sq) float32 (-inf for a query that sees no key).
        backend: ``"auto"`` (the paged_attention kernel, on CPU and on CUDA, but torch SDPA on CUDA in
            float16 and bfloat16 for a call it reads in place: a dense cache, an int cache_seqlens, no
            leftpad or window, causal only for one token, and none of lse, softcap, sinks, ALiBi, which
            keep the kernel, so the same call with and without lse may differ in the last bits; on a CPU
            with AMX-BF16 torch SDPA too for bfloat16 chunked prefill, from 256 query rows per KV head
            and 32 tokens, over a plain dense cache (bottom-right causal as a mask of its sizes); on
            CUDA eager for the rest under ATTN_BACKENDS_CUDA_DECODE=0; on MPS sdpa, else eager),
            ``"paged_attention"``, ``"flash"``
            (our flash kernel over a gathered view of the cache; the decode kernel for a few query
            tokens), ``"sdpa"`` (torch SDPA over the cache's view, for the calls that need no mask, and no
            lse, softcap, sinks or ALiBi; on the CPU only the chunked prefill above; the others fall
            back to the kernel),
            ``"math"`` / ``"eager"`` (float64 torch ops over the gathered view, any device; float32 on
            MPS) or any accepted name; one that cannot serve a KV-cache call falls back along its
            chain (flex and the ``_native_*`` names to sdpa) and the list, with one warning.
        strict: raise instead of falling back.
        sinks: (Hq,) floating attention sinks, as in ``attention`` (counted once per row, also when
            the keys are split).

    Returns:
        out (B, Sq, Hq, D) in q's dtype, or (out, lse) with return_softmax_lse=True.  A query that
        sees no key gets out 0 and lse -inf (lse = sinks[h] with sinks).
    """
    if (strict is False or strict is True) and not _is_compiling():
        # the fast path (csrc/ab_direct.c, kvcache): an eager CPU call within the checks' rules whose plan is
        # known, all in C; None hands the call to the Python path
        res = _fast_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                            cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                            rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse, backend, sinks)
        if res is not None:
            return res
    return _kvcache.attention_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
        block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
        return_softmax_lse, backend, strict, sinks)


class BackendInfo(NamedTuple):
    """One row of ``backends()``."""

    name: str
    aliases: Tuple[str, ...]
    kind: str  # "planner", "bundled" (our kernels), "torch" (SDPA, FlexAttention), "external" (a package)
    available: bool  # can run on a device this machine has
    why_not: str  # "" when available
    devices: Tuple[str, ...]  # device types it has a kernel or route for
    lossy: bool
    supports_backward: bool


def backends() -> List[BackendInfo]:
    """Every backend the library knows, in registry order, with whether it can run here and why not."""
    return [BackendInfo(*row) for row in _report.backend_rows()]


def explain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> Plan:
    """The plan for ``attention(q, k, v, **kwargs)`` without running it: the backend that would
    serve the call, the candidates tried, and for every backend why it cannot.  ``print()`` it for
    a table.  Takes the keyword arguments of ``attention``."""
    return _dispatch.explain(q, k, v, **kwargs)


@contextlib.contextmanager
def use(backend: str) -> Iterator[str]:
    """Default backend for calls made in this context (``backend="auto"`` or left out).

    Context-local (contextvars): safe across threads and asyncio tasks; nests.  An explicit
    ``backend=`` argument still wins.  Under torch.compile the backend is fixed when the graph is
    traced.  Outside any ``use``, the default is ATTN_BACKENDS_BACKEND, else "auto".
    """
    name = _resolve(backend)
    token = _planner._context_backend.set(name)
    try:
        yield name
    finally:
        _planner._context_backend.reset(token)


def resolve(name: str) -> str:
    """The canonical backend name for any accepted name (case-insensitive, '-' == '_').

    Raises ValueError listing every valid name when ``name`` is unknown.
    """
    return _resolve(name)


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
         dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
         enable_gqa: bool = False) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention``, exactly, routed through the planner.

    Same signature, semantics and errors: is_causal is top-left, dropout applies whenever
    dropout_p > 0, a bool mask means True = attend.  Calls the planner cannot reproduce exactly
    (broadcast batch dims, a mask with is_causal, arguments torch rejects) go to torch's own
    function.  The backend is the ``use(...)`` / process default (``patch_sdpa(backend)`` sets it).
    """
    return _integrations.sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def patch_sdpa(backend: str = "auto") -> None:
    """Replace ``torch.nn.functional.scaled_dot_product_attention`` with a router to ``backend``.

    Code that looks the function up through the module at call time (nn.MultiheadAttention, HF
    models with attn_implementation="sdpa", most training scripts) then runs on our backends; a
    reference taken earlier with ``from torch.nn.functional import ...`` keeps torch's."""
    _integrations.patch_sdpa(backend)


def unpatch_sdpa() -> None:
    """Restore torch's own ``scaled_dot_product_attention`` (the same object, not a copy)."""
    _integrations.unpatch_sdpa()


def patched_sdpa(backend: str = "auto"):
    """Context manager: ``patch_sdpa(backend)`` inside, whatever was there before restored after."""
    return _integrations.patched_sdpa(backend)


def add_argparse_args(parser, default: str = "auto", *, skip=()):
    """Add ``--attn_implementation NAME`` (every accepted name, case-insensitive; stored canonical),
    ``--use_flash_attention`` (deprecated, same as ``--attn_implementation flash``; a FutureWarning
    says so), ``--disable_mps_fix`` and ``--patch_sdpa`` to an argparse parser; returns the parser.

    A flag the parser already has is left as it is (HfArgumentParser and TRL-style configs define
    ``--attn_implementation`` themselves; ``--use_flash_attention`` then writes into theirs);
    ``skip=("patch_sdpa", ...)`` leaves out flags by name.  Apply the parsed values with
    ``apply_args(args)``."""
    return _integrations.add_argparse_args(parser, default, skip=skip)


def apply_args(args, *more, for_hf: bool = False) -> str:
    """Apply flags parsed by ``add_argparse_args``: the process default backend (what
    ``backend="auto"`` means outside ``use``), the MPS rule, and patching SDPA when
    ``--patch_sdpa`` was given.  Each flag is read from the first of ``args, *more`` that has it
    (``apply_args(model_args, extra)`` for HfArgumentParser's dataclasses); the backend may be any
    accepted name or a registered attn_implementation.  Returns the canonical backend name, or
    with ``for_hf=True`` the attn_implementation to hand to transformers (``hf_name``; our
    backends are registered with it first)."""
    return _integrations.apply_args(args, *more, for_hf=for_hf)


def register_transformers() -> dict:
    """Register our backends with HF transformers' AttentionInterface (and its mask interface), so
    that ``from_pretrained(..., attn_implementation=ab.hf_name("flash"))`` runs the model's attention
    on them.  ``"attn_backends"`` is the default backend (see ``use`` and ``apply_args``); the others
    are ``hf_name(backend)``: ``attn_backends_fa``, ``attn_backends_fa_varlen``, ``attn_backends_torch``
    (torch's SDPA), ``attn_backends_math``, ...  Everything the model passes is honoured (masks,
    position_bias, attention sinks, sliding windows, softcap, packed sequences) or refused with an
    error naming it.  Also ``"attn_backends_flash_attention_2"``: transformers' own flash-attention
    path (and its continuous batching) on ``attn_backends.flash_attn``'s flash-attn functions
    (docs/integrations.md).  Returns {canonical name: attn_implementation}."""
    from . import _transformers

    return _transformers.register()


def register_diffusers() -> dict:
    """Register our backends with diffusers, under the names of ``hf_name``, so that diffusers' own
    ``model.set_attention_backend("attn_backends_fa")`` and ``with attention_backend(...):`` select
    them.  diffusers has no public registration API yet: this adds members to its
    ``AttentionBackendName`` enum and registers through its backend registry, and raises
    RuntimeError if a diffusers release changed either (docs/integrations.md).  Calls take
    diffusers' (B, S, H, D) layout; a (B, Sk) mask is a key padding mask, as in its native
    backend.  Returns {canonical name: diffusers backend name}."""
    from . import _diffusers

    return _diffusers.register()


def hf_name(backend: str) -> str:
    """The attn_implementation that ``register_transformers()`` (and ``register_diffusers()``)
    registers for any accepted backend name: ``hf_name("flash_attention_2") == "attn_backends_fa"``,
    ``hf_name("sdpa") == "attn_backends_torch"``, ``hf_name("auto") == "attn_backends"``; a
    registered name (old spellings included) gives its current spelling.  Needs neither package
    installed.  Raises ValueError listing the valid names for an unknown one."""
    from . import _transformers

    return _transformers.hf_name(backend)
