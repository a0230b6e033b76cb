"""Structural gradients and ``within_gradient`` at their edges, against plain PyTorch:

* a custom function whose backward runs its own ``torch.autograd.backward`` (a recomputation
  not built on ``torch.utils.checkpoint``): ``structural_grad`` raises naming the paths and
  leaves every ``.grad`` as it was, never a silent zero;
* ``within_gradient`` of a tensor captured inside ``torch.func.grad`` called under
  ``no_grad``: nothing records through it; under ``torch.compile`` with a ``vmap`` level
  innermost: the eager answer (or an error with ``fullgraph=True``), never the other branch;
* DDP's rule for ignored parameters: a tied parameter is left out of the reduction only when
  every path it is found under is ignored.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import detach_variable

import torchstruct as ts
from torchstruct.distributed import _ignored


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, x):
        ctx.fn = fn
        ctx.save_for_backward(x)
        with torch.no_grad():
            return fn(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = detach_variable(ctx.saved_tensors)
        with torch.enable_grad():
            y = ctx.fn(x)
        torch.autograd.backward(y, g)
        return None, x.grad


class _Reversible(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 1)

    def forward(self, x):
        return self.c(_Recompute.apply(self.b, self.a(x)))


@pytest.mark.parametrize("had_grads", [False, True])
def test_a_backward_inside_the_backward_is_refused_not_a_silent_zero(had_grads):
    torch.manual_seed(0)
    m, x = _Reversible(), torch.randn(4, 3)
    if had_grads:
        m(x).sum().backward()
        m.b.weight.grad = m.b.weight.grad.clone()
    before = {n: None if p.grad is None else p.grad.clone() for n, p in m.named_parameters()}
    objects = {n: p.grad for n, p in m.named_parameters()}
    with pytest.raises(RuntimeError, match="'b.weight'"):
        ts.structural_grad(m, lambda mm: mm(x).sum())
    for n, p in m.named_parameters():
        if not had_grads:
            assert p.grad is None, n
        else:
            assert p.grad is objects[n], n
    if not had_grads:
        assert all(v is None for v in before.values())
    # the tensor form too, and wrt= a part the recomputation does not reach is fine
    g = ts.structural_grad(m, lambda mm: mm(x).sum(), wrt="c")
    assert set(ts.tree.paths(g)) == {"c.weight", "c.bias"}


def test_within_gradient_of_a_captured_tensor_follows_the_outer_grad_mode():
    w = torch.randn(3, requires_grad=True)
    seen = {}

    def f(x):
        seen["w"], seen["x"] = ts.within_gradient(w), ts.within_gradient(x)
        return (x * w).sum()

    with torch.no_grad():
        torch.func.grad(f)(torch.ones(3))
    assert seen == {"w": False, "x": True}
    torch.func.grad(f)(torch.ones(3))
    assert seen == {"w": True, "x": True}


def _branch(x):
    return x * 2 if ts.within_gradient(x) else x * 3


def test_within_gradient_under_compile_with_vmap_innermost():
    torch._dynamo.reset()
    x = torch.randn(2, 3, requires_grad=True)
    eager = torch.func.vmap(_branch)(x)
    compiled = torch.compile(lambda t: torch.func.vmap(_branch)(t), backend="eager")(x)
    torch.testing.assert_close(compiled, eager)
    assert torch.equal(eager, x * 2)
    with pytest.raises(Exception):  # fullgraph: an error, never the other branch
        torch.compile(lambda t: torch.func.vmap(_branch)(t), backend="eager",
                      fullgraph=True)(x)
    torch._dynamo.reset()


def test_ddp_ignores_a_tied_parameter_only_under_all_its_paths():
    class TiedLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(10, 4), nn.Linear(4, 10)
            self.head.weight = self.emb.weight
            self.w = nn.Parameter(torch.zeros(1))

    m = TiedLM()
    assert _ignored(m, {"emb.weight"}) == set()  # head.weight keeps it in
    assert _ignored(m, {"emb.weight", "head.weight"}) == {id(m.emb.weight)}
    assert _ignored(m, {"head.bias"}) == {id(m.head.bias)}
    assert _ignored(m, {"w"}) == set()  # DDP spells a root parameter ".w"
    assert _ignored(m, {".w"}) == {id(m.w)}
