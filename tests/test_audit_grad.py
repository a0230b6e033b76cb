"""Structural gradients and trees, tried as a suspicious PyTorch user would.

Every gradient is compared with PyTorch itself (``torch.autograd.grad`` or ``.backward()`` on
the same model and data), with ``torch.equal`` where the arithmetic is the same; every error
path checks that flags, ``.grad`` fields and parameters are left as they were.

A test marked ``xfail(strict=True)`` reproduces a case that goes wrong today; its reason says
what happens and what is expected.
"""
import copy
import os
import re
import warnings

import pytest
import torch
from torch import nn
from torch.autograd import forward_ad as fwad
from torch.utils.checkpoint import checkpoint

import torchstruct as ts

T = ts.tree
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore:Complex modules")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def flat(tree):
    return T.to_flat_dict(tree)


def flags(m):
    return [p.requires_grad for p in m.parameters()]


def same(tree, names, grads):
    """``tree`` holds exactly ``grads`` (torch.equal) at ``names``, and nothing else."""
    f = flat(tree)
    return list(f) == list(names) and all(torch.equal(f[n], g) for n, g in zip(names, grads))


def reference(model, loss_fn, names):
    """PyTorch's answer: ``torch.autograd.grad`` of a fresh forward w.r.t. ``names``."""
    params = dict(model.named_parameters(remove_duplicate=False))
    return torch.autograd.grad(loss_fn(model), [params[n] for n in names])


class Tied(nn.Module):
    """A block used twice (by two attributes) and a weight tied across two linears."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        self.b.weight = self.a.weight
        self.c = self.a
        self.head = nn.Linear(3, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))))


def mlp():
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


X = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))


def sq(m):
    return m(X).pow(2).sum()


# --- structural_grad: selectors -----------------------------------------------------------

def test_wrt_selecting_no_parameter_is_an_error():
    m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1), nn.Sequential())
    before = flags(m)
    for wrt in ("1", m[1], "3", m[3], lambda path, p: False):
        for loss in (sq, sq(m)):
            with pytest.raises(ValueError, match="selects no parameter"):
                ts.structural_grad(m, loss, wrt=wrt)
    with pytest.raises(ValueError, match="selects no parameter"):
        ts.value_and_grad(sq, m, wrt="1")
    assert flags(m) == before and all(p.grad is None for p in m.parameters())


# --- create_graph / retain_graph ----------------------------------------------------------

def test_create_graph_with_wrt_keeps_second_order_terms_like_autograd_grad():
    """MAML: the inner gradient of the head is differentiated w.r.t. the body too."""
    torch.manual_seed(0)
    m, x2 = mlp(), torch.randn(5, 3)

    def outer(gw, gb):
        h = torch.tanh(m[0](x2))
        return (h @ (m[2].weight - 0.1 * gw).T + (m[2].bias - 0.1 * gb)).pow(2).sum()

    params = list(m.parameters())
    gw, gb = torch.autograd.grad(sq(m), [m[2].weight, m[2].bias], create_graph=True)
    ref = torch.autograd.grad(outer(gw, gb), params)
    for loss in (sq, sq(m)):
        g = ts.structural_grad(m, loss, wrt="2", create_graph=True)
        assert torch.equal(g["2"]["weight"], gw) and g["2"]["weight"].requires_grad
        ours = torch.autograd.grad(outer(g["2"]["weight"], g["2"]["bias"]), params)
        assert all(torch.equal(a, b) for a, b in zip(ours, ref))
    assert flags(m) == [True] * 4


def test_create_graph_with_wrt_turns_on_a_frozen_parameter_and_keeps_the_others_off():
    m = mlp()
    with ts.freeze(m, "0"):
        g = ts.structural_grad(m, sq, wrt="0.bias", create_graph=True)
        assert flags(m) == [False, False, True, True]
    ref = torch.autograd.grad(sq(m), [m[0].bias], create_graph=True)[0]
    assert torch.equal(g["0"]["bias"], ref) and g["0"]["bias"].requires_grad
    # the second derivative reaches 0.bias and the trainable head, not the frozen 0.weight
    pen = g["0"]["bias"].pow(2).sum()
    assert pen.grad_fn is not None
    assert torch.autograd.grad(pen, [m[0].weight], allow_unused=True)[0] is None


def test_create_graph_full_second_order_matches_autograd_grad():
    m = Tied()
    names = [n for n, _ in m.named_parameters()]
    params = list(m.parameters())
    first = torch.autograd.grad(sq(m), params, create_graph=True)
    second = torch.autograd.grad(sum(g.pow(2).sum() for g in first), params)
    for loss in (sq, sq(m)):
        g = ts.structural_grad(m, loss, create_graph=True)
        assert same(g, names, first) and all(t.requires_grad for t in T.leaves(g))
        pen = sum(t.pow(2).sum() for t in T.leaves(g))
        assert same(ts.structural_grad(m, pen), names, second)


def test_retain_graph_defaults_to_create_graph_like_autograd_grad():
    m = mlp()
    loss = sq(m)
    a = ts.structural_grad(m, loss, retain_graph=True)
    b = ts.structural_grad(m, loss)  # retain_graph=None frees the graph
    assert all(torch.equal(u, v) for u, v in zip(T.leaves(a), T.leaves(b)))
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        ts.structural_grad(m, loss)


# --- structural_grad: against PyTorch -----------------------------------------------------

WRTS = {
    "glob": ("a.*", ["a.weight", "a.bias"]),
    "module path": ("head", ["head.weight", "head.bias"]),
    "regex": (re.compile(r".*bias"), ["a.bias", "b.bias", "head.bias"]),
    "callable": (lambda path, p: p.dim() == 2, ["a.weight", "head.weight"]),
    "later tied path": ("b.weight", ["a.weight"]),
    "block used twice (later path)": ("c", ["a.weight", "a.bias"]),
    "list": (["b.bias", "head.weight"], ["b.bias", "head.weight"]),
}


@pytest.mark.parametrize("kind", list(WRTS))
@pytest.mark.parametrize("form", ["tensor", "callable"])
def test_every_selector_kind_matches_autograd_grad_exactly(kind, form):
    m = Tied()
    wrt, names = WRTS[kind]
    ref = reference(m, sq, names)
    g = ts.structural_grad(m, sq(m) if form == "tensor" else sq, wrt=wrt)
    assert same(g, names, ref)
    assert flags(m) == [True] * 5 and all(p.grad is None for p in m.parameters())


def test_selector_objects_module_and_parameter():
    m = Tied()
    assert same(ts.structural_grad(m, sq, wrt=m.b), ["a.weight", "b.bias"],
                reference(m, sq, ["a.weight", "b.bias"]))
    assert same(ts.structural_grad(m, sq, wrt=m.head.bias), ["head.bias"],
                reference(m, sq, ["head.bias"]))


def test_tied_gradient_is_the_total_over_uses_like_backward():
    m = Tied()
    g = flat(ts.structural_grad(m, sq))
    assert list(g) == ["a.weight", "a.bias", "b.bias", "head.weight", "head.bias"]
    sq(m).backward()
    assert all(torch.equal(g[n], p.grad) for n, p in m.named_parameters())


def test_existing_grad_fields_and_flags_untouched():
    m = Tied()
    for p in m.parameters():
        p.grad = torch.full_like(p, 7.0)
    grads = [p.grad for p in m.parameters()]
    with ts.freeze(m, "head"):
        before = flags(m)
        ts.structural_grad(m, sq)
        ts.structural_grad(m, sq, wrt="head")
        ts.structural_grad(m, sq(m), wrt="a")
        ts.value_and_grad(sq, m, wrt="head.bias")
        assert flags(m) == before
    assert all(p.grad is g and bool((g == 7).all()) for p, g in zip(m.parameters(), grads))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.complex64])
def test_dtypes_match_autograd_grad_exactly(dtype):
    m = nn.Linear(3, 2).to(dtype)
    x = X.to(dtype) if not dtype.is_complex else torch.complex(X, X.flip(0))

    def loss(mm):
        out = mm(x)
        return (out.abs() if dtype.is_complex else out.float()).pow(2).sum()

    g = ts.structural_grad(m, loss)
    assert same(g, ["weight", "bias"], reference(m, loss, ["weight", "bias"]))
    assert all(t.dtype == dtype for t in T.leaves(g))


def test_sparse_embedding_gradient_matches_and_global_norm_refuses_clearly():
    e = nn.Embedding(10, 4, sparse=True)
    tokens = torch.tensor([1, 2, 2, 7])
    loss = lambda mm: mm(tokens).pow(2).sum()
    g = ts.structural_grad(e, loss)["weight"]
    ref = torch.autograd.grad(loss(e), [e.weight])[0]
    assert g.is_sparse and torch.equal(g.to_dense(), ref.to_dense())
    with pytest.raises(TypeError, match="sparse"):
        ts.global_norm({"weight": g})


# --- structural_grad: errors --------------------------------------------------------------

def test_loss_from_another_model_is_an_error_naming_paths_and_changes_nothing():
    m, other = mlp(), mlp()
    with ts.freeze(m, "0"):
        before = flags(m)
        for loss in (sq(other), lambda mm: sq(other)):
            with pytest.raises(ValueError, match=r"reaches none of the asked parameters \('2.weight', '2.bias'\)"):
                ts.structural_grad(m, loss)
        with pytest.raises(ValueError, match=r"reaches none .*'0.weight', '0.bias'"):
            ts.structural_grad(m, lambda mm: sq(other), wrt="0")
        assert flags(m) == before
    assert all(p.grad is None for p in [*m.parameters(), *other.parameters()])


def test_loss_from_detached_copies_is_an_error():
    m = mlp()
    copies = {k: v.detach().clone().requires_grad_() for k, v in m.named_parameters()}
    with pytest.raises(ValueError, match="reaches none"):
        ts.structural_grad(m, lambda mm: torch.func.functional_call(mm, copies, (X,)).sum())


def test_loss_under_no_grad_is_an_error():
    m = mlp()
    with torch.no_grad():
        loss = sq(m)
    for bad in (loss, lambda mm: sq(mm).detach()):
        with pytest.raises(ValueError, match="does not require grad"):
            ts.structural_grad(m, bad)


def test_bad_losses():
    m = mlp()
    with pytest.raises(ValueError, match=r"scalar .*\(5, 1\)"):
        ts.structural_grad(m, m(X))
    with pytest.raises(ValueError, match="scalar"):
        ts.structural_grad(m, lambda mm: mm(X))
    with pytest.raises(TypeError, match="float"):
        ts.structural_grad(m, lambda mm: 1.0)
    with pytest.raises(TypeError, match="nn.Module"):
        ts.structural_grad({"a": X}, sq)
    # a one-element loss of any shape is a scalar, as for torch.autograd.grad
    g = ts.structural_grad(m, sq(m).reshape(1, 1))
    assert same(g, ["0.weight", "0.bias", "2.weight", "2.bias"],
                reference(m, sq, ["0.weight", "0.bias", "2.weight", "2.bias"]))


def test_frozen_parameter_with_a_tensor_loss_names_it_and_changes_nothing():
    m = mlp()
    with ts.freeze(m, "0"):
        loss = sq(m)
        with pytest.raises(ValueError, match="'0.weight' does not require grad"):
            ts.structural_grad(m, loss, wrt="0")
        assert flags(m) == [False, False, True, True]
        g = ts.structural_grad(m, sq, wrt="0")  # the callable form can
        assert flags(m) == [False, False, True, True]
    assert same(g, ["0.weight", "0.bias"], reference(m, sq, ["0.weight", "0.bias"]))


def test_buffers_and_foreign_parameters_are_not_selectable():
    m = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    with pytest.raises(ValueError, match="closest"):
        ts.structural_grad(m, lambda mm: mm(X).sum(), wrt="1.running_mean")
    with pytest.raises(ValueError, match="not a parameter of the model"):
        ts.structural_grad(m, lambda mm: mm(X).sum(), wrt=nn.Parameter(torch.ones(1)))
    with pytest.raises(ValueError, match="empty"):
        ts.structural_grad(m, lambda mm: mm(X).sum(), wrt=[])


# --- activation checkpointing -------------------------------------------------------------

class Ck(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.i, self.mid, self.o = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 1)
        self.reentrant = reentrant

    def forward(self, x):
        h = checkpoint(self.mid, torch.tanh(self.i(x)), use_reentrant=self.reentrant)
        return self.o(h).pow(2).sum()


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("wrt", [None, "o", "i", ["i", "o"], "mid.bias"])
@pytest.mark.parametrize("form", ["tensor", "callable"])
def test_checkpointing_matches_plain_autograd(reentrant, wrt, form):
    if reentrant and form == "callable" and wrt == "mid.bias":
        pytest.skip("a dead reentrant checkpoint: its own test")
    torch.manual_seed(0)
    m = Ck(reentrant)
    plain = copy.deepcopy(m)
    plain.reentrant = None
    plain.forward = lambda x: plain.o(plain.mid(torch.tanh(plain.i(x)))).pow(2).sum()
    x = torch.randn(5, 3, requires_grad=True)
    names = [n for n, _ in ts.select(m, wrt or "*")]
    ref = reference(plain, lambda mm: mm(x), names)
    for p in m.parameters():
        p.grad = torch.full_like(p, 3.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = ts.structural_grad(m, m(x) if form == "tensor" else (lambda mm: mm(x)), wrt=wrt)
    assert same(g, names, ref)
    assert all(bool((p.grad == 3).all()) for p in m.parameters()) and x.grad is None
    assert flags(m) == [True] * 6 and x.requires_grad


def test_dead_reentrant_checkpoint_is_an_error_naming_the_parameter():
    m = Ck(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="'mid.weight' is used inside a reentrant"):
            ts.structural_grad(m, lambda mm: mm(X), wrt="mid")
        with pytest.raises(RuntimeError, match="use_reentrant=False"):
            ts.structural_grad(m, lambda mm: mm(X), create_graph=True)
    assert flags(m) == [True] * 6 and all(p.grad is None for p in m.parameters())


def test_parametrized_weights_and_tensor_hooks_match_backward():
    from torch.nn.utils.parametrizations import weight_norm

    m = nn.Sequential(weight_norm(nn.Linear(3, 4)), nn.Tanh(), nn.Linear(4, 1))
    m[2].weight.register_hook(lambda g: g * 2)  # run by autograd.grad as by backward
    g = flat(ts.structural_grad(m, sq))
    assert list(g) == ["0.bias", "0.parametrizations.weight.original0",
                       "0.parametrizations.weight.original1", "2.weight", "2.bias"]
    sq(m).backward()
    assert all(torch.equal(g[n], p.grad) for n, p in m.named_parameters())


def test_callable_under_no_grad_or_inference_mode_is_a_clear_error():
    m = mlp()
    loss = sq(m)
    with torch.no_grad():
        ts.structural_grad(m, loss)  # a graph recorded before: fine, as torch.autograd.grad
        with pytest.raises(ValueError, match="no_grad"):
            ts.structural_grad(m, sq)
    with torch.inference_mode(), pytest.raises(ValueError, match="does not require grad"):
        ts.structural_grad(m, sq)


# --- wrapped models -----------------------------------------------------------------------

class Wrapper(nn.Module):
    """What DataParallel-like wrappers look like: the model under ``module``."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args):
        return self.module(*args)


def test_wrapped_models_prefix_paths_and_match_plain_autograd():
    from torch.optim.swa_utils import AveragedModel

    m = Tied()
    names = ["a.weight", "a.bias", "b.bias", "head.weight", "head.bias"]
    ref = reference(m, sq, names)
    compiled = torch.compile(m, backend="eager")
    cases = [(compiled, "_orig_mod."), (Wrapper(m), "module."), (AveragedModel(m), "module.")]
    for wrapped, prefix in cases:
        g = ts.structural_grad(wrapped, lambda w: w(X).pow(2).sum())
        if isinstance(wrapped, AveragedModel):  # its own deep copy of m
            ref_w = reference(wrapped.module, sq, names)
        else:
            ref_w = ref
        assert same(g, [prefix + n for n in names], ref_w)
        g = ts.structural_grad(wrapped, lambda w: w(X).pow(2).sum(), wrt=prefix + "head")
        assert list(flat(g)) == [prefix + "head.weight", prefix + "head.bias"]
    with pytest.raises(ValueError, match="_orig_mod.head"):  # closest paths named
        ts.structural_grad(compiled, lambda w: w(X).sum(), wrt="head")
    # the inner model, with a loss computed through its wrapper
    assert same(ts.structural_grad(m, Wrapper(m)(X).pow(2).sum()), names, ref)


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


def tiny_gpt2(hf):
    torch.manual_seed(0)
    cfg = hf.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=50, n_positions=16,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return hf.GPT2LMHeadModel(cfg)


IDS = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))


def lm_loss(m):
    return m(input_ids=IDS, labels=IDS).loss


def test_hf_gpt2_tied_head_and_reentrant_gradient_checkpointing_match_backward(hf):
    m = tiny_gpt2(hf)
    g = flat(ts.structural_grad(m, lm_loss))
    assert "lm_head.weight" not in g and len(g) == len(list(m.parameters()))
    lm_loss(m).backward()
    assert all(torch.equal(g[n], p.grad) for n, p in m.named_parameters())
    assert list(flat(ts.structural_grad(m, lm_loss, wrt="lm_head"))) == ["transformer.wte.weight"]
    for reentrant in (True, False):
        m.zero_grad(set_to_none=True)
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        m.train()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            g = flat(ts.structural_grad(m, lm_loss))
            h1 = flat(ts.structural_grad(m, lm_loss, wrt="transformer.h.1"))
            assert all(p.grad is None for p in m.parameters())
            lm_loss(m).backward()
        assert all(torch.equal(g[n], p.grad) for n, p in m.named_parameters())
        assert len(h1) == 12 and all(torch.equal(h1[n], p.grad) for n, p in m.named_parameters()
                                     if n in h1)
        m.gradient_checkpointing_disable()


def test_hf_bert_classifier_matches_backward(hf):
    torch.manual_seed(0)
    cfg = hf.BertConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                        intermediate_size=32, vocab_size=50, max_position_embeddings=16)
    m = hf.BertForSequenceClassification(cfg).eval()
    loss = lambda mm: mm(input_ids=IDS, labels=torch.tensor([0, 1])).loss
    g = flat(ts.structural_grad(m, loss, wrt="classifier"))
    assert same(g, ["classifier.weight", "classifier.bias"],
                reference(m, loss, ["classifier.weight", "classifier.bias"]))


def test_peft_lora_gives_only_adapter_gradients_equal_to_backward(hf):
    peft = pytest.importorskip("peft")
    m = peft.get_peft_model(tiny_gpt2(hf), peft.LoraConfig(
        r=2, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0))
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.normal_()
    before = flags(m)
    g = flat(ts.structural_grad(m, lm_loss))
    assert len(g) == 4 and all("lora_" in n for n in g) and flags(m) == before
    lm_loss(m).backward()
    assert all(torch.equal(g[n], p.grad) for n, p in m.named_parameters() if p.requires_grad)
