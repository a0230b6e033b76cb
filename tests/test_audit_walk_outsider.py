"""Outside audit of ``ts.map_trainable``, ``ts.polyak_update`` and ``ts.within_gradient``.

The tests take the point of view of a user who keeps an EMA teacher, a target network or an SWA
average next to a trained model. Every result is checked against a hand-written brute force
(``(1 - tau) * target + tau * source`` in float64, per-tensor ``lerp_``) or against
``torch.optim.swa_utils.AveragedModel`` / ``get_ema_multi_avg_fn`` where the two overlap, on
small HF models (GPT-2 with tied embeddings, BERT), PEFT LoRA models, BatchNorm buffers,
parametrizations, frozen parts, mixed dtypes, meta tensors, deepcopied and compiled modules,
``no_grad`` / ``inference_mode``, activation checkpointing and threads. Bad input must raise a
clear error and leave every parameter as it was.

Convention: a case that behaves wrongly today is kept, minimized, as a test marked
``@pytest.mark.xfail(strict=True, reason="BUG: what happens; what is expected")``; it turns the
suite red once the behaviour is fixed, and the marker is then removed. Limits that the docs
state are not treated as bugs.
"""
import copy
import fractions
import os
import threading

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np
import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch import nn
from torch.nn.utils import parametrizations as P
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.checkpoint import checkpoint

import torchstruct as ts


# ----------------------------------------------------------------------------- helpers
def bn_net(seed: int) -> nn.Sequential:
    """A small MLP with a batch norm (buffers) at index 1; 3 inputs, 2 outputs."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))


class TiedLM(nn.Module):
    """An embedding tied to the output head: three distinct parameters, four paths."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tok):
        return self.head(torch.tanh(self.body(self.emb(tok))))


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50,
                                      n_positions=16))


def tiny_bert():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    return BertModel(BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=32, vocab_size=50,
                                max_position_embeddings=16))


def snap(model: nn.Module) -> dict:
    """Copies of every parameter, at every path (tied ones at each)."""
    return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def bufsnap(model: nn.Module) -> dict:
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def same(model: nn.Module, before: dict) -> bool:
    """Every parameter bitwise as in ``before``."""
    return all(torch.equal(p.detach(), before[n])
               for n, p in model.named_parameters(remove_duplicate=False))


def brute(t: torch.Tensor, s: torch.Tensor, tau: float) -> torch.Tensor:
    """``(1 - tau) * t + tau * s`` in float64, in ``t``'s dtype."""
    return ((1 - tau) * t.detach().double() + tau * s.detach().double()).to(t.dtype)


def perturb(model: nn.Module, seed: int, scale: float = 0.1) -> None:
    """Add seeded noise to every parameter (tied ones once)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * scale)


# ============================================================================ polyak_update
@pytest.mark.parametrize("tau", [0.0, 1e-4, 0.01, 0.25, 0.5, 0.999, 1.0])
def test_polyak_matches_float64_brute_force(tau):
    target, source = bn_net(0), bn_net(1)
    t0, s0 = snap(target), snap(source)
    out = ts.polyak_update(target, source, tau)
    assert out is target
    for n, p in target.named_parameters():
        torch.testing.assert_close(p.detach(), brute(t0[n], s0[n], tau), rtol=1e-6, atol=1e-7)
        assert p.is_leaf and p.requires_grad and p.grad_fn is None
    assert same(source, s0)


def test_polyak_is_bitwise_the_averagedmodel_ema_and_leaves_buffers():
    online = bn_net(0)
    ema_ts = copy.deepcopy(online)
    avg = AveragedModel(online, multi_avg_fn=get_ema_multi_avg_fn(0.75), use_buffers=False)
    avg.update_parameters(online)  # first call copies
    b_before = bufsnap(ema_ts)
    for step in range(4):
        online.train()
        online(torch.randn(6, 3))  # moves the online running stats
        perturb(online, seed=step + 10, scale=0.3)
        ts.polyak_update(ema_ts, online, 1 - 0.75)
        avg.update_parameters(online)
    for (n, p), q in zip(ema_ts.named_parameters(), avg.module.parameters()):
        assert torch.equal(p, q), n
    # buffers (running stats, num_batches_tracked) are not parameters: untouched
    for n, b in ema_ts.named_buffers():
        assert torch.equal(b, b_before[n]), n
    assert not torch.equal(online[1].running_mean, b_before["1.running_mean"])


def test_polyak_with_one_over_n_is_the_swa_equal_average():
    online = bn_net(0)
    swa_ts = copy.deepcopy(online)
    avg = AveragedModel(online)
    avg.update_parameters(online)
    for n in range(1, 5):
        perturb(online, seed=n, scale=0.5)
        ts.polyak_update(swa_ts, online, 1.0 / (n + 1))
        avg.update_parameters(online)
    for (n, p), q in zip(swa_ts.named_parameters(), avg.module.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_polyak_tied_parameter_updated_once_own_module():
    target, source = TiedLM(), TiedLM()
    assert target.head.weight is target.emb.weight
    perturb(source, 3)
    t0, s0 = snap(target), snap(source)
    calls = []
    real = torch._foreach_lerp_

    def spy(a, b, w):
        calls.append([id(x) for x in a])
        return real(a, b, w)

    torch._foreach_lerp_ = spy
    try:
        ts.polyak_update(target, source, 0.5)
    finally:
        torch._foreach_lerp_ = real
    ids = [i for c in calls for i in c]
    assert ids.count(id(target.emb.weight)) == 1 and len(ids) == len(set(ids)) == 3
    torch.testing.assert_close(target.emb.weight, brute(t0["emb.weight"], s0["emb.weight"], 0.5))
    assert target.head.weight is target.emb.weight


def test_polyak_gpt2_tied_matches_averagedmodel_and_state_dict_source():
    online = tiny_gpt2()
    assert online.lm_head.weight is online.transformer.wte.weight
    ema = copy.deepcopy(online)
    avg = AveragedModel(online, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    avg.update_parameters(online)
    perturb(online, 5, scale=0.2)
    e0 = snap(ema)
    ts.polyak_update(ema, online, 0.1)
    avg.update_parameters(online)
    for (n, p), q in zip(ema.named_parameters(), avg.module.parameters()):
        assert torch.equal(p, q), n
    wte = ema.transformer.wte.weight
    torch.testing.assert_close(wte, brute(e0["transformer.wte.weight"],
                                         online.transformer.wte.weight.detach(), 0.1))
    assert ema.lm_head.weight is wte
    # a state_dict (views of one memory at both tied paths) is an accepted source
    pnames = dict(online.named_parameters(remove_duplicate=False))
    sd = {k: v for k, v in online.state_dict().items() if k in pnames}
    assert "lm_head.weight" in sd
    ts.polyak_update(ema, sd, 1.0)
    for (n, p), q in zip(ema.named_parameters(), online.parameters()):
        assert torch.equal(p, q), n
    # the EMA gives the same logits as the online model now
    tok = torch.tensor([[1, 2, 3]])
    ema.eval(), online.eval()
    torch.testing.assert_close(ema(tok).logits, online(tok).logits)


def test_polyak_peft_lora_moves_only_the_adapters():
    from peft import LoraConfig, get_peft_model

    pm = get_peft_model(tiny_bert(), LoraConfig(r=2, target_modules=["query", "value"],
                                                lora_dropout=0.0))
    ema = copy.deepcopy(pm)
    # make base weights differ too: a wrong update of a frozen base weight would show
    with torch.no_grad():
        for p in pm.parameters():
            p.add_(0.5)
    e0 = snap(ema)
    src = dict(pm.named_parameters())
    ts.polyak_update(ema, pm, 0.25)
    moved = [n for n, p in ema.named_parameters() if not torch.equal(p, e0[n])]
    trainable = [n for n, p in pm.named_parameters() if p.requires_grad]
    assert moved and sorted(moved) == sorted(trainable) and all("lora_" in n for n in moved)
    for n in moved:
        torch.testing.assert_close(ema.get_parameter(n), brute(e0[n], src[n].detach(), 0.25))
    mt = ts.map_trainable(lambda p: p.detach().norm(), pm)
    assert ts.tree.paths(mt) == trainable


def test_polyak_parametrizations_match_averagedmodel():
    def make():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        P.weight_norm(m[0])
        P.orthogonal(m[1])
        return m

    online = make()
    ema = copy.deepcopy(online)
    avg = AveragedModel(online, multi_avg_fn=get_ema_multi_avg_fn(0.8))
    avg.update_parameters(online)
    perturb(online, 7, scale=0.3)
    ts.polyak_update(ema, online, 0.2)
    avg.update_parameters(online)
    names = [n for n, _ in ema.named_parameters()]
    assert "0.parametrizations.weight.original0" in names
    for (n, p), q in zip(ema.named_parameters(), avg.module.parameters()):
        assert torch.equal(p, q), n
    x = torch.randn(3, 4)
    torch.testing.assert_close(ema(x), avg(x))


def test_polyak_frozen_parts_bitwise_still_and_no_version_bump():
    torch.manual_seed(0)
    target = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    source = copy.deepcopy(target)
    perturb(source, 9)
    t0 = snap(target)
    x = torch.randn(4, 3)
    with ts.freeze(target, "1"):
        # the graph saves the frozen 1.weight (for the gradient of 0.*), not 0.weight itself
        out = target(x).pow(2).sum()
        v = [target[1].weight._version, target[1].bias._version]
        ts.polyak_update(target, source, 0.5)
        assert [target[1].weight._version, target[1].bias._version] == v
        assert torch.equal(target[1].weight, t0["1.weight"]) and torch.equal(target[1].bias, t0["1.bias"])
        torch.testing.assert_close(target[0].weight, brute(t0["0.weight"], source[0].weight.detach(), 0.5))
        out.backward()  # the frozen weight saved by the graph was not written: backward works
    assert target[0].weight.grad is not None and target[1].weight.grad is None


def test_polyak_does_not_touch_source_versions_backward_after_update():
    online, target = bn_net(0), bn_net(1)
    x = torch.randn(4, 3, requires_grad=True)
    loss = online(x).pow(2).sum()
    v = [p._version for p in online.parameters()]
    ts.polyak_update(target, online, 0.3)
    assert [p._version for p in online.parameters()] == v
    loss.backward()
    assert all(p.grad is not None for p in online.parameters())


def test_polyak_bf16_is_bitwise_per_tensor_lerp_and_mixed_dtype_refused():
    torch.manual_seed(0)
    t, s = nn.Linear(16, 16).bfloat16(), nn.Linear(16, 16).bfloat16()
    ref = {n: p.detach().clone().lerp_(s.get_parameter(n).detach(), 0.01) for n, p in t.named_parameters()}
    ts.polyak_update(t, s, 0.01)
    for n, p in t.named_parameters():
        assert torch.equal(p, ref[n]) and p.dtype == torch.bfloat16
    # a bf16 model with an fp32 EMA: a module source of another dtype is refused, nothing moves
    ema = nn.Linear(16, 16)
    e0 = snap(ema)
    with pytest.raises(ValueError, match=r"'weight'.*bfloat16.*float32"):
        ts.polyak_update(ema, t, 0.5)
    assert same(ema, e0)
    # ... and fp32 copies as a tree work, computed in fp32
    src = ts.tree.map(lambda p: p.detach().float(), ts.tree.from_module(t))
    ts.polyak_update(ema, src, 0.5)
    torch.testing.assert_close(ema.weight, brute(e0["weight"], t.weight.float(), 0.5))
    assert ema.weight.dtype == torch.float32


def test_polyak_on_meta_device():
    with torch.device("meta"):
        tm, sm = nn.Linear(3, 3), nn.Linear(3, 3)
    assert ts.polyak_update(tm, sm, 0.5).weight.device.type == "meta"
    with pytest.raises(ValueError, match=r"'weight'.*cpu.*meta"):
        ts.polyak_update(tm, nn.Linear(3, 3), 0.5)
    out = ts.map_trainable(lambda p: p * 2, tm)
    assert out["weight"].device.type == "meta" and out["weight"].shape == (3, 3)


@pytest.mark.parametrize("ctx", ["no_grad", "inference_mode", "enable_grad"])
def test_polyak_under_grad_modes(ctx):
    target, source = bn_net(0), bn_net(1)
    t0, s0 = snap(target), snap(source)
    cm = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
          "enable_grad": torch.enable_grad}[ctx]
    with cm():
        ts.polyak_update(target, source, 0.4)
    for n, p in target.named_parameters():
        torch.testing.assert_close(p.detach(), brute(t0[n], s0[n], 0.4))
        assert not p.is_inference() and p.grad_fn is None
    target(torch.randn(2, 3)).sum().backward()  # still a trainable model
    assert all(p.grad is not None for p in target.parameters())


def test_polyak_frozen_by_hand_target_refused_unfreeze_works_and_restores():
    online = bn_net(0)
    target = copy.deepcopy(online).requires_grad_(False)
    perturb(online, 2)
    t0 = snap(target)
    with pytest.raises(ValueError, match="frozen by hand"):
        ts.polyak_update(target, online, 0.5)
    assert same(target, t0)
    with ts.unfreeze(target):
        ts.polyak_update(target, online, 0.5)
    for n, p in target.named_parameters():
        torch.testing.assert_close(p.detach(), brute(t0[n], online.get_parameter(n).detach(), 0.5))
    assert not any(p.requires_grad for p in target.parameters())


@pytest.mark.parametrize("tau", [np.float32(0.25), np.float64(0.25), fractions.Fraction(1, 4),
                                 torch.tensor(0.25), torch.tensor([0.25], dtype=torch.float64)])
def test_polyak_accepts_number_like_tau(tau):
    target, source = bn_net(0), bn_net(1)
    t0, s0 = snap(target), snap(source)
    ts.polyak_update(target, source, tau)
    for n, p in target.named_parameters():
        torch.testing.assert_close(p.detach(), brute(t0[n], s0[n], 0.25))


@pytest.mark.parametrize("tau,exc", [
    (None, TypeError), ("0.5", TypeError), (True, TypeError), (torch.tensor(True), TypeError),
    (0.5 + 0j, TypeError), ([0.5], TypeError), (torch.ones(2) / 2, TypeError),
    (-1e-9, ValueError), (1.0000001, ValueError), (float("inf"), ValueError),
    (float("nan"), ValueError), (torch.tensor(float("nan")), ValueError),
])
def test_polyak_bad_tau_raises_and_changes_nothing(tau, exc):
    target, source = bn_net(0), bn_net(1)
    t0 = snap(target)
    with pytest.raises(exc, match="tau"):
        ts.polyak_update(target, source, tau)
    assert same(target, t0)


def test_polyak_mismatched_sources_raise_clearly_and_change_nothing():
    target, source = bn_net(0), bn_net(1)
    t0 = snap(target)
    flat = dict(ts.tree.to_flat_dict(ts.tree.from_module(source)))
    cases = [
        ({**flat, "9.weight": torch.zeros(1)}, ValueError, r"'9\.weight'"),  # foreign leaf
        (dict(source.state_dict()), ValueError, r"running_mean|running_var|num_batches|buffer"),
        ({**flat, "3.bias": torch.zeros(3)}, ValueError, r"'3\.bias'.*\(3,\)"),
        ({**flat, "3.bias": torch.zeros(2, dtype=torch.int64)}, ValueError, r"'3\.bias'.*int64"),
        ({k: v for k, v in flat.items() if k != "1.weight"}, ValueError, r"'1\.weight'"),
        (nn.Linear(3, 5), ValueError, r"'0\.weight'"),
        (AveragedModel(source), ValueError, r"'0\.weight'.*module\.0\.weight"),
        ([t for t in flat.values()], TypeError, "source"),
        ({"0": {"weight": 1.0}}, TypeError, r"'0\.weight'"),
    ]
    for src, exc, pat in cases:
        with pytest.raises(exc, match=pat):
            ts.polyak_update(target, src, 0.5)
        assert same(target, t0)
    # a frozen path's leaf of the wrong shape is refused too, even though it is not used
    with ts.freeze(target, "0"):
        with pytest.raises(ValueError, match=r"'0\.weight'"):
            ts.polyak_update(target, {**flat, "0.weight": torch.zeros(5)}, 0.5)
    assert same(target, t0)
    # AveragedModel as *target* against a plain source: the paths do not match
    avg = AveragedModel(target)
    with pytest.raises(ValueError, match=r"'module\.0\.weight'"):
        ts.polyak_update(avg, source, 0.5)


def test_polyak_tied_source_rules():
    target = TiedLM()
    t0 = snap(target)
    untied = TiedLM()
    untied.head.weight = nn.Parameter(untied.emb.weight.detach().clone() + 1)
    with pytest.raises(ValueError, match=r"'emb\.weight'.*'head\.weight'"):
        ts.polyak_update(target, untied, 0.5)
    assert same(target, t0)
    # untied target, tied source: each of the target's parameters follows the one tensor
    plain = TiedLM()
    plain.head.weight = nn.Parameter(plain.emb.weight.detach().clone())
    p0 = snap(plain)
    src = TiedLM()
    ts.polyak_update(plain, src, 0.5)
    torch.testing.assert_close(plain.head.weight, brute(p0["head.weight"], src.emb.weight.detach(), 0.5))
    torch.testing.assert_close(plain.emb.weight, brute(p0["emb.weight"], src.emb.weight.detach(), 0.5))


def test_polyak_constant_block_refuses_before_writing():
    target, source = bn_net(0), bn_net(1)
    t0 = snap(target)
    with ts.constant(target, "3.bias"):  # the last parameter: earlier ones must not move
        with pytest.raises(RuntimeError, match=r"'3\.bias'"):
            ts.polyak_update(target, source, 0.5)
    assert same(target, t0)


def test_polyak_from_threads_on_different_models():
    errors, results = [], {}
    barrier = threading.Barrier(3)

    def work(i):
        try:
            torch.manual_seed(i)
            t, s = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6)), nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6))
            t0, s0 = snap(t), snap(s)
            barrier.wait()
            for _ in range(50):
                if i % 2:
                    with ts.freeze(t, "0"):
                        ts.polyak_update(t, s, 0.05)
                else:
                    ts.polyak_update(t, s, 0.05)
            k = 0.95 ** 50
            for n, p in t.named_parameters():
                exp = t0[n] if (i % 2 and n.startswith("0.")) else s0[n] + (t0[n] - s0[n]) * k
                results[(i, n)] = torch.allclose(p.detach(), exp, atol=1e-5)
            results[(i, "flags")] = all(p.requires_grad for p in t.parameters())
        except Exception as e:  # pragma: no cover - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors and len(results) == 15 and all(results.values()), (errors, results)


def test_polyak_compiled_modules_as_target_and_source():
    online = nn.Linear(3, 2)
    oc = torch.compile(online, backend="eager")
    ec = copy.deepcopy(oc)
    x = torch.randn(2, 3)
    ec(x)
    e0 = snap(ec)
    perturb(online, 4)
    ts.polyak_update(ec, oc, 0.5)
    assert not same(ec, e0)
    torch.testing.assert_close(ec(x), nn.functional.linear(x, ec._orig_mod.weight, ec._orig_mod.bias))
    with pytest.raises(ValueError, match=r"'weight'.*_orig_mod\.weight"):
        ts.polyak_update(nn.Linear(3, 2), oc, 0.5)


def test_polyak_inside_swap_of_the_source_reads_the_stand_ins():
    """Documented: inside swap every torch op sees the tree's tensor for a swapped parameter."""
    target, source = nn.Linear(2, 2), nn.Linear(2, 2)
    t0 = snap(target)
    stand = {"weight": torch.zeros(2, 2), "bias": torch.zeros(2)}
    with ts.swap(source, stand):
        ts.polyak_update(target, source, 0.5)
    torch.testing.assert_close(target.weight, 0.5 * t0["weight"])
    assert torch.equal(stand["weight"], torch.zeros(2, 2))


# ------------------------------------------------------- polyak_update: edges (tau, writes)
def test_polyak_tau_one_copies_over_a_nonfinite_target():
    target, source = nn.Linear(2, 2), nn.Linear(2, 2)
    with torch.no_grad():
        target.weight.fill_(float("nan"))  # e.g. uninitialized memory after to_empty()
        target.bias.fill_(float("inf"))
    ts.polyak_update(target, source, 1.0)
    assert torch.equal(target.weight, source.weight) and torch.equal(target.bias, source.bias)


def test_polyak_tau_zero_keeps_the_target_when_the_source_is_nonfinite():
    target, source = nn.Linear(2, 2), nn.Linear(2, 2)
    t0 = snap(target)
    versions = [p._version for p in target.parameters()]
    with torch.no_grad():
        source.weight.fill_(float("inf"))  # a diverged online model during an EMA warm-up
    ts.polyak_update(target, source, 0.0)
    assert same(target, t0)
    assert [p._version for p in target.parameters()] == versions  # not even written


def test_polyak_an_inference_tensor_target_is_refused_before_any_write():
    with torch.inference_mode():
        target = nn.Linear(2, 2)
    source = nn.Linear(2, 2)
    t0 = snap(target)
    with pytest.raises(RuntimeError, match="'weight' is an inference tensor"):
        ts.polyak_update(target, source, 0.5)
    assert same(target, t0)
    with torch.inference_mode():  # where it can be written, it is
        ts.polyak_update(target, source, 0.5)
    torch.testing.assert_close(target.bias, brute(t0["bias"], source.bias.detach(), 0.5))


def test_polyak_a_target_with_self_overlapping_memory_is_refused_before_any_write():
    target = nn.Module()
    target.a = nn.Parameter(torch.zeros(2, dtype=torch.float64))
    target.b = nn.Parameter(torch.zeros(1).expand(2))  # another dtype group, written second
    source = {"a": torch.ones(2, dtype=torch.float64), "b": torch.ones(2)}
    with pytest.raises(RuntimeError, match="'b' has elements that share memory"):
        ts.polyak_update(target, source, 0.5)
    assert torch.equal(target.a.detach(), torch.zeros(2, dtype=torch.float64))


def test_polyak_inside_a_swap_of_the_target_is_refused():
    target, source = nn.Linear(2, 2), nn.Linear(2, 2)
    stand = {"weight": torch.zeros(2, 2), "bias": torch.zeros(2)}
    t0 = snap(target)
    with ts.swap(target, stand):
        with pytest.raises(RuntimeError, match="swap block that replaces target's parameter"):
            ts.polyak_update(target, source, 0.5)
    assert same(target, t0)
    assert torch.equal(stand["weight"], torch.zeros(2, 2))


@pytest.mark.parametrize("tau", [0.5, 1.0])
def test_polyak_a_source_aliasing_the_target_is_read_as_it_was(tau):
    target = nn.Sequential(nn.Linear(2, 2, bias=False), nn.Linear(2, 2, bias=False))
    a0, b0 = target[0].weight.detach().clone(), target[1].weight.detach().clone()
    ts.polyak_update(target, {"0.weight": target[1].weight, "1.weight": target[0].weight}, tau)
    torch.testing.assert_close(target[0].weight, (1 - tau) * a0 + tau * b0)
    torch.testing.assert_close(target[1].weight, (1 - tau) * b0 + tau * a0)
    # a transposed view of the parameter itself as its own source
    sq = nn.Linear(3, 3, bias=False)
    w0 = sq.weight.detach().clone()
    ts.polyak_update(sq, {"weight": sq.weight.detach().t()}, tau)
    torch.testing.assert_close(sq.weight, (1 - tau) * w0 + tau * w0.t())


# ========================================================================= map_trainable
def test_map_trainable_sgd_step_matches_brute_and_follows_model_order():
    model = bn_net(0)
    x, y = torch.randn(8, 3), torch.randn(8, 2)
    loss_fn = lambda m: nn.functional.mse_loss(m(x), y)  # noqa: E731
    with ts.freeze(model, "1"):
        grads = ts.structural_grad(model, loss_fn)
        # trees with reversed key order, one flat, one nested
        flat_rev = dict(reversed(list(ts.tree.to_flat_dict(grads).items())))
        with torch.no_grad():
            stepped = ts.map_trainable(lambda p, g, g2: p - 0.1 * g - 0.0 * g2, model, flat_rev, grads)
        assert ts.tree.paths(stepped) == [n for n, _ in ts.trainable_parameters(model)]
    assert "1.weight" not in ts.tree.to_flat_dict(stepped)
    ref = copy.deepcopy(model)
    ref[1].requires_grad_(False)
    ref[1].eval()  # documented: a BatchNorm that torchstruct froze normalizes with its running stats
    loss_fn(ref).backward()
    for n, v in ts.tree.to_flat_dict(stepped).items():
        p = ref.get_parameter(n)
        torch.testing.assert_close(v, (p - 0.1 * p.grad).detach())
        assert not v.requires_grad


def test_map_trainable_tied_once_and_no_side_effects():
    m = TiedLM()
    m0 = snap(m)
    seen = []
    full = ts.tree.from_module(m)
    sd_tree = m.state_dict()  # views at both tied paths: one tensor
    out = ts.map_trainable(lambda p, a, b: seen.append(id(p)) or a + b, m, full, sd_tree)
    assert seen.count(id(m.emb.weight)) == 1 and len(seen) == 3
    assert ts.tree.paths(out) == ["emb.weight", "body.weight", "body.bias"]
    assert same(m, m0)


def test_map_trainable_frozen_leaves_ignored_but_shape_checked():
    m = bn_net(0)
    full = ts.tree.to_flat_dict(ts.tree.from_module(m))
    with ts.freeze(m, "0", "1"):
        out = ts.map_trainable(lambda p, g: g * 2, m, {**full, "0.weight": None})
        assert ts.tree.paths(out) == ["3.weight", "3.bias"]
        with pytest.raises(ValueError, match=r"'0\.weight'.*\(1,\)"):
            ts.map_trainable(lambda p, g: g, m, {**full, "0.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"no leaf at '0\.weight'"):
        ts.map_trainable(lambda p, g: g, m, {**full, "0.weight": None})
    with pytest.raises(ValueError, match=r"running_mean"):
        ts.map_trainable(lambda p, g: g, m, ts.tree.from_module(m, buffers=True))


def test_map_trainable_bad_arguments():
    m = bn_net(0)
    tree = ts.tree.from_module(m)
    with pytest.raises(TypeError, match="f"):
        ts.map_trainable(None, m)
    with pytest.raises(TypeError, match="nn.Module"):
        ts.map_trainable(lambda p: p, tree)  # a tree where the model belongs
    with pytest.raises(TypeError, match="dict"):
        ts.map_trainable(lambda p, g: p, m, [1])
    with pytest.raises(TypeError, match=r"'0\.weight'"):
        ts.map_trainable(lambda p: 1.0, m)  # f returned a number
    with pytest.raises(TypeError, match=r"'0\.weight'"):
        ts.map_trainable(lambda p, g: p, m, {"0": {"weight": 3}})
    with pytest.raises(ValueError, match=r"uninitialized|lazy"):
        ts.map_trainable(lambda p: p, nn.LazyLinear(2))
    assert ts.map_trainable(lambda p: None, m) == {}


def test_map_trainable_with_torch_func_grads_and_peft_free_model():
    m = TiedLM()
    tok = torch.tensor([1, 2, 3])
    g = torch.func.grad(lambda ps: torch.func.functional_call(m, ps, (tok,)).sum())(
        dict(m.named_parameters()))
    out = ts.map_trainable(lambda p, gg: gg, m, g)
    m(tok).sum().backward()
    for n, v in ts.tree.to_flat_dict(out).items():
        torch.testing.assert_close(v, m.get_parameter(n).grad)


# ======================================================================== within_gradient
wg = ts.within_gradient


def _record(fn):
    rec = []

    def f(t):
        rec.append(wg(t))
        return fn(t)

    return f, rec


def test_within_gradient_functorch_and_grad_modes():
    x = torch.ones(3)
    f, rec = _record(lambda t: (t * 2).sum())
    with torch.no_grad():
        torch.func.grad(f)(x)  # grad ignores an outer no_grad
        torch.func.vjp(f, x)
    assert rec == [True, True]
    rec.clear()

    def g(t):
        with torch.no_grad():  # grad respects an inner no_grad
            rec.append(wg(t))
        return (t * 2).sum()

    torch.func.grad(g)(x)
    torch.func.vmap(f)(torch.ones(2, 3))  # vmap alone differentiates nothing
    torch.func.vmap(f)(torch.ones(2, 3, requires_grad=True))
    torch.func.jacfwd(f)(x)
    torch.func.vmap(torch.func.grad(f))(torch.ones(2, 3))
    assert rec == [False, False, True, True, True]
    with fwAD.dual_level():
        d = fwAD.make_dual(torch.ones(2), torch.ones(2))
        with torch.no_grad():
            assert wg(d)
        with torch.inference_mode():
            assert not wg(d)
    xr = torch.ones(2, requires_grad=True)
    with torch.inference_mode(), torch.enable_grad():
        assert not wg(xr) and not (xr * 2).requires_grad
    with pytest.raises(TypeError, match="argument 1"):
        wg(xr, 3)  # checked even after a tracked argument
    assert not wg()


def test_within_gradient_modules_and_freezing():
    m = bn_net(0)
    assert wg(m)
    with ts.freeze(m):
        assert not wg(m)
    with ts.freeze(m, "0", "1"):
        assert wg(m) and not wg(m[0])
    assert not wg(nn.ReLU()) and not wg(nn.BatchNorm1d(3, affine=False))
    with torch.no_grad():
        assert not wg(m)


def test_within_gradient_noise_layer_consistent_under_activation_checkpointing():
    torch.manual_seed(0)
    lin = nn.Linear(3, 3)
    mask = torch.tensor([1.0, 0.0, 1.0])
    calls = []

    def block(t):
        h = lin(t)
        calls.append(wg(h))
        return h * mask * 2 if wg(h) else h

    x = torch.randn(4, 3, requires_grad=True)
    block(x).pow(2).sum().backward()
    g_plain = x.grad.clone(), lin.weight.grad.clone()
    x.grad, lin.weight.grad = None, None
    calls.clear()
    checkpoint(block, x, use_reentrant=False).pow(2).sum().backward()
    assert calls == [True, True]  # forward and recompute take the same branch
    torch.testing.assert_close(x.grad, g_plain[0])
    torch.testing.assert_close(lin.weight.grad, g_plain[1])
    with torch.no_grad():
        torch.testing.assert_close(block(x), lin(x))


def test_within_gradient_compiled_branches_follow_the_mode():
    f = torch.compile(lambda t: t * (2 if ts.within_gradient(t) else 3), backend="eager", fullgraph=True)
    xr = torch.ones(2, requires_grad=True)
    assert torch.equal(f(xr).detach(), torch.full((2,), 2.0))
    assert torch.equal(f(xr.detach()), torch.full((2,), 3.0))
    with torch.no_grad():
        assert torch.equal(f(xr), torch.full((2,), 3.0))
    with torch.inference_mode():
        assert torch.equal(f(xr), torch.full((2,), 3.0))
    with torch.inference_mode(), torch.enable_grad():
        assert torch.equal(f(xr), torch.full((2,), 3.0))
    assert torch.equal(f(xr).detach(), torch.full((2,), 2.0))  # back again, no stale graph
    assert torch.equal(torch.func.grad(lambda t: f(t).sum())(torch.ones(2)), torch.full((2,), 2.0))
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    c = torch.compile(lambda t: ts.within_gradient(t), backend="eager", fullgraph=True)
    with ts.stop_gradient(net, "0"):
        assert not c(net[0].weight) and c(net[1].weight)
    g = torch.compile(lambda t: t * (2 if ts.within_gradient(t) else 3), backend="eager")
    with fwAD.dual_level():
        d = fwAD.make_dual(torch.ones(2), torch.ones(2))
        out = fwAD.unpack_dual(g(d))
        assert torch.equal(out.primal, torch.full((2,), 2.0))
        assert torch.equal(out.tangent, torch.full((2,), 2.0))


# ====================================================================== more polyak_update
def test_polyak_declarations_follow_a_deepcopy_and_layouts_are_kept():
    t = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    s = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    ts.mark_trainable(t, "1")
    c = copy.deepcopy(t)
    for m in (t, c):
        m0 = snap(m)
        ts.polyak_update(m, s, 0.5)
        assert [n for n, p in m.named_parameters() if not torch.equal(p, m0[n])] == ["1.weight", "1.bias"]
    # a channels_last target stays channels_last and gets exactly lerp_'s values
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    src = nn.Conv2d(3, 4, 3)
    ref = conv.weight.detach().clone().lerp_(src.weight.detach(), 0.3)
    ts.polyak_update(conv, src, 0.3)
    assert torch.equal(conv.weight, ref)
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    # a sparse source leaf is refused by path
    lin = nn.Linear(2, 2)
    l0 = snap(lin)
    with pytest.raises(ValueError, match=r"sparse.*'weight'"):
        ts.polyak_update(lin, {"weight": torch.eye(2).to_sparse(), "bias": torch.zeros(2)}, 0.5)
    assert same(lin, l0)
