"""Trees, summaries and unfreezing schedules, tried as a suspicious user would.

- ``ts.tree``: every function compared with a brute force over random nested trees (mixed
  dtypes and shapes, 0-dim, zero-size and non-contiguous leaves, keys with digits or dots,
  ``None`` leaves, empty subtrees, tied leaves); bad input raises naming the path or argument.
- ``ts.tree.from_module``, ``ts.map_trainable``, ``ts.grad_tree``: tied parameters live once, at
  their first path in ``named_parameters()`` order.
- ``ts.summary``: counts per row against a brute force on HF models built from configs (GPT-2,
  BERT, PEFT LoRA), tied embeddings, hand-frozen vs torchstruct-frozen models, zero-element
  parameters, meta-device models and a submodule shared by two paths; it never writes a flag or
  installs a hook.
- ``ts.UnfreezeSchedule``: flags at every step against a brute-force replay of the milestones;
  a resumed schedule equals an uninterrupted one; bad milestones change nothing.

A test marked ``xfail(strict=True)`` reproduces a case that goes wrong today; its reason says
what happens, where, and what is expected.
"""
import copy
import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import torchstruct as ts
from _models import TiedLM

T = ts.tree
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROPS = settings(max_examples=40, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ============================================================================ brute-force oracles
def brute_items(tree, prefix=""):
    """(path, leaf) pairs, depth first, None skipped: the dotted key is just a longer name."""
    out = []
    for k, v in tree.items():
        path = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict):
            out += brute_items(v, path)
        elif v is not None:
            out.append((path, v))
    return out


def brute_nest(pairs):
    """A nested dict from (path, leaf) pairs, first-seen key order."""
    root = {}
    for path, leaf in pairs:
        *parents, last = path.split(".")
        node = root
        for k in parents:
            node = node.setdefault(k, {})
        node[last] = leaf
    return root


def brute_like(tree, values, prefix=""):
    """The keys of ``tree`` as they are nested (dotted keys kept), leaves from ``values``
    (path -> leaf, absent: dropped), dicts left empty dropped."""
    out = {}
    for k, v in tree.items():
        path = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict):
            sub = brute_like(v, values, path)
            if sub:
                out[k] = sub
        elif v is not None and path in values:
            out[k] = values[path]
    return out


def bits(t):
    if t.dtype.is_floating_point:
        return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def same_structure(a, b):
    """Equal nested dicts (key order included), leaves bitwise equal."""
    if isinstance(a, dict) != isinstance(b, dict):
        return False
    if not isinstance(a, dict):
        return same(a, b)
    return list(a) == list(b) and all(same_structure(a[k], b[k]) for k in a)


# ============================================================================ random trees
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16,
          torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool]
SHAPES = st.lists(st.integers(0, 3), min_size=0, max_size=3).map(tuple)
KEYS = st.text(alphabet="ab_09x", min_size=1, max_size=3)


@st.composite
def leaves_st(draw):
    """A tensor with values exact in every dtype it can be promoted with (so round trips are
    bitwise), possibly non-contiguous."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(SHAPES)
    layout = draw(st.sampled_from(["contiguous", "strided", "transposed"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    big = shape[:-1] + (2 * shape[-1],) if shape else shape
    if dtype == torch.bool:
        base = torch.randint(0, 2, big, generator=g).bool()
    elif dtype.is_floating_point:
        base = (torch.randint(-8, 9, big, generator=g).to(torch.float64) / 4).to(dtype)
    else:
        base = torch.randint(0, 9, big, generator=g).to(dtype)
    t = base[..., ::2] if shape else base
    if layout == "contiguous" or not shape:
        t = t.contiguous()
    elif layout == "transposed" and len(shape) >= 2:
        t = t.contiguous().transpose(0, 1).contiguous().transpose(0, 1)
    assert t.shape == shape
    return t


@st.composite
def trees_st(draw, depth=3):
    """A nested tree without dotted keys; None leaves, empty dicts and tied leaves included."""
    made = []

    def node(d):
        keys = draw(st.lists(KEYS, unique=True, max_size=3))
        out = {}
        for k in keys:
            kind = draw(st.sampled_from(["leaf", "leaf", "none", "dict", "tied"] if d else
                                        ["leaf", "leaf", "none", "tied"]))
            if kind == "dict":
                out[k] = node(d - 1)
            elif kind == "none":
                out[k] = None
            elif kind == "tied" and made:
                out[k] = draw(st.sampled_from(made))
            else:
                leaf = draw(leaves_st())
                made.append(leaf)
                out[k] = leaf
        return out

    return node(depth)


@st.composite
def dotted_trees_st(draw):
    """A tree where some subtrees are folded into dotted keys (``{"a": {"b": x}}`` ->
    ``{"a.b": x}``); sometimes every level is folded (a flat path-keyed dict)."""
    tree = draw(trees_st())
    if draw(st.booleans()):
        return {p: v for p, v in brute_items(tree)}  # fully flat, None leaves dropped

    def fold(t):
        out = {}
        for k, v in t.items():
            if isinstance(v, dict) and v and draw(st.booleans()):
                for k2, v2 in fold(v).items():
                    out[f"{k}.{k2}"] = v2
            elif isinstance(v, dict):
                out[k] = fold(v)
            else:
                out[k] = v
        return out

    return fold(tree)


ANY_TREE = st.one_of(trees_st(), dotted_trees_st())


# ============================================================================ 1. ts.tree properties
@PROPS
@given(ANY_TREE)
def test_paths_leaves_flat_dict_match_brute_force(tree):
    pairs = brute_items(tree)
    assert T.paths(tree) == [p for p, _ in pairs]
    got = T.leaves(tree)
    assert len(got) == len(pairs) and all(a is b for a, (_, b) in zip(got, pairs))
    flat = T.to_flat_dict(tree)
    assert list(flat) == [p for p, _ in pairs] and all(flat[p] is v for p, v in pairs)
    back = T.from_flat_dict(flat)
    assert same_structure(back, brute_nest(pairs))
    assert T.reduce(lambda n, x: n + x.numel(), tree, 0) == sum(v.numel() for _, v in pairs)


@PROPS
@given(ANY_TREE)
def test_flatten_matches_brute_force_and_round_trips_bitwise(tree):
    pairs = brute_items(tree)
    before = [(p, v.clone()) for p, v in pairs]
    vec, spec = T.flatten(tree)
    firsts, seen = [], {}
    for p, v in pairs:
        if id(v) not in seen:
            seen[id(v)] = p
            firsts.append(v)
    dtype = firsts[0].dtype if firsts else torch.float32
    for v in firsts[1:]:
        dtype = torch.promote_types(dtype, v.dtype)
    expected = torch.cat([v.reshape(-1).to(dtype) for v in firsts]) if firsts else torch.empty(0)
    assert same(vec, expected)
    assert spec.dtype == dtype and spec.paths == tuple(p for p, _ in pairs)
    assert spec.numel == sum(v.numel() for v in firsts)
    for e, (p, v) in zip(spec.entries, pairs):
        assert e.shape == v.shape and e.dtype == v.dtype
        assert e.alias_of == (None if seen[id(v)] == p else seen[id(v)])
    back = T.unflatten(vec, spec)
    # the keys of the input come back as they were: flat, nested or mixed
    want = brute_like(tree, dict(pairs))  # the input's keys, as they were nested
    assert same_structure(back, want)
    got = T.to_flat_dict(back)
    for p, v in pairs:  # tied leaves come back as one object at all of their paths
        assert got[p] is got[seen[id(v)]]
    # nothing was written into the input
    assert all(same(v, b) for (_, v), (_, b) in zip(pairs, before))


@PROPS
@given(ANY_TREE, st.data())
def test_map_with_several_trees_matches_brute_force(tree, data):
    pairs = brute_items(tree)
    # a second tree: the same paths, flat and in reversed order; a third: nested
    other = dict(reversed([(p, torch.ones_like(v, dtype=torch.float64)) for p, v in pairs]))
    third = brute_nest([(p, torch.full(v.shape, 2.0, dtype=torch.float64)) for p, v in pairs])
    drop = set(data.draw(st.lists(st.sampled_from([p for p, _ in pairs]), max_size=2))
               if pairs else [])
    calls = []

    def f(x, y, z):
        calls.append(x)
        return None if len(calls) - 1 in {i for i, (p, _) in enumerate(pairs) if p in drop} \
            else x.to(torch.float64) + y * z
    out = T.map(f, tree, other, third)
    assert len(calls) == len(pairs) and all(a is b for a, (_, b) in zip(calls, pairs))
    kept = [(p, v.to(torch.float64) + 2) for p, v in pairs if p not in drop]
    want = brute_like(tree, dict(kept))
    assert same_structure(out, want)


def test_map_error_names_the_tree_by_its_position_among_the_trees_given():
    """The message names the missing path; the tree is said to be argument i of ``rest``."""
    a = {"x": torch.ones(1), "y": {"z": torch.ones(1)}}
    bad = {"x": torch.ones(1)}
    with pytest.raises(ValueError, match="'y.z'"):
        T.map(lambda *xs: xs[0], a, a, bad)
    with pytest.raises(ValueError, match="extra leaf at 'y.w'"):
        T.map(lambda *xs: xs[0], a, {"x": torch.ones(1), "y": {"z": torch.ones(1),
                                                                  "w": torch.ones(1)}})


def test_map_error_counts_trees_as_the_user_does():
    a = {"x": torch.ones(1), "y": torch.ones(1)}
    bad = {"x": torch.ones(1)}
    with pytest.raises(ValueError) as e:
        T.map(lambda *xs: xs[0], a, a, bad)
    assert "argument 3" in str(e.value) or "third" in str(e.value) or "rest[1]" in str(e.value)


def test_map_non_tree_in_rest_is_named():
    a = {"x": torch.ones(1)}
    with pytest.raises(TypeError, match=r"argument|rest"):
        T.map(lambda *xs: xs[0], a, a, 5)


@pytest.mark.parametrize("bad", [[1.0], 3, 2.5, "w", (torch.ones(1),)])
@pytest.mark.parametrize("fn", [T.paths, T.leaves, T.flatten, T.to_flat_dict,
                                lambda t: T.map(lambda x: x, t),
                                lambda t: T.reduce(lambda a, x: a, t, 0)])
def test_non_tensor_leaf_is_a_type_error_naming_its_path(fn, bad):
    with pytest.raises(TypeError, match=r"'enc\.0\.w'"):
        fn({"enc": {"0": {"w": bad}}, "ok": torch.ones(1)})


def test_non_tensor_in_a_flat_dict_is_named():
    with pytest.raises(TypeError, match=r"'a\.b'"):
        T.from_flat_dict({"a.b": [1.0]})
    with pytest.raises(TypeError, match=r"'a\.b'"):
        T.flatten({"a.b": 3})


def test_map_result_of_wrong_type_is_named_for_flat_and_nested_input():
    for tree in ({"a.b": torch.ones(1)}, {"a": {"b": torch.ones(1)}}):
        with pytest.raises(TypeError, match=r"'a\.b'"):
            T.map(lambda x: x.tolist(), tree)


def test_map_checks_every_tree_before_calling_f():
    a = {"x": torch.ones(1), "y": torch.ones(1)}
    calls = []
    with pytest.raises(ValueError, match="'y'"):
        T.map(lambda *xs: calls.append(1) or xs[0], a, {"x": torch.ones(1)})
    assert calls == []


@pytest.mark.parametrize("tree,words", [
    ({"a": torch.ones(1), "a.b": torch.ones(1)}, ["'a'", "'a.b'"]),
    ({"a.b": torch.ones(1), "a": {"b": torch.ones(1)}}, ["'a.b'"]),
    ({"a..b": torch.ones(1)}, ["'a..b'"]),
    ({".a": torch.ones(1)}, ["'.a'"]),
    ({"": torch.ones(1)}, ["''"]),
    ({1: torch.ones(1)}, ["1"]),
])
def test_bad_keys_and_conflicting_paths(tree, words):
    for fn in (T.paths, T.flatten, T.to_flat_dict):
        with pytest.raises(ValueError) as e:
            fn(tree)
        assert all(w in str(e.value) for w in words), str(e.value)


def test_none_leaves_and_empty_subtrees_are_invisible():
    w = torch.ones(2)
    t = {"a": {}, "b": {"c": {}, "d": None}, "e": {"f": w}, "g": None}
    assert T.paths(t) == ["e.f"]
    vec, spec = T.flatten(t)
    assert spec.paths == ("e.f",) and same(T.unflatten(vec, spec)["e"]["f"], w)
    assert T.map(lambda x: x, t) == {"e": {"f": w}}
    assert T.from_flat_dict(T.to_flat_dict(t)) == {"e": {"f": w}}
    empty_vec, empty_spec = T.flatten({"a": {}, "b": None})
    assert empty_vec.shape == (0,) and T.unflatten(empty_vec, empty_spec) == {}


def test_flatten_zero_dim_zero_size_and_non_contiguous_leaves():
    base = torch.arange(24.0).reshape(4, 6)
    t = {"s": torch.tensor(5.0), "z": torch.empty(0, 3), "nc": base[:, ::2], "tr": base.t(),
         "e": torch.empty(2, 0, 4, dtype=torch.int64)}
    vec, spec = T.flatten(t)
    assert vec.numel() == 1 + 0 + 12 + 24 + 0
    back = T.unflatten(vec, spec)
    assert all(same(back[k], t[k]) for k in t)
    assert back["s"].dim() == 0 and back["e"].dtype == torch.int64


def test_unflatten_from_a_non_contiguous_vector():
    t = {"a": torch.randn(2, 3), "b": torch.randn(4)}
    vec, spec = T.flatten(t)
    holder = torch.zeros(2 * vec.numel())
    holder[::2] = vec
    back = T.unflatten(holder[::2], spec)
    assert all(same(back[k], t[k]) for k in t)


@pytest.mark.parametrize("vector,error,words", [
    (torch.zeros(7), ValueError, ["7", "6"]),
    (torch.zeros(5), ValueError, ["5", "6"]),
    (torch.zeros(2, 3), ValueError, ["1-D", "(2, 3)"]),
    (torch.tensor(1.0), ValueError, ["1-D"]),
    ([0.0] * 6, TypeError, ["Tensor"]),
])
def test_unflatten_bad_vector(vector, error, words):
    _, spec = T.flatten({"a": torch.ones(2, 2), "b": torch.ones(2)})
    with pytest.raises(error) as e:
        T.unflatten(vector, spec)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_unflatten_spec_from_another_tree_of_other_length_is_refused():
    _, spec_small = T.flatten({"a": torch.ones(3)})
    vec_big, _ = T.flatten({"a": torch.ones(3), "b": torch.ones(4)})
    with pytest.raises(ValueError, match="7.*3|3.*7"):
        T.unflatten(vec_big, spec_small)
    with pytest.raises(TypeError, match="TreeSpec"):
        T.unflatten(vec_big, {"a": torch.ones(3)})


def test_unflatten_refuses_a_complex_vector_for_a_real_tree():
    _, spec = T.flatten({"a": torch.ones(2)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises((TypeError, ValueError)):
            T.unflatten(torch.tensor([1 + 2j, 3 - 1j]), spec)


def test_flatten_refuses_mixed_devices_naming_both_paths():
    t = {"a": torch.ones(2), "b": {"c": torch.ones(2, device="meta")}}
    with pytest.raises(ValueError, match=r"'a'.*cpu.*'b\.c'.*meta"):
        T.flatten(t)


def test_flatten_refuses_a_sparse_leaf_naming_it():
    with pytest.raises(TypeError, match="'g.s'"):
        T.flatten({"g": {"s": torch.eye(3).to_sparse()}})


# ----------------------------------------------------------------------------- tied parameters
class Shared(nn.Module):
    """One submodule at two paths, one parameter tied across modules."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        self.c = self.a
        self.d = nn.Linear(3, 3)
        self.d.bias = self.b.bias


def test_from_module_tied_once_at_first_path_like_named_parameters():
    for model in (TiedLM(), Shared(), nn.Sequential(nn.Linear(2, 2), nn.ReLU())):
        tree = T.from_module(model)
        named = list(model.named_parameters())
        assert T.paths(tree) == [p for p, _ in named]
        assert all(a is b for a, (_, b) in zip(T.leaves(tree), named))
        vec, spec = T.flatten(tree)
        assert spec.numel == sum(p.numel() for p in model.parameters())


def test_from_module_buffers_are_the_buffers_themselves():
    m = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    tree = T.from_module(m, buffers=True)
    flat = T.to_flat_dict(tree)
    for path, b in m.named_buffers():
        assert flat[path] is b
    assert set(flat) == {p for p, _ in m.named_parameters()} | {p for p, _ in m.named_buffers()}


def test_flatten_of_a_state_dict_stores_a_tied_parameter_once():
    model = TiedLM()
    vec, spec = T.flatten(model.state_dict())
    assert spec.numel == sum(p.numel() for p in model.parameters())
    back = T.unflatten(vec, spec)
    assert back["head.weight"] is back["embed.weight"]


def test_map_trainable_visits_tied_parameter_once_at_first_path():
    model = Shared()
    seen = []
    out = ts.map_trainable(lambda p: seen.append(p) or p * 1, model)
    named = list(model.named_parameters())
    assert len(seen) == len(named) and all(a is b for a, (_, b) in zip(seen, named))
    assert T.paths(out) == [p for p, _ in named]


def test_map_trainable_against_brute_force_with_frozen_and_tied():
    model = Shared()
    model.b.weight.requires_grad_(False)
    grads = {p: torch.full_like(q, 3.0) for p, q in model.named_parameters()}
    with ts.freeze(model, "a"):
        out = ts.map_trainable(lambda p, g: p.detach() - 0.5 * g, model, grads)
        want = {p: q.detach() - 1.5 for p, q in model.named_parameters() if q.requires_grad}
    flat = T.to_flat_dict(out)
    assert list(flat) == list(want) and all(torch.equal(flat[k], want[k]) for k in want)
    assert list(want) == ["b.bias", "d.weight"]


def test_map_trainable_errors_name_path_and_tree():
    model = Shared()
    full = T.map(torch.zeros_like, T.from_module(model))
    with pytest.raises(ValueError, match="'a.weight'"):  # only the later path of the shared module
        ts.map_trainable(lambda p, g: g, model,
                         {"c": {"weight": torch.zeros(3, 3), "bias": torch.zeros(3)}})
    extra = dict(T.to_flat_dict(full), **{"a.wieght": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match="'a.wieght'"):
        ts.map_trainable(lambda p, g: g, model, extra)
    untied = dict(T.to_flat_dict(full), **{"c.weight": torch.ones(3, 3)})
    with pytest.raises(ValueError, match="'a.weight'.*'c.weight'"):
        ts.map_trainable(lambda p, g: g, model, untied)
    with pytest.raises(TypeError):
        ts.map_trainable(lambda p, g: g, model, [torch.zeros(1)])
    with pytest.raises(TypeError):
        ts.map_trainable(lambda p: 1.0, model)
    with pytest.raises(TypeError, match="nn.Module"):
        ts.map_trainable(lambda p: p, full)


def test_grad_tree_against_brute_force():
    torch.manual_seed(0)
    model = Shared()
    model.b.weight.requires_grad_(False)
    x = torch.randn(2, 3)
    (model.a(x) + model.b(x) + model.c(x) + model.d(x)).pow(2).sum().backward()
    model.b.weight.grad = torch.ones(3, 3)  # a stale grad on a frozen parameter
    model.d.weight.grad = None

    def brute():
        return [(p, q.grad) for p, q in model.named_parameters()
                if q.requires_grad and q.grad is not None]
    flat = T.to_flat_dict(ts.grad_tree(model))
    assert list(flat) == [p for p, _ in brute()] == ["a.weight", "a.bias", "b.bias"]
    assert all(flat[p] is g for p, g in brute())
    with ts.freeze(model, "a"):
        flat = T.to_flat_dict(ts.grad_tree(model))
        assert list(flat) == [p for p, _ in brute()] == ["b.bias"]
    assert list(T.to_flat_dict(ts.grad_tree(model))) == ["a.weight", "a.bias", "b.bias"]
    with pytest.raises(TypeError, match="nn.Module"):
        ts.grad_tree({"a": torch.ones(1)})


# ============================================================================ 2. ts.summary
def snapshot(model):
    """Every flag, every hook dict and every attribute name of every module and parameter."""
    mods = []
    for name, mod in model.named_modules(remove_duplicate=False):
        hooks = tuple((k, tuple(v)) for k, v in vars(mod).items()
                      if "hook" in k and isinstance(v, dict))
        mods.append((name, hooks, tuple(sorted(vars(mod)))))
    params = [(name, p.requires_grad, tuple(sorted(vars(p))), id(p) in ts._state.records,
               tuple(getattr(p, "_backward_hooks", None) or ()),
               tuple(getattr(p, "_post_accumulate_grad_hooks", None) or ()))
              for name, p in model.named_parameters(remove_duplicate=False)]
    from torch.nn.modules import module as M
    glob = tuple(len(getattr(M, k)) for k in dir(M) if k.startswith("_global_") and
                 isinstance(getattr(M, k), dict))
    attached = [name for name, mod in model.named_modules()
                if any(st.root() is mod for st in ts._state.live_states())]
    return mods, params, glob, attached


def brute_counts(model, prefix):
    """(trainable, total) over the parameters whose first path lies under ``prefix``."""
    tr = tot = 0
    for path, p in model.named_parameters():
        if not prefix or path == prefix or path.startswith(prefix + "."):
            tot += p.numel()
            tr += p.numel() if p.requires_grad else 0
    return tr, tot


def brute_rows(model):
    """Paths of the rows a summary must show: modules in preorder (a module seen before is
    one row, not descended into), each followed by its own parameters."""
    out, seen = [], set()

    def walk(mod, path):
        out.append(path)
        if id(mod) in seen:
            return
        seen.add(id(mod))
        for name, p in mod._parameters.items():
            if p is not None:
                out.append(f"{path}.{name}" if path else name)
        for name, child in mod._modules.items():
            if child is not None:
                walk(child, f"{path}.{name}" if path else name)
    walk(model, "")
    return out


def check_rows(model, s):
    """Every row against the brute force, rows standing for repeated blocks included (they
    count every copy), the set of rows too; and the totals."""
    assert s.counts == brute_counts(model, "")
    first = {}
    for path, p in model.named_parameters():
        first.setdefault(id(p), path)
    params = dict(model.named_parameters(remove_duplicate=False))
    collapsed = []  # (depth, first block path, every block path) of the enclosing repeats

    def expand(path):
        out = [path]
        for _, head, alts in reversed(collapsed):  # innermost first
            out = [alt + q[len(head):] if q == head or q.startswith(head + ".") else q
                   for q in out for alt in (alts if q == head or q.startswith(head + ".")
                                            else [None])]
        return out

    shown = []
    for r in s.rows:
        while collapsed and r.depth <= collapsed[-1][0]:
            collapsed.pop()
        if r.repeat > 1:
            lo, hi = (int(x) for x in r.name.split("–"))
            parent = r.path.rsplit(".", 1)[0] if "." in r.path else ""
            alts = [f"{parent}.{i}" if parent else str(i) for i in range(lo, hi + 1)]
            assert len(alts) == r.repeat
            collapsed.append((r.depth, r.path, alts))
        paths = expand(r.path)
        shown += paths
        if r.tied_to is not None:
            assert (r.trainable, r.total) == (0, 0)
            if r.is_param:
                assert first[id(params[r.path])] == r.tied_to != r.path
            continue
        want = [brute_counts(model, q) for q in paths]
        assert (r.trainable, r.total) == tuple(map(sum, zip(*want))), (r, paths)
    assert sorted(shown) == sorted(brute_rows(model))
    assert f"{100 * s.trainable / max(s.total, 1):.2f}%" in s.totals()


@st.composite
def models_st(draw):
    """Random models: stacks of small blocks (runs of identical ones, nested stacks), modules
    reused at a second path, parameters tied across modules, zero-element parameters and
    random frozen flags."""
    made_mods, made_params = [], []

    def block(d):
        kind = draw(st.sampled_from(["lin", "lin", "lin3", "norm", "empty", "seq", "list",
                                     "reuse", "tie"] if d else ["lin", "lin3", "norm", "empty"]))
        if kind == "reuse" and made_mods:
            return draw(st.sampled_from(made_mods))
        if kind in ("seq", "list"):
            n = draw(st.integers(1, 4))
            same = draw(st.booleans())
            proto = None
            kids = []
            for _ in range(n):
                kid = copy.deepcopy(proto) if same and proto is not None else block(d - 1)
                proto = kid
                kids.append(kid)
            m = nn.Sequential(*kids) if kind == "seq" else nn.ModuleList(kids)
        elif kind == "tie" and made_params:
            m = nn.Linear(2, 2)
            m.weight = draw(st.sampled_from(made_params))
        else:
            args = {"lin": (2, 2), "lin3": (2, 3), "norm": (2,), "empty": (0, 2)}.get(kind, (2, 2))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                m = (nn.LayerNorm if kind == "norm" else nn.Linear)(*args)
        made_mods.append(m)
        made_params.extend(p for p in m.parameters(recurse=False) if p.shape == (2, 2))
        return m

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zero-element parameters
        root = nn.ModuleList(block(2) for _ in range(draw(st.integers(1, 5))))
    mode = draw(st.sampled_from(["all", "none", "random"]))
    for p in root.parameters():
        p.requires_grad_(mode == "all" or (mode == "random" and draw(st.booleans())))
    return root


@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(models_st())
def test_summary_rows_of_random_models_match_brute_force(model):
    before = snapshot(model)
    s = ts.summary(model)
    assert snapshot(model) == before
    check_rows(model, s)
    assert T.paths(T.from_module(model)) == [p for p, _ in model.named_parameters()]


def tiny_gpt2(**kw):
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=3, n_head=2, n_embd=8, vocab_size=40, n_positions=16,
                     bos_token_id=0, eos_token_id=0, **kw)
    return GPT2LMHeadModel(cfg)


def tiny_bert():
    pytest.importorskip("transformers")
    from transformers import BertConfig, BertModel
    torch.manual_seed(0)
    return BertModel(BertConfig(num_hidden_layers=2, num_attention_heads=2, hidden_size=8,
                                intermediate_size=16, vocab_size=40, max_position_embeddings=16))


@pytest.fixture(scope="module")
def hf():
    pytest.importorskip("transformers")
    return True


def test_summary_gpt2_tied_embeddings_match_brute_force(hf):
    model = tiny_gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    before = snapshot(model)
    s = ts.summary(model)
    assert snapshot(model) == before
    check_rows(model, s)
    tied = [r for r in s.rows if r.tied_to is not None]
    assert [(r.path, r.tied_to) for r in tied] == [("lm_head.weight", "transformer.wte.weight")]
    assert "tied" in str(s) and "to transformer.wte.weight" in str(s)


def test_summary_bert_frozen_by_hand_equals_frozen_by_torchstruct(hf):
    by_hand, by_ts = tiny_bert(), tiny_bert()
    for name, p in by_hand.named_parameters():
        if not name.startswith("encoder.layer.1"):
            p.requires_grad_(False)
    with ts.freeze_except(by_ts, "encoder.layer.1"):
        before = snapshot(by_ts)
        s_ts = ts.summary(by_ts)
        assert snapshot(by_ts) == before
        check_rows(by_ts, s_ts)
    before = snapshot(by_hand)
    s_hand = ts.summary(by_hand)
    assert snapshot(by_hand) == before
    check_rows(by_hand, s_hand)
    assert s_hand.counts == s_ts.counts
    assert [(r.path, r.trainable, r.total, r.mark) for r in s_hand.rows] == \
        [(r.path, r.trainable, r.total, r.mark) for r in s_ts.rows]
    assert 0 < s_hand.trainable < s_hand.total


def test_summary_peft_lora_matches_brute_force_and_peft(hf):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        tiny_gpt2(), peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True))
    before = snapshot(model)
    s = ts.summary(model)
    assert snapshot(model) == before
    check_rows(model, s)
    trainable, total = model.get_nb_trainable_parameters()
    assert s.counts == (trainable, total)
    lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert s.trainable == lora > 0


def test_summary_meta_device_model(hf):
    with torch.device("meta"):
        model = tiny_gpt2()
    s = ts.summary(model)
    check_rows(model, s)
    with torch.device("meta"):
        mixed = nn.Sequential(nn.Linear(100, 100), nn.Linear(100, 3))
    mixed[0].weight.requires_grad_(False)
    check_rows(mixed, ts.summary(mixed))
    assert ts.summary(mixed).counts == (100 + 303, 10100 + 303)


def test_summary_zero_element_parameters():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = nn.Sequential(nn.Linear(0, 3), nn.Linear(3, 0), nn.Linear(2, 2))
    m[1].bias.requires_grad_(False)
    s = ts.summary(m)
    check_rows(m, s)
    assert s.counts == (3 + 6, 3 + 6)
    empty = nn.Module()
    empty.p = nn.Parameter(torch.empty(0))
    assert ts.summary(empty).counts == (0, 0) and "0.00%" in ts.summary(empty).totals()


def test_summary_shared_submodule_and_tied_parameter_counted_once():
    m = Shared()
    m.b.weight.requires_grad_(False)
    before = snapshot(m)
    s = ts.summary(m)
    assert snapshot(m) == before
    check_rows(m, s)
    rows = {r.path: r for r in s.rows}
    assert rows["c"].tied_to == "a" and rows["d.bias"].tied_to == "b.bias"
    assert s.counts == (12 + 3 + 9, 12 + 12 + 9)  # b.weight frozen; c and d.bias shared


def test_summary_collapsed_blocks_count_every_copy():
    m = nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)) for _ in range(5)),
                      nn.Linear(4, 2))
    with ts.freeze(m, "4", "0.1"):
        s = ts.summary(m)
        check_rows(m, s)
    assert [r.repeat for r in s.rows if r.depth == 1] == [1, 3, 1, 1]


def test_summary_attached_model_with_declarations_writes_nothing():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(3, 3)
            self.head = nn.Linear(3, 1)

        def trainable(self):
            return ["head"]

    m = Net()
    ts.attach(m)
    with ts.freeze(m, "head.bias"):
        before = snapshot(m)
        s = ts.summary(m)
        assert snapshot(m) == before
        assert s.counts == (3, 16)
        assert s.counts == brute_counts(m, "")


def test_summary_mark_of_a_module_holding_a_frozen_tied_parameter():
    m = Shared()
    m.b.bias.requires_grad_(False)
    rows = {r.path: r for r in ts.summary(m).rows}
    assert rows["d"].mark == "partial"


def test_summary_percentage_never_rounds_to_all_or_nothing():
    big = nn.Sequential(nn.Linear(1000, 100), nn.Linear(1, 1))
    big[1].bias.requires_grad_(False)
    s = ts.summary(big)
    assert s.trainable < s.total and "100.00%" not in s.totals()
    small = nn.Sequential(nn.Linear(1000, 1000), nn.Linear(1, 1, bias=False))
    for p in small[0].parameters():
        p.requires_grad_(False)
    s = ts.summary(small)
    assert s.trainable > 0 and "0.00%" not in s.totals()


def test_summary_bad_input():
    with pytest.raises(TypeError, match="nn.Module"):
        ts.summary({"a": torch.ones(1)})
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(TypeError, match="max_depth"):
            ts.summary(nn.Linear(2, 2), max_depth=bad)


# ============================================================================ 3. UnfreezeSchedule
NAMES = ["0", "1", "2", "3", "4"]


def stack():
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(2, 2) for _ in range(5)))


def flags(m):
    return [p.requires_grad for p in m.parameters()]


def brute_flags(model, start, milestones, step):
    """Flags after ``step`` steps: starting flag and (covered by a milestone <= step)."""
    reached = [v for k, v in milestones.items() if k <= step]
    out = []
    for (path, _), f in zip(model.named_parameters(), start):
        if any(v is None for v in reached):
            covered = True
        else:
            covered = any(path.split(".")[0] in v for v in reached)
        out.append(f and covered)
    return out


MILESTONES = st.dictionaries(
    st.integers(0, 12),
    st.one_of(st.none(), st.lists(st.sampled_from(NAMES), min_size=1, max_size=3, unique=True)),
    min_size=1, max_size=5)


@PROPS
@given(MILESTONES, st.lists(st.booleans(), min_size=10, max_size=10))
def test_schedule_flags_at_every_step_match_brute_force_replay(milestones, start):
    model = stack()
    for p, f in zip(model.parameters(), start):
        p.requires_grad_(f)
    s = ts.UnfreezeSchedule(model, dict(reversed(list(milestones.items()))))  # any key order
    try:
        assert s.milestones == tuple(sorted(milestones))
        for step in range(15):
            assert s.current_step == step
            assert s.stage == sum(k <= step for k in milestones)
            assert flags(model) == brute_flags(model, start, milestones, step), step
            s.step()
    finally:
        s.close()
    assert flags(model) == start


@PROPS
@given(MILESTONES, st.integers(0, 14))
def test_schedule_resumed_mid_run_equals_uninterrupted(milestones, at):
    a, b = stack(), stack()
    sa = ts.UnfreezeSchedule(a, milestones)
    for _ in range(at):
        sa.step()
    state = sa.state_dict()
    assert state == {"step": at, "milestones": sorted(milestones)}
    sb = ts.UnfreezeSchedule(b, milestones)
    sb.step()  # somewhere else first: loading must move it
    sb.load_state_dict(state)
    try:
        for _ in range(15 - at):
            assert flags(b) == flags(a) and sb.current_step == sa.current_step
            assert sb.stage == sa.stage and sb.selectors == sa.selectors
            sa.step()
            sb.step()
    finally:
        sa.close()
        sb.close()


def test_schedule_milestone_at_every_step():
    m = stack()
    s = ts.UnfreezeSchedule(m, {i: [NAMES[4 - i]] for i in range(5)})
    try:
        for i in range(5):
            assert flags(m) == [j >= 4 - i for j in range(5) for _ in range(2)]
            s.step()
        assert all(flags(m))
    finally:
        s.close()


@pytest.mark.parametrize("milestones,error,words", [
    ({-1: "0"}, ValueError, ["-1", "negative"]),
    ({1.0: "0"}, TypeError, ["1.0", "integer"]),
    ({"3": "0"}, TypeError, ["'3'"]),
    ({True: "0"}, TypeError, ["True"]),
    ({0: "0", 4: "9"}, ValueError, ["milestone 4", "'9'"]),
    ({0: "0", 2: ["1", "typo"]}, ValueError, ["milestone 2", "'typo'"]),
    ({0: []}, ValueError, ["milestone 0", "empty"]),
    ({0: 5}, TypeError, ["milestone 0"]),
    ({0: nn.Linear(2, 2)}, ValueError, ["milestone 0", "not a submodule"]),
    ({}, ValueError, ["empty"]),
    ([(0, "0")], TypeError, ["mapping"]),
])
def test_schedule_bad_milestones_raise_and_change_nothing(milestones, error, words):
    m = stack()
    m[1].bias.requires_grad_(False)
    before = flags(m)
    snap = snapshot(m)
    with pytest.raises(error) as e:
        ts.UnfreezeSchedule(m, milestones)
    assert all(w in str(e.value) for w in words), str(e.value)
    assert flags(m) == before and snapshot(m) == snap
    m(torch.ones(1, 2))  # nothing held on: a forward changes nothing either
    assert flags(m) == before
    assert [p for p, _ in ts.trainable_parameters(m)] == \
        [n for n, p in m.named_parameters() if p.requires_grad]


@pytest.mark.parametrize("state", [
    {"step": -1, "milestones": [0, 3]},
    {"step": 2.0, "milestones": [0, 3]},
    {"step": 2, "milestones": [0, 4]},
    {"step": 2, "milestones": [3, 0]},
    {"step": 2},
    {"step": 2, "milestones": [0, 3], "extra": 1},
    [("step", 2)],
])
def test_schedule_bad_state_changes_nothing(state):
    m = stack()
    s = ts.UnfreezeSchedule(m, {0: "4", 3: "3"})
    for _ in range(4):
        s.step()
    before, where = flags(m), (s.current_step, s.stage)
    with pytest.raises((TypeError, ValueError)):
        s.load_state_dict(state)
    assert flags(m) == before and (s.current_step, s.stage) == where
    s.step()
    assert flags(m) == before
    s.close()


def test_schedule_closed_refuses_and_changes_nothing():
    m = stack()
    s = ts.UnfreezeSchedule(m, {0: "4", 1: None})
    s.close()
    assert all(flags(m))
    with pytest.raises(RuntimeError, match="closed"):
        s.step()
    with pytest.raises(RuntimeError, match="closed"):
        s.load_state_dict({"step": 0, "milestones": [0, 1]})
    assert all(flags(m))


# ============================================================================ later findings
def lazy_model():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Lazy modules are a new feature"
        return nn.Sequential(nn.Linear(2, 2), nn.LazyLinear(3))


def test_summary_of_a_lazy_model_names_the_uninitialized_parameter():
    m = lazy_model()
    try:
        ts.summary(m)
    except Exception as e:  # an error is acceptable only if it says where
        assert "1.weight" in str(e), str(e)


def test_flatten_of_an_uninitialized_parameter_names_its_path():
    with pytest.raises((TypeError, ValueError, RuntimeError), match=r"1\.weight"):
        T.flatten(T.from_module(lazy_model()))


def test_lazy_model_after_its_first_forward_is_counted():
    m = lazy_model()
    m(torch.ones(1, 2))
    check_rows(m, ts.summary(m))
    assert ts.summary(m).counts == (6 + 9, 6 + 9)


def test_summary_bert_masked_lm_two_ties(hf):
    pytest.importorskip("transformers")
    from transformers import BertConfig, BertForMaskedLM
    torch.manual_seed(0)
    b = BertForMaskedLM(BertConfig(num_hidden_layers=2, num_attention_heads=2, hidden_size=8,
                                   intermediate_size=16, vocab_size=40,
                                   max_position_embeddings=16))
    b.bert.embeddings.word_embeddings.weight.requires_grad_(False)
    before = snapshot(b)
    s = ts.summary(b)
    assert snapshot(b) == before
    check_rows(b, s)
    assert {(r.path, r.tied_to) for r in s.rows if r.tied_to} >= {
        ("cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight")}


def test_summary_peft_modules_to_save_and_lora_on_tied_embedding(hf):
    peft = pytest.importorskip("peft")
    for cfg in (peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True,
                                modules_to_save=["ln_f"]),
                peft.LoraConfig(r=2, target_modules=["wte"])):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = peft.get_peft_model(tiny_gpt2(), cfg)
        before = snapshot(model)
        s = ts.summary(model)
        assert snapshot(model) == before
        check_rows(model, s)
        assert s.counts == model.get_nb_trainable_parameters()


def stale_schedule():
    m = nn.Sequential(*(nn.Linear(2, 2) for _ in range(3)))
    m.add_module("extra", nn.Linear(2, 2))
    s = ts.UnfreezeSchedule(m, {0: "2", 2: "extra", 4: None})
    del m.extra  # the model changed: milestone 2 now selects nothing
    return m, s


def test_schedule_stage_change_with_a_stale_selector_changes_nothing():
    m, s = stale_schedule()
    s.step()
    before = flags(m)
    for _ in range(2):
        with pytest.raises(ValueError, match="'extra'"):
            s.step()
        assert (s.current_step, s.stage) == (1, 1) and flags(m) == before
    with pytest.raises(ValueError, match="'extra'"):
        s.load_state_dict({"step": 3, "milestones": [0, 2, 4]})
    assert (s.current_step, s.stage) == (1, 1) and flags(m) == before
    s.load_state_dict({"step": 5, "milestones": [0, 2, 4]})  # past it: everything trains
    assert all(flags(m)) and s.selectors is None
    s.close()


def test_schedule_stale_selector_error_names_the_milestone():
    m, s = stale_schedule()
    s.step()
    with pytest.raises(ValueError, match="milestone 2"):
        s.step()
    s.close()


def test_grad_tree_and_map_trainable_inside_stop_gradient_see_the_parameters():
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    m(torch.ones(3, 2)).sum().backward()
    outside = T.to_flat_dict(ts.grad_tree(m))
    with ts.stop_gradient(m, "0"):
        inside = T.to_flat_dict(ts.grad_tree(m))
        assert T.paths(ts.map_trainable(lambda p: p, m)) == list(outside)
        assert ts.summary(m).counts == (9, 9)
    assert list(inside) == list(outside) and all(inside[k] is outside[k] for k in outside)


def interleaved():
    """A mixed tree (allowed: "the two forms may be mixed") whose dotted key and nested dict
    for ``a`` are not adjacent: depth-first order is a.x, b, a.y."""
    return {"a.x": torch.full((2,), 1.0), "b": torch.full((2,), 2.0),
            "a": {"y": torch.full((2,), 3.0)}}


def test_interleaved_mixed_tree_is_walked_in_insertion_order():
    t = interleaved()
    assert T.paths(t) == ["a.x", "b", "a.y"]
    vec, spec = T.flatten(t)
    assert spec.paths == ("a.x", "b", "a.y") and vec.tolist() == [1, 1, 2, 2, 3, 3]
    flat = T.to_flat_dict(T.unflatten(vec, spec))  # the values are right, path by path
    assert {k: v.tolist() for k, v in flat.items()} == {"a.x": [1, 1], "b": [2, 2],
                                                         "a.y": [3, 3]}


def test_unflatten_then_flatten_gives_back_the_same_vector():
    vec, spec = T.flatten(interleaved())
    back = T.unflatten(vec, spec)
    assert T.paths(back) == list(spec.paths)
    vec2, spec2 = T.flatten(back)
    assert torch.equal(vec2, vec) and spec2.paths == spec.paths


def test_map_keeps_the_leaf_order_of_its_input():
    t = interleaved()
    assert T.paths(T.map(lambda x: x * 1, t)) == T.paths(t)


@settings(max_examples=40, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(models_st(), st.data())
def test_grad_tree_and_map_trainable_of_random_models_match_brute_force(model, data):
    for p in model.parameters():
        if data.draw(st.booleans()):
            p.grad = torch.randn_like(p)
    named = list(model.named_parameters())
    want = [(n, p.grad) for n, p in named if p.requires_grad and p.grad is not None]
    got = T.to_flat_dict(ts.grad_tree(model))
    assert list(got) == [n for n, _ in want] and all(got[n] is g for n, g in want)
    # a tree over every path of the model (later paths of tied parameters included)
    full = {n: p.detach() * 2 for n, p in named}
    full.update({n: full[n0] for n, p in model.named_parameters(remove_duplicate=False)
                 for n0, q in named if q is p and n0 != n})
    out = T.to_flat_dict(ts.map_trainable(lambda p, x: x + 1, model, full))
    want = [(n, p.detach() * 2 + 1) for n, p in named if p.requires_grad]
    assert list(out) == [n for n, _ in want] and all(torch.equal(out[n], w) for n, w in want)


def test_summary_same_for_every_way_of_freezing():
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 3), nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3)),
                             nn.Linear(3, 1))

    by_hand, bare, declared, ctx = make(), make(), make(), make()
    for p in list(by_hand[0].parameters()) + list(by_hand[1].parameters()):
        p.requires_grad_(False)
    ts.freeze_except(bare, "2")                      # permanent
    ts.mark_trainable(declared, "2")                 # a declaration
    rows = []
    for m in (by_hand, bare, declared):
        s = ts.summary(m)
        check_rows(m, s)
        rows.append([(r.path, r.trainable, r.total, r.mark) for r in s.rows])
    with ts.freeze(ctx, "0", "1"):
        rows.append([(r.path, r.trainable, r.total, r.mark) for r in ts.summary(ctx).rows])
    assert rows[0] == rows[1] == rows[2] == rows[3]
    assert rows[0][0][1:] == (4, 4 + 12 + 12 + 6, "partial")
    ts.mark_trainable(declared, None)
    assert ts.summary(declared).counts == (34, 34) and all(flags(declared))
