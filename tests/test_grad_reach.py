"""structural_grad never returns a silent zero for a parameter the loss cannot reach.

Reentrant activation checkpointing hides the checkpointed parameters from
``torch.autograd.grad``; their gradients are computed exactly (compared with ``.backward()``),
without ``.grad`` side effects. A loss that reaches none of the asked parameters raises.
"""
import copy
import functools
import os

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import torchstruct as ts
from torchstruct.select import index

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class Ckpt(nn.Module):
    """Embedding-like input layer, a checkpointed middle, a head; ``tie`` shares a weight
    between a layer inside the checkpoint and the head."""

    def __init__(self, reentrant=True, tie=False, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(4, 6)
        self.mid = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh())
        self.head = nn.Linear(6, 6)
        self.out = nn.Linear(6, 1)
        if tie:
            self.head.weight = self.mid[2].weight
        self.reentrant = reentrant

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = checkpoint(self.mid, h, use_reentrant=self.reentrant)
        return self.out(torch.tanh(self.head(h)))


def data(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(5, 4, generator=g), torch.randn(5, 1, generator=g)


def loss_of(x, y):
    return lambda m: ((m(x) - y) ** 2).mean()


def backward_grads(model, loss_fn, asked=None):
    """{canonical path: .grad} by plain .backward() on a deep copy (tied once)."""
    ref = copy.deepcopy(model)
    loss_fn(ref).backward()
    paths = [p for p, _ in ts.select(ref, asked)] if asked is not None else None
    out = {path: p.grad for path, p in index(ref)}
    return out if paths is None else {p: out[p] for p in paths}


def backward_misses(model, loss_fn, asked) -> bool:
    """Whether plain .backward(), with only the ``asked`` parameters requiring grad (on a deep
    copy), leaves one of them without a gradient (or has no graph at all)."""
    ref = copy.deepcopy(model)
    ts.detach_hooks(ref)
    chosen = {id(p) for _, p in ts.select(ref, asked)}
    for p in ref.parameters():
        p.requires_grad_(id(p) in chosen)
        p.grad = None
    loss = loss_fn(ref)
    if loss.requires_grad:
        loss.backward()
    return any(p.grad is None for p in ref.parameters() if id(p) in chosen)


def assert_equal_to(tree, ref):
    got = ts.tree.to_flat_dict(tree)
    assert list(got) == list(ref)
    for path, g in ref.items():
        assert torch.equal(got[path], g), path


def sentinels(model):
    """Give every parameter a recognisable stale .grad; return a checker."""
    stale = {}
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
        stale[p] = p.grad

    def unchanged():
        return all(p.grad is s and bool((s == 7.0).all()) for p, s in stale.items())

    return unchanged


# ----------------------------------------------------------------------------- exact values
@pytest.mark.parametrize("form", ["callable", "tensor"])
@pytest.mark.parametrize("wrt", [None, "mid", "mid.2.weight", ["inp", "out"], "head"])
@pytest.mark.parametrize("input_grad", [False, True])
def test_reentrant_checkpoint_matches_backward(form, wrt, input_grad):
    m, (x, y) = Ckpt(), data()
    x.requires_grad_(input_grad)
    ref = backward_grads(m, loss_of(x, y), wrt)
    loss = loss_of(x, y) if form == "callable" else loss_of(x, y)(m)
    if form == "callable" and wrt in ("mid", "mid.2.weight") and not input_grad:
        # With wrt=, only the asked parameters require grad in the forward: the checkpoint's
        # input (from the input layer, now frozen) requires no grad and the checkpoint records
        # nothing. An error names the parameter, instead of a zero.
        with pytest.raises(ValueError, match=r"'mid.[02].weight' is used inside a reentrant "):
            ts.structural_grad(m, loss, wrt=wrt)
        assert all(p.requires_grad and p.grad is None for p in m.parameters())
        return
    g = ts.structural_grad(m, loss, wrt=wrt)
    assert_equal_to(g, ref)
    assert all(t.abs().sum() > 0 for t in ts.tree.leaves(g))


def test_dead_reentrant_checkpoint_with_own_flags_raises():
    """A checkpoint whose input requires no grad because the user froze the layers before it:
    .backward() silently misses the parameters inside; structural_grad names them."""
    m, (x, y) = Ckpt(), data()
    with ts.freeze(m, "inp"):
        with pytest.raises(ValueError, match="'mid.0.weight' is used inside a reentrant"):
            ts.structural_grad(m, loss_of(x, y))
        g = ts.structural_grad(m, loss_of(x, y), wrt="out")  # nothing asked inside: fine
        assert_equal_to(g, backward_grads(m, loss_of(x, y), "out"))


def test_reentrant_checkpoint_leaves_grads_flags_and_inputs_alone():
    m, (x, y) = Ckpt(), data()
    x = x.clone().requires_grad_()
    unchanged = sentinels(m)
    flags = [p.requires_grad for p in m.parameters()]
    ref = backward_grads(m, loss_of(x, y), "mid")
    x.grad = None
    g = ts.structural_grad(m, loss_of(x, y)(m), wrt="mid")
    assert_equal_to(g, ref)
    assert unchanged()
    assert x.grad is None and x.requires_grad
    assert [p.requires_grad for p in m.parameters()] == flags


class FedDirectly(nn.Module):
    """A checkpoint whose input is a leaf outside the model (HF's enable_input_require_grads
    on an embedding's output, or an input with requires_grad_()), its function frozen or not
    asked."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.mid = nn.Linear(4, 4)
        self.out = nn.Linear(4, 1)

    def forward(self, h):
        return self.out(checkpoint(self.mid, h, use_reentrant=True)).sum()


@pytest.mark.parametrize("stale", [None, 3.0])
@pytest.mark.parametrize("how", ["frozen", "wrt"])
def test_reentrant_checkpoint_fed_by_a_leaf_gives_the_gradients_and_keeps_its_grad(how, stale):
    m = FedDirectly()
    h = torch.randn(3, 4).requires_grad_()
    h.grad = None if stale is None else torch.full((3, 4), stale)
    ref = backward_grads(m, lambda mm: mm(h.detach().requires_grad_()), "out")
    if how == "frozen":
        with ts.freeze(m, "mid"):
            g = ts.structural_grad(m, lambda mm: mm(h))
    else:
        g = ts.structural_grad(m, lambda mm: mm(h), wrt="out")
    assert_equal_to(g, ref)
    assert h.requires_grad
    assert (h.grad is None) if stale is None else bool((h.grad == stale).all())
    assert all(p.grad is None and p.requires_grad for p in m.parameters())


def test_reentrant_checkpoint_fed_by_a_hooked_leaf_is_refused_and_changes_nothing():
    m = FedDirectly()
    h = torch.randn(3, 4).requires_grad_()
    calls = []
    h.register_hook(lambda g: calls.append(g))
    with pytest.raises(RuntimeError, match="outside the model has a gradient hook"):
        ts.structural_grad(m, lambda mm: mm(h), wrt="out")
    assert not calls and h.grad is None
    assert all(p.grad is None and p.requires_grad for p in m.parameters())


def test_reentrant_checkpoint_other_model_inside_is_left_alone():
    """A foreign module called inside the checkpoint: its parameters get no .grad."""
    m, (x, y) = Ckpt(), data()
    other = nn.Linear(6, 6)

    def loss(mm):
        h = torch.tanh(mm.inp(x))
        h = checkpoint(lambda t: other(mm.mid(t)), h, use_reentrant=True)
        return ((mm.out(torch.tanh(mm.head(h))) - y) ** 2).mean()

    m_ref, other_ref = copy.deepcopy(m), copy.deepcopy(other)
    ((m_ref.out(torch.tanh(m_ref.head(checkpoint(lambda t: other_ref(m_ref.mid(t)),
                                                 torch.tanh(m_ref.inp(x)), use_reentrant=True))))
      - y) ** 2).mean().backward()
    g = ts.structural_grad(m, loss)
    assert_equal_to(g, {path: p.grad for path, p in index(m_ref)})
    assert other.weight.grad is None and other.bias.grad is None
    assert other.weight.requires_grad


def test_reentrant_checkpoint_tied_across_the_checkpoint():
    m, (x, y) = Ckpt(tie=True), data()
    ref = backward_grads(m, loss_of(x, y))
    g = ts.structural_grad(m, loss_of(x, y))
    assert "head.weight" not in ts.tree.to_flat_dict(g)
    assert_equal_to(g, ref)                          # total over both uses
    g_head = ts.structural_grad(m, loss_of(x, y)(m), wrt="head.weight")
    assert ts.tree.paths(g_head) == ["mid.2.weight"]
    assert torch.equal(g_head["mid"]["2"]["weight"], ref["mid.2.weight"])
    # callable form: only the tied weight requires grad, the checkpoint records nothing, and
    # the use inside it would be lost: an error, not a partial gradient
    with pytest.raises(ValueError, match="'mid.2.weight' is used inside a reentrant"):
        ts.structural_grad(m, loss_of(x, y), wrt="head.weight")
    xg = x.clone().requires_grad_()
    g_head = ts.structural_grad(m, loss_of(xg, y), wrt="head.weight")
    assert torch.equal(g_head["mid"]["2"]["weight"], ref["mid.2.weight"])


def test_reentrant_checkpoint_sequential_and_partial():
    torch.manual_seed(0)
    seq = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    x = torch.randn(3, 4, requires_grad=True)
    fn = lambda m: checkpoint_sequential(m, 2, x, use_reentrant=True).pow(2).sum()  # noqa: E731
    assert_equal_to(ts.structural_grad(seq, fn), backward_grads(seq, fn))
    def fn2(m):
        return checkpoint(functools.partial(m.__call__), x, use_reentrant=True).sum()

    assert_equal_to(ts.structural_grad(seq, fn2, wrt="0"), backward_grads(seq, fn2, "0"))


def test_reentrant_checkpoint_retain_graph_and_unused_zeros():
    m, (x, y) = Ckpt(), data()
    m.spare = nn.Linear(2, 2)                          # registered, never called
    loss = loss_of(x, y)(m)
    ref = backward_grads(m, loss_of(x, y), "mid")
    g1 = ts.structural_grad(m, loss, wrt=["mid", "spare"], retain_graph=True)
    g2 = ts.structural_grad(m, loss, wrt="mid")
    assert torch.equal(g1["mid"]["0"]["weight"], ref["mid.0.weight"])
    assert torch.equal(g2["mid"]["0"]["weight"], ref["mid.0.weight"])
    assert not g1["spare"]["weight"].any()             # unused by the forward: zeros


def test_non_reentrant_checkpoint_uses_autograd_grad():
    m, (x, y) = Ckpt(reentrant=False), data()
    fired = []
    m.inp.weight.register_hook(lambda g: fired.append("inp"))
    assert_equal_to(ts.structural_grad(m, loss_of(x, y), wrt="mid"),
                    backward_grads(m, loss_of(x, y), "mid"))
    assert fired == []                                 # the unasked input layer never ran
    assert_equal_to(ts.structural_grad(m, loss_of(x, y)), backward_grads(m, loss_of(x, y)))


def test_non_reentrant_checkpoint_create_graph_matches_plain():
    """Hessian-vector products through a non-reentrant checkpoint equal those without it."""
    (x, y) = data()
    results = []
    for reentrant in (False, None):
        m = Ckpt(reentrant=False)
        if reentrant is None:                        # no checkpoint at all
            m.forward = lambda t, m=m: m.out(torch.tanh(m.head(m.mid(torch.tanh(m.inp(t))))))
        g = ts.structural_grad(m, loss_of(x, y), create_graph=True)
        v = ts.tree.map(torch.ones_like, g)
        gv = sum((a * b).sum() for a, b in zip(ts.tree.leaves(g), ts.tree.leaves(v)))
        results.append(ts.tree.leaves(ts.structural_grad(m, gv)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- errors
def test_reentrant_checkpoint_create_graph_raises_and_changes_nothing():
    m, (x, y) = Ckpt(), data()
    unchanged = sentinels(m)
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        ts.structural_grad(m, loss_of(x, y), create_graph=True)
    with pytest.raises(RuntimeError, match="create_graph"):
        ts.structural_grad(m, loss_of(x, y)(m), wrt="out", create_graph=True)
    assert unchanged() and all(p.requires_grad for p in m.parameters())


def test_loss_from_another_model_names_the_paths():
    m, other, (x, y) = Ckpt(reentrant=False), Ckpt(reentrant=False, seed=3), data()
    unchanged = sentinels(m)
    for loss in (loss_of(x, y)(other), lambda mm: loss_of(x, y)(other)):
        with pytest.raises(ValueError, match=r"reaches none of the asked parameters "
                                             r"\('inp.weight', 'inp.bias', 'mid.0.weight' and 7 "
                                             r"more\)"):
            ts.structural_grad(m, loss)
    with pytest.raises(ValueError, match="'mid.0.weight'"):
        ts.value_and_grad(lambda mm: loss_of(x, y)(other), m, wrt="mid.0.weight")
    assert unchanged() and all(p.requires_grad for p in m.parameters())


def test_loss_from_another_checkpointed_model_raises_and_leaves_it_alone():
    m, other, (x, y) = Ckpt(), Ckpt(seed=3), data()
    unchanged, other_unchanged = sentinels(m), sentinels(other)
    with pytest.raises(ValueError, match="reaches none of the asked parameters"):
        ts.structural_grad(m, loss_of(x, y)(other))
    with pytest.raises(ValueError, match="'mid.0.weight'"):
        ts.structural_grad(m, loss_of(x, y)(other), wrt="mid")
    assert unchanged() and other_unchanged()
    assert all(p.requires_grad for p in [*m.parameters(), *other.parameters()])


def test_detached_copies_raise():
    m, (x, y) = Ckpt(reentrant=False), data()
    params = {n: p.detach().clone().requires_grad_() for n, p in m.named_parameters()}
    loss = ((torch.func.functional_call(m, params, (x,)) - y) ** 2).mean()
    with pytest.raises(ValueError, match="copies of the parameters"):
        ts.structural_grad(m, loss)


def test_unused_versus_unreachable():
    """Some asked parameters reached: the others are unused by this forward and get zeros.
    None reached: an error."""

    class WithSpare(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.spare = nn.Linear(4, 1), nn.Linear(4, 1)

        def forward(self, x):
            return self.used(x)

    m, (x, _) = WithSpare(), data()
    for loss in (lambda mm: mm(x).sum(), m(x).sum()):
        g = ts.structural_grad(m, loss, retain_graph=True)
        assert not g["spare"]["weight"].any() and g["used"]["weight"].abs().sum() > 0
        with pytest.raises(ValueError, match="'spare.weight', 'spare.bias'"):
            ts.structural_grad(m, loss, wrt="spare", retain_graph=True)


def test_post_accumulate_hook_with_reentrant_checkpoint_raises():
    m, (x, y) = Ckpt(), data()
    steps = []
    m.mid[0].weight.register_post_accumulate_grad_hook(lambda p: steps.append(1))
    with pytest.raises(RuntimeError, match="'mid.0.weight' has a post-accumulate-grad hook"):
        ts.structural_grad(m, loss_of(x, y))
    assert steps == [] and all(p.grad is None for p in m.parameters())
    m2 = Ckpt(reentrant=False)
    m2.mid[0].weight.register_post_accumulate_grad_hook(lambda p: steps.append(1))
    ts.structural_grad(m2, loss_of(x, y))            # autograd.grad never runs such hooks
    assert steps == []


# ----------------------------------------------------------------------------- HF GPT-2
@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("wrt", [None, "transformer.h.1",
                                 ["transformer.wte", "transformer.h.0.attn"]])
def test_hf_gpt2_gradient_checkpointing_matches_backward(reentrant, wrt):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(2))
    loss_fn = lambda m: m(input_ids=ids, labels=ids).loss  # noqa: E731
    ref = backward_grads(model, loss_fn, wrt)
    unchanged = sentinels(model)
    try:
        g = ts.structural_grad(model, loss_fn, wrt=wrt)
    except ValueError as err:
        # transformers before 5 leaves the checkpoint's input as it is: with only the asked
        # layer requiring grad, nothing is recorded inside its reentrant checkpoint
        assert reentrant and "none of whose inputs requires grad" in str(err), err
        assert backward_misses(model, loss_fn, wrt)
        assert unchanged()
        return
    got = ts.tree.to_flat_dict(g)
    assert list(got) == list(ref)
    assert "lm_head.weight" not in got                # tied to transformer.wte.weight
    for path, r in ref.items():
        torch.testing.assert_close(got[path], r, rtol=1e-6, atol=1e-8, msg=path)
    assert any(got[p].abs().sum() > 0 for p in got if ".h.1." in p or ".h.0." in p)
    assert unchanged()
    if reentrant:
        with pytest.raises(RuntimeError, match="use_reentrant=False"):
            ts.structural_grad(model, loss_fn, wrt=wrt, create_graph=True)


def test_peft_lora_with_reentrant_checkpointing_matches_backward():
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(cfg)
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["c_attn"],
                                                      fan_in_fan_out=True, init_lora_weights=False))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(2))
    loss_fn = lambda m: m(input_ids=ids, labels=ids).loss  # noqa: E731
    if not loss_fn(copy.deepcopy(model)).requires_grad:
        # older transformers/peft leave the checkpoints' inputs as they are: every trainable
        # parameter is inside a reentrant checkpoint none of whose inputs requires grad, and
        # plain .backward() has no graph either; structural_grad says so
        with pytest.raises(ValueError, match="requires grad"):
            ts.structural_grad(model, loss_fn)
        assert all(p.grad is None for p in model.parameters())
        return
    ref = backward_grads(model, loss_fn, lambda path, p: p.requires_grad)
    assert len(ref) == 4 and all("lora_" in path for path in ref)
    got = ts.tree.to_flat_dict(ts.structural_grad(model, loss_fn))
    assert list(got) == list(ref)
    for path, r in ref.items():
        torch.testing.assert_close(got[path], r, rtol=1e-6, atol=1e-8, msg=path)
        assert r.abs().sum() > 0
    assert all(p.grad is None for p in model.parameters())
