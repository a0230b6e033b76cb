"""A training step (forward, backward, ts.clip_by_global_norm, ts.optim.AdamW.step) with the
model compiled on CPU gives the eager result, and the library's ops trace without graph breaks."""
import pytest
import torch
from torch import nn

import torchstruct as ts

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
