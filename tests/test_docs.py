"""Every ```python block in docs/*.md runs, and every doctest of the package passes."""

import doctest
import importlib
import pathlib
import pkgutil
import re

import pytest
import torch
from torch import nn

import torchstruct as ts

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
DOC_FILES = sorted(DOCS.glob("*.md")) if DOCS.is_dir() else []
BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)


def python_blocks(text):
    """(line number, source) of each ```python fenced block, in order."""
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in BLOCK.finditer(text)]


def test_block_extraction():
    text = "intro\n```python\nx = 1\n```\nmid\n```\nnot python\n```\n```python\ny = x\n```\n"
    assert python_blocks(text) == [(3, "x = 1\n"), (10, "y = x\n")]


def _public_fully_shard() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("path", DOC_FILES, ids=[p.name for p in DOC_FILES])
def test_doc_file_runs(path):
    text = path.read_text(encoding="utf-8")
    if "from torch.distributed.fsdp import fully_shard" in text and not _public_fully_shard():
        pytest.skip(f"{path.name} imports torch.distributed.fsdp.fully_shard (torch >= 2.6)")
    namespace = {"torch": torch, "nn": nn, "ts": ts, "__name__": f"docs_{path.stem}"}
    for line, source in python_blocks(text):
        code = compile("\n" * (line - 1) + source, str(path), "exec")
        torch.manual_seed(0)
        try:
            exec(code, namespace)
        except Exception as e:  # name the block that failed
            raise AssertionError(f"{path.name}: the block starting at line {line} failed: "
                                 f"{type(e).__name__}: {e}") from e


def package_modules():
    names = [ts.__name__]
    for info in pkgutil.walk_packages(ts.__path__, prefix=ts.__name__ + "."):
        names.append(info.name)
    return sorted(names)


def test_doctests_of_every_module():
    attempted = 0
    failures = []
    for name in package_modules():
        module = importlib.import_module(name)
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False, report=True)
        attempted += result.attempted
        if result.failed:
            failures.append(f"{name}: {result.failed} of {result.attempted} failed")
    assert not failures, "; ".join(failures)
    assert attempted > 0
