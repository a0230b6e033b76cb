"""Declarations, effective trainability, and the hooks that make them real.

A parameter's **effective trainability** is decided in three steps:

1. its *starting flag*: the ``requires_grad`` it had when torchstruct first saw it, or the last
   value the user set by hand (see below);
2. the active contexts (:mod:`torchstruct.contexts`), applied outermost first, so the innermost
   wins: ``freeze`` turns the selected off, ``freeze_except`` turns everything else off,
   ``unfreeze`` turns the selected on;
3. the declarations: every module on the parameter's path that declares what trains (a
   ``trainable()`` method, or :func:`mark_trainable`) must list the next name on the path.
   A declaration only ever turns a flag off; no context can override it.

The flags are written at once whenever a declaration or a context changes, and a forward
pre-hook on the attached model re-applies them before a forward when the module tree changed
(a parameter or submodule was registered anywhere). When nothing changed the hook costs one
dictionary look-up and one integer comparison.

**A manual ``requires_grad_()``** on a parameter of an attached model sets that parameter's
starting flag. torchstruct notices it the next time it applies flags (when a context is entered
or left, a declaration changes, the module tree changes, or any function that reads
trainability runs). Declarations and active contexts still apply on top of it.
"""
from __future__ import annotations

import operator
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.modules import module as _module_mod
from torch.nn.modules.batchnorm import _NormBase

from .select import ParamIndex, _closest, index, select

__all__ = [
    "attach",
    "detach_hooks",
    "mark_trainable",
    "trainable_parameters",
    "is_trainable",
    "declared",
]

_BASE = "_torchstruct_base"  # attribute on a parameter: its starting flag
_WRITTEN = "_torchstruct_written"  # attribute on a parameter: the flag torchstruct last wrote
_MARK = "_torchstruct_trainable"  # attribute on a module: names from mark_trainable

# Bumped whenever any module or parameter is registered anywhere, or a declaration changes.
_generation = [0]

# Called as guard(changes, refuse) before any flag is written, with the (path, parameter,
# new flag) of every parameter whose flag would change. With refuse=True a guard raises to
# refuse the change (nothing is written); with refuse=False (leaving a context, which must
# always restore) it may only warn. torchstruct.distributed registers the one for DDP.
flag_guards: list = []


def _bump(*_args) -> None:
    _generation[0] += 1


def _on_module_registered(module: nn.Module, name: str, _submodule) -> None:
    _bump()
    if name == "_orig_mod" and type(module).__name__ == "OptimizedModule":
        module.register_forward_pre_hook(_pre_compiled_forward)


_module_mod.register_module_parameter_registration_hook(_bump)
_module_mod.register_module_module_registration_hook(_on_module_registered)

# For each module tree torchstruct last looked at: the generation, its modules' parameter
# dicts, and (weakly) the parameter objects in them. It notices parameters put in place without
# a registration hook firing: FSDP2's ``fully_shard`` writes ``module._parameters`` directly.
_trees: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _same_objects(refs: list, now: list) -> bool:
    return len(refs) == len(now) and all(map(operator.is_, [r() for r in refs], now))


def _notice_swaps(*modules: nn.Module | None) -> None:
    """Bump the generation when a tree's parameter objects changed since it was last seen
    (or it is seen for the first time). Called by entry points, not by the forward hook."""
    for module in modules:
        if module is None:
            continue
        seen = _trees.get(module)
        fresh = seen is None or seen[0] != _generation[0]  # a module may have been registered
        dicts = [m._parameters for m in module.modules()] if fresh else seen[1]
        now = [p for d in dicts for p in d.values() if p is not None]
        if seen is not None and _same_objects(seen[2], now):
            if fresh:
                _trees[module] = (_generation[0], dicts, seen[2])
            continue
        _bump()
        _trees[module] = (_generation[0], dicts, [weakref.ref(p) for p in now])


# ----------------------------------------------------------------------------- declarations
def _own_names(module: nn.Module) -> list[str]:
    return list(module._parameters) + list(module._modules)


def _check_names(module: nn.Module, names: Iterable, what: str) -> frozenset[str]:
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


def declared(module: nn.Module) -> frozenset[str] | None:
    """The names ``module`` declares trainable, or None when it declares nothing.

    :func:`mark_trainable` on the instance takes precedence over a ``trainable()`` method.
    """
    mark = module.__dict__.get(_MARK)
    if mark is not None:
        return mark
    method = getattr(type(module), "trainable", None)
    if not callable(method):
        return None
    return _check_names(module, method(module), f"{type(module).__name__}.trainable()")


def mark_trainable(module: nn.Module, *names: str | None) -> nn.Module:
    """Declare which direct parameters and child modules of ``module`` train.

    The same declaration a ``trainable()`` method makes, recorded on one instance: no
    subclassing needed. Whatever is not listed is frozen, with its subtree. ``mark_trainable(m)``
    with no names freezes all of ``m``; ``mark_trainable(m, None)`` removes the declaration.
    Flags change at once in every attached model that contains ``module``.

    Arguments:
        module: the module whose own parameters/children are named.
        *names: names of direct parameters or child modules, or a single ``None``.

    Returns:
        ``module``.

    Raises:
        ValueError: a name that is not a direct parameter or child (with the closest names).

    Example:
        >>> import torch.nn as nn, torchstruct as ts
        >>> m = nn.Linear(2, 2)
        >>> _ = ts.mark_trainable(m, "bias")
        >>> [path for path, _ in ts.trainable_parameters(m)]
        ['bias']
        >>> _ = ts.mark_trainable(m, None)
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"mark_trainable: expected an nn.Module, got {type(module).__name__}")
    before = module.__dict__.get(_MARK)
    mark = None if names == (None,) else _check_names(module, names, "mark_trainable")
    _set_mark(module, mark)
    try:
        for st in _states_containing(module) or [_state_for(module)]:
            st.apply()
    except BaseException:  # refused (a flag guard): the previous declaration stands
        _set_mark(module, before)
        for st in _states_containing(module):
            st.apply(refuse=False)
        raise
    return module


def _set_mark(module: nn.Module, mark: frozenset[str] | None) -> None:
    if mark is None:
        module.__dict__.pop(_MARK, None)
    else:
        module.__dict__[_MARK] = mark
    _bump()


def _admitted(root: nn.Module) -> set[int]:
    """Ids of the parameters that every declaration along some path of theirs admits."""
    out: set[int] = set()

    def walk(mod: nn.Module) -> None:
        names = declared(mod)
        for name, p in mod._parameters.items():
            if p is not None and (names is None or name in names):
                out.add(id(p))
        for name, child in mod._modules.items():
            if child is not None and (names is None or name in names):
                walk(child)

    walk(root)
    return out


# ----------------------------------------------------------------------------- state
@dataclass(eq=False)
class Entry:
    """One active context: ``kind`` over ``selectors`` within ``scope``'s subtree."""

    kind: str  # "freeze" | "freeze_except" | "unfreeze"
    scope: weakref.ref
    selectors: tuple
    freeze_norm_stats: bool = True
    _cache: list | None = field(default=None, repr=False)

    def resolved(self) -> tuple[list[int], set[int]] | None:
        """Ids of the scope's parameters and of the scope's modules, or None when it is gone.

        Walked once per module-tree generation (again whenever a parameter or module is
        registered anywhere).
        """
        scope = self.scope()
        if scope is None:
            return None
        if self._cache is None or self._cache[0] != _generation[0]:
            ids = [id(p) for p in scope.parameters()]
            self._cache = [_generation[0], ids, {id(m) for m in scope.modules()}, None]
        return self._cache[1], self._cache[2]

    def chosen(self) -> set[int]:
        """Ids of the selected parameters, resolved once per module-tree generation."""
        got, scope = self.resolved(), self.scope()
        if got is None or scope is None:
            return set()
        if self._cache[3] is None:
            self._cache[3] = (
                {id(p) for _, p in select(scope, *self.selectors, strict=False)}
                if self.selectors
                else set(got[0])  # no selector: the whole scope (no strong reference to it)
            )
        return self._cache[3]

    def apply(self, flags: dict[int, bool]) -> None:
        """Fold this context into ``flags`` (parameter id -> flag), within its scope."""
        got = self.resolved()
        if got is None:
            return
        ids = [i for i in got[0] if i in flags]  # only the model being applied
        if not ids:
            return
        chosen = self.chosen()
        for i in ids:
            if self.kind == "freeze" and i in chosen:
                flags[i] = False
            elif self.kind == "freeze_except" and i not in chosen:
                flags[i] = False
            elif self.kind == "unfreeze" and i in chosen:
                flags[i] = True


# Every active context of every model, outermost (oldest) first. One list, so that contexts on
# different modules that share parameters compose exactly as nested contexts do.
_entries: list[Entry] = []


def _drop_dead(_ref=None, _entries: list[Entry] = _entries) -> None:
    """Forget the contexts of models that no longer exist (also a weakref callback, which may
    run at interpreter exit, hence the list bound as a default)."""
    _entries[:] = [e for e in _entries if e.scope() is not None]


def push(entry: Entry) -> None:
    """Activate a context and apply the flags it changes at once (or refuse: nothing changes)."""
    _drop_dead()
    _entries.append(entry)
    try:
        _apply_around(entry)
    except BaseException:
        _entries.remove(entry)
        _apply_around(entry, refuse=False)
        raise


def pop(entry: Entry) -> None:
    """Deactivate a context (wherever it is in the stack) and restore the flags."""
    _entries[:] = [e for e in _entries if e is not entry]
    _drop_dead()
    _apply_around(entry, refuse=False)


def _apply_around(entry: Entry, refuse: bool = True) -> None:
    """Apply every state whose model shares a parameter with the entry's scope."""
    scope = entry.scope()
    _notice_swaps(scope, *(st.root() for st in list(_states.values())))
    got = entry.resolved()
    if scope is None or got is None:
        return
    governing = _state_for(scope)
    ids = set(got[0])
    for st in list(_states.values()):
        if st is governing or not ids.isdisjoint(st.index()[1]):
            st.apply(refuse)


@dataclass(eq=False)
class State:
    """What torchstruct keeps for one attached model (the root)."""

    root: weakref.ref
    freeze_norm_stats: bool = True
    generation: int = -1  # the module-tree generation last applied
    idx: ParamIndex | None = None
    _cache: tuple | None = None  # (generation, index, parameter ids, module ids)
    # path -> (starting flag, flag written) at the last application
    last: dict = field(default_factory=dict)
    hook: object = None
    norm_hooks: dict[int, tuple[weakref.ref, list]] = field(default_factory=dict)

    # -- the module tree, walked once per generation
    def index(self) -> tuple[ParamIndex, frozenset[int], frozenset[int]]:
        """The root's parameter index, parameter ids and module ids (cached per generation)."""
        root = self.root()
        if root is None:
            return index(nn.Module()), frozenset(), frozenset()
        if self._cache is None or self._cache[0] != _generation[0]:
            idx = index(root)
            self._cache = (
                _generation[0],
                idx,
                frozenset(id(p) for p in idx.params),
                frozenset(id(m) for m in root.modules()),
            )
        return self._cache[1:]

    # -- flags
    def apply(self, refuse: bool = True) -> None:
        """Recompute every flag of the root's parameters and write it (see ``flag_guards``)."""
        root = self.root()
        if root is None:
            return
        self.idx = idx = self.index()[0]
        for path, p in idx:
            written = getattr(p, _WRITTEN, None)
            before = self.last.get(path)
            if written is None and before is not None and before[1] is p.requires_grad:
                setattr(p, _BASE, before[0])  # a copy put in place of the parameter (FSDP2)
            elif written is not p.requires_grad:
                setattr(p, _BASE, p.requires_grad)  # first sight, or changed by hand
        flags = {id(p): getattr(p, _BASE) for p in idx.params}
        for entry in _entries:
            entry.apply(flags)
        admitted = _admitted(root)
        new = [(path, p, flags[id(p)] and id(p) in admitted) for path, p in idx]
        changes = [c for c in new if c[1].requires_grad is not c[2]]
        for guard in flag_guards if changes else ():
            guard(changes, refuse)
        for _, p, flag in new:
            if p.requires_grad is not flag:
                p.requires_grad_(flag)
            setattr(p, _WRITTEN, flag)
        self.last = {path: (getattr(p, _BASE), flag) for path, p, flag in new}
        self._sync_norm_hooks(root)
        self.generation = _generation[0]

    def refresh(self) -> None:
        """Apply when anything may have changed; cheap (no selector work) otherwise."""
        _notice_swaps(self.root())
        if (
            self.generation != _generation[0]
            or self.idx is None
            or any(getattr(p, _WRITTEN, None) is not p.requires_grad for p in self.idx.params)
        ):
            self.apply()

    # -- hooks
    def install(self) -> None:
        root = self.root()
        if self.hook is None and root is not None:
            self.hook = root.register_forward_pre_hook(_pre_forward)

    def uninstall(self) -> None:
        if self.hook is not None:
            self.hook.remove()
            self.hook = None
        for _, handles in self.norm_hooks.values():
            for h in handles:
                h.remove()
        self.norm_hooks.clear()

    def _norm_stats_frozen(self, mod: nn.Module) -> bool:
        if not (isinstance(mod, _NormBase) and mod.track_running_stats):
            return False
        params = [p for p in mod._parameters.values() if p is not None]
        enabled = self.freeze_norm_stats and all(  # only contexts whose scope holds the layer
            e.freeze_norm_stats for e in _entries if (r := e.resolved()) and id(mod) in r[1]
        )
        return enabled and bool(params) and not any(p.requires_grad for p in params)

    def _sync_norm_hooks(self, root: nn.Module) -> None:
        want = {id(m): m for m in root.modules() if self._norm_stats_frozen(m)}
        for key in list(self.norm_hooks):
            ref, handles = self.norm_hooks[key]
            if key not in want or ref() is not want[key]:
                for h in handles:
                    h.remove()
                del self.norm_hooks[key]
        if self.hook is None:  # detached: no hooks at all
            return
        for key, mod in want.items():
            if key not in self.norm_hooks:
                handles = [
                    mod.register_forward_pre_hook(_norm_pre),
                    mod.register_forward_hook(_norm_post, always_call=True),
                ]
                self.norm_hooks[key] = (weakref.ref(mod), handles)


_states: weakref.WeakKeyDictionary[nn.Module, State] = weakref.WeakKeyDictionary()


def _pre_forward(module: nn.Module, _args) -> None:
    if torch.compiler.is_compiling():  # flags are written eagerly; compiled code guards on them
        return
    st = _states.get(module) if module is not None else None
    if st is not None and st.generation != _generation[0]:
        st.apply()


def _pre_compiled_forward(wrapper: nn.Module, _args) -> None:
    """On a ``torch.compile`` wrapper: apply before the compiled frame runs (eagerly)."""
    _pre_forward(wrapper._modules.get("_orig_mod"), _args)



def _norm_pre(module: nn.Module, _args) -> None:
    module.__dict__["_torchstruct_was_training"] = module.training
    module.training = False  # normalize with, and never update, the running statistics


def _norm_post(module: nn.Module, _args, _out) -> None:
    module.training = module.__dict__.pop("_torchstruct_was_training", module.training)


def _contains(root: nn.Module | None, module: nn.Module) -> bool:
    return root is not None and any(m is module for m in root.modules())


def _states_containing(module: nn.Module) -> list[State]:
    return [st for st in list(_states.values()) if id(module) in st.index()[2]]


def _state_for(module: nn.Module) -> State:
    """The state governing ``module``: its own, an attached ancestor's, or a new one.

    A new state rooted at ``module`` replaces the states of attached descendants (their
    declarations are now read from ``module`` down).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(module).__name__}")
    st = _states.get(module)
    if st is not None:
        return st
    for other in list(_states.values()):
        if id(module) in other.index()[2]:
            return other
    st = State(weakref.ref(module))
    for root, other in list(_states.items()):
        if _contains(module, root):
            other.uninstall()
            del _states[root]
    _states[module] = st
    st.install()
    st.apply()
    return st


# ----------------------------------------------------------------------------- public
def attach(model: nn.Module, *, freeze_norm_stats: bool | None = None) -> nn.Module:
    """Install the hooks that keep ``requires_grad`` equal to effective trainability.

    Every torchstruct entry point that takes a model attaches it implicitly; calling
    ``attach`` again re-applies all flags at once (useful after code that swapped parameters
    without registering them).

    Arguments:
        model: the root module.
        freeze_norm_stats: when given, sets whether normalization layers whose parameters are
            all frozen stop updating (and use) their running statistics. Default True.

    Returns:
        ``model``.
    """
    _bump()  # re-read everything: parameters swapped without registration are seen too
    st = _state_for(model)
    if freeze_norm_stats is not None:
        st.freeze_norm_stats = bool(freeze_norm_stats)
    st.install()
    st.apply()
    return model


def detach_hooks(model: nn.Module) -> nn.Module:
    """Remove every hook torchstruct installed on ``model`` (flags stay as they are).

    Contexts still change flags at once while active; only the automatic re-application at
    forward (new parameters, new submodules) and the frozen-norm behaviour stop.
    """
    st = _states.get(model)
    if st is not None:
        st.uninstall()
    return model


def _governed(model: nn.Module) -> ParamIndex:
    """Refresh the flags governing ``model`` and return its parameter index."""
    st = _state_for(model)
    st.refresh()
    return st.idx if st.root() is model else index(model)


def trainable_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """``(path, parameter)`` for every effectively trainable parameter, tied ones once.

    Example:
        >>> import torch.nn as nn, torchstruct as ts
        >>> m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        >>> with ts.freeze(m, "0"):
        ...     [path for path, _ in ts.trainable_parameters(m)]
        ['1.weight', '1.bias']
    """
    idx = _governed(model)
    return iter([(path, p) for path, p in idx if getattr(p, _WRITTEN)])


def is_trainable(model: nn.Module, path_or_param: str | nn.Parameter) -> bool:
    """Whether one parameter of ``model`` (given by path or object) is effectively trainable.

    Raises:
        ValueError: the path names no parameter of ``model`` (closest paths listed), or the
            parameter does not belong to ``model``.
    """
    idx = _governed(model)
    if isinstance(path_or_param, str):
        for p, ps in zip(idx.params, idx.paths):
            if path_or_param in ps:
                return getattr(p, _WRITTEN)
        raise ValueError(
            f"is_trainable: {path_or_param!r} is not a parameter path of the model; closest: "
            f"{_closest(path_or_param, idx.all_paths())}"
        )
    if isinstance(path_or_param, torch.Tensor):
        for p in idx.params:
            if p is path_or_param:
                return getattr(p, _WRITTEN)
        raise ValueError("is_trainable: the given tensor is not a parameter of the model")
    raise TypeError(
        f"is_trainable: expected a path or a parameter, got {type(path_or_param).__name__}"
    )
