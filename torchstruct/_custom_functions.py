"""Custom autograd functions running now, found from the Python stack (for the blocks).

``torch.autograd.Function.apply`` passes through no torch function mode: a parameter handed
directly to ``MyFunction.apply`` is an input of the function's backward node, whatever a
``stop_gradient`` / ``swap`` block does to the operations of its forward. A block finds such
a function while its forward runs (the forward's operations see the stand-in) by walking the
stack for the frame of a custom function's ``forward``.

The frame is told by its code: the code of every ``forward`` defined on a subclass of
``torch.autograd.Function`` (the innermost function under decorators that keep
``__wrapped__``, such as ``torch.amp.custom_fwd``), indexed from the live subclasses. The
index is read again only when the stack holds a code it has not classified yet, so a steady
loop costs a dictionary look-up per frame. This needs no Python frame of ``apply`` itself
(torch 2.14 implements ``apply`` in C++).

A function defined as a plain function, run once as such inside a block, and only later made
the ``forward`` of a new ``Function`` subclass is not recognized (its code was classified
before the class existed).
"""
from __future__ import annotations

import inspect
import threading
import weakref

import torch
from torch import Tensor
from torch.autograd.function import _is_setup_context_defined

__all__ = ["running_forwards", "first_argument", "arguments", "save_stand_ins",
           "drop_gradients"]

# code of a custom function's forward -> (qualified name, whether it takes ctx first)
_FORWARDS: dict = {}
_OTHERS: set = set()  # codes seen on the stack that are no custom function's forward
_LOCK = threading.Lock()


def _innermost(fn):
    seen = set()
    while getattr(fn, "__wrapped__", None) is not None and id(fn) not in seen:
        seen.add(id(fn))
        fn = fn.__wrapped__
    return fn


def _index() -> None:
    """Read the forward of every live subclass of ``torch.autograd.Function``."""
    stack, seen = [torch.autograd.Function], set()
    while stack:
        cls = stack.pop()
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.add(sub)
                stack.append(sub)
        forward = cls.__dict__.get("forward")
        code = getattr(_innermost(getattr(forward, "__func__", forward)), "__code__", None)
        if code is not None and code not in _FORWARDS:
            name = f"{cls.__qualname__}.forward"
            _FORWARDS[code] = (name, not _is_setup_context_defined(cls.setup_context))


def running_forwards(frame) -> list:
    """``(frame, name, takes ctx)`` of every custom function's forward running in ``frame``
    or the frames it was called from, innermost first."""
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    with _LOCK:
        if any(f.f_code not in _FORWARDS and f.f_code not in _OTHERS for f in frames):
            _index()
            _OTHERS.update(f.f_code for f in frames if f.f_code not in _FORWARDS)
        return [(f, *_FORWARDS[f.f_code]) for f in frames if f.f_code in _FORWARDS]


def first_argument(frame):
    """The first argument the function running in ``frame`` was called with (a custom
    function's ``ctx``), also through a decorator taking ``*args``, or None."""
    code = frame.f_code
    if code.co_argcount:
        return frame.f_locals.get(code.co_varnames[0])
    if code.co_flags & inspect.CO_VARARGS:
        star = frame.f_locals.get(code.co_varnames[code.co_kwonlyargcount])
        if isinstance(star, tuple) and star:
            return star[0]
    return None


def arguments(frame) -> list:
    """The values of the arguments of the function running in ``frame``, in the order of its
    signature (``*args`` and ``**kwargs`` spread)."""
    code, local = frame.f_code, frame.f_locals
    count = code.co_argcount + code.co_kwonlyargcount
    names = list(code.co_varnames[:count])
    out = [local.get(n) for n in names[:code.co_argcount]]
    star = code.co_flags & inspect.CO_VARARGS
    if star:
        out.extend(local.get(code.co_varnames[count]) or ())
    out.extend(local.get(n) for n in names[code.co_argcount:])
    if code.co_flags & inspect.CO_VARKEYWORDS:
        out.extend((local.get(code.co_varnames[count + bool(star)]) or {}).values())
    return out


def save_stand_ins(ctx, blocked: dict[int, Tensor]) -> None:
    """What custom function node ``ctx`` saves of a ``blocked`` parameter (by
    ``ctx.save_for_backward``, before or after now) is its ``.detach()`` alias: the same
    memory and version counter, so the backward computes the same values, but a backward run
    with ``create_graph=True`` builds no graph back to the parameter (a second derivative
    gives it nothing, as with the parameter detached by hand)."""
    table = ctx.__dict__.setdefault("_torchstruct_saved", {})
    table.update(blocked)

    def swap(tensors):
        return tuple(t.detach() if isinstance(t, Tensor) and table.get(id(t)) is t else t
                     for t in tensors)

    saved = getattr(ctx, "to_save", None)
    if saved:
        ctx.to_save = swap(saved)
    if "save_for_backward" not in ctx.__dict__:
        node, save = weakref.ref(ctx), type(ctx).save_for_backward
        ctx.save_for_backward = lambda *tensors: save(node(), *swap(tensors))


def drop_gradients(positions: set[int]):
    """A post hook for a custom function's backward node: no gradient for the inputs at
    ``positions`` (their edges get nothing, as if they had been detached)."""
    def hook(grad_inputs, _grad_outputs):
        return tuple(None if i in positions else g for i, g in enumerate(grad_inputs))
    return hook

