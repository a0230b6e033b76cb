"""Three recent guarantees, tried as a suspicious user would.

1. DDP (``find_unused_parameters=True``): every reducing backward ends with a check that the
   ranks train the same synchronized parameters; a disagreement is a ``RuntimeError`` on every
   rank (never a hang) that changes nothing. Tried with dict, dataclass and mixed-tuple outputs,
   a loss using one output only, parameters DDP ignores, an ``UnfreezeSchedule`` or a
   declaration on one rank, tied weights, two wrappers in one process (a GAN step), a
   ``GradScaler``, and backwards that DDP does not reduce. Every run is two gloo processes
   (``_spawn.py``); every comparison is between the ranks or against plain DDP.
2. An attached model whose declaration froze a layer it shares with another attached model is
   garbage-collected: the survivors' flags and torchstruct's reads agree at once (reference
   cycles, three models, a survivor under ``freeze_except``, an ``UnfreezeSchedule``, tied
   weights, a collection in another thread, a collection during a forward), compared with the
   flags a fresh model would get.
3. ``stop_gradient`` / ``swap`` / ``constant`` under ``torch.compile``: values and gradients
   equal eager mode for many operations, blocks entered inside compiled functions and compiled
   models called inside blocks, and no recompilation for fresh batches.

A test marked ``xfail(strict=True)`` reproduces a case that goes wrong today; its reason says
what happens and what is expected.
"""
import contextlib
import copy
import dataclasses
import datetime
import gc
import threading

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import _spawn
import torchstruct as ts
from _flags import flags, reads
from _spawn import check as _check
from _spawn import failed as _failed
from _spawn import every_rank as _every_rank
from _spawn import gloo_available
from torchstruct._compile_caveats import MODES_MISTRACED
from _spawn import raises_on_every_rank as _raises_on_every_rank
from _spawn import same_on_all_ranks as _same_on_all_ranks

DDP_ONLY = pytest.mark.skipif(not gloo_available(), reason="gloo is not available")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# ============================================================================ 1. DDP agreement
@dataclasses.dataclass
class _Out:
    logits: torch.Tensor
    hidden: torch.Tensor


class _DictNet(nn.Module):
    """Returns what HF models return: a dict (or a dataclass) of several tensors."""

    def __init__(self, kind="dict"):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(4, 8)
        self.head = nn.Linear(8, 2)
        self.aux = nn.Linear(8, 1)
        self.kind = kind

    def forward(self, x):
        h = self.body(x).tanh()
        if self.kind == "dict":
            return {"logits": self.head(h), "aux": self.aux(h), "n": 3}
        if self.kind == "tuple":
            return self.head(h), None, "text", 3, [self.aux(h)]
        return _Out(self.head(h), self.aux(h))


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(6, 4)
        self.mid = nn.Linear(4, 4)
        self.out = nn.Linear(4, 6, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids):
        return self.out(self.mid(self.emb(ids)).tanh())


def _no_error(checks, label, step):
    error = None
    try:
        step()
    except RuntimeError as e:
        error = str(e)
    _check(checks, f"{label}: no error on any rank", _every_rank(error is None), str(error))


def ddp_scenario(rank, checks):
    from torch.nn.parallel import DistributedDataParallel as DDP

    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)

    # dict / dataclass / tuple-with-non-tensors outputs, the loss using some outputs only
    for kind in ("dict", "dataclass", "tuple"):
        m = _DictNet(kind)
        ddp = DDP(m, find_unused_parameters=True)
        # (plain DDP needs every tensor of a dataclass output in the loss)
        logits = (lambda o: o["logits"]) if kind == "dict" else (
            (lambda o: o.logits + o.hidden) if kind == "dataclass" else (lambda o: o[0]))
        if rank == 1:
            ts.freeze(m, "body")
        before = [p.detach().clone() for p in m.parameters()]
        _raises_on_every_rank(checks, f"{kind} output, one loss term",
                           lambda: (logits(ddp(x)) - y).square().mean().backward(),
                           ["'body.weight'", "'body.bias'"])
        _check(checks, f"{kind} output, one loss term: parameters unchanged",
               all(torch.equal(a, b) for a, b in zip(before, m.parameters())))
        if rank == 1:
            ts.unfreeze(m, "body")  # agreeing again: an ordinary step, the ranks equal
        for p in m.parameters():
            p.grad = None
        _no_error(checks, f"{kind} output, agreeing again",
                  lambda: (logits(ddp(x)) - y).square().mean().backward())
        _check(checks, f"{kind} output, agreeing again: the gradients equal on both ranks",
               _same_on_all_ranks([p.grad for p in m.parameters() if p.grad is not None]))

    # parameters DDP ignores may be frozen on one rank only
    m = _DictNet("dict")
    m._ddp_params_and_buffers_to_ignore = ["aux.weight", "aux.bias"]
    ddp = DDP(m, find_unused_parameters=True)
    if rank == 0:
        ts.freeze(m, "aux")
    _no_error(checks, "a one-rank freeze of ignored parameters",
              lambda: (ddp(x)["logits"] - y).square().mean().backward())
    _check(checks, "a one-rank freeze of ignored parameters: synchronized gradients equal",
           _same_on_all_ranks([m.body.weight.grad, m.head.weight.grad]))

    # an UnfreezeSchedule built after wrapping, stepped once more on rank 0 than on rank 1
    m = _DictNet("dict")
    ddp = DDP(m, find_unused_parameters=True)
    sched = ts.UnfreezeSchedule(m, {0: "head", 1: "aux", 2: None})
    opt = ts.optim.SGD(m.parameters(), lr=0.1)

    def step():
        opt.zero_grad(set_to_none=True)
        out = ddp(x)
        ((out["logits"] - y).square().mean() + out["aux"].mean()).backward()
        opt.step()

    _no_error(checks, "a schedule in step on both ranks", step)
    sched.step()
    if rank == 0:
        sched.step()  # rank 0 runs ahead: "body" trains there only
    before = [p.detach().clone() for p in m.parameters()]
    _raises_on_every_rank(checks, "a schedule one stage ahead on one rank", step,
                       ["'body.weight'"])
    _check(checks, "a schedule one stage ahead on one rank: parameters unchanged",
           all(torch.equal(a, b) for a, b in zip(before, m.parameters())))
    if rank == 1:
        sched.step()
    _no_error(checks, "a schedule caught up", step)
    _check(checks, "a schedule caught up: the ranks equal",
           _same_on_all_ranks(list(m.parameters())))

    # a declaration made on one rank after wrapping applies at the next forward
    m = _DictNet("dict")
    ddp = DDP(m, find_unused_parameters=True)
    if rank == 1:
        ts.mark_trainable(m, "head", "aux")
    _raises_on_every_rank(checks, "a declaration on one rank",
                       lambda: (ddp(x)["logits"] - y).square().mean().backward(),
                       ["'body.weight'"])

    # tied weights frozen on one rank: named once, by their first path
    m = _Tied()
    ddp = DDP(m, find_unused_parameters=True)
    ids = torch.randint(0, 6, (5,), generator=g)
    if rank == 0:
        ts.freeze(m, "emb")
    _raises_on_every_rank(checks, "a tied weight frozen on one rank",
                       lambda: ddp(ids).square().mean().backward(), ["'emb.weight'"])

    # a GradScaler-scaled backward: the same check
    m = _DictNet("dict")
    ddp = DDP(m, find_unused_parameters=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    if rank == 0:
        ts.freeze(m, "head")
    _raises_on_every_rank(checks, "a scaled backward",
                       lambda: scaler.scale((ddp(x)["logits"] - y).square().mean()).backward(),
                       ["'head.weight'"])

    # two wrappers in one process, a GAN step: the discriminator frozen by hand on every rank
    # while the generator trains, as pix2pix / CycleGAN do
    torch.manual_seed(0)
    gen, disc = nn.Linear(3, 4), nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    dgen, ddisc = (DDP(gen, find_unused_parameters=True),
                   DDP(disc, find_unused_parameters=True))
    og, od = torch.optim.SGD(gen.parameters(), lr=0.1), torch.optim.SGD(disc.parameters(), lr=0.1)
    z, real = torch.randn(4, 3, generator=g), torch.randn(4, 4, generator=g)

    def gan_step():
        for p in disc.parameters():
            p.requires_grad_(True)
        od.zero_grad()
        fake = dgen(z)
        sign = torch.tensor([1.0] * 4 + [-1.0] * 4)
        (ddisc(torch.cat([fake.detach(), real])).squeeze(1) * sign).mean().backward()
        od.step()
        for p in disc.parameters():
            p.requires_grad_(False)
        og.zero_grad()
        (-ddisc(dgen(z)).mean()).backward()
        og.step()

    _no_error(checks, "a GAN step, the discriminator frozen on every rank",
              lambda: [gan_step() for _ in range(2)])
    _check(checks, "a GAN step: both models equal on both ranks",
           _same_on_all_ranks([*gen.parameters(), *disc.parameters()]))

    # the gradient of the output with respect to the input on every rank (a gradient
    # penalty, a saliency map) before the loss's backward: as plain DDP
    m = _DictNet("dict")
    ddp = DDP(m, find_unused_parameters=True)
    xi = x.clone().requires_grad_()

    def penalty_step():
        out = ddp(xi)
        (gx,) = torch.autograd.grad(out["logits"].sum(), xi, retain_graph=True)
        ((out["logits"] - y).square().mean() + out["aux"].mean()).backward()
        return gx

    _no_error(checks, "an input gradient on every rank", lambda: [penalty_step()
                                                                 for _ in range(2)])
    _check(checks, "an input gradient on every rank: the gradients equal",
           _same_on_all_ranks([p.grad for p in m.parameters()]))


@pytest.fixture(scope="module")
def ddp_checks():
    return _spawn.run(ddp_scenario)


def _assert(per_rank, prefix, at_least=1):
    part = {r: [c for c in cs if c[0].startswith(prefix)] for r, cs in per_rank.items()}
    assert all(len(c) >= at_least for c in part.values()), {r: len(c) for r, c in part.items()}
    assert not _failed(part), "\n".join(_failed(part))


@DDP_ONLY
@pytest.mark.parametrize("kind", ["dict", "dataclass", "tuple"])
def test_ddp_disagreement_with_structured_outputs_and_a_partial_loss(ddp_checks, kind):
    _assert(ddp_checks, f"{kind} output", 5)


@DDP_ONLY
def test_ddp_parameters_it_ignores_may_be_frozen_on_one_rank(ddp_checks):
    _assert(ddp_checks, "a one-rank freeze of ignored parameters", 2)


@DDP_ONLY
def test_ddp_an_unfreeze_schedule_one_stage_ahead_on_one_rank(ddp_checks):
    _assert(ddp_checks, "a schedule", 6)


@DDP_ONLY
def test_ddp_a_declaration_on_one_rank(ddp_checks):
    _assert(ddp_checks, "a declaration on one rank", 2)


@DDP_ONLY
def test_ddp_a_tied_weight_frozen_on_one_rank(ddp_checks):
    _assert(ddp_checks, "a tied weight frozen on one rank", 2)


@DDP_ONLY
def test_ddp_a_grad_scaler_backward(ddp_checks):
    _assert(ddp_checks, "a scaled backward", 2)


@DDP_ONLY
def test_ddp_two_wrappers_in_a_gan_step(ddp_checks):
    _assert(ddp_checks, "a GAN step", 2)


@DDP_ONLY
def test_ddp_an_input_gradient_on_every_rank_before_the_backward(ddp_checks):
    _assert(ddp_checks, "an input gradient on every rank", 2)


# ---------------------------------------------------- backwards DDP reduces without the check
def _short_group():
    """A group whose collectives give up after 5 s: a rank left waiting fails quickly."""
    import torch.distributed as dist

    return dist.new_group([0, 1], timeout=datetime.timedelta(seconds=5))


def ddp_zero_loss_scenario(rank, checks):
    """Rank 1 has no usable data this step and backpropagates the usual zero loss over the
    parameters (it keeps DDP's reduction going) instead of a loss of the output."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    group = _short_group()
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    ddp = DDP(m, find_unused_parameters=True, process_group=group)
    x = torch.randn(2, 4)
    error = None
    try:
        for _ in range(2):
            out = ddp(x)
            loss = out.sum() if rank == 0 else 0 * sum(p.sum() for p in m.parameters())
            loss.backward()
        ok = _same_on_all_ranks([p.grad for p in m.parameters()], group)
    except RuntimeError as e:
        error, ok = str(e)[:300], False
    _check(checks, "zero loss on one rank", error is None and ok, str(error))


def ddp_one_rank_input_gradient_scenario(rank, checks):
    """Rank 0 alone takes the gradient of the output with respect to the input (a saliency map
    for logging) before the shared backward: ``torch.autograd.grad`` reduces nothing in DDP."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    group = _short_group()
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    ddp = DDP(m, find_unused_parameters=True, process_group=group)
    x = torch.randn(2, 4, requires_grad=True)
    error = None
    try:
        for _ in range(2):
            out = ddp(x)
            if rank == 0:
                torch.autograd.grad(out.sum(), x, retain_graph=True)
            out.square().sum().backward()
        ok = _same_on_all_ranks([p.grad for p in m.parameters()], group)
    except RuntimeError as e:
        error, ok = str(e)[:300], False
    _check(checks, "an input gradient on one rank", error is None and ok, str(error))


def _run_quick(scenario, monkeypatch):
    monkeypatch.setattr(_spawn, "DEADLINE", 25.0)
    per_rank = _spawn.run(scenario)
    assert not _failed(per_rank), "\n".join(_failed(per_rank))
    assert all(per_rank.values())


@DDP_ONLY
def test_ddp_a_zero_loss_over_the_parameters_on_one_rank_does_not_hang(monkeypatch):
    _run_quick(ddp_zero_loss_scenario, monkeypatch)


@DDP_ONLY
def test_ddp_an_input_gradient_on_one_rank_only_is_no_collective(monkeypatch):
    _run_quick(ddp_one_rank_input_gradient_scenario, monkeypatch)


# ================================================== 2. a model sharing a layer is collected
def _a_and_b_freezing_their_shared_layer(cycle=False):
    """``a`` (attached, no declaration) and ``b`` share ``shared``; ``b``'s declaration trains
    nothing, so the shared layer is frozen in ``a`` too while ``b`` lives."""
    shared = nn.Linear(2, 2)
    a = nn.Sequential(nn.Linear(2, 2), shared)
    b = nn.Sequential(shared)
    ts.attach(a)
    ts.mark_trainable(b)
    if cycle:
        b.loop = [b]  # collected by gc.collect() only
    assert flags(a) == reads(a) == [True, True, False, False]
    return shared, a, b


def test_a_model_in_a_reference_cycle_is_collected_by_gc_and_the_survivor_applies_at_once():
    shared, a, b = _a_and_b_freezing_their_shared_layer(cycle=True)
    del b
    assert flags(a) == reads(a) == [True, True, False, False]  # alive until gc.collect()
    gc.collect()
    assert flags(a) == reads(a) == [True] * 4


def test_three_models_sharing_a_layer_both_survivors_apply_at_once():
    shared = nn.Linear(2, 2)
    a = nn.Sequential(nn.Linear(2, 2), shared)
    c = nn.Sequential(shared, nn.Linear(2, 2))
    b = nn.Sequential(shared)
    ts.attach(a)
    ts.attach(c)
    ts.mark_trainable(b)
    assert flags(a) == [True, True, False, False] and flags(c) == [False, False, True, True]
    del b
    gc.collect()
    assert flags(a) == reads(a) == [True] * 4
    assert flags(c) == reads(c) == [True] * 4


@pytest.mark.parametrize("how", ["freeze_except", "nested freeze and unfreeze"])
def test_a_survivor_inside_its_own_contexts_applies_at_once_and_restores_after(how):
    shared, a, b = _a_and_b_freezing_their_shared_layer()
    with contextlib.ExitStack() as stack:
        if how == "freeze_except":
            stack.enter_context(ts.freeze_except(a, "1"))
            assert flags(a) == [False] * 4  # freeze_except leaves the selected as they are
        else:
            stack.enter_context(ts.freeze(a, "0"))
            stack.enter_context(ts.unfreeze(a, "1.bias"))
        del b
        gc.collect()
        # what a model that never shared the layer gets under the same contexts
        assert flags(a) == reads(a) == [False, False, True, True]
    assert flags(a) == reads(a) == [True] * 4


def test_a_survivor_with_an_unfreeze_schedule_keeps_the_stage_then_follows_it():
    shared, a, b = _a_and_b_freezing_their_shared_layer()
    sched = ts.UnfreezeSchedule(a, {0: "0", 1: None})
    del b
    gc.collect()
    assert flags(a) == reads(a) == [True, True, False, False]  # stage 0: only "0" trains
    sched.step()
    assert flags(a) == reads(a) == [True] * 4


def test_a_survivor_whose_own_declaration_also_freezes_the_layer_keeps_it_frozen():
    shared, a, b = _a_and_b_freezing_their_shared_layer()
    ts.mark_trainable(a, "0")
    del b
    gc.collect()
    assert flags(a) == reads(a) == [True, True, False, False]


def test_a_tied_embedding_frozen_by_the_collected_model_trains_again():
    emb = nn.Embedding(4, 2)
    a = nn.Sequential(emb, nn.Linear(2, 4))
    a[1].weight = emb.weight  # tied: one parameter, listed once
    b = nn.Sequential(emb)
    ts.attach(a)
    ts.mark_trainable(b)
    assert flags(a) == reads(a) == [False, True]
    del b
    gc.collect()
    assert flags(a) == reads(a) == [True, True]


def test_a_collection_in_another_thread_while_a_context_is_active_here():
    shared, a, b = _a_and_b_freezing_their_shared_layer()
    box = [b]
    del b
    with ts.freeze(a, "0"):
        t = threading.Thread(target=lambda: (box.clear(), gc.collect()))
        t.start()
        t.join()
        assert flags(a) == reads(a) == [False, False, True, True]
    assert flags(a) == reads(a) == [True] * 4


@pytest.mark.parametrize("when", ["forward", "backward"])
def test_a_collection_during_the_survivors_forward_or_backward(when):
    shared, a, b = _a_and_b_freezing_their_shared_layer()
    box = [b]
    del b
    collect = lambda *_: (box.clear(), gc.collect(), None)[-1]  # noqa: E731
    x = torch.randn(3, 2)
    if when == "forward":  # before the shared layer runs: it is used trainable
        handle = shared.register_forward_pre_hook(collect)
        a(x).sum().backward()
        handle.remove()
        assert shared.weight.grad is not None
    else:
        y = a(x)
        y.register_hook(collect)
        y.sum().backward()
        assert shared.weight.grad is None  # frozen when the forward ran, as in plain PyTorch
    assert flags(a) == reads(a) == [True] * 4


def test_after_the_collection_compiled_code_and_a_new_optimizer_train_the_shared_layer():
    shared, a, b = _a_and_b_freezing_their_shared_layer()
    torch._dynamo.reset()
    cm = torch.compile(a, backend="aot_eager")
    x = torch.randn(3, 2)
    cm(x).sum().backward()
    assert [p.grad is not None for p in a.parameters()] == [True, True, False, False]
    a.zero_grad(set_to_none=True)
    del b
    gc.collect()
    ref = copy.deepcopy(a)  # plain PyTorch: every flag on
    ts.detach_hooks(ref)
    opt = ts.optim.SGD(a.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    cm(x).sum().backward()
    ref(x).sum().backward()
    opt.step()
    ref_opt.step()
    for p, q in zip(a.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
    torch._dynamo.reset()


def test_a_collection_during_functional_call_of_the_survivor_leaves_flags_and_reads_agreeing():
    shared, a, b = _a_and_b_freezing_their_shared_layer()
    box = [b]
    del b
    params = {k: v.detach().clone() for k, v in a.named_parameters()}
    handle = a[0].register_forward_hook(lambda *_: (box.clear(), gc.collect(), None)[-1])
    torch.func.functional_call(a, params, (torch.randn(1, 2),))
    handle.remove()
    assert reads(a) == [True] * 4  # the collected model's declaration no longer holds
    assert flags(a) == reads(a)


# ================================================================= 3. blocks under torch.compile
def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def _ops(m, x):
    """Functions, methods, operators, in-place ops, views, reductions and property reads."""
    y = x.clone()
    y.add_(1).mul_(2)
    return [x.tanh(), x.sigmoid(), torch.exp(x), x + 1, x * 2, x / 3, -x, x ** 2, abs(x),
            nn.functional.gelu(x), x.sum(0), x.mean(1), x.T, x.flip(0), x.clamp(-0.1, 0.1),
            x.softmax(-1), x @ x.T, x.reshape(-1), x.view(3, 4), x[0], x[:, 1], x.cumsum(0),
            x.max(0).values, x.norm(), torch.where(x > 0, x, 0.0), y,
            x.new_full((1,), float(x.shape[0])), m(x[:, :3]), m[0](x[:, :3]).sigmoid(),
            m[2].weight * 2 + m[2].bias[:, None], torch.tensor([float(x.requires_grad)])]


def _enter(m, block):
    tree = {k: v.detach() + 0.1 for k, v in m.named_parameters()}
    if block == "stop_gradient":
        return ts.stop_gradient(m, "0")
    if block == "swap":
        return ts.swap(m, tree)
    if block == "constant":
        return ts.constant(m)
    stack = contextlib.ExitStack()
    stack.enter_context(ts.stop_gradient(m, "0"))
    stack.enter_context(ts.swap(m, {"2.weight": tree["2.weight"]}))
    return stack


def _same(got, want, msg=""):
    assert len(got) == len(want), msg
    for i, (a, b) in enumerate(zip(got, want)):
        assert (a is None) == (b is None), f"{msg} {i}"
        if a is not None:
            torch.testing.assert_close(a, b, msg=f"{msg} {i}")


@pytest.mark.parametrize("block", ["stop_gradient", "swap", "constant", "nested"])
def test_many_operations_in_a_block_entered_inside_a_compiled_function_equal_eager(block):
    torch._dynamo.reset()
    m = _net()

    def f(x):
        with _enter(m, block):
            outs = _ops(m, x)
        return outs + [sum(o.float().sum() for o in outs)]

    x = torch.randn(4, 3, requires_grad=True)
    params = [x, *m.parameters()]
    want = f(x)
    want_grads = torch.autograd.grad(want[-1], params, allow_unused=True)
    cf = torch.compile(f, backend="aot_eager")
    for call in range(2):  # the second call runs the cached graphs
        got = cf(x)
        _same(got, want, f"call {call}, output")
        _same(torch.autograd.grad(got[-1], params, allow_unused=True), want_grads,
              f"call {call}, gradient")
    torch._dynamo.reset()


def test_nested_blocks_around_a_compiled_model_compile_once_for_fresh_batches():
    torch._dynamo.reset()
    m = _net()
    w2 = m[2].weight.detach() * 2
    cm = torch.compile(m, backend="aot_eager")
    per_call = []
    for i in range(5):
        x = torch.randn(5, 3, generator=torch.Generator().manual_seed(i))
        counters.clear()
        with ts.stop_gradient(m, "0"), ts.swap(m, {"2.weight": w2}):
            got = cm(x)
        per_call.append(counters["stats"]["unique_graphs"])
        with ts.stop_gradient(m, "0"), ts.swap(m, {"2.weight": w2}):
            want = m(x)
        torch.testing.assert_close(got, want)
    assert sum(per_call[1:]) == 0, per_call
    torch._dynamo.reset()


def test_functional_call_and_torch_func_grad_inside_a_block_inside_compiled_code():
    torch._dynamo.reset()
    m = _net()

    def with_functional_call(x, params):
        with ts.stop_gradient(m, "0"):
            return torch.func.functional_call(m, params, (x,)).sum()

    def with_func_grad(x):
        loss = lambda p, x: torch.func.functional_call(m, p, (x,)).square().sum()  # noqa: E731
        with ts.stop_gradient(m, "2"):
            return torch.func.grad(loss)(dict(m.named_parameters()), x)

    compiled = torch.compile(with_functional_call, backend="aot_eager")
    for i in range(3):
        params = {k: v.detach().clone().requires_grad_() for k, v in m.named_parameters()}
        x = torch.randn(5, 3)
        got, want = compiled(x, params), with_functional_call(x, params)
        torch.testing.assert_close(got, want)
        _same(torch.autograd.grad(got, list(params.values()), allow_unused=True),
              torch.autograd.grad(want, list(params.values()), allow_unused=True))
    x = torch.randn(5, 3)
    got = torch.compile(with_func_grad, backend="aot_eager")(x)
    want = with_func_grad(x)
    assert list(got) == list(want)
    _same(list(got.values()), list(want.values()))
    assert all(torch.count_nonzero(want[k]) == 0 for k in ("2.weight", "2.bias"))
    torch._dynamo.reset()


@pytest.mark.parametrize("block", ["stop_gradient", "swap"])
def test_one_function_compiled_outside_and_inside_a_block_in_one_compiled_step(block):
    """The same helper runs before, inside and after a block entered in a compiled function:
    each call's graph must be the one for its place (values and gradients as eager)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = nn.Linear(3, 4)
    tree = {"weight": torch.randn(4, 3, requires_grad=True)}

    def helper(x):
        return nn.functional.linear(x, m.weight, m.bias).tanh()

    def f(x):
        y = helper(x)
        with ts.stop_gradient(m, "weight") if block == "stop_gradient" else ts.swap(m, tree):
            z = helper(x)
        return (y * z + helper(2 * x)).sum()

    x = torch.randn(2, 3, requires_grad=True)
    wrt = [x, m.weight, m.bias, tree["weight"]]
    want = f(x)
    want_grads = torch.autograd.grad(want, wrt, allow_unused=True)
    cf = torch.compile(f, backend="aot_eager")
    for _ in range(2):
        got = cf(x)
        torch.testing.assert_close(got, want)
        _same(torch.autograd.grad(got, wrt, allow_unused=True), want_grads)
    torch._dynamo.reset()


class _TransposeNet(nn.Module):
    """``x @ self.w.T + self.b``: a transpose read as a property of the parameter."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, 3))
        self.b = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return x @ self.w.T + self.b


@pytest.mark.parametrize("fullgraph", [False, True])
def test_a_compiled_model_reading_a_parameters_transpose_inside_stop_gradient(fullgraph):
    torch._dynamo.reset()
    m = _TransposeNet()
    cm = torch.compile(m, backend="aot_eager", fullgraph=fullgraph)
    x = torch.randn(2, 3, requires_grad=True)
    with ts.stop_gradient(m, "w"):
        want = m(x)
    want_grads = torch.autograd.grad(want.sum(), [x, m.w, m.b], allow_unused=True)
    if fullgraph and MODES_MISTRACED:  # the handler is left out of compiled code: a clear error
        with ts.stop_gradient(m, "w"), pytest.raises(Exception, match="disable"):
            cm(x)
        torch._dynamo.reset()
        return
    with ts.stop_gradient(m, "w"):
        got = cm(x)
    torch.testing.assert_close(got, want)
    _same(torch.autograd.grad(got.sum(), [x, m.w, m.b], allow_unused=True), want_grads)
    torch._dynamo.reset()


def test_a_compiled_model_reading_a_parameters_transpose_inside_swap():
    """Refused or right, never a wrong value. From torch 2.13 the compiled graph may take the
    parameter itself as an input for ``self.w.T`` (also ``.mT``, ``.H``, ``.data``), and the
    block's mode then meets it inside AOT autograd's function at run time: a RuntimeError
    naming it (a documented limit, docs/stop_gradient.md; whether dynamo builds the graph so
    varies with torch and with what the process compiled before). Before 2.13 the handler runs
    eagerly and this is exact."""
    torch._dynamo.reset()
    m = _TransposeNet()
    tree = {"w": torch.randn(4, 3), "b": torch.randn(4)}
    cm = torch.compile(m, backend="aot_eager")
    x = torch.randn(2, 3)
    try:
        with ts.swap(m, tree):
            want = m(x)
        torch.testing.assert_close(want, x @ tree["w"].T + tree["b"])
        with ts.swap(m, tree):
            try:
                got = cm(x)
            except RuntimeError as e:
                assert not MODES_MISTRACED, e  # (before 2.13: exact)
                assert "handed directly to the custom autograd function" in str(e), e
                return
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got, want)


class _BranchOnFlag(nn.Module):
    """Branches on its parameter's ``requires_grad`` (a frozen adapter skipped, say)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(2))

    def forward(self, x):
        return x * self.w if self.w.requires_grad else x * 0


@pytest.mark.xfail(not MODES_MISTRACED, strict=True, reason=(
    "Inside stop_gradient, p.requires_grad reads False in eager mode (the stand-in's flag, "
    "docs/stop_gradient.md 'Limits'), but a compiled model reads the parameter's own True "
    "(dynamo does not pass the read through the block's mode), takes the other branch and "
    "returns x * w = [1, 1] instead of eager's [0, 0] (fullgraph=False and True alike). "
    "Expected: the eager result, as for every other read through the block. A documented "
    "limit (docs/stop_gradient.md, Limits): ts.within_gradient(p) is right in both. "
    "From torch 2.13 only: before, the handler runs eagerly and this is exact."))
def test_a_compiled_model_reading_requires_grad_inside_stop_gradient_equals_eager():
    torch._dynamo.reset()
    m = _BranchOnFlag()
    cm = torch.compile(m, backend="aot_eager")
    x = torch.ones(2)
    try:
        with ts.stop_gradient(m):
            want, got = m(x), cm(x)
    finally:
        torch._dynamo.reset()
    assert torch.equal(want, torch.zeros(2))  # eager: the stand-in does not require grad
    torch.testing.assert_close(got, want)


def test_tiny_gpt2_compiled_evaluated_with_swapped_ema_weights_compiles_once():
    transformers = pytest.importorskip("transformers")
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                  attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0,
                                  eos_token_id=0, bos_token_id=0)
    m = transformers.GPT2LMHeadModel(cfg).eval()
    cm = torch.compile(m, backend="aot_eager")
    ema = {k: v.detach() * 0.9 for k, v in m.named_parameters()}
    per_call = []
    for i in range(4):
        ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(i))
        counters.clear()
        with torch.no_grad(), ts.swap(m, ema):
            got = cm(input_ids=ids).logits
        per_call.append(counters["stats"]["unique_graphs"])
        with torch.no_grad():
            want = torch.func.functional_call(m, ema, (ids,), strict=False).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert sum(per_call[1:]) == 0, per_call
    torch._dynamo.reset()


def test_a_collection_during_another_model_s_functional_call_applies_the_survivor_at_once():
    """Only a functional_call sharing modules with the survivor defers its application: one of
    an unrelated model (a teacher called functionally) does not leave its flags stale."""
    shared, a, b = _a_and_b_freezing_their_shared_layer()
    teacher = nn.Linear(2, 2)
    box = [b]
    del b
    seen = []

    def collect(*_):
        box.clear()
        gc.collect()
        seen.append((flags(a), reads(a)))

    handle = teacher.register_forward_hook(collect)
    params = {k: v.detach().clone() for k, v in teacher.named_parameters()}
    torch.func.functional_call(teacher, params, (torch.randn(1, 2),))
    handle.remove()
    assert seen == [([True] * 4, [True] * 4)]  # at once, inside the teacher's call
