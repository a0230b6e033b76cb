"""Flag contexts and activation checkpointing (reentrant or not): a checkpoint's recomputation
in backward runs with the flags of its forward, also when the context was left in between (a
decorated training step whose loss is backpropagated after it returns), and a change of the
tree registered between the forward and the backward waits for the next forward outside the
backward."""
import contextlib
import copy
import gc
import os
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import torchstruct as ts
from _flags import flags
from _models import Checkpointed as Net, Grows, grads, same_grads

os.environ.setdefault("HF_HUB_OFFLINE", "1")

FORWARD = torch.utils.checkpoint.CheckpointFunction.__dict__["forward"]


def X(seed=0):
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))


def backward_after(make_context, mode, before=None):
    """Loss computed under a decorated context, backward after it returns: the gradients."""
    m = Net(mode)
    if before is not None:
        before(m)

    @make_context(m)
    def step(x):
        return m(x).pow(2).mean()

    step(X()).backward()
    return m, grads(m)


CONTEXTS = {
    "freeze": (lambda m: ts.freeze(m, "mid"), None),
    "freeze_except": (lambda m: ts.freeze_except(m, "out"), None),
    "unfreeze (mid frozen by hand)": (lambda m: ts.unfreeze(m, "mid"),
                                      lambda m: m.mid.requires_grad_(False)),
    "unfreeze (mid frozen by a bare freeze)": (lambda m: ts.unfreeze(m, "mid.0"),
                                               lambda m: ts.freeze(m, "mid")),
}


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("name", list(CONTEXTS))
def test_backward_after_the_block_gives_the_gradients_of_the_forward(name, reentrant):
    make, before = CONTEXTS[name]
    plain, want = backward_after(make, None, before)
    ckpt, got = backward_after(make, reentrant, before)
    same_grads(got, want)
    assert flags(ckpt) == flags(plain)  # the recomputation's flags are put back


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_context_on_the_whole_model_is_kept_for_the_recomputation(reentrant):
    """No selector: the context decides for every parameter of its model."""
    plain, want = backward_after(lambda m: ts.freeze(m.mid), None)
    ckpt, got = backward_after(lambda m: ts.freeze(m.mid), reentrant)
    same_grads(got, want)
    assert all(g is None for k, g in got.items() if k.startswith("mid"))
    assert flags(ckpt) == flags(plain)


def test_a_function_bound_to_no_module_recomputes_with_the_flags_of_the_forward():
    """Shapes chosen so that torch's own check (shapes, dtypes, devices of the saved tensors)
    would not see the other tensors a recomputation with other flags saves."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4, bias=False)
    h = torch.randn(4, 4, requires_grad=True)
    w = lin.weight.detach()
    want, = torch.autograd.grad(torch.tanh(torch.tanh(h) @ w.T).pow(2).sum(), h)
    for make in (ts.freeze, ts.stop_gradient):
        global _LAYER
        _LAYER = lin  # the function reaches the layer through a global name only
        with make(lin):
            y = checkpoint(_segment, h, use_reentrant=False)
        # after the block: recomputed with its flags (freeze) or inside it (stop_gradient)
        got, = torch.autograd.grad(y.pow(2).sum(), h)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        with make(lin):  # backward inside the block: recomputed inside it
            y = checkpoint(_segment, h, use_reentrant=False)
            got, = torch.autograd.grad(y.pow(2).sum(), h)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("backward_inside", [True, False])
def test_a_forward_that_applies_a_waiting_change_recomputes_with_the_flags_it_applied(
        reentrant, backward_inside):
    """A layer added inside the block waits, frozen by the block's rule, for the next forward;
    that forward runs checkpointed: its recomputation sees the layer frozen as the forward
    did. A batch of 3 on 3-wide layers: the saved tensors of a recomputation with the layer
    still trainable have the same shapes, so torch's own check would not see them."""
    def run(mode):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3))
        ts.attach(m)
        x = torch.randn(3, 3, requires_grad=True)
        with pytest.warns(ts.RestoredFlagsWarning, match="'2.weight', '2.bias'"):
            with ts.freeze_except(m, "0"):
                m[2] = nn.Linear(3, 3)  # added inside the block: frozen at the next forward
                y = m(x) if mode is None else checkpoint(m, x, use_reentrant=mode)
                assert not m[2].weight.requires_grad
                if backward_inside:
                    y.square().sum().backward()
        if not backward_inside:
            y.square().sum().backward()
        return m, grads(m), x.grad

    plain, want, want_x = run(None)
    ckpt, got, got_x = run(reentrant)
    same_grads(got, want)
    torch.testing.assert_close(got_x, want_x, rtol=0, atol=0)
    assert got["2.weight"] is None
    assert flags(ckpt) == flags(plain)


@pytest.mark.parametrize("context", [False, True])
@pytest.mark.parametrize("reentrant", [None, True, False])
def test_a_change_registered_between_forward_and_backward_waits_for_the_next_forward(
        reentrant, context):
    m = Grows()
    ts.attach(m)
    x = torch.randn(3, 3, requires_grad=True)
    with ts.unfreeze(m, "a") if context else contextlib.nullcontext():
        y = m(x) if reentrant is None else checkpoint(m, x, use_reentrant=reentrant)
        m.extra["head"] = nn.Linear(3, 3)  # b frozen at the next application
        y.square().sum().backward()  # the recomputation is no application
        assert m.b.weight.requires_grad and m.b.weight.grad is not None
    got = grads(m)
    plain = Grows()
    plain(x.detach()).square().sum().backward()
    for name in ("a.weight", "a.bias", "b.weight", "b.bias"):
        assert torch.equal(got[name], plain.get_parameter(name).grad), name
    m(x)  # the next forward applies (or the context's exit did)
    assert not m.b.weight.requires_grad and m.extra.head.weight.requires_grad


def test_a_forward_inside_a_backward_hook_does_not_apply_a_waiting_change():
    m = Grows()
    ts.attach(m)
    x = torch.randn(3, 3, requires_grad=True)
    seen = []

    def hook(grad):
        m(torch.randn(3, 3))  # a model run from a gradient hook, inside the backward
        seen.append(m.b.weight.requires_grad)
        return grad

    y = m(x)
    y.register_hook(hook)
    m.extra["head"] = nn.Linear(3, 3)
    y.sum().backward()
    assert seen == [True] and m.b.weight.grad is not None
    m(x)
    assert not m.b.weight.requires_grad


def test_inside_the_block_nothing_changes():
    for mode in (None, True):
        m = Net(mode)
        with ts.freeze(m, "mid"):
            m(X()).pow(2).mean().backward()
        if mode is None:
            want = grads(m)
        else:
            same_grads(grads(m), want)
    assert all(g is None for k, g in want.items() if k.startswith("mid"))


_LAYER = None


def _segment(h):
    return torch.tanh(_LAYER(torch.tanh(h)))



def test_several_steps_and_an_optimizer_match_the_plain_model():
    models = {}
    for mode in (None, True):
        m = Net(mode)
        opt = ts.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

        @ts.freeze(m, "mid.0")
        def step(x):
            return m(x).pow(2).mean()

        for i in range(3):
            opt.zero_grad()
            step(X(i)).backward()
            opt.step()
        models[mode] = m
    for (n, a), b in zip(models[None].named_parameters(), models[True].parameters()):
        assert torch.equal(a, b), n
    assert torch.equal(models[True].mid[0].weight, Net(None).mid[0].weight)  # never moved


def test_the_forward_is_torch_s_own_when_no_context_is_active():
    gc.collect()  # models of earlier tests holding a bare context
    m = Net(True)
    with ts.freeze(m, "mid"):
        assert torch.utils.checkpoint.CheckpointFunction.__dict__["forward"] is not FORWARD
    assert torch.utils.checkpoint.CheckpointFunction.__dict__["forward"] is FORWARD
    with pytest.raises(ValueError):
        with ts.freeze(m, "nothing.here"):
            pass
    assert torch.utils.checkpoint.CheckpointFunction.__dict__["forward"] is FORWARD


def test_a_checkpoint_that_records_nothing_keeps_its_function():
    m = Net(True)
    with ts.freeze(m, "inp"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: none of the inputs requires grad
        out = m(X())
    out.pow(2).mean().backward()
    assert m.mid[0].weight.grad is None and m.out.weight.grad is not None


def test_hf_gpt2_reentrant_checkpointing_with_a_decorated_freeze_except():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=16,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    out = {}
    for ckpt in (False, True):
        m = copy.deepcopy(base)
        m.train()
        m.config.use_cache = False
        if ckpt:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                m.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": True})
            m.enable_input_require_grads()  # else a frozen bottom leaves the checkpoints dead

        @ts.freeze_except(m, "transformer.h.1.*", "transformer.ln_f.*")
        def step():
            return m(input_ids=ids, labels=ids).loss

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            step().backward()
        out[ckpt] = grads(m)
    assert any(g is not None for k, g in out[True].items() if ".h.1." in k)
    assert all(g is None for k, g in out[True].items() if ".h.0." in k)
    for k in out[False]:
        assert (out[False][k] is None) == (out[True][k] is None), k
        if out[False][k] is not None:
            torch.testing.assert_close(out[True][k], out[False][k], rtol=1e-5, atol=1e-7)


def test_the_non_reentrant_recomputation_is_followed_on_this_torch():
    """The generator torch's non-reentrant checkpoint recomputes through is found (its name
    changed in torch 2.14): without it, recomputations after a context or block ends would run
    with other flags (torchstruct then warns)."""
    from torchstruct import _checkpoints

    assert _checkpoints._GENERATOR is not None
    assert getattr(torch.utils.checkpoint, _checkpoints._GENERATOR_NAME) in (
        _checkpoints._GENERATOR, _checkpoints._generator)
