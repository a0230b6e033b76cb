"""Contexts and declarations under load and under faults: no hooks, references or memory left
behind after many cycles, and every flag restored when a ``KeyboardInterrupt`` cuts a block."""
import contextlib
import gc
import sys
import tracemalloc
import weakref

import pytest
import torch
from torch import nn

import torchstruct as ts
from torchstruct import _state as tstate

CYCLES = 10_000
STEPS = 1_000
# Memory checks, all taken after ``gc.collect()``:
# - over a whole run: the number of live gc-tracked Python objects and of allocated pymalloc
#   blocks (``sys.getallocatedblocks``; no tracing cost). One object kept per cycle would add
#   10,000 of each.
# - over the last part of a run (tracing every allocation costs ~10x): the tracemalloc
#   snapshot difference in bytes, whose largest lines are shown on failure.
OBJECT_BOUND = 100
BLOCK_BOUND = 2_000
MEMORY_BOUND = 64 * 1024


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors


def _model():
    return nn.Sequential(
        nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)
    )


def _hooks(model):
    """Per module of ``model``: the numbers of forward pre-hooks and forward hooks other than
    torchstruct's pair on a normalization layer, and whether that pair is there at most once (a
    layer held once keeps it, passing, while it is in the attached tree)."""
    from torchstruct.hooks import _norm_post, _norm_pre

    out = {}
    for name, m in model.named_modules():
        pre = list(m._forward_pre_hooks.values())
        post = list(m._forward_hooks.values())
        pairs = pre.count(_norm_pre)
        out[name] = (len(pre) - pairs, len(post) - post.count(_norm_post),
                     pairs <= 1 and post.count(_norm_post) == pairs)
    return out


def _flags(model):
    return {name: p.requires_grad for name, p in model.named_parameters()}


def _registry_sizes():
    live_entries = [e for e in tstate.entries if e.scope() is not None]  # dead: pruned lazily
    return len(live_entries), len(tstate.live_states()), len(tstate.records)


def _torch_function_modes():
    return torch._C._len_torch_function_stack()


class _Leaks:
    """Measure what a run leaves behind; ``traced()`` opens the tracemalloc window."""

    def __enter__(self):
        gc.collect()
        self.objects, self.blocks = len(gc.get_objects()), sys.getallocatedblocks()
        self.growth, self.top = 0, []
        return self

    @contextlib.contextmanager
    def traced(self):
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        try:
            yield
        finally:
            gc.collect()
            after = tracemalloc.take_snapshot()
            tracemalloc.stop()
            skip = [tracemalloc.Filter(False, tracemalloc.__file__)]
            stats = after.filter_traces(skip).compare_to(before.filter_traces(skip), "lineno")
            self.growth = sum(s.size_diff for s in stats)
            self.top = [str(s) for s in stats[:8]]
            del before, after, stats

    def __exit__(self, *exc):
        gc.collect()
        self.object_growth = len(gc.get_objects()) - self.objects
        self.block_growth = sys.getallocatedblocks() - self.blocks
        return False

    def check(self):
        assert self.object_growth < OBJECT_BOUND, f"{self.object_growth} more live objects"
        assert self.block_growth < BLOCK_BOUND, f"{self.block_growth} more allocated blocks"
        assert self.growth < MEMORY_BOUND, (
            f"Python memory grew by {self.growth} bytes; largest growth:\n" + "\n".join(self.top)
        )


def _cycle(model, i: int) -> None:
    """One enter/exit of a context; every other cycle the block raises."""
    kind = i % 4
    try:
        if kind == 0:
            with ts.freeze_except(model, "5"):
                pass
        elif kind == 1:
            with ts.freeze(model, "1", "3"):  # freezes the norm layer: norm hooks come and go
                raise ValueError("boom")
        elif kind == 2:
            with ts.unfreeze(model, "0"), ts.stop_gradient(model, "3"):
                pass
        else:
            with ts.freeze(model):
                with ts.freeze_except(model, "0"):
                    raise RuntimeError("boom")
    except (ValueError, RuntimeError):
        pass


def test_context_cycles_leave_no_hooks_references_or_memory():
    model = _model()
    ts.attach(model)
    x = torch.randn(3, 4)
    model(x)
    gc.collect()  # other tests' dead models leave the registries now, not during the run
    hooks, flags, sizes = _hooks(model), _flags(model), _registry_sizes()
    modes = _torch_function_modes()
    for i in range(200):  # warm up caches before measuring
        _cycle(model, i)
    untraced = CYCLES - 1_000
    with _Leaks() as leaks:
        for i in range(untraced):
            _cycle(model, i)
        with leaks.traced():
            for i in range(untraced, CYCLES):
                _cycle(model, i)
    assert _hooks(model) == hooks
    assert _flags(model) == flags
    assert _registry_sizes() == sizes
    assert _torch_function_modes() == modes
    leaks.check()
    model(x)
    assert _hooks(model) == hooks


def test_dropped_models_are_collected_and_registries_do_not_grow():
    gc.collect()
    ts.freeze(nn.Linear(1, 1))  # a permanent context whose model dies: pruned at the next push
    sizes = _registry_sizes()
    alive = weakref.WeakSet()  # a weak reference to each model: empty once all are collected
    created = 0

    def one(i):
        model = _model()
        alive.add(model)
        if i % 3 == 0:
            with ts.freeze_except(model, "5"):
                model(torch.randn(2, 4))
        elif i % 3 == 1:
            ts.mark_trainable(model, "0", "5")
            ts.freeze(model, "0")  # permanent: never exited
            model(torch.randn(2, 4))
        else:
            ts.attach(model)
            with ts.stop_gradient(model, "0"):
                model(torch.randn(2, 4)).sum().backward()

    with _Leaks() as leaks:
        for i in range(240):
            one(i)
            created += 1
        with leaks.traced():
            for i in range(240, 300):
                one(i)
                created += 1
        gc.collect()
        # The permanent contexts of dead models are dropped at the next push/pop.
        with ts.freeze(nn.Linear(1, 1)):
            pass
        gc.collect()
    assert created == 300 and len(alive) == 0, f"{len(alive)} of {created} models still alive"
    now = _registry_sizes()
    assert all(n <= before for n, before in zip(now, sizes)), (now, sizes)
    assert all(e.scope() is not None for e in tstate.entries)
    leaks.check()


def test_training_loop_with_changing_declarations_does_not_leak():
    torch.manual_seed(0)
    model = _model()
    ts.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 4), torch.randn(16, 2)
    plans = [("0", "1", "3", "5"), ("5",), ("3", "5"), ("0",), ("1", "5")]
    want = set()

    def step(i):
        nonlocal want
        if i % 100 == 0:  # a new declaration every 100 steps
            plan = plans[(i // 100) % len(plans)]
            ts.mark_trainable(model, *plan)
            want = {n for n, _ in model.named_parameters() if n.split(".")[0] in plan}
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if i % 100 == 99:
            got = {n for n, p in model.named_parameters() if p.grad is not None}
            assert got == want, (i, got, want)

    for i in range(100):  # warm up
        step(i)
    ts.mark_trainable(model, None)
    hooks, sizes = _hooks(model), _registry_sizes()
    with _Leaks() as leaks:
        for i in range(STEPS - 200):
            step(i)
        with leaks.traced():
            for i in range(STEPS - 200, STEPS):
                step(i)
        ts.mark_trainable(model, None)
    assert all(p.requires_grad for p in model.parameters())
    assert _hooks(model) == hooks
    assert _registry_sizes() == sizes
    leaks.check()

    # The same loop with throw-away models and optimizers: none survives.
    alive = weakref.WeakSet()
    for _ in range(20):
        m = _model()
        alive.add(m)
        o = torch.optim.SGD(m.parameters(), lr=1e-3)
        for i in range(50):
            if i % 10 == 0:
                ts.mark_trainable(m, *plans[(i // 10) % len(plans)])
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
        del m, o
    gc.collect()
    assert len(alive) == 0
    assert _registry_sizes() == sizes


# ----------------------------------------------------------------------------- KeyboardInterrupt
def _declared_model():
    torch.manual_seed(0)
    model = _model()
    model[3].weight.requires_grad_(False)  # a starting flag set by the user
    ts.mark_trainable(model, "0", "1", "3", "5")
    return model


def _state(model):
    return _flags(model), _hooks(model), _registry_sizes(), _torch_function_modes()


def test_keyboard_interrupt_inside_a_context_restores_flags():
    model = _declared_model()
    before = _state(model)
    with pytest.raises(KeyboardInterrupt):
        with ts.freeze_except(model, "5"):
            model(torch.randn(2, 4))
            raise KeyboardInterrupt
    assert _state(model) == before
    with pytest.raises(KeyboardInterrupt):
        with ts.stop_gradient(model, "0"):
            raise KeyboardInterrupt
    assert _state(model) == before


def test_keyboard_interrupt_inside_nested_contexts_restores_flags():
    model = _declared_model()
    before = _state(model)
    with pytest.raises(KeyboardInterrupt):
        with ts.freeze(model, "1"):
            with ts.unfreeze(model, "3"):
                with ts.stop_gradient(model, "5"), ts.constant(model, "0"):
                    with ts.freeze_except(model, "0"):
                        assert [p for p, _ in ts.trainable_parameters(model)] == [
                            "0.weight", "0.bias"]
                        model(torch.randn(2, 4)).sum().backward()
                        raise KeyboardInterrupt
    assert _state(model) == before
    # Everything still works afterwards.
    with ts.freeze(model, "0"):
        assert not model[0].weight.requires_grad
    assert _state(model) == before


def test_keyboard_interrupt_inside_a_decorated_function_restores_flags():
    model = _declared_model()
    before = _state(model)
    seen = []

    @ts.freeze(model, "0")
    @ts.freeze_except(model, "0", "5")
    def train_step(interrupt):
        seen.append([p for p, _ in ts.trainable_parameters(model)])
        model(torch.randn(2, 4))
        if interrupt:
            raise KeyboardInterrupt

    assert _state(model) == before  # decorating applies nothing
    with pytest.raises(KeyboardInterrupt):
        train_step(True)
    assert _state(model) == before
    train_step(False)
    assert _state(model) == before
    assert seen == [["5.weight", "5.bias"]] * 2
