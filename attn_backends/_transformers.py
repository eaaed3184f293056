"""HF transformers integration through its public registries (AttentionInterface and
AttentionMaskInterface): ``from_pretrained(..., attn_implementation="attn_backends_fa")`` runs the
model's attention on our backends, with everything the model hands the attention function honoured
(masks, T5's position bias, GPT-OSS's sinks, sliding windows, softcap, packed sequences) or refused
with an error naming it.

Names (``hf_name``): ``attn_backends`` is the default backend (``ab.use(...)``, ``apply_args``,
ATTN_BACKENDS_BACKEND, else the planner); ``attn_backends_<suffix>`` names one backend.  transformers
reads meaning into substrings of the name: "sdpa" makes it check the model's sdpa support (Gemma2,
MPT and GPT-OSS refuse), "flash" its flash-attention kernels, "flex_attention" FlexAttention, a
"paged|" prefix its paged cache and "org/repo" a hub kernel.  So torch's SDPA is ``attn_backends_torch``
and flash is ``attn_backends_fa``.  One name has "flash" in it on purpose, FLASH_API: transformers' own
flash-attention path on attn_backends.flash_attn (the one continuous batching needs).
"""

from __future__ import annotations

import logging

import torch

from ._autocast import autocast_cast, autocast_dtype
from ._names import CANONICAL, resolve

logger = logging.getLogger("attn_backends")

# canonical backend -> suffix of its attn_implementation; the other backends keep their own name
_SUFFIX = {
    "flash": "fa",
    "flash_varlen": "fa_varlen",
    "sdpa": "torch",
    "_native_flash": "torch_fa",
    "_native_efficient": "torch_efficient",
    "_native_cudnn": "torch_cudnn",
    "_native_math": "torch_math",
    "paged_attention": "paged",
    "flash_attn_pkg": "fa_pkg",
    "sageattention_pkg": "sage_pkg",
}


def hf_accepts(name: str) -> bool:
    """True when transformers takes ``name`` as a plain registered implementation for every model,
    reading nothing into it (modeling_utils: the sdpa, flash and flex checks, the paged| prefix,
    the hub-kernel pattern)."""
    return not ("sdpa" in name or "flash" in name or "flex_attention" in name or name.startswith("paged|")
                or "/" in name)


def _registered_name(canonical: str) -> str:
    if canonical == "auto":
        return "attn_backends"
    return "attn_backends_" + _SUFFIX.get(canonical, canonical.strip("_"))


def _old_name(canonical: str) -> str:
    """The name releases before the rename registered ("flash" spelled "fa", nothing else changed)."""
    return "attn_backends" if canonical == "auto" else "attn_backends_" + canonical.replace("flash", "fa")


NAMES = {c: _registered_name(c) for c in CANONICAL}
# old names that transformers accepts for every model stay registered; the others only map here
ALIASES = {_old_name(c): c for c in CANONICAL if _old_name(c) != NAMES[c]}
_BY_HF_NAME = {**{n: c for c, n in NAMES.items()}, **ALIASES}


_PAGED = "paged|"


def continuous_batching(backend) -> bool:
    """Whether backend is one of transformers' continuous-batching names, "paged|" (any case) and an
    implementation ("paged|eager", "paged|sdpa", "paged|flash_attention_2", or one of ours:
    "paged|math"), or FLASH_API itself (with or without the prefix): every one of them is FLASH_API for
    transformers (batching_backend says on which backend).  ValueError where the rest is no name we take."""
    return batching_backend(backend) is not None


def batching_backend(backend):
    """For a continuous-batching name (continuous_batching), the backend its attention runs on: the
    canonical name of ours after "paged|" ("paged|math": math), else "auto" (transformers' own names and
    FLASH_API: the planner's choice); None for any other name.  ValueError where the rest is no name we
    take."""
    if backend in FLASH_API_NAMES:
        return "auto"
    if not (isinstance(backend, str) and backend[:len(_PAGED)].lower() == _PAGED):
        return None
    rest = backend[len(_PAGED):]
    if rest.lower() in (FLASH_API, "eager", "sdpa") or rest.lower().startswith("flash_attention_"):
        return "auto"  # transformers' own paged names: the paged path, not a backend
    canonical = _BY_HF_NAME.get(rest)
    return canonical if canonical is not None else resolve(rest)


def hf_name(backend: str) -> str:
    """The attn_implementation registered for any accepted backend name (ours, HF's own names such
    as "sdpa" or "flash_attention_2", or a registered attn_implementation, old spellings included).
    transformers' continuous-batching names ("paged|eager", ...) give FLASH_API, the one name of ours its
    generate_batch takes (it runs its paged cache on our flash-attn functions)."""
    if continuous_batching(backend):
        return FLASH_API
    canonical = _BY_HF_NAME.get(backend) if isinstance(backend, str) else None
    return NAMES[canonical if canonical is not None else resolve(backend)]


# ---- the attention function -------------------------------------------------------------------

# keywords models pass that do not change what attention computes here: the cache was already
# updated by the model, the flags concern other outputs, and packing is read from the mask (dense
# names) or from position_ids (the varlen name)
_NOT_ATTENTION = frozenset({
    "position_ids", "use_cache", "cache_position", "past_key_values", "past_key_value", "output_hidden_states",
    "output_router_logits", "return_dict", "num_items_in_batch", "layer_idx", "seq_idx",
})
_warned_output_attentions = [False]


def _attend(q, k, v, sinks, cu=None, **kw):
    """ab.attention (or ab.attention_varlen when cu = (cu_q, cu_k, max_q, max_k) is given), with the
    model's attention sinks (GPT-OSS's s_aux: one logit per query head in each row's softmax
    denominator, no value) passed to the kernels, which compute them and their gradient; a backend
    that cannot take them falls back (ab.explain says why)."""
    from . import attention, attention_varlen

    if sinks is not None:
        kw["sinks"] = sinks
    return attention(q, k, v, **kw) if cu is None else attention_varlen(q, k, v, *cu, **kw)


def _bias_mask(bias, mask):
    """T5-style position bias folded into the mask as one float mask (gradients reach the bias)."""
    if not bias.is_floating_point():
        raise TypeError(f"position_bias must be a floating tensor (added to the scores), got {bias.dtype}")
    if mask is None:
        return bias
    if mask.dtype == torch.bool:
        return bias.masked_fill(~mask, float("-inf"))
    return bias + mask


def _cu_from_positions(position_ids):
    """(cu_seqlens int32, max length) of sequences packed in one row, each starting where
    position_ids falls back to its minimum (transformers' prepare_fa_kwargs_from_position_ids), or
    None when the row holds one sequence."""
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[0] != 1 or position_ids.shape[1] < 2:
        return None
    pos = position_ids[0]
    if bool((pos[1:] == pos[:-1] + 1).all()):
        return None
    starts = (pos == pos.min()).nonzero().flatten().to(torch.int32)
    cu = torch.cat([starts, starts.new_tensor([pos.numel()])])
    return cu, int((cu[1:] - cu[:-1]).max())


def _varlen_from_padding(q, k, v, mask, causal, sinks, kw):
    """transformers' flash_attention_2 path on a padding mask (B, Sk), True/1 = token: the real
    tokens of each row become one packed sequence, padded rows of the output are 0.  The mask pads
    the keys; it pads the queries too in causal calls (self-attention, the last Sq positions) and in
    self-attention (Sq = Sk) with a window or ALiBi, whose positions must match the keys' on either side:
    a call without causality may be cross-attention, whose queries are the decoder's and all real
    (transformers' flash path takes the encoder's mask for them and zeroes the decoder's rows past
    the encoder's length; sdpa attends them), so there every query attends its row's real keys."""
    B, Hq, Sq, D = q.shape
    if k.shape[2] > mask.shape[-1]:  # a static cache longer than the mask: unwritten slots
        k, v = k[:, :, :mask.shape[-1]], v[:, :, :mask.shape[-1]]
    Sk = k.shape[2]
    keep = mask.bool()
    lens_k = keep.sum(-1, dtype=torch.int32)
    cu_k = torch.nn.functional.pad(lens_k.cumsum(0, dtype=torch.int32), (1, 0))
    idx_k = keep.flatten().nonzero().flatten()
    kk = k.transpose(1, 2).reshape(B * Sk, *k.shape[1::2])[idx_k]
    vv = v.transpose(1, 2).reshape(B * Sk, *v.shape[1::2])[idx_k]
    if Sq == Sk and (causal or kw.get("window") is not None or kw.get("alibi_slopes") is not None):
        # self-attention whose scores depend on positions (causal, a window, ALiBi): the queries are
        # packed as the keys, so each sequence's query i and key i are one token, whichever side pads
        idx_q, cu_q, lens_q = idx_k, cu_k, lens_k
    elif Sq == 1 or not causal:  # every query
        idx_q = torch.arange(B * Sq, device=q.device)
        cu_q = torch.arange(0, (B + 1) * Sq, Sq, dtype=torch.int32, device=q.device)
        lens_q = torch.full((B,), Sq, dtype=torch.int32, device=q.device)
    else:  # a chunk after a left-padded prefix: the last Sq positions of the mask are the queries
        keep_q = keep[:, -Sq:]
        lens_q = keep_q.sum(-1, dtype=torch.int32)
        cu_q = torch.nn.functional.pad(lens_q.cumsum(0, dtype=torch.int32), (1, 0))
        idx_q = keep_q.flatten().nonzero().flatten()
    qq = q.transpose(1, 2).reshape(B * Sq, Hq, D)[idx_q]
    cu = (cu_q, cu_k, int(lens_q.max()) if B else 0, int(lens_k.max()) if B else 0)
    out = _attend(qq, kk, vv, sinks, cu, causal=causal, **kw)
    full = out.new_zeros(B * Sq, Hq, out.shape[-1])
    full[idx_q] = out
    return full.view(B, Sq, Hq, -1)


def _packed_args(kw, position_ids, varlen_name, mask):
    """(cu_q, cu_k, max_q, max_k) when the call is over packed sequences, else None: cu_seq_lens
    given (any name; a mask beside them holds the same packing, or none when a cache stopped HF
    from reading it off position_ids), or for the varlen name position_ids that restart, with no
    mask."""
    cu_q, cu_k = kw.pop("cu_seq_lens_q", None), kw.pop("cu_seq_lens_k", None)
    max_q, max_k = kw.pop("max_length_q", None), kw.pop("max_length_k", None)
    if cu_q is not None or cu_k is not None:
        if cu_q is None or cu_k is None:
            raise ValueError("attn_backends: packed sequences need both cu_seq_lens_q and cu_seq_lens_k, got only "
                             + ("cu_seq_lens_q" if cu_k is None else "cu_seq_lens_k"))
        cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
        max_q = int((cu_q[1:] - cu_q[:-1]).max()) if max_q is None else int(max_q)
        max_k = int((cu_k[1:] - cu_k[:-1]).max()) if max_k is None else int(max_k)
        return cu_q, cu_k, max_q, max_k
    if varlen_name and mask is None:
        found = _cu_from_positions(position_ids)
        if found is not None:
            cu, longest = found
            return cu, cu, longest, longest
    return None


def _read_kwargs(module, kw, varlen_name, mask):
    """The keywords a model passed, checked: (sinks, position_bias, softcap, sliding_window,
    deterministic, packed, alibi_slopes).  Anything that would change the result and is not honoured
    raises."""
    sinks = kw.pop("s_aux", None)
    if sinks is None:
        sinks = kw.pop("sinks", None)
    # ALiBi as slopes (flash-attn's definition), for a model that hands them over; the ALiBi models of
    # transformers 5.x (MPT, Bloom, Falcon) compute attention in their own code and never call us
    alibi = kw.pop("alibi_slopes", None)
    bias = kw.pop("position_bias", None)
    softcap = kw.pop("softcap", None) or 0.0
    window = kw.pop("sliding_window", None)
    deterministic = bool(kw.pop("deterministic", None) or False)
    if kw.pop("output_attentions", None) and not _warned_output_attentions[0]:
        _warned_output_attentions[0] = True
        logger.warning("attn_backends attention does not support `output_attentions=True`: the attention "
                       "weights come back as None. Set attn_implementation='eager' to get them.")
    packed = _packed_args(kw, kw.get("position_ids"), varlen_name, mask)
    unknown = sorted(name for name, val in kw.items() if val is not None and name not in _NOT_ATTENTION)
    if unknown:
        raise TypeError(f"attn_backends: {type(module).__name__} passed {', '.join(map(repr, unknown))} to the "
                        "attention function, which it cannot honour; use attn_implementation='eager'")
    return sinks, bias, softcap, None if window is None else int(window), deterministic, packed, alibi


def _forward(backend, module, query, key, value, attention_mask, dropout, scaling, is_causal, kw):
    """(B, Sq, Hq, Dv) attention output for one HF attention call; see ``_make_forward``."""
    varlen_name = backend == "flash_varlen"
    sinks, bias, softcap, sw, deterministic, packed, alibi = _read_kwargs(module, kw, varlen_name, attention_mask)
    cast = autocast_dtype(query)
    if cast is not None:
        # as HF's sdpa (F.sdpa is an autocast op) and flash paths (get_target_dtype) do: under autocast, a
        # float32 model's q and k come out of RoPE in float32 beside a bfloat16 v; all run in autocast's dtype
        query, key, value = (autocast_cast(t, cast, query.device.type) for t in (query, key, value))
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if backend == "auto":
        from ._planner import default_backend

        backend = default_backend()
    opts = dict(dropout_p=dropout, scale=scaling, softcap=softcap, deterministic=deterministic)
    if alibi is not None:
        opts["alibi_slopes"] = alibi
    # the sliding_window keyword is flash's (transformers' flash path: window_size (sw - 1, sw - 1)): it
    # counts the query itself, causal i - j < sw, bidirectional |i - j| < sw (a model that wants
    # |i - j| <= w, as its own sdpa mask has it, passes w + 1: ModernBERT, Gemma 3)
    window = None if sw is None else (sw - 1, -1) if is_causal else (sw - 1, sw - 1)
    B, Sq, Sk = query.shape[0], query.shape[2], key.shape[2]

    # transformers' flash path: a padding mask first, then cu_seq_lens, then packed position_ids
    padded = varlen_name and attention_mask is not None and attention_mask.dim() == 2
    if padded and packed is not None:
        packed = None  # as HF's flash path: the padding mask wins
    if (padded or packed is not None) and bias is None:
        opts.update(backend="flash_varlen" if backend == "flash" else backend, window=window)
        causal = "bottom_right" if is_causal else False  # flash-attn's alignment, per sequence
        if padded:
            return _varlen_from_padding(query, key, value, attention_mask, causal, sinks, opts)
        Hq, Hkv = query.shape[1], key.shape[1]
        q = query.transpose(1, 2).reshape(B * Sq, Hq, -1)
        k = key.transpose(1, 2).reshape(B * Sk, Hkv, -1)
        v = value.transpose(1, 2).reshape(B * Sk, Hkv, -1)
        return _attend(q, k, v, sinks, packed, causal=causal, **opts).view(B, Sq, Hq, -1)
    if packed is not None:
        raise ValueError("attn_backends: position_bias cannot be applied to packed sequences; pass a padded batch")

    # Dense.  The mask, when HF built one, is sdpa_mask's bool (B, 1, Sq, Sk), True = attend, with
    # causality, padding, packing and sliding windows in it.  Without one, causality and the window
    # follow HF's sdpa path: top-left for a prefill, and one decoded query sees the whole cache.
    causal = False
    if padded:  # the varlen name with a float bias: the padding mask joins the bias, flash's alignment
        key, value = key[:, :, :attention_mask.shape[-1]], value[:, :, :attention_mask.shape[-1]]
        attention_mask = attention_mask.bool()[:, None, None, :]
        causal = "bottom_right" if is_causal else False
    elif attention_mask is None:
        if is_causal and Sq > 1:
            causal = True
            if Sk > Sq:  # prefill into an empty static cache: the keys past Sq are unwritten slots
                key, value = key[:, :, :Sq], value[:, :, :Sq]
                bias = bias[..., :Sq] if bias is not None else None
        elif is_causal:
            causal = "bottom_right"  # one query: sees every key, and a window counts back from it
    else:
        window = None
    mask = _bias_mask(bias, attention_mask) if bias is not None else attention_mask
    out = _attend(query, key, value, sinks, backend="flash" if varlen_name else backend, causal=causal,
                  attn_mask=mask, window=window, **opts)
    # HF wants (B, S, H, D); ours is stored that way, so this is a view
    return out.transpose(1, 2).contiguous()


def _make_forward(backend: str):
    def attn_backends_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                              **kwargs):
        # query (B, Hq, Sq, D), key/value (B, Hkv, Sk, D): HF hands custom functions the KV heads
        # unrepeated, and our kernels take GQA as it is
        return _forward(backend, module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs), None

    attn_backends_forward.__name__ = f"attn_backends_{backend}_forward"
    return attn_backends_forward


# ---- masks ------------------------------------------------------------------------------------

_self_attending: dict = {}  # config class -> whether its model computes attention itself


def _computes_attention_itself(config) -> bool:
    """True for models whose attention code never calls the AttentionInterface (MPT, Bloom, Falcon,
    GPT-J, ...): they read the mask themselves, in eager's convention.  transformers asks the same
    question (PreTrainedModel._can_set_attn_implementation) before it lets a model switch."""
    cls = type(config)
    found = _self_attending.get(cls)
    if found is None:
        found = _self_attending[cls] = _inspect_model_code(cls)
        if found:
            logger.warning(
                "attn_backends: %s models compute attention in their own code (they do not call transformers' "
                "AttentionInterface), so attn_backends cannot serve them; they run transformers' eager attention, "
                "with the mask it expects", getattr(config, "model_type", cls.__name__))
    return found


@torch.compiler.assume_constant_result
def _inspect_model_code(config_cls) -> bool:
    import importlib

    from transformers import PreTrainedModel

    try:
        module = importlib.import_module(config_cls.__module__.replace(".configuration_", ".modeling_"))
    except ImportError:
        return False  # a model we cannot find: assume the functional form every new model has
    for obj in vars(module).values():
        if isinstance(obj, type) and issubclass(obj, PreTrainedModel) and obj.__module__ == module.__name__:
            return not obj._can_set_attn_implementation()
    return False


def _make_mask(base):
    """The mask our attention function reads (``base``: sdpa_mask, or ``_varlen_mask`` for the
    varlen name), except for models that read the mask themselves: those get eager's float mask, as
    under attn_implementation="eager" (sdpa's bool would mean the opposite to them, and its None
    would crash them)."""
    from transformers.masking_utils import eager_mask

    def attn_backends_mask(*args, config=None, **kwargs):
        if config is not None and _computes_attention_itself(config):
            return eager_mask(*args, config=config, **kwargs)
        return base(*args, config=config, **kwargs)

    return attn_backends_mask


# transformers' mask functions whose pattern the attention function receives otherwise: causality
# (is_causal), a window (sliding_window) and packing (position_ids, which the varlen name reads)
_EXPRESSIBLE = frozenset({
    "causal_mask_function", "bidirectional_mask_function", "sliding_window_overlay.<locals>.inner_mask",
    "sliding_window_bidirectional_overlay.<locals>.inner_mask", "packed_sequence_mask_function.<locals>.inner_mask",
})


def _flash_expressible(fn) -> bool:
    """Whether an HF mask function is causality or bidirectionality, and-ed with windows and packing only."""
    if fn is None:
        return True
    name = getattr(fn, "__qualname__", "")
    if getattr(fn, "__module__", None) != "transformers.masking_utils":
        return False
    if name in _EXPRESSIBLE:
        return True
    if name in ("and_masks.<locals>.and_mask", "remap_positions_for_packed_sequence.<locals>.inner_mask"):
        inner = []
        for cell in fn.__closure__ or ():
            v = cell.cell_contents
            inner.extend(v if isinstance(v, tuple) else [v] if callable(v) else [])
        return bool(inner) and all(_flash_expressible(f) for f in inner)
    return False  # or_mask (a pattern widened), chunked_overlay, blockwise_overlay, anything else


def _varlen_mask(**kwargs):
    """The varlen name's mask: what transformers' flash path reads (flash_attention_mask: the 2D
    padding mask, or None), and sdpa's mask where that cannot express the call: a cache (static
    slots not yet written, windows over past tokens) or a custom pattern (``use_vmap``).  Without a
    cache, causality, the window and packing (position_ids) are the attention function's."""
    from transformers.masking_utils import flash_attention_mask, sdpa_mask

    if kwargs.get("use_vmap", False) or not _flash_expressible(kwargs.get("mask_function")):
        # a pattern beyond causality, windows and packing (Gemma 3's and PaliGemma's bidirectional image
        # blocks, Llama 4's chunks, or_mask_function/and_mask_function): only the full mask holds it
        return sdpa_mask(**kwargs)
    padding = flash_attention_mask(**kwargs)
    if padding is not None:
        return padding
    q_offset, kv_offset = kwargs.get("q_offset", 0), kwargs.get("kv_offset", 0)
    if (not isinstance(q_offset, torch.Tensor) and q_offset == 0 and kv_offset == 0
            and kwargs["kv_length"] == kwargs["q_length"] and not kwargs.get("use_vmap", False)):
        return None
    return sdpa_mask(**kwargs)


# ---- transformers' own flash-attention path on attn_backends.flash_attn ----------------------------

# The one registered name with "flash" in it, on purpose: transformers then runs its own flash-attention
# code (integrations/flash_attention.py) with flash-attn's functions from attn_backends.flash_attn, and
# its continuous batching treats the model as flash ("...flash...2": its decode fast path through
# flash_attn_with_kvcache and a block table, which transformers enables on CUDA and XPU only).
FLASH_API = "attn_backends_flash_attention_2"
FLASH_API_NAMES = (FLASH_API, _PAGED + FLASH_API)  # the name, and as releases that keep "paged|" spell it


def _flash_api_functions(fau):
    from . import flash_attn as fa

    return fa.flash_attn_func, fa.flash_attn_varlen_func, fa.flash_attn_with_kvcache, fau._pad_input, fau._unpad_input


def _register_flash_api(AttentionInterface, AttentionMaskInterface) -> bool:
    """Registers FLASH_API: transformers' flash_attention_forward and flash mask under our name, and
    its flash loader (modeling_flash_attention_utils._lazy_imports, which knows flash-attn's packages
    and hub kernels only) answering our functions for that name.  False, with a warning, where this
    transformers release lacks one of the pieces (the other names do not need them)."""
    try:
        import transformers.modeling_flash_attention_utils as fau
        from transformers.integrations.flash_attention import flash_attention_forward
        from transformers.masking_utils import flash_attention_mask

        fau._lazy_imports, fau._pad_input, fau._unpad_input  # noqa: B018 (present, or this release differs)
    except (ImportError, AttributeError) as e:
        logger.warning("attn_backends: %r is not registered: this transformers release differs from the one "
                       "it was written for (%s)", FLASH_API, e)
        return False

    def wrap(loader):
        def _lazy_imports(implementation, *args, **kwargs):
            if implementation in FLASH_API_NAMES:
                return _flash_api_functions(fau)
            return loader(implementation, *args, **kwargs)
        return _lazy_imports

    _wrap_once(fau, "_lazy_imports", wrap)
    AttentionInterface.register(FLASH_API, flash_attention_forward)
    AttentionMaskInterface.register(FLASH_API, flash_attention_mask)
    _target_dtype_without_linear_layers()
    # releases that still name the paged flash path "paged|<flash name>" (5.17; 5.2x drops the prefix):
    # continuous batching switches the model to "paged|" + FLASH_API, whose forward is transformers' own
    # paged flash forward, calling our pair through the loader above
    if "paged|flash_attention_2" in getattr(AttentionInterface, "_global_mapping", {}):
        AttentionInterface.register("paged|" + FLASH_API, AttentionInterface._global_mapping["paged|flash_attention_2"])
    _let_models_with_flash_lists_take_flash_api(fau)
    return True


def _ours(module) -> bool:
    return getattr(getattr(module, "config", None), "_attn_implementation", None) in FLASH_API_NAMES


def _target_dtype_without_linear_layers() -> None:
    """transformers' flash path casts a float32 query to the dtype of the attention module's first
    nn.Linear (integrations/flash_attention.py get_target_dtype): a module without one (GPT-2's Conv1D)
    raised StopIteration, which generate_batch swallowed into empty results.  For FLASH_API such a module
    gets the dtype of its first floating parameter (the model's), or no cast; other names as before."""
    try:
        import transformers.integrations.flash_attention as fa_mod
    except ImportError:
        return

    def wrap(original):
        def get_target_dtype(query, module):
            try:
                return original(query, module)
            except StopIteration:
                if not _ours(module):
                    raise
                return next((t.dtype for t in module.parameters() if t.is_floating_point()), None)
        return get_target_dtype

    _wrap_once(fa_mod, "get_target_dtype", wrap)


def _wrap_once(owner, name, wrap) -> None:
    """owner.name replaced by wrap(original), once (the wrapper is marked, __wrapped__ keeps the original);
    nothing where this transformers release has no such attribute."""
    original = getattr(owner, name, None)
    if original is None or getattr(original, "_attn_backends", False):
        return
    wrapper = wrap(original)
    wrapper._attn_backends = True
    wrapper.__wrapped__ = original
    setattr(owner, name, wrapper)


def _supports_flash(model) -> bool:
    supports = getattr(model, "_supports_flash_attn", None)  # transformers 5's flag; 4's was _2's
    return getattr(model, "_supports_flash_attn_2", True) if supports is None else bool(supports)


def _let_continuous_batching_take_our_names() -> None:
    """transformers' continuous batching (generate_batch) takes "paged|eager", "sdpa" and flash names only
    (its paged cache needs their masks or cu_seqlens), and refused every other name of ours: a script that
    batched with "sdpa" broke once --attn_implementation went through ab.apply_args.  A model on one of
    our names is switched, as transformers switches sdpa to flash-attn, to FLASH_API (transformers' paged
    flash path on our functions, which run on the default backend: ab.use, apply_args), or to its own
    "paged|eager" where the model does not support flash; one warning says which, and the model gets its
    name back afterwards (transformers' _original_attn_impl)."""
    try:
        from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager
    except ImportError:
        return

    def wrap(switch):
        def switch_to_cb_friendly_attn(self, model, *args, **kwargs):
            given = getattr(model.config, "_attn_implementation", None)
            if not isinstance(given, str) or _BY_HF_NAME.get(given) is None:
                return switch(self, model, *args, **kwargs)
            from ._planner import default_backend

            target = FLASH_API if _supports_flash(model) else "paged|eager"
            runs = f"on the default backend {default_backend()!r}" if target == FLASH_API else "on transformers' eager"
            logger.warning("attn_backends: continuous batching takes %r as %r (its paged cache takes flash "
                           "implementations, 'sdpa' and 'paged|eager' only); attention runs %s", given, target, runs)
            model.set_attn_implementation(target)
            try:
                switch(self, model, *args, **kwargs)
            except BaseException:
                model.set_attn_implementation(given)
                raise
            self._original_attn_impl = given  # restored when the manager stops
        return switch_to_cb_friendly_attn

    _wrap_once(ContinuousBatchingManager, "switch_to_cb_friendly_attn", wrap)


def _generic_flash_kernels(fau) -> set:
    """The flash-attention implementations transformers knows as flash-attn's own interface (its packages
    and their hub builds): every one is called through flash_attention_forward as FLASH_API is."""
    fallback = getattr(fau, "FLASH_ATTN_KERNEL_FALLBACK", {})
    names = set(fallback) | set(fallback.values())
    names |= set(getattr(fau, "FLASH_ATTN_KERNEL_VERSIONS", {}))
    names |= set(getattr(fau, "FLASH_ATTN_KERNEL_DEVICES", {}))
    return names


def _let_models_with_flash_lists_take_flash_api(fau) -> None:
    """A model that lists the flash kernels it works with (``_compatible_flash_implementations``: GPT-OSS
    and the other models with attention sinks list flash-attn 3/4 builds, which take ``s_aux``) has any
    other flash name rewritten by transformers to the first of them, a hub kernel.  FLASH_API takes
    ``s_aux``, windows and softcap through the same flash_attention_forward, so where the list names one
    of flash-attn's own kernels, FLASH_API is taken as one of them and kept.  A list of kernels of
    another kind only (MiniMax-M3's sparse "MiniMaxAI/msa") is left to transformers' rewrite."""
    try:
        from transformers.modeling_utils import PreTrainedModel
    except ImportError:
        return

    def wrap(check):
        generic = _generic_flash_kernels(fau)

        def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
            if attn_implementation in FLASH_API_NAMES and not _supports_flash(self):
                # transformers' own check for flash_attention_N (_flash_attn_can_dispatch) reads the name with a
                # regex that FLASH_API does not match: its flash path would silently drop what such a model needs
                # (T5's position_bias, Gemma 3's bidirectional image blocks, Llama 4's chunks)
                raise ValueError(f"{type(self).__name__} does not support Flash Attention, so it cannot use "
                                 f"{FLASH_API!r} (transformers' flash path); use 'attn_backends_fa' or "
                                 "'attn_backends' (continuous batching then runs transformers' own 'paged|eager')")
            listed = getattr(self, "_compatible_flash_implementations", None)
            if (attn_implementation not in FLASH_API_NAMES or not listed
                    or FLASH_API in listed or not generic.intersection(listed)):
                return check(self, attn_implementation, *args, **kwargs)
            had, old = "_compatible_flash_implementations" in self.__dict__, self.__dict__.get(
                "_compatible_flash_implementations")
            self.__dict__["_compatible_flash_implementations"] = [*listed, FLASH_API]
            try:
                return check(self, attn_implementation, *args, **kwargs)
            finally:
                if had:
                    self.__dict__["_compatible_flash_implementations"] = old
                else:
                    del self.__dict__["_compatible_flash_implementations"]

        _check_and_adjust_attn_implementation.__doc__ = check.__doc__
        return _check_and_adjust_attn_implementation

    _wrap_once(PreTrainedModel, "_check_and_adjust_attn_implementation", wrap)


def register() -> dict:
    """Registers every backend; returns {our canonical name: registered attn_implementation}.  Also
    registers FLASH_API (transformers' flash path on attn_backends.flash_attn)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    masks = {False: _make_mask(sdpa_mask), True: _make_mask(_varlen_mask)}
    for hf, canonical in [(n, c) for c, n in NAMES.items()] + [(a, c) for a, c in ALIASES.items() if hf_accepts(a)]:
        if not hf_accepts(hf):
            raise RuntimeError(f"attn_backends: {hf!r} would not be taken by transformers as a plain name")
        AttentionInterface.register(hf, _make_forward(canonical))
        AttentionMaskInterface.register(hf, masks[canonical == "flash_varlen"])
    if _register_flash_api(AttentionInterface, AttentionMaskInterface):
        _let_continuous_batching_take_our_names()
    return dict(NAMES)
