"""Every torchstruct op on PyTorch's own multi-tensor and fused ops.

This is what a device without compiled kernels runs (a CUDA GPU with a
CPU-only build of the extension, the common case when nvcc was missing at
install time): the same signatures, checks and semantics as
``torchstruct._reference`` and the compiled ops, with a few launches per call
instead of one Python loop per tensor.

* ``global_norm``: ``torch._foreach_norm`` per dtype (fp16/bf16 accumulate in
  float32, float64 in float64, everything on the CPU in float64 as the kernels do),
  then one reduction of the per-tensor norms; a general p (not 1, 2 or inf, which
  no kernel computes) by ``general_norm``: the elements scaled by the largest, their
  powers taken in place on copies, the sums by the 1-norm (also where the device has
  kernels: ``_ops`` passes their inf- and 1-norms in).
* ``scale_``: ``torch._foreach_mul_`` by the 0-dim scale on the device (entry
  by entry, in list order, when entries share memory).
* ``clip_by_global_norm_``: the two above; the coefficient never leaves the
  device.
* ``sgd_step_`` / ``adamw_step_``: ``torch._fused_sgd_`` / ``torch._fused_adamw_``
  per dtype where the device has them (else ``_reference``). The fused ops
  divide the gradients by ``grad_scale`` and write them back, so whenever a
  grad scale or a clip coefficient applies they get copies of the gradients
  (the optimizers never rewrite gradients), with ``grad_scale / clip_coef`` as
  their scale (float32 and float64 parameters with a clip coefficient: copies
  unscaled and clipped beforehand, in their dtype); they skip a step only when ``found_inf == 1``, so they get
  ``float(found_inf != 0)``. Masked parameters: the fused update runs on them
  too, and their masked-out elements (parameter and state) are then put back
  from copies taken before, bitwise. Not used for float16/bfloat16 on the CPU,
  where ``torch._fused_sgd_`` leaves the vectorized part of such tensors
  unchanged (torch 2.13; ``tests/test_fallback.py`` checks the fused ops there).
"""
import math
from typing import Callable, Dict, List, Optional, Sequence

import torch

from . import _reference

__all__ = ["adamw_step_", "clip_by_global_norm_", "global_norm", "scale_", "sgd_step_"]

_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA", "mps": "MPS", "xpu": "XPU", "hpu": "HPU"}
_fused_cache: Dict[tuple, bool] = {}
#: (op, device type, dtype) the fused op gets wrong
_FUSED_BROKEN = {("_fused_sgd_", "cpu", torch.float16), ("_fused_sgd_", "cpu", torch.bfloat16)}


def has_fused(op: str, device: torch.device, dtype: Optional[torch.dtype] = None) -> bool:
    """Whether ``torch.<op>`` (``_fused_sgd_`` / ``_fused_adamw_``) has a kernel for the
    device type (and computes ``dtype`` right)."""
    if (op, device.type, dtype) in _FUSED_BROKEN:
        return False
    key = (op, device.type)
    if key not in _fused_cache:
        try:
            from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

            listed = device.type in _get_fused_kernels_supported_devices()
        except ImportError:
            listed = device.type in ("cpu", "cuda")
        dispatch = _DISPATCH_KEYS.get(device.type)
        try:
            registered = dispatch is not None and torch._C._dispatch_has_kernel_for_dispatch_key(
                f"aten::{op}", dispatch)
        except Exception:  # private API missing: trust the list
            registered = listed
        _fused_cache[key] = bool(listed and registered and hasattr(torch, op))
    return _fused_cache[key]


def _by_dtype(tensors: Sequence[torch.Tensor]) -> Dict[torch.dtype, List[int]]:
    groups: Dict[torch.dtype, List[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return groups


def _entries_overlap(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the memory of two non-empty entries overlaps (the same tensor twice, or views)."""
    spans = []
    for t in tensors:
        n = t.numel()
        if n == 0:
            continue
        if t.is_contiguous():
            extent = n
        else:
            extent = sum((k - 1) * s for k, s in zip(t.shape, t.stride())) + 1
        begin = t.data_ptr()
        spans.append((begin, begin + extent * t.element_size()))
    spans.sort()
    return any(spans[i][0] < spans[i - 1][1] for i in range(1, len(spans)))


def _in_list_order(device: torch.device) -> bool:
    """Whether a foreach op on ``device`` runs tensor by tensor in list order (the CPU's
    per-tensor loop), so entries that share memory are handled as a Python loop would."""
    return device.type == "cpu"


# --------------------------------------------------------------------------- norms


def global_norm(tensors: Sequence[torch.Tensor], norm_type: float = 2.0,
                norm: Optional[Callable] = None) -> torch.Tensor:
    """As ``_reference.global_norm``: ``torch._foreach_norm`` per dtype, one reduction; a
    general p by :func:`general_norm`, with ``norm`` (default: this function)."""
    p = _reference.validate_norm_type(norm_type)
    tensors = _reference.validate_tensors(tensors, "global_norm")
    if not tensors:
        return torch.tensor(0.0)
    device = tensors[0].device
    dtype = _reference.result_dtype(tensors)
    nonempty = [t for t in tensors if t.numel() > 0]
    if not nonempty:
        return torch.zeros((), dtype=dtype, device=device)
    acc = _reference.accumulate_dtype(device, dtype, p)
    with torch.no_grad():
        if p not in _reference.KERNEL_NORMS:
            return general_norm(nonempty, p, norm or global_norm).to(dtype)
        parts = []
        for group_dtype, idx in _by_dtype(nonempty).items():
            group_acc = torch.float64 if group_dtype == torch.float64 else acc
            norms = torch._foreach_norm([nonempty[i] for i in idx], p, dtype=group_acc)
            parts.append(torch.stack(norms).to(acc))
        stacked = parts[0] if len(parts) == 1 else torch.cat(parts)
        total = stacked.amax() if p == float("inf") else torch.linalg.vector_norm(stacked, p)
    return total.to(dtype)


#: elements copied at a time by a general-p norm (16 MiB of float32 copies)
_GENERAL_BATCH = 1 << 22
#: the least ``p log y`` whose power counts: ``e^-80`` is above float32's smallest normal
#: number (1.2e-38), so no power becomes a slow subnormal; each element adds at most ``e^-80`` (next to
#: the largest element's power, 1: below any rounding until 10^27 elements)
_LEAST_LOG_POWER = -80.0
#: the largest p taken as is by a general-p norm (beyond, float32 would hold it as inf):
#: ``n^(1/p)`` is 1 in float64 for any count of elements
_LARGEST_P = 1e20


def general_norm(tensors: Sequence[torch.Tensor], p: float, norm: Callable) -> torch.Tensor:
    """The norm of a general ``p`` (not 1, 2 or inf) of non-empty ``tensors`` on one device
    (0-dim, float64), as ``_reference.vector_norm`` takes it for one tensor. ``norm(list, q)``
    gives the inf-norm and the 1-norms (the sums of the powers): the compiled op where the
    device has it, else :func:`global_norm`. Multi-tensor ops in place on copies of at most
    ``_GENERAL_BATCH`` elements.

    p > 1: every element divided by the largest magnitude ``m`` of all before its power is
    taken, the sum rooted and multiplied by ``m``; the powers as ``exp(p log y)`` (vectorized;
    its relative error, ~``p |log y| eps``, is largest on the terms that count least), in
    float32 unless some tensor is float64; a p beyond ``_LARGEST_P`` is taken as that (the
    norm differs by a factor ``n^(1/p)``, 1 in float64). p < 1: ``|x|^p`` lies between
    ``|x|`` and 1, in range without scaling (a scaled small element could underflow while its
    power counts); in float64, whose precision the root's ``1/p`` needs."""
    if p < 1.0:
        sums = [norm(_abs_copies(batch, torch.float64, lambda y: torch._foreach_pow_(y, p)), 1.0)
                for batch in _batches(tensors, _GENERAL_BATCH)]
        return torch.stack(sums).sum().pow(1.0 / p)
    m = norm(tensors, math.inf).to(torch.float64)
    usable = torch.isfinite(m) & (m > 0)
    scale = torch.where(usable, m, torch.ones_like(m))
    # float64 when the result is (any float64 input), else float32: scaled, the powers stay
    # in range
    work = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    q = min(p, _LARGEST_P)

    def powers(y):
        torch._foreach_div_(y, [scale.to(work)] * len(y))  # (m is exact in every dtype)
        torch._foreach_log_(y)
        torch._foreach_mul_(y, q)
        torch._foreach_clamp_min_(y, _LEAST_LOG_POWER)
        torch._foreach_exp_(y)

    sums = [norm(_abs_copies(batch, work, powers), 1.0).to(torch.float64)
            for batch in _batches(tensors, _GENERAL_BATCH)]
    total = scale * torch.stack(sums).sum().pow(1.0 / q)
    return torch.where(usable, total, m)  # 0, inf or NaN: m itself


def _abs_copies(batch: Sequence[torch.Tensor], dtype: torch.dtype, fn: Callable) -> list:
    """``|t|`` of each tensor of ``batch`` as a new tensor of ``dtype``, ``fn`` applied to the
    list (in place)."""
    y = [t.abs() if t.dtype == dtype else t.to(dtype).abs_() for t in batch]
    fn(y)
    return y


def _batches(tensors: Sequence[torch.Tensor], size: int):
    """Consecutive runs of ``tensors`` of at most ``size`` elements (a larger tensor alone)."""
    run, count = [], 0
    for t in tensors:
        if run and count + t.numel() > size:
            yield run
            run, count = [], 0
        run.append(t)
        count += t.numel()
    if run:
        yield run


def scale_(tensors: Sequence[torch.Tensor], scale: torch.Tensor) -> None:
    """As ``_reference.scale_``: ``torch._foreach_mul_`` by ``scale`` on the device."""
    tensors = _reference.validate_tensors(tensors, "scale_")
    if not isinstance(scale, torch.Tensor) or scale.dim() != 0:
        raise ValueError(f"scale_: scale must be a 0-dim tensor, got {scale!r}")
    _reference.validate_writable(tensors, "scale_")
    if not tensors:
        return
    device = tensors[0].device
    if scale.device != device:
        scale = scale.to(device, non_blocking=True)
    with torch.no_grad():
        if not _in_list_order(device) and _entries_overlap(tensors):
            # entry by entry, in list order: a duplicate is multiplied twice, and no two
            # blocks of one launch write the same element
            for t in tensors:
                t.mul_(scale)
            return
        for idx in _by_dtype(tensors).values():
            torch._foreach_mul_([tensors[i] for i in idx], scale)


def clip_by_global_norm_(grads: Sequence[torch.Tensor], max_norm: float,
                         norm_type: float = 2.0, norm: Optional[Callable] = None) -> torch.Tensor:
    """As ``_reference.clip_by_global_norm_``, on the multi-tensor ops above (``norm``: as
    :func:`global_norm` takes it)."""
    p = _reference.validate_norm_type(norm_type)
    max_norm = _reference.validate_max_norm(max_norm)
    grads = _reference.validate_tensors(grads, "clip_by_global_norm_")
    if not grads:
        return torch.tensor(0.0)
    _reference.validate_writable(grads, "clip_by_global_norm_")
    with torch.no_grad():
        total = global_norm(grads, p, norm)
        scale_(grads, _reference.clip_coefficient(total, max_norm))
    return total.to(_reference.clip_result_dtype(grads))


# --------------------------------------------------------------------------- optimizer steps


def _fused_scalars(device, clip_coef, grad_scale, found_inf):
    """``(scale, skip)`` for a fused op: the float32 divisor of the gradients (None: none)
    and ``float(found_inf != 0)`` (None: none), on ``device``."""
    scale = None
    if grad_scale is not None:
        scale = grad_scale.reshape(()).to(device=device, dtype=torch.float32)
    if clip_coef is not None:
        coef = clip_coef.reshape(()).to(device=device, dtype=torch.float32)
        scale = coef.reciprocal() if scale is None else scale / coef
    skip = None
    if found_inf is not None:
        skip = (found_inf.reshape(()) != 0).to(device=device, dtype=torch.float32)
    return scale, skip


def _keep_masked_out(masks: Sequence[Optional[torch.Tensor]], *lists: Sequence[torch.Tensor]):
    """Copies of the masked tensors of ``lists`` (parallel to ``masks``), and a function that
    puts their masked-out elements back after an update."""
    saved = [(t, m, t.clone()) for m, *ts in zip(masks, *lists) if m is not None for t in ts]

    def restore():
        for t, m, old in saved:
            t.copy_(torch.where(m, t, old))

    return restore


def _bump_versions(*lists: Sequence[torch.Tensor]) -> None:
    """Advance the version counters of tensors a fused op wrote (``torch._fused_sgd_`` and
    ``torch._fused_adamw_`` leave them), as every in-place op does: a backward through a
    value saved before the step raises instead of using the new value."""
    for tensors in lists:
        for t in tensors:
            torch.autograd.graph.increment_version(t)


def _grads_for_fused(grads, dtype, scale, clip_coef, grad_scale):
    """``(gradients, grad_scale)`` to give a fused op updating parameters of ``dtype``. For
    float32/float64 ones with a clip coefficient: copies unscaled and clipped in that dtype as
    ``_reference`` computes them (times float32(1/grad_scale), times the coefficient), and no
    grad_scale: the fused ops take one float32 divisor, which cannot hold ``grad_scale /
    coef`` when the coefficient is tiny (inf: no update at all) and rounds a float64
    coefficient. Otherwise the gradients (copies when the op is to unscale them: it writes
    them back) and ``scale`` (see :func:`_fused_scalars`)."""
    if clip_coef is None or dtype not in (torch.float32, torch.float64):
        return (grads if scale is None else [g.clone() for g in grads]), scale
    device = grads[0].device
    coef = clip_coef.reshape(()).to(device=device, dtype=dtype)
    if grad_scale is None:
        return torch._foreach_mul(grads, coef), None
    inv = grad_scale.reshape(()).double().reciprocal().float().to(device=device, dtype=dtype)
    out = torch._foreach_mul(grads, inv)
    torch._foreach_mul_(out, coef)
    return out, None


def sgd_step_(params, grads, momentum_buffers, masks, lr, momentum, dampening, weight_decay,
              nesterov, maximize, first_step, clip_coef=None, grad_scale=None, found_inf=None):
    """As ``_reference.sgd_step_``, on ``torch._fused_sgd_``."""
    params, momentum_buffers = _reference.check_sgd_inputs(
        params, grads, momentum_buffers, masks, lr, momentum, dampening, weight_decay, clip_coef,
        grad_scale, found_inf)
    if not params:
        return
    device = params[0].device
    masks = list(masks) if masks else [None] * len(params)
    with torch.no_grad():
        scale, skip = _fused_scalars(device, clip_coef, grad_scale, found_inf)
        for dtype, idx in _by_dtype(params).items():
            ps = [params[i] for i in idx]
            bufs = [momentum_buffers[i] for i in idx] if momentum != 0 else []
            part_masks = [masks[i] for i in idx]
            if not has_fused("_fused_sgd_", device, dtype):
                _reference.sgd_step_(ps, [grads[i] for i in idx], bufs, part_masks, lr, momentum,
                                     dampening, weight_decay, nesterov, maximize, first_step,
                                     clip_coef, grad_scale, found_inf)
                continue
            restore = _keep_masked_out(part_masks, ps, *([bufs] if bufs else []))
            gs, divisor = _grads_for_fused([grads[i] for i in idx], dtype, scale, clip_coef,
                                           grad_scale)
            torch._fused_sgd_(
                ps, gs, bufs, weight_decay=weight_decay, momentum=momentum, lr=lr,
                dampening=dampening, nesterov=nesterov, maximize=maximize,
                is_first_step=bool(first_step and bufs), grad_scale=divisor, found_inf=skip)
            _bump_versions(ps, bufs)
            restore()


def adamw_step_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, masks, lr, beta1,
                beta2, weight_decay, eps, amsgrad, maximize, clip_coef=None, grad_scale=None,
                found_inf=None):
    """As ``_reference.adamw_step_``, on ``torch._fused_adamw_``."""
    params, max_exp_avg_sqs = _reference.check_adamw_inputs(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, masks, lr, beta1, beta2,
        weight_decay, eps, amsgrad, clip_coef, grad_scale, found_inf)
    if not params:
        return
    device = params[0].device
    masks = list(masks) if masks else [None] * len(params)
    with torch.no_grad():
        scale, skip = _fused_scalars(device, clip_coef, grad_scale, found_inf)
        for dtype, idx in _by_dtype(params).items():
            ps = [params[i] for i in idx]
            ms = [exp_avgs[i] for i in idx]
            vs = [exp_avg_sqs[i] for i in idx]
            vmaxs = [max_exp_avg_sqs[i] for i in idx] if amsgrad else []
            part_steps = [steps[i] for i in idx]
            if not has_fused("_fused_adamw_", device, dtype):
                _reference.adamw_step_(ps, [grads[i] for i in idx], ms, vs, vmaxs, part_steps,
                                       [masks[i] for i in idx], lr, beta1, beta2, weight_decay,
                                       eps, amsgrad, maximize, clip_coef, grad_scale, found_inf)
                continue
            restore = _keep_masked_out([masks[i] for i in idx], ps, ms, vs,
                                       *([vmaxs] if amsgrad else []))
            # the fused op reads the advanced count; a skipped step does not advance it
            torch._foreach_add_(part_steps, 1.0 if skip is None else 1.0 - skip)
            gs, divisor = _grads_for_fused([grads[i] for i in idx], dtype, scale, clip_coef,
                                           grad_scale)
            torch._fused_adamw_(
                ps, gs, ms, vs, vmaxs, part_steps, lr=lr, beta1=beta1, beta2=beta2,
                weight_decay=weight_decay, eps=eps, amsgrad=amsgrad, maximize=maximize,
                grad_scale=divisor, found_inf=skip)
            _bump_versions(ps, ms, vs, vmaxs)
            restore()
