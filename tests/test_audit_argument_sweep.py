"""A sweep of wrong argument types over the whole public API of torchstruct.

For every public function, constructor and method, each argument is fed values of the wrong
kind that a user could pass by mistake: text for numbers, numbers / None / text for bool flags,
bools, NumPy scalars and 0-dim / 1-element / meta tensors for numbers, NaN / inf / negative
numbers, generators and sets where lists are, dicts or classes where a module is, modules and
parameters that belong to another model. The cases come from tables (``pytest.mark.parametrize``
over the cross product of arguments and bad values), not one by one.

What each case must do: either be accepted as documented (the docstrings, ``docs/`` and
``torch``'s own behaviour for the drop-in arguments), with the same result as the plain number
would give, or raise ``TypeError`` / ``ValueError`` / ``RuntimeError`` with a message naming the
argument; and when it raises, every ``requires_grad`` flag, parameter value, ``.grad``, buffer,
module attribute, hook and optimizer state / param group must be exactly as before. Arguments
of the same kind in different functions (``strict``, ``buffers``, ``norm_type``, ``max_norm``,
learning-rate-like numbers, integers) must treat the same bad value the same way.

Convention: a case where torchstruct breaks this is kept, minimized, as a test marked
``@pytest.mark.xfail(strict=True, reason="BUG: what happens; what is expected")``; everything
else is an ordinary passing test.
"""
import copy
import math

import numpy as np
import pytest
import torch
from torch import nn

import torchstruct as ts

ERRORS = (TypeError, ValueError, RuntimeError)


# ------------------------------------------------------------------------------ fixtures
def make_model():
    """Linear -> LayerNorm -> Linear, with ``.grad`` on every parameter, one parameter frozen
    by hand and one BatchNorm (buffers)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3), nn.Linear(3, 2), nn.BatchNorm1d(2))
    for i, p in enumerate(m.parameters()):
        p.grad = torch.full_like(p, 0.5 + i)
    m[1].bias.requires_grad_(False)
    return m


OTHER = nn.Linear(3, 3)  # a model that is never part of the one under test


def snapshot(model, opt=None):
    """Everything a failed call must leave as it was."""
    snap = {
        "flags": [(n, p.requires_grad) for n, p in model.named_parameters()],
        "params": [(n, p.detach().clone()) for n, p in model.named_parameters()],
        "param_ids": [(n, id(p)) for n, p in model.named_parameters()],
        "grads": [(n, None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()],
        "buffers": [(n, b.clone()) for n, b in model.named_buffers()],
        "attrs": [(n, sorted(vars(mod).keys()), len(mod._forward_pre_hooks), len(mod._forward_hooks),
                   mod.training) for n, mod in model.named_modules()],
        "trainable": [n for n, _ in ts.trainable_parameters(model)],
    }
    if opt is not None:
        sd = opt.state_dict()
        snap["opt_state"] = {k: {kk: (vv.clone() if torch.is_tensor(vv) else vv) for kk, vv in v.items()}
                             for k, v in sd["state"].items()}
        snap["opt_groups"] = [{k: (v if k != "params" else list(v)) for k, v in g.items()}
                              for g in sd["param_groups"]]
        snap["opt_nparams"] = [len(g["params"]) for g in opt.param_groups]
    return snap


def _same(a, b):
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and \
            a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def assert_unchanged(before, after):
    for key in before:
        assert _same(before[key], after[key]), f"{key} changed by a call that raised"


def check_refused_or_accepted(call, model, names, opt=None):
    """Run ``call()``; return ``("ok", result)`` or ``("error", exc)`` after checking that an
    error names one of ``names`` and leaves everything as it was."""
    before = snapshot(model, opt)
    try:
        result = call()
    except ERRORS as e:
        assert_unchanged(before, snapshot(model, opt))
        msg = str(e)
        assert any(n in msg for n in names), f"error does not name {names}: {type(e).__name__}: {msg}"
        return "error", e
    return "ok", result


# ------------------------------------------------------------------------------ values
# values that mean the number 0.5 in another type
NUMERIC_EQUIVALENTS = {
    "np_float64": lambda: np.float64(0.5),
    "np_float32": lambda: np.float32(0.5),
    "tensor_0d": lambda: torch.tensor(0.5),
    "tensor_1elem": lambda: torch.tensor([0.5]),
    "tensor_0d_f64": lambda: torch.tensor(0.5, dtype=torch.float64),
}
# values no number-argument may take silently
ALWAYS_BAD_NUMBERS = {
    "none": lambda: None,
    "text_word": lambda: "abc",
    "text_False": lambda: "False",
    "nan": lambda: float("nan"),
    "list": lambda: [0.5],
    "set": lambda: {0.5},
    "tensor_2elem": lambda: torch.tensor([0.5, 0.5]),
    "complex": lambda: 0.5 + 1j,
    "meta_tensor": lambda: torch.tensor(0.5, device="meta"),
    "module": lambda: nn.Linear(1, 1),
}


def _grads_of(m):
    return [p.grad.clone() for p in m.parameters()]


def _clip_max_norm(m, v):
    total = ts.clip_by_global_norm(m, v)
    return float(total), _grads_of(m)


def _clip_norm_type(m, v):
    total = ts.clip_by_global_norm(m, 1.0, v)
    return float(total), _grads_of(m)


def _global_norm(m, v):
    return float(ts.global_norm(m, v))


def _polyak(m, v):
    src = make_model()
    with torch.no_grad():
        for p in src.parameters():
            p.add_(1.0)
    ts.polyak_update(m, src, v)
    return [p.detach().clone() for p in m.parameters()]


def _layer_decay(m, v):
    return ts.layer_decay(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)), v,
                          layers="")


def _pg(key):
    def call(m, v):
        groups = ts.param_groups(m, ("0", {key: v}))
        return [(g["name"], float(g[key])) for g in groups if key in g]
    return call


def _pg_weight_decay(m, v):
    return [(g["name"], g.get("weight_decay")) for g in ts.param_groups(m, weight_decay=v)]


def _opt(cls, key, **fixed):
    def call(m, v):
        kw = dict(fixed)
        if key.startswith("betas"):
            betas = [0.9, 0.999]
            betas[int(key[-1])] = v
            kw["betas"] = tuple(betas)
        else:
            kw[key] = v
        opt = cls(m.parameters(), **kw)
        opt.step()
        return [p.detach().clone() for p in m.parameters()]
    return call


# (label, callable(model, value), names one of which the error must mention, value of 0.5
#  allowed?, negative refused?)
NUMBER_ARGS = [
    ("clip.max_norm", _clip_max_norm, ["max_norm"], True),
    ("clip.norm_type", _clip_norm_type, ["norm_type"], True),
    ("global_norm.norm_type", _global_norm, ["norm_type"], True),
    ("polyak_update.tau", _polyak, ["tau"], True),
    ("layer_decay.decay", _layer_decay, ["decay"], True),
    ("param_groups.lr", _pg("lr"), ["lr"], True),
    ("param_groups.lr_scale", _pg("lr_scale"), ["lr_scale"], True),
    ("param_groups.weight_decay", _pg_weight_decay, ["weight_decay"], True),
    ("SGD.lr", _opt(ts.optim.SGD, "lr"), ["lr"], True),
    ("SGD.momentum", _opt(ts.optim.SGD, "momentum", lr=0.1), ["momentum"], True),
    ("SGD.dampening", _opt(ts.optim.SGD, "dampening", lr=0.1, momentum=0.9), ["dampening"], False),
    ("SGD.weight_decay", _opt(ts.optim.SGD, "weight_decay", lr=0.1), ["weight_decay"], True),
    ("SGD.max_grad_norm", _opt(ts.optim.SGD, "max_grad_norm", lr=0.1), ["max_grad_norm"], True),
    ("SGD.norm_type", _opt(ts.optim.SGD, "norm_type", lr=0.1, max_grad_norm=1.0), ["norm_type"], True),
    ("AdamW.lr", _opt(ts.optim.AdamW, "lr"), ["lr"], True),
    ("AdamW.eps", _opt(ts.optim.AdamW, "eps"), ["eps"], True),
    ("AdamW.weight_decay", _opt(ts.optim.AdamW, "weight_decay"), ["weight_decay"], True),
    ("AdamW.betas0", _opt(ts.optim.AdamW, "betas0"), ["betas"], True),
    ("AdamW.betas1", _opt(ts.optim.AdamW, "betas1"), ["betas"], True),
    ("AdamW.max_grad_norm", _opt(ts.optim.AdamW, "max_grad_norm"), ["max_grad_norm"], True),
]
NUMBER_ARG_IDS = [a[0] for a in NUMBER_ARGS]

# documented acceptances: None means "not given" for these
NUMBER_DOCUMENTED = {("param_groups.weight_decay", "none"), ("SGD.max_grad_norm", "none"),
                     ("AdamW.max_grad_norm", "none")}


def _cases(values):
    out = []
    for label, call, names, neg_refused in NUMBER_ARGS:
        for key, make in values.items():
            if (label, key) in NUMBER_DOCUMENTED:
                continue
            out.append(pytest.param(label, call, names, make, id=f"{label}-{key}"))
    return out


@pytest.mark.parametrize("label, call, names, make", _cases(ALWAYS_BAD_NUMBERS))
def test_number_argument_refuses_garbage(label, call, names, make):
    """None, words, NaN, lists, sets, several-element / complex / meta tensors, modules: a
    clear error naming the argument, nothing changed."""
    m = make_model()
    outcome, what = check_refused_or_accepted(lambda: call(m, make()), m, names)
    assert outcome == "error", f"{label} accepted {make()!r}: {what!r}"


@pytest.mark.parametrize("label, call, names, make",
                         [c for c in _cases({"negative": lambda: -0.5})
                          if c.values[0] not in ("SGD.dampening",)])
def test_number_argument_refuses_negative(label, call, names, make):
    m = make_model()
    outcome, what = check_refused_or_accepted(lambda: call(m, make()), m, names)
    assert outcome == "error", f"{label} accepted -0.5"


@pytest.mark.parametrize("label, call, names, make", _cases(NUMERIC_EQUIVALENTS))
def test_number_argument_numeric_equivalents_match_plain_float(label, call, names, make):
    """NumPy scalars and one-element tensors: accepted with exactly the result of 0.5 (or
    refused with a clear error naming the argument)."""
    m_ref = make_model()
    expected = call(m_ref, 0.5)
    m = make_model()
    outcome, got = check_refused_or_accepted(lambda: call(m, make()), m, names)
    assert outcome == "ok", f"{label} refuses {make()!r}: {got}"
    assert _same(got, expected)


# ---- the same bad value, the same treatment, across the drop-in number arguments
@pytest.mark.parametrize("value", ["2", "2.0", True, np.int64(2), torch.tensor(2.0)],
                         ids=["text_int", "text_float", "bool", "np_int", "tensor"])
def test_norm_type_same_treatment_everywhere(value):
    """``norm_type`` is read with ``float()`` by clip_by_global_norm, global_norm and the
    optimizers alike (torch's clip_grad_norm_ reads it that way too): the same answer."""
    m1, m2, m3 = make_model(), make_model(), make_model()
    p = float(value)
    expected = torch.nn.utils.clip_grad_norm_([q for q in m3.parameters() if q.requires_grad], 1.0, p)
    # a model argument means its trainable parameters: the same set as given to torch above
    assert float(ts.global_norm(m1, value)) == pytest.approx(float(expected), rel=1e-6)
    assert float(ts.clip_by_global_norm(m2, 1.0, value)) == pytest.approx(float(expected), rel=1e-6)
    ts.optim.SGD(make_model().parameters(), lr=0.1, max_grad_norm=1.0, norm_type=value)


def test_max_norm_text_accepted_like_torch_but_max_grad_norm_text_refused_as_documented():
    m = make_model()
    m_ref = make_model()
    total = ts.clip_by_global_norm(m, "1.0")
    total_ref = torch.nn.utils.clip_grad_norm_([p for p in m_ref.parameters() if p.requires_grad], "1.0")
    assert torch.allclose(total, total_ref)
    for cls in (ts.optim.SGD, ts.optim.AdamW):
        with pytest.raises(ValueError, match="max_grad_norm"):
            cls(make_model().parameters(), lr=0.1, max_grad_norm="1.0")


@pytest.mark.parametrize("value", [True, np.bool_(True), torch.tensor(True)], ids=["bool", "np_bool", "tensor_bool"])
def test_bool_as_tau_refused(value):
    """A bool tau is refused (documented); the refusal leaves the target untouched."""
    m = make_model()
    outcome, e = check_refused_or_accepted(lambda: _polyak(m, value), m, ["tau"])
    assert outcome == "error" and isinstance(e, TypeError)


@pytest.mark.parametrize("value", [True, False], ids=["True", "False"])
def test_bool_as_learning_rate_matches_torch(value):
    """torch.optim takes lr=True as 1.0; ts.optim must agree (accepting it is torch's rule)."""
    m1, m2 = make_model(), make_model()
    ts.optim.SGD(m1.parameters(), lr=value).step()
    torch.optim.SGD([p for p in m2.parameters()], lr=value, foreach=False).step()
    for a, b in zip(m1.parameters(), m2.parameters()):
        if a.requires_grad:
            assert torch.equal(a, b)


@pytest.mark.parametrize("value", ["0.5", True, float("inf"), float("nan"), -1.0],
                         ids=["text", "bool", "inf", "nan", "neg"])
def test_lr_scale_refused_by_param_groups_and_optimizer_alike(value):
    """``lr_scale`` is checked by param_groups and by the optimizer: both refuse the same
    values, and a refused add_param_group leaves the optimizer as it was."""
    m = make_model()
    with pytest.raises((TypeError, ValueError), match="lr_scale"):
        ts.param_groups(m, ("0", {"lr_scale": value}))
    opt = ts.optim.SGD([m[0].weight], lr=0.1, momentum=0.9)
    opt.step()
    outcome, _ = check_refused_or_accepted(
        lambda: opt.add_param_group({"params": [m[2].weight], "lr_scale": value}), m, ["lr_scale"], opt)
    assert outcome == "error"


@pytest.mark.parametrize("key, value", [("lr", "0.1"), ("lr", None), ("lr", float("nan")), ("lr", -1.0),
                                        ("momentum", "0.9"), ("weight_decay", [0.1]),
                                        ("lr", torch.tensor([0.1, 0.1])), ("lr_scale", "2")],
                         ids=lambda v: repr(v)[:12])
def test_bad_group_value_set_before_step_changes_nothing(key, value):
    """A hyper-parameter broken by hand in ``param_groups`` is refused at ``step()`` before any
    parameter, gradient or state moves."""
    m = make_model()
    opt = ts.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    opt.step()
    opt.param_groups[0][key] = value
    before = snapshot(m, None)
    state_before = copy.deepcopy(opt.state_dict()["state"])
    with pytest.raises(ERRORS, match=key):
        opt.step()
    assert_unchanged(before, snapshot(m))
    assert _same(state_before, opt.state_dict()["state"])


# ------------------------------------------------------------------------------ bool flags
BAD_FLAGS = {
    "None": None,
    "text_False": "False",
    "text_no": "no",
    "int_0": 0,
    "int_1": 1,
    "np_bool": np.bool_(False),
    "tensor_bool": torch.tensor(False),
    "float": 1.0,
}


def _loss(m):
    return m(torch.ones(4, 3)).sum()


# (label, callable(model, value), argument name, None allowed?)
FLAG_ARGS = [
    ("freeze.strict", lambda m, v: ts.freeze(m, "0", strict=v), "strict", False),
    ("freeze.freeze_norm_stats", lambda m, v: ts.freeze(m, "0", freeze_norm_stats=v), "freeze_norm_stats", False),
    ("freeze_except.strict", lambda m, v: ts.freeze_except(m, "0", strict=v), "strict", False),
    ("freeze_except.freeze_norm_stats", lambda m, v: ts.freeze_except(m, "0", freeze_norm_stats=v), "freeze_norm_stats", False),
    ("unfreeze.strict", lambda m, v: ts.unfreeze(m, "0", strict=v), "strict", False),
    ("unfreeze.freeze_norm_stats", lambda m, v: ts.unfreeze(m, "0", freeze_norm_stats=v), "freeze_norm_stats", False),
    ("stop_gradient.strict", lambda m, v: ts.stop_gradient(m, "0", strict=v), "strict", False),
    ("constant.strict", lambda m, v: ts.constant(m, "0", strict=v), "strict", False),
    ("select.strict", lambda m, v: ts.select(m, "0", strict=v), "strict", False),
    ("param_groups.strict", lambda m, v: ts.param_groups(m, ("0", {"lr": 0.1}), strict=v), "strict", False),
    ("UnfreezeSchedule.strict", lambda m, v: ts.UnfreezeSchedule(m, {0: "0"}, strict=v), "strict", False),
    ("UnfreezeSchedule.freeze_norm_stats", lambda m, v: ts.UnfreezeSchedule(m, {0: "0"}, freeze_norm_stats=v), "freeze_norm_stats", False),
    ("state_dict.buffers", lambda m, v: ts.state_dict(m, buffers=v), "buffers", False),
    ("load_state_dict.strict", lambda m, v: ts.load_state_dict(m, ts.state_dict(m), strict=v), "strict", False),
    ("load_state_dict.buffers", lambda m, v: ts.load_state_dict(m, ts.state_dict(m), buffers=v), "buffers", False),
    ("attach.freeze_norm_stats", lambda m, v: ts.attach(m, freeze_norm_stats=v), "freeze_norm_stats", True),
    ("structural_grad.create_graph", lambda m, v: ts.structural_grad(m, _loss, create_graph=v), "create_graph", False),
    ("structural_grad.retain_graph", lambda m, v: ts.structural_grad(m, _loss, retain_graph=v), "retain_graph", True),
    ("value_and_grad.has_aux", lambda m, v: ts.value_and_grad(
        (lambda m: (_loss(m), 1)) if v is True else _loss, m, has_aux=v), "has_aux", False),
    ("tree.from_module.buffers", lambda m, v: ts.tree.from_module(m, buffers=v), "buffers", False),
]



def _flag_cases():
    out = []
    for label, call, name, none_ok in FLAG_ARGS:
        for key, value in BAD_FLAGS.items():
            if none_ok and value is None:
                continue
            out.append(pytest.param(call, name, value, id=f"{label}-{key}"))
    return out


@pytest.mark.parametrize("call, name, value", _flag_cases())
def test_bool_flag_refuses_non_bool(call, name, value):
    """Every ``strict`` / ``buffers`` / ``freeze_norm_stats`` / graph flag is a bool: anything
    else raises TypeError naming it, and nothing changes (flags, hooks, attributes)."""
    m = make_model()
    outcome, e = check_refused_or_accepted(lambda: call(m, value), m, [name])
    assert outcome == "error", f"{name}={value!r} accepted"
    assert isinstance(e, TypeError)


@pytest.mark.parametrize("label, call, name, none_ok", FLAG_ARGS, ids=[a[0] for a in FLAG_ARGS])
def test_bool_flag_accepts_true_and_false(label, call, name, none_ok):
    for value in (True, False):
        m = make_model()
        out = call(m, value)
        if hasattr(out, "__exit__"):  # a bare context call applies from now on: lift it (a
            out.__exit__(None, None, None)  # constant / stop_gradient block is per thread)


def test_value_and_grad_has_aux_text_false_minimal():
    m = nn.Linear(2, 1)
    with pytest.raises(TypeError, match="has_aux"):
        ts.value_and_grad(lambda m: (m(torch.ones(1, 2)).sum(), "aux"), m, has_aux="False")


def test_tree_from_module_buffers_text_false_minimal():
    with pytest.raises(TypeError, match="buffers"):
        ts.tree.from_module(nn.BatchNorm1d(2), buffers="False")


def test_optimizer_bool_hyperparameters_follow_torch():
    """``nesterov`` / ``maximize`` / ``amsgrad`` are torch's arguments, read as torch reads
    them: ts.optim gives the same update as torch.optim for the same (odd) value."""
    for kw in ({"maximize": 1}, {"maximize": "yes"}, {"nesterov": 1, "momentum": 0.9}):
        m1, m2 = make_model(), make_model()
        ts.optim.SGD(m1.parameters(), lr=0.1, **kw).step()
        torch.optim.SGD(m2.parameters(), lr=0.1, foreach=False, **kw).step()
        for a, b in zip(m1.parameters(), m2.parameters()):
            if a.requires_grad:
                torch.testing.assert_close(a, b)
    m1, m2 = make_model(), make_model()
    ts.optim.AdamW(m1.parameters(), lr=0.1, amsgrad=1).step()
    torch.optim.AdamW(m2.parameters(), lr=0.1, amsgrad=1, foreach=False).step()
    for a, b in zip(m1.parameters(), m2.parameters()):
        if a.requires_grad:
            torch.testing.assert_close(a, b)


# ------------------------------------------------------------------------------ module arguments
NOT_MODULES = {
    "dict_of_params": lambda m: dict(m.named_parameters()),
    "None": lambda m: None,
    "path_text": lambda m: "0",
    "parameter": lambda m: m[0].weight,
    "list_of_modules": lambda m: list(m.children()),
    "module_class": lambda m: nn.Linear,
    "state_dict": lambda m: m.state_dict(),
}

MODEL_ARGS = [
    ("freeze", lambda v: ts.freeze(v, "0")),
    ("freeze_except", lambda v: ts.freeze_except(v, "0")),
    ("unfreeze", lambda v: ts.unfreeze(v, "0")),
    ("stop_gradient", lambda v: ts.stop_gradient(v, "0")),
    ("constant", lambda v: ts.constant(v, "0")),
    ("swap", lambda v: ts.swap(v, {})),
    ("select", lambda v: ts.select(v, "0")),
    ("attach", lambda v: ts.attach(v)),
    ("detach_hooks", lambda v: ts.detach_hooks(v)),
    ("summary", lambda v: ts.summary(v)),
    ("trainable_parameters", lambda v: list(ts.trainable_parameters(v))),
    ("is_trainable", lambda v: ts.is_trainable(v, "0.weight")),
    ("mark_trainable", lambda v: ts.mark_trainable(v, "weight")),
    ("grad_tree", lambda v: ts.grad_tree(v)),
    ("state_dict", lambda v: ts.state_dict(v)),
    ("load_state_dict", lambda v: ts.load_state_dict(v, {})),
    ("structural_grad", lambda v: ts.structural_grad(v, torch.ones((), requires_grad=True))),
    ("map_trainable", lambda v: ts.map_trainable(lambda p: p, v)),
    ("polyak_update.target", lambda v: ts.polyak_update(v, make_model(), 0.5)),
    ("param_groups", lambda v: ts.param_groups(v)),
    ("layer_decay", lambda v: ts.layer_decay(v, 0.5)),
    ("UnfreezeSchedule", lambda v: ts.UnfreezeSchedule(v, {0: None})),
    ("is_norm", lambda v: ts.is_norm(v)),
    ("tree.from_module", lambda v: ts.tree.from_module(v)),
]


@pytest.mark.parametrize("call", [pytest.param(c, id=n) for n, c in MODEL_ARGS])
@pytest.mark.parametrize("make", list(NOT_MODULES.values()), ids=list(NOT_MODULES))
def test_model_argument_must_be_a_module(call, make):
    """A dict of parameters, a state_dict, a class, a parameter, a path or None where a module
    is expected: TypeError, and the model the value came from is untouched."""
    m = make_model()
    before = snapshot(m)
    with pytest.raises(TypeError, match=r"(?i)module"):
        call(make(m))
    assert_unchanged(before, snapshot(m))


# ------------------------------------------------------------------------------ selectors
BAD_SELECTORS = {
    "dict": lambda m: {"0": True},
    "set": lambda m: {"0"},
    "generator": lambda m: (s for s in ["0"]),
    "int": lambda m: 0,
    "float": lambda m: 1.5,
    "bytes": lambda m: b"0",
    "plain_tensor": lambda m: m[0].weight.detach(),
    "param_data": lambda m: m[0].weight.data,
    "other_module": lambda m: OTHER,
    "other_parameter": lambda m: OTHER.weight,
    "deepcopy_of_submodule": lambda m: copy.deepcopy(m[0]),
    "empty_list": lambda m: [],
    "typo": lambda m: "O.weight",
    "list_with_one_bad": lambda m: ["0", OTHER],
}

SELECTOR_ARGS = [
    ("freeze", lambda m, s: ts.freeze(m, s)),
    ("freeze_except", lambda m, s: ts.freeze_except(m, s)),
    ("unfreeze", lambda m, s: ts.unfreeze(m, s)),
    ("freeze.strict_False", lambda m, s: ts.freeze(m, s, strict=False)),
    ("stop_gradient", lambda m, s: ts.stop_gradient(m, s)),
    ("constant", lambda m, s: ts.constant(m, s)),
    ("select", lambda m, s: ts.select(m, s)),
    ("UnfreezeSchedule", lambda m, s: ts.UnfreezeSchedule(m, {0: "2", 3: s})),
    ("structural_grad.wrt", lambda m, s: ts.structural_grad(m, _loss, wrt=s)),
    ("value_and_grad.wrt", lambda m, s: ts.value_and_grad(lambda m: _loss(m), m, wrt=s)),
    ("param_groups.rule", lambda m, s: ts.param_groups(m, (s, {"lr": 0.1}))),
    ("param_groups.no_decay", lambda m, s: ts.param_groups(m, no_decay=s)),
]


def _selector_cases():
    out = []
    for label, call in SELECTOR_ARGS:
        for key, make in BAD_SELECTORS.items():
            if label == "freeze.strict_False" and key in (
                    "typo", "other_module", "other_parameter", "deepcopy_of_submodule",
                    "list_with_one_bad"):
                continue  # strict=False: a string matching nothing, or an object not in the
                # model, selects nothing (documented in ts.select; contexts re-applied after
                # a module was replaced rely on it)
            out.append(pytest.param(call, make, id=f"{label}-{key}"))
    return out


@pytest.mark.parametrize("call, make", _selector_cases())
def test_bad_selector_refused_with_nothing_changed(call, make):
    """Unsupported selector types, objects from another model, an empty list, a typo: a clear
    error (TypeError for types, ValueError for objects/paths), nothing changed."""
    m = make_model()
    sel = make(m)
    before = snapshot(m)
    with pytest.raises((TypeError, ValueError), match=r"(?i)selector|select|not a (sub)?module|"
                       r"not a parameter|empty|match|closest|milestone|rule|no_decay"):
        call(m, sel)
    assert_unchanged(before, snapshot(m))


@pytest.mark.parametrize("make", [lambda m: OTHER.weight, lambda m: m[0].weight.detach(), lambda m: 0,
                                  lambda m: None, lambda m: {"0.weight"}, lambda m: "0.wieght"],
                         ids=["other_param", "plain_tensor", "int", "None", "set", "typo"])
def test_is_trainable_bad_argument(make):
    m = make_model()
    before = snapshot(m)
    with pytest.raises((TypeError, ValueError)):
        ts.is_trainable(m, make(m))
    assert_unchanged(before, snapshot(m))


@pytest.mark.parametrize("value", [OTHER, OTHER.weight, 0, b"x", {"0"}, ["0"], "nope"],
                         ids=["other_module", "parameter", "int", "bytes", "set", "list", "typo"])
def test_layer_decay_bad_layers(value):
    m = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), nn.Linear(2, 2))
    with pytest.raises((TypeError, ValueError), match="layer"):
        ts.layer_decay(m, 0.5, layers=value)


@pytest.mark.parametrize("value", [0, b"weight", OTHER, {"weight"}, ["weight"], False, (n for n in ["weight"])],
                         ids=["int", "bytes", "module", "set", "list", "False", "generator"])
def test_mark_trainable_bad_names(value):
    m = make_model()
    before = snapshot(m)
    with pytest.raises((TypeError, ValueError), match="names|name"):
        ts.mark_trainable(m[0], value)
    assert_unchanged(before, snapshot(m))


def test_mark_trainable_none_mixed_with_names_refused():
    m = make_model()
    before = snapshot(m)
    with pytest.raises((TypeError, ValueError)):
        ts.mark_trainable(m[0], None, "weight")
    assert_unchanged(before, snapshot(m))


# ------------------------------------------------------------------------------ integers
@pytest.mark.parametrize("value", [-1, 1.0, "1", True, None.__class__, [1], float("inf")],
                         ids=["neg", "float", "text", "bool", "type", "list", "inf"])
def test_summary_max_depth_refuses_non_integers(value):
    with pytest.raises(TypeError, match="max_depth"):
        ts.summary(make_model(), value)


def test_summary_max_depth_numpy_integer():
    m = make_model()
    assert ts.summary(m, np.int64(1)).counts == ts.summary(m, 1).counts


@pytest.mark.parametrize("key, error", [(1.0, TypeError), ("0", TypeError), (True, TypeError), (-1, ValueError),
                                        (None, TypeError)], ids=["float", "text", "bool", "neg", "None"])
def test_schedule_milestone_step_types(key, error):
    m = make_model()
    before = snapshot(m)
    with pytest.raises(error, match="milestone"):
        ts.UnfreezeSchedule(m, {key: "0"})
    assert_unchanged(before, snapshot(m))


@pytest.mark.parametrize("key", [np.int64(0), torch.tensor(0)], ids=["np_int", "tensor_int"])
def test_schedule_milestone_integer_like_steps_accepted(key):
    m1, m2 = make_model(), make_model()
    ts.UnfreezeSchedule(m1, {key: "0"})
    ts.UnfreezeSchedule(m2, {0: "0"})
    assert [p.requires_grad for p in m1.parameters()] == [p.requires_grad for p in m2.parameters()]


@pytest.mark.parametrize("state", [None, [], {}, "x", {"step": "1", "milestones": [0, 2]},
                                   {"step": 1.5, "milestones": [0, 2]}, {"step": True, "milestones": [0, 2]},
                                   {"step": -1, "milestones": [0, 2]}, {"step": None, "milestones": [0, 2]},
                                   {"step": 1, "milestones": [0, "2"]}, {"step": 1, "milestones": [0, 3]},
                                   {"step": torch.tensor(1.5), "milestones": [0, 2]}],
                         ids=lambda s: repr(s)[:24])
def test_schedule_load_state_dict_bad_state(state):
    m = make_model()
    sched = ts.UnfreezeSchedule(m, {0: "2", 2: "0"})
    before = snapshot(m)
    with pytest.raises((TypeError, ValueError), match="load_state_dict"):
        sched.load_state_dict(state)
    assert_unchanged(before, snapshot(m))
    assert sched.current_step == 0


# ------------------------------------------------------------------------------ trees
def _meta_tree(m):
    return {n: p.detach().to("meta") for n, p in m.named_parameters()}


BAD_TREES = {
    "None": lambda m: None,
    "list": lambda m: [p.detach().clone() for p in m.parameters()],
    "module": lambda m: make_model(),
    "generator": lambda m: ((n, p.detach().clone()) for n, p in m.named_parameters()),
    "float_leaf": lambda m: {**{n: p.detach().clone() for n, p in m.named_parameters()}, "0.bias": 1.0},
    "numpy_leaf": lambda m: {**{n: p.detach().clone() for n, p in m.named_parameters()},
                             "0.bias": np.zeros(3, dtype=np.float32)},
    "meta_leaves": _meta_tree,
    "wrong_shape": lambda m: {**{n: p.detach().clone() for n, p in m.named_parameters()}, "0.bias": torch.zeros(4)},
    "unknown_path": lambda m: {**{n: p.detach().clone() for n, p in m.named_parameters()}, "9.weight": torch.zeros(1)},
    "int_key": lambda m: {0: torch.zeros(1)},
}

TREE_ARGS = [
    ("swap", lambda m, t: ts.swap(m, t)),
    ("load_state_dict", lambda m, t: ts.load_state_dict(m, t, strict=False)),
    ("polyak_update.source", lambda m, t: ts.polyak_update(m, t, 0.5)),
    ("map_trainable", lambda m, t: ts.map_trainable(lambda p, g: g + 0, m, t)),
]

TREE_ACCEPTS = {
    ("polyak_update.source", "module"),  # a module source is documented (matched by path)
    # documented: map_trainable checks shapes (and paths), not devices; f decides what to do
    ("map_trainable", "meta_leaves"),
}


def _tree_cases():
    out = []
    for label, call in TREE_ARGS:
        for key, make in BAD_TREES.items():
            if (label, key) in TREE_ACCEPTS:
                continue
            out.append(pytest.param(call, make, id=f"{label}-{key}"))
    return out


@pytest.mark.parametrize("call, make", _tree_cases())
def test_bad_tree_refused_with_nothing_changed(call, make):
    m = make_model()
    tree = make(m)
    before = snapshot(m)
    with pytest.raises((TypeError, ValueError)):
        call(m, tree)
    assert_unchanged(before, snapshot(m))


@pytest.mark.parametrize("make", [lambda: (p for p in make_model().parameters()),
                                  lambda: set(make_model().parameters())], ids=["generator", "set"])
def test_clip_takes_iterables_as_torch_does(make):
    params = make()
    ps = list(params) if isinstance(params, set) else None
    total = ts.clip_by_global_norm(ps if ps is not None else params, 1.0)
    ref = make_model()
    expected = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 1.0)
    assert torch.allclose(total, expected)


@pytest.mark.parametrize("value", [None, "abc", 3, 1.5, [1.0, 2.0], {"a": 1.0}, {"a": np.ones(2)}, {"a": OTHER}],
                         ids=["None", "text", "int", "float", "list_of_floats", "float_leaf", "numpy_leaf", "module_leaf"])
@pytest.mark.parametrize("fn", ["clip_by_global_norm", "global_norm"])
def test_norm_functions_refuse_non_tensors(fn, value):
    with pytest.raises(TypeError):
        if fn == "clip_by_global_norm":
            ts.clip_by_global_norm(value, 1.0)
        else:
            ts.global_norm(value)


def test_clip_meta_gradients_refused_or_meta_result():
    """Meta gradients have no values: a meta total norm (as global_norm gives) or a clear error."""
    w = nn.Parameter(torch.ones(2, device="meta"))
    w.grad = torch.ones(2, device="meta")
    try:
        total = ts.clip_by_global_norm([w], 1.0)
    except ERRORS as e:
        assert "meta" in str(e)
    else:
        assert total.device.type == "meta"


TREE_FN_CASES = [
    ("paths", lambda v: ts.tree.paths(v)),
    ("leaves", lambda v: ts.tree.leaves(v)),
    ("to_flat_dict", lambda v: ts.tree.to_flat_dict(v)),
    ("flatten", lambda v: ts.tree.flatten(v)),
    ("map", lambda v: ts.tree.map(lambda x: x, v)),
    ("reduce", lambda v: ts.tree.reduce(lambda a, x: a, v, 0)),
]


@pytest.mark.parametrize("fn", [pytest.param(f, id=n) for n, f in TREE_FN_CASES])
@pytest.mark.parametrize("value", [None, [torch.ones(1)], nn.Linear(1, 1), {1: torch.ones(1)}, {"a": 1.0},
                                   {"a": np.ones(1)}, {"": torch.ones(1)}, {"a..b": torch.ones(1)},
                                   {"a": torch.ones(1), "a.b": torch.ones(1)}, "abc"],
                         ids=["None", "list", "module", "int_key", "float_leaf", "numpy_leaf", "empty_key",
                              "empty_component", "prefix_conflict", "text"])
def test_tree_functions_refuse_non_trees(fn, value):
    with pytest.raises((TypeError, ValueError)):
        fn(value)


@pytest.mark.parametrize("args", [([1.0, 1.0], "spec"), (np.ones(2), "spec"), (torch.ones(1, 2), "spec"),
                                  (torch.ones(3), "spec"), (torch.ones(2), {"a": 1}), (torch.ones(2), None)],
                         ids=["list", "numpy", "2d", "length", "dict_spec", "None_spec"])
def test_unflatten_bad_arguments(args):
    _, spec = ts.tree.flatten({"a": torch.ones(2)})
    vec, sp = args
    with pytest.raises((TypeError, ValueError), match="vector|spec"):
        ts.tree.unflatten(vec, spec if sp == "spec" else sp)


@pytest.mark.parametrize("flat", [None, "ab", torch.ones(2), 3, {1: torch.ones(1)}, [("a", 1.0)], [("a",)],
                                  {"a": torch.ones(1), "a.b": torch.ones(1)}],
                         ids=["None", "text", "tensor", "int", "int_key", "float_value", "not_pair", "conflict"])
def test_from_flat_dict_bad_arguments(flat):
    with pytest.raises((TypeError, ValueError)):
        ts.tree.from_flat_dict(flat)


def test_from_flat_dict_generator_accepted_as_documented():
    t = ts.tree.from_flat_dict((k, v) for k, v in [("a.b", torch.ones(1)), ("c", torch.zeros(1))])
    assert ts.tree.paths(t) == ["a.b", "c"]


@pytest.mark.parametrize("f", [None, "f", 3], ids=["None", "text", "int"])
@pytest.mark.parametrize("fn", ["tree.map", "tree.reduce", "map_trainable", "value_and_grad"])
def test_callable_arguments_refuse_non_callables(fn, f):
    m = make_model()
    before = snapshot(m)
    with pytest.raises(TypeError, match="callable"):
        if fn == "tree.map":
            ts.tree.map(f, {"a": torch.ones(1)})
        elif fn == "tree.reduce":
            ts.tree.reduce(f, {"a": torch.ones(1)}, 0)
        elif fn == "map_trainable":
            ts.map_trainable(f, m)
        else:
            ts.value_and_grad(f, m)
    assert_unchanged(before, snapshot(m))


@pytest.mark.parametrize("loss", [None, 1.0, "x", np.float32(1.0), [torch.ones(())]],
                         ids=["None", "float", "text", "numpy", "list"])
def test_structural_grad_loss_type(loss):
    m = make_model()
    before = snapshot(m)
    with pytest.raises(TypeError, match="loss"):
        ts.structural_grad(m, loss)
    assert_unchanged(before, snapshot(m))


@pytest.mark.parametrize("value", [None, 1.0, [torch.ones(1)], {"a": torch.ones(1)}, "x"],
                         ids=["None", "float", "list", "dict", "text"])
def test_within_gradient_refuses_non_tensors(value):
    with pytest.raises(TypeError, match="within_gradient"):
        ts.within_gradient(torch.ones(1), value)


# ------------------------------------------------------------------------------ optimizers
BAD_MASKS = {
    "other_parameter": lambda m: {OTHER.weight: torch.ones(3, 3, dtype=torch.bool)},
    "param_data": lambda m: {m[0].weight.data: torch.ones(3, 3, dtype=torch.bool)},
    "float_mask": lambda m: {m[0].weight: torch.ones(3, 3)},
    "wrong_shape": lambda m: {m[0].weight: torch.ones(3, dtype=torch.bool)},
    "meta_mask": lambda m: {m[0].weight: torch.ones(3, 3, dtype=torch.bool, device="meta")},
    "python_bool": lambda m: {m[0].weight: True},
    "numpy_mask": lambda m: {m[0].weight: np.ones((3, 3), dtype=bool)},
    "nested_list_mask": lambda m: {m[0].weight: [[True] * 3] * 3},
    "unknown_path": lambda m: {"0.weigth": torch.ones(3, 3, dtype=torch.bool)},
    "int_key": lambda m: {0: torch.ones(3, 3, dtype=torch.bool)},
}
@pytest.mark.parametrize("cls", [ts.optim.SGD, ts.optim.AdamW], ids=["SGD", "AdamW"])
@pytest.mark.parametrize("make", list(BAD_MASKS.values()) + [
    lambda m: [torch.ones(3, 3, dtype=torch.bool)],
    lambda m: {m[0].weight}],
    ids=list(BAD_MASKS) + ["list_of_masks", "set_of_params"])
def test_optimizer_bad_masks(cls, make):
    m = make_model()
    masks = make(m)
    before = snapshot(m)
    with pytest.raises((TypeError, ValueError), match="mask"):
        cls(m.parameters(), lr=0.1, masks=masks)
    assert_unchanged(before, snapshot(m))


@pytest.mark.parametrize("make", [
    lambda m: (OTHER.weight, torch.ones(3, 3, dtype=torch.bool)),
    lambda m: (m[0].weight, torch.ones(3, 3)),
    lambda m: (m[0].weight, torch.ones(3, 3, dtype=torch.bool, device="meta")),
    lambda m: (m[0].weight, True),
    lambda m: ("0.weight", torch.ones(3, 3, dtype=torch.bool)),
    lambda m: (m[0].weight.detach(), torch.ones(3, 3, dtype=torch.bool)),
], ids=["other_param", "float_mask", "meta_mask", "python_bool", "path_without_names", "plain_tensor"])
def test_set_mask_bad_arguments_leave_optimizer_unchanged(make):
    m = make_model()
    opt = ts.optim.AdamW(m.parameters(), lr=0.1)
    opt.step()
    args = make(m)
    outcome, _ = check_refused_or_accepted(lambda: opt.set_mask(*args), m, ["mask", "param"], opt)
    assert outcome == "error"


@pytest.mark.parametrize("param", [OTHER.weight, 0, None, torch.ones(3, 3)],
                         ids=["other_param", "int", "None", "plain_tensor"])
def test_set_mask_remove_on_non_parameter_is_an_error(param):
    m = make_model()
    opt = ts.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises((TypeError, ValueError)):
        opt.set_mask(param, None)


def test_set_mask_remove_unknown_path_is_an_error():
    """(with param_names, an unknown path is refused also when removing a mask)"""
    m = make_model()
    opt = ts.optim.SGD(ts.param_groups(m), lr=0.1)
    with pytest.raises(ValueError, match="closest"):
        opt.set_mask("0.wieght", None)


@pytest.mark.parametrize("params", [None, "abc", 3, OTHER, {"w": OTHER.weight}, []],
                         ids=["None", "text", "int", "module", "dict", "empty"])
@pytest.mark.parametrize("cls", [ts.optim.SGD, ts.optim.AdamW], ids=["SGD", "AdamW"])
def test_optimizer_params_refused_like_torch(cls, params):
    with pytest.raises((TypeError, ValueError)):
        cls(params, lr=0.1)
    torch_cls = getattr(torch.optim, cls.__name__)
    with pytest.raises((TypeError, ValueError)):
        torch_cls(params, lr=0.1)


@pytest.mark.parametrize("cls", [ts.optim.SGD, ts.optim.AdamW], ids=["SGD", "AdamW"])
def test_optimizer_generator_params_accepted_like_torch(cls):
    m1, m2 = make_model(), make_model()
    cls((p for p in m1.parameters()), lr=0.1).step()
    getattr(torch.optim, cls.__name__)((p for p in m2.parameters()), lr=0.1, foreach=False).step()
    for a, b in zip(m1.parameters(), m2.parameters()):
        if a.requires_grad:  # a parameter frozen by hand is skipped by ts.optim (documented)
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("group", [
    lambda m: {"params": [m[0].weight]},  # already in a group
    lambda m: {"params": {m[2].weight}},  # a set
    lambda m: {"params": [m[2].weight], "lr": "0.1"},
    lambda m: {"params": [m[2].weight], "lr": float("nan")},
    lambda m: {"params": [m[2].weight], "momentum": -1.0},
    lambda m: {"params": [m[2].weight.detach()]},  # a non-leaf? (a leaf tensor: torch accepts)
    lambda m: {"params": [torch.ones(2, dtype=torch.complex64, requires_grad=True)]},
    lambda m: {"params": [m[2].weight], "lr": torch.tensor([0.1, 0.2])},
], ids=["duplicate", "set", "lr_text", "lr_nan", "neg_momentum", "plain_leaf", "complex", "lr_2elem"])
def test_add_param_group_bad_group_changes_nothing(group):
    m = make_model()
    opt = ts.optim.SGD([m[0].weight, m[0].bias], lr=0.1, momentum=0.9)
    opt.step()
    g = group(m)
    before = snapshot(m, opt)
    try:
        opt.add_param_group(g)
    except ERRORS:
        assert_unchanged(before, snapshot(m, opt))
    else:
        # accepted only where torch accepts it too
        topt = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1, momentum=0.9)
        topt.add_param_group(copy.copy(g))


@pytest.mark.parametrize("closure", [1, "x"], ids=["int", "text"])
def test_step_closure_not_callable_changes_nothing(closure):
    m = make_model()
    opt = ts.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    opt.step()
    before = snapshot(m, opt)
    with pytest.raises(TypeError):
        opt.step(closure)
    assert_unchanged(before, snapshot(m, opt))


# ------------------------------------------------------------------------------ misc
@pytest.mark.parametrize("device", [1.5, True, "gpu", [0]], ids=["float", "bool", "text", "list"])
def test_backend_bad_device(device):
    with pytest.raises((TypeError, ValueError, RuntimeError)):
        ts.backend(device)


def test_backend_meta_device_is_reference():
    assert ts.backend(torch.ones(1, device="meta")) == "reference"
    assert ts.backend("meta") == "reference"


@pytest.mark.parametrize("tau", [0.0, 1.0, np.float32(0.25), torch.tensor(0.25, requires_grad=True)],
                         ids=["zero", "one", "np32", "tensor_requires_grad"])
def test_polyak_edge_taus_give_the_documented_result(tau):
    m, src = make_model(), make_model()
    with torch.no_grad():
        for p in src.parameters():
            p.add_(4.0)
    orig = [p.detach().clone() for p in m.parameters()]
    ts.polyak_update(m, src, tau)
    t = float(tau)
    for (n, p), o, s in zip(m.named_parameters(), orig, src.parameters()):
        if n == "1.bias":  # frozen by hand: untouched
            assert torch.equal(p, o)
        else:
            torch.testing.assert_close(p.detach(), (1 - t) * o + t * s.detach())
