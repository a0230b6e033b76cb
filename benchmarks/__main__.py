"""Run every benchmark and write its section of benchmarks/RESULTS.md.

    python -m benchmarks            # all of them
    python -m benchmarks hooks clip # some of them, by the name after ``bench_``
"""
from __future__ import annotations

import importlib
import pkgutil
import sys

import benchmarks


def main(argv: list[str]) -> None:
    names = sorted(m.name[len("bench_"):] for m in pkgutil.iter_modules(benchmarks.__path__)
                   if m.name.startswith("bench_"))
    unknown = [a for a in argv if a not in names]
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {unknown}; available: {names}")
    for name in argv or names:
        print(f"== {name}", flush=True)
        importlib.import_module(f"benchmarks.bench_{name}").main(["--write"])


if __name__ == "__main__":
    main(sys.argv[1:])
