"""Outside audit of three areas of torchstruct, checked against brute force and plain PyTorch.

1. ``ts.summary`` and the ``ts.tree`` utilities: every count, mark, tie and path a summary
   reports is recomputed from ``named_parameters()`` (tied weights once, frozen vs trainable,
   parametrizations, PEFT LoRA adapters, lazy modules, meta-device models, repeated blocks).
2. The convention that a flat path-keyed dict (``{"0.weight": t}``, as ``state_dict`` and
   ``torch.func.functional_call`` use) is accepted wherever a tree is: every public function
   taking a tree is driven with the nested, the flat and a mixed form, and with trees that do
   not match the model (extra key, missing key, wrong shape), which must raise naming the path
   and leave every parameter and flag as it was.
3. Flag contexts (``freeze``, ``freeze_except``, ``unfreeze``) and ``structural_grad`` used on
   different models from different threads at once: flags restored exactly, gradients equal to
   a single-threaded ``torch.autograd.grad`` reference, no deadlock (every join has a timeout),
   and generators / iterators passed where lists are.

Convention: a case found to misbehave is kept, reduced to its smallest form, as a test marked
``@pytest.mark.xfail(strict=True, reason="BUG: what happens; what is expected")``. Such a test
asserts the documented behaviour, so it fails today and turns into an unexpected pass (an error
under ``strict=True``) once the library is fixed, at which point the mark should be removed.
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import copy
import random
import re
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

import torchstruct as ts

T = ts.tree
JOIN = 60.0  # seconds: a thread still alive after this is a deadlock


# ---------------------------------------------------------------------------
# brute-force helpers
# ---------------------------------------------------------------------------

def _flags(model):
    return [p.requires_grad for p in model.parameters()]


def _values(model):
    return [p.detach().clone() for p in model.parameters()]


def _same_values(model, before):
    return all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))


def _under(path: str, prefix: str) -> bool:
    return prefix == "" or path == prefix or path.startswith(prefix + ".")


def _brute(model, prefixes):
    """(trainable, total, mark) of the parameters under any of ``prefixes``: counts over the
    first path of each parameter object, marks over every path (ties included)."""
    on = {id(p) for _, p in ts.trainable_parameters(model)}
    tr = tot = 0
    for path, p in model.named_parameters():
        if any(_under(path, pre) for pre in prefixes):
            tot += p.numel()
            tr += p.numel() if id(p) in on else 0
    has_on = has_off = False
    for path, p in model.named_parameters(remove_duplicate=False):
        if p.numel() and any(_under(path, pre) for pre in prefixes):
            has_on |= id(p) in on
            has_off |= id(p) not in on
    mark = ("partial" if has_on and has_off else "trainable" if has_on
            else "frozen" if has_off else "-")
    return tr, tot, mark


def _expanded_prefixes(model, rows):
    """For each summary row, the real module/parameter paths it stands for (a collapsed
    ``a–b`` row stands for the children of its parent from ``a`` to ``b``)."""
    mods = dict(model.named_modules(remove_duplicate=False))
    out, stack = [], []  # stack: (depth, prefixes, row path)
    for r in rows:
        while stack and stack[-1][0] >= r.depth:
            stack.pop()
        if not stack:
            prefixes = [r.path]
        else:
            parent_prefixes, parent_path = stack[-1][1], stack[-1][2]
            if r.repeat > 1:
                first, last = r.name.split("–")
                names = list(mods[parent_path]._modules)
                rels = names[names.index(first): names.index(last) + 1]
                assert len(rels) == r.repeat
            else:
                rels = [r.path[len(parent_path) + 1:] if parent_path else r.path]
            prefixes = [f"{pp}.{x}" if pp else x for pp in parent_prefixes for x in rels]
        stack.append((r.depth, prefixes, r.path))
        out.append(prefixes)
    return out


def _check_summary(model, max_depth=None):
    """Every row of ``ts.summary(model)`` against brute force; returns the summary."""
    s = ts.summary(model, max_depth=max_depth)
    first = {id(p): path for path, p in model.named_parameters()}
    all_paths = dict(model.named_parameters(remove_duplicate=False))
    mods = dict(model.named_modules(remove_duplicate=False))
    first_mod = {id(m): path for path, m in model.named_modules()}
    for r, prefixes in zip(s.rows, _expanded_prefixes(model, s.rows)):
        if max_depth is not None:
            assert r.depth <= max_depth
        if r.tied_to is not None:
            if r.is_param:
                p = all_paths[r.path]
                assert first[id(p)] == r.tied_to != r.path, r
            else:
                assert first_mod[id(mods[r.path])] == r.tied_to != r.path, r
            continue
        if r.is_param:
            assert first[id(all_paths[r.path])] == r.path, r
        assert (r.trainable, r.total, r.mark) == _brute(model, prefixes), (r, prefixes)
    tr, tot, _ = _brute(model, [""])
    assert s.counts == (tr, tot)
    assert s.total == sum(p.numel() for p in model.parameters())
    assert s.totals().startswith("trainable ")
    assert str(s).splitlines()[-1] == s.totals()
    return s


# ---------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.n = nn.LayerNorm(3)


class Net(nn.Module):
    """Tied embedding/head, a block reused under a second name, a ModuleList of identical
    blocks and a Sequential with named children."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.blocks = nn.ModuleList([Block() for _ in range(4)])
        self.seq = nn.Sequential(OrderedDict(x=nn.Linear(3, 3), y=nn.Linear(3, 3),
                                             z=nn.Linear(3, 2)))
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight
        self.again = self.blocks[1]
        self.empty = nn.Parameter(torch.zeros(0))


class SharedBlock(nn.Module):
    def __init__(self, shared):
        super().__init__()
        self.w = shared
        self.b = nn.Parameter(torch.zeros(2))


def _shared_blocks():
    shared = nn.Parameter(torch.ones(2, 2))
    return nn.ModuleList([SharedBlock(shared) for _ in range(3)])


def _parametrized():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2), nn.Linear(2, 2))
    parametrizations.weight_norm(m[0])
    parametrizations.orthogonal(m[1])
    m[2].bias.requires_grad_(False)  # frozen by hand: its starting flag
    return m


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, i):
        return self.head(torch.tanh(self.body(self.embed(i))))


def _gpt2(**kw):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=8,
                     bos_token_id=0, eos_token_id=0, **kw)
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg)


# ---------------------------------------------------------------------------
# (a) summary
# ---------------------------------------------------------------------------

SUMMARY_CASES = [
    ("net", Net, []),
    ("net-frozen-parts", Net, [("freeze", ("blocks.2.a", "seq.y.bias", "head"))]),
    ("net-freeze-except", Net, [("freeze_except", ("blocks.0", "seq.z"))]),
    ("net-tied-second-path", Net, [("freeze_except", ("head",))]),
    ("shared-blocks", _shared_blocks, []),
    ("shared-blocks-frozen", _shared_blocks, [("freeze", ("0.w",))]),
    ("shared-blocks-by-later-path", _shared_blocks, [("freeze", ("2.w",))]),
    ("parametrized", _parametrized, []),
    ("parametrized-frozen", _parametrized, [("freeze", ("0",)), ("unfreeze", ("2.bias",))]),
    ("parametrized-original", _parametrized,
     [("freeze", ("1.parametrizations.weight.original",))]),
]


@pytest.mark.parametrize("name,factory,contexts", SUMMARY_CASES, ids=[c[0] for c in SUMMARY_CASES])
def test_summary_rows_agree_with_brute_force(name, factory, contexts):
    torch.manual_seed(0)
    model = factory()
    start = _flags(model)
    ctxs = [getattr(ts, kind)(model, *sels) for kind, sels in contexts]
    try:
        for c in ctxs:
            c.__enter__()
        s = _check_summary(model)
        # the summary agrees with the flags the contexts wrote
        on = {id(p) for p in model.parameters() if p.requires_grad}
        assert s.trainable == sum(p.numel() for p in model.parameters() if id(p) in on)
        for depth in (0, 1, 2):
            assert ts.summary(model, max_depth=depth).counts == s.counts
            _check_summary(model, max_depth=depth)
    finally:
        for c in reversed(ctxs):
            c.__exit__(None, None, None)
    assert _flags(model) == start


def test_summary_collapses_only_identical_blocks():
    model = Net()
    rows = {r.path: r for r in ts.summary(model).rows}
    # blocks.1 is also reached as `again`: shown on its own rows, so the tie names a row shown
    assert [(rows[f"blocks.{i}"].name, rows[f"blocks.{i}"].repeat) for i in (0, 1, 2)] == [
        ("0", 1), ("1", 1), ("2–3", 2)]
    assert rows["seq.x"].repeat == 2 and rows["seq.x"].name == "x–y"
    with ts.freeze(model, "blocks.2.a"):
        rows = {r.path: r for r in ts.summary(model).rows}
        assert all(rows[f"blocks.{i}"].repeat == 1 for i in range(4))
    rows = {r.path: r for r in ts.summary(model).rows}
    assert rows["head.weight"].tied_to == "emb.weight"
    assert rows["again"].tied_to == "blocks.1"
    assert rows["empty"].mark == "-" and rows["empty"].total == 0


def test_summary_is_read_only():
    model = Net()
    model.blocks[0].a.bias.requires_grad_(False)
    start = _flags(model)
    hooks = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]
    s = ts.summary(model)
    assert _flags(model) == start
    assert [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()] == hooks
    assert s.trainable == s.total - 3
    copy.deepcopy(model)  # still plain PyTorch


def test_summary_of_gpt2_with_tied_head():
    model = _gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    s = _check_summary(model)
    assert s.counts == (model.num_parameters(), model.num_parameters())
    rows = {r.path: r for r in s.rows}
    assert rows["lm_head.weight"].tied_to == "transformer.wte.weight"
    with ts.freeze_except(model, "transformer.h.1", "lm_head"):
        s = _check_summary(model)
        assert s.trainable == model.num_parameters(only_trainable=True)
        # lm_head's weight is the embedding: freeze_except keeps it (selected by any path)
        assert model.transformer.wte.weight.requires_grad
    assert all(_flags(model))


def test_summary_of_peft_lora_model():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_gpt2(), LoraConfig(r=2, target_modules=["c_attn"],
                                               fan_in_fan_out=True))
    s = _check_summary(model)
    trainable, total = model.get_nb_trainable_parameters()
    assert s.counts == (trainable, total)
    lora_rows = [r for r in s.rows if "lora_A" in r.path and r.is_param]
    assert lora_rows and all(r.mark == "trainable" for r in lora_rows)
    with ts.freeze(model, "*lora_B*"):
        s = _check_summary(model)
        assert s.trainable == sum(p.numel() for n, p in model.named_parameters()
                                  if "lora_A" in n)
    assert s.totals() != ts.summary(model).totals()
    assert ts.summary(model).counts == (trainable, total)


def test_summary_of_meta_device_model():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(512, 512), nn.LayerNorm(512), nn.Linear(512, 8))
    with ts.freeze(model, "1"):
        s = _check_summary(model)
    assert s.total == 512 * 512 + 512 + 1024 + 512 * 8 + 8
    assert s.trainable == s.total - 1024
    assert "%" in s.totals()


def test_summary_of_lazy_model_names_the_path_then_counts():
    model = nn.Sequential(nn.Linear(3, 3), nn.LazyLinear(2))
    with pytest.raises(ValueError, match=re.escape("'1.weight'")):
        ts.summary(model)
    model(torch.ones(1, 3))
    s = _check_summary(model)
    assert s.counts == (20, 20)


def test_summary_totals_line_uses_brute_force_share():
    model = nn.Sequential(nn.Linear(1000, 1000), nn.Linear(1000, 1))
    with ts.freeze(model, "0"):
        s = ts.summary(model)
        assert s.counts == (1001, 1002001)
        assert s.totals() == "trainable 1K of 1M, 0.10%"
    model2 = nn.Sequential(nn.Linear(1000, 1000), nn.Linear(1, 1, bias=False))
    with ts.freeze(model2, "1"):
        assert ts.summary(model2).totals().endswith(">99.99%")


# ---------------------------------------------------------------------------
# (a) ts.tree utilities
# ---------------------------------------------------------------------------

def test_tree_flat_nested_and_mixed_forms_agree():
    a, b, c = torch.randn(2, 3), torch.randn(3), torch.tensor(5, dtype=torch.int64)
    nested = {"enc": {"0": {"weight": a, "bias": b}}, "head": c}
    flat = {"enc.0.weight": a, "enc.0.bias": b, "head": c}
    mixed = {"enc.0": {"weight": a}, "enc": {"0": {"bias": b}}, "head": c}
    for t in (nested, flat, mixed):
        assert T.paths(t) == ["enc.0.weight", "enc.0.bias", "head"]
        assert all(x is y for x, y in zip(T.leaves(t), [a, b, c]))
        assert T.to_flat_dict(t) == flat
        vec, spec = T.flatten(t)
        assert vec.dtype == torch.float32 and spec.numel == 10
        back = T.unflatten(vec, spec)
        assert list(back) == list(t)  # the keys as they were
        assert T.paths(back) == T.paths(t)
        assert all(torch.equal(x, y) for x, y in zip(T.leaves(back), [a, b, c]))
        doubled = T.map(lambda u, v, w: u + v + w, t, flat, nested)
        assert list(doubled) == list(t)
        assert torch.equal(T.to_flat_dict(doubled)["enc.0.bias"], 3 * b)
    assert T.from_flat_dict(flat) == {"enc": {"0": {"weight": a, "bias": b}}, "head": c}
    pairs = ((k, v) for k, v in flat.items())  # a generator of pairs
    assert T.paths(T.from_flat_dict(pairs)) == T.paths(nested)


@pytest.mark.parametrize("other,path,kind", [
    ({"x.y": torch.ones(2), "x.z": torch.ones(3), "extra": torch.ones(1)}, "extra", "extra"),
    ({"x.y": torch.ones(2)}, "x.z", "no leaf"),
    ({"x": {"y": torch.ones(2)}, "x.z": None}, "x.z", "no leaf"),
])
def test_tree_map_mismatch_names_the_path(other, path, kind):
    t = {"x": {"y": torch.ones(2), "z": torch.ones(3)}}
    with pytest.raises(ValueError, match=re.escape(repr(path))) as e:
        T.map(torch.add, t, other)
    assert kind in str(e.value)


@pytest.mark.parametrize("bad,names", [
    ({"x": {"y": torch.ones(1)}, "x.y": torch.ones(1)}, ["'x.y'"]),
    ({"x.y": torch.ones(1), "x.y.z": torch.ones(1)}, ["'x.y'", "'x.y.z'"]),
    ({"x..y": torch.ones(1)}, ["'x..y'"]),
])
def test_tree_conflicting_flat_keys_raise_everywhere(bad, names):
    for fn in (T.paths, T.flatten, T.to_flat_dict, ts.global_norm,
               lambda t: ts.clip_by_global_norm(t, 1.0), lambda t: T.map(lambda u: u, t)):
        with pytest.raises(ValueError) as e:
            fn(bad)
        assert all(n in str(e.value) for n in names), (fn, str(e.value))


def test_from_module_and_flatten_store_a_tied_weight_once():
    model = TiedLM()
    params = T.from_module(model)
    assert T.paths(params) == [n for n, _ in model.named_parameters()]
    assert all(x is p for x, p in zip(T.leaves(params), model.parameters()))
    sd = model.state_dict()  # two detached views of the tied weight
    vec, spec = T.flatten(sd)
    assert spec.numel == sum(p.numel() for p in model.parameters())
    alias = {e.path: e.alias_of for e in spec.entries}
    assert alias["head.weight"] == "embed.weight"
    back = T.unflatten(vec, spec)
    assert list(back) == list(sd) and back["head.weight"] is back["embed.weight"]


# ---------------------------------------------------------------------------
# (b) flat path-keyed dicts wherever a tree is
# ---------------------------------------------------------------------------

def _bn_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def _grads_ref(model, x):
    ps = [p for p in model.parameters() if p.requires_grad]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return dict(zip(names, torch.autograd.grad(model(x).pow(2).sum(), ps)))


def test_structural_grad_tree_in_every_form_through_norm_and_clip():
    model = _bn_net()
    x = torch.randn(5, 3)
    ref = _grads_ref(model, x)
    g = ts.structural_grad(model, lambda m: m(x).pow(2).sum())
    flat = T.to_flat_dict(g)
    assert list(flat) == list(ref)
    assert all(torch.allclose(flat[k], ref[k]) for k in ref)
    mixed = {"0": g["0"], "1.weight": g["1"]["weight"], "1.bias": g["1"]["bias"], "2": g["2"]}
    want = torch.linalg.vector_norm(torch.cat([v.flatten() for v in ref.values()]))
    for form in (g, flat, mixed):
        assert torch.allclose(ts.global_norm(form), want)
        assert torch.allclose(ts.global_norm(form, 1.0),
                              sum(v.abs().sum() for v in ref.values()))
    # clip each form in place; compare with torch's clip_grad_norm_ on parameters
    ps = [nn.Parameter(torch.zeros_like(v)) for v in ref.values()]
    for p, v in zip(ps, ref.values()):
        p.grad = v.clone()
    want_norm = torch.nn.utils.clip_grad_norm_(ps, 0.5)
    for make in (lambda: {k: v.clone() for k, v in ref.items()},
                 lambda: T.from_flat_dict({k: v.clone() for k, v in ref.items()})):
        tree = make()
        norm = ts.clip_by_global_norm(tree, 0.5)
        assert torch.allclose(norm, want_norm)
        for leaf, p in zip(T.leaves(tree), ps):
            assert torch.allclose(leaf, p.grad)


def test_flat_and_nested_trees_drive_map_trainable_polyak_and_swap():
    model = _bn_net()
    x = torch.randn(5, 3)
    with ts.freeze(model, "1"):
        g = ts.structural_grad(model, lambda m: m(x).pow(2).sum())
        flat = T.to_flat_dict(g)
        assert "1.weight" not in flat
        a = ts.map_trainable(lambda p, gg: p - 0.1 * gg, model, g)
        b = ts.map_trainable(lambda p, gg: p - 0.1 * gg, model, flat)
        assert T.paths(a) == T.paths(b) == list(flat)
        assert all(torch.equal(u, v) for u, v in zip(T.leaves(a), T.leaves(b)))
        # a full parameter tree (frozen paths included) is fine, flat or nested
        full = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        assert T.paths(ts.map_trainable(lambda p, z: z, model, full)) == list(flat)
        assert T.paths(ts.map_trainable(lambda p, z: z, model, T.from_flat_dict(full))) \
            == list(flat)
        target = copy.deepcopy(model)
        src = {k: torch.full_like(v, 2.0) for k, v in full.items()}
        ts.polyak_update(model, src, 0.5)
        ts.polyak_update(target, T.from_flat_dict(src), 0.5)
        for (n, p), q in zip(model.named_parameters(), target.parameters()):
            assert torch.equal(p, q), n
        assert torch.equal(model[1].weight, torch.ones(4))  # frozen: untouched
    y_swapped = None
    with torch.no_grad(), ts.swap(model, {"0.weight": torch.zeros(4, 3), "2": {"bias": torch.ones(2)}}):
        y_swapped = model.eval()(x)
    model.train()
    with torch.no_grad():
        h = model[1].eval()(torch.zeros(5, 4) + model[0].bias)
        model[1].train()
        torch.testing.assert_close(y_swapped, h @ model[2].weight.T + 1.0)


def _mismatching(model):
    flat = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    extra = dict(flat, **{"3.weight": torch.zeros(2, 2)})
    missing = {k: v for k, v in flat.items() if k != "2.bias"}
    shape = dict(flat, **{"2.bias": torch.zeros(3)})
    return [("extra", extra, "'3.weight'"), ("missing", missing, "'2.bias'"),
            ("shape", shape, "'2.bias'")]


TREE_TAKERS = {
    "map_trainable": lambda m, t: ts.map_trainable(lambda p, x: x, m, t),
    "polyak_update": lambda m, t: ts.polyak_update(m, t, 0.5),
    "load_state_dict": lambda m, t: ts.load_state_dict(m, t, buffers=False),
}


@pytest.mark.parametrize("fn", sorted(TREE_TAKERS))
@pytest.mark.parametrize("form", ["flat", "nested"])
def test_mismatching_tree_raises_naming_path_and_changes_nothing(fn, form):
    model = _bn_net()
    for kind, tree, path in _mismatching(model):
        if form == "nested":
            if fn == "load_state_dict":
                continue  # a state is a flat mapping: checked in its own test
            tree = T.from_flat_dict(tree)
        flags, values = _flags(model), _values(model)
        with pytest.raises(ValueError) as e:
            TREE_TAKERS[fn](model, tree)
        assert path in str(e.value), (kind, str(e.value))
        assert _flags(model) == flags and _same_values(model, values)


@pytest.mark.parametrize("form", ["flat", "nested"])
def test_swap_with_mismatching_tree(form):
    model = _bn_net()
    for kind, tree, path in _mismatching(model):
        if kind == "missing":
            continue  # swap takes partial trees
        tree = tree if form == "flat" else T.from_flat_dict(tree)
        values = _values(model)
        with pytest.raises(ValueError, match=re.escape(path)):
            with ts.swap(model, tree):
                raise AssertionError("entered")
        assert _same_values(model, values)
        assert model[0].weight is model._modules["0"]._parameters["weight"]


def test_load_state_dict_refuses_a_nested_tree_and_writes_nothing():
    model = _bn_net()
    nested = T.from_flat_dict({n: torch.zeros_like(p) for n, p in model.named_parameters()})
    values = _values(model)
    with pytest.raises(ValueError, match="Nothing was written"):
        ts.load_state_dict(model, nested)
    assert _same_values(model, values)
    # its flat form loads
    ts.load_state_dict(model, T.to_flat_dict(nested), buffers=False)
    assert all(torch.equal(p, torch.zeros_like(p)) for p in model.parameters())


def test_tied_model_state_dict_is_a_tree_for_norm_map_and_polyak():
    torch.manual_seed(0)
    model, source = TiedLM(), TiedLM()
    sd = source.state_dict()
    assert list(sd) == ["embed.weight", "body.weight", "body.bias", "head.weight"]
    want = torch.linalg.vector_norm(torch.cat([p.detach().flatten() for p in source.parameters()]))
    assert torch.allclose(ts.global_norm(sd), want)  # the tied weight once
    assert T.paths(ts.map_trainable(lambda p, s: s + 0, model, sd)) == \
        ["embed.weight", "body.weight", "body.bias"]
    ts.polyak_update(model, sd, 1.0)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), source.parameters()))
    # two different tensors at the two paths of the tied weight: refused, nothing written
    bad = dict(sd, **{"head.weight": sd["embed.weight"] + 1})
    values = _values(model)
    for call in (lambda: ts.polyak_update(model, bad, 0.5),
                 lambda: ts.map_trainable(lambda p, s: s, model, bad),
                 lambda: ts.load_state_dict(model, bad)):
        with pytest.raises(ValueError, match="head.weight"):
            call()
        assert _same_values(model, values)
    # swap names a tied weight by its first path only (documented): the error names the path
    with pytest.raises(ValueError, match=re.escape("'head.weight'")):
        ts.swap(model, sd)
    assert _same_values(model, values)


def test_clip_of_a_flat_tree_holding_a_tied_gradient_twice_scales_it_once():
    model = TiedLM()
    i = torch.tensor([1, 2, 3])
    g = T.to_flat_dict(ts.structural_grad(model, lambda m: m(i).sum()))
    assert list(g) == ["embed.weight", "body.weight", "body.bias"]
    twice = dict(g, **{"head.weight": g["embed.weight"]})
    want = ts.global_norm(g)
    before = {k: v.clone() for k, v in g.items()}
    norm = ts.clip_by_global_norm(twice, 1.0)
    assert torch.allclose(norm, want)
    coef = 1.0 / (float(want) + 1e-6)
    for k in g:
        torch.testing.assert_close(g[k], before[k] * coef)


def test_clip_and_norm_errors_in_a_tree_change_nothing():
    a = torch.full((2,), 3.0)
    for bad in ({"a": a, "b": [1.0]}, {"a": a, "b": torch.ones(2, dtype=torch.int64)},
                {"a": a, "b": torch.ones(2).to_sparse()}):
        with pytest.raises(TypeError):
            ts.clip_by_global_norm(bad, 0.1)
        assert torch.equal(a, torch.full((2,), 3.0))


def test_clip_of_a_tree_or_model_with_a_bad_leaf_names_its_path():
    """A sparse, integer or expanded leaf of a tree (or gradient of a model) is named by its
    path, not by its index among the distinct leaves; nothing is written."""
    tied = torch.ones(2)
    bad = {"sparse": torch.ones(2).to_sparse(), "integer": torch.ones(2, dtype=torch.int64),
           "expanded": torch.ones(1).expand(3)}
    for kind, leaf in bad.items():
        tree = {"enc": {"weight": tied, "again": tied}, "dec.bias": leaf}
        fns = [lambda t: ts.clip_by_global_norm(t, 1.0)]
        if kind != "expanded":  # (only a write refuses it)
            fns.append(ts.global_norm)
        for fn in fns:
            with pytest.raises((TypeError, RuntimeError), match=r"the leaf at 'dec\.bias'"):
                fn(tree)
            assert torch.equal(tied, torch.ones(2))
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    m[0].requires_grad_(False)
    m[1].weight.grad = torch.ones(2, 2)
    m[1].bias.grad = torch.ones(2).to_sparse()
    for fn in (ts.global_norm, lambda t: ts.clip_by_global_norm(t, 1.0)):
        with pytest.raises(TypeError, match=r"the gradient of '1\.bias' has layout"):
            fn(m)
        assert torch.equal(m[1].weight.grad, torch.ones(2, 2))


# ---------------------------------------------------------------------------
# (c) threads, generators
# ---------------------------------------------------------------------------

def _thread_model(i):
    torch.manual_seed(i)
    m = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                      nn.Linear(8, 1))
    m[3].bias.requires_grad_(False)  # frozen by hand
    return m


def _run_threads(target, n):
    errors = []

    def wrapped(i):
        try:
            target(i)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append((i, repr(e)))

    threads = [threading.Thread(target=wrapped, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN)
    assert not any(t.is_alive() for t in threads), "deadlock: a thread did not finish"
    assert not errors, errors


KINDS = ("freeze", "freeze_except", "unfreeze")
SELS = ("0", "3.*", ["5.weight", "0.bias"], re.compile(r"[35]\.bias"), "1")


def test_contexts_and_structural_grad_on_different_models_from_threads():
    n, iters = 4, 25
    models = [_thread_model(i) for i in range(n)]
    xs = [torch.randn(6, 4, generator=torch.Generator().manual_seed(100 + i)) for i in range(n)]
    start = [_flags(m) for m in models]
    # single-threaded references: flags inside each context and autograd.grad of the loss
    refs = {}
    for i, (m, x) in enumerate(zip(models, xs)):
        m.eval()  # running statistics stay fixed: every reference and call agree
        for kind in KINDS:
            for j, sel in enumerate(SELS):
                with getattr(ts, kind)(m, sel):
                    refs[i, kind, j] = (_flags(m), _grads_ref(m, x))
                    wrt = dict(ts.structural_grad(m, lambda mm: mm(x).pow(2).sum(), wrt="0")
                               .items())
                    refs[i, kind, j, "wrt"] = T.to_flat_dict(wrt)
        assert _flags(m) == start[i]

    def work(i):
        rnd = random.Random(i)
        m, x = models[i], xs[i]
        for _ in range(iters):
            kind, j = rnd.choice(KINDS), rnd.randrange(len(SELS))
            flags, ref = refs[i, kind, j]
            with getattr(ts, kind)(m, SELS[j]):
                assert _flags(m) == flags
                g = T.to_flat_dict(ts.structural_grad(m, lambda mm: mm(x).pow(2).sum()))
                assert list(g) == list(ref)
                for k in ref:
                    torch.testing.assert_close(g[k], ref[k])
                with ts.freeze(m, "5"):
                    assert not any(p.requires_grad for p in m[5].parameters())
                assert _flags(m) == flags
                gw = T.to_flat_dict(ts.structural_grad(m, lambda mm: mm(x).pow(2).sum(),
                                                       wrt="0"))
                want = refs[i, kind, j, "wrt"]
                assert list(gw) == list(want)
                for k in want:
                    torch.testing.assert_close(gw[k], want[k])
                assert _flags(m) == flags
                # a tensor loss too
                loss = m(x).pow(2).sum()
                gt = T.to_flat_dict(ts.structural_grad(m, loss))
                for k in ref:
                    torch.testing.assert_close(gt[k], ref[k])
            assert _flags(m) == start[i]

    _run_threads(work, n)
    for m, s in zip(models, start):
        assert _flags(m) == s


def test_interleaved_non_nested_exits_across_threads():
    """Thread 1 and thread 2 enter and leave contexts on their own model in an order that is
    not LIFO across the process; every step is checked against the expected flags."""
    ma, mb = _thread_model(0), _thread_model(1)
    sa, sb = _flags(ma), _flags(mb)
    pa, pb = ThreadPoolExecutor(1), ThreadPoolExecutor(1)

    def on(pool, fn):
        return pool.submit(fn).result(timeout=JOIN)

    try:
        a1 = on(pa, lambda: ts.freeze(ma, "0").__enter__())
        fa1 = _flags(ma)
        assert fa1 == [False, False] + sa[2:]
        b1 = on(pb, lambda: ts.freeze_except(mb, "5").__enter__())
        fb1 = _flags(mb)
        assert fb1 == [False] * 6 + sb[6:]
        b2 = on(pb, lambda: ts.unfreeze(mb, "3").__enter__())
        assert _flags(mb) == [False] * 4 + [True, True] + sb[6:]
        on(pa, lambda: a1.__exit__(None, None, None))  # A leaves while B is two deep
        assert _flags(ma) == sa and _flags(mb) == [False] * 4 + [True, True] + sb[6:]
        a2 = on(pa, lambda: ts.unfreeze(ma).__enter__())
        assert all(_flags(ma))
        on(pb, lambda: b2.__exit__(None, None, None))
        assert _flags(mb) == fb1 and all(_flags(ma))
        on(pb, lambda: b1.__exit__(None, None, None))
        assert _flags(mb) == sb and all(_flags(ma))
        on(pa, lambda: a2.__exit__(None, None, None))
        assert _flags(ma) == sa and _flags(mb) == sb
    finally:
        pa.shutdown(wait=False)
        pb.shutdown(wait=False)


def test_bare_calls_declarations_and_forwards_on_different_models_from_threads():
    """Permanent calls, declarations and hook-driven forwards in parallel end with the flags a
    sequential run gives."""
    n = 4

    def script(m, rnd_seed):
        rnd = random.Random(rnd_seed)
        x = torch.randn(3, 4)
        for _ in range(15):
            op = rnd.randrange(4)
            if op == 0:
                ts.freeze(m, rnd.choice(["0", "5"]))
            elif op == 1:
                ts.unfreeze(m, rnd.choice(["0.weight", "3", "5.bias"]))
            elif op == 2:
                ts.mark_trainable(m[3], *rnd.choice([("weight",), ("weight", "bias"), (None,)]))
            m(x)
        return _flags(m)

    sequential = [script(_thread_model(i), i) for i in range(n)]
    models = [_thread_model(i) for i in range(n)]
    got = [None] * n

    def work(i):
        got[i] = script(models[i], i)

    _run_threads(work, n)
    assert got == sequential
    assert [_flags(m) for m in models] == sequential


def test_decorated_contexts_called_from_threads():
    n = 4
    models = [_thread_model(i) for i in range(n)]
    start = [_flags(m) for m in models]
    x = torch.randn(3, 4)
    funcs = []
    for m in models:
        @ts.freeze_except(m, "5")
        def step(mm=m):
            assert _flags(mm) == [False] * 6 + [True, True]
            return ts.tree.paths(ts.structural_grad(mm, lambda q: q(x).sum()))
        funcs.append(step)
    out = [None] * n

    def work(i):
        for _ in range(20):
            out[i] = funcs[i]()
            assert _flags(models[i]) == start[i]

    _run_threads(work, n)
    assert out == [["5.weight", "5.bias"]] * n
    assert [_flags(m) for m in models] == start


def test_no_deadlock_when_a_loss_or_selector_waits_on_another_thread():
    ma, mb = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)), nn.Sequential(nn.Linear(3, 3),
                                                                          nn.Linear(3, 1))
    x = torch.randn(2, 3)
    seen = []

    def other():
        with ts.freeze(mb, "0"):
            seen.append(_flags(mb))
            seen.append(T.paths(ts.structural_grad(mb, lambda m: m(x).sum())))
        seen.append(_flags(mb))

    def in_thread():
        t = threading.Thread(target=other, daemon=True)
        t.start()
        t.join(JOIN)
        assert not t.is_alive(), "deadlock"

    def loss(m):
        in_thread()
        return m(x).pow(2).sum()

    for wrt in (None, "1"):
        seen.clear()
        g = T.to_flat_dict(ts.structural_grad(ma, loss, wrt=wrt))
        ref = dict(zip([n for n, _ in ma.named_parameters()],
                       torch.autograd.grad(ma(x).pow(2).sum(), list(ma.parameters()))))
        for k in g:
            torch.testing.assert_close(g[k], ref[k])
        assert seen == [[False, False, True, True], ["1.weight", "1.bias"], [True] * 4]

    def selector(path, p):
        in_thread()
        return path.startswith("0")

    with ts.freeze(ma, selector):
        assert _flags(ma) == [False, False, True, True]
    assert all(_flags(ma))

    # a forward run by a worker thread inside the loss (DataParallel-like)
    def worker_loss(m):
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("y", m(x).sum()), daemon=True)
        t.start()
        t.join(JOIN)
        assert not t.is_alive()
        return out["y"]

    g = T.to_flat_dict(ts.structural_grad(ma, worker_loss, wrt="1"))
    ref = torch.autograd.grad(ma(x).sum(), [ma[1].weight, ma[1].bias])
    torch.testing.assert_close(g["1.weight"], ref[0])
    torch.testing.assert_close(g["1.bias"], ref[1])
    assert all(_flags(ma))


def test_frozen_batchnorm_statistics_per_thread():
    n = 4
    models = [_thread_model(i) for i in range(n)]
    x = torch.randn(6, 4)
    expected = []
    for i in range(n):
        m = copy.deepcopy(models[i])
        if i % 2 == 0:
            expected.append(m[1].running_mean.clone())
        else:
            for _ in range(10):
                m(x)
            expected.append(m[1].running_mean.clone())

    def work(i):
        m = models[i]
        if i % 2 == 0:
            with ts.freeze(m, "1"):
                for _ in range(10):
                    m(x)
        else:
            with ts.freeze(m, "0"):
                for _ in range(10):
                    m(x)

    _run_threads(work, n)
    for m, want in zip(models, expected):
        torch.testing.assert_close(m[1].running_mean, want)
        assert m[1].training is True


def test_generators_where_lists_are():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    start = _flags(model)
    x = torch.randn(2, 3)
    # selectors are str / pattern / callable / module / parameter or a list/tuple of them:
    # an iterator is refused with a clear TypeError, and nothing changes
    for make in (lambda: (p for p in model[0].parameters()), lambda: model[2].parameters(),
                 lambda: iter(["0", "2.bias"]), lambda: {"0"}):
        for call in (lambda s: ts.freeze(model, s), lambda s: ts.freeze_except(model, s),
                     lambda s: ts.unfreeze(model, s), lambda s: ts.select(model, s),
                     lambda s: ts.structural_grad(model, lambda m: m(x).sum(), wrt=s)):
            with pytest.raises(TypeError, match="list/tuple"):
                call(make())
            assert _flags(model) == start
    # the same parameters as a tuple work
    with ts.freeze(model, tuple(model[0].parameters())):
        assert _flags(model) == [False, False, True, True]
    assert _flags(model) == start
    g = ts.structural_grad(model, lambda m: m(x).sum(), wrt=tuple(model[2].parameters()))
    assert T.paths(g) == ["2.weight", "2.bias"]
    # clip / global_norm take generators as torch does
    for p in model.parameters():
        p.grad = torch.full_like(p, 2.0)
    want = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.allclose(ts.global_norm(p.grad for p in model.parameters()), want)
    norm = ts.clip_by_global_norm((p for p in model.parameters()), 1.0)
    assert torch.allclose(norm, want)
    assert torch.allclose(ts.global_norm([p.grad for p in model.parameters()]),
                          torch.tensor(1.0), atol=1e-5)
    with pytest.warns(UserWarning, match="empty generator"):
        assert float(ts.clip_by_global_norm((p for p in []), 1.0)) == 0.0


def test_context_entered_in_one_thread_and_left_in_another():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    pa, pb = ThreadPoolExecutor(1), ThreadPoolExecutor(1)
    try:
        ctx = pa.submit(lambda: ts.freeze(model, "0").__enter__()).result(JOIN)
        assert _flags(model) == [False, False, True, True]
        pb.submit(lambda: ctx.__exit__(None, None, None)).result(JOIN)
        assert all(_flags(model))
    finally:
        pa.shutdown(wait=False)
        pb.shutdown(wait=False)


def test_models_created_and_dropped_in_threads_while_others_hold_contexts():
    import gc

    keep = [nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)) for _ in range(2)]
    x = torch.ones(1, 3)

    def work(i):
        rnd = random.Random(i)
        for it in range(25):
            if i < 2:
                m = keep[i]
                with ts.freeze_except(m, "1"):
                    assert _flags(m) == [False, False, True, True]
                    assert ts.summary(m).counts == (4, 16)
                    assert T.paths(ts.structural_grad(m, lambda q: q(x).sum())) == \
                        ["1.weight", "1.bias"]
                    if it % 8 == 0:
                        gc.collect()
                assert all(_flags(m))
            else:
                tmp = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
                ctx = ts.freeze(tmp, "0")
                ctx.__enter__()
                tmp(x)
                if rnd.random() < 0.5:
                    ctx.__exit__(None, None, None)
                del tmp, ctx
                if it % 8 == 0:
                    gc.collect()

    _run_threads(work, 4)
    assert all(all(_flags(m)) for m in keep)


def test_swap_with_a_flat_tree_matches_functional_call():
    model = _bn_net().eval()
    x = torch.randn(4, 3)
    flat = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    want = torch.func.functional_call(model, flat, (x,))
    for tree in (flat, T.from_flat_dict(flat),
                 {"0.weight": flat["0.weight"], "0": {"bias": flat["0.bias"]},
                  **{k: v for k, v in flat.items() if not k.startswith("0.")}}):
        with torch.no_grad(), ts.swap(model, tree):
            torch.testing.assert_close(model(x), want)
    # None leaves are absent: swapping only the head's bias
    partial = {"0.weight": None, "2": {"bias": flat["2.bias"], "weight": None}}
    with torch.no_grad():
        y0 = model(x)
        with ts.swap(model, partial):
            y1 = model(x)
    torch.testing.assert_close(y1, y0 - model[2].bias + flat["2.bias"])
