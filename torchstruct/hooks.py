"""Hooks make it real: writing effective trainability into ``requires_grad``, and keeping it so.

- :func:`attach` installs a forward pre-hook on a model (every entry point that changes what
  trains attaches implicitly). The hook re-applies the flags before a forward only when the
  model's own tree changed (a parameter or module registered into it); otherwise it costs a
  dictionary look-up and an attribute read.
- Normalization layers whose parameters are all frozen get a pair of hooks that hold their
  running statistics (kept, passing, while the layer is in the tree and not held: compiled
  code guards on hooks). ``attach(module, freeze_norm_stats=...)`` stores the choice on
  ``module`` itself; a layer follows the choice of its nearest ancestor-or-self that was given
  one (default True), whichever tree it is attached in.
- Every hook looks up a live owner before acting. A copy of a model (``deepcopy``,
  ``AveragedModel``, ``torch.save``/``torch.load``) carries the hook functions in its hook
  dictionaries, but no state governs the copy, so they do nothing there: the copy behaves as
  plain PyTorch until it is attached itself. :func:`detach_hooks` removes them from any model.

Before ``torch.save(model)`` of an attached model, note that the hooks are pickled by name
(``torchstruct.hooks._pre_forward``): loading the file then needs torchstruct importable.
``ts.detach_hooks(model)`` first removes every one of them (flags stay as they are), which is
also what ``torch.jit.script`` needs.
"""
from __future__ import annotations

import contextlib
import functools
import sys
import threading
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.modules import module as _module_mod
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.utils import stateless as _stateless

from . import _compile_caveats, _state
from ._checks import check_bool, refuse_inference_tensor, refuse_no_grad_dtype
from ._checks import is_exporting as _is_exporting
from .declare import effective

__all__ = ["attach", "detach_hooks"]

_NORM_OPTION = "_torchstruct_freeze_norm_stats"  # attribute on a module: attach's option
# PyTorch's containers: their insert / pop / __delitem__ write _modules without a registration
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _container_mark(m: nn.Module) -> tuple:
    """What :meth:`State.reshaped` compares: a weak reference to the container, what
    identifies its ``_modules`` and its length. A container's own ``del`` / ``pop`` put an
    ``OrderedDict`` in place, which is known by a weak reference (a new dict may be at the
    address of a freed one); the plain dict a module starts with, by its address (a freed
    one is replaced only by such an ``OrderedDict``, or by a write into ``_modules`` that
    bypasses registration, which the docs leave to ``ts.attach``)."""
    mods = m._modules
    key = id(mods) if type(mods) is dict else weakref.ref(mods)
    return weakref.ref(m), key, len(mods)


@dataclass(eq=False)
class State:
    """What torchstruct keeps for one attached model (the root, held weakly; its parameters
    through their records, see :class:`torchstruct._state.Record`)."""

    root: weakref.ref
    dirty: bool = True  # the root's tree changed since the last application
    registrations: int = 0  # registrations into the tree, ever (contexts compare it)
    # id -> weak reference of the tree's modules at the last application (an id alone may be
    # a new module's by now, at the address of one that left and was freed)
    module_ids: dict = field(default_factory=dict)
    # the root's class at the last application: FSDP2's fully_shard changes it as it puts
    # sharded parameters in place without registering them (the next forward applies, and so
    # lets go of the replaced parameters)
    kind: type = None
    # path -> (starting flag, flag written, serial, record of the parameter) at the last
    # application
    last: dict = field(default_factory=dict)
    # id -> record of the parameters at the last application
    members: dict = field(default_factory=dict)
    hook: object = None
    norm_hooks: dict = field(default_factory=dict)  # id(layer) -> (weakref, [handles])
    # (weak reference, id of its _modules dict, its length) of each container of the tree at
    # the last application: their own methods (insert, pop, del) change the tree without
    # registering
    containers: tuple = ()
    # after a registration into a module below the root, until the next application: hooks
    # on that module and the modules between it and the root (id -> handle), so that a forward
    # of any of them applies first; and the tree's parents as last applied, built at the first
    # such registration (id of a module -> weak reference to its parent)
    below: dict = field(default_factory=dict)
    parents: dict | None = None
    # id -> weak reference of the modules registered into the tree since the last application
    # (with the modules below them): a registration into one of them is one into the tree
    added: dict = field(default_factory=dict)

    def reshaped(self) -> bool:
        """Whether a container of the tree was changed by one of its own methods (``insert``,
        ``pop``, ``del m[i]``, which write its ``_modules`` without a registration) since the
        last application: the identity and length of each container's ``_modules`` (``del``
        puts a new dict in place; see :func:`_container_mark`), not a walk of the tree. The
        next forward applies; unless every change found only shrank a container (``pop``,
        ``del``), it counts as a registration (contexts see that the tree grew). Looked at
        without the lock (this runs at every forward); a change found is recorded under it,
        once (another thread may have applied meanwhile)."""
        if not self._containers_changed()[0]:
            return False
        with _state.LOCK:
            changed, grown = self._containers_changed()
            if not changed:
                return False
            self.containers = ()  # counted once; the application looks again
            (_state.grew if grown else _state.mark_changed)(self)
            return True

    def _containers_changed(self) -> tuple[bool, bool]:
        """(whether a container changed, whether one of those did not only shrink)."""
        changed = grown = False
        for ref, key, n in self.containers:
            c = ref()
            if c is not None:
                mods = c._modules
                if len(mods) == n and (id(mods) == key and type(mods) is dict
                                       if type(key) is int else key() is mods):
                    continue  # the dict _container_mark saw
                grown = grown or len(mods) >= n
            else:
                grown = True
            changed = True
        return changed, grown

    def registered_into(self, module: nn.Module, value) -> None:
        """``value`` (a parameter or module) was registered into ``module``, a module of this
        tree: until the next application, a module ``value`` brings counts as the tree's, and
        a forward of ``value`` itself (a new block of a ``ModuleList`` called on its own), of
        ``module`` or of a module between it and the root applies first (the root's own hook
        covers the root's forwards)."""
        new = isinstance(value, nn.Module)
        if new:
            for parent in value.modules():
                self.added[id(parent)] = weakref.ref(parent)
                if self.parents is not None:
                    for child in parent._modules.values():
                        if child is not None:
                            self.parents[id(child)] = weakref.ref(parent)
        root = self.root()
        if root is None or self.hook is None or (module is root and not new):
            return
        if self.parents is None:
            self.parents = {}
            stack = [root]
            while stack:
                mod = stack.pop()
                for child in mod._modules.values():
                    if child is not None and id(child) not in self.parents:
                        self.parents[id(child)] = weakref.ref(mod)
                        stack.append(child)
        if new:  # (registered before it is in ``module``'s dictionary: not found by a walk)
            self.parents[id(value)] = weakref.ref(module)
            self._hook_below(value)
        mod = module
        while mod is not None and mod is not root and (id(mod) not in self.below
                                                       or not self.below[id(mod)]):
            self._hook_below(mod)
            ref = self.parents.get(id(mod))
            mod = ref() if ref is not None else None

    def _hook_below(self, mod: nn.Module) -> None:
        """A pre-hook on ``mod`` applying the waiting change (once; not on a TorchScript
        module, which takes no Python hooks: its eager parents carry the chain)."""
        if id(mod) in self.below:
            return
        if isinstance(mod, torch.jit.ScriptModule):
            self.below[id(mod)] = ()  # (the walk goes on above it)
            return
        self.below[id(mod)] = (mod.register_forward_pre_hook(_pre_forward_below),
                               weakref.ref(mod))
        mod.__dict__[_state.BELOW] = _state.MARKED

    def _drop_below(self) -> None:
        below, self.below, self.parents = self.below, {}, None
        others = [st for st in list(_state.states.values()) if st is not self and st.below]
        for hooked in below.values():
            if not hooked:
                continue
            handle, ref = hooked
            handle.remove()
            mod = ref()
            if mod is not None and not any(id(mod) in st.below for st in others):
                mod.__dict__.pop(_state.BELOW, None)  # (another tree's hook still waits)

    def apply(self, refuse: bool = True,
              backward_done: bool = False) -> list[tuple[str, nn.Parameter, bool]]:
        """Compute every flag of the root's parameters and write it (after ``flag_guards``).

        Parameters that left the tree since the last application go back to their starting
        flag (unless someone else changed them, or another attached model holds them).

        Returns:
            ``(path, parameter, new flag)`` of every flag that changed.

        Raises:
            Exception: an invalid declaration (or a ``trainable()`` that raises). With
                ``refuse=False`` (a context exits and must restore) the flags are written
                first, such a declaration admitting the names it still has (none when it
                cannot be read).
            RuntimeError: inside a backward, a change of the tree waits (see
                :meth:`refuse_in_backward`; not with ``refuse=False``, nor with
                ``backward_done``: called as a backward ends, from its callback).
        """
        root = self.root()
        if root is None:
            return []
        with _state.LOCK:
            if refuse and not backward_done:  # (at the end of a backward, in its callback)
                self.refuse_in_backward()
            error = None
            try:
                idx, starts, flags = effective(root, self.last)
            except BaseException as err:  # noqa: BLE001 - an invalid or failing declaration
                # (or one interrupted: a KeyboardInterrupt while a context exits restores too)
                if refuse:
                    raise
                error = err  # restoring (a context exits): write what can be, then raise
                idx, starts, flags = effective(root, self.last, lenient=True)
            outside = {}  # what the model decides for the flags a running call holds
            if _state.held_flags:  # a structural_grad(wrt=) loss runs: its flags hold
                for p in idx.params:
                    if (held := _state.held_flag(p)) is not None:
                        outside[id(p)] = (p, flags[id(p)])
                        flags[id(p)] = held
            if not all(isinstance(p, nn.Parameter) and not isinstance(p, _Fake)
                       for p in idx.params) or (not _is_compiling() and _in_functional_call(root)):
                # tensors standing in for parameters (a context entered inside a forward
                # that functional_call runs; code the hooks do not see:
                # stateless._reparametrize_module used directly, the fake parameters of a
                # torch.export before is_exporting): not ours to write. Applied once the
                # parameters are back (as functional_call returns, by the root's forward, or
                # another application: the hooks below the root try once only)
                self._drop_below()
                _state.mark_changed(self)
                return []
            new = [(path, p, flags[id(p)]) for path, p in idx]
            changes = [c for c in new if c[1].requires_grad is not c[2]]
            for path, p, flag in changes:
                if flag:
                    refuse_no_grad_dtype(path, p, "it cannot be made trainable (select "
                                         "floating-point parameters only). No flag was changed.")
                if refuse:
                    refuse_inference_tensor(path, p)
            if refuse and changes:
                self._refuse_unholdable(changes, flags, idx.module_objects)
            for guard in _state.flag_guards if changes else ():
                guard(changes, refuse)
            members = {}
            for path, p, flag in new:
                if p.requires_grad is not flag:
                    write_flag(p, flag)
                members[id(p)] = _state.set_record(p, starts[id(p)][0], flag, starts[id(p)][1])
            if changes:
                moved = {id(c[1]) for c in changes}
                _compile_caveats.flags_changed(
                    m for m in idx.module_objects
                    if any(id(v) in moved for v in m._parameters.values()))
            self._release_leavers(members)
            self.members = members
            if self.last and any(path not in self.last for ps in idx.paths for path in ps):
                # parameters at new paths that no registration announced (a module slot
                # written directly, as torch.ao.quantization's convert does): contexts
                # count it as the tree growing, as they count a registration
                self.registrations += 1
            # every path of a tied parameter: a conversion that unties it (new objects at
            # each path) gives each copy the record of the parameter it replaces
            self.last = {
                path: (starts[id(p)][0], flags[id(p)], starts[id(p)][1], members[id(p)])
                for p, paths in zip(idx.params, idx.paths) for path in paths
            }
            for p, flag in outside.values():
                _state.decided_outside(p, flag)
            modules = idx.module_objects
            self.module_ids = {id(m): weakref.ref(m) for m in modules}
            self.added = {}
            self.containers = tuple(_container_mark(m) for m in modules
                                    if isinstance(m, _CONTAINERS))
            self._sync_norm_hooks(modules)
            self.dirty = False
            self._drop_below()
            self.kind = type(root)
            root.__dict__.pop(_state.CHANGED, None)
            if error is not None:
                raise error
            return changes

    def changed(self, root: nn.Module) -> bool:
        """Whether the tree of ``root`` (this state's) changed since the last application: a
        registration, FSDP2's class change, a container changed by its own methods."""
        return self.dirty or self.kind is not type(root) or bool(
            self.containers and self.reshaped())

    def refuse_in_backward(self) -> None:
        """Raise (``RuntimeError``, nothing changed) inside a backward when a change of the tree
        made since the last application waits (never while none was made yet: a first
        application has nothing to wait for): applying it would change flags half-way through
        the backward."""
        root = self.root()
        if root is not None and in_backward() and self.module_ids and self.changed(root):
            raise RuntimeError(_IN_BACKWARD)

    def _release_leavers(self, now: dict) -> None:
        """The parameters of the last application not in ``now`` left the tree: they get their
        starting flag back and are forgotten, unless another attached model holds them, or the
        scope of an active context (a block on a module that was taken out), which keeps them
        until it ends (:func:`release_kept`)."""
        leavers = {k: r for k, r in self.members.items() if k not in now}
        if leavers:
            held = {i for st in _state.live_states() if st is not self for i in st.live_members()}
            _release_unheld(leavers, held, in_callback=False)

    def release(self) -> None:
        """The root is gone: its parameters that live on (a kept submodule) and its norm layers
        become plain PyTorch again, except those an active context's scope holds (until it
        ends); other attached models holding some re-apply at their next forward. Runs as a
        weakref callback: no lock taken, ``states`` not changed.

        The parameters are still held here (by their records, and by the dying tree, which
        Python clears after this callback), so every one of them gets its flag back, also
        those about to be freed. A callback may run anywhere (garbage collection), also
        inside a ``torch.func`` transform, which refuses ``requires_grad_()``: the flags are
        written as attributes, and an error is never raised from here."""
        others = [st for st in list(_state.states.values()) if st is not self and st.root()]
        mine = self.live_members()
        sharing = [st for st in others if not st.live_members().isdisjoint(mine)]
        for st in sharing:
            _state.mark_changed(st)
        _release_unheld(self.members, {i for st in others for i in st.live_members()},
                        in_callback=True)
        self.members, self.last = {}, {}
        self.uninstall()
        _apply_now_if_safe(sharing)

    def holds_module(self, module: nn.Module) -> bool:
        """Whether ``module`` (this very object) was in the tree at the last application, or
        was registered into it since."""
        for ids in (self.module_ids, self.added):  # (a plain loop: traced by dynamo)
            ref = ids.get(id(module))
            if ref is not None and ref() is module:
                return True
        return False

    def live_members(self) -> set[int]:
        """Ids of the parameters of the last application that torchstruct still follows (a
        forgotten record holds no parameter, and its id may belong to another object by
        now)."""
        return {i for i, rec in self.members.items() if rec.p is not None}

    # -- hooks
    def install(self) -> None:
        root = self.root()
        if self.hook is None and root is not None:
            self.hook = root.register_forward_pre_hook(_pre_forward)
            self._sync_norm_hooks(list(root.modules()))

    def uninstall(self) -> None:
        if self.hook is not None:
            self.hook.remove()
            self.hook = None
        self._drop_below()
        for key, (ref, handles) in self.norm_hooks.items():
            for h in handles:
                h.remove()
            _state.frozen_norms.pop(key, None)
            if (mod := ref()) is not None:
                _release_mode(mod)  # the hold ended: a mode left by a forward, back
        self.norm_hooks.clear()

    def _norm_stats_frozen(self, mod: nn.Module) -> bool:
        """Whether ``mod`` is a normalization layer whose statistics are to be held, the
        option given to ``attach`` aside (see :func:`_opted_out`)."""
        if not (isinstance(mod, _NormBase) and mod.track_running_stats):
            return False
        params = _layer_params(mod)
        if not params or any(_state.flag_outside_blocks(p) for p in params):
            return False
        if not any(_frozen_by_us(p) for p in params):  # frozen by PEFT or by hand: plain
            return False
        return not _context_opts_out(mod)

    def _refuse_unholdable(self, changes: list, flags: dict, modules: list) -> None:
        """``RuntimeError`` before any write when ``changes`` freeze every parameter of a
        TorchScript normalization layer with running statistics: a ScriptModule takes no
        Python hooks, so torchstruct could not hold its statistics (a training forward would
        update them although the layer is frozen), unless its hold was opted out of."""
        freezing = {id(p) for _, p, flag in changes if not flag}
        layers = [m for m in modules if freezing and _scripted_stat_norm(m)]
        off = _opted_out(self.root()) if layers else set()
        for mod in layers:
            params = list(mod.parameters())
            if (id(mod) in off or _context_opts_out(mod)
                    or not any(id(p) in freezing for p in params)
                    or any(flags.get(id(p), p.requires_grad) for p in params)):
                continue
            path = next(n for n, m in self.root().named_modules() if m is mod)
            raise RuntimeError(
                f"cannot freeze the TorchScript {mod.original_name} at {path!r}: torchstruct "
                "holds a frozen normalization layer's running statistics through Python "
                "hooks, which a ScriptModule does not take, so a training forward would "
                "update them. Use the eager module, put it in eval() and pass "
                "freeze_norm_stats=False (to ts.attach or the context) to let PyTorch's own "
                "rule apply, or keep one of its parameters trainable. No flag was changed.")

    def _sync_norm_hooks(self, modules: list[nn.Module]) -> None:
        want = {}
        if self.hook is not None:  # detached: no hooks at all
            want = {id(m): m for m in modules if self._norm_stats_frozen(m)}
        if want:  # the options are read only when some layer would be held
            off = _opted_out(self.root())
            want = {key: m for key, m in want.items() if key not in off}
        # a layer's hooks stay while it is in the tree, also while it is not held (they pass
        # then): compiled code guards on a module's hooks, and hooks registered anew at every
        # hold would make each compiled step compile again
        in_tree = {id(m) for m in modules}
        for key in list(self.norm_hooks):
            ref, handles = self.norm_hooks[key]
            mod = ref()
            gone = (self.hook is None or mod is None or key not in in_tree
                    or handles[0].id not in mod._forward_pre_hooks)  # detach_hooks
            if gone or (key in want and want[key] is not mod):
                for h in handles:
                    h.remove()
                del self.norm_hooks[key]
                _state.frozen_norms.pop(key, None)
            elif key not in want:
                _state.frozen_norms.pop(key, None)  # not held now: the hooks pass
            if mod is not None and key not in want:
                _release_mode(mod)  # the hold ended: a mode left by a forward, back
        for key, mod in want.items():
            if key not in self.norm_hooks:
                self.norm_hooks[key] = (weakref.ref(mod), [
                    mod.register_forward_pre_hook(_norm_pre),
                    mod.register_forward_hook(_norm_post, always_call=True),
                    mod.register_load_state_dict_post_hook(_norm_loaded),
                ])
            held = _state.frozen_norms.get(key)
            if held is None or held[0]() is not mod:  # a hold begins: what it keeps, from now
                _state.frozen_norms[key] = (weakref.ref(mod), getattr(mod, "momentum", None),
                                            list(_stats_version(mod)))


def _context_opts_out(mod: nn.Module) -> bool:
    """Whether a context entered with ``freeze_norm_stats=False`` holds ``mod`` in its scope."""
    for entry in _state.entries:
        scope = entry.scope()
        if not entry.freeze_norm_stats and scope is not None and any(
            m is mod for m in scope.modules()
        ):
            return True
    return False


def _scripted_stat_norm(mod: nn.Module) -> bool:
    """Whether ``mod`` is a TorchScript batch or instance norm that tracks running statistics
    (scripted or traced, it is no ``_NormBase``: it is known by its ``running_mean`` buffer)."""
    return (isinstance(mod, torch.jit.ScriptModule)
            and getattr(mod, "running_mean", None) is not None)  # (traced: no constants kept)


def write_flag(p: nn.Parameter, flag: bool) -> None:
    """``p.requires_grad_(flag)``; for an uninitialized lazy parameter (an ``nn.Lazy*`` module
    before its first forward), which refuses every method, the attribute itself: the flag is
    the object's own and stays with it when the first forward materializes it in place."""
    if nn.parameter.is_lazy(p):
        p.requires_grad = flag
    else:
        p.requires_grad_(flag)


def _opted_out(root: nn.Module | None) -> set[int]:
    """Ids of the modules of ``root``'s tree given ``freeze_norm_stats=False``: by ``attach`` on
    themselves or, failing that, on their nearest ancestor that was given an option.

    One walk, in ``named_modules`` order: a module reachable by several paths follows its
    first (canonical) path. Options given above ``root`` do not reach into its tree."""
    off: set[int] = set()
    seen: set[int] = set()
    stack = [(root, True)] if root is not None else []
    while stack:
        mod, inherited = stack.pop()
        if id(mod) in seen:
            continue
        seen.add(id(mod))
        option = mod.__dict__.get(_NORM_OPTION, inherited)
        if not option:
            off.add(id(mod))
        children = [c for c in mod._modules.values() if c is not None]
        stack.extend((c, option) for c in reversed(children))
    return off


def _frozen_by_us(p) -> bool:
    """Whether torchstruct holds ``p`` frozen (its starting flag is on); while a running
    ``structural_grad(wrt=)`` block holds its flag, as the model decides it without the
    block."""
    rec = _state.record(p)
    if rec is None or not rec[0]:
        return False
    if _state.held_flags and _state.held_flag(p) is not None:
        return not _state.flag_outside_blocks(p)
    return not rec[1] and not p.requires_grad


def _release(members: dict, keep: set[int], in_callback: bool = False) -> set[int]:
    """Give the parameters in ``members`` (id -> record), except ``keep``, their starting flag
    back, unless someone else wrote their flag since; forget their records. With
    ``in_callback`` (see :meth:`State.release`) nothing raises.

    Returns:
        The ids of the parameters forgotten."""
    out = set()
    for key, hit in list(members.items()):
        p = hit.p
        if p is None or key in keep:
            continue
        rec = _state.record(p)
        if rec is not None and p.requires_grad is rec[1] and rec[0] is not rec[1]:
            if not in_callback:
                write_flag(p, rec[0])
            else:
                try:
                    p.requires_grad = rec[0]
                except Exception:  # noqa: BLE001 - never raise from garbage collection
                    pass
        _state.forget(p)
        out.add(key)
    return out


def _scoping(skip=None) -> dict:
    """id of a parameter -> the first active context (other than ``skip``) whose scope holds
    it. Reads modules only: safe in a weakref callback."""
    out: dict = {}
    for entry in list(_state.entries):
        scope = entry.scope() if entry is not skip else None
        if scope is not None:
            for p in scope.parameters():
                out.setdefault(id(p), entry)
    return out


def _release_unheld(leavers: dict, held: set[int], in_callback: bool, skip=None) -> None:
    """Release ``leavers`` (id -> record, parameters that left a tree), except those in
    ``held`` (another attached model holds them: theirs now) and those in the scope of an
    active context, which keeps them until it ends."""
    scoping = _scoping(skip)
    for key, rec in leavers.items():
        entry = scoping.get(key)
        if key not in held and entry is not None and rec.p is not None:
            entry.kept.setdefault(key, rec)
    released = _release(leavers, held | set(scoping), in_callback)
    if not in_callback:
        _state.forget_decisions(released)


def release_kept(entry, in_callback: bool = False) -> None:
    """``entry`` (a context) ended, or its scope was collected: the parameters it kept (they
    left their tree while its scope held them) are released, unless an attached model holds
    them now (the scope itself, attached when the context was left) or another active
    context's scope does. With ``in_callback`` nothing raises and no state is dropped."""
    kept, entry.kept = entry.kept, {}
    if not kept:
        return
    live = ([st for st in list(_state.states.values()) if st.root() is not None]
            if in_callback else _state.live_states())
    held = {i for st in live for i in st.live_members()}
    _release_unheld(kept, held, in_callback, skip=entry)


def _apply_now_if_safe(sharing: list, backward_done: bool = False) -> None:
    """A model was collected: the attached models that shared parameters with it apply at once
    (its declarations no longer hold their shared parameters), so that flags and reads agree
    right away. Only where that is safe: no thread holds the lock (a collection may start
    inside a locked region of this thread, half-way through a change) and no ``torch.func``
    transform (which refuses flag writes) runs, and not for a model a running
    ``functional_call`` shares modules with (its parameters may stand in there); otherwise
    their next forward applies, as it would anyway. Inside a backward, at its end (flags
    changed half-way through it would change what a checkpoint's recomputation records). Runs
    in a weakref callback: never raises (a failing declaration, or a change a guard refuses,
    such as a parameter DDP does not synchronize starting to train, changes no flag here and is
    raised at the next forward)."""
    if _transforming():
        return
    sharing = [st for st in sharing if st.root() is None or not _in_functional_call(st.root())]
    if not sharing:
        return
    if not backward_done and in_backward():
        torch.autograd.Variable._execution_engine.queue_callback(
            functools.partial(_apply_now_if_safe, sharing, True))
        return
    if not _state.LOCK.enter_if_free():
        return
    try:
        for st in sharing:
            try:
                st.apply(backward_done=backward_done)  # all or nothing: a refusal raises
                # before any flag is written
            except Exception:  # noqa: BLE001 - never raise from garbage collection
                _state.mark_changed(st)  # the next forward applies, and raises there
    finally:
        _state.LOCK.__exit__(None, None, None)


def _released_when_dead(state: weakref.ref):
    def callback(_root: weakref.ref) -> None:
        st = state()
        if st is not None and _state is not None:  # None: the interpreter is exiting
            st.release()

    return callback


# ----------------------------------------------------------------------------- the hooks
# Constant-folded to True while dynamo traces; a plain function returning False otherwise.
_is_compiling = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)
# True inside a torch.func transform (vmap, grad, ...), which refuses requires_grad_(): a change
# of the tree seen at a forward there waits for the next forward outside
_transforming = torch._C._are_functorch_transforms_active
_GRAPH_TASK = getattr(torch._C, "_current_graph_task_id", None)


_IN_BACKWARD = (
    "torchstruct: this call runs inside a backward (an activation checkpoint's recomputation "
    "entering a flag context again, or a hook autograd runs), and it would apply a change of "
    "the model's tree made after the forward (a module or parameter registered since): flags "
    "would change half-way through the backward, and a recomputation would no longer record "
    "what the forward did. Nothing was changed. Register modules before the forward or after "
    "the backward."
)


def in_backward() -> bool:
    """Whether autograd runs a backward in this thread now: a forward there is an activation
    checkpoint's recomputation (or a hook's), which must record what the forward recorded. A
    change of the tree registered since the forward waits for the next forward outside (an
    application there would change flags half-way through the backward)."""
    return _GRAPH_TASK is not None and _GRAPH_TASK() != -1


# While torch.export traces (_is_exporting, strict or not), which allows no eager code in its
# graph, a change of the tree seen there waits for the next forward outside (the traced program
# does not read flags); non-strict export runs on fake parameters, which an application never
# takes for the model's own (State.apply)
try:
    from torch._subclasses.fake_tensor import FakeTensor as _Fake
except ImportError:  # pragma: no cover - a torch without fake tensors
    class _Fake:
        pass
# torch.func.functional_call runs the forward with its tensors written straight into the
# modules' dictionaries (no registration), and puts the parameters back the same way after it:
# an application there would take stand-ins that are Parameters for the model's own (and let go
# of the real ones). It is made before the call and once it has returned (_functional_call)
_FUNCTIONAL_CALL_IMPL = getattr(_stateless, "_functional_call", None)
_FUNCTIONAL_CALL = frozenset(f.__code__ for f in [_FUNCTIONAL_CALL_IMPL] if f)


def _in_functional_call(root: nn.Module | None = None) -> bool:
    """Whether a ``torch.func.functional_call`` runs below this frame (walks the stack: only
    asked when a change waits); with ``root``, one whose module shares modules with ``root``'s
    tree (whose parameters may stand in ``root``'s places: another model called inside that
    forward, a frozen teacher, has its own parameters in place)."""
    return bool(_calls_running(root))


def _calls_running(root: nn.Module | None) -> list:
    """The modules of the ``functional_call``s running below this frame (of those that share
    modules with ``root``'s tree, when given; ``None`` for one whose module is not known)."""
    calls = []
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code in _FUNCTIONAL_CALL:
            called = frame.f_locals.get("module")
            if not isinstance(called, nn.Module):
                calls.append(None)
            elif root is None or _overlap(root, called):
                calls.append(called)
        frame = frame.f_back
    return calls


def _wait_for_calls(calls: list) -> None:
    """A change that waits for the running ``functional_call``s to return: their modules
    carry the mark until then, so that compiled code around the call, which reads only the
    called module's mark, applies it as the call returns (see :func:`_apply_around_call`)."""
    for called in calls:
        if called is not None:
            called.__dict__[_state.CHANGED] = _state.MARKED


def _overlap(a: nn.Module, b: nn.Module) -> bool:
    """Whether one of two modules is in the other's tree."""
    return any(m is b for m in a.modules()) or any(m is a for m in b.modules())


def _functional_call(module, *args, **kwargs):
    """``torch.nn.utils.stateless._functional_call`` (what ``torch.func.functional_call``
    calls) between two tries at the applications waiting for ``module`` (see
    :func:`_apply_around_call`): a change made before the call is applied before it, as a
    forward does, and one made while it ran (a model sharing a layer collected) once the
    model's own parameters are back (an invalid declaration raises then). A model trained
    only through ``functional_call`` gets its flags and is not left with a change waiting
    for good. Not after a call that raised (the next forward applies)."""
    _apply_around_call(module)
    out = _FUNCTIONAL_CALL_IMPL(module, *args, **kwargs)
    _apply_around_call(module)
    return out


def _apply_around_call(module) -> None:
    """In compiled code only where ``module`` carries the mark of a change (an attached root
    whose tree changed, or a module whose call met a change waiting: :func:`_wait_for_calls`;
    a graph break then, and compiled code guards on the mark anyway), and not while
    ``torch.export`` traces."""
    if not _is_compiling():
        _apply_waiting(module)
    elif getattr(module, _state.CHANGED, False) and not _is_exporting():
        _apply_waiting_eagerly(module)


def _apply_waiting(module) -> None:
    """Around ``functional_call(module, ...)``, while the model's own parameters are in place:
    apply the attached models whose change waits, as their forward would: those whose root is
    ``module`` or below it (any change of their tree), and those with a registration waiting
    below their root at ``module``. Not inside another ``functional_call``, a ``torch.func``
    transform, a backward or ``torch.export`` (the next forward or call outside them applies).

    Raises:
        Exception: an invalid declaration, as the forward raises it.
    """
    if not isinstance(module, nn.Module) or _transforming() or in_backward() or _is_exporting():
        return
    waiting = [st for st in list(_state.states.values()) if st.hook is not None and (
        st.dirty or (st.root() is not None and st.changed(st.root())))]
    if not waiting and _state.CHANGED not in module.__dict__:
        return
    with _state.LOCK:
        if _state.states.get(id(module)) is None:
            module.__dict__.pop(_state.CHANGED, None)  # a mark the call carried (_wait_for_calls)
        inside = {id(m) for m in module.modules()} if waiting else ()
        for st in waiting:
            root = st.root()
            if root is None or _in_functional_call(root):
                continue
            if (id(root) in inside and st.changed(root)) or (id(module) in st.below and st.dirty):
                st.apply()


_apply_waiting_eagerly = torch.compiler.disable(_apply_waiting)
if _FUNCTIONAL_CALL_IMPL is not None:
    _stateless._functional_call = functools.wraps(_FUNCTIONAL_CALL_IMPL)(_functional_call)


def _pre_forward(module: nn.Module, _args) -> None:
    if _is_compiling():  # flags are written eagerly; compiled code guards on them
        if getattr(module, _state.CHANGED, False) and not _is_exporting():
            # guarded: a registration makes it retrace
            _apply_eagerly(module)  # a graph break: runs eagerly, before the traced forward
        return
    st = _state.states.get(id(module))
    if st is None:
        return
    if (st.changed(module) and st.root() is module and not _transforming() and not _is_exporting()
            and not in_backward() and not _in_functional_call(module)):
        st.apply()


@torch.compiler.disable
def _apply_eagerly(module: nn.Module) -> None:
    """Inside compiled code (``module.compile()``, a compiled step calling the model): apply
    the change of ``module``'s tree outside the graph. A copy carrying the mark (``deepcopy``)
    has no state: the mark is dropped."""
    with _state.LOCK:
        st = _state.state_of(module)
        if st is None or st.hook is None:
            module.__dict__.pop(_state.CHANGED, None)
        elif st.dirty and not in_backward():
            calls = _calls_running(module)
            if calls:
                _wait_for_calls(calls)
            else:
                st.apply()


def _pre_forward_below(module: nn.Module, _args) -> None:
    """On a module below an attached root, while a registration into the tree at or under
    ``module`` waits for an application (see :meth:`State.registered_into`): apply it now,
    before ``module``'s forward runs on its own (``model.encoder(x)``). Outside compiled code
    (a graph break there, only while the change waits; a copy of the module, whose mark
    reads false, has no state and breaks nothing); not while ``torch.export`` traces."""
    if _is_exporting() or (_is_compiling() and not getattr(module, _state.BELOW, False)):
        return
    _apply_below(module)


@torch.compiler.disable
def _apply_below(module: nn.Module) -> None:
    if _transforming() or in_backward():
        return
    calls = _calls_running(module)
    if calls:
        _wait_for_calls(calls)
        return
    with _state.LOCK:
        for st in _state.live_states():
            if id(module) in st.below and st.dirty and st.hook is not None:
                st.apply()


def _pre_compiled_forward(wrapper: nn.Module, _args) -> None:
    """On a ``torch.compile`` wrapper: apply before the compiled frame runs (eagerly), also
    a change waiting below an attached root when the wrapper holds a module above it."""
    module = wrapper._modules.get("_orig_mod")
    _pre_forward(module, _args)
    if any(id(module) in st.below for st in list(_state.states.values())):
        _pre_forward_below(module, _args)


def _on_module_registered(module: nn.Module, name: str, _submodule) -> None:
    if name == "_orig_mod" and type(module).__name__ == "OptimizedModule":
        module.register_forward_pre_hook(_pre_compiled_forward)


_module_mod.register_module_module_registration_hook(_on_module_registered)


def _held(module: nn.Module) -> bool:
    """Whether a live state holds ``module``'s statistics now. Not while one of its parameters
    requires grad (unfrozen by hand since the last application; a flag a running
    ``structural_grad(wrt=)`` block turned on for its loss counts as it was before: the loss
    sees the layer as ``loss(model)`` does; inside a ``swap`` or ``stop_gradient`` block, the
    parameters' own flags, not their stand-ins'; tensors ``functional_call`` put in their
    places count as the last application found the layer), nor while the layer was
    switched to a cumulative average since the hold began (``momentum=None``: what
    ``torch.optim.swa_utils.update_bn`` does to recompute the statistics on purpose)."""
    hit = _state.frozen_norms.get(id(module))
    if hit is None or hit[0]() is not module:
        return False
    with torch._C.DisableTorchFunction():  # the parameters' own flags, not a block's stand-ins'
        if any(_state.flag_outside_blocks(p) for p in _layer_params(module)
               if _state.handle(p) is not None):  # (a functional_call's stand-in: as applied)
            return False  # unfrozen since the last application (a write by hand): plain
    return not (module.momentum is None and hit[1] is not None)


def _layer_params(module: nn.Module) -> list:
    """A normalization layer's parameters: its own, and where a parametrization moved them
    (``parametrizations.weight.original``), those below it."""
    if not module._modules:
        return [p for p in module._parameters.values() if p is not None]
    return list(module.parameters())


def _stats_version(module: nn.Module) -> tuple:
    """``(address of running_mean's tensor, its version counter)``: which tensor holds the
    statistics and how often it was written (``(None, -1)`` without statistics). An address,
    not a weak reference: ``torch.utils.swap_tensors`` refuses tensors that have one, and a
    swap (``load_state_dict`` under the future flag) gives the buffer a new address."""
    stats = getattr(module, "running_mean", None)
    if stats is None:
        return (None, -1)
    if nn.parameter.is_lazy(stats):  # a lazy layer before its first forward: no tensor yet
        return (_LAZY, -1)
    return (stats._cdata, stats._version)


_LAZY = "lazy"  # the statistics of a hold begun before a lazy layer's first forward


def _settle_lazy(module: nn.Module, hit) -> None:
    """A hold begun before lazy ``module`` had statistics: the ones it has now, once
    materialized (by its first forward, or a ``load_state_dict``), are where the hold starts."""
    stats = getattr(module, "running_mean", None)
    if stats is not None and not nn.parameter.is_lazy(stats):
        hit[2][:] = _stats_version(module)


def _norm_loaded(module: nn.Module, _keys) -> None:
    """After a ``load_state_dict`` of a normalization layer with hooks: a lazy one's loaded
    statistics settle its hold (a later reset is then seen as one)."""
    hit = _state.frozen_norms.get(id(module))
    if hit is not None and hit[0]() is module and hit[2][0] is _LAZY:
        _settle_lazy(module, hit)


def _refuse_reset(module: nn.Module) -> None:
    """Raise if held batch norm ``module``, built with ``momentum=None``, had its statistics
    reset since the hold began: what ``update_bn`` does before recomputing them, which cannot be
    told apart from any other forward for such a layer (its momentum is ``None`` all along).

    Only Python reads while the same ``running_mean`` tensor was not written; after a write (a
    reset, a load) or a new tensor in its place (``.to(dtype)``, ``.half()``,
    ``load_state_dict(assign=True)``: the new tensor's version counter says nothing of the old
    one's) the count is read once: 0 is what a reset leaves, and raises; any other count
    (loaded or converted trained statistics) becomes the new starting point."""
    hit = _state.frozen_norms.get(id(module))
    if hit is None or hit[0]() is not module:
        return  # the hold ended (in another thread) since this forward found the layer held
    _, momentum, (held, version) = hit
    stats = getattr(module, "running_mean", None)
    if momentum is not None or (stats is None and held is None):
        return
    if not isinstance(module, nn.modules.batchnorm._BatchNorm):
        return  # update_bn recomputes batch norms only; instance norms never count batches
    if held is _LAZY:  # materialized by this forward (fresh statistics, not a reset; a load
        _settle_lazy(module, hit)  # settles them as it materializes them): held from here on
        return
    if not module.training:
        return  # an eval forward updates nothing, held or not: decided at the next train one
    if stats is not None and held == stats._cdata and stats._version == version:
        return  # nothing wrote the statistics since the hold began
    count = getattr(module, "num_batches_tracked", None)
    if stats is not None and count is not None and int(count) == 0:
        raise RuntimeError(
            f"The running statistics of {type(module).__name__} (momentum=None) were reset while "
            "torchstruct holds them (the layer is frozen): with momentum=None, recomputing them "
            "(torch.optim.swa_utils.update_bn) cannot be told apart from an ordinary forward, so "
            "they would stay at their reset values. Run update_bn on an AveragedModel or a copy, "
            "outside the context that freezes the layer, or attach with freeze_norm_stats=False."
        )
    hit[2][:] = _stats_version(module)


_WAS_TRAINING = "_torchstruct_was_training"  # a held layer's saved mode while forwards run
# The mode a held forward runs in: falsy, as eval() leaves it, yet not the ``False`` that
# ``eval()`` writes (nor the ``True`` of ``train()``), so a mode the user sets while the forward
# runs is told apart from ours by identity, and kept.
_HELD_OFF = 0
# around a layer's saved mode: read, counted and written at once. Re-entrant: a garbage
# collection inside the locked region may end a hold (a weakref callback), which puts back
# a mode under it
_MODE_LOCK = threading.RLock()


@dataclass(eq=False)
class _SavedMode:
    """A held layer's mode before its held forwards, and those forwards running: ``(thread
    id, frame that called the hooks)`` each, one per pair of hooks that ran (a layer shared by
    two attached trees carries two). The last to end puts the mode back."""

    was: bool
    calls: list = field(default_factory=list)

    def __reduce__(self):  # a copy (deepcopy, pickle) of a layer keeps the mode, not frames
        return (_SavedMode, (self.was,))


def _norm_pre(module: nn.Module, _args) -> None:
    # Only a layer a live state holds, never a copy's.
    if not _held(module):
        _release_mode(module)  # a mode left by an interrupted forward: back
    elif _is_compiling():  # traced code runs in one thread; dynamo refuses a lock there
        saved = module.__dict__.get(_WAS_TRAINING)
        if not isinstance(saved, bool):
            _refuse_reset(module)
            module.__dict__[_WAS_TRAINING] = _mode_before(module, saved)
        module.training = False  # normalize with, and never update, the running statistics
    else:
        here, me = sys._getframe(1), threading.get_ident()
        with _MODE_LOCK:
            saved = module.__dict__.get(_WAS_TRAINING)
            calls = [c for c in getattr(saved, "calls", ()) if _running(c, me, here)]
            if not calls:
                _refuse_reset(module)
            module.__dict__[_WAS_TRAINING] = _SavedMode(_mode_before(module, saved),
                                                        [*calls, (me, here)])
            module.training = _HELD_OFF  # normalize with, and never update, the statistics


def _mode_before(module: nn.Module, saved) -> bool:
    """The mode to put back after the held forward starting now: the layer's own when nothing
    was saved; else the one saved before the held forwards running (or left by one a
    BaseException ended), unless the user set one since."""
    if saved is None:
        return module.training
    if isinstance(saved, bool):  # a traced forward's (which switched the layer to False)
        return saved
    return saved.was if module.__dict__.get("training") is _HELD_OFF else module.training


def _running(call: tuple, me: int, here) -> bool:
    """Whether held forward ``call`` has not ended: this thread's while the frame that called
    its hooks is on the stack (a KeyboardInterrupt ends a forward without its ``always_call``
    hook); another thread's while that thread lives."""
    who, frame = call
    if who != me:  # while that thread lives: walking another thread's running frames is unsafe
        return who in sys._current_frames()  # (it crashed the interpreter)
    while here is not None and here is not frame:
        here = here.f_back
    return here is not None


def _norm_post(module: nn.Module, _args, _out) -> None:
    """The layer's mode back after its forward, unless the user set one while it ran (or
    another thread's held forward of the layer still runs: the last to end puts it back).
    torch runs this hook (``always_call``) after a forward that raised an Exception, not after
    a BaseException (``KeyboardInterrupt``): the mode such a forward left is put back when the
    hold ends (``State._sync_norm_hooks``) or at the layer's next forward, whichever comes
    first."""
    if _is_compiling():
        _put_back(module)
        return
    with _MODE_LOCK:
        saved = module.__dict__.get(_WAS_TRAINING)
        if isinstance(saved, _SavedMode):
            me = threading.get_ident()
            mine = [i for i, (who, _) in enumerate(saved.calls) if who == me]
            if mine:  # this thread's latest (its forwards of the layer nest)
                saved.calls = saved.calls[:mine[-1]] + saved.calls[mine[-1] + 1:]
            if saved.calls:
                return
        _put_back(module)


def _release_mode(module: nn.Module) -> None:
    """The hold ended: the mode its forwards saved, back (see :func:`_put_back`)."""
    if _WAS_TRAINING not in module.__dict__:
        return
    if _is_compiling():
        _put_back(module)
        return
    with _MODE_LOCK:
        _put_back(module)


def _put_back(module: nn.Module) -> None:
    """Put back the mode held forwards saved, unless the user set one since: ``train()`` or
    ``eval()`` while a forward ran or after one a BaseException ended."""
    saved = module.__dict__.pop(_WAS_TRAINING, None)
    if saved is not None:
        module.training = _mode_before(module, saved)


_OURS = (_pre_forward, _pre_forward_below, _pre_compiled_forward, _norm_pre, _norm_post)


# ----------------------------------------------------------------------------- states
def _contains(root: nn.Module | None, module: nn.Module) -> bool:
    return root is not None and any(m is module for m in root.modules())


def _governing(module: nn.Module) -> State | None:
    """The existing state governing ``module``: its own, or an attached ancestor's."""
    st = _state.state_of(module)
    if st is not None:
        return st
    for other in _state.live_states():
        if _contains(other.root(), module):
            return other
    return None


def state_for(module: nn.Module) -> State:
    """The state governing ``module``: its own, an attached ancestor's, or a new one.

    A new state rooted at ``module`` replaces the states of attached descendants (their
    declarations are now read from ``module`` down; options given to ``attach`` live on the
    modules and stay). Active contexts governed by a replaced state count registrations from
    the new one on (:func:`_rebase_entries`). Call under the lock.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(module).__name__}")
    st = _governing(module)
    if st is not None:
        return st
    st = State(None)
    st.root = weakref.ref(module, _released_when_dead(weakref.ref(st)))
    replaced = [other for other in _state.live_states() if _contains(module, other.root())]
    before = _entry_governors() if replaced else []
    for other in replaced:
        other.uninstall()
        _state.states.pop(id(other.root()), None)
        st.members.update(other.members)  # released at the first application if gone
    _state.states[id(module)] = st
    try:
        st.install()
    except BaseException:  # e.g. a scripted module refuses Python hooks: no state is left
        _unmake(st, module, replaced)
        raise
    _rebase_entries(before)
    return st


def _unmake(st: State, module: nn.Module, replaced: list) -> None:
    """Drop the new state ``st`` rooted at ``module``; the attached models it replaced are
    back, as they were."""
    before = _entry_governors() if replaced else []
    st.uninstall()
    if _state.states.get(id(module)) is st:
        del _state.states[id(module)]
    st.members, st.last = {}, {}
    for other in replaced:
        _state.states[id(other.root())] = other
        other.install()
    _rebase_entries(before)


@contextlib.contextmanager
def attached_or_as_before(module):
    """A call that may attach ``module`` (:func:`state_for`) runs in the block. When it raises
    and no attached model governed ``module`` before, none does after: its new state and hooks
    are dropped, with the records the call made, and the attached models it replaced are
    back. Call under the lock."""
    if not isinstance(module, nn.Module) or _governing(module) is not None:
        yield
        return
    replaced = [other for other in _state.live_states() if _contains(module, other.root())]
    known = set(_state.records)
    try:
        yield
    except BaseException:
        st = _state.state_of(module)
        if st is not None:
            _unmake(st, module, replaced)
        for p in module.parameters():
            if id(p) not in known:
                _state.forget(p)
        raise


def _entry_governors() -> list:
    """``(entry, governing state)`` of every active context."""
    return [(e, _governing(s)) for e in _state.entries if (s := e.scope()) is not None]


def _rebase_entries(before: list) -> None:
    """A context's ``registrations`` is its governing state's count when it was entered; where
    the governing state changed since ``before``, shift it by the difference of the two counts,
    so that leaving the context measures the registrations into its tree since it was entered."""
    for entry, old in before:
        scope = entry.scope()
        new = _governing(scope) if scope is not None else None
        if old is not None and new is not None and new is not old:
            entry.registrations += new.registrations - old.registrations


def apply_pending(module: nn.Module) -> None:
    """Apply now what the hooks would apply at the next forward of the trees holding ``module``
    (a registration since their last application)."""
    with _state.LOCK:
        for st in _state.live_states():
            if st.holds_module(module) and (st.dirty or st.reshaped()):
                st.apply()


def apply_recorded(st: State, refuse: bool, applied: list | None, only: list | None) -> list:
    """``st.apply(refuse)``, appending ``st`` to ``applied`` once it applied; with ``only``,
    nothing unless ``st`` is one of those (undoing a refused change: a state that refused
    wrote nothing, and applying it leniently would write the flags of a declaration that is
    not valid). Returns the changes."""
    if only is not None and not any(st is o for o in only):
        return []
    changes = st.apply(refuse)
    if applied is not None:
        applied.append(st)
    return changes


def apply_containing(module: nn.Module, refuse: bool = True, applied: list | None = None,
                     only: list | None = None) -> None:
    """Apply every state whose tree contains ``module`` (attaching ``module`` if none does),
    and the other attached models sharing parameters with those (one flag, written once for
    all of them). ``applied``, ``only``: see :func:`apply_recorded`."""
    def apply(st) -> None:
        apply_recorded(st, refuse, applied, only)

    with _state.LOCK:
        found = [st for st in _state.live_states() if _contains(st.root(), module)]
        found = found or [state_for(module)]
        for st in found:
            apply(st)
        mine = set().union(*(st.live_members() for st in found))
        for st in _state.live_states():
            if st not in found and not st.live_members().isdisjoint(mine):
                apply(st)


# ----------------------------------------------------------------------------- public
def attach(model: nn.Module, *, freeze_norm_stats: bool | None = None) -> nn.Module:
    """Install the hooks that keep ``requires_grad`` equal to effective trainability.

    Every torchstruct entry point that changes what trains attaches implicitly; calling
    ``attach`` again re-applies all flags at once (useful after code that swapped parameters
    without registering them).

    Arguments:
        model: the module to attach (a submodule of an attached model is governed by that
            model's hooks; attaching its parent later makes one tree of both).
        freeze_norm_stats: when given (True or False), sets whether the normalization layers
            of ``model``'s subtree whose parameters are all frozen (by torchstruct) stop
            updating, and normalize with, their running statistics. The choice is stored on
            ``model`` and inherited by its subtree: a layer follows the nearest
            ancestor-or-self given an option (its own wins over its parent's, whichever was
            given first), True when none was. Omitted, every stored option stays as it is.
            It survives attaching a parent, :func:`detach_hooks` and re-attaching, and is
            copied with the module (``deepcopy``). A context's own ``freeze_norm_stats=False``
            still keeps plain behaviour for the layers in its scope while it is active.

    Returns:
        ``model``.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or ``freeze_norm_stats`` is neither
            None nor a bool (nothing changes).
    """
    check_bool(freeze_norm_stats, "freeze_norm_stats", "attach", none=True)
    with _state.LOCK, attached_or_as_before(model):
        st = state_for(model)
        st.install()
        missing = object()
        old = model.__dict__.get(_NORM_OPTION, missing)
        if freeze_norm_stats is not None:
            model.__dict__[_NORM_OPTION] = freeze_norm_stats
        try:
            st.apply()
        except BaseException:  # a refused application: the option stays as it was
            if old is missing:
                model.__dict__.pop(_NORM_OPTION, None)
            else:
                model.__dict__[_NORM_OPTION] = old
            raise
    return model


def detach_hooks(model: nn.Module) -> nn.Module:
    """Remove every hook torchstruct installed on ``model`` and its submodules (flags, and the
    ``freeze_norm_stats`` options given to :func:`attach`, stay).

    Also removes the inert hooks a copy of an attached model carries (``deepcopy``,
    ``torch.load``). Contexts still change flags at once while active; only the automatic
    re-application at forward (new parameters, new submodules) and the frozen-norm behaviour
    stop. Needed before ``torch.jit.script``, and before ``torch.save`` when the file must load
    without torchstruct.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"detach_hooks: expected an nn.Module, got {type(model).__name__}")
    with _state.LOCK:
        st = _state.state_of(model)
        if st is not None:
            st.uninstall()
        for mod in model.modules():
            for hooks in (mod._forward_pre_hooks, mod._forward_hooks):
                for key in [k for k, h in hooks.items() if h in _OURS]:
                    del hooks[key]
                    mod._forward_hooks_always_called.pop(key, None)
            _release_mode(mod)  # a mode an interrupted held forward left (on a copy too): back
    return model
