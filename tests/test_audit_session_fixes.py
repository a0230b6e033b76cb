"""Outside checks of five recent changes: a refused first application leaves nothing attached
(``hooks.attached_or_as_before``), ``ts.constant`` refusing ``load_state_dict`` /
``polyak_update`` / optimizer steps before the first write, ``structural_grad``'s exact path
keeping a leaf that feeds a reentrant checkpoint directly, ``polyak_update`` refusing a target
with nothing trainable, and reentrant checkpoints remembering the flags of their forward.

Convention: a case found broken is kept as a test marked
``@pytest.mark.xfail(strict=True, reason=...)`` whose reason says what happens and what is
expected; every other test is an ordinary passing check. Every comparison is against plain
PyTorch (the same model without checkpointing, or ``.backward()`` on a deep copy).
"""
import copy
import gc
import os
import threading
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import torchstruct as ts
from _models import Checkpointed as Net, grads, same_grads
from torchstruct import _state

os.environ.setdefault("HF_HUB_OFFLINE", "1")

FORWARD = torch.utils.checkpoint.CheckpointFunction.__dict__["forward"]


def forward_is_torch_s():
    return torch.utils.checkpoint.CheckpointFunction.__dict__["forward"] is FORWARD


def X(seed=0, req=False):
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
    return x.requires_grad_() if req else x


def flags(model):
    return [p.requires_grad for p in model.parameters()]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    gc.collect()
    if not _state.entries:
        assert forward_is_torch_s()


# ============================================================================ 5. checkpoint flags
class Nest(nn.Module):
    """A reentrant checkpoint inside another one's function."""

    def __init__(self, mode):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.mode = mode

    def outer(self, h):
        h = self.a(h)
        return self.b(h) if self.mode is None else checkpoint(self.b, h, use_reentrant=True)

    def forward(self, x):
        h = self.outer(x) if self.mode is None else checkpoint(self.outer, x, use_reentrant=True)
        return h.pow(2).sum()


def nest_grads(mode, make, inside):
    m = Nest(mode)
    x = X(req=True)
    with make(m):
        loss = m(x)
        if inside:
            loss.backward()
    if not inside:
        loss.backward()
    return m, grads(m)


@pytest.mark.parametrize("make", [lambda m: ts.freeze(m, "a"), lambda m: ts.freeze_except(m, "b")])
def test_nested_checkpoints_outer_frozen_after_the_block(make):
    plain, want = nest_grads(None, make, False)
    ckpt, got = nest_grads(True, make, False)
    same_grads(got, want)
    assert flags(ckpt) == flags(plain)


@pytest.mark.parametrize("make", [lambda m: ts.freeze(m, "b"), lambda m: ts.freeze_except(m, "a")])
def test_nested_checkpoints_inside_the_block(make):
    _, want = nest_grads(None, make, True)
    _, got = nest_grads(True, make, True)
    same_grads(got, want)


@pytest.mark.parametrize("make", [lambda m: ts.freeze(m, "b"), lambda m: ts.freeze_except(m, "a")])
def test_nested_checkpoints_inner_frozen_after_the_block(make):
    _, want = nest_grads(None, make, False)
    _, got = nest_grads(True, make, False)
    same_grads(got, want)


def test_nested_checkpoint_backward_inside_and_after_restore_the_forward():
    """Entering and leaving contexts with checkpoints nested: torch's forward is back."""
    m = Nest(True)
    with ts.freeze(m, "a"):
        assert not forward_is_torch_s()
        with ts.unfreeze(m, "a"):
            m(X(req=True)).backward()
        assert not forward_is_torch_s()
    assert forward_is_torch_s()


# ============================================================================ 1. refused attach


class Boom(Exception):
    pass


class Declares(nn.Module):
    def __init__(self, fail=True):
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)
        self.fail = fail

    def trainable(self):
        yield "a"
        if self.fail:
            raise Boom("trainable")
        yield "b"


class Root(nn.Module):
    def __init__(self, shared=None):
        super().__init__()
        self.sub = shared if shared is not None else nn.Sequential(nn.Linear(2, 2),
                                                                   nn.Linear(2, 2))
        self.bad = Declares()

    def forward(self, x):
        return self.bad.a(self.sub(x))


def internal(model):
    """torchstruct's own state as it concerns ``model`` (matched by identity)."""
    mods, ps = list(model.modules()), list(model.parameters())
    return dict(
        states=[(i, _state.state_of(m).registrations) for i, m in enumerate(mods)
                if _state.state_of(m) is not None],  # by identity: a dead model's id is reused
        entries=[e.registrations for e in _state.entries],
        records=[(i, r.base, r.written) for i, p in enumerate(ps)
                 for r in list(_state.records.values()) if r.p is p],
        hooks=[len(m._forward_pre_hooks) for m in mods],
        flags=flags(model),
    )


REFUSED = {
    "attach": lambda r: ts.attach(r),
    "freeze": lambda r: ts.freeze(r, "bad.a"),
    "unfreeze": lambda r: ts.unfreeze(r, "sub"),
    "freeze_except": lambda r: ts.freeze_except(r, "sub"),
    "mark_trainable": lambda r: ts.mark_trainable(r, "sub", "bad"),
    "schedule": lambda r: ts.UnfreezeSchedule(r, {0: "sub", 1: None}),
}


def new_root_over_attached_sub(call, fail):
    """``r.sub`` attached with a declaration and an active context; then ``call`` on the root
    (refused by ``bad.trainable()`` when ``fail``). Returns the fingerprints and the flags
    after leaving the context and a forward with a new layer."""
    r = Root()
    r.bad.fail = fail
    ts.mark_trainable(r.sub, "1")
    ctx = ts.freeze(r.sub, "1.bias")
    ctx.__enter__()
    before = internal(r)
    if fail:
        with pytest.raises(Boom):
            REFUSED[call](r)
    after = internal(r)
    r.sub[0].weight.requires_grad_(True)  # the user's write inside the block
    ctx.__exit__(None, None, None)
    r.sub.add_module("2", nn.Linear(2, 2))
    r(torch.randn(1, 2))
    return before, after, [(n, p.requires_grad) for n, p in r.named_parameters()]


@pytest.mark.parametrize("call", list(REFUSED))
def test_refused_new_root_over_an_attached_sub_puts_everything_back(call):
    before, after, end = new_root_over_attached_sub(call, True)
    assert after == before
    _, _, control = new_root_over_attached_sub_without_call()
    assert end == control


def new_root_over_attached_sub_without_call():
    r = Root()
    ts.mark_trainable(r.sub, "1")
    ctx = ts.freeze(r.sub, "1.bias")
    ctx.__enter__()
    r.sub[0].weight.requires_grad_(True)
    ctx.__exit__(None, None, None)
    r.sub.add_module("2", nn.Linear(2, 2))
    r(torch.randn(1, 2))
    return None, None, [(n, p.requires_grad) for n, p in r.named_parameters()]


@pytest.mark.parametrize("call", list(REFUSED))
def test_refused_call_on_a_root_sharing_a_layer_with_an_attached_model(call):
    shared = nn.Linear(2, 2)
    other = nn.Sequential(shared, nn.Linear(2, 2))
    ts.mark_trainable(other, "1")
    with ts.freeze(other, "1.bias"):
        r = Root(shared)
        b_other, b_r = internal(other), internal(r)
        with pytest.raises(Boom):
            REFUSED[call](r)
        assert internal(other) == b_other and internal(r) == b_r
        assert not any(len(mm._forward_pre_hooks) for mm in r.bad.modules())
    assert flags(other) == [False, False, True, True]
    other(torch.randn(1, 2))
    assert flags(other) == [False, False, True, True]


@pytest.mark.parametrize("call", list(REFUSED))
def test_refusal_after_a_successful_attach_keeps_the_model_attached(call):
    r = Root()
    r.bad.fail = False
    ts.attach(r)
    ts.mark_trainable(r.sub, "1")
    r.bad.fail = True
    before = internal(r)
    with pytest.raises(Boom):
        REFUSED[call](r)
    assert internal(r)["hooks"] == before["hooks"] and any(before["hooks"])
    assert flags(r) == before["flags"]
    r.bad.fail = False
    r.sub.add_module("2", nn.Linear(2, 2))
    r(torch.randn(1, 2))
    assert [r.sub[i].weight.requires_grad for i in range(3)] == [False, True, False]


def test_refused_first_applications_in_one_thread_beside_contexts_in_another():
    errors = []

    def refuser():
        try:
            for _ in range(100):
                r = Root()
                with pytest.raises(Boom):
                    ts.freeze(r, "sub")
                assert not any(len(mm._forward_pre_hooks) for mm in r.modules())
                assert all(p.requires_grad for p in r.parameters())
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def user():
        try:
            m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
            for _ in range(100):
                with ts.freeze(m, "0"):
                    assert flags(m) == [False, False, True, True]
                    m(torch.randn(1, 2)).sum().backward()
                assert all(flags(m))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=refuser), threading.Thread(target=user)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_forward_is_torch_s_once_the_permanent_context_s_model_is_gone():
    """The dead entry leaves the stack at the next context change; torch's forward comes back
    at the first reentrant checkpoint run after the model is gone, which pays for it once."""
    m = nn.Sequential(nn.Linear(2, 2))
    ts.freeze(m, "0.bias")
    del m
    gc.collect()
    other = nn.Linear(2, 2)
    x = torch.randn(1, 2, requires_grad=True)
    checkpoint(other, x, use_reentrant=True).sum().backward()
    assert other.weight.grad is not None
    assert forward_is_torch_s()


# ============================================================================ 2. constant writes
def small(seed=0, shift=0.0):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Linear(2, 2))
    with torch.no_grad():
        for p in m.parameters():
            p.add_(shift)
    return m


def values(m):
    return {k: v.clone() for k, v in m.state_dict().items()}


def unchanged(a, m):
    b = values(m)
    return all(torch.equal(a[k], b[k]) for k in a)


def test_constant_lets_writes_of_unprotected_parameters_and_buffers_through():
    m, src = small(), small(shift=1.0)
    state = ts.state_dict(src)
    with ts.constant(m, "2"):
        ts.load_state_dict(m, {"0.weight": state["0.weight"]}, strict=False)
        ts.load_state_dict(m, {k: v for k, v in state.items() if k.startswith("1.running")},
                           strict=False)
        with ts.freeze(m, "2"):  # the protected layer is not trainable: polyak skips it
            ts.polyak_update(m, src, 1.0)
        other = small()
        ts.polyak_update(other, m, 0.5)  # reading protected parameters is no write
        ts.load_state_dict(other, ts.state_dict(m))
    for k in ("0.weight", "0.bias", "1.weight", "1.running_mean"):
        assert torch.equal(m.state_dict()[k], src.state_dict()[k]), k
    assert torch.equal(m[2].weight, small()[2].weight)


@pytest.mark.parametrize("what", ["load_state_dict", "polyak_update"])
@pytest.mark.parametrize("where", ["plain", "nested", "tied", "view"])
def test_constant_refuses_before_the_first_write(what, where):
    if where == "tied":
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.a = nn.Linear(2, 2)
                self.b = nn.Linear(2, 2)
                self.b.weight = self.a.weight
        m, src, block, path = M(), M(), ("b",), "a.weight"
    elif where == "view":
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                base = torch.randn(8)
                self.p = nn.Parameter(base[:4].view(2, 2))
                self.q = nn.Parameter(base[4:].view(2, 2))
        m, src, block, path = M(), M(), ("q",), "q"
    else:
        m, src, block, path = small(), small(shift=1.0), ("2.bias",), "2.bias"
    before = values(m)
    if where == "nested":
        path = "0.weight"  # the outer block's, first in order
    outer = ts.constant(m, "0") if where == "nested" else ts.constant(m, *block)
    with outer, ts.constant(m, *block):
        with pytest.raises(RuntimeError, match=f"{what}.*{path}|{path}.*{what}"):
            if what == "load_state_dict":
                ts.load_state_dict(m, {k: v.clone() for k, v in ts.state_dict(src).items()})
            else:
                ts.polyak_update(m, src, 0.5)
    assert unchanged(before, m)


def test_another_thread_s_constant_block_does_not_refuse_here():
    m, src = small(), small(shift=1.0)
    ready, done, errors = threading.Event(), threading.Event(), []

    def holder():
        try:
            with ts.constant(m):
                ready.set()
                done.wait(30)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            ready.set()

    t = threading.Thread(target=holder)
    t.start()
    ready.wait(30)
    try:
        ts.load_state_dict(m, ts.state_dict(small(shift=2.0)))
        loaded = m[1].running_mean.clone()
        ts.polyak_update(m, src, 1.0)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        m(torch.randn(3, 2)).sum().backward()
        opt.step()
    finally:
        done.set()
        t.join()
    assert not errors
    assert torch.equal(loaded, small(shift=2.0)[1].running_mean)
    assert not torch.equal(m[0].weight, src[0].weight)  # moved by the step after the polyak


def test_guarded_step_leaves_momentum_alone_and_lets_gradless_protected_through():
    m = small()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.randn(3, 2)).sum().backward()
    with ts.constant(m, "2"):
        with pytest.raises(RuntimeError, match="2.weight"):
            opt.step()
        assert not opt.state
        m[2].weight.grad = m[2].bias.grad = None
        opt.step()  # the protected layer has no gradient: nothing of it is written
    assert opt.state and m[2].weight not in opt.state


def _compiled_step_graphs(hooked):
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters
    from torch.optim import optimizer as O

    saved = dict(O._global_optimizer_pre_hooks)
    if not hooked:
        O._global_optimizer_pre_hooks.clear()
    dynamo.reset()
    counters.clear()
    try:
        torch.manual_seed(0)
        m = nn.Linear(4, 4)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        step = torch.compile(opt.step, backend="eager")
        seen = []
        for i in range(4):
            m(torch.randn(2, 4)).sum().backward()
            step()
            opt.zero_grad()
            seen.append(counters["stats"]["unique_graphs"])
        return seen, m.weight.detach().clone()
    finally:
        O._global_optimizer_pre_hooks.clear()
        O._global_optimizer_pre_hooks.update(saved)
        dynamo.reset()


def test_compiled_optimizer_step_traces_no_more_with_the_pre_hook():
    plain, w0 = _compiled_step_graphs(False)
    hooked, w1 = _compiled_step_graphs(True)
    assert hooked[-1] <= plain[-1] and hooked[1] == hooked[-1]  # nothing new per step
    assert torch.equal(w0, w1)


# ============================================================================ 3. fed leaves
class Fed(nn.Module):
    """A reentrant checkpoint whose input is a leaf outside the model, fed in several ways."""

    def __init__(self, kind="one"):
        super().__init__()
        torch.manual_seed(0)
        self.mid, self.mid2, self.out = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)
        self.kind = kind

    def forward(self, h):
        ck = reentrant
        if self.kind == "outside":  # the leaf is also used outside the checkpoint
            z = ck(self.mid, h) + h * 2
        elif self.kind == "two":  # the leaf feeds two checkpoints
            z = ck(self.mid, h) + ck(self.mid2, h)
        elif self.kind == "nested":
            z = ck(lambda t: ck(self.mid, t) + self.mid2(t), h)
        else:
            z = ck(self.mid, h)
        return self.out(torch.tanh(z)).sum()


def reentrant(fn, *args):
    return checkpoint(fn, *args, use_reentrant=True)


def backward_on_copy(model, h, asked):
    ref = copy.deepcopy(model)
    ts.detach_hooks(ref)
    ref(h.detach().clone().requires_grad_()).backward()
    named = dict(ref.named_parameters())
    return {k: named[k].grad for k in asked}


@pytest.mark.parametrize("how", ["wrt", "frozen", "tensor", "retain_graph"])
@pytest.mark.parametrize("kind", ["one", "outside", "two", "nested"])
def test_fed_leaf_gradients_equal_backward_and_its_grad_is_put_back(kind, how):
    m = Fed(kind)
    h = torch.randn(3, 4).requires_grad_()
    h.grad = torch.full((3, 4), 3.0)
    if how == "wrt":
        g = ts.structural_grad(m, lambda mm: mm(h), wrt="out")
    elif how == "frozen":
        with ts.freeze(m, "mid", "mid2"):
            g = ts.structural_grad(m, lambda mm: mm(h))
    elif how == "tensor":
        g = ts.structural_grad(m, m(h), wrt="out")
    else:
        loss = m(h)
        g = ts.structural_grad(m, loss, wrt="out", retain_graph=True)
        again = ts.structural_grad(m, loss, wrt="out")
        for a, b in zip(ts.tree.leaves(g), ts.tree.leaves(again)):
            assert torch.equal(a, b)
    want = backward_on_copy(m, h, ["out.weight", "out.bias"])
    got = ts.tree.to_flat_dict(g)
    assert list(got) == list(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert h.requires_grad and bool((h.grad == 3.0).all())
    assert all(p.grad is None and p.requires_grad for p in m.parameters())


def test_fed_leaf_that_is_another_model_s_parameter_gets_no_grad():
    prompt = nn.Linear(4, 3)
    m = Fed()
    g = ts.structural_grad(m, lambda mm: mm(prompt.weight.T.contiguous().T), wrt="out")
    ts.structural_grad(m, lambda mm: mm(prompt.weight), wrt="out")  # the leaf itself
    assert prompt.weight.grad is None and prompt.weight.requires_grad
    assert sorted(ts.tree.to_flat_dict(g)) == ["out.bias", "out.weight"]


@pytest.mark.parametrize("kind", ["hook", "prehook"])
def test_fed_leaf_with_a_hook_on_its_accumulator_is_refused(kind):
    m = Fed()
    h = torch.randn(3, 4).requires_grad_()
    acc = h.view_as(h).grad_fn.next_functions[0][0]
    calls = []
    getattr(acc, "register_" + kind)(lambda *a: calls.append(1))
    with pytest.raises(RuntimeError, match="hook"):
        ts.structural_grad(m, lambda mm: mm(h), wrt="out")
    assert not calls


def test_fed_leaf_with_a_post_accumulate_hook_is_refused():
    m = Fed()
    h = torch.randn(3, 4).requires_grad_()
    calls = []
    h.register_post_accumulate_grad_hook(lambda t: calls.append(1))
    with pytest.raises(RuntimeError, match="hook"):
        ts.structural_grad(m, lambda mm: mm(h), wrt="out")
    assert not calls and h.grad is None


# ============================================================================ 4. polyak refusal
def pair(shift=1.0):
    torch.manual_seed(0)
    src = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    tgt = copy.deepcopy(src)
    with torch.no_grad():
        for p in src.parameters():
            p.add_(shift)
    return src, tgt


def test_frozen_target_is_refused_and_unchanged():
    src, tgt = pair()
    tgt.requires_grad_(False)
    before = [p.clone() for p in tgt.parameters()]
    with pytest.raises(ValueError, match="every parameter of target was frozen by hand"):
        ts.polyak_update(tgt, src, 0.5)
    assert all(torch.equal(a, b) for a, b in zip(before, tgt.parameters()))


@pytest.mark.parametrize("wrap", ["plain", "AveragedModel"])
def test_documented_remedy_updates_every_parameter_and_restores_the_flags(wrap):
    from torch.optim.swa_utils import AveragedModel

    src, tgt = pair()
    if wrap == "AveragedModel":
        tgt = AveragedModel(tgt).module
    tgt.requires_grad_(False)
    before = [p.clone() for p in tgt.parameters()]
    with ts.unfreeze(tgt):
        ts.polyak_update(tgt, src, 0.5)
    for a, p, s in zip(before, tgt.parameters(), src.parameters()):
        assert torch.equal(p, torch.lerp(a, s, 0.5))
    assert not any(flags(tgt))
    tgt(torch.randn(1, 2))
    assert not any(flags(tgt))


def test_a_target_with_some_trainable_parameters_is_not_refused():
    src, tgt = pair()
    with ts.freeze(tgt, "0"):
        ts.polyak_update(tgt, src, 1.0)
    assert torch.equal(tgt[1].weight, src[1].weight)
    assert not torch.equal(tgt[0].weight, src[0].weight)


def test_ema_target_on_the_source_s_schedule_during_an_all_frozen_stage():
    src, tgt = pair(shift=0.0)
    schedules = [ts.UnfreezeSchedule(m, {2: None}) for m in (src, tgt)]
    try:
        for _ in range(3):
            ts.polyak_update(tgt, src, 0.1)
            for s in schedules:
                s.step()
    finally:
        for s in schedules:
            s.close()


class WithIndex(nn.Module):
    """A float layer and an integer Parameter (an index table that can never require grad)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l = nn.Linear(2, 2)
        self.idx = nn.Parameter(torch.arange(3), requires_grad=False)


def test_documented_remedy_with_an_integer_parameter_in_the_target():
    """The whole-model remedy refuses the integer parameter (it cannot require grad); the
    message names the other remedy, a selector over the floating-point parameters, which
    works."""
    src, tgt = WithIndex(), WithIndex().requires_grad_(False)
    with torch.no_grad():
        src.l.weight.add_(1)
    with pytest.raises(ValueError, match="selectors"):
        ts.polyak_update(tgt, src, 0.5)
    with pytest.raises(ValueError, match="idx"):
        with ts.unfreeze(tgt):
            pass
    with ts.unfreeze(tgt, "l"):
        ts.polyak_update(tgt, src, 0.5)
    torch.testing.assert_close(tgt.l.weight, 0.5 * (WithIndex().l.weight + src.l.weight))
    assert not any(p.requires_grad for p in tgt.parameters())


class Declared(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    def trainable(self):
        return ["b"]


def test_documented_remedy_leaves_what_a_declaration_excludes():
    """docs/structural.md: a declaration on the target still excludes what it does not list,
    inside unfreeze too (no context overrides a declaration)."""
    src, tgt = Declared(), Declared().requires_grad_(False)
    with torch.no_grad():
        for p in src.parameters():
            p.add_(1)
    with ts.unfreeze(tgt):
        ts.polyak_update(tgt, src, 0.5)
    assert torch.equal(tgt.a.weight, Declared().a.weight)
    torch.testing.assert_close(tgt.b.weight, 0.5 * (Declared().b.weight + src.b.weight))


def test_a_checkpoint_s_recomputation_leaves_another_thread_s_model_alone():
    mA = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    mB = nn.Linear(2, 2)
    calls = [0]
    ev = {k: threading.Event() for k in ("entered", "leave", "left", "recomputing", "done")}
    seen = {}

    def fn_b(h):
        calls[0] += 1
        if calls[0] == 2:  # the recomputation in backward
            ev["recomputing"].set()
            ev["done"].wait(30)
        return mB(h)

    def thread_a():
        try:
            with ts.freeze(mA, "0"):
                ev["entered"].set()
                ev["leave"].wait(30)
            ev["left"].set()
            ev["recomputing"].wait(30)
            seen["flag"] = mA[0].weight.requires_grad
            mA(torch.randn(1, 2)).sum().backward()
            seen["grad"] = mA[0].weight.grad is not None
        finally:
            ev["entered"].set()
            ev["left"].set()
            ev["done"].set()

    t = threading.Thread(target=thread_a)
    t.start()
    ev["entered"].wait(30)
    loss = checkpoint(fn_b, torch.randn(1, 2).requires_grad_(), use_reentrant=True).sum()
    ev["leave"].set()
    ev["left"].wait(30)
    loss.backward()
    t.join()
    assert seen == {"flag": True, "grad": True}
    assert mA[0].weight.requires_grad


# ---------------------------------------------------------------------------- DDP (2 processes)
def _ddp_checkpoint_after_block(rank, checks):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from _spawn import check

    finals = {}
    for mode in (None, True):
        m = Net(mode)
        ddp = DDP(m, find_unused_parameters=True)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)

        @ts.freeze(m, "mid")
        def step(x):
            return ddp(x).pow(2).mean()

        for i in range(3):
            opt.zero_grad()
            step(X(10 * i + rank)).backward()
            opt.step()
        finals[mode] = ([p.detach().clone() for p in m.parameters()], grads(m), flags(m))
    (pa, ga, fa), (pb, gb, fb) = finals[None], finals[True]
    check(checks, "parameters", all(torch.allclose(a, b, atol=1e-6) for a, b in zip(pa, pb)))
    check(checks, "grads", all((ga[k] is None) == (gb[k] is None) for k in ga), str(gb.keys()))
    check(checks, "flags", fa == fb and all(fb))
    check(checks, "forward", forward_is_torch_s())


@pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")
def test_ddp_reentrant_checkpoint_backward_after_a_decorated_freeze():
    from _spawn import failed, gloo_available, run

    if not gloo_available():
        pytest.skip("gloo not available")
    assert not failed(run(_ddp_checkpoint_after_block))


# ---------------------------------------------------------------------------- HF Llama
def llama(ckpt):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=3, num_attention_heads=2,
                                   num_key_value_heads=2, max_position_embeddings=16)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.config.use_cache = False
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        model.enable_input_require_grads()
    model.train()
    return model


IDS = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(1))


def close_grads(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] is None) == (b[k] is None), k
        if a[k] is not None:
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-7, msg=k)


@pytest.mark.parametrize("how", ["decorated freeze_except", "schedule step before backward",
                                 "structural_grad in a freeze"])
def test_llama_reentrant_checkpointing_with_contexts_matches_no_checkpointing(how):
    out = {}
    for ckpt in (False, True):
        m = llama(ckpt)
        if how == "decorated freeze_except":
            @ts.freeze_except(m, "model.layers.1", "lm_head")
            def step():
                return m(input_ids=IDS, labels=IDS).loss

            step().backward()
            out[ckpt] = grads(m)
        elif how == "schedule step before backward":
            s = ts.UnfreezeSchedule(m, {0: "lm_head", 1: ["model.layers.2", "lm_head"],
                                        2: None})
            loss = m(input_ids=IDS, labels=IDS).loss
            s.step()  # the next stage trains more; this loss is the previous stage's
            loss.backward()
            out[ckpt] = grads(m)
            s.close()
        else:
            with ts.freeze(m, "model.layers.0", "model.embed_tokens"):
                g = ts.structural_grad(m, lambda mm: mm(input_ids=IDS, labels=IDS).loss)
            assert all(p.grad is None for p in m.parameters())
            out[ckpt] = ts.tree.to_flat_dict(g)
    close_grads(out[True], out[False])
    if how != "structural_grad in a freeze":
        assert any(v is not None for k, v in out[True].items() if "layers.1." in k or
                   "layers.2." in k or "lm_head" in k)


# ---------------------------------------------------------------------------- structural_grad
def _sg_with_context(mode, order, fail=False):
    """structural_grad on Net(mode) with a freeze of mid.0 entered / left in ``order``."""
    m = Net(mode)
    ctx = []  # a context applies when it is made: made where it is entered
    if order == "context around":
        with ts.freeze(m, "mid.0"):
            return m, ts.structural_grad(m, lambda mm: loss_or_fail(mm, fail))
    if order == "context inside the loss":
        def loss(mm):
            with ts.freeze(mm, "mid.0"):
                return loss_or_fail(mm, fail)
        return m, ts.structural_grad(m, loss)
    if order == "entered in the loss, left after":
        def loss(mm):
            ctx.append(ts.freeze(mm, "mid.0").__enter__())
            return loss_or_fail(mm, fail)
        try:
            return m, ts.structural_grad(m, loss)
        finally:
            ctx[0].__exit__(None, None, None)
    if order == "entered before, left in the loss":
        ctx.append(ts.freeze(m, "mid.0").__enter__())

        def loss(mm):
            try:
                return loss_or_fail(mm, fail)
            finally:
                ctx[0].__exit__(None, None, None)
        return m, ts.structural_grad(m, loss)
    raise AssertionError(order)


def loss_or_fail(m, fail):
    out = m(X()).pow(2).mean()
    if fail:
        raise Boom("loss")
    return out


ORDERS = ["context around", "context inside the loss", "entered in the loss, left after",
          "entered before, left in the loss"]


@pytest.mark.parametrize("order", ORDERS)
def test_structural_grad_and_contexts_in_any_order_match_no_checkpointing(order):
    if order == "entered in the loss, left after":  # a flag turned off during the loss call
        for mode in (None, True):
            with pytest.raises(RuntimeError, match="stopped requiring grad"):
                _sg_with_context(mode, order)
            assert forward_is_torch_s() and not _state.entries
        return
    plain, want = _sg_with_context(None, order)
    ckpt, got = _sg_with_context(True, order)
    want, got = ts.tree.to_flat_dict(want), ts.tree.to_flat_dict(got)
    assert list(got) == list(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert flags(ckpt) == flags(plain) and all(p.grad is None for p in ckpt.parameters())
    assert forward_is_torch_s()


@pytest.mark.parametrize("order", ORDERS)
def test_structural_grad_and_contexts_raising_put_torch_s_forward_back(order):
    with pytest.raises(Boom):
        _sg_with_context(True, order, fail=True)
    assert forward_is_torch_s()


def test_a_recomputation_that_raises_leaves_the_flags_as_they_are():
    m = Net(True)
    calls, inner = [0], m.mid.forward

    def flaky(h):
        calls[0] += 1
        if calls[0] == 2:
            raise Boom("recompute")
        return inner(h)

    m.mid.forward = flaky
    with ts.freeze(m, "mid"):
        loss = m(X()).pow(2).mean()
    with pytest.raises(Boom):
        loss.backward()
    assert all(flags(m))


@pytest.mark.parametrize("change", ["registration in mid", "mark_trainable"])
def test_a_change_between_forward_and_backward_after_the_block(change):
    out = {}
    for mode in (None, True):
        m = Net(mode)
        with ts.freeze(m, "mid"):
            loss = m(X()).pow(2).mean()
        if change == "registration in mid":
            m.mid.add_module("extra", nn.Identity())
        else:
            ts.mark_trainable(m.mid, "0")
        loss.backward()
        out[mode] = (grads(m), flags(m))
    same_grads(out[True][0], out[None][0])
    assert out[True][1] == out[None][1]


# ---------------------------------------------------------------------------- 1. DDP flag guards
@pytest.fixture
def one_process_group():
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("gloo not available")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


GUARDED = {
    "freeze": lambda m: ts.freeze(m, "0"),
    "freeze_except": lambda m: ts.freeze_except(m, "1"),
    "mark_trainable": lambda m: ts.mark_trainable(m, "1"),
    "schedule": lambda m: ts.UnfreezeSchedule(m, {0: "1", 1: None}),
    "unfreeze": lambda m: ts.unfreeze(m, "0"),
}


@pytest.mark.parametrize("sub_attached", [False, True])
@pytest.mark.parametrize("call", list(GUARDED))
def test_a_ddp_guard_refusing_the_first_application_leaves_nothing(one_process_group, call,
                                                                    sub_attached):
    from torch.nn.parallel import DistributedDataParallel as DDP

    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    if call == "unfreeze":
        m[0].requires_grad_(False)
    if sub_attached:
        ts.mark_trainable(m[1], "weight", "bias")  # attached, admits everything
    ddp = DDP(m)
    before = internal(m)
    with pytest.raises(RuntimeError, match="DistributedDataParallel"):
        GUARDED[call](m)
    assert internal(m) == before
    assert (id(m[1]) in _state.states) == sub_attached and id(m) not in _state.states
    ddp(torch.randn(3, 2)).sum().backward()
    assert all(p.grad is not None for p in m.parameters() if p.requires_grad)


# ---------------------------------------------------------------------------- 5. more checkpoints
class Seq(nn.Module):
    def __init__(self, mode):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 4)
        self.body = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
        self.mode = mode

    def forward(self, x):
        h = self.inp(x)
        if self.mode is None:
            return self.body(h).sum()
        return checkpoint_sequential(self.body, 2, h, use_reentrant=True).sum()


@pytest.mark.parametrize("sel", [("body.1", "body.2"), ("body.3",), ("body.0",)])
def test_checkpoint_sequential_after_a_decorated_freeze(sel):
    out = {}
    for mode in (None, True):
        m = Seq(mode)

        @ts.freeze(m, *sel)
        def step():
            return m(X())

        step().backward()
        out[mode] = (grads(m), flags(m))
    same_grads(out[True][0], out[None][0])
    assert out[True][1] == out[None][1]


def test_manual_write_between_forward_and_backward_inside_the_block():
    out = {}
    for mode in (None, True):
        m = Net(mode)
        with ts.freeze(m, "mid.0"):
            loss = m(X()).pow(2).mean()
            m.mid[2].requires_grad_(False)  # undecided by the context
            m.mid[0].requires_grad_(True)  # decided by it
            loss.backward()
        out[mode] = (grads(m), flags(m))
    same_grads(out[True][0], out[None][0])
    assert out[True][1] == out[None][1]


@pytest.mark.parametrize("backward", ["inside", "after"])
def test_compiled_model_with_a_reentrant_checkpoint_in_a_context(backward):
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    finals = {}
    for mode in (None, True):
        dynamo.reset()
        counters.clear()
        m = Net(mode)
        compiled = torch.compile(m, backend="aot_eager")
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        graphs = []
        for i in range(4):
            with ts.freeze(m, "mid.0"):
                loss = compiled(X(i)).pow(2).mean()
                if backward == "inside":
                    loss.backward()
            if backward == "after":
                loss.backward()
            assert m.mid[0].weight.grad is None
            opt.step()
            opt.zero_grad()
            graphs.append(counters["stats"]["unique_graphs"])
        assert graphs[1] == graphs[-1], graphs  # no new graph per step
        finals[mode] = [p.detach().clone() for p in m.parameters()]
    dynamo.reset()
    for a, b in zip(finals[None], finals[True]):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("call", list(REFUSED) + [None])
def test_registration_inside_the_sub_s_block_after_a_refused_root(call):
    """The sub's active context, rebased twice by the refused root, still measures the
    registrations into its tree since it was entered: same flags as with no refused call."""
    def run(refused):
        r = Root()
        ts.attach(r.sub)
        with ts.freeze_except(r.sub, "0"):
            if refused is not None:
                with pytest.raises(Boom):
                    REFUSED[refused](r)
            r.sub.add_module("2", nn.Linear(2, 2))
            r.sub(torch.randn(1, 2))
            inside = flags(r.sub)
        r.sub(torch.randn(1, 2))
        return inside, flags(r.sub), internal(r.sub)["hooks"]

    assert run(call) == run(None)


def test_constant_leaves_buffers_of_a_protected_module_and_same_object_loads_alone():
    m = small()
    with ts.constant(m, "1"):
        ts.load_state_dict(m, {"1.running_mean": torch.ones(2)}, strict=False)
        ts.load_state_dict(m, {"1.weight": m[1].weight}, strict=False)  # nothing to write
        with pytest.raises(RuntimeError, match="1.weight"):
            ts.load_state_dict(m, {"1.weight": m[1].weight.detach().clone()}, strict=False)
    assert torch.equal(m[1].running_mean, torch.ones(2))


SWITCHES = {
    "sub-scope, then another": (lambda m: ts.freeze(m.mid, "0"), lambda m: ts.freeze(m, "mid.2")),
    "freeze, then freeze_except": (lambda m: ts.freeze(m, "mid.0"),
                                   lambda m: ts.freeze_except(m, "inp")),
    "other model's context, then m's": (lambda m: ts.freeze(nn.Linear(1, 1)),
                                        lambda m: ts.freeze(m, "mid")),
    "unfreeze, then freeze": (lambda m: ts.unfreeze(m, "mid"), lambda m: ts.freeze(m, "inp")),
}


@pytest.mark.parametrize("name", list(SWITCHES))
def test_forward_in_one_context_backward_in_another(name):
    first, second = SWITCHES[name]
    out = {}
    for mode in (None, True):
        m = Net(mode)
        if name.startswith("unfreeze"):
            m.mid.requires_grad_(False)
        with first(m):
            loss = m(X()).pow(2).mean()
        with second(m):
            loss.backward()
        out[mode] = (grads(m), flags(m))
    same_grads(out[True][0], out[None][0])
    assert out[True][1] == out[None][1]


@pytest.mark.parametrize("how", ["by hand", "context around", "context in the loss"])
def test_a_dead_checkpoint_is_still_refused_with_a_context_active(how):
    m = Net(True)
    loss = lambda mm: mm(X()).pow(2).mean()  # noqa: E731
    with pytest.raises(ValueError, match="mid.0.weight"):
        if how == "by hand":
            m.inp.requires_grad_(False)
            ts.structural_grad(m, loss)
        elif how == "context around":
            with ts.freeze(m, "inp"):
                ts.structural_grad(m, loss)
        else:
            def in_context(mm):
                with ts.freeze(mm, "inp"):
                    return loss(mm)
            ts.structural_grad(m, in_context)
    assert forward_is_torch_s() and all(p.grad is None for p in m.parameters())


@pytest.mark.parametrize("milestones", [{0: "out", 1: "mid"}, {0: ["inp", "out"], 1: None}])
def test_schedule_stage_change_between_forward_and_backward(milestones):
    out = {}
    for mode in (None, True):
        m = Net(mode)
        s = ts.UnfreezeSchedule(m, milestones)
        loss = m(X()).pow(2).mean()
        s.step()
        loss.backward()
        out[mode] = (grads(m), flags(m))
        s.close()
    same_grads(out[True][0], out[None][0])
    assert out[True][1] == out[None][1]


@pytest.mark.parametrize("kind", ["one", "outside", "two", "nested"])
def test_fed_leaf_with_the_checkpointed_layers_asked(kind):
    m = Fed(kind)
    h = torch.randn(3, 4).requires_grad_()
    h.grad = torch.full((3, 4), 3.0)
    got = ts.tree.to_flat_dict(ts.structural_grad(m, lambda mm: mm(h), wrt=["mid", "mid2"]))
    want = backward_on_copy(m, h, list(got))
    for k, g in got.items():  # a layer the loss does not use gets zeros (documented)
        assert torch.equal(g, torch.zeros_like(g) if want[k] is None else want[k]), k
    assert bool((h.grad == 3.0).all()) and all(p.grad is None for p in m.parameters())
