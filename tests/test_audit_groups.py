"""Param groups, layer decay, unfreezing schedules and trainable-only checkpoints, tried as a
suspicious user would: every answer compared with a brute force, with PyTorch or with the
libraries the practice comes from (HF Trainer's no-decay list, timm's layer-decay formula).

- ``ts.param_groups``: every parameter in exactly one group (tied ones once, frozen ones
  included), the first rule that selects it wins, ``no_decay="auto"`` against a brute force over
  norm classes, biases and ``no_weight_decay()`` names; errors name the rule.
- ``ts.layer_decay``: ``decay ** (L + 1 - id)`` against a brute-force layer id, on hand-made
  stacks and HF models built from configs; an ambiguous stack is an error, never a guess.
- ``ts.UnfreezeSchedule``: a resumed run equals an uninterrupted one, step by step; bad input
  changes nothing.
- ``ts.state_dict`` / ``ts.load_state_dict``: exactly the trainable parameters (tied once) and
  their modules' buffers; every check made before any write.

A test marked ``xfail(strict=True)`` reproduces a case that goes wrong today; its reason says
what happens and what is expected.
"""
import copy
import io
import os
import re

import pytest
import torch
from torch import nn

import torchstruct as ts

os.environ.setdefault("HF_HUB_OFFLINE", "1")


# ---------------------------------------------------------------------------- models and oracles
class Net(nn.Module):
    """Every kind of parameter param_groups has to place: tied, frozen, norm, bias, 1-d."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.pos = nn.Parameter(torch.zeros(4))
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"fc": nn.Linear(4, 4), "norm": nn.LayerNorm(4)}) for _ in range(3))
        self.gn = nn.GroupNorm(2, 4)
        self.bn = nn.BatchNorm1d(4)
        self.rms = nn.RMSNorm(4)
        self.ln_nobias = nn.LayerNorm(4, bias=False)
        self.ln_plain = nn.LayerNorm(4, elementwise_affine=False)
        self.inst = nn.InstanceNorm1d(4, affine=True)
        self.lrn = nn.LocalResponseNorm(2)
        self.lstm = nn.LSTM(4, 4)
        self.head = nn.Linear(4, 10)
        self.head.weight = self.embed.weight  # tied: canonical path embed.weight
        self.shared = self.blocks[0]  # a module reachable by two paths


def canonical(model):
    """{id: first path} by brute force over named_parameters(remove_duplicate=False)."""
    out = {}
    for path, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), path)
    return out


def placed(groups):
    """{path: group} over all groups, asserting that no path appears twice."""
    out = {}
    for g in groups:
        assert len(g["params"]) == len(g["param_names"])
        for name in g["param_names"]:
            assert name not in out, name
            out[name] = g
    return out


def norm_exempt_brute_force(model):
    """Brute force of no_decay="auto" without no_weight_decay(): a parameter whose last name is
    or ends/starts with bias, or a direct parameter of a norm (torch's classes or a class name
    ending in Norm)."""
    norms = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm,
             nn.LocalResponseNorm)
    out = set()
    for mpath, mod in model.named_modules(remove_duplicate=False):
        is_norm = isinstance(mod, norms) or re.search(r"Norm(\d*d|\d+P?|Gated)?$",
                                                      type(mod).__name__)
        for name, p in mod.named_parameters(recurse=False):
            if is_norm or name == "bias" or name.endswith("_bias") or name.startswith("bias_"):
                out.add(id(p))
    return out


def tiny_bert():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=40, hidden_size=8, num_hidden_layers=3,
                                  num_attention_heads=2, intermediate_size=8,
                                  max_position_embeddings=16)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(cfg)


def tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=3, n_embd=8, n_head=2, vocab_size=40, n_positions=16,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def layer_ids_brute_force(model, stack):
    """timm/BEiT layer ids by path: before the stack 0, block i -> i + 1, after L + 1; a tied
    parameter at its first path."""
    n = len(model.get_submodule(stack))
    out, seen = {}, False
    for path, _ in model.named_parameters():
        m = re.match(re.escape(stack) + r"\.(\d+)\.", path)
        if m:
            seen, layer = True, int(m.group(1)) + 1
        else:
            layer = n + 1 if seen else 0
        out[path] = layer
    return out, n


# ---------------------------------------------------------------------------- ts.layer_decay
class Stage(nn.Module):
    def __init__(self, depth):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(depth))


class Hierarchical(nn.Module):
    """Swin / ResNet shape: a list of stages, the third one longer than the list itself."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(2, 2)
        self.layers = nn.ModuleList(Stage(d) for d in (2, 2, 6, 2))
        self.head = nn.Linear(2, 2)


class EncoderWithLinearHead(nn.Module):
    """Two encoder layers and a head written as three Linears: two stacks side by side."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(4, 2, 8), 2,
                                         enable_nested_tensor=False)
        self.head = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1))


def test_layer_decay_stages_holding_a_longer_stack_is_an_error_not_a_guess():
    model = Hierarchical()
    with pytest.raises(ValueError, match=r"'layers'.*'layers\.2\.blocks'.*layers="):
        ts.layer_decay(model, 0.5)
    rules = ts.layer_decay(model, 0.5, layers="layers")  # named: coarse, per stage
    assert [o["lr_scale"] for _, o in rules] == [0.5 ** 5, 0.5 ** 4, 0.5 ** 3, 0.5 ** 2, 0.5,
                                                 1.0]


def test_layer_decay_two_stacks_of_different_sizes_side_by_side_is_an_error():
    with pytest.raises(ValueError, match=r"'enc\.layers', 'head'.*layers="):
        ts.layer_decay(EncoderWithLinearHead(), 0.5)
    with pytest.raises(ValueError, match=r"'encoder\.layers', 'decoder\.layers'.*layers="):
        ts.layer_decay(nn.Transformer(8, 2, 2, 3, 16, batch_first=True), 0.5)  # 2 and 3 layers


def test_layer_decay_clip_towers_of_different_depth_is_an_error():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.CLIPConfig(
        text_config=dict(hidden_size=8, intermediate_size=8, num_hidden_layers=2,
                         num_attention_heads=2, vocab_size=40, max_position_embeddings=16),
        vision_config=dict(hidden_size=8, intermediate_size=8, num_hidden_layers=4,
                           num_attention_heads=2, image_size=8, patch_size=4))
    model = transformers.CLIPModel(cfg)
    with pytest.raises(ValueError, match="'text_model.encoder.layers', "
                                         "'vision_model.encoder.layers'"):
        ts.layer_decay(model, 0.5)


def test_layer_decay_ignores_shorter_lists_inside_the_blocks():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))

    model = nn.Sequential(nn.Linear(2, 2), nn.ModuleList(Block() for _ in range(4)))
    assert [o["name"] for _, o in ts.layer_decay(model, 0.5)] == [
        "layer 0", "1.0", "1.1", "1.2", "1.3"]


def scales_of(groups):
    return {name: g.get("lr_scale", 1.0) for name, g in placed(groups).items()}


@pytest.mark.parametrize("which", ["bert", "gpt2", "vit", "torch_encoder"])
def test_layer_decay_matches_timms_rule_on_real_stacks(which):
    """scale == decay ** (L + 1 - id) with the brute-force id, every parameter in one group."""
    decay = 0.7
    if which == "bert":
        model, stack = tiny_bert(), "bert.encoder.layer"
    elif which == "gpt2":
        model, stack = tiny_gpt2(), "transformer.h"
    elif which == "vit":
        transformers = pytest.importorskip("transformers")
        model = transformers.ViTForImageClassification(transformers.ViTConfig(
            hidden_size=8, num_hidden_layers=3, num_attention_heads=2, intermediate_size=8,
            image_size=8, patch_size=4, num_labels=2))
        stack = next(n for n, m in model.named_modules()
                     if isinstance(m, nn.ModuleList) and len(m) == 3)
    else:
        model = nn.Sequential(nn.Embedding(7, 4), nn.TransformerEncoder(
            nn.TransformerEncoderLayer(4, 2, 8), 3, enable_nested_tensor=False), nn.Linear(4, 7))
        stack = "1.layers"
    groups = ts.param_groups(model, *ts.layer_decay(model, decay), weight_decay=0.1)
    ids, n = layer_ids_brute_force(model, stack)
    got = scales_of(groups)
    assert set(got) == set(ids)  # every canonical path once
    for path, layer in ids.items():
        assert got[path] == pytest.approx(decay ** (n + 1 - layer), rel=1e-12), path
    if which == "gpt2":  # the tied head lives at the embedding: id 0
        assert got["transformer.wte.weight"] == pytest.approx(decay ** (n + 1))
        assert "lm_head.weight" not in got


# ---------------------------------------------------------------------------- ts.param_groups
@pytest.mark.parametrize("no_decay", ["auto", None, "blocks.*.norm", lambda path, p: p.ndim <= 1])
def test_param_groups_partition_every_parameter_once_brute_force(no_decay):
    model = Net()
    ts.freeze(model, "lstm", "blocks.1")  # frozen parameters are grouped too
    rules = [("blocks.1", {"lr": 1.0}), (model.blocks[2].fc.weight, {"lr": 2.0}),
             (re.compile(r"blocks\.\d\.fc\..*"), {"lr": 3.0}), ("head", {"lr": 4.0}),
             ("blocks", {"lr": 5.0, "weight_decay": 0.3})]
    groups = ts.param_groups(model, *rules, weight_decay=0.1, no_decay=no_decay)
    where = placed(groups)
    first = canonical(model)
    assert sorted(where) == sorted(first.values())  # each object once, at its first path
    params = [p for g in groups for p in g["params"]]
    assert len({id(p) for p in params}) == len(params) == len(first)
    for g in groups:  # paths and objects agree
        assert [first[id(p)] for p in g["params"]] == g["param_names"]
    # first rule wins, by brute force: the index of the first rule whose selection holds it
    for path, g in where.items():
        p = model.get_parameter(path)
        k = next((i for i, (sel, _) in enumerate(rules)
                  if any(q is p for _, q in ts.select(model, sel, strict=False))), None)
        assert g.get("lr") == (None if k is None else rules[k][1]["lr"]), path
    assert len({g["name"] for g in groups}) == len(groups)


def test_param_groups_auto_no_decay_matches_brute_force_on_every_norm_class():
    model = Net()
    groups = ts.param_groups(model, weight_decay=0.1)
    exempt = norm_exempt_brute_force(model)
    by_path = placed(groups)
    for path, g in by_path.items():
        p = model.get_parameter(path)
        assert (g["weight_decay"] == 0.0) == (id(p) in exempt), path
    for path in ("rms.weight", "gn.weight", "gn.bias", "bn.weight", "ln_nobias.weight", "inst.bias",
                 "lstm.bias_ih_l0", "blocks.0.norm.weight"):
        assert by_path[path]["weight_decay"] == 0.0, path
    for path in ("embed.weight", "pos", "lstm.weight_ih_l0", "blocks.2.fc.weight"):
        assert by_path[path]["weight_decay"] == 0.1, path


def test_param_groups_hf_norm_classes_built_from_config():
    transformers = pytest.importorskip("transformers")
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=40, hidden_size=8, intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2))
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=40, d_model=8, d_kv=4, d_ff=8, num_layers=1, num_heads=2))
    for model in (llama, t5):
        by_path = placed(ts.param_groups(model, weight_decay=0.1))
        exempt = norm_exempt_brute_force(model)
        assert exempt  # the RMSNorm / T5LayerNorm weights are found by class name
        for path, g in by_path.items():
            p = model.get_parameter(path)
            assert (g["weight_decay"] == 0.0) == (id(p) in exempt), path


def test_param_groups_gated_and_1p_norms_of_hf_models_are_norms():
    transformers = pytest.importorskip("transformers")
    from transformers.models.mamba2.modeling_mamba2 import MambaRMSNormGated
    from transformers.models.nemotron.modeling_nemotron import NemotronLayerNorm1P

    model = nn.ModuleDict({"mixer": nn.ModuleDict({"norm": MambaRMSNormGated(4, 4),
                                                   "proj": nn.Linear(4, 4, bias=False)}),
                           "ln": NemotronLayerNorm1P(4)})
    assert ts.is_norm(model["mixer"]["norm"]) and ts.is_norm(model["ln"])
    zero = {n for g in ts.param_groups(model, weight_decay=0.1) if g["weight_decay"] == 0.0
            for n in g["param_names"]}
    assert zero == {"mixer.norm.weight", "ln.weight", "ln.bias"}
    # names that only contain Norm are not norms
    for name in ("RobertaPreLayerNormEmbeddings", "Normalizer", "NormalEstimator"):
        assert not ts.is_norm(type(name, (nn.Module,), {})())


@pytest.mark.parametrize("make", [tiny_bert, tiny_gpt2])
def test_param_groups_agree_with_hf_trainer_on_the_trained_parameters(make):
    transformers = pytest.importorskip("transformers")
    model = make()
    args = transformers.TrainingArguments(output_dir="/tmp/unused", report_to=[],
                                          weight_decay=0.1, use_cpu=True)
    trainer = transformers.Trainer(model=model, args=args)
    decayed = set(trainer.get_decay_parameter_names(model))
    groups = ts.param_groups(model, weight_decay=0.1)
    ours = {n for g in groups if g["weight_decay"] == 0.1 for n in g["param_names"]}
    assert ours == decayed & set(placed(groups))  # HF lists tied aliases too; we list them once


def test_param_groups_options_pass_through_to_torch_and_ts_optimizers_and_a_scheduler():
    model = Net()
    groups = ts.param_groups(model, ("blocks", {"betas": (0.5, 0.6), "lr_scale": 0.5,
                                                "name": "body", "eps": 1e-6}),
                             weight_decay=0.1)
    assert groups[0]["betas"] == (0.5, 0.6) and groups[0]["lr_scale"] == 0.5
    assert groups[0]["name"] == "body" and groups[1]["name"] == "body (no decay)"
    for cls in (torch.optim.AdamW, ts.optim.AdamW):
        opt = cls(ts.param_groups(model, ("blocks", {"betas": (0.5, 0.6), "lr_scale": 0.5}),
                                  weight_decay=0.1), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
        opt.step()  # no gradients: nothing moves
        sched.step()
        assert [g["lr"] for g in opt.param_groups] == [5e-4] * len(opt.param_groups)
        assert opt.param_groups[0]["betas"] == (0.5, 0.6)
        assert opt.param_groups[0]["lr_scale"] == 0.5
        assert opt.state_dict()["param_groups"][0]["param_names"] == groups[0]["param_names"]


def test_param_groups_frozen_parameters_are_grouped_and_left_untouched_by_the_optimizers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    ts.freeze(model, "0")
    before = model[0].weight.detach().clone()
    model[0].weight.grad = torch.ones(3, 3)  # a stale gradient
    opt = ts.optim.AdamW(ts.param_groups(model, weight_decay=0.5), lr=0.1)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    assert torch.equal(model[0].weight, before) and model[0].weight not in opt.state
    ts.unfreeze(model, "0")  # no add_param_group needed
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    assert not torch.equal(model[0].weight, before)


def test_param_groups_no_weight_decay_names_globs_and_submodules():
    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.gamma = nn.Parameter(torch.ones(2, 2))
            self.w = nn.Parameter(torch.ones(2, 2))

        def no_weight_decay(self):
            return ["gamma"]  # relative to this module

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.cls_token = nn.Parameter(torch.zeros(1, 2))
            self.blocks = nn.ModuleList(Inner() for _ in range(2))
            self.extra = nn.ModuleDict({"a": nn.Linear(2, 2, bias=False),
                                        "b": nn.Linear(2, 2, bias=False)})
            self.proj = nn.Linear(2, 2, bias=False)

        def no_weight_decay(self):
            return {"cls_token", "extra.*.weight", "nothing_like_this"}  # timm allows patterns

    model = Outer()
    zero = {n for g in ts.param_groups(model, weight_decay=0.1) if g["weight_decay"] == 0.0
            for n in g["param_names"]}
    assert zero == {"cls_token", "blocks.0.gamma", "blocks.1.gamma", "extra.a.weight",
                    "extra.b.weight"}


def test_param_groups_no_weight_decay_returning_a_str_is_refused():
    model = nn.Sequential(nn.Linear(2, 2))
    model.no_weight_decay = lambda: "0.weight"  # would otherwise be read letter by letter
    with pytest.raises(TypeError, match="no_weight_decay.*str '0.weight'"):
        ts.param_groups(model)


def test_param_groups_errors_name_the_rule_or_no_decay():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
    with pytest.raises(ValueError, match=r"rule 1: selector 'haed'.*closest"):
        ts.param_groups(model, ("0", {}), ("haed", {}))
    with pytest.raises(ValueError, match=r"rule 0: selector '1' names only modules without "
                                         r"parameters.*selects no parameter"):
        ts.param_groups(model, ("1", {}))  # a module without parameters
    with pytest.raises(ValueError, match=r"rule 0 \('<lambda>'\) selects no parameter"):
        ts.param_groups(model, (lambda path, p: False, {}))
    with pytest.raises(TypeError, match="rule 0: selector must be"):
        ts.param_groups(model, ({"0"}, {}))
    with pytest.raises(ValueError, match=r"no_decay: selector '2.bais'.*'2.bias'"):
        ts.param_groups(model, no_decay="2.bais")
    # the docstring: a no_decay selector that selects nothing raises, as a rule does
    with pytest.raises(ValueError, match=r"no_decay: selector '1' names only modules.*selects "
                                         r"no parameter"):
        ts.param_groups(model, no_decay="1")
    with pytest.raises(ValueError, match=r"no_decay \('<lambda>'\) selects no parameter"):
        ts.param_groups(model, no_decay=lambda path, p: p.ndim == 3)
    groups = ts.param_groups(model, ("1", {}), no_decay=lambda path, p: False, strict=False)
    assert [g["name"] for g in groups] == ["default"]


def test_param_groups_overlapping_and_duplicate_rules_first_wins_names_stay_unique():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    groups = ts.param_groups(model, ("0", {"lr": 1.0}), ("0", {"lr": 2.0}),
                             ("*", {"lr": 3.0}), no_decay=None)
    assert [(g["name"], g["lr"], g["param_names"]) for g in groups] == [
        ("0", 1.0, ["0.weight", "0.bias"]), ("*", 3.0, ["1.weight", "1.bias"])]
    groups = ts.param_groups(model, ("0", {"name": "default"}), ("1.weight", {"name": "x"}),
                             ("1.bias", {"name": "x"}))
    names = [g["name"] for g in groups]
    assert len(set(names)) == len(names) and names[0] == "default"


def test_param_groups_tied_parameter_follows_any_of_its_paths():
    model = Net()
    groups = ts.param_groups(model, ("head", {"lr": 9.0}), no_decay=None)
    assert groups[0]["param_names"] == ["embed.weight", "head.bias"]
    assert groups[0]["params"][0] is model.embed.weight
    # the block reachable as blocks.0 and shared: once, at blocks.0
    where = placed(groups)
    assert "shared.fc.weight" not in where and "blocks.0.fc.weight" in where


def test_param_groups_peft_lora_model():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_gpt2(), peft.LoraConfig(r=2, target_modules=["c_attn"],
                                                              fan_in_fan_out=True))
    groups = ts.param_groups(model, ("*lora_*", {"lr": 1e-2}), weight_decay=0.1)
    where = placed(groups)
    assert sorted(where) == sorted(canonical(model).values())
    lora = [n for n in where if "lora_" in n]
    assert len(lora) == 6 and all(where[n]["lr"] == 1e-2 for n in lora)
    assert all(where[n]["weight_decay"] == 0.1 for n in lora)  # 2-d adapter weights decay
    opt = ts.optim.AdamW(groups, lr=1e-3)
    model(input_ids=torch.randint(0, 40, (2, 5))).logits.sum().backward()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt.step()
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)


# ---------------------------------------------------------------------------- ts.UnfreezeSchedule
def tower():
    torch.manual_seed(0)
    return nn.ModuleDict({"embed": nn.Embedding(6, 4),
                          "blocks": nn.ModuleList(nn.Linear(4, 4) for _ in range(3)),
                          "head": nn.Linear(4, 6)})


MILESTONES = {0: "head", 2: "blocks.2", 3: ["blocks.1", re.compile(r"blocks\.0\.bias")],
              6: None}


def flags(model):
    return [p.requires_grad for p in model.parameters()]


def expected_flags(model, step):
    """Brute force: the union of the selections of every milestone <= step."""
    reached = [sel for s, sel in MILESTONES.items() if s <= step]
    if any(sel is None for sel in reached):
        return [True] * len(flags(model))
    on = {id(p) for sel in reached for _, p in ts.select(model, sel)}
    return [id(p) in on for p in model.parameters()]


def test_schedule_counts_like_an_lr_scheduler_and_follows_the_brute_force():
    model = tower()
    schedule = ts.UnfreezeSchedule(model, MILESTONES)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lr_sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    for step in range(9):
        assert schedule.current_step == lr_sched.last_epoch == step
        assert flags(model) == expected_flags(model, step), step
        opt.step()
        lr_sched.step()
        schedule.step()


@pytest.mark.parametrize("stop", [0, 1, 2, 3, 5, 6, 8])
def test_schedule_resume_equals_an_uninterrupted_run(stop):
    model = tower()
    schedule = ts.UnfreezeSchedule(model, MILESTONES)
    trace = []
    for _ in range(9):
        trace.append(flags(model))
        schedule.step()
    first = tower()
    s1 = ts.UnfreezeSchedule(first, MILESTONES)
    for _ in range(stop):
        s1.step()
    buf = io.BytesIO()
    torch.save(s1.state_dict(), buf)
    buf.seek(0)
    fresh = tower()
    resumed = ts.UnfreezeSchedule(fresh, MILESTONES)
    resumed.load_state_dict(torch.load(buf))
    assert flags(fresh) == trace[stop]  # applied at once, before any forward
    assert resumed.stage == s1.stage and resumed.selectors == s1.selectors
    for step in range(stop, 9):
        assert flags(fresh) == trace[step], step
        resumed.step()


def test_schedule_bad_milestones_raise_and_change_nothing():
    model = tower()
    with ts.freeze(model, "embed"):
        before = flags(model)
        for bad, error, words in [
            ({-1: "head"}, ValueError, "negative"), ({1.0: "head"}, TypeError, "integers"),
            ({"1": "head"}, TypeError, "integers"), ({0: "head", 4: "blokcs.1"}, ValueError,
                                                     "milestone 4.*'blocks"),
            ({0: []}, ValueError, "empty"), ({0: {"head"}}, TypeError, "milestone 0"),
            ({0: nn.Linear(2, 2)}, ValueError, "milestone 0.*not a submodule"),
            ({}, ValueError, "empty"), ([(0, "head")], TypeError, "mapping"),
        ]:
            with pytest.raises(error, match=words):
                ts.UnfreezeSchedule(model, bad)
            assert flags(model) == before, bad
    assert all(flags(model))


def test_schedule_load_state_dict_bad_state_changes_nothing():
    model = tower()
    schedule = ts.UnfreezeSchedule(model, MILESTONES)
    schedule.step()
    schedule.step()
    before = flags(model), schedule.current_step, schedule.stage
    for bad in [{"step": -1, "milestones": [0, 2, 3, 6]}, {"step": 1.5, "milestones": [0, 2, 3, 6]},
                {"step": torch.tensor(1.5), "milestones": [0, 2, 3, 6]},
                {"step": 4, "milestones": 7}, {"step": 4, "milestones": [0, 2, "3", 6]},
                {"step": 4, "milestones": [0, 2, 6]}, {"step": True, "milestones": [0, 2, 3, 6]},
                {"step": 4}, None]:
        with pytest.raises(ValueError, match="load_state_dict"):
            schedule.load_state_dict(bad)
        assert (flags(model), schedule.current_step, schedule.stage) == before, bad
    schedule.load_state_dict({"step": torch.tensor(4), "milestones": (0, 2, 3, 6)})
    assert schedule.current_step == 4 and type(schedule.current_step) is int


def test_schedule_with_an_optimizer_built_from_param_groups():
    model = tower()
    schedule = ts.UnfreezeSchedule(model, {0: "head", 1: None})
    opt = ts.optim.AdamW(ts.param_groups(model, ("embed", {"lr_scale": 0.5}),
                                         weight_decay=0.1), lr=0.1)
    tokens = torch.randint(0, 6, (3, 2))

    def forward():
        h = model["embed"](tokens)
        for block in model["blocks"]:
            h = block(h)
        return model["head"](h).sum()

    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.zero_grad()
    forward().backward()
    opt.step()
    schedule.step()
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, start[n])}
    assert moved == {"head.weight", "head.bias"}
    opt.zero_grad()
    forward().backward()
    opt.step()
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, start[n])}
    assert moved == set(start)  # everything joined without add_param_group


def test_schedule_inside_a_context_and_a_context_inside_it():
    model = tower()
    with ts.freeze(model, "head"):
        schedule = ts.UnfreezeSchedule(model, {0: "head", 1: None})
        assert not any(flags(model))  # the enclosing freeze keeps the head frozen
        schedule.step()
        assert not model["head"].weight.requires_grad and model["embed"].weight.requires_grad
    assert all(flags(model))
    schedule.close()
    assert all(flags(model))


# ---------------------------------------------------------------------------- checkpoints
class Ckpt(nn.Module):
    """Tied weights, a module used twice, norms with and without parameters, buffers at the
    root and non-persistent ones."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.bn = nn.BatchNorm1d(4)
        self.stats = nn.BatchNorm1d(4, affine=False)  # statistics only
        self.inst = nn.InstanceNorm1d(4)  # no parameters, no statistics
        self.body = nn.Linear(4, 4)
        self.body.register_buffer("scale", torch.ones(4))
        self.body.register_buffer("cache", torch.zeros(4), persistent=False)
        self.ln = nn.LayerNorm(4)
        self.again = self.ln
        self.out = nn.Linear(4, 6, bias=False)
        self.out.weight = self.embed.weight
        self.register_buffer("root", torch.zeros(2))

    def forward(self, idx):
        h = self.embed(idx).mean(1)
        return self.out(self.again(self.ln(self.body(self.stats(self.bn(h))))))


def checkpoint_brute_force(model):
    """Keys of ts.state_dict by brute force: trainable parameters at their first path, and the
    persistent buffers of modules owning a trainable parameter directly or of parameter-less
    norms tracking statistics; each tensor once, in model.state_dict() order."""
    keep, seen = set(), set()
    for mpath, mod in model.named_modules():
        own = list(mod.parameters(recurse=False))
        stats = (isinstance(mod, nn.modules.batchnorm._NormBase) and mod.track_running_stats
                 and not own)
        for name, p in mod.named_parameters(recurse=False):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                keep.add(f"{mpath}.{name}" if mpath else name)
        if stats or any(p.requires_grad for p in own):
            for name, b in mod.named_buffers(recurse=False):
                if name not in mod._non_persistent_buffers_set and id(b) not in seen:
                    seen.add(id(b))
                    keep.add(f"{mpath}.{name}" if mpath else name)
    return [k for k in model.state_dict() if k in keep]


@pytest.mark.parametrize("frozen", [(), ("embed",), ("bn", "body"), ("ln",), ("*",)])
def test_checkpoint_keys_match_brute_force(frozen):
    model = Ckpt()
    if frozen:
        ts.freeze(model, *frozen)
    state = ts.state_dict(model)
    assert list(state) == checkpoint_brute_force(model)
    for path, p in model.named_parameters(remove_duplicate=False):  # frozen ones absent
        assert (path in state) == (p.requires_grad and canonical(model)[id(p)] == path), path
    for k, t in state.items():  # shares storage, detached
        assert not t.requires_grad and t.data_ptr() == model.state_dict()[k].data_ptr()
    if not frozen:
        assert "out.weight" not in state and "again.weight" not in state  # tied once
        assert "root" not in state and "body.cache" not in state and "body.scale" in state


def test_checkpoint_round_trip_torch_save_and_deepcopy():
    torch.manual_seed(0)
    model = Ckpt()
    ts.freeze(model, "embed")
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randint(0, 6, (5, 3))).sum().backward()
        opt.step()
    twin = copy.deepcopy(model)  # a copy: plain PyTorch, flags copied
    assert list(ts.state_dict(twin)) == list(ts.state_dict(model))
    buf = io.BytesIO()
    torch.save(ts.state_dict(model), buf)
    buf.seek(0)
    torch.manual_seed(0)
    fresh = Ckpt()  # same embedding (same seed), everything else reloaded
    ts.freeze(fresh, "embed")
    assert ts.load_state_dict(fresh, torch.load(buf)) == ([], [])
    for k, v in model.state_dict().items():
        if k != "root":
            assert torch.equal(fresh.state_dict()[k], v), k
    model.eval(), fresh.eval()
    idx = torch.randint(0, 6, (2, 3))
    assert torch.equal(model(idx), fresh(idx))


def state_snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def same_state(model, snap):
    return all(torch.equal(v, snap[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("bad", [
    ("ln.wieght", torch.ones(4), "'ln.wieght'.*closest.*'ln.weight'"),
    ("bn.weight", torch.ones(5), r"'bn.weight': shape \(5,\)"),
    ("bn.num_batches_tracked", torch.tensor(1.0), "dtype torch.float32"),
    ("body.cache", torch.ones(4), "'body.cache' is not a parameter or buffer"),
    ("again.weight", torch.full((4,), 7.0), "same tensor .tied."),
    ("body.weight", torch.ones(4, 4).to_sparse(), "layout"),
    ("body.weight", torch.empty(4, 4, device="meta"), "meta"),
    ("body.weight", [[1.0] * 4] * 4, "expected a tensor"),
])
@pytest.mark.parametrize("strict", [True, False])
def test_checkpoint_bad_entry_anywhere_writes_nothing(bad, strict):
    torch.manual_seed(0)
    model = Ckpt()
    good = {k: torch.full_like(v, 3) for k, v in ts.state_dict(model).items()}
    key, value, words = bad
    for where in ("first", "last"):
        state = dict(good)
        state.pop(key, None)
        state = {key: value, **state} if where == "first" else {**state, key: value}
        snap = state_snapshot(model)
        with pytest.raises(ValueError, match=words):
            ts.load_state_dict(model, state, strict=strict)
        assert same_state(model, snap), where


def test_checkpoint_missing_keys_strict_and_not():
    model = Ckpt()
    state = {k: torch.full_like(v, 2) for k, v in ts.state_dict(model).items()}
    del state["bn.running_var"]
    snap = state_snapshot(model)
    with pytest.raises(ValueError, match=r"missing 1 key.*'bn.running_var'.*strict=False"):
        ts.load_state_dict(model, state)
    assert same_state(model, snap)
    got = ts.load_state_dict(model, state, strict=False)
    assert got.missing_keys == ["bn.running_var"] and got.unexpected_keys == []
    assert torch.equal(model.bn.running_var, snap["bn.running_var"])
    assert torch.equal(model.bn.weight, torch.full((4,), 2.0))
    # a tied parameter given under its other path counts as present
    state["bn.running_var"] = torch.ones(4)
    state["out.weight"] = state.pop("embed.weight")
    assert ts.load_state_dict(model, state) == ([], [])
    assert torch.equal(model.embed.weight, torch.full((6, 4), 2.0))
    # a frozen parameter may be given (a full state dict loads), it is not required
    ts.freeze(model, "body")
    assert "body.weight" not in ts.state_dict(model)
    assert ts.load_state_dict(model, model.state_dict()) == ([], [])


def test_checkpoint_model_built_under_inference_mode_refused_before_any_write():
    with torch.inference_mode():
        model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    state = {k: torch.ones_like(v.clone()) for k, v in model.state_dict().items()}
    with torch.inference_mode():
        snap = state_snapshot(model)
    with pytest.raises(ValueError, match="inference_mode"):
        ts.load_state_dict(model, state)
    with torch.inference_mode():
        assert same_state(model, snap)
        ts.load_state_dict(model, state)  # inside it, it loads
        assert torch.equal(model[1].weight, torch.ones(2, 2))


def test_checkpoint_peft_adapters_round_trip():
    peft = pytest.importorskip("peft")

    def wrapped():
        return peft.get_peft_model(tiny_gpt2(), peft.LoraConfig(
            r=2, target_modules=["c_attn"], fan_in_fan_out=True, init_lora_weights=False))

    model = wrapped()
    state = ts.state_dict(model)
    assert list(state) == checkpoint_brute_force(model)
    assert set(state) == {n for n, p in model.named_parameters() if p.requires_grad}
    again = wrapped()
    with torch.no_grad():
        for name, p in again.named_parameters():
            if "lora_" in name:
                p.add_(1.0)  # other adapter weights
    ids = torch.randint(0, 40, (1, 4))
    model.eval(), again.eval()  # no dropout
    assert not torch.equal(model(input_ids=ids).logits, again(input_ids=ids).logits)
    ts.load_state_dict(again, state)
    assert torch.equal(model(input_ids=ids).logits, again(input_ids=ids).logits)


def test_param_groups_tensor_lr_as_torch_optimizers_take_it():
    model = nn.Sequential(nn.Linear(2, 2))
    lr = torch.tensor(0.01)
    groups = ts.param_groups(model, ("0.weight", {"lr": lr}))
    assert groups[0]["lr"] is lr  # kept as given
    for cls in (torch.optim.AdamW, ts.optim.AdamW):
        cls(ts.param_groups(model, ("0.weight", {"lr": lr})), lr=0.1)
    for bad, error in [(torch.tensor(-1.0), ValueError), (torch.tensor(float("nan")), ValueError),
                       (torch.ones(2), TypeError), (torch.tensor(True), TypeError)]:
        with pytest.raises(error, match="rule 0: lr"):
            ts.param_groups(model, ("0.weight", {"lr": bad}))


def test_layer_decay_named_stack_without_parameters_is_an_error():
    model = nn.Sequential(nn.Linear(2, 2), nn.ModuleList(), nn.ModuleList([nn.ReLU(), nn.ReLU()]),
                          nn.Linear(2, 2))
    for stack in ("1", "2"):  # all parameters would land in "layer 0" at decay ** 1
        with pytest.raises(ValueError, match=f"stack '{stack}' has no parameters"):
            ts.layer_decay(model, 0.5, layers=stack)


# ---------------------------------------------------------------------------- ts.summary
def test_summary_counts_match_brute_force_and_write_nothing():
    model = Net()
    ts.freeze(model, "blocks.1", "lstm")
    before = flags(model)
    s = ts.summary(model)
    assert flags(model) == before
    unique = {id(p): p for p in model.parameters()}.values()
    assert s.counts == (sum(p.numel() for p in unique if p.requires_grad),
                        sum(p.numel() for p in unique))
    rows = {r.path: r for r in s.rows}
    for name, child in model.named_children():  # per child: its parameters not seen earlier
        if name == "shared":
            assert rows[name].tied_to == "blocks.0"
            continue
        seen = {id(p) for earlier, c in model.named_children() if earlier != name
                for p in c.parameters()
                if list(dict(model.named_children())).index(earlier)
                < list(dict(model.named_children())).index(name)}
        own = [p for p in child.parameters() if id(p) not in seen]
        row = rows[name]
        assert (row.trainable, row.total) == (sum(p.numel() for p in own if p.requires_grad),
                                              sum(p.numel() for p in own)), name
    assert rows["head.weight"].tied_to == "embed.weight"
    assert str(s).splitlines()[-1].startswith("trainable ")


def test_layer_decay_block_names_with_glob_characters_are_names():
    from collections import OrderedDict

    stack = nn.Sequential(OrderedDict([("a[1]", nn.Linear(2, 2)), ("a1", nn.Linear(2, 2)),
                                       ("b*", nn.Linear(2, 2))]))
    model = nn.Sequential(nn.Linear(2, 2), stack)
    groups = ts.param_groups(model, *ts.layer_decay(model, 0.5, layers="1"))
    ids, n = layer_ids_brute_force(model, "1")
    order = {name: i for i, name in enumerate(stack._modules)}  # ids by position, not digits
    for path in ids:
        if path.startswith("1."):
            ids[path] = order[path.split(".")[1]] + 1
    assert scales_of(groups) == {path: 0.5 ** (n + 1 - layer) for path, layer in ids.items()}


def test_param_groups_no_decay_selector_replaces_auto_and_none_decays_everything():
    model = Net()
    groups = ts.param_groups(model, weight_decay=0.1, no_decay="blocks.*.fc.bias")
    zero = {n for g in groups if g["weight_decay"] == 0.0 for n in g["param_names"]}
    assert zero == {"blocks.0.fc.bias", "blocks.1.fc.bias", "blocks.2.fc.bias"}
    groups = ts.param_groups(model, ("head", {"lr": 1.0}), weight_decay=0.1, no_decay=None)
    assert [g["name"] for g in groups] == ["head", "default"]
    assert all(g["weight_decay"] == 0.1 for g in groups)
    groups = ts.param_groups(model, no_decay=None)  # no weight_decay=: the key is left out
    assert len(groups) == 1 and "weight_decay" not in groups[0]


def test_schedule_strict_false_allows_a_selector_that_matches_nothing():
    model = tower()
    with pytest.raises(ValueError, match="milestone 2.*'blokcs.1'"):
        ts.UnfreezeSchedule(model, {0: "head", 2: "blokcs.1"})
    schedule = ts.UnfreezeSchedule(model, {0: "head", 2: "blokcs.1"}, strict=False)
    schedule.step()
    schedule.step()
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["head.weight",
                                                                        "head.bias"]
    schedule.close()


def test_param_groups_parametrized_biases_and_norm_weights_are_not_decayed():
    from torch.nn.utils import parametrize
    from torch.nn.utils.parametrizations import weight_norm

    class Same(nn.Module):
        def forward(self, x):
            return x

    model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2), nn.Linear(2, 2))
    parametrize.register_parametrization(model[0], "bias", Same())
    parametrize.register_parametrization(model[1], "weight", Same())
    weight_norm(model[2])
    zero = {n for g in ts.param_groups(model, weight_decay=0.1) if g["weight_decay"] == 0.0
            for n in g["param_names"]}
    assert zero == {"0.parametrizations.bias.original", "1.bias",
                    "1.parametrizations.weight.original", "2.bias"}


def test_layer_decay_stack_with_parameters_of_its_own_is_an_error():
    class Blocks(nn.ModuleList):
        def __init__(self):
            super().__init__([nn.Linear(2, 2) for _ in range(3)])
            self.scale = nn.Parameter(torch.ones(2))  # in the stack, in no block

    model = nn.Sequential(nn.Linear(2, 2), Blocks(), nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"'1' holds parameters of its own.*'1.scale'"):
        ts.layer_decay(model, 0.5, layers="1")
