"""The prose of README.md and docs/*.md, and the public docstrings, read as promises.

The code blocks of the docs already run (tests/test_docs.py); this file checks the sentences
around them, one claim per test, grouped by page, each with the claim quoted. It also checks
that every name, argument and option the docs mention exists with that spelling and
signature, and that every public name is documented somewhere in docs/.

A test marked ``xfail(strict=True)`` reproduces a case where behaviour and docs disagree; its
reason quotes the claim and says what happens.
"""
import asyncio
import inspect
import io
import math
import pathlib
import re
import threading
import warnings

import pytest
import torch
from torch import nn

import torchstruct as ts
from _flags import NEEDS_NAMED_OPTIM
from _models import holders

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
README = DOCS.parent / "README.md"


def doc_text():
    return "\n".join(p.read_text(encoding="utf-8") for p in sorted(DOCS.glob("*.md")))


def seq():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 3), nn.LayerNorm(3), nn.Linear(3, 1))


def flags(m):
    return [p.requires_grad for p in m.parameters()]


def tied():
    emb = nn.Embedding(10, 4)
    out = nn.Linear(4, 10, bias=False)
    out.weight = emb.weight
    return nn.ModuleDict({"emb": emb, "out": out})


def raises_naming(exc, *names):
    """pytest.raises that also checks each name appears quoted in the message."""
    class _Ctx:
        def __enter__(self):
            self.cm = pytest.raises(exc)
            self.info = self.cm.__enter__()
            return self.info

        def __exit__(self, *a):
            out = self.cm.__exit__(*a)
            msg = str(self.info.value)
            for n in names:
                assert n in msg, f"{n!r} not in {msg!r}"
            return out
    return _Ctx()


# ---------------------------------------------------------------------------------------------
# cross-references: names, signatures, every public name documented
# ---------------------------------------------------------------------------------------------

def public_names():
    names = [n for n in dir(ts) if not n.startswith("_") and not inspect.ismodule(getattr(ts, n))]
    names += [f"tree.{n}" for n in ts.tree.__all__]
    names += [f"optim.{n}" for n in ts.optim.__all__]
    return names


@pytest.mark.parametrize("name", public_names())
def test_every_public_name_is_named_in_the_docs(name):
    # brief: every public name is documented somewhere in docs/ (by name, not only through a
    # generated `::: module` directive)
    short = name.split(".")[-1]
    assert re.search(rf"\b{re.escape(short)}\b", doc_text()), name


@pytest.mark.parametrize("call, params", [
    # docs/selecting.md: "ts.select(model, *selectors, strict=True)"
    (ts.select, ["model", "selectors", "strict"]),
    # docs/groups.md table: "ts.param_groups(model, *rules, weight_decay=None, no_decay="auto",
    # strict=True)" and "ts.layer_decay(model, decay, *, layers=None)"
    (ts.param_groups, ["model", "rules", "weight_decay", "no_decay", "strict"]),
    (ts.layer_decay, ["model", "decay", "layers"]),
    # docs/clipping.md: "ts.clip_by_global_norm(params, max_norm, norm_type=2.0,
    # error_if_nonfinite=False)" ("foreach= is accepted and ignored")
    (ts.clip_by_global_norm, ["params", "max_norm", "norm_type", "error_if_nonfinite", "foreach"]),
    (ts.clip_grad_norm_, ["params", "max_norm", "norm_type", "error_if_nonfinite", "foreach"]),
    # docs/checkpoint.md: "ts.load_state_dict(model, state, *, strict=True, buffers=True)"
    (ts.load_state_dict, ["model", "state", "strict", "buffers"]),
    (ts.state_dict, ["model", "buffers"]),
    # docs/structural.md: "ts.value_and_grad(fn, model, *args, has_aux=False, wrt=None)"
    (ts.value_and_grad, ["fn", "model", "args", "has_aux", "wrt"]),
    (ts.structural_grad, ["model", "loss", "wrt", "retain_graph", "create_graph"]),
    # docs/structural.md: "ts.map_trainable(f, model, *trees)", "ts.polyak_update(target,
    # source, tau)"
    (ts.map_trainable, ["f", "model", "trees"]),
    (ts.polyak_update, ["target", "source", "tau"]),
    # docs/schedule.md: "ts.UnfreezeSchedule(model, milestones)", "with strict=True"
    (ts.UnfreezeSchedule, ["model", "milestones", "strict", "freeze_norm_stats"]),
    # docs/freezing.md: "ts.attach(module, freeze_norm_stats=False)", "max_depth"
    (ts.attach, ["model", "freeze_norm_stats"]),
    (ts.summary, ["model", "max_depth"]),
    (ts.freeze, ["model", "selectors", "strict", "freeze_norm_stats"]),
    (ts.freeze_except, ["model", "selectors", "strict", "freeze_norm_stats"]),
    (ts.unfreeze, ["model", "selectors", "strict", "freeze_norm_stats"]),
    # docs/trees.md: "ts.tree.map(f, tree, *rest)", "from_module ... buffers=True"
    (ts.tree.map, ["f", "tree", "rest"]),
    (ts.tree.from_module, ["model", "buffers"]),
])
def test_documented_signatures(call, params):
    sig = inspect.signature(call)
    assert [p for p in params if p not in sig.parameters] == []


def test_optimizer_signatures_as_documented():
    # docs/optimizers.md text block: SGD(params, lr=1e-3, momentum=0, dampening=0,
    # weight_decay=0, nesterov=False, *, maximize=False, masks=None, max_grad_norm=None,
    # norm_type=2.0); AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
    # amsgrad=False, *, ...)
    sgd = inspect.signature(ts.optim.SGD).parameters
    assert (sgd["lr"].default, sgd["momentum"].default, sgd["dampening"].default,
            sgd["weight_decay"].default, sgd["nesterov"].default) == (1e-3, 0, 0, 0, False)
    adamw = inspect.signature(ts.optim.AdamW).parameters
    assert (adamw["lr"].default, adamw["betas"].default, adamw["eps"].default,
            adamw["weight_decay"].default, adamw["amsgrad"].default) == (
                1e-3, (0.9, 0.999), 1e-8, 1e-2, False)
    for p in ("maximize", "masks", "max_grad_norm", "norm_type"):
        assert sgd[p].kind is inspect.Parameter.KEYWORD_ONLY
        assert adamw[p].kind is inspect.Parameter.KEYWORD_ONLY
    assert adamw["norm_type"].default == 2.0 and adamw["max_grad_norm"].default is None


def test_lower_level_ops_named_by_the_docs_exist():
    # docs/clipping.md: "torchstruct._ops.clip_by_global_norm_(grads, max_norm, norm_type)" and
    # "torchstruct._ops.scale_(tensors, scale)"; docs/api.md: "compiled_device_types()",
    # "use_backend(name)"
    from torchstruct import _ops
    g = [torch.tensor([3.0, 4.0])]
    assert float(_ops.clip_by_global_norm_(g, 1.0, 2.0)) == 5.0
    t = [torch.ones(2)]
    _ops.scale_(t, torch.tensor(2.0))
    assert torch.equal(t[0], torch.full((2,), 2.0))
    assert isinstance(_ops.compiled_device_types(), (list, tuple, set, frozenset))
    assert callable(_ops.use_backend)


def test_files_named_by_the_docs_exist():
    # docs/index.md and docs/performance.md name files of the repository
    root = DOCS.parent
    for f in ("torchstruct/select.py", "torchstruct/_state.py", "torchstruct/_reference.py",
              "torchstruct/_dtensor.py", "benchmarks/bench_structural_grad.py",
              "benchmarks/RESULTS.md", "examples/finetune.py", "tests/test_distributed.py",
              "tests/test_fsdp.py", "tests/test_compile.py", "tests/test_compiled_step.py",
              "tests/test_amp.py", "run.sh"):
        assert (root / f).exists(), f
    for name in ("bench_clip",):
        assert (root / "benchmarks" / f"{name}.py").exists()


# ---------------------------------------------------------------------------------------------
# docs/selecting.md
# ---------------------------------------------------------------------------------------------

def test_select_glob_is_case_sensitive():
    # "glob (`fnmatch`, case-sensitive) over parameter paths and module paths"
    m = seq()
    with pytest.raises(ValueError):
        ts.select(m, "0.WEIGHT")
    assert ts.select(m, "0.WEIGHT", strict=False) == []


def test_select_regex_fullmatches_parameter_paths_only():
    # "`re.compile(...)`: parameters whose path the regex `fullmatch`es" (not module paths, not
    # a prefix search)
    m = seq()
    assert ts.select(m, re.compile(r"0"), strict=False) == []
    assert [p for p, _ in ts.select(m, re.compile(r"0\.w"), strict=False)] == []
    assert [p for p, _ in ts.select(m, re.compile(r"0\..*"))] == ["0.weight", "0.bias"]


def test_select_returns_named_parameters_order_whatever_the_selector_order():
    # "returns `(path, parameter)` pairs in `named_parameters()` order"
    m = seq()
    assert [p for p, _ in ts.select(m, "2.bias", "0")] == ["0.weight", "0.bias", "2.bias"]
    assert [p for p, _ in ts.select(m, "0", "0.weight")] == ["0.weight", "0.bias"]


def test_select_regex_matching_nothing_raises_naming_closest():
    # "A string or regex that matches nothing raises `ValueError` naming the closest existing
    # paths"
    with raises_naming(ValueError, "'2.weight'"):
        ts.select(seq(), re.compile(r"2\.wieght"))


def test_select_foreign_module_or_parameter_raises():
    # "A module or parameter that is not part of the model is an error too"
    m = seq()
    with pytest.raises(ValueError):
        ts.select(m, nn.Linear(2, 2))
    with pytest.raises(ValueError):
        ts.select(m, nn.Parameter(torch.zeros(1)))


def test_select_callable_matching_nothing_is_empty_not_an_error():
    # "A callable that matches nothing is not an error: it is a predicate, not a name."
    assert ts.select(seq(), lambda path, p: False) == []


def test_select_parameterless_module_name_raises_and_strict_false_allows_it():
    # "so is a name or module object that selects only modules without parameters"
    m = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    with pytest.raises(ValueError):
        ts.select(m, "1")
    with pytest.raises(ValueError):
        ts.select(m, m[1])
    assert ts.select(m, "1", strict=False) == []
    before = flags(m)
    with pytest.raises(ValueError):
        ts.freeze_except(m, "1")
    assert flags(m) == before


def test_select_tied_by_later_path_and_by_regex():
    # "it is selected when any of its paths is selected, and it is returned once, at its first
    # path"
    t = tied()
    assert [p for p, _ in ts.select(t, "out.weight")] == ["emb.weight"]
    assert [p for p, _ in ts.select(t, re.compile(r"out\.weight"))] == ["emb.weight"]
    assert [p for p, _ in ts.select(t, lambda path, p: path == "out.weight")] == ["emb.weight"]
    assert [p for p, _ in ts.select(t, "emb", "out")] == ["emb.weight"]


# ---------------------------------------------------------------------------------------------
# docs/freezing.md
# ---------------------------------------------------------------------------------------------

def test_declaration_is_not_overridden_by_unfreeze():
    # "A declaration only ever turns flags off, and no context overrides it (`unfreeze`
    # included)"
    lin = nn.Linear(2, 2)
    ts.mark_trainable(lin, "bias")
    with ts.unfreeze(lin):
        assert flags(lin) == [False, True]
        assert not ts.is_trainable(lin, "weight")
    ts.mark_trainable(lin, None)
    assert flags(lin) == [True, True]


def test_trainable_parameters_tied_once_and_is_trainable_by_any_path():
    # "`ts.trainable_parameters(model)` yields `(path, param)` for all of them, tied parameters
    # once"; "`ts.is_trainable(model, path_or_param)` answers for one parameter"
    t = tied()
    assert [p for p, _ in ts.trainable_parameters(t)] == ["emb.weight"]
    with ts.freeze(t, "out"):
        assert not ts.is_trainable(t, "emb.weight") and not ts.is_trainable(t, "out.weight")
        assert not ts.is_trainable(t, t.emb.weight)
    with raises_naming(ValueError, "'out.weight'"):
        ts.is_trainable(t, "out.wieght")


def test_bad_input_to_contexts_changes_nothing():
    # "Bad input (an unknown selector, a module that is not part of the model, an empty list
    # of selectors) raises before anything changes: `ts.freeze_except(m, [])` never freezes
    # the whole model silently."
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    for bad in ((["0", "nope"],), ("0", nn.Linear(1, 1)), ([],)):
        for ctx in (ts.freeze, ts.freeze_except, ts.unfreeze):
            with pytest.raises((ValueError, TypeError)):
                ctx(m, *bad)
            assert flags(m) == [True] * 4


def test_reading_installs_no_hook_on_a_model_never_attached():
    # "Reading changes nothing. ... they install no hook and write no flag"; "A model
    # torchstruct never attached stays plain PyTorch"; summary "is read-only"
    m = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    list(ts.trainable_parameters(m))
    ts.is_trainable(m, "0.weight")
    str(ts.summary(m))
    assert all(not mod._forward_pre_hooks and not mod._forward_hooks for mod in m.modules())


def test_detach_hooks_removes_every_hook():
    # "`ts.detach_hooks(model)` removes every hook."
    m = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    with ts.freeze(m, "1"):
        m(torch.randn(4, 2))
    ts.detach_hooks(m)
    for mod in m.modules():
        assert not mod._forward_pre_hooks and not mod._forward_hooks, mod
    assert m.__class__ is nn.Sequential


def test_attach_returns_the_model():
    # docs/coming_from.md: "a = ts.attach(Adapter())"
    m = nn.Linear(2, 2)
    assert ts.attach(m) is m
    ts.detach_hooks(m)


def test_async_generator_decorator_raises_type_error():
    # "Decorating an async generator function raises `TypeError`"
    m = nn.Linear(2, 2)

    async def agen():
        yield 1

    with pytest.raises(TypeError):
        ts.freeze(m)(agen)


def test_async_function_decorator_applies_around_resumptions():
    # "An `async def` function ... the context applies while its body runs, around each
    # resumption, so other tasks running between its `await`s see the flags as they are
    # outside it."
    m = nn.Linear(2, 2)
    seen = []

    @ts.freeze(m)
    async def body():
        seen.append(m.weight.requires_grad)
        await asyncio.sleep(0)
        seen.append(m.weight.requires_grad)

    async def other():
        await asyncio.sleep(0)
        seen.append(("other", m.weight.requires_grad))

    async def main():
        await asyncio.gather(body(), other())

    asyncio.run(main())
    assert seen[0] is False and ("other", True) in seen and m.weight.requires_grad


def test_summary_max_depth_zero_shows_root_only():
    # "`max_depth` hides deeper rows ...: `0` shows the root only"
    m = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    s = ts.summary(m, max_depth=0)
    assert len(s.rows) == 1 and s.counts == (12, 12)


def test_bare_context_returns_object_with_exit():
    # "A bare call returns the context object; `ctx.__exit__(None, None, None)` lifts it later."
    m = nn.Linear(2, 2)
    ctx = ts.freeze(m)
    assert isinstance(ctx, ts.freeze) and not m.weight.requires_grad
    ctx.__exit__(None, None, None)
    assert m.weight.requires_grad


def test_restored_flags_warning_is_a_warning():
    # "a `ts.RestoredFlagsWarning` names the parameters the exit turns back on"
    assert issubclass(ts.RestoredFlagsWarning, Warning)


# ---------------------------------------------------------------------------------------------
# docs/trees.md
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fn", [ts.tree.paths, ts.tree.leaves, ts.tree.to_flat_dict,
                                ts.tree.flatten, lambda t: ts.tree.map(lambda x: x, t)])
def test_tree_key_and_leaf_rules(fn):
    # docs/trees.md said "Keys are non-empty strings without "." (else `ValueError` naming the
    # key)"; the code (and ts.tree's module docstring) takes a dotted key as the nested keys it
    # joins, which docs/index.md promises ("a flat dict keyed by dotted paths is taken too").
    # The page now says so; checked here: dotted keys are paths, an empty component or a
    # duplicate path raises ValueError naming the key, a non-tensor leaf raises TypeError
    # naming its path, a non-dict root raises TypeError.
    assert ts.tree.leaves({"x": {"a.b": torch.ones(1)}})[0].shape == (1,)
    with raises_naming(ValueError, "'a..b'"):
        fn({"x": {"a..b": torch.ones(1)}})
    with pytest.raises(ValueError):
        fn({"": torch.ones(1)})
    with raises_naming(ValueError, "'a.b'"):
        fn({"a.b": torch.ones(1), "a": {"b": torch.ones(1)}})
    with raises_naming(TypeError, "x.y"):
        fn({"x": {"y": [1.0]}})
    with raises_naming(TypeError, "x.y"):
        fn({"x": {"y": 3}})
    with pytest.raises(TypeError):
        fn([torch.ones(1)])


def test_tree_paths_docstring_on_dotted_keys():
    # ts.tree.paths's docstring: "Raises: ValueError: a key is not a non-empty string without
    # "."" -- a dotted key is accepted (a flat dict), as the module docstring says.
    assert ts.tree.paths({"a.b": torch.ones(1)}) == ["a.b"]


def test_tree_none_leaf_is_absent_and_builders_create_no_empty_dicts():
    # "A `None` leaf means *absent* ... Empty dicts hold no leaves; functions that build trees
    # never create them."
    t = {"a": {"x": None}, "b": torch.ones(1)}
    assert ts.tree.paths(t) == ["b"]
    assert ts.tree.to_flat_dict(t) == {"b": t["b"]}
    assert ts.tree.from_flat_dict([("a.x", None), ("b", t["b"])]) == {"b": t["b"]}
    assert ts.tree.map(lambda x: x, t) == {"b": t["b"]}
    assert ts.tree.reduce(lambda acc, x: acc + 1, t, 0) == 1
    vec, spec = ts.tree.flatten(t)
    assert spec.paths == ("b",)


def test_tree_map_rest_must_have_same_paths():
    # "The trees in `rest` must have exactly the same paths ...; otherwise `ValueError` names
    # the first missing or extra path."
    a = {"x": torch.ones(1)}
    with raises_naming(ValueError, "'y'"):
        ts.tree.map(torch.add, a, {"x": torch.ones(1), "y": torch.ones(1)})
    with raises_naming(ValueError, "'x'"):
        ts.tree.map(torch.add, a, {"x": None})


def test_tree_flatten_empty_and_promotion():
    # "an empty tree gives an empty float32 vector"; "int64 + fp32 gives fp32"
    vec, spec = ts.tree.flatten({})
    assert vec.dtype == torch.float32 and vec.shape == (0,) and spec.numel == 0
    vec, _ = ts.tree.flatten({"i": torch.tensor([1]), "f": torch.tensor([0.5])})
    assert vec.dtype == torch.float32


def test_tree_flatten_devices_and_sparse():
    # "All leaves must be on one device, else `ValueError` names two paths and their devices;
    # a sparse leaf ... raises `TypeError` naming its path."
    with raises_naming(ValueError, "a", "b", "meta"):
        ts.tree.flatten({"a": torch.ones(1), "b": torch.ones(1, device="meta")})
    with raises_naming(TypeError, "s"):
        ts.tree.flatten({"s": torch.eye(2).to_sparse()})


def test_tree_flatten_is_differentiable():
    # "The vector is a `torch.cat` of the leaves, so it is differentiable with respect to them."
    w = torch.ones(2, requires_grad=True)
    vec, _ = ts.tree.flatten({"w": w})
    vec.sum().backward()
    assert torch.equal(w.grad, torch.ones(2))


def test_tree_unflatten_view_when_dtypes_agree_and_shape_errors():
    # "a view of the vector when the dtypes agree, a copy otherwise"; "A vector that is not
    # 1-D ... raises `ValueError` giving both numbers"
    vec, spec = ts.tree.flatten({"a": torch.ones(2, 2), "b": torch.zeros(3)})
    back = ts.tree.unflatten(vec, spec)
    assert back["a"].data_ptr() == vec.data_ptr()
    with pytest.raises(ValueError):
        ts.tree.unflatten(vec.reshape(7, 1), spec)


def test_tree_spec_is_frozen():
    # "`spec` is a frozen `ts.tree.TreeSpec`"
    _, spec = ts.tree.flatten({"a": torch.ones(1)})
    assert isinstance(spec, ts.tree.TreeSpec)
    with pytest.raises(AttributeError):
        spec.numel = 3
    import dataclasses
    leaf = spec.entries[0]
    # "`LeafSpec(path, shape, dtype, offset, alias_of)`"
    assert isinstance(leaf, ts.tree.LeafSpec)
    assert [f.name for f in dataclasses.fields(leaf)] == ["path", "shape", "dtype", "offset",
                                                          "alias_of"]
    with pytest.raises(AttributeError):
        leaf.offset = 1


def test_tree_from_module_buffers_follow_each_modules_parameters():
    # docs/trees.md said "`buffers=True` adds the buffers after the parameters": in a nested
    # tree a module's buffers sit in its own dict, after its parameters but before the next
    # module's (depth-first order); the page now says so.
    m = nn.Sequential(nn.BatchNorm1d(2), nn.Linear(2, 2))
    paths = ts.tree.paths(ts.tree.from_module(m, buffers=True))
    assert paths == ["0.weight", "0.bias", "0.running_mean", "0.running_var",
                     "0.num_batches_tracked", "1.weight", "1.bias"]


def test_index_flat_dicts_taken_wherever_trees_are():
    # docs/index.md: "Wherever a tree ... is taken, a flat dict keyed by dotted paths is taken
    # too (`{"0.weight": t}`): `swap`, `polyak_update`, `clip_by_global_norm`, `global_norm`,
    # `map_trainable` and `ts.tree.*`."
    net = nn.Sequential(nn.Linear(2, 2))
    flat = {k: v.detach().clone() for k, v in net.named_parameters()}
    x = torch.randn(3, 2)
    with ts.swap(net, {"0.weight": torch.zeros(2, 2)}):
        torch.testing.assert_close(net(x), net[0].bias.detach().expand(3, 2))
    ts.polyak_update(net, flat, 0.5)
    assert float(ts.global_norm({"0.weight": torch.tensor([3.0]), "0.bias": torch.tensor([4.0])})) == 5.0
    g = {"0.weight": torch.ones(2, 2), "0.bias": torch.ones(2)}
    ts.clip_by_global_norm(g, 1.0)
    assert math.isclose(float(ts.global_norm(g)), 1.0, rel_tol=1e-4)
    assert ts.tree.paths(ts.map_trainable(lambda p, t: t, net, flat)) == ["0.weight", "0.bias"]
    assert ts.tree.paths(flat) == ["0.weight", "0.bias"]
    assert ts.tree.paths(ts.tree.map(lambda t: t, flat)) == ["0.weight", "0.bias"]


# ---------------------------------------------------------------------------------------------
# docs/structural.md
# ---------------------------------------------------------------------------------------------

def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def test_structural_flags_restored_when_callable_raises():
    # "every flag is restored afterwards, also when the callable raises"; no .grad written
    m = mlp()
    m[0].bias.requires_grad_(False)

    def boom(model):
        model(torch.randn(2, 4)).sum()
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        ts.structural_grad(m, boom, wrt="0.bias")
    assert flags(m) == [True, False, True, True]
    assert all(p.grad is None for p in m.parameters())


def test_structural_retain_graph_defaults_to_create_graph():
    # "`retain_graph` defaults to `create_graph`, as in `torch.autograd.grad`"
    m = mlp()
    loss = m(torch.randn(3, 4)).pow(2).sum()
    ts.structural_grad(m, loss)
    with pytest.raises(RuntimeError):
        ts.structural_grad(m, loss)
    loss = m(torch.randn(3, 4)).pow(2).sum()
    g = ts.structural_grad(m, loss, create_graph=True)
    ts.structural_grad(m, loss)                    # graph kept
    assert g["0"]["weight"].requires_grad


def test_structural_frozen_wrt_with_tensor_loss_names_path_and_changes_nothing():
    # "One that does not require grad now raises `ValueError` naming its path"; "Errors leave
    # everything as it was"
    m = mlp()
    with ts.freeze(m, "2.bias"):
        loss = m(torch.randn(3, 4)).sum()
        with raises_naming(ValueError, "'2.bias'"):
            ts.structural_grad(m, loss, wrt="2")
        assert flags(m) == [True, True, True, False]
    with raises_naming(ValueError, "'2.weight'"):
        ts.structural_grad(m, m(torch.randn(3, 4)).sum(), wrt="2.wieght")


def test_structural_wrt_selecting_no_parameter_raises():
    # "so does a `wrt` that selects no parameter at all (a module without parameters, a
    # callable that is False everywhere)"
    m = mlp()
    with pytest.raises(ValueError):
        ts.structural_grad(m, lambda mm: mm(torch.randn(2, 4)).sum(), wrt=lambda p, t: False)
    with pytest.raises(ValueError):
        ts.structural_grad(m, lambda mm: mm(torch.randn(2, 4)).sum(), wrt=m[1])


def test_structural_callable_wrt_keeps_other_flags_off_during_forward():
    # "the forward runs with exactly the asked parameters requiring grad (every other parameter
    # of the model has `requires_grad=False` for the duration of the call"
    m = mlp()
    seen = []

    def loss(model):
        seen.append(flags(model))
        return model(torch.randn(2, 4)).sum()

    ts.structural_grad(m, loss, wrt="2.weight")
    assert seen == [[False, False, True, False]] and all(flags(m))


def test_value_and_grad_value_detached_and_aux_as_is():
    # "`value` is detached; `aux` is returned as it is."
    m = mlp()
    aux_obj = object()
    (value, aux), g = ts.value_and_grad(lambda mm, x: (mm(x).sum(), aux_obj), m,
                                        torch.randn(2, 4), has_aux=True)
    assert value.grad_fn is None and not value.requires_grad and aux is aux_obj
    value2, _ = ts.value_and_grad(lambda mm, x: mm(x).sum(), m, torch.randn(2, 4))
    assert value2.dim() == 0


def test_grad_tree_only_trainable_and_present():
    # "`ts.grad_tree(model)`: the `.grad` tensors PyTorch accumulated for the trainable
    # parameters, as a tree (the tensors themselves; `None` grads absent)"
    m = mlp()
    m(torch.randn(2, 4)).sum().backward()
    m[2].bias.grad = None
    with ts.freeze(m, "0"):
        gt = ts.grad_tree(m)
    assert ts.tree.paths(gt) == ["2.weight"]
    assert gt["2"]["weight"] is m[2].weight.grad


def test_map_trainable_errors_and_frozen_leaves_ignored():
    # "its leaves at frozen paths are ignored. A tree without a leaf at a trainable path, or
    # with a leaf at a path that is no parameter of the model, raises `ValueError` naming the
    # path"; "`f` may return `None` to leave a path out"
    m = mlp()
    full = ts.tree.map(torch.zeros_like, ts.tree.from_module(m))
    with ts.freeze(m, "0"):
        out = ts.map_trainable(lambda p, t: t, m, full)
        assert ts.tree.paths(out) == ["2.weight", "2.bias"]
        part = {"2": {"weight": torch.zeros(2, 8)}}
        with raises_naming(ValueError, "'2.bias'"):
            ts.map_trainable(lambda p, t: t, m, part)
        extra = dict(ts.tree.to_flat_dict(full), **{"9.weight": torch.zeros(1)})
        with raises_naming(ValueError, "'9.weight'"):
            ts.map_trainable(lambda p, t: t, m, extra)
        assert ts.map_trainable(lambda p, t: None, m, full) == {}


def test_polyak_update_checks_everything_first():
    # "Everything is checked before anything is written: `tau` outside [0, 1], a missing path,
    # or a shape/dtype/device mismatch raises `ValueError` and changes nothing."
    target = mlp()
    before = [p.detach().clone() for p in target.parameters()]
    src = {k: v.detach() + 1 for k, v in target.named_parameters()}
    cases = [dict(src, **{"2.bias": src["2.bias"].double()}),
             dict(src, **{"2.bias": torch.zeros(3)}),
             {k: v for k, v in src.items() if k != "2.bias"},
             dict(src, **{"2.bias": torch.zeros(2, device="meta")})]
    for bad in cases:
        with pytest.raises(ValueError):
            ts.polyak_update(target, bad, 0.5)
        assert all(torch.equal(p, b) for p, b in zip(target.parameters(), before))
    for tau in (-0.1, 1.1, float("nan")):
        with raises_naming(ValueError, "tau"):
            ts.polyak_update(target, src, tau)
    ts.polyak_update(target, src, 1.0)
    assert all(torch.equal(p, src[k]) for k, p in target.named_parameters())
    assert not any(p.grad_fn for p in target.parameters())


def test_polyak_update_tied_once():
    # "It is ... updated once by `ts.polyak_update`"
    t, s = tied(), tied()
    before = t.emb.weight.detach().clone()
    ts.polyak_update(t, s, 0.5)
    torch.testing.assert_close(t.emb.weight, 0.5 * before + 0.5 * s.emb.weight)


# ---------------------------------------------------------------------------------------------
# docs/stop_gradient.md
# ---------------------------------------------------------------------------------------------

def test_blocks_change_no_module_attribute_and_undo_when_raising():
    # "They change no flag and no module attribute"; "undo also when the block raises"
    net = nn.Linear(2, 1)
    w = net.weight
    for ctx in (lambda: ts.stop_gradient(net), lambda: ts.constant(net),
                lambda: ts.swap(net, {"weight": torch.zeros(1, 2)})):
        with pytest.raises(RuntimeError, match="boom"):
            with ctx():
                assert net.weight is w
                raise RuntimeError("boom")
        assert net.weight is w and w.requires_grad
        net(torch.ones(1, 2)).sum().backward()
        assert w.grad is not None
        w.grad = None
        with torch.no_grad():
            w.add_(0.0)                                # constant undone too


def test_blocks_validate_before_changing_anything():
    # "They validate their input first (a bad selector or tree changes nothing)"
    net = nn.Linear(2, 1)
    for bad in (lambda: ts.stop_gradient(net, "nope"), lambda: ts.constant(net, "nope"),
                lambda: ts.swap(net, {"weight": torch.zeros(2, 2)})):
        with pytest.raises(ValueError):
            bad()
        net(torch.ones(1, 2)).sum().backward()
        assert net.weight.grad is not None
        net.weight.grad = None


def test_bare_stop_gradient_exited_out_of_order_removes_only_itself():
    # "A `stop_gradient` or `swap` block may be exited in any order: a bare one exited while a
    # later block is open removes only itself."
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    first = ts.stop_gradient(net, "0")
    with ts.stop_gradient(net, "1"):
        first.__exit__(None, None, None)
        net(torch.ones(1, 2)).sum().backward()
    assert net[0].weight.grad is not None and net[1].weight.grad is None


def test_blocks_are_thread_local():
    # "Blocks are thread-local: a block acts in the thread that entered it, and exiting it in
    # another thread raises."
    net = nn.Linear(2, 1)
    got = {}

    def other():
        net(torch.ones(1, 2)).sum().backward()
        got["grad"] = net.weight.grad is not None
        try:
            ctx.__exit__(None, None, None)
        except Exception as e:  # noqa: BLE001
            got["exit"] = e

    ctx = ts.stop_gradient(net)
    try:
        t = threading.Thread(target=other)
        t.start()
        t.join()
    finally:
        ctx.__exit__(None, None, None)
    assert got["grad"] and isinstance(got.get("exit"), Exception)


def test_stop_gradient_tied_any_path_blocks_all_uses():
    # "selecting any path of a tied parameter blocks the one object at all its uses"
    t = tied()
    bias = torch.zeros(4, requires_grad=True)
    with ts.stop_gradient(t, "out"):
        h = t.emb(torch.tensor([1, 2])) + bias
        t.out(torch.tanh(h)).sum().backward()
    assert t.emb.weight.grad is None and bias.grad is not None


def test_stop_gradient_optimizer_step_inside_block_works():
    # "`p.grad` is still the parameter's own gradient (an optimizer step inside the block
    # works)"
    net = nn.Linear(2, 1)
    net(torch.ones(1, 2)).sum().backward()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    before = net.weight.detach().clone()
    with ts.stop_gradient(net):
        assert net.weight.grad is not None
        opt.step()
    assert not torch.equal(net.weight, before)


@pytest.mark.parametrize("write", ["out", "data", "detach", "foreach", "view", "rebind"])
def test_constant_catches_every_documented_write(write):
    # "in-place methods, `p[0] = 1`, writes through `.data`, `.detach()` or views, `out=`
    # arguments, `torch._foreach_*_`"; "Rebinding `p.data = other` ... raises too"
    net = nn.Linear(3, 2)
    w = net.weight
    before = w.detach().clone()
    with ts.constant(net, "weight"):
        with raises_naming(RuntimeError, "'weight'"):
            with torch.no_grad():
                if write == "out":
                    torch.add(before, 1.0, out=w)
                elif write == "data":
                    w.data.mul_(2)
                elif write == "detach":
                    w.detach().zero_()
                elif write == "foreach":
                    torch._foreach_add_([w], 1.0)
                elif write == "view":
                    w.view(-1)[0] = 5.0
                else:
                    w.data = torch.zeros(2, 3)
    assert torch.equal(w, before)


def test_constant_allows_reads_and_grad_accumulation():
    # "Reads, out-of-place ops, gradient accumulation into `.grad` and writes to unselected
    # parameters pass."
    net = nn.Linear(3, 2)
    with ts.constant(net):
        net(torch.ones(1, 3)).sum().backward()
        net(torch.ones(1, 3)).sum().backward()
    assert torch.equal(net.bias.grad, torch.full((2,), 2.0))


def test_swap_errors_name_the_path():
    # "A path that is not a parameter, a non-canonical path of a tied parameter, or a
    # shape/dtype/layout/device mismatch raises `ValueError` naming the path"
    bn = nn.Sequential(nn.BatchNorm1d(2))
    with raises_naming(ValueError, "'0.running_mean'"):
        ts.swap(bn, {"0.running_mean": torch.zeros(2)})
    with raises_naming(ValueError, "'out.weight'"):
        ts.swap(tied(), {"out": {"weight": torch.zeros(10, 4)}})
    lin = nn.Linear(2, 2)
    for bad in (torch.zeros(2, 2, dtype=torch.float64), torch.zeros(2, 2, device="meta"),
                torch.zeros(2, 2).to_sparse()):
        with raises_naming(ValueError, "'weight'"):
            ts.swap(lin, {"weight": bad})


def test_swap_attribute_writes_go_to_the_parameter():
    # "attribute *writes* (`p.requires_grad = ...`, `p.grad = None`) and the methods that write
    # a flag ... (`p.requires_grad_()`, `model.requires_grad_(False)`) still go to the
    # parameter"; "`named_parameters()` ... return the original objects"
    lin = nn.Linear(2, 2)
    w = lin.weight
    with ts.swap(lin, {"weight": torch.zeros(2, 2)}):
        assert dict(lin.named_parameters())["weight"] is w
        lin.requires_grad_(False)
    assert not w.requires_grad and not lin.bias.requires_grad
    lin.requires_grad_(True)


def test_swap_plain_state_dict_holds_the_stand_in_values():
    # "a plain `model.state_dict()` ... holds the stand-ins' values"
    lin = nn.Linear(2, 2)
    with ts.swap(lin, {"weight": torch.full((2, 2), 7.0)}):
        sd = lin.state_dict()
        kv = lin.state_dict(keep_vars=True)
    assert torch.equal(sd["weight"], torch.full((2, 2), 7.0)) and kv["weight"] is lin.weight


def test_within_gradient_modes():
    # "False under `no_grad` and `inference_mode`"; "a dual tensor keeps its tangent under
    # `no_grad`, so `within_gradient` is True for it there (False under `inference_mode`)";
    # modules: any parameter
    x = torch.ones(2, requires_grad=True)
    assert ts.within_gradient(x) and not ts.within_gradient(torch.ones(2))
    with torch.no_grad():
        assert not ts.within_gradient(x)
    with torch.inference_mode():
        assert not ts.within_gradient(x)
    import torch.autograd.forward_ad as fwAD
    with fwAD.dual_level():
        d = fwAD.make_dual(torch.ones(2), torch.ones(2))
        assert ts.within_gradient(d)
        with torch.no_grad():
            assert ts.within_gradient(d)
    lin = nn.Linear(2, 2)
    lin.weight.requires_grad_(False)
    assert ts.within_gradient(lin)                  # the bias still requires grad
    lin.bias.requires_grad_(False)
    assert not ts.within_gradient(lin)


# ---------------------------------------------------------------------------------------------
# docs/clipping.md
# ---------------------------------------------------------------------------------------------

def test_clip_foreach_accepted_and_ignored():
    # "`foreach=` is accepted and ignored"
    for foreach in (True, False, None):
        hs = holders([torch.tensor([3.0, 4.0])])
        assert float(ts.clip_by_global_norm(hs, 1.0, foreach=foreach)) == 5.0


def test_clip_parameter_listed_twice_counted_and_scaled_twice():
    # "a parameter listed twice is counted twice and scaled twice", "exactly as
    # `clip_grad_norm_` takes it"
    ours, theirs = holders([torch.tensor([3.0, 4.0])]), holders([torch.tensor([3.0, 4.0])])
    a = ts.clip_by_global_norm([ours[0], ours[0]], 1.0)
    b = torch.nn.utils.clip_grad_norm_([theirs[0], theirs[0]], 1.0)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(ours[0].grad, theirs[0].grad)


def test_clip_tree_tensor_at_two_paths_once():
    # "a tree ...: its leaf tensors themselves, in place; a tensor held at several paths once"
    g = torch.tensor([3.0, 4.0])
    total = ts.clip_by_global_norm({"a": g, "b": g, "c": None}, 1.0)
    assert float(total) == 5.0
    torch.testing.assert_close(g, torch.tensor([0.6, 0.8]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("p", [1.0, 3.0, 0.5, float("inf")])
def test_clip_norm_types_match_torch(p):
    # "`norm_type`: 1, 2, `inf` or any p > 0"; "same returned total norm ..., same clipped
    # gradients"
    torch.manual_seed(0)
    grads = [torch.randn(5), torch.randn(2, 3)]
    ours, theirs = holders(grads), holders(grads)
    a = ts.clip_by_global_norm(ours, 0.1, norm_type=p)
    b = torch.nn.utils.clip_grad_norm_(theirs, 0.1, norm_type=p)
    torch.testing.assert_close(a, b)
    for h, t in zip(ours, theirs):
        torch.testing.assert_close(h.grad, t.grad)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan")])
def test_clip_bad_norm_type_is_value_error(bad):
    # "`norm_type`: 1, 2, `inf` or any p > 0 (`ValueError` otherwise)"
    hs = holders([torch.tensor([3.0, 4.0])])
    with pytest.raises(ValueError):
        ts.clip_by_global_norm(hs, 1.0, norm_type=bad)
    assert torch.equal(hs[0].grad, torch.tensor([3.0, 4.0]))


def test_clip_nan_max_norm_and_bad_entries():
    # "`max_norm < 0` (or NaN): `ValueError`"; "Sparse gradients, integer or complex
    # gradients, a non-tensor entry: `TypeError` naming the entry. A gradient whose elements
    # share memory (an expanded tensor): `RuntimeError`." ... "all gradients are bitwise
    # unchanged"
    good = holders([torch.tensor([3.0, 4.0])])[0]
    with pytest.raises(ValueError):
        ts.clip_by_global_norm([good], float("nan"))
    with pytest.raises(TypeError):
        ts.clip_by_global_norm([good, 3.0], 1.0)
    for bad_grad in (torch.tensor([1, 2]), torch.tensor([1j]), torch.eye(2).to_sparse()):
        if bad_grad.is_complex():
            p = nn.Parameter(torch.zeros(1, dtype=torch.complex64))
        elif bad_grad.is_sparse:
            p = nn.Parameter(torch.zeros(2, 2))
        else:
            p = torch.zeros(2, dtype=torch.int64)
        p.grad = bad_grad
        with pytest.raises(TypeError):
            ts.clip_by_global_norm([good, p], 1.0)
        assert torch.equal(good.grad, torch.tensor([3.0, 4.0]))
    p = nn.Parameter(torch.zeros(2, 3))
    p.grad = torch.ones(3).expand(2, 3)
    with pytest.raises(RuntimeError):
        ts.clip_by_global_norm([good, p], 1.0)
    assert torch.equal(good.grad, torch.tensor([3.0, 4.0]))


def test_clip_inf_norm_zeroes_finite_elements_as_torch():
    # "an inf norm zeroes the finite elements" (as in torch)
    ours = holders([torch.tensor([float("inf"), 1.0])])
    theirs = holders([torch.tensor([float("inf"), 1.0])])
    a = ts.clip_by_global_norm(ours, 1.0)
    b = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    assert math.isinf(float(a)) and math.isinf(float(b))
    assert float(ours[0].grad[1]) == 0.0 == float(theirs[0].grad[1])


def test_clip_returned_dtype_is_the_promotion():
    # "fp16 alone gives fp16, fp16 with bf16 gives fp32"; fp64 accumulates in fp64
    h = holders([torch.ones(2, dtype=torch.float16), torch.ones(2, dtype=torch.bfloat16)])
    assert ts.clip_by_global_norm(h, 1.0).dtype == torch.float32
    h = holders([torch.ones(2, dtype=torch.float16)])
    assert ts.clip_by_global_norm(h, 1.0).dtype == torch.float16
    h = holders([torch.ones(2, dtype=torch.float64), torch.ones(2)])
    assert ts.clip_by_global_norm(h, 1.0).dtype == torch.float64


def test_clip_inf_norm_of_empty_gradient_contributes_nothing():
    # "torch refuses the inf-norm of an empty gradient; here it contributes nothing."
    h = holders([torch.zeros(0), torch.tensor([2.0])])
    assert float(ts.clip_by_global_norm(h, 10.0, norm_type=float("inf"))) == 2.0


def test_clip_fp16_norm_overflow_exact_and_clipped():
    # "when those per-tensor fp16 norms overflow ... here the total is exact (returned as
    # `inf` if it does not fit in fp16 ...) and the gradients are clipped, not zeroed"
    h = holders([torch.full((4,), 60000.0, dtype=torch.float16)])
    total = ts.clip_by_global_norm(h, 1.0)
    assert math.isinf(float(total))
    assert float(h[0].grad.float().norm()) == pytest.approx(1.0, rel=1e-2)


def test_global_norm_docstring_dtype_and_empty():
    # global_norm's docstring: "A 0-dim tensor (float32, or float64 when any input is float64;
    # fp16/bf16 accumulate in fp32) ...; `tensor(0.)` when there is nothing."
    assert ts.global_norm([torch.ones(2, dtype=torch.float16)]).dtype == torch.float32
    assert ts.global_norm([torch.ones(2, dtype=torch.float64)]).dtype == torch.float64
    z = ts.global_norm([])
    assert z.dim() == 0 and float(z) == 0.0
    assert float(ts.global_norm({})) == 0.0


def test_global_norm_of_module_reads_trainable_grads():
    # README quick start / docs/coming_from.md: `ts.global_norm(model)` is the norm of the
    # gradients of the trainable parameters, a tied one once
    t = tied()
    t.out(t.emb(torch.tensor([1, 2]))).sum().backward()
    torch.testing.assert_close(ts.global_norm(t), t.emb.weight.grad.norm())


# ---------------------------------------------------------------------------------------------
# docs/checkpoint.md
# ---------------------------------------------------------------------------------------------

def ck_model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3), nn.Linear(3, 1))
    m.register_buffer("scratch", torch.zeros(1), persistent=False)
    return m


def test_checkpoint_shares_storage_and_loads_with_plain_pytorch():
    # "The tensors share storage with the model"; "the result also loads with plain
    # `model.load_state_dict(state, strict=False)`"
    m = ck_model()
    ts.freeze(m, "0")
    sd = ts.state_dict(m)
    assert sd["2.weight"].data_ptr() == m[2].weight.data_ptr()
    assert "0.weight" not in sd and "scratch" not in sd
    fresh = ck_model()
    res = fresh.load_state_dict({k: v + 1 for k, v in sd.items()}, strict=False)
    assert res.unexpected_keys == []


def test_checkpoint_load_checks_dtype_unknown_and_nonpersistent_keys():
    # "every key is a path of a parameter ... or a persistent buffer"; "same shape and dtype
    # ... (no silent cast)"; "All problems are listed in one `ValueError`"; nothing written
    m = ck_model()
    sd = {k: v.clone() + 1 for k, v in ts.state_dict(m).items()}
    before = {k: v.clone() for k, v in m.state_dict().items()}
    bad = dict(sd, **{"2.weight": sd["2.weight"].double(), "scratch": torch.zeros(1)})
    with raises_naming(ValueError, "'2.weight'", "'scratch'"):
        ts.load_state_dict(m, bad)
    meta = dict(sd, **{"2.bias": torch.zeros(1, device="meta")})
    with raises_naming(ValueError, "'2.bias'"):
        ts.load_state_dict(m, meta)
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())


def test_checkpoint_load_any_tied_path_and_returns_incompatible_keys():
    # "any of a tied parameter's paths"; "It returns `IncompatibleKeys(missing_keys,
    # unexpected_keys)`"; "Flags are not part of a checkpoint and are not touched"
    t = tied()
    ts.freeze(t, "emb")
    got = ts.load_state_dict(t, {"out.weight": torch.ones(10, 4)}, strict=False)
    assert torch.equal(t.emb.weight, torch.ones(10, 4))
    assert got.missing_keys == [] and got.unexpected_keys == []
    assert not t.emb.weight.requires_grad


def test_checkpoint_strict_missing_key_raises_and_buffers_false():
    # "with `strict=True`, every key that `ts.state_dict(model, buffers=buffers)` gives *now*
    # must be present"; "A checkpoint saved with `buffers=False` loads with `buffers=False`."
    m = ck_model()
    sd = ts.state_dict(m)
    with raises_naming(ValueError, "2.bias"):
        ts.load_state_dict(m, {k: v for k, v in sd.items() if k != "2.bias"})
    nob = ts.state_dict(m, buffers=False)
    assert "1.running_mean" not in nob
    with pytest.raises(ValueError):
        ts.load_state_dict(m, nob)
    ts.load_state_dict(m, nob, buffers=False)


def test_checkpoint_parameterless_norm_buffers_in_and_container_buffers_out():
    # "every normalization layer that tracks running statistics and has no parameters ... a
    # container module's buffers are not"
    m = nn.Sequential(nn.BatchNorm1d(2, affine=False), nn.Linear(2, 2))
    m.register_buffer("step", torch.zeros(1))
    keys = list(ts.state_dict(m))
    assert "0.running_mean" in keys and "step" not in keys


# ---------------------------------------------------------------------------------------------
# docs/schedule.md
# ---------------------------------------------------------------------------------------------

def sched_model():
    return nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2), "head": nn.Linear(2, 1)})


def test_schedule_no_milestone_at_zero_freezes_everything():
    # "with no milestone at 0, everything is frozen until the first one"
    m = sched_model()
    s = ts.UnfreezeSchedule(m, {2: "head"})
    assert not any(flags(m)) and s.stage == 0
    s.step()
    s.step()
    assert [n for n, p in m.named_parameters() if p.requires_grad] == ["head.weight", "head.bias"]
    s.close()
    assert all(flags(m))


def test_schedule_star_means_everything_and_selectors_none():
    # "`None` or `"*"` means everything"; "`schedule.selectors` (what trains now: a tuple,
    # `None` for everything)"; "`schedule.milestones` (the sorted steps)"
    m = sched_model()
    s = ts.UnfreezeSchedule(m, {3: "*", 0: "head"})
    assert tuple(s.milestones) == (0, 3)
    assert isinstance(s.selectors, tuple)
    for _ in range(3):
        s.step()
    assert all(flags(m)) and s.selectors is None
    s.close()


def test_schedule_state_dict_shape_and_mismatched_milestones():
    # "`state_dict()` is `{"step": ..., "milestones": [...]}`; `load_state_dict()` on a
    # schedule built with the same milestones"
    m = sched_model()
    s = ts.UnfreezeSchedule(m, {0: "head", 2: "b"})
    s.step()
    assert s.state_dict() == {"step": 1, "milestones": [0, 2]}
    before = flags(m)
    with pytest.raises(ValueError):
        s.load_state_dict({"step": 3, "milestones": [0, 5]})
    assert flags(m) == before and s.current_step == 1
    s.close()


@pytest.mark.parametrize("bad", [{-1: "head"}, {1.5: "head"}, {"0": "head"}])
def test_schedule_milestone_steps_are_integers_ge_zero(bad):
    # "`milestones` maps a step (an integer >= 0) to selectors"
    m = sched_model()
    with pytest.raises((ValueError, TypeError)):
        ts.UnfreezeSchedule(m, bad)
    assert all(flags(m))


def test_schedule_keeps_hand_frozen_after_none():
    # "A parameter frozen by PEFT, by hand or by a declaration ... stays frozen even after
    # `None`."
    m = sched_model()
    m["a"].bias.requires_grad_(False)
    ts.mark_trainable(m["b"], "bias")
    s = ts.UnfreezeSchedule(m, {0: "head", 1: None})
    s.step()
    assert [n for n, p in m.named_parameters() if not p.requires_grad] == ["a.bias", "b.weight"]
    s.close()
    ts.mark_trainable(m["b"], None)


# ---------------------------------------------------------------------------------------------
# docs/groups.md
# ---------------------------------------------------------------------------------------------

class GNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.encoder = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        self.head = nn.Linear(4, 2)


def test_param_groups_every_parameter_once_frozen_and_tied_included():
    # "Every parameter of the model lands in exactly one group"; "a tied parameter once";
    # "frozen parameters too"; "Empty groups are left out"; "unique "name""
    m = GNet()
    m.head.weight = nn.Parameter(torch.zeros(2, 4))
    m.out = nn.Linear(4, 10, bias=False)
    m.out.weight = m.embed.weight
    with ts.freeze(m, "encoder"):
        groups = ts.param_groups(m, ("head", {"lr": 1.0}), ("out", {"lr": 2.0}))
    ids = [id(p) for g in groups for p in g["params"]]
    assert sorted(ids) == sorted({id(p) for p in m.parameters()}) and len(ids) == len(set(ids))
    assert all(g["params"] for g in groups)
    names = [g["name"] for g in groups]
    assert len(names) == len(set(names))
    by = {g["name"]: g["param_names"] for g in groups}
    assert by["out"] == ["embed.weight"]              # a rule selecting any of its paths


def test_param_groups_option_checks():
    # "`params` / `param_names` are refused and a key that looks like a typo of a known one
    # (`weight_decy`, `lr_scal`) raises; `lr`, `lr_scale` and `weight_decay` must be finite
    # numbers `>= 0` (a one-element tensor ... is kept as given)"
    m = GNet()
    for bad in ({"params": []}, {"param_names": []}, {"weight_decy": 0.1}, {"lr_scal": 2.0},
                {"lr": -1.0}, {"lr": float("nan")}, {"lr_scale": float("inf")},
                {"weight_decay": -0.1}):
        with pytest.raises(ValueError):
            ts.param_groups(m, ("head", bad))
    lr = torch.tensor(0.01)
    g = ts.param_groups(m, ("head", {"lr": lr, "my_key": 3}))
    assert g[0]["lr"] is lr and g[0]["my_key"] == 3


def test_param_groups_weight_decay_none_leaves_the_key_out():
    # "a part that decays (`weight_decay=` of the call, or the optimizer's default when
    # `None`)"
    g = ts.param_groups(GNet())
    decaying = [x for x in g if "no decay" not in x["name"]]
    assert decaying and all("weight_decay" not in x for x in decaying)
    opt = torch.optim.AdamW(g, weight_decay=0.3)
    assert opt.param_groups[0]["weight_decay"] == 0.3


def test_no_decay_auto_biases_by_name():
    # "biases: parameters whose last path component is `bias`, `*_bias` or `bias_*`
    # (`nn.LSTM`'s `bias_ih_l0`, `nn.MultiheadAttention`'s `in_proj_bias`)"
    m = nn.ModuleDict({"lstm": nn.LSTM(2, 2), "mha": nn.MultiheadAttention(4, 2)})
    no = {n for g in ts.param_groups(m, weight_decay=0.1) if g["weight_decay"] == 0.0
          for n in g["param_names"]}
    assert no == {"lstm.bias_ih_l0", "lstm.bias_hh_l0", "mha.in_proj_bias", "mha.out_proj.bias"}


@pytest.mark.parametrize("cls, norm", [
    ("LlamaRMSNorm", True), ("T5LayerNorm", True), ("LayerNorm2d", True), ("GroupNorm32", True),
    ("FrozenBatchNorm2d", True), ("NemotronLayerNorm1P", True), ("MambaRMSNormGated", True),
    ("Normalize", False), ("NormLayer", False), ("Block", False)])
def test_is_norm_by_class_name(cls, norm):
    # "any class whose name ends in `Norm`, optionally followed by digits, `<digits>d`,
    # `<digits>P` or `Gated`"
    module = type(cls, (nn.Module,), {})()
    assert ts.is_norm(module) is norm


def test_is_norm_torch_classes_and_subclasses():
    # "PyTorch's norm classes and their subclasses (`BatchNorm*`, `SyncBatchNorm`,
    # `InstanceNorm*`, `LayerNorm`, `GroupNorm`, `LocalResponseNorm`, `RMSNorm`)"
    for m in (nn.BatchNorm2d(2), nn.SyncBatchNorm(2), nn.InstanceNorm1d(2), nn.LayerNorm(2),
              nn.GroupNorm(1, 2), nn.LocalResponseNorm(2), nn.RMSNorm(2),
              type("MyLN", (nn.LayerNorm,), {})(2)):
        assert ts.is_norm(m), m
    assert not ts.is_norm(nn.Linear(2, 2))


def test_no_decay_parametrized_bias_read_as_bias():
    # "a parameter moved by `torch.nn.utils.parametrize` (`m.parametrizations.bias.original`)
    # is read as the one it stands for (`m.bias`)"
    import torch.nn.utils.parametrize as P

    class Id(nn.Module):
        def forward(self, x):
            return x

    m = nn.Sequential(nn.Linear(2, 2))
    P.register_parametrization(m[0], "bias", Id())
    no = {n for g in ts.param_groups(m, weight_decay=0.1) if g["weight_decay"] == 0.0
          for n in g["param_names"]}
    assert no == {"0.parametrizations.bias.original"}


def test_no_weight_decay_str_refused_and_glob_relative():
    # "a single str is refused rather than read letter by letter"; "glob patterns (`"*.gamma"`
    # ...), relative to the module that defines it"
    m = GNet()
    m.encoder.no_weight_decay = lambda: "0"
    with pytest.raises((TypeError, ValueError)):
        ts.param_groups(m, weight_decay=0.1)
    m.encoder.no_weight_decay = lambda: ["*.weight"]
    no = {n for g in ts.param_groups(m, weight_decay=0.1) if g["weight_decay"] == 0.0
          for n in g["param_names"]}
    assert {"encoder.0.weight", "encoder.1.weight"} <= no and "head.weight" not in no


def test_rule_with_weight_decay_not_split_and_no_decay_selector_strict():
    # "A rule that sets `weight_decay` itself is not split"; "`no_decay=` a selector ... a
    # selector that selects nothing raises unless `strict=False`"; "`no_decay=None` decays
    # everything"
    m = GNet()
    g = ts.param_groups(m, ("head", {"weight_decay": 0.2}), weight_decay=0.1)
    assert [x["name"] for x in g][0] == "head" and g[0]["param_names"] == ["head.weight", "head.bias"]
    with pytest.raises(ValueError):
        ts.param_groups(m, no_decay="nope")
    ts.param_groups(m, no_decay="nope", strict=False)
    assert [x["name"] for x in ts.param_groups(m, weight_decay=0.1, no_decay=None)] == ["default"]


def test_rule_selecting_nothing_strict_false():
    # "A rule that selects nothing raises ...; `strict=False` allows it."
    m = GNet()
    with pytest.raises(ValueError):
        ts.param_groups(m, ("nope", {"lr": 1.0}))
    assert ts.param_groups(m, ("nope", {"lr": 1.0}), strict=False)


def test_add_param_group_from_param_groups():
    # "e.g. `opt.add_param_group(ts.param_groups(new_part)[0])` or `{"params": [p],
    # "param_names": ["new.weight"]}`"
    m = GNet()
    opt = ts.optim.AdamW(ts.param_groups(m), lr=1e-3)
    opt.add_param_group(ts.param_groups(nn.Linear(2, 2))[0])
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(1))], "param_names": ["new.weight"]})
    assert len(opt.param_groups) == 4               # default, default (no decay), two added


def test_lr_scale_one_is_bitwise_plain_step():
    # "`lr_scale=1` is bitwise the plain step"
    torch.manual_seed(0)
    a = nn.Linear(3, 3)
    b = nn.Linear(3, 3)
    b.load_state_dict(a.state_dict())
    oa = ts.optim.AdamW([{"params": a.parameters(), "lr_scale": 1.0}], lr=1e-2)
    ob = ts.optim.AdamW(b.parameters(), lr=1e-2)
    for _ in range(3):
        x = torch.randn(2, 3)
        for net, opt in ((a, oa), (b, ob)):
            opt.zero_grad()
            net(x).pow(2).sum().backward()
            opt.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_lr_scale_bad_value_later_raises_at_step_before_writing():
    # "a bad value raises `ValueError` at construction, or at the next `step()` before
    # anything is written"
    lin = nn.Linear(2, 2)
    with pytest.raises(ValueError):
        ts.optim.SGD([{"params": lin.parameters(), "lr_scale": -1.0}], lr=0.1)
    opt = ts.optim.SGD(lin.parameters(), lr=0.1)
    lin(torch.ones(1, 2)).sum().backward()
    before = [p.detach().clone() for p in lin.parameters()]
    opt.param_groups[0]["lr_scale"] = float("nan")
    with pytest.raises(ValueError):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(lin.parameters(), before))


@pytest.mark.parametrize("decay", [0.0, -0.5, 1.5, float("nan")])
def test_layer_decay_range(decay):
    # "`decay` must be in (0, 1]."
    m = nn.Sequential(nn.Embedding(3, 2), nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    with pytest.raises(ValueError):
        ts.layer_decay(m, decay)


def test_layer_decay_two_stacks_raise_naming_candidates_and_layers_argument():
    # "two stacks side by side ... raises and asks for `layers=`, naming the candidates";
    # "The stack is named with `layers=` (a path ..., or the module)"
    m = nn.ModuleDict({"enc": nn.ModuleList(nn.Linear(2, 2) for _ in range(2)),
                       "dec": nn.ModuleList(nn.Linear(2, 2) for _ in range(3))})
    with raises_naming(ValueError, "layers=", "enc", "dec"):
        ts.layer_decay(m, 0.5)
    by_path = ts.layer_decay(m, 0.5, layers="dec")
    by_module = ts.layer_decay(m, 0.5, layers=m["dec"])
    assert [o for _, o in by_path] == [o for _, o in by_module]
    # ids: enc (before the stack) 0, dec.0-2 1..3, nothing after it
    assert [o["lr_scale"] for _, o in by_path] == [0.5 ** 4, 0.5 ** 3, 0.5 ** 2, 0.5]


# ---------------------------------------------------------------------------------------------
# docs/optimizers.md
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("opt_cls", [ts.optim.SGD, ts.optim.AdamW])
@pytest.mark.parametrize("flag", ["foreach", "fused"])
def test_optim_foreach_fused_not_offered(opt_cls, flag):
    # "**Not offered**: `foreach`, `fused`, `capturable`, `differentiable`": passing one is a
    # TypeError naming it (not silently ignored, unlike clip_by_global_norm's foreach=)
    with raises_naming(TypeError, flag):
        opt_cls(nn.Linear(2, 2).parameters(), **{flag: True})


def test_sgd_bitwise_with_torch_on_cpu():
    # "SGD: bitwise on CPU"
    torch.manual_seed(0)
    a = nn.Linear(5, 3)
    b = nn.Linear(5, 3)
    b.load_state_dict(a.state_dict())
    kw = dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01, maximize=True)
    oa = ts.optim.SGD(a.parameters(), **kw)
    ob = torch.optim.SGD(b.parameters(), foreach=False, **kw)
    for _ in range(5):
        x = torch.randn(4, 5)
        for net, opt in ((a, oa), (b, ob)):
            opt.zero_grad()
            net(x).pow(2).sum().backward()
            opt.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_optim_state_dict_interchangeable_with_torch():
    # "A state dict saved by `torch.optim.AdamW` / `SGD` loads into these optimizers and the
    # other way round"
    lin = nn.Linear(2, 2)
    t = torch.optim.AdamW(lin.parameters(), lr=1e-2)
    lin(torch.ones(1, 2)).sum().backward()
    t.step()
    o = ts.optim.AdamW(lin.parameters(), lr=1e-2)
    o.load_state_dict(t.state_dict())
    o.step()
    assert float(o.state[lin.weight]["step"]) == 2
    back = torch.optim.AdamW(lin.parameters(), lr=1e-2)
    back.load_state_dict(o.state_dict())
    back.step()
    assert float(back.state[lin.weight]["step"]) == 3


def test_optim_negative_lr_set_later_and_max_grad_norm_written_later():
    # "a negative `lr` (also one set later in a param group ...), a negative or NaN
    # `max_grad_norm` (also one written later to `optimizer.max_grad_norm`, checked at
    # `step()`)" leave everything as it was
    lin = nn.Linear(2, 2)
    lin(torch.ones(1, 2)).sum().backward()
    before = [p.detach().clone() for p in lin.parameters()]
    opt = ts.optim.AdamW(lin.parameters(), lr=1e-2)
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError):
        opt.step()
    opt.param_groups[0]["lr"] = 1e-2
    opt.max_grad_norm = float("nan")
    with pytest.raises(ValueError):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(lin.parameters(), before)) and not opt.state


def test_optim_sparse_gradient_runtime_error_naming_parameter():
    # "sparse gradients (a `RuntimeError` naming the parameter)"
    emb = nn.Embedding(4, 2, sparse=True)
    emb(torch.tensor([1])).sum().backward()
    opt = ts.optim.SGD(emb.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


def test_optim_tied_stepped_once():
    # "**Tied or repeated parameters** are stepped once per step"
    t = tied()
    opt = ts.optim.SGD([t.emb.weight, t.out.weight], lr=0.1)
    t.out(t.emb(torch.tensor([1]))).sum().backward()
    expected = t.emb.weight.detach() - 0.1 * t.emb.weight.grad
    opt.step()
    torch.testing.assert_close(t.emb.weight.detach(), expected)


@NEEDS_NAMED_OPTIM
def test_optim_masks_by_path_and_set_mask_none():
    # "Param groups that carry `param_names` (`ts.param_groups`, or `named_parameters()` given
    # to the optimizer) let masks be keyed by path"; "`set_mask(param, mask)` sets or (with
    # `None`) removes a mask later; `optimizer.masks` holds them."
    lin = nn.Linear(2, 2)
    mask = torch.tensor([[True, False], [False, False]])
    opt = ts.optim.SGD(lin.named_parameters(), lr=0.1, masks={"weight": mask})
    assert torch.equal(opt.masks[lin.weight], mask)
    before = lin.weight.detach().clone()
    lin(torch.ones(1, 2)).sum().backward()
    opt.step()
    assert torch.equal(lin.weight[1], before[1]) and not torch.equal(lin.weight[0, 0], before[0, 0])
    opt.set_mask("weight", None)
    assert lin.weight not in opt.masks


def test_optim_last_grad_norm_is_0dim_of_unclipped():
    # "The total norm of the last step (of the unscaled gradients, as a 0-dim tensor) is
    # `optimizer.last_grad_norm`"; "The gradients are never written."
    lin = nn.Linear(2, 2)
    opt = ts.optim.SGD(lin.parameters(), lr=0.1, max_grad_norm=1e-3)
    lin(torch.ones(1, 2)).sum().backward()
    grads = [p.grad.clone() for p in lin.parameters()]
    opt.step()
    assert opt.last_grad_norm.dim() == 0
    torch.testing.assert_close(opt.last_grad_norm, ts.global_norm(grads))
    assert all(torch.equal(p.grad, g) for p, g in zip(lin.parameters(), grads))


def test_adamw_step_is_float32_tensor():
    # "AdamW's `step` is a float32 tensor on the parameter's device"
    lin = nn.Linear(2, 2)
    opt = ts.optim.AdamW(lin.parameters())
    lin(torch.ones(1, 2)).sum().backward()
    opt.step()
    st = opt.state[lin.weight]["step"]
    assert torch.is_tensor(st) and st.dtype == torch.float32 and st.device == lin.weight.device


# ---------------------------------------------------------------------------------------------
# docs/coming_from.md
# ---------------------------------------------------------------------------------------------

def test_polyak_update_is_optax_incremental_update():
    # "`ts.polyak_update` is `optax.incremental_update`": optax's
    # incremental_update(new, old, step_size) = step_size * new + (1 - step_size) * old, with
    # the target (old) first here: polyak_update(target=old, source=new, tau=step_size)
    old, new = nn.Linear(2, 2), nn.Linear(2, 2)
    o = [p.detach().clone() for p in old.parameters()]
    ts.polyak_update(old, new, tau=0.25)
    for p, q, n in zip(old.parameters(), o, new.parameters()):
        torch.testing.assert_close(p.detach(), 0.25 * n.detach() + 0.75 * q)


def test_fastai_freeze_to_negative_index():
    # "`learn.freeze_to(n)` | `ts.freeze_except(model, *groups[n:])`": fastai's freeze_to(-2)
    # trains the last two groups
    net = nn.ModuleDict({"embed": nn.Linear(2, 2), "body": nn.Linear(2, 2), "head": nn.Linear(2, 2)})
    groups = ["embed", "body", "head"]
    with ts.freeze_except(net, *groups[-2:]):
        assert [n for n, p in net.named_parameters() if p.requires_grad] == [
            "body.weight", "body.bias", "head.weight", "head.bias"]


def test_fastai_unfreeze_keeps_other_freezes():
    # "leaving a context restores exactly the previous flags, so parameters frozen by
    # something else (PEFT, a declaration) stay frozen"
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    net[0].bias.requires_grad_(False)
    stage = ts.freeze_except(net, "1")
    stage.__exit__(None, None, None)
    assert flags(net) == [True, False, True, True]


def test_lightning_freeze_row_flags_only():
    # "`with ts.freeze(model):` (flags only; `model.eval()` is separate)"
    net = nn.Sequential(nn.Linear(2, 2), nn.Dropout())
    with ts.freeze(net):
        assert net.training and net[1].training and not any(flags(net))


def test_hf_trainer_decay_names_match_on_bert_gpt2_llama():
    # "(`no_decay="auto"`: ...; the same parameters on BERT, GPT-2 and Llama)" and the row
    # "`Trainer.get_decay_parameter_names(model)` | `[n for g in groups if g["weight_decay"] > 0
    # for n in g["param_names"]]`"
    import os
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    models = [
        transformers.BertModel(transformers.BertConfig(
            vocab_size=20, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=8)),
        transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=1, n_embd=8, n_head=2, vocab_size=20, n_positions=8)),
        transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=20, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=2)),
    ]
    for model in models:
        groups = ts.param_groups(model, weight_decay=0.01)
        ours = {n for g in groups if g["weight_decay"] > 0 for n in g["param_names"]}
        by_obj = dict(model.named_parameters(remove_duplicate=False))
        hf = transformers.Trainer.get_decay_parameter_names(None, model)
        assert {id(by_obj[n]) for n in ours} == {id(by_obj[n]) for n in hf}, type(model).__name__


# ---------------------------------------------------------------------------------------------
# docs/freezing.md: normalization statistics
# ---------------------------------------------------------------------------------------------

def test_norm_frozen_by_hand_keeps_updating():
    # "A layer frozen by someone else (... your own `requires_grad_(False)`) is not
    # torchstruct's: it keeps PyTorch's behaviour and updates its statistics in training mode."
    net = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    ts.attach(net)
    net[1].requires_grad_(False)
    before = net[1].running_mean.clone()
    with ts.freeze(net, "0"):
        net(torch.randn(8, 3))
    assert not torch.equal(net[1].running_mean, before)


def test_norm_context_freeze_norm_stats_false_updates():
    # "Pass `freeze_norm_stats=False` to a context ... to keep PyTorch's plain behaviour."
    net = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    before = net[1].running_mean.clone()
    with ts.freeze(net, freeze_norm_stats=False):
        net(torch.randn(8, 3))
    assert not torch.equal(net[1].running_mean, before)
    before = net[1].running_mean.clone()
    with ts.freeze(net):
        net(torch.randn(8, 3))
        assert net[1].training
    assert torch.equal(net[1].running_mean, before) and net[1].training


def test_norm_partly_frozen_layer_not_held():
    # "While all parameters of a `BatchNorm*` ... are frozen" -- a layer with one parameter
    # still trainable is not held
    net = nn.Sequential(nn.BatchNorm1d(3))
    before = net[0].running_mean.clone()
    with ts.freeze(net, "0.weight"):
        net(torch.randn(8, 3))
    assert not torch.equal(net[0].running_mean, before)


# ---------------------------------------------------------------------------------------------
# README.md and docs/api.md
# ---------------------------------------------------------------------------------------------

def test_backend_values_and_device_forms():
    # docs/api.md: "`ts.backend(device)` answers for one device (a `torch.device`, a string such
    # as `"cuda:0"`, or a tensor)"
    for d in (torch.device("cpu"), "cpu", torch.ones(1), None):
        assert ts.backend(d) in ("compiled", "fallback", "reference")
    assert ts.backend("cuda:0") in ("compiled", "fallback", "reference")


def test_use_backend_restores_on_exit():
    # docs/api.md: "`torchstruct._ops.use_backend(name)` switches inside a `with` block"
    before = ts.backend()
    with ts._ops.use_backend("reference"):
        assert ts.backend() == "reference" and ts.backend("cpu") == "reference"
        h = holders([torch.tensor([3.0, 4.0])])
        assert float(ts.clip_by_global_norm(h, 1.0)) == 5.0
    assert ts.backend() == before


def test_readme_clip_grad_norm_alias():
    # docs/index.md: "`clip_by_global_norm` (also spelled `ts.clip_grad_norm_`)"
    # docs/api.md: "`clip_grad_norm_` is another name of `clip_by_global_norm`"
    assert ts.clip_grad_norm_ is ts.clip_by_global_norm


def test_clip_coefficient_one_leaves_gradients_bitwise():
    # docs/clipping.md: "When the coefficient is exactly 1 (no clipping needed) the multiply is
    # skipped ... the result is identical"
    g = torch.tensor([0.1, 0.2, 0.3])
    h = holders([g])
    total = ts.clip_by_global_norm(h, 10.0)
    assert torch.equal(h[0].grad, g)
    torch.testing.assert_close(total, g.norm())


# ---------------------------------------------------------------------------------------------
# more claims, by page
# ---------------------------------------------------------------------------------------------

def test_structural_parameter_switched_on_after_forward_gets_zeros():
    # docs/structural.md: "A parameter switched on *after* the forward cannot be detected: it
    # gets zeros" (when the loss reaches another asked parameter; alone, it is the
    # "reaches none" ValueError, as the page now says)
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    m[0].weight.requires_grad_(False)
    loss = m(torch.randn(3, 2)).sum()
    m[0].weight.requires_grad_(True)
    g = ts.structural_grad(m, loss, retain_graph=True)
    assert torch.equal(g["0"]["weight"], torch.zeros(2, 2))
    with raises_naming(ValueError, "'0.weight'"):
        ts.structural_grad(m, loss, wrt="0.weight")


def test_summary_flags_tied_parameters_and_reused_modules():
    # docs/freezing.md: "the module tree with trainable/frozen marks, element counts per
    # subtree, tied parameters and reused modules flagged, and the totals"
    emb = nn.Embedding(5, 2)
    head = nn.Linear(2, 5, bias=False)
    head.weight = emb.weight
    blk = nn.Linear(2, 2)
    s = ts.summary(nn.ModuleDict({"emb": emb, "head": head, "a": blk, "b": blk}))
    text = str(s)
    assert "to emb.weight" in text and "to a" in text and s.counts == (16, 16)


def test_schedule_failed_stage_change_leaves_step_and_flags():
    # docs/schedule.md: "A stage change that cannot be applied leaves the schedule, its step
    # and every flag as they were, and raises: with `strict=True`, a selector that no longer
    # matches anything"
    m = nn.ModuleDict({"a": nn.Linear(2, 2), "head": nn.Linear(2, 1)})
    s = ts.UnfreezeSchedule(m, {0: "head", 1: "a"})
    del m["a"]
    before = flags(m)
    with raises_naming(ValueError, "'a'"):
        s.step()
    assert (s.current_step, s.stage) == (0, 1) and flags(m) == before
    s.close()


def test_optim_mask_errors_name_the_parameter():
    # docs/optimizers.md: "A mask of the wrong shape, dtype or device raises `ValueError`
    # naming the parameter, at construction, in `set_mask`, or at `step()`"
    lin = nn.Linear(2, 2)
    opt = ts.optim.SGD(lin.parameters(), lr=0.1)
    for bad in (torch.ones(2, 2), torch.ones(3, dtype=torch.bool),
                torch.ones(2, 2, dtype=torch.bool, device="meta")):
        with raises_naming(ValueError, "parameter 0"):
            opt.set_mask(lin.weight, bad)
    assert not opt.masks


def test_optim_lr_scale_zero_then_positive_starts_fresh():
    # docs/groups.md: "`lr_scale=0` ... no state is created, step counts do not advance ...
    # Setting a positive scale later starts them from a fresh state."
    net = nn.Linear(2, 2)
    opt = ts.optim.AdamW([{"params": [net.weight], "lr_scale": 0.0}, {"params": [net.bias]}],
                         lr=0.1)
    net(torch.ones(1, 2)).sum().backward()
    opt.step()
    assert net.weight not in opt.state
    opt.param_groups[0]["lr_scale"] = 1.0
    opt.step()
    assert float(opt.state[net.weight]["step"]) == 1 and float(opt.state[net.bias]["step"]) == 2


def test_optim_identical_memory_in_one_group_refused():
    # docs/optimizers.md: "Errors leave everything as it was: ... two parameters of one group
    # on the same memory"
    buf = torch.zeros(4)
    p1, p2 = nn.Parameter(buf[:3]), nn.Parameter(buf[:3])
    p1.grad, p2.grad = torch.ones(3), torch.ones(3)
    with pytest.raises(RuntimeError, match="shares its memory"):
        ts.optim.SGD([p1, p2], lr=0.1).step()
    assert torch.equal(buf, torch.zeros(4))


def test_optim_partly_overlapping_parameters_in_one_group_refused():
    buf = torch.zeros(4)
    p1, p2 = nn.Parameter(buf[:3]), nn.Parameter(buf[1:])
    p1.grad, p2.grad = torch.ones(3), torch.ones(3)
    try:
        with pytest.raises(RuntimeError):
            ts.optim.SGD([p1, p2], lr=0.1).step()
    finally:
        assert torch.equal(buf, torch.zeros(4)), buf


def test_constant_exit_under_later_dispatch_mode_raises_and_stays_active():
    # docs/stop_gradient.md: "A `constant` block exited while a dispatch mode entered after it
    # is still open raises and stays active"
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    lin = nn.Linear(2, 2)
    c = ts.constant(lin)
    mode = Passthrough()
    mode.__enter__()
    try:
        with pytest.raises(RuntimeError):
            c.__exit__(None, None, None)
    finally:
        mode.__exit__(None, None, None)
    with raises_naming(RuntimeError, "'weight'"):
        lin.weight.data.add_(1)
    c.__exit__(None, None, None)
    lin.weight.data.add_(0)


def test_within_gradient_true_in_non_reentrant_checkpoint_recompute():
    # docs/stop_gradient.md: "and the recompute of
    # `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`"
    from torch.utils.checkpoint import checkpoint
    seen = []

    def f(t):
        seen.append(ts.within_gradient(t))
        return t * 2

    x = torch.ones(2, requires_grad=True)
    checkpoint(f, x, use_reentrant=False).sum().backward()
    assert seen and all(seen)


def test_checkpoint_inference_mode_model_written_only_inside():
    # docs/checkpoint.md: "a model built under `torch.inference_mode()` is written only inside
    # it"
    with torch.inference_mode():
        im = nn.Linear(2, 2)
    state = {"weight": torch.zeros(2, 2), "bias": torch.zeros(2)}
    with raises_naming(ValueError, "'weight'", "inference_mode"):
        ts.load_state_dict(im, state)
    with torch.inference_mode():
        ts.load_state_dict(im, state)
    assert torch.equal(im.weight, torch.zeros(2, 2))


def test_value_and_grad_pair_needs_has_aux():
    # docs/structural.md: "returns `(value, grads)`, or `((value, aux), grads)` when `fn`
    # returns a pair" -- only with `has_aux=True` (the page now says so): a pair without it is
    # a TypeError, and has_aux=True with a bare value too
    m = nn.Linear(2, 1)
    x = torch.ones(3, 2)
    with pytest.raises(TypeError):
        ts.value_and_grad(lambda mm: (mm(x).sum(), 1), m)
    with pytest.raises(TypeError):
        ts.value_and_grad(lambda mm: mm(x).sum(), m, has_aux=True)


def test_tree_map_rest_key_order_may_differ():
    # docs/trees.md: "(their key order may differ)"; results follow `tree`'s order
    out = ts.tree.map(lambda a, b: a + b, {"a": torch.ones(1), "b": torch.full((1,), 2.0)},
                      {"b": torch.ones(1), "a": torch.ones(1)})
    assert list(out) == ["a", "b"] and float(out["b"]) == 3.0


def test_checkpoint_non_tensor_value_listed():
    # docs/checkpoint.md: "every value is a tensor ...". "All problems are listed in one
    # `ValueError`."
    m = nn.Linear(2, 1)
    with raises_naming(ValueError, "'weight'", "'bias'"):
        ts.load_state_dict(m, {"weight": 3.0, "bias": torch.zeros(2)})


def test_commands_and_options_named_by_the_docs_exist():
    # docs/performance.md: "python -m benchmarks.bench_structural_grad --write  # --rounds N",
    # "bench_global_norm --write  # --device cuda, --norm-type 1"; README: "bash run.sh example
    # --steps 40 --no-compare --plot /tmp/losses.png", "pip install -e .[docs]", "[test]",
    # "bash run.sh bench"
    root = DOCS.parent
    for mod in re.findall(r"python -m benchmarks\.(\w+)", doc_text() + README.read_text()):
        assert (root / "benchmarks" / f"{mod}.py").exists(), mod
    sg = (root / "benchmarks/bench_structural_grad.py").read_text()
    gn = (root / "benchmarks/bench_global_norm.py").read_text()
    assert "rounds=" in sg and "device=" in gn and "norm_type=" in gn
    ex = (root / "examples/finetune.py").read_text()
    for flag in ("--steps", "--no-compare", "--plot"):
        assert f'"{flag}"' in ex, flag
    cfg = (root / "setup.cfg").read_text()
    for extra in ("test =", "bench =", "docs ="):
        assert extra in cfg
    run = (root / "run.sh").read_text()
    for cmd in ("example)", "test)", "bench)"):
        assert cmd in run


def test_no_kernels_one_warning_per_process_and_device():
    # docs/api.md: "any other device ... runs the fallback, with one `RuntimeWarning` per
    # process and device"; docs/clipping.md and docs/optimizers.md: "one warning per process
    # and device"; `TORCHSTRUCT_NO_KERNELS=cpu` "treats those types as having no compiled
    # kernels"
    import os
    import subprocess
    import sys
    code = (
        "import warnings, torch, torchstruct as ts\n"
        "from torch import nn\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    for _ in range(2):\n"
        "        p = nn.Parameter(torch.ones(3)); p.grad = torch.ones(3)\n"
        "        ts.clip_by_global_norm([p], 0.1); ts.global_norm([p.grad])\n"
        "        ts.optim.AdamW([p]).step(); ts.optim.SGD([p], lr=0.1, momentum=0.9).step()\n"
        "print(ts.backend('cpu'), sum(issubclass(x.category, RuntimeWarning) for x in w))\n")
    env = dict(os.environ, TORCHSTRUCT_NO_KERNELS="cpu", PYTHONPATH=str(DOCS.parent))
    env.pop("TORCHSTRUCT_BACKEND", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    backend, count = out.stdout.split()
    from torchstruct import _ops  # without compiled kernels nothing falls back: no warning
    assert count == ("1" if _ops.compiled_available() else "0")
    assert backend in ("fallback", "reference")


def test_schedule_stage_change_keeps_its_place_among_contexts():
    # docs/schedule.md said: "A stage change enters the new context after every context already
    # active, so it counts as the innermost one ... an `unfreeze` block entered after the
    # schedule and still active at a stage change no longer overrides it from then on." The
    # code puts the new stage where the old one stood (docs/freezing.md: "a schedule's stage
    # change continues the stage it replaces"), so the unfreeze block goes on overriding it
    # until it ends; the page now says so.
    m = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2), "head": nn.Linear(2, 1)})
    s = ts.UnfreezeSchedule(m, {0: "head", 1: "a"})
    with ts.unfreeze(m, "b"):
        assert flags(m) == [False, False, True, True, True, True]
        s.step()
        assert flags(m) == [True, True, True, True, True, True]
    assert flags(m) == [True, True, False, False, True, True]
    s.close()
    assert all(flags(m))


def test_context_on_a_submodule_is_scoped_to_it():
    # docs/freezing.md: "Contexts on a submodule of an attached model are scoped to that
    # submodule."
    m = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), nn.Linear(2, 1))
    ts.attach(m)
    with ts.freeze_except(m[0], "1"):
        assert flags(m) == [False, False, True, True, True, True]
        assert ts.is_trainable(m, "1.weight")
    assert all(flags(m))
    ts.detach_hooks(m)


def test_layer_decay_tied_takes_first_path_id():
    # docs/groups.md: "A tied parameter takes the id of its first path"
    class T(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(5, 2)
            self.blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))
            self.head = nn.Linear(2, 5, bias=False)
            self.head.weight = self.emb.weight

    t = T()
    scale = {n: g["lr_scale"] for g in ts.param_groups(t, *ts.layer_decay(t, 0.5))
             for n in g["param_names"]}
    assert scale["emb.weight"] == 0.5 ** 3 and "head.weight" not in scale


def test_parameters_leaving_the_model_get_their_starting_flag_back():
    # docs/freezing.md: "Parameters that leave the model (a module replaced or deleted, also
    # inside a block) get their starting flag back ... at the latest when the block is left"
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    old = m[0]
    with ts.freeze(m):
        m[0] = nn.Linear(2, 2)
    assert flags(old) == [True, True] and all(flags(m))


def test_restored_flags_warning_names_parameters_created_frozen_in_the_block():
    # docs/freezing.md: "The same warning names parameters *created* inside the block with
    # `requires_grad=False` that stay frozen after it: a parametrization such as
    # `torch.nn.utils.parametrizations.weight_norm` copies the flag the block wrote"
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ts.freeze(m, "0"):
            torch.nn.utils.parametrizations.weight_norm(m[0])
    text = " ".join(str(w.message) for w in caught if issubclass(w.category, ts.RestoredFlagsWarning))
    assert "'0.parametrizations.weight.original0'" in text
    assert not m[0].parametrizations.weight.original0.requires_grad


def test_invalid_declaration_inside_block_restores_then_raises():
    # docs/freezing.md: "A declaration that became invalid inside a block ... the exit restores
    # them first -- the invalid declaration admitting the names it still has ... -- and then
    # raises the declaration's error."
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.mlp, self.gate = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)

        def trainable(self):
            return ["mlp", "gate"]

    b = ts.attach(Block())
    with raises_naming(ValueError, "'mlp'"):
        with ts.freeze(b):
            assert not any(flags(b))
            del b.mlp
    assert flags(b) == [False, False, True, True]       # attn declared frozen, gate admitted
    ts.detach_hooks(b)


def test_copy_of_attached_model_is_plain_pytorch():
    # docs/freezing.md: "A copy of an attached model ... the copy's BatchNorm updates its
    # statistics ..., and it behaves as plain PyTorch until it is attached itself"
    import copy
    net = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    stay = ts.freeze(net)
    cp = copy.deepcopy(net)
    before = cp[1].running_mean.clone()
    cp(torch.randn(8, 3))
    assert not torch.equal(cp[1].running_mean, before)
    stay.__exit__(None, None, None)


def test_freeze_norm_stats_choice_survives_detach_and_attach():
    # docs/freezing.md: "attaching a parent later, `ts.detach_hooks` and attaching again keep
    # it"; "a layer built with `momentum=None` is held as any other"
    bb = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    ts.attach(bb, freeze_norm_stats=False)
    ts.detach_hooks(bb)
    ts.attach(nn.Sequential(bb))
    with ts.freeze(bb):
        before = bb[1].running_mean.clone()
        bb(torch.randn(8, 3))
        assert not torch.equal(bb[1].running_mean, before)
    bn = nn.Sequential(nn.BatchNorm1d(3, momentum=None))
    with ts.freeze(bn):
        before = bn[0].running_mean.clone()
        bn(torch.randn(8, 3))
        assert torch.equal(bn[0].running_mean, before)


def test_ddp_rules_single_process():
    # docs/freezing.md: "After wrapping, torchstruct refuses (with a `RuntimeError` that says
    # what to do, changing no flag) ... a parameter that DDP does not synchronize starting to
    # train, or a synchronized one stopping while the wrapper was built with
    # `find_unused_parameters=False`. Freezing after wrapping with
    # `find_unused_parameters=True` works. ... if the model was wrapped inside that context, a
    # `RuntimeWarning` says the wrapper no longer matches."
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        net[0].bias.requires_grad_(False)
        ddp = DDP(net)
        with pytest.raises(RuntimeError, match="find_unused_parameters"):
            ts.freeze(ddp, "module.1")
        assert flags(net) == [True, False, True, True]
        with pytest.raises(RuntimeError):
            ts.unfreeze(ddp, "module.0.bias")
        assert flags(net) == [True, False, True, True]

        net2 = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        ddp2 = DDP(net2, find_unused_parameters=True)
        with ts.freeze(ddp2, "module.1"):
            assert flags(net2) == [True, True, False, False]

        net3 = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with ts.freeze(net3, "1"):
                ddp3 = DDP(net3, find_unused_parameters=True)      # kept alive
        assert any(issubclass(w.category, RuntimeWarning) and "wrap" in str(w.message).lower()
                   for w in caught), [str(w.message) for w in caught]
        del ddp, ddp2, ddp3
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# docstrings of the public functions: Raises / Returns
# ---------------------------------------------------------------------------------------------

def test_select_docstring_errors():
    # select: "ValueError: ... an empty list/tuple of selectors (always, also with
    # strict=False). TypeError: a selector of an unsupported type."
    m = seq()
    for empty in ([], ()):
        with pytest.raises(ValueError):
            ts.select(m, empty, strict=False)
    with pytest.raises(TypeError):
        ts.select(m, 3)


def test_summary_and_attach_docstring_type_errors():
    # summary: "TypeError: `model` is not a module, or `max_depth` not an integer >= 0 or
    # None"; attach: "TypeError: ... `freeze_norm_stats` is neither None nor a bool (nothing
    # changes)"
    m = seq()
    for bad in (-1, 1.5, "2"):
        with pytest.raises(TypeError):
            ts.summary(m, max_depth=bad)
    with pytest.raises(TypeError):
        ts.summary("model")
    with pytest.raises(TypeError):
        ts.attach(m, freeze_norm_stats=1)
    assert not m._forward_pre_hooks


def test_map_trainable_and_polyak_docstring_type_errors():
    # map_trainable: "TypeError: ... `f` returned something that is neither tensor nor None";
    # polyak_update: "TypeError: `target` is not a module, `source` neither module nor tree,
    # or `tau` not a number"
    m = nn.Linear(2, 2)
    with pytest.raises(TypeError):
        ts.map_trainable(lambda p: 1.0, m)
    with pytest.raises(TypeError):
        ts.polyak_update(m, [p.detach() for p in m.parameters()], 0.5)
    with pytest.raises(TypeError):
        ts.polyak_update(m, nn.Linear(2, 2), "0.5")
    with pytest.raises(TypeError):
        ts.polyak_update({"weight": m.weight}, m, 0.5)


def test_swap_docstring_leaf_not_tensor():
    # swap: "TypeError: `model` is not an `nn.Module`, or a leaf is not a tensor."
    lin = nn.Linear(2, 2)
    with pytest.raises(TypeError):
        ts.swap(lin, {"weight": [[0.0, 0.0], [0.0, 0.0]]})
    with pytest.raises(TypeError):
        ts.swap("lin", {})


def test_param_groups_docstring_type_errors():
    # param_groups: "TypeError: a rule that is not a pair, options that are not a dict, a bad
    # selector, a `no_weight_decay()` that returns a str or names that are not str."
    m = GNet()
    with pytest.raises(TypeError):
        ts.param_groups(m, ("head",))
    with pytest.raises(TypeError):
        ts.param_groups(m, ("head", [("lr", 1.0)]))
    with pytest.raises(TypeError):
        ts.param_groups(m, (3, {"lr": 1.0}))
    m.no_weight_decay = lambda: "embed"
    with pytest.raises(TypeError):
        ts.param_groups(m, weight_decay=0.1)
    m.no_weight_decay = lambda: [3]
    with pytest.raises(TypeError):
        ts.param_groups(m, weight_decay=0.1)


def test_layer_decay_docstring_type_error():
    # layer_decay: "TypeError: `decay` not a number, `layers` of a wrong type."
    m = nn.Sequential(nn.Embedding(3, 2), nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    with pytest.raises(TypeError):
        ts.layer_decay(m, "0.5")
    with pytest.raises(TypeError):
        ts.layer_decay(m, 0.5, layers=3)


@pytest.mark.parametrize("milestones, exc", [
    ({}, ValueError), ({-1: "0"}, ValueError), ({0: []}, ValueError),
    ({1.5: "0"}, TypeError), ({"0": "0"}, TypeError), ([(0, "0")], TypeError),
    ({0: 3}, TypeError)])
def test_schedule_docstring_errors(milestones, exc):
    # UnfreezeSchedule: "TypeError: `model` is not a module, `milestones` not a mapping, a
    # step not an integer, or a selector of an unsupported type. ValueError: no milestone, a
    # negative step, an empty selector list, or a selector that matches nothing"
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    with pytest.raises(exc):
        ts.UnfreezeSchedule(m, milestones)
    assert all(flags(m))


def test_state_dict_docstring_detached_and_ordered():
    # state_dict: "`{path: tensor}` (detached, sharing storage with the model), in the order
    # of `model.state_dict()`"
    m = ck_model()
    sd = ts.state_dict(m)
    assert all(not t.requires_grad for t in sd.values())
    order = [k for k in m.state_dict() if k in sd]
    assert list(sd) == order


def test_grad_tree_docstring_inside_stop_gradient():
    # grad_tree: "Inside a `stop_gradient` block the blocked parameters are included as
    # outside it."
    m = nn.Linear(2, 1)
    m(torch.ones(1, 2)).sum().backward()
    with ts.stop_gradient(m):
        assert ts.tree.paths(ts.grad_tree(m)) == ["weight", "bias"]


def test_mark_trainable_docstring_typo_names_closest():
    # mark_trainable: "ValueError: a name that is not a direct parameter or child (with the
    # closest names)"; nothing changes
    lin = nn.Linear(2, 2)
    with raises_naming(ValueError, "'weight'"):
        ts.mark_trainable(lin, "wieght")
    assert flags(lin) == [True, True]


def test_sgd_masked_momentum_buffer_stays_zero():
    # docs/optimizers.md: "SGD with masks: a masked-out element's momentum buffer stays at zero
    # from creation"; masked-out elements bitwise unchanged also with weight decay
    lin = nn.Linear(2, 2, bias=False)
    mask = torch.tensor([[True, False], [True, False]])
    opt = ts.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9, weight_decay=0.5,
                       masks={lin.weight: mask})
    before = lin.weight.detach().clone()
    for _ in range(2):
        opt.zero_grad()
        lin(torch.randn(3, 2)).pow(2).sum().backward()
        opt.step()
    buf = opt.state[lin.weight]["momentum_buffer"]
    assert buf[:, 1].eq(0).all() and buf[:, 0].ne(0).all()
    assert torch.equal(lin.weight[:, 1], before[:, 1])


@pytest.mark.parametrize("opt_fn", [lambda ps: ts.optim.AdamW(ps, lr=0.1),
                                    lambda ps: ts.optim.SGD(ps, lr=0.1, momentum=0.9)])
def test_gradscaler_skipped_first_step_creates_no_state_on_cpu(opt_fn):
    # docs/optimizers.md: "`found_inf` on the CPU is read on the host and a skipped step returns
    # before any state is created"; "an overflowed step creates no buffer"
    lin = nn.Linear(2, 1)
    opt = opt_fn(lin.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale(lin(torch.ones(1, 2)).sum()).backward()
    lin.weight.grad[0, 0] = float("inf")
    before = [p.detach().clone() for p in lin.parameters()]
    scaler.step(opt)
    scaler.update()
    assert not opt.state and all(torch.equal(p, b) for p, b in zip(lin.parameters(), before))


def test_torchstruct_functions_see_the_model_outside_the_stop_gradient_block():
    # docs/stop_gradient.md: "inside a `stop_gradient` or `swap` block ...
    # `ts.trainable_parameters`, `ts.is_trainable`, `ts.summary` ... see the model as it is
    # outside the block, and `ts.optim` steps every trainable parameter that has a gradient.
    # A `copy.deepcopy(model)` ... made inside the block copies the parameters' own flags"
    import copy
    m = nn.Linear(2, 1)
    m(torch.ones(1, 2)).sum().backward()
    opt = ts.optim.SGD(m.parameters(), lr=0.1)
    before = m.weight.detach().clone()
    with ts.stop_gradient(m):
        assert [p for p, _ in ts.trainable_parameters(m)] == ["weight", "bias"]
        assert ts.is_trainable(m, "weight") and ts.summary(m).counts == (3, 3)
        cp = copy.deepcopy(m)
        opt.step()
    assert all(flags(cp)) and not torch.equal(m.weight, before)


def test_structural_grad_inside_stop_gradient_block():
    # docs/structural.md: "a loss computed outside the block gets its usual gradients there,
    # and a callable loss, which runs under the block, reaches a blocked ... parameter only
    # where it is used outside the block (a loss that reaches none of them is the
    # `ValueError` above)"
    m = nn.Linear(2, 1)
    x = torch.ones(3, 2)
    outside = m(x).sum()
    with ts.stop_gradient(m):
        g = ts.structural_grad(m, outside)
        with pytest.raises(ValueError):
            ts.structural_grad(m, lambda mm: mm(x).sum())
    assert torch.equal(g["bias"], torch.tensor([3.0]))


def test_registered_ops_named_by_the_docs():
    # README: "A C++ extension (`torch.ops.torchstruct.*` ...) does the global-norm reductions
    # and fused masked optimizer updates"; docs/optimizers.md: "`torch.ops.torchstruct.sgd_step_`
    # / `adamw_step_`"; docs/clipping.md: "`torch.ops.torchstruct.clip_by_global_norm_`",
    # "`torchstruct._C.clip_grads_`"
    from torchstruct import _ops
    if not _ops.compiled_available():
        pytest.skip("the extension is not built")
    for name in ("clip_by_global_norm_", "sgd_step_", "adamw_step_", "global_norm", "scale_"):
        assert hasattr(torch.ops.torchstruct, name), name
    import torchstruct._C as C
    assert hasattr(C, "clip_grads_")


def test_unregistered_parameter_swap_is_read_at_once_and_written_at_the_next_application():
    # docs/freezing.md said an unregistered swap (`module._parameters[...] = p`) "is seen the
    # next time a context is entered or left or trainability is read"; a read answers for the
    # new parameter at once but writes no flag ("Reading changes nothing"), so its flag stays
    # its own, also across forwards, until a context is entered or left or `ts.attach` runs.
    # The page now says so.
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    c = ts.freeze_except(m, "1")
    newp = nn.Parameter(torch.zeros(2, 2))
    m[0]._parameters["weight"] = newp
    assert not ts.is_trainable(m, "0.weight") and newp.requires_grad
    m(torch.ones(1, 2))
    assert newp.requires_grad
    ts.attach(m)
    assert not newp.requires_grad
    c.__exit__(None, None, None)
    assert newp.requires_grad


def test_context_decides_once_per_parameter_under_renumbering():
    # docs/freezing.md: "a `Sequential` renumbered by `del m[0]` does not move a glob like
    # `"1"` to another layer"; "`load_state_dict(assign=True)`, `to_empty` ... inherits what
    # was decided for the one it replaces"
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    l1, l2 = m[1], m[2]
    with ts.freeze(m, "1"):
        del m[0]
        ts.attach(m)
        assert flags(l1) == [False, False] and flags(l2) == [True, True]
    assert all(flags(l1) + flags(l2))
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    with ts.freeze(m, "0"):
        m.load_state_dict(sd, assign=True)
        assert flags(m) == [False, False, True, True]
    assert all(flags(m))
    with ts.freeze(m, "1"):
        m.to_empty(device="cpu")
        assert flags(m) == [True, True, False, False]
    assert all(flags(m))


def test_t5_relative_attention_bias_decays_here():
    # docs/groups.md: "HF `Trainer` ... also exempts T5's `relative_attention_bias` embedding
    # table, which this rule decays"; T5LayerNorm found by name
    import os
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    t5 = transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=20, d_model=8, d_kv=4, d_ff=8, num_layers=1, num_heads=2))
    groups = ts.param_groups(t5, weight_decay=0.1)
    wd = {n: g["weight_decay"] for g in groups for n in g["param_names"]}
    rel = [n for n in wd if "relative_attention_bias" in n]
    assert rel and all(wd[n] == 0.1 for n in rel)
    assert all(wd[n] == 0.0 for n in wd if "layer_norm" in n)
    hf = set(transformers.Trainer.get_decay_parameter_names(None, t5))
    assert not set(rel) & hf


def test_checkpoint_lazy_parameter_nothing_written():
    # docs/checkpoint.md: "Parameters that are not plain tensors (... lazy parameters) are
    # refused ... rather than written partly"
    m = nn.Sequential(nn.Linear(2, 2), nn.LazyLinear(2))
    before = m[0].weight.detach().clone()
    with pytest.raises(ValueError):
        ts.load_state_dict(m, {"0.weight": torch.zeros(2, 2)}, strict=False)
    assert torch.equal(m[0].weight, before)


def test_checkpoint_lazy_parameter_error_names_the_path():
    m = nn.Sequential(nn.Linear(2, 2), nn.LazyLinear(2))
    with raises_naming(ValueError, "'1.weight'"):
        ts.load_state_dict(m, {"0.weight": torch.zeros(2, 2)}, strict=False)


def test_optimizer_clip_settings_not_in_state_dict():
    # docs/optimizers.md: "`max_grad_norm` and `norm_type` are constructor settings, not part
    # of the state dict"
    lin = nn.Linear(2, 2)
    sd = ts.optim.AdamW(lin.parameters(), max_grad_norm=1.0, norm_type=1.0).state_dict()
    assert "max_grad_norm" not in sd["param_groups"][0] and "norm_type" not in sd["param_groups"][0]
    again = ts.optim.AdamW(lin.parameters())
    again.load_state_dict(sd)
    assert again.max_grad_norm is None and again.norm_type == 2.0


def test_summary_shows_in_a_repl():
    # docs/freezing.md: "`ts.summary(model)` returns (and shows, in a REPL) the module tree"
    s = ts.summary(nn.Linear(2, 2))
    assert repr(s) == str(s) and str(s).endswith("trainable 6 of 6, 100.00%")


def test_structural_grad_ddp_refusals_single_process():
    # docs/structural.md / docs/distributed.md: "On a wrapper built with `static_graph=True` it
    # needs one training step first ...; before that it is refused, changing nothing";
    # "refused ...: a communication hook other than the plain `allreduce_hook` ...
    # (`RuntimeError` ...), and `create_graph=True` (`ValueError`)"
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        x = torch.randn(3, 2)
        net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        d = DDP(net, static_graph=True)
        with pytest.raises(RuntimeError, match="static_graph"):
            ts.structural_grad(d, lambda m: m(x).sum())
        assert all(p.grad is None for p in net.parameters()) and all(flags(net))
        d(x).sum().backward()
        assert ts.tree.paths(ts.structural_grad(d, lambda m: m(x).sum()))[0] == "module.0.weight"
        d2 = DDP(nn.Linear(2, 1))
        with pytest.raises(ValueError):
            ts.structural_grad(d2, lambda m: m(x).sum(), create_graph=True)
        d3 = DDP(nn.Linear(2, 1))
        d3.register_comm_hook(None, default_hooks.fp16_compress_hook)
        with pytest.raises(RuntimeError, match="fp16_compress_hook"):
            ts.structural_grad(d3, lambda m: m(x).sum())
        d4 = DDP(nn.Linear(2, 1))
        d4.register_comm_hook(None, default_hooks.allreduce_hook)
        ts.structural_grad(d4, lambda m: m(x).sum())
        del d, d2, d3, d4
    finally:
        dist.destroy_process_group()


def test_environment_variables_and_setup_named_by_the_readme():
    # README: "`TORCHSTRUCT_NO_EXTENSION=1` at install time ..., or
    # `TORCHSTRUCT_BACKEND=reference` at run time"; "`TORCH_CUDA_ARCH_LIST`", "`CUDA_HOME` (or
    # `/usr/local/cuda`)"; "installs the pinned CPU build `torch==2.13.0`, then `pip install
    # --no-build-isolation -e .[test]`"; docs/api.md: "`TORCHSTRUCT_NO_KERNELS=cpu`"
    root = DOCS.parent
    setup, ops = (root / "setup.py").read_text(), (root / "torchstruct/_ops.py").read_text()
    run = (root / "run.sh").read_text()
    for name in ("TORCHSTRUCT_NO_EXTENSION", "TORCH_CUDA_ARCH_LIST", "CUDA_HOME", "/usr/local/cuda"):
        assert name in setup, name
    for name in ("TORCHSTRUCT_BACKEND", "TORCHSTRUCT_NO_KERNELS"):
        assert name in ops, name
    assert "torch==2.13.0" in run and "--no-build-isolation -e" in run and '.[test]' in run
    for name in set(re.findall(r"TORCHSTRUCT_[A-Z_]+", doc_text() + README.read_text())):
        assert name in setup + ops + run, name


def test_constant_protects_memory_not_objects():
    # docs/stop_gradient.md: "a write that overlaps the bytes of a selected parameter raises,
    # whatever tensor it goes through (also one on another storage sharing those bytes, from
    # `torch.from_numpy` ...); two parameters that are views of one buffer are told apart";
    # "Rebinding `p.data = other` ... raises too, unless `other` is the parameter's own memory
    # seen the same way (`module.float()` on a float model)"
    np = pytest.importorskip("numpy")
    buf = torch.zeros(4)
    m = nn.Module()
    m.a, m.b = nn.Parameter(buf[:2]), nn.Parameter(buf[2:])
    with ts.constant(m, "a"), torch.no_grad():
        m.b.add_(1)
        with raises_naming(RuntimeError, "'a'"):
            buf[1:3].add_(1)
    assert torch.equal(buf, torch.tensor([0.0, 0.0, 1.0, 1.0]))
    arr = np.zeros(3, dtype=np.float32)
    m2 = nn.Module()
    m2.p = nn.Parameter(torch.from_numpy(arr))
    with ts.constant(m2), torch.no_grad():
        with raises_naming(RuntimeError, "'p'"):
            torch.from_numpy(arr).add_(1)
        m2.float()
        with raises_naming(RuntimeError, "'p'"):
            m2.double()
    assert arr.sum() == 0 and m2.p.dtype == torch.float32


def test_contexts_on_different_models_from_different_threads():
    # docs/freezing.md: "contexts on different models may be entered and left from different
    # threads"
    models = [nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)) for _ in range(2)]
    errors = []

    def work(m):
        try:
            for _ in range(30):
                with ts.freeze_except(m, "1"):
                    assert flags(m) == [False, False, True, True]
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(m,)) for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and all(all(flags(m)) for m in models)


def test_schedule_step_between_milestones_walks_nothing(monkeypatch):
    # docs/schedule.md: "`step()` that reaches no milestone is a counter increment and a
    # comparison: no walk of the model"
    m = nn.ModuleDict({"a": nn.Linear(2, 2), "head": nn.Linear(2, 1)})
    s = ts.UnfreezeSchedule(m, {0: "head", 5: "a"})
    calls = []
    for name in ("named_modules", "named_parameters", "modules", "parameters", "children"):
        orig = getattr(nn.Module, name)

        def spy(self, *a, _orig=orig, _name=name, **k):
            calls.append(_name)
            return _orig(self, *a, **k)

        monkeypatch.setattr(nn.Module, name, spy)
    for _ in range(4):
        s.step()
    monkeypatch.undo()
    assert calls == [] and s.current_step == 4
    s.close()


def test_select_tuple_union_and_no_selector_contexts():
    # docs/selecting.md: "the union of a list or tuple of selectors"; docs/freezing.md:
    # "`ts.freeze(model, *selectors)` turns the selected off (no selector: the whole model)",
    # "`ts.unfreeze(model, *selectors)` turns the selected on (no selector: the whole model)"
    m = seq()
    assert [p for p, _ in ts.select(m, ("0.bias", m[2]))] == ["0.bias", "2.weight", "2.bias"]
    with ts.freeze(m):
        assert not any(flags(m))
        with ts.unfreeze(m):
            assert all(flags(m))
    assert all(flags(m))


def test_structural_grad_reentrant_checkpoint_puts_everything_back():
    # docs/structural.md (use_reentrant=True): "every other leaf the loss visibly reaches
    # (inputs, another model's parameters) ... switched off, so nothing accumulates there; the
    # asked `.grad` fields start empty and every `.grad` and flag is put back afterwards. The
    # numbers are those of `.backward()`"; "a parameter with a post-accumulate-grad hook ...
    # raises `RuntimeError` naming it"
    from torch.utils.checkpoint import checkpoint

    class C(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.out = nn.Linear(4, 8), nn.Linear(8, 2)
            self.mid = nn.Sequential(nn.Linear(8, 8), nn.Tanh())

        def forward(self, x):
            return self.out(checkpoint(self.mid, torch.tanh(self.inp(x)), use_reentrant=True))

    torch.manual_seed(0)
    m, other = C(), nn.Linear(2, 2)
    x = torch.randn(3, 4, requires_grad=True)
    everything = list(m.parameters()) + list(other.parameters())
    for p in everything:
        p.grad = torch.full_like(p, 7.0)
    g = ts.tree.to_flat_dict(ts.structural_grad(m, lambda mm: other(mm(x)).sum()))
    assert all(torch.equal(p.grad, torch.full_like(p, 7.0)) for p in everything)
    assert x.grad is None and all(p.requires_grad for p in everything)
    ref = C()
    ref.load_state_dict(m.state_dict())
    other(ref(x.detach())).sum().backward()
    assert all(torch.equal(g[n], p.grad) for n, p in ref.named_parameters())
    m.mid[0].weight.register_post_accumulate_grad_hook(lambda p: None)
    with raises_naming(RuntimeError, "'mid.0.weight'"):
        ts.structural_grad(m, lambda mm: other(mm(x)).sum())


def test_tree_map_and_unflatten_give_back_a_flat_dict_for_a_flat_input():
    # docs/trees.md (as fixed): "`map` and `unflatten` give back a flat dict for a flat input"
    flat = {"a.b": torch.ones(1), "c": torch.zeros(2)}
    assert list(ts.tree.map(lambda t: t, flat)) == ["a.b", "c"]
    vec, spec = ts.tree.flatten(flat)
    assert list(ts.tree.unflatten(vec, spec)) == ["a.b", "c"]
