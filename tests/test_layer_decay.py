"""ts.layer_decay: timm's layer-wise lr scales, against a brute-force layer id and against
timm's formula written out on HF BERT / GPT-2 models; stack detection; bad input."""
import os
import re

import pytest
import torch
from torch import nn

import torchstruct as ts

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)


class Stacked(nn.Module):
    def __init__(self, n=5, sequential=False):
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.pos = nn.Parameter(torch.zeros(4))
        blocks = [Block() for _ in range(n)]
        self.blocks = nn.Sequential(*blocks) if sequential else nn.ModuleList(blocks)
        self.mlp = nn.Sequential(nn.Linear(4, 4), nn.GELU())  # not a stack: mixed types
        self.final = nn.LayerNorm(4)
        self.head = nn.Linear(4, 7)
        self.head.weight = self.embed.weight  # tied: its first path is before the stack


def scales_of(model, groups):
    """{canonical path: lr_scale} from param groups."""
    out = {}
    for g in groups:
        for name in g["param_names"]:
            assert name not in out
            out[name] = g.get("lr_scale", 1.0)
    return out


def brute_force(model, stack, decay):
    """Layer ids from the canonical paths: before the stack 0, block i -> i + 1, after L + 1."""
    n = len(model.get_submodule(stack))
    out, seen = {}, False
    for path, _ in model.named_parameters():
        m = re.match(re.escape(stack) + r"\.(\d+)\.", path)
        if m:
            seen, layer = True, int(m.group(1)) + 1
        else:
            layer = n + 1 if seen else 0
        out[path] = decay ** (n + 1 - layer)
    return out


@pytest.mark.parametrize("sequential", [False, True])
@pytest.mark.parametrize("decay", [0.65, 1.0])
def test_against_brute_force(sequential, decay):
    model = Stacked(sequential=sequential)
    rules = ts.layer_decay(model, decay)
    groups = ts.param_groups(model, *rules)
    assert scales_of(model, groups) == brute_force(model, "blocks", decay)
    assert scales_of(model, groups)["embed.weight"] == decay ** 6  # the tied head: layer 0
    assert [o["name"] for _, o in rules] == ["layer 0"] + [f"blocks.{i}" for i in range(5)] + [
        "layer 6"]


def test_explicit_layers_by_path_or_module_and_earlier_rules_win():
    model = Stacked()
    by_path = ts.layer_decay(model, 0.5, layers="blocks")
    assert by_path == ts.layer_decay(model, 0.5, layers=model.blocks)
    groups = ts.param_groups(model, ("blocks.0", {"lr_scale": 3.0}), *by_path)
    scales = scales_of(model, groups)
    assert scales["blocks.0.fc.weight"] == 3.0 and scales["blocks.1.fc.weight"] == 0.5 ** 4


def timm_layer_id(path, num_layers, embed_prefixes, block_prefix):
    """timm / BEiT / MAE's get_layer_id rule, written out for a model: embeddings 0, block i
    -> i + 1, the rest num_layers (= L + 1)."""
    if path.startswith(embed_prefixes):
        return 0
    m = re.match(re.escape(block_prefix) + r"\.(\d+)\.", path)
    return int(m.group(1)) + 1 if m else num_layers


@pytest.mark.parametrize("arch", ["bert", "gpt2"])
def test_against_timms_formula_on_hf_models(arch):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if arch == "bert":
        config = transformers.BertConfig(vocab_size=30, hidden_size=8, num_hidden_layers=4,
                                         num_attention_heads=2, intermediate_size=16)
        model = transformers.BertForSequenceClassification(config)
        stack, embed = "bert.encoder.layer", ("bert.embeddings.",)
    else:
        config = transformers.GPT2Config(vocab_size=30, n_embd=8, n_layer=4, n_head=2)
        model = transformers.GPT2LMHeadModel(config)
        stack, embed = "transformer.h", ("transformer.wte.", "transformer.wpe.")
    decay, L = 0.75, 4
    rules = ts.layer_decay(model, decay)  # found automatically
    assert rules[1][0] == f"{stack}.0"
    groups = ts.param_groups(model, *rules, weight_decay=0.05)
    num_layers = L + 1
    layer_scales = [decay ** (num_layers - i) for i in range(num_layers + 1)]  # timm / BEiT
    expected = {path: layer_scales[timm_layer_id(path, num_layers, embed, stack)]
                for path, _ in model.named_parameters()}
    assert scales_of(model, groups) == expected
    # the optimizer steps each group with lr * scale
    opt = ts.optim.AdamW(groups, lr=1e-3)
    assert {g["name"]: g.get("lr_scale") for g in opt.param_groups}["layer 0"] == decay ** 5


def test_t5_has_two_stacks_and_says_so():
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(vocab_size=30, d_model=8, d_kv=4, d_ff=16, num_layers=2,
                                   num_heads=2)
    model = transformers.T5ForConditionalGeneration(config)
    with pytest.raises(ValueError, match="'encoder.block', 'decoder.block'.*layers="):
        ts.layer_decay(model, 0.8)
    rules = ts.layer_decay(model, 0.8, layers="decoder.block")
    scales = scales_of(model, ts.param_groups(model, *rules))
    assert scales["decoder.block.0.layer.0.SelfAttention.q.weight"] == 0.8 ** 2
    assert scales["encoder.block.1.layer.0.SelfAttention.q.weight"] == 0.8 ** 3  # before


def test_no_stack_and_bad_layers():
    with pytest.raises(ValueError, match="no nn.ModuleList.*layers="):
        ts.layer_decay(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), 0.5)
    model = Stacked()
    with pytest.raises(ValueError, match="'blokcs'.*closest.*'blocks'"):
        ts.layer_decay(model, 0.5, layers="blokcs")
    with pytest.raises(ValueError, match="is a Linear, not an nn.ModuleList"):
        ts.layer_decay(model, 0.5, layers="head")
    with pytest.raises(ValueError, match="not a submodule"):
        ts.layer_decay(model, 0.5, layers=nn.ModuleList([Block(), Block()]))
    with pytest.raises(TypeError, match="layers must be"):
        ts.layer_decay(model, 0.5, layers=3)
    with pytest.raises(TypeError, match="nn.Module"):
        ts.layer_decay("blocks", 0.5)


@pytest.mark.parametrize("decay, error", [
    (0.0, ValueError), (-0.5, ValueError), (1.5, ValueError), (float("nan"), ValueError),
    ("0.5", TypeError), (True, TypeError), (None, TypeError),
])
def test_bad_decay(decay, error):
    with pytest.raises(error, match="decay"):
        ts.layer_decay(Stacked(), decay)


def test_blocks_without_parameters_keep_their_ids():
    model = Stacked()
    model.blocks[2].fc = nn.Identity()
    model.blocks[2].norm = nn.Identity()
    rules = ts.layer_decay(model, 0.5, layers="blocks")
    names = [o["name"] for _, o in rules]
    assert "blocks.2" not in names  # no rule that would select nothing
    scales = scales_of(model, ts.param_groups(model, *rules))
    assert scales["blocks.3.fc.weight"] == 0.5 ** 2  # ids unchanged: block 4 of 5


def test_nested_stacks_of_one_size_take_the_outermost():
    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    model = nn.Sequential(nn.Linear(4, 4), nn.ModuleList(Heads() for _ in range(3)))
    rules = ts.layer_decay(model, 0.5)
    assert [o["name"] for _, o in rules] == ["layer 0", "1.0", "1.1", "1.2"]


def test_a_block_listed_several_times_counts_once():
    """One block applied at several depths (shared weights): L counts distinct blocks, and the
    shared parameters take the id of the first position (docs/groups.md)."""
    blk = nn.Linear(4, 4)
    model = nn.Sequential(nn.Linear(2, 4), nn.ModuleList([blk, blk, blk]), nn.Linear(4, 1))
    rules = ts.layer_decay(model, 0.5)
    assert [(o["name"], o["lr_scale"]) for _, o in rules] == [
        ("layer 0", 0.25), ("1.0", 0.5), ("layer 2", 1.0)]
    scales = scales_of(model, ts.param_groups(model, *rules))
    assert scales["1.0.weight"] == 0.5 and scales["0.weight"] == 0.25


def test_the_model_itself_as_the_stack():
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)])
    for layers in (None, "", model):
        rules = ts.layer_decay(model, 0.5, layers=layers)
        assert [(o["name"], o["lr_scale"]) for _, o in rules] == [
            ("0", 0.125), ("1", 0.25), ("2", 0.5)]
