"""No silent wrong flags: writes by others, copies, read-only calls, threads, generators,
modules that leave a model, empty selectors and registrations elsewhere.

Each test is what a suspicious user would try, on plain PyTorch modules and on the real PEFT /
transformers / swa_utils code where the case comes from.
"""
import contextlib
import copy
import io
import os
import pickle
import sys
import threading
import warnings

import pytest
import torch
from torch import nn

import torchstruct as ts
from torchstruct import _state, hooks

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def flags(model):
    return {path: p.requires_grad for path, p in model.named_parameters()}


def mlp():
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Linear(4, 2))


def bn_net():
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))


# ----------------------------------------------------------------------------- writes by others
def test_a_different_value_written_inside_a_block_survives_it():
    m = mlp()
    with ts.freeze_except(m, "2"):
        m[2].weight.requires_grad_(False)  # the block left it on: this write is the user's
    assert m[2].weight.requires_grad is False
    assert all(v for k, v in flags(m).items() if k != "2.weight")
    with ts.freeze(m, "0"):  # and later blocks keep respecting it
        assert m[2].weight.requires_grad is False
    assert m[2].weight.requires_grad is False


def test_get_peft_model_inside_a_block_warns_naming_the_parameters_it_turns_back_on():
    peft = pytest.importorskip("peft")
    base = nn.Sequential()
    base.add_module("q", nn.Linear(8, 8))
    base.add_module("head", nn.Linear(8, 2))
    with pytest.warns(ts.RestoredFlagsWarning) as record:
        with ts.freeze_except(base, "head"):
            peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q"]))
    message = str(record[0].message)
    assert "q.base_layer.weight" in message and "get_peft_model" in message
    # the rule is documented: the block's exit restores what it froze; PEFT's own
    # different-value write (head: on -> off) stands
    assert base.head.weight.requires_grad is False
    assert base.q.lora_A["default"].weight.requires_grad is True


def test_no_warning_when_nothing_was_added_inside_the_block():
    m = mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ts.freeze_except(m, "3"):
            m(torch.randn(2, 4))


def test_get_peft_model_outside_a_block_keeps_peft_flags():
    peft = pytest.importorskip("peft")
    base = nn.Sequential()
    base.add_module("q", nn.Linear(8, 8))
    base.add_module("head", nn.Linear(8, 2))
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q"]))
    want = flags(model)
    with ts.freeze(model, "*.lora_A.*"):
        assert not base.q.lora_A["default"].weight.requires_grad
    assert flags(model) == want


# ----------------------------------------------------------------------------- copies
@pytest.mark.parametrize("how", ["deepcopy", "averaged", "save_load"])
def test_a_copy_of_a_model_with_frozen_norm_updates_its_statistics(how):
    m = bn_net()
    ts.freeze(m, "1")  # permanent: m's BatchNorm stops updating its running statistics
    if how == "deepcopy":
        c = copy.deepcopy(m)
    elif how == "averaged":
        c = torch.optim.swa_utils.AveragedModel(m).module
    else:
        buf = io.BytesIO()
        torch.save(m, buf)
        buf.seek(0)
        c = torch.load(buf, weights_only=False)
    x = torch.randn(16, 3) * 3 + 1
    m.train()
    m(x)
    assert torch.equal(m[1].running_mean, torch.zeros(4))  # the original still holds them
    c.train()
    c(x)
    assert not torch.equal(c[1].running_mean, torch.zeros(4))  # the copy is plain PyTorch
    assert c[1].training is True


def test_update_bn_on_an_averaged_copy_works():
    m = bn_net()
    ts.freeze(m, "1")
    swa = torch.optim.swa_utils.AveragedModel(m)
    loader = [torch.randn(8, 3) * 2 + 3 for _ in range(3)]
    torch.optim.swa_utils.update_bn(loader, swa)
    want = torch.cat(loader).float()
    lin = m[0]
    with torch.no_grad():
        h = lin(want)
    assert torch.allclose(swa.module[1].running_mean, h.mean(0), atol=1e-5)


def test_detach_hooks_removes_the_inert_hooks_a_copy_carries():
    m = bn_net()
    ts.freeze(m, "1")
    c = copy.deepcopy(m)
    assert any(len(mod._forward_pre_hooks) for mod in c.modules())
    ts.detach_hooks(c)
    assert not any(len(mod._forward_pre_hooks) or len(mod._forward_hooks) for mod in c.modules())
    assert len(m[1]._forward_pre_hooks) == 1  # the original keeps its own


def test_a_copy_made_inside_a_block_starts_from_its_own_flags_when_attached():
    m = mlp()
    with ts.freeze(m, "0"):
        c = copy.deepcopy(m)
    assert not c[0].weight.requires_grad  # torch's copy semantics: the flag as it was
    ts.attach(c)  # the copy's own starting flags: nothing of the original's records
    assert not c[0].weight.requires_grad and c[2].weight.requires_grad
    with ts.freeze(c, "2"):
        pass
    assert not c[0].weight.requires_grad
    assert m[0].weight.requires_grad


# ----------------------------------------------------------------------------- read-only calls
class Declared(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    def trainable(self):
        return ["a"]


def test_read_only_calls_install_no_hook_and_write_no_flag():
    m = Declared()
    assert [p for p, _ in ts.trainable_parameters(m)] == ["a.weight", "a.bias"]
    assert ts.is_trainable(m, "b.weight") is False
    assert "trainable 6 of 12" in str(ts.summary(m))
    assert all(flags(m).values())  # nothing written
    assert not any(len(mod._forward_pre_hooks) for mod in m.modules())
    assert b"torchstruct" not in pickle.dumps(m)  # loads without torchstruct
    plain = bn_net()
    ts.summary(plain), list(ts.trainable_parameters(plain)), ts.is_trainable(plain, "1.weight")
    torch.jit.script(plain)  # scripting refuses Python hooks: there are none
    assert b"torchstruct" not in pickle.dumps(plain)


def test_read_only_call_on_a_model_sharing_a_parameter_changes_no_flag():
    shared = nn.Linear(2, 2)
    a = nn.Sequential(shared, nn.Linear(2, 2))
    b = nn.Sequential(shared, nn.Linear(2, 1))
    ts.freeze(a, "0")  # a attached: shared frozen
    assert shared.weight.requires_grad is False
    assert ts.is_trainable(b, "0.weight") is False  # the active context covers it
    list(ts.trainable_parameters(b))
    ts.summary(b)
    assert shared.weight.requires_grad is False
    assert not len(b._forward_pre_hooks)


def test_detach_hooks_makes_an_attached_model_plain_for_save_and_script():
    m = bn_net()
    ts.freeze(m, "1")
    ts.detach_hooks(m)
    assert b"torchstruct" not in pickle.dumps(m)
    torch.jit.script(m)


# ----------------------------------------------------------------------------- threads
def test_contexts_from_four_threads_on_four_models_do_not_interfere():
    models = [mlp() for _ in range(4)]
    keeps = ["0", "3", "2", "0"]
    errors = []
    barrier = threading.Barrier(len(models))

    def work(m, keep):
        x = torch.randn(2, 4)
        barrier.wait()
        try:
            for _ in range(1000):
                with ts.freeze_except(m, keep):
                    m(x)
                    got = flags(m)
                    want = {k: k.startswith(keep + ".") for k in got}
                    if got != want:
                        errors.append((keep, got))
                        return
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        threads = [threading.Thread(target=work, args=(m, k)) for m, k in zip(models, keeps)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(before)
    assert not errors, errors[:1]
    assert all(all(flags(m).values()) for m in models)
    assert not [e for e in _state.entries if e.scope() in models]


# ----------------------------------------------------------------------------- generators
@pytest.mark.parametrize("kind", ["freeze", "freeze_except", "unfreeze"])
def test_decorated_generator_holds_inside_the_generator_only(kind):
    m = mlp()
    m[0].weight.requires_grad_(False)
    start = flags(m)

    @getattr(ts, kind)(m, "0")
    def gen(n):
        for i in range(n):
            yield flags(m)

    with ts.freeze(m, "3"):
        outside = flags(m)
    it = gen(3)
    assert flags(m) == start  # creating the generator applies nothing
    inside = next(it)
    assert flags(m) == start  # nor between resumptions
    want = {
        "freeze": {**start, "0.weight": False, "0.bias": False},
        "freeze_except": {k: (v if k.startswith("0.") else False) for k, v in start.items()},
        "unfreeze": {**start, "0.weight": True, "0.bias": True},
    }[kind]
    assert inside == want
    assert list(it) == [want, want]
    assert flags(m) == start and outside != start


def test_decorated_generator_send_throw_close_and_return_value():
    m = mlp()

    @ts.freeze(m, "0")
    def echo():
        got = yield "ready"
        while True:
            try:
                got = yield (got, m[0].weight.requires_grad)
            except KeyError:
                return "done"

    g = echo()
    assert next(g) == "ready"
    assert g.send(5) == (5, False)
    assert m[0].weight.requires_grad
    with pytest.raises(StopIteration) as stop:
        g.throw(KeyError("x"))
    assert stop.value.value == "done"
    assert m[0].weight.requires_grad
    g2 = echo()
    next(g2)
    g2.close()
    assert all(flags(m).values())


# ----------------------------------------------------------------------------- coroutines
def test_decorated_coroutine_holds_while_its_body_runs_only():
    """Two tasks interleave: the decorated one sees its context at each resumption, the
    other one never does; an exception inside restores the flags and reaches the caller."""
    import asyncio

    m = mlp()
    seen = {"decorated": [], "other": []}

    @ts.freeze(m, "0")
    async def decorated(fail):
        for _ in range(3):
            seen["decorated"].append(m[0].weight.requires_grad)
            await asyncio.sleep(0)
        if fail:
            raise KeyError("inside")
        return "done"

    async def other():
        for _ in range(3):
            seen["other"].append(m[0].weight.requires_grad)
            await asyncio.sleep(0)

    async def main(fail):
        return await asyncio.gather(decorated(fail), other())

    assert asyncio.run(main(False))[0] == "done"
    assert seen == {"decorated": [False] * 3, "other": [True] * 3}
    with pytest.raises(KeyError, match="inside"):
        asyncio.run(main(True))
    assert all(flags(m).values())


@pytest.mark.parametrize("kind", ["freeze", "stop_gradient"])
def test_decorating_an_async_generator_function_is_a_clear_error(kind):
    m = mlp()

    async def agen():
        yield flags(m)

    with pytest.raises(TypeError, match="async generator function .*agen.*`with`"):
        getattr(ts, kind)(m, "0")(agen)
    assert all(flags(m).values())


# ----------------------------------------------------------------------------- leaving modules
def test_module_replaced_inside_a_block_gets_its_flags_back():
    m = mlp()
    old = m[0]
    with ts.freeze_except(m, "3"):
        m[0] = nn.Linear(4, 4)
        m(torch.randn(1, 4))
        assert not m[0].weight.requires_grad  # the newcomer follows the block
        assert old.weight.requires_grad  # what left is plain again at the next application
    assert old.weight.requires_grad and old.bias.requires_grad
    assert all(flags(m).values())


def test_module_deleted_inside_a_block_gets_its_flags_back():
    m = mlp()
    gone = m[2]
    with ts.freeze(m, "2"):
        del m[2]
    assert gone.weight.requires_grad and gone.bias.requires_grad
    assert all(flags(m).values())


def test_a_module_that_left_keeps_a_flag_someone_else_wrote():
    m = mlp()
    gone = m[2]
    with ts.freeze(m, "0"):
        del m[2]
        gone.weight.requires_grad_(False)  # the user's own write
    assert gone.weight.requires_grad is False and gone.bias.requires_grad is True


# ----------------------------------------------------------------------------- empty selectors
@pytest.mark.parametrize("sel", [[], (), [[]], nn.ReLU(), nn.Linear(4, 4)])
@pytest.mark.parametrize("kind", ["freeze", "freeze_except", "unfreeze"])
def test_empty_or_foreign_selectors_raise_and_change_nothing(kind, sel):
    m = mlp()
    m[0].bias.requires_grad_(False)
    before = flags(m)
    with pytest.raises(ValueError):
        getattr(ts, kind)(m, sel)
    assert flags(m) == before
    assert not len(m._forward_pre_hooks)


def test_a_module_of_the_model_without_parameters_is_an_empty_match():
    m = mlp()
    with pytest.raises(ValueError, match="ReLU names only modules without parameters"):
        ts.freeze_except(m, m[1])  # the ReLU alone: would freeze everything
    assert all(flags(m).values())
    with ts.freeze_except(m, m[1], strict=False):  # said on purpose
        assert not any(flags(m).values())
    with ts.freeze(m, [m[1], m[2]]):  # with a module that has parameters: fine
        assert [k for k, v in flags(m).items() if not v] == ["2.weight", "2.bias"]


# ----------------------------------------------------------------------------- value_and_grad
def test_value_and_grad_with_wrt_returns_the_value_of_the_plain_call():
    torch.manual_seed(0)
    m = mlp()
    x = torch.randn(5, 4)

    def loss(model, x):
        l2 = sum((p * p).sum() for _, p in ts.trainable_parameters(model))
        return model(x).pow(2).mean() + 0.1 * l2

    with ts.freeze(m, "3"):
        plain = loss(m, x)
        value, grads = ts.value_and_grad(loss, m, x, wrt="0")
        assert torch.equal(value, plain.detach())
        assert sorted(ts.tree.paths(grads)) == ["0.bias", "0.weight"]
        assert [p for p, _ in ts.trainable_parameters(m)] == [
            "0.weight", "0.bias", "2.weight", "2.bias"]
    assert all(flags(m).values())


# ----------------------------------------------------------------------------- registrations
def test_registrations_elsewhere_do_not_make_an_attached_model_reapply(monkeypatch):
    m = mlp()
    ts.freeze_except(m, "3")
    x = torch.randn(2, 4)
    m(x)
    calls = []
    orig = hooks.State.apply
    monkeypatch.setattr(hooks.State, "apply", lambda self, *a: (calls.append(1), orig(self, *a))[1])
    for _ in range(5):
        other = nn.Linear(3, 3)  # unrelated modules and parameters, created per step
        other.extra = nn.Parameter(torch.zeros(1))
        m(x)
    assert calls == []
    m[3].extra = nn.Parameter(torch.zeros(1))  # a registration into the model: re-applied once
    m(x)
    m(x)
    assert calls == [1]


# ----------------------------------------------------------------------------- smaller ones
def test_trainable_returning_a_string_is_a_clear_error():
    class Oops(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(2, 2)

        def trainable(self):
            return "head"

    m = Oops()
    with pytest.raises(TypeError, match=r"did you mean \['head'\]"):
        ts.attach(m)
    assert all(flags(m).values())


def test_unfreeze_of_an_integer_parameter_names_it_and_changes_nothing():
    m = mlp()
    m.index = nn.Parameter(torch.arange(3), requires_grad=False)
    m[0].weight.requires_grad_(False)
    before = flags(m)
    with pytest.raises(ValueError, match="'index'.*int64"):
        ts.unfreeze(m)
    assert flags(m) == before
    with ts.unfreeze(m, "0"):  # the floating-point ones alone are fine
        assert m[0].weight.requires_grad
    assert flags(m) == before


@pytest.mark.parametrize("opt", ["SGD", "AdamW"])
@pytest.mark.parametrize("flag", ["fused", "foreach"])
def test_ts_optim_rejects_fused_and_foreach_clearly(opt, flag):
    with pytest.raises(TypeError, match=rf"{flag}= is not an option here.*one fused pass"):
        getattr(ts.optim, opt)(mlp().parameters(), lr=0.1, **{flag: True})


@pytest.mark.parametrize("opt", ["SGD", "AdamW"])
def test_ts_optim_refuses_complex_parameters_at_construction(opt):
    m = mlp()
    m.phase = nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(TypeError, match="'phase' is complex"):
        getattr(ts.optim, opt)(ts.param_groups(m), lr=0.1)
    with pytest.raises(TypeError, match="complex"):
        getattr(ts.optim, opt)(m.parameters(), lr=0.1)
    o = getattr(ts.optim, opt)(mlp().parameters(), lr=0.1)
    with pytest.raises(TypeError, match="complex"):
        o.add_param_group({"params": [m.phase]})
    assert len(o.param_groups) == 1


# ------------------------------------------------- bookkeeping inside stop_gradient / swap
# Inside these blocks ``p.requires_grad`` reads the stand-in's flag (docs/stop_gradient.md);
# torchstruct's own reads and writes must still see, and change, the parameters themselves.
def _blocks(m):
    yield "stop_gradient", lambda: ts.stop_gradient(m[0])
    yield "swap", lambda: ts.swap(m, {"0.weight": m[0].weight.detach().clone()})


@pytest.mark.parametrize("kind", ["stop_gradient", "swap"])
def test_flags_written_inside_a_substituting_block_reach_the_parameters(kind):
    def fresh():
        m = mlp()
        ts.attach(m)
        return m, dict(_blocks(m))[kind]

    m, block = fresh()
    with block():
        ts.freeze(m, "0")  # bare call: from now on
    assert flags(m)["0.weight"] is False and flags(m)["0.bias"] is False
    assert not ts.is_trainable(m, "0.weight")

    m, block = fresh()
    with block():
        ts.mark_trainable(m, "2", "3")
    assert flags(m) == {k: not k.startswith("0.") for k in flags(m)}

    m, block = fresh()
    with block():
        with ts.freeze_except(m, "3"):
            pass
    assert flags(m) == dict.fromkeys(flags(m), True)  # restored, not "written by hand"
    with ts.freeze(m, "2"):
        assert flags(m)["0.weight"] is True and flags(m)["2.weight"] is False


@pytest.mark.parametrize("kind", ["stop_gradient", "swap"])
def test_reads_inside_a_substituting_block_are_the_models(kind):
    m = mlp()
    ts.freeze(m, "2")
    m(torch.randn(3, 4)).sum().backward()
    want = (
        [path for path, _ in ts.trainable_parameters(m)],
        sorted(ts.state_dict(m)),
        ts.summary(m),
        ts.global_norm(m),
        ts.is_trainable(m, "0.weight"),
    )
    with dict(_blocks(m))[kind]():
        got = (
            [path for path, _ in ts.trainable_parameters(m)],
            sorted(ts.state_dict(m)),
            ts.summary(m),
            ts.global_norm(m),
            ts.is_trainable(m, "0.weight"),
        )
        assert m[0].weight.requires_grad is False  # the stand-in's flag
    assert got[:3] == want[:3] and torch.equal(got[3], want[3]) and got[4] is want[4]


def test_a_registration_applied_by_a_forward_inside_stop_gradient():
    m = mlp()
    ts.attach(m)
    ts.mark_trainable(m, "3")
    with ts.stop_gradient(m[0]):
        m.append(nn.Linear(2, 2))  # a new head, not declared: frozen at the next forward
        m(torch.randn(1, 4))
    assert flags(m) == {k: k.startswith("3.") for k in flags(m)}


def test_another_threads_block_does_not_lift_or_leak():
    """Modes are per thread: a block open in one thread neither changes what the lock lifts in
    another nor is lifted for good by it."""
    m = mlp()
    ts.attach(m)
    inside, done = threading.Event(), threading.Event()
    seen = {}

    def worker():
        with ts.stop_gradient(m[0]):
            inside.set()
            done.wait(5)
            seen["worker"] = m[0].weight.requires_grad  # still the stand-in's after the lock
    t = threading.Thread(target=worker)
    t.start()
    assert inside.wait(5)
    with ts.freeze(m, "2"):  # this thread takes the lock while the worker's block is open
        seen["main"] = m[0].weight.requires_grad
    done.set()
    t.join(5)
    assert seen == {"main": True, "worker": False}
    assert flags(m) == dict.fromkeys(flags(m), True)


@pytest.mark.parametrize("opt", ["SGD", "AdamW"])
def test_ts_optim_step_inside_stop_gradient_steps_the_blocked_parameters(opt):
    """docs/stop_gradient.md: an optimizer step inside the block works (``p.requires_grad``
    reads the stand-in's False there; the step must not take it for a frozen parameter)."""
    models = []
    for inside in (False, True):
        torch.manual_seed(0)
        m = mlp()
        o = getattr(ts.optim, opt)(m.parameters(), lr=0.1, weight_decay=0.01)
        m(torch.randn(3, 4)).sum().backward()
        with ts.stop_gradient(m) if inside else contextlib.nullcontext():
            o.step()
        models.append(m)
    for a, b in zip(*(m.parameters() for m in models)):
        assert torch.equal(a, b)
