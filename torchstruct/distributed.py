"""torchstruct and ``torch.distributed``.

**DistributedDataParallel.** DDP decides, when it is built, which parameters it synchronizes:
those that require grad. Changing what trains afterwards goes wrong silently (a parameter that
starts training gets gradients that differ between ranks) or fails later with DDP's generic
"Expected to have finished reduction" error (a parameter that stops training while
``find_unused_parameters=False``). torchstruct therefore refuses such a change at once, with an
error that says what to do, and changes no flag:

- a parameter that DDP does not synchronize would start training: always refused (re-wrap);
- a synchronized parameter would stop training: refused unless the wrapper was built with
  ``find_unused_parameters=True`` (and without ``static_graph=True``, which fixes the used
  set after the first step), which copes with it, as long as every rank makes the same
  change: each reducing backward of such a wrapper ends with a check that the ranks train the
  same synchronized parameters, an error on every rank when they do not.

Leaving a context always restores the flags; when that changes what a live wrapper
synchronizes (the model was wrapped inside the context), a ``RuntimeWarning`` says so.

Declarations and contexts applied *before* wrapping, contexts that leave the synchronized set as
it is, and the block-local ``stop_gradient``/``constant``/``swap`` (they change no flag) are
fine. A synchronized parameter that ``stop_gradient`` or ``swap`` keeps out of every use in a
forward is, to DDP, an unused parameter: that needs ``find_unused_parameters=True``, as in plain
PyTorch. Without it DDP would leave that step's gradients unreduced and fail only at the next
step, so such a forward is refused at once, naming the parameters (a walk of the autograd graph
from the outputs, made only when a block was active during the forward).
``global_norm`` and ``clip_by_global_norm`` on a DDP model read the gradients after DDP
averaged them, so they give the global answer on every rank.

``structural_grad`` / ``value_and_grad`` on a DDP model (the wrapper, or its module) give the
averaged gradient too: the loss callable runs under ``ddp.no_sync()`` (so DDP's reducer expects
no backward), this rank's gradients come from ``torch.autograd.grad``, and one all-reduce per
device and dtype averages them as DDP's reducer does (divided by the world size, then summed).
What a plain average cannot reproduce (a communication hook, mixed precision) is refused, and
an error on one rank is an error on every rank, never a hang.

**FSDP2** (``fully_shard``) needs no guard: it copies the sharded parameters' flags to the
gathered ones at every forward, so what trains may change between steps. Its DTensor
parameters and gradients are handled where the ops meet the kernels (``torchstruct._dtensor``).
"""
from __future__ import annotations

import contextlib
import warnings
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules import module as _module_mod
from torch.nn.parallel import DistributedDataParallel
from torch.nn.parallel.distributed import _find_tensors

from . import _state
from ._checkpoints import is_reentrant_checkpoint, modules_behind
from ._state import _snapshot, flag_guards

__all__: list[str] = []

# id of a parameter -> (weakref to its DDP wrapper, whether DDP synchronizes it, the
# parameter). The parameter is held as long as its wrapper lives (the wrapper holds it too),
# never by a weak reference (torch.utils.swap_tensors refuses a tensor that has one); the
# wrapper's entries go when it is collected.
_wrapped: dict[int, tuple[weakref.ref, bool, object]] = {}
# weakref to a DDP wrapper -> its check that the ranks train the same parameters
_agreements: dict[weakref.ref, "_Agreement"] = {}


def _forget_wrapper(ref: weakref.ref) -> None:
    """A DDP wrapper was collected: forget its parameters (runs as a weakref callback)."""
    agreement = _agreements.pop(ref, None)
    if agreement is not None:
        agreement.release()
    for key, hit in _snapshot(_wrapped):
        if hit[0] is ref:
            _wrapped.pop(key, None)


def _on_module_registered(module: nn.Module, name: str, inner) -> None:
    """Record, as DDP is built, which parameters of its module it will synchronize."""
    if isinstance(module, DistributedDataParallel) and name == "module":
        ref = weakref.ref(module, _forget_wrapper)
        # DDP leaves their flags free
        ignored = _ignored(inner, getattr(module, "parameters_to_ignore", ()))
        synchronized = []
        for path, p in inner.named_parameters():
            if id(p) in ignored:
                continue
            _wrapped[id(p)] = (ref, p.requires_grad, p)
            if p.requires_grad:
                synchronized.append((path, p))
        _agreements[ref] = _Agreement(ref, synchronized)
        module.register_forward_pre_hook(_before_forward)
        module.register_forward_hook(_after_forward, always_call=True)


def _waits_for_every_gradient(ddp: DistributedDataParallel) -> bool:
    """Whether this forward prepares a reduction that waits for the gradient of every
    synchronized parameter (a parameter no use reaches leaves its bucket unreduced)."""
    return (torch.is_grad_enabled() and ddp.require_backward_grad_sync
            and not ddp.find_unused_parameters and not getattr(ddp, "static_graph", False)
            and not getattr(ddp, "_delay_all_reduce_all_params", False)
            and not torch.compiler.is_compiling())


def _before_forward(ddp: DistributedDataParallel, _args) -> None:
    if _waits_for_every_gradient(ddp):
        ddp.__dict__["_torchstruct_blocks"] = _state.stand_ins_seen()


def _after_forward(ddp: DistributedDataParallel, _args, out) -> None:
    """Refuse a forward in which a block (``stop_gradient``, ``swap``) took a synchronized
    parameter out of every use, while the wrapper waits for every gradient: DDP would reduce
    none of that bucket, leave this step's gradients local, and fail only at the next step.
    Where a synchronized parameter may stop training, its backward checks that the ranks agree
    on what trains."""
    agreement = _agreements.get(weakref.ref(ddp))
    if agreement is not None:
        agreement.arm(out is not None and _lets_training_stop(ddp))
    before = ddp.__dict__.pop("_torchstruct_blocks", None)
    if before is None or out is None:
        return
    after = _state.stand_ins_seen()
    if not (before[0] or after[0] or before[1] != after[1]):
        return  # no block could replace anything during this forward
    with _state.without_stand_ins():  # the parameters' own flags
        missing = _unreached(ddp, out)
    if missing:
        raise RuntimeError(
            f"No use in this forward of the DistributedDataParallel model reaches "
            f"{', '.join(repr(p) for p in missing)} (a stop_gradient or swap block replaced "
            "it in every use): the wrapper was built with find_unused_parameters=False and "
            "would wait for its gradient, leave this step's gradients unreduced and fail at "
            "the next step. Build the wrapper with find_unused_parameters=True, or keep a use "
            "of the parameter outside the block."
        )


def _lets_training_stop(ddp: DistributedDataParallel) -> bool:
    """Whether this forward prepares a reduction in which a synchronized parameter may have
    stopped training (the guard allows it only with ``find_unused_parameters=True``). The
    answer is the same on every rank: it depends only on how the wrapper was built and on
    what DDP itself needs alike on every rank (a backward after a forward with grad enabled,
    outside ``no_sync()``). Inside ``Join`` (uneven inputs) no check is made: a rank that has
    run out of data shadows DDP's own collectives only, and would leave the others waiting."""
    join = getattr(ddp, "_join_config", None)
    return (ddp.find_unused_parameters and torch.is_grad_enabled()
            and ddp.require_backward_grad_sync and not getattr(ddp, "static_graph", False)
            and not torch.compiler.is_compiling() and not getattr(join, "enable", False))


class _Agreement:
    """One DDP wrapper's check, at the end of each backward that DDP reduces, that every rank
    trains the same synchronized parameters.

    A parameter frozen on some ranks only is, to DDP with ``find_unused_parameters=True``, a
    parameter those ranks did not use: its averaged gradient reaches every rank, but an
    optimizer that skips frozen parameters (``ts.optim``) moves it on the other ranks only, and
    the ranks' weights drift apart without an error. The check is one all-reduce of a flag per
    synchronized parameter, made by every rank in the backward DDP reduces in, so a
    disagreement is an error on every rank, never a hang.

    What starts the check is what starts DDP's own reduction: a forward that prepares one
    (:meth:`arm`), then the first gradient accumulated into a synchronized parameter in a
    backward (DDP's hooks sit on the same accumulation). A backward that accumulates nothing
    there (``torch.autograd.grad`` with respect to an input) reduces nothing and checks
    nothing; one that does, through the forward's output or not (a zero loss over the
    parameters on a rank without data), checks once, after DDP's reducer has finished.

    Holds the ``(path, parameter)`` pairs the wrapper synchronizes, in its module's order when
    it was built (the same on every rank, whatever a rank's tree became since), and one hook
    on each that has required grad at a reducing forward, until the wrapper is collected."""

    __slots__ = ("pairs", "handles", "armed", "hook")

    def __init__(self, ref: weakref.ref, pairs: list) -> None:
        self.pairs, self.handles, self.armed = pairs, {}, False
        engine = torch.autograd.Variable._execution_engine

        def after_reducer():  # DDP's reducer queued its own callback during the backward
            ddp = ref()
            if ddp is not None:
                _agree_on_flags(ddp)

        def hook(_p) -> None:
            if self.armed:  # once per reducing forward
                self.armed = False
                engine.queue_callback(lambda: engine.queue_callback(after_reducer))

        self.hook = hook

    def arm(self, reducing: bool) -> None:
        """A forward of the wrapper: the check runs in the next backward when it prepared a
        reduction (``reducing``), not otherwise."""
        self.armed = reducing
        if reducing:
            for _, p in self.pairs:
                if p.requires_grad and id(p) not in self.handles:
                    self.handles[id(p)] = p.register_post_accumulate_grad_hook(self.hook)

    def release(self) -> None:
        """The wrapper is gone: its hooks go too (runs in a weakref callback)."""
        self.armed = False
        handles, self.handles = self.handles, {}
        for h in handles.values():
            h.remove()


def _agree_on_flags(ddp: DistributedDataParallel) -> None:
    """Raise on every rank if the ranks train different synchronized parameters."""
    agreement = _agreements.get(weakref.ref(ddp))
    synchronized = agreement.pairs if agreement is not None else []
    n = len(synchronized)
    trains = torch.tensor([p.requires_grad for _, p in synchronized], dtype=torch.int32)
    both = torch.cat([trains, -trains]).to(_device(ddp))
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=ddp.process_group)
    differ = (both[:n] + both[n:]).nonzero().flatten().tolist()  # max - min, per parameter
    if differ:
        paths = [synchronized[i][0] for i in differ]
        here = ", ".join(f"{p!r} ({'trains' if synchronized[i][1].requires_grad else 'frozen'})"
                         for i, p in zip(differ, paths))
        raise RuntimeError(
            f"The ranks of the DistributedDataParallel group disagree on what trains: "
            f"{len(paths)} synchronized parameter(s) train on some ranks and are frozen on "
            f"others; on this rank: {here}. DDP averages their gradients on every rank, but "
            "an optimizer skips a frozen parameter, so the ranks' weights would drift apart. "
            "Make the same change of what trains on every rank. This backward's gradients are "
            "in .grad; no flag or parameter was changed."
        )


def _unreached(ddp: DistributedDataParallel, out) -> list[str]:
    """Paths of the synchronized parameters that no gradient from ``out`` reaches (a walk of
    the autograd graph, as DDP's ``find_unused_parameters`` does)."""
    pending = {}
    for path, p in ddp.module.named_parameters():
        hit = _wrapper_of(p)
        if p.requires_grad and hit is not None and hit[1] and hit[0] is ddp:
            pending[id(p)] = path
    # the tensors DDP itself finds in the output (containers, dataclasses, namedtuples, dicts)
    roots = [t for t in _find_tensors(out) if t.requires_grad]
    if not roots:
        return []  # nothing to differentiate: no reduction will start
    nodes, seen = [], set()
    for t in roots:
        if t.grad_fn is None:
            pending.pop(id(t), None)
        else:
            nodes.append(t.grad_fn)
    while nodes and pending:
        node = nodes.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            pending.pop(id(variable), None)
        if is_reentrant_checkpoint(node):
            # its backward recomputes the function: the parameters it uses have no edge here;
            # those of the modules it is bound to (HF's layer.__call__, a closure's self) count
            for m in modules_behind(getattr(node, "run_function", None)):
                for p in m.parameters():
                    pending.pop(id(p), None)
        # a custom function's inputs whose gradient a stop_gradient block cuts get nothing
        cut = getattr(node, "_torchstruct_cut", ())
        nodes.extend(n for i, (n, _) in enumerate(node.next_functions)
                     if n is not None and i not in cut)
    return list(pending.values())


def _wrapper_of(p):
    """``(live DDP wrapper, whether it synchronizes p)`` of parameter ``p``, or None."""
    hit = _wrapped.get(id(p))
    ddp = hit[0]() if hit is not None and hit[2] is p else None
    return None if ddp is None else (ddp, hit[1])


def _ddp_problem(path: str, p, flag: bool) -> str | None:
    """Why DDP cannot follow ``p``'s flag changing to ``flag``, or None when it can."""
    hit = _wrapper_of(p)
    if hit is None:
        return None
    ddp = hit[0]
    if flag and not hit[1]:
        return (
            f"{path!r} would start training, but DistributedDataParallel synchronizes only the "
            "parameters that required grad when it was built: its gradient would differ between "
            "ranks. Change what trains before wrapping (or drop this wrapper, make the change "
            "and wrap the model again)."
        )
    if not flag and hit[1] and getattr(ddp, "static_graph", False):
        return (
            f"{path!r} would stop training, but DistributedDataParallel was built with "
            "static_graph=True, which fixes after the first step which parameters get a "
            "gradient, and waits for its gradient at every step. Change what trains before "
            "wrapping, or wrap without static_graph and with find_unused_parameters=True."
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


def ddp_wrapper(model: nn.Module) -> DistributedDataParallel | None:
    """The live DDP wrapper that synchronizes ``model``'s parameters: ``model`` itself, or the
    wrapper of ``model`` (or of a module containing it); None when there is none."""
    if isinstance(model, DistributedDataParallel):
        return model
    if not _wrapped:
        return None
    for p in model.parameters():
        hit = _wrapper_of(p)
        if hit is not None:
            return hit[0]
    return None


def average_gradients(ddp: DistributedDataParallel, compute, *, tensor_loss: bool,
                      create_graph: bool) -> list:
    """``compute()`` (``(params, grads)``: this rank's parameters asked for and their
    gradients, in order), the gradients averaged over the ranks of ``ddp``, as ``backward()``
    on the wrapper leaves them in ``.grad``.

    ``compute`` runs under ``ddp.no_sync()``: a forward there prepares no reduction, so
    ``autograd.grad`` leaves DDP's reducer ready for the next training step. Every rank learns
    whether another one failed (in ``compute``, or in the checks below), or asks for other
    parameters, before any gradient is exchanged, so an error on one rank is an error on all
    of them, never a hang. Parameters DDP was told to ignore
    (``_ddp_params_and_buffers_to_ignore``) keep their local gradient, as with ``backward()``.

    Raises:
        ValueError: ``tensor_loss`` outside ``ddp.no_sync()`` (the forward already prepared a
            reduction that only ``backward()`` completes), or ``create_graph``.
        RuntimeError: a communication hook or mixed precision is set on ``ddp`` (``backward()``
            reduces through it; a plain average would differ); ``static_graph=True`` before the
            first training step; another rank failed; the ranks ask for different parameters.
    """
    error, params, grads = None, [], None
    try:  # (before no_sync, which turns the reduction it checks for off)
        _check_plain_average(ddp, tensor_loss, create_graph)
    except Exception as e:  # noqa: BLE001 - every rank must hear of it first
        error = e
    with ddp.no_sync(), _buffers_synced_first(ddp, not tensor_loss):
        try:
            if error is None:
                params, grads = compute()
        except Exception as e:  # noqa: BLE001 - every rank must hear of it first
            error = e
    _agree(ddp, error, params)
    return _average(ddp, [(p, g) for p, g in zip(params, grads)],
                    _ignored(ddp.module, ddp.parameters_to_ignore))


def _ignored(inner: nn.Module, skip) -> set[int]:
    """Ids of the parameters of ``inner`` (the module a DDP wraps) its reducer leaves out,
    ``skip`` being its ``parameters_to_ignore``: as the reducer decides, a parameter is in
    unless every ``module_name.param_name`` it is found under is listed (a tied one is found
    under several; a parameter of the root itself under ``.name``, as DDP spells it)."""
    if not skip:
        return set()
    paths: dict[int, list[str]] = {}
    for mpath, mod in inner.named_modules():
        for name, p in mod.named_parameters(recurse=False):
            paths.setdefault(id(p), []).append(f"{mpath}.{name}")
    return {i for i, ps in paths.items() if all(path in skip for path in ps)}


@contextlib.contextmanager
def _buffers_synced_first(ddp, forward_follows: bool):
    """Broadcast rank 0's buffers now, as ``ddp``'s next forward would, and let that forward
    skip it: the broadcast is a collective, so a loss callable that raises on one rank before
    the forward would otherwise leave the other ranks waiting in it (a hang). Nothing when no
    forward follows (a loss already computed: its graph may hold the buffers)."""
    pre_forward = getattr(ddp, "_check_sync_bufs_pre_fwd", None)
    if (not forward_follows or pre_forward is None or not pre_forward()
            or hasattr(ddp, "buffer_hook")):
        yield
        return
    ddp._sync_buffers()
    before, ddp.broadcast_buffers = ddp.broadcast_buffers, False
    try:
        yield
    finally:
        ddp.broadcast_buffers = before


def _check_plain_average(ddp, tensor_loss: bool, create_graph: bool) -> None:
    """Refuse, on every rank alike, what a plain average cannot reproduce."""
    if create_graph:
        raise ValueError(
            "structural_grad: create_graph=True on a DistributedDataParallel model: the "
            "synchronized gradient is not differentiable (DDP's backward() does not support "
            "double backward either). Use torch.autograd.grad on the inner module for each "
            "rank's local differentiable gradient"
        )
    if tensor_loss and ddp.require_backward_grad_sync:
        raise ValueError(
            "structural_grad: a loss already computed by a DistributedDataParallel model with "
            "gradient synchronization on has a reduction pending that only loss.backward() "
            "completes. Pass the loss as a callable `lambda m: ...` (the forward then runs "
            "under ddp.no_sync()), or compute the loss and call structural_grad inside the "
            "same `with ddp.no_sync():` block"
        )
    if getattr(ddp, "static_graph", False) and not getattr(
            ddp, "_static_graph_delay_allreduce_enqueued", True):
        raise RuntimeError(
            "structural_grad: the DistributedDataParallel model has static_graph=True and has "
            "not run a training step yet; DDP records its graph at the first backward(), which "
            "structural_grad would consume (DDP fails inside and trains wrongly afterwards). "
            "Run one step with loss.backward() first"
        )
    logger = getattr(ddp, "logger", None)
    hook = logger is not None and ddp._get_ddp_logging_data().get("comm_hook")
    if hook and hook not in ("allreduce_hook", "BuiltinCommHookType.ALLREDUCE"):
        raise RuntimeError(
            f"structural_grad: the DistributedDataParallel model has the communication hook "
            f"{hook!r}; backward() reduces the gradients through it, and structural_grad's "
            "plain average would differ. Use loss.backward() and ts.grad_tree(model)"
        )
    if getattr(ddp, "mixed_precision", None) is not None:
        raise RuntimeError(
            "structural_grad: the DistributedDataParallel model reduces gradients in mixed "
            "precision; structural_grad's average would differ. Use loss.backward() and "
            "ts.grad_tree(model)"
        )


def _device(ddp) -> torch.device:
    p = next(ddp.module.parameters(), None)
    return torch.device("cpu") if p is None else p.device


def _agree(ddp, error: BaseException | None, params: list) -> None:
    """Raise on every rank if any rank failed (this rank's own error where it has one), or if
    the ranks ask for different parameters (``wrt=`` or the trainable set differs): their
    gradients could not be averaged (a collective of mismatched sizes crashes or hangs)."""
    position = {}
    for p in ddp.module.parameters():
        position.setdefault(id(p), len(position))
    asked = [0.0] * len(position)  # which of the module's parameters: compared whole
    outside = 0.0
    for p in params:
        if id(p) in position:
            asked[position[id(p)]] = 1.0
        else:
            outside += 1.0
    mine = [0.0 if error is None else 1.0, float(len(params)), outside,
            float(sum(p.numel() for p in params)), *asked]
    both = torch.tensor(mine + [-v for v in mine], dtype=torch.float64, device=_device(ddp))
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=ddp.process_group)
    if error is not None:
        raise error
    if both[0].item():
        raise RuntimeError(
            "structural_grad: another rank of the DistributedDataParallel group raised while "
            "computing its gradients (its error names the cause); no gradient was exchanged"
        )
    n = len(mine)
    if not torch.equal(both[1:n], -both[n + 1:]):
        raise RuntimeError(
            "structural_grad: the ranks of the DistributedDataParallel group ask for different "
            f"parameters (this rank: {len(params)}); every rank must ask for the same ones (the "
            "same wrt=, and the same parameters trainable on every rank). "
            "No gradient was exchanged"
        )


def _average(ddp, pairs: list, ignored: set) -> list:
    """Each gradient averaged over the ranks (one all-reduce per device and dtype)."""
    world = dist.get_world_size(ddp.process_group)
    out = [g for _, g in pairs]
    groups: dict = {}
    for i, (p, g) in enumerate(pairs):
        if id(p) not in ignored:
            g = g.to_dense() if g.is_sparse else g
            out[i] = g
            groups.setdefault((g.device, g.dtype), []).append(i)
    for idx in groups.values():
        flat = torch.cat([out[i].reshape(-1) for i in idx]).mul_(1.0 / world)  # as DDP
        dist.all_reduce(flat, group=ddp.process_group)
        parts = flat.split([out[i].numel() for i in idx])
        for i, part in zip(idx, parts):
            out[i] = part.view_as(out[i])
    return out


_module_mod.register_module_module_registration_hook(_on_module_registered)
flag_guards.append(_ddp_guard)
