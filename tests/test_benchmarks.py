"""The benchmarks' command lines (``python -m benchmarks NAME``) reach the shared writer.

Running a benchmark takes minutes, so the suite checks what can break without running one:
every ``benchmarks/bench_*.py`` imports, has a ``main``, and the ``report`` its ``main`` calls
is ``benchmarks.results.report`` (a local function of the same name once shadowed it, and
``python -m benchmarks ddp`` failed after measuring). One short benchmark runs whole.
"""
import importlib
import inspect
import pathlib
import pkgutil

import pytest

import benchmarks
from benchmarks import results

NAMES = sorted(m.name for m in pkgutil.iter_modules(benchmarks.__path__)
               if m.name.startswith("bench_"))


@pytest.mark.parametrize("name", NAMES)
def test_a_benchmark_main_writes_through_the_shared_report(name):
    module = importlib.import_module(f"benchmarks.{name}")
    assert callable(getattr(module, "main", None)), f"{name} has no main()"
    source = inspect.getsource(module.main)
    if "report(" in source:
        assert module.report is results.report, (
            f"{name}.report is {module.report!r}, not benchmarks.results.report: main() would "
            "pass its options to the wrong function")


def test_every_benchmark_is_found_by_the_runner():
    files = sorted(p.stem for p in pathlib.Path(benchmarks.__file__).parent.glob("bench_*.py"))
    assert files == NAMES and len(NAMES) >= 10


def test_a_benchmark_runs_through_main_without_writing(capsys):
    before = results.RESULTS.read_text()
    importlib.import_module("benchmarks.bench_schedule").main(["--rounds", "3"])
    out = capsys.readouterr().out
    assert "|---" in out, out[:500]
    assert results.RESULTS.read_text() == before
