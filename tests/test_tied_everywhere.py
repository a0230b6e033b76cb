"""Tied (shared) parameters against every public name of torchstruct, as a suspicious user tries them.

The contract (DESIGN.md, "Words"): a *tied parameter* is one ``nn.Parameter`` object reachable by
several paths. It lives once, at its first path in ``named_parameters()`` order (its other paths
are absent from trees), its gradient is the total over all uses, it is counted once in every
norm, updated once per step and stored once. The docs add: it is selected when *any* of its paths
is selected (selecting.md), a declaration admits it when *one* of its paths is admitted
(freezing.md), a rule selecting any path takes it and it gets the layer id of its first path
(groups.md), ``ts.swap`` keys are canonical (first) paths (stop_gradient.md), and
``ts.load_state_dict`` accepts any of its paths, both when they agree (checkpoint.md).

Tying patterns: an embedding tied to an output head (a hand-written LM, GPT-2 and T5 built from
tiny configs with HF transformers, no download), one ``nn.Linear`` registered under two names, a
shared submodule reachable by two nested paths, one weight tied across blocks of an
``nn.ModuleList``, a tie made after ``ts.attach`` / a declaration / inside a context, and PEFT
LoRA on a tied GPT-2.

What is checked, always against plain PyTorch or a brute force written here:

* ``ts.select`` by every module path and every parameter path (also the second ones), by
  object, regex and callable; ``is_trainable`` / ``trainable_parameters`` / ``mark_trainable``
  (an exhaustive brute force of the "one admitting path is enough" rule), ``attach`` and flags;
* ``freeze`` / ``freeze_except`` / ``unfreeze`` naming only the second path: flags inside, and
  restored exactly after (also a starting flag set by hand, and nested contexts);
* ``structural_grad`` / ``value_and_grad`` / ``grad_tree`` with ``wrt`` naming either path: the
  total gradient, reported at the first path, against ``torch.autograd.grad`` and an untied copy;
* ``global_norm`` / ``clip_by_global_norm`` against ``torch.nn.utils.clip_grad_norm_`` on the
  deduplicated list (and on a list with a duplicate, taken as given);
* ``param_groups`` / ``layer_decay`` / ``lr_scale``; ``ts.optim.SGD`` / ``AdamW`` with masks on a
  tied parameter against ``torch.optim`` (``foreach=False``);
* ``ts.state_dict`` / ``ts.load_state_dict``, ``torch.save`` round trips, ``deepcopy``,
  ``AveragedModel``; ``summary``; ``map_trainable`` / ``polyak_update``; ``UnfreezeSchedule``;
  ``stop_gradient`` / ``constant`` / ``swap`` naming the second path;
* bad input on tied models: a clear error, and flags, values and optimizer state unchanged.

Convention: a test that exposes a defect is kept, minimized, and marked
``@pytest.mark.xfail(strict=True, reason="BUG: what happens; what is expected")``. Behaviour the
docs explicitly state as a limit is not a defect: the documented behaviour is asserted instead.
"""
from __future__ import annotations

import copy
import io
import itertools
import random
import re
import warnings

import pytest
import torch
from torch import nn

import torchstruct as ts


# ----------------------------------------------------------------------------- models

class TiedLM(nn.Module):
    """An embedding tied to the output projection (head has its own bias)."""

    def __init__(self, vocab=11, d=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mid = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.mid(self.emb(tokens))))


class UntiedLM(TiedLM):
    """The same LM with the head owning a copy: tie it later."""

    def __init__(self):
        super().__init__()
        self.head.weight = nn.Parameter(self.emb.weight.detach().clone())


class TwoNames(nn.Module):
    """One nn.Linear registered under two attribute names, used twice."""

    def __init__(self):
        super().__init__()
        lin = nn.Linear(4, 4)
        self.a = lin
        self.out = nn.Linear(4, 1)
        self.b = lin  # registered after `out`: the second path comes later

    def forward(self, x):
        return self.out(torch.tanh(self.b(torch.tanh(self.a(x)))))


class SharedSub(nn.Module):
    """A submodule reachable by two nested paths (encoder.proj and decoder.proj)."""

    def __init__(self):
        super().__init__()
        proj = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.encoder = nn.ModuleDict({"proj": proj, "norm": nn.LayerNorm(4)})
        self.decoder = nn.ModuleDict({"proj": proj, "out": nn.Linear(4, 1)})

    def forward(self, x):
        h = self.encoder["norm"](self.encoder["proj"](x))
        return self.decoder["out"](self.decoder["proj"](h))


class Stack(nn.Module):
    """One weight tied across blocks of a ModuleList (block 2 reuses block 0's weight)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.blocks[2].weight = self.blocks[0].weight
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        h = self.inp(x)
        for blk in self.blocks:
            h = torch.tanh(blk(h))
        return self.head(h)


TOKENS = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 1]])
X = torch.linspace(-1, 1, 12).reshape(3, 4)


def lm_loss(m):
    return nn.functional.cross_entropy(m(TOKENS).flatten(0, 1), TOKENS.flatten())


def vec_loss(m):
    return m(X).square().sum()


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight
    return model


def gpt2_loss(m):
    ids = torch.tensor([[1, 5, 9, 3, 7], [2, 4, 6, 8, 10]])
    return m(input_ids=ids, labels=ids).loss


def t5():
    from transformers import T5Config, T5ForConditionalGeneration
    cfg = T5Config(vocab_size=40, d_model=16, d_kv=4, d_ff=32, num_layers=1,
                   num_decoder_layers=1, num_heads=2, dropout_rate=0.0,
                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    model = T5ForConditionalGeneration(cfg)
    assert model.lm_head.weight is model.shared.weight is model.decoder.embed_tokens.weight
    return model


def t5_loss(m):
    ids = torch.tensor([[3, 5, 9, 1], [2, 4, 6, 1]])
    return m(input_ids=ids, labels=ids.flip(-1)).loss


CASES = {
    "tied_lm": (TiedLM, lm_loss),
    "two_names": (TwoNames, vec_loss),
    "shared_sub": (SharedSub, vec_loss),
    "modulelist": (Stack, vec_loss),
    "gpt2": (gpt2, gpt2_loss),
    "t5": (t5, t5_loss),
}
SMALL = ["tied_lm", "two_names", "shared_sub", "modulelist"]


def make(name, seed=0):
    torch.manual_seed(seed)
    factory, loss = CASES[name]
    return factory(), loss


# ----------------------------------------------------------------------------- brute force

def paths_of(model):
    """id(param) -> every path of it, in named_parameters(remove_duplicate=False) order."""
    out = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(n)
    return out


def first_path(model):
    return {id(p): n for n, p in model.named_parameters()}


def aliases(model):
    """second path -> first path, for every tied parameter."""
    return {n: ps[0] for ps in paths_of(model).values() for n in ps[1:]}


def unique_params(model):
    return [p for _, p in model.named_parameters()]


def brute_select(model, name):
    """First paths of the params having any path equal to `name` or below the module `name`."""
    fp = first_path(model)
    out = []
    for n, p in model.named_parameters():
        if any(q == name or q.startswith(name + ".") for q in paths_of(model)[id(p)]):
            out.append(fp[id(p)])
    return out


def flags(model):
    return [(n, p.requires_grad) for n, p in model.named_parameters(remove_duplicate=False)]


def values(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def same_values(model, before):
    return all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def second_module(model):
    """A module path that holds a tied parameter under a later (second) path."""
    second = next(iter(aliases(model)))
    return second.rsplit(".", 1)[0]


def ag_grads(model, loss):
    """Plain torch.autograd over the unique parameters of a plain copy: {first path: grad}."""
    ref = copy.deepcopy(model)
    ts.detach_hooks(ref)
    for p in ref.parameters():
        p.requires_grad_(True)
    params = unique_params(ref)
    gs = torch.autograd.grad(loss(ref), params, allow_unused=True)
    return {n: (torch.zeros_like(p) if g is None else g)
            for (n, p), g in zip(ref.named_parameters(), gs)}


def _copy_grads(src, dst):
    for p, q in zip(src.parameters(), dst.parameters()):
        q.grad = None if p.grad is None else p.grad.clone()


def close(a, b, **kw):
    torch.testing.assert_close(a, b, rtol=kw.get("rtol", 1e-5), atol=kw.get("atol", 1e-6))


# ----------------------------------------------------------------------------- sanity of the patterns

@pytest.mark.parametrize("name", CASES)
def test_every_pattern_really_ties(name):
    m, _ = make(name)
    al = aliases(m)
    assert al, "the pattern must produce at least one tied parameter"
    names = [n for n, _ in m.named_parameters()]
    assert not set(al) & set(names) and set(al.values()) <= set(names)


# ----------------------------------------------------------------------------- ts.select

@pytest.mark.parametrize("name", CASES)
def test_select_every_module_and_parameter_path_matches_brute_force(name):
    m, _ = make(name)
    fp = first_path(m)
    mod_paths = [n for n, _ in m.named_modules(remove_duplicate=False) if n]
    par_paths = [n for n, _ in m.named_parameters(remove_duplicate=False)]
    for path in sorted(set(mod_paths + par_paths)):
        expected = brute_select(m, path)
        if not expected:
            continue  # a module without parameters: an error by the docs, checked elsewhere
        got = ts.select(m, path)
        assert [n for n, _ in got] == expected, path
        assert all(fp[id(p)] == n for n, p in got), path


@pytest.mark.parametrize("name", CASES)
def test_select_second_path_by_object_regex_and_callable(name):
    m, _ = make(name)
    for second, first in aliases(m).items():
        p = m.get_parameter(second)
        assert p is m.get_parameter(first)
        want = [first]
        assert [n for n, _ in ts.select(m, p)] == want
        assert [n for n, _ in ts.select(m, re.compile(re.escape(second)))] == want
        assert [n for n, _ in ts.select(m, lambda path, q, s=second: path == s)] == want
        assert [n for n, _ in ts.select(m, [second, first])] == want  # union: once
        mod = m.get_submodule(second.rsplit(".", 1)[0])
        assert first in [n for n, _ in ts.select(m, mod)]


def test_select_a_glob_over_second_paths_only():
    m, _ = make("tied_lm")
    assert [n for n, _ in ts.select(m, "he*.weight")] == ["emb.weight"]
    assert [n for n, _ in ts.select(m, "*.weight")] == ["emb.weight", "mid.weight"]


# ----------------------------------------------------------------------------- trainability & declarations

@pytest.mark.parametrize("name", CASES)
def test_is_trainable_by_either_path_and_trainable_parameters_once(name):
    m, _ = make(name)
    al = aliases(m)
    tp = ts.trainable_parameters(m)
    assert [n for n, _ in tp] == [n for n, _ in m.named_parameters()]
    for second, first in al.items():
        assert ts.is_trainable(m, second) is True and ts.is_trainable(m, first) is True
        with ts.freeze(m, second):
            assert ts.is_trainable(m, second) is False and ts.is_trainable(m, first) is False
            assert ts.is_trainable(m, m.get_parameter(second)) is False
            assert first not in [n for n, _ in ts.trainable_parameters(m)]


def _brute_declared(model, decls):
    """Is each first path admitted: some path of it along which every declaration admits."""
    out = {}
    for ps in paths_of(model).values():
        ok_any = False
        for path in ps:
            parts = path.split(".")
            ok = True
            for i in range(len(parts)):
                prefix = ".".join(parts[:i])
                mod = model.get_submodule(prefix)
                if id(mod) in decls and parts[i] not in decls[id(mod)]:
                    ok = False
                    break
            ok_any = ok_any or ok
        out[ps[0]] = ok_any
    return out


def test_declarations_brute_force_one_admitting_path_is_enough():
    """Every combination of declarations on the root, emb and head of the tied LM."""
    m, _ = make("tied_lm")
    start = flags(m)
    options = {
        "": [None, (), ("head",), ("emb",), ("mid", "head"), ("emb", "mid")],
        "emb": [None, (), ("weight",)],
        "head": [None, ("bias",), ("weight",), ("weight", "bias")],
    }
    for combo in itertools.product(*options.values()):
        decls = {}
        for mod_path, names in zip(options, combo):
            mod = m.get_submodule(mod_path)
            ts.mark_trainable(mod, None)
            if names is not None:
                ts.mark_trainable(mod, *names)
                decls[id(mod)] = set(names)
        want = _brute_declared(m, decls)
        got = {n: p.requires_grad for n, p in m.named_parameters()}
        assert got == want, combo
        assert {n for n, _ in ts.trainable_parameters(m)} == {n for n, v in want.items() if v}
        assert ts.is_trainable(m, "head.weight") is want["emb.weight"], combo
    for mod_path in options:
        ts.mark_trainable(m.get_submodule(mod_path), None)
    assert flags(m) == start


def test_declaration_naming_the_second_owner_admits_on_gpt2():
    m, _ = make("gpt2")
    ts.mark_trainable(m, "lm_head")  # only the head trains: the head *is* the embedding
    want = {n: n == "transformer.wte.weight" for n, _ in m.named_parameters()}
    assert {n: p.requires_grad for n, p in m.named_parameters()} == want
    assert [n for n, _ in ts.trainable_parameters(m)] == ["transformer.wte.weight"]
    ts.mark_trainable(m, None)
    assert all(p.requires_grad for p in m.parameters())


def test_attach_is_idempotent_and_reads_write_nothing_on_tied_model():
    m, _ = make("tied_lm")
    m.emb.weight.requires_grad_(False)  # the user's own starting flag
    before = flags(m)
    ts.trainable_parameters(m), ts.is_trainable(m, "head.weight"), ts.summary(m)
    assert flags(m) == before
    ts.attach(m)
    ts.attach(m)
    m(TOKENS)
    assert flags(m) == before
    assert ts.is_trainable(m, "head.weight") is False
    ts.detach_hooks(m)


# ----------------------------------------------------------------------------- contexts

@pytest.mark.parametrize("name", CASES)
def test_freeze_naming_only_the_second_path(name):
    m, _ = make(name)
    for second, first in aliases(m).items():
        start = flags(m)
        with ts.freeze(m, second):
            assert m.get_parameter(first).requires_grad is False
            others = [(n, f) for n, f in flags(m) if m.get_parameter(n) is not m.get_parameter(first)]
            assert others == [(n, f) for n, f in start if m.get_parameter(n) is not m.get_parameter(first)]
        assert flags(m) == start


@pytest.mark.parametrize("name", CASES)
def test_freeze_except_naming_only_the_second_module(name):
    m, _ = make(name)
    mod = second_module(m)
    keep = set(brute_select(m, mod))
    start = flags(m)
    with ts.freeze_except(m, mod):
        got = {n: p.requires_grad for n, p in m.named_parameters()}
        assert got == {n: n in keep for n in got}
    assert flags(m) == start


@pytest.mark.parametrize("name", SMALL)
def test_unfreeze_second_path_of_a_parameter_frozen_by_hand(name):
    m, _ = make(name)
    second, first = next(iter(aliases(m).items()))
    p = m.get_parameter(first)
    p.requires_grad_(False)
    start = flags(m)
    with ts.unfreeze(m, second):
        assert p.requires_grad and ts.is_trainable(m, first)
        with ts.freeze(m, first):  # nested by the other path: the inner one wins
            assert not p.requires_grad
        assert p.requires_grad
        with ts.freeze_except(m, second):
            assert p.requires_grad
    assert flags(m) == start and not p.requires_grad


def test_contexts_restore_when_the_block_raises_and_as_decorator():
    m, _ = make("tied_lm")
    start = flags(m)

    @ts.freeze(m, "head.weight")
    def step():
        return m.emb.weight.requires_grad

    assert m.emb.weight.requires_grad  # nothing at decoration
    assert step() is False
    assert flags(m) == start
    with pytest.raises(KeyError):
        with ts.freeze_except(m, "head"):
            raise KeyError("boom")
    assert flags(m) == start


def test_freeze_second_path_gives_no_grad_to_either_use():
    m, _ = make("tied_lm")
    with ts.freeze(m, "head"):
        lm_loss(m).backward()
    assert m.emb.weight.grad is None and m.head.bias.grad is None
    assert m.mid.weight.grad is not None


# ----------------------------------------------------------------------------- gradients

@pytest.mark.parametrize("name", CASES)
def test_structural_grad_wrt_either_path_is_the_total_at_the_first_path(name):
    m, loss = make(name)
    ref = ag_grads(m, loss)
    for second, first in aliases(m).items():
        for wrt in (second, first, m.get_parameter(second)):
            g = ts.tree.to_flat_dict(ts.structural_grad(m, loss, wrt=wrt))
            assert list(g) == [first], wrt
            close(g[first], ref[first])
        g = ts.tree.to_flat_dict(ts.structural_grad(m, loss(m), wrt=second))
        assert list(g) == [first]
        close(g[first], ref[first])
    assert all(p.grad is None for p in m.parameters())


@pytest.mark.parametrize("name", CASES)
def test_total_gradient_equals_sum_over_an_untied_copy(name):
    """Brute force: untie every second path into its own parameter; sum their grads."""
    m, loss = make(name)
    untied = copy.deepcopy(m)
    al = aliases(untied)
    owners = {}
    for second, first in al.items():
        mod_path, attr = second.rsplit(".", 1)
        mod = untied.get_submodule(mod_path)
        fresh = nn.Parameter(untied.get_parameter(first).detach().clone())
        setattr(mod, attr, fresh)
        owners.setdefault(first, []).append(fresh)
    if name in ("shared_sub", "two_names", "t5"):  # a shared *module*: untie it as a whole
        if name == "shared_sub":
            untied.decoder["proj"] = copy.deepcopy(untied.encoder["proj"])
        elif name == "two_names":
            untied.b = copy.deepcopy(untied.a)
        else:
            untied.encoder.embed_tokens = copy.deepcopy(untied.shared)
            untied.decoder.embed_tokens = copy.deepcopy(untied.shared)
            untied.lm_head.weight = nn.Parameter(untied.shared.weight.detach().clone())
        owners = {}
        for sec, fir in al.items():
            owners.setdefault(fir, []).append(untied.get_parameter(sec))
    assert not aliases(untied)
    loss(untied).backward()
    g = ts.tree.to_flat_dict(ts.structural_grad(m, loss))
    for first, extra in owners.items():
        own = untied.get_parameter(first).grad  # T5's `shared` has no use of its own
        total = (0 if own is None else own) + sum(q.grad for q in extra)
        close(g[first], total)


@pytest.mark.parametrize("name", ["tied_lm", "modulelist", "gpt2"])
def test_value_and_grad_and_grad_tree_by_second_path(name):
    m, loss = make(name)
    second, first = next(iter(aliases(m).items()))
    ref = ag_grads(m, loss)
    (value, aux), g = ts.value_and_grad(lambda mm: (loss(mm), 7), m, has_aux=True, wrt=second)
    assert aux == 7 and value.grad_fn is None
    assert ts.tree.paths(g) == [first]
    close(ts.tree.to_flat_dict(g)[first], ref[first])
    close(value, loss(m).detach())
    loss(m).backward()
    gt = ts.tree.to_flat_dict(ts.grad_tree(m))
    assert second not in gt and gt[first] is m.get_parameter(first).grad
    close(gt[first], ref[first])


def test_structural_grad_wrt_second_path_of_a_frozen_tied_parameter():
    m, loss = make("tied_lm")
    ref = ag_grads(m, loss)
    with ts.freeze(m, "head"):
        inside = flags(m)
        assert ts.tree.paths(ts.structural_grad(m, loss)) == ["mid.weight", "mid.bias"]
        g = ts.structural_grad(m, loss, wrt="head.weight")  # callable form: a frozen one works
        assert flags(m) == inside
        close(g["emb"]["weight"], ref["emb.weight"])
        with pytest.raises(ValueError, match=r"emb\.weight|head\.weight"):
            ts.structural_grad(m, loss(m), wrt="head.weight")  # tensor form: no graph to it
        assert flags(m) == inside


def test_structural_grad_create_graph_through_tied_weight():
    m, loss = make("tied_lm")
    g = ts.structural_grad(m, loss, wrt="head.weight", create_graph=True)
    hvp_ts = ts.structural_grad(m, (g["emb"]["weight"] ** 2).sum(), wrt="emb.weight")
    p = m.emb.weight
    (gr,) = torch.autograd.grad(loss(m), p, create_graph=True)
    (hvp,) = torch.autograd.grad((gr ** 2).sum(), p)
    close(hvp_ts["emb"]["weight"], hvp)


# ----------------------------------------------------------------------------- norms and clipping

@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf"), 3.0])
def test_clip_model_matches_torch_on_the_deduplicated_list(name, norm_type):
    m, loss = make(name)
    loss(m).backward()
    ref = copy.deepcopy(m)
    _copy_grads(m, ref)
    want = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 0.05, norm_type=norm_type)
    close(ts.global_norm(m, norm_type=norm_type), want)
    got = ts.clip_by_global_norm(m, 0.05, norm_type=norm_type)
    close(got, want)
    for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        close(p.grad, q.grad)


def test_clip_a_list_with_the_tied_parameter_twice_is_taken_as_given():
    m, loss = make("tied_lm")
    loss(m).backward()
    ref = copy.deepcopy(m)
    _copy_grads(m, ref)
    lst = [m.emb.weight, m.mid.weight, m.head.weight]
    rlst = [ref.emb.weight, ref.mid.weight, ref.head.weight]
    want = torch.nn.utils.clip_grad_norm_(rlst, 0.01)
    close(ts.clip_by_global_norm(lst, 0.01), want)
    close(m.emb.weight.grad, ref.emb.weight.grad)  # scaled twice, exactly as torch
    close(m.mid.weight.grad, ref.mid.weight.grad)


@pytest.mark.parametrize("name", ["tied_lm", "gpt2", "t5"])
def test_clip_a_structural_grad_tree_and_frozen_second_path(name):
    m, loss = make(name)
    g = ts.structural_grad(m, loss)
    ref = [t.clone() for t in ts.tree.leaves(g)]
    want = torch.linalg.vector_norm(torch.cat([t.flatten() for t in ref]))
    close(ts.global_norm(g), want)
    close(ts.clip_by_global_norm(g, 0.1), want)
    for t, r in zip(ts.tree.leaves(g), ref):
        close(t, r * min(1.0, 0.1 / (want.item() + 1e-6)))
    # frozen through the second path: not in the norm, its grad left alone
    loss(m).backward()
    second, first = next(iter(aliases(m).items()))
    tied = m.get_parameter(first)
    tied_grad = tied.grad.clone()
    with ts.freeze(m, second):
        rest = [p for p in m.parameters() if p is not tied]
        want = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in rest]))
        close(ts.clip_by_global_norm(m, 1e-3), want)
    assert torch.equal(tied.grad, tied_grad)


# ----------------------------------------------------------------------------- param groups, layer decay

@pytest.mark.parametrize("name", CASES)
def test_param_groups_each_parameter_once_rule_by_second_path(name):
    m, _ = make(name)
    second, first = next(iter(aliases(m).items()))
    groups = ts.param_groups(m, (second, {"lr": 0.5}), weight_decay=0.1)
    seen = [id(p) for g in groups for p in g["params"]]
    assert sorted(seen) == sorted(id(p) for p in m.parameters())  # exactly once each
    names = [n for g in groups for n in g["param_names"]]
    assert sorted(names) == sorted(n for n, _ in m.named_parameters())
    assert not set(names) & set(aliases(m))
    owner = [g for g in groups if first in g["param_names"]]
    assert len(owner) == 1 and owner[0]["lr"] == 0.5
    for g in groups:
        assert [n for n in g["param_names"]] == [first_path(m)[id(p)] for p in g["params"]]
    # a later rule by the first path cannot take it again
    groups = ts.param_groups(m, (second, {"lr": 0.5}), (first, {"lr": 0.1}), strict=False)
    assert sum(first in g["param_names"] for g in groups) == 1
    assert [g["lr"] for g in groups if first in g["param_names"]] == [0.5]


def test_layer_decay_gpt2_tied_head_gets_layer_zero():
    m, _ = make("gpt2")
    L = 2
    groups = ts.param_groups(m, *ts.layer_decay(m, 0.5))
    scale = {n: g["lr_scale"] for g in groups for n in g["param_names"]}
    assert sorted(scale) == sorted(n for n, _ in m.named_parameters())
    assert "lm_head.weight" not in scale
    assert scale["transformer.wte.weight"] == 0.5 ** (L + 1)
    assert scale["transformer.h.0.attn.c_attn.weight"] == 0.5 ** L
    assert scale["transformer.h.1.mlp.c_fc.weight"] == 0.5 ** 1
    assert scale["transformer.ln_f.weight"] == 1.0


def test_layer_decay_weight_tied_across_blocks_and_block_listed_twice():
    m, _ = make("modulelist")
    groups = ts.param_groups(m, *ts.layer_decay(m, 0.5))
    scale = {n: g["lr_scale"] for g in groups for n in g["param_names"]}
    assert sorted(scale) == sorted(n for n, _ in m.named_parameters())
    assert scale["blocks.0.weight"] == 0.5 ** 3  # id 1 (its first path), L = 3
    assert scale["blocks.2.bias"] == 0.5 ** 1 and scale["head.weight"] == 1.0
    b = nn.Linear(4, 4)
    twice = nn.ModuleDict({"inp": nn.Linear(4, 4), "blocks": nn.ModuleList([b, nn.Linear(4, 4), b]),
                           "head": nn.Linear(4, 1)})
    groups = ts.param_groups(twice, *ts.layer_decay(twice, 0.5))
    scale = {n: g["lr_scale"] for g in groups for n in g["param_names"]}
    assert scale["blocks.0.weight"] == 0.5 ** 2 and scale["blocks.1.weight"] == 0.5  # L = 2
    assert scale["head.bias"] == 1.0 and scale["inp.weight"] == 0.5 ** 3


def test_lr_scale_zero_by_second_path_leaves_tied_weight_bitwise():
    m, loss = make("tied_lm")
    opt = ts.optim.SGD(ts.param_groups(m, ("head.weight", {"lr_scale": 0.0})), lr=0.1,
                       momentum=0.9, weight_decay=0.1)
    before = m.emb.weight.detach().clone()
    mid = m.mid.weight.detach().clone()
    loss(m).backward()
    opt.step()
    assert torch.equal(m.emb.weight, before) and m.emb.weight not in opt.state
    assert not torch.equal(m.mid.weight, mid)


# ----------------------------------------------------------------------------- optimizers

@pytest.mark.parametrize("opt_name", ["SGD", "AdamW"])
@pytest.mark.parametrize("name", ["tied_lm", "gpt2"])
def test_optim_masks_on_tied_parameter_match_torch(opt_name, name):
    m, loss = make(name)
    ref = copy.deepcopy(m)
    second, first = next(iter(aliases(m).items()))
    tied = m.get_parameter(second)
    torch.manual_seed(3)
    mask = torch.rand(tied.shape) < 0.5
    kw = dict(lr=0.05, momentum=0.9, weight_decay=0.1) if opt_name == "SGD" else \
        dict(lr=0.01, weight_decay=0.1)
    opt = getattr(ts.optim, opt_name)(m.parameters(), masks={m.get_parameter(second): mask}, **kw)
    ropt = getattr(torch.optim, opt_name)(ref.parameters(), foreach=False, **kw)
    start = tied.detach().clone()
    _step_both(3, loss, m, ref, opt, ropt)
    rt = ref.get_parameter(first)
    close(tied.detach(), torch.where(mask, rt.detach(), start), rtol=1e-5, atol=1e-6)
    assert torch.equal(tied[~mask], start[~mask])  # masked out: bitwise
    for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        if p is not tied:
            close(p, q)
    st = opt.state[tied]
    key = "momentum_buffer" if opt_name == "SGD" else "exp_avg"
    assert st[key][~mask].eq(0).all()
    assert len(opt.state) == len(unique_params(m))


def _step_both(n, loss, m, ref, opt, ropt):
    """``n`` steps of ``opt`` on ``m`` and ``ropt`` on ``ref``, with the same gradients."""
    for _ in range(n):
        opt.zero_grad()
        ropt.zero_grad()
        loss(m).backward()
        _copy_grads(m, ref)
        opt.step()
        ropt.step()


@pytest.mark.parametrize("opt_name", ["SGD", "AdamW"])
def test_optim_tied_parameter_listed_twice_is_stepped_once(opt_name):
    m, loss = make("tied_lm")
    ref = copy.deepcopy(m)
    kw = dict(lr=0.1, momentum=0.9) if opt_name == "SGD" else dict(lr=0.01)
    dup = [p for _, p in m.named_parameters(remove_duplicate=False)]
    assert len(dup) == len(unique_params(m)) + 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns about duplicates
        opt = getattr(ts.optim, opt_name)(dup, **kw)
    ropt = getattr(torch.optim, opt_name)(list(ref.parameters()), foreach=False, **kw)
    _step_both(2, loss, m, ref, opt, ropt)
    for p, q in zip(m.parameters(), ref.parameters()):
        close(p, q)


def test_optim_skips_tied_parameter_frozen_by_second_path():
    m, loss = make("gpt2")
    opt = ts.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1)
    loss(m).backward()  # a stale grad on the tied weight
    wte = m.transformer.wte.weight
    before = wte.detach().clone()
    with ts.freeze(m, "lm_head"):
        opt.step()
    assert torch.equal(wte, before) and wte not in opt.state
    assert len(opt.state) == len(unique_params(m)) - 1


def test_optim_mask_by_path_and_by_second_path():
    m, loss = make("tied_lm")
    mask = torch.zeros(11, 6, dtype=torch.bool)
    mask[:3] = True
    opt = ts.optim.SGD(ts.param_groups(m), lr=0.1, masks={"emb.weight": mask})
    assert torch.equal(opt.masks[m.emb.weight], mask)
    # The second path is no key of the optimizer's param_names (named_parameters() dedups);
    # the docs do not say whether it is accepted. Either it names the one tied tensor, or it
    # is refused clearly: never silently ignored.
    try:
        opt2 = ts.optim.SGD(ts.param_groups(m), lr=0.1, masks={"head.weight": mask})
    except ValueError as e:
        assert "head.weight" in str(e)
    else:
        assert torch.equal(opt2.masks[m.emb.weight], mask)


def test_optim_state_dict_resume_with_mask_on_tied():
    m, loss = make("tied_lm")
    mask = torch.zeros(11, 6, dtype=torch.bool)
    mask[5:] = True
    opt = ts.optim.AdamW(m.named_parameters(), lr=0.01, masks={m.head.weight: mask})
    loss(m).backward()
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    m2 = copy.deepcopy(m)
    opt2 = ts.optim.AdamW(m2.named_parameters(), lr=0.01)
    opt2.load_state_dict(sd)
    assert torch.equal(opt2.masks[m2.head.weight], mask)
    assert m2.head.weight is m2.emb.weight
    for o, mm in ((opt, m), (opt2, m2)):
        o.zero_grad()
        loss(mm).backward()
        o.step()
    close(m2.emb.weight, m.emb.weight)


# ----------------------------------------------------------------------------- checkpoints & copies

@pytest.mark.parametrize("name", CASES)
def test_ts_state_dict_has_tied_once_at_first_path(name):
    m, _ = make(name)
    sd = ts.state_dict(m, buffers=False)
    assert list(sd) == [n for n, _ in m.named_parameters()]
    for n, t in sd.items():
        assert torch.equal(t, m.get_parameter(n))
    second, first = next(iter(aliases(m).items()))
    with ts.freeze(m, second):
        assert first not in ts.state_dict(m, buffers=False)


@pytest.mark.parametrize("name", ["tied_lm", "gpt2", "t5"])
def test_load_state_dict_restores_both_paths(name):
    m, _ = make(name)
    src, _ = make(name, seed=1)
    full = src.state_dict()  # holds every path of the tied weight
    res = ts.load_state_dict(m, full)
    assert list(res.missing_keys) == [] and list(res.unexpected_keys) == []
    for second, first in aliases(m).items():
        assert m.get_parameter(second) is m.get_parameter(first)
        assert torch.equal(m.get_parameter(second), src.get_parameter(first))
    # only the second path given (strict): it is the one tensor
    m3, _ = make(name)
    part = ts.state_dict(src)
    for second, first in aliases(m3).items():
        if first in part:
            part[second] = part.pop(first)
    ts.load_state_dict(m3, part)
    for second, first in aliases(m3).items():
        assert torch.equal(m3.get_parameter(first), src.get_parameter(first))


def test_load_state_dict_conflicting_tied_values_writes_nothing():
    m, _ = make("tied_lm")
    src, _ = make("tied_lm", seed=1)
    full = src.state_dict()
    full["head.weight"] = full["head.weight"] + 1
    before = values(m)
    fl = flags(m)
    with pytest.raises(ValueError, match=r"emb\.weight.*head\.weight|head\.weight.*emb\.weight"):
        ts.load_state_dict(m, full)
    assert same_values(m, before) and flags(m) == fl
    nan = src.state_dict()
    nan["emb.weight"][0, 0] = float("nan")
    nan["head.weight"][0, 0] = float("nan")  # NaN counts as equal to NaN
    ts.load_state_dict(m, nan)
    assert torch.isnan(m.head.weight[0, 0])


@pytest.mark.parametrize("name", ["tied_lm", "gpt2"])
def test_torch_save_round_trip_of_ts_state_dict_and_of_attached_model(name):
    m, loss = make(name)
    second, first = next(iter(aliases(m).items()))
    ts.attach(m)
    buf = io.BytesIO()
    torch.save(ts.state_dict(m), buf)
    buf.seek(0)
    sd = torch.load(buf)
    fresh, _ = make(name, seed=5)
    ts.load_state_dict(fresh, sd)
    assert fresh.get_parameter(second) is fresh.get_parameter(first)
    close(loss(fresh), loss(m))
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    assert back.get_parameter(second) is back.get_parameter(first)
    assert list(ts.state_dict(back)) == list(ts.state_dict(m))
    with ts.freeze(back, second):
        assert not back.get_parameter(first).requires_grad
        assert m.get_parameter(first).requires_grad
    assert back.get_parameter(first).requires_grad
    ts.detach_hooks(m)


def test_deepcopy_keeps_ties_and_copy_is_plain_until_attached():
    m, loss = make("tied_lm")
    ts.freeze_except(m, "head")  # permanent, on the original
    c = copy.deepcopy(m)
    assert c.head.weight is c.emb.weight and c.emb.weight is not m.emb.weight
    assert flags(c) == flags(m)
    c.extra = nn.Linear(2, 2)  # a registration: plain PyTorch on the copy, no hook acts
    c(TOKENS)
    assert c.extra.weight.requires_grad
    with ts.freeze(c, "head.weight"):
        assert not c.emb.weight.requires_grad and m.emb.weight.requires_grad
    g = ts.structural_grad(c, loss, wrt="head.weight")
    close(g["emb"]["weight"], ag_grads(c, loss)["emb.weight"])


def test_averaged_model_keeps_ties_and_averages_once():
    from torch.optim.swa_utils import AveragedModel
    m, loss = make("tied_lm")
    ts.attach(m)
    avg = AveragedModel(m)
    assert avg.module.head.weight is avg.module.emb.weight
    first = values(m)
    for _ in range(2):
        with torch.no_grad():
            for p in m.parameters():
                p.add_(1.0)
        avg.update_parameters(m)  # the first call copies, the second averages
    for n, p in avg.module.named_parameters():  # the tied one averaged once: first + 1.5
        close(p, first[n] + 1.5)
    assert [k for k in ts.state_dict(avg, buffers=False)] == \
        ["module." + n for n, _ in m.named_parameters()]
    with ts.freeze(avg, "module.head"):
        assert not avg.module.emb.weight.requires_grad
    assert avg.module.emb.weight.requires_grad


# ----------------------------------------------------------------------------- summary

@pytest.mark.parametrize("name", CASES)
def test_summary_counts_tied_once_and_flags_it(name):
    m, _ = make(name)
    second, first = next(iter(aliases(m).items()))
    total = sum(p.numel() for p in m.parameters())
    s = ts.summary(m)
    assert s.counts == (total, total)
    rows = {r.path: r for r in s.rows}
    for sec, fir in aliases(m).items():  # flagged: at the parameter, or at a reused module
        if sec in rows:
            assert rows[sec].tied_to == fir and rows[sec].total == 0
        else:
            owner = [r for r in s.rows if r.tied_to and sec.startswith(r.path + ".")]
            assert owner and fir.startswith(owner[0].tied_to + "."), sec
    n = m.get_parameter(first).numel()
    with ts.freeze(m, second):
        s = ts.summary(m)
    assert s.counts == (total - n, total)
    assert str(s).splitlines()[-1].endswith(f"{100 * (total - n) / total:.2f}%")


def test_summary_rows_add_up_with_tied_parameter():
    m, _ = make("tied_lm")
    with ts.freeze(m, "mid"):
        s = ts.summary(m)
    rows = {r.path: r for r in s.rows}
    assert rows["head.weight"].tied_to == "emb.weight"
    assert rows[""].total == sum(rows[k].total for k in ("emb", "mid", "head"))
    assert rows[""].trainable == sum(rows[k].trainable for k in ("emb", "mid", "head"))
    assert s.counts == (66 + 11, 66 + 42 + 11)


# ----------------------------------------------------------------------------- walk

@pytest.mark.parametrize("name", ["modulelist", "shared_sub", "gpt2"])
def test_map_trainable_and_polyak_once_with_second_path_frozen(name):
    m, loss = make(name)
    src, _ = make(name, seed=2)
    second, first = next(iter(aliases(m).items()))
    tied = m.get_parameter(first)
    before = {id(p): p.detach().clone() for p in m.parameters()}
    srcv = {id(p): q.detach().clone() for p, q in zip(m.parameters(), src.parameters())}
    with ts.freeze(m, second):
        seen = []
        out = ts.map_trainable(lambda p, s: seen.append(p) or s, m, ts.tree.from_module(src))
        assert all(p is not tied for p in seen) and len(seen) == len(set(map(id, seen)))
        assert first not in ts.tree.paths(out)
        ts.polyak_update(m, src, 0.25)
    for p in m.parameters():
        want = before[id(p)] if p is tied else 0.75 * before[id(p)] + 0.25 * srcv[id(p)]
        close(p.detach(), want)
    ts.polyak_update(m, src, 0.5)  # now the tied one too, exactly once
    close(tied.detach(), 0.5 * before[id(tied)] + 0.5 * srcv[id(tied)])


# ----------------------------------------------------------------------------- UnfreezeSchedule

def test_unfreeze_schedule_milestone_by_second_path():
    m, _ = make("gpt2")
    start = flags(m)
    s = ts.UnfreezeSchedule(m, {0: "lm_head", 2: "transformer.h.1", 3: None})
    assert [n for n, p in m.named_parameters() if p.requires_grad] == ["transformer.wte.weight"]
    s.step()
    s.step()
    h1 = {n for n, _ in m.named_parameters() if n.startswith("transformer.h.1.")}
    assert {n for n, p in m.named_parameters() if p.requires_grad} == {"transformer.wte.weight"} | h1
    state = s.state_dict()
    s.close()
    assert flags(m) == start
    m2, _ = make("gpt2")
    s2 = ts.UnfreezeSchedule(m2, {0: "lm_head", 2: "transformer.h.1", 3: None})
    s2.load_state_dict(state)
    assert {n for n, p in m2.named_parameters() if p.requires_grad} == {"transformer.wte.weight"} | h1
    s2.step()
    assert all(p.requires_grad for p in m2.parameters())
    s2.close()


# ----------------------------------------------------------------------------- blocks

def test_stop_gradient_second_path_blocks_every_use():
    m, loss = make("tied_lm")
    with ts.stop_gradient(m, "head.weight"):
        loss(m).backward()
    assert m.emb.weight.grad is None
    ref = copy.deepcopy(m)
    ref.zero_grad(set_to_none=True)
    w = ref.emb.weight.detach()
    h = torch.tanh(ref.mid(nn.functional.embedding(TOKENS, w)))
    out = nn.functional.linear(h, w, ref.head.bias)
    nn.functional.cross_entropy(out.flatten(0, 1), TOKENS.flatten()).backward()
    close(m.mid.weight.grad, ref.mid.weight.grad)
    close(m.head.bias.grad, ref.head.bias.grad)


def test_stop_gradient_second_path_for_part_of_the_forward():
    m, _ = make("tied_lm")
    h = torch.tanh(m.mid(m.emb(TOKENS)))  # the embedding use: outside the block
    with ts.stop_gradient(m, "head"):
        out = m.head(h)
    nn.functional.cross_entropy(out.flatten(0, 1), TOKENS.flatten()).backward()
    ref = copy.deepcopy(m)
    ref.zero_grad(set_to_none=True)
    h = torch.tanh(ref.mid(ref.emb(TOKENS)))
    out = nn.functional.linear(h, ref.emb.weight.detach(), ref.head.bias.detach())
    nn.functional.cross_entropy(out.flatten(0, 1), TOKENS.flatten()).backward()
    close(m.emb.weight.grad, ref.emb.weight.grad)
    assert m.head.bias.grad is None


def test_stop_gradient_on_gpt2_lm_head_matches_detached_reference():
    m, loss = make("gpt2")
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    hidden = m.transformer(input_ids=ids).last_hidden_state
    with ts.stop_gradient(m, "lm_head"):
        logits = m.lm_head(hidden)
    logits.square().mean().backward()
    g_ts = m.transformer.wte.weight.grad.clone()
    m.zero_grad(set_to_none=True)
    hidden = m.transformer(input_ids=ids).last_hidden_state
    logits = nn.functional.linear(hidden, m.transformer.wte.weight.detach())
    logits.square().mean().backward()
    close(g_ts, m.transformer.wte.weight.grad)


def test_constant_second_path_protects_the_one_tensor():
    m, loss = make("tied_lm")
    loss(m).backward()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    before = values(m)
    with ts.constant(m, "head.weight"):
        with torch.no_grad(), pytest.raises(RuntimeError, match=r"emb\.weight|head\.weight"):
            m.emb.weight.add_(1.0)
        with pytest.raises(RuntimeError, match=r"emb\.weight|head\.weight"):
            opt.step()
        with torch.no_grad():
            m.mid.bias.zero_()  # not selected: allowed
    assert torch.equal(m.emb.weight, before["emb.weight"])
    assert opt.state == {} or all(len(v) == 0 for v in opt.state.values())
    assert torch.equal(m.mid.bias, torch.zeros(6))


def test_swap_first_path_swaps_every_use_second_path_is_refused():
    m, _ = make("tied_lm")
    w = torch.randn(11, 6)
    with ts.swap(m, {"emb": {"weight": w}}):
        out = m(TOKENS)
    h = torch.tanh(m.mid(nn.functional.embedding(TOKENS, w)))
    close(out, nn.functional.linear(h, w, m.head.bias))
    before = values(m)
    with pytest.raises(ValueError, match=r"head\.weight"):
        ts.swap(m, {"head": {"weight": w}})
    assert same_values(m, before)
    close(m(TOKENS), TiedLM.forward(m, TOKENS))


def test_swap_on_t5_shared_embedding_reaches_all_four_uses():
    m, loss = make("t5")
    w = torch.randn_like(m.shared.weight)
    with torch.no_grad(), ts.swap(m, {"shared": {"weight": w}}):
        got = loss(m)
    ref = copy.deepcopy(m)
    with torch.no_grad():
        ref.shared.weight.copy_(w)
    close(got, loss(ref).detach())
    for second in ("encoder.embed_tokens", "decoder.embed_tokens", "lm_head"):
        with pytest.raises(ValueError):
            ts.swap(m, {second: {"weight": w}})


# ----------------------------------------------------------------------------- ties made later

def test_tie_made_after_a_declaration_follows_at_the_next_forward():
    m = UntiedLM()
    ts.mark_trainable(m, "head")
    assert not m.emb.weight.requires_grad
    m.head.weight = m.emb.weight  # now reachable by the admitted path
    assert ts.is_trainable(m, "emb.weight")  # reads walk the tree
    m(TOKENS)
    assert m.emb.weight.requires_grad and not m.mid.weight.requires_grad
    ts.mark_trainable(m, None)
    assert all(p.requires_grad for p in m.parameters())


def test_tie_made_after_attach_then_contexts_by_second_path():
    m = UntiedLM()
    ts.attach(m)
    m(TOKENS)
    old = m.head.weight
    m.head.weight = m.emb.weight
    m(TOKENS)
    assert [n for n, _ in ts.select(m, "head.weight")] == ["emb.weight"]
    start = flags(m)
    with ts.freeze(m, "head"):
        assert not m.emb.weight.requires_grad and m.mid.weight.requires_grad
    assert flags(m) == start and old.requires_grad
    g = ts.structural_grad(m, lm_loss, wrt="head")
    assert ts.tree.paths(g) == ["emb.weight", "head.bias"]
    close(g["emb"]["weight"], ag_grads(m, lm_loss)["emb.weight"])


def test_tie_made_inside_a_context_all_flags_back_after():
    m = UntiedLM()
    old = m.head.weight
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ts.RestoredFlagsWarning)
        with ts.freeze(m, "head", "mid"):
            m.head.weight = m.emb.weight
            m(TOKENS)
            assert not m.mid.weight.requires_grad and not m.head.bias.requires_grad
            # decided once per parameter at entry (freezing.md): the embedding was not picked
            assert m.emb.weight.requires_grad
    assert all(p.requires_grad for p in m.parameters()) and old.requires_grad


def test_tie_made_inside_a_context_is_frozen_by_the_next_one():
    m = UntiedLM()
    with pytest.warns(ts.RestoredFlagsWarning, match="mid"):  # documented: a registration inside
        with ts.freeze(m, "mid"):
            m.head.weight = m.emb.weight
    with ts.freeze(m, "head.weight"):
        assert not m.emb.weight.requires_grad
    assert all(p.requires_grad for p in m.parameters())


# ----------------------------------------------------------------------------- PEFT

def test_peft_lora_on_tied_gpt2():
    peft = pytest.importorskip("peft")
    m, loss = make("gpt2")
    pm = peft.get_peft_model(m, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"],
                                                fan_in_fan_out=True, lora_dropout=0.0))
    base = pm.base_model.model
    assert base.lm_head.weight is base.transformer.wte.weight
    on = [n for n, p in pm.named_parameters() if p.requires_grad]
    assert [n for n, _ in ts.trainable_parameters(pm)] == on and all("lora_" in n for n in on)
    start = flags(pm)
    wte = "base_model.model.transformer.wte.weight"
    with ts.unfreeze(pm, "base_model.model.lm_head"):
        assert base.transformer.wte.weight.requires_grad
        assert ts.is_trainable(pm, "base_model.model.lm_head.weight")
        assert [n for n, _ in ts.trainable_parameters(pm)] == [wte] + on
    assert flags(pm) == start
    g = ts.structural_grad(pm, loss, wrt="base_model.model.lm_head.weight")
    assert ts.tree.paths(g) == [wte]
    close(ts.tree.to_flat_dict(g)[wte], ag_grads(pm, loss)[wte])
    assert flags(pm) == start
    total = sum(p.numel() for p in pm.parameters())
    lora = sum(p.numel() for p in pm.parameters() if p.requires_grad)
    assert ts.summary(pm).counts == (lora, total)
    groups = ts.param_groups(pm, ("*lm_head*", {"lr": 0.5}))
    assert sum(len(g["params"]) for g in groups) == len(list(pm.parameters()))
    assert [g["param_names"] for g in groups if g.get("lr") == 0.5] == [[wte]]


# ----------------------------------------------------------------------------- bad input

def test_bad_selectors_on_tied_model_change_nothing():
    m, loss = make("tied_lm")
    m.mid.bias.requires_grad_(False)
    start = flags(m)
    for call in (lambda: ts.freeze(m, "head.wieght"),
                 lambda: ts.freeze_except(m, "haed"),
                 lambda: ts.unfreeze(m, "head.weigth"),
                 lambda: ts.freeze_except(m, []),
                 lambda: ts.freeze(m, nn.Parameter(torch.zeros(11, 6))),
                 lambda: ts.mark_trainable(m.head, "wieght"),
                 lambda: ts.UnfreezeSchedule(m, {0: "head", 2: "head.wieght"}),
                 lambda: ts.structural_grad(m, lm_loss, wrt="head.wieght"),
                 lambda: ts.param_groups(m, ("head.wieght", {"lr": 1.0}))):
        with pytest.raises(ValueError, match="head|haed|wieght|empty|part of|not"):
            call()
        assert flags(m) == start


def test_bad_swap_polyak_and_clip_on_tied_model_change_nothing():
    m, loss = make("tied_lm")
    loss(m).backward()
    before, grads = values(m), {n: p.grad.clone() for n, p in m.named_parameters()}
    with pytest.raises(ValueError, match=r"emb\.weight"):
        ts.swap(m, {"emb": {"weight": torch.zeros(11, 5)}})
    with pytest.raises(ValueError, match="tau"):
        ts.polyak_update(m, copy.deepcopy(m), 1.5)
    bad_src = copy.deepcopy(m)
    bad_src.head.weight = nn.Parameter(torch.zeros(11, 6))  # untied in the source: its 2nd path
    src_tree = ts.tree.from_module(bad_src)
    src_tree["emb"]["weight"] = torch.zeros(11, 5)
    with pytest.raises(ValueError, match=r"emb\.weight"):
        ts.polyak_update(m, src_tree, 0.5)
    with pytest.raises((ValueError, RuntimeError), match="max_norm|negative"):
        ts.clip_by_global_norm(m, -1.0)
    assert same_values(m, before)
    assert all(torch.equal(p.grad, grads[n]) for n, p in m.named_parameters())


def test_bad_mask_on_tied_parameter_changes_nothing():
    m, loss = make("tied_lm")
    good = torch.ones(11, 6, dtype=torch.bool)
    good[0] = False
    opt = ts.optim.AdamW(m.parameters(), lr=0.01, masks={m.head.weight: good})
    loss(m).backward()
    opt.step()
    state = {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[m.emb.weight].items()}
    before = values(m)
    fl = flags(m)
    for bad in (torch.ones(6, 11, dtype=torch.bool), torch.ones(11, 6)):
        with pytest.raises(ValueError, match=r"emb\.weight|head\.weight|mask|shape|dtype"):
            opt.set_mask(m.head.weight, bad)
        with pytest.raises(ValueError):
            ts.optim.AdamW(m.parameters(), lr=0.01, masks={m.head.weight: bad})
    assert torch.equal(opt.masks[m.emb.weight], good)
    assert same_values(m, before) and flags(m) == fl
    for k, v in opt.state[m.emb.weight].items():
        assert torch.equal(v, state[k]) if torch.is_tensor(v) else v == state[k]


def test_map_trainable_mismatched_leaf_at_second_path_is_refused():
    m, loss = make("gpt2")
    g = ts.tree.to_flat_dict(ts.structural_grad(m, loss))
    g["lm_head.weight"] = torch.zeros_like(g["transformer.wte.weight"])
    with pytest.raises(ValueError, match=r"lm_head\.weight"):
        ts.map_trainable(lambda p, d: d, m, ts.tree.from_flat_dict(g))


# ----------------------------------------------------------------------------- more patterns

class SharedNorm(nn.Module):
    """One BatchNorm reachable by two paths (x and y)."""

    def __init__(self):
        super().__init__()
        bn = nn.BatchNorm1d(3)
        self.x = bn
        self.lin = nn.Linear(3, 3)
        self.y = bn

    def forward(self, v):
        return self.y(self.lin(self.x(v)))


def test_shared_norm_frozen_by_second_path_holds_stats_and_checkpoints_once():
    torch.manual_seed(0)
    m = SharedNorm()
    m(torch.randn(8, 3))
    before = m.x.running_mean.clone()
    with ts.freeze(m, "y"):
        assert not m.x.weight.requires_grad and m.lin.weight.requires_grad
        m(torch.randn(8, 3))
        assert torch.equal(m.x.running_mean, before)  # all its parameters frozen: held
    m(torch.randn(8, 3))
    assert not torch.equal(m.x.running_mean, before)
    sd = ts.state_dict(m)
    assert not any(k.startswith("y.") for k in sd) and "x.running_mean" in sd
    full = m.state_dict()
    assert ts.load_state_dict(m, full).missing_keys == []
    bad = dict(full)
    bad["y.running_mean"] = bad["y.running_mean"] + 1
    keep = m.x.running_mean.clone()
    with pytest.raises(ValueError, match=r"x\.running_mean.*y\.running_mean"):
        ts.load_state_dict(m, bad)
    assert torch.equal(m.x.running_mean, keep)


def test_module_registered_twice_blocks_by_second_name():
    m, loss = make("two_names")
    with ts.stop_gradient(m, "b"):
        loss(m).backward()
    assert m.a.weight.grad is None and m.a.bias.grad is None and m.out.weight.grad is not None
    w = torch.randn(4, 4)
    with torch.no_grad(), ts.swap(m, {"a": {"weight": w}}):
        y = m(X)
    ref = copy.deepcopy(m)
    with torch.no_grad():
        ref.a.weight.copy_(w)
    close(y, ref(X))
    with pytest.raises(ValueError, match=r"b\.weight.*a\.weight"):
        ts.swap(m, {"b": {"weight": w}})
    before = m.a.weight.detach().clone()
    with ts.constant(m, "b"), torch.no_grad(), pytest.raises(RuntimeError, match=r"a\.weight|b\.weight"):
        m.a.weight.data.add_(1.0)
    assert torch.equal(m.a.weight, before)


def test_optim_max_grad_norm_counts_tied_once_with_duplicate_list():
    m, loss = make("tied_lm")
    ref = copy.deepcopy(m)
    dup = [p for _, p in m.named_parameters(remove_duplicate=False)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        opt = ts.optim.SGD(dup, lr=0.1, momentum=0.9, max_grad_norm=0.01)
    ropt = torch.optim.SGD(list(ref.parameters()), lr=0.1, momentum=0.9, foreach=False)
    loss(m).backward()
    _copy_grads(m, ref)
    grads = [p.grad.clone() for p in m.parameters()]
    want = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 0.01)
    opt.step()
    ropt.step()
    close(opt.last_grad_norm, want)
    for p, q, g in zip(m.parameters(), ref.parameters(), grads):
        close(p, q)
        assert torch.equal(p.grad, g)  # never rewritten


def test_no_weight_decay_names_and_no_decay_selector_by_second_path():
    m, _ = make("tied_lm")
    m.no_weight_decay = lambda: {"head.weight"}
    groups = {g["name"]: g["param_names"] for g in ts.param_groups(m, weight_decay=0.1)}
    assert "emb.weight" in groups["default (no decay)"] and "emb.weight" not in groups["default"]
    del m.no_weight_decay
    groups = {g["name"]: g["param_names"]
              for g in ts.param_groups(m, weight_decay=0.1, no_decay="head.weight")}
    assert groups["default (no decay)"] == ["emb.weight"]


@pytest.mark.parametrize("second", ["norm.weight", "lin.bias"])
def test_no_decay_auto_exempts_a_tied_parameter_when_any_path_is_exempt(second):
    """groups.md: a tied parameter is exempt when any of its paths is (a norm's weight, a bias),
    as a rule selecting any of its paths takes it; its group lists it at its first path."""
    m = nn.Module()
    m.a = nn.Module()
    m.a.scale = nn.Parameter(torch.ones(4))
    m.norm, m.lin = nn.LayerNorm(4), nn.Linear(4, 4)
    owner, name = second.split(".")
    setattr(getattr(m, owner), name, m.a.scale)
    groups = {g["name"]: g["param_names"] for g in ts.param_groups(m, weight_decay=0.1)}
    assert "a.scale" in groups["default (no decay)"]
    assert "a.scale" not in groups["default"]
    assert sum(len(v) for v in groups.values()) == len(list(m.parameters()))


def test_unfreeze_schedule_on_weight_tied_across_blocks():
    m, _ = make("modulelist")
    start = flags(m)
    s = ts.UnfreezeSchedule(m, {0: "blocks.2", 1: "head"})
    assert [n for n, p in m.named_parameters() if p.requires_grad] == ["blocks.0.weight", "blocks.2.bias"]
    s.step()
    assert [n for n, p in m.named_parameters() if p.requires_grad] == [
        "blocks.0.weight", "blocks.2.bias", "head.weight", "head.bias"]
    s.close()
    assert flags(m) == start


def test_within_gradient_on_tied_parameter_by_either_module():
    m, _ = make("tied_lm")
    with ts.freeze(m, "head.weight"):
        assert ts.within_gradient(m.head.weight) is False
        assert ts.within_gradient(m.emb) is False  # its only parameter is the tied one
        assert ts.within_gradient(m.head) is True  # head.bias still trains
    assert ts.within_gradient(m.emb) is True
    with torch.no_grad():
        assert ts.within_gradient(m.emb) is False


def test_summary_tied_to_always_names_a_shown_row():
    blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))
    blocks[3].weight = blocks[1].weight  # block 1 owns it, block 3 reuses it
    s = ts.summary(blocks)
    shown = {r.path for r in s.rows}
    assert [r.tied_to for r in s.rows if r.tied_to] == ["1.weight"]
    assert "1.weight" in shown  # shown as '0–2: Linear ×3' with block 0's rows only
