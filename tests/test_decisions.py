"""What a context decided, and writes by others: both stand until the context exits.

- A context decides once per parameter whether its selectors pick it (docs/freezing.md, "A
  context decides once per parameter").
- A flag written by someone else wins over the contexts active and the declarations made
  when it was written; those entered or made later apply on top (docs/freezing.md, "A write
  by someone else").
"""
import gc
import random

import pytest
import torch
from torch import nn

import torchstruct as ts


def flags(m):
    return [p.requires_grad for p in m.parameters()]


def reads(m):
    return [ts.is_trainable(m, path) for path, _ in m.named_parameters()]


def net():
    return nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 1))


# ------------------------------------------------------------------------------ writes by others
def test_a_write_inside_a_block_wins_and_reads_agree_at_once():
    m = net()
    with ts.freeze(m, "0"):
        m[0].weight.requires_grad_(True)
        assert flags(m)[:2] == [True, False] and reads(m) == flags(m)
        m(torch.randn(2, 3))
        m.append(nn.Identity())  # a registration: the next forward applies again
        m(torch.randn(2, 3))
        assert flags(m)[:2] == [True, False] and reads(m) == flags(m)
    assert all(flags(m)) and reads(m) == flags(m)


def test_a_context_entered_after_the_write_applies_on_top_and_lifts_cleanly():
    m = net()
    with ts.freeze(m, "0"):
        m[0].weight.requires_grad_(True)
        with ts.freeze(m):
            assert not any(flags(m)) and reads(m) == flags(m)
        assert flags(m)[:2] == [True, False] and reads(m) == flags(m)
    assert all(flags(m))


def test_a_write_of_false_inside_an_unfreeze_stands_after_it():
    m = net()
    m[1].requires_grad_(False)
    with ts.unfreeze(m, "1"):
        assert all(flags(m))
        m[1].weight.requires_grad_(False)
        assert reads(m) == flags(m) and not m[1].weight.requires_grad
    assert flags(m) == [True, True, False, False, True, True] and reads(m) == flags(m)


def test_a_write_against_a_permanent_context_wins():
    m = net()
    ts.freeze(m, "2")
    m[2].weight.requires_grad_(True)
    m.append(nn.Identity())
    m(torch.randn(2, 3))
    assert m[2].weight.requires_grad and not m[2].bias.requires_grad
    assert reads(m) == flags(m)
    with ts.freeze(m, "2"):  # a new context does apply to it
        assert not m[2].weight.requires_grad
    assert m[2].weight.requires_grad


def test_a_write_wins_over_an_older_declaration_and_a_newer_one_applies_on_top():
    m = net()
    ts.mark_trainable(m, "0", "1")
    m[2].weight.requires_grad_(True)  # after the declaration: it stands
    assert reads(m) == flags(m)
    ts.attach(m)
    assert m[2].weight.requires_grad and not m[2].bias.requires_grad and reads(m) == flags(m)
    ts.mark_trainable(m, "0", "1")  # made after the write: applies on top
    assert not m[2].weight.requires_grad and reads(m) == flags(m)


def test_value_and_grad_sees_a_write_made_inside_a_block():
    m = net()
    x = torch.randn(2, 3)
    with ts.freeze(m, "0"):
        m[0].weight.requires_grad_(True)

        def loss(mm):
            assert ts.is_trainable(mm, "0.weight")  # the model's true trainability
            return mm(x).sum()

        _, tree = ts.value_and_grad(loss, m)
        got = set(ts.tree.to_flat_dict(tree))
        assert "0.weight" in got and "0.bias" not in got
        assert flags(m)[:2] == [True, False]


# ------------------------------------------------------------------------------ decisions
def test_a_callable_selector_is_asked_once_per_parameter():
    m = net()
    calls = []

    def pick(path, p):
        calls.append(path)
        return path.endswith("bias")

    with ts.freeze(m, pick):
        for _ in range(3):
            with ts.freeze(m, "0"):
                m(torch.randn(2, 3))
        asked = len(calls)
        m.append(nn.Linear(1, 1))  # judged once when first seen
        m(torch.randn(2, 3))
        assert not m[3].bias.requires_grad and m[3].weight.requires_grad
        with ts.freeze(m, "1"):
            pass
    assert asked == 6  # each of the 6 parameters once (one path each)
    assert sorted(calls[asked:]) == ["3.bias", "3.weight"]
    assert all(flags(m))


def test_a_module_selector_does_not_follow_a_fresh_module_put_in_its_place():
    m = net()
    with ts.freeze(m, m[1]):
        m[1] = nn.Linear(3, 3)  # a new layer, with its own (True) flags
        m(torch.randn(2, 3))
        assert all(flags(m)) and reads(m) == flags(m)


def test_parameters_replaced_many_times_keep_the_decision_despite_id_reuse():
    # Objects die and new ones reuse their ids: a decision never passes to another parameter.
    for _ in range(50):
        m = net()
        with ts.freeze(m, "0", m[2].bias):
            for _ in range(3):
                m.to("meta")
                m.to_empty(device="cpu")  # the old objects die here (reference counts)
            want = [False, False, True, True, True, False]
            assert flags(m) == want and reads(m) == want
            m.append(nn.Identity())
            m(torch.randn(2, 3))
            assert flags(m) == want and reads(m) == want
        assert all(flags(m)) and reads(m) == flags(m)


@pytest.mark.parametrize("selector", ["0", "0.weight", "module", "param", "callable"])
def test_every_selector_kind_follows_load_state_dict_assign(selector):
    m = net()
    sel = {"0": "0", "0.weight": "0.weight", "module": m[0], "param": m[0].weight,
           "callable": lambda path, p: path == "0.weight"}[selector]
    state = {k: v.clone() for k, v in m.state_dict().items()}
    with ts.freeze(m, sel):
        want = flags(m)
        for _ in range(2):
            m.load_state_dict(state, assign=True)
            m(torch.randn(2, 3))
            assert flags(m) == want and reads(m) == want
    assert all(flags(m))


def test_decisions_of_a_permanent_context_do_not_grow_without_bound():
    m = net()
    ts.freeze(m, "0")
    entry = next(e for e in ts._state.entries if e.scope() is m)
    for _ in range(200):
        m.append(nn.Linear(1, 1))
        m(torch.randn(2, 3))
        del m[3]
        ts.attach(m)
    gc.collect()
    ts.attach(m)
    m.append(nn.Linear(1, 1))
    ts.attach(m)
    assert len(entry.decided) <= 2 * len(list(m.parameters())) + 64 + 2


def test_random_writes_and_contexts_agree_with_the_reads():
    rng = random.Random(1)
    for _ in range(30):
        m = net()
        ts.attach(m)
        open_ = []
        for step in range(20):
            r = rng.random()
            params = list(m.parameters())
            if r < 0.35:
                rng.choice(params).requires_grad_(rng.random() < 0.5)
            elif r < 0.7 or not open_:
                kind = rng.choice([ts.freeze, ts.freeze_except, ts.unfreeze])
                open_.append(kind(m, rng.choice(["0", "1", "2", "*bias"])))
            else:
                open_.pop(rng.randrange(len(open_))).__exit__(None, None, None)
            ts.attach(m)  # an application: every write is seen
            assert reads(m) == flags(m), step
        for ctx in reversed(open_):
            ctx.__exit__(None, None, None)
