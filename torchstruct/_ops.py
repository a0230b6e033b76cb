"""The one seam between torchstruct and its kernels.

Every op exists three times, with one signature and one semantics: compiled
(``torch.ops.torchstruct.<name>``, registered by the ``torchstruct._C``
extension built from ``csrc/``), on PyTorch's own multi-tensor and fused ops
(``torchstruct._fallback.<name>``), and pure PyTorch, one tensor at a time
(``torchstruct._reference.<name>``, the test oracle). The functions here
validate input, split it by device, and send each part to one of them.

Backend selection (``backend()`` names the active one):

* ``"compiled"`` (the default when the extension is loaded): each device type
  with compiled kernels runs them (``compiled_device_types()``: ``("cpu",)`` or
  ``("cpu", "cuda")``); any other device (CUDA tensors with a CPU-only build)
  runs the fallback, with one ``RuntimeWarning`` per process and device that
  says how to build its kernels. ``backend(device)`` says what runs for one
  device: ``"compiled"``, ``"fallback"`` or ``"reference"``.
* ``"fallback"``: every device on PyTorch's multi-tensor ops.
* ``"reference"`` (the default without the extension): the pure-PyTorch ops.
* ``TORCHSTRUCT_BACKEND=compiled|fallback|reference`` (read at import) picks one;
  ``TORCHSTRUCT_NO_KERNELS=cpu`` (comma-separated device types, read at import)
  treats those device types as having no compiled kernels (CI runs the CPU
  through the fallback this way); ``use_backend(name)`` switches temporarily.

Inputs that need autograd (grad mode on and a tensor that requires grad, a
forward-mode dual, or any input inside a ``torch.func`` transform) go to the
reference implementation, which is differentiable (and batches under ``vmap``);
the others are not.
``meta`` tensors (shapes only) go to the reference too.

Adding an op: a kernel in ``csrc/`` registered under the same name (it must
check all its input before writing anything), a function of that name in
``_reference.py`` and one in ``_fallback.py``, its fake kernel below, its name in ``_OPS``, and a wrapper
here that tries ``_try_compiled(name, tensors, args)`` (the eager fast path) and,
when that refuses, hands DTensors to ``_dtensor`` and the rest to
``_per_device(name, tensors, args, validate)``.
"""

import contextlib
import functools
import os
import threading
import warnings
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch

from . import _derivatives, _dtensor, _fallback, _reference

try:
    from . import _C  # noqa: F401  (importing registers torch.ops.torchstruct.*)
except ImportError as _err:  # extension not built
    _C = None
    _C_IMPORT_ERROR = _err
else:
    _C_IMPORT_ERROR = None

__all__ = [
    "backend",
    "compiled_available",
    "compiled_device_types",
    "clip_by_global_norm_",
    "global_norm",
    "scale_",
    "use_backend",
]

BACKENDS = ("compiled", "fallback", "reference")

#: names of the ops registered as torch.ops.torchstruct.<name>
_OPS = ("global_norm", "scale_", "clip_by_global_norm_", "sgd_step_", "adamw_step_")

_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA"}


def _kernel_devices(name: str) -> frozenset:
    """Device types for which the compiled op ``name`` has a kernel."""
    if _C is None:
        return frozenset()
    built = {"cpu"} | ({"cuda"} if getattr(_C, "WITH_CUDA", 0) else set())
    found = set()
    for device_type, key in _DISPATCH_KEYS.items():
        try:
            has = torch._C._dispatch_has_kernel_for_dispatch_key(f"torchstruct::{name}", key)
        except Exception:  # private API missing: trust the build flags
            has = device_type in built
        if has:
            found.add(device_type)
    return frozenset(found)


_KERNELS: Dict[str, frozenset] = {name: _kernel_devices(name) for name in _OPS}


def _initial_backend() -> str:
    forced = os.environ.get("TORCHSTRUCT_BACKEND", "").strip().lower()
    if forced in ("reference", "fallback"):
        return forced
    if forced not in ("", "auto", "compiled"):
        warnings.warn(
            f"TORCHSTRUCT_BACKEND={forced!r} is not one of 'compiled', 'fallback', "
            f"'reference'; ignored",
            RuntimeWarning,
            stacklevel=2,
        )
    if _C is None:
        if forced == "compiled":
            warnings.warn(
                f"TORCHSTRUCT_BACKEND=compiled but the extension is not available "
                f"({_C_IMPORT_ERROR}); using the reference implementation",
                RuntimeWarning,
                stacklevel=2,
            )
        return "reference"
    return "compiled"


_backend = _initial_backend()
#: the backend outside every use_backend block, and the blocks open now, innermost last
_base_backend = _backend
_blocks: List[tuple] = []
_blocks_lock = threading.Lock()


def _initial_no_kernels() -> frozenset:
    value = os.environ.get("TORCHSTRUCT_NO_KERNELS", "")
    return frozenset(part.strip().lower() for part in value.split(",") if part.strip())


#: device types treated as having no compiled kernels (TORCHSTRUCT_NO_KERNELS)
_no_kernels: frozenset = _initial_no_kernels()
#: devices already warned about running on the fallback
_warned: set = set()


def compiled_available() -> bool:
    """True when the compiled extension ``torchstruct._C`` is loaded."""
    return _C is not None


def accumulator_hooks(tensor: torch.Tensor) -> Optional[Tuple[int, int]]:
    """The hooks on ``tensor``'s gradient accumulator node (``register_hook`` /
    ``register_prehook`` on it, which no Python API lists), as ``(python, other)`` counts:
    those registered from Python, those added in C++ (DDP's reducer). ``(0, 0)`` for a tensor
    without an accumulator; None without the compiled extension, which reads them."""
    if _C is None:
        return None
    return _C.accumulator_hooks(tensor)


def off_path_hooks(roots, targets) -> Optional[list]:
    """The hooked nodes a backward from ``roots`` runs and ``torch.autograd.grad(roots,
    targets)`` would not (no path to a target, nor to a reentrant checkpoint; gradient
    accumulators left out), as ``(node name, kind, hooks)``: kind ``"retain_grad"`` (hooks
    empty) or ``"hook"``, hooks the callables registered from Python (None for one made in
    C++); None without the compiled extension, which reads them."""
    if _C is None:
        return None
    return _C.off_path_hooks(list(roots), list(targets))


def compiled_device_types() -> Tuple[str, ...]:
    """Device types with compiled kernels: ``()``, ``("cpu",)`` or ``("cpu", "cuda")``."""
    if _C is None:
        return ()
    return ("cpu", "cuda") if getattr(_C, "WITH_CUDA", 0) else ("cpu",)


def backend(device=None) -> str:
    """What runs the ops.

    Arguments:
        device: None, or a device (``torch.device``, a string such as ``"cuda:0"``,
            or a tensor, for its device).

    Returns:
        Without a device, the active backend: ``"compiled"`` (the ``torchstruct._C``
        kernels on every device type they were built for, the fallback elsewhere),
        ``"fallback"`` (PyTorch's multi-tensor ops everywhere) or ``"reference"``
        (pure PyTorch). With a device, what runs for its tensors: ``"compiled"``,
        ``"fallback"`` or ``"reference"`` (``meta`` tensors: ``"reference"``).
    """
    if device is None:
        return _backend
    device_type = (device.device if isinstance(device, torch.Tensor) else torch.device(device)).type
    if _backend == "reference" or device_type == "meta":
        return "reference"
    if _backend == "compiled" and all(_has_kernel(name, device_type) for name in _OPS):
        return "compiled"
    return "fallback"


def _has_kernel(name: str, device_type: str) -> bool:
    """Whether op ``name`` runs its compiled kernel for ``device_type`` now."""
    return (_backend == "compiled" and device_type in _KERNELS[name]
            and device_type not in _no_kernels)


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Make ``name`` (``"compiled"``, ``"fallback"`` or ``"reference"``) the active
    backend inside the block, for the whole process (every thread). Blocks nest; when
    blocks of several threads overlap, the one entered last applies until it ends, and
    once every block has ended the backend is the one from before the first, whatever the
    order in which they end (also on error)."""
    global _backend, _base_backend
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    if name == "compiled" and _C is None:
        raise RuntimeError(
            f"the compiled backend is not available: torchstruct._C failed to import "
            f"({_C_IMPORT_ERROR})"
        )
    token = (name,)  # this block, by identity
    with _blocks_lock:
        if not _blocks:
            _base_backend = _backend
        _blocks.append(token)
        _backend = name
    try:
        yield
    finally:
        with _blocks_lock:
            _blocks[:] = [b for b in _blocks if b is not token]
            _backend = _blocks[-1][0] if _blocks else _base_backend


def _needs_autograd(tensors: Sequence[torch.Tensor]) -> bool:
    if _is_compiling():  # traced code: reverse mode only (dynamo handles transforms itself)
        return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    return _derivatives.any_differentiated(tensors)


def _is_compiling() -> bool:
    try:
        return torch.compiler.is_compiling()
    except AttributeError:  # older spelling
        return torch._dynamo.is_compiling()


def run_eagerly(fn):
    """``fn``, run eagerly also inside ``torch.compile`` (a graph break there). The wrapper that
    makes it so is built at the first call: importing ``torch._dynamo`` costs about a second,
    which ``import torchstruct`` does not pay."""
    disabled = []

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not disabled:
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)

    return call


def _impl(name: str, device: torch.device, tensors: Sequence[torch.Tensor],
          p: Optional[float] = None):
    """The implementation of op ``name`` for ``tensors`` (all on ``device``): the
    reference when it is active, an autograd graph is needed or the tensors are
    ``meta``; for a norm type ``p`` no kernel computes (a general p), the fallback's, around
    the 1- and inf-norms of this function's choice; else the compiled op when the device
    type has its kernel; else the fallback (warning once per device when the compiled
    backend is active)."""
    if _backend == "reference" or device.type == "meta" or _needs_autograd(tensors):
        return getattr(_reference, name)
    if p is not None and not _kernel_norm(p):
        return functools.partial(getattr(_fallback, name), norm=_impl("global_norm", device, tensors))
    if _has_kernel(name, device.type):
        return getattr(torch.ops.torchstruct, name)
    if _backend == "compiled":
        _warn_fallback(device)
    if name in _EAGER_FALLBACK and _is_compiling():
        return _EAGER_FALLBACK[name]
    return getattr(_fallback, name)


# The fallback's optimizer steps run eagerly under torch.compile (a graph break): the fused
# ops they call cannot mutate state that the traced step has just created.
_EAGER_FALLBACK = {name: run_eagerly(getattr(_fallback, name))
                   for name in ("sgd_step_", "adamw_step_")}


def _warn_fallback(device: torch.device) -> None:
    if device in _warned:
        return
    warnings.warn(_no_kernel_message(device), RuntimeWarning, stacklevel=4)
    _warned.add(device)  # (after: a warnings filter that raises it raises it every time)


def _no_kernel_message(device: torch.device) -> str:
    if device.type in _no_kernels:
        why = f"TORCHSTRUCT_NO_KERNELS names {device.type}"
    elif _C is None:
        why = "the extension is not built"
    else:
        why = f"the extension was built without {device.type} kernels"
    how = ("a CUDA build of torch, the CUDA toolkit whose major version matches "
           "torch.version.cuda (CUDA_HOME with bin/nvcc) and TORCH_CUDA_ARCH_LIST when no GPU "
           "is visible" if device.type == "cuda" else f"that device's toolkit")
    return (
        f"torchstruct: no compiled kernels for {device} ({why}); its tensors run on PyTorch's "
        f"multi-tensor and fused ops (correct, slower). To build the kernels, reinstall with "
        f"{how}: `pip install --no-build-isolation -e .` (setup.py prints why it skipped them)."
    )


def _group_by_device(tensors: Sequence[torch.Tensor]) -> Dict[torch.device, List[torch.Tensor]]:
    """Tensors grouped by device, groups in order of first appearance."""
    groups: Dict[torch.device, List[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device, []).append(t)
    return groups


def _per_device(
    name: str,
    tensors: List[torch.Tensor],
    args: tuple,
    validate: Callable[[List[torch.Tensor]], List[torch.Tensor]],
    p: Optional[float] = None,
) -> List[torch.Tensor]:
    """Run op ``name`` as ``op(part, *args)`` for each device's part of the
    non-empty list ``tensors``; the results in order of first appearance.

    The checked path, after the fast path (``_try_compiled``) refused: ``validate``
    (raises clear errors), then one call per device through ``_impl`` (``p``: the norm
    type of a norm op). The compiled kernels check every input before they write anything, so a
    refused call has no effect.
    """
    tensors = validate(tensors)
    groups = _group_by_device(tensors)
    return [_impl(name, device, part, p)(part, *args) for device, part in groups.items()]


def _kernel_norm(p: float) -> bool:
    """Whether the kernels compute norm type ``p`` (1, 2 or inf); a general p runs on
    PyTorch's ops, scaled (``_fallback.general_norm``)."""
    return p in _reference.KERNEL_NORMS


# ---------------------------------------------------------------------------
# fake kernels (shapes and dtypes only), so torch.compile can trace the ops
# ---------------------------------------------------------------------------

if _C is not None and hasattr(torch.library, "register_fake"):

    @torch.library.register_fake("torchstruct::global_norm")
    def _global_norm_fake(tensors, norm_type):
        torch._check(len(tensors) > 0, lambda: "global_norm: expected at least one tensor")
        device = tensors[0].device
        for t in tensors:
            torch._check(
                t.device == device,
                lambda: f"global_norm: all tensors must be on one device, got {device} and {t.device}",
            )
        return tensors[0].new_empty((), dtype=_reference.result_dtype(tensors))

    def _check_one_device_fake(op, tensors):
        torch._check(len(tensors) > 0, lambda: f"{op}: expected at least one tensor")
        device = tensors[0].device
        for t in tensors:
            torch._check(
                t.device == device,
                lambda: f"{op}: all tensors must be on one device, got {device} and {t.device}",
            )

    @torch.library.register_fake("torchstruct::scale_")
    def _scale_fake(tensors, scale):
        _check_one_device_fake("scale_", tensors)
        torch._check(scale.dim() == 0, lambda: "scale_: scale must be a 0-dim tensor")

    @torch.library.register_fake("torchstruct::clip_by_global_norm_")
    def _clip_by_global_norm_fake(grads, max_norm, norm_type):
        _check_one_device_fake("clip_by_global_norm_", grads)
        return grads[0].new_empty((), dtype=_reference.clip_result_dtype(grads))


# ---------------------------------------------------------------------------
# ops
# ---------------------------------------------------------------------------


def global_norm(tensors: Sequence[torch.Tensor], norm_type: float = 2.0,
                name_of: Optional[Callable[[int], str]] = None) -> torch.Tensor:
    """p-norm of the concatenation of all elements of ``tensors``.

    ``tensors``: any sequence of dense float32/float64/float16/bfloat16 tensors,
    possibly empty, possibly on several devices. ``norm_type``: any p > 0, or
    ``inf`` (``ValueError`` otherwise). Returns a 0-dim tensor on the first
    tensor's device, float64 if any input is float64 else float32
    (``torch.tensor(0.0)`` for an empty list). NaN anywhere gives NaN, inf gives
    inf. Each device's part is reduced by one kernel call; the per-device norms
    are then combined. DTensors (FSDP2) count with all their shards: see
    ``_dtensor``; the result is then the same plain tensor on every rank. ``name_of``:
    how an error names tensor ``i`` (its path), else by index.
    """
    p = _reference.validate_norm_type(norm_type)
    tensors = list(tensors) if not isinstance(tensors, torch.Tensor) else [tensors]
    if not tensors:
        return torch.tensor(0.0)
    out = _try_compiled("global_norm", tensors, (p,)) if _kernel_norm(p) else _REFUSED
    if out is not _REFUSED:
        return out
    if _dtensor.any_dtensor(tensors):
        return _dtensor.global_norm(tensors, p, lambda part: global_norm(part, p))
    norms = _per_device("global_norm", tensors, (p,),
                        _validate_float_tensors("global_norm", name_of), p)
    if len(norms) == 1:
        return norms[0]
    return _reference.combine_norms(norms, p, tensors[0].device)


def _validate_float_tensors(op: str, name_of: Optional[Callable[[int], str]] = None
                            ) -> Callable[[List[torch.Tensor]], List[torch.Tensor]]:
    return lambda tensors: _reference.validate_tensors(tensors, op, name_of)


def _validate_writable_tensors(op: str, name_of: Optional[Callable[[int], str]] = None
                               ) -> Callable[[List[torch.Tensor]], List[torch.Tensor]]:
    def validate(tensors):
        tensors = _reference.validate_tensors(tensors, op, name_of)
        _reference.validate_writable(tensors, op, name_of)
        return tensors

    return validate


def _try_compiled(name: str, tensors: List[torch.Tensor], args: tuple):
    """The compiled op on the whole list (eager fast path), or ``_REFUSED`` when it
    does not apply or refuses the input (the checked path then explains)."""
    first = tensors[0]
    if (
        _backend == "compiled"
        and isinstance(first, torch.Tensor)
        and _has_kernel(name, first.device.type)
        and not _is_compiling()
    ):
        try:
            if not _needs_autograd(tensors):
                # the OpOverload itself: no overload resolution per call
                return getattr(torch.ops.torchstruct, name).default(tensors, *args)
        except _NOT_REFUSALS:
            raise  # out of memory (or a device error) may come after some writes: no retry
        except (AttributeError, RuntimeError, TypeError, ValueError, NotImplementedError):
            pass  # explained or handled by the checked path; kernels write nothing when refusing
    return _REFUSED


#: errors that are not a kernel refusing its input (those check everything before any write)
_NOT_REFUSALS = tuple(
    e for e in (getattr(torch, "OutOfMemoryError", None), getattr(torch, "AcceleratorError", None))
    if e is not None
)


_REFUSED = object()


def _scale_on(scale: torch.Tensor, device: torch.device) -> torch.Tensor:
    # A CPU scalar is read on the host by every kernel; otherwise the device's own copy.
    if scale.device == device or scale.device.type == "cpu":
        return scale
    return scale.to(device, non_blocking=True)


def scale_(tensors: Sequence[torch.Tensor], scale: torch.Tensor) -> None:
    """Multiply every tensor in place by the 0-dim tensor ``scale`` (as
    ``t.mul_(scale)``; a tensor listed twice is multiplied twice). Tensors may be on
    several devices; ``scale`` is moved to each (a CPU scalar is used as is).
    Everything is checked before anything is written."""
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    if not isinstance(scale, torch.Tensor) or scale.dim() != 0:
        raise ValueError(f"scale_: scale must be a 0-dim tensor, got {scale!r}")
    if not tensors:
        return
    if _try_compiled("scale_", tensors, (scale,)) is not _REFUSED:
        return
    tensors = _validate_writable_tensors("scale_")(_dtensor.locals_(tensors))
    groups = _group_by_device(tensors)
    impls = [(_impl("scale_", device, part), device, part) for device, part in groups.items()]
    for impl, device, part in impls:
        impl(part, _scale_on(scale, device))


def clip_by_global_norm_(
    grads: Sequence[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    name_of: Optional[Callable[[int], str]] = None,
) -> torch.Tensor:
    """Scale ``grads`` in place by ``min(max_norm / (norm + 1e-6), 1)``, ``norm``
    their global ``norm_type``-norm; returns ``norm`` (0-dim, on the first grad's
    device, in the promoted dtype of the grads as ``clip_grad_norm_`` returns it;
    ``torch.tensor(0.0)`` for no grads).

    One device: one call of the fused op (norm, coefficient on the device, scale).
    Several devices, or ``error_if_nonfinite``: the norm of each device's part,
    combined on the first device, checked (``RuntimeError`` if non-finite, which
    reads the norm on the host; nothing is written then), then each part scaled
    by the coefficient. DTensors likewise: the norm of all their shards (a
    collective, see ``_dtensor``), then each rank's local shards scaled. Every
    input is checked before anything is written; an error names a bad one as
    ``name_of(i)`` says where given.
    """
    p = _reference.validate_norm_type(norm_type)
    max_norm = _reference.validate_max_norm(max_norm)
    grads = [grads] if isinstance(grads, torch.Tensor) else list(grads)
    if not grads:
        return torch.tensor(0.0)
    if not error_if_nonfinite and _kernel_norm(p):
        out = _try_compiled("clip_by_global_norm_", grads, (max_norm, p))
        if out is not _REFUSED:
            return out
    sharded = _dtensor.any_dtensor(grads)  # DTensors: scale the local shards, norm of all
    local_grads = _validate_writable_tensors("clip_by_global_norm_", name_of)(
        _dtensor.locals_(grads) if sharded else grads)
    groups = _group_by_device(local_grads)
    if len(groups) == 1 and not error_if_nonfinite and not sharded:
        device = local_grads[0].device
        return _impl("clip_by_global_norm_", device, local_grads, p)(local_grads, max_norm, p)
    # Resolve every kernel first: an unsupported device raises before any write.
    plans = [
        (_impl("global_norm", device, part, p), _impl("scale_", device, part), device, part)
        for device, part in groups.items()
    ]
    if sharded:
        total = global_norm(grads, p)
    else:
        norms = [norm_fn(part, p) for norm_fn, _, _, part in plans]
        total = norms[0] if len(norms) == 1 else _reference.combine_norms(norms, p, grads[0].device)
    result = total.to(_reference.clip_result_dtype(local_grads))
    # Checked as returned: an fp16 norm above 65504 is inf there, as torch reports it.
    if error_if_nonfinite and not bool(torch.isfinite(result)):
        raise RuntimeError(
            f"clip_by_global_norm: the total norm of order {p} of the gradients is non-finite "
            f"({result.item()}), so it cannot be clipped; the gradients were left unchanged. "
            f"Pass error_if_nonfinite=False to scale them by the non-finite norm anyway."
        )
    coef = _reference.clip_coefficient(total, max_norm)
    for _, scale_fn, device, part in plans:
        scale_fn(part, _scale_on(coef, device))
    return result


def clip_grads_of(params, max_norm, norm_type):
    """The fast path of ``clip_by_global_norm`` for a list or tuple of parameters: their
    ``.grad`` read and clipped in C++ (``torchstruct._C.clip_grads_``), skipping ``None``;
    returns the norm, or None when it does not apply or the input needs the checked path
    (nothing has been written then). Call it under ``torch.no_grad()``."""
    if (_backend != "compiled" or _is_compiling() or not isinstance(params, (list, tuple))
            or not _KERNELS["clip_by_global_norm_"] or _no_kernels
            or not _kernel_norm(float(norm_type))):
        return None
    try:  # a device without a kernel is refused there, and explained by the checked path
        return _C.clip_grads_(params, float(max_norm), float(norm_type))
    except (TypeError, ValueError, AttributeError):
        return None


# ---------------------------------------------------------------------------
# fused optimizer steps (torchstruct.optim)
# ---------------------------------------------------------------------------

if _C is not None and hasattr(torch.library, "register_fake"):

    @torch.library.register_fake("torchstruct::sgd_step_")
    def _sgd_step_fake(params, grads, momentum_buffers, masks, lr, momentum, dampening,
                       weight_decay, nesterov, maximize, first_step, clip_coef=None,
                       grad_scale=None, found_inf=None):
        torch._check(len(grads) == len(params), lambda: "sgd_step_: one gradient per parameter")
        torch._check(len(masks) in (0, len(params)), lambda: "sgd_step_: no masks or one per parameter")

    @torch.library.register_fake("torchstruct::adamw_step_")
    def _adamw_step_fake(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, masks, lr,
                         beta1, beta2, weight_decay, eps, amsgrad, maximize, clip_coef=None,
                         grad_scale=None, found_inf=None):
        for what, tensors in (("gradient", grads), ("exp_avg", exp_avgs),
                              ("exp_avg_sq", exp_avg_sqs), ("step", steps)):
            torch._check(len(tensors) == len(params),
                         lambda: f"adamw_step_: one {what} per parameter")
        torch._check(len(masks) in (0, len(params)), lambda: "adamw_step_: no masks or one per parameter")


def _on(t, device: torch.device):
    """``t`` (a tensor or None) on ``device``."""
    if t is None or t.device == device:
        return t
    return t.to(device, non_blocking=True)


class StepCall(NamedTuple):
    """One call of a fused step op on one device: ``fn(params, *lists, masks, *scalars,
    **extra)``, ``fn`` resolved by :func:`_impl`."""

    name: str
    fn: Callable
    params: list
    lists: list
    masks: list
    scalars: tuple
    extra: dict


def step_calls(name: str, params: List[torch.Tensor], lists: List[list], masks: list,
               scalars: tuple, extra: dict) -> List[StepCall]:
    """The calls of the in-place step op ``name`` over ``params``, one per device: ``lists``
    are parallel to ``params`` (an empty list stays empty), ``masks`` too (or empty); the
    0-dim tensors of ``extra`` are moved to each device. Every device's implementation is
    resolved here; nothing runs."""
    masks = list(masks) if any(m is not None for m in masks) else []
    device = _one_device(params)
    if device is not None:  # the common case: no index lists
        return [StepCall(name, _impl(name, device, params), params, lists, masks, scalars,
                         {k: _on(v, device) for k, v in extra.items()})]
    if _dtensor.any_dtensor(params):  # FSDP2: update each rank's shard, elementwise
        params, masks = _dtensor.locals_(params), _dtensor.locals_(masks)
        lists = [_dtensor.locals_(lst) for lst in lists]
    groups: Dict[torch.device, List[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault(p.device, []).append(i)
    return [StepCall(name, _impl(name, device, [params[i] for i in idx]),
                     [params[i] for i in idx],
                     [[lst[i] for i in idx] if lst else [] for lst in lists],
                     [masks[i] for i in idx] if masks else [], scalars,
                     {k: _on(v, device) for k, v in extra.items()})
            for device, idx in groups.items()]


def check_step_calls(calls: Sequence[StepCall]) -> None:
    """Every input of ``calls`` checked as their kernels check it, before any of them
    writes: a refusal of the last leaves the first unwritten. (Under ``torch.compile`` each
    call checks its own input when it runs.)"""
    if _is_compiling():
        return
    for call in calls:
        if _unboxed(call):
            getattr(_C, f"check_{call.name}")(call.params, *call.lists, call.masks, *call.scalars,
                                              call.extra["clip_coef"], call.extra["grad_scale"],
                                              call.extra["found_inf"])
        elif call.name == "sgd_step_":
            lr, momentum, dampening, weight_decay = call.scalars[:4]
            _reference.check_sgd_inputs(call.params, *call.lists, call.masks, lr, momentum,
                                        dampening, weight_decay, **call.extra)
        else:
            lr, beta1, beta2, weight_decay, eps, amsgrad, _ = call.scalars
            _reference.check_adamw_inputs(call.params, *call.lists, call.masks, lr, beta1, beta2,
                                          weight_decay, eps, amsgrad, **call.extra)


def run_step_calls(calls: Sequence[StepCall]) -> None:
    """Run ``calls``; the compiled op eagerly through ``torchstruct._C.<name>`` (the same op,
    unboxed: no per-tensor cost of the boxed call)."""
    with torch.no_grad():
        for call in calls:
            if _unboxed(call):
                getattr(_C, call.name)(call.params, *call.lists, call.masks, *call.scalars,
                                       call.extra["clip_coef"], call.extra["grad_scale"],
                                       call.extra["found_inf"])
            else:
                call.fn(call.params, *call.lists, call.masks, *call.scalars, **call.extra)


def _unboxed(call: StepCall) -> bool:
    return call.fn is getattr(torch.ops.torchstruct, call.name, None) and not _is_compiling()


def _one_device(tensors: list):
    """The device of all ``tensors`` (a non-empty list) when they share one and none is a
    DTensor; else None."""
    if _C is not None and not _is_compiling():
        return _C.common_device(tensors)  # (also None for any tensor subclass)
    if _dtensor.any_dtensor(tensors):
        return None
    device = tensors[0].device
    return device if all(t.device == device for t in tensors) else None


def sgd_step_calls(params, grads, momentum_buffers, masks=(), *, lr: float,
                   momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
                   nesterov: bool = False, maximize: bool = False, first_step: bool = False,
                   clip_coef=None, grad_scale=None, found_inf=None) -> List[StepCall]:
    """The calls of :func:`sgd_step_` (one per device), not run."""
    params = list(params)
    if not params:
        return []
    return step_calls(
        "sgd_step_", params, [list(grads), list(momentum_buffers)], list(masks),
        (float(lr), float(momentum), float(dampening), float(weight_decay), bool(nesterov),
         bool(maximize), bool(first_step)),
        {"clip_coef": clip_coef, "grad_scale": grad_scale, "found_inf": found_inf},
    )


def adamw_step_calls(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, masks=(), *,
                     lr: float, beta1: float, beta2: float, weight_decay: float, eps: float,
                     amsgrad: bool = False, maximize: bool = False, clip_coef=None,
                     grad_scale=None, found_inf=None) -> List[StepCall]:
    """The calls of :func:`adamw_step_` (one per device), not run."""
    params = list(params)
    if not params:
        return []
    return step_calls(
        "adamw_step_", params,
        [list(grads), list(exp_avgs), list(exp_avg_sqs), list(max_exp_avg_sqs), list(steps)],
        list(masks),
        (float(lr), float(beta1), float(beta2), float(weight_decay), float(eps), bool(amsgrad),
         bool(maximize)),
        {"clip_coef": clip_coef, "grad_scale": grad_scale, "found_inf": found_inf},
    )


def sgd_step_(*args, **kwargs) -> None:
    """One fused SGD step over ``params`` in place (torch.optim.SGD's arithmetic;
    see ``csrc/ops.cpp`` for the contract), arguments as :func:`sgd_step_calls`.
    Parameters may be on several devices (one op call per device, every device's
    input checked before the first writes); the 0-dim ``clip_coef`` /
    ``grad_scale`` / ``found_inf`` are moved to each."""
    calls = sgd_step_calls(*args, **kwargs)
    check_step_calls(calls)
    run_step_calls(calls)


def adamw_step_(*args, **kwargs) -> None:
    """One fused AdamW step over ``params`` in place (torch.optim.AdamW's
    arithmetic; see ``csrc/ops.cpp`` for the contract), arguments as
    :func:`adamw_step_calls`. Parameters may be on several devices (one op call
    per device, every device's input checked before the first writes)."""
    calls = adamw_step_calls(*args, **kwargs)
    check_step_calls(calls)
    run_step_calls(calls)
