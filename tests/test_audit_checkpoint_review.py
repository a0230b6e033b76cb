"""Checkpoints and trees at their edges, each against plain PyTorch or the documented rule:

* ``ts.load_state_dict`` inside a ``ts.swap`` block writes the parameters, never the
  stand-ins (``ts.state_dict`` there holds the stand-ins' values, as ``model.state_dict()``);
* a model tensor that cannot be written in place (an expanded buffer) is a listed problem:
  nothing is written;
* a value that shares memory with another written tensor (loading ``state_dict`` entries
  shifted by one layer) is read as it was before the load;
* ``ts.tree.from_module(buffers=True)`` puts each module's buffers after its own parameters;
* ``ts.tree.flatten`` does not tie a conjugate or negative view to its base.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import torchstruct as ts


def test_load_inside_swap_writes_the_parameters_and_state_dict_holds_the_stand_ins():
    torch.manual_seed(0)
    m = nn.Linear(2, 2)
    stand = {"weight": torch.zeros(2, 2), "bias": torch.zeros(2)}
    with ts.swap(m, stand):
        saved = ts.state_dict(m)  # as model.state_dict() in the block: the stand-ins' values
        assert torch.equal(saved["weight"], stand["weight"])
        ts.load_state_dict(m, {"weight": torch.full((2, 2), 7.0)}, strict=False)
        assert torch.equal(m(torch.ones(1, 2)), torch.zeros(1, 2))  # the block still swaps
    assert torch.equal(m.weight.detach(), torch.full((2, 2), 7.0))
    assert torch.equal(stand["weight"], torch.zeros(2, 2))  # the stand-in untouched


def test_an_expanded_buffer_is_a_problem_and_nothing_is_written():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(2, 2)
            self.register_buffer("pos", torch.zeros(1).expand(3))

    m = M()
    before = m.a.weight.detach().clone()
    with pytest.raises(ValueError, match=r"'pos': the model's tensor has elements that share memory.*Nothing"):
        ts.load_state_dict(m, {"a.weight": torch.ones(2, 2), "pos": torch.arange(3.0)},
                           strict=False)
    assert torch.equal(m.a.weight.detach(), before)


def test_values_sharing_memory_with_targets_are_read_before_the_load():
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(2, 2, bias=False) for _ in range(3)])
    twin = nn.Sequential(*[nn.Linear(2, 2, bias=False) for _ in range(3)])
    twin.load_state_dict(m.state_dict())
    saved = ts.state_dict(m)  # views of the model's own tensors
    ts.load_state_dict(m, {"1.weight": saved["0.weight"], "2.weight": saved["1.weight"]},
                       strict=False)
    with torch.no_grad():  # the same shift by hand, from copies
        twin[2].weight.copy_(twin[1].weight.clone())
        twin[1].weight.copy_(twin[0].weight.clone())
    for a, b in zip(m.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def test_from_module_puts_buffers_after_their_modules_parameters():
    m = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2, affine=False), nn.Linear(2, 2))
    got = ts.tree.paths(ts.tree.from_module(m, buffers=True))
    assert got == ["0.weight", "0.bias", "1.running_mean", "1.running_var",
                   "1.num_batches_tracked", "2.weight", "2.bias"]
    assert ts.tree.paths(ts.tree.from_module(m)) == [n for n, _ in m.named_parameters()]


def test_flatten_keeps_a_conjugate_or_negative_view_apart_from_its_base():
    z = torch.tensor([1 + 2j, 3 - 1j])
    vec, spec = ts.tree.flatten({"a": z, "b": z.conj()})
    assert spec.numel == 4
    assert torch.equal(ts.tree.unflatten(vec, spec)["b"], z.conj().resolve_conj())
    x = torch.tensor([1.0, 2.0])
    vec, spec = ts.tree.flatten({"a": x, "b": torch._neg_view(x)})
    assert torch.equal(ts.tree.unflatten(vec, spec)["b"], torch.tensor([-1.0, -2.0]))
    vec, spec = ts.tree.flatten({"a": x, "b": x.view(2)})  # a true tie still ties
    assert spec.numel == 2


def test_loading_the_models_own_state_copies_nothing(monkeypatch):
    from torchstruct import checkpoint as ck

    m = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    seen = []
    monkeypatch.setattr(ck, "_unaliased", lambda t, s: seen.append(len(s)) or s)
    ts.load_state_dict(m, m.state_dict())
    ts.load_state_dict(m, ts.state_dict(m))
    assert seen == []  # every value is its target's own memory: no write, no copy
