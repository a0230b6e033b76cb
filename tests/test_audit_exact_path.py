"""Audit of structural_grad's exact path through reentrant activation checkpointing.

The promise (docs/structural.md, "Activation checkpointing"): the asked gradients are those
``.backward()`` gives on a deep copy; no ``.grad`` field, ``requires_grad`` flag, checkpoint
``run_function`` or optimizer state changes; no hook runs that ``torch.autograd.grad`` would not
run; a case that cannot be done exactly is a clear error, never a silently wrong number.

Passing tests pin down behaviour verified here. Tests marked ``xfail(strict=True)`` with a
reason starting "BUG:" are defects found by this audit.
"""
import copy
import functools
import os
import threading
import warnings

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from _reentrant import (IDS, QUIET, S, ck, ddp_grads, hf_loss, leaf, tiny_gpt2,
                        tiny_llama)

import torchstruct as ts
import torchstruct.grad as tsgrad
from torchstruct.select import index

os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytestmark = QUIET


def stale(model):
    """Give every trainable parameter a sentinel .grad; returns {param: that grad object}."""
    out = {}
    for p in model.parameters():
        if p.requires_grad and not p.is_sparse:
            p.grad = torch.full_like(p, S)
            out[p] = p.grad
    return out


def assert_untouched(model, grads, outside=(), flags=None):
    """Every sentinel .grad is still the same object with the same value; outside tensors
    still require grad with their sentinel; the model's flags are ``flags``."""
    for p, g in grads.items():
        assert p.grad is g and bool((g == S).all())
    for t in outside:
        assert t.requires_grad
        assert t.grad is not None and bool((t.grad == S).all()), t.grad
    if flags is not None:
        assert [p.requires_grad for p in model.parameters()] == flags


def reference(model, loss_fn, outside=(), seed=None):
    """{canonical path: .grad} by plain .backward() on deep copies of the model and of the
    tensors outside it (hooks of torchstruct detached on the copy)."""
    memo = {id(t): t.detach().clone().requires_grad_(t.requires_grad) for t in outside}
    ref = copy.deepcopy(model, memo)
    ts.detach_hooks(ref)
    for p in ref.parameters():
        p.grad = None
    if seed is not None:
        torch.manual_seed(seed)
    loss_fn(ref).backward()
    return {path: p.grad for path, p in index(ref)}


def assert_same(got_tree, ref, exact=True):
    got = ts.tree.to_flat_dict(got_tree)
    assert got, "empty tree"
    for k, g in got.items():
        want = ref[k] if ref[k] is not None else torch.zeros_like(g)
        if g.is_sparse:
            g, want = g.to_dense(), want.to_dense()
        if exact:
            assert torch.equal(g, want), k
        else:
            torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6, msg=k)


@pytest.fixture
def spy(monkeypatch):
    """Counts the exact-path calls (so a test knows the reentrant path was taken)."""
    calls = []
    real = tsgrad._grads_by_backward

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(tsgrad, "_grads_by_backward", counted)
    return calls


# ============================================================================ small models
class Outside(nn.Module):
    """A model whose reentrant checkpoints reach tensors outside it in several ways."""

    def __init__(self, kind, e=None, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.a, self.b, self.out = (nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4),
                                              nn.Linear(4, 1))
        self.seq = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(),
                                 nn.Linear(4, 4))
        if kind == "tied":
            self.b.weight = self.a.weight
        self.kind, self.e = kind, [e]
        self.to(dtype)

    def forward(self, x):
        e, k = self.e[0], self.kind
        h = torch.tanh(self.inp(x))
        if k in ("same_closure_in_two", "tied"):
            z = ck(lambda u: self.a(u) * e, h)
            z = ck(lambda u: self.b(u) * e, z)
        elif k == "inside_and_outside":
            z = ck(lambda u: self.a(u) * e, h) * e + e.sum()
        elif k == "tuple_with_non_tensors":
            def f(u):
                return self.a(u), 3, None, u.detach() * 2, self.b(u) * e
            r = ck(f, h)
            z = r[0] + r[4] + r[3]
        elif k == "checkpoint_sequential":
            z = checkpoint_sequential(self.seq, 3, h, use_reentrant=True) * e
        elif k == "non_leaf_closure":
            w = e * 2
            z = ck(lambda u: self.a(u) * w, h)
        elif k == "parameter_expression_closure":
            w = self.b.weight * 2
            z = ck(lambda u: u @ w, h)
        elif k == "partial_keyword":
            z = ck(functools.partial(lambda u, scale: self.a(u) * scale, scale=e), h)
        elif k == "three_deep":
            z = ck(lambda u: ck(lambda v: ck(lambda q: self.a(q) * e, v) + self.b(v), u), h)
        elif k == "nested_fed_once":
            z = ck(lambda u: ck(lambda v, w: self.a(v) * w, u, e), h)
        else:
            raise AssertionError(k)
        return self.out(torch.tanh(z)).sum()


KINDS = ["same_closure_in_two", "tied", "inside_and_outside", "tuple_with_non_tensors",
         "checkpoint_sequential", "non_leaf_closure", "parameter_expression_closure",
         "partial_keyword", "three_deep", "nested_fed_once"]


@pytest.mark.parametrize("form", ["callable", "tensor"])
@pytest.mark.parametrize("wrt", [None, ["inp", "a", "out"]])
@pytest.mark.parametrize("kind", KINDS)
def test_small_models_match_backward_and_touch_nothing(kind, wrt, form, spy):
    e = leaf(4)
    m = Outside(kind, e)
    x = torch.randn(3, 4)
    ref = reference(m, lambda mm: mm(x), [e])
    grads = stale(m)
    flags = [p.requires_grad for p in m.parameters()]
    if form == "callable":
        got = ts.structural_grad(m, lambda mm: mm(x), wrt=wrt)
    else:
        loss = m(x)
        nodes, cks = tsgrad._walk(loss)
        functions = [(n, n.run_function) for n in cks]
        got = ts.structural_grad(m, loss, wrt=wrt)
        assert all(n.run_function is f for n, f in functions)
    assert spy, "the exact path was expected"
    assert_same(got, ref)
    assert_untouched(m, grads, [e], flags)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("kind", ["same_closure_in_two", "checkpoint_sequential"])
def test_other_dtypes_match_backward(kind, dtype):
    e = leaf(4, dtype=dtype)
    m = Outside(kind, e, dtype)
    x = torch.randn(3, 4, dtype=dtype)
    ref = reference(m, lambda mm: mm(x), [e])
    grads = stale(m)
    got = ts.structural_grad(m, lambda mm: mm(x), wrt=None if kind != "checkpoint_sequential"
                             else ["seq", "inp"])
    assert all(g.dtype == dtype for g in ts.tree.leaves(got))
    assert_same(got, ref)
    assert_untouched(m, grads, [e])


# ============================================================================ HF transformers
def hf_model(kind, lora):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100,
                                      n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0)
        model, targets = transformers.GPT2LMHeadModel(cfg), ["c_attn"]
    elif kind == "llama":
        model, targets = tiny_llama(), ["q_proj", "v_proj"]
    else:
        cfg = transformers.BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, vocab_size=100,
                                      max_position_embeddings=32, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0)
        model, targets = transformers.BertForMaskedLM(cfg), ["query", "value"]
    if lora:
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=2, target_modules=targets, init_lora_weights=False, fan_in_fan_out=kind == "gpt2"))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.enable_input_require_grads()
    model.train()
    return model




@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_hf_reentrant_checkpointing_matches_backward(kind, lora, spy):
    model = hf_model(kind, lora)
    ref = reference(model, hf_loss)
    grads = stale(model)
    flags = [p.requires_grad for p in model.parameters()]
    got = ts.structural_grad(model, hf_loss)
    assert spy
    if lora:
        assert all("lora_" in k for k in ts.tree.paths(got))
    assert_same(got, ref)
    assert_untouched(model, grads, flags=flags)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hf_reentrant_with_wrt_matches_backward_of_only_those(kind):
    """With wrt, the forward runs with only those parameters requiring grad; the numbers are
    those of .backward() with the same flags (accumulation order may differ otherwise)."""
    model = hf_model(kind, lora=False)
    wrt = [n for n, _ in model.named_parameters() if ".1." in n][:3]
    chosen = set(wrt)
    ref_model = copy.deepcopy(model)
    ts.detach_hooks(ref_model)
    for n, p in ref_model.named_parameters():
        p.requires_grad_(n in chosen)
    hf_loss(ref_model).backward()
    ref = {n: p.grad for n, p in index(ref_model)}
    grads = stale(model)
    flags = [p.requires_grad for p in model.parameters()]
    got = ts.structural_grad(model, hf_loss, wrt=wrt)
    assert sorted(ts.tree.paths(got)) == sorted(wrt)
    assert_same(got, ref)
    assert_untouched(model, grads, flags=flags)


def test_hf_gpt2_with_dropout_is_bitwise_backward_under_the_same_seed():
    model = tiny_gpt2(0.2)
    ref = reference(model, hf_loss, seed=11)
    torch.manual_seed(11)
    got = ts.structural_grad(model, hf_loss)
    assert_same(got, ref)


def test_hf_t5_encoder_states_reach_the_decoder_checkpoints_through_keywords():
    """The decoder layers' checkpoints get encoder_hidden_states by keyword (a closure): their
    recomputation's inner backward runs into the encoder's graph."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                num_decoder_layers=2, num_heads=4, dropout_rate=0.0,
                                decoder_start_token_id=0)
    model = transformers.T5ForConditionalGeneration(cfg)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    labels = torch.randint(1, 100, (2, 6), generator=torch.Generator().manual_seed(3))
    loss_fn = lambda m: m(input_ids=IDS, labels=labels).loss  # noqa: E731
    ref = reference(model, loss_fn)
    grads = stale(model)
    got = ts.structural_grad(model, loss_fn)
    assert_same(got, ref)
    assert_untouched(model, grads)


# ============================================================================ errors restore
class TwoCheckpoints(nn.Module):
    """``a`` checkpointed with closure ``e2`` (recomputed last), then ``b`` with ``e1``."""

    def __init__(self, e1, e2, raise_on=None):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.a, self.b, self.out = (nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4),
                                              nn.Linear(4, 1))
        self.e, self.calls, self.raise_on = [e1, e2], 0, raise_on

    def fa(self, u):
        self.calls += 1
        if self.raise_on == self.calls:
            raise KeyError("boom in the recomputation")
        return self.a(u) * self.e[1]

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        z = ck(self.fa, h)
        z = ck(lambda u: self.b(u) * self.e[0], z)
        return self.out(z).sum()


@pytest.mark.parametrize("kind", ["tensor", "post-accumulate", "node", "node-pre"])
def test_refusal_during_recomputation_puts_everything_back(kind):
    e1, e2 = leaf(4), leaf(4)
    m = TwoCheckpoints(e1, e2)
    calls, keep = [], []
    if kind == "tensor":
        e2.register_hook(lambda g: calls.append(kind))
    elif kind == "post-accumulate":
        e2.register_post_accumulate_grad_hook(lambda t: calls.append(kind))
    else:
        acc = e2.view_as(e2).grad_fn.next_functions[0][0]
        keep.append(acc)
        (acc.register_hook if kind == "node" else acc.register_prehook)(
            lambda *a: calls.append(kind))
    x = torch.randn(3, 4)
    loss = m(x)
    nodes, cks = tsgrad._walk(loss)
    functions = [(n, n.run_function) for n in cks]
    grads = stale(m)
    flags = [p.requires_grad for p in m.parameters()]
    with pytest.raises(RuntimeError, match="outside the model has a"):
        ts.structural_grad(m, loss, wrt=["a", "out"], retain_graph=True)
    assert calls == []
    assert all(n.run_function is f for n, f in functions)
    assert_untouched(m, grads, [e1, e2], flags)
    # the retained graph then backpropagates as plain PyTorch does, hook included
    for t in (e1, e2, *m.parameters()):
        t.grad = None
    loss.backward()
    assert calls and e1.grad is not None and e2.grad is not None


def test_exception_in_the_recomputed_function_puts_everything_back():
    e1, e2 = leaf(4), leaf(4)
    m = TwoCheckpoints(e1, e2, raise_on=2)  # the forward is call 1, the recomputation call 2
    loss = m(torch.randn(3, 4))
    nodes, cks = tsgrad._walk(loss)
    functions = [(n, n.run_function) for n in cks]
    grads = stale(m)
    flags = [p.requires_grad for p in m.parameters()]
    with pytest.raises(KeyError, match="boom"):
        ts.structural_grad(m, loss, wrt=["inp", "a", "out"])
    assert all(n.run_function is f for n, f in functions)
    assert_untouched(m, grads, [e1, e2], flags)


def test_retain_graph_two_calls_then_backward_equal_plain_pytorch():
    e1, e2 = leaf(4), leaf(4)
    m = TwoCheckpoints(e1, e2)
    x = torch.randn(3, 4)
    ref = reference(m, lambda mm: mm(x), [e1, e2])
    loss = m(x)
    g1 = ts.tree.to_flat_dict(ts.structural_grad(m, loss, wrt="a", retain_graph=True))
    g2 = ts.tree.to_flat_dict(ts.structural_grad(m, loss, wrt=["inp", "out"], retain_graph=True))
    for k, g in {**g1, **g2}.items():
        assert torch.equal(g, ref[k]), k
    assert all(p.grad is None and p.requires_grad for p in m.parameters())
    e1.grad = e2.grad = None
    loss.backward()
    for k, p in index(m):
        assert torch.equal(p.grad, ref[k]), k
    assert e1.grad is not None and e2.grad is not None


def test_under_no_grad_and_with_an_inference_mode_constant():
    torch.manual_seed(0)
    m = nn.ModuleDict(dict(inp=nn.Linear(4, 4), a=nn.Linear(4, 4), out=nn.Linear(4, 1)))
    with torch.inference_mode():
        c = torch.randn(4)
    x = torch.randn(3, 4)
    loss_fn = lambda mm: mm["out"](ck(lambda u: mm["a"](u) + c,  # noqa: E731
                                      torch.tanh(mm["inp"](x)))).sum()
    ref = reference(m, loss_fn)
    loss = loss_fn(m)
    with torch.no_grad():
        got = ts.structural_grad(m, loss)
    assert_same(got, ref)
    assert all(p.grad is None for p in m.parameters())


def test_sparse_embedding_gradient_on_the_exact_path():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb, self.a, self.out = nn.Embedding(10, 4, sparse=True), nn.Linear(4, 4), \
                nn.Linear(4, 1)

        def forward(self, ids):
            return self.out(ck(self.a, self.emb(ids))).sum()

    ids = torch.randint(0, 10, (3, 5))
    m = M()
    ref = reference(m, lambda mm: mm(ids))
    got = ts.structural_grad(m, lambda mm: mm(ids))
    assert got["emb"]["weight"].is_sparse
    assert_same(got, ref)
    assert all(p.grad is None for p in m.parameters())


def test_optimizer_state_and_grads_untouched():
    e1, e2 = leaf(4), leaf(4)
    m = TwoCheckpoints(e1, e2)
    x = torch.randn(3, 4)
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1), ts.optim.AdamW(m.parameters(), lr=0.1)]
    m(x).backward()
    for o in opts:
        o.step()
    before = [copy.deepcopy(o.state_dict()) for o in opts]
    grads = stale(m)
    ts.structural_grad(m, lambda mm: mm(x))
    ts.structural_grad(m, lambda mm: mm(x), wrt=["inp", "a"])
    assert_untouched(m, grads)
    for o, b in zip(opts, before):
        s = o.state_dict()
        for i, st in b["state"].items():
            for k, v in st.items():
                assert torch.equal(torch.as_tensor(s["state"][i][k]), torch.as_tensor(v))


def test_two_threads_on_two_models_concurrently():
    class M(nn.Module):
        def __init__(self, e, seed):
            super().__init__()
            torch.manual_seed(seed)
            self.inp, self.a, self.b, self.out = (nn.Linear(8, 8), nn.Linear(8, 8),
                                                  nn.Linear(8, 8), nn.Linear(8, 1))
            self.e = [e]

        def forward(self, x):
            e = self.e[0]
            z = ck(lambda u: self.a(u) * e, torch.tanh(self.inp(x)))
            z = ck(self.b, z)
            return self.out(torch.tanh(z)).sum()

    errors, barrier = [], threading.Barrier(2)

    def work(seed, wrt):
        e = leaf(8)
        m, x = M(e, seed), torch.randn(16, 8)
        ref = reference(m, lambda mm: mm(x), [e])
        barrier.wait()
        for i in range(15):
            try:
                got = ts.tree.to_flat_dict(ts.structural_grad(m, lambda mm: mm(x), wrt=wrt))
                if any(not torch.equal(g, ref[k]) for k, g in got.items()):
                    errors.append((seed, i, "value"))
                if not (e.requires_grad and bool((e.grad == S).all())):
                    errors.append((seed, i, "closure"))
                if any(p.grad is not None or not p.requires_grad for p in m.parameters()):
                    errors.append((seed, i, "params"))
            except Exception as err:  # noqa: BLE001
                errors.append((seed, i, repr(err)))

    threads = [threading.Thread(target=work, args=(1, None)),
               threading.Thread(target=work, args=(2, ["inp", "a", "out"]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


@pytest.mark.parametrize("form", ["callable", "tensor_in_no_sync"])
def test_ddp_with_reentrant_checkpoint_and_closure(group, form):
    e1, e2 = leaf(4), leaf(4)
    m = TwoCheckpoints(e1, e2)
    x = torch.randn(3, 4)
    ref = reference(m, lambda mm: mm(x), [e1, e2])
    ddp = DDP(m)
    grads = stale(m)
    wrt = ["module.inp", "module.a", "module.out"]
    got = ddp_grads(ddp, x, form, wrt)
    assert sorted(got) == sorted(k for k in ("module." + p for p, _ in index(m))
                                 if k.split(".")[1] in ("inp", "a", "out"))
    for k, g in got.items():
        assert torch.equal(g, ref[k[len("module."):]]), k
    assert_untouched(m, grads, [e1, e2])
    # a plain DDP step afterwards is plain PyTorch
    for t in (e1, e2, *m.parameters()):
        t.grad = None
    ddp(x).backward()
    for k, p in index(m):
        assert torch.equal(p.grad, ref[k]), k


# ============================================================================ BUGS
def test_an_input_fed_to_outer_and_nested_checkpoint_keeps_its_grad():
    torch.manual_seed(0)
    m = nn.ModuleDict(dict(a=nn.Linear(4, 4), out=nn.Linear(4, 1)))
    x = leaf(3, 4)
    inner = lambda u: ck(lambda v, w: m["a"](v) * w, u, x)  # noqa: E731
    ts.structural_grad(m, lambda mm: mm["out"](ck(inner, x)).sum())
    assert x.grad is not None and bool((x.grad == S).all())


def test_a_closure_fed_to_nested_checkpoints_in_two_outer_ones_keeps_its_grad():
    torch.manual_seed(0)
    m = nn.ModuleDict(dict(a=nn.Linear(4, 4), b=nn.Linear(4, 4), out=nn.Linear(4, 1)))
    e = leaf(4)
    x = torch.randn(3, 4, requires_grad=True)

    def loss(mm):
        z = ck(lambda u: ck(lambda v, w: mm["a"](v) * w, u, e), x)
        z = ck(lambda u: ck(lambda v, w: mm["b"](v) * w, u, e), z)
        return mm["out"](z).sum()

    ts.structural_grad(m, loss)
    assert e.requires_grad and bool((e.grad == S).all()), e.grad


def test_switched_off_leaf_fed_to_a_nested_checkpoint_is_revived():
    torch.manual_seed(0)
    m = nn.ModuleDict(dict(inp=nn.Linear(4, 4), a=nn.Linear(4, 4), out=nn.Linear(4, 1)))
    e = leaf(4)
    x = torch.randn(3, 4)

    def loss(mm):
        h = torch.tanh(mm["inp"](x))
        z = ck(lambda u: u + ck(mm["a"], e), h) * e
        return mm["out"](z).sum()

    ref = reference(m, loss, [e])
    assert ref["a.weight"].abs().sum() > 0
    got = ts.structural_grad(m, loss)
    assert torch.equal(got["a"]["weight"], ref["a.weight"])


def test_tensor_loss_not_asked_parameter_feeding_a_nested_checkpoint_is_revived():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.w = nn.Parameter(torch.randn(4))
            self.inp, self.a, self.out = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)

        def forward(self, x):
            h = torch.tanh(self.inp(x))
            return self.out(ck(lambda u: u + ck(self.a, self.w), h)).sum()

    m, x = M(), torch.randn(3, 4)
    ref = reference(m, lambda mm: mm(x))
    got = ts.structural_grad(m, m(x), wrt=["a", "out"])
    assert torch.equal(got["a"]["bias"], ref["a.bias"])


def test_nested_checkpoint_recording_nothing_is_refused():
    class M(nn.Module):
        def __init__(self, nested):
            super().__init__()
            torch.manual_seed(0)
            self.inp, self.a, self.out = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)
            self.nested = nested

        def forward(self, x):
            h, c = torch.tanh(self.inp(x)), torch.ones(3, 4)
            z = ck(lambda u: u + ck(self.a, c), h) if self.nested else h + ck(self.a, c)
            return self.out(z).sum()

    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="none of whose inputs requires grad"):
        ts.structural_grad(M(nested=False), lambda mm: mm(x))  # top level: refused (works)
    with pytest.raises(ValueError, match="none of whose inputs requires grad"):
        ts.structural_grad(M(nested=True), lambda mm: mm(x))


def test_retain_grad_of_a_non_leaf_off_the_asked_paths_is_refused():
    """h.retain_grad() on a branch leading to no asked parameter: autograd.grad leaves h.grad
    None, the exact path's real backward would write it: refused, h.grad still None; on the
    asked path it is written, as autograd.grad writes it."""
    torch.manual_seed(0)
    m = nn.ModuleDict(dict(inp=nn.Linear(4, 4), a=nn.Linear(4, 4), out=nn.Linear(4, 1)))
    x = torch.randn(3, 4)
    grads, flags = stale(m), [p.requires_grad for p in m.parameters()]
    # without a checkpoint (autograd.grad) h.grad stays None
    h = torch.tanh(m["inp"](x))
    h.retain_grad()
    ts.structural_grad(m, m["out"](m["a"](h)).sum(), wrt="out")
    assert h.grad is None
    h = torch.tanh(m["inp"](x))
    h.retain_grad()
    with pytest.raises(RuntimeError, match=r"TanhBackward0 has retain_grad\(\)"):
        ts.structural_grad(m, m["out"](ck(m["a"], h)).sum(), wrt="out")
    assert h.grad is None
    assert_untouched(m, grads, flags=flags)
    h = torch.tanh(m["inp"](x))
    h.retain_grad()
    ts.structural_grad(m, m["out"](ck(m["a"], h)).sum(), wrt=["inp", "out"])
    assert h.grad is not None