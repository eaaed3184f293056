"""flash-attn's three entry points, served by attn_backends.

Code written against flash-attn 2 can swap its import and keep its calls::

    from attn_backends.flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

(the packed forms too: ``flash_attn_qkvpacked_func``, ``flash_attn_kvpacked_func`` and their varlen
twins, which split the packed tensor into views).

Each function takes flash-attn's arguments, layouts and semantics (bottom-right causal and windows,
any negative window side unbounded, ALiBi slopes, softcap, lse shapes) and runs on the backend the
planner picks (``ab.use(...)`` and ATTN_BACKENDS_BACKEND apply; the keyword ``backend=`` names one).
Two keywords beyond flash-attn 2: ``s_aux``, attention sinks under FA3's / vLLM's name (the name
transformers' flash path passes them under), and ``backend``.

transformers' flash-attention path takes these three through ``register_transformers()`` under
the attn_implementation ``"attn_backends_flash_attention_2"`` (docs/integrations.md): its continuous
batching then prefills through ``flash_attn_varlen_func`` and, on a GPU, decodes against its paged
cache through ``flash_attn_with_kvcache``.

Decided here, where flash-attn does not say or where its kernel departs from its own definition:
  - ``return_attn_probs=True`` returns ``(out, lse, None)``; the third item, flash-attn's dropout
    pattern for its tests, is not computed.
  - A query row that sees no key gets out 0 (as flash-attn) and lse -inf, the log of its empty sum,
    as everywhere in this library; flash-attn's kernel writes +inf there.
  - ALiBi's lse is that of the scores flash-attn defines (-slope * |i + Sk - Sq - j|); its causal
    kernel adds slope * j instead, the same softmax and output but an lse higher by a constant per
    row (docs/semantics.md).
  - A window side of -1 is unbounded, as flash-attn documents; its kernel bounds an unbounded right
    side at seqlen_k when the left side is bounded, which hides keys only from rows that sit before
    the first key (Sq > Sk, no causal).
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch

from . import _C, _validate, _varlen
from ._eager import visible_keys
from ._kvcache import _flag, window_pair

_fast_varlen = _C.attention_varlen
_is_compiling = torch.compiler.is_compiling

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "flash_attn_qkvpacked_func",
           "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func"]


def _no_window(window_size: tuple) -> bool:
    """window_size is (-1, -1) in plain ints (== against a tuple holding a tensor would ask the truth of a
    tensor comparison: the checks below word what is wrong with such a window)."""
    return (len(window_size) == 2 and window_size[0].__class__ is int and window_size[1].__class__ is int
            and window_size[0] == -1 and window_size[1] == -1)


def _bottom_right_window(Sq: int, Sk: int, wl: int, wr: int, device) -> torch.Tensor:
    """bool (Sq, Sk): flash-attn's window without causal, aligned bottom-right (query i at i + Sk - Sq)."""
    return visible_keys(Sq, Sk, 0, wl, wr, device, bottom_right=True)


# Our checks name our arguments; these functions' callers know flash-attn's: an error about one of the two
# that differ names it as the caller wrote it (the messages begin with the argument's name)
_THEIR_NAMES = (("scale ", "softmax_scale "), ("sinks ", "s_aux "))


def _flash_attn_names(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (TypeError, ValueError) as e:
            msg = str(e)
            for ours, theirs in _THEIR_NAMES:
                if msg.startswith(ours) and type(e) in (TypeError, ValueError):
                    rest = msg[len(ours):].replace(f"|{ours.strip()}|", f"|{theirs.strip()}|")
                    raise type(e)(theirs + rest) from None
            raise

    return call


def _dense_layout(q, k, v):
    """flash-attn's (B, S, H, D) layout, checked before the tensors are viewed in ours."""
    for name, t, want in (("q", q, "(batch, seqlen_q, nheads, headdim)"), ("k", k, "(batch, seqlen_k, nheads_k, headdim)"),
                          ("v", v, "(batch, seqlen_k, nheads_k, headdim_v)")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D {want}, as in flash-attn, got shape {tuple(t.shape)}")


def _options(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, s_aux, backend):
    causal = _flag("causal", causal)
    opts = dict(backend=backend, causal="bottom_right" if causal else False, dropout_p=dropout_p,
                scale=softmax_scale, softcap=softcap, deterministic=bool(deterministic), sinks=s_aux,
                alibi_slopes=alibi_slopes)
    wl, wr = window_pair(window_size)
    return opts, (wl, wr), causal


@_flash_attn_names
def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    s_aux: Optional[torch.Tensor] = None,
    backend: Optional[str] = "auto",
):
    """flash-attn's ``flash_attn_func``: q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv).

    Returns out (B, Sq, Hq, Dv), or (out, lse (B, Hq, Sq) float32, None) with return_attn_probs.
    Differentiable (q, k, v, and s_aux)."""
    from . import attention

    _dense_layout(q, k, v)
    opts, (wl, wr), causal = _options(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                      deterministic, s_aux, backend)
    Sq, Sk = q.shape[1], k.shape[1]
    mask = None
    if not causal and (wl >= 0 or wr >= 0) and Sq != Sk:
        mask = _bottom_right_window(Sq, Sk, wl, wr, q.device)  # ours aligns a window top-left without causal
    elif wl >= 0 or wr >= 0:
        opts["window"] = (wl, wr)
    res = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                    return_lse=bool(return_attn_probs), **opts)
    if return_attn_probs:
        out, lse = res
        return out.transpose(1, 2).contiguous(), lse, None
    return res.transpose(1, 2).contiguous()


def _check_pages(k, v, block_table, cu_q, cu_k, max_q, max_k, Tq):
    """The paged form's arguments checked (the packed ones as the varlen path checks them); returns
    each sequence's key count."""
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or block_table.dtype not in (
            torch.int32, torch.int64):
        what = (f"{tuple(block_table.shape)} {block_table.dtype}" if isinstance(block_table, torch.Tensor)
                else type(block_table).__name__)
        raise ValueError(f"block_table must be (batch, max_blocks) int32, got {what}")
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} with block_table must be a paged cache (num_blocks, block_size, nheads_k, "
                             f"headdim), got {got}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v with block_table must have the same (num_blocks, block_size, nheads_k), got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    Tk = int(cu_k[-1]) if isinstance(cu_k, torch.Tensor) and cu_k.dim() == 1 and cu_k.numel() else 0
    return _varlen.check_cu_seqlens(cu_q, cu_k, max_q, max_k, Tq, Tk, k.device)[4]


def _gather_pages(cache: torch.Tensor, block_table: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """(sum(lens), H, D): the first lens[b] rows of each sequence's pages, one sequence after another."""
    nb, bs = cache.shape[0], cache.shape[1]
    lens = lens.to(torch.int64).cpu()
    B = lens.numel()
    if block_table.shape[0] != B:
        raise ValueError(f"block_table has {block_table.shape[0]} rows for {B} sequences (cu_seqlens_k)")
    need = (lens + bs - 1) // bs
    if B and int(need.max()) > block_table.shape[1]:
        raise ValueError(f"cu_seqlens_k asks for {int(need.max())} blocks of {bs} keys, block_table has "
                         f"{block_table.shape[1]} per sequence")
    # every key's (sequence, position), then its block and row: one gather, no loop over sequences
    seq = torch.repeat_interleave(torch.arange(B), lens)
    pos = torch.arange(seq.numel()) - torch.repeat_interleave(lens.cumsum(0) - lens, lens)
    blocks = block_table.to(torch.int64).cpu()[seq, pos // bs]
    bad = (blocks < 0) | (blocks >= nb)
    if bool(bad.any()):
        b = int(seq[bad.nonzero()[0, 0]])
        raise ValueError(f"block_table[{b}] names blocks outside 0..{nb - 1} within its {int(lens[b])} keys")
    idx = blocks * bs + pos % bs
    return cache.reshape(nb * bs, *cache.shape[2:])[idx.to(cache.device)]


def _spare_rows(q, k, v, cu_q, cu_k, paged):
    """(rows of q, rows of k) the sequences use, where q (or k, unpaged) holds rows past the last sequence
    (cu_seqlens[-1] below its length: flash-attn takes such a buffer); None otherwise, or where the
    arguments are for the checks to refuse.  Not read while tracing."""
    if _is_compiling() or not all(isinstance(t, torch.Tensor) for t in (q, k, cu_q, cu_k)):
        return None
    if q.dim() != 3 or any(c.dim() != 1 or not c.numel() or c.dtype not in (torch.int32, torch.int64)
                           or c.device.type == "meta" for c in (cu_q, cu_k)):
        return None
    if not paged and (not isinstance(v, torch.Tensor) or v.shape[:1] != k.shape[:1]):
        return None  # k and v of different lengths: the checks' error
    nq, nk = int(cu_q[-1]), int(cu_k[-1])
    tk = k.shape[0] if not paged and k.dim() == 3 else None
    if nq < 0 or nq > q.shape[0] or tk is not None and (nk < 0 or nk > tk):
        return None  # the checks' errors
    return (nq, nk) if nq < q.shape[0] or tk is not None and nk < tk else None


@_flash_attn_names
def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Optional[torch.Tensor] = None,
    *,
    s_aux: Optional[torch.Tensor] = None,
    backend: Optional[str] = "auto",
):
    """flash-attn's ``flash_attn_varlen_func``: q (total_q, Hq, D), k and v (total_k, Hkv, D), or with
    block_table paged caches (num_blocks, block_size, Hkv, D) whose sequence b is its first
    cu_seqlens_k[b + 1] - cu_seqlens_k[b] keys in the blocks block_table[b] names.

    Returns out (total_q, Hq, Dv), or (out, lse (Hq, total_q) float32, None) with return_attn_probs."""
    from . import attention, attention_varlen

    if (block_table is None and not dropout_p and not deterministic and window_size.__class__ is tuple
            and (causal is True or (causal is False and _no_window(window_size))) and not _is_compiling()):
        # the packed calls' fast path (csrc/ab_direct.c); None: the checks and the planner below.  A window
        # only with causal: without it flash-attn aligns the window bottom-right, ours top-left (below)
        res = _fast_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, backend,
                           "bottom_right" if causal else False, softmax_scale, window_size, softcap,
                           bool(return_attn_probs), s_aux, alibi_slopes)
        if res is not None:
            return (res[0], res[1], None) if return_attn_probs else res

    spare = _spare_rows(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table is not None)
    if spare is not None:
        # rows past the last sequence (a fixed-size buffer): flash-attn takes them and leaves their output
        # unspecified; here the call runs on the used rows, and the spare ones get out 0, lse -inf
        nq, nk = spare
        res = flash_attn_varlen_func(q[:nq], k if block_table is not None else k[:nk],
                                     v if block_table is not None else v[:nk], cu_seqlens_q, cu_seqlens_k,
                                     max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                     softcap, alibi_slopes, deterministic, return_attn_probs, block_table, s_aux=s_aux,
                                     backend=backend)
        out = res[0] if return_attn_probs else res
        out = torch.cat([out, out.new_zeros((q.shape[0] - nq, *out.shape[1:]))])
        if not return_attn_probs:
            return out
        lse = torch.cat([res[1], res[1].new_full((res[1].shape[0], q.shape[0] - nq), float("-inf"))], 1)
        return out, lse, None
    opts, (wl, wr), causal = _options(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                      deterministic, s_aux, backend)
    if _is_compiling() and (block_table is not None or not causal and (wl >= 0 or wr >= 0)):
        # these read cu_seqlens on the host (the pages, the lengths sequence by sequence): traced, inductor
        # failed to compile them (NameError in its generated code); they run eagerly, a graph break
        return _eager_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                             softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                             return_attn_probs, block_table, s_aux=s_aux, backend=backend)
    if block_table is not None:
        lens_k = _check_pages(k, v, block_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              q.shape[0] if isinstance(q, torch.Tensor) and q.dim() else 0)
        k, v = _gather_pages(k, block_table, lens_k), _gather_pages(v, block_table, lens_k)
    want = bool(return_attn_probs)
    if not causal and (wl >= 0 or wr >= 0):
        # ours aligns a window top-left without causal, flash-attn bottom-right: sequence by sequence
        # with the mask where the two differ, after the checks the packed path makes
        Tq, Hq, _, Tk, _, _ = _varlen.check_qkv(q, k, v)
        hq, hk, B, lq, lk = _varlen.check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, Tq, Tk,
                                                     q.device)
        if alibi_slopes is not None:
            opts["alibi_slopes"] = _validate.check_alibi(alibi_slopes, q, B, Hq)
        if bool((lq != lk).any()):
            return _varlen_by_sequence(attention, q, k, v, hq.tolist(), hk.tolist(), (wl, wr), want, opts)
    if wl >= 0 or wr >= 0:
        opts["window"] = (wl, wr)
    res = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, return_lse=want, **opts)
    return (res[0], res[1], None) if want else res


@torch.compiler.disable
def _eager_varlen(*args, **kwargs):
    return flash_attn_varlen_func(*args, **kwargs)


def _varlen_by_sequence(attention, q, k, v, cq, ck, window, want, opts):
    alibi = opts.pop("alibi_slopes")
    outs, lses = [], []
    for b in range(len(cq) - 1):
        qb, kb, vb = (x.transpose(0, 1)[None] for x in (q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]]))
        mask = _bottom_right_window(qb.shape[2], kb.shape[2], *window, q.device)
        slopes = alibi[b] if alibi is not None and alibi.dim() == 2 else alibi
        r = attention(qb, kb, vb, attn_mask=mask, return_lse=want, alibi_slopes=slopes, **opts)
        out, lse = r if want else (r, None)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0] if want else None)
    out = torch.cat(outs) if outs else q.new_zeros(0, q.shape[1], v.shape[-1])
    if want:
        return out, torch.cat(lses, dim=1) if lses else torch.zeros(q.shape[1], 0, device=q.device), None
    return out


@_flash_attn_names
def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    rotary_cos: Optional[torch.Tensor] = None,
    rotary_sin: Optional[torch.Tensor] = None,
    cache_seqlens=None,
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
    *,
    s_aux: Optional[torch.Tensor] = None,
    backend: Optional[str] = "auto",
):
    """flash-attn's ``flash_attn_with_kvcache``: ``ab.attention_with_kvcache`` with flash-attn's
    positional order (docs/decode.md).  As flash-attn's, it has no backward and runs without a graph
    whatever its inputs require (ab.attention_with_kvcache raises for a call that needs a gradient)."""
    from . import attention_with_kvcache

    with torch.no_grad():
        return attention_with_kvcache(
            q, k_cache, v_cache, k, v, rotary_cos=rotary_cos, rotary_sin=rotary_sin, cache_seqlens=cache_seqlens,
            cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, block_table=block_table,
            softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
            rotary_interleaved=rotary_interleaved, alibi_slopes=alibi_slopes, num_splits=num_splits,
            return_softmax_lse=return_softmax_lse, backend=backend, sinks=s_aux)


# ---- the packed forms: views of the packed tensor, so gradients reach it ----------------------

def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                              s_aux=None, backend="auto"):
    """flash-attn's ``flash_attn_qkvpacked_func``: qkv (B, S, 3, H, D)."""
    _packed("qkv", qkv, 5, 3)
    q, k, v = qkv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, s_aux=s_aux, backend=backend)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                             s_aux=None, backend="auto"):
    """flash-attn's ``flash_attn_kvpacked_func``: q (B, Sq, Hq, D), kv (B, Sk, 2, Hkv, D)."""
    _packed("kv", kv, 5, 2)
    k, v = kv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, s_aux=s_aux, backend=backend)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, s_aux=None, backend="auto"):
    """flash-attn's ``flash_attn_varlen_qkvpacked_func``: qkv (total, 3, H, D)."""
    _packed("qkv", qkv, 4, 3)
    q, k, v = qkv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                                  s_aux=s_aux, backend=backend)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, s_aux=None,
                                    backend="auto"):
    """flash-attn's ``flash_attn_varlen_kvpacked_func``: q (total_q, Hq, D), kv (total_k, 2, Hkv, D)."""
    _packed("kv", kv, 4, 2)
    k, v = kv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, s_aux=s_aux, backend=backend)


def _packed(name, t, ndim, n):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    dim = ndim - 3
    if t.dim() != ndim or t.shape[dim] != n:
        want = ("(B, S, " if ndim == 5 else "(total, ") + f"{n}, H, D)"
        raise ValueError(f"{name} must be {want}, got shape {tuple(t.shape)}")
