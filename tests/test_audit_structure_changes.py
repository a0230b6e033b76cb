"""An outsider's audit of three behaviours: containers changed by their own methods, a
registration below the root applied at the forward of a module above it, and reentrant
checkpoints that record nothing under ``structural_grad``.

Every case is compared with the read-only answer (``ts.trainable_parameters``), with the same
change made by registration, or with PyTorch's own ``.backward()`` (DESIGN.md §1 "Hooks make it
real", "Flags", "Errors"; docs/freezing.md "Hooks"; docs/structural.md "Activation
checkpointing"). Cases marked xfail are contradictions of the contract, kept as strict
expectations.
"""
import contextlib
import copy
import gc
import io
import os
import threading
import warnings
import weakref

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import torchstruct as ts
from _flags import consistent, flags
from _models import EncDec, Net, trainable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

X = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
CKPT_FORWARD = torch.utils.checkpoint.CheckpointFunction.__dict__["forward"]


def hook_total(model):
    return sum(len(m._forward_pre_hooks) for m in model.modules())


@contextlib.contextmanager
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# ----------------------------------------------------------------------------- 1. containers
def _several(m):
    """Several changes by the containers' own methods between two forwards, in three
    containers; returns what left."""
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    m.layers.insert(0, a)
    gone = [m.layers.pop(2)]
    m.layers.insert(1, b)
    gone += list(m.layers)[3:5]
    del m.layers[3:5]
    gone.append(m.extra.pop("b"))
    m.head.insert(1, nn.Linear(3, 3))
    return gone


def _several_by_assignment(m):
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    old = list(m.layers)
    gone = [old[1], old[2], old[3]]
    m.layers = nn.ModuleList([a, b, old[0]])
    gone.append(m.extra["b"])
    m.extra = nn.ModuleDict({"a": m.extra["a"]})
    m.head = nn.Sequential(m.head[0], nn.Linear(3, 3), m.head[1])
    return gone


@pytest.mark.parametrize("rule", ["freeze_except", "declaration", "trainable"])
def test_several_container_changes_between_two_forwards_match_reassignment(rule):
    def run(change):
        torch.manual_seed(0)
        if rule == "trainable":
            class Own(Net):
                def trainable(self):
                    return ["head"]
            m = Own()
        else:
            m = Net()
        starts = {id(p): p.requires_grad for p in m.parameters()}
        if rule == "freeze_except":
            ts.freeze_except(m, "head.1", "layers.0")
        elif rule == "declaration":
            ts.mark_trainable(m, "head")
        else:
            ts.attach(m)
        m(X)
        gone = change(m)
        m(X)
        return m, gone, starts

    m, gone, starts = run(_several)
    ref, ref_gone, _ = run(_several_by_assignment)
    assert consistent(m) and consistent(ref)
    assert len(trainable(m)) == len(trainable(ref))
    for mod in gone:
        assert flags(mod) == [starts[id(p)] for p in mod.parameters()]


def test_moduledict_clear_and_refill_by_pop_gives_flags_back():
    m = Net()
    ts.freeze_except(m, "head")
    m(X)
    a, b = m.extra["a"], m.extra["b"]
    m.extra.clear()
    m(X)
    assert consistent(m) and flags(a) == [True, True] and flags(b) == [True, True]
    m.extra.update({"c": nn.Linear(3, 3)})  # registration
    m(X)
    assert not any(flags(m.extra["c"])) and consistent(m)


def test_pop_then_insert_keeps_the_length_and_is_still_seen():
    """``pop`` rebuilds ``_modules``; ``insert`` restores the length: the identity tells."""
    m = Net()
    ts.freeze_except(m, "head")
    m(X)
    for _ in range(6):  # a reused address of the dict must not hide a change
        new = nn.Linear(3, 3)
        gone = m.layers.pop(0)
        m.layers.insert(0, new)
        m(X)
        assert not any(flags(new)), "an inserted layer kept its own flag"
        assert all(flags(gone)), "a layer that left kept the flag torchstruct wrote"
        assert consistent(m)


def test_moduledict_pop_then_registration_of_the_same_name():
    m = Net()
    ts.freeze_except(m, "head")
    m(X)
    old = m.extra.pop("a")
    m.extra["a"] = nn.Linear(3, 3)
    m(X)
    assert all(flags(old)) and not any(flags(m.extra["a"])) and consistent(m)


def test_sequential_pop_then_append_in_a_block_restores():
    m = Net()
    with quiet():
        with ts.freeze_except(m, "head.1"):
            m(X)
            gone = m.head.pop(0)
            new = nn.Linear(3, 3)
            m.head.insert(0, new)
            m(X)
            assert not any(flags(new)) and all(flags(gone)) and consistent(m)
    assert all(p.requires_grad for p in m.parameters()) and all(flags(gone))


def test_a_change_inside_nested_blocks_without_a_forward_is_undone_at_each_exit():
    m = Net()
    with quiet():
        with ts.freeze(m, "layers"):
            with ts.freeze_except(m, "head"):
                gone = m.head.pop(0)  # no forward inside: found when the blocks end
                new = nn.Linear(3, 3)
                m.layers.insert(0, new)
            assert consistent(m)
            assert all(flags(gone))
            assert not any(flags(new))  # still inside freeze(m, "layers")
        assert consistent(m) and all(p.requires_grad for p in m.parameters())
    assert all(flags(gone)) and all(flags(new))


def test_a_change_inside_a_block_then_mark_trainable_on_a_removed_layer():
    m = Net()
    ts.mark_trainable(m, "head")
    m(X)
    gone = m.head.pop(0)
    m(X)
    assert all(flags(gone)) and consistent(m)
    ts.mark_trainable(m, None)
    m(X)
    assert all(p.requires_grad for p in m.parameters())


def test_removed_modules_are_collectable_after_the_next_forward():
    m = Net()
    ts.freeze_except(m, "head")
    m(X)
    gone = m.layers.pop(1)
    refs = [weakref.ref(gone)] + [weakref.ref(p) for p in gone.parameters()]
    d = m.extra.pop("a")
    refs += [weakref.ref(d)] + [weakref.ref(p) for p in d.parameters()]
    del gone, d
    m(X)
    gc.collect()
    assert all(r() is None for r in refs)


def test_an_attached_model_is_freed_without_the_cycle_collector():
    """Plain PyTorch frees a model when its last reference goes; torchstruct's global state
    must add no reference cycle (nor a strong reference) that keeps it alive."""
    gc.collect()
    gc.disable()
    try:
        m = Net()
        ts.freeze_except(m, "head")
        m(X)
        m.layers.insert(0, nn.Linear(3, 3))
        m.encoder = EncDec()  # a registration below waits after the next line
        m(X)
        m.encoder.encoder[1].append(nn.Linear(3, 3))
        m.encoder.encoder(X)
        ref = weakref.ref(m)
        params = [weakref.ref(p) for p in m.parameters()]
        del m
        assert ref() is None
        assert all(r() is None for r in params)
    finally:
        gc.enable()


def test_an_attached_model_with_a_waiting_change_is_collectable():
    m = EncDec()
    ts.freeze_except(m, "decoder")
    m(X)
    m.encoder[1].append(nn.Linear(3, 3))  # waits: hooks below the root
    ref = weakref.ref(m)
    del m
    gc.collect()
    assert ref() is None


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


def test_gpt2_blocks_pruned_and_inserted_between_forwards(transformers):
    cfg = transformers.GPT2Config(n_layer=4, n_embd=16, n_head=2, vocab_size=32, n_positions=8)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 32, (2, 6))
    ts.freeze_except(model, "transformer.h.3", "transformer.ln_f")
    model(ids, use_cache=False)
    h = model.transformer.h
    gone = [h.pop(0), h.pop(0)]
    new = copy.deepcopy(h[0])
    h.insert(0, new)
    model.config.n_layer = len(h)
    model(ids, use_cache=False)
    assert consistent(model)
    assert all(all(flags(g)) for g in gone) and not any(flags(new))
    assert trainable(model) == sorted(
        [f"transformer.h.2.{n}" for n, _ in h[2].named_parameters()]
        + ["transformer.ln_f.bias", "transformer.ln_f.weight"])


def test_bert_encoder_layer_popped_applies_at_the_root(transformers):
    cfg = transformers.BertConfig(num_hidden_layers=3, hidden_size=16, num_attention_heads=2,
                                  intermediate_size=32, vocab_size=32,
                                  max_position_embeddings=16)
    torch.manual_seed(0)
    model = transformers.BertModel(cfg)
    ids = torch.randint(0, 32, (2, 6))
    with quiet():
        with ts.freeze_except(model, "encoder.layer.2", "pooler"):
            model(ids)
            gone = model.encoder.layer.pop(2)
            model.config.num_hidden_layers = 2
            model(ids)
            assert consistent(model) and all(flags(gone))
            assert trainable(model) == ["pooler.dense.bias", "pooler.dense.weight"]
        assert all(p.requires_grad for p in model.parameters()) and all(flags(gone))


def test_peft_lora_gpt2_with_a_block_pruned(transformers):
    peft = pytest.importorskip("peft")
    cfg = transformers.GPT2Config(n_layer=3, n_embd=16, n_head=2, vocab_size=32, n_positions=8)
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(cfg)
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["c_attn"],
                                                      fan_in_fan_out=True))
    ids = torch.randint(0, 32, (2, 6))
    lora_before = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    with quiet():
        with ts.freeze(model, "*h.0.*"):
            model(input_ids=ids, use_cache=False)
            t = model.base_model.model.transformer
            gone = t.h.pop(-1)
            t.config.n_layer = len(t.h)
            model(input_ids=ids, use_cache=False)
            assert consistent(model)
            # the popped block has its PEFT flags back: LoRA on, the base frozen
            assert [n for n, p in gone.named_parameters() if p.requires_grad] == [
                n for n, _ in gone.named_parameters() if "lora_" in n]
        assert consistent(model)
        assert sorted(n for n, p in model.named_parameters() if p.requires_grad) == \
            [n for n in lora_before if ".h.2." not in n]


def test_a_compiled_wrapper_sees_several_changes_and_a_block():
    m = Net()
    cm = torch.compile(m, backend="eager")
    with quiet():
        with ts.freeze_except(m, "head.1"):
            cm(X)
            gone = m.layers.pop(0)
            new = nn.Linear(3, 3)
            m.extra.pop("b")
            m.head.insert(0, new)
            cm(X)
            assert consistent(m) and all(flags(gone)) and not any(flags(new))
    assert all(p.requires_grad for p in m.parameters())


@pytest.mark.parametrize("how", ["insert", "pop", "del", "del slice"])
def test_the_root_itself_a_sequential_changed_by_its_own_methods(how):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 1))
    ts.freeze_except(m, m[3])
    m(X)
    new, gone = nn.Linear(3, 3), []
    if how == "insert":
        m.insert(0, new)
    elif how == "pop":
        gone = [m.pop(1)]
    elif how == "del":
        gone = [m[0]]
        del m[0]
    else:
        gone = [m[0], m[1]]
        del m[0:2]
    m(X)
    assert consistent(m) and all(all(flags(g)) for g in gone)
    assert not any(flags(new)) if how == "insert" else True
    assert trainable(m) == [f"{len(m) - 1}.bias", f"{len(m) - 1}.weight"]


def test_modules_removed_inside_a_block_are_collectable_after_it_ends():
    m = Net()
    with quiet():
        with ts.freeze_except(m, "head"):
            m(X)
            gone = m.layers.pop(1)
            refs = [weakref.ref(gone)] + [weakref.ref(p) for p in gone.parameters()]
            assert not any(flags(gone))  # kept by the block until it ends
            del gone
            m(X)
    m(X)
    gc.collect()
    assert all(r() is None for r in refs)


# ----------------------------------------------------------------------------- 2. below
class SharedEmbed(nn.Module):
    """One module reachable through two parents (a tied embedding, as T5/BART share one)."""

    def __init__(self):
        super().__init__()
        shared = nn.Sequential(nn.Linear(3, 3))
        self.encoder = nn.Sequential(shared, nn.Linear(3, 3))
        self.decoder = nn.Sequential(shared, nn.Linear(3, 1))

    def forward(self, x):
        return self.decoder(self.encoder(x)).sum()


def test_a_registration_into_a_shared_module_applies_at_the_forward_of_its_second_parent():
    m = SharedEmbed()
    ts.freeze_except(m, m.encoder[1], m.decoder[1])
    m(X)
    new = nn.Linear(3, 3)
    m.encoder[0].append(new)  # registered into the shared module
    m.decoder(X)  # a module between it and the root, by the second path
    assert not any(flags(new)) and consistent(m)


def test_a_registration_into_a_shared_module_applies_at_the_forward_of_its_first_parent():
    m = SharedEmbed()
    ts.freeze_except(m, m.encoder[1], m.decoder[1])
    m(X)
    new = nn.Linear(3, 3)
    m.decoder[0].append(new)
    m.encoder(X)
    assert not any(flags(new)) and consistent(m)


def test_a_waiting_change_applies_once_and_the_hooks_go():
    m = EncDec()
    ts.freeze_except(m, "decoder")
    m(X)
    base = hook_total(m)
    new1, new2 = nn.Linear(3, 3), nn.Linear(3, 3)
    m.encoder[1].append(new1)
    m.encoder.append(new2)
    assert hook_total(m) > base
    m.encoder(X)
    assert not any(flags(new1) + flags(new2)) and consistent(m) and hook_total(m) == base


def test_torch_save_and_load_while_a_change_waits_is_plain_pytorch():
    m = EncDec()
    ts.freeze_except(m, "decoder")
    m(X)
    m.encoder[1].append(nn.Linear(3, 3))
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    loaded.encoder(X)
    loaded(X)
    assert all(flags(loaded.encoder[1][1]))  # not governed: plain PyTorch
    assert flags(loaded.encoder) == flags(m.encoder)[:4] + [True, True]
    m.encoder(X)
    assert not any(flags(m.encoder)) and consistent(m)
    ts.detach_hooks(loaded)
    assert hook_total(loaded) == 0


def test_deepcopy_of_a_submodule_while_a_change_waits_then_original_freed():
    m = EncDec()
    ts.freeze_except(m, "decoder")
    m(X)
    new = nn.Linear(3, 3)
    m.encoder[1].append(new)
    cp = copy.deepcopy(m.encoder)
    copied = flags(cp)
    assert copied == [False] * 4 + [True, True]  # copied as they were: the change waited
    del m
    gc.collect()
    cp(X)
    assert flags(cp) == copied
    m2 = EncDec()  # a new model, maybe at a reused address, is not confused with the dead one
    ts.freeze_except(m2, "decoder")
    m2(X)
    cp(X)
    assert flags(cp) == copied and consistent(m2)


def test_two_threads_forward_different_submodules_while_a_change_waits():
    torch.manual_seed(0)
    m = EncDec()
    m.other = nn.Sequential(nn.Linear(3, 3))
    ts.freeze_except(m, "decoder")
    m(X)
    new1, new2 = nn.Linear(3, 3), nn.Linear(3, 3)
    m.encoder[1].append(new1)
    m.other.append(new2)
    errors = []
    barrier = threading.Barrier(2)

    def go(mod):
        try:
            barrier.wait()
            for _ in range(20):
                mod(X)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=go, args=(mod,)) for mod in (m.encoder, m.other)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors
    assert not any(flags(new1) + flags(new2)) and consistent(m)
    assert hook_total(m) == sum(1 for _ in [m])  # the root's hook only


class Lazy(nn.Module):
    """Registers a layer into a child during its own forward (a lazily built head)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 3))
        self.tail = nn.Sequential(nn.Linear(3, 3))

    def forward(self, x):
        if len(self.tail) == 1:
            self.tail.append(nn.Linear(3, 3))
        return self.tail(self.body(x)).sum()


def test_a_registration_inside_a_forward_is_applied_before_the_child_runs():
    m = Lazy()
    ts.freeze_except(m, "body")
    m(X)
    assert not any(flags(m.tail)) and consistent(m)
    base = hook_total(m)
    m2 = Lazy()
    ts.freeze_except(m2, "body")
    out = m2(X)
    out.backward()
    assert m2.tail[1].weight.grad is None  # frozen before the tail ran
    assert hook_total(m2) == base


def test_a_module_shared_by_two_attached_models_applies_for_both():
    shared = nn.Sequential(nn.Linear(3, 3))
    a = nn.Sequential(shared, nn.Linear(3, 1))
    b = nn.Sequential(nn.Sequential(shared), nn.Linear(3, 1))
    ts.freeze_except(a, a[1])  # the shared layer is frozen, for both
    ts.attach(b)
    a(X)
    b(X)
    base = hook_total(a) + hook_total(b)
    new = nn.Linear(3, 3)
    shared.append(new)  # registered into a module of both trees
    b[0](X)  # a forward in b alone, between the change and b's root
    assert not any(flags(new)) and consistent(a) and consistent(b)
    assert hook_total(a) + hook_total(b) == base


class Gate(nn.Module):
    """A module whose ``trainable()`` (read during an application) waits for a signal."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.entered, self.go, self.armed = threading.Event(), threading.Event(), False

    def trainable(self):
        if self.armed and threading.current_thread() is not threading.main_thread():
            self.armed = False
            self.entered.set()
            self.go.wait(10)
        return ["lin"]

    def forward(self, x):
        return self.lin(x)


class Raced(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Linear(3, 3)
        self.gate = Gate()
        self.head = nn.Linear(3, 1)

    def forward(self, x):
        return self.head(self.gate(self.block(x))).sum()


def test_a_registration_during_another_threads_application_is_not_lost():
    gc.collect()
    with ts.freeze(nn.Linear(1, 1)):  # forgets the contexts of models gone
        pass
    from torchstruct import _state
    assert not _state.entries  # with a context active, _held_again takes the lock
    m = Raced()
    ts.mark_trainable(m, "head", "gate")  # a declaration: no context is active
    m(X)
    m.gate.armed = True
    m.head.register_parameter("extra", nn.Parameter(torch.zeros(1)))  # the next forward applies
    worker = threading.Thread(target=m, args=(X,))
    worker.start()
    assert m.gate.entered.wait(10)  # the worker's application is walking the tree
    m.block.adapter = nn.Linear(3, 3)  # meanwhile, into a module already walked
    m.gate.go.set()
    worker.join(10)
    m(X)
    assert not any(flags(m.block.adapter)) and consistent(m)


# ----------------------------------------------------------------------------- 3. checkpoints
def reference_grads(model_fn, names):
    m = model_fn(False)
    m.zero_grad()
    loss = m(X)
    loss.backward()
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p))
            for n, p in m.named_parameters() if n in names}


class SeqCk(nn.Module):
    """checkpoint_sequential over a stack whose input does not require grad, then a head."""

    def __init__(self, reentrant=True):
        super().__init__()
        torch.manual_seed(0)
        self.stack = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3))
        self.head = nn.Linear(3, 1)
        self.reentrant = reentrant

    def forward(self, x):
        h = checkpoint_sequential(self.stack, 2, x, use_reentrant=self.reentrant)
        return (self.head(h) + self.head(x)).pow(2).sum()


def test_checkpoint_sequential_dead_is_an_error_and_the_head_is_exact():
    m = SeqCk()
    with quiet():
        with pytest.raises(ValueError, match=r"'stack\.\d\.(weight|bias)' is used inside"):
            ts.structural_grad(m, lambda mm: mm(X))
        g = ts.tree.to_flat_dict(ts.structural_grad(m, lambda mm: mm(X), wrt="head"))
    ref = reference_grads(SeqCk, {"head.weight", "head.bias"})
    assert sorted(g) == ["head.bias", "head.weight"]
    assert all(torch.allclose(g[n], ref[n]) for n in g)
    assert torch.utils.checkpoint.CheckpointFunction.__dict__["forward"] is CKPT_FORWARD


class Nested(nn.Module):
    """A live reentrant checkpoint (its input requires grad) holding an inner reentrant
    checkpoint whose input, during the first (no-grad) forward, requires nothing."""

    def __init__(self, reentrant=True):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 1)
        self.reentrant = reentrant

    def inner(self, u):
        return torch.tanh(self.b(u))

    def outer(self, u):
        return checkpoint(self.inner, torch.tanh(u), use_reentrant=self.reentrant)

    def forward(self, x):
        h = checkpoint(self.outer, self.a(x), use_reentrant=self.reentrant)
        return self.c(h).pow(2).sum()


def test_nested_live_reentrant_checkpoints_give_backwards_gradients():
    names = {n for n, _ in Nested().named_parameters()}
    m = Nested()
    loss_ref = reference_grads(Nested, names)
    with quiet():
        g = ts.tree.to_flat_dict(ts.structural_grad(m, lambda mm: mm(X)))
    assert sorted(g) == sorted(names)
    assert all(torch.allclose(g[n], loss_ref[n], atol=1e-6) for n in names)


class NestedDead(Nested):
    def forward(self, x):  # the outer checkpoint gets only x: dead, and so is the inner one
        h = checkpoint(self.outer, x, use_reentrant=self.reentrant)
        return (self.c(h) + self.a(x).sum(1, keepdim=True)).pow(2).sum()


def test_nested_dead_reentrant_checkpoints_name_the_inner_parameter():
    m = NestedDead()
    with quiet():
        with pytest.raises(ValueError, match=r"'b\.(weight|bias)' is used inside"):
            ts.structural_grad(m, lambda mm: mm(X))
        g = ts.tree.to_flat_dict(ts.structural_grad(m, lambda mm: mm(X), wrt=["a", "c"]))
    ref = reference_grads(NestedDead, {"a.weight", "a.bias", "c.weight", "c.bias"})
    assert all(torch.allclose(g[n], ref[n]) for n in ref)


class Derived(nn.Module):
    """A tensor derived from a parameter outside a dead reentrant checkpoint, used inside."""

    def __init__(self, reentrant=True):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.out = nn.Linear(3, 3), nn.Linear(3, 1)
        self.reentrant = reentrant

    def forward(self, x):
        w = self.lin.weight * 2  # requires grad, not a parameter
        h = checkpoint(lambda u: torch.tanh(u @ w.t()), x, use_reentrant=self.reentrant)
        return self.out(h).pow(2).sum()


def test_a_tensor_derived_from_a_parameter_used_in_a_dead_checkpoint_is_an_error():
    plain = Derived(reentrant=False)
    plain(X).backward()
    assert plain.lin.weight.grad.abs().sum() > 0  # the loss depends on lin.weight
    m = Derived()
    with quiet():
        with pytest.raises(ValueError, match="lin.weight"):
            ts.structural_grad(m, lambda mm: mm(X))


class ReadsMeta(nn.Module):
    """A dead reentrant checkpoint that only reads a parameter's dtype and shape (a cast, as
    HF code does with ``self.weight.dtype``); the parameter is used numerically outside."""

    def __init__(self, reentrant=True):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.out = nn.Linear(3, 3), nn.Linear(3, 1)
        self.reentrant = reentrant

    def forward(self, x):
        w = self.lin.weight
        inner = lambda u: torch.tanh(u.to(w.dtype) * w.shape[0])
        return self.out(self.lin(checkpoint(inner, x, use_reentrant=self.reentrant))).sum()


def test_a_dead_checkpoint_reading_only_a_parameters_dtype_is_not_an_error():
    m = ReadsMeta()
    ref = ReadsMeta(reentrant=False)
    ref(X).backward()
    with quiet():
        g = ts.tree.to_flat_dict(ts.structural_grad(m, lambda mm: mm(X)))
    assert all(torch.allclose(g[n], p.grad) for n, p in ref.named_parameters())


def test_the_checkpoint_forward_is_restored_after_a_raising_loss_and_nested_calls():
    m = SeqCk()

    def bad(mm):
        mm(X)
        raise KeyError("boom")

    with quiet():
        with pytest.raises(KeyError):
            ts.structural_grad(m, bad)
        assert torch.utils.checkpoint.CheckpointFunction.__dict__["forward"] is CKPT_FORWARD

        def outer(mm):  # a structural_grad inside the loss of another
            ts.structural_grad(mm, lambda k: k(X), wrt="head")
            assert torch.utils.checkpoint.CheckpointFunction.__dict__["forward"] \
                is not CKPT_FORWARD  # the outer watch is still on
            return mm(X)

        with pytest.raises(ValueError, match="stack"):
            ts.structural_grad(m, outer)
    assert torch.utils.checkpoint.CheckpointFunction.__dict__["forward"] is CKPT_FORWARD
    assert all(p.requires_grad for p in m.parameters())
    assert all(p.grad is None for p in m.parameters())


def test_concurrent_structural_grad_calls_in_threads():
    models = [SeqCk() for _ in range(4)]  # built here: the threads share no random generator
    refs = [copy.deepcopy(m) for m in models]
    results, errors = {}, []
    barrier = threading.Barrier(4)

    def dead(i):
        try:
            barrier.wait()
            for _ in range(5):
                with quiet():
                    with pytest.raises(ValueError, match="stack"):
                        ts.structural_grad(models[i], lambda mm: mm(X))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def live(i):
        try:
            barrier.wait()
            for _ in range(5):
                with quiet():
                    results[i] = ts.tree.to_flat_dict(
                        ts.structural_grad(models[i], lambda mm: mm(X), wrt="head"))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=f, args=(i,))
               for i, f in enumerate((dead, live, dead, live))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors, errors
    assert sorted(results) == [1, 3]
    for i, g in results.items():
        with quiet():
            refs[i](X).backward()
        assert torch.equal(g["head.weight"], refs[i].head.weight.grad)
        assert torch.equal(g["head.bias"], refs[i].head.bias.grad)
    assert all(p.grad is None and p.requires_grad for m in models for p in m.parameters())
    assert torch.utils.checkpoint.CheckpointFunction.__dict__["forward"] is CKPT_FORWARD
    from torchstruct import grad as _g
    assert _g._WATCHES == []


# ----------------------------------------------------------------------------- transforms
def _changed(where):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 3), nn.Sequential(nn.Linear(3, 3)), nn.Linear(3, 1))
    ts.freeze_except(m, m[2])
    m(X)
    new = nn.Linear(3, 3)
    if where == "container":
        m.insert(0, new)  # seen at the root's next forward
        return m, m, new
    m[1].append(new)  # a registration below: seen at m[1]'s next forward
    return m, m[1], new


@pytest.mark.parametrize("where", ["container", "below"])
def test_vmap_of_a_model_right_after_a_change_runs_as_plain_pytorch(where):
    m, run, new = _changed(where)
    plain = copy.deepcopy(run)
    ts.detach_hooks(plain)
    xs = X[None].expand(2, 4, 3)
    out = torch.func.vmap(run)(xs)
    assert torch.allclose(out, torch.func.vmap(plain)(xs))
    m(X)
    assert not any(flags(new)) and consistent(m)


@pytest.mark.parametrize("where", ["container", "below"])
def test_torch_func_grad_over_inputs_right_after_a_change_runs_as_plain_pytorch(where):
    m, run, new = _changed(where)
    plain = copy.deepcopy(run)
    ts.detach_hooks(plain)
    g = torch.func.grad(lambda x: run(x).sum())(X)
    assert torch.allclose(g, torch.func.grad(lambda x: plain(x).sum())(X))


@pytest.mark.parametrize("where", ["container", "below"])
def test_no_grad_and_inference_mode_forwards_apply_a_change(where):
    for mode in (torch.no_grad, torch.inference_mode):
        m, run, new = _changed(where)
        with mode():
            run(X)
        assert not any(flags(new)) and consistent(m)
        assert hook_total(m) == 1


def test_entering_a_block_applies_a_waiting_change_and_drops_the_hooks_below():
    m = EncDec()
    ts.freeze_except(m, "decoder")
    m(X)
    new = nn.Linear(3, 3)
    m.encoder[1].append(new)
    assert hook_total(m) > 1
    with ts.freeze(m, "decoder"):
        assert hook_total(m) == 1 and not any(flags(new)) and consistent(m)
    assert not any(flags(new)) and consistent(m)


def test_a_declaration_shifted_by_an_insert_follows_names_as_reassignment_does():
    def run(by_method):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 1))
        ts.mark_trainable(m, "2")
        m(X)
        lay = nn.Linear(3, 3)
        if by_method:
            m.insert(0, lay)
        else:
            m2 = list(m)
            for k in list(m._modules):
                delattr(m, k)
            for i, mod in enumerate([lay] + m2):
                m.add_module(str(i), mod)
        m(X)
        return trainable(m), consistent(m)

    assert run(True) == run(False) == (["2.bias", "2.weight"], True)
