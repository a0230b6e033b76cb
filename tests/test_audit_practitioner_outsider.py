"""How fast each part learns, used as a practitioner uses it every day, checked from the outside.

What is checked, every answer against plain PyTorch (``torch.optim`` stepped with per-group
learning rates computed by hand, flags set by hand) or against a brute force written here from
the rule docs/groups.md and docs/schedule.md state:

* ``ts.param_groups``: every parameter in exactly one group (tied ones once, frozen ones
  included), the first rule that selects a parameter wins (all orders of three overlapping
  rules), unique names; ``no_decay="auto"`` against HF ``Trainer.get_decay_parameter_names`` on
  BERT, GPT-2, ViT and Llama built from tiny configs (the same parameters, compared by identity)
  and T5 (the one documented difference: ``relative_attention_bias``); custom norm classes
  (``*RMSNorm``, ``LayerNorm2d``, ``nn.RMSNorm``, a norm holding a projection), a tied bias, a
  model's and a submodule's ``no_weight_decay()`` (paths, prefixes, globs, absent names);
* HF ``Trainer`` given ``ts.optim.AdamW(ts.param_groups(...))`` and
  ``get_cosine_schedule_with_warmup`` against the ``Trainer``'s own AdamW and decay list; a
  ``TrainerCallback`` driving ``ts.UnfreezeSchedule`` with layer-decay groups against a plain
  loop (flags and per-group rates set by hand);
* ``lr_scale`` under ``LambdaLR``, ``OneCycleLR`` (momentum cycling included),
  ``CosineAnnealingWarmRestarts``, ``SequentialLR``, ``ReduceLROnPlateau``, ``CyclicLR`` and HF
  ``get_cosine_schedule_with_warmup``, driving ``ts.optim.AdamW`` / ``ts.optim.SGD``, against
  ``torch.optim`` with each group's ``lr`` set by hand to ``scheduled lr * scale``;
  ``lr_scale=0``: bitwise unchanged, no state, out of the ``max_grad_norm`` norm;
* ``ts.layer_decay`` against timm's formula written by hand (ids 0..L+1,
  ``decay ** (L + 1 - id)``) on BERT (``encoder.layer``), GPT-2 (``transformer.h``, the tied
  output embedding at id 0), ViT, Llama (``model.layers``) and T5 with ``layers=``; a training run
  with the layer-decay groups against ``torch.optim.AdamW`` with per-parameter rates; nested
  stacks (per-expert lists shorter or longer than the stack), two candidate stacks, the model
  itself as the stack, a block listed twice;
* ``ts.UnfreezeSchedule``: flags after every step against the cumulative rule, one optimizer
  built from ``ts.param_groups`` for the whole run (``ts.optim`` and ``torch.optim.AdamW``: a frozen
  parameter gets no state and no weight decay), a frozen BatchNorm against an ``eval()`` twin,
  ``state_dict()`` through ``torch.save``, a resumed run equal bit for bit to an uninterrupted one;
* Lightning: ``configure_optimizers`` returning ``ts.optim.AdamW(ts.param_groups(self, ...))``
  with a per-step ``OneCycleLR`` and a callback driving the schedule, against a plain loop;
* bad input: a clear error, and flags, hooks, parameters, optimizer state and schedule position
  unchanged.

Convention: a test that exposes a defect is kept, minimized, and marked
``@pytest.mark.xfail(strict=True, reason="BUG: what happens; what is expected")``; once the
defect is fixed the test passes, the strict xfail turns into a failure, and the marker has to
go. Limits the documentation states are not treated as defects: the test asserts the
documented behaviour instead.
"""
from __future__ import annotations

import copy
import io
import itertools
import os
import re
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as L

import torchstruct as ts

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    BertConfig, BertForSequenceClassification, BertModel, GPT2Config, GPT2LMHeadModel,
    LlamaConfig, LlamaForCausalLM, T5Config, T5ForConditionalGeneration, Trainer,
    TrainingArguments, ViTConfig, ViTForImageClassification, get_cosine_schedule_with_warmup,
)
from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.set_verbosity_error()


# ----------------------------------------------------------------------------- helpers

def tiny_bert(layers=3):
    torch.manual_seed(0)
    return BertModel(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=layers,
                                num_attention_heads=2, intermediate_size=32,
                                max_position_embeddings=32))


def tiny_gpt2(layers=3):
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=16, n_layer=layers, n_head=2,
                                      n_positions=32, bos_token_id=0, eos_token_id=0))


def tiny_vit(layers=3):
    torch.manual_seed(0)
    return ViTForImageClassification(ViTConfig(image_size=8, patch_size=4, num_channels=3,
                                               hidden_size=16, num_hidden_layers=layers,
                                               num_attention_heads=2, intermediate_size=32,
                                               num_labels=3))


def tiny_llama(layers=3):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=layers, num_attention_heads=2,
                                        num_key_value_heads=1, max_position_embeddings=32,
                                        bos_token_id=0, eos_token_id=0, pad_token_id=0))


def tiny_t5():
    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(vocab_size=50, d_model=16, d_kv=8, d_ff=32,
                                               num_layers=2, num_heads=2,
                                               decoder_start_token_id=0))


HF_MODELS = {"bert": tiny_bert, "gpt2": tiny_gpt2, "vit": tiny_vit, "llama": tiny_llama}


def unique_params(model):
    """Each parameter object once, with its first path (named_parameters() order)."""
    return list(model.named_parameters())


def group_of(groups):
    """id(param) -> the group holding it; asserts that each parameter is in exactly one."""
    where = {}
    for g in groups:
        assert len(g["params"]) == len(g["param_names"])
        for p in g["params"]:
            assert id(p) not in where, "a parameter in two groups"
            where[id(p)] = g
    return where


def flags(model):
    return [p.requires_grad for p in model.parameters()]


def snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def same_bits(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def hook_count(model):
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


# ----------------------------------------------------------------------------- param_groups

@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_auto_no_decay_is_the_hf_trainer_decay_list(name):
    model = HF_MODELS[name]()
    hf = set(Trainer.get_decay_parameter_names(None, model))
    by_path = dict(model.named_parameters(remove_duplicate=False))
    hf_ids = {id(by_path[n]) for n in hf}
    groups = ts.param_groups(model, weight_decay=0.1)
    where = group_of(groups)
    assert set(where) == {id(p) for p in model.parameters()}
    ours = {pid for pid, g in where.items() if g["weight_decay"] != 0.0}
    assert ours == hf_ids
    assert all(g["weight_decay"] in (0.1, 0.0) for g in groups)


def test_auto_no_decay_on_t5_differs_only_by_the_documented_relative_attention_bias():
    model = tiny_t5()
    by_path = dict(model.named_parameters(remove_duplicate=False))
    hf_ids = {id(by_path[n]) for n in Trainer.get_decay_parameter_names(None, model)}
    groups = ts.param_groups(model, weight_decay=0.1)
    ours = {pid for pid, g in group_of(groups).items() if g["weight_decay"] != 0.0}
    extra = {n for n, p in model.named_parameters() if id(p) in ours - hf_ids}
    assert hf_ids - ours == set()
    assert extra and all("relative_attention_bias" in n for n in extra)


def test_trainer_with_ts_optimizer_matches_the_trainers_own_adamw(tmp_path):
    class Data(torch.utils.data.Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(0)
            self.x = torch.randint(0, 50, (16, 6), generator=g)
            self.y = torch.randint(0, 3, (16,), generator=g)

        def __len__(self):
            return 16

        def __getitem__(self, i):
            return {"input_ids": self.x[i], "labels": self.y[i]}

    def model():
        torch.manual_seed(0)
        return BertForSequenceClassification(BertConfig(
            vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=32, max_position_embeddings=16, num_labels=3,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))

    def args():
        return TrainingArguments(
            output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=4,
            learning_rate=1e-2, weight_decay=0.1, warmup_steps=2, lr_scheduler_type="cosine",
            report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no",
            dataloader_num_workers=0, seed=0, disable_tqdm=True, optim="adamw_torch")

    theirs = model()
    Trainer(model=theirs, args=args(), train_dataset=Data()).train()
    ours = model()
    opt = ts.optim.AdamW(ts.param_groups(ours, weight_decay=0.1), lr=1e-2)
    sched = get_cosine_schedule_with_warmup(opt, 2, 6)
    Trainer(model=ours, args=args(), train_dataset=Data(), optimizers=(opt, sched)).train()
    for (n, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)
    assert not same_bits(snapshot(ours), snapshot(model()))  # it trained


def test_trainer_callback_schedule_with_layer_decay_matches_a_plain_loop(tmp_path):
    from transformers import TrainerCallback, get_constant_schedule

    class Data(torch.utils.data.Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(0)
            self.x = torch.randint(0, 50, (16, 6), generator=g)
            self.y = torch.randint(0, 3, (16,), generator=g)

        def __len__(self):
            return 16

        def __getitem__(self, i):
            return {"input_ids": self.x[i], "labels": self.y[i]}

    def model():
        torch.manual_seed(0)
        return BertForSequenceClassification(BertConfig(
            vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=32, max_position_embeddings=16, num_labels=3,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))

    class Drive(TrainerCallback):
        def __init__(self, schedule):
            self.schedule = schedule

        def on_step_end(self, args, state, control, **kwargs):
            while self.schedule.current_step < state.global_step:
                self.schedule.step()

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=4,
                             learning_rate=1e-2, report_to=[], use_cpu=True, save_strategy="no",
                             logging_strategy="no", seed=0, disable_tqdm=True, max_grad_norm=1.0)
    ours = model()
    schedule = ts.UnfreezeSchedule(ours, {0: "classifier", 3: None})
    opt = ts.optim.AdamW(ts.param_groups(ours, *ts.layer_decay(ours, 0.5), weight_decay=0.1),
                         lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Trainer(model=ours, args=args, train_dataset=Data(),
                optimizers=(opt, get_constant_schedule(opt)), callbacks=[Drive(schedule)]).train()
    assert schedule.current_step == 6 and all(flags(ours))

    plain = model()
    groups = ts.param_groups(plain, *ts.layer_decay(plain, 0.5), weight_decay=0.1)
    for g in groups:
        g["lr"] = 1e-2 * g.pop("lr_scale", 1.0)
    popt = torch.optim.AdamW(groups, lr=1e-2, foreach=False)
    loader = Trainer(model=plain, args=args, train_dataset=Data()).get_train_dataloader()
    batches = [b for _ in range(2) for b in loader]
    plain.requires_grad_(False)
    plain.classifier.requires_grad_(True)
    plain.train()
    for step in range(6):
        if step == 3:
            plain.requires_grad_(True)
        popt.zero_grad()
        plain(**batches[step]).loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in plain.parameters() if p.grad is not None], 1.0)
        popt.step()
    for (n, p), q in zip(ours.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)


class MyRMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))


class LayerNorm2d(nn.LayerNorm):
    pass


class AdaLayerNorm(nn.Module):
    """A norm that holds a projection: only its direct parameters are exempt."""

    def __init__(self, d):
        super().__init__()
        self.proj = nn.Linear(d, 2 * d)
        self.weight = nn.Parameter(torch.ones(d))


class Normalizer(nn.Module):  # not a norm by its name
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))


class Block(nn.Module):
    def __init__(self, d=4):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(d))
        self.fc = nn.Linear(d, d)
        self.pos = nn.Parameter(torch.zeros(2, d))

    def no_weight_decay(self):
        return ["pos", "*gamma", "not_there"]


class Zoo(nn.Module):
    def __init__(self):
        super().__init__()
        self.cls = nn.Parameter(torch.zeros(4))
        self.stem = nn.Linear(4, 4)
        self.norms = nn.ModuleDict(dict(a=MyRMSNorm(4), b=LayerNorm2d(4), c=AdaLayerNorm(4),
                                        d=Normalizer(4), e=nn.RMSNorm(4), f=nn.GroupNorm(1, 4),
                                        g=nn.BatchNorm1d(4)))
        self.blocks = nn.Sequential(Block(), Block())
        self.lstm = nn.LSTM(4, 4)
        self.head = nn.Linear(4, 2)
        self.head.bias = self.cls  # a tied parameter: its second path is a bias

    def no_weight_decay(self):
        return {"stem", "absent.module"}


def zoo_expected_no_decay(model):
    """Brute force of docs/groups.md's rule, path by path (any path of a tied parameter)."""
    norm_paths = {"norms.a", "norms.b", "norms.c", "norms.e", "norms.f", "norms.g"}
    out = set()
    for path, p in model.named_parameters(remove_duplicate=False):
        parent, _, leaf = path.rpartition(".")
        bias = leaf == "bias" or leaf.endswith("_bias") or leaf.startswith("bias_")
        named = (path.startswith("stem.") or re.fullmatch(r"blocks\.\d\.(pos|gamma)", path))
        if bias or parent in norm_paths or named:
            out.add(id(p))
    return out


def test_auto_no_decay_custom_norms_no_weight_decay_and_a_tied_bias_brute_force():
    model = Zoo()
    model.blocks[1].fc.weight.requires_grad_(False)  # frozen ones are grouped too
    groups = ts.param_groups(model, weight_decay=0.3)
    where = group_of(groups)
    assert set(where) == {id(p) for p in model.parameters()}
    exempt = {pid for pid, g in where.items() if g["weight_decay"] == 0.0}
    assert exempt == zoo_expected_no_decay(model)
    assert [g["name"] for g in groups] == ["default", "default (no decay)"]
    for g in groups:  # params in named_parameters() order, names their paths
        order = [n for n, p in unique_params(model) if id(p) in {id(q) for q in g["params"]}]
        assert g["param_names"] == order
    assert ts.is_norm(model.norms.a) and not ts.is_norm(model.norms.d)


def test_no_decay_none_and_selector_replace_the_automatic_rule():
    model = Zoo()
    everything = ts.param_groups(model, weight_decay=0.3, no_decay=None)
    assert len(everything) == 1 and everything[0]["weight_decay"] == 0.3
    timm_like = ts.param_groups(model, weight_decay=0.3, no_decay=lambda path, p: p.ndim <= 1)
    exempt = {pid for pid, g in group_of(timm_like).items() if g["weight_decay"] == 0.0}
    assert exempt == {id(p) for p in model.parameters() if p.ndim <= 1}


def test_first_rule_wins_in_every_order_brute_force():
    model = Zoo()
    rules = [("blocks", {"lr": 0.1}), ("*.weight", {"lr": 0.2, "weight_decay": 0.5}),
             (re.compile(r".*\.(fc|proj)\..*"), {"lr": 0.3, "name": "fc"})]

    def selected(sel, path):
        if isinstance(sel, re.Pattern):
            return bool(sel.fullmatch(path))
        import fnmatch
        return fnmatch.fnmatchcase(path, sel) or fnmatch.fnmatchcase(path, sel + ".*")

    for order in itertools.permutations(rules):
        groups = ts.param_groups(model, *order, weight_decay=0.01)
        where = group_of(groups)
        assert len({g["name"] for g in groups}) == len(groups)
        paths_of = {}
        for path, p in model.named_parameters(remove_duplicate=False):
            paths_of.setdefault(id(p), []).append(path)
        for path, p in unique_params(model):
            lr = next((opt["lr"] for sel, opt in order
                       if any(selected(sel, q) for q in paths_of[id(p)])), None)
            assert where[id(p)].get("lr") == lr, (order, path)


def test_param_groups_feed_torch_optimizers_and_name_the_state_dict():
    model = tiny_gpt2(2)
    groups = ts.param_groups(model, ("lm_head", {"lr": 1e-2}), weight_decay=0.1)
    opt = torch.optim.AdamW(groups, lr=1e-3)
    sd = opt.state_dict()
    assert [g["name"] for g in sd["param_groups"]] == [g["name"] for g in groups]
    # the tied output embedding is selected through its second path and listed at its first
    assert groups[0]["param_names"] == ["transformer.wte.weight"]


# ----------------------------------------------------------------------------- lr_scale

def scheduled_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 2))


SCHEDULERS = {
    "lambda": lambda o: L.LambdaLR(o, lambda s: 1 / (1 + s)),
    "onecycle": lambda o: L.OneCycleLR(o, max_lr=0.05, total_steps=12),
    "warm_restarts": lambda o: L.CosineAnnealingWarmRestarts(o, T_0=3, T_mult=2, eta_min=1e-4),
    "sequential": lambda o: L.SequentialLR(o, [L.LinearLR(o, 0.1, 1.0, total_iters=3),
                                               L.ExponentialLR(o, 0.9)], milestones=[3]),
    "plateau": lambda o: L.ReduceLROnPlateau(o, factor=0.5, patience=0),
    "cyclic": lambda o: L.CyclicLR(o, base_lr=0.005, max_lr=0.05, step_size_up=3),
    "hf_cosine": lambda o: get_cosine_schedule_with_warmup(o, 3, 12),
}
RULES = [("0", {"lr_scale": 0.25}), ("2", {"lr_scale": 0.5}), ("3", {"lr_scale": 0.0})]


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("sched", sorted(SCHEDULERS))
def test_lr_scale_under_schedulers_equals_torch_with_hand_computed_rates(kind, sched):
    ours, theirs = scheduled_net(), scheduled_net()
    g_ours = ts.param_groups(ours, *RULES, weight_decay=0.1)
    g_theirs = [{k: v for k, v in g.items() if k != "lr_scale"}
                for g in ts.param_groups(theirs, *RULES, weight_decay=0.1)]
    scales = [g.get("lr_scale", 1.0) for g in g_ours]
    assert sorted(set(scales)) == [0.0, 0.25, 0.5, 1.0]
    shadow_params = [{"params": [torch.zeros(1, requires_grad=True)]} for _ in g_ours]
    if kind == "adamw":
        a = ts.optim.AdamW(g_ours, lr=0.05)
        b = torch.optim.AdamW(g_theirs, lr=0.05, foreach=False)
        shadow = torch.optim.AdamW(shadow_params, lr=0.05)
    else:
        a = ts.optim.SGD(g_ours, lr=0.05, momentum=0.9, weight_decay=0.01)
        b = torch.optim.SGD(g_theirs, lr=0.05, momentum=0.9, weight_decay=0.01, foreach=False)
        shadow = torch.optim.SGD(shadow_params, lr=0.05, momentum=0.9)
    sa, ss = SCHEDULERS[sched](a), SCHEDULERS[sched](shadow)
    zero = [p for g, s in zip(b.param_groups, scales) if s == 0 for p in g["params"]]
    frozen_before = [p.detach().clone() for g, s in zip(a.param_groups, scales) if s == 0
                     for p in g["params"]]
    torch.manual_seed(1)
    xs = [torch.randn(6, 4) for _ in range(12)]
    for x in xs:
        for gb, gs, s in zip(b.param_groups, shadow.param_groups, scales):
            gb["lr"] = gs["lr"] * s
            for key in ("betas", "momentum"):
                if key in gs:
                    gb[key] = gs[key]
        for net, opt in ((ours, a), (theirs, b)):
            opt.zero_grad()
            net(x).pow(2).mean().backward()
        for p in zero:  # torch skips a parameter without a gradient
            p.grad = None
        a.step()
        b.step()
        shadow.step()
        if sched == "plateau":
            sa.step(1.0)
            ss.step(1.0)
        else:
            sa.step()
            ss.step()
        assert len({g["lr"] for g in a.param_groups}) == 1  # one schedule, unscaled
    assert [g.get("lr_scale", 1.0) for g in a.param_groups] == scales
    for (n, p), q in zip(ours.named_parameters(), theirs.parameters()):
        if kind == "sgd":
            assert torch.equal(p, q), n
        else:
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=n)
    after = [p for g, s in zip(a.param_groups, scales) if s == 0 for p in g["params"]]
    assert same_bits(after, frozen_before) and not any(p in a.state for p in after)


def test_lr_scale_zero_is_outside_the_clip_norm():
    torch.manual_seed(0)
    ours = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    theirs = copy.deepcopy(ours)
    a = ts.optim.SGD(ts.param_groups(ours, ("0", {"lr_scale": 0.0}), no_decay=None),
                     lr=0.1, max_grad_norm=0.01)
    b = torch.optim.SGD(theirs[1].parameters(), lr=0.1)
    x = torch.randn(4, 3)
    for net in (ours, theirs):
        net(x).pow(2).sum().backward()
    total = torch.nn.utils.clip_grad_norm_(list(theirs[1].parameters()), 0.01)
    a.step()
    b.step()
    torch.testing.assert_close(a.last_grad_norm, total)
    assert same_bits(ours.parameters(), theirs.parameters())


def test_a_negative_lr_from_a_scheduler_changes_nothing():
    model = scheduled_net()
    opt = ts.optim.AdamW(ts.param_groups(model, ("0", {"lr_scale": 0.5})), lr=0.01)
    sched = L.LambdaLR(opt, lambda s: 1.0 if s == 0 else -1.0)
    x = torch.randn(3, 4)
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] < 0
    before, state = snapshot(model), copy.deepcopy(opt.state_dict()["state"])
    opt.zero_grad()
    model(x).sum().backward()
    with pytest.raises(ValueError, match="lr"):
        opt.step()
    assert same_bits(model.parameters(), before)
    after = opt.state_dict()["state"]
    assert after.keys() == state.keys()
    for k in state:
        assert all(torch.equal(state[k][s], after[k][s]) for s in state[k])


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "0.5", None])
def test_a_bad_lr_scale_written_later_is_refused_before_any_write(bad):
    model = scheduled_net()
    opt = ts.optim.SGD(ts.param_groups(model, ("2", {"lr_scale": 0.5})), lr=0.1, momentum=0.9)
    x = torch.randn(3, 4)
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    before = snapshot(model)
    bufs = {p: opt.state[p]["momentum_buffer"].clone() for p in model.parameters()}
    opt.param_groups[0]["lr_scale"] = bad
    opt.zero_grad()
    model(x).sum().backward()
    with pytest.raises((ValueError, TypeError), match="lr_scale"):
        opt.step()
    assert same_bits(model.parameters(), before)
    assert all(torch.equal(opt.state[p]["momentum_buffer"], b) for p, b in bufs.items())


# ----------------------------------------------------------------------------- layer_decay

# The parameters before the stack (layer id 0) and the stack, as a practitioner writes them.
HF_LAYOUT = {
    "bert": (("embeddings.",), "encoder.layer"),
    "gpt2": (("transformer.wte.", "transformer.wpe."), "transformer.h"),
    "vit": (("vit.embeddings.",), None),
    "llama": (("model.embed_tokens.",), "model.layers"),
}


def timm_scale(path, before, stack, n_layers, decay):
    if path.startswith(before):
        layer_id = 0
    else:
        m = re.match(re.escape(stack) + r"\.(\d+)\.", path)
        layer_id = int(m.group(1)) + 1 if m else n_layers + 1
    return decay ** (n_layers + 1 - layer_id)


@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_layer_decay_is_timms_formula_on_hf_models(name):
    model = HF_MODELS[name](3)
    before, stack = HF_LAYOUT[name]
    if stack is None:  # ViT: wherever this version of transformers keeps its layers
        stack = next(n for n, m in model.named_modules()
                     if isinstance(m, nn.ModuleList) and len(m) == 3)
    decay = 0.65
    rules = ts.layer_decay(model, decay)  # found automatically
    assert [o["name"] for _, o in rules][1:4] == [f"{stack}.{i}" for i in range(3)]
    assert rules == ts.layer_decay(model, decay, layers=stack)
    groups = ts.param_groups(model, *rules, weight_decay=0.05)
    where = group_of(groups)
    for path, p in unique_params(model):
        assert where[id(p)]["lr_scale"] == timm_scale(path, before, stack, 3, decay), path
    if name == "gpt2":  # the output embedding is the input one: layer 0
        assert where[id(model.lm_head.weight)]["lr_scale"] == decay ** 4


def test_layer_decay_on_t5_encoder_with_layers():
    model = tiny_t5()
    with pytest.raises(ValueError, match="encoder.block.*decoder.block.*layers="):
        ts.layer_decay(model, 0.5)
    groups = ts.param_groups(model, *ts.layer_decay(model, 0.5, layers="encoder.block"))
    where = group_of(groups)
    for path, p in unique_params(model):
        assert where[id(p)]["lr_scale"] == timm_scale(path, ("shared.",), "encoder.block", 2,
                                                      0.5), path


def test_layer_decay_training_equals_torch_with_per_parameter_rates():
    ours, theirs = tiny_llama(2), tiny_llama(2)
    decay = 0.5
    groups = ts.param_groups(ours, *ts.layer_decay(ours, decay), weight_decay=0.1)
    a = ts.optim.AdamW(groups, lr=1e-2)
    sa = get_cosine_schedule_with_warmup(a, 1, 5)
    plain = []
    for path, p in theirs.named_parameters():
        exempt = path.endswith("norm.weight") or path.endswith("bias")
        plain.append({"params": [p], "scale": timm_scale(path, ("model.embed_tokens.",),
                                                         "model.layers", 2, decay),
                      "weight_decay": 0.0 if exempt else 0.1})
    b = torch.optim.AdamW(plain, lr=1e-2, foreach=False)
    sb = get_cosine_schedule_with_warmup(b, 1, 5)
    torch.manual_seed(3)
    for _ in range(4):
        ids = torch.randint(0, 50, (2, 6))
        for g in b.param_groups:
            g["lr"] = sb.get_last_lr()[0] * g["scale"]
        for net, opt in ((ours, a), (theirs, b)):
            opt.zero_grad()
            net(input_ids=ids, labels=ids).loss.backward()
            opt.step()
        sa.step()
        for g in b.param_groups:
            g["lr"] = g["initial_lr"]
        sb.step()
    for (n, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=n)


class Expert(nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(experts))


class MoE(nn.Module):
    def __init__(self, blocks, experts):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList(Expert(experts) for _ in range(blocks))
        self.head = nn.Linear(4, 2)


def test_layer_decay_nested_stacks():
    model = MoE(3, 2)  # per-expert lists shorter than the stack: ignored
    scale = {n: g["lr_scale"] for g in ts.param_groups(model, *ts.layer_decay(model, 0.5))
             for n in g["param_names"]}
    for path, _ in model.named_parameters():
        assert scale[path] == timm_scale(path, ("embed.",), "blocks", 3, 0.5), path
    longer = MoE(2, 4)
    with pytest.raises(ValueError, match="layers="):
        ts.layer_decay(longer, 0.5)
    rules = ts.layer_decay(longer, 0.5, layers="blocks")
    assert [o["lr_scale"] for _, o in rules] == [0.125, 0.25, 0.5, 1.0]


def test_layer_decay_two_candidate_stacks_raise_naming_both_and_change_nothing():
    model = nn.ModuleDict({"enc": nn.ModuleList(nn.Linear(2, 2) for _ in range(2)),
                           "dec": nn.ModuleList(nn.Linear(2, 2) for _ in range(3))})
    before = flags(model), hook_count(model)
    with pytest.raises(ValueError) as e:
        ts.layer_decay(model, 0.5)
    assert "'enc'" in str(e.value) and "'dec'" in str(e.value) and "layers=" in str(e.value)
    assert (flags(model), hook_count(model)) == before
    rules = ts.layer_decay(model, 0.5, layers=model.dec)
    scale = {n: g["lr_scale"] for g in ts.param_groups(model, *rules) for n in g["param_names"]}
    assert scale["enc.0.weight"] == 0.5 ** 4 and scale["dec.0.weight"] == 0.5 ** 3
    assert scale["dec.2.bias"] == 0.5


def test_layer_decay_model_itself_and_a_block_listed_twice():
    blocks = [nn.Linear(2, 2) for _ in range(3)]
    assert [o["lr_scale"] for _, o in ts.layer_decay(nn.Sequential(*blocks), 0.5)] == \
        [0.125, 0.25, 0.5]
    shared = nn.Sequential(blocks[0], blocks[1], blocks[0])  # L counts distinct blocks
    assert [(o["name"], o["lr_scale"]) for _, o in ts.layer_decay(shared, 0.5)] == \
        [("0", 0.25), ("1", 0.5)]


@pytest.mark.parametrize("decay, error", [(0, ValueError), (1.5, ValueError),
                                          (float("nan"), ValueError), ("0.5", TypeError),
                                          (None, TypeError), (True, TypeError)])
def test_layer_decay_bad_decay(decay, error):
    with pytest.raises(error, match="decay"):
        ts.layer_decay(tiny_bert(2), decay)


# ----------------------------------------------------------------------------- UnfreezeSchedule

def ladder():
    torch.manual_seed(0)
    return nn.ModuleDict({
        "embed": nn.Embedding(20, 8),
        "blocks": nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
                                for _ in range(3)),
        "head": nn.Linear(8, 20),
    })


def ladder_forward(model, tokens):
    h = model["embed"](tokens)
    for block in model["blocks"]:
        h = torch.tanh(block(h))
    return model["head"](h)


MILESTONES = {0: "head", 2: "blocks.2", 4: ["blocks.1", "blocks.0"], 6: None}


def expected_flags(model, step, milestones=MILESTONES):
    reached = [milestones[s] for s in sorted(milestones) if s <= step]
    if any(r is None for r in reached):
        return [True] * len(flags(model))
    prefixes = [x for r in reached for x in (r if isinstance(r, list) else [r])]
    return [any(n == p or n.startswith(p + ".") for p in prefixes)
            for n, _ in model.named_parameters()]


def test_unfreeze_schedule_flags_follow_the_cumulative_rule():
    model = ladder()
    schedule = ts.UnfreezeSchedule(model, MILESTONES)
    for step in range(9):
        assert schedule.current_step == step
        assert flags(model) == expected_flags(model, step), step
        schedule.step()
    assert schedule.selectors is None and schedule.stage == 4


def test_unfreeze_schedule_without_milestone_zero_freezes_everything():
    model = ladder()
    schedule = ts.UnfreezeSchedule(model, {2: "head"})
    assert not any(flags(model)) and schedule.selectors == ()
    schedule.step()
    schedule.step()
    assert flags(model) == expected_flags(model, 0)


def test_hand_frozen_parameter_stays_frozen_after_everything():
    model = ladder()
    model["embed"].weight.requires_grad_(False)
    schedule = ts.UnfreezeSchedule(model, {0: "head", 1: None})
    schedule.step()
    assert flags(model) == [n != "embed.weight" for n, _ in model.named_parameters()]


def run_ladder(model, schedule, opt, sched, batches):
    for tokens in batches:
        opt.zero_grad()
        logits = ladder_forward(model, tokens)
        nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
        opt.step()
        sched.step()
        schedule.step()


def build_ladder_run(model, kind):
    schedule = ts.UnfreezeSchedule(model, MILESTONES)
    groups = ts.param_groups(model, ("head", {"lr": 2e-2}), weight_decay=0.1)
    if kind == "ts":
        opt = ts.optim.AdamW(groups, lr=1e-2)
    else:
        opt = torch.optim.AdamW(groups, lr=1e-2, foreach=False)
    sched = L.OneCycleLR(opt, max_lr=[2e-2, 2e-2, 1e-2, 1e-2], total_steps=20)
    return schedule, opt, sched


BATCHES = [torch.randint(0, 20, (4, 5), generator=torch.Generator().manual_seed(i))
           for i in range(9)]


@pytest.mark.parametrize("kind", ["ts", "torch"])
def test_unfreeze_schedule_resume_equals_an_uninterrupted_run_bitwise(kind):
    full = ladder()
    run_ladder(full, *build_ladder_run(full, kind), BATCHES)

    first = ladder()
    schedule, opt, sched = build_ladder_run(first, kind)
    run_ladder(first, schedule, opt, sched, BATCHES[:5])
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "optim": opt.state_dict(),
                "schedule": schedule.state_dict(), "sched": sched.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)

    resumed = ladder()
    schedule, opt, sched = build_ladder_run(resumed, kind)
    resumed.load_state_dict(saved["model"])
    schedule.load_state_dict(saved["schedule"])
    assert flags(resumed) == flags(first) == expected_flags(resumed, 5)
    opt.load_state_dict(saved["optim"])
    sched.load_state_dict(saved["sched"])
    run_ladder(resumed, schedule, opt, sched, BATCHES[5:])
    assert schedule.current_step == 9
    assert same_bits(resumed.parameters(), full.parameters())


def test_unfreeze_schedule_ts_optim_equals_torch_adamw_and_frozen_get_nothing():
    a, b = ladder(), ladder()
    ra, rb = build_ladder_run(a, "ts"), build_ladder_run(b, "torch")
    embed_before = a["embed"].weight.detach().clone()
    run_ladder(a, *ra, BATCHES[:4])
    run_ladder(b, *rb, BATCHES[:4])
    for opt in (ra[1], rb[1]):  # frozen so far: no state, no weight decay
        assert a["embed"].weight not in opt.state and b["embed"].weight not in opt.state
        assert a["blocks"][0][0].weight not in opt.state
    assert torch.equal(a["embed"].weight, embed_before)
    assert torch.equal(b["embed"].weight, embed_before)
    run_ladder(a, *ra, BATCHES[4:])
    run_ladder(b, *rb, BATCHES[4:])
    assert a["embed"].weight in ra[1].state and b["embed"].weight in rb[1].state
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=n)


def test_unfreeze_schedule_frozen_batchnorm_equals_an_eval_twin():
    def make():
        torch.manual_seed(0)
        return nn.ModuleDict({"body": nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6)),
                              "head": nn.Linear(6, 2)})

    def forward(m, x):
        return m["head"](torch.tanh(m["body"](x)))

    ours, twin = make(), make()
    schedule = ts.UnfreezeSchedule(ours, {0: "head", 3: None})
    a = torch.optim.AdamW(ts.param_groups(ours, weight_decay=0.1), lr=1e-2, foreach=False)
    b = torch.optim.AdamW(ts.param_groups(twin, weight_decay=0.1), lr=1e-2, foreach=False)
    twin["body"].requires_grad_(False)
    twin["body"][1].eval()
    torch.manual_seed(1)
    for step in range(6):
        if step == 3:
            twin["body"].requires_grad_(True)
            twin["body"][1].train()
        x = torch.randn(8, 4)
        for net, opt in ((ours, a), (twin, b)):
            opt.zero_grad()
            forward(net, x).pow(2).mean().backward()
            opt.step()
        schedule.step()
    assert same_bits(ours.parameters(), twin.parameters())
    assert same_bits(ours.buffers(), twin.buffers())


def test_unfreeze_schedule_copy_governs_no_model():
    model = ladder()
    schedule = ts.UnfreezeSchedule(model, MILESTONES)
    schedule.step()
    buf = io.BytesIO()
    torch.save(schedule, buf)
    buf.seek(0)
    copied = torch.load(buf, weights_only=False)
    assert copied.state_dict() == schedule.state_dict() == {"step": 1, "milestones": [0, 2, 4, 6]}
    with pytest.raises(RuntimeError, match="copy"):
        copied.step()
    assert flags(model) == expected_flags(model, 1)


@pytest.mark.parametrize("milestones, error", [
    ({0: "head", 5: "blocks.7"}, ValueError),
    ({0: "head", "3": "blocks.0"}, TypeError),
    ({0: "head", -1: "blocks.0"}, ValueError),
    ({0: []}, ValueError),
    ({}, ValueError),
    ({0: {"head"}}, TypeError),
    ({0: "head", 2: nn.Linear(8, 8)}, ValueError),
])
def test_bad_milestones_raise_and_change_no_flag(milestones, error):
    model = ladder()
    model["blocks"][1][0].weight.requires_grad_(False)
    outer = ts.freeze(model, "embed")  # an active permanent context too
    before = flags(model), hook_count(model)
    with pytest.raises(error):
        ts.UnfreezeSchedule(model, milestones)
    assert (flags(model), hook_count(model)) == before
    del outer


@pytest.mark.parametrize("state", [
    {"step": 3, "milestones": [0, 2, 4]},
    {"step": -1, "milestones": [0, 2, 4, 6]},
    {"step": "3", "milestones": [0, 2, 4, 6]},
    {"step": 3},
    {"step": 3, "milestones": [0, 2, 4, 6], "extra": 1},
    {"step": 3, "milestones": "0,2,4,6"},
    [3, [0, 2, 4, 6]],
])
def test_bad_schedule_state_changes_nothing(state):
    model = ladder()
    schedule = ts.UnfreezeSchedule(model, MILESTONES)
    schedule.step()
    before = flags(model), schedule.state_dict(), schedule.stage
    with pytest.raises((ValueError, TypeError)):
        schedule.load_state_dict(state)
    assert (flags(model), schedule.state_dict(), schedule.stage) == before
    schedule.step()
    assert flags(model) == expected_flags(model, 2)


# ----------------------------------------------------------------------------- Lightning

def test_lightning_configure_optimizers_with_param_groups_and_a_schedule_callback(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")

    class Finetune(pl.Callback):
        def __init__(self, milestones):
            self.milestones, self.schedule = milestones, None

        def setup(self, trainer, pl_module, stage):
            if self.schedule is None:
                self.schedule = ts.UnfreezeSchedule(pl_module, self.milestones)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            while self.schedule.current_step < trainer.global_step:
                self.schedule.step()

        def state_dict(self):
            return {"schedule": self.schedule.state_dict()}

        def load_state_dict(self, state):
            self.schedule.load_state_dict(state["schedule"])

    def nets():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Tanh()), nn.Linear(8, 2)

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.backbone, self.head = nets()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.head(self.backbone(x)), y)

        def configure_optimizers(self):
            opt = ts.optim.AdamW(ts.param_groups(self, ("backbone", {"lr_scale": 0.1}),
                                                 weight_decay=0.05), lr=1e-2)
            sched = L.OneCycleLR(opt, max_lr=1e-2, total_steps=8)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    g = torch.Generator().manual_seed(0)
    xs, ys = torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=4)
    module, callback = Net(), Finetune({0: "head", 3: None})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl.Trainer(max_steps=8, accelerator="cpu", logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False,
                   callbacks=[callback], default_root_dir=str(tmp_path)).fit(module, data)
    assert callback.schedule.current_step == 8 and all(flags(module))

    # the same run by hand: torch.optim.AdamW, flags and per-group rates set by hand
    backbone, head = nets()
    plain = nn.ModuleDict({"backbone": backbone, "head": head})
    groups = ts.param_groups(plain, ("backbone", {"lr_scale": 0.1}), weight_decay=0.05)
    scales = [gr.pop("lr_scale", 1.0) for gr in groups]
    opt = torch.optim.AdamW(groups, lr=1e-2, foreach=False)
    shadow = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=1e-2)
    shadow_sched = L.OneCycleLR(shadow, max_lr=1e-2, total_steps=8)
    backbone.requires_grad_(False)
    for step in range(8):
        if step == 3:
            backbone.requires_grad_(True)
        for gr, s in zip(opt.param_groups, scales):
            gr["lr"] = shadow.param_groups[0]["lr"] * s
            gr["betas"] = shadow.param_groups[0]["betas"]
        x, y = xs[4 * step:4 * step + 4], ys[4 * step:4 * step + 4]
        opt.zero_grad()
        nn.functional.cross_entropy(head(backbone(x)), y).backward()
        opt.step()
        shadow.step()
        shadow_sched.step()
    for (n, p), q in zip(module.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=n)


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("call, error, words", [
    (lambda m: ts.param_groups(m, ("haed", {"lr": 1e-3})), ValueError, "'head'"),
    (lambda m: ts.param_groups(m, ("head", {"weight_decy": 0.1})), ValueError, "weight_decay"),
    (lambda m: ts.param_groups(m, ("head", {"lr": -1.0})), ValueError, "lr"),
    (lambda m: ts.param_groups(m, ("head", {"lr_scale": float("nan")})), ValueError, "lr_scale"),
    (lambda m: ts.param_groups(m, ("head", {"params": []})), ValueError, "params"),
    (lambda m: ts.param_groups(m, "head"), TypeError, "pair"),
    (lambda m: ts.param_groups(m, ("head", 0.1)), TypeError, "options"),
    (lambda m: ts.param_groups(m, ([], {"lr": 1.0})), ValueError, "empty"),
    (lambda m: ts.param_groups(m, (nn.Linear(2, 2), {"lr": 1.0})), ValueError, "Linear"),
    (lambda m: ts.param_groups(m, weight_decay=-0.1), ValueError, "weight_decay"),
    (lambda m: ts.param_groups(m, no_decay="bais"), ValueError, "no_decay"),
    (lambda m: ts.param_groups(m, no_decay=[]), ValueError, "empty"),
    (lambda m: ts.param_groups(m, strict=None), TypeError, "strict"),
    (lambda m: ts.layer_decay(m, 0.5, layers="blocks.9"), ValueError, "closest"),
    (lambda m: ts.layer_decay(m, 0.5, layers="head"), ValueError, "Linear"),
    (lambda m: ts.layer_decay(m, 0.5, layers=3), TypeError, "layers"),
])
def test_bad_group_input_raises_clearly_and_touches_nothing(call, error, words):
    model = ladder()
    model["blocks"][0][0].bias.requires_grad_(False)
    before = flags(model), hook_count(model), snapshot(model)
    with pytest.raises(error) as e:
        call(model)
    assert words in str(e.value)
    assert flags(model) == before[0] and hook_count(model) == before[1]
    assert same_bits(model.parameters(), before[2])


def test_no_weight_decay_returning_a_str_is_refused():
    model = ladder()
    model.no_weight_decay = lambda: "embed"
    with pytest.raises(TypeError, match="str"):
        ts.param_groups(model)


def test_read_only_helpers_write_no_flag_and_install_no_hook():
    model = tiny_bert(2)
    model.pooler.dense.weight.requires_grad_(False)
    before = flags(model), hook_count(model)
    ts.param_groups(model, *ts.layer_decay(model, 0.7), weight_decay=0.1)
    assert (flags(model), hook_count(model)) == before
