"""A parameter a block replaces, handed *directly* to a custom ``torch.autograd.Function``
(fused kernels: Liger/Unsloth-style RMSNorm, bitsandbytes matmuls take the weight this way).

``Function.apply`` passes through no torch function mode, so the stand-in cannot be put in
the arguments; the function's forward operations see it, and that is where it is found:

- ``stop_gradient``, a forward taking ``ctx``: the backward node's gradient for the parameter is
  cut (exact: the stand-in aliases the parameter, so what the node saved is the same);
- ``swap`` (the function saved the parameter, not the stand-in), or a forward without ``ctx``
  (``setup_context`` style): refused with an error naming the function, unless apply records
  nothing (``no_grad``, a parameter that does not require grad) where that can be told.
"""
import pytest
import torch
from torch import nn

import torchstruct as ts
from _flags import APPLY_TAKES_KEYWORDS


@pytest.fixture(autouse=True, params=["apply frame", "forward code"])
def lookup(request, monkeypatch):
    """Every test with both ways of finding the running forward: the frame Function.apply
    called (where apply is Python) and the forward's code (where apply is C++, torch 2.14)."""
    from torchstruct import _custom_functions

    if request.param == "apply frame" and _custom_functions._APPLY is None:
        pytest.skip("Function.apply is C++ in this torch")
    if request.param == "forward code":
        monkeypatch.setattr(_custom_functions, "_APPLY", None)
    return request.param


class RMSNormFn(torch.autograd.Function):
    """A fused-style RMSNorm: the weight handed in directly, the backward written by hand."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        x = x.contiguous()
        w = weight.contiguous()
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, w, rstd)
        return x * rstd * w

    @staticmethod
    def backward(ctx, g):
        x, w, rstd = ctx.saved_tensors
        n = x.shape[-1]
        gw = (g * x * rstd).reshape(-1, n).sum(0)
        gx_hat = g * w
        gx = rstd * (gx_hat - x * rstd.pow(2) * (gx_hat * x).mean(-1, keepdim=True))
        return gx, gw, None


class FusedRMSNorm(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(n) + 0.5)

    def forward(self, x):
        return RMSNormFn.apply(x, self.weight, 1e-6)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.norm, self.out = nn.Linear(4, 6), FusedRMSNorm(6), nn.Linear(6, 1)

    def forward(self, x):
        h = self.norm(self.inp(x))
        return self.out(h + 0.1 * self.norm.weight)  # a second, plain use of the weight


X = torch.randn(5, 4)


def test_the_function_matches_autograd():
    x, w = torch.randn(3, 6, requires_grad=True), torch.rand(6, requires_grad=True)
    torch.autograd.gradcheck(lambda a, b: RMSNormFn.apply(a, b, 1e-6),
                             (x.double(), w.double()))


def by_hand(net, blocked_weight):
    """The same forward with the norm's weight detached by hand in the fused call."""
    h = net.inp(X)
    w = net.norm.weight.detach() if blocked_weight else net.norm.weight
    h = RMSNormFn.apply(h, w, 1e-6)
    return net.out(h + 0.1 * (net.norm.weight.detach() if blocked_weight else net.norm.weight))


@pytest.mark.parametrize("selector", ["norm", "norm.weight", "*"])
def test_stop_gradient_cuts_the_functions_gradient_for_the_parameter(selector):
    net, ref = Net(), Net()
    with ts.stop_gradient(net, selector):
        net(X).pow(2).sum().backward()
    blocked = ref.norm.weight.detach()
    h = RMSNormFn.apply(ref.inp(X) if selector != "*" else ref.inp(X).detach(), blocked, 1e-6)
    out_w = ref.out.weight if selector != "*" else ref.out.weight.detach()
    out_b = ref.out.bias if selector != "*" else ref.out.bias.detach()
    loss = nn.functional.linear(h + 0.1 * blocked, out_w, out_b).pow(2).sum()
    if loss.requires_grad:
        loss.backward()
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert torch.allclose(p.grad, q.grad, atol=1e-6), name


def test_other_inputs_keep_their_gradients_and_outside_the_block_nothing_is_cut():
    net, ref = Net(), Net()
    x, x_ref = X.clone().requires_grad_(), X.clone().requires_grad_()
    with ts.stop_gradient(net, "norm"):
        y = net.norm(x @ torch.ones(4, 6))
    y.sum().backward()
    RMSNormFn.apply(x_ref @ torch.ones(4, 6), ref.norm.weight.detach(), 1e-6).sum().backward()
    assert net.norm.weight.grad is None
    assert torch.allclose(x.grad, x_ref.grad)
    net(X).sum().backward()  # after the block: the fused call gives the weight its gradient
    ref.zero_grad()
    ref(X).sum().backward()
    assert torch.allclose(net.norm.weight.grad, ref.norm.weight.grad)


def test_the_same_parameter_handed_twice_and_nested_functions():
    class Outer(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, w):
            return RMSNormFn.apply(a, w, 1e-6) * w  # the inner function is handed w as well

        @staticmethod
        def backward(ctx, g):
            return None, g.sum(0)  # a gradient for w, which the block cuts

    norm = FusedRMSNorm(6)
    x = torch.randn(2, 6, requires_grad=True)
    with ts.stop_gradient(norm):
        out = RMSNormFn.apply(RMSNormFn.apply(x, norm.weight, 1e-6), norm.weight, 1e-6)
    out.sum().backward()
    assert norm.weight.grad is None and x.grad is not None
    with ts.stop_gradient(norm):
        nested = Outer.apply(x.detach(), norm.weight)
    nested.sum().backward()
    assert norm.weight.grad is None
    Outer.apply(x.detach(), norm.weight).sum().backward()  # outside the block: not cut
    assert torch.equal(norm.weight.grad, torch.full((6,), 2.0))


def test_swap_is_refused_when_the_function_records_a_backward():
    norm = FusedRMSNorm(6)
    x = torch.randn(2, 6)
    tree = {"weight": torch.full((6,), 2.0)}
    with ts.swap(norm, tree):
        with pytest.raises(RuntimeError, match=r"swap: .*custom autograd function "
                                               r"RMSNormFn\.forward"):
            norm(x)
        with torch.no_grad():  # apply records nothing: the forward sees the swapped weight
            got = norm(x)
    assert torch.allclose(got, RMSNormFn.apply(x, tree["weight"], 1e-6))
    assert norm.weight.grad is None


class SetupContextFn(torch.autograd.Function):
    @staticmethod
    def forward(a, w):
        return a * w

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        a, w = ctx.saved_tensors
        return g * w, g * a


def test_a_forward_without_ctx_is_refused_naming_the_function():
    lin = nn.Linear(2, 2)
    with ts.stop_gradient(lin, "bias"):
        with pytest.raises(RuntimeError, match=r"stop_gradient: .*SetupContextFn\.forward.*"
                                               r"takes no ctx"):
            SetupContextFn.apply(torch.ones(2), lin.bias)
    lin.bias.requires_grad_(False)  # nothing would reach it: no refusal
    with ts.stop_gradient(lin, "bias"):
        SetupContextFn.apply(torch.ones(2), lin.bias)
    assert lin.bias.grad is None


def test_a_refusal_leaves_no_gradient_and_the_block_usable():
    norm = FusedRMSNorm(6)
    with ts.swap(norm, {"weight": torch.ones(6)}):
        with pytest.raises(RuntimeError):
            norm(torch.randn(2, 6))
        assert torch.equal(norm.weight * 1, torch.ones(6))  # still swapped
    assert norm.weight.grad is None and norm.weight.requires_grad


# ------------------------------------------------------------ finding the function's forward
def test_a_function_class_defined_inside_the_block_is_found():
    """The forwards are indexed from the live subclasses of torch.autograd.Function; a class
    defined after the index was read (inside the block, after other calls) is found too."""
    norm = FusedRMSNorm(6)
    x = torch.randn(2, 6, requires_grad=True)
    with ts.stop_gradient(norm):
        RMSNormFn.apply(x, norm.weight, 1e-6).sum().backward()  # the index is read here

        class Late(torch.autograd.Function):
            @staticmethod
            def forward(ctx, a, w):
                return a * w.contiguous()

            @staticmethod
            def backward(ctx, g):
                return g, g.sum(0)

        Late.apply(x, norm.weight).sum().backward()
    assert norm.weight.grad is None
    Late.apply(x, norm.weight).sum().backward()  # outside: the gradient arrives
    assert norm.weight.grad is not None


def test_a_forward_that_rebinds_its_argument_is_cut_by_the_node_s_edges():
    class Rebinds(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, w):
            w = w.contiguous() * 1.0  # the name no longer holds the parameter
            ctx.save_for_backward(w)
            return a * w

        @staticmethod
        def backward(ctx, g):
            (w,) = ctx.saved_tensors
            return g * w, g.sum(0)

    norm = FusedRMSNorm(6)
    x = torch.randn(2, 6, requires_grad=True)
    with ts.stop_gradient(norm):
        Rebinds.apply(x, norm.weight).sum().backward()
    assert norm.weight.grad is None
    torch.testing.assert_close(x.grad, norm.weight.detach().expand(2, 6))


@pytest.mark.skipif(not APPLY_TAKES_KEYWORDS, reason="Function.apply takes no keyword arguments")
def test_a_forward_without_ctx_called_by_keyword_is_refused():
    lin = nn.Linear(2, 2)
    with ts.stop_gradient(lin, "bias"):
        with pytest.raises(RuntimeError, match=r"SetupContextFn\.forward.*takes no ctx"):
            SetupContextFn.apply(torch.ones(2), w=lin.bias)
    assert lin.bias.grad is None


def test_the_index_is_read_again_only_for_code_not_seen_before(monkeypatch, lookup):
    from torchstruct import _custom_functions

    if lookup != "forward code":
        pytest.skip("the index is read only where the forward is found by its code")

    reads = []
    real = _custom_functions._index
    monkeypatch.setattr(_custom_functions, "_index", lambda: (reads.append(1), real())[1])
    net = Net()

    def step():
        with ts.stop_gradient(net, "norm"), torch.no_grad():
            net(X)
        with ts.stop_gradient(net, "norm"):
            net(X).sum().backward()

    _custom_functions._OTHERS.clear()  # forget what was classified: the first step reads
    step()
    assert reads  # the index was read
    step()
    first = len(reads)
    step()
    assert len(reads) == first  # the same code: classified already


class AmpScaled(torch.autograd.Function):
    """forward/backward under torch.amp.custom_fwd / custom_bwd (a decorator taking *args)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, a, w):
        ctx.save_for_backward(a, w)
        return a * w.contiguous()

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, g):
        a, w = ctx.saved_tensors
        return g * w, (g * a).sum(0)


def test_a_decorated_forward_is_found_and_cut():
    norm = FusedRMSNorm(6)
    x = torch.randn(2, 6, requires_grad=True)
    with ts.stop_gradient(norm):
        AmpScaled.apply(x, norm.weight).sum().backward()
    assert norm.weight.grad is None
    torch.testing.assert_close(x.grad, norm.weight.detach().expand(2, 6))
    AmpScaled.apply(x, norm.weight).sum().backward()
    assert norm.weight.grad is not None


def test_a_decorated_forward_under_swap_is_refused_naming_it():
    norm = FusedRMSNorm(6)
    with ts.swap(norm, {"weight": torch.ones(6)}):
        with pytest.raises(RuntimeError, match=r"swap: .*AmpScaled\.forward"):
            AmpScaled.apply(torch.randn(2, 6), norm.weight)
