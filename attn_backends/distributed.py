"""Context parallelism over torch.distributed: attention over a sequence split across ranks.

    from attn_backends import distributed as abd
    q_local = abd.shard(q)                              # this rank's rows of (B, H, S, D)
    out_local = abd.ring_attention(q_local, k_local, v_local, causal=True)
    out = abd.unshard(out_local)                        # every rank's rows, in order

Two schemes (docs/distributed.md):

- ring: the K/V shards travel around the ring of ranks, each block's transfer hidden behind the
  compute of the one before; partial results merged in float32; a second ring pass for the backward.
  Memory per rank O(S / W); any number of heads.
- Ulysses: two all_to_all exchanges turn sequence shards into head shards and back, with one ordinary
  attention call (any backend) in between.  Needs the heads divisible by the world size W.

Shards are in the SDPA layout (B, H, S_local, D), GQA allowed.  The layout says which rows a rank
holds: "zigzag" (the default) cuts the sequence into 2W chunks and gives rank r chunks r and 2W-1-r,
so that every rank has the same causal work; "contiguous" gives rank r the r-th of W chunks.  Use the
same layout for shard, the attention calls and unshard.  Every rank of the group must make the same
calls in the same order (as with any collective), the backward included.  Dropout is not supported.
"""

from __future__ import annotations

import math
import zlib
from typing import Optional, Tuple, Union

import torch

from . import _cp, _dispatch, _planner, _ring, _validate

__all__ = ["shard", "unshard", "ring_attention", "ulysses_attention", "shard_varlen", "unshard_varlen",
           "ring_attention_varlen", "ulysses_attention_varlen"]

Causal = Union[bool, str]


def shard(x: torch.Tensor, *, group=None, layout: str = "zigzag", dim: int = 2) -> torch.Tensor:
    """This rank's piece of ``x`` along ``dim`` (the sequence dim, 2 for (B, H, S, D)).

    Every rank passes the whole ``x``; no communication.  x.shape[dim] must divide into the layout's
    chunks: W for "contiguous", 2W for "zigzag" (W = the group's size).  Returns a new tensor (never a
    view of x) of length x.shape[dim] / W; differentiable."""
    g = _cp.resolve_group(group)
    layout = _cp.check_layout(layout)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    dim = _check_dim(dim, x.dim(), "x")
    n = _cp.n_chunks(layout, g.world)
    S = x.shape[dim]
    if S % n:
        raise ValueError(f"x: its length along dim {dim} ({S}) must divide into the {n} equal chunks of the "
                         f"{layout} layout over {g.world} ranks (pad the sequence to a multiple of {n})")
    c = S // n
    return torch.cat([x.narrow(dim, i * c, c) for i in _cp.chunks_of(layout, g.rank, g.world)], dim)


def unshard(x_local: torch.Tensor, *, group=None, layout: str = "zigzag", dim: int = 2) -> torch.Tensor:
    """Every rank's piece, put back in sequence order along ``dim``, on every rank (all_gather).

    The inverse of ``shard``.  Differentiable, with torch.distributed.nn's all_gather rule: the gradient
    of a rank's piece is the sum over ranks of the gradient of its rows."""
    g = _cp.resolve_group(group)
    fields, error = None, None
    try:
        layout = _cp.check_layout(layout)
        if not isinstance(x_local, torch.Tensor):
            raise TypeError(f"x_local must be a torch.Tensor, got {type(x_local).__name__}")
        dim = _check_dim(dim, x_local.dim(), "x_local")
        if layout == "zigzag" and x_local.shape[dim] % 2:
            raise ValueError(f"x_local: a zigzag piece holds two equal chunks, so its length along dim {dim} must "
                             f"be even, got {x_local.shape[dim]}")
        fields = [("the number of dims of x_local", x_local.dim()), ("dim", dim),
                  ("layout", _cp.LAYOUTS.index(layout)), ("x_local's dtype", _cp.dtype_id(x_local.dtype))]
        fields += [(f"x_local.shape[{i}]", s) for i, s in enumerate(x_local.shape[:_cp.FIELDS_MAX - 6])]
    except (TypeError, ValueError) as e:
        error = e
    _cp.agree(g, "unshard", fields, error)
    return _Unshard.apply(x_local, g, layout, dim)


def _check_dim(dim, ndim: int, name: str) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if not -ndim <= dim < ndim:
        raise ValueError(f"dim {dim} is out of range for {name} with {ndim} dims")
    return dim % ndim


def _gather(x, g, layout, dim):
    parts = _cp.all_gather_dim(x, g)
    if layout == "contiguous":
        return torch.cat(parts, dim)
    # zigzag: rank r's piece is chunks r and 2W-1-r; chunk i < W comes first in rank i's piece
    W, c = g.world, x.shape[dim] // 2
    order = [parts[i].narrow(dim, 0, c) for i in range(W)]
    order += [parts[2 * W - 1 - i].narrow(dim, c, c) for i in range(W, 2 * W)]
    return torch.cat(order, dim)


def _local_rows(x, g, layout, dim):
    n = _cp.n_chunks(layout, g.world)
    c = x.shape[dim] // n
    return torch.cat([x.narrow(dim, i * c, c) for i in _cp.chunks_of(layout, g.rank, g.world)], dim)


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g, layout, dim):
        ctx.args = (g, layout, dim)
        return _gather(x, g, layout, dim)

    @staticmethod
    def backward(ctx, grad):
        g, layout, dim = ctx.args
        return _SumLocalRows.apply(grad, g, layout, dim), None, None, None


class _SumLocalRows(torch.autograd.Function):
    """unshard's backward (the gradient summed over ranks, then this rank's rows) as a function of its
    own, so that it is differentiable too (create_graph=True): its adjoint is unshard."""

    @staticmethod
    def forward(ctx, grad, g, layout, dim):
        ctx.args = (g, layout, dim)
        return _local_rows(_cp.all_reduce_sum(grad, g), g, layout, dim)

    @staticmethod
    def backward(ctx, grad):
        g, layout, dim = ctx.args
        return _Unshard.apply(grad, g, layout, dim), None, None, None


# ---- the checks both attention schemes share ------------------------------------------------------

def _options(q, k, v, causal, scale, window, softcap, layout):
    """Validates one rank's arguments; returns (B, Hq, Sq, D, Hkv, Sk, Dv, causal, wl, wr, scale, softcap,
    layout) with causal as 0/1/2 and scale resolved."""
    B, Hq, Sq, D, Hkv, Sk, Dv = _validate.check_qkv(q, k, v)
    causal_i = _validate.check_causal(causal)
    wl, wr = _validate.check_window(window)
    scale_f = _validate.check_scale(scale, D)
    softcap_f = _validate.check_softcap(softcap)
    layout = _cp.check_layout(layout)
    return B, Hq, Sq, D, Hkv, Sk, Dv, causal_i, wl, wr, scale_f, softcap_f, layout


def _fields(q, opts, extra=(), packed=False):
    B, Hq, Sq, D, Hkv, Sk, Dv, causal_i, wl, wr, scale_f, softcap_f, layout = opts
    s, h, d = (0, 1, 2) if packed else (2, 1, 3)
    return [("the batch size (q.shape[0])", B), (f"q's heads (q.shape[{h}])", Hq),
            (f"q's local length (q.shape[{s}])", Sq), (f"the head dim (q.shape[{d}])", D),
            (f"k's heads (k.shape[{h}])", Hkv), (f"k's local length (k.shape[{s}])", Sk),
            (f"v's head dim (v.shape[{d}])", Dv), ("the dtype", _cp.dtype_id(q.dtype)),
            ("the device type", {"cpu": 0, "cuda": 1}.get(q.device.type, 2)), ("causal", causal_i),
            ("window left", wl), ("window right", wr), ("scale", scale_f), ("softcap", softcap_f),
            ("layout", _cp.LAYOUTS.index(layout))] + list(extra)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    causal: Causal = False,
    layout: str = "zigzag",
    scale: Optional[float] = None,
    window: Optional[Tuple[int, int]] = None,
    softcap: float = 0.0,
    return_lse: bool = False,
    backend: Optional[str] = "auto",
):
    """Attention of this rank's query rows over the keys of every rank, K/V passed around the ring.

    Args:
        q: (B, Hq, Sq_local, D) this rank's query rows (``shard`` of the whole q); any strides.
        k: (B, Hkv, Sk_local, D), v: (B, Hkv, Sk_local, Dv): this rank's keys and values; Hq % Hkv == 0.
            Every rank's shards have the same shapes; zigzag needs even local lengths.
        group: the process group (None = the default one).  Its ranks hold the sequence's pieces in
            rank order (ring neighbours are group ranks r +- 1).
        causal, scale, window, softcap: as ``ab.attention``, on the whole sequence's positions (bottom-right
            alignment uses the whole lengths W * Sq_local and W * Sk_local).
        layout: "zigzag" or "contiguous": how the shards were cut (see ``shard``).
        return_lse: also return lse (B, Hq, Sq_local) float32 (float64 for float64 inputs), differentiable.
        backend: the kernel for each block of the forward: our "flash" or "math" ("auto" = the planner's
            choice among them).  Other names fall back to one of them with the library's usual warning, or
            raise with ATTN_BACKENDS_STRICT=1: the ring needs each block's lse.  The backward's blocks
            always run our flash backward (it takes the row's delta from the final output it is given),
            so float64 inputs get the forward only (a gradient raises ValueError).

    Returns:
        out (B, Hq, Sq_local, Dv) in q's dtype for this rank's rows, or (out, lse).

    Blocks that the causal mask or the window leaves empty are skipped; each rank's memory stays
    O(S_local): two K/V blocks and, in the backward, three float32 dK/dV buffers.  Partial results are
    merged in float32 (each block's output comes back from the kernel in q's dtype).  Rows with no
    visible key are 0 with lse -inf, as everywhere in the library.
    """
    g = _cp.resolve_group(group)
    fields = error = None
    try:
        opts = _options(q, k, v, causal, scale, window, softcap, layout)
        Sq, Sk, layout_ = opts[2], opts[5], opts[12]
        if not isinstance(return_lse, bool):
            raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
        if layout_ == "zigzag":
            for name, n in (("q", Sq), ("k", Sk)):
                if n % 2:
                    raise ValueError(f"{name}: a zigzag shard holds two equal chunks, so its local length must be "
                                     f"even, got {n} (shard the sequence with abd.shard, or pad it to a multiple "
                                     f"of {2 * g.world})")
        need_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        kernel = _ring_kernel(q, k, v, backend, causal, window, softcap, opts[10], need_grad)
        fields = _fields(q, opts, [("whether the call needs a gradient", need_grad),
                                   ("the kernel", ("flash", "math").index(kernel))])
    except (TypeError, ValueError, RuntimeError) as e:
        error = e
    _cp.agree(g, "ring_attention", fields, error)
    B, Hq, Sq, D, Hkv, Sk, Dv, causal_i, wl, wr, scale_f, softcap_f, layout = opts
    cfg = _ring.Config(g, layout, kernel, causal_i, scale_f, wl, wr, softcap_f, Sq * g.world, Sk * g.world,
                       deterministic=torch.are_deterministic_algorithms_enabled())
    if need_grad:
        out, lse = _ring.RingFunction.apply(q, k, v, cfg)
    else:
        out, lse = _ring.forward(q, k, v, cfg)
    return (out, lse) if return_lse else out


def _ring_kernel(q, k, v, backend, causal, window, softcap, scale, need_grad) -> str:
    """Our kernel for the forward's blocks: the planner's choice for this call with lse, which only our
    flash and math can give.  The backward's blocks always run our flash backward (_ring.kernel_bwd
    says why), so a call that needs a gradient needs it to serve here."""
    _, sig = _dispatch.prepare(q, k, v, backend, causal, None, 0.0, scale, window, softcap, True)
    chosen = _planner.choose(sig, _planner.STRICT)
    if chosen == "eager" and q.is_cpu:
        chosen = "math"  # eager on CPU is our math kernel
    if chosen not in ("flash", "math"):
        raise ValueError(f"backend: ring attention runs our flash or math kernels (it needs each block's lse); "
                         f"the planner chose {chosen!r} for this call ({q.device.type}, {q.dtype}); "
                         "`ab.explain(q, k, v, return_lse=True)` shows why")
    if need_grad:
        _, sig = _dispatch.prepare(q, k, v, "flash", causal, None, 0.0, scale, window, softcap, True)
        why = _planner.build(sig).reasons["flash"]
        if why:
            raise ValueError(f"backend: the backward of ring attention runs our flash backward, which cannot "
                             f"serve this call: {why}")
    return chosen


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    causal: Causal = False,
    layout: str = "zigzag",
    scale: Optional[float] = None,
    window: Optional[Tuple[int, int]] = None,
    softcap: float = 0.0,
    backend: Optional[str] = "auto",
):
    """Attention over sequence shards by trading them for head shards (DeepSpeed Ulysses).

    One all_to_all gives each rank the whole sequence for Hq / W of the heads (and the K/V heads they
    use), one ``ab.attention`` call runs there with ``backend`` (any backend: the planner's usual
    choice and fallbacks), and a second all_to_all returns each rank its own rows for every head.

    Args:
        q, k, v: this rank's shards, as ``ring_attention``.  Hq must be divisible by the group's size
            W; when Hkv is not, K/V heads are repeated (only as far as needed) before the exchange.
        layout: how the shards were cut ("zigzag" by default, as ``shard``); it decides where each row
            sits in the whole sequence, which the causal mask and the window need.
        Others as ``ring_attention``.

    Returns:
        out (B, Hq, Sq_local, Dv) in q's dtype.  Differentiable.
    """
    g = _cp.resolve_group(group)
    fields = error = None
    try:
        opts = _options(q, k, v, causal, scale, window, softcap, layout)
        Hq, Sq, Hkv, Sk, layout_ = opts[1], opts[2], opts[4], opts[5], opts[12]
        if Hq % g.world:
            raise ValueError(f"q: Ulysses splits the heads over the {g.world} ranks of the group, so q's heads "
                             f"({Hq}) must be divisible by {g.world} (ring_attention has no such limit)")
        if layout_ == "zigzag":
            for name, n in (("q", Sq), ("k", Sk)):
                if n % 2:
                    raise ValueError(f"{name}: a zigzag shard holds two equal chunks, so its local length must be "
                                     f"even, got {n}")
        _check_backend_name(backend)
        fields = _fields(q, opts)
    except (TypeError, ValueError) as e:
        error = e
    _cp.agree(g, "ulysses_attention", fields, error)
    B, Hq, Sq, D, Hkv, Sk, Dv, causal_i, wl, wr, scale_f, softcap_f, layout = opts
    W = g.world
    if Hkv % W:
        # repeat each K/V head so there are lcm(Hkv, W) of them: query head h still meets the copy of its
        # own K/V head (repeat_interleave keeps GQA's h // group mapping), and lcm divides Hq
        rep = math.lcm(Hkv, W) // Hkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    qh, kh, vh = (_to_heads(t, g, layout) for t in (q, k, v))
    out = _dispatch.attention(qh, kh, vh, backend, causal, None, 0.0, scale_f, window, softcap_f, False, False)
    return _to_rows(out, g, layout)


def _check_backend_name(backend) -> None:
    """Ulysses hands backend to ab.attention only after its first all_to_all: a name one rank alone gets
    wrong must fail before the exchanges, in agree, or the other ranks wait in the second all_to_all
    until the group's timeout."""
    if backend is not None:
        from . import _names

        _names.resolve(backend)


def _order(layout: str, W: int) -> list:
    """For each chunk of the whole sequence in order, its index among the ranks' pieces laid end to end."""
    if layout == "contiguous":
        return list(range(W))
    # rank r's piece is chunks (r, 2W-1-r): piece slot 2r holds chunk r, slot 2r+1 chunk 2W-1-r
    return [2 * i if i < W else 2 * (2 * W - 1 - i) + 1 for i in range(2 * W)]


def _to_heads(x, g, layout):
    """(B, H, S_local, D) rows of every head -> (B, H / W, S, D): all the rows of this rank's heads."""
    B, H, S, D = x.shape
    W = g.world
    blocks = x.reshape(B, W, H // W, S, D).transpose(0, 1)  # block j: the heads rank j will own
    got = _cp.all_to_all(blocks, g)  # (W, B, H/W, S, D): block j is rank j's rows
    n = len(_order(layout, W))
    c = S * W // n
    pieces = got.reshape(W, B, H // W, n // W, c, D).permute(0, 3, 1, 2, 4, 5).reshape(n, B, H // W, c, D)
    idx = torch.tensor(_order(layout, W), device=x.device)
    return pieces.index_select(0, idx).permute(1, 2, 0, 3, 4).reshape(B, H // W, n * c, D)


def _to_rows(x, g, layout):
    """The inverse of _to_heads: (B, H / W, S, Dv) -> (B, H, S_local, Dv)."""
    B, Hw, S, Dv = x.shape
    W = g.world
    order = _order(layout, W)
    n = len(order)
    c = S // n
    chunks = x.reshape(B, Hw, n, c, Dv).permute(2, 0, 1, 3, 4)  # (n, B, H/W, c, Dv) in sequence order
    inv = [0] * n
    for chunk, slot in enumerate(order):
        inv[slot] = chunk
    pieces = chunks.index_select(0, torch.tensor(inv, device=x.device))  # slot order: rank by rank
    blocks = pieces.reshape(W, n // W, B, Hw, c, Dv).permute(0, 2, 3, 1, 4, 5).reshape(W, B, Hw, S // W, Dv)
    got = _cp.all_to_all(blocks, g)  # block j: rank j's heads for this rank's rows
    return got.transpose(0, 1).reshape(B, W * Hw, S // W, Dv)


# ---- packed (varlen) sequences ----------------------------------------------------------------------
# A packed batch (total, H, D) with cu_seqlens is sharded sequence by sequence: each sequence is cut into
# the layout's chunks (its length must divide into them) and a rank's piece is, sequence after sequence,
# its chunks of that sequence.  So every rank holds 1/W of every sequence, and under zigzag the same
# causal work.  cu_seqlens always describes the whole batch and is the same on every rank.

def _check_cu(cu_seqlens, max_seqlen, total: int, n: int, g, what: str = "the packed rows"):
    """Validates the whole batch's cu_seqlens on the host; returns the list of sequence lengths."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be a 1-D int32 tensor of length batch + 1 (as in flash-attn), got "
                         f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}")
    cu = cu_seqlens.cpu().tolist()
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    if cu[0] != 0 or any(L < 0 for L in lengths) or cu[-1] != total:
        raise ValueError(f"cu_seqlens must start at 0, never decrease and end at the whole batch's rows ({total}: "
                         f"{what}), got {cu}")
    bad = [L for L in lengths if L % n]
    if bad:
        raise ValueError(f"cu_seqlens: every sequence's length must divide into the layout's {n} equal chunks over "
                         f"{g.world} ranks, got lengths {bad} (pad each sequence to a multiple of {n})")
    if max_seqlen is not None:
        if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
            raise TypeError(f"max_seqlen must be an int, got {type(max_seqlen).__name__}")
        if lengths and max_seqlen < max(lengths):
            raise ValueError(f"max_seqlen ({max_seqlen}) is shorter than the longest sequence ({max(lengths)})")
    return lengths


def _piece_rows(lengths, layout: str, rank: int, W: int) -> torch.Tensor:
    """The whole batch's row indices of rank's piece, in the piece's order."""
    n = _cp.n_chunks(layout, W)
    rows, start = [], 0
    for L in lengths:
        c = L // n
        rows += [torch.arange(start + i * c, start + (i + 1) * c) for i in _cp.chunks_of(layout, rank, W)]
        start += L
    return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)


def _all_pieces(lengths, layout, W) -> torch.Tensor:
    """The whole batch's row of each row of every rank's piece laid end to end, rank after rank."""
    return torch.cat([_piece_rows(lengths, layout, j, W) for j in range(W)])


def _cu_fields(lengths, max_seqlen):
    # cu_seqlens must be the same everywhere: a CRC-32 of the lengths (exact in a float64), since a
    # weighted sum let different batches of one total pass ([4, 8, 4] and [8, 0, 8])
    cu_sum = zlib.crc32(b"".join(int(L).to_bytes(8, "little") for L in lengths))
    return [("the number of sequences (cu_seqlens)", len(lengths)), ("cu_seqlens (a checksum)", cu_sum),
            ("max_seqlen", max_seqlen if max_seqlen is not None else -1)]


def shard_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor, *, group=None, layout: str = "zigzag",
                 dim: int = 0) -> torch.Tensor:
    """This rank's piece of the packed rows of ``x`` along ``dim`` (0 for (total, H, D)): 1/W of every
    sequence, cut by ``layout`` (see the section comment above).  cu_seqlens (int32, batch + 1) describes
    the whole batch; every length must divide into the layout's chunks.  A new tensor; differentiable."""
    g = _cp.resolve_group(group)
    layout = _cp.check_layout(layout)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    dim = _check_dim(dim, x.dim(), "x")
    lengths = _check_cu(cu_seqlens, None, x.shape[dim], _cp.n_chunks(layout, g.world), g, f"x.shape[{dim}]")
    return x.index_select(dim, _piece_rows(lengths, layout, g.rank, g.world).to(x.device))


def unshard_varlen(x_local: torch.Tensor, cu_seqlens: torch.Tensor, *, group=None, layout: str = "zigzag",
                   dim: int = 0) -> torch.Tensor:
    """Every rank's piece put back into the whole packed batch along ``dim``, on every rank: the inverse
    of ``shard_varlen``.  Differentiable with ``unshard``'s rule (the gradient summed over ranks)."""
    g = _cp.resolve_group(group)
    fields, error = None, None
    try:
        layout = _cp.check_layout(layout)
        if not isinstance(x_local, torch.Tensor):
            raise TypeError(f"x_local must be a torch.Tensor, got {type(x_local).__name__}")
        dim = _check_dim(dim, x_local.dim(), "x_local")
        lengths = _check_cu(cu_seqlens, None, x_local.shape[dim] * g.world, _cp.n_chunks(layout, g.world), g,
                            f"W * x_local.shape[{dim}]")
        fields = [("the number of dims of x_local", x_local.dim()), ("dim", dim),
                  ("layout", _cp.LAYOUTS.index(layout)), ("x_local's dtype", _cp.dtype_id(x_local.dtype))]
        fields += [(f"x_local.shape[{i}]", s) for i, s in enumerate(x_local.shape[:_cp.FIELDS_MAX - 9])]
        fields += _cu_fields(lengths, None)
    except (TypeError, ValueError) as e:
        error = e
    _cp.agree(g, "unshard_varlen", fields, error)
    rows = _all_pieces(lengths, layout, g.world).to(x_local.device)
    mine = _piece_rows(lengths, layout, g.rank, g.world).to(x_local.device)
    return _UnshardRows.apply(x_local, g, dim, torch.argsort(rows), mine)


class _UnshardRows(torch.autograd.Function):
    """all_gather, then rows put in order by an index; the gradient summed over ranks, then this rank's rows."""

    @staticmethod
    def forward(ctx, x, g, dim, order, mine):
        ctx.args = (g, dim, order, mine)
        return torch.cat(_cp.all_gather_dim(x, g), dim).index_select(dim, order)

    @staticmethod
    def backward(ctx, grad):
        g, dim, order, mine = ctx.args
        return _SumRows.apply(grad, g, dim, order, mine), None, None, None, None


class _SumRows(torch.autograd.Function):
    """_UnshardRows' backward as a function of its own, differentiable (its adjoint is _UnshardRows)."""

    @staticmethod
    def forward(ctx, grad, g, dim, order, mine):
        ctx.args = (g, dim, order, mine)
        return _cp.all_reduce_sum(grad, g).index_select(dim, mine)

    @staticmethod
    def backward(ctx, grad):
        g, dim, order, mine = ctx.args
        return _UnshardRows.apply(grad, g, dim, order, mine), None, None, None, None


def _varlen_options(q, k, v, cu_seqlens, max_seqlen, causal, scale, window, softcap, layout, g):
    from . import _varlen

    Tq, Hq, D, Tk, Hkv, Dv = _varlen.check_qkv(q, k, v)
    if Tk != Tq:
        raise ValueError(f"k: packed context parallel attention is self-attention over one cu_seqlens, so k has "
                         f"q's rows ({Tq}), got {Tk}")
    causal_i = _validate.check_causal(causal)
    wl, wr = _validate.check_window(window)
    scale_f = _validate.check_scale(scale, D)
    softcap_f = _validate.check_softcap(softcap)
    layout = _cp.check_layout(layout)
    lengths = _check_cu(cu_seqlens, max_seqlen, Tq * g.world, _cp.n_chunks(layout, g.world), g,
                        "W * q.shape[0]")
    opts = (1, Hq, Tq, D, Hkv, Tk, Dv, causal_i, wl, wr, scale_f, softcap_f, layout)
    return opts, lengths


def ring_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    group=None,
    causal: Causal = False,
    layout: str = "zigzag",
    scale: Optional[float] = None,
    window: Optional[Tuple[int, int]] = None,
    softcap: float = 0.0,
    return_lse: bool = False,
    backend: Optional[str] = "auto",
):
    """``ring_attention`` over packed sequences (self-attention, flash-attn's varlen layout).

    Args:
        q: (T_local, Hq, D), k: (T_local, Hkv, D), v: (T_local, Hkv, Dv): this rank's piece of the packed
            batch, as ``shard_varlen`` cuts it.
        cu_seqlens: int32 (batch + 1,): the whole batch's sequences (the same on every rank); each length
            divides into the layout's chunks.  max_seqlen: the longest whole sequence.
        window: not supported here (a pair of chunks has a different offset in every sequence); a
            window raises ValueError.  ``ulysses_attention_varlen`` takes one.
        Others as ``ring_attention``; the kernel is our flash_varlen.

    Returns:
        out (T_local, Hq, Dv), or (out, lse) with lse (Hq, T_local) float32 as flash-attn's varlen.
    """
    g = _cp.resolve_group(group)
    fields = error = None
    try:
        if window is not None and tuple(window) != (-1, -1):
            raise ValueError("window: ring_attention_varlen takes no window (a pair of chunks has a different "
                             "offset in each sequence); use ulysses_attention_varlen, or ring_attention on "
                             "dense input")
        if not isinstance(return_lse, bool):
            raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
        opts, lengths = _varlen_options(q, k, v, cu_seqlens, max_seqlen, causal, scale, None, softcap, layout, g)
        n = _cp.n_chunks(opts[12], g.world)
        chunk = [L // n for L in lengths]
        cu_chunk = torch.tensor([0] + [sum(chunk[:i + 1]) for i in range(len(chunk))], dtype=torch.int32)
        need_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        _varlen_kernel(q, k, v, lengths, g.world, backend, causal, softcap, opts[10])
        fields = _fields(q, opts, [("whether the call needs a gradient", need_grad)]
                         + _cu_fields(lengths, max_seqlen), packed=True)
    except (TypeError, ValueError, RuntimeError) as e:
        error = e
    _cp.agree(g, "ring_attention_varlen", fields, error)
    _, Hq, T, D, Hkv, _, Dv, causal_i, wl, wr, scale_f, softcap_f, layout = opts
    cfg = _ring.Config(g, layout, "flash", causal_i, scale_f, -1, -1, softcap_f, 0, 0,
                       deterministic=torch.are_deterministic_algorithms_enabled(), cu=cu_chunk,
                       max_len=max(chunk, default=0))
    # chunk-major: every sequence's first chunk, then every sequence's second, so that one chunk of all
    # the sequences is a contiguous packed batch with cu_chunk
    local = [L // g.world for L in lengths]
    starts = [sum(local[:i]) for i in range(len(local))]
    perm = torch.cat([torch.arange(s + i * c, s + (i + 1) * c) for i in range(n // g.world)
                      for s, c in zip(starts, chunk)] or [torch.zeros(0, dtype=torch.long)]).to(q.device)
    qc, kc, vc = (t.index_select(0, perm) for t in (q, k, v))
    if need_grad:
        out, lse = _ring.RingFunction.apply(qc, kc, vc, cfg)
    else:
        out, lse = _ring.forward(qc, kc, vc, cfg)
    back = torch.argsort(perm)
    out, lse = out.index_select(0, back), lse.index_select(0, back).t()
    return (out, lse) if return_lse else out


def _varlen_kernel(q, k, v, lengths, W, backend, causal, softcap, scale) -> None:
    """The packed ring runs our flash_varlen kernels, forward and backward: checks the planner agrees
    (asked about this rank's piece, its sequences 1/W as long)."""
    local = [L // W for L in lengths]
    cu = torch.tensor([0] + [sum(local[:i + 1]) for i in range(len(local))], dtype=torch.int32)
    _, sig = _dispatch.prepare_varlen(q, k, v, cu, cu, max(local, default=0), max(local, default=0), backend,
                                      causal, 0.0, scale, None, softcap, True)
    chosen = _planner.choose(sig, _planner.STRICT)
    if chosen != "flash_varlen":
        raise ValueError(f"backend: packed ring attention runs our flash_varlen kernels; the planner chose "
                         f"{chosen!r} for this call ({q.device.type}, {q.dtype})")


def ulysses_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    group=None,
    causal: Causal = False,
    layout: str = "zigzag",
    scale: Optional[float] = None,
    window: Optional[Tuple[int, int]] = None,
    softcap: float = 0.0,
    backend: Optional[str] = "auto",
):
    """``ulysses_attention`` over packed sequences: q (T_local, Hq, D) etc. as ``shard_varlen`` cuts them,
    cu_seqlens and max_seqlen of the whole batch (as ``ring_attention_varlen``); one
    ``ab.attention_varlen`` call on the whole batch for Hq / W heads.  Windows are supported.
    Returns out (T_local, Hq, Dv)."""
    g = _cp.resolve_group(group)
    fields = error = None
    try:
        opts, lengths = _varlen_options(q, k, v, cu_seqlens, max_seqlen, causal, scale, window, softcap, layout, g)
        if opts[1] % g.world:
            raise ValueError(f"q: Ulysses splits the heads over the {g.world} ranks of the group, so q's heads "
                             f"({opts[1]}) must be divisible by {g.world} (ring_attention_varlen has no such limit)")
        _check_backend_name(backend)
        fields = _fields(q, opts, _cu_fields(lengths, max_seqlen), packed=True)
    except (TypeError, ValueError) as e:
        error = e
    _cp.agree(g, "ulysses_attention_varlen", fields, error)
    _, Hq, T, D, Hkv, _, Dv, causal_i, wl, wr, scale_f, softcap_f, layout = opts
    W = g.world
    if Hkv % W:
        rep = math.lcm(Hkv, W) // Hkv  # as ulysses_attention
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    rows = _all_pieces(lengths, layout, W).to(q.device)
    order = torch.argsort(rows)

    def to_heads(x):  # (T_local, H, D) -> (T, H / W, D), the whole batch in order
        Tl, H, Dx = x.shape
        got = _cp.all_to_all(x.reshape(Tl, W, H // W, Dx).transpose(0, 1), g)
        return got.reshape(W * Tl, H // W, Dx).index_select(0, order)

    qh, kh, vh = (to_heads(t) for t in (q, k, v))
    cu = cu_seqlens.to(device=q.device)
    out = _dispatch.attention_varlen(qh, kh, vh, cu, cu, max_seqlen, max_seqlen, backend, causal, 0.0, scale_f,
                                     window, softcap_f, False, False)
    pieces = out.index_select(0, rows).reshape(W, T, Hq // W, Dv)
    return _cp.all_to_all(pieces, g).transpose(0, 1).reshape(T, Hq, Dv)
