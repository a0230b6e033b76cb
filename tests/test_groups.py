"""ts.param_groups: every parameter once, first rule wins, no weight decay on biases and norms
(against HF Trainer's own rule on real models), names, torch optimizers, bad input."""
import os
import re

import pytest
import torch
from torch import nn

import torchstruct as ts

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class MyRMSNorm(nn.Module):  # a user norm class: detected by its name
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * self.weight


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.enc = nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6), nn.Linear(6, 6, bias=False))
        self.bn = nn.BatchNorm1d(6)
        self.gn = nn.GroupNorm(2, 6)
        self.rms = nn.RMSNorm(6)
        self.mine = MyRMSNorm(6)
        self.lstm = nn.LSTM(6, 6)
        self.pos_embed = nn.Parameter(torch.zeros(1, 6))
        self.head = nn.Linear(6, 3)
        self.head_tied = nn.Linear(6, 10)
        self.head_tied.weight = self.emb.weight  # tied

    def forward(self, idx):
        h = self.enc(self.emb(idx)) + self.pos_embed
        return self.head(self.mine(self.rms(h)))


def members(groups):
    return [id(p) for g in groups for p in g["params"]]


def by_name(groups):
    return {g["name"]: g for g in groups}


def paths_of(model, group):
    ids = {id(p) for p in group["params"]}
    return [path for path, p in model.named_parameters() if id(p) in ids]


# ---------------------------------------------------------------------------
# every parameter exactly once
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("no_decay", ["auto", None, "head"])
def test_every_parameter_exactly_once_tied_once_frozen_included(no_decay):
    model = Net()
    model.enc[0].weight.requires_grad_(False)
    groups = ts.param_groups(model, ("enc", {"lr": 0.1}), ("emb", {"lr": 0.2}),
                             ("head*", {"lr": 0.3}), no_decay=no_decay)
    ids = members(groups)
    assert len(ids) == len(set(ids))
    assert set(ids) == {id(p) for p in model.parameters()}  # frozen and tied included
    assert ids.count(id(model.emb.weight)) == 1
    for g in groups:  # param_names line up with params, canonical paths
        assert len(g["param_names"]) == len(g["params"])
        for name, p in zip(g["param_names"], g["params"]):
            assert model.get_parameter(name) is p
    assert "head_tied.weight" not in [n for g in groups for n in g["param_names"]]


def test_first_rule_wins_and_default_group_last():
    model = Net()
    groups = ts.param_groups(model, ("enc.0", {"lr": 1.0}), ("enc", {"lr": 2.0}),
                             no_decay=None)
    g = by_name(groups)
    assert [x["name"] for x in groups] == ["enc.0", "enc", "default"]
    assert g["enc.0"]["param_names"] == ["enc.0.weight", "enc.0.bias"]
    assert g["enc"]["param_names"] == ["enc.1.weight", "enc.1.bias", "enc.2.weight"]
    assert g["enc.0"]["lr"] == 1.0 and g["enc"]["lr"] == 2.0 and "lr" not in g["default"]


def test_tied_parameter_goes_to_the_first_rule_selecting_any_of_its_paths():
    model = Net()
    groups = ts.param_groups(model, ("head_tied", {"lr": 5.0}), no_decay=None)
    g = by_name(groups)
    assert g["head_tied"]["param_names"] == ["emb.weight", "head_tied.bias"]
    assert "emb.weight" not in g["default"]["param_names"]


def test_named_parameters_order_within_groups():
    model = Net()
    (group,) = ts.param_groups(model, no_decay=None)
    expected = [path for path, _ in model.named_parameters()]
    assert group["param_names"] == expected and group["name"] == "default"


# ---------------------------------------------------------------------------
# no_decay
# ---------------------------------------------------------------------------

def test_auto_no_decay_biases_norms_and_no_weight_decay_names():
    model = Net()
    model.no_weight_decay = lambda: {"pos_embed", "head"}  # a path and a module prefix
    groups = ts.param_groups(model, weight_decay=0.05)
    g = by_name(groups)
    no = set(g["default (no decay)"]["param_names"])
    assert g["default (no decay)"]["weight_decay"] == 0.0
    assert g["default"]["weight_decay"] == 0.05
    expected_no = {
        "enc.0.bias", "enc.1.weight", "enc.1.bias", "bn.weight", "bn.bias", "gn.weight",
        "gn.bias", "rms.weight", "mine.weight", "lstm.bias_ih_l0", "lstm.bias_hh_l0",
        "pos_embed", "head.weight", "head.bias", "head_tied.bias",
    }
    assert no == expected_no
    assert set(g["default"]["param_names"]) == (
        {path for path, _ in model.named_parameters()} - expected_no)


def test_no_weight_decay_of_a_submodule_is_relative_to_it():
    model = Net()
    model.enc.no_weight_decay = lambda: ["2.weight"]
    g = by_name(ts.param_groups(model))
    assert "enc.2.weight" in g["default (no decay)"]["param_names"]
    assert "weight_decay" not in g["default"]  # weight_decay=None: the optimizer's default


def test_is_norm():
    class T5LayerNorm(nn.Module):
        pass

    class GroupNorm32(nn.GroupNorm):
        pass

    class LayerNorm2d(nn.Module):
        pass

    class Normalizer(nn.Module):
        pass

    class ConvNextV2GRN(nn.Module):  # global response normalization
        pass

    class GRNHead(nn.Module):  # GRN not at the end: not a norm
        pass

    for m in (nn.LayerNorm(2), nn.BatchNorm2d(2), nn.InstanceNorm1d(2, affine=True),
              nn.GroupNorm(1, 2), nn.RMSNorm(2), nn.LocalResponseNorm(2), nn.SyncBatchNorm(2),
              T5LayerNorm(), GroupNorm32(1, 2), LayerNorm2d(), ConvNextV2GRN()):
        assert ts.is_norm(m), type(m).__name__
    for m in (nn.Linear(1, 1), Normalizer(), nn.Embedding(2, 2), nn.Sequential(), GRNHead()):
        assert not ts.is_norm(m), type(m).__name__


def test_no_decay_selector_replaces_auto_and_none_decays_everything():
    model = Net()
    g = by_name(ts.param_groups(model, no_decay="head", weight_decay=0.1))
    assert g["default (no decay)"]["param_names"] == ["head.weight", "head.bias"]
    assert "enc.0.bias" in g["default"]["param_names"]
    groups = ts.param_groups(model, no_decay=None, weight_decay=0.1)
    assert [x["name"] for x in groups] == ["default"] and groups[0]["weight_decay"] == 0.1


def test_rule_weight_decay_wins_over_no_decay():
    model = Net()
    g = by_name(ts.param_groups(model, ("enc", {"weight_decay": 0.3}), weight_decay=0.1))
    assert g["enc"]["param_names"] == [
        "enc.0.weight", "enc.0.bias", "enc.1.weight", "enc.1.bias", "enc.2.weight"]
    assert g["enc"]["weight_decay"] == 0.3 and "enc (no decay)" not in g


def test_rule_groups_are_split_and_names_readable_and_unique():
    model = Net()
    rx = re.compile(r"enc\.0\..*")
    groups = ts.param_groups(model, (rx, {"lr": 1.0}), (model.head, {}),
                             (lambda path, p: path.startswith("gn"), {"name": "group"}),
                             ([model.rms.weight, "bn"], {"name": "group"}))
    names = [g["name"] for g in groups]
    assert names == ["re:enc\\.0\\..*", "re:enc\\.0\\..* (no decay)", "head",
                     "head (no decay)", "group (no decay)", "group #2 (no decay)", "default",
                     "default (no decay)"]
    assert len(set(names)) == len(names)


def test_hf_trainer_decay_rule_agrees_on_real_models():
    transformers = pytest.importorskip("transformers")
    from transformers import Trainer

    configs = {
        "bert": transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                                        num_attention_heads=2, intermediate_size=32),
        "gpt2": transformers.GPT2Config(vocab_size=50, n_embd=16, n_layer=2, n_head=2),
        "llama": transformers.LlamaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                                          num_attention_heads=2, intermediate_size=32),
    }
    for name, config in configs.items():
        model = transformers.AutoModelForCausalLM.from_config(config) if name != "bert" else \
            transformers.BertForSequenceClassification(config)
        theirs = set(Trainer.get_decay_parameter_names(None, model))
        groups = ts.param_groups(model, weight_decay=0.1)
        ours = {n for g in groups if g["weight_decay"] > 0 for n in g["param_names"]}
        canonical = {path for path, _ in model.named_parameters()}
        assert ours == theirs & canonical, (name, ours ^ (theirs & canonical))


def test_t5_norms_found_by_class_name():
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(vocab_size=50, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                   num_heads=2)
    model = transformers.T5ForConditionalGeneration(config)
    g = by_name(ts.param_groups(model))
    no = g["default (no decay)"]["param_names"]
    assert "encoder.final_layer_norm.weight" in no
    assert "encoder.block.0.layer.0.layer_norm.weight" in no
    assert all(n.endswith("layer_norm.weight") for n in no)


# ---------------------------------------------------------------------------
# with optimizers
# ---------------------------------------------------------------------------

def test_torch_optimizer_takes_the_groups_and_records_names():
    model = Net()
    groups = ts.param_groups(model, ("head", {"lr": 0.5}), weight_decay=0.1)
    opt = torch.optim.AdamW(groups, lr=1e-3)
    sd = opt.state_dict()
    assert [g["param_names"] for g in sd["param_groups"]] == [g["param_names"] for g in groups]
    assert [g["name"] for g in sd["param_groups"]] == [g["name"] for g in groups]
    other = torch.optim.AdamW(ts.param_groups(Net(), ("head", {"lr": 0.5}), weight_decay=0.1))
    other.load_state_dict(sd)
    assert other.param_groups[0]["lr"] == 0.5


def test_ts_optim_skips_frozen_members_of_the_groups():
    model = Net()
    opt = ts.optim.AdamW(ts.param_groups(model, weight_decay=0.1), lr=0.1)
    before = model.enc[0].weight.detach().clone()
    with ts.freeze(model, "enc.0"):
        model(torch.randint(0, 10, (4,))).sum().backward()
        model.enc[0].weight.grad = torch.ones_like(before)
        opt.step()
    assert torch.equal(model.enc[0].weight.detach(), before)
    assert model.enc[0].weight not in opt.state and model.head.weight in opt.state


# ---------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------

def test_typo_selector_raises_with_close_matches():
    model = Net()
    with pytest.raises(ValueError, match="'encc'.*closest.*'enc"):
        ts.param_groups(model, ("encc", {"lr": 1.0}))
    with pytest.raises(ValueError, match="rule 0.*selects no parameter"):
        ts.param_groups(model, (lambda path, p: False, {"lr": 1.0}))
    with pytest.raises(ValueError, match="empty list selects nothing"):
        ts.param_groups(model, ([], {"lr": 1.0}))
    with pytest.raises(ValueError, match="'hed'"):
        ts.param_groups(model, no_decay="hed")


def test_strict_false_allows_empty_rules():
    model = Net()
    groups = ts.param_groups(model, ("encc", {"lr": 1.0}), no_decay="nothing*", strict=False)
    assert [g["name"] for g in groups] == ["default"]


@pytest.mark.parametrize("rule, error, match", [
    ("enc", TypeError, "rule 0 must be a pair"),
    (("enc",), TypeError, "rule 0 must be a pair"),
    (("enc", {"lr": 1}, 3), TypeError, "rule 0 must be a pair"),
    (("enc", [("lr", 1.0)]), TypeError, "options must be a dict"),
    (("enc", {"params": []}), ValueError, "'params' is set by param_groups"),
    (("enc", {"param_names": []}), ValueError, "'param_names'"),
    (("enc", {"weight_decy": 0.1}), ValueError, "unknown option 'weight_decy'; did you mean "
                                                "'weight_decay'"),
    (("enc", {"lr_scal": 0.1}), ValueError, "did you mean 'lr_scale'"),
    (("enc", {"lr_scale": -1.0}), ValueError, "rule 0: lr_scale must be a finite number >= 0"),
    (("enc", {"lr_scale": float("nan")}), ValueError, "lr_scale"),
    (("enc", {"lr_scale": float("inf")}), ValueError, "lr_scale"),
    (("enc", {"lr_scale": True}), TypeError, "lr_scale must be a number"),
    (("enc", {"lr_scale": "2"}), TypeError, "lr_scale must be a number"),
    (("enc", {"lr": -1e-3}), ValueError, "lr must be"),
    (("enc", {"weight_decay": -0.1}), ValueError, "weight_decay must be"),
    (("enc", {"name": 3}), TypeError, "name must be a str"),
    (("enc", {1: 3}), TypeError, "keys must be str"),
    ((3.5, {}), TypeError, "selector must be"),
])
def test_bad_rules(rule, error, match):
    with pytest.raises(error, match=match):
        ts.param_groups(Net(), rule)


def test_bad_arguments():
    with pytest.raises(TypeError, match="nn.Module"):
        ts.param_groups([nn.Parameter(torch.ones(1))])
    with pytest.raises(ValueError, match="weight_decay"):
        ts.param_groups(Net(), weight_decay=-1.0)
    with pytest.raises(ValueError, match="not a submodule"):
        ts.param_groups(Net(), (nn.Linear(2, 2), {}))
    with pytest.raises(ValueError, match="not a parameter of the model"):
        ts.param_groups(Net(), (nn.Parameter(torch.ones(1)), {}))


def test_custom_option_keys_pass_through():
    (g, *_) = ts.param_groups(Net(), ("enc", {"my_tag": "x", "betas": (0.8, 0.9)}))
    assert g["my_tag"] == "x" and g["betas"] == (0.8, 0.9)


def test_bad_no_weight_decay_names_raise():
    model = Net()
    model.no_weight_decay = lambda: [3]
    with pytest.raises(TypeError, match="no_weight_decay"):
        ts.param_groups(model)
