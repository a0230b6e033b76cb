"""The one seam between torchstruct and its kernels.

Every op exists twice: compiled (``torch.ops.torchstruct.<name>``, registered by
the ``torchstruct._C`` extension built from ``csrc/``) and pure PyTorch
(``torchstruct._reference.<name>``, same signature and semantics). The
functions here validate input, split it by device, and send each part to the
compiled kernel when the compiled backend is active and has a kernel for that
device type, else to the reference implementation.

Backend selection:

* ``backend()`` is ``"compiled"`` when the extension is loaded and not
  overridden, else ``"reference"``. Which device types have compiled kernels is
  told by ``compiled_device_types()`` (``("cpu",)`` or ``("cpu", "cuda")``).
* ``TORCHSTRUCT_BACKEND=reference`` (read at import) forces the reference even
  when the extension is built.
* ``use_backend(name)`` switches temporarily (tests, debugging).

Inputs that need autograd (grad mode on and a tensor that requires grad) go to
the reference implementation, which is differentiable; the compiled kernels are
not.

Adding an op: a kernel in ``csrc/`` registered under the same name (it must
check all its input before writing anything), a function of that name in
``_reference.py``, its fake kernel below, its name in ``_OPS``, and a wrapper
here that calls ``_per_device(name, tensors, args, validate)``.
"""

import contextlib
import os
import warnings
from typing import Callable, Dict, Iterator, List, Sequence, Tuple

import torch

from . import _reference

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
    "global_norm",
    "use_backend",
]

BACKENDS = ("compiled", "reference")

#: names of the ops registered as torch.ops.torchstruct.<name>
_OPS = ("global_norm",)

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
    if forced == "reference":
        return "reference"
    if forced not in ("", "auto", "compiled"):
        warnings.warn(
            f"TORCHSTRUCT_BACKEND={forced!r} is not one of 'compiled', 'reference'; ignored",
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


def compiled_available() -> bool:
    """True when the compiled extension ``torchstruct._C`` is loaded."""
    return _C is not None


def compiled_device_types() -> Tuple[str, ...]:
    """Device types with compiled kernels: ``()``, ``("cpu",)`` or ``("cpu", "cuda")``."""
    if _C is None:
        return ()
    return ("cpu", "cuda") if getattr(_C, "WITH_CUDA", 0) else ("cpu",)


def backend() -> str:
    """The active backend: ``"compiled"`` (the ``torchstruct._C`` kernels, used
    for every device type they were built for; see ``compiled_device_types()``)
    or ``"reference"`` (pure PyTorch)."""
    return _backend


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Make ``name`` (``"compiled"`` or ``"reference"``) the active backend inside
    the block; the previous one is restored on exit, also on error."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    if name == "compiled" and _C is None:
        raise RuntimeError(
            f"the compiled backend is not available: torchstruct._C failed to import "
            f"({_C_IMPORT_ERROR})"
        )
    previous = _backend
    _backend = name
    try:
        yield
    finally:
        _backend = previous


def _needs_autograd(tensors: Sequence[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _is_compiling() -> bool:
    try:
        return torch.compiler.is_compiling()
    except AttributeError:  # older spelling
        return torch._dynamo.is_compiling()


def _impl(name: str, device: torch.device, tensors: Sequence[torch.Tensor]):
    """The implementation of op ``name`` for ``tensors`` (all on ``device``):
    the compiled op when it is active, has a kernel for the device type and no
    autograd graph is needed, else the reference function."""
    if (
        _backend == "compiled"
        and device.type in _KERNELS[name]
        and not _needs_autograd(tensors)
    ):
        return getattr(torch.ops.torchstruct, name)
    return getattr(_reference, name)


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
) -> List[torch.Tensor]:
    """Run op ``name`` as ``op(part, *args)`` for each device's part of the
    non-empty list ``tensors``; the results in order of first appearance.

    Fast path (eager, compiled backend): one call of the compiled op on the
    whole list, which checks its input in C++; if it refuses (several devices,
    bad input), the checked path runs: ``validate`` (raises clear errors), then
    one call per device through ``_impl``. The compiled kernels check every
    input before they write anything, so a refused call has no effect.
    """
    first = tensors[0]
    if (
        _backend == "compiled"
        and isinstance(first, torch.Tensor)
        and first.device.type in _KERNELS[name]
        and not _is_compiling()
    ):
        try:
            if not _needs_autograd(tensors):
                return [getattr(torch.ops.torchstruct, name)(tensors, *args)]
        except (AttributeError, RuntimeError, TypeError, ValueError, NotImplementedError):
            pass  # explained or handled by the checked path
    tensors = validate(tensors)
    groups = _group_by_device(tensors)
    return [_impl(name, device, part)(part, *args) for device, part in groups.items()]


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


# ---------------------------------------------------------------------------
# ops
# ---------------------------------------------------------------------------


def global_norm(tensors: Sequence[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """p-norm of the concatenation of all elements of ``tensors``.

    ``tensors``: any sequence of dense float32/float64/float16/bfloat16 tensors,
    possibly empty, possibly on several devices. ``norm_type``: any p > 0, or
    ``inf`` (``ValueError`` otherwise). Returns a 0-dim tensor on the first
    tensor's device, float64 if any input is float64 else float32
    (``torch.tensor(0.0)`` for an empty list). NaN anywhere gives NaN, inf gives
    inf. Each device's part is reduced by one kernel call; the per-device norms
    are then combined.
    """
    p = _reference.validate_norm_type(norm_type)
    tensors = list(tensors) if not isinstance(tensors, torch.Tensor) else [tensors]
    if not tensors:
        return torch.tensor(0.0)
    norms = _per_device("global_norm", tensors, (p,), _validate_float_tensors("global_norm"))
    if len(norms) == 1:
        return norms[0]
    return _reference.combine_norms(norms, p, tensors[0].device)


def _validate_float_tensors(op: str) -> Callable[[List[torch.Tensor]], List[torch.Tensor]]:
    return lambda tensors: _reference.validate_tensors(tensors, op)
