"""Frozen parameters get no gradient; gradients still reach inputs (a small transformer)."""

import pytest
import torch
from torch import nn

import torchstruct as ts


class TinyTransformer(nn.Module):
    def __init__(self, d=16, heads=2, layers=2, classes=3):
        super().__init__()
        self.embed = nn.Linear(5, d)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(d, heads, 32, dropout=0.0, batch_first=True),
            num_layers=layers,
            enable_nested_tensor=False,
        )
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        return self.head(self.norm(self.encoder(self.embed(x))).mean(dim=1))


def _check(model, trainable, x):
    for path, p in model.named_parameters():
        if path in trainable:
            assert p.grad is not None, path
            assert torch.isfinite(p.grad).all(), path
        else:
            assert p.grad is None, path
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_freeze_except_head_leaves_frozen_grads_none_and_reaches_input():
    torch.manual_seed(0)
    model = TinyTransformer()
    x = torch.randn(2, 4, 5, requires_grad=True)
    with ts.freeze_except(model, "head"):
        model(x).pow(2).sum().backward()
    _check(model, {"head.weight", "head.bias"}, x)
    # after the block everything trains again
    assert all(p.requires_grad for p in model.parameters())


def test_freeze_except_head_on_bare_transformer_encoder_layer():
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), nn.Linear(8, 1)
    )
    x = torch.randn(3, 5, 8, requires_grad=True)
    with ts.freeze_except(model, "1"):
        model(x).sum().backward()
    _check(model, {"1.weight", "1.bias"}, x)


def test_gradients_match_full_backward_for_the_trainable_ones():
    torch.manual_seed(2)
    model = TinyTransformer()
    x = torch.randn(2, 4, 5, requires_grad=True)
    model(x).pow(2).sum().backward()
    want_head = model.head.weight.grad.clone()
    want_x = x.grad.clone()
    model.zero_grad(set_to_none=True)
    x.grad = None
    with ts.freeze_except(model, "head"):
        model(x).pow(2).sum().backward()
    torch.testing.assert_close(model.head.weight.grad, want_head)
    torch.testing.assert_close(x.grad, want_x)


def test_frozen_subgraph_without_input_grad_is_not_recorded():
    torch.manual_seed(3)
    model = TinyTransformer()
    x = torch.randn(2, 4, 5)  # no grad wanted for the input
    with ts.freeze_except(model, "head"):
        with torch.no_grad():
            feats = model.norm(model.encoder(model.embed(x)))
        hidden = model.norm(model.encoder(model.embed(x)))
        # nothing upstream of the head requires grad: autograd records no graph there
        assert hidden.grad_fn is None and not hidden.requires_grad
        model.head(hidden.mean(dim=1)).sum().backward()
        torch.testing.assert_close(hidden, feats)
    for path, p in model.named_parameters():
        assert (p.grad is not None) == path.startswith("head."), path


@pytest.mark.parametrize("sel", ["encoder.layers.1", "*.self_attn", "norm"])
def test_freeze_except_inner_parts(sel):
    torch.manual_seed(4)
    model = TinyTransformer()
    x = torch.randn(2, 4, 5, requires_grad=True)
    with ts.freeze_except(model, sel):
        want = {path for path, _ in ts.trainable_parameters(model)}
        model(x).sum().backward()
    assert want
    _check(model, want, x)
