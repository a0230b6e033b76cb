"""``attach(module, freeze_norm_stats=...)``: the option belongs to the module it names and is
inherited by its subtree (the nearest ancestor-or-self given one wins, default True); and a
context's exit measures the registrations into its tree also across an attached parent.

Every test compares a BatchNorm's running statistics before and after real forwards in training
mode: "held" means they did not move, "plain" that they moved as in PyTorch.
"""
import copy
import os
import warnings

import pytest
import torch
from torch import nn

import torchstruct as ts

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def x3():
    return torch.randn(8, 3)


def block():
    return nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))


def moves(model, bns, *args):
    """Whether each of ``bns`` updated its running mean during one training forward."""
    model.train()
    before = [bn.running_mean.clone() for bn in bns]
    model(*args)
    return [not torch.equal(b, bn.running_mean) for b, bn in zip(before, bns)]


def two_blocks():
    child, other = block(), block()
    return child, other, nn.Sequential(child, other)


# ------------------------------------------------------------------------ nearest option wins
def test_a_childs_false_survives_attaching_the_parent_and_the_parent_keeps_the_default():
    child, other, parent = two_blocks()
    ts.attach(child, freeze_norm_stats=False)
    ts.attach(parent)
    with ts.freeze(parent):
        assert moves(parent, [child[1], other[1]], x3()) == [True, False]
    assert moves(parent, [child[1], other[1]], x3()) == [True, True]  # trainable: plain


def test_an_explicit_option_on_the_parent_does_not_override_the_childs():
    child, other, parent = two_blocks()
    ts.attach(child, freeze_norm_stats=False)
    ts.attach(parent, freeze_norm_stats=True)
    with ts.freeze(parent):
        assert moves(parent, [child[1], other[1]], x3()) == [True, False]


def test_a_childs_option_changes_only_its_subtree():
    child, other, parent = two_blocks()
    ts.attach(parent, freeze_norm_stats=False)
    ts.attach(child, freeze_norm_stats=True)
    with ts.freeze(parent):
        assert moves(parent, [child[1], other[1]], x3()) == [False, True]


def test_a_child_without_option_inherits_the_parents():
    child, other, parent = two_blocks()
    ts.attach(parent, freeze_norm_stats=False)
    ts.attach(child)  # no option: nothing stored changes, the parent's False reaches it
    with ts.freeze(parent):
        assert moves(parent, [child[1], other[1]], x3()) == [True, True]


def test_attach_without_the_option_keeps_the_stored_one_and_a_new_one_replaces_it():
    child, other, parent = two_blocks()
    ts.attach(parent, freeze_norm_stats=False)
    ts.attach(parent)
    with ts.freeze(parent):
        assert moves(parent, [child[1], other[1]], x3()) == [True, True]
        ts.attach(parent, freeze_norm_stats=True)  # takes effect at once, inside the block too
        assert moves(parent, [child[1], other[1]], x3()) == [False, False]


def test_an_option_on_the_layer_itself_and_three_levels_of_nesting():
    inner = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.BatchNorm1d(3))
    mid = nn.Sequential(inner, nn.BatchNorm1d(3))
    top = nn.Sequential(mid, nn.BatchNorm1d(3))
    ts.attach(top, freeze_norm_stats=False)
    ts.attach(mid, freeze_norm_stats=True)
    ts.attach(inner[2], freeze_norm_stats=False)
    bns = [inner[1], inner[2], mid[1], top[1]]
    with ts.freeze(top):
        assert moves(top, bns, x3()) == [False, True, False, True]


def test_the_option_of_a_child_attached_first_reaches_a_grandparent_attached_later():
    child = block()
    mid = nn.Sequential(child, nn.BatchNorm1d(3))
    top = nn.Sequential(mid, nn.BatchNorm1d(3))
    ts.attach(child, freeze_norm_stats=False)
    ts.attach(mid)
    ts.attach(top, freeze_norm_stats=True)
    with ts.freeze(top):
        assert moves(top, [child[1], mid[1], top[1]], x3()) == [True, False, False]


def test_a_layer_reachable_by_two_paths_follows_its_first_path():
    shared = nn.BatchNorm1d(3)
    a, b = nn.Sequential(shared), nn.Sequential(shared)
    root = nn.Sequential(nn.Linear(3, 3), a, b)
    ts.attach(b, freeze_norm_stats=False)  # b is its second path: the first (via a) says True
    ts.attach(root)
    with ts.freeze(root):
        assert moves(root, [shared], x3()) == [False]
        ts.attach(a, freeze_norm_stats=False)
        assert moves(root, [shared], x3()) == [True]


def test_the_option_does_not_hold_a_layer_frozen_by_hand():
    child, other, parent = two_blocks()
    ts.attach(parent, freeze_norm_stats=True)
    child[1].requires_grad_(False)  # the user's freezing, not torchstruct's: plain behaviour
    assert moves(parent, [child[1], other[1]], x3()) == [True, True]


# ------------------------------------------------------------------------ contexts' own option
def test_a_contexts_false_still_opts_out_while_the_stored_option_is_true():
    child, other, parent = two_blocks()
    ts.attach(parent, freeze_norm_stats=True)
    with ts.freeze(parent):
        with ts.freeze(child, freeze_norm_stats=False):
            assert moves(parent, [child[1], other[1]], x3()) == [True, False]
        assert moves(parent, [child[1], other[1]], x3()) == [False, False]


def test_a_contexts_default_does_not_override_a_stored_false():
    child, other, parent = two_blocks()
    ts.attach(child, freeze_norm_stats=False)
    with ts.freeze(parent):  # implicitly attaches the parent; the context says True
        assert moves(parent, [child[1], other[1]], x3()) == [True, False]


def test_an_unfreeze_schedule_follows_the_stored_options():
    child, other, parent = two_blocks()
    model = nn.Sequential(parent, nn.Linear(3, 1))
    ts.attach(child, freeze_norm_stats=False)
    sched = ts.UnfreezeSchedule(model, {0: "1", 1: None})
    assert not child[1].weight.requires_grad and not other[1].weight.requires_grad
    assert moves(model, [child[1], other[1]], x3()) == [True, False]
    sched.step()
    assert moves(model, [child[1], other[1]], x3()) == [True, True]


# ------------------------------------------------------------------------ copies and detaching
def test_a_deepcopy_is_plain_until_attached_then_follows_its_copied_option():
    child, other, parent = two_blocks()
    ts.attach(child, freeze_norm_stats=False)
    with ts.freeze(parent):
        assert moves(parent, [child[1], other[1]], x3()) == [True, False]
        cp = copy.deepcopy(parent)  # carries the option and, inert, the norm hooks
        assert moves(cp, [cp[0][1], cp[1][1]], x3()) == [True, True]  # no state governs it
        cp.requires_grad_(True)
        ts.freeze(cp)  # permanent, on the copy only
        assert moves(cp, [cp[0][1], cp[1][1]], x3()) == [True, False]
        ts.attach(cp[0], freeze_norm_stats=True)  # the copy's option is its own
        assert moves(cp, [cp[0][1], cp[1][1]], x3()) == [False, False]
        assert moves(parent, [child[1], other[1]], x3()) == [True, False]


def test_detach_hooks_keeps_the_option_and_reattaching_uses_it():
    child, other, parent = two_blocks()
    ts.attach(child, freeze_norm_stats=False)
    ts.freeze(parent)  # permanent
    ts.detach_hooks(parent)
    assert moves(parent, [child[1], other[1]], x3()) == [True, True]  # no hooks: plain
    assert all(not bn._forward_pre_hooks for bn in (child[1], other[1]))
    ts.attach(parent)
    assert moves(parent, [child[1], other[1]], x3()) == [True, False]


def test_a_bad_option_raises_and_changes_nothing():
    child, other, parent = two_blocks()
    for bad in ("False", 0, None.__class__):
        with pytest.raises(TypeError, match="freeze_norm_stats"):
            ts.attach(parent, freeze_norm_stats=bad)
    assert not parent._forward_pre_hooks
    assert all("_torchstruct_freeze_norm_stats" not in m.__dict__ for m in parent.modules())
    with ts.freeze(parent):
        assert moves(parent, [child[1], other[1]], x3()) == [False, False]


# ------------------------------------------------------------------------ a real model
def test_hf_resnet_stage_option_survives_attaching_the_model():
    pytest.importorskip("transformers")
    from transformers import ResNetConfig, ResNetModel

    cfg = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                       layer_type="basic")
    torch.manual_seed(0)
    model = ResNetModel(cfg).train()
    stage0 = model.encoder.stages[0]
    ts.attach(stage0, freeze_norm_stats=False)
    ts.attach(model)
    stem = model.embedder.embedder.normalization
    in0 = stage0.layers[0].layer[0].normalization
    in1 = model.encoder.stages[1].layers[0].layer[0].normalization
    x = torch.randn(2, 3, 16, 16)
    with ts.freeze_except(model, "encoder.stages.1.layers.0.layer.1"):
        assert moves(model, [stem, in0, in1], x) == [False, True, False]
    assert moves(model, [stem, in0, in1], x) == [True, True, True]


# ------------------------------------------------------------------------ registrations and exit
def grown_child():
    """An attached child whose tree already had a registration (its count is not 0)."""
    child = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    ts.attach(child)
    child.append(nn.Identity())
    child(x3())
    return child


def test_a_registration_after_attaching_the_parent_inside_the_block_still_warns():
    child = grown_child()
    parent = nn.Sequential(child, nn.Linear(3, 1))
    with pytest.warns(ts.RestoredFlagsWarning, match="'0.0.weight'"):
        with ts.freeze(child, "0"):
            ts.attach(parent)
            child.add_module("extra", nn.Linear(3, 3))
            child[0].requires_grad_(False)  # same value as the block's: cannot be told apart
    assert child[0].weight.requires_grad and child.extra.weight.requires_grad


def test_a_registration_before_attaching_the_parent_inside_the_block_still_warns():
    child = grown_child()
    parent = nn.Sequential(child, nn.Linear(3, 1))
    with pytest.warns(ts.RestoredFlagsWarning, match="'0.0.weight'"):
        with ts.freeze(child, "0"):
            child.add_module("extra", nn.Linear(3, 3))
            ts.attach(parent)
    assert all(p.requires_grad for p in parent.parameters())


def test_nested_blocks_on_child_and_parent_give_no_spurious_warning():
    child = grown_child()
    parent = nn.Sequential(child, nn.Linear(3, 1))
    other = grown_child()  # an unrelated attached model with a block of its own
    with warnings.catch_warnings():
        warnings.simplefilter("error", ts.RestoredFlagsWarning)
        with ts.freeze(other, "1"), ts.freeze(child, "0"):
            ts.attach(parent)
            with ts.freeze(parent, "1"):
                parent(x3())
    assert all(p.requires_grad for p in parent.parameters())
    assert all(p.requires_grad for p in other.parameters())


def test_get_peft_model_after_attaching_the_parent_inside_the_block_warns():
    peft = pytest.importorskip("peft")
    base = nn.Sequential()
    base.add_module("q", nn.Linear(8, 8))
    base.add_module("head", nn.Linear(8, 2))
    ts.attach(base)
    base.add_module("extra", nn.Identity())  # the child's tree grew before the block
    base(torch.randn(2, 8))
    outer = nn.Sequential(base)
    with pytest.warns(ts.RestoredFlagsWarning) as record:
        with ts.freeze_except(base, "head"):
            ts.attach(outer)
            peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q"]))
    assert "q.base_layer.weight" in str(record[0].message)
    assert base.q.lora_A["default"].weight.requires_grad is True


# ------------------------------------------------------------------ update_bn on the model itself
def test_update_bn_recomputes_held_statistics_and_the_hold_resumes_after_it():
    from torch.optim.swa_utils import update_bn

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 1))
    ts.freeze_except(net, "2")
    batches = [torch.randn(16, 3) for _ in range(3)]
    update_bn(batches, net)
    h = torch.cat([net[0](x) for x in batches]).detach()
    assert torch.allclose(net[1].running_mean, h.mean(0), atol=1e-5)
    assert net[1].momentum == 0.1  # update_bn put it back
    net.train()
    before = net[1].running_mean.clone()
    net(torch.randn(16, 3))  # held again
    assert torch.equal(before, net[1].running_mean)


def test_a_layer_built_with_cumulative_averaging_is_still_held():
    net = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3, momentum=None), nn.Linear(3, 1))
    net(torch.randn(8, 3))  # some statistics
    with ts.freeze(net, "1"):
        before = net[1].running_mean.clone()
        net(torch.randn(8, 3))
        assert torch.equal(before, net[1].running_mean)
