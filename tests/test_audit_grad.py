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


# --- create_graph / retain_graph ----------------------------------------------------------

def test_create_graph_with_wrt_keeps_second_order_terms_like_autograd_grad():
    """MAML: the inner gradient of the head is differentiated w.r.t. the body too."""
    torch.manual_seed(0)
    m, x2 = mlp(), torch.randn(5, 3)

    def outer(gw, gb):
        h = torch.tanh(m[0](x2))
        return (h @ (m[2].weight - 0.1 * gw).T + (m[2].bias - 0.1 * gb)).pow(2).sum()

    params = list(m.parameters())
    gw, gb = torch.autograd.grad(sq(m), [m[2].weight, m[2].bias], create_graph=True)
    ref = torch.autograd.grad(outer(gw, gb), params)
    for loss in (sq, sq(m)):
        g = ts.structural_grad(m, loss, wrt="2", create_graph=True)
        assert torch.equal(g["2"]["weight"], gw) and g["2"]["weight"].requires_grad
        ours = torch.autograd.grad(outer(g["2"]["weight"], g["2"]["bias"]), params)
        assert all(torch.equal(a, b) for a, b in zip(ours, ref))
    assert flags(m) == [True] * 4


def test_create_graph_with_wrt_turns_on_a_frozen_parameter_and_keeps_the_others_off():
    m = mlp()
    with ts.freeze(m, "0"):
        g = ts.structural_grad(m, sq, wrt="0.bias", create_graph=True)
        assert flags(m) == [False, False, True, True]
    ref = torch.autograd.grad(sq(m), [m[0].bias], create_graph=True)[0]
    assert torch.equal(g["0"]["bias"], ref) and g["0"]["bias"].requires_grad
    # the second derivative reaches 0.bias and the trainable head, not the frozen 0.weight
    pen = g["0"]["bias"].pow(2).sum()
    assert pen.grad_fn is not None
    assert torch.autograd.grad(pen, [m[0].weight], allow_unused=True)[0] is None
