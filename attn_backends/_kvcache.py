"""attention_with_kvcache: flash-attn's ``flash_attn_with_kvcache`` on our backends (docs/decode.md).

One call validates its arguments, asks the planner which backend serves a KV-cache call of its kind
(the call signature's layout field is 2), and runs it:

- ``paged_attention``: the CPU decode kernel (csrc/cpu/decode_cpu.c) writes the new keys and values
  into the cache and attends in one op, for every query length: several tokens (16 query rows per
  KV head or more) run its tiled products.  Only where it multiplies a bfloat16 cache in bfloat16
  (AVX512_BF16), which the tiled products do not, queries longer than one of its tiles (more than
  64 query rows per KV head; more than 48 over a long dense cache that flash reads in place,
  csrc/cpu/decode_cpu.h ab_kvcache_cpu_max_rows) go to flash over a gathered view instead.
  On CUDA (unless ATTN_BACKENDS_CUDA_DECODE=0), and on the CPU under the CUDA emulation, the same
  op runs the CUDA decode kernel (csrc/cuda/decode.cu) for every query length.
- ``flash``: the cache is gathered into a dense (B, Hkv, S, D) view and our flash kernel attends with
  a bool mask that carries leftpad, sequence ends, causal and window; ALiBi and sinks are the
  kernel's own arguments (with ALiBi each row's keys are first moved to end at S, so that the
  kernel's bottom-right alignment is the row's own).
- ``sdpa``: torch SDPA in the call's dtype, over the cache's own view, for the calls that need no
  mask (in_place), and on the CPU for those that need only a bottom-right causal mask of their sizes
  (mask_kind 2), which it builds; the others fall back to the kernel.  First under auto on CUDA in
  16-bit types for the in_place calls, and on a CPU with AMX-BF16 for bfloat16 chunked prefill; on the
  CPU it serves only that chunked prefill (csrc/ab_planner.c torch_first_kv and why_not).
- ``math`` and ``eager``: the same gathered view, attended in float64 with plain torch ops (any device;
  float32 on MPS, which has no float64).

The gathered paths write the cache with torch ops, exactly where the kernel does, and check the
values of the index tensors on the host first; the kernel checks them itself.  Either way nothing is
written when a check fails.
"""

from __future__ import annotations

import contextlib
import math
import operator
from typing import NamedTuple, Optional

import torch

from . import _C, _planner
from ._names import ID, resolve
from ._ops import ops
from ._providers.ours import read_guards, read_ok
from ._providers.torch_sdpa import ORIGINAL_SDPA
from ._validate import _float_range_error, as_int, check_sinks, finite
from ._validate import as_real as _real, is_bool as _is_bool, type_name as _kind

_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INDEX = (torch.int32, torch.int64)
_below_autograd = torch._C._AutoDispatchBelowAutograd
_is_compiling = torch.compiler.is_compiling
# what torch.autograd.graph.increment_version calls: the version bump of a cache the kernel wrote into
_increment_version = torch._C._increment_version
# the fast path's (csrc/ab_direct.c kvcache()) guards are _direct_ok's, ours.py's read_guards (each returns
# something false when no mode, trace or transform is active; inference mode may be on), and its writes
# get the same version bumps
_C.set_kvcache_guards(read_guards, _increment_version)
_INVALID = "attn_backends: invalid argument: "


class KVCall(NamedTuple):
    """A validated call.  seqlen: tokens in every cache row when seqlens is None (-1: the whole
    cache).  causal is bottom-right; (wl, wr) the window, -1 unbounded."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k: Optional[torch.Tensor]
    v: Optional[torch.Tensor]
    cos: Optional[torch.Tensor]
    sin: Optional[torch.Tensor]
    seqlens: Optional[torch.Tensor]
    seqlen: int
    batch_idx: Optional[torch.Tensor]
    leftpad: Optional[torch.Tensor]
    block_table: Optional[torch.Tensor]
    alibi: Optional[torch.Tensor]
    scale: float
    causal: bool
    wl: int
    wr: int
    softcap: float
    interleaved: bool
    num_splits: int
    sinks: Optional[torch.Tensor] = None


# ---- argument checks ---------------------------------------------------------------------------

def _tensor(name, t, ndim, layout, device, dtypes=None, what=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} must be {what}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on q's device ({device}), got {t.device}")


def _index(name, t, B, device):
    _tensor(name, t, 1, "(B,)", device, _INDEX, "int32 (or int64)")
    if t.shape[0] != B:
        raise ValueError(f"{name} must have shape (B,) = ({B},), got {tuple(t.shape)}")


def _int(name, x, least=None):
    """An integer argument as flash-attn takes it (_validate.as_int: a Python or NumPy int, or a 0-d
    integer tensor; bools are refused), at least `least`."""
    x = as_int(x, name)
    if least is not None and x < least:
        raise ValueError(f"{name} must be >= {least}, got {x}")
    return x


def overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two positions of t may share memory: its dims of size > 1 by stride, each stride must pass the
    furthest element the smaller ones reach (csrc/ab_params.c, the same rule).  A zero stride fails it."""
    reach = 0
    for stride, size in sorted((t.stride(d), t.shape[d]) for d in range(t.dim()) if t.shape[d] > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def _byte_span(t: torch.Tensor) -> tuple:
    lo = t.data_ptr()
    return lo, lo + t.element_size() * (1 + sum(st * (n - 1) for st, n in zip(t.stride(), t.shape)))


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b are views of one storage whose byte ranges meet (eager only)."""
    if a.numel() == 0 or b.numel() == 0 or a._is_zerotensor() or b._is_zerotensor():
        return False  # a zero tensor has no memory
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a0, a1), (b0, b1) = _byte_span(a), _byte_span(b)
    return a0 < b1 and b0 < a1


def window_pair(window_size) -> tuple:
    """flash-attn's window_size as (left, right): a pair of ints, any negative side unbounded (-1)."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}")
    return max(_int("window_size[0]", window_size[0]), -1), max(_int("window_size[1]", window_size[1]), -1)


def _flag(name, x, what=""):
    """A bool argument: True/False, a NumPy bool, or an int 0 or 1 (flash-attn's binding converts
    them the same way)."""
    if _is_bool(x):
        return bool(x)
    try:
        v = operator.index(x)
    except TypeError:
        raise TypeError(f"{name} must be a bool{what}, got {_kind(x)}") from None
    if v not in (0, 1):
        raise ValueError(f"{name} must be a bool{what} (or 0 or 1), got {v}")
    return bool(v)


def capacity(k_cache: torch.Tensor, block_table) -> int:
    """Positions a cache row holds: S_cache, or max_blocks * block_size for a paged cache."""
    return k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)


def check(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
          block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
          num_splits, sinks=None) -> KVCall:
    """Types, shapes, dtypes and devices of every argument (TypeError / ValueError naming it); the
    values of the index tensors are checked where they are read (see the module docstring)."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q must be 4-D (B, Sq, Hq, D), got shape {tuple(q.shape)}")
    if q.dtype not in _FLOAT:
        raise TypeError(f"q must be float16, bfloat16, float32 or float64, got {q.dtype}")
    dev, dt = q.device, q.dtype
    B, Sq, Hq, D = q.shape
    if D < 1:
        raise ValueError(f"q's head dim (its last dim, D) must be at least 1, got shape {tuple(q.shape)}")
    paged = block_table is not None
    layout = "(num_blocks, block_size, Hkv, D)" if paged else "(B_cache, S_cache, Hkv, D)"
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        _tensor(name, c, 4, layout, dev, (dt,), f"{dt} like q")
        if c.stride(-1) != 1 and c.numel():
            raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides {c.stride()}")
        if not _is_compiling() and (c.is_neg() or c._is_zerotensor()):  # read and written in place, as memory
            raise ValueError(f"{name} is a negative view or a zero tensor (its values are not its memory), which "
                             "a cache read and written in place cannot be: pass .resolve_neg() or .clone() of it")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    Hkv = k_cache.shape[2]
    if k_cache.shape[3] != D:
        raise ValueError(f"k_cache's head dim ({k_cache.shape[3]}) must equal q's ({D})")
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"the number of query heads ({Hq}) must be a multiple of the cache's key/value heads ({Hkv})")
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (the new keys and values to append)")
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            _tensor(name, t, 4, "(B, Sk_new, Hkv, D)", dev, (dt,), f"{dt} like q")
            if t.shape[0] != B or t.shape[2:] != (Hkv, D):
                raise ValueError(f"{name} must have shape (B, Sk_new, Hkv, D) = ({B}, Sk_new, {Hkv}, {D}), "
                                 f"got {tuple(t.shape)}")
        if v.shape != k.shape:
            raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            shared = [d for d in range(3) if c.stride(d) == 0 and c.shape[d] > 1] if k.shape[1] else []
            if shared:  # as ab_kvcache_params_check (csrc/ab_params.c); torch refuses such writes too
                raise ValueError(f"{name} is written in place (k and v are given) but has a zero stride in dim "
                                 f"{shared[0]}: an expanded view, whose positions share memory; pass a cache that "
                                 "owns its memory")
            if k.shape[1] and not _is_compiling() and overlaps_itself(c):  # as ab_kvcache_params_check (eager)
                raise ValueError(f"{name} is written in place (k and v are given) but its strides {c.stride()} "
                                 "make positions share memory (an overlapping view); pass a cache that owns its "
                                 "memory")
        # new rows that are a view of a cache (tokens moved within it: a speculative rollback) are read
        # before any is written, as if copied first (row by row, a write landed on a row still to be read)
        # (while tracing, the memory cannot be asked about: both are copied, a few rows)
        k, v = (t.clone() if _is_compiling() or _shares_memory(t, k_cache) or _shares_memory(t, v_cache) else t
                for t in (k, v))
    seqlens, seqlen = None, -1
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("cache_seqlens is required when k and v are given (it says where to write them)")
    elif isinstance(cache_seqlens, torch.Tensor):
        _index("cache_seqlens", cache_seqlens, B, dev)
        seqlens = cache_seqlens
    else:
        seqlen = _int("cache_seqlens", cache_seqlens, 0)
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None:
        if k is None:
            raise ValueError("rotary_cos and rotary_sin need the new k and v (they rotate the appended keys and q)")
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            _tensor(name, t, 2, "(seqlen_ro, rotary_dim / 2)", dev, _FLOAT, "floating point")
        if rotary_sin.shape != rotary_cos.shape:
            raise ValueError(f"rotary_sin must have rotary_cos's shape {tuple(rotary_cos.shape)}, "
                             f"got {tuple(rotary_sin.shape)}")
        if not 1 <= rotary_cos.shape[1] <= D // 2:
            raise ValueError(f"rotary_dim = 2 * rotary_cos.shape[1] = {2 * rotary_cos.shape[1]} must be in [2, D = {D}]")
    if cache_batch_idx is not None:
        if paged:
            raise ValueError("cache_batch_idx does not apply to a paged cache (block_table maps the rows)")
        _index("cache_batch_idx", cache_batch_idx, B, dev)
    elif not paged and k_cache.shape[0] < B:
        raise ValueError(f"k_cache has {k_cache.shape[0]} rows for a batch of {B}: "
                         "give cache_batch_idx to map batch rows to cache rows")
    if cache_leftpad is not None:
        _index("cache_leftpad", cache_leftpad, B, dev)
    if paged:
        _tensor("block_table", block_table, 2, "(B, max_blocks)", dev, _INDEX, "int32 (or int64)")
        if block_table.shape[0] != B:
            raise ValueError(f"block_table must have shape (B, max_blocks) with B = {B}, got {tuple(block_table.shape)}")
        if k_cache.shape[1] < 1:
            raise ValueError("a paged cache needs block_size = k_cache.shape[1] >= 1")
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor):
            raise TypeError(f"alibi_slopes must be a torch.Tensor, got {type(alibi_slopes).__name__}")
        if tuple(alibi_slopes.shape) not in ((Hq,), (B, Hq)):
            raise ValueError(f"alibi_slopes must have shape (Hq,) = ({Hq},) or (B, Hq) = ({B}, {Hq}), "
                             f"got {tuple(alibi_slopes.shape)}")
        _tensor("alibi_slopes", alibi_slopes, alibi_slopes.dim(), "", dev, (torch.float32,), "float32")
    if sinks is not None:
        check_sinks(sinks, q, Hq)
    if softmax_scale is None:
        scale = D ** -0.5
    else:
        scale = _real("softmax_scale", softmax_scale, "a float or None")
        if not finite(scale):
            raise ValueError(f"softmax_scale must be finite, got {scale}")
    causal = _flag("causal", causal, " (bottom-right aligned, as flash-attn)")
    wl, wr = window_pair(window_size)
    # a side of the cache's capacity or more hides no key: unbounded, as flash-attn makes it (the kernels
    # then never add a side near 2**63 to a position)
    cap = capacity(k_cache, block_table)
    wl, wr = (-1 if wl >= cap else wl), (-1 if wr >= cap else wr)
    snew = k.shape[1] if k is not None else 0
    if seqlen > cap - snew:  # an int's range, here only (past int64 it cannot reach the kernels); as they word it
        raise ValueError(f"cache_seqlens = {seqlen} is outside the cache: with {snew} new tokens it must be in "
                         f"[0, {cap - snew}]")
    softcap = _real("softcap", softcap, "a float")
    if not (softcap >= 0.0 and finite(softcap)):
        raise ValueError(f"softcap must be >= 0 and finite (0 disables it), got {softcap}")
    _float_range_error("softmax_scale", scale, dt)  # scores in float32: a factor past its range is inf there
    _float_range_error("softcap", softcap, dt)
    rotary_interleaved = _flag("rotary_interleaved", rotary_interleaved)
    num_splits = max(_int("num_splits", num_splits), 0)  # as flash-attn: 0 or less picks the count
    if num_splits >= 2**31:  # flash-attn's is a C int; ours are capped at the keys anyway
        raise ValueError(f"num_splits must be below 2**31 (0 picks the count), got {num_splits}")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k_cache, v_cache, k, v, sinks,
                                                                                   rotary_cos, rotary_sin,
                                                                                   alibi_slopes)):
        raise RuntimeError("attention_with_kvcache has no backward (inference only): call it under "
                           "torch.no_grad() or torch.inference_mode(), or with tensors that do not require grad")
    return KVCall(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, seqlens, seqlen, cache_batch_idx,
                  cache_leftpad, block_table, alibi_slopes, scale, causal, wl, wr, softcap, rotary_interleaved,
                  num_splits, sinks)


# ---- planning ----------------------------------------------------------------------------------

_chosen = ({}, {})
_PAGED = ID["paged_attention"]
_CPU = _planner.DEVICE_IDS["cpu"]
_PLAIN = (ID["auto"], _PAGED)  # requests under which paged_attention serving a call is not a fallback


def _plain(c: KVCall) -> bool:
    """A dense cache whose rows all hold the same, host-known number of tokens (an int cache_seqlens or
    none), without leftpad, window or ALiBi: torch can read it in place."""
    return (c.seqlens is None and c.block_table is None and c.batch_idx is None and c.leftpad is None
            and c.wl < 0 and c.wr < 0 and c.alibi is None)


def in_place(c: KVCall) -> bool:
    """Whether attending to the cache as a dense call needs neither a mask nor the index values: _plain,
    causal only for one query token (then bottom-right causal hides nothing)."""
    return _plain(c) and (not c.causal or c.q.shape[1] <= 1)


def mask_kind(c: KVCall) -> int:
    """The call descriptor's mask field for a KV-cache call: 0 in_place, 2 _plain but causal over several
    query tokens (a bottom-right causal mask of host-known sizes), 1 otherwise (a mask or the index values).
    The CPU fast path (csrc/ab_direct.c ab_py_kvcache) computes it the same way."""
    return 0 if in_place(c) else 2 if _plain(c) else 1


def signature(c: KVCall, backend, want_lse=True) -> _planner.Call:
    """The call descriptor (csrc/ab_planner.h ab_call): layout 2 = a KV-cache call; mask mask_kind(c);
    many_rows from _planner.KV_MANY_ROWS query rows per KV head and KV_MANY_TOKENS query tokens."""
    requested = "auto" if backend == "auto" else (resolve(backend) if backend is not None else "auto")
    if requested == "auto":
        requested = _planner.default_backend()
    q = c.q
    dev = _planner.DEVICE_IDS.get(q.device.type, 3)
    if dev == 1:
        cc, lib_ok, _, smem = _planner.cuda_device_info(q.device.index)
    else:
        cc, lib_ok, smem = 0, 0, 0
    D, gqa, softcap = q.shape[3], q.shape[2] != c.k_cache.shape[2], c.softcap > 0
    many = (q.shape[1] * (q.shape[2] // c.k_cache.shape[2]) >= _planner.KV_MANY_ROWS
            and q.shape[1] >= _planner.KV_MANY_TOKENS)
    if _is_compiling():  # with dynamic=True sizes and floats are symbolic: constants for the plan (static_int)
        D, (gqa, softcap, many) = _planner.static_int(D), _planner.static_flags(gqa, softcap, many)
    # every field by position (new_call's order): keywords cost a decode call microseconds
    return _planner.new_call(dev, cc, lib_ok, _planner.DTYPE_IDS[q.dtype], D, D, gqa,
                             False, mask_kind(c), False, 2 if c.causal else 0, c.wl >= 0 or c.wr >= 0,
                             softcap, False, False, False, bool(want_lse), 2, None, ID[requested],
                             _planner.cpu_isa(), None, smem, c.sinks is not None, c.alibi is not None, None, None,
                             False, None, many)


def choose(c: KVCall, backend, strict, want_lse=True) -> str:
    sig = signature(c, backend, want_lse)
    strict = bool(strict or _planner.STRICT)
    if _is_compiling():  # planned at trace time (_planner.choose), the choice baked into the graph
        return _planner.choose(sig, strict)
    chosen = _chosen[strict].get(sig)
    if chosen is None:
        chosen = _planner.choose(sig, strict)
        if len(_chosen[strict]) < 4096:
            _chosen[strict][sig] = chosen
    # attention_with_kvcache's fast path may serve such calls now (its table is bounded: a plan it let go
    # of comes back on the next call here)
    if chosen == "paged_attention" and sig.device == _CPU and sig.requested in _PLAIN and not _is_compiling():
        _C.remember(sig, _PAGED)
    return chosen


def attention_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                           cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                           rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse, backend, strict,
                           sinks=None):
    c = check(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
              block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
              num_splits, sinks)
    out, lse = RUNNERS[choose(c, backend, strict, return_softmax_lse)](c)
    return (out, lse) if return_softmax_lse else out


# ---- the decode kernel ---------------------------------------------------------------------------

@torch.compiler.assume_constant_result
def _emulating() -> bool:
    """_C.cuda_emulation() as torch.compile reads it: once, at trace time."""
    return bool(_C.cuda_emulation())


@torch.compiler.assume_constant_result
def _max_rows(dtype: int, in_place: bool, positions: int) -> int:
    """_C.kvcache_max_rows as torch.compile reads it: at trace time, for the traced sizes."""
    return _C.kvcache_max_rows(dtype, in_place, positions)


def run_kernel(c: KVCall):
    """The CPU decode kernel: cache write and attention in one op.  Its checks of the index values
    come back as ValueError, like the host checks of the gathered paths."""
    compiling = _is_compiling()
    if c.q.is_cuda or (_emulating() if compiling else _C.cuda_emulation()):
        return run_cuda_kernel(c)
    G = c.q.shape[2] // c.k_cache.shape[2]
    # more query rows per KV head than the kernel serves best (no limit with its tiled products; with
    # bfloat16 products one of its tiles, fewer over a long dense cache: csrc/cpu/decode_cpu.h
    # ab_kvcache_cpu_max_rows)
    in_place = c.block_table is None and c.batch_idx is None
    rows, positions = c.q.shape[1] * G, c.k_cache.shape[1]
    if compiling:
        most = _max_rows(_planner.DTYPE_IDS[c.q.dtype], in_place, _planner.static_int(positions))
    else:
        most = _C.kvcache_max_rows(_planner.DTYPE_IDS[c.q.dtype], in_place, positions)
    if rows > most:
        return run_gathered(c, _attend_flash)
    return _kernel_op(c)


def _rows16(t: torch.Tensor) -> bool:
    """Whether the CUDA decode kernel can read t's rows with 16-byte loads."""
    es = t.element_size()
    return t.data_ptr() % 16 == 0 and all(n <= 1 or s * es % 16 == 0 for n, s in zip(t.shape[:3], t.stride()[:3]))


_warned = set()
_GRID_Y = 65535  # a CUDA grid's y dimension
_KEYS_32 = 2**31  # the CUDA kernels count a row's keys in 32 bits
_BLOCKS_32 = 2**31  # and attend_kernel names a paged cache's blocks in 32 bits


def _cuda_kernel_takes(c: KVCall) -> bool:
    """Whether the CUDA decode kernel takes the call's sizes (csrc/cuda/decode.cu, ab_cuda_kvcache_fwd):
    its grids take B rows (the cache write's y) and Hkv times the row tiles of the query rows of a KV
    head (the attention's y), tiles of up to 8 rows as attend_kernel takes them (the tensor-core
    attention's tiles of 16 need fewer), up to 65535 each; it counts a row's keys in 32 bits, and
    names a paged cache's blocks in 32 bits (attend_kernel's look-ahead of the block table)."""
    B, Sq, Hq, _ = c.q.shape
    Hkv = c.k_cache.shape[2]
    rows = Sq * (Hq // Hkv)
    per_tile = 1 if rows <= 1 else 2 if rows <= 2 else 4 if rows <= 4 else 8
    blocks = c.k_cache.shape[0] if c.block_table is not None else 0
    return (B <= _GRID_Y and Hkv * -(-rows // per_tile) <= _GRID_Y and capacity(c.k_cache, c.block_table) < _KEYS_32
            and blocks < _BLOCKS_32)


# Whether calls on a GPU read their index values back to check them on the host first (below).
CHECK_DEVICE_VALUES = _planner._env_flag("ATTN_BACKENDS_KVCACHE_CHECK")


def run_cuda_kernel(c: KVCall):
    """The CUDA decode kernel (csrc/cuda/decode.cu; on the CPU under the CUDA emulation).  Caches whose
    rows are not 16-byte aligned go to eager.

    The index values (cache_seqlens, cache_leftpad, cache_batch_idx, block_table) are checked on the
    host first (host_rows: the CPU kernel's checks and messages, nothing written on error) where
    reading them costs no synchronisation: an int cache_seqlens, CPU tensors (as under the
    emulation).  Tensors on the GPU are not read back by default: a device-to-host copy per call
    would stall the stream on every layer of every decode step, and cannot be captured in a CUDA
    graph.  There the kernel bounds the values itself (decode_kernel.cuh): a batch row whose values
    are out of range (lengths, leftpad, batch index, rotary tables too short) writes nothing and
    reads no position outside the caches, and its output rows and lse come out NaN, as do the rows
    that would read a block the block table does not name.  ATTN_BACKENDS_KVCACHE_CHECK=1 (or
    CHECK_DEVICE_VALUES = True) checks them on the host there too, with the CPU's errors."""
    if not (_rows16(c.k_cache) and _rows16(c.v_cache)):
        if "align" not in _warned:
            _warned.add("align")
            _planner.logger.warning("attn_backends: the CUDA decode kernel reads cache rows with 16-byte loads; "
                                    "these caches are not 16-byte aligned, so eager serves the call")
        return run_exact(c)
    if not _cuda_kernel_takes(c):  # a very long prefill or cache: the exact route over the gathered cache
        return run_exact(c)
    if CHECK_DEVICE_VALUES or not any(t is not None and t.is_cuda
                                      for t in (c.seqlens, c.leftpad, c.batch_idx, c.block_table)):
        host_rows(c)
    return _kernel_op(c)


def _direct_ok(c: KVCall) -> bool:
    """Whether the call may skip the dispatcher (_C.kvcache_fwd_cpu, csrc/ab_direct.c): it is not traced
    (torch.compile, jit) and no TorchDispatchMode, TorchFunctionMode or functorch transform must see it,
    and every tensor is a plain torch.Tensor on the CPU (the direct call hands anything else back).
    Inference mode may stay on.  A call that writes k and v into the cache gets the op's version bumps
    of k_cache and v_cache (torch._C._increment_version), so autograd still sees the write.  The same
    kernel and checks as the op: the same bits (tests/test_kvcache.py)."""
    return read_ok(c.q, c.k_cache, c.v_cache, c.k, c.v, c.cos, c.sin, c.seqlens, c.batch_idx, c.leftpad,
                   c.block_table, c.alibi, c.sinks)


def _kernel_op(c: KVCall):
    try:
        if c.q.is_cpu and _direct_ok(c):
            res = _C.kvcache_fwd_cpu(c.q, c.k_cache, c.v_cache, c.k, c.v, c.cos, c.sin, c.seqlens, c.seqlen,
                                     c.batch_idx, c.leftpad, c.block_table, c.alibi, c.scale, c.causal, c.wl, c.wr,
                                     c.softcap, c.interleaved, c.num_splits, c.sinks)
            if res is not None:  # None: the CUDA emulation serves CPU tensors, through the op
                return res
        args = (c.q, c.k_cache, c.v_cache, c.k, c.v, c.cos, c.sin, c.seqlens, c.seqlen, c.batch_idx, c.leftpad,
                c.block_table, c.alibi, c.scale, c.causal, c.wl, c.wr, c.softcap, c.interleaved, c.num_splits,
                c.sinks)
        if _is_compiling():  # the schema's Tensor(a!) tells the compiler about the write (and its SymInt
            return ops.kvcache_fwd(*args)  # cache_seqlen keeps an int cache_seqlens from specializing the graph)
        with _below_autograd():
            res = ops.kvcache_fwd(*args)
        if c.k is not None:
            # the dispatcher bumps no version counter for a stable-ABI op's Tensor(a!) arguments (it has
            # no ADInplaceOrView kernel): bumped here, as the direct call bumps them, so that autograd
            # sees the write (inference tensors, which have no counter, are skipped)
            _increment_version((c.k_cache, c.v_cache))
        return res
    except RuntimeError as e:
        msg = str(e)
        at = msg.find(_INVALID)
        if at < 0:
            raise
        raise ValueError(msg[at + len(_INVALID):].splitlines()[0]) from None


# ---- the gathered paths (flash, math, eager; paged_attention's long queries) --------------------

class _Rows(NamedTuple):
    """Host copies of the per-row values: tokens in the cache, first visible position, end (one
    past the last key), dense cache row, and the capacity of a row."""

    seq: list
    lo: list
    end: list
    row: list
    cap: int


def host_rows(c: KVCall) -> _Rows:
    """The values of the index tensors, checked as the kernel checks them (decode_cpu.c
    check_values), before anything is written."""
    B, Sq = c.q.shape[0], c.q.shape[1]
    paged = c.block_table is not None
    bs = c.k_cache.shape[1]
    cap = capacity(c.k_cache, c.block_table)
    snew = c.k.shape[1] if c.k is not None else 0
    seq = c.seqlens.tolist() if c.seqlens is not None else [c.seqlen if c.seqlen >= 0 else cap] * B
    lo = c.leftpad.tolist() if c.leftpad is not None else [0] * B
    row = c.batch_idx.tolist() if c.batch_idx is not None else list(range(B))
    table = c.block_table.tolist() if paged else None
    per_token = c.causal or 0 <= c.wl < cap or 0 <= c.wr < cap
    qspan = Sq if per_token else min(Sq, 1)
    for b in range(B):
        n = seq[b]
        if n < 0 or n + snew > cap:  # a tensor's value (check() refused an int one)
            raise ValueError(f"cache_seqlens[{b}] = {n} is outside the cache: with {snew} new tokens it must be "
                             f"in [0, {cap - snew}] (the cache holds {cap} positions per row)")
        if not 0 <= lo[b] <= n:
            raise ValueError(f"cache_leftpad[{b}] = {lo[b]} must be in [0, cache_seqlens[{b}] = {n}]")
        if c.batch_idx is not None and not 0 <= row[b] < c.k_cache.shape[0]:
            raise ValueError(f"cache_batch_idx[{b}] = {row[b]} is not a row of k_cache (it has {c.k_cache.shape[0]})")
        if paged:
            for i in range(lo[b] // bs, -(-(n + snew) // bs)):
                if not 0 <= table[b][i] < c.k_cache.shape[0]:
                    raise ValueError(f"block_table[{b}][{i}] = {table[b][i]} is not a block of k_cache (it has "
                                     f"{c.k_cache.shape[0]}), and row {b} reads or writes positions up to "
                                     f"{n + snew - 1}")
        if c.cos is not None:
            need = n + max(snew, qspan)
            if need > c.cos.shape[0]:
                raise ValueError(f"rotary_cos has {c.cos.shape[0]} positions, but row {b} rotates up to position "
                                 f"{need - 1} (cache_seqlens[{b}] + {need - n - 1})")
    return _Rows(seq, lo, [seq[b] + snew for b in range(B)], row, cap)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, interleaved: bool,
           dtype: torch.dtype) -> torch.Tensor:
    """x (B, S, H, D) rotated in dtype at positions pos (B, S): pairs (2i, 2i + 1) when interleaved,
    else the GPT-NeoX halves (i, i + rotary_dim / 2); dims past rotary_dim unchanged.  In float32 the
    arithmetic is the kernel's: x0 * cos - x1 * sin and x0 * sin + x1 * cos, each product rounded."""
    half = cos.shape[1]
    c = cos.to(dtype)[pos].unsqueeze(2)  # (B, S, 1, half)
    s = sin.to(dtype)[pos].unsqueeze(2)
    y = x.to(dtype).clone()
    if interleaved:
        x0, x1 = y[..., 0:2 * half:2].clone(), y[..., 1:2 * half:2].clone()
        y[..., 0:2 * half:2] = x0 * c - x1 * s
        y[..., 1:2 * half:2] = x0 * s + x1 * c
    else:
        x0, x1 = y[..., :half].clone(), y[..., half:2 * half].clone()
        y[..., :half] = x0 * c - x1 * s
        y[..., half:2 * half] = x0 * s + x1 * c
    return y


def _positions(rows: _Rows, S: int, device) -> torch.Tensor:
    """(B, S) int64: cache_seqlens[b] + t."""
    return torch.tensor(rows.seq, dtype=torch.int64, device=device)[:, None] + torch.arange(S, device=device)


def _writing(c: KVCall):
    """Where the torch-op paths write the new tokens: under torch.inference_mode() when a cache is an
    inference tensor (made under inference_mode, as HF and vLLM make theirs), since torch refuses an
    in-place update of one outside it, and the call may come under no_grad; the kernels write it
    either way, as flash-attn's does."""
    if c.k_cache.is_inference() or c.v_cache.is_inference():
        return torch.inference_mode()
    return contextlib.nullcontext()


def append(c: KVCall, rows: _Rows) -> None:
    """The new keys (rotated) and values into the cache at cache_seqlens[b] + t, in place."""
    if c.k is None or c.k.shape[1] == 0 or c.q.shape[0] == 0:
        return
    with _writing(c):
        _append(c, rows)


def _append(c: KVCall, rows: _Rows) -> None:
    pos = _positions(rows, c.k.shape[1], c.q.device)
    k_new = c.k if c.cos is None else rotate(c.k, c.cos, c.sin, pos, c.interleaved, torch.float32).to(c.k.dtype)
    if c.block_table is None:
        r = torch.tensor(rows.row, dtype=torch.int64, device=c.q.device)[:, None].expand_as(pos)
        c.k_cache[r, pos] = k_new
        c.v_cache[r, pos] = c.v
    else:
        bs = c.k_cache.shape[1]
        blk = torch.gather(c.block_table.long(), 1, pos // bs)
        c.k_cache[blk, pos % bs] = k_new
        c.v_cache[blk, pos % bs] = c.v


def gather(c: KVCall, rows: _Rows):
    """The keys and values positions [0, max end) of every row as (B, S, Hkv, D), and the keys each
    query sees: bool (B, Sq, S), leftpad, sequence end, causal and window, bottom-right aligned."""
    B, Sq = c.q.shape[0], c.q.shape[1]
    dev = c.q.device
    S = max(rows.end, default=0)
    if c.block_table is None and c.batch_idx is None:
        K, V = c.k_cache[:B, :S], c.v_cache[:B, :S]  # views: no copy
    elif c.block_table is None:
        r = torch.tensor(rows.row, dtype=torch.int64, device=dev)
        K, V = c.k_cache[r, :S], c.v_cache[r, :S]
    else:
        bs = c.k_cache.shape[1]
        nb = -(-S // bs)
        blocks = c.block_table[:, :nb].long().clamp(0, c.k_cache.shape[0] - 1)  # unread blocks may be padding
        K = c.k_cache[blocks].reshape(B, nb * bs, *c.k_cache.shape[2:])[:, :S]
        V = c.v_cache[blocks].reshape(B, nb * bs, *c.v_cache.shape[2:])[:, :S]
    j = torch.arange(S, device=dev).view(1, 1, S)
    end = torch.tensor(rows.end, dtype=torch.int64, device=dev).view(B, 1, 1)
    lo = torch.tensor(rows.lo, dtype=torch.int64, device=dev).view(B, 1, 1)
    ii = torch.arange(Sq, device=dev).view(1, Sq, 1) + end - Sq  # the query's position
    own = (j >= lo) & (j < end)  # (B, 1, S): the row's own tokens
    if any(rows.lo) or min(rows.end, default=S) < S:
        # Values past a row's end or before its leftpad are not the row's (an uninitialised or reused
        # cache holds anything there, NaN included): zeros in their place, as flash-attn never reads
        # them and the decode kernels skip them, since a 0 weight times NaN would still be NaN.  A copy;
        # the caller's cache is left as it is.  A key there only gives a score the mask hides.
        V = torch.where(own.view(B, S, 1, 1), V, V.new_zeros(()))
    vis = own.expand(B, Sq, S)
    if c.causal:
        vis = vis & (j <= ii)
    if c.wl >= 0:
        vis = vis & (j >= ii - c.wl)
    if c.wr >= 0:
        vis = vis & (j <= ii + c.wr)
    return K, V, vis, ii


def _alibi_bias(c: KVCall, ii: torch.Tensor, S: int, dtype) -> torch.Tensor:
    """(B, Hq, Sq, S): -slope * |query position - key position|."""
    B, Hq = c.q.shape[0], c.q.shape[2]
    slopes = c.alibi.to(dtype).expand(B, Hq).reshape(B, Hq, 1, 1)
    dist = (ii - torch.arange(S, device=ii.device).view(1, 1, S)).abs().to(dtype).unsqueeze(1)
    return -slopes * dist


def run_gathered(c: KVCall, attend):
    """Host checks, the cache write with torch ops, then ``attend(c, rows, q_rotated)``."""
    rows = host_rows(c)
    append(c, rows)
    B, Sq, Hq, D = c.q.shape
    if B == 0 or Sq == 0 or Hq == 0:
        return c.q.new_empty(B, Sq, Hq, D), torch.empty(B, Hq, Sq, dtype=torch.float32, device=c.q.device)
    return attend(c, rows)


def _rotated_q(c: KVCall, rows: _Rows, dtype) -> torch.Tensor:
    if c.cos is None:
        return c.q.to(dtype)
    Sq = c.q.shape[1]
    pos = _positions(rows, Sq, c.q.device)
    if not (c.causal or 0 <= c.wl < rows.cap or 0 <= c.wr < rows.cap):
        pos = pos[:, :1].expand(-1, Sq)  # every token at cache_seqlens, as flash-attn
    return rotate(c.q, c.cos, c.sin, pos, c.interleaved, dtype)


def _right_aligned(K, V, vis, end):
    """K, V and vis with each row's keys moved to end at the last position S - 1 (zeros and hidden
    before them).  Then the kernel's ALiBi alignment i + Sk - Sq is each row's own query position
    t + end_b - Sq, whatever the row's length."""
    B, S = K.shape[0], K.shape[1]
    pos = torch.arange(S, device=K.device).view(1, S) - (S - end.view(B, 1))  # the row's position at slot j
    idx = pos.clamp(min=0)
    rows = torch.arange(B, device=K.device).view(B, 1)
    ok = (pos >= 0).view(B, 1, S)
    vis = torch.gather(vis, 2, idx.view(B, 1, S).expand(B, vis.shape[1], S)) & ok
    return K[rows, idx], V[rows, idx], vis


def _attend_flash(c: KVCall, rows: _Rows):
    """Our flash kernel over the gathered cache: the visibility as its attn_mask, ALiBi and sinks as
    its own arguments (the keys right-aligned per row first, when ALiBi needs each row's position)."""
    K, V, vis, ii = gather(c, rows)
    q = _rotated_q(c, rows, torch.float32).to(c.q.dtype)
    if (K.shape[1] and c.alibi is None and c.wl < 0 and c.wr < 0 and not any(rows.lo)
            and min(rows.end) == K.shape[1]):
        # every row sees keys [0, S) with its queries at the end: the kernel's own bottom-right causal (or
        # none), no mask to read (chunked prefill against a cache, docs/decode.md)
        mask, causal = None, 2 if c.causal else 0
    else:
        if c.alibi is not None and K.shape[1]:
            end = torch.tensor(rows.end, dtype=torch.int64, device=K.device)
            K, V, vis = _right_aligned(K, V, vis, end)
        mask, causal = vis.unsqueeze(1), 0  # (B, 1, Sq, S)
    args = (q.transpose(1, 2), K.transpose(1, 2), V.transpose(1, 2), mask, None, causal, c.scale, -1, -1, c.softcap,
            0.0, c.sinks, c.alibi)
    with _below_autograd():
        out, lse = ops.flash_fwd(*args)[:2]
    return out.transpose(1, 2).contiguous(), lse  # flash-attn's out: callers view it as (B, Sq, Hq * D)


def _exact_dtype(device) -> torch.dtype:
    """float64, but float32 on MPS, which has no float64 (the dense eager composite's rule there)."""
    return torch.float32 if device.type == "mps" else torch.float64


def _attend_exact(c: KVCall, rows: _Rows):
    """Plain torch ops over the gathered cache (any device), in float64 where the device has it
    (_exact_dtype)."""
    acc = _exact_dtype(c.q.device)
    K, V, vis, ii = gather(c, rows)
    B, Sq, Hq, D = c.q.shape
    G = Hq // K.shape[2]
    q = _rotated_q(c, rows, acc)
    Kr = K.to(acc).repeat_interleave(G, dim=2)  # (B, S, Hq, D)
    Vr = V.to(acc).repeat_interleave(G, dim=2)
    s = torch.einsum("bthd,bshd->bhts", q, Kr) * c.scale
    if c.softcap > 0:
        s = c.softcap * torch.tanh(s / c.softcap)
    if c.alibi is not None:
        s = s + _alibi_bias(c, ii, K.shape[1], acc)
    s = s.masked_fill(~vis.unsqueeze(1), -math.inf)
    if c.sinks is not None:  # one more key per head, with a zero value
        s = torch.cat([s, c.sinks.to(acc).view(1, Hq, 1, 1).expand(B, Hq, Sq, 1)], dim=-1)
        Vr = torch.cat([Vr, Vr.new_zeros(B, 1, Hq, Vr.shape[-1])], dim=1)
    if s.shape[-1] == 0:  # no row has a key
        return c.q.new_zeros(B, Sq, Hq, D), torch.full((B, Hq, Sq), -math.inf, device=c.q.device)
    dead = (s == -math.inf).all(dim=-1, keepdim=True)  # no visible key: out 0, lse -inf
    s = s.masked_fill(dead, 0.0)
    m = s.amax(dim=-1, keepdim=True)
    e = torch.exp(s - m).masked_fill(dead, 0.0)
    denom = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(dead, torch.ones_like(denom), denom)
    lse = torch.where(dead, torch.full_like(denom, -math.inf), m + torch.log(denom)).squeeze(-1)
    out = torch.einsum("bhts,bshd->bthd", p, Vr)
    return out.to(c.q.dtype).contiguous(), lse.float()  # as _attend_flash's


def _flash_hands_to_decode(c: KVCall) -> bool:
    """Whether our CPU flash forward would hand this call's queries to the decode kernel (its rule for a
    few query tokens, csrc/cpu/flash_cpu.c ab_flash_cpu_decode_route, asked with views of the gathered
    cache's shape: only sizes and the last stride are read)."""
    if not c.q.is_cpu or _C.cuda_emulation() or not read_ok(c.q, c.k_cache, c.v_cache):
        return False
    B, Sq, Hq, D = c.q.shape
    cap = capacity(c.k_cache, c.block_table)
    if B == 0 or Sq == 0 or cap == 0:
        return False
    kv = c.k_cache.new_empty((1, 1, 1, D)).expand(B, c.k_cache.shape[2], cap, D)
    return _C.flash_decode_route(c.q.transpose(1, 2), kv, kv, not in_place(c), 0.0, 2 if c.causal else 0, c.wl, c.wr,
                                 None, None) > 0


def run_flash(c: KVCall):
    """flash over the gathered cache; but the query lengths flash's CPU forward hands to the decode
    kernel (one token, a few: decode) go to that kernel reading the cache itself, which gives the sums
    flash's route would give on the gathered copy (a paged cache is read in the dense cache's chunks)
    without the copy, and without the op's own tiles: through the op (ops.flash_fwd) those calls took
    11x the kernel's time (bfloat16 GQA 32/8, 4096 keys: 4.8 against 0.42 ms, Zen 4, 2026-11-27)."""
    if _flash_hands_to_decode(c):
        return run_kernel(c)
    return run_gathered(c, _attend_flash)


def run_exact(c: KVCall):
    return run_gathered(c, _attend_exact)


def run_sdpa(c: KVCall):
    """torch SDPA in the call's dtype over the cache's own view, the new tokens written with slices: no
    index value read back, nothing gathered, no host copy (what auto sends to torch on CUDA in 16-bit
    types, and on a CPU with AMX for chunked prefill: csrc/ab_planner.c torch_first_kv).  No mask, but a
    bottom-right causal one over several query tokens, built from the sizes.  The planner gives it only
    the calls _plain(c) (no lse, softcap, sinks or ALiBi either): through a gathered copy and a mask,
    torch took 2.5-11.4x the CUDA kernel's time on an H200 and 4-68x the CPU kernel's on a Zen 4
    (benchmarks/bench_kv_routes.py), so those calls fall back to the kernel."""
    if not _plain(c):
        raise RuntimeError("attn_backends: torch SDPA's KV-cache route reads the cache in place only (the planner "
                           "sends it no other call)")
    B, Sq, Hq, D = c.q.shape
    cap, dev = c.k_cache.shape[1], c.q.device
    n = c.seqlen if c.seqlen >= 0 else cap
    snew = c.k.shape[1] if c.k is not None else 0
    host_rows(c)  # the kernel's checks and messages; with no index tensor it reads nothing from the device
    if snew and B:
        k_new = c.k
        if c.cos is not None:
            pos = torch.arange(n, n + snew, device=dev).expand(B, snew)
            k_new = rotate(c.k, c.cos, c.sin, pos, c.interleaved, torch.float32).to(c.k.dtype)
        with _writing(c):
            c.k_cache[:B, n:n + snew] = k_new
            c.v_cache[:B, n:n + snew] = c.v
    S = n + snew
    if B == 0 or Sq == 0 or Hq == 0 or S == 0:
        return c.q.new_zeros(c.q.shape), None
    q = c.q
    mask = None
    if c.causal and Sq > 1:  # query i at position S - Sq + i sees the keys up to it (bottom-right)
        mask = torch.ones(Sq, S, dtype=torch.bool, device=dev).tril(S - Sq)
    if c.cos is not None:  # flash-attn's rule: causal, query i at cache_seqlens + i; else all at cache_seqlens
        pos = (n + torch.arange(Sq, device=dev) if c.causal else torch.full((Sq,), n, device=dev)).expand(B, Sq)
        q = rotate(q, c.cos, c.sin, pos, c.interleaved, torch.float32).to(q.dtype)
    # torch's own function (ORIGINAL_SDPA: not a patched one), over (B, H, S, D) views of the cache
    out = ORIGINAL_SDPA(q.transpose(1, 2), c.k_cache[:B, :S].transpose(1, 2), c.v_cache[:B, :S].transpose(1, 2),
                        attn_mask=mask, scale=c.scale, enable_gqa=Hq != c.k_cache.shape[2])
    out = out.transpose(1, 2).contiguous()  # as _attend_flash's (a copy only where Sq > 1)
    if mask is not None and Sq > S:  # queries before the first key see none: 0, as the kernel gives
        out[:, :Sq - S] = 0
    return out, None


RUNNERS = {
    "paged_attention": run_kernel,
    "flash": run_flash,
    "math": run_exact,
    "eager": run_exact,
    "sdpa": run_sdpa,
}
