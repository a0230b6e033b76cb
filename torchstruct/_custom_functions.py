"""Custom autograd functions running now, found from the Python stack (for the blocks).

``torch.autograd.Function.apply`` passes through no torch function mode: a parameter handed
directly to ``MyFunction.apply`` is an input of the function's backward node, whatever a
``stop_gradient`` / ``swap`` block does to the operations of its forward. A block finds such
a function while its forward runs (the forward's operations see the stand-in) by walking the
stack for the frame of a custom function's ``forward``:

- where ``apply`` is Python (torch before 2.14), the frame ``apply`` called, with the
  arguments ``apply`` was given: ``apply`` is never compiled by dynamo, so this holds also
  when dynamo runs the forward's frame with code of its own (a graph break inside it);
- where ``apply`` is C++ (torch 2.14), the frame running the code of a ``forward`` defined on
  a subclass of ``torch.autograd.Function`` (the innermost function under decorators that keep
  ``__wrapped__``, such as ``torch.amp.custom_fwd``), matched by file, first line and name
  rather than by the code object, with the arguments that frame holds.
  The forwards are indexed from the live subclasses, read again only when the stack holds code
  not classified yet, so a steady loop costs a dictionary look-up per frame. A function run as
  a plain function inside a block before it became the ``forward`` of a class defined later
  is not recognized (its code was classified first); nor is the rest of a forward that dynamo
  resumes in a function of its own after a graph break.
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

# the code of Function.apply where it is Python; None where it is C++ (torch 2.14)
_APPLY = getattr(getattr(torch.autograd.Function.apply, "__func__", None), "__code__", None)

# (file, first line, name) of a custom function's forward -> (qualified name, takes ctx)
_FORWARDS: dict = {}
_OTHERS: set = set()  # keys seen on the stack that are no custom function's forward
_LOCK = threading.Lock()


def _key(code) -> tuple:
    return code.co_filename, code.co_firstlineno, code.co_name


def _describe(cls) -> tuple:
    return f"{cls.__qualname__}.forward", not _is_setup_context_defined(cls.setup_context)


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
        if code is not None and _key(code) not in _FORWARDS:
            _FORWARDS[_key(code)] = _describe(cls)


def running_forwards(frame) -> list:
    """``(frame, name, takes ctx, inputs)`` of every custom function's forward running in
    ``frame`` or the frames it was called from, innermost first; ``inputs``: its arguments
    after ``ctx``, in the order of the node's inputs."""
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    if _APPLY is not None:
        return [(f, *_describe(c.f_locals.get("cls")), _apply_inputs(c.f_locals))
                for f, c in zip(frames, frames[1:])
                if c.f_code is _APPLY and not _is_pack_hook(f)
                and isinstance(c.f_locals.get("cls"), type)]
    with _LOCK:
        keys = [_key(f.f_code) for f in frames]
        if any(k not in _FORWARDS and k not in _OTHERS for k in keys):
            _index()
            _OTHERS.update(k for k in keys if k not in _FORWARDS)
        out = []
        for f, k in zip(frames, keys):
            if k in _FORWARDS:
                name, takes_ctx = _FORWARDS[k]
                out.append((f, name, takes_ctx, arguments(f)[1 if takes_ctx else 0:]))
        return out


def _apply_inputs(apply_locals: dict) -> tuple:
    """The arguments of a running ``Function.apply`` in the order of its node's inputs:
    keyword arguments are bound to the forward's parameters by name, after the positional
    ones."""
    args, kwargs = apply_locals.get("args", ()), apply_locals.get("kwargs")
    if not kwargs:
        return tuple(args)
    try:
        names = list(inspect.signature(apply_locals["cls"].forward).parameters)
    except (KeyError, TypeError, ValueError):
        return tuple(args) + tuple(kwargs.values())
    if not _is_setup_context_defined(apply_locals["cls"].setup_context):
        names = names[1:]  # ctx
    return tuple(args) + tuple(kwargs[n] for n in names[len(args):] if n in kwargs)


def _is_pack_hook(frame) -> bool:
    """Whether ``frame`` runs the saved-tensor pack hook in force (``apply`` calls it after
    the forward, to pack what the forward saved: non-reentrant checkpointing, offloading)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    hooks = top(False) if top is not None else None
    return bool(hooks) and getattr(hooks[0], "__code__", None) is frame.f_code


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

