"""Selectors: what picks parameters.

A *selector* is one of

- a glob string, matched with :func:`fnmatch.fnmatchcase` against parameter paths and module
  paths; a pattern that names a module (``"encoder"``, ``"encoder.*"``, ``"*.norm"``) selects
  that module's whole subtree;
- a compiled :class:`re.Pattern`, ``fullmatch``-ed against parameter paths;
- a callable ``(path, param) -> bool``;
- an :class:`torch.nn.Module` (its subtree) or :class:`torch.nn.Parameter` (itself), by identity;
- a list or tuple of selectors (their union).

A tied parameter (one object reachable by several paths) is selected when any of its paths is.
Every public function of the library that picks parameters goes through :func:`select`.
"""
from __future__ import annotations

import difflib
import fnmatch
import functools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ._checks import check_bool

__all__ = ["select", "ParamIndex", "index", "Selector"]

Selector = "str | re.Pattern | Callable[[str, nn.Parameter], bool] | nn.Module | nn.Parameter | list | tuple"


@dataclass(frozen=True)
class ParamIndex:
    """Every parameter of a module with all of its paths.

    ``params`` lists each parameter object once, in ``named_parameters()`` order (tied
    parameters at their first path); ``paths[i]`` lists every path of ``params[i]``, the first
    being its canonical path.
    """

    params: tuple[nn.Parameter, ...]
    paths: tuple[tuple[str, ...], ...]
    modules: tuple[str, ...]
    module_objects: tuple[nn.Module, ...] = ()

    def __iter__(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(canonical path, parameter)`` pairs, tied parameters once."""
        return ((ps[0], p) for p, ps in zip(self.params, self.paths))

    def __len__(self) -> int:
        return len(self.params)

    def all_paths(self) -> list[str]:
        return [path for ps in self.paths for path in ps]


def index(model: nn.Module) -> ParamIndex:
    """Index ``model``'s parameters: each object once, with all its paths.

    One walk over the module dictionaries (recursive, as ``named_modules`` is), in the order
    (and with the paths) of ``named_modules`` / ``named_parameters(remove_duplicate=False)``;
    ``modules`` also lists each distinct module object once, in that order
    (``module_objects``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(model).__name__}")
    slot: dict[int, int] = {}
    params: list[nn.Parameter] = []
    paths: list[list[str]] = []
    names: list[str] = []
    objects: dict[int, nn.Module] = {}
    _visit("", model, slot, params, paths, names, objects)
    return ParamIndex(tuple(params), tuple(tuple(ps) for ps in paths), tuple(names),
                      tuple(objects.values()))


def _visit(dot: str, mod: nn.Module, slot: dict, params: list, paths: list, names: list,
           objects: dict) -> None:
    """:func:`index`'s walk, in pre-order: ``mod``'s own parameters, then its children (a
    module-level function: a nested one calling itself would be a reference cycle holding the
    model until the garbage collector runs)."""
    objects.setdefault(id(mod), mod)
    for name, p in mod._parameters.items():
        if p is None:
            continue
        i = slot.get(id(p))
        if i is None:
            slot[id(p)] = len(params)
            params.append(p)
            paths.append([dot + name])
        else:
            paths[i].append(dot + name)
    for name, child in mod._modules.items():
        if child is not None:
            names.append(dot + name)
            _visit(dot + name + ".", child, slot, params, paths, names, objects)


@functools.lru_cache(maxsize=256)
def _compiled(pattern: str) -> tuple[Callable, Callable]:
    """The glob ``pattern`` as ``(match of a path or a dotted prefix of it, match of a whole
    name)`` (translated once per pattern: selectors are entered at every step)."""
    inner = fnmatch.translate(pattern)
    assert inner.endswith("\\Z")
    prefix = re.compile(f"(?:{inner[:-2]})(?:\\..*)?", re.S).fullmatch
    return prefix, re.compile(inner).match


def _glob(pattern: str) -> Callable[[str, nn.Parameter], bool]:
    """Whether some dotted prefix of the path (``a``, ``a.b``, ...) matches ``pattern``: one
    regular expression, the pattern followed by an optional ``.rest``."""
    match = _compiled(pattern)[0]
    return lambda path, _: match(path) is not None


def _closest(word: str, candidates: list[str], n: int = 5) -> str:
    lowered: dict[str, str] = {}  # compared without case: "HEAD" is closest to "head"
    for c in candidates:
        lowered.setdefault(c.lower(), c)
    close = [lowered[c] for c in
             difflib.get_close_matches(word.lower(), list(lowered), n=n, cutoff=0.4)]
    if not close:  # fall back to the first few paths, so the message always shows real names
        close = candidates[:n]
    return ", ".join(repr(c) for c in close) or "(the model has no parameters)"


def _predicate(
    sel, model: nn.Module, idx: ParamIndex, strict: bool
) -> Callable[[str, nn.Parameter], bool] | set[int]:
    """One selector -> a predicate over ``(path, param)`` or a set of parameter ids."""
    if isinstance(sel, nn.Parameter):
        if strict and not any(p is sel for p in idx.params):
            raise ValueError(
                f"selector: the given nn.Parameter (shape {tuple(sel.shape)}) is not a "
                "parameter of the model"
            )
        return {id(sel)}
    if isinstance(sel, nn.Module):
        if strict and not any(m is sel for m in model.modules()):
            raise ValueError(
                f"selector: the given {type(sel).__name__} is not a submodule of the model "
                "(modules are matched by identity; a copy or a new instance is another module)"
            )
        return {id(p) for p in sel.parameters()}
    if isinstance(sel, str):
        pred = _glob(sel)
        known = idx.all_paths() + list(idx.modules)
        whole = _compiled(sel)[1]
        if strict and not any(whole(name) for name in known):
            raise ValueError(
                f"selector {sel!r} matches no parameter or module; closest paths: "
                f"{_closest(sel, known)} (pass strict=False to allow an empty match)"
            )
        return pred
    if isinstance(sel, re.Pattern):
        pred = lambda path, _: sel.fullmatch(path) is not None  # noqa: E731
        if strict and not any(pred(path, None) for path in idx.all_paths()):
            raise ValueError(
                f"selector re.compile({sel.pattern!r}) fully matches no parameter path; closest "
                f"paths: {_closest(sel.pattern, idx.all_paths())} (pass strict=False to allow "
                "an empty match)"
            )
        return pred
    if isinstance(sel, type):  # callable, but calling it builds an object (always "true")
        raise TypeError(
            f"selector: the class {sel.__name__} is not a selector (a callable selector is "
            f"called as f(path, param) -> bool). To select the parameters of every "
            f"{sel.__name__} module, pass the modules: [m for m in model.modules() if "
            f"isinstance(m, {sel.__name__})]")
    if callable(sel):
        return lambda path, p: _answer(sel, path, p)
    raise TypeError(
        f"selector must be a str, re.Pattern, callable, nn.Module, nn.Parameter or a "
        f"list/tuple of these; got {type(sel).__name__}"
    )


def _answer(sel: Callable, path: str, p: nn.Parameter) -> bool:
    """A callable selector's answer for ``path``: a truth value (a 0-dim tensor such as
    ``(p == 0).all()`` counts as one), not a tensor of elements (``p.abs() > 0`` is an element
    mask, not a choice of the parameter)."""
    out = sel(path, p)
    if isinstance(out, torch.Tensor) and out.dim() > 0:
        raise TypeError(
            f"selector {getattr(sel, '__qualname__', type(sel).__name__)} returned a Tensor "
            f"(shape {tuple(out.shape)}) for {path!r}; a callable selector answers True or "
            "False per parameter (for example `bool((p != 0).any())`; element masks go to "
            "ts.optim's masks=)"
        )
    return bool(out)


def _flatten(selectors) -> Iterator:
    for sel in selectors:
        if isinstance(sel, (list, tuple)):
            if not sel:
                raise ValueError(
                    "selector: an empty list selects nothing (and freeze_except would freeze "
                    "everything); pass at least one selector"
                )
            yield from _flatten(sel)
        else:
            yield sel


def select(
    model: nn.Module, *selectors, strict: bool = True, idx: ParamIndex | None = None
) -> list[tuple[str, nn.Parameter]]:
    """The parameters of ``model`` picked by any of ``selectors``.

    Arguments:
        model: the module whose parameters are searched.
        *selectors: see the module docstring; several selectors are a union.
        strict: when True (default), a string or regex selector that matches nothing, a
            module or parameter that does not belong to ``model``, or selectors (no callable
            among them) that together pick no parameter (modules without parameters), raise.
        idx: a precomputed :func:`index` of ``model`` (to avoid walking it twice).

    Returns:
        ``(canonical path, parameter)`` pairs in ``named_parameters()`` order, tied parameters
        once.

    Raises:
        ValueError: a string or regex matching nothing (naming the closest existing paths), a
            module/parameter that does not belong to ``model`` (by identity), or an empty
            list/tuple of selectors (always, also with ``strict=False``).
        TypeError: a selector of an unsupported type, a callable selector returning a tensor
            of one or more dimensions (the path named), or ``strict`` not a bool.

    Example:
        >>> import torch.nn as nn, torchstruct as ts
        >>> m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        >>> [path for path, _ in ts.select(m, "1")]
        ['1.weight', '1.bias']
    """
    check_bool(strict, "strict", "select")
    idx = index(model) if idx is None else idx
    members = list(_flatten(selectors))
    preds = [_predicate(sel, model, idx, strict) for sel in members]
    ids = {i for pr in preds if isinstance(pr, set) for i in pr}
    fns = [pr for pr in preds if not isinstance(pr, set)]
    picked = [
        (ps[0], p)
        for p, ps in zip(idx.params, idx.paths)
        if id(p) in ids or any(fn(path, p) for fn in fns for path in ps)
    ]
    if strict and members and not picked and not any(_is_predicate(s) for s in members):
        named = ", ".join(repr(s) if isinstance(s, str) else type(s).__name__ for s in members)
        raise ValueError(
            f"selector {named} names only modules without parameters: it selects no parameter "
            "(freeze_except would freeze everything; pass strict=False to allow an empty match)"
        )
    return picked


def _is_predicate(sel) -> bool:
    """A callable selector (not a module): matching nothing is an answer, not a mistake."""
    return callable(sel) and not isinstance(sel, (nn.Module, re.Pattern))
