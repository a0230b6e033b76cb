"""``ts.structural_grad(model, loss_callable, wrt=...)`` as a block, tried as a suspicious user.

The call switches flags for the duration of its loss (``torchstruct/grad.py``, class ``_only``)
and, on exit, sets each flag it wrote to what it would be without the call, computed then; a
change made inside the loss (a context entered or lifted, a schedule step, a hand write, a
declaration changed, a module added or replaced, parameters replaced) stands, and applications
during the loss keep the call's flags (``_state.held_flags``, ``hooks.State.apply``).

Audited here: nested calls (other ``wrt``, ``create_graph=True``, ``value_and_grad``), attached
and unattached models, declarations, contexts around and inside the loss, hand writes (PEFT-like),
exceptions (``ValueError``, ``KeyboardInterrupt``) at several points, threads orchestrated with
``threading.Event`` (always with timeouts), a layer shared by two attached roots, tied
parameters, and ``torch.utils.checkpoint`` (reentrant and not) inside the loss.

Every gradient is compared with plain PyTorch on a ``deepcopy`` of the model with the flags set
by hand (``torch.autograd.grad``, or ``.backward()`` through a reentrant checkpoint), and after
every call the flags are compared with torchstruct's reads (attached models) or with the flags
before the call (unattached ones, where nothing changed).

Each case that went wrong here is fixed; its test says what is expected.
"""
import copy
import threading
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import torchstruct as ts

X = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
TIMEOUT = 5.0


# --------------------------------------------------------------------------- helpers
def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def flags(m):
    return [p.requires_grad for p in m.parameters()]


def reads(m):
    return [ts.is_trainable(m, p) for p in m.parameters()]


def agree(m):
    """The flags PyTorch sees are torchstruct's reads."""
    assert flags(m) == reads(m), (flags(m), reads(m))


def sq(m):
    return m(X).pow(2).sum()


def reference(model, loss_fn, paths, backward=False):
    """The gradients of ``loss_fn`` w.r.t. ``paths`` in plain PyTorch: a deepcopy of ``model``
    without hooks, exactly ``paths`` requiring grad (set by hand)."""
    plain = copy.deepcopy(model)
    ts.detach_hooks(plain)
    named = dict(plain.named_parameters())
    for p in plain.parameters():
        p.requires_grad_(False)
    asked = [named[path] for path in paths]
    for p in asked:
        p.requires_grad_(True)
    loss = loss_fn(plain)
    if backward:  # reentrant checkpoints refuse torch.autograd.grad
        loss.backward()
        got = [p.grad for p in asked]
    else:
        got = torch.autograd.grad(loss, asked, allow_unused=True)
    return {path: torch.zeros_like(p) if g is None else g
            for path, p, g in zip(paths, asked, got)}


def same(tree, want, exact=False):
    flat = ts.tree.to_flat_dict(tree)
    assert list(flat) == list(want), (list(flat), list(want))
    for path in want:
        ok = torch.equal if exact else (lambda a, b: torch.allclose(a, b, atol=1e-6))
        assert ok(flat[path], want[path]), path


def run_threads(*targets):
    threads = [threading.Thread(target=t, daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(3 * TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a thread hangs"


class Declared(nn.Module):
    """A declaration: only ``body`` and ``head`` train; ``stem`` is frozen by it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.stem, self.body, self.head = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def trainable(self):
        return ["body", "head"]

    def forward(self, x):
        return self.head(torch.tanh(self.body(torch.tanh(self.stem(x)))))


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.emb = nn.Embedding(10, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, t):
        return self.head(torch.tanh(self.mid(self.emb(t))))


TOKENS = torch.tensor([[1, 2, 3], [4, 5, 6]])


def lm_loss(m):
    return m(TOKENS).pow(2).sum()


class Ck(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        torch.manual_seed(3)
        self.a, self.b, self.c = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2)
        self.reentrant = reentrant

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = checkpoint(self.b, h, use_reentrant=self.reentrant)
        return self.c(torch.tanh(h))


# --------------------------------------------------------------------------- baseline
@pytest.mark.parametrize("attached", [False, True])
@pytest.mark.parametrize("wrt, paths", [("0", ["0.weight", "0.bias"]),
                                        ("2.bias", ["2.bias"]),
                                        (["0.weight", "2"], ["0.weight", "2.weight", "2.bias"])])
def test_plain_call_matches_torch_and_restores(attached, wrt, paths):
    m = mlp()
    if attached:
        ts.attach(m)
    before = flags(m)
    same(ts.structural_grad(m, sq, wrt=wrt), reference(m, sq, paths), exact=True)
    assert flags(m) == before
    agree(m)
    assert all(p.grad is None for p in m.parameters())


def test_call_inside_freeze_asks_a_frozen_param_and_keeps_the_context():
    m = mlp()
    with ts.freeze(m, "0"):
        g = ts.structural_grad(m, sq, wrt="0")
        assert flags(m) == [False, False, True, True]
        agree(m)
    same(g, reference(m, sq, ["0.weight", "0.bias"]), exact=True)
    assert all(flags(m))


def test_declaration_frozen_param_in_wrt():
    m = Declared()
    ts.attach(m)
    assert flags(m) == [False, False, True, True, True, True]
    g = ts.structural_grad(m, sq, wrt="stem")
    same(g, reference(m, sq, ["stem.weight", "stem.bias"]), exact=True)
    assert flags(m) == [False, False, True, True, True, True]
    agree(m)


def test_value_and_grad_with_wrt_and_aux():
    m = mlp()
    ts.attach(m)

    def fn(mm, x):
        out = mm(x)
        return out.pow(2).sum(), out.detach()

    (value, aux), g = ts.value_and_grad(fn, m, X, has_aux=True, wrt="2")
    assert torch.equal(value, sq(m).detach()) and aux.shape == (5, 2)
    same(g, reference(m, sq, ["2.weight", "2.bias"]), exact=True)
    assert all(flags(m))
    agree(m)


def test_norm_statistics_update_as_outside_the_call():
    torch.manual_seed(4)
    m = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 1))
    ts.attach(m)
    plain = copy.deepcopy(m)
    ts.detach_hooks(plain)
    g = ts.structural_grad(m, sq, wrt="2")
    plain(X)
    assert torch.equal(m[1].running_mean, plain[1].running_mean)
    assert int(m[1].num_batches_tracked) == 1
    assert torch.allclose(ts.tree.to_flat_dict(g)["2.weight"],
                          reference(plain, sq, ["2.weight"])["2.weight"], atol=1e-6)
    agree(m)


# --------------------------------------------------------------------------- inside the loss
def test_applications_during_the_loss_keep_the_calls_flags():
    """A registration, ts.attach and a context entered and left inside the loss: each
    application keeps exactly the asked parameters requiring grad."""
    m = mlp()
    ts.attach(m)
    seen = []

    def loss(mm):
        mm.add_module("extra", nn.Identity())  # a registration: the next forward applies
        out = mm(X).pow(2).sum()
        seen.append(flags(mm))
        ts.attach(mm)
        seen.append(flags(mm))
        with ts.unfreeze(mm):
            seen.append(flags(mm))
        seen.append(flags(mm))
        assert ts.is_trainable(mm, "0.weight")  # reads are the model's own, not the call's
        return out

    g = ts.structural_grad(m, loss, wrt="2")
    assert seen == [[False, False, True, True]] * 4
    same(g, reference(m, sq, ["2.weight", "2.bias"]), exact=True)
    assert all(flags(m))
    agree(m)


def test_bare_freeze_entered_in_the_loss_stands_then_lifts():
    m = mlp()
    ts.attach(m)
    held = []

    def loss(mm):
        held.append(ts.freeze(mm, "2"))  # the asked layer itself
        assert mm[2].weight.requires_grad  # the call holds it
        return sq(mm)

    g = ts.structural_grad(m, loss, wrt="2")
    same(g, reference(m, sq, ["2.weight", "2.bias"]), exact=True)
    assert flags(m) == [True, True, False, False]
    agree(m)
    held[0].__exit__(None, None, None)
    assert all(flags(m))
    agree(m)


def test_context_lifted_in_the_loss_stays_lifted():
    m = mlp()
    ctx = ts.freeze_except(m, "2")

    def loss(mm):
        ctx.__exit__(None, None, None)
        return sq(mm)

    g = ts.structural_grad(m, loss, wrt="0.bias")
    same(g, reference(m, sq, ["0.bias"]), exact=True)
    assert all(flags(m))
    agree(m)


def test_schedule_step_in_the_loss_stands():
    m = mlp()
    sched = ts.UnfreezeSchedule(m, {0: ["2"], 1: ["0"]})
    assert flags(m) == [False, False, True, True]

    def loss(mm):
        sched.step()
        return sq(mm)

    g = ts.structural_grad(m, loss, wrt="2")
    same(g, reference(m, sq, ["2.weight", "2.bias"]), exact=True)
    assert all(flags(m))
    agree(m)


def test_mark_trainable_made_and_removed_in_the_loss():
    m = mlp()

    def made(mm):
        ts.mark_trainable(mm[0], "bias")
        return sq(mm)

    ts.structural_grad(m, made, wrt="2")
    assert flags(m) == [False, True, True, True]
    agree(m)

    def removed(mm):
        ts.mark_trainable(mm[0], None)
        return sq(mm)

    g = ts.structural_grad(m, removed, wrt="0.weight")  # asks the declaration-frozen weight
    same(g, reference(m, sq, ["0.weight"]), exact=True)
    assert all(flags(m))
    agree(m)

    def freezes_the_asked(mm):  # a declaration made in the loss freezes the asked layer
        ts.mark_trainable(mm, "0")
        assert mm[2].weight.requires_grad  # the call holds it
        return sq(mm)

    g = ts.structural_grad(m, freezes_the_asked, wrt="2")
    same(g, reference(m, sq, ["2.weight", "2.bias"]), exact=True)
    assert flags(m) == [True, True, False, False]
    agree(m)
    ts.mark_trainable(m, None)
    assert all(flags(m))


def test_hand_writes_in_the_loss_stand():
    """A write the call can see (another value than the one it wrote) stands: on a
    non-asked parameter set True, on a parameter frozen before the call."""
    m = mlp()
    m[2].bias.requires_grad_(False)  # frozen by hand before: not asked, the call keeps False

    def loss(mm):
        mm[0].bias.requires_grad_(True)  # the call had switched it off
        mm[2].bias.requires_grad_(True)
        return sq(mm)

    g = ts.structural_grad(m, loss, wrt="0.weight")
    same(g, reference(m, sq, ["0.weight"]), exact=True)
    assert all(flags(m))

    m = mlp()  # unattached, frozen by hand before the call (PEFT-like), and asked
    m[0].requires_grad_(False)
    g = ts.structural_grad(m, sq, wrt="0")
    same(g, reference(m, sq, ["0.weight", "0.bias"]), exact=True)
    assert flags(m) == [False, False, True, True]

    m = mlp()
    ts.attach(m)
    with ts.freeze(m, "2"):
        def loss2(mm):
            mm[0].weight.requires_grad_(True)  # asked: a no-op
            mm[2].weight.requires_grad_(True)  # not asked, frozen by the context
            return sq(mm)

        ts.structural_grad(m, loss2, wrt="0")
        assert flags(m) == [True, True, True, False]
        agree(m)
    assert all(flags(m))
    agree(m)


@pytest.mark.parametrize("attached", [False, True])
def test_asked_param_switched_off_by_hand_raises_and_the_write_stands(attached):
    m = mlp()
    if attached:
        ts.attach(m)

    def loss(mm):
        out = sq(mm)
        mm[2].weight.requires_grad_(False)
        return out

    with pytest.raises(RuntimeError, match="'2.weight' stopped requiring grad"):
        ts.structural_grad(m, loss, wrt="2")
    assert flags(m) == [True, True, False, True]
    if attached:
        agree(m)


@pytest.mark.parametrize("attached", [False, True])
def test_module_replaced_in_the_loss(attached):
    m = mlp()
    if attached:
        ts.attach(m)
    old = list(m[0].parameters())

    def loss(mm):
        out = sq(mm)
        mm[0] = nn.Linear(3, 4)  # plain PyTorch: new parameters require grad
        return out

    ts.structural_grad(m, loss, wrt="2")
    assert all(flags(m)) and all(p.requires_grad for p in old)
    if attached:
        agree(m)


@pytest.mark.parametrize("attached", [False, True])
@pytest.mark.parametrize("forward_after", [False, True])
def test_module_deleted_in_the_loss(attached, forward_after):
    m = mlp()
    if attached:
        ts.attach(m)
    old = list(m[0].parameters())

    def loss(mm):
        out = sq(mm)
        del mm[0]
        if forward_after:
            mm(torch.randn(2, 4))
        return out

    ts.structural_grad(m, loss, wrt="2")
    assert all(flags(m)) and all(p.requires_grad for p in old)
    if attached:
        agree(m)


@pytest.mark.parametrize("attached", [False, True])
def test_load_state_dict_assign_in_the_loss(attached):
    m = mlp()
    if attached:
        ts.attach(m)
    state = {k: v.detach().clone() for k, v in m.state_dict().items()}

    def loss(mm):
        out = sq(mm)
        mm.load_state_dict(state, assign=True)
        return out

    ts.structural_grad(m, loss, wrt="2")
    plain = mlp()
    plain.load_state_dict(state, assign=True)
    assert flags(plain) == [True] * 4  # what PyTorch gives without the call
    assert flags(m) == [True] * 4
    if attached:
        agree(m)


def test_load_state_dict_assign_then_forward_in_the_loss_attached():
    m = mlp()
    ts.attach(m)
    state = {k: v.detach().clone() for k, v in m.state_dict().items()}

    def loss(mm):
        out = sq(mm)
        mm.load_state_dict(state, assign=True)
        mm(X)  # the registration is applied here
        return out

    ts.structural_grad(m, loss, wrt="2")
    assert flags(m) == [True] * 4
    agree(m)


@pytest.mark.parametrize("attached", [False, True])
def test_peft_like_freeze_and_adapter_in_the_loss_is_not_undone_silently(attached):
    m = mlp()
    if attached:
        ts.attach(m)

    def loss(mm):
        out = sq(mm)
        mm[0].weight.requires_grad_(False)  # the base (not asked)
        mm[0].bias.requires_grad_(False)
        mm.append(nn.Linear(2, 2))  # the adapter
        return out

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ts.structural_grad(m, loss, wrt="2")
    warned = any(issubclass(w.category, ts.RestoredFlagsWarning) for w in caught)
    assert warned or flags(m)[:2] == [False, False]


def test_context_with_block_inside_the_loss_then_interrupt():
    m = mlp()
    ts.attach(m)

    def loss(mm):
        with ts.freeze(mm, "0"):
            mm(X)
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ts.structural_grad(m, loss, wrt="2")
    assert all(flags(m))
    agree(m)


@pytest.mark.parametrize("exc", [ValueError, KeyboardInterrupt])
@pytest.mark.parametrize("where", ["before", "after_forward", "after_bare_context"])
@pytest.mark.parametrize("attached", [False, True])
def test_exception_from_the_loss(exc, where, attached):
    m = mlp()
    if attached:
        ts.attach(m)
    entered = []

    def loss(mm):
        if where != "before":
            mm(X)
        if where == "after_bare_context":
            entered.append(ts.freeze_except(mm, "2"))
        raise exc("boom")

    with pytest.raises(exc):
        ts.structural_grad(m, loss, wrt="0")
    if entered:
        assert flags(m) == [False, False, True, True]
        agree(m)
        entered[0].__exit__(None, None, None)
    assert all(flags(m))
    if attached:
        agree(m)
    same(ts.structural_grad(m, sq, wrt="0"), reference(m, sq, ["0.weight", "0.bias"]), exact=True)


# --------------------------------------------------------------------------- nesting
@pytest.mark.parametrize("inner_wrt, inner_cg", [("2", False), ("*", False), ("0", True)])
def test_nested_call_that_switches_nothing_off_for_the_outer(inner_wrt, inner_cg):
    m = mlp()
    ts.attach(m)
    inner = {}

    def small(mm):
        return mm(X).sum()

    def loss(mm):
        out = sq(mm)
        inner["g"] = ts.structural_grad(mm, small, wrt=inner_wrt, create_graph=inner_cg)
        assert mm[2].weight.requires_grad  # back to the outer call's flags
        assert not mm[0].weight.requires_grad
        return out

    g = ts.structural_grad(m, loss, wrt="2")
    same(g, reference(m, sq, ["2.weight", "2.bias"]), exact=True)
    inner_paths = {"2": ["2.weight", "2.bias"], "*": ["0.weight", "0.bias", "2.weight", "2.bias"],
                   "0": ["0.weight", "0.bias"]}[inner_wrt]
    same(inner["g"], reference(m, small, inner_paths))
    assert all(flags(m))
    agree(m)


def test_nested_call_on_another_model():
    a, b = mlp(0), mlp(1)
    ts.attach(a)
    inner = {}

    def loss(mm):
        inner["g"] = ts.structural_grad(b, sq, wrt="0")
        return sq(mm)

    g = ts.structural_grad(a, loss, wrt="2")
    same(g, reference(a, sq, ["2.weight", "2.bias"]), exact=True)
    same(inner["g"], reference(b, sq, ["0.weight", "0.bias"]), exact=True)
    assert all(flags(a)) and all(flags(b))


def test_outer_call_without_wrt_around_a_nested_wrt_call():
    m = mlp()
    ts.attach(m)
    paths = ["0.weight", "0.bias", "2.weight", "2.bias"]

    def loss(mm):
        out = sq(mm)
        ts.structural_grad(mm, lambda q: q(X).sum(), wrt="2")
        assert all(flags(mm))
        return out

    same(ts.structural_grad(m, loss), reference(m, sq, paths), exact=True)
    assert all(flags(m))
    agree(m)


@pytest.mark.parametrize("inner_wrt", ["2", "*"])
def test_nested_call_that_raises_is_caught_by_the_outer_loss(inner_wrt):
    m = mlp()
    ts.attach(m)

    def failing(mm):
        mm(X)
        raise ValueError("inner")

    def loss(mm):
        out = sq(mm)
        with pytest.raises(ValueError, match="inner"):
            ts.structural_grad(mm, failing, wrt=inner_wrt)
        assert flags(mm) == [False, False, True, True]  # the outer call's flags again
        return out + mm(X).sum()

    g = ts.structural_grad(m, loss, wrt="2")
    same(g, reference(m, lambda q: sq(q) + q(X).sum(), ["2.weight", "2.bias"]))
    assert all(flags(m))
    agree(m)


def test_nested_call_without_wrt_inside_a_wrt_call():
    m = mlp()
    ts.attach(m)
    inner = {}

    def small(mm):
        return mm(X).sum()

    def loss(mm):
        out = sq(mm)
        inner["g"] = ts.structural_grad(mm, small)
        return out

    ts.structural_grad(m, loss, wrt="2")
    same(inner["g"], reference(m, small, ["0.weight", "0.bias", "2.weight", "2.bias"]))
    assert all(flags(m))


@pytest.mark.parametrize("forward", ["before_inner", "after_inner"])
def test_nested_call_with_another_wrt_same_thread(forward):
    m = mlp()
    inner = {}

    def small(mm):
        return mm(X).sum()

    def loss(mm):
        out = sq(mm) if forward == "before_inner" else None
        inner["g"] = ts.structural_grad(mm, small, wrt="2")
        return sq(mm) if out is None else out

    g = ts.structural_grad(m, loss, wrt="0")
    same(g, reference(m, sq, ["0.weight", "0.bias"]), exact=True)
    same(inner["g"], reference(m, small, ["2.weight", "2.bias"]))
    assert all(flags(m))


def test_nested_call_inside_a_create_graph_call():
    m = mlp()
    ts.attach(m)

    def loss(mm):
        out = sq(mm)
        ts.structural_grad(mm, lambda q: q(X).sum(), wrt="0")
        return out

    g = ts.structural_grad(m, loss, wrt="2", create_graph=True)
    want = torch.autograd.grad(sq(m), [m[2].weight, m[2].bias], create_graph=True)
    assert all(torch.allclose(a, b) for a, b in zip(ts.tree.leaves(g), want))
    assert g["2"]["weight"].requires_grad
    assert all(flags(m))
    agree(m)


def test_nested_value_and_grad_with_another_wrt():
    m = mlp()
    ts.attach(m)

    def fn(mm):
        out = sq(mm)
        ts.value_and_grad(lambda q: q(X).sum(), mm, wrt="0")
        return out

    value, g = ts.value_and_grad(fn, m, wrt="2")
    assert torch.equal(value, sq(m).detach())
    same(g, reference(m, sq, ["2.weight", "2.bias"]), exact=True)
    agree(m)


def test_nested_call_on_a_model_sharing_the_asked_layer():
    shared = nn.Linear(3, 3)
    a = nn.Sequential(shared, nn.Linear(3, 1))
    b = nn.Sequential(shared, nn.Linear(3, 2))
    ts.attach(a)
    ts.attach(b)

    def loss(mm):
        ts.structural_grad(b, sq, wrt="1")
        return sq(mm)

    g = ts.structural_grad(a, loss, wrt="0")
    same(g, reference(a, sq, ["0.weight", "0.bias"]), exact=True)
    agree(a)
    agree(b)


def test_create_graph_keeps_other_flags_inside_a_freeze():
    """keep_others: the asked parameters on, every other flag as it is (frozen stays frozen),
    so the gradient is differentiable w.r.t. the trainable ones only, as torch with those
    flags set by hand."""
    m = mlp()
    with ts.freeze(m, "0.weight"):
        g = ts.structural_grad(m, sq, wrt="2.weight", create_graph=True)
        penalty = g["2"]["weight"].pow(2).sum()
        gp = ts.structural_grad(m, penalty, wrt=["0.bias"])
        assert flags(m) == [False, True, True, True]
        agree(m)
    plain = copy.deepcopy(m)
    plain[0].weight.requires_grad_(False)
    (w,) = torch.autograd.grad(sq(plain), [plain[2].weight], create_graph=True)
    (want,) = torch.autograd.grad(w.pow(2).sum(), [plain[0].bias])
    assert torch.allclose(g["2"]["weight"], w) and torch.allclose(gp["0"]["bias"], want)
    assert all(flags(m))


# --------------------------------------------------------------------------- shared, tied
def test_layer_shared_by_two_attached_roots():
    shared = nn.Linear(3, 3)
    a = nn.Sequential(shared, nn.Linear(3, 1))
    b = nn.Sequential(shared, nn.Linear(3, 2))
    ts.attach(a)
    ts.mark_trainable(b, "1")  # b's declaration freezes the shared layer (in both models)
    assert flags(a) == [False, False, True, True]
    for model, wrt in ((a, "0"), (b, "0"), (a, "1")):
        paths = [f"{wrt}.weight", f"{wrt}.bias"]
        same(ts.structural_grad(model, sq, wrt=wrt), reference(model, sq, paths), exact=True)
        agree(a)
        agree(b)
        assert flags(a) == [False, False, True, True]

    def loss(mm):  # the loss lifts b's declaration: the shared layer trains after the call
        ts.mark_trainable(b, None)
        return sq(mm)

    ts.structural_grad(a, loss, wrt="1")
    assert all(flags(a)) and all(flags(b))
    agree(a)
    agree(b)


def test_unattached_model_sharing_a_layer_with_a_declared_attached_one():
    shared = nn.Linear(3, 3)
    a = nn.Sequential(shared, nn.Linear(3, 1))
    ts.mark_trainable(a, "1")
    plain = nn.Sequential(shared, nn.Linear(3, 2))
    before = flags(plain)
    for wrt in ("0", "1"):
        g = ts.structural_grad(plain, sq, wrt=wrt)
        same(g, reference(plain, sq, [f"{wrt}.weight", f"{wrt}.bias"]), exact=True)
        assert flags(plain) == before == [False, False, True, True]
        agree(a)


@pytest.mark.parametrize("wrt", ["head", "emb", "head.weight"])
def test_tied_parameter_asked_by_any_path_gets_the_total(wrt):
    lm = TiedLM()
    ts.mark_trainable(lm, "mid")  # the tie is frozen by the declaration
    assert flags(lm) == [False, True, True]
    g = ts.structural_grad(lm, lm_loss, wrt=wrt)
    same(g, reference(lm, lm_loss, ["emb.weight"]), exact=True)
    assert flags(lm) == [False, True, True]
    agree(lm)


# --------------------------------------------------------------------------- checkpoints
@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("wrt, paths", [("a", ["a.weight", "a.bias"]),
                                        (["a", "b"], ["a.weight", "a.bias", "b.weight", "b.bias"]),
                                        ("c", ["c.weight", "c.bias"])])
def test_checkpoint_inside_the_loss(reentrant, wrt, paths):
    ck = Ck(reentrant)
    ts.attach(ck)
    with ts.freeze(ck, "c"):
        g = ts.structural_grad(ck, sq, wrt=wrt)
        assert flags(ck) == [True, True, True, True, False, False]
        agree(ck)
    same(g, reference(ck, sq, paths, backward=reentrant))
    assert all(flags(ck)) and all(p.grad is None for p in ck.parameters())
    agree(ck)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_then_a_context_entered_in_the_loss(reentrant):
    """The recomputation in backward runs while the call still holds its flags: a context
    the loss entered after the checkpoint's forward changes nothing of the gradient."""
    ck = Ck(reentrant)
    held = []

    def loss(mm):
        out = sq(mm)
        held.append(ts.freeze(mm, "b"))
        return out

    paths = ["a.weight", "a.bias", "b.weight", "b.bias"]
    g = ts.structural_grad(ck, loss, wrt=["a", "b"])
    same(g, reference(ck, sq, paths, backward=reentrant))
    assert flags(ck) == [True, True, False, False, True, True]
    agree(ck)
    held[0].__exit__(None, None, None)
    assert all(flags(ck))


def test_reentrant_checkpoint_recording_nothing_is_a_clear_error():
    ck = Ck(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="'b.weight' is used inside a reentrant"):
            ts.structural_grad(ck, sq, wrt="b")
    assert all(flags(ck)) and all(p.grad is None for p in ck.parameters())


# --------------------------------------------------------------------------- threads
@pytest.mark.parametrize("attached", [False, True])
@pytest.mark.parametrize("wrt_a, wrt_b", [("0", "2"), ("0", "0"), ("2", "*"), ("*", "2")])
def test_two_threads_one_model(attached, wrt_a, wrt_b):
    """A's loss waits, mid-forward, for B's whole call. Each call returns the single-threaded
    gradients or raises RuntimeError; the flags end as they started."""
    m = mlp()
    if attached:
        ts.attach(m)
    start = flags(m)
    expand = {"0": ["0.weight", "0.bias"], "2": ["2.weight", "2.bias"],
              "*": ["0.weight", "0.bias", "2.weight", "2.bias"]}
    want_a = reference(m, sq, expand[wrt_a])
    want_b = reference(m, lambda q: q(X).sum(), expand[wrt_b])
    a_in, b_done, res = threading.Event(), threading.Event(), {}

    def loss_a(mm):
        first = mm(X).pow(2)
        a_in.set()
        assert b_done.wait(TIMEOUT)
        return first.sum()

    def thread_a():
        try:
            res["a"] = ts.structural_grad(m, loss_a, wrt=wrt_a)
        except BaseException as err:  # noqa: BLE001 - checked below
            res["a"] = err

    def thread_b():
        try:
            assert a_in.wait(TIMEOUT)
            res["b"] = ts.structural_grad(m, lambda q: q(X).sum(), wrt=wrt_b)
        except BaseException as err:  # noqa: BLE001
            res["b"] = err
        finally:
            b_done.set()

    run_threads(thread_a, thread_b)
    for key, want in (("a", want_a), ("b", want_b)):
        if isinstance(res[key], BaseException):
            assert isinstance(res[key], RuntimeError), res[key]
        else:
            same(res[key], want)
    assert not isinstance(res["b"], BaseException)  # the newer call holds its own flags
    assert flags(m) == start
    if attached:
        agree(m)


@pytest.mark.parametrize("rounds", [30])
def test_many_threads_random_wrt_end_restored(rounds):
    m = mlp()
    ts.attach(m)
    with ts.freeze(m, "0.bias"):
        start = flags(m)
        choices = ["0", "2", "0.weight", "*", "2.bias"]
        expand = {c: [p for p, _ in ts.select(m, c)] for c in choices}
        wants = {c: reference(m, sq, expand[c]) for c in choices}
        errors = []

        def work(k):
            for i in range(rounds):
                c = choices[(k + i) % len(choices)]
                try:
                    same(ts.structural_grad(m, sq, wrt=c), wants[c])
                except RuntimeError:
                    pass
                except BaseException as err:  # noqa: BLE001
                    errors.append(err)

        run_threads(*[lambda k=k: work(k) for k in range(3)])
        assert not errors, errors
        assert flags(m) == start
        agree(m)
    assert all(flags(m))
    agree(m)


def test_other_thread_enters_a_context_while_the_call_holds():
    m = mlp()
    ts.attach(m)
    a_in, b_done, res, ctx = threading.Event(), threading.Event(), {}, []

    def loss_a(mm):
        a_in.set()
        assert b_done.wait(TIMEOUT)
        assert mm[0].weight.requires_grad  # the call holds its asked layer
        return sq(mm)

    def thread_a():
        try:
            res["a"] = ts.structural_grad(m, loss_a, wrt="0")
        except BaseException as err:  # noqa: BLE001
            res["a"] = err

    def thread_b():
        try:
            assert a_in.wait(TIMEOUT)
            ctx.append(ts.freeze(m, "0"))
        finally:
            b_done.set()

    run_threads(thread_a, thread_b)
    same(res["a"], reference(m, sq, ["0.weight", "0.bias"]), exact=True)
    assert flags(m) == [False, False, True, True]  # the other thread's context stands
    agree(m)
    ctx[0].__exit__(None, None, None)
    assert all(flags(m))
    agree(m)


def test_failing_call_in_another_thread_leaves_the_running_call_alone():
    m = mlp()
    ts.attach(m)
    a_in, b_done, res = threading.Event(), threading.Event(), {}

    def loss_a(mm):
        a_in.set()
        assert b_done.wait(TIMEOUT)
        return sq(mm)

    def loss_b(mm):
        mm(X)
        raise ValueError("boom")

    def thread_a():
        try:
            res["a"] = ts.structural_grad(m, loss_a, wrt="0")
        except BaseException as err:  # noqa: BLE001
            res["a"] = err

    def thread_b():
        try:
            assert a_in.wait(TIMEOUT)
            ts.structural_grad(m, loss_b, wrt="*")
        except ValueError as err:
            res["b"] = err
        finally:
            b_done.set()

    run_threads(thread_a, thread_b)
    assert isinstance(res["b"], ValueError)
    same(res["a"], reference(m, sq, ["0.weight", "0.bias"]), exact=True)
    assert all(flags(m))
    agree(m)


def test_call_without_wrt_racing_a_wrt_call():
    m = mlp()
    want = reference(m, sq, ["0.weight", "0.bias", "2.weight", "2.bias"])
    b_in, a_forward, b_done, res = threading.Event(), threading.Event(), threading.Event(), {}

    def loss_a(mm):
        assert b_in.wait(TIMEOUT)
        out = sq(mm)  # runs while B holds '0' off
        a_forward.set()
        assert b_done.wait(TIMEOUT)
        return out

    def loss_b(mm):
        b_in.set()
        assert a_forward.wait(TIMEOUT)
        return mm(X).sum()

    def thread_a():
        try:
            res["a"] = ts.structural_grad(m, loss_a)
        except BaseException as err:  # noqa: BLE001
            res["a"] = err

    def thread_b():
        try:
            res["b"] = ts.structural_grad(m, loss_b, wrt="2")
        finally:
            b_done.set()

    run_threads(thread_a, thread_b)
    assert all(flags(m))
    assert isinstance(res["a"], RuntimeError) or (
        isinstance(res["a"], dict) and torch.allclose(
            ts.tree.to_flat_dict(res["a"])["0.weight"], want["0.weight"]))


@pytest.mark.parametrize("head_only", [False, True])
def test_overridden_call_whose_loss_misses_it_raises_runtime_error(head_only):
    m = mlp()
    ts.attach(m)
    a_in, b_in, a_forward, b_done = (threading.Event() for _ in range(4))
    res = {}

    def loss_a(mm):
        a_in.set()
        assert b_in.wait(TIMEOUT)
        out = mm[2](X @ torch.ones(3, 4)).sum() if head_only else sq(mm)  # B holds '2.bias' off
        a_forward.set()
        assert b_done.wait(TIMEOUT)  # B's call has exited: '2.bias' is on again
        return out

    def loss_b(mm):
        b_in.set()
        assert a_forward.wait(TIMEOUT)
        return mm(X).sum()

    def thread_a():
        try:
            res["a"] = ts.structural_grad(m, loss_a, wrt="2.bias")
        except BaseException as err:  # noqa: BLE001
            res["a"] = err

    def thread_b():
        try:
            assert a_in.wait(TIMEOUT)
            res["b"] = ts.structural_grad(m, loss_b, wrt="0")
        except BaseException as err:  # noqa: BLE001
            res["b"] = err
        finally:
            b_done.set()

    run_threads(thread_a, thread_b)
    same(res["b"], reference(m, lambda q: q(X).sum(), ["0.weight", "0.bias"]))
    assert all(flags(m))
    agree(m)
    assert isinstance(res["a"], RuntimeError), res["a"]
