"""ts.map_trainable and ts.polyak_update."""
import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import torchstruct as ts


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def params(m):
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def ones_tree(m):
    return ts.tree.map(torch.ones_like, ts.tree.from_module(m))


# ----------------------------------------------------------------------------- map_trainable
def test_map_trainable_model_only():
    m = mlp()
    out = ts.map_trainable(lambda p: p * 2, m)
    assert ts.tree.paths(out) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    torch.testing.assert_close(out["2"]["bias"], m[2].bias * 2)


def test_map_trainable_takes_trainability_from_the_model():
    m = mlp()
    g = ones_tree(m)  # covers frozen parameters too: they are ignored
    calls = []
    with ts.freeze(m, "0"):
        out = ts.map_trainable(lambda p, d: calls.append(id(p)) or p - 0.1 * d, m, g)
    assert calls == [id(m[2].weight), id(m[2].bias)]
    assert ts.tree.paths(out) == ["2.weight", "2.bias"]
    torch.testing.assert_close(out["2"]["weight"], m[2].weight - 0.1)


def test_map_trainable_several_trees_and_none_drops():
    m = mlp()
    a, b = ones_tree(m), ts.tree.map(lambda t: 3 * torch.ones_like(t), ts.tree.from_module(m))
    out = ts.map_trainable(lambda p, x, y: None if p.dim() == 1 else x + y, m, a, b)
    assert ts.tree.paths(out) == ["0.weight", "2.weight"]
    assert bool((out["0"]["weight"] == 4).all())


def test_map_trainable_with_structural_grad_gives_sgd_step():
    m, x = mlp(), torch.randn(5, 3)
    ref = copy.deepcopy(m)
    ref(x).square().mean().backward()
    g = ts.structural_grad(m, lambda mm: mm(x).square().mean(), wrt="2")
    with pytest.raises(ValueError, match="no leaf"):  # "0" trains, but g has no leaf for it
        ts.map_trainable(lambda p, d: p - 0.5 * d, m, g)
    with ts.freeze_except(m, "2"):
        new = ts.map_trainable(lambda p, d: p - 0.5 * d, m, g)
    torch.testing.assert_close(new["2"]["weight"], ref[2].weight - 0.5 * ref[2].weight.grad)


def test_map_trainable_missing_path_names_it():
    m = mlp()
    g = ts.tree.from_flat_dict({"0.weight": torch.ones(4, 3), "0.bias": torch.ones(4)})
    with pytest.raises(ValueError, match=r"tree argument 1 has no leaf at '2\.weight'"):
        ts.map_trainable(lambda p, d: p, m, g)
    with ts.freeze(m, "2"):
        assert ts.tree.paths(ts.map_trainable(lambda p, d: d, m, g)) == ["0.weight", "0.bias"]


def test_map_trainable_foreign_path_is_an_error():
    m = mlp()
    g = ones_tree(m)
    g["3"] = {"weight": torch.ones(1)}
    with pytest.raises(ValueError, match=r"'3\.weight'.*not a parameter path.*closest"):
        ts.map_trainable(lambda p, d: d, m, ones_tree(m), g)


def test_map_trainable_type_errors():
    m = mlp()
    with pytest.raises(TypeError, match="nn.Module"):
        ts.map_trainable(lambda p: p, {"a": torch.ones(1)})
    with pytest.raises(TypeError):
        ts.map_trainable(lambda p: 1.0, m)


# ----------------------------------------------------------------------------- polyak_update
@settings(max_examples=20, deadline=None)
@given(st.floats(0.0, 1.0))
def test_polyak_matches_formula(tau):
    target, source = mlp(0), mlp(1)
    t0, s0 = params(target), params(source)
    assert ts.polyak_update(target, source, tau) is target
    for n, p in target.named_parameters():
        torch.testing.assert_close(p.detach(), (1 - tau) * t0[n] + tau * s0[n], rtol=1e-6, atol=1e-6)
        assert p.is_leaf and p.requires_grad and p.grad is None


def test_polyak_endpoints_are_exact():
    target, source = mlp(0), mlp(1)
    t0 = params(target)
    ts.polyak_update(target, source, 0.0)
    assert all(torch.equal(p, t0[n]) for n, p in target.named_parameters())
    ts.polyak_update(target, source, 1)
    assert all(torch.equal(p, q) for p, q in zip(target.parameters(), source.parameters()))


def test_polyak_skips_frozen_parameters_of_target():
    target, source = mlp(0), mlp(1)
    t0 = params(target)
    with ts.freeze(target, "0"):
        ts.polyak_update(target, source, 0.5)
    assert torch.equal(target[0].weight, t0["0.weight"]) and torch.equal(target[0].bias, t0["0.bias"])
    assert not torch.equal(target[2].weight, t0["2.weight"])


def test_polyak_source_tree_and_dtypes():
    target = mlp(0)
    target[2].double()
    t0 = params(target)
    src = ts.tree.map(lambda p: torch.zeros_like(p), ts.tree.from_module(target))
    ts.polyak_update(target, src, 0.25)
    for n, p in target.named_parameters():
        torch.testing.assert_close(p.detach(), 0.75 * t0[n])
    assert target[2].weight.dtype == torch.float64


def test_polyak_one_fused_call_per_group_and_one_write(monkeypatch):
    """One group: one in-place ``_foreach_lerp_``. Several (dtypes): the smaller group lerped
    out of place and copied in, then the largest lerped in place."""
    target, source = mlp(0), mlp(1)
    calls = []
    for name in ("_foreach_lerp_", "_foreach_lerp", "_foreach_copy_"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda a, b, *w, real=real, name=name:
                            calls.append((name, len(a))) or real(a, b, *w))
    ts.polyak_update(target, source, 0.1)
    assert calls == [("_foreach_lerp_", 4)]
    calls.clear()
    target[2].double()
    source[2].double()
    want = [(1 - 0.1) * p.detach() + 0.1 * q.detach()
            for p, q in zip(target.parameters(), source.parameters())]
    ts.polyak_update(target, source, 0.1)
    small = sum(p.numel() for p in target[2].parameters()) < sum(
        p.numel() for p in target[0].parameters())
    assert small  # the float64 layer is the smaller group: staged
    assert calls == [("_foreach_lerp", 2), ("_foreach_copy_", 2), ("_foreach_lerp_", 2)]
    for p, w in zip(target.parameters(), want):
        torch.testing.assert_close(p.detach(), w)


@pytest.mark.parametrize("tau", [-0.1, 1.5, float("nan")])
def test_polyak_bad_tau(tau):
    target, source = mlp(0), mlp(1)
    t0 = params(target)
    with pytest.raises(ValueError, match="tau"):
        ts.polyak_update(target, source, tau)
    assert all(torch.equal(p, t0[n]) for n, p in target.named_parameters())
    with pytest.raises(TypeError, match="tau"):
        ts.polyak_update(target, source, True)


def test_polyak_mismatch_changes_nothing():
    target, source = mlp(0), mlp(1)
    t0 = params(target)
    bad = dict(ts.tree.to_flat_dict(ts.tree.from_module(source)))
    bad["2.bias"] = torch.zeros(3)  # the last one: the earlier ones must stay untouched
    with pytest.raises(ValueError, match=r"'2\.bias'.*\(3,\).*\(2,\)"):
        ts.polyak_update(target, ts.tree.from_flat_dict(bad), 0.5)
    bad["2.bias"] = torch.zeros(2, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"'2\.bias'.*float64"):
        ts.polyak_update(target, ts.tree.from_flat_dict(bad), 0.5)
    del bad["2.bias"]
    with pytest.raises(ValueError, match=r"no leaf at '2\.bias'"):
        ts.polyak_update(target, ts.tree.from_flat_dict(bad), 0.5)
    with pytest.raises(ValueError, match=r"no parameter at '0\.weight'"):
        ts.polyak_update(target, nn.Linear(3, 4), 0.5)
    with pytest.raises(TypeError, match="source"):
        ts.polyak_update(target, [torch.zeros(1)], 0.5)
    assert all(torch.equal(p, t0[n]) for n, p in target.named_parameters())


def test_polyak_records_no_graph():
    target, source = mlp(0), mlp(1)
    ts.polyak_update(target, source, 0.3)
    assert all(p.grad_fn is None for p in target.parameters())
    target(torch.randn(2, 3)).sum().backward()  # still trainable leaves
    assert all(p.grad is not None for p in target.parameters())


@pytest.mark.parametrize("tau", [0.5, 1.0])
def test_polyak_with_every_target_parameter_frozen_by_a_context_writes_nothing(tau):
    target, source = mlp(0), mlp(1)
    t0 = params(target)
    with ts.freeze(target):
        assert ts.polyak_update(target, source, tau) is target
    assert all(torch.equal(p, t0[n]) for n, p in target.named_parameters())
