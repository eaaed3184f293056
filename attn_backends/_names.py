"""Backend names: the C registry's table, resolved case-insensitively ('-' == '_').

The table comes from the C core once at import; resolution is a dict lookup in Python so that
torch.compile can trace it (a call into the C module would break the graph).
"""

from __future__ import annotations

from . import _C

# (name, aliases, kind, summary, lossy, provider, caps per device) rows; the index is the C id.  The names
# are fixed; the caps are as they stood at import, before the CUDA switches (_planner): what a backend
# serves now is _C.backend_table()'s (attn_backends/_report.py reads it)
TABLE = tuple(_C.backend_table())
CANONICAL = tuple(row[0] for row in TABLE)
ALL_NAMES = tuple(n for row in TABLE for n in (row[0], *row[1]))
ID = {name: i for i, name in enumerate(CANONICAL)}
_BY_NAME = {n: row[0] for row in TABLE for n in (row[0], *row[1])}


def resolve(name: str) -> str:
    """Canonical name for any accepted name; ValueError listing the valid names otherwise."""
    canonical = _BY_NAME.get(name)
    if canonical is not None:
        return canonical
    if not isinstance(name, str):
        raise TypeError(f"backend must be a str, got {type(name).__name__}")
    canonical = _BY_NAME.get(name.lower().replace("-", "_"))
    if canonical is None:
        raise ValueError(f"unknown backend {name!r}; valid names are: {', '.join(ALL_NAMES)}")
    return canonical
