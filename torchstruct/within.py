"""``within_gradient``: is autograd recording a graph through these tensors right now?

A layer that behaves differently in training and evaluation (dropout, noise injection, a
straight-through estimator) can ask this instead of reading a ``training`` flag. The answer is
about the *tensors*: it is True when some differentiation mode will carry a derivative through
one of them, whichever of PyTorch's modes that is:

- eager reverse mode: grad mode is enabled and the tensor requires grad (this covers
  ``loss.backward()``, ``torch.autograd.grad`` and the recompute of
  ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, which runs under grad mode);
- ``torch.func.grad`` / ``vjp`` / ``jacrev`` (and ``vmap`` nested inside them): the functorch
  wrapper of the tensor requires grad at its level;
- forward mode: the tensor is a dual of ``torch.autograd.forward_ad`` or ``torch.func.jvp``
  with a tangent at the current level.

It is False under ``torch.no_grad()`` and ``torch.inference_mode()`` for reverse mode. Note
that PyTorch's ``no_grad`` does not apply to forward mode: a dual tensor keeps propagating its
tangent under ``no_grad``, so ``within_gradient`` stays True for it there (it is False under
``inference_mode``, which stops tangents as well).

Under ``torch.compile`` (also ``fullgraph=True``) the check reduces to ``torch.is_grad_enabled()``
and the ``requires_grad`` of an identity view of ``x`` (traced away; sparse and nested
tensors, which have no view, are read as they are), which dynamo specializes and guards on:
each branch of a function that branches on it is compiled for the mode it is called in,
without a graph break. The view passes through torch function modes where a
property read does not in traced code (a ``stop_gradient`` / ``swap`` block's stand-in
answers), and it is right inside ``torch.func.grad`` / ``vjp`` / ``jacrev`` compiled as a
whole. Inside a forward-AD level (``torch.autograd.forward_ad.dual_level``), where traced code
cannot see tangents, the check runs eagerly through a graph break (with ``fullgraph=True``: an
error, never a wrong answer).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.autograd import forward_ad as _fwad

from ._derivatives import has_tangent

__all__ = ["within_gradient"]

_functorch = torch._C._functorch


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and hasattr(compiler, "is_compiling"):
        return compiler.is_compiling()
    return torch._dynamo.is_compiling()  # pragma: no cover - very old torch


def _tracked(t: Tensor) -> bool:
    grad_mode = torch.is_grad_enabled()
    if _compiling():
        # in traced code a property read does not pass through torch function modes, an
        # operation does: the flag of an identity view is the stand-in's inside a
        # stop_gradient or swap block (the parameter's own elsewhere). Sparse and nested
        # tensors have no view: read as they are
        if grad_mode and (t.view_as(t) if t.layout == torch.strided and not t.is_nested
                          else t).requires_grad:
            return True
        # traced code cannot see tangents, nor a flag below a vmap level (a batched tensor
        # reads False there): ask eagerly
        if _fwad._current_level >= 0 or _functorch.is_batchedtensor(t):
            return _tracked_eagerly(t)
        return False
    # enable_grad() inside inference_mode() turns grad mode on, and still records nothing
    inference = torch.is_inference_mode_enabled()
    while True:
        if (not inference and t.requires_grad and _grad_mode_at(_functorch.maybe_get_level(t),
                                                                grad_mode)) or has_tangent(t):
            return True
        if not _functorch.is_functorch_wrapped_tensor(t):
            return False
        t = _functorch.get_unwrapped(t)  # e.g. a vmap wrapper inside torch.func.grad


def _grad_mode_at(level: int, grad_mode: bool) -> bool:
    """The grad mode work on a tensor of functorch ``level`` (-1: a plain tensor) runs with:
    ``grad_mode`` (this one) unless a ``torch.func.grad`` / ``vjp`` transform above that level
    runs, whose own grad mode is on inside it; then the mode it was entered with (a tensor
    captured inside ``torch.func.grad`` called under ``no_grad`` records nothing)."""
    if not grad_mode or not torch._C._are_functorch_transforms_active():
        return grad_mode
    from torch._functorch import pyfunctorch

    for interpreter in pyfunctorch.retrieve_all_functorch_interpreters():  # outermost first
        if interpreter.level() > level and interpreter.key() == _GRAD:
            return interpreter.prev_grad_mode()
    return grad_mode


_GRAD = torch._C._functorch.TransformType.Grad


@torch.compiler.disable
def _tracked_eagerly(t: Tensor) -> bool:
    """:func:`_tracked` outside the trace (a graph break; with ``fullgraph=True`` an error)."""
    return _tracked(t)


def within_gradient(*xs: Tensor | nn.Module) -> bool:
    """Whether autograd is recording a graph through any of ``xs`` now.

    Arguments:
        *xs: tensors or modules; a module counts when any of its parameters does.

    Returns:
        True when a differentiation mode carries a derivative through one of ``xs``: eager
        autograd (grad mode on and ``requires_grad``), ``torch.func.grad``/``vjp``/``jacrev``,
        or a forward-mode dual (``torch.autograd.forward_ad``, ``torch.func.jvp``). False
        under ``torch.no_grad()`` (reverse mode) and ``torch.inference_mode()``, and when no
        argument is given.

    Raises:
        TypeError: an argument that is neither a tensor nor a module (every argument is
            checked, whatever the others say).

    Example:
        >>> import torch, torchstruct as ts
        >>> x = torch.ones(2, requires_grad=True)
        >>> ts.within_gradient(x), ts.within_gradient(x.detach())
        (True, False)
        >>> with torch.no_grad():
        ...     ts.within_gradient(x)
        False
        >>> f = lambda t: (t * 2 if ts.within_gradient(t) else t).sum()
        >>> torch.func.grad(f)(torch.ones(2))
        tensor([2., 2.])
    """
    for i, x in enumerate(xs):  # every argument is checked, also after one that is tracked
        if not isinstance(x, (Tensor, nn.Module)):
            raise TypeError(
                f"within_gradient: argument {i} must be a Tensor or an nn.Module, got "
                f"{type(x).__name__}"
            )
    for x in xs:
        if isinstance(x, nn.Module):
            if any(_tracked(p) for p in x.parameters()):
                return True
        elif _tracked(x):
            return True
    return False
