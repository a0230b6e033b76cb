"""Block-local contexts (stop_gradient, constant, swap) and selectors, tried as a suspicious user.

Every gradient of a ``stop_gradient`` block is compared with the same computation written by
hand (``torch.func.functional_call`` with ``.detach()``-ed parameters), every output of a
``swap`` block with ``functional_call`` over the swapped tensors, bitwise (``torch.equal``) where
the arithmetic is the same. ``constant`` is tried against every in-place path a user might take;
selectors against a brute force over ``named_parameters(remove_duplicate=False)`` and
``fnmatch``.

A test marked ``xfail(strict=True)`` reproduces a case that goes wrong today; its reason says
what happens and what is expected.
"""
import copy
import fnmatch
import io
import os
import re
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils.checkpoint import checkpoint

import torchstruct as ts
from _flags import TORCH

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def modes():
    """How many torch function and dispatch modes are active in this thread."""
    return len(_get_current_function_mode_stack()), len(_get_current_dispatch_mode_stack())


def grads(model, extra=()):
    return {n: p.grad for n, p in model.named_parameters()}, [t.grad for t in extra]


def same(a, b):
    """Bitwise equal, None equal to None only."""
    if a is None or b is None:
        return a is None and b is None
    return torch.equal(a, b)


def same_grads(got, want):
    (gp, gx), (wp, wx) = got, want
    assert gp.keys() == wp.keys()
    bad = [n for n in gp if not same(gp[n], wp[n])] + [i for i, (a, b) in enumerate(zip(gx, wx))
                                                      if not same(a, b)]
    assert not bad, bad


# --------------------------------------------------------------------------- models
class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.body = nn.Linear(4, 4)
        self.out = nn.Linear(4, 7, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids):
        return self.out(torch.tanh(self.body(self.emb(ids))))


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(4, 12)
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        return self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))


class Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(9, 4, mode="mean")
        self.head = nn.Linear(4, 2)

    def forward(self, ids):
        return self.head(self.bag(ids, torch.tensor([0, 3])))


class MHA(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(4, 2, batch_first=True)

    def forward(self, x):
        return self.mha(x, x, x, need_weights=False)[0]


class RNN(nn.Module):
    def __init__(self, cls):
        super().__init__()
        self.rnn = cls(3, 4, num_layers=2)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.rnn(x)[0])


def _weight_norm():
    m = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
    nn.utils.parametrizations.weight_norm(m[0])
    return m


CASES = {
    # name: (model factory, input factory, selectors naming the blocked parameters)
    "tied_by_alias": (TiedLM, lambda: torch.tensor([[1, 2, 3], [4, 5, 6]]), ["out.weight"]),
    "tied_body": (TiedLM, lambda: torch.tensor([[1, 2, 3]]), ["body.bias"]),
    "lstm": (lambda: RNN(nn.LSTM), lambda: torch.randn(5, 2, 3),
             ["rnn.weight_hh_l1", "rnn.bias_ih_l0"]),
    "gru": (lambda: RNN(nn.GRU), lambda: torch.randn(5, 2, 3), ["rnn.weight_ih_l0"]),
    "mha": (MHA, lambda: torch.randn(2, 3, 4), ["mha.in_proj_weight"]),
    "mha_out": (MHA, lambda: torch.randn(2, 3, 4), ["mha.out_proj.weight"]),
    "sdpa": (Attention, lambda: torch.randn(2, 5, 4), ["qkv.weight"]),
    "embedding_bag": (Bag, lambda: torch.tensor([1, 2, 3, 4, 5, 8]), ["bag.weight"]),
    "conv_groups": (lambda: nn.Sequential(nn.Conv2d(4, 4, 3, groups=2), nn.Conv2d(4, 2, 1)),
                    lambda: torch.randn(1, 4, 5, 5), ["0.weight"]),
    "weight_norm": (_weight_norm, lambda: torch.randn(2, 3),
                    ["0.parametrizations.weight.original0"]),
}


def reference_grads(model, x, blocked, inputs_grad=False):
    """The same computation by hand: functional_call with the blocked parameters detached."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(inputs_grad) if x.is_floating_point() else x
    params = {n: (p.detach() if n in blocked else p) for n, p in model.named_parameters()}
    functional_call(model, params, (x,)).pow(2).sum().backward()
    return grads(model, [x] if inputs_grad else [])


@pytest.mark.parametrize("case", CASES)
def test_stop_gradient_equals_detach_by_hand(case):
    make, inputs, blocked = CASES[case]
    torch.manual_seed(0)
    model, x = make(), inputs()
    floating = x.is_floating_point()
    xin = x.clone().requires_grad_(floating) if floating else x
    with ts.stop_gradient(model, *blocked):
        out = model(xin)
    out.pow(2).sum().backward()
    got = grads(model, [xin] if floating else [])
    canonical = {n for n, _ in ts.select(model, *blocked)}
    assert all(got[0][n] is None for n in canonical) and modes() == (0, 0)
    same_grads(got, reference_grads(model, x, canonical, floating))


@pytest.mark.parametrize("case", CASES)
def test_swap_equals_functional_call(case):
    make, inputs, paths = CASES[case]
    torch.manual_seed(1)
    model, x = make(), inputs()
    paths = [n for n, _ in ts.select(model, *paths)]  # canonical paths
    tree = {p: torch.randn_like(dict(model.named_parameters())[p]).requires_grad_() for p in paths}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with ts.swap(model, tree):
        out = model(x)
    out.pow(2).sum().backward()
    got = grads(model, list(tree.values()))
    for t in tree.values():
        t.grad = None
    model.zero_grad(set_to_none=True)
    want_out = functional_call(model, {**dict(model.named_parameters()), **tree}, (x,))
    want_out.pow(2).sum().backward()
    assert torch.equal(out, want_out)
    same_grads(got, grads(model, list(tree.values())))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_swap_state_dict_holds_the_stand_ins_named_parameters_the_originals():
    m, t = nn.Linear(2, 2), torch.zeros(2)
    with ts.swap(m, {"bias": t}):
        state = m.state_dict()
        assert torch.equal(state["bias"], t) and state["bias"].data_ptr() == t.data_ptr()
        assert m.state_dict(keep_vars=True)["bias"] is m._parameters["bias"]
        assert dict(m.named_parameters())["bias"] is m._parameters["bias"]
    assert not torch.equal(m.state_dict()["bias"], t) or bool((m.bias == 0).all())


def test_multihead_attention_fast_path_under_swap():
    """eval + no_grad takes MHA's native fast path outside a block; inside one the swapped
    weights are used."""
    torch.manual_seed(0)
    model, x = MHA().eval(), torch.randn(2, 3, 4)
    tree = {"mha.in_proj_weight": torch.randn(12, 4), "mha.out_proj.bias": torch.randn(4)}
    with torch.no_grad():
        with ts.swap(model, tree):
            got = model(x)
        want = functional_call(model, tree, (x,), strict=False)
        plain = model(x)
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, plain)


def test_tied_gpt2_from_config():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=2, n_head=2,
                                     attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 32, (2, 6))
    paths = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    assert "lm_head.weight" in paths  # tied to transformer.wte.weight
    with ts.stop_gradient(model, "lm_head", "transformer.h.0.attn"):
        model(ids).logits.pow(2).sum().backward()
    got = grads(model)
    assert got[0]["transformer.wte.weight"] is None
    blocked = {n for n, _ in ts.select(model, "transformer.wte.weight", "transformer.h.0.attn.*")}
    model.zero_grad(set_to_none=True)
    params = {n: (p.detach() if n in blocked else p) for n, p in model.named_parameters()}
    functional_call(model, params, (ids,)).logits.pow(2).sum().backward()
    same_grads(got, grads(model))


def test_gpt2_with_reentrant_gradient_checkpointing_inside_stop_gradient_is_refused():
    """HF's gradient checkpointing with use_reentrant=True recomputes each block after a
    stop_gradient around the forward has exited: refused, instead of gradients for the blocked
    weights. Evaluation (eval mode, no checkpointing) inside a swap is untouched."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=2, n_head=2,
                                     attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.enable_input_require_grads()
    model.train()
    ids = torch.randint(0, 32, (2, 6))
    with ts.stop_gradient(model, "transformer.h.0.attn"):
        with pytest.raises(RuntimeError, match="reentrant activation checkpoint"):
            model(ids)
    assert all(p.grad is None for p in model.parameters())
    model.eval()
    ema = {n: p.detach() * 0.5 for n, p in model.named_parameters()}
    with torch.no_grad(), ts.swap(model, ema):
        model(ids)


def test_bert_from_config_swap_and_stop_gradient():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=30, hidden_size=8, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=16,
                                     max_position_embeddings=16, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    ids = torch.randint(0, 30, (2, 5))
    layer0 = {n: p.detach() + 0.5 for n, p in model.named_parameters() if ".layer.0." in n}
    with ts.swap(model, layer0):
        got = model(ids).last_hidden_state
    assert torch.equal(got, functional_call(model, layer0, (ids,), strict=False).last_hidden_state)
    with ts.stop_gradient(model, "encoder.layer.1", "embeddings"):
        model(ids).last_hidden_state.pow(2).sum().backward()
    got = grads(model)
    blocked = {n for n, _ in ts.select(model, "encoder.layer.1", "embeddings")}
    model.zero_grad(set_to_none=True)
    params = {n: (p.detach() if n in blocked else p) for n, p in model.named_parameters()}
    functional_call(model, params, (ids,)).last_hidden_state.pow(2).sum().backward()
    same_grads(got, grads(model))


def test_swap_with_differentiable_stand_ins_maml():
    """Stand-ins computed from the parameters (one inner SGD step, create_graph=True):
    the outer gradient reaches the parameters through them, as with functional_call."""
    torch.manual_seed(0)
    m, x, y = nn.Linear(3, 1), torch.randn(4, 3), torch.randn(4, 1)
    params = dict(m.named_parameters())
    inner = torch.autograd.grad(F.mse_loss(m(x), y), list(params.values()), create_graph=True)
    fast = {n: p - 0.1 * g for (n, p), g in zip(params.items(), inner)}
    with ts.swap(m, fast):
        outer = F.mse_loss(m(x), y)
    got = torch.autograd.grad(outer, list(params.values()), retain_graph=True)
    want = torch.autograd.grad(F.mse_loss(functional_call(m, fast, (x,)), y), list(params.values()))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_swap_two_parameters_for_each_other():
    torch.manual_seed(0)
    m, x = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3)), torch.randn(2, 3)
    tree = {"0.weight": m[2].weight, "2.weight": m[0].weight}
    with ts.swap(m, tree):
        out = m(x)
    out.pow(2).sum().backward()
    got = grads(m)
    m.zero_grad(set_to_none=True)
    want = functional_call(m, tree, (x,), strict=False)
    want.pow(2).sum().backward()
    assert torch.equal(out, want)
    same_grads(got, grads(m))


def test_optimizer_step_inside_swap_moves_the_stand_ins_only():
    """Lookahead: an optimizer over the model's parameters, stepped inside the block, reads the
    stand-ins' gradients and updates the stand-ins; the parameters stay bitwise unchanged."""
    torch.manual_seed(0)
    m = nn.Linear(3, 2)
    before = [p.detach().clone() for p in m.parameters()]
    slow = {n: p.detach().clone().requires_grad_() for n, p in m.named_parameters()}
    start = {n: t.detach().clone() for n, t in slow.items()}
    opt = torch.optim.SGD(m.parameters(), lr=0.5, foreach=True)
    with ts.swap(m, slow):
        m(torch.ones(1, 3)).sum().backward()
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(m.parameters(), before))
    assert all(p.grad is None for p in m.parameters())
    for n, t in slow.items():
        assert torch.equal(t.detach(), start[n] - 0.5 * t.grad)


def test_peft_lora_swap_zero_b_equals_disabled_adapter():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["0", "2"],
                                                      lora_dropout=0.0))
    for n, p in model.named_parameters():
        if "lora_B" in n:
            nn.init.normal_(p)
    x = torch.randn(3, 4)
    zeros = {n: torch.zeros_like(p) for n, p in model.named_parameters() if "lora_B" in n}
    with torch.no_grad():
        with ts.swap(model, zeros):
            got = model(x)
        with model.disable_adapter():
            want = model(x)
        assert not torch.equal(model(x), want)
    assert torch.equal(got, want)
    with ts.stop_gradient(model, "*lora_A*"):
        model(x).sum().backward()
    assert all((p.grad is None) == ("lora_A" in n) for n, p in model.named_parameters()
               if p.requires_grad)


# --------------------------------------------------------------------------- autograd tools
def test_func_grad_and_vmap_inside_blocks():
    torch.manual_seed(0)
    m, x = nn.Linear(3, 3), torch.randn(2, 3)
    with ts.stop_gradient(m, "weight"):
        gx = torch.func.grad(lambda t: torch.tanh(m(t)).sum())(x)
    want = torch.func.grad(lambda t: torch.tanh(F.linear(t, m.weight.detach(), m.bias)).sum())(x)
    assert torch.equal(gx, want)
    w = torch.randn(3, 3)
    with ts.swap(m, {"weight": w}):
        got = torch.func.vmap(m)(x)
    assert torch.equal(got, torch.func.vmap(lambda t: F.linear(t, w, m.bias))(x))


def test_func_grad_over_the_parameters_themselves():
    torch.manual_seed(0)
    m, x = nn.Linear(3, 3), torch.randn(2, 3)
    with ts.stop_gradient(m, "weight"):
        g = torch.func.grad(lambda ps: functional_call(m, ps, (x,)).sum())(
            dict(m.named_parameters()))
    assert torch.equal(g["weight"], torch.zeros(3, 3))


def test_func_transforms_over_the_parameters_themselves_follow_the_blocks():
    torch.manual_seed(0)
    m, x = nn.Linear(3, 2), torch.randn(4, 3)
    params = dict(m.named_parameters())
    loss = lambda ps: functional_call(m, ps, (x,)).pow(2).sum()
    hand = lambda ps: F.linear(x, ps["weight"].detach(), ps["bias"]).pow(2).sum()
    with ts.stop_gradient(m, "weight"):
        got = torch.func.grad(loss)(params)
        jac = torch.func.jacrev(lambda ps: functional_call(m, ps, (x,)))(params)
        hess = torch.func.hessian(lambda b: loss({"weight": m.weight, "bias": b}))(m.bias)
    want = torch.func.grad(hand)(params)
    assert torch.equal(got["weight"], torch.zeros(2, 3)) and torch.allclose(got["bias"], want["bias"])
    assert torch.equal(jac["weight"], torch.zeros(4, 2, 2, 3))
    assert torch.allclose(hess, 2 * len(x) * torch.eye(2))
    # outside the block nothing is cut; a copy of the parameters is not the parameters
    assert not torch.equal(torch.func.grad(loss)(params)["weight"], torch.zeros(2, 3))
    with ts.stop_gradient(m, "weight"):
        copies = {k: v.detach().clone() for k, v in params.items()}
        assert not torch.equal(torch.func.grad(loss)(copies)["weight"], torch.zeros(2, 3))
    # swap: the tree's tensor in place of the wrapped parameter, a constant for the transform
    w = torch.ones(2, 3)
    with ts.swap(m, {"weight": w}):
        got = torch.func.grad(loss)(params)
    want = torch.func.grad(lambda ps: F.linear(x, w, ps["bias"]).pow(2).sum())(params)
    assert torch.equal(got["weight"], torch.zeros(2, 3)) and torch.allclose(got["bias"], want["bias"])


class Mul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g * b, g * a


def test_parameter_handed_directly_to_a_custom_function():
    m, x = nn.Linear(3, 2), torch.randn(2, requires_grad=True)
    with ts.stop_gradient(m, "bias"):
        Mul.apply(m.bias, x).pow(2).sum().backward()
    assert m.bias.grad is None
    x2 = x.detach().requires_grad_()
    Mul.apply(m.bias.detach(), x2).pow(2).sum().backward()
    assert torch.equal(x.grad, x2.grad)
    # swap: the function saved the parameter itself for backward, so its gradients would be
    # computed from the parameter's values: refused, unless apply records nothing
    with ts.swap(m, {"bias": torch.full((2,), 3.0)}):
        with pytest.raises(RuntimeError, match=r"swap: .* directly to the custom autograd "
                                               r"function Mul\.forward"):
            Mul.apply(m.bias, torch.ones(2))
        with torch.no_grad():
            assert torch.equal(Mul.apply(m.bias, torch.ones(2)), torch.full((2,), 3.0))


def test_aten_ops_autograd_grad_and_structural_grad_of_a_blocked_loss():
    torch.manual_seed(0)
    m, x = nn.Linear(3, 2), torch.randn(4, 3)
    with ts.stop_gradient(m, "weight"):
        y = torch.ops.aten.addmm.default(m.bias, x, m.weight.t())
        loss = y.pow(2).sum()
        got = torch.autograd.grad(loss, [m.weight, m.bias], allow_unused=True)
    hand = torch.ops.aten.addmm.default(m.bias, x, m.weight.detach().t()).pow(2).sum()
    want = torch.autograd.grad(hand, [m.weight, m.bias], allow_unused=True)
    assert got[0] is None and want[0] is None and torch.equal(got[1], want[1])
    with ts.stop_gradient(m, "weight"):
        loss = m(x).pow(2).sum()
    tree = ts.structural_grad(m, loss)
    hand = F.linear(x, m.weight.detach(), m.bias).pow(2).sum()
    want = ts.structural_grad(m, hand)
    assert tree.keys() == want.keys() and all(same(tree[k], want[k]) for k in tree)


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpoint_with_the_block_inside_the_function(reentrant):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
    x = torch.randn(2, 3, requires_grad=True)

    def fn(t):
        with ts.stop_gradient(m, "0.weight"):
            return m(t)

    checkpoint(fn, x, use_reentrant=reentrant).sum().backward()
    got = grads(m, [x])
    m.zero_grad(set_to_none=True)
    x2 = x.detach().requires_grad_()
    params = {n: (p.detach() if n == "0.weight" else p) for n, p in m.named_parameters()}
    functional_call(m, params, (x2,)).sum().backward()
    same_grads(got, grads(m, [x2]))


@pytest.mark.parametrize("kind", ["stop_gradient", "swap"])
def test_checkpoint_non_reentrant_recomputed_after_the_block_matches_no_checkpoint(kind):
    """The forward ran in the block, the backward runs after it: the recompute runs inside
    the block again (saved shapes coincide, so torch's own check would not see a recompute
    without it), gradients bitwise those of the same code without a checkpoint."""
    torch.manual_seed(0)
    x = torch.randn(4, 4, requires_grad=True)
    v = torch.randn(4, 4, requires_grad=True)
    got = []
    for ck in (False, True):
        torch.manual_seed(1)
        m = nn.Linear(4, 4)
        block = (ts.stop_gradient(m, "weight") if kind == "stop_gradient"
                 else ts.swap(m, {"weight": v}))
        with block:
            y = checkpoint(m, x, use_reentrant=False) if ck else m(x)
        got.append(torch.autograd.grad(torch.tanh(y).pow(2).sum(), [x, v, m.weight, m.bias],
                                       allow_unused=True))
        assert m.weight.grad is None and ts.is_trainable(m, "weight")
    for a, b in zip(*got):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert got[1][2] is None  # the blocked / swapped weight: no gradient
    assert (got[1][1] is None) == (kind == "stop_gradient")  # a swap's stand-in gets one


@pytest.mark.parametrize("first", ["context", "block"])
@pytest.mark.parametrize("after", [False, True])
def test_checkpoint_recomputed_in_a_block_with_a_flag_context_active_keeps_the_flags(first,
                                                                                    after):
    """A flag context active elsewhere makes checkpoints remember their flags; the
    recomputation runs inside the block the forward ran in, where a parameter reads its
    stand-in's flag: the flags remembered and set back are the parameters' own, whichever
    was switched on first (the wrappers compose in that order), so none is left frozen."""
    other = nn.Linear(2, 2)
    torch.manual_seed(0)
    m, x = nn.Linear(4, 4), torch.randn(4, 4, requires_grad=True)
    want, = torch.autograd.grad(torch.tanh(nn.functional.linear(
        x, m.weight.detach(), m.bias)).pow(2).sum(), x)
    hold = ts.freeze(other) if first == "context" else None
    try:
        with ts.stop_gradient(m, "weight"):
            hold = hold or ts.freeze(other)
            y = checkpoint(m, x, use_reentrant=False)
            if not after:
                got, = torch.autograd.grad(torch.tanh(y).pow(2).sum(), x)
        if after:
            got, = torch.autograd.grad(torch.tanh(y).pow(2).sum(), x)
    finally:
        hold.__exit__(None, None, None)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert m.weight.requires_grad and m.bias.requires_grad
    assert ts.is_trainable(m, "weight") and all(p.requires_grad for p in other.parameters())


@pytest.mark.parametrize("kind", ["stop_gradient", "swap"])
def test_checkpoint_non_reentrant_recomputed_inside_the_block_matches_no_checkpoint(kind):
    torch.manual_seed(0)
    m, x = nn.Linear(4, 4), torch.randn(4, 4, requires_grad=True)  # saved shapes coincide
    v = torch.randn(4, 4, requires_grad=True)

    def block():
        return (ts.stop_gradient(m, "weight") if kind == "stop_gradient"
                else ts.swap(m, {"weight": v}))

    got = []
    for ck in (False, True):
        with block():
            y = checkpoint(m, x, use_reentrant=False) if ck else m(x)
            got.append(torch.autograd.grad(torch.tanh(y).pow(2).sum(), [x, v]
                                           if kind == "swap" else [x], allow_unused=True))
    for a, b in zip(*got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["stop_gradient", "swap"])
def test_checkpoint_reentrant_called_inside_the_block_is_refused(kind):
    """Its backward would recompute after the block, without the stand-ins: an error, with
    nothing accumulated; entered inside the checkpointed function, the block is fine, and
    an evaluation (no input requiring grad, no backward to come) is not refused."""
    torch.manual_seed(0)
    m, x = nn.Linear(3, 3), torch.randn(2, 3, requires_grad=True)

    def block():
        if kind == "stop_gradient":
            return ts.stop_gradient(m, "weight")
        return ts.swap(m, {"weight": torch.zeros(3, 3)})

    with block():
        with pytest.raises(RuntimeError, match=f"{kind}: .*reentrant activation checkpoint"):
            checkpoint(m, x, use_reentrant=True)
        with torch.no_grad():
            m(x)  # no checkpoint: plain no_grad use is fine
        y_eval = checkpoint(m, x.detach(), use_reentrant=True)  # nothing to recompute
    assert m.weight.grad is None and not y_eval.requires_grad

    def inner(u):
        with block():
            return m(u)

    y = checkpoint(inner, x, use_reentrant=True)
    y.sum().backward()
    with block():
        want = m(x)
    assert torch.equal(y, want)
    if kind == "stop_gradient":
        assert m.weight.grad is None and m.bias.grad is not None


# --------------------------------------------------------------------------- nesting, state
def test_nested_blocks_of_each_kind():
    torch.manual_seed(0)
    m, x = nn.Linear(3, 2), torch.randn(4, 3)
    t = torch.randn(2, 3, requires_grad=True)
    # swap outside, stop_gradient inside: the op sees the swapped tensor, detached
    with ts.swap(m, {"weight": t}), ts.stop_gradient(m, "weight"):
        out = m(x)
    out.sum().backward()
    assert torch.equal(out, F.linear(x, t.detach(), m.bias))
    assert t.grad is None and m.weight.grad is None and m.bias.grad is not None
    # stop_gradient outside, swap inside: the stand-in is not the parameter and learns
    m.zero_grad(set_to_none=True)
    with ts.stop_gradient(m, "weight"), ts.swap(m, {"weight": t}):
        out = m(x)
    out.sum().backward()
    assert torch.equal(out, F.linear(x, t, m.bias)) and t.grad is not None
    assert m.weight.grad is None
    # same kind nested: inner swap wins, union for stop_gradient
    with ts.swap(m, {"bias": torch.zeros(2)}), ts.swap(m, {"bias": torch.ones(2)}):
        assert torch.equal(m(x), F.linear(x, m.weight, torch.ones(2)))
    with ts.stop_gradient(m, "weight"), ts.stop_gradient(m, "bias"), ts.constant(m):
        assert not m(x).requires_grad
    assert modes() == (0, 0)


@pytest.mark.parametrize("kind", ["stop_gradient", "swap", "constant"])
def test_exception_inside_the_block_restores(kind):
    m = nn.Linear(2, 2)
    make = {"stop_gradient": lambda: ts.stop_gradient(m), "constant": lambda: ts.constant(m),
            "swap": lambda: ts.swap(m, {"bias": torch.zeros(2)})}[kind]
    with pytest.raises(KeyError):
        with make():
            raise KeyError("inside")
    assert modes() == (0, 0)
    m(torch.ones(1, 2)).sum().backward()
    assert m.weight.grad is not None
    with torch.no_grad():
        m.bias.add_(1)


def test_bare_block_exited_out_of_order_removes_only_itself():
    m, x = nn.Linear(2, 2), torch.ones(1, 2)
    blocked = ts.stop_gradient(m, "weight")
    with ts.swap(m, {"bias": torch.full((2,), 5.0)}):
        blocked.__exit__(None, None, None)
        out = m(x)  # the swap is still active, the stop_gradient is not
        assert torch.equal(out, F.linear(x, m.weight, torch.full((2,), 5.0)))
        out.sum().backward()
        assert m.weight.grad is not None
    assert modes() == (0, 0)
    assert torch.equal(m(x), F.linear(x, m.weight, m.bias))


def test_decorated_generator_with_a_block_open_across_yield():
    """A generator decorated with one block, holding another open while suspended: each
    resumption enters and leaves the decorator's block without taking the inner one along."""
    m, x = nn.Linear(2, 2), torch.ones(1, 2)
    five = torch.full((2,), 5.0)

    @ts.stop_gradient(m, "weight")
    def gen():
        with ts.swap(m, {"bias": five}):
            yield m(x)
            yield m(x)

    g = gen()
    first = next(g)
    assert not first.requires_grad  # weight blocked, bias swapped for a constant
    assert torch.equal(first, F.linear(x, m.weight, five))
    assert len(_get_current_function_mode_stack()) == 1  # the generator's swap, still open
    assert torch.equal(next(g), first)
    g.close()
    assert modes() == (0, 0)
    m(x).sum().backward()
    assert m.weight.grad is not None


def test_constant_exited_out_of_order_raises_and_stays_active():
    m = nn.Linear(2, 2)
    ro = ts.constant(m, "bias")
    other = ts.constant(m, "weight")
    with pytest.raises(RuntimeError, match="reverse order"):
        ro.__exit__(None, None, None)
    with torch.no_grad(), pytest.raises(RuntimeError, match="'bias'"):
        m.bias.add_(1)
    other.__exit__(None, None, None)
    ro.__exit__(None, None, None)
    assert modes() == (0, 0)


@pytest.mark.parametrize("kind", ["stop_gradient", "constant"])
def test_blocks_are_thread_local(kind):
    m, x = nn.Linear(2, 2), torch.ones(1, 2)
    inside, seen, errors = threading.Event(), {}, []
    done = threading.Event()

    def other():
        inside.wait()
        try:
            m.zero_grad(set_to_none=True)
            m(x).sum().backward()
            seen["grad"] = m.weight.grad is not None
            with torch.no_grad():
                m.weight.add_(0.0)  # not read-only in this thread
            seen["modes"] = modes()
        except Exception as e:  # noqa: BLE001
            errors.append(e)
        done.set()

    t = threading.Thread(target=other)
    t.start()
    block = ts.stop_gradient(m) if kind == "stop_gradient" else ts.constant(m)
    with block:
        inside.set()
        done.wait()
    t.join()
    assert not errors and seen == {"grad": True, "modes": (0, 0)}


@pytest.mark.parametrize("kind", ["stop_gradient", "constant"])
def test_exiting_a_bare_block_in_another_thread_is_an_error(kind):
    m = nn.Linear(2, 2)
    block = ts.stop_gradient(m) if kind == "stop_gradient" else ts.constant(m)
    active = modes()
    errors = []

    def other():
        try:
            block.__exit__(None, None, None)
        except RuntimeError as e:
            errors.append(str(e))

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert errors and "thread" in errors[0]
    assert modes() == active != (0, 0)
    block.__exit__(None, None, None)
    assert modes() == (0, 0)


@pytest.mark.parametrize("kind", ["stop_gradient", "swap"])
def test_flag_and_hook_methods_act_on_the_parameter(kind):
    m, t = nn.Linear(2, 2), torch.zeros(2, requires_grad=True)
    block = (lambda: ts.stop_gradient(m)) if kind == "stop_gradient" else (
        lambda: ts.swap(m, {"bias": t}))
    with block():
        m.requires_grad_(False)
    assert [p.requires_grad for p in m.parameters()] == [False, False] and t.requires_grad
    seen = []
    with block():
        m.bias.requires_grad_(True)
        m.bias.register_hook(lambda g: seen.append(g.clone()))
    assert m.bias.requires_grad and not m.weight.requires_grad
    m(torch.ones(1, 2)).sum().backward()
    assert len(seen) == 1 and torch.equal(seen[0], m.bias.grad)


def test_deepcopy_inside_stop_gradient_keeps_flags():
    m = nn.Linear(2, 2)
    m.bias.requires_grad_(False)
    with ts.stop_gradient(m):
        c = copy.deepcopy(m)
        buf = io.BytesIO()
        torch.save(m, buf)
        assert not m.weight.requires_grad  # code outside torchstruct still reads the stand-in
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for copied in (c, loaded):
        assert [p.requires_grad for p in copied.parameters()] == [True, False]


# --------------------------------------------------------------------------- constant
def _trained():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    m(torch.randn(2, 3)).sum().backward()
    return m


def _opt(cls, **kw):
    return lambda m: cls(m.parameters(), lr=0.1, **kw).step()


W = lambda m: m[0].weight  # noqa: E731


def _no_grad(fn):
    with torch.no_grad():
        return fn()


WRITES = {
    "data.add_": lambda m: W(m).data.add_(1),
    "detach.copy_": lambda m: W(m).detach().copy_(torch.zeros(3, 3)),
    "sgd_foreach": _opt(torch.optim.SGD, momentum=0.9, foreach=True),
    "sgd_fused": _opt(torch.optim.SGD, fused=True),
    "sgd_loop": _opt(torch.optim.SGD, foreach=False),
    "adamw_foreach": _opt(torch.optim.AdamW, foreach=True),
    "adamw_fused": _opt(torch.optim.AdamW, fused=True),
    "adamw_loop": _opt(torch.optim.AdamW, foreach=False),
    "adagrad": _opt(torch.optim.Adagrad),
    "ts_sgd": _opt(ts.optim.SGD),
    "ts_adamw": _opt(ts.optim.AdamW),
    "foreach_add_": lambda m: torch._foreach_add_([p.detach() for p in m.parameters()], 1.0),
    "out=": lambda m: torch.add(torch.ones(3, 3), 1, out=W(m).data),
    "view_then_in_place": lambda m: W(m).detach().view(-1)[2:5].mul_(0),
    "as_strided_fill": lambda m: W(m).detach().as_strided((2,), (4,)).fill_(0),
    "set_": lambda m: W(m).data.set_(torch.zeros(3, 3)),
    "resize_": lambda m: W(m).data.resize_(2),
    "t_": lambda m: _no_grad(W(m).t_),  # (on an alias it changes the alias only: allowed)
    "init.zeros_": lambda m: nn.init.zeros_(W(m)),
    "apply_init": lambda m: m.apply(lambda mod: nn.init.ones_(mod.weight)
                                    if isinstance(mod, nn.Linear) else None),
    "polyak_update": lambda m: ts.polyak_update(m, _trained(), 0.5),
    "dlpack_alias": lambda m: torch.utils.dlpack.from_dlpack(W(m).detach()).fill_(0),
    "numpy_alias_through_torch": lambda m: torch.from_numpy(W(m).detach().numpy()).fill_(0),
}


@pytest.mark.parametrize("write", WRITES)
def test_constant_refuses_every_write_path(write):
    m = _trained()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    with ts.constant(m, "0"), pytest.raises(RuntimeError, match=r"constant: .*'0\.(weight|bias)'"):
        WRITES[write](m)
    assert all(torch.equal(p, before[n]) for n, p in m.named_parameters() if n.startswith("0."))
    assert modes() == (0, 0)


def test_constant_with_a_compiled_forward():
    """Frames run eagerly under the dispatch mode (results as eager); fullgraph=True raises
    (torch 2.13 on) or runs eagerly too (2.12)."""
    torch._dynamo.reset()
    m, x = _trained(), torch.randn(2, 3)
    with ts.constant(m):
        assert torch.equal(torch.compile(m, backend="eager")(x), m(x))
        try:
            out = torch.compile(m, backend="eager", fullgraph=True)(x)
        except RuntimeError as err:
            assert "fullgraph" in str(err)
        else:
            assert torch.equal(out, m(x))
    assert modes() == (0, 0)


class _WritesInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x):
        with torch.no_grad():
            self.w.mul_(2)
        return self.w * x


@pytest.mark.skipif(TORCH < (2, 11), reason="compiled code escapes dispatch modes on older "
                                             "torch (2.4 seen; docs/stop_gradient.md)")
@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
@pytest.mark.parametrize("compiled_before", [False, True])
def test_constant_refuses_a_write_by_compiled_code(backend, compiled_before):
    torch._dynamo.reset()
    m = _WritesInForward()
    cm = torch.compile(m, backend=backend)
    if compiled_before:  # a graph cached outside the block is not run inside it
        cm(torch.ones(3))
    before = m.w.detach().clone()
    with ts.constant(m), pytest.raises(RuntimeError, match=r"constant: .*'w'"):
        cm(torch.ones(3))
    assert torch.equal(m.w, before)


def test_constant_load_state_dict_refused_for_the_selected():
    m = _trained()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    state = {k: torch.zeros_like(v) for k, v in m.state_dict().items()}
    with ts.constant(m, "0"), pytest.raises(RuntimeError, match=r"constant: aten::copy_"):
        m.load_state_dict(state)
    assert torch.equal(m[0].weight, before["0.weight"]) and torch.equal(m[0].bias, before["0.bias"])


def test_constant_allows_grad_writes_reads_and_the_unselected():
    m = _trained()
    before = m[0].weight.detach().clone()
    with ts.constant(m, "0"):
        m[0].weight.grad.mul_(2)
        m.zero_grad(set_to_none=False)
        m(torch.randn(2, 3)).sum().backward()
        nn.utils.clip_grad_norm_(m.parameters(), 0.01)
        ts.clip_by_global_norm(m, 0.01)
        torch.optim.SGD(m[1].parameters(), lr=0.1, foreach=True).step()
        m.float()
    assert torch.equal(m[0].weight, before)


@pytest.mark.parametrize("rebind", [
    lambda m: nn.utils.vector_to_parameters(torch.zeros(16), m.parameters()),
    lambda m: setattr(m[0].bias, "data", torch.zeros(3)),
    lambda m: m.double(),
])
def test_constant_refuses_rebinding_data(rebind):
    """``p.data = other`` is not an aten write: the block refuses it at the attribute."""
    m = _trained()
    before = [p.detach().clone() for p in m[0].parameters()]
    with ts.constant(m, "0"), pytest.raises(RuntimeError, match=r"\.data .*'0\.(weight|bias)'"):
        rebind(m)
    assert all(torch.equal(p, b) for p, b in zip(m[0].parameters(), before))
    assert modes() == (0, 0)


def test_constant_allows_rebinding_to_the_same_memory_and_the_unselected():
    m = _trained()
    with ts.constant(m, "0"):
        m.float()  # each parameter's .data set to itself
        m.to("cpu")
        m[0].weight.data = m[0].weight.data
        m[1].weight.data = torch.zeros(1, 3)
        m[0].weight.detach().data = torch.zeros(3, 3)  # rebinds an alias only
    assert torch.equal(m[1].weight, torch.zeros(1, 3))


def test_constant_parameter_inside_a_larger_buffer_written_through_an_alias():
    """Protection is by memory: a parameter that is a view into a flat buffer is protected
    also against a write through another storage object on the same bytes."""
    flat = torch.zeros(20)
    m = nn.Module()
    m.a = nn.Parameter(flat[:10].view(2, 5))
    m.b = nn.Parameter(flat[10:].view(2, 5))
    alias = torch.from_numpy(m.b.detach().numpy())  # a new storage starting at b's bytes
    with ts.constant(m, "b"), pytest.raises(RuntimeError, match="'b'"):
        alias.fill_(1.0)
    assert torch.equal(m.b, torch.zeros(2, 5))


def test_constant_on_meta_parameters_refuses_only_the_selected():
    """Meta tensors have no bytes (every data_ptr is 0): told apart by storage."""
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)).to("meta")
    with ts.constant(m, "0"), torch.no_grad():
        m[1].weight.add_(1)
        with pytest.raises(RuntimeError, match="'0.weight'"):
            m[0].weight.add_(1)


def test_constant_sparse_parameter_written_directly():
    """A sparse parameter has no strided memory: protected by identity."""
    m = nn.Module()
    m.s = nn.Parameter(torch.sparse_coo_tensor([[0, 1]], [1.0, 2.0], (3,)))
    with ts.constant(m), torch.no_grad(), pytest.raises(RuntimeError, match="'s'"):
        m.s.mul_(2)
    assert torch.equal(m.s.to_dense(), torch.tensor([1.0, 2.0, 0.0]))


def test_constant_sparse_parameter_written_through_data():
    m = nn.Module()
    m.s = nn.Parameter(torch.sparse_coo_tensor([[0, 1]], [1.0, 2.0], (3,)))
    with ts.constant(m), pytest.raises(RuntimeError, match="'s'"):
        m.s.data.mul_(2)
    assert torch.equal(m.s.to_dense(), torch.tensor([1.0, 2.0, 0.0]))


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_constant_sparse_parameter_aliases_are_protected_and_copies_are_free(layout):
    dense = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    m = nn.Module()
    m.s = nn.Parameter(dense.to_sparse() if layout == "coo" else dense.to_sparse_csr())
    with ts.constant(m):
        for alias in (lambda p: p.data, lambda p: p.detach()):
            with pytest.raises(RuntimeError, match="'s'"):
                alias(m.s).mul_(2)
        with torch.no_grad():
            copy_ = m.s.clone()
            copy_.mul_(3)  # its own bytes: allowed
            m.s.values().clone().add_(1)
            with pytest.raises(RuntimeError, match="'s'"):
                m.s.values().add_(1)  # the values themselves, strided
    assert torch.equal(m.s.to_dense(), dense)
    assert torch.equal(copy_.to_dense(), dense * 3)


# --------------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize("make, error", [
    (lambda m: ts.stop_gradient(m, "0.wieght"), ValueError),
    (lambda m: ts.constant(m, ["0", []]), ValueError),
    (lambda m: ts.stop_gradient(m, 3), TypeError),
    (lambda m: ts.constant(m, nn.Linear(2, 2)), ValueError),
    (lambda m: ts.swap(m, {"0": {"weight": torch.zeros(2, 2)}}), ValueError),
    (lambda m: ts.swap(m, {"0.weight": torch.zeros(3, 2, dtype=torch.float64)}), ValueError),
    (lambda m: ts.swap(m, {"0.weight": torch.zeros(3, 2), "1.bias": torch.zeros(5)}), ValueError),
    (lambda m: ts.swap(m, {"0.weight": 1.0}), TypeError),
    (lambda m: ts.swap(m, {"0.weight": torch.zeros(3, 2).to_sparse()}), ValueError),
    (lambda m: ts.swap(m, {"2.weight": torch.zeros(1, 3)}), ValueError),
    (lambda m: ts.swap(m, [torch.zeros(3, 2)]), TypeError),
    (lambda m: ts.swap(nn.Linear(2, 2).weight, {}), TypeError),
])
def test_bad_input_raises_and_leaves_nothing_active(make, error):
    m = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    with pytest.raises(error, match=r"'0\.wieght'|'0\.weight'|'1\.bias'|'2\.weight'|empty|"
                                    r"selector|submodule|tensor|dict|Module"):
        make(m)
    assert modes() == (0, 0)


# --------------------------------------------------------------------------- selectors
def brute(model, pattern):
    """Canonical paths of the parameters one of whose paths has a dotted prefix matching."""
    rows = model.named_parameters(remove_duplicate=False)
    hit = {}
    for path, p in rows:
        parts = path.split(".")
        match = any(fnmatch.fnmatchcase(".".join(parts[:k]), pattern)
                    for k in range(1, len(parts) + 1))
        hit[id(p)] = hit.get(id(p), False) or match
    return [n for n, p in model.named_parameters() if hit[id(p)]]


def odd_model():
    m = nn.ModuleDict({
        "layer": nn.ModuleList([nn.Linear(1, 1) for _ in range(12)]),
        "encoder": nn.Sequential(nn.Linear(1, 1), nn.LayerNorm(1)),
        "norm": nn.LayerNorm(1),
        "x[1]": nn.Linear(1, 1),
        "x1": nn.Linear(1, 1),
        "block-2": nn.Linear(1, 1, bias=False),
    })
    m["pd"] = nn.ParameterDict({"alpha": nn.Parameter(torch.ones(1)),
                                "beta1": nn.Parameter(torch.ones(1))})
    m["pl"] = nn.ParameterList([nn.Parameter(torch.ones(1)) for _ in range(3)])
    m["tied"] = nn.Linear(1, 1)
    m["tied"].weight = m["layer"][10].weight
    return m


PATTERNS = ["encoder", "encoder.*", "*.norm", "*norm*", "*bias", "*.bias", "layer.1*", "layer.10",
            "layer.1", "layer.1?.weight", "layer.[12]", "layer.[!1]*", "x[1]", "x[[]1]", "x?1?.*",
            "block-2", "pd", "pd.beta?", "pl.*", "pl.1", "*.?", "tied", "tied.weight", "*"]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_glob_equals_brute_force_over_every_path(pattern):
    m = odd_model()
    want = brute(m, pattern)
    if want:
        assert [n for n, _ in ts.select(m, pattern)] == want
    else:
        with pytest.raises(ValueError, match="closest paths"):
            ts.select(m, pattern)
        assert ts.select(m, pattern, strict=False) == []


def test_glob_details():
    m = odd_model()
    pick = lambda *s: [n for n, _ in ts.select(m, *s)]  # noqa: E731
    assert pick("layer.1") == ["layer.1.weight", "layer.1.bias"]  # not layer.10, layer.11
    assert pick("x[1]") == ["x1.weight", "x1.bias"]  # brackets are a character class
    assert pick("x[[]1]") == ["x[1].weight", "x[1].bias"]  # a literal bracket
    assert pick("tied") == ["layer.10.weight", "tied.bias"]  # tied: at its canonical path
    with pytest.raises(ValueError, match="'norm'"):
        ts.select(m, "*.norm")  # fnmatch: "*." needs a dot, the top-level norm has none
    assert pick("*norm") == ["encoder.1.weight", "encoder.1.bias", "norm.weight", "norm.bias"][2:]


def test_regex_callables_objects_and_lists():
    m = odd_model()
    pick = lambda *s, **k: [n for n, _ in ts.select(m, *s, **k)]  # noqa: E731
    every = [n for n, _ in m.named_parameters(remove_duplicate=False)]
    rx = re.compile(r"layer\.1\d?\.weight")
    assert pick(rx) == [n for n, _ in m.named_parameters() if rx.fullmatch(n)]
    assert pick(re.compile(r"tied\.weight")) == ["layer.10.weight"]  # any path of a tied one
    with pytest.raises(ValueError, match="fully matches no parameter path"):
        ts.select(m, re.compile("layer"))  # fullmatch, on parameter paths only
    seen = []
    ts.select(m, lambda path, p: seen.append(path))
    assert sorted(seen) == sorted(every)  # every path of a tied parameter is asked
    assert pick(lambda path, p: torch.tensor(path.endswith("bias"))) == brute(m, "*bias")
    assert pick(m["encoder"], m["pd"]["alpha"], [[m["pl"][2]], ("norm",)]) == [
        "encoder.0.weight", "encoder.0.bias", "encoder.1.weight", "encoder.1.bias",
        "norm.weight", "norm.bias", "pd.alpha", "pl.2"]
    assert pick(m["tied"].weight) == ["layer.10.weight"]
    assert pick(m["pl"]) == ["pl.0", "pl.1", "pl.2"] and pick(m["pd"]) == ["pd.alpha", "pd.beta1"]


@pytest.mark.parametrize("bad, error, match", [
    ([], ValueError, "empty list"),
    ([["layer.1"], ()], ValueError, "empty list"),
    (nn.Linear(1, 1), ValueError, "not a submodule"),
    (nn.Parameter(torch.ones(1)), ValueError, "not a parameter of the model"),
    ("layr.1", ValueError, "'layer.1"),
    ("encodr", ValueError, "'encoder"),
    (re.compile(r"layr\.1\.weight"), ValueError, "'layer.1.weight'"),
    ((p for p in [1]), TypeError, "got generator"),
    ({"layer"}, TypeError, "got set"),
    (torch.ones(1), TypeError, "got Tensor"),
])
def test_selector_errors(bad, error, match):
    with pytest.raises(error, match=re.escape(match) if "'" in match else match):
        ts.select(odd_model(), bad)


def test_foreign_objects_with_strict_false_select_nothing():
    m = odd_model()
    assert ts.select(m, nn.Linear(1, 1), nn.Parameter(torch.ones(1)), strict=False) == []


def test_module_names_with_dots_or_digits():
    m = nn.Module()
    m.add_module("7", nn.Linear(1, 1))
    m._modules["a.b"] = nn.Linear(1, 1)  # a dotted name, possible only through _modules
    assert [n for n, _ in ts.select(m, "7")] == ["7.weight", "7.bias"]
    assert [n for n, _ in ts.select(m, "a.b")] == ["a.b.weight", "a.b.bias"]
    assert [n for n, _ in ts.select(m, "a.*")] == brute(m, "a.*")
