"""Fused optimizers that respect torchstruct's rules.

``SGD`` and ``AdamW`` subclass ``torch.optim.Optimizer`` (param groups,
``state_dict``, LR schedulers, ``zero_grad``) and compute what
``torch.optim.SGD`` / ``AdamW`` with ``foreach=False`` compute, in one fused pass
per param group, and also:

* never touch a frozen parameter (``requires_grad`` false at step time): no
  read, no write, no state entry -- even with a stale ``.grad`` and weight decay;
* take element masks, ``masks={param: bool tensor}``: masked-out elements and
  their state stay bitwise unchanged;
* fold the global-norm clip into the update (``max_grad_norm=``): gradients are
  read once for the norm and once for the update, never written;
* work with ``torch.amp.GradScaler`` (``grad_scale`` / ``found_inf`` as PyTorch's
  fused optimizers take them).

See ``docs/optimizers.md``.
"""
from ._base import MaskedOptimizer
from .adamw import AdamW
from .sgd import SGD

__all__ = ["AdamW", "MaskedOptimizer", "SGD"]
