"""Writes docs/backends.md from the C registry and this machine's report.

    python docs/generate_backends.py

The names table and the support matrix come from the registry (csrc/ab_registry.c), never by
hand; tests/test_planner.py fails when the page is stale.  The report section is the output of
`python -m attn_backends` on the machine that ran this script.  The prose (above the names table,
and under the support matrix's heading) is the page's own: edit it in backends.md, and this script
keeps it.
"""

import datetime
import os
import subprocess
import sys

from attn_backends._report import names_markdown, support_matrix_markdown

HERE = os.path.dirname(os.path.abspath(__file__))

NAMES = "## Accepted names\n\n"
MATRIX = "## Support matrix (generated from the registry)\n\n"
REPORT = "\n\n## The report on the machine that generated this page ("


def prose(page: str):
    """The hand-written parts of the page as it stands: everything before the names table, and the
    paragraphs between the support matrix's heading and its first table.  They are edited in
    backends.md itself; this script keeps them and rewrites the rest."""
    intro = page[:page.index(NAMES)]
    start = page.index(MATRIX) + len(MATRIX)
    return intro, page[start:page.index("### cpu", start)]


def main():
    report = subprocess.run([sys.executable, "-m", "attn_backends"], capture_output=True, text=True,
                            check=True).stdout
    path = os.path.join(HERE, "backends.md")
    with open(path) as f:
        intro, matrix_prose = prose(f.read())
    text = (intro + NAMES + names_markdown() + "\n\n" + MATRIX + matrix_prose + support_matrix_markdown() +
            f"{REPORT}{datetime.date.today()})\n\n"
            "`python -m attn_backends`:\n\n```\n" + report.rstrip() + "\n```\n")
    with open(path, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
