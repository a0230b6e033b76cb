"""Griffe extension used by the API reference (mkdocs.yml, mkdocstrings' python handler).

The package's docstrings are Google-style, with two habits Griffe's Markdown rendering does not
share:

- doctest sections are titled ``Example:``; Griffe's parser knows the plural ``Examples:``
  only, and would render the singular as a plain admonition whose ``>>>`` lines are read as
  Markdown. The heading is renamed so they render as highlighted console examples;
- cross-references use Sphinx roles (``:func:`name```, ``:class:`~pkg.Name```, ``:mod:`.x```)
  and literal blocks are introduced by ``::``. Roles become inline code (the name as written,
  or its last component after ``~``) and ``::`` a single colon.

Only the docstring text handed to the parser changes; the source is untouched.
"""
from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(?P<indent>[ \t]*)Example:[ \t]*$", re.MULTILINE)
_ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|exc|obj):`(?P<tilde>~?)(?P<target>[^`]+)`")
_LITERAL = re.compile(r"(?<=\S)::[ \t]*$", re.MULTILINE)


def _role(match: re.Match) -> str:
    target = match.group("target")
    if match.group("tilde"):
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


def markdown_docstring(text: str) -> str:
    """The docstring ``text`` with the rewrites above applied."""
    text = _EXAMPLE.sub(r"\g<indent>Examples:", text)
    text = _ROLE.sub(_role, text)
    return _LITERAL.sub(":", text)


class ExampleSections(griffe.Extension):
    """Apply :func:`markdown_docstring` to every docstring before it is parsed."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        docstring = obj.docstring
        if docstring is not None:
            docstring.value = markdown_docstring(docstring.value)
