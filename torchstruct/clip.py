"""Global norms and clipping by global norm."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from . import _ops, tree
from .declare import trainable_parameters

__all__ = ["global_norm"]


def _tensors(x) -> list[torch.Tensor]:
    """A model (its trainable parameters' gradients), a tree (its leaves) or tensors -> list."""
    if isinstance(x, nn.Module):
        return [p.grad for _, p in trainable_parameters(x) if p.grad is not None]
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):  # a tree: its leaves, a tensor held at several paths once
        return list({id(t): t for t in tree.leaves(x)}.values())
    if isinstance(x, Iterable):
        items = list(x)
        for i, t in enumerate(items):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"global_norm: element {i} is a {type(t).__name__}, not a Tensor")
        return items
    raise TypeError(
        f"expected a model, a tree (dict) or tensors; got {type(x).__name__}"
    )


def global_norm(x, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all elements of ``x`` taken together, tied parameters once.

    Arguments:
        x: an ``nn.Module`` (the gradients of its trainable parameters), a tree (its leaves;
            ``None`` leaves are skipped) or a tensor / iterable of tensors.
        norm_type: 1, 2, ``inf`` or any p > 0.

    Returns:
        A 0-dim tensor (float32, or float64 when any input is float64; fp16/bf16 accumulate in
        fp32) on the device of the first tensor; ``tensor(0.)`` when there is nothing.

    Example:
        >>> import torch, torchstruct as ts
        >>> float(ts.global_norm({"a": torch.tensor([3.0]), "b": {"c": torch.tensor([4.0])}}))
        5.0
    """
    return _ops.global_norm(_tensors(x), float(norm_type))
