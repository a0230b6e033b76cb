"""Pure-PyTorch implementations of every torchstruct op.

This module is the test oracle for the compiled kernels in ``csrc/`` and the
fallback when the extension is not built (or ``TORCHSTRUCT_BACKEND=reference``).
Each public function here has the same signature and semantics as the
corresponding ``torch.ops.torchstruct.*`` op; ``torchstruct._ops`` picks one of
the two. The input validators are shared with ``_ops`` so that both backends
reject bad input with the same errors.
"""

import math
from typing import Callable, Iterable, List, Optional, Sequence

import torch

__all__ = [
    "FLOAT_DTYPES",
    "clip_by_global_norm_",
    "clip_coefficient",
    "clip_result_dtype",
    "scale_",
    "validate_max_norm",
    "validate_writable",
    "combine_norms",
    "global_norm",
    "result_dtype",
    "validate_norm_type",
    "validate_tensors",
]

#: dtypes the norm kernels accept (freely mixed in one call).
FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def validate_norm_type(norm_type) -> float:
    """Return ``norm_type`` as a float; ``ValueError`` unless it is > 0 (inf allowed)."""
    try:
        p = float(norm_type)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(
            f"norm_type must be a number > 0 or inf, got {norm_type!r}"
        ) from None
    if math.isnan(p) or p <= 0.0:
        raise ValueError(f"norm_type must be > 0 or inf, got {norm_type!r}")
    return p


def validate_tensors(tensors: Iterable[torch.Tensor], op: str,
                     name_of: Optional[Callable[[int], str]] = None) -> List[torch.Tensor]:
    """Materialize ``tensors`` as a list of dense floating-point tensors.

    Raises ``TypeError`` naming the offending entry for non-tensors, sparse or
    otherwise non-strided tensors, and unsupported dtypes: as ``name_of(i)`` says (e.g.
    "the gradient of 'fc.weight'") where given, else by its index.
    """
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    out = list(tensors)
    for i, t in enumerate(out):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: entry {i} is a {type(t).__name__}, not a tensor")
        if t.layout != torch.strided:
            raise TypeError(
                f"{op}: {_name(i, name_of)} has layout {t.layout}; sparse and other non-strided "
                f"tensors are not supported (densify with .to_dense() first)"
            )
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(
                f"{op}: {_name(i, name_of)} has dtype {t.dtype}; supported dtypes are "
                f"float32, float64, float16 and bfloat16"
            )
    return out


def _name(i: int, name_of: Optional[Callable[[int], str]]) -> str:
    """How an error names entry ``i``: as ``name_of`` says where given, else ``tensor i``."""
    return name_of(i) if name_of is not None else f"tensor {i}"


def result_dtype(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    """float64 if any input is float64, else float32 (fp16/bf16 accumulate in fp32)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def combine_norms(norms: Sequence[torch.Tensor], norm_type: float, device=None) -> torch.Tensor:
    """Combine p-norms of disjoint parts into the p-norm of the whole.

    inf: the max (NaN-propagating); otherwise ``(sum n_i^p)^(1/p)`` (scaled for a general p,
    see :func:`vector_norm`). The result is on ``device`` (default: the first norm's device)
    in the widest input dtype.
    """
    if device is None:
        device = norms[0].device
    dtype = torch.float64 if any(n.dtype == torch.float64 for n in norms) else torch.float32
    stacked = torch.stack([n.to(device=device, dtype=dtype) for n in norms])
    if math.isinf(norm_type):
        return stacked.amax()
    return vector_norm(stacked, norm_type, dtype)


KERNEL_NORMS = (1.0, 2.0, math.inf)  # the norm types the compiled kernels compute


def vector_norm(t: torch.Tensor, p: float, dtype: torch.dtype) -> torch.Tensor:
    """``torch.linalg.vector_norm(t, p, dtype=dtype)``, exact for a general p (not in
    :data:`KERNEL_NORMS`) wherever the norm itself is representable: for p > 1 the elements
    are divided by the largest magnitude ``m`` before their powers are taken, and the result
    multiplied by it (``m * ||t / m||_p``), so ``|x|^p`` neither overflows (``100^200``) nor
    underflows (``0.001^120``) even where the norm is an ordinary number (for p < 1, ``|x|^p``
    lies between ``|x|`` and 1: unscaled). ``m`` is a constant for
    autograd (the norm is homogeneous: the gradient is the same). inf anywhere gives inf,
    NaN anywhere NaN. Never reads a value on the host."""
    if p in KERNEL_NORMS or p < 1.0:  # p < 1: |x|^p lies between |x| and 1, in range
        return torch.linalg.vector_norm(t, p, dtype=dtype)
    x = t.to(dtype)
    m = x.detach().abs().amax()
    scale = torch.where((m > 0) & torch.isfinite(m), m, torch.ones_like(m))
    norm = scale * torch.linalg.vector_norm(x / scale, p)
    return torch.where(torch.isinf(m), m, norm)


def global_norm(tensors: Sequence[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """p-norm of the concatenation of all elements of ``tensors``.

    Returns a 0-dim tensor on the first tensor's device, float64 if any input is
    float64 else float32; ``torch.tensor(0.0)`` for an empty list. NaN anywhere
    gives NaN (for every norm type), inf gives inf. Differentiable. Accumulates in
    :func:`accumulate_dtype`.
    """
    p = validate_norm_type(norm_type)
    tensors = validate_tensors(tensors, "global_norm")
    if not tensors:
        return torch.tensor(0.0)
    device = tensors[0].device
    dtype = result_dtype(tensors)
    norms = [vector_norm(t, p, accumulate_dtype(t.device, dtype, p))
             for t in tensors if t.numel() > 0]
    if not norms:
        return torch.zeros((), dtype=dtype, device=device)
    return combine_norms(norms, p, device).to(dtype)


def accumulate_dtype(device: torch.device, dtype: torch.dtype, p: float) -> torch.dtype:
    """The dtype in which a norm of ``dtype`` results on ``device`` accumulates: float64 on
    the CPU (PyTorch's CPU norm kernels lose ~1e-4 relative accuracy in float32 on millions
    of elements; the compiled CPU kernel sums its partials in double) and for a general p
    (not 1, 2 or inf) anywhere (float64 keeps more of the powers of the elements much smaller
    than the largest, see :func:`vector_norm`); elsewhere ``dtype``."""
    if device.type == "cpu" or p not in (1.0, 2.0, math.inf):
        return torch.float64
    return dtype


# --------------------------------------------------------------------------- clipping


def validate_max_norm(max_norm, name: str = "max_norm", text: bool = True) -> float:
    """Return ``max_norm`` as a float; ``ValueError`` naming ``name`` unless it is >= 0 (inf
    allowed). Read with ``float()`` as ``clip_grad_norm_`` reads it (a one-element tensor, a
    bool, and with ``text`` a numeric string such as ``"1.0"``); ``text=False`` refuses
    strings, as torch's optimizers refuse a hyper-parameter given as text."""
    if not text and isinstance(max_norm, (str, bytes, bytearray)):
        raise ValueError(f"{name} must be a number >= 0, got the string {max_norm!r}")
    try:
        value = float(max_norm)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{name} must be a number >= 0, got {max_norm!r}") from None
    if math.isnan(value) or value < 0.0:
        raise ValueError(f"{name} must be >= 0, got {max_norm!r}")
    return value


def validate_writable(tensors: Sequence[torch.Tensor], op: str,
                      name_of: Optional[Callable[[int], str]] = None) -> None:
    """``RuntimeError`` naming the entry (as :func:`validate_tensors` does) for a tensor
    whose elements share memory (e.g. an expanded tensor), or an inference tensor outside
    inference mode: it cannot be written in place."""
    # (not while torch.compile traces: it cannot trace inference-mode queries, and
    # traced tensors are never inference tensors)
    compiling = getattr(torch.compiler, "is_compiling", lambda: False)()
    outside_inference = not compiling and not torch.is_inference_mode_enabled()
    for i, t in enumerate(tensors):
        problem = unwritable(t, outside_inference)
        if problem is not None:
            raise RuntimeError(f"{op}: {_name(i, name_of)} {problem}")


def unwritable(t: torch.Tensor, outside_inference: bool = True) -> Optional[str]:
    """Why ``t`` cannot be written in place (an inference tensor outside inference mode,
    elements that share memory), or None."""
    if outside_inference and t.is_inference():
        return ("is an inference tensor; in-place updates to inference tensors outside "
                "InferenceMode are not allowed")
    if t.numel() > 1 and not t.is_contiguous() and torch._debug_has_internal_overlap(t) == 1:
        return "has elements that share memory (e.g. an expanded tensor) and cannot be written in place"
    return None


def clip_result_dtype(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    """The dtype ``torch.nn.utils.clip_grad_norm_`` returns its total norm in: the
    promotion of all input dtypes (float16 alone stays float16)."""
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        if t.dtype is not dtype:
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(max_norm / (total_norm + 1e-6), 1)`` as a 0-dim tensor, evaluated as
    ``clip_grad_norm_`` evaluates it (NaN stays NaN)."""
    return ((total_norm + 1e-6).reciprocal() * max_norm).clamp(max=1.0)


def scale_(tensors: Sequence[torch.Tensor], scale: torch.Tensor) -> None:
    """Multiply every tensor in place by the 0-dim tensor ``scale`` (list order: a
    tensor listed twice is multiplied twice)."""
    tensors = validate_tensors(tensors, "scale_")
    if not isinstance(scale, torch.Tensor) or scale.dim() != 0:
        raise ValueError(f"scale_: scale must be a 0-dim tensor, got {scale!r}")
    validate_writable(tensors, "scale_")
    for t in tensors:
        t.mul_(scale if scale.device == t.device or scale.device.type == "cpu" else scale.to(t.device))


def clip_by_global_norm_(grads: Sequence[torch.Tensor], max_norm: float,
                         norm_type: float = 2.0) -> torch.Tensor:
    """In place: ``grads`` scaled by ``min(max_norm / (norm + 1e-6), 1)`` where
    ``norm`` is their global ``norm_type``-norm (accumulated as :func:`global_norm`
    accumulates); returns the norm in the promoted dtype of the grads,
    on the first grad's device (``torch.tensor(0.0)`` for an empty list)."""
    p = validate_norm_type(norm_type)
    max_norm = validate_max_norm(max_norm)
    grads = validate_tensors(grads, "clip_by_global_norm_")
    if not grads:
        return torch.tensor(0.0)
    validate_writable(grads, "clip_by_global_norm_")
    with torch.no_grad():
        norm = global_norm(grads, p)
        scale_(grads, clip_coefficient(norm, max_norm))
    return norm.to(clip_result_dtype(grads))


# ---------------------------------------------------------------------------
# fused optimizer steps (torchstruct.optim): sgd_step_, adamw_step_
# ---------------------------------------------------------------------------


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal strides in every dimension of size > 1 (the memory order matches)."""
    return all(n <= 1 or sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride()))


def _check_like_params(op, what, params, tensors, same_dtype=True):
    if len(tensors) != len(params):
        raise ValueError(f"{op}: expected {len(params)} {what}, got {len(tensors)}")
    for i, (t, p) in enumerate(zip(tensors, params)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {what} {i} is a {type(t).__name__}, not a tensor")
        if t.layout != torch.strided:
            raise RuntimeError(
                f"{op}: {what} {i} has layout {t.layout}; sparse and other non-strided "
                f"tensors are not supported"
            )
        if t.device != p.device:
            raise RuntimeError(f"{op}: {what} {i} is on {t.device} but parameter {i} is on {p.device}")
        if same_dtype and t.dtype != p.dtype:
            raise TypeError(f"{op}: {what} {i} has dtype {t.dtype} but parameter {i} has {p.dtype}")
        if t.shape != p.shape:
            raise ValueError(
                f"{op}: {what} {i} has shape {tuple(t.shape)} but parameter {i} has shape "
                f"{tuple(p.shape)}"
            )
        if not _same_layout(t, p):
            raise ValueError(
                f"{op}: {what} {i} has strides {t.stride()} but parameter {i} has strides "
                f"{p.stride()}; they must be laid out alike"
            )


def _check_hyper(op, name, value, allow_negative=False):
    if math.isnan(value) or (not allow_negative and value < 0):
        raise ValueError(f"{op}: {name} must be >= 0, got {value}")


def _check_scalar_tensor(op, name, t, device):
    if t is None:
        return
    if not isinstance(t, torch.Tensor) or t.numel() != 1:
        raise ValueError(f"{op}: {name} must be a one-element tensor, got {t!r}")
    if t.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{op}: {name} must be float32 or float64, got {t.dtype}")
    if t.device != device:
        raise RuntimeError(f"{op}: {name} is on {t.device} but the parameters are on {device}")


def _check_step_scalars(op, params, clip_coef, grad_scale, found_inf):
    """The optional clip_coef, grad_scale and found_inf of a step, on the parameters' device."""
    if params:
        for name, t in (("clip_coef", clip_coef), ("grad_scale", grad_scale), ("found_inf", found_inf)):
            _check_scalar_tensor(op, name, t, params[0].device)


def validate_step_inputs(op, params, grads, states, masks, steps=None):
    """The checks of ``sgd_step_`` / ``adamw_step_`` (the compiled kernels make the
    same ones): ``states`` is a list of ``(what, tensors)`` matching ``params``."""
    params = list(params)
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{op}: parameter {i} is a {type(p).__name__}, not a tensor")
        if p.layout != torch.strided:
            raise RuntimeError(f"{op}: parameter {i} has layout {p.layout}; only dense tensors")
        if p.device != params[0].device:
            raise RuntimeError(
                f"{op}: all tensors must be on one device, but parameter 0 is on "
                f"{params[0].device} and parameter {i} is on {p.device}"
            )
        if p.dtype not in FLOAT_DTYPES:
            raise TypeError(
                f"{op}: parameter {i} has dtype {p.dtype}; supported dtypes are float32, "
                f"float64, float16 and bfloat16"
            )
        if p.numel() > 0 and not _is_non_overlapping_and_dense(p):
            raise RuntimeError(
                f"{op}: parameter {i} is not dense (it overlaps itself or has gaps); call "
                f".contiguous() first"
            )
    _check_like_params(op, "gradients", params, grads)
    for what, tensors in states:
        _check_like_params(op, what, params, tensors)
    for what, tensors in [("parameters", params), *states, ("steps", steps or ())]:
        validate_writable(tensors, f"{op}: {what}")
    if masks:
        if len(masks) != len(params):
            raise ValueError(
                f"{op}: expected no masks or {len(params)} (one per parameter, None for none), "
                f"got {len(masks)}"
            )
        for i, (m, p) in enumerate(zip(masks, params)):
            if m is None:
                continue
            if not isinstance(m, torch.Tensor) or m.dtype != torch.bool:
                raise TypeError(f"{op}: mask {i} must be a bool tensor, got "
                                f"{getattr(m, 'dtype', type(m).__name__)}")
            if m.device != p.device:
                raise RuntimeError(f"{op}: mask {i} is on {m.device} but parameter {i} is on {p.device}")
            if m.shape != p.shape:
                raise ValueError(f"{op}: mask {i} has shape {tuple(m.shape)} but parameter {i} "
                                 f"has shape {tuple(p.shape)}")
            if not _same_layout(m, p):
                raise ValueError(f"{op}: mask {i} has strides {m.stride()} but parameter {i} has "
                                 f"strides {p.stride()}; they must be laid out alike")
    if steps is not None:
        if len(steps) != len(params):
            raise ValueError(f"{op}: expected {len(params)} step tensors, got {len(steps)}")
        for i, (s, p) in enumerate(zip(steps, params)):
            if not isinstance(s, torch.Tensor) or s.numel() != 1:
                raise ValueError(f"{op}: step {i} must be a one-element tensor")
            if s.dtype != torch.float32:
                raise TypeError(f"{op}: step {i} must be float32, got {s.dtype}")
            if s.device != p.device:
                raise RuntimeError(f"{op}: step {i} is on {s.device} but parameter {i} is on {p.device}")
        first = {}
        for i, s in enumerate(steps):
            j = first.setdefault(_place(s)[:2], i)
            if j != i:
                raise RuntimeError(f"{op}: step {i} and step {j} are the same tensor; each "
                                   f"parameter needs its own step count")
    if len({_place(p)[:2] for p in params if p.numel() > 0}) != sum(1 for p in params if p.numel() > 0):
        raise RuntimeError(f"{op}: a parameter shares its memory with another; each tensor may be "
                           f"stepped once per call")
    return params


def _place(t: torch.Tensor) -> tuple[object, int, int]:
    """Where ``t``'s bytes are: ``(memory, start, end)``, the byte range ``[start, end)`` it may
    touch in that memory. Memory is a device's address space (tensors on different storages
    may share bytes: ``from_numpy``, dlpack), or, for ``meta`` tensors, which have no bytes,
    their storage."""
    if t.is_meta:
        memory, start = ("meta", t.untyped_storage()._cdata), t.storage_offset() * t.element_size()
    else:
        memory, start = t.device, t.data_ptr()
    n = t.numel()
    if n == 0:
        return memory, 0, 0
    span = n if t.is_contiguous() else 1 + sum((k - 1) * abs(s)
                                               for k, s in zip(t.shape, t.stride()))
    return memory, start, start + span * t.element_size()


def _is_non_overlapping_and_dense(t: torch.Tensor) -> bool:
    order = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n > 1)
    expected = 1
    for stride, size in order:
        if stride != expected:
            return False
        expected *= size
    return True


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype


def _effective_grad(grad, compute, clip_coef, grad_scale, maximize):
    """The gradient as the update uses it: unscaled (times float32(1/grad_scale),
    as GradScaler unscales), clipped, negated for maximize. ``grad`` is not written."""
    g = grad.to(compute)
    if grad_scale is not None:
        inv = grad_scale.double().reciprocal().float()
        g = g * inv.to(compute)
    if clip_coef is not None:
        g = g * clip_coef.to(compute)
    if maximize:
        g = -g
    return g


def _write_back(dst, new, keep):
    """dst <- new, except where ``keep`` (bool tensor or None) is True."""
    if keep is None:
        dst.copy_(new)
    else:
        dst.copy_(torch.where(keep, dst, new.to(dst.dtype)))


def _keep_mask(mask, found_inf):
    """Where the old values stay: masked-out elements, or everything when found_inf != 0."""
    keep = None if mask is None else ~mask
    if found_inf is not None:
        skip = found_inf.reshape(()) != 0
        keep = skip if keep is None else keep | skip
    return keep


def check_sgd_inputs(params, grads, momentum_buffers, masks, lr, momentum, dampening,
                     weight_decay, clip_coef, grad_scale, found_inf):
    """Every check of ``sgd_step_`` (the compiled kernels make the same ones); returns
    ``(params, momentum_buffers)`` as lists."""
    op = "sgd_step_"
    _check_hyper(op, "lr", lr)
    _check_hyper(op, "momentum", momentum)
    _check_hyper(op, "dampening", dampening, allow_negative=True)
    _check_hyper(op, "weight_decay", weight_decay)
    params = list(params)
    momentum_buffers = list(momentum_buffers)
    if momentum == 0 and momentum_buffers:
        raise ValueError(f"{op}: momentum is 0, so no momentum buffers are expected")
    states = [("momentum buffers", momentum_buffers)] if momentum != 0 else []
    validate_step_inputs(op, params, grads, states, masks)
    _check_step_scalars(op, params, clip_coef, grad_scale, found_inf)
    return params, momentum_buffers


def check_adamw_inputs(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, masks, lr,
                       beta1, beta2, weight_decay, eps, amsgrad, clip_coef, grad_scale,
                       found_inf):
    """Every check of ``adamw_step_`` (the compiled kernels make the same ones); returns
    ``(params, max_exp_avg_sqs)`` as lists."""
    op = "adamw_step_"
    _check_hyper(op, "lr", lr)
    if not 0.0 <= beta1 < 1.0:
        raise ValueError(f"{op}: beta1 must be in [0, 1), got {beta1}")
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"{op}: beta2 must be in [0, 1), got {beta2}")
    _check_hyper(op, "weight_decay", weight_decay)
    _check_hyper(op, "eps", eps)
    params = list(params)
    max_exp_avg_sqs = list(max_exp_avg_sqs)
    if not amsgrad and max_exp_avg_sqs:
        raise ValueError(f"{op}: amsgrad is off, so no max_exp_avg_sqs are expected")
    states = [("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs)]
    if amsgrad:
        states.append(("max_exp_avg_sqs", max_exp_avg_sqs))
    validate_step_inputs(op, params, grads, states, masks, steps)
    _check_step_scalars(op, params, clip_coef, grad_scale, found_inf)
    return params, max_exp_avg_sqs


def sgd_step_(params, grads, momentum_buffers, masks, lr, momentum, dampening, weight_decay,
              nesterov, maximize, first_step, clip_coef=None, grad_scale=None, found_inf=None):
    """torch.optim.SGD's single-tensor step (foreach=False), in place, with masks, a
    clip coefficient and grad_scale/found_inf (see ``csrc/ops.cpp``). float16/bfloat16
    compute in float32."""
    params, momentum_buffers = check_sgd_inputs(params, grads, momentum_buffers, masks, lr,
                                                momentum, dampening, weight_decay, clip_coef,
                                                grad_scale, found_inf)
    with torch.no_grad():
        for i, p in enumerate(params):
            mask = masks[i] if masks else None
            keep = _keep_mask(mask, found_inf)
            compute = _compute_dtype(p)
            g = _effective_grad(grads[i], compute, clip_coef, grad_scale, maximize)
            p_c = p.to(compute)
            if weight_decay != 0:
                g = g.add(p_c, alpha=weight_decay)
            if momentum != 0:
                if first_step:
                    buf = g.clone()
                else:
                    buf = momentum_buffers[i].to(compute, copy=True)
                    buf.mul_(momentum).add_(g, alpha=1 - dampening)
                g = g.add(buf, alpha=momentum) if nesterov else buf
                _write_back(momentum_buffers[i], buf, keep)
            if keep is None and compute == p.dtype:
                p.add_(g, alpha=-lr)
            else:
                _write_back(p, p_c.add(g, alpha=-lr), keep)


def adamw_step_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, masks, lr, beta1,
                beta2, weight_decay, eps, amsgrad, maximize, clip_coef=None, grad_scale=None,
                found_inf=None):
    """torch.optim.AdamW's single-tensor step (foreach=False), in place, with masks, a
    clip coefficient and grad_scale/found_inf (see ``csrc/ops.cpp``). ``steps`` are
    float32 one-element tensors, advanced by one (not when found_inf != 0); the bias
    corrections are computed from the advanced count in float64, as torch does with
    ``step.item()``, but without reading it on the host. float16/bfloat16 compute in
    float32."""
    params, max_exp_avg_sqs = check_adamw_inputs(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, masks, lr, beta1, beta2,
        weight_decay, eps, amsgrad, clip_coef, grad_scale, found_inf)
    with torch.no_grad():
        for i, p in enumerate(params):
            mask = masks[i] if masks else None
            keep = _keep_mask(mask, found_inf)
            compute = _compute_dtype(p)
            direct = keep is None and compute == p.dtype  # update the tensors themselves
            g = _effective_grad(grads[i], compute, clip_coef, grad_scale, maximize)
            param = p if direct else p.to(compute, copy=True)
            exp_avg = exp_avgs[i] if direct else exp_avgs[i].to(compute, copy=True)
            exp_avg_sq = exp_avg_sqs[i] if direct else exp_avg_sqs[i].to(compute, copy=True)

            step = steps[i].reshape(()) + 1  # float32, as torch's step_t += 1
            step_d = step.double()
            bias_correction1 = 1 - torch.pow(beta1, step_d)
            bias_correction2 = 1 - torch.pow(beta2, step_d)
            neg_step_size = (-(lr / bias_correction1)).to(compute)
            bias_correction2_sqrt = bias_correction2.sqrt().to(compute)

            if weight_decay != 0:
                param.mul_(1 - lr * weight_decay)
            exp_avg.lerp_(g, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            if amsgrad:
                vmax = max_exp_avg_sqs[i] if direct else max_exp_avg_sqs[i].to(compute, copy=True)
                torch.maximum(vmax, exp_avg_sq, out=vmax)
                denom = (vmax.sqrt() / bias_correction2_sqrt).add_(eps)
            else:
                denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
            # addcdiv_(exp_avg, denom, value=-step_size) computes (value * exp_avg) / denom
            param.add_((exp_avg * neg_step_size).div_(denom))

            if not direct:
                _write_back(p, param, keep)
                _write_back(exp_avgs[i], exp_avg, keep)
                _write_back(exp_avg_sqs[i], exp_avg_sq, keep)
                if amsgrad:
                    _write_back(max_exp_avg_sqs[i], vmax, keep)
            if found_inf is None:
                steps[i].copy_(step.reshape(steps[i].shape))
            else:
                steps[i].copy_(torch.where(found_inf.reshape(()) != 0, steps[i].reshape(()), step)
                               .reshape(steps[i].shape))
