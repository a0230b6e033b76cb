"""``ts.param_groups``, ``ts.layer_decay``, ``ts.UnfreezeSchedule``, ``ts.is_norm``, selectors
and ``ts.summary`` on a zoo of real architectures, each checked against a brute force written
here (a walk of ``named_parameters()`` / ``named_modules()``).

Models are built from tiny configs in code (nothing is downloaded): transformers Gemma, Gemma2,
Gemma3 (their RMSNorm adds 1 to the weight), Qwen2, Mistral, Phi, Phi3, Llama with tied
embeddings, Bart, Whisper, T5 (custom ``T5LayerNorm``), DistilBert, Electra, DeBERTa-v2,
ConvNext, ConvNextV2, Swin, Mamba, CLIP (two towers), and PEFT LoRA / IA3 / prompt-tuning /
LayerNorm-tuning wrappers of some of them. An architecture whose class the installed
transformers lacks is skipped on its own.

Groups: every parameter lands in exactly one group, tied ones once at their first path, frozen
ones included; ``params`` and ``param_names`` agree; group names are unique readable strings.

No decay: with ``no_decay="auto"`` exactly the biases, the direct parameters of every
normalization layer (the brute force lists each family's norm classes by name and refuses an
unknown norm-looking class with parameters) and the names of a ``no_weight_decay()`` method get
weight decay 0. The result is also compared with HF Trainer's rule (``get_parameter_names`` with
``nn.LayerNorm`` and its name patterns): the differences allowed are listed per model (Swin's
relative position bias table and T5's relative attention bias table decay here; Mamba's final
``norm_f`` does not).

Layer decay: with ``layers=None`` the stack found is the one named here per model; the scales
of every parameter follow ``decay ** (L + 1 - id)`` with ids 0 / 1..L / L+1 taken from the
``named_parameters()`` order; encoder-decoder models, CLIP's two towers and stages holding
longer stacks raise naming the candidates, and ``layers=`` given explicitly works on them.

Schedules and selectors: ``ts.UnfreezeSchedule`` stages on decoder, encoder-decoder, tied and
PEFT models are followed step by step against the expected set of trainable paths, with
``ts.summary`` / ``ts.trainable_parameters`` agreeing with the flags after a forward, and a
``state_dict()`` round trip onto a fresh model. Typos in selectors given to ``freeze``,
``param_groups``, ``UnfreezeSchedule`` and ``layer_decay`` raise naming the intended path and
leave every flag unchanged.

A test marked ``xfail(strict=True)`` reproduces a case that goes wrong today; its reason says
what happens and what is expected.
"""
import fnmatch
import functools
import os
import re
import warnings

import pytest
import torch
from torch import nn

import torchstruct as ts
from test_layer_decay import brute_force as layer_scales_by_brute_force

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

_DEC = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
_SEQ2SEQ = dict(vocab_size=64, d_model=16, encoder_layers=2, decoder_layers=2,
                encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                decoder_ffn_dim=32)

# name: (config class, model class, config kwargs, the layer stack layer_decay should find, or
# the stacks it should refuse to choose between)
SPECS = {
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(_DEC, head_dim=8), "model.layers"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(_DEC, head_dim=8), "model.layers"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(_DEC, head_dim=8, sliding_window=8),
               "model.layers"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _DEC, "model.layers"),
    "mistral": ("MistralConfig", "MistralForCausalLM", _DEC, "model.layers"),
    "phi": ("PhiConfig", "PhiForCausalLM", _DEC, "model.layers"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(_DEC, pad_token_id=0), "model.layers"),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", dict(_DEC, tie_word_embeddings=True),
                   "model.layers"),
    "bart": ("BartConfig", "BartForConditionalGeneration",
             dict(_SEQ2SEQ, max_position_embeddings=32),
             ("model.encoder.layers", "model.decoder.layers")),
    "whisper": ("WhisperConfig", "WhisperForConditionalGeneration",
                dict(_SEQ2SEQ, num_mel_bins=8, max_source_positions=16, max_target_positions=16,
                     pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1),
                ("model.encoder.layers", "model.decoder.layers")),
    "t5": ("T5Config", "T5ForConditionalGeneration",
           dict(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2,
                num_heads=2, relative_attention_num_buckets=8),
           ("encoder.block", "decoder.block")),
    "distilbert": ("DistilBertConfig", "DistilBertForSequenceClassification",
                   dict(vocab_size=64, dim=16, n_layers=2, n_heads=2, hidden_dim=32,
                        max_position_embeddings=32), "distilbert.transformer.layer"),
    "electra": ("ElectraConfig", "ElectraForPreTraining",
                dict(vocab_size=64, embedding_size=8, hidden_size=16, num_hidden_layers=2,
                     num_attention_heads=2, intermediate_size=32, max_position_embeddings=32),
                "electra.encoder.layer"),
    "deberta_v2": ("DebertaV2Config", "DebertaV2ForSequenceClassification",
                   dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32, relative_attention=True,
                        pos_att_type=["p2c", "c2p"], position_buckets=8, max_relative_positions=16,
                        norm_rel_ebd="layer_norm", conv_kernel_size=3),
                   "deberta.encoder.layer"),
    "convnext": ("ConvNextConfig", "ConvNextForImageClassification",
                 dict(num_channels=3, hidden_sizes=[8, 16], depths=[2, 2], num_stages=2,
                      image_size=32, num_labels=3), "convnext.encoder.stages"),
    "swin": ("SwinConfig", "SwinForImageClassification",
             dict(image_size=32, patch_size=4, embed_dim=8, depths=[2, 2], num_heads=[1, 2],
                  window_size=2, num_labels=3), "swin.encoder.layers"),
    "mamba": ("MambaConfig", "MambaForCausalLM",
              dict(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2,
                   conv_kernel=2), "backbone.layers"),
    "clip": ("CLIPConfig", "CLIPModel",
             dict(text_config=dict(vocab_size=64, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=2, num_attention_heads=2,
                                   max_position_embeddings=16),
                  vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, image_size=16, patch_size=8),
                  projection_dim=8),
             ("text_model.encoder.layers", "vision_model.encoder.layers")),
}
ZOO = sorted(SPECS)

# The normalization classes of these families, by class name (the brute force's own list).
NORM_CLASSES = {
    "LayerNorm", "GroupNorm", "BatchNorm1d", "BatchNorm2d", "RMSNorm", "GemmaRMSNorm",
    "Gemma2RMSNorm", "Gemma3RMSNorm", "Qwen2RMSNorm", "MistralRMSNorm", "Phi3RMSNorm",
    "LlamaRMSNorm", "T5LayerNorm", "ConvNextLayerNorm", "MambaRMSNorm",
}

# Parameters where HF Trainer's rule and "auto" differ, on purpose (see the docs of groups):
# (decayed here but not by the Trainer, not decayed here but by the Trainer).
HF_DIFFERENCES = {
    "swin": (r".*relative_position_bias_table", None),
    "t5": (r".*relative_attention_bias\.weight", None),
    "mamba": (None, r"backbone\.norm_f\.weight"),
}


def _make(name, **overrides):
    config_cls, model_cls, kwargs, _ = SPECS[name]
    cfg_cls = getattr(transformers, config_cls, None)
    cls = getattr(transformers, model_cls, None)
    if cfg_cls is None or cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {model_cls}")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(cfg_cls(**dict(kwargs, **overrides)))


@functools.lru_cache(maxsize=None)
def _cached(name):
    """One model per architecture for the read-only tests (nothing here writes a flag)."""
    return _make(name)


def zoo(name):
    model = _cached(name)
    assert all(p.requires_grad for n, p in model.named_parameters()
               if not n.endswith("embed_positions.weight")), "a test left a flag changed"
    return model


# ----------------------------------------------------------------------------- brute force
def canonical(model):
    """[(path, param)]: each parameter object once, at its first path (remove_duplicate=False
    walk written out)."""
    seen, out = set(), []
    for path, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen.add(id(p))
            out.append((path, p))
    return out


def is_bias_name(name):
    return name == "bias" or name.endswith("_bias") or name.startswith("bias_")


def _prefixes(path):
    """The path and the paths of the modules above it: a pattern naming a module selects its
    subtree."""
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def brute_no_decay(model, extra=()):
    """Paths that "auto" should exempt: biases, direct parameters of a known norm class, and
    ``extra`` (no_weight_decay names already made absolute, fnmatch patterns or prefixes)."""
    modules = dict(model.named_modules(remove_duplicate=False))
    for path, m in modules.items():  # the list above must know every norm-looking class
        own = list(m.parameters(recurse=False))
        if own and "norm" in type(m).__name__.lower():
            assert type(m).__name__ in NORM_CLASSES, f"unknown norm class {type(m).__name__}"
    out = set()
    for path, _ in canonical(model):
        parent, _, last = path.rpartition(".")
        if is_bias_name(last) or type(modules[parent]).__name__ in NORM_CLASSES:
            out.add(path)
        elif any(fnmatch.fnmatchcase(prefix, pat) for pat in extra for prefix in _prefixes(path)):
            out.add(path)
    return out


def check_partition(model, groups):
    """Every canonical parameter in exactly one group; params and param_names agree; names
    unique and readable. Returns {path: group}."""
    canon = canonical(model)
    where = {}
    for g in groups:
        assert len(g["params"]) == len(g["param_names"]) > 0
        for path, p in zip(g["param_names"], g["params"]):
            assert path not in where, f"{path} in two groups"
            where[path] = g
            assert dict(canon)[path] is p
    assert list(where) != [] and set(where) == {path for path, _ in canon}
    # each group lists its parameters in named_parameters() order
    order = {path: i for i, (path, _) in enumerate(canon)}
    for g in groups:
        assert [order[n] for n in g["param_names"]] == sorted(order[n] for n in g["param_names"])
    names = [g["name"] for g in groups]
    assert len(set(names)) == len(names)
    for n in names:
        assert isinstance(n, str) and n.isprintable() and "0x" not in n and "object at" not in n
    return where


def hf_no_decay(model):
    pytest.importorskip("transformers")
    from transformers.trainer_pt_utils import get_parameter_names

    patterns = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]
    decay = set(get_parameter_names(model, [nn.LayerNorm], patterns))
    return {path for path, _ in canonical(model)} - decay


def trainable_paths(model):
    return {n for n, p in canonical(model) if p.requires_grad}


def counts(model):
    canon = canonical(model)
    return (sum(p.numel() for _, p in canon if p.requires_grad), sum(p.numel() for _, p in canon))


def agree(model):
    """Flags, ts.trainable_parameters and ts.summary all say the same."""
    said = {n for n, _ in ts.trainable_parameters(model)}
    assert said == trainable_paths(model)
    assert ts.summary(model).counts == counts(model)


# ------------------------------------------------------------------------------- groups
@pytest.mark.parametrize("name", ZOO)
def test_auto_no_decay_is_exactly_biases_and_norms(name):
    model = zoo(name)
    groups = ts.param_groups(model, weight_decay=0.1)
    where = check_partition(model, groups)
    exempt = {path for path, g in where.items() if g["weight_decay"] == 0.0}
    assert exempt == brute_no_decay(model)
    for path, g in where.items():
        assert g["weight_decay"] == (0.0 if path in exempt else 0.1)
        assert g["name"] == ("default (no decay)" if path in exempt else "default")


@pytest.mark.parametrize("name", ZOO)
def test_auto_no_decay_against_hf_trainer(name):
    model = zoo(name)
    groups = ts.param_groups(model, weight_decay=0.1)
    ours = {n for g in groups if g["weight_decay"] == 0.0 for n in g["param_names"]}
    hf = hf_no_decay(model)
    only_hf, only_ours = HF_DIFFERENCES.get(name, (None, None))
    assert {p for p in hf - ours} == {p for p in hf if only_hf and re.fullmatch(only_hf, p)}
    assert {p for p in ours - hf} == {p for p in ours if only_ours and re.fullmatch(only_ours, p)}


@pytest.mark.parametrize("name", ["llama_tied", "t5", "bart", "whisper"])
def test_tied_parameters_once_at_first_path(name):
    model = zoo(name)
    all_paths = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    canon = canonical(model)
    assert len(all_paths) > len(canon)  # the model really ties something
    groups = ts.param_groups(model, ("lm_head" if name != "whisper" else "proj_out",
                                     {"lr": 0.5}), weight_decay=0.0)
    where = check_partition(model, groups)
    head = model.get_output_embeddings().weight
    first = next(n for n, p in canon if p is head)
    assert first != "lm_head.weight" and where[first]["lr"] == 0.5
    assert sum(p is head for g in groups for p in g["params"]) == 1


def test_frozen_parameters_are_grouped():
    model = zoo("whisper")  # its encoder's sinusoidal positions are frozen by the model
    frozen = [n for n, p in canonical(model) if not p.requires_grad]
    assert frozen == ["model.encoder.embed_positions.weight"]
    where = check_partition(model, ts.param_groups(model, weight_decay=0.1))
    assert where[frozen[0]]["name"] == "default"


def test_rules_names_and_first_rule_wins_on_qwen2():
    model = zoo("qwen2")
    groups = ts.param_groups(
        model,
        (re.compile(r".*\.q_proj\..*"), {"lr": 1.0}),
        (["lm_head", model.model.norm], {"lr": 2.0}),
        (lambda path, p: p.ndim == 1, {"lr": 3.0, "name": "vectors"}),
        ("model.layers.1", {"weight_decay": 0.3}),
        weight_decay=0.1)
    where = check_partition(model, groups)
    for path, p in canonical(model):
        g = where[path]
        if re.fullmatch(r".*\.q_proj\..*", path):
            want = 1.0
        elif path.startswith(("lm_head.", "model.norm.")):
            want = 2.0
        elif p.ndim == 1:
            want = 3.0
        else:
            want = None
        assert g.get("lr") == want, path
        if want is None and path.startswith("model.layers.1."):
            assert g["weight_decay"] == 0.3  # a rule with its own weight decay is not split
    assert "vectors (no decay)" in {g["name"] for g in groups}
    assert "vectors" not in {g["name"] for g in groups}  # all its members are exempt


@pytest.mark.parametrize("name", ["gemma", "gemma3", "t5", "mamba", "convnext"])
def test_is_norm_on_each_family(name):
    model = zoo(name)
    for _, m in model.named_modules():
        assert ts.is_norm(m) == (type(m).__name__ in NORM_CLASSES), type(m).__name__
    assert any(ts.is_norm(m) for m in model.modules())


def test_no_weight_decay_of_a_submodule_is_relative_to_it():
    model = _make("clip")
    emb = model.vision_model.embeddings
    emb.no_weight_decay = lambda: {"class_embedding", "position_embedding", "no_such_token"}
    groups = ts.param_groups(model, weight_decay=0.1)
    exempt = {n for g in groups if g["weight_decay"] == 0.0 for n in g["param_names"]}
    extra = ("vision_model.embeddings.class_embedding",
             "vision_model.embeddings.position_embedding")
    assert exempt == brute_no_decay(model, extra)
    assert "text_model.embeddings.position_embedding.weight" not in exempt


def test_no_weight_decay_glob_on_a_model():
    model = _make("gemma2")
    model.no_weight_decay = lambda: ["*.embed_tokens"]
    exempt = {n for g in ts.param_groups(model, weight_decay=0.1) if g["weight_decay"] == 0.0
              for n in g["param_names"]}
    assert exempt == brute_no_decay(model, ("*.embed_tokens",))
    assert "model.embed_tokens.weight" in exempt


def test_convnextv2_grn_weight_is_not_decayed():
    cls = getattr(transformers, "ConvNextV2ForImageClassification", None)
    if cls is None:
        pytest.skip("no ConvNextV2 in this transformers")
    model = cls(transformers.ConvNextV2Config(num_channels=3, hidden_sizes=[8, 16],
                                              depths=[1, 1], num_stages=2, image_size=32,
                                              num_labels=3))
    grn = [n for n, _ in model.named_parameters() if ".grn." in n]
    assert grn
    exempt = {n for g in ts.param_groups(model, weight_decay=0.1) if g["weight_decay"] == 0.0
              for n in g["param_names"]}
    assert set(grn) <= exempt


# --------------------------------------------------------------------------- layer decay
@pytest.mark.parametrize("name", ZOO)
def test_layer_decay_auto(name):
    model = zoo(name)
    stack = SPECS[name][3]
    if isinstance(stack, tuple):  # side by side: must refuse, naming both
        with pytest.raises(ValueError, match="layers=") as e:
            ts.layer_decay(model, 0.5)
        for s in stack:
            assert repr(s) in str(e.value)
        return
    rules = ts.layer_decay(model, 0.5)
    assert [o["name"] for _, o in rules][1:-1] == [
        f"{stack}.{i}" for i in range(len(model.get_submodule(stack)))]
    groups = ts.param_groups(model, *rules, weight_decay=0.05)
    where = check_partition(model, groups)
    want = layer_scales_by_brute_force(model, stack, 0.5)
    assert {n: g["lr_scale"] for n, g in where.items()} == want
    nd = brute_no_decay(model)
    assert {n for n, g in where.items() if g["weight_decay"] == 0.0} == nd


@pytest.mark.parametrize("name,stack", [
    ("bart", "model.encoder.layers"), ("bart", "model.decoder.layers"),
    ("whisper", "model.decoder.layers"), ("t5", "encoder.block"), ("t5", "decoder.block"),
    ("clip", "vision_model.encoder.layers"), ("clip", "text_model.encoder.layers"),
])
def test_layer_decay_explicit_layers(name, stack):
    model = zoo(name)
    for layers in (stack, model.get_submodule(stack)):
        groups = ts.param_groups(model, *ts.layer_decay(model, 0.75, layers=layers))
        where = check_partition(model, groups)
        want = layer_scales_by_brute_force(model, stack, 0.75)
        got = {n: g["lr_scale"] for n, g in where.items()}
        assert got.keys() == want.keys()
        for n in want:
            assert got[n] == pytest.approx(want[n], rel=1e-12), n


def test_layer_decay_tied_head_takes_embedding_id():
    model = zoo("llama_tied")
    groups = ts.param_groups(model, *ts.layer_decay(model, 0.5))
    where = check_partition(model, groups)
    assert "lm_head.weight" not in where
    assert where["model.embed_tokens.weight"]["lr_scale"] == 0.5 ** 4
    assert where["model.norm.weight"]["lr_scale"] == 1.0


def test_layer_decay_head_rule_first_wins():
    model = zoo("mistral")
    groups = ts.param_groups(model, ("lm_head", {"lr": 1e-2}), *ts.layer_decay(model, 0.5))
    where = check_partition(model, groups)
    want = layer_scales_by_brute_force(model, "model.layers", 0.5)
    for n, g in where.items():
        if n == "lm_head.weight":
            assert g["lr"] == 1e-2 and "lr_scale" not in g
        else:
            assert g["lr_scale"] == want[n]


def test_layer_decay_more_than_ten_blocks():
    model = _make("qwen2", num_hidden_layers=12)
    rules = ts.layer_decay(model, 0.9)
    where = check_partition(model, ts.param_groups(model, *rules))
    want = layer_scales_by_brute_force(model, "model.layers", 0.9)
    assert {n: g["lr_scale"] for n, g in where.items()} == pytest.approx(want)
    assert [p for p, _ in ts.select(model, "model.layers.1")] == [
        p for p, _ in canonical(model) if p.startswith("model.layers.1.")]


@pytest.mark.parametrize("name,kw", [
    ("swin", dict(depths=[1, 3], num_heads=[1, 2])),
    ("convnext", dict(depths=[1, 3])),
])
def test_layer_decay_stages_holding_longer_stacks_refuse(name, kw):
    model = _make(name, **kw)
    with pytest.raises(ValueError, match="layers="):
        ts.layer_decay(model, 0.5)
    stack = SPECS[name][3] + ".1." + ("blocks" if name == "swin" else "layers")
    # the inner stack of one stage, explicitly
    where = check_partition(model, ts.param_groups(model, *ts.layer_decay(model, 0.5,
                                                                         layers=stack)))
    want = layer_scales_by_brute_force(model, stack, 0.5)
    assert {n: g["lr_scale"] for n, g in where.items()} == want


# --------------------------------------------------------------------------------- PEFT
def _peft_model(kind):
    peft = pytest.importorskip("peft")
    if kind == "lora_llama":
        return peft.get_peft_model(_make("llama_tied"), peft.LoraConfig(
            r=2, target_modules=["q_proj", "v_proj"])), "base_model.model.model.layers"
    if kind == "lora_bart":
        return peft.get_peft_model(_make("bart"), peft.LoraConfig(
            r=2, target_modules=["q_proj", "v_proj"], bias="lora_only")), None
    if kind == "ia3_t5":
        return peft.get_peft_model(_make("t5"), peft.IA3Config(
            task_type="SEQ_2_SEQ_LM", target_modules=["k", "v", "wo"],
            feedforward_modules=["wo"])), None
    if kind == "prompt_qwen2":
        return peft.get_peft_model(_make("qwen2"), peft.PromptTuningConfig(
            task_type="CAUSAL_LM", num_virtual_tokens=4)), "base_model.model.layers"
    if kind == "lora_distilbert":
        return peft.get_peft_model(_make("distilbert"), peft.LoraConfig(
            task_type="SEQ_CLS", r=2, target_modules=["q_lin", "v_lin"])), \
            "base_model.model.distilbert.transformer.layer"
    if kind == "lntune_gemma":
        return peft.get_peft_model(_make("gemma"), peft.LNTuningConfig(
            task_type="CAUSAL_LM", target_modules=["input_layernorm", "norm"])), \
            "base_model.model.model.layers"
    raise AssertionError(kind)


@functools.lru_cache(maxsize=None)
def _peft_cached(kind):
    return _peft_model(kind)


PEFT_KINDS = ["lora_llama", "lora_bart", "ia3_t5", "prompt_qwen2", "lora_distilbert",
              "lntune_gemma"]


@pytest.mark.parametrize("kind", PEFT_KINDS)
def test_peft_groups_layer_decay_and_summary(kind):
    model, stack = _peft_cached(kind)
    before = [p.requires_grad for p in model.parameters()]
    groups = ts.param_groups(model, weight_decay=0.1)
    where = check_partition(model, groups)
    assert {n for n, g in where.items() if g["weight_decay"] == 0.0} == brute_no_decay(model)
    adapters = [n for n, p in canonical(model) if p.requires_grad]
    assert adapters and all(where[n]["weight_decay"] == 0.1 for n in adapters
                            if not is_bias_name(n.rpartition(".")[2])
                            and ".ln_tuning_layers." not in n)
    if stack is None:
        with pytest.raises(ValueError, match="layers="):
            ts.layer_decay(model, 0.5)
    else:
        where = check_partition(model, ts.param_groups(model, *ts.layer_decay(model, 0.5)))
        assert {n: g["lr_scale"] for n, g in where.items()} == layer_scales_by_brute_force(
            model, stack, 0.5)
    assert ts.summary(model).counts == counts(model)
    assert {n for n, _ in ts.trainable_parameters(model)} == set(adapters)
    assert [p.requires_grad for p in model.parameters()] == before  # read-only calls


def test_no_weight_decay_under_peft_is_relative_to_the_wrapped_model():
    peft = pytest.importorskip("peft")

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.pos_embed = nn.Parameter(torch.zeros(4))
            self.proj = nn.Linear(4, 4)
            self.head = nn.Linear(4, 2)

        def no_weight_decay(self):
            return {"pos_embed", "emb"}

        def forward(self, x):
            return self.head(self.proj(self.emb(x) + self.pos_embed))

    model = peft.get_peft_model(Net(), peft.LoraConfig(r=2, target_modules=["proj"]))
    exempt = {n for g in ts.param_groups(model, weight_decay=0.1) if g["weight_decay"] == 0.0
              for n in g["param_names"]}
    assert exempt == brute_no_decay(model, ("base_model.model.pos_embed",
                                            "base_model.model.emb"))


# ----------------------------------------------------------------------------- schedules
def _forward(name, model):
    if name in ("qwen2", "llama_tied", "mistral", "lora_llama"):
        model(input_ids=torch.randint(0, 64, (1, 5)))
    elif name == "bart":
        model(input_ids=torch.randint(3, 64, (1, 5)),
              decoder_input_ids=torch.randint(3, 64, (1, 4)))
    else:
        raise AssertionError(name)


def _expected(model, selected_paths_fn):
    return {n for n, p in canonical(model) if selected_paths_fn(n)}


def test_unfreeze_schedule_on_qwen2_step_by_step_and_resume():
    model = _make("qwen2")
    milestones = {0: "lm_head", 2: "model.layers.2",
                  4: ["model.layers.1", re.compile(r"model\.norm\..*")], 6: None}
    s = ts.UnfreezeSchedule(model, milestones)
    stages = [
        (0, lambda n: n.startswith("lm_head.")),
        (2, lambda n: n.startswith(("lm_head.", "model.layers.2."))),
        (4, lambda n: n.startswith(("lm_head.", "model.layers.2.", "model.layers.1.",
                                    "model.norm."))),
        (6, lambda n: True),
    ]
    try:
        seen = []
        for step in range(8):
            want = next(f for at, f in reversed(stages) if step >= at)
            assert s.current_step == step
            assert trainable_paths(model) == _expected(model, want), step
            _forward("qwen2", model)
            assert trainable_paths(model) == _expected(model, want), step
            agree(model)
            seen.append(s.stage)
            if step == 5:
                state = s.state_dict()
            s.step()
        assert seen == [1, 1, 2, 2, 3, 3, 4, 4]
    finally:
        s.close()
    assert all(p.requires_grad for p in model.parameters())

    fresh = _make("qwen2")
    r = ts.UnfreezeSchedule(fresh, milestones)
    try:
        r.load_state_dict(state)
        assert r.current_step == 5 and r.stage == 3
        assert trainable_paths(fresh) == _expected(fresh, stages[2][1])
        agree(fresh)
        r.step()
        assert all(p.requires_grad for p in fresh.parameters())
    finally:
        r.close()


def test_unfreeze_schedule_tied_head_selects_embedding():
    model = _make("llama_tied")
    s = ts.UnfreezeSchedule(model, {0: "lm_head", 1: "model.layers.0"})
    try:
        assert trainable_paths(model) == {"model.embed_tokens.weight"}
        _forward("llama_tied", model)
        agree(model)
        s.step()
        assert trainable_paths(model) == {"model.embed_tokens.weight"} | {
            n for n, _ in canonical(model) if n.startswith("model.layers.0.")}
        agree(model)
        assert ts.summary(model).counts == counts(model)
    finally:
        s.close()
    assert all(p.requires_grad for p in model.parameters())


def test_unfreeze_schedule_on_bart_encoder_decoder():
    model = _make("bart")
    s = ts.UnfreezeSchedule(model, {0: "model.decoder.layers.1", 2: "model.decoder", 3: "*"})
    try:
        for step, want in [(0, lambda n: n.startswith("model.decoder.layers.1.")),
                           (1, lambda n: n.startswith("model.decoder.layers.1.")),
                           (2, lambda n: n.startswith("model.decoder.")),
                           (3, lambda n: True)]:
            # the shared embedding's first path is model.shared.weight: selected via the
            # decoder's embed_tokens path from stage 2 on
            exp = _expected(model, want)
            if step >= 2:
                exp.add("model.shared.weight")
            assert trainable_paths(model) == exp, step
            _forward("bart", model)
            agree(model)
            s.step()
    finally:
        s.close()
    assert all(p.requires_grad for p in model.parameters())


def test_unfreeze_schedule_on_lora_keeps_peft_frozen_base():
    model, _ = _peft_model("lora_llama")
    base_flags = {n: p.requires_grad for n, p in canonical(model)}
    s = ts.UnfreezeSchedule(model, {0: "*.lora_B", 2: None})
    try:
        assert trainable_paths(model) == {n for n in base_flags if ".lora_B." in n}
        _forward("lora_llama", model)
        agree(model)
        s.step()
        s.step()
        assert trainable_paths(model) == {n for n, f in base_flags.items() if f}
        _forward("lora_llama", model)
        agree(model)
        sd = s.state_dict()
    finally:
        s.close()
    assert {n: p.requires_grad for n, p in canonical(model)} == base_flags
    assert sd["step"] == 2


# --------------------------------------------------------------------- typos / bad input
@pytest.mark.parametrize("bad,close", [
    ("model.layer.1", "model.layers.1"),
    ("model.layers.1.self_atn", "model.layers.1.self_attn"),
    ("lm_haed", "lm_head"),
    ("model.layers.1.mlp.up_proj.wieght", "model.layers.1.mlp.up_proj.weight"),
])
def test_typos_raise_with_close_matches_and_change_nothing(bad, close):
    model = _make("qwen2")
    model.model.layers[0].mlp.requires_grad_(False)  # a starting flag to keep
    flags = [p.requires_grad for p in model.parameters()]
    for call in (lambda: ts.freeze(model, bad), lambda: ts.freeze_except(model, bad),
                 lambda: ts.unfreeze(model, bad), lambda: ts.param_groups(model, (bad, {})),
                 lambda: ts.UnfreezeSchedule(model, {0: "lm_head", 3: bad}),
                 lambda: ts.param_groups(model, no_decay=bad)):
        with pytest.raises(ValueError) as e:
            call()
        assert repr(close) in str(e.value)
        assert [p.requires_grad for p in model.parameters()] == flags
    agree(model)


def test_typo_in_layers_and_in_a_peft_path():
    model = zoo("bart")
    with pytest.raises(ValueError, match=re.escape("'model.encoder.layers'")):
        ts.layer_decay(model, 0.5, layers="model.encoder.layer")
    peft_model, _ = _peft_cached("lora_llama")
    flags = [p.requires_grad for p in peft_model.parameters()]
    with pytest.raises(ValueError) as e:
        ts.freeze(peft_model, "base_model.model.model.layers.0.self_attn.q_proj.lora_a")
    assert "'base_model.model.model.layers.0.self_attn.q_proj.lora_A'" in str(e.value)
    assert [p.requires_grad for p in peft_model.parameters()] == flags


# ------------------------------------------------------------------------------- summary
def _brute_row(model, path):
    """(trainable, total) of the subtree at ``path``, each parameter at its first path."""
    inside = [p for n, p in canonical(model) if not path or n == path or n.startswith(path + ".")]
    return sum(p.numel() for p in inside if p.requires_grad), sum(p.numel() for p in inside)


@pytest.mark.parametrize("name", ["llama_tied", "bart", "swin", "t5", "whisper", "mamba"])
def test_summary_rows_against_brute_force(name):
    model = _make(name)
    with ts.freeze(model, lambda path, p: p.ndim == 1):
        assert trainable_paths(model) != {n for n, _ in canonical(model)}
        s = ts.summary(model)
        assert s.counts == counts(model)
        repeats = []  # (first block path, how many) of the collapsed rows above
        for r in s.rows:
            repeats = [(p, k) for p, k in repeats if r.path.startswith(p + ".")]
            if r.tied_to is not None:
                assert r.is_param and r.tied_to == next(
                    n for n, p in canonical(model) if p is model.get_parameter(r.path))
                continue
            copies = [r.path]
            if r.repeat > 1:
                head, _, idx = r.path.rpartition(".")
                copies = [f"{head}.{int(idx) + i}" for i in range(r.repeat)]
            for first, k in repeats:
                head, _, idx = first.rpartition(".")
                copies = [f"{head}.{int(idx) + i}" + c[len(first):] for i in range(k)
                          for c in copies]
            want = [sum(x) for x in zip(*(_brute_row(model, c) for c in copies))]
            assert [r.trainable, r.total] == want, r.path
            if r.repeat > 1:
                repeats.append((r.path, r.repeat))
        tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {
            n for n, _ in canonical(model)}
        assert {r.path for r in s.rows if r.tied_to is not None} <= tied
    assert all(p.requires_grad for n, p in model.named_parameters()
               if not n.endswith("embed_positions.weight"))
