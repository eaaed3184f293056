"""How scripts reach the library without rewriting their attention: a drop-in for
torch.nn.functional.scaled_dot_product_attention (and patching it), and the argparse flags that
training scripts pass through.

ab.sdpa keeps F.sdpa's contract exactly: every call it would not serve with F.sdpa's semantics
(other ranks than it can reshape, broadcast batch dims, a mask together with is_causal, dtypes or
shapes F.sdpa rejects, tensor subclasses) goes to the original torch function, so it never raises
an exception torch would not raise, and raises the ones torch does.  Its output has the strides
F.sdpa's would have.  Where torch's fast CPU path itself misbehaves, it follows torch's math backend
(docs/integrations.md lists each such difference).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import sys
import threading
import warnings

import torch

from . import _planner
from ._autocast import autocast_cast, autocast_dtype
from ._names import ALL_NAMES, resolve
from ._ops import grad_strides
from ._providers import ORIGINAL_SDPA
from ._validate import finite

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_F32_MAX = float(torch.finfo(torch.float32).max)
_is_compiling = torch.compiler.is_compiling


def _servable(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> bool:
    """True when the call is one F.sdpa accepts and we reproduce exactly."""
    T = torch.Tensor
    if type(query) is not T or type(key) is not T or type(value) is not T:
        return False  # subclasses, nested tensors, non-tensors: torch decides
    nd = query.dim()
    if nd < 2 or key.dim() != nd or value.dim() != nd:
        return False
    if query.shape[:-2] != key.shape[:-2] or key.shape[:-2] != value.shape[:-2]:
        if nd < 4 or query.shape[:-3] != key.shape[:-3] or key.shape[:-3] != value.shape[:-3] \
                or key.shape[-3] != value.shape[-3]:
            return False  # broadcast batch dims
    dt = query.dtype
    if dt not in _FLOATS or key.dtype != dt or value.dtype != dt:
        return False
    if key.device != query.device or value.device != query.device:
        return False
    if query.shape[-1] != key.shape[-1] or key.shape[-2] != value.shape[-2] or query.shape[-1] == 0:
        return False
    if nd >= 4 and query.shape[-3] != key.shape[-3]:
        if not enable_gqa or key.shape[-3] == 0 or query.shape[-3] % key.shape[-3]:
            return False
    if enable_gqa and nd < 3:
        return False  # torch indexes the head dim (-3), which (L, E) inputs lack: IndexError
    if enable_gqa and nd >= 4 and query.shape[-3] == 0:
        return False  # no heads: torch returns the empty result, but its backend selection (torch._fused_sdp_choice,
        # asked below for the output's strides) divides by the head count and kills the process (SIGFPE)
    if attn_mask is not None:
        if is_causal or type(attn_mask) is not T or attn_mask.device != query.device:
            return False
        if attn_mask.dtype != torch.bool and attn_mask.dtype not in (torch.float32, dt):
            return False
        if attn_mask.dim() > nd:
            return False
        L, S = query.shape[-2], key.shape[-2]
        full = tuple(query.shape[:-2]) + (L, S)
        for have, need in zip(reversed(attn_mask.shape), reversed(full)):
            if have != need and have != 1:
                return False
    if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool) or not 0.0 <= dropout_p < 1.0:
        return False
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        return False
    return isinstance(is_causal, bool)


def _scale_beyond_kernels(scale, dtype) -> bool:
    """A scale our kernels reject (not finite, or beyond float32 for float32 scores) that torch takes."""
    if scale is None or isinstance(scale, bool) or not isinstance(scale, (int, float)):
        return False
    return not finite(scale) or (dtype != torch.float64 and abs(scale) > _F32_MAX)


def _torch_math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """torch's math backend: what F.sdpa computes where its fast CPU path misbehaves (a NaN or infinite
    scale gives finite garbage there, NaN in math)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return ORIGINAL_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                             scale=scale, enable_gqa=enable_gqa)


def _fused_choice(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> int:
    """The backend F.sdpa would run (torch.nn.attention.SDPBackend value); a call its selection rejects
    (a 1-D mask raises IndexError there) counts as math, where torch computes it."""
    try:
        return int(torch._fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                           enable_gqa=enable_gqa))
    except (RuntimeError, IndexError, ValueError, TypeError):
        return 0


_fused_choice_traced = torch.compiler.assume_constant_result(_fused_choice)


def _torch_strides(query, value, nd, choice) -> tuple:
    """The strides of F.sdpa's output: torch's fused CPU/CUDA kernels allocate it like the query
    (empty_like: the query's own strides when dense, else contiguous); its math path returns a
    matmul result, contiguous."""
    shape = tuple(query.shape[:-1]) + (value.shape[-1],)
    if nd == 4 and choice > 0 and query.shape[-1] == value.shape[-1]:
        return grad_strides(query)
    strides, s = [0] * len(shape), 1
    for d in reversed(range(len(shape))):
        strides[d] = s
        s *= max(shape[d], 1)
    return tuple(strides)


def _with_strides(out: torch.Tensor, strides: tuple) -> torch.Tensor:
    if out.stride() == strides:
        return out
    if out.numel() == 0 or all(a == b or n == 1 for a, b, n in zip(out.stride(), strides, out.shape)):
        return out.as_strided(out.shape, strides, out.storage_offset())  # the same elements: a view
    return torch.empty_strided(out.shape, strides, dtype=out.dtype, device=out.device).copy_(out)


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
         *, backend=None):
    from . import _dispatch

    cast = autocast_dtype(query)
    if cast is not None:
        # what F.sdpa computes under autocast: its floating arguments cast first, then the call as such (with
        # autocast off, so that no op inside it is cast again)
        dev = query.device.type
        query, key, value, attn_mask = (autocast_cast(t, cast, dev) for t in (query, key, value, attn_mask))
        with torch.autocast(dev, enabled=False):
            return sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend=backend)
    if _dispatch.transformed():  # forward-mode AD, vmap, grad: torch's own, as the patch promises
        return ORIGINAL_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                             scale=scale, enable_gqa=enable_gqa)
    from . import attention

    if not _servable(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        return ORIGINAL_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                             scale=scale, enable_gqa=enable_gqa)
    nd = query.dim()
    call = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if _is_compiling():
        # with dynamic=True the floats are symbolic, and a constant's arguments must not be: torch's
        # selection (sdp_params) reads neither the scale nor dropout_p's value, only dropout_p > 0
        choice = _fused_choice_traced(query, key, value, attn_mask, 0.5 if dropout_p > 0 else 0.0, is_causal, None,
                                      enable_gqa)
    else:
        choice = _fused_choice(*call)
    if _scale_beyond_kernels(scale, query.dtype):
        return _with_strides(_torch_math(*call), _torch_strides(query, value, nd, choice))
    q, k, v, m = query, key, value, attn_mask
    if nd == 3:  # (N, L, E): no head dim
        q, k, v = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if m is not None and m.dim() == 3:
            m = m.unsqueeze(1)
    elif nd == 2:  # (L, E)
        q, k, v = query[None, None], key[None, None], value[None, None]
    elif nd > 4:  # (*batch, H, L, E): the batch dims flattened into one (sized explicitly: any may be 0)
        batch = math.prod(query.shape[:-3])
        q, k, v = (t.reshape(batch, *t.shape[-3:]) for t in (query, key, value))
        if m is not None:
            full = tuple(query.shape[:-2]) + (query.shape[-2], key.shape[-2])
            m = m.expand(full).reshape(batch, *full[-3:])
    out = attention(q, k, v, backend="auto" if backend is None else backend, causal=is_causal, attn_mask=m,
                    dropout_p=dropout_p, scale=scale)
    if nd != 4:
        out = out.reshape(*query.shape[:-1], value.shape[-1])
    elif choice > 0 and out.stride() == query.stride():
        return out  # the usual (B, S, H, D) query: torch's fused kernel and ours lay the output out alike
    return _with_strides(out, _torch_strides(query, value, nd, choice))


_patched = {"router": None}


def _router(backend: str):
    @functools.wraps(ORIGINAL_SDPA)
    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                     enable_gqa=False):
        return sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend=backend)

    scaled_dot_product_attention.__attn_backends__ = backend
    return scaled_dot_product_attention


def patch_sdpa(backend: str = "auto") -> None:
    name = resolve(backend)
    router = _router(name)
    _patched["router"] = router
    torch.nn.functional.scaled_dot_product_attention = router


def unpatch_sdpa() -> None:
    torch.nn.functional.scaled_dot_product_attention = ORIGINAL_SDPA
    _patched["router"] = None


# the open patched_sdpa blocks, oldest first: [what the block found, its router].  Blocks of several threads
# may close in any order; one that closes while a later one is still open hands it what it found, so that
# the last to close restores what was there before the first (a plain save and restore put the first
# block's router back for good when the first closed before the second)
_blocks: list = []
_blocks_lock = threading.Lock()


@contextlib.contextmanager
def patched_sdpa(backend: str = "auto"):
    router = _router(resolve(backend))
    with _blocks_lock:
        block = [torch.nn.functional.scaled_dot_product_attention, router]
        _blocks.append(block)
        _patched["router"] = router
        torch.nn.functional.scaled_dot_product_attention = router
    try:
        yield
    finally:
        with _blocks_lock:
            i = next(i for i, b in enumerate(_blocks) if b is block)
            del _blocks[i]
            if i < len(_blocks):  # a block opened after this one is still open: it keeps its router
                _blocks[i][0] = block[0]
            else:
                previous = block[0]
                torch.nn.functional.scaled_dot_product_attention = previous
                _patched["router"] = previous if getattr(previous, "__attn_backends__", None) else None


# ---- argparse -----------------------------------------------------------------------------------

def _backend_arg(value: str) -> str:
    from ._transformers import continuous_batching

    try:
        return value if continuous_batching(value) else _resolve_any(value)  # a "paged|" name: as given
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _backend_arg_or_value_error(value: str) -> str:
    """_backend_arg for add_argparse_args' default: the same names, a ValueError for others."""
    try:
        return _backend_arg(value)
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"default: {e}") from None


def _resolve_any(value: str) -> str:
    """Canonical name for any accepted name, or for an attn_implementation we register with HF."""
    from ._transformers import _BY_HF_NAME

    return _BY_HF_NAME.get(value) or resolve(value)


def _parser_frame(filename: str) -> bool:
    """Whether a frame of this file is the parser's rather than the script's: argparse, this module, or
    transformers' HfArgumentParser (whose parse_args_into_dataclasses calls argparse)."""
    return filename in (argparse.__file__, __file__) or filename.replace("\\", "/").endswith(
        "transformers/hf_argparser.py")


def _outside_argparse() -> int:
    """The stacklevel of the first frame outside the parser (_parser_frame): the script's parse_args
    call, so that the warning shows the user's line (and the default filters show it)."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and _parser_frame(frame.f_code.co_filename):
        level, frame = level + 1, frame.f_back
    return level


class _UseFlashAttention(argparse.Action):
    """--use_flash_attention: the old boolean flag, kept working: --attn_implementation flash."""

    def __init__(self, option_strings, dest, **kwargs):
        kwargs.pop("nargs", None)
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        # a FutureWarning: the notice is for the person running the script, and Python's default
        # filters hide a DeprecationWarning raised outside __main__
        warnings.warn(f"{option_string} is deprecated; use --attn_implementation flash", FutureWarning,
                      stacklevel=_outside_argparse())
        setattr(namespace, self.dest, "flash")


_FLAGS = (("--attn_implementation", "--attn-implementation"), ("--use_flash_attention", "--use_flash_attention_2"),
          ("--disable_mps_fix",), ("--patch_sdpa",))


def add_argparse_args(parser: argparse.ArgumentParser, default: str = "auto", *, skip=()) -> argparse.ArgumentParser:
    taken = getattr(parser, "_option_string_actions", {})
    skip = {s if s.startswith("--") else "--" + s for s in skip}
    add = [flags[0] for flags in _FLAGS if not any(f in taken or f in skip for f in flags)]
    existing = taken.get("--attn_implementation") or taken.get("--attn-implementation")
    dest = existing.dest if existing is not None else "attn_implementation"
    if not add:
        return parser
    group = parser.add_argument_group("attention (attn_backends)")
    if "--attn_implementation" in add:
        names = ", ".join(ALL_NAMES)
        group.add_argument("--attn_implementation", "--attn-implementation", type=_backend_arg,
                           default=_backend_arg_or_value_error(default), metavar="NAME",
                           help=f"attention backend, any of (case-insensitive): {names}; also the names "
                                "registered with HF transformers (attn_backends_*) and its continuous-batching "
                                "names, paged|eager, paged|sdpa or paged|<one of ours> (default: %(default)s)")
    if "--use_flash_attention" in add:
        group.add_argument("--use_flash_attention", "--use_flash_attention_2", action=_UseFlashAttention, dest=dest,
                           help="deprecated: same as --attn_implementation flash")
    if "--disable_mps_fix" in add:
        group.add_argument("--disable_mps_fix", action="store_true",
                           help="on MPS, let torch SDPA serve masked calls in evaluation (it gives NaN there)")
    if "--patch_sdpa" in add:
        group.add_argument("--patch_sdpa", action="store_true",
                           help="route torch.nn.functional.scaled_dot_product_attention through attn_backends too")
    return parser


def apply_args(args, *more, for_hf: bool = False) -> str:
    """Applies parsed flags: the process default backend, the MPS rule, and patching when asked.
    Each flag is read from the first of ``args, *more`` that holds it (HfArgumentParser hands back
    one dataclass per group).  Returns the canonical backend name, or with for_hf=True the
    attn_implementation registered with HF transformers (registering it)."""
    def flag(name, default):
        for source in (args, *more):
            value = getattr(source, name, None)
            if value is not None:
                return value
        return default

    from . import _transformers

    given = flag("attn_implementation", "auto")
    # "paged|eager", ...: the planner's choice, as "auto"; "paged|math": math (batching_backend)
    batching = _transformers.batching_backend(given)
    name = batching if batching is not None else _resolve_any(given)
    if name == "auto":  # no choice on the command line: ATTN_BACKENDS_BACKEND still decides
        name = _planner.ENV_BACKEND
    _planner.set_process_default(name)
    if flag("disable_mps_fix", False):
        _planner.settings["mps_fix"] = False
    if flag("patch_sdpa", False):
        patch_sdpa(name)
    if for_hf:
        _transformers.register()
        return _transformers.hf_name(given if batching is not None else name)
    return name
