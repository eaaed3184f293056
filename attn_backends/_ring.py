"""Ring attention: the schedule, the block masks, and the forward and backward ring passes.

Each rank holds its query rows and its keys/values for the chunks its layout gives it (_cp.chunks_of).
The K/V of every rank travel once around the ring (rank r sends to r+1, receives from r-1), packed in
one buffer, the next block's transfer overlapped with the current block's compute.  Every (query
chunk, key chunk) pair is one of

    empty    no query of the chunk sees any key of the other: skipped;
    full     every query sees every key: one call with no mask;
    partial  a band of diagonals: one call on the rows and keys the band touches, with a causal flag
             or a top-left window that reproduces the global mask exactly (``block``).

The partial (out, lse) of each call are merged in float32 with merge_attention_states.  The backward
is a second ring pass: each block calls our backward op with the forward's final out and lse (so
P = exp(S - lse) is already the globally normalised probability), dQ accumulates locally in float32
and dK/dV accumulate in float32 in a buffer that travels with the K/V block and arrives home after
the last step.  Nothing of size S (the whole sequence) is ever held: per rank, two K/V blocks (in use,
arriving) and three dK/dV buffers (being computed, arriving, leaving) at most.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import torch

from . import _cp, _ops
from ._merge import merge_attention_states

_below_autograd = torch._C._AutoDispatchBelowAutograd


# ---- our ops, called in one place --------------------------------------------------------------
# Every call of the raw ops is in these two functions (their schemas: csrc/torch_shim.cpp), so that a
# change of signature touches nothing else.

_FWD = {"flash": _ops.ops.flash_fwd.default, "math": _ops.ops.math_fwd.default}
_BWD = {"flash": _ops.ops.flash_bwd.default}
_VARLEN_FWD, _VARLEN_BWD = _ops.ops.flash_varlen_fwd.default, _ops.ops.flash_varlen_bwd.default


def _cuda_rows(*ts):
    return [_ops.cuda_layout(t) if t is not None and t.is_cuda else t for t in ts]


def kernel_fwd(kernel: str, q, k, v, causal: int, scale: float, wl: int, wr: int, softcap: float, cu=None,
               max_len: int = 0):
    """(out in q's dtype, lse float32) of one block; no dropout (the ring takes none).
    Dense: q (B, Hq, n, D) -> out (B, Hq, n, Dv), lse (B, Hq, n).  Packed (cu: host int32 cu_seqlens
    shared by q and k, max_len their longest sequence): q (n, Hq, D) -> out (n, Hq, Dv), lse (n, Hq),
    the lse transposed from the op's (Hq, n) so that it indexes like out (as merge wants it)."""
    q, k, v = _cuda_rows(q, k, v)
    with _below_autograd():
        if cu is None:
            return _FWD[kernel](q, k, v, None, None, causal, scale, wl, wr, softcap, 0.0)[:2]
        # flash's third output, its row stats, is not passed on: each block's backward must take P
        # from the merged lse of the whole row, not from the block's own max and sum
        out, lse = _VARLEN_FWD(q, k, v, cu, cu, max_len, max_len, None, causal, scale, wl, wr, softcap, 0.0)[:2]
        return out, lse.t()


def kernel_bwd(dout, q, k, v, out, lse, dlse, causal: int, scale: float, wl: int, wr: int, softcap: float,
               deterministic: bool, cu=None, max_len: int = 0):
    """(dq, dk, dv) of one block, in the inputs' dtype, given the forward's final out and lse (laid
    out as kernel_fwd returns them).

    Always our flash backward: it takes delta_i = rowsum(dO_i * O_i) - dlse_i from the out it is given
    (the whole row's output), so a block's call is exactly that block's share of the gradient.  The
    math backward sums P dP over the call's own keys instead, which is right only for a whole row."""
    dout, q, k, v, out = _cuda_rows(dout, q, k, v, out)
    with _below_autograd():
        if cu is None:
            return _BWD["flash"](dout, q, k, v, out, lse, dlse, None, None, causal, scale, wl, wr, softcap,
                                 0.0, False, deterministic)[:3]
        lse, dlse = lse.t().contiguous(), None if dlse is None else dlse.t().contiguous()
        return _VARLEN_BWD(dout, q, k, v, out, lse, dlse, cu, cu, max_len, max_len, None, causal, scale, wl, wr,
                           softcap, 0.0, deterministic)[:3]


# ---- which (query chunk, key chunk) pairs are empty, full or partial ----------------------------

class Block(NamedTuple):
    """The part of a (query piece, key piece) pair to compute: rows r0:r1 and keys c0:c1 of the
    pieces, under (causal, window) in the kernel's own coordinates; full = no mask at all."""

    r0: int
    r1: int
    c0: int
    c1: int
    causal: int
    wl: int
    wr: int
    full: bool


def band(causal: int, wl: int, wr: int):
    """The global mask as a band of diagonals: key j is visible to query i when
    lo <= j - (i + shift) <= hi (shift = Sk - Sq for bottom-right alignment, else 0); None = unbounded."""
    lo = -wl if wl >= 0 else None
    hi = wr if wr >= 0 else None
    if causal:
        hi = 0 if hi is None else min(hi, 0)
    return lo, hi


def block(qo: int, nq: int, ko: int, nk: int, lo, hi) -> Optional[Block]:
    """The call for query rows qo:qo+nq against keys ko:ko+nk (global positions, the query's already
    shifted by the alignment) under the band (lo, hi); None when no query sees any key.

    In the pieces' own coordinates the band is lo + d <= j - i <= hi + d with d = qo - ko.  The kernel
    takes a top-left window (left, right >= 0, or -1 = unbounded), i.e. bands containing the main
    diagonal; a band that does not is first moved onto it by dropping the leading rows that see nothing
    (when it lies below: hi + d < 0) or the leading keys nobody sees (above: lo + d > 0).  Trailing rows
    and keys that nothing reaches are dropped too, which only saves work."""
    if nq <= 0 or nk <= 0:
        return None
    d = qo - ko
    blo = None if lo is None else lo + d
    bhi = None if hi is None else hi + d
    if (bhi is not None and bhi < -(nq - 1)) or (blo is not None and blo > nk - 1):
        return None
    if (blo is None or blo <= -(nq - 1)) and (bhi is None or bhi >= nk - 1):
        return Block(0, nq, 0, nk, 0, -1, -1, True)
    r0 = max(0, -bhi) if bhi is not None else 0
    c0 = max(0, blo) if blo is not None else 0
    r1 = min(nq, nk - blo) if blo is not None else nq
    c1 = min(nk, nq + bhi) if bhi is not None else nk
    # at most one of r0, c0 is positive (blo <= bhi), so the moved band contains the diagonal
    lo2 = None if blo is None else blo - c0 + r0
    hi2 = None if bhi is None else bhi - c0 + r0
    n_q, n_k = r1 - r0, c1 - c0
    if (lo2 is None or lo2 <= -(n_q - 1)) and (hi2 is None or hi2 >= n_k - 1):
        return Block(r0, r1, c0, c1, 0, -1, -1, False)
    wl = -1 if lo2 is None or lo2 <= -(n_q - 1) else -lo2
    wr = -1 if hi2 is None or hi2 >= n_k - 1 else hi2
    if wl == -1 and wr == 0:
        return Block(r0, r1, c0, c1, 1, -1, -1, False)  # plain causal: the kernels' own causal path
    return Block(r0, r1, c0, c1, 0, wl, wr, False)


@dataclasses.dataclass(frozen=True)
class Config:
    """One ring call: the group, the layout, and the attention options in the kernels' terms."""

    g: _cp.Group
    layout: str
    kernel: str  # the forward's blocks: "flash" or "math" (the backward's are always flash: kernel_bwd)
    causal: int  # 0, 1 top-left, 2 bottom-right
    scale: float
    wl: int
    wr: int
    softcap: float
    Sq: int  # whole (unsharded) lengths (packed: unused)
    Sk: int
    deterministic: bool = False
    cu: Optional[torch.Tensor] = None  # packed: host int32 cu_seqlens of one chunk of every sequence
    max_len: int = 0  # packed: the longest such chunk
    compute: bool = True  # benchmarks only: run the schedule without the kernels,
    communicate: bool = True  # or without the transfers (benchmarks/bench_context_parallel.py)


class Call(NamedTuple):
    """One kernel call of a ring step: local query rows q0:q1 against local key rows k0:k1 of the block."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: int
    wl: int
    wr: int


def plan_step_packed(cfg: Config, src: int, nq_local: int, nk_local: int) -> list:
    """The kernel calls of a packed ring step.  The local rows are chunk-major (every sequence's first
    chunk, then every sequence's second: distributed._chunk_major), so chunk slot i of all the
    sequences is one packed call with cfg.cu.  A sequence's chunks all have one length, so with no
    window a pair is empty, full or its diagonal, whatever the sequence: one call serves every sequence.
    Pairs are not joined: a sequence's rows in two slots are not adjacent."""
    W = cfg.g.world
    qc = _cp.chunks_of(cfg.layout, cfg.g.rank, W)
    kc = _cp.chunks_of(cfg.layout, src, W)
    cq, ck = nq_local // len(qc), nk_local // len(kc)
    calls = []
    for i, a in enumerate(qc):
        for j, b in enumerate(kc):
            if cfg.causal and a < b:
                continue
            calls.append(Call(i * cq, (i + 1) * cq, j * ck, (j + 1) * ck, 1 if cfg.causal and a == b else 0, -1, -1))
    return calls


def plan_step(cfg: Config, src: int, nq_local: int, nk_local: int) -> list:
    """The kernel calls of rank cfg.g.rank against the K/V block of rank src.

    Blocks are joined where that is exact: when every pair is full, one call for all local rows and keys;
    else a row of full pairs is one call over every key of the block, or a column of full pairs one
    call over every local row (with zigzag under a causal mask that leaves 3 calls at the first step,
    where a rank meets its own keys, and 1 at every other)."""
    W = cfg.g.world
    qc = _cp.chunks_of(cfg.layout, cfg.g.rank, W)
    kc = _cp.chunks_of(cfg.layout, src, W)
    cq, ck = nq_local // len(qc), nk_local // len(kc)
    shift = cfg.Sk - cfg.Sq if cfg.causal == 2 else 0
    lo, hi = band(cfg.causal, cfg.wl, cfg.wr)
    grid = [[block(a * cq + shift, cq, b * ck, ck, lo, hi) for b in kc] for a in qc]
    full = [[bl is not None and bl.full for bl in row] for row in grid]
    if all(all(row) for row in full):
        return [Call(0, nq_local, 0, nk_local, 0, -1, -1)]
    calls, done = [], set()
    full_rows = [i for i, row in enumerate(full) if all(row)]
    full_cols = [j for j in range(len(kc)) if all(full[i][j] for i in range(len(qc)))]
    for i in full_rows:
        calls.append(Call(i * cq, (i + 1) * cq, 0, nk_local, 0, -1, -1))
        done.update((i, j) for j in range(len(kc)))
    if not full_rows:
        for j in full_cols:
            calls.append(Call(0, nq_local, j * ck, (j + 1) * ck, 0, -1, -1))
            done.update((i, j) for i in range(len(qc)))
    for i, row in enumerate(grid):
        for j, bl in enumerate(row):
            if bl is None or (i, j) in done:
                continue
            calls.append(Call(i * cq + bl.r0, i * cq + bl.r1, j * ck + bl.c0, j * ck + bl.c1, bl.causal, bl.wl,
                              bl.wr))
    return calls


# ---- the ring passes -----------------------------------------------------------------------------

def _send_recv(buf: torch.Tensor, cfg: Config, tag: int):
    """Posts the send of buf to the next rank and the receive of the same-sized buffer from the
    previous one; returns (the buffer being filled, the requests)."""
    if not cfg.communicate:
        return buf, []
    import torch.distributed as dist

    recv = torch.empty_like(buf)
    ops = [dist.P2POp(dist.isend, buf, cfg.g.next, cfg.g.pg, tag),
           dist.P2POp(dist.irecv, recv, cfg.g.prev, cfg.g.pg, tag)]
    return recv, dist.batch_isend_irecv(ops)


def _wait(reqs) -> None:
    for r in reqs:
        r.wait()


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def _unpack(buf: torch.Tensor, k_shape, v_shape):
    nk = k_shape.numel()
    return buf[:nk].view(k_shape), buf[nk:].view(v_shape)


_TAG_KV, _TAG_DKV = 1, 2


def forward(q, k, v, cfg: Config):
    """(out in q's dtype, lse float32) of this rank's rows: dense (B, Hq, Sq_local, Dv) and
    (B, Hq, Sq_local); packed (T_local, Hq, Dv) and (T_local, Hq)."""
    packed = cfg.cu is not None
    dim = 0 if packed else 2  # the sequence dim of q, k, v, out and lse alike
    nq, nk, Dv = q.shape[dim], k.shape[dim], v.shape[-1]
    acc_dtype = _ops.lse_dtype(q.dtype)  # float32 (float64 for float64 inputs)
    if packed:
        acc = torch.zeros(nq, q.shape[1], Dv, dtype=acc_dtype, device=q.device)
        acc_lse = torch.full((nq, q.shape[1]), float("-inf"), dtype=acc_dtype, device=q.device)
    else:
        B, Hq = q.shape[:2]
        acc = torch.zeros(B, nq, Hq, Dv, dtype=acc_dtype, device=q.device).transpose(1, 2)
        acc_lse = torch.full((B, Hq, nq), float("-inf"), dtype=acc_dtype, device=q.device)
    plan = plan_step_packed if packed else plan_step
    kv, reqs = _pack(k, v), []
    W, r = cfg.g.world, cfg.g.rank
    for step in range(W):
        if step < W - 1:
            nxt, reqs = _send_recv(kv, cfg, _TAG_KV)
        kb, vb = _unpack(kv, k.shape, v.shape)
        for c in (plan(cfg, (r - step) % W, nq, nk) if cfg.compute else ()):
            rows = lambda t: t.narrow(dim, c.q0, c.q1 - c.q0)  # noqa: E731
            keys = lambda t: t.narrow(dim, c.k0, c.k1 - c.k0)  # noqa: E731
            o, lse = kernel_fwd(cfg.kernel, rows(q), keys(kb), keys(vb), c.causal, cfg.scale, c.wl, c.wr,
                                cfg.softcap, cfg.cu, cfg.max_len)
            merged, merged_lse = merge_attention_states(rows(acc), rows(acc_lse), o.to(acc_dtype), lse)
            rows(acc).copy_(merged)
            rows(acc_lse).copy_(merged_lse)
        if step < W - 1:
            _wait(reqs)
            kv = nxt
    return acc.to(q.dtype), acc_lse


def backward(dout, q, k, v, out, lse, dlse, cfg: Config):
    """(dq, dk, dv) of this rank's q, k, v, in their dtype (out, lse as forward returned them)."""
    packed = cfg.cu is not None
    dim = 0 if packed else 2
    nq, nk = q.shape[dim], k.shape[dim]
    plan = plan_step_packed if packed else plan_step
    acc_dtype = _ops.lse_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    kv, kv_reqs = _pack(k, v), []
    sent = None
    dkv, dkv_reqs = None, []  # the dK/dV accumulator of the block in hand, float32, travelling with it
    W, r = cfg.g.world, cfg.g.rank
    for step in range(W):
        if step < W - 1:
            kv_next, kv_reqs = _send_recv(kv, cfg, _TAG_KV)
        kb, vb = _unpack(kv, k.shape, v.shape)
        part = torch.zeros(kv.shape, dtype=acc_dtype, device=kv.device)
        dkb, dvb = _unpack(part, k.shape, v.shape)
        for c in (plan(cfg, (r - step) % W, nq, nk) if cfg.compute else ()):
            rows = lambda t: None if t is None else t.narrow(dim, c.q0, c.q1 - c.q0)  # noqa: E731
            keys = lambda t: t.narrow(dim, c.k0, c.k1 - c.k0)  # noqa: E731
            gq, gk, gv = kernel_bwd(rows(dout), rows(q), keys(kb), keys(vb), rows(out), rows(lse), rows(dlse),
                                    c.causal, cfg.scale, c.wl, c.wr, cfg.softcap, cfg.deterministic, cfg.cu,
                                    cfg.max_len)
            rows(dq).add_(gq)
            keys(dkb).add_(gk)
            keys(dvb).add_(gv)
        # this block's accumulator arrives from the previous rank while the block above is computed
        _wait(dkv_reqs)
        dkv = part if dkv is None else dkv.add_(part)
        # send it on: after the last step it goes to the block's owner, the next rank
        if W > 1:
            sent = dkv  # kept alive until its send is waited for
            dkv, dkv_reqs = _send_recv(sent, cfg, _TAG_DKV)
        if step < W - 1:
            _wait(kv_reqs)
            kv = kv_next
    _wait(dkv_reqs)
    del sent
    dk, dv = _unpack(dkv, k.shape, v.shape)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class RingFunction(torch.autograd.Function):
    """Ring attention as one autograd node: the forward ring pass, and the backward ring pass fed with
    the forward's final out and lse."""

    @staticmethod
    def forward(ctx, q, k, v, cfg):
        out, lse = forward(q, k, v, cfg)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = cfg
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        # create_graph=True with something that requires grad: the ring's backward (our kernels and
        # collectives) is not itself differentiable, so a second derivative would silently be 0; the
        # gradients returned then raise a clear error if anything differentiates them
        recorded = [t for t in (q, k, v, dout, dlse) if t is not None and t.requires_grad]
        with torch.no_grad():
            if dout is None:
                dout = torch.zeros_like(out)
            grads = backward(dout, q, k, v, out, lse, dlse, ctx.cfg)
        if torch.is_grad_enabled() and recorded:
            grads = _no_second_derivative(grads, recorded)
        return (*grads, None)


def _no_second_derivative(grads, recorded):
    """grads, unchanged in value, behind a node that raises when differentiated.  The node hangs off
    what the backward was recorded for (an exact 0: the sum of an empty slice of each), so that a
    second derivative towards any of them reaches it and raises instead of silently being 0."""
    anchor = sum(t.flatten()[:0].sum() for t in recorded)
    return torch._C._functions.DelayedError(
        b"ring attention (attn_backends.distributed.ring_attention, ring_attention_varlen) has no second "
        b"derivative: its backward is a second ring pass of our kernels, which autograd cannot differentiate. "
        b"Use ulysses_attention (any order), or take the gradient without create_graph=True",
        len(grads))(*(g + anchor.to(g.dtype) for g in grads))
