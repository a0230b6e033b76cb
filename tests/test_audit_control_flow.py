"""Audit: contexts and structural_grad under unusual control flow.

Threads (own models, the same model, shared submodules, blocks held while other threads run),
exits out of LIFO order, generators and coroutines (held across ``yield`` / ``await``, the
decorator form), exceptions (inside blocks, from user hooks, from the loss callable, from a
declaration at exit), activation checkpointing whose recomputation runs after the block, and
grad-mode nesting. Gradients are compared with plain PyTorch where the same flags are set by
hand or ``.detach()`` is placed by hand.

The contract checked is the one of docs/freezing.md and docs/stop_gradient.md.
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import gc
import random
import sys
import threading

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointError, checkpoint

import torchstruct as ts
from torchstruct import _state

from _flags import entries_on, fold

JOIN = 30.0  # seconds: a thread still alive after this is a hang (asserted)


# ----------------------------------------------------------------------------- helpers
def flags(m):
    return [p.requires_grad for p in m.parameters()]


def reads(m):
    return [ts.is_trainable(m, p) for p in m.parameters()]


def small(mixed=True):
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 1))
    if mixed:
        m[0].bias.requires_grad_(False)  # a starting flag that is off: respected
    return m


def modes():
    return len(torch.overrides._get_current_function_mode_stack())


def run_threads(targets, timeout=JOIN):
    threads = [threading.Thread(target=t, daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a thread hung"


@pytest.fixture
def fast_switching():
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # many more thread switches inside torchstruct's code
    yield
    sys.setswitchinterval(before)


def snapshot(m):
    """Everything a context must give back: flags, values, hooks, records, stacks."""
    return {
        "flags": flags(m),
        "values": [p.detach().clone() for p in m.parameters()],
        "hooks": [(len(mod._forward_pre_hooks), len(mod._forward_hooks)) for mod in m.modules()],
        "records": [_state.record(p) for p in m.parameters()],
        "entries": len(entries_on(m)),
        "modes": modes(),
        "training": [mod.training for mod in m.modules()],
        "grads": [p.grad for p in m.parameters()],
    }


def assert_same_snapshot(a, b):
    assert a["flags"] == b["flags"]
    assert all(torch.equal(x, y) for x, y in zip(a["values"], b["values"]))
    assert a["hooks"] == b["hooks"]
    assert a["records"] == b["records"]
    assert a["entries"] == b["entries"]
    assert a["modes"] == b["modes"]
    assert a["training"] == b["training"]
    assert [g is None for g in a["grads"]] == [g is None for g in b["grads"]]


def same_grads(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


# ============================================================================= threads
def test_threads_hammer_flag_contexts_on_own_models(fast_switching):
    """8 threads x 200 iterations of random nesting on each thread's own model: flags inside
    every block are the fold of the thread's stack, every exit restores the level below, and
    the end is the start exactly (flags and reads)."""
    errors = []
    models = [small() for _ in range(8)]

    def worker(seed):
        rnd, m = random.Random(seed), models[seed]
        ts.attach(m)
        paths = [n for n, _ in m.named_parameters()]
        start = flags(m)
        x = torch.randn(2, 3)
        try:
            for it in range(200):
                stack, active = [], []
                for _ in range(rnd.randint(1, 4)):
                    kind = rnd.choice(["freeze", "freeze_except", "unfreeze"])
                    sel = rnd.choice(["0", "1", "2", "0.weight", "1.bias", "0.bias"])
                    stack.append(getattr(ts, kind)(m, sel))
                    active.append((kind, sel))
                    if flags(m) != fold(start, paths, active):
                        errors.append((seed, it, "inside", active, flags(m)))
                        return
                    m(x)
                while stack:
                    stack.pop().__exit__(None, None, None)
                    active.pop()
                    if flags(m) != fold(start, paths, active):
                        errors.append((seed, it, "exit", active, flags(m)))
                        return
        except Exception as e:  # noqa: BLE001
            errors.append((seed, repr(e)))

    run_threads([lambda s=s: worker(s) for s in range(8)])
    assert errors == []
    for m in models:
        assert flags(m) == [True, False, True, True, True, True]
        assert reads(m) == flags(m)


def test_threads_hammer_blocks_and_structural_grad(fast_switching):
    """stop_gradient, swap, freeze + stop_gradient and structural_grad(wrt=) on each thread's
    own model, concurrently: results right in every iteration, nothing left behind."""
    errors = []

    def worker(seed):
        rnd = random.Random(seed)
        torch.manual_seed(seed)
        m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
        x = torch.randn(2, 3)
        try:
            for it in range(200):
                op = rnd.choice(["sg", "swap", "sgrad", "freeze_sg"])
                if op == "sg":
                    with ts.stop_gradient(m, "0"):
                        y = m(x).sum()
                    g0, g1 = torch.autograd.grad(y, [m[0].weight, m[1].weight], allow_unused=True)
                    ok = g0 is None and g1 is not None
                elif op == "swap":
                    with ts.swap(m, {"1.weight": torch.zeros(1, 3)}):
                        y = m(x)
                    ok = torch.equal(y.detach(), m[1].bias.detach().expand(2, 1))
                elif op == "sgrad":
                    g = ts.structural_grad(m, lambda mm: mm(x).sum(), wrt="1")
                    ok = sorted(ts.tree.paths(g)) == ["1.bias", "1.weight"]
                else:
                    with ts.freeze(m, "1"), ts.stop_gradient(m, "0"):
                        y = m(x).sum()
                    ok = not y.requires_grad
                ok = ok and all(flags(m)) and modes() == 0
                if not ok:
                    errors.append((seed, it, op))
                    return
        except Exception as e:  # noqa: BLE001
            errors.append((seed, repr(e)))

    run_threads([lambda s=s: worker(s) for s in range(8)])
    assert errors == []


def test_threads_decorated_functions_on_own_models(fast_switching):
    errors = []

    def worker(seed):
        m = small()
        start = flags(m)

        @ts.freeze_except(m, "2")
        def step(depth):
            inner = ts.unfreeze(m, "0.bias") if depth else contextlib.nullcontext()
            with inner:
                return flags(m)

        for it in range(200):
            got = step(it % 2)
            want = [False, it % 2 == 1, False, False, True, True]
            if got != want or flags(m) != start:
                errors.append((seed, it, got))
                return

    run_threads([lambda s=s: worker(s) for s in range(8)])
    assert errors == []


def test_threads_on_the_same_model_and_on_models_sharing_a_submodule_end_restored(
        fast_switching):
    """Documented as 'should not' (docs/freezing.md, Threads: one bit per parameter): what a
    block sees may come from another thread's block, but nothing may end wrong: once every
    thread is done, every flag is its start and reads agree."""
    shared = nn.Linear(3, 3)
    shared.bias.requires_grad_(False)
    a, b = nn.Sequential(shared, nn.Linear(3, 1)), nn.Sequential(nn.Linear(3, 3), shared)
    same = small()
    start = {id(p): p.requires_grad for m in (a, b, same) for p in m.parameters()}
    errors = []

    def worker(seed, model):
        rnd = random.Random(seed)
        try:
            for _ in range(150):
                stack = []
                for _ in range(rnd.randint(1, 3)):
                    kind = rnd.choice([ts.freeze, ts.unfreeze, ts.freeze_except])
                    stack.append(kind(model, rnd.choice(["0", "1", "0.weight", "1.bias"])))
                    model(torch.randn(2, 3))
                rnd.shuffle(stack)  # and out of order
                for c in stack:
                    c.__exit__(None, None, None)
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    targets = [a, b, a, b, same, same, same, same]
    run_threads([lambda s=s, t=t: worker(s, t) for s, t in enumerate(targets)])
    assert errors == []
    assert {id(p): p.requires_grad for m in (a, b, same) for p in m.parameters()} == start
    for m in (a, b, same):
        assert reads(m) == flags(m)
    assert entries_on(a, b, same) == []


@pytest.mark.parametrize("kind", ["stop_gradient", "swap", "constant"])
def test_a_block_held_in_one_thread_does_not_act_in_another(kind):
    """docs/stop_gradient.md: blocks are thread-local."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    x = torch.randn(3, 2)
    plain = m(x).sum().item()
    entered, done, res = threading.Event(), threading.Event(), {}

    def holder():
        ctx = {"stop_gradient": lambda: ts.stop_gradient(m),
               "swap": lambda: ts.swap(m, {"1.bias": torch.tensor([100.0])}),
               "constant": lambda: ts.constant(m)}[kind]()
        with ctx:
            entered.set()
            done.wait(JOIN)
            y = m(x).sum()
            res["holder"] = (y.requires_grad, y.item())
            if kind == "constant":
                try:
                    with torch.no_grad():
                        m[1].bias.add_(0.0)
                    res["holder_write"] = "ok"
                except RuntimeError:
                    res["holder_write"] = "refused"

    def other():
        entered.wait(JOIN)
        try:
            y = m(x).sum()
            g = torch.autograd.grad(y, list(m.parameters()))
            res["other"] = (all(t is not None for t in g), y.item())
            with torch.no_grad():
                m[1].bias.add_(0.0)  # a write in this thread: not the block's business
            res["other_write"] = "ok"
        finally:
            done.set()

    run_threads([holder, other])
    assert res["other"] == (True, pytest.approx(plain))
    assert res["other_write"] == "ok"
    if kind == "stop_gradient":
        assert res["holder"] == (False, pytest.approx(plain))
    elif kind == "swap":
        assert res["holder"][1] != pytest.approx(plain)
    else:
        assert res["holder_write"] == "refused"
    assert modes() == 0


@pytest.mark.parametrize("kind", ["stop_gradient", "swap", "constant"])
def test_a_block_exited_in_another_thread_raises_and_stays_active(kind):
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    c = {"stop_gradient": lambda: ts.stop_gradient(m),
         "swap": lambda: ts.swap(m, {"1.bias": torch.tensor([1.0])}),
         "constant": lambda: ts.constant(m)}[kind]()
    out = {}

    def exit_elsewhere():
        try:
            c.__exit__(None, None, None)
            out["r"] = "ok"
        except RuntimeError as e:
            out["r"] = str(e)

    run_threads([exit_elsewhere])
    assert "thread" in out["r"] and kind in out["r"]
    assert c._active and modes() == 1  # still active here
    c.__exit__(None, None, None)  # and exits in its own thread
    assert modes() == 0 and not entries_on(m)


def test_a_flag_context_exited_in_another_thread_restores():
    m = small()
    start = flags(m)
    c = ts.freeze(m, "1")
    assert flags(m) == [True, False, False, False, True, True]
    run_threads([lambda: c.__exit__(None, None, None)])
    assert flags(m) == start and reads(m) == start


def test_backward_in_another_thread_after_a_reentrant_checkpoint_in_a_block():
    """The recomputation (in the backward's thread) runs with the flags remembered at the
    forward, while another thread holds a context on another model."""
    torch.manual_seed(0)
    net = _CkNet(5, reentrant=True)
    other = _CkNet(5, reentrant=True)
    x = torch.randn(3, 5)
    want = _reference_grads(net, x, "block.0")
    with ts.freeze(net, "block.0"):
        y = net(x).pow(2).sum()
    held, go, err = threading.Event(), threading.Event(), []

    def hold():
        with ts.freeze(other, "out"):
            held.set()
            go.wait(JOIN)

    def backward():
        held.wait(JOIN)
        try:
            y.backward()
        except Exception as e:  # noqa: BLE001
            err.append(e)
        finally:
            go.set()

    run_threads([hold, backward])
    assert err == []
    same_grads([p.grad for p in net.parameters()], want)
    assert all(flags(net)) and all(flags(other))


def test_two_threads_structural_grad_wrt_on_the_same_model_end_restored():
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    ts.attach(m)
    x = torch.randn(3, 2)
    start = flags(m)
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def a():
        def loss(mm):
            a_in.set()
            b_in.wait(JOIN)
            return mm(x).sum()

        try:
            ts.structural_grad(m, loss, wrt="0")
        except RuntimeError:
            pass  # a clear error for this call is fine
        finally:
            a_out.set()

    def b():
        a_in.wait(JOIN)

        def loss(mm):
            b_in.set()
            a_out.wait(JOIN)
            return mm(x).sum()

        ts.structural_grad(m, loss, wrt="1")

    run_threads([a, b])
    m(x)  # a forward does not put it right either
    assert flags(m) == start == reads(m)


# ============================================================================= exit order
KINDS = ["freeze", "freeze_except", "unfreeze"]


@pytest.mark.parametrize("first", KINDS)
@pytest.mark.parametrize("second", KINDS)
@pytest.mark.parametrize("hand_off", [False, True])
def test_out_of_lifo_order_exit(first, second, hand_off):
    """a = first(m, 'x'); b = second(m, 'x'); a exits before b: b alone applies, then the
    start (also a starting flag set off by hand)."""
    m = small()
    if hand_off:
        m[1].weight.requires_grad_(False)
    paths = [n for n, _ in m.named_parameters()]
    start = flags(m)
    a = getattr(ts, first)(m, "1")
    b = getattr(ts, second)(m, "1.weight")
    assert flags(m) == fold(start, paths, [(first, "1"), (second, "1.weight")])
    a.__exit__(None, None, None)
    assert flags(m) == fold(start, paths, [(second, "1.weight")])
    assert reads(m) == flags(m)
    b.__exit__(None, None, None)
    assert flags(m) == start == reads(m)


def test_exit_stack_mixing_every_context_and_a_failing_entry():
    torch.manual_seed(0)
    m = small(mixed=False)
    x = torch.randn(2, 3)
    start, before = flags(m), [p.detach().clone() for p in m.parameters()]
    with contextlib.ExitStack() as stack:
        stack.enter_context(ts.freeze(m, "0"))
        stack.enter_context(ts.stop_gradient(m, "1"))
        stack.enter_context(ts.swap(m, {"2.bias": torch.tensor([5.0])}))
        stack.enter_context(ts.constant(m, "2"))
        stack.enter_context(ts.unfreeze(m, "0.bias"))
        # read through the blocks: the stand-ins' flags (documented), 1.* detached aliases,
        # 2.bias the swapped-in tensor
        assert flags(m) == [False, True, False, False, True, False]
        with _state.LOCK:  # the parameters' own flags
            assert flags(m) == [False, True, True, True, True, True]
        y = m(x)
        ref = nn.functional.linear(
            nn.functional.linear(nn.functional.linear(x, m[0].weight.detach(), m[0].bias),
                                 m[1].weight.detach(), m[1].bias.detach()),
            m[2].weight, torch.tensor([5.0]))
        torch.testing.assert_close(y, ref)
        moved = stack.pop_all()  # transferred: still active after the with
    assert modes() > 0
    moved.close()
    assert flags(m) == start and modes() == 0 and not entries_on(m)

    with pytest.raises(ValueError):
        with contextlib.ExitStack() as stack:
            stack.enter_context(ts.freeze(m, "0"))
            stack.enter_context(ts.stop_gradient(m, "1"))
            stack.enter_context(ts.freeze(m, "no_such_layer"))  # raises: the rest unwinds
    assert flags(m) == start and modes() == 0 and not entries_on(m)
    assert all(torch.equal(p, b) for p, b in zip(m.parameters(), before))


@pytest.mark.parametrize("kind", ["freeze", "stop_gradient", "swap", "constant"])
def test_a_context_exited_twice_and_reentered_in_sequence(kind):
    m = small()
    start = flags(m)
    make = {"freeze": lambda: ts.freeze(m, "1"), "stop_gradient": lambda: ts.stop_gradient(m),
            "swap": lambda: ts.swap(m, {"2.bias": torch.zeros(1)}),
            "constant": lambda: ts.constant(m)}[kind]
    c = make()
    c.__exit__(None, None, None)
    c.__exit__(None, None, None)  # a second exit changes nothing
    assert flags(m) == start and modes() == 0 and not entries_on(m)
    for _ in range(3):  # a lifted context object entered again re-applies
        with c:
            if kind == "freeze":
                assert flags(m) == [True, False, False, False, True, True]
            else:
                assert modes() == 1
        assert flags(m) == start and modes() == 0 and not entries_on(m)


@pytest.mark.parametrize("kind", ["freeze", "stop_gradient"])
def test_the_same_context_object_entered_while_active(kind):
    m = small()
    x = torch.randn(2, 3)
    c = ts.freeze(m, "1") if kind == "freeze" else ts.stop_gradient(m, "1")
    try:
        with c:
            with c:
                pass
            # still inside the outer `with c`: it must hold here
            if kind == "freeze":
                assert flags(m) == [True, False, False, False, True, True]
            else:
                y = m(x).sum()
                assert torch.autograd.grad(y, m[1].weight, allow_unused=True)[0] is None
    except RuntimeError as e:  # a clear refusal of the nested re-entry would be fine too
        assert "active" in str(e) or "entered" in str(e)
    assert flags(m) == [True, False, True, True, True, True] and modes() == 0


def test_stop_gradient_and_swap_exit_in_any_order():
    torch.manual_seed(0)
    m = nn.Linear(3, 1)
    x = torch.randn(2, 3)
    w = torch.ones(1, 3, requires_grad=True)
    a = ts.stop_gradient(m, "bias")
    b = ts.swap(m, {"weight": w})
    c = ts.stop_gradient(m, "weight")  # inner: blocks what stands in for the weight too
    a.__exit__(None, None, None)  # the bottom one first
    m(x).sum().backward()
    assert w.grad is None and m.bias.grad is not None and m.weight.grad is None
    c.__exit__(None, None, None)  # now the middle one
    y = m(x)
    torch.testing.assert_close(y, x @ w.T + m.bias)
    y.sum().backward()
    assert w.grad is not None and m.weight.grad is w.grad  # reads see the stand-in (doc)
    b.__exit__(None, None, None)
    assert m.weight.grad is None  # the parameter itself got nothing
    assert modes() == 0
    torch.testing.assert_close(m(x), x @ m.weight.T + m.bias)


def test_constant_exited_under_a_later_constant_raises_and_stays_active():
    """Documented: a constant block exited while a dispatch mode entered after it is still
    active raises and stays active."""
    m = nn.Linear(2, 1)
    a, b = ts.constant(m, "weight"), ts.constant(m, "bias")
    with pytest.raises(RuntimeError, match="reverse order"):
        a.__exit__(None, None, None)
    with torch.no_grad(), pytest.raises(RuntimeError, match="'weight'"):
        m.weight.add_(1)
    b.__exit__(None, None, None)
    a.__exit__(None, None, None)
    with torch.no_grad():
        m.weight.add_(1)  # free again


# ============================================================================= generators
def test_generators_holding_blocks_closed_early_collected_and_interleaved():
    m = small()
    start = flags(m)

    def frozen():
        with ts.freeze(m, "0"):
            yield flags(m)
            yield flags(m)

    def unfrozen():
        with ts.unfreeze(m, "0.bias"):
            yield flags(m)
            yield flags(m)

    a, b = frozen(), unfrozen()
    assert next(a) == [False, False, True, True, True, True]
    assert next(b) == [False, True, True, True, True, True]  # inner (later) wins
    a.close()  # out of order: b's block alone remains
    assert flags(m) == [True, True, True, True, True, True]
    del b
    gc.collect()  # never resumed: collected
    assert flags(m) == start and not entries_on(m)

    def blocked():
        with ts.stop_gradient(m, "0"):
            yield

    def swapped():
        with ts.swap(m, {"2.bias": torch.tensor([3.0])}):
            yield

    g, h = blocked(), swapped()
    next(g)
    next(h)
    assert modes() == 2
    g.close()  # the lower mode first
    x = torch.randn(2, 3)
    out = m(x)
    torch.testing.assert_close(out, m[2](m[1](m[0](x))) - m[2].bias + 3.0)
    del h
    gc.collect()
    assert modes() == 0


def test_a_generator_holding_a_block_closed_in_another_thread_raises_clearly():
    m = small()
    kept = []

    def gen():
        with ts.stop_gradient(m) as c:
            kept.append(c)
            yield

    g = gen()
    next(g)
    err = []

    def close():
        try:
            g.close()
        except RuntimeError as e:
            err.append(str(e))

    run_threads([close])
    assert err and "thread" in err[0]
    assert modes() == 1  # still active in this thread: exit it here
    kept[0].__exit__(None, None, None)
    assert modes() == 0


def test_decorated_generator_closed_thrown_collected_and_sent():
    m = small()
    start = flags(m)
    seen = []

    @ts.freeze(m, "0")
    def gen(n):
        try:
            for _ in range(n):
                got = yield flags(m)
                seen.append((got, flags(m)))
        finally:
            seen.append(("finally", flags(m)))

    frozen = [False, False, True, True, True, True]
    g = gen(3)
    assert next(g) == frozen and flags(m) == start
    assert g.send("hi") == frozen and seen[-1] == ("hi", frozen) and flags(m) == start
    g.close()
    assert seen[-1] == ("finally", frozen) and flags(m) == start
    g = gen(3)
    next(g)
    with pytest.raises(ValueError):
        g.throw(ValueError("x"))
    assert seen[-1] == ("finally", frozen) and flags(m) == start
    g = gen(3)
    next(g)
    del g
    gc.collect()
    assert seen[-1] == ("finally", frozen) and flags(m) == start and not entries_on(m)
    with pytest.raises(TypeError, match="async generator"):
        @ts.freeze(m, "0")
        async def agen():
            yield 1


def test_decorated_stop_gradient_generator_between_resumptions():
    m = small(mixed=False)
    x = torch.ones(1, 3)

    @ts.stop_gradient(m)
    def gen():
        yield m(x).sum()
        yield m(x).sum()

    g = gen()
    y = next(g)
    outside = m(x).sum()  # between resumptions: not blocked
    assert not y.requires_grad and outside.requires_grad
    assert not next(g).requires_grad
    g.close()
    assert modes() == 0


@pytest.mark.parametrize("kind", ["flags", "swap"])
def test_decorated_generator_with_an_inner_block_held_across_yield(kind):
    m = small(mixed=False)
    x = torch.ones(1, 3)
    if kind == "flags":
        @ts.freeze(m, "0")
        def gen():
            with ts.unfreeze(m, "0.weight"):  # inner: wins
                yield flags(m)
                yield flags(m)

        assert list(gen()) == [[True, False, True, True, True, True]] * 2
    else:
        @ts.swap(m, {"0.weight": torch.zeros(3, 3)})
        def gen():
            with ts.swap(m, {"0.weight": torch.ones(3, 3)}):  # inner: wins
                yield m[0](x).detach()
                yield m[0](x).detach()

        want = (3.0 + m[0].bias).detach().expand(1, 3)
        for y in gen():
            torch.testing.assert_close(y, want)


def test_decorated_generator_after_its_inner_block_ended_holds_again():
    """The inner block wins while the body holds it; once the body leaves it, the decorator's
    context alone applies at the later resumptions; between resumptions neither."""
    m = small(mixed=False)
    seen = []

    @ts.freeze(m, "0")
    def gen():
        with ts.unfreeze(m, "0.weight"):
            seen.append(flags(m)[:2])
            yield
            seen.append(flags(m)[:2])
        yield
        seen.append(flags(m)[:2])
        yield

    g = gen()
    next(g)
    between = flags(m)[:2]  # the inner block is still held here (a `with` across a yield)
    next(g)
    after = flags(m)[:2]
    next(g)
    assert seen == [[True, False], [True, False], [False, False]]
    assert between == [True, True] and after == [True, True]
    g.close()
    assert all(flags(m))


def test_decorated_async_function_with_an_inner_block_held_across_await():
    m = small(mixed=False)

    @ts.freeze(m, "0")
    async def step():
        with ts.unfreeze(m, "0.weight"):
            first = flags(m)
            await asyncio.sleep(0)
            return first, flags(m)

    first, second = asyncio.run(step())
    assert first == second == [True, False, True, True, True, True]


def test_async_gather_of_decorated_functions_sees_only_its_own_context():
    m = small()
    start = flags(m)
    paths = [n for n, _ in m.named_parameters()]
    log, rnd = [], random.Random(0)
    choices = [("freeze", "0"), ("freeze_except", "2"), ("unfreeze", "0.bias"), ("freeze", "2")]

    def make(i):
        kind, sel = choices[i % len(choices)]

        @getattr(ts, kind)(m, sel)
        async def task():
            for _ in range(3):
                log.append((i, flags(m) == fold(start, paths, [(kind, sel)])))
                await asyncio.sleep(rnd.random() * 1e-3)
            return i

        return task

    async def main():
        return await asyncio.gather(*(make(i)() for i in range(24)))

    assert asyncio.run(main()) == list(range(24))
    assert len(log) == 72 and all(ok for _, ok in log)
    assert flags(m) == start and not entries_on(m)


def test_async_with_blocks_across_await_interleaved():
    m = small()
    start = flags(m)
    x = torch.randn(2, 3)

    async def a():
        with ts.freeze(m, "0"), ts.stop_gradient(m, "2"):
            await asyncio.sleep(0)
            await asyncio.sleep(0.002)  # b exits first: out of order
        return True

    async def b():
        with ts.unfreeze(m, "0.bias"), ts.swap(m, {"1.bias": torch.zeros(3)}):
            await asyncio.sleep(0)
        return True

    async def main():
        return await asyncio.gather(a(), b())

    assert asyncio.run(main()) == [True, True]
    assert flags(m) == start and modes() == 0 and not entries_on(m)
    torch.testing.assert_close(m(x), m[2](m[1](m[0](x))))


def test_decorator_on_recursive_function_and_method():
    m = small()
    start = flags(m)

    @ts.freeze(m, "0")
    def rec(n):
        here = flags(m)
        return (rec(n - 1) if n else []) + [here]

    assert rec(4) == [[False, False, True, True, True, True]] * 5
    assert flags(m) == start and not entries_on(m)

    class Trainer:
        @ts.freeze_except(m, "1")
        def step(self, k):
            return flags(m), k

        @ts.stop_gradient(m, "2")
        def probe(self, x):
            return m(x).sum()

    t = Trainer()
    assert t.step(7) == ([False, False, True, True, False, False], 7)
    y = t.probe(torch.randn(2, 3))
    assert torch.autograd.grad(y, m[2].weight, allow_unused=True)[0] is None
    assert flags(m) == start and modes() == 0


# ============================================================================= exceptions
CONTEXTS = {
    "freeze": lambda m: ts.freeze(m, "0", "1"),
    "freeze_except": lambda m: ts.freeze_except(m, "3"),
    "unfreeze": lambda m: ts.unfreeze(m),
    "stop_gradient": lambda m: ts.stop_gradient(m),
    "swap": lambda m: ts.swap(m, {"0.weight": torch.zeros(2, 2)}),
    "constant": lambda m: ts.constant(m),
}


def _bn_net():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Linear(2, 2), nn.Linear(2, 1))
    m[3].bias.requires_grad_(False)
    with ts.freeze(m, "1"):  # the norm hooks stay once a layer was held (documented)
        pass
    return m


@pytest.mark.parametrize("name", list(CONTEXTS))
@pytest.mark.parametrize("exc", [ValueError, KeyboardInterrupt])
@pytest.mark.parametrize("where", ["block", "user_hook"])
def test_raise_inside_block_restores_everything(name, exc, where):
    m = _bn_net()
    before = snapshot(m)
    x = torch.randn(4, 2)

    def hook(_mod, _args):
        raise exc("from a user hook")

    with pytest.raises(exc):
        with CONTEXTS[name](m):
            if where == "block":
                raise exc("inside")
            h = m[2].register_forward_pre_hook(hook)
            try:
                m(x)
            finally:
                h.remove()
    after = snapshot(m)
    after["hooks"] = [(len(mod._forward_pre_hooks), len(mod._forward_hooks))
                      for mod in m.modules()]
    assert_same_snapshot(after, before)


def test_keyboard_interrupt_inside_a_held_batchnorm_forward():
    m = _bn_net()
    x = torch.randn(8, 2)

    def interrupt(_mod, _args):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        with ts.freeze(m, "1"):
            h = m[1].register_forward_pre_hook(interrupt)
            try:
                m(x)
            finally:
                h.remove()
    assert m[1].training
    stats = m[1].running_mean.clone()
    m(x)  # plain training forward, nothing frozen: updates the statistics
    assert not torch.equal(stats, m[1].running_mean)


def test_keyboard_interrupt_inside_a_held_batchnorm_forward_while_the_hold_stays():
    """The hold outlives the interrupted forward: the next forward (still held) updates
    nothing and leaves the layer in training mode; once the hold ends, forwards update."""
    m = _bn_net()
    x = torch.randn(8, 2)
    hold = ts.freeze(m, "1")
    h = m[1].register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        m(x)
    h.remove()
    stats = m[1].running_mean.clone()
    m(x)
    assert m[1].training and torch.equal(stats, m[1].running_mean)
    hold.__exit__(None, None, None)
    m(x)
    assert m[1].training and not torch.equal(stats, m[1].running_mean)


@pytest.mark.parametrize("exc", [ValueError, KeyboardInterrupt])
@pytest.mark.parametrize("wrt", [None, "0", "2"])
def test_error_inside_structural_grad_loss_restores_everything(exc, wrt):
    m = _bn_net()
    before = snapshot(m)
    x = torch.randn(4, 2)

    def loss(mm):
        mm[1].eval()  # no statistics update: the snapshot compares them all
        try:
            mm(x)
        finally:
            mm[1].train()
        raise exc("in the loss")

    with pytest.raises(exc):
        ts.structural_grad(m, loss, wrt=wrt)
    assert_same_snapshot(snapshot(m), before)


class _Declared(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 1)
        self.b.bias.requires_grad_(False)
        self.boom = None

    def trainable(self):
        if self.boom is not None:
            raise self.boom
        return ["a", "b"]

    def forward(self, x):
        return self.b(self.a(x))


def test_a_declaration_failing_at_exit_restores_then_raises():
    """docs/freezing.md: the exit restores first, then raises the declaration's error."""
    m = _Declared()
    start = flags(m)
    with pytest.raises(ValueError, match="boom"):
        with ts.freeze(m, "a"):
            m.boom = ValueError("boom")
    m.boom = None
    assert flags(m) == start == reads(m) and not entries_on(m)


def test_keyboard_interrupt_from_a_declaration_during_exit_still_restores():
    m = _Declared()
    start = flags(m)
    with pytest.raises(KeyboardInterrupt):
        with ts.freeze(m, "a"):
            m.boom = KeyboardInterrupt()
    m.boom = None
    m(torch.randn(1, 2))
    assert flags(m) == start == reads(m)


def test_structural_grad_wrt_whose_loss_makes_a_declaration_invalid_restores_then_raises():
    """A declaration the loss made invalid (its child deleted): every flag the call wrote is
    written first (the declaration admitting what it still names, as a context's exit does),
    then the declaration's error is raised."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 1)

        def trainable(self):
            return ["b"]

    m = Net()
    ts.attach(m)
    x = torch.randn(3, 2)

    def loss(mm):
        del mm.b
        return mm.a(x).sum()

    with pytest.raises(ValueError, match="no direct parameter or child module 'b'"):
        ts.structural_grad(m, loss, wrt="a")
    assert flags(m) == [False, False]


@pytest.mark.parametrize("case", ["schedule_step", "bare_freeze", "lift_outer"])
def test_structural_grad_wrt_with_flag_changes_inside_the_loss(case):
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    x = torch.randn(3, 2)
    keep = []
    if case == "schedule_step":
        sched = ts.UnfreezeSchedule(m, {0: "1", 1: None})
        change = sched.step
        want = [True] * 4
    elif case == "bare_freeze":
        def change():
            keep.append(ts.freeze(m, "1"))
        want = [True, True, False, False]
    else:
        outer = ts.freeze(m, "1")

        def change():
            outer.__exit__(None, None, None)
        want = [True] * 4

    def loss(mm):
        change()
        return mm(x).sum()

    try:
        ts.structural_grad(m, loss, wrt="1" if case == "schedule_step" else "0")
        m(x)
        assert reads(m) == want
        assert flags(m) == want
    finally:
        for c in keep:  # leave no permanent context behind for the other tests
            c.__exit__(None, None, None)


# ============================================================================= checkpointing
class _CkNet(nn.Module):
    def __init__(self, d, reentrant, inner=None):
        super().__init__()
        self.reentrant, self.inner = reentrant, inner
        self.inp = nn.Linear(d, d)
        self.block = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))
        self.out = nn.Linear(d, 1)

    def run_block(self, h):
        if self.inner is None:
            return self.block(h)
        with self.inner(self, "block.0"):
            return self.block(h)

    def forward(self, x):
        return self.out(checkpoint(self.run_block, self.inp(x), use_reentrant=self.reentrant))


def _reference_grads(net, x, frozen):
    """Plain PyTorch, no checkpoint, the flags of ``frozen`` set off by hand."""
    ref = copy.deepcopy(net)
    ts.detach_hooks(ref)
    for p in ref.parameters():
        p.grad = None
    ref.get_submodule(frozen).requires_grad_(False)
    ref.out(ref.block(ref.inp(x))).pow(2).sum().backward()
    return [p.grad for p in ref.parameters()]


CTX = {"freeze": ts.freeze, "stop_gradient": ts.stop_gradient}


@pytest.mark.parametrize("width", [4, 8])  # 4: the saved tensors' shapes coincide
@pytest.mark.parametrize("kind", list(CTX))
def test_non_reentrant_checkpoint_forward_in_block_backward_after(kind, width):
    """A flag context: the recomputation runs with the forward's flags; a stop_gradient
    block: the recomputation runs inside it again. Exact gradients either way."""
    torch.manual_seed(0)
    net = _CkNet(width, reentrant=False)
    x = torch.randn(4, width)
    want = _reference_grads(net, x, "block.0")

    @CTX[kind](net, "block.0")
    def step(inp):
        return net(inp).pow(2).sum()

    loss = step(x)
    loss.backward()
    same_grads([p.grad for p in net.parameters()], want)
    assert all(p.grad is None for p in net.block[0].parameters())
    assert all(flags(net))


@pytest.mark.parametrize("kind", list(CTX))
def test_non_reentrant_checkpoint_forward_and_backward_in_the_block(kind):
    """Backward inside the block: the recomputation runs inside it too (torch calls backward
    from the block's own handler, where its stand-ins are off: they are put back)."""
    torch.manual_seed(0)
    net = _CkNet(4, reentrant=False)
    x = torch.randn(4, 4)
    want = _reference_grads(net, x, "block.0")
    with CTX[kind](net, "block.0"):
        net(x).pow(2).sum().backward()
    same_grads([p.grad for p in net.parameters()], want)


def test_reentrant_checkpoint_forward_in_freeze_backward_after_matches_plain():
    torch.manual_seed(0)
    net = _CkNet(4, reentrant=True)
    x = torch.randn(4, 4)
    want = _reference_grads(net, x, "block.0")

    @ts.freeze(net, "block.0")
    def step(inp):
        return net(inp).pow(2).sum()

    step(x).backward()
    same_grads([p.grad for p in net.parameters()], want)
    assert all(flags(net))


def test_reentrant_checkpoint_inside_a_stop_gradient_block_is_refused():
    torch.manual_seed(0)
    net = _CkNet(4, reentrant=True)
    with pytest.raises(RuntimeError, match="reentrant"):
        with ts.stop_gradient(net, "block.0"):
            net(torch.randn(4, 4))
    assert modes() == 0


@pytest.mark.parametrize("kind", list(CTX))
@pytest.mark.parametrize("reentrant", [True, False])
def test_block_entered_inside_the_checkpointed_function_matches_plain(kind, reentrant):
    torch.manual_seed(0)
    net = _CkNet(4, reentrant=reentrant, inner=CTX[kind])
    x = torch.randn(4, 4)
    want = _reference_grads(net, x, "block.0")
    net(x).pow(2).sum().backward()
    same_grads([p.grad for p in net.parameters()], want)
    assert all(flags(net)) and modes() == 0


@pytest.mark.parametrize("kind", ["stop_gradient", "swap", "constant"])
@pytest.mark.parametrize("reentrant", [True, False])
def test_a_block_active_at_backward_time_does_not_change_an_earlier_forward(kind, reentrant):
    """Forward (checkpointed) outside any block, backward inside one: the recomputation must
    give the forward's gradients."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    h0 = torch.randn(4, 4, requires_grad=True)

    def seg(h):
        return torch.tanh(lin(torch.tanh(h)))

    hh = h0.detach().requires_grad_()
    want = torch.autograd.grad(seg(hh).pow(2).sum(), [hh, lin.weight, lin.bias])
    y = checkpoint(seg, h0, use_reentrant=reentrant).pow(2).sum()
    ctx = {"stop_gradient": lambda: ts.stop_gradient(lin),
           "swap": lambda: ts.swap(lin, {"weight": torch.zeros(4, 4)}),
           "constant": lambda: ts.constant(lin)}[kind]()
    with ctx:
        y.backward()
    same_grads([h0.grad, lin.weight.grad, lin.bias.grad], list(want))


def test_freeze_entered_after_a_reentrant_forward_is_not_undone_documented_limit():
    """docs/freezing.md, limits: a context entered only after the forward, before the
    backward, is not undone for the recomputation (none was active at the forward)."""
    torch.manual_seed(0)
    net = _CkNet(4, reentrant=True)
    y = net(torch.randn(4, 4)).pow(2).sum()
    with ts.freeze(net, "block.0"):
        y.backward()
    assert net.block[0].weight.grad is None and net.block[2].weight.grad is not None
    assert all(flags(net))


@pytest.mark.parametrize("kind", list(CTX))
@pytest.mark.parametrize("hooks", ["save_on_cpu", "clone"])
def test_saved_tensors_hooks_with_contexts_backward_after_the_block(kind, hooks):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(4, 4, requires_grad=True)
    ref = copy.deepcopy(m)
    ref[2].requires_grad_(False)
    xr = x.detach().requires_grad_()
    ref(xr).pow(2).sum().backward()
    want = [xr.grad] + [p.grad for p in ref.parameters()]
    manager = (torch.autograd.graph.save_on_cpu() if hooks == "save_on_cpu"
               else torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t))
    with manager, CTX[kind](m, "2"):
        y = m(x).pow(2).sum()
    y.backward()
    same_grads([x.grad] + [p.grad for p in m.parameters()], want)
    assert all(flags(m)) and modes() == 0


# ============================================================================= grad modes
@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_grad_modes_nested_with_contexts_and_within_gradient(mode):
    m = small()
    start = flags(m)
    x = torch.randn(2, 3)
    with mode():
        with ts.freeze(m, "0"):
            assert flags(m) == [False, False, True, True, True, True]
            assert not ts.within_gradient(m)
        with ts.unfreeze(m):
            assert all(flags(m))
        with ts.stop_gradient(m, "2"):
            assert not ts.within_gradient(m[2]) and not ts.within_gradient(m[0])
        with pytest.raises(ValueError, match="does not require grad"):
            ts.structural_grad(m, lambda mm: mm(x).sum())
        with pytest.raises(ValueError, match="does not require grad"):
            ts.structural_grad(m, lambda mm: mm(x).sum(), wrt="0")
        assert flags(m) == start
    with torch.no_grad():
        with ts.stop_gradient(m, "2"), torch.enable_grad():
            assert not ts.within_gradient(m[2]) and ts.within_gradient(m[0])
            y = m(x).sum()
        with torch.enable_grad(), ts.freeze(m, "0"):
            assert ts.within_gradient(m[1]) and not ts.within_gradient(m[0].weight)
    g = torch.autograd.grad(y, [m[0].weight, m[2].weight], allow_unused=True)
    assert g[0] is not None and g[1] is None
    assert flags(m) == start and modes() == 0 and not entries_on(m)


def test_within_gradient_false_under_inference_mode_with_enable_grad():
    x = torch.ones(2, requires_grad=True)
    lin = nn.Linear(2, 2)
    with torch.inference_mode(), torch.enable_grad():
        assert not (x * 2).requires_grad  # autograd records nothing here
        assert not ts.within_gradient(x)
        assert not ts.within_gradient(lin)


def test_freeze_of_inference_mode_parameters():
    """Refused at entry (its exit could not turn the flags back on), nothing changed."""
    with torch.inference_mode():
        m = nn.Linear(2, 2)
    start = flags(m)
    with pytest.raises(RuntimeError, match="'weight' is an inference tensor"):
        with ts.freeze(m):
            pass
    assert flags(m) == start == reads(m) and not entries_on(m)
