"""A general p (not 1, 2 or inf): ``ts.global_norm``, ``ts.clip_by_global_norm`` and the
optimizers' ``max_grad_norm`` against an exact oracle in decimal arithmetic (60 digits, an
exponent range far beyond float64's), on every backend. Each tensor is scaled by its largest
element before its powers are taken, so the norm is exact wherever it is representable, also
where ``|x|^p`` alone leaves float64's range (docs/clipping.md)."""
import decimal
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import torchstruct as ts
from torchstruct import _reference
from _models import holders

INF, NAN = float("inf"), float("nan")


def exact_norm(tensors, p) -> float:
    """The p-norm of all elements, in 60-digit decimal arithmetic, rounded to a float."""
    with decimal.localcontext() as ctx:
        ctx.prec = 60
        ctx.Emax, ctx.Emin = 10**6, -10**6
        dp = decimal.Decimal(repr(float(p)))
        total = decimal.Decimal(0)
        for t in tensors:
            for v in t.detach().double().reshape(-1).tolist():
                if v != 0.0:
                    total += decimal.Decimal(repr(abs(v))) ** dp
        return 0.0 if total == 0 else float(total ** (1 / dp))


def as_result(value: float, tensors) -> float:
    """``value`` rounded to the dtype the norm is returned in."""
    return float(torch.tensor(value, dtype=torch.float64).to(_reference.result_dtype(tensors)))


@st.composite
def tensor_lists(draw):
    dtype = draw(st.sampled_from([torch.float64, torch.float32]))
    lo, hi = (-250, 250) if dtype == torch.float64 else (-30, 30)  # log10 of a tensor's scale
    out = []
    for _ in range(draw(st.integers(1, 4))):
        n = draw(st.integers(0, 12))
        scale = 10.0 ** draw(st.floats(lo, hi))
        values = draw(st.lists(st.floats(-1, 1), min_size=n, max_size=n))
        out.append(torch.tensor(values, dtype=torch.float64).mul(scale).to(dtype))
    return out


P = st.one_of(st.floats(0.5, 600), st.sampled_from([0.5, 1.5, 3.0, 120.0, 200.0]))


@settings(max_examples=120, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tensors=tensor_lists(), p=P)
def test_global_norm_is_exact(backend, tensors, p):
    want = as_result(exact_norm(tensors, p), tensors)
    got = ts.global_norm(tensors, p)
    assert got.dtype == _reference.result_dtype(tensors)
    tol = 1e-12 if all(t.dtype == torch.float64 for t in tensors) else 2e-6
    assert math.isclose(float(got), want, rel_tol=tol, abs_tol=0.0), (float(got), want)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tensors=tensor_lists(), p=P, ratio=st.floats(0.01, 2.0))
def test_clip_scales_by_the_exact_norm(backend, tensors, p, ratio):
    """The coefficient comes from the exact norm: the clipped gradients are the originals
    times ``min(max_norm / (norm + 1e-6), 1)`` (in the gradients' dtype), never zeroed, never
    left unclipped when the norm is above ``max_norm``."""
    norm = exact_norm(tensors, p)
    max_norm = norm * ratio
    params = holders(tensors)
    total = ts.clip_by_global_norm(params, max_norm, p)
    assert math.isclose(float(total), as_result(norm, tensors), rel_tol=2e-6)
    coef = min(max_norm / (norm + 1e-6), 1.0)
    for w, g in zip(params, tensors):
        want = (g.double() * coef).to(g.dtype)
        torch.testing.assert_close(w.grad, want, rtol=2e-6, atol=0.0)


@pytest.mark.parametrize("p, value, n", [(200.0, 100.0, 4), (120.0, 1e-3, 4), (50.0, 1e300, 3),
                                         (4747.0, 0.85, 10), (3.0, 1e-310, 5)])
def test_powers_out_of_float64_range(backend, p, value, n):
    """``|x|^p`` overflows or underflows in float64 (or the elements are subnormal) while
    the norm, ``value * n^(1/p)``, is an ordinary number."""
    g = torch.full((n,), value, dtype=torch.float64)
    want = value * n ** (1 / p)
    assert math.isclose(float(ts.global_norm([g], p)), want, rel_tol=1e-12)
    assert math.isclose(float(ts.global_norm([g[:1], g[1:]], p)), want, rel_tol=1e-12)
    (w,) = holders([g])
    total = ts.clip_by_global_norm([w], want / 2, p)
    assert math.isclose(float(total), want, rel_tol=1e-12)
    torch.testing.assert_close(w.grad, g * (want / 2 / (want + 1e-6)), rtol=1e-12, atol=0.0)


@pytest.mark.parametrize("p", [0.5, 3.0, 300.0])
def test_non_finite_and_zero_elements(backend, p):
    assert float(ts.global_norm([torch.zeros(3), torch.zeros(0)], p)) == 0.0
    assert float(ts.global_norm([torch.tensor([1.0, INF]), torch.ones(2)], p)) == INF
    assert math.isnan(float(ts.global_norm([torch.tensor([INF]), torch.tensor([NAN, 1.0])], p)))
    assert math.isnan(float(ts.global_norm([torch.tensor([1e30, NAN])], p)))
    with pytest.raises(RuntimeError, match="non-finite"):
        w = holders([torch.tensor([1.0, INF])])
        ts.clip_by_global_norm(w, 1.0, p, error_if_nonfinite=True)
    assert torch.equal(w[0].grad, torch.tensor([1.0, INF]))  # nothing written


def test_a_norm_beyond_float64_is_inf(backend):
    g = torch.full((8,), 1e308, dtype=torch.float64)  # the norm: 2e308
    assert float(ts.global_norm([g], 3.0)) == INF
    assert float(ts.global_norm([g[:4], g[4:]], 3.0)) == INF


@pytest.mark.parametrize("p", [1.5, 3.0, 7.0])
def test_reference_is_differentiable_as_torch(p):
    """The scale is a constant for autograd: the gradient of the norm is torch's."""
    torch.manual_seed(0)
    a = torch.randn(5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda x, y: _reference.global_norm([x, y], p), (a, b))
    ga, gb = torch.autograd.grad(ts.global_norm([a, b], p), (a, b))
    wa, wb = torch.autograd.grad(
        torch.linalg.vector_norm(torch.cat([a, b.reshape(-1)]), p), (a, b))
    torch.testing.assert_close((ga, gb), (wa, wb), rtol=1e-12, atol=0.0)


@pytest.mark.parametrize("opt", ["SGD", "AdamW"])
def test_optimizer_max_grad_norm_with_a_large_p(opt):
    """An optimizer clipping by a norm whose powers overflow float64 steps as one clipped by
    hand with the exact coefficient."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(6, dtype=torch.float64))
    ref = nn.Parameter(w.detach().clone())
    g = torch.full((6,), 50.0, dtype=torch.float64)
    w.grad, ref.grad = g.clone(), g.clone()
    norm = 50.0 * 6 ** (1 / 250)
    ours = getattr(ts.optim, opt)([w], lr=0.1, max_grad_norm=1.0, norm_type=250.0)
    theirs = getattr(torch.optim, opt)([ref], lr=0.1)
    ref.grad.mul_(1.0 / (norm + 1e-6))
    ours.step()
    theirs.step()
    torch.testing.assert_close(w, ref, rtol=1e-12, atol=1e-15)


def test_compiled_clip_with_a_general_p():
    torch.manual_seed(0)
    grads = [torch.randn(4, 3) * 1e20, torch.randn(7) * 1e20]
    params, want = holders(grads), holders(grads)
    ts.clip_by_global_norm(want, 1.0, 40.0)

    @torch.compile(backend="eager", fullgraph=True)
    def clip(ps):
        return ts.clip_by_global_norm(ps, 1.0, 40.0)

    total = clip(params)
    assert math.isclose(float(total), exact_norm(grads, 40.0), rel_tol=2e-6)
    for p, q in zip(params, want):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0.0)
