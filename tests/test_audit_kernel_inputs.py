"""Kernel inputs shaped the way training frameworks hand them over.

``ts.clip_by_global_norm``, ``ts.global_norm`` and the fused ``ts.optim.SGD`` /
``ts.optim.AdamW`` steps are compared with PyTorch itself (``clip_grad_norm_``,
``torch.optim`` with ``foreach=False``) and with float64 brute-force norms, on:
DDP gradient bucket views (``gradient_as_bucket_view=True``, also ``static_graph``),
parameters and gradients that are views into one flat buffer (with storage offsets),
non-contiguous, channels_last, expanded and gap-strided tensors, repeated and
overlapping tensors, 0-dim, empty and many tiny tensors, tensors larger than the
kernels' work chunks, mixed dtypes, sparse / complex / mismatched-dtype input,
non-finite values and every norm type. After every in-place update the version
counters, views and the rest of a shared buffer are checked; every refused input
must leave parameters, gradients and optimizer state bitwise unchanged.
"""
import copy
import math
import os
import tempfile

import pytest
import torch
from torch import nn

import torchstruct as ts

INF = float("inf")


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def _gloo_available() -> bool:
    try:
        import torch.distributed as dist
        return dist.is_available() and dist.is_gloo_available()
    except Exception:  # pragma: no cover
        return False


needs_gloo = pytest.mark.skipif(not _gloo_available(), reason="torch.distributed gloo unavailable")


def _clone_strided(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with the same sizes and strides (and dtype)."""
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
    out.copy_(t)
    return out


def _param(data: torch.Tensor, grad=None, requires_grad=True) -> nn.Parameter:
    p = nn.Parameter(data, requires_grad=requires_grad)
    p.grad = grad
    return p


def _holder(grad: torch.Tensor) -> nn.Parameter:
    """A parameter of ``grad``'s shape and dtype whose ``.grad`` is ``grad`` itself."""
    return _param(torch.zeros(grad.shape, dtype=grad.dtype), grad)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` (NaN-safe bitwise comparison)."""
    t = t.detach()
    if t.numel() == 0:
        return t.reshape(-1).view(torch.uint8)
    view = {torch.float64: torch.int64, torch.float32: torch.int32,
            torch.float16: torch.int16, torch.bfloat16: torch.int16}.get(t.dtype)
    return t.contiguous().view(view) if view is not None else t.clone()


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _brute_norm(tensors, p) -> float:
    flat = torch.cat([t.detach().double().reshape(-1) for t in tensors])
    if flat.numel() == 0:
        return 0.0
    return float(torch.linalg.vector_norm(flat, p))


def _snapshot(opt, params):
    """Everything a step may change, deep-copied."""
    grads = []
    for p in params:
        g = p.grad
        grads.append(None if g is None else (g.to_dense() if g.is_sparse else g.clone()))
    state = {i: {k: (v.clone() if torch.is_tensor(v) else copy.deepcopy(v))
                 for k, v in opt.state[p].items()}
             for i, p in enumerate(params) if p in opt.state}
    last = opt.last_grad_norm
    return ([_clone_strided(p.detach()) for p in params], grads, state,
            None if last is None else last.clone())


def _same_snapshot(a, b) -> bool:
    pa, ga, sa, la = a
    pb, gb, sb, lb = b
    if not all(_bitwise(x, y) for x, y in zip(pa, pb)):
        return False
    for x, y in zip(ga, gb):
        if (x is None) != (y is None) or (x is not None and not _bitwise(x, y)):
            return False
    if sa.keys() != sb.keys():
        return False
    for k in sa:
        if sa[k].keys() != sb[k].keys():
            return False
        for key in sa[k]:
            x, y = sa[k][key], sb[k][key]
            if torch.is_tensor(x):
                if not _bitwise(x, y):
                    return False
            elif x != y:
                return False
    if (la is None) != (lb is None):
        return False
    return la is None or _bitwise(la, lb)


# ---------------------------------------------------------------------------
# clip_by_global_norm / global_norm
# ---------------------------------------------------------------------------


def _clip_both(grads, max_norm, norm_type=2.0, **kw):
    """(ts total, ts grads, torch total, torch grads) on copies of ``grads``."""
    ours = [_holder(_clone_strided(g)) for g in grads]
    theirs = [_holder(_clone_strided(g)) for g in grads]
    total = ts.clip_by_global_norm(ours, max_norm, norm_type, **kw)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type, **kw)
    return total, [p.grad for p in ours], expected, [p.grad for p in theirs]


LAYOUTS = {
    "channels_last": lambda: torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
    "transposed": lambda: torch.randn(5, 7).t(),
    "gap_strided": lambda: torch.randn(6, 8)[:, ::2],
    "storage_offset": lambda: torch.randn(50)[7:40],
    "zero_dim": lambda: torch.tensor(2.5),
    "empty": lambda: torch.empty(0, 3),
    "larger_than_chunk": lambda: torch.randn(3 * 65536 + 17),
    "large_gap_strided": lambda: torch.randn(2 * 65536 + 9, 2)[:, 0],
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("max_norm", [0.5, 1e9])
def test_clip_layouts_match_torch(layout, max_norm):
    torch.manual_seed(0)
    grads = [LAYOUTS[layout](), torch.randn(9)]
    brute = _brute_norm(grads, 2.0)
    total, ours, expected, theirs = _clip_both(grads, max_norm)
    assert total.dtype == expected.dtype and total.shape == ()
    assert math.isclose(float(total), brute, rel_tol=1e-6)
    # torch sums large float32 tensors less accurately than the float64 brute force
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=0)
    for a, b, g in zip(ours, theirs, grads):
        assert a.stride() == g.stride()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-12)
    if max_norm > brute:  # no clipping: bitwise the input
        assert all(_bitwise(a, g) for a, g in zip(ours, grads))


def test_clip_flat_param_and_grad_buffers_neighbours_untouched():
    """FSDP1 / Megatron style: parameters are views into one flat buffer and gradients views
    into one flat gradient buffer, with offsets and unused gaps between them."""
    torch.manual_seed(0)
    flat = torch.randn(400)
    gflat = torch.randn(400)
    shapes = [(3, 4), (10,), (5, 5, 2), (7,), ()]
    params, off = [], 5
    used = torch.zeros(400, dtype=torch.bool)
    for s in shapes:
        n = math.prod(s)
        params.append(_param(flat[off:off + n].view(s), gflat[off:off + n].view(s)))
        used[off:off + n] = True
        off += n + 3
    gflat_before = gflat.clone()
    flat_before = flat.clone()
    watch = gflat[5:17].view(3, 4)  # another view of the first gradient
    versions = [p.grad._version for p in params]
    expected_total, expected_grads = (lambda hs: (torch.nn.utils.clip_grad_norm_(hs, 0.5),
                                                  [h.grad for h in hs]))(
        [_holder(p.grad.clone()) for p in params])

    total = ts.clip_by_global_norm(params, 0.5)

    torch.testing.assert_close(total, expected_total, rtol=1e-6, atol=0)
    for p, e in zip(params, expected_grads):
        torch.testing.assert_close(p.grad, e, rtol=2e-6, atol=1e-12)
    assert torch.equal(gflat[~used], gflat_before[~used])  # gaps untouched
    assert torch.equal(flat, flat_before)                  # parameters untouched
    assert torch.equal(watch, params[0].grad)              # views see the update
    assert all(p.grad._version > v for p, v in zip(params, versions))


@pytest.mark.parametrize("norm_type", [1, 2, 3.5, INF, 0.5, 20])
def test_global_norm_mixed_dtypes_and_layouts_vs_float64(norm_type):
    torch.manual_seed(0)
    tensors = [torch.randn(70001) * 10, torch.randn(7, dtype=torch.float64),
               torch.randn(70000).to(torch.bfloat16)[::2], torch.randn(33).half(),
               torch.randn(3, 4, 5, 6).to(memory_format=torch.channels_last), torch.tensor(-3.0),
               torch.empty(0)]
    out = ts.global_norm(tensors, norm_type)
    assert out.dtype == torch.float64
    # float32 tensors are summed in float32 lanes before the float64 combination
    assert math.isclose(float(out), _brute_norm(tensors, norm_type), rel_tol=1e-7)
    out32 = ts.global_norm([t for t in tensors if t.dtype != torch.float64], norm_type)
    assert out32.dtype == torch.float32
    assert math.isclose(float(out32), _brute_norm([t for t in tensors if t.dtype != torch.float64],
                                                  norm_type), rel_tol=1e-6)


@pytest.mark.parametrize("dtypes,expected", [
    ((torch.float16,), torch.float16),
    ((torch.bfloat16,), torch.bfloat16),
    ((torch.float16, torch.bfloat16), torch.float32),
    ((torch.float16, torch.float32), torch.float32),
    ((torch.bfloat16, torch.float64), torch.float64),
])
def test_clip_mixed_dtypes_return_dtype_and_exact_norm(dtypes, expected):
    torch.manual_seed(0)
    grads = [torch.randn(300).to(d) * 4 for d in dtypes]
    total, ours, ref_total, theirs = _clip_both(grads, 0.5)
    assert total.dtype == expected == ref_total.dtype
    brute = _brute_norm(grads, 2.0)
    assert math.isclose(float(total), float(torch.tensor(brute).to(expected)), rel_tol=1e-6)
    coef = 0.5 / (brute + 1e-6)
    for a, g in zip(ours, grads):
        assert a.dtype == g.dtype
        torch.testing.assert_close(a.double(), g.double() * coef,
                                   rtol=max(2 * torch.finfo(g.dtype).eps, 1e-6), atol=0)


@pytest.mark.parametrize("norm_type", [1, 2, 3.5, INF])
def test_clip_norm_types_match_torch(norm_type):
    torch.manual_seed(1)
    grads = [torch.randn(10), torch.randn(3, 3).t(), torch.randn(70000)[::3]]
    total, ours, expected, theirs = _clip_both(grads, 0.3, norm_type)
    assert math.isclose(float(total), _brute_norm(grads, norm_type), rel_tol=1e-6)
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=0)  # torch: float32 sums
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("norm_type", [0, -1, -INF, float("nan"), None, "fro"])
def test_clip_bad_norm_type_refused_nothing_changes(norm_type):
    params = [_holder(torch.tensor([3.0, 4.0])), _holder(torch.randn(70000))]
    before = [p.grad.clone() for p in params]
    with pytest.raises(ValueError, match="norm_type"):
        ts.clip_by_global_norm(params, 1.0, norm_type)
    with pytest.raises(ValueError, match="norm_type"):
        ts.global_norm([p.grad for p in params], norm_type)
    assert all(_bitwise(p.grad, b) for p, b in zip(params, before))


@pytest.mark.parametrize("max_norm", [-1.0, float("nan"), None, "abc"])
def test_clip_bad_max_norm_refused_nothing_changes(max_norm):
    params = [_holder(torch.tensor([3.0, 4.0]))]
    before = params[0].grad.clone()
    with pytest.raises(ValueError, match="max_norm"):
        ts.clip_by_global_norm(params, max_norm)
    assert _bitwise(params[0].grad, before)


@pytest.mark.parametrize("max_norm", [0.0, 1e300, INF])
def test_clip_extreme_max_norm_matches_torch(max_norm):
    torch.manual_seed(0)
    grads = [torch.randn(10), torch.randn(2, 3).t()]
    total, ours, expected, theirs = _clip_both(grads, max_norm)
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
    for a, b in zip(ours, theirs):
        assert _bitwise(a, b)


@pytest.mark.parametrize("bad", [float("nan"), INF, -INF])
@pytest.mark.parametrize("norm_type", [1, 2, 3.5, INF])
def test_clip_nonfinite_without_error_matches_torch(bad, norm_type):
    torch.manual_seed(0)
    grads = [torch.tensor([bad, 1.0, 0.0]), torch.randn(70000)]
    total, ours, expected, theirs = _clip_both(grads, 1.0, norm_type)
    assert _bitwise(total, expected)
    for a, b in zip(ours, theirs):
        assert torch.equal(a.isnan(), b.isnan())
        torch.testing.assert_close(a.nan_to_num(), b.nan_to_num(), rtol=0, atol=0)


@pytest.mark.parametrize("bad", [float("nan"), INF])
def test_clip_nonfinite_with_error_raises_and_changes_nothing(bad):
    grads = [torch.randn(5), torch.tensor([bad, 1.0]), torch.randn(6, 4)[:, ::2]]
    params = [_holder(g) for g in grads]
    before = [g.clone() for g in grads]
    with pytest.raises(RuntimeError, match="non-finite"):
        ts.clip_by_global_norm(params, 1.0, error_if_nonfinite=True)
    assert all(_bitwise(p.grad, b) for p, b in zip(params, before))
    # and like torch without the error when everything is finite
    params[1].grad = torch.tensor([2.0, 1.0])
    theirs = [_holder(p.grad.clone()) for p in params]
    total = ts.clip_by_global_norm(params, 1.0, error_if_nonfinite=True)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0, error_if_nonfinite=True)
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)


def test_clip_fp16_norm_overflow_clips_instead_of_zeroing():
    p = _holder(torch.full((4,), 60000.0, dtype=torch.float16))
    total = ts.clip_by_global_norm([p], 1.0)
    assert total.dtype == torch.float16 and math.isinf(float(total))
    torch.testing.assert_close(p.grad.double().norm(), torch.tensor(1.0, dtype=torch.float64),
                               rtol=2e-3, atol=0)
    p.grad = torch.full((4,), 60000.0, dtype=torch.float16)
    before = p.grad.clone()
    with pytest.raises(RuntimeError, match="non-finite"):
        ts.clip_by_global_norm([p], 1.0, error_if_nonfinite=True)
    assert _bitwise(p.grad, before)


def _buffer_clip(build, **kw):
    torch.manual_seed(3)
    base = torch.randn(300000)
    out = []
    for fn in (ts.clip_by_global_norm, torch.nn.utils.clip_grad_norm_):
        buf = base.clone()
        total = fn(build(buf), 0.5, **kw)
        out.append((total, buf))
    return out


@pytest.mark.parametrize("case", ["same_grad_twice", "same_param_twice", "overlapping",
                                  "overlapping_large", "interleaved_strided", "mixed_views"])
@pytest.mark.parametrize("error_if_nonfinite", [False, True])
def test_clip_repeated_and_overlapping_grads_like_torch(case, error_if_nonfinite):
    """A gradient listed twice counts twice and is scaled twice, as in torch (documented),
    also for views that only partly overlap."""
    builds = {
        "same_grad_twice": lambda b: [_holder(b[:100]), _holder(b[100:200]), _holder(b[:100])],
        "same_param_twice": lambda b: (lambda p: [p, _holder(b[200:300]), p])(_holder(b[:100])),
        "overlapping": lambda b: [_holder(b[:100]), _holder(b[50:150])],
        "overlapping_large": lambda b: [_holder(b[:200000]), _holder(b[100000:300000])],
        "interleaved_strided": lambda b: [_holder(b[0:1000:2]), _holder(b[1:1000:2])],
        "mixed_views": lambda b: [_holder(b[:1200].view(30, 40)[:, :20]),
                                  _holder(b[:1200].view(30, 40)[:, 10:30]),
                                  _holder(b[:1200].view(30, 40).t())],
    }
    (t_ours, b_ours), (t_torch, b_torch) = _buffer_clip(builds[case],
                                                        error_if_nonfinite=error_if_nonfinite)
    torch.testing.assert_close(t_ours, t_torch, rtol=1e-6, atol=0)
    torch.testing.assert_close(b_ours, b_torch, rtol=2e-6, atol=1e-12)


def test_clip_expanded_grad_refused_nothing_changes():
    first = torch.randn(10)
    params = [_holder(first), _holder(torch.randn(1, 4).expand(3, 4)), _holder(torch.randn(5))]
    before = [p.grad.clone() for p in params]
    with pytest.raises(RuntimeError, match="share memory"):
        ts.clip_by_global_norm(params, 1e-3)
    assert all(_bitwise(p.grad, b) for p, b in zip(params, before))
    # also when no clipping would be needed
    with pytest.raises(RuntimeError, match="share memory"):
        ts.clip_by_global_norm(params, 1e9)
    assert all(_bitwise(p.grad, b) for p, b in zip(params, before))


def test_clip_sparse_grad_refused_nothing_changes():
    emb = nn.Embedding(10, 3, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    dense = _holder(torch.randn(70000))
    before = dense.grad.clone()
    sparse_before = emb.weight.grad.to_dense()
    with pytest.raises(TypeError, match="tensor 1"):
        ts.clip_by_global_norm([dense, emb.weight], 1e-3)
    assert _bitwise(dense.grad, before)
    assert torch.equal(emb.weight.grad.to_dense(), sparse_before)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.int64, torch.bool])
def test_clip_unsupported_dtype_refused_nothing_changes(dtype):
    good = torch.randn(100)
    bad = torch.ones(4, dtype=dtype)
    before = good.clone()
    with pytest.raises(TypeError):
        ts.clip_by_global_norm({"a": good, "b": bad}, 1e-3)
    with pytest.raises(TypeError):
        ts._ops.clip_by_global_norm_([good, bad], 1e-3)
    with pytest.raises(TypeError):
        ts.global_norm([good, bad])
    assert _bitwise(good, before)


def test_clip_frozen_params_with_grads_and_none_grads_like_torch():
    """A list of parameters is taken as given (clip_grad_norm_): a requires_grad=False
    parameter's .grad is clipped too, None grads are skipped."""
    torch.manual_seed(0)
    grads = [torch.randn(4), torch.randn(3), torch.randn(2, 2)]
    ours = [_param(torch.zeros(4), grads[0].clone()),
            _param(torch.zeros(3), grads[1].clone(), requires_grad=False),
            _param(torch.zeros(5)),
            _param(torch.zeros(2, 2), grads[2].clone())]
    theirs = [_param(torch.zeros(4), grads[0].clone()),
              _param(torch.zeros(3), grads[1].clone(), requires_grad=False),
              _param(torch.zeros(5)),
              _param(torch.zeros(2, 2), grads[2].clone())]
    total = ts.clip_by_global_norm(ours, 0.1)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 0.1)
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
    assert ours[2].grad is None
    for a, b in zip(ours, theirs):
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=2e-6, atol=0)
    # nothing to clip at all: torch's tensor(0.)
    empty = ts.clip_by_global_norm([_param(torch.zeros(2))], 1.0)
    assert float(empty) == 0.0


def test_clip_many_tiny_tensors_match_torch():
    torch.manual_seed(0)
    grads = [torch.randn(1 + (i % 3)) for i in range(4000)] + [torch.tensor(1.0)] * 3
    total, ours, expected, theirs = _clip_both(grads, 1.0)
    assert math.isclose(float(total), _brute_norm(grads, 2.0), rel_tol=1e-6)
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-12)


@pytest.mark.parametrize("foreach", [None, True, False])
def test_clip_foreach_accepted_and_ignored(foreach):
    torch.manual_seed(0)
    grads = [torch.randn(10), torch.randn(3, 3)]
    total, ours, expected, theirs = _clip_both(grads, 0.2, foreach=foreach)
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=0)


@pytest.mark.parametrize("max_norm", [1e-3, 1e9])
@pytest.mark.parametrize("error_if_nonfinite", [False, True])
def test_clip_bumps_every_grad_version_so_autograd_notices(max_norm, error_if_nonfinite):
    """Every gradient is written in place (torch always multiplies): its version counter
    advances, so a backward through a value saved before the clip raises."""
    torch.manual_seed(0)
    grads = [LAYOUTS[k]() for k in ("channels_last", "gap_strided", "zero_dim", "storage_offset")]
    params = [_holder(g) for g in grads]
    versions = [g._version for g in grads]
    w = torch.randn(grads[0].shape, requires_grad=True)
    y = (w * grads[0]).sum()  # saves grads[0] for the backward
    ts.clip_by_global_norm(params, max_norm, error_if_nonfinite=error_if_nonfinite)
    assert all(g._version > v for g, v in zip(grads, versions))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


# ---------------------------------------------------------------------------
# limits of the general-p norm
# ---------------------------------------------------------------------------


def test_general_p_norm_does_not_overflow_in_float64():
    g = torch.full((4,), 100.0)
    expected = 100.0 * 4 ** (1 / 200)
    assert math.isclose(float(ts.global_norm([g], 200)), expected, rel_tol=1e-6)
    p = _holder(g.clone())
    total = ts.clip_by_global_norm([p], 1.0, 200)
    assert math.isfinite(float(total))
    assert bool((p.grad != 0).all())


def test_general_p_norm_does_not_underflow_in_float64():
    g = torch.full((4,), 1e-3, dtype=torch.float64)
    expected = 1e-3 * 4 ** (1 / 120)
    assert math.isclose(float(ts.global_norm([g], 120)), expected, rel_tol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_grads_with_a_float64_grad_are_summed_as_documented(dtype):
    # docs/clipping.md: fp16/bf16 elements are accumulated in fp32 within blocks of 1024
    # elements, the blocks summed in float64: a relative error of order 1e-6 at worst
    g = torch.ones(1024, dtype=dtype)
    g[0] = 4096
    params = [_holder(g), _holder(torch.zeros(1, dtype=torch.float64))]
    total = ts.clip_by_global_norm(params, 1e9)
    assert total.dtype == torch.float64
    assert math.isclose(float(total), _brute_norm([g], 2), rel_tol=1e-5)


# ---------------------------------------------------------------------------
# optimizers
# ---------------------------------------------------------------------------

OPT_LAYOUTS = {
    "channels_last": lambda: torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
    "transposed": lambda: torch.randn(5, 4).t(),
    "larger_than_chunk": lambda: torch.randn(2 * 65536 + 37),
    "zero_dim": lambda: torch.tensor(1.5),
    "empty": lambda: torch.empty(0, 3),
    "odd_sizes": lambda: torch.randn(257),
}

SGD_CONFIGS = [
    dict(lr=0.1),
    dict(lr=0.1, momentum=0.9),
    dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    dict(lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.1, maximize=True),
]
ADAMW_CONFIGS = [
    dict(lr=0.01),
    dict(lr=0.01, amsgrad=True, weight_decay=0.1),
    dict(lr=0.01, betas=(0.3, 0.9), maximize=True),
]


def _train_both(make_params, ts_cls, th_cls, kw, steps=3, grad_fn=None, ts_kw=None,
                clip=None):
    """Run ts and torch (foreach=False; clip_grad_norm_ first when ``clip``) on strided
    copies of the same parameters with the same gradients; returns both lists and opts."""
    base = make_params()
    ours = [nn.Parameter(_clone_strided(t)) for t in base]
    theirs = [nn.Parameter(_clone_strided(t)) for t in base]
    a = ts_cls(ours, **kw, **(ts_kw or {}), **({} if clip is None else {"max_grad_norm": clip}))
    b = th_cls(theirs, **kw, foreach=False)
    for _ in range(steps):
        for p, q in zip(ours, theirs):
            g = torch.randn(p.shape, dtype=p.dtype) if grad_fn is None else grad_fn(p)
            p.grad = g
            q.grad = g.clone() if grad_fn is None or g.stride()[0] == 0 else _clone_strided(g)
        grads_before = [p.grad.clone() for p in ours]
        a.step()
        assert all(_bitwise(p.grad, g) for p, g in zip(ours, grads_before))  # never written
        if clip is not None:
            total = torch.nn.utils.clip_grad_norm_(theirs, clip)
            torch.testing.assert_close(a.last_grad_norm, total, rtol=1e-6, atol=0)
        b.step()
    return ours, theirs, a, b


@pytest.mark.parametrize("layout", sorted(OPT_LAYOUTS))
@pytest.mark.parametrize("cfg", range(len(SGD_CONFIGS)))
def test_sgd_layouts_bitwise_like_torch(layout, cfg):
    torch.manual_seed(0)
    ours, theirs, a, _ = _train_both(lambda: [OPT_LAYOUTS[layout](), torch.randn(7)],
                                     ts.optim.SGD, torch.optim.SGD, SGD_CONFIGS[cfg])
    for p, q in zip(ours, theirs):
        assert p.stride() == q.stride()
        assert _bitwise(p, q)
        if p in a.state and "momentum_buffer" in a.state[p]:
            assert a.state[p]["momentum_buffer"].shape == p.shape


@pytest.mark.parametrize("layout", sorted(OPT_LAYOUTS))
@pytest.mark.parametrize("cfg", range(len(ADAMW_CONFIGS)))
def test_adamw_layouts_close_to_torch(layout, cfg):
    torch.manual_seed(0)
    ours, theirs, a, b = _train_both(lambda: [OPT_LAYOUTS[layout](), torch.randn(7)],
                                     ts.optim.AdamW, torch.optim.AdamW, ADAMW_CONFIGS[cfg])
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if key in b.state[q]:
                torch.testing.assert_close(a.state[p][key], b.state[q][key], rtol=1e-6,
                                           atol=1e-10)
        assert float(a.state[p]["step"]) == 3.0


GRAD_SHAPES = {
    "expanded": lambda p: torch.randn(1, 4).expand(3, 4),
    "gap_strided": lambda p: torch.randn(3, 8)[:, ::2],
    "transposed_of_contiguous_param": lambda p: torch.randn(4, 3).t(),
}


@pytest.mark.parametrize("grad_kind", sorted(GRAD_SHAPES))
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_step_reads_odd_gradients_like_torch(grad_kind, opt):
    """Gradients are only read: expanded, gap-strided or differently laid out gradients
    step as torch steps them, and are left as they were."""
    torch.manual_seed(0)
    ts_cls, th_cls, kw = ((ts.optim.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9))
                          if opt == "sgd" else
                          (ts.optim.AdamW, torch.optim.AdamW, dict(lr=0.05)))
    # (torch's clip_grad_norm_ cannot scale an expanded gradient in place)
    ours, theirs, _, _ = _train_both(lambda: [torch.randn(3, 4)], ts_cls, th_cls, kw,
                                     grad_fn=GRAD_SHAPES[grad_kind],
                                     clip=None if grad_kind == "expanded" else 0.7)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_flat_buffers_with_masks_and_clip(opt):
    """Parameters are views into one flat buffer, gradients views into one flat gradient
    buffer (FSDP1 use_orig_params / Megatron contiguous buffers), with masks and
    max_grad_norm: the masked-in elements step as torch.optim after clip_grad_norm_, the
    masked-out ones and every byte between the parameters keep their bits, the gradient
    buffer is never written, views see the update and version counters advance."""
    torch.manual_seed(0)
    flat = torch.randn(500)
    gflat = torch.randn(500)
    specs = [((3, 4), None), ((2, 3, 2, 2), "cl"), ((10,), None), ((), None), ((0, 2), None)]
    ours, used, off = [], torch.zeros(500, dtype=torch.bool), 3
    for shape, kind in specs:
        n = math.prod(shape)
        if kind == "cl":
            data = flat[off:off + n].view(2, 2, 2, 3).permute(0, 3, 1, 2)  # channels_last strides
            grad = gflat[off:off + n].view(2, 2, 2, 3).permute(0, 3, 1, 2)
        else:
            data, grad = flat[off:off + n].view(shape), gflat[off:off + n].view(shape)
        ours.append(_param(data, grad))
        used[off:off + n] = True
        off += n + 5
    theirs = [_param(_clone_strided(p.detach()), _clone_strided(p.grad)) for p in ours]
    masks = {p: torch.rand(p.shape) > 0.4 for p in ours}
    if opt == "sgd":
        kw = dict(lr=0.1, momentum=0.9, weight_decay=0.1)
        a = ts.optim.SGD(ours, masks=masks, max_grad_norm=0.5, **kw)
        b = torch.optim.SGD(theirs, foreach=False, **kw)
    else:
        kw = dict(lr=0.05, weight_decay=0.1, amsgrad=True)
        a = ts.optim.AdamW(ours, masks=masks, max_grad_norm=0.5, **kw)
        b = torch.optim.AdamW(theirs, foreach=False, **kw)
    flat_before, gflat_before = flat.clone(), gflat.clone()
    before = [p.detach().clone() for p in ours]
    watch = flat[3:15].view(3, 4)
    versions = [p._version for p in ours]

    a.step()
    total = torch.nn.utils.clip_grad_norm_(theirs, 0.5)
    b.step()

    torch.testing.assert_close(a.last_grad_norm, total, rtol=1e-6, atol=0)
    assert torch.equal(gflat, gflat_before)                  # gradients never written
    assert torch.equal(flat[~used], flat_before[~used])      # neighbours untouched
    assert torch.equal(watch, ours[0].detach())              # views see the update
    for p, q, old, v in zip(ours, theirs, before, versions):
        m = masks[p]
        assert torch.equal(p.detach()[~m], old[~m])
        torch.testing.assert_close(p.detach()[m], q.detach()[m], rtol=1e-6, atol=1e-7)
        if p.numel():
            assert p._version > v
        for key, value in a.state[p].items():
            if torch.is_tensor(value) and value.shape == p.shape:
                assert bool((value[~m] == 0).all()), key   # masked-out state untouched (zero)


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_masked_out_elements_keep_bits_with_nonfinite_grads(opt):
    p = _param(torch.randn(4, 70000))
    mask = torch.zeros(4, 70000, dtype=torch.bool)
    mask[1] = True
    g = torch.randn(4, 70000)
    g[0, :10] = float("nan")
    g[2, :10] = INF
    p.grad = g
    cls = ts.optim.SGD if opt == "sgd" else ts.optim.AdamW
    o = cls([p], lr=0.1, masks={p: mask}, **({"momentum": 0.9} if opt == "sgd" else {}))
    before = p.detach().clone()
    o.step()
    o.step()
    assert _bitwise(p.detach()[~mask], before[~mask])
    assert bool(torch.isfinite(p.detach()[mask]).all())


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_overlapping_params_in_one_group_refused_nothing_changes(opt):
    buf = torch.randn(20)
    p1, p2, p3 = _param(buf[0:10]), _param(buf[5:15]), _param(torch.randn(3))
    for p in (p1, p2, p3):
        p.grad = torch.randn(p.shape)
    cls = ts.optim.SGD if opt == "sgd" else ts.optim.AdamW
    o = cls([p3, p1, p2], lr=0.1, max_grad_norm=1.0)
    snap = _snapshot(o, [p3, p1, p2])
    version = buf._version
    with pytest.raises(RuntimeError, match="shares its memory"):
        o.step()
    assert _same_snapshot(snap, _snapshot(o, [p3, p1, p2]))
    assert buf._version == version and not o.state
    # the same memory seen through another dtype overlaps as well
    raw = torch.randn(8)
    pa, pc = _param(raw[0:4], torch.randn(4)), _param(raw[2:6].view(torch.bfloat16))
    pc.grad = torch.randn(8, dtype=torch.bfloat16)
    o = cls([pa, pc], lr=0.1)
    snap = _snapshot(o, [pa, pc])
    with pytest.raises(RuntimeError, match="shares its memory"):
        o.step()
    assert _same_snapshot(snap, _snapshot(o, [pa, pc]))


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_overlapping_params_in_two_groups_step_like_torch(opt):
    """Not refused across groups (torch steps the groups one after the other): the result is
    torch's, bitwise."""
    base = torch.randn(30)
    out = []
    for which in ("ts", "torch"):
        buf = base.clone()
        p1, p2 = _param(buf[0:20]), _param(buf[10:30])
        groups = [{"params": [p1]}, {"params": [p2], "lr": 0.05}]
        if opt == "sgd":
            o = (ts.optim.SGD(groups, lr=0.1, momentum=0.9) if which == "ts"
                 else torch.optim.SGD(groups, lr=0.1, momentum=0.9, foreach=False))
        else:
            o = (ts.optim.AdamW(groups, lr=0.1) if which == "ts"
                 else torch.optim.AdamW(groups, lr=0.1, foreach=False))
        torch.manual_seed(1)
        for _ in range(3):
            p1.grad, p2.grad = torch.randn(20), torch.randn(20)
            o.step()
        out.append(buf)
    if opt == "sgd":
        assert _bitwise(out[0], out[1])
    else:
        torch.testing.assert_close(out[0], out[1], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_same_param_twice_stepped_once(opt):
    p = _param(torch.randn(5), torch.ones(5))
    q = _param(p.detach().clone(), torch.ones(5))
    cls, ref = ((ts.optim.SGD, torch.optim.SGD) if opt == "sgd"
                else (ts.optim.AdamW, torch.optim.AdamW))
    with pytest.warns(UserWarning, match="duplicate"):
        o = cls([p, p], lr=0.1)
    o.step()
    ref([q], lr=0.1, foreach=False).step()
    torch.testing.assert_close(p, q, rtol=1e-6, atol=0)


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_sparse_grad_refused_nothing_changes(opt):
    emb = nn.Embedding(10, 3, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    w = _param(torch.randn(4), torch.randn(4))
    cls = ts.optim.SGD if opt == "sgd" else ts.optim.AdamW
    o = cls([w, emb.weight], lr=0.1, max_grad_norm=1.0)
    snap = _snapshot(o, [w, emb.weight])
    with pytest.raises(RuntimeError, match="sparse"):
        o.step()
    assert _same_snapshot(snap, _snapshot(o, [w, emb.weight]))


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_complex_param_refused_nothing_changes(opt):
    cls = ts.optim.SGD if opt == "sgd" else ts.optim.AdamW
    c = _param(torch.randn(3, dtype=torch.complex64))
    with pytest.raises(TypeError, match="complex"):
        cls([c], lr=0.1)
    # a parameter made complex after construction is refused at step()
    w, c = _param(torch.randn(3), torch.randn(3)), _param(torch.randn(3))
    o = cls([w, c], lr=0.1)
    c.data = torch.randn(3, dtype=torch.complex64)
    c.grad = torch.randn(3, dtype=torch.complex64)
    snap = _snapshot(o, [w, c])
    with pytest.raises(TypeError, match="complex64"):
        o.step()
    assert _same_snapshot(snap, _snapshot(o, [w, c]))


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_grad_of_another_dtype_refused_nothing_changes(opt):
    p, w = _param(torch.randn(4), torch.randn(4)), _param(torch.randn(2), torch.randn(2))
    p.grad.data = torch.randn(4, dtype=torch.float64)  # autograd's setter would refuse it
    cls = ts.optim.SGD if opt == "sgd" else ts.optim.AdamW
    o = cls([w, p], lr=0.1)
    snap = _snapshot(o, [w, p])
    with pytest.raises(RuntimeError, match="float64"):
        o.step()
    assert _same_snapshot(snap, _snapshot(o, [w, p]))


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_non_dense_param_refused_nothing_changes(opt):
    cls = ts.optim.SGD if opt == "sgd" else ts.optim.AdamW
    w = _param(torch.randn(3), torch.randn(3))
    gap = _param(torch.randn(4, 8)[:, ::2], torch.randn(4, 4))
    o = cls([w, gap], lr=0.1)
    snap = _snapshot(o, [w, gap])
    with pytest.raises(RuntimeError, match="not dense"):
        o.step()
    assert _same_snapshot(snap, _snapshot(o, [w, gap]))


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_frozen_with_grad_and_none_grads_skipped(opt):
    cls = ts.optim.SGD if opt == "sgd" else ts.optim.AdamW
    frozen = _param(torch.randn(3), torch.randn(3), requires_grad=False)
    nograd = _param(torch.randn(2))
    live = _param(torch.randn(4), torch.randn(4))
    o = cls([frozen, nograd, live], lr=0.1, weight_decay=0.5, max_grad_norm=1e-3)
    f0, n0 = frozen.detach().clone(), nograd.detach().clone()
    o.step()
    assert _bitwise(frozen.detach(), f0) and _bitwise(nograd.detach(), n0)
    assert frozen not in o.state and nograd not in o.state
    assert (live in o.state) == (opt == "adamw")  # SGD without momentum keeps no state
    # the norm is that of the stepped gradients only
    assert math.isclose(float(o.last_grad_norm), _brute_norm([live.grad], 2), rel_tol=1e-6)


def test_mixed_dtypes_in_one_group_with_clip():
    torch.manual_seed(0)
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
    ours = [_param(torch.randn(50).to(d)) for d in dtypes]
    theirs = [_param(p.detach().clone()) for p in ours]
    a = ts.optim.SGD(ours, lr=0.1, momentum=0.9, max_grad_norm=0.5, norm_type=3.5)
    b = torch.optim.SGD(theirs, lr=0.1, momentum=0.9, foreach=False)
    for _ in range(3):
        grads = [torch.randn(50).to(d) * 3 for d in dtypes]
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        a.step()
        torch.nn.utils.clip_grad_norm_(theirs, 0.5, 3.5)
        b.step()
        assert a.last_grad_norm.dtype == torch.float64
        assert math.isclose(float(a.last_grad_norm), _brute_norm(grads, 3.5), rel_tol=1e-12)
    # float32 / float64 follow torch closely (torch's fp16/bf16 per-tensor norms are rounded)
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-3, atol=1e-4)
    for p, q in zip(ours[2:], theirs[2:]):
        torch.testing.assert_close(p.float(), q.float(), rtol=0.02, atol=0.02)


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("max_norm", [0.0, 1e300])
def test_extreme_max_grad_norm_like_torch(opt, max_norm):
    torch.manual_seed(0)
    ts_cls, th_cls, kw = ((ts.optim.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9))
                          if opt == "sgd" else
                          (ts.optim.AdamW, torch.optim.AdamW, dict(lr=0.05)))
    ours, theirs, _, _ = _train_both(lambda: [torch.randn(3, 4), torch.randn(5)], ts_cls,
                                     th_cls, kw, clip=max_norm)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_foreach_fused_and_bad_norm_type_refused(opt):
    cls = ts.optim.SGD if opt == "sgd" else ts.optim.AdamW
    p = _param(torch.randn(3))
    for flag in ("foreach", "fused"):
        for value in (True, False):
            with pytest.raises(TypeError, match=flag):
                cls([p], lr=0.1, **{flag: value})
    for bad in (0, -1.0, -INF, float("nan"), "fro"):
        with pytest.raises(ValueError, match="norm_type"):
            cls([p], lr=0.1, max_grad_norm=1.0, norm_type=bad)


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("norm_type", [1, 3.5, INF])
def test_max_grad_norm_norm_types_like_torch(opt, norm_type):
    torch.manual_seed(0)
    ts_cls, th_cls, kw = ((ts.optim.SGD, torch.optim.SGD, dict(lr=0.1))
                          if opt == "sgd" else
                          (ts.optim.AdamW, torch.optim.AdamW, dict(lr=0.05)))
    base = [torch.randn(3, 4), torch.randn(2, 3, 2, 2).to(memory_format=torch.channels_last)]
    ours = [nn.Parameter(_clone_strided(t)) for t in base]
    theirs = [nn.Parameter(_clone_strided(t)) for t in base]
    a = ts_cls(ours, max_grad_norm=0.3, norm_type=norm_type, **kw)
    b = th_cls(theirs, foreach=False, **kw)
    for _ in range(2):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape)
            q.grad = p.grad.clone()
        a.step()
        total = torch.nn.utils.clip_grad_norm_(theirs, 0.3, norm_type)
        b.step()
        torch.testing.assert_close(a.last_grad_norm, total, rtol=1e-6, atol=0)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("kind", ["plain", "flat_view", "channels_last"])
def test_step_bumps_versions_so_autograd_notices(opt, kind):
    flat = torch.randn(40)
    if kind == "plain":
        w = _param(torch.randn(3, 4))
    elif kind == "flat_view":
        w = _param(flat[5:17].view(3, 4))
    else:
        w = _param(torch.randn(2, 3, 2, 2).to(memory_format=torch.channels_last))
    y = (w * w).sum()  # saves w
    w.grad = torch.randn(w.shape)
    cls = ts.optim.SGD if opt == "sgd" else ts.optim.AdamW
    o = cls([w], lr=0.1, **({"momentum": 0.9} if opt == "sgd" else {}))
    grad_version = w.grad._version
    v = w._version
    o.step()
    assert w._version > v
    assert w.grad._version == grad_version  # gradients are only read
    state_versions = {k: t._version for k, t in o.state[w].items() if torch.is_tensor(t)}
    o.step()
    for k, t in o.state[w].items():
        if torch.is_tensor(t):
            assert t._version > state_versions[k], k
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_many_tiny_params_like_torch():
    torch.manual_seed(0)
    ours = [_param(torch.randn(1 + i % 3)) for i in range(2000)]
    theirs = [_param(p.detach().clone()) for p in ours]
    a = ts.optim.SGD(ours, lr=0.1, momentum=0.9, max_grad_norm=1.0)
    b = torch.optim.SGD(theirs, lr=0.1, momentum=0.9, foreach=False)
    for _ in range(2):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape)
            q.grad = p.grad.clone()
        a.step()
        total = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
        b.step()
        torch.testing.assert_close(a.last_grad_norm, total, rtol=1e-6, atol=0)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_refusal_in_last_group_undoes_state_of_first(opt):
    cls = ts.optim.SGD if opt == "sgd" else ts.optim.AdamW
    a, b = _param(torch.randn(4)), _param(torch.randn(3))
    kw = {"momentum": 0.9} if opt == "sgd" else {}
    o = cls([{"params": [a]}, {"params": [b]}], lr=0.1, max_grad_norm=1.0, **kw)
    a.grad, b.grad = torch.randn(4), torch.randn(3)
    o.step()
    c = _param(torch.randn(5))
    o.add_param_group({"params": [c]})
    b.data = torch.randn(6)  # its state no longer fits
    a.grad, b.grad, c.grad = torch.randn(4), torch.randn(6), torch.randn(5)
    snap = _snapshot(o, [a, b, c])
    with pytest.raises(RuntimeError, match="shape"):
        o.step()
    assert _same_snapshot(snap, _snapshot(o, [a, b, c]))
    assert c not in o.state


# ---------------------------------------------------------------------------
# DDP gradient bucket views
# ---------------------------------------------------------------------------


@pytest.fixture
def gloo_group():
    import torch.distributed as dist
    fd, path = tempfile.mkstemp(prefix="ts_audit_pg_")
    os.close(fd)
    os.unlink(path)
    dist.init_process_group("gloo", rank=0, world_size=1, init_method="file://" + path)
    try:
        yield
    finally:
        dist.destroy_process_group()
        if os.path.exists(path):
            os.unlink(path)


def _convnet():
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))


@needs_gloo
@pytest.mark.parametrize("static_graph", [False, True])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_ddp_bucket_view_grads_step_and_clip_like_torch(gloo_group, static_graph, opt):
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    net = _convnet()
    ref = copy.deepcopy(net)
    kw = dict(gradient_as_bucket_view=True, static_graph=static_graph, bucket_cap_mb=0.001)
    ddp, ddp_ref = DDP(net, **kw), DDP(ref, **kw)
    if opt == "sgd":
        a = ts.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9, max_grad_norm=0.5)
        b = torch.optim.SGD(ddp_ref.parameters(), lr=0.1, momentum=0.9, foreach=False)
    else:
        a = ts.optim.AdamW(ddp.parameters(), lr=0.01, max_grad_norm=0.5)
        b = torch.optim.AdamW(ddp_ref.parameters(), lr=0.01, foreach=False)
    for step in range(3):
        x = torch.randn(2, 3, 8, 8)
        for model, o in ((ddp, a), (ddp_ref, b)):
            o.zero_grad(set_to_none=False)
            model(x).pow(2).sum().backward()
        grads = [p.grad for p in net.parameters()]
        assert all(g._base is not None for g in grads)  # views into the buckets
        before = [g.clone() for g in grads]
        a.step()
        assert all(_bitwise(g, c) for g, c in zip(grads, before))  # only read
        total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        b.step()
        torch.testing.assert_close(a.last_grad_norm, total, rtol=1e-6, atol=0)
        for p, q in zip(net.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    # ts.clip_by_global_norm on the bucket views
    x = torch.randn(2, 3, 8, 8)
    for model, o in ((ddp, a), (ddp_ref, b)):
        o.zero_grad(set_to_none=False)  # (torch's were clipped in place above, ours not)
        model(x).pow(2).sum().backward()
    buckets = {g._base.data_ptr(): g._base for g in (p.grad for p in net.parameters())}
    versions = [p.grad._version for p in net.parameters()]
    t1 = ts.clip_by_global_norm(ddp.parameters(), 0.1)
    t2 = torch.nn.utils.clip_grad_norm_(ddp_ref.parameters(), 0.1)
    torch.testing.assert_close(t1, t2, rtol=1e-5, atol=0)  # (parameters agree to ~1e-6)
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-8)
        assert p.grad._base.data_ptr() in buckets  # still the bucket views
    assert all(p.grad._version > v for p, v in zip(net.parameters(), versions))


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_grad_scaler_flat_view_params_like_torch_and_skip_changes_nothing(opt):
    """GradScaler + max_grad_norm on parameters that are views into one flat buffer: like
    torch's unscale_ + clip_grad_norm_ + step; an overflowed step leaves the buffer bitwise
    unchanged."""
    torch.manual_seed(0)
    flat = torch.randn(100)
    w, b = _param(flat[2:14].view(3, 4)), _param(flat[20:23])
    rw, rb = _param(w.detach().clone()), _param(b.detach().clone())
    if opt == "sgd":
        o = ts.optim.SGD([w, b], lr=0.1, momentum=0.9, max_grad_norm=1.0)
        r = torch.optim.SGD([rw, rb], lr=0.1, momentum=0.9, foreach=False)
    else:
        o = ts.optim.AdamW([w, b], lr=0.01, max_grad_norm=1.0)
        r = torch.optim.AdamW([rw, rb], lr=0.01, foreach=False)
    sa = torch.amp.GradScaler("cpu", init_scale=1024.0)
    sb = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x = torch.randn(5, 4)
    for step in range(3):
        o.zero_grad()
        r.zero_grad()
        sa.scale(((x @ w.t()).sum(1) + b.sum()).pow(2).mean()).backward()
        sb.scale(((x @ rw.t()).sum(1) + rb.sum()).pow(2).mean()).backward()
        if step == 1:
            w.grad[0, 0] = INF
            rw.grad[0, 0] = INF
        before = flat.clone()
        sa.step(o)
        sa.update()
        sb.unscale_(r)
        torch.nn.utils.clip_grad_norm_([rw, rb], 1.0)
        sb.step(r)
        sb.update()
        if step == 1:
            assert _bitwise(flat, before)
        assert sa.get_scale() == sb.get_scale()
        torch.testing.assert_close(w, rw, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(b, rb, rtol=1e-6, atol=1e-7)
