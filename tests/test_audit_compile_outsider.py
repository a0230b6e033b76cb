"""An outside look at torchstruct under ``torch.compile``: can a compiled model keep a stale
``requires_grad`` flag or a stale gradient after torchstruct changed what trains?

Each scenario runs the same steps three ways where it makes sense: through a compiled model
(``torch.compile(model)``, ``model.compile()`` in place, or a compiled step function), through
the same torchstruct calls run eagerly, and through plain PyTorch with the flags written by hand
on a copy without hooks. Covered: ``freeze`` / ``freeze_except`` / ``unfreeze`` contexts (with,
bare, decorator), ``UnfreezeSchedule`` stages, declarations (``trainable()``,
``mark_trainable``) changed between compiled calls, whole compiled training steps with
``ts.optim`` and ``ts.clip_by_global_norm``, ``ts.structural_grad`` with changing ``wrt``,
``stop_gradient`` / ``constant`` / ``swap`` blocks around compiled calls, ``fullgraph=True``
and ``dynamic=True`` where the docs say they work, recompilation once every trainable set has
been seen, and frozen BatchNorm statistics.

Most checks use the ``eager`` or ``aot_eager`` backends (inductor compiles C++ and is slow
here); a few use inductor. Dynamo is reset before and after every test.

Convention: a test marked ``@pytest.mark.xfail(strict=True, reason="BUG: ...")`` is a minimal
reproduction of a behaviour that is wrong today; the reason says what happens and what should.
Such a test starts passing (and so fails the run) once the behaviour is fixed.
"""
import copy

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import torchstruct as ts

F = nn.functional
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


# ---------------------------------------------------------------------------------- helpers
class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 6)
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x)))))


def tower(seed=0):
    torch.manual_seed(seed)
    return Tower()


def data(seed=1, n=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g)


def grads(m):
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def flags(m):
    return {n for n, p in m.named_parameters() if p.requires_grad}


def plain_grads(model, x, y, trainable):
    """Plain PyTorch: a hook-free copy, flags by hand, backward."""
    ref = copy.deepcopy(model)
    ts.detach_hooks(ref)
    for n, p in ref.named_parameters():
        p.requires_grad_(n in trainable)
        p.grad = None
    F.mse_loss(ref(x), y).backward()
    return grads(ref)


def assert_same_grads(got, want):
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=n)


def one_step(model, call, x, y):
    for p in model.parameters():
        p.grad = None
    F.mse_loss(call(x), y).backward()
    return grads(model)


ALL = {"a.weight", "a.bias", "b.weight", "b.bias", "head.weight", "head.bias"}
HEAD = {"head.weight", "head.bias"}
B = {"b.weight", "b.bias"}
A = {"a.weight", "a.bias"}


def make_call(model, how, **kw):
    if how == "wrapper":
        return torch.compile(model, backend="aot_eager", **kw)
    if how == "inplace":
        model.compile(backend="aot_eager", **kw)
        return model
    if how == "step":
        @torch.compile(backend="aot_eager", **kw)
        def fwd(x):
            return model(x)
        return fwd
    raise AssertionError(how)


HOWS = ["wrapper", "inplace", "step"]


# ------------------------------------------------------------ contexts between compiled calls
@pytest.mark.parametrize("how", HOWS)
def test_contexts_toggled_between_compiled_calls_match_plain_pytorch(how):
    m = tower()
    call = make_call(m, how)
    x, y = data()
    seq = []
    seq.append((None, ALL))
    seq.append((lambda: ts.freeze_except(m, "head"), HEAD))
    seq.append((None, ALL))
    seq.append((lambda: ts.freeze(m, "a", "head.bias"), ALL - A - {"head.bias"}))
    seq.append((lambda: ts.freeze_except(m, "head"), HEAD))
    seq.append((None, ALL))
    for ctx, want in seq:
        if ctx is None:
            got = one_step(m, call, x, y)
            assert flags(m) == want
        else:
            with ctx():
                got = one_step(m, call, x, y)
                assert flags(m) == want
        assert_same_grads(got, plain_grads(m, x, y, want))


@pytest.mark.parametrize("how", HOWS)
def test_unfreeze_inside_freeze_except_between_compiled_calls(how):
    m = tower()
    call = make_call(m, how)
    x, y = data()
    ts.freeze_except(m, "head")  # bare: permanent
    assert_same_grads(one_step(m, call, x, y), plain_grads(m, x, y, HEAD))
    with ts.unfreeze(m, "a"):
        assert_same_grads(one_step(m, call, x, y), plain_grads(m, x, y, HEAD | A))
        with ts.freeze(m, "head"):
            assert_same_grads(one_step(m, call, x, y), plain_grads(m, x, y, A))
    assert_same_grads(one_step(m, call, x, y), plain_grads(m, x, y, HEAD))


def test_unfreeze_of_a_parameter_frozen_before_compiling():
    """Starting flag False at compile time; ``ts.unfreeze`` must make the compiled graph
    compute its gradient, and leaving the context must stop it again."""
    m = tower()
    m.a.weight.requires_grad_(False)
    call = torch.compile(m, backend="aot_eager")
    x, y = data()
    assert_same_grads(one_step(m, call, x, y), plain_grads(m, x, y, ALL - {"a.weight"}))
    with ts.unfreeze(m, "a.weight"):
        assert m.a.weight.requires_grad
        assert_same_grads(one_step(m, call, x, y), plain_grads(m, x, y, ALL))
    assert not m.a.weight.requires_grad
    assert_same_grads(one_step(m, call, x, y), plain_grads(m, x, y, ALL - {"a.weight"}))


def test_context_entered_inside_a_compiled_function():
    """A freeze context entered *inside* the compiled function: the backward must follow it,
    and the flags must be restored afterwards (the function runs several times)."""
    m = tower()
    x, y = data()

    @torch.compile(backend="aot_eager")
    def step(x, y):
        with ts.freeze_except(m, "head"):
            loss = F.mse_loss(m(x), y)
        return loss

    for _ in range(2):
        for p in m.parameters():
            p.grad = None
        step(x, y).backward()
        assert flags(m) == ALL
        assert_same_grads(grads(m), plain_grads(m, x, y, HEAD))


def test_decorator_context_on_a_compiled_function():
    m = tower()
    x, y = data()

    @ts.freeze(m, "a", "b")
    def loss_fn(x, y):
        return F.mse_loss(m(x), y)

    compiled = torch.compile(loss_fn, backend="aot_eager")
    for _ in range(2):
        for p in m.parameters():
            p.grad = None
        compiled(x, y).backward()
        assert flags(m) == ALL
        assert_same_grads(grads(m), plain_grads(m, x, y, HEAD))
    # and the same function without the decorator's parameters frozen, through the model itself
    cm = torch.compile(m, backend="aot_eager")
    assert_same_grads(one_step(m, cm, x, y), plain_grads(m, x, y, ALL))


# ---------------------------------------------------------------------------- declarations
class Declared(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 6)
        self.head = nn.Linear(6, 2)

    def trainable(self):
        return ["head", "b"]

    def forward(self, x):
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x)))))


@pytest.mark.parametrize("how", HOWS)
def test_trainable_method_and_mark_trainable_between_compiled_calls(how):
    torch.manual_seed(0)
    m = Declared()
    ts.attach(m)
    call = make_call(m, how)
    x, y = data()
    assert_same_grads(one_step(m, call, x, y), plain_grads(m, x, y, HEAD | B))
    ts.mark_trainable(m.b, "bias")
    assert_same_grads(one_step(m, call, x, y), plain_grads(m, x, y, HEAD | {"b.bias"}))
    ts.mark_trainable(m.b, None)
    assert_same_grads(one_step(m, call, x, y), plain_grads(m, x, y, HEAD | B))
    ts.mark_trainable(m, "head")  # narrows the class declaration further
    assert_same_grads(one_step(m, call, x, y), plain_grads(m, x, y, HEAD))
    ts.mark_trainable(m, None)
    assert_same_grads(one_step(m, call, x, y), plain_grads(m, x, y, HEAD | B))


@pytest.mark.parametrize("how", ["wrapper", "inplace"])
def test_mark_trainable_with_fullgraph(how):
    m = tower()
    call = make_call(m, how, fullgraph=True)
    x, y = data()
    ts.attach(m)
    assert_same_grads(one_step(m, call, x, y), plain_grads(m, x, y, ALL))
    ts.mark_trainable(m, "a")
    assert_same_grads(one_step(m, call, x, y), plain_grads(m, x, y, A))
    ts.mark_trainable(m, "b", "head")
    assert_same_grads(one_step(m, call, x, y), plain_grads(m, x, y, B | HEAD))
    ts.mark_trainable(m, None)
    assert_same_grads(one_step(m, call, x, y), plain_grads(m, x, y, ALL))


# -------------------------------------------------------------------- whole training steps
def train_run(compiled, changes, opt_kind="adamw", clip=True, backend="aot_eager", steps=8):
    """Run ``steps`` training steps; ``changes[i]`` (a callable) is applied before step i."""
    m = tower()
    if opt_kind == "adamw":
        opt = ts.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    else:
        opt = ts.optim.SGD(m.parameters(), lr=1e-1, momentum=0.9, weight_decay=0.1)

    def step(x, y):
        loss = F.mse_loss(m(x), y)
        loss.backward()
        if clip:
            ts.clip_by_global_norm(m, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    if compiled:
        step = torch.compile(step, backend=backend)
    losses, trained = [], []
    for i in range(steps):
        if i in changes:
            changes[i](m)
        x, y = data(seed=100 + i)
        before = {n: p.detach().clone() for n, p in m.named_parameters()}
        losses.append(step(x, y))
        trained.append({n for n, p in m.named_parameters() if not torch.equal(p, before[n])})
    return m, losses, trained


def plain_run(changes, opt_kind="adamw", clip=True, steps=8):
    """The same run in plain PyTorch: flags by hand, torch.optim, clip_grad_norm_."""
    m = tower()
    if opt_kind == "adamw":
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    else:
        opt = torch.optim.SGD(m.parameters(), lr=1e-1, momentum=0.9, weight_decay=0.1,
                              foreach=False)
    losses, trained = [], []
    for i in range(steps):
        if i in changes:
            for n, p in m.named_parameters():
                p.requires_grad_(n in changes[i])
        x, y = data(seed=100 + i)
        before = {n: p.detach().clone() for n, p in m.named_parameters()}
        loss = F.mse_loss(m(x), y)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_([p for p in m.parameters() if p.requires_grad], 0.5)
        # torch.optim steps any parameter with a grad; frozen ones have none (set_to_none)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        trained.append({n for n, p in m.named_parameters() if not torch.equal(p, before[n])})
    return m, losses, trained


def _bare(fn):
    return fn


def _freeze_schedule():
    """Bare contexts changing what trains; returned as (ts changes, plain flag sets)."""
    state = {}

    def only_head(m):
        state["c"] = ts.freeze_except(m, "head")

    def add_b(m):
        state["u"] = ts.unfreeze(m, "b")

    def lift(m):
        state["u"].__exit__(None, None, None)
        state["c"].__exit__(None, None, None)

    def freeze_a(m):
        state["f"] = ts.freeze(m, "a")

    ts_changes = {1: only_head, 3: add_b, 5: lift, 6: freeze_a}
    plain = {0: ALL, 1: HEAD, 3: HEAD | B, 5: ALL, 6: ALL - A}
    return ts_changes, plain


@pytest.mark.parametrize("opt_kind", ["adamw"])
def test_compiled_training_step_follows_bare_contexts_like_plain_pytorch(opt_kind):
    ts_changes, plain = _freeze_schedule()
    mc, lc, tc = train_run(True, ts_changes, opt_kind)
    ts_changes, plain = _freeze_schedule()
    me, le, te = train_run(False, ts_changes, opt_kind)
    mp, lp, tp = plain_run(plain, opt_kind)
    assert tc == te == tp
    for a, b, c in zip(lc, le, lp):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6)
    for (n, p), q, r in zip(mc.named_parameters(), me.parameters(), mp.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6, msg=n)
        torch.testing.assert_close(q, r, rtol=1e-5, atol=1e-6, msg=n)


def test_compiled_training_step_inductor_follows_unfreeze_schedule():
    """UnfreezeSchedule stepped after each compiled (inductor) training step."""
    def run(compiled):
        m = tower()
        sched = ts.UnfreezeSchedule(m, {0: "head", 2: None})
        opt = ts.optim.AdamW(m.parameters(), lr=1e-2, max_grad_norm=0.5)

        def step(x, y):
            loss = F.mse_loss(m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        if compiled:
            step = torch.compile(step)
        trained = []
        for i in range(4):
            x, y = data(seed=200 + i)
            before = {n: p.detach().clone() for n, p in m.named_parameters()}
            step(x, y)
            sched.step()
            trained.append({n for n, p in m.named_parameters() if not torch.equal(p, before[n])})
        return m, trained

    mc, tc = run(True)
    me, te = run(False)
    assert te == [HEAD, HEAD, ALL, ALL]
    assert tc == te
    for p, q in zip(mc.parameters(), me.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_unfreeze_schedule_load_state_dict_between_compiled_calls():
    m = tower()
    call = torch.compile(m, backend="aot_eager")
    x, y = data()
    sched = ts.UnfreezeSchedule(m, {0: "head", 3: "a"})
    assert_same_grads(one_step(m, call, x, y), plain_grads(m, x, y, HEAD))
    other = ts.UnfreezeSchedule(tower(), {0: "head", 3: "a"})
    for _ in range(4):
        other.step()
    sched.load_state_dict(other.state_dict())
    assert_same_grads(one_step(m, call, x, y), plain_grads(m, x, y, HEAD | A))


# ----------------------------------------------------------------------- structural_grad
def test_structural_grad_with_changing_wrt_on_a_compiled_model():
    m = tower()
    cm = torch.compile(m, backend="aot_eager")
    x, y = data()
    for wrt, want in [("head", HEAD), ("a", A), (None, ALL), ("b.weight", {"b.weight"}),
                      ("head", HEAD)]:
        tree = ts.structural_grad(m, lambda mod: F.mse_loss(cm(x), y), wrt=wrt)
        got = ts.tree.to_flat_dict(tree)
        ref = plain_grads(m, x, y, want)
        assert_same_grads(got, ref)
        assert flags(m) == ALL  # wrt is for the call only
        assert all(p.grad is None for p in m.parameters())


def test_structural_grad_inside_a_freeze_context_on_a_compiled_model():
    m = tower()
    cm = torch.compile(m, backend="aot_eager")
    x, y = data()
    with ts.freeze_except(m, "head", "b"):
        got = ts.tree.to_flat_dict(ts.structural_grad(m, F.mse_loss(cm(x), y)))
        assert_same_grads(got, plain_grads(m, x, y, HEAD | B))
    got = ts.tree.to_flat_dict(ts.structural_grad(m, F.mse_loss(cm(x), y)))
    assert_same_grads(got, plain_grads(m, x, y, ALL))


# ------------------------------------------------------------------------------ blocks
@pytest.mark.parametrize("fullgraph", [False, True])
def test_swap_with_new_values_each_call_is_not_baked_into_the_graph(fullgraph):
    lin = nn.Linear(3, 2)
    cl = torch.compile(lin, backend="aot_eager", fullgraph=fullgraph)
    x = torch.randn(4, 3)
    for k in range(4):
        w = torch.full((2, 3), float(k))
        b = torch.full((2,), -float(k))
        with ts.swap(lin, {"weight": w, "bias": b}):
            torch.testing.assert_close(cl(x), x @ w.T + b)
    torch.testing.assert_close(cl(x), lin(x))


def test_swap_tensor_updated_in_place_between_calls_inductor():
    lin = nn.Linear(3, 2)
    cl = torch.compile(lin)
    x = torch.randn(4, 3)
    ema = {"weight": lin.weight.detach().clone(), "bias": lin.bias.detach().clone()}
    for k in range(3):
        with torch.no_grad():
            ema["weight"].mul_(0.5).add_(1.0)
            ema["bias"].add_(1.0)
        with ts.swap(lin, ema):
            torch.testing.assert_close(cl(x), x @ ema["weight"].T + ema["bias"])
    torch.testing.assert_close(cl(x), x @ lin.weight.T + lin.bias)


@pytest.mark.parametrize("fullgraph", [False, True])
def test_stop_gradient_with_alternating_selectors_around_a_compiled_model(fullgraph):
    m = tower()
    cm = torch.compile(m, backend="aot_eager", fullgraph=fullgraph)
    x, y = data()
    for sel, blocked in [("a", A), ("head", HEAD), (None, ALL), ("a", A), ("b", B), (None, ALL)]:
        for p in m.parameters():
            p.grad = None
        args = () if sel is None else (sel,)
        with ts.stop_gradient(m, *args):
            loss = F.mse_loss(cm(x), y)
        if blocked == ALL:
            assert not loss.requires_grad
        else:
            loss.backward()
            assert_same_grads(grads(m), plain_grads(m, x, y, ALL - blocked))
        assert flags(m) == ALL
    assert_same_grads(one_step(m, cm, x, y), plain_grads(m, x, y, ALL))


def test_stop_gradient_block_and_freeze_context_together_around_compiled_calls():
    m = tower()
    cm = torch.compile(m, backend="aot_eager")
    x, y = data()
    with ts.freeze(m, "head"):
        with ts.stop_gradient(m, "a"):
            out = cm(x)
        F.mse_loss(out, y).backward()
    assert_same_grads(grads(m), plain_grads(m, x, y, B))
    assert_same_grads(one_step(m, cm, x, y), plain_grads(m, x, y, ALL))


def test_constant_around_a_compiled_inference_call_then_training():
    m = tower()
    cm = torch.compile(m, backend="aot_eager")
    x, y = data()
    before = copy.deepcopy(m.state_dict())
    with ts.constant(m):
        out = cm(x)
        with pytest.raises(RuntimeError):
            with torch.no_grad():
                m.a.weight.add_(1.0)
    torch.testing.assert_close(out, m(x))
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k])
    assert_same_grads(one_step(m, cm, x, y), plain_grads(m, x, y, ALL))


# ------------------------------------------------------------------- fullgraph / dynamic
def test_fullgraph_freeze_except_docs_example_and_back():
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(3, 4)
    with ts.freeze_except(model, "2"):
        compiled(x).sum().backward()
    assert model[0].weight.grad is None and model[2].weight.grad is not None
    model.zero_grad(set_to_none=True)
    compiled(x).sum().backward()
    assert model[0].weight.grad is not None and model[2].weight.grad is not None


@pytest.mark.parametrize("how", ["wrapper", "inplace"])
def test_dynamic_shapes_with_changing_trainable_sets(how):
    m = tower()
    call = make_call(m, how, dynamic=True)
    for i, (n, ctx, want) in enumerate([
            (3, None, ALL), (5, "head", HEAD), (7, None, ALL), (9, "head", HEAD),
            (4, "a", A), (6, None, ALL)]):
        x, y = data(seed=i, n=n)
        if ctx is None:
            got = one_step(m, call, x, y)
        else:
            with ts.freeze_except(m, ctx):
                got = one_step(m, call, x, y)
        assert_same_grads(got, plain_grads(m, x, y, want))


def test_no_recompile_once_both_trainable_sets_are_seen():
    m = tower()
    cm = torch.compile(m, backend="aot_eager", fullgraph=True)
    x, y = data()
    one_step(m, cm, x, y)
    with ts.freeze_except(m, "head"):
        one_step(m, cm, x, y)
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            assert_same_grads(one_step(m, cm, x, y), plain_grads(m, x, y, ALL))
            with ts.freeze_except(m, "head"):
                assert_same_grads(one_step(m, cm, x, y), plain_grads(m, x, y, HEAD))
    assert counters["stats"]["unique_graphs"] == 0


def test_model_compile_vs_torch_compile_give_the_same_training():
    def run(how):
        torch._dynamo.reset()
        m = tower()
        call = make_call(m, how)
        opt = ts.optim.SGD(m.parameters(), lr=0.1)
        for i in range(6):
            x, y = data(seed=300 + i)
            ctx = ts.freeze_except(m, "head") if i % 2 else ts.unfreeze(m, "a")
            with ctx:
                F.mse_loss(call(x), y).backward()
            opt.step()
            opt.zero_grad()
        return m

    a, b = run("wrapper"), run("inplace")
    e = tower()
    opt = ts.optim.SGD(e.parameters(), lr=0.1)
    for i in range(6):
        x, y = data(seed=300 + i)
        for n, p in e.named_parameters():
            p.requires_grad_(n in HEAD if i % 2 else True)
        F.mse_loss(e(x), y).backward()
        opt.step()
        opt.zero_grad()
    for p, q, r in zip(a.parameters(), b.parameters(), e.parameters()):
        torch.testing.assert_close(p, r)
        torch.testing.assert_close(q, r)


# ---------------------------------------------------------------------- BatchNorm stats
class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.bn(self.lin(x)))


@pytest.mark.parametrize("how", ["wrapper", "inplace"])
def test_frozen_batchnorm_statistics_toggle_under_compile(how):
    torch.manual_seed(0)
    m = BNNet()
    call = make_call(m, how)
    x = torch.randn(8, 4) * 3 + 1
    call(x)  # trains the statistics
    rm = m.bn.running_mean.clone()
    nb = int(m.bn.num_batches_tracked)
    assert not torch.equal(rm, torch.zeros(4))
    with ts.freeze(m, "bn"):
        for _ in range(2):
            call(x * 2 + 5)
        torch.testing.assert_close(m.bn.running_mean, rm)
        assert int(m.bn.num_batches_tracked) == nb
    call(x * 2 + 5)
    assert not torch.equal(m.bn.running_mean, rm)
    assert int(m.bn.num_batches_tracked) == nb + 1
    # and held again on re-entry, with the graph compiled for the held layer
    rm2 = m.bn.running_mean.clone()
    with ts.freeze_except(m, "head"):
        call(x)
        torch.testing.assert_close(m.bn.running_mean, rm2)


# -------------------------------------------------------------------------- tied weights
class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.mid = nn.Linear(4, 4)
        self.out = nn.Linear(4, 7, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx):
        return self.out(torch.tanh(self.mid(self.emb(idx))))


def test_tied_weight_frozen_through_one_path_under_compile():
    torch.manual_seed(0)
    m = Tied()
    cm = torch.compile(m, backend="aot_eager")
    idx = torch.randint(0, 7, (3, 5))
    with ts.freeze(m, "out"):
        assert not m.emb.weight.requires_grad
        cm(idx).sum().backward()
        assert m.emb.weight.grad is None and m.mid.weight.grad is not None
    m.zero_grad(set_to_none=True)
    cm(idx).sum().backward()
    ref = copy.deepcopy(m)
    ts.detach_hooks(ref)
    ref.zero_grad(set_to_none=True)
    ref(idx).sum().backward()
    torch.testing.assert_close(m.emb.weight.grad, ref.emb.weight.grad)


# ------------------------------------------------- torchstruct reads inside compiled code
@pytest.mark.parametrize("name", ["trainable_parameters", "grad_tree", "state_dict"])
def test_trainability_reads_inside_a_compiled_function_follow_contexts(name):
    fns = {
        "trainable_parameters": lambda m: [n for n, _ in ts.trainable_parameters(m)],
        "grad_tree": lambda m: sorted(ts.tree.to_flat_dict(ts.grad_tree(m))),
        "state_dict": lambda m: sorted(ts.state_dict(m, buffers=False)),
    }
    fn = fns[name]
    m = tower()
    x, y = data()
    F.mse_loss(m(x), y).backward()
    cf = torch.compile(lambda: fn(m), backend="eager")
    seen = []
    for ctx in [None, lambda: ts.freeze_except(m, "head"), lambda: ts.freeze(m, "a"),
                lambda: ts.unfreeze(m, "a"), None]:
        with (ctx() if ctx else torch.enable_grad()):
            got = cf()
            want = sorted(flags(m))
            assert sorted(got) == want, (got, want)
            seen.append(tuple(sorted(got)))
    assert len(set(seen)) == 3


def test_structural_grad_called_inside_a_compiled_function_with_changing_wrt():
    m = tower()
    x, y = data()
    for wrt, want in [("head", HEAD), ("a", A)]:
        f = torch.compile(
            lambda x: ts.structural_grad(m, lambda mod: F.mse_loss(mod(x), y), wrt=wrt),
            backend="aot_eager")
        assert_same_grads(ts.tree.to_flat_dict(f(x)), plain_grads(m, x, y, want))
        assert flags(m) == ALL


def test_parameter_registered_into_an_undeclared_module_after_model_compile():
    class Gated(Tower):
        def forward(self, x):
            h = self.b(torch.tanh(self.a(x)))
            if hasattr(self.b, "gate"):
                h = h * self.b.gate
            return self.head(torch.tanh(h))

    torch.manual_seed(0)
    m = Gated()
    m.compile(backend="aot_eager")
    x, y = data()
    ts.mark_trainable(m, "head")
    assert_same_grads(one_step(m, m, x, y), plain_grads(m, x, y, HEAD))
    m.b.gate = nn.Parameter(torch.ones(6))  # registered after compiling: not declared
    got = one_step(m, m, x, y)
    assert not m.b.gate.requires_grad
    assert_same_grads(got, plain_grads(m, x, y, HEAD))


# ------------------------------------------------------------- blocks: threads, recompiles
@pytest.mark.parametrize("fullgraph", [False, True])
def test_stop_gradient_in_one_thread_does_not_leak_into_a_compiled_call_in_another(fullgraph):
    import threading

    m = tower()
    cm = torch.compile(m, backend="aot_eager", fullgraph=fullgraph)
    x, y = data()
    entered, done = threading.Event(), threading.Event()
    res = {}

    def blocked():
        with ts.stop_gradient(m, "a"):
            entered.set()
            done.wait(30)
            res["in"] = F.mse_loss(cm(x), y)

    def plain():
        entered.wait(30)
        res["out"] = F.mse_loss(cm(x), y)
        done.set()

    ts_ = [threading.Thread(target=blocked), threading.Thread(target=plain)]
    for t in ts_:
        t.start()
    for t in ts_:
        t.join()
    names = [n for n, _ in m.named_parameters()]
    g_in = torch.autograd.grad(res["in"], list(m.parameters()), allow_unused=True)
    g_out = torch.autograd.grad(res["out"], list(m.parameters()), allow_unused=True)
    assert_same_grads({n: g for n, g in zip(names, g_in) if g is not None},
                      plain_grads(m, x, y, ALL - A))
    assert_same_grads({n: g for n, g in zip(names, g_out) if g is not None},
                      plain_grads(m, x, y, ALL))


@pytest.mark.parametrize("fullgraph", [False, True])
def test_swap_with_a_fresh_tree_every_call_compiles_once(fullgraph):
    lin = nn.Linear(3, 2)
    cl = torch.compile(lin, backend="eager", fullgraph=fullgraph)
    x = torch.randn(4, 3)
    for k in range(10):
        w, b = torch.full((2, 3), float(k)), torch.full((2,), -float(k))
        with ts.swap(lin, {"weight": w, "bias": b}):
            torch.testing.assert_close(cl(x), x @ w.T + b)
    assert counters["stats"]["unique_graphs"] == 1


def test_freeze_toggled_every_step_with_fresh_batches_uses_two_graphs():
    lin = nn.Linear(3, 2)
    cl = torch.compile(lin, backend="eager", fullgraph=True)
    for _ in range(10):
        lin.zero_grad(set_to_none=True)
        with ts.freeze(lin, "weight"):
            cl(torch.randn(4, 3)).sum().backward()
        assert lin.weight.grad is None and lin.bias.grad is not None
        cl(torch.randn(4, 3)).sum().backward()
        assert lin.weight.grad is not None
    assert counters["stats"]["unique_graphs"] == 2


@pytest.mark.parametrize("block", ["swap", "stop_gradient"])
def test_held_batchnorm_inside_a_block_fullgraph_matches_eager(block):
    def run(compiled):
        torch._dynamo.reset()
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
        call = torch.compile(m, backend="aot_eager", fullgraph=True) if compiled else m
        x = torch.randn(8, 4) * 2 + 1
        m(x)
        w = torch.ones(4, requires_grad=True)
        with ts.freeze(m, "1"):
            ctx = ts.swap(m, {"1.weight": w}) if block == "swap" else ts.stop_gradient(m, "0")
            with ctx:
                out = call(x * 3).sum()
        g = torch.autograd.grad(out, [w, m[2].weight], allow_unused=True)
        return [out.detach(), *g, m[1].running_mean.clone(), int(m[1].num_batches_tracked)]

    got, want = run(True), run(False)
    for a, b in zip(got, want):
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(a, b)
        else:
            assert a == b


# ---------------------------------------------------------------------------------- bugs
def test_fullgraph_model_with_held_batchnorm_inside_structural_grad_wrt():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    cm = torch.compile(m, backend="eager", fullgraph=True)
    x = torch.randn(8, 4)
    with ts.freeze(m, "1"):
        got = ts.tree.to_flat_dict(ts.structural_grad(m, lambda mod: cm(x).sum(), wrt="0"))
        want = ts.tree.to_flat_dict(ts.structural_grad(m, lambda mod: mod(x).sum(), wrt="0"))
    assert sorted(got) == ["0.bias", "0.weight"]
    for k in want:
        torch.testing.assert_close(got[k], want[k])
    with ts.freeze(m, "1"):  # value_and_grad too, through the same graph
        value, grads = ts.value_and_grad(lambda mod: cm(x).sum(), m, wrt="0")
        with torch.no_grad():
            torch.testing.assert_close(value, m(x).sum())  # (held: normalized as eval)
    for k, g in ts.tree.to_flat_dict(grads).items():
        torch.testing.assert_close(g, want[k])


def test_held_batchnorm_inside_structural_grad_wrt_without_fullgraph_matches_eager():
    """The same case as the one above, without fullgraph: correct through a graph break."""
    def run(compiled):
        torch._dynamo.reset()
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        call = torch.compile(m, backend="aot_eager") if compiled else m
        x = torch.randn(8, 4) * 2 + 1
        m(x)
        with ts.freeze(m, "1"):
            g = ts.tree.to_flat_dict(ts.structural_grad(m, lambda mod: call(x * 3).sum(),
                                                        wrt="0"))
            g2 = ts.tree.to_flat_dict(ts.structural_grad(m, lambda mod: call(x).sum(),
                                                         wrt="1"))
        return g, g2, m[1].running_mean.clone(), int(m[1].num_batches_tracked)

    (g, g2, rm, nb), (h, h2, rm2, nb2) = run(True), run(False)
    assert sorted(g) == sorted(h) == ["0.bias", "0.weight"]
    assert sorted(g2) == sorted(h2) == ["1.bias", "1.weight"]
    for k in h:
        torch.testing.assert_close(g[k], h[k])
    for k in h2:
        torch.testing.assert_close(g2[k], h2[k])
    torch.testing.assert_close(rm, rm2)
    assert nb == nb2 == 1
