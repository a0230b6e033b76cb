"""torchstruct's bookkeeping inside ``stop_gradient`` / ``swap`` / ``constant`` blocks, tried as
a suspicious user would.

Inside ``stop_gradient`` and ``swap`` blocks ``p.requires_grad`` reads the stand-in's flag;
torchstruct lifts the blocks' modes while it holds its lock (``_state.without_stand_ins``) so
that its own reads and writes see the parameters. Each test compares with the same sequence run
without the block (flags), with ``.detach()`` written by hand (gradients), or the mode stack
with itself before the call (the very mode objects, in order).

A test marked ``xfail(strict=True)`` reproduces a case that goes wrong today; its reason says
what happens and what is expected.
"""
import contextlib
import os
import threading

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

import torchstruct as ts

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def stack():
    return list(_get_current_function_mode_stack())


def same(a, b):
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def flags(m):
    return {path: p.requires_grad for path, p in m.named_parameters()}


def mlp():
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Linear(4, 2))


class Mine(TorchFunctionMode):
    """A user's own mode: passes everything through."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class Net(nn.Module):
    """Declares ``b`` trainable; ``trainable()`` runs ``self.hook`` once if set."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)
        self.hook = None

    def trainable(self):
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()
        return ["b"]

    def forward(self, x):
        return self.b(self.a(x))


@pytest.fixture(autouse=True)
def clean_stack():
    before = stack()
    yield
    assert same(stack(), before), "a test left the mode stack changed"


def blocks(m):
    """(name, factory) of each block kind on ``m`` (selecting its first layer)."""
    first = next(iter(m.children()))
    first_w = next(n for n, p in m.named_parameters() if p is first.weight)
    return {
        "stop_gradient": lambda: ts.stop_gradient(first),
        "swap": lambda: ts.swap(m, {first_w: first.weight.detach().clone()}),
        "constant": lambda: ts.constant(first),
        "none": contextlib.nullcontext,
    }


KINDS = ["stop_gradient", "swap", "constant"]


# ----------------------------------------------------------------- every public function inside
def _sequence(m, block):
    """Public torchstruct calls on ``m`` inside ``block()``; what each one showed."""
    seen = []
    with block():
        ts.attach(m)
        ts.mark_trainable(m, "0", "2", "3")
        with ts.freeze(m, "0"):
            seen.append(("freeze", [k for k, _ in ts.trainable_parameters(m)]))
            with ts.unfreeze(m, "0.bias"):
                seen.append(("unfreeze", ts.is_trainable(m, "0.bias"), ts.summary(m).counts))
        with ts.freeze_except(m, "3"):
            seen.append(("groups", [[id(p) for p in g["params"]] for g in ts.param_groups(m)]))
        sched = ts.UnfreezeSchedule(m, {0: "3", 2: "2"})
        for _ in range(3):
            seen.append(("sched", [k for k, _ in ts.trainable_parameters(m)]))
            sched.step()
        seen.append(("state_dict", sorted(ts.state_dict(m))))
        ts.freeze(m, "2.bias")  # bare: from now on
        seen.append(("grad_tree", sorted(ts.tree.paths(ts.grad_tree(m)))))
        ts.detach_hooks(m)
        m.append(nn.Linear(2, 2))  # no hooks now: nothing applies
        seen.append(("after detach", [k for k, _ in ts.trainable_parameters(m)]))
        ts.attach(m)
        m(torch.randn(3, 4))  # the hook applies the declaration to the new head
    seen.append(("end", flags(m)))
    return seen


@pytest.mark.parametrize("kind", KINDS)
def test_public_calls_inside_a_block_equal_the_same_calls_outside(kind):
    torch.manual_seed(0)
    plain = mlp()
    want = _sequence(plain, blocks(plain)["none"])
    torch.manual_seed(0)
    m = mlp()
    got = _sequence(m, blocks(m)[kind])
    assert [s[0] for s in got] == [s[0] for s in want]
    for (name, *g), (_, *w) in zip(got, want):
        if name == "groups":  # ids of two models: compare shapes
            assert [len(x) for x in g[0]] == [len(x) for x in w[0]]
        else:
            assert g == w, name
    assert want[-1][1]["4.weight"] is False  # the declaration did apply to the new head


@pytest.mark.parametrize("kind", ["stop_gradient", "swap"])
def test_global_norm_clip_and_map_trainable_inside_read_the_model(kind):
    torch.manual_seed(0)
    m = mlp()
    ts.freeze(m, "2")
    m(torch.randn(3, 4)).sum().backward()
    want_norm = ts.global_norm(m)
    want_map = ts.map_trainable(lambda p: p.detach() * 2, m)
    with blocks(m)[kind]():
        got_norm = ts.global_norm(m)
        got_map = ts.map_trainable(lambda p: p.detach() * 2, m)
        clipped = ts.clip_by_global_norm(m, 0.5)
    assert torch.equal(got_norm, want_norm) and torch.equal(clipped, want_norm)
    assert sorted(got_map) == sorted(want_map)
    assert torch.isclose(ts.global_norm(m), torch.tensor(0.5))


# ----------------------------------------------------------------- nesting and gradients
def _grads(m):
    return {k: None if p.grad is None else p.grad.clone() for k, p in m.named_parameters()}


def _hand(frozen=(), detached=()):
    """The same forward as the torchstruct variants below, with .detach() written by hand."""
    torch.manual_seed(0)
    m = mlp()
    for k, p in m.named_parameters():
        p.requires_grad_(k.split(".")[0] not in frozen)
    x = torch.randn(3, 4)
    h = x
    for i, layer in enumerate(m):
        if isinstance(layer, nn.Linear) and str(i) in detached:
            h = nn.functional.linear(h, layer.weight.detach(), layer.bias.detach())
        else:
            h = layer(h)
    h.sum().backward()
    return _grads(m)


def _same_grads(a, b):
    return a.keys() == b.keys() and all(
        (a[k] is None and b[k] is None) or (a[k] is not None and b[k] is not None
                                             and torch.allclose(a[k], b[k])) for k in a)


@pytest.mark.parametrize("order", ["block_in_context", "context_in_block", "decorated",
                                   "decorated_block", "compiled"])
def test_nesting_with_freeze_contexts_matches_detach_by_hand(order):
    torch.manual_seed(0)
    m = mlp()
    ts.attach(m)
    x = torch.randn(3, 4)
    if order == "block_in_context":
        with ts.freeze(m, "2"), ts.stop_gradient(m[0]):
            m(x).sum().backward()
    elif order == "context_in_block":
        with ts.stop_gradient(m[0]), ts.freeze(m, "2"):
            m(x).sum().backward()
    elif order == "decorated":
        @ts.freeze(m, "2")
        def run():
            return m(x)
        with ts.stop_gradient(m[0]):
            run().sum().backward()
    elif order == "decorated_block":
        @ts.stop_gradient(m[0])
        def run():
            return m(x)
        with ts.freeze(m, "2"):
            run().sum().backward()
    else:
        @torch.compile(backend="eager")
        def run(x):
            with ts.freeze(m, "2"):
                return m(x)
        with ts.stop_gradient(m[0]):
            run(x).sum().backward()
    assert flags(m) == dict.fromkeys(flags(m), True)
    assert _same_grads(_grads(m), _hand(frozen="2", detached="0"))


# ----------------------------------------------------------------- the mode stack, exactly
def _user_stack(m):
    """Mine, stop_gradient, Mine, swap, Mine entered; returns (exit, the stack)."""
    es = contextlib.ExitStack()
    es.enter_context(Mine())
    es.enter_context(ts.stop_gradient(m.a))
    es.enter_context(Mine())
    es.enter_context(ts.swap(m, {"b.bias": torch.zeros(2)}))
    es.enter_context(Mine())
    return es, stack()


def _boom():
    raise KeyError("trainable() failed")


@pytest.mark.parametrize("call", ["trainable_raises", "bad_selector", "bad_schedule",
                                  "clip_bad", "freeze_ok", "optim_step"])
def test_calls_that_raise_or_not_restore_the_stack_exactly(call):
    m = Net()
    with _user_stack(m)[0]:
        before = stack()
        if call == "trainable_raises":
            m.hook = _boom
            with pytest.raises(KeyError):
                ts.attach(m)
        elif call == "bad_selector":
            with pytest.raises(ValueError, match="nope"):
                ts.freeze(m, "nope")
        elif call == "bad_schedule":
            with pytest.raises(ValueError):
                ts.UnfreezeSchedule(m, {0: "a", 3: "zzz"})
        elif call == "clip_bad":
            with pytest.raises((TypeError, ValueError)):
                ts.clip_by_global_norm(m, "x")
        elif call == "freeze_ok":
            with ts.freeze(m, "a"):
                assert same(stack(), before)
        else:
            m(torch.ones(1, 2)).sum().backward()
            ts.optim.SGD(m.a.parameters(), lr=0.1).step()  # stop_gradient'ed: steps
            with pytest.raises(RuntimeError, match="inside a swap block"):
                ts.optim.SGD(m.parameters(), lr=0.1).step()  # b.bias is swapped: refused
        assert same(stack(), before)
    assert not any(isinstance(mode, Mine) for mode in stack())
    if call != "optim_step":  # bad input changed no flag; a context left restored them
        declared = call == "freeze_ok"  # attached by the context: Net's trainable() applies
        assert flags(m) == {k: not (declared and k.startswith("a.")) for k in flags(m)}


def test_a_block_entered_by_trainable_stays_open_and_the_flags_are_right():
    """A ``trainable()`` that enters a bare block while torchstruct applies the declaration: the
    rest of the application still reads the parameters' own flags, the block is open after
    (on top of the user's mode), and leaves cleanly."""
    m = Net()
    opened = []
    m.hook = lambda: opened.append(ts.stop_gradient(m))
    with Mine() as mine:
        ts.attach(m)
        assert len(stack()) == 2 and stack()[0] is mine and stack()[1] is opened[0]._mode
        opened[0].__exit__(None, None, None)
        assert same(stack(), [mine])
    assert flags(m) == {"a.weight": False, "a.bias": False, "b.weight": True, "b.bias": True}
    with ts.freeze(m):
        pass
    assert flags(m) == {"a.weight": False, "a.bias": False, "b.weight": True, "b.bias": True}


def test_user_modes_entered_or_exited_inside_trainable_stay_so():
    m = Net()
    mine = Mine()
    with _user_stack(m)[0]:
        before = stack()
        m.hook = mine.__enter__
        ts.attach(m)  # lifted during the call; trainable() enters a mode of its own
        assert same(stack(), before + [mine])
        m.hook = lambda: mine.__exit__(None, None, None)
        ts.freeze(m, "a")
        assert same(stack(), before)


def test_a_generator_holding_a_block_closed_inside_a_torchstruct_call():
    """The block leaves for good: closing a generator from ``trainable()`` (or the garbage
    collector finalizing it there) exits its block while torchstruct has it lifted."""
    m = Net()
    ts.attach(m)

    def held():
        with ts.stop_gradient(m.b):
            yield

    g = held()
    next(g)
    assert len(stack()) == 1
    m.hook = g.close
    with ts.freeze(m, "a"):
        pass
    assert stack() == []
    m(torch.ones(1, 2)).sum().backward()
    assert m.b.weight.grad is not None and m.a.weight.grad is None


def test_a_decorated_generator_closed_inside_a_torchstruct_call():
    m = Net()
    ts.attach(m)
    x = torch.ones(1, 2)

    @ts.stop_gradient(m.b)
    def gen():
        with ts.swap(m, {"a.bias": torch.zeros(2)}):
            yield m(x)
            yield m(x)

    g = gen()
    assert not next(g).requires_grad
    m.hook = g.close
    with ts.freeze(m, "a"):
        assert stack() == []
    assert flags(m) == {"a.weight": False, "a.bias": False, "b.weight": True, "b.bias": True}


# ----------------------------------------------------------------- generators and threads
def test_generator_holding_a_block_across_yields_while_torchstruct_runs_between():
    torch.manual_seed(0)
    m = mlp()
    ts.attach(m)
    x = torch.randn(3, 4)

    def forwards():
        with ts.stop_gradient(m[0]):
            while True:
                yield m(x)

    g = forwards()
    out = next(g)
    ts.freeze(m, "2")  # between yields, the generator's block open on this thread
    assert flags(m)["2.weight"] is False and ts.is_trainable(m, "0.weight")
    out = next(g)
    g.close()
    assert flags(m)["0.weight"] is True and stack() == []
    out.sum().backward()
    assert _same_grads(_grads(m), _hand(frozen="2", detached="0"))


def test_two_threads_with_their_own_blocks_on_one_shared_model():
    torch.manual_seed(0)
    m = mlp()
    ts.attach(m)
    errors, seen = [], {}
    go = threading.Barrier(2)

    def worker(name, block, selector):
        try:
            with block():
                own = stack()
                go.wait(5)
                for _ in range(20):
                    with ts.freeze(m, selector):
                        seen.setdefault(name, set()).add(ts.is_trainable(m, selector + ".weight"))
                        list(ts.trainable_parameters(m))
                        ts.summary(m)
                    assert same(stack(), own)
            assert stack() == []
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=worker, args=("a", lambda: ts.stop_gradient(m[0]), "2")),
               threading.Thread(target=worker, args=("b", lambda: ts.swap(
                   m, {"0.weight": torch.zeros(4, 4)}), "3"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert seen == {"a": {False}, "b": {False}}
    assert flags(m) == dict.fromkeys(flags(m), True)


# ----------------------------------------------------------------- registrations inside a block
def test_peft_adapter_injected_inside_stop_gradient():
    peft = pytest.importorskip("peft")

    def build(inside):
        torch.manual_seed(0)
        base = mlp()
        ts.attach(base)
        cfg = peft.LoraConfig(r=2, target_modules=["2"], lora_alpha=4)
        with ts.stop_gradient(base[0]) if inside else contextlib.nullcontext():
            model = peft.get_peft_model(base, cfg)
            ts.attach(model)
            model(torch.randn(3, 4))
            got = flags(model), [k for k, _ in ts.trainable_parameters(model)]
        return got

    assert build(True) == build(False)


# ----------------------------------------------------------------- ts.optim inside swap
@pytest.mark.parametrize("opt", ["SGD", "AdamW"])
@pytest.mark.parametrize("grads_on", ["stand_ins", "parameters"])
def test_ts_optim_inside_swap_is_refused_and_changes_nothing(grads_on, opt):
    """Inside swap, a step would read and write the stand-ins for some tensors and the
    parameters for others: refused before any write, wherever the gradients are. Inside
    stop_gradient (stand-ins share the parameters' memory) the step runs as outside."""
    torch.manual_seed(0)
    m = nn.Linear(3, 2)
    if grads_on == "parameters":
        m(torch.ones(1, 3)).sum().backward()
    slow = {n: p.detach().clone().requires_grad_() for n, p in m.named_parameters()}
    o = getattr(ts.optim, opt)(m.parameters(), lr=0.5)
    before = [t.detach().clone() for t in [*slow.values(), *m.parameters()]]
    with ts.swap(m, slow):
        if grads_on == "stand_ins":
            m(torch.ones(1, 3)).sum().backward()
        with pytest.raises(RuntimeError, match=f"{opt}: step\\(\\) inside a swap block"):
            o.step()
    assert all(torch.equal(a, b) for a, b in
               zip(before, [t.detach() for t in [*slow.values(), *m.parameters()]]))
    assert not o.state
    with ts.swap(m, {"weight": slow["weight"]}):  # a partial swap of other parameters
        pass
    other = getattr(ts.optim, opt)([nn.Parameter(torch.ones(2))], lr=0.5)
    with ts.swap(m, slow):
        other.step()  # an optimizer over tensors the block does not replace: fine


def test_a_block_entered_after_a_nested_lift_ended_is_not_lost():
    """Lifts nest (``ts.optim``'s step planning, ``ts.global_norm`` of a model and
    ``structural_grad`` lift inside the lock too); a block entered after an inner lift ended,
    still under the outer, must come on the stack when the outer ends (and block the
    gradient)."""
    from torchstruct import _state

    m = nn.Linear(2, 2)
    with _state.LOCK:
        with _state.without_stand_ins():
            pass
        block = ts.stop_gradient(m, "weight")
    assert len(stack()) == 1 and stack()[0] is block._mode
    with block:  # already active: exits at the end
        m(torch.ones(1, 2)).sum().backward()
    assert m.weight.grad is None and m.bias.grad is not None and stack() == []


def test_a_generator_finalized_by_the_garbage_collector_inside_a_torchstruct_call():
    """A generator in a reference cycle holding a block, collected while torchstruct applies
    flags (any allocation may collect): its block leaves for good."""
    import gc

    m = Net()
    ts.attach(m)

    def held(box):
        with ts.stop_gradient(m.b):
            yield

    box = [None]
    box[0] = held(box)
    next(box[0])
    del box
    assert len(stack()) == 1
    m.hook = gc.collect
    with ts.freeze(m, "a"):
        pass
    assert stack() == []
    m(torch.ones(1, 2)).sum().backward()
    assert m.b.weight.grad is not None


def test_async_tasks_with_blocks_and_contexts_interleaved():
    import asyncio

    torch.manual_seed(0)
    m = mlp()
    ts.attach(m)
    x = torch.randn(3, 4)
    outs = []

    @ts.stop_gradient(m[0])
    async def blocked_forward():
        for _ in range(3):
            outs.append(m(x))
            await asyncio.sleep(0)

    async def contexts():
        for _ in range(3):
            with ts.freeze(m, "2"):
                assert ts.is_trainable(m, "0.weight") and not ts.is_trainable(m, "2.weight")
                await asyncio.sleep(0)

    async def main():
        await asyncio.gather(blocked_forward(), contexts())

    asyncio.run(main())
    assert stack() == [] and flags(m) == dict.fromkeys(flags(m), True)
    outs[-1].sum().backward()
    assert m[0].weight.grad is None and m[3].weight.grad is not None


def test_ts_state_dict_inside_swap_keys_as_outside_values_as_torch_state_dict_inside():
    """The paths are the model's trainable ones; the values, like ``model.state_dict()`` in the
    block (docs/stop_gradient.md), are the stand-ins' (saving EMA weights from the block)."""
    m = mlp()
    ts.freeze(m, "2")
    ema = {k: torch.full_like(v, 7.0) for k, v in ts.state_dict(m).items()}
    want = list(ts.state_dict(m))
    with ts.swap(m, ema):
        got = ts.state_dict(m)
        plain = m.state_dict()
    assert list(got) == want
    assert all(torch.equal(got[k], plain[k]) and torch.equal(got[k], ema[k]) for k in got)


def test_compiled_function_entering_a_block_and_a_context():
    torch.manual_seed(0)
    m = mlp()
    ts.attach(m)
    x = torch.randn(3, 4)

    @torch.compile(backend="eager")
    def run(x):
        with ts.freeze(m, "2"), ts.stop_gradient(m[0]):
            return m(x)

    run(x).sum().backward()
    assert stack() == [] and flags(m) == dict.fromkeys(flags(m), True)
    assert _same_grads(_grads(m), _hand(frozen="2", detached="0"))


def test_blocks_entered_and_left_by_a_selector_callable():
    """A callable selector runs with the blocks lifted: a block it enters is lifted with them
    (the flags it decides are the parameters'), one it leaves stays left."""
    m = Net()
    ts.attach(m)
    outer = ts.stop_gradient(m.a)  # bare, left by the selector
    opened = []

    def pick(path, p):
        if not opened:
            opened.append(ts.stop_gradient(m.b))
            outer.__exit__(None, None, None)
        return path.startswith("a.")

    with ts.freeze(m, pick, "b.bias"):
        assert same(stack(), [opened[0]._mode])
        assert not outer._active
        opened[0].__exit__(None, None, None)
        assert flags(m) == {"a.weight": False, "a.bias": False, "b.weight": True, "b.bias": False}
    # Net declares "b": "a" stays frozen by the declaration, "b.bias" is restored
    assert flags(m) == {"a.weight": False, "a.bias": False, "b.weight": True, "b.bias": True}
    assert stack() == []


@pytest.mark.parametrize("where", ["target", "source"])
@pytest.mark.parametrize("kind", ["stop_gradient", "swap"])
def test_polyak_update_inside_a_block_does_what_the_same_torch_ops_do(kind, where):
    """``polyak_update`` moves values, a torch operation: inside ``stop_gradient`` it equals the
    update outside; inside ``swap`` it reads a swapped source's stand-ins, as
    ``torch._foreach_lerp_`` does in the same block, and refuses a swapped target (it would
    write the stand-ins, not the parameters, as a ``ts.optim`` step there would), changing
    nothing."""
    if kind == "swap" and where == "target":
        torch.manual_seed(0)
        src, tgt = nn.Linear(3, 2), nn.Linear(3, 2)
        stand = torch.zeros(2)
        before = [p.detach().clone() for p in tgt.parameters()]
        with ts.swap(tgt, {"bias": stand}), torch.no_grad():
            with pytest.raises(RuntimeError, match="swap block that replaces target's"):
                ts.polyak_update(tgt, src, 0.5)
        assert all(torch.equal(a, b) for a, b in zip(tgt.parameters(), before))
        assert torch.equal(stand, torch.zeros(2))
        return

    def run(update):
        torch.manual_seed(0)
        src, tgt = nn.Linear(3, 2), nn.Linear(3, 2)
        model = tgt if where == "target" else src
        block = (ts.stop_gradient(model) if kind == "stop_gradient"
                 else ts.swap(model, {"bias": torch.zeros(2)}))
        with block, torch.no_grad():
            update(tgt, src)
        return [p.detach().clone() for p in [*tgt.parameters(), *src.parameters()]]

    got = run(lambda t, s: ts.polyak_update(t, s, 0.5))
    want = run(lambda t, s: torch._foreach_lerp_(list(t.parameters()), list(s.parameters()), 0.5))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_freeze_decorated_generator_holding_a_block_across_yields():
    """The decorator's context applies around each resumption (lifting the generator's own
    block to write the flags); between resumptions the caller sees the model unfrozen, with the
    generator's block still open on this thread."""
    torch.manual_seed(0)
    m = mlp()
    ts.attach(m)
    x = torch.randn(3, 4)

    @ts.freeze(m, "2")
    def forwards():
        with ts.stop_gradient(m[0]):
            while True:
                yield m(x), flags(m)["2.weight"], ts.is_trainable(m, "0.weight")

    g = forwards()
    out, frozen_inside, trainable_inside = next(g)
    assert frozen_inside is False and trainable_inside is True
    assert ts.is_trainable(m, "2.weight") and len(stack()) == 1
    ts.mark_trainable(m, "0", "2", "3")  # between resumptions, the block open
    out, frozen_inside, _ = next(g)
    g.close()
    assert frozen_inside is False and stack() == []
    assert flags(m) == dict.fromkeys(flags(m), True)
    out.sum().backward()
    assert _same_grads(_grads(m), _hand(frozen="2", detached="0"))
