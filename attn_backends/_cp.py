"""Context-parallel plumbing shared by ring and Ulysses attention (attn_backends.distributed).

- which process group a call runs on, this process's rank in it, and its ring neighbours;
- the layouts: which chunks of the sequence each rank holds;
- ``agree``: one small all_gather before any other collective, so that a rank whose arguments are
  wrong, or differ from the others', makes every rank raise the same clear error instead of leaving
  the others blocked in a send or an all_to_all that will never be matched;
- the all_to_all with its autograd rule.

Every collective goes through torch.distributed (gloo on CPU, NCCL on GPUs): no transport of our own.
"""

from __future__ import annotations

import dataclasses
import math

import torch

LAYOUTS = ("zigzag", "contiguous")


def _dist():
    import torch.distributed as dist

    return dist


@dataclasses.dataclass(frozen=True)
class Group:
    """A process group as a call sees it: the group, this rank, the world size, ring neighbours
    (as global ranks, which isend/irecv take) and the device its collectives use."""

    pg: object
    rank: int
    world: int
    next: int
    prev: int
    device: torch.device


def resolve_group(group) -> Group:
    """The group a call runs on (None = the default group); errors name ``group``."""
    dist = _dist()
    if not dist.is_available():
        raise RuntimeError("group: this torch build has no torch.distributed")
    if not dist.is_initialized():
        raise RuntimeError("group: torch.distributed is not initialized; call "
                           "torch.distributed.init_process_group(...) first (torchrun sets up its environment)")
    pg = dist.group.WORLD if group is None else group
    non_member = getattr(dist.GroupMember, "NON_GROUP_MEMBER", None)
    if non_member is not None and (pg is non_member or (type(pg) is int and pg == non_member)):
        # what new_group returns to a process outside the group (an int in recent torch)
        raise ValueError(f"group: this process (global rank {dist.get_rank()}) is not a member of the group it "
                         "was given")
    if not isinstance(pg, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    rank = dist.get_rank(pg)
    if rank < 0:
        raise ValueError(f"group: this process (global rank {dist.get_rank()}) is not a member of the group it "
                         "was given")
    world = dist.get_world_size(pg)
    backend = str(dist.get_backend(pg))
    # a collective's tensors must live where the backend works: NCCL on the current GPU, else the CPU
    if "nccl" in backend and "gloo" not in backend:
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    return Group(pg, rank, world, dist.get_global_rank(pg, (rank + 1) % world),
                 dist.get_global_rank(pg, (rank - 1) % world), device)


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f'layout must be "zigzag" or "contiguous", got {layout!r}')
    return layout


def chunks_of(layout: str, rank: int, world: int) -> tuple:
    """The chunk indices rank holds, in its local order.  zigzag cuts the sequence into 2W chunks and
    gives rank r chunks r and 2W-1-r, so that under a causal mask every rank has the same work; contiguous
    cuts it into W chunks, rank r holding chunk r."""
    return (rank, 2 * world - 1 - rank) if layout == "zigzag" else (rank,)


def n_chunks(layout: str, world: int) -> int:
    return 2 * world if layout == "zigzag" else world


_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
FIELDS_MAX = 24


def dtype_id(dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)


def agree(g: Group, what: str, fields, error: Exception | None = None) -> None:
    """Every rank of g says what it was called with; all raise if any rank's arguments were invalid
    (its own error there, a pointer to it elsewhere) or if they differ.

    fields: [(description, number)] of what must match across ranks, the same list on every rank for
    a call that is right (None when this rank's arguments were rejected, with ``error``).  One
    all_gather of a few float64 numbers: it is what turns a mismatched shard into an error instead of
    a hang."""
    if fields is not None and len(fields) > FIELDS_MAX - 2:
        raise AssertionError("agree: too many fields")
    # one id per public call: the packed variants have their own (and more fields), so a rank in
    # unshard and another in unshard_varlen cannot pass here on one side and raise on the other
    call_id = {"ring_attention": 1, "ulysses_attention": 2, "unshard": 3, "ring_attention_varlen": 4,
               "ulysses_attention_varlen": 5, "unshard_varlen": 6}.get(what, 9)
    head = [1.0 if error is not None else 0.0, float(call_id)]
    values = [float(v) for _, v in fields] if fields is not None else []
    header = torch.tensor(head + values + [0.0] * (FIELDS_MAX - len(head) - len(values)), dtype=torch.float64,
                          device=g.device)
    if g.world > 1:
        gathered = [torch.empty_like(header) for _ in range(g.world)]
        _dist().all_gather(gathered, header, group=g.pg)
        rows = [t.tolist() for t in gathered]
    else:
        rows = [header.tolist()]
    if error is not None:
        raise error
    bad = [r for r, row in enumerate(rows) if row[0]]
    if bad:
        raise RuntimeError(f"{what}: rank{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))} of the group "
                           "rejected its arguments (the error there says why); no rank ran the call")
    others = {int(row[1]) for row in rows}
    if len(others) > 1:
        raise RuntimeError(f"{what}: the ranks of the group are not all in the same call (one is in "
                           "ring_attention, another in ulysses_attention or unshard, or their packed variants); "
                           "every rank must make the same calls in the same order")
    for i, (name, _) in enumerate(fields):
        col = [row[2 + i] for row in rows]
        if any(c != col[0] and not (math.isnan(c) and math.isnan(col[0])) for c in col):
            have = ", ".join(f"rank {r} has {_fmt(c)}" for r, c in enumerate(col))
            raise ValueError(f"{what}: the ranks of the group disagree on {name}: {have}; every rank must pass "
                             "shards of the same shape and the same options (abd.shard makes equal shards)")


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def all_to_all(x: torch.Tensor, g: Group) -> torch.Tensor:
    """all_to_all_single over dim 0 of x (W equal blocks): block j goes to rank j, and block j of the
    result came from rank j.  Differentiable: the adjoint of this exchange is the same exchange."""
    return _AllToAll.apply(x, g)


def _exchange(x: torch.Tensor, g: Group) -> torch.Tensor:
    x = x.contiguous()
    if g.world == 1:
        return x
    out = torch.empty_like(x)
    _dist().all_to_all_single(out, x, group=g.pg)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return _exchange(x, g)

    @staticmethod
    def backward(ctx, grad):
        # through the autograd.Function again, so that the gradient is itself differentiable (double
        # backward, create_graph=True): the adjoint of the exchange is the same exchange
        return _AllToAll.apply(grad, ctx.g), None


def all_gather_dim(x: torch.Tensor, g: Group) -> list:
    """Every rank's x (equal shapes, checked by ``agree`` before), in rank order."""
    x = x.contiguous()
    if g.world == 1:
        return [x]
    parts = [torch.empty_like(x) for _ in range(g.world)]
    _dist().all_gather(parts, x, group=g.pg)
    return parts


def all_reduce_sum(x: torch.Tensor, g: Group) -> torch.Tensor:
    x = x.contiguous().clone()
    if g.world > 1:
        _dist().all_reduce(x, group=g.pg)
    return x
