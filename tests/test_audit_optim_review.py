"""Optimizer and clipping edges, each against plain PyTorch:

* masks carried only in the ``"state"`` entries of a state dict (what
  ``get_optimizer_state_dict`` keeps) speak for the parameters that have an entry: one never
  stepped keeps the mask given with ``masks=``;
* the folded clip under a grad scale on the CPU: scaled float32 gradients whose squares
  overflow float32 still give the unscaled norm ``unscale_`` + ``clip_grad_norm_`` give;
* ``clip_by_global_norm`` of a tree of parameters (``dict(model.named_parameters())``) is
  refused: it would rescale the weights;
* param group options the optimizers do not offer are refused by ``add_param_group`` and,
  where they change the update, by ``load_state_dict``; nothing changes.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import torchstruct as ts


def test_masks_carried_in_state_keep_the_mask_of_a_parameter_never_stepped():
    torch.manual_seed(0)
    a, b = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4))
    ma = torch.tensor([True, False, True, False])
    mb = torch.tensor([False, False, False, True])
    opt = ts.optim.AdamW([a, b], lr=0.1, masks={a: ma, b: mb})
    a.grad = torch.ones(4)
    opt.step()  # b has no state yet
    saved = opt.state_dict()
    saved = copy.deepcopy({"state": saved["state"], "param_groups": saved["param_groups"]})
    again = ts.optim.AdamW([a, b], lr=0.1, masks={a: ma, b: mb})
    again.load_state_dict(saved)
    assert torch.equal(again.masks[a], ma) and torch.equal(again.masks[b], mb)
    before = b.detach().clone()
    a.grad = b.grad = torch.ones(4)
    again.step()
    assert torch.equal(b.detach()[~mb], before[~mb]) and not torch.equal(b.detach(), before)
    # an optimizer built without masks gets those the state carries, and only those
    bare = ts.optim.AdamW([a, b], lr=0.1)
    bare.load_state_dict(saved)
    assert [id(p) for p in bare.masks] == [id(a)] and torch.equal(bare.masks[a], ma)


def test_a_state_dict_carrying_no_mask_keeps_the_masks_given_here():
    a = nn.Parameter(torch.zeros(3))
    opt = ts.optim.SGD([a], lr=0.1)
    a.grad = torch.ones(3)
    opt.step()
    saved = opt.state_dict()
    saved = {"state": saved["state"], "param_groups": saved["param_groups"]}
    mine = ts.optim.SGD([a], lr=0.1, masks={a: torch.tensor([True, False, True])})
    mine.load_state_dict(saved)  # no carried mask anywhere (a torch.optim state dict)
    assert a in mine.masks


def test_a_state_entry_without_a_carried_mask_means_no_mask():
    a, b = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3))
    opt = ts.optim.SGD([a, b], lr=0.1, momentum=0.9,
                       masks={a: torch.tensor([True, False, True])})
    a.grad = b.grad = torch.ones(3)
    opt.step()  # both have state; only a's entry carries a mask
    saved = opt.state_dict()
    saved = {"state": saved["state"], "param_groups": saved["param_groups"]}
    mine = ts.optim.SGD([a, b], lr=0.1, momentum=0.9,
                        masks={b: torch.tensor([False, False, True])})
    mine.load_state_dict(saved)  # the saved run stepped b unmasked: it resumes so
    assert [id(p) for p in mine.masks] == [id(a)]


def test_folded_clip_under_a_grad_scale_does_not_overflow_on_the_cpu():
    scale = 2.0 ** 40
    p = nn.Parameter(torch.zeros(4))
    opt = ts.optim.SGD([p], lr=1.0, max_grad_norm=1.0)
    p.grad = torch.full((4,), 2e19)  # scaled: its square overflows float32
    opt.grad_scale, opt.found_inf = torch.tensor(scale), torch.tensor(0.0)
    opt.step()
    q = nn.Parameter(torch.zeros(4))
    q.grad = torch.full((4,), 2e19) * torch.tensor(1 / scale)  # what unscale_ gives
    expected = torch.nn.utils.clip_grad_norm_([q], 1.0)
    torch.optim.SGD([q], lr=1.0).step()
    torch.testing.assert_close(opt.last_grad_norm, expected)
    torch.testing.assert_close(p.detach(), q.detach())


def test_folded_clip_under_a_grad_scale_still_skips_on_inf():
    p = nn.Parameter(torch.zeros(2))
    opt = ts.optim.SGD([p], lr=1.0, max_grad_norm=1.0)
    p.grad = torch.tensor([float("inf"), 1.0])
    opt.grad_scale, opt.found_inf = torch.tensor(2.0), torch.tensor(1.0)
    opt.step()
    assert torch.equal(p.detach(), torch.zeros(2)) and not opt.state
    assert torch.isinf(opt.last_grad_norm)


@pytest.mark.parametrize("tree", ["named_parameters", "from_module"])
def test_clip_of_a_tree_of_parameters_is_refused(tree):
    m = nn.Linear(4, 4)
    m(torch.randn(2, 4)).sum().backward()
    w, g = m.weight.detach().clone(), m.weight.grad.clone()
    params = dict(m.named_parameters()) if tree == "named_parameters" else ts.tree.from_module(m)
    with pytest.raises(TypeError, match="'weight' is an nn.Parameter"):
        ts.clip_by_global_norm(params, 0.1)
    assert torch.equal(m.weight.detach(), w) and torch.equal(m.weight.grad, g)
    # the gradients' tree is clipped as before
    total = ts.clip_by_global_norm(ts.grad_tree(m), 0.1)
    assert total > 0.1 and float(ts.global_norm(m)) == pytest.approx(0.1, rel=1e-4)


@pytest.mark.parametrize("option", [{"differentiable": True}, {"capturable": True},
                                    {"fused": True}, {"foreach": True},
                                    {"decoupled_weight_decay": False}])
def test_add_param_group_refuses_options_not_offered(option):
    p, q = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    opt = ts.optim.AdamW([p], lr=0.1)
    with pytest.raises(TypeError, match=next(iter(option))):
        opt.add_param_group({"params": [q], **option})
    assert len(opt.param_groups) == 1
    # the values torch's own state dicts carry are accepted
    opt.add_param_group({"params": [q], "fused": None, "foreach": False, "capturable": False,
                         "differentiable": False, "decoupled_weight_decay": True})
    assert len(opt.param_groups) == 2


def test_sgd_refuses_differentiable_but_has_no_decoupled_option():
    p, q = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    opt = ts.optim.SGD([p], lr=0.1)
    with pytest.raises(TypeError, match="differentiable"):
        opt.add_param_group({"params": [q], "differentiable": True})
    opt.add_param_group({"params": [q], "decoupled_weight_decay": False})  # not SGD's option


@pytest.mark.parametrize("fused", [None, True])
def test_load_accepts_torch_adamw_and_refuses_torch_adam(fused):
    for cls, ok in ((torch.optim.AdamW, True), (torch.optim.Adam, False)):
        a = nn.Parameter(torch.ones(3))
        a.grad = torch.ones(3)
        theirs = cls([a], lr=0.1, weight_decay=0.01, fused=fused)
        theirs.step()
        mine = ts.optim.AdamW([a], lr=0.2)
        if ok:
            mine.load_state_dict(theirs.state_dict())
            assert mine.param_groups[0]["lr"] == 0.1 and mine.state[a]
        else:
            with pytest.raises(ValueError, match="decoupled_weight_decay=False"):
                mine.load_state_dict(theirs.state_dict())
            assert mine.param_groups[0]["lr"] == 0.2 and not mine.state
