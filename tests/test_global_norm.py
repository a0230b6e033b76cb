"""torchstruct._ops.global_norm (and torch.ops.torchstruct.global_norm) against
torch.linalg.vector_norm of the concatenation, computed in float64."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchstruct import _fallback, _ops, _reference

INF = float("inf")
NORM_TYPES = [0.5, 1.0, 2.0, 3.0, INF]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]

requires_compiled = pytest.mark.skipif(
    not _ops.compiled_available(), reason="torchstruct._C is not built"
)


def expected_norm(tensors, p):
    """float64 norm of the concatenation of all elements (as stored)."""
    flat = [t.detach().reshape(-1).to(device="cpu", dtype=torch.float64) for t in tensors]
    if not sum(f.numel() for f in flat):  # no element (torch has no inf norm of nothing): 0
        return torch.tensor(0.0, dtype=torch.float64)
    return torch.linalg.vector_norm(torch.cat(flat), p)


def tolerance(tensors, p):
    """Relative tolerance: inputs that are all float64 are reduced in float64,
    anything else accumulates in (at least) float32. The root (1/p) scales the
    relative error of the sum by 1/p."""
    if tensors and all(t.dtype == torch.float64 for t in tensors):
        return 1e-10 * max(1.0, 1.0 / p)
    return 2e-5 * max(1.0, 1.0 / p)


def assert_norm_close(result, tensors, p):
    expected = expected_norm(tensors, p)
    assert result.dim() == 0
    assert result.dtype == _reference.result_dtype(tensors)
    got = result.detach().to("cpu", torch.float64)
    if math.isnan(expected.item()):
        assert math.isnan(got.item()), f"expected NaN, got {got.item()}"
        return
    torch.testing.assert_close(got, expected, rtol=tolerance(tensors, p), atol=0.0)


def make(shape, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)


# --------------------------------------------------------------------------- values


@pytest.mark.parametrize("p", NORM_TYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_single_dtype(backend, dtype, p):
    tensors = [make((13, 7), dtype, seed=1), make((100,), dtype, seed=2), make((3, 4, 5), dtype, seed=3)]
    result = _ops.global_norm(tensors, p)
    assert_norm_close(result, tensors, p)


@pytest.mark.parametrize("p", NORM_TYPES)
def test_mixed_dtypes(backend, p):
    tensors = [make((50,), d, seed=i) for i, d in enumerate(DTYPES * 2)]
    result = _ops.global_norm(tensors, p)
    assert result.dtype == torch.float64
    assert_norm_close(result, tensors, p)


@pytest.mark.parametrize("p", NORM_TYPES)
def test_mixed_low_precision_gives_float32(backend, p):
    tensors = [make((64,), torch.float16), make((65,), torch.bfloat16, seed=1), make((9,), torch.float32)]
    result = _ops.global_norm(tensors, p)
    assert result.dtype == torch.float32
    assert_norm_close(result, tensors, p)


def test_known_values(backend):
    t = [torch.tensor([3.0, -4.0]), torch.tensor([[0.0], [12.0]])]
    assert _ops.global_norm(t, 2.0).item() == pytest.approx(13.0)
    assert _ops.global_norm(t, 1.0).item() == pytest.approx(19.0)
    assert _ops.global_norm(t, INF).item() == pytest.approx(12.0)
    assert _ops.global_norm(t).item() == pytest.approx(13.0)  # default is 2


def test_empty_list(backend):
    result = _ops.global_norm([], 2.0)
    assert result.dim() == 0 and result.item() == 0.0
    assert _ops.global_norm(iter([]), INF).item() == 0.0


@pytest.mark.parametrize("p", NORM_TYPES)
def test_zero_size_tensors(backend, p):
    only_empty = [torch.empty(0), torch.empty(3, 0, dtype=torch.float16)]
    result = _ops.global_norm(only_empty, p)
    assert result.item() == 0.0 and result.dtype == torch.float32
    mixed = [torch.empty(0), make((10,), torch.float32), torch.empty(0, 5, dtype=torch.float64)]
    assert_norm_close(_ops.global_norm(mixed, p), mixed, p)


@pytest.mark.parametrize("p", NORM_TYPES)
def test_non_contiguous(backend, p):
    base = make((64, 48), torch.float32)
    tensors = [
        base.t(),
        base[::3, 5:17],
        make((10, 20), torch.float64, seed=4).t()[2:],
        make((40, 6), torch.bfloat16, seed=5)[:, ::2],
        make((8, 8, 8), torch.float16, seed=6).permute(2, 0, 1),
    ]
    assert not any(t.is_contiguous() for t in tensors)
    assert_norm_close(_ops.global_norm(tensors, p), tensors, p)


@pytest.mark.parametrize("p", NORM_TYPES)
def test_one_big_tensor(backend, p):
    # > 1M elements: spans many work chunks, reduced in parallel.
    big = make((1_500_001,), torch.float32, seed=7)
    assert_norm_close(_ops.global_norm([big], p), [big], p)


@pytest.mark.parametrize("p", [1.0, 2.0, INF])
def test_big_half_tensor(backend, p):
    big = make((1 << 20,), torch.float16, seed=8)
    assert_norm_close(_ops.global_norm([big], p), [big], p)


@pytest.mark.parametrize("p", NORM_TYPES)
def test_many_small_tensors(backend, p):
    tensors = [make((i % 7 + 1, 3), torch.float32, seed=i) for i in range(2000)]
    assert_norm_close(_ops.global_norm(tensors, p), tensors, p)


def test_outlier_is_found(backend):
    # The max lands in one element of one chunk far from the start.
    tensors = [torch.zeros(200_000) for _ in range(3)]
    tensors[2][123_457] = -5.0
    assert _ops.global_norm(tensors, INF).item() == 5.0
    assert _ops.global_norm(tensors, 1.0).item() == 5.0


# --------------------------------------------------------------------------- non-finite


@pytest.mark.parametrize("p", NORM_TYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where", [0, 777, 999, 99_999])  # 999: in a block's scalar tail
def test_nan_propagates(backend, dtype, p, where):
    tensors = [make((1000,), dtype, seed=1), make((100_000,), dtype, seed=2)]
    if where < 1000:
        tensors[0][where] = float("nan")
    else:
        tensors[1][where] = float("nan")
    tensors[1][5] = 1e4  # a larger finite value must not hide the NaN (inf norm)
    assert math.isnan(_ops.global_norm(tensors, p).item())


@pytest.mark.parametrize("p", NORM_TYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_inf_propagates(backend, dtype, p):
    tensors = [make((1000,), dtype), make((5000,), dtype, seed=1)]
    tensors[1][4321] = -float("inf")
    assert _ops.global_norm(tensors, p).item() == INF


@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_nan_propagates(backend, dtype):
    t = make((4096,), dtype)
    t[100] = -float("nan")
    for p in NORM_TYPES:
        assert math.isnan(_ops.global_norm([t], p).item())


def test_nan_and_inf_gives_nan(backend):
    t = [torch.tensor([float("inf"), 1.0]), torch.tensor([float("nan")])]
    for p in NORM_TYPES:
        assert math.isnan(_ops.global_norm(t, p).item())


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("bad", [0, 0.0, -1, -INF, float("nan"), "two", None])
def test_bad_norm_type(backend, bad):
    with pytest.raises(ValueError, match="norm_type"):
        _ops.global_norm([torch.ones(3)], bad)
    with pytest.raises(ValueError, match="norm_type"):
        _ops.global_norm([], bad)


@requires_compiled
@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan")])
def test_bad_norm_type_compiled_op(bad):
    with pytest.raises(ValueError, match="norm_type"):
        torch.ops.torchstruct.global_norm([torch.ones(3)], bad)


def test_sparse_raises(backend):
    sparse = torch.eye(3).to_sparse()
    with pytest.raises(TypeError, match="sparse"):
        _ops.global_norm([torch.ones(2), sparse])


@pytest.mark.parametrize("bad", [torch.ones(3, dtype=torch.int64), torch.ones(2, dtype=torch.complex64)])
def test_unsupported_dtype_raises(backend, bad):
    with pytest.raises(TypeError, match="dtype"):
        _ops.global_norm([torch.ones(2), bad])


def test_non_tensor_raises(backend):
    with pytest.raises(TypeError, match="entry 1"):
        _ops.global_norm([torch.ones(2), 3.0])


@requires_compiled
def test_op_rejects_mixed_devices_while_tracing():
    # cpu + meta dispatches to the fake (meta) kernel, which checks devices as
    # the real kernels do (the CUDA kernel's own check: test_cuda_* below).
    with pytest.raises(RuntimeError, match="one device"):
        torch.ops.torchstruct.global_norm([torch.ones(3), torch.ones(3, device="meta")], 2.0)


@requires_compiled
def test_compiled_op_rejects_empty_list():
    # The dispatcher refuses an op call without tensors before any kernel runs.
    with pytest.raises(RuntimeError, match="empty list"):
        torch.ops.torchstruct.global_norm([], 2.0)


@requires_compiled
def test_compiled_op_rejects_bad_dtype():
    with pytest.raises(TypeError, match="dtype"):
        torch.ops.torchstruct.global_norm([torch.ones(3, dtype=torch.int32)], 2.0)


@requires_compiled
def test_compiled_op_matches_reference():
    tensors = [make((300, 5), d, seed=i) for i, d in enumerate(DTYPES)]
    for p in _reference.KERNEL_NORMS:
        got = torch.ops.torchstruct.global_norm(tensors, p)
        ref = _reference.global_norm(tensors, p)
        assert got.dtype == ref.dtype
        torch.testing.assert_close(got, ref, rtol=2e-5, atol=0.0)


@requires_compiled
@pytest.mark.parametrize("p", [0.5, 3.0, 200.0])
def test_compiled_ops_refuse_a_general_p_which_the_api_computes(p):
    """The kernels compute 1, 2 and inf; a general p is refused by the ops themselves (before
    any write) and computed by the public functions on PyTorch's ops."""
    g = [make((30,), torch.float32, seed=1)]
    before = g[0].clone()
    with pytest.raises(ValueError, match="kernels compute norm types 1, 2 and inf"):
        torch.ops.torchstruct.global_norm(g, p)
    with pytest.raises(ValueError, match="kernels compute norm types 1, 2 and inf"):
        torch.ops.torchstruct.clip_by_global_norm_(g, 0.1, p)
    assert torch.equal(g[0], before)
    assert_norm_close(_ops.global_norm(g, p), g, p)


# --------------------------------------------------------------------------- dispatch


def test_backend_is_used(backend, monkeypatch):
    """Each backend runs its own implementation and no other."""
    calls = []
    for module in (_reference, _fallback):
        real = module.global_norm

        def spy(tensors, p, real=real, name=module.__name__.rsplit(".", 1)[-1]):
            calls.append(name)
            return real(tensors, p)

        monkeypatch.setattr(module, "global_norm", spy)
    _ops.global_norm([torch.ones(4)], 2.0)
    assert calls == {"compiled": [], "fallback": ["_fallback"], "reference": ["_reference"]}[backend]


def test_requires_grad_is_differentiable(backend):
    x = torch.tensor([3.0, 4.0], requires_grad=True)
    n = _ops.global_norm([x], 2.0)
    n.backward()
    torch.testing.assert_close(x.grad, torch.tensor([0.6, 0.8]))


def test_several_devices_combined(backend):
    """Tensors on several devices: per-device norms combined on the first device."""
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    if len(devices) < 2:
        # 'meta' can't hold values; exercise the combination through the helper instead.
        norms = [torch.tensor(3.0), torch.tensor(4.0, dtype=torch.float64)]
        out = _reference.combine_norms(norms, 2.0, torch.device("cpu"))
        assert out.dtype == torch.float64 and out.item() == pytest.approx(5.0)
        assert _reference.combine_norms(norms, INF).item() == 4.0
        assert _reference.combine_norms(norms, 1.0).item() == pytest.approx(7.0)
        return
    tensors = [make((100,), torch.float32, d, seed=i) for i, d in enumerate(devices * 2)]
    for p in NORM_TYPES:
        result = _ops.global_norm(tensors, p)
        assert result.device == tensors[0].device
        assert_norm_close(result, tensors, p)


# --------------------------------------------------------------------------- torch.compile


def _compile_available():
    try:
        import torch._dynamo  # noqa: F401
    except Exception:
        return False
    return hasattr(torch, "compile")


@requires_compiled
@pytest.mark.skipif(not _compile_available(), reason="torch.compile is not available")
def test_torch_compile_fullgraph_op():
    torch._dynamo.reset()

    def f(a, b):
        return torch.ops.torchstruct.global_norm([a * 2, b], 2.0) + 1

    a, b = make((40, 3), torch.float32), make((17,), torch.float64, seed=1)
    try:
        compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
        got = compiled(a, b)
    except Exception as e:  # a broken compiler toolchain is not this op's failure
        if "fake" in str(e).lower() or "abstract" in str(e).lower():
            raise
        pytest.skip(f"torch.compile unavailable here: {type(e).__name__}: {e}")
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, f(a, b), rtol=1e-10, atol=0.0)


@requires_compiled
@pytest.mark.skipif(not _compile_available(), reason="torch.compile is not available")
def test_torch_compile_fullgraph_seam():
    """The Python seam itself (validation, device grouping, dispatch) traces without breaks."""
    torch._dynamo.reset()

    def f(a, b):
        return _ops.global_norm([a, b + 1], 3.0)

    a, b = make((40, 3), torch.float16), make((17,), torch.float32, seed=1)
    with _ops.use_backend("compiled"):
        try:
            got = torch.compile(f, fullgraph=True, backend="aot_eager")(a, b)
        except Exception as e:
            if "fake" in str(e).lower() or "graph break" in str(e).lower():
                raise
            pytest.skip(f"torch.compile unavailable here: {type(e).__name__}: {e}")
        expected = f(a, b)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0.0)


@requires_compiled
def test_fake_kernel_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a = torch.empty(5, 3)
        b = torch.empty(2, dtype=torch.float16)
        out = torch.ops.torchstruct.global_norm([a, b], 2.0)
        assert out.shape == () and out.dtype == torch.float32
        c = torch.empty(4, dtype=torch.float64)
        assert torch.ops.torchstruct.global_norm([a, c], INF).dtype == torch.float64


# --------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.parametrize("p", NORM_TYPES)
def test_cuda_matches_reference(backend, p):
    tensors = [make((n,), d, "cuda", seed=n) for n, d in
               [(1, torch.float32), (70_000, torch.float16), (3000, torch.bfloat16),
                (200_001, torch.float64), (0, torch.float32), (513, torch.float32)]]
    tensors.append(make((30, 40), torch.float32, "cuda", seed=9).t())
    result = _ops.global_norm(tensors, p)
    assert result.device.type == "cuda"
    assert_norm_close(result, tensors, p)
    ref = _reference.global_norm(tensors, p)
    torch.testing.assert_close(result, ref, rtol=2e-5, atol=0.0)


@pytest.mark.cuda
@pytest.mark.parametrize("p", NORM_TYPES)
def test_cuda_many_small_and_nonfinite(backend, p):
    tensors = [make((1000,), torch.float32, "cuda", seed=i) for i in range(2000)]
    assert_norm_close(_ops.global_norm(tensors, p), tensors, p)
    tensors[1234][17] = float("nan")
    assert math.isnan(_ops.global_norm(tensors, p).item())
    tensors[1234][17] = float("inf")
    assert _ops.global_norm(tensors, p).item() == INF


@pytest.mark.cuda
def test_cuda_compiled_op_rejects_mixed_devices():
    if "cuda" not in _ops.compiled_device_types():
        pytest.skip("CUDA kernels not built")
    with pytest.raises(RuntimeError, match="one device"):
        torch.ops.torchstruct.global_norm([torch.ones(3, device="cuda"), torch.ones(3)], 2.0)


# --------------------------------------------------------------------------- property


_shapes = st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple)
_entries = st.lists(st.tuples(_shapes, st.sampled_from(DTYPES), st.booleans()), min_size=0, max_size=12)


@settings(max_examples=60, deadline=None)
@given(
    entries=_entries,
    p=st.sampled_from(NORM_TYPES) | st.floats(0.25, 6.0),
    scale=st.sampled_from([1e-3, 1.0, 1e3]),
    seed=st.integers(0, 2**16),
    use_compiled=st.booleans(),
)
def test_property_random_lists(entries, p, scale, seed, use_compiled):
    name = "compiled" if use_compiled and _ops.compiled_available() else "reference"
    tensors = []
    for i, (shape, dtype, transpose) in enumerate(entries):
        t = make(shape, torch.float64, seed=seed + i) * scale
        t = t.to(dtype)
        if transpose and t.dim() >= 2:
            t = t.transpose(0, -1)
        tensors.append(t)
    with _ops.use_backend(name):
        result = _ops.global_norm(tensors, p)
    if not tensors:
        assert result.item() == 0.0
        return
    assert_norm_close(result, tensors, p)
