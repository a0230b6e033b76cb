"""Outside-eyes audit: waiting changes of the tree, activation-checkpoint recomputations, and
structural gradients around frozen normalization layers.

What is checked:

1. a non-reentrant checkpoint recomputes with the flags its forward *ended* with (also when the
   forward applied a waiting change), whatever flag context was active, with ``with`` or bare,
   for ``torch.utils.checkpoint``, ``checkpoint_sequential``, torch's composable checkpoint,
   nested checkpoints and HF ``gradient_checkpointing_enable``;
2. a forward inside a backward (a recomputation, a model called from a gradient or module
   backward hook, ``functional_call`` there) applies nothing: a registration made between the
   forward and the backward waits for the next forward outside the backward;
3. ``structural_grad`` / ``value_and_grad`` asking for the parameters of a normalization layer
   torchstruct holds frozen keep it held: value equal to ``loss(model)``, running statistics
   untouched, gradient equal to that of the layer in eval mode; and after the call it is still
   held;
4. a registration into a module that joined the attached tree since the last application is
   one into the tree (a forward of that module applies it first);
5. ``wrt=None`` on a model with nothing trainable raises ``ValueError`` before the loss runs.

Oracle: plain PyTorch. The same model without checkpointing (or with the flags written by
hand), ``.backward()`` on a ``copy.deepcopy``, eval-mode normalization for held layers, and
``torch.autograd.grad``. Square layers and batches of 3 are used where a recomputation with
other flags would save tensors of the same shapes, so only the values can tell.
"""
import contextlib
import copy
import os
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import torchstruct as ts
from _models import Grows

os.environ.setdefault("HF_HUB_OFFLINE", "1")


# ----------------------------------------------------------------------------- helpers
def rand(*shape, seed=0, grad=False):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return t.requires_grad_(grad)


def grads(m):
    return {n: None if p.grad is None else p.grad.clone() for n, p in m.named_parameters()}


def flags(m):
    return {n: p.requires_grad for n, p in m.named_parameters()}


def same_grads(got, want):
    assert set(got) == set(want)
    for name in want:
        assert (got[name] is None) == (want[name] is None), name
        if want[name] is not None:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


def reads_agree(m):
    for name, p in m.named_parameters():
        assert ts.is_trainable(m, name) == p.requires_grad, name


@contextlib.contextmanager
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def plain_grows(frozen=(), seed=0):
    """The oracle for :class:`Grows`: the same weights, flags written by hand, no hook."""
    m = Grows(seed)
    for name in frozen:
        m.get_submodule(name).requires_grad_(False)
    return m


# ============================================================================= 1. recompute flags
@pytest.mark.parametrize("bare", [False, True])
@pytest.mark.parametrize("kind", ["freeze", "unfreeze"])
def test_checkpointed_root_that_applies_a_waiting_declaration_change_recomputes_with_it(kind, bare):
    """The forward of the checkpointed root applies the waiting change (``b`` becomes frozen);
    the context is then left and ``b`` stays frozen, ``a`` moves: the recomputation must run
    with the flags the forward ended with."""
    m = Grows()
    ts.attach(m)
    if kind == "unfreeze":
        m.a.requires_grad_(False)  # a starting flag of our own: the context turns it on
    x = rand(3, 3, grad=True)
    m.extra["head"] = nn.Linear(3, 3)  # waiting: b frozen at the next application
    ctx = ts.freeze(m, "a") if kind == "freeze" else ts.unfreeze(m, "a")
    if bare:
        y = checkpoint(m, x, use_reentrant=False)
        at_forward = flags(m)
        ctx.__exit__(None, None, None)
    else:
        with ctx:
            y = checkpoint(m, x, use_reentrant=False)
            at_forward = flags(m)
    assert at_forward["b.weight"] is False
    assert flags(m)["a.weight"] is not at_forward["a.weight"]  # moved after the forward
    y.square().sum().backward()
    got, gx = grads(m), x.grad.clone()

    # the oracle: the forward's flags written by hand, then the flags of the backward (a leaf
    # turned off since gets no .grad: PyTorch skips its accumulation)
    ref = plain_grows()
    ref.extra["head"] = copy.deepcopy(m.extra["head"])
    for n, p in ref.named_parameters():
        p.grad = None
        p.requires_grad_(at_forward[n])
    x2 = x.detach().clone().requires_grad_()
    out = ref(x2)
    for n, p in ref.named_parameters():
        p.requires_grad_(flags(m)[n])
    out.square().sum().backward()
    same_grads(got, grads(ref))
    torch.testing.assert_close(gx, x2.grad, rtol=0, atol=0)
    reads_agree(m)


class Outer(nn.Module):
    """A root whose forward runs a nested non-reentrant checkpoint around ``mid``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.inp = nn.Linear(3, 3)
        self.mid = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3))
        self.out = nn.ModuleList([nn.Linear(3, 3)])

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = checkpoint(self.mid, h, use_reentrant=False)
        for layer in self.out:
            h = layer(h)
        return h


def test_nested_checkpoints_after_a_waiting_change_and_a_left_context():
    """Outer checkpoint of the root (applies the waiting layer: frozen by ``freeze_except``),
    inner checkpoint of ``mid`` (frozen by the context); backward after the context: both
    recomputations see the forward's flags."""
    m = Outer()
    x = rand(3, 3, grad=True)
    with quiet():
        with ts.freeze_except(m, "inp", "out.0"):
            m.out.append(nn.Linear(3, 3))  # waiting: not selected, frozen at the next forward
            y = checkpoint(m, x, use_reentrant=False)
            at_forward = flags(m)
    assert at_forward["out.1.weight"] is False and at_forward["mid.0.weight"] is False
    assert all(flags(m).values())  # restored
    y.square().sum().backward()

    ref = copy.deepcopy(m)
    ts.detach_hooks(ref)
    for n, p in ref.named_parameters():
        p.requires_grad_(at_forward[n])
        p.grad = None
    x2 = x.detach().clone().requires_grad_()
    ref(x2).square().sum().backward()
    same_grads(grads(m), grads(ref))
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=0)


def test_checkpointed_lambda_over_the_model_reads_the_flags_after_the_forward():
    """The checkpointed function is a closure over the root (``lambda x: m(x)``)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3))
    x = rand(3, 3, grad=True)
    with quiet():
        ctx = ts.freeze_except(m, "0")
        m.append(nn.Linear(3, 3))
        y = checkpoint(lambda t: m(t), x, use_reentrant=False)
        assert not m[3].weight.requires_grad
        ctx.__exit__(None, None, None)
    assert m[3].weight.requires_grad and m[2].weight.requires_grad
    y.square().sum().backward()
    assert m[3].weight.grad is None and m[2].weight.grad is None
    ref = copy.deepcopy(m)
    ts.detach_hooks(ref)
    for i, layer in enumerate(ref):
        for p in layer.parameters():
            p.grad = None
            p.requires_grad_(i == 0)
    x2 = x.detach().clone().requires_grad_()
    ref(x2).square().sum().backward()
    same_grads(grads(m), grads(ref))


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpoint_sequential_in_a_decorated_step(reentrant):
    """``checkpoint_sequential`` runs the root's children, not the root: its segments
    recompute with the step's flags after the decorated step returned."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3))
    x = rand(3, 3, grad=True)

    @ts.freeze(m, "2")
    def step(t):
        return checkpoint_sequential(m, 2, t, use_reentrant=reentrant).square().sum()

    step(x).backward()
    got = grads(m)
    ref = copy.deepcopy(m)
    ts.detach_hooks(ref)
    for p in ref.parameters():
        p.grad = None
    ref[2].requires_grad_(False)
    x2 = x.detach().clone().requires_grad_()
    ref(x2).square().sum().backward()
    same_grads(got, grads(ref))
    assert got["2.weight"] is None and all(flags(m).values())


def test_composable_checkpoint_recomputes_with_the_flags_the_forward_ended_with():
    from torch.distributed._composable import checkpoint as composable

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3))
    composable(m)
    x = rand(3, 3, grad=True)
    with quiet():
        ctx = ts.freeze_except(m, "0")
        m.append(nn.Linear(3, 3))  # waiting: frozen at the next forward
        y = m(x)
        assert not m[3].weight.requires_grad
        ctx.__exit__(None, None, None)
    y.square().sum().backward()
    assert m[2].weight.grad is None and m[3].weight.grad is None
    assert m[0].weight.grad is not None


@pytest.fixture(scope="module")
def gpt2_parts():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers, cfg


@pytest.mark.parametrize("reentrant", [True, False])
def test_hf_gradient_checkpointing_with_lora_added_after_attaching(gpt2_parts, reentrant):
    """GPT-2 with HF checkpointing, LoRA injected after the model was attached (a waiting
    change applied by the step's forward), a decorated step, backward after it: the same
    gradients as the same model without checkpointing."""
    peft = pytest.importorskip("peft")
    transformers, cfg = gpt2_parts
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))

    def build(ck):
        m = copy.deepcopy(base)
        ts.attach(m)
        lora = peft.LoraConfig(r=2, target_modules=["c_attn"], lora_dropout=0.0,
                               init_lora_weights=False)
        torch.manual_seed(1)
        peft.inject_adapter_in_model(lora, m)
        if ck:
            m.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        m.train()

        @ts.freeze(m, "transformer.h.0.*", "transformer.wte")
        def step():
            return m(ids, labels=ids).loss

        step().backward()
        return m

    with quiet():
        plain, ck = build(False), build(True)
    want, got = grads(plain), grads(ck)
    assert got["transformer.h.0.attn.c_attn.lora_A.default.weight"] is None
    assert got["transformer.h.1.attn.c_attn.lora_A.default.weight"] is not None
    for name in want:
        assert (got[name] is None) == (want[name] is None), name
        if want[name] is not None:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
    assert flags(ck) == flags(plain)


# ============================================================================= 2. no application in backward
class Sub(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.enc = Grows()
        self.dec = nn.Linear(3, 3)

    def forward(self, x):
        return self.dec(self.enc(x))


@pytest.mark.parametrize("bare_context", [False, True])
@pytest.mark.parametrize("reentrant", [True, False])
def test_registration_below_the_root_between_forward_and_backward_waits(reentrant, bare_context):
    """A registration into the checkpointed encoder between the forward and the backward
    (it puts a below-root hook on the encoder): the encoder's recomputation applies nothing,
    so ``enc.b`` gets its gradient as without checkpointing; the encoder's next forward
    outside the backward applies."""
    m = Sub()
    ts.attach(m)
    x = rand(3, 3, grad=True)
    ctx = ts.freeze(m, "dec.bias") if bare_context else contextlib.nullcontext()
    y = m.dec(checkpoint(m.enc, x, use_reentrant=reentrant))
    m.enc.extra["head"] = nn.Linear(3, 3)
    y.square().sum().backward()
    assert m.enc.b.weight.requires_grad
    if bare_context:
        with pytest.warns(ts.RestoredFlagsWarning, match="'dec.bias'"):  # the tree grew
            ctx.__exit__(None, None, None)
    got = grads(m)
    ref = Sub()
    if bare_context:
        ref.dec.bias.requires_grad_(False)
    ref(x.detach()).square().sum().backward()
    for name, g in grads(ref).items():
        assert (got[name] is None) == (g is None), name
        if g is not None:
            torch.testing.assert_close(got[name], g, rtol=0, atol=0, msg=name)
    m.enc(x)
    assert not m.enc.b.weight.requires_grad
    reads_agree(m)


@pytest.mark.parametrize("ck", [None, True, False])
def test_retain_graph_two_backwards_around_a_registration(ck):
    """Backward, registration (b frozen at the next application), backward again: both
    backwards give the gradients of the forward (twice accumulated); the next forward
    outside the backward applies."""
    m = Grows()
    ts.attach(m)
    x = rand(3, 3, grad=True)
    y = m(x) if ck is None else checkpoint(m, x, use_reentrant=ck)
    loss = y.square().sum()
    loss.backward(retain_graph=True)
    m.extra["head"] = nn.Linear(3, 3)
    loss.backward()
    assert m.b.weight.requires_grad  # not applied by a recomputation
    ref = plain_grows()
    l2 = ref(x.detach()).square().sum()
    l2.backward(retain_graph=True)
    l2.backward()
    got = grads(m)
    for name, g in grads(ref).items():
        torch.testing.assert_close(got[name], g, rtol=0, atol=0, msg=name)
    m(x)
    assert not m.b.weight.requires_grad and m.extra.head.weight.requires_grad
    reads_agree(m)


def test_model_called_from_a_module_backward_hook_applies_nothing():
    m = Grows()
    ts.attach(m)
    other = Grows(seed=3)
    seen = []

    def hook(module, grad_in, grad_out):
        out = m(rand(3, 3, seed=5))  # the attached model, inside the backward
        seen.append((m.b.weight.requires_grad, out.shape))

    other.register_full_backward_hook(hook)
    x = rand(3, 3, grad=True)
    out = other(x)
    m.extra["head"] = nn.Linear(3, 3)
    out.sum().backward()
    assert seen == [(True, (3, 3))]
    m(x)
    assert not m.b.weight.requires_grad


def test_functional_call_inside_a_gradient_hook_applies_nothing():
    m = Grows()
    ts.attach(m)
    x = rand(3, 3, grad=True)
    seen = []
    params = {n: p.detach().clone() for n, p in m.named_parameters()}

    def hook(grad):
        out = torch.func.functional_call(m, params, (rand(3, 3, seed=2),))
        seen.append((m.b.weight.requires_grad, out.shape))
        return grad

    y = m(x)
    y.register_hook(hook)
    m.extra["head"] = nn.Linear(3, 3)
    y.sum().backward()
    assert seen == [(True, (3, 3))]
    assert m.b.weight.grad is not None
    m(x)
    assert not m.b.weight.requires_grad


@pytest.mark.parametrize("reentrant", [True, False])
def test_context_entered_inside_the_checkpointed_function_with_a_change_waiting_is_refused(
        reentrant):
    """The recomputation enters the decorated function's context again; entering it would
    apply the registration made between the forward and the backward (b frozen half-way
    through the backward: no gradient with a reentrant checkpoint, torch's CheckpointError
    without). Refused with a RuntimeError that says why, no flag changed; the next forward
    outside applies the change."""
    m = Grows()
    ts.attach(m)
    x = rand(3, 3, grad=True)

    @ts.unfreeze(m, "a")  # a decorated function as the checkpointed function
    def fn(t):
        return m(t)

    y = checkpoint(fn, x, use_reentrant=reentrant)
    m.extra["head"] = nn.Linear(3, 3)  # registered between the forward and the backward
    before = flags(m)
    with pytest.raises(RuntimeError, match="inside a backward .* registered since"):
        y.square().sum().backward()
    assert flags(m) == before and m.b.weight.requires_grad
    m(x)
    assert not m.b.weight.requires_grad and m.extra.head.weight.requires_grad
    # without a change waiting, the same recomputation runs as the forward did
    y = checkpoint(fn, x, use_reentrant=reentrant)
    y.square().sum().backward()
    assert m.a.weight.grad is not None and m.b.weight.grad is None


@pytest.mark.parametrize("ck", [None, True])
def test_structural_grad_from_a_gradient_hook_with_a_change_waiting_is_refused(ck):
    """structural_grad from a gradient hook would apply the registration made between the
    forward and the backward (b frozen half-way through: its .grad silently skipped). Refused
    with a RuntimeError, nothing changed."""
    m = Grows()
    ts.attach(m)
    x = rand(3, 3, grad=True)

    def hook(grad):
        with torch.enable_grad():  # a penalty term computed in the hook
            ts.structural_grad(m, lambda mm: mm(rand(3, 3, seed=4)).sum(), wrt="a")
        return grad

    h = torch.tanh(x)
    y = m(h) if ck is None else checkpoint(m, h, use_reentrant=ck)
    y.register_hook(hook)
    m.extra["head"] = nn.Linear(3, 3)  # registered between the forward and the backward
    before = flags(m)
    with pytest.raises(RuntimeError, match="inside a backward"):
        y.square().sum().backward()
    assert flags(m) == before


def test_structural_grad_from_a_gradient_hook_without_a_change_waiting():
    m = Grows()
    ts.attach(m)
    x = rand(3, 3, grad=True)
    inner = []

    def hook(grad):
        with torch.enable_grad():
            inner.append(ts.structural_grad(m, lambda mm: mm(rand(3, 3, seed=4)).sum(),
                                            wrt="a"))
        return grad

    y = m(torch.tanh(x))
    y.register_hook(hook)
    y.square().sum().backward()
    ref = plain_grows()
    want = torch.autograd.grad(ref(rand(3, 3, seed=4)).sum(), [ref.a.weight, ref.a.bias])
    torch.testing.assert_close(inner[0]["a"]["weight"], want[0], rtol=0, atol=0)
    ref(torch.tanh(x.detach())).square().sum().backward()
    same_grads(grads(m), grads(ref))


# ============================================================================= 3. held norms
def norm_net(kind="bn1d", seed=0):
    torch.manual_seed(seed)
    if kind == "bn1d":
        norm = nn.BatchNorm1d(3)
    elif kind == "in1d":
        norm = nn.InstanceNorm1d(3, affine=True, track_running_stats=True)
    elif kind == "sync":
        norm = nn.SyncBatchNorm(3)
    else:
        raise ValueError(kind)
    width = 4 if kind == "in1d" else 3  # instance norm: (N, C=3, L=4), Linear over L
    net = nn.Sequential(nn.Linear(width, width), norm, nn.Linear(width, 1))
    with torch.no_grad():
        norm.running_mean.fill_(0.5)
        norm.running_var.fill_(2.0)
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    return net


def norm_input(kind):
    x = rand(8, 3, seed=7)
    return x.unsqueeze(-1).expand(8, 3, 4).contiguous() if kind == "in1d" else x


def loss_of(m, x):
    return m(x).square().mean()


def eval_oracle(kind, x, wrt_names):
    """The layer in eval mode, the rest as is: value and the gradients of ``wrt_names``."""
    ref = norm_net(kind)
    ref[1].eval()
    value = loss_of(ref, x)
    ps = [ref.get_parameter(n) for n in wrt_names]
    return value.detach(), torch.autograd.grad(value, ps), ref[1].running_mean.clone()


HOLDERS = {
    "freeze with": lambda net: ts.freeze(net, "1"),
    "freeze_except bare": lambda net: ts.freeze_except(net, "0", "2"),
    "declaration": lambda net: ts.mark_trainable(net, "0", "2") or contextlib.nullcontext(),
}


@pytest.mark.parametrize("wrt", ["1", "1.weight"])
@pytest.mark.parametrize("holder", list(HOLDERS))
@pytest.mark.parametrize("kind", ["bn1d", "in1d", "sync"])
def test_asking_for_a_held_norm_keeps_it_held(kind, holder, wrt):
    net = norm_net(kind)
    x = norm_input(kind)
    ctx = HOLDERS[holder](net)
    names = [n for n, _ in net.named_parameters() if n == wrt or n.startswith(wrt + ".")]
    value, want, stats = eval_oracle(kind, x, names)
    got_value, g = ts.value_and_grad(loss_of, net, x, wrt=wrt)
    torch.testing.assert_close(got_value, value, rtol=0, atol=0)
    torch.testing.assert_close(net[1].running_mean, stats, rtol=0, atol=0)
    flat = ts.tree.to_flat_dict(g)
    assert sorted(flat) == sorted(names)
    for n, w in zip(names, want):
        torch.testing.assert_close(flat[n], w, rtol=1e-6, atol=1e-7, msg=n)
    assert not net[1].weight.requires_grad and net[1].training
    loss_of(net, x)  # still held after the call
    torch.testing.assert_close(net[1].running_mean, stats, rtol=0, atol=0)
    if hasattr(ctx, "__exit__"):
        ctx.__exit__(None, None, None)


def test_held_norm_with_create_graph_and_nested_calls():
    net = norm_net()
    x = norm_input("bn1d")
    ts.freeze(net, "1")
    value, want, stats = eval_oracle("bn1d", x, ["1.weight", "1.bias"])
    g = ts.structural_grad(net, lambda m: loss_of(m, x), wrt="1", create_graph=True)
    torch.testing.assert_close(g["1"]["weight"], want[0], rtol=1e-6, atol=1e-7)
    inner = []

    def outer_loss(m):
        inner.append(ts.structural_grad(m, lambda mm: loss_of(mm, x), wrt="1.bias"))
        return loss_of(m, x)

    g2 = ts.structural_grad(net, outer_loss, wrt="0")
    torch.testing.assert_close(inner[0]["1"]["bias"], want[1], rtol=1e-6, atol=1e-7)
    ref = norm_net()
    ref[1].eval()
    loss_of(ref, x).backward()
    torch.testing.assert_close(g2["0"]["weight"], ref[0].weight.grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(net[1].running_mean, stats, rtol=0, atol=0)


@pytest.mark.parametrize("reentrant", [True, False])
def test_held_norm_inside_a_checkpoint(reentrant):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = norm_net()

        def forward(self, x):
            h = self.body[0](x)
            h = checkpoint(self.body[1], h, use_reentrant=reentrant)
            return self.body[2](h)

    net = Net()
    x = norm_input("bn1d").requires_grad_()  # the checkpoint's input records
    ts.freeze(net, "body.1")
    value, want, stats = eval_oracle("bn1d", x, ["1.weight", "1.bias"])
    v, g = ts.value_and_grad(loss_of, net, x, wrt="body.1")
    torch.testing.assert_close(v, value, rtol=0, atol=0)
    torch.testing.assert_close(g["body"]["1"]["weight"], want[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(g["body"]["1"]["bias"], want[1], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(net.body[1].running_mean, stats, rtol=0, atol=0)


def test_norm_opted_out_is_not_held_when_asked():
    net = norm_net()
    ts.attach(net, freeze_norm_stats=False)
    x = norm_input("bn1d")
    ts.freeze(net, "1")
    ref = norm_net()
    v_ref = loss_of(ref, x)
    v, _ = ts.value_and_grad(loss_of, net, x, wrt="1")
    torch.testing.assert_close(v, v_ref.detach(), rtol=0, atol=0)
    torch.testing.assert_close(net[1].running_mean, ref[1].running_mean, rtol=0, atol=0)


@pytest.mark.parametrize("wrt", ["1", "0"])
def test_unfreezing_a_held_norm_inside_the_loss_unholds_it_as_loss_model_does(wrt):
    def loss(m):
        with ts.unfreeze(m, "1"):
            return loss_of(m, x)

    x = norm_input("bn1d")
    ref = norm_net()
    ts.freeze(ref, "1")
    v_ref = loss(ref)
    assert not torch.equal(ref[1].running_mean, torch.full((3,), 0.5))  # unheld: updated
    net = norm_net()
    ts.freeze(net, "1")
    v, _ = ts.value_and_grad(loss, net, wrt=wrt)
    torch.testing.assert_close(net[1].running_mean, ref[1].running_mean, rtol=0, atol=0)
    torch.testing.assert_close(v, v_ref.detach(), rtol=0, atol=0)


LOSS_CHANGES = {
    # a context entered on another part of the model inside the loss (an application)
    "context inside the loss": lambda m: ts.freeze(m, "2"),
    # a module registered inside the loss: the root's forward applies it
    "registration inside the loss": lambda m: (m.add_module("extra", nn.Linear(1, 1))
                                               if not hasattr(m, "extra") else None)
    or contextlib.nullcontext(),
}


@pytest.mark.parametrize("change", list(LOSS_CHANGES))
def test_application_inside_the_loss_keeps_the_asked_norm_held(change):
    x = norm_input("bn1d")

    def loss(m):
        with LOSS_CHANGES[change](m):
            return loss_of(m, x)

    ref = norm_net()
    ts.freeze(ref, "1")
    with quiet():
        v_ref = loss(ref).detach()
        net = norm_net()
        ts.freeze(net, "1")
        v, _ = ts.value_and_grad(loss, net, wrt="1")
    torch.testing.assert_close(net[1].running_mean, ref[1].running_mean, rtol=0, atol=0)
    torch.testing.assert_close(v, v_ref, rtol=0, atol=0)


def test_norm_is_still_held_after_a_call_whose_loss_entered_a_context():
    x = norm_input("bn1d")
    net = norm_net()
    ts.freeze(net, "1")

    def loss(m):
        with ts.freeze(m, "2"):
            return loss_of(m, x)

    ts.value_and_grad(loss, net, wrt="1")
    assert not net[1].weight.requires_grad
    before = net[1].running_mean.clone()
    net(x)  # a plain training forward: the frozen layer must not update
    torch.testing.assert_close(net[1].running_mean, before, rtol=0, atol=0)


@pytest.mark.parametrize("frozen, wrt", [("1", "1"), ("1", "0"), ("2", "0")])
def test_a_context_entered_inside_the_loss_decides_the_norm_as_in_loss_model(frozen, wrt):
    """The norm trains; the loss enters a context freezing ``frozen``. Frozen there (``"1"``,
    the norm asked for or held off by the call) it is held as ``loss(model)`` holds it;
    frozen elsewhere (``"2"``) it is not held, and trains again after the call."""
    x = norm_input("bn1d")

    def loss(m):
        with ts.freeze(m, frozen):
            return loss_of(m, x)

    ref = norm_net()
    ts.attach(ref)
    v_ref = loss(ref).detach()
    held = torch.equal(ref[1].running_mean, torch.full((3,), 0.5))
    assert held is (frozen == "1")
    net = norm_net()
    ts.attach(net)
    v, _ = ts.value_and_grad(loss, net, wrt=wrt)
    torch.testing.assert_close(net[1].running_mean, ref[1].running_mean, rtol=0, atol=0)
    torch.testing.assert_close(v, v_ref, rtol=0, atol=0)
    before = net[1].running_mean.clone()
    net(x)  # trainable again after the call: updates
    assert not torch.equal(net[1].running_mean, before)


# ============================================================================= 4. joined modules
def _fresh(root=None):
    torch.manual_seed(0)
    m = root if root is not None else nn.Sequential(nn.Linear(3, 3))
    ts.freeze_except(m, "0")
    return m


def test_registration_into_appended_block_applied_by_the_block():
    m = _fresh()
    block = nn.Sequential()
    m.append(block)
    block.append(nn.Linear(3, 3))
    assert block[0].weight.requires_grad  # waiting
    block(rand(2, 3))
    assert not block[0].weight.requires_grad
    reads_agree(m)


def test_registration_into_a_grandchild_applied_by_each_level():
    for which in ("inner", "outer"):
        m = _fresh()
        inner = nn.Sequential()
        outer = nn.Sequential(inner)
        m.append(outer)
        inner.append(nn.Linear(3, 3))
        (inner if which == "inner" else outer)(rand(2, 3))
        assert not inner[0].weight.requires_grad, which
        reads_agree(m)


def test_registration_into_a_block_joined_below_the_root():
    """The block joins a submodule (not the root); a layer registered into it; forwards of
    the block, then of the submodule holding it, each see the change applied."""
    for which in ("block", "enc"):
        torch.manual_seed(0)
        m = nn.ModuleDict({"enc": nn.Sequential(nn.Linear(3, 3)), "dec": nn.Linear(3, 3)})
        ts.freeze_except(m, "enc.0", "dec")
        block = nn.Sequential()
        m["enc"].append(block)
        block.append(nn.Linear(3, 3))
        m["dec"](rand(2, 3))  # a module beside the change: nothing applied
        assert block[0].weight.requires_grad
        (block if which == "block" else m["enc"])(rand(2, 3))
        assert not block[0].weight.requires_grad, which
        reads_agree(m)


def test_registration_into_a_block_added_by_moduledict_update():
    m = nn.ModuleDict({"a": nn.Linear(3, 3)})
    ts.freeze_except(m, "a")
    block = nn.Sequential()
    m.update({"b": block})
    block.append(nn.Linear(3, 3))
    block(rand(2, 3))
    assert not block[0].weight.requires_grad
    reads_agree(m)


def test_registration_into_a_block_added_then_removed_changes_nothing_of_it():
    m = _fresh()
    block = nn.Sequential()
    m.append(block)
    del m[1]
    block.append(nn.Linear(3, 3))
    block(rand(2, 3))
    assert block[0].weight.requires_grad  # not the tree's: its own flag
    m(rand(2, 3))
    assert block[0].weight.requires_grad and m[0].weight.requires_grad
    reads_agree(m)


def test_registration_into_appended_block_then_checkpointed_block_forward():
    """The joined block's forward runs under a checkpoint inside a context: applied at the
    forward, recomputed with it after the context."""
    m = _fresh()
    block = nn.Sequential()
    m.append(block)
    block.append(nn.Linear(3, 3))
    x = rand(3, 3, grad=True)
    with ts.unfreeze(m, "1.0.bias"):
        y = checkpoint(block, x, use_reentrant=False)
        assert not block[0].weight.requires_grad and block[0].bias.requires_grad
        y.square().sum().backward()
    assert block[0].weight.grad is None and block[0].bias.grad is not None


def test_registration_into_a_block_inserted_into_a_container_documented():
    """docs/freezing.md lists 'a container's insert, pop or del followed only by forwards of a
    submodule, not of the root' among what is seen at the next application only: the block
    put in by insert (no registration) is not known as joined until then, so a registration
    into it waits for the root's forward, which applies both."""
    m = _fresh()
    block = nn.Sequential()
    m.insert(1, block)
    block.append(nn.Linear(3, 3))
    assert not ts.is_trainable(m, "1.0.weight")  # reads answer for the tree as it is
    m(rand(2, 3))
    assert not block[0].weight.requires_grad


# ============================================================================= 5. nothing trainable
NOTHING = {
    "frozen by a context": lambda m: ts.freeze(m),
    "frozen by hand": lambda m: m.requires_grad_(False),
    "declaration": lambda m: ts.mark_trainable(m, "1"),  # a child without parameters
    "freeze_except of a module without parameters": lambda m: ts.freeze_except(m, "1", strict=False),
}


@pytest.mark.parametrize("how", list(NOTHING))
def test_nothing_trainable_raises_before_the_loss_runs(how):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
    NOTHING[how](m)
    before = flags(m)
    calls = []

    def loss(mm):
        calls.append(1)
        return mm(rand(2, 3)).sum()

    for call in (lambda: ts.structural_grad(m, loss),
                 lambda: ts.structural_grad(m, loss, create_graph=True),
                 lambda: ts.value_and_grad(lambda mm: loss(mm), m),
                 lambda: ts.value_and_grad(lambda mm: (loss(mm), 0), m, has_aux=True)):
        with pytest.raises(ValueError, match="trainable"):
            call()
    assert calls == [] and flags(m) == before
    with torch.no_grad():
        t = m(rand(2, 3)).sum()
    with pytest.raises(ValueError):
        ts.structural_grad(m, t)
    g = ts.structural_grad(m, loss, wrt="2")  # naming frozen parameters works
    assert ts.tree.paths(g) == ["2.weight", "2.bias"] and flags(m) == before


def test_parameterless_model_raises_before_the_loss_runs():
    calls = []
    with pytest.raises(ValueError):
        ts.value_and_grad(lambda m: calls.append(1) or m(rand(2, 3, grad=True)).sum(), nn.Tanh())
    assert calls == []


def test_trainable_only_through_a_waiting_registration_does_not_raise():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 3))
    ctx = ts.freeze(m, "0")
    m.append(nn.Linear(3, 1))  # waiting, trainable once applied
    g = ts.structural_grad(m, lambda mm: mm(rand(2, 3)).sum())
    assert ts.tree.paths(g) == ["1.weight", "1.bias"]
    with pytest.warns(ts.RestoredFlagsWarning, match="'0.weight', '0.bias'"):
        ctx.__exit__(None, None, None)
