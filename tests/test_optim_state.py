"""ts.optim state dicts keep the element masks: a resumed run needs no masks= and continues
bitwise; bad saved masks or state raise before anything changes; masks by path."""
import copy
import io

import pytest
import torch
from torch import nn

import torchstruct as ts
import torchstruct.optim as tso
from _flags import NEEDS_NAMED_OPTIM

KINDS = {"adamw": (tso.AdamW, dict(lr=0.05, weight_decay=0.1)),
         "sgd": (tso.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.1))}


def make(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 1))


def rows_mask(model):
    mask = torch.zeros(10, 4, dtype=torch.bool)
    mask[7:] = True  # only the new rows of the embedding train
    return mask


def train(model, opt, steps, start=0):
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        idx = torch.randint(0, 10, (8, 3), generator=g)
        opt.zero_grad()
        model(idx).pow(2).mean().backward()
        opt.step()


def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_resume_needs_no_masks_and_is_bitwise(kind):
    cls, kw = KINDS[kind]
    straight = make()
    opt = cls(ts.param_groups(straight), masks={straight[0].weight: rows_mask(straight)}, **kw)
    train(straight, opt, 6)

    first = make()
    opt1 = cls(ts.param_groups(first), masks={first[0].weight: rows_mask(first)}, **kw)
    train(first, opt1, 3)
    model_state = roundtrip(first.state_dict())
    optim_state = roundtrip(opt1.state_dict())
    assert list(optim_state["masks"]) == [0] and optim_state["masks"][0].dtype == torch.bool

    resumed = make(seed=1)
    resumed.load_state_dict(model_state)
    opt2 = cls(ts.param_groups(resumed), **kw)  # no masks= here
    opt2.load_state_dict(optim_state)
    assert torch.equal(opt2.masks[resumed[0].weight], rows_mask(resumed))
    train(resumed, opt2, 3, start=3)
    for p, q in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    assert torch.equal(resumed[0].weight[:7], make()[0].weight[:7])  # masked rows untouched


@NEEDS_NAMED_OPTIM
def test_masks_keyed_by_path_with_named_groups():
    model = make()
    opt = tso.AdamW(ts.param_groups(model), masks={"0.weight": rows_mask(model)})
    assert opt.masks[model[0].weight] is not None
    opt.set_mask("1.weight", torch.ones(4, 4, dtype=torch.bool))
    assert model[1].weight in opt.masks
    opt.set_mask("1.weight", None)
    assert model[1].weight not in opt.masks
    with pytest.raises(ValueError, match="'0.wieght'.*closest.*'0.weight'"):
        tso.AdamW(ts.param_groups(model), masks={"0.wieght": rows_mask(model)})
    with pytest.raises(ValueError, match="carry no param_names"):
        tso.AdamW(model.parameters(), masks={"0.weight": rows_mask(model)})
    named = tso.SGD(model.named_parameters(), lr=0.1, masks={"0.weight": rows_mask(model)})
    assert model[0].weight in named.masks


def test_torch_state_dicts_interchange():
    model = make()
    ours = tso.AdamW(model.parameters(), masks={model[0].weight: rows_mask(model)})
    train(model, ours, 2)
    theirs = torch.optim.AdamW(make().parameters())
    theirs.load_state_dict(ours.state_dict())  # the extra "masks" key is ignored by torch
    back = tso.AdamW(model.parameters(), masks={model[0].weight: rows_mask(model)})
    back.load_state_dict(theirs.state_dict())  # no "masks": the current ones stay
    assert model[0].weight in back.masks


def snapshot(opt):
    return copy.deepcopy(opt.state_dict()), {p: m.clone() for p, m in opt.masks.items()}


def assert_unchanged(opt, snap):
    sd, masks = snap
    now = opt.state_dict()
    assert now["param_groups"] == sd["param_groups"]
    assert set(now["state"]) == set(sd["state"])
    for k in sd["state"]:
        for key, value in sd["state"][k].items():
            assert torch.equal(now["state"][k][key], value)
    assert set(map(id, opt.masks)) == set(map(id, masks))
    for p, m in masks.items():
        assert torch.equal(opt.masks[p], m)


@pytest.mark.parametrize("corrupt, match", [
    (lambda sd: sd["masks"].__setitem__(0, torch.ones(9, 4, dtype=torch.bool)),
     r"shape \(9, 4\)"),
    (lambda sd: sd["masks"].__setitem__(0, torch.ones(10, 4)), "dtype torch.float32"),
    (lambda sd: sd["masks"].__setitem__(0, [True]), "not a bool tensor"),
    (lambda sd: sd["masks"].__setitem__(99, torch.ones(10, 4, dtype=torch.bool)),
     "index 99"),
    (lambda sd: sd.__setitem__("masks", [1]), "'masks' must be a dict"),
    (lambda sd: sd["state"][1].__setitem__("exp_avg", torch.zeros(3)), r"'exp_avg'.*\(3,\)"),
])
def test_bad_saved_masks_or_state_change_nothing(corrupt, match):
    model = make()
    opt = tso.AdamW(ts.param_groups(model, no_decay=None), lr=0.1,
                    masks={model[0].weight: rows_mask(model)})
    train(model, opt, 2)
    other = make()
    saved = copy.deepcopy(opt.state_dict())
    target = tso.AdamW(ts.param_groups(other, no_decay=None), lr=0.3,
                       masks={other[0].weight: torch.ones(10, 4, dtype=torch.bool)})
    train(other, target, 1)
    corrupt(saved)
    snap = snapshot(target)
    with pytest.raises(ValueError, match=match):
        target.load_state_dict(saved)
    assert_unchanged(target, snap)


def test_mismatched_groups_raise_as_torch_does():
    model = make()
    opt = tso.AdamW(ts.param_groups(model), lr=0.1)
    other = tso.AdamW(ts.param_groups(make(), no_decay=None), lr=0.1)
    with pytest.raises(ValueError, match="number of parameter groups"):
        other.load_state_dict(opt.state_dict())


def test_param_names_recorded_in_state_dict():
    model = make()
    opt = tso.AdamW(ts.param_groups(model, weight_decay=0.01))
    sd = opt.state_dict()
    assert sd["param_groups"][0]["param_names"] == ["0.weight", "1.weight", "2.weight"]
    assert sd["param_groups"][1]["name"] == "default (no decay)"
