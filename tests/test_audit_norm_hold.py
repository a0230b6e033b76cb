"""Audit of the hold on normalization statistics (docs/freezing.md, "Normalization statistics").

While every parameter of a ``BatchNorm*`` / ``InstanceNorm*`` layer with running statistics is
frozen *by torchstruct* (a context, a declaration), a training-mode forward must behave as the
layer in eval mode: it normalizes with the running statistics, leaves them (and
``num_batches_tracked``) untouched, and the layer's ``training`` flag is what it was before the
forward. Everything else (frozen by hand, ``freeze_norm_stats=False``, a parameter unfrozen,
``momentum=None`` switched on since the hold) is plain PyTorch.

The oracle is plain PyTorch: a ``copy.deepcopy`` of the model taken before the step (with
``ts.detach_hooks`` so torchstruct governs nothing of it), with the held layer put in eval mode by
hand and the same ``requires_grad`` flags written by hand. Running statistics and
``num_batches_tracked`` are compared bitwise; outputs and gradients with ``torch.equal`` where
the arithmetic is the same (rtol=0).
"""
from __future__ import annotations

import copy
import io
import sys
import threading

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.utils.checkpoint import checkpoint

import torchstruct as ts
from torchstruct import hooks as _hooks


# --------------------------------------------------------------------------- helpers
class Scale(nn.Module):
    """A per-channel scale (channel dim 1), so that gradients flow around the norm layer."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, c))

    def forward(self, x):
        return x * self.weight.reshape(1, -1, *([1] * (x.dim() - 2)))


class Net(nn.Module):
    def __init__(self, norm: nn.Module, c: int) -> None:
        super().__init__()
        self.pre = Scale(c)
        self.norm = norm
        self.head = Scale(c)

    def forward(self, x):
        return self.head(self.norm(self.pre(x)))


def oracle(model: nn.Module, *held: str) -> nn.Module:
    """A plain-PyTorch copy of ``model``, the ``held`` layers in eval mode by hand."""
    ref = copy.deepcopy(model)
    ts.detach_hooks(ref)
    for path in held:
        ref.get_submodule(path).eval()
    return ref


def stats(m: nn.Module) -> list[torch.Tensor]:
    return [b.detach().clone() for b in (m.running_mean, m.running_var, m.num_batches_tracked)
            if b is not None]


def same_stats(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(stats(a), stats(b), strict=True))


def grads(model: nn.Module) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def same_grads(a: nn.Module, b: nn.Module) -> bool:
    ga, gb = grads(a), grads(b)
    return ga.keys() == gb.keys() and all(torch.equal(ga[k], gb[k]) for k in ga)


def warmed(model: nn.Module, shape, steps: int = 2) -> nn.Module:
    for _ in range(steps):
        model(torch.randn(shape))
    return model


def interrupted(net: nn.Module) -> None:
    """A forward of ``net`` a KeyboardInterrupt ends inside ``net.norm``'s hooks (after
    torchstruct's pre-hook: PyTorch runs no forward hook after a BaseException)."""
    def interrupt(m, a):
        raise KeyboardInterrupt

    h = net.norm.register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        net(torch.randn(8, 4))
    h.remove()


LAYERS = {
    "bn1d_2d": (lambda: nn.BatchNorm1d(4), (8, 4)),
    "bn1d_3d": (lambda: nn.BatchNorm1d(4), (8, 4, 5)),
    "bn2d": (lambda: nn.BatchNorm2d(4), (6, 4, 3, 3)),
    "bn3d": (lambda: nn.BatchNorm3d(4), (4, 4, 2, 3, 2)),
    "syncbn": (lambda: nn.SyncBatchNorm(4), (6, 4, 3, 3)),
    "in1d": (lambda: nn.InstanceNorm1d(4, affine=True, track_running_stats=True), (3, 4, 7)),
    "in2d": (lambda: nn.InstanceNorm2d(4, affine=True, track_running_stats=True), (3, 4, 3, 3)),
    "in3d": (lambda: nn.InstanceNorm3d(4, affine=True, track_running_stats=True),
             (2, 4, 2, 3, 2)),
}


def _how(kind: str, net: Net):
    """A way of having torchstruct freeze ``net.norm`` (and only it)."""
    if kind == "freeze":
        return ts.freeze(net, "norm")
    if kind == "freeze_except":
        return ts.freeze_except(net, "pre", "head")
    if kind == "mark_trainable":
        ts.mark_trainable(net, "pre", "head")

        class _Lift:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                ts.mark_trainable(net, None)

        return _Lift()
    raise AssertionError(kind)


# --------------------------------------------------------------------------- layer kinds
@pytest.mark.parametrize("how", ["freeze", "freeze_except", "mark_trainable"])
@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_held_step_matches_eval_copy_bitwise(layer, how):
    torch.manual_seed(0)
    make, shape = LAYERS[layer]
    net = warmed(Net(make(), 4), shape)
    xs = [torch.randn(shape) for _ in range(2)]
    ref = oracle(net, "norm")
    ref.norm.requires_grad_(False)
    with _how(how, net):
        assert not net.norm.weight.requires_grad
        for x in xs:
            out, want = net(x), ref(x)
            assert torch.equal(out, want)
            out.square().sum().backward()
            want.square().sum().backward()
            assert net.norm.training and net.training
        assert same_stats(net.norm, ref.norm)
        assert same_grads(net, ref)
    # trainable again: plain PyTorch, statistics move as in a train-mode copy
    ref.norm.train()
    ref.norm.requires_grad_(True)
    x = torch.randn(shape)
    before = net.norm.running_mean.clone()
    assert torch.equal(net(x), ref(x))
    assert same_stats(net.norm, ref.norm)
    assert not torch.equal(net.norm.running_mean, before)  # released: it moved


class Declared(Net):
    def trainable(self):
        return ["pre", "head"]


def test_class_declaration_holds_the_layer_from_the_first_forward():
    torch.manual_seed(0)
    plain = warmed(Net(nn.BatchNorm2d(4), 4), (6, 4, 3, 3))
    net = Declared(nn.BatchNorm2d(4), 4)
    net.load_state_dict(plain.state_dict())
    ref = oracle(plain, "norm")
    ref.norm.requires_grad_(False)
    ts.attach(net)
    x = torch.randn(6, 4, 3, 3)
    assert torch.equal(net(x), ref(x))
    assert same_stats(net.norm, ref.norm) and net.norm.training


# --------------------------------------------------------------------------- who froze it
def test_only_weight_frozen_is_not_held():
    torch.manual_seed(0)
    net = warmed(Net(nn.BatchNorm1d(4), 4), (8, 4))
    ref = oracle(net)
    x = torch.randn(8, 4)
    with ts.freeze(net, "norm.weight"):
        assert torch.equal(net(x), ref(x))
    assert same_stats(net.norm, ref.norm)


def test_frozen_by_hand_and_opt_outs_are_plain():
    torch.manual_seed(0)
    net = warmed(Net(nn.BatchNorm1d(4), 4), (8, 4))
    ts.attach(net)
    ref = oracle(net)
    x = torch.randn(8, 4)
    net.norm.requires_grad_(False)  # by hand: plain PyTorch
    ref.norm.requires_grad_(False)
    assert torch.equal(net(x), ref(x)) and same_stats(net.norm, ref.norm)
    net.norm.requires_grad_(True)
    ref.norm.requires_grad_(True)
    with ts.freeze(net, "norm", freeze_norm_stats=False):
        assert torch.equal(net(x), ref(x)) and same_stats(net.norm, ref.norm)
    ts.attach(net, freeze_norm_stats=False)
    with ts.freeze(net, "norm"):
        assert torch.equal(net(x), ref(x)) and same_stats(net.norm, ref.norm)


def test_affine_false_layer_is_not_affected_documented():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, affine=False), nn.Linear(4, 1))
    ref = oracle(net)
    x = torch.randn(8, 3)
    with ts.freeze(net, "0"):
        ref[0].requires_grad_(False)
        assert torch.equal(net(x), ref(x))
    assert same_stats(net[1], ref[1]) and int(net[1].num_batches_tracked) == 1


def test_unfrozen_by_hand_inside_the_block_is_released_at_once():
    torch.manual_seed(0)
    net = warmed(Net(nn.BatchNorm1d(4), 4), (8, 4))
    x = torch.randn(8, 4)
    with ts.freeze(net, "norm"):
        net.norm.weight.requires_grad_(True)  # one parameter requires grad at the forward
        ref = oracle(net)
        assert torch.equal(net(x), ref(x))
        assert same_stats(net.norm, ref.norm)


# --------------------------------------------------------------------------- lazy / parametrized
def test_lazy_batchnorm_frozen_before_materialization():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.LazyBatchNorm1d(), nn.Linear(4, 1))
    torch.manual_seed(0)  # an uninitialized lazy module cannot be deep-copied: built twice
    ref = nn.Sequential(nn.Linear(3, 4), nn.LazyBatchNorm1d(), nn.Linear(4, 1))
    x = torch.randn(8, 3)
    with ts.freeze(net, "1"):
        out = net(x)
        assert not net[1].weight.requires_grad and net[1].training
    for p in ref[1].parameters():
        p.requires_grad = False
    ref[1].eval()
    want = ref(x)
    assert torch.equal(out, want)
    assert same_stats(net[1], ref[1]) and int(net[1].num_batches_tracked) == 0
    ref[1].train()
    ref[1].requires_grad_(True)
    x = torch.randn(8, 3)
    assert torch.equal(net(x), ref(x)) and same_stats(net[1], ref[1])


def test_lazy_batchnorm_frozen_after_materialization():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.LazyBatchNorm1d(), nn.Linear(4, 1))
    warmed(net, (8, 3))
    ref = oracle(net, "1")
    ref[1].requires_grad_(False)
    x = torch.randn(8, 3)
    with ts.freeze(net, "1"):
        assert torch.equal(net(x), ref(x))
    assert same_stats(net[1], ref[1])


class Softplus(nn.Module):
    def forward(self, w):
        return nn.functional.softplus(w)


@pytest.mark.parametrize("kind", ["custom", "weight_norm"])
def test_parametrized_norm_weight_is_held_through_its_original(kind):
    torch.manual_seed(0)
    net = warmed(Net(nn.BatchNorm2d(4), 4), (6, 4, 3, 3))
    if kind == "custom":
        parametrize.register_parametrization(net.norm, "weight", Softplus())
    else:
        nn.utils.parametrizations.weight_norm(net.norm, dim=0)
    ref = oracle(net, "norm")
    ref.norm.requires_grad_(False)
    x = torch.randn(6, 4, 3, 3)
    with ts.freeze(net, "norm"):
        assert not any(p.requires_grad for p in net.norm.parameters())
        out, want = net(x), ref(x)
        assert torch.equal(out, want)
        out.sum().backward()
        want.sum().backward()
    assert same_stats(net.norm, ref.norm) and same_grads(net, ref)


def test_spectral_norm_conv_next_to_held_bn_keeps_its_power_iteration():
    torch.manual_seed(0)
    net = nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Conv2d(3, 4, 3)), nn.BatchNorm2d(4),
                        nn.ReLU(), nn.Flatten(), nn.LazyLinear(2))
    warmed(net, (4, 3, 6, 6))
    ref = oracle(net, "1")
    ref[1].requires_grad_(False)
    x = torch.randn(4, 3, 6, 6)
    with ts.freeze(net, "1"):
        out, want = net(x), ref(x)
    assert torch.equal(out, want)
    assert same_stats(net[1], ref[1])
    u = lambda m: m[0].parametrizations.weight[0]._u
    assert torch.equal(u(net), u(ref))  # power iteration ran in both


# --------------------------------------------------------------------------- modes, exceptions
def test_eval_forward_inside_the_hold_and_train_back():
    torch.manual_seed(0)
    net = warmed(Net(nn.BatchNorm1d(4), 4), (8, 4))
    ref = oracle(net)
    x = torch.randn(8, 4)
    with ts.freeze(net, "norm"):
        net.eval()
        ref.eval()
        assert torch.equal(net(x), ref(x)) and not net.norm.training
        net.train()
        assert torch.equal(net(x), ref(x)) and net.norm.training
    assert same_stats(net.norm, ref.norm)


class TogglesInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        self.bn.train()  # a module that forces its norm into training mode per call
        return self.bn(self.lin(x))


def test_module_that_calls_train_on_its_norm_in_forward_is_still_held():
    torch.manual_seed(0)
    net = warmed(TogglesInForward(), (8, 4))
    ref = oracle(net)
    x = torch.randn(8, 4)
    with ts.freeze(net, "bn"):
        net.eval()
        out = net(x)
        assert net.bn.training  # its own forward turned it on, as in plain PyTorch
    ref.bn.eval()  # the oracle: the held layer normalizes as in eval mode
    assert torch.equal(out, nn.functional.batch_norm(
        ref.lin(x), ref.bn.running_mean, ref.bn.running_var, ref.bn.weight, ref.bn.bias,
        False, 0.0, ref.bn.eps))
    assert same_stats(net.bn, ref.bn)


def test_exception_inside_the_layer_forward_restores_the_mode():
    torch.manual_seed(0)
    net = warmed(Net(nn.BatchNorm1d(4), 4), (8, 4))
    before = stats(net.norm)
    with ts.freeze(net, "norm"):
        with pytest.raises(ValueError):
            net.norm(torch.randn(2, 4, 3, 3))  # wrong rank: _check_input_dim raises
        assert net.norm.training
        assert _hooks._WAS_TRAINING not in net.norm.__dict__
        # a user pre-hook (registered after the hold) that raises
        h = net.norm.register_forward_pre_hook(lambda m, a: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            net(torch.randn(8, 4))
        h.remove()
        assert net.norm.training
    assert all(torch.equal(a, b) for a, b in zip(before, stats(net.norm)))
    net(torch.randn(8, 4))
    assert int(net.norm.num_batches_tracked) == 3  # plain again after the block


def test_keyboard_interrupt_mode_restored_at_block_exit_documented():
    net = warmed(Net(nn.BatchNorm1d(4), 4), (8, 4))
    with ts.freeze(net, "norm"):
        interrupted(net)
        assert not net.norm.training  # documented: not restored after a BaseException ...
    assert net.norm.training  # ... but when the hold ends


def test_eval_called_during_the_held_forward_sticks():
    torch.manual_seed(0)
    net = warmed(Net(nn.BatchNorm1d(4), 4), (8, 4))
    with ts.freeze(net, "norm"):
        h = net.norm.register_forward_pre_hook(lambda m, a: net.eval() and None)
        net(torch.randn(8, 4))
        h.remove()
    assert net.norm.training is net.training is False


# --------------------------------------------------------------------------- threads
def test_two_threads_forwarding_a_held_layer_never_update_its_statistics():
    torch.manual_seed(0)
    net = warmed(Net(nn.BatchNorm1d(4), 4), (8, 4))
    a_in, b_in, a_done = threading.Event(), threading.Event(), threading.Event()
    names = {}

    def order(mod, args):  # only forces one interleaving; no effect on a single thread
        who = names.get(threading.get_ident())
        if who == "A":
            a_in.set()
            b_in.wait(5)
        elif who == "B":
            b_in.set()
            a_done.wait(5)

    with ts.freeze(net, "norm"):
        x = torch.randn(8, 4)
        net(x)  # the hooks are in place
        before = stats(net.norm)
        h = net.norm.register_forward_pre_hook(order)

        def run(name):
            names[threading.get_ident()] = name
            with torch.no_grad():
                net(x)
            if name == "A":
                a_done.set()

        ta = threading.Thread(target=run, args=("A",))
        ta.start()
        a_in.wait(5)
        tb = threading.Thread(target=run, args=("B",))
        tb.start()
        ta.join(10)
        tb.join(10)
        h.remove()
        assert all(torch.equal(a, b) for a, b in zip(before, stats(net.norm)))


def test_threads_running_held_forwards_leave_the_layer_in_training_mode():
    """The look at and the write of the saved mode happen at once (under a lock): threads
    entering the held forward together save the mode once, and the layer is in training mode
    after them. A stress loop (each round failed about one time in ten before the lock)."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(5):
            torch.manual_seed(0)
            net = warmed(Net(nn.BatchNorm1d(4), 4), (8, 4))
            with ts.freeze(net, "norm"):
                threads = [threading.Thread(
                    target=lambda: [net(torch.randn(8, 4)) for _ in range(100)])
                    for _ in range(3)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(30)
                assert net.norm.training
            assert net.norm.training
    finally:
        sys.setswitchinterval(old)


# --------------------------------------------------------------------------- checkpointing
@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpoint_recompute_does_not_update_held_statistics(reentrant):
    torch.manual_seed(0)
    net = warmed(Net(nn.BatchNorm2d(4), 4), (6, 4, 3, 3))
    ref = oracle(net, "norm")
    ref.norm.requires_grad_(False)
    x = torch.randn(6, 4, 3, 3, requires_grad=True)
    xr = x.detach().clone().requires_grad_(True)
    with ts.freeze(net, "norm"):
        out = checkpoint(net, x, use_reentrant=reentrant)
        out.square().sum().backward()
        assert net.norm.training
    want = ref(xr)
    want.square().sum().backward()
    assert torch.equal(out, want)
    assert same_stats(net.norm, ref.norm)
    assert same_grads(net, ref) and torch.equal(x.grad, xr.grad)


# --------------------------------------------------------------------------- autocast, no_grad
def test_autocast_bfloat16_held_matches_eval_copy():
    torch.manual_seed(0)
    net = warmed(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
                               nn.Flatten(), nn.Linear(16, 2)), (4, 3, 4, 4))
    ref = oracle(net, "1")
    ref[1].requires_grad_(False)
    x = torch.randn(4, 3, 4, 4)
    with ts.freeze(net, "1"), torch.autocast("cpu", dtype=torch.bfloat16):
        out = net(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = ref(x)
    assert out.dtype == want.dtype and torch.equal(out, want)
    assert same_stats(net[1], ref[1])


def test_inference_mode_forward_is_held():
    torch.manual_seed(0)
    net = warmed(Net(nn.BatchNorm1d(4), 4), (8, 4))
    ref = oracle(net, "norm")
    x = torch.randn(8, 4)
    with ts.freeze(net, "norm"), torch.inference_mode():
        out = net(x)
    with torch.inference_mode():
        assert torch.equal(out, ref(x))
    assert same_stats(net.norm, ref.norm) and net.norm.training


# --------------------------------------------------------------------------- structural_grad
def _loss(x):
    return lambda m: m(x).square().mean()


def test_structural_grad_wrt_held_layer_differentiates_it_in_eval_mode():
    torch.manual_seed(0)
    net = warmed(Net(nn.BatchNorm1d(4), 4), (8, 4))
    ref = oracle(net, "norm")
    ref.pre.requires_grad_(False)
    ref.head.requires_grad_(False)
    x = torch.randn(8, 4)
    with ts.freeze(net, "norm"):
        value, g = ts.value_and_grad(lambda m: _loss(x)(m), net, wrt="norm")
        assert not net.norm.weight.requires_grad and net.norm.training
    want = _loss(x)(ref)
    gw, gb = torch.autograd.grad(want, [ref.norm.weight, ref.norm.bias])
    assert torch.equal(value, want.detach())
    assert torch.equal(g["norm"]["weight"], gw) and torch.equal(g["norm"]["bias"], gb)
    assert same_stats(net.norm, ref.norm)


def test_structural_grad_that_switches_the_layer_off_leaves_it_plain():
    torch.manual_seed(0)
    net = warmed(Net(nn.BatchNorm1d(4), 4), (8, 4))
    ts.attach(net)
    ref = oracle(net)
    x = torch.randn(8, 4)
    value, g = ts.value_and_grad(_loss(x), net, wrt="head")  # the norm's flags go off
    want = _loss(x)(ref)
    (gw,) = torch.autograd.grad(want, [ref.head.weight])
    assert torch.equal(value, want.detach()) and torch.equal(g["head"]["weight"], gw)
    assert same_stats(net.norm, ref.norm)  # updated exactly once, as loss(model)


def test_context_entered_inside_the_loss_holds_the_layer():
    torch.manual_seed(0)
    net = warmed(Net(nn.BatchNorm1d(4), 4), (8, 4))
    ts.attach(net)
    ref = oracle(net, "norm")
    x = torch.randn(8, 4)

    def loss(m):
        with ts.freeze(m, "norm"):
            return _loss(x)(m)

    value, g = ts.value_and_grad(loss, net, wrt="head")
    want = _loss(x)(ref)
    (gw,) = torch.autograd.grad(want, [ref.head.weight])
    assert torch.equal(value, want.detach()) and torch.equal(g["head"]["weight"], gw)
    assert same_stats(net.norm, ref.norm) and net.norm.training


def test_context_left_inside_the_loss_releases_the_layer():
    torch.manual_seed(0)
    net = warmed(Net(nn.BatchNorm1d(4), 4), (8, 4))
    ref = oracle(net, "norm")
    x1, x2 = torch.randn(8, 4), torch.randn(8, 4)
    ctx = ts.freeze(net, "norm")

    def loss(m):
        a = _loss(x1)(m)  # held
        ctx.__exit__(None, None, None)
        return a + _loss(x2)(m)  # trainable again: plain

    value, _ = ts.value_and_grad(loss, net, wrt="head")
    want = _loss(x1)(ref)
    ref.norm.train()
    want = want + _loss(x2)(ref)
    assert torch.equal(value, want.detach())
    assert same_stats(net.norm, ref.norm)


@pytest.mark.parametrize("frozen", [False, True])
def test_nested_structural_grad_calls_see_the_layer_as_the_model_decides(frozen):
    torch.manual_seed(0)
    net = warmed(Net(nn.BatchNorm1d(4), 4), (8, 4))
    ts.attach(net)
    ref = oracle(net, *(["norm"] if frozen else []))
    x1, x2 = torch.randn(8, 4), torch.randn(8, 4)
    inner = {}

    def outer_loss(m):
        inner["v"], inner["g"] = ts.value_and_grad(_loss(x2), m, wrt="norm")
        return _loss(x1)(m)

    ctx = ts.freeze(net, "norm") if frozen else None
    try:
        value, g = ts.value_and_grad(outer_loss, net, wrt="head")
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    want_inner = _loss(x2)(ref)
    want = _loss(x1)(ref)
    assert torch.equal(inner["v"], want_inner.detach())
    assert torch.equal(value, want.detach())
    assert same_stats(net.norm, ref.norm)
    assert net.norm.weight.requires_grad


def test_create_graph_call_on_held_layer():
    torch.manual_seed(0)
    net = warmed(Net(nn.BatchNorm1d(4), 4), (8, 4))
    ref = oracle(net, "norm")
    ref.norm.requires_grad_(False)
    x = torch.randn(8, 4)
    with ts.freeze(net, "norm"):
        g = ts.structural_grad(net, _loss(x), wrt="head", create_graph=True)
    (gw,) = torch.autograd.grad(_loss(x)(ref), [ref.head.weight], create_graph=True)
    assert torch.equal(g["head"]["weight"], gw)
    assert same_stats(net.norm, ref.norm)


# --------------------------------------------------------------------------- swap, functional_call
def test_swap_with_grad_requiring_stand_ins_does_not_release_the_layer():
    torch.manual_seed(0)
    net = warmed(Net(nn.BatchNorm1d(4), 4), (8, 4))
    ref = oracle(net, "norm")
    fast = {"norm": {"weight": (net.norm.weight.detach() * 2).requires_grad_(True),
                     "bias": (net.norm.bias.detach() + 1).requires_grad_(True)}}
    x = torch.randn(8, 4)
    with ts.freeze(net, "norm"):
        with ts.swap(net, fast):
            out = net(x)
        gw = torch.autograd.grad(out.sum(), fast["norm"]["weight"])[0]
    want = torch.func.functional_call(
        ref, {"norm.weight": fast["norm"]["weight"], "norm.bias": fast["norm"]["bias"]}, (x,))
    (ww,) = torch.autograd.grad(want.sum(), fast["norm"]["weight"])
    assert torch.equal(out, want) and torch.equal(gw, ww)
    assert same_stats(net.norm, ref.norm)


def test_stop_gradient_on_a_trainable_layer_is_plain_and_on_a_frozen_one_held():
    torch.manual_seed(0)
    net = warmed(Net(nn.BatchNorm1d(4), 4), (8, 4))
    ref = oracle(net)
    x = torch.randn(8, 4)
    with ts.stop_gradient(net, "norm"):  # changes no flag: plain training-mode statistics
        assert torch.equal(net(x), ref(x))
    assert same_stats(net.norm, ref.norm)
    ref.norm.eval()
    with ts.freeze(net, "norm"), ts.stop_gradient(net, "norm"):
        assert torch.equal(net(x), ref(x))
    assert same_stats(net.norm, ref.norm)


def test_functional_call_with_params_and_buffers_passed_in():
    torch.manual_seed(0)
    net = warmed(Net(nn.BatchNorm1d(4), 4), (8, 4))
    ref = oracle(net, "norm")
    x = torch.randn(8, 4)

    def fresh():
        d = {k: v.detach().clone() for k, v in net.state_dict().items()}
        d["norm.weight"].requires_grad_(True)  # fast weights
        d["norm.bias"].requires_grad_(True)
        return d

    mine, theirs = fresh(), fresh()
    kept = {k: v.clone() for k, v in mine.items() if "running" in k or "batches" in k}
    with ts.freeze(net, "norm"):
        out = torch.func.functional_call(net, mine, (x,))
    want = torch.func.functional_call(ref, theirs, (x,))
    assert torch.equal(out, want)
    for k, v in kept.items():  # the passed-in statistics are not updated either
        assert torch.equal(mine[k], v) and torch.equal(theirs[k], v)
    assert same_stats(net.norm, ref.norm) and net.norm.training


def test_torch_func_grad_and_vmap_over_a_held_layer():
    torch.manual_seed(0)
    net = warmed(Net(nn.BatchNorm1d(4), 4), (8, 4))
    ref = oracle(net, "norm")
    x = torch.randn(3, 8, 4)
    params = {k: v.detach() for k, v in net.named_parameters()}

    def f(model):
        def loss(p, xb):
            return torch.func.functional_call(model, p, (xb,)).square().mean()
        return torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)

    with ts.freeze(net, "norm"):
        got = f(net)  # vmap over a training-mode BN would refuse its in-place update
    want = f(ref)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    assert same_stats(net.norm, ref.norm)


# --------------------------------------------------------------------------- momentum / update_bn
def test_momentum_switched_to_none_by_hand_is_not_held_until_it_is_back():
    torch.manual_seed(0)
    net = warmed(Net(nn.BatchNorm1d(4), 4), (8, 4))
    x = torch.randn(8, 4)
    with ts.freeze(net, "norm"):
        net(x)
        net.norm.momentum = None
        ref = oracle(net)
        assert torch.equal(net(x), ref(x)) and same_stats(net.norm, ref.norm)
        net.norm.momentum = 0.1
        ref = oracle(net, "norm")
        assert torch.equal(net(x), ref(x)) and same_stats(net.norm, ref.norm)


def test_update_bn_on_an_averaged_model_of_a_held_model():
    from torch.optim.swa_utils import AveragedModel, update_bn

    torch.manual_seed(0)
    net = warmed(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)), (8, 3))
    loader = [torch.randn(8, 3) for _ in range(3)]
    plain = oracle(net)
    with ts.freeze(net, "1"):
        swa = AveragedModel(net)
        swa.update_parameters(net)
        update_bn(loader, swa)
        held_before = stats(net[1])
        net(loader[0])
        assert all(torch.equal(a, b) for a, b in zip(held_before, stats(net[1])))
    plain[1].requires_grad_(False)
    swa_ref = AveragedModel(plain)
    swa_ref.update_parameters(plain)
    update_bn(loader, swa_ref)
    assert same_stats(swa.module[1], swa_ref.module[1])
    assert int(swa.module[1].num_batches_tracked) == 3


def test_update_bn_on_the_model_itself_recomputes_then_holds():
    from torch.optim.swa_utils import update_bn

    torch.manual_seed(0)
    net = warmed(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)), (8, 3))
    loader = [torch.randn(8, 3) for _ in range(3)]
    ref = oracle(net)
    with ts.freeze(net, "1"):
        update_bn(loader, net)
        update_bn(loader, ref)
        assert same_stats(net[1], ref[1]) and net[1].momentum == 0.1
        x = torch.randn(8, 3)
        ref[1].eval()
        assert torch.equal(net(x), ref(x)) and same_stats(net[1], ref[1])


def test_update_bn_on_a_held_momentum_none_layer_raises_documented():
    from torch.optim.swa_utils import update_bn

    torch.manual_seed(0)
    net = warmed(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, momentum=None),
                               nn.Linear(4, 1)), (8, 3))
    with ts.freeze(net, "1"):
        with pytest.raises(RuntimeError, match="momentum=None"):
            update_bn([torch.randn(8, 3)], net)


# --------------------------------------------------------------------------- sharing, moving
def test_bn_shared_by_two_attached_models_one_flag_one_behaviour():
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(4)
    a = nn.Sequential(nn.Linear(3, 4), bn, nn.Linear(4, 1))
    b = nn.Sequential(nn.Linear(5, 4), bn, nn.Linear(4, 2))
    warmed(a, (8, 3))
    ts.attach(a)
    ts.attach(b)
    x = torch.randn(8, 5)
    with ts.freeze(a, "1"):
        assert not bn.weight.requires_grad  # one flag: frozen in b too, by torchstruct
        ref = oracle(b, "1")
        assert torch.equal(b(x), ref(x)) and same_stats(bn, ref[1])
    ref = oracle(b)
    assert torch.equal(b(x), ref(x)) and same_stats(bn, ref[1])


def test_bn_moved_out_of_the_model_behaves_as_its_flags_say():
    torch.manual_seed(0)
    net = warmed(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)), (8, 3))
    x = torch.randn(8, 4)
    with pytest.warns(ts.RestoredFlagsWarning):
        with ts.freeze(net, "1"):
            bn = net[1]
            other = nn.Sequential(bn)
            net[1] = nn.Identity()
            net(torch.randn(8, 3))  # the application sees the layer left the tree
            frozen = not bn.weight.requires_grad
            ref = oracle(other, *(["0"] if frozen else []))
            assert torch.equal(other(x), ref(x)) and same_stats(bn, ref[0])


# --------------------------------------------------------------------------- copies
def test_deepcopy_and_torch_save_of_a_held_model_are_plain():
    torch.manual_seed(0)
    net = warmed(Net(nn.BatchNorm1d(4), 4), (8, 4))
    x = torch.randn(8, 4)
    with ts.freeze(net, "norm"):
        net(x)
        dup = copy.deepcopy(net)
        buf = io.BytesIO()
        torch.save(net, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        for c in (dup, loaded):
            assert c.norm.training and not c.norm.weight.requires_grad
            ref = oracle(c)
            assert torch.equal(c(x), ref(x)) and same_stats(c.norm, ref.norm)
        before = stats(net.norm)
        net(x)
        assert all(torch.equal(a, b) for a, b in zip(before, stats(net.norm)))


def test_load_state_dict_into_a_held_layer_holds_the_loaded_statistics():
    torch.manual_seed(0)
    net = warmed(Net(nn.BatchNorm1d(4), 4), (8, 4))
    other = warmed(Net(nn.BatchNorm1d(4), 4), (8, 4), steps=5)
    x = torch.randn(8, 4)
    with ts.freeze(net, "norm"):
        net.load_state_dict(other.state_dict())
        ref = oracle(net, "norm")
        assert torch.equal(net(x), ref(x)) and same_stats(net.norm, ref.norm)


# --------------------------------------------------------------------------- compile
def test_compiled_model_holds_inside_and_is_plain_outside():
    torch.manual_seed(0)
    net = warmed(Net(nn.BatchNorm1d(4), 4), (8, 4))
    ref = oracle(net)
    cnet = torch.compile(net, backend="eager")
    xs = [torch.randn(8, 4) for _ in range(3)]
    assert torch.equal(cnet(xs[0]), ref(xs[0])) and same_stats(net.norm, ref.norm)
    with ts.freeze(net, "norm"):
        ref.norm.eval()
        assert torch.equal(cnet(xs[1]), ref(xs[1])) and same_stats(net.norm, ref.norm)
        assert net.norm.training
    ref.norm.train()
    assert torch.equal(cnet(xs[2]), ref(xs[2])) and same_stats(net.norm, ref.norm)


def test_compiled_structural_grad_with_context_in_the_loss():
    torch.manual_seed(0)
    net = warmed(Net(nn.BatchNorm1d(4), 4), (8, 4))
    ts.attach(net)
    ref = oracle(net, "norm")
    cnet = torch.compile(net, backend="eager")
    x = torch.randn(8, 4)

    def loss(m):
        with ts.freeze(net, "norm"):
            return cnet(x).square().mean()

    value, g = ts.value_and_grad(loss, net, wrt="head")
    want = _loss(x)(ref)
    (gw,) = torch.autograd.grad(want, [ref.head.weight])
    assert torch.equal(value, want.detach()) and torch.equal(g["head"]["weight"], gw)
    assert same_stats(net.norm, ref.norm)


# --------------------------------------------------------------------------- a small ResNet
class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                  nn.BatchNorm2d(cout))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.down(x))


class TinyResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, 1, 1, bias=False), nn.BatchNorm2d(4))
        self.layer1 = BasicBlock(4, 6, 2)
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        x = self.layer1(torch.relu(self.stem(x)))
        return self.fc(x.mean((2, 3)))


def test_resnet_finetune_steps_match_a_hand_frozen_eval_copy():
    torch.manual_seed(0)
    net = warmed(TinyResNet(), (4, 3, 8, 8))
    ref = oracle(net)
    ref.stem.requires_grad_(False)
    ref.stem.eval()  # a frozen stem (BN and all), trained layer1 (its BNs update) and fc
    opt = torch.optim.SGD([p for p in net.parameters()], lr=0.1)
    opt_ref = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    data = [(torch.randn(4, 3, 8, 8), torch.randint(0, 3, (4,))) for _ in range(3)]
    with ts.freeze(net, "stem"):
        for x, y in data:
            for m, o in ((net, opt), (ref, opt_ref)):
                o.zero_grad()
                nn.functional.cross_entropy(m(x), y).backward()
                o.step()
    for name in ("stem.1", "layer1.bn1", "layer1.bn2", "layer1.down.1"):
        assert same_stats(net.get_submodule(name), ref.get_submodule(name)), name
    for (n, p), (_, q) in zip(net.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q), n
    assert all(m.training for m in net.modules())


# --------------------------------------------------------------------------- more modes
def test_eval_after_an_interrupted_held_forward_sticks():
    net = warmed(Net(nn.BatchNorm1d(4), 4), (8, 4))
    with ts.freeze(net, "norm"):
        interrupted(net)
        net.eval()  # e.g. a final validation after Ctrl-C
        net(torch.randn(8, 4))
    assert net.training is False
    count = int(net.norm.num_batches_tracked)
    net(torch.randn(8, 4))  # an eval forward: plain PyTorch updates nothing
    assert net.norm.training is False and int(net.norm.num_batches_tracked) == count


def test_train_after_an_interrupted_held_forward_is_still_held():
    """After a forward a KeyboardInterrupt ended, ``model.train()`` writes True over the
    held mode left behind; the next forward, still held, must not update the statistics."""
    net = warmed(Net(nn.BatchNorm1d(4), 4), (8, 4))
    with ts.freeze(net, "norm"):
        interrupted(net)
        net.train()
        before = stats(net.norm)
        net(torch.randn(8, 4))
        assert all(torch.equal(a, b) for a, b in zip(before, stats(net.norm)))
        assert net.norm.training is True
    net(torch.randn(8, 4))
    assert int(net.norm.num_batches_tracked) == int(before[-1]) + 1  # plain after the block


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_copy_after_an_interrupted_held_forward(how):
    """The mode a forward a KeyboardInterrupt ended left behind travels with a copy of the
    model (deepcopy, a whole-model torch.save), and the copy, which nothing holds, gets its
    training mode back at its first forward."""
    net = warmed(Net(nn.BatchNorm1d(4), 4), (8, 4))
    with ts.freeze(net, "norm"):
        interrupted(net)
        if how == "deepcopy":
            twin = copy.deepcopy(net)
        else:
            buf = io.BytesIO()
            torch.save(net, buf)
            buf.seek(0)
            twin = torch.load(buf, weights_only=False)
        count = int(twin.norm.num_batches_tracked)
        twin(torch.randn(8, 4))
        assert twin.norm.training is True
        assert int(twin.norm.num_batches_tracked) == count + 1  # not held: plain
        assert _hooks._WAS_TRAINING not in twin.norm.__dict__
        before = stats(net.norm)
        net(torch.randn(8, 4))
        assert all(torch.equal(a, b) for a, b in zip(before, stats(net.norm)))
        assert net.norm.training is True


def test_a_held_layer_called_again_inside_its_forward():
    """A pre-hook on the held layer (after torchstruct's) that calls the layer again: both
    forwards held, the mode back (a bool, True) only after the outer one."""
    torch.manual_seed(0)
    net = warmed(Net(nn.BatchNorm1d(4), 4), (8, 4))
    seen = []

    def again(m, a):
        h.remove()
        m(a[0])
        seen.append(m.training)  # the inner forward ended; the outer one is about to run

    with ts.freeze(net, "norm"):
        net(torch.randn(8, 4))  # the hold's hooks are in place: ours run first
        before = stats(net.norm)
        h = net.norm.register_forward_pre_hook(again)
        net(torch.randn(8, 4))
        assert len(seen) == 1 and not seen[0]
        assert net.norm.training is True
        assert all(torch.equal(a, b) for a, b in zip(before, stats(net.norm)))


def test_mode_inside_and_after_the_held_forward():
    """Inside the held forward the layer reads as eval mode; after it, exactly the bool it
    was (True or False)."""
    torch.manual_seed(0)
    net = warmed(Net(nn.BatchNorm1d(4), 4), (8, 4))
    inside = []
    with ts.freeze(net, "norm"):
        net(torch.randn(8, 4))  # the hold's hooks are in place: ours run first
        net.norm.register_forward_pre_hook(lambda m, a: inside.append(bool(m.training)))
        for mode in (True, False, True):
            net.train(mode)
            net(torch.randn(8, 4))
            assert net.norm.training is mode
    assert inside == [False, False, False]


def test_eval_from_another_thread_during_a_held_forward_sticks():
    torch.manual_seed(0)
    net = warmed(Net(nn.BatchNorm1d(4), 4), (8, 4))

    def other_thread_eval(m, a):
        t = threading.Thread(target=net.eval)
        t.start()
        t.join(10)

    with ts.freeze(net, "norm"):
        h = net.norm.register_forward_pre_hook(other_thread_eval)
        net(torch.randn(8, 4))
        h.remove()
        assert net.norm.training is False
    count = int(net.norm.num_batches_tracked)
    net(torch.randn(8, 4))
    assert net.norm.training is False and int(net.norm.num_batches_tracked) == count


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_thread_ended_by_a_base_exception_inside_the_held_forward():
    """A worker thread's held forward ended by a BaseException (SystemExit): its entry is
    stale once the thread is gone; the main thread's next forward puts the mode back after
    it."""
    torch.manual_seed(0)
    net = warmed(Net(nn.BatchNorm1d(4), 4), (8, 4))

    def leave(m, a):
        if threading.current_thread() is not threading.main_thread():
            raise SystemExit

    with ts.freeze(net, "norm"):
        h = net.norm.register_forward_pre_hook(leave)
        t = threading.Thread(target=lambda: net(torch.randn(8, 4)))
        t.start()
        t.join(10)
        assert not t.is_alive() and not net.norm.training  # left as the forward set it
        before = stats(net.norm)
        net(torch.randn(8, 4))
        h.remove()
        assert net.norm.training is True
        assert all(torch.equal(a, b) for a, b in zip(before, stats(net.norm)))


def test_a_layer_shared_by_two_attached_models():
    """One norm layer in two attached trees, both freezing it: a hold by either keeps the
    statistics, and the mode comes back after every forward."""
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(4)
    a = warmed(Net(norm, 4), (8, 4))
    b = Net(norm, 4)
    ts.attach(a)
    ts.attach(b)
    try:
        with ts.freeze(a, "norm"), ts.freeze(b, "norm"):
            before = stats(norm)
            for m in (a, b, a):
                m(torch.randn(8, 4))
                assert norm.training is True
                assert _hooks._WAS_TRAINING not in norm.__dict__
            assert all(torch.equal(x, y) for x, y in zip(before, stats(norm)))
    finally:
        ts.detach_hooks(a)
        ts.detach_hooks(b)


def test_in_place_compiled_model_holds_and_releases_at_every_entry():
    torch.manual_seed(0)
    net = warmed(Net(nn.BatchNorm1d(4), 4), (8, 4))
    ref = oracle(net)
    net.compile(backend="eager")
    for _ in range(2):
        x = torch.randn(8, 4)
        ref.norm.train()
        assert torch.equal(net(x), ref(x)) and same_stats(net.norm, ref.norm)
        with ts.freeze(net, "norm"):
            x = torch.randn(8, 4)
            ref.norm.eval()
            assert torch.equal(net(x), ref(x)) and same_stats(net.norm, ref.norm)
            assert net.norm.training


def test_unfreeze_inside_the_loss_releases_a_held_layer():
    torch.manual_seed(0)
    net = warmed(Net(nn.BatchNorm1d(4), 4), (8, 4))
    ref = oracle(net)
    x = torch.randn(8, 4)

    def loss(m):
        with ts.unfreeze(m, "norm"):
            return _loss(x)(m)

    with ts.freeze(net, "norm"):
        value, g = ts.value_and_grad(loss, net, wrt="head")
        assert not net.norm.weight.requires_grad
    want = _loss(x)(ref)
    (gw,) = torch.autograd.grad(want, [ref.head.weight])
    assert torch.equal(value, want.detach()) and torch.equal(g["head"]["weight"], gw)
    assert same_stats(net.norm, ref.norm)


def test_structural_grad_wrt_a_layer_frozen_by_hand_is_plain():
    torch.manual_seed(0)
    net = warmed(Net(nn.BatchNorm1d(4), 4), (8, 4))
    net.norm.requires_grad_(False)  # by hand: PyTorch's behaviour, statistics update
    ts.attach(net)
    ref = oracle(net)
    ref.norm.requires_grad_(True)
    ref.pre.requires_grad_(False)
    ref.head.requires_grad_(False)
    x = torch.randn(8, 4)
    value, g = ts.value_and_grad(_loss(x), net, wrt="norm")
    want = _loss(x)(ref)
    gw, gb = torch.autograd.grad(want, [ref.norm.weight, ref.norm.bias])
    assert torch.equal(value, want.detach()) and torch.equal(g["norm"]["weight"], gw)
    assert same_stats(net.norm, ref.norm)
    assert not net.norm.weight.requires_grad


def test_convert_sync_batchnorm_inside_the_block_holds_the_new_layer():
    torch.manual_seed(0)
    net = warmed(Net(nn.BatchNorm2d(4), 4), (6, 4, 3, 3))
    x = torch.randn(6, 4, 3, 3)
    with pytest.warns(ts.RestoredFlagsWarning), ts.freeze(net, "norm"):
        net(x)
        conv = nn.SyncBatchNorm.convert_sync_batchnorm(net)
        assert conv is net and isinstance(net.norm, nn.SyncBatchNorm)
        ref = oracle(net, "norm")
        assert torch.equal(net(x), ref(x)) and same_stats(net.norm, ref.norm)
        assert net.norm.training


def test_momentum_none_layer_converted_inside_the_hold_stays_held_documented():
    torch.manual_seed(0)
    net = warmed(Net(nn.BatchNorm1d(4, momentum=None), 4), (8, 4), steps=3)
    x = torch.randn(8, 4, dtype=torch.float64)
    with ts.freeze(net, "norm"):
        net(x.float())
        net.double()  # trained statistics converted: not a reset, still held
        ref = oracle(net, "norm")
        assert torch.equal(net(x), ref(x)) and same_stats(net.norm, ref.norm)
        net.norm.reset_running_stats()  # what update_bn does first: the next forward raises
        with pytest.raises(RuntimeError, match="reset"):
            net(x)
        net.eval()
        net(x)  # an eval forward passes


@pytest.mark.parametrize("momentum", [0.1, None])
def test_a_hold_ending_while_a_forward_begins(monkeypatch, momentum):
    """Another thread ends the hold right after a forward's hook found the layer held (the race
    a thread entering and leaving ``ts.freeze`` while others run forwards hits): the forward
    neither fails nor puts the ended hold back."""
    from torchstruct import _state

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, momentum=momentum), nn.Linear(4, 2))
    for _ in range(2):
        net(torch.randn(8, 4))
    real = _hooks._held

    def held_then_ended(module):
        found = real(module)
        _state.frozen_norms.pop(id(module), None)
        return found

    with ts.freeze(net, "1"):
        net[1].running_mean.add_(1.0)  # a write since the hold began: the count is read
        monkeypatch.setattr(_hooks, "_held", held_then_ended)
        net(torch.randn(8, 4))
        assert id(net[1]) not in _state.frozen_norms
        monkeypatch.undo()
    assert net[1].training is True
