"""within_gradient: one test per differentiation mode, plus a dropout-like layer that switches
on it and must give the hand-computed gradient in each mode."""
import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch import nn
from torch.func import functional_call, grad, jacrev, jvp, vjp, vmap
from torch.utils.checkpoint import checkpoint

import torchstruct as ts

MASK = torch.tensor([1.0, 0.0, 1.0, 1.0])
SCALE = 4.0 / 3.0
W = torch.tensor([0.5, -1.0, 2.0, 3.0])


def drop(x):
    """Dropout-like: a fixed mask, rescaled, applied only while differentiating."""
    return x * MASK * SCALE if ts.within_gradient(x) else x


def loss(x):
    return (W * drop(x)).sum()


DROPPED = W * MASK * SCALE  # d loss / dx when the mask is applied


def x0(requires_grad=False):
    return torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=requires_grad)


def test_eager_with_requires_grad():
    x = x0(True)
    assert ts.within_gradient(x)
    assert ts.within_gradient(x * 2)  # intermediate results too
    loss(x).backward()
    torch.testing.assert_close(x.grad, DROPPED)


def test_eager_without_requires_grad():
    x = x0()
    assert not ts.within_gradient(x)
    assert torch.equal(drop(x), x)
    assert ts.within_gradient(x, x0(True))  # any of xs


def test_no_grad():
    x = x0(True)
    with torch.no_grad():
        assert not ts.within_gradient(x)
        assert torch.equal(drop(x), x)


def test_inference_mode():
    x = x0(True)
    with torch.inference_mode():
        assert not ts.within_gradient(x)
        assert torch.equal(drop(x), x)


def test_func_grad():
    seen = []

    def f(x):
        seen.append(ts.within_gradient(x))
        return loss(x)

    torch.testing.assert_close(grad(f)(x0()), DROPPED)
    assert seen == [True]
    with torch.no_grad():  # torch.func.grad ignores an outer no_grad: still differentiating
        torch.testing.assert_close(grad(f)(x0()), DROPPED)


def test_func_grad_with_vmap_inside():
    def f(xs):
        return vmap(loss)(xs).sum()

    xs = torch.stack([x0(), 2 * x0()])
    torch.testing.assert_close(grad(f)(xs), DROPPED.expand(2, 4))


def test_func_vjp():
    out, pullback = vjp(drop, x0())
    torch.testing.assert_close(out, x0() * MASK * SCALE)
    (g,) = pullback(W)
    torch.testing.assert_close(g, DROPPED)


def test_func_jacrev():
    torch.testing.assert_close(jacrev(drop)(x0()), torch.diag(MASK * SCALE))
    torch.testing.assert_close(jacrev(jacrev(loss))(x0()), torch.zeros(4, 4))


def test_forward_ad_dual():
    tangent = torch.ones(4)
    with fwAD.dual_level():
        d = fwAD.make_dual(x0(), tangent)
        assert ts.within_gradient(d)
        assert not ts.within_gradient(x0())
        y = drop(d)
        torch.testing.assert_close(fwAD.unpack_dual(y).tangent, MASK * SCALE)
        with torch.no_grad():  # no_grad does not stop forward mode in PyTorch
            assert ts.within_gradient(d)
        with torch.inference_mode():
            assert not ts.within_gradient(d)
    assert not ts.within_gradient(x0())


def test_func_jvp():
    seen = []

    def f(x):
        seen.append(ts.within_gradient(x))
        return drop(x)

    out, tangent_out = jvp(f, (x0(),), (W,))
    torch.testing.assert_close(out, x0() * MASK * SCALE)
    torch.testing.assert_close(tangent_out, DROPPED)
    assert seen == [True]


def test_checkpoint_recompute():
    seen = []

    def block(x):
        seen.append((ts.within_gradient(x), torch._C._current_graph_task_id() != -1))
        return drop(x) * 2

    x = x0(True)
    y = checkpoint(block, x, use_reentrant=False)
    assert seen == [(True, False)]  # the forward pass
    (W * y).sum().backward()
    assert seen == [(True, False), (True, True)]  # the recompute, inside backward
    torch.testing.assert_close(x.grad, 2 * DROPPED)


def _compiled_drop():
    torch._dynamo.reset()
    return torch.compile(drop, fullgraph=True, backend="aot_eager")


def test_compile_fullgraph_with_grad():
    cdrop = _compiled_drop()
    x = x0(True)
    y = cdrop(x)
    torch.testing.assert_close(y, x0() * MASK * SCALE)
    (W * y).sum().backward()
    torch.testing.assert_close(x.grad, DROPPED)


def test_compile_fullgraph_without_grad():
    cdrop = _compiled_drop()
    cdrop(x0(True))  # compile the differentiating branch first: the guards must switch
    torch.testing.assert_close(cdrop(x0()), x0())
    with torch.no_grad():
        torch.testing.assert_close(cdrop(x0(True)), x0())
    torch.testing.assert_close(cdrop(x0(True)), x0() * MASK * SCALE)


def test_compile_fullgraph_explain_has_no_break():
    explanation = torch._dynamo.explain(drop)(x0(True))
    assert explanation.graph_break_count == 0


class Noisy(nn.Module):
    """A layer that switches on whether its own parameters are being differentiated."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        y = self.w * x
        return y * MASK * SCALE if ts.within_gradient(self) else y


def test_modules():
    m = Noisy()
    assert ts.within_gradient(m)
    with torch.no_grad():
        assert not ts.within_gradient(m)
    (W * m(x0())).sum().backward()
    torch.testing.assert_close(m.w.grad, W * x0() * MASK * SCALE)
    m.requires_grad_(False)
    assert not ts.within_gradient(m)
    assert ts.within_gradient(m, x0(True))
    assert not ts.within_gradient(nn.ReLU())  # no parameters


def test_module_under_functional_call_grad():
    m = Noisy().requires_grad_(False)
    params = {"w": torch.ones(4)}
    g = grad(lambda p: (W * functional_call(m, p, (x0(),))).sum())(params)
    torch.testing.assert_close(g["w"], W * x0() * MASK * SCALE)


def test_bad_argument_and_no_argument():
    assert ts.within_gradient() is False
    with pytest.raises(TypeError, match="argument 1"):
        ts.within_gradient(x0(), 3.0)
