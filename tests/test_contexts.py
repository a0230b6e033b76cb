"""Tests for torchstruct.contexts: freeze / freeze_except / unfreeze and frozen norm stats."""

import warnings

import pytest
import torch
from torch import nn

import torchstruct as ts


def flags(model):
    return {path: p.requires_grad for path, p in model.named_parameters()}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        self.head = nn.Linear(4, 2)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.head(self.encoder(x)) * self.scale


def mixed_net():
    """A net with some starting flags already off."""
    m = Net()
    m.encoder[0].bias.requires_grad_(False)
    m.head.weight.requires_grad_(False)
    return m


ALL = ["scale", "encoder.0.weight", "encoder.0.bias", "encoder.2.weight", "encoder.2.bias",
       "head.weight", "head.bias"]


# ----------------------------------------------------------------------------- basics
def test_freeze_temporary_with_block():
    m = mixed_net()
    start = flags(m)
    with ts.freeze(m, "encoder") as ctx:
        assert isinstance(ctx, ts.freeze)
        got = flags(m)
        assert got == {**start, "encoder.0.weight": False, "encoder.2.weight": False,
                       "encoder.2.bias": False}
    assert flags(m) == start


def test_freeze_without_selector_freezes_everything():
    m = mixed_net()
    start = flags(m)
    with ts.freeze(m):
        assert not any(flags(m).values())
    assert flags(m) == start


def test_freeze_except_leaves_selected_as_they_are():
    m = mixed_net()
    start = flags(m)
    with ts.freeze_except(m, "head"):
        assert flags(m) == {**{k: False for k in ALL}, "head.weight": False, "head.bias": True}
    assert flags(m) == start


def test_unfreeze_turns_selected_on():
    m = mixed_net()
    start = flags(m)
    with ts.unfreeze(m, "head", "encoder.0"):
        assert all(flags(m).values())
    assert flags(m) == start
    with ts.unfreeze(m):
        assert all(flags(m).values())
    assert flags(m) == start


def test_flags_change_at_construction_without_with():
    m = Net()
    ctx = ts.freeze(m, "head")
    assert flags(m)["head.weight"] is False
    ctx.__exit__(None, None, None)
    assert flags(m)["head.weight"] is True


@pytest.mark.parametrize("kind", [ts.freeze, ts.freeze_except, ts.unfreeze])
def test_bare_call_is_permanent(kind):
    m = mixed_net()
    kind(m, "encoder.2")
    after = flags(m)
    m(torch.randn(2, 4))
    ts.attach(m)
    assert flags(m) == after
    assert [p for p, _ in ts.trainable_parameters(m)] == [k for k, v in after.items() if v]
    if kind is ts.freeze:
        assert after["encoder.2.weight"] is False and after["scale"] is True
    elif kind is ts.freeze_except:
        assert after["encoder.2.weight"] is True and after["scale"] is False
    else:
        assert after["head.weight"] is False


def test_context_object_reentered_with_applies_again():
    m = Net()
    ctx = ts.freeze(m, "head")
    ctx.__exit__(None, None, None)
    with ctx:
        assert flags(m)["head.weight"] is False
    assert flags(m)["head.weight"] is True


# ----------------------------------------------------------------------------- decorator
@pytest.mark.parametrize("kind,sel,inside", [
    (ts.freeze, "head", {"head.weight": False, "head.bias": False}),
    (ts.freeze_except, "head", {**{k: False for k in ALL}, "head.bias": True}),
    (ts.unfreeze, "head", {"head.weight": True, "head.bias": True}),
])
def test_decorator_applies_per_call_not_at_decoration(kind, sel, inside):
    m = mixed_net()
    start = flags(m)
    seen = []

    @kind(m, sel)
    def step(x, *, k=1):
        seen.append(flags(m))
        return x * k

    assert flags(m) == start  # nothing at decoration
    assert step.__name__ == "step"
    assert step(3, k=2) == 6
    assert flags(m) == start
    assert step(1) == 1
    assert flags(m) == start
    assert len(seen) == 2
    for got in seen:
        assert got == {**start, **inside}


def test_decorated_function_raising_restores():
    m = mixed_net()
    start = flags(m)

    @ts.freeze_except(m, "scale")
    def boom():
        assert flags(m)["head.bias"] is False
        raise RuntimeError("x")

    with pytest.raises(RuntimeError):
        boom()
    assert flags(m) == start


def test_decorated_function_called_recursively_nests():
    m = Net()
    start = flags(m)
    depth = []

    @ts.freeze(m, "head")
    def rec(n):
        depth.append(flags(m)["head.weight"])
        if n:
            rec(n - 1)
        depth.append(flags(m)["head.weight"])

    rec(2)
    assert depth == [False] * 6
    assert flags(m) == start


# ----------------------------------------------------------------------------- exact restore
@pytest.mark.parametrize("kind", [ts.freeze, ts.freeze_except, ts.unfreeze])
@pytest.mark.parametrize("exc", [None, ValueError, KeyboardInterrupt])
def test_exact_restore_of_arbitrary_starting_flags(kind, exc):
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        m = Net()
        for p in m.parameters():
            p.requires_grad_(bool(torch.randint(0, 2, (), generator=g)))
        start = flags(m)
        if exc is None:
            with kind(m, ["encoder.0", "head.bias"]):
                pass
        else:
            with pytest.raises(exc):
                with kind(m, ["encoder.0", "head.bias"]):
                    raise exc()
        assert flags(m) == start


def test_restore_after_keyboard_interrupt_in_nested_blocks():
    m = mixed_net()
    start = flags(m)
    with pytest.raises(KeyboardInterrupt):
        with ts.freeze(m):
            with ts.unfreeze(m, "head"):
                with ts.freeze_except(m, "scale"):
                    raise KeyboardInterrupt
    assert flags(m) == start


# ----------------------------------------------------------------------------- nesting
def test_nesting_innermost_wins():
    m = mixed_net()
    start = flags(m)
    with ts.freeze(m):
        assert not any(flags(m).values())
        with ts.unfreeze(m, "head"):
            assert [k for k, v in flags(m).items() if v] == ["head.weight", "head.bias"]
            with ts.freeze(m, "head.bias"):
                assert [k for k, v in flags(m).items() if v] == ["head.weight"]
            assert [k for k, v in flags(m).items() if v] == ["head.weight", "head.bias"]
        assert not any(flags(m).values())
    assert flags(m) == start


def test_unfreeze_inside_freeze_except_then_freeze_except_inside():
    m = mixed_net()
    start = flags(m)
    with ts.freeze_except(m, "encoder"):
        assert [k for k, v in flags(m).items() if v] == ["encoder.0.weight", "encoder.2.weight",
                                                          "encoder.2.bias"]
        with ts.unfreeze(m, "encoder.0.bias"):
            with ts.freeze_except(m, "encoder.0"):
                assert [k for k, v in flags(m).items() if v] == ["encoder.0.weight",
                                                                  "encoder.0.bias"]
            assert flags(m)["encoder.0.bias"] is True
        assert flags(m)["encoder.0.bias"] is False
    assert flags(m) == start


def test_composing_contexts_in_one_with_statement():
    m = Net()
    start = flags(m)
    with ts.freeze(m, "encoder"), ts.freeze(m, "scale"), ts.unfreeze(m, "encoder.2.bias"):
        assert [k for k, v in flags(m).items() if v] == ["encoder.2.bias", "head.weight", "head.bias"]
    assert flags(m) == start


def test_exit_out_of_order_keeps_the_others():
    m = Net()
    start = flags(m)
    a = ts.freeze(m, "head")
    b = ts.freeze(m, "scale")
    a.__exit__(None, None, None)  # leave the outer one first
    assert flags(m)["head.weight"] is True and flags(m)["scale"] is False
    b.__exit__(None, None, None)
    assert flags(m) == start


def test_contexts_on_a_submodule_of_an_attached_model():
    m = mixed_net()
    ts.attach(m)
    start = flags(m)
    with ts.freeze(m.encoder, "0"):  # selectors are relative to the submodule
        assert flags(m) == {**start, "encoder.0.weight": False}
        with ts.freeze_except(m.encoder, "2.bias"):
            assert flags(m) == {**start, "encoder.0.weight": False, "encoder.2.weight": False}
            with ts.unfreeze(m.head):
                assert flags(m)["head.weight"] is True
            assert flags(m)["head.weight"] is False
        m(torch.randn(2, 4))  # the root's hook does not undo the submodule's context
        assert flags(m) == {**start, "encoder.0.weight": False}
    assert flags(m) == start


def test_context_on_submodule_then_root_attached_inside():
    m = Net()
    start = flags(m)
    with ts.freeze(m.head):
        ts.attach(m)
        assert flags(m)["head.weight"] is False
        with ts.freeze(m, "scale"):
            assert flags(m)["head.weight"] is False and flags(m)["scale"] is False
        assert flags(m)["head.weight"] is False and flags(m)["scale"] is True
        m(torch.randn(1, 4))
        assert flags(m)["head.weight"] is False
    assert flags(m) == start


def test_contexts_on_sibling_submodules_sharing_a_parameter():
    shared = nn.Linear(2, 2)
    m = nn.ModuleDict({"a": nn.Sequential(shared), "b": nn.Sequential(shared, nn.Linear(2, 2))})
    start = flags(m)
    with ts.freeze(m["a"]):
        assert shared.weight.requires_grad is False
        with ts.freeze(m["b"], "1"):
            # the shared layer is still frozen by the outer context
            assert shared.weight.requires_grad is False
            assert m["b"][1].weight.requires_grad is False
        assert shared.weight.requires_grad is False
        assert m["b"][1].weight.requires_grad is True
    assert flags(m) == start


def test_unfreeze_cannot_override_a_declaration():
    m = Net()
    ts.mark_trainable(m, "head", "scale")
    start = flags(m)
    with ts.unfreeze(m):
        assert flags(m) == start
    with ts.unfreeze(m, "encoder"):
        assert not any(p.requires_grad for p in m.encoder.parameters())
    assert flags(m) == start


def test_declaration_inside_context_and_lifted_after():
    m = Net()
    start = flags(m)
    with ts.freeze(m, "scale"):
        ts.mark_trainable(m, "head", "scale")
        assert [k for k, v in flags(m).items() if v] == ["head.weight", "head.bias"]
        ts.mark_trainable(m, None)
        assert [k for k, v in flags(m).items() if not v] == ["scale"]
    assert flags(m) == start


def test_regex_callable_module_and_param_selectors_in_contexts():
    import re

    m = Net()
    with ts.freeze(m, re.compile(r".*\.bias"), lambda path, p: p.ndim == 0, m.head, m.encoder[0].weight):
        assert [k for k, v in flags(m).items() if v] == ["encoder.2.weight"]
    assert all(flags(m).values())


# ----------------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize("make", [
    lambda m: ts.freeze(m, "encodr"),
    lambda m: ts.freeze_except(m, "haed"),
    lambda m: ts.unfreeze(m, ["head", "nope"]),
    lambda m: ts.freeze(m, nn.Linear(4, 4)),
    lambda m: ts.freeze(m, nn.Parameter(torch.zeros(2))),
])
def test_unknown_selector_raises_and_changes_nothing(make):
    m = mixed_net()
    ts.attach(m)
    with ts.freeze(m, "scale"):
        start = flags(m)
        with pytest.raises(ValueError):
            make(m)
        assert flags(m) == start
    assert flags(m) == flags(mixed_net())


def test_unknown_selector_message_names_closest_path():
    m = Net()
    with pytest.raises(ValueError) as e:
        ts.freeze_except(m, "encoder.2.wieght")
    assert "encoder.2.weight" in str(e.value)


@pytest.mark.parametrize("kind", [ts.freeze, ts.freeze_except, ts.unfreeze])
def test_non_module_first_argument_raises(kind):
    m = mixed_net()
    start = flags(m)
    for bad in ["encoder", list(m.parameters()), None, m.head.weight]:
        with pytest.raises(TypeError):
            kind(bad, "head")
    assert flags(m) == start


def test_freeze_except_with_no_selector_raises():
    m = mixed_net()
    start = flags(m)
    with pytest.raises(TypeError):
        ts.freeze_except(m)
    assert flags(m) == start


def test_bad_selector_type_raises_and_changes_nothing():
    m = mixed_net()
    start = flags(m)
    with pytest.raises(TypeError):
        ts.freeze(m, "head", 3)
    assert flags(m) == start


def test_bad_decorator_arguments_raise_at_decoration():
    m = Net()
    with pytest.raises(ValueError):
        @ts.freeze(m, "nope")
        def f():
            pass
    assert all(flags(m).values())


def test_strict_false_allows_empty_match():
    m = mixed_net()
    start = flags(m)
    with ts.freeze(m, "nope", strict=False):
        assert flags(m) == start
    with ts.freeze_except(m, "nope", strict=False):
        assert not any(flags(m).values())
    assert flags(m) == start


# ----------------------------------------------------------------------------- norm stats
def norm_layers():
    return [
        (nn.BatchNorm1d(4), torch.randn(8, 4)),
        (nn.BatchNorm2d(3), torch.randn(4, 3, 5, 5)),
        (nn.InstanceNorm1d(3, affine=True, track_running_stats=True), torch.randn(4, 3, 7)),
    ]


def _stats(norm):
    return [b.clone() for b in (norm.running_mean, norm.running_var, norm.num_batches_tracked)]


def _prime(norm):
    """Give the running statistics non-trivial values."""
    with torch.no_grad():
        norm.running_mean.uniform_(-1, 1)
        norm.running_var.uniform_(0.5, 2)
        norm.num_batches_tracked.fill_(7)
        if norm.weight is not None:
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)


@pytest.mark.parametrize("idx", range(3))
@pytest.mark.parametrize("how", ["freeze", "freeze_except", "declaration", "starting_flag"])
def test_frozen_norm_keeps_running_stats(idx, how):
    norm, x = norm_layers()[idx]
    _prime(norm)
    m = nn.Sequential(nn.Identity(), norm)
    m.train()
    with torch.no_grad():
        norm.eval()
        want = norm(x)
        norm.train()
    before = _stats(norm)
    if how == "freeze":
        ctx = ts.freeze(m, "1")
    elif how == "freeze_except":
        ctx = ts.freeze_except(m, "0", strict=False)
    elif how == "declaration":
        ts.mark_trainable(m, "0")
        ctx = None
    else:  # frozen by hand: not torchstruct's to hold; plain PyTorch behaviour
        for p in norm.parameters():
            p.requires_grad_(False)
        ts.attach(m)
        m(x)
        assert norm.training is True
        assert not torch.equal(norm.running_mean, before[0])
        return
    assert not any(p.requires_grad for p in norm.parameters())
    out = m(x)
    assert norm.training is True and m.training is True
    for a, b in zip(before, _stats(norm)):
        assert torch.equal(a, b)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    if ctx is not None:
        ctx.__exit__(None, None, None)
        m(x)  # after the context the statistics update again
        assert not torch.equal(norm.running_mean, before[0])
        if isinstance(norm, nn.modules.batchnorm._BatchNorm):  # InstanceNorm never counts
            assert int(norm.num_batches_tracked) == 8


def test_frozen_norm_training_restored_when_forward_raises():
    norm = nn.BatchNorm1d(4)
    m = nn.Sequential(norm)
    m.train()
    before = _stats(norm)
    with ts.freeze(m):
        with pytest.raises(RuntimeError):
            m(torch.randn(8, 5))  # wrong feature size
        assert norm.training is True
        for a, b in zip(before, _stats(norm)):
            assert torch.equal(a, b)
        m.eval()
        m(torch.randn(8, 4))
        assert norm.training is False  # eval mode stays eval mode
        m.train()
    assert norm.training is True


def test_frozen_norm_inside_transformer_like_model():
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    bn = m[1]
    before = _stats(bn)
    with ts.freeze_except(m, "2"):
        m(torch.randn(8, 4)).sum().backward()
        for a, b in zip(before, _stats(bn)):
            assert torch.equal(a, b)
    assert m[2].weight.grad is not None and bn.weight.grad is None


@pytest.mark.parametrize("where", ["context", "attach"])
def test_freeze_norm_stats_false_keeps_plain_behaviour(where):
    bn = nn.BatchNorm1d(4)
    m = nn.Sequential(bn)
    before = _stats(bn)
    if where == "context":
        ctx = ts.freeze(m, freeze_norm_stats=False)
    else:
        ts.attach(m, freeze_norm_stats=False)
        ctx = ts.freeze(m)
    assert not bn.weight.requires_grad
    m(torch.randn(8, 4))
    assert not torch.equal(bn.running_mean, before[0])
    assert int(bn.num_batches_tracked) == 1
    ctx.__exit__(None, None, None)


def test_norm_with_some_params_trainable_still_updates():
    bn = nn.BatchNorm1d(4)
    m = nn.Sequential(bn)
    before = _stats(bn)
    with ts.freeze(m, "0.weight"):
        assert bn.bias.requires_grad and not bn.weight.requires_grad
        m(torch.randn(8, 4))
    assert not torch.equal(bn.running_mean, before[0])
    assert int(bn.num_batches_tracked) == 1


def test_norm_updates_after_exit_its_hooks_pass_and_stay_one_pair():
    """After the hold, the layer keeps one pair of hooks while it is in the attached tree
    (compiled code guards on a module's hooks: new ones at every hold would recompile every
    step); they pass, and detach_hooks removes them."""
    from torchstruct.hooks import _norm_post, _norm_pre

    bn = nn.BatchNorm1d(4)
    m = nn.Sequential(bn)
    for _ in range(3):
        with ts.freeze(m):
            m(torch.randn(8, 4))
    assert int(bn.num_batches_tracked) == 0  # held inside
    assert list(bn._forward_pre_hooks.values()) == [_norm_pre]
    assert list(bn._forward_hooks.values()) == [_norm_post]
    m(torch.randn(8, 4))
    assert int(bn.num_batches_tracked) == 1
    ts.detach_hooks(m)
    assert len(bn._forward_pre_hooks) == 0 and len(bn._forward_hooks) == 0


def test_freeze_norm_stats_false_on_another_model_does_not_leak():
    bn1, bn2 = nn.BatchNorm1d(4), nn.BatchNorm1d(4)
    m1, m2 = nn.Sequential(bn1), nn.Sequential(bn2)
    before1 = _stats(bn1)
    with ts.freeze(m2, freeze_norm_stats=False), ts.freeze(m1):
        m1(torch.randn(8, 4))
        m2(torch.randn(8, 4))
    for a, b in zip(before1, _stats(bn1)):  # m1 asked for frozen stats
        assert torch.equal(a, b)
    assert int(bn2.num_batches_tracked) == 1  # m2 asked for plain behaviour


def test_freeze_norm_stats_false_lifted_restores_frozen_stats():
    bn = nn.BatchNorm1d(4)
    m = nn.Sequential(bn)
    with ts.freeze(m):
        with ts.freeze(m, freeze_norm_stats=False):
            m(torch.randn(8, 4))
            assert int(bn.num_batches_tracked) == 1
        before = _stats(bn)
        m(torch.randn(8, 4))
        for a, b in zip(before, _stats(bn)):
            assert torch.equal(a, b)


# ----------------------------------------------------------------------------- lifetime
def test_permanent_context_does_not_keep_the_model_alive():
    import gc
    import weakref

    refs = []
    for sel in [(), ("0",), ("0.weight",)]:
        m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        ts.freeze(m, *sel)  # permanent: lives as long as the model, not longer
        refs.append(weakref.ref(m))
        del m
    gc.collect()
    assert [r() is None for r in refs] == [True, True, True]


def test_unrelated_model_contexts_are_not_re_evaluated():
    calls = []

    def pick(path, p):
        calls.append(path)
        return path.endswith("bias")

    a = nn.Sequential(nn.Linear(2, 2))
    ts.freeze(a, pick)  # permanent context on model a
    b = nn.Sequential(nn.Linear(2, 2))
    calls.clear()
    with ts.freeze(b, "0.weight"):
        assert b[0].weight.requires_grad is False
    assert b[0].weight.requires_grad is True
    assert calls == []  # a shares nothing with b: its selectors need not run
    assert a[0].bias.requires_grad is False and a[0].weight.requires_grad is True


@pytest.mark.parametrize("how", ["registered", "slot written, then a forward"])
def test_a_change_made_before_a_block_and_applied_by_its_entry_is_not_reported_at_exit(how):
    """The block's own entry applies what was added before it (a registration no forward has
    applied yet, a module slot written directly): nothing was added inside the block, so its
    exit warns of nothing; a module slot written inside it is reported."""
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    ts.attach(m)
    if how == "registered":
        m.head = nn.Linear(2, 2)
    else:
        m._modules["head"] = nn.Linear(2, 2)
        m(torch.randn(1, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ts.RestoredFlagsWarning)
        with ts.freeze(m, "0"):
            assert [p.requires_grad for p in m.parameters()] == [False, False, True, True, True, True]
        m._modules["tail"] = nn.Linear(2, 2)
        schedule = ts.UnfreezeSchedule(m, {0: "1", 1: None})  # (its first stage finds it)
        assert not m.tail.weight.requires_grad
        schedule.step()  # so leaving that stage reports nothing
    with pytest.warns(ts.RestoredFlagsWarning, match="'0.weight'"):
        with ts.freeze_except(m, "1"):
            m[1]._modules["extra"] = nn.Linear(2, 2)
            ts.attach(m)
    assert all(p.requires_grad for p in m.parameters())
