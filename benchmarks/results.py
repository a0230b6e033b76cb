"""Write one benchmark's section of benchmarks/RESULTS.md, leaving the others as they are."""
from __future__ import annotations

import argparse
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


def options(doc: str, argv: list[str] | None = None, helps: dict | None = None, **defaults):
    """A benchmark's command line: ``--write`` plus one ``--name`` per keyword default (a bool
    default makes a switch). ``argv`` None reads ``sys.argv``. Returns the parsed options."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--write", action="store_true",
                        help="write the results into their section of benchmarks/RESULTS.md")
    for name, default in defaults.items():
        flag, text = "--" + name.replace("_", "-"), (helps or {}).get(name)
        if isinstance(default, bool):
            parser.add_argument(flag, action="store_true", help=text)
        else:
            parser.add_argument(flag, type=type(default), default=default, help=text)
    return parser.parse_args(argv)


def report(args, key: str, title: str, body: str) -> None:
    """Print ``body``; with ``--write``, also put it in section ``key`` of RESULTS.md."""
    print(body)
    if args.write:
        write_section(key, title, body)
