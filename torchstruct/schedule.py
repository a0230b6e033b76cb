"""``ts.UnfreezeSchedule``: gradual unfreezing driven step by step, like an LR scheduler.

The schedule holds one permanent context on the model (:mod:`torchstruct.contexts`): a bare
``freeze_except(model, *trained)`` over everything the milestones reached so far select, or
``freeze(model)`` while none has been reached, or none at all once a milestone said
"everything". At a stage change it enters the new context and then leaves the old one; when the
change is refused (a flag change DDP cannot follow, see :mod:`torchstruct.distributed`), the old
context is put back and the schedule stays where it was: flags, step and stage unchanged.
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Mapping

from torch import nn

from ._checks import as_int, check_bool
from .contexts import exchange, freeze, freeze_except
from .select import select

__all__ = ["UnfreezeSchedule"]

class _Everything:
    """A milestone that trains everything from then on: one object, also through a copy."""

    def __reduce__(self):
        return "_EVERYTHING"  # pickled by name: the module's own object comes back

    def __repr__(self) -> str:
        return "everything"


_EVERYTHING = _Everything()


def _milestone_step(key) -> int:
    step = as_int(key)
    if step is None:
        raise TypeError(
            f"UnfreezeSchedule: milestone steps must be integers, got {key!r} "
            f"({type(key).__name__})"
        )
    if step < 0:
        raise ValueError(f"UnfreezeSchedule: milestone step {step} is negative")
    return step


def _nothing(path: str, param) -> bool:
    """The selector of the stage where everything trains: it picks no parameter."""
    return False


def _milestone_selectors(model: nn.Module, step: int, value, strict: bool):
    """A milestone's value -> ``_EVERYTHING`` or a tuple of selectors, checked against ``model``."""
    if value is None or (isinstance(value, str) and value == "*"):
        return _EVERYTHING
    sels = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    if not sels:
        raise ValueError(
            f"UnfreezeSchedule: milestone {step} has an empty selector list (use None or '*' "
            "for everything)"
        )
    try:
        select(model, *sels, strict=strict)
    except (TypeError, ValueError) as e:
        raise type(e)(f"UnfreezeSchedule: milestone {step}: {e}") from None
    return sels


class UnfreezeSchedule:
    """Unfreeze parts of a model at given steps; what trains grows with every milestone.

    ``milestones`` maps a step to the selectors that train from that step on, in addition to
    everything earlier milestones selected; ``None`` or ``"*"`` trains everything. Step 0 applies
    at construction (with no milestone at 0, everything is frozen until the first one), and
    :meth:`step` advances one step, like an LR scheduler: call it once per optimizer step,
    after ``optimizer.step()``. The selected parameters keep their own flags (those frozen by a
    declaration, by PEFT or by hand stay frozen), exactly as :class:`~torchstruct.freeze_except`
    leaves them; contexts entered around the schedule compose with it.

    A step that reaches no milestone is a counter increment and a comparison (no walk of the
    model). :meth:`state_dict` / :meth:`load_state_dict` carry the step across a resume; loading
    re-applies the flags of the loaded stage at once.

    Arguments:
        model: the module whose parameters the schedule governs.
        milestones: ``{step: selectors}``; steps are integers >= 0, selectors anything
            :func:`~torchstruct.select` takes (a list or tuple is a union), or ``None`` / ``"*"``
            for everything.
        strict: when True (default), a selector that matches nothing raises (typos), here and
            at every stage change.
        freeze_norm_stats: passed to the contexts: normalization layers whose parameters are all
            frozen stop updating their running statistics (default True).

    Raises:
        TypeError: ``model`` is not a module, ``milestones`` not a mapping, a step not an
            integer, a selector of an unsupported type, or ``strict`` / ``freeze_norm_stats``
            not a bool.
        ValueError: no milestone, a negative step, an empty selector list, or a selector that
            matches nothing (naming the milestone and the closest paths).
        RuntimeError: the flags of step 0 cannot be applied (a wrapped DDP model cannot follow
            them). Nothing changed.

    Example:
        >>> import torch.nn as nn, torchstruct as ts
        >>> m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 1))
        >>> s = ts.UnfreezeSchedule(m, {0: "2", 2: "1", 4: None})
        >>> [p.requires_grad for p in m.parameters()]
        [False, False, False, False, True, True]
        >>> for _ in range(2):
        ...     s.step()
        >>> s.current_step, s.stage, s.selectors
        (2, 2, ('2', '1'))
        >>> [p.requires_grad for p in m.parameters()]
        [False, False, True, True, True, True]
    """

    def __init__(
        self,
        model: nn.Module,
        milestones: Mapping,
        *,
        strict: bool = True,
        freeze_norm_stats: bool = True,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"UnfreezeSchedule: expected an nn.Module, got {type(model).__name__}")
        if not isinstance(milestones, Mapping):
            raise TypeError(
                "UnfreezeSchedule: milestones must be a mapping {step: selectors}, got "
                f"{type(milestones).__name__}"
            )
        if not milestones:
            raise ValueError("UnfreezeSchedule: milestones is empty (nothing would ever train)")
        steps = {}
        for key, value in milestones.items():
            step = _milestone_step(key)
            if step in steps:
                raise ValueError(f"UnfreezeSchedule: milestone step {step} is given twice")
            steps[step] = value
        self.model = model
        self.strict = check_bool(strict, "strict", "UnfreezeSchedule")
        self.freeze_norm_stats = check_bool(freeze_norm_stats, "freeze_norm_stats",
                                            "UnfreezeSchedule")
        self._steps = tuple(sorted(steps))
        self._selectors = tuple(
            _milestone_selectors(model, s, steps[s], self.strict) for s in self._steps
        )
        self._context = None
        self._closed = False
        self._copy = False  # a copy (deepcopy, pickle) governs no model
        self._stage = 0
        self._step = 0
        self._next = -1  # the step of the next milestone; -1: not applied yet
        self._swap(self._stage_at(0), _apply_first=True)

    # ------------------------------------------------------------------ reading
    @property
    def current_step(self) -> int:
        """The number of :meth:`step` calls so far (0 after construction), or the loaded step."""
        return self._step

    @property
    def stage(self) -> int:
        """How many milestones have been reached (0 while none has)."""
        return self._stage

    @property
    def milestones(self) -> tuple[int, ...]:
        """The milestone steps, sorted."""
        return self._steps

    @property
    def selectors(self) -> tuple | None:
        """The selectors that train now (the milestones reached, in order), ``None`` once a
        milestone said everything, ``()`` while none has been reached."""
        return self._union(self._stage)

    def _union(self, stage: int) -> tuple | None:
        reached = self._selectors[:stage]
        if any(s is _EVERYTHING for s in reached):
            return None
        return tuple(sel for sels in reached for sel in sels)

    def _stage_at(self, step: int) -> int:
        return bisect.bisect_right(self._steps, step)

    def __repr__(self) -> str:
        return (
            f"UnfreezeSchedule(step={self._step}, stage={self._stage}/{len(self._steps)}, "
            f"milestones={list(self._steps)})"
        )

    # ------------------------------------------------------------------ copies
    def __getstate__(self) -> dict:
        """A copy (``copy.deepcopy``, ``pickle``, ``torch.save``) keeps the step, the stage and
        the milestones, and governs no model: the context holding the flags belongs to this
        schedule and its model, and a copied model starts from the flags copied with it, the
        stage's frozen ones included, which no context of a copy could tell from the user's.
        Its :meth:`state_dict` works and :meth:`close` lifts nothing; :meth:`step` and
        :meth:`load_state_dict` raise, saying how to go on (a new schedule, loaded from it).
        Like any attribute, ``model`` is copied with it."""
        state = dict(self.__dict__)
        state["_context"], state["_copy"] = None, True
        return state

    def _refuse_copy(self, what: str) -> None:
        if self._copy:
            raise RuntimeError(
                f"UnfreezeSchedule.{what}: this schedule is a copy (copy.deepcopy, pickle), "
                "which governs no model (a copied model carries the flags it was copied with). "
                "Build ts.UnfreezeSchedule(model, milestones) on the model to govern, from its "
                "flags before any schedule froze them, and load_state_dict(this.state_dict()).")

    # ------------------------------------------------------------------ advancing
    def step(self) -> None:
        """Advance one step; at a milestone, unfreeze what it selects.

        Raises:
            RuntimeError: the stage change is refused (DDP cannot follow it). The schedule, its
                step and every flag stay as they were.
            ValueError: with ``strict=True``, a selector of the new stage matches nothing in the
                model any more (the model changed). Nothing changed.
        """
        self._refuse_copy("step")
        step = self._step + 1
        if step < self._next:
            self._step = step
            return
        self._swap(self._stage_at(step))
        self._step = step

    def close(self) -> None:
        """Lift the schedule's context: every flag returns to what it would be without it.

        The schedule is unusable afterwards (:meth:`step` and :meth:`load_state_dict` raise).
        """
        if self._context is not None:
            self._context.__exit__(None, None, None)
        self._context, self._closed, self._next = None, True, -1

    def state_dict(self) -> dict:
        """``{"step": int, "milestones": [int, ...]}``: what :meth:`load_state_dict` needs."""
        return {"step": self._step, "milestones": list(self._steps)}

    def load_state_dict(self, state: Mapping) -> None:
        """Go to the step in ``state`` and apply the flags of its stage at once.

        Arguments:
            state: a dict from :meth:`state_dict` of a schedule with the same milestone steps.

        Raises:
            TypeError, ValueError: ``state`` is malformed, or was saved by a schedule with other
                milestone steps. Nothing changed.
            RuntimeError: the stage change is refused (DDP). Nothing changed.
        """
        self._refuse_copy("load_state_dict")
        if not isinstance(state, Mapping) or set(state) != {"step", "milestones"}:
            raise ValueError(
                "UnfreezeSchedule.load_state_dict: expected a dict with keys 'step' and "
                f"'milestones', got {state!r}"
            )
        step = as_int(state["step"])
        if step is None or step < 0:
            raise ValueError(
                "UnfreezeSchedule.load_state_dict: 'step' must be an integer >= 0, got "
                f"{state['step']!r}"
            )
        saved = state["milestones"]
        steps = [as_int(s) for s in saved] if isinstance(saved, (list, tuple)) else [None]
        if None in steps:
            raise ValueError(
                "UnfreezeSchedule.load_state_dict: 'milestones' must be a list of integer "
                f"steps, got {saved!r}"
            )
        if steps != list(self._steps):
            raise ValueError(
                "UnfreezeSchedule.load_state_dict: the state was saved by a schedule with "
                f"milestones at steps {list(state['milestones'])}, this one has "
                f"{list(self._steps)}"
            )
        # the stage in force too: its context taken again, so a tree changed since (a layer
        # appended) is judged now, as the load promises, at the stage's place in the stack
        self._swap(self._stage_at(step))
        self._step = step

    # ------------------------------------------------------------------ the context
    def _context_for(self, stage: int):
        """The (validated, not yet applied) context that holds ``stage``, or None."""
        union = self._union(stage)
        if union is None:  # everything trains: a context freezing nothing keeps the schedule's
            # place among the active contexts (and its serial: later writes by hand stand)
            return freeze.prepared(self.model, _nothing, strict=False,
                                   freeze_norm_stats=self.freeze_norm_stats)
        for step, sels in zip(self._steps, self._selectors[:stage]):  # the model may have
            _milestone_selectors(self.model, step, sels, self.strict)  # changed: say where
        if not union:
            return freeze.prepared(self.model, freeze_norm_stats=self.freeze_norm_stats)
        return freeze_except.prepared(self.model, *union, strict=self.strict,
                                      freeze_norm_stats=self.freeze_norm_stats)

    def _swap(self, stage: int, _apply_first: bool = False) -> None:
        """Hold the context of ``stage`` instead of the current one, in one application of the
        flags (a change DDP cannot follow is refused by its guard), or change nothing."""
        if self._closed:
            raise RuntimeError("UnfreezeSchedule: the schedule was closed")
        new = self._context_for(stage)  # validated: a bad selector raises, nothing changed
        try:
            exchange(self._context, new)
        except RuntimeError as e:
            where = "at construction" if _apply_first else f"to stage {stage}"
            said = str(e)
            unchanged = "" if "no flag was changed" in said.lower() else "; no flag was changed"
            raise RuntimeError(
                f"UnfreezeSchedule: the change {where} is refused: {said} The schedule stays "
                f"at step {self._step}, stage {self._stage}{unchanged}."
            ) from e
        self._context, self._stage = new, stage
        self._next = self._steps[stage] if stage < len(self._steps) else math.inf
