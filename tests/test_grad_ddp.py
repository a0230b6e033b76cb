"""structural_grad / value_and_grad on DistributedDataParallel (gloo, 2 processes): the
synchronized (averaged) gradient, exactly what ``.backward()`` leaves in ``.grad``, and DDP
still trains normally afterwards. Harness: ``tests/_spawn.py`` (bounded in time)."""
import pytest
import torch
from torch import nn

from _spawn import gloo_available, run
from _spawn import batch as _batch
from _spawn import half as _half
from _spawn import small_model as _model
from _spawn import check as _check
from _spawn import close as _close
from _spawn import failed as _failed

if not gloo_available():
    pytest.skip("torch.distributed with the gloo backend is not available", allow_module_level=True)

def _mse(out, y):
    return nn.functional.mse_loss(out, y)


def _backward_grads(ddp, call):
    """``{inner path: .grad}`` after ``call(ddp).backward()`` on a DDP wrapper (tied once)."""
    ddp.zero_grad(set_to_none=True)
    call(ddp).backward()
    seen, out = set(), {}
    for n, p in ddp.module.named_parameters():
        if id(p) not in seen and p.grad is not None:
            seen.add(id(p))
            out[n] = p.grad.clone()
    ddp.zero_grad(set_to_none=True)
    return out


def _same(checks, label, tree, want, prefix=""):
    import torchstruct as ts

    got = ts.tree.to_flat_dict(tree)
    _check(checks, f"{label}: paths", list(got) == [prefix + n for n in want],
           f"{list(got)} vs {list(want)}")
    for n, w in want.items():
        g = got.get(prefix + n)
        _check(checks, f"{label}: {n}", g is not None and torch.equal(g, w),
               "differs" if g is None else f"max diff {float((g - w).abs().max())}")


def _steps(ddp, xs, ys, steps=2):
    """A normal DDP training loop; returns the parameters after it."""
    opt = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=0.1)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        _mse(ddp(xs), ys).backward()
        opt.step()
    return [p.detach().clone() for p in ddp.parameters()]


class _Branchy(nn.Module):
    """``a`` is used by rank 0's batch only (``use_a``), ``spare`` by nobody."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.a, self.spare = nn.Linear(4, 2), nn.Linear(4, 2), nn.Linear(4, 2)
        self.use_a = False

    def forward(self, x):
        return self.body(x) + (self.a(x) if self.use_a else 0)


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Linear(4, 4, bias=False)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 4, bias=False)
        self.head.weight = self.emb.weight
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.head(torch.tanh(self.mid(self.emb(x))))))


class _Ckpt(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.mid, self.out = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return self.out(checkpoint(self.mid, torch.tanh(self.inp(x)), use_reentrant=True))


# ----------------------------------------------------------------------------- scenarios
def scenario_synchronized(rank, checks):
    import torchstruct as ts
    from torch.nn.parallel import DistributedDataParallel as DDP

    x, y = _batch()
    xs, ys = _half(x, rank), _half(y, rank)
    fn = lambda m: _mse(m(xs), ys)  # noqa: E731
    ref_ddp = DDP(_model())
    want = _backward_grads(ref_ddp, fn)
    want_after = _steps(ref_ddp, xs, ys)

    model = _model()
    ddp = DDP(model)
    _same(checks, "wrapper, callable", ts.structural_grad(ddp, fn), want, "module.")
    _same(checks, "inner module, callable", ts.structural_grad(model, fn), want)
    (value, g) = ts.value_and_grad(lambda m, a, b: _mse(m(a), b), ddp, xs, ys)
    _same(checks, "value_and_grad", g, want, "module.")
    _check(checks, "value is this rank's loss", torch.equal(value, fn(model).detach()))
    with ddp.no_sync():
        _same(checks, "tensor loss under no_sync", ts.structural_grad(ddp, fn(ddp)), want,
              "module.")
    _same(checks, "wrt", ts.structural_grad(ddp, fn, wrt="module.2"),
          {k: v for k, v in want.items() if k.startswith("2.")}, "module.")
    _check(checks, "no .grad written", all(p.grad is None for p in model.parameters()))
    # a tensor loss computed with synchronization on: refused, and DDP recovers after backward
    loss = fn(ddp)
    try:
        ts.structural_grad(ddp, loss)
        _check(checks, "tensor loss with sync on: raises", False)
    except ValueError as e:
        _check(checks, "tensor loss with sync on: message",
               "no_sync" in str(e) and "callable" in str(e), str(e))
    loss.backward()
    ddp.zero_grad(set_to_none=True)
    after = _steps(ddp, xs, ys)
    _check(checks, "normal DDP steps afterwards",
           all(torch.equal(a, b) for a, b in zip(after, want_after)))

    # find_unused_parameters=True: a parameter used on rank 0 only, one used by nobody
    def branchy():
        m = _Branchy()
        m.use_a = rank == 0
        return m

    ref_b = DDP(branchy(), find_unused_parameters=True)
    want_b = _backward_grads(ref_b, fn)
    want_b_after = _steps(ref_b, xs, ys)
    b = DDP(branchy(), find_unused_parameters=True)
    gb = ts.tree.to_flat_dict(ts.structural_grad(b, fn))
    for n, w in want_b.items():
        _check(checks, f"find_unused: {n}", torch.equal(gb["module." + n], w))
    _check(checks, "find_unused: a averaged with rank 1's zeros",
           "a.weight" in want_b and gb["module.a.weight"].abs().sum() > 0)
    _check(checks, "find_unused: spare (no rank uses it) zeros",
           "spare.weight" not in want_b and not gb["module.spare.weight"].any())
    _check(checks, "find_unused: normal steps afterwards",
           all(torch.equal(a, c) for a, c in zip(_steps(b, xs, ys), want_b_after)))

    # tied parameters
    _same(checks, "tied", ts.structural_grad(DDP(_Tied()), fn), _backward_grads(DDP(_Tied()), fn),
          "module.")

    # frozen before wrapping: the trainable ones as .backward(); wrt= a frozen one gives the
    # gradient of the mean loss over all ranks (the full batch)
    frozen = _model()
    ts.freeze(frozen, "0")
    ref_f = _model()
    ts.freeze(ref_f, "0")
    want_f = _backward_grads(DDP(ref_f), fn)
    fddp = DDP(frozen)
    _same(checks, "frozen: default", ts.structural_grad(fddp, fn), want_f, "module.")
    g0 = ts.structural_grad(fddp, fn, wrt="module.0")
    full = _model()
    _mse(full(x), y).backward()
    _check(checks, "frozen: wrt= a frozen layer is the full-batch gradient",
           _close(g0["module"]["0"]["weight"], full[0].weight.grad))
    _check(checks, "frozen: still frozen", not frozen[0].weight.requires_grad)
    _steps(fddp, xs, ys)
    _check(checks, "frozen: normal steps afterwards", frozen[0].weight.grad is None
           and frozen[2].weight.grad is not None)

    # reentrant activation checkpointing: the exact path, averaged
    cm = _Ckpt()
    gc = ts.tree.to_flat_dict(ts.structural_grad(DDP(cm), fn))
    single = _Ckpt()
    _mse(single(x), y).backward()
    for n, p in single.named_parameters():
        _check(checks, f"checkpoint: {n}", _close(gc["module." + n], p.grad))
    _check(checks, "checkpoint: no .grad written", all(p.grad is None for p in cm.parameters()))

    _refused(rank, checks, xs, ys, fn)


def _refused(rank, checks, xs, ys, fn):
    import torch.distributed as dist
    import torchstruct as ts
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    def raises(label, call, kind, words):
        try:
            call()
            _check(checks, f"{label}: raises", False)
        except kind as e:
            _check(checks, f"{label}: message", all(w in str(e) for w in words), str(e))

    hooked = DDP(_model())
    hooked.register_comm_hook(None, default_hooks.fp16_compress_hook)
    raises("fp16 comm hook", lambda: ts.structural_grad(hooked, fn), RuntimeError,
           ["'fp16_compress_hook'", "grad_tree"])
    plain = DDP(_model())
    plain.register_comm_hook(dist.group.WORLD, default_hooks.allreduce_hook)
    _same(checks, "allreduce_hook allowed", ts.structural_grad(plain, fn),
          _backward_grads(DDP(_model()), fn), "module.")
    raises("create_graph", lambda: ts.structural_grad(DDP(_model()), fn, create_graph=True),
           ValueError, ["create_graph"])

    # an error on rank 1 only: both ranks raise, nobody hangs, DDP still trains
    ddp = DDP(_model())

    def flaky(m):
        if rank == 1:
            raise KeyError("rank one failed")
        return fn(m)

    raises("one rank fails", lambda: ts.structural_grad(ddp, flaky),
           KeyError if rank == 1 else RuntimeError,
           ["rank one failed"] if rank == 1 else ["another rank"])
    ref = DDP(_model())
    _check(checks, "steps after a failure",
           all(torch.equal(a, b) for a, b in zip(_steps(ddp, xs, ys), _steps(ref, xs, ys))))
    # a loss from another model: every rank raises alike
    other = _model(seed=5)
    raises("another model", lambda: ts.structural_grad(DDP(_model()), lambda m: fn(other)),
           ValueError, ["reaches none"])


# ----------------------------------------------------------------------------- tests
def test_synchronized_gradients_and_refusals():
    """One run of two processes (start-up dominates the time) for every case."""
    per_rank = run(scenario_synchronized)
    assert not _failed(per_rank), "\n".join(_failed(per_rank))
    assert all(len(c) > 40 for c in per_rank.values())
