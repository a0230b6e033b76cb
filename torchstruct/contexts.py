"""Contexts that change which parameters train for a block, and restore exactly afterwards.

Each context is a class that applies at construction and restores at ``__exit__`` (the
``torch.set_grad_enabled`` convention):

- ``with ts.freeze_except(model, "head"): ...`` is temporary;
- a bare ``ts.freeze_except(model, "head")`` is permanent;
- ``@ts.freeze_except(model, "head")`` on a function applies per call, not at decoration.

They nest (the innermost wins), compose, and restore the previous flags also when the block
raises.
"""
from __future__ import annotations

import functools
import weakref
from typing import Callable, ClassVar

from torch import nn

from .declare import Entry, _drop_dead, pop, push
from .select import select

__all__ = ["freeze", "freeze_except", "unfreeze"]


class _Context:
    """Apply at construction, undo at ``__exit__``; as a decorator, apply per call."""

    def __init__(self, *args, **kwargs) -> None:
        self._args, self._kwargs = args, kwargs
        self._active = False
        self._apply()
        self._active = True

    def _apply(self) -> None:  # validate everything first: a bad input changes nothing
        raise NotImplementedError

    def _undo(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        if not self._active:
            self._apply()
            self._active = True
        return self

    def __exit__(self, *exc) -> bool:
        if self._active:
            self._active = False
            self._undo()
        return False

    def __call__(self, fn: Callable) -> Callable:
        self.__exit__(None, None, None)  # decorating applies nothing

        @functools.wraps(fn)
        def per_call(*args, **kwargs):
            with type(self)(*self._args, **self._kwargs):
                return fn(*args, **kwargs)

        return per_call


class _FlagContext(_Context):
    kind: ClassVar[str]
    needs_selector: ClassVar[bool] = False

    def __init__(
        self, model: nn.Module, *selectors, strict: bool = True, freeze_norm_stats: bool = True
    ) -> None:
        super().__init__(model, *selectors, strict=strict, freeze_norm_stats=freeze_norm_stats)

    def _apply(self) -> None:
        model, *selectors = self._args
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"{type(self).__name__}: first argument must be an nn.Module, got "
                f"{type(model).__name__}"
            )
        if not selectors:
            if self.needs_selector:
                raise TypeError(f"{type(self).__name__} needs at least one selector")
            selectors = []  # the whole of ``model`` (an empty tuple means that to Entry)
        if selectors:
            select(model, *selectors, strict=self._kwargs["strict"])  # raises before any change
        self._entry = Entry(
            self.kind,
            weakref.ref(model, _drop_dead),  # a permanent context ends with its model
            tuple(selectors),
            self._kwargs["freeze_norm_stats"],
        )
        push(self._entry)

    def _undo(self) -> None:
        pop(self._entry)


class freeze(_FlagContext):
    """Turn the selected parameters off (all of ``model`` when no selector is given).

    Example:
        >>> import torch.nn as nn, torchstruct as ts
        >>> m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        >>> with ts.freeze(m, "0"):
        ...     m[0].weight.requires_grad
        False
        >>> m[0].weight.requires_grad
        True
    """

    kind = "freeze"


class freeze_except(_FlagContext):
    """Turn every parameter of ``model`` off except the selected (which stay as they are).

    Example:
        >>> import torch.nn as nn, torchstruct as ts
        >>> m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        >>> with ts.freeze_except(m, "1.*"):
        ...     [p.requires_grad for p in m.parameters()]
        [False, False, True, True]
    """

    kind = "freeze_except"
    needs_selector = True


class unfreeze(_FlagContext):
    """Turn the selected parameters on (all of ``model`` when no selector is given).

    A declaration (``trainable()`` / :func:`~torchstruct.mark_trainable`) still wins: unfreeze
    lifts contexts and starting flags, not declarations.
    """

    kind = "unfreeze"
