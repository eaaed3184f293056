"""Argument checks for the public API: every error names the argument and what was expected.

Types and dtypes raise TypeError, shapes and values raise ValueError.  The checks run on every
call, so they read each tensor's metadata once and avoid building anything they do not need.
The C core checks again at the op boundary (direct torch.ops calls), with RuntimeError.
"""

from __future__ import annotations

import math
import numbers
import operator

import torch

FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
INT64_MAX = 2**63 - 1
# float16, bfloat16 and float32 inputs get float32 scores: a scale or softcap beyond float32's range
# cannot be applied there at all
F32_MAX = float(torch.finfo(torch.float32).max)
_CAUSAL = {False: 0, True: 1, "top_left": 1, "bottom_right": 2}


def _shape(t: torch.Tensor) -> str:
    return str(tuple(t.shape))


def check_qkv(q, k, v):
    """Checks q, k, v of the (B, H, S, D) layout; returns (B, Hq, Sq, D, Hkv, Sk, Dv).

    The common case is one boolean expression; only a call that fails it pays for the search
    that names the offending argument (qkv_error)."""
    try:
        B, Hq, Sq, D = q.shape
        Bk, Hkv, Sk, Dk = k.shape
        Bv, Hv, Skv, Dv = v.shape
        dt = q.dtype
        dev = q.device
        ok = (
            dt in FLOAT_DTYPES and k.dtype is dt and v.dtype is dt and Bk == B and Bv == B
            and Hv == Hkv and Skv == Sk and Dk == D and D > 0 and Hkv > 0 and Hq % Hkv == 0
            and k.device == dev and v.device == dev
        )
    except (AttributeError, TypeError, ValueError):
        ok = False
    if ok:
        return B, Hq, Sq, D, Hkv, Sk, Dv
    return qkv_error(q, k, v)


def qkv_error(q, k, v):
    """Raises the error that names what is wrong with q, k, v (or returns the sizes if nothing is)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q must be 4-D (B, Hq, Sq, D), got shape {_shape(q)}")
    if k.dim() != 4:
        raise ValueError(f"k must be 4-D (B, Hkv, Sk, D), got shape {_shape(k)}")
    if v.dim() != 4:
        raise ValueError(f"v must be 4-D (B, Hkv, Sk, Dv), got shape {_shape(v)}")
    dt = q.dtype
    if dt not in FLOAT_DTYPES:
        raise TypeError(f"q must be float16, bfloat16, float32 or float64, got {dt}")
    if k.dtype != dt or v.dtype != dt:
        raise TypeError(f"q, k and v must have the same dtype, got {dt}, {k.dtype} and {v.dtype}")
    dev = q.device
    if k.device != dev or v.device != dev:
        raise ValueError(f"q, k and v must be on the same device, got {dev}, {k.device} and {v.device}")
    B, Hq, Sq, D = q.shape
    Bk, Hkv, Sk, Dk = k.shape
    Bv, Hv, Skv, Dv = v.shape
    if Bk != B or Bv != B:
        raise ValueError(f"q, k and v must have the same batch size, got {B}, {Bk} and {Bv}")
    if Hv != Hkv:
        raise ValueError(f"k and v must have the same number of heads, got {Hkv} and {Hv}")
    if Skv != Sk:
        raise ValueError(f"k and v must have the same sequence length, got {Sk} and {Skv}")
    if Dk != D:
        raise ValueError(f"q and k must have the same head dim, got {D} and {Dk}")
    if D < 1:
        raise ValueError("the head dim of q and k must be at least 1")
    if (Hq % Hkv != 0) if Hkv else Hq != 0:
        raise ValueError(
            f"the number of query heads ({Hq}) must be a multiple of the number of key/value heads ({Hkv})"
        )
    return B, Hq, Sq, D, Hkv, Sk, Dv


def check_mask(attn_mask, q: torch.Tensor, B: int, Hq: int, Sq: int, Sk: int) -> torch.Tensor:
    """bool (True = may attend) or floating (added to the scores), broadcastable to (B, Hq, Sq, Sk)."""
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and attn_mask.dtype not in FLOAT_DTYPES:
        raise TypeError(f"attn_mask must be bool (True = may attend) or floating (added to the scores), got {attn_mask.dtype}")
    if attn_mask.device != q.device:
        raise ValueError(f"attn_mask must be on the same device as q ({q.device}), got {attn_mask.device}")
    nd = attn_mask.dim()
    if nd > 4:
        raise ValueError(f"attn_mask must have at most 4 dims (B, Hq, Sq, Sk), got shape {_shape(attn_mask)}")
    want = (B, Hq, Sq, Sk)[4 - nd:]
    for have, need in zip(attn_mask.shape, want):
        if have != need and have != 1:
            raise ValueError(
                f"attn_mask of shape {_shape(attn_mask)} is not broadcastable to (B, Hq, Sq, Sk) = {(B, Hq, Sq, Sk)}"
            )
    return attn_mask if nd else attn_mask.reshape(1)


def check_causal(causal) -> int:
    """False | True | "top_left" | "bottom_right" -> 0, 1, 1, 2."""
    try:
        return _CAUSAL[causal]
    except (KeyError, TypeError):
        raise ValueError(
            f'causal must be False, True, "top_left" or "bottom_right", got {causal!r}'
        ) from None


def type_name(x) -> str:
    """A value's type for an error message, qualified outside the builtins (numpy.bool, not bool)."""
    t = type(x)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__name__}"


def is_bool(x) -> bool:
    """True/False, a NumPy bool or a bool tensor."""
    return (isinstance(x, bool) or (type(x).__module__ == "numpy" and type(x).__name__ in ("bool_", "bool"))
            or (isinstance(x, torch.Tensor) and x.dtype == torch.bool))


def as_real(name: str, x, what: str) -> float:
    """A float argument as a Python float: a Python or NumPy real, or a 0-d real tensor, as F.sdpa and
    flash-attn take them (bools are refused)."""
    if is_bool(x) or not (isinstance(x, numbers.Real) or isinstance(x, torch.Tensor) and x.ndim == 0
                          and not x.is_complex()):
        raise TypeError(f"{name} must be {what}, got {type_name(x)}")
    if isinstance(x, torch.Tensor) and x.device.type == "meta":
        raise ValueError(f"{name} must hold a value, got a tensor on the meta device")
    try:
        return float(x)
    except OverflowError:  # an int past float's range (10**400): inf, which the callers' range checks name
        return math.inf if x > 0 else -math.inf


def as_int(val, name: str) -> int:
    """val as a Python int: an int, a numpy integer, or a 0-d integer tensor (flash-attn's own tests pass
    window sizes as tensors).  bool is not an int here."""
    if isinstance(val, int) and not isinstance(val, bool):
        return val
    if isinstance(val, torch.Tensor):
        if val.dim() != 0 or val.dtype.is_floating_point or val.dtype.is_complex or val.dtype == torch.bool:
            raise TypeError(f"{name} must be an int or a 0-d integer tensor, got a {val.dtype} tensor of shape "
                            f"{_shape(val)}")
        if val.device.type == "meta":
            raise ValueError(f"{name} must hold a value, got a tensor on the meta device")
        return int(val.item())
    if not isinstance(val, bool) and not (type(val).__module__ == "numpy" and type(val).__name__ == "bool_"):
        try:
            return operator.index(val)  # numpy integers
        except TypeError:
            pass
    raise TypeError(f"{name} must be an int, got {type(val).__name__}")


def check_window(window) -> tuple[int, int]:
    """None or (left, right), each an int in [-1, 2**63 - 1] (-1 = unbounded on that side)."""
    if window is None:
        return -1, -1
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(f"window must be None or a pair (left, right), got {window!r}")
    sides = []
    for side, val in zip(("left", "right"), window):
        val = as_int(val, f"window {side}")
        if val < -1:
            raise ValueError(f"window {side} must be >= -1 (-1 = unbounded), got {val}")
        if val > INT64_MAX:
            raise ValueError(f"window {side} must be at most 2**63 - 1 (any value >= Sq + Sk is unbounded), got {val}")
        sides.append(val)
    return sides[0], sides[1]


def clamp_window(wl: int, wr: int, Sq: int, Sk: int) -> tuple[int, int]:
    """A side at least Sq + Sk wide hides no key: it becomes -1, so no kernel adds it to a row index
    (a window near 2**63 would overflow there)."""
    span = Sq + Sk
    return (-1 if wl >= span else wl), (-1 if wr >= span else wr)


def finite(x: float) -> bool:
    """math.isfinite, in a form torch.compile(dynamic=True) traces: there float arguments are symbolic,
    and dynamo cannot trace math.isfinite on them (a graph break); comparisons it can."""
    return -math.inf < x < math.inf


def _float_range_error(name: str, val: float, dtype) -> None:
    if dtype != torch.float64 and abs(val) > F32_MAX:
        raise ValueError(f"{name} must be within float32's range (|{name}| <= {F32_MAX:.4g}) for {dtype} inputs, "
                         f"whose scores are computed in float32; got {val:g}")


def check_scale(scale, D: int, dtype=torch.float32) -> float:
    if scale is None:
        return 1.0 / math.sqrt(D)
    scale = as_real("scale", scale, "a float or None")
    if not finite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    _float_range_error("scale", scale, dtype)
    return scale


def check_softcap(softcap, dtype=torch.float32) -> float:
    softcap = as_real("softcap", softcap, "a float")
    if not (softcap >= 0.0 and finite(softcap)):
        raise ValueError(f"softcap must be >= 0 and finite (0 disables it), got {softcap}")
    _float_range_error("softcap", softcap, dtype)
    return softcap


def check_dropout(dropout_p) -> float:
    dropout_p = as_real("dropout_p", dropout_p, "a float")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return dropout_p


def check_sinks(sinks, q: torch.Tensor, Hq: int):
    """Attention sinks: a floating tensor (Hq,) on q's device (one logit per query head)."""
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a torch.Tensor of shape (Hq,) = ({Hq},), got {type(sinks).__name__}")
    if tuple(sinks.shape) != (Hq,):
        raise ValueError(f"sinks must have shape (Hq,) = ({Hq},): one logit per query head, got {_shape(sinks)}")
    if sinks.dtype not in FLOAT_DTYPES:
        raise TypeError(f"sinks must be floating (float16, bfloat16, float32 or float64), got {sinks.dtype}")
    if sinks.device != q.device:
        raise ValueError(f"sinks must be on q's device ({q.device}), got {sinks.device}")
    return sinks


def check_alibi(alibi_slopes, q: torch.Tensor, B: int, Hq: int):
    """ALiBi slopes: float32 (Hq,) or (B, Hq) on q's device, as flash-attn takes them."""
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a torch.Tensor, got {type(alibi_slopes).__name__}")
    if tuple(alibi_slopes.shape) not in ((Hq,), (B, Hq)):
        raise ValueError(f"alibi_slopes must have shape (Hq,) = ({Hq},) or (B, Hq) = ({B}, {Hq}), "
                         f"got {_shape(alibi_slopes)}")
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32 (as in flash-attn), got {alibi_slopes.dtype}")
    if alibi_slopes.device != q.device:
        raise ValueError(f"alibi_slopes must be on q's device ({q.device}), got {alibi_slopes.device}")
    return alibi_slopes
