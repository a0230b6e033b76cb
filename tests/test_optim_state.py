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


# -- a parameter listed twice in a group (torch warns "duplicate parameters") -----------------

REPEATED = {"SGD": (tso.SGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.1)),
            "AdamW": (tso.AdamW, torch.optim.AdamW, dict(lr=0.05, weight_decay=0.1))}


def three_tensors(seed=0):
    """a, p, q: the parameters of the repeated-parameter tests."""
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(*shape, generator=g)) for shape in ((4,), (3, 2), (5,))]


def over_repeated(cls, tensors, **kw):
    """``cls`` over two groups, the second listing p and q twice each: torch numbers a 0,
    p 3 and q 4 (a repeated parameter by its last position in its group)."""
    a, p, q = tensors
    with pytest.warns(UserWarning, match="duplicate parameters"):
        return cls([{"params": [a]}, {"params": [p, q, p, q], "lr": 0.03}], **kw)


def masks_of(tensors):
    """Masks on a and on the repeated p (q has none)."""
    a, p, _ = tensors
    return {a: torch.tensor([True, False, True, True]),
            p: torch.tensor([[True, False], [False, True], [True, True]])}


def step_with_grads(opt, tensors, steps, start=0):
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(100 + step)
        for t in tensors:
            t.grad = torch.randn(t.shape, generator=g)
        opt.step()


def same_bits(a, b) -> bool:
    """Bitwise equality of two tensors (tells -0.0 from 0.0), dtype and shape included."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return a == b
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    ints = {torch.float32: torch.int32, torch.float64: torch.int64}[a.dtype]
    return torch.equal(a.detach().reshape(-1).view(ints), b.detach().reshape(-1).view(ints))


def assert_same_state_dicts(one, two):
    """Two optimizer state dicts alike bitwise: groups, state entries (carried masks too)."""
    assert one["param_groups"] == two["param_groups"]
    assert set(one["state"]) == set(two["state"]) and set(one["masks"]) == set(two["masks"])
    for k, entry in one["state"].items():
        assert set(entry) == set(two["state"][k])
        for key, value in entry.items():
            assert same_bits(value, two["state"][k][key]), (k, key)
    for k, mask in one["masks"].items():
        assert same_bits(mask, two["masks"][k])


@pytest.mark.parametrize("name", sorted(REPEATED))
def test_repeated_parameter_numbered_as_torch_numbers_it(name):
    """Every index state_dict() writes -- "state", "masks", the carried masks -- is torch's
    own number of the parameter (a repeated one: its last position in its group)."""
    ts_cls, torch_cls, kw = REPEATED[name]
    ours, theirs = three_tensors(), three_tensors()
    opt = over_repeated(ts_cls, ours, masks=masks_of(ours), **kw)
    ref = over_repeated(torch_cls, theirs, foreach=False, **kw)
    step_with_grads(opt, ours, 1)
    step_with_grads(ref, theirs, 1)
    sd, torch_sd = opt.state_dict(), ref.state_dict()
    assert [g["params"] for g in sd["param_groups"]] == [[0], [3, 4, 3, 4]]
    assert [g["params"] for g in torch_sd["param_groups"]] == [[0], [3, 4, 3, 4]]
    assert set(sd["state"]) == set(torch_sd["state"]) == {0, 3, 4}
    assert set(sd["masks"]) == {0, 3}
    for k, mask in sd["masks"].items():
        assert sd["state"][k]["torchstruct_mask"] is mask
    assert "torchstruct_mask" not in sd["state"][4]
    assert torch.equal(sd["masks"][3], masks_of(ours)[ours[1]])


@pytest.mark.parametrize("name", sorted(REPEATED))
def test_repeated_parameter_resume_is_bitwise(backend, name):
    """state_dict -> a fresh optimizer (no masks=) over copies of the parameters ->
    load_state_dict -> more steps: parameters, moments and masks stay bitwise those of the
    optimizer that never stopped, also through torch.save / torch.load."""
    ts_cls, _, kw = REPEATED[name]
    first = three_tensors()
    start = [t.detach().clone() for t in first]
    masks = masks_of(first)
    opt = over_repeated(ts_cls, first, masks=masks, **kw)
    step_with_grads(opt, first, 3)
    for saved in (copy.deepcopy(opt.state_dict()), roundtrip(opt.state_dict())):
        resumed = [nn.Parameter(t.detach().clone()) for t in first]
        again = over_repeated(ts_cls, resumed, **kw)
        again.load_state_dict(saved)
        assert set(map(id, again.masks)) == {id(resumed[0]), id(resumed[1])}
        for t, r in zip(first, resumed):
            assert set(again.state[r]) == set(opt.state[t])
            for key, value in opt.state[t].items():
                assert same_bits(again.state[r][key], value), key
        assert_same_state_dicts(again.state_dict(), opt.state_dict())
        straight = copy.deepcopy((opt, first))  # the never-stopped run, from here on
        step_with_grads(again, resumed, 3, start=3)
        step_with_grads(straight[0], straight[1], 3, start=3)
        for t, r in zip(straight[1], resumed):
            assert same_bits(r, t)
        assert_same_state_dicts(again.state_dict(), straight[0].state_dict())
    for t, s in zip(first[:2], start[:2]):  # the masked-out elements kept their bits
        mask = masks[t]
        assert same_bits(t[~mask], s[~mask])


@pytest.mark.parametrize("name", sorted(REPEATED))
def test_repeated_parameter_state_dicts_interchange_with_torch(backend, name):
    """With a repeated parameter, torch.optim's state dict loads (keeping the current masks),
    and ours loads into torch.optim, whose state dict brings the carried masks back."""
    ts_cls, torch_cls, kw = REPEATED[name]
    theirs = three_tensors()
    ref = over_repeated(torch_cls, theirs, foreach=False, **kw)
    step_with_grads(ref, theirs, 2)
    ours = [nn.Parameter(t.detach().clone()) for t in theirs]
    masks = masks_of(ours)
    opt = over_repeated(ts_cls, ours, masks=masks, **kw)
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))
    assert set(map(id, opt.masks)) == set(map(id, masks))
    for t, o in zip(theirs, ours):
        for key, value in ref.state[t].items():
            assert torch.equal(opt.state[o][key].float(), value.float()), key
    step_with_grads(opt, ours, 2, start=2)

    other = over_repeated(torch_cls, three_tensors(seed=1), foreach=False, **kw)
    other.load_state_dict(copy.deepcopy(opt.state_dict()))
    back = [nn.Parameter(t.detach().clone()) for t in ours]
    fresh = over_repeated(ts_cls, back, **kw)  # no masks=: they come from the state entries
    fresh.load_state_dict(other.state_dict())
    assert set(map(id, fresh.masks)) == {id(back[0]), id(back[1])}
    for t, b in zip(ours[:2], back[:2]):
        assert same_bits(fresh.masks[b], masks[t])
