"""An outside audit of the optimizers' eager fast path (the C++ step plan, the gradients read
in C++, the unboxed op call, the version counters): against the checked Python plan,
torch.optim (foreach=False) on the same data, and the same step on the reference backend;
error paths must leave parameters and state as they were."""
import copy
import os
import pickle
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import torchstruct as ts
import torchstruct.optim as tso
from torchstruct import _ops

pytestmark = pytest.mark.skipif(_ops._C is None, reason="the extension is not built")

SETTINGS = settings(max_examples=int(os.environ.get("AUDIT_EXAMPLES", "40")), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# (torchstruct class, torch class, hyper-parameters)
CONFIGS = {
    "sgd": (tso.SGD, torch.optim.SGD, dict(lr=0.1)),
    "sgd_wd": (tso.SGD, torch.optim.SGD, dict(lr=0.1, weight_decay=0.1, maximize=True)),
    "sgd_mom": (tso.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.3)),
    "sgd_nesterov": (tso.SGD, torch.optim.SGD,
                     dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.05)),
    "adamw": (tso.AdamW, torch.optim.AdamW, dict(lr=0.01)),
    "adamw_ams": (tso.AdamW, torch.optim.AdamW,
                  dict(lr=0.01, amsgrad=True, maximize=True, weight_decay=0.3)),
}


def _torch_opt(cls, params, kw):
    return cls(params, foreach=False, **kw)


def _snapshot(opt, params):
    """Every parameter and state tensor, cloned, with the state's keys."""
    out = [p.detach().clone() for p in params]
    state = {}
    for i, p in enumerate(params):
        entry = opt.state.get(p)
        state[i] = None if entry is None else {
            k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in entry.items()}
    return out, state


def _same_snapshot(a, b):
    (pa, sa), (pb, sb) = a, b
    assert all(torch.equal(x, y) for x, y in zip(pa, pb)), "a parameter changed"
    assert sa.keys() == sb.keys()
    for k in sa:
        if sa[k] is None or sb[k] is None:
            assert sa[k] is None and sb[k] is None, f"state of parameter {k} appeared/vanished"
            continue
        assert sa[k].keys() == sb[k].keys(), f"state keys of parameter {k} changed"
        for key in sa[k]:
            x, y = sa[k][key], sb[k][key]
            assert (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y), \
                f"state {key} of parameter {k} changed"


def _close(a, b, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------
# layouts: parameters and gradients of every layout, three ways
# ---------------------------------------------------------------------------

def _param_of(kind, dtype, gen):
    base = torch.randn(64, generator=gen, dtype=torch.float64).to(dtype)
    if kind == "contiguous":
        t = base[:12].reshape(3, 4)
    elif kind == "transposed":
        t = base[:12].reshape(4, 3).t()
    elif kind == "channels_last":
        t = base[:24].reshape(1, 2, 3, 4).contiguous(memory_format=torch.channels_last)
    elif kind == "offset_view":
        t = base[5:17].reshape(3, 4)  # dense, storage offset 5
    elif kind == "size1_odd_stride":
        t = base[:12].reshape(12, 1).as_strided((12, 1), (1, 7))
    elif kind == "scalar":
        t = base[3]
    elif kind == "empty":
        t = base[:0].reshape(0, 3)
    else:
        raise AssertionError(kind)
    return t


def _grad_like(kind, p, gen):
    g = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype)
    if kind == "contiguous" or p.dim() == 0 or p.numel() == 0:
        return g.contiguous()
    if kind == "transposed_storage":  # the dimensions stored in reverse order
        return g.permute(*reversed(range(g.dim()))).contiguous().permute(
            *reversed(range(g.dim())))
    if kind == "strided_slice":  # a view with gaps (not dense)
        big = torch.zeros(*p.shape[:-1], p.shape[-1] * 2, dtype=p.dtype)
        big[..., ::2] = g
        return big[..., ::2]
    if kind == "expanded":  # one row broadcast: stride 0
        row = g.reshape(-1)[: p.shape[-1]].clone()
        return row.expand(p.shape)
    if kind == "like_param":
        out = torch.empty_like(p)
        out.copy_(g)
        return out
    raise AssertionError(kind)


P_KINDS = ("contiguous", "transposed", "channels_last", "offset_view", "size1_odd_stride",
           "scalar", "empty")
G_KINDS = ("contiguous", "transposed_storage", "strided_slice", "expanded", "like_param")


def _run_three(config, p_kinds, g_kinds, dtype, steps, seed):
    """The same steps by torchstruct (compiled), torchstruct (reference) and torch; returns
    the parameters and their strides, the state of torchstruct's."""
    ts_cls, torch_cls, kw = CONFIGS[config]
    results = {}
    for who in ("compiled", "reference", "torch"):
        gen = torch.Generator().manual_seed(seed)
        params = [nn.Parameter(_param_of(k, dtype, gen)) for k in p_kinds]
        opt = (_torch_opt(torch_cls, params, kw) if who == "torch" else ts_cls(params, **kw))
        for _ in range(steps):
            for p, gk in zip(params, g_kinds):
                p.grad = _grad_like(gk, p, gen)
            with _ops.use_backend("reference" if who == "reference" else "compiled"):
                opt.step()
        results[who] = ([p.detach().clone() for p in params], [p.stride() for p in params], opt)
    return results


@SETTINGS
@given(config=st.sampled_from(sorted(CONFIGS)),
       kinds=st.lists(st.tuples(st.sampled_from(P_KINDS), st.sampled_from(G_KINDS)),
                      min_size=1, max_size=4),
       dtype=st.sampled_from([torch.float32, torch.float64]),
       steps=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_every_layout_steps_as_torch_and_the_reference(config, kinds, dtype, steps, seed):
    p_kinds, g_kinds = zip(*kinds)
    r = _run_three(config, p_kinds, g_kinds, dtype, steps, seed)
    fast, fast_strides, opt = r["compiled"]
    for who in ("reference", "torch"):
        other, strides, _ = r[who]
        for a, b in zip(fast, other):
            _close(a, b)
        assert fast_strides == strides, f"the parameters' layout changed ({who})"
    # the state tensors keep the parameter's layout (the kernels read them as it)
    for p in opt.param_groups[0]["params"]:
        for k, v in opt.state[p].items():
            if k != "step":
                assert v.shape == p.shape and (v.numel() <= 1 or v.stride() == p.stride()
                                               or p.dim() == 0), k


# ---------------------------------------------------------------------------
# the C++ plan against the checked one, along a sequence of edits between steps
# ---------------------------------------------------------------------------

def _outcome(fn):
    try:
        return "plan", [(id(g), [id(p) for p in ps]) for g, ps in fn()]
    except (RuntimeError, ValueError, TypeError) as err:
        return "error", type(err)


EDITS = ("grad_none", "freeze", "unfreeze", "data_shape", "data_dtype", "data_transposed",
         "grad_transposed", "grad_expanded", "append_group_tied", "drop_group", "lr_scale_0",
         "lr_scale_1", "dup_in_group", "set_grad", "data_non_dense", "mask")


def _apply(edit, opt, params, pick):
    p = params[pick % len(params)]
    if edit == "grad_none":
        p.grad = None
    elif edit == "freeze":
        p.requires_grad_(False)
    elif edit == "unfreeze":
        p.requires_grad_(True)
    elif edit == "data_shape":
        p.data = torch.randn(p.numel() + 1, dtype=p.dtype)
    elif edit == "data_dtype":
        p.data = p.data.double() if p.dtype == torch.float32 else p.data.float()
    elif edit == "data_transposed" and p.dim() == 2:
        p.data = p.data.t().contiguous().t()
    elif edit == "data_non_dense":
        p.data = torch.randn(p.numel() * 2, dtype=p.dtype)[::2]
    elif edit == "grad_transposed" and p.dim() == 2:
        p.grad = torch.randn(p.shape[::-1], dtype=p.dtype).t()
    elif edit == "grad_expanded" and p.dim() == 2:
        p.grad = torch.randn(1, p.shape[1], dtype=p.dtype).expand(p.shape)
    elif edit == "append_group_tied":
        opt.param_groups.append({**opt.defaults, "params": [p, params[(pick + 1) % len(params)]]})
    elif edit == "drop_group" and len(opt.param_groups) > 1:
        opt.param_groups.pop(pick % len(opt.param_groups))
    elif edit == "lr_scale_0":
        opt.param_groups[pick % len(opt.param_groups)]["lr_scale"] = 0
    elif edit == "lr_scale_1":
        opt.param_groups[pick % len(opt.param_groups)]["lr_scale"] = 1.0
    elif edit == "dup_in_group":
        opt.param_groups[pick % len(opt.param_groups)]["params"].append(p)
    elif edit == "set_grad":
        p.grad = torch.randn(p.shape, dtype=p.dtype) if p.layout == torch.strided else None
    elif edit == "mask" and any(p is q for g in opt.param_groups for q in g["params"]):
        opt.masks[p] = torch.rand(p.shape) > 0.5  # written directly: checked at the step


@SETTINGS
@given(name=st.sampled_from(["sgd_mom", "adamw_ams"]),
       edits=st.lists(st.tuples(st.sampled_from(EDITS), st.integers(0, 7)), max_size=8))
def test_the_c_plan_agrees_with_the_checked_plan_along_edits(name, edits):
    torch.manual_seed(0)
    ts_cls, _, kw = CONFIGS[name]
    params = [nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(5)),
              nn.Parameter(torch.randn(())), nn.Parameter(torch.randn(0, 2))]
    opt = ts_cls([{"params": params[:2]}, {"params": params[2:], "lr_scale": 0.5}], **kw)
    for p in params:
        p.grad = torch.randn_like(p)
    for edit, pick in edits:
        _apply(edit, opt, params, pick)
        checked = _outcome(opt._plan_checked)
        fast = opt._plan_fast()
        if checked[0] == "error":
            assert fast is None, (edit, "the checked plan raises, the C++ plan answered")
        elif fast is not None:
            assert _outcome(lambda: fast) == checked, edit
        before = _snapshot(opt, params)
        try:
            opt.step()
        except (RuntimeError, ValueError, TypeError):
            if checked[0] == "error":  # refused by the plan: nothing written
                _same_snapshot(before, _snapshot(opt, params))
            return  # a kernel refusal: see the partial-write tests below


# ---------------------------------------------------------------------------
# errors must leave every parameter and all state as they were
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["sgd_mom", "adamw"])
def test_a_bad_gradient_in_a_later_group_changes_nothing(name):
    ts_cls, _, kw = CONFIGS[name]
    a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(4))
    opt = ts_cls([{"params": [a]}, {"params": [b]}], **kw)
    a.grad, b.grad = torch.ones(3), torch.ones(4)
    opt.step()
    b.grad = torch.ones(4)
    b.data = torch.ones(4, dtype=torch.float64)  # the gradient's dtype no longer matches
    a.grad = torch.ones(3)
    before = _snapshot(opt, [a, b])
    with pytest.raises(RuntimeError, match="param group 1"):
        opt.step()
    _same_snapshot(before, _snapshot(opt, [a, b]))


@pytest.mark.parametrize("name", ["sgd_mom", "adamw"])
def test_state_that_no_longer_fits_changes_nothing(name):
    ts_cls, _, kw = CONFIGS[name]
    a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(4))
    opt = ts_cls([{"params": [a]}, {"params": [b]}], **kw)
    a.grad, b.grad = torch.ones(3), torch.ones(4)
    opt.step()
    b.data = torch.ones(5)
    a.grad, b.grad = torch.ones(3), torch.ones(5)
    before = _snapshot(opt, [a, b])
    with pytest.raises(RuntimeError):
        opt.step()
    _same_snapshot(before, _snapshot(opt, [a, b]))


def test_an_inference_tensor_parameter_changes_nothing_sgd():
    p, q = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    opt = tso.SGD([p, q], lr=0.1, momentum=0.9, dampening=0.5)
    p.grad = torch.ones(3)
    opt.step()  # p has a buffer, q none
    with torch.inference_mode():
        q.data = torch.ones(3)
    p.grad, q.grad = torch.ones(3), torch.ones(3)
    before = _snapshot(opt, [p, q])
    with pytest.raises(RuntimeError, match="inference"):
        opt.step()
    _same_snapshot(before, _snapshot(opt, [p, q]))


def test_an_inference_tensor_parameter_changes_nothing_adamw():
    p = nn.Parameter(torch.ones(3))
    opt = tso.AdamW([p], lr=0.1)
    with torch.inference_mode():
        p.data = torch.ones(3)
    p.grad = torch.ones(3)
    with pytest.raises(RuntimeError, match="inference"):
        opt.step()
    assert p not in opt.state


def test_after_a_refused_step_sgd_still_matches_torch():
    p = nn.Parameter(torch.ones(3))
    opt = tso.SGD([p], lr=0.1, momentum=0.9, dampening=0.5)
    good = p.data
    with torch.inference_mode():
        p.data = torch.ones(3)
    p.grad = torch.ones(3)
    with pytest.raises(RuntimeError, match="inference"):
        opt.step()
    p.data = good  # fixed by the user; step again
    q = nn.Parameter(torch.ones(3))
    ref = torch.optim.SGD([q], lr=0.1, momentum=0.9, dampening=0.5, foreach=False)
    p.grad, q.grad = torch.ones(3), torch.ones(3)
    opt.step()
    ref.step()
    _close(p.detach(), q.detach())


def test_inference_state_is_refused_and_changes_nothing_in_one_group():
    p = nn.Parameter(torch.ones(3))
    opt = tso.AdamW([p], lr=0.1)
    p.grad = torch.ones(3)
    with torch.inference_mode():
        opt.step()  # state made here is inference tensors
    assert opt.state[p]["exp_avg"].is_inference()
    before = _snapshot(opt, [p])
    with pytest.raises(RuntimeError, match="inference"):
        opt.step()
    _same_snapshot(before, _snapshot(opt, [p]))


# ---------------------------------------------------------------------------
# versions: what is written advances, what is not stays
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_versions_advance_exactly_for_written_tensors(name):
    ts_cls, _, kw = CONFIGS[name]
    w = nn.Parameter(torch.randn(4, 3))
    frozen = nn.Parameter(torch.randn(3))
    zero = nn.Parameter(torch.randn(2))
    masked = nn.Parameter(torch.randn(5))
    opt = ts_cls([{"params": [w, frozen, masked]}, {"params": [zero], "lr_scale": 0}], **kw,
                 masks={masked: torch.zeros(5, dtype=torch.bool)})
    for p in (w, frozen, zero, masked):
        p.grad = torch.randn(p.shape[::-1]).t() if p.dim() == 2 else torch.randn_like(p)
    frozen.requires_grad_(False)
    opt.step()
    versions = {n: p._version for n, p in (("w", w), ("frozen", frozen), ("zero", zero),
                                             ("masked", masked))}
    grad_version = w.grad._version
    state_versions = {k: v._version for k, v in opt.state[w].items()}
    opt.step()
    assert w._version > versions["w"] and masked._version > versions["masked"]
    assert frozen._version == versions["frozen"] and zero._version == versions["zero"]
    assert frozen not in opt.state and zero not in opt.state
    assert w.grad._version == grad_version, "the gradient was written"
    for k, v in opt.state[w].items():
        assert v._version > state_versions[k], k


@pytest.mark.parametrize("name", ["sgd_mom", "adamw"])
@pytest.mark.parametrize("grad_kind", ["transposed", "expanded", "channels_last"])
def test_a_step_between_forward_and_backward_raises_for_any_grad_layout(name, grad_kind):
    ts_cls, _, kw = CONFIGS[name]
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, 3)
    opt = ts_cls(conv.parameters(), **kw)
    x = torch.randn(1, 2, 5, 5)
    conv(x).sum().backward()
    g = conv.weight.grad
    conv.weight.grad = {
        "transposed": g.permute(3, 2, 1, 0).contiguous().permute(3, 2, 1, 0),
        "expanded": g[:1].expand_as(g),
        "channels_last": g.contiguous(memory_format=torch.channels_last)}[grad_kind]
    opt.step()
    loss = conv(x).square().sum()
    conv.weight.grad = conv.weight.grad.clone()
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


# ---------------------------------------------------------------------------
# AMP, closures, threads, copies
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["sgd_mom", "adamw_ams"])
def test_grad_scaler_on_cpu_matches_torch(name):
    ts_cls, torch_cls, kw = CONFIGS[name]
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    b = copy.deepcopy(a)
    oa, ob = ts_cls(a.parameters(), **kw), _torch_opt(torch_cls, b.parameters(), kw)
    sa = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
    sb = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
    for i in range(6):
        x = torch.randn(5, 4)
        if i == 3:
            x[0, 0] = float("inf")  # an overflowed step: skipped by both
        for m, o, s in ((a, oa, sa), (b, ob, sb)):
            o.zero_grad()
            s.scale(m(x).square().mean()).backward()
            s.step(o)
            s.update()
        assert sa.get_scale() == sb.get_scale()
    for pa, pb in zip(a.parameters(), b.parameters()):
        _close(pa.detach(), pb.detach())
    for pa, pb in zip(a.parameters(), b.parameters()):
        for k, v in ob.state[pb].items():
            _close(torch.as_tensor(oa.state[pa][k]).float(), torch.as_tensor(v).float())


@pytest.mark.parametrize("name", ["sgd_nesterov", "adamw"])
def test_a_closure_steps_as_torch(name):
    ts_cls, torch_cls, kw = CONFIGS[name]
    torch.manual_seed(0)
    a = nn.Linear(3, 2)
    b = copy.deepcopy(a)
    oa, ob = ts_cls(a.parameters(), **kw), _torch_opt(torch_cls, b.parameters(), kw)
    x = torch.randn(4, 3)
    for _ in range(3):
        losses = []
        for m, o in ((a, oa), (b, ob)):
            def closure(m=m, o=o):
                o.zero_grad()
                loss = m(x).square().sum()
                loss.backward()
                return loss
            losses.append(o.step(closure))
        _close(losses[0], losses[1])
    for pa, pb in zip(a.parameters(), b.parameters()):
        _close(pa.detach(), pb.detach())


def test_threads_stepping_their_own_optimizers_agree_with_sequential():
    def make(seed):
        g = torch.Generator().manual_seed(seed)
        ps = [nn.Parameter(torch.randn(50, 20, generator=g)) for _ in range(5)]
        grads = [[torch.randn(50, 20, generator=g) for _ in ps] for _ in range(20)]
        return ps, grads

    def train(ps, grads, cls):
        opt = cls(ps, lr=0.01, **({"momentum": 0.9} if cls is tso.SGD else {}))
        for step in grads:
            for p, g in zip(ps, step):
                p.grad = g
            opt.step()

    jobs = [(make(i), tso.AdamW if i % 2 else tso.SGD) for i in range(6)]
    seq = [([p.detach().clone() for p in ps], grads, cls) for (ps, grads), cls in jobs]
    threads = [threading.Thread(target=train, args=(ps, grads, cls))
               for (ps, grads), cls in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for ((ps, _), _), (start, grads, cls) in zip(jobs, seq):
        ref = [nn.Parameter(s) for s in start]
        train(ref, grads, cls)
        for a, b in zip(ps, ref):
            assert torch.equal(a.detach(), b.detach())


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "state_dict"])
@pytest.mark.parametrize("name", ["sgd_mom", "adamw_ams"])
def test_resuming_from_a_copy_continues_exactly(how, name):
    ts_cls, torch_cls, kw = CONFIGS[name]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = ts_cls(model.parameters(), **kw, masks={model[0].weight: torch.rand(4, 3) > 0.3},
                 max_grad_norm=0.5)
    data = [torch.randn(5, 3) for _ in range(4)]

    def step(m, o, x):
        o.zero_grad()
        m(x).square().sum().backward()
        o.step()

    for x in data[:2]:
        step(model, opt, x)
    if how == "deepcopy":
        model2, opt2 = copy.deepcopy((model, opt))
    elif how == "pickle":
        model2, opt2 = pickle.loads(pickle.dumps((model, opt)))
    else:
        model2 = copy.deepcopy(model)
        opt2 = ts_cls(model2.parameters(), **kw, max_grad_norm=0.5)
        opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    for x in data[2:]:
        step(model, opt, x)
        step(model2, opt2, x)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a.detach(), b.detach())
    for a, b in zip(model.parameters(), model2.parameters()):
        for k in opt.state[a]:
            assert torch.equal(opt.state[a][k], opt2.state[b][k]), k


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_optimizer_keeps_masks_and_clip(how):
    w = nn.Parameter(torch.ones(3))
    opt = tso.SGD([w], lr=0.1, masks={w: torch.tensor([True, False, True])},
                  max_grad_norm=0.5, norm_type=1.0)
    w2, opt2 = (copy.deepcopy((w, opt)) if how == "deepcopy"
                else pickle.loads(pickle.dumps((w, opt))))
    assert (opt2.max_grad_norm, opt2.norm_type) == (0.5, 1.0)
    assert len(opt2.masks) == 1 and next(iter(opt2.masks)) is w2


def test_torch_state_is_taken_over_and_continues_as_torch():
    """State from torch.optim.AdamW (step a CPU float32 scalar, maybe a float64 exp_avg after
    a dtype change) is converted at the first step, then stepped as torch steps it."""
    torch.manual_seed(0)
    a = nn.Linear(3, 2)
    b = copy.deepcopy(a)
    ta = torch.optim.AdamW(a.parameters(), lr=0.01, foreach=False)
    for _ in range(2):
        ta.zero_grad()
        a(torch.randn(4, 3)).sum().backward()
        ta.step()
    b.load_state_dict(a.state_dict())
    ob = tso.AdamW(b.parameters(), lr=0.01)
    ob.load_state_dict(copy.deepcopy(ta.state_dict()))  # torch would share the tensors
    for _ in range(3):
        x = torch.randn(4, 3)
        for m, o in ((a, ta), (b, ob)):
            o.zero_grad()
            m(x).sum().backward()
            o.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        _close(pa.detach(), pb.detach())
        assert float(ta.state[pa]["step"]) == float(ob.state[pb]["step"]) == 5.0


# ---------------------------------------------------------------------------
# modes and blocks active during the step
# ---------------------------------------------------------------------------

def test_a_dispatch_mode_sees_the_op_and_the_result_is_the_same():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Log(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(4, 3))
    q = nn.Parameter(p.detach().clone())
    o1, o2 = tso.AdamW([p], lr=0.1), torch.optim.AdamW([q], lr=0.1, foreach=False)
    for _ in range(3):
        g = torch.randn(4, 3)
        p.grad, q.grad = g.clone(), g.clone()
        log = Log()
        with log:
            o1.step()
        o2.step()
        assert any("adamw_step_" in op for op in log.ops)
    _close(p.detach(), q.detach())


@pytest.mark.parametrize("name", ["sgd_mom", "adamw"])
def test_a_step_inside_a_constant_block_raises_before_any_write(name):
    ts_cls, _, kw = CONFIGS[name]
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    opt = ts_cls(model.parameters(), **kw)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    model.zero_grad()
    model(torch.randn(2, 3)).sum().backward()
    params = list(model.parameters())
    before = _snapshot(opt, params)
    with pytest.raises(Exception):
        with ts.constant(model, "1"):
            opt.step()
    _same_snapshot(before, _snapshot(opt, params))


@pytest.mark.parametrize("name", ["sgd_mom", "adamw_ams"])
def test_a_step_inside_stop_gradient_equals_one_outside(name):
    ts_cls, _, kw = CONFIGS[name]
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    b = copy.deepcopy(a)
    oa, ob = ts_cls(a.parameters(), **kw), ts_cls(b.parameters(), **kw)
    for _ in range(2):
        x = torch.randn(5, 3)
        for m in (a, b):
            m.zero_grad()
            m(x).square().sum().backward()
        with ts.stop_gradient(a, "0"):
            oa.step()
        ob.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa.detach(), pb.detach())


def test_a_step_inside_swap_is_refused_and_changes_nothing():
    model = nn.Linear(3, 2)
    opt = tso.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 3)).sum().backward()
    params = list(model.parameters())
    before = _snapshot(opt, params)
    with ts.swap(model, {"weight": torch.zeros(2, 3)}):
        with pytest.raises(RuntimeError, match="swap"):
            opt.step()
    _same_snapshot(before, _snapshot(opt, params))


def test_a_torch_function_mode_that_hides_a_grad_is_obeyed():
    from torch.overrides import TorchFunctionMode

    class NoBiasGrad(TorchFunctionMode):
        def __init__(self, hidden):
            super().__init__()
            self.hidden = hidden

        def __torch_function__(self, func, types, args=(), kwargs=None):
            # (each attribute read makes a new method-wrapper: compared with ==, not is)
            if func == torch.Tensor.grad.__get__ and args[0] is self.hidden:
                return None
            return func(*args, **(kwargs or {}))

    lin = nn.Linear(3, 2)
    opt = tso.SGD(lin.parameters(), lr=0.1)
    lin(torch.randn(2, 3)).sum().backward()
    bias = lin.bias.detach().clone()
    with NoBiasGrad(lin.bias):
        opt.step()
    assert torch.equal(lin.bias.detach(), bias)


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_a_torch_function_mode_that_answers_grad_is_obeyed_as_torch_obeys_it(layout):
    from torch.overrides import TorchFunctionMode

    class Doubled(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func == torch.Tensor.grad.__get__ and out is not None:
                return out * 2
            return out

    results = []
    for make in (lambda ps: tso.SGD(ps, lr=1.0), lambda ps: tso.SGD(ps, lr=1.0),
                 lambda ps: torch.optim.SGD(ps, lr=1.0, foreach=False)):
        w = nn.Parameter(torch.zeros(2, 3))
        g = torch.ones(2, 3)
        w.grad = g if layout == "contiguous" else g.t().contiguous().t()
        opt = make([w])
        with Doubled():
            opt.step()
        results.append(w.detach().clone())
    assert torch.equal(results[2], torch.full((2, 3), -2.0))  # torch steps with the mode's
    assert torch.equal(results[0], results[2])


# ---------------------------------------------------------------------------
# ties, duplicates, groups edited by hand
# ---------------------------------------------------------------------------

def test_a_tied_parameter_across_groups_steps_once_with_its_first_group():
    w = nn.Parameter(torch.ones(3))
    other = nn.Parameter(torch.ones(2))
    opt = tso.SGD([{"params": [w], "lr": 0.5}, {"params": [other], "lr": 0.1}], lr=0.1)
    opt.param_groups[1]["params"].append(w)  # by hand: add_param_group refuses ties
    w.grad, other.grad = torch.ones(3), torch.ones(2)
    for backend in ("compiled", "reference"):
        with _ops.use_backend(backend):
            w.data.fill_(1.0)
            opt.step()
            assert torch.equal(w.detach(), torch.full((3,), 0.5)), backend


def test_a_tied_parameter_first_in_a_zero_scaled_group():
    """Stepped once, at its first place that is not skipped -- the same on both plans."""
    w = nn.Parameter(torch.ones(3))
    opt = tso.SGD([{"params": [w], "lr_scale": 0}], lr=0.5)
    opt.param_groups.append({**opt.defaults, "params": [w], "lr_scale": 1.0})
    w.grad = torch.ones(3)
    fast = opt._plan_fast()
    assert _outcome(lambda: fast) == _outcome(opt._plan_checked)
    opt.step()
    assert torch.equal(w.detach(), torch.full((3,), 0.5))


def test_two_parameters_on_one_memory_in_one_group_are_refused_unchanged():
    base = torch.randn(6)
    p, q = nn.Parameter(base), nn.Parameter(base)  # two Parameter objects, one memory
    opt = tso.AdamW([p, q], lr=0.1)
    p.grad, q.grad = torch.ones(6), torch.ones(6)
    before = base.clone()
    with pytest.raises(RuntimeError, match="shares its memory"):
        opt.step()
    assert torch.equal(base, before) and not opt.state


def test_groups_appended_and_removed_between_steps_match_torch():
    torch.manual_seed(0)
    ps = [nn.Parameter(torch.randn(3)) for _ in range(3)]
    qs = [nn.Parameter(p.detach().clone()) for p in ps]
    oa = tso.AdamW([ps[0]], lr=0.1)
    ob = torch.optim.AdamW([qs[0]], lr=0.1, foreach=False)
    for step in range(5):
        if step == 1:
            oa.add_param_group({"params": [ps[1]], "lr": 0.05})
            ob.add_param_group({"params": [qs[1]], "lr": 0.05})
        if step == 2:
            oa.add_param_group({"params": [ps[2]], "weight_decay": 0.5})
            ob.add_param_group({"params": [qs[2]], "weight_decay": 0.5})
        if step == 3:
            oa.param_groups.pop(1)
            ob.param_groups.pop(1)
        for p, q in zip(ps, qs):
            g = torch.randn(3)
            p.grad, q.grad = g.clone(), g.clone()
        if step == 4:  # torch.optim steps a frozen parameter with a .grad; ours does not
            ps[0].grad = qs[0].grad = None
            ps[2].requires_grad_(False)
            qs[2].grad = None
            frozen = ps[2].detach().clone()
        oa.step()
        ob.step()
        for p, q in zip(ps, qs):
            _close(p.detach(), q.detach())
    assert torch.equal(ps[2].detach(), frozen)


# ---------------------------------------------------------------------------
# real models
# ---------------------------------------------------------------------------

def _tiny_gpt2():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, n_positions=16,
                                     vocab_size=50, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.parametrize("name", ["adamw_ams", "sgd_nesterov"])
def test_a_tiny_gpt2_trains_as_with_torch(name):
    ts_cls, torch_cls, kw = CONFIGS[name]
    a = _tiny_gpt2()
    b = copy.deepcopy(a)
    assert a.lm_head.weight is a.transformer.wte.weight  # tied
    a.transformer.h[0].requires_grad_(False)
    b.transformer.h[0].requires_grad_(False)
    oa = ts_cls(a.parameters(), **kw)
    ob = _torch_opt(torch_cls, [p for p in b.parameters() if p.requires_grad], kw)
    ids = torch.randint(0, 50, (2, 8))
    for _ in range(3):
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            m(input_ids=ids, labels=ids).loss.backward()
            o.step()
    # (the attention's key bias has a gradient that is 0 up to rounding: Adam turns the
    # rounding differences of earlier steps into updates of up to lr, hence atol)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        _close(pa.detach(), pb.detach(), rtol=1e-4, atol=1e-4)
    assert not any(p in oa.state for p in a.transformer.h[0].parameters())


def test_a_peft_lora_model_trains_as_with_torch():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    peft = pytest.importorskip("peft")
    a = _tiny_gpt2()
    b = copy.deepcopy(a)
    cfg = dict(r=2, lora_alpha=4, target_modules=["c_attn"], lora_dropout=0.0,
               fan_in_fan_out=True, init_lora_weights=False)
    torch.manual_seed(1)
    a = peft.get_peft_model(a, peft.LoraConfig(**cfg))
    torch.manual_seed(1)
    b = peft.get_peft_model(b, peft.LoraConfig(**cfg))
    oa = tso.AdamW(a.parameters(), lr=0.01)
    ob = torch.optim.AdamW([p for p in b.parameters() if p.requires_grad], lr=0.01,
                           foreach=False)
    ids = torch.randint(0, 50, (2, 8))
    for _ in range(3):
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            m(input_ids=ids, labels=ids).loss.backward()
            o.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        _close(pa.detach(), pb.detach(), rtol=1e-4, atol=1e-5)
    assert len(oa.state) == sum(p.requires_grad for p in a.parameters())


# ---------------------------------------------------------------------------
# torch.compile (one small case)
# ---------------------------------------------------------------------------

def test_a_compiled_training_step_matches_eager_torch():
    torch._dynamo.reset()
    torch.manual_seed(0)
    a = nn.Linear(4, 3)
    b = copy.deepcopy(a)
    oa = tso.AdamW(a.parameters(), lr=0.01)
    ob = torch.optim.AdamW(b.parameters(), lr=0.01, foreach=False)

    @torch.compile(backend="eager")
    def train(x):
        oa.zero_grad()
        a(x).square().sum().backward()
        oa.step()

    for _ in range(3):
        x = torch.randn(5, 4)
        train(x)
        ob.zero_grad()
        b(x).square().sum().backward()
        ob.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        _close(pa.detach(), pb.detach())


# ---------------------------------------------------------------------------
# more corners: empty parameters, inference mode, lr_scale, clip, masks
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("make", [lambda: torch.randn(4, 3).t()[:0],
                                  lambda: torch.empty(0, 3).as_strided((0, 3), (1, 7)),
                                  lambda: torch.zeros(1, 3).expand(0, 3),
                                  lambda: torch.zeros(3, 1).expand(3, 0)])
@pytest.mark.parametrize("name", ["sgd_mom", "adamw_ams"])
def test_zero_element_parameters_of_odd_strides_step(make, name):
    ts_cls, _, kw = CONFIGS[name]
    a, p = nn.Parameter(torch.ones(2)), nn.Parameter(make())
    opt = ts_cls([{"params": [a]}, {"params": [p]}], **kw)
    a.grad, p.grad = torch.ones(2), torch.zeros(p.shape)
    for backend in ("compiled", "reference"):
        with _ops.use_backend(backend):
            opt.step()
    assert p.shape == make().shape and not torch.equal(a.detach(), torch.ones(2))
    assert opt.state[p] and all(v.shape in (p.shape, torch.Size([]))
                                for v in opt.state[p].values())


@pytest.mark.parametrize("name", ["sgd_mom", "adamw"])
def test_a_step_in_inference_mode_between_forward_and_backward_is_caught(backend, name):
    ts_cls, _, kw = CONFIGS[name]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = ts_cls(model.parameters(), **kw)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    loss = model(torch.randn(2, 3)).square().sum()  # saves model[2].weight
    with torch.inference_mode():
        opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("name", ["sgd_mom", "adamw_ams"])
def test_steps_inside_inference_mode_match_torch(name):
    ts_cls, torch_cls, kw = CONFIGS[name]
    torch.manual_seed(0)
    a = nn.Linear(3, 2)
    b = copy.deepcopy(a)
    oa, ob = ts_cls(a.parameters(), **kw), _torch_opt(torch_cls, b.parameters(), kw)
    for _ in range(3):
        x = torch.randn(4, 3)
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            m(x).square().sum().backward()
            with torch.inference_mode():
                o.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        _close(pa.detach(), pb.detach())


def test_a_string_lr_scale_is_refused_or_skips():
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    try:
        opt = tso.AdamW([{"params": [p], "lr_scale": "0"}], lr=0.1)
        opt.step()
    except (TypeError, ValueError):
        return
    assert p not in opt.state


def test_a_scheduler_with_lr_scale_matches_torch_with_scaled_lrs():
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    b = copy.deepcopy(a)
    oa = tso.AdamW([{"params": a[0].parameters(), "lr_scale": 0.25},
                    {"params": a[1].parameters()}], lr=0.04)
    ob = torch.optim.AdamW([{"params": b[0].parameters(), "lr": 0.01},
                            {"params": b[1].parameters(), "lr": 0.04}], lr=0.04, foreach=False)
    sa = torch.optim.lr_scheduler.StepLR(oa, step_size=1, gamma=0.5)
    sb = torch.optim.lr_scheduler.StepLR(ob, step_size=1, gamma=0.5)
    for _ in range(4):
        x = torch.randn(5, 3)
        for m, o, s in ((a, oa, sa), (b, ob, sb)):
            o.zero_grad()
            m(x).square().sum().backward()
            o.step()
            s.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        _close(pa.detach(), pb.detach())


@pytest.mark.parametrize("name", ["sgd_mom", "adamw"])
def test_clip_with_a_grad_scaler_matches_torch_unscale_then_clip(name):
    ts_cls, torch_cls, kw = CONFIGS[name]
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    b = copy.deepcopy(a)
    # the second layer's weight gets a transposed gradient layout on our side
    oa = ts_cls(a.parameters(), **kw, max_grad_norm=0.3)
    ob = _torch_opt(torch_cls, b.parameters(), kw)
    sa, sb = torch.amp.GradScaler("cpu", init_scale=128.0), torch.amp.GradScaler("cpu",
                                                                                  init_scale=128.0)
    for _ in range(3):
        x = torch.randn(6, 4)
        oa.zero_grad()
        sa.scale(a(x).square().mean()).backward()
        a[2].weight.grad = a[2].weight.grad.t().contiguous().t()
        sa.step(oa)
        sa.update()
        ob.zero_grad()
        sb.scale(b(x).square().mean()).backward()
        sb.unscale_(ob)
        norm = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.3)
        sb.step(ob)
        sb.update()
        _close(oa.last_grad_norm, norm)
    for pa, pb in zip(a.parameters(), b.parameters()):
        _close(pa.detach(), pb.detach())


def test_the_clip_norm_counts_only_stepped_gradients():
    w, frozen, zero, nograd = (nn.Parameter(torch.randn(3, 2)) for _ in range(4))
    opt = tso.SGD([{"params": [w, frozen, nograd]}, {"params": [zero], "lr_scale": 0}],
                  lr=0.1, max_grad_norm=1e9)
    for p in (w, frozen, zero):
        p.grad = torch.randn(2, 3).t()  # laid out unlike the parameters
    frozen.requires_grad_(False)
    opt.step()
    _close(opt.last_grad_norm, w.grad.norm())


@SETTINGS
@given(name=st.sampled_from(sorted(CONFIGS)), seed=st.integers(0, 2**16),
       p_kind=st.sampled_from(P_KINDS[:-1]), g_kind=st.sampled_from(G_KINDS),
       mask_kind=st.sampled_from(["contiguous", "transposed", "expanded"]))
def test_masked_out_elements_stay_bitwise_and_the_rest_match_the_reference(
        name, seed, p_kind, g_kind, mask_kind):
    ts_cls, _, kw = CONFIGS[name]
    out = {}
    for backend in ("compiled", "reference"):
        gen = torch.Generator().manual_seed(seed)
        p = nn.Parameter(_param_of(p_kind, torch.float32, gen))
        m = torch.rand(p.shape, generator=gen) > 0.5
        if mask_kind == "transposed" and p.dim() >= 2:
            m = m.transpose(0, 1).contiguous().transpose(0, 1)
        elif mask_kind == "expanded" and p.dim() >= 1:
            m = m.reshape(-1)[:1].reshape([1] * p.dim()).expand(p.shape)
        opt = ts_cls([p], **kw, masks={p: m})
        start = p.detach().clone()
        with _ops.use_backend(backend):
            for _ in range(2):
                p.grad = _grad_like(g_kind, p, gen)
                opt.step()
        assert torch.equal(p.detach()[~m], start[~m]), "a masked-out element changed"
        for k, v in opt.state[p].items():
            if k != "step":
                assert not v[~m].any(), f"masked-out {k} changed"
        out[backend] = p.detach().clone()
    _close(out["compiled"], out["reference"])


def test_torch_state_is_converted_into_a_channels_last_layout():
    torch.manual_seed(0)
    a = nn.Conv2d(3, 4, 3)
    b = copy.deepcopy(a).to(memory_format=torch.channels_last)
    ta = torch.optim.AdamW(a.parameters(), lr=0.01, amsgrad=True, foreach=False)
    x = torch.randn(2, 3, 6, 6)
    ta.zero_grad()
    a(x).square().sum().backward()
    ta.step()
    b.load_state_dict(a.state_dict())
    ob = tso.AdamW(b.parameters(), lr=0.01, amsgrad=True)
    ob.load_state_dict(copy.deepcopy(ta.state_dict()))
    for _ in range(2):
        x = torch.randn(2, 3, 6, 6)
        for m, o in ((a, ta), (b, ob)):
            o.zero_grad()
            m(x).square().sum().backward()
            o.step()
    assert b.weight.is_contiguous(memory_format=torch.channels_last)
    for pa, pb in zip(a.parameters(), b.parameters()):
        _close(pa.detach(), pb.detach())


@pytest.mark.parametrize("name", ["sgd_mom", "adamw"])
def test_a_model_moved_to_channels_last_after_some_steps_trains_on(name):
    ts_cls, torch_cls, kw = CONFIGS[name]
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(3, 27), nn.Unflatten(1, (3, 3, 3)), nn.Conv2d(3, 4, 2))
    b = copy.deepcopy(a)
    oa, ob = ts_cls(a.parameters(), **kw), _torch_opt(torch_cls, b.parameters(), kw)
    for i in range(4):
        if i == 2:
            a.to(memory_format=torch.channels_last)
            b.to(memory_format=torch.channels_last)
        x = torch.randn(2, 3)
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            m(x).square().sum().backward()
            o.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        _close(pa.detach(), pb.detach())


@pytest.mark.parametrize("name", ["sgd_mom", "adamw"])
def test_a_step_in_stop_gradient_with_gradients_read_in_python(name):
    """Gradients laid out unlike their parameters are read in Python, where the block's
    function mode is active: still the parameters' own gradients."""
    ts_cls, _, kw = CONFIGS[name]
    torch.manual_seed(0)
    a = nn.Linear(3, 2)
    b = copy.deepcopy(a)
    oa, ob = ts_cls(a.parameters(), **kw), ts_cls(b.parameters(), **kw)
    for _ in range(2):
        x = torch.randn(4, 3)
        for m in (a, b):
            m.zero_grad()
            m(x).sum().backward()
            m.weight.grad = m.weight.grad.t().contiguous().t()
        with ts.stop_gradient(a):
            oa.step()
        ob.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa.detach(), pb.detach())


@pytest.mark.parametrize("name", ["sgd_mom", "adamw"])
def test_unscale_clip_then_step_matches_torch(name):
    ts_cls, torch_cls, kw = CONFIGS[name]
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    b = copy.deepcopy(a)
    oa, ob = ts_cls(a.parameters(), **kw), _torch_opt(torch_cls, b.parameters(), kw)
    sa = torch.amp.GradScaler("cpu", init_scale=64.0)
    sb = torch.amp.GradScaler("cpu", init_scale=64.0)
    for i in range(4):
        x = torch.randn(6, 4)
        if i == 2:
            x[1, 1] = float("nan")
        for m, o, s in ((a, oa, sa), (b, ob, sb)):
            o.zero_grad()
            s.scale(m(x).square().mean()).backward()
            s.unscale_(o)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.2)
            s.step(o)
            s.update()
    for pa, pb in zip(a.parameters(), b.parameters()):
        _close(pa.detach(), pb.detach())


def test_a_skipped_amp_step_writes_nothing_and_bumps_nothing():
    lin = nn.Linear(3, 2)
    opt = tso.AdamW(lin.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    for bad in (False, True):
        opt.zero_grad()
        x = torch.randn(2, 3)
        if bad:
            x[0, 0] = float("inf")
        scaler.scale(lin(x).sum()).backward()
        params = list(lin.parameters())
        before = _snapshot(opt, params)
        versions = [p._version for p in params] + [v._version for p in params
                                                   for v in opt.state[p].values()] if bad else []
        scaler.step(opt)
        scaler.update()
    _same_snapshot(before, _snapshot(opt, params))
    assert versions == [p._version for p in params] + [v._version for p in params
                                                       for v in opt.state[p].values()]


# ---------------------------------------------------------------------------
# a drawn training run against torch.optim, edits between steps
# ---------------------------------------------------------------------------

RUN_EDITS = ("step", "step", "step", "grad_none", "freeze", "unfreeze", "lr", "lr_scale",
             "lr_scale_0", "zero_grad_keep", "grad_transposed", "amsgrad_on", "momentum")


@SETTINGS
@given(name=st.sampled_from(sorted(CONFIGS)),
       edits=st.lists(st.tuples(st.sampled_from(RUN_EDITS), st.integers(0, 5)),
                      min_size=1, max_size=12),
       seed=st.integers(0, 2**16))
def test_a_drawn_run_with_edits_matches_torch(name, edits, seed):
    ts_cls, torch_cls, kw = CONFIGS[name]
    gen = torch.Generator().manual_seed(seed)
    shapes = [(3, 4), (4, 3), (5,), ()]
    ps = [nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    qs = [nn.Parameter(p.detach().clone()) for p in ps]
    oa = ts_cls([{"params": ps[:2]}, {"params": ps[2:]}], **kw)
    ob = _torch_opt(torch_cls, [{"params": qs[:2]}, {"params": qs[2:]}], kw)
    scale = [1.0, 1.0]
    fresh = [True] * 4  # torch steps a frozen parameter's stale .grad: we drop it there
    for edit, k in edits:
        i, gi = k % 4, k % 2
        if edit == "step":
            for j, (p, q) in enumerate(zip(ps, qs)):
                if fresh[j] or p.grad is None:
                    g = torch.randn(p.shape, generator=gen)
                    if p.requires_grad:
                        p.grad, q.grad = g.clone(), g.clone()
                fresh[j] = True
            saved = {}
            for g_idx in range(2):
                ob.param_groups[g_idx]["lr"] = oa.param_groups[g_idx]["lr"] * scale[g_idx]
                if scale[g_idx] == 0:  # skipped by us; torch: no gradients this step
                    for q in ob.param_groups[g_idx]["params"]:
                        saved[q], q.grad = q.grad, None
            for q in qs:
                if not q.requires_grad:
                    saved.setdefault(q, q.grad)
                    q.grad = None
            oa.step()
            ob.step()
            for q, g in saved.items():
                q.grad = g
            for p, q in zip(ps, qs):
                _close(p.detach(), q.detach())
        elif edit == "grad_none":
            ps[i].grad = qs[i].grad = None
        elif edit == "freeze":
            ps[i].requires_grad_(False)
            qs[i].requires_grad_(False)
        elif edit == "unfreeze":
            ps[i].requires_grad_(True)
            qs[i].requires_grad_(True)
        elif edit == "lr":
            oa.param_groups[gi]["lr"] *= 0.5
        elif edit == "lr_scale":
            scale[gi] = 0.25 * (k + 1)
            oa.param_groups[gi]["lr_scale"] = scale[gi]
        elif edit == "lr_scale_0":
            scale[gi] = 0.0
            oa.param_groups[gi]["lr_scale"] = 0
        elif edit == "zero_grad_keep":
            oa.zero_grad(set_to_none=False)
            ob.zero_grad(set_to_none=False)
            fresh = [False] * 4
        elif edit == "grad_transposed" and ps[i].dim() == 2 and ps[i].grad is not None:
            ps[i].grad = ps[i].grad.t().contiguous().t()
            fresh[i] = False
        elif edit == "amsgrad_on" and "amsgrad" in oa.param_groups[gi] and not any(
                q in ob.state for q in ob.param_groups[gi]["params"]):
            oa.param_groups[gi]["amsgrad"] = ob.param_groups[gi]["amsgrad"] = True
        elif edit == "momentum" and "momentum" in oa.param_groups[gi]:
            oa.param_groups[gi]["momentum"] = ob.param_groups[gi]["momentum"] = 0.5
            oa.param_groups[gi]["nesterov"] = ob.param_groups[gi]["nesterov"] = False
    for p, q in zip(ps, qs):
        _close(p.detach(), q.detach())
        assert (p in oa.state) == (q in ob.state)


def test_inference_state_in_a_later_group_changes_nothing(backend):
    a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    opt = tso.AdamW([{"params": [a]}, {"params": [b]}], lr=0.1)
    b.grad = torch.ones(3)
    with torch.inference_mode():
        opt.step()  # b's state: inference tensors
    a.grad = torch.ones(3)
    before = _snapshot(opt, [a, b])
    with pytest.raises(RuntimeError, match="inference"):
        opt.step()
    _same_snapshot(before, _snapshot(opt, [a, b]))


def test_use_backend_blocks_in_two_threads_leave_the_backend_as_it_was():
    start = _ops.backend()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def first():
        with _ops.use_backend("reference"):
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def second():
        a_in.wait(10)
        with _ops.use_backend("fallback"):
            b_in.set()
            a_out.wait(10)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert _ops.backend() == start
    finally:
        _ops._backend = start  # leave the process as the other tests expect it


@pytest.mark.parametrize("name", ["sgd_mom", "adamw_ams"])
def test_torch_continues_from_our_state_dict(name):
    ts_cls, torch_cls, kw = CONFIGS[name]
    torch.manual_seed(0)
    a = nn.Sequential(nn.Conv2d(2, 3, 2), nn.Flatten(), nn.Linear(12, 2))
    a.to(memory_format=torch.channels_last)
    b = copy.deepcopy(a)
    oa = ts_cls(a.parameters(), **kw)
    data = [torch.randn(2, 2, 3, 3) for _ in range(4)]
    for x in data[:2]:
        oa.zero_grad()
        a(x).square().sum().backward()
        oa.step()
    b.load_state_dict(a.state_dict())
    ob = _torch_opt(torch_cls, b.parameters(), kw)
    sd = copy.deepcopy(oa.state_dict())
    sd.pop("masks")
    ob.load_state_dict(sd)
    for x in data[2:]:
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            m(x).square().sum().backward()
            o.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        _close(pa.detach(), pb.detach())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["sgd_nesterov", "adamw_ams"])
def test_low_precision_steps_agree_across_backends(dtype, name):
    ts_cls, _, kw = CONFIGS[name]
    out = {}
    for backend in ("compiled", "fallback", "reference"):
        gen = torch.Generator().manual_seed(0)
        ps = [nn.Parameter(torch.randn(5, 7, generator=gen).to(dtype)),
              nn.Parameter(torch.randn(7, 5, generator=gen).to(dtype).t()),
              nn.Parameter(torch.randn(3, generator=gen).double())]
        opt = ts_cls(ps, **kw, masks={ps[0]: torch.rand(5, 7, generator=gen) > 0.3})
        for _ in range(3):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
            with _ops.use_backend(backend):
                opt.step()
        out[backend] = [p.detach().clone() for p in ps]
    for backend in ("fallback", "reference"):
        for a, b in zip(out["compiled"], out[backend]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6 if a.dtype == torch.float64
                                       else (1e-2 if a.dtype == torch.bfloat16 else 1e-3))


# ---------------------------------------------------------------------------
# hooks, Lightning, reference counts
# ---------------------------------------------------------------------------

def test_step_hooks_run_around_the_fast_step():
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = tso.SGD([p], lr=0.1)
    calls = []

    def pre(o, args, kwargs):
        calls.append("pre")
        p.grad = p.grad * 10  # read by the plan after the hook

    opt.register_step_pre_hook(pre)
    opt.register_step_post_hook(lambda o, a, k: calls.append(("post", p.detach().clone())))
    opt.step()
    assert calls[0] == "pre" and calls[1][0] == "post"
    _close(calls[1][1], torch.zeros(3))


def test_lightning_bf16_mixed_with_clip_matches_torch_with_lightning_clip():
    L = pytest.importorskip("lightning")

    class Module(L.LightningModule):
        def __init__(self, net, make):
            super().__init__()
            self.net, self.make = net, make

        def training_step(self, batch, i):
            x, y = batch
            return (self.net(x) - y).square().mean()

        def configure_optimizers(self):
            return self.make(self.net.parameters())

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    out = []
    for make, clip in ((lambda ps: tso.AdamW(ps, lr=0.01, max_grad_norm=0.5), None),
                       (lambda ps: torch.optim.AdamW(ps, lr=0.01, foreach=False), 0.5)):
        module = Module(copy.deepcopy(net), make)
        trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, precision="bf16-mixed",
                            gradient_clip_val=clip)
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
        out.append([p.detach().clone() for p in module.net.parameters()])
    assert not all(torch.equal(a, b) for a, b in zip(out[0], [p.detach() for p in
                                                               net.parameters()]))
    for a, b in zip(*out):
        _close(a, b)


def test_reference_counts_are_stable_over_steps_declines_and_refusals():
    import gc
    import sys

    class Marked(torch.Tensor):
        pass

    ps = [nn.Parameter(torch.randn(3, 4)) for _ in range(3)]
    ps[1].data = ps[1].data.t().contiguous().t()
    sub = torch.randn(2).as_subclass(Marked).requires_grad_()
    for cls, kw in ((tso.AdamW, dict(amsgrad=True)), (tso.SGD, dict(momentum=0.9))):
        opt = cls([{"params": ps[:2]}, {"params": ps[2:], "lr_scale": 0.5}], lr=0.1, **kw)
        for p in ps:
            p.grad = torch.randn(3, 4)
        ps[0].grad = ps[0].grad.t().contiguous().t()  # read in Python
        opt.step()
        opt.step()

        def objects():
            return (ps + [p.grad for p in ps] + [v for p in ps for v in opt.state[p].values()]
                    + opt.param_groups + [g["params"] for g in opt.param_groups] + [sub])

        gc.collect()
        before = [sys.getrefcount(x) for x in objects()]
        for _ in range(50):
            opt.step()
        opt.param_groups[1]["params"].append(sub)  # the C++ plan declines
        sub.grad = torch.ones(2)
        for _ in range(20):
            opt.step()
        opt.param_groups[1]["params"].pop()
        assert sub in opt.state  # stepped by the checked plan
        del opt.state[sub]
        state = opt.state[ps[2]]
        key = "exp_avg" if "exp_avg" in state else "momentum_buffer"
        good, state[key] = state[key], torch.zeros(5)  # the kernel refuses
        for _ in range(20):
            with pytest.raises(RuntimeError):
                opt.step()
        state[key] = good
        del good, state
        gc.collect()
        assert [sys.getrefcount(x) for x in objects()] == before


@pytest.mark.parametrize("name", ["sgd_mom", "adamw"])
def test_a_constant_block_on_a_later_group_refuses_the_whole_step(name):
    ts_cls, _, kw = CONFIGS[name]
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    opt = ts_cls([{"params": model[0].parameters()}, {"params": model[1].parameters()}], **kw)
    model(torch.randn(2, 3)).sum().backward()
    params = list(model.parameters())
    before = _snapshot(opt, params)
    with ts.constant(model, "1"):
        with pytest.raises(RuntimeError, match="1.weight"):
            opt.step()
    _same_snapshot(before, _snapshot(opt, params))


@pytest.mark.parametrize("norm_type", [1.0, 0.5, 3.0, float("inf")])
def test_the_folded_clip_matches_torch_for_any_norm_and_layout(norm_type):
    torch.manual_seed(0)
    a = nn.Sequential(nn.Conv2d(2, 3, 2), nn.Flatten(), nn.Linear(12, 2))
    a.to(memory_format=torch.channels_last)
    b = copy.deepcopy(a)
    oa = tso.SGD(a.parameters(), lr=0.1, momentum=0.9, max_grad_norm=0.1, norm_type=norm_type)
    ob = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9, foreach=False)
    for _ in range(3):
        x = torch.randn(2, 2, 3, 3)
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            m(x).square().sum().backward()
        a[2].weight.grad = a[2].weight.grad.t().contiguous().t()
        a[0].weight.grad = a[0].weight.grad.contiguous()  # unlike the channels_last weight
        oa.step()
        norm = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.1, norm_type=norm_type)
        ob.step()
        _close(oa.last_grad_norm, norm)
    for pa, pb in zip(a.parameters(), b.parameters()):
        _close(pa.detach(), pb.detach())


@pytest.mark.parametrize("name", ["sgd_mom", "adamw_ams"])
def test_meta_parameters_take_the_checked_path_and_step(name):
    ts_cls, _, kw = CONFIGS[name]
    p = nn.Parameter(torch.empty(3, 4, device="meta"))
    q = nn.Parameter(torch.ones(2))
    p.grad, q.grad = torch.empty(3, 4, device="meta"), torch.ones(2)
    opt = ts_cls([{"params": [q]}, {"params": [p]}], **kw)
    assert opt._plan_fast() is None
    opt.step()
    assert all(v.device.type == "meta" for v in opt.state[p].values())
    assert not torch.equal(q.detach(), torch.ones(2))


def test_parameters_overlapping_through_foreign_memory_are_refused_unchanged():
    """Two storages on the same bytes (numpy views, a dtype view): found by address."""
    np = pytest.importorskip("numpy")
    buf = np.zeros(10, dtype=np.float32)
    base = torch.zeros(8)
    cases = [(torch.from_numpy(buf[0:6]), torch.from_numpy(buf[4:10])),
             (base[:4], base.view(torch.float16)[6:10])]
    for x, y in cases:
        p, q = nn.Parameter(x), nn.Parameter(y)
        p.grad, q.grad = torch.ones_like(p), torch.ones_like(q)
        opt = tso.SGD([p, q], lr=0.1)
        assert opt._plan_fast() is None
        before = [p.detach().clone(), q.detach().clone()]
        with pytest.raises(RuntimeError, match="shares its memory"):
            opt.step()
        assert torch.equal(p.detach(), before[0]) and torch.equal(q.detach(), before[1])


@pytest.mark.parametrize("name", ["sgd_mom", "adamw"])
def test_loaded_state_of_another_shape_is_never_broadcast(name):
    ts_cls, _, kw = CONFIGS[name]
    p = nn.Parameter(torch.ones(4))
    p.grad = torch.arange(4.0)
    opt = ts_cls([p], **kw)
    opt.step()
    resumed = ts_cls([p], **kw)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))  # shapes match here
    p.data = torch.ones(3, 4)  # the model changes after loading
    p.grad = torch.ones(3, 4)
    try:
        resumed.step()
    except RuntimeError:
        return
    raise AssertionError(f"state of shape (4,) taken as {tuple(p.shape)}: "
                         f"{ {k: tuple(v.shape) for k, v in resumed.state[p].items()} }")


def test_state_assigned_by_hand_is_never_broadcast():
    p = nn.Parameter(torch.ones(3, 4))
    p.grad = torch.ones(3, 4)
    opt = tso.SGD([p], lr=0.1, momentum=0.9)
    opt.state[p] = {"momentum_buffer": torch.arange(4.0)}
    try:
        opt.step()
    except RuntimeError:
        return
    raise AssertionError("a momentum buffer of shape (4,) was broadcast to (3, 4)")


@pytest.mark.parametrize("name", ["sgd_mom", "adamw"])
def test_a_compiled_step_between_forward_and_backward_is_caught(name):
    ts_cls, _, kw = CONFIGS[name]
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = ts_cls(model.parameters(), **kw)
    step = torch.compile(opt.step, backend="aot_eager")
    model(torch.randn(2, 3)).sum().backward()
    step()
    loss = model(torch.randn(2, 3)).square().sum()
    step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_gpt2_with_masked_embedding_rows_agrees_across_backends():
    out = {}
    for backend in ("compiled", "reference"):
        model = _tiny_gpt2()
        wte = model.transformer.wte.weight
        mask = torch.zeros_like(wte, dtype=torch.bool)
        mask[40:] = True  # train only the "new" rows of the tied embedding
        start = wte.detach().clone()
        opt = tso.AdamW(ts.param_groups(model), lr=0.01, masks={wte: mask})
        ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
        for _ in range(2):
            opt.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
            with _ops.use_backend(backend):
                opt.step()
        assert torch.equal(wte.detach()[:40], start[:40])
        assert not torch.equal(wte.detach()[40:], start[40:])
        assert not opt.state[wte]["exp_avg"][:40].any()
        out[backend] = [p.detach().clone() for p in model.parameters()]
    for a, b in zip(out["compiled"], out["reference"]):
        _close(a, b, rtol=1e-4, atol=1e-4)  # the key bias: rounding noise, see above


@pytest.mark.parametrize("name", ["sgd_nesterov", "adamw_ams"])
def test_gradients_with_a_graph_from_create_graph_step_as_torch(name):
    ts_cls, torch_cls, kw = CONFIGS[name]
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    b = copy.deepcopy(a)
    oa, ob = ts_cls(a.parameters(), **kw), _torch_opt(torch_cls, b.parameters(), kw)
    for _ in range(2):
        x = torch.randn(5, 3)
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            m(x).square().sum().backward(create_graph=True)
        assert a[0].weight.grad.requires_grad
        a[2].weight.grad = a[2].weight.grad.t().contiguous().t()  # read in Python, copied
        oa.step()
        ob.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert not pa.grad_fn and pa.is_leaf
        _close(pa.detach(), pb.detach())
