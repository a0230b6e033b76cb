"""ts.global_norm on trees and models: the norm of the concatenation of the unique trainable
gradients."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import torchstruct as ts

NORMS = [1.0, 2.0, 3.0, 0.5, math.inf]


def model():
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), shared, nn.Tanh(), shared, nn.Linear(4, 2))


def loss(m):
    return m(torch.linspace(-1, 1, 15).reshape(5, 3)).square().sum()


def reference(tensors, p):
    return torch.linalg.vector_norm(torch.cat([t.flatten() for t in tensors]), ord=p)


def unique_trainable_grads(m):
    return [p.grad for _, p in ts.trainable_parameters(m) if p.grad is not None]


@pytest.mark.parametrize("p", NORMS)
def test_tree_from_structural_grad(p):
    m = model()
    g = ts.structural_grad(m, loss)
    loss(m).backward()
    unique = {id(q): q.grad for q in m.parameters()}.values()
    torch.testing.assert_close(ts.global_norm(g, p), reference(unique, p), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("p", NORMS)
def test_model_counts_trainable_grads_once(p):
    m = model()
    m[0].weight.grad = torch.full_like(m[0].weight, 100.0)  # stale grad on a frozen param
    with ts.freeze(m, "0"):
        loss(m).backward()
        expected = reference(unique_trainable_grads(m), p)
        assert len(unique_trainable_grads(m)) == 4  # shared block once + last layer
        torch.testing.assert_close(ts.global_norm(m, p), expected, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(ts.global_norm(ts.grad_tree(m), p), expected, rtol=1e-5, atol=1e-7)


def test_wrt_tree_norm():
    m = model()
    g = ts.structural_grad(m, loss, wrt="5")
    loss(m).backward()
    torch.testing.assert_close(ts.global_norm(g), reference([m[5].weight.grad, m[5].bias.grad], 2))


def test_none_leaves_and_empty():
    t = {"a": torch.tensor([3.0]), "b": {"c": None, "d": torch.tensor([[4.0]])}}
    assert float(ts.global_norm(t)) == 5.0
    assert float(ts.global_norm({})) == 0.0
    assert float(ts.global_norm(nn.Linear(2, 2))) == 0.0  # no grads yet


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=1, max_size=6),
             min_size=1, max_size=5),
    st.sampled_from(NORMS),
)
def test_random_trees(values, p):
    leaves = [torch.tensor(v, dtype=torch.float64) for v in values]
    t = ts.tree.from_flat_dict((f"n{i % 2}.l{i}", x) for i, x in enumerate(leaves))
    torch.testing.assert_close(ts.global_norm(t, p), reference(leaves, p))
