"""``torchstruct.optim.AdamW``: torch.optim.AdamW as one fused pass, with the
frozen rule, element masks, a folded-in global-norm clip and GradScaler support."""
from __future__ import annotations

import torch

from .. import _ops
from ._base import MaskedOptimizer, _number, _scaled_lr

__all__ = ["AdamW"]


class AdamW(MaskedOptimizer):
    """Adam with decoupled weight decay, as ``torch.optim.AdamW(foreach=False)``
    computes it, in one fused pass per param group.

    Arguments are those of ``torch.optim.AdamW``, plus (keyword only):

    * ``masks``: ``{param: bool tensor}``; only the elements where the mask is True
      are updated (masked-out elements and their moments stay bitwise unchanged; the
      parameter's step count still advances).
    * ``max_grad_norm``: clip by the global norm of all stepped gradients, folded
      into the update (the gradients are read, never written). A number >= 0 or None
      (``ValueError`` otherwise, a string included). The last total norm
      is ``optimizer.last_grad_norm``.
    * ``norm_type``: the order of that norm (default 2).

    A param group may set ``lr_scale`` (default 1): it steps with ``lr * lr_scale``
    (schedulers rewrite ``lr`` and keep the ratios); ``lr_scale=0`` leaves the group
    bitwise unchanged, state included.

    Frozen parameters (``requires_grad`` false at step time) are never touched and
    get no state. State is torch's (``step``, ``exp_avg``, ``exp_avg_sq``,
    ``max_exp_avg_sq``), with ``step`` a float32 tensor on the parameter's device
    (as torch's fused AdamW keeps it), so ``state_dict()`` is interchangeable with
    ``torch.optim.AdamW``'s.

    >>> import torch, torchstruct.optim
    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> opt = torchstruct.optim.AdamW([w], lr=0.1, weight_decay=0.0)
    >>> w.grad = torch.tensor([1.0, -1.0])
    >>> opt.step()
    >>> w.detach()
    tensor([0.9000, 1.1000])
    """

    _op = "adamw_step_"
    _fixed_options = {**MaskedOptimizer._fixed_options, "decoupled_weight_decay": True}
    _group_keys = ("lr", "betas", "eps", "weight_decay")
    _state_keys = ("step", "exp_avg", "exp_avg_sq")

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 masks=None, max_grad_norm=None, norm_type: float = 2.0,
                 foreach=None, fused=None):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad, maximize=maximize)
        super().__init__(params, defaults, masks=masks, max_grad_norm=max_grad_norm,
                         norm_type=norm_type, foreach=foreach, fused=fused)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)

    def _check_group(self, index, group):
        super()._check_group(index, group)
        name = f"AdamW: param group {index}"
        betas = group["betas"]
        if len(betas) != 2:
            raise ValueError(f"{name}: betas must be a pair, got {betas!r}")
        for k, beta in enumerate(betas):
            b = _number(beta, f"{name}: betas[{k}]")
            if not 0.0 <= b < 1.0:
                raise ValueError(f"{name}: betas[{k}] must be in [0, 1), got {beta!r}")
        eps = _number(group["eps"], f"{name}: eps")
        if not eps >= 0:
            raise ValueError(f"{name}: eps must be >= 0, got {group['eps']!r}")
        weight_decay = _number(group["weight_decay"], f"{name}: weight_decay")
        if not weight_decay >= 0:
            raise ValueError(f"{name}: weight_decay must be >= 0, got {group['weight_decay']!r}")

    def _update(self, group, params, grads, masks, clip_coef, grad_scale, found_inf, log):
        amsgrad = bool(group["amsgrad"])
        exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], []
        state_of, checked, write = self.state.get, self._checked_state, self._write_state
        for p in params:
            state = state_of(p)
            if not state:  # first step: torch's zero state (step on the parameter's device)
                write(log, p, "step", torch.zeros((), dtype=torch.float32, device=p.device))
                for key in ("exp_avg", "exp_avg_sq"):
                    write(log, p, key, torch.zeros_like(p, memory_format=torch.preserve_format))
                state = self.state[p]
            elif id(p) not in checked and self._first_check(p):
                # state from load_state_dict may be elsewhere: converted at its first step
                step = state["step"]
                if (not isinstance(step, torch.Tensor) or step.dtype != torch.float32
                        or step.device != p.device):
                    write(log, p, "step",
                          torch.as_tensor(float(step), dtype=torch.float32).to(p.device))
                for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                    old = state.get(key)
                    if old is not None and (new := self._state_like(p, old, key)) is not old:
                        write(log, p, key, new)
            if amsgrad:
                if "max_exp_avg_sq" not in state:
                    write(log, p, "max_exp_avg_sq",
                          torch.zeros_like(p, memory_format=torch.preserve_format))
                max_exp_avg_sqs.append(state["max_exp_avg_sq"])
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        return _ops.adamw_step_calls(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, masks,
            lr=_scaled_lr(group), beta1=float(beta1), beta2=float(beta2),
            weight_decay=float(group["weight_decay"]), eps=float(group["eps"]),
            amsgrad=amsgrad, maximize=bool(group["maximize"]), clip_coef=clip_coef,
            grad_scale=grad_scale, found_inf=found_inf)
