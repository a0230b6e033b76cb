"""How fast each part learns, checked from the outside with other people's models.

What this file audits, each answer compared with a brute force written here (expected group,
weight decay and lr scale per parameter, worked out from its path), with plain ``torch.optim``
or with the libraries the practice comes from (HF ``Trainer``'s decay list, timm's layer-decay
formula):

- ``ts.param_groups``: every parameter in exactly one group (tied ones once, frozen ones
  included), first matching rule wins, ``no_decay="auto"`` (biases, norms, ``no_weight_decay()``),
  unique readable names, clear errors for typos and bad options; HF BERT / GPT-2 / Llama, a
  timm-style ViT, PEFT LoRA models and ``nn.Transformer``.
- ``ts.layer_decay``: ``decay ** (L + 1 - id)`` per parameter, the layer stack found by itself.
- ``lr_scale`` under ``torch.optim.lr_scheduler`` schedulers: the same trajectory as torch's
  optimizers stepped at ``lr * lr_scale``; ``lr_scale=0`` leaves a group bitwise unchanged;
  ``deepcopy`` / ``torch.save`` keep the scales.
- ``ts.UnfreezeSchedule``: flags after any number of steps, resumed from ``state_dict()``,
  composed with contexts and hand-written flags; bad milestones and bad states change nothing.
- ``ts.state_dict`` / ``ts.load_state_dict``: trainable-only keys, an interrupted and resumed
  fine-tune equal bit for bit to an uninterrupted one, every bad entry refused before any write.

Convention: a test marked ``@pytest.mark.xfail(strict=True, reason="BUG: ...")`` reproduces, in
a minimal form, a case that goes wrong today; its reason says what happens and what is expected.
When the behaviour is fixed the test passes and the strict xfail turns red, so the marker must
then be removed.
"""
import copy
import fnmatch
import io
import os
import re
import warnings

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn
from torch.nn.utils import parametrize

import torchstruct as ts

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

# a ViT written the way timm writes it (cls token, pos embed, layer scale, no_weight_decay())


class _Attn(nn.Module):
    def __init__(self, d, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


class _LayerScale(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((d,), 1e-5))

    def forward(self, x):
        return x * self.gamma


class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn = _Attn(d)
        self.ls1 = _LayerScale(d)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.ls2 = _LayerScale(d)

    def forward(self, x):
        x = x + self.ls1(self.attn(self.norm1(x)))
        return x + self.ls2(self.mlp(self.norm2(x)))


class _PatchEmbed(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.proj = nn.Conv2d(3, d, 4, 4)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class ViT(nn.Module):
    def __init__(self, d=16, depth=4, classes=5):
        super().__init__()
        self.patch_embed = _PatchEmbed(d)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.pos_embed = nn.Parameter(torch.randn(1, 5, d) * 0.02)
        self.blocks = nn.Sequential(*[_Block(d) for _ in range(depth)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def no_weight_decay(self):
        return {"pos_embed", "cls_token", "dist_token"}  # timm lists names that may not exist

    def forward(self, x):
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


def bert():
    torch.manual_seed(0)
    return transformers.BertModel(transformers.BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32))


def gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=3, n_embd=16, n_head=2, vocab_size=40, n_positions=16, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        bos_token_id=0, eos_token_id=0, pad_token_id=0))


def lora_vit():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(ViT(), peft.LoraConfig(r=2, target_modules=["qkv"]))


def lora_gpt2():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(gpt2(), peft.LoraConfig(r=2, target_modules=["c_attn"],
                                                           fan_in_fan_out=True))


MODELS = {"bert": bert, "gpt2": gpt2, "llama": llama, "vit": ViT, "lora_vit": lora_vit,
          "lora_gpt2": lora_gpt2}
STACKS = {"bert": "encoder.layer", "gpt2": "transformer.h", "llama": "model.layers",
          "vit": "blocks", "lora_vit": "base_model.model.blocks",
          "lora_gpt2": "base_model.model.transformer.h"}


# ---------------------------------------------------------------------------- brute force
def unique_params(model):
    """[(param, [all its paths])] in named_parameters() order, each object once."""
    out = {}
    for path, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), (p, []))[1].append(path)
    return list(out.values())


def glob_hits(pattern, path):
    """A glob selector: the path or one of its dotted prefixes matches."""
    parts = path.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[:k]), pattern) for k in range(1, len(parts) + 1))


_NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase)


def auto_exempt(model, paths, extra_globs=()):
    """The documented no_decay="auto" rule, written out: bias names, norm parents (by type or
    by a class name ending in Norm), parametrized originals read as the tensor they stand for,
    and extra glob names (no_weight_decay())."""
    modules = dict(model.named_modules(remove_duplicate=False))
    for path in paths:
        m = re.fullmatch(r"(?:(.*)\.)?parametrizations\.([^.]+)\.original\d*", path)
        if m:
            parent, name = m.group(1) or "", m.group(2)
        else:
            parent, _, name = path.rpartition(".")
        if name == "bias" or name.endswith("_bias") or name.startswith("bias_"):
            return True
        owner = modules.get(parent)
        if owner is not None and (isinstance(owner, _NORM_TYPES)
                                  or type(owner).__name__.endswith("Norm")):
            return True
        if any(glob_hits(g, path) for g in extra_globs):
            return True
    return False


def per_param(groups):
    """{id(param): group} checking that no parameter is in two groups."""
    seen = {}
    for g in groups:
        assert len(g["params"]) == len(g["param_names"]) > 0
        for p in g["params"]:
            assert id(p) not in seen, f"a parameter in two groups: {g['name']}"
            seen[id(p)] = g
    assert len({g["name"] for g in groups}) == len(groups), "group names not unique"
    return seen


def brute_layer_ids(model, stack):
    """{canonical path: timm layer id} and L, from paths alone."""
    canon = [paths[0] for _, paths in unique_params(model)]
    block_ids = {}
    stack_mod = model.get_submodule(stack)
    for i, (name, _) in enumerate(stack_mod._modules.items()):
        block_ids[name] = i + 1
    n = len(stack_mod)
    first = next(i for i, p in enumerate(canon) if p.startswith(stack + "."))
    ids = {}
    for i, path in enumerate(canon):
        if path.startswith(stack + "."):
            ids[path] = block_ids[path[len(stack) + 1:].split(".")[0]]
        else:
            ids[path] = 0 if i < first else n + 1
    return ids, n


def flags(model):
    return [p.requires_grad for p in model.parameters()]


# ============================================================================ param_groups
@pytest.mark.parametrize("make", ["bert", "gpt2", "llama"])
def test_param_groups_hf_models_partition_and_decay_set_equals_hf_trainer(make):
    model = MODELS[make]()
    model.get_submodule(STACKS[make] + ".0").requires_grad_(False)  # frozen ones included
    groups = ts.param_groups(model, weight_decay=0.1)
    seen = per_param(groups)
    uniq = unique_params(model)
    assert set(seen) == {id(p) for p, _ in uniq}
    names = [n for g in groups for n in g["param_names"]]
    assert sorted(names) == sorted(paths[0] for _, paths in uniq)  # canonical paths, once
    decayed = {n for g in groups if g["weight_decay"] > 0 for n in g["param_names"]}
    trainer = set(transformers.Trainer.get_decay_parameter_names(None, model))
    canonical = {paths[0] for _, paths in uniq}
    assert decayed == trainer & canonical
    for g in groups:  # params listed in named_parameters() order
        order = [names.index(n) for n in g["param_names"]]
        assert order == sorted(order)


_GLOBS = ["embed", "head", "head.weight", "enc.*", "enc.1", "*.bias", "*weight*", "attn",
          "rnn.*_l0", "sym", "sym.parametrizations.weight.original", "scale", "enc.[02]"]


class _Zoo(nn.Module):
    """Tied, parametrized, LSTM / MHA biases, norms by type, a no_weight_decay() name that
    exists and one that does not."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.enc = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4, bias=False),
                                 nn.GroupNorm(2, 4))
        self.attn = nn.MultiheadAttention(4, 2, add_bias_kv=True)
        self.rnn = nn.LSTM(4, 4)
        self.head = nn.Linear(4, 7)
        self.head.weight = self.embed.weight
        self.sym = nn.Linear(4, 4)
        parametrize.register_parametrization(self.sym, "weight", _Sym())
        self.scale = nn.Parameter(torch.ones(4))

    def no_weight_decay(self):
        return ["scale", "not_here"]


class _Sym(nn.Module):
    def forward(self, w):
        return (w + w.T) / 2


_ZOO = _Zoo()
_ZOO.enc[2].weight.requires_grad_(False)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rules=st.lists(st.tuples(st.sampled_from(_GLOBS), st.fixed_dictionaries({}, optional={
    "lr": st.sampled_from([0.1, 0.2]), "weight_decay": st.sampled_from([0.0, 0.3]),
    "lr_scale": st.sampled_from([0.0, 0.5])})), max_size=4),
    wd=st.sampled_from([None, 0.05]))
def test_param_groups_random_rules_agree_with_brute_force(rules, wd):
    groups = ts.param_groups(_ZOO, *rules, weight_decay=wd)
    seen = per_param(groups)
    uniq = unique_params(_ZOO)
    assert set(seen) == {id(p) for p, _ in uniq}
    for p, paths in uniq:
        g = seen[id(p)]
        k = next((i for i, (sel, _) in enumerate(rules)
                  if any(glob_hits(sel, q) for q in paths)), None)
        opts = rules[k][1] if k is not None else {}
        for key in ("lr", "lr_scale"):
            assert g.get(key) == opts.get(key), (paths, g["name"], key)
        if "weight_decay" in opts:
            expected = opts["weight_decay"]
        elif auto_exempt(_ZOO, paths, ["scale"]):
            expected = 0.0
        else:
            expected = wd
        assert g.get("weight_decay") == expected, (paths, g["name"])
        assert g["param_names"][[id(q) for q in g["params"]].index(id(p))] == paths[0]


def test_param_groups_timm_vit_no_weight_decay_and_timm_ndim_rule():
    model = ViT()
    groups = ts.param_groups(model, weight_decay=0.05)
    seen = per_param(groups)
    for p, paths in unique_params(model):
        exempt = auto_exempt(model, paths, ["pos_embed", "cls_token"])
        assert seen[id(p)]["weight_decay"] == (0.0 if exempt else 0.05), paths
    wd = {n: g["weight_decay"] for g in groups for n in g["param_names"]}
    assert wd["cls_token"] == wd["pos_embed"] == 0.0
    assert wd["blocks.0.ls1.gamma"] == 0.05  # layer scale: not a bias, not a norm
    # timm's own rule, as the docs spell it
    timm = ts.param_groups(model, weight_decay=0.05, no_decay=lambda path, p: p.ndim <= 1)
    wd2 = {n: g["weight_decay"] for g in timm for n in g["param_names"]}
    for name, p in model.named_parameters():
        timm_exempt = p.ndim <= 1 or name.endswith(".bias")
        assert (wd2[name] == 0.0) == timm_exempt, name


def test_param_groups_lora_vit_finds_the_inner_no_weight_decay_and_keeps_frozen_base():
    model = lora_vit()
    groups = ts.param_groups(model, ("*lora_*", {"lr": 1e-2}), weight_decay=0.05)
    seen = per_param(groups)
    assert set(seen) == {id(p) for p, _ in unique_params(model)}
    wd = {n: g["weight_decay"] for g in groups for n in g["param_names"]}
    assert wd["base_model.model.cls_token"] == wd["base_model.model.pos_embed"] == 0.0
    assert wd["base_model.model.blocks.0.attn.qkv.base_layer.weight"] == 0.05
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen and all(n in wd for n in frozen)  # frozen base weights are grouped too
    lora_group = groups[0]
    assert lora_group["name"] == "*lora_*" and lora_group["lr"] == 1e-2
    assert all(".lora_" in n for n in lora_group["param_names"])
    assert {n for n in wd if ".lora_" in n} == set(lora_group["param_names"])


def test_param_groups_gpt2_tied_head_lives_once_under_its_first_path():
    model = gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    groups = ts.param_groups(model, ("lm_head", {"lr": 5e-3}), weight_decay=0.1)
    per_param(groups)
    assert groups[0]["name"] == "lm_head"
    assert groups[0]["param_names"] == ["transformer.wte.weight"]
    assert groups[0]["params"][0] is model.lm_head.weight
    names = [n for g in groups for n in g["param_names"]]
    assert "lm_head.weight" not in names and names.count("transformer.wte.weight") == 1
    # a torch optimizer accepts the groups (no parameter twice) and steps the tied one once
    opt = ts.optim.AdamW(groups, lr=1e-3)
    ids = torch.randint(0, 40, (2, 6))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert float(opt.state[model.lm_head.weight]["step"]) == 1


def test_param_groups_bad_input_is_refused_clearly():
    model = bert()
    with pytest.raises(ValueError, match=r"rule 1.*closest paths.*'encoder\.layer'"):
        ts.param_groups(model, ("pooler", {}), ("encoder.layers", {"lr": 1e-3}))
    with pytest.raises(ValueError, match="lr_scale"):
        ts.param_groups(model, ("pooler", {"lr_scal": 0.5}))
    with pytest.raises(ValueError, match="lr"):
        ts.param_groups(model, ("pooler", {"lr": -1.0}))
    with pytest.raises(ValueError, match="weight_decay"):
        ts.param_groups(model, ("pooler", {"weight_decay": float("nan")}))
    with pytest.raises(ValueError, match="params"):
        ts.param_groups(model, ("pooler", {"params": []}))
    with pytest.raises(ValueError, match="not a submodule"):
        ts.param_groups(model, (nn.Linear(2, 2), {}))
    with pytest.raises(ValueError, match="empty"):
        ts.param_groups(model, ([], {}))
    with pytest.raises(TypeError, match="pair"):
        ts.param_groups(model, ("pooler", {}), 0.01)  # weight_decay given positionally
    with pytest.raises(ValueError, match="no_decay"):
        ts.param_groups(model, no_decay="*.LayerNorn.weight")
    with pytest.raises(TypeError, match="strict"):
        ts.param_groups(model, strict="yes")
    # strict=False: a rule that selects nothing is allowed and leaves no group
    groups = ts.param_groups(model, ("encoder.layers", {"lr": 1.0}), strict=False)
    assert all(g.get("lr") != 1.0 for g in groups)
    per_param(groups)


def test_param_groups_nn_transformer_with_layer_decay_against_brute_force():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = nn.Transformer(d_model=8, nhead=2, num_encoder_layers=2, num_decoder_layers=3,
                               dim_feedforward=16)
    with pytest.raises(ValueError, match=r"'encoder\.layers'.*'decoder\.layers'"):
        ts.layer_decay(model, 0.5)
    rules = ts.layer_decay(model, 0.5, layers="decoder.layers")
    groups = ts.param_groups(model, *rules, weight_decay=0.1)
    seen = per_param(groups)
    ids, n = brute_layer_ids(model, "decoder.layers")
    assert n == 3
    for p, paths in unique_params(model):
        g = seen[id(p)]
        assert g["lr_scale"] == 0.5 ** (n + 1 - ids[paths[0]]), paths
        assert g["weight_decay"] == (0.0 if auto_exempt(model, paths) else 0.1), paths
    wd = {n: g["weight_decay"] for g in groups for n in g["param_names"]}
    assert wd["encoder.layers.0.self_attn.in_proj_bias"] == 0.0
    assert wd["encoder.layers.0.self_attn.in_proj_weight"] == 0.1
    assert wd["decoder.norm.weight"] == 0.0


# ============================================================================ layer_decay
@pytest.mark.parametrize("make", list(MODELS))
def test_layer_decay_scales_match_timm_formula_per_parameter(make):
    model = MODELS[make]()
    decay = 0.65
    rules = ts.layer_decay(model, decay)
    groups = ts.param_groups(model, *rules, weight_decay=0.05)
    seen = per_param(groups)
    assert set(seen) == {id(p) for p, _ in unique_params(model)}
    ids, n = brute_layer_ids(model, STACKS[make])
    assert n in (3, 4)
    for p, paths in unique_params(model):
        expected = decay ** (n + 1 - ids[paths[0]])
        assert seen[id(p)]["lr_scale"] == pytest.approx(expected, rel=1e-15), paths
    scale = {n: g["lr_scale"] for g in groups for n in g["param_names"]}
    if make == "gpt2":  # the tied output embedding: id of its first path (layer 0)
        assert scale["transformer.wte.weight"] == decay ** (n + 1)
        assert scale["transformer.ln_f.weight"] == 1.0


def test_layer_decay_rules_before_win_and_decay_one_is_flat():
    model = llama()
    groups = ts.param_groups(model, ("lm_head", {"lr": 1e-2, "name": "head"}),
                             *ts.layer_decay(model, 0.5))
    seen = per_param(groups)
    assert seen[id(model.lm_head.weight)]["name"] == "head"
    assert "lr_scale" not in seen[id(model.lm_head.weight)]
    assert seen[id(model.model.norm.weight)]["lr_scale"] == 1.0
    flat = ts.param_groups(model, *ts.layer_decay(model, 1.0))
    assert {g["lr_scale"] for g in flat} == {1.0}
    for bad in (0, 0.0, -0.5, 1.5, float("nan")):
        with pytest.raises(ValueError, match="decay"):
            ts.layer_decay(model, bad)
    with pytest.raises(TypeError, match="decay"):
        ts.layer_decay(model, "0.5")
    with pytest.raises(ValueError, match=r"closest.*'model\.layers'"):
        ts.layer_decay(model, 0.5, layers="model.layer")


class _B(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


@pytest.mark.parametrize("layers", ["model", "", None])
def test_layer_decay_model_that_is_itself_the_stack(layers):
    model = nn.Sequential(_B(), _B(), _B())
    rules = ts.layer_decay(model, 0.5, layers=model if layers == "model" else layers)
    assert [(o["name"], o["lr_scale"]) for _, o in rules] == [
        ("0", 0.125), ("1", 0.25), ("2", 0.5)]
    groups = ts.param_groups(model, *rules)
    by_param = {id(p): g.get("lr_scale", 1.0) for g in groups for p in g["params"]}
    for i, block in enumerate(model):  # brute force: block i at decay ** (L - i)
        assert all(by_param[id(p)] == 0.5 ** (3 - i) for p in block.parameters())


def test_layer_decay_a_root_stack_with_longer_stacks_inside_is_refused():
    stage = lambda: nn.Sequential(*[_B() for _ in range(3)])  # noqa: E731
    model = nn.Sequential(stage(), stage())
    with pytest.raises(ValueError, match="holds larger stacks"):
        ts.layer_decay(model, 0.5)


# ============================================================================ lr_scale
def _schedulers():
    return {
        "onecycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=12),
        "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=5),
        "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(
            o, [lambda s, k=k: 1.0 / (1 + s + k) for k in range(len(o.param_groups))]),
        "sequential": lambda o: torch.optim.lr_scheduler.SequentialLR(
            o, [torch.optim.lr_scheduler.LinearLR(o, 0.1, 1.0, total_iters=3),
                torch.optim.lr_scheduler.ExponentialLR(o, 0.8)], milestones=[3]),
    }


@pytest.mark.parametrize("kind", ["AdamW", "SGD"])
@pytest.mark.parametrize("sched", list(_schedulers()))
def test_lr_scale_steps_like_torch_at_scaled_lr_under_schedulers(kind, sched):
    torch.manual_seed(0)
    ours = ViT(d=8, depth=2)
    theirs = copy.deepcopy(ours)
    frozen_zero = ("patch_embed", {"lr_scale": 0.0})
    rules = [frozen_zero, *ts.layer_decay(ours, 0.5)]
    groups = ts.param_groups(ours, *rules, weight_decay=0.05)
    ref_groups = ts.param_groups(theirs, *rules[:1], *ts.layer_decay(theirs, 0.5),
                                 weight_decay=0.05)
    scales = [g.get("lr_scale", 1.0) for g in groups]
    assert scales == [g.get("lr_scale", 1.0) for g in ref_groups] and 0.0 in scales
    if kind == "AdamW":
        opt = ts.optim.AdamW(groups, lr=1e-2, max_grad_norm=0.5)
        ref = torch.optim.AdamW(ref_groups, lr=1e-2, foreach=False)
    else:
        opt = ts.optim.SGD(groups, lr=1e-2, momentum=0.9, max_grad_norm=0.5)
        ref = torch.optim.SGD(ref_groups, lr=1e-2, momentum=0.9, foreach=False)
    s1, s2 = _schedulers()[sched](opt), _schedulers()[sched](ref)
    zero = ours.patch_embed.proj.weight
    zero_before = zero.detach().clone()
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):
        x = torch.randn(3, 3, 8, 8, generator=gen)
        opt.zero_grad()
        ours(x).pow(2).mean().backward()  # the same gradients for both: no model chaos
        for p, q in zip(ours.parameters(), theirs.parameters()):
            q.grad = p.grad.clone()
        live = [p for g, s in zip(ref.param_groups, scales) if s != 0 for p in g["params"]]
        total = torch.nn.utils.clip_grad_norm_(live, 0.5)
        lrs = [g["lr"] for g in ref.param_groups]
        for g, s in zip(ref.param_groups, scales):
            g["lr"] = g["lr"] * s
            if s == 0:
                for p in g["params"]:
                    p.grad = None
        opt.step()
        ref.step()
        for g, lr in zip(ref.param_groups, lrs):
            g["lr"] = lr
        s1.step()
        s2.step()
        torch.testing.assert_close(opt.last_grad_norm, total, rtol=1e-6, atol=0)
        assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref.param_groups]
        assert [g.get("lr_scale", 1.0) for g in opt.param_groups] == scales  # never rewritten
    for p, q in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert torch.equal(zero, zero_before) and zero not in opt.state


def test_lr_scale_one_is_bitwise_plain_and_sgd_scale_is_bitwise_torch():
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 2))
    b, c = copy.deepcopy(a), copy.deepcopy(a)
    oa = ts.optim.SGD([{"params": a.parameters(), "lr_scale": 1.0}], lr=0.03, momentum=0.9,
                      weight_decay=0.01, nesterov=True)
    ob = ts.optim.SGD(b.parameters(), lr=0.03, momentum=0.9, weight_decay=0.01, nesterov=True)
    oc = ts.optim.SGD([{"params": c.parameters(), "lr_scale": 0.37}], lr=0.03, momentum=0.9,
                      weight_decay=0.01, nesterov=True)
    d = copy.deepcopy(a)
    od = torch.optim.SGD(d.parameters(), lr=0.03 * 0.37, momentum=0.9, weight_decay=0.01,
                         nesterov=True, foreach=False)
    gen = torch.Generator().manual_seed(2)
    for _ in range(5):
        x = torch.randn(4, 5, generator=gen)
        for m, o in ((a, oa), (b, ob), (c, oc), (d, od)):
            o.zero_grad()
            m(x).pow(2).sum().backward()
            o.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert all(torch.equal(p, q) for p, q in zip(c.parameters(), d.parameters()))


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "0.5", None, True,
                                 torch.tensor([0.5, 0.5]), torch.tensor(-1.0)])
def test_lr_scale_bad_value_set_later_is_refused_before_any_write(bad):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    opt = ts.optim.AdamW(ts.param_groups(net, ("0", {"lr_scale": 0.5})), lr=0.1,
                         max_grad_norm=1.0)
    net(torch.ones(2, 3)).sum().backward()
    before = [p.detach().clone() for p in net.parameters()]
    last = len(opt.param_groups) - 1
    opt.param_groups[last]["lr_scale"] = bad
    with pytest.raises(ValueError, match=rf"param group {last}: lr_scale"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), before))
    assert len(opt.state) == 0 and opt.last_grad_norm is None
    with pytest.raises(ValueError, match="lr_scale"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(2))], "lr_scale": -2.0,
                             "param_names": ["extra"]})
    assert len(opt.param_groups) == last + 1


def test_lr_scale_zero_then_positive_follows_torch_with_those_steps_skipped():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    ref = copy.deepcopy(net)
    opt = ts.optim.AdamW([{"params": net[0].parameters()}, {"params": net[1].parameters()}],
                         lr=0.05, weight_decay=0.1)
    torch_opt = torch.optim.AdamW([{"params": ref[0].parameters()},
                                   {"params": ref[1].parameters()}],
                                  lr=0.05, weight_decay=0.1, foreach=False)
    plan = [(1, 0), (1, 0), (0, 1), (0.5, 1), (1, 0.25), (1, 1)]
    gen = torch.Generator().manual_seed(3)
    for s0, s1 in plan:
        x = torch.randn(5, 3, generator=gen)
        opt.param_groups[0]["lr_scale"], opt.param_groups[1]["lr_scale"] = s0, s1
        frozen_before = {id(p): p.detach().clone() for g in opt.param_groups
                         if g["lr_scale"] == 0 for p in g["params"]}
        for m, o in ((net, opt), (ref, torch_opt)):
            o.zero_grad()
            m(x).pow(2).sum().backward()
        for g, s in zip(torch_opt.param_groups, (s0, s1)):
            g["lr"] = 0.05 * s
            if s == 0:
                for p in g["params"]:
                    p.grad = None
        opt.step()
        torch_opt.step()
        for p in net.parameters():
            if id(p) in frozen_before:
                assert torch.equal(p, frozen_before[id(p)])
        ours = [float(opt.state[p]["step"]) if p in opt.state else None for p in net.parameters()]
        theirs = [float(torch_opt.state[p]["step"]) if p in torch_opt.state else None
                  for p in ref.parameters()]
        assert ours == theirs
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_lr_scale_survives_deepcopy_and_torch_save_of_model_optimizer_scheduler():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    opt = ts.optim.AdamW(ts.param_groups(net, ("0", {"lr_scale": 0.25}), ("2", {"lr_scale": 0.0}),
                                         weight_decay=0.1), lr=0.1, max_grad_norm=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)

    def run(model, o, s, seed):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(3):
            x = torch.randn(4, 3, generator=gen)
            o.zero_grad()
            model(x).pow(2).sum().backward()
            o.step()
            s.step()

    run(net, opt, sched, 0)
    twin = copy.deepcopy((net, opt, sched))
    buf = io.BytesIO()
    torch.save((net, opt, sched), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    frozen = net[2].weight.detach().clone()
    for trio in ((net, opt, sched), twin, loaded):
        run(*trio, 1)
        assert [g.get("lr_scale") for g in trio[1].param_groups] == [0.25, 0.25, 0.0, 0.0, None]
        assert trio[1].param_groups[0]["params"][0] is trio[0][0].weight
        assert torch.equal(trio[0][2].weight, frozen)
    for p, q, r in zip(net.parameters(), twin[0].parameters(), loaded[0].parameters()):
        assert torch.equal(p, q) and torch.equal(p, r)


def test_optimizer_state_from_other_rule_order_is_refused_and_changes_nothing():
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))

    a = make()
    oa = ts.optim.AdamW(ts.param_groups(a, ("2", {"lr_scale": 0.5}), ("0", {"lr_scale": 0.1})),
                        lr=0.1)
    a(torch.randn(2, 3)).sum().backward()
    oa.step()
    saved = copy.deepcopy(oa.state_dict())
    b = make()
    ob = ts.optim.AdamW(ts.param_groups(b, ("0", {"lr_scale": 0.1}), ("2", {"lr_scale": 0.5})),
                        lr=0.3)
    before = [{k: v for k, v in g.items() if k != "params"} for g in ob.param_groups]
    with pytest.raises(ValueError, match=r"'2\.weight'.*'0\.weight'"):
        ob.load_state_dict(saved)
    assert [{k: v for k, v in g.items() if k != "params"} for g in ob.param_groups] == before
    assert len(ob.state) == 0


# ============================================================================ UnfreezeSchedule
def _tower():
    torch.manual_seed(0)
    return nn.ModuleDict({"embed": nn.Embedding(10, 4),
                          "blocks": nn.ModuleList(nn.Linear(4, 4) for _ in range(4)),
                          "head": nn.Linear(4, 2)})


_SEL = ["head", "blocks.3", "blocks.2", ["blocks.1", "blocks.0"], "embed", "*.bias", None, "*",
        re.compile(r"blocks\.[02]\.weight")]


def _brute_trains(model, milestones, step, start):
    reached = [v for s, v in sorted(milestones.items(), key=lambda kv: kv[0]) if s <= step]
    out = []
    for (path, p), f in zip(model.named_parameters(), start):
        if any(v is None or (isinstance(v, str) and v == "*") for v in reached):
            ok = True
        else:
            sels = [s for v in reached for s in (v if isinstance(v, list) else [v])]
            ok = any(s.fullmatch(path) if isinstance(s, re.Pattern) else glob_hits(s, path)
                     for s in sels)
        out.append(f and ok)
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ms=st.dictionaries(st.integers(0, 8), st.sampled_from(range(len(_SEL))), min_size=1,
                          max_size=4),
       steps=st.integers(0, 10), hand_frozen=st.booleans())
def test_schedule_flags_follow_brute_force_and_resume_anywhere(ms, steps, hand_frozen):
    milestones = {k: _SEL[v] for k, v in ms.items()}
    model = _tower()
    if hand_frozen:
        model["blocks"][2].bias.requires_grad_(False)
    start = flags(model)
    sched = ts.UnfreezeSchedule(model, milestones)
    for k in range(steps):
        assert flags(model) == _brute_trains(model, milestones, k, start), k
        sched.step()
    assert flags(model) == _brute_trains(model, milestones, steps, start)
    assert sched.current_step == steps
    assert sched.stage == sum(1 for s in milestones if s <= steps)
    buf = io.BytesIO()
    torch.save(sched.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf)  # weights_only: plain ints
    fresh = _tower()
    if hand_frozen:
        fresh["blocks"][2].bias.requires_grad_(False)
    again = ts.UnfreezeSchedule(fresh, milestones)
    again.load_state_dict(state)
    assert flags(fresh) == flags(model)
    assert (again.current_step, again.stage) == (sched.current_step, sched.stage)
    again.step()
    sched.step()
    assert flags(fresh) == flags(model)
    sched.close()
    again.close()
    assert flags(model) == start == flags(fresh)


def test_schedule_bad_milestones_raise_and_leave_every_flag():
    model = _tower()
    model["embed"].weight.requires_grad_(False)  # by hand
    with ts.freeze(model, "blocks.0"):
        before = flags(model)
        cases = [
            ({-1: "head"}, ValueError, "negative"),
            ({True: "head"}, TypeError, "integers"),
            ({1.5: "head"}, TypeError, "integers"),
            ({"3": "head"}, TypeError, "integers"),
            ({0: "head", 5: "blocks.7"}, ValueError, r"milestone 5.*'blocks\.\d'"),
            ({0: "head", 2: []}, ValueError, "empty"),
            ({}, ValueError, "empty"),
            ({0: nn.Linear(4, 2)}, ValueError, "not a submodule"),
            ({0: {"head"}}, TypeError, "selector"),
            ({0: "head", 3: re.compile("heads.*")}, ValueError, "milestone 3"),
        ]
        for milestones, err, msg in cases:
            with pytest.raises(err, match=msg):
                ts.UnfreezeSchedule(model, milestones)
            assert flags(model) == before, milestones
        with pytest.raises(TypeError, match="mapping"):
            ts.UnfreezeSchedule(model, [(0, "head")])
        with pytest.raises(TypeError, match="strict"):
            ts.UnfreezeSchedule(model, {0: "head"}, strict=1)
        assert flags(model) == before


def test_schedule_load_bad_state_changes_nothing():
    model = _tower()
    sched = ts.UnfreezeSchedule(model, {0: "head", 2: "blocks.3", 4: None})
    sched.step()
    sched.step()
    sched.step()
    before = flags(model)
    for bad in ({"step": 5, "milestones": [0, 2]}, {"step": -1, "milestones": [0, 2, 4]},
                {"step": 2.0, "milestones": [0, 2, 4]}, {"step": True, "milestones": [0, 2, 4]},
                {"step": 5}, {"step": 5, "milestones": [0, 2, 4], "extra": 1},
                {"step": 5, "milestones": "0,2,4"}, [5, [0, 2, 4]]):
        with pytest.raises((ValueError, TypeError)):
            sched.load_state_dict(bad)
        assert flags(model) == before
        assert (sched.current_step, sched.stage) == (3, 2)
    sched.load_state_dict({"step": torch.tensor(1), "milestones": (0, 2, 4)})  # going back
    assert (sched.current_step, sched.stage) == (1, 1)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["head.weight",
                                                                           "head.bias"]
    sched.close()
    with pytest.raises(RuntimeError, match="closed"):
        sched.load_state_dict({"step": 3, "milestones": [0, 2, 4]})
    with pytest.raises(RuntimeError, match="closed"):
        sched.step()
    assert all(flags(model))


def test_schedule_model_changed_under_it_refuses_the_stage_change_and_keeps_its_step():
    model = _tower()
    sched = ts.UnfreezeSchedule(model, {0: "head", 2: "blocks.3"})
    sched.step()
    del model["blocks"][3]
    before = flags(model)
    with pytest.raises(ValueError, match=r"milestone 2.*'blocks\.3'"):
        sched.step()
    assert (sched.current_step, sched.stage) == (1, 1) and flags(model) == before
    with pytest.raises(ValueError, match="milestone 2"):
        sched.load_state_dict({"step": 7, "milestones": [0, 2]})
    assert (sched.current_step, sched.stage) == (1, 1) and flags(model) == before


def test_schedule_composes_with_hand_writes_and_contexts():
    model = _tower()
    trains = lambda: sorted({".".join(n.split(".")[:2 if n.startswith("blocks") else 1])  # noqa
                             for n, p in model.named_parameters() if p.requires_grad})
    sched = ts.UnfreezeSchedule(model, {0: "head", 1: "blocks.2", 2: None})
    model["head"].bias.requires_grad_(False)  # a write by hand while the schedule holds
    ts.freeze(model, "blocks.3")  # a permanent context entered after the schedule
    sched.step()
    assert trains() == ["blocks.2", "head"] and not model["head"].bias.requires_grad
    with ts.unfreeze(model, "embed"):
        sched.step()  # to "everything" inside an unfreeze block
        assert trains() == ["blocks.0", "blocks.1", "blocks.2", "embed", "head"]
    assert trains() == ["blocks.0", "blocks.1", "blocks.2", "embed", "head"]
    with ts.unfreeze(model, "embed"):
        sched.load_state_dict({"step": 0, "milestones": [0, 1, 2]})
        assert trains() == ["embed", "head"]
    assert trains() == ["head"] and not model["head"].bias.requires_grad
    sched.close()
    assert not model["head"].bias.requires_grad and not model["blocks"][3].weight.requires_grad


class _Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(3, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def test_schedule_copies_of_the_model_are_plain_pytorch():
    model = _Tower()
    sched = ts.UnfreezeSchedule(model, {0: "head", 2: "blocks.2", 3: None})
    twin = copy.deepcopy(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert flags(twin) == flags(loaded) == flags(model) == [False] * 8 + [True, True]
    for other in (twin, loaded):
        other.requires_grad_(True)
        other(torch.randn(2, 3)).sum().backward()  # no hook puts the schedule's flags back
        assert all(flags(other))
    sched.step()
    sched.step()
    assert flags(model) == [False] * 6 + [True] * 4
    assert all(flags(twin)) and all(flags(loaded))
    model.blocks.append(nn.Linear(4, 4))  # a new block follows the stage at the next forward
    model(torch.randn(2, 3))
    assert [p.requires_grad for p in model.blocks[3].parameters()] == [False, False]
    with pytest.warns(ts.RestoredFlagsWarning, match="embed.weight"):
        sched.close()  # documented: flags of a tree changed inside the block, said aloud
    assert all(flags(model))


def test_schedule_on_peft_lora_keeps_the_base_frozen_and_checkpoints_adapters_only():
    model = lora_gpt2()
    start = {n: p.requires_grad for n, p in model.named_parameters()}
    sched = ts.UnfreezeSchedule(model, {0: "base_model.model.transformer.h.2", 2: None})
    trains = lambda: [n for n, p in model.named_parameters() if p.requires_grad]  # noqa: E731
    assert trains() and all(".h.2." in n and ".lora_" in n for n in trains())
    sched.step()
    sched.step()
    assert trains() == [n for n, f in start.items() if f]
    assert list(ts.state_dict(model)) == trains()
    groups = ts.param_groups(model, *ts.layer_decay(model, 0.5))
    assert set(per_param(groups)) == {id(p) for p, _ in unique_params(model)}
    sched.close()
    assert {n: p.requires_grad for n, p in model.named_parameters()} == start


# ============================================================================ checkpoints
def test_gradual_unfreeze_fine_tune_resumed_from_trainable_checkpoint_is_bitwise_equal():
    milestones = {0: "transformer.ln_f", 2: "transformer.h.2",
                  4: ["transformer.h.1", "transformer.h.0"], 6: None}

    def setup(model):
        sched = ts.UnfreezeSchedule(model, milestones)
        opt = ts.optim.AdamW(ts.param_groups(model, *ts.layer_decay(model, 0.6),
                                             weight_decay=0.1), lr=1e-2, max_grad_norm=1.0)
        lrs = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
        return sched, opt, lrs

    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 40, (2, 8), generator=gen) for _ in range(8)]

    def train(model, sched, opt, lrs, bs):
        for b in bs:
            opt.zero_grad()
            model(input_ids=b, labels=b).loss.backward()
            opt.step()
            lrs.step()
            sched.step()

    straight = gpt2()
    train(straight, *setup(straight), batches)
    first = gpt2()
    parts = setup(first)
    train(first, *parts, batches[:5])
    buf = io.BytesIO()
    trainable = ts.state_dict(first)
    assert "lm_head.weight" not in trainable  # tied: at its first path only
    assert set(trainable) == {n for n, p in first.named_parameters() if p.requires_grad}
    torch.save({"model": trainable, "opt": parts[1].state_dict(), "lrs": parts[2].state_dict(),
                "sched": parts[0].state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf)
    resumed = gpt2()
    sched, opt, lrs = setup(resumed)
    sched.load_state_dict(ck["sched"])
    assert ts.load_state_dict(resumed, ck["model"]) == ([], [])
    opt.load_state_dict(ck["opt"])
    lrs.load_state_dict(ck["lrs"])
    train(resumed, sched, opt, lrs, batches[5:])
    for (name, p), q in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name
    assert flags(straight) == flags(resumed)


_BAD = {
    "dtype": lambda s: s.__setitem__("pooler.dense.weight", s["pooler.dense.weight"].half()),
    "shape": lambda s: s.__setitem__("pooler.dense.bias", torch.zeros(17)),
    "scalar": lambda s: s.__setitem__("pooler.dense.bias", torch.zeros(())),
    "not_tensor": lambda s: s.__setitem__("pooler.dense.bias", [0.0] * 16),
    "unknown": lambda s: s.__setitem__("pooler.dense.wieght", s["pooler.dense.weight"]),
    "meta": lambda s: s.__setitem__("pooler.dense.bias", torch.empty(16, device="meta")),
    "non_persistent": lambda s: s.__setitem__("embeddings.position_ids",
                                              torch.arange(32)[None]),
}


@pytest.mark.parametrize("bad", list(_BAD))
def test_checkpoint_bad_entry_writes_nothing_and_names_the_path(bad):
    model = bert()
    ts.freeze(model, "embeddings", "encoder.layer.0")
    state = {k: torch.randn_like(v) if v.is_floating_point() else v.clone()
             for k, v in ts.state_dict(model).items()}
    _BAD[bad](state)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    start = flags(model)
    with pytest.raises(ValueError, match=r"pooler\.dense|position_ids") as info:
        ts.load_state_dict(model, state)
    assert "Nothing was written" in str(info.value)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert flags(model) == start


def test_checkpoint_tied_gpt2_paths():
    model = gpt2()
    state = ts.state_dict(model)
    assert "transformer.wte.weight" in state and "lm_head.weight" not in state
    other = gpt2()
    with torch.no_grad():
        other.transformer.wte.weight.add_(1.0)
    by_head = {("lm_head.weight" if k == "transformer.wte.weight" else k): v
               for k, v in state.items()}
    assert ts.load_state_dict(other, by_head) == ([], [])  # any path of the tied tensor
    assert torch.equal(other.transformer.wte.weight, model.transformer.wte.weight)
    clash = dict(state)
    clash["lm_head.weight"] = state["transformer.wte.weight"] + 1
    keep = other.transformer.wte.weight.detach().clone()
    with pytest.raises(ValueError, match="tied"):
        ts.load_state_dict(other, clash)
    assert torch.equal(other.transformer.wte.weight, keep)
    # a trainable-only checkpoint is refused by a model set up differently (strict) ...
    ts.freeze(other, "transformer.h")
    missing = dict(state)
    del missing["transformer.ln_f.weight"]
    with pytest.raises(ValueError, match=r"missing.*transformer\.ln_f\.weight"):
        ts.load_state_dict(other, missing)
    # ... and allowed with strict=False, reporting the missing key
    got = ts.load_state_dict(other, missing, strict=False)
    assert got.missing_keys == ["transformer.ln_f.weight"]


def test_checkpoint_error_lists_missing_keys_together_with_other_problems():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 3))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["1.weight"] = torch.zeros(4, 2)
    del state["0.weight"]
    with pytest.raises(ValueError) as info:
        ts.load_state_dict(model, state)
    assert "'1.weight'" in str(info.value) and "'0.weight'" in str(info.value)


def test_checkpoint_tied_weight_with_nan_is_not_two_different_values():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(2, 2)
            self.b = nn.Linear(2, 2)
            self.b.weight = self.a.weight

    model = Tied()
    with torch.no_grad():
        model.a.weight[0, 0] = float("nan")
    state = model.state_dict()  # 'a.weight' and 'b.weight': the same values
    assert model.load_state_dict(state) is not None
    ts.load_state_dict(model, state)


def test_checkpoint_buffers_argument_that_is_not_a_bool_is_refused():
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    with pytest.raises(TypeError, match="strict"):
        ts.load_state_dict(model, ts.state_dict(model), strict="no")
    with pytest.raises(TypeError, match="buffers"):
        ts.state_dict(model, buffers="False")
