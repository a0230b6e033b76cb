"""Tests for torchstruct.declare: declarations, effective trainability and the hooks."""

import pytest
import torch
from torch import nn

import torchstruct as ts
from torchstruct import declare, hooks


def flags(model):
    return {path: p.requires_grad for path, p in model.named_parameters()}


def trainable_paths(model):
    return [path for path, _ in ts.trainable_parameters(model)]


class Adapter(nn.Module):
    """Declares through a method: only ``lora`` trains."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(4, 4)
        self.lora = nn.Linear(4, 4, bias=False)

    def trainable(self):
        return ["lora"]

    def forward(self, x):
        return self.base(x) + self.lora(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.encoder(x))


# ----------------------------------------------------------------------------- trainable()
def test_trainable_method_protocol():
    m = Adapter()
    ts.attach(m)
    assert flags(m) == {"base.weight": False, "base.bias": False, "lora.weight": True}
    assert trainable_paths(m) == ["lora.weight"]


def test_trainable_method_may_list_own_parameters_and_return_any_iterable():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))
            self.shift = nn.Parameter(torch.zeros(()))
            self.inner = nn.Linear(2, 2)

        def trainable(self):
            return iter(("scale",))  # a one-shot iterator is an Iterable too

    m = Scaled()
    assert trainable_paths(m) == ["scale"]
    assert all(flags(m).values())  # a read: nothing written
    ts.attach(m)
    assert flags(m) == {"scale": True, "shift": False, "inner.weight": False, "inner.bias": False}


def test_trainable_method_empty_freezes_everything():
    class Frozen(nn.Linear):
        def trainable(self):
            return []

    m = nn.Sequential(Frozen(2, 2), nn.Linear(2, 2))
    ts.attach(m)
    assert flags(m) == {"0.weight": False, "0.bias": False, "1.weight": True, "1.bias": True}


def test_trainable_attribute_that_is_not_callable_is_no_declaration():
    m = nn.Linear(2, 2)
    m.trainable = True  # an instance attribute, not a method: no declaration
    ts.attach(m)
    assert flags(m) == {"weight": True, "bias": True}


def test_class_level_trainable_with_bad_name_gives_clear_error():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(2))
            self.lora_a = nn.Linear(2, 2)

        def trainable(self):
            return ["lora_b"]

    m = Bad()
    before = flags(m)
    with pytest.raises(ValueError) as e:
        ts.attach(m)
    msg = str(e.value)
    assert "lora_b" in msg and "Bad" in msg and "lora_a" in msg
    assert flags(m) == before


def test_class_level_trainable_returning_non_string_gives_type_error():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def trainable(self):
            return [self.lin]

    with pytest.raises(TypeError):
        ts.attach(Bad())


# ----------------------------------------------------------------------------- mark_trainable
def test_mark_trainable_changes_flags_at_once():
    m = Net()
    ret = ts.mark_trainable(m, "head")
    assert ret is m
    # at once: no forward, no query needed
    assert flags(m) == {
        "encoder.0.weight": False,
        "encoder.0.bias": False,
        "encoder.2.weight": False,
        "encoder.2.bias": False,
        "head.weight": True,
        "head.bias": True,
    }


def test_mark_trainable_on_a_submodule_of_an_attached_model_changes_flags_at_once():
    m = Net()
    ts.attach(m)
    ts.mark_trainable(m.encoder, "2")
    assert flags(m) == {
        "encoder.0.weight": False,
        "encoder.0.bias": False,
        "encoder.2.weight": True,
        "encoder.2.bias": True,
        "head.weight": True,
        "head.bias": True,
    }


def test_mark_trainable_own_parameter_name():
    m = nn.Linear(3, 3)
    ts.mark_trainable(m, "bias")
    assert flags(m) == {"weight": False, "bias": True}


def test_mark_trainable_no_names_freezes_all():
    m = Net()
    ts.mark_trainable(m.encoder)
    ts.attach(m)
    assert trainable_paths(m) == ["head.weight", "head.bias"]


def test_mark_trainable_none_removes_and_restores():
    m = Net()
    m.head.bias.requires_grad_(False)  # a starting flag that must survive
    before = flags(m)
    ts.mark_trainable(m, "encoder")
    assert not any(p.requires_grad for p in m.head.parameters())
    ts.mark_trainable(m, None)
    assert flags(m) == before


def test_mark_trainable_none_falls_back_to_the_method():
    m = Adapter()
    ts.mark_trainable(m, "base", "lora")
    assert all(flags(m).values())
    ts.mark_trainable(m, None)
    assert flags(m) == {"base.weight": False, "base.bias": False, "lora.weight": True}


def test_mark_trainable_overrides_the_method():
    m = Adapter()
    ts.mark_trainable(m, "base")
    assert flags(m) == {"base.weight": True, "base.bias": True, "lora.weight": False}


def test_mark_trainable_unknown_name_raises_with_close_names_and_changes_nothing():
    m = Net()
    ts.mark_trainable(m, "head")
    before = flags(m)
    with pytest.raises(ValueError) as e:
        ts.mark_trainable(m, "encoder", "haed")
    assert "haed" in str(e.value) and "'head'" in str(e.value)
    assert flags(m) == before
    # the earlier declaration is still in force
    assert declare.declared(m) == frozenset({"head"})
    # a path is not a direct name
    with pytest.raises(ValueError):
        ts.mark_trainable(m, "head.weight")
    assert flags(m) == before


def test_mark_trainable_on_fresh_model_unknown_name_changes_nothing():
    m = Net()
    m.encoder[0].bias.requires_grad_(False)
    before = flags(m)
    with pytest.raises(ValueError):
        ts.mark_trainable(m, "encodr")
    assert flags(m) == before


def test_mark_trainable_rejects_non_modules_and_non_strings():
    with pytest.raises(TypeError):
        ts.mark_trainable("model", "head")
    m = Net()
    with pytest.raises(TypeError):
        ts.mark_trainable(m, m.head)
    assert all(flags(m).values())


# ----------------------------------------------------------------------------- nesting
class Deep(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.ModuleDict({"x": nn.Linear(2, 2), "y": nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))})
        self.b = nn.Linear(2, 2)
        self.c = nn.Parameter(torch.zeros(2))


def test_declarations_nested_at_several_levels():
    m = Deep()
    ts.mark_trainable(m, "a", "c")
    ts.mark_trainable(m.a, "y")
    ts.mark_trainable(m.a["y"], "1")
    ts.mark_trainable(m.a["y"][1], "weight")
    assert trainable_paths(m) == ["c", "a.y.1.weight"]
    assert flags(m) == {
        "c": True,
        "a.x.weight": False,
        "a.x.bias": False,
        "a.y.0.weight": False,
        "a.y.0.bias": False,
        "a.y.1.weight": True,
        "a.y.1.bias": False,
        "b.weight": False,
        "b.bias": False,
    }
    # lifting an inner declaration widens only its level
    ts.mark_trainable(m.a["y"], None)
    assert trainable_paths(m) == ["c", "a.y.0.weight", "a.y.0.bias", "a.y.1.weight"]
    # lifting the outermost one
    ts.mark_trainable(m, None)
    assert trainable_paths(m) == ["c", "a.y.0.weight", "a.y.0.bias", "a.y.1.weight", "b.weight", "b.bias"]


def test_inner_declaration_cannot_admit_what_outer_excludes():
    m = Deep()
    ts.mark_trainable(m, "b")
    ts.mark_trainable(m.a, "x", "y")
    assert trainable_paths(m) == ["b.weight", "b.bias"]


def test_declaration_on_unattached_submodule_then_attach_root():
    m = Deep()
    ts.mark_trainable(m.a, "x")
    ts.attach(m)
    assert trainable_paths(m) == ["c", "a.x.weight", "a.x.bias", "b.weight", "b.bias"]


# ----------------------------------------------------------------------------- queries
class TiedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.mid = nn.Linear(3, 3)
        self.out = nn.Linear(3, 5, bias=False)
        self.out.weight = self.embed.weight


def test_trainable_parameters_tied_once():
    m = TiedNet()
    got = list(ts.trainable_parameters(m))
    assert [p for p, _ in got] == ["embed.weight", "mid.weight", "mid.bias"]
    assert got[0][1] is m.embed.weight


def test_tied_parameter_admitted_along_some_path():
    m = TiedNet()
    ts.mark_trainable(m, "out")  # embed is not listed but the weight is reachable via out
    assert trainable_paths(m) == ["embed.weight"]
    assert m.embed.weight.requires_grad
    ts.mark_trainable(m, "mid")
    assert trainable_paths(m) == ["mid.weight", "mid.bias"]
    assert not m.embed.weight.requires_grad


def test_is_trainable_by_path_and_param():
    m = TiedNet()
    ts.mark_trainable(m, "mid")
    assert ts.is_trainable(m, "mid.weight") is True
    assert ts.is_trainable(m, "embed.weight") is False
    assert ts.is_trainable(m, "out.weight") is False  # the tied param by its second path
    assert ts.is_trainable(m, m.mid.bias) is True
    assert ts.is_trainable(m, m.out.weight) is False
    ts.mark_trainable(m, "out", "mid")
    assert ts.is_trainable(m, "embed.weight") is True


def test_is_trainable_on_submodule_of_attached_model():
    m = Net()
    ts.mark_trainable(m, "head")
    assert ts.is_trainable(m.encoder, "0.weight") is False
    assert ts.is_trainable(m.head, "weight") is True


def test_is_trainable_errors():
    m = Net()
    with pytest.raises(ValueError) as e:
        ts.is_trainable(m, "head.wieght")
    assert "head.weight" in str(e.value)
    with pytest.raises(ValueError):
        ts.is_trainable(m, "head")  # a module path is not a parameter path
    with pytest.raises(ValueError):
        ts.is_trainable(m, nn.Parameter(torch.zeros(2)))
    with pytest.raises(ValueError):
        ts.is_trainable(m, torch.zeros(2))
    with pytest.raises(TypeError):
        ts.is_trainable(m, 3)
    assert all(flags(m).values())


# ----------------------------------------------------------------------------- starting flags
def test_frozen_parameter_keeps_its_flag_across_attach():
    m = Net()
    m.encoder[0].weight.requires_grad_(False)
    before = flags(m)
    ts.attach(m)
    assert flags(m) == before
    ts.attach(m)
    assert flags(m) == before
    m(torch.randn(2, 4))
    assert flags(m) == before
    assert "encoder.0.weight" not in trainable_paths(m)


def test_declaration_lifted_returns_to_starting_flag_not_to_true():
    m = Net()
    m.head.weight.requires_grad_(False)
    ts.mark_trainable(m, "encoder")
    ts.mark_trainable(m, "head")
    assert flags(m)["head.weight"] is False and flags(m)["head.bias"] is True
    ts.mark_trainable(m, None)
    assert flags(m)["head.weight"] is False and flags(m)["encoder.0.weight"] is True


def test_manual_requires_grad_sets_new_starting_flag():
    m = Net()
    ts.attach(m)
    # the user freezes one parameter by hand: a new starting flag
    m.head.bias.requires_grad_(False)
    with ts.freeze(m, "encoder"):
        assert flags(m)["head.bias"] is False
    assert flags(m)["head.bias"] is False
    assert flags(m)["encoder.0.weight"] is True
    assert "head.bias" not in trainable_paths(m)
    # and unfreezes it by hand again: picked up at the next application
    m.head.bias.requires_grad_(True)
    assert ts.is_trainable(m, "head.bias") is True
    with ts.freeze(m, "encoder"):
        assert flags(m)["head.bias"] is True


def test_manual_requires_grad_on_a_declared_frozen_parameter_wins_until_a_newer_declaration():
    m = Net()
    ts.mark_trainable(m, "head")
    m.encoder[0].weight.requires_grad_(True)  # written after the declaration: it stands
    assert ts.is_trainable(m, "encoder.0.weight") is True  # reads agree with the flag at once
    m(torch.randn(1, 4))
    ts.attach(m)
    assert m.encoder[0].weight.requires_grad is True
    assert not m.encoder[0].bias.requires_grad  # only what was written
    ts.mark_trainable(m, "head")  # a declaration made after the write applies on top
    assert m.encoder[0].weight.requires_grad is False
    assert ts.is_trainable(m, "encoder.0.weight") is False
    # the manual True is its starting flag: lifting the declaration keeps it on
    ts.mark_trainable(m, None)
    assert m.encoder[0].weight.requires_grad is True


def test_manual_requires_grad_against_a_class_declaration_stands():
    class Frozen(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(2, 2)
            self.b = nn.Linear(2, 2)

        def trainable(self):
            return ["b"]

    m = Frozen()
    ts.attach(m)
    assert not m.a.weight.requires_grad
    m.a.weight.requires_grad_(True)  # the user's explicit choice, after the class's rule
    m.register_module("c", nn.Linear(2, 2))  # a registration: the hook applies again
    ts.attach(m)
    assert m.a.weight.requires_grad and ts.is_trainable(m, "a.weight")
    assert not m.a.bias.requires_grad and not m.c.weight.requires_grad


def test_manual_requires_grad_inside_context_is_kept_after_exit():
    m = Net()
    ts.attach(m)
    with ts.freeze(m, "encoder"):
        m.head.weight.requires_grad_(False)
    assert flags(m)["head.weight"] is False
    assert flags(m)["encoder.0.weight"] is True


# ----------------------------------------------------------------------------- hooks
def test_attach_returns_model_and_installs_one_pre_hook():
    m = Net()
    n = len(m._forward_pre_hooks)
    assert ts.attach(m) is m
    assert len(m._forward_pre_hooks) == n + 1
    ts.attach(m)
    assert len(m._forward_pre_hooks) == n + 1


def test_new_adapter_follows_declaration_at_next_forward():
    m = Net()
    ts.mark_trainable(m, "encoder")
    m.adapter = nn.Linear(2, 2)  # not declared: frozen from the next forward on
    m.encoder.add_module("3", nn.Linear(4, 4))  # inside the admitted subtree: trains
    m(torch.randn(1, 4))
    assert m.adapter.weight.requires_grad is False
    assert m.encoder[3].weight.requires_grad is True


def test_replaced_head_gets_right_flag_at_next_forward():
    m = Net()
    ts.mark_trainable(m, "head")
    m.head = nn.Linear(4, 2)  # a new head: declared trainable by name
    m.encoder[0] = nn.Linear(4, 4)  # a new encoder layer: frozen by the declaration
    assert m.encoder[0].weight.requires_grad is True  # not yet: only at the next forward
    m(torch.randn(1, 4))
    assert m.head.weight.requires_grad and m.head.bias.requires_grad
    assert not m.encoder[0].weight.requires_grad and not m.encoder[0].bias.requires_grad


def test_new_parameter_follows_active_context_at_next_forward():
    m = Net()
    with ts.freeze(m, "encoder"):
        m.encoder[2].extra = nn.Parameter(torch.zeros(4))
        m.encoder.add_module("3", nn.Linear(4, 4))
        m(torch.randn(1, 4))
        assert m.encoder[2].extra.requires_grad is False
        assert m.encoder[3].weight.requires_grad is False
    assert m.encoder[2].extra.requires_grad is True
    assert m.encoder[3].weight.requires_grad is True


def test_new_frozen_parameter_keeps_its_starting_flag():
    m = Net()
    ts.attach(m)
    m.head.extra = nn.Parameter(torch.zeros(2), requires_grad=False)
    m(torch.randn(1, 4))
    assert m.head.extra.requires_grad is False
    with ts.unfreeze(m, "head"):
        assert m.head.extra.requires_grad is True
    assert m.head.extra.requires_grad is False


def test_hook_does_not_rewalk_when_nothing_changed(monkeypatch):
    m = Net()
    ts.mark_trainable(m, "head")
    x = torch.randn(2, 4)
    m(x)  # settles anything pending
    calls = []
    orig = hooks.State.apply

    def counting(self):
        calls.append(1)
        return orig(self)

    monkeypatch.setattr(hooks.State, "apply", counting)
    m(x)
    m(x)
    assert calls == []
    # a change in the tree makes the next forward re-apply, once
    m.encoder.add_module("3", nn.Linear(4, 4))
    m(x)
    assert len(calls) == 1
    assert m.encoder[3].weight.requires_grad is False
    m(x)
    assert len(calls) == 1


def test_hook_does_not_rewalk_with_builtin_transformer(monkeypatch):
    m = nn.Sequential(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), nn.Linear(8, 1))
    ts.mark_trainable(m, "1")
    x = torch.randn(2, 3, 8)
    m(x)
    calls = []
    orig = hooks.State.apply
    monkeypatch.setattr(hooks.State, "apply", lambda self: (calls.append(1), orig(self))[1])
    m(x)
    assert calls == []


def test_detach_hooks_removes_hooks():
    m = Net()
    n0 = len(m._forward_pre_hooks)
    ts.mark_trainable(m, "encoder")
    assert len(m._forward_pre_hooks) == n0 + 1
    assert ts.detach_hooks(m) is m
    assert len(m._forward_pre_hooks) == n0
    before = flags(m)
    m.adapter = nn.Linear(2, 2)
    m.head = nn.Linear(4, 2)
    m(torch.randn(1, 4))
    # no longer updated at forward; existing flags stay as they were
    assert m.adapter.weight.requires_grad is True
    assert m.head.weight.requires_grad is True
    assert flags(m)["encoder.0.weight"] == before["encoder.0.weight"]


def test_detach_hooks_removes_norm_hooks():
    bn = nn.BatchNorm1d(4)
    m = nn.Sequential(nn.Linear(4, 4), bn)
    ts.freeze(m, "1")
    n_pre, n_post = len(bn._forward_pre_hooks), len(bn._forward_hooks)
    assert n_pre >= 1 and n_post >= 1
    ts.detach_hooks(m)
    assert len(m._forward_pre_hooks) == 0
    assert len(bn._forward_pre_hooks) == 0 and len(bn._forward_hooks) == 0


def test_detach_hooks_on_unattached_model_is_a_no_op():
    m = Net()
    assert ts.detach_hooks(m) is m
    assert len(m._forward_pre_hooks) == 0


def test_attach_after_detach_reinstalls():
    m = Net()
    ts.mark_trainable(m, "head")
    ts.detach_hooks(m)
    ts.attach(m)
    assert len(m._forward_pre_hooks) == 1
    m.adapter = nn.Linear(2, 2)
    m(torch.randn(1, 4))
    assert m.adapter.weight.requires_grad is False


def test_attach_reapplies_at_once_after_unregistered_swap():
    m = Net()
    ts.mark_trainable(m, "head")
    # a parameter swapped in without going through registration (e.g. by direct dict write)
    m.encoder[0]._parameters["weight"] = nn.Parameter(torch.zeros(4, 4))
    ts.attach(m)
    assert m.encoder[0].weight.requires_grad is False


def test_backward_under_declaration_gives_no_grad_to_frozen():
    m = Net()
    ts.mark_trainable(m, "head")
    m(torch.randn(3, 4)).sum().backward()
    assert m.head.weight.grad is not None
    assert all(p.grad is None for p in m.encoder.parameters())


# ----------------------------------------------------------------------------- unregistered swaps
def _swap_in_copy(module, name):
    """Put a copy of a parameter in place the way FSDP2's fully_shard does: a new object with the
    same flag, written into the parameter dict directly (no registration hook fires)."""
    old = module._parameters[name]
    module._parameters[name] = nn.Parameter(old.detach().clone(), requires_grad=old.requires_grad)
    return module._parameters[name]


def test_context_left_after_an_unregistered_swap_restores_the_new_parameter():
    m = Net()
    with ts.freeze_except(m, "head"):
        new = _swap_in_copy(m.encoder[0], "weight")
        assert new.requires_grad is False
        assert "encoder.0.weight" not in trainable_paths(m)
        assert any(p is new for _, p in declare.index(m))
    assert new.requires_grad is True  # the copy is restored, not the object it replaced
    assert all(flags(m).values())


def test_trainable_parameters_see_an_unregistered_swap():
    m = Net()
    ts.attach(m)
    new = _swap_in_copy(m.head, "bias")
    assert any(p is new for _, p in ts.trainable_parameters(m))
    with ts.freeze(m, "head"):
        assert new.requires_grad is False
    assert new.requires_grad is True


def test_a_new_parameter_at_a_frozen_path_keeps_its_own_flag():
    """Only a copy (the flag torchstruct last wrote there) inherits the starting flag."""
    m = Net()
    m.head.weight.requires_grad_(False)  # frozen by hand: the starting flag is False
    ts.attach(m)
    m.head._parameters["weight"] = nn.Parameter(torch.zeros_like(m.head.weight))  # trains
    with ts.freeze(m, "encoder"):
        assert m.head.weight.requires_grad is True
    assert m.head.weight.requires_grad is True
    # a copy of a hand-frozen parameter stays frozen
    m.head.weight.requires_grad_(False)
    ts.attach(m)
    _swap_in_copy(m.head, "weight")
    with ts.freeze(m, "encoder"):
        pass
    assert m.head.weight.requires_grad is False


# ------------------------------------------------------------- a declaration invalid at exit
class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(2, 2)
        self.mlp = nn.Linear(2, 2)
        self.extra = nn.Linear(2, 2)

    def trainable(self):
        return ["mlp", "attn"]


@pytest.mark.parametrize("how", ["method", "mark"])
def test_leaving_a_block_with_a_declaration_made_invalid_restores_then_raises(how):
    m = nn.Sequential(nn.Linear(2, 2), _TwoHeads())
    if how == "mark":
        ts.mark_trainable(m[1], "mlp", "attn")
    with pytest.raises(ValueError, match="mlp"):
        with ts.freeze(m, "0", "1.attn"):
            assert not m[1].attn.weight.requires_grad
            del m[1].mlp
    # the block's own flags are back; what the declaration still names still trains, and the
    # rest of its module stays frozen
    assert m[0].weight.requires_grad and m[0].bias.requires_grad
    assert m[1].attn.weight.requires_grad and m[1].attn.bias.requires_grad
    assert not m[1].extra.weight.requires_grad
    with pytest.raises(ValueError, match="mlp"):  # every read still says what is wrong
        ts.is_trainable(m, "0.weight")
    with pytest.raises(ValueError, match="mlp"):  # and so does entering a new context
        ts.freeze(m, "0")
    assert m[0].weight.requires_grad


# ------------------------------------------------------------- models that share a submodule
def test_declarations_of_every_attached_model_holding_a_parameter_gate_it():
    shared = nn.Linear(2, 2)
    a = nn.Sequential(shared, nn.Linear(2, 2))
    b = nn.Sequential(nn.Linear(2, 2), shared)
    ts.attach(a)
    ts.attach(b)
    ts.mark_trainable(a, "1")  # a: the shared layer does not train
    for model in (a, b):
        model.append(nn.Identity())  # a registration: each re-applies at its forward
        model(torch.randn(1, 2))
        assert not shared.weight.requires_grad
        assert not ts.is_trainable(model, shared.weight)
        assert {id(p) for _, p in ts.trainable_parameters(model)} == {
            id(p) for p in model.parameters() if p.requires_grad}
    assert b[0].weight.requires_grad and a[1].weight.requires_grad
    ts.mark_trainable(a, None)
    assert shared.weight.requires_grad and ts.is_trainable(b, "1.weight")
    del b[1]  # b no longer holds it: only a's declarations count
    ts.mark_trainable(b, "0")
    assert shared.weight.requires_grad and ts.is_trainable(a, "0.weight")
