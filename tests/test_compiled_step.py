"""A training step (forward, backward, ts.clip_by_global_norm, ts.optim.AdamW.step) with the
model compiled on CPU gives the eager result, and the library's ops trace without graph breaks;
the whole step function compiled, and ``torch.compile(opt.step)`` alone, give it too, also when
what trains changes after compilation."""
import pytest
import torch
from torch import nn

import torchstruct as ts
from _flags import STALE_GRAPHS

pytestmark = pytest.mark.skipif(not hasattr(torch, "compile"), reason="torch.compile unavailable")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))


def _train(model, forward, steps=4):
    torch.manual_seed(1)
    opt = ts.optim.AdamW([p for _, p in ts.trainable_parameters(model)], lr=1e-2)
    norms = []
    for _ in range(steps):
        x, y = torch.randn(16, 8), torch.randn(16, 4)
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(forward(x), y).backward()
        norms.append(ts.clip_by_global_norm(model, 0.5))
        opt.step()
    return norms


def test_compiled_training_step_equals_eager():
    eager, compiled = _model(), _model()
    with ts.freeze_except(eager, "4"), ts.freeze_except(compiled, "4"):
        want = _train(eager, eager)
        got = _train(compiled, torch.compile(compiled, backend="inductor"))
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-5, atol=1e-6)
    for a, b in zip(compiled.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert compiled[0].weight.grad is None  # frozen: never got a gradient


def test_library_ops_trace_without_graph_breaks():
    from torchstruct import _ops

    if not _ops.compiled_available():
        pytest.skip("torch.ops.torchstruct is registered by the compiled extension, not built")
    torch._dynamo.reset()
    grads = [torch.randn(10), torch.randn(3, 3)]

    def step(gs):
        norm = torch.ops.torchstruct.global_norm(gs, 2.0)
        coef = torch.clamp(0.5 / (norm + 1e-6), max=1.0)
        return norm, [g * coef for g in gs]

    explained = torch._dynamo.explain(step)(grads)
    assert explained.graph_break_count == 0, explained.break_reasons
    norm, scaled = torch.compile(step, fullgraph=True, backend="aot_eager")(grads)
    torch.testing.assert_close(norm, torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])))


# ----------------------------------------------------------------------------- the whole step
# The whole step function -- zero_grad, forward, backward, ts.clip_by_global_norm (or the clip
# folded into the optimizer), ts.optim.AdamW.step -- under torch.compile. Dynamo breaks the graph
# at zero_grad and at backward(), and around the optimizer's plan, which runs eagerly (see the
# requires_grad test below). The frozen part is decided by ts.freeze_except; in the first case
# it is lifted mid-run and the compiled step must follow, exactly as eager does.

def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(),
                         nn.Linear(16, 4))


def _batches(n):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)) for _ in range(n)]


def _make_step(model, folded):
    # All parameters go to the optimizer: the frozen ones are skipped at step time.
    if folded:
        opt = ts.optim.AdamW(model.parameters(), lr=1e-2, max_grad_norm=0.5)
    else:
        opt = ts.optim.AdamW(model.parameters(), lr=1e-2)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if folded:
            opt.step()
            return loss.detach(), opt.last_grad_norm
        norm = ts.clip_by_global_norm(model, 0.5)
        opt.step()
        return loss.detach(), norm

    return opt, step


def _run_steps(model, step, batches, frozen_steps):
    """``frozen_steps`` steps with only layers 2 and 4 trainable, then the rest unfrozen."""
    out = []
    with ts.freeze_except(model, "2", "4"):
        for x, y in batches[:frozen_steps]:
            out.append(tuple(t.clone() for t in step(x, y)))
        frozen_after = (model[0].weight.detach().clone(), model[0].weight.grad)
    for x, y in batches[frozen_steps:]:
        out.append(tuple(t.clone() for t in step(x, y)))
    return out, frozen_after


def _assert_same_state(got_model, got_opt, want_model, want_opt, tol):
    """Parameters and optimizer state (step, exp_avg, exp_avg_sq) equal, entry for entry."""
    for (name, a), b in zip(got_model.named_parameters(), want_model.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), **tol,
                                   msg=lambda m, n=name: f"{n}: {m}")
        sa, sb = got_opt.state.get(a, {}), want_opt.state.get(b, {})
        assert sa.keys() == sb.keys(), name
        for key in sb:
            torch.testing.assert_close(sa[key], sb[key], **tol,
                                       msg=lambda m, n=name, k=key: f"{n} {k}: {m}")


@pytest.mark.parametrize(
    "backend,folded,frozen_steps",
    [("inductor", False, 4), ("aot_eager", True, 6)],
    ids=["inductor-clip_by_global_norm-unfrozen_mid_run", "aot_eager-max_grad_norm-frozen"])
@STALE_GRAPHS
def test_compiled_whole_step_equals_eager(backend, folded, frozen_steps):
    torch._dynamo.reset()
    batches = _batches(6)
    eager, compiled = _mlp(), _mlp()
    init0 = eager[0].weight.detach().clone()
    want_opt, want_step = _make_step(eager, folded)
    got_opt, got_step = _make_step(compiled, folded)
    want, want_frozen = _run_steps(eager, want_step, batches, frozen_steps)
    got, got_frozen = _run_steps(compiled, torch.compile(got_step, backend=backend), batches,
                                 frozen_steps)
    torch._dynamo.reset()
    tol = dict(rtol=1e-5, atol=1e-6)
    for i, ((loss_g, norm_g), (loss_w, norm_w)) in enumerate(zip(got, want)):
        torch.testing.assert_close(loss_g, loss_w, **tol, msg=lambda m, i=i: f"loss {i}: {m}")
        torch.testing.assert_close(norm_g, norm_w, **tol, msg=lambda m, i=i: f"norm {i}: {m}")
    # While frozen, layer 0 got no gradient, no state, and stayed bitwise unchanged.
    for weight, grad in (want_frozen, got_frozen):
        assert grad is None
        assert torch.equal(weight, init0)
    if frozen_steps < len(batches):
        # After the freeze was lifted, layer 0 trained, compiled as eager: the guards followed.
        assert not torch.equal(compiled[0].weight.detach(), init0)
        assert got_opt.state[compiled[0].weight]["step"].item() == len(batches) - frozen_steps
    else:
        assert compiled[0].weight not in got_opt.state
    assert got_opt.state[compiled[4].weight]["step"].item() == len(batches)
    _assert_same_state(compiled, got_opt, eager, want_opt, tol)


def test_compiled_optimizer_step_alone_equals_eager():
    """``torch.compile(opt.step)`` alone (the clip folded in), the gradients computed eagerly,
    a frozen part included: parameters and state equal eager's."""
    torch._dynamo.reset()
    batches = _batches(4)
    eager, compiled = _mlp(), _mlp()
    want_opt = ts.optim.AdamW(eager.parameters(), lr=1e-2, max_grad_norm=0.5)
    got_opt = ts.optim.AdamW(compiled.parameters(), lr=1e-2, max_grad_norm=0.5)
    got_step = torch.compile(got_opt.step, backend="inductor")
    with ts.freeze_except(eager, "4"), ts.freeze_except(compiled, "4"):
        for x, y in batches:
            for model, opt, step in ((eager, want_opt, want_opt.step),
                                     (compiled, got_opt, got_step)):
                opt.zero_grad(set_to_none=True)
                nn.functional.mse_loss(model(x), y).backward()
                step()
    torch._dynamo.reset()
    assert set(got_opt.state) == {compiled[4].weight, compiled[4].bias}
    _assert_same_state(compiled, got_opt, eager, want_opt, dict(rtol=1e-5, atol=1e-6))


def test_compiled_optimizer_step_sets_last_grad_norm():
    """Dynamo does not replay attribute writes on optimizers (pytorch/pytorch#171590); the
    norm is recorded outside the compiled code."""
    torch._dynamo.reset()
    w = nn.Parameter(torch.ones(3))
    opt = ts.optim.AdamW([w], lr=0.1, max_grad_norm=0.5)
    step = torch.compile(opt.step, backend="aot_eager")
    w.grad = torch.full((3,), 2.0)
    step()
    torch._dynamo.reset()
    assert opt.last_grad_norm is not None
    torch.testing.assert_close(opt.last_grad_norm, torch.tensor(12.0).sqrt())


@pytest.mark.parametrize("change", ["unfreeze", "freeze_with_stale_grad"])
def test_compiled_optimizer_step_follows_requires_grad_changes(change):
    """Dynamo guards the parameters it reaches through param_groups by identity only, so a plan
    traced into the compiled step would bake the flags in (an unfrozen parameter never stepped,
    a frozen one with a stale .grad stepped); the plan runs eagerly and the rest resumes on it."""
    def run(compiled):
        torch._dynamo.reset()
        w0, w1 = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
        opt = ts.optim.AdamW([w0, w1], lr=0.1)
        step = torch.compile(opt.step, backend="aot_eager") if compiled else opt.step
        w0.requires_grad_(change != "unfreeze")
        for _ in range(2):  # two steps: the state exists, no more recompilation for it
            w0.grad, w1.grad = torch.ones(2), torch.ones(2)
            step()
        w0.requires_grad_(change == "unfreeze")
        w0.grad, w1.grad = torch.ones(2), torch.ones(2)
        step()
        torch._dynamo.reset()
        return w0.detach(), w1.detach()

    for got, want in zip(run(compiled=True), run(compiled=False)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
