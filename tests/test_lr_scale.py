"""lr_scale: ts.optim steps with lr * lr_scale (against torch.optim with the product as lr),
schedulers keep the ratios, lr_scale=0 leaves a group bitwise unchanged, bad values raise."""
import copy

import pytest
import torch
from torch import nn

import torchstruct as ts
import torchstruct.optim as tso

OPTIMS = {
    "adamw": (tso.AdamW, torch.optim.AdamW, dict(weight_decay=0.1, amsgrad=True)),
    "sgd": (tso.SGD, torch.optim.SGD, dict(momentum=0.9, weight_decay=0.1, nesterov=True)),
}


def make(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def train(model, opt, steps, sched=None, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(6, 5, generator=g)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        if sched is not None:
            sched.step()


@pytest.mark.parametrize("kind", sorted(OPTIMS))
def test_matches_torch_with_scaled_lr(kind):
    ours_cls, theirs_cls, kw = OPTIMS[kind]
    lr, scales = 0.01, [0.3, 1.0, 7.0]
    a, b = make(), make()
    ours = ours_cls([{"params": a[2 * i].parameters(), "lr_scale": s}
                     for i, s in enumerate(scales)], lr=lr, **kw)
    theirs = theirs_cls([{"params": b[2 * i].parameters(), "lr": lr * s}
                         for i, s in enumerate(scales)], lr=lr, foreach=False, **kw)
    train(a, ours, 15)
    train(b, theirs, 15)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", sorted(OPTIMS))
def test_lr_scale_one_is_bitwise_the_plain_step(kind):
    ours_cls, _, kw = OPTIMS[kind]
    a, b = make(), make()
    train(a, ours_cls([{"params": a.parameters(), "lr_scale": 1.0}], lr=0.02, **kw), 10)
    train(b, ours_cls(b.parameters(), lr=0.02, **kw), 10)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("kind", sorted(OPTIMS))
def test_scheduler_keeps_the_ratios(kind):
    ours_cls, theirs_cls, kw = OPTIMS[kind]
    a, b = make(), make()
    rest_a = list(a[2].parameters()) + list(a[4].parameters())
    rest_b = list(b[2].parameters()) + list(b[4].parameters())
    ours = ours_cls([{"params": a[0].parameters(), "lr_scale": 0.25}, {"params": rest_a}],
                    lr=0.04, **kw)
    theirs = theirs_cls([{"params": b[0].parameters()}, {"params": rest_b}], lr=0.04,
                        foreach=False, **kw)
    s1 = torch.optim.lr_scheduler.OneCycleLR(ours, max_lr=0.04, total_steps=12)
    s2 = torch.optim.lr_scheduler.OneCycleLR(theirs, max_lr=[0.01, 0.04], total_steps=12)
    lrs = []
    g = torch.Generator().manual_seed(1)
    for _ in range(11):
        x = torch.randn(6, 5, generator=g)
        lrs.append(ours.param_groups[1]["lr"])
        assert ours.param_groups[0]["lr"] == lrs[-1]  # the scheduler sees one lr
        assert ours.param_groups[0]["lr_scale"] == 0.25  # and leaves the scale alone
        for net, opt, sched in ((a, ours, s1), (b, theirs, s2)):
            opt.zero_grad()
            net(x).pow(2).mean().backward()
            opt.step()
            sched.step()
    assert len(set(lrs)) > 5  # the schedule really moved lr
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", sorted(OPTIMS))
def test_lr_scale_zero_leaves_the_group_bitwise_unchanged(kind):
    ours_cls, _, kw = OPTIMS[kind]
    model = make()
    opt = ours_cls([{"params": model[0].parameters(), "lr_scale": 0.0},
                    {"params": list(model[2].parameters()) + list(model[4].parameters())}],
                   lr=0.05, max_grad_norm=0.5, **kw)
    before = [p.detach().clone() for p in model[0].parameters()]
    train(model, opt, 3)
    for p, b in zip(model[0].parameters(), before):
        assert torch.equal(p.detach(), b)  # weight decay did not move it either
        assert p not in opt.state  # no state created, no step count
    assert model[2].weight in opt.state
    # scaled up later (an unfreeze by rate): it starts stepping from a fresh state
    opt.param_groups[0]["lr_scale"] = 1.0
    train(model, opt, 1)
    assert not torch.equal(model[0].weight.detach(), before[0])
    if kind == "adamw":
        assert float(opt.state[model[0].weight]["step"]) == 1


def test_lr_scale_zero_group_is_not_in_the_clip_norm():
    model = make()
    opt = tso.SGD([{"params": model[0].parameters(), "lr_scale": 0.0},
                   {"params": list(model[2].parameters()) + list(model[4].parameters())}],
                  lr=0.05, max_grad_norm=1e9)
    model(torch.randn(3, 5)).sum().backward()
    opt.step()
    expected = ts.global_norm([p.grad for p in list(model[2].parameters())
                               + list(model[4].parameters())])
    torch.testing.assert_close(opt.last_grad_norm, expected)


@pytest.mark.parametrize("bad, error", [
    (-0.5, "lr_scale must be a finite number >= 0"),
    (float("nan"), "lr_scale must be a finite number >= 0"),
    (float("inf"), "lr_scale must be a finite number >= 0"),
    ("x", "lr_scale must be a number"),
    (True, "lr_scale must be a number"),
    (None, "lr_scale must be a number"),
])
@pytest.mark.parametrize("kind", sorted(OPTIMS))
def test_bad_lr_scale_raises_at_construction_and_at_step_before_any_write(kind, bad, error):
    ours_cls, _, kw = OPTIMS[kind]
    model = make()
    with pytest.raises(ValueError, match=f"param group 1: {error}"):
        ours_cls([{"params": model[0].parameters()},
                  {"params": model[2].parameters(), "lr_scale": bad}], lr=0.1, **kw)
    opt = ours_cls([{"params": model[0].parameters()},
                    {"params": model[2].parameters(), "lr_scale": 2.0}], lr=0.1, **kw)
    train(model, opt, 1)
    state = copy.deepcopy(opt.state_dict()["state"])
    params = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[1]["lr_scale"] = bad  # e.g. written by a buggy schedule
    model(torch.randn(2, 5)).sum().backward()
    with pytest.raises(ValueError, match=error):
        opt.step()
    for p, q in zip(model.parameters(), params):
        assert torch.equal(p.detach(), q)
    after = opt.state_dict()["state"]
    for k, entry in state.items():
        for key, value in entry.items():
            assert torch.equal(after[k][key], value)


def test_param_groups_lr_scale_reaches_the_optimizer():
    model = make()
    groups = ts.param_groups(model, ("0", {"lr_scale": 0.5}), weight_decay=0.0)
    opt = tso.AdamW(groups, lr=0.01)
    assert [g.get("lr_scale", 1.0) for g in opt.param_groups] == [0.5, 0.5, 1.0, 1.0]
