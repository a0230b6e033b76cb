"""A change of the tree applies at the next forward of any module it is under, not only the root's.

DESIGN.md §1: submodules added later follow the declarations at the next forward. A model is
often run through a part of it (``model.encoder(x)``, ``model.get_encoder()``,
``model.transformer(ids)``): after a registration below the root, a forward of the module it
was registered into, or of any module between it and the root, applies first. The hooks that do
this exist only while the change waits, and are gone after it is applied.
"""
import copy

import pytest
import torch
from torch import nn

import torchstruct as ts
from _flags import consistent
from _models import EncDec

X = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))


def hook_counts(model):
    return [len(m._forward_pre_hooks) for m in model.modules()]


@pytest.mark.parametrize("run", ["encoder", "inner", "root"])
def test_a_layer_added_deep_applies_at_the_forward_of_any_module_above_it(run):
    m = EncDec()
    ts.freeze_except(m, "decoder")  # bare: the encoder is frozen, and what is added to it
    m(X)
    before = hook_counts(m)
    new = nn.Linear(3, 3)
    m.encoder[1].append(new)  # a registration two levels below the root
    assert new.weight.requires_grad  # not applied yet: at the next forward
    {"encoder": lambda: m.encoder(X), "inner": lambda: m.encoder[1](X),
     "root": lambda: m(X)}[run]()
    assert not new.weight.requires_grad and consistent(m)
    assert sum(hook_counts(m)) == sum(before)  # the waiting hooks are gone once applied


def test_a_forward_of_a_sibling_branch_does_not_apply():
    m = EncDec()
    ts.freeze_except(m, "decoder")
    m(X)
    new = nn.Linear(3, 3)
    m.encoder[1].append(new)
    m.decoder(torch.randn(4, 3))  # not above the change: nothing to apply there
    assert new.weight.requires_grad
    m.encoder(X)
    assert not new.weight.requires_grad and consistent(m)


def test_a_copy_made_while_a_change_waits_is_plain_pytorch():
    m = EncDec()
    ts.freeze_except(m, "decoder")
    m(X)
    m.encoder[1].append(nn.Linear(3, 3))
    cp = copy.deepcopy(m)  # carries the waiting hooks, inert there
    cp.encoder(X)
    assert cp.encoder[1][1].weight.requires_grad  # the copy is not governed
    m.encoder(X)
    assert not m.encoder[1][1].weight.requires_grad and consistent(m)
    ts.detach_hooks(cp)
    assert hook_counts(cp) == [0] * len(hook_counts(cp))


def test_detach_hooks_removes_the_waiting_hooks():
    m = EncDec()
    ts.freeze_except(m, "decoder")
    m(X)
    m.encoder[1].append(nn.Linear(3, 3))
    ts.detach_hooks(m)
    assert hook_counts(m) == [0] * len(hook_counts(m))
    m.encoder(X)  # detached: nothing applies at a forward
    assert m.encoder[1][1].weight.requires_grad


def test_a_head_added_to_gpt2s_transformer_applies_when_the_transformer_runs_alone():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 64, (2, 8))
    ts.freeze_except(model, "transformer.h.1")  # bare
    model(ids, use_cache=False)
    block = copy.deepcopy(model.transformer.h[0])
    model.transformer.h.append(block)  # registration into the ModuleList
    model.config.n_layer = 3
    model.transformer(ids, use_cache=False)  # the transformer alone, not the LM head model
    assert not any(p.requires_grad for p in block.parameters())
    assert consistent(model)


def test_a_compiled_submodule_applies_a_waiting_change():
    m = EncDec()
    ts.freeze_except(m, "decoder")
    enc = torch.compile(m.encoder, backend="eager")
    m(X)
    enc(X)
    new = nn.Linear(3, 3)
    m.encoder[1].append(new)
    enc(X)
    assert not new.weight.requires_grad and consistent(m)
    enc(X)
    assert not new.weight.requires_grad


@pytest.mark.parametrize("as_parameters", [False, True])
def test_functional_call_of_the_module_applies_the_change_waiting_below_it(as_parameters):
    m = EncDec()
    ts.freeze_except(m, "decoder")
    m(X)
    new = nn.Linear(3, 3)
    m.encoder[1].append(new)
    waiting = sum(len(mod._forward_pre_hooks) for mod in m.encoder.modules())
    assert waiting > 0
    wrap = nn.Parameter if as_parameters else (lambda t: t)
    params = {k: wrap(v.detach().clone()) for k, v in m.named_parameters()}  # stand-ins
    flags_before = {k: v.requires_grad for k, v in params.items()}
    torch.func.functional_call(m.encoder, {k[len("encoder."):]: v for k, v in params.items()
                                           if k.startswith("encoder.")}, (X,))
    # applied to the model's own parameters (as the encoder's own forward would), never to
    # the stand-ins
    assert {k: v.requires_grad for k, v in params.items()} == flags_before
    assert not new.weight.requires_grad and consistent(m)
    assert sum(len(mod._forward_pre_hooks) for mod in m.encoder.modules()) == 0


def test_a_module_at_the_address_of_one_that_left_is_not_taken_for_it():
    # docs/freezing.md: registrations anywhere else in the process cost an attached model
    # nothing; its waiting change is applied at the next application of its own tree. A
    # module freed after leaving the tree can leave its address to a new, unrelated module:
    # registrations into that one, and its forward, must not apply the change early.
    for _ in range(200):
        m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        ts.freeze_except(m, "0")  # bare: permanent
        m(torch.randn(1, 2))
        old = id(m[1])
        m[1] = nn.Linear(2, 2)  # the old layer is freed; the new one waits for m's forward
        lin = nn.Linear(2, 2)  # CPython often puts it at the freed layer's address
        if id(lin) != old:
            continue
        other = nn.Sequential(nn.Linear(2, 2))  # never attached
        other.append(lin)
        other(torch.randn(1, 2))
        assert m[1].weight.requires_grad  # still its own flag: the change waits for m
        m(torch.randn(1, 2))
        assert not m[1].weight.requires_grad
        return
    pytest.skip("no address reuse happened in 200 tries")


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_a_registration_into_a_module_added_since_the_last_application(depth):
    """A block joins the tree (waiting), then layers are registered into it and below it: the
    block's forward, or that of the deepest one, applies both, as the root's would."""
    m = nn.Sequential(nn.Linear(3, 3))
    ts.freeze_except(m, "0")  # bare: what is added later is frozen
    m(X)
    chain = [nn.Sequential(nn.Linear(3, 3))]
    m.append(chain[0])  # a registration into the root
    for _ in range(depth - 1):
        chain.append(nn.Sequential(nn.Linear(3, 3)))
        chain[-2].append(chain[-1])  # into a module that joined since the last application
    chain[-1].append(nn.Linear(3, 3))
    assert all(p.requires_grad for p in chain[0].parameters())  # waits for a forward
    chain[-1](X)
    assert not any(p.requires_grad for p in chain[0].parameters()) and consistent(m)
    assert m[0].weight.requires_grad


def test_a_registration_into_a_module_that_joined_and_left_applies_nothing_to_it():
    m = nn.Sequential(nn.Linear(3, 3))
    ts.freeze_except(m, "0")
    m(X)
    block = nn.Sequential(nn.Linear(3, 3))
    m.append(block)
    del m[1]  # left again before any application
    block.append(nn.Linear(3, 3))
    block(X)
    assert all(p.requires_grad for p in block.parameters())  # never in the tree when applied
    m(X)
    assert all(p.requires_grad for p in block.parameters()) and consistent(m)


def test_a_registration_below_a_block_added_after_the_parents_were_read():
    """The tree's parents are read at the first registration below the root; a block that
    joins after that is found above the layers registered into it."""
    m = EncDec()
    ts.freeze_except(m, "decoder")
    m(X)
    m.encoder[1].append(nn.Linear(3, 3))  # the parents are read here
    block = nn.Sequential(nn.Linear(3, 3))
    m.encoder.append(block)  # joins after
    inner = nn.Sequential()
    block.append(inner)
    inner.append(nn.Linear(3, 3))  # two levels below the block
    inner(X)
    assert not any(p.requires_grad for p in m.encoder.parameters()) and consistent(m)
