"""Audit: structural_grad's exact path (reentrant checkpoints) with checkpoints NESTED inside a
reentrant checkpoint's function, and hooks off / on the asked paths (docs/structural.md,
"Activation checkpointing"; torchstruct/grad.py ``_Exact`` and ``_DeadCheckpoints``).

Promise checked: the asked gradients are ``torch.equal`` to ``.backward()`` on a deep copy (after
``ts.detach_hooks``); a nested checkpoint that records nothing while it uses an asked parameter is
a ValueError naming it; a hook the real backward would run off the asked paths is a RuntimeError
before it runs; after every call (success or error) every flag, ``.grad`` and torch's
``CheckpointFunction`` are as before. (Defects this audit found are fixed; their tests pass.)
"""
import copy
import functools
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module_mod
from torch.utils.checkpoint import CheckpointFunction, checkpoint, checkpoint_sequential

from _reentrant import QUIET, S, ck, ddp_grads, leaf, tiny_gpt2

import torchstruct as ts
from torchstruct import _checkpoints
from torchstruct.select import index

pytestmark = QUIET


def snapshot(model, outside=()):
    """Sentinel .grad on every parameter; what must hold after any call."""
    for p in model.parameters():
        p.grad = torch.full_like(p, S)
    return ([(p, p.grad, p.requires_grad) for p in model.parameters()],
            [(t, t.grad, t.requires_grad) for t in outside],
            dict(_module_mod._global_forward_pre_hooks))


def assert_as_before(snap):
    params, outside, hooks = snap
    for p, g, flag in params + outside:
        assert p.requires_grad is flag
        assert p.grad is g and bool((g == S).all())
    assert "apply" not in CheckpointFunction.__dict__  # torch's own apply again
    assert CheckpointFunction.__dict__["forward"] is _checkpoints._FORWARD
    assert not _checkpoints._BEFORE and "dead" not in _checkpoints._AROUND
    assert dict(_module_mod._global_forward_pre_hooks) == hooks


def reference(model, x, seed=None):
    """{path: .grad} by plain .backward() on a deep copy (outside tensors held by the model in a
    list are copied with it; x cloned), torchstruct's hooks detached."""
    ref = copy.deepcopy(model)
    ts.detach_hooks(ref)
    for t in getattr(ref, "e", ()):
        t.grad = None
    for p in ref.parameters():
        p.grad = None
    if seed is not None:
        torch.manual_seed(seed)
    ref(x.detach().clone().requires_grad_(x.requires_grad)).backward()
    return {path: p.grad for path, p in index(ref)}, ref


def same(a, b):
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def assert_equal(got, ref):
    got = ts.tree.to_flat_dict(got)
    assert got
    for k, g in got.items():
        want = ref[k] if ref[k] is not None else torch.zeros_like(g)
        assert torch.equal(g, want), (k, (g - want).abs().max())


# ================================================================ nested checkpoints: numbers
class Nested(nn.Module):
    """Checkpoints nested in a reentrant checkpoint's function, in the ways ``kind`` names;
    ``e`` a tensor outside the model (requiring grad in the forward), held in a list."""

    def __init__(self, kind, e):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(4))
        self.inp, self.a, self.b, self.out = (nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4),
                                              nn.Linear(4, 1))
        self.seq = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(),
                                 nn.Linear(4, 4))
        self.drop = nn.Dropout(0.5)
        if kind == "tied":
            self.b.weight = self.a.weight
        self.kind, self.e = kind, [e]

    def forward(self, x):
        e, k = self.e[0], self.kind
        h = torch.tanh(self.inp(x))
        if k == "sequential":  # checkpoint_sequential(use_reentrant=True) fed e, in a checkpoint
            z = ck(lambda u: u + checkpoint_sequential(self.seq, 2, e, use_reentrant=True), h)
        elif k == "three_levels":
            z = ck(lambda u: u + ck(lambda v, f: v * ck(self.a, f), u, e), h)
        elif k == "same_e_two_layers":
            z = ck(lambda u: u * ck(self.b, e), ck(lambda u: u + ck(self.a, e), h) * e)
        elif k == "tied":
            z = ck(lambda u: ck(self.a, e) + ck(self.b, u), h)
        elif k == "non_tensor_args":
            z = ck(lambda u: u + ck(lambda f, n, none, t: self.a(f) * n + t[0], e, 3, None,
                                    (e,)), h)
        elif k == "partial_keyword":
            z = ck(lambda u: u + ck(functools.partial(lambda f, s: self.a(f) * s, s=e), e), h)
        elif k == "dropout":
            z = ck(lambda u: self.drop(u) + ck(lambda f: self.drop(self.a(f)), e), h)
        elif k == "parameter_fed":  # w: a parameter fed to a nested checkpoint, used outside too
            z = ck(lambda u: u * self.w + ck(lambda f, p: self.a(f) * p, e, self.w), h) + self.w
        elif k == "bound_module":  # one outer function is a module
            z = ck(self.b, h) + ck(lambda u: ck(self.a, e) * u, h)
        else:  # a reentrant checkpoint in a non-reentrant one
            z = checkpoint(lambda u: u + ck(self.a, e), h, use_reentrant=False)
        return self.out(z * e).sum()  # the graph shows e: switched off for the backward


KINDS = ["sequential", "three_levels", "same_e_two_layers", "tied", "non_tensor_args",
         "partial_keyword", "dropout", "parameter_fed", "bound_module",
         "reentrant_in_non_reentrant"]


@pytest.mark.parametrize("form", ["callable", "tensor"])
@pytest.mark.parametrize("wrt", [None, ["a", "out"], ["inp", "b", "seq"], ["w", "a", "seq"]])
@pytest.mark.parametrize("kind", KINDS)
def test_nested_checkpoints_match_backward_and_restore_everything(kind, wrt, form):
    e = leaf(4)
    m = Nested(kind, e)
    x = leaf(3, 4)  # the outer checkpoint records whatever is asked
    ref, _ = reference(m, x, seed=3)
    snap = snapshot(m, [e, x])
    torch.manual_seed(3)
    loss = (lambda mm: mm(x)) if form == "callable" else m(x)
    got = ts.structural_grad(m, loss, wrt=wrt)
    assert sorted(ts.tree.to_flat_dict(got)) == sorted(
        k for k, _ in (index(m) if wrt is None else ts.select(m, wrt)))
    assert_equal(got, ref)
    assert_as_before(snap)


def test_dropout_nested_changes_with_the_seed():
    """The dropout case is not trivially equal: another seed gives other numbers."""
    m, x = Nested("dropout", leaf(4)), leaf(3, 4)
    ref, _ = reference(m, x, seed=3)
    torch.manual_seed(4)
    got = ts.tree.to_flat_dict(ts.structural_grad(m, lambda mm: mm(x)))
    assert not all(same(g, ref[k]) for k, g in got.items() if ref[k] is not None)


@pytest.mark.parametrize("form", ["callable", "tensor"])
def test_no_grad_around_the_call(form):
    e = leaf(4)
    m, x = Nested("same_e_two_layers", e), leaf(3, 4)
    ref, _ = reference(m, x)
    snap = snapshot(m, [e, x])
    if form == "tensor":
        loss = m(x)
        with torch.no_grad():
            got = ts.structural_grad(m, loss, wrt=["a", "b"])
        assert_equal(got, ref)
    else:  # the forward records nothing: an error, nothing changed
        with torch.no_grad(), pytest.raises(ValueError):
            ts.structural_grad(m, lambda mm: mm(x))
    assert torch.is_grad_enabled()
    assert_as_before(snap)


def test_retain_graph_two_calls_then_plain_backward():
    e = leaf(4)
    m, x = Nested("parameter_fed", e), leaf(3, 4)
    ref, r = reference(m, x)
    loss = m(x)
    g1 = ts.structural_grad(m, loss, wrt="a", retain_graph=True)
    g2 = ts.structural_grad(m, loss, wrt=["w", "inp", "out"], retain_graph=True)
    assert_equal(g1, ref)
    assert_equal(g2, ref)
    assert all(p.grad is None and p.requires_grad for p in m.parameters())
    assert e.requires_grad and bool((e.grad == S).all())
    e.grad = None
    loss.backward()  # the graph is as .backward() needs it
    for k, p in index(m):
        assert same(p.grad, ref[k]), k
    assert torch.equal(e.grad, r.e[0].grad)


class Raising(nn.Module):
    """outer(u) = u + nested(e, w); raises in the call numbered ``raise_at`` of either."""

    def __init__(self, e, raise_at):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(4))
        self.inp, self.a, self.out = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)
        self.e, self.raise_at, self.n = [e], raise_at, {"outer": 0, "nested": 0}

    def step(self, name):
        self.n[name] += 1
        if self.raise_at == (name, self.n[name]):
            raise KeyError(f"boom in {name}")

    def forward(self, x):
        e = self.e[0]

        def nested(f, p):
            self.step("nested")
            return self.a(f) * p

        def outer(u):
            r = u + ck(nested, e, self.w)
            self.step("outer")  # after the nested one revived e and w
            return r

        return self.out(ck(outer, torch.tanh(self.inp(x))) * e).sum()


# the nested function runs in the forward (1), the outer recomputation (2), its own (3)
@pytest.mark.parametrize("where", [("outer", 2), ("nested", 2), ("nested", 3)])
@pytest.mark.parametrize("form", ["callable", "tensor"])
@pytest.mark.parametrize("wrt", [None, ["a", "out"]])
def test_an_exception_in_a_recomputation_puts_everything_back(where, form, wrt):
    e, x = leaf(4), leaf(3, 4)
    m = Raising(e, where)
    snap = snapshot(m, [e, x])
    loss = (lambda mm: mm(x)) if form == "callable" else m(x)
    with pytest.raises(KeyError, match="boom"):
        ts.structural_grad(m, loss, wrt=wrt)
    assert m.n[where[0]] == where[1]
    assert_as_before(snap)
    m.raise_at = None  # and the next call is exact
    ref, _ = reference(m, x)
    assert_equal(ts.structural_grad(m, lambda mm: mm(x), wrt=wrt), ref)


# ================================================================ nested: what is refused
class Dead(nn.Module):
    """A nested checkpoint whose only input cannot be switched back on (computed from e), or
    (the last three kinds) whose function reads the OUTER checkpoint's input ``u`` (its detached
    copy) through a closure or a keyword: the gradient ``.backward()`` hands back to ``h`` (and
    so to ``inp``) includes that use."""

    def __init__(self, kind, e):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.a, self.side, self.out = (nn.Linear(4, 4), nn.Linear(4, 4),
                                                 nn.Linear(4, 4), nn.Linear(4, 1))
        self.kind, self.e = kind, [e]

    def forward(self, x):
        e, k = self.e[0], self.kind
        if k == "functional":  # the asked weight used without its module
            fn = lambda u: u + ck(lambda c: F.linear(c, self.a.weight), e * 2)  # noqa: E731
        elif k == "view":
            fn = lambda u: u + ck(self.a, e[:])  # noqa: E731
        elif k == "detached":
            fn = lambda u: u + ck(self.a, e.detach())  # noqa: E731
        elif k == "reads_outer_input":  # no parameter inside; u read through a closure
            fn = lambda u: u + ck(lambda q: q * torch.tanh(u), e * 2)  # noqa: E731
        elif k == "fed_and_closed_over":
            fn = lambda u: ck(lambda c: self.a(c) * u, u)  # noqa: E731
        elif k == "closed_over_only":
            def fn(u):
                return u + ck(lambda c: self.a(c) + u, torch.ones(3, 4, requires_grad=True))
        elif k == "keyword":
            fn = lambda u: ck(functools.partial(lambda c, kv: self.a(c) * kv, kv=u), u)  # noqa
        else:  # the nested one uses a tensor the outer function computed with a
            def fn(u):
                y = self.a(u)
                return y + ck(lambda c: self.side(c) * y, e * 2)
        return self.out(ck(fn, torch.tanh(self.inp(x))) * e).sum()


@pytest.mark.parametrize("form", ["callable", "tensor"])
@pytest.mark.parametrize("kind", ["functional", "view", "detached", "behind_a_closure"])
def test_a_dead_nested_checkpoint_using_an_asked_parameter_is_refused(kind, form):
    e, x = leaf(4), leaf(3, 4)
    m = Dead(kind, e)
    snap = snapshot(m, [e, x])
    loss = (lambda mm: mm(x)) if form == "callable" else m(x)
    with pytest.raises(ValueError, match=r"'a\.weight' is used inside .* nested in another"):
        ts.structural_grad(m, loss, wrt=["inp", "a", "out"])
    assert_as_before(snap)


@pytest.mark.parametrize("variant", ["fed_and_closed_over", "closed_over_only", "keyword"])
@pytest.mark.parametrize("wrt", [None, ["inp", "out"]])
def test_a_nested_checkpoint_closing_over_the_outer_input_matches_backward(variant, wrt):
    m, x = Dead(variant, leaf(4)), torch.randn(3, 4)
    ref, _ = reference(m, x)
    assert ref["inp.bias"].abs().sum() > 0
    snap = snapshot(m)
    got = ts.structural_grad(m, lambda mm: mm(x), wrt=wrt)
    assert_as_before(snap)
    assert_equal(got, ref)


@pytest.mark.parametrize("form", ["callable", "tensor"])
def test_a_dead_nested_checkpoint_reading_the_outer_input_is_refused(form):
    """Fed only e * 2 (e switched off, so it records nothing) while it reads the outer
    checkpoint's input by closure: inp's gradient would miss that use; refused."""
    e, x = leaf(4), torch.randn(3, 4)
    m = Dead("reads_outer_input", e)
    ref, _ = reference(m, x)
    assert ref["inp.bias"].abs().sum() > 0
    loss = (lambda mm: mm(x)) if form == "callable" else m(x)
    snap = snapshot(m, [e])
    with pytest.raises(ValueError, match="reads the outer one's input"):
        ts.structural_grad(m, loss, wrt=["inp"])
    assert_as_before(snap)


# ================================================================ hooks inside recomputations
class Hooked(nn.Module):
    """inp -> outer(u) = u + nested(e) (+ side(e2) in the outer function); nested(f) = a(f)
    (+ side(e2)). A hook of kind ``how`` on ``side``'s output (off the asked paths: side not
    asked, e2 outside the model) or on ``a``'s output (on them), registered when the function
    is recomputed with grad."""

    def __init__(self, how, where, e, e2):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.a, self.side, self.out = (nn.Linear(4, 4), nn.Linear(4, 4),
                                                 nn.Linear(4, 4), nn.Linear(4, 1))
        self.how, self.where, self.e, self.calls = how, where, [e, e2], []
        if how == "module":
            target = self.a if where == "nested_on" else self.side
            target.sink = self.calls  # (a deep copy's hook writes to the copy's list)
            target.register_full_backward_hook(lambda mod, *a: mod.sink.append("module"))

    def hook(self, t):
        if not torch.is_grad_enabled() or self.how == "module":
            return t
        if self.how == "tensor":
            t.register_hook(lambda g: self.calls.append("tensor"))
        elif self.how == "retain":
            t.retain_grad()
            self.calls.append(t)
        elif self.how == "node":
            t.grad_fn.register_hook(lambda *a: self.calls.append("node"))
        elif self.how == "prehook":
            t.grad_fn.register_prehook(lambda *a: self.calls.append("prehook"))
        elif self.how == "removed":
            t.register_hook(lambda g: self.calls.append("removed")).remove()
            t.grad_fn.register_prehook(lambda *a: self.calls.append("removed")).remove()
            t.grad_fn.register_hook(lambda *a: self.calls.append("removed")).remove()
        return t

    def forward(self, x):
        e, e2 = self.e

        def outer(u):
            def nested(f):
                y = self.a(f)
                if self.where == "nested_off":
                    y = y + self.hook(self.side(e2))
                elif self.where == "outer_input":  # a branch to u: to inp, through the outer
                    y = y + self.hook(torch.tanh(u))
                return self.hook(y) if self.where == "nested_on" else y

            r = u + ck(nested, e)
            return r + self.hook(self.side(e2)) if self.where == "outer_off" else r

        return self.out(ck(outer, torch.tanh(self.inp(x))) * e).sum()


def ran(calls):
    return [c for c in calls if isinstance(c, str) or c.grad is not None]


HOWS = ["tensor", "retain", "node", "prehook", "module"]


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("where", ["nested_off", "outer_off"])
@pytest.mark.parametrize("form", ["callable", "tensor"])
def test_a_hook_off_the_asked_paths_in_a_recomputation_is_refused(how, where, form):
    e, e2, x = leaf(4), leaf(4), leaf(3, 4)
    m = Hooked(how, where, e, e2)
    snap = snapshot(m, [e, e2, x])
    loss = (lambda mm: mm(x)) if form == "callable" else m(x)
    kind = "retain_grad" if how == "retain" else "a gradient hook"
    with pytest.raises(RuntimeError, match=f"has {kind}.*leads to no asked parameter"):
        ts.structural_grad(m, loss, wrt=["inp", "a", "out"])
    assert ran(m.calls) == []
    assert_as_before(snap)


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("form", ["callable", "tensor"])
def test_a_hook_on_an_asked_path_in_a_nested_recomputation_runs_as_backward(how, form):
    e, e2, x = leaf(4), leaf(4), leaf(3, 4)
    m = Hooked(how, "nested_on", e, e2)
    ref, r = reference(m, x)
    want = ran(r.calls)
    assert want
    m.calls.clear()
    loss = (lambda mm: mm(x)) if form == "callable" else m(x)
    got = ts.structural_grad(m, loss, wrt=["inp", "a", "out"])
    assert [c if isinstance(c, str) else "retained" for c in ran(m.calls)] == \
        [c if isinstance(c, str) else "retained" for c in want]
    if how == "retain":
        assert torch.equal(ran(m.calls)[0].grad, want[0].grad)
    assert_equal(got, ref)


@pytest.mark.parametrize("where", ["nested_off", "outer_off", "nested_on"])
def test_a_removed_hook_in_a_recomputation_is_not_refused(where):
    e, e2, x = leaf(4), leaf(4), leaf(3, 4)
    m = Hooked("removed", where, e, e2)
    ref, _ = reference(m, x)
    snap = snapshot(m, [e, e2, x])
    got = ts.structural_grad(m, lambda mm: mm(x), wrt=["inp", "a", "out"])
    assert m.calls == []
    assert_equal(got, ref)
    assert_as_before(snap)


@pytest.mark.parametrize("how", ["tensor", "node"])
def test_a_hook_on_a_branch_to_the_outer_input_runs(how):
    e, e2, x = leaf(4), leaf(4), torch.randn(3, 4)
    m = Hooked(how, "outer_input", e, e2)
    ref, r = reference(m, x)
    assert r.calls == [how]
    m.calls.clear()
    got = ts.structural_grad(m, lambda mm: mm(x))
    assert m.calls == [how]
    assert_equal(got, ref)


@pytest.mark.parametrize("wrt", [None, ["w", "a"], ["w"]])
def test_asked_parameter_hooks_in_nested_checkpoints_see_backward_s_parts(wrt):
    e, x = leaf(4), leaf(3, 4)
    m = Nested("parameter_fed", e)
    seen = []
    m.w.register_hook(lambda g: seen.append(("w", g.clone())))
    m.a.weight.register_hook(lambda g: seen.append(("a", g.clone())))
    got = ts.structural_grad(m, lambda mm: mm(x), wrt=wrt)
    mine = list(seen)
    seen.clear()
    for path, p in m.named_parameters():  # .backward() with the same flags, same model
        p.grad = None
        p.requires_grad_(wrt is None or path.split(".")[0] in wrt)
    m(x).backward()
    assert [n for n, _ in mine] == [n for n, _ in seen] and len(mine) >= 2
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(mine, seen))
    assert torch.equal(ts.tree.to_flat_dict(got)["w"], m.w.grad)


@pytest.mark.parametrize("kind", ["post_accumulate", "tensor", "accumulator"])
def test_a_hook_on_a_revived_parameter_not_asked_is_refused(kind):
    """Tensor loss: w (not asked) is switched back on for the nested checkpoint it feeds; a hook
    the real backward would run there is refused, nothing runs, everything put back."""
    e, x = leaf(4), leaf(3, 4)
    m, calls = Nested("parameter_fed", e), []
    if kind == "post_accumulate":
        m.w.register_post_accumulate_grad_hook(lambda t: calls.append(kind))
    elif kind == "tensor":
        m.w.register_hook(lambda g: calls.append(kind))
    else:
        m.acc = m.w.view_as(m.w).grad_fn.next_functions[0][0]
        m.acc.register_prehook(lambda *a: calls.append(kind))
    loss = m(x)
    snap = snapshot(m, [e, x])
    with pytest.raises(RuntimeError, match="'w' has a"):
        ts.structural_grad(m, loss, wrt=["a", "out"])
    assert calls == []
    assert_as_before(snap)


# ================================================================ threads, DDP, HF
class DDPNested(nn.Module):
    """Each parameter used once (plain DDP backward works too)."""

    def __init__(self, e, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.w = nn.Parameter(torch.randn(4))
        self.inp, self.a, self.b, self.c, self.out = (nn.Linear(4, 4), nn.Linear(4, 4),
                                                      nn.Linear(4, 4), nn.Linear(4, 4),
                                                      nn.Linear(4, 1))
        self.e = [e]

    def forward(self, x):
        e = self.e[0]
        z = ck(lambda u: u + ck(lambda f, p: self.a(f) * p, e, self.w), torch.tanh(self.inp(x)))
        z = ck(lambda u: ck(self.b, u) * ck(self.c, e), z * e)
        return self.out(z).sum()


def test_a_concurrent_plain_backward_with_nested_checkpoints_is_untouched():
    """One thread's structural_grad, another thread's plain .backward(), each its own model and
    outside tensor: both exact, every time."""
    errors, barrier = [], threading.Barrier(2)

    def work(structural):
        e, x = leaf(4), torch.randn(16, 4, requires_grad=True)
        m = DDPNested(e, 1 + structural)
        ref, r = reference(m, x)
        barrier.wait()
        for i in range(20):
            try:
                if structural:
                    got = ts.structural_grad(m, lambda mm: mm(x), wrt=["a", "c", "out"])
                    ok = all(torch.equal(g, ref[k]) for k, g in ts.tree.to_flat_dict(got).items())
                    ok = ok and e.requires_grad and bool((e.grad == S).all())
                else:
                    m.zero_grad(set_to_none=True)
                    e.grad = None
                    m(x).backward()
                    ok = all(same(p.grad, ref[k]) for k, p in index(m))
                    ok = ok and torch.equal(e.grad, r.e[0].grad)
                if not ok:
                    errors.append((structural, i))
            except Exception as err:  # noqa: BLE001
                errors.append((structural, i, repr(err)))

    threads = [threading.Thread(target=work, args=(flag,)) for flag in (True, False)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert "apply" not in CheckpointFunction.__dict__


@pytest.mark.parametrize("form", ["callable", "tensor_in_no_sync"])
@pytest.mark.parametrize("wrt", [None, ["module.a", "module.out"]])
def test_ddp_nested_checkpoints(group, form, wrt):
    from torch.nn.parallel import DistributedDataParallel as DDP

    e, x = leaf(4), leaf(3, 4)
    m = DDPNested(e)
    ref, _ = reference(m, x)
    ddp = DDP(m)
    snap = snapshot(m, [e, x])
    got = ddp_grads(ddp, x, form, wrt)
    assert len(got) == (len(list(index(m))) if wrt is None else 4)
    for k, g in got.items():
        assert torch.equal(g, ref[k[len("module."):]]), k
    assert_as_before(snap)
    for t in (e, x, *m.parameters()):  # a plain DDP step afterwards is plain PyTorch
        t.grad = None
    ddp(x).backward()
    for k, p in index(m):
        assert same(p.grad, ref[k]), k


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("wrt_layer1", [False, True])
def test_hf_gpt2_inside_an_outer_checkpoint_with_hooks(wrt_layer1):
    """HF's own reentrant layer checkpoints nested in an outer one around the whole model,
    dropout on (seeded), a full backward hook and a tensor hook (registered by a forward hook)
    on layer 1: numbers, hook calls and gradients seen by the hooks are .backward()'s."""
    model = tiny_gpt2(0.1)
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(2))
    calls = []
    model.transformer.h[1].mlp.register_full_backward_hook(
        lambda mod, gi, go: calls.append(("mlp1", go[0].clone())))

    def forward_hook(mod, inp, out):
        o = out[0] if isinstance(out, tuple) else out
        if o.requires_grad:
            o.register_hook(lambda g: calls.append(("attn1", g.clone())))

    model.transformer.h[1].attn.register_forward_hook(forward_hook)

    def loss_fn(m):
        emb = m.transformer.wte(ids)
        return ck(lambda t: m(inputs_embeds=t, labels=ids).loss, emb)

    wrt = [n for n, _ in model.named_parameters() if ".1." in n] if wrt_layer1 else None
    ref_model = copy.deepcopy(model)
    ts.detach_hooks(ref_model)
    torch.manual_seed(5)
    loss_fn(ref_model).backward()
    ref = {k: p.grad for k, p in index(ref_model)}
    want = list(calls)
    assert [n for n, _ in want] == ["mlp1", "attn1"]
    calls.clear()
    snap = snapshot(model)
    torch.manual_seed(5)
    got = ts.structural_grad(model, loss_fn, wrt=wrt)
    assert [n for n, _ in calls] == [n for n, _ in want]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(calls, want))
    assert_equal(got, ref)
    assert_as_before(snap)
