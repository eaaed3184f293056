"""HF transformers integration through its public registries (AttentionInterface and
AttentionMaskInterface), so ``from_pretrained(..., attn_implementation="ab_flash")`` runs on our
backends with the model's masks honoured.

Registered names: ``attn_backends`` (the default backend: ``ab.use(...)``, ``--attn_implementation``
through ``apply_args``, ATTN_BACKENDS_BACKEND, else the planner's choice) and
``attn_backends_<name>`` for every canonical backend, with "flash" spelled "fa" because HF treats
any attn_implementation containing "flash" as a request for its own flash-attention kernels
(``attn_backends_fa``, ``attn_backends_fa_varlen``, ``attn_backends_math``, ``attn_backends_sage``,
...).  HF's own names (``eager``, ``sdpa``, ``flash_attention_2``, ``flex_attention``) are left
alone: they mean HF's implementations.  ``hf_name(...)`` maps any of our accepted names to the
registered one.
"""

from __future__ import annotations

from ._names import CANONICAL, resolve


def hf_name(backend: str) -> str:
    """The attn_implementation string registered for one of our backend names."""
    name = resolve(backend)
    return "attn_backends" if name == "auto" else "attn_backends_" + name.replace("flash", "fa")


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


def register() -> dict:
    """Registers every backend; returns {our canonical name: registered attn_implementation}."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    registered = {}
    for name in CANONICAL:
        hf = hf_name(name)
        AttentionInterface.register(hf, _make_forward(name))
        AttentionMaskInterface.register(hf, sdpa_mask)
        registered[name] = hf
    return registered
