"""Block-local contexts at their edges, each against plain PyTorch:

* a ``stop_gradient`` block entered inside a custom function's forward (a reentrant
  checkpoint's) leaves the gradient of a parameter handed to that function outside it;
* ``constant`` refuses the writes no schema flags (batch norm's running statistics given as
  parameters, in training only), the in-place methods that reach no aten op (``apply_``,
  ``map_``), ``share_memory_`` (the memory would move), and writes given an empty parameter
  itself; it allows a metadata-only change of an alias (``p.detach().t_()``).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import torchstruct as ts


@pytest.mark.parametrize("how", ["reentrant", "non_reentrant", "plain"])
def test_stop_gradient_inside_a_checkpointed_function_keeps_the_outer_use(how):
    torch.manual_seed(0)
    m = nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)

    def fn(x, w):
        h = x @ w.t()  # a use outside the block
        with ts.stop_gradient(m, "weight"):
            return m(torch.tanh(h))

    y = (fn(x, m.weight) if how == "plain"
         else checkpoint(fn, x, m.weight, use_reentrant=how == "reentrant"))
    y.sum().backward()
    # by hand: the in-block use through a detached weight
    w = m.weight.detach().clone().requires_grad_(True)
    (torch.tanh(x.detach() @ w.t()) @ m.weight.detach().t() + m.bias.detach()).sum().backward()
    torch.testing.assert_close(m.weight.grad, w.grad)


class _StatsAsParameters(nn.Module):
    def __init__(self):
        super().__init__()
        self.rm = nn.Parameter(torch.zeros(3), requires_grad=False)
        self.rv = nn.Parameter(torch.ones(3), requires_grad=False)

    def forward(self, x, training=True):
        return F.batch_norm(x, self.rm, self.rv, training=training)


def test_constant_refuses_batch_norm_updating_statistics_held_as_parameters():
    bn = _StatsAsParameters()
    with ts.constant(bn), pytest.raises(RuntimeError, match="'rm'"):
        bn(torch.randn(8, 3) + 5)
    assert torch.equal(bn.rm, torch.zeros(3)) and torch.equal(bn.rv, torch.ones(3))
    with ts.constant(bn):
        bn(torch.randn(8, 3) + 5, training=False)  # reads only


@pytest.mark.parametrize("write", ["apply_", "map_", "share_memory"])
def test_constant_refuses_writes_that_reach_no_aten_op(write):
    torch.manual_seed(0)
    m = nn.Linear(3, 3)
    before = m.weight.detach().clone()
    with ts.constant(m), torch.no_grad(), pytest.raises(RuntimeError, match="'weight'"):
        if write == "apply_":
            m.weight.data.apply_(lambda v: 0.0)
        elif write == "map_":
            m.weight.data.map_(m.weight.data, lambda a, b: 0.0)
        else:
            m.share_memory()
    assert torch.equal(m.weight.detach(), before) and not m.weight.is_shared()
    with ts.constant(m, "bias"), torch.no_grad():
        m.weight.data.apply_(lambda v: v)  # not selected: allowed


def test_constant_protects_an_empty_parameter_given_itself():
    m = nn.Module()
    m.p = nn.Parameter(torch.empty(0))
    with ts.constant(m), torch.no_grad(), pytest.raises(RuntimeError, match="'p'"):
        m.p.set_(torch.ones(3))
    assert m.p.shape == (0,)


def test_constant_allows_metadata_changes_of_an_alias_only():
    m = nn.Linear(3, 2)
    with ts.constant(m), torch.no_grad():
        alias = m.weight.detach()
        alias.t_()
        alias.unsqueeze_(0)
        with pytest.raises(RuntimeError, match="'weight'"):
            m.weight.t_()  # the parameter itself
    assert m.weight.shape == (2, 3)


def test_constant_passes_share_memory_that_moves_nothing():
    m = nn.Linear(2, 2)
    m.share_memory()
    with ts.constant(m):
        m.share_memory()  # already shared: nothing moves
    assert m.weight.is_shared()
