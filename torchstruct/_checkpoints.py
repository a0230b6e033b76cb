"""Activation checkpoints (``torch.utils.checkpoint``) and what torchstruct changes around them.

A reentrant checkpoint (``use_reentrant=True``) seen from the autograd graph: its backward
recomputes the function and runs an inner backward out of sight of the graph, so the parameters
the function uses have no edge from the node (used by structural gradients and by the DDP
check of blocks). Both forms recompute the function in backward, possibly after a context or
block around their forward has ended: while one is active, the recomputation is made to run
with the flags the forward ran with (contexts), and inside the ``stop_gradient`` / ``swap``
blocks the forward ran in (also those left before the backward)."""
from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
import warnings
import weakref

import torch.utils.checkpoint
from torch import nn


def is_reentrant_checkpoint(node) -> bool:
    """A custom autograd function named like a checkpoint (``torch.utils.checkpoint`` with
    ``use_reentrant=True``, and the implementations modelled on it): its backward recomputes
    the forward and runs an inner backward that writes ``.grad``, out of sight of this graph."""
    cls = getattr(node, "_forward_cls", None)
    return cls is not None and "checkpoint" in cls.__name__.lower()


def modules_behind(fn, depth: int = 4):
    """The modules a checkpointed function is bound to, as far as they can be seen: a module,
    a bound method's object, a partial's function and arguments, a closure's cells, lists."""
    if depth < 0:
        return
    if isinstance(fn, nn.Module):
        yield fn
    elif isinstance(fn, (list, tuple)):
        for f in fn:
            yield from modules_behind(f, depth - 1)
    elif isinstance(fn, functools.partial):
        for f in (fn.func, *fn.args, *fn.keywords.values()):
            yield from modules_behind(f, depth - 1)
    elif callable(fn):
        yield from modules_behind(getattr(fn, "__self__", None), depth - 1)
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                yield from modules_behind(cell.cell_contents, depth - 1)
            except ValueError:  # an empty cell
                pass


# ----------------------------------------------------------------------------- the forward
# torch's reentrant checkpoint forward is wrapped only while some part of torchstruct looks at
# it (``around``), and put back as it was (the staticmethod itself) when none does; likewise
# the generator behind the non-reentrant form (``recompute_through``), which ``checkpoint``
# looks up in its module at each call.
_CHECKPOINT = torch.utils.checkpoint.CheckpointFunction
_FORWARD = _CHECKPOINT.__dict__["forward"]


def _generator_name() -> str | None:
    """The module-level name under which torch's non-reentrant checkpoint calls the generator
    that recomputes (``..._impl`` from torch 2.14 on; the old name is then a shim calling it),
    provided ``checkpoint``'s own code calls it by that name; else None."""
    cp = torch.utils.checkpoint
    called = set()
    for fn in (getattr(cp, "checkpoint", None), getattr(cp, "_checkpoint_impl", None)):
        fn = inspect.unwrap(fn) if fn is not None else None  # (torch._disable_dynamo's wrapper)
        called |= set(getattr(getattr(fn, "__code__", None), "co_names", ()))
    for name in ("_checkpoint_without_reentrant_generator_impl",
                 "_checkpoint_without_reentrant_generator"):
        if name in called and callable(getattr(cp, name, None)):
            return name
    return None


_GENERATOR_NAME = _generator_name()
_GENERATOR = getattr(torch.utils.checkpoint, _GENERATOR_NAME) if _GENERATOR_NAME else None
_COMPOSABLE = "torch.distributed._composable.checkpoint_activation"  # imports it by name
_AROUND_LOCK = threading.Lock()
_AROUND: dict = {}  # key -> around(forward, ctx, run_function, preserve_rng_state, *args)
_RECOMPUTE: dict = {}  # key -> capture(fn, settle) -> what the non-reentrant recomputation runs


def around(key: str, fn) -> None:
    """Run ``CheckpointFunction.forward`` through ``fn(forward, ctx, run_function,
    preserve_rng_state, *args)`` (which calls ``forward`` with the rest), or stop (``fn`` None).
    Several compose, in the order they were first given."""
    with _AROUND_LOCK:
        _set(key, fn)


def _set(key: str, fn) -> None:
    """``around`` under its lock."""
    if fn is None:
        _AROUND.pop(key, None)
    else:
        _AROUND[key] = fn
    wrapped = getattr(_CHECKPOINT.__dict__["forward"], "__func__", None) is _forward
    if bool(_AROUND) is not wrapped:  # the same object while it stays wrapped
        _CHECKPOINT.forward = staticmethod(_forward) if _AROUND else _FORWARD


def _set_recompute(key: str, capture) -> None:
    """Under ``around``'s lock: a non-reentrant checkpoint called from now on recomputes
    ``capture(fn, settle)`` instead of its function ``fn`` (called as its forward begins, in
    the forward's thread; what it appends to ``settle`` is called once the forward has
    returned), or stop (``capture`` None). Several compose, in the order they were first
    given."""
    if _GENERATOR is None:  # pragma: no cover - a torch whose checkpoint calls it otherwise
        if capture is not None:
            warnings.warn(
                f"torchstruct cannot follow the recomputation of non-reentrant activation "
                f"checkpoints (use_reentrant=False) on torch {torch.__version__}: a checkpoint "
                f"whose forward runs inside a flag context or a stop_gradient / swap block and "
                f"whose backward runs after it ends recomputes with the flags and tensors of "
                f"then, and its gradients may be wrong. Run the backward inside the block, or "
                f"use a torch version torchstruct supports", RuntimeWarning, stacklevel=4)
        return
    if capture is None:
        _RECOMPUTE.pop(key, None)
    else:
        _RECOMPUTE[key] = capture
    now = _generator if _RECOMPUTE else _GENERATOR
    setattr(torch.utils.checkpoint, _GENERATOR_NAME, now)
    # torch's composable checkpoint imports the generator by name: its module gets it too,
    # once loaded (it holds the one in force when it was imported, put right at the next change)
    composable = sys.modules.get(_COMPOSABLE)
    if composable is not None and getattr(composable, _GENERATOR_NAME, None) in (
            _GENERATOR, _generator):
        setattr(composable, _GENERATOR_NAME, now)


def _generator(fn, *rest, **kwargs):
    settle = []  # what a capture reads once the forward has returned
    for capture in list(_RECOMPUTE.values()):
        fn = capture(fn, settle)
    out = yield from _GENERATOR(fn, *rest, **kwargs)
    for read in settle:
        read()
    return out


def _forward(ctx, run_function, preserve_rng_state, *args):
    forward = _FORWARD.__func__
    for fn in list(_AROUND.values()):
        forward = functools.partial(fn, forward)
    return forward(ctx, run_function, preserve_rng_state, *args)


def before_apply(fn) -> None:
    """Call ``fn(args)`` with a reentrant checkpoint's inputs as it is applied, before autograd
    decides from their flags whether it records (its forward is too late for that), or stop
    (``fn`` None). One at a time."""
    global _BEFORE
    with _AROUND_LOCK:
        _BEFORE = fn
        if fn is not None:
            _CHECKPOINT.apply = classmethod(_apply)
        elif "apply" in _CHECKPOINT.__dict__:
            del _CHECKPOINT.apply  # torch.autograd.Function's own again


_BEFORE = None  # the function before_apply was given


def _apply(cls, run_function, preserve_rng_state, *args):
    fn = _BEFORE  # read once: another thread may stop it meanwhile
    if fn is not None:
        fn(args)
    return super(_CHECKPOINT, cls).apply(run_function, preserve_rng_state, *args)


def records_nothing(args) -> bool:
    """A reentrant checkpoint given ``args`` records nothing: none of them requires grad."""
    return not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


# ----------------------------------------------------------------------------- flags kept
# Why the forward is wrapped for the flags: while a flag context is active, or while a
# recomputation that set flags back runs in some thread (a checkpoint nested in its function
# runs its forward there, with no context active any more).
_WANTED = {"contexts": False, "recomputing": 0}
# the blocks active per thread (a thread that ended with one active, a generator holding it
# closed from another thread, no longer counts: its modes went with it)
_BLOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCAL = threading.local()  # .running: this thread's recomputations, innermost last (flags)


def keep_flags(on: bool) -> None:
    """While a flag context is active (``on``), a checkpoint that records remembers the flags
    the active contexts decide for its own model, and its recomputation in backward runs with
    them."""
    _want(contexts=on)


def watch_blocks(count: int) -> None:
    """A ``stop_gradient`` / ``swap`` block was entered (``count`` 1) or left (-1): while any is
    active, a non-reentrant checkpoint whose forward runs inside blocks recomputes inside them,
    also once they have ended."""
    _want(blocks=count)


def _want(contexts: bool | None = None, recomputing: int = 0, blocks: int = 0) -> None:
    with _AROUND_LOCK:
        if contexts is not None:
            _WANTED["contexts"] = contexts
        _WANTED["recomputing"] += recomputing
        if blocks:
            me = threading.current_thread()
            _BLOCKS[me] = _BLOCKS.get(me, 0) + blocks
        on = _WANTED["contexts"] or _WANTED["recomputing"] > 0
        _set("flags", _remember_flags if on else None)
        _set_recompute("flags", _flags_kept if on else None)
        blocks_on = any(n > 0 and t.is_alive() for t, n in list(_BLOCKS.items()))
        _set_recompute("blocks", _blocks_kept if blocks_on else None)


def _remember_flags(forward, ctx, run_function, preserve_rng_state, *args):
    out = forward(ctx, run_function, preserve_rng_state, *args)
    if not records_nothing(args):
        flags = _flags_for(run_function)
        if flags:
            ctx.run_function = functools.partial(_recompute, flags, ctx.run_function)
    return out


def _flags_kept(fn, settle: list):
    """A non-reentrant checkpoint's function, recomputed with the flags of its forward: those
    it ended with, read once it has returned (its first hook may apply a waiting change)."""
    flags = []

    def read():
        flags[:] = _flags_for(fn)

    settle.append(read)
    return functools.partial(_recompute_kept, flags, fn)


def _recompute_kept(flags: list, fn, *args, **kwargs):
    return _recompute(tuple(flags), fn, *args, **kwargs)


def _stand_ins() -> list:
    return [m for m in torch.overrides._get_current_function_mode_stack()
            if getattr(m, "stands_in", False)]


def _blocks_kept(fn, settle: list):
    """A non-reentrant checkpoint's function, recomputed inside the blocks its forward ran in:
    those still active (a backward called inside a block runs without it: torch calls it from
    the block's own handler) and those that have exited since (a block's mode keeps what it
    stands in for), so that the recomputation is the forward again."""
    modes = _stand_ins()
    return functools.partial(_recompute_in_blocks, modes, fn) if modes else fn


def _recompute_in_blocks(modes: list, fn, *args, **kwargs):
    now = _stand_ins()
    missing = [m for m in modes if not any(m is n for n in now)]
    for mode in missing:
        torch._C._push_on_torch_function_stack(mode)
    try:
        return fn(*args, **kwargs)
    finally:
        for mode in reversed(missing):  # taken off wherever it is; modes above stay, in order
            above = []
            while (top := torch._C._pop_torch_function_stack()) is not mode:
                above.append(top)
            for m in reversed(above):
                torch._C._push_on_torch_function_stack(m)


def _flags_for(run_function) -> tuple:
    """``(parameter, flag now)`` of the parameters a recomputation of ``run_function`` must see
    as its forward does: those of the modules it is bound to (a module, a bound method, a
    partial or closure over one), or, when none is seen, those of the scopes of the active
    contexts; and those an enclosing recomputation of this thread set back. Flags that did not
    move by the recomputation are left alone then."""
    from . import _state

    scopes = [s for s in (e.scope() for e in list(_state.entries)) if s is not None]
    running = getattr(_LOCAL, "running", None)
    if not scopes and not running:
        with _state.LOCK:  # the last context's model is gone: torch's own forward again
            if not any(e.scope() is not None for e in _state.entries):
                keep_flags(False)
        return ()
    params = {}
    for mod in list(modules_behind(run_function)) or scopes:
        params.update((id(p), p) for p in mod.parameters())
    if running:
        params.update((id(p), p) for p, _ in running[-1])
    with torch._C.DisableTorchFunction():  # the parameters' own flags, not a block's stand-ins
        return tuple((p, p.requires_grad) for p in params.values())


@contextlib.contextmanager
def pinned(ids):
    """While the block runs, a recomputation in this thread leaves the flags of the tensors
    whose ids are ``ids`` as they are (structural_grad's exact path decides them: every leaf
    it switched off, or back on for a checkpoint it feeds)."""
    before = getattr(_LOCAL, "pinned", frozenset())
    _LOCAL.pinned = before | frozenset(ids)
    try:
        yield
    finally:
        _LOCAL.pinned = before


def _recompute(flags: tuple, run_function, *args, **kwargs):
    """A checkpoint's recomputation (in backward) with the flags its forward ran with: a
    context entered around the forward and left before the backward (a decorated training
    step whose loss is backpropagated after it returns) would otherwise record gradients for
    parameters the forward had frozen, or none for those it trained. Flags that moved since
    are set back for the recomputation only, and restored after it; a checkpoint nested in
    the function remembers them in turn. The parameters' own flags are read and written, not
    those of a block's stand-ins (this may run inside the blocks the forward ran in). The
    flags :func:`pinned` in this thread are left alone."""
    pinned = getattr(_LOCAL, "pinned", ())
    with torch._C.DisableTorchFunction():
        moved = [(p, flag) for p, flag in flags
                 if p.requires_grad is not flag and id(p) not in pinned]
    if not moved:
        return run_function(*args, **kwargs)
    from . import _state

    running = _LOCAL.__dict__.setdefault("running", [])
    running.append(flags)
    _want(recomputing=1)
    with _state.LOCK, torch._C.DisableTorchFunction():
        # what torchstruct knows of these flags: a context entered in the recomputation reads
        # the flags set back as writes of someone else (which keeps them for the recomputation)
        # and dates them; once the flags are restored, that knowledge is put back as it was
        records = [(p, _state.record(p)) for p, _ in moved]
        for p, flag in moved:
            p.requires_grad_(flag)
    try:
        return run_function(*args, **kwargs)
    finally:
        with _state.LOCK, torch._C.DisableTorchFunction():
            for p, flag in moved:
                p.requires_grad_(not flag)
            for p, known in records:
                if known is not None:
                    _state.set_record(p, *known)
                elif _state.handle(p) is not None:  # first written in the recomputation
                    _state.set_record(p, p.requires_grad, p.requires_grad)
        running.pop()
        _want(recomputing=-1)
