"""An outside audit of torchstruct when several models hold the same modules or parameters.

What is checked, every answer against plain PyTorch (a twin whose flags are set by hand,
``torch.autograd.grad``, ``torch.nn.utils.clip_grad_norm_``) or against a brute force of the
rule docs/freezing.md states ("Effective trainability": contexts of every model fold in entry
order, the inner one winning; a parameter shared by two attached models needs a declaration
admitting it in *each* model; one flag, one answer in both models' reads):

* teacher-student distillation, the student holding the teacher's embedding module: the
  teacher frozen bare or in a ``with`` block, the student trained with ``freeze_except`` /
  ``unfreeze``; the flag of the shared embedding, and ``is_trainable``,
  ``trainable_parameters`` and ``summary`` of both models after every forward of either;
  random sequences of contexts, declarations and forwards on two topologies (two models
  sharing a module; a wrapper around a backbone that is attached on its own);
* a wrapper and its backbone: declarations on the backbone against contexts on the wrapper,
  ``ts.detach_hooks`` of one root, a teacher whose declaration froze the shared layer collected;
* EMA / target networks: ``copy.deepcopy``, modules shared with the student,
  ``torch.optim.swa_utils.AveragedModel``; ``ts.polyak_update`` between them;
* ``ts.structural_grad(student, loss, wrt=...)`` where the loss also runs the teacher;
* one optimizer over both models: ``ts.param_groups`` per model (the shared parameter once),
  ``ts.optim.AdamW`` with an element mask on the shared parameter;
* ``ts.state_dict`` / ``ts.load_state_dict`` and ``ts.global_norm`` of each model;
* ``ts.stop_gradient`` / ``ts.swap`` / ``ts.constant`` on the teacher while the student runs;
* two threads, each training one of two models that share a module, each in its own context;
* bad input: a clear error, and flags, values and optimizer state of both models unchanged.

Convention: a test that exposes a defect is kept, minimized, and marked
``@pytest.mark.xfail(strict=True, reason="BUG: what happens; what is expected")``; once the
defect is fixed the test passes, the strict xfail turns into a failure, and the marker has to
go. Limits the documentation states are not treated as defects: the test asserts the
documented behaviour instead.
"""
from __future__ import annotations

import copy
import gc
import random
import threading
import weakref

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

import torchstruct as ts


# ----------------------------------------------------------------------------- helpers

class Net(nn.Module):
    """A small model whose embedding module may be shared with another one."""

    def __init__(self, emb: nn.Embedding, d_out: int = 3):
        super().__init__()
        self.emb = emb
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, d_out)

    def forward(self, tok):
        return self.head(torch.tanh(self.body(self.emb(tok)).mean(1)))


class DeclaredTeacher(Net):
    """A teacher whose class declares that only its body and head train."""

    def trainable(self):
        return ["body", "head"]


class Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(3, 3)
        self.top = nn.Linear(3, 3)

    def forward(self, x):
        return self.top(torch.relu(self.stem(x)))


TOK = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 0]])


def make_pair(seed=0, teacher_cls=Net):
    """``(emb, teacher, student)``: the student holds the teacher's embedding module."""
    torch.manual_seed(seed)
    emb = nn.Embedding(10, 4)
    teacher = teacher_cls(emb)
    student = Net(emb)
    return emb, teacher, student


def flags(m):
    return {n: p.requires_grad for n, p in m.named_parameters()}


def consistent(m):
    """Every read of ``m`` agrees with the flags: is_trainable, trainable_parameters, summary."""
    trainable = {id(p) for _, p in ts.trainable_parameters(m)}
    for path, p in m.named_parameters():
        if ts.is_trainable(m, path) is not p.requires_grad:
            return False
        if (id(p) in trainable) is not p.requires_grad:
            return False
    s = ts.summary(m)
    unique = {id(p): p for p in m.parameters()}.values()
    return s.counts == (sum(p.numel() for p in unique if p.requires_grad),
                        sum(p.numel() for p in unique))


def snapshot(*models):
    out = {}
    for m in models:
        for p in m.parameters():
            out[id(p)] = (p.requires_grad, p.detach().clone())
    return out


def unchanged(before, *models):
    for m in models:
        for p in m.parameters():
            flag, value = before[id(p)]
            if p.requires_grad is not flag or not torch.equal(p.detach(), value):
                return False
    return True


def brute_force(models, every, active, declared):
    """The documented rule: starting flag True, contexts folded in entry order, then every
    declaration along every path of every model holding the parameter must admit it."""
    want = {i: True for i in every}
    for kind, model, chosen, _ in active:
        for p in model.parameters():
            if kind == "freeze" and id(p) in chosen:
                want[id(p)] = False
            elif kind == "freeze_except" and id(p) not in chosen:
                want[id(p)] = False
            elif kind == "unfreeze" and id(p) in chosen:
                want[id(p)] = True
    for model in models:
        for path, p in model.named_parameters():
            mod = model
            for part in path.split("."):
                if id(mod) in declared and part not in declared[id(mod)][1]:
                    want[id(p)] = False
                mod = getattr(mod, part)
    return want


# ------------------------------------------------------------------ distillation: flags and reads

@pytest.mark.parametrize("how", ["bare", "with"])
def test_distillation_shared_embedding_follows_the_teachers_freeze_in_both_models(how):
    emb, teacher, student = make_pair()
    ts.attach(teacher)
    ts.attach(student)
    outer = ts.freeze(teacher)  # bare: permanent; "with": lifted below
    both = lambda: consistent(teacher) and consistent(student)
    assert not emb.weight.requires_grad and all(flags(student)[n] for n in flags(student)
                                                if not n.startswith("emb"))
    assert both()
    # freeze_except leaves the selected as they are: the teacher froze the embedding
    with ts.freeze_except(student, "emb", "head"):
        for forward in (student, teacher, student):
            forward(TOK)
            assert flags(student) == {"emb.weight": False, "body.weight": False,
                                      "body.bias": False, "head.weight": True, "head.bias": True}
            assert not any(flags(teacher).values()) and both()
        # the inner block wins: the student's unfreeze turns the shared layer on ... for both
        with ts.unfreeze(student, "emb"):
            teacher(TOK)
            assert emb.weight.requires_grad and ts.is_trainable(teacher, "emb.weight")
            assert [n for n, _ in ts.trainable_parameters(teacher)] == ["emb.weight"]
            assert both()
            out = student(TOK).pow(2).sum() + teacher(TOK).sum()
            out.backward()
            assert emb.weight.grad is not None and teacher.head.weight.grad is None
            assert student.body.weight.grad is None and student.head.weight.grad is not None
        assert not emb.weight.requires_grad and both()
    assert not emb.weight.requires_grad and both()
    if how == "with":
        outer.__exit__(None, None, None)
        assert all(flags(teacher).values()) and all(flags(student).values()) and both()
    else:
        student(TOK)
        teacher(TOK)
        assert not emb.weight.requires_grad and not any(flags(teacher).values()) and both()


def test_a_teacher_declaration_keeps_the_shared_embedding_frozen_against_student_contexts():
    emb, teacher, student = make_pair(teacher_cls=DeclaredTeacher)
    ts.attach(teacher)
    ts.attach(student)
    assert not emb.weight.requires_grad  # the teacher's class does not list "emb"
    assert not ts.is_trainable(student, "emb.weight") and consistent(student)
    with ts.unfreeze(student):  # a declaration beats every context, unfreeze included
        student(TOK)
        assert not emb.weight.requires_grad and consistent(student) and consistent(teacher)
        g = ts.structural_grad(student, lambda m: m(TOK).sum())
        assert "emb.weight" not in ts.tree.to_flat_dict(g)
    # an instance declaration on the teacher that lists it: both models now admit it
    ts.mark_trainable(teacher, "emb", "head")
    teacher(TOK)
    assert emb.weight.requires_grad and not teacher.body.weight.requires_grad
    assert consistent(student) and consistent(teacher)
    ts.mark_trainable(teacher, None)  # back to the class's trainable()
    assert not emb.weight.requires_grad and teacher.body.weight.requires_grad
    assert consistent(student) and consistent(teacher)


def _teacher_student():
    emb, teacher, student = make_pair(seed=1)
    models = [teacher, student]
    ts.attach(teacher)
    ts.attach(student)
    owners = {"t": teacher, "s": student, "emb": emb}
    decl_choices = {
        "t": [["emb", "head"], ["body", "head"], ["emb", "body", "head"], ["head"]],
        "s": [["emb", "head"], ["body", "head"], ["emb", "body", "head"]],
        "emb": [[], ["weight"]],
    }
    selectors = ["emb", "body", "head", "*bias", "emb.weight", "head.*"]
    forwards = [lambda: teacher(TOK), lambda: student(TOK)]
    return models, owners, decl_choices, selectors, forwards


def _wrapper_backbone():
    torch.manual_seed(2)
    bb = Backbone()
    wrapper = nn.Sequential(bb, nn.Linear(3, 1))
    ts.attach(bb)
    ts.attach(wrapper)
    x = torch.randn(2, 3)
    owners = {"bb": bb, "wrapper": wrapper, "stem": bb.stem}
    decl_choices = {"bb": [["top"], ["stem", "top"], ["stem"]],
                    "wrapper": [["0"], ["1"], ["0", "1"]],
                    "stem": [["weight"], []]}
    selectors = ["0", "1", "0.top", "*bias", "stem", "top.weight"]
    forwards = [lambda: wrapper(x), lambda: bb(x)]
    return [wrapper, bb], owners, decl_choices, selectors, forwards


@pytest.mark.parametrize("topology", [_teacher_student, _wrapper_backbone],
                         ids=["teacher_student", "wrapper_backbone"])
def test_random_contexts_declarations_and_forwards_match_the_documented_rule(topology):
    rng = random.Random(7)
    for trial in range(20):
        models, owners, decl_choices, selectors, forwards = topology()
        every = {id(p): p for m in models for p in m.parameters()}
        active, declared = [], {}
        for step in range(12):
            r = rng.random()
            if r < 0.4 or not active:
                model = rng.choice(models)
                kind = rng.choice(["freeze", "freeze_except", "unfreeze"])
                sel = rng.choice(selectors)
                try:
                    chosen = {id(p) for _, p in ts.select(model, sel)}
                except ValueError:  # a selector of the other model: nothing entered
                    before = {i: p.requires_grad for i, p in every.items()}
                    with pytest.raises(ValueError):
                        getattr(ts, kind)(model, sel)
                    assert {i: p.requires_grad for i, p in every.items()} == before
                    continue
                active.append((kind, model, chosen, getattr(ts, kind)(model, sel)))
            elif r < 0.6:
                *_, ctx = active.pop(rng.randrange(len(active)))
                ctx.__exit__(None, None, None)
            elif r < 0.8:
                key = rng.choice(sorted(owners))
                target = owners[key]
                names = rng.choice(decl_choices[key] + [None])
                if names is None:
                    ts.mark_trainable(target, None)
                    declared.pop(id(target), None)
                else:
                    ts.mark_trainable(target, *names)
                    declared[id(target)] = (target, set(names))
            else:
                rng.choice(forwards)()
            want = brute_force(models, every, active, declared)
            got = {i: p.requires_grad for i, p in every.items()}
            assert got == want, (trial, step)
            assert all(consistent(m) for m in models), (trial, step)
        for *_, ctx in reversed(active):
            ctx.__exit__(None, None, None)
        for target, _ in list(declared.values()):
            ts.mark_trainable(target, None)
        assert all(p.requires_grad for p in every.values())
        assert all(consistent(m) for m in models)


# ---------------------------------------------------------------------- wrapper and backbone

def test_backbone_declaration_against_contexts_on_the_wrapper():
    class DeclaredBackbone(Backbone):
        def trainable(self):
            return ["top"]

    bb = DeclaredBackbone()
    wrapper = nn.Sequential(bb, nn.Linear(3, 1))
    ts.attach(bb)
    ts.attach(wrapper)
    x = torch.randn(2, 3)
    expect = [False, False, True, True, True, True]
    assert list(flags(wrapper).values()) == expect and consistent(wrapper) and consistent(bb)
    with ts.unfreeze(wrapper):  # the backbone's declaration wins over the wrapper's unfreeze
        wrapper(x)
        assert list(flags(wrapper).values()) == expect
        with ts.freeze(wrapper, "0"):
            bb(x)
            assert list(flags(wrapper).values()) == [False] * 4 + [True, True]
            assert not ts.is_trainable(bb, "top.weight") and consistent(bb)
        assert list(flags(wrapper).values()) == expect
    # the backbone's own context is scoped to it, and seen through the wrapper
    with ts.freeze_except(bb, "top.bias"):
        wrapper(x)
        assert list(flags(wrapper).values()) == [False, False, False, True, True, True]
        assert consistent(wrapper) and consistent(bb)
    assert list(flags(wrapper).values()) == expect and consistent(wrapper) and consistent(bb)


def test_detaching_the_backbone_keeps_the_wrappers_hook_working():
    bb = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    wrapper = nn.Sequential(bb, nn.Linear(3, 1))
    ts.attach(bb)
    ts.freeze_except(wrapper, "1")  # bare, on the wrapper
    ts.detach_hooks(bb)
    bb.append(nn.Linear(3, 3))  # a registration below the wrapper's root
    bb(torch.randn(2, 3))  # the module it was registered into applies it (docs/freezing.md)
    assert not any(p.requires_grad for p in bb.parameters())
    assert consistent(bb) and consistent(wrapper)


def test_detaching_the_wrapper_removes_the_hooks_of_an_attached_backbone_as_documented():
    # detach_hooks(model) removes every hook torchstruct installed on the model *and its
    # submodules*: a backbone attached on its own inside it loses its forward hook too, and
    # a registration into it waits for the next application (here ts.attach(bb)).
    bb = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    wrapper = nn.Sequential(bb, nn.Linear(3, 1))
    ts.mark_trainable(bb, "1")  # attaches bb
    ts.attach(wrapper)
    ts.detach_hooks(wrapper)
    bb.append(nn.Linear(3, 3))
    bb(torch.randn(2, 3))
    assert bb[2].weight.requires_grad  # not applied at bb's forward: its hook is gone
    assert not ts.is_trainable(bb, "2.weight")  # the read already answers by the declaration
    ts.attach(bb)  # applies, and installs bb's hook again
    assert not bb[2].weight.requires_grad and consistent(bb)
    bb.append(nn.Linear(3, 3))
    bb(torch.randn(2, 3))
    assert not bb[3].weight.requires_grad and consistent(bb)


def test_a_teacher_whose_declaration_froze_the_shared_embedding_is_collected():
    emb, teacher, student = make_pair(teacher_cls=DeclaredTeacher)
    ts.attach(teacher)
    ts.attach(student)
    assert not emb.weight.requires_grad
    ref = weakref.ref(teacher)
    del teacher
    gc.collect()
    assert ref() is None
    # the survivor applies at once (docs/freezing.md): flags and reads agree right away
    assert emb.weight.requires_grad and consistent(student)
    # and a new optimizer trains it exactly as plain PyTorch does
    torch.manual_seed(0)
    twin = Net(nn.Embedding(10, 4))
    twin.load_state_dict(student.state_dict())
    for m in (student, twin):
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        m(TOK).pow(2).sum().backward()
        opt.step()
    for (n, p), q in zip(student.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=n)


# -------------------------------------------------------------------- EMA and target networks

def test_polyak_into_a_deepcopy_ema_and_into_an_ema_sharing_the_embedding():
    emb, teacher, student = make_pair()
    ts.attach(student)
    ema_copy = copy.deepcopy(student)  # plain PyTorch, its own embedding
    ema_shared = Net(emb)  # shares the embedding module with the student
    ema_shared.load_state_dict(student.state_dict())
    with torch.no_grad():
        for p in student.parameters():
            p.add_(torch.randn_like(p))
    src = {n: p.detach().clone() for n, p in student.named_parameters()}
    old_copy = {n: p.detach().clone() for n, p in ema_copy.named_parameters()}
    old_shared = {n: p.detach().clone() for n, p in ema_shared.named_parameters()}
    ts.polyak_update(ema_copy, student, 0.25)
    ts.polyak_update(ema_shared, student, 0.25)
    for n, p in ema_copy.named_parameters():
        torch.testing.assert_close(p, torch.lerp(old_copy[n], src[n], 0.25), msg=n)
    for n, p in ema_shared.named_parameters():
        if p is emb.weight:  # target and source are one tensor: lerp(x, x) = x
            assert torch.equal(p, src[n])
        else:
            torch.testing.assert_close(p, torch.lerp(old_shared[n], src[n], 0.25), msg=n)
    assert all(torch.equal(p, src[n]) for n, p in student.named_parameters())
    # freezing the target that shares the embedding freezes the student's (one flag) ...
    ts.freeze(ema_shared)
    assert not emb.weight.requires_grad and not ts.is_trainable(student, "emb.weight")
    assert consistent(student) and consistent(ema_shared)
    before = {n: p.detach().clone() for n, p in ema_shared.named_parameters()}
    ts.polyak_update(ema_shared, student, 0.5)  # a target a context keeps frozen: left alone
    assert all(torch.equal(p, before[n]) for n, p in ema_shared.named_parameters())
    with ts.unfreeze(ema_shared):
        ts.polyak_update(ema_shared, student, 0.5)
    for n, p in ema_shared.named_parameters():
        torch.testing.assert_close(p, torch.lerp(before[n], src[n], 0.5), msg=n)
    assert not emb.weight.requires_grad and consistent(student)


def test_averaged_model_of_an_attached_student_is_a_plain_copy():
    emb, teacher, student = make_pair()
    ts.attach(teacher)
    ts.attach(student)
    with ts.freeze(teacher):  # the shared embedding is frozen while the copy is made
        avg = AveragedModel(student)
    assert avg.module.emb.weight is not emb.weight  # AveragedModel deep-copies
    assert emb.weight.requires_grad  # the original is restored ...
    assert not avg.module.emb.weight.requires_grad  # ... the copy keeps the flag it copied
    assert [n for n, _ in ts.trainable_parameters(avg.module)] == [
        "body.weight", "body.bias", "head.weight", "head.bias"]
    assert consistent(avg.module)
    # update_parameters is plain PyTorch: the running mean of every parameter
    snaps = [[p.detach().clone() for p in student.parameters()]]
    avg.update_parameters(student)
    for _ in range(2):
        with torch.no_grad():
            for p in student.parameters():
                p.add_(1.0)
        snaps.append([p.detach().clone() for p in student.parameters()])
        avg.update_parameters(student)
        student(TOK)  # the student's forward does not touch the copy
    for i, p in enumerate(avg.module.parameters()):
        torch.testing.assert_close(p, torch.stack([s[i] for s in snaps]).mean(0))
    assert all(p.requires_grad for p in teacher.parameters())
    # polyak into the copy: its frozen embedding (copied flag) is left as it is
    before = avg.module.emb.weight.detach().clone()
    ts.polyak_update(avg.module, student, 0.5)
    assert torch.equal(avg.module.emb.weight, before)
    with ts.unfreeze(avg.module):
        ts.polyak_update(avg.module, student, 0.5)
    torch.testing.assert_close(avg.module.emb.weight, torch.lerp(before, emb.weight.detach(), 0.5))
    assert not avg.module.emb.weight.requires_grad and emb.weight.requires_grad


# ---------------------------------------------------------------------- structural gradients

def _twin_grads(teacher, student, asked, loss_of):
    """torch.autograd.grad on a twin built from the same values, flags set by hand:
    only the asked student parameters require grad."""
    emb2 = nn.Embedding(10, 4)
    t2, s2 = Net(emb2), Net(emb2)
    t2.load_state_dict(teacher.state_dict())
    s2.load_state_dict(student.state_dict())
    for n, p in s2.named_parameters():
        p.requires_grad_(n in asked)
    for p in t2.parameters():
        if p is not emb2.weight:
            p.requires_grad_(False)
    named = dict(s2.named_parameters())
    grads = torch.autograd.grad(loss_of(s2, t2), [named[n] for n in asked])
    return dict(zip(asked, grads))


def _distill(s, t):
    return (s(TOK) - t(TOK)).pow(2).sum() + 0.1 * t(TOK).sum()


@pytest.mark.parametrize("wrt", [None, "emb", "head", ["emb", "body"]],
                         ids=["trainable", "emb", "head", "emb+body"])
@pytest.mark.parametrize("teacher_frozen", [True, False])
def test_structural_grad_of_student_with_the_teacher_in_the_loss(wrt, teacher_frozen):
    emb, teacher, student = make_pair(seed=3)
    ts.attach(student)
    ctx = ts.freeze(teacher) if teacher_frozen else ts.freeze(teacher, "head")
    before = {**{("t", n): f for n, f in flags(teacher).items()},
              **{("s", n): f for n, f in flags(student).items()}}
    g = ts.tree.to_flat_dict(ts.structural_grad(student, lambda s: _distill(s, teacher), wrt=wrt))
    if wrt is None:
        asked = [n for n, p in student.named_parameters() if p.requires_grad]
        assert ("emb.weight" in asked) is (not teacher_frozen)
    else:
        asked = [n for n, _ in ts.select(student, wrt)]
    assert list(g) == asked
    ref = _twin_grads(teacher, student, asked, _distill)
    for n in asked:
        torch.testing.assert_close(g[n], ref[n], msg=n)
    after = {**{("t", n): f for n, f in flags(teacher).items()},
             **{("s", n): f for n, f in flags(student).items()}}
    assert after == before and consistent(teacher) and consistent(student)
    assert all(p.grad is None for p in [*teacher.parameters(), *student.parameters()])
    ctx.__exit__(None, None, None)


def test_structural_grad_tensor_loss_for_the_embedding_the_teacher_froze_is_refused():
    emb, teacher, student = make_pair()
    ts.attach(student)
    with ts.freeze(teacher):
        loss = _distill(student, teacher)
        before = snapshot(teacher, student)
        with pytest.raises(ValueError, match="emb.weight"):
            ts.structural_grad(student, loss, wrt="emb")
        assert unchanged(before, teacher, student)
        g = ts.structural_grad(student, loss, wrt="head")  # the same loss, a trainable part
        assert list(ts.tree.to_flat_dict(g)) == ["head.weight", "head.bias"]
        with pytest.raises(ValueError, match="no trainable|trainable"):
            ts.structural_grad(teacher, lambda t: t(TOK).sum())  # a model with nothing on
        assert unchanged(before, teacher, student)


# ------------------------------------------------------------------ one optimizer, two models

def test_param_groups_of_two_models_concatenated_are_refused_like_torch():
    emb, teacher, student = make_pair()
    groups = ts.param_groups(teacher) + ts.param_groups(student)
    with pytest.raises(ValueError, match="more than one parameter group"):
        torch.optim.AdamW(groups, lr=0.1)
    with pytest.raises(ValueError, match="more than one parameter group"):
        ts.optim.AdamW(groups, lr=0.1)
    # one container over both: the shared parameter once, at its first path
    both = nn.ModuleDict({"t": teacher, "s": student})
    groups = ts.param_groups(both, ("s.head", {"lr": 0.01}))
    names = [n for g in groups for n in g["param_names"]]
    params = [p for g in groups for p in g["params"]]
    assert len(params) == len({id(p) for p in params}) == len({id(p) for p in both.parameters()})
    assert "t.emb.weight" in names and "s.emb.weight" not in names
    assert sorted(names) == sorted(n for n, _ in both.named_parameters())


def _adamw_pair(mask):
    emb, teacher, student = make_pair(seed=4)
    ts.attach(teacher)
    ts.attach(student)
    both = nn.ModuleDict({"t": teacher, "s": student})
    opt = ts.optim.AdamW(ts.param_groups(both), lr=0.05, weight_decay=0.1,
                         masks={"t.emb.weight": mask})
    return emb, teacher, student, both, opt


def test_adamw_mask_on_the_shared_embedding_over_both_models_matches_torch():
    mask = torch.zeros(10, 4, dtype=torch.bool)
    mask[7:] = True  # only three rows of the shared table train
    emb, teacher, student, both, opt = _adamw_pair(mask)
    assert opt.masks[emb.weight] is not None
    emb2 = nn.Embedding(10, 4)
    t2, s2 = Net(emb2), Net(emb2)
    t2.load_state_dict(teacher.state_dict())
    s2.load_state_dict(student.state_dict())
    both2 = nn.ModuleDict({"t": t2, "s": s2})
    ref = torch.optim.AdamW(ts.param_groups(both2), lr=0.05, weight_decay=0.1, foreach=False)
    frozen_rows = emb.weight[:7].detach().clone()
    tok = torch.tensor([[1, 2, 7, 8, 9], [3, 7, 8, 9, 0]])  # masked-out rows get gradients too
    with ts.freeze(teacher, "head"):
        for _ in range(3):
            for m, o in ((both, opt), (both2, ref)):
                o.zero_grad()
                (m["s"](tok) - m["t"](tok)).pow(2).sum().backward()
            t2.head.weight.grad = t2.head.bias.grad = None  # the twin's "frozen" head
            opt.step()
            ref.step()
            with torch.no_grad():  # the mask, applied by hand on the twin
                emb2.weight[:7] = frozen_rows
    assert torch.equal(emb.weight[:7], frozen_rows)  # masked-out: same bits
    assert opt.state[emb.weight]["exp_avg"][:7].eq(0).all()
    for (n, p), q in zip(both.named_parameters(), both2.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6, msg=n)
    assert teacher.head.weight not in opt.state  # frozen in the block: never stepped
    assert emb.weight.requires_grad and consistent(teacher) and consistent(student)


def test_adamw_bad_mask_on_the_shared_embedding_changes_nothing():
    mask = torch.ones(10, 4, dtype=torch.bool)
    emb, teacher, student, both, opt = _adamw_pair(mask)
    (student(TOK).sum() + teacher(TOK).sum()).backward()
    opt.step()
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    before = snapshot(teacher, student)
    for bad in (torch.ones(10, 3, dtype=torch.bool), torch.ones(10, 4)):
        with pytest.raises(ValueError):
            opt.set_mask(student.emb.weight, bad)
    with pytest.raises(ValueError, match="emb"):
        opt.set_mask("s.emb.weight", mask)  # the shared parameter goes by its first path
    assert torch.equal(opt.masks[emb.weight], mask)
    assert unchanged(before, teacher, student)
    assert {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}.keys() \
        == state.keys()
    for p, s in opt.state.items():
        for k, v in s.items():
            assert torch.equal(v, state[id(p)][k])


def test_a_mask_keyed_by_a_path_both_models_have_is_refused_as_ambiguous():
    emb, teacher, student = make_pair()
    seen, groups = set(), []
    for g in ts.param_groups(teacher) + ts.param_groups(student):  # the shared table once
        keep = [(p, n) for p, n in zip(g["params"], g["param_names"]) if id(p) not in seen]
        seen |= {id(p) for p, _ in keep}
        groups.append(dict(g, params=[p for p, _ in keep], param_names=[n for _, n in keep]))
    mask = torch.zeros(3, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="'head.weight' names 2 parameters"):
        ts.optim.AdamW(groups, lr=0.1, masks={"head.weight": mask})
    opt = ts.optim.AdamW(groups, lr=0.1, masks={student.head.weight: mask})
    with pytest.raises(ValueError, match="'head.weight' names 2 parameters"):
        opt.set_mask("head.weight", None)
    assert list(opt.masks) == [student.head.weight] and opt.masks[student.head.weight] is mask
    opt.set_mask("emb.weight", mask.new_ones(10, 4))  # a path only one parameter has
    assert opt.masks[emb.weight].all()


# ------------------------------------------------------------- checkpoints and norms of each model

def test_state_dict_of_each_model_holds_the_shared_embedding_and_loads_through_either():
    emb, teacher, student = make_pair()
    ts.attach(student)
    with ts.freeze(teacher, "body", "head"):
        st, ss = ts.state_dict(teacher), ts.state_dict(student)
        assert list(st) == ["emb.weight"]
        assert list(ss) == ["emb.weight", "body.weight", "body.bias", "head.weight", "head.bias"]
        assert st["emb.weight"].data_ptr() == ss["emb.weight"].data_ptr() == emb.weight.data_ptr()
        with ts.freeze(student, "emb"):  # one flag: out of both checkpoints
            assert list(ts.state_dict(teacher)) == []
            assert "emb.weight" not in ts.state_dict(student)
        saved = {k: v.clone() for k, v in ss.items()}
        with torch.no_grad():
            for p in [*teacher.parameters(), *student.parameters()]:
                p.add_(1.0)
        t_body = teacher.body.weight.detach().clone()
        ts.load_state_dict(student, saved)  # through the student: the teacher sees the table
        assert torch.equal(teacher.emb.weight, saved["emb.weight"])
        assert torch.equal(teacher.body.weight, t_body)
        for k, v in saved.items():
            assert torch.equal(student.get_parameter(k), v)
        new_table = torch.randn(10, 4)
        ts.load_state_dict(teacher, {"emb.weight": new_table})  # through the teacher
        assert torch.equal(student.emb.weight, new_table)
        # a bad entry: nothing written, not even the shared table
        before = snapshot(teacher, student)
        bad = dict(saved, **{"head.weight": torch.zeros(5, 5)})
        with pytest.raises(ValueError, match="head.weight"):
            ts.load_state_dict(student, bad)
        with pytest.raises(ValueError, match="body.weight"):  # strict: the student's keys
            ts.load_state_dict(student, {"emb.weight": saved["emb.weight"]})
        assert unchanged(before, teacher, student)


def test_global_norm_and_clipping_of_each_model_match_torch():
    emb, teacher, student = make_pair(seed=5)
    ts.attach(student)
    torch.manual_seed(5)
    emb2 = nn.Embedding(10, 4)
    t2, s2 = Net(emb2), Net(emb2)
    t2.load_state_dict(teacher.state_dict())
    s2.load_state_dict(student.state_dict())
    t2.head.requires_grad_(False)
    with ts.freeze(teacher, "head"):
        for t, s in ((teacher, student), (t2, s2)):
            (s(TOK).pow(2).sum() + 3 * t(TOK).pow(2).sum()).backward()
        trainable = lambda m: [p for p in m.parameters() if p.requires_grad]
        for m, m2 in ((teacher, t2), (student, s2)):
            want = torch.nn.utils.clip_grad_norm_(trainable(m2), float("inf"))
            torch.testing.assert_close(ts.global_norm(m), want)
            want1 = torch.nn.utils.get_total_norm([p.grad for p in trainable(m2)], 1.0)
            torch.testing.assert_close(ts.global_norm(m, 1.0), want1)
        # clip the student, then the teacher: the shared gradient is scaled by both
        got_s = ts.clip_by_global_norm(student, 0.5)
        got_t = ts.clip_by_global_norm(teacher, 0.3)
        want_s = torch.nn.utils.clip_grad_norm_(trainable(s2), 0.5)
        want_t = torch.nn.utils.clip_grad_norm_(trainable(t2), 0.3)
        torch.testing.assert_close(got_s, want_s)
        torch.testing.assert_close(got_t, want_t)
        for (n, p), q in zip([*teacher.named_parameters(), *student.named_parameters()],
                             [*t2.parameters(), *s2.parameters()]):
            if q.grad is None:
                assert p.grad is None, n
            else:
                torch.testing.assert_close(p.grad, q.grad, msg=n)
        with pytest.raises(ValueError):
            ts.clip_by_global_norm(student, -1.0)
        torch.testing.assert_close(emb.weight.grad, emb2.weight.grad)


# ------------------------------------------------------ block-local contexts on the teacher

def test_stop_gradient_on_the_teacher_blocks_the_students_shared_use_inside_the_block():
    emb, teacher, student = make_pair(seed=6)
    ts.attach(teacher)
    ts.attach(student)
    twin_t, twin_s = make_pair(seed=6)[1:]
    twin_emb = twin_s.emb.weight
    with ts.stop_gradient(teacher):  # every teacher parameter, the shared table included
        inside = student(TOK).pow(2).sum() + teacher(TOK).sum()
    outside = student(TOK).sum()
    (inside + outside).backward()
    # the documented rule, by hand: inside the block each use of a teacher parameter is a
    # detached alias, whichever model makes it
    fc = torch.func.functional_call
    detached_t = {n: p.detach() for n, p in twin_t.named_parameters()}
    ref_inside = fc(twin_s, {"emb.weight": twin_emb.detach()}, (TOK,)).pow(2).sum() \
        + fc(twin_t, detached_t, (TOK,)).sum()
    (ref_inside + twin_s(TOK).sum()).backward()
    for (n, p), q in zip([*teacher.named_parameters(), *student.named_parameters()],
                         [*twin_t.parameters(), *twin_s.parameters()]):
        if q.grad is None:
            assert p.grad is None, n
        else:
            torch.testing.assert_close(p.grad, q.grad, msg=n)
    assert teacher.body.weight.grad is None and emb.weight.grad is not None
    assert all(p.requires_grad for p in [*teacher.parameters(), *student.parameters()])


def test_swap_on_the_teacher_is_seen_by_the_student_and_refuses_a_step_on_it():
    emb, teacher, student = make_pair(seed=7)
    ts.attach(student)
    twin_s = make_pair(seed=7)[2]
    table = torch.randn(10, 4, requires_grad=True)
    opt = ts.optim.AdamW(student.parameters(), lr=0.1)
    student(TOK).sum().backward()
    before = snapshot(teacher, student)
    with ts.swap(teacher, {"emb": {"weight": table}}):
        out = student(TOK)  # the student's use of the shared table sees the stand-in
        out.pow(2).sum().backward()
        with pytest.raises(RuntimeError):
            opt.step()  # would read the stand-in and write the parameters
        assert opt.state == {} or all(len(s) == 0 for s in opt.state.values())
        with pytest.raises(RuntimeError, match="emb.weight"):
            ts.polyak_update(student, copy.deepcopy(twin_s), 0.5)
        assert ts.is_trainable(student, "emb.weight") and consistent(student)
    assert unchanged(before, teacher, student)
    table2 = table.detach().clone().requires_grad_()
    ref = torch.func.functional_call(twin_s, {"emb.weight": table2}, (TOK,))
    torch.testing.assert_close(out, ref)
    ref.pow(2).sum().backward()
    torch.testing.assert_close(table.grad, table2.grad)
    # the student's own parameters got gradients from the swapped forward, the table none
    g_body_twin = torch.autograd.grad(
        torch.func.functional_call(twin_s, {"emb.weight": table.detach()}, (TOK,)).pow(2).sum(),
        twin_s.body.weight)[0]
    g_first = torch.autograd.grad(twin_s(TOK).sum(), twin_s.body.weight)[0]
    torch.testing.assert_close(student.body.weight.grad, g_first + g_body_twin)
    torch.testing.assert_close(emb.weight.grad,
                               torch.autograd.grad(twin_s(TOK).sum(), twin_s.emb.weight)[0])


def test_constant_on_the_teacher_refuses_a_student_step_on_the_shared_table():
    emb, teacher, student = make_pair(seed=8)
    ts.attach(student)
    opt = ts.optim.AdamW(student.parameters(), lr=0.1)
    student(TOK).sum().backward()
    opt.step()
    student(TOK).sum().backward()
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    before = snapshot(teacher, student)
    with ts.constant(teacher):
        with pytest.raises(RuntimeError, match="'emb.weight'"):
            opt.step()
        with pytest.raises(RuntimeError, match="emb.weight"), torch.no_grad():
            student.emb.weight.mul_(2)  # through the student's path: same memory
    assert unchanged(before, teacher, student)
    for p, s in opt.state.items():
        for k, v in s.items():
            assert torch.equal(v, state[id(p)][k])
    with ts.constant(teacher, "head"):  # the teacher's own head: the student's step passes
        opt.step()
    assert not torch.equal(emb.weight, before[id(emb.weight)][1])


# --------------------------------------------------------------------------------- threads

def test_two_threads_train_two_models_sharing_an_embedding_each_in_its_own_context():
    # docs/freezing.md: contexts on different models may be used from different threads; a
    # flag is one bit per parameter, so here no context covers the shared table.
    emb, a, b = make_pair(seed=9)
    ts.attach(a)
    ts.attach(b)
    loss = lambda m: m(TOK).pow(2).sum()

    def reference(m, frozen):
        names = [n for n, _ in m.named_parameters() if not n.startswith(frozen)]
        named = dict(m.named_parameters())
        return dict(zip(names, torch.autograd.grad(loss(m), [named[n] for n in names])))

    refs = {"head": reference(a, "head"), "body": reference(b, "body")}
    errors, barrier = [], threading.Barrier(2)

    def work(m, sel):
        try:
            barrier.wait()
            for i in range(60):
                with ts.freeze(m, sel):
                    g = ts.tree.to_flat_dict(ts.structural_grad(m, loss))
                    if list(g) != list(refs[sel]):
                        errors.append((sel, i, list(g)))
                        return
                    for k, v in g.items():
                        if not torch.allclose(v, refs[sel][k]):
                            errors.append((sel, i, k))
                            return
                    if ts.is_trainable(m, sel + ".weight") or not m.emb.weight.requires_grad:
                        errors.append((sel, i, "read"))
                        return
        except Exception as e:  # pragma: no cover - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(a, "head")),
               threading.Thread(target=work, args=(b, "body"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert all(p.requires_grad for p in [*a.parameters(), *b.parameters()])
    assert consistent(a) and consistent(b)


def test_a_wrt_call_on_one_model_never_gives_the_other_thread_a_silent_zero():
    # structural_grad(a, wrt="head") switches the shared table off while its loss runs; a
    # call on b in another thread that asks for the table either gets the true gradient or
    # raises RuntimeError naming it (docs/structural.md), never zeros.
    emb, a, b = make_pair(seed=10)
    ts.attach(a)
    ts.attach(b)
    loss = lambda m: m(TOK).pow(2).sum()
    named = dict(b.named_parameters())
    ref_b = dict(zip(named, torch.autograd.grad(loss(b), list(named.values()))))
    ref_a = torch.autograd.grad(loss(a), [a.head.weight, a.head.bias])
    out = {"ok": 0, "refused": 0, "bad": []}
    barrier = threading.Barrier(2)

    def on_a():
        barrier.wait()
        for _ in range(80):
            g = ts.tree.to_flat_dict(ts.structural_grad(a, loss, wrt="head"))
            if not (torch.allclose(g["head.weight"], ref_a[0])
                    and torch.allclose(g["head.bias"], ref_a[1])):
                out["bad"].append("a")

    def on_b():
        barrier.wait()
        for _ in range(80):
            try:
                g = ts.tree.to_flat_dict(ts.structural_grad(b, loss))
            except RuntimeError as e:
                if "emb.weight" not in str(e):
                    out["bad"].append(str(e))
                out["refused"] += 1
                continue
            if list(g) != list(ref_b) or any(not torch.allclose(g[k], ref_b[k]) for k in g):
                out["bad"].append(sorted(g))
            else:
                out["ok"] += 1

    threads = [threading.Thread(target=on_a), threading.Thread(target=on_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out["bad"] == [] and out["ok"] + out["refused"] == 80
    assert all(p.requires_grad for p in [*a.parameters(), *b.parameters()])
    assert consistent(a) and consistent(b)


# ------------------------------------------------------------- registrations into the shared part

@pytest.mark.parametrize("forward", ["student", "teacher", "shared"])
def test_a_layer_added_to_the_shared_part_is_judged_by_the_teachers_context(forward):
    shared = nn.Sequential(nn.Linear(3, 3))
    teacher = nn.Sequential(shared, nn.Linear(3, 1))
    student = nn.Sequential(shared, nn.Linear(3, 2))
    ts.attach(student)
    ctx = ts.freeze_except(teacher, "1")
    shared.append(nn.Linear(3, 3))  # a new layer in the shared part, after the context
    {"student": student, "teacher": teacher, "shared": shared}[forward](torch.randn(2, 3))
    assert not shared[1].weight.requires_grad  # not selected by the teacher's "1": frozen
    assert [p.requires_grad for p in student.parameters()] == [False] * 4 + [True, True]
    assert consistent(student) and consistent(teacher)
    with pytest.warns(ts.RestoredFlagsWarning):
        ctx.__exit__(None, None, None)
    assert all(p.requires_grad for p in [*teacher.parameters(), *student.parameters()])
    assert consistent(student) and consistent(teacher)


# ------------------------------------------------------------------------------- bad input

def test_bad_input_on_either_model_changes_nothing_in_both():
    emb, teacher, student = make_pair()
    ts.attach(teacher)
    ts.attach(student)
    ts.freeze(teacher, "head")
    before = snapshot(teacher, student)
    ema = copy.deepcopy(student)
    calls = [
        (ValueError, "emb.weight", lambda: ts.freeze_except(student, "emb.wieght")),
        (ValueError, "submodule", lambda: ts.freeze(student, teacher.head)),
        (ValueError, "not a parameter", lambda: ts.is_trainable(student, teacher.body.weight)),
        (ValueError, "", lambda: ts.freeze_except(student, [])),
        (ValueError, "emb.weight", lambda: ts.swap(teacher, {"emb": {"weight": torch.zeros(3)}})),
        (ValueError, "tau", lambda: ts.polyak_update(student, ema, 1.5)),
        (ValueError, "", lambda: ts.polyak_update(student, {"emb": {"weight": torch.zeros(3)}},
                                                  0.5)),
        (ValueError, "", lambda: ts.mark_trainable(student, "embb")),
        (ValueError, "", lambda: ts.structural_grad(student, lambda m: m(TOK).sum(),
                                                    wrt="haed")),
        (ValueError, "", lambda: ts.param_groups(student, ("haed", {"lr": 1.0}))),
    ]
    for exc, match, call in calls:
        with pytest.raises(exc, match=match or None):
            call()
        assert unchanged(before, teacher, student), match
        assert consistent(teacher) and consistent(student)
        student(TOK)
        teacher(TOK)
        assert unchanged(before, teacher, student)
