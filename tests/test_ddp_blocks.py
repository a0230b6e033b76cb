"""Blocks (``stop_gradient``, ``swap``) inside the forward of a DDP model built with
``find_unused_parameters=False``: a synchronized parameter a block keeps out of every use is
refused at the forward (DDP would wait for its gradient, reduce nothing of its bucket and fail
only at the next step), naming the paths; every other case is plain DDP.

One process (gloo, world size 1): the refusal is decided on each rank from its own graph; the
two-process checks are in ``test_audit_distributed.py``."""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import torchstruct as ts
from torchstruct import distributed as ts_distributed

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with the gloo backend is not available", allow_module_level=True)


@pytest.fixture(autouse=True)
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


X = torch.randn(5, 3)


def grads(m):
    return [None if p.grad is None else p.grad.clone() for p in m.parameters()]


def step_matches_plain(ddp, m):
    """A normal step after the refusal: DDP reduces, and the gradients are the plain ones."""
    plain = copy.deepcopy(m)
    m.zero_grad(set_to_none=True)
    ddp(X).sum().backward()
    plain(X).sum().backward()
    return all(torch.allclose(a, b) for a, b in zip(grads(m), grads(plain)))


@pytest.mark.parametrize("block", ["stop_gradient", "swap"])
def test_a_block_over_every_use_is_refused_naming_the_paths(block):
    m = net()
    ddp = DDP(m)
    ddp(X).sum().backward()  # a first normal step
    m.zero_grad(set_to_none=True)
    ctx = (ts.stop_gradient(m, "0") if block == "stop_gradient"
           else ts.swap(m, {"0.weight": torch.zeros(4, 3), "0.bias": torch.zeros(4)}))
    with pytest.raises(RuntimeError, match=r"reaches '0\.weight', '0\.bias' .*"
                                           r"find_unused_parameters=True"):
        with ctx:
            ddp(X)
    assert grads(m) == [None] * 4
    assert all(p.requires_grad for p in m.parameters())
    assert step_matches_plain(ddp, m)  # DDP's reducer was left ready for the next step


class BlockInside(nn.Module):
    """The block entered and left inside the forward (the decorator form)."""

    def __init__(self, both_uses_blocked):
        super().__init__()
        self.enc, self.head = nn.Linear(3, 4), nn.Linear(4, 1)
        self.both = both_uses_blocked

    def forward(self, x):
        blocked = ts.stop_gradient(self, "enc")(self.enc)(x)
        other = ts.stop_gradient(self, "enc")(self.enc)(x) if self.both else self.enc(x)
        return self.head(blocked + other)


def test_a_block_entered_and_left_inside_the_forward_is_seen():
    ddp = DDP(BlockInside(both_uses_blocked=True))
    with pytest.raises(RuntimeError, match=r"'enc\.weight', 'enc\.bias'"):
        ddp(X)


def test_a_block_over_one_use_of_two_is_plain_ddp():
    m = BlockInside(both_uses_blocked=False)
    plain = copy.deepcopy(m)
    ddp = DDP(m)
    ddp(X).sum().backward()
    plain(X).sum().backward()
    assert all(torch.allclose(a, b) for a, b in zip(grads(m), grads(plain)))
    # the blocked use gives no gradient: only the unblocked one does
    enc_only = copy.deepcopy(plain)
    enc_only.zero_grad()
    with torch.no_grad():
        first = enc_only.enc(X)
    enc_only.head(first + enc_only.enc(X)).sum().backward()
    assert torch.allclose(m.enc.weight.grad, enc_only.enc.weight.grad)


@pytest.mark.parametrize("options", [dict(find_unused_parameters=True),
                                     dict(static_graph=True)])
def test_wrappers_that_cope_with_unused_parameters_are_not_refused(options):
    m = net()
    ddp = DDP(m, **options)
    for _ in range(2):
        with ts.stop_gradient(m, "0"):
            ddp(X).sum().backward()
        assert m[0].weight.grad is None and m[2].weight.grad is not None
        m.zero_grad(set_to_none=True)


def test_no_sync_no_grad_and_outputs_without_grad_are_not_refused():
    m = net()
    ddp = DDP(m)
    with ts.stop_gradient(m, "0"):
        with ddp.no_sync():  # no reduction is prepared
            ddp(X).sum().backward()
        with torch.no_grad():
            ddp(X)
    m.zero_grad(set_to_none=True)
    with ts.stop_gradient(m):  # every parameter blocked: nothing to differentiate at all
        out = ddp(X)
    assert not out.requires_grad
    assert step_matches_plain(ddp, m)


class Outputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 2), nn.Linear(3, 2)

    def forward(self, x):
        return {"a": (self.a(x),), "b": [self.b(x)], "scale": self.b.bias}


def test_outputs_in_containers_and_a_parameter_returned_as_is():
    m = Outputs()
    ddp = DDP(m)
    with ts.stop_gradient(m, "b.weight"):  # b.bias is still returned itself
        with pytest.raises(RuntimeError, match=r"reaches 'b\.weight' \("):
            ddp(X)
    with ts.stop_gradient(m, "a"):
        with pytest.raises(RuntimeError, match=r"reaches 'a\.weight', 'a\.bias' \("):
            ddp(X)


def test_parameters_ddp_does_not_synchronize_are_not_waited_for():
    m = net()
    m[0].requires_grad_(False)  # frozen before wrapping: DDP does not wait for them
    ddp = DDP(m)
    with ts.stop_gradient(m, "0"):
        ddp(X).sum().backward()
    m2 = net()
    m2._ddp_params_and_buffers_to_ignore = ["0.weight", "0.bias"]
    ddp2 = DDP(m2)
    with ts.stop_gradient(m2, "0"):
        ddp2(X).sum().backward()
    assert m2[0].weight.grad is None and m2[2].weight.grad is not None


def test_a_block_on_another_model_is_not_this_wrappers_concern(monkeypatch):
    m, other = net(), net()
    ddp = DDP(m)
    walks = []
    real = ts_distributed._unreached
    monkeypatch.setattr(ts_distributed, "_unreached", lambda *a: walks.append(1) or real(*a))
    ddp(X).sum().backward()
    assert walks == []  # no block: no walk of the graph
    with ts.stop_gradient(other):
        ddp(X).sum().backward()
    assert walks == [1]  # a block was active: the walk finds every parameter used
    assert all(p.grad is not None for p in m.parameters())
