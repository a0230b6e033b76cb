"""torchstruct.optim.SGD / AdamW: against torch.optim (foreach=False), the frozen and
mask rules, the folded-in clip, GradScaler, state_dict, schedulers, errors; the
fused ops against their reference."""
import copy

import pytest
import torch
from torch import nn

import torchstruct.optim as tso
from torchstruct import _ops

STEPS = 100


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


class Net(nn.Module):
    """Several parameter shapes: an embedding, matrices, vectors, a LayerNorm."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(12, 6)
        self.fc1 = nn.Linear(6, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 5)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, idx):
        h = self.emb(idx).mean(1)
        h = torch.tanh(self.norm(self.fc1(h)))
        return self.fc2(h) * self.scale


def make_net(seed=0):
    torch.manual_seed(seed)
    return Net()


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, 12, (8, 3), generator=g)
    target = torch.randn(8, 5, generator=g)
    return idx, target


def loss_of(model, step):
    idx, target = batch(step)
    return ((model(idx) - target) ** 2).mean()


def groups(model, lr=1e-2, **first):
    """Two param groups with different lr / weight decay."""
    a = [model.emb.weight, model.fc1.weight, model.fc1.bias, model.scale]
    b = [model.norm.weight, model.norm.bias, model.fc2.weight, model.fc2.bias]
    return [dict(params=a, **first), dict(params=b, lr=lr * 3, weight_decay=0.05)]


def train(model, opt, steps=STEPS, start=0, before_step=None, scheduler=None, sign=1.0):
    """``steps`` steps on ``sign * loss`` (sign -1 with maximize: a bounded problem)."""
    for k in range(start, start + steps):
        opt.zero_grad()
        (sign * loss_of(model, k)).backward()
        if before_step is not None:
            before_step(model, k)
        opt.step()
        if scheduler is not None:
            scheduler.step()


def assert_rel(actual, expected, tol=1e-6, what=""):
    """max |a - e| <= tol * max |e| (per tensor)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    scale = expected.abs().max().clamp_min(1e-30)
    err = ((actual - expected).abs().max() / scale).item()
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


def assert_models_close(a, b, tol=1e-6):
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert_rel(pa, pb, tol, name)


def snapshot(model, opt):
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = copy.deepcopy(opt.state_dict())
    return params, state


def assert_unchanged(model, opt, snap):
    params, state = snap
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), params[n]), f"{n} changed"
    now = opt.state_dict()
    assert now["state"].keys() == state["state"].keys()
    for k, entry in state["state"].items():
        for key, value in entry.items():
            if key == "torchstruct_mask":  # a copy of the mask, not state
                continue
            assert torch.equal(torch.as_tensor(now["state"][k][key]), torch.as_tensor(value)), (k, key)


# ---------------------------------------------------------------------------
# against torch.optim
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
def test_adamw_matches_torch(backend, amsgrad, maximize):
    # torch's x86 CPU sqrt (MKL) is off by one ulp for some inputs where ours is
    # IEEE; a moderate lr keeps the training from amplifying that past 1e-6.
    ref, net = make_net(), make_net()
    kw = dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.1, amsgrad=amsgrad,
              maximize=maximize)
    torch_opt = torch.optim.AdamW(groups(ref, 3e-3), foreach=False, **kw)
    ts_opt = tso.AdamW(groups(net, 3e-3), **kw)
    train(ref, torch_opt, sign=-1.0 if maximize else 1.0)
    train(net, ts_opt, sign=-1.0 if maximize else 1.0)
    assert_models_close(net, ref)
    for p, q in zip(net.parameters(), ref.parameters()):
        s, t = ts_opt.state[p], torch_opt.state[q]
        assert float(s["step"]) == float(t["step"]) == STEPS
        assert_rel(s["exp_avg"], t["exp_avg"], 1e-5, "exp_avg")
        assert_rel(s["exp_avg_sq"], t["exp_avg_sq"], 1e-5, "exp_avg_sq")


def test_adamw_large_beta1_weight(backend):
    """beta1 <= 0.5: lerp's other formula."""
    ref, net = make_net(), make_net()
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.3, 0.9), foreach=False)
    ts_opt = tso.AdamW(net.parameters(), lr=1e-2, betas=(0.3, 0.9))
    train(ref, torch_opt, 30)
    train(net, ts_opt, 30)
    assert_models_close(net, ref)


@pytest.mark.parametrize(
    "momentum, dampening, nesterov, maximize",
    [(0.0, 0.0, False, False), (0.9, 0.0, False, False), (0.9, 0.2, False, False),
     (0.9, 0.0, True, False), (0.5, 0.0, True, True), (0.9, 0.1, False, True)],
)
def test_sgd_matches_torch(backend, momentum, dampening, nesterov, maximize):
    ref, net = make_net(), make_net()
    kw = dict(lr=5e-2, momentum=momentum, dampening=dampening, weight_decay=0.01,
              nesterov=nesterov, maximize=maximize)
    torch_opt = torch.optim.SGD(groups(ref), foreach=False, **kw)
    ts_opt = tso.SGD(groups(net), **kw)
    train(ref, torch_opt, sign=-1.0 if maximize else 1.0)
    train(net, ts_opt, sign=-1.0 if maximize else 1.0)
    assert_models_close(net, ref)
    if momentum:
        for p, q in zip(net.parameters(), ref.parameters()):
            assert_rel(ts_opt.state[p]["momentum_buffer"], torch_opt.state[q]["momentum_buffer"],
                       1e-5, "momentum_buffer")
    else:
        assert len(ts_opt.state) == 0  # as torch: no state without momentum


def test_lr_scheduler(backend):
    ref, net = make_net(), make_net()
    torch_opt = torch.optim.AdamW(groups(ref), lr=1e-2, foreach=False)
    ts_opt = tso.AdamW(groups(net), lr=1e-2)
    s1 = torch.optim.lr_scheduler.StepLR(torch_opt, step_size=10, gamma=0.5)
    s2 = torch.optim.lr_scheduler.StepLR(ts_opt, step_size=10, gamma=0.5)
    train(ref, torch_opt, scheduler=s1)
    train(net, ts_opt, scheduler=s2)
    assert ts_opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5 ** 10)
    assert_models_close(net, ref)


def test_add_param_group_and_zero_grad(backend):
    ref, net = make_net(), make_net()
    torch_opt = torch.optim.SGD([ref.fc1.weight], lr=0.1, momentum=0.9, foreach=False)
    ts_opt = tso.SGD([net.fc1.weight], lr=0.1, momentum=0.9)
    train(ref, torch_opt, 5)
    train(net, ts_opt, 5)
    torch_opt.add_param_group({"params": [ref.fc2.weight], "lr": 0.05})
    ts_opt.add_param_group({"params": [net.fc2.weight], "lr": 0.05})
    train(ref, torch_opt, 10, start=5)
    train(net, ts_opt, 10, start=5)
    assert_models_close(net, ref)
    ts_opt.zero_grad()
    assert net.fc1.weight.grad is None and net.fc2.weight.grad is None


# ---------------------------------------------------------------------------
# frozen parameters and masks
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("make_opt", [
    lambda ps: tso.AdamW(ps, lr=1e-2, weight_decay=0.5),
    lambda ps: tso.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.5),
], ids=["adamw", "sgd"])
def test_frozen_parameters_untouched(backend, make_opt):
    net = make_net()
    opt = make_opt(net.parameters())
    frozen = [net.emb.weight, net.fc1.bias]
    for p in frozen:
        p.grad = torch.randn_like(p)  # stale gradient
        p.requires_grad_(False)
    before = [p.detach().clone() for p in frozen]
    train(net, opt, 5)
    for p, b in zip(frozen, before):
        p.grad = torch.randn_like(p)  # a stale gradient must not matter either
    opt.step()
    for p, b in zip(frozen, before):
        assert torch.equal(p.detach(), b)
        assert p not in opt.state
    assert net.fc1.weight in opt.state or isinstance(opt, tso.SGD)


def test_frozen_mid_training_keeps_state_as_is(backend):
    net = make_net()
    opt = tso.AdamW(net.parameters(), lr=1e-2, weight_decay=0.5)
    train(net, opt, 3)
    p = net.fc2.weight
    state = {k: v.clone() for k, v in opt.state[p].items()}
    value = p.detach().clone()
    p.requires_grad_(False)
    p.grad = torch.ones_like(p)
    train(net, opt, 3, start=3)
    assert torch.equal(p.detach(), value)
    for k, v in state.items():
        assert torch.equal(opt.state[p][k], v)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_masks_adamw(backend, amsgrad):
    """Train only the new embedding rows: the old rows (and their moments) keep
    their bits, with weight decay and a gradient on every row."""
    net = make_net()
    mask = torch.zeros_like(net.emb.weight, dtype=torch.bool)
    mask[9:] = True
    opt = tso.AdamW(net.parameters(), lr=1e-2, weight_decay=0.3, amsgrad=amsgrad,
                    masks={net.emb.weight: mask})
    old = net.emb.weight.detach().clone()
    train(net, opt, 20)
    w = net.emb.weight.detach()
    assert torch.equal(w[:9], old[:9])
    assert not torch.equal(w[9:], old[9:])
    state = opt.state[net.emb.weight]
    for key in ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else []):
        assert torch.equal(state[key][:9], torch.zeros_like(state[key][:9])), key
        assert state[key][9:].abs().sum() > 0


def test_masks_sgd(backend):
    net = make_net()
    mask = torch.rand(net.fc1.weight.shape, generator=torch.Generator().manual_seed(3)) < 0.5
    opt = tso.SGD(net.parameters(), lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=0.3,
                  masks={net.fc1.weight: mask})
    old = net.fc1.weight.detach().clone()
    train(net, opt, 10)
    w = net.fc1.weight.detach()
    assert torch.equal(w[~mask], old[~mask])
    assert (w[mask] != old[mask]).all()
    buf = opt.state[net.fc1.weight]["momentum_buffer"]
    assert torch.equal(buf[~mask], torch.zeros_like(buf[~mask]))


@pytest.mark.parametrize("cls", [tso.AdamW, tso.SGD])
def test_all_true_mask_is_no_mask(backend, cls):
    a, b = make_net(), make_net()
    kw = dict(lr=1e-2, weight_decay=0.1) if cls is tso.AdamW else dict(lr=1e-2, momentum=0.9)
    oa = cls(a.parameters(), **kw)
    ob = cls(b.parameters(), masks={p: torch.ones_like(p, dtype=torch.bool)
                                    for p in b.parameters()}, **kw)
    train(a, oa, 10)
    train(b, ob, 10)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_set_mask(backend):
    net = make_net()
    opt = tso.AdamW(net.parameters(), lr=1e-2)
    opt.set_mask(net.fc2.bias, torch.tensor([True, False, True, False, True]))
    old = net.fc2.bias.detach().clone()
    train(net, opt, 3)
    assert torch.equal(net.fc2.bias.detach()[1::2], old[1::2])
    opt.set_mask(net.fc2.bias, None)
    train(net, opt, 1, start=3)
    assert (net.fc2.bias.detach()[1::2] != old[1::2]).all()


def test_tied_and_duplicate_parameters_step_once(backend):
    shared = nn.Parameter(torch.randn(4, 4))
    ref = shared.detach().clone().requires_grad_()
    with pytest.warns(UserWarning):  # torch warns about the duplicate
        opt = tso.AdamW([shared, shared], lr=0.1)
    torch_opt = torch.optim.AdamW([ref], lr=0.1, foreach=False)
    for _ in range(3):
        shared.grad = torch.ones(4, 4)
        ref.grad = torch.ones(4, 4)
        opt.step()
        torch_opt.step()
    assert torch.equal(shared.detach(), ref.detach())
    assert float(opt.state[shared]["step"]) == 3


# ---------------------------------------------------------------------------
# state_dict
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("cls, kw", [
    (tso.AdamW, dict(lr=1e-2, amsgrad=True)),
    (tso.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True)),
])
def test_state_dict_round_trip(backend, cls, kw):
    full = make_net()
    opt_full = cls(groups(full), **kw)
    train(full, opt_full, 60)

    first = make_net()
    opt_first = cls(groups(first), **kw)
    train(first, opt_first, 30)
    saved_model = copy.deepcopy(first.state_dict())
    saved_opt = copy.deepcopy(opt_first.state_dict())

    resumed = make_net(seed=7)
    resumed.load_state_dict(saved_model)
    opt_resumed = cls(groups(resumed), **kw)
    opt_resumed.load_state_dict(saved_opt)
    train(resumed, opt_resumed, 30, start=30)
    for p, q in zip(resumed.parameters(), full.parameters()):
        assert torch.equal(p, q)


def test_state_dict_interchangeable_with_torch(backend):
    """A torch.optim.AdamW checkpoint (CPU step tensors) continues in ts.optim.AdamW."""
    ref, net = make_net(), make_net()
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    train(ref, torch_opt, 10)
    net.load_state_dict(ref.state_dict())
    ts_opt = tso.AdamW(net.parameters(), lr=1e-2)
    ts_opt.load_state_dict(copy.deepcopy(torch_opt.state_dict()))  # else they share tensors
    train(ref, torch_opt, 10, start=10)
    train(net, ts_opt, 10, start=10)
    assert_models_close(net, ref)


# ---------------------------------------------------------------------------
# max_grad_norm
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_max_grad_norm_equals_clip_then_step(backend, norm_type):
    ref, net = make_net(), make_net()
    torch_opt = torch.optim.AdamW(groups(ref), lr=1e-2, weight_decay=0.1, foreach=False)
    ts_opt = tso.AdamW(groups(net), lr=1e-2, weight_decay=0.1, max_grad_norm=0.05,
                       norm_type=norm_type)
    norms = []

    def clip(model, k):
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, norm_type))

    train(ref, torch_opt, 50, before_step=clip)
    for k in range(50):
        ts_opt.zero_grad()
        loss_of(net, k).backward()
        grads = [p.grad.clone() for p in net.parameters()]
        ts_opt.step()
        for p, g in zip(net.parameters(), grads):
            assert torch.equal(p.grad, g)  # gradients are read, never written
        assert_rel(ts_opt.last_grad_norm, norms[k], 1e-5, "norm")
    assert_models_close(net, ref, 1e-5)


def test_max_grad_norm_sgd_skips_frozen(backend):
    ref, net = make_net(), make_net()
    for model in (ref, net):
        model.fc1.weight.requires_grad_(False)
    torch_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, foreach=False)
    ts_opt = tso.SGD(net.parameters(), lr=0.1, momentum=0.9, max_grad_norm=0.1)

    def clip(model, k):
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 0.1)

    def stale(model, k):
        model.fc1.weight.grad = torch.full_like(model.fc1.weight, 1e3)

    train(ref, torch_opt, 20, before_step=clip)
    train(net, ts_opt, 20, before_step=stale)  # a huge stale grad on the frozen weight
    assert_models_close(net, ref, 1e-5)


# ---------------------------------------------------------------------------
# GradScaler
# ---------------------------------------------------------------------------


def _grad_scaler():
    try:
        return torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=3)
    except Exception as e:  # pragma: no cover - torch without CPU GradScaler
        pytest.skip(f"torch.amp.GradScaler('cpu') unavailable: {e}")


@pytest.mark.parametrize("cls, kw", [
    (tso.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (tso.SGD, dict(lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=0.1)),
])
def test_grad_scaler_with_injected_inf(backend, cls, kw):
    ref, net = make_net(), make_net()
    torch_cls = getattr(torch.optim, cls.__name__)
    torch_opt = torch_cls(ref.parameters(), foreach=False, **kw)
    ts_opt = cls(net.parameters(), **kw)
    s_ref, s_net = _grad_scaler(), _grad_scaler()
    inf_steps = {0, 4, 5, 11}
    for model, opt, scaler in ((ref, torch_opt, s_ref), (net, ts_opt, s_net)):
        for k in range(20):
            opt.zero_grad()
            scaler.scale(loss_of(model, k)).backward()
            if k in inf_steps:
                model.fc2.weight.grad[0, 0] = float("inf")
            if model is net and k in inf_steps:
                snap = snapshot(net, ts_opt)
            scaler.step(opt)
            scaler.update()
            if model is net and k in inf_steps:
                assert_unchanged(net, ts_opt, snap)
    assert s_ref.get_scale() == s_net.get_scale()
    assert_models_close(net, ref)
    for p, q in zip(net.parameters(), ref.parameters()):
        if cls is tso.AdamW:
            assert float(ts_opt.state[p]["step"]) == float(torch_opt.state[q]["step"]) == 16


def test_grad_scaler_with_unscale_and_max_grad_norm(backend):
    """unscale_ before step (grad_scale then None), with the folded-in clip."""
    ref, net = make_net(), make_net()
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    ts_opt = tso.AdamW(net.parameters(), lr=1e-2, max_grad_norm=0.05)
    s_ref, s_net = _grad_scaler(), _grad_scaler()
    for k in range(10):
        torch_opt.zero_grad()
        s_ref.scale(loss_of(ref, k)).backward()
        s_ref.unscale_(torch_opt)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        s_ref.step(torch_opt)
        s_ref.update()
        ts_opt.zero_grad()
        s_net.scale(loss_of(net, k)).backward()
        if k % 2:
            s_net.unscale_(ts_opt)  # either way: the clip sees unscaled gradients
        s_net.step(ts_opt)
        s_net.update()
    assert_models_close(net, ref, 1e-5)


# ---------------------------------------------------------------------------
# errors: clear, and nothing changes
# ---------------------------------------------------------------------------


def _trained():
    net = make_net()
    opt = tso.AdamW(groups(net), lr=1e-2)
    train(net, opt, 2)
    loss_of(net, 2).backward()
    return net, opt


@pytest.mark.parametrize("bad, message", [
    (lambda p: torch.ones(3, dtype=torch.bool), "shape"),
    (lambda p: torch.ones(p.shape), "dtype"),
    (lambda p: torch.ones(p.shape, dtype=torch.bool, device="meta"), "meta"),
    (lambda p: [[True]], "not a bool tensor"),
])
def test_bad_mask(backend, bad, message):
    net = make_net()
    with pytest.raises(ValueError, match=message) as info:
        tso.AdamW(net.parameters(), masks={net.fc1.weight: bad(net.fc1.weight)})
    assert "(16, 6)" in str(info.value)  # names the parameter
    net, opt = _trained()
    with pytest.raises(ValueError, match=message):
        opt.set_mask(net.fc1.weight, bad(net.fc1.weight))
    # a mask made bad after construction is caught at step time, before any write
    opt.masks[net.fc2.weight] = bad(net.fc2.weight)
    snap = snapshot(net, opt)
    with pytest.raises(ValueError, match=message):
        opt.step()
    assert_unchanged(net, opt, snap)


def test_named_parameter_in_message(backend):
    net = make_net()
    opt = tso.AdamW(net.named_parameters()) if _named_groups_supported() else None
    if opt is None:
        pytest.skip("this torch has no named parameters in optimizers")
    with pytest.raises(ValueError, match="fc1.weight"):
        opt.set_mask(net.fc1.weight, torch.ones(2, dtype=torch.bool))


def _named_groups_supported():
    try:
        torch.optim.SGD([("w", nn.Parameter(torch.ones(1)))], lr=0.1)
        return True
    except Exception:
        return False


def test_mask_for_foreign_tensor(backend):
    net = make_net()
    with pytest.raises(ValueError, match="not a parameter of this optimizer"):
        tso.AdamW(net.fc1.parameters(), masks={net.fc2.weight: torch.ones(5, 16, dtype=torch.bool)})


@pytest.mark.parametrize("cls", [tso.AdamW, tso.SGD])
def test_negative_lr_and_max_grad_norm(backend, cls):
    net = make_net()
    with pytest.raises(ValueError, match="lr"):
        cls(net.parameters(), lr=-1.0)
    with pytest.raises(ValueError, match="max_grad_norm"):
        cls(net.parameters(), lr=0.1, max_grad_norm=-1.0)
    opt = cls(groups(net), lr=0.1)
    train(net, opt, 2)
    loss_of(net, 2).backward()
    opt.param_groups[1]["lr"] = -0.5  # the second group: the first must not move either
    snap = snapshot(net, opt)
    with pytest.raises(ValueError, match="param group 1: lr"):
        opt.step()
    assert_unchanged(net, opt, snap)


def test_bad_hyper_parameters(backend):
    net = make_net()
    with pytest.raises(ValueError, match="betas"):
        tso.AdamW(net.parameters(), betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="Nesterov"):
        tso.SGD(net.parameters(), lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="norm_type"):
        tso.AdamW(net.parameters(), max_grad_norm=1.0, norm_type=0)


def test_sparse_gradient(backend):
    net, opt = _trained()
    net.fc2.weight.grad = net.fc2.weight.grad.to_sparse()  # in the second group
    snap = snapshot(net, opt)
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert_unchanged(net, opt, snap)


def test_device_without_kernel(monkeypatch):
    """A device without compiled kernels (simulated for cpu) steps on PyTorch's fused ops:
    one warning, and the compiled kernels' result."""
    if not _ops.compiled_available():
        pytest.skip("the compiled extension is not built")
    net, opt = _trained()
    twin_net, twin_opt = _trained()
    kernels = dict(_ops._KERNELS)
    kernels["adamw_step_"] = frozenset()  # as if the build had no kernel for this device
    monkeypatch.setattr(_ops, "_KERNELS", kernels)
    monkeypatch.setattr(_ops, "_warned", set())
    with _ops.use_backend("compiled"):
        with pytest.warns(RuntimeWarning, match="no compiled kernels for cpu"):
            opt.step()
    with _ops.use_backend("compiled"):
        monkeypatch.setattr(_ops, "_KERNELS", dict(kernels, adamw_step_=frozenset({"cpu"})))
        twin_opt.step()
    assert_models_close(net, twin_net)


# ---------------------------------------------------------------------------
# the ops: compiled against reference
# ---------------------------------------------------------------------------


def _op_inputs(dtype, seed=0, amsgrad=False, masked=True):
    g = torch.Generator().manual_seed(seed)
    shapes = [(33, 7), (1,), (70000,), (3, 0)]  # 70000 spans two work chunks
    ps = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    gs = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    ms = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    vs = [torch.rand(s, generator=g).to(dtype) for s in shapes]
    vm = [v + torch.rand(v.shape, generator=g).to(dtype) * 0.1 for v in vs] if amsgrad else []
    steps = [torch.tensor(float(k + 1)) for k in range(len(shapes))]
    masks = ([torch.rand(s, generator=g) < 0.7 for s in shapes[:-1]] + [None]) if masked else []
    return ps, gs, ms, vs, vm, steps, masks


def _clone(xs):
    return [None if x is None else x.clone() for x in xs]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_adamw_op_compiled_matches_reference(dtype, amsgrad):
    if not _ops.compiled_available():
        pytest.skip("the compiled extension is not built")
    ps, gs, ms, vs, vm, steps, masks = _op_inputs(dtype, amsgrad=amsgrad)
    out = {}
    for name in ("compiled", "reference"):
        args = [_clone(x) for x in (ps, gs, ms, vs, vm, steps)]
        with _ops.use_backend(name):
            _ops.adamw_step_(*args, masks, lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.1,
                             eps=1e-8, amsgrad=amsgrad, maximize=True,
                             clip_coef=torch.tensor(0.7), grad_scale=torch.tensor(1024.0))
        out[name] = args
    ulp = {torch.float32: 1e-6, torch.float64: 1e-12, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    for a_list, b_list in zip(out["compiled"], out["reference"]):
        for a, b in zip(a_list, b_list):
            if a.numel():
                torch.testing.assert_close(a, b, rtol=ulp, atol=ulp)
    # gradients untouched, masked-out elements kept
    for p0, p1, m in zip(ps, out["compiled"][0], masks):
        if m is not None and p0.numel():
            assert torch.equal(p1[~m], p0[~m])
    assert [float(s) for s in out["compiled"][5]] == [2.0, 3.0, 4.0, 5.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("first_step", [False, True])
def test_sgd_op_compiled_matches_reference(dtype, first_step):
    if not _ops.compiled_available():
        pytest.skip("the compiled extension is not built")
    ps, gs, bufs, _, _, _, masks = _op_inputs(dtype)
    out = {}
    for name in ("compiled", "reference"):
        args = [_clone(x) for x in (ps, gs, bufs)]
        with _ops.use_backend(name):
            _ops.sgd_step_(*args, masks, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01,
                           nesterov=False, first_step=first_step, clip_coef=torch.tensor(0.5))
        out[name] = args
    tol = {torch.float32: 1e-6, torch.float64: 1e-12, torch.bfloat16: 8e-3}[dtype]
    for a_list, b_list in zip(out["compiled"], out["reference"]):
        for a, b in zip(a_list, b_list):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("op", ["adamw", "sgd"])
def test_op_found_inf_writes_nothing(backend, op):
    ps, gs, ms, vs, vm, steps, masks = _op_inputs(torch.float32)
    before = [_clone(x) for x in (ps, ms, vs, steps)]
    found = torch.tensor(1.0)
    if op == "adamw":
        _ops.adamw_step_(ps, gs, ms, vs, [], steps, masks, lr=0.1, beta1=0.9, beta2=0.99,
                         weight_decay=0.1, eps=1e-8, found_inf=found)
    else:
        _ops.sgd_step_(ps, gs, ms, masks, lr=0.1, momentum=0.9, weight_decay=0.1,
                       found_inf=found)
    for xs, ys in zip((ps, ms, vs, steps), before):
        for x, y in zip(xs, ys):
            assert torch.equal(x, y)


def test_op_checks_everything_before_writing(backend):
    ps, gs, ms, vs, vm, steps, masks = _op_inputs(torch.float32)
    before = _clone(ps)
    bad_masks = list(masks)
    bad_masks[2] = torch.ones(5, dtype=torch.bool)  # the third tensor's mask is wrong
    with pytest.raises((ValueError, RuntimeError)):
        _ops.adamw_step_(ps, gs, ms, vs, [], steps, bad_masks, lr=0.1, beta1=0.9, beta2=0.99,
                         weight_decay=0.1, eps=1e-8)
    for p, b in zip(ps, before):
        assert torch.equal(p, b)


# ---------------------------------------------------------------------------
# half precision, CUDA
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_follow_fp32(backend, dtype):
    """fp16/bf16 parameters: computed in fp32, rounded once per step."""
    net32, net16 = make_net(), make_net().to(dtype)
    o32 = tso.AdamW(net32.parameters(), lr=1e-3)
    o16 = tso.AdamW(net16.parameters(), lr=1e-3)
    for k in range(5):
        for model, opt in ((net32, o32), (net16, o16)):
            opt.zero_grad()
            for p in model.parameters():
                p.grad = torch.full_like(p, 0.5 if k % 2 else -0.25)
            opt.step()
    for p, q in zip(net16.parameters(), net32.parameters()):
        torch.testing.assert_close(p.float(), q, rtol=2e-2, atol=2e-3)
        assert o16.state[p]["exp_avg"].dtype == dtype


@pytest.mark.cuda
@pytest.mark.parametrize("cls, kw", [
    (tso.AdamW, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    (tso.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1)),
])
def test_cuda_matches_torch(backend, cls, kw):
    ref, net = make_net().cuda(), make_net().cuda()
    torch_opt = getattr(torch.optim, cls.__name__)(ref.parameters(), foreach=False, **kw)
    ts_opt = cls(net.parameters(), max_grad_norm=10.0, **kw)

    def clip(model, k):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)

    def run(model, opt, before):
        for k in range(30):
            opt.zero_grad()
            idx, target = (t.cuda() for t in batch(k))
            ((model(idx) - target) ** 2).mean().backward()
            if before:
                before(model, k)
            opt.step()

    run(ref, torch_opt, clip)
    run(net, ts_opt, None)
    assert_models_close(net, ref, 1e-5)


@pytest.mark.cuda
def test_cuda_grad_scaler_found_inf_on_device(backend):
    net = make_net().cuda()
    opt = tso.AdamW(net.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cuda")
    train(net, opt, 0)
    for k in range(3):
        opt.zero_grad()
        idx, target = (t.cuda() for t in batch(k))
        scaler.scale(((net(idx) - target) ** 2).mean()).backward()
        if k == 2:
            net.fc2.weight.grad[0, 0] = float("inf")
            snap = snapshot(net, opt)
        scaler.step(opt)
        scaler.update()
    assert_unchanged(net, opt, snap)


def test_state_loaded_in_another_layout_is_converted_at_its_first_step():
    """A checkpoint's state may be laid out differently from the parameter (here contiguous
    against a transposed parameter): converted once at the first step, then stepped as torch
    steps it."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(4, 3).t())  # strides (1, 3)
    p.grad = torch.randn(3, 4)
    opt = tso.AdamW([p], lr=0.1)
    opt.step()
    saved = opt.state_dict()
    for key in ("exp_avg", "exp_avg_sq"):
        saved["state"][0][key] = saved["state"][0][key].contiguous()
        assert saved["state"][0][key].stride() != p.stride()
    ours, theirs = nn.Parameter(p.detach().clone().t().contiguous().t()), nn.Parameter(p.detach().clone())
    resumed = tso.AdamW([ours], lr=0.1)
    resumed.load_state_dict(copy.deepcopy(saved))
    reference = torch.optim.AdamW([theirs], lr=0.1, foreach=False)
    reference.load_state_dict(copy.deepcopy(saved))
    for _ in range(2):
        g = torch.randn(3, 4)
        ours.grad, theirs.grad = g.clone(), g.clone()
        resumed.step()
        reference.step()
        assert resumed.state[ours]["exp_avg"].stride() == ours.stride()
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(resumed.state[ours]["exp_avg_sq"], reference.state[theirs]["exp_avg_sq"])
