"""Declarations and effective trainability (computed, never written here).

A parameter's **effective trainability** is decided in three steps:

1. its *starting flag*: the ``requires_grad`` it had when torchstruct first wrote it, or the
   last value someone else set (a ``requires_grad_()`` by hand, PEFT, a constructor);
2. the active contexts (:mod:`torchstruct.contexts`), applied outermost first, so the innermost
   wins: ``freeze`` turns the selected off, ``freeze_except`` turns everything else off,
   ``unfreeze`` turns the selected on;
3. the declarations: every module on the parameter's path that declares what trains (a
   ``trainable()`` method, or :func:`mark_trainable`) must list the next name on the path
   (a tied parameter needs one such path; a parameter shared by two attached models, one in
   each). A declaration only ever turns a flag off; no context can override it.

A flag someone else wrote (it differs from the one torchstruct last wrote) stands against the
contexts active and the declarations made when it was written: they skip that parameter, and
only those entered or made later apply to it. Contexts and ``mark_trainable`` declarations get
serials from one counter (:mod:`torchstruct._state`) to tell which came later.

:func:`effective` computes this from the model as it is now; it writes nothing and installs
nothing, so the read-only calls (:func:`trainable_parameters`, :func:`is_trainable`,
``ts.summary``) change no flag and leave a model that was never attached as plain PyTorch.
Writing the flags, and keeping them written, is the job of :mod:`torchstruct.hooks`.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from . import _state
from .select import ParamIndex, _closest, index, select

__all__ = [
    "mark_trainable",
    "trainable_parameters",
    "is_trainable",
    "declared",
    "effective",
]

_MARK = "_torchstruct_trainable"  # attribute on a module: (names, serial) from mark_trainable


# ----------------------------------------------------------------------------- declarations
def _own_names(module: nn.Module) -> list[str]:
    return list(module._parameters) + list(module._modules)


def _check_names(module: nn.Module, names, what: str) -> frozenset[str]:
    if isinstance(names, (str, bytes)) or not isinstance(names, Iterable):
        raise TypeError(
            f"{what} must return a list (or other iterable) of names, got "
            f"{type(names).__name__} {names!r}"
            + (f"; did you mean [{names!r}]?" if isinstance(names, str) else "")
        )
    names = tuple(names)
    own = _own_names(module)
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"{what}: names must be strings, got {type(name).__name__}")
        if name not in own:
            raise ValueError(
                f"{what}: {type(module).__name__} has no direct parameter or child module "
                f"{name!r}; it has: {_closest(name, own)}"
            )
    return frozenset(names)


def _mark(module: nn.Module) -> tuple[frozenset[str] | None, int]:
    """``(names, serial)`` of a :func:`mark_trainable` declaration on ``module`` (None, 0 when
    there is none)."""
    mark = module.__dict__.get(_MARK)
    if mark is None:
        return None, 0
    if isinstance(mark, frozenset):  # stored without a serial: as old as a class's method
        return mark, _state.DECLARED_BY_CLASS
    return mark


def serial_of(module: nn.Module) -> int:
    """When ``module``'s declaration was made, as a serial comparable with the contexts': a
    ``trainable()`` method counts as older than anything torchstruct has seen."""
    names, serial = _mark(module)
    return serial if names is not None else _state.DECLARED_BY_CLASS


def declared(module: nn.Module) -> frozenset[str] | None:
    """The names ``module`` declares trainable, or None when it declares nothing.

    :func:`mark_trainable` on the instance takes precedence over a ``trainable()`` method.
    """
    mark = _mark(module)[0]
    if mark is not None:
        gone = mark.difference(_own_names(module))
        if gone:  # renamed since (a parametrization, pruning): never freeze it silently
            raise ValueError(
                f"mark_trainable on a {type(module).__name__}: {sorted(gone)} no longer name a "
                f"direct parameter or child (it has: {_closest(sorted(gone)[0], _own_names(module))}"
                "); a parametrization or pruning renames parameters: declare the new names "
                "with ts.mark_trainable again"
            )
        return mark
    method = getattr(type(module), "trainable", None)
    if not callable(method):
        return None
    return _check_names(module, method(module), f"{type(module).__name__}.trainable()")


def _still_named(module: nn.Module) -> frozenset[str] | None:
    """What a declaration that :func:`declared` refuses still names (the names that exist);
    None (no declaration) when it cannot be read at all."""
    own = set(_own_names(module))
    mark = _mark(module)[0]
    try:
        names = mark if mark is not None else type(module).trainable(module)
        if isinstance(names, (str, bytes)):
            return None
        return frozenset(n for n in names if isinstance(n, str) and n in own)
    except BaseException:  # noqa: BLE001 - a trainable() failing (or interrupted) in its own code
        return None


def _declares(module: nn.Module) -> bool:
    """Whether ``module`` has a declaration to read (valid or not): a :func:`mark_trainable`
    mark or a ``trainable()`` method."""
    return _MARK in module.__dict__ or callable(getattr(type(module), "trainable", None))


def _blocked(root: nn.Module, lenient: bool = False,
             modules: Iterable[nn.Module] | None = None) -> dict[int, int]:
    """Per parameter id, how recently declarations exclude it: along each of its paths the
    serial (:func:`serial_of`) of the newest declaration that does not admit it, 0 when none;
    the smallest over its paths (a tied parameter needs one admitting path).

    With ``lenient``, a declaration that became invalid admits what it still names, and one
    that cannot be read at all counts as absent, instead of raising (used to restore flags
    when a context exits; the error is raised after).

    ``modules``: every module of ``root``'s tree, when known (an index's ``module_objects``);
    a tree none of which declares anything excludes nothing, and is not walked.
    """
    if modules is not None and not any(map(_declares, modules)):
        return {}
    out: dict[int, int] = {}

    def walk(mod: nn.Module, above: int) -> None:
        try:
            names = declared(mod)
        except BaseException:  # noqa: BLE001 - also a trainable() failing (or interrupted)
            if not lenient:
                raise
            names = _still_named(mod)
        serial = serial_of(mod) if names is not None else 0
        for name, p in mod._parameters.items():
            if p is not None:
                s = above if names is None or name in names else max(above, serial)
                out[id(p)] = min(out.get(id(p), s), s)
        for name, child in mod._modules.items():
            if child is not None:
                walk(child, above if names is None or name in names else max(above, serial))

    walk(root, 0)
    return out


def mark_trainable(module: nn.Module, *names: str | None) -> nn.Module:
    """Declare which direct parameters and child modules of ``module`` train.

    The same declaration a ``trainable()`` method makes, recorded on one instance: no
    subclassing needed. Whatever is not listed is frozen, with its subtree. ``mark_trainable(m)``
    with no names freezes all of ``m``; ``mark_trainable(m, None)`` removes the declaration.
    Flags change at once in every attached model that contains ``module`` (``module`` itself
    is attached when none does).

    Arguments:
        module: the module whose own parameters/children are named.
        *names: names of direct parameters or child modules, or a single ``None``.

    Returns:
        ``module``.

    Raises:
        TypeError: ``module`` is not a module, or is a TorchScript module.
        ValueError: a name that is not a direct parameter or child (with the closest names).

    Example:
        >>> import torch.nn as nn, torchstruct as ts
        >>> m = nn.Linear(2, 2)
        >>> _ = ts.mark_trainable(m, "bias")
        >>> [path for path, _ in ts.trainable_parameters(m)]
        ['bias']
        >>> _ = ts.mark_trainable(m, None)
    """
    from . import hooks  # the layer above: writing flags

    if not isinstance(module, nn.Module):
        raise TypeError(f"mark_trainable: expected an nn.Module, got {type(module).__name__}")
    if isinstance(module, torch.jit.ScriptModule):
        raise TypeError(
            f"mark_trainable: a TorchScript module ({module.original_name}) holds no Python "
            "attributes, so no declaration can be stored on it; declare on the eager module "
            "(before scripting it), or on an eager module above it")
    mark = None if names == (None,) else _check_names(module, names, "mark_trainable")
    with _state.LOCK, hooks.attached_or_as_before(module):
        before = module.__dict__.get(_MARK)
        serial = _state.next_serial()
        _set_mark(module, None if mark is None else (mark, serial))
        applied: list = []
        try:
            hooks.apply_containing(module, applied=applied)
        except BaseException:  # refused: the previous declaration stands, and the states
            _set_mark(module, before)  # that wrote before another refused are put back
            if applied:
                hooks.apply_containing(module, refuse=False, only=applied)
            raise
        _state.applied_through = max(_state.applied_through, serial)
    return module


def _set_mark(module: nn.Module, mark) -> None:
    if mark is None:
        module.__dict__.pop(_MARK, None)
    else:
        module.__dict__[_MARK] = mark


# ----------------------------------------------------------------------------- computing
def starting_flag(p: nn.Parameter, path: str, last: dict,
                  present: frozenset | set = frozenset()) -> tuple[bool, int, int | None]:
    """Where ``p`` (at ``path`` of a tree whose last application was ``last``, whose
    parameters' ids now are ``present``) starts from.

    A parameter torchstruct wrote starts from :func:`torchstruct._state.current` (a write by
    someone else becomes its starting flag, and the contexts applied so far no longer apply to
    it; those entered later still apply on top). A parameter put in place of another without
    torchstruct seeing it (FSDP2, ``load_state_dict(assign=True)``) that carries the flag the
    other one has (the flag torchstruct last wrote, or one written since by someone else, read
    now from the other parameter, which torchstruct still holds) is taken as its copy: it keeps
    its starting flag and what contexts decided for it. One still in the tree (moved to another
    path: ``del seq[i]`` renumbers the layers after it) was not replaced: ``p`` is new.

    Returns:
        ``(starting flag, serial of the newest context that no longer applies to p (0: none),
        the record (:class:`torchstruct._state.Record`) of the parameter ``p`` is a copy of, or
        None)``.
    """
    now = _state.current(p)
    if now is not None:
        return now[0], now[1], None
    before = last.get(path)
    if before is None:
        return p.requires_grad, 0, None
    start, flag, since, rec = before
    old = getattr(rec, "p", None)
    if old is not None and old is not p and id(old) in present:
        return p.requires_grad, 0, None  # the one that stood here only moved
    if old is not None and old is not p and (read := _state.current(old)) is not None:
        (start, since), flag = read, old.requires_grad  # a write on it not read yet counts
    if flag is p.requires_grad:
        return start, since, rec
    return p.requires_grad, 0, None


def effective(
    root: nn.Module, last: dict | None = None, lenient: bool = False, remember: bool = True
) -> tuple[ParamIndex, dict[int, tuple], dict[int, bool]]:
    """The effective trainability of every parameter of ``root``, computed now.

    Arguments:
        root: the module whose declarations gate (its ancestors' are not consulted).
        last: ``path -> (starting flag, flag written, serial, record of the parameter)`` of the
            tree's last application.
        lenient: an invalid declaration admits what it still names, and a context's selector
            that raises picks none of the parameters it was asked about, instead of raising.
        remember: whether the contexts record what they decide for parameters seen the first
            time (an application does; a read does not, so it changes nothing).

    Returns:
        ``(index, starts, effective flags)`` keyed by parameter id; ``starts`` holds what
        :func:`starting_flag` returns.
    """
    idx = index(root)
    last = last or {}
    with _state.LOCK:  # contexts remember what they decided for each parameter
        present = {id(p) for p in idx.params}
        starts = {id(p): starting_flag(p, path, last, present) for path, p in idx}
        flags = {i: s[0] for i, s in starts.items()}
        for entry in _state.entries:
            entry.fold(flags, starts, root, idx, lenient, remember)
    blocked = _blocked(root, lenient, idx.module_objects)
    for other, shared in _sharing(root, idx):  # one flag: every model holding it must admit it
        theirs = _blocked(other, lenient)
        for i in shared:
            blocked[i] = max(blocked.get(i, 0), theirs.get(i, 0))
    # a declaration excludes a parameter unless someone wrote its flag after it was made
    return idx, starts, {i: f and blocked.get(i, 0) <= starts[i][1] for i, f in flags.items()}


def _sharing(root: nn.Module, idx: ParamIndex) -> list[tuple[nn.Module, set[int]]]:
    """``(other root, ids of root's parameters in its tree)`` for every other attached model
    that shared a module or a parameter with ``root``'s tree at its last application."""
    mine = {id(p): p for p in idx.params}
    modules = None
    out = []
    for st in _state.live_states():
        other = st.root()
        if other is None or other is root:
            continue
        modules = modules if modules is not None else {id(m) for m in idx.module_objects}
        if modules.isdisjoint(st.module_ids) and not any(
            i in mine and rec.p is mine[i] for i, rec in st.members.items()
        ):
            continue
        shared = set(mine).intersection(id(p) for p in other.parameters())
        if shared:
            out.append((other, shared))
    return out


def _governing_root(model: nn.Module) -> nn.Module:
    """The attached root whose tree holds ``model`` now (``model`` itself if none does)."""
    if _state.state_of(model) is not None:
        return model
    for st in _state.live_states():
        root = st.root()
        if root is not None and any(m is model for m in root.modules()):
            return root
    return model


def _effective_of(model: nn.Module, lenient: bool = False) -> tuple[ParamIndex, dict[int, bool]]:
    """``model``'s parameter index and effective flags, declarations read from its governing
    root down (``lenient``: as :func:`effective`). Writes nothing."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(model).__name__}")
    root = _governing_root(model)
    st = _state.state_of(root)
    idx, _, flags = effective(root, st.last if st is not None else None, lenient,
                              remember=False)
    return (idx if root is model else index(model)), flags


def trainable_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """``(path, parameter)`` for every effectively trainable parameter, tied ones once.

    Read-only: computed from the starting flags, the active contexts and the declarations;
    no flag is written and no hook installed.

    Example:
        >>> import torch.nn as nn, torchstruct as ts
        >>> m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        >>> with ts.freeze(m, "0"):
        ...     [path for path, _ in ts.trainable_parameters(m)]
        ['1.weight', '1.bias']
    """
    idx, flags = _effective_of(model)
    return iter([(path, p) for path, p in idx if flags[id(p)]])


def is_trainable(model: nn.Module, path_or_param: str | nn.Parameter) -> bool:
    """Whether one parameter of ``model`` (given by path or object) is effectively trainable.

    Read-only, as :func:`trainable_parameters`.

    Raises:
        ValueError: the path names no parameter of ``model`` (closest paths listed), or the
            parameter does not belong to ``model``.
    """
    idx, flags = _effective_of(model)
    if isinstance(path_or_param, str):
        for p, ps in zip(idx.params, idx.paths):
            if path_or_param in ps:
                return flags[id(p)]
        raise ValueError(
            f"is_trainable: {path_or_param!r} is not a parameter path of the model; closest: "
            f"{_closest(path_or_param, idx.all_paths())}"
        )
    if isinstance(path_or_param, torch.Tensor):
        for p in idx.params:
            if p is path_or_param:
                return flags[id(p)]
        raise ValueError("is_trainable: the given tensor is not a parameter of the model")
    raise TypeError(
        f"is_trainable: expected a path or a parameter, got {type(path_or_param).__name__}"
    )
