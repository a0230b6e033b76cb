"""The path of a device without compiled kernels (PyTorch's multi-tensor and fused ops), the
per-device ``backend(device)``, and the step ops' refusals shared by every backend.

The op, clip and optimizer suites run through the fallback too (the ``backend`` fixture);
these tests cover what only it has: the switch, the warning, dtype groups, duplicates,
masks and gradient copies around the fused ops."""
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import torchstruct as ts
import torchstruct.optim as tso
from torchstruct import _fallback, _ops, _reference

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _run(code, **env):
    full_env = dict(os.environ)
    for key in ("TORCHSTRUCT_BACKEND", "TORCHSTRUCT_NO_KERNELS"):
        full_env.pop(key, None)
    full_env.update(env)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=full_env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out


def _tensors(seed=0, dtypes=DTYPES, sizes=(7, 1000, 1, 0, 33)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g, dtype=torch.float64).to(dtypes[i % len(dtypes)])
            for i, n in enumerate(sizes)]


# --------------------------------------------------------------------------- backend(device)


def test_backend_per_device():
    assert _ops.backend("meta") == "reference"
    with _ops.use_backend("reference"):
        assert _ops.backend("cpu") == "reference"
    with _ops.use_backend("fallback"):
        assert _ops.backend() == "fallback"
        assert _ops.backend("cpu") == "fallback"
        assert _ops.backend(torch.device("cuda:1")) == "fallback"
        assert _ops.backend(torch.ones(1)) == "fallback"
    if _ops.compiled_available():
        with _ops.use_backend("compiled"):
            assert _ops.backend("cpu") == "compiled"
            cuda = "compiled" if "cuda" in _ops.compiled_device_types() else "fallback"
            assert _ops.backend("cuda") == cuda
            assert ts.backend("cuda:0") == cuda


def test_no_kernels_env_sends_cpu_to_the_fallback_and_warns_once():
    code = (
        "import warnings, torch\n"
        "from torchstruct import _ops\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        "    a = _ops.global_norm([torch.tensor([3.0, 4.0])]).item()\n"
        "    b = _ops.global_norm([torch.tensor([6.0, 8.0])]).item()\n"
        "print(_ops.backend(), _ops.backend('cpu'), a, b, len(seen))\n"
        "print(seen[0].message if seen else '')\n"
    )
    out = _run(code, TORCHSTRUCT_NO_KERNELS="cpu").stdout.strip().splitlines()
    if not _ops.compiled_available():
        assert out[0] == "reference reference 5.0 10.0 0"
        return
    assert out[0] == "compiled fallback 5.0 10.0 1"
    assert "TORCHSTRUCT_NO_KERNELS names cpu" in out[1] and "pip install" in out[1]


def test_backend_env_fallback():
    code = ("import torch\nfrom torchstruct import _ops\n"
            "print(_ops.backend(), _ops.global_norm([torch.tensor([3.0, 4.0])]).item())")
    assert _run(code, TORCHSTRUCT_BACKEND="fallback").stdout.strip() == "fallback 5.0"


def test_explicit_fallback_does_not_warn():
    with _ops.use_backend("fallback"), warnings.catch_warnings():
        warnings.simplefilter("error")
        _ops.global_norm([torch.ones(3)])


# --------------------------------------------------------------------------- norms and scaling


@pytest.mark.parametrize("p", [1.0, 2.0, 3.0, 0.5, float("inf")])
def test_global_norm_mixed_dtypes_equals_reference(p):
    ts_ = _tensors(seed=1)
    got = _fallback.global_norm(ts_, p)
    want = _reference.global_norm(ts_, p)
    assert got.dtype == want.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("p", [2.0, float("inf")])
def test_global_norm_nonfinite(bad, p):
    ts_ = _tensors(seed=2, dtypes=(torch.float32, torch.bfloat16))
    ts_[1][500] = bad
    got = _fallback.global_norm(ts_, p)
    want = _reference.global_norm(ts_, p)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())


def test_global_norm_only_empty_tensors():
    got = _fallback.global_norm([torch.ones(0), torch.ones(0, 3)], 2.0)
    assert got.item() == 0.0 and got.dtype == torch.float32


def test_scale_duplicates_and_overlapping_views_in_list_order():
    base = torch.arange(1.0, 11.0)
    a, b = base[:6], base[4:]  # overlap at 4, 5
    expected = base.clone()
    for view in (expected[:6], expected[4:], expected[:6]):
        view.mul_(2.0)
    _fallback.scale_([a, b, a], torch.tensor(2.0))
    assert torch.equal(base, expected)


def test_scale_mixed_dtypes_like_mul():
    ts_ = _tensors(seed=3)
    want = [t.clone() for t in ts_]
    scale = torch.tensor(0.3)
    for t in want:
        t.mul_(scale)
    _fallback.scale_(ts_, scale)
    for got, exp in zip(ts_, want):
        assert torch.equal(got, exp)


def test_clip_equals_torch():
    params = [nn.Parameter(torch.zeros(n)) for n in (5, 300, 2)]
    twins = [nn.Parameter(torch.zeros(n)) for n in (5, 300, 2)]
    for i, (p, q) in enumerate(zip(params, twins)):
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(i))
        q.grad = p.grad.clone()
    with _ops.use_backend("fallback"):
        got = ts.clip_by_global_norm(params, 0.5)
    want = torch.nn.utils.clip_grad_norm_(twins, 0.5)
    torch.testing.assert_close(got, want)
    for p, q in zip(params, twins):
        torch.testing.assert_close(p.grad, q.grad)


# --------------------------------------------------------------------------- optimizer steps


def _step_inputs(dtype, seed=0, n=(6, 40, 1, 0)):
    g = torch.Generator().manual_seed(seed)

    def r(k):
        return torch.randn(k, generator=g, dtype=torch.float64).to(dtype)

    params = [r(k) for k in n]
    grads = [r(k) for k in n]
    m = [r(k) * 0.1 for k in n]
    v = [r(k).abs() * 0.01 for k in n]
    vmax = [x * 2 for x in v]
    steps = [torch.tensor(float(3 + i)) for i in range(len(n))]
    masks = [torch.rand(k, generator=g) > 0.4 for k in n]
    if len(masks) > 2:
        masks[2] = None
    return params, grads, m, v, vmax, steps, masks


def _clone(lists):
    return [[None if t is None else t.clone() for t in lst] for lst in lists]


TOL = {torch.float32: 1e-6, torch.float64: 1e-12, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("with_masks", [False, True])
@pytest.mark.parametrize("scaled", [False, True])
def test_adamw_step_equals_reference(dtype, amsgrad, with_masks, scaled):
    inputs = _step_inputs(dtype)
    ours, ref = _clone(inputs), _clone(inputs)
    grads_before = [g.clone() for g in inputs[1]]
    extra = {}
    if scaled:
        extra = dict(clip_coef=torch.tensor(0.25), grad_scale=torch.tensor(1024.0),
                     found_inf=torch.tensor(0.0))
        for lst in (ours, ref):
            lst[1] = [g * 1024 for g in lst[1]]
        grads_before = [g * 1024 for g in grads_before]
    for impl, (p, g, m, v, vmax, steps, masks) in ((_fallback, ours), (_reference, ref)):
        impl.adamw_step_(p, g, m, v, vmax if amsgrad else [], steps,
                         masks if with_masks else [], 1e-2, 0.9, 0.999, 0.1, 1e-8, amsgrad,
                         False, **extra)
    tol = TOL[dtype]
    for k, (a, b) in enumerate(zip(ours, ref)):
        if k == 4 and not amsgrad:
            continue
        for x, y in zip(a, b):
            if x is not None:
                torch.testing.assert_close(x, y, rtol=tol, atol=tol)
    for g, before in zip(ours[1], grads_before):
        assert torch.equal(g, before), "gradients are never written"
    if with_masks:  # masked-out elements keep their bits, state included
        for k in (0, 2, 3):
            for x, orig, mask in zip(ours[k], inputs[k], inputs[6]):
                if mask is not None:
                    assert torch.equal(x[~mask], orig[~mask])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("momentum, dampening, nesterov", [(0.0, 0.0, False), (0.9, 0.1, False),
                                                           (0.9, 0.0, True)])
@pytest.mark.parametrize("first_step", [False, True])
@pytest.mark.parametrize("with_masks", [False, True])
def test_sgd_step_equals_reference(dtype, momentum, dampening, nesterov, first_step, with_masks):
    params, grads, bufs, _, _, _, masks = _step_inputs(dtype, seed=5)
    bufs = bufs if momentum else []
    ours, ref = _clone([params, grads, bufs]), _clone([params, grads, bufs])
    extra = dict(clip_coef=torch.tensor(0.5), grad_scale=torch.tensor(8.0))
    for impl, (p, g, b) in ((_fallback, ours), (_reference, ref)):
        impl.sgd_step_(p, g, b, masks if with_masks else [], 0.1, momentum, dampening, 0.01,
                       nesterov, False, first_step, **extra)
    tol = TOL[dtype]
    for a, b in zip(ours, ref):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=tol, atol=tol)
    for g, before in zip(ours[1], grads):
        assert torch.equal(g, before), "gradients are never written"
    if with_masks:
        for x, orig, mask in zip(ours[0], params, masks):
            if mask is not None:
                assert torch.equal(x[~mask], orig[~mask])


@pytest.mark.parametrize("found", [1.0, 2.0, -1.0, float("nan")])
def test_found_inf_nonzero_writes_nothing(found):
    p, g, m, v, vmax, steps, _ = _step_inputs(torch.float32)
    before = _clone([p, g, m, v, steps])
    _fallback.adamw_step_(p, g, m, v, [], steps, [], 1e-2, 0.9, 0.999, 0.1, 1e-8, False, False,
                          grad_scale=torch.tensor(2.0), found_inf=torch.tensor(found))
    _fallback.sgd_step_(p, g, m, [], 0.1, 0.9, 0.0, 0.0, False, False, False,
                        found_inf=torch.tensor(found))
    for a, b in zip([p, g, m, v, steps], before):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def test_device_without_fused_ops_uses_the_reference(monkeypatch):
    monkeypatch.setitem(_fallback._fused_cache, ("_fused_adamw_", "cpu"), False)
    calls = []
    real = _reference.adamw_step_
    monkeypatch.setattr(_reference, "adamw_step_", lambda *a, **k: calls.append(1) or real(*a, **k))
    p, g, m, v, vmax, steps, _ = _step_inputs(torch.float32)
    _fallback.adamw_step_(p, g, m, v, [], steps, [], 1e-2, 0.9, 0.999, 0.1, 1e-8, False, False)
    assert calls == [1]


def test_has_fused_on_cpu():
    assert _fallback.has_fused("_fused_adamw_", torch.device("cpu")) == hasattr(torch,
                                                                                "_fused_adamw_")


# --------------------------------------------------------------------------- shared refusals


@pytest.mark.parametrize("name", ["compiled", "fallback", "reference"])
def test_shared_step_tensor_refused(name):
    if name == "compiled" and not _ops.compiled_available():
        pytest.skip("extension not built")
    p, g, m, v, vmax, steps, _ = _step_inputs(torch.float32, n=(3, 4))
    shared = [steps[0], steps[0]]
    before = _clone([p, m, v, shared])
    with _ops.use_backend(name), pytest.raises(RuntimeError, match="step 1 and step 0"):
        _ops.adamw_step_(p, g, m, v, [], shared, lr=1e-2, beta1=0.9, beta2=0.999,
                         weight_decay=0.0, eps=1e-8)
    for a, b in zip([p, m, v, shared], before):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


@pytest.mark.parametrize("name", ["compiled", "fallback", "reference"])
def test_duplicate_parameter_refused(name):
    if name == "compiled" and not _ops.compiled_available():
        pytest.skip("extension not built")
    p = torch.ones(4)
    with _ops.use_backend(name), pytest.raises(RuntimeError, match="shares its memory"):
        _ops.sgd_step_([p, p], [torch.ones(4), torch.ones(4)], [], lr=0.1)
    assert torch.equal(p, torch.ones(4))


# --------------------------------------------------------------------------- SGD under AMP


def _sgd_pair(**kw):
    torch.manual_seed(0)
    ours = nn.Linear(3, 2)
    theirs = nn.Linear(3, 2)
    theirs.load_state_dict(ours.state_dict())
    return (ours, tso.SGD(ours.parameters(), lr=0.1, **kw),
            theirs, torch.optim.SGD(theirs.parameters(), lr=0.1, foreach=False, **kw))


def _set_grads(model, seed):
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


@pytest.mark.parametrize("name", ["compiled", "fallback", "reference"])
def test_sgd_momentum_overflowed_first_step_then_normal_step(name):
    """GradScaler semantics: a first step with found_inf=1 is skipped entirely (torch never
    calls step()); the next step is torch's first step (buffer = gradient)."""
    if name == "compiled" and not _ops.compiled_available():
        pytest.skip("extension not built")
    ours, opt, theirs, ref = _sgd_pair(momentum=0.9, dampening=0.3, weight_decay=0.01)
    with _ops.use_backend(name):
        _set_grads(ours, 1)
        opt.grad_scale, opt.found_inf = torch.tensor(1.0), torch.tensor(1.0)
        opt.step()
        assert not opt.state
        for seed in (2, 3):
            _set_grads(ours, seed)
            _set_grads(theirs, seed)
            opt.grad_scale, opt.found_inf = torch.tensor(1.0), torch.tensor(0.0)
            opt.step()
            ref.step()
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_sgd_momentum_first_step_with_found_inf_on_the_device_path():
    """found_inf that reaches the update (as it does on an accelerator, not read before):
    an overflowed first step creates no buffer."""
    ours, opt, theirs, ref = _sgd_pair(momentum=0.9, dampening=0.3)
    _set_grads(ours, 1)
    plan = opt._plan()
    for group, params in plan:
        grads = [p.grad for p in params]
        _ops.run_step_calls(opt._update(group, params, grads, [None] * len(params), None, None,
                                        torch.tensor(1.0), []))
    assert not opt.state
    _set_grads(ours, 2)
    _set_grads(theirs, 2)
    opt.step()
    ref.step()
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- no retry after OOM


class _Namespace:
    def __init__(self, **ops):
        self.__dict__.update(ops)


class _Op:
    def __init__(self, fn):
        self.default = fn


def test_out_of_memory_after_a_write_is_not_retried(monkeypatch):
    if not _ops.compiled_available():
        pytest.skip("extension not built")
    t = torch.ones(3)

    def scale_then_oom(tensors, scale):
        for x in tensors:
            x.mul_(scale)
        raise torch.OutOfMemoryError("out of memory after the write")

    monkeypatch.setattr(torch.ops, "torchstruct", _Namespace(scale_=_Op(scale_then_oom)))
    with _ops.use_backend("compiled"), pytest.raises(torch.OutOfMemoryError):
        _ops.scale_([t], torch.tensor(2.0))
    assert torch.equal(t, torch.full((3,), 2.0)), "scaled once, not retried"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["_fused_sgd_", "_fused_adamw_"])
def test_fused_ops_used_on_cpu_compute_right(op, dtype):
    """Every (fused op, dtype) the fallback uses on the CPU updates every element (torch 2.13's
    CPU _fused_sgd_ leaves the vectorized part of float16/bfloat16 tensors unchanged: not
    used there)."""
    if not _fallback.has_fused(op, torch.device("cpu"), dtype):
        pytest.skip(f"{op} not used for {dtype} on the cpu")
    n = 1000
    p, g = torch.ones(n, dtype=dtype), torch.ones(n, dtype=dtype)
    if op == "_fused_sgd_":
        torch._fused_sgd_([p], [g], [], weight_decay=0.0, momentum=0.0, lr=0.1, dampening=0.0,
                          nesterov=False, maximize=False, is_first_step=False)
    else:
        torch._fused_adamw_([p], [g], [torch.zeros_like(p)], [torch.zeros_like(p)], [],
                            [torch.tensor(1.0)], lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0.0,
                            eps=1e-8, amsgrad=False, maximize=False)
    assert torch.allclose(p.double(), torch.full((n,), 0.9, dtype=torch.float64), atol=2e-3)


# --------------------------------------------------------------------------- on a GPU


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["compiled", "fallback"])
def test_cuda_sgd_equals_reference(name, dtype):
    if name == "compiled" and "cuda" not in _ops.compiled_device_types():
        pytest.skip("CUDA kernels not built")
    params, grads, bufs, _, _, _, masks = _step_inputs(dtype, seed=7, n=(6, 70_000, 1, 0))
    cuda = [[t.cuda() if t is not None else None for t in lst]
            for lst in (params, grads, bufs, masks)]
    with _ops.use_backend(name):
        _ops.sgd_step_(*cuda[:3], cuda[3], lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01,
                       grad_scale=torch.tensor(4.0, device="cuda"))
    _reference.sgd_step_(params, grads, bufs, masks, 0.1, 0.9, 0.1, 0.01, False, False, False,
                         grad_scale=torch.tensor(4.0))
    for got, want in zip(cuda[:3], (params, grads, bufs)):
        for a, b in zip(got, want):
            torch.testing.assert_close(a.cpu(), b, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["compiled", "fallback"])
def test_cuda_fallback_equals_compiled_and_refusals(name, dtype):
    if name == "compiled" and "cuda" not in _ops.compiled_device_types():
        pytest.skip("CUDA kernels not built")
    p, g, m, v, vmax, steps, masks = _step_inputs(dtype)
    cuda = [[t.cuda() if t is not None else None for t in lst]
            for lst in (p, g, m, v, vmax, steps, masks)]
    with _ops.use_backend(name):
        _ops.adamw_step_(*cuda[:6], cuda[6], lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1,
                         eps=1e-8, amsgrad=True, clip_coef=torch.tensor(0.5, device="cuda"))
        x = cuda[0][0]
        with pytest.raises(RuntimeError, match="shares its memory"):
            _ops.sgd_step_([x, x], [x.clone(), x.clone()], [], lr=0.1)
        s = cuda[5][0]
        with pytest.raises(RuntimeError, match="step 1 and step 0"):
            _ops.adamw_step_([x, x.clone()], [x.clone(), x.clone()], [x.clone(), x.clone()],
                             [x.clone(), x.clone()], [], [s, s], lr=1e-2, beta1=0.9,
                             beta2=0.999, weight_decay=0.0, eps=1e-8)
    _reference.adamw_step_(p, g, m, v, vmax, steps, masks, 1e-2, 0.9, 0.999, 0.1, 1e-8, True,
                           False, clip_coef=torch.tensor(0.5))
    for got, want in zip(cuda[:6], (p, g, m, v, vmax, steps)):
        for a, b in zip(got, want):
            torch.testing.assert_close(a.cpu(), b, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["compiled", "fallback"])
def test_cuda_graph_capture_and_replay(name):
    """The ops capture in a CUDA graph and replay on the captured tensors' new values."""
    if name == "compiled" and "cuda" not in _ops.compiled_device_types():
        pytest.skip("CUDA kernels not built")
    grads = [torch.randn(n, device="cuda") for n in (3, 70_000, 200_000)]
    params = [torch.zeros_like(t) for t in grads]
    ms = [torch.zeros_like(t) for t in grads]
    vs = [torch.zeros_like(t) for t in grads]
    steps = [torch.zeros((), device="cuda") for _ in grads]
    with _ops.use_backend(name):
        def body():
            _ops.clip_by_global_norm_(grads, 1.0, 2.0)
            _ops.adamw_step_(params, grads, ms, vs, [], steps, lr=1e-2, beta1=0.9, beta2=0.999,
                             weight_decay=0.0, eps=1e-8)

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            body()  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        for _ in range(3):
            fresh = [torch.randn_like(t) * 10 for t in grads]
            for t, f in zip(grads, fresh):
                t.copy_(f)
            expected = [f.cpu() for f in fresh]
            torch.nn.utils.clip_grad_norm_(expected, 1.0)
            graph.replay()
            torch.cuda.synchronize()
            for t, e in zip(grads, expected):
                torch.testing.assert_close(t.cpu(), e, rtol=1e-5, atol=1e-6)
    assert all(float(s) == 4.0 for s in steps)  # warm-up and three replays (capture runs nothing)


@pytest.mark.parametrize("cls", [tso.AdamW, tso.SGD])
def test_fallback_step_under_torch_compile(cls):
    """The fallback's fused steps run eagerly inside torch.compile (state created in the traced
    step cannot be mutated by the fused ops there) and give the eager result."""
    kw = dict(lr=1e-2, max_grad_norm=0.5) | ({"momentum": 0.9} if cls is tso.SGD else {})
    torch.manual_seed(0)
    models = [nn.Linear(4, 3), nn.Linear(4, 3)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [cls(m.parameters(), **kw) for m in models]
    compiled_step = torch.compile(opts[0].step, backend="aot_eager")
    x = torch.randn(5, 4)
    with _ops.use_backend("fallback"):
        for _ in range(2):
            for m in models:
                m.zero_grad()
                m(x).pow(2).sum().backward()
            compiled_step()
            opts[1].step()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
