"""Outside-eyes audit of a general norm type p (not 1, 2 or inf) in ``ts.global_norm``,
``ts.clip_by_global_norm`` / ``ts.clip_grad_norm_`` and the optimizers' ``max_grad_norm`` +
``norm_type``: every element is divided by the largest magnitude before its power is taken, so
the norm must be exact (to rounding) wherever it is representable in the result dtype, even
where ``|x|^p`` leaves float64's range (docs/clipping.md).

Oracles: Python ``decimal`` (60 digits, exponents up to +-10**7), ``torch.nn.utils.
clip_grad_norm_`` / ``torch.linalg.vector_norm`` where those are exact (moderate p and values),
and brute force. Tests marked ``xfail(strict=True)`` pin bugs found by this audit.
"""
import decimal
import functools
import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn

import torchstruct as ts
from torchstruct import _ops, _reference
from _models import TiedLM, holders

INF, NAN = float("inf"), float("nan")
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]

requires_compiled = pytest.mark.skipif(not _ops.compiled_available(),
                                       reason="torchstruct._C is not built")


# --------------------------------------------------------------------------- oracles / helpers


def exact_norm(tensors, p) -> float:
    """The p-norm of every element of ``tensors`` (as stored), in 60-digit decimal arithmetic
    with a huge exponent range, rounded once to a Python float (inf beyond float64, NaN for
    any NaN, inf for any inf)."""
    values = [v for t in tensors for v in t.detach().double().reshape(-1).tolist()]
    if any(math.isnan(v) for v in values):
        return NAN
    if any(math.isinf(v) for v in values):
        return INF
    with decimal.localcontext() as ctx:
        ctx.prec = 60
        ctx.Emax, ctx.Emin = 10**7, -10**7
        dp = decimal.Decimal(float(p))  # exact binary value of p
        total = decimal.Decimal(0)
        for v in values:
            if v != 0.0:
                total += decimal.Decimal(abs(v)) ** dp
        if total == 0:
            return 0.0
        return float(total ** (decimal.Decimal(1) / dp))


def exact_grad_of_norm(values, p):
    """d||x||_p / dx_i = sign(x_i) (|x_i| / ||x||)^(p-1), exactly (decimal), as floats."""
    with decimal.localcontext() as ctx:
        ctx.prec = 60
        ctx.Emax, ctx.Emin = 10**7, -10**7
        dp = decimal.Decimal(float(p))
        xs = [decimal.Decimal(v) for v in values]
        norm = sum((abs(x) ** dp for x in xs if x != 0), decimal.Decimal(0)) ** (1 / dp)
        return [float((abs(x) / norm) ** (dp - 1)) * (1 if x > 0 else -1) if x != 0 else 0.0
                for x in xs]


def subnormal(dtype) -> float:
    f = torch.finfo(dtype)
    return f.tiny * f.eps


def assert_norm(got: torch.Tensor, exact: float, dtype: torch.dtype, rtol: float):
    """``got`` (a 0-dim tensor of ``dtype``) is ``exact`` rounded to ``dtype`` to within
    ``rtol`` (plus the dtype's own rounding and its smallest subnormal); inf exactly where the
    exact norm is beyond the dtype's largest finite value."""
    assert got.dtype == dtype, (got.dtype, dtype)
    assert got.dim() == 0
    g = float(got)
    if math.isnan(exact):
        assert math.isnan(g), g
        return
    fmax = torch.finfo(dtype).max
    rtol = max(rtol, torch.finfo(dtype).eps)
    if exact > fmax * (1 + rtol):
        assert g == INF, (g, exact)
    elif exact < fmax * (1 - rtol):
        assert math.isfinite(g), (g, exact)
        assert abs(g - exact) <= rtol * exact + 2 * subnormal(dtype), (g, exact, g / exact - 1
                                                                       if exact else None)
    # (within rtol of the largest finite value: either is right)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit pattern of ``t`` (NaN-safe bitwise comparison)."""
    view = {8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()]
    return t.detach().contiguous().view(view).clone()


def promoted(tensors):
    return functools.reduce(torch.promote_types, [t.dtype for t in tensors])


def norm_dtype(tensors):
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def work_rtol(tensors):
    """Tolerance of a general-p norm: float64 work when a non-empty float64 is present."""
    return 1e-12 if any(t.dtype == torch.float64 and t.numel() for t in tensors) else 2e-5


# --------------------------------------------------------------------------- hypothesis

#: log10 of the smallest subnormal and largest finite value of each dtype (a little inside)
LOG10_RANGE = {torch.float16: (-7.2, 4.8), torch.bfloat16: (-40.0, 38.5),
               torch.float32: (-44.8, 38.5), torch.float64: (-323.0, 308.0)}

P_STRATEGY = st.one_of(
    st.floats(0.05, 0.999),                       # p in (0, 1)
    st.floats(1.001, 1.999), st.floats(2.001, 12.0),
    st.floats(12.0, 5000.0),                      # large p: |x|^p far out of range
    st.sampled_from([0.5, 1.5, 3.0, 120.0, 200.0, 4747.0]),
)


@st.composite
def tensor_lists(draw):
    """(p, list of 1-4 tensors of any float dtype, 0-8 elements each) spanning many orders of
    magnitude, with zeros and subnormals."""
    p = draw(P_STRATEGY)
    k = draw(st.integers(1, 4))
    dtypes = [draw(st.sampled_from(DTYPES)) for _ in range(k)]
    lengths = [draw(st.integers(0, 8)) for _ in range(k)]
    f64 = any(d == torch.float64 and n for d, n in zip(dtypes, lengths))
    lo, hi = (-320.0, 308.0) if f64 else (-44.0, 38.5)
    center = draw(st.floats(lo, hi))
    spread = draw(st.floats(0, 600.0 if f64 else 80.0))
    out = []
    for dtype, n in zip(dtypes, lengths):
        dlo, dhi = LOG10_RANGE[dtype]
        values = []
        for _ in range(n):
            if draw(st.integers(0, 7)) == 0:
                values.append(0.0)
                continue
            e = min(max(center - draw(st.floats(0, 1)) * spread, dlo), dhi)
            sign = -1.0 if draw(st.booleans()) else 1.0
            values.append(sign * 10.0 ** e)
        out.append(torch.tensor(values, dtype=torch.float64).to(dtype))
    return p, out


HYP = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                 HealthCheck.too_slow])


@settings(max_examples=150, **HYP)
@given(case=tensor_lists())
def test_hypothesis_global_norm_matches_decimal(backend, case):
    p, tensors = case
    got = ts.global_norm(tensors, p)
    assert_norm(got, exact_norm(tensors, p), norm_dtype(tensors), work_rtol(tensors))
    # the same through a dict tree and as a generator: same value
    tree = {f"t{i}": {"w": t} for i, t in enumerate(tensors)}
    assert bits(ts.global_norm(tree, p)).equal(bits(got))
    assert bits(ts.global_norm((t for t in tensors), p)).equal(bits(got))


@settings(max_examples=100, **HYP)
@given(case=tensor_lists(), ratio=st.floats(0.01, 2.0))
def test_hypothesis_clip_scales_by_the_exact_norm(backend, case, ratio):
    p, tensors = case
    exact = exact_norm(tensors, p)
    ndtype = norm_dtype(tensors)
    fmax = torch.finfo(ndtype).max
    assume(not (fmax * 0.999 < exact < fmax * 1.001))  # either side of overflow is right there
    # (a max_norm beyond the norm dtype with an inf norm gives inf/inf = NaN, as in torch)
    max_norm = exact * ratio if 0 < exact < fmax else 1.0
    assume(max_norm < fmax)
    params = holders(tensors)
    total = ts.clip_by_global_norm(params, max_norm, p)
    assert_norm(total, exact, promoted(tensors), work_rtol(tensors))
    coef = 0.0 if exact > fmax else min(max_norm / (exact + 1e-6), 1.0)
    for w, g in zip(params, tensors):
        want = (g.double() * coef).to(g.dtype)
        rtol = max(work_rtol(tensors), torch.finfo(g.dtype).eps) * 2
        torch.testing.assert_close(w.grad, want, rtol=rtol, atol=subnormal(g.dtype))
        assert not w.grad.isnan().any()


# --------------------------------------------------------------------------- exact cases


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p, value, n", [(200.0, 100.0, 4), (120.0, 1e-3, 5), (4747.0, 0.85, 9),
                                         (0.5, 3.0, 7), (0.05, 2.0, 3), (33.3, 2e4, 1000)])
def test_powers_out_of_range_every_dtype(backend, dtype, p, value, n):
    """``|x|^p`` overflows or underflows even float64 while the norm ``value n^(1/p)`` is an
    ordinary number: exact in every gradient dtype, split over tensors or not, clipped by
    it (torch's own clip_grad_norm_ gets inf/0 here and zeroes or leaves the gradients)."""
    g = torch.full((n,), value, dtype=torch.float64).to(dtype)
    want = exact_norm([g], p)
    rtol = 1e-12 if dtype == torch.float64 else 2e-5
    assert_norm(ts.global_norm([g], p), want, norm_dtype([g]), rtol)
    assert_norm(ts.global_norm([g[:1], g[1:], g[:0]], p), want, norm_dtype([g]), rtol)
    (w,) = holders([g])
    max_norm = want / 2
    total = ts.clip_by_global_norm([w], max_norm, p)
    assert_norm(total, want, dtype, rtol)
    coef = max_norm / (want + 1e-6)
    torch.testing.assert_close(w.grad, (g.double() * coef).to(dtype),
                               rtol=max(2 * rtol, torch.finfo(dtype).eps), atol=0.0)


@pytest.mark.parametrize("p", [0.5, 1.5, 3.0, 7.5, 13.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_torch_on_moderate_values(backend, p, dtype):
    """Moderate p and values: the same norm and the same clipped gradients as
    torch.nn.utils.clip_grad_norm_ and torch.linalg.vector_norm."""
    torch.manual_seed(1)
    grads = [torch.randn(7, 5, dtype=dtype), torch.randn(3, dtype=dtype) * 4,
             torch.randn(0, dtype=dtype), torch.randn(2, 2, 2, dtype=dtype)]
    flat = torch.cat([g.reshape(-1) for g in grads])
    rtol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(ts.global_norm(grads, p),
                               torch.linalg.vector_norm(flat.double(), p).to(dtype),
                               rtol=rtol, atol=0.0)
    ours, theirs = holders(grads), holders(grads)
    a = ts.clip_by_global_norm(ours, 0.3, p)
    b = torch.nn.utils.clip_grad_norm_(theirs, 0.3, p)
    assert a.dtype == b.dtype == dtype
    torch.testing.assert_close(a, b, rtol=rtol, atol=0.0)
    for w, h in zip(ours, theirs):
        torch.testing.assert_close(w.grad, h.grad, rtol=rtol, atol=1e-30)
    # and the alias is the same function
    again = holders(grads)
    c = ts.clip_grad_norm_(again, 0.3, p)
    assert bits(c).equal(bits(a))
    assert all(bits(x.grad).equal(bits(y.grad)) for x, y in zip(again, ours))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", [0.5, 3.0])
def test_subnormal_values(backend, dtype, p):
    """Gradients in each dtype's subnormal range (and mixed with normal ones)."""
    tiny = subnormal(dtype)
    g = torch.tensor([tiny, 3 * tiny, 17 * tiny, 0.0, -5 * tiny], dtype=dtype)
    assert (g[g != 0].abs() < torch.finfo(dtype).tiny).all()  # really subnormal
    want = exact_norm([g], p)
    rtol = 1e-12 if dtype == torch.float64 else 2e-5
    assert_norm(ts.global_norm([g], p), want, norm_dtype([g]), rtol)
    mixed = [g, torch.tensor([1.0], dtype=dtype)]
    assert_norm(ts.global_norm(mixed, p), exact_norm(mixed, p), norm_dtype(mixed), rtol)
    (w,) = holders([g])
    total = ts.clip_by_global_norm([w], 1.0, p)  # no clipping: gradients bitwise the same
    assert_norm(total, want, dtype, rtol)
    assert bits(w.grad).equal(bits(g))


# --------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("dtypes", [(torch.float16,), (torch.bfloat16,), (torch.float32,),
                                    (torch.float64,), (torch.float16, torch.bfloat16),
                                    (torch.float16, torch.float32), (torch.bfloat16, torch.float64),
                                    (torch.float16, torch.bfloat16, torch.float32, torch.float64)])
@pytest.mark.parametrize("p", [0.5, 3.0, 250.0])
def test_returned_dtypes(backend, dtypes, p):
    grads = [torch.full((3,), 1.5 + i, dtype=d) for i, d in enumerate(dtypes)]
    n = ts.global_norm(grads, p)
    assert n.dtype == (torch.float64 if torch.float64 in dtypes else torch.float32)
    assert n.device == grads[0].device and n.dim() == 0
    ref = holders(grads)
    want = torch.nn.utils.clip_grad_norm_(ref, 1e9, 2.0)  # the dtype torch returns
    total = ts.clip_by_global_norm(holders(grads), 1e9, p)
    assert total.dtype == want.dtype == promoted(grads)
    assert_norm(total, exact_norm(grads, p), total.dtype, work_rtol(grads))
    # empty tensors only: zero of the right dtype; nothing at all: tensor(0.)
    empties = [torch.zeros(0, dtype=d) for d in dtypes]
    z = ts.global_norm(empties, p)
    assert z.dtype == n.dtype and float(z) == 0.0
    zc = ts.clip_by_global_norm(holders(empties), 1.0, p)
    assert float(zc) == 0.0 and not zc.isnan()
    e = ts.global_norm([], p)
    assert e.dtype == torch.float32 and float(e) == 0.0
    assert float(ts.clip_by_global_norm([], 1.0, p)) == 0.0


# --------------------------------------------------------------------------- non-finite / zero


@pytest.mark.parametrize("p", [0.05, 0.5, 3.0, 300.0])
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_zero_gradients(backend, p, dtype):
    grads = [torch.zeros(5, dtype=dtype), torch.zeros(0, dtype=dtype), torch.zeros(2, 3, dtype=dtype)]
    n = ts.global_norm(grads, p)
    assert float(n) == 0.0 and not n.isnan()
    for max_norm in (1.0, 0.0):
        params = holders(grads)
        total = ts.clip_by_global_norm(params, max_norm, p, error_if_nonfinite=True)
        assert float(total) == 0.0 and total.dtype == dtype
        for w in params:
            assert not w.grad.isnan().any() and (w.grad == 0).all()
    # max_norm 0 with non-zero gradients: zeroed, nothing NaN
    (w,) = holders([torch.tensor([1.0, -2.0, 0.0], dtype=dtype)])
    ts.clip_by_global_norm([w], 0.0, p)
    assert (w.grad == 0).all() and not w.grad.isnan().any()


@pytest.mark.parametrize("p", [0.5, 3.0, 300.0])
@pytest.mark.parametrize("where", [0, 1, 2])
def test_nan_anywhere_gives_nan(backend, p, where):
    grads = [torch.tensor([1e30, -2.0]), torch.tensor([3.0, 4.0], dtype=torch.float16),
             torch.tensor([1e-30, 5.0, INF], dtype=torch.float64)]
    grads[where] = grads[where].clone()
    grads[where][0] = NAN
    assert math.isnan(float(ts.global_norm(grads, p)))
    ours, theirs = holders(grads), holders(grads)
    total = ts.clip_by_global_norm(ours, 1.0, p)
    assert math.isnan(float(total)) and total.dtype == torch.float64
    torch.nn.utils.clip_grad_norm_(theirs, 1.0, p)
    for w, h in zip(ours, theirs):
        assert w.grad.isnan().all()  # NaN norm: every gradient NaN, as torch
        assert h.grad.isnan().all()


@pytest.mark.parametrize("p", [0.5, 3.0, 300.0])
@pytest.mark.parametrize("dtype", DTYPES)
def test_inf_gives_inf_and_zeroes_finite_elements(backend, p, dtype):
    grads = [torch.tensor([1.0, -INF, 2.0], dtype=dtype), torch.tensor([3.0, 0.0], dtype=dtype)]
    assert float(ts.global_norm(grads, p)) == INF
    assert float(ts.global_norm(grads[::-1], p)) == INF
    ours, theirs = holders(grads), holders(grads)
    total = ts.clip_by_global_norm(ours, 1.0, p)
    want = torch.nn.utils.clip_grad_norm_(theirs, 1.0, p)
    assert float(total) == INF and total.dtype == want.dtype == dtype
    for w, h in zip(ours, theirs):  # finite elements zeroed, inf * 0 = NaN, as torch
        torch.testing.assert_close(w.grad, h.grad, rtol=0, atol=0, equal_nan=True)
    assert (ours[1].grad == 0).all() and ours[0].grad[1].isnan()


def test_combine_norms_is_scaled():
    """``_reference.combine_norms`` (several devices, DTensor groups): exact where the parts'
    p-th powers are out of range; inf / NaN propagate."""
    for dtype in (torch.float32, torch.float64):
        parts = [torch.tensor(100.0, dtype=dtype)] * 4
        got = _reference.combine_norms(parts, 200.0)
        assert_norm(got, 100.0 * 4 ** (1 / 200), dtype, 1e-6 if dtype == torch.float32 else 1e-13)
        parts = [torch.tensor(1e-3, dtype=dtype), torch.tensor(2e-3, dtype=dtype)]
        assert_norm(_reference.combine_norms(parts, 120.0), exact_norm([torch.stack(parts)], 120.0),
                    dtype, 1e-6 if dtype == torch.float32 else 1e-13)
    mixed = [torch.tensor(3.0), torch.tensor(4.0, dtype=torch.float64)]
    got = _reference.combine_norms(mixed, 3.0)
    assert got.dtype == torch.float64 and math.isclose(float(got), 91 ** (1 / 3), rel_tol=1e-14)
    assert float(_reference.combine_norms([torch.tensor(1.0), torch.tensor(INF)], 3.0)) == INF
    assert math.isnan(float(_reference.combine_norms([torch.tensor(INF), torch.tensor(NAN)], 3.0)))
    assert math.isnan(float(_reference.combine_norms([torch.tensor(NAN), torch.tensor(INF)], 3.0)))
    assert float(_reference.combine_norms([torch.tensor(0.0)] * 3, 0.5)) == 0.0


# --------------------------------------------------------------------------- overflow of the result


@pytest.mark.parametrize("p", [3.0, 0.5, 40.0])
def test_fp16_norm_above_65504_is_inf_but_clips_by_the_exact_norm(backend, p):
    """docs/clipping.md: fp16 gradients whose norm does not fit fp16 return inf, while the
    gradients are clipped by the exact (fp32) norm, not zeroed; error_if_nonfinite raises."""
    g = torch.full((1000,), 60000.0, dtype=torch.float16)
    exact = exact_norm([g[:1]], p) * 1000 ** (1 / p)  # (exact_norm on 1000 equal values: slow)
    assert exact > 65504
    n32 = ts.global_norm([g], p)  # the fp32 norm is finite and exact
    assert_norm(n32, exact, torch.float32, 2e-5)
    (w,) = holders([g])
    total = ts.clip_by_global_norm([w], 1.0, p)
    assert total.dtype == torch.float16 and float(total) == INF
    torch.testing.assert_close(w.grad, (g.double() / (exact + 1e-6)).half(), rtol=1e-3, atol=0.0)
    (w,) = holders([g])
    with pytest.raises(RuntimeError, match="non-finite"):
        ts.clip_by_global_norm([w], 1.0, p, error_if_nonfinite=True)
    assert bits(w.grad).equal(bits(g))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_norm_beyond_the_result_dtype_is_inf(backend, dtype):
    big = {torch.float32: 3e38, torch.bfloat16: 3e38, torch.float64: 1.7e308}[dtype]
    g = torch.full((8,), big, dtype=torch.float64).to(dtype)
    assert float(ts.global_norm([g], 3.0)) == INF
    assert float(ts.global_norm([g[:4], g[4:]], 3.0)) == INF
    # but the norm of the largest representable p (one element) is exactly that element
    assert float(ts.global_norm([g[:1]], 3.0)) == float(g[0])
    (w,) = holders([g])
    with pytest.raises(RuntimeError, match="non-finite"):
        ts.clip_by_global_norm([w], 1.0, 3.0, error_if_nonfinite=True)
    assert bits(w.grad).equal(bits(g))
    total = ts.clip_by_global_norm([w], 1.0, 3.0)
    assert float(total) == INF and total.dtype == dtype


# --------------------------------------------------------------------------- error_if_nonfinite


def _model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(dtype)
    m(torch.randn(5, 3, dtype=dtype)).pow(2).sum().backward()
    return m


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
@pytest.mark.parametrize("form", ["list", "tuple", "tensor", "module", "tree"])
@pytest.mark.parametrize("p", [0.5, 7.0])
def test_error_if_nonfinite_raises_and_changes_nothing(backend, bad, form, p):
    m = _model()
    params = list(m.parameters())
    params[2].grad[1, 3] = bad
    before = [bits(q.grad) for q in params]
    if form == "list":
        target = params
    elif form == "tuple":
        target = tuple(params)
    elif form == "tensor":
        target = params[2]
    elif form == "module":
        target = m
    else:
        target = {"a": {"w": params[0].grad, "b": params[1].grad},
                  "c": {"w": params[2].grad, "b": params[3].grad, "none": None}}
    with pytest.raises(RuntimeError, match="non-finite"):
        ts.clip_by_global_norm(target, 1e-3, p, error_if_nonfinite=True)
    assert all(bits(q.grad).equal(b) for q, b in zip(params, before))


@pytest.mark.parametrize("form", ["list", "tuple", "generator", "module", "tree"])
@pytest.mark.parametrize("p", [0.5, 7.0, 250.0])
def test_error_if_nonfinite_finite_same_result(backend, form, p):
    """With finite gradients, error_if_nonfinite=True (a different code path: the norm, a
    check, then the scale) gives bitwise what the default gives; foreach= is ignored."""
    results = []
    for flag in (False, True):
        m = _model(seed=5)
        for q in m.parameters():
            q.grad.mul_(300.0)  # |g|^250 overflows float64
        params = list(m.parameters())
        target = {"list": params, "tuple": tuple(params), "generator": (q for q in params),
                  "module": m,
                  "tree": {"l0": {"w": params[0].grad, "b": params[1].grad},
                           "l2": {"w": params[2].grad, "b": params[3].grad}}}[form]
        total = ts.clip_by_global_norm(target, 0.05, p, error_if_nonfinite=flag, foreach=True)
        results.append((total, [q.grad.clone() for q in params]))
    (t0, g0), (t1, g1) = results
    assert bits(t0).equal(bits(t1)) and t0.dtype == torch.float32
    assert all(bits(a).equal(bits(b)) for a, b in zip(g0, g1))
    exact = exact_norm([q.grad for q in _model(seed=5).parameters()], p) * 300.0
    assert_norm(t0, exact, torch.float32, 2e-5)
    assert_norm(ts.global_norm(g0, p), 0.05 * exact / (exact + 1e-6), torch.float32, 2e-5)


# --------------------------------------------------------------------------- entry points


@pytest.mark.parametrize("p", [0.5, 3.0, 250.0])
def test_module_tied_once_frozen_excluded(backend, p):
    torch.manual_seed(0)
    lm = TiedLM()
    lm(torch.tensor([1, 2, 3])).logsumexp(-1).sum().backward()
    for q in lm.parameters():  # large gradients: |g|^250 is far beyond float32
        q.grad.mul_(1e3)
    with ts.freeze(lm, "body"):
        body = [bits(q.grad) for q in lm.body.parameters()]
        trainable = [q for _, q in ts.trainable_parameters(lm)]
        assert len(trainable) == 1 and trainable[0] is lm.embed.weight
        exact = exact_norm([q.grad for q in trainable], p)
        assert_norm(ts.global_norm(lm, p), exact, torch.float32, 2e-5)
        g = lm.embed.weight.grad.clone()
        total = ts.clip_by_global_norm(lm, exact / 10, p)
    assert_norm(total, exact, torch.float32, 2e-5)
    assert all(bits(q.grad).equal(b) for q, b in zip(lm.body.parameters(), body))
    torch.testing.assert_close(lm.embed.weight.grad, g * (exact / 10 / (exact + 1e-6)),
                               rtol=3e-5, atol=0.0)


@pytest.mark.parametrize("p", [0.5, 3.0, 200.0])
def test_tree_shared_leaf_once_none_skipped(backend, p):
    a = torch.full((3,), 100.0)
    b = torch.tensor([50.0, -75.0], dtype=torch.float64)
    tree = {"enc": {"w": a, "b": b}, "dec": {"w": a, "x": None}, "flat.w": a}
    exact = exact_norm([a, b], p)  # a once
    assert_norm(ts.global_norm(tree, p), exact, torch.float64, 1e-12)
    a0, b0 = a.clone(), b.clone()
    total = ts.clip_by_global_norm(tree, 1.0, p)
    assert_norm(total, exact, torch.float64, 1e-12)
    coef = 1.0 / (exact + 1e-6)
    torch.testing.assert_close(a, (a0.double() * coef).float(), rtol=1e-6, atol=0.0)  # once
    torch.testing.assert_close(b, b0 * coef, rtol=1e-12, atol=0.0)


@pytest.mark.parametrize("p", [0.5, 3.0, 200.0])
def test_parameter_listed_twice_counts_and_scales_twice(backend, p):
    """As clip_grad_norm_ takes a list: the same parameter twice is in the norm twice and
    multiplied twice (brute force, and torch on moderate values)."""
    g = torch.tensor([30.0, -40.0, 5.0], dtype=torch.float64)
    (w,) = holders([g])
    other = holders([torch.tensor([1.0, 2.0], dtype=torch.float64)])[0]
    exact = exact_norm([g, g, other.grad], p)
    total = ts.clip_by_global_norm([w, other, w], 1.0, p)
    assert_norm(total, exact, torch.float64, 1e-12)
    coef = 1.0 / (exact + 1e-6)
    torch.testing.assert_close(w.grad, g * coef * coef, rtol=1e-12, atol=0.0)
    if p <= 3.0:  # torch is exact here
        (h,) = holders([g])
        h2 = holders([torch.tensor([1.0, 2.0], dtype=torch.float64)])[0]
        want = torch.nn.utils.clip_grad_norm_([h, h2, h], 1.0, p)
        torch.testing.assert_close(total, want, rtol=1e-12, atol=0.0)
        torch.testing.assert_close(w.grad, h.grad, rtol=1e-12, atol=0.0)
    # global_norm of a list: the tensor twice counts twice
    assert_norm(ts.global_norm([g, g], p), exact_norm([g, g], p), torch.float64, 1e-12)


@pytest.mark.parametrize("p", [0.5, 3.0, 200.0])
def test_low_level_op_with_overlapping_views(backend, p):
    """``_ops.clip_by_global_norm_`` on gradient tensors directly: an entry and a view of part
    of it count (and are scaled) as separate entries, as a Python loop would."""
    base = torch.tensor([3.0, 4.0, 12.0], dtype=torch.float64)
    ref = base.clone()
    exact = exact_norm([ref, ref[:2]], p)
    total = _ops.clip_by_global_norm_([base, base[:2]], 1.0, p)
    assert_norm(total, exact, torch.float64, 1e-12)
    c = 1.0 / (exact + 1e-6)
    want = ref * c
    want[:2] *= c
    torch.testing.assert_close(base, want, rtol=1e-12, atol=0.0)


@pytest.mark.parametrize("layout", ["transposed", "channels_last", "gaps", "strided_1d"])
@pytest.mark.parametrize("p", [0.5, 3.0])
def test_non_contiguous_gradients(backend, layout, p):
    torch.manual_seed(3)
    if layout == "transposed":
        store = torch.randn(5, 4, dtype=torch.float64) * 7
        make = lambda s: s.t()  # noqa: E731
    elif layout == "channels_last":
        store = (torch.randn(2, 3, 4, 5, dtype=torch.float64) * 7).to(
            memory_format=torch.channels_last)
        make = lambda s: s  # noqa: E731
    elif layout == "gaps":
        store = torch.randn(4, 10, dtype=torch.float64) * 7
        make = lambda s: s[:, ::2]  # noqa: E731
    else:
        store = torch.randn(12, dtype=torch.float64) * 7
        make = lambda s: s[1::3]  # noqa: E731
    keep = store.clone()
    g = make(store)
    w = nn.Parameter(torch.zeros(g.shape, dtype=g.dtype))
    w.grad = g
    h = nn.Parameter(torch.zeros(g.shape, dtype=g.dtype))
    h.grad = make(keep.clone())
    flat = g.contiguous().reshape(-1)
    torch.testing.assert_close(ts.global_norm([g], p), torch.linalg.vector_norm(flat, p),
                               rtol=1e-12, atol=0.0)
    total = ts.clip_by_global_norm([w], 0.5, p)
    want = torch.nn.utils.clip_grad_norm_([h], 0.5, p)
    torch.testing.assert_close(total, want, rtol=1e-12, atol=0.0)
    torch.testing.assert_close(w.grad, h.grad, rtol=1e-12, atol=0.0)
    assert w.grad.stride() == g.stride()  # in place, layout kept
    if layout == "gaps":  # the elements between the gradient's are untouched
        assert torch.equal(store[:, 1::2], keep[:, 1::2])


@pytest.mark.parametrize("p", [0.5, 3.0, 200.0])
@pytest.mark.parametrize("error_if_nonfinite", [False, True])
def test_expanded_gradient_refused_for_clipping(backend, p, error_if_nonfinite):
    src = torch.tensor([1.0, 2.0, 30.0, 4.0])
    w = nn.Parameter(torch.zeros(3, 4))
    w.grad = src.expand(3, 4)
    other = holders([torch.tensor([5.0, 6.0])])[0]
    before = [bits(src), bits(other.grad)]
    with pytest.raises(RuntimeError, match="share memory"):
        ts.clip_by_global_norm([other, w], 1e-3, p, error_if_nonfinite=error_if_nonfinite)
    assert bits(src).equal(before[0]) and bits(other.grad).equal(before[1])
    # reading it is fine: every logical element counts (brute force on a materialized copy)
    assert_norm(ts.global_norm([w.grad], p), exact_norm([src.expand(3, 4).contiguous()], p),
                torch.float32, 2e-5)


# --------------------------------------------------------------------------- optimizers


def _twin_params(seed, dtype, big):
    torch.manual_seed(seed)
    shapes = [(4, 3), (3,), (2, 2, 2)]
    ps = [nn.Parameter(torch.randn(s, dtype=dtype)) for s in shapes]
    gs = [torch.randn(s, dtype=torch.float64).mul(big).to(dtype) for s in shapes]
    return ps, gs


@pytest.mark.parametrize("opt", ["SGD", "AdamW"])
@pytest.mark.parametrize("p, big", [(3.0, 1.0), (0.5, 1.0), (200.0, 100.0), (150.0, 1e-3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_optimizer_max_grad_norm_general_p(backend, opt, p, big, dtype):
    """An optimizer clipping by the general-p norm steps as torch's optimizer does on
    gradients clipped by hand with the exact norm; gradients are never written;
    ``last_grad_norm`` is the exact norm."""
    ps, gs = _twin_params(0, dtype, big)
    ref = [nn.Parameter(q.detach().clone()) for q in ps]
    for q, r, g in zip(ps, ref, gs):
        q.grad, r.grad = g.clone(), g.clone()
    exact = exact_norm(gs, p)
    max_norm = exact / 3
    kwargs = dict(lr=0.1, weight_decay=0.01) if opt == "AdamW" else dict(lr=0.1, momentum=0.9)
    ours = getattr(ts.optim, opt)(ps, max_grad_norm=max_norm, norm_type=p, **kwargs)
    theirs = getattr(torch.optim, opt)(ref, **kwargs)
    for _ in range(2):
        ours.step()
        for r, g in zip(ref, gs):
            r.grad = g.double().mul(max_norm / (exact + 1e-6)).to(dtype)
        theirs.step()
    rtol = 1e-10 if dtype == torch.float64 else 1e-5
    assert_norm(ours.last_grad_norm, exact, dtype, 1e-12 if dtype == torch.float64 else 2e-5)
    for q, r in zip(ps, ref):
        torch.testing.assert_close(q, r, rtol=rtol, atol=1e-7 if dtype == torch.float32 else 1e-14)
    assert all(bits(q.grad).equal(bits(g)) for q, g in zip(ps, gs))


@pytest.mark.parametrize("opt", ["SGD", "AdamW"])
@pytest.mark.parametrize("p", [0.5, 3.0, 60.0])
def test_optimizer_with_grad_scaler(backend, opt, p):
    """torch.amp.GradScaler on the CPU: scaler.step(ours) with max_grad_norm equals
    unscale_ + clip_grad_norm_ + step of torch's optimizer (the norm of the unscaled grads)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    ref = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    ref.load_state_dict(model.state_dict())
    ours = getattr(ts.optim, opt)(model.parameters(), lr=0.05, max_grad_norm=0.01, norm_type=p)
    theirs = getattr(torch.optim, opt)(ref.parameters(), lr=0.05)
    s1 = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    s2 = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    for step in range(2):
        x = torch.randn(8, 4)
        model.zero_grad()
        ref.zero_grad()
        s1.scale(model(x).pow(2).sum()).backward()
        s2.scale(ref(x).pow(2).sum()).backward()
        scaled = [bits(q.grad) for q in model.parameters()]
        s1.step(ours)
        s1.update()
        s2.unscale_(theirs)
        unscaled = [q.grad.clone() for q in ref.parameters()]
        n = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01, p)
        s2.step(theirs)
        s2.update()
        assert all(bits(q.grad).equal(b) for q, b in zip(model.parameters(), scaled))
        torch.testing.assert_close(ours.last_grad_norm.float(), n, rtol=1e-5, atol=0.0)
        assert_norm(ours.last_grad_norm.float(), exact_norm(unscaled, p), torch.float32, 2e-5)
        for q, r in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(q, r, rtol=1e-5, atol=1e-6)


def test_optimizer_grad_scale_large_p(backend):
    """A grad_scale set by hand (GradScaler-style) with p=200 on gradients of 100 (times the
    scale): the clip uses the exact norm of the unscaled gradients."""
    w = nn.Parameter(torch.zeros(4, dtype=torch.float64))
    w.grad = torch.full((4,), 100.0 * 1024, dtype=torch.float64)
    opt = ts.optim.SGD([w], lr=1.0, max_grad_norm=1.0, norm_type=200.0)
    opt.grad_scale = torch.tensor(1024.0)
    opt.found_inf = torch.tensor(0.0)
    opt.step()
    exact = 100.0 * 4 ** (1 / 200)
    assert math.isclose(float(opt.last_grad_norm), exact, rel_tol=1e-7)
    torch.testing.assert_close(w.detach(), torch.full((4,), -100.0 / (exact + 1e-6),
                                                       dtype=torch.float64), rtol=1e-7, atol=0.0)


@pytest.mark.parametrize("opt", ["SGD", "AdamW"])
def test_optimizer_fp16_params_large_p(backend, opt):
    """fp16 parameters whose gradients' 200th powers overflow everything: clipped by the exact
    norm (torch's own clip_grad_norm_ would see inf and zero them)."""
    w = nn.Parameter(torch.ones(6, dtype=torch.float16))
    w.grad = torch.full((6,), 100.0, dtype=torch.float16)
    exact = 100.0 * 6 ** (1 / 200)
    o = getattr(ts.optim, opt)([w], lr=0.1, max_grad_norm=1.0, norm_type=200.0)
    o.step()
    assert math.isclose(float(o.last_grad_norm), exact, rel_tol=1e-5)
    if opt == "SGD":
        want = 1.0 - 0.1 * 100.0 / (exact + 1e-6)
        torch.testing.assert_close(w.detach().double(), torch.full((6,), want, dtype=torch.float64),
                                   rtol=2e-3, atol=0.0)
    else:  # first AdamW step moves by lr (sign of the clipped gradient), after weight decay
        want = 1.0 * (1 - 0.1 * 0.01) - 0.1
        torch.testing.assert_close(w.detach().double(), torch.full((6,), want, dtype=torch.float64),
                                   rtol=2e-3, atol=0.0)
    assert (w.grad == 100.0).all()


# --------------------------------------------------------------------------- bad p values

BAD_P = [0, 0.0, -1.0, -INF, NAN, "fro", "nuc", None, "abc", 1j, [3.0]]


@pytest.mark.parametrize("bad", BAD_P, ids=repr)
def test_bad_norm_type_clear_error_nothing_changed(backend, bad):
    m = _model()
    params = list(m.parameters())
    before = [bits(q.grad) for q in params]
    tree = {"w": params[0].grad}
    calls = [lambda: ts.global_norm(params[0].grad, bad),
             lambda: ts.global_norm(m, bad),
             lambda: ts.global_norm(tree, bad),
             lambda: ts.clip_by_global_norm(params, 1e-3, bad),
             lambda: ts.clip_by_global_norm(params, 1e-3, bad, error_if_nonfinite=True),
             lambda: ts.clip_grad_norm_(m, 1e-3, bad),
             lambda: ts.clip_by_global_norm(tree, 1e-3, bad),
             lambda: _ops.clip_by_global_norm_([q.grad for q in params], 1e-3, bad),
             lambda: _ops.global_norm([params[0].grad], bad)]
    for call in calls:
        with pytest.raises(ValueError, match="norm_type"):
            call()
    assert all(bits(q.grad).equal(b) for q, b in zip(params, before))
    for name in ("SGD", "AdamW"):
        with pytest.raises(ValueError, match="norm_type"):
            getattr(ts.optim, name)(params, lr=0.1, max_grad_norm=1.0, norm_type=bad)


@pytest.mark.parametrize("bad", [0.0, -2.0, NAN, "fro", None])
@pytest.mark.parametrize("opt", ["SGD", "AdamW"])
def test_optimizer_norm_type_rewritten_bad_changes_nothing(backend, bad, opt):
    m = _model()
    params = list(m.parameters())
    o = getattr(ts.optim, opt)(params, lr=0.1, max_grad_norm=1.0, norm_type=3.0)
    o.step()  # state exists
    state_before = {id(q): {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                    for q, s in o.state.items()}
    p_before = [bits(q) for q in params]
    g_before = [bits(q.grad) for q in params]
    norm_before = o.last_grad_norm
    o.norm_type = bad
    with pytest.raises(ValueError, match="norm_type"):
        o.step()
    assert all(bits(q).equal(b) for q, b in zip(params, p_before))
    assert all(bits(q.grad).equal(b) for q, b in zip(params, g_before))
    assert o.last_grad_norm is norm_before
    for q, s in o.state.items():
        for k, v in s.items():
            old = state_before[id(q)][k]
            assert (bits(v).equal(bits(old)) if torch.is_tensor(v) else v == old), k


@requires_compiled
@pytest.mark.parametrize("p", [0.5, 3.0, 200.0])
def test_compiled_ops_refuse_a_general_p(p):
    g = [torch.tensor([3.0, 4.0]), torch.tensor([12.0], dtype=torch.float64)]
    before = [bits(t) for t in g]
    with pytest.raises(ValueError, match="norm types 1, 2 and inf"):
        torch.ops.torchstruct.global_norm(g, p)
    with pytest.raises(ValueError, match="norm types 1, 2 and inf"):
        torch.ops.torchstruct.clip_by_global_norm_(g, 1.0, p)
    assert all(bits(t).equal(b) for t, b in zip(g, before))
    # the kernel norms still run there
    for q, want in ((1.0, 19.0), (2.0, 13.0), (INF, 12.0)):
        assert float(torch.ops.torchstruct.global_norm(g, q)) == want
    # and the Python functions take the general p
    assert_norm(ts.global_norm(g, p), exact_norm(g, p), torch.float64, 1e-12)


# --------------------------------------------------------------------------- torch.compile


def test_torch_compile_eager_backend_general_p():
    torch._dynamo.reset()
    torch.manual_seed(0)
    grads = [torch.randn(4, 3) * 1e3, torch.randn(5, dtype=torch.float64) * 1e3,
             torch.randn(2, dtype=torch.float16) * 100]
    p = 120.0

    def clip(ps):
        return ts.clip_by_global_norm(ps, 1.0, p)

    want_params = holders(grads)
    want = clip(want_params)
    exact = exact_norm(grads, p)
    assert_norm(want, exact, torch.float64, 1e-12)
    for fullgraph in (False, True):
        params = holders(grads)
        total = torch.compile(clip, backend="eager", fullgraph=fullgraph)(params)
        assert total.dtype == torch.float64
        assert_norm(total, exact, torch.float64, 1e-12)
        for a, b in zip(params, want_params):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0.0)

    # a model argument (a graph break by design) and a global_norm inside a compiled function
    m, m2 = _model(seed=4), _model(seed=4)
    for q in m.parameters():
        q.grad.mul_(1e4)
    for q in m2.parameters():
        q.grad.mul_(1e4)
    compiled = torch.compile(lambda mod: (ts.global_norm(mod, 7.0),
                                          ts.clip_by_global_norm(mod, 0.1, 7.0)), backend="eager")
    n1, t1 = compiled(m)
    t2 = ts.clip_by_global_norm(m2, 0.1, 7.0)
    torch.testing.assert_close(n1, t2, rtol=1e-6, atol=0.0)
    torch.testing.assert_close(t1, t2, rtol=1e-6, atol=0.0)
    for a, b in zip(m.parameters(), m2.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0.0)
    torch._dynamo.reset()


# --------------------------------------------------------------------------- autograd


@pytest.mark.parametrize("p", [0.5, 1.5, 3.0, 7.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_autograd_matches_torch_vector_norm(backend, p, dtype):
    torch.manual_seed(2)
    a = torch.randn(5, dtype=dtype, requires_grad=True)
    b = torch.randn(3, 2, dtype=dtype, requires_grad=True)
    c = torch.randn(4, dtype=dtype)  # not differentiated
    n = ts.global_norm([a, b, c], p)
    assert n.requires_grad and n.dtype == dtype
    ga, gb = torch.autograd.grad(n, (a, b))
    flat = torch.cat([a, b.reshape(-1), c])
    want = torch.linalg.vector_norm(flat, p)
    wa, wb = torch.autograd.grad(want, (a, b))
    rtol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(n, want, rtol=rtol, atol=0.0)
    torch.testing.assert_close((ga, gb), (wa, wb), rtol=rtol, atol=1e-7 if dtype == torch.float32
                               else 1e-15)
    # a dict tree with requires_grad leaves: the same gradient
    ga2, = torch.autograd.grad(ts.global_norm({"x": {"a": a}, "b": b.detach()}, p), (a,))
    wa2, = torch.autograd.grad(torch.linalg.vector_norm(torch.cat([a, b.detach().reshape(-1)]), p),
                               (a,))
    torch.testing.assert_close(ga2, wa2, rtol=rtol, atol=1e-7 if dtype == torch.float32 else 1e-15)


@pytest.mark.parametrize("p, value", [(200.0, 100.0), (120.0, 1e-3)])
def test_autograd_where_torch_overflows(backend, p, value):
    """The gradient of the norm on values whose p-th powers leave float64's range: exact
    (torch.linalg.vector_norm gives inf / 0 and a NaN gradient there)."""
    vals = [value, -value / 2, value / 3, 0.0]
    x = torch.tensor(vals, dtype=torch.float64, requires_grad=True)
    n = ts.global_norm([x], p)
    (g,) = torch.autograd.grad(n, x)
    assert math.isclose(float(n.detach()), exact_norm([x], p), rel_tol=1e-12)
    want = torch.tensor(exact_grad_of_norm(vals, p), dtype=torch.float64)
    torch.testing.assert_close(g, want, rtol=1e-10, atol=1e-300)
    assert torch.isfinite(g).all()


def test_autograd_zero_and_p_below_one(backend):
    """Zeros in the input (p < 1): torch's gradient (0 there); all zeros: gradient 0, no NaN."""
    x = torch.tensor([0.0, 1.0, -2.0], requires_grad=True)
    (g,) = torch.autograd.grad(ts.global_norm([x], 0.5), x)
    y = x.detach().clone().requires_grad_()
    (w,) = torch.autograd.grad(torch.linalg.vector_norm(y, 0.5), y)
    torch.testing.assert_close(g, w, rtol=1e-6, atol=0.0)
    z = torch.zeros(3, requires_grad=True)
    (gz,) = torch.autograd.grad(ts.global_norm([z], 3.0), z)
    assert torch.equal(gz, torch.zeros(3))


# --------------------------------------------------------------------------- size / speed


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_million_elements(backend, dtype):
    """1e6 elements (one tensor, and 2000 small ones) in each dtype: the norm is right (the
    timing is looked at by hand: well under a second each here)."""
    torch.manual_seed(0)
    big = torch.randn(10**6, dtype=torch.float64).mul(50).to(dtype)
    flat = big.double()
    for p in (3.0, 0.5, 200.0):
        if p < 10:  # float64 brute force (no power leaves float64's range)
            want = float(torch.linalg.vector_norm(flat, p))
        else:  # the 200th powers of ~100 overflow float64: brute force on flat / 128 ...
            want = float(torch.linalg.vector_norm(flat / 128, p)) * 128  # (exact: 2^7)
            assert math.isfinite(want) and want > 0
        rtol = 1e-9 if dtype == torch.float64 else 2e-5
        assert_norm(ts.global_norm([big], p), want, norm_dtype([big]), rtol)
    parts = list(big.split(500))
    m = big.double().abs().max()
    want = float(m * torch.linalg.vector_norm(big.double() / m, 3.0))
    assert_norm(ts.global_norm(parts, 3.0), want, norm_dtype([big]),
                1e-9 if dtype == torch.float64 else 2e-5)
    params = holders(parts[:200])
    total = ts.clip_by_global_norm(params, 1.0, 3.0)
    sub = torch.cat(parts[:200]).double()
    m = sub.abs().max()
    assert_norm(total, float(m * torch.linalg.vector_norm(sub / m, 3.0)), dtype,
                1e-9 if dtype == torch.float64 else 2e-5)


def test_more_elements_than_one_batch(backend):
    """Over 4M elements (the general-p norm copies 4M at a time): several tensors across the
    batch boundaries and one larger than a batch; fp16 and fp32 mixed; p=200 on values ~100
    (every power overflows float64 unscaled)."""
    torch.manual_seed(0)
    grads = [torch.rand(1_500_000).mul_(100), torch.rand(3_000_000).mul_(100).half(),
             torch.rand(5_000_000).mul_(100)]
    flat = torch.cat([g.double() for g in grads])
    want = float(torch.linalg.vector_norm(flat / 128, 200.0)) * 128  # 2^7: exact scaling
    assert_norm(ts.global_norm(grads, 200.0), want, torch.float32, 2e-5)
    want3 = float(torch.linalg.vector_norm(flat, 3.0))
    assert_norm(ts.global_norm(grads, 3.0), want3, torch.float32, 2e-5)


def test_functorch_vmap_and_grad(backend):
    x = torch.randn(4, 5, dtype=torch.float64) * 100
    got = torch.func.vmap(lambda r: ts.global_norm([r], 200.0))(x)
    for row, n in zip(x, got):
        assert math.isclose(float(n), exact_norm([row], 200.0), rel_tol=1e-12)
    g = torch.func.grad(lambda r: ts.global_norm([r], 200.0))(x[0])
    torch.testing.assert_close(g, torch.tensor(exact_grad_of_norm(x[0].tolist(), 200.0),
                                                dtype=torch.float64), rtol=1e-10, atol=1e-300)
    # no_grad with requires_grad inputs: the same value, no graph
    y = x[0].clone().requires_grad_()
    with torch.no_grad():
        n = ts.global_norm([y], 200.0)
    assert n.grad_fn is None and math.isclose(float(n), exact_norm([x[0]], 200.0), rel_tol=1e-12)


# --------------------------------------------------------------------------- bugs found


def test_small_p_over_more_than_float64s_range(backend):
    x = torch.cat([torch.tensor([1e300], dtype=torch.float64),
                   torch.full((1000,), 1e-300, dtype=torch.float64)])
    want = exact_norm([x], 0.01)  # (1e3 + 1000 * 1e-3)^100 = 1.1051e300
    assert math.isclose(float(torch.linalg.vector_norm(x, 0.01)), want, rel_tol=1e-9)
    assert math.isclose(float(ts.global_norm([x], 0.01)), want, rel_tol=1e-6)


@pytest.mark.parametrize("name", ["compiled", "fallback"])
def test_small_p_float32_over_more_than_float32s_range(name):
    if name == "compiled" and not _ops.compiled_available():
        pytest.skip("no compiled extension")
    x = torch.cat([torch.tensor([1e30]), torch.full((1000,), 1e-20)])
    want = exact_norm([x], 0.1)  # about (1e3 + 1000 * 1e-2)^10 = 1.1046e30
    assert math.isclose(float(torch.linalg.vector_norm(x.double(), 0.1)), want, rel_tol=1e-9)
    with _ops.use_backend("reference"):
        assert math.isclose(float(ts.global_norm([x], 0.1)), want, rel_tol=1e-6)
    with _ops.use_backend(name):
        got = float(ts.global_norm([x], 0.1))
        (w,) = holders([x])
        total = float(ts.clip_by_global_norm([w], 1.0, 0.1))
    assert math.isclose(got, want, rel_tol=1e-5), got
    assert math.isclose(total, want, rel_tol=1e-5), total


def test_combine_norms_small_p_float32():
    got = _reference.combine_norms([torch.tensor(1e30), torch.tensor(1e-20)], 0.05)
    want = 1e30 * (1 + (1e-50) ** 0.05) ** 20
    assert math.isclose(float(got), want, rel_tol=1e-5), float(got)


@pytest.mark.parametrize("name", ["compiled", "fallback"])
def test_huge_p_on_float32_is_the_largest_magnitude(name):
    if name == "compiled" and not _ops.compiled_available():
        pytest.skip("no compiled extension")
    x = torch.tensor([3.0, 4.0])
    with _ops.use_backend("reference"):
        assert float(ts.global_norm([x], 1e300)) == 4.0
    assert float(ts.global_norm([x.double()], 1e300)) == 4.0
    with _ops.use_backend(name):
        got = float(ts.global_norm([x], 1e300))
        (w,) = holders([x])
        ts.clip_by_global_norm([w], 1.0, 1e39)
    assert got == 4.0, got
    assert not w.grad.isnan().any(), w.grad


def test_grad_scale_does_not_overflow_the_scaled_norm(backend):
    n = 100
    w = nn.Parameter(torch.zeros(n))
    w.grad = torch.full((n,), 1e37)
    opt = ts.optim.SGD([w], lr=1.0, max_grad_norm=1.0, norm_type=0.5)
    opt.grad_scale = torch.tensor(65536.0)
    opt.found_inf = torch.tensor(0.0)
    opt.step()
    exact = 1e37 / 65536 * n ** 2
    assert math.isclose(float(opt.last_grad_norm), exact, rel_tol=1e-5)
    want = -(1e37 / 65536) / (exact + 1e-6)
    torch.testing.assert_close(w.detach(), torch.full((n,), want), rtol=1e-4, atol=0.0)


@pytest.mark.parametrize("p", [2.0, 3.0])
def test_fallback_float64_clip_coefficient_in_float64(p):
    g = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    n = exact_norm([g], p)
    want = 1.0 - g / (n + 1e-6)
    with _ops.use_backend("fallback"):
        w = nn.Parameter(torch.ones(3, dtype=torch.float64))
        w.grad = g.clone()
        ts.optim.SGD([w], lr=1.0, max_grad_norm=1.0, norm_type=p).step()
    torch.testing.assert_close(w.detach(), want, rtol=1e-12, atol=0.0)
