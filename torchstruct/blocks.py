"""Block-local contexts on parameters: ``stop_gradient``, ``constant``, ``swap``.

Unlike :func:`~torchstruct.freeze`, these change no ``requires_grad`` flag and no module
attribute: they act on the *operations executed inside the block*.

- :class:`stop_gradient` and :class:`swap` install a ``torch.overrides.TorchFunctionMode`` that
  replaces each selected parameter, wherever it appears in the arguments of a torch function or
  tensor method, by a stand-in: its ``.detach()`` alias (``stop_gradient``) or the tree's tensor
  (``swap``). Parameters are recognised by identity, so cached references (``nn.LSTM``'s
  ``_flat_weights``) and tied parameters are covered. Property reads see the stand-in
  (``p.T``, ``p.shape``; ``p.requires_grad`` is False inside ``stop_gradient``), except
  ``p.grad`` inside ``stop_gradient``, which stays the parameter's own; property writes
  (``p.requires_grad = ...``, ``p.grad = ...``) and the methods that write a flag or a hook
  (``requires_grad_``, ``register_hook``) act on the parameter itself.
- :class:`constant` installs a ``torch.utils._python_dispatch.TorchDispatchMode`` that reads
  each aten op's schema and raises before an op writes into the memory of a selected parameter
  (byte ranges in the device's memory, whatever storage the write goes through), and a
  ``TorchFunctionMode`` that refuses ``p.data = other`` on a selected parameter.

All three are :class:`~torchstruct.contexts._Context` classes: ``with`` for a block, a bare
call for "from now on", ``@`` on a function for every call of it. They validate their input
before changing anything. Their modes are thread-local. A ``stop_gradient`` or ``swap`` block
leaves the mode stack wherever it is in it (a bare block may be exited under a later one); a
``constant`` block exits in reverse order of entry (an out-of-order exit raises, nothing
changed).

A ``torch.autograd.Function.apply`` call does not pass through torch function modes: a
parameter handed *directly* to a custom autograd function is found by the function's forward
operations instead; inside ``stop_gradient`` (a forward taking ``ctx``) the node's gradient for
it is cut, elsewhere the call is refused (see ``_Substitute._cut_custom_functions``).

Limits: modes are thread-local and last while the block is open: a checkpointed
function recomputed during backward must enter the block itself. ``torch.compile`` (torch >= 2.5)
traces through an active block (the mode's handler is traced); entering or leaving a block
*inside* a compiled function is a graph break. ``constant`` runs the compiled code's operations
through its dispatch mode as well.
"""
from __future__ import annotations

import bisect
import os
import sys
from collections.abc import Callable

import torch
import torch._dynamo
import torch.utils.checkpoint
from torch import Tensor, nn
from torch._C import _functorch
from torch.optim import optimizer as _optimizer
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import (TorchDispatchMode, _get_current_dispatch_mode_stack,
                                          _pop_mode, _push_mode)

from . import _checkpoints, _compile_caveats, _custom_functions, _state
from ._checks import check_bool, refuse_lazy, refuse_while_exporting
from ._ops import run_eagerly
from ._reference import _place
from .contexts import _Context
from .select import _closest, index, select
from .tree import to_flat_dict

__all__ = ["stop_gradient", "constant", "swap"]


def _check_model(ctx: str, model) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{ctx}: first argument must be an nn.Module, got {type(model).__name__}")


# ---------------------------------------------------------------------------------------------
# Substitution of parameters in the arguments of torch functions.


# methods that write a parameter's flag or hooks: like attribute writes, they act on the
# parameter itself (``model.requires_grad_(False)`` inside a block freezes the model)
_ON_PARAMETER = frozenset({"requires_grad_", "register_hook", "register_post_accumulate_grad_hook",
                           "retain_grad"})


class _Substitute(TorchFunctionMode):
    """Replace ``table[id(p)] = (p, make)`` parameters by ``make(p)`` in every torch call.

    Attribute writes (``p.requires_grad = ...``, ``p.grad = ...``), the methods in
    ``_ON_PARAMETER`` (``requires_grad_``, ``register_hook``) and reads of the attributes named
    in ``own`` keep acting on the parameter itself.
    """

    stands_in = True  # lifted while torchstruct works on the parameters (_state.LOCK)
    wrapped = False  # whether the call being handled runs inside a torch.func transform
    aliases = False  # set by the block: whether the stand-ins share the parameters' memory

    def __init__(self, table: dict[int, tuple[Tensor, Callable[[Tensor], Tensor]]],
                 own: frozenset[str] = frozenset(), kind: str = "block") -> None:
        super().__init__()
        self.table = table
        # the classes of the replaced tensors (Parameter; plain tensors inside functional_call):
        # a tensor of another class is not looked up, its id is never read, so compiled code
        # inside the block guards on the class of a batch, not on its identity (a fresh batch
        # per step would otherwise compile a graph per step)
        self.kinds = frozenset(type(hit[0]) for hit in table.values())
        # what acts on the parameter itself: attribute writes, the methods in _ON_PARAMETER,
        # the reads in ``own``
        self.own = frozenset({"__set__", "__delete__"}) | _ON_PARAMETER | own
        self.kind = kind
        # reentrant checkpoints already running when the block was entered (it is inside them)
        self.outer = {id(f) for f in _checkpoint_frames(sys._getframe())}
        # custom functions' forwards already running then: a parameter handed to their apply
        # was handed outside the block (its gradient is theirs to give)
        self.outer_forwards = {id(f) for f, *_ in
                               _custom_functions.running_forwards(sys._getframe())}

    def _sub(self, x):
        """``x`` (a tensor, or a list, tuple or dict looked into) with the replaced parameters
        replaced; ``x`` itself when nothing in it is."""
        if isinstance(x, dict):
            values = self._replaced(tuple(x.values()))
            return x if values is None else dict(zip(x, values))
        if isinstance(x, (list, tuple)):
            values = self._replaced(x)
            if values is None:
                return x
            return type(x)(*values) if hasattr(x, "_fields") else type(x)(values)  # namedtuple
        values = self._replaced((x,))
        return x if values is None else values[0]

    def _replaced(self, values) -> list | None:
        """``values`` with the replaced parameters replaced, or None when none is (the common
        case: one dictionary look-up per tensor, no new objects; this runs at every torch call
        in the block)."""
        table, out = self.table, None
        for i, v in enumerate(values):
            if isinstance(v, Tensor):
                hit = table.get(id(v)) if type(v) in self.kinds else None
                if hit is not None and hit[0] is v:
                    new = hit[1](v)
                elif self.wrapped and _functorch.is_functorch_wrapped_tensor(v):
                    new = self._sub_wrapped(v)
                else:
                    continue
            elif isinstance(v, (list, tuple, dict)):
                new = self._sub(v)
            else:
                continue
            if new is not v:
                if out is None:
                    out = list(values)
                out[i] = new
        return out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", None)
        if name == "__get__":  # a property read: which property?
            name = getattr(getattr(func, "__self__", None), "__name__", None)
        if name in self.own:
            return func(*args, **kwargs)
        if name == "_make_dual" and torch._C._are_functorch_transforms_active():
            # torch.func.jvp makes its duals from the variables it is handed: the block
            # replaces the dual's uses instead (see _sub_wrapped). Outside torch.func, a dual
            # made from the parameter is made from its stand-in
            return func(*args, **kwargs)
        if name == "requires_grad" and _caller(sys._getframe(1)).f_code in _COPYING:
            return func(*args, **kwargs)  # a copy or a save of the parameter: its own flag
        # inside torch.func transforms, the parameters may come wrapped (grad over
        # functional_call(model, dict(model.named_parameters()))); the transform's own
        # autograd.grad call over those wrappers is left as it is
        self.wrapped = (torch._C._are_functorch_transforms_active()
                        and func is not torch.autograd.grad)
        values = self._replaced(args)
        if values is not None and name in _CONVERSIONS and not torch.compiler.is_compiling() \
                and _converting(sys._getframe(1)):
            return func(*args, **kwargs)  # see _converting
        new_args = args if values is None else tuple(values)
        new_kwargs = self._sub(kwargs) if kwargs else kwargs
        # a custom function's forward runs with both grad modes off; it may turn grad mode
        # back on (torch.enable_grad inside the forward), never forward grad mode. The
        # compiling test comes first: dynamo cannot trace what follows it (with the grad mode
        # tests first, a compiled function entering blocks computes wrong values)
        if not torch.compiler.is_compiling() and not (
                torch.is_grad_enabled() and torch._C._is_fwd_grad_enabled()) and (
                new_args is not args or new_kwargs is not kwargs):
            self._refuse_recompute()
            self._cut_custom_functions()
        return func(*new_args, **new_kwargs)

    if _compile_caveats.MODES_MISTRACED:  # compiled code runs the handler eagerly
        __torch_function__ = torch.compiler.disable(__torch_function__)
    else:  # traced inlined only: a frame of its own is not guarded on func
        __torch_function__ = _compile_caveats.only_inlined(__torch_function__)

    def _cut_custom_functions(self) -> None:
        """A parameter handed directly to a custom ``torch.autograd.Function`` running now:
        ``apply`` passes through no torch function mode, so the function's backward node has
        an edge to the parameter itself. Its forward's operations see the stand-in (that is how
        this is found, see :mod:`torchstruct._custom_functions`); inside ``stop_gradient`` the
        node's gradient for the parameter is cut (a hook on the node; the stand-in aliases the
        parameter, so everything else the node saved is the same), which is exact; the edge
        stays, so the parameter's hooks run as for a backward returning None for it
        (docs/stop_gradient.md). Anywhere else it is refused."""
        for frame, name, takes_ctx, inputs in _custom_functions.running_forwards(
                sys._getframe(2)):
            if id(frame) not in self.outer_forwards:
                self._cut(frame, name, takes_ctx, inputs)

    def _cut(self, forward, name: str, takes_ctx: bool, inputs) -> None:
        ctx = _custom_functions.first_argument(forward) if takes_ctx else None
        if isinstance(ctx, torch.autograd.function.BackwardCFunction):
            # the node's edges, one per tensor input (empty when apply records nothing,
            # under no_grad): an edge to a replaced parameter is one to cut
            needed = {i: v for i, (node, _) in enumerate(ctx.next_functions)
                      if (v := getattr(node, "variable", None)) is not None
                      and (hit := self.table.get(id(v))) is not None and hit[0] is v}
        else:  # a forward without ctx (setup_context): whether apply records is not known
            with torch._C.DisableTorchFunction():
                needed = {i: a for i, a in enumerate(inputs)
                          if isinstance(a, Tensor) and a.requires_grad
                          and (hit := self.table.get(id(a))) is not None and hit[0] is a}
        if not needed:
            return
        if not (self.aliases and isinstance(ctx, torch.autograd.function.BackwardCFunction)):
            raise RuntimeError(
                f"{self.kind}: a parameter it replaces is handed directly to the custom "
                f"autograd function {name} (torch.autograd.Function.apply does not pass through "
                "torch function modes, so its backward would reach the parameter itself"
                + (", and what it saved for backward is the parameter, not the stand-in"
                   if not self.aliases else
                   "; the function's forward takes no ctx, so its backward node cannot be "
                   "reached from here") +
                "). " + (_HOOK_HINT if "BackwardHookFunction" in name else
                         "Hand it the replacement yourself inside the block (p.detach() for "
                         "stop_gradient).")
            )
        done = ctx.__dict__.setdefault("_torchstruct_cut", set())
        if needed.keys() - done:
            if not done:
                ctx.register_hook(_custom_functions.drop_gradients(done))
            done.update(needed)
            _custom_functions.save_stand_ins(ctx, {id(v): v for v in needed.values()})

    def _sub_wrapped(self, x):
        """``x`` wraps a tensor for a torch.func transform: replaced (at its level: the
        stand-in of the wrapper, ``x.detach()`` inside ``stop_gradient``) when what it wraps,
        all levels down, is a replaced parameter (or the alias of the whole parameter that
        ``torch.func.jvp``, hence ``jacfwd`` and ``hessian``, makes its dual from)."""
        base = x
        while _functorch.is_functorch_wrapped_tensor(base):
            base = _functorch.get_unwrapped(base)
        hit = self.table.get(id(base))
        if hit is not None and hit[0] is base:
            return hit[1](x)
        root = base._base
        hit = None if root is None else self.table.get(id(root))
        if hit is not None and hit[0] is root and _whole_alias(base, root):
            return hit[1](x)
        return x

    def _refuse_recompute(self) -> None:
        """A stand-in used inside a reentrant checkpoint entered after the block, which will
        record a backward: the backward recomputes without the block, silently wrong."""
        for frame in _checkpoint_frames(sys._getframe(2)):
            if id(frame) in self.outer:
                continue
            inputs = frame.f_locals.get("args", ())
            if any(isinstance(t, Tensor) and t.requires_grad for t in inputs):
                raise RuntimeError(
                    f"{self.kind}: a parameter it replaces is used inside a reentrant activation "
                    "checkpoint (torch.utils.checkpoint with use_reentrant=True) called inside "
                    "the block: its backward recomputes the function after the block has "
                    "exited, without the replacement, so the gradients would be wrong. Enter the "
                    "block inside the checkpointed function, or use use_reentrant=False")


# PyTorch's full backward hooks pass a module's tensor inputs through a custom function
_HOOK_HINT = ("This one is PyTorch's own: a module full backward hook (register_full_backward_"
              "hook or register_full_backward_pre_hook) on a module called with the parameter "
              "itself as an input. Remove the hook for the block, or call that module with an "
              "expression of the parameter (p * 1, or the replacement itself).")

_DYNAMO = os.path.dirname(torch._dynamo.__file__) + os.sep


def _caller(frame):
    """``frame``, or the first frame out of it that is not dynamo's (the wrapper of a handler
    under ``torch.compiler.disable``: before torch 2.13, or where ``only_inlined`` has no
    other way)."""
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_DYNAMO):
        frame = frame.f_back
    return frame


# the torch functions nn.Module's conversions call on a parameter (to, cuda, half, ...,
# share_memory, to_empty): only these are looked at by _converting
_CONVERSIONS = frozenset({"to", "cuda", "cpu", "xpu", "mps", "ipu", "mtia", "type", "float",
                          "double", "half", "bfloat16", "share_memory_", "empty_like"})


def _converting(frame) -> bool:
    """The torch call made from ``frame`` is a module conversion's ``fn(param)``
    (``model.to()``, ``.half()``, ``.share_memory()``: ``Module._apply``): it acts on the
    parameter itself, never on its stand-in, which ``Module._apply`` would otherwise write
    into the module (``param.data = fn(stand_in)``)."""
    for _ in range(7):  # fn, a Tensor method in Python (share_memory_), its handler, and
        if frame is None:  # the wrapper of a compiler.disable'd handler
            return False
        if frame.f_code is _MODULE_APPLY:
            return True
        frame = frame.f_back
    return False


def _whole_alias(t: Tensor, p: Tensor) -> bool:
    """``t`` sees exactly ``p``'s elements, the same way."""
    return (t.shape == p.shape and t.stride() == p.stride() and t.dtype == p.dtype
            and t.storage_offset() == p.storage_offset())


def _checkpoint_frames(frame) -> list:
    """The frames of ``torch.utils.checkpoint``'s reentrant forward from ``frame`` outwards."""
    out = []
    while frame is not None:
        if frame.f_code is _REENTRANT_FORWARD:
            out.append(frame)
        frame = frame.f_back
    return out


_REENTRANT_FORWARD = torch.utils.checkpoint.CheckpointFunction.forward.__code__

# Parameter's own copy and serialization code: the flag it reads is the parameter's, so a
# deepcopy or torch.save made inside a block keeps the flags (the copy is not in the block).
# Likewise the module code that builds the tensor swapped into a parameter, or registered in its
# place (module.to() / load_state_dict on PyTorch's swap path): it copies the parameter's flag.
_COPYING = frozenset({nn.Parameter.__deepcopy__.__code__, nn.Parameter.__reduce_ex__.__code__,
                      nn.Module._apply.__code__, nn.Module._load_from_state_dict.__code__})


class _SubstituteBlock(_Context):
    own: frozenset[str] = frozenset()  # attributes read from the parameter itself
    aliases: bool = False  # whether the stand-ins share the parameters' memory

    def _table(self) -> dict[int, tuple[Tensor, Callable[[Tensor], Tensor]]]:
        raise NotImplementedError

    @run_eagerly
    def _apply(self) -> None:
        table = self._table()
        _refuse_scripted(type(self).__name__, self._args[0], table)
        mode = _Substitute(table, self.own, type(self).__name__)  # validates first
        mode.aliases = self.aliases
        _checkpoints.watch_blocks(1)
        _state.push_stand_in(mode)
        self._mode = mode

    @run_eagerly
    def _undo(self) -> None:
        _leave(self, self._mode)
        _checkpoints.watch_blocks(-1)

    def _above(self) -> list:
        return _modes_above(_FUNCTION_MODES, self._mode)

    def _sink_below(self, items: list) -> None:
        _sink_mode(_FUNCTION_MODES, self._mode, items)


def _refuse_scripted(ctx: str, model: nn.Module, table: dict) -> None:
    """``RuntimeError`` when a parameter the block acts on is used by a TorchScript module of
    ``model``: its compiled code calls no Python torch function, so the block would not see
    those uses (the parameter would get its gradient, or be used instead of its stand-in)."""
    if not any(isinstance(mod, torch.jit.ScriptModule) for mod in model.modules()):
        return  # (the common case: no paths built)
    for path, mod in model.named_modules():
        if not isinstance(mod, torch.jit.ScriptModule):
            continue
        for name, p in mod.named_parameters():
            if id(p) in table:
                where = f"the TorchScript module {path!r}" if path else "a TorchScript module"
                raise RuntimeError(
                    f"{ctx}: parameter {'.'.join(filter(None, [path, name]))!r} is used by "
                    f"{where} ({mod.original_name}), whose compiled code calls no Python torch "
                    f"function, so {ctx} would not act on it there. Use the eager module, or "
                    "leave that module's parameters out of the block. Nothing was changed.")


# (the stack, bottom first; pop its top; push on it): this thread's torch function modes and
# its dispatch modes
_FUNCTION_MODES = (torch.overrides._get_current_function_mode_stack,
                   torch._C._pop_torch_function_stack, torch._C._push_on_torch_function_stack)
_DISPATCH_MODES = (_get_current_dispatch_mode_stack, _pop_mode, _push_mode)


def _modes_above(modes: tuple, mode) -> list:
    """The modes entered after ``mode`` on one of the stacks above (all of them, any kind)."""
    stack = modes[0]()
    at = next((i for i, m in enumerate(stack) if m is mode), len(stack))
    return stack[at + 1:]


def _sink_mode(modes: tuple, mode, items: list) -> None:
    """Move ``mode`` below the first of ``items`` on one of the stacks above, the order of the
    others kept (nothing happens when it is below them already, or none of them is there)."""
    stack, pop, push = modes[0](), modes[1], modes[2]
    first = next((i for i, m in enumerate(stack) if any(m is x for x in items)), None)
    mine = next((i for i, m in enumerate(stack) if m is mode), None)
    if first is None or mine is None or mine < first:
        return
    popped = [pop() for _ in range(len(stack) - first)][::-1]  # bottom first, `mode` last
    popped.insert(0, popped.pop())
    for m in popped:
        push(m)


def _leave(ctx, mode: TorchFunctionMode) -> None:
    """Take ``mode`` off this thread's torch function mode stack, wherever it is: modes
    entered after it stay, in order. Raises (``ctx`` still active) when it is not there.
    Left while torchstruct has it lifted (a generator holding the block closed from inside a
    torchstruct call), it is taken off the lifted modes: it does not come back."""
    if not any(m is mode for m in torch.overrides._get_current_function_mode_stack()):
        if _state.take_lifted(mode):
            return
        ctx._active = True  # still active where it was entered
        raise RuntimeError(_not_here(ctx))
    above = []
    while (top := torch._C._pop_torch_function_stack()) is not mode:
        above.append(top)
    for m in reversed(above):
        torch._C._push_on_torch_function_stack(m)


def _not_here(ctx) -> str:
    return (f"{type(ctx).__name__}: this block is not active in this thread (blocks are "
            "thread-local: exit it in the thread that entered it)")


def _detach(p: Tensor) -> Tensor:
    return p.detach()


class stop_gradient(_SubstituteBlock):
    """Inside the block, the selected parameters are constants for autograd.

    Every torch operation executed in the block sees a ``.detach()`` alias of each selected
    parameter (same memory, no graph), so it contributes no gradient to that parameter, while
    gradients still flow to every other input. The same parameters used before or after the
    block (or in another block that does not select them) get their gradients as usual, so one
    forward pass may block different partitions of the weights in different parts. Blocks
    nest: a parameter is blocked when any enclosing block selects it.

    Arguments:
        model: the module whose parameters are selected.
        *selectors: which parameters (see :func:`~torchstruct.select`); none means all of
            ``model``. Resolved when the block is entered.
        strict: when True (default) a selector that matches nothing raises.

    Returns:
        The context (use with ``with``, as a decorator, or call it bare to apply from now on).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, a selector has an unsupported type, or
            ``strict`` is not a bool.
        ValueError: a selector matching nothing (naming the closest paths).

    Example:
        >>> import torch, torch.nn as nn, torchstruct as ts
        >>> m = nn.Linear(2, 1)
        >>> x = torch.ones(1, 2, requires_grad=True)
        >>> with ts.stop_gradient(m, "weight"):
        ...     y = m(x)
        >>> y.sum().backward()
        >>> m.weight.grad is None, m.bias.grad, x.grad is not None
        (True, tensor([1.]), True)
    """

    # p.grad is the parameter's own gradient, and so are the ``inputs`` of a backward
    # (``loss.backward(inputs=[p])``, ``torch.autograd.backward``): the .grad it fills
    own = frozenset({"grad", "_grad", "backward"})

    def __init__(self, model: nn.Module, *selectors, strict: bool = True) -> None:
        super().__init__(model, *selectors, strict=strict)

    aliases = True  # a .detach() alias: writes through it reach the parameter

    def _table(self):
        model, *selectors = self._args
        _check_model("stop_gradient", model)
        check_bool(self._kwargs["strict"], "strict", "stop_gradient")
        chosen = select(model, *(selectors or [model]), strict=self._kwargs["strict"])
        refuse_lazy("stop_gradient", chosen)  # (its materialization would see the stand-in)
        return {id(p): (p, _detach) for _, p in chosen}


class swap(_SubstituteBlock):
    """Inside the block, the tree's tensors stand in for the model's parameters.

    Every torch operation executed in the block sees ``tree``'s tensor wherever it would see
    the parameter at that path (EMA weights for evaluation, lookahead weights, ...). Gradients
    reach the swapped-in tensors that require grad. The module itself is not modified: its
    attributes still hold the original ``nn.Parameter`` objects, which are bitwise untouched and
    in use again on exit, also when the block raises. The tree may be **partial**: only the
    paths it names are swapped. A tied parameter is named by its canonical (first) path and is
    swapped at all of its uses.

    Arguments:
        model: the module whose parameters are replaced.
        tree: a nested dict of tensors following the module tree, or a flat dict keyed by
            dotted paths (``{"0.weight": t}``, as a ``state_dict``); ``None`` leaves are
            skipped. Each tensor must have the shape, dtype, layout and device of the
            parameter it replaces.

    Returns:
        The context (use with ``with``, as a decorator, or call it bare to apply from now on).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or a leaf is not a tensor.
        ValueError: a path that is not a parameter of ``model`` (naming the closest paths), a
            non-canonical path of a tied parameter, a shape/dtype/layout/device mismatch, or an
            uninitialized lazy parameter, naming the path. Nothing is changed.

    Example:
        >>> import torch, torch.nn as nn, torchstruct as ts
        >>> m = nn.Linear(2, 1)
        >>> with ts.swap(m, {"weight": torch.zeros(1, 2), "bias": torch.ones(1)}):
        ...     m(torch.ones(1, 2))
        tensor([[1.]])
    """

    def __init__(self, model: nn.Module, tree: dict) -> None:
        super().__init__(model, tree)

    def _table(self):
        model, tree = self._args
        _check_model("swap", model)
        if not isinstance(tree, dict):
            raise TypeError(f"swap: tree must be a dict, got {type(tree).__name__}")
        flat = to_flat_dict(tree)  # checks keys and leaves, naming the path
        idx = index(model)
        canonical = {ps[0]: p for p, ps in zip(idx.params, idx.paths)}
        alias = {path: ps[0] for ps in idx.paths for path in ps[1:]}
        table = {}
        for path, t in flat.items():
            if path in alias:
                raise ValueError(
                    f"swap: {path!r} is a tied parameter; name it at its canonical path "
                    f"{alias[path]!r} (that swaps all of its uses)"
                )
            p = canonical.get(path)
            if p is None and path in dict(model.named_buffers()):
                raise ValueError(
                    f"swap: {path!r} is a buffer of the model, not a parameter; swap replaces "
                    f"parameters only (a state_dict holds buffers too: keep its parameter paths)"
                )
            if p is None:
                raise ValueError(
                    f"swap: {path!r} is not a parameter of the model; closest paths: "
                    f"{_closest(path, list(canonical))}"
                )
            refuse_lazy("swap", [(path, p)])
            for what in ("shape", "dtype", "layout", "device"):
                want, got = getattr(p, what), getattr(t, what)
                if want != got:
                    raise ValueError(
                        f"swap: {what} mismatch at {path!r}: the parameter has {_show(want)}, "
                        f"the tree's tensor has {_show(got)}"
                    )
            table[id(p)] = (p, lambda _p, t=t: t)
        return table


def _show(v) -> str:
    return str(tuple(v)) if isinstance(v, torch.Size) else str(v)


# ---------------------------------------------------------------------------------------------
# Write protection at the aten level.

_WRITES: dict = {}  # OpOverload -> ((position, name), ...) of its written arguments
# ops that update their running statistics in place with no write in their schema:
# name -> ((position, name) of those arguments, position of `training` or None: always)
_STATS_WRITERS = {
    "aten::native_batch_norm": (((3, "running_mean"), (4, "running_var")), 5),
    "aten::cudnn_batch_norm": (((3, "running_mean"), (4, "running_var")), 5),
    "aten::miopen_batch_norm": (((3, "running_mean"), (4, "running_var")), 5),
    "aten::_batch_norm_impl_index": (((3, "running_mean"), (4, "running_var")), 5),
    "aten::batch_norm_update_stats": (((1, "running_mean"), (2, "running_var")), None),
    "aten::batch_norm_gather_stats_with_counts": (((3, "running_mean"), (4, "running_var")),
                                                  None),
}
# ops writing only the metadata (sizes, strides) of the tensor they are given: a write to
# a parameter only when given the parameter itself, not another tensor on its memory
_METADATA_WRITERS = frozenset({"aten::t_", "aten::transpose_", "aten::swapdims_",
                               "aten::swapaxes_", "aten::unsqueeze_", "aten::squeeze_",
                               "aten::as_strided_"})


def _written_args(func, args, kwargs) -> tuple[list, bool]:
    """The tensors (or lists of them) ``func`` writes in place, given its arguments, and
    whether it writes only their metadata."""
    hit = _WRITES.get(func)
    if hit is None:
        schema = func._schema
        flagged = tuple((i, a.name) for i, a in enumerate(schema.arguments)
                        if a.alias_info is not None and a.alias_info.is_write)
        hit = _WRITES[func] = (flagged, _STATS_WRITERS.get(schema.name),
                               schema.name in _METADATA_WRITERS)
    flagged, stats, metadata = hit
    if stats is not None:
        rows, training = stats
        if training is None or (args[training] if training < len(args)
                                else kwargs.get("training", True)):
            flagged = flagged + rows
    return [args[i] if i < len(args) else kwargs.get(name) for i, name in flagged], metadata


_SPARSE_PARTS = {
    torch.sparse_coo: ("_indices", "_values"),
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}


def _parts(t: Tensor) -> list[Tensor]:
    """The strided tensors that hold ``t``'s bytes: ``t`` itself, a sparse tensor's indices
    and values; none for other layouts (recognised by identity only)."""
    if t.layout == torch.strided:
        return [t]
    with torch._C.DisableTorchFunction():
        return [getattr(t, name)() for name in _SPARSE_PARTS.get(t.layout, ())]


class _Guard(TorchDispatchMode):
    """Raise before an aten op writes into a protected byte range."""

    def __init__(self, protected: list[tuple[str, Tensor]]) -> None:
        super().__init__()
        spans: dict[object, list[tuple[int, int, str]]] = {}
        # every protected parameter by identity (a write given the parameter itself: also
        # an empty one, or one whose memory moved; sparse ones, whose bytes are their parts)
        self.params: dict[int, tuple[Tensor, str]] = {id(p): (p, path) for path, p in protected}
        for path, p in protected:
            if p.layout == torch.strided and p.numel() == 0:
                continue  # no bytes
            for part in _parts(p):  # a sparse tensor's bytes: its values and indices
                memory, lo, hi = _place(part)
                spans.setdefault(memory, []).append((lo, hi, path))
        # per memory: spans sorted by start, their starts, and the running maximum of their ends
        self.spans = {}
        for memory, rows in spans.items():
            rows.sort()
            ends, top = [], 0
            for _, hi, _ in rows:
                top = max(top, hi)
                ends.append(top)
            self.spans[memory] = (rows, [lo for lo, _, _ in rows], ends)

    def _hit(self, t, metadata: bool = False) -> str | None:
        """The path of the protected parameter a write into ``t`` would change (``metadata``:
        a write of ``t``'s sizes and strides only, a change of the parameter itself only)."""
        if not isinstance(t, Tensor):
            return None
        mine = self.params.get(id(t))
        if mine is not None and mine[0] is t:
            return mine[1]
        if metadata:
            return None
        if t.layout != torch.strided:
            # another tensor object over the same bytes (p.data of a sparse parameter)
            return next(filter(None, map(self._hit, _parts(t))), None)
        try:
            memory, lo, hi = _place(t)
        except (RuntimeError, NotImplementedError):  # no storage (some subclasses)
            return None
        found = self.spans.get(memory)
        if found is None or lo == hi:
            return None
        rows, starts, ends = found
        j = bisect.bisect_left(starts, hi) - 1  # spans starting before the write ends
        while j >= 0 and ends[j] > lo:  # some span up to j ends after the write starts
            if rows[j][1] > lo:
                return rows[j][2]
            j -= 1
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        written, metadata = _written_args(func, args, kwargs)
        for arg in written:
            for t in arg if isinstance(arg, (list, tuple)) else (arg,):
                path = self._hit(t, metadata)
                if path is not None:
                    raise RuntimeError(
                        f"constant: {func._schema.name} would modify parameter {path!r} in "
                        "place inside a ts.constant block"
                    )
        return func(*args, **kwargs)


class _RefuseRebind(TorchFunctionMode):
    """Raise before ``p.data = other`` gives a selected parameter other values (a rebinding,
    not an aten write: ``torch.nn.utils.vector_to_parameters``, ``module.double()``), and
    before the in-place methods that reach no aten op (``apply_``, ``map_``, ``map2_``:
    Python functions written element by element; ``share_memory_``: the memory moved, which
    the block could no longer protect) act on a protected one's memory."""

    def __init__(self, chosen: list[tuple[str, Tensor]]) -> None:
        super().__init__()
        self.params = {id(p): (p, path) for path, p in chosen}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", None)
        if name in _UNSEEN_WRITES and args and not _shared_already(name, args[0]):
            with _state.without_stand_ins():  # the parameter's own memory
                path = protected_path([args[0]])
            if path is not None:
                what = "move the memory of" if name == "share_memory_" else "modify"
                raise RuntimeError(
                    f"constant: Tensor.{name} would {what} parameter {path!r} in place inside "
                    "a ts.constant block")
        if name in ("__set__", "__get__"):
            name += getattr(getattr(func, "__self__", None), "__name__", "")
        hit = self.params.get(id(args[0])) if args and name in _REBINDS else None
        if hit is not None and hit[0] is args[0]:
            new, how = _REBINDS[name](args, _caller(sys._getframe(1)))
            with _state.without_stand_ins():  # the parameter's own memory
                same = how is None or _same_data(args[0], new)
            if not same:
                raise RuntimeError(
                    f"constant: {how} would replace the values of parameter {hit[1]!r} inside "
                    "a ts.constant block"
                )
        return func(*args, **(kwargs or {}))

    __torch_function__ = _compile_caveats.only_inlined(__torch_function__)


def _swapped_in(args, frame):
    """A ``requires_grad`` read by ``Module._apply`` on its swap branch (conversions under
    ``set_swap_module_params_on_conversion``, tensor-subclass parameters): what it swaps in."""
    if frame.f_code is not _MODULE_APPLY or not frame.f_locals.get("p_should_use_swap_tensors"):
        return None, None
    return frame.f_locals.get("param_applied"), "a conversion swapping tensors (Module._apply)"


# the ways a parameter's values are replaced without an aten write: name -> (args, caller's
# frame) -> (the new values, how, or None when this call replaces nothing)
_UNSEEN_WRITES = frozenset({"apply_", "map_", "map2_", "share_memory_"})


def _shared_already(name: str, t) -> bool:
    """``share_memory_`` that moves nothing: a storage already shared, or not on the CPU."""
    if name != "share_memory_" or not isinstance(t, Tensor):
        return False
    with torch._C.DisableTorchFunction():
        return t.device.type != "cpu" or t.is_shared()
_REBINDS = {
    "__set__data": lambda args, _: (args[1], "setting .data") if len(args) == 2 else (None, None),
    "module_load": lambda args, _: (args[1] if len(args) > 1 else None,
                                    "load_state_dict swapping tensors (Tensor.module_load)"),
    "__get__requires_grad": _swapped_in,
}
_MODULE_APPLY = nn.Module._apply.__code__


def _same_data(p: Tensor, new) -> bool:
    """``p.data = new`` changes nothing: ``new`` is ``p``'s own memory, seen the same way."""
    if not (isinstance(new, Tensor) and new.device == p.device and new.dtype == p.dtype
            and new.layout == p.layout and new.shape == p.shape):
        return False
    if new.numel() == 0:
        return True
    # a sparse tensor's memory is that of its indices and values (module.float(), .to(device)
    # on a model already there hand the parameter's own data back)
    mine, theirs = _parts(p), _parts(new)
    return bool(mine) and len(mine) == len(theirs) and all(
        a.shape == b.shape and a.stride() == b.stride() and a.data_ptr() == b.data_ptr()
        for a, b in zip(mine, theirs))


def _guards() -> list:
    """This thread's active ``constant`` blocks."""
    return [m for m in _get_current_dispatch_mode_stack() if isinstance(m, _Guard)]


def protected_path(tensors, guards=None) -> str | None:
    """The path of the first of ``tensors`` whose memory a ``constant`` block of this thread
    (or of ``guards``) protects, or None (at once when no block is active)."""
    guards = _guards() if guards is None else guards
    if not guards:
        return None
    for t in tensors:
        path = next(filter(None, (g._hit(t) for g in guards)), None)
        if path is not None:
            return path
    return None


def refuse_constant_writes(what: str, tensors) -> None:
    """Raise before a write of many tensors (one op per group) when a ``constant`` block of
    this thread protects any of them: refused before the first group is written, so nothing
    changes, instead of at the group holding it.

    Raises:
        RuntimeError: naming the protected parameter's path and ``what`` would write it.
    """
    path = protected_path(tensors)
    if path is not None:
        raise RuntimeError(
            f"constant: {what} would write parameter {path!r} inside a ts.constant block; it was "
            "refused before it changed anything"
        )


def _refuse_guarded_step(optimizer, args, kwargs):
    """An optimizer step about to update a parameter a ``constant`` block of this thread
    protects (one with a gradient: the step would write it) is refused before it starts, so
    that its own state (momentum buffers, moments) is not updated either. A step given a
    closure is checked again when the closure returns (the gradients it computed), before the
    step goes on. Registered once for every ``torch.optim.Optimizer``; without an active
    block it returns at once."""
    if not _guards():
        return None
    _refuse_step_of(optimizer)
    # args: (optimizer, closure?) as the step was called
    closure = kwargs["closure"] if "closure" in kwargs else (args[1] if len(args) > 1 else None)
    if closure is None:
        return None

    def checked_closure():
        loss = closure()
        _refuse_step_of(optimizer)
        return loss

    if "closure" in kwargs:
        return args, {**kwargs, "closure": checked_closure}
    return (args[0], checked_closure, *args[2:]), kwargs


def _refuse_step_of(optimizer) -> None:
    guards = _guards()
    if not guards:
        return
    path = protected_path([p for group in optimizer.param_groups for p in group["params"]
                           if p.grad is not None], guards)
    if path is not None:
        raise RuntimeError(
            f"constant: {type(optimizer).__name__}.step would update parameter {path!r} "
            "(it has a gradient) inside a ts.constant block; the step was refused before "
            "it changed anything, the optimizer's state included"
        )


_optimizer.register_optimizer_step_pre_hook(_refuse_guarded_step)


class constant(_Context):
    """Inside the block, the selected parameters are read-only.

    Any in-place change of a selected parameter executed in the block raises ``RuntimeError``
    naming its path, *before* the write, so the parameter is unchanged: in-place methods
    (``add_``, ``copy_``, ``p[0] = 1``), writes through aliases (``p.data.add_``, views),
    ``out=`` arguments, ``torch._foreach_*_`` and therefore optimizer steps. Reads and
    out-of-place operations pass. Protection is by memory: any tensor sharing the
    parameter's memory is protected too. The parameter's memory is taken when the block is
    entered; ``p.data = other`` (``vector_to_parameters``) raises too, unless ``other`` is
    that memory. Writes that bypass PyTorch's operators (a NumPy array on the memory) and
    replacing the module's parameter object (``load_state_dict(assign=True)``) are not seen.

    Arguments:
        model: the module whose parameters are selected.
        *selectors: which parameters (see :func:`~torchstruct.select`); none means all of
            ``model``.
        strict: when True (default) a selector that matches nothing raises.

    Returns:
        The context (use with ``with``, as a decorator, or call it bare to apply from now on).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, a selector has an unsupported type, or
            ``strict`` is not a bool.
        ValueError: a selector matching nothing (naming the closest paths).
        RuntimeError: (inside the block) an operation that would write a selected parameter.

    Example:
        >>> import torch, torch.nn as nn, torchstruct as ts
        >>> m = nn.Linear(2, 1)
        >>> with ts.constant(m, "bias"):
        ...     m.weight.data.zero_()  # not selected: allowed
        ...     try:
        ...         m.bias.data.add_(1)
        ...     except RuntimeError as e:
        ...         print(e)
        tensor([[0., 0.]])
        constant: aten::add_ would modify parameter 'bias' in place inside a ts.constant block
    """

    def __init__(self, model: nn.Module, *selectors, strict: bool = True) -> None:
        super().__init__(model, *selectors, strict=strict)

    @run_eagerly
    def _apply(self) -> None:
        model, *selectors = self._args
        refuse_while_exporting("ts.constant")
        _check_model("constant", model)
        check_bool(self._kwargs["strict"], "strict", "constant")
        chosen = select(model, *(selectors or [model]), strict=self._kwargs["strict"])
        refuse_lazy("constant", chosen)  # no memory to protect yet
        with _state.without_stand_ins():  # the parameters' own memory, not a swap's stand-ins
            mode, rebind = _Guard(chosen), _RefuseRebind(chosen)
        _compile_caveats.warn_once()
        rebind.__enter__()
        mode.__enter__()
        self._mode, self._rebind = mode, rebind

    @run_eagerly
    def _undo(self) -> None:
        stack = _get_current_dispatch_mode_stack()
        if not stack or stack[-1] is not self._mode:
            self._active = True  # nothing changed: still active
            if not any(m is self._mode for m in stack):
                raise RuntimeError(_not_here(self))
            raise RuntimeError(
                "constant: a dispatch mode entered after this block is still active; exit "
                "blocks in reverse order of entry (as `with` does)"
            )
        self._mode.__exit__(None, None, None)
        _leave(self, self._rebind)
        _compile_caveats.warn_once()  # code compiled inside the block, unseen there

    def _above(self) -> list:
        return (_modes_above(_FUNCTION_MODES, self._rebind)
                + _modes_above(_DISPATCH_MODES, self._mode))

    def _sink_below(self, items: list) -> None:
        _sink_mode(_FUNCTION_MODES, self._rebind, items)
        _sink_mode(_DISPATCH_MODES, self._mode, items)

    def _suspend(self) -> None:
        # the dispatch modes the body entered after this block and holds are set aside while
        # it exits (which takes its own mode off the top), then put back in their order
        stack = _get_current_dispatch_mode_stack()
        at = next((i for i, m in enumerate(stack) if m is self._mode), len(stack) - 1)
        above = [_pop_mode() for _ in range(len(stack) - at - 1)][::-1]
        try:
            self.__exit__(None, None, None)
        finally:
            for m in above:
                _push_mode(m)
