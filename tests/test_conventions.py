"""Conventions: flat path-keyed dicts (state_dict / functional_call style) are accepted wherever
a tree is, with the same answers; ts.clip_grad_norm_ is clip_by_global_norm; a number argument
is read by one rule wherever it is taken."""
import copy
import fractions

import numpy as np

import pytest
import torch
from torch import nn

import torchstruct as ts
from torchstruct import tree as T


def make(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def grads_of(model):
    model.zero_grad()
    model(torch.randn(5, 3, generator=torch.Generator().manual_seed(0))).pow(2).sum().backward()
    return {path: p.grad.clone() for path, p in model.named_parameters()}


def test_alias():
    assert ts.clip_grad_norm_ is ts.clip_by_global_norm


def test_tree_functions_take_flat_dicts():
    a, b, c = torch.ones(2), torch.arange(3.0), torch.tensor(5.0)
    flat = {"x.w": a, "x.b": b, "y": c}
    nested = {"x": {"w": a, "b": b}, "y": c}
    assert T.paths(flat) == T.paths(nested) == ["x.w", "x.b", "y"]
    assert [t is u for t, u in zip(T.leaves(flat), (a, b, c))] == [True] * 3
    assert T.reduce(lambda n, t: n + t.numel(), flat, 0) == 6
    assert T.to_flat_dict(flat) == flat and T.to_flat_dict(nested) == flat
    doubled = T.map(lambda t, u: t + u, flat, nested)  # forms may be mixed
    assert list(doubled) == ["x.w", "x.b", "y"]  # a flat dict in, a flat dict out
    assert torch.equal(doubled["x.b"], 2 * b)
    assert T.paths(T.map(lambda t: t, nested)) == ["x.w", "x.b", "y"]
    assert isinstance(T.map(lambda t: t, nested)["x"], dict)
    assert list(T.map(lambda t: None if t.dim() == 0 else t, flat)) == ["x.w", "x.b"]
    vec, spec = T.flatten(flat)
    back = T.unflatten(vec, spec)
    assert list(back) == ["x.w", "x.b", "y"] and torch.equal(back["y"], c)
    vec2, spec2 = T.flatten(nested)
    assert torch.equal(vec, vec2) and isinstance(T.unflatten(vec2, spec2)["x"], dict)
    mixed = {"x": {"w": a}, "x.b": b}
    assert T.paths(mixed) == ["x.w", "x.b"]


@pytest.mark.parametrize("bad, error, match", [
    ({"a.b": torch.ones(1), "a": {"b": torch.ones(1)}}, ValueError, "duplicate path 'a.b'"),
    ({"a": torch.ones(1), "a.b": torch.ones(1)}, ValueError, "conflicting paths 'a' and 'a.b'"),
    ({"a..b": torch.ones(1)}, ValueError, "'a..b'.*empty component"),
    ({"a.": torch.ones(1)}, ValueError, "empty component"),
    ({"a.b": [1.0]}, TypeError, "'a.b'"),
])
def test_bad_flat_dicts(bad, error, match):
    with pytest.raises(error, match=match):
        T.paths(bad)
    with pytest.raises(error, match=match):
        ts.global_norm(bad)


def test_global_norm_and_clip_take_flat_dicts():
    model = make()
    flat = grads_of(model)
    nested = T.from_flat_dict({k: v.clone() for k, v in flat.items()})
    assert torch.equal(ts.global_norm(flat), ts.global_norm(nested))
    n1 = ts.clip_grad_norm_(flat, 0.1)
    n2 = ts.clip_by_global_norm(nested, 0.1)
    assert torch.equal(n1, n2)
    for path, g in T.to_flat_dict(nested).items():
        assert torch.equal(flat[path], g)
    assert float(ts.global_norm(flat)) == pytest.approx(0.1, rel=1e-4)


def test_swap_takes_a_state_dict():
    model, other = make(0), make(1)
    x = torch.randn(4, 3)
    with ts.swap(model, other.state_dict()):
        y = model(x)
    assert torch.equal(y, other(x))
    with ts.swap(model, {"2.weight": other[2].weight.detach()}):  # partial, flat
        z = model(x)
    assert torch.equal(z, nn.functional.linear(torch.tanh(model[0](x)), other[2].weight,
                                               model[2].bias))
    with pytest.raises(ValueError, match="'2.wieght'.*closest"):
        ts.swap(model, {"2.wieght": other[2].weight.detach()})


def test_polyak_update_takes_a_flat_source():
    target, online = make(0), make(1)
    expected = copy.deepcopy(target)
    ts.polyak_update(expected, T.from_flat_dict(dict(online.named_parameters())), 0.3)
    ts.polyak_update(target, dict(online.named_parameters()), 0.3)
    for p, q in zip(target.parameters(), expected.parameters()):
        assert torch.equal(p, q)
    with pytest.raises(ValueError, match="'0.wieght'"):
        ts.polyak_update(target, {"0.wieght": torch.ones(4, 3)}, 0.3)


def test_map_trainable_takes_flat_dicts():
    model = make()
    flat = grads_of(model)
    with ts.freeze(model, "0"):
        out = ts.map_trainable(lambda p, g: p - g, model, flat)
    assert T.paths(out) == ["2.weight", "2.bias"]
    assert torch.equal(T.to_flat_dict(out)["2.bias"], model[2].bias - flat["2.bias"])


def test_functional_call_roundtrip():
    model = make()
    params = dict(model.named_parameters())
    halved = T.map(lambda p: p.detach() / 2, params)
    y = torch.func.functional_call(model, halved, (torch.ones(1, 3),))
    with ts.swap(model, halved):
        assert torch.equal(model(torch.ones(1, 3)), y)


def test_a_state_dict_with_buffers_is_refused_by_name():
    model, other = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)), nn.Sequential(
        nn.Linear(2, 2), nn.BatchNorm1d(2))
    sd = other.state_dict()
    with pytest.raises(ValueError, match="'1.running_mean' is a buffer"):
        ts.swap(model, sd)
    with pytest.raises(ValueError, match="'1.running_mean', a buffer"):
        ts.polyak_update(model, sd, 0.5)
    params = {k: v for k, v in sd.items() if k in dict(model.named_parameters())}
    ts.polyak_update(model, params, 1.0)
    assert torch.equal(model[0].weight, other[0].weight)


# ---------------------------------------------------------------- one rule for number arguments
NUMBER_TAKERS = {  # the call with the number in place, and the error it raises for a non-number
    "param_groups lr_scale": (lambda m, x: ts.param_groups(m, ("0", {"lr_scale": x})), TypeError),
    "layer_decay decay": (lambda m, x: ts.layer_decay(m, x, layers=""), TypeError),
    "polyak_update tau": (lambda m, x: ts.polyak_update(m, make(1), x), TypeError),
    "optim lr": (lambda m, x: ts.optim.SGD(m.parameters(), lr=x), ValueError),
    "optim lr_scale": (lambda m, x: ts.optim.SGD([{"params": m.parameters(), "lr_scale": x}],
                                                 lr=0.1), ValueError),
}
NUMBER_LIKE = [0.5, np.float32(0.5), fractions.Fraction(1, 2), torch.tensor(0.5, dtype=torch.float64),
               torch.tensor([0.5]), torch.tensor(1)]
NOT_A_NUMBER = ["0.5", b"0.5", None, [0.5], 0.5 + 0j, torch.tensor(0.5 + 0j), torch.ones(2) / 2,
                torch.tensor(0.5, device="meta"), torch.tensor(True)]


@pytest.mark.parametrize("taker", sorted(NUMBER_TAKERS))
@pytest.mark.parametrize("value", NUMBER_LIKE, ids=repr)
def test_every_number_argument_takes_the_same_number_likes(taker, value):
    call, _ = NUMBER_TAKERS[taker]
    m = make()
    call(m, value)


@pytest.mark.parametrize("taker", sorted(NUMBER_TAKERS))
@pytest.mark.parametrize("value", NOT_A_NUMBER, ids=repr)
def test_every_number_argument_refuses_the_same_non_numbers_and_changes_nothing(taker, value):
    call, error = NUMBER_TAKERS[taker]
    m = make()
    before = [(p.detach().clone(), p.requires_grad) for p in m.parameters()]
    with pytest.raises(error, match="must be a"):
        call(m, value)
    assert all(torch.equal(p, v) and p.requires_grad == f
               for p, (v, f) in zip(m.parameters(), before))
