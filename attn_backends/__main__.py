"""python -m attn_backends: the environment and backend report (--matrix, --names: markdown)."""

from ._report import main

main()
