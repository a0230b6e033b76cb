"""Mixed precision: torch.autocast (bf16 on CPU) with freezing, structural gradients, the fused
optimizers and clipping. (GradScaler with the fused optimizers is in test_optim.py.)"""
import copy

import torch
from torch import nn

import torchstruct as ts


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))


def _loss(model, x, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    assert out.dtype == torch.bfloat16  # autocast really ran the matmuls in bf16
    return nn.functional.mse_loss(out.float(), y)


def test_autocast_training_step_matches_torch_and_keeps_frozen_weights():
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    ours, ref = _model(), _model()
    frozen_before = ours[0].weight.detach().clone()
    with ts.freeze_except(ours, "2", "3"), ts.freeze_except(ref, "2", "3"):
        opt = ts.optim.AdamW([p for _, p in ts.trainable_parameters(ours)], lr=1e-2, max_grad_norm=0.5)
        ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, foreach=False)
        for _ in range(5):
            for model, o in ((ours, opt), (ref, ref_opt)):
                o.zero_grad(set_to_none=True)
                _loss(model, x, y).backward()
                if o is ref_opt:
                    torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.grad is not None], 0.5)
                o.step()
    assert torch.equal(ours[0].weight, frozen_before)
    assert ours[0].weight.grad is None
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_structural_grad_under_autocast_equals_backward():
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    model, twin = _model(), _model()
    grads = ts.structural_grad(model, lambda m: _loss(m, x, y), wrt="3")
    _loss(twin, x, y).backward()
    flat = ts.tree.to_flat_dict(grads)
    assert set(flat) == {"3.weight", "3.bias"}
    for path, g in flat.items():
        assert g.dtype == torch.float32  # gradients of fp32 parameters stay fp32
        torch.testing.assert_close(g, twin.get_parameter(path).grad)


def test_clip_of_bf16_grads_accumulates_in_fp32():
    torch.manual_seed(1)
    params = [nn.Parameter(torch.randn(1000).bfloat16()) for _ in range(3)]
    for p in params:
        p.grad = torch.randn(1000).bfloat16() * 10
    twins = copy.deepcopy(params)
    for a, b in zip(params, twins):
        b.grad = a.grad.clone()
    exact = torch.linalg.vector_norm(torch.cat([p.grad.double() for p in params]))
    got = ts.clip_by_global_norm(params, 1.0)
    want = torch.nn.utils.clip_grad_norm_(twins, 1.0)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want.double(), rtol=1e-2, atol=0)
    assert abs(float(got) - float(exact)) / float(exact) < 1e-2
    for a, b in zip(params, twins):
        torch.testing.assert_close(a.grad, b.grad, rtol=2e-2, atol=1e-3)
