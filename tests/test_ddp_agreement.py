"""The ranks of a DDP group must agree on what trains (DESIGN.md §5: freezing rules for a DDP
model are enforced with a clear error or handled, never a hang).

With ``find_unused_parameters=True`` a synchronized parameter may stop training after wrapping.
Frozen on one rank only, DDP averages the other ranks' gradients with that rank's nothing, and
an optimizer that skips frozen parameters moves it on the other ranks only: the weights drift
apart. The backward of every reducing forward therefore checks, on every rank, that the ranks
train the same synchronized parameters. Each scenario below runs in two gloo processes
(``_spawn.py``); every comparison is between the ranks or against one process on the whole
batch.
"""
import contextlib

import pytest
import torch
from torch import nn

import torchstruct as ts
from _spawn import batch as _batch
from _spawn import check as _check
from _spawn import close as _close
from _spawn import failed as _failed
from _spawn import gloo_available, run
from _spawn import every_rank as _every_rank
from _spawn import half as _half
from _spawn import raises_on_every_rank as _raises_on_every_rank
from _spawn import same_on_all_ranks as _same_on_all_ranks
from _spawn import small_model as _model

pytestmark = pytest.mark.skipif(not gloo_available(), reason="gloo is not available")


def _mse(out, y):
    return nn.functional.mse_loss(out, y)


def _flags(m):
    return [p.requires_grad for p in m.parameters()]


def _values(m):
    return [p.detach().clone() for p in m.parameters()]


def _step_raises(checks, label, m, ddp, opt, x, y, words):
    """One training step whose backward must raise on every rank, naming ``words``, and
    change no flag, no parameter and no optimizer state; its gradients are in ``.grad``."""
    flags, values = _flags(m), _values(m)
    state = {id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
             for p, s in opt.state.items()}
    def step():
        _mse(ddp(x), y).backward()
        opt.step()

    _raises_on_every_rank(checks, label, step, words)
    _check(checks, f"{label}: flags unchanged", _flags(m) == flags, f"{flags} -> {_flags(m)}")
    _check(checks, f"{label}: parameters bitwise unchanged",
           all(torch.equal(a, b) for a, b in zip(values, _values(m))))
    after = {id(p): s for p, s in opt.state.items()}
    _check(checks, f"{label}: optimizer state unchanged",
           after.keys() == state.keys() and all(
               torch.equal(v, after[k][n]) if torch.is_tensor(v) else v == after[k][n]
               for k, s in state.items() for n, v in s.items()))
    _check(checks, f"{label}: the averaged gradients are in .grad, the same on every rank",
           _same_on_all_ranks([p.grad for p in m.parameters() if p.grad is not None]))


def _counting_checks(counter):
    """``(real, counted)``: torchstruct's check that the ranks agree, and a wrapper of it that
    also counts the ``dist.all_reduce`` calls made inside it, one entry per check."""
    import torchstruct.distributed as tsd

    real, all_reduce = tsd._agree_on_flags, tsd.dist.all_reduce

    def counted(ddp):
        made = []

        def counting(*args, **kwargs):
            made.append(1)
            return all_reduce(*args, **kwargs)

        tsd.dist.all_reduce = counting
        try:
            return real(ddp)
        finally:
            tsd.dist.all_reduce = all_reduce
            counter.append(len(made))

    return real, counted


def scenario(rank, checks):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import torchstruct.distributed as tsd

    x, y = _batch()
    xs, ys = _half(x, rank), _half(y, rank)

    # 1. ts.freeze on rank 0 only, then a ts.optim step: an error on both ranks, nothing moved;
    #    agreeing again, training goes on and the ranks stay equal
    m = _model()
    ddp = DDP(m, find_unused_parameters=True)
    opt = ts.optim.AdamW(m.parameters(), lr=0.1)
    _mse(ddp(xs), ys).backward()  # one agreeing step first: the optimizer has state
    opt.step()
    opt.zero_grad(set_to_none=True)
    if rank == 0:
        ts.freeze(m, "0")
    _step_raises(checks, "ts.freeze on one rank", m, ddp, opt, xs, ys, ["'0.weight'", "'0.bias'"])
    message = None
    try:
        _mse(ddp(xs), ys).backward()
    except RuntimeError as e:
        message = str(e)
    _check(checks, "the error repeats while the ranks disagree", _every_rank(message is not None))
    ts.freeze(m, "0")  # now on every rank
    opt.zero_grad(set_to_none=True)
    before = m[0].weight.detach().clone()
    for _ in range(2):
        _mse(ddp(xs), ys).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    _check(checks, "agreeing again: training goes on, the ranks equal",
           _same_on_all_ranks(_values(m)) and torch.equal(m[0].weight, before))

    # 2. the same freeze on every rank: no error, the same step as one process on the whole batch
    ref, m = _model(), _model()
    ts.freeze(ref, "2")
    ddp = DDP(m, find_unused_parameters=True)
    ts.freeze(m, "2")
    opts = [ts.optim.SGD(mm.parameters(), lr=0.1, momentum=0.9) for mm in (ref, m)]
    for _ in range(3):
        for call, a, b, opt in ((ref, x, y, opts[0]), (ddp, xs, ys, opts[1])):
            opt.zero_grad(set_to_none=True)
            _mse(call(a), b).backward()
            opt.step()
    _check(checks, "the same freeze on every rank: as one process",
           all(_close(p, q) for p, q in zip(m.parameters(), ref.parameters())))

    # 3. a flag written by hand on one rank, torch.optim stepping: an error all the same (plain
    #    torch.optim would move the parameter the rank froze)
    m = _model()
    ddp = DDP(m, find_unused_parameters=True)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    if rank == 1:
        m[4].bias.requires_grad_(False)
    _step_raises(checks, "requires_grad_(False) on one rank", m, ddp, opt, xs, ys, ["'4.bias'"])

    # 4. a freeze on one rank around the forward only: the flags agree again when the backward
    #    ends, the averaged gradient reaches both ranks, and both step alike
    m = _model()
    ddp = DDP(m, find_unused_parameters=True)
    opt = ts.optim.SGD(m.parameters(), lr=0.1)
    error = None
    try:
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            with ts.freeze(m, "0") if rank == 0 else contextlib.nullcontext():
                out = ddp(xs)
            _mse(out, ys).backward()
            opt.step()
    except RuntimeError as e:
        error = str(e)
    _check(checks, "a one-rank freeze around the forward only: no error",
           _every_rank(error is None), str(error))
    _check(checks, "a one-rank freeze around the forward only: the ranks equal",
           _same_on_all_ranks(_values(m)))

    # 5. one rank freezes in the micro-steps under no_sync() only: nothing is reduced there, the
    #    synchronized step agrees, the ranks stay equal
    m = _model()
    ddp = DDP(m, find_unused_parameters=True)
    opt = ts.optim.SGD(m.parameters(), lr=0.1)
    error = None
    try:
        with ddp.no_sync():
            with ts.freeze(m, "2") if rank == 0 else contextlib.nullcontext():
                _mse(ddp(xs), ys).backward()
        _mse(ddp(xs), ys).backward()
        opt.step()
    except RuntimeError as e:
        error = str(e)
    _check(checks, "a one-rank freeze inside no_sync() only: no error", _every_rank(error is None),
           str(error))
    _check(checks, "a one-rank freeze inside no_sync() only: the ranks equal",
           _same_on_all_ranks(_values(m)))

    # 6. the cost: one all-reduce per reducing backward, none elsewhere
    calls = []
    real, counted = _counting_checks(calls)
    tsd._agree_on_flags = counted
    try:
        m = _model()
        ddp = DDP(m, find_unused_parameters=True)
        for _ in range(3):
            _mse(ddp(xs), ys).backward()
        n_sync = len(calls)
        with ddp.no_sync():
            _mse(ddp(xs), ys).backward()
        with torch.no_grad():
            ddp(xs)
        n_other = len(calls) - n_sync
        out = ddp(xs)  # two outputs used in one loss: still one check
        (_mse(out[:2], ys[:2]) + _mse(out[2:], ys[2:])).backward()
        n_two = len(calls) - n_sync - n_other
        plain = DDP(_model())  # find_unused_parameters=False: the guard refuses instead
        _mse(plain(xs), ys).backward()
        n_plain = len(calls) - n_sync - n_other - n_two
    finally:
        tsd._agree_on_flags = real
    _check(checks, "one all-reduce per reducing backward", n_sync == 3 and calls[:3] == [1] * 3,
           str(calls))
    _check(checks, "none under no_sync() or no_grad", n_other == 0, str(n_other))
    _check(checks, "one per backward with several outputs", n_two == 1, str(n_two))
    _check(checks, "none without find_unused_parameters", n_plain == 0, str(n_plain))

    # 7. an unfreeze on one rank of a synchronized parameter frozen by a context on both
    m = _model()
    ddp = DDP(m, find_unused_parameters=True)
    opt = ts.optim.SGD(m.parameters(), lr=0.1)
    with ts.freeze(m, "2"):
        if rank == 0:
            with ts.unfreeze(m, "2.bias"):
                _step_raises(checks, "ts.unfreeze on one rank inside a shared freeze", m, ddp,
                             opt, xs, ys, ["'2.bias'"])
        else:
            _step_raises(checks, "ts.unfreeze on one rank inside a shared freeze", m, ddp, opt,
                         xs, ys, ["'2.bias'"])

    # 8. uneven inputs under Join: a rank that has run out of data shadows DDP's own
    #    collectives only, so no check is made there, and nothing waits
    from torch.distributed.algorithms.join import Join

    m = _model()
    ddp = DDP(m, find_unused_parameters=True)
    opt = ts.optim.SGD(m.parameters(), lr=0.1)
    calls = []
    real, counted = _counting_checks(calls)
    tsd._agree_on_flags = counted
    try:
        with Join([ddp]):
            for _ in range(3 if rank == 0 else 2):
                opt.zero_grad(set_to_none=True)
                _mse(ddp(xs), ys).backward()
                opt.step()
    finally:
        tsd._agree_on_flags = real
    _check(checks, "uneven inputs under Join: no check, no hang", not calls, str(len(calls)))
    dist.barrier()


@pytest.fixture(scope="module")
def checks():
    return run(scenario)


def _assert(per_rank, prefix, at_least):
    part = {r: [c for c in cs if c[0].startswith(prefix)] for r, cs in per_rank.items()}
    assert all(len(c) >= at_least for c in part.values()), {r: len(c) for r, c in part.items()}
    assert not _failed(part), "\n".join(_failed(part))


def test_a_freeze_on_one_rank_is_an_error_on_every_rank_and_changes_nothing(checks):
    _assert(checks, "ts.freeze on one rank", 6)
    _assert(checks, "the error repeats", 1)
    _assert(checks, "agreeing again", 1)


def test_a_hand_written_flag_on_one_rank_is_an_error_with_torch_optim_too(checks):
    _assert(checks, "requires_grad_(False) on one rank", 6)


def test_an_unfreeze_on_one_rank_is_an_error(checks):
    _assert(checks, "ts.unfreeze on one rank", 6)


def test_the_same_freeze_on_every_rank_trains_as_one_process(checks):
    _assert(checks, "the same freeze on every rank", 1)


def test_disagreements_that_end_before_the_reduction_are_no_error(checks):
    _assert(checks, "a one-rank freeze around the forward only", 2)
    _assert(checks, "a one-rank freeze inside no_sync() only", 2)


def test_uneven_inputs_under_join_are_not_checked_and_do_not_hang(checks):
    _assert(checks, "uneven inputs under Join", 1)


def test_the_check_is_one_all_reduce_per_reducing_backward(checks):
    _assert(checks, "one all-reduce per reducing backward", 1)
    _assert(checks, "none under", 1)
    _assert(checks, "one per backward with several outputs", 1)
    _assert(checks, "none without find_unused_parameters", 1)
