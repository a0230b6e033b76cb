"""Tied parameters: one object, several paths. It lives once, at its first path, its gradient is
the total over every use, and it is counted, flattened and updated once."""
import copy

import pytest
import torch
from torch import nn

import torchstruct as ts


class TiedLM(nn.Module):
    """An embedding tied to the output projection."""

    def __init__(self, vocab=11, d=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mid = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.mid(self.emb(tokens))))


class Branches(nn.Module):
    """A block shared across ModuleDict branches, and one weight tied across two others."""

    def __init__(self):
        super().__init__()
        shared = nn.Linear(4, 4)
        self.branches = nn.ModuleDict(
            {"a": shared, "b": nn.Linear(4, 4), "c": nn.Linear(4, 4), "d": shared}
        )
        self.branches["c"].weight = self.branches["b"].weight

    def forward(self, x):
        return sum(torch.tanh(branch(x)) for branch in self.branches.values())


def twice():
    torch.manual_seed(0)
    block = nn.Linear(4, 4)
    return nn.Sequential(block, nn.Tanh(), block, nn.Tanh(), nn.Linear(4, 1))


def lm_loss(m):
    tokens = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 1]])
    return nn.functional.cross_entropy(m(tokens).flatten(0, 1), tokens.flatten())


def vec_loss(m):
    return m(torch.linspace(-1, 1, 12).reshape(3, 4)).square().sum()


CASES = {
    "embedding-head": (TiedLM, lm_loss, {"emb.weight"}, {"head.weight"}),
    "block-twice": (twice, vec_loss, {"0.weight", "0.bias"}, {"2.weight", "2.bias"}),
    "moduledict": (
        Branches,
        vec_loss,
        {"branches.a.weight", "branches.b.weight"},
        {"branches.d.weight", "branches.d.bias", "branches.c.weight"},
    ),
}


def make(name):
    torch.manual_seed(0)
    factory, loss, tied, aliases = CASES[name]
    return factory(), loss, tied, aliases


@pytest.mark.parametrize("name", CASES)
def test_gradient_is_total_over_uses_at_first_path(name):
    m, loss, tied, aliases = make(name)
    ref = copy.deepcopy(m)
    loss(ref).backward()  # PyTorch accumulates every use into the one .grad
    for form in (loss(m), loss):
        g = ts.tree.to_flat_dict(ts.structural_grad(m, form))
        assert tied <= set(g) and not aliases & set(g)
        assert list(g) == [n for n, _ in ref.named_parameters()]
        for n, p in ref.named_parameters():
            torch.testing.assert_close(g[n], p.grad, rtol=1e-6, atol=1e-7)


def test_embedding_head_gradient_is_sum_of_both_uses():
    m, loss, _, _ = make("embedding-head")
    untied = copy.deepcopy(m)
    untied.head.weight = nn.Parameter(untied.emb.weight.detach().clone())
    loss(untied).backward()
    g = ts.structural_grad(m, loss)
    total = untied.emb.weight.grad + untied.head.weight.grad
    torch.testing.assert_close(g["emb"]["weight"], total, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(g["emb"]["weight"], untied.emb.weight.grad)


def test_wrt_by_a_later_path_gives_the_leaf_at_the_first_path():
    m, loss, _, _ = make("embedding-head")
    for wrt in ("head", "head.weight", m.head, ["emb", "head"]):
        g = ts.structural_grad(m, loss, wrt=wrt)
        assert ts.tree.paths(g) == ["emb.weight"]


@pytest.mark.parametrize("name", CASES)
def test_counted_once_in_norms_and_flattened_once(name):
    m, loss, _, _ = make(name)
    g = ts.structural_grad(m, loss)
    unique = list({id(p): p for p in m.parameters()}.values())
    vec, spec = ts.tree.flatten(g)
    assert vec.numel() == spec.numel == sum(p.numel() for p in unique)
    loss(m).backward()
    expected = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in unique]))
    torch.testing.assert_close(ts.global_norm(g), expected)
    torch.testing.assert_close(ts.global_norm(m), expected)
    torch.testing.assert_close(ts.global_norm(ts.grad_tree(m)), expected)
    assert ts.tree.paths(ts.grad_tree(m)) == ts.tree.paths(g)


@pytest.mark.parametrize("name", CASES)
def test_map_trainable_visits_once(name):
    m, loss, _, aliases = make(name)
    g = ts.structural_grad(m, loss)
    seen = []
    out = ts.map_trainable(lambda p, d: seen.append(id(p)) or p - d, m, g)
    assert len(seen) == len(set(seen)) == len({id(p) for p in m.parameters()})
    assert not aliases & set(ts.tree.paths(out))


def test_map_trainable_rejects_a_different_leaf_at_a_later_path():
    m, loss, _, _ = make("embedding-head")
    g = ts.structural_grad(m, loss)
    g["head"] = {"weight": torch.zeros_like(m.emb.weight)}
    with pytest.raises(ValueError, match=r"'emb\.weight' and 'head\.weight'.*tied"):
        ts.map_trainable(lambda p, d: d, m, g)
    g["head"]["weight"] = g["emb"]["weight"]  # the same tensor at both paths is fine
    assert ts.tree.paths(ts.map_trainable(lambda p, d: d, m, g))[0] == "emb.weight"


@pytest.mark.parametrize("name", CASES)
def test_polyak_updates_once(name):
    target, _, _, _ = make(name)
    torch.manual_seed(1)
    source = copy.deepcopy(target)
    for p in source.parameters():
        p.data.normal_()
    t0 = {id(p): p.detach().clone() for p in target.parameters()}
    s = {id(p): q for p, q in zip(target.parameters(), source.parameters())}
    ts.polyak_update(target, source, 0.5)
    for p in target.parameters():  # applied twice would give 0.25 * t + 0.75 * s
        torch.testing.assert_close(p.detach(), 0.5 * t0[id(p)] + 0.5 * s[id(p)].detach())
