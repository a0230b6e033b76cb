"""``torch.export`` of an attached model: it traces as plain PyTorch, and a change of the tree
waiting for the next forward stays waiting (its fake parameters are never taken for the
model's own), in strict and non-strict export alike."""
import pytest
import torch
from torch import nn

import torchstruct as ts

export = pytest.importorskip("torch.export").export


def _flags(m):
    return [p.requires_grad for p in m.parameters()]


def _reads(m):
    return [ts.is_trainable(m, p) for p in m.parameters()]


def _waiting_change():
    """A model whose bare freeze_except("0") holds, and a layer added since (frozen by it at
    the next application, its own flag True until then)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    ts.freeze_except(m, "0")
    m(torch.randn(3, 4))
    m.append(nn.Linear(2, 2))
    return m


@pytest.mark.parametrize("strict", [False, True])
def test_export_leaves_a_waiting_change_waiting_and_the_next_forward_applies_it(strict):
    m = _waiting_change().eval()
    before = _flags(m)
    assert before == [True, True, False, False, False, False, True, True]
    x = torch.randn(3, 4)
    ep = export(m, (x,), strict=strict)
    assert _flags(m) == before  # not the starting flags of every parameter
    assert _reads(m) == [True, True] + [False] * 6  # the reads judge the change, as before
    assert torch.equal(ep.module()(x), m(x))
    assert _flags(m) == _reads(m)  # that forward applied it


@pytest.mark.parametrize("strict", [False, True])
def test_export_without_a_waiting_change_changes_no_flag(strict):
    m = _waiting_change().eval()
    ts.attach(m)
    flags = _flags(m)
    assert flags == [True, True] + [False] * 6
    ep = export(m, (torch.randn(3, 4),), strict=strict)
    assert _flags(m) == flags
    # the program's module holds the model's own parameters (docs/freezing.md "Exporting")
    assert all(any(p is q for q in m.parameters()) for p in ep.module().parameters())
    assert [(n, p.requires_grad) for n, p in ep.named_parameters()] == [
        (n, p.requires_grad) for n, p in m.named_parameters()]


def test_export_inside_a_block_sees_the_blocks_flags_and_the_exit_restores_them():
    m = _waiting_change()
    ts.attach(m)
    with ts.unfreeze(m, "2"):
        export(m.eval(), (torch.randn(3, 4),))
        assert _flags(m) == [True, True, False, False, True, True, False, False]
    assert _flags(m) == [True, True] + [False] * 6


def test_a_forward_under_fake_tensors_never_takes_them_for_the_model_s_own():
    # the fake Parameters stand in the model's places: never written, never taken for new
    # parameters of the model; its own get the waiting change, as a plain forward under the
    # fake mode gives it
    fake_tensor = pytest.importorskip("torch._subclasses.fake_tensor")
    m = _waiting_change().eval()
    own = list(m.parameters())
    with fake_tensor.FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fakes = {n: nn.Parameter(mode.from_tensor(p.detach()), requires_grad=True)
                 for n, p in m.named_parameters()}
        torch.func.functional_call(m, fakes, (torch.randn(3, 4),))
    assert all(f.requires_grad for f in fakes.values())
    assert all(a is b for a, b in zip(own, m.parameters()))
    assert _flags(m) == _reads(m) == [True, True] + [False] * 6
    m(torch.randn(3, 4))
    assert _flags(m) == _reads(m) == [True, True] + [False] * 6


@pytest.mark.parametrize("strict", [False, True])
def test_export_of_a_submodule_leaves_a_change_below_the_root_to_its_next_forward(strict):
    # docs/freezing.md: after a registration below the root, a forward of the module it was
    # registered into applies the change first; an export of that module is no such forward
    m = nn.Sequential(nn.Sequential(nn.Linear(4, 4)), nn.Linear(4, 2))
    ts.freeze_except(m, "1")
    m(torch.randn(3, 4))
    m[0].append(nn.Linear(4, 4))
    export(m[0], (torch.randn(3, 4),), strict=strict)
    assert _flags(m) == [False, False, True, True, True, True]
    m[0](torch.randn(3, 4))
    assert _flags(m) == _reads(m) == [False, False, False, False, True, True]


def test_the_programs_normalization_layers_are_fixed_when_it_is_exported():
    # docs/freezing.md "Exporting": held at export, traced as held; not held at export, the
    # program runs as traced (training mode: it updates the statistics it shares), whatever
    # torchstruct holds later
    torch.manual_seed(0)
    x = torch.randn(6, 4)
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).train()
    ts.attach(m)
    plain = export(m, (x,)).module()
    with ts.freeze(m, "1"):
        held = export(m, (x,)).module()
        stats = m[1].running_mean.clone()
        plain(x)
        assert not torch.equal(m[1].running_mean, stats)  # the program updates them
        stats = m[1].running_mean.clone()
        m(x)
        assert torch.equal(m[1].running_mean, stats)  # the model holds them
    stats = m[1].running_mean.clone()
    held(x)
    assert torch.equal(m[1].running_mean, stats)  # held as when it was exported
    m(x)
    assert not torch.equal(m[1].running_mean, stats)
