"""Audit: decorated generators and coroutines whose bodies hold blocks across suspensions.

A context used as a decorator on a generator function or an ``async def`` function applies
around each resumption only (docs/freezing.md, "generator function"). Each resumption enters a
fresh context; ``_Context._resumed`` / ``_resumption`` (torchstruct/contexts.py) put it BELOW
the blocks the body entered earlier and still holds (``_above`` / ``_sink_below`` of
``_FlagContext`` and of ``_SubstituteBlock`` in torchstruct/blocks.py), so that such a block
wins at every later resumption, as it would in one long block, and stays active between
resumptions, as any ``with`` held across a ``yield`` does.

Probed here: freeze / freeze_except / unfreeze / stop_gradient / swap / constant decorators
with inner blocks of the same and of other kinds, held across one or many yields, left
mid-way, ``yield from`` into another decorated generator, interleaved generators, generators
of different models, ``send`` / ``throw`` / ``close``, generators abandoned and collected,
exceptions inside the inner block, and ``asyncio.gather`` / cancellation of decorated
coroutines. After each step the flags are compared with ``ts.is_trainable``, with the
contract's fold of the active contexts (innermost wins), and with the fold of torchstruct's
own stack; swapped values and gradients with plain PyTorch (``functional_call`` with the
replacement or a detached copy placed by hand). At the end: no torchstruct mode left on the
stacks, flags back to the start, no context of the test's models in ``_state.entries``.

The contract checked is the one of docs/freezing.md and docs/stop_gradient.md.
"""
from __future__ import annotations

import asyncio
import gc
import weakref

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.func import functional_call
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import torchstruct as ts
from torchstruct import _state

import _flags
from _flags import entries_on


# ----------------------------------------------------------------------------- helpers
def small(mixed=True):
    """Three linears; with ``mixed`` the first bias starts frozen (a starting flag: respected)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 1))
    if mixed:
        m[0].bias.requires_grad_(False)
    _BASE[m] = {n: p.detach().clone() for n, p in m.named_parameters()}
    return m


_BASE = weakref.WeakKeyDictionary()  # model -> its values when built (for ``hand``)


def flags(m):
    return [p.requires_grad for p in m.parameters()]


def reads(m):
    return [ts.is_trainable(m, p) for p in m.parameters()]


def paths(m):
    return [n for n, _ in m.named_parameters()]


def fold(m, start, active):
    """The flags the contract gives for ``active`` on ``m`` (see ``_flags.fold``)."""
    return _flags.fold(start, paths(m), active)


def stack_of(m):
    """torchstruct's own stack of contexts on ``m``, as (kind, selector) pairs."""
    out = []
    for e in entries_on(m):
        assert len(e.selectors) <= 1 and all(isinstance(s, str) for s in e.selectors)
        out.append((e.kind, e.selectors[0] if e.selectors else None))
    return out


def check(m, start, active, stand_ins=False):
    """Flags == reads == the contract's fold of ``active`` == the fold of the real stack.

    With ``stand_ins`` (a stop_gradient / swap block active), ``p.requires_grad`` reads the
    stand-in's flag (documented): only the reads are compared then."""
    want = fold(m, start, active)
    if not stand_ins:
        assert flags(m) == want, (flags(m), want, stack_of(m))
    assert reads(m) == want, (reads(m), want, stack_of(m))
    assert fold(m, start, stack_of(m)) == want


def ts_modes():
    """torchstruct modes on this thread's torch-function and dispatch stacks."""
    stacks = [*torch.overrides._get_current_function_mode_stack(),
              *_get_current_dispatch_mode_stack()]
    return [md for md in stacks if type(md).__module__.startswith("torchstruct")]


def clean(m, start):
    assert ts_modes() == []
    assert flags(m) == start and reads(m) == start
    assert entries_on(m) == []


def hand(m, x, **replace):
    """Plain PyTorch: ``m``'s forward (three linears) on the values ``m`` had when built, with
    the tensors at ``replace``'s paths (``__`` for ``.``) put in their place. Computed from
    plain tensors only, so a block held by a suspended generator does not touch it."""
    vals = {**_BASE[m], **{k.replace("__", "."): v for k, v in replace.items()}}
    for i in range(3):
        x = F.linear(x, vals[f"{i}.weight"], vals[f"{i}.bias"])
    return x


def full(shape, v, grad=False):
    return torch.full(shape, float(v), requires_grad=grad)


@pytest.fixture(autouse=True)
def _no_leak_between_tests():
    """A test that exposes a leaked mode (torchstruct's, or a user's mode left behind by a
    crash) must not break the next one: both mode stacks are put back as they were before
    the test (the test itself asserts on them)."""
    from torch.utils._python_dispatch import _pop_mode, _push_mode
    fn_before = list(torch.overrides._get_current_function_mode_stack())
    ds_before = list(_get_current_dispatch_mode_stack())
    yield
    gc.collect()
    for _ in range(torch._C._len_torch_function_stack()):
        torch._C._pop_torch_function_stack()
    for md in fn_before:
        torch._C._push_on_torch_function_stack(md)
    for _ in range(len(_get_current_dispatch_mode_stack())):
        _pop_mode()
    for md in ds_before:
        _push_mode(md)


F0 = ("freeze", "0")
X = torch.ones(2, 3)


# ============================================================= flag decorators, inner blocks
@pytest.mark.parametrize("dec,inner", [
    (("freeze", "0"), ("unfreeze", "0.weight")),
    (("unfreeze", None), ("freeze", "1")),
    (("freeze_except", "2"), ("unfreeze", "1.bias")),
    (("freeze", "0"), ("freeze", "0.weight")),
    (("unfreeze", "0.bias"), ("freeze_except", "0")),
])
def test_flag_decorator_with_an_inner_flag_block_held_across_many_yields(dec, inner):
    m = small()
    start = flags(m)

    def ctx(kind, sel):
        return getattr(ts, kind)(m, *([sel] if sel else []))

    @ctx(*dec)
    def gen():
        check(m, start, [dec])
        yield
        with ctx(*inner):
            for _ in range(4):
                check(m, start, [dec, inner])  # the inner block wins at every resumption
                yield
                check(m, start, [dec, inner])
        check(m, start, [dec])
        yield

    g = gen()
    next(g)
    check(m, start, [])
    for _ in range(4):
        next(g)
        check(m, start, [inner])  # between resumptions: the held block alone
    next(g)
    check(m, start, [])
    with pytest.raises(StopIteration):
        next(g)
    clean(m, start)


def test_two_inner_blocks_entered_at_different_resumptions_and_left_in_order():
    m = small()
    start = flags(m)
    a, b = ("unfreeze", "0"), ("freeze", "0.weight")

    @ts.freeze_except(m, "2")
    def gen():
        with ts.unfreeze(m, "0"):
            yield
            check(m, start, [("freeze_except", "2"), a])
            with ts.freeze(m, "0.weight"):
                yield
                check(m, start, [("freeze_except", "2"), a, b])
                yield
            check(m, start, [("freeze_except", "2"), a])
            yield
        check(m, start, [("freeze_except", "2")])

    g = gen()
    next(g)
    check(m, start, [a])
    next(g)
    check(m, start, [a, b])
    next(g)
    next(g)
    check(m, start, [a])
    assert list(g) == []
    clean(m, start)


def test_bare_permanent_context_made_inside_the_body_stays_inner_to_the_decorator():
    """A bare call inside the body is entered after the decorator's context: at later
    resumptions it still wins; it outlives the generator (permanent)."""
    m = small()
    start = flags(m)
    made = []

    @ts.unfreeze(m)
    def gen():
        made.append(ts.freeze(m, "1"))
        yield
        check(m, start, [("unfreeze", None), ("freeze", "1")])
        yield

    g = gen()
    next(g)
    check(m, start, [("freeze", "1")])
    next(g)
    assert list(g) == []
    check(m, start, [("freeze", "1")])
    made[0].__exit__(None, None, None)
    clean(m, start)


def test_a_block_entered_outside_between_resumptions_is_under_the_next_resumption():
    """Without a held block, each resumption's context is entered after the caller's block,
    as a plain decorated call made inside that block: the decorator wins."""
    m = small()
    start = flags(m)

    @ts.freeze(m, "0")
    def gen():
        while True:
            yield flags(m)

    g = gen()
    with ts.unfreeze(m, "0"):
        assert next(g) == fold(m, start, [("unfreeze", "0"), F0])
        check(m, start, [("unfreeze", "0")])
    assert next(g) == fold(m, start, [F0])
    g.close()
    clean(m, start)


def test_flag_decorator_with_inner_stop_gradient_and_swap_blocks():
    """freeze decorator + inner swap of a frozen layer; flags and values at each step."""
    m = small(mixed=False)
    start = flags(m)
    w = full((1, 3), 2.0, grad=True)

    @ts.freeze(m, "0")
    def gen():
        with ts.swap(m, {"2.weight": w}), ts.stop_gradient(m, "1"):
            for _ in range(3):
                check(m, start, [F0], stand_ins=True)
                yield m(X)

    outs = []
    for out in gen():
        outs.append(out)
        check(m, start, [], stand_ins=True)  # the held blocks stay active between
    assert ts_modes() == []
    want = hand(m, X, **{"2__weight": w})
    for out in outs:
        torch.testing.assert_close(out, want)
    sum(o.sum() for o in outs).backward()
    assert all(p.grad is None for p in [*m[0].parameters(), *m[1].parameters()])
    assert w.grad is not None and m[2].weight.grad is None and m[2].bias.grad is not None
    clean(m, start)


def test_a_flag_written_by_hand_in_the_body_stands_between_resumptions_like_no_grad():
    """A write by hand inside a resumption stands after it (the decorator's context is left);
    the next resumption's fresh context is entered after the write and applies on top of it,
    as ``@torch.no_grad()`` on a generator turns grad mode off again at every resumption."""
    m = small(mixed=False)
    start = flags(m)

    @ts.unfreeze(m)
    def gen():
        with ts.freeze(m, "2"):
            m[0].weight.requires_grad_(False)  # against the decorator: stands for now
            yield flags(m), reads(m)
            yield flags(m), reads(m)
        yield flags(m), reads(m)

    g = gen()
    assert next(g) == ([False, True, True, True, False, False],) * 2
    assert flags(m) == reads(m) == [False, True, True, True, False, False]
    assert next(g) == ([True, True, True, True, False, False],) * 2  # the fresh unfreeze
    assert flags(m) == reads(m) == [False, True, True, True, False, False]  # the write stands
    assert next(g)[0] == [True] * 6
    g.close()
    assert flags(m) == reads(m) == [False, True, True, True, True, True]
    assert entries_on(m) == [] and ts_modes() == []
    m[0].weight.requires_grad_(True)
    assert flags(m) == start

    @torch.no_grad()
    def plain():
        torch.set_grad_enabled(True)
        yield torch.is_grad_enabled()
        yield torch.is_grad_enabled()

    assert list(plain()) == [True, False]  # PyTorch's own decorator: the same rule


# ============================================================= nested and interleaved
def test_yield_from_into_another_decorated_generator_with_held_blocks():
    """outer @freeze('0') holding unfreeze('0.weight'), driving inner @freeze_except('1')
    holding unfreeze('0.bias'): one long block each, nested in that order."""
    m = small()
    start = flags(m)
    o_dec, o_in = ("freeze", "0"), ("unfreeze", "0.weight")
    i_dec, i_in = ("freeze_except", "1"), ("unfreeze", "0.bias")

    @ts.freeze_except(m, "1")
    def inner():
        check(m, start, [o_dec, o_in, i_dec])
        with ts.unfreeze(m, "0.bias"):
            for _ in range(2):
                yield "i"
                check(m, start, [o_dec, o_in, i_dec, i_in])
        yield "i-after"
        check(m, start, [o_dec, o_in, i_dec])
        return "ret"

    @ts.freeze(m, "0")
    def outer():
        with ts.unfreeze(m, "0.weight"):
            yield "o"
            r = yield from inner()
            check(m, start, [o_dec, o_in])
            yield r
        check(m, start, [o_dec])

    g = outer()
    assert next(g) == "o"
    check(m, start, [o_in])
    assert next(g) == "i"
    check(m, start, [o_in, i_in])
    assert next(g) == "i"
    assert next(g) == "i-after"
    check(m, start, [o_in])
    assert next(g) == "ret"
    assert list(g) == []
    clean(m, start)


def test_two_generators_of_one_decorated_function_alternating_without_inner_blocks():
    m = small()
    start = flags(m)

    @ts.freeze_except(m, "2")
    def gen(n):
        for _ in range(n):
            yield flags(m), reads(m)

    a, b = gen(3), gen(3)
    want = fold(m, start, [("freeze_except", "2")])
    for _ in range(3):
        assert next(a) == (want, want)
        check(m, start, [])
        assert next(b) == (want, want)
        check(m, start, [])
    assert list(a) == list(b) == []
    clean(m, start)


def test_two_generators_of_one_decorated_function_alternating_with_disjoint_held_blocks():
    """Each generator holds a block on its own layer; the decorator's layer is disjoint, so the
    order of contexts across generators does not matter: each sees its decorator, its own
    block and the other's held block."""
    m = small()
    start = flags(m)
    held = {"a": ("unfreeze", "1.weight"), "b": ("freeze", "2")}

    @ts.freeze(m, "0")
    def gen(name):
        kind, sel = held[name]
        with getattr(ts, kind)(m, sel):
            for _ in range(3):
                other = [v for k, v in held.items() if k != name and k in running]
                check(m, start, [F0, *other, held[name]])
                yield

    running = set()
    a, b = gen("a"), gen("b")
    running.add("a")
    next(a)
    running.add("b")
    for _ in range(2):
        next(b)
        next(a)
        check(m, start, [held["a"], held["b"]])
    next(b)
    running.discard("a")
    assert list(a) == []
    check(m, start, [held["b"]])
    running.discard("b")
    assert list(b) == []
    clean(m, start)


def test_generators_of_different_models_alternate_independently():
    m1, m2 = small(), small(mixed=False)
    s1, s2 = flags(m1), flags(m2)

    @ts.freeze(m1)
    def g1():
        with ts.unfreeze(m1, "2"):
            for _ in range(3):
                check(m1, s1, [("freeze", None), ("unfreeze", "2")])
                check(m2, s2, [("freeze_except", "0")])  # g2's held block
                yield

    @ts.unfreeze(m2, "1")
    def g2():
        with ts.freeze_except(m2, "0"):
            for _ in range(3):
                check(m2, s2, [("unfreeze", "1"), ("freeze_except", "0")])
                check(m1, s1, [("unfreeze", "2")])
                yield

    a, b = g1(), g2()
    next(b)
    for _ in range(3):
        next(a)
        check(m1, s1, [("unfreeze", "2")])
        check(m2, s2, [("freeze_except", "0")])
        try:
            next(b)
        except StopIteration:
            pass
    assert list(a) == list(b) == []
    clean(m1, s1)
    clean(m2, s2)


# ============================================================= send / throw / close / gc
def test_send_and_return_value_through_an_inner_block():
    m = small()
    start = flags(m)

    @ts.freeze(m, "0")
    def gen():
        total = 0
        with ts.unfreeze(m, "0.weight"):
            while (got := (yield total)) is not None:
                check(m, start, [F0, ("unfreeze", "0.weight")])
                total += got
        return total

    def drive():
        return (yield from gen())

    g = drive()
    assert next(g) == 0
    assert g.send(2) == 2
    assert g.send(3) == 5
    with pytest.raises(StopIteration) as stop:
        g.send(None)
    assert stop.value.value == 5
    clean(m, start)


def test_throw_caught_inside_the_inner_block_resumes_below_it():
    m = small()
    start = flags(m)
    inner = ("unfreeze", "0.weight")

    @ts.freeze(m, "0")
    def gen():
        with ts.unfreeze(m, "0.weight"):
            while True:
                try:
                    yield
                except ValueError:
                    check(m, start, [F0, inner])
                    yield "caught"

    g = gen()
    next(g)
    assert g.throw(ValueError("x")) == "caught"
    check(m, start, [inner])
    next(g)
    assert g.throw(ValueError("y")) == "caught"
    g.close()
    clean(m, start)


def test_throw_not_caught_leaves_the_inner_block_and_restores():
    m = small()
    start = flags(m)
    seen = []

    @ts.freeze(m, "0")
    def gen():
        try:
            with ts.unfreeze(m, "0.weight"):
                try:
                    yield
                finally:
                    seen.append(flags(m))
        finally:
            seen.append(flags(m))

    g = gen()
    next(g)
    with pytest.raises(KeyError):
        g.throw(KeyError("k"))
    assert seen == [fold(m, start, [F0, ("unfreeze", "0.weight")]), fold(m, start, [F0])]
    clean(m, start)


def test_exception_raised_by_the_body_inside_the_inner_block():
    m = small()
    start = flags(m)

    @ts.freeze(m, "0")
    def gen():
        with ts.unfreeze(m, "0.weight"), ts.swap(m, {"2.bias": torch.zeros(1)}):
            yield
            raise RuntimeError("boom")

    g = gen()
    next(g)
    assert len(ts_modes()) == 1
    with pytest.raises(RuntimeError, match="boom"):
        next(g)
    clean(m, start)
    torch.testing.assert_close(m(X), hand(m, X))


def test_generator_returning_inside_the_inner_block():
    m = small()
    start = flags(m)

    @ts.stop_gradient(m, "2")
    def gen():
        with ts.freeze(m, "1"), ts.swap(m, {"0.bias": torch.zeros(3)}):
            yield m(X)
            return "done"

    g = gen()
    first = next(g)
    with pytest.raises(StopIteration) as stop:
        next(g)
    assert stop.value.value == "done"
    clean(m, start)
    want = hand(m, X, **{"0__bias": torch.zeros(3)})
    torch.testing.assert_close(first, want)


def test_close_inside_the_inner_block_finally_sees_decorator_and_block():
    m = small()
    start = flags(m)
    seen = []
    w = full((1, 3), 4.0)

    @ts.freeze(m, "0")
    def gen():
        with ts.unfreeze(m, "0.weight"), ts.swap(m, {"2.weight": w}):
            try:
                yield
                yield
            finally:
                seen.append((reads(m), m(X).detach()))

    g = gen()
    next(g)
    next(g)
    g.close()
    assert seen[0][0] == fold(m, start, [F0, ("unfreeze", "0.weight")])
    torch.testing.assert_close(seen[0][1], hand(m, X, **{"2__weight": w}))
    clean(m, start)


@pytest.mark.parametrize("cycle", [False, True])
def test_abandoned_generator_collected_restores_everything(cycle):
    m = small()
    start = flags(m)
    seen = []
    keep = []

    @ts.freeze(m, "0")
    def gen():
        with ts.unfreeze(m, "0.weight"), ts.stop_gradient(m, "1"):
            try:
                yield
                yield
            finally:
                seen.append(reads(m))

    g = gen()
    if cycle:
        keep.append(g)
        keep.append(keep)  # the list holds the generator, and itself
    next(g)
    assert len(ts_modes()) == 1
    del g, keep
    gc.collect()
    assert seen == [fold(m, start, [F0, ("unfreeze", "0.weight")])]
    clean(m, start)


def test_abandoned_swap_generator_collected_inside_the_callers_own_swap_block():
    """The collection runs the generator's exit (with a fresh decorator context) while the
    caller holds a swap of the same parameter: the caller's swap stays, in force."""
    m = small()
    start = flags(m)

    @ts.swap(m, {"2.bias": torch.full((1,), 1.0)})
    def gen():
        with ts.swap(m, {"2.bias": torch.full((1,), 2.0)}):
            yield
            yield

    g = gen()
    next(g)
    mine = torch.full((1,), 3.0)
    with ts.swap(m, {"2.bias": mine}):
        del g
        gc.collect()
        assert len(ts_modes()) == 1
        torch.testing.assert_close(m(X), hand(m, X, **{"2__bias": mine}))
    clean(m, start)


def test_a_later_resumption_whose_context_cannot_be_made_raises_clearly_and_cleans_up():
    """The selected layer deleted between resumptions: the next resumption raises the
    selector's ValueError; the body is finalized (its blocks left), nothing stays behind."""
    m = small()
    start = flags(m)[:4]
    seen = []

    @ts.freeze(m, "2")
    def gen():
        try:
            with ts.unfreeze(m, "0"), ts.swap(m, {"0.bias": torch.zeros(3)}):
                yield
                yield
        finally:
            seen.append("finally")

    g = gen()
    next(g)
    del m[2]
    with pytest.raises(ValueError, match="'2'"):
        next(g)
    gc.collect()
    assert seen == ["finally"]
    assert ts_modes() == [] and entries_on(m) == []
    assert flags(m) == reads(m) == start


# ============================================================= stand-in decorators
def test_swap_decorator_with_an_inner_swap_of_the_same_parameter():
    m = small()
    start = flags(m)
    d, i = full((1, 3), 1.0), full((1, 3), 2.0)

    @ts.swap(m, {"2.weight": d})
    def gen():
        yield m(X)
        with ts.swap(m, {"2.weight": i}):
            for _ in range(3):
                yield m(X)
        yield m(X)

    g = gen()
    outs = [next(g)]
    torch.testing.assert_close(m(X), hand(m, X))  # between: nothing
    for _ in range(3):
        outs.append(next(g))
        torch.testing.assert_close(m(X), hand(m, X, **{"2__weight": i}))  # the held block
    outs.append(next(g))
    assert list(g) == []
    want_d, want_i = hand(m, X, **{"2__weight": d}), hand(m, X, **{"2__weight": i})
    for out, want in zip(outs, [want_d, want_i, want_i, want_i, want_d]):
        torch.testing.assert_close(out, want)
    clean(m, start)


def test_stop_gradient_decorator_with_an_inner_swap_of_a_blocked_parameter():
    """stop_gradient outside, swap inside (one long block): the stand-in learns; the
    parameters it does not replace stay blocked."""
    m = small(mixed=False)
    start = flags(m)
    w = full((1, 3), 2.0, grad=True)

    @ts.stop_gradient(m, "2")
    def gen():
        with ts.swap(m, {"2.weight": w}):
            for _ in range(3):
                yield m(X).sum()

    losses = list(gen())
    sum(losses).backward()
    w_ref = w.detach().clone().requires_grad_()
    want = hand(m, X, **{"2__weight": w_ref}).sum() * 3
    torch.testing.assert_close(sum(losses), want)
    want.backward()
    torch.testing.assert_close(w.grad, w_ref.grad * 1)
    assert m[2].weight.grad is None and m[2].bias.grad is None
    clean(m, start)


def test_swap_decorator_with_an_inner_stop_gradient_of_the_swapped_parameter():
    """swap outside, stop_gradient inside (one long block): the op sees the swapped tensor,
    detached. A decorator context put above the held block would let the stand-in learn."""
    m = small(mixed=False)
    start = flags(m)
    w = full((1, 3), 2.0, grad=True)

    @ts.swap(m, {"2.weight": w})
    def gen():
        with ts.stop_gradient(m, "2.weight"):
            yield m(X).sum()
            yield m(X).sum()
            yield m(X).sum()

    losses = list(gen())
    torch.testing.assert_close(losses[2], hand(m, X, **{"2__weight": w.detach()}).sum())
    sum(losses).backward()
    assert w.grad is None and m[2].weight.grad is None and m[2].bias.grad is not None
    clean(m, start)


def test_stop_gradient_decorator_with_an_inner_unfreeze_grads_match_by_hand():
    """The losses of two resumptions, backpropagated between resumptions (the held unfreeze
    still on, the decorator's block off), equal plain PyTorch: the flag set by hand, layer 1
    detached by hand."""
    m = small()
    start = flags(m)

    @ts.stop_gradient(m, "1")
    def gen():
        with ts.unfreeze(m, "0.bias"):
            yield m(X).sum()
            yield m(X).pow(2).sum()
            yield None

    g = gen()
    loss = next(g) + next(g)
    check(m, start, [("unfreeze", "0.bias")])
    loss.backward()
    got = [p.grad for p in m.parameters()]
    assert list(g) == [None]
    clean(m, start)

    ref = small()  # same seed: same values
    ref[0].bias.requires_grad_(True)  # the held unfreeze, by hand
    params = {**dict(ref.named_parameters()),
              "1.weight": ref[1].weight.detach(), "1.bias": ref[1].bias.detach()}
    (functional_call(ref, params, (X,)).sum()
     + functional_call(ref, params, (X,)).pow(2).sum()).backward()
    want = [p.grad for p in ref.parameters()]
    assert [a is None for a in got] == [b is None for b in want] == [False, False, True, True,
                                                                    False, False]
    for a, b in zip(got, want):
        if a is not None:
            torch.testing.assert_close(a, b)


def test_nested_swap_decorated_generators_with_held_swaps():
    m = small()
    start = flags(m)
    v = {k: torch.full((1,), float(k)) for k in range(1, 5)}

    def out_with(k):
        return hand(m, X, **{"2__bias": v[k]})

    @ts.swap(m, {"2.bias": v[2]})
    def inner():
        yield m(X)
        with ts.swap(m, {"2.bias": v[4]}):
            yield m(X)
            yield m(X)
        yield m(X)

    @ts.swap(m, {"2.bias": v[1]})
    def outer():
        yield m(X)
        with ts.swap(m, {"2.bias": v[3]}):
            yield from inner()
            yield m(X)
        yield m(X)

    outs = list(outer())
    for got, k in zip(outs, [1, 2, 4, 4, 2, 3, 1]):
        torch.testing.assert_close(got, out_with(k))
    assert len(outs) == 7
    clean(m, start)


def test_swap_generators_on_disjoint_parameters_interleaved():
    m = small()
    start = flags(m)
    t = {name: torch.full((1,), float(i + 1)) for i, name in enumerate("ab")}
    w = torch.zeros(3)

    @ts.swap(m, {"0.bias": w})
    def gen(name, path):
        with ts.swap(m, {path: t[name] if path == "2.bias" else t[name].expand(3).clone()}):
            for _ in range(3):
                yield m(X)

    a, b = gen("a", "2.bias"), gen("b", "1.bias")
    outs_a, outs_b = [next(a)], []
    for _ in range(2):
        outs_b.append(next(b))
        outs_a.append(next(a))
    outs_b.append(next(b))
    # a: its decorator, its block, and b's held block (b entered after a's first step)
    want_a0 = hand(m, X, **{"0__bias": w, "2__bias": t["a"]})
    want_a = hand(m, X, **{"0__bias": w, "2__bias": t["a"], "1__bias": t["b"].expand(3)})
    want_b = hand(m, X, **{"0__bias": w, "2__bias": t["a"], "1__bias": t["b"].expand(3)})
    torch.testing.assert_close(outs_a[0], want_a0)
    for o in outs_a[1:]:
        torch.testing.assert_close(o, want_a)
    for o in outs_b:
        torch.testing.assert_close(o, want_b)
    a.close()
    b.close()
    clean(m, start)


def test_swap_decorated_generator_send_throw_close_restore_values():
    m = small()
    start = flags(m)
    d, i = torch.full((1,), 5.0), torch.full((1,), 6.0)

    @ts.swap(m, {"2.bias": d})
    def gen():
        with ts.swap(m, {"2.bias": i}):
            while True:
                try:
                    got = yield m(X)
                except LookupError:
                    got = "thrown"
                assert got in ("s", "thrown")

    g = gen()
    want = hand(m, X, **{"2__bias": i})
    torch.testing.assert_close(next(g), want)
    torch.testing.assert_close(g.send("s"), want)
    torch.testing.assert_close(g.throw(LookupError()), want)
    g.close()
    clean(m, start)
    torch.testing.assert_close(m(X), hand(m, X))


@pytest.mark.parametrize("kind", ["stop_gradient", "swap", "constant"])
def test_stand_in_decorator_with_a_users_torch_function_mode_held_across_yields(kind):
    m = small()
    start = flags(m)
    block = {"stop_gradient": lambda: ts.stop_gradient(m, "1"),
             "swap": lambda: ts.swap(m, {"2.bias": torch.zeros(1)}),
             "constant": lambda: ts.constant(m, "0")}[kind]()

    @block
    def gen():
        with torch.device("meta"):
            yield torch.empty(1).device.type
            yield torch.empty(1).device.type
        yield torch.empty(1).device.type

    try:
        got = list(gen())
    except RuntimeError as e:
        got = str(e)
        del e
    gc.collect()
    leaked = [type(md).__name__ for md in torch.overrides._get_current_function_mode_stack()]
    assert got == ["meta", "meta", "cpu"], got
    assert leaked == [] and torch.empty(1).device.type == "cpu"
    clean(m, start)


# ============================================================= constant
@pytest.mark.parametrize("how", ["generator", "async"])
def test_constant_decorator_with_an_inner_constant_held_across_a_suspension(how):
    m = small()
    start = flags(m)
    errors = []

    def write(path):
        p = m.get_parameter(path)
        try:
            with torch.no_grad():
                p.add_(0)
        except RuntimeError as e:
            errors.append((path, "'%s'" % path in str(e)))
            return False
        return True

    if how == "generator":
        @ts.constant(m, "0")
        def body():
            with ts.constant(m, "1"):
                yield write("0.weight"), write("1.weight")
                yield write("0.weight"), write("1.weight")

        try:
            got = list(body())
        except RuntimeError as e:
            got = str(e)
            del e
    else:
        @ts.constant(m, "0")
        async def body():
            with ts.constant(m, "1"):
                first = write("0.weight"), write("1.weight")
                await asyncio.sleep(0)
                return [first, (write("0.weight"), write("1.weight"))]

        try:
            got = asyncio.run(body())
        except RuntimeError as e:
            got = str(e)
            del e
    gc.collect()
    assert got == [(False, False), (False, False)], got
    assert all(named for _, named in errors)
    clean(m, start)
    assert write("0.weight") and write("1.weight")


def test_constant_decorator_with_an_inner_stop_gradient_and_the_reverse():
    m = small()
    start = flags(m)

    def writable(path):
        try:
            with torch.no_grad():
                m.get_parameter(path).add_(0)
        except RuntimeError:
            return False
        return True

    @ts.constant(m, "0")
    def a():
        with ts.stop_gradient(m, "2"):
            yield writable("0.weight"), m(X).requires_grad
            yield writable("0.weight"), m(X).requires_grad

    @ts.stop_gradient(m)
    def b():
        with ts.constant(m, "1"):
            yield writable("1.weight"), m(X).requires_grad
            yield writable("1.weight"), m(X).requires_grad

    ga, gb = a(), b()
    assert next(ga) == (False, True)
    assert writable("0.weight")  # between: the decorator's protection is off
    assert next(gb) == (False, False)
    assert not writable("1.weight")  # between: the held constant is still on
    assert next(ga) == (False, True) and next(gb) == (False, False)
    assert list(ga) == list(gb) == []
    clean(m, start)
    assert writable("1.weight")


# ============================================================= asyncio
def test_gather_of_decorated_coroutines_on_separate_models_with_inner_blocks():
    models = [small(mixed=bool(i % 2)) for i in range(6)]
    starts = [flags(m) for m in models]
    vals = [torch.full((1,), float(i)) for i in range(6)]
    ok = []

    def make(i):
        m, start = models[i], starts[i]

        @ts.freeze(m, "0")
        async def flag_task():
            with ts.unfreeze(m, "0.weight"):
                for _ in range(3):
                    await asyncio.sleep(0)
                    ok.append(flags(m) == reads(m)
                              == fold(m, start, [F0, ("unfreeze", "0.weight")]))
            await asyncio.sleep(0)
            ok.append(flags(m) == fold(m, start, [F0]))
            return i

        @ts.swap(m, {"2.bias": vals[i]})
        async def swap_task():
            with ts.swap(m, {"2.bias": vals[i] + 10}), ts.stop_gradient(m, "1"):
                for _ in range(3):
                    await asyncio.sleep(0)
                    ok.append(torch.allclose(m(X), hand(m, X, **{"2__bias": vals[i] + 10})))
            await asyncio.sleep(0)
            ok.append(torch.allclose(m(X), hand(m, X, **{"2__bias": vals[i]})))
            return i

        return flag_task() if i % 2 else swap_task()

    async def main():
        return await asyncio.gather(*(make(i) for i in range(6)))

    assert asyncio.run(main()) == list(range(6))
    assert len(ok) == 24 and all(ok)
    for m, s in zip(models, starts):
        clean(m, s)


def test_gather_on_one_model_with_commuting_contexts_across_awaits():
    """Decorator freeze('0') on every task, each holding a freeze of its own layer across
    awaits: all these contexts commute, so every task sees the union of what is held."""
    m = small()
    start = flags(m)
    holding, ok = set(), []
    own = ["1.weight", "1.bias", "2.weight", "2.bias"]

    @ts.freeze(m, "0")
    async def task(i):
        await asyncio.sleep(0)
        with ts.freeze(m, own[i]):
            holding.add(i)
            for k in range(3):
                await asyncio.sleep(0.0005 * ((i + k) % 3))
                want = fold(m, start, [F0] + [("freeze", own[j]) for j in sorted(holding)])
                ok.append(flags(m) == reads(m) == want)
            holding.discard(i)
        return i

    async def main():
        return await asyncio.gather(*(task(i) for i in range(4)))

    assert asyncio.run(main()) == [0, 1, 2, 3]
    assert len(ok) == 12 and all(ok)
    clean(m, start)


def test_gather_on_one_model_with_swaps_of_disjoint_parameters_across_awaits():
    """Every task: decorator swap of '0.bias', an inner swap of its own parameter held across
    awaits. Disjoint swaps commute: each step computes with the decorator's tensor and every
    tensor held at that moment."""
    m = small()
    start = flags(m)
    own = ["1.bias", "2.bias", "1.weight", "2.weight"]
    shapes = {p: tuple(m.get_parameter(p).shape) for p in own}
    tensors = {p: torch.full(shapes[p], float(i + 2)) for i, p in enumerate(own)}
    dec = torch.full((3,), 1.0)
    holding, ok = set(), []

    @ts.swap(m, {"0.bias": dec})
    async def task(i):
        await asyncio.sleep(0)
        with ts.swap(m, {own[i]: tensors[own[i]]}):
            holding.add(i)
            for k in range(3):
                await asyncio.sleep(0.0005 * ((i + k) % 3))
                repl = {own[j].replace(".", "__"): tensors[own[j]] for j in holding}
                ok.append(torch.allclose(m(X), hand(m, X, **{"0__bias": dec}, **repl)))
            holding.discard(i)
        return i

    async def main():
        return await asyncio.gather(*(task(i) for i in range(4)))

    assert asyncio.run(main()) == [0, 1, 2, 3]
    assert len(ok) == 12 and all(ok)
    clean(m, start)
    torch.testing.assert_close(m(X), hand(m, X))


def test_cancelled_decorated_coroutine_inside_its_inner_block():
    m = small()
    start = flags(m)
    seen = []

    @ts.freeze(m, "0")
    async def slow():
        with ts.unfreeze(m, "0.weight"), ts.swap(m, {"2.bias": torch.zeros(1)}):
            try:
                await asyncio.sleep(10)
            finally:
                seen.append((reads(m), m(X).detach()))

    async def main():
        t = asyncio.ensure_future(slow())
        await asyncio.sleep(0)
        assert reads(m) == fold(m, start, [("unfreeze", "0.weight")])
        assert len(ts_modes()) == 1  # the held swap, between resumptions
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t

    asyncio.run(main())
    assert seen[0][0] == fold(m, start, [F0, ("unfreeze", "0.weight")])
    torch.testing.assert_close(seen[0][1], hand(m, X, **{"2__bias": torch.zeros(1)}))
    clean(m, start)


def test_wait_for_timeout_of_a_decorated_coroutine_restores():
    m = small()
    start = flags(m)

    @ts.stop_gradient(m)
    async def slow():
        with ts.freeze_except(m, "2"), ts.swap(m, {"2.bias": torch.zeros(1)}):
            await asyncio.sleep(10)

    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(slow(), 0.01)

    asyncio.run(main())
    clean(m, start)


def test_nested_decorated_coroutines_with_held_blocks():
    m = small()
    start = flags(m)
    log = []

    @ts.unfreeze(m, "0")
    async def inner():
        with ts.freeze(m, "0.weight"), ts.swap(m, {"2.bias": torch.full((1,), 4.0)}):
            await asyncio.sleep(0)
            log.append(("inner", reads(m), m(X).detach()))
        await asyncio.sleep(0)
        log.append(("inner-after", reads(m), m(X).detach()))

    @ts.freeze(m)
    async def outer():
        with ts.swap(m, {"2.bias": torch.full((1,), 3.0)}):
            await asyncio.sleep(0)
            await inner()
            log.append(("outer", reads(m), m(X).detach()))

    asyncio.run(outer())
    want = {
        "inner": (fold(m, start, [("freeze", None), ("unfreeze", "0"), ("freeze", "0.weight")]),
                  4.0),
        "inner-after": (fold(m, start, [("freeze", None), ("unfreeze", "0")]), 3.0),
        "outer": (fold(m, start, [("freeze", None)]), 3.0),
    }
    for name, fl, out in log:
        assert fl == want[name][0], name
        torch.testing.assert_close(out, hand(m, X, **{"2__bias": torch.full((1,), want[name][1])}))
    clean(m, start)


# ============================================================= history of held blocks
def test_flag_decorator_after_its_own_block_ended_is_not_sunk_below_another_generators_block():
    m = small(mixed=False)
    start = flags(m)

    @ts.freeze(m, "0")
    def gen(hold):
        if hold:
            with ts.unfreeze(m, "0.weight"):
                yield flags(m)
        while True:
            yield flags(m)

    def other():
        with ts.unfreeze(m, "0.weight"):
            yield
            yield

    a = gen(True)
    next(a)
    b = other()
    next(b)  # b's block, entered outside any decorated resumption
    next(a)  # a leaves its own block in this resumption
    fresh = gen(False)
    # a and fresh now hold nothing: the same function, resumed in the same outside state
    got_a, got_fresh = next(a), next(fresh)
    a.close()
    fresh.close()
    b.close()
    clean(m, start)
    assert got_fresh == fold(m, start, [("unfreeze", "0.weight"), F0])
    assert got_a == got_fresh


def test_swap_decorator_after_its_own_block_ended_is_not_sunk_below_another_generators_swap():
    m = small()
    start = flags(m)
    dec, mine, theirs = (torch.full((1,), v) for v in (1.0, 2.0, 3.0))

    @ts.swap(m, {"2.bias": dec})
    def gen(hold):
        if hold:
            with ts.swap(m, {"2.bias": mine}):
                yield m(X)
        while True:
            yield m(X)

    def other():
        with ts.swap(m, {"2.bias": theirs}):
            yield
            yield

    a = gen(True)
    next(a)
    b = other()
    next(b)
    next(a)  # a leaves its own swap
    fresh = gen(False)
    got_a, got_fresh = next(a), next(fresh)
    a.close()
    fresh.close()
    b.close()
    clean(m, start)
    torch.testing.assert_close(got_fresh, hand(m, X, **{"2__bias": dec}))
    torch.testing.assert_close(got_a, got_fresh)
