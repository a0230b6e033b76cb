"""The one owner of torchstruct's process-wide state: small, locked, and owned by the live models.

Everything torchstruct remembers between calls lives here, and nowhere else:

- ``records``: per parameter, a :class:`Record`: its *starting flag*, the flag torchstruct last
  wrote, and the serial of the newest context or declaration a write by someone else overrides
  (see below). Kept here, not as attributes of the parameter, so that a copy of a parameter
  (``deepcopy``, ``torch.save``) carries nothing of ours and behaves as plain PyTorch.
- ``states``: the attached models (roots), keyed by ``id``; each :class:`~torchstruct.hooks.State`
  holds its root weakly.
- ``entries``: the active contexts of every model, outermost (oldest) first. Each context (and
  each ``mark_trainable`` declaration) gets a serial when it is made; ``applied_through`` is the
  newest serial whose flags were written. A flag found different from the one torchstruct last
  wrote was written by someone else after every context and declaration up to
  ``applied_through`` applied, so those no longer apply to it: the write stands until they are
  lifted (later ones still apply on top of it).
- ``frozen_norms``: the normalization layers whose running statistics are held right now.
- ``held_flags``: the flags of the ``structural_grad(wrt=)`` calls whose loss runs now.
- ``flag_guards``: callbacks consulted before flags change (``torchstruct.distributed``).

**No weak reference to a parameter.** ``torch.utils.swap_tensors`` (what ``module.to()``,
``.half()`` and ``load_state_dict`` use for tensor-subclass parameters, or under
``torch.__future__.set_swap_module_params_on_conversion(True)``) refuses a tensor that has one,
and it keeps the parameter's identity (the same Python object, new contents): everything
here follows the object. A :class:`Record` holds its parameter strongly, and is owned by the
attached trees: it exists while the parameter is in one (it is written at each application),
and is emptied (:func:`forget`) at the application after the parameter left every attached tree,
or when the last model holding it is collected. A model is held weakly (modules may be), so a
dropped model and its parameters are freed. The other tables that know a parameter hold its
record (a state's last application, what a context found when it was entered: an emptied record
matches no parameter), or hold the parameter for no longer than its record lives (a context's
decisions: :func:`forget_decisions`, dropped too when the context ends or its model is
collected).

Every change of these happens under :data:`LOCK` (re-entrant), so contexts entered and left
from several threads compose as if they ran one after another. While a thread holds it, the
stand-ins of its ``stop_gradient`` / ``swap`` blocks are lifted (:func:`without_stand_ins`):
flags are read and written on the parameters themselves.

A registration anywhere in the process (``register_parameter``, ``add_module``, attribute
assignment) marks *only the attached trees that contain the module registered into* as
changed: building an unrelated module costs the attached models nothing.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import weakref

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.modules import module as _module_mod

_lifting = threading.local()  # .frames: this thread's lifted stand-in modes, one list per lift


@contextlib.contextmanager
def without_stand_ins():
    """Within the block, this thread's torch function modes that stand tensors in for
    parameters (``stop_gradient`` and ``swap`` blocks: modes with a true ``stands_in``
    attribute) are lifted, every other mode staying in its order: code here reads and writes
    the parameters themselves (``p.requires_grad`` is the parameter's flag, not its stand-in's).

    Modes entered or exited inside (a ``trainable()`` method, a generator closed here) stay so:
    a lifted mode taken away with :func:`take_lifted` is not put back, the others return to
    their places, and modes entered inside stay on top (stand-ins entered with
    :func:`push_stand_in` are lifted too until the outermost lift ends).
    """
    depth = torch._C._len_torch_function_stack()
    stack = [torch._C._pop_torch_function_stack() for _ in range(depth)][::-1]  # bottom first
    lifted = [mode for mode in stack if getattr(mode, "stands_in", False)]
    for mode in stack:
        if not getattr(mode, "stands_in", False):
            torch._C._push_on_torch_function_stack(mode)
    frames = _lifting.__dict__.setdefault("frames", [])
    frames.append(lifted)
    try:
        yield
    finally:
        del frames[next(i for i, f in enumerate(frames) if f is lifted)]  # by identity
        now = [torch._C._pop_torch_function_stack()
               for _ in range(torch._C._len_torch_function_stack())][::-1]
        for mode in _restored(stack, lifted, now):
            torch._C._push_on_torch_function_stack(mode)


def _restored(stack: list, lifted: list, now: list) -> list:
    """The mode stack after a lift: ``stack`` as it was, less the lifted modes taken away and
    the other modes no longer in ``now``, with the modes entered meanwhile (in ``now``) after
    the mode they were entered above."""
    out, j = [], 0
    for mode in stack:
        if getattr(mode, "stands_in", False):
            if any(m is mode for m in lifted):
                out.append(mode)
            continue
        k = next((i for i in range(j, len(now)) if now[i] is mode), None)
        if k is not None:  # still there: with the modes entered between it and the last one
            out += now[j:k + 1]
            j = k + 1
    entered = [m for m in lifted if not any(m is s for s in stack)]  # see push_stand_in
    return out + now[j:] + entered


def push_stand_in(mode) -> None:
    """Enter ``mode`` (a mode with a true ``stands_in``) on this thread's stack; while this
    thread is lifting them (a block entered by a ``trainable()`` method torchstruct runs), it
    is held lifted with the others and goes on top when the outermost lift ends."""
    _lifting.pushed = getattr(_lifting, "pushed", 0) + 1
    frames = getattr(_lifting, "frames", None)
    if frames:
        frames[0].append(mode)
    else:
        torch._C._push_on_torch_function_stack(mode)


def stand_ins_seen() -> tuple[bool, int]:
    """``(whether a block with stand-ins is active on this thread, how many such blocks it
    entered so far)``: taken before and after a forward, they say whether a block may have
    replaced parameters during it."""
    active = any(getattr(m, "stands_in", False)
                 for m in torch.overrides._get_current_function_mode_stack())
    return active, getattr(_lifting, "pushed", 0)


def take_lifted(mode) -> bool:
    """Take ``mode`` off this thread's lifted modes (a block left while lifted): True if it
    was there; it is then not put back when the lift ends."""
    for lifted in getattr(_lifting, "frames", ()):
        for i, m in enumerate(lifted):
            if m is mode:
                del lifted[i]
                return True
    return False


def replaced(tensors) -> list:
    """Those of ``tensors`` (an iterable, read only while such a block is active) that an
    active block of this thread replaces by another tensor (``swap``: a stand-in with memory
    of its own, ``table[id(p)] = (p, make)``)."""
    modes = [m for m in torch.overrides._get_current_function_mode_stack()
             if getattr(m, "stands_in", False) and not getattr(m, "aliases", True)]
    if not modes:
        return []
    out = []
    for t in tensors:  # (plain loops: dynamo cannot trace an assignment in a comprehension)
        for m in modes:
            hit = m.table.get(id(t))
            if hit is not None and hit[0] is t:
                out.append(t)
                break
    return out


class _Lock:
    """A re-entrant lock; while a thread holds it, :func:`without_stand_ins` is in force for
    that thread: torchstruct's bookkeeping (flags, records, declarations, the user's
    ``trainable()`` and selector callables it runs) sees the parameters, also when it runs
    inside a ``stop_gradient`` or ``swap`` block (a block entered meanwhile is lifted too)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._held = threading.local()  # this thread's depth and its lifting block

    def __enter__(self) -> "_Lock":
        self._lock.acquire()
        return self._entered()

    def enter_if_free(self) -> bool:
        """Enter only when no thread holds the lock, this one included (a weakref callback may
        run inside a locked region of its own thread, whose changes are half made); never
        waits. Returns whether it entered (then leave with ``__exit__``)."""
        if getattr(self._held, "depth", 0) or not self._lock.acquire(blocking=False):
            return False
        self._entered()
        return True

    def _entered(self) -> "_Lock":
        held = self._held
        depth = getattr(held, "depth", 0)
        if not depth:
            try:
                lifting = without_stand_ins()
                lifting.__enter__()
            except BaseException:
                self._lock.release()
                raise
            held.lifting = lifting
        held.depth = depth + 1
        return self

    def __exit__(self, *exc) -> None:
        held = self._held
        held.depth -= 1
        try:
            if not held.depth:
                lifting, held.lifting = held.lifting, None
                lifting.__exit__(None, None, None)
        finally:
            self._lock.release()


LOCK = _Lock()

class Record:
    """What torchstruct remembers of one parameter ``p``: its starting flag (``base``), the
    flag torchstruct last wrote (``written``), and the serial of the newest context or
    declaration that does not apply to it because someone else wrote its flag after it was
    made (``since``). Holds ``p`` while torchstruct follows it; :func:`forget` empties it
    (``p`` None), so that tables still holding the record hold nothing of the parameter."""

    __slots__ = ("p", "base", "written", "since")

    def __init__(self, p, base: bool, written: bool, since: int) -> None:
        self.p, self.base, self.written, self.since = p, base, written, since


# id(parameter) -> its Record (see above): only parameters of attached trees, and those that
# left one until the application that gives them their flag back
records: dict[int, Record] = {}

# id(root) -> State (see torchstruct.hooks); a State holds its root weakly
states: dict = {}

# every active context (torchstruct.contexts.Entry), outermost first
entries: list = []
# Contexts and mark_trainable declarations get serials from one counter; a class's
# trainable() method counts as made at DECLARED_BY_CLASS, before anything else.
DECLARED_BY_CLASS = 1
_serials = itertools.count(DECLARED_BY_CLASS + 1)
applied_through = DECLARED_BY_CLASS  # every serial up to this one has had its flags written


def next_serial() -> int:
    """A serial for a context being pushed or a declaration being made (under the lock).

    Writes by someone else not read yet are read first, so that each is dated before the new
    serial: a context or declaration made after a write applies on top of it, whenever the
    write is noticed by an application."""
    note_writes()
    return next(_serials)


def _snapshot(table: dict) -> list:
    """``table``'s items; a weakref callback run by garbage collection while they are listed
    may remove one (a collected model's records): list them again then."""
    while True:
        try:
            return list(table.items())
        except RuntimeError:  # "dictionary changed size during iteration"
            continue


class Left:
    """What a context keeps of a parameter torchstruct forgot (it left every attached tree),
    so that the parameter keeps what the context decided for it if it comes back, without
    keeping it alive: the address of its tensor, and a weak reference to the memory it holds
    (its storage: ``torch.multiprocessing.reductions.StorageWeakRef``). Neither a Python weak
    reference nor a C++ weak reference to the tensor itself: ``torch.utils.swap_tensors``
    refuses a tensor that has either, and a parameter that left may be converted on PyTorch's
    swap path while it is out. The object at the parameter's ``id`` that holds that very
    tensor, on that very memory still alive, is that parameter; one swapped since, or given
    new data (``p.data = ...``), is judged again, as a new parameter.

    A tensor whose storage cannot be reached (a tensor type without one) is followed by a
    C++ weak reference to the tensor (``torch._C._WeakTensorRef``) instead (a sparse tensor:
    its values' storage)."""

    __slots__ = ("ref", "address", "storage")

    def __init__(self, p) -> None:
        self.address = p._cdata
        storage = _storage(p)
        if storage is None:
            self.ref, self.storage = torch._C._WeakTensorRef(p), None
        else:
            self.ref, self.storage = StorageWeakRef(storage), storage._cdata

    def gone(self) -> bool:
        return self.ref.expired()

    def holds(self, p) -> bool:
        """Whether ``p`` (found at the id this was kept under) is the parameter that left."""
        if self.ref.expired() or p._cdata != self.address:
            return False
        if self.storage is None:
            return True
        storage = _storage(p)
        return storage is not None and storage._cdata == self.storage


_COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def _storage(p):
    """The storage holding ``p``'s elements (a sparse tensor's values), or None where it cannot
    be reached."""
    try:
        if p.layout == torch.sparse_coo:
            return p._values().untyped_storage()
        if p.layout in _COMPRESSED:
            return p.values().untyped_storage()
        return p.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def forget_decisions(ids: set[int]) -> None:
    """The parameters ``ids`` were forgotten (they left every attached tree): the active
    contexts stop holding them, keeping a :class:`Left` instead (and dropping those of
    parameters freed since). Under the lock, never in a weakref callback."""
    if ids:
        for entry in list(entries):
            if not ids.isdisjoint(entry.decided):
                entry.decided = {
                    k: ((Left(v[0]), v[1]) if k in ids and isinstance(v[0], torch.Tensor) else v)
                    for k, v in entry.decided.items()
                    if not (isinstance(v[0], Left) and v[0].gone())
                }


def _held_again(module, value) -> None:
    """``value`` (a parameter or a module) is registered into ``module`` of an attached tree:
    the parameters that left it and come back are held again by the decisions of the active
    contexts (:class:`Left` knows a parameter only until its data is replaced: a conversion
    after it is back keeps the decision)."""
    if not any(st.holds_module(module) for st in list(states.values())):
        return
    params = ([value] if isinstance(value, torch.Tensor)
              else list(value.parameters()) if isinstance(value, nn.Module) else [])
    with LOCK:
        for entry in list(entries):
            for p in params:
                hit = entry.decided.get(id(p))
                if hit is not None and isinstance(hit[0], Left) and hit[0].holds(p):
                    entry.decided[id(p)] = (p, hit[1])


def note_writes() -> None:
    """Read every flag someone else wrote since torchstruct last wrote it (see
    :func:`current`), so that the write is dated now."""
    for _, hit in _snapshot(records):
        p = hit.p
        if p is not None and p.requires_grad is not hit.written:
            hit.base, hit.written, hit.since = _read(hit, p)

# the structural_grad(wrt=) blocks whose loss runs now, oldest first: each has ``flags``, a dict
# id(parameter) -> (parameter, the flag the block holds it at). An application writes these
# over the effective flags while the block runs (reads are the model's true trainability);
# the newest block holding a parameter wins. Each also has ``outside``, id(parameter) -> the flag
# the model decides without the blocks (what a normalization layer's hold reads).
held_flags: list = []


def _holding(p) -> list:
    """The running ``structural_grad(wrt=)`` blocks that hold ``p``'s flag, oldest first.
    (A plain loop: dynamo cannot trace an assignment expression inside a comprehension, and
    a held norm layer's hook runs this inside compiled forwards, ``fullgraph=True`` too.)"""
    out = []
    for block in held_flags:
        hit = block.flags.get(id(p))
        if hit is not None and hit[0] is p:
            out.append(block)
    return out


def held_flag(p) -> bool | None:
    """The flag the newest running ``structural_grad(wrt=)`` block holds ``p`` at, or None."""
    blocks = _holding(p)
    return blocks[-1].flags[id(p)][1] if blocks else None


def flag_outside_blocks(p) -> bool:
    """``p``'s flag as the model decides it without the running ``structural_grad(wrt=)``
    blocks that hold it (as it was when the oldest was entered, or as an application inside
    them decided it since); its flag now when none holds it."""
    blocks = _holding(p) if held_flags else ()  # (read at every forward of a held layer)
    return blocks[0].outside.get(id(p), p.requires_grad) if blocks else p.requires_grad


def decided_outside(p, flag: bool) -> None:
    """An application inside running ``structural_grad(wrt=)`` blocks that hold ``p``'s flag
    decided ``flag`` for it without them."""
    for block in _holding(p):
        block.outside[id(p)] = flag


# id(norm layer) -> (weakref to the layer, its momentum when the hold began, [address, version]
# of its running_mean then): layers whose running statistics are held now. Written under LOCK;
# a forward's hook reads an entry without it (the hold may end meanwhile) and updates only the
# entry's own list, never the dict, so an ended hold is never put back
frozen_norms: dict[int, tuple[weakref.ref, object, list]] = {}

# Called as guard(changes, refuse) before flags are written, with the (path, parameter, new
# flag) of every parameter whose flag would change. With refuse=True a guard raises to refuse
# the change (nothing is written); with refuse=False (leaving a context, which must always
# restore) it may only warn.
flag_guards: list = []


# ----------------------------------------------------------------------------- records
def record(p) -> tuple[bool, bool, int] | None:
    """``(starting flag, flag last written, overridden-through serial)`` of parameter ``p``, or
    None if never written."""
    hit = handle(p)
    return None if hit is None else (hit.base, hit.written, hit.since)


def handle(p) -> Record | None:
    """The :class:`Record` of parameter ``p`` (the same object for as long as torchstruct
    follows ``p``), or None."""
    hit = records.get(id(p))
    return hit if hit is not None and hit.p is p else None


def current(p) -> tuple[bool, int] | None:
    """``(starting flag, overridden-through serial)`` of parameter ``p`` as it stands now, or
    None if torchstruct never wrote its flag.

    The one place the rule lives: a flag different from the one torchstruct last wrote was
    written by someone else after everything up to ``applied_through``; it becomes the starting
    flag, and those contexts and declarations no longer apply to ``p``."""
    hit = handle(p)
    return None if hit is None else _read(hit, p)[::2]


def _read(hit: Record, p) -> tuple[bool, bool, int]:
    """``(starting flag, flag now, overridden-through serial)`` of ``p`` from its record."""
    if p.requires_grad is hit.written:
        return hit.base, hit.written, hit.since
    return p.requires_grad, p.requires_grad, applied_through


def set_record(p, base: bool, written: bool, since: int = 0) -> Record:
    """Write ``p``'s record (its :class:`Record`, made the first time); returns it."""
    hit = handle(p)
    if hit is None:
        hit = records[id(p)] = Record(p, base, written, since)
    else:
        hit.base, hit.written, hit.since = base, written, since
    return hit


def forget(p) -> None:
    """Forget ``p``'s record and empty it (tables still holding it no longer hold ``p``)."""
    hit = handle(p)
    if hit is not None:
        del records[id(p)]
        hit.p = None


# ----------------------------------------------------------------------------- states
def live_states() -> list:
    """The states whose root is alive (a snapshot: safe to iterate while others change).

    States of dead roots are dropped here, not in a weakref callback: a callback runs inside
    any allocation (garbage collection), also while another loop walks ``states``."""
    out = []
    for key, st in list(states.items()):
        if st.root() is None:
            states.pop(key, None)
        else:
            out.append(st)
    return out


def state_of(root: nn.Module):
    """The state rooted exactly at ``root``, or None."""
    st = states.get(id(root))
    return st if st is not None and st.root() is root else None


# Attribute on an attached root: MARKED while its tree changed since its last application (a
# registration). Compiled code reads it, and guards on it: see torchstruct.hooks._pre_forward.
CHANGED = "_torchstruct_changed"
# Attribute on a module below an attached root: MARKED while its pre-hook waits to apply a
# registration made at or under it (see torchstruct.hooks.State.registered_into); a copy of the
# module reads it as false, so that its copied hook does nothing in compiled code either.
BELOW = "_torchstruct_below"


class _Mark:
    """The value of the ``CHANGED`` attribute: true, and false in a deep copy (``deepcopy``,
    pickling: ``torch.save`` of the module), which has no state of its own and behaves as
    plain PyTorch, compiled with ``fullgraph=True`` too."""

    __slots__ = ()

    def __bool__(self) -> bool:
        return True

    def __deepcopy__(self, memo) -> bool:
        return False

    def __reduce__(self):
        return (bool, ())

    def __repr__(self) -> str:
        return "MARKED"


MARKED = _Mark()


def mark_changed(st) -> None:
    """The tree of state ``st`` changed: its next forward applies again."""
    st.dirty = True
    root = st.root()
    if root is not None:
        root.__dict__[CHANGED] = MARKED


def grew(st) -> None:
    """The tree of state ``st`` changed (a registration, or a container changed by its own
    methods): its next forward applies, and the contexts on it count one more change."""
    mark_changed(st)
    st.registrations += 1


def _on_registered(module: nn.Module, name: str, value) -> None:
    """A parameter or module was registered into ``module``: only trees holding it changed."""
    if value is not None and (module._parameters.get(name) is value
                              or module._modules.get(name) is value):
        return  # the same object registered again (tie_weights): nothing changed
    key = id(module)
    if not any(key in st.module_ids or key in st.added for st in list(states.values())):
        return  # not into an attached tree: nothing to do, no lock taken
    with LOCK:  # not while another thread's application walks the tree: it would be lost
        if entries and value is not None:
            _held_again(module, value)
        for st in list(states.values()):
            if st.holds_module(module):
                grew(st)
                st.registered_into(module, value)


_module_mod.register_module_parameter_registration_hook(_on_registered)
_module_mod.register_module_module_registration_hook(_on_registered)
