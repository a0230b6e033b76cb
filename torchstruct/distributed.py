"""torchstruct and ``torch.distributed``.

**DistributedDataParallel.** DDP decides, when it is built, which parameters it synchronizes:
those that require grad. Changing what trains afterwards goes wrong silently (a parameter that
starts training gets gradients that differ between ranks) or fails later with DDP's generic
"Expected to have finished reduction" error (a parameter that stops training while
``find_unused_parameters=False``). torchstruct therefore refuses such a change at once, with an
error that says what to do, and changes no flag:

- a parameter that DDP does not synchronize would start training: always refused (re-wrap);
- a synchronized parameter would stop training: refused unless the wrapper was built with
  ``find_unused_parameters=True``, which copes with it.

Leaving a context always restores the flags; when that changes what a live wrapper
synchronizes (the model was wrapped inside the context), a ``RuntimeWarning`` says so.

Declarations and contexts applied *before* wrapping, contexts that leave the synchronized set as
it is, and the block-local ``stop_gradient``/``constant``/``swap`` (they change no flag) are
always fine. ``global_norm`` and ``clip_by_global_norm`` on a DDP model read the gradients after
DDP averaged them, so they give the global answer on every rank.

**FSDP2** (``fully_shard``) needs no guard: it copies the sharded parameters' flags to the
gathered ones at every forward, so what trains may change between steps. Its DTensor
parameters and gradients are handled where the ops meet the kernels (``torchstruct._dtensor``).
"""
from __future__ import annotations

import warnings
import weakref

from torch import nn
from torch.nn.modules import module as _module_mod
from torch.nn.parallel import DistributedDataParallel

from ._state import flag_guards

__all__: list[str] = []

# id of a parameter -> (weakref to its DDP wrapper, whether DDP synchronizes it)
_wrapped: dict[int, tuple[weakref.ref, bool]] = {}


def _on_module_registered(module: nn.Module, name: str, inner) -> None:
    """Record, as DDP is built, which parameters of its module it will synchronize."""
    if isinstance(module, DistributedDataParallel) and name == "module":
        ref = weakref.ref(module)
        for p in inner.parameters():
            _wrapped[id(p)] = (ref, p.requires_grad)
            weakref.finalize(p, _wrapped.pop, id(p), None)


def _ddp_problem(path: str, p, flag: bool) -> str | None:
    """Why DDP cannot follow ``p``'s flag changing to ``flag``, or None when it can."""
    hit = _wrapped.get(id(p))
    ddp = hit[0]() if hit else None
    if ddp is None:
        return None
    if flag and not hit[1]:
        return (
            f"{path!r} would start training, but DistributedDataParallel synchronizes only the "
            "parameters that required grad when it was built: its gradient would differ between "
            "ranks. Change what trains before wrapping (wrap the model again after the change)."
        )
    if not flag and hit[1] and not ddp.find_unused_parameters:
        return (
            f"{path!r} would stop training, but DistributedDataParallel was built with "
            "find_unused_parameters=False and waits for its gradient at every step. Change what "
            "trains before wrapping, or wrap with find_unused_parameters=True."
        )
    return None


def _ddp_guard(changes, refuse: bool) -> None:
    problems = [m for m in (_ddp_problem(*c) for c in changes) if m]
    if problems and refuse:
        raise RuntimeError(problems[0] + " No flag was changed.")
    if problems:  # leaving a context always restores; the wrapper is now stale
        warnings.warn(
            problems[0].replace("would", "will")
            + " (This follows from leaving a context entered before the model was wrapped.)",
            RuntimeWarning,
            stacklevel=4,
        )


_module_mod.register_module_module_registration_hook(_on_module_registered)
flag_guards.append(_ddp_guard)
