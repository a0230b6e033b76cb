"""What ``torch.compile`` gets wrong around torchstruct: worked around where it can be, said once
where not.

- Its guards do not check the ``requires_grad`` of a module's parameters
  (pytorch/pytorch#139476, fixed in torch 2.12): a graph compiled for one trainable set keeps
  running after the flags change (gradients for frozen weights; none for a module added after
  compiling). Plain PyTorch 2.4.1 and 2.11.0 do this; 2.12.0 and later recompile. From 2.5
  (2.5.1, 2.6.0, 2.8.0 and 2.11.0 seen) the cause is a shortcut: a module's guards are skipped
  while its dictionaries are unchanged, and a flag is not a dictionary change. Where
  torchstruct changes flags it therefore changes the ``_parameters`` dictionary of each module
  holding one (a key added and taken out again, :func:`flags_changed`): compiled code checks
  its guards again, flags included, and recompiles once per trainable set (a set seen before
  reuses its graph). On 2.4 nothing short of ``torch._dynamo.reset()`` helps: a warning.
- Dynamo before torch 2.13 traces a torch function mode's handler wrongly: on 2.12.0 a property
  read passed through a ``stop_gradient`` block's handler returned another value (HF GPT-2's
  ``input_ids.device`` came back as a ``torch.Size``), and 2.11.0 and 2.12.0 refuse its
  ``id()`` look-ups. There the blocks' handler is left out of compiled code
  (:data:`MODES_MISTRACED`): inside a block each operation of compiled code runs eagerly
  through a graph break, and ``fullgraph=True`` raises.
- On older releases (2.4.1 seen), compiled code runs under a torch dispatch mode without
  passing its operations through it, and an inductor kernel writes a parameter without
  bumping its version counter: ``ts.constant`` does not see such a write. 2.11.0 and later
  leave compiled code out while a dispatch mode is active.
- Dynamo (2.13 seen) compiles a torch function mode's handler as a frame of its own where the
  code calling the operation runs eagerly (a compiled function that enters a ``stop_gradient``
  block falls back to eager around it), and guards that frame on the handler's tensors but not
  on ``func``, the operation: the next operation on tensors of the same kind reuses the
  graph (``x.sigmoid()`` returned ``x.tanh()``). The blocks' handler is therefore never
  compiled as a frame of its own (:func:`only_inlined`); dynamo still traces it where it
  inlines it into a compiled forward.

:func:`flags_changed` is called where torchstruct changes flags, :func:`warn_once` where
``ts.constant`` is entered: on such a torch, in a process that has compiled a graph, each warns
once where nothing can be done.
"""
from __future__ import annotations

import os
import sys
import warnings

import torch

__all__ = ["STALE", "MODES_MISTRACED", "RECHECKED", "only_inlined", "flags_changed", "warn_once"]

_VERSION = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
STALE = _VERSION < (2, 12)
MODES_MISTRACED = _VERSION < (2, 13)
RECHECKED = (2, 5) <= _VERSION < (2, 12)  # stale, but a dictionary change makes guards re-check
_warned = False
_KEY = "\0torchstruct flags changed"  # never a parameter's name (a name cannot hold "\0")


def _compiled_something() -> bool:
    utils = sys.modules.get("torch._dynamo.utils")
    return utils is not None and bool(utils.counters["stats"]["unique_graphs"])


def only_inlined(fn):
    """``fn`` (a function) is never compiled by dynamo as a frame of its own: called from code
    that runs eagerly, it runs eagerly, and so does everything it calls; traced where dynamo
    inlines it into a compiled caller. Where this torch offers no way to say so, ``fn`` is
    left out of compiled code altogether (``torch.compiler.disable``): correct, with a graph
    break where it is called. Returns the function to use."""
    eval_frame = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
    action = getattr(eval_frame, "FrameAction", None)
    strategy = getattr(eval_frame, "FrameExecStrategy", None)
    setter = getattr(eval_frame, "set_code_exec_strategy", None)
    if action is None or strategy is None or setter is None:
        return torch.compiler.disable(fn)
    setter(fn.__code__, strategy(action.SKIP, action.SKIP))
    return fn


def flags_changed(modules) -> None:
    """torchstruct changed the flags of parameters held by ``modules``: where this torch would
    keep running graphs compiled for the old flags but re-checks its guards after a change of
    a module's dictionaries (:data:`RECHECKED`), each module's ``_parameters`` gets a key added
    and taken out again (no parameter is ever missing from it); where nothing helps, a warning
    (:func:`warn_once`). Only in a process that has compiled a graph."""
    if not STALE or not _compiled_something():
        return
    if not RECHECKED:
        warn_once()
        return
    for m in modules:
        params = m._parameters
        if params:
            params[_KEY] = None
            del params[_KEY]


def warn_once() -> None:
    """Warn (``RuntimeWarning``, once per process) when this torch is one of those above and
    the process has compiled a graph."""
    global _warned
    if not STALE or _warned or not _compiled_something():
        return
    _warned = True
    if RECHECKED:  # flags are handled (flags_changed): only ts.constant is left
        message = (
            f"ts.constant under torch.compile on torch {torch.__version__}: compiled code may "
            "write a parameter without ts.constant seeing it (on 2.4 an inductor kernel's write "
            "is not seen; torch >= 2.11 leaves compiled code out while the block is active). "
            "Keep compiled code out of ts.constant blocks, or use torch >= 2.12.")
    else:
        message = (
            f"torchstruct under torch.compile needs torch >= 2.5, and this process runs "
            f"compiled code on torch {torch.__version__}: its graphs keep the requires_grad "
            "flags they were compiled with (pytorch/pytorch#139476), so after torchstruct "
            "changes what trains a compiled model or step may compute gradients for the old "
            "trainable set (frozen weights can still move; a module added after compiling gets "
            "none), and an inductor kernel's write to a parameter is not seen by ts.constant. "
            "Call torch._dynamo.reset() after changing what trains, keep compiled code out of "
            "ts.constant blocks, or use torch >= 2.12.")
    warnings.warn(message, RuntimeWarning, stacklevel=_outside_torchstruct())


def _outside_torchstruct() -> int:
    """The ``stacklevel`` of the first caller outside torchstruct and torch (from
    ``warn_once``; torch's frames are those of ``torch.compiler.disable`` wrappers)."""
    ours = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                 for m in (sys.modules[__package__], torch))
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(ours):
        frame, level = frame.f_back, level + 1
    return level
