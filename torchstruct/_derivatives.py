"""Which tensors carry derivatives, in every mode PyTorch has.

A tensor takes part in differentiation when reverse mode records through it (grad mode on and
``requires_grad``), when it holds a forward-mode tangent at the active dual level
(``torch.autograd.forward_ad``), or when a ``torch.func`` transform (``grad``, ``vjp``,
``jvp``, ``jacrev``, ``jacfwd``, ``vmap``, ...) is running: its wrapped tensors carry what the
transform needs. Code that would otherwise treat tensors as plain memory (the compiled kernels,
a tree's tie of two views of one storage) asks here first.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.autograd import forward_ad

_functorch = getattr(torch._C, "_functorch", None)


def in_transform() -> bool:
    """Whether a ``torch.func`` transform is running (its tensors are wrapped)."""
    return _functorch is not None and _functorch.maybe_current_level() is not None


def has_tangent(t: torch.Tensor) -> bool:
    """Whether ``t`` holds a forward-mode tangent at the active dual level (a ``vmap`` wrapper
    carries none itself)."""
    if getattr(forward_ad, "_current_level", -1) < 0:  # no dual level is active
        return False
    if _functorch is not None and _functorch.is_batchedtensor(t):
        return False
    try:
        return forward_ad.unpack_dual(t).tangent is not None
    except RuntimeError:  # pragma: no cover - a functorch layer without a rule for unpack_dual
        return False


def carries_derivatives(t: torch.Tensor) -> bool:
    """Whether ``t`` is recorded by reverse mode or holds a forward-mode tangent."""
    return (t.requires_grad and torch.is_grad_enabled()) or has_tangent(t)


def any_differentiated(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether an op on ``tensors`` must be built of differentiable PyTorch ops: one of them
    carries derivatives, or a ``torch.func`` transform is running."""
    tensors = list(tensors)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return True
    return in_transform() or any(has_tangent(t) for t in tensors)
