"""torchstruct under ``torch.compile``, tried as a suspicious user who trains compiled.

Audited: an attached model compiled (the ``torch.compile`` wrapper, ``model.compile()`` in place,
a compiled step function; ``dynamic=True`` and ``mode="reduce-overhead"``) whose trainable set
changes between steps (contexts entered around compiled calls, bare contexts, declarations, an
adapter added after compiling); ``stop_gradient`` / ``swap`` blocks around a compiled model and
entered inside compiled functions; ``constant`` around a compiled training step; structural
gradients of compiled losses; ``clip_by_global_norm`` / ``global_norm`` and ``ts.optim`` inside
compiled steps; ``within_gradient`` under compile; frozen BatchNorm statistics; and how often
compiled code recompiles once a change has been applied.

Every result is compared with eager PyTorch written by hand (``detach``, ``requires_grad_``,
``torch.autograd.grad``, ``clip_grad_norm_``, ``torch.optim``), never with torchstruct itself.
The default inductor backend is used at least once for each feature; ``aot_eager`` where
inductor adds nothing but compile time. Every test starts from ``torch._dynamo.reset()``.

A test marked ``xfail(strict=True)`` reproduces a case that goes wrong today; its reason says
what happens and what is expected.
"""
import copy
import os
import warnings

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch.autograd import forward_ad as fwad

import torchstruct as ts

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = [
    pytest.mark.skipif(not hasattr(torch, "compile"), reason="torch.compile is not available"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
F = nn.functional


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def flat(tree):
    return ts.tree.to_flat_dict(tree)


def params(m):
    return dict(m.named_parameters())


def by_hand(model, loss_fn, trainable):
    """Eager PyTorch's answer: a plain copy (no hooks), flags set by hand, autograd.grad."""
    ref = copy.deepcopy(model)
    ts.detach_hooks(ref)
    ps = params(ref)
    for n, p in ps.items():
        p.requires_grad_(n in trainable)
    loss = loss_fn(ref)
    names = [n for n in ps if n in trainable]
    gs = torch.autograd.grad(loss, [ps[n] for n in names], allow_unused=True)
    return loss.detach(), {n: g for n, g in zip(names, gs) if g is not None}


def grads(m):
    return {n: p.grad for n, p in m.named_parameters() if p.grad is not None}


def assert_grads(m, want):
    got = grads(m)
    assert list(got) == list(want), (list(got), list(want))
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=n)


# ------------------------------------------------------------ trainable set changes, compiled
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.ln = nn.LayerNorm(4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)
        self.adapters = nn.ModuleDict()

    def forward(self, idx):
        h = torch.tanh(self.body(self.ln(self.emb(idx))))
        for a in self.adapters.values():
            h = h + a(h)
        return self.head(h).mean()


def _net():
    torch.manual_seed(0)
    return Net()


def _check_step(m, call, idx, trainable):
    """One compiled forward/backward: which parameters got ``.grad``, their values, the loss
    and the flags all equal eager PyTorch with the flags set by hand."""
    for p in m.parameters():
        p.grad = None
    out = call(idx)
    out.backward()
    names = [n for n, _ in m.named_parameters()]
    trainable = [n for n in names if n in trainable]
    want_loss, want = by_hand(m, lambda r: r(idx), trainable)
    torch.testing.assert_close(out.detach(), want_loss)
    assert_grads(m, want)
    assert [n for n, p in m.named_parameters() if p.requires_grad] == trainable


def _walk_trainable_sets(m, call, short=False):
    idx = torch.randint(0, 10, (3, 5), generator=torch.Generator().manual_seed(1))
    everything = [n for n, _ in m.named_parameters()]
    head = ["head.weight", "head.bias"]
    _check_step(m, call, idx, everything)
    with ts.freeze_except(m, "head"):
        _check_step(m, call, idx, head)
        with ts.unfreeze(m, "ln"):
            _check_step(m, call, idx, head + ["ln.weight", "ln.bias"])
        if not short:
            with ts.freeze(m, "head.bias"):
                _check_step(m, call, idx, ["head.weight"])
    _check_step(m, call, idx, everything)  # no stale graph keeps the old set
    ts.mark_trainable(m, "body", "adapters")
    _check_step(m, call, idx, ["body.weight", "body.bias"])
    m.adapters["a"] = nn.Linear(4, 4)  # added after compiling: admitted by the declaration
    adapter = ["adapters.a.weight", "adapters.a.bias"]
    _check_step(m, call, idx, ["body.weight", "body.bias"] + adapter)
    ts.mark_trainable(m, None)
    ts.freeze(m, "emb")  # bare: permanent
    rest = [n for n in everything + adapter if not n.startswith("emb")]
    _check_step(m, call, idx, rest)
    if not short:
        m.head2 = nn.Linear(4, 1)  # registered, unused by forward
        _check_step(m, call, idx, rest + ["head2.weight", "head2.bias"])
        rest = rest + ["head2.weight", "head2.bias"]
    counters.clear()
    for _ in range(2):
        _check_step(m, call, idx, rest)
    assert counters["stats"]["unique_graphs"] == 0  # settled: nothing compiles any more
    _check_step(m, call, torch.randint(0, 10, (2, 7)), rest)  # another shape


@pytest.mark.parametrize("how", ["wrapper-inductor", "in_place-aot_eager",
                                 "dynamic-aot_eager", "reduce_overhead-inductor"])
def test_trainable_set_changes_between_steps_of_a_compiled_model(how):
    m = _net()
    if how == "wrapper-inductor":
        call = torch.compile(m)
    elif how == "in_place-aot_eager":
        m.compile(backend="aot_eager")
        call = m
    elif how == "dynamic-aot_eager":
        call = torch.compile(m, backend="aot_eager", dynamic=True)
    else:
        call = torch.compile(m, mode="reduce-overhead")
    _walk_trainable_sets(m, call, short=how.startswith("reduce"))
