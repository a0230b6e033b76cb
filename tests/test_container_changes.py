"""A container changed by its own methods (``insert``, ``pop``, ``del m[i]``) follows the rules.

PyTorch's ``Sequential``, ``ModuleList`` and ``ModuleDict`` write their ``_modules`` directly in
these methods, without the registration hooks an assignment or ``append`` fires. DESIGN.md §1:
submodules added later follow the declarations at the next forward; Flags: parameters that leave
get their starting flag back. Each case is compared with the read-only answer
(``ts.trainable_parameters``) and with the same change made by registration.
"""
import copy
import warnings

import pytest
import torch
from torch import nn

import torchstruct as ts
from _flags import consistent
from _models import Net, trainable

X = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))


def new():
    return nn.Linear(3, 3)


# (name, change made by the container's own method, the same change made by registration)
def _insert(m, lay):
    m.layers.insert(1, lay)


def _insert_by_assignment(m, lay):
    m.layers = nn.ModuleList([m.layers[0], lay, *list(m.layers)[1:]])


def _seq_insert(m, lay):
    m.head.insert(0, lay)


def _seq_insert_by_assignment(m, lay):
    m.head = nn.Sequential(lay, *m.head)


def _pop(m, _):
    return [m.layers.pop(2)]


def _pop_by_assignment(m, _):
    gone = m.layers[2]
    m.layers = nn.ModuleList(lay for i, lay in enumerate(m.layers) if i != 2)
    return [gone]


def _del_slice(m, _):
    gone = list(m.layers)[1:3]
    del m.layers[1:3]
    return gone


def _del_slice_by_assignment(m, _):
    gone = list(m.layers)[1:3]
    m.layers = nn.ModuleList([m.layers[0], m.layers[3]])
    return gone


def _dict_pop(m, _):
    return [m.extra.pop("a")]


def _dict_pop_by_assignment(m, _):
    gone = m.extra["a"]
    m.extra = nn.ModuleDict({"b": m.extra["b"]})
    return gone and [gone]


def _seq_del(m, _):
    gone = m.head[0]
    del m.head[0]
    return [gone]


def _seq_del_by_assignment(m, _):
    gone = m.head[0]
    m.head = nn.Sequential(m.head[1])
    return [gone]


CHANGES = {
    "ModuleList.insert": (_insert, _insert_by_assignment),
    "Sequential.insert": (_seq_insert, _seq_insert_by_assignment),
    "ModuleList.pop": (_pop, _pop_by_assignment),
    "del ModuleList[1:3]": (_del_slice, _del_slice_by_assignment),
    "ModuleDict.pop": (_dict_pop, _dict_pop_by_assignment),
    "del Sequential[0]": (_seq_del, _seq_del_by_assignment),
}

RULES = {
    "freeze_except a module": lambda m: ts.freeze_except(m, m.head[-1]),
    "freeze a glob": lambda m: ts.freeze(m, "layers.1*", "extra.*"),
    "freeze all": lambda m: ts.freeze(m),
    "declaration": lambda m: ts.mark_trainable(m, "head"),
}


def _run(change, rule, start_frozen=False):
    torch.manual_seed(0)
    m = Net()
    if start_frozen:  # a starting flag of False (a pretrained part frozen by hand)
        m.layers[2].requires_grad_(False)
        m.extra["a"].requires_grad_(False)
        m.head[0].requires_grad_(False)
    lay = new()
    starts = {id(p): p.requires_grad for mod in m.modules() for p in mod.parameters()}
    rule(m)
    m(X)
    gone = change(m, lay) or []
    m(X)
    return m, gone, starts


@pytest.mark.parametrize("start_frozen", [False, True])
@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("name", list(CHANGES))
def test_a_container_change_applies_at_the_next_forward_as_a_registration_does(
        name, rule, start_frozen):
    own, by_registration = CHANGES[name]
    m, gone, starts = _run(own, RULES[rule], start_frozen)
    ref, ref_gone, _ = _run(by_registration, RULES[rule], start_frozen)
    assert consistent(m), "flags and reads disagree"
    assert trainable(m) == trainable(ref)
    for mod, ref_mod in zip(gone, ref_gone):  # what left has its starting flag back
        assert [p.requires_grad for p in mod.parameters()] == \
            [starts[id(p)] for p in mod.parameters()]
        assert [p.requires_grad for p in mod.parameters()] == \
            [p.requires_grad for p in ref_mod.parameters()]


@pytest.mark.parametrize("name", list(CHANGES))
def test_a_container_change_inside_a_block_is_undone_as_a_registration_is(name):
    own, by_registration = CHANGES[name]

    def run(change):
        torch.manual_seed(0)
        m = Net()
        lay = new()
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            with ts.freeze_except(m, m.head[-1]):
                m(X)
                gone = change(m, lay) or []
                m(X)
                inside = trainable(m)
        after = trainable(m)
        return m, inside, after, [p.requires_grad for g in gone for p in g.parameters()], \
            [str(w.message) for w in said if issubclass(w.category, ts.RestoredFlagsWarning)]

    m, inside, after, gone, said = run(own)
    ref = run(by_registration)
    assert (inside, after, gone) == ref[1:4]
    if gone:  # only taken out: nothing was added (assigning a new container adds one)
        assert not any("were added" in text for text in said), said
    else:
        assert len(said) == len(ref[4])
    assert consistent(m) and all(p.requires_grad for p in m.parameters())


def test_a_change_found_by_a_read_before_any_forward():
    m = Net()
    ts.freeze_except(m, m.head[-1])
    m(X)
    lay = new()
    m.layers.insert(0, lay)
    # structural_grad applies what the next forward would before its own call
    g = ts.structural_grad(m, lambda mm: mm(X))
    assert not lay.weight.requires_grad and consistent(m)
    assert sorted(ts.tree.paths(g)) == ["head.1.bias", "head.1.weight"]


def test_a_container_change_on_a_gpt2_model():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 64, (2, 8))
    ts.freeze_except(model, "transformer.h.2")
    model(ids, use_cache=False)
    blocks = model.transformer.h
    trained = blocks[2]
    grown = copy.deepcopy(trained)  # a copy of the trained block, put first: frozen (the
    blocks.insert(0, grown)         # selector named the objects it matched at the call)
    model.config.n_layer = len(blocks)  # older transformers size per-layer lists by it
    model(ids, use_cache=False)
    assert consistent(model)
    assert trainable(model) == sorted(f"transformer.h.3.{n}" for n, _ in
                                      trained.named_parameters())
    assert not any(p.requires_grad for p in grown.parameters())
    dropped = blocks.pop(3)  # the trained block leaves: its starting flags come back
    model.config.n_layer = len(blocks)
    model(ids, use_cache=False)
    assert dropped is trained and consistent(model) and trainable(model) == []
    assert all(p.requires_grad for p in dropped.parameters())
    del blocks[0]  # and the copy: its flags back too
    model.config.n_layer = len(blocks)
    model(ids, use_cache=False)
    assert all(p.requires_grad for p in grown.parameters()) and consistent(model)


def test_a_compiled_wrapper_sees_a_container_change():
    m = Net()
    ts.freeze_except(m, m.head[-1])
    cm = torch.compile(m, backend="eager")
    cm(X)
    lay = new()
    m.layers.insert(2, lay)
    cm(X)
    assert not lay.weight.requires_grad and consistent(m)
    gone = m.layers.pop(2)
    cm(X)
    assert gone.weight.requires_grad and consistent(m)


@pytest.mark.parametrize("forward_between", [True, False])
def test_a_layer_added_where_a_renumbered_one_stood_keeps_its_own_flag(forward_between):
    """``del m[1]`` moves the old ``m[2]`` to ``"1"``; a frozen layer appended at ``"2"``
    afterwards is new (it started frozen and stays so), not a copy of the one that moved,
    whether or not a forward ran between the two edits."""
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    with ts.freeze(m):
        del m[1]
        if forward_between:
            m(torch.randn(1, 2))
        new = nn.Linear(2, 2).requires_grad_(False)
        m.append(new)
        m(torch.randn(1, 2))
    assert [p.requires_grad for p in m.parameters()] == [True] * 4 + [False] * 2
