"""HF transformers integration through its public registries (AttentionInterface and
AttentionMaskInterface), so ``from_pretrained(..., attn_implementation="attn_backends_fa")`` runs on
our backends with the model's masks honoured.

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


def _make_forward(backend: str):
    from . import attention

    def attn_backends_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                              **kwargs):
        # query (B, Hq, Sq, D), key/value (B, Hkv, Sk, D): HF hands custom functions the KV heads
        # unrepeated, and our kernels take GQA as it is.  The mask, when HF built one, is
        # sdpa_mask's bool (B, 1, Sq, Sk) with True = attend, and already holds causality,
        # padding and sliding windows.  Without one, causality follows HF's sdpa path exactly.
        q_len, kv_len = query.shape[2], key.shape[2]
        causal = False
        if attention_mask is None:
            is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
            causal = bool(is_causal) and q_len > 1
            if causal and kv_len > q_len:
                # prefill into an empty static cache: the keys past q_len are unwritten slots
                key, value = key[:, :, :q_len], value[:, :, :q_len]
        softcap = kwargs.get("softcap") or 0.0
        out = attention(query, key, value, backend=backend, causal=causal, attn_mask=attention_mask,
                        dropout_p=dropout, scale=scaling, softcap=softcap)
        # HF wants (B, S, H, D); ours is stored that way, so this is a view
        return out.transpose(1, 2).contiguous(), None

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
