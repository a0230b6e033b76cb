"""Global norms and clipping by global norm."""
from __future__ import annotations

import types
import warnings
from collections.abc import Iterable

import torch
from torch import nn

from . import _ops, _reference, _state, tree
from .declare import trainable_parameters

__all__ = ["clip_by_global_norm", "clip_grad_norm_", "global_norm"]


def _model_grads_now(model: nn.Module) -> list[torch.Tensor]:
    """The gradients of ``model``'s trainable parameters: the parameters' own, also inside a
    ``swap`` block (where ``p.grad`` reads the stand-in's). Under ``torch.compile`` this runs
    eagerly (a graph break): see ``_model_grads``."""
    with _state.without_stand_ins():
        return [p.grad for _, p in trainable_parameters(model) if p.grad is not None]


_REASON = ("ts.global_norm / ts.clip_by_global_norm of a model work out which parameters train "
           "eagerly (a graph break); under fullgraph=True pass the list of trainable parameters "
           "instead (for example [p for p in model.parameters() if p.requires_grad])")
try:
    _model_grads = torch.compiler.disable(_model_grads_now, reason=_REASON)
except TypeError:  # torch < 2.7: no reason
    _model_grads = torch.compiler.disable(_model_grads_now)


def _model_paths(model: nn.Module):
    """How an error names gradient ``i`` of ``_model_grads(model)``: by its parameter's path
    (worked out only when an error needs it)."""
    def name_of(i: int) -> str:
        with _state.without_stand_ins():
            paths = [path for path, p in trainable_parameters(model) if p.grad is not None]
        return f"the gradient of {paths[i]!r}"
    return name_of


def _tree_leaves(x: dict):
    """A tree's leaves, a tensor held at several paths once, and how an error names each."""
    items = tree._distinct_items(x)
    return [leaf for _, leaf in items], lambda i: f"the leaf at {items[i][0]!r}"


def _tensors(x):
    """A model (its trainable parameters' gradients), a tree (its leaves) or tensors -> list,
    and how an error names entry ``i`` (by path; None: by index)."""
    if isinstance(x, nn.Module):
        return _model_grads(x), _model_paths(x)
    if isinstance(x, torch.Tensor):
        return [x], None
    if isinstance(x, dict):
        return _tree_leaves(x)
    if isinstance(x, Iterable):
        items = list(x)
        for i, t in enumerate(items):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"global_norm: element {i} is a {type(t).__name__}, not a Tensor")
        return items, None
    raise TypeError(
        f"expected a model, a tree (dict) or tensors; got {type(x).__name__}"
    )


def global_norm(x, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all elements of ``x`` taken together, tied parameters once.

    Arguments:
        x: an ``nn.Module`` (the gradients of its trainable parameters), a tree or a flat
            path-keyed dict (its leaves, a tensor held at several paths once as
            ``ts.tree.flatten`` ties them; ``None`` leaves are skipped) or a tensor / iterable
            of tensors (taken as given).
        norm_type: 1, 2, ``inf`` or any p > 0.

    Returns:
        A 0-dim tensor (float32, or float64 when any input is float64; fp16/bf16 accumulate in
        fp32) on the device of the first tensor; ``tensor(0.)`` when there is nothing.

    Raises:
        ValueError: a ``norm_type`` that is not a number > 0 or inf (checked first, with the
            message :func:`clip_by_global_norm` gives).
        TypeError: ``x`` is none of the above, an entry is not a tensor, or one is sparse or
            of an unsupported dtype (for a model or a tree, named by its path).

    Example:
        >>> import torch, torchstruct as ts
        >>> float(ts.global_norm({"a": torch.tensor([3.0]), "b": {"c": torch.tensor([4.0])}}))
        5.0
    """
    p = _reference.validate_norm_type(norm_type)
    tensors, name_of = _tensors(x)
    return _ops.global_norm(tensors, p, name_of)


def _grads_to_clip(params):
    """The gradients ``clip_by_global_norm`` works on (see its docstring), and how an error
    names gradient ``i`` (by path; None: by index)."""
    if isinstance(params, nn.Module):
        return _model_grads(params), _model_paths(params)
    if isinstance(params, dict):  # a tree of gradients
        grads, name_of = _tree_leaves(params)
        for i, g in enumerate(grads):
            if isinstance(g, nn.Parameter):
                raise TypeError(
                    f"clip_by_global_norm: {name_of(i)} is an nn.Parameter. A tree given here "
                    "holds gradients, which are scaled in place; this one holds parameters "
                    "(dict(model.named_parameters()), ts.tree.from_module), which would be "
                    "rescaled themselves. Pass the model, or its parameters as a list, to clip "
                    "their .grad. Nothing was changed.")
        return grads, name_of
    if isinstance(params, torch.Tensor):
        return ([params.grad] if params.grad is not None else []), None
    if isinstance(params, Iterable) and not isinstance(params, (str, bytes)):
        is_generator = isinstance(params, types.GeneratorType)
        params = list(params)
        if is_generator and not params:
            warnings.warn(
                "`parameters` is an empty generator, no gradient clipping will occur.",
                stacklevel=3,
            )
        try:
            grads = []
            for p in params:  # one .grad read each (slow on nn.Parameter); traceable by dynamo
                g = p.grad
                if g is not None:
                    grads.append(g)
            return grads, None
        except AttributeError:
            for i, p in enumerate(params):
                if not isinstance(p, torch.Tensor):
                    raise TypeError(
                        f"clip_by_global_norm: parameters[{i}] is a {type(p).__name__}, not a "
                        f"tensor (expected parameters whose .grad is clipped)"
                    ) from None
            raise
    raise TypeError(
        f"clip_by_global_norm: expected a parameter, an iterable of parameters, a model or a "
        f"tree (dict) of gradients; got {type(params).__name__}"
    )


def clip_by_global_norm(
    params,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip gradients by their global norm, in place: a drop-in for
    ``torch.nn.utils.clip_grad_norm_``.

    Every gradient is multiplied by ``min(max_norm / (total_norm + 1e-6), 1)``, where
    ``total_norm`` is the ``norm_type``-norm of all gradient elements taken together.

    Arguments:
        params: what to clip --
            a tensor or an iterable of tensors (parameters): their ``.grad``, skipping
            ``None``, the list taken as given (exactly as ``clip_grad_norm_`` takes it: a
            parameter listed twice counts twice and is scaled twice);
            an ``nn.Module``: the gradients of its trainable parameters, a tied parameter once;
            a tree (nested ``dict``, or flat path-keyed ``dict``) of gradient tensors, e.g. from
            ``ts.structural_grad``: its
            leaves themselves, a tensor held at several paths once (one object, or views of
            the very same memory, as ``ts.tree.flatten`` ties them; ``None`` leaves skipped).
        max_norm: the largest allowed total norm, ``>= 0`` (``ValueError`` otherwise), read
            with ``float()`` as ``clip_grad_norm_`` reads it (a one-element tensor or a
            numeric string such as ``"1.0"`` is taken; ``"abc"`` or ``None`` is not).
        norm_type: 1, 2, ``inf`` or any p > 0.
        error_if_nonfinite: raise ``RuntimeError`` (gradients left unchanged) when the total
            norm is NaN or inf. This reads the norm on the host (a device sync on CUDA); without
            it there is none. Default ``False``: like torch, a NaN norm makes every gradient NaN.
        foreach: accepted for compatibility and ignored (the fused kernel is always used).

    Returns:
        The total norm before clipping, a 0-dim tensor on the first gradient's device, in the
        dtype ``clip_grad_norm_`` returns (the promotion of the gradient dtypes; fp16/bf16 are
        accumulated in fp32 all the same). ``tensor(0.)`` when there is no gradient.

    Raises:
        ValueError: ``max_norm`` not a number, negative or NaN; bad ``norm_type`` (both
            checked before any gradient is read).
        TypeError: a non-tensor entry, a sparse gradient, an unsupported dtype (for a model
            or a tree, named by its path).
        RuntimeError: non-finite norm with ``error_if_nonfinite``; a device the compiled
            extension was not built for. Nothing is modified when anything is raised.

    Example:
        >>> import torch, torchstruct as ts
        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> w.grad = torch.tensor([3.0, 4.0])
        >>> float(ts.clip_by_global_norm([w], max_norm=1.0))
        5.0
        >>> round(float(w.grad.norm()), 4)
        1.0
    """
    del foreach  # always fused
    norm_type = _reference.validate_norm_type(norm_type)  # before any path reads them
    max_norm = _reference.validate_max_norm(max_norm)
    with torch.no_grad():
        if not error_if_nonfinite:  # a list of parameters: .grad read in C++ (many small ones)
            norm = _ops.clip_grads_of(params, max_norm, norm_type)
            if norm is not None:
                return norm
        grads, name_of = _grads_to_clip(params)
        return _ops.clip_by_global_norm_(grads, max_norm, norm_type, error_if_nonfinite,
                                         name_of)


clip_grad_norm_ = clip_by_global_norm
"""``ts.clip_grad_norm_``: another name of :func:`clip_by_global_norm` (PyTorch's spelling)."""
