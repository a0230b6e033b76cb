"""Structural gradients and trees, tried as a suspicious PyTorch user would.

Every gradient is compared with PyTorch itself (``torch.autograd.grad`` or ``.backward()`` on
the same model and data), with ``torch.equal`` where the arithmetic is the same; every error
path checks that flags, ``.grad`` fields and parameters are left as they were.

A test marked ``xfail(strict=True)`` reproduces a case that goes wrong today; its reason says
what happens and what is expected.
"""
import copy
import os
import re
import warnings

import pytest
import torch
from torch import nn
from torch.autograd import forward_ad as fwad
from torch.utils.checkpoint import checkpoint

import torchstruct as ts

T = ts.tree
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def flat(tree):
    return T.to_flat_dict(tree)


def flags(m):
    return [p.requires_grad for p in m.parameters()]


def same(tree, names, grads):
    """``tree`` holds exactly ``grads`` (torch.equal) at ``names``, and nothing else."""
    f = flat(tree)
    return list(f) == list(names) and all(torch.equal(f[n], g) for n, g in zip(names, grads))


def reference(model, loss_fn, names):
    """PyTorch's answer: ``torch.autograd.grad`` of a fresh forward w.r.t. ``names``."""
    params = dict(model.named_parameters(remove_duplicate=False))
    return torch.autograd.grad(loss_fn(model), [params[n] for n in names])


class Tied(nn.Module):
    """A block used twice (by two attributes) and a weight tied across two linears."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        self.b.weight = self.a.weight
        self.c = self.a
        self.head = nn.Linear(3, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))))


def mlp():
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


X = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))


def sq(m):
    return m(X).pow(2).sum()


# --- structural_grad: selectors -----------------------------------------------------------

def test_wrt_selecting_no_parameter_is_an_error():
    m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1), nn.Sequential())
    before = flags(m)
    for wrt in ("1", m[1], "3", m[3], lambda path, p: False):
        for loss in (sq, sq(m)):
            with pytest.raises(ValueError, match="selects no parameter"):
                ts.structural_grad(m, loss, wrt=wrt)
    with pytest.raises(ValueError, match="selects no parameter"):
        ts.value_and_grad(sq, m, wrt="1")
    assert flags(m) == before and all(p.grad is None for p in m.parameters())
