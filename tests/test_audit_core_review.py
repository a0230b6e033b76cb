"""Flags after unusual sequences around contexts: each test states the rule of
docs/freezing.md it checks, against a brute force of that rule or plain PyTorch.

* a checkpoint's recomputation that enters a context of the checkpointed function (the flags
  it set back for the recomputation are not taken for someone else's writes afterwards);
* a container changed by its own methods again and again (``del`` then ``insert``), where a
  new ``_modules`` dict may be at the address of a freed one;
* an outer context whose callable selector raises on a parameter added inside an inner block:
  the inner block's exit restores every flag it can, then raises;
* leaving ``unfreeze`` after the tree grew: a write inside that cannot be told apart from the
  block's own is undone with a warning naming it (as ``freeze`` does).
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import torchstruct as ts


def flags(m: nn.Module) -> dict:
    return {n: p.requires_grad for n, p in m.named_parameters()}


@pytest.mark.parametrize("reentrant", [False, True])
def test_recomputation_entering_a_context_keeps_the_starting_flags(reentrant):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    before = flags(m)

    @ts.freeze(m, "1")
    def body(x):
        return m[0](x)

    outer = ts.freeze(m, "0")  # permanent
    with ts.unfreeze(m, "0"):  # this step trains layer 0
        x = torch.randn(3, 2, requires_grad=reentrant)
        loss = m[1](checkpoint(body, x, use_reentrant=reentrant)).sum()
    assert not m[0].weight.requires_grad
    loss.backward()  # the recomputation sets layer 0 back on and enters body's context
    assert flags(m) == {"0.weight": False, "0.bias": False, "1.weight": True, "1.bias": True}
    assert [n for n, _ in ts.trainable_parameters(m)] == ["1.weight", "1.bias"]
    outer.__exit__(None, None, None)
    assert flags(m) == before  # every flag back to where it started
    assert [n for n, _ in ts.trainable_parameters(m)] == list(before)


def test_recomputation_keeps_a_write_made_between_forward_and_backward():
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))

    @ts.freeze(m, "1")
    def body(x):
        return m[0](x)

    with ts.freeze(m, "1"):
        loss = m[1](checkpoint(body, torch.randn(3, 2), use_reentrant=False)).sum()
    m[0].weight.requires_grad_(False)  # the user's own write, after the forward
    loss.backward()
    assert flags(m) == {"0.weight": False, "0.bias": True, "1.weight": True, "1.bias": True}
    with ts.freeze(m, "0"):
        pass
    assert not m[0].weight.requires_grad  # still the user's write: its new starting flag


class _Declared(nn.Sequential):
    def trainable(self):
        return ["0", "1"]  # anything else is frozen


def test_container_changed_by_its_own_methods_again_and_again():
    m = _Declared(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    ts.attach(m)
    x = torch.randn(1, 2)
    for i in range(300):
        del m[2]
        m.insert(2, nn.Linear(2, 2))  # a new dict each time, often at a freed one's address
        if i % 3 == 0:
            m(x)
            assert flags(m) == {"0.weight": True, "0.bias": True, "1.weight": True,
                                "1.bias": True, "2.weight": False, "2.bias": False}, i
            assert [n for n, _ in ts.trainable_parameters(m)] == [
                "0.weight", "0.bias", "1.weight", "1.bias"]


def test_inner_exit_restores_when_an_outer_callable_selector_raises():
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    table = {"0.weight": True, "0.bias": True, "1.weight": False, "1.bias": False}
    outer = ts.freeze(m, lambda path, p: table[path])  # permanent; knows only these paths
    with pytest.raises(KeyError, match="2.weight"):
        with ts.freeze(m, "1"):
            m.append(nn.Linear(1, 1))
    assert flags(m) == {"0.weight": False, "0.bias": False, "1.weight": True, "1.bias": True,
                        "2.weight": True, "2.bias": True}
    with pytest.raises(KeyError):  # the next application asks again
        ts.trainable_parameters(m)
    table.update({"2.weight": True, "2.bias": False})
    outer.__exit__(None, None, None)
    assert all(flags(m).values())


def test_leaving_unfreeze_after_growth_names_the_flags_it_turns_off():
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    m[0].requires_grad_(False)
    ts.attach(m)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with ts.unfreeze(m):
            m.append(nn.Linear(1, 1))
            m[0].weight.requires_grad_(True)  # same value as the block's own write
    assert flags(m) == {"0.weight": False, "0.bias": False, "1.weight": True, "1.bias": True,
                        "2.weight": True, "2.bias": True}
    said = [str(w.message) for w in seen if issubclass(w.category, ts.RestoredFlagsWarning)]
    assert len(said) == 1 and "requires_grad=False" in said[0] and "'0.weight'" in said[0]


def test_leaving_unfreeze_without_growth_undoes_a_same_value_write_silently():
    # the documented limit ("the one write that cannot be seen"): no growth, no warning
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    m[0].requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ts.unfreeze(m):
            m[0].weight.requires_grad_(True)
            m[0].bias.requires_grad_(False)  # another value: it stands
    assert flags(m) == {"0.weight": False, "0.bias": False, "1.weight": True, "1.bias": True}


def test_decorating_with_a_context_inside_its_own_block_keeps_the_block():
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    c = ts.freeze(m, "1")
    with c:
        f = c(lambda: m[1].weight.requires_grad)
        assert not m[1].weight.requires_grad  # the block still holds
        assert f() is False and not m[1].weight.requires_grad
    assert m[1].weight.requires_grad
    assert f() is False and m[1].weight.requires_grad  # per call afterwards


def test_a_refused_declaration_changes_no_flag_elsewhere():
    m = nn.Module()
    m.enc, m.head = nn.Linear(2, 2), nn.Linear(2, 2)
    ts.mark_trainable(m, "enc", "head")
    del m.head  # the declaration names a child that is gone: invalid
    m.adapter = nn.Linear(2, 2)
    before = flags(m)
    with pytest.raises(ValueError):
        ts.freeze(m.enc, "bias")
    with pytest.raises(ValueError):
        ts.mark_trainable(m.enc, "weight")
    assert flags(m) == before


@pytest.mark.parametrize("how", ["context", "declaration"])
def test_a_lazy_batch_norm_with_cumulative_average_frozen_before_its_first_forward(how):
    # docs/freezing.md: "a layer built with momentum=None is held as any other"; its first
    # forward materializes fresh statistics, which is no reset
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 3), nn.LazyBatchNorm1d(momentum=None), nn.Linear(3, 1))
    ctx = ts.freeze(net, "1") if how == "context" else ts.mark_trainable(net, "0", "2")
    for _ in range(3):
        net(torch.randn(8, 3))
    assert torch.equal(net[1].running_mean, torch.zeros(3))
    assert torch.equal(net[1].running_var, torch.ones(3))
    assert int(net[1].num_batches_tracked) == 0
    net[1].reset_running_stats()  # a reset while held (what update_bn does) still raises
    with pytest.raises(RuntimeError, match="were reset"):
        net(torch.randn(8, 3))
    if how == "context":
        ctx.__exit__(None, None, None)


def test_a_loaded_lazy_batch_norm_reset_while_held_still_raises():
    from torch.optim.swa_utils import update_bn

    torch.manual_seed(0)
    src = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3, momentum=None))
    src(torch.randn(16, 3) + 3)
    m = nn.Sequential(nn.Linear(3, 3), nn.LazyBatchNorm1d(momentum=None))
    with ts.freeze(m, "1"):
        m.load_state_dict(src.state_dict())  # materializes trained statistics: the hold's own
        with pytest.raises(RuntimeError, match="were reset"):
            update_bn([torch.randn(8, 3) for _ in range(3)], m)


def test_loading_into_an_inference_model_inside_inference_mode():
    with torch.inference_mode():
        m = nn.Linear(2, 2)
    with torch.inference_mode():
        ts.load_state_dict(m, {"weight": torch.ones(2, 2), "bias": torch.zeros(2)})
    assert torch.equal(m.weight, torch.ones(2, 2))
    with pytest.raises(ValueError, match="inference_mode"):
        ts.load_state_dict(m, {"weight": torch.zeros(2, 2), "bias": torch.zeros(2)})
    assert torch.equal(m.weight, torch.ones(2, 2))
