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
and flash is ``attn_backends_fa``.
"""

from __future__ import annotations

import logging

import torch

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


def hf_name(backend: str) -> str:
    """The attn_implementation registered for any accepted backend name (ours, HF's own names such
    as "sdpa" or "flash_attention_2", or a registered attn_implementation, old spellings included)."""
    canonical = _BY_HF_NAME.get(backend) if isinstance(backend, str) else None
    return NAMES[canonical if canonical is not None else resolve(backend)]


# ---- the attention function -------------------------------------------------------------------

# keywords models pass that do not change what attention computes here: the cache was already
# updated by the model, the flags concern other outputs, and packing is read from the mask
_NOT_ATTENTION = frozenset({
    "position_ids", "use_cache", "cache_position", "past_key_values", "past_key_value", "output_hidden_states",
    "output_router_logits", "return_dict", "num_items_in_batch", "layer_idx", "seq_idx",
})
_warned_output_attentions = [False]


def _attend(q, k, v, sinks, **kw):
    """ab.attention with attention sinks: one logit s per query head that joins each row's softmax
    denominator and contributes no value (GPT-OSS, FA3's s_aux).  Exact on top of lse: with sinks the output is
    out * exp(lse) / (exp(lse) + exp(s)) = out * sigmoid(lse - s), and autograd carries the gradient
    to q, k, v (through the backward op's grad_lse) and to s.  A row that sees no key has lse = -inf
    and stays 0.  When the kernels take sinks themselves, this becomes one call."""
    from . import attention

    if sinks is None:
        return attention(q, k, v, **kw)
    out, lse = attention(q, k, v, return_lse=True, **kw)  # out (B, Hq, Sq, Dv), lse (B, Hq, Sq)
    w = torch.sigmoid(lse - sinks.to(lse.dtype)[:, None])
    return (out * w[..., None]).to(out.dtype)


def _bias_mask(bias, mask):
    """T5-style position bias folded into the mask as one float mask (gradients reach the bias)."""
    if not bias.is_floating_point():
        raise TypeError(f"position_bias must be a floating tensor (added to the scores), got {bias.dtype}")
    if mask is None:
        return bias
    if mask.dtype == torch.bool:
        return bias.masked_fill(~mask, float("-inf"))
    return bias + mask


def _read_kwargs(module, kw):
    """The keywords a model passed, checked: (sinks, position_bias, softcap, sliding_window,
    deterministic).  Anything that would change the result and is not honoured raises."""
    sinks = kw.pop("s_aux", None)
    if sinks is None:
        sinks = kw.pop("sinks", None)
    bias = kw.pop("position_bias", None)
    softcap = kw.pop("softcap", None) or 0.0
    window = kw.pop("sliding_window", None)
    deterministic = bool(kw.pop("deterministic", None) or False)
    if kw.pop("output_attentions", None) and not _warned_output_attentions[0]:
        _warned_output_attentions[0] = True
        logger.warning("attn_backends attention does not support `output_attentions=True`: the attention "
                       "weights come back as None. Set attn_implementation='eager' to get them.")
    unknown = sorted(name for name, val in kw.items() if val is not None and name not in _NOT_ATTENTION)
    if unknown:
        raise TypeError(f"attn_backends: {type(module).__name__} passed {', '.join(map(repr, unknown))} to the "
                        "attention function, which it cannot honour; use attn_implementation='eager'")
    return sinks, bias, softcap, None if window is None else int(window), deterministic


def _forward(backend, module, query, key, value, attention_mask, dropout, scaling, is_causal, kw):
    """(B, Sq, Hq, Dv) attention output for one HF attention call; see ``_make_forward``."""
    sinks, bias, softcap, sw, deterministic = _read_kwargs(module, kw)
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    opts = dict(dropout_p=dropout, scale=scaling, softcap=softcap, deterministic=deterministic)
    # HF's sliding_window counts the query itself (causal: key j is visible when i - j < sliding_window);
    # its bidirectional masks take |i - j| <= sliding_window
    window = None if sw is None else (sw - 1, -1) if is_causal else (sw, sw)
    Sq, Sk = query.shape[2], key.shape[2]

    # The mask, when HF built one, is sdpa_mask's bool (B, 1, Sq, Sk), True = attend, with
    # causality, padding, packing and sliding windows in it.  Without one, causality and the window
    # follow HF's sdpa path: top-left for a prefill, and one decoded query sees the whole cache.
    causal = False
    if attention_mask is None:
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
    out = _attend(query, key, value, sinks, backend=backend, causal=causal, attn_mask=mask, window=window, **opts)
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
    """The mask our attention function reads (``base``: sdpa_mask), except for models that read the mask themselves: those get eager's float mask, as
    under attn_implementation="eager" (sdpa's bool would mean the opposite to them, and its None
    would crash them)."""
    from transformers.masking_utils import eager_mask

    def attn_backends_mask(*args, config=None, **kwargs):
        if config is not None and _computes_attention_itself(config):
            return eager_mask(*args, config=config, **kwargs)
        return base(*args, config=config, **kwargs)

    return attn_backends_mask


def register() -> dict:
    """Registers every backend; returns {our canonical name: registered attn_implementation}."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    mask = _make_mask(sdpa_mask)
    for hf, canonical in [(n, c) for c, n in NAMES.items()] + [(a, c) for a, c in ALIASES.items() if hf_accepts(a)]:
        if not hf_accepts(hf):
            raise RuntimeError(f"attn_backends: {hf!r} would not be taken by transformers as a plain name")
        AttentionInterface.register(hf, _make_forward(canonical))
        AttentionMaskInterface.register(hf, mask)
    return dict(NAMES)
