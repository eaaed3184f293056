"""Backend names: the C registry's table, resolved case-insensitively ('-' == '_').

The names come from the C core once at import; resolution is a dict lookup in Python so that
torch.compile can trace it (a call into the C module would break the graph).
"""

from __future__ import annotations

from . import _C

# (name, aliases) per backend; the index is the C id.  Names only: a backend's capabilities change with
# the CUDA switches (_planner, _C.enable_cuda_*), so whoever needs them reads _C.backend_table() then
_NAMES = tuple((row[0], tuple(row[1])) for row in _C.backend_table())
CANONICAL = tuple(name for name, _ in _NAMES)
ALL_NAMES = tuple(n for name, aliases in _NAMES for n in (name, *aliases))
ID = {name: i for i, name in enumerate(CANONICAL)}
_BY_NAME = {n: name for name, aliases in _NAMES for n in (name, *aliases)}


def resolve(name: str) -> str:
    """Canonical name for any accepted name; ValueError listing the valid names otherwise."""
    canonical = _BY_NAME.get(name) if name.__class__ is str else None
    if canonical is not None:
        return canonical
    if not isinstance(name, str):
        raise TypeError(f"backend must be a str, got {type(name).__name__}")
    canonical = _BY_NAME.get(name.lower().replace("-", "_"))
    if canonical is None:
        raise ValueError(f"unknown backend {name!r}; valid names are: {', '.join(ALL_NAMES)}")
    return canonical
