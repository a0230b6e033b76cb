"""Contexts that change which parameters train for a block, and restore exactly afterwards.

Each context is a class that applies at construction and restores at ``__exit__`` (the
``torch.set_grad_enabled`` convention):

- ``with ts.freeze_except(model, "head"): ...`` is temporary;
- a bare ``ts.freeze_except(model, "head")`` is permanent;
- ``@ts.freeze_except(model, "head")`` on a function applies per call, not at decoration.

They nest (the innermost wins), compose, and restore the previous flags also when the block
raises.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Callable, ClassVar

from torch import nn

from . import _checkpoints, _state, hooks
from ._checks import check_bool, refuse_while_exporting
from .select import ParamIndex, index, select

__all__ = ["freeze", "freeze_except", "unfreeze", "RestoredFlagsWarning"]


# ----------------------------------------------------------------------------- the stack
@dataclass(eq=False)
class Entry:
    """One active context: ``kind`` over ``selectors`` within ``scope``'s subtree.

    A context decides once per parameter whether its selectors pick it: the parameters present
    at construction then, a parameter added later when it first appears (a copy put in place
    of one, ``load_state_dict(assign=True)``, inherits the decision). So what a block selected
    stays selected until it exits, whatever happens to paths (a ``Sequential`` renumbered) or
    to the flags a callable selector reads.
    """

    kind: str  # "freeze" | "freeze_except" | "unfreeze"
    scope: weakref.ref
    selectors: tuple
    freeze_norm_stats: bool = True
    # the governing state's registration count when entered; shifted when a new state (an
    # attached parent) replaces it (hooks.state_for), so that the difference at exit counts
    # the registrations into the tree while the context was active
    registrations: int = 0
    serial: int = 0  # set when pushed: later contexts have larger serials
    # id of a parameter -> (the parameter, whether the selectors pick it). The parameter is
    # held while torchstruct follows it (its id is never reused meanwhile); once forgotten (it
    # left every attached tree) a _state.Left stands in for it, which knows it again if it
    # comes back (held again once registered back into an attached tree) and does not keep it
    # alive. All dropped when the context ends or its scope is
    # collected. No weak reference: torch.utils.swap_tensors refuses a tensor that has one.
    decided: dict = field(default_factory=dict)
    # the governing state's members and last application when entered (see hooks.State; the
    # records they hold are emptied when torchstruct forgets a parameter)
    present: dict = field(default_factory=dict)
    present_paths: dict = field(default_factory=dict)
    # id -> record of the parameters that left their attached tree while the scope held them
    # (a block on a module that was taken out): held for the block, released when it ends
    kept: dict = field(default_factory=dict)
    # without selectors, on a module below the root of its tree: the ids of its parameters
    # when entered (what it selected; None: the whole tree)
    inside: frozenset | None = None

    def decide(self, scope: nn.Module, idx: ParamIndex, params: list, strict: bool = False,
               lenient: bool = False, remember: bool = True) -> set[int]:
        """Record what the selectors pick among ``params`` of ``scope`` (indexed as ``idx``);
        a callable selector is asked about these only. Returns the ids picked. ``lenient``
        (restoring: a context exits): a selector that raises picks none of them, and nothing
        is recorded (the next application asks again, and raises). ``remember=False`` (a
        read): nothing is recorded either (the application decides when it comes)."""
        if remember and len(self.decided) > 2 * len(idx.params) + 64:  # forget the gone
            here = {id(p) for p in idx.params}
            self.decided = {k: v for k, v in self.decided.items() if k in here or (
                not v[0].gone() if isinstance(v[0], _state.Left)
                else _state.handle(v[0]) is not None)}
        if len(params) < len(idx.params):
            asked = {id(p) for p in params}
            rows = [(p, ps) for p, ps in zip(idx.params, idx.paths) if id(p) in asked]
            idx = ParamIndex(tuple(p for p, _ in rows), tuple(ps for _, ps in rows),
                             idx.modules, idx.module_objects)
        try:
            chosen = {id(p) for _, p in select(scope, *self.selectors, strict=strict, idx=idx)}
        except Exception:
            if not lenient:
                raise
            return set()
        if remember:
            for p in params:
                self.decided[id(p)] = (p, id(p) in chosen)
        return chosen

    def selected(self, scope: nn.Module, idx: ParamIndex, params: list, starts: dict,
                 lenient: bool = False, remember: bool = True) -> set[int]:
        """Ids of ``params`` the selectors pick, deciding for those seen the first time
        (``lenient``, ``remember``: see :meth:`decide`)."""
        if not self.selectors:
            return {id(p) for p in params}
        out, new = set(), []
        for p in params:
            hit = self._decision(p, remember)
            if hit is None:
                source = starts[id(p)][2]  # the record of the parameter p is a copy of
                was = source.p if source is not None else None
                hit = self._decision(was, remember) if was is not None else None
                if hit is None:
                    new.append(p)
                    continue
                if remember:
                    self.decided[id(p)] = (p, hit)
            if hit:
                out.add(id(p))
        if new:
            out |= self.decide(scope, idx, new, lenient=lenient, remember=remember)
        return out

    def _decision(self, p, remember: bool = True) -> bool | None:
        """Whether the selectors picked ``p`` (None: not decided yet). A parameter that left
        and came back is held again (``remember``: that is recorded)."""
        hit = self.decided.get(id(p))
        if hit is None or hit[0] is p:
            return None if hit is None else hit[1]
        if isinstance(hit[0], _state.Left) and hit[0].holds(p):
            if remember:
                self.decided[id(p)] = (p, hit[1])
            return hit[1]
        return None

    def end(self, in_callback: bool = False) -> None:
        """The context ended (or, ``in_callback``, its scope was collected): drop what it
        holds of the parameters, and release those it kept."""
        self.decided, self.present, self.present_paths, self.inside = {}, {}, {}, None
        hooks.release_kept(self, in_callback)

    def fold(self, flags: dict[int, bool], starts: dict, root: nn.Module,
             root_index: ParamIndex, lenient: bool = False, remember: bool = True) -> None:
        """Fold this context into ``flags`` (parameter id -> flag of ``root``'s parameters,
        indexed as ``root_index``; ``starts`` as :func:`~torchstruct.declare.effective`),
        within its scope, except for parameters whose flag someone wrote after it applied
        (``lenient``, ``remember``: see :meth:`decide`)."""
        scope = self.scope()
        if scope is None:
            return
        idx = root_index if scope is root else index(scope)
        params = [p for p in idx.params if id(p) in flags and starts[id(p)][1] < self.serial]
        if not params:
            return
        chosen = self.selected(scope, idx, params, starts, lenient, remember)
        for p in params:
            i = id(p)
            if self.kind == "freeze" and i in chosen:
                flags[i] = False
            elif self.kind == "freeze_except" and i not in chosen:
                flags[i] = False
            elif self.kind == "unfreeze" and i in chosen:
                flags[i] = True


def _scope_of(entry: Entry, model: nn.Module) -> weakref.ref:
    """A weak reference to ``model`` (the scope of ``entry``) that ends the entry when the
    model is collected: its decisions then hold none of the model's parameters."""
    entry_ref = weakref.ref(entry)

    def ended(_model: weakref.ref) -> None:
        e = entry_ref()
        if e is not None:
            try:
                e.end(in_callback=True)
            except Exception:  # noqa: BLE001 - the interpreter is exiting (modules torn down)
                pass

    return weakref.ref(model, ended)


def _swapped(entries: list, olds: list, news: list) -> list:
    """``entries`` with ``olds`` replaced by ``news`` where the first of ``olds`` stood (contexts
    entered since stay inner to it), or ``news`` last when there is no old one."""
    if not olds or olds[0] not in entries:
        return [e for e in entries if e not in olds] + news
    at = entries.index(olds[0])
    return [e for e in entries[:at] if e not in olds] + news + [
        e for e in entries[at:] if e not in olds]


def _drop_dead() -> None:
    """Forget the contexts of models that no longer exist (under the lock, at every push and
    pop; until then a dead scope's entry folds nothing)."""
    _state.entries[:] = [e for e in _state.entries if e.scope() is not None]


@contextlib.contextmanager
def _changing_entries():
    """Under the lock, a change of the stack of contexts: afterwards, reentrant checkpoints
    remember the flags the contexts decide while any is active (:mod:`._checkpoints`)."""
    with _state.LOCK:
        try:
            _drop_dead()
            yield
        finally:
            _checkpoints.keep_flags(bool(_state.entries))


def _refuse_in_backward(entry: Entry) -> None:
    """Entering a context inside a backward (a checkpoint's recomputation entering a decorated
    function's context again) while a change of the tree waits on a model the context would
    apply: refused before anything changes (its restoring pass would apply the change too)."""
    scope = entry.scope()
    if scope is None or not hooks.in_backward():
        return
    governing = hooks.state_for(scope)
    ids = {id(p) for p in scope.parameters()} | governing.live_members()
    for st in _state.live_states():
        if st is governing or not ids.isdisjoint(st.live_members()):
            st.refuse_in_backward()


def _apply_around(entry: Entry, refuse: bool = True, applied: list | None = None,
                  only: list | None = None) -> list:
    """Apply every state whose model shares a parameter with the entry's scope; the changes.
    ``applied``, ``only``: see :func:`hooks.apply_recorded`."""
    scope = entry.scope()
    if scope is None:
        return []
    governing = hooks.state_for(scope)
    changes, errors = [], []

    def apply(st) -> None:
        nonlocal changes
        try:
            changes += hooks.apply_recorded(st, refuse, applied, only)
        except BaseException as err:  # noqa: BLE001 - restoring: every tree first, then raise
            if refuse:
                raise
            errors.append(err)

    apply(governing)
    others = [s for s in _state.live_states() if s is not governing]
    if others:  # other attached models holding the scope's parameters: applied too
        ids = (governing.live_members() if governing.root() is scope and not governing.dirty
               else {id(p) for p in scope.parameters()})  # the root just applied: its own
        for st in others:
            if not ids.isdisjoint(st.live_members()):
                apply(st)
    if errors:
        raise errors[0]
    return changes


def push(entry: Entry) -> None:
    """Activate a context and apply the flags it changes at once (or refuse: nothing changes)."""
    with _changing_entries(), hooks.attached_or_as_before(entry.scope()):
        scope = entry.scope()
        _refuse_in_backward(entry)
        entry.serial = _state.next_serial()
        _state.entries.append(entry)
        applied: list = []
        try:
            _apply_around(entry, applied=applied)
        except BaseException:
            _state.entries.remove(entry)
            try:
                if applied:  # the states that wrote flags before another refused
                    _apply_around(entry, refuse=False, only=applied)
            finally:
                entry.end()
            raise
        _count_from_now(entry)
        _state.applied_through = entry.serial
        _remember_present(entry)


def _count_from_now(entry: Entry) -> None:
    """The registrations into ``entry``'s tree, counted once its own application has run: what
    that application found (a module put in place by a direct slot write before the block) was
    not added inside the block."""
    scope = entry.scope()
    entry.registrations = hooks.state_for(scope).registrations if scope is not None else 0


def pop(entry: Entry) -> None:
    """Deactivate a context (wherever it is in the stack) and restore the flags."""
    with _changing_entries():
        _state.entries[:] = [e for e in _state.entries if e is not entry]
        scope = entry.scope()
        governing = hooks.state_for(scope) if scope is not None else None
        if governing is not None:
            governing.reshaped()  # a container changed by its own methods inside the block
        try:
            changes = _apply_around(entry, refuse=False)
            said = _undone(entry, changes)
        finally:
            entry.end()
    warn_undone(f"ts.{entry.kind}", **said)


def _undone(entry: Entry, changes: list) -> dict:
    """What leaving ``entry`` (its exit's application made ``changes``) may have undone that
    code inside it wrote (call under the lock, before the entry ends): the arguments of
    :func:`warn_undone` but the block's name."""
    scope = entry.scope()
    governing = hooks.state_for(scope) if scope is not None else None
    grown = governing is not None and governing.registrations != entry.registrations
    # the exit's application walked the tree: what left it is known, added to or not (a
    # parameter deleted and a buffer registered in its place registers nothing)
    left = _left_changed(entry, vanished_only=not grown)
    if entry.kind == "unfreeze":
        return {"turned_on": [], "born": [], "left": [], "grown": grown, "left_on": left,
                "turned_off": [path for path, _, flag in changes if not flag] if grown else []}
    return {"turned_on": [path for path, _, flag in changes if flag] if grown else [],
            "born": _born_frozen(entry) if grown else [], "left": left, "grown": grown}


def exchange(old: "_FlagContext | None", new: "_FlagContext | None") -> None:
    """Lift ``old`` and hold ``new`` (a context from ``_FlagContext.prepared``) in one
    application: a flag change a guard refuses (DDP) raises, with both as they were.

    ``old`` and ``new`` are contexts on the same model (or None); ``new`` ends active.
    """
    olds = [old._entry] if old is not None and old._active else []
    news = [new._entry] if new is not None else []
    anchor = (news or olds or [None])[0]
    if anchor is None:
        return
    with _changing_entries(), hooks.attached_or_as_before(anchor.scope()):
        saved = list(_state.entries)
        model = anchor.scope()
        if model is not None:  # a container changed by its own methods since: seen
            hooks.state_for(model).reshaped()
        for entry in news:  # a stage change continues the stage it replaces: its serial
            entry.serial = olds[0].serial if olds else _state.next_serial()
        _state.entries[:] = _swapped(saved, olds, news)
        applied: list = []
        try:
            changes = _apply_around(anchor, applied=applied)
        except BaseException:
            _state.entries[:] = saved
            try:
                if applied:  # (see push)
                    _apply_around(anchor, refuse=False, only=applied)
            finally:
                for entry in news:
                    entry.end()
            raise
        for entry in news:
            _count_from_now(entry)
        _state.applied_through = max([_state.applied_through] + [e.serial for e in news])
        try:  # what leaving the old stage may have undone, as a block's exit says it
            said = [_undone(entry, changes) for entry in olds]
        finally:
            for entry in news:
                _remember_present(entry)
            for entry in olds:
                entry.end()
    if old is not None:
        old._active = False
    if new is not None:
        new._active = True
    for kwargs in said:
        warn_undone("a stage of ts.UnfreezeSchedule", **kwargs)


def _remember_present(entry: Entry) -> None:
    """What the entry's tree held when it was entered (references, no copies: an application
    replaces these dictionaries, never changes them)."""
    scope = entry.scope()
    if scope is not None:
        st = hooks.state_for(scope)
        entry.present, entry.present_paths = st.members, st.last
        if not entry.selectors and st.root() is not scope:  # the whole of a part of the tree
            entry.inside = frozenset(map(id, scope.parameters()))


def _born_frozen(entry: Entry) -> list[str]:
    """Paths of the parameters of the entry's scope that appeared inside the block, started
    from ``requires_grad=False`` and are frozen now (call under the lock, after the exit's
    application)."""
    scope = entry.scope()
    if scope is None:
        return []
    inside = {id(p) for p in scope.parameters()}
    out, seen = [], set()
    for path, (base, flag, _, rec) in hooks.state_for(scope).last.items():
        p = rec.p
        if p is None or id(p) not in inside or base or flag or id(p) in seen:
            continue
        seen.add(id(p))
        was = entry.present.get(id(p))
        if was is not None and was.p is p:
            continue
        before = entry.present_paths.get(path)
        if before is None or before[0]:  # new, not a copy of a parameter frozen before
            out.append(path)
    return out


def _left_changed(entry: Entry, vanished_only: bool = False) -> list[str]:
    """Paths (as when the block was entered) of the parameters whose flag the block changed
    (froze one whose starting flag is on; for ``unfreeze``, turned on one whose starting flag
    is off) and that left its scope's tree inside the block (call under the lock, after the
    exit's application, before the entry ends). ``vanished_only``: only those whose path
    holds no parameter now (nothing was registered into the tree: a parameter at the same
    path is the old one's copy, such as a dtype conversion's, which the exit restored with
    it). A parameter at the same path whose flag is the starting one after the exit (a copy
    put there by ``load_state_dict(assign=True)``) is not named either."""
    scope = entry.scope()
    if scope is None:
        return []
    changed_from = entry.kind != "unfreeze"  # the starting flag the block changes
    st = hooks.state_for(scope)
    now = st.members
    if entry.present.keys() <= now.keys():  # nothing left (the usual case: one C-level pass)
        return []
    key_of = {id(rec): key for key, rec in entry.present.items()}
    out = []
    for path, (base, _, _, rec) in entry.present_paths.items():
        key = key_of.get(id(rec))
        if base is not changed_from or key is None or key in now:
            continue
        held = st.last.get(path)  # what holds the path now: one with that flag again is fine
        if held is not None and (vanished_only or held[1] is changed_from):
            continue
        if entry.selectors:
            hit = entry.decided.get(key)
            if hit is None:
                continue
            picked = hit[1]
        else:  # no selector: the whole scope
            picked = entry.inside is None or key in entry.inside
        if picked is (entry.kind != "freeze_except"):  # selected, or not by freeze_except
            out.append(path)
    return out


def _names(paths: list[str]) -> str:
    more = f" and {len(paths) - 5} more" if len(paths) > 5 else ""
    return ", ".join(repr(p) for p in paths[:5]) + more


def warn_undone(block: str, turned_on: list[str], born: list[str], left: list[str],
                grown: bool = True, left_on: list[str] = (), turned_off: list[str] = ()
                ) -> None:
    """Leaving ``block`` (its name, for the message), in which modules were added (``grown``;
    else only ``left`` can be non-empty): a same-value ``requires_grad_(False)``
    written inside it (``get_peft_model`` freezing the base model) cannot be told apart from
    the block's own freezing, and is undone; a parameter created inside it may have copied
    the flag the block wrote (a parametrization such as ``weight_norm``) and stays frozen; a
    frozen parameter that left may have been replaced by something that copied its flag
    (``left_on``: a parameter an ``unfreeze`` block turned on that left, by something that
    copied the True it had); leaving an ``unfreeze`` block, a same-value
    ``requires_grad_(True)`` written inside it is undone (``turned_off``). Say so, naming the
    parameters."""
    said = []
    if turned_on:
        said.append(
            f"{len(turned_on)} parameter(s) return to requires_grad=True: {_names(turned_on)}. "
            "If code inside the block froze them on purpose (e.g. get_peft_model), that write "
            "could not be told apart from the block's own and is undone: freeze them again "
            "after the block (ts.freeze(model, ...) without `with`), or make the change outside "
            "the block."
        )
    if turned_off:
        said.append(
            f"{len(turned_off)} parameter(s) return to requires_grad=False: "
            f"{_names(turned_off)}. If code inside the block unfroze them on purpose, that "
            "write could not be told apart from the block's own and is undone: unfreeze them "
            "again after the block (ts.unfreeze(model, ...) without `with`), or make the change "
            "outside the block."
        )
    if born:
        said.append(
            f"{len(born)} parameter(s) created inside the block started from "
            f"requires_grad=False and stay frozen: {_names(born)}. If they took that flag from a "
            "parameter the block froze (a parametrization such as weight_norm copies it), "
            "unfreeze them after the block (ts.unfreeze(model, ...) without `with`), or make "
            "the change outside the block."
        )
    if left:
        said.append(
            f"{len(left)} parameter(s) the block froze left the model inside it: "
            f"{_names(left)}. If code put something in their place that copied the flag the "
            "block wrote (remove_parametrizations(leave_parametrized=True) of a "
            "parametrization with several originals, such as weight_norm, registers a result "
            "that does not require grad as a buffer), it does not train now: make that change "
            "outside the block, or register it as a trainable parameter again."
        )
    if left_on:
        said.append(
            f"{len(left_on)} parameter(s) frozen before the block, that the block unfroze, "
            f"left the model inside it: {_names(left_on)}. If code put something in their "
            "place that copied the flag the block wrote (a parametrization such as weight_norm "
            "copies it into its originals), it trains now: freeze it again after the block "
            "(ts.freeze(model, ...) without `with`), or make that change outside the block."
        )
    if said:
        what = ("modules or parameters were added to the model inside the block"
                if grown else "the model changed inside the block")
        warnings.warn(
            f"leaving {block}: {what}, and " + " Also, ".join(said),
            RestoredFlagsWarning,
            stacklevel=_outside_level(),
        )


def _outside_level() -> int:
    """The ``stacklevel`` (for a ``warnings.warn`` in the caller) of the first frame outside
    torchstruct: the user's ``with`` line, or the call of a decorated function."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("torchstruct"):
        frame, level = frame.f_back, level + 1
    return level


class RestoredFlagsWarning(UserWarning):
    """Leaving a context turned parameters back on that code inside it may have frozen."""


# ----------------------------------------------------------------------------- the classes
class _Context:
    """Apply at construction, undo at ``__exit__``; as a decorator, apply per call."""

    _depth = 0  # how many `with` blocks entered it and have not exited yet

    def __init__(self, *args, **kwargs) -> None:
        self._args, self._kwargs = args, kwargs
        self._active = False
        self._apply()
        self._active = True

    def _apply(self) -> None:  # validate everything first: a bad input changes nothing
        raise NotImplementedError

    def _undo(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        if not self._active:
            self._apply()
            self._active = True
        self._depth += 1
        return self

    def __exit__(self, *exc) -> bool:
        if self._depth > 1:  # the same object entered again inside its own block: the
            self._depth -= 1  # outer block still holds it
            return False
        self._depth = 0
        if self._active:
            self._active = False
            self._undo()
        return False

    def _fresh(self) -> "_Context":
        return type(self)(*self._args, **self._kwargs)

    def __call__(self, fn: Callable) -> Callable:
        """Decorate ``fn``: the context applies during each call (for a generator function
        or an ``async def`` function, while its body runs: around each resumption, not
        between them, so other code running meanwhile does not see it)."""
        if not self._depth:  # decorating applies nothing (a `with` block of it stays)
            self.__exit__(None, None, None)
        if inspect.isasyncgenfunction(fn):
            raise TypeError(
                f"{type(self).__name__} cannot decorate the async generator function "
                f"{fn.__qualname__}: enter it with `with` inside the function's body instead")
        if inspect.isgeneratorfunction(fn):
            @functools.wraps(fn)
            def per_resume(*args, **kwargs):
                return (yield from self._resumed(fn(*args, **kwargs)))

            return per_resume
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def per_await(*args, **kwargs):
                return await _Awaiting(self._resumed(fn(*args, **kwargs)))

            return per_await

        @functools.wraps(fn)
        def per_call(*args, **kwargs):
            with self._fresh():
                return fn(*args, **kwargs)

        return per_call

    def _resumed(self, gen):
        """Run ``gen`` (a generator or a coroutine) to its end with a fresh context around
        each of its resumptions; what it yields is yielded, what it returns is returned.

        Blocks the body entered after the context and still holds across a suspension stay
        inner to it: each fresh context goes below them (they win, as in one long block)."""
        held: list = []
        try:
            with self._resumption(held):
                response = gen.send(None)
            while True:
                try:
                    request = yield response
                except GeneratorExit:
                    with self._resumption(held):
                        gen.close()
                    raise
                except BaseException as err:  # noqa: BLE001 - thrown in: passed on
                    with self._resumption(held):
                        response = gen.throw(err)
                else:
                    with self._resumption(held):
                        response = gen.send(request)
        except StopIteration as stop:
            return stop.value

    @contextlib.contextmanager
    def _resumption(self, held: list):
        """A fresh context for one resumption, below ``held`` (the blocks the body entered in
        earlier resumptions and still holds); ``held`` is updated when this one ends: what
        the body entered during it and still holds is added, what it left is dropped (blocks
        that were above for another reason, another generator's, are not the body's)."""
        ctx = self._fresh()
        try:
            ctx._sink_below(held)
            before = ctx._above()
        except BaseException:
            ctx._suspend()
            raise
        try:
            yield
        finally:
            try:
                held[:] = [x for x in ctx._above()
                           if _among(x, held) or not _among(x, before)]
            finally:
                ctx._suspend()

    # the stacks a context kind lives in (flag contexts: torchstruct's stack of contexts;
    # stop_gradient / swap: the thread's torch function modes; constant: those and the
    # dispatch modes), for a decorated generator's resumptions; by default order is moot
    def _above(self) -> list:
        """What was entered after this context, in its kind's stacks, and is active now."""
        return []

    def _sink_below(self, items: list) -> None:
        """Move this (active) context below the first of ``items`` still active."""

    def _suspend(self) -> None:
        """Lift this context at the end of a resumption, wherever it is in its stacks (the
        body may hold blocks entered after it)."""
        self.__exit__(None, None, None)


def _among(x, items: list) -> bool:
    return any(x is y for y in items)


class _Awaiting:
    """An awaitable driven by a generator (what :meth:`_Context._resumed` makes)."""

    def __init__(self, gen) -> None:
        self._gen = gen

    def __await__(self):
        return self._gen


class _FlagContext(_Context):
    kind: ClassVar[str]
    needs_selector: ClassVar[bool] = False

    def __init__(
        self, model: nn.Module, *selectors, strict: bool = True, freeze_norm_stats: bool = True
    ) -> None:
        super().__init__(model, *selectors, strict=strict, freeze_norm_stats=freeze_norm_stats)

    @classmethod
    def prepared(cls, model: nn.Module, *selectors, strict: bool = True,
                 freeze_norm_stats: bool = True) -> "_FlagContext":
        """The context, validated but not applied: :func:`exchange` applies it."""
        ctx = cls.__new__(cls)
        ctx._args = (model, *selectors)
        ctx._kwargs = {"strict": strict, "freeze_norm_stats": freeze_norm_stats}
        ctx._active = False
        ctx._entry = ctx._make_entry()
        return ctx

    def _apply(self) -> None:
        push(self._make_entry())

    def _make_entry(self) -> Entry:
        """Validate the arguments (raises before any change) and build the stack entry."""
        model, *selectors = self._args
        who = type(self).__name__
        refuse_while_exporting(f"ts.{who}")
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"{who}: first argument must be an nn.Module, got {type(model).__name__}"
            )
        check_bool(self._kwargs["strict"], "strict", who)
        check_bool(self._kwargs["freeze_norm_stats"], "freeze_norm_stats", who)
        if not selectors:
            if self.needs_selector:
                raise TypeError(f"{who} needs at least one selector")
            selectors = []  # the whole of ``model`` (an empty tuple means that to Entry)
        self._entry = Entry(self.kind, None, tuple(selectors), self._kwargs["freeze_norm_stats"])
        self._entry.scope = _scope_of(self._entry, model)  # a permanent context ends with it
        if selectors:  # decided now for the parameters present; raises before any change
            idx = index(model)
            self._entry.decide(model, idx, list(idx.params), self._kwargs["strict"])
        return self._entry

    def _undo(self) -> None:
        pop(self._entry)

    def _above(self) -> list:
        entries = _state.entries
        at = next((i for i, e in enumerate(entries) if e is self._entry), len(entries))
        return entries[at + 1:]

    def _sink_below(self, items: list) -> None:
        with _changing_entries():
            entries = _state.entries
            first = next((i for i, e in enumerate(entries) if any(e is x for x in items)), None)
            mine = next((i for i, e in enumerate(entries) if e is self._entry), None)
            if first is None or mine is None or mine < first:
                return
            entries.pop(mine)
            entries.insert(first, self._entry)
            _apply_around(self._entry, refuse=False)


class freeze(_FlagContext):
    """Turn the selected parameters off (all of ``model`` when no selector is given).

    Arguments (the same for :class:`freeze_except` and :class:`unfreeze`):
        model: the module whose parameters are selected.
        *selectors: see :func:`~torchstruct.select`.
        strict: when True (default), a selector that matches nothing raises.
        freeze_norm_stats: whether normalization layers whose parameters are all frozen stop
            updating their running statistics (default True).

    Raises (all before anything changes):
        TypeError: ``model`` is not a module, a selector has an unsupported type, or
            ``strict`` / ``freeze_norm_stats`` is not a bool (``None`` or ``"no"`` are not
            read by truthiness).
        ValueError: a selector matching nothing (closest paths named), a module or parameter
            that is not part of ``model``, an empty list of selectors.

    Example:
        >>> import torch.nn as nn, torchstruct as ts
        >>> m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        >>> with ts.freeze(m, "0"):
        ...     m[0].weight.requires_grad
        False
        >>> m[0].weight.requires_grad
        True
    """

    kind = "freeze"


class freeze_except(_FlagContext):
    """Turn every parameter of ``model`` off except the selected (which stay as they are).

    Arguments and errors as :class:`freeze`.

    Example:
        >>> import torch.nn as nn, torchstruct as ts
        >>> m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        >>> with ts.freeze_except(m, "1.*"):
        ...     [p.requires_grad for p in m.parameters()]
        [False, False, True, True]
    """

    kind = "freeze_except"
    needs_selector = True


class unfreeze(_FlagContext):
    """Turn the selected parameters on (all of ``model`` when no selector is given).

    Arguments and errors as :class:`freeze`; also ``ValueError`` naming a selected parameter
    whose dtype cannot require grad (an integer one), nothing changed.

    A declaration (``trainable()`` / :func:`~torchstruct.mark_trainable`) still wins: unfreeze
    lifts contexts and starting flags, not declarations.
    """

    kind = "unfreeze"
