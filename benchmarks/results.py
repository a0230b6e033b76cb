"""Write one benchmark's section of benchmarks/RESULTS.md, leaving the others as they are."""
from __future__ import annotations

import pathlib
import re

RESULTS = pathlib.Path(__file__).with_name("RESULTS.md")


def write_section(key: str, title: str, body: str) -> None:
    """Replace (or append) the text between ``<!-- key:begin -->`` and ``<!-- key:end -->``."""
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    block = f"<!-- {key}:begin -->\n## {title}\n\n{body.strip()}\n<!-- {key}:end -->"
    pattern = re.compile(rf"<!-- {re.escape(key)}:begin -->.*?<!-- {re.escape(key)}:end -->", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    RESULTS.write_text(text)
