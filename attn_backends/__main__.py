"""python -m attn_backends: the environment and backend report."""

from ._report import report

print(report())
