"""Tests for ts.state_dict / ts.load_state_dict: trainable-only checkpoints."""

import io
import os

import pytest
import torch
from torch import nn

import torchstruct as ts


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.conv = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6))  # frozen below
        self.body = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.ReLU())  # trains
        self.stats = nn.BatchNorm1d(6, affine=False)  # no parameters: statistics always update
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.ones(1))  # root owns no parameter: never included
        self.body[0].register_buffer("cache", torch.zeros(3), persistent=False)

    def forward(self, tokens):
        h = self.embed(tokens).mean(1)
        return self.head(self.stats(self.body(self.conv(h)))) * self.scale


def make():
    torch.manual_seed(0)
    return Net()


FROZEN = ("conv",)


def tokens(seed=1):
    return torch.randint(0, 10, (8, 5), generator=torch.Generator().manual_seed(seed))


def train(model, steps=3):
    opt = ts.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    for i in range(steps):
        opt.zero_grad()
        model(tokens(i)).pow(2).mean().backward()
        opt.step()


def snapshot(model):
    return {k: v.clone() for k, v in model.state_dict(keep_vars=False).items()}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_keys_are_exactly_what_training_can_change():
    m = make()
    with ts.freeze(m, *FROZEN):
        sd = ts.state_dict(m)
    assert list(sd) == [
        "embed.weight", "body.0.weight", "body.0.bias", "body.1.weight", "body.1.bias",
        "body.1.running_mean", "body.1.running_var", "body.1.num_batches_tracked",
        "stats.running_mean", "stats.running_var", "stats.num_batches_tracked",
    ]
    # the tied head weight appears once, at its first path; frozen BN stats, the root's buffer
    # and the non-persistent buffer are left out
    with ts.freeze(m, *FROZEN):
        assert list(ts.state_dict(m, buffers=False)) == [
            "embed.weight", "body.0.weight", "body.0.bias", "body.1.weight", "body.1.bias"]
    full = ts.state_dict(m)  # nothing frozen: the frozen BN's statistics come in too
    assert "conv.1.running_mean" in full and "scale" not in full and "head.weight" not in full


def test_keys_match_brute_force_and_tensors_share_storage():
    m = make()
    m.body[1].bias.requires_grad_(False)  # a partly trainable BN still owns a trainable one
    with ts.freeze_except(m, "body"):
        sd = ts.state_dict(m)
        trainable = {n for n, p in m.named_parameters() if p.requires_grad}
    owners = {"body.0", "body.1", "stats"}
    want = trainable | {f"{o}.{b}" for o in owners for b, _ in
                        m.get_submodule(o).named_buffers(recurse=False) if b != "cache"}
    assert set(sd) == want
    for k, v in sd.items():
        ref = m.state_dict(keep_vars=True)[k]
        assert v.data_ptr() == ref.data_ptr() and not v.requires_grad


def test_round_trip_into_a_fresh_model_reproduces_outputs(tmp_path):
    m = make()
    with ts.freeze(m, *FROZEN):
        train(m)
        torch.save(ts.state_dict(m), tmp_path / "t.pt")
    fresh = make()  # same pretrained (frozen) weights, nothing trained
    x = tokens(7)
    m.eval(), fresh.eval()
    assert not torch.equal(m(x), fresh(x))
    with ts.freeze(fresh, *FROZEN):
        got = ts.load_state_dict(fresh, torch.load(tmp_path / "t.pt"))
    assert got.missing_keys == [] and got.unexpected_keys == []
    assert torch.equal(m(x), fresh(x))
    m.train(), fresh.train()
    assert torch.equal(m(x), fresh(x))
    assert same(snapshot(m), snapshot(fresh))


def test_frozen_parameters_and_a_full_state_dict_load_too():
    a, b = make(), make()
    train(a)
    with ts.freeze(b, *FROZEN):
        ts.load_state_dict(b, a.state_dict())  # every key, tied ones twice with equal values
    assert same(snapshot(a), snapshot(b))


def test_tied_parameter_under_its_other_path():
    a, b = make(), make()
    train(a)
    with ts.freeze_except(b, "embed"):
        ts.load_state_dict(b, {"head.weight": a.embed.weight.detach()}, buffers=False)
    assert torch.equal(b.embed.weight, a.embed.weight) and b.head.weight is b.embed.weight


def test_strict_false_allows_missing_keys_only():
    a, b = make(), make()
    train(a)
    sd = ts.state_dict(a)
    del sd["body.1.weight"], sd["stats.running_var"]
    with pytest.raises(ValueError, match="missing 2 key"):
        ts.load_state_dict(b, sd)
    got = ts.load_state_dict(b, sd, strict=False)
    assert set(got.missing_keys) == {"body.1.weight", "stats.running_var"}
    assert torch.equal(b.body[0].weight, a.body[0].weight)
    assert not torch.equal(b.body[1].weight, a.body[1].weight)


def test_buffers_false_checkpoint_loads_with_buffers_false():
    a, b = make(), make()
    train(a)
    sd = ts.state_dict(a, buffers=False)
    with pytest.raises(ValueError, match="running_mean"):
        ts.load_state_dict(b, sd)
    ts.load_state_dict(b, sd, buffers=False)
    assert torch.equal(b.body[0].weight, a.body[0].weight)


# ----------------------------------------------------------------------------- bad input
def _bad_states(good):
    bad_shape = dict(good, **{"body.0.weight": torch.zeros(6, 5)})
    bad_dtype = dict(good, **{"body.0.bias": torch.zeros(6, dtype=torch.float64)})
    return {
        "unknown key": (dict(good, **{"body.0.wieght": torch.zeros(6, 6)}),
                        ["'body.0.wieght'", "closest", "'body.0.weight'"]),
        "shape": (bad_shape, ["'body.0.weight'", "(6, 5)", "(6, 6)"]),
        "shape, strict=False": (bad_shape, ["(6, 5)"]),
        "dtype": (bad_dtype, ["'body.0.bias'", "torch.float64", "torch.float32"]),
        "not a tensor": (dict(good, **{"body.0.bias": [0.0] * 6}), ["'body.0.bias'", "list"]),
        "meta": (dict(good, **{"body.0.bias": torch.zeros(6, device="meta")}), ["meta"]),
        "tied differ": (dict(good, **{"head.weight": torch.zeros(10, 6)}), ["tied"]),
        "missing": ({k: v for k, v in good.items() if k != "embed.weight"},
                    ["missing", "'embed.weight'"]),
    }


@pytest.mark.parametrize("case", list(_bad_states({})))
def test_bad_input_raises_and_writes_nothing(case):
    a, b = make(), make()
    train(a)
    good = {k: v.clone() for k, v in ts.state_dict(a).items()}
    state, words = _bad_states(good)[case]
    before = snapshot(b)
    flags = [p.requires_grad for p in b.parameters()]
    with pytest.raises(ValueError) as info:
        ts.load_state_dict(b, state, strict=not case.endswith("strict=False"))
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    assert "Nothing was written" in str(info.value)
    assert same(snapshot(b), before)  # the good keys were not written either
    assert [p.requires_grad for p in b.parameters()] == flags


@pytest.mark.parametrize("args, error, words", [
    (("not a module", {}), TypeError, ["nn.Module"]),
    ((None, [("a", torch.zeros(1))]), TypeError, ["mapping"]),
    ((None, {1: torch.zeros(1)}), TypeError, ["str"]),
])
def test_bad_arguments(args, error, words):
    m = make()
    before = snapshot(m)
    model, state = args
    with pytest.raises(error) as info:
        ts.load_state_dict(m if model is None else model, state)
    assert all(w in str(info.value) for w in words)
    assert same(snapshot(m), before)
    with pytest.raises(TypeError, match="nn.Module"):
        ts.state_dict("not a module")


def test_model_on_meta_is_refused():
    a = make()
    with torch.device("meta"):
        b = Net()
    with pytest.raises(ValueError, match="materialize"):
        ts.load_state_dict(b, ts.state_dict(a), strict=False)


def test_errors_list_several_problems_at_once():
    a, b = make(), make()
    sd = dict(ts.state_dict(a), x1=torch.zeros(1), x2=torch.zeros(1))
    sd["body.0.bias"] = torch.zeros(2)
    with pytest.raises(ValueError) as info:
        ts.load_state_dict(b, sd)
    msg = str(info.value)
    assert "'x1'" in msg and "'x2'" in msg and "(2,)" in msg


# ----------------------------------------------------------------------------- PEFT LoRA
def _lora_model():
    os.environ["HF_HUB_OFFLINE"] = "1"
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                  bos_token_id=0, eos_token_id=0)
    base = transformers.GPT2LMHeadModel(cfg)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0,
                           fan_in_fan_out=True,
                           init_lora_weights=False)
    return peft.get_peft_model(base, lora), peft


def test_peft_lora_checkpoint_holds_only_the_lora_weights_and_round_trips():
    model, peft = _lora_model()
    sd = ts.state_dict(model)
    assert sd and all(".lora_A." in k or ".lora_B." in k for k in sd)
    want = peft.get_peft_model_state_dict(model)
    assert len(sd) == len(want) == 4  # 2 layers x (lora_A, lora_B)
    assert sum(v.numel() for v in sd.values()) == sum(v.numel() for v in want.values())
    full = model.state_dict()
    size = sum(v.numel() * v.element_size() for v in sd.values())
    full_size = sum(v.numel() * v.element_size() for v in full.values())
    assert size < 0.1 * full_size

    buf = io.BytesIO()
    torch.save(sd, buf)
    fresh, _ = _lora_model()  # same base weights (same seed); its LoRA weights are reset below
    with torch.no_grad():
        for k, v in ts.state_dict(fresh).items():
            v.normal_()
    x = torch.randint(0, 64, (2, 8))
    model.eval(), fresh.eval()
    assert not torch.equal(model(x).logits, fresh(x).logits)
    buf.seek(0)
    ts.load_state_dict(fresh, torch.load(buf))
    assert torch.equal(model(x).logits, fresh(x).logits)


def test_lazy_parameters_are_refused():
    lazy = nn.Sequential(nn.LazyLinear(2))
    with pytest.raises(ValueError, match="UninitializedParameter"):
        ts.load_state_dict(lazy, {"0.weight": torch.zeros(2, 3)}, strict=False)
