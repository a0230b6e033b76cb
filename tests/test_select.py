"""Tests for torchstruct.select: every selector kind, tied parameters, strict errors."""

import re

import pytest
import torch
from torch import nn

import torchstruct as ts


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(3, 3)
        self.norm = nn.LayerNorm(3)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList([Block(), Block()])
        self.encoder.proj = nn.Linear(3, 3, bias=False)
        self.head = nn.Linear(3, 2)
        self.scale = nn.Parameter(torch.ones(()))


ALL = [
    "scale",
    "encoder.layers.0.q.weight",
    "encoder.layers.0.q.bias",
    "encoder.layers.0.norm.weight",
    "encoder.layers.0.norm.bias",
    "encoder.layers.1.q.weight",
    "encoder.layers.1.q.bias",
    "encoder.layers.1.norm.weight",
    "encoder.layers.1.norm.bias",
    "encoder.proj.weight",
    "head.weight",
    "head.bias",
]


def paths(model, *sels, **kw):
    return [p for p, _ in ts.select(model, *sels, **kw)]


@pytest.fixture
def net():
    return Net()


def test_named_parameters_order_is_the_reference(net):
    assert [p for p, _ in net.named_parameters()] == ALL
    assert paths(net, "*") == ALL


# ----------------------------------------------------------------------------- globs
def test_glob_on_exact_parameter_path(net):
    assert paths(net, "head.bias") == ["head.bias"]
    assert paths(net, "scale") == ["scale"]


def test_glob_naming_a_module_selects_its_subtree(net):
    assert paths(net, "head") == ["head.weight", "head.bias"]
    assert paths(net, "encoder.layers.1") == [p for p in ALL if p.startswith("encoder.layers.1.")]
    assert paths(net, "encoder") == [p for p in ALL if p.startswith("encoder.")]


def test_glob_star_under_a_module(net):
    assert paths(net, "encoder.*") == [p for p in ALL if p.startswith("encoder.")]
    assert paths(net, "encoder.layers.*.q") == [p for p in ALL if ".q." in p]


def test_glob_star_bias(net):
    assert paths(net, "*.bias") == [p for p in ALL if p.endswith(".bias")]


def test_glob_pattern_naming_modules_by_suffix(net):
    # "*.norm" names modules (no parameter path ends in "norm"): their whole subtrees
    assert paths(net, "*.norm") == [p for p in ALL if ".norm." in p]


def test_glob_does_not_match_partial_names(net):
    # "head" must not select a hypothetical "header"; "enc" is no prefix match of "encoder"
    assert paths(net, "enc", strict=False) == []
    m = nn.ModuleDict({"head": nn.Linear(1, 1), "header": nn.Linear(1, 1)})
    assert paths(m, "head") == ["head.weight", "head.bias"]


def test_glob_character_class_and_question_mark(net):
    assert paths(net, "encoder.layers.[0].q.weight") == ["encoder.layers.0.q.weight"]
    assert paths(net, "encoder.layers.?.q.bias") == [
        "encoder.layers.0.q.bias",
        "encoder.layers.1.q.bias",
    ]


# ----------------------------------------------------------------------------- regex
def test_regex_fullmatch(net):
    assert paths(net, re.compile(r"encoder\.layers\.\d\.q\.weight")) == [
        "encoder.layers.0.q.weight",
        "encoder.layers.1.q.weight",
    ]
    # fullmatch, not search: a pattern matching only a part of a path selects nothing
    with pytest.raises(ValueError):
        ts.select(net, re.compile(r"q\.weight"))
    assert paths(net, re.compile(r"q\.weight"), strict=False) == []
    assert paths(net, re.compile(r".*q\.weight")) == [
        "encoder.layers.0.q.weight",
        "encoder.layers.1.q.weight",
    ]


def test_regex_matching_nothing_raises_with_close_paths(net):
    with pytest.raises(ValueError) as e:
        ts.select(net, re.compile(r"haed\.weight"))
    assert "head.weight" in str(e.value)


# ----------------------------------------------------------------------------- callables
def test_callable_gets_path_and_param(net):
    seen = []

    def pick(path, p):
        seen.append((path, p))
        return p.ndim == 2

    got = ts.select(net, pick)
    assert [p for p, _ in got] == [p for p, t in net.named_parameters() if t.ndim == 2]
    named = dict(net.named_parameters())
    assert all(named[path] is p for path, p in seen)
    for path, p in got:
        assert named[path] is p


def test_callable_truthiness(net):
    assert paths(net, lambda path, p: 1 if path == "scale" else 0) == ["scale"]


def test_callable_selecting_nothing_is_allowed(net):
    assert ts.select(net, lambda path, p: False) == []


# ----------------------------------------------------------------------------- objects
def test_module_object_selects_its_subtree(net):
    assert paths(net, net.encoder.layers[1].norm) == [
        "encoder.layers.1.norm.weight",
        "encoder.layers.1.norm.bias",
    ]
    assert paths(net, net) == ALL


def test_parameter_object_selects_itself(net):
    assert paths(net, net.head.bias) == ["head.bias"]
    got = ts.select(net, net.scale)
    assert len(got) == 1 and got[0][1] is net.scale


def test_module_without_parameters_selects_nothing_and_strict_says_so(net):
    """A selector naming only parameter-less modules is an empty match: freeze_except would
    freeze everything. Strict (the default) refuses it; strict=False allows it."""
    net.act = nn.ReLU()
    for sel in (net.act, "act", "ac*", ["act"]):
        with pytest.raises(ValueError, match="selects no parameter"):
            ts.select(net, sel)
        assert ts.select(net, sel, strict=False) == []
    before = [p.requires_grad for p in net.parameters()]
    with pytest.raises(ValueError, match="'act'"):
        ts.freeze_except(net, "act")
    assert [p.requires_grad for p in net.parameters()] == before
    # in a union that picks parameters, a parameter-less module is fine (layers listed by index)
    assert [path for path, _ in ts.select(net, ["act", "head"])] == ["head.weight", "head.bias"]
    assert ts.select(net, "act", lambda path, p: False) == []  # a predicate answered: no error


# ----------------------------------------------------------------------------- unions
def test_list_and_tuple_union(net):
    want = ["scale", "encoder.proj.weight", "head.weight", "head.bias"]
    assert paths(net, ["head", "scale", net.encoder.proj]) == want
    assert paths(net, ("head", "scale", net.encoder.proj)) == want
    assert paths(net, "head", "scale", net.encoder.proj) == want


def test_nested_lists(net):
    sel = ["head.bias", ("scale", [re.compile(r"encoder\.proj\..*"), [lambda p, _: False]])]
    assert paths(net, sel) == ["scale", "encoder.proj.weight", "head.bias"]


def test_union_overlap_returns_each_parameter_once_in_model_order(net):
    assert paths(net, ["head.weight", "head", "*.weight", net.head]) == [
        p for p in ALL if p.endswith(".weight") or p.startswith("head.")
    ]


def test_no_selector_selects_nothing(net):
    assert ts.select(net) == []


def test_returns_parameter_objects(net):
    named = dict(net.named_parameters())
    for path, p in ts.select(net, "*"):
        assert named[path] is p and isinstance(p, nn.Parameter)


# ----------------------------------------------------------------------------- tied
class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.body = nn.Linear(3, 3)
        self.out = nn.Linear(3, 5, bias=False)
        self.out.weight = self.embed.weight  # tied: paths embed.weight and out.weight


def test_tied_selected_by_any_path_once_at_first_path():
    m = Tied()
    for sel in ["embed.weight", "out.weight", "out", "embed", re.compile(r"out\.weight"),
                lambda path, p: path == "out.weight", m.out, m.embed, m.out.weight]:
        got = ts.select(m, sel)
        assert len(got) == 1, sel
        assert got[0][0] == "embed.weight" and got[0][1] is m.embed.weight, sel
    got = ts.select(m, "*")
    assert [p for p, _ in got] == ["embed.weight", "body.weight", "body.bias"]


def test_tied_module_used_twice():
    lin = nn.Linear(2, 2)
    m = nn.Sequential(lin, nn.ReLU(), lin)
    assert paths(m, "2") == ["0.weight", "0.bias"]
    assert paths(m, "2.bias") == ["0.bias"]
    assert paths(m, "*") == ["0.weight", "0.bias"]


def test_tied_callable_sees_every_path():
    m = Tied()
    seen = []
    ts.select(m, lambda path, p: seen.append(path) or False)
    assert "out.weight" in seen and "embed.weight" in seen


# ----------------------------------------------------------------------------- strict errors
def test_misspelt_string_raises_naming_closest_paths(net):
    with pytest.raises(ValueError) as e:
        ts.select(net, "encoder.layers.0.q.wieght")
    msg = str(e.value)
    assert "encoder.layers.0.q.wieght" in msg
    assert "encoder.layers.0.q.weight" in msg


def test_misspelt_module_name_raises_naming_closest(net):
    with pytest.raises(ValueError) as e:
        ts.select(net, "encodr")
    assert "encoder" in str(e.value)
    with pytest.raises(ValueError) as e:
        ts.select(net, "haed")
    assert "head" in str(e.value)


def test_far_off_string_still_names_real_paths(net):
    with pytest.raises(ValueError) as e:
        ts.select(net, "zzzzzzzzzzzzzzzzzzzz")
    assert any(p in str(e.value) for p in ALL)


def test_one_bad_string_in_a_list_raises(net):
    with pytest.raises(ValueError) as e:
        ts.select(net, ["head", "encoder.prj"])
    assert "encoder.proj" in str(e.value)


def test_foreign_module_raises(net):
    with pytest.raises(ValueError):
        ts.select(net, nn.Linear(3, 3))


def test_foreign_parameter_raises(net):
    with pytest.raises(ValueError):
        ts.select(net, nn.Parameter(torch.zeros(3)))


@pytest.mark.parametrize("bad", [3, 2.5, None, b"head", {"head"}, torch.zeros(3), object()])
def test_unsupported_types_raise_type_error(net, bad):
    with pytest.raises(TypeError):
        ts.select(net, bad)


def test_unsupported_type_nested_in_list_raises_type_error(net):
    with pytest.raises(TypeError):
        ts.select(net, ["head", [7]])


def test_non_module_model_raises_type_error():
    with pytest.raises(TypeError):
        ts.select([nn.Linear(1, 1)], "*")


def test_strict_false_allows_empty_match(net):
    assert ts.select(net, "nope", strict=False) == []
    assert ts.select(net, re.compile("nope"), strict=False) == []
    assert ts.select(net, ["nope", "head.bias"], strict=False)[0][0] == "head.bias"
    # a foreign object simply selects nothing
    assert ts.select(net, nn.Linear(1, 1), strict=False) == []
    assert ts.select(net, nn.Parameter(torch.zeros(1)), strict=False) == []


def test_strict_false_still_rejects_bad_types(net):
    with pytest.raises(TypeError):
        ts.select(net, 3, strict=False)


def test_empty_model():
    m = nn.ReLU()
    assert ts.select(m, "*", strict=False) == []
    with pytest.raises(ValueError):
        ts.select(m, "weight")


def test_index_leaves_no_reference_cycle_holding_the_model():
    """A model indexed (and selected from) is freed by reference counting alone, as soon as
    the last reference goes: nothing waits for the garbage collector."""
    import gc
    import weakref

    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)))
    ref = weakref.ref(model)
    gc.disable()
    try:
        ts.select(model, "1.*")
        del model
        assert ref() is None
    finally:
        gc.enable()
