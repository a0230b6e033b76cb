"""torchstruct with ``torch.compile`` (CPU, inductor): contexts around a compiled model, the
attached model's pre-hook under ``fullgraph=True``, ``global_norm`` and ``structural_grad``."""
import copy
import io
import pickle
import importlib

import pytest
import torch
from torch import nn

import torchstruct as ts
from _flags import STALE_GRAPHS, TORCH


def _compile_available() -> str | None:
    if not hasattr(torch, "compile"):
        return "torch.compile is not available"
    try:
        importlib.import_module("torch._dynamo")
        importlib.import_module("torch._inductor")
    except Exception as e:  # pragma: no cover - depends on the platform
        return f"inductor is not available: {e}"
    try:  # a C++ compiler is needed for the CPU backend
        torch.compile(lambda t: t * 2 + 1, backend="inductor")(torch.ones(2))
    except Exception as e:  # pragma: no cover - depends on the platform
        return f"torch.compile (inductor, CPU) does not work here: {type(e).__name__}: {e}"
    return None


_REASON = _compile_available()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 2)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _pair():
    torch.manual_seed(0)
    eager = MLP()
    return eager, copy.deepcopy(eager)


def _data():
    torch.manual_seed(1)
    return torch.randn(5, 4), torch.randn(5, 2)


def _step(model, call, opt, x, y):
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(call(x), y)
    loss.backward()
    grads = {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}
    opt.step()
    return loss.detach(), grads


@STALE_GRAPHS
def test_freeze_except_around_a_compiled_model_changes_between_steps():
    eager, twin = _pair()
    compiled = torch.compile(twin, backend="inductor")
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_c = torch.optim.SGD(twin.parameters(), lr=0.1)
    x, y = _data()
    for keep in ("a", "c", "b", "a"):  # the trainable set changes every step
        with ts.freeze_except(eager, keep), ts.freeze_except(twin, keep):
            le, ge = _step(eager, eager, opt_e, x, y)
            lc, gc_ = _step(twin, compiled, opt_c, x, y)
        torch.testing.assert_close(lc, le)
        for name in ge:
            if name.startswith(keep + "."):
                assert gc_[name] is not None, (keep, name)
                torch.testing.assert_close(gc_[name], ge[name])
            else:
                assert ge[name] is None and gc_[name] is None, (keep, name)
        for (n, pe), (_, pc) in zip(eager.named_parameters(), twin.named_parameters()):
            torch.testing.assert_close(pc, pe, msg=n)
    assert all(p.requires_grad for p in twin.parameters())


def _graph_breaks(call, *args):
    """Run ``call`` and return dynamo's graph-break reasons (counted by dynamo itself)."""
    counters = torch._dynamo.utils.counters
    counters.clear()
    call(*args)
    return dict(counters["graph_break"])


@STALE_GRAPHS
def test_attached_model_compiles_with_fullgraph():
    """The forward pre-hook of an attached model must not break the graph.

    ``torch.compile(model)`` builds an ``OptimizedModule``, which registers ``model`` as its
    submodule: the module tree changed, so the hook's next run re-applies the flags.
    """
    eager, twin = _pair()
    ts.attach(twin)
    ts.mark_trainable(twin, "c")
    x, _ = _data()
    breaks = _graph_breaks(torch.compile(twin, backend="eager"), x)
    assert not breaks, "graph breaks in an attached model's forward:\n" + "\n".join(breaks)
    nn.Linear(1, 1)  # a module built anywhere else changes the generation too
    breaks = _graph_breaks(torch.compile(twin, backend="eager"), x)
    assert not breaks, "graph breaks in an attached model's forward:\n" + "\n".join(breaks)

    torch._dynamo.reset()
    compiled = torch.compile(twin, backend="inductor", fullgraph=True)
    out = compiled(x)
    torch.testing.assert_close(out, eager(x))
    out.sum().backward()
    assert twin.c.weight.grad is not None and twin.a.weight.grad is None
    # A declaration changed after compiling is applied at once; the graph follows it.
    ts.mark_trainable(twin, "a")
    twin.zero_grad(set_to_none=True)
    out = compiled(x)
    torch.testing.assert_close(out, eager(x))
    out.sum().backward()
    assert twin.a.weight.grad is not None and twin.c.weight.grad is None


class WithAdapters(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = MLP()
        self.adapters = nn.ModuleDict()

    def forward(self, x):
        h = self.body(x)
        for a in self.adapters.values():
            h = h + a(h)
        return h


def test_adapter_added_after_compiling_follows_declarations():
    torch.manual_seed(0)
    model = WithAdapters()
    ts.mark_trainable(model, "adapters")
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    x, _ = _data()
    compiled(x)
    assert not any(p.requires_grad for p in model.parameters())
    model.adapters["new"] = nn.Linear(2, 2)  # admitted by the declaration
    model.body.extra = nn.Linear(2, 2)  # under "body", which the declaration freezes
    model.body.extra.weight.requires_grad_(True)
    out = compiled(x)
    out.sum().backward()
    assert model.adapters["new"].weight.grad is not None
    assert all(p.grad is None for p in model.body.parameters())
    assert not model.body.extra.weight.requires_grad


def test_global_norm_inside_fullgraph_compile_equals_eager():
    eager, _ = _pair()
    x, y = _data()
    nn.functional.mse_loss(eager(x), y).backward()
    grads = [p.grad for p in eager.parameters()]

    @torch.compile(backend="inductor", fullgraph=True)
    def norms(gs):
        return ts.global_norm(gs), ts.global_norm(gs, norm_type=1.0), ts.global_norm(
            gs, norm_type=float("inf"))

    got = norms(grads)
    want = (ts.global_norm(grads), ts.global_norm(grads, 1.0), ts.global_norm(grads, float("inf")))
    flat = torch.cat([g.reshape(-1) for g in grads])
    for g, w, p in zip(got, want, (2.0, 1.0, float("inf"))):
        torch.testing.assert_close(g, w)
        torch.testing.assert_close(g, torch.linalg.vector_norm(flat, p))
    torch.testing.assert_close(ts.global_norm(eager), want[0])


def test_global_norm_op_traces_with_its_fake_kernel():
    if not hasattr(torch.ops, "torchstruct") or not hasattr(torch.ops.torchstruct, "global_norm"):
        pytest.skip("the compiled extension (torch.ops.torchstruct) is not built")
    xs = [torch.randn(3, 4), torch.randn(7)]

    @torch.compile(backend="inductor", fullgraph=True)
    def f(xs):
        return torch.ops.torchstruct.global_norm(xs, 2.0) * 2

    want = 2 * torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in xs]))
    torch.testing.assert_close(f(xs), want)


def test_structural_grad_of_a_compiled_models_loss_equals_eager():
    eager, twin = _pair()
    compiled = torch.compile(twin, backend="inductor")
    x, y = _data()
    with ts.freeze(eager, "b"), ts.freeze(twin, "b"):
        ge = ts.structural_grad(eager, nn.functional.mse_loss(eager(x), y))
        gc_ = ts.structural_grad(twin, nn.functional.mse_loss(compiled(x), y))
    assert ts.tree.paths(gc_) == ts.tree.paths(ge) == ["a.weight", "a.bias", "c.weight", "c.bias"]
    for path, a, b in zip(ts.tree.paths(ge), ts.tree.leaves(ge), ts.tree.leaves(gc_)):
        torch.testing.assert_close(b, a, msg=path)
    # With wrt and a callable loss that calls the compiled module.
    ge = ts.structural_grad(eager, lambda m: nn.functional.mse_loss(m(x), y), wrt="c")
    gc_ = ts.structural_grad(twin, lambda m: nn.functional.mse_loss(compiled(x), y), wrt="c")
    assert ts.tree.paths(gc_) == ["c.weight", "c.bias"]
    for a, b in zip(ts.tree.leaves(ge), ts.tree.leaves(gc_)):
        torch.testing.assert_close(b, a)
    assert all(p.grad is None for p in twin.parameters())


def _counting_backend(graphs: list):
    def backend(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    return backend


def test_a_compiled_step_applies_a_change_once_and_then_stops_recompiling():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    ts.freeze_except(m, "1")
    graphs = []

    @torch.compile(backend=_counting_backend(graphs))
    def step(x):
        return m(x).sum()

    x = torch.randn(4, 3)
    step(x).backward()
    m.append(nn.Linear(3, 1))  # the next compiled call applies it, outside the graph
    step(x).backward()
    assert not m[2].weight.requires_grad and m[2].weight.grad is None
    assert [p.requires_grad for p in m.parameters()] == [False, False, True, True, False, False]
    settled = len(graphs)
    for _ in range(3):
        step(x).backward()
    assert len(graphs) == settled  # no graph break or retrace once the change is applied


def test_module_compile_in_place_with_fullgraph_refuses_a_pending_change():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    ts.freeze_except(m, "1")
    m.compile(backend="eager", fullgraph=True)
    m(torch.randn(2, 3))
    m.append(nn.Linear(3, 1))
    with pytest.raises(Exception, match="_apply_eagerly"):
        m(torch.randn(2, 3))  # cannot apply inside one graph: an error, not a stale flag
    ts.attach(m)  # applied eagerly: the compiled forward runs again
    m(torch.randn(2, 3))
    assert not m[2].weight.requires_grad


def test_a_change_to_another_model_does_not_make_compiled_code_retrace():
    other = nn.Sequential(nn.Linear(3, 3))
    ts.attach(other)
    m = nn.Sequential(nn.Linear(3, 3))
    ts.attach(m)
    graphs = []

    @torch.compile(backend=_counting_backend(graphs))
    def step(x):
        return m(x).sum()

    step(torch.randn(2, 3))
    settled = len(graphs)
    other.append(nn.Linear(3, 3))  # a change never applied: other is not run again
    for _ in range(3):
        step(torch.randn(2, 3))
    assert len(graphs) == settled
    assert other[1].weight.requires_grad  # and nothing was applied to it from m's forward


# ------------------------------------------- torch before 2.12: graphs kept after flags change
def _torch_before_2_12():
    return TORCH < (2, 12)


def test_the_stale_graph_warning_is_armed_exactly_on_torch_before_2_12():
    from torchstruct import _compile_caveats

    assert _compile_caveats.STALE is _torch_before_2_12()
    assert _compile_caveats.RECHECKED is ((2, 5) <= TORCH < (2, 12))
    assert _compile_caveats.MODES_MISTRACED is (TORCH < (2, 13))


def test_the_blocks_handler_is_traced_where_dynamo_traces_it_right():
    """From torch 2.13 dynamo traces the blocks' mode (fullgraph=True holds); before, the
    handler is wrapped in torch.compiler.disable."""
    from torchstruct import _compile_caveats, blocks

    wrapped = hasattr(blocks._Substitute.__torch_function__, "__wrapped__")
    assert wrapped is _compile_caveats.MODES_MISTRACED


def test_compiled_code_sees_a_flag_changed_between_calls():
    """What the warning is about, on this torch: a graph compiled with the parameter requiring
    grad must not run on once it is frozen (pytorch/pytorch#139476, before torch 2.12)."""
    torch._dynamo.reset()

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def forward(self, x):
            y = self.w * x
            return y * 2 if y.requires_grad else y * 3

    m = M()
    cm = torch.compile(m, fullgraph=True, backend="aot_eager")
    x = torch.ones(3)
    first = cm(x)[0].item()
    with ts.freeze(m):
        frozen = cm(x)[0].item()
    again = cm(x)[0].item()
    if TORCH < (2, 5):
        pytest.xfail("torch before 2.5 keeps the graph compiled for the old flags")
    assert (first, frozen, again) == (2.0, 3.0, 2.0)


def _graphs():
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def test_torch_before_2_12_warns_once_when_flags_change_after_compiling(monkeypatch):
    import warnings

    from torchstruct import _compile_caveats

    monkeypatch.setattr(_compile_caveats, "STALE", True)  # as on torch before 2.5
    monkeypatch.setattr(_compile_caveats, "RECHECKED", False)
    monkeypatch.setattr(_compile_caveats, "_warned", False)
    from torch._dynamo.utils import counters

    monkeypatch.setitem(counters["stats"], "unique_graphs", 0)
    m = nn.Linear(2, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ts.freeze(m, "bias"):  # nothing compiled in this process (as counted): quiet
            pass
    torch._dynamo.reset()
    torch.compile(nn.Linear(2, 2), backend="aot_eager")(torch.ones(2))
    assert _graphs() > 0
    with pytest.warns(RuntimeWarning, match=r"139476.*torch._dynamo.reset\(\)") as seen:
        ts.freeze(m, "weight")
    assert seen[0].filename == __file__  # points at the user's call
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        ts.unfreeze(m, "weight")
        with ts.freeze(m):
            pass
    assert [p.requires_grad for p in m.parameters()] == [True, True]


def test_torch_2_5_to_2_11_changed_flags_touch_the_holders_dictionaries_without_a_warning(
        monkeypatch):
    """There a dictionary change makes compiled code check its guards (flags included) again:
    each module holding a changed flag gets a key added to and taken out of ``_parameters``.
    No parameter goes missing, the order stays, nothing warns; the compiled model follows."""
    import warnings

    from torchstruct import _compile_caveats

    monkeypatch.setattr(_compile_caveats, "STALE", True)
    monkeypatch.setattr(_compile_caveats, "RECHECKED", True)
    torch._dynamo.reset()
    m = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
    cm = torch.compile(m, backend="aot_eager")
    x = torch.ones(3, 2)
    cm(x).sum().backward()
    before = [list(mod._parameters.items()) for mod in m.modules()]
    seen = []

    class Watched(dict):
        def __setitem__(self, key, value):
            seen.append(key)
            super().__setitem__(key, value)

    m[2]._parameters = Watched(m[2]._parameters)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ts.freeze(m, "2"):
            m.zero_grad(set_to_none=True)
            cm(x).sum().backward()
            assert m[2].weight.grad is None and m[0].weight.grad is not None
    assert seen == [_compile_caveats._KEY] * 2  # frozen, then back: touched once each way
    assert [list(mod._parameters.items()) for mod in m.modules()] == before
    m.zero_grad(set_to_none=True)
    cm(x).sum().backward()
    assert m[2].weight.grad is not None
    torch._dynamo.reset()


def test_entering_constant_warns_too_on_torch_before_2_12(monkeypatch):
    from torchstruct import _compile_caveats

    monkeypatch.setattr(_compile_caveats, "STALE", True)
    monkeypatch.setattr(_compile_caveats, "_warned", False)
    torch.compile(nn.Linear(2, 2), backend="aot_eager")(torch.ones(2))
    m = nn.Linear(2, 2)
    with pytest.warns(RuntimeWarning, match="ts.constant"):
        with ts.constant(m):
            pass


def test_no_stale_graph_warning_on_this_torch_when_it_guards_the_flags():
    import warnings

    if _torch_before_2_12():
        pytest.skip("this torch does not guard the flags")
    torch.compile(nn.Linear(2, 2), backend="aot_eager")(torch.ones(2))
    m = nn.Linear(2, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ts.freeze(m):
            pass


def test_before_2_13_fullgraph_inside_a_block_raises_and_without_it_the_results_are_exact():
    from torchstruct._compile_caveats import MODES_MISTRACED

    if not MODES_MISTRACED:
        pytest.skip("dynamo traces the blocks' mode here (fullgraph=True holds inside blocks)")
    torch.manual_seed(0)
    m, x = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1)), torch.randn(4, 3)
    torch._dynamo.reset()
    strict = torch.compile(m, backend="aot_eager", fullgraph=True)
    with ts.stop_gradient(m, "0"):
        with pytest.raises(Exception, match="disable"):
            strict(x)
    loose = torch.compile(m, backend="aot_eager")
    with ts.stop_gradient(m, "0"):
        loose(x).sum().backward()
    assert m[0].weight.grad is None and m[2].weight.grad is not None


def _with_change_waiting():
    """An attached model whose tree grew after its last application: its next forward applies
    (the new layer is frozen then)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    ts.freeze_except(m, "1")
    m(torch.randn(2, 3))
    m.append(nn.Linear(1, 1))
    return m


def _saved_and_loaded(m):
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("how", ["deepcopy", "torch.save", "pickle"])
def test_a_copy_made_while_a_change_waits_compiles_with_fullgraph_as_plain_pytorch(how):
    """A copy has no state of its own (it behaves as plain PyTorch until attached): it carries
    no mark of the original's waiting change, so a fullgraph compile meets no graph break."""
    m = _with_change_waiting()
    waiting = [p.requires_grad for p in m.parameters()]
    assert waiting == [False, False, True, True, True, True]
    make = {"deepcopy": copy.deepcopy, "torch.save": _saved_and_loaded,
            "pickle": lambda mm: pickle.loads(pickle.dumps(mm))}[how]
    c = make(m)
    x = torch.randn(2, 3)
    got = torch.compile(lambda q: c(q).sum(), backend="eager", fullgraph=True)(x)
    assert torch.equal(got, c(x).sum())
    assert [p.requires_grad for p in c.parameters()] == waiting  # nothing applied to the copy
    torch.compile(lambda q: m(q).sum(), backend="eager")(x)  # the original still applies
    assert [p.requires_grad for p in m.parameters()] == [False, False, True, True, False, False]
