"""ts.clip_by_global_norm against torch.nn.utils.clip_grad_norm_, and the ops behind it."""
import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils import clip_grad_norm_

import torchstruct as ts
from torchstruct import _ops, _reference

INF = float("inf")
NORM_TYPES = [1.0, 2.0, 3.0, INF, 0.5]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
# relative tolerance of the returned norm and of the clipped grads, by dtype: torch
# rounds fp16/bf16 per-tensor norms and the coefficient to the grad dtype, torchstruct
# accumulates and computes the coefficient in fp32 (a difference of about one ulp).
RTOL = {torch.float32: 2e-5, torch.float64: 1e-7, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

requires_compiled = pytest.mark.skipif(
    not _ops.compiled_available(), reason="torchstruct._C is not built"
)


def make_param(shape, dtype=torch.float32, device="cpu", seed=0, grad="dense", scale=1.0):
    """A parameter with a random .grad: grad is 'dense', 'none', 'transposed' or 'strided'
    (a view with gaps, not a dense span)."""
    g = torch.Generator().manual_seed(seed)
    p = nn.Parameter(torch.zeros(shape, dtype=dtype, device=device))
    if grad == "none":
        return p
    if grad == "transposed" and len(shape) >= 2:
        full = torch.randn(tuple(reversed(shape)), generator=g, dtype=torch.float64) * scale
        p.grad = full.to(dtype=dtype, device=device).transpose(0, -1)
    elif grad == "strided" and len(shape) >= 1:
        full = torch.randn((*shape[:-1], 2 * shape[-1]), generator=g, dtype=torch.float64) * scale
        p.grad = full.to(dtype=dtype, device=device)[..., ::2]
    else:
        p.grad = (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype=dtype, device=device)
    return p


def same_layout_copy(g):
    """A copy of g with g's memory layout (contiguous, transposed or strided with gaps)."""
    if g.is_contiguous():
        return g.clone()
    if g.dim() >= 2 and g.transpose(0, -1).is_contiguous():
        return g.transpose(0, -1).clone().transpose(0, -1)
    base = torch.empty((*g.shape[:-1], 2 * g.shape[-1]), dtype=g.dtype, device=g.device)
    out = base[..., ::2]
    out.copy_(g)
    return out


def twin(params):
    """Independent copies of the parameters, grads copied with the same layout."""
    if isinstance(params, torch.Tensor):
        return twin([params])[0]
    made = {}  # the same parameter listed twice has one twin
    for p in params:
        if id(p) not in made:
            q = nn.Parameter(p.detach().clone())
            if p.grad is not None:
                q.grad = same_layout_copy(p.grad)
            made[id(p)] = q
    return [made[id(p)] for p in params]


def snapshot(params):
    return [None if p.grad is None else p.grad.clone() for p in params]


def assert_bitwise_unchanged(params, before):
    for p, b in zip(params, before):
        if b is None:
            assert p.grad is None
        else:
            assert torch.equal(p.grad.isnan(), b.isnan())
            assert torch.equal(p.grad.nan_to_num(), b.nan_to_num())


def loosest(dtypes):
    return max((RTOL[d] for d in dtypes), default=1e-5)


def assert_like_torch(params, max_norm, p, error_if_nonfinite=False, rtol=None):
    """Clip twins with torch and torchstruct; same norm (dtype, device, value) and grads."""
    ours = twin(params)
    if isinstance(params, torch.Tensor):
        params = [params]
    before = [None if q.grad is None else q.grad.clone() for q in params]
    # torch refuses the inf-norm of an empty grad (no identity); here it contributes nothing
    for_torch = [q for q in params if p != INF or q.grad is None or q.grad.numel() > 0]
    expected = clip_grad_norm_(for_torch, max_norm, p, error_if_nonfinite)
    got = ts.clip_by_global_norm(ours, max_norm, p, error_if_nonfinite)
    dtypes = {q.grad.dtype for q in ours if q.grad is not None}
    tol = rtol if rtol is not None else loosest(dtypes) * (4 if p == 0.5 else 1)
    if len(for_torch) == len(params):
        assert got.dtype == expected.dtype
    else:  # torch's dtype with the empty grads it refused
        assert got.dtype == _reference.clip_result_dtype([q.grad for q in ours if q.grad is not None])
    assert got.device == expected.device
    assert got.shape == ()
    torch.testing.assert_close(got.double(), expected.double(), rtol=tol, atol=0.0, equal_nan=True)
    for i, (a, b) in enumerate(zip(params, ours)):
        if a.grad is None:
            assert b.grad is None
            continue
        scale = float(a.grad.double().nan_to_num(0.0, 0.0, 0.0).abs().max()) if a.grad.numel() else 0.0
        # torch's coefficient carries the rounding of the narrowest dtype in the set
        gtol = 2 * max(RTOL[a.grad.dtype], tol)
        # one ulp of the grad's dtype is allowed (documented), and in the subnormal range one
        # ulp is the dtype's smallest step, however large relative to the value
        tiny = torch.finfo(a.grad.dtype).smallest_normal * torch.finfo(a.grad.dtype).eps
        want = a.grad
        if _inexact_torch_coefficient(expected, max_norm):
            # torch computes its coefficient in the norm's dtype, where it is subnormal here (off
            # by up to several percent) or 0 (its fp16 norm overflowed; documented): the
            # float64 clip is the oracle then
            want = (before[i].double() * _exact_coefficient(before, max_norm, p)
                    ).to(a.grad.dtype)
        torch.testing.assert_close(b.grad, want, rtol=gtol,
                                   atol=max(gtol * max(scale, 1e-30), tiny), equal_nan=True)
    return got


def _inexact_torch_coefficient(total_norm, max_norm) -> bool:
    coef = max_norm / (total_norm + 1e-6)
    return bool(coef < torch.finfo(total_norm.dtype).smallest_normal)


def _exact_coefficient(grads, max_norm, p) -> float:
    flat = torch.cat([g.double().reshape(-1) for g in grads if g is not None])
    if p == INF:
        norm = float(flat.abs().max()) if flat.numel() else 0.0
    else:
        norm = float(flat.abs().pow(p).sum() ** (1 / p))
    return min(1.0, max_norm / (norm + 1e-6))


# --------------------------------------------------------------------------- against torch


@pytest.mark.parametrize("p", NORM_TYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("max_norm", [0.0, 0.1, 1e6])
def test_matches_torch(backend, p, dtype, max_norm):
    params = [make_param(s, dtype, seed=i) for i, s in enumerate([(3, 4), (17,), (), (0,), (5, 1, 2)])]
    assert_like_torch(params, max_norm, p)


@pytest.mark.parametrize("p", NORM_TYPES)
def test_mixed_dtypes_none_grads_noncontiguous(backend, p):
    params = [
        make_param((4, 6), torch.float32, seed=1, grad="transposed"),
        make_param((5,), torch.float16, seed=2),
        make_param((3,), torch.float32, grad="none"),
        make_param((2, 8), torch.bfloat16, seed=3, grad="strided"),
        make_param((7, 3), torch.float64, seed=4, grad="strided"),
        make_param((70_000,), torch.float32, seed=5),  # several chunks
    ]
    assert_like_torch(params, 0.5, p)


@pytest.mark.parametrize("dtypes, expected", [
    ([torch.float16], torch.float16),
    ([torch.bfloat16], torch.bfloat16),
    ([torch.float16, torch.bfloat16], torch.float32),
    ([torch.bfloat16, torch.float32], torch.float32),
    ([torch.float16, torch.float64], torch.float64),
])
def test_returned_dtype_is_torchs(backend, dtypes, expected):
    params = [make_param((10,), d, seed=i) for i, d in enumerate(dtypes)]
    assert assert_like_torch(params, 1.0, 2.0).dtype == expected


def test_many_tensors_and_no_clip_needed(backend):
    params = [make_param((100,), seed=i) for i in range(300)]
    assert_like_torch(params, 1e9, 2.0)  # coefficient exactly 1
    assert_like_torch(params, 1.0, 2.0)


def test_single_tensor_generator_empty(backend):
    a, b = make_param((3, 3), seed=7), make_param((3, 3), seed=7)
    torch.testing.assert_close(ts.clip_by_global_norm(b, 0.1), clip_grad_norm_(a, 0.1))
    torch.testing.assert_close(b.grad, a.grad)
    # a generator is consumed once
    params = [make_param((4,), seed=i) for i in range(3)]
    ours = twin(params)
    torch.testing.assert_close(ts.clip_by_global_norm((q for q in ours), 1.0), clip_grad_norm_(params, 1.0))
    # nothing to clip
    assert ts.clip_by_global_norm([], 1.0).item() == 0.0
    assert ts.clip_by_global_norm([make_param((2,), grad="none")], 1.0).item() == 0.0
    with pytest.warns(UserWarning, match="empty generator"):
        ts.clip_by_global_norm((q for q in []), 1.0)
    # foreach is accepted and ignored
    ts.clip_by_global_norm(ours, 1.0, foreach=True)
    ts.clip_by_global_norm(ours, 1.0, foreach=False)


def test_duplicates_taken_as_given(backend):
    """A parameter listed twice counts twice in the norm and is scaled twice, as in torch."""
    w, v = make_param((5,), seed=1), make_param((3,), seed=2)
    assert_like_torch([w, v, w], 0.1, 2.0)
    assert_like_torch([w, w], 0.1, INF)


# --------------------------------------------------------------------------- property


_param = st.tuples(
    st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple),
    st.sampled_from(["dense", "dense", "none", "transposed", "strided"]),
    st.integers(0, 2**16),
)


@settings(max_examples=80, deadline=None)
@given(
    entries=st.lists(_param, min_size=0, max_size=10),
    dtype=st.sampled_from(DTYPES + ["mixed"]),
    p=st.sampled_from(NORM_TYPES),
    max_norm=st.sampled_from([0.0, 1e-3, 0.5, 3.0, 1e4]),
    scale=st.sampled_from([1e-2, 1.0, 10.0]),
    use_compiled=st.booleans(),
    data=st.data(),
)
def test_property_random_parameter_lists(entries, dtype, p, max_norm, scale, use_compiled, data):
    params = []
    for shape, grad, seed in entries:
        d = data.draw(st.sampled_from(DTYPES)) if dtype == "mixed" else dtype
        params.append(make_param(shape, d, seed=seed, grad=grad, scale=scale))
    name = "compiled" if use_compiled and _ops.compiled_available() else "reference"
    with _ops.use_backend(name):
        assert_like_torch(params, max_norm, p)


# --------------------------------------------------------------------------- non-finite


@pytest.mark.parametrize("bad", [float("nan"), INF])
@pytest.mark.parametrize("p", [2.0, INF, 1.0])
def test_nonfinite_without_error_like_torch(backend, bad, p):
    params = [make_param((4, 4), seed=1), make_param((6,), seed=2)]
    params[1].grad[3] = bad
    got = assert_like_torch(params, 1.0, p)
    assert not math.isfinite(got.item())


@pytest.mark.parametrize("bad", [float("nan"), INF])
def test_nonfinite_with_error_raises_and_leaves_grads(backend, bad):
    params = [make_param((4, 4), seed=1), make_param((6,), seed=2)]
    params[1].grad[3] = bad
    ours = twin(params)
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
    before = snapshot(ours)
    with pytest.raises(RuntimeError, match="non-finite"):
        ts.clip_by_global_norm(ours, 1.0, error_if_nonfinite=True)
    assert_bitwise_unchanged(ours, before)


def test_error_if_nonfinite_finite_clips(backend):
    params = [make_param((4, 4), seed=1), make_param((6,), torch.float64, seed=2)]
    assert_like_torch(params, 0.3, 2.0, error_if_nonfinite=True)


# --------------------------------------------------------------------------- models and trees


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4)
        self.frozen = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.head(self.frozen(self.body(self.embed(x))))


def test_model_trainable_only_tied_once(backend):
    torch.manual_seed(0)
    a = Tied()
    b = Tied()
    b.load_state_dict(a.state_dict())
    b.head.weight = b.embed.weight
    for m in (a, b):
        m(torch.tensor([1, 2, 3])).sum().backward()
        m.frozen.weight.grad = torch.ones(4, 4)  # a stale grad on a frozen parameter
    unique = list({id(p): p for p in a.parameters() if p.requires_grad}.values())
    frozen_before = b.frozen.weight.grad.clone()
    expected = clip_grad_norm_(unique, 0.01)
    got = ts.clip_by_global_norm(b, 0.01)
    torch.testing.assert_close(got, expected)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        if p.grad is not None and p.requires_grad:
            torch.testing.assert_close(q.grad, p.grad, msg=name)
    assert torch.equal(b.frozen.weight.grad, frozen_before)


def test_model_with_frozen_subtree(backend):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    m(torch.randn(2, 3)).sum().backward()
    first = [p.grad.clone() for p in m[0].parameters()]
    expected = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in m[1].parameters()]))
    with ts.freeze(m, "0"):
        n = ts.clip_by_global_norm(m, 1e-3)
    torch.testing.assert_close(n, expected)
    torch.testing.assert_close(
        torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in m[1].parameters()])),
        torch.tensor(1e-3), rtol=1e-4, atol=0.0)
    assert all(torch.equal(p.grad, f) for p, f in zip(m[0].parameters(), first))


def test_tree_from_structural_grad(backend):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(5, 3)
    tree = ts.structural_grad(m, lambda mod: mod(x).pow(2).sum())
    leaves = ts.tree.leaves(tree)
    expected_leaves = [t.clone() for t in leaves]
    expected = clip_grad_norm_([_as_param(t) for t in expected_leaves], 0.05)
    got = ts.clip_by_global_norm(tree, 0.05)
    torch.testing.assert_close(got, expected)
    for t, e in zip(ts.tree.leaves(tree), expected_leaves):
        torch.testing.assert_close(t, e)


def _as_param(t):
    """A holder whose .grad is t itself (clip_grad_norm_ scales it in place)."""
    p = nn.Parameter(torch.zeros_like(t))
    p.grad = t
    return p


def test_tree_shared_leaf_once(backend):
    t = torch.tensor([3.0, 4.0])
    tree = {"a": t, "b": {"c": t, "d": None}}
    assert ts.clip_by_global_norm(tree, 1.0).item() == pytest.approx(5.0)
    torch.testing.assert_close(t, torch.tensor([0.6, 0.8]), rtol=1e-5, atol=0.0)


# --------------------------------------------------------------------------- bad input


def _bad_cases():
    def neg():
        return [make_param((3,), seed=1), make_param((2,), seed=2)], dict(max_norm=-1.0), ValueError, "max_norm"

    def nan_max():
        return [make_param((3,), seed=1)], dict(max_norm=float("nan")), ValueError, "max_norm"

    def sparse():
        dense = make_param((3, 3), seed=1)
        s = nn.Parameter(torch.zeros(3, 3))
        s.grad = torch.eye(3).to_sparse()
        return [dense, s], dict(max_norm=0.1), TypeError, "sparse"

    def int_grad():
        w = make_param((3,), seed=1)
        w.grad = torch.ones(3)
        x = torch.zeros(2, dtype=torch.int64)
        x.grad = torch.ones(2, dtype=torch.int64)
        return [w, x], dict(max_norm=0.1), TypeError, "dtype"

    def not_a_tensor():
        return [make_param((3,), seed=1), 3.0], dict(max_norm=0.1), TypeError, r"parameters\[1\]"

    def bad_norm_type():
        return [make_param((3,), seed=1)], dict(max_norm=0.1, norm_type=-2.0), ValueError, "norm_type"

    def expanded():
        w, e = make_param((3,), seed=1), nn.Parameter(torch.zeros(4, 3))
        e.grad = torch.ones(3).expand(4, 3)
        return [w, e], dict(max_norm=0.1), RuntimeError, "share memory"

    return [neg, nan_max, sparse, int_grad, not_a_tensor, bad_norm_type, expanded]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda f: f.__name__)
def test_bad_input_raises_and_changes_nothing(backend, case):
    params, kwargs, exc, match = case()
    before = [None if not isinstance(p, torch.Tensor) or p.grad is None else p.grad.clone()
              for p in params]
    with pytest.raises(exc, match=match):
        ts.clip_by_global_norm(params, **kwargs)
    for p, b in zip(params, before):
        if b is not None:
            if b.is_sparse:
                assert torch.equal(p.grad.to_dense(), b.to_dense())
            else:
                assert torch.equal(p.grad, b)


@pytest.mark.parametrize("bad", ["weights", 3, None])
def test_wrong_params_type(backend, bad):
    with pytest.raises(TypeError, match="clip_by_global_norm"):
        ts.clip_by_global_norm(bad, 1.0)


# --------------------------------------------------------------------------- the ops


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_op_matches_mul(backend, dtype):
    tensors = [make_param(s, dtype, seed=i).grad for i, s in enumerate([(3, 4), (70_000,), (0,)])]
    tensors.append(make_param((4, 6), dtype, seed=9, grad="transposed").grad)
    tensors.append(make_param((4, 6), dtype, seed=9, grad="strided").grad)
    for s in [0.37, 1.0, 0.0, float("nan")]:
        expected = [t.clone().mul_(torch.tensor(s)) for t in tensors]
        work = [same_layout_copy(t) for t in tensors]
        _ops.scale_(work, torch.tensor(s))
        for w, e in zip(work, expected):
            torch.testing.assert_close(w, e, rtol=0.0, atol=0.0, equal_nan=True)


def test_scale_op_duplicates_twice_and_checks(backend):
    t = torch.tensor([1.0, 2.0])
    _ops.scale_([t, t], torch.tensor(0.5))
    torch.testing.assert_close(t, torch.tensor([0.25, 0.5]))
    with pytest.raises(ValueError, match="0-dim"):
        _ops.scale_([t], torch.tensor([0.5, 0.5]))
    with pytest.raises(TypeError, match="sparse"):
        _ops.scale_([t, torch.eye(2).to_sparse()], torch.tensor(0.5))
    torch.testing.assert_close(t, torch.tensor([0.25, 0.5]))


def test_clip_op_matches_reference(backend):
    for p in NORM_TYPES:
        grads = [make_param(s, d, seed=i).grad for i, (s, d) in
                 enumerate([((30,), torch.float32), ((5, 7), torch.float16), ((9,), torch.float64)])]
        ref = [g.clone() for g in grads]
        got = _ops.clip_by_global_norm_(grads, 0.1, p)
        exp = _reference.clip_by_global_norm_(ref, 0.1, p)
        assert got.dtype == exp.dtype == torch.float64
        torch.testing.assert_close(got, exp, rtol=1e-6, atol=0.0)
        for g, r in zip(grads, ref):
            torch.testing.assert_close(g, r, rtol=RTOL[g.dtype], atol=0.0)


@requires_compiled
def test_compiled_op_direct_and_refusals():
    g = [torch.tensor([3.0, 4.0]), torch.zeros(0)]
    n = torch.ops.torchstruct.clip_by_global_norm_(g, 1.0, 2.0)
    assert n.item() == 5.0
    torch.testing.assert_close(g[0], torch.tensor([0.6, 0.8]), rtol=1e-6, atol=0.0)
    keep = g[0].clone()
    with pytest.raises(ValueError, match="max_norm"):
        torch.ops.torchstruct.clip_by_global_norm_(g, -1.0, 2.0)
    with pytest.raises(TypeError, match="dtype"):
        torch.ops.torchstruct.clip_by_global_norm_([g[0], torch.ones(2, dtype=torch.int32)], 0.1, 2.0)
    with pytest.raises(RuntimeError, match="one device"):
        torch.ops.torchstruct.scale_([g[0], torch.ones(3, device="meta")], torch.tensor(0.5))
    assert torch.equal(g[0], keep)


@requires_compiled
def test_fake_kernels():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a, b = torch.empty(5, 3, dtype=torch.float16), torch.empty(2, dtype=torch.bfloat16)
        out = torch.ops.torchstruct.clip_by_global_norm_([a, b], 1.0, 2.0)
        assert out.shape == () and out.dtype == torch.float32
        assert torch.ops.torchstruct.clip_by_global_norm_([a], 1.0, 2.0).dtype == torch.float16
        torch.ops.torchstruct.scale_([a, b], torch.tensor(0.5))


def test_meta_tensors_run_shapes_only(backend):
    g = [torch.empty(3, device="meta"), torch.empty(2, 2, device="meta")]
    out = _ops.clip_by_global_norm_(g, 1.0, 2.0)
    assert out.device.type == "meta" and out.dtype == torch.float32


@requires_compiled
def test_device_without_kernel_falls_back(monkeypatch):
    """A device type the compiled op has no kernel for (simulated here for cpu): PyTorch's
    multi-tensor ops give the compiled result, with one warning per device that says how
    to build the kernels."""
    monkeypatch.setitem(_ops._KERNELS, "clip_by_global_norm_", frozenset())
    monkeypatch.setitem(_ops._KERNELS, "global_norm", frozenset())
    monkeypatch.setitem(_ops._KERNELS, "scale_", frozenset())
    monkeypatch.setattr(_ops, "_warned", set())
    w, expected = make_param((4,), seed=1), make_param((4,), seed=1)
    with _ops.use_backend("compiled"):
        want = torch.nn.utils.clip_grad_norm_([expected], 0.01)
        with pytest.warns(RuntimeWarning, match=r"no compiled kernels for cpu.*pip install"):
            got = ts.clip_by_global_norm([w], 0.01)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(w.grad, expected.grad)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per process and device
            ts.clip_by_global_norm([w], 0.01, error_if_nonfinite=True)


def test_fp16_norm_overflow_documented(backend):
    """fp16 grads whose norm exceeds the fp16 range: torch (fp16 norms) returns inf and
    scales by 0; the returned norm here is inf too (fp16 dtype), but the coefficient
    comes from the fp32 norm, so the grads are clipped, not zeroed."""
    w = make_param((4,), torch.float16)
    w.grad = torch.full((4,), 60000.0, dtype=torch.float16)
    n = ts.clip_by_global_norm([w], 1.0)
    assert n.dtype == torch.float16 and math.isinf(n.item())
    torch.testing.assert_close(w.grad.float().norm(), torch.tensor(1.0), rtol=2e-3, atol=0.0)
    w.grad = torch.full((4,), 60000.0, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="non-finite"):
        ts.clip_by_global_norm([w], 1.0, error_if_nonfinite=True)


def test_fp16_norm_overflow_is_clipped_once_through_every_entry_point(backend):
    """The same case through a module and a tuple (the C++ entry point that reads .grad): the
    gradients are scaled once to norm 1, never a second time through a retry."""
    for wrap in (lambda w: (w,), lambda w: [w], lambda w: nn.ModuleList([_holder(w)])):
        w = make_param((4,), torch.float16)
        w.grad = torch.full((4,), 60000.0, dtype=torch.float16)
        version = w.grad._version
        n = ts.clip_by_global_norm(wrap(w), 1.0)
        assert math.isinf(n.item())
        torch.testing.assert_close(w.grad, torch.full((4,), 0.5, dtype=torch.float16))
        assert w.grad._version == version + 1  # written once


def _holder(w):
    m = nn.Module()
    m.w = w
    return m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_norm_beyond_the_dtype_range_is_inf_as_torch_returns_it(backend, dtype):
    """fp32 (or bf16) gradients whose norm exceeds the dtype's largest value: torch returns inf
    and scales every gradient by 0; so does every backend, with the norm in the same dtype."""
    big = 3e38
    w, ref = make_param((2,), dtype), make_param((2,), dtype)
    w.grad = torch.full((2,), big, dtype=dtype)
    ref.grad = w.grad.clone()
    want = torch.nn.utils.clip_grad_norm_([ref], 1.0, foreach=False)
    got = ts.clip_by_global_norm([w], 1.0)
    assert got.dtype == want.dtype == dtype and math.isinf(got.item()) and math.isinf(want.item())
    assert torch.equal(w.grad, ref.grad)
    norm = ts.global_norm([torch.full((2,), big, dtype=dtype)])
    assert math.isinf(norm.item())
    assert math.isinf(torch.linalg.vector_norm(torch.full((2,), big, dtype=dtype)).item())


# --------------------------------------------------------------------------- torch.compile


def _compile_available():
    try:
        import torch._dynamo  # noqa: F401
    except Exception:
        return False
    return hasattr(torch, "compile")


@requires_compiled
@pytest.mark.skipif(not _compile_available(), reason="torch.compile is not available")
@pytest.mark.parametrize("public", [True, False], ids=["public", "op"])
def test_torch_compile_fullgraph(public):
    """Both the public function (on a list of tensors with .grad) and the op trace
    with fullgraph=True."""
    torch._dynamo.reset()
    params = [make_param((6, 5), seed=1), make_param((7,), seed=2)]
    ours = twin(params)

    if public:
        def f(ps):
            return ts.clip_by_global_norm(ps, 0.2) * 1
    else:
        def f(ps):
            return torch.ops.torchstruct.clip_by_global_norm_([p.grad for p in ps], 0.2, 2.0) * 1

    with _ops.use_backend("compiled"):
        try:
            got = torch.compile(f, fullgraph=True, backend="aot_eager")(ours)
        except Exception as e:
            text = str(e).lower()
            if "fake" in text or "graph break" in text or "unsupported" in text:
                raise
            pytest.skip(f"torch.compile unavailable here: {type(e).__name__}: {e}")
    expected = clip_grad_norm_(params, 0.2)
    torch.testing.assert_close(got, expected)
    for a, b in zip(params, ours):
        torch.testing.assert_close(b.grad, a.grad)


# --------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.parametrize("p", NORM_TYPES)
def test_cuda_matches_torch(backend, p):
    params = [make_param(s, d, "cuda", seed=i, grad=g) for i, (s, d, g) in enumerate([
        ((1,), torch.float32, "dense"), ((70_000,), torch.float16, "dense"),
        ((3000,), torch.bfloat16, "dense"), ((200_001,), torch.float64, "dense"),
        ((0,), torch.float32, "dense"), ((30, 40), torch.float32, "transposed"),
        ((8, 10), torch.float32, "strided"), ((5,), torch.float32, "none"),
    ])]
    assert_like_torch(params, 0.5, p)
    assert_like_torch(params, 1e9, p)


@pytest.mark.cuda
def test_cuda_many_small_nonfinite_and_duplicates(backend):
    params = [make_param((1000,), device="cuda", seed=i) for i in range(2000)]
    assert_like_torch(params, 1.0, 2.0)
    assert_like_torch(params[:3] + params[:2], 0.1, 2.0)
    params[1234].grad[17] = float("nan")
    assert_like_torch(params, 1.0, 2.0)
    before = snapshot(params)
    with pytest.raises(RuntimeError, match="non-finite"):
        ts.clip_by_global_norm(params, 1.0, error_if_nonfinite=True)
    assert_bitwise_unchanged(params, before)


@pytest.mark.cuda
def test_cuda_scale_op_device_scalar(backend):
    t = torch.arange(5.0, device="cuda")
    _ops.scale_([t], torch.tensor(0.5, device="cuda"))
    torch.testing.assert_close(t.cpu(), torch.arange(5.0) * 0.5)
    _ops.scale_([t], torch.tensor(2.0))  # a CPU scalar
    torch.testing.assert_close(t.cpu(), torch.arange(5.0))


@pytest.mark.cuda
def test_cuda_and_cpu_together(backend):
    params = [make_param((50,), device="cuda", seed=1), make_param((20,), seed=2),
              make_param((30,), device="cuda", seed=3)]
    got = assert_like_torch(params, 0.1, 2.0)
    assert got.device.type == "cuda"


def test_version_counter_bumped_like_mul_(backend):
    """The in-place write is visible to autograd, as with torch's mul_: a value saved for
    backward and then clipped makes backward refuse."""
    g = torch.tensor([3.0, 4.0])
    v = g._version
    _ops.clip_by_global_norm_([g], 1.0, 2.0)
    assert g._version > v
    v = g._version
    _ops.scale_([g], torch.tensor(0.5))
    assert g._version > v
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    y = x * 2
    z = (y * y).sum()  # saves y
    with torch.no_grad():
        _ops.clip_by_global_norm_([y], 0.1, 2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.backward()


def test_inference_tensor_outside_inference_mode_refused(backend):
    with torch.inference_mode():
        g = torch.tensor([3.0, 4.0])
    with pytest.raises(RuntimeError, match="[Ii]nference"):
        _ops.clip_by_global_norm_([g], 1.0, 2.0)
    assert torch.equal(g, torch.tensor([3.0, 4.0]))
    with torch.inference_mode():
        _ops.clip_by_global_norm_([g], 1.0, 2.0)
    torch.testing.assert_close(g, torch.tensor([0.6, 0.8]), rtol=1e-5, atol=0.0)


# ----------------------------------------------------------------------------- the C++ entry point
@requires_compiled
def test_list_of_parameters_takes_the_cpp_entry_and_matches_torch():
    """Many small parameters: ``.grad`` read in C++; same norm and gradients as torch."""
    ours = [make_param((1000,), seed=i) for i in range(300)]
    ours[7].grad = None  # skipped, as torch skips it
    theirs = [make_param((1000,), seed=i) for i in range(300)]
    theirs[7].grad = None
    with _ops.use_backend("compiled"), torch.no_grad():
        got = _ops.clip_grads_of(ours, 0.5, 2.0)
    want = clip_grad_norm_(theirs, 0.5)
    assert got is not None  # the entry point applied
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for a, b in zip(ours, theirs):
        if b.grad is None:
            assert a.grad is None
        else:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)
    assert float(torch.stack([p.grad.norm() for p in ours if p.grad is not None]).norm()) == (
        pytest.approx(0.5, rel=1e-5))


@requires_compiled
@pytest.mark.parametrize("case", ["not a tensor", "no gradient", "negative max_norm",
                                  "a generator", "reference backend", "an int64 gradient"])
def test_cpp_entry_declines_and_writes_nothing(case):
    """Whatever the entry point does not handle goes to the checked path untouched."""
    params = [make_param((5,), seed=1), make_param((3,), seed=2)]
    before = [p.grad.clone() for p in params]
    max_norm, backend = 0.1, "compiled"
    if case == "not a tensor":
        params = [params[0], "w"]
    elif case == "no gradient":
        for p in params:
            p.grad = None
    elif case == "negative max_norm":
        max_norm = -1.0
    elif case == "a generator":
        params = (p for p in params)
    elif case == "reference backend":
        backend = "reference"
    elif case == "an int64 gradient":
        params.append(torch.zeros(2, dtype=torch.int64, requires_grad=False))
        params[-1].grad = torch.ones(2, dtype=torch.int64)
    with _ops.use_backend(backend), torch.no_grad():
        assert _ops.clip_grads_of(params, max_norm, 2.0) is None
    for p, b in zip([p for p in params if isinstance(p, torch.Tensor) and p.grad is not None],
                    before):
        assert torch.equal(p.grad, b)
