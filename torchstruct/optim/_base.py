"""The masked-step base shared by ``torchstruct.optim.SGD`` and ``AdamW``.

A step, in order:

1. **Plan and check** (nothing is written yet): walk the param groups, keep the
   parameters that will be stepped -- ``requires_grad`` true and a ``.grad`` --
   each tensor once (a tied parameter listed in several places is stepped at its
   first place), and check the hyper-parameters of every group, the gradients
   (dense, a supported dtype), the parameters (dense, no two of one group sharing
   memory) and the masks (shape, dtype, device). Any problem
   raises here, naming the parameter, before any parameter or state changes.
   (Every device has an implementation: a device without compiled kernels runs
   PyTorch's fused ops, see ``torchstruct._ops``.) The plain case is decided in
   C++ (``torchstruct._C.step_plan``), anything else by the checked Python plan.
2. **AMP**: ``self.grad_scale`` / ``self.found_inf`` as ``torch.amp.GradScaler``
   sets them on optimizers with ``_step_supports_amp_scaling``. A ``found_inf``
   on the CPU is read on the host: when set, the step is skipped before any
   state exists (as torch skips its step). On an accelerator it goes to the
   kernels, which skip the update on the device without a host sync.
3. **Clip**: with ``max_grad_norm``, one pass over the gradients of the stepped
   parameters (all groups together) gives the global norm (divided by the grad
   scale), kept as ``last_grad_norm`` once step 4's checks pass; the coefficient
   ``clamp(max_grad_norm / (norm + 1e-6), max=1)`` stays a tensor and is
   applied inside the update kernel. Gradients are never written.
4. **Update**: the op calls of every param group (one per group and device)
   are built -- missing state created, state that no longer fits its parameter
   converted -- and the input of all of them checked before the first runs; a
   refusal (or an interruption) undoes every state write of the step. Each call
   then updates parameters and state in one pass, advancing the version counter
   of every tensor it writes.

Parameters that are frozen at step time (``requires_grad`` false) are never
read or written and get no ``optimizer.state`` entry, even with a stale
``.grad`` and weight decay.

A param group may carry ``lr_scale`` (default 1, a finite number >= 0): it steps
with ``lr * lr_scale``, so an LR scheduler rewriting ``lr`` keeps the ratios
between groups. A group with ``lr_scale == 0`` is skipped like a frozen
parameter: not read, not written, no new state, no step count, not part of the
``max_grad_norm`` norm.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Dict, List, Optional

import torch

from .. import _dtensor, _ops, _reference, _state
from .._checks import as_real, describe
from .._reference import (FLOAT_DTYPES, _is_non_overlapping_and_dense, _place, validate_max_norm,
                          result_dtype, validate_norm_type)
from ..select import _closest

__all__ = ["MaskedOptimizer"]


def _number(value, what: str) -> float:
    """A hyper-parameter as a float: a real number or a one-element real tensor, as
    ``_checks.as_real`` reads one, or a bool, which torch's optimizers read as 0 or 1 (so these
    do too, as drop-ins); ``ValueError`` otherwise, as torch's optimizers raise for an invalid
    hyper-parameter (text too, which ``float()`` would read and an LR scheduler would then fail
    on much later)."""
    number = float(value) if isinstance(value, bool) else as_real(value)
    if number is None:
        raise ValueError(f"{what} must be a number, got {describe(value)}")
    return number


def _max_grad_norm(value, name: str) -> Optional[float]:
    """``max_grad_norm`` checked as ``clip_by_global_norm`` checks ``max_norm``: None, or a
    number >= 0 (``ValueError`` otherwise; a string too, as for any hyper-parameter of a
    torch optimizer)."""
    if value is None:
        return None
    return validate_max_norm(value, f"{name}: max_grad_norm", text=False)


def _lr_scale(group: dict, where: str) -> float:
    """The group's ``lr_scale`` (default 1), checked: a finite number >= 0."""
    scale = group.get("lr_scale", 1.0)
    if isinstance(scale, bool):  # not torch's: a flag written in the wrong place
        raise ValueError(f"{where}: lr_scale must be a number, got {scale!r}")
    value = _number(scale, f"{where}: lr_scale")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{where}: lr_scale must be a finite number >= 0, got {scale!r}")
    return value


def _scaled_lr(group: dict) -> float:
    """The learning rate a group steps with: ``lr * lr_scale``."""
    scale = group.get("lr_scale", 1.0)
    return float(group["lr"]) if scale == 1 else float(group["lr"]) * float(scale)


def _same_device(a: torch.Tensor, b: torch.Tensor) -> bool:
    # is_cpu first: no torch.device object per tensor in the common case
    return b.is_cpu if a.is_cpu else a.device == b.device


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    sa, sb = a.stride(), b.stride()
    return sa == sb or all(n <= 1 or x == y for n, x, y in zip(a.shape, sa, sb))


def _like(p: torch.Tensor, t: torch.Tensor, dtype=None) -> torch.Tensor:
    """``t`` laid out like ``p`` (a copy when the strides differ)."""
    if _same_layout(t, p):
        return t
    out = torch.empty_like(p, dtype=dtype if dtype is not None else t.dtype)
    out.copy_(t)
    return out


def _grads_of(params: list) -> list:
    """The gradients of ``params`` as the kernels take them: one laid out unlike its
    parameter is copied into the parameter's layout (the norm is the same either way)."""
    # (in C++ unless a torch function mode could answer the .grad reads, as in the plan)
    if (_ops._C is not None and not _ops._is_compiling()
            and not torch._C._len_torch_function_stack()):
        grads = _ops._C.grads_of(params)  # None when one needs a copy
        if grads is not None:
            return grads
    out = []
    for p in params:  # (a plain loop: dynamo cannot trace an assignment in a comprehension)
        g = p.grad
        out.append(g if g.stride() == p.stride() else _like(p, g))
    return out


_MISSING = object()  # no state value there before (see MaskedOptimizer._write_state)


_MASK_KEY = "torchstruct_mask"  # a mask carried in its parameter's state_dict() "state" entry


def _unwrapped(name):
    """A parameter path without the prefixes wrappers add: ``_orig_mod.`` (``torch.compile``,
    also of a submodule) anywhere, ``module.`` (DDP, DataParallel) in front."""
    if not isinstance(name, str):
        return name
    parts = [part for part in name.split(".") if part != "_orig_mod"]
    while len(parts) > 1 and parts[0] == "module":
        parts.pop(0)
    return ".".join(parts)


def _mask_of(value):
    """A carried mask as saved; as bool when a torch optimizer's ``load_state_dict`` cast it to
    the parameter's floating dtype on the way (exact: its values are 0 and 1)."""
    if (isinstance(value, torch.Tensor) and value.is_floating_point() and not value.is_meta
            and bool(((value == 0) | (value == 1)).all())):
        return value != 0
    return value


def _same_mask(a, b) -> bool:
    """Whether two saved masks (or Nones) are the same."""
    if a is b:
        return True
    if a is None or b is None:
        return a is None and b is None
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and torch.equal(a.cpu(), b.cpu()))



def _shape_text(p: torch.Tensor) -> str:
    """``shape (2, 3)``, or what a lazy parameter before its first forward is."""
    if torch.nn.parameter.is_lazy(p):
        return "an uninitialized lazy parameter"
    return f"shape {tuple(p.shape)}"


def _overflowed_on_cpu(total: torch.Tensor, grads: list) -> bool:
    """The compiled kernels sum float32 squares in float32 lanes: a scaled gradient's squares
    (past ~1.8e19) may overflow there where the float64 sum fits. On the CPU (where reading
    the result costs no device sync) a norm that came out inf or NaN is taken again in float64
    (:mod:`torchstruct._reference`: exact, and inf or NaN again only if a gradient is)."""
    return (not torch.compiler.is_compiling() and total.device.type == "cpu"
            and not bool(torch.isfinite(total)) and all(type(g) is torch.Tensor for g in grads))


class MaskedOptimizer(torch.optim.Optimizer):
    """Base of the fused optimizers: planning, checks, masks, clip, AMP.

    Subclasses set ``_op`` (the ``torchstruct._ops`` op name), implement
    ``_check_group(index, group)`` (raise ``ValueError`` for bad
    hyper-parameters) and ``_update(group, params, grads, masks, clip_coef,
    grad_scale, found_inf)`` (create missing state, call the op; ``masks`` is
    empty, or one bool tensor or None per parameter).
    """

    _op = ""
    # the group options and (in a non-empty state entry) the state keys a step reads: a
    # state dict without them is refused by load_state_dict
    _group_keys: tuple = ("lr",)
    _state_keys: tuple = ()
    # torch.amp.GradScaler.step: set grad_scale / found_inf and call step().
    _step_supports_amp_scaling = True
    # torch.optim group options these optimizers do not offer -> the value they step as:
    # a group added with another value is refused; so is a loaded one, for the options that
    # change the update (``differentiable``; AdamW's ``decoupled_weight_decay``), while the
    # others (how torch runs its step) load as torch's state dicts carry them, and are ignored
    _fixed_options: dict = {"foreach": None, "fused": None, "capturable": False,
                            "differentiable": False}
    _changes_update: frozenset = frozenset({"differentiable", "decoupled_weight_decay"})

    def __init__(self, params, defaults: dict, *, masks=None, max_grad_norm=None,
                 norm_type: float = 2.0, foreach=None, fused=None):
        name = type(self).__name__
        for flag, value in (("foreach", foreach), ("fused", fused)):
            if value is not None:
                raise TypeError(
                    f"{name}: {flag}= is not an option here: torchstruct's optimizers always "
                    f"update each param group in one fused pass (compiled kernels, or PyTorch's "
                    f"own multi-tensor ops on a device without them); drop {flag}={value!r}")
        lr = _number(defaults["lr"], f"{name}: lr")
        if math.isnan(lr) or lr < 0:
            raise ValueError(f"{name}: lr must be >= 0, got {defaults['lr']!r}")
        max_grad_norm = _max_grad_norm(max_grad_norm, name)
        norm_type = validate_norm_type(norm_type)
        super().__init__(params, defaults)  # each group checked by add_param_group
        #: the global-norm clip threshold (None: no clipping)
        self.max_grad_norm: Optional[float] = max_grad_norm
        #: the order of that norm
        self.norm_type: float = norm_type
        #: the total gradient norm of the last step (0-dim tensor, unscaled), or None
        self.last_grad_norm: Optional[torch.Tensor] = None
        #: element masks, {param: bool tensor}; see set_mask
        self.masks: Dict[torch.Tensor, torch.Tensor] = {}
        # ids of the parameters whose existing state was checked since construction or loading
        self._checked_state: set = set()
        if masks is not None and not isinstance(masks, Mapping):
            raise TypeError(f"{type(self).__name__}: masks must be a dict {{parameter or path: "
                            f"bool tensor}}, got a {type(masks).__name__}")
        if masks:
            checked = {}
            for p, mask in masks.items():
                p = self._param_named(p)
                self._check_mask(p, mask, require_member=True)
                checked[p] = mask
            self.masks.update(checked)

    def __getstate__(self):
        """torch's (defaults, state, param groups), plus the clip and the masks: a deepcopy or
        pickle of the optimizer keeps clipping and masking as the original does."""
        state = super().__getstate__()
        state.update(max_grad_norm=self.max_grad_norm, norm_type=self.norm_type,
                     masks=self.masks, last_grad_norm=self.last_grad_norm)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("max_grad_norm", None)
        self.__dict__.setdefault("norm_type", 2.0)
        self.__dict__.setdefault("last_grad_norm", None)
        self.__dict__.setdefault("masks", {})
        self._checked_state = set()  # loaded state: converted at its first step
        for group in self.param_groups:
            group.setdefault("maximize", False)

    # -- masks -------------------------------------------------------------

    def set_mask(self, param: torch.Tensor, mask: Optional[torch.Tensor]) -> None:
        """Restrict the updates of ``param`` to the elements where ``mask`` is True
        (a bool tensor of ``param``'s shape, on its device); ``None`` removes the
        mask. Masked-out elements, and their state, stay bitwise unchanged.
        ``param`` may be given by its path when the param groups carry
        ``param_names`` (``ts.param_groups``, ``named_parameters()``)."""
        param = self._param_named(param)
        if mask is None:
            self._check_member(param)
            self.masks.pop(param, None)
            return
        self._check_mask(param, mask, require_member=True)
        self.masks[param] = mask

    def _param_named(self, key):
        """``key`` itself, or the parameter whose ``param_names`` entry is ``key`` (a str)."""
        if not isinstance(key, str):
            return key
        names, found = [], []
        for group in self.param_groups:
            for name, p in zip(group.get("param_names", ()), group["params"]):
                if name == key and not any(p is q for q in found):
                    found.append(p)
                names.append(name)
        if len(found) == 1:
            return found[0]
        if found:
            raise ValueError(f"{type(self).__name__}: masks: {key!r} names {len(found)} "
                             f"parameters of this optimizer (param groups of several models); "
                             f"give the parameter itself")
        if not names:
            raise ValueError(f"{type(self).__name__}: masks: {key!r} names no parameter: the "
                             f"param groups carry no param_names (build them with "
                             f"ts.param_groups or from named_parameters())")
        raise ValueError(f"{type(self).__name__}: masks: {key!r} names no parameter of this "
                         f"optimizer (a tied parameter goes by its first path, as "
                         f"named_parameters() lists it); closest: {_closest(key, names)}")

    # -- state_dict: the masks travel with the state -------------------------

    @torch._disable_dynamo
    def state_dict(self):
        """torch's optimizer state dict, plus ``"masks"``: ``{index: bool tensor}`` keyed
        by the same parameter indices as ``"state"``, so a resumed run needs no ``masks=``.
        The mask of a parameter that has state is also in its ``"state"`` entry (under
        ``"torchstruct_mask"``), which tools that keep only ``"state"`` and
        ``"param_groups"`` (``torch.distributed.checkpoint.state_dict``) carry along. The
        masks are added before the registered ``state_dict`` post-hooks run: they see, and may
        change, the finished state dict."""

        def add_masks(_, out):  # registered first: every post-hook sees the masks
            order = self._param_order()
            out["masks"] = {order[id(p)]: m for p, m in self.masks.items() if id(p) in order}
            state = out["state"]
            for k, mask in out["masks"].items():
                if k in state:  # a new dict: the entry is the optimizer's own
                    state[k] = {**state[k], _MASK_KEY: mask}
            return out

        handle = self.register_state_dict_post_hook(add_masks, prepend=True)
        try:
            return super().state_dict()
        finally:
            handle.remove()

    @torch._disable_dynamo
    def load_state_dict(self, state_dict) -> None:
        """torch's ``load_state_dict``, after checking (on the state dict the registered
        ``load_state_dict`` pre-hooks return) the saved masks (bool, the parameter's shape;
        moved to its device), the shapes of the saved per-element state against the
        parameters, the option and state keys this optimizer needs (a state dict of another
        optimizer type is refused) and, where both sides carry ``param_names``, that the
        saved names are this optimizer's: on any error nothing is changed. The masks are
        those under ``"masks"``, else those carried in the ``"state"`` entries; a state dict
        with neither (e.g. from ``torch.optim``) keeps the current masks. The masks are in
        place before the registered ``load_state_dict`` post-hooks run."""
        loaded = []

        def check(_, hooked):  # registered last: it sees what the other pre-hooks return
            masks, hooked = self._checked_load(hooked)
            loaded.append(masks)
            return hooked

        def set_masks(_):  # registered first: every post-hook sees the loaded masks
            if loaded and loaded[0] is not None:
                self.masks = loaded[0]

        handles = [self.register_load_state_dict_pre_hook(check),
                   self.register_load_state_dict_post_hook(set_masks, prepend=True)]
        try:
            super().load_state_dict(state_dict)
        finally:
            for handle in handles:
                handle.remove()

    def _checked_load(self, state_dict):
        """(the saved masks, or None to keep the current ones; the state dict to load, the
        masks carried in its ``"state"`` entries taken out), all checked; ``(None,
        state_dict)`` when the groups do not match (torch's own check raises)."""
        by_index = self._saved_index(state_dict)
        if by_index is None:
            return None, state_dict
        self._check_saved_groups(state_dict["param_groups"])
        state, carried = self._saved_state(state_dict.get("state", {}), by_index)
        masks = self._saved_masks(state_dict, by_index, carried, state)
        if carried:
            state_dict = {**state_dict, "state": state}
        return masks, state_dict

    def _check_saved_groups(self, saved: list) -> None:
        """The saved groups carry the options this optimizer needs and, where both sides
        have ``param_names``, the same names (wrapper prefixes aside); ``ValueError``."""
        name = type(self).__name__
        for gi, (sg, group) in enumerate(zip(saved, self.param_groups)):
            self._refuse_options(sg, f"load_state_dict: saved param group {gi}",
                                 self._changes_update.intersection(self._fixed_options),
                                 ValueError)
            missing = [k for k in self._group_keys if k not in sg]
            if missing:
                raise ValueError(
                    f"{name}: load_state_dict: saved param group {gi} has no {missing[0]!r} "
                    f"(it has {sorted(k for k in sg if k != 'params')}): a state dict of "
                    f"another optimizer type? {name} needs {', '.join(self._group_keys)}")
            ours, theirs = group.get("param_names"), sg.get("param_names")
            if not isinstance(ours, list) or not isinstance(theirs, list):
                continue  # no names on one side: by position, as torch loads
            for j, (a, b) in enumerate(zip(theirs, ours)):
                if _unwrapped(a) != _unwrapped(b):
                    raise ValueError(
                        f"{name}: load_state_dict: saved param group {gi}, position {j} is "
                        f"{a!r} but this optimizer's is {b!r}: the state would load into "
                        f"another parameter (map the saved state by param_names with a "
                        f"register_load_state_dict_pre_hook)")

    def _saved_state(self, saved, by_index) -> tuple:
        """(the saved ``"state"`` without the carried masks, {index: carried mask}), each
        entry checked: the state keys this optimizer needs, per-element shapes."""
        name = type(self).__name__
        state, carried = {}, {}
        for k, entry in dict(saved).items():
            p = by_index.get(k)
            if p is None or not isinstance(entry, dict):
                state[k] = entry
                continue
            if _MASK_KEY in entry:
                entry = dict(entry)
                carried[k] = _mask_of(entry.pop(_MASK_KEY))
            missing = [key for key in self._state_keys if key not in entry]
            if entry and missing:
                raise ValueError(
                    f"{name}: load_state_dict: the saved state of {self._label(p)} has no "
                    f"{missing[0]!r} (it has {sorted(entry)}): a state dict of another "
                    f"optimizer type?")
            if entry and torch.nn.parameter.is_lazy(p):
                raise ValueError(
                    f"{name}: load_state_dict: {self._label(p)}: the saved state cannot be "
                    f"checked against a parameter whose shape is not known yet; run one "
                    f"forward of the model before loading the optimizer's state")
            for key, value in entry.items():
                # every tensor but the step counter is per element (a 0-dim one would broadcast)
                if isinstance(value, torch.Tensor) and key != "step" and value.shape != p.shape:
                    raise ValueError(f"{name}: load_state_dict: state {key!r} of "
                                     f"{self._label(p)} has shape {tuple(value.shape)}")
            state[k] = entry
        return state, carried

    def _saved_masks(self, state_dict, by_index, carried, state):
        """{param: mask} from ``"masks"``, else from the masks carried in the ``"state"``
        entries, checked; None when there are neither. Where both are there, they must agree
        on every parameter with a state entry."""
        name = type(self).__name__
        if "masks" in state_dict:
            saved = state_dict["masks"]
            if not isinstance(saved, dict):
                raise ValueError(f"{name}: load_state_dict: 'masks' must be a dict, got "
                                 f"{type(saved).__name__}")
        elif carried:
            saved = carried
        else:
            return None
        masks = {}
        for k, mask in saved.items():
            p = by_index.get(k)
            if p is None:
                raise ValueError(f"{name}: load_state_dict: a mask for parameter index "
                                 f"{k!r}, which the saved param groups do not list")
            if isinstance(mask, torch.Tensor) and mask.device != p.device:
                mask = mask.to(p.device)
            self._check_mask(p, mask)
            masks[p] = mask
        if carried and saved is not carried:
            for k in state:
                if not _same_mask(saved.get(k), carried.get(k)):
                    raise ValueError(
                        f"{name}: load_state_dict: the saved 'masks' and the mask in the saved "
                        f"state of {self._label(by_index[k])} disagree (a pre-hook that "
                        f"remapped 'state' but not 'masks'?)")
        if saved is carried:
            # the masks the state entries carry speak for their parameters only: a parameter
            # with no saved state (never stepped: frozen so far) keeps the mask it has here
            entries = {by_index[k] for k, entry in state.items()
                       if k in by_index and isinstance(entry, dict)}
            kept = {p: m for p, m in self.masks.items() if p not in entries}
            masks = {**kept, **masks}
        return masks

    def _param_order(self) -> Dict[int, int]:
        """id(param) -> its index in a state dict, numbered as ``torch.optim.Optimizer.
        state_dict`` numbers it (its ``"state"`` keys and packed ``"params"``): positions
        count on through the groups; a parameter listed more than once in a group gets its
        LAST position there, and one already numbered in an earlier group keeps that index.
        ``"masks"`` and the masks carried in ``"state"`` are keyed by it, so
        ``_saved_index`` (torch's ``load_state_dict`` mapping) reads each back to its
        parameter."""
        order: Dict[int, int] = {}
        start = 0
        for group in self.param_groups:
            params = group["params"]
            # torch's own expression: the filter reads the mapping as it was before this group,
            # so within the group a later position of the same tensor overwrites an earlier one
            order.update({id(p): i for i, p in enumerate(params, start) if id(p) not in order})
            start += len(params)
        return order

    def _saved_index(self, state_dict) -> Optional[Dict[int, torch.Tensor]]:
        """saved parameter index -> parameter, or None when the groups do not match."""
        saved = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if not isinstance(saved, list) or len(saved) != len(self.param_groups):
            return None
        out = {}
        for sg, group in zip(saved, self.param_groups):
            ids = sg.get("params") if isinstance(sg, dict) else None
            if not isinstance(ids, list) or len(ids) != len(group["params"]):
                return None
            out.update(zip(ids, group["params"]))
        return out

    def add_param_group(self, param_group: dict) -> None:
        """``torch.optim.Optimizer.add_param_group``, refusing complex parameters (the fused
        steps have no complex arithmetic; torch's optimizers step them as real views) and
        bad hyper-parameters (``ValueError`` naming the group; nothing is added)."""
        params = param_group["params"]
        if not isinstance(params, (torch.Tensor, set)):  # a set: torch's own error follows
            param_group["params"] = params = list(params)  # a generator is read once, here
        names = param_group.get("param_names")
        params = [params] if isinstance(params, torch.Tensor) else params
        for j, p in enumerate(params):
            if isinstance(p, torch.Tensor) and p.is_complex():
                label = repr(names[j]) if names is not None and j < len(names) else (
                    f"{j} of param group {len(self.param_groups)}")
                raise TypeError(
                    f"{type(self).__name__}: parameter {label} is complex ({p.dtype}); "
                    "torchstruct's optimizers support float32, float64, float16 and bfloat16 "
                    "parameters (use torch.optim for complex ones, or train a real view: "
                    "torch.view_as_real)")
        self._refuse_options(param_group, f"param group {len(self.param_groups)}",
                             self._fixed_options)
        super().add_param_group(param_group)
        try:  # the group as it will step (defaults filled in)
            self._check_group(len(self.param_groups) - 1, self.param_groups[-1])
        except Exception:
            self.param_groups.pop()
            raise

    def _refuse_options(self, group: dict, where: str, options, error=TypeError) -> None:
        """``error`` for a group setting one of ``options`` (names of ``_fixed_options``) to
        another value than these optimizers step as (any true one for a False or None)."""
        for key in options:
            fixed = self._fixed_options[key]
            if key in group and (bool(group[key]) if fixed in (None, False)
                                 else group[key] != fixed):
                how = "" if fixed is None else f"; it always steps as {key}={fixed!r}"
                raise error(
                    f"{type(self).__name__}: {where} sets {key}={group[key]!r}, which this "
                    f"optimizer does not offer{how} (see 'Not offered' in docs/optimizers.md). "
                    "Nothing was changed.")

    def _label(self, param: torch.Tensor) -> str:
        shape = _shape_text(param)
        for gi, group in enumerate(self.param_groups):
            for j, p in enumerate(group["params"]):
                if p is param:
                    names = group.get("param_names")
                    if names is not None and j < len(names):
                        return f"parameter {names[j]!r} ({shape})"
                    return f"parameter {j} of param group {gi} ({shape})"
        return f"a tensor ({shape}) that is not a parameter of this optimizer"

    def _check_member(self, p) -> None:
        """A mask's key: a parameter of this optimizer."""
        name = type(self).__name__
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"{name}: masks must be keyed by parameters, got a {type(p).__name__}")
        if not any(q is p for g in self.param_groups for q in g["params"]):
            raise ValueError(f"{name}: masks: {self._label(p)}")

    def _check_mask(self, p, mask, require_member=False) -> None:
        name = type(self).__name__
        if require_member:
            self._check_member(p)
        elif not isinstance(p, torch.Tensor):
            raise ValueError(f"{name}: masks must be keyed by parameters, got a {type(p).__name__}")
        label = self._label(p)
        if torch.nn.parameter.is_lazy(p):
            raise ValueError(f"{name}: {label}: its shape is not known before its module's "
                             f"first forward, so no mask can be checked against it; give "
                             f"its mask after that forward (optimizer.set_mask)")
        if not isinstance(mask, torch.Tensor):
            raise ValueError(f"{name}: the mask of {label} is a {type(mask).__name__}, "
                             f"not a bool tensor")
        if mask.dtype != torch.bool:
            raise ValueError(f"{name}: the mask of {label} has dtype {mask.dtype}; "
                             f"masks must be torch.bool")
        if mask.shape != p.shape:
            raise ValueError(f"{name}: the mask of {label} has shape {tuple(mask.shape)}; "
                             f"it must have the parameter's shape {tuple(p.shape)}")
        if mask.device != p.device:
            raise ValueError(f"{name}: the mask of {label} is on {mask.device} but the "
                             f"parameter is on {p.device}")
        if mask.layout != torch.strided:
            raise ValueError(f"{name}: the mask of {label} must be a dense tensor")
        problem = _dtensor.mask_problem(p, mask)
        if problem:
            raise ValueError(f"{name}: the mask of {label} {problem}")

    # -- the step ----------------------------------------------------------

    def _check_group(self, index: int, group: dict) -> None:
        lr = _number(group["lr"], f"{type(self).__name__}: param group {index}: lr")
        if math.isnan(lr) or lr < 0:
            raise ValueError(f"{type(self).__name__}: param group {index}: lr must be >= 0, "
                             f"got {group['lr']!r}")
        _lr_scale(group, f"{type(self).__name__}: param group {index}")

    # Eager also under torch.compile: dynamo guards the parameters it reaches through
    # param_groups by identity only, so flags read in a compiled plan would be baked in. The
    # compiled rest of the step resumes on the plan and is guarded on it.
    @_ops.run_eagerly
    def _plan(self) -> List[tuple]:
        """[(group, params)] of what this step updates; raises (before any write)
        on bad input. Flags are the parameters' own, also inside a ``stop_gradient`` block
        (where ``p.requires_grad`` reads the stand-in's False)."""
        swapped = _state.replaced(p for g in self.param_groups for p in g["params"])
        if swapped:
            raise RuntimeError(
                f"{type(self).__name__}: step() inside a swap block that replaces "
                f"{self._label(swapped[0])}: the step would read and write the stand-ins for "
                f"some tensors and the parameters for others. Step outside the block (or "
                f"build an optimizer over the swapped-in tensors)")
        with _state.without_stand_ins():
            return self._plan_now()

    def _plan_now(self) -> List[tuple]:
        plan = self._plan_fast()
        return plan if plan is not None else self._plan_checked()

    def _plan_fast(self) -> Optional[List[tuple]]:
        """The plan found in C++ (``torchstruct._C.step_plan``), or None when the input needs
        the checked path below (DTensors and other tensor subclasses, a problem to report,
        a torch function mode that could answer ``.grad`` reads)."""
        if _ops._C is None or torch._C._len_torch_function_stack():
            return None
        groups = self.param_groups
        for index, group in enumerate(groups):
            self._check_group(index, group)
        stepped = _ops._C.step_plan(
            [() if group.get("lr_scale", 1.0) == 0 else group["params"] for group in groups],
            torch.nn.Parameter)
        if stepped is None:
            return None
        plan = [(group, params) for group, params in zip(groups, stepped) if params]
        if self.masks:
            ids = {id(p) for _, params in plan for p in params}
            for p, mask in self.masks.items():
                if id(p) in ids:
                    self._check_mask(p, mask)
        return plan

    def _plan_checked(self) -> List[tuple]:
        name = type(self).__name__
        masks = self.masks
        seen = set()
        plan = []
        for index, group in enumerate(self.param_groups):
            self._check_group(index, group)
            if group.get("lr_scale", 1.0) == 0:
                continue  # a group scaled to 0 is skipped like a frozen parameter
            params = []
            spans = []  # (memory, first byte, end byte, parameter): each memory once per call
            # the memory is a DTensor's local shard (the DTensor itself has none)
            shards = _dtensor.locals_(group["params"])
            for p, shard in zip(group["params"], shards):
                g = p.grad
                if g is None or not p.requires_grad or id(p) in seen:
                    continue  # no gradient, frozen, or already stepped (tied)
                seen.add(id(p))
                if shard.numel():
                    memory, lo, hi = _place(shard)
                    spans.append((memory, lo, hi, p))
                if not shard.is_contiguous() and not _is_non_overlapping_and_dense(shard):
                    raise RuntimeError(
                        f"{name}: {self._label(p)} is not dense (it overlaps itself or has "
                        f"gaps, e.g. an expanded tensor); call .contiguous() first")
                if g.layout != torch.strided:
                    raise RuntimeError(
                        f"{name}: {self._label(p)} has a sparse gradient ({g.layout}); "
                        f"sparse gradients are not supported (densify them, or use "
                        f"torch.optim.SparseAdam)")
                dtype = p.dtype
                if dtype not in FLOAT_DTYPES:
                    raise TypeError(f"{name}: {self._label(p)} has dtype {dtype}; supported "
                                    f"are float32, float64, float16 and bfloat16")
                if g.dtype != dtype or g.shape != p.shape or not _same_device(p, g):
                    raise RuntimeError(
                        f"{name}: the gradient of {self._label(p)} has dtype {g.dtype}, shape "
                        f"{tuple(g.shape)} on {g.device}; expected the parameter's "
                        f"{dtype}, {tuple(p.shape)} on {p.device}")
                if masks:
                    mask = masks.get(p)
                    if mask is not None:
                        self._check_mask(p, mask)
                params.append(p)
            if params:
                plan.append((group, params))
            self._refuse_shared(spans)
        return plan

    def _refuse_shared(self, spans: list) -> None:
        """Two parameters of one group whose bytes overlap (the same tensor's memory, or views
        that partly overlap) would be stepped twice there: refused."""
        by_memory: dict = {}
        for memory, lo, hi, p in spans:
            by_memory.setdefault(memory, []).append((lo, hi, p))
        for same in by_memory.values():
            same.sort(key=lambda s: s[:2])
            for a, b in zip(same, same[1:]):
                if b[0] < a[1]:
                    raise RuntimeError(
                        f"{type(self).__name__}: {self._label(b[2])} shares its memory with "
                        f"{self._label(a[2])} in one param group; each tensor may be stepped "
                        f"once per step")

    def _amp(self):
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if grad_scale is not None and not isinstance(grad_scale, torch.Tensor):
            grad_scale = torch.tensor(float(grad_scale), dtype=torch.float32)
        if found_inf is not None and not isinstance(found_inf, torch.Tensor):
            found_inf = torch.tensor(float(found_inf), dtype=torch.float32)
        if grad_scale is not None and grad_scale.dtype != torch.float32:
            grad_scale = grad_scale.float()
        if found_inf is not None and found_inf.dtype != torch.float32:
            found_inf = found_inf.float()
        return grad_scale, found_inf

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every trainable parameter that has a gradient; returns the
        closure's loss (the closure runs with gradients enabled). A step that raises drops
        ``grad_scale`` / ``found_inf`` (``GradScaler.step`` deletes them only after a step
        that returns): a retried ``scaler.step`` would otherwise unscale twice."""
        try:
            return self._step(closure)
        except BaseException:
            self.__dict__.pop("grad_scale", None)
            self.__dict__.pop("found_inf", None)
            raise

    def _step(self, closure):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # the attribute may have been rewritten since construction: checked before any write
        max_grad_norm = _max_grad_norm(self.max_grad_norm, type(self).__name__)
        plan = self._plan()
        grad_scale, found_inf = self._amp()

        grads = [_grads_of(params) for _, params in plan]
        clip_coef = total = None
        if max_grad_norm is not None:
            every = [g for part in grads for g in part]
            if every:
                if grad_scale is None:
                    total = _ops.global_norm(every, self.norm_type)
                else:  # the norm of the unscaled gradients: the scaled one taken in float64
                    # (an empty float64 entry), as it may not fit the gradients' dtype
                    wide = every + [torch.empty(0, dtype=torch.float64, device=every[0].device)]
                    total = _ops.global_norm(wide, self.norm_type)
                    if _overflowed_on_cpu(total, every):
                        total = _reference.global_norm(wide, self.norm_type)
                    inv = grad_scale.double().reciprocal().float().to(total.device)
                    total = (total * inv.double()).to(result_dtype(every))
                clip_coef = torch.clamp(max_grad_norm / (total + 1e-6), max=1.0)
            else:
                total = torch.zeros(())

        if found_inf is not None and found_inf.device.type == "cpu":
            if found_inf.item() != 0:
                if total is not None:
                    self._remember_norm(total)
                return loss  # skipped, as torch skips it: nothing else changes
            found_inf = None

        calls = self._calls(plan, grads, clip_coef, grad_scale, found_inf)
        if total is not None:
            self._remember_norm(total)
        _ops.run_step_calls(calls)
        return loss

    def _calls(self, plan, grads, clip_coef, grad_scale, found_inf) -> list:
        """Every op call of this step (``_ops.StepCall``), the input of all of them checked:
        nothing is written yet but state. State a parameter lacks is created here, and
        existing state that no longer fits its parameter (loaded from elsewhere, or the
        parameter's dtype, device or memory layout changed since) is converted, and the calls
        checked once more; on a refusal (or an interruption) every state write of the step is
        undone."""
        for last in (False, True):
            log: list = []
            try:
                calls = []
                for (group, params), part in zip(plan, grads):
                    masks = [self._mask_for(p) for p in params] if self.masks else []
                    calls += self._update(group, params, part, masks, clip_coef, grad_scale,
                                          found_inf, log)
                _ops.check_step_calls(calls)
                return calls
            except BaseException as err:
                self._undo(log)
                self._checked_state.clear()  # at the next try: every state converted to fit
                if last or not isinstance(err, Exception):
                    raise
        raise AssertionError("unreachable")

    def _write_state(self, log: list, p: torch.Tensor, key: str, value) -> None:
        """``self.state[p][key] = value``, with what it replaces kept in ``log``."""
        if p not in self.state:
            log.append((p, None, _MISSING))
        state = self.state[p]
        log.append((p, key, state.get(key, _MISSING)))
        state[key] = value

    def _undo(self, log: list) -> None:
        """Undo the state writes ``log`` holds, last first."""
        for p, key, old in reversed(log):
            if key is None:
                self.state.pop(p, None)
            elif old is _MISSING:
                self.state[p].pop(key, None)
            else:
                self.state[p][key] = old

    @_ops.run_eagerly  # dynamo does not replay attribute writes on optimizers
    def _remember_norm(self, total: torch.Tensor) -> None:
        self.last_grad_norm = total

    def _mask_for(self, p):
        mask = self.masks.get(p)
        return None if mask is None else _like(p, mask)

    def _update(self, group, params, grads, masks, clip_coef, grad_scale, found_inf,
                log) -> list:
        """The op calls (``_ops.StepCall``) that update one param group, not run. State a
        parameter lacks is created, and state that does not fit it converted, each through
        ``_write_state(log, ...)``."""
        raise NotImplementedError

    def _first_check(self, p: torch.Tensor) -> bool:
        """True the first time ``p``'s existing state is stepped since construction or loading
        (``load_state_dict``, unpickling): the state may come from elsewhere and is converted
        then. Afterwards it is the optimizer's own, and the kernels check it at every step."""
        if id(p) in self._checked_state:
            return False
        self._checked_state.add(id(p))
        return True

    def _state_like(self, p: torch.Tensor, t, key: str) -> torch.Tensor:
        """A state tensor of ``p`` as the kernels need it: ``p``'s dtype, device and
        layout (state loaded from elsewhere is converted once). State of another shape, or
        an inference tensor outside inference mode, is refused (``RuntimeError``): a copy
        would broadcast it, or hide what torch refuses."""
        name = type(self).__name__
        if not isinstance(t, torch.Tensor) or t.shape != p.shape:
            raise RuntimeError(
                f"{name}: state {key!r} of {self._label(p)} has shape "
                f"{tuple(getattr(t, 'shape', ()))}, not the parameter's (was the parameter "
                f"replaced by one of another shape after the state was made?); nothing was "
                f"stepped")
        if t.is_inference() and not torch.is_inference_mode_enabled():
            raise RuntimeError(
                f"{name}: state {key!r} of {self._label(p)} is an inference tensor (made by a "
                f"step inside torch.inference_mode()), which cannot be updated in place outside "
                f"it; nothing was stepped")
        if t.device != p.device or t.dtype != p.dtype or not _same_layout(t, p):
            out = torch.empty_like(p)
            out.copy_(t)
            return out
        return t
