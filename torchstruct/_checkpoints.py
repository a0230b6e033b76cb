"""Reentrant activation checkpoints (``torch.utils.checkpoint`` with ``use_reentrant=True``)
seen from the autograd graph: their backward recomputes the function and runs an inner backward
out of sight of the graph, so the parameters the function uses have no edge from the node.
Used by structural gradients and by the DDP check of blocks."""
from __future__ import annotations

import functools
import threading

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
# it (``around``), and put back as it was (the staticmethod itself) when none does.
_CHECKPOINT = torch.utils.checkpoint.CheckpointFunction
_FORWARD = _CHECKPOINT.__dict__["forward"]
_AROUND_LOCK = threading.Lock()
_AROUND: dict = {}  # key -> around(forward, ctx, run_function, preserve_rng_state, *args)


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
    _CHECKPOINT.forward = staticmethod(_forward) if _AROUND else _FORWARD


def _forward(ctx, run_function, preserve_rng_state, *args):
    forward = _FORWARD.__func__
    for fn in list(_AROUND.values()):
        forward = functools.partial(fn, forward)
    return forward(ctx, run_function, preserve_rng_state, *args)


def records_nothing(args) -> bool:
    """A reentrant checkpoint given ``args`` records nothing: none of them requires grad."""
    return not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


# ----------------------------------------------------------------------------- flags kept
# Why the forward is wrapped for the flags: while a flag context is active, or while a
# recomputation that set flags back runs in some thread (a checkpoint nested in its function
# runs its forward there, with no context active any more).
_WANTED = {"contexts": False, "recomputing": 0}
_LOCAL = threading.local()  # .running: this thread's recomputations, innermost last (flags)


def keep_flags(on: bool) -> None:
    """While a flag context is active (``on``), a reentrant checkpoint that records remembers
    the flags the active contexts decide for its own model, and its recomputation in backward
    runs with them."""
    _want(contexts=on)


def _want(contexts: bool | None = None, recomputing: int = 0) -> None:
    with _AROUND_LOCK:
        if contexts is not None:
            _WANTED["contexts"] = contexts
        _WANTED["recomputing"] += recomputing
        on = _WANTED["contexts"] or _WANTED["recomputing"] > 0
        _set("flags", _remember_flags if on else None)


def _remember_flags(forward, ctx, run_function, preserve_rng_state, *args):
    out = forward(ctx, run_function, preserve_rng_state, *args)
    if not records_nothing(args):
        flags = _flags_for(run_function)
        if flags:
            ctx.run_function = functools.partial(_recompute, flags, ctx.run_function)
    return out


def _flags_for(run_function) -> tuple:
    """``(parameter, flag now)`` of the parameters whose flags an active context decided, or
    that an enclosing recomputation of this thread set back, restricted to the attached models
    holding a module ``run_function`` is bound to (all of them when none is seen)."""
    from . import _state

    params = {}
    for entry in list(_state.entries):
        if entry.scope() is not None:
            for p, _ in list(entry.decided.values()):
                if isinstance(p, nn.Parameter):
                    params[id(p)] = p
    running = getattr(_LOCAL, "running", None)
    if running:
        params.update((id(p), p) for p, _ in running[-1])
    elif not params:
        with _state.LOCK:  # the last context's model is gone: torch's own forward again
            if not any(e.scope() is not None for e in _state.entries):
                keep_flags(False)
    mods = {id(m) for m in modules_behind(run_function)} if params else ()
    if mods:  # a function bound to no module at all: every model's flags
        own = set().union(*(st.members for st in _state.live_states()
                            if not mods.isdisjoint(st.module_ids)))
        return tuple((p, p.requires_grad) for i, p in params.items() if i in own)
    return tuple((p, p.requires_grad) for p in params.values())


def _recompute(flags: tuple, run_function, *args):
    """A checkpoint's recomputation (in backward) with the flags its forward ran with: a
    context entered around the forward and left before the backward (a decorated training
    step whose loss is backpropagated after it returns) would otherwise record gradients for
    parameters the forward had frozen, or none for those it trained. Flags that moved since
    are set back for the recomputation only, and restored after it; a checkpoint nested in
    the function remembers them in turn."""
    moved = [(p, flag) for p, flag in flags if p.requires_grad is not flag]
    if not moved:
        return run_function(*args)
    running = _LOCAL.__dict__.setdefault("running", [])
    running.append(flags)
    _want(recomputing=1)
    for p, flag in moved:
        p.requires_grad_(flag)
    try:
        return run_function(*args)
    finally:
        for p, flag in moved:
            p.requires_grad_(not flag)
        running.pop()
        _want(recomputing=-1)
