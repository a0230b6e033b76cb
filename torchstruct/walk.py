"""Walking a model and trees together, with trainability taken from the model.

- :func:`map_trainable` calls ``f(param, *leaves)`` at each trainable parameter of a model, the
  leaves looked up by the parameter's path in each tree, and returns the results as a tree.
- :func:`polyak_update` moves a model's trainable parameters towards a source (a model or a
  tree) in one fused, in-place pass: ``target <- (1 - tau) * target + tau * source``.

Matching trees to a model (both functions; a tree may also be a flat path-keyed dict such as
a ``state_dict``, see :mod:`torchstruct.tree`):

- A trainable parameter is visited once, at its first path in ``named_parameters()`` order
  (tied parameters included), and must have a leaf at that path in every tree (``ValueError``
  naming the path otherwise).
- Leaves at other parameter paths of the model (frozen parameters, the later paths of a tied
  parameter) are not used: a tree covering the whole model is fine. Every leaf at a parameter
  path, used or not, must have that parameter's shape (``ValueError`` naming the path: nothing
  is broadcast). A leaf at a path that names no parameter of the model raises ``ValueError``
  naming it (the tree does not match the model), and so do two different tensors at two paths
  of a tied parameter (the tie would silently lose one): the same tensor, or views of the same
  memory (what ``state_dict`` holds for a tied parameter), are one. A source *module* for
  :func:`polyak_update` follows the same tie rule.
- An uninitialized lazy parameter (an ``nn.Lazy*`` module before its first forward) where a
  function needs its shape raises ``ValueError`` naming its path.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from . import _dtensor, _state
from . import tree as _tree
from ._checks import as_real, check_callable, describe, refuse_lazy
from ._reference import validate_writable
from .blocks import refuse_constant_writes
from .declare import starting_flag, trainable_parameters
from .select import _closest, index

__all__ = ["map_trainable", "polyak_update"]

Pairs = list[tuple[str, nn.Parameter]]


def _trainable(model: nn.Module, who: str) -> Pairs:
    """The trainable ``(path, parameter)`` pairs of ``model``; none of them lazy."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{who}: expected an nn.Module, got {type(model).__name__}")
    pairs = list(trainable_parameters(model))
    refuse_lazy(who, pairs)
    return pairs


def _check_ties(idx, flat: dict, what: str) -> None:
    """Leaves at two paths of one tied parameter must be one tensor: else one would be lost."""
    for ps in idx.paths:
        held = [path for path in ps if path in flat]
        for path in held[1:]:
            if not _tree._same_tensor(flat[held[0]], flat[path]):
                raise ValueError(
                    f"{what} has different tensors at {held[0]!r} and {path!r}, two paths of "
                    f"one tied parameter of the model; a tied parameter lives once, at its "
                    f"first path {ps[0]!r}"
                )


def _leaves_for(model: nn.Module, pairs: Pairs, tree: dict, what: str) -> list[torch.Tensor]:
    """The leaf of ``tree`` at each path of ``pairs``; checks the tree against the model."""
    flat = _tree.to_flat_dict(tree)
    idx = index(model)
    param_at = {path: p for p, ps in zip(idx.params, idx.paths) for path in ps}
    buffers = None
    for path, leaf in flat.items():
        p = param_at.get(path)
        if p is not None:  # a leaf at a parameter's path, trainable or not, is its shape
            refuse_lazy(what, [(path, p)])
            if leaf.shape != p.shape:
                raise ValueError(
                    f"{what} has at {path!r} a leaf of shape {tuple(leaf.shape)}, but that "
                    f"parameter has shape {tuple(p.shape)} (a tree matched to the model holds "
                    "each parameter's shape; nothing is broadcast)"
                )
            continue
        buffers = {n for n, _ in model.named_buffers()} if buffers is None else buffers
        if path in buffers:
            raise ValueError(
                f"{what} has a leaf at {path!r}, a buffer of the model, not a parameter "
                f"(a state_dict holds buffers too: keep its parameter paths only)"
            )
        raise ValueError(
            f"{what} has a leaf at {path!r}, which is not a parameter path of the model; "
            f"closest: {_closest(path, idx.all_paths())}"
        )
    _check_ties(idx, flat, what)
    missing = [path for path, _ in pairs if path not in flat]
    if missing:
        raise ValueError(
            f"{what} has no leaf at {missing[0]!r}, a trainable parameter of the model"
            + (f" ({len(missing) - 1} more missing)" if len(missing) > 1 else "")
        )
    return [flat[path] for path, _ in pairs]


def map_trainable(f: Callable, model: nn.Module, *trees: dict) -> dict:
    """``f(param, *leaves)`` at every trainable parameter of ``model``, as a tree.

    Arguments:
        f: called once per trainable parameter (tied ones once), in ``named_parameters()``
            order, with the parameter and the leaf of each tree at its path. It returns a
            tensor, or ``None`` to leave that path out of the result.
        model: the module whose trainability decides where ``f`` is called.
        *trees: trees (e.g. gradients from :func:`~torchstruct.structural_grad`) with a leaf at
            every trainable path; leaves at other parameter paths are ignored (see the module
            docstring).

    Returns:
        A tree of ``f``'s results at the trainable paths.

    Raises:
        TypeError: ``f`` is not callable, ``model`` is not a module, a tree is not a tree, or
            ``f`` returned something that is neither tensor nor None.
        ValueError: a tree lacks a trainable path, has a leaf at a path that is no parameter
            path of the model, or a leaf of another shape than its parameter; a trainable
            parameter is an uninitialized lazy one (the message names the path, and the tree).

    Example:
        >>> import torch, torch.nn as nn, torchstruct as ts
        >>> m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        >>> grads = ts.tree.map(torch.ones_like, ts.tree.from_module(m))
        >>> with ts.freeze(m, "0"):
        ...     sq = ts.map_trainable(lambda p, g: (g * g).sum(), m, grads)
        >>> ts.tree.to_flat_dict(sq)
        {'1.weight': tensor(2.), '1.bias': tensor(1.)}
    """
    check_callable(f, "f", "map_trainable")
    pairs = _trainable(model, "map_trainable")
    columns = [_leaves_for(model, pairs, t, f"tree argument {i}") for i, t in enumerate(trees, 1)]
    rows = zip(*columns) if columns else ((),) * len(pairs)
    return _tree.from_flat_dict((path, f(p, *row)) for (path, p), row in zip(pairs, rows))


def _check_tau(tau) -> float:
    value = as_real(tau)
    if value is None:
        raise TypeError("polyak_update: tau must be a real number or a one-element real tensor, "
                        f"got {describe(tau)}")
    if not 0.0 <= value <= 1.0:  # NaN fails too
        raise ValueError(f"polyak_update: tau must be in [0, 1], got {value}")
    return value


def _source_tree(target: nn.Module, pairs: Pairs, source) -> list[torch.Tensor]:
    if isinstance(source, nn.Module):
        flat = dict(source.named_parameters(remove_duplicate=False))
        missing = [path for path, _ in pairs if path not in flat]
        if missing:
            raise ValueError(
                f"polyak_update: source module has no parameter at {missing[0]!r}, a trainable "
                f"parameter of the target; closest: {_closest(missing[0], list(flat))}"
            )
        _check_ties(index(target), flat, "polyak_update: source module")
        return [flat[path] for path, _ in pairs]
    if isinstance(source, dict):
        return _leaves_for(target, pairs, source, "polyak_update: source tree")
    raise TypeError(f"polyak_update: source must be an nn.Module or a tree, got {type(source).__name__}")


def _check_pairs(pairs: Pairs, sources: list[torch.Tensor]) -> None:
    refuse_lazy("polyak_update: source", [(path, s) for (path, _), s in zip(pairs, sources)])
    for (path, p), s in zip(pairs, sources):
        if s.shape != p.shape or s.dtype != p.dtype or s.device != p.device:
            raise ValueError(
                f"polyak_update: at {path!r} the source is {tuple(s.shape)} {s.dtype} on "
                f"{s.device} but the target is {tuple(p.shape)} {p.dtype} on {p.device}"
            )
        if s.is_sparse or p.is_sparse:
            raise ValueError(f"polyak_update: sparse tensor at {path!r} is not supported")


def _check_writable(pairs: Pairs) -> None:
    """Refuse, before any write, a target parameter the update cannot write as itself: one a
    ``swap`` block stands another tensor in for (the stand-in would be written, and the update
    lost when the block ends), an inference tensor, one whose elements share memory."""
    swapped = _state.replaced(p for _, p in pairs)
    if swapped:
        path = next(path for path, p in pairs if p is swapped[0])
        raise RuntimeError(
            f"polyak_update: inside a swap block that replaces target's parameter {path!r}: the "
            f"update would write the stand-in, not the parameter. Update outside the block")
    validate_writable([p for _, p in pairs], "polyak_update",
                      lambda i: f"target's parameter {pairs[i][0]!r}")


def _unaliased(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> list[torch.Tensor]:
    """``sources``, each sharing memory with a target (another target parameter, a view of
    one) copied first: every source is read as it was before the update."""
    written = {_storage_key(t) for t in _dtensor.locals_(targets)}
    return [s.clone() if s is not t and _storage_key(local) in written else s
            for t, s, local in zip(targets, sources, _dtensor.locals_(sources))]


def _storage_key(t: torch.Tensor):
    """``t``'s storage (its device and where it starts), shared by every view of it whatever
    part it covers (unlike ``tree._memory``, the very same view); or ``t``'s id where it has no
    storage to read (a wrapper subclass): then it shares only with itself."""
    try:
        return (t.device, t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError, TypeError):
        return ("id", id(t))


@torch.no_grad()
def _lerp(targets: list[torch.Tensor], sources: list[torch.Tensor], tau: float) -> None:
    """``t.lerp_(s, tau)`` for all pairs, so that an error or a Ctrl-C leaves every target
    as it was or every one updated: ``tau`` 1 copies (``lerp`` would keep a NaN or inf of the
    target), in one call; one (device, dtype) group lerps in place, in one call. Several
    groups: the smaller ones are lerped out of place and copied in, then the largest lerps in
    place, the others put back if that raises (memory: twice the smaller groups, not the
    target). DTensors (no foreach copy for them) lerp group by group."""
    if not targets:  # (foreach ops refuse empty lists)
        return
    if tau == 1.0 and not _dtensor.any_dtensor(targets):
        torch._foreach_copy_(targets, sources)
        return
    groups: dict[tuple, tuple[list, list]] = {}
    for t, s in zip(targets, sources):
        ts_, ss = groups.setdefault((t.device, t.dtype), ([], []))
        ts_.append(t)
        ss.append(s)
    if len(groups) == 1 or _dtensor.any_dtensor(targets):
        for ts_, ss in groups.values():
            (torch._foreach_copy_(ts_, ss) if tau == 1.0 else torch._foreach_lerp_(ts_, ss, tau))
        return
    order = sorted(groups.values(), key=lambda g: sum(t.numel() for t in g[0]))
    *small, (big_t, big_s) = order
    small_t = [t for ts_, _ in small for t in ts_]
    staged = [v for ts_, ss in small for v in torch._foreach_lerp(ts_, ss, tau)]
    saved = [t.clone() for t in small_t]
    torch._foreach_copy_(small_t, staged)
    try:
        torch._foreach_lerp_(big_t, big_s, tau)
    except BaseException:
        torch._foreach_copy_(small_t, saved)
        raise


def _frozen_by_hand(model: nn.Module) -> bool:
    """``model`` has parameters and every one starts from ``requires_grad=False`` (not frozen
    by a context or declaration: those leave a target deliberately still)."""
    params = list(model.parameters())
    return bool(params) and not any(starting_flag(p, "", {})[0] for p in params)


def polyak_update(target: nn.Module, source, tau: float) -> nn.Module:
    """``target <- (1 - tau) * target + tau * source`` over the trainable parameters of ``target``.

    In place, under ``torch.no_grad()``, in one fused pass (``torch._foreach_lerp_`` per
    device and dtype; where there are several, the smaller groups are staged so that an error
    or a Ctrl-C never leaves the target half updated). A tied parameter is updated once. ``tau=1`` copies ``source`` (also
    over a NaN or inf in ``target``) and ``tau=0`` writes nothing. Every source value is read
    as it was before the call (a source sharing memory with a target parameter is copied
    first). Everything is validated before anything is written: on error no parameter has
    changed.

    Arguments:
        target: the module updated (its trainable parameters, tied ones once).
        source: a module (parameters matched by path; it may have extra ones) or a tree with
            a leaf at every trainable path of ``target``.
        tau: the weight of ``source``, in [0, 1] (``0`` keeps ``target``, ``1`` copies
            ``source``).

    Returns:
        ``target``.

    Raises:
        ValueError: ``tau`` outside [0, 1]; every parameter of ``target`` frozen by hand
            (``requires_grad=False`` before torchstruct: nothing would move); a trainable path
            missing from ``source``; a source tensor whose shape, dtype or device differs from
            the target's (path named).
        TypeError: ``target`` is not a module, ``source`` neither module nor tree, or ``tau``
            not a number.
        RuntimeError: inside a ``ts.constant`` block protecting a parameter it would update,
            or a ``ts.swap`` block replacing one; a target parameter that is an inference
            tensor (outside ``inference_mode``) or whose elements share memory (nothing is
            written).

    Example:
        >>> import torch, torch.nn as nn, torchstruct as ts
        >>> target, online = nn.Linear(2, 1), nn.Linear(2, 1)
        >>> with torch.no_grad():
        ...     _ = target.bias.fill_(0.0), online.bias.fill_(1.0)
        >>> _ = ts.polyak_update(target, online, tau=0.25)
        >>> float(target.bias.detach())
        0.25
    """
    tau = _check_tau(tau)
    pairs = _trainable(target, "polyak_update")
    if not pairs and _frozen_by_hand(target):
        raise ValueError(
            "polyak_update: every parameter of target was frozen by hand (requires_grad=False "
            "before torchstruct, as a target network made with requires_grad_(False)), so "
            "nothing would be updated; the update follows target's trainable parameters: call "
            "it inside `with ts.unfreeze(target):` to update them (or `ts.unfreeze(target, "
            "*selectors)` naming the floating-point parameters to update, when target holds "
            "integer ones)"
        )
    sources = _source_tree(target, pairs, source)
    _check_pairs(pairs, sources)
    targets = [p for _, p in pairs]
    refuse_constant_writes("polyak_update", targets)
    _check_writable(pairs)
    if tau == 0.0:  # keeps target as it is (a lerp would turn it NaN where source is inf)
        return target
    _lerp(targets, _unaliased(targets, sources), tau)
    return target
