"""Parameter groups by selector, without weight decay on biases and norms, and layer decay.

- :func:`param_groups` turns rules ``(selector, options)`` into the ``param_groups`` list that
  every ``torch.optim.Optimizer`` takes: each parameter of the model in exactly one group (tied
  parameters once, frozen ones included), biases and normalization weights split off into groups
  with ``weight_decay=0``, each group named and carrying its parameters' paths.
- :func:`layer_decay` gives the rules of timm's layer-wise learning-rate decay as ``lr_scale``
  options, for the blocks of a layer stack.

Every selection goes through :func:`torchstruct.select.select`.
"""
from __future__ import annotations

import difflib
import glob
import math
import re
from collections.abc import Mapping

import torch
from torch import nn

from ._checks import as_real, check_bool, describe
from .select import ParamIndex, _closest, index, select

__all__ = ["param_groups", "layer_decay", "is_norm"]

# Group options ``param_groups`` knows; an unknown key close to one of these is a typo.
_KNOWN_OPTIONS = frozenset({
    "lr", "lr_scale", "weight_decay", "betas", "eps", "amsgrad", "maximize", "momentum",
    "dampening", "nesterov", "foreach", "fused", "capturable", "differentiable", "name",
    "initial_lr", "alpha", "centered", "lr_decay", "initial_accumulator_value", "rho", "lambd",
    "t0", "decoupled_weight_decay", "momentum_decay", "etas", "step_sizes", "max_lr", "min_lr",
})
_RESERVED = ("params", "param_names")

_TORCH_NORMS = tuple(
    cls for cls in (
        nn.modules.batchnorm._NormBase,  # BatchNorm*, SyncBatchNorm, InstanceNorm*
        nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.CrossMapLRN2d,
        getattr(nn, "RMSNorm", None),
    ) if cls is not None
)
_NORM_NAME = re.compile(r"(Norm(\d*d|\d+P?|Gated)?|GRN)$")


def is_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a normalization layer, for ``no_decay="auto"``.

    True for PyTorch's norm classes (``BatchNorm*``, ``SyncBatchNorm``, ``InstanceNorm*``,
    ``LayerNorm``, ``GroupNorm``, ``LocalResponseNorm``, ``RMSNorm`` and their subclasses) and for
    any class whose name ends in ``Norm``, optionally followed by digits, ``<digits>d``,
    ``<digits>P`` or ``Gated`` (``LlamaRMSNorm``, ``T5LayerNorm``, ``LayerNorm2d``,
    ``GroupNorm32``, ``FrozenBatchNorm2d``, ``NemotronLayerNorm1P``, ``MambaRMSNormGated``), or
    in ``GRN`` (global response normalization: ``ConvNextV2GRN``; timm's
    ``GlobalResponseNorm`` ends in ``Norm``). A TorchScript module is read by the name of the
    class it was scripted from (``original_name``).

    Arguments:
        module: a module instance (a class is not one: ``is_norm(nn.LayerNorm(4))``).

    Returns:
        Whether ``module`` is a normalization layer.

    Raises:
        TypeError: ``module`` is not an ``nn.Module`` instance (a class, None, a string).

    Example:
        >>> import torch.nn as nn, torchstruct as ts
        >>> class T5LayerNorm(nn.Module): pass
        >>> ts.is_norm(nn.LayerNorm(4)), ts.is_norm(T5LayerNorm()), ts.is_norm(nn.Linear(2, 2))
        (True, True, False)
    """
    if not isinstance(module, nn.Module):
        what = f"the class {module.__name__}" if isinstance(module, type) else type(module).__name__
        raise TypeError(f"is_norm: expected an nn.Module instance, got {what}")
    if isinstance(module, torch.jit.ScriptModule):  # scripted: only the class name is left
        return bool(_NORM_NAME.search(module.original_name))
    return isinstance(module, _TORCH_NORMS) or bool(_NORM_NAME.search(type(module).__name__))


# torch.nn.utils.parametrize moves ``m.weight`` to ``m.parametrizations.weight.original`` (or
# ``original0``, ``original1``, ...): the tensor still stands for ``m``'s ``weight``.
_PARAMETRIZED = re.compile(r"(?:(.*)\.)?parametrizations\.([^.]+)\.original\d*")


def _owner_and_name(path: str) -> tuple[str, str]:
    """The module path and the parameter name a parameter path stands for."""
    m = _PARAMETRIZED.fullmatch(path)
    if m:
        return m.group(1) or "", m.group(2)
    parent, _, name = path.rpartition(".")
    return parent, name


def _is_bias(name: str) -> bool:
    return name == "bias" or name.endswith("_bias") or name.startswith("bias_")


def _auto_no_decay(model: nn.Module) -> list:
    """The selectors of ``no_decay="auto"``: biases, norm weights, ``no_weight_decay()`` names."""
    norms = {name for name, m in model.named_modules(remove_duplicate=False) if is_norm(m)}

    def bias_or_norm(path: str, _p) -> bool:
        parent, name = _owner_and_name(path)
        return _is_bias(name) or parent in norms

    bias_or_norm.__name__ = "biases and norms"
    named = []  # the timm convention: a module's no_weight_decay() names (paths, prefixes or
    for prefix, m in model.named_modules():  # fnmatch patterns), relative to the module
        fn = getattr(m, "no_weight_decay", None)
        if callable(fn) and not isinstance(fn, nn.Module):  # (a child of that name is no method)
            names = fn()
            if isinstance(names, str):  # iterating it would give its letters
                raise TypeError(f"param_groups: {type(m).__name__}.no_weight_decay() returned "
                                f"the str {names!r}; return a collection of names, e.g. "
                                f"{{{names!r}}}")
            for name in names:
                if not isinstance(name, str):
                    raise TypeError(f"param_groups: {type(m).__name__}.no_weight_decay() "
                                    f"returned {name!r}, not a str")
                named.append(f"{glob.escape(prefix)}.{name}" if prefix else name)
    return [bias_or_norm, *named]


def _check_number(value, what: str, where: str) -> float:
    """``value`` as a float: a real number, or a one-element real tensor (torch's optimizers take
    a tensor ``lr``); anything else raises."""
    number = as_real(value)
    if number is None:
        raise TypeError(f"param_groups: {where}: {what} must be a number, got {describe(value)}")
    value = number
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"param_groups: {where}: {what} must be a finite number >= 0, "
                         f"got {value!r}")
    return value


def _check_options(options, where: str) -> dict:
    if not isinstance(options, Mapping):
        raise TypeError(f"param_groups: {where}: options must be a dict of param-group keys, "
                        f"got {type(options).__name__}")
    options = dict(options)
    for key in options:
        if not isinstance(key, str):
            raise TypeError(f"param_groups: {where}: option keys must be str, got {key!r}")
        if key in _RESERVED:
            raise ValueError(f"param_groups: {where}: {key!r} is set by param_groups itself; "
                             f"select the parameters with the rule's selector instead")
        if key not in _KNOWN_OPTIONS:
            close = difflib.get_close_matches(key, sorted(_KNOWN_OPTIONS), n=1, cutoff=0.8)
            if close:
                raise ValueError(f"param_groups: {where}: unknown option {key!r}; did you mean "
                                 f"{close[0]!r}?")
    for key in ("lr", "lr_scale", "weight_decay"):
        if key in options:
            _check_number(options[key], key, where)
    if "name" in options and not isinstance(options["name"], str):
        raise TypeError(f"param_groups: {where}: name must be a str, got {options['name']!r}")
    return options


def _describe(sel, model: nn.Module, idx: ParamIndex) -> str:
    """A readable name for a selector."""
    if isinstance(sel, str):
        return sel
    if isinstance(sel, re.Pattern):
        return f"re:{sel.pattern}"
    if isinstance(sel, nn.Parameter):
        return next((ps[0] for p, ps in zip(idx.params, idx.paths) if p is sel), "parameter")
    if isinstance(sel, nn.Module):
        found = next((name for name, m in model.named_modules() if m is sel), None)
        return found or type(sel).__name__
    if isinstance(sel, (list, tuple)):
        return "+".join(_describe(s, model, idx) for s in sel) or "[]"
    return getattr(sel, "__name__", type(sel).__name__)


def _check_rule(rule, i: int) -> tuple:
    if not isinstance(rule, (tuple, list)) or len(rule) != 2:
        raise TypeError(f"param_groups: rule {i} must be a pair (selector, options), "
                        f"got {rule!r}")
    return rule[0], _check_options(rule[1], f"rule {i}")


def _unique(name: str, taken: set) -> str:
    out, k = name, 2
    while out in taken:
        out, k = f"{name} #{k}", k + 1
    taken.add(out)
    return out


def param_groups(model: nn.Module, *rules, weight_decay=None, no_decay="auto",
                 strict: bool = True) -> list[dict]:
    """Param groups for a ``torch.optim.Optimizer``, built from selector rules.

    Every parameter of ``model`` lands in exactly one group, frozen ones included (so a later
    unfreeze needs no ``add_param_group``; ``ts.optim`` and torch's optimizers skip parameters
    without a gradient) and tied ones once, at their first path: in the group of the first rule
    that selects it, else in the default group. Then each group is split by ``no_decay``: its
    parameters that ``no_decay`` selects go to a part with ``weight_decay=0.0``, the others keep
    the group's weight decay. A rule that sets ``weight_decay`` itself is not split: its value
    holds for all of its parameters.

    Arguments:
        model: the module whose parameters are grouped.
        *rules: pairs ``(selector, options)``: ``options`` is a dict of param-group keys
            (``lr``, ``weight_decay``, ``betas``, ``lr_scale``, ...; ``name`` names the group).
            Selectors are those of :func:`~torchstruct.select`.
        weight_decay: the weight decay of the decaying groups that set none; ``None`` leaves
            the key out (the optimizer's default applies).
        no_decay: which parameters get no weight decay. ``"auto"``: biases (a last path
            component ``bias``, ``*_bias`` or ``bias_*``), every direct parameter of a
            normalization layer (see :func:`is_norm`; a parametrized one too, read through
            ``parametrizations.<name>.original``) and the names returned by the
            ``no_weight_decay()`` method of the model or any submodule (the timm convention;
            parameter paths, module prefixes or glob patterns such as ``"*.gamma"``, relative
            to that module). A selector replaces that rule; ``None`` decays everything.
        strict: when True (default), a rule (or ``no_decay`` selector) that selects no
            parameter raises.

    Returns:
        A list of dicts, each with ``"params"`` (in ``named_parameters()`` order), their paths
        as ``"param_names"`` (which ``torch.optim.Optimizer.state_dict`` records), a readable
        unique ``"name"`` (the rule's ``name`` option, else the selector written out; the default
        group is ``"default"``; a no-decay part adds ``" (no decay)"``) and the rule's options.
        Empty groups are left out. Rules come first in their order, the default group last.

    Raises:
        ValueError: a rule or ``no_decay`` selecting nothing (naming it and the closest
            paths), a negative or non-finite ``lr`` / ``lr_scale`` / ``weight_decay`` (numbers,
            or one-element tensors as torch's optimizers allow), an option that looks like a
            typo of a known one, ``params`` or ``param_names`` among the options.
        TypeError: a rule that is not a pair, options that are not a dict, a bad selector,
            a ``no_weight_decay()`` that returns a str or names that are not str, ``strict``
            not a bool.

    Example:
        >>> import torch.nn as nn, torchstruct as ts
        >>> m = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
        >>> groups = ts.param_groups(m, ("2", {"lr": 1e-3}), weight_decay=0.1)
        >>> for g in groups:
        ...     print(g["name"], g["param_names"], g["weight_decay"])
        2 ['2.weight'] 0.1
        2 (no decay) ['2.bias'] 0.0
        default ['0.weight'] 0.1
        default (no decay) ['0.bias', '1.weight', '1.bias'] 0.0
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"param_groups: expected an nn.Module, got {type(model).__name__}")
    check_bool(strict, "strict", "param_groups")
    if weight_decay is not None:
        weight_decay = _check_number(weight_decay, "weight_decay", "argument")
    checked = [_check_rule(rule, i) for i, rule in enumerate(rules)]
    idx = index(model)
    chosen = [_picked(model, sel, f"rule {i}", strict, idx)
              for i, (sel, _) in enumerate(checked)]
    exempt = _exempt(model, no_decay, strict, idx)
    specs = [(options, options.get("name") or _describe(sel, model, idx))
             for sel, options in checked] + [({}, "default")]
    return _build(specs, _assign(idx, chosen), exempt, weight_decay)


def _picked(model: nn.Module, sel, what: str, strict: bool, idx: ParamIndex) -> set:
    """ids of the parameters that ``sel`` (``what``: "rule 0", "no_decay") selects; with
    ``strict``, selecting nothing raises. Errors name ``what``."""
    try:
        picked = {id(p) for _, p in select(model, sel, strict=strict, idx=idx)}
    except (TypeError, ValueError) as e:
        raise type(e)(f"param_groups: {what}: {e}") from None
    if strict and not picked:
        name = _describe(sel, model, idx)
        raise ValueError(f"param_groups: {what} ({name!r}) selects no parameter; closest "
                         f"paths: {_closest(name, idx.all_paths())} (pass strict=False to allow "
                         f"an empty selection)")
    return picked


def _exempt(model: nn.Module, no_decay, strict: bool, idx: ParamIndex) -> set:
    """ids of the parameters without weight decay."""
    if isinstance(no_decay, str) and no_decay == "auto":
        return {id(p) for _, p in select(model, _auto_no_decay(model), strict=False, idx=idx)}
    if no_decay is None:
        return set()
    return _picked(model, no_decay, "no_decay", strict, idx)


def _assign(idx: ParamIndex, chosen: list) -> list:
    """Each parameter (canonical path) to the first rule that selects it, else the default
    slot (the last)."""
    slots = [[] for _ in range(len(chosen) + 1)]
    for path, p in idx:
        k = next((i for i, ids in enumerate(chosen) if id(p) in ids), len(chosen))
        slots[k].append((path, p))
    return slots


def _build(specs: list, slots: list, exempt: set, weight_decay) -> list[dict]:
    """The groups: each rule's slot split into its decaying and no-decay parts, named."""
    groups, taken, bases = [], set(), set()
    for (options, name), members in zip(specs, slots):
        name = _unique(name, bases)
        options = {k: v for k, v in options.items() if k != "name"}
        if "weight_decay" in options or not exempt:
            parts = [(name, members, options.get("weight_decay", weight_decay))]
        else:
            parts = [(name, [m for m in members if id(m[1]) not in exempt], weight_decay),
                     (f"{name} (no decay)", [m for m in members if id(m[1]) in exempt], 0.0)]
        for part_name, part, wd in parts:
            if not part:
                continue
            group = {"params": [p for _, p in part], "param_names": [path for path, _ in part],
                     "name": _unique(part_name, taken), **options}
            if wd is not None:
                group["weight_decay"] = wd
            groups.append(group)
    return groups


def _stacks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """ModuleLists / Sequentials of at least two blocks of one type, each with parameters."""
    found = []
    for name, m in model.named_modules():  # the model itself too ("")
        if not isinstance(m, (nn.ModuleList, nn.Sequential)) or len(m) < 2:
            continue
        kinds = {type(block) for block in m}
        if len(kinds) == 1 and all(any(True for _ in b.parameters()) for b in m):
            found.append((name, m))
    return found


def _prefix(path: str) -> str:
    """What the paths below module ``path`` start with (``""`` for the model itself)."""
    return f"{path}." if path else ""


def _find_stack(model: nn.Module, layers) -> tuple[str, nn.Module]:
    if isinstance(layers, nn.Module):
        name = next((n for n, m in model.named_modules() if m is layers), None)
        if name is None:
            raise ValueError(f"layer_decay: the given {type(layers).__name__} is not a "
                             f"submodule of the model")
        layers = name
    if isinstance(layers, str):  # "": the model itself is the stack
        modules = dict(model.named_modules())
        stack = modules.get(layers)
        if stack is None:
            raise ValueError(f"layer_decay: layers={layers!r} is not a module of the model; "
                             f"closest: {_closest(layers, [n for n in modules if n])}")
        if not isinstance(stack, (nn.ModuleList, nn.Sequential)):
            raise ValueError(f"layer_decay: layers={layers!r} is a {type(stack).__name__}, "
                             f"not an nn.ModuleList or nn.Sequential of blocks")
        return layers, stack
    if layers is not None:
        raise TypeError(f"layer_decay: layers must be a module path (str), a module or None, "
                        f"got {type(layers).__name__}")
    found = _stacks(model)
    if not found:
        raise ValueError("layer_decay: the model has no nn.ModuleList or nn.Sequential of two "
                         "or more blocks of one type; name the layer stack with layers=")
    inside = lambda n, o: n != o and n.startswith(_prefix(o))  # noqa: E731
    outer = [(n, m) for n, m in found if not any(inside(n, o) for o, _ in found)]
    if len(outer) > 1:  # side by side (an encoder and a decoder, two towers, a head)
        names = ", ".join(repr(n) for n, _ in outer)
        sizes = ", ".join(str(len(m)) for _, m in outer)
        raise ValueError(f"layer_decay: several layer stacks: {names} (of {sizes} blocks); "
                         f"pick one with layers=")
    name, stack = outer[0]
    larger = [n for n, m in found if inside(n, name) and len(m) > len(stack)]
    if larger:  # stages of blocks: the stages or the blocks of one stage?
        raise ValueError(f"layer_decay: the layer stack {name!r} ({len(stack)} blocks) holds "
                         f"larger stacks ({', '.join(repr(n) for n in larger)}); pick one with "
                         f"layers=")
    return name, stack


def layer_decay(model: nn.Module, decay: float, *, layers=None) -> list[tuple]:
    """The rules of layer-wise learning-rate decay (timm's), for :func:`param_groups`.

    The parameters are given layer ids: 0 for those before the layer stack (in
    ``named_parameters()`` order: embeddings), ``1..L`` for the ``L`` blocks of the stack, and
    ``L + 1`` for those after it (final norm, head); layer ``i`` gets
    ``lr_scale = decay ** (L + 1 - i)``, so the head trains at the full rate and each block
    below at ``decay`` times the one above. A tied parameter takes the id of its first path.

    Arguments:
        model: the module.
        decay: the factor between neighbouring layers, in (0, 1].
        layers: the layer stack (an ``nn.ModuleList`` or ``nn.Sequential``), by path
            (``"encoder.layer"``; ``""`` for the model itself) or as the module. ``None`` finds
            it: the one list of at least two blocks of one type that have parameters and lies
            in no other such list (lists inside its blocks, such as per-head or per-expert
            lists, are ignored when they are not longer than it); the model itself when it is
            such a list.

    Returns:
        A list of rules ``(selector, {"lr_scale": ..., "name": ...})``: one for the
        parameters before the stack (named ``"layer 0"``, if any), one per block with
        parameters (named by its path), one for those after (``"layer L+1"``, if any). Pass them
        to :func:`param_groups` (after rules that should win over them).

    Raises:
        ValueError: ``decay`` outside (0, 1]; ``layers`` not a list of blocks of the model
            (naming the closest module paths), one without parameters or one holding
            parameters of its own outside its blocks; no stack found, several stacks side by side
            (an encoder and a decoder, two towers), or one holding a longer stack in a block
            (stages of blocks); the message names them.
        TypeError: ``decay`` not a number, ``layers`` of a wrong type.

    Example:
        >>> import torch.nn as nn, torchstruct as ts
        >>> blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        >>> m = nn.Sequential(nn.Linear(2, 4), blocks, nn.Linear(4, 1))
        >>> [(options["name"], options["lr_scale"]) for _, options in ts.layer_decay(m, 0.5)]
        [('layer 0', 0.125), ('1.0', 0.25), ('1.1', 0.5), ('layer 3', 1.0)]
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"layer_decay: expected an nn.Module, got {type(model).__name__}")
    number = as_real(decay)
    if number is None:
        raise TypeError(f"layer_decay: decay must be a number, got {describe(decay)}")
    if not 0.0 < number <= 1.0:
        raise ValueError(f"layer_decay: decay must be in (0, 1], got {decay!r}")
    decay = number
    name, stack = _find_stack(model, layers)
    blocks = [_prefix(name) + child for child, _ in stack.named_children()]
    n = len(blocks)
    idx = index(model)
    if not (select(model, glob.escape(name), strict=False, idx=idx) if name else len(idx)):
        raise ValueError(f"layer_decay: the layer stack {name!r} has no parameters (an empty "
                         f"list, or blocks without parameters); name another with layers=")
    before, after, seen_stack, loose = [], [], False, []
    for path, _ in idx:  # canonical paths: a tied parameter sits at its first path
        if path.startswith(_prefix(name)):
            seen_stack = True
            if not any(path.startswith(block + ".") for block in blocks):
                loose.append(path)
        else:
            (after if seen_stack else before).append(glob.escape(path))
    if loose:
        raise ValueError(f"layer_decay: the layer stack {name!r} holds parameters of its own, in "
                         f"no block ({', '.join(map(repr, loose[:5]))}), which have no layer id; "
                         f"give them a rule of their own before the layer-decay rules")
    rules = []
    if before:
        rules.append((before, {"lr_scale": decay ** (n + 1), "name": "layer 0"}))
    for i, block in enumerate(blocks, start=1):
        sel = glob.escape(block)  # a block named "a[1]" is that block, not a pattern
        if select(model, sel, strict=False, idx=idx):  # a block without parameters: no rule
            rules.append((sel, {"lr_scale": decay ** (n + 1 - i), "name": block}))
    if after:
        rules.append((after, {"lr_scale": 1.0, "name": f"layer {n + 1}"}))
    return rules
