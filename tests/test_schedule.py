"""Tests for ts.UnfreezeSchedule: stages, resume, composition with contexts, errors, DDP."""

import numpy as np
import pytest
import torch
from torch import nn

import torchstruct as ts
from torchstruct import hooks
import torchstruct.schedule as schedule_mod


def make():
    torch.manual_seed(0)
    return nn.ModuleDict({
        "embed": nn.Embedding(10, 4),
        "body": nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)),
        "head": nn.Linear(4, 2),
    })


def flags(model):
    return {path: p.requires_grad for path, p in model.named_parameters()}


def expected(model, *selectors):
    """Brute force: the union of the selectors trains, everything else is frozen."""
    chosen = set()
    for sel in selectors:
        chosen |= {path for path in flags(model) if path == sel or path.startswith(sel + ".")}
    return {path: path in chosen for path in flags(model)}


MILESTONES = {0: "head", 2: "body.2", 4: ["body.1", "body.0"], 7: None}


def test_stages_follow_the_milestones_cumulatively():
    m = make()
    s = ts.UnfreezeSchedule(m, MILESTONES)
    want = {
        0: ("head",), 1: ("head",), 2: ("head", "body.2"), 3: ("head", "body.2"),
        4: ("head", "body.2", "body.1", "body.0"), 6: ("head", "body.2", "body.1", "body.0"),
    }
    for step in range(10):
        assert s.current_step == step
        if step in want:
            assert flags(m) == expected(m, *want[step]), step
        if step >= 7:
            assert all(flags(m).values()) and s.selectors is None and s.stage == 4
        s.step()
    assert s.milestones == (0, 2, 4, 7)


def test_stage_and_selectors_are_exposed():
    m = make()
    s = ts.UnfreezeSchedule(m, {3: "head", 5: ["body.0", "body.1"]})
    assert (s.current_step, s.stage, s.selectors) == (0, 0, ())
    assert not any(flags(m).values())  # no milestone at 0: everything frozen until the first
    for _ in range(3):
        s.step()
    assert (s.current_step, s.stage, s.selectors) == (3, 1, ("head",))
    for _ in range(2):
        s.step()
    assert (s.stage, s.selectors) == (2, ("head", "body.0", "body.1"))
    assert flags(m) == expected(m, "head", "body.0", "body.1")
    assert "step=5" in repr(s) and "stage=2/2" in repr(s)


@pytest.mark.parametrize("everything", [None, "*"])
def test_everything_keeps_starting_flags_and_declarations(everything):
    m = make()
    m["embed"].weight.requires_grad_(False)  # frozen by hand: its starting flag
    ts.mark_trainable(m["body"], "0", "1")  # a declaration: body.2 never trains
    try:
        s = ts.UnfreezeSchedule(m, {0: "head", 1: everything})
        assert flags(m) == expected(m, "head")
        s.step()
        want = {path: not path.startswith(("embed", "body.2")) for path in flags(m)}
        assert flags(m) == want
    finally:
        ts.mark_trainable(m["body"], None)


def test_selected_parameters_keep_their_own_flags():
    m = make()
    m["head"].bias.requires_grad_(False)
    ts.UnfreezeSchedule(m, {0: "head"})
    assert flags(m) == {**expected(m, "head"), "head.bias": False}


def test_other_selector_kinds():
    m = make()
    s = ts.UnfreezeSchedule(m, {
        0: m["head"],
        1: [m["body"][2].weight, lambda path, p: path == "body.1.bias"],
        np.int64(2): __import__("re").compile(r"embed\..*"),
    })
    assert flags(m) == expected(m, "head")
    s.step()
    assert flags(m) == {**expected(m, "head", "body.2.weight", "body.1.bias")}
    s.step()
    assert flags(m) == expected(m, "head", "body.2.weight", "body.1.bias", "embed")


def test_resume_mid_run_gives_the_same_flags_in_a_fresh_model():
    m = make()
    s = ts.UnfreezeSchedule(m, MILESTONES)
    for _ in range(5):
        s.step()
    state = s.state_dict()
    assert state == {"step": 5, "milestones": [0, 2, 4, 7]}
    fresh = make()
    r = ts.UnfreezeSchedule(fresh, MILESTONES)
    assert flags(fresh) == expected(fresh, "head")
    r.load_state_dict({**state, "step": np.int64(state["step"])})  # flags re-applied at once
    assert flags(fresh) == flags(m)
    assert (r.current_step, r.stage, r.selectors) == (s.current_step, s.stage, s.selectors)
    for _ in range(3):  # and both go on alike
        s.step()
        r.step()
        assert flags(fresh) == flags(m)
    assert all(flags(fresh).values())


def test_load_state_dict_can_go_back_and_survives_torch_save(tmp_path):
    m = make()
    s = ts.UnfreezeSchedule(m, MILESTONES)
    early = s.state_dict()
    for _ in range(8):
        s.step()
    torch.save(early, tmp_path / "s.pt")
    s.load_state_dict(torch.load(tmp_path / "s.pt"))
    assert s.current_step == 0 and s.stage == 1
    assert flags(m) == expected(m, "head")
    s.step(), s.step()
    assert flags(m) == expected(m, "head", "body.2")


def test_enclosing_freeze_context_composes_and_is_lifted():
    m = make()
    s = ts.UnfreezeSchedule(m, {0: "head", 2: None})
    with ts.freeze(m, "embed", "head.bias"):
        assert flags(m) == {**expected(m, "head"), "head.bias": False}
        s.step(), s.step()  # stage change inside the block: the block still freezes its part
        assert flags(m) == {p: not p.startswith(("embed", "head.bias")) for p in flags(m)}
    assert all(flags(m).values())  # the block left: the schedule alone decides


def test_schedule_built_inside_a_context_outlives_it():
    m = make()
    with ts.freeze_except(m, "body"):
        s = ts.UnfreezeSchedule(m, {0: ["head", "body.0"], 1: "body.1"})
        assert flags(m) == expected(m, "body.0")
        s.step()
        assert flags(m) == expected(m, "body.0", "body.1")
    assert flags(m) == expected(m, "head", "body.0", "body.1")


def test_step_reaching_no_milestone_does_not_walk_the_model(monkeypatch):
    m = make()
    s = ts.UnfreezeSchedule(m, {0: "head", 50: None})
    calls = []
    real = hooks.State.apply  # every walk of the model and every flag write goes through it
    monkeypatch.setattr(hooks.State, "apply", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(schedule_mod, "select", lambda *a, **k: calls.append(1))
    for _ in range(49):
        s.step()
    assert calls == [] and s.current_step == 49
    s.step()
    assert calls and all(flags(m).values())


def test_close_lifts_the_schedule():
    m = make()
    s = ts.UnfreezeSchedule(m, {0: "head"})
    assert not m["embed"].weight.requires_grad
    s.close()
    assert all(flags(m).values())
    with pytest.raises(RuntimeError, match="closed"):
        s.step()
    with pytest.raises(RuntimeError, match="closed"):
        s.load_state_dict({"step": 3, "milestones": [0]})
    assert all(flags(m).values())


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("milestones, error, words", [
    ({0: "haed"}, ValueError, ["milestone 0", "'haed'", "'head"]),
    ({0: "head", 3: ["body.0", "bdy.1"]}, ValueError, ["milestone 3", "bdy.1", "'body.1"]),
    ({0: []}, ValueError, ["empty selector list"]),
    ({}, ValueError, ["empty"]),
    ({-1: "head"}, ValueError, ["negative"]),
    ({True: "head"}, TypeError, ["integers"]),
    ({"0": "head"}, TypeError, ["integers"]),
    ({1.0: "head"}, TypeError, ["integers"]),
    ({0: 3}, TypeError, ["milestone 0", "selector must be"]),
    ({0: ["head", None]}, TypeError, ["selector must be"]),
    ({0: nn.Linear(2, 2)}, ValueError, ["not a submodule"]),
    ({0: nn.Parameter(torch.ones(1))}, ValueError, ["not a parameter of the model"]),
    ([(0, "head")], TypeError, ["mapping"]),
])
def test_bad_milestones_raise_and_change_nothing(milestones, error, words):
    m = make()
    m["head"].bias.requires_grad_(False)
    before = flags(m)
    with pytest.raises(error) as info:
        ts.UnfreezeSchedule(m, milestones)
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    assert flags(m) == before
    with ts.freeze(m, "body"):  # no context was left behind: entering and leaving restores
        pass
    assert flags(m) == before


def test_not_a_module():
    with pytest.raises(TypeError, match="nn.Module"):
        ts.UnfreezeSchedule({"a": 1}, {0: "a"})


def test_strict_false_allows_an_empty_match():
    m = make()
    s = ts.UnfreezeSchedule(m, {0: "head", 1: "adapter*"}, strict=False)
    s.step()
    assert flags(m) == expected(m, "head")


def test_stage_change_that_fails_changes_nothing():
    m = make()
    s = ts.UnfreezeSchedule(m, {0: "head", 2: "body.2"})
    s.step()
    m["body"] = nn.Sequential(nn.Linear(4, 4))  # the model changed: "body.2" is gone
    before = flags(m)
    with pytest.raises(ValueError, match="body.2"):
        s.step()
    assert (s.current_step, s.stage) == (1, 1) and flags(m) == before
    with pytest.raises(ValueError, match="body.2"):  # still refused, still nothing changed
        s.load_state_dict({"step": 5, "milestones": [0, 2]})
    assert (s.current_step, s.stage) == (1, 1) and flags(m) == before


@pytest.mark.parametrize("state, words", [
    ({"step": 3}, ["keys"]),
    ({"step": 3, "milestones": [0, 2], "extra": 1}, ["keys"]),
    ({"step": -1, "milestones": [0, 2]}, [">= 0"]),
    ({"step": True, "milestones": [0, 2]}, [">= 0"]),
    ({"step": 2.0, "milestones": [0, 2]}, [">= 0"]),
    ({"step": 3, "milestones": [0, 3]}, ["[0, 3]", "[0, 2]"]),
    ([("step", 3)], ["keys"]),
])
def test_bad_state_raises_and_changes_nothing(state, words):
    m = make()
    s = ts.UnfreezeSchedule(m, {0: "head", 2: "body.2"})
    s.step()
    before = flags(m)
    with pytest.raises(ValueError) as info:
        s.load_state_dict(state)
    for w in words:
        assert w in str(info.value)
    assert (s.current_step, s.stage) == (1, 1) and flags(m) == before


# ----------------------------------------------------------------------------- DDP
def _ddp_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def scenario_schedule_under_ddp(rank, checks):
    from _spawn import check
    from torch.nn.parallel import DistributedDataParallel as DDP

    import torchstruct as ts

    def state(m, s):
        return [p.requires_grad for p in m.parameters()], s.current_step, s.stage

    # 1. A parameter DDP does not synchronize would start training: refused, nothing changes.
    model = _ddp_model()
    s = ts.UnfreezeSchedule(model, {0: "2", 1: "0"})
    ddp = DDP(model)  # kept alive: the rule applies to live wrappers
    before = state(model, s)
    for attempt in range(2):
        try:
            s.step()
        except RuntimeError as e:
            msg = str(e)
            check(checks, f"refused message {attempt}", "DistributedDataParallel" in msg
                  and "'0.weight'" in msg and "stays at step 0" in msg, msg)
        else:
            check(checks, f"refused {attempt}", False, "no error")
        check(checks, f"unchanged {attempt}", state(model, s) == before, str(state(model, s)))
    try:
        s.load_state_dict({"step": 4, "milestones": [0, 1]})
        check(checks, "load refused", False, "no error")
    except RuntimeError:
        check(checks, "load unchanged", state(model, s) == before, str(state(model, s)))

    # 2. A change DDP can follow: every parameter was synchronized (wrapped while all trained)
    #    and find_unused_parameters=True copes with the frozen ones.
    model = _ddp_model()
    ddp = DDP(model, find_unused_parameters=True)
    s = ts.UnfreezeSchedule(model, {0: "2", 1: "0"})
    x = torch.randn(4, 4)
    ddp(x).sum().backward()
    check(checks, "first layer frozen", model[0].weight.grad is None)
    s.step()
    ddp(x).sum().backward()
    check(checks, "allowed change applied", model[0].weight.requires_grad
          and model[0].weight.grad is not None and s.stage == 2)

    # 3. find_unused_parameters=False: the freeze at construction is refused, nothing changes.
    model = _ddp_model()
    ddp = DDP(model)
    try:
        ts.UnfreezeSchedule(model, {0: "2"})
        check(checks, "construction refused", False, "no error")
    except RuntimeError as e:
        check(checks, "construction refused", "find_unused_parameters" in str(e), str(e))
    check(checks, "construction unchanged", all(p.requires_grad for p in model.parameters()))
    del ddp


def test_schedule_under_ddp():
    from _spawn import failed, gloo_available, run

    if not gloo_available():
        pytest.skip("torch.distributed with the gloo backend is not available")
    per_rank = run(scenario_schedule_under_ddp)
    assert not failed(per_rank), failed(per_rank)
    assert all(len(c) >= 8 for c in per_rank.values())


# ------------------------------------------------------------------ the stage where everything trains
def _flags_of(m):
    return [p.requires_grad for p in m.parameters()]


def test_load_of_the_stage_in_force_applies_a_changed_tree_at_once():
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    s = ts.UnfreezeSchedule(m, {0: "1", 3: "0"})
    m.append(nn.Linear(2, 2))  # not selected by "1": frozen by the stage
    s.load_state_dict({"step": 1, "milestones": [0, 3]})  # the stage in force
    assert _flags_of(m) == [False, False, True, True, False, False]
    assert _flags_of(m) == [ts.is_trainable(m, p) for p in m.parameters()]
    s.close()


def test_close_of_the_everything_stage_applies_a_pending_tree_change():
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    ts.mark_trainable(m, "0", "1")  # whatever else m gets is frozen
    s = ts.UnfreezeSchedule(m, {0: None})
    m.append(nn.Linear(2, 2))
    s.close()
    assert _flags_of(m) == [True, True, True, True, False, False]


def test_leaving_the_everything_stage_keeps_the_schedules_place_and_later_writes():
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    s = ts.UnfreezeSchedule(m, {0: "0", 1: None})
    with ts.unfreeze(m, "1"):  # entered after the schedule: stays inner to it
        s.step()
        s.load_state_dict({"step": 0, "milestones": [0, 1]})
        assert _flags_of(m) == [True, True, True, True, False, False]
    s.close()

    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    s = ts.UnfreezeSchedule(m, {0: "0", 1: None})
    m[1].weight.requires_grad_(True)  # by hand, against the schedule: it stands
    s.step()
    s.load_state_dict({"step": 0, "milestones": [0, 1]})
    assert _flags_of(m) == [True, True, True, False]
    s.close()
    assert all(_flags_of(m))
