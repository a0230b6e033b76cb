"""Outside audit: ``ts.optim.SGD`` / ``ts.optim.AdamW`` inside the wider PyTorch optimizer
ecosystem.

What is audited (written from the docs only: ``docs/optimizers.md``, ``docs/groups.md``,
``docs/schedule.md``, the contract ``DESIGN.md``; the library is a black box):

* LR schedulers that rewrite group keys other than ``lr``: ``CyclicLR`` (cycling SGD's
  ``momentum`` and AdamW's ``betas``), ``OneCycleLR`` on SGD (cycling ``momentum``,
  ``three_phase``), ``ReduceLROnPlateau``, ``SWALR`` with ``AveragedModel``,
  ``ChainedScheduler``, ``CosineAnnealingWarmRestarts``, ``PolynomialLR``; with ``nesterov``,
  ``dampening``, ``maximize``, ``amsgrad``; over ``lr_scale`` groups from ``ts.param_groups``;
  a ``CyclicLR`` run resumed mid-cycle from optimizer + scheduler state dicts; tensor ``lr``
  filled in place by a scheduler (eager and inside ``torch.compile``).
* Optimizer hooks: step pre/post hooks (local and the global
  ``torch.optim.optimizer.register_optimizer_step_pre_hook`` / ``_post_hook``) that freeze a
  parameter, rewrite ``lr`` or the gradients, read ``last_grad_norm``; ``state_dict`` pre/post
  hooks and ``load_state_dict`` post hooks next to the element masks; the profiler's step name;
  the LR scheduler's "step order" bookkeeping.
* ``torch.distributed.checkpoint``: ``get_state_dict`` / ``set_state_dict`` with
  ``StateDictOptions`` (full, cpu_offload, flattened), two optimizers at once, a round trip
  ts -> ``torch.optim`` -> ts, ``dcp.save`` / ``dcp.load`` into a fresh optimizer, and the
  lr=0 initialisation step DCP runs on a never-stepped optimizer (one gloo process group of
  world size 1 on 127.0.0.1).
* Training-loop edges: ``zero_grad(set_to_none=False)`` with unused branches, a parameter
  frozen with a stale ``.grad`` and unfrozen later, ``add_param_group`` after steps (with
  ``lr_scale``, ``set_mask``, a scheduler attached), a parameter appended to
  ``group["params"]``, tensor ``betas``, ``GradScaler`` with two optimizers and overflows in
  either (step counts!), "optimizer in backward" (one optimizer per parameter stepped from
  ``register_post_accumulate_grad_hook``) with frozen parameters, masks and a per-parameter
  ``max_grad_norm``.

Oracles: ``torch.optim.SGD`` / ``AdamW`` with ``foreach=False`` on a deep copy fed the same
data -- SGD bitwise (docs: "SGD: bitwise on CPU"), AdamW to 1e-6 relative (the documented
tolerance); where ``lr_scale`` is involved, torch given the scaled rates explicitly, to 1e-6
(the product is rounded differently); masked-out elements and frozen / skipped parameters
bitwise unchanged, and no ``optimizer.state`` entry for what is never stepped; a resumed run
bitwise equal to the straight run. The ``state_dict`` / ``load_state_dict`` post-hooks see the
masks: they once ran before the masks were added or loaded.
"""
import copy
import io
import socket
import warnings

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as lrs

import torchstruct as ts
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

RTOL, ATOL = 1e-6, 1e-7


# ---------------------------------------------------------------------------------- helpers

def _close(a, b, exact):
    if exact:
        assert torch.equal(a, b), (a - b).abs().max()
    else:
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def _same_params(m1, m2, exact):
    for (n, p), q in zip(m1.named_parameters(), m2.parameters()):
        try:
            _close(p.detach(), q.detach(), exact)
        except AssertionError as e:
            raise AssertionError(f"{n}: {e}") from None


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))


def _batches(n, seed=0, shape=(4, 5)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) for _ in range(n)]


def _torch_twin(cls):
    return {ts.optim.SGD: torch.optim.SGD, ts.optim.AdamW: torch.optim.AdamW}[cls]


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# ------------------------------------------------------- schedulers rewriting group keys

def _cyclic_sgd(o):
    return lrs.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=3, base_momentum=0.7,
                        max_momentum=0.95)


SCHEDULES = {
    # name: (ts class, hyper-parameters, scheduler factory, key the scheduler cycles or None)
    "cyclic_sgd_nesterov": (ts.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True,
                                               weight_decay=0.01), _cyclic_sgd, "momentum"),
    "cyclic_sgd_triangular2_dampening": (
        ts.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.2),
        lambda o: lrs.CyclicLR(o, 0.01, 0.1, step_size_up=2, mode="triangular2"), "momentum"),
    "cyclic_sgd_exp_range_maximize": (
        ts.optim.SGD, dict(lr=0.1, momentum=0.5, maximize=True, weight_decay=0.1),
        lambda o: lrs.CyclicLR(o, 0.01, 0.1, step_size_up=2, mode="exp_range", gamma=0.9),
        "momentum"),
    "cyclic_adamw_amsgrad": (
        ts.optim.AdamW, dict(lr=0.01, amsgrad=True, weight_decay=0.1),
        lambda o: lrs.CyclicLR(o, 0.001, 0.01, step_size_up=3, base_momentum=0.8,
                               max_momentum=0.95), "betas"),
    "onecycle_sgd_three_phase": (
        ts.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True),
        lambda o: lrs.OneCycleLR(o, max_lr=0.2, total_steps=12, three_phase=True), "momentum"),
    "onecycle_adamw_maximize": (
        ts.optim.AdamW, dict(lr=0.01, maximize=True),
        lambda o: lrs.OneCycleLR(o, max_lr=0.02, total_steps=12), "betas"),
    "plateau_sgd": (ts.optim.SGD, dict(lr=0.1, momentum=0.9),
                    lambda o: lrs.ReduceLROnPlateau(o, patience=1, factor=0.5), None),
    "plateau_adamw_amsgrad": (ts.optim.AdamW, dict(lr=0.01, amsgrad=True),
                              lambda o: lrs.ReduceLROnPlateau(o, patience=0, factor=0.3), None),
    "swalr_adamw": (ts.optim.AdamW, dict(lr=0.01, weight_decay=0.05),
                    lambda o: torch.optim.swa_utils.SWALR(o, swa_lr=0.03, anneal_epochs=4),
                    None),
    "chained_sgd": (ts.optim.SGD, dict(lr=0.1, momentum=0.5, dampening=0.5),
                    lambda o: lrs.ChainedScheduler([lrs.ConstantLR(o, factor=0.5, total_iters=3),
                                                    lrs.ExponentialLR(o, gamma=0.9)]), None),
    "warm_restarts_adamw": (ts.optim.AdamW, dict(lr=0.01),
                            lambda o: lrs.CosineAnnealingWarmRestarts(o, T_0=3, T_mult=2), None),
    "polynomial_sgd_maximize": (ts.optim.SGD, dict(lr=0.1, weight_decay=0.1, maximize=True),
                                lambda o: lrs.PolynomialLR(o, total_iters=6, power=2.0), None),
}


def _sched_step(s, loss):
    if isinstance(s, lrs.ReduceLROnPlateau):
        s.step(1.0)  # a plateau: the rate drops every `patience + 1` steps
    else:
        s.step()


def _cycled(group, key):
    return group[key] if key == "momentum" else group[key][0]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_schedulers_that_rewrite_group_keys_match_torch(name):
    cls, kw, make_sched, key = SCHEDULES[name]
    a, b = _mlp(), _mlp()
    oa = cls(a.parameters(), **kw)
    ob = _torch_twin(cls)(b.parameters(), foreach=False, **kw)
    sa, sb = make_sched(oa), make_sched(ob)
    seen_a, seen_b, lrs_a = [], [], []
    for x in _batches(12):
        for m, o, s, seen in ((a, oa, sa, seen_a), (b, ob, sb, seen_b)):
            o.zero_grad()
            loss = m(x).pow(2).mean()
            loss.backward()
            o.step()
            _sched_step(s, loss)
            if key is not None:
                seen.append(_cycled(o.param_groups[0], key))
        lrs_a.append(oa.param_groups[0]["lr"])
    _same_params(a, b, exact=cls is ts.optim.SGD)
    assert len(set(lrs_a)) > 2, "the schedule did not move the learning rate"
    if key is not None:
        assert seen_a == seen_b and len(set(seen_a)) > 2, "the scheduler did not cycle " + key
    for p, q in zip(a.parameters(), b.parameters()):
        assert oa.state[p].keys() == ob.state[q].keys()


def _lr_scale_net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(20, 6), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))


def _tokens(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 20, (4, 5), generator=g) for _ in range(n)]


@pytest.mark.parametrize("which", ["cyclic", "plateau", "onecycle"])
@pytest.mark.parametrize("cls", [ts.optim.SGD, ts.optim.AdamW])
def test_cycling_schedulers_over_lr_scale_groups_match_torch_with_scaled_rates(cls, which):
    scales = {"0": 0.1, "1": 0.5}
    kw = dict(momentum=0.9) if cls is ts.optim.SGD else dict(weight_decay=0.1)
    base = 0.05 if cls is ts.optim.SGD else 0.01
    a, b = _lr_scale_net(), _lr_scale_net()
    groups = ts.param_groups(a, *[(k, {"lr_scale": s}) for k, s in scales.items()],
                             no_decay=None)
    oa = cls(groups, lr=base, **kw)
    tgroups = ts.param_groups(b, *[(k, {"lr": base * s}) for k, s in scales.items()],
                              no_decay=None)
    ob = _torch_twin(cls)(tgroups, lr=base, foreach=False, **kw)
    per = [g.get("lr_scale", 1.0) for g in oa.param_groups]
    assert per == [0.1, 0.5, 1.0]

    def make(o, scaled):
        f = per if scaled else [1.0] * len(per)
        if which == "cyclic":
            return lrs.CyclicLR(o, base_lr=[base / 10 * s for s in f],
                                max_lr=[base * s for s in f], step_size_up=2)
        if which == "onecycle":
            return lrs.OneCycleLR(o, max_lr=[base * s for s in f], total_steps=8)
        return lrs.ReduceLROnPlateau(o, patience=0, factor=0.5,
                                     min_lr=[base / 8 * s for s in f])

    sa, sb = make(oa, False), make(ob, True)
    for tok in _tokens(8):
        for m, o, s in ((a, oa, sa), (b, ob, sb)):
            o.zero_grad()
            loss = m(tok).pow(2).mean()
            loss.backward()
            o.step()
            _sched_step(s, loss)
        # one schedule for every group, and the ratios stay where lr_scale put them
        assert len({g["lr"] for g in oa.param_groups}) == 1
        assert [g["lr_scale"] for g in oa.param_groups[:2]] == [0.1, 0.5]
        for ga, gb, s in zip(oa.param_groups, ob.param_groups, per):
            assert ga["lr"] * s == pytest.approx(gb["lr"], rel=1e-12)
    _same_params(a, b, exact=False)


def test_cyclic_momentum_run_resumed_mid_cycle_is_bitwise_with_its_mask():
    mask = torch.zeros(20, 6, dtype=torch.bool)
    mask[15:] = True

    def setup():
        net = _lr_scale_net()
        opt = ts.optim.SGD(ts.param_groups(net, ("3", {"lr_scale": 0.5})), lr=0.1,
                           momentum=0.9, nesterov=True, weight_decay=0.01,
                           masks={"0.weight": mask})
        return net, opt, _cyclic_sgd(opt)

    toks = _tokens(10, seed=3)

    def run(net, opt, sched, steps):
        for i in steps:
            opt.zero_grad()
            net(toks[i]).pow(2).mean().backward()
            opt.step()
            sched.step()

    straight, so, ss = setup()
    run(straight, so, ss, range(10))

    net, opt, sched = setup()
    run(net, opt, sched, range(4))
    saved = _roundtrip({"model": net.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict()})
    fresh = _lr_scale_net(seed=1)
    fresh.load_state_dict(saved["model"])
    opt2 = ts.optim.SGD(ts.param_groups(fresh, ("3", {"lr_scale": 0.5})), lr=0.1, momentum=0.9,
                        nesterov=True, weight_decay=0.01)  # no masks=: from the state dict
    sched2 = _cyclic_sgd(opt2)
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    assert opt2.param_groups[0]["momentum"] == opt.param_groups[0]["momentum"]
    run(fresh, opt2, sched2, range(4, 10))
    _same_params(fresh, straight, exact=True)
    start = _lr_scale_net()
    assert torch.equal(fresh[0].weight[~mask], start[0].weight[~mask])
    buf = opt2.state[fresh[0].weight]["momentum_buffer"]
    assert buf[~mask].eq(0).all() and buf[mask].ne(0).any()
    assert torch.equal(buf, so.state[straight[0].weight]["momentum_buffer"])


@pytest.mark.parametrize("cls", [ts.optim.SGD, ts.optim.AdamW])
def test_tensor_lr_filled_in_place_by_a_scheduler_matches_torch(cls):
    kw = dict(momentum=0.9, nesterov=True, weight_decay=0.01) if cls is ts.optim.SGD else \
        dict(weight_decay=0.1, amsgrad=True)
    a, b = _mlp(), _mlp()
    lr_a, lr_b = torch.tensor(0.05), torch.tensor(0.05)
    oa = cls(a.parameters(), lr=lr_a, **kw)
    ob = _torch_twin(cls)(b.parameters(), lr=lr_b, foreach=False, **kw)
    sa = lrs.CosineAnnealingLR(oa, T_max=6)
    sb = lrs.CosineAnnealingLR(ob, T_max=6)
    for x in _batches(6):
        for m, o, s in ((a, oa, sa), (b, ob, sb)):
            o.zero_grad()
            m(x).pow(2).sum().backward()
            o.step()
            s.step()
    assert oa.param_groups[0]["lr"] is lr_a  # filled in place, never replaced
    assert torch.equal(lr_a, lr_b) and float(lr_a) < 0.05
    _same_params(a, b, exact=cls is ts.optim.SGD)


def test_tensor_lr_with_lr_scale_follows_the_in_place_schedule():
    a, b = _mlp(), _mlp()
    lr = torch.tensor(0.08)
    oa = ts.optim.SGD([{"params": a[0].parameters(), "lr_scale": 0.25},
                       {"params": a[2].parameters()}], lr=lr, momentum=0.5)
    ob = torch.optim.SGD([{"params": b[0].parameters(), "lr": 0.02},
                          {"params": b[2].parameters(), "lr": 0.08}], lr=0.08, momentum=0.5,
                         foreach=False)
    sa, sb = lrs.StepLR(oa, 1, gamma=0.5), lrs.StepLR(ob, 1, gamma=0.5)
    for x in _batches(4):
        for m, o, s in ((a, oa, sa), (b, ob, sb)):
            o.zero_grad()
            m(x).pow(2).sum().backward()
            o.step()
            s.step()
    assert float(lr) == pytest.approx(0.005)
    _same_params(a, b, exact=False)


def test_compiled_step_with_tensor_lr_and_scheduler_matches_eager_and_torch():
    def run(kind):
        torch._dynamo.reset()
        net = _mlp()
        if kind == "torch":
            opt = torch.optim.AdamW(net.parameters(), lr=torch.tensor(0.05), weight_decay=0.1,
                                    foreach=False)
        else:
            opt = ts.optim.AdamW(net.parameters(), lr=torch.tensor(0.05), weight_decay=0.1,
                                 max_grad_norm=0.5)
        sched = lrs.ExponentialLR(opt, gamma=0.5)

        def step():
            opt.step()

        fn = torch.compile(step) if kind == "compiled" else step
        for x in _batches(4):
            opt.zero_grad()
            net(x).pow(2).sum().backward()
            if kind == "torch":
                torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
            fn()
            sched.step()
        return net

    eager, compiled, ref = run("eager"), run("compiled"), run("torch")
    _same_params(compiled, eager, exact=True)
    _same_params(eager, ref, exact=False)


def test_swa_with_ts_optim_averages_like_torch():
    def run(cls):
        net = _mlp()
        opt = cls(net.parameters(), lr=0.05, weight_decay=0.1, **(
            {} if cls is ts.optim.AdamW else {"foreach": False}))
        swa = torch.optim.swa_utils.AveragedModel(net)
        sched = lrs.CosineAnnealingLR(opt, T_max=10)
        swa_sched = torch.optim.swa_utils.SWALR(opt, swa_lr=0.02, anneal_epochs=2)
        for i, x in enumerate(_batches(8)):
            opt.zero_grad()
            net(x).pow(2).mean().backward()
            opt.step()
            if i >= 4:
                swa.update_parameters(net)
                swa_sched.step()
            else:
                sched.step()
        return swa, opt

    ours, oa = run(ts.optim.AdamW)
    theirs, ob = run(torch.optim.AdamW)
    assert int(ours.n_averaged) == int(theirs.n_averaged) == 4
    assert oa.param_groups[0]["lr"] == ob.param_groups[0]["lr"]
    _same_params(ours.module, theirs.module, exact=False)


# ------------------------------------------------------------------------------- hooks

def test_scheduler_step_order_bookkeeping_sees_the_ts_step():
    net = _mlp()
    opt = ts.optim.SGD(net.parameters(), lr=0.1)
    sched = lrs.StepLR(opt, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()"
        for x in _batches(2):
            opt.zero_grad()
            net(x).sum().backward()
            opt.step()
            sched.step()
    # and the converse still warns, as with torch's optimizers
    net2 = _mlp()
    opt2 = ts.optim.SGD(net2.parameters(), lr=0.1)
    sched2 = lrs.StepLR(opt2, 1)
    with pytest.warns(UserWarning, match="optimizer.step"):
        sched2.step()


@pytest.mark.parametrize("cls", [ts.optim.SGD, ts.optim.AdamW])
def test_global_step_hooks_run_around_a_ts_step_and_can_freeze(cls):
    net = _mlp()
    opt = cls(net.parameters(), lr=0.1, weight_decay=0.5)
    calls = []
    frozen = net[0].weight
    before = frozen.detach().clone()
    head = net[2].weight.detach().clone()

    def pre(o, args, kwargs):
        if o is opt:
            calls.append(("pre", frozen.detach().clone()))
            frozen.requires_grad_(False)  # frozen when step() runs: never touched

    def post(o, args, kwargs):
        if o is opt:
            calls.append(("post", frozen.detach().clone()))

    h1 = register_optimizer_step_pre_hook(pre)
    h2 = register_optimizer_step_post_hook(post)
    try:
        net(_batches(1)[0]).sum().backward()
        opt.step()
    finally:
        h1.remove()
        h2.remove()
        frozen.requires_grad_(True)
    assert [c[0] for c in calls] == ["pre", "post"]
    assert torch.equal(frozen.detach(), before) and frozen not in opt.state
    assert not torch.equal(net[2].weight, head)


def test_local_pre_hook_rewriting_lr_and_grads_is_honoured():
    a, b = _mlp(), _mlp()
    oa = ts.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    ob = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9, foreach=False)

    def hook(params):
        def pre(o, args, kwargs):
            o.param_groups[0]["lr"] = 0.025
            for p in params:
                p.grad = torch.full_like(p, 0.5)
        return pre

    oa.register_step_pre_hook(hook(list(a.parameters())))
    ob.register_step_pre_hook(hook(list(b.parameters())))
    for x in _batches(2):
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            m(x).sum().backward()
            o.step()
    _same_params(a, b, exact=True)


def test_pre_hook_returning_new_arguments_passes_the_closure():
    net = _mlp()
    opt = ts.optim.SGD(net.parameters(), lr=0.1)
    x = _batches(1)[0]
    calls = []

    def closure():
        calls.append(1)
        opt.zero_grad()
        loss = net(x).pow(2).mean()
        loss.backward()
        return loss

    # torch passes `args` with the optimizer first; the hook returns (new_args, new_kwargs)
    opt.register_step_pre_hook(lambda o, args, kwargs: (args, {"closure": closure}))
    w = net[0].weight.detach().clone()
    loss = opt.step()
    assert calls == [1] and torch.is_tensor(loss)
    assert not torch.equal(net[0].weight, w)


def test_post_hook_reads_the_norm_of_this_step():
    net = _mlp()
    opt = ts.optim.AdamW(net.parameters(), lr=0.01, max_grad_norm=0.1)
    seen = []
    opt.register_step_post_hook(lambda o, a, k: seen.append(o.last_grad_norm.clone()))
    for scale in (1.0, 5.0):
        opt.zero_grad()
        (scale * net(_batches(1)[0]).sum()).backward()
        expected = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(p.grad) for p in net.parameters()]))
        opt.step()
        torch.testing.assert_close(seen[-1], expected)


def test_profiler_names_the_step_and_zero_grad_like_torch_optimizers():
    net = _mlp()
    opt = ts.optim.AdamW(net.parameters(), lr=0.01)
    net(_batches(1)[0]).sum().backward()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
        opt.zero_grad()
    names = {e.name for e in prof.events()}
    assert "Optimizer.step#AdamW.step" in names
    assert "Optimizer.zero_grad#AdamW.zero_grad" in names


def _masked_adamw():
    torch.manual_seed(0)
    emb = nn.Embedding(6, 3)
    mask = torch.zeros(6, 3, dtype=torch.bool)
    mask[4:] = True
    opt = ts.optim.AdamW(emb.parameters(), lr=0.1, masks={emb.weight: mask})
    emb(torch.tensor([[1, 4, 5]])).sum().backward()
    opt.step()
    return emb, opt, mask


def test_state_dict_pre_hook_setting_a_mask_is_saved():
    torch.manual_seed(0)
    emb = nn.Embedding(6, 3)
    opt = ts.optim.AdamW(emb.parameters(), lr=0.1)
    emb(torch.tensor([[1, 4]])).sum().backward()
    opt.step()
    mask = torch.zeros(6, 3, dtype=torch.bool)
    mask[5] = True
    opt.register_state_dict_pre_hook(lambda o: o.set_mask(emb.weight, mask))
    sd = opt.state_dict()
    assert torch.equal(sd["masks"][0], mask)
    assert torch.equal(sd["state"][0]["torchstruct_mask"].bool(), mask)


def test_state_dict_post_hook_runs_and_may_add_keys_without_losing_masks():
    emb, opt, mask = _masked_adamw()
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 7})
    sd = opt.state_dict()
    assert sd["extra"] == 7 and torch.equal(sd["masks"][0], mask)


def test_state_dict_post_hook_sees_the_masks():
    emb, opt, mask = _masked_adamw()
    seen = {}

    def post(o, sd):
        seen["keys"] = sorted(sd)
        seen["state0"] = sorted(sd["state"][0])

    opt.register_state_dict_post_hook(post)
    opt.state_dict()
    assert "masks" in seen["keys"], seen          # the hook gets the finished state dict
    assert "torchstruct_mask" in seen["state0"], seen


def test_state_dict_post_hook_removing_the_masks_stands():
    emb, opt, mask = _masked_adamw()

    def post(o, sd):
        sd.pop("masks", None)
        for entry in sd["state"].values():
            entry.pop("torchstruct_mask", None)

    opt.register_state_dict_post_hook(post)
    sd = opt.state_dict()
    assert "masks" not in sd and "torchstruct_mask" not in sd["state"][0]


def test_load_state_dict_post_hook_sees_the_loaded_masks():
    emb, opt, mask = _masked_adamw()
    saved = copy.deepcopy(opt.state_dict())
    fresh = ts.optim.AdamW(emb.parameters(), lr=0.1)  # no masks=: they come from `saved`
    seen = {}
    fresh.register_load_state_dict_post_hook(
        lambda o: seen.setdefault("masks", {id(p): m.clone() for p, m in o.masks.items()}))
    fresh.load_state_dict(saved)
    assert torch.equal(fresh.masks[emb.weight], mask)  # loaded by the time load returns...
    assert id(emb.weight) in seen["masks"], "...but not when the post-hook ran"


def test_load_state_dict_post_hook_dropping_a_mask_stands():
    emb, opt, mask = _masked_adamw()
    saved = copy.deepcopy(opt.state_dict())
    fresh = ts.optim.AdamW(emb.parameters(), lr=0.1)
    fresh.register_load_state_dict_post_hook(lambda o: o.set_mask(emb.weight, None))
    fresh.load_state_dict(saved)  # "resume, but from now on train every row"
    assert emb.weight not in fresh.masks
    w = emb.weight.detach().clone()
    emb(torch.tensor([[0, 1]])).sum().backward()
    fresh.step()
    assert not torch.equal(emb.weight[0], w[0])  # row 0 (masked out before) trains now


def test_load_state_dict_post_hook_can_rewrite_group_options():
    emb, opt, mask = _masked_adamw()
    saved = copy.deepcopy(opt.state_dict())
    fresh = ts.optim.AdamW(emb.parameters(), lr=0.1)

    def post(o):
        o.param_groups[0]["lr_scale"] = 0.0

    fresh.register_load_state_dict_post_hook(post)
    fresh.load_state_dict(saved)
    w = emb.weight.detach().clone()
    step = fresh.state[emb.weight]["step"].clone()
    emb(torch.tensor([[4, 5]])).sum().backward()
    fresh.step()
    assert torch.equal(emb.weight, w) and torch.equal(fresh.state[emb.weight]["step"], step)


def test_every_state_dict_hook_runs_once_and_a_load_pre_hook_edit_stands():
    emb, opt, mask = _masked_adamw()
    n = {"sd_pre": 0, "sd_post": 0, "ld_pre": 0, "ld_post": 0}

    def bump(key):
        def hook(*args):
            n[key] += 1
        return hook

    for key, reg in (("sd_pre", opt.register_state_dict_pre_hook),
                     ("sd_post", opt.register_state_dict_post_hook),
                     ("ld_pre", opt.register_load_state_dict_pre_hook),
                     ("ld_post", opt.register_load_state_dict_post_hook)):
        reg(bump(key))
    saved = copy.deepcopy(opt.state_dict())
    opt.load_state_dict(saved)
    assert n == {"sd_pre": 1, "sd_post": 1, "ld_pre": 1, "ld_post": 1}

    fresh = ts.optim.AdamW(emb.parameters(), lr=0.1)

    def double(o, sd):  # not idempotent: must be applied exactly once
        sd = copy.deepcopy(sd)
        for entry in sd["state"].values():
            entry["exp_avg"] = entry["exp_avg"] * 2
        return sd

    fresh.register_load_state_dict_pre_hook(double)
    fresh.load_state_dict(copy.deepcopy(saved))
    assert torch.equal(fresh.state[emb.weight]["exp_avg"], opt.state[emb.weight]["exp_avg"] * 2)
    assert torch.equal(fresh.masks[emb.weight], mask)


def test_step_pre_hook_setting_the_mask_of_this_batch_is_obeyed():
    torch.manual_seed(0)
    emb = nn.Embedding(8, 3)
    opt = ts.optim.AdamW(emb.parameters(), lr=0.1, weight_decay=0.1)
    rows = {}

    def pre(o, args, kwargs):  # train only the rows this batch names as "new"
        m = torch.zeros(8, 3, dtype=torch.bool)
        m[rows["new"]] = True
        o.set_mask(emb.weight, m)

    opt.register_step_pre_hook(pre)
    w0 = emb.weight.detach().clone()
    for new in ([1, 2], [2, 3]):
        rows["new"] = torch.tensor(new)
        opt.zero_grad()
        emb(torch.tensor([1, 2, 3, 5])).sum().backward()
        opt.step()
    for r in (0, 4, 5, 6, 7):
        assert torch.equal(emb.weight[r], w0[r]), r
    for r in (1, 2, 3):
        assert not torch.equal(emb.weight[r], w0[r]), r
    assert opt.state[emb.weight]["exp_avg"][5].eq(0).all()


# ------------------------------------------------------------- torch.distributed.checkpoint

@pytest.fixture(scope="module")
def gloo():
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("gloo is not available")
    if dist.is_initialized():
        yield dist
        return
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


ROWS = torch.zeros(20, 6, dtype=torch.bool)
ROWS[15:] = True


def _dcp_setup(masks=True, seed=0):
    net = _lr_scale_net(seed)
    opt = ts.optim.AdamW(ts.param_groups(net, ("3", {"lr_scale": 0.5})), lr=0.02,
                         weight_decay=0.1, max_grad_norm=0.5,
                         masks={"0.weight": ROWS} if masks else None)
    return net, opt


def _dcp_train(net, opts, steps):
    toks = _tokens(12, seed=7)
    for i in steps:
        for o in opts:
            o.zero_grad()
        net(toks[i]).pow(2).mean().backward()
        for o in opts:
            o.step()


@pytest.mark.parametrize("options", ["default", "full", "full_cpu_offload"])
def test_dcp_get_set_state_dict_resumes_bitwise_with_masks_and_lr_scale(gloo, options):
    sd_mod = pytest.importorskip("torch.distributed.checkpoint.state_dict")
    opts = {"default": sd_mod.StateDictOptions(),
            "full": sd_mod.StateDictOptions(full_state_dict=True),
            "full_cpu_offload": sd_mod.StateDictOptions(full_state_dict=True,
                                                        cpu_offload=True)}[options]
    straight, so = _dcp_setup()
    _dcp_train(straight, [so], range(6))

    net, opt = _dcp_setup()
    _dcp_train(net, [opt], range(3))
    msd, osd = sd_mod.get_state_dict(net, opt, options=opts)
    saved = _roundtrip({"model": msd, "optim": osd})
    fresh, opt2 = _dcp_setup(masks=False, seed=1)
    sd_mod.set_state_dict(fresh, opt2, model_state_dict=saved["model"],
                          optim_state_dict=saved["optim"], options=opts)
    assert [n for n, p in fresh.named_parameters() if p in opt2.masks] == ["0.weight"]
    assert [g.get("lr_scale") for g in opt2.param_groups][:2] == [0.5, 0.5]
    _dcp_train(fresh, [opt2], range(3, 6))
    _same_params(fresh, straight, exact=True)


def test_dcp_with_two_optimizers_keeps_each_ones_masks(gloo):
    sd_mod = pytest.importorskip("torch.distributed.checkpoint.state_dict")

    def setup(masks=True, seed=0):
        net = _lr_scale_net(seed)
        o1 = ts.optim.AdamW(net[0].parameters(), lr=0.02,
                            masks={net[0].weight: ROWS} if masks else None)
        o2 = ts.optim.SGD(list(net[1].parameters()) + list(net[3].parameters()), lr=0.05,
                          momentum=0.9)
        return net, (o1, o2)

    straight, sopts = setup()
    _dcp_train(straight, sopts, range(6))
    net, opts = setup()
    _dcp_train(net, opts, range(3))
    msd, osd = sd_mod.get_state_dict(net, opts)
    saved = _roundtrip({"model": msd, "optim": osd})
    assert "torchstruct_mask" in saved["optim"]["state"]["0.weight"]
    fresh, fopts = setup(masks=False, seed=1)
    sd_mod.set_state_dict(fresh, fopts, model_state_dict=saved["model"],
                          optim_state_dict=saved["optim"])
    assert torch.equal(fopts[0].masks[fresh[0].weight], ROWS) and not fopts[1].masks
    _dcp_train(fresh, fopts, range(3, 6))
    _same_params(fresh, straight, exact=True)


def test_dcp_round_trip_through_torch_adamw_brings_the_mask_back(gloo):
    sd_mod = pytest.importorskip("torch.distributed.checkpoint.state_dict")
    net, opt = _dcp_setup()
    _dcp_train(net, [opt], range(2))
    plain = copy.deepcopy(net)
    topt = torch.optim.AdamW(ts.param_groups(plain, ("3", {"lr_scale": 0.5})), lr=0.02,
                             weight_decay=0.1, foreach=False)
    sd_mod.set_optimizer_state_dict(plain, topt, sd_mod.get_optimizer_state_dict(net, opt))
    assert "torchstruct_mask" in topt.state[plain[0].weight]  # the carried copy is kept
    _dcp_train(plain, [topt], range(2, 3))  # torch steps with the extra key present
    back = copy.deepcopy(plain)
    opt2 = ts.optim.AdamW(ts.param_groups(back, ("3", {"lr_scale": 0.5})), lr=0.02,
                          weight_decay=0.1)
    sd_mod.set_optimizer_state_dict(back, opt2, sd_mod.get_optimizer_state_dict(plain, topt))
    m = opt2.masks[back[0].weight]
    assert m.dtype == torch.bool and torch.equal(m, ROWS)
    rows = back[0].weight.detach().clone()
    _dcp_train(back, [opt2], range(3, 5))
    assert torch.equal(back[0].weight[~ROWS], rows[~ROWS])
    assert not torch.equal(back[0].weight[ROWS], rows[ROWS])


def test_dcp_save_and_load_into_a_fresh_optimizer_resumes_bitwise(gloo, tmp_path):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    sd_mod = pytest.importorskip("torch.distributed.checkpoint.state_dict")
    straight, so = _dcp_setup()
    _dcp_train(straight, [so], range(6))
    net, opt = _dcp_setup()
    _dcp_train(net, [opt], range(3))
    msd, osd = sd_mod.get_state_dict(net, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path))

    fresh, opt2 = _dcp_setup(seed=1)  # masks= given again (documented for dcp.load)
    msd2, osd2 = sd_mod.get_state_dict(fresh, opt2)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, checkpoint_id=str(tmp_path))
    sd_mod.set_state_dict(fresh, opt2, model_state_dict=state["model"],
                          optim_state_dict=state["optim"])
    _dcp_train(fresh, [opt2], range(3, 6))
    _same_params(fresh, straight, exact=True)
    assert {k: float(v["step"]) for k, v in opt2.state_dict()["state"].items()} == \
        {k: float(v["step"]) for k, v in so.state_dict()["state"].items()}


def test_dcp_flattened_state_dict_resumes_bitwise_when_masks_are_given_again(gloo):
    sd_mod = pytest.importorskip("torch.distributed.checkpoint.state_dict")
    opts = sd_mod.StateDictOptions(flatten_optimizer_state_dict=True)
    straight, so = _dcp_setup()
    _dcp_train(straight, [so], range(5))
    net, opt = _dcp_setup()
    _dcp_train(net, [opt], range(2))
    osd = _roundtrip(sd_mod.get_optimizer_state_dict(net, opt, options=opts))
    fresh = copy.deepcopy(net)
    opt2 = ts.optim.AdamW(ts.param_groups(fresh, ("3", {"lr_scale": 0.5})), lr=0.02,
                          weight_decay=0.1, max_grad_norm=0.5, masks={"0.weight": ROWS})
    sd_mod.set_optimizer_state_dict(fresh, opt2, osd, options=opts)
    assert torch.equal(opt2.masks[fresh[0].weight], ROWS)
    _dcp_train(fresh, [opt2], range(2, 5))
    _same_params(fresh, straight, exact=True)


def test_dcp_initialisation_step_of_a_fresh_optimizer_moves_nothing(gloo):
    sd_mod = pytest.importorskip("torch.distributed.checkpoint.state_dict")
    net = _lr_scale_net()
    net[1].weight.requires_grad_(False)  # frozen: no state, not touched
    before = [p.detach().clone() for p in net.parameters()]
    opt = ts.optim.SGD(ts.param_groups(net, ("3", {"lr_scale": 0.0})), lr=0.1, momentum=0.9,
                       weight_decay=0.5, masks={"0.weight": ROWS})
    osd = sd_mod.get_optimizer_state_dict(net, opt)  # DCP steps once with lr=0, zero grads
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), before))
    assert all(p.grad is None for p in net.parameters())
    assert net[1].weight not in opt.state
    assert net[3].weight not in opt.state  # lr_scale=0: no state
    assert set(osd["state"]) == {"0.weight", "1.bias"}
    assert [g["lr"] for g in opt.param_groups] == [0.1] * len(opt.param_groups)


# --------------------------------------------------------------------- training-loop edges

@pytest.mark.parametrize("cls,kw", [
    (ts.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.1)),
    (ts.optim.AdamW, dict(lr=0.05, weight_decay=0.1, amsgrad=True)),
])
def test_zero_grad_keeping_zeros_with_unused_branches_matches_torch(cls, kw):
    torch.manual_seed(0)
    a = nn.ModuleList([nn.Linear(3, 3), nn.Linear(3, 3)])
    b = copy.deepcopy(a)
    oa, ob = cls(a.parameters(), **kw), _torch_twin(cls)(b.parameters(), foreach=False, **kw)
    for i, x in enumerate(_batches(6, shape=(2, 3))):
        if i == 5:
            unused = a[1].weight.detach().clone()
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad(set_to_none=False)
            (m[0](x) if i % 2 else m[1](m[0](x))).sum().backward()
            o.step()
    # the last step (i = 5) left a[1] unused: its gradients were kept as zeros, yet it moved
    # (weight decay, momentum / moments) exactly as torch moves it
    assert all(p.grad is not None and p.grad.eq(0).all() for p in a[1].parameters())
    assert not torch.equal(a[1].weight, unused)
    _same_params(a, b, exact=cls is ts.optim.SGD)


@pytest.mark.parametrize("cls,kw", [
    (ts.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1)),
    (ts.optim.AdamW, dict(lr=0.05, weight_decay=0.2)),
])
def test_parameter_frozen_with_a_stale_grad_then_unfrozen_matches_torch_without_it(cls, kw):
    a, b = _mlp(), _mlp()
    oa, ob = cls(a.parameters(), **kw), _torch_twin(cls)(b.parameters(), foreach=False, **kw)
    xs = _batches(6)
    for i, x in enumerate(xs):
        frozen = 1 <= i <= 3
        for m, o in ((a, oa), (b, ob)):
            m[0].weight.requires_grad_(not frozen)
            o.zero_grad()
            m(x).pow(2).mean().backward()
        if frozen:
            stale = torch.full_like(a[0].weight, 3.0)
            a[0].weight.grad = stale  # ts: ignored while frozen; torch: no gradient at all
            before = a[0].weight.detach().clone()
        oa.step()
        ob.step()
        if frozen:
            assert torch.equal(a[0].weight, before)
            assert (a[0].weight in oa.state) == (i > 0 and b[0].weight in ob.state)
    for m in (a, b):
        m[0].weight.requires_grad_(True)
    _same_params(a, b, exact=cls is ts.optim.SGD)
    a[0].weight.requires_grad_(False)
    a[0].weight.grad = torch.ones_like(a[0].weight)
    oa.zero_grad()  # zero_grad works as usual: a frozen parameter's stale grad goes too
    assert a[0].weight.grad is None
    a[0].weight.requires_grad_(True)
    if cls is ts.optim.AdamW:
        assert float(oa.state[a[0].weight]["step"]) == float(ob.state[b[0].weight]["step"]) == 3


def test_add_param_group_after_steps_with_lr_scale_mask_and_scheduler():
    torch.manual_seed(0)
    body, head = nn.Linear(4, 4), nn.Linear(4, 2)
    tbody, thead = copy.deepcopy(body), copy.deepcopy(head)
    oa = ts.optim.AdamW(body.parameters(), lr=0.02, weight_decay=0.1)
    ob = torch.optim.AdamW(tbody.parameters(), lr=0.02, weight_decay=0.1, foreach=False)
    sa, sb = lrs.StepLR(oa, 1, gamma=0.7), lrs.StepLR(ob, 1, gamma=0.7)
    mask = torch.zeros(2, 4, dtype=torch.bool)
    mask[1] = True
    for i, x in enumerate(_batches(6, shape=(3, 4))):
        if i == 2:
            oa.add_param_group({"params": list(head.parameters()), "lr_scale": 0.5})
            oa.set_mask(head.weight, mask)
            ob.add_param_group({"params": list(thead.parameters()), "lr": 0.01})
            row0 = head.weight[0].detach().clone()
        for bb, hh, o, s in ((body, head, oa, sa), (tbody, thead, ob, sb)):
            o.zero_grad()
            (bb(x).pow(2).sum() + hh(x).pow(2).sum()).backward()
            o.step()
            s.step()
    assert torch.equal(head.weight[0], row0)
    # AdamW is elementwise and output 1 depends on row 1 and bias 1 only: those follow torch
    # at lr * 0.5 (row 0, and so bias 0, differ: torch has no mask)
    _close(head.weight[1].detach(), thead.weight[1].detach(), exact=False)
    _close(head.bias[1].detach(), thead.bias[1].detach(), exact=False)
    assert not torch.equal(head.weight[1], thead.weight.new_zeros(4))
    sd = _roundtrip(oa.state_dict())
    assert list(sd["masks"]) == [2]
    again = ts.optim.AdamW(body.parameters(), lr=0.02, weight_decay=0.1)
    again.add_param_group({"params": list(head.parameters()), "lr_scale": 0.5})
    again.load_state_dict(sd)
    assert torch.equal(again.masks[head.weight], mask)
    assert again.param_groups[1]["lr_scale"] == 0.5


@pytest.mark.parametrize("cls,kw", [(ts.optim.SGD, dict(lr=0.1, momentum=0.9)),
                                    (ts.optim.AdamW, dict(lr=0.1, weight_decay=0.1))])
def test_parameter_appended_to_group_params_after_steps_is_stepped_like_torch(cls, kw):
    torch.manual_seed(0)
    init = [torch.randn(3), torch.randn(3)]
    ps = [nn.Parameter(t.clone()) for t in init]
    qs = [nn.Parameter(t.clone()) for t in init]
    oa, ob = cls([ps[0]], **kw), _torch_twin(cls)([qs[0]], foreach=False, **kw)
    g = torch.Generator().manual_seed(1)
    for i in range(4):
        if i == 2:
            oa.param_groups[0]["params"].append(ps[1])
            ob.param_groups[0]["params"].append(qs[1])
        for p, q in zip(ps, qs):
            p.grad = torch.randn(3, generator=g)
            q.grad = p.grad.clone()
        oa.step()
        ob.step()
    for p, q in zip(ps, qs):
        _close(p.detach(), q.detach(), exact=cls is ts.optim.SGD)
    assert ps[1] in oa.state


def test_tensor_betas_match_torch():
    a, b = _mlp(), _mlp()
    betas = lambda: (torch.tensor(0.85), torch.tensor(0.99))  # noqa: E731
    oa = ts.optim.AdamW(a.parameters(), lr=0.01, betas=betas())
    ob = torch.optim.AdamW(b.parameters(), lr=0.01, betas=betas(), foreach=False)
    for x in _batches(4):
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            m(x).pow(2).sum().backward()
            o.step()
    _same_params(a, b, exact=False)


def test_grad_scaler_with_two_optimizers_and_overflows_matches_torch_step_counts():
    def run(lib):
        torch.manual_seed(0)
        enc, head = nn.Linear(4, 3), nn.Linear(3, 2)
        if lib == "ts":
            oa = ts.optim.AdamW(enc.parameters(), lr=0.01, max_grad_norm=1.0)
            ob = ts.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)
        else:
            oa = torch.optim.AdamW(enc.parameters(), lr=0.01, foreach=False)
            ob = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9, foreach=False)
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=2)
        for i, x in enumerate(_batches(7, shape=(5, 4))):
            oa.zero_grad()
            ob.zero_grad()
            scaler.scale(head(torch.tanh(enc(x))).pow(2).mean()).backward()
            if i in (0, 4):
                head.weight.grad[0, 0] = float("nan")  # the SGD half overflows
            if i == 2:
                enc.bias.grad[0] = float("inf")  # the AdamW half overflows
            if lib == "torch":
                scaler.unscale_(oa)
                torch.nn.utils.clip_grad_norm_(enc.parameters(), 1.0)
            scaler.step(oa)
            scaler.step(ob)
            scaler.update()
        return enc, head, oa, ob, scaler

    ours, theirs = run("ts"), run("torch")
    _same_params(ours[0], theirs[0], exact=False)
    _same_params(ours[1], theirs[1], exact=True)
    assert float(ours[2].state[ours[0].weight]["step"]) == \
        float(theirs[2].state[theirs[0].weight]["step"]) == 6
    assert ours[4].get_scale() == theirs[4].get_scale()
    # the SGD momentum buffer was first created at step 1 (step 0 overflowed) in both
    torch.testing.assert_close(ours[3].state[ours[1].weight]["momentum_buffer"],
                               theirs[3].state[theirs[1].weight]["momentum_buffer"],
                               rtol=0, atol=0)
    assert getattr(ours[2], "grad_scale", None) is None


@pytest.mark.parametrize("name", ["SGD", "AdamW"])
def test_group_added_mid_run_whose_first_scaled_step_overflows_matches_torch(name):
    def run(lib):
        torch.manual_seed(0)
        a, b = nn.Linear(3, 3), nn.Linear(3, 2)
        kw = dict(lr=0.1, momentum=0.9) if name == "SGD" else dict(lr=0.05, weight_decay=0.1)
        opt = (getattr(ts.optim, name)(a.parameters(), **kw) if lib == "ts" else
               getattr(torch.optim, name)(a.parameters(), foreach=False, **kw))
        scaler = torch.amp.GradScaler("cpu", init_scale=64.0)
        for i, x in enumerate(_batches(5, shape=(4, 3))):
            if i == 2:
                opt.add_param_group({"params": list(b.parameters())})
            opt.zero_grad()
            scaler.scale(b(a(x)).pow(2).mean()).backward()
            if i == 2:
                a.weight.grad[0, 0] = float("inf")  # the new group's first step is skipped
                before = b.weight.detach().clone()
            scaler.step(opt)
            if i == 2:
                assert torch.equal(b.weight, before) and b.weight not in opt.state
            scaler.update()
        return a, b, opt

    (a1, b1, o1), (a2, b2, o2) = run("ts"), run("torch")
    _same_params(a1, a2, exact=name == "SGD")
    _same_params(b1, b2, exact=name == "SGD")
    if name == "AdamW":
        assert float(o1.state[b1.weight]["step"]) == float(o2.state[b2.weight]["step"]) == 2
    else:
        assert torch.equal(o1.state[b1.weight]["momentum_buffer"],
                           o2.state[b2.weight]["momentum_buffer"])


# ------------------------------------------------------------------ optimizer in backward

def _emb_net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))


def _in_backward(net, make_opt, step_hook=None):
    opts = {p: make_opt(p) for p in net.parameters()}

    def hook(p):
        if step_hook is not None:
            step_hook(p)
        opts[p].step()
        opts[p].zero_grad()

    handles = [p.register_post_accumulate_grad_hook(hook) for p in net.parameters()]
    return opts, handles


def test_optimizer_in_backward_matches_torch_optimizer_in_backward():
    a, b = _emb_net(), _emb_net()
    oa, ha = _in_backward(a, lambda p: ts.optim.AdamW([p], lr=0.05, weight_decay=0.1))
    ob, hb = _in_backward(b, lambda p: torch.optim.AdamW([p], lr=0.05, weight_decay=0.1,
                                                        foreach=False))
    try:
        for tok in _tokens(3):
            tok = tok % 10
            for m in (a, b):
                m(tok).pow(2).mean().backward()
    finally:
        for h in ha + hb:
            h.remove()
    _same_params(a, b, exact=False)
    assert all(p.grad is None for p in a.parameters())


def test_optimizer_in_backward_with_frozen_block_and_masked_rows():
    mask = torch.zeros(10, 4, dtype=torch.bool)
    mask[7:] = True
    net, joint_net = _emb_net(), _emb_net()
    start = [p.detach().clone() for p in net.parameters()]
    opts, handles = _in_backward(
        net, lambda p: ts.optim.AdamW([p], lr=0.05, weight_decay=0.1,
                                      masks={p: mask} if p is net[0].weight else None))
    joint = ts.optim.AdamW(joint_net.parameters(), lr=0.05, weight_decay=0.1,
                           masks={joint_net[0].weight: mask})
    try:
        for tok in _tokens(3):
            tok = tok % 10
            with ts.freeze(net, "1"):
                net(tok).pow(2).mean().backward()
            with ts.freeze(joint_net, "1"):
                joint.zero_grad()
                joint_net(tok).pow(2).mean().backward()
                joint.step()
    finally:
        for h in handles:
            h.remove()
    assert torch.equal(net[1].weight, start[1]) and torch.equal(net[1].bias, start[2])
    assert not opts[net[1].weight].state and not opts[net[1].bias].state
    assert torch.equal(net[0].weight[~mask], start[0][~mask])
    assert not torch.equal(net[0].weight[mask], start[0][mask])
    assert torch.equal(opts[net[0].weight].state[net[0].weight]["exp_avg"][~mask],
                       torch.zeros(int((~mask).sum())))
    # stepping each parameter from its own hook = one optimizer after backward
    _same_params(net, joint_net, exact=False)


def test_optimizer_in_backward_with_per_parameter_clip_matches_torch():
    a, b = _mlp(), _mlp()
    oa, ha = _in_backward(a, lambda p: ts.optim.SGD([p], lr=0.1, momentum=0.9,
                                                    max_grad_norm=0.05))
    ob, hb = _in_backward(
        b, lambda p: torch.optim.SGD([p], lr=0.1, momentum=0.9, foreach=False),
        step_hook=lambda p: torch.nn.utils.clip_grad_norm_([p], 0.05))
    try:
        for x in _batches(3):
            for m in (a, b):
                m(x).pow(2).sum().backward()
    finally:
        for h in ha + hb:
            h.remove()
    # to rounding: the norm's summation order (and so its last bit, and the coefficient's)
    # is torch's only where its vectorized reduction happens to add in the same order
    _same_params(a, b, exact=False)
    assert all(float(o.last_grad_norm) > 0.05 for o in oa.values())
