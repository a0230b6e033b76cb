"""torchstruct beyond one process and one thread, tried as a suspicious user would.

Two gloo processes (``tests/_spawn.py``: bounded in time, a hang fails the test) check DDP
models whose trained set changes after wrapping (contexts, declarations, ``UnfreezeSchedule``,
``static_graph``, ignored parameters, a parameter frozen on one rank only), ``structural_grad``
on DDP against the averaged ``.grad`` of ``backward()``, and the norms and optimizers under DDP
and FSDP2 against torch and a single-process brute force. One process checks contexts from
several threads, inside generators and across ``asyncio`` tasks.

Each spawned scenario batches many checks (starting two interpreters dominates the cost); the
tests read their part by prefix. A test marked ``xfail(strict=True)`` reproduces a case that
goes wrong today; its reason says what happens and what is expected.
"""
import asyncio
import copy
import gc
import threading
import warnings

import pytest
import torch
from torch import nn

import torchstruct as ts
from _spawn import batch as _batch
from _spawn import check as _check
from _spawn import close as _close
from _spawn import failed as _failed
from _spawn import gloo_available, run
from _spawn import half as _half
from _spawn import small_model as _model

needs_gloo = pytest.mark.skipif(not gloo_available(), reason="gloo is not available")


def _mse(out, y):
    return nn.functional.mse_loss(out, y)


def _flags(m):
    return [p.requires_grad for p in m.parameters()]


def _refused(checks, label, fn, model, words, kind=RuntimeError):
    """``fn()`` raises ``kind`` whose message holds ``words``; no flag of ``model`` changed."""
    before = _flags(model)
    try:
        fn()
        _check(checks, f"{label}: raises", False, f"no error; flags {_flags(model)}")
    except kind as e:
        _check(checks, f"{label}: message", all(w.lower() in str(e).lower() for w in words), str(e))
    except Exception as e:  # noqa: BLE001 - the wrong kind of error is a failed check
        _check(checks, f"{label}: error type", False, repr(e))
    _check(checks, f"{label}: flags unchanged", _flags(model) == before,
           f"{before} -> {_flags(model)}")


def _same_on_all_ranks(t):
    """Whether ``t`` (a tensor) is bitwise the same on every rank."""
    import torch.distributed as dist

    t = t.detach().reshape(-1).double()
    both = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(both, t)
    return all(torch.equal(both[0], o) for o in both[1:])


def _grads(m, prefix=""):
    return {prefix + n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def _train(call, model, x, y, steps=2, opt=None):
    opt = opt or torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        _mse(call(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


# ----------------------------------------------------------------------------- DDP: what trains
class _OneUseBlocked(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = _model()

    def forward(self, t):
        with ts.stop_gradient(self.net, "0"):
            blocked = self.net(t)
        return blocked + self.net(t)


def _ddp_freezing(rank, checks):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    x, y = _batch()
    xs, ys = _half(x, rank), _half(y, rank)

    # UnfreezeSchedule built before wrapping, stepped after: the unfreeze is refused, the
    # schedule stays where it was (step, stage, flags), and load_state_dict alike.
    m = _model()
    sched = ts.UnfreezeSchedule(m, {0: "4", 1: "2", 2: None})
    ddp = DDP(m)
    _refused(checks, "schedule.step", sched.step, m, ["wrap", "no flag was changed"])
    _check(checks, "schedule.step refused: step and stage kept",
           (sched.current_step, sched.stage) == (0, 1), repr(sched))
    _refused(checks, "schedule.load_state_dict", lambda: sched.load_state_dict(
        {"step": 5, "milestones": [0, 1, 2]}), m, ["wrap"])
    _check(checks, "schedule.load_state_dict refused: kept", sched.current_step == 0)
    ref = _model()
    ts.freeze_except(ref, "4")
    _check(checks, "training after the refusals equals a fresh wrap of the head-only model",
           all(torch.equal(a, b) for a, b in zip(_train(ddp, m, xs, ys),
                                                  _train(DDP(ref), ref, xs, ys))))
    # the way out the message gives: drop the wrapper, step, wrap again; trains as one process
    _refused(checks, "schedule.step message", sched.step, m, ["drop this wrapper"])
    del ddp
    sched.step()
    _check(checks, "schedule.step after dropping the wrapper", (sched.current_step, sched.stage)
           == (1, 2) and _flags(m) == [False, False, True, True, True, True], repr(sched))
    ref = copy.deepcopy(m)  # plain PyTorch, the same flags and weights
    ddp = DDP(m)
    _check(checks, "wrapped again: trains as one process", all(_close(a, b) for a, b in zip(
        _train(ddp, m, xs, ys), _train(ref, ref, x, y))))
    # a context entered before wrapping and left after it: restored, with a RuntimeWarning
    m = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ts.freeze(m, "0"):
            ddp = DDP(m)
    _check(checks, "context left after wrapping: restored, RuntimeWarning names the path",
           all(_flags(m)) and any(issubclass(w.category, RuntimeWarning)
                                  and "'0.weight' will start training" in str(w.message)
                                  for w in caught), str([str(w.message) for w in caught]))
    # a schedule constructed after wrapping would freeze: refused (find_unused_parameters=False)
    m = _model()
    ddp = DDP(m)
    _refused(checks, "schedule built after wrapping",
             lambda: ts.UnfreezeSchedule(m, {0: "4"}), m, ["find_unused_parameters"])
    # removing a declaration made before wrapping would unfreeze what DDP does not synchronize
    m = _model()
    ts.mark_trainable(m, "4")
    ddp = DDP(m)
    _refused(checks, "mark_trainable(None)", lambda: ts.mark_trainable(m, None), m, ["wrap"])
    _check(checks, "mark_trainable(None) refused: the declaration stays",
           [n for n, _ in ts.trainable_parameters(m)] == ["4.weight", "4.bias"])
    # contexts on the wrapper; a decorator made before wrapping, called after it
    m = _model()
    decorated = ts.freeze_except(m, "4")(lambda: None)
    ddp = DDP(m)
    _refused(checks, "with freeze(wrapper)", lambda: ts.freeze(ddp, "module.2").__enter__(), m,
             ["find_unused_parameters"])
    _refused(checks, "decorated freeze_except(wrapper)", decorated, m, ["find_unused_parameters"])
    with ts.unfreeze(m, "0"):  # already trains: nothing to follow
        _check(checks, "a no-op unfreeze is allowed", all(_flags(m)))

    # static_graph=True without find_unused_parameters: freezing is refused
    m = _model()
    ddp = DDP(m, static_graph=True)
    _train(ddp, m, xs, ys)
    _refused(checks, "static_graph freeze", lambda: ts.freeze(m, "0"), m,
             ["find_unused_parameters"])
    _check(checks, "static_graph: trains on after the refusal (no DDP error)",
           len(_train(ddp, m, xs, ys)) == len(_flags(m)))

    # parameters DDP ignores (_ddp_params_and_buffers_to_ignore) are not synchronized: changing
    # their flags after wrapping is plain PyTorch and needs no refusal
    m = _model()
    m._ddp_params_and_buffers_to_ignore = ["0.weight", "0.bias"]
    ddp = DDP(m)
    try:
        with ts.freeze(m, "0"):
            _mse(ddp(xs), ys).backward()
            _check(checks, "ignored: freeze allowed", m[0].weight.grad is None
                   and m[2].weight.grad is not None)
        _check(checks, "ignored: restored", all(_flags(m)))
    except RuntimeError as e:
        _check(checks, "ignored: freeze allowed", False, str(e))

    # find_unused_parameters=True with static_graph=True: DDP fixed the used set after the
    # first step and would fail at the next one; refused at once, naming static_graph
    m = _model()
    ddp = DDP(m, find_unused_parameters=True, static_graph=True)
    _train(ddp, m, xs, ys)
    _refused(checks, "static_graph and find_unused_parameters freeze",
             lambda: ts.freeze(m, "2"), m, ["static_graph=True"])
    _check(checks, "static_graph and find_unused_parameters: trains on (no DDP error)",
           len(_train(ddp, m, xs, ys)) == len(_flags(m)))

    # find_unused_parameters=True: freezing after wrapping trains like one process
    ref = _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    m = _model()
    ddp = DDP(m, find_unused_parameters=True)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    _train(ddp, m, xs, ys, opt=opt)
    _train(ref, ref, x, y, opt=ref_opt)
    with ts.freeze(m, "2"), ts.freeze(ref, "2"):
        got = _train(ddp, m, xs, ys, opt=opt)
        want = _train(ref, ref, x, y, opt=ref_opt)
    _check(checks, "fup freeze after steps: as one process",
           all(_close(a, b) for a, b in zip(got, want)),
           str([float((a - b).abs().max()) for a, b in zip(got, want)]))

    # stop_gradient / swap change no flag; a synchronized parameter they keep out of every use
    # of a forward is an unused parameter to DDP: fine with find_unused_parameters=True
    for label, block in (("stop_gradient", lambda mm: ts.stop_gradient(mm, "0")),
                         ("swap", lambda mm: ts.swap(mm, {"0.weight": mm[0].weight.detach() + 1,
                                                           "0.bias": mm[0].bias.detach()}))):
        m = _model()
        ddp = DDP(m, find_unused_parameters=True)
        with block(m):
            _mse(ddp(xs), ys).backward()
        _check(checks, f"{label} with find_unused_parameters: gradients averaged",
               m[0].weight.grad is None and _same_on_all_ranks(m[2].weight.grad))
        m.zero_grad()
        _mse(ddp(xs), ys).backward()  # and the next step is a normal one
        _check(checks, f"{label} with find_unused_parameters: next step averaged",
               _same_on_all_ranks(m[0].weight.grad))
    # ... and with find_unused_parameters=False, DDP would wait for its gradient, leave the
    # step's gradients local and fail only at the next step: refused at the forward, on every
    # rank, before any gradient exists; the wrapper trains on normally afterwards
    for label, block in (("stop_gradient", lambda mm: ts.stop_gradient(mm, "0")),
                         ("swap", lambda mm: ts.swap(mm, {"0.weight": mm[0].weight.detach() + 1,
                                                           "0.bias": mm[0].bias.detach()}))):
        m = _model()
        ddp = DDP(m)
        outcome = "no error"
        try:
            with block(m):
                _mse(ddp(xs), ys).backward()
        except RuntimeError as e:
            outcome = str(e)
        _check(checks, f"{label} over every use, find_unused_parameters=False: refused",
               "'0.weight', '0.bias'" in outcome and "find_unused_parameters=True" in outcome
               and all(p.grad is None for p in m.parameters()) and all(_flags(m)), outcome)
        _mse(ddp(xs), ys).backward()
        _check(checks, f"{label} over every use, find_unused_parameters=False: next step averaged",
               all(_same_on_all_ranks(p.grad) for p in m.parameters()))
    # a block over one use of two keeps the parameter in the graph: no refusal
    m = _OneUseBlocked()
    ddp = DDP(m)
    _mse(ddp(xs), ys).backward()
    _check(checks, "stop_gradient over one use of two, find_unused_parameters=False: averaged",
           all(_same_on_all_ranks(p.grad) for p in m.parameters()))

    # UnfreezeSchedule after wrapping everything with find_unused_parameters=True: every
    # stage only freezes what DDP synchronizes, and trains as one process
    ref, m = _model(), _model()
    ddp = DDP(m, find_unused_parameters=True)
    scheds = [ts.UnfreezeSchedule(mm, {0: "4", 1: "2", 2: None}) for mm in (ref, m)]
    opts = [torch.optim.SGD(mm.parameters(), lr=0.1) for mm in (ref, m)]
    for _ in range(3):
        for mm, call, a, b, opt, sched in ((ref, ref, x, y, opts[0], scheds[0]),
                                           (m, ddp, xs, ys, opts[1], scheds[1])):
            opt.zero_grad(set_to_none=True)
            _mse(call(a), b).backward()
            opt.step()
            sched.step()
    _check(checks, "schedule after wrapping with find_unused_parameters: as one process",
           all(_close(p, q) for p, q in zip(m.parameters(), ref.parameters()))
           and all(_flags(m)))

    # a parameter frozen on one rank only: never a silent divergence between the ranks
    m = _model()
    ddp = DDP(m, find_unused_parameters=True)
    opt = ts.optim.SGD(m.parameters(), lr=0.1)
    outcome = "no error"
    try:
        if rank == 0:
            ts.freeze(m, "0")
        _mse(ddp(xs), ys).backward()
        opt.step()
    except RuntimeError as e:
        outcome = str(e)
    flags = torch.tensor(_flags(m), dtype=torch.float64)
    same = _same_on_all_ranks(torch.cat([p.detach().reshape(-1) for p in m.parameters()]))
    errors = torch.tensor([0.0 if outcome == "no error" else 1.0])
    dist.all_reduce(errors)
    _check(checks, "one-rank freeze: an error or the same parameters on every rank",
           bool(errors.item() == dist.get_world_size()) or same,
           f"{outcome}; flags {flags.tolist()}; parameters the same on every rank: {same}")


# ----------------------------------------------------------------------------- DDP: gradients
def _ddp_gradients(rank, checks):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    x, y = _batch()
    xs, ys = _half(x, rank), _half(y, rank)
    fn = lambda m: _mse(m(xs), ys)  # noqa: E731

    ref = DDP(_model())
    _mse(ref(xs), ys).backward()
    want = _grads(ref.module)
    full = _model()
    _mse(full(x), y).backward()
    m = _model()
    ddp = DDP(m)
    flat = ts.tree.to_flat_dict
    g = flat(ts.structural_grad(ddp, fn))
    _check(checks, "structural_grad == averaged .grad",
           all(torch.equal(g["module." + n], w) for n, w in want.items()))
    _check(checks, "structural_grad == full-batch gradient",
           all(_close(g["module." + n], p.grad) for n, p in full.named_parameters()))
    # wrt: a list mixing a parameter object and a glob; only those come back
    sub = flat(ts.structural_grad(m, fn, wrt=[m[4].bias, "2.weight"]))
    _check(checks, "wrt subset: paths", sorted(sub) == ["2.weight", "4.bias"], str(sorted(sub)))
    _check(checks, "wrt subset: values",
           all(torch.equal(sub[n], want[n]) for n in sub))
    # .grad accumulated by an earlier backward stays untouched
    _mse(ddp(xs), ys).backward()
    before = _grads(m)
    ts.structural_grad(ddp, fn)
    _check(checks, "existing .grad untouched",
           all(torch.equal(before[n], p.grad) for n, p in m.named_parameters()))
    # under no_sync: documented to average all the same (backward() there accumulates locally)
    m.zero_grad(set_to_none=True)
    with ddp.no_sync():
        g = flat(ts.structural_grad(ddp, fn(ddp)))
        _mse(ddp(xs), ys).backward()
    local = _grads(m)
    _check(checks, "no_sync: structural_grad averages",
           all(torch.equal(g["module." + n], w) for n, w in want.items()))
    _check(checks, "no_sync: backward() stays local (this rank's half)",
           not _same_on_all_ranks(local["0.weight"]))
    m.zero_grad(set_to_none=True)
    _check(checks, "steps afterwards", all(torch.equal(a, b) for a, b in zip(
        _train(ddp, m, xs, ys), _train(ref, ref.module, xs, ys))))

    # static_graph=True: DDP records its graph at the first backward(); before it, refused
    # clearly and DDP then trains as a fresh wrapper does; after it, the averaged gradient
    static, ref_static = DDP(_model(), static_graph=True), DDP(_model(), static_graph=True)
    try:
        ts.structural_grad(static, fn)
        _check(checks, "static_graph before a step: raises", False)
    except RuntimeError as e:
        _check(checks, "static_graph before a step: message",
               "static_graph=True" in str(e) and "backward()" in str(e), str(e))
    _check(checks, "static_graph: trains as a fresh wrapper after the refusal", all(
        torch.equal(a, b) for a, b in zip(_train(static, static.module, xs, ys),
                                          _train(ref_static, ref_static.module, xs, ys))))
    static.zero_grad(set_to_none=True)
    ref_static.zero_grad(set_to_none=True)
    g = flat(ts.structural_grad(static, fn))
    _mse(ref_static(xs), ys).backward()
    _check(checks, "static_graph after a step: averaged .grad", all(
        torch.equal(g["module." + n], p.grad) for n, p in ref_static.module.named_parameters()))

    # wrt= differing between the ranks: an error on every rank, not a crash or a hang
    other = DDP(_model())
    wrt = "module.2" if rank == 0 else "module.4"
    try:
        ts.structural_grad(other, fn, wrt=wrt)
        _check(checks, "wrt differing between ranks: raises", False)
    except RuntimeError as e:
        _check(checks, "wrt differing between ranks: message", "rank" in str(e), str(e))
    # trainable sets differing between the ranks (find_unused_parameters=True allows a
    # freeze on one rank): an error on every rank
    m = _model()
    fup = DDP(m, find_unused_parameters=True)
    if rank == 1:
        ts.freeze(m, "0")
    try:
        ts.structural_grad(fup, fn)
        _check(checks, "trainable sets differing: raises", False)
    except RuntimeError as e:
        _check(checks, "trainable sets differing: message", "rank" in str(e), str(e))
    # after both refusals the process group still works
    t = torch.ones(1)
    dist.all_reduce(t)
    _check(checks, "group alive", t.item() == 2.0)

    # buffers (DDP broadcasts rank 0's at the forward, a collective): the gradient uses rank
    # 0's buffers as backward() does, and a loss raising on one rank before the forward is an
    # error on every rank, not a hang
    def with_buffers():
        torch.manual_seed(0)
        bn = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
        bn[1].running_mean.fill_(float(rank))  # differs between the ranks until broadcast
        return bn.eval()  # running statistics feed the output

    ref_bn = DDP(with_buffers())
    _mse(ref_bn(xs), ys).backward()
    bn = DDP(with_buffers())
    g = flat(ts.structural_grad(bn, fn))
    _check(checks, "buffers: structural_grad == averaged .grad", all(
        torch.equal(g["module." + n], p.grad) for n, p in ref_bn.module.named_parameters()))
    _check(checks, "buffers: rank 0's were broadcast", not bn.module[1].running_mean.any())

    def flaky(model):
        if rank == 1:
            raise KeyError("rank one failed")
        return fn(model)

    try:
        ts.structural_grad(bn, flaky)
        _check(checks, "buffers, one rank fails: raises", False)
    except (KeyError, RuntimeError) as e:
        _check(checks, "buffers, one rank fails: raises", True, str(e))
    bn.train()
    ref_bn.train()
    ref_bn.zero_grad(set_to_none=True)
    _check(checks, "buffers: steps afterwards", all(torch.equal(a, b) for a, b in zip(
        _train(bn, bn.module, xs, ys), _train(ref_bn, ref_bn.module, xs, ys))))
    _check(checks, "buffers: running statistics afterwards", torch.equal(
        bn.module[1].running_var, ref_bn.module[1].running_var))

    # global_norm, clip_by_global_norm and AdamW(max_grad_norm) under DDP: single-process answers
    for p_norm in (1.0, 2.0, float("inf")):
        ref1 = _model()
        _mse(ref1(x), y).backward()
        want_norm = torch.nn.utils.clip_grad_norm_(ref1.parameters(), 0.01, norm_type=p_norm)
        m = _model()
        ddp = DDP(m)
        _mse(ddp(xs), ys).backward()
        gn = ts.global_norm(ddp, p_norm)
        got_norm = ts.clip_by_global_norm(ddp, 0.01, norm_type=p_norm)
        _check(checks, f"ddp global_norm {p_norm}", _close(gn, want_norm))
        _check(checks, f"ddp clip norm {p_norm}", _close(got_norm, want_norm))
        _check(checks, f"ddp clipped grads {p_norm}", all(
            _close(p.grad, q.grad) for p, q in zip(m.parameters(), ref1.parameters())))
    ref1 = _model()
    ts.freeze(ref1, "2")
    m = _model()
    ts.freeze(m, "2")
    ddp = DDP(m)
    opt_ref = torch.optim.AdamW([p for p in ref1.parameters() if p.requires_grad], lr=0.05,
                                foreach=False)
    opt = ts.optim.AdamW(m.parameters(), lr=0.05, max_grad_norm=0.05)
    for _ in range(3):
        _mse(ref1(x), y).backward()
        norm = torch.nn.utils.clip_grad_norm_(
            [p for p in ref1.parameters() if p.requires_grad], 0.05)
        opt_ref.step()
        opt_ref.zero_grad()
        _mse(ddp(xs), ys).backward()
        opt.step()
        opt.zero_grad()
        _check(checks, "ddp AdamW last_grad_norm", _close(opt.last_grad_norm, norm))
    _check(checks, "ddp AdamW(max_grad_norm) parameters",
           all(_close(p, q) for p, q in zip(m.parameters(), ref1.parameters())))
    _check(checks, "ddp AdamW: frozen layer bitwise unchanged",
           torch.equal(m[2].weight, _model()[2].weight) and m[2].weight not in opt.state)


def scenario_all(rank, checks):
    """Every spawned check in one pair of processes (starting them dominates the cost)."""
    parts = [("freeze: ", _ddp_freezing), ("grad: ", _ddp_gradients)]
    if _fully_shard() is not None:
        parts.append(("fsdp: ", _fsdp_numbers))
    for prefix, part_fn in parts:
        part = []
        part_fn(rank, part)
        checks.extend((prefix + n, ok, m) for n, ok, m in part)


@pytest.fixture(scope="module")
def ddp_checks():
    return run(scenario_all)


def _part(per_rank, prefix):
    """The checks named ``prefix...``; those named ``<part>: xfail ...`` (cases that go wrong
    today) only for a prefix that names them."""
    marked = "xfail" in prefix
    return {r: [c for c in checks if c[0].startswith(prefix) and ("xfail" in c[0]) == marked]
            for r, checks in per_rank.items()}


def _assert_ok(per_rank, at_least):
    assert all(len(c) >= at_least for c in per_rank.values()), \
        {r: len(c) for r, c in per_rank.items()}
    assert not _failed(per_rank), "\n".join(_failed(per_rank))


@needs_gloo
def test_ddp_changes_after_wrapping_are_refused_or_handled(ddp_checks):
    _assert_ok(_part(ddp_checks, "freeze: "), 20)


@needs_gloo
def test_ddp_structural_grad_and_norms_are_the_averaged_ones(ddp_checks):
    _assert_ok(_part(ddp_checks, "grad: "), 20)


@needs_gloo
def test_ddp_a_parameter_frozen_on_one_rank_only_is_an_error(ddp_checks):
    _assert_ok(_part(ddp_checks, "freeze: one-rank"), 1)


@needs_gloo
def test_ddp_a_block_over_every_use_without_find_unused_parameters_is_refused(ddp_checks):
    _assert_ok(_part(ddp_checks, "freeze: stop_gradient over"), 3)
    _assert_ok(_part(ddp_checks, "freeze: swap over"), 2)


# ----------------------------------------------------------------------------- FSDP2
def _fully_shard():
    """FSDP2's ``fully_shard`` where it runs on CPU tensors over gloo (public from torch 2.6;
    torch 2.4's private one initializes CUDA even then), else None."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        return None
    return fully_shard


def _fsdp_model(shard=True, freeze=None):
    """Uneven shards: 7 and 3 rows over 2 ranks, a 1-element bias (rank 1's shard is empty)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 3), nn.Tanh(),
                      nn.Linear(3, 1))
    if freeze:
        ts.freeze(m, freeze)
    if shard:
        for layer in (m[0], m[2], m[4]):
            _fully_shard()(layer)
        _fully_shard()(m)
    return m


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _brute(tensors, p):
    flat = torch.cat([t.detach().reshape(-1).double() for t in tensors])
    if p == float("inf"):
        return flat.abs().max().float()
    return flat.abs().pow(p).sum().pow(1.0 / p).float()


def _fsdp_numbers(rank, checks):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    x, y = _batch()
    x, y = torch.cat([x, x[:, :1]], 1), y[:, :1]  # 5 features, 1 output
    xs, ys = _half(x, rank), _half(y, rank)

    def step(m, a, b):
        _mse(m(a), b).backward()

    # ts.clip_by_global_norm against torch.nn.utils.clip_grad_norm_ on the same sharded model,
    # and against a single process on the unsharded one
    for p_norm in (1.0, 2.0, float("inf"), 3.0, 0.5):
        ref, a, b = _fsdp_model(shard=False), _fsdp_model(), _fsdp_model()
        step(ref, x, y)
        step(a, xs, ys)
        step(b, xs, ys)
        full_grads = [q.grad for q in ref.parameters()]
        want = _brute(full_grads, p_norm)
        got = ts.clip_by_global_norm(a.parameters(), 0.01, norm_type=p_norm)
        _check(checks, f"clip norm {p_norm} == brute force", _close(got, want, rtol=1e-4),
               f"{float(got)} vs {float(want)}")
        _check(checks, f"clip norm {p_norm} is a plain tensor", type(got) is torch.Tensor)
        if p_norm in (1.0, 2.0, 3.0):  # torch's inf norm raises on rank 1's empty shard
            theirs = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.01, norm_type=p_norm)
            _check(checks, f"clip norm {p_norm} == torch's on FSDP",
                   _close(got, _full(theirs), rtol=1e-5), f"{float(got)} vs {float(_full(theirs))}")
            _check(checks, f"clipped grads {p_norm} == torch's on FSDP", all(
                _close(_full(g.grad), _full(h.grad)) for g, h in zip(a.parameters(),
                                                                   b.parameters())))
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01, norm_type=p_norm)
        _check(checks, f"clipped grads {p_norm} == unsharded", all(
            _close(_full(g.grad), h.grad, rtol=1e-4) for g, h in zip(a.parameters(),
                                                                   ref.parameters())))

    # mixed DTensor and plain tensors: the plain ones are taken as the same on every rank
    ref, m = _fsdp_model(shard=False), _fsdp_model()
    step(ref, x, y)
    step(m, xs, ys)
    extra = torch.linspace(-3.0, 2.0, 4)  # the same on every rank
    for p_norm in (1.0, 2.0, float("inf")):
        got = ts.global_norm([q.grad for q in m.parameters()] + [extra], p_norm)
        want = _brute([q.grad for q in ref.parameters()] + [extra], p_norm)
        _check(checks, f"mixed DTensor and plain, norm {p_norm}", _close(got, want, rtol=1e-5),
               f"{float(got)} vs {float(want)}")
    # a tree of gradients (grad_tree), clipped in place
    tree = ts.grad_tree(m)
    total = ts.clip_by_global_norm(tree, 0.02)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.02)
    _check(checks, "clip of a grad_tree: global norm", _close(total, want, rtol=1e-5),
           f"{float(total)} vs {float(want)}")
    _check(checks, "clip of a grad_tree: grads clipped in place", all(
        _close(_full(g.grad), h.grad, rtol=1e-4) for g, h in zip(m.parameters(),
                                                               ref.parameters())))

    # tensors of which one rank holds only empty shards (a 1-element tensor over 2 ranks)
    mesh = init_device_mesh("cpu", (2,))
    one = distribute_tensor(torch.tensor([-2.5]), mesh, [Shard(0)])
    _check(checks, "rank 1 holds an empty shard", one.to_local().numel() == (1 - rank))
    for p_norm in (1.0, 2.0, float("inf"), 3.0):
        got = ts.global_norm([one], p_norm)
        _check(checks, f"only empty shards on rank 1, norm {p_norm}",
               _close(got, torch.tensor(2.5)), f"{float(got)}")
    g1 = distribute_tensor(torch.tensor([4.0]), mesh, [Shard(0)])
    total = ts.clip_by_global_norm([g1], 1.0)
    _check(checks, "clip of a list of DTensor tensors (.grad absent): nothing clipped, norm 0",
           _close(total, torch.tensor(0.0)), f"{float(total)}")
    # a model with nothing trainable: norm 0 on every rank, no collective needed
    frozen = _fsdp_model(freeze="*")
    _check(checks, "nothing trainable: global_norm 0", float(ts.global_norm(frozen)) == 0.0)

    # AdamW(max_grad_norm) on a sharded model frozen in part, against torch on the unsharded one
    ref, m = _fsdp_model(shard=False, freeze="2"), _fsdp_model(freeze="2")
    opt_ref = torch.optim.AdamW([q for q in ref.parameters() if q.requires_grad], lr=0.05,
                                foreach=False)
    opt = ts.optim.AdamW(m.parameters(), lr=0.05, max_grad_norm=0.05)
    for _ in range(3):
        step(ref, x, y)
        norm = torch.nn.utils.clip_grad_norm_([q for q in ref.parameters() if q.requires_grad],
                                              0.05)
        opt_ref.step()
        opt_ref.zero_grad()
        step(m, xs, ys)
        opt.step()
        opt.zero_grad()
        _check(checks, "fsdp AdamW last_grad_norm", _close(opt.last_grad_norm, norm),
               f"{float(opt.last_grad_norm)} vs {float(norm)}")
    _check(checks, "fsdp AdamW(max_grad_norm) parameters", all(
        _close(_full(p), q) for p, q in zip(m.parameters(), ref.parameters())))
    _check(checks, "fsdp AdamW: frozen layer unchanged, no state",
           torch.equal(_full(m[2].weight), _fsdp_model(shard=False)[2].weight)
           and m[2].weight not in opt.state)

    # param_groups: every parameter once, biases and norms without decay, lr_scale=0 unchanged
    m = _fsdp_model()
    groups = ts.param_groups(m, ("0", {"lr_scale": 0.0}), weight_decay=0.1)
    listed = [q for g in groups for q in g["params"]]
    _check(checks, "param_groups: every sharded parameter once",
           len(listed) == len(list(m.parameters()))
           and {id(q) for q in listed} == {id(q) for q in m.parameters()})
    no_decay = {id(q) for g in groups if g.get("weight_decay") == 0.0 for q in g["params"]}
    _check(checks, "param_groups: biases and LayerNorm without decay",
           {id(m[0].bias), id(m[1].weight), id(m[1].bias), id(m[4].bias)} <= no_decay
           and id(m[2].weight) not in no_decay, str([g["name"] for g in groups]))
    before = _full(m[0].weight).clone()
    opt = ts.optim.AdamW(groups, lr=0.1)
    step(m, xs, ys)
    opt.step()
    _check(checks, "param_groups: lr_scale=0 bitwise unchanged", torch.equal(
        _full(m[0].weight), before) and not torch.equal(_full(m[2].weight),
                                                      _fsdp_model(shard=False)[2].weight))

    # state_dict: the trainable sharded parameters; load_state_dict refuses DTensors clearly
    m = _fsdp_model(freeze="0")
    state = ts.state_dict(m)
    ref = _fsdp_model(shard=False)
    _check(checks, "state_dict: trainable paths", list(state) == [
        n for n, q in ref.named_parameters() if not n.startswith("0.")], str(list(state)))
    _check(checks, "state_dict: sharded values", all(
        type(v).__name__ == "DTensor" and torch.equal(_full(v), dict(ref.named_parameters())[k])
        for k, v in state.items()))
    before = [_full(q).clone() for q in m.parameters()]
    try:
        ts.load_state_dict(m, {k: torch.zeros(_full(v).shape) for k, v in state.items()})
        _check(checks, "load_state_dict of plain tensors into DTensors: raises", False)
    except ValueError as e:
        _check(checks, "load_state_dict of plain tensors into DTensors: message",
               "DTensor" in str(e) and "1.weight" in str(e), str(e))
    _check(checks, "load_state_dict refused: nothing written", all(
        torch.equal(_full(q), b) for q, b in zip(m.parameters(), before)))


@needs_gloo
@pytest.mark.skipif(_fully_shard() is None,
                    reason="FSDP2 on CPU tensors is tested from torch 2.6 on (fully_shard public)")
def test_fsdp_norms_optimizers_groups_and_state_are_global(ddp_checks):
    _assert_ok(_part(ddp_checks, "fsdp: "), 40)


# ----------------------------------------------------------------------------- one process, threads
def _net():
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2))


def _cycle_checks(m, seed, rounds, errors):
    """Nested contexts on ``m``, each flag checked against what one thread alone gives."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3)
    for i in range(rounds):
        pick = str(int(torch.randint(3, (1,), generator=g)))
        try:
            with ts.freeze(m, pick):
                want = [not n.startswith(pick + ".") for n, _ in m.named_parameters()]
                got = _flags(m)
                m(x)  # the forward hook applies nothing new
                with ts.freeze_except(m, "2"), ts.unfreeze(m, "1"):
                    # freeze_except leaves "2" as it is (frozen when pick is "2")
                    inner = [n.startswith("1.") or (n.startswith("2.") and pick != "2")
                             for n, _ in m.named_parameters()]
                    if _flags(m) != inner:
                        errors.append(f"round {i}: inner {_flags(m)} != {inner}")
                if got != want or _flags(m) != want:
                    errors.append(f"round {i}: {got} / {_flags(m)} != {want}")
                if i % 10 == 0:
                    raise KeyError(i)  # restored also when the block raises
        except KeyError:
            pass
        if not all(_flags(m)):
            errors.append(f"round {i}: not restored {_flags(m)}")
        if i % 5 == 0:  # declarations and schedules, which other threads' contexts never see
            ts.mark_trainable(m, "1", "2")
            m(x)
            if _flags(m) != [False, False, True, True, True, True]:
                errors.append(f"round {i}: declared {_flags(m)}")
            ts.mark_trainable(m, None)
            sched = ts.UnfreezeSchedule(m, {0: "2", 1: None})
            if _flags(m) != [False, False, False, False, True, True]:
                errors.append(f"round {i}: schedule stage 1 {_flags(m)}")
            sched.step()
            if not all(_flags(m)):
                errors.append(f"round {i}: schedule stage 2 {_flags(m)}")
            sched.close()


def test_threads_with_contexts_on_different_models_see_their_own_flags_only():
    import sys

    models = [ts.attach(_net()) for _ in range(4)]
    errors, switch = [], sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # interleave as often as possible
    try:
        threads = [threading.Thread(target=_cycle_checks, args=(m, i, 60, errors))
                   for i, m in enumerate(models)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        sys.setswitchinterval(switch)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors[:5]
    assert all(all(_flags(m)) for m in models)
    assert all(ts.trainable_parameters(m) and len(list(ts.trainable_parameters(m))) == 6
               for m in models)


def test_one_model_from_two_threads_on_different_parameters_composes():
    """docs/freezing.md: contexts on the same *parameters* from two threads are not supported;
    on different parameters of one model they compose (exits in any order)."""
    m = ts.attach(_net())
    entered, leave = threading.Event(), threading.Event()
    seen = {}

    def holder():
        with ts.freeze(m, "0"):
            entered.set()
            leave.wait(10)
            seen["holder at exit"] = _flags(m)

    t = threading.Thread(target=holder)
    t.start()
    assert entered.wait(10)
    with ts.freeze(m, "2"):
        assert _flags(m) == [False, False, True, True, False, False]
        leave.set()
        t.join(10)
        # the first context, entered before this one, was left first: only this one holds
        assert _flags(m) == [True, True, True, True, False, False]
    assert all(_flags(m))
    assert seen["holder at exit"] == [False, False, True, True, False, False]


def test_a_with_block_suspended_in_a_generator_holds_until_closed_or_collected():
    m = ts.attach(_net())

    def gen():
        with ts.freeze(m, "0"):
            yield _flags(m)
            yield _flags(m)

    it = gen()
    assert next(it)[:2] == [False, False]
    assert _flags(m)[:2] == [False, False]  # a with block left open: it holds (plain Python)
    outer = ts.freeze(m, "1")  # entered after it, left after it
    it.close()  # the inner block is left first
    assert _flags(m) == [True, True, False, False, True, True]
    outer.__exit__(None, None, None)
    assert all(_flags(m))

    it = gen()
    next(it)
    with ts.unfreeze(m, "0"):  # the newer context wins while both hold
        assert _flags(m)[:2] == [True, True]
        del it
        gc.collect()  # the suspended generator is finalized: its block exits
        assert _flags(m)[:2] == [True, True]
    assert all(_flags(m))
    assert not [e for e in ts._state.entries if e.scope() is m]


@pytest.mark.parametrize("same_model", [False, True])
def test_a_suspended_block_left_from_inside_another_contexts_application(same_model):
    """Garbage collection may finalize a suspended generator at any allocation, also while
    another context applies (the lock is re-entrant): a callable selector closing it there
    stands for that moment."""
    a = ts.attach(_net())
    b = a if same_model else ts.attach(_net())

    def gen():
        with ts.freeze(b, "1"):
            yield
            yield

    it = gen()
    next(it)

    def closing(path, _p):
        it.close()
        return path.startswith("2.")

    with ts.freeze_except(a, closing):
        assert _flags(a) == [False, False, False, False, True, True]
        assert all(_flags(b)) or same_model
    assert all(_flags(a)) and all(_flags(b))
    assert not [e for e in ts._state.entries if e.scope() in (a, b)]


def test_a_decorated_generator_holds_only_while_it_runs_also_when_closed_or_collected():
    m = ts.attach(_net())
    inside = []

    @ts.freeze_except(m, "2")
    def gen():
        try:
            while True:
                yield _flags(m)
        finally:
            inside.append(_flags(m))  # finalization runs inside the context too

    frozen = [False, False, False, False, True, True]
    it = gen()
    assert next(it) == frozen and all(_flags(m))
    with pytest.raises(ZeroDivisionError):
        it.throw(ZeroDivisionError)
    assert inside == [frozen] and all(_flags(m))
    it = gen()
    next(it)
    del it
    gc.collect()
    assert inside == [frozen, frozen] and all(_flags(m))


def test_contexts_across_asyncio_tasks_compose_in_any_exit_order():
    a, b = ts.attach(_net()), ts.attach(_net())
    log = []

    async def task(m, sel, delay, name):
        with ts.freeze(m, sel):
            log.append((name, "in", _flags(a), _flags(b)))
            await asyncio.sleep(delay)
            log.append((name, "out", _flags(a), _flags(b)))

    async def main():
        await asyncio.gather(task(a, "0", 0.02, "a0"), task(a, "2", 0.0, "a2"),
                             task(b, "1", 0.01, "b1"))

    asyncio.run(main())
    steps = {(n, w): (fa, fb) for n, w, fa, fb in log}
    both = [False, False, True, True, False, False]
    assert steps[("a2", "in")][0] == both  # a0 entered first and still holds
    assert steps[("a2", "out")][0] == both
    assert steps[("a0", "out")][0] == [False, False, True, True, True, True]  # a2 left first
    assert steps[("b1", "out")] == (steps[("b1", "out")][0], [True, True, False, False, True, True])
    assert all(_flags(a)) and all(_flags(b))


def test_a_decorated_coroutine_function_runs_inside_the_context():
    m = ts.attach(_net())

    @ts.freeze(m, "0")
    async def step():
        await asyncio.sleep(0)
        return _flags(m)

    assert asyncio.run(step())[:2] == [False, False]
    assert all(_flags(m))
