"""``torchstruct.optim.SGD``: torch.optim.SGD as one fused pass, with the frozen
rule, element masks, a folded-in global-norm clip and GradScaler support."""
from __future__ import annotations

import torch

from .. import _ops
from ._base import MaskedOptimizer, _number, _scaled_lr

__all__ = ["SGD"]


class SGD(MaskedOptimizer):
    """Stochastic gradient descent (optionally with momentum), as
    ``torch.optim.SGD(foreach=False)`` computes it, in one fused pass per param group.

    Arguments are those of ``torch.optim.SGD``, plus (keyword only):

    * ``masks``: ``{param: bool tensor}``; only the elements where the mask is True
      are updated (masked-out elements and their momentum stay bitwise unchanged).
    * ``max_grad_norm``: clip by the global norm of all stepped gradients, folded
      into the update (the gradients are read, never written). A number >= 0 or None
      (``ValueError`` otherwise, a string included). The last total norm
      is ``optimizer.last_grad_norm``.
    * ``norm_type``: the order of that norm (default 2).

    A param group may set ``lr_scale`` (default 1): it steps with ``lr * lr_scale``
    (schedulers rewrite ``lr`` and keep the ratios); ``lr_scale=0`` leaves the group
    bitwise unchanged, state included.

    Frozen parameters (``requires_grad`` false at step time) are never touched and
    get no state. State is torch's: ``state[p]["momentum_buffer"]`` when momentum
    is not 0, so ``state_dict()`` is interchangeable with ``torch.optim.SGD``'s.

    >>> import torch, torchstruct.optim
    >>> w = torch.nn.Parameter(torch.ones(3))
    >>> opt = torchstruct.optim.SGD([w], lr=0.5)
    >>> w.grad = torch.ones(3)
    >>> opt.step()
    >>> w.detach()
    tensor([0.5000, 0.5000, 0.5000])
    """

    _op = "sgd_step_"
    _group_keys = ("lr", "momentum", "dampening", "weight_decay")
    _state_keys = ("momentum_buffer",)

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, maximize: bool = False,
                 masks=None, max_grad_norm=None, norm_type: float = 2.0,
                 foreach=None, fused=None):
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov, maximize=maximize)
        super().__init__(params, defaults, masks=masks, max_grad_norm=max_grad_norm,
                         norm_type=norm_type, foreach=foreach, fused=fused)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("nesterov", False)

    def _check_group(self, index, group):
        super()._check_group(index, group)
        name = f"SGD: param group {index}"
        momentum = _number(group["momentum"], f"{name}: momentum")
        dampening = _number(group["dampening"], f"{name}: dampening")
        weight_decay = _number(group["weight_decay"], f"{name}: weight_decay")
        if not momentum >= 0:
            raise ValueError(f"{name}: momentum must be >= 0, got {group['momentum']!r}")
        if not weight_decay >= 0:
            raise ValueError(f"{name}: weight_decay must be >= 0, got {group['weight_decay']!r}")
        if dampening != dampening:
            raise ValueError(f"{name}: dampening must be a number, got {group['dampening']!r}")
        if group["nesterov"] and (momentum <= 0 or dampening != 0):
            raise ValueError(f"{name}: Nesterov momentum requires a momentum and zero dampening")

    def _update(self, group, params, grads, masks, clip_coef, grad_scale, found_inf, log):
        momentum = float(group["momentum"])
        kwargs = dict(lr=_scaled_lr(group), momentum=momentum,
                      dampening=float(group["dampening"]),
                      weight_decay=float(group["weight_decay"]), nesterov=bool(group["nesterov"]),
                      maximize=bool(group["maximize"]), clip_coef=clip_coef,
                      grad_scale=grad_scale, found_inf=found_inf)
        if momentum == 0:
            return _ops.sgd_step_calls(params, grads, [], masks, first_step=False, **kwargs)
        # Parameters without a buffer take their first step (buffer = gradient).
        first, later = [], []
        for i, p in enumerate(params):
            state = self.state.get(p)
            buf = None if state is None else state.get("momentum_buffer")
            if buf is None:
                first.append(i)
            else:
                if self._first_check(p):  # state from load_state_dict may be elsewhere: convert
                    new = self._state_like(p, buf, "momentum_buffer")
                    if new is not buf:
                        self._write_state(log, p, "momentum_buffer", new)
                later.append(i)
        if first and found_inf is not None and bool(found_inf.reshape(()) != 0):
            # An overflowed first step creates no buffer (torch skips the whole step), so the
            # next step is a first step again. found_inf is read on the host here, only for
            # parameters still without a buffer (on the CPU it was read before).
            first = []
        for i in first:
            self._write_state(log, params[i], "momentum_buffer", torch.zeros_like(
                params[i], memory_format=torch.preserve_format))
        calls = []
        for idx, is_first in ((later, False), (first, True)):
            if idx:
                calls += _ops.sgd_step_calls(
                    [params[i] for i in idx], [grads[i] for i in idx],
                    [self.state[params[i]]["momentum_buffer"] for i in idx],
                    [masks[i] for i in idx] if masks else [], first_step=is_first, **kwargs)
        return calls
