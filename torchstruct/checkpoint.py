"""Trainable-only checkpoints: ``ts.state_dict`` and ``ts.load_state_dict``.

``ts.state_dict(model)`` holds exactly what training can change:

- every **trainable parameter** (``ts.trainable_parameters``), once, at its canonical path (a
  tied parameter at its first path in ``named_parameters()`` order);
- with ``buffers=True``, the persistent buffers (those ``Module.state_dict`` saves) of
  1. every module that **directly owns** a trainable parameter (it is one of the module's own
     ``_parameters``, not a descendant's): a trainable ``BatchNorm``'s running statistics, for
     example; and
  2. every normalization layer that tracks running statistics and **has no parameters**
     (``BatchNorm(affine=False)``, ``InstanceNorm(track_running_stats=True)``): its statistics
     update in training whatever is frozen.

  A normalization layer whose parameters are all frozen is left out: its statistics stay as they
  are while frozen (the default ``freeze_norm_stats=True`` of the contexts). A buffer reachable
  by several paths appears once, at its first path.

Keys are paths exactly as ``model.state_dict()`` spells them, so the result also loads with
``model.load_state_dict(state, strict=False)``. The tensors share storage with the model, as
``Module.state_dict`` does (``torch.save`` copies them).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from . import _state
from ._checks import check_bool, refuse_lazy
from ._reference import unwritable
from .blocks import refuse_constant_writes
from .declare import trainable_parameters
from .select import _closest
from .tree import _same_tensor
from .walk import _unaliased

__all__ = ["state_dict", "load_state_dict", "IncompatibleKeys"]


class IncompatibleKeys(NamedTuple):
    """What :func:`load_state_dict` did not find (``unexpected_keys`` is always empty: an
    unknown key raises)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def _owned_buffers(model: nn.Module, trained: set[int]) -> dict[str, torch.Tensor]:
    """The persistent buffers of modules that own a trainable parameter, and of parameter-less
    normalization layers, each buffer object once at its first path."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for mpath, mod in model.named_modules():
        own = [p for p in mod._parameters.values() if p is not None]
        stats = isinstance(mod, _NormBase) and mod.track_running_stats and not own
        if not stats and not any(id(p) in trained for p in own):
            continue
        for name, b in mod._buffers.items():
            if b is None or name in mod._non_persistent_buffers_set or id(b) in seen:
                continue
            seen.add(id(b))
            out[f"{mpath}.{name}" if mpath else name] = b
    return out


def state_dict(model: nn.Module, *, buffers: bool = True) -> dict[str, torch.Tensor]:
    """What training can change in ``model``: its trainable parameters and their modules' buffers.

    Arguments:
        model: the module.
        buffers: include the buffers described in the module docstring (running statistics of
            trainable normalization layers, ...). Default True.

    Returns:
        ``{path: tensor}`` (detached, sharing storage with the model), in the order of
        ``model.state_dict()``.

    Raises:
        TypeError: ``model`` is not a module, ``buffers`` not a bool.
        ValueError: a trainable parameter is uninitialized (a lazy module before its first
            forward), naming its path.

    Example:
        >>> import torch.nn as nn, torchstruct as ts
        >>> m = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
        >>> with ts.freeze(m, "0"):
        ...     list(ts.state_dict(m))
        ['1.weight', '1.bias', '1.running_mean', '1.running_var', '1.num_batches_tracked']
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"state_dict: expected an nn.Module, got {type(model).__name__}")
    check_bool(buffers, "buffers", "state_dict")
    params = list(trainable_parameters(model))
    refuse_lazy("state_dict", params)  # no values to save or load yet
    # (inside a swap block, the stand-ins' values, as model.state_dict() holds them there)
    out = {path: p.detach() for path, p in params}
    if buffers:
        trained = {id(p) for _, p in params}
        out.update((path, b.detach()) for path, b in _owned_buffers(model, trained).items())
    order = {path: i for i, path in enumerate(_targets(model))}  # Module.state_dict's order
    return {path: out[path] for path in sorted(out, key=order.__getitem__)}


def _targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every path ``Module.state_dict`` would write, in its order: parameters (all paths of a
    tied one) and persistent buffers."""
    out: dict[str, torch.Tensor] = {}
    for mpath, mod in model.named_modules(remove_duplicate=False):
        prefix = f"{mpath}." if mpath else ""
        for name, p in mod._parameters.items():
            if p is not None:
                out[prefix + name] = p
        for name, b in mod._buffers.items():
            if b is not None and name not in mod._non_persistent_buffers_set:
                out[prefix + name] = b
    return out


_PLAIN = (torch.Tensor, nn.Parameter)


def _method(cls, name: str):
    attr = getattr(cls, name)
    return getattr(attr, "__func__", attr)


# what a plain tensor or parameter runs for torch functions and dispatch
_PLAIN_HANDLERS = ({_method(c, "__torch_function__") for c in _PLAIN},
                   {_method(c, "__torch_dispatch__") for c in _PLAIN})


def _plain(t: torch.Tensor) -> bool:
    """``t`` is copied in place as a plain tensor: a ``Tensor``, a ``Parameter``, or a
    subclass of them that only adds Python attributes (neither torch function nor dispatch
    handling of its own: not DTensor, not a lazy parameter)."""
    cls = type(t)
    return cls in _PLAIN or (_method(cls, "__torch_function__") in _PLAIN_HANDLERS[0]
                             and _method(cls, "__torch_dispatch__") in _PLAIN_HANDLERS[1])


def _problem(path: str, value, target: torch.Tensor) -> str | None:
    """Why ``value`` cannot be written into ``target``, or None."""
    if not isinstance(value, torch.Tensor):
        return f"{path!r}: expected a tensor, got {type(value).__name__}"
    for what, t in (("state's", value), ("model's", target)):
        if not _plain(t):  # DTensor, lazy or other subclasses: not copied in place here
            return f"{path!r}: the {what} tensor is a {type(t).__name__}, not a plain tensor"
    if tuple(value.shape) != tuple(target.shape):
        return (
            f"{path!r}: shape {tuple(value.shape)} in the state, {tuple(target.shape)} in the "
            "model"
        )
    if value.dtype != target.dtype:
        return f"{path!r}: dtype {value.dtype} in the state, {target.dtype} in the model"
    if value.is_meta:
        return f"{path!r}: the state's tensor is on the meta device (it has no data)"
    if target.is_meta:
        return (
            f"{path!r}: the model's tensor is on the meta device; materialize the model (e.g. "
            "model.to_empty(device=...)) before loading"
        )
    if value.layout != target.layout:
        return f"{path!r}: layout {value.layout} in the state, {target.layout} in the model"
    if target.is_inference() and not torch.is_inference_mode_enabled():
        return (
            f"{path!r}: the model's tensor was created under torch.inference_mode() and cannot "
            "be written outside it; load inside torch.inference_mode() or rebuild the model "
            "outside it"
        )
    # elements sharing memory (an expanded buffer); an inference tensor is told of above
    problem = unwritable(target, outside_inference=False)
    return None if problem is None else f"{path!r}: the model's tensor {problem}"


def load_state_dict(
    model: nn.Module, state: Mapping[str, torch.Tensor], *, strict: bool = True,
    buffers: bool = True,
) -> IncompatibleKeys:
    """Load a (trainable-only) checkpoint into ``model``, checking everything before writing.

    Every key must be a path of a parameter or persistent buffer of ``model`` (any parameter,
    trainable or not: a full ``model.state_dict()`` loads too); every value a tensor of the same
    shape and dtype, with data (not on the meta device), on any device (copied across). Values
    are copied into the model's tensors in place, under ``torch.no_grad()``; flags are not
    touched.

    Arguments:
        model: the module to write into.
        state: ``{path: tensor}``, e.g. from :func:`state_dict` (then ``torch.save``/``load``).
        strict: when True (default), every key :func:`state_dict` gives for ``model`` now (set up
            the same freezing before loading) must be present. ``False`` allows missing keys,
            never unknown keys or mismatched tensors.
        buffers: whether the buffers :func:`state_dict` includes are expected (``strict``); use
            the value the checkpoint was saved with.

    Returns:
        ``IncompatibleKeys(missing_keys, unexpected_keys)``, as ``Module.load_state_dict``.

    Raises:
        TypeError: ``model`` is not a module, ``state`` not a mapping with string keys, or
            ``strict`` or ``buffers`` not a bool.
        ValueError: unknown keys (with the closest paths), missing keys (``strict``), values of
            the wrong type, shape, dtype or device, or one tensor given twice (a tied parameter
            under two paths) with different values. Nothing is written.
        RuntimeError: inside a ``ts.constant`` block protecting a parameter it would write.
            Nothing is written.

    Example:
        >>> import torch, torch.nn as nn, torchstruct as ts
        >>> a, b = nn.Linear(2, 2), nn.Linear(2, 2)
        >>> with ts.freeze(a, "bias"), ts.freeze(b, "bias"):
        ...     _ = ts.load_state_dict(b, ts.state_dict(a))
        >>> torch.equal(a.weight, b.weight), torch.equal(a.bias, b.bias)
        (True, False)
    """
    with _state.without_stand_ins():  # the model as it is outside a swap block
        return _load(model, state, strict, buffers)


def _load(model: nn.Module, state, strict, buffers) -> IncompatibleKeys:
    if not isinstance(model, nn.Module):
        raise TypeError(f"load_state_dict: expected an nn.Module, got {type(model).__name__}")
    if not isinstance(state, Mapping):
        raise TypeError(f"load_state_dict: state must be a mapping, got {type(state).__name__}")
    check_bool(strict, "strict", "load_state_dict")
    check_bool(buffers, "buffers", "load_state_dict")
    bad_keys = [k for k in state if not isinstance(k, str)]
    if bad_keys:
        raise TypeError(f"load_state_dict: keys must be paths (str), got {bad_keys[0]!r}")
    targets = _targets(model)
    problems = [
        f"{k!r} is not a parameter or buffer of the model; closest: {_closest(k, list(targets))}"
        for k in state if k not in targets
    ]
    problems += [m for k, v in state.items() if k in targets if (m := _problem(k, v, targets[k]))]
    if not problems:
        problems += _aliases_differ(state, targets)
    try:
        expected = state_dict(model, buffers=buffers)
    except ValueError:  # a lazy trainable parameter: named, unless other problems are to tell
        if not problems:
            raise
        expected = {}
    given = {id(targets[k]) for k in state if k in targets}  # a tied tensor under any path
    missing = [k for k in expected if k not in state and id(targets[k]) not in given]
    if strict and missing:
        problems.append(
            f"missing {len(missing)} key(s) of the trainable state: {missing[:5]}"
            + (" ..." if len(missing) > 5 else "")
            + " (pass strict=False to allow it)"
        )
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise ValueError(
            "load_state_dict: " + "; ".join(problems[:5]) + more + ". Nothing was written."
        )
    # (a value that is its target's own memory seen the same way changes nothing)
    writes = [(targets[k], v) for k, v in state.items() if not _same_tensor(v, targets[k])]
    refuse_constant_writes("load_state_dict", [t for t, _ in writes])
    if writes:  # one call: an error or a Ctrl-C lands before it or after it, never half way
        dests = [t for t, _ in writes]
        values = _unaliased(dests, [v for _, v in writes])  # each read as it was before
        with torch.no_grad():
            torch._foreach_copy_(dests, values)
    return IncompatibleKeys(missing, [])


def _aliases_differ(state: Mapping, targets: dict) -> list[str]:
    first: dict[int, str] = {}
    out = []
    for k, v in state.items():
        prev = first.setdefault(id(targets[k]), k)
        if prev != k and not _same_values(state[prev], v):
            out.append(f"{prev!r} and {k!r} name the same tensor (tied) with different values")
    return out


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one shape and dtype hold the same values, NaN as NaN (a tied
    parameter's entries in ``model.state_dict()``, which may hold NaN)."""
    a, b = a.cpu(), b.cpu()
    if torch.equal(a, b):
        return True
    if not (a.is_floating_point() or a.is_complex()):
        return False
    return bool(((a == b) | (a.isnan() & b.isnan())).all())
