"""Differential fuzzing of ts.clip_by_global_norm / ts.clip_grad_norm_, ts.global_norm,
ts.polyak_update and ts.tree.flatten/unflatten against torch and float64 brute force, on every
backend (compiled / fallback / reference).

What torch does, and where torchstruct deliberately differs (docs/clipping.md):

* ``torch.nn.utils.clip_grad_norm_`` takes a tensor or any iterable (a generator too, with a
  warning when it is empty); a list is taken as given (a parameter twice: counted twice and
  scaled twice); ``norm_type`` is read with ``float()`` (so ``"inf"`` works), ``max_norm`` too.
* torch refuses the inf-norm of an empty gradient; torchstruct lets it contribute nothing.
* torch rounds per-tensor norms and the coefficient to fp16/bf16; torchstruct accumulates those
  in fp32 (the clipped values may differ by an ulp of the gradient dtype). The returned norm has
  torch's dtype: the promotion of the gradient dtypes (fp16 alone stays fp16).
* When fp16 per-tensor norms overflow, torch returns inf and zeroes the gradients; torchstruct
  returns inf too (the norm does not fit in fp16) but clips by the exact norm.
* torch flips the gradients for a negative ``max_norm``; torchstruct raises ``ValueError``.
* torch clips complex gradients; torchstruct raises ``TypeError`` (documented), changing nothing.
* ``ts.global_norm`` returns float32 for fp16/bf16 input (torch's ``get_total_norm``: fp16).
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import torchstruct as ts

SETTINGS = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
FEW = settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

INF = float("inf")
SHAPES = [(), (0,), (1,), (3,), (2, 3), (4, 5), (3, 0, 2), (7, 1), (130,), (33, 65)]
BIG_SHAPES = [(300, 250)]  # more than one 64k-element work chunk
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# --------------------------------------------------------------------------- helpers


def bits(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``'s bits (NaN payloads and -0.0 included)."""
    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.is_complex():
        t = torch.view_as_real(t)
    t = t.clone().contiguous()
    return t.view(_INT_OF_SIZE[t.element_size()])


def snapshot(params):
    """Every .grad: the object and its bits."""
    return [(p.grad, None if p.grad is None else bits(p.grad)) for p in params]


def assert_unchanged(params, snap):
    for i, (p, (g, b)) in enumerate(zip(params, snap)):
        assert p.grad is g, f"entry {i}: .grad object replaced"
        if g is not None:
            assert torch.equal(bits(p.grad), b), f"entry {i}: gradient changed"


def make_grad(shape, dtype, layout, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    if layout == "transposed" and len(shape) == 2:
        g = (torch.randn(shape[::-1], generator=gen, dtype=torch.float64) * scale).to(dtype).t()
    elif layout == "strided" and len(shape) == 2:
        base = torch.randn(shape[0], 2 * shape[1], generator=gen, dtype=torch.float64) * scale
        g = base.to(dtype)[:, ::2]
    else:
        g = (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)
    return g


def make_params(entries):
    params = []
    for e in entries:
        p = nn.Parameter(torch.zeros(e["shape"], dtype=e["dtype"]), requires_grad=e["requires_grad"])
        if e["grad"]:
            p.grad = make_grad(e["shape"], e["dtype"], e["layout"], e["scale"], e["seed"])
        params.append(p)
    return params


def clone_structure(params):
    """Copies of ``params`` (same grad values and strides) with the same sharing: a parameter
    listed twice is one copy listed twice, a grad shared by two parameters is shared."""
    pmemo, gmemo, out = {}, {}, []
    for p in params:
        if id(p) not in pmemo:
            q = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
            if p.grad is not None:
                if id(p.grad) not in gmemo:
                    gmemo[id(p.grad)] = p.grad.clone()  # keeps the strides of a dense grad
                q.grad = gmemo[id(p.grad)]
            pmemo[id(p)] = q
        out.append(pmemo[id(p)])
    return out


def as_form(params, form):
    if form == "list":
        return list(params)
    if form == "tuple":
        return tuple(params)
    if form == "generator":
        return (p for p in params)
    assert form == "single" and len(params) == 1
    return params[0]


def exact_norm(tensors, p):
    """float64 brute force over the concatenation (list taken as given)."""
    tensors = [t for t in tensors if t.numel() > 0]
    if not tensors:
        return torch.tensor(0.0, dtype=torch.float64)
    flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])
    return torch.linalg.vector_norm(flat, p)


def promoted(dtypes):
    out = dtypes[0]
    for d in dtypes[1:]:
        out = torch.promote_types(out, d)
    return out


def grad_multiplicity(params):
    """id(grad) -> (grad, its value before, how many times it is in the effective list)."""
    seen = {}
    for p in params:
        if p.grad is not None:
            g = p.grad
            _, before, k = seen.get(id(g), (g, g.detach().clone(), 0))
            seen[id(g)] = (g, before, k + 1)
    return seen


def eps(dtype):
    return torch.finfo(dtype).eps


entry_st = st.fixed_dictionaries(
    {
        "shape": st.sampled_from(SHAPES),
        "dtype": st.sampled_from([torch.float32, torch.float64]),
        "layout": st.sampled_from(["contig", "transposed", "strided"]),
        "scale": st.sampled_from([1e-3, 1.0, 30.0, 1e3]),
        "grad": st.sampled_from([True, True, True, False]),
        "requires_grad": st.sampled_from([True, True, False]),
        "seed": st.integers(0, 2**16),
    }
)
NORM_TYPES = [1, 2, 2.0, 3.5, 0.5, INF, "inf", "2", 1.0]
MAX_NORMS = [0.0, 1e-3, 0.5, 1.0, 10.0, 1e4, INF, "tensor0.5", "tensor[2.]", "0.25"]


def read_max_norm(m):
    if m == "tensor0.5":
        return torch.tensor(0.5)
    if m == "tensor[2.]":
        return torch.tensor([2.0])
    return m


# --------------------------------------------------------------------------- clip vs torch


@SETTINGS
@given(
    entries=st.lists(entry_st, min_size=0, max_size=6),
    dups=st.lists(st.integers(0, 50), max_size=2),
    share=st.booleans(),
    norm_type=st.sampled_from(NORM_TYPES),
    max_norm=st.sampled_from(MAX_NORMS),
    form=st.sampled_from(["list", "tuple", "generator", "single"]),
    foreach=st.sampled_from([None, True, False]),
    error_if_nonfinite=st.booleans(),
    alias=st.booleans(),
)
def test_clip_matches_torch_and_brute_force(backend, entries, dups, share, norm_type, max_norm,
                                             form, foreach, error_if_nonfinite, alias):
    params = make_params(entries)
    if params:
        params += [params[i % len(params)] for i in dups]
        if share and params[0].grad is not None:  # another parameter holding the same grad
            q = nn.Parameter(torch.zeros_like(params[0]))
            q.grad = params[0].grad
            params.append(q)
    if form == "single" and len(params) != 1:
        form = "list"
    theirs = clone_structure(params)
    p = float(norm_type)
    mx = float(read_max_norm(max_norm))
    grads = [q.grad for q in params if q.grad is not None]
    exact = exact_norm(grads, p)
    mult = grad_multiplicity(params)

    fn = ts.clip_grad_norm_ if alias else ts.clip_by_global_norm
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the empty-generator warning, as torch's
        n = fn(as_form(params, form), read_max_norm(max_norm), norm_type,
               error_if_nonfinite=error_if_nonfinite, foreach=foreach)
        empties_under_inf = math.isinf(p) and any(g.numel() == 0 for g in grads)
        if empties_under_inf:
            # torch refuses the inf-norm of an empty gradient; documented: here it contributes
            # nothing. Compare with torch on the list without the empty gradients.
            with pytest.raises(RuntimeError, match="empty"):
                torch.nn.utils.clip_grad_norm_(clone_structure(params), mx, norm_type)
            theirs = [q for q in theirs if q.grad is None or q.grad.numel() > 0]
        tn = torch.nn.utils.clip_grad_norm_(as_form(theirs, form if form != "single" or len(theirs) == 1 else "list"),
                                            read_max_norm(max_norm), norm_type,
                                            error_if_nonfinite=error_if_nonfinite, foreach=foreach)

    # the returned total norm: 0-d, on the CPU, torch's dtype, torch's value, the exact value
    assert isinstance(n, torch.Tensor) and n.shape == () and n.device == torch.device("cpu")
    want_dtype = promoted([g.dtype for g in grads]) if grads else torch.float32
    assert n.dtype == want_dtype
    if not empties_under_inf:
        assert n.dtype == tn.dtype
    torch.testing.assert_close(n.double(), tn.double(), rtol=1e-4, atol=1e-30)
    torch.testing.assert_close(n.double(), exact.to(n.dtype).double(), rtol=1e-5, atol=1e-30)

    # the clipped gradients: before * coef**k (k: times the grad is listed), and torch's
    coef = min(mx / (exact.item() + 1e-6), 1.0)
    for g, before, k in mult.values():
        torch.testing.assert_close(g.double(), before.double() * coef**k, rtol=1e-5, atol=1e-30)
    for q, t in first_uses(params, theirs):
        scale = q.grad.abs().max().item()
        torch.testing.assert_close(q.grad, t.grad, rtol=1e-5, atol=1e-6 * scale + 1e-30)


def first_uses(params, theirs):
    """(ours, torch's) for each parameter with a non-empty grad, in order of first use."""
    def uniq(ps):
        out = []
        for q in ps:
            if q.grad is not None and q.grad.numel() > 0 and all(q is not o for o in out):
                out.append(q)
        return out
    ours, mine = uniq(params), uniq(theirs)
    assert len(ours) == len(mine)
    return list(zip(ours, mine))


# --------------------------------------------------------------------------- half precision

half_entry_st = st.fixed_dictionaries(
    {
        "shape": st.sampled_from(SHAPES + BIG_SHAPES),
        "dtype": st.sampled_from([torch.float16, torch.bfloat16, torch.float16, torch.bfloat16,
                                  torch.float32, torch.float64]),
        "layout": st.sampled_from(["contig", "transposed", "strided"]),
        "scale": st.sampled_from([1e-3, 1.0, 100.0]),
        "grad": st.just(True),
        "requires_grad": st.just(True),
        "seed": st.integers(0, 2**16),
    }
)


@SETTINGS
@given(
    entries=st.lists(half_entry_st, min_size=1, max_size=5),
    norm_type=st.sampled_from([1.0, 2.0, 3.5, INF]),
    max_norm=st.sampled_from([0.1, 1.0, 1e5]),
    error_if_nonfinite=st.booleans(),
)
def test_clip_half_precision_accumulates_in_fp32(backend, entries, norm_type, max_norm,
                                                 error_if_nonfinite):
    if math.isinf(norm_type):  # torch refuses the inf-norm of an empty grad (documented)
        entries = [e for e in entries if 0 not in e["shape"]] or [dict(entries[0], shape=(3,))]
    params = make_params(entries)
    theirs = clone_structure(params)
    grads = [p.grad for p in params]
    before = [g.clone() for g in grads]
    out_dtype = promoted([g.dtype for g in grads])
    exact = exact_norm(before, norm_type)
    overflows = bool(torch.isinf(exact.to(out_dtype)))  # the norm does not fit the result dtype
    if overflows and error_if_nonfinite:  # documented: raises as torch does, nothing changed
        snap = snapshot(params)
        with pytest.raises(RuntimeError, match="non-finite"):
            ts.clip_by_global_norm(params, max_norm, norm_type, error_if_nonfinite=True)
        assert_unchanged(params, snap)
        with pytest.raises(RuntimeError, match="non-finite"):
            torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type, error_if_nonfinite=True)
        return
    n = ts.clip_by_global_norm(params, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite)
    tn = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)

    # dtype: what torch returns (the promotion: fp16 alone stays fp16, fp16 + bf16 -> fp32)
    assert n.dtype == tn.dtype == out_dtype
    assert n.shape == () and n.device.type == "cpu"
    # value: the exact norm rounded once to that dtype (torch rounds per-tensor norms too). The
    # fp16/bf16/fp32 elements are accumulated in fp32 (compiled: |x|^p in fp32 lanes), so even a
    # float64 result carries fp32-level error from them.
    acc_eps = max(8 * eps(n.dtype), 1e-12, 4 * eps(torch.float32) if any(g.dtype != torch.float64 for g in grads) else 0)
    torch.testing.assert_close(n.double(), exact.to(n.dtype).double(), rtol=acc_eps, atol=0)
    low = max(eps(g.dtype) for g in grads)
    # torch's total is inf whenever one per-tensor norm overflows its fp16 dtype; it then zeroes
    # every gradient. Documented: here the total is exact (inf only when it does not fit the
    # result dtype) and the gradients are clipped by it.
    torch_inf = overflows or any(bool(torch.isinf(exact_norm([b], norm_type).to(b.dtype))) for b in before)
    assert bool(torch.isinf(n)) == overflows
    if torch_inf:
        assert torch.isinf(tn)
    else:
        torch.testing.assert_close(n.double(), tn.double(), rtol=max(4 * low, 1e-5), atol=1e-30)
    # the coefficient, in fp32 (fp64 with any fp64 grad) from the exact norm
    acc = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    coef = ((exact.to(acc) + 1e-6).reciprocal() * max_norm).clamp(max=1.0)
    for g, b, t in zip(grads, before, theirs):
        tiny = 2 * torch.finfo(g.dtype).smallest_normal * eps(g.dtype)  # one subnormal step
        expected = (b.to(acc) * coef).to(g.dtype)
        torch.testing.assert_close(g, expected, rtol=2 * max(eps(g.dtype), acc_eps), atol=tiny)
        if torch_inf:
            assert bool((t.grad == 0).all())  # torch: inf norm, every gradient zeroed
        else:  # torch rounds its norm and coefficient to fp16/bf16 (documented): apart by that
            torch_coef = (max_norm / (tn + 1e-6)).clamp(max=1.0).double()
            coef_err = abs(torch_coef.item() / coef.double().item() - 1) if coef.item() else 0.0
            torch.testing.assert_close(g, t.grad, rtol=1.1 * coef_err + max(3 * eps(g.dtype), 1e-5), atol=tiny)


# --------------------------------------------------------------------------- extreme values

EXTREMES = [
    # dtype, values, p, max_norm; torch's own answer is right in the single-element cases
    pytest.param(torch.float32, [100.0] * 8, 20.0, 1.0, id="fp32-p20-overflow"),
    pytest.param(torch.float32, [1e30], 3.5, 1.0, id="fp32-one-element-p3.5-overflow"),
    pytest.param(torch.float16, [30000.0], 10.0, 1.0, id="fp16-one-element-p10-overflow"),
    pytest.param(torch.float32, [1e-3] * 8, 20.0, 1e-5, id="fp32-p20-underflow-unclipped"),
]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype, values, p, max_norm", EXTREMES)
def test_norm_of_extreme_values_is_exact(backend, device, dtype, values, p, max_norm):
    """A general p accumulates in float64 on every device and backend (docs/clipping.md)."""
    w = nn.Parameter(torch.zeros(len(values), dtype=dtype, device=device))
    w.grad = torch.tensor(values, dtype=dtype, device=device)
    before = w.grad.clone()
    exact = exact_norm([before.cpu()], p).to(device)
    assert torch.isfinite(exact.to(dtype))  # the norm fits the result dtype
    n = ts.clip_by_global_norm([w], max_norm, p)
    torch.testing.assert_close(n.double(), exact.to(dtype).double(), rtol=1e-5, atol=0)
    coef = min(max_norm / (exact.item() + 1e-6), 1.0)
    torch.testing.assert_close(w.grad.double(), before.double() * coef, rtol=2e-3, atol=0)
    g = ts.global_norm([before], p)
    torch.testing.assert_close(g.double(), exact, rtol=1e-5, atol=0)
    if len(values) == 1 and device == "cpu":  # torch gets these right: the drop-in must too
        t = nn.Parameter(torch.zeros(1, dtype=dtype))
        t.grad = before.clone()
        tn = torch.nn.utils.clip_grad_norm_([t], max_norm, p)
        torch.testing.assert_close(n, tn)
        torch.testing.assert_close(w.grad, t.grad, rtol=2e-3, atol=0)


@pytest.mark.parametrize("scale, p", [(60000.0, 2.0), (300.0, 2.0), (1e-7, 2.0), (65504.0, 1.0),
                                      (6e-8, INF), (2e4, 3.5)])
def test_fp16_squares_that_overflow_or_underflow_in_fp16(backend, scale, p):
    """fp16 elements whose squares leave fp16's range: accumulated in fp32, the norm is exact
    when it fits in fp16; when it does not, inf is returned (as torch) but the gradients are
    clipped by the exact norm (documented), where torch zeroes them."""
    params = []
    for k in (3, 5, 1):
        w = nn.Parameter(torch.zeros(k, dtype=torch.float16))
        w.grad = torch.full((k,), scale, dtype=torch.float16)
        params.append(w)
    before = [w.grad.clone() for w in params]
    theirs = clone_structure(params)
    exact = exact_norm(before, p)
    n = ts.clip_by_global_norm(params, 1.0, p)
    tn = torch.nn.utils.clip_grad_norm_(theirs, 1.0, p)
    assert n.dtype == tn.dtype == torch.float16
    fits = bool(torch.isfinite(exact.to(torch.float16)))
    if fits:
        assert n.item() == exact.to(torch.float16).item()
        if scale >= 1.0:  # subnormal per-tensor norms: torch rounds each one (documented)
            assert n.item() == tn.item()
    else:
        assert torch.isinf(n) and torch.isinf(tn)
        assert all(bool((t.grad == 0).all()) for t in theirs)  # torch zeroes; documented
    coef = torch.clamp(1.0 / (exact.float() + 1e-6), max=1.0)
    for w, b in zip(params, before):
        assert torch.equal(w.grad, (b.float() * coef).half())
        if fits:
            assert bool(w.grad.abs().max() > 0) or bool(b.abs().max() == 0)
    if not fits:  # clipped to the max norm, not zeroed
        torch.testing.assert_close(exact_norm([w.grad for w in params], p).float(),
                                   torch.tensor(1.0), rtol=2e-3, atol=0)
        # and error_if_nonfinite raises as torch does, nothing changed
        for w, b in zip(params, before):
            w.grad = b.clone()
        snap = snapshot(params)
        with pytest.raises(RuntimeError, match="non-finite"):
            ts.clip_by_global_norm(params, 1.0, p, error_if_nonfinite=True)
        assert_unchanged(params, snap)


# --------------------------------------------------------------------------- non-finite, max_norm


@SETTINGS
@given(
    entries=st.lists(entry_st, min_size=1, max_size=4),
    poison=st.lists(st.tuples(st.integers(0, 10), st.integers(0, 10_000),
                              st.sampled_from([float("nan"), INF, -INF])), min_size=1, max_size=3),
    norm_type=st.sampled_from([1.0, 2.0, 3.5, INF]),
    max_norm=st.sampled_from([0.0, 0.5, 1e4]),
)
def test_nonfinite_grads_match_torch(backend, entries, poison, norm_type, max_norm):
    """Without error_if_nonfinite: as torch, a NaN norm makes every gradient NaN, an inf norm
    zeroes the finite elements. With it: RuntimeError and every gradient bitwise unchanged."""
    entries = [dict(e, grad=True) for e in entries]
    if math.isinf(norm_type):
        entries = [e for e in entries if 0 not in e["shape"]] or [dict(entries[0], shape=(3,))]
    params = make_params(entries)
    poisoned = False
    for i, j, v in poison:
        g = params[i % len(params)].grad
        if g.numel():
            idx = torch.unravel_index(torch.tensor(j % g.numel()), g.shape)
            g[idx] = v
            poisoned = True
    snap = snapshot(params)
    theirs = clone_structure(params)
    if poisoned:
        with pytest.raises(RuntimeError, match="non-finite"):
            ts.clip_by_global_norm(params, max_norm, norm_type, error_if_nonfinite=True)
        assert_unchanged(params, snap)
        with pytest.raises(RuntimeError, match="non-finite"):
            torch.nn.utils.clip_grad_norm_(clone_structure(params), max_norm, norm_type,
                                           error_if_nonfinite=True)
    n = ts.clip_by_global_norm(params, max_norm, norm_type)
    tn = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
    assert n.dtype == tn.dtype
    torch.testing.assert_close(n, tn, rtol=1e-5, atol=0, equal_nan=True)
    if poisoned:
        assert not bool(torch.isfinite(n))
    for q, t in zip(params, theirs):
        # same NaN pattern, same zeros; finite values to tolerance
        assert torch.equal(q.grad.isnan(), t.grad.isnan())
        torch.testing.assert_close(q.grad, t.grad, rtol=1e-5, atol=1e-30, equal_nan=True)


@pytest.mark.parametrize("max_norm", [0.0, 0, torch.tensor(0.0), False])
def test_max_norm_zero_zeroes_bitwise_as_torch(backend, max_norm):
    params = make_params([dict(shape=s, dtype=d, layout="contig", scale=1.0, grad=True,
                               requires_grad=True, seed=i)
                          for i, (s, d) in enumerate([((4, 5), torch.float32), ((7,), torch.float64),
                                                      ((3,), torch.float16), ((2, 2), torch.bfloat16)])])
    theirs = clone_structure(params)
    n = ts.clip_by_global_norm(params, max_norm)
    tn = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    torch.testing.assert_close(n, tn, rtol=1e-3, atol=0)
    for q, t in zip(params, theirs):
        assert bool((q.grad == 0).all())
        assert torch.equal(bits(q.grad), bits(t.grad))  # -0.0 where the grad was negative


@pytest.mark.parametrize("max_norm, expected", [(torch.tensor(0.5), 0.5), (torch.tensor([2.0]), 2.0),
                                                (torch.tensor([[0.25]], dtype=torch.float64), 0.25),
                                                ("0.1", 0.1), (True, 1.0), (INF, INF),
                                                (3, 3.0)])
def test_max_norm_read_as_torch_reads_it(backend, max_norm, expected):
    w = nn.Parameter(torch.zeros(2))
    w.grad = torch.tensor([30.0, 40.0])
    t = nn.Parameter(torch.zeros(2))
    t.grad = w.grad.clone()
    n = ts.clip_by_global_norm([w], max_norm)
    tn = torch.nn.utils.clip_grad_norm_([t], max_norm)
    assert n.item() == tn.item() == 50.0
    torch.testing.assert_close(w.grad, t.grad)
    want = torch.tensor([30.0, 40.0]) * min(expected / (50.0 + 1e-6), 1.0)
    torch.testing.assert_close(w.grad, want)


# --------------------------------------------------------------------------- errors: nothing changes

BAD_ARGS = [
    ("max_norm", -1.0, ValueError, "max_norm"),
    ("max_norm", -1e-30, ValueError, "max_norm"),
    ("max_norm", float("nan"), ValueError, "max_norm"),
    ("max_norm", -INF, ValueError, "max_norm"),
    ("max_norm", None, ValueError, "max_norm"),
    ("max_norm", "abc", ValueError, "max_norm"),
    ("max_norm", torch.tensor([1.0, 2.0]), ValueError, "max_norm"),
    ("max_norm", torch.tensor(-0.5), ValueError, "max_norm"),
    ("norm_type", 0, ValueError, "norm_type"),
    ("norm_type", -1.0, ValueError, "norm_type"),
    ("norm_type", -INF, ValueError, "norm_type"),
    ("norm_type", float("nan"), ValueError, "norm_type"),
    ("norm_type", None, ValueError, "norm_type"),
    ("norm_type", "fro", ValueError, "norm_type"),
    ("norm_type", "nuc", ValueError, "norm_type"),
]
BAD_ENTRIES = [
    ("sparse", TypeError, "sparse"),
    ("complex", TypeError, "complex"),
    ("int", TypeError, "int64"),
    ("nontensor", TypeError, "not a"),
    ("none_entry", TypeError, "not a"),
    ("expanded", RuntimeError, "share memory"),
    ("nan", RuntimeError, "non-finite"),
    ("inf", RuntimeError, "non-finite"),
]


def bad_entry(kind):
    """(object to put in the list, the thing whose .grad must stay unchanged or None)."""
    if kind == "sparse":
        e = nn.Embedding(6, 3, sparse=True)
        e(torch.tensor([1, 4])).sum().backward()
        return e.weight, e.weight
    if kind == "complex":
        p = nn.Parameter(torch.zeros(3, dtype=torch.complex64))
        p.grad = torch.tensor([3 + 4j, 1j, 2], dtype=torch.complex64)
        return p, p
    if kind == "int":
        t = torch.zeros(3, dtype=torch.int64)
        t.grad = torch.tensor([1, 2, 3])
        return t, t
    if kind == "nontensor":
        return 3.0, None
    if kind == "none_entry":
        return None, None
    p = nn.Parameter(torch.zeros(3, 4))
    if kind == "expanded":
        p.grad = torch.tensor([1.0, 2.0, 3.0, 4.0]).expand(3, 4)
    else:
        p.grad = torch.ones(3, 4)
        p.grad[1, 2] = float(kind)
    return p, p


@FEW
@given(
    entries=st.lists(entry_st.map(lambda e: dict(e, grad=True)), min_size=1, max_size=4),
    bad=st.sampled_from(BAD_ARGS + BAD_ENTRIES),
    where=st.integers(0, 10),
    form=st.sampled_from(["list", "tuple", "generator"]),
)
def test_every_error_is_clear_and_changes_nothing(backend, entries, bad, where, form):
    params = make_params(entries)
    kwargs = dict(max_norm=1e-3, norm_type=2.0)
    watched = list(params)
    if len(bad) == 4:  # a bad argument
        name, value, exc, words = bad
        kwargs[name] = value
        error_if_nonfinite = False
    else:
        kind, exc, words = bad
        obj, holder = bad_entry(kind)
        params.insert(where % (len(params) + 1), obj)
        if holder is not None:
            watched.append(holder)
        error_if_nonfinite = kind in ("nan", "inf")
    snap = snapshot(watched)
    versions = [w.grad._version for w in watched]
    with pytest.raises(exc, match=words):
        ts.clip_by_global_norm(as_form(params, form), kwargs["max_norm"], kwargs["norm_type"],
                               error_if_nonfinite=error_if_nonfinite)
    assert_unchanged(watched, snap)
    assert [w.grad._version for w in watched] == versions
    # ts.global_norm refuses the same entries / norm types, with the same kind of error
    if len(bad) == 4 and bad[0] == "norm_type":
        with pytest.raises(ValueError, match="norm_type"):
            ts.global_norm([w.grad for w in watched], bad[1])
    elif len(bad) == 3 and bad[0] in ("sparse", "complex", "int"):
        with pytest.raises(TypeError):
            ts.global_norm([w.grad for w in watched])
    assert_unchanged(watched, snap)


@pytest.mark.parametrize("bad", [{"params": "not a tensor"}, {"a": {"b": [1.0]}}, {"": torch.ones(2)},
                                 "abc", 3, {"a": torch.ones(2, dtype=torch.complex64)}])
def test_bad_tree_or_object_is_an_error_and_changes_nothing(backend, bad):
    w = nn.Parameter(torch.zeros(2))
    w.grad = torch.tensor([3.0, 4.0])
    before = bits(w.grad)
    with pytest.raises((TypeError, ValueError)):
        ts.clip_by_global_norm(bad, 1e-3)
    with pytest.raises((TypeError, ValueError)):
        ts.global_norm(bad)
    assert torch.equal(bits(w.grad), before)
    if isinstance(bad, dict) and "a" in bad and isinstance(bad["a"], torch.Tensor):
        assert torch.equal(bad["a"], torch.ones(2, dtype=torch.complex64))


def test_complex_grads_torch_clips_them_here_a_type_error(backend):
    """torch clips complex gradients; documented here: TypeError naming the entry, no change."""
    p = nn.Parameter(torch.zeros(2, dtype=torch.complex64))
    p.grad = torch.tensor([3 + 4j, 0], dtype=torch.complex64)
    q = nn.Parameter(torch.zeros(2, dtype=torch.complex64))
    q.grad = p.grad.clone()
    assert torch.nn.utils.clip_grad_norm_([q], 1.0).item() == pytest.approx(5.0)
    with pytest.raises(TypeError, match="complex64"):
        ts.clip_by_global_norm([p], 1.0)
    assert torch.equal(p.grad, torch.tensor([3 + 4j, 0], dtype=torch.complex64))


_INFERENCE_REPRO = """
import torch, torchstruct as ts
from torch import nn
with torch.inference_mode():
    g = torch.ones(3)
p = nn.Parameter(torch.zeros(3)); p.grad = g
q = nn.Parameter(torch.zeros(3)); q.grad = torch.ones(3)
try:
    ts.clip_by_global_norm([p, q], 0.1)
except RuntimeError as e:
    assert "inference" in str(e), e
    assert torch.equal(q.grad, torch.ones(3)) and torch.equal(p.grad, torch.ones(3))
    print("CLEAR ERROR")
"""


def test_inference_tensor_grad_first_is_a_clear_error_not_an_abort():
    """The C++ entry point reads the first gradient's version counter, which an inference
    tensor does not have: it leaves such a list to the checked path (a subprocess, since the
    failure this guards against aborted the interpreter)."""
    env = dict(os.environ, TORCHSTRUCT_BACKEND="compiled")  # the C++ fast path of a list
    out = subprocess.run([sys.executable, "-c", _INFERENCE_REPRO], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-500:]
    assert "CLEAR ERROR" in out.stdout


def test_inference_tensor_grad_later_is_a_clear_error(backend):
    with torch.inference_mode():
        g = torch.ones(3)
    p = nn.Parameter(torch.zeros(3))
    p.grad = g
    q = nn.Parameter(torch.zeros(3))
    q.grad = torch.ones(3)
    with pytest.raises(RuntimeError, match="inference"):
        ts.clip_by_global_norm([q, p], 0.1)
    assert torch.equal(q.grad, torch.ones(3)) and torch.equal(p.grad, torch.ones(3))


# --------------------------------------------------------------------------- overlapping grads


def test_overlapping_views_and_shared_grads_as_torch(backend):
    """Grads that share memory (views of one buffer, one tensor held by two parameters): torch
    reads each entry for the norm and multiplies entry by entry; so must the drop-in."""
    def build():
        base = torch.arange(1.0, 13.0)
        a, b, c = (nn.Parameter(torch.zeros(6)) for _ in range(3))
        a.grad, b.grad = base[0:6], base[3:9]      # overlapping views
        c.grad = a.grad                            # the very same tensor
        d = nn.Parameter(torch.zeros(2, 3))
        d.grad = base[6:12].view(3, 2).t()         # a transposed view, overlapping b
        return base, [a, b, c, d]

    for norm_type in (1.0, 2.0, INF):
        base, params = build()
        tbase, theirs = build()
        n = ts.clip_by_global_norm(params, 3.0, norm_type)
        tn = torch.nn.utils.clip_grad_norm_(theirs, 3.0, norm_type)
        torch.testing.assert_close(n, tn)
        torch.testing.assert_close(base, tbase, rtol=1e-6, atol=0)


# --------------------------------------------------------------------------- models


class TiedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4)
        self.extra = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied: one parameter, two paths

    def forward(self, x):
        return self.head(self.extra(torch.tanh(self.body(self.embed(x)))))


def tied_net(seed=0):
    torch.manual_seed(seed)
    return TiedNet()


def net_loss(m):
    return m(torch.tensor([1, 2, 3, 7])).logsumexp(-1).sum() * 3.0


SELECTORS = [(), ("body",), ("extra.bias",), ("body", "extra"), ("embed",)]


@FEW
@given(
    seed=st.integers(0, 1000),
    selectors=st.sampled_from(SELECTORS),
    by_hand=st.sampled_from([None, "extra.weight", "body.bias"]),
    norm_type=st.sampled_from([1.0, 2.0, 3.5, INF]),
    max_norm=st.sampled_from([0.0, 1e-2, 1.0, 1e6]),
    as_alias=st.booleans(),
)
def test_model_form_clips_trainable_grads_tied_once(backend, seed, selectors, by_hand, norm_type,
                                                    max_norm, as_alias):
    m = tied_net(seed)
    net_loss(m).backward()
    if by_hand is not None:  # frozen by hand, with a stale grad
        p = m.get_parameter(by_hand)
        p.requires_grad_(False)
        p.grad = torch.full_like(p, 100.0)
    fn = ts.clip_grad_norm_ if as_alias else ts.clip_by_global_norm
    ctx = ts.freeze(m, *selectors) if selectors else _nullcontext()
    all_params = list(m.parameters())  # tied once
    assert len(all_params) == 5
    with ctx:
        trainable = [p for p in all_params if p.requires_grad]  # flags change at once
        assert [p for _, p in ts.trainable_parameters(m)] == trainable
        frozen = [p for p in all_params if not p.requires_grad]
        frozen_snap = snapshot(frozen)
        before = [p.grad.clone() for p in trainable]
        holders = clone_structure(trainable)
        n = fn(m, max_norm, norm_type)
        tn = torch.nn.utils.clip_grad_norm_(holders, max_norm, norm_type)
    exact = exact_norm(before, norm_type)
    torch.testing.assert_close(n.double(), exact.float().double(), rtol=1e-5, atol=0)
    torch.testing.assert_close(n, tn, rtol=1e-5, atol=0)
    assert n.dtype == torch.float32 and n.shape == ()
    coef = min(max_norm / (exact.item() + 1e-6), 1.0)
    for p, b, h in zip(trainable, before, holders):
        torch.testing.assert_close(p.grad.double(), b.double() * coef, rtol=1e-5, atol=1e-30)
        torch.testing.assert_close(p.grad, h.grad, rtol=1e-5, atol=1e-30)
    assert_unchanged(frozen, frozen_snap)


def test_model_parameters_generator_is_taken_as_given(backend):
    """``model.parameters()``: every parameter with a grad, frozen or not, as torch."""
    m = tied_net(1)
    net_loss(m).backward()
    m.body.weight.requires_grad_(False)  # a stale grad: the list form still clips it (torch)
    t = tied_net(1)
    for p, q in zip(m.parameters(), t.parameters()):
        q.grad = p.grad.clone()
    n = ts.clip_by_global_norm(m.parameters(), 0.05)
    tn = torch.nn.utils.clip_grad_norm_(t.parameters(), 0.05)
    torch.testing.assert_close(n, tn)
    for p, q in zip(m.parameters(), t.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    assert m.body.weight.grad.norm() < 0.05 + 1e-6


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# --------------------------------------------------------------------------- trees


@FEW
@given(
    seed=st.integers(0, 1000),
    selectors=st.sampled_from(SELECTORS),
    form=st.sampled_from(["nested", "flat", "mixed", "with_none", "same_tensor_twice"]),
    norm_type=st.sampled_from([1.0, 2.0, 0.5, INF]),
    max_norm=st.sampled_from([0.0, 1e-2, 1.0, 1e6]),
)
def test_tree_of_grads_clipped_in_place(backend, seed, selectors, form, norm_type, max_norm):
    m = tied_net(seed)
    ctx = ts.freeze(m, *selectors) if selectors else _nullcontext()
    with ctx:
        tree = ts.structural_grad(m, net_loss)
    assert all(p.grad is None for p in m.parameters())  # no .grad side effects
    paths = ts.tree.paths(tree)
    assert "head.weight" not in paths  # a tied parameter lives at its first path
    leaves = ts.tree.leaves(tree)
    # the same gradient via backward(), for the trainable parameters: the tree is that gradient
    with ctx:
        net_loss(m).backward()
        expected_grads = {path: p.grad for path, p in ts.trainable_parameters(m)}
    assert list(expected_grads) == paths
    for path, leaf in zip(paths, leaves):
        torch.testing.assert_close(leaf, expected_grads[path], rtol=1e-5, atol=1e-7)

    if form == "nested":
        arg = tree
    elif form == "flat":
        arg = ts.tree.to_flat_dict(tree)
    elif form == "mixed":  # the first module's leaves under dotted keys, the rest nested
        first, *rest = list(tree)
        sub = tree[first]
        arg = {f"{first}.{k}": v for k, v in ts.tree.to_flat_dict(sub).items()} if isinstance(sub, dict) else {first: sub}
        arg.update({k: tree[k] for k in rest})
    elif form == "with_none":
        arg = dict(tree)
        arg["frozen_thing"] = None
    else:  # the same tensor object at two paths: counted once, scaled once
        arg = dict(ts.tree.to_flat_dict(tree))
        arg["copy_of_first"] = leaves[0]
    before = [t.clone() for t in leaves]
    holders = [nn.Parameter(torch.zeros_like(b)) for b in before]
    for h, b in zip(holders, before):
        h.grad = b.clone()
    n = ts.clip_by_global_norm(arg, max_norm, norm_type)
    tn = torch.nn.utils.clip_grad_norm_(holders, max_norm, norm_type)
    exact = exact_norm(before, norm_type)
    torch.testing.assert_close(n.double(), exact.float().double(), rtol=1e-5, atol=0)
    torch.testing.assert_close(n, tn, rtol=1e-5, atol=0)
    coef = min(max_norm / (exact.item() + 1e-6), 1.0)
    for leaf, b, h in zip(ts.tree.leaves(tree), before, holders):  # the leaves themselves
        torch.testing.assert_close(leaf.double(), b.double() * coef, rtol=1e-5, atol=1e-30)
        torch.testing.assert_close(leaf, h.grad, rtol=1e-5, atol=1e-30)
    # global_norm of the clipped tree: min(norm, max_norm)
    g = ts.global_norm(arg, norm_type)
    want = exact_norm([leaf for leaf in ts.tree.leaves(tree)], norm_type)
    torch.testing.assert_close(g.double(), want.float().double(), rtol=1e-5, atol=1e-30)


def test_global_norm_of_state_dict_counts_tied_weight_once(backend):
    m = tied_net(0)
    sd = m.state_dict()  # a flat path-keyed dict: two detached views of the tied weight
    assert sd["embed.weight"].data_ptr() == sd["head.weight"].data_ptr()
    vec, spec = ts.tree.flatten(sd)  # flatten stores the tied weight once
    assert spec.numel == sum(p.numel() for p in m.parameters())
    torch.testing.assert_close(ts.global_norm(sd), torch.linalg.vector_norm(vec), rtol=1e-5, atol=0)


def test_clip_tree_of_views_of_one_grad_scales_once(backend):
    g = torch.full((10, 4), 1.0)
    tree = {"embed": {"weight": g}, "head": {"weight": g.detach()}}  # one memory, two views
    n = ts.clip_by_global_norm(tree, 1.0)
    torch.testing.assert_close(n, torch.tensor(math.sqrt(40.0)))
    torch.testing.assert_close(g.norm(), torch.tensor(1.0), rtol=1e-5, atol=0)


# --------------------------------------------------------------------------- global_norm


gn_entry_st = st.fixed_dictionaries(
    {
        "shape": st.sampled_from(SHAPES),
        "dtype": st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]),
        "layout": st.sampled_from(["contig", "transposed", "strided"]),
        "scale": st.sampled_from([1e-2, 1.0, 30.0]),
        "grad": st.just(True),
        "requires_grad": st.just(True),
        "seed": st.integers(0, 2**16),
    }
)


@SETTINGS
@given(
    entries=st.lists(gn_entry_st, min_size=0, max_size=5),
    dups=st.lists(st.integers(0, 50), max_size=2),
    norm_type=st.sampled_from(NORM_TYPES),
    form=st.sampled_from(["list", "tuple", "generator", "single"]),
)
def test_global_norm_matches_get_total_norm(backend, entries, dups, norm_type, form):
    tensors = [p.grad for p in make_params(entries)]
    if tensors:
        tensors += [tensors[i % len(tensors)] for i in dups]
    if form == "single" and len(tensors) != 1:
        form = "list"
    p = float(norm_type)
    snap = [bits(t) for t in tensors]
    n = ts.global_norm(as_form(tensors, form), norm_type)
    assert all(torch.equal(a, bits(t)) for a, t in zip(snap, tensors))  # read only
    # documented: float32 (float64 with any float64 input; fp16/bf16 accumulate in fp32) where
    # torch's get_total_norm returns the promotion (fp16 alone: fp16)
    want_dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    assert n.dtype == want_dtype and n.shape == () and n.device.type == "cpu"
    exact = exact_norm(tensors, p)  # the list as given: a duplicate counts twice
    torch.testing.assert_close(n.double(), exact.to(want_dtype).double(), rtol=1e-5, atol=1e-30)
    usable = [t for t in tensors if not (math.isinf(p) and t.numel() == 0)]
    if math.isinf(p) and len(usable) != len(tensors):
        with pytest.raises(RuntimeError):  # torch refuses; documented: contributes nothing
            torch.nn.utils.get_total_norm(tensors, norm_type)
    tn = torch.nn.utils.get_total_norm(usable, norm_type)
    per_tensor_overflow = any(bool(torch.isinf(exact_norm([t], p).to(t.dtype))) for t in usable)
    if not per_tensor_overflow:
        low = max([eps(t.dtype) for t in usable], default=eps(torch.float32))
        torch.testing.assert_close(n.double(), tn.double(), rtol=max(4 * low, 1e-5), atol=1e-30)


def test_global_norm_of_model_is_trainable_grads_tied_once(backend):
    m = tied_net(3)
    net_loss(m).backward()
    m.body.weight.requires_grad_(False)
    m.body.weight.grad = torch.full_like(m.body.weight, 1e3)  # stale, frozen: not counted
    with ts.freeze(m, "extra.bias"):
        grads = [p.grad for p in m.parameters() if p.requires_grad]
        assert len(grads) == 3  # embed (tied, once), body.bias, extra.weight
        for p in (1.0, 2.0, INF):
            torch.testing.assert_close(ts.global_norm(m, p).double(), exact_norm(grads, p).float().double(),
                                       rtol=1e-5, atol=0)
    assert ts.global_norm([]).dtype == torch.float32 and ts.global_norm([]).item() == 0.0
    assert ts.global_norm(nn.Linear(2, 2)).item() == 0.0  # no grads at all


# --------------------------------------------------------------------------- polyak_update


@FEW
@given(
    seed=st.integers(0, 1000),
    tau=st.one_of(st.sampled_from([0.0, 1.0, 0.5, 1e-3, 0.999]), st.floats(0.0, 1.0)),
    selectors=st.sampled_from(SELECTORS),
    by_hand=st.sampled_from([None, "extra.weight"]),
    source_form=st.sampled_from(["module", "tree", "flat", "state_dict"]),
)
def test_polyak_update_matches_brute_force(backend, seed, tau, selectors, by_hand, source_form):
    target, source = tied_net(seed), tied_net(seed + 1)
    if by_hand is not None:
        target.get_parameter(by_hand).requires_grad_(False)
    if source_form == "module":
        src = source
    elif source_form == "tree":
        src = ts.tree.from_module(source)
    elif source_form == "flat":
        src = ts.tree.to_flat_dict(ts.tree.from_module(source))
    else:
        src = source.state_dict()
    ctx = ts.freeze(target, *selectors) if selectors else _nullcontext()
    with ctx:
        params = list(target.parameters())  # tied once
        old = [p.detach().clone() for p in params]
        trainable = [p.requires_grad for p in params]
        out = ts.polyak_update(target, src, tau)
    assert out is target
    source_params = dict(source.named_parameters())
    for (path, p), o, tr in zip(target.named_parameters(), old, trainable):
        s = source_params[path].detach()
        if not tr:
            assert torch.equal(bits(p), bits(o)), path  # frozen: bitwise untouched
        elif tau == 0.0:
            assert torch.equal(bits(p), bits(o)), path
        elif tau == 1.0:
            assert torch.equal(p.detach(), s), path
        else:  # updated once (a tied parameter twice would be (1-tau)**2)
            torch.testing.assert_close(p.detach(), (1 - tau) * o + tau * s, rtol=1e-6, atol=1e-7)
    for p, q in zip(source.parameters(), tied_net(seed + 1).parameters()):
        assert torch.equal(p, q)  # the source is untouched


@pytest.mark.parametrize("tau, exc", [(-0.1, ValueError), (1.5, ValueError), (float("nan"), ValueError),
                                      (INF, ValueError), ("0.5", TypeError), (True, TypeError),
                                      (None, TypeError), (torch.tensor([0.1, 0.2]), TypeError)])
def test_polyak_update_bad_tau_changes_nothing(backend, tau, exc):
    target, source = tied_net(0), tied_net(1)
    old = [bits(p) for p in target.parameters()]
    with pytest.raises(exc, match="tau"):
        ts.polyak_update(target, source, tau)
    assert all(torch.equal(bits(p), o) for p, o in zip(target.parameters(), old))


def test_polyak_update_bad_source_changes_nothing(backend):
    target, source = tied_net(0), tied_net(1)
    old = [bits(p) for p in target.parameters()]
    bad_trees = [
        {k: v for k, v in ts.tree.to_flat_dict(ts.tree.from_module(source)).items() if k != "extra.bias"},
        {**ts.tree.to_flat_dict(ts.tree.from_module(source)), "extra.bias": torch.zeros(5)},
        {**ts.tree.to_flat_dict(ts.tree.from_module(source)),
         "extra.bias": torch.zeros(4, dtype=torch.float64)},
        {**ts.tree.to_flat_dict(ts.tree.from_module(source)), "nonexistent.weight": torch.zeros(1)},
        {**ts.tree.to_flat_dict(ts.tree.from_module(source)), "head.weight": torch.zeros(10, 4)},
    ]
    for bad in bad_trees:
        with pytest.raises(ValueError):
            ts.polyak_update(target, bad, 0.5)
        assert all(torch.equal(bits(p), o) for p, o in zip(target.parameters(), old))
    untied = tied_net(1)
    untied.head.weight = nn.Parameter(untied.embed.weight.detach() + 1.0)  # the tie broken
    with pytest.raises(ValueError, match="tied"):
        ts.polyak_update(target, untied, 0.5)
    assert all(torch.equal(bits(p), o) for p, o in zip(target.parameters(), old))
    with pytest.raises(TypeError):
        ts.polyak_update(target, [p for p in source.parameters()], 0.5)
    assert all(torch.equal(bits(p), o) for p, o in zip(target.parameters(), old))


# --------------------------------------------------------------------------- tree round trips

leaf_st = st.tuples(
    st.sampled_from([(), (0,), (1,), (3,), (2, 3), (4, 1, 2), (5, 0)]),
    st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64]),
    st.sampled_from(["contig", "transposed"]),
    st.integers(0, 2**16),
)
tree_st = st.recursive(
    st.dictionaries(st.sampled_from(["weight", "bias", "a", "b"]), leaf_st, min_size=1, max_size=3),
    lambda children: st.dictionaries(st.sampled_from(["enc", "dec", "0", "1"]), children | leaf_st,
                                     min_size=1, max_size=3),
    max_leaves=8,
)


def materialize(spec):
    if isinstance(spec, dict):
        return {k: materialize(v) for k, v in spec.items()}
    shape, dtype, layout, seed = spec
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.int64:
        return torch.randint(-100, 100, shape, generator=gen)
    if layout == "transposed" and len(shape) == 2:
        return torch.randn(shape[::-1], generator=gen).to(dtype).t()
    return torch.randn(shape, generator=gen).to(dtype)


@SETTINGS
@given(spec=tree_st, flat=st.booleans())
def test_tree_flatten_unflatten_round_trip(backend, spec, flat):
    tree = materialize(spec)
    if flat:
        tree = ts.tree.to_flat_dict(tree)
    paths, leaves = ts.tree.paths(tree), ts.tree.leaves(tree)
    vec, tspec = ts.tree.flatten(tree)
    dtype = promoted([t.dtype for t in leaves]) if leaves else torch.float32
    assert vec.dim() == 1 and vec.dtype == dtype == tspec.dtype
    assert vec.numel() == tspec.numel == sum(t.numel() for t in leaves)
    assert list(tspec.paths) == paths
    expected = torch.cat([t.reshape(-1).to(dtype) for t in leaves]) if leaves else torch.zeros(0)
    assert torch.equal(vec, expected)
    back = ts.tree.unflatten(vec, tspec)
    assert ts.tree.paths(back) == paths
    assert list(back) == list(tree)  # the same keys (flat stays flat, nested stays nested)
    for a, b in zip(ts.tree.leaves(back), leaves):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(bits(a), bits(b))  # every cast here is exact
    float_leaves = [t for t in leaves if t.is_floating_point()]
    if float_leaves and len(float_leaves) == len(leaves):
        torch.testing.assert_close(ts.global_norm(tree).double(),
                                   torch.linalg.vector_norm(vec.double()), rtol=1e-5, atol=1e-30)
    with pytest.raises(ValueError):
        ts.tree.unflatten(torch.zeros(vec.numel() + 1, dtype=vec.dtype), tspec)


def test_empty_generator_warns_as_torch(backend):
    with pytest.warns(UserWarning, match="empty generator"):
        n = ts.clip_by_global_norm((p for p in []), 1.0)
    with pytest.warns(UserWarning, match="empty generator"):
        tn = torch.nn.utils.clip_grad_norm_((p for p in []), 1.0)
    assert n.dtype == tn.dtype == torch.float32 and n.item() == tn.item() == 0.0
    # every parameter without a grad, an empty list: tensor(0.), nothing to clip, as torch
    ps = [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))]
    for arg in ([], ps, tuple(ps), ps[0]):
        n = ts.clip_by_global_norm(arg, 1.0)
        tn = torch.nn.utils.clip_grad_norm_(arg, 1.0)
        assert n.dtype == tn.dtype and n.item() == tn.item() == 0.0 and n.shape == ()
    assert all(p.grad is None for p in ps)
