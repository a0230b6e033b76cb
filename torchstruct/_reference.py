"""Pure-PyTorch implementations of every torchstruct op.

This module is the test oracle for the compiled kernels in ``csrc/`` and the
fallback when the extension is not built (or ``TORCHSTRUCT_BACKEND=reference``).
Each public function here has the same signature and semantics as the
corresponding ``torch.ops.torchstruct.*`` op; ``torchstruct._ops`` picks one of
the two. The input validators are shared with ``_ops`` so that both backends
reject bad input with the same errors.
"""

import math
from typing import Iterable, List, Sequence

import torch

__all__ = [
    "FLOAT_DTYPES",
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


def validate_tensors(tensors: Iterable[torch.Tensor], op: str) -> List[torch.Tensor]:
    """Materialize ``tensors`` as a list of dense floating-point tensors.

    Raises ``TypeError`` naming the offending entry for non-tensors, sparse or
    otherwise non-strided tensors, and unsupported dtypes.
    """
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    out = list(tensors)
    for i, t in enumerate(out):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: entry {i} is a {type(t).__name__}, not a tensor")
        if t.layout != torch.strided:
            raise TypeError(
                f"{op}: tensor {i} has layout {t.layout}; sparse and other non-strided "
                f"tensors are not supported (densify with .to_dense() first)"
            )
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(
                f"{op}: tensor {i} has dtype {t.dtype}; supported dtypes are "
                f"float32, float64, float16 and bfloat16"
            )
    return out


def result_dtype(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    """float64 if any input is float64, else float32 (fp16/bf16 accumulate in fp32)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def combine_norms(norms: Sequence[torch.Tensor], norm_type: float, device=None) -> torch.Tensor:
    """Combine p-norms of disjoint parts into the p-norm of the whole.

    inf: the max (NaN-propagating); otherwise ``(sum n_i^p)^(1/p)``. The result is
    on ``device`` (default: the first norm's device) in the widest input dtype.
    """
    if device is None:
        device = norms[0].device
    dtype = torch.float64 if any(n.dtype == torch.float64 for n in norms) else torch.float32
    stacked = torch.stack([n.to(device=device, dtype=dtype) for n in norms])
    if math.isinf(norm_type):
        return stacked.amax()
    return torch.linalg.vector_norm(stacked, norm_type)


def global_norm(tensors: Sequence[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """p-norm of the concatenation of all elements of ``tensors``.

    Returns a 0-dim tensor on the first tensor's device, float64 if any input is
    float64 else float32; ``torch.tensor(0.0)`` for an empty list. NaN anywhere
    gives NaN (for every norm type), inf gives inf. Differentiable. On CPU the
    reduction runs in float64; elsewhere in the result dtype.
    """
    p = validate_norm_type(norm_type)
    tensors = validate_tensors(tensors, "global_norm")
    if not tensors:
        return torch.tensor(0.0)
    device = tensors[0].device
    dtype = result_dtype(tensors)
    norms = [
        torch.linalg.vector_norm(t, p, dtype=_accumulate_dtype(t, dtype))
        for t in tensors
        if t.numel() > 0
    ]
    if not norms:
        return torch.zeros((), dtype=dtype, device=device)
    return combine_norms(norms, p, device).to(dtype)


def _accumulate_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    # PyTorch's CPU norm kernels lose ~1e-4 relative accuracy in float32 on
    # millions of elements; on CPU accumulate in float64 (as the compiled CPU
    # kernel does for its partial sums). Elsewhere the result dtype.
    return torch.float64 if t.device.type == "cpu" else dtype
