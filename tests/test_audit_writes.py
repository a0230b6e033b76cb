"""Writes by hand, declarations and compiled code, tried as a suspicious user would.

Three rules (docs/freezing.md): a flag written by hand wins over the contexts active and the
declarations made when it was written, and later ones apply on top; a compiled forward reads
"some attached tree changed" and applies eagerly once, then runs without breaks; a declaration
applies at once in every attached model sharing parameters with the trees holding it.

A test marked ``xfail(strict=True)`` reproduces a case that goes wrong today; its reason says
what happens and what is expected.
"""
import copy
import os
import threading

import pytest
import torch
from torch import nn

import torchstruct as ts
from _flags import STALE_GRAPHS, flags, reads
from torchstruct import _state

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def agree(m):
    """Flags, trainable_parameters, is_trainable and summary tell one story."""
    f = flags(m)
    by_path = [ts.is_trainable(m, p) for p in m.parameters()]
    counted = sum(p.numel() for p in m.parameters() if p.requires_grad)
    return f == reads(m) == by_path and ts.summary(m).counts[0] == counted


def x3():
    return torch.randn(4, 3)


def counting_aot_eager(graphs):
    from torch._dynamo.backends.registry import lookup_backend

    aot = lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot(gm, example_inputs)

    return backend


def counting_backend(graphs):
    def backend(gm, _example_inputs):
        graphs.append(gm)
        return gm.forward

    return backend


class Block(nn.Module):
    """A class whose ``trainable()`` method declares only ``mlp`` trainable."""

    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(3, 3)
        self.mlp = nn.Linear(3, 3)

    def trainable(self):
        return ["mlp"]

    def forward(self, x):
        return self.mlp(self.attn(x))


# --------------------------------------------------------------------------- rule 1: writes by hand
def test_a_write_against_a_class_declaration_stands_under_later_marks_and_nested_blocks():
    b = Block()
    ts.attach(b)
    assert flags(b) == [False, False, True, True]
    b.attn.weight.requires_grad_(True)  # against trainable() (as old as anything): it stands
    b(x3())
    assert flags(b) == [True, False, True, True] and agree(b)
    ts.mark_trainable(b, "mlp")  # a declaration made later applies on top
    assert flags(b) == [False, False, True, True] and agree(b)
    ts.mark_trainable(b, None)  # lifted: back to the method, which the write overrides
    assert flags(b) == [True, False, True, True] and agree(b)
    with ts.freeze(b, "mlp"):
        b.attn.bias.requires_grad_(True)  # inside the block, against the class and the block
        assert flags(b) == [True, True, False, False] and agree(b)
        with ts.freeze_except(b, "mlp.bias"):  # entered later: on top of every write
            assert flags(b) == [False] * 4 and agree(b)
            b(x3())
            assert flags(b) == [False] * 4 and agree(b)
        assert flags(b) == [True, True, False, False] and agree(b)
    assert flags(b) == [True, True, True, True] and agree(b)


def test_a_declaration_made_after_an_unseen_write_applies_on_top_of_it():
    results = []
    for seen in (False, True):
        lin = nn.Linear(2, 2)
        a = nn.Sequential(lin)
        ts.freeze(a)  # torchstruct wrote False
        lin.weight.requires_grad_(True)  # by hand
        if seen:
            ts.attach(a)  # a re-application that changes nothing
        c = nn.Sequential(nn.Linear(2, 2))
        ts.mark_trainable(c)  # made after the write: all of c is frozen
        c.append(lin)
        c(torch.randn(1, 2))
        results.append(flags(c))
    assert results[0] == results[1] == [False] * 4


def test_a_deepcopy_attached_applies_its_declarations_afresh_to_its_own_flags():
    """Documented (docs/freezing.md, copies): a copy carries no history; attached, its
    declarations apply to the flags it has, so a write by hand that overrode a declaration in
    the original does not carry over. Flags and reads agree in both."""
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    ts.mark_trainable(m, "1")
    m[0].weight.requires_grad_(True)
    m(torch.randn(1, 2))
    cp = copy.deepcopy(m)
    assert flags(cp) == flags(m) == [True, False, True, True]  # plain PyTorch until attached
    ts.attach(cp)
    assert flags(cp) == reads(cp) == [False, False, True, True]
    assert flags(m) == reads(m) == [True, False, True, True]


def test_a_deepcopy_made_before_any_write_follows_its_own_declaration_and_writes():
    m = nn.Sequential(Block(), nn.Linear(3, 1))
    ts.mark_trainable(m, "0")
    cp = copy.deepcopy(m)
    ts.attach(cp)
    assert flags(cp) == flags(m) == [False, False, True, True, False, False]
    cp[0].attn.bias.requires_grad_(True)  # a write on the copy: the copy's own
    cp(x3())
    assert flags(cp) == [False, True, True, True, False, False] and agree(cp)
    assert flags(m) == [False, False, True, True, False, False] and agree(m)


def test_a_schedule_stage_change_does_not_freeze_a_parameter_turned_on_by_hand():
    m = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2), "head": nn.Linear(2, 1)})
    s = ts.UnfreezeSchedule(m, {0: "head", 2: "b"})
    m["a"].bias.requires_grad_(True)  # against stage 0: stands
    s.step()  # no milestone: nothing re-applied, the write stays
    assert flags(m) == [False, True, False, False, True, True] and agree(m)
    s.step()  # stage 2: "b" trains too
    assert flags(m) == [False, True, True, True, True, True] and agree(m)


def test_a_schedule_stage_change_inside_a_later_block_keeps_the_block_and_agrees():
    m = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2), "head": nn.Linear(2, 1)})
    s = ts.UnfreezeSchedule(m, {0: "head", 1: "b"})
    m["head"].bias.requires_grad_(False)  # by hand: stays frozen through the stage change
    with ts.unfreeze(m, "a.weight"):
        s.step()
        assert flags(m) == [True, False, True, True, True, False] and agree(m)
        ts.attach(m)  # a re-application changes nothing
        assert flags(m) == [True, False, True, True, True, False] and agree(m)
    assert flags(m) == [False, False, True, True, True, False] and agree(m)


def test_value_and_grad_and_structural_grad_after_a_write_over_a_class_declaration():
    torch.manual_seed(0)
    m = nn.Sequential(Block(), nn.Linear(3, 1))
    ts.attach(m)
    x = x3()
    m[0].attn.weight.requires_grad_(True)
    _, tree = ts.value_and_grad(lambda mm, x: mm(x).sum(), m, x)
    got = ts.tree.to_flat_dict(tree)
    assert sorted(got) == sorted(p for p, _ in ts.trainable_parameters(m))
    assert "0.attn.weight" in got and "0.attn.bias" not in got
    want = torch.autograd.grad(m(x).sum(), [m[0].attn.weight])[0]
    assert torch.allclose(got["0.attn.weight"], want)
    ts.mark_trainable(m[0], "mlp")  # later: freezes attn again
    tree = ts.structural_grad(m, lambda mm: mm(x).sum())
    assert "0.attn.weight" not in ts.tree.to_flat_dict(tree)
    assert agree(m)


def _adamw_pair(m):
    """ts.optim.AdamW on ``m`` and torch.optim.AdamW on a copy, same groups."""
    twin = copy.deepcopy(m)
    groups = ts.param_groups(m, weight_decay=0.1)
    opt = ts.optim.AdamW(groups, lr=0.05)
    names = dict((id(p), n) for n, p in m.named_parameters())
    tp = dict(twin.named_parameters())
    tgroups = [dict(g, params=[tp[names[id(p)]] for p in g["params"]]) for g in groups]
    for g in tgroups:
        g.pop("param_names", None)
    ref = torch.optim.AdamW(tgroups, lr=0.05)
    return twin, opt, ref


def test_ts_adamw_matches_torch_adamw_through_writes_contexts_and_marks_with_stale_grads():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 1))
    twin, opt, ref = _adamw_pair(m)
    x = x3()

    def step():
        for p, q in zip(m.parameters(), twin.parameters()):
            q.requires_grad_(p.requires_grad)
        for model in (m, twin):
            model(x).pow(2).sum().backward()  # grads are never zeroed: stale ones stay
        hidden = {}
        for p, q in zip(m.parameters(), twin.parameters()):
            if not p.requires_grad:  # torch.optim steps a stale grad: hide it from it
                hidden[q], q.grad = q.grad, None
        before = [p.detach().clone() for p in m.parameters()]
        opt.step()
        ref.step()
        for q, g in hidden.items():
            q.grad = g
        for p, q, b in zip(m.parameters(), twin.parameters(), before):
            assert torch.allclose(p, q, atol=1e-6)
            assert torch.equal(p, b) is (not p.requires_grad)  # frozen: not moved at all

    step()
    with ts.freeze(m, "1"):
        m[1].bias.requires_grad_(True)  # by hand inside the block
        step()
        ts.mark_trainable(m[2], "bias")  # later: on top
        step()
    assert flags(m) == [True, True, True, True, False, True]
    step()
    ts.mark_trainable(m[2], None)
    step()
    assert flags(m) == [True] * 6


# --------------------------------------------------------------------- rule 3: sharing models
def test_mark_trainable_reaches_a_model_sharing_a_parameter_it_got_after_its_last_application():
    emb = nn.Embedding(5, 3)
    a = nn.ModuleDict({"emb": emb, "out": nn.Linear(3, 3)})
    b = nn.ModuleDict({"head": nn.Linear(3, 5, bias=False), "mid": nn.Linear(3, 3)})
    ts.attach(a)
    ts.attach(b)
    b["head"].weight = emb.weight  # a tie made after b's last application
    ts.mark_trainable(a, "out")  # a's declaration freezes the embedding
    assert not emb.weight.requires_grad
    assert flags(b) == reads(b) and agree(b) and agree(a)
    ts.mark_trainable(a, None)
    assert emb.weight.requires_grad and flags(b) == reads(b) and agree(a)


def test_a_write_on_a_shared_parameter_wins_over_both_models_earlier_declarations():
    shared = nn.Linear(2, 2)
    a = nn.Sequential(shared, nn.Linear(2, 2))
    b = nn.Sequential(nn.Linear(2, 2), shared)
    ts.mark_trainable(a, "1")
    ts.mark_trainable(b, "0")
    assert not shared.weight.requires_grad
    shared.weight.requires_grad_(True)
    a(torch.randn(1, 2))
    b(torch.randn(1, 2))
    assert shared.weight.requires_grad and agree(a) and agree(b)
    ts.mark_trainable(b, "0")  # b declares again, later: on top, in both models
    assert not shared.weight.requires_grad and agree(a) and agree(b)


class _Declares(nn.Module):
    def __init__(self, shared):
        super().__init__()
        self.shared = shared
        self.extra = nn.Linear(2, 2)

    def trainable(self):
        return ["shared", "extra"]


def test_mark_trainable_refused_by_a_sharing_models_broken_declaration_changes_nothing():
    shared = nn.Linear(2, 2)
    a = nn.Sequential(shared, nn.Linear(2, 2))
    ts.attach(a)
    b = _Declares(shared)
    ts.attach(b)
    del b.extra  # b's declaration names a child that is gone
    with pytest.raises(ValueError, match="extra"):
        ts.mark_trainable(a, "1")  # would freeze the shared layer: b must be applied too
    assert flags(a) == [True] * 4 and flags(b) == [True, True]
    assert "_torchstruct_trainable" not in a.__dict__  # the declaration was not kept
    with pytest.raises(ValueError, match="extra"):
        ts.is_trainable(a, "0.weight")  # a read says so too, and writes nothing
    assert flags(a) == [True] * 4


# --------------------------------------------------------------------- rule 2: compiled code
@STALE_GRAPHS
def test_compiled_training_step_follows_marks_writes_and_contexts_between_steps():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    ts.attach(m)
    x = x3()
    graphs = []

    @torch.compile(backend=counting_aot_eager(graphs))
    def step(x):
        loss = m(x).sum()
        loss.backward()
        return loss

    changes = [
        lambda: ts.mark_trainable(m, "1"),
        lambda: ts.mark_trainable(m, None),
        lambda: m[1].bias.requires_grad_(False),
        lambda: m[1].bias.requires_grad_(True),
    ]
    counts = []
    for i in range(16):
        changes[i % 4]()
        ctx = ts.freeze(m, "0.bias") if i % 3 == 0 else None
        for p in m.parameters():
            p.grad = None
        step(x)
        assert [p.grad is not None for p in m.parameters()] == flags(m) and agree(m)
        want = torch.autograd.grad(m(x).sum(), [p for p in m.parameters() if p.requires_grad])
        got = [p.grad for p in m.parameters() if p.requires_grad]
        assert all(torch.allclose(a, b) for a, b in zip(got, want))
        if ctx is not None:
            ctx.__exit__(None, None, None)
        counts.append(len(graphs))
    assert counts[11] == counts[-1]  # every configuration seen by step 12: no more graphs
    assert flags(m) == [True] * 4


def test_contexts_entered_inside_a_compiled_step_with_a_head_appended_midway():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    ts.attach(m)
    x = x3()
    graphs = []

    @torch.compile(backend=counting_aot_eager(graphs))
    def step(x):
        with ts.freeze(m, "0"):
            loss = m(x).sum()
            loss.backward()
        return loss

    counts = []
    for i in range(8):
        for p in m.parameters():
            p.grad = None
        if i == 3:
            m.append(nn.Linear(1, 1))  # trains: not selected by the block
        step(x)
        assert [p.grad is not None for p in m.parameters()] == [False, False] + [True] * (
            len(m) * 2 - 2)
        assert all(flags(m)) and agree(m)
        counts.append(len(graphs))
    assert counts[4] == counts[-1] and not getattr(m, _state.CHANGED, False)


def test_module_compile_retraces_once_after_a_registration_and_not_for_other_models():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    ts.freeze_except(m, "1")
    graphs = []
    m.compile(backend=counting_backend(graphs))
    x = x3()
    m(x)
    m.append(nn.Linear(1, 1))
    m(x)
    assert not m[2].weight.requires_grad and agree(m)
    settled = len(graphs)
    other = nn.Sequential(nn.Linear(3, 3))
    ts.attach(other)
    for i in range(10):
        m(x)
        other.add_module(f"extra{i}", nn.Linear(1, 1))  # elsewhere: m pays once at most
    m(x)
    assert len(graphs) == settled
    assert not getattr(m, _state.CHANGED, False)


@STALE_GRAPHS
def test_unfreeze_schedule_stages_under_a_compiled_step_then_no_more_graphs():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 1))
    s = ts.UnfreezeSchedule(m, {0: "2", 2: "1", 4: None})
    x = x3()
    graphs = []

    @torch.compile(backend=counting_aot_eager(graphs))
    def step(x):
        loss = m(x).pow(2).sum()
        loss.backward()
        return loss

    counts = []
    for _ in range(10):
        for p in m.parameters():
            p.grad = None
        step(x)
        assert [p.grad is not None for p in m.parameters()] == flags(m) and agree(m)
        s.step()
        counts.append(len(graphs))
    assert all(flags(m))
    assert counts[5] == counts[-1]  # the last stage compiled once


@pytest.mark.parametrize("how", ["in_place", "wrapper"])
def test_fullgraph_forward_is_not_refused_after_a_registration_into_another_model(how):
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    ts.attach(m)
    if how == "in_place":
        m.compile(backend="eager", fullgraph=True)
        call = m
    else:
        call = torch.compile(m, backend="eager", fullgraph=True)
    call(x3())
    other = nn.Sequential(nn.Linear(3, 3))
    ts.attach(other)
    other.append(nn.Linear(3, 3))
    try:
        ts.attach(m)
        call(x3())
    finally:
        ts.attach(other)  # applied: nothing pending is left for later tests


def test_a_failing_application_of_another_model_does_not_break_a_compiled_forward():
    bad = nn.Sequential(nn.Linear(3, 3))
    ts.unfreeze(bad)
    m = nn.Sequential(nn.Linear(3, 1))
    ts.attach(m)
    m.compile(backend="eager")
    x = x3()
    m(x)
    bad.register_parameter("index", nn.Parameter(torch.zeros(2, dtype=torch.long),
                                                 requires_grad=False))
    with pytest.raises(ValueError, match="index"):
        bad(x)  # its own forward: the error is its own
    eager = nn.Sequential(nn.Linear(3, 1))
    ts.attach(eager)
    eager(x)  # an eager forward of another model runs
    try:
        m(x)  # so must a compiled one
    finally:
        del bad._parameters["index"]
        ts.attach(bad)  # applied: nothing pending is left for later tests


def test_functional_call_training_does_not_leave_an_application_pending_forever():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    ts.freeze_except(m, "1")
    x = x3()
    m(x)
    m.append(nn.Linear(1, 1))
    tensors = {k: v.detach().clone().requires_grad_() for k, v in m.named_parameters()}

    @torch.compile(backend="eager")
    def step(p, x):
        return torch.func.functional_call(m, p, (x,)).sum()

    try:
        for _ in range(4):
            step(tensors, x).backward()
        assert all(t.grad is not None for t in tensors.values())
        assert agree(m)
        assert not getattr(m, _state.CHANGED, False)
    finally:
        m(x)  # applied: nothing pending is left for later tests


def test_a_compiled_forward_of_another_model_leaves_a_detached_model_as_eager_code_does():
    results = []
    for compiled in (False, True):
        m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
        ts.freeze_except(m, "1")
        ts.detach_hooks(m)
        other = nn.Sequential(nn.Linear(3, 2))
        ts.attach(other)
        if compiled:
            other.compile(backend="eager")
        other(x3())
        m.append(nn.Linear(1, 1))
        m(x3())
        other(x3())
        results.append(flags(m))
        ts.attach(m)  # applied: nothing pending is left for later tests
    assert results[0] == results[1] == [False, False, True, True, True, True]


@STALE_GRAPHS
def test_torch_compile_wrapper_step_with_a_head_appended_and_contexts_inside_and_outside():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    ts.freeze_except(m, "1")
    cm = torch.compile(m, backend="aot_eager")
    x = x3()
    cm(x).sum().backward()
    assert m[0].weight.grad is None and m[1].weight.grad is not None
    m.append(nn.Linear(3, 1))  # not selected by "1": frozen at the next forward
    for p in m.parameters():
        p.grad = None
    cm(x).sum().backward()
    assert m[2].weight.grad is None and not m[2].weight.requires_grad and agree(m)
    with ts.unfreeze(m, "2"):
        for p in m.parameters():
            p.grad = None
        cm(x).sum().backward()
        assert m[2].weight.grad is not None and m[0].weight.grad is None and agree(m)
    assert not m[2].weight.requires_grad and agree(m)


# ---------------------------------------------------------------------------- real libraries
def test_gpt2_lora_write_by_hand_inside_a_block_with_a_compiled_step():
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=8, n_layer=2, n_head=2, vocab_size=32, n_positions=16)
    torch.manual_seed(0)
    pm = get_peft_model(GPT2LMHeadModel(cfg), LoraConfig(r=2, target_modules=["c_attn"]))
    start = flags(pm)
    attn = pm.base_model.model.transformer.h[1].attn.c_attn
    ids = torch.randint(0, 32, (2, 5))
    graphs = []

    @torch.compile(backend=counting_backend(graphs))
    def step(ids):
        out = pm(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.loss

    with ts.freeze_except(pm, "*.h.1.*"):
        attn.base_layer.bias.requires_grad_(True)  # by hand: trains, against PEFT and block
        assert agree(pm)
        for _ in range(3):
            for p in pm.parameters():
                p.grad = None
            step(ids)
            assert [p.grad is not None for p in pm.parameters()] == flags(pm)
        assert attn.base_layer.bias.grad is not None and attn.base_layer.weight.grad is None
        settled = len(graphs)
        for p in pm.parameters():
            p.grad = None
        step(ids)
        assert len(graphs) == settled
    changed = [n for (n, _), a, b in zip(pm.named_parameters(), start, flags(pm)) if a != b]
    assert changed == ["base_model.model.transformer.h.1.attn.c_attn.base_layer.bias"]
    assert agree(pm)


def test_bert_lora_mark_trainable_on_a_shared_layer_reaches_both_models():
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    pytest.importorskip("transformers")
    from transformers import BertConfig, BertModel

    cfg = BertConfig(hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=16, vocab_size=32, max_position_embeddings=16)
    torch.manual_seed(0)
    pm = get_peft_model(BertModel(cfg), LoraConfig(r=2, target_modules=["query", "value"]))
    probe = nn.ModuleDict({"enc": pm.base_model.model.encoder, "head": nn.Linear(8, 2)})
    ts.attach(pm)
    ts.attach(probe)
    layer = pm.base_model.model.encoder.layer[0]
    ts.mark_trainable(layer, "output")  # layer 0's attention (its LoRA too) frozen in both
    lora = layer.attention.self.query.lora_A["default"].weight
    assert not lora.requires_grad
    assert agree(pm) and agree(probe)
    ts.mark_trainable(layer, None)
    assert lora.requires_grad and agree(pm) and agree(probe)


# ----------------------------------------------------------------------------------- threads
def test_threads_writing_by_hand_marking_and_entering_blocks_on_their_own_models():
    errors = []

    def work(seed):
        try:
            torch.manual_seed(seed)
            m = nn.Sequential(Block(), nn.Linear(3, 1))
            x = x3()
            for i in range(30):
                with ts.freeze(m, "1"):
                    m[0].attn.bias.requires_grad_(True)
                    assert flags(m) == [False, True, True, True, False, False]
                    ts.mark_trainable(m[0], "mlp")
                    assert flags(m) == [False, False, True, True, False, False]
                    ts.mark_trainable(m[0], None)
                    m(x)
                    assert flags(m) == reads(m)
                m[0].attn.bias.requires_grad_(False)
                m(x)
                assert flags(m) == reads(m) == [False, False, True, True, True, True]
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
