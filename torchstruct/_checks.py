"""Argument checks shared by the public functions: one mistake, one message, wherever it is made.

Each check raises before its caller changes anything, naming the function and the argument
(or the parameter's path).
"""
from __future__ import annotations

import numbers
import operator
from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["check_bool", "check_callable", "refuse_lazy", "refuse_no_grad_dtype",
           "refuse_while_exporting"]

# True while torch.export traces, strict or not (absent from older torch: never)
is_exporting = getattr(torch.compiler, "is_exporting", lambda: False)


def check_bool(value, name: str, who: str, *, none: bool = False):
    """``value`` when it is a bool (or None, with ``none``); else ``TypeError`` naming ``name``.

    A flag such as ``strict`` or ``freeze_norm_stats`` is never read by truthiness: ``None``
    would be read as False and the string ``"no"`` as True, the opposite of what was written.
    """
    if isinstance(value, bool) or (none and value is None):
        return value
    allowed = "True, False or None" if none else "True or False"
    raise TypeError(f"{who}: {name} must be {allowed}, got {type(value).__name__} {value!r}")


_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def as_real(value) -> float | None:
    """``value`` as a float where it is a real number: a Python or NumPy real, or a
    one-element real tensor with data (torch's optimizers take a tensor ``lr``); else None.
    A bool is not a number here (``True`` as a learning rate is a mistake)."""
    if isinstance(value, torch.Tensor):
        if (value.numel() != 1 or value.is_meta
                or not (value.is_floating_point() or value.dtype in _INT_DTYPES)):
            return None
        return float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)


def describe(value) -> str:
    """``value`` in an error message: a tensor by dtype and shape (its repr can be long, and a
    meta tensor has no values), anything else by type and repr."""
    if isinstance(value, torch.Tensor):
        meta = "meta " if value.is_meta else ""
        return f"a {meta}{value.dtype} tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r}"


def as_int(value) -> int | None:
    """``value`` as an int where it is an integer: a Python or NumPy integer, or a one-element
    integer tensor (``operator.index``); else None (a bool too)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def refuse_while_exporting(who: str) -> None:
    """``RuntimeError`` when ``who`` is entered while ``torch.export`` traces: an exported
    program holds no ``requires_grad`` flags and no guard, so the block would be lost from it
    (its gradients and checks silently those of the model without the block)."""
    if is_exporting():
        raise RuntimeError(
            f"{who}: entered while torch.export traces (inside the model's forward); an "
            "exported program records no requires_grad flags or write checks, so this block "
            "would be missing from it. Enter it around the calls of the exported module "
            "(ep.module()) instead (non-strict export does record ts.stop_gradient and "
            "ts.swap inside a forward).")


def check_callable(f, name: str, who: str):
    """``f`` when it is callable; else ``TypeError`` naming ``name``."""
    if not callable(f):
        raise TypeError(f"{who}: {name} must be callable, got {type(f).__name__}")
    return f


def refuse_lazy(who: str, pairs: Iterable[tuple[str, nn.Parameter]]) -> None:
    """``ValueError`` naming the first uninitialized lazy parameter among ``(path, param)``:
    it has no shape nor values before its module's first forward."""
    for path, p in pairs:
        if nn.parameter.is_lazy(p):
            raise ValueError(
                f"{who}: parameter {path!r} is an uninitialized lazy parameter (an nn.Lazy* "
                "module before its first forward): its shape and values are not known yet; "
                "run one forward first"
            )


def refuse_no_grad_dtype(path: str, p, consequence: str) -> None:
    """``ValueError`` naming ``path`` when ``p``'s dtype cannot require grad (integers, bool):
    only floating-point and complex tensors can; ``consequence`` says what cannot be done."""
    if not (p.is_floating_point() or p.is_complex()):
        raise ValueError(
            f"parameter {path!r} has dtype {p.dtype}, which cannot require grad; {consequence}"
        )


def refuse_inference_tensor(path: str, p) -> None:
    """``RuntimeError`` naming ``path`` when ``p`` is an inference tensor (made under
    ``torch.inference_mode()``): outside that mode PyTorch refuses to turn its flag on, so a
    flag written on it could not be restored."""
    if not torch.nn.parameter.is_lazy(p) and p.is_inference():
        raise RuntimeError(
            f"parameter {path!r} is an inference tensor (created under torch.inference_mode()): "
            "PyTorch refuses requires_grad=True on it outside inference mode, so a flag "
            "torchstruct wrote could not be restored. Build the model outside inference_mode "
            "(or replace its parameters with clones made outside it). No flag was changed."
        )
