"""DistributedDataParallel (gloo, 2 processes on 127.0.0.1) with torchstruct.

Each scenario runs in two fresh processes (``tests/_spawn.py``: bounded in time, a hang fails
the test). The workers compare against a single-process model computed in the worker
itself (same seeds), so the parent only collects verdicts.
"""
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

# ----------------------------------------------------------------------------- scenarios
def _loss(out, y):
    # The mean over each rank's half; DDP averages the ranks' gradients, so the result is the
    # gradient of the mean over the full batch.
    return nn.functional.mse_loss(out, y)


def _train(call, model, x, y, steps=2):
    """Two SGD steps; returns the per-step ``{path: grad or None}`` and the final parameters."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    grads = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        _loss(call(x), y).backward()
        grads.append({n: None if p.grad is None else p.grad.clone()
                      for n, p in model.named_parameters()})
        opt.step()
    return grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _same_training(checks, label, got, want):
    (g_got, p_got), (g_want, p_want) = got, want
    for step, (a, b) in enumerate(zip(g_got, g_want)):
        for name in b:
            if b[name] is None:
                _check(checks, f"{label} step {step} {name} no grad", a[name] is None,
                       "a frozen parameter got a gradient")
            else:
                _check(checks, f"{label} step {step} {name} grad",
                       a[name] is not None and _close(a[name], b[name]), "gradient differs")
    for name in p_want:
        _check(checks, f"{label} {name} after steps", _close(p_got[name], p_want[name]))


def scenario_global_norm(rank, checks):
    import torchstruct as ts
    from torch.nn.parallel import DistributedDataParallel as DDP

    x, y = _batch()
    ref = _model()
    _loss(ref(x), y).backward()
    want = ts.global_norm(ref)

    model = _model()
    ddp = DDP(model)
    _loss(ddp(_half(x, rank)), _half(y, rank)).backward()
    got_wrapper = ts.global_norm(ddp)
    got_inner = ts.global_norm(model)
    _check(checks, "global_norm(ddp) == single-process", _close(got_wrapper, want),
           f"{float(got_wrapper)} vs {float(want)}")
    _check(checks, "global_norm(ddp.module) == single-process", _close(got_inner, want),
           f"{float(got_inner)} vs {float(want)}")
    for p_norm in (1.0, float("inf")):
        _check(checks, f"global_norm(ddp, {p_norm})",
               _close(ts.global_norm(ddp, p_norm), ts.global_norm(ref, p_norm)))
    # Frozen before wrapping: the norm is over the trainable gradients only, on every rank.
    ref2 = _model()
    ts.freeze(ref2, "0")
    _loss(ref2(x), y).backward()
    model2 = _model()
    ts.freeze(model2, "0")
    ddp2 = DDP(model2)
    _loss(ddp2(_half(x, rank)), _half(y, rank)).backward()
    _check(checks, "global_norm with a frozen layer", _close(ts.global_norm(ddp2),
                                                             ts.global_norm(ref2)))


def scenario_before_wrapping(rank, checks):
    import torchstruct as ts
    from torch.nn.parallel import DistributedDataParallel as DDP

    x, y = _batch()
    xs, ys = _half(x, rank), _half(y, rank)

    # A permanent freeze_except, then wrapping.
    ref = _model()
    ts.freeze_except(ref, "4")
    want = _train(ref, ref, x, y)
    model = _model()
    ts.freeze_except(model, "4")
    ddp = DDP(model)
    _same_training(checks, "freeze_except", _train(ddp, model, xs, ys), want)

    # A declaration (mark_trainable), then wrapping.
    ref = _model()
    ts.mark_trainable(ref, "2", "4")
    want = _train(ref, ref, x, y)
    model = _model()
    ts.mark_trainable(model, "2", "4")
    ddp = DDP(model)
    _same_training(checks, "mark_trainable", _train(ddp, model, xs, ys), want)

    # A temporary context around wrapping and training.
    ref = _model()
    with ts.freeze(ref, "0", "2"):
        want = _train(ref, ref, x, y)
    model = _model()
    with ts.freeze(model, "0", "2"):
        ddp = DDP(model)
        got = _train(ddp, model, xs, ys)
    _same_training(checks, "with freeze", got, want)
    _check(checks, "flags restored", all(p.requires_grad for p in model.parameters()))


def _raises_clearly(checks, label, fn, model, words):
    """``fn()`` must raise RuntimeError naming DDP and ``words``, changing no flag."""
    before = [p.requires_grad for p in model.parameters()]
    try:
        fn()
    except RuntimeError as e:
        msg = str(e)
        ok = "DistributedDataParallel" in msg and all(w in msg for w in words)
        _check(checks, f"{label}: message", ok, msg)
    else:
        _check(checks, f"{label}: raises", False,
               "no error; flags are now " + str([p.requires_grad for p in model.parameters()]))
    _check(checks, f"{label}: flags unchanged",
           [p.requires_grad for p in model.parameters()] == before)


def scenario_after_wrapping(rank, checks):
    """The proposed behaviour: changing the trained set of a wrapped model is refused with a
    clear error unless DDP can cope (``find_unused_parameters=True`` and only freezing)."""
    import torchstruct as ts
    from torch.nn.parallel import DistributedDataParallel as DDP

    x, y = _batch()
    xs, ys = _half(x, rank), _half(y, rank)

    # 1. Freezing after wrapping, find_unused_parameters=False: DDP's reducer would wait for
    #    gradients that never come ("Expected to have finished reduction ...").
    model = _model()
    ddp = DDP(model)
    hint = ["find_unused_parameters"]
    _raises_clearly(checks, "freeze(inner)", lambda: ts.freeze(model, "0"), model, hint)
    _raises_clearly(checks, "freeze(wrapper)", lambda: ts.freeze(ddp, "module.0"), model, hint)
    _raises_clearly(checks, "freeze_except(inner)", lambda: ts.freeze_except(model, "4"),
                    model, hint)
    _raises_clearly(checks, "mark_trainable(inner)", lambda: ts.mark_trainable(model, "4"),
                    model, hint)
    # Block-local tools change no flag and need no guard, but one that keeps a synchronized
    # parameter out of every use makes it unused: refused at the forward, before any gradient.
    try:
        with ts.stop_gradient(model, "0"):
            _loss(ddp(xs), ys).backward()
        said = "no error"
    except RuntimeError as e:
        said = str(e)
    _check(checks, "stop_gradient over every use refused", "'0.weight', '0.bias'" in said
           and all(p.grad is None for p in model.parameters()), said)
    _loss(ddp(xs), ys).backward()  # the wrapper trains on
    _check(checks, "trains on after the refusal", model[0].weight.grad is not None)

    # 2. Unfreezing a parameter DDP does not synchronise: its gradient would silently differ
    #    between ranks. Refused whatever find_unused_parameters is; the fix is to re-wrap.
    for fup in (False, True):
        model = _model()
        ts.freeze(model, "0")
        ddp = DDP(model, find_unused_parameters=fup)
        _raises_clearly(checks, f"unfreeze(fup={fup})", lambda: ts.unfreeze(model, "0"),
                        model, ["wrap"])
        # A context that leaves the synchronised set as it is stays allowed.
        with ts.freeze(model, "0"):
            pass
        _check(checks, f"no-op freeze allowed (fup={fup})", not model[0].weight.requires_grad
               and model[2].weight.requires_grad)

    # 3. find_unused_parameters=True: freezing after wrapping is handled, and trains exactly
    #    like a single process with the same layer frozen.
    ref = _model()
    with ts.freeze(ref, "0"):
        want = _train(ref, ref, x, y)
    model = _model()
    ddp = DDP(model, find_unused_parameters=True)
    with ts.freeze(model, "0"):
        got = _train(ddp, model, xs, ys)
    _same_training(checks, "freeze with find_unused_parameters", got, want)


def scenario_norm_and_before_wrapping(rank, checks):
    norm, before = [], []
    scenario_global_norm(rank, norm)
    scenario_before_wrapping(rank, before)
    checks.extend(("norm: " + n, ok, m) for n, ok, m in norm)
    checks.extend(("before: " + n, ok, m) for n, ok, m in before)


# ----------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def norm_and_before_wrapping():
    """One pair of processes for (a) and (b): starting interpreters dominates the cost."""
    return run(scenario_norm_and_before_wrapping)


def _part(per_rank, prefix):
    return {r: [c for c in checks if c[0].startswith(prefix)] for r, checks in per_rank.items()}


def test_global_norm_of_ddp_model_equals_single_process(norm_and_before_wrapping):
    per_rank = _part(norm_and_before_wrapping, "norm: ")
    assert all(len(c) == 5 for c in per_rank.values()), per_rank
    assert not _failed(per_rank), "\n".join(_failed(per_rank))


def test_declarations_and_contexts_before_wrapping(norm_and_before_wrapping):
    per_rank = _part(norm_and_before_wrapping, "before: ")
    assert all(len(c) > 30 for c in per_rank.values()), {r: len(c) for r, c in per_rank.items()}
    assert not _failed(per_rank), "\n".join(_failed(per_rank))


def test_changing_the_trained_set_after_wrapping_is_refused_or_handled():
    per_rank = run(scenario_after_wrapping)
    assert not _failed(per_rank), "\n".join(_failed(per_rank))
