"""Tests for torchstruct.tree: nested-dict trees, flatten/unflatten, from_module."""

import doctest
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from torchstruct import tree as T

import _models

# ---------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64]
KEYS = st.text(alphabet="abcxyz_019", min_size=1, max_size=3)
SHAPES = st.lists(st.integers(0, 3), min_size=0, max_size=3).map(tuple)


def _make_leaf(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    # small integers: exact in every float dtype they may be promoted to (bf16 included)
    return torch.randint(-200, 201, shape, generator=g, dtype=dtype)


LEAVES = st.builds(_make_leaf, SHAPES, st.sampled_from(DTYPES), st.integers(0, 2**31 - 1))


def trees(depth):
    value = LEAVES if depth == 0 else st.one_of(LEAVES, trees(depth - 1))
    return st.dictionaries(KEYS, value, max_size=3)


TREES = st.integers(0, 4).flatmap(trees)
PROPS = settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def bits(t):
    """An integer view of ``t`` so that comparisons are bitwise (NaN, -0.0)."""
    if t.dtype.is_floating_point:
        t = t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


# ---------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------

@PROPS
@given(TREES)
def test_flatten_unflatten_round_trip_bitwise(tree):
    vec, spec = T.flatten(tree)
    flat = T.to_flat_dict(tree)
    assert vec.dim() == 1 and vec.numel() == spec.numel
    assert spec.numel == sum(t.numel() for t in flat.values())
    assert spec.paths == tuple(flat)
    if flat:
        expected = flat[next(iter(flat))].dtype
        for t in flat.values():
            expected = torch.promote_types(expected, t.dtype)
        assert vec.dtype == expected == spec.dtype
    else:
        assert vec.dtype == torch.float32
    back = T.to_flat_dict(T.unflatten(vec, spec))
    assert list(back) == list(flat)
    for path, t in flat.items():
        assert same_bits(back[path], t), path


@PROPS
@given(TREES, st.data())
def test_flatten_stores_tied_leaf_once(tree, data):
    flat = T.to_flat_dict(tree)
    if not flat:
        return
    path = data.draw(st.sampled_from(list(flat)))
    tied = dict(tree, tied_=flat[path])  # KEYS are at most 3 characters: "tied_" is new
    vec, spec = T.flatten(tied)
    assert spec.numel == T.flatten(tree)[1].numel
    assert spec.entries[-1].alias_of == path
    back = T.to_flat_dict(T.unflatten(vec, spec))
    assert back["tied_"] is back[path]


@PROPS
@given(TREES)
def test_flat_dict_round_trip(tree):
    flat = T.to_flat_dict(tree)
    rebuilt = T.from_flat_dict(flat)
    again = T.to_flat_dict(rebuilt)
    assert list(again) == list(flat)
    assert all(again[p] is flat[p] for p in flat)
    # a rebuilt tree has no empty dicts, so rebuilding it again is the identity
    assert _structure(T.from_flat_dict(again)) == _structure(rebuilt)
    assert all(_structure(v) for v in rebuilt.values() if isinstance(v, dict))


def _structure(tree):
    return {k: _structure(v) if isinstance(v, dict) else id(v) for k, v in tree.items()}


@PROPS
@given(TREES)
def test_paths_and_leaves_agree_with_flat_dict(tree):
    flat = T.to_flat_dict(tree)
    assert T.paths(tree) == list(flat)
    assert len(T.leaves(tree)) == len(flat)
    assert all(a is b for a, b in zip(T.leaves(tree), flat.values()))


@PROPS
@given(TREES)
def test_map_identity(tree):
    out = T.map(lambda x: x, tree)
    assert T.paths(out) == T.paths(tree)
    assert all(a is b for a, b in zip(T.leaves(out), T.leaves(tree)))


@PROPS
@given(TREES)
def test_map_two_trees(tree):
    other = T.map(lambda x: x * 2, tree)
    seen = []

    def f(a, b):
        seen.append((a, b))
        return b - a

    out = T.map(f, tree, other)
    assert T.paths(out) == T.paths(tree)
    assert len(seen) == len(T.leaves(tree))
    assert all(x is y for (x, _), y in zip(seen, T.leaves(tree)))
    assert all(x is y for (_, x), y in zip(seen, T.leaves(other)))
    for got, x in zip(T.leaves(out), T.leaves(tree)):
        assert same_bits(got, x)  # 2x - x == x exactly


@PROPS
@given(TREES)
def test_reduce_numel_matches_spec(tree):
    assert T.reduce(lambda n, x: n + x.numel(), tree, 0) == T.flatten(tree)[1].numel


# ---------------------------------------------------------------------------
# Targeted behaviour
# ---------------------------------------------------------------------------

def test_doctests_pass():
    result = doctest.testmod(T)
    assert result.attempted > 0 and result.failed == 0


def test_none_leaves_are_absent_everywhere():
    a = torch.ones(2)
    tree = {"a": a, "frozen": None, "sub": {"x": None}}
    assert T.paths(tree) == ["a"]
    assert T.to_flat_dict(tree) == {"a": a}
    assert T.map(lambda x, y: x, tree, {"a": a, "b": None}) == {"a": a}
    assert T.from_flat_dict({"a": a, "b.c": None}) == {"a": a}


def test_map_drops_none_and_prunes_empty_dicts():
    tree = {"a": {"b": torch.ones(1)}, "c": torch.ones(2, 2)}
    out = T.map(lambda x: None if x.numel() == 1 else x, tree)
    assert list(out) == ["c"]
    assert T.map(lambda x: None, tree) == {}


def test_map_accepts_other_key_order():
    x = {"a": torch.tensor(1.0), "b": torch.tensor(2.0)}
    y = {"b": torch.tensor(10.0), "a": torch.tensor(20.0)}
    out = T.map(torch.add, x, y)
    assert list(out) == ["a", "b"]
    assert out["a"].item() == 21.0 and out["b"].item() == 12.0


def test_reduce_is_a_left_fold_in_order():
    tree = {"b": torch.tensor(1.0), "a": {"z": torch.tensor(2.0), "y": torch.tensor(3.0)}}
    assert T.reduce(lambda acc, x: acc + [x.item()], tree, []) == [1.0, 2.0, 3.0]
    assert T.reduce(lambda acc, x: acc, {}, "init") == "init"


def test_flatten_empty_tree():
    vec, spec = T.flatten({"a": {}})
    assert vec.shape == (0,) and vec.dtype == torch.float32
    assert spec.numel == 0 and spec.paths == ()
    assert T.unflatten(vec, spec) == {}


def test_flatten_mixed_dtypes_promote():
    tree = {"h": torch.tensor([1.5], dtype=torch.float16), "f": torch.tensor([2.0]),
            "b": torch.tensor([0.25], dtype=torch.bfloat16)}
    vec, spec = T.flatten(tree)
    assert vec.dtype == torch.float32
    back = T.unflatten(vec, spec)
    assert [back[k].dtype for k in "hfb"] == [torch.float16, torch.float32, torch.bfloat16]
    assert torch.equal(back["h"], tree["h"]) and torch.equal(back["b"], tree["b"])


def test_flatten_spec_records_path_shape_dtype_offset():
    w = torch.zeros(2, 3)
    vec, spec = T.flatten({"w": w, "s": torch.tensor(1.0, dtype=torch.float64), "again": w})
    assert isinstance(spec, T.TreeSpec)
    e = spec.entries
    assert [(x.path, tuple(x.shape), x.dtype, x.offset, x.alias_of) for x in e] == [
        ("w", (2, 3), torch.float32, 0, None),
        ("s", (), torch.float64, 6, None),
        ("again", (2, 3), torch.float32, 0, "w"),
    ]
    assert spec.numel == 7 and vec.dtype == torch.float64
    with pytest.raises(Exception):
        spec.dtype = torch.float32  # frozen
    assert hash(e[1]) == hash(T.LeafSpec("s", torch.Size(()), torch.float64, 6))


def test_tied_tensor_flattened_once_and_restored_as_one_object():
    w = torch.arange(4.0)
    tree = {"emb": {"weight": w}, "bias": torch.ones(1), "out": {"weight": w}}
    vec, spec = T.flatten(tree)
    assert vec.numel() == 5
    assert torch.equal(vec, torch.tensor([0.0, 1.0, 2.0, 3.0, 1.0]))
    back = T.unflatten(vec + 1, spec)
    assert back["emb"]["weight"] is back["out"]["weight"]
    assert torch.equal(back["out"]["weight"], w + 1)


def test_unflatten_same_dtype_gives_views():
    vec, spec = T.flatten({"a": torch.zeros(2), "b": torch.zeros(3)})
    back = T.unflatten(vec, spec)
    vec[3] = 5.0
    assert back["b"][1].item() == 5.0


def test_flatten_is_differentiable():
    a = torch.ones(2, requires_grad=True)
    b = torch.ones(3, dtype=torch.float64, requires_grad=True)
    vec, _ = T.flatten({"a": a, "b": b})
    (vec * torch.arange(5.0, dtype=torch.float64)).sum().backward()
    assert torch.equal(a.grad, torch.tensor([0.0, 1.0]))
    assert torch.equal(b.grad, torch.tensor([2.0, 3.0, 4.0], dtype=torch.float64))


def test_flatten_meta_device_alone_is_fine():
    vec, spec = T.flatten({"a": torch.empty(2, 3, device="meta")})
    assert vec.device.type == "meta" and vec.shape == (6,)
    assert T.unflatten(vec, spec)["a"].shape == (2, 3)


class TiedLM(_models.TiedLM):
    """With a buffer (trees hold parameters only)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(1))


def test_from_module_tied_embedding_once_at_first_path():
    model = TiedLM()
    tree = T.from_module(model)
    assert T.paths(tree) == ["embed.weight", "body.weight", "body.bias"]
    assert tree["embed"]["weight"] is model.embed.weight
    assert isinstance(tree["body"]["bias"], nn.Parameter)
    assert "head" not in tree
    assert T.paths(tree) == [n for n, _ in model.named_parameters()]
    vec, spec = T.flatten(tree)
    assert spec.numel == sum(p.numel() for p in model.parameters())


def test_from_module_with_buffers():
    model = TiedLM()
    tree = T.from_module(model, buffers=True)
    # each module's buffers after its own parameters, before its children (state_dict's order)
    assert T.paths(tree) == ["scale", "embed.weight", "body.weight", "body.bias"]
    assert tree["scale"] is model.scale


def test_from_module_block_used_twice():
    block = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3))
    model = nn.Sequential(block, block)
    tree = T.from_module(model)
    assert T.paths(tree) == ["0.0.weight", "0.0.bias", "0.1.weight", "0.1.bias"]
    assert "1" not in tree
    assert tree["0"]["1"]["weight"] is block[1].weight


def test_from_module_rejects_non_module():
    with pytest.raises(TypeError, match="nn.Module"):
        T.from_module({"a": torch.ones(1)})


def test_from_flat_dict_accepts_pairs_and_keeps_order():
    a, b, c = torch.ones(1), torch.ones(2), torch.ones(3)
    tree = T.from_flat_dict(iter([("x.b", b), ("y", c), ("x.a", a)]))
    assert list(tree) == ["x", "y"] and list(tree["x"]) == ["b", "a"]
    assert tree["x"]["a"] is a


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------

def test_map_missing_path_is_named():
    x = {"a": torch.ones(1), "b": {"c": torch.ones(1), "d": torch.ones(1)}}
    y = {"a": torch.ones(1), "b": {"c": torch.ones(1)}}
    with pytest.raises(ValueError, match=r"rest\[0\] \(tree number 2, counting `tree` as 1\) has no leaf at 'b\.d'"):
        T.map(torch.add, x, y)


def test_map_extra_path_is_named():
    x = {"a": torch.ones(1)}
    y = {"a": torch.ones(1)}
    z = {"a": torch.ones(1), "e": {"f": torch.ones(1)}}
    with pytest.raises(ValueError, match=r"rest\[1\] \(tree number 3, counting `tree` as 1\) has an extra leaf at 'e\.f'"):
        T.map(lambda *ts: ts[0], x, y, z)


def test_map_result_must_be_tensor_or_none():
    with pytest.raises(TypeError, match="'a'"):
        T.map(lambda x: 3, {"a": torch.ones(1)})


@pytest.mark.parametrize("length", [0, 4, 6])
def test_unflatten_wrong_length(length):
    _, spec = T.flatten({"a": torch.ones(5)})
    with pytest.raises(ValueError, match=rf"{length} elements.*needs 5"):
        T.unflatten(torch.zeros(length), spec)


def test_unflatten_not_1d():
    _, spec = T.flatten({"a": torch.ones(2, 2)})
    with pytest.raises(ValueError, match=r"1-D with 4 elements; got 2-D"):
        T.unflatten(torch.zeros(2, 2), spec)


def test_unflatten_needs_a_spec():
    with pytest.raises(TypeError, match="TreeSpec"):
        T.unflatten(torch.zeros(1), [("a", (1,))])


def test_flatten_mixed_devices_named():
    tree = {"a": torch.ones(1), "b": {"c": torch.empty(1, device="meta")}}
    with pytest.raises(ValueError, match=r"'a' is on cpu, 'b\.c' is on meta"):
        T.flatten(tree)


@pytest.mark.parametrize("fn", [T.paths, T.leaves, T.to_flat_dict, T.flatten,
                                lambda t: T.map(lambda x: x, t), lambda t: T.reduce(lambda a, x: a, t, 0)])
@pytest.mark.parametrize("bad", [[1, 2], 3, "text", (torch.ones(1),)])
def test_bad_leaf_type_names_path(fn, bad):
    with pytest.raises(TypeError, match=re.escape("'x.y'") + ".*" + type(bad).__name__):
        fn({"x": {"y": bad}})


def test_root_must_be_a_dict():
    with pytest.raises(TypeError, match="root"):
        T.paths(torch.ones(1))


@pytest.mark.parametrize("key", [1, ("a",), "a..b", ".a", ""])
def test_bad_keys_named(key):
    with pytest.raises(ValueError, match=re.escape(repr(key))):
        T.paths({"top": {key: torch.ones(1)}})
    with pytest.raises(ValueError, match=re.escape(repr(key))):
        T.flatten({key: torch.ones(1)})


@pytest.mark.parametrize("pairs, named", [
    ([("a", 1), ("a.b", 2)], ("'a'", "'a.b'")),
    ([("a.b", 2), ("a", 1)], ("'a.b'", "'a'")),
    ([("x.a.b.c", 1), ("x.a", 2)], ("'x.a.b.c'", "'x.a'")),
    ([("x.a", 1), ("x.a.b.c", 2)], ("'x.a'", "'x.a.b.c'")),
])
def test_conflicting_flat_paths_named(pairs, named):
    pairs = [(p, torch.full((1,), float(v))) for p, v in pairs]
    with pytest.raises(ValueError, match="conflicting paths") as info:
        T.from_flat_dict(pairs)
    assert all(n in str(info.value) for n in named)


def test_from_flat_dict_duplicates_and_bad_paths():
    one = torch.ones(1)
    with pytest.raises(ValueError, match="duplicate path 'a.b'"):
        T.from_flat_dict([("a.b", one), ("a.b", one)])
    for bad in ["a..b", ".a", "a.", ""]:
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            T.from_flat_dict({bad: one})
    with pytest.raises(ValueError, match="7"):
        T.from_flat_dict({7: one})
    with pytest.raises(TypeError, match="'a.b'.*list"):
        T.from_flat_dict({"a.b": [1.0]})
