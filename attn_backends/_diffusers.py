"""diffusers integration: our backends as diffusers attention backends, selected with diffusers' own
``model.set_attention_backend("attn_backends_fa")`` or ``with attention_backend("attn_backends_fa"):``.
The names are those of the transformers integration (``hf_name``).

diffusers (0.42) has no public way to add a backend: its names are the members of the
``AttentionBackendName`` enum, which ``set_attention_backend`` and ``attention_backend`` check, and
its functions sit in ``_AttentionBackendRegistry``.  ``register`` therefore adds one enum member per
backend and registers the function with the registry's own decorator (the one diffusers uses for
its backends).  Those two private pieces are all this module touches; each step is checked and a
diffusers release that changes them makes ``register`` raise, naming what changed
(tests/test_diffusers.py runs it against the installed diffusers).
"""

from __future__ import annotations

from ._names import CANONICAL
from ._transformers import NAMES


def _fail(what: str):
    import diffusers

    return RuntimeError(f"attn_backends.register_diffusers: diffusers {diffusers.__version__} changed {what}; "
                        "this version of attn_backends cannot register its backends there")


def _add_member(enum_cls, value: str):
    """The AttentionBackendName member for ``value``, added the way Enum builds its own members
    (Python's enum has no public way to extend an enum)."""
    member = enum_cls._value2member_map_.get(value)
    if member is not None:
        return member
    member = str.__new__(enum_cls, value)
    member._name_, member._value_ = value.upper(), value
    member.__objclass__ = enum_cls
    member._sort_order_ = len(enum_cls._member_names_)
    enum_cls._member_map_[member._name_] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(member._name_)
    if enum_cls(value) is not member or value not in {m.value for m in enum_cls.__members__.values()}:
        raise _fail("how AttentionBackendName members are looked up")
    return member


def _make_backend(backend: str):
    from . import attention

    dense = "flash" if backend == "flash_varlen" else backend  # diffusers' calls are dense

    def attn_backends_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                enable_gqa=False, return_lse=False, _parallel_config=None):
        # diffusers' layout: query (B, Sq, Hq, D), key/value (B, Sk, Hkv, D); ours is (B, H, S, D) in
        # any strides, so the transposes are views
        if _parallel_config is not None:
            raise NotImplementedError("attn_backends: diffusers' context parallelism is not supported; use "
                                      "attn_backends.distributed, or a diffusers backend that supports it")
        if query.shape[2] != key.shape[2] and not enable_gqa:
            raise ValueError(f"attn_backends: query has {query.shape[2]} heads and key {key.shape[2]}; pass "
                             "enable_gqa=True for grouped-query attention (as torch's scaled_dot_product_attention)")
        if attn_mask is not None and attn_mask.dim() == 2 and attn_mask.shape == (query.shape[0], key.shape[1]):
            attn_mask = attn_mask[:, None, None, :]  # a key padding mask (B, Sk), as diffusers' native backend
        res = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), backend=dense,
                        causal=bool(is_causal), attn_mask=attn_mask, dropout_p=dropout_p, scale=scale,
                        return_lse=return_lse)
        if return_lse:
            out, lse = res
            return out.transpose(1, 2), lse.transpose(1, 2)  # lse (B, Sq, Hq), as diffusers' parallel ops
        return res.transpose(1, 2)

    attn_backends_attention.__name__ = f"attn_backends_{backend}_diffusers"
    return attn_backends_attention


def register() -> dict:
    """Registers every backend with diffusers; returns {our canonical name: diffusers backend name}."""
    import diffusers  # noqa: F401  (not installed: the ImportError says so)

    try:
        from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry
    except ImportError as e:
        raise _fail("where its attention backends live (diffusers.models.attention_dispatch)") from e
    if not (isinstance(getattr(AttentionBackendName, "_value2member_map_", None), dict)
            and callable(getattr(_AttentionBackendRegistry, "register", None))
            and isinstance(getattr(_AttentionBackendRegistry, "_backends", None), dict)):
        raise _fail("AttentionBackendName or _AttentionBackendRegistry")
    registered = {}
    for name in CANONICAL:
        member = _add_member(AttentionBackendName, NAMES[name])
        fn = _make_backend(name)
        _AttentionBackendRegistry.register(member, constraints=[], supports_context_parallel=False)(fn)
        if _AttentionBackendRegistry._backends.get(member) is not fn:
            raise _fail("_AttentionBackendRegistry.register")
        registered[name] = member.value
    return registered
