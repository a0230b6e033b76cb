"""Structural gradients: the gradient of a loss as a tree that follows the model.

- :func:`structural_grad` differentiates a scalar loss with respect to the trainable parameters
  of a model (or a selector ``wrt`` given at the call) and returns a tree of gradients.
- :func:`value_and_grad` runs ``fn(model, *args)`` and returns its value with that tree.
- :func:`grad_tree` reads the ``.grad`` fields PyTorch accumulated, as a tree.

Rules shared by all three:

- A tied parameter (one object at several paths) has one leaf, at its first path in
  ``named_parameters()`` order, holding the total gradient over every use.
- Gradients come from ``torch.autograd.grad`` over the asked parameters the loss reaches: no
  ``.grad`` is read or written, and autograd runs only the part of the graph that leads to the
  asked parameters (the weight-gradient products of the others are never computed).
- Reentrant activation checkpointing (``use_reentrant=True``) hides the parameters inside it
  from ``torch.autograd.grad``; a loss whose graph holds such a checkpoint is differentiated by
  ``torch.autograd.backward``, exactly as ``.backward()`` would, with every ``.grad`` field and
  flag it could touch saved and restored (``create_graph=True`` is refused there).
- An asked parameter the loss does not reach gets ``torch.zeros_like(param)`` (unused by this
  forward) as long as the loss reaches another asked parameter: a tree always has one leaf per
  asked parameter. A loss that reaches none of them (another model, detached copies) is an
  error naming them, and so is an asked parameter used inside a reentrant checkpoint that
  records nothing (none of its inputs requires grad).
- Inside a ``stop_gradient`` or ``swap`` block, the asked set, the flags and the gradients are
  those of the parameters themselves (the block's stand-ins are not differentiated): a loss
  computed outside the block gets its usual gradients, and a callable loss, which runs under
  the block, reaches the blocked or swapped parameters only where they are used outside it.
- On a model wrapped by ``DistributedDataParallel`` (the wrapper or its module), the gradients
  are averaged over the ranks, as ``backward()`` leaves them (see :mod:`.distributed`).
- When ``loss`` is a callable and ``wrt`` is given, the forward runs with exactly the asked
  parameters requiring grad (every other parameter of the model has ``requires_grad=False``
  during the call). Afterwards, also when the call raises, each flag the call wrote is what it
  would be without the call: a change made inside the loss (a context entered or lifted, a
  schedule step, a flag written by hand) stands, as inside any torchstruct block. Declarations
  and contexts are not consulted for that call, and normalization statistics behave exactly as
  they would outside it, so the loss value is the same as ``loss(model)``. With
  ``create_graph=True`` the asked parameters are switched on and every other flag stays as it
  is, so the gradients are differentiable with respect to every parameter that requires grad
  (as ``torch.autograd.grad(loss(model), asked, create_graph=True)`` would be).
"""
from __future__ import annotations

import functools
import sys
import threading
import warnings
import weakref
from collections.abc import Callable

import torch
import torch.utils.checkpoint
import torch.utils.hooks
from torch import nn
from torch.nn.modules import module as _module_mod
from torch.overrides import TorchFunctionMode

from . import _dtensor, _ops, _state
from . import tree as _tree
from ._checks import check_bool, refuse_no_grad_dtype
from ._checkpoints import (around, before_apply, is_reentrant_checkpoint, modules_behind,
                           pinned, records_nothing)
from ._compile_caveats import flags_changed, only_inlined
from ._reference import _place
from .distributed import average_gradients, ddp_wrapper
from .contexts import warn_undone
from .declare import _effective_of, starting_flag, trainable_parameters
from .hooks import apply_pending
from .select import index, select

__all__ = ["structural_grad", "value_and_grad", "grad_tree"]

Pairs = list[tuple[str, nn.Parameter]]


def _asked(model: nn.Module, wrt) -> Pairs:
    """The parameters whose gradients are asked for: ``wrt``'s selection, or the trainable ones."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module as model, got {type(model).__name__}")
    if _dtensor.sharded_by_fsdp(model):
        raise RuntimeError(
            "structural_grad / value_and_grad: the model is sharded with FSDP2's fully_shard, "
            "which gathers parameters and reduce-scatters gradients in its own backward hooks; "
            "torch.autograd.grad bypasses them. Call loss.backward() and take the sharded "
            "gradients as a tree with ts.grad_tree(model)."
        )
    trainable = list(trainable_parameters(model))  # a read: attaches nothing
    if wrt is None:
        if not trainable:
            raise ValueError(
                f"structural_grad: no parameter of the model ({type(model).__name__}) is "
                "trainable now, and wrt=None asks for the trainable ones; an empty tree would "
                "hide the mistake. Name the parameters to differentiate with wrt= (frozen ones "
                "too), or make some trainable"
            )
        return trainable
    asked = select(model, wrt)
    if not asked:
        raise ValueError(
            f"structural_grad: wrt={wrt!r} selects no parameter of the model (a module without "
            "parameters, or a callable that is False everywhere); an empty tree would hide the "
            "mistake"
        )
    for path, p in asked:
        refuse_no_grad_dtype(path, p, "structural_grad cannot take its gradient (select "
                             "floating-point parameters only in wrt)")
    return asked


class _only:
    """Within the block, exactly the ``asked`` parameters of ``model`` require grad (with
    ``keep_others``: the asked ones are switched on and every other flag stays as it is; with
    ``watch`` as well, only the asked ones that are off now are written: a call without
    ``wrt``, whose asked parameters are the trainable ones).

    The flags written here are recorded as torchstruct's own (the starting flags stay), so
    trainability read inside the block (``ts.trainable_parameters`` in a loss term) is the
    model's true one, not this block's; an application inside the block (a context entered
    in the loss, a registration) keeps the block's flags (``_state.held_flags``). On exit,
    also when the block raises, each flag the block wrote becomes what it would be without
    the block, computed then: what torchstruct itself changed during the call (a context
    entered or lifted, a schedule step) stands, and so does a write by someone else (a copy
    put in place of a parameter, carrying the block's flag, gets the flag of the one it
    replaced); a block still running (an outer call, another thread's) keeps its flags. When
    parameters were added inside the block, a ``RestoredFlagsWarning`` names those the exit
    turned back on (a same-value write inside it cannot be told apart from the block's own).
    A block whose asked parameter a newer block of another thread held off while it ran
    raises: its forward may have missed that parameter.
    """

    def __init__(self, model: nn.Module, asked: Pairs, keep_others: bool = False,
                 watch: bool = False) -> None:
        self.model = model
        self.index = index(model)  # the model's parameters when the block is entered
        self.params = self.index.params
        self.paths = {id(p): path for path, p in asked}
        self.keep_others = keep_others or watch
        self.watch = watch
        self.thread = threading.get_ident()
        self.flags: dict = {}  # id -> (parameter, the flag held), while the block runs
        # id -> the flag the model decides without the block: as it was when the block was
        # entered, as an application inside it decides since (_state.decided_outside)
        self.outside: dict = {}
        self.overridden: str | None = None  # an asked path a newer thread's block held off
        self.undone: list[str] = []  # paths turned back on after the model grew (warned)

    def __enter__(self) -> None:
        with _state.LOCK:  # (stand-ins lifted)
            apply_pending(self.model)  # else the hook would apply during the call
            self.flags = {id(p): (p, id(p) in self.paths) for p in self.params
                          if id(p) in self.paths or not self.keep_others}
            if self.watch:
                self.flags = {i: hit for i, hit in self.flags.items() if not hit[0].requires_grad}
            for block in _state.held_flags:  # another thread's running block whose asked
                if block.thread != self.thread:  # parameter this one holds off (newest wins)
                    block.overridden = block.overridden or _held_off(self, block.paths)
            self.outside = {i: p.requires_grad for i, (p, _) in self.flags.items()}
            _state.held_flags.append(self)
            try:
                for p, flag in self.flags.values():
                    base, since, _ = starting_flag(p, "", {})
                    if p.requires_grad is not flag:
                        p.requires_grad_(flag)
                    _state.set_record(p, base, flag, since)
            except BaseException:  # e.g. an unmaterialized lazy parameter: nothing changed
                self._leave()
                raise
            if self.flags:
                flags_changed(self.model.modules())  # compiled code in the loss sees them

    def __exit__(self, exc_type, exc, tb) -> None:
        with _state.LOCK:  # (stand-ins lifted)
            self._leave()
        if self.overridden is not None and (exc_type is None or issubclass(exc_type, Exception)):
            raise RuntimeError(
                f"structural_grad: another structural_grad(wrt=...) call on this model, in "
                f"another thread, held {self.overridden!r} off while this call's loss ran, so "
                "the forward may have missed it and its gradient cannot be trusted; run such "
                "calls one after another (or each on its own copy of the model)"
            ) from exc
        if self.undone:
            warn_undone("ts.structural_grad(wrt=...)", self.undone, [], [])

    def _leave(self) -> None:
        """Every flag this block wrote back to what it is without the block (see above)."""
        if self in _state.held_flags:
            _state.held_flags.remove(self)
        if not self.flags:
            return
        governed = {i for st in _state.live_states() for i, rec in st.members.items()
                    if rec.p is not None}
        truth, error = {}, None
        if not governed.isdisjoint(self.flags):
            try:
                truth = _effective_of(self.model)[1]
            except BaseException as err:  # noqa: BLE001 - a declaration that became invalid
                # (or fails) in the loss: every flag written first, as a context's exit does
                error, truth = err, _effective_of(self.model, lenient=True)[1]
        decided, turned_on = {}, []
        for i, (p, mine) in self.flags.items():
            base, since, _ = starting_flag(p, "", {})
            held = _state.held_flag(p)
            flag = held if held is not None else truth.get(i, base) if i in governed else base
            if p.requires_grad is not flag:
                if flag and not mine:
                    turned_on.append(i)
                p.requires_grad_(flag)
            if i in governed or held is not None:
                _state.set_record(p, base, flag, since)
            else:
                _state.forget(p)
            decided[i] = flag
        before, now = self.index, index(self.model)
        at_path = {path: id(p) for p, ps in zip(before.params, before.paths) for path in ps}
        known = {id(p) for p in before.params}
        grew = False
        for p, ps in zip(now.params, now.paths):  # copies put in place of the block's ones
            if id(p) in known:
                continue
            grew = True
            old = next((at_path[path] for path in ps if path in at_path), None)
            if (old in decided and p.requires_grad is self.flags[old][1]
                    and p.requires_grad is not decided[old] and _state.held_flag(p) is None):
                p.requires_grad_(decided[old])
        if grew and turned_on:
            first = {id(p): ps[0] for p, ps in zip(before.params, before.paths)}
            self.undone = [first[i] for i in turned_on]
        self.flags, self.outside = {}, {}
        flags_changed(self.model.modules())
        if error is not None:
            raise error


def _held_off(block: _only, paths: dict) -> str | None:
    """The first of ``paths`` (id -> path) that ``block`` holds off, or None."""
    return next((path for i, path in paths.items()
                 if i in block.flags and not block.flags[i][1]), None)


def _check_loss(loss) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"structural_grad: loss must be a scalar tensor or a callable returning one, got "
            f"{type(loss).__name__}"
        )
    if loss.numel() != 1:
        raise ValueError(
            f"structural_grad: loss must be a scalar (one element), got shape {tuple(loss.shape)}"
        )
    return loss


def _check_frozen(loss: torch.Tensor, asked: Pairs) -> None:
    """A loss computed before the call has no graph to a parameter that does not require grad."""
    frozen = [path for path, p in asked if not p.requires_grad]
    if frozen:
        more = f" (nor to {len(frozen) - 1} more)" if len(frozen) > 1 else ""
        raise ValueError(
            f"structural_grad: parameter {frozen[0]!r} does not require grad, so the loss "
            f"(already computed) has no graph to it{more}; pass the loss as a callable "
            "`loss(model)` so that the forward runs with the wrt parameters requiring grad"
        )


def _check_requires_grad(loss: torch.Tensor, asked: Pairs) -> None:
    if not loss.requires_grad:
        raise ValueError(
            "structural_grad: the loss does not require grad (computed under torch.no_grad(), "
            "from frozen parameters only, or with the parameters blocked by ts.stop_gradient or "
            f"replaced by ts.swap; it reaches none of {_names(asked)})"
        )


def _names(asked: Pairs) -> str:
    """The first asked paths, for a message."""
    more = f" and {len(asked) - 3} more" if len(asked) > 3 else ""
    return ", ".join(repr(path) for path, _ in asked[:3]) + more


def structural_grad(
    model: nn.Module,
    loss,
    *,
    wrt=None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
) -> dict:
    """The gradient of a scalar loss as a tree following ``model``.

    Arguments:
        model: the module whose parameters are differentiated.
        loss: a scalar tensor already computed from ``model``, or a callable
            ``loss(model) -> scalar tensor`` (called once here). With a callable and ``wrt``
            given, the forward runs with exactly the ``wrt`` parameters requiring grad, so
            autograd neither records nor saves anything for the others (with
            ``create_graph=True``: the ``wrt`` parameters switched on, the others as they are,
            so that the gradients stay differentiable with respect to them).
        wrt: a selector (see :func:`torchstruct.select`) picking the parameters to
            differentiate, for this call only. ``None``: the effectively trainable parameters.
        retain_graph: keep the graph for another backward; defaults to ``create_graph``.
        create_graph: record the backward itself, making the gradients differentiable
            (gradient penalties, Hessian-vector products).

    Returns:
        A tree with one leaf per asked parameter (a tied parameter once, at its first path, with
        the total gradient over all its uses). A parameter the loss does not reach gets
        ``torch.zeros_like(param)`` when the loss reaches another asked parameter. Each leaf
        owns its memory, as ``.grad`` after ``backward()`` does (copied where autograd hands
        back one tensor for several parameters, or an expanded one), so the tree can be
        clipped and updated in place. No ``.grad`` field is left changed. Under DDP: the
        gradients averaged over the ranks.

    Raises:
        TypeError: ``model`` is not a module, or ``loss`` is neither tensor nor callable, or the
            callable does not return a tensor; ``create_graph`` not a bool, ``retain_graph``
            neither a bool nor None (checked before the loss callable runs).
        ValueError: the loss is not a scalar or does not require grad; an asked parameter does
            not require grad when ``loss`` is a tensor (it has no graph; the message names its
            path); a ``wrt`` parameter whose dtype cannot require grad (an integer one; its
            path named, before anything runs); a ``wrt`` selector matching nothing (closest
            paths named) or selecting no parameter (a module without parameters, a callable
            False everywhere); ``wrt=None`` on a model with no trainable parameter; the loss
            reaches
            none of the asked parameters (paths named); an asked parameter is used inside a
            reentrant checkpoint none of whose inputs requires grad; under DDP, a tensor loss
            outside ``ddp.no_sync()``, or ``create_graph=True``.
        RuntimeError: an asked parameter stopped requiring grad while the loss callable ran;
            ``create_graph=True`` through reentrant checkpointing, or a post-accumulate-grad
            hook that its exact path would run; under DDP, a communication hook or mixed
            precision, or an error on another rank.

    Example:
        >>> import torch, torch.nn as nn, torchstruct as ts
        >>> m = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
        >>> x = torch.randn(4, 3)
        >>> g = ts.structural_grad(m, lambda m: m(x).sum(), wrt="1")
        >>> ts.tree.paths(g)
        ['1.weight', '1.bias']
        >>> m[1].weight.grad is None
        True
    """
    check_bool(create_graph, "create_graph", "structural_grad")  # before the loss runs
    check_bool(retain_graph, "retain_graph", "structural_grad", none=True)

    def prepared() -> Pairs:
        with _state.without_stand_ins():
            asked = _asked(model, wrt)
        if not callable(loss):
            _check_loss(loss)  # a bad loss is a TypeError / ValueError everywhere, DDP or not
        return asked

    ddp = ddp_wrapper(model) if isinstance(model, nn.Module) else None
    if ddp is None:
        asked = prepared()
        grads = _local(model, loss, asked, wrt, retain_graph, create_graph)
        return _tree.from_flat_dict((path, g) for (path, _), g in zip(asked, grads))
    asked = []

    def local() -> tuple[list, list]:  # (under DDP every rank hears of an error here too:
        asked[:] = prepared()          # a wrt= that fails on one rank, a bad loss on one)
        return [p for _, p in asked], _local(model, loss, asked, wrt, retain_graph, create_graph)

    grads = average_gradients(ddp, local, tensor_loss=not callable(loss),
                              create_graph=create_graph)
    return _tree.from_flat_dict((path, g) for (path, _), g in zip(asked, grads))


def _local(model: nn.Module, loss, asked: Pairs, wrt, retain_graph, create_graph) -> list:
    """This process's gradients of ``loss`` w.r.t. ``asked``, in order."""
    if not callable(loss):
        with _state.without_stand_ins():
            _check_frozen(_check_loss(loss), asked)
            return _grads(model, loss, asked, retain_graph, create_graph)
    if wrt is None:  # the asked ones on (those a running call holds off), others kept
        with _only(model, asked, watch=True):
            value = _called(loss, model, asked)
            with _state.without_stand_ins():
                return _grads(model, value, asked, retain_graph, create_graph)
    # autograd.grad also needs the flags on; with create_graph the others keep theirs, so that
    # the gradients stay differentiable w.r.t. them (second-order terms through the forward)
    with _only(model, asked, keep_others=create_graph):
        value = _called(loss, model, asked)
        with _state.without_stand_ins():
            return _grads(model, value, asked, retain_graph, create_graph)


def _called(loss_fn: Callable, model: nn.Module, asked: Pairs) -> torch.Tensor:
    """``loss_fn(model)``, checked; an asked parameter switched off during the call, or used
    inside a reentrant checkpoint that records nothing, is an error."""
    with _DeadCheckpoints(model, asked) as watch:
        loss = _check_loss(loss_fn(model))
    if watch.blind and torch.is_grad_enabled():  # (under no_grad: the loss says so, below)
        raise ValueError(
            f"structural_grad: {watch.blind[0]!r} is used inside a reentrant activation "
            "checkpoint (use_reentrant=True) none of whose inputs requires grad, so autograd "
            "records nothing there and its gradient would be missing (.backward() misses it "
            "too). With wrt=, only the asked parameters require grad during the forward, so the "
            "layers before the checkpoint may no longer make its input require grad. Use "
            "use_reentrant=False, or make the checkpoint's input require grad (HF: "
            "model.enable_input_require_grads())"
        )
    with _state.without_stand_ins():
        off = [path for path, p in asked if not p.requires_grad]
    if off:
        raise RuntimeError(
            f"structural_grad: parameter {off[0]!r} stopped requiring grad during the loss call "
            "(a context, a declaration re-applied after a module was registered, or "
            "requires_grad_(False) inside the callable); its gradient cannot be taken"
        )
    return loss


def _grads(model: nn.Module, loss: torch.Tensor, asked: Pairs, retain_graph, create_graph) -> list:
    """The gradients of ``loss`` w.r.t. ``asked``, in order (zeros for an unused parameter).

    ``torch.autograd.grad`` over the asked parameters the graph reaches; through reentrant
    activation checkpointing (opaque to it), the exact path of :func:`_grads_by_backward`.
    """
    if not asked:
        return []
    _check_requires_grad(loss, asked)
    nodes, checkpoints = _walk(loss)
    if checkpoints:
        grads = _grads_by_backward(model, loss, asked, nodes, checkpoints, retain_graph,
                                   create_graph)
    else:
        leaves = {id(t) for t in _leaves(nodes)}
        if loss.grad_fn is None:  # the loss is a leaf itself (a scalar parameter)
            leaves.add(id(loss))
        reached = [i for i, (_, p) in enumerate(asked) if id(p) in leaves]
        if not reached:
            raise ValueError(_unreachable(asked))
        before = _grad_slots(model)
        found = torch.autograd.grad(
            loss,
            [asked[i][1] for i in reached],
            allow_unused=True,
            retain_graph=retain_graph,
            create_graph=create_graph,
        )
        _refuse_nested_backward(model, before)
        if all(g is None for g in found):
            # an edge is not a use: a compiled graph's backward node has an edge to every
            # parameter input requiring grad, also one it used only through .detach()
            raise ValueError(_unreachable(asked))
        grads = [None] * len(asked)
        for i, g in zip(reached, found):
            grads[i] = g
    return _owning([torch.zeros_like(p) if g is None else g for (_, p), g in zip(asked, grads)])


def _grad_slots(model: nn.Module) -> list:
    """``(path, parameter, its .grad, that tensor's version)`` of every parameter."""
    return [(path, p, p.grad, None if p.grad is None else p.grad._version)
            for path, p in model.named_parameters()]


def _refuse_nested_backward(model: nn.Module, before: list) -> None:
    """``torch.autograd.grad`` writes no ``.grad``; one written meanwhile was written by a
    backward a node ran inside it (a custom function recomputing its forward in backward and
    calling ``torch.autograd.backward``, as reentrant checkpoints and reversible layers do):
    the gradients it hands back miss what flowed that way. Put back what can be, and raise."""
    touched = [(path, p, g, v) for path, p, g, v in before
               if p.grad is not g or (g is not None and g._version != v)]
    if not touched:
        return
    lost = [path for path, p, g, v in touched if p.grad is g]  # accumulated in place
    for _, p, g, _ in touched:
        if p.grad is not g:
            p.grad = g
    names = ", ".join(repr(path) for path, *_ in touched[:5])
    raise RuntimeError(
        f"structural_grad: a backward run inside this one wrote the .grad of {names}: a custom "
        "autograd Function in the graph computes its gradients with its own "
        "torch.autograd.backward (a recomputation in backward: reversible layers, an "
        "activation checkpoint not built on torch.utils.checkpoint), which torch.autograd.grad "
        "cannot see through, so the gradients would be silently wrong (zeros there). Use "
        "loss.backward() and ts.grad_tree(model) for such a model"
        + (f". The .grad of {', '.join(map(repr, lost[:5]))} was accumulated in place and "
           "holds that backward's contribution now" if lost else
           "; every .grad was put back as it was"))


def _owning(grads: list) -> list:
    """``grads``, each leaf owning its memory as ``.grad`` does after ``backward()``: a leaf
    whose bytes overlap another's (autograd hands ``w = base + delta`` one tensor for both
    parameters) or whose elements share memory (the zero-stride gradient of a parameter summed
    as it is) is copied. Trees count a tensor held at several paths once, and clip and update
    their leaves in place: an alias would be counted once, or written twice."""
    out = list(grads)
    spans = []
    for i, g in enumerate(out):
        if g.layout != torch.strided:  # sparse: its own index and value tensors
            continue
        if g.numel() > 1 and not g.is_contiguous() and torch._debug_has_internal_overlap(g) != 0:
            out[i] = g.clone(memory_format=torch.preserve_format)
        elif g.numel() > 0:
            try:
                spans.append((_place(g), i))
            except (RuntimeError, NotImplementedError):  # no storage (a wrapper subclass)
                pass
    spans.sort(key=lambda hit: (str(hit[0][0]), hit[0][1]))
    memory, end = None, 0
    for (where, start, stop), i in spans:  # by memory, then start: one sweep
        if where == memory and start < end:
            out[i] = out[i].clone(memory_format=torch.preserve_format)
        else:
            memory, end = where, stop
    return out


def _leaves(nodes: set) -> list:
    """The tensors whose gradient accumulator nodes are among ``nodes`` (the leaves a graph
    reaches: the parameters its gradients flow to)."""
    return [n.variable for n in nodes if hasattr(n, "variable")]


def _walk(*tensors: torch.Tensor) -> tuple[set, list]:
    """Every backward node reachable from ``tensors``, and the reentrant checkpoints among
    them."""
    seen, checkpoints, stack = set(), [], [t.grad_fn for t in tensors]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if is_reentrant_checkpoint(node):
            checkpoints.append(node)
        stack.extend(f for f, _ in node.next_functions)
    return seen, checkpoints


def _unreachable(asked: Pairs) -> str:
    return (
        f"structural_grad: the loss reaches none of the asked parameters ({_names(asked)}): it was "
        "computed from another model, from copies of the parameters (.detach(), .data, "
        "ts.stop_gradient, ts.swap, torch.func.functional_call with other tensors), or by a forward "
        "that does not use them. A zero gradient here would hide the mistake; compute the loss "
        "from this model, or ask (wrt=) for parameters it uses"
    )


def _grads_by_backward(model, loss, asked: Pairs, nodes: set, checkpoints: list, retain_graph,
                       create_graph) -> list:
    """The asked gradients by ``torch.autograd.backward(loss)``, exactly as ``.backward()``.

    A reentrant checkpoint's backward refuses ``torch.autograd.grad`` and a ``backward`` with
    ``inputs``, and accumulates into ``.grad`` from an inner backward. So: exactly the asked
    parameters of the model require grad (the recomputation records nothing for the others),
    and :class:`_Exact` keeps the backward from touching any other leaf; afterwards every
    ``.grad`` and flag is put back.
    """
    if create_graph:
        raise RuntimeError(
            "structural_grad: create_graph=True through reentrant activation checkpointing "
            "(torch.utils.checkpoint with use_reentrant=True): its backward runs an inner "
            "backward that records no graph, so the gradients would silently not be "
            "differentiable through the checkpointed part. Use use_reentrant=False (HF: "
            "gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': "
            "False}))"
        )
    ddp = ddp_wrapper(model)
    if ddp is not None and ddp.static_graph:
        raise RuntimeError(
            "structural_grad: reentrant activation checkpointing on a DistributedDataParallel "
            "model built with static_graph=True: the exact path runs a backward whose hooks "
            "the reducer would count as a training step. Use use_reentrant=False"
        )
    if not _ops.compiled_available():
        warnings.warn(
            "structural_grad: without the compiled extension (torchstruct._C) the hooks on "
            "gradient accumulator nodes, and those on branches of the graph leading to no asked "
            "parameter, cannot be read, and the real backward that reentrant activation "
            "checkpointing needs runs any there are. Use use_reentrant=False, or install "
            "torchstruct with its extension",
            RuntimeWarning, stacklevel=4,
        )
    exact = _Exact(model, asked, ddp)
    exact.check(_leaves(nodes) + [p for _, p in asked], ())
    exact.check_branches([loss], ())
    bound = [p for node in checkpoints
             for m in modules_behind(getattr(node, "run_function", None)) for p in m.parameters()]
    with _only(model, asked):
        try:
            exact.take(nodes, checkpoints, (), bound)
            for _, p in asked:
                p.grad = None
            torch.autograd.backward(loss, retain_graph=retain_graph)
            grads = [p.grad for _, p in asked]
        finally:
            exact.restore()
    if all(g is None for g in grads):
        raise ValueError(_unreachable(asked))
    return grads


class _Exact:
    """What the exact path's real backward may touch: the asked parameters, whose ``.grad``
    starts empty, and nothing else.

    :meth:`take` is given a graph: every leaf it reaches that requires grad and is not asked
    stops requiring grad (the backward then accumulates nothing into it), except a leaf that
    feeds a reentrant checkpoint directly (an input made to require grad, HF's
    ``enable_input_require_grads``): the checkpoint's recomputation takes its inputs' flags,
    so it stays on and gets its ``.grad`` back afterwards. Each reentrant checkpoint's
    function is wrapped so that its graph, recomputed in backward (out of sight until then:
    a tensor its function closes over, another model's parameter, a nested checkpoint), is
    taken the same way before its inner backward runs; the function's own inputs (the
    detached copies whose ``.grad`` the checkpoint hands back) are left alone; a checkpoint
    nested in it gets back the flags of its switched-off leaf inputs (:meth:`_revive`), or is
    refused where it records nothing. :meth:`restore` puts back flags, ``.grad`` fields and
    functions.

    A hook the backward would run and ``autograd.grad`` would not is an error: on a leaf
    (:meth:`check`), or on a non-leaf tensor or node off the asked paths
    (:meth:`check_branches`), ``retain_grad()`` included.
    """

    def __init__(self, model: nn.Module, asked: Pairs, ddp) -> None:
        self.model, self.pairs = model, asked
        self.asked = {id(p) for _, p in asked}
        self.owners = _owners(model, {id(p): path for path, p in asked})  # for the watches
        every = index(model)
        self.paths = {id(p): path for path, p in every}
        # the ids of the leaves that required grad when the forward ran and are switched off
        # here (by the caller's _only, made after this, and by take): one that feeds a
        # checkpoint directly requires grad again (_feeding)
        self.revivable = {id(p) for p in every.params
                          if p.requires_grad and id(p) not in self.asked}
        self.synced = {id(p) for p in ddp.module.parameters()} if ddp is not None else set()
        self.lock = threading.Lock()  # a backward may recompute on several device threads
        self.saved = [(p, p.grad) for _, p in asked]  # (tensor, .grad to put back)
        self.held = set(self.asked)  # the ids of the tensors in saved
        self.flags: dict = {}  # id -> (leaf, its flag before this wrote it)
        # id -> weak reference: the recomputed functions' own inputs (the detached copies whose
        # .grad each checkpoint hands back once its inner backward is done): left alone, also
        # by a checkpoint nested in the function that reads one (weak: temporaries)
        self.inputs: dict = {}
        # (weak reference to a checkpoint node, its function) wrapped: weak, as a node of a
        # recomputed graph holds that graph's inputs (through its edges) and dies with it
        self.functions: list = []

    def check(self, leaves: list, keep) -> None:
        """Refuse the hooks on ``leaves`` a real backward would run: a post-accumulate-grad
        hook, a hook on the gradient accumulator node (the engine calls those even for a leaf
        switched off; except the C++ hooks of DDP's reducer on the parameters it synchronizes,
        which do nothing under the ``no_sync`` the DDP path runs in), a tensor hook on a leaf
        not asked (``autograd.grad`` calls those of the asked ones too)."""
        for t in leaves:
            if id(t) in keep:
                continue
            where = repr(self.paths[id(t)]) if id(t) in self.paths else "a tensor outside the model"
            if getattr(t, "_post_accumulate_grad_hooks", None):
                what = "a post-accumulate-grad hook (an optimizer step in backward?)"
            elif _accumulator_hooked(t, id(t) in self.synced):
                what = ("a hook on its gradient accumulator node (grad_fn.next_functions[0][0]"
                        ".register_hook / register_prehook, as FSDP and ZeRO-style gradient "
                        "reducers install)")
            elif t._backward_hooks and id(t) not in self.asked:
                what = "a gradient hook"
            else:
                continue
            which = ("" if id(t) in self.paths else
                     f" (that tensor: shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device})")
            raise RuntimeError(
                f"structural_grad: {where} has {what}{which}, and reentrant activation "
                "checkpointing needs a real backward to get the gradients, which would run it. "
                "Use use_reentrant=False, or remove the hook for this call"
            )

    def check_branches(self, roots, inputs) -> None:
        """Refuse a hook, or a ``retain_grad()``, on a non-leaf tensor (or its node) that the
        backward from ``roots`` would run and ``autograd.grad`` would not: on a branch that
        leads to no asked parameter, nor to a reentrant checkpoint, nor to one of ``inputs``
        (the recomputed functions', whose gradients their checkpoints hand back)."""
        targets = [p for _, p in self.pairs] + [a for a in inputs if isinstance(a, torch.Tensor)]
        hooked = [(name, kind) for name, kind, hooks in _ops.off_path_hooks(
            [r for r in roots if isinstance(r, torch.Tensor)], targets) or ()
            if kind == "retain_grad" or not all(_idle(h) for h in hooks)]
        if not hooked:
            return
        name, kind = hooked[0]
        what = ("retain_grad() (the backward would write its .grad)" if kind == "retain_grad"
                else "a gradient hook (Tensor.register_hook, a hook on its grad_fn, or a module's "
                "full backward hook)")
        raise RuntimeError(
            f"structural_grad: a tensor computed by {name} has {what}, on a branch of the graph "
            "that leads to no asked parameter; reentrant activation checkpointing needs a real "
            "backward to get the gradients, which would run it where torch.autograd.grad does "
            "not. Use use_reentrant=False, ask (wrt=) for the parameters behind it, or remove it "
            "for this call"
        )

    def take(self, nodes: set, checkpoints: list, keep, extra=()) -> None:
        """The graph of ``nodes`` (its reentrant ``checkpoints`` among them), ``keep`` the ids
        of the leaves left alone, ``extra`` more leaves to switch off."""
        fed = {id(fn.variable): fn.variable for node in checkpoints
               for fn, _ in node.next_functions if hasattr(fn, "variable")}
        with self.lock:
            for t in _leaves(nodes) + list(extra):
                i = id(t)
                if i not in self.asked and i not in keep and i not in fed and t.requires_grad:
                    self._set(t, False)
                    self.revivable.add(i)
            self._feeding(fed.values(), keep)
            for node in checkpoints:
                fn = getattr(node, "run_function", None)
                if fn is not None:
                    self.functions.append((weakref.ref(node), fn))
                    node.run_function = functools.partial(self._recompute, fn)

    def _set(self, t: torch.Tensor, flag: bool) -> None:
        """Under the lock: ``t.requires_grad_(flag)``, its flag before the first write kept."""
        self.flags.setdefault(id(t), (t, t.requires_grad))
        t.requires_grad_(flag)

    def _feeding(self, leaves, keep=()) -> None:
        """Under the lock: ``leaves`` feed a reentrant checkpoint directly. Each that required
        grad when the forward ran requires grad now (or again), its ``.grad`` saved and emptied
        once (fed again by a later recomputation, it already holds a gradient): the
        checkpoint's recomputation takes its inputs' flags, and a checkpoint nested there
        would otherwise record less than in the forward, or nothing."""
        for t in leaves:
            i = id(t)
            if (i in self.asked or i in keep or t.grad_fn is not None
                    or not (t.requires_grad or i in self.revivable)):
                continue
            if not t.requires_grad:
                self._set(t, True)
            if i not in self.held:
                self.held.add(i)
                self.saved.append((t, t.grad))
                t.grad = None

    def _revive(self, args) -> None:
        """A checkpoint is applied to ``args`` inside a recomputed function (before autograd
        decides from their flags whether it records): those switched off here, back on. (One
        requiring grad is held by :meth:`take` once the function returns, unless it is the
        function's own input, a temporary whose ``.grad`` the outer checkpoint reads.)"""
        with self.lock:
            self._feeding(a for a in args if isinstance(a, torch.Tensor) and not a.requires_grad)

    def _enclosing(self) -> dict:
        """Under the lock: id -> tensor, the recomputed functions' inputs alive now (this
        one's, and those of the checkpoints around it whose backward runs)."""
        live = {}
        for i, ref in list(self.inputs.items()):
            t = ref()
            if t is None:
                del self.inputs[i]
            else:
                live[i] = t
        return live

    def _recompute(self, fn, *args):
        """A checkpoint's function, recomputed in its backward: a checkpoint nested in it that
        records nothing where it uses an asked parameter, or an enclosing checkpoint's input,
        is an error (:class:`_DeadCheckpoints`, after :meth:`_revive`), and its graph is taken
        before the inner backward runs."""
        with self.lock:  # switched off here: stays off (not the flag the forward ran with);
            # an asked one gets the forward's, as the rest of the graph has it
            decided = (set(self.paths) - self.asked) | set(self.flags)
            self.inputs.update((id(a), weakref.ref(a)) for a in args if isinstance(a, torch.Tensor))
            live = self._enclosing()
        with pinned(decided), _DeadCheckpoints(self.model, self.pairs, revive=self._revive,
                                                inputs=live, owners=self.owners) as watch:
            out = fn(*args)
        if watch.blind:
            raise ValueError(
                f"structural_grad: {watch.blind[0]!r} is used inside a reentrant activation "
                "checkpoint (use_reentrant=True) nested in another one, none of whose inputs "
                "requires grad when the outer one recomputes it in backward, so autograd records "
                "nothing there and its gradient would be missing (.backward() misses it too, "
                "unless an input is computed inside the outer function from a tensor this call "
                "switched off to take only the asked gradients: a parameter not asked, or a "
                "tensor outside the model). Use use_reentrant=False, or give the nested "
                "checkpoint an input that requires grad"
            )
        if watch.lost:
            raise ValueError(
                "structural_grad: a reentrant activation checkpoint (use_reentrant=True) nested "
                "in another one, none of whose inputs requires grad when the outer one "
                "recomputes it in backward, reads the outer one's input (a closure, a keyword "
                "bound in a partial): autograd records nothing there, so the gradient flowing "
                "back through that input, to the parameters before the outer checkpoint, would "
                "miss that use. Use use_reentrant=False, or pass that tensor to the nested "
                "checkpoint as an argument"
            )
        outs = out if isinstance(out, (tuple, list)) else (out,)
        nodes, inner = _walk(*(o for o in outs if isinstance(o, torch.Tensor)))
        keep = set(live)
        self.check(_leaves(nodes), keep | self.asked)
        self.check_branches(outs, list(live.values()))
        self.take(nodes, inner, keep)
        return out

    def restore(self) -> None:
        with self.lock:
            for ref, fn in reversed(self.functions):
                if (node := ref()) is not None:
                    node.run_function = fn
            for t, flag in self.flags.values():
                t.requires_grad_(flag)
            for t, g in self.saved:
                t.grad = g


def _idle(hook) -> bool:
    """``hook`` is the one torch registers on the input side of a module with backward hooks
    (to call its full backward hooks once the inputs' gradients are known), and the module had
    none when its forward ran (a ``register_full_backward_pre_hook`` alone): it changes
    nothing, so a backward that runs it and ``autograd.grad`` that does not agree."""
    if getattr(hook, "__qualname__", "") != "BackwardHook._set_user_hook.<locals>.hook":
        return False
    cells = dict(zip(hook.__code__.co_freevars, hook.__closure__ or ()))
    try:
        owner = cells["self"].cell_contents
    except (KeyError, ValueError):
        return False
    return isinstance(owner, torch.utils.hooks.BackwardHook) and not owner.user_hooks


def _accumulator_hooked(t: torch.Tensor, synced: bool) -> bool:
    """``t``'s gradient accumulator node has a hook: one registered from Python, or, unless
    DDP's reducer synchronizes ``t`` (its hooks are C++), any."""
    python, other = _ops.accumulator_hooks(t) or (0, 0)
    return bool(python or (other and not synced))


class _DeadCheckpoints:
    """Watches a forward for asked parameters used inside a reentrant checkpoint that got no
    input requiring grad (it runs its function under ``no_grad`` and records nothing, so their
    gradient is lost without a trace in the graph).

    Two ways in, both present only while some watch is on:

    - a global forward pre-hook (:func:`_watch`) looks at the modules that own an asked
      parameter when they run with grad disabled, and finds the checkpoint's ``forward`` among
      the calling frames of this thread (a module whose own kernels read its parameters);
    - ``torch.utils.checkpoint``'s reentrant forward is wrapped (:func:`_checkpoint_forward`):
      one that gets no input requiring grad runs its function under :class:`_Uses`, which
      notes every asked parameter an operation takes (a parameter used functionally,
      ``F.linear(u, self.lin.weight)``, whose module's forward never runs).

    Only the watches of the thread running the checkpoint look. The exact path watches each
    recomputation too (a checkpoint nested in the function runs its forward there): with
    ``revive``, called with a checkpoint's inputs as it is applied (:func:`_checkpoint_apply`),
    and ``inputs``, the recomputed functions' own, whose use inside a checkpoint that records
    nothing sets ``lost``.
    """

    def __init__(self, model: nn.Module, asked: Pairs, revive=None, inputs=None,
                 owners=None) -> None:
        paths = {id(p): path for path, p in asked}
        self.revive = revive  # given a checkpoint's inputs before it is judged (or None)
        # id -> tensor: the inputs of the checkpoints being recomputed (in the exact path's
        # backward); one used inside a checkpoint that records nothing sets lost
        self.inputs = inputs or {}
        self.lost = False
        self.paths = paths
        self.thread = threading.get_ident()
        self.walked: set = set()  # graph nodes already searched for asked parameters
        # id(module) -> the asked paths of its own parameters (given: computed once per call)
        self.owners: dict[int, list[str]] = owners if owners is not None else _owners(model, paths)
        self.blind: list[str] = []

    def __enter__(self) -> "_DeadCheckpoints":
        with _WATCH_LOCK:
            _WATCHES.append(self)
            if len(_WATCHES) == 1:
                _watch_on()
            if self.revive is not None:
                before_apply(_checkpoint_apply)
        return self

    def __exit__(self, *exc) -> None:
        with _WATCH_LOCK:
            _WATCHES[:] = [w for w in _WATCHES if w is not self]
            if not _WATCHES:
                _module_mod._global_forward_pre_hooks.pop(_WATCH_KEY[0], None)
                around("dead", None)
            if not any(w.revive is not None for w in _WATCHES):
                before_apply(None)

    def seen(self, module: nn.Module) -> None:
        own = self.owners.get(id(module))
        if own and _in_dead_checkpoint(sys._getframe(2)):
            self.note(own)

    def used(self, args) -> None:
        """An operation inside a dead checkpoint took ``args``: note the asked parameters among
        them, and those behind a tensor computed from them outside (``w = lin.weight * 2``)."""
        own = []
        for t in _tensors_in(args):
            if id(t) in self.paths:
                own.append(self.paths[id(t)])
            elif self.inputs.get(id(t)) is t:
                self.lost = True
            elif t.grad_fn is not None:
                own.extend(self._behind(t.grad_fn))
        if own:
            self.note(own)

    def _behind(self, node) -> list[str]:
        """The asked parameters the graph from ``node`` reaches (a node is walked once per
        watch)."""
        found, stack = [], [node]
        while stack:
            n = stack.pop()
            if n is None or n in self.walked:
                continue
            self.walked.add(n)
            leaf = getattr(n, "variable", None)
            if leaf is not None and id(leaf) in self.paths:
                found.append(self.paths[id(leaf)])
            elif leaf is not None and self.inputs.get(id(leaf)) is leaf:
                self.lost = True
            stack.extend(f for f, _ in n.next_functions)
        return found

    def note(self, paths: list[str]) -> None:
        self.blind.extend(p for p in paths if p not in self.blind)


def _owners(model: nn.Module, paths: dict) -> dict[int, list[str]]:
    """id(module) -> the paths (``paths``: id -> path) of the module's own parameters among
    them, for every module of ``model`` that has one."""
    owners = {}
    for m in model.modules():
        own = [paths[id(p)] for p in m._parameters.values() if p is not None and id(p) in paths]
        if own:
            owners[id(m)] = own
    return owners


def _mine() -> list:
    """The watches of this thread."""
    me = threading.get_ident()
    return [w for w in list(_WATCHES) if w.thread == me]


def _tensors_in(args, depth: int = 3):
    """The tensors among an operation's arguments (inside lists, tuples and dicts too)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif depth and isinstance(a, (list, tuple)):
            yield from _tensors_in(a, depth - 1)
        elif depth and isinstance(a, dict):
            yield from _tensors_in(a.values(), depth - 1)


class _Uses(TorchFunctionMode):
    """Passes every operation through, and shows the arguments of those that compute a tensor
    to ``watches`` (reading a dtype, a shape or a size uses no value: not shown)."""

    def __init__(self, watches: list) -> None:
        super().__init__()
        self.watches = watches

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if next(_tensors_in((out,)), None) is not None:
            for w in self.watches:
                w.used((args, kwargs))
        return out

    __torch_function__ = only_inlined(__torch_function__)


_NESTED = threading.local()  # depth of reentrant checkpoint forwards running in this thread


def _checkpoint_apply(args) -> None:
    """A reentrant checkpoint is applied to ``args``: the watches of this thread that revive
    see them first (not for a checkpoint inside another one's forward: see below)."""
    if not getattr(_NESTED, "depth", 0):
        for w in _mine():
            if w.revive is not None:
                w.revive(args)


def _checkpoint_forward(forward, ctx, run_function, preserve_rng_state, *args):
    """``CheckpointFunction.forward`` while a watch is on: a checkpoint none of whose tensor
    inputs requires grad, in a thread with a watch, runs under :class:`_Uses`. A checkpoint
    inside another one's forward is judged by the outermost (its first run is discarded; a
    dead outer one is watched, and a live one's recomputation runs it again, where the exact
    path judges it: :meth:`_Exact._recompute`)."""
    depth = getattr(_NESTED, "depth", 0)
    watches = _mine() if not depth else []
    dead = watches and records_nothing(args)
    _NESTED.depth = depth + 1
    try:
        if not dead:
            return forward(ctx, run_function, preserve_rng_state, *args)
        with _Uses(watches):
            return forward(ctx, run_function, preserve_rng_state, *args)
    finally:
        _NESTED.depth = depth


# The watches on now (all threads), and the key of their global hook. The hook goes in under
# one key with one function every time: compiled code guards on the global hooks, and a new
# key per call would compile a model called inside a loss callable again at every call.
_WATCH_LOCK = threading.Lock()
_WATCHES: list = []
_WATCH_KEY: list = []


def _watch(module: nn.Module, _args) -> None:
    if torch.is_grad_enabled():
        return
    for w in _mine():
        w.seen(module)


def _watch_on() -> None:
    if not _WATCH_KEY:
        _WATCH_KEY.append(_module_mod.register_module_forward_pre_hook(_watch).id)
    else:
        _module_mod._global_forward_pre_hooks[_WATCH_KEY[0]] = _watch
    around("dead", _checkpoint_forward)


def _in_dead_checkpoint(frame) -> bool:
    """Whether ``frame`` runs inside a reentrant checkpoint's forward none of whose tensor
    inputs requires grad (the outermost such forward decides: see :func:`_checkpoint_forward`)."""
    dead = False
    while frame is not None:
        if frame.f_code.co_name == "forward":
            ctx = frame.f_locals.get("ctx")
            if ctx is not None and is_reentrant_checkpoint(ctx):
                args = frame.f_locals.get("args", ())
                dead = records_nothing(args)
        frame = frame.f_back
    return dead


def _split_aux(out, has_aux: bool):
    if not has_aux:
        return out, None
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(
            "value_and_grad: with has_aux=True, fn must return a pair (value, aux), got "
            f"{type(out).__name__}"
        )
    return out


def value_and_grad(fn: Callable, model: nn.Module, *args, has_aux: bool = False, wrt=None):
    """Evaluate ``fn(model, *args)`` and its structural gradient in one forward.

    Arguments:
        fn: ``fn(model, *args) -> scalar tensor``, or ``-> (scalar tensor, aux)`` with
            ``has_aux=True``.
        model: the module differentiated.
        *args: passed to ``fn`` after ``model``.
        has_aux: ``fn`` returns ``(value, aux)``; ``aux`` is returned untouched.
        wrt: as in :func:`structural_grad` (the forward runs with exactly these parameters
            requiring grad).

    Returns:
        ``(value, grads)`` or ``((value, aux), grads)``: ``value`` is detached from the graph,
        ``grads`` is the tree :func:`structural_grad` returns.

    Raises:
        TypeError: ``fn`` is not callable, or with ``has_aux`` does not return a pair.
        ValueError: as :func:`structural_grad`.

    Example:
        >>> import torch, torch.nn as nn, torchstruct as ts
        >>> m = nn.Linear(2, 1)
        >>> (v, n), g = ts.value_and_grad(lambda m, x: (m(x).sum(), len(x)), m, torch.ones(3, 2),
        ...                               has_aux=True)
        >>> n, sorted(g)
        (3, ['bias', 'weight'])
        >>> float(g["bias"])
        3.0
    """
    if not callable(fn):
        raise TypeError(f"value_and_grad: fn must be callable, got {type(fn).__name__}")
    check_bool(has_aux, "has_aux", "value_and_grad")
    seen: list = []

    def loss(m: nn.Module) -> torch.Tensor:
        value, aux = _split_aux(fn(m, *args), has_aux)
        seen.append((value, aux))
        return value

    grads = structural_grad(model, loss, wrt=wrt)
    value, aux = seen[0]
    value = value.detach()
    return ((value, aux) if has_aux else value), grads


def grad_tree(model: nn.Module) -> dict:
    """The current ``.grad`` fields of the trainable parameters of ``model``, as a tree.

    Arguments:
        model: the module.

    Returns:
        A tree of the ``.grad`` tensors themselves (not copies), tied parameters once at their
        first path; parameters whose ``.grad`` is ``None`` are absent. Inside a
        ``stop_gradient`` block the blocked parameters are included as outside it.

    Raises:
        TypeError: ``model`` is not a module.

    Example:
        >>> import torch, torch.nn as nn, torchstruct as ts
        >>> m = nn.Linear(2, 1)
        >>> m(torch.ones(1, 2)).sum().backward()
        >>> g = ts.grad_tree(m)
        >>> g["bias"] is m.bias.grad
        True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"grad_tree: expected an nn.Module, got {type(model).__name__}")
    # which parameters train is read from the parameters themselves, also inside a
    # stop_gradient / swap block (whose mode makes requires_grad read the stand-in's flag)
    with _state.without_stand_ins():
        pairs = list(trainable_parameters(model))
    return _tree.from_flat_dict((path, p.grad) for path, p in pairs)
