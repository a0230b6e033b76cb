"""The documentation site: its nav lists every page, every public name is documented, and it
builds with ``mkdocs build --strict`` (that last test only where the docs extra is installed)."""

import importlib
import importlib.util
import pathlib
import re
import subprocess
import sys
import types

import pytest

import torchstruct

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
CONFIG = ROOT / "mkdocs.yml"

NAV_ENTRY = re.compile(r"^\s*-\s+(?:[^:\n]*:\s+)?(?P<page>[^\s:]+\.md)\s*$")
TOP_LEVEL_KEY = re.compile(r"^[A-Za-z_][\w-]*\s*:")
API_ENTRY = re.compile(r"^:::\s+(?P<path>[\w.]+)\s*$", re.MULTILINE)
FENCE = re.compile(r"^```[^\n]*\n.*?^```[ \t]*$", re.DOTALL | re.MULTILINE)
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)


def nav_pages(config_text: str) -> list:
    """The .md files named in the ``nav:`` block of mkdocs.yml, in order.

    Read as text rather than YAML: the config uses mkdocs' own tags (``!relative``), and the
    test extra has no YAML parser.
    """
    pages, inside = [], False
    for line in config_text.splitlines():
        if TOP_LEVEL_KEY.match(line):
            inside = line.split(":", 1)[0].strip() == "nav"
            continue
        if inside:
            m = NAV_ENTRY.match(line)
            if m:
                pages.append(m.group("page"))
    return pages


def test_nav_parser():
    text = ("site_name: x\nnav:\n  - Home: index.md\n  - Guide:\n      - A page: a.md\n"
            "      - b.md\n  - API: sub/api.md\ntheme:\n  name: mkdocs\n  - not_nav.md\n")
    assert nav_pages(text) == ["index.md", "a.md", "b.md", "sub/api.md"]


def test_every_page_is_in_the_nav_and_every_nav_entry_exists():
    pages = nav_pages(CONFIG.read_text(encoding="utf-8"))
    assert pages, "mkdocs.yml has no nav entries"
    assert len(pages) == len(set(pages)), f"nav lists a page twice: {pages}"
    on_disk = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    missing_from_nav = sorted(on_disk - set(pages))
    missing_on_disk = sorted(set(pages) - on_disk)
    assert not missing_from_nav, f"pages in docs/ that mkdocs.yml's nav does not list: {missing_from_nav}"
    assert not missing_on_disk, f"nav entries with no file in docs/: {missing_on_disk}"


def public_names() -> list:
    """Public names of the package, minus its submodules."""
    return sorted(
        n for n in dir(torchstruct)
        if not n.startswith("_") and not isinstance(getattr(torchstruct, n), types.ModuleType)
    )


def code_text(markdown: str) -> str:
    """The fenced blocks and inline code spans of a Markdown text, joined."""
    fences = FENCE.findall(markdown)
    rest = FENCE.sub("", markdown)
    return "\n".join(fences + [m.group(2) for m in CODE_SPAN.finditer(rest)])


def test_every_public_name_is_documented():
    texts = {p.name: p.read_text(encoding="utf-8") for p in sorted(DOCS.glob("*.md"))}
    assert "api.md" in texts, "docs/api.md is missing"
    api_modules = set(API_ENTRY.findall(texts["api.md"]))
    code = "\n".join(code_text(t) for name, t in texts.items())
    undocumented = []
    for name in public_names():
        module = getattr(getattr(torchstruct, name), "__module__", None) or ""
        # covered by the reference when its defining module (or a package above it) has an entry
        parts = module.split(".")
        if any(".".join(parts[:i]) in api_modules for i in range(1, len(parts) + 1)):
            continue
        # otherwise the guide must show it in code
        if re.search(rf"(?<![\w]){re.escape(name)}\b", code):
            continue
        undocumented.append(f"{name} (defined in {module or '?'})")
    assert not undocumented, (
        "public names neither in an api.md '::: module' entry of their defining module nor shown "
        f"in code in docs/*.md: {undocumented}"
    )


def test_api_reference_covers_the_modules():
    api = (DOCS / "api.md").read_text(encoding="utf-8")
    entries = API_ENTRY.findall(api)
    for mod in ("select", "declare", "hooks", "contexts", "blocks", "grad", "within", "walk", "tree",
                "clip", "summary", "optim"):
        assert f"torchstruct.{mod}" in entries, f"api.md has no '::: torchstruct.{mod}' entry"


def test_performance_page_includes_the_results_file():
    text = (DOCS / "performance.md").read_text(encoding="utf-8")
    assert re.search(r'^--8<-- "benchmarks/RESULTS\.md[:\d]*"\s*$', text, re.MULTILINE), (
        "performance.md must pull benchmarks/RESULTS.md in at build time"
    )


def _missing_docs_tools() -> list:
    wanted = {"mkdocs": "mkdocs", "mkdocstrings": "mkdocstrings",
              "mkdocstrings_handlers.python": "mkdocstrings[python]",
              "pymdownx": "pymdown-extensions"}
    missing = []
    for module, package in wanted.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # parent package absent
            found = False
        if not found:
            missing.append(package)
    return missing


def test_site_builds_strict(tmp_path):
    missing = _missing_docs_tools()
    if missing:
        pytest.skip(f"docs tools not installed ({', '.join(missing)}); pip install -e .[docs]")
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(CONFIG),
         "--site-dir", str(site)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    for anchor in ("torchstruct.select.select", "torchstruct.grad.structural_grad",
                   "torchstruct.clip.clip_by_global_norm"):
        assert f'id="{anchor}"' in api, f"the API reference has no entry {anchor}"
    # the benchmark tables come from benchmarks/RESULTS.md, not from a copy
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")
    performance = (site / "performance" / "index.html").read_text(encoding="utf-8")
    for title in re.findall(r"^## (.+)$", results, re.MULTILINE):
        plain = title.replace("`", "").strip()
        assert plain.split(":")[0] in performance, f"results section {title!r} missing from the site"
