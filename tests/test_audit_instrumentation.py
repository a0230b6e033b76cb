"""PyTorch's autograd instrumentation and module-rewriting utilities used with torchstruct.

Module backward hooks: per-module ``register_full_backward_hook`` /
``register_full_backward_pre_hook`` and the global ``register_module_full_backward_hook`` /
``register_module_full_backward_pre_hook`` around ``ts.stop_gradient``, ``ts.swap``,
``ts.freeze``, ``ts.structural_grad`` and ``ts.value_and_grad`` (selected and unselected
parameters, a parameter handed to a module as its input, hooks that raise). The hooks'
``grad_input`` / ``grad_output``, the order they fire in and every gradient are compared with
plain PyTorch running the same computation with the parameters detached by hand
(``torch.func.functional_call``) or its flags set by hand (``torch.autograd.grad``).

Autograd instrumentation: ``saved_tensors_hooks`` (what is packed) and ``save_on_cpu``,
``register_multi_grad_hook``, tensor hooks, ``Node.register_hook`` / ``register_prehook``,
``set_detect_anomaly`` (a NaN in backward inside ``structural_grad``), ``retain_graph`` and
``create_graph`` (a gradient penalty through a ``stop_gradient`` block and through
``structural_grad``), ``allow_mutation_on_saved_tensors``, forward-mode AD
(``torch.autograd.forward_ad`` duals as inputs of a blocked model and as ``swap`` stand-ins,
forward and reverse together), and an optimizer stepped from post-accumulate-grad hooks inside
``ts.constant``.

Module rewrites: ``torch.nn.utils.prune`` (``weight_orig`` and a forward pre-hook),
``parametrizations.spectral_norm`` / ``orthogonal`` and ``torch.ao.quantization`` QAT
(``fuse_modules_qat`` + ``prepare_qat``, a fused Conv-BN-ReLU with its own BatchNorm): freezing
by selector, parameter groups (every parameter exactly once, ``no_decay`` on renamed biases and
norm weights), ``ts.optim.AdamW`` / ``SGD`` against ``torch.optim`` (frozen parameters bitwise
unchanged with stale gradients, held BatchNorm statistics equal to a BatchNorm put in eval mode
by hand), element masks from a pruning mask, a context that spans ``prepare_qat``. Bad input in
these settings (selectors naming the computed ``weight``, the computed tensor itself, masks of
the wrong dtype): a clear error and nothing changed.

Clipping: ``ts.clip_by_global_norm`` against ``torch.nn.utils.clip_grad_norm_`` on
non-contiguous and strided gradients, expanded (zero-stride) ones, two parameters sharing one
gradient or overlapping gradient memory, fp16 gradients on fp32 parameters and fp32 gradients
on bf16 parameters (``grad_dtype``), and on the trees ``ts.structural_grad`` returns (whose
leaves are autograd's raw outputs).

A test marked ``xfail(strict=True)`` reproduces a case that goes wrong today; its reason says
what happens and what is expected.
"""
import copy
import gc
import math
import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.utils.prune as prune
from torch import nn
from torch.nn.modules import module as _module
from torch.nn.utils import parametrizations

import torchstruct as ts
from _flags import consistent, flags

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


# ------------------------------------------------------------------------------------ helpers
def _c(g):
    return None if g is None else g.detach().clone()


def _record(model):
    """Full backward (pre) hooks on every module of ``model``: a log of what they receive."""
    log, handles = [], []
    for name, mod in model.named_modules():
        handles.append(mod.register_full_backward_pre_hook(
            lambda _m, go, name=name: log.append((name, "pre", [_c(g) for g in go]))))
        handles.append(mod.register_full_backward_hook(
            lambda _m, gi, go, name=name: log.append(
                (name, "bw", [_c(g) for g in gi], [_c(g) for g in go]))))
    return log, handles


def _record_globally():
    log = []
    handles = [
        _module.register_module_full_backward_pre_hook(
            lambda m, go: log.append((type(m).__name__, "pre", [_c(g) for g in go]))),
        _module.register_module_full_backward_hook(
            lambda m, gi, go: log.append((type(m).__name__, "bw", [_c(g) for g in gi],
                                          [_c(g) for g in go]))),
    ]
    return log, handles


def _remove(handles):
    for h in handles:
        h.remove()


def _same_log(got, expected):
    assert got, "no hook fired"
    assert [e[:2] for e in got] == [e[:2] for e in expected]
    for a, b in zip(got, expected):
        for xs, ys in zip(a[2:], b[2:]):
            assert len(xs) == len(ys)
            for x, y in zip(xs, ys):
                assert (x is None) == (y is None), a[:2]
                if x is not None:
                    torch.testing.assert_close(x, y)


def _same_grads(got, expected):
    got, expected = list(got), list(expected)
    assert len(got) == len(expected)
    for x, y in zip(got, expected):
        assert (x is None) == (y is None)
        if x is not None:
            torch.testing.assert_close(x, y)


def _detached_call(model, blocked, *args, replace=None):
    """``model(*args)`` with the parameters at ``blocked`` paths detached by hand."""
    params = {n: (p.detach() if n in blocked else p) for n, p in model.named_parameters()}
    params.update(replace or {})
    return torch.func.functional_call(model, params, args)


class _PosNet(nn.Module):
    """A parameter that is also a module's *input* (``self.a(self.pos)``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.pos = nn.Parameter(torch.randn(3, 4))
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x + self.a(self.pos).sum(0))))


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 2))


# ======================================================================= 1. module backward hooks
@pytest.mark.parametrize("blocked", [("pos",), ("a",), ("b",), ("a", "pos"), ()])
def test_full_backward_hooks_inside_stop_gradient_match_hand_detached_parameters(blocked):
    m = _PosNet()
    ref = copy.deepcopy(m)
    x = torch.randn(5, 4, requires_grad=True)
    log, handles = _record(m)
    try:
        with ts.stop_gradient(m, *blocked):
            out = m(x)
        out.pow(2).sum().backward()
    finally:
        _remove(handles)
    got = [_c(p.grad) for p in m.parameters()], _c(x.grad)
    x.grad = None

    paths = {n for n, _ in ref.named_parameters()
             if not blocked or any(n == s or n.startswith(s + ".") for s in blocked)}
    expected_log, handles = _record(ref)
    try:
        _detached_call(ref, paths, x).pow(2).sum().backward()
    finally:
        _remove(handles)
    _same_log(log, expected_log)
    _same_grads(got[0], [p.grad for p in ref.parameters()])
    torch.testing.assert_close(got[1], x.grad)
    assert all(p.requires_grad for p in m.parameters())


def test_global_backward_hooks_inside_swap_match_functional_call():
    m = _mlp()
    ref = copy.deepcopy(m)
    x = torch.randn(5, 4, requires_grad=True)
    w = torch.randn(6, 4, requires_grad=True)
    tree = {"0": {"weight": w}, "3": {"bias": torch.randn(2)}}
    log, handles = _record_globally()
    try:
        with ts.swap(m, tree):
            out = m(x)
        out.pow(2).sum().backward()
    finally:
        _remove(handles)
    got = _c(x.grad), _c(w.grad), [_c(p.grad) for p in m.parameters()]
    x.grad = w.grad = None
    expected_log, handles = _record_globally()
    try:
        _detached_call(ref, set(), x, replace={"0.weight": w, "3.bias": tree["3"]["bias"]}
                       ).pow(2).sum().backward()
    finally:
        _remove(handles)
    _same_log(log, expected_log)
    torch.testing.assert_close(got[0], x.grad)
    torch.testing.assert_close(got[1], w.grad)
    _same_grads(got[2], [p.grad for p in ref.parameters()])
    assert got[2][0] is None and got[2][-1] is None  # the swapped-out parameters get nothing


@pytest.mark.parametrize("wrt", [None, "b", "a", "pos", "b.bias"])
def test_backward_hooks_under_structural_grad_match_autograd_grad(wrt):
    """The callable form with ``wrt`` runs the forward with only the asked parameters
    requiring grad: the reference sets exactly those flags by hand."""
    m = _PosNet()
    ref = copy.deepcopy(m)
    x = torch.randn(5, 4, requires_grad=True)

    def loss_fn(model):
        return model(x).pow(2).sum()

    log, handles = _record(m)
    try:
        tree = ts.structural_grad(m, loss_fn, wrt=wrt)
    finally:
        _remove(handles)
    assert all(p.grad is None for p in m.parameters()) and x.grad is None
    assert all(p.requires_grad for p in m.parameters())

    asked = [n for n, _ in ref.named_parameters()
             if wrt is None or n == wrt or n.startswith(wrt + ".")]
    if wrt is not None:
        for n, p in ref.named_parameters():
            p.requires_grad_(n in asked)
    params = dict(ref.named_parameters())
    expected_log, handles = _record(ref)
    try:
        expected = torch.autograd.grad(loss_fn(ref), [params[n] for n in asked])
    finally:
        _remove(handles)
    _same_log(log, expected_log)
    flat = ts.tree.to_flat_dict(tree)
    assert list(flat) == asked
    _same_grads(flat.values(), expected)


def test_global_hooks_with_freeze_and_value_and_grad_match_flags_set_by_hand():
    m = _mlp()
    ref = copy.deepcopy(m)
    x = torch.randn(5, 4, requires_grad=True)
    log, handles = _record_globally()
    try:
        with ts.freeze(m, "1", "3.bias"):
            (value, aux), tree = ts.value_and_grad(
                lambda model: (model(x).pow(2).sum(), "aux"), m, has_aux=True)
    finally:
        _remove(handles)
    assert aux == "aux" and all(flags(m)) and x.grad is None
    assert all(p.grad is None for p in m.parameters())
    for n, p in ref.named_parameters():
        p.requires_grad_(not (n.startswith("1.") or n == "3.bias"))
    names = [n for n, p in ref.named_parameters() if p.requires_grad]
    params = dict(ref.named_parameters())
    expected_log, handles = _record_globally()
    try:
        loss = ref(x).pow(2).sum()
        expected = torch.autograd.grad(loss, [params[n] for n in names])
    finally:
        _remove(handles)
    _same_log(log, expected_log)
    assert list(ts.tree.to_flat_dict(tree)) == names
    _same_grads(ts.tree.leaves(tree), expected)
    torch.testing.assert_close(value, loss.detach())


@pytest.mark.parametrize("hook", ["full", "pre"])
def test_a_backward_hook_on_a_swapped_parameter_input_is_refused_without_changes(hook):
    """A module with a full backward hook whose input is a swapped parameter that requires
    grad: PyTorch's hook machinery hands the parameter itself to a custom autograd function,
    which ``swap`` cannot replace. The documented answer is a ``RuntimeError``, never the
    original parameter's values; the same model without the hook gives the stand-in's."""
    m = _PosNet()
    x = torch.randn(3, 4)
    stand_in = torch.randn(3, 4, requires_grad=True)
    expected = _detached_call(m, set(), x, replace={"pos": stand_in})
    with ts.swap(m, {"pos": stand_in}):
        torch.testing.assert_close(m(x), expected)  # no hook: the stand-in's values
    register = (m.a.register_full_backward_hook if hook == "full"
                else m.a.register_full_backward_pre_hook)
    handle = register(lambda *args: None)
    before = [p.detach().clone() for p in m.parameters()]
    try:
        with pytest.raises(RuntimeError, match="BackwardHookFunction.*full backward hook"):
            with ts.swap(m, {"pos": stand_in}):
                m(x)
    finally:
        handle.remove()
    assert all(torch.equal(a, p) for a, p in zip(before, m.parameters()))
    assert stand_in.grad is None and all(p.grad is None for p in m.parameters())
    with ts.swap(m, {"pos": stand_in}):  # the block still works once the hook is gone
        torch.testing.assert_close(m(x), expected)


def test_hooks_that_raise_restore_flags_and_leave_no_gradients():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1))
    m[0].bias.requires_grad_(False)  # a starting flag of the user's own
    start = flags(m)
    x = torch.randn(5, 4, requires_grad=True)

    def boom(*_):
        raise ValueError("hook boom")

    handle = m[2].register_full_backward_hook(boom)
    try:
        with pytest.raises(ValueError, match="hook boom"):
            ts.structural_grad(m, lambda model: model(x).sum(), wrt=["0.weight", "2"])
        assert flags(m) == start and consistent(m)
        with pytest.raises(ValueError, match="hook boom"):
            with ts.freeze(m, "0"):
                m(x).sum().backward()
        assert flags(m) == start and consistent(m)
    finally:
        handle.remove()
    assert m[0].weight.grad is None and m[0].bias.grad is None


# ================================================================ 2. autograd instrumentation
def _packed(fn):
    log = []

    def pack(t):
        log.append((tuple(t.shape), t.dtype, t.requires_grad))
        return t.clone()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return log, out


def test_saved_tensors_hooks_see_what_hand_detached_parameters_save():
    m = _mlp()
    ref = copy.deepcopy(m)
    x = torch.randn(5, 4, requires_grad=True)

    def blocked():
        with ts.stop_gradient(m, "0"):
            return m(x)

    log, out = _packed(blocked)
    expected_log, expected = _packed(lambda: _detached_call(ref, {"0.weight", "0.bias"}, x))
    assert log == expected_log
    got = torch.autograd.grad(out.pow(2).sum(), [x, *m.parameters()], allow_unused=True)
    _same_grads(got, torch.autograd.grad(expected.pow(2).sum(), [x, *ref.parameters()],
                                         allow_unused=True))
    assert got[1] is None and got[2] is None

    with torch.autograd.graph.save_on_cpu(), ts.stop_gradient(m, "3"):
        out = m(x)
    out.pow(2).sum().backward()
    ref.zero_grad(set_to_none=True)
    x_ref = x.detach().requires_grad_()
    _detached_call(ref, {"3.weight", "3.bias"}, x_ref).pow(2).sum().backward()
    _same_grads([p.grad for p in m.parameters()], [p.grad for p in ref.parameters()])


@pytest.mark.parametrize("wrt", [None, "2", "0.bias", "2.bias"])
def test_tensor_multi_grad_and_node_hooks_under_structural_grad(wrt):
    """Tensor hooks that rescale a parameter's gradient, a multi-grad hook on activations and
    the loss node's hooks fire exactly as under ``torch.autograd.grad`` with the same flags."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1))
    ref = copy.deepcopy(m)
    x = torch.randn(5, 4)

    def loss_fn(model):
        return model(x).pow(2).sum()

    def instrument(model):
        log, handles = [], []
        for n, p in model.named_parameters():
            handles.append(p.register_hook(
                lambda g, n=n: (log.append(("t", n, [g.clone()])), g * 2)[1]))

        def on_forward(_mod, inputs, out):
            if out.requires_grad:
                ts_ = [t for t in (inputs[0], out) if t.requires_grad]
                handles.append(torch.autograd.graph.register_multi_grad_hook(
                    ts_, lambda gs: log.append(("multi", "", [_c(g) for g in gs]))))

        handles.append(model[1].register_forward_hook(on_forward))
        return log, handles

    log, handles = instrument(m)
    try:
        tree = ts.structural_grad(m, loss_fn, wrt=wrt)
    finally:
        _remove(handles)
    names = list(ts.tree.to_flat_dict(tree))
    expected_log, handles = instrument(ref)
    if wrt is not None:
        for n, p in ref.named_parameters():
            p.requires_grad_(n in names)
    params = dict(ref.named_parameters())
    try:
        expected = torch.autograd.grad(loss_fn(ref), [params[n] for n in names])
    finally:
        _remove(handles)
    assert log and [e[:2] for e in log] == [e[:2] for e in expected_log]
    _same_log(log, expected_log)
    _same_grads(ts.tree.leaves(tree), expected)  # the hooks' doubling included

    # Node hooks on the loss: structural_grad runs them once, as a plain backward does
    loss = loss_fn(m)
    seen = []
    loss.grad_fn.register_prehook(lambda go: seen.append("pre"))
    loss.grad_fn.register_hook(lambda gi, go: seen.append("post"))
    tree = ts.structural_grad(m, loss, retain_graph=True)
    assert seen == ["pre", "post"]
    loss.backward()
    assert seen == ["pre", "post"] * 2
    for path, g in ts.tree.to_flat_dict(tree).items():
        torch.testing.assert_close(g, dict(m.named_parameters())[path].grad)


def test_multi_grad_hooks_on_parameters_fail_under_structural_grad_as_under_autograd_grad():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 1))
    x = torch.randn(3, 4)
    handle = torch.autograd.graph.register_multi_grad_hook(list(m.parameters()), lambda gs: None)
    try:
        with pytest.raises(RuntimeError) as plain:
            torch.autograd.grad(m(x).sum(), list(m.parameters()))
        with pytest.raises(RuntimeError) as ours:
            ts.structural_grad(m, lambda model: model(x).sum(), wrt="0.bias")
    finally:
        handle.remove()
    assert str(ours.value) == str(plain.value)
    assert all(flags(m)) and all(p.grad is None for p in m.parameters())


def test_anomaly_mode_nan_in_backward_inside_structural_grad_restores_everything():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1))
    m[0].bias.requires_grad_(False)
    start = flags(m)
    x = torch.randn(5, 4)

    def loss_fn(model):  # sqrt(0) in backward: inf * 0 = NaN
        return (model(x) - model(x).detach()).pow(2).sum().sqrt()

    with torch.autograd.set_detect_anomaly(True):
        with pytest.raises(RuntimeError) as plain:
            torch.autograd.grad(loss_fn(m), [m[0].weight])
        for wrt in ("0.bias", None):
            with pytest.raises(RuntimeError) as ours:
                ts.structural_grad(m, loss_fn, wrt=wrt)
            assert str(ours.value) == str(plain.value) and "nan" in str(ours.value)
            assert flags(m) == start and consistent(m)
            with pytest.raises(RuntimeError, match="nan"):
                with ts.stop_gradient(m, "2"):
                    loss = loss_fn(m)
                loss.backward()
    assert all(p.grad is None for p in m.parameters())
    assert not torch.is_anomaly_enabled()


def test_gradient_penalty_through_a_stop_gradient_block():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 1))
    ref = copy.deepcopy(m)
    x = torch.randn(5, 4)
    xr = x.clone().requires_grad_()
    with ts.stop_gradient(m, "2"):
        out = m(xr)
        gx, = torch.autograd.grad(out.sum(), xr, create_graph=True)
    (gx.pow(2).sum() + out.mean()).backward()
    x2 = x.clone().requires_grad_()
    out = _detached_call(ref, {"2.weight", "2.bias"}, x2)
    gx2, = torch.autograd.grad(out.sum(), x2, create_graph=True)
    (gx2.pow(2).sum() + out.mean()).backward()
    _same_grads([p.grad for p in m.parameters()], [p.grad for p in ref.parameters()])
    assert m[2].weight.grad is None and m[0].weight.grad is not None
    torch.testing.assert_close(xr.grad, x2.grad)


@pytest.mark.parametrize("wrt", [None, "4", "0.weight"])
def test_gradient_penalty_through_structural_grad_matches_autograd(wrt):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 1))
    ref = copy.deepcopy(m)
    x = torch.randn(5, 4)

    def loss_fn(model):
        return model(x).pow(2).mean()

    tree = ts.structural_grad(m, loss_fn, create_graph=True, wrt=wrt)
    penalty = sum(t.pow(2).sum() for t in ts.tree.leaves(tree))
    second = ts.tree.to_flat_dict(ts.structural_grad(m, penalty))
    assert all(p.grad is None for p in m.parameters()) and all(flags(m))

    params = dict(ref.named_parameters())
    first = torch.autograd.grad(loss_fn(ref), [params[n] for n in ts.tree.to_flat_dict(tree)],
                                create_graph=True)
    expected = torch.autograd.grad(sum(t.pow(2).sum() for t in first), list(ref.parameters()),
                                   allow_unused=True)
    assert list(second) == list(params)
    for (n, p), e in zip(params.items(), expected):
        torch.testing.assert_close(second[n], torch.zeros_like(p) if e is None else e)


def test_retain_graph_with_structural_grad_then_backward():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1))
    x = torch.randn(5, 4)
    loss = m(x).pow(2).sum()
    g1 = ts.structural_grad(m, loss, wrt="2", retain_graph=True)
    g2 = ts.structural_grad(m, loss, retain_graph=True)
    assert all(p.grad is None for p in m.parameters())
    loss.backward()
    flat = ts.tree.to_flat_dict(g2)
    for n, p in m.named_parameters():
        assert torch.equal(flat[n], p.grad)
    for n, t in ts.tree.to_flat_dict(g1).items():
        assert torch.equal(t, flat[n])

    m.zero_grad(set_to_none=True)
    loss = m(x).pow(2).sum()
    ts.structural_grad(m, loss)  # retain_graph defaults to create_graph (False): freed
    with pytest.raises(RuntimeError, match="second time"):
        loss.backward()
    assert all(p.grad is None for p in m.parameters())


def test_forward_mode_duals_inside_stop_gradient_and_swap():
    m = _mlp()
    x, tx = torch.randn(5, 4), torch.randn(5, 4)
    # a dual input through a partly blocked model: the tangent is the plain jvp
    with fwAD.dual_level():
        with ts.stop_gradient(m, "0"):
            tangent = fwAD.unpack_dual(m(fwAD.make_dual(x, tx))).tangent
    torch.testing.assert_close(tangent, torch.func.jvp(m, (x,), (tx,))[1])

    # a dual stand-in in swap: the jvp with respect to that weight
    w = m[0].weight.detach().clone()
    tw = torch.randn_like(w)
    with fwAD.dual_level():
        with ts.swap(m, {"0": {"weight": fwAD.make_dual(w, tw)}}):
            tangent = fwAD.unpack_dual(m(x)).tangent
    params = dict(m.named_parameters())
    expected = torch.func.jvp(
        lambda wt: torch.func.functional_call(m, {**params, "0.weight": wt}, (x,)),
        (w,), (tw,))[1]
    torch.testing.assert_close(tangent, expected)

    # forward and reverse together: reverse gradients of primal + tangent through a block
    ref = copy.deepcopy(m)
    xr, xr2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    with fwAD.dual_level():
        with ts.stop_gradient(m, "3"):
            primal, tangent = fwAD.unpack_dual(m(fwAD.make_dual(xr, tx)))
        (primal.sum() + tangent.pow(2).sum()).backward()
    with fwAD.dual_level():
        primal, tangent = fwAD.unpack_dual(
            _detached_call(ref, {"3.weight", "3.bias"}, fwAD.make_dual(xr2, tx)))
        (primal.sum() + tangent.pow(2).sum()).backward()
    _same_grads([p.grad for p in m.parameters()], [p.grad for p in ref.parameters()])
    torch.testing.assert_close(xr.grad, xr2.grad)
    assert m[3].weight.grad is None


def test_allow_mutation_on_saved_tensors_with_a_blocked_parameter():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
    ref = copy.deepcopy(m)
    results = []
    for model, blocked in ((m, True), (ref, False)):
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1), requires_grad=True)
        with torch.autograd.graph.allow_mutation_on_saved_tensors():
            if blocked:
                with ts.stop_gradient(model, "2"):
                    out = model(x)
            else:
                out = _detached_call(model, {"2.weight", "2.bias"}, x)
            with torch.no_grad():
                model[2].weight.mul_(3)  # after the forward: backward uses the saved values
            out.sum().backward()
        results.append((x.grad, [p.grad for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0])
    _same_grads(results[0][1], results[1][1])
    assert torch.equal(m[2].weight, ref[2].weight)


def test_optimizer_in_backward_inside_constant_is_refused_for_the_protected_layer():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    ref = copy.deepcopy(m)
    x = torch.randn(8, 4)
    opts = {p: torch.optim.SGD([p], lr=0.1, momentum=0.9) for p in m.parameters()}

    def step(p):
        opts[p].step()
        opts[p].zero_grad()

    handles = [p.register_post_accumulate_grad_hook(step) for p in m.parameters()]
    before = [p.detach().clone() for p in m.parameters()]
    try:
        with pytest.raises(RuntimeError, match=r"'0\.bias'"):
            with ts.constant(m, "0"):
                m(x).sum().backward()
    finally:
        _remove(handles)
    assert torch.equal(m[0].weight, before[0]) and torch.equal(m[0].bias, before[1])
    assert not opts[m[0].weight].state and not opts[m[0].bias].state
    # the unprotected head stepped exactly as plain SGD would
    ref(x).sum().backward()
    ref_opt = torch.optim.SGD(ref[2].parameters(), lr=0.1, momentum=0.9)
    ref_opt.step()
    assert torch.equal(m[2].weight, ref[2].weight) and torch.equal(m[2].bias, ref[2].bias)


# ======================================================================== 3. module rewrites
def _rewritten():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 6), nn.Linear(6, 6),
                      nn.Linear(6, 2))
    prune.l1_unstructured(m[0], "weight", amount=0.5)
    prune.random_unstructured(m[1], "weight", amount=0.3)
    parametrizations.spectral_norm(m[2])
    parametrizations.orthogonal(m[3])
    prune.l1_unstructured(m[4], "bias", amount=0.5)
    return m


def test_param_groups_after_pruning_and_parametrizations():
    m = _rewritten()
    groups = ts.param_groups(m, ("2", {"lr": 0.01}), weight_decay=0.1)
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) and set(ids) == {id(p) for p in m.parameters()}
    decay = {n: g["weight_decay"] for g in groups for n in g["param_names"]}
    assert decay == {
        "0.weight_orig": 0.1, "0.bias": 0.0,
        "1.weight_orig": 0.0, "1.bias": 0.0,  # a pruned LayerNorm weight is still a norm's
        "2.parametrizations.weight.original": 0.1, "2.bias": 0.0,
        "3.parametrizations.weight.original": 0.1, "3.bias": 0.0,
        "4.weight": 0.1, "4.bias_orig": 0.0,  # a pruned bias is still a bias
    }
    lrs = {n: g.get("lr") for g in groups for n in g["param_names"]}
    assert lrs["2.parametrizations.weight.original"] == 0.01 and lrs["2.bias"] == 0.01


@pytest.mark.parametrize("frozen", [("0", "3"), ("2.parametrizations",), ("*_orig",)])
@pytest.mark.parametrize("kind", ["AdamW", "SGD"])
def test_optimizers_on_rewritten_models_match_torch_and_leave_frozen_bitwise(frozen, kind):
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))

    def train(model, ours):
        ctx = ts.freeze(model, *frozen)
        groups = ts.param_groups(model, ("2", {"lr": 0.01}), weight_decay=0.1)
        extra = {"momentum": 0.9} if kind == "SGD" else {}
        if ours:
            opt = getattr(ts.optim, kind)(groups, lr=0.05, **extra)
        else:
            groups = [{**{k: v for k, v in g.items() if k != "param_names"},
                       "params": [p for p in g["params"] if p.requires_grad]} for g in groups]
            opt = getattr(torch.optim, kind)([g for g in groups if g["params"]], lr=0.05,
                                             foreach=False, **extra)
        for p in model.parameters():
            p.grad = torch.ones_like(p)  # stale gradients on everything
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        trained = {n for n, _ in ts.trainable_parameters(model)}
        for _ in range(3):
            for p in model.parameters():
                if p.requires_grad:
                    p.grad = None
            model(x).pow(2).mean().backward()
            opt.step()
        ctx.__exit__(None, None, None)
        return before, dict(model.named_parameters()), trained, opt

    before, after, trained, opt = train(_rewritten(), True)
    _, expected, trained_ref, _ = train(_rewritten(), False)
    assert trained == trained_ref and trained and len(trained) < len(after)
    for n, p in after.items():
        if n in trained:
            torch.testing.assert_close(p, expected[n], rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(p, before[n]), n
            assert p not in opt.state, n


def _qat_model():
    tq = pytest.importorskip("torch.ao.quantization")
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                      nn.Linear(64, 3)).train()
    m.qconfig = tq.get_default_qat_qconfig("x86")
    m = tq.fuse_modules_qat(m, [["0", "1", "2"]])
    tq.prepare_qat(m, inplace=True)
    return m


@pytest.mark.parametrize("how", ["freeze 0", "freeze_except 4", "freeze 0.bn"])
def test_qat_model_freezing_matches_flags_and_eval_batchnorm_by_hand(how):
    a, b = _qat_model(), _qat_model()
    assert [n for n, _ in a.named_parameters()] == [
        "0.weight", "0.bias", "0.bn.weight", "0.bn.bias", "4.weight", "4.bias"]
    name, sel = how.split()
    ctx = getattr(ts, name)(a, sel)
    frozen = {n for n, p in a.named_parameters() if not p.requires_grad}
    held = {"0.bn.weight", "0.bn.bias"} <= frozen
    opt_a = ts.optim.AdamW(ts.param_groups(a, weight_decay=0.1), lr=0.05)
    for n, p in b.named_parameters():
        p.requires_grad_(n not in frozen)
    trained = [(n, p) for n, p in b.named_parameters() if p.requires_grad]
    no_decay = lambda n: n.endswith("bias") or ".bn." in n  # noqa: E731
    opt_b = torch.optim.AdamW(
        [{"params": [p for n, p in trained if not no_decay(n)], "weight_decay": 0.1},
         {"params": [p for n, p in trained if no_decay(n)], "weight_decay": 0.0}],
        lr=0.05, foreach=False)
    before = {n: p.detach().clone() for n, p in a.named_parameters()}
    x = torch.randn(6, 2, 6, 6, generator=torch.Generator().manual_seed(1))
    try:
        for _ in range(3):
            outs = []
            for model, opt in ((a, opt_a), (b, opt_b)):
                opt.zero_grad(set_to_none=True)
                if model is b and held:
                    model[0].bn.eval()
                out = model(x)
                model[0].bn.train()
                out.pow(2).mean().backward()
                opt.step()
                outs.append(out.detach())
            torch.testing.assert_close(outs[0], outs[1])
            assert a[0].bn.training
    finally:
        ctx.__exit__(None, None, None)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        if n in frozen:
            assert torch.equal(p, before[n]), n
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    for (n, s), (_, t) in zip(a.named_buffers(), b.named_buffers()):
        torch.testing.assert_close(s.float(), t.float(), msg=n)
    assert all(flags(a)) and consistent(a)


def test_a_context_spans_prepare_qat_which_keeps_the_parameter_objects():
    tq = pytest.importorskip("torch.ao.quantization")
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).train()
    w, b = m[0].weight, m[0].bias
    m.qconfig = tq.get_default_qat_qconfig("x86")
    with ts.freeze(m, "0"):
        tq.prepare_qat(m, inplace=True)
        m(torch.randn(3, 4))
        assert m[0].weight is w and type(m[0]).__module__.startswith("torch.ao.nn.qat")
        assert flags(m) == [False, False, True, True] and consistent(m)
        groups = ts.param_groups(m)
        assert sorted(id(p) for g in groups for p in g["params"]) == sorted(
            id(p) for p in m.parameters())
    assert all(flags(m)) and consistent(m) and w.requires_grad and b.requires_grad


def test_a_declaration_on_a_module_prepare_qat_replaces_goes_with_that_module():
    """``mark_trainable`` records on an instance; ``prepare_qat`` puts a new module in its
    place (same parameter objects). Once the old module is collected, flags and reads agree
    with a model that never had the declaration (the weight trains again)."""
    tq = pytest.importorskip("torch.ao.quantization")
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).train()
    ts.mark_trainable(m[0], "bias")
    assert flags(m) == [False, True, True, True]
    m.qconfig = tq.get_default_qat_qconfig("x86")
    tq.prepare_qat(m, inplace=True)
    gc.collect()
    m(torch.randn(3, 4))
    assert consistent(m)
    assert flags(m) == [True, True, True, True]


def test_pruning_mask_as_an_optimizer_mask():
    def build():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
        prune.l1_unstructured(m[0], "weight", amount=0.5)
        return m

    m, ref = build(), build()
    w = m[0].weight_orig
    with pytest.raises(ValueError, match="torch.bool"):  # the float mask prune keeps
        ts.optim.AdamW(m.parameters(), lr=0.1, masks={w: m[0].weight_mask})
    with pytest.raises(ValueError, match="not a parameter"):  # the computed weight
        ts.optim.AdamW(m.parameters(), lr=0.1, masks={m[0].weight: m[0].weight_mask.bool()})
    keep = m[0].weight_mask.bool()
    opt = ts.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.1, masks={w: keep})
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.1, foreach=False)
    before = w.detach().clone()
    x = torch.randn(8, 4)
    for _ in range(3):
        for model, o in ((m, opt), (ref, ref_opt)):
            o.zero_grad()
            model(x).pow(2).sum().backward()
            o.step()
    assert torch.equal(w[~keep], before[~keep])
    assert torch.equal(opt.state[w]["exp_avg"][~keep], torch.zeros(int((~keep).sum())))
    torch.testing.assert_close(w[keep], ref[0].weight_orig[keep])
    torch.testing.assert_close(m[2].weight, ref[2].weight)


def test_bad_selectors_on_rewritten_models_are_clear_errors_that_change_nothing():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    prune.l1_unstructured(m[0], "weight", amount=0.5)
    parametrizations.orthogonal(m[2])
    ts.attach(m)
    m[0].bias.requires_grad_(False)
    start = flags(m)
    called = []

    def loss_fn(model):
        called.append(1)
        return model(torch.randn(3, 4)).sum()

    cases = [
        (ValueError, r"'0\.weight'.*'0\.weight_orig'", lambda: ts.freeze(m, "0.weight")),
        (ValueError, r"'2\.weight'.*2\.parametrizations", lambda: ts.freeze_except(m, "2.weight")),
        (ValueError, r"'2\.weight'", lambda: ts.stop_gradient(m, "2.weight")),
        (TypeError, "got Tensor", lambda: ts.freeze(m, m[0].weight)),  # computed, not a param
        (TypeError, "got Tensor", lambda: ts.constant(m, m[2].weight)),
        (TypeError, "got Tensor", lambda: ts.unfreeze(m, m[0].weight_mask)),
        (ValueError, r"'0\.weight'.*'0\.weight_orig'",
         lambda: ts.swap(m, {"0": {"weight": torch.zeros(6, 4)}})),
        (ValueError, r"shape mismatch at '0\.weight_orig'",
         lambda: ts.swap(m, {"0": {"weight_orig": torch.zeros(4, 6)}})),
        (ValueError, r"'0\.weight'", lambda: ts.structural_grad(m, loss_fn, wrt="0.weight")),
        (TypeError, "got Tensor", lambda: ts.value_and_grad(loss_fn, m, wrt=[m[2].weight])),
        (ValueError, r"'2\.weight'", lambda: ts.param_groups(m, ("2.weight", {"lr": 1.0}))),
    ]
    for error, match, call in cases:
        with pytest.raises(error, match=match):
            call()
        assert flags(m) == start and consistent(m) and not called


# ============================================================================== 4. clipping
def _holders(shapes):
    return [nn.Parameter(torch.zeros(s)) for s in shapes]


def _strided_grads(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, generator=g).t(),           # transposed (3, 4)
            torch.randn(4, 6, generator=g)[:, ::2],       # strided (4, 3)
            torch.randn(10, generator=g)[::2]]            # strided (5,)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.0])
@pytest.mark.parametrize("max_norm", [0.5, 100.0])
def test_clip_non_contiguous_grads_like_clip_grad_norm(norm_type, max_norm):
    ours, theirs = _holders([(3, 4), (4, 3), (5,)]), _holders([(3, 4), (4, 3), (5,)])
    for ps in (ours, theirs):
        for p, g in zip(ps, _strided_grads(0)):
            p.grad = g
    total = ts.clip_by_global_norm(ours, max_norm, norm_type=norm_type)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type=norm_type,
                                              foreach=False)
    torch.testing.assert_close(total, expected)
    for p, q in zip(ours, theirs):
        assert p.grad.stride() == q.grad.stride()
        torch.testing.assert_close(p.grad, q.grad)


def test_clip_an_expanded_grad_is_an_error_that_changes_nothing():
    ps = _holders([(3, 4), (5,)])
    ps[0].grad = torch.randn(3, 4)
    ps[1].grad = torch.ones(1).expand(5)
    before = [p.grad.clone() for p in ps]
    with pytest.raises(RuntimeError):
        torch.nn.utils.clip_grad_norm_(_copy_grads(ps), 0.1)
    with pytest.raises(RuntimeError, match="share memory"):
        ts.clip_by_global_norm(ps, 0.1)
    assert all(torch.equal(p.grad, b) for p, b in zip(ps, before))
    torch.testing.assert_close(ts.global_norm([p.grad for p in ps]),
                               torch.cat([b.flatten() for b in before]).norm())


def _copy_grads(ps):
    out = _holders([p.shape for p in ps])
    for q, p in zip(out, ps):
        q.grad = p.grad.clone() if p.grad.stride() != (0,) else p.grad
    return out


@pytest.mark.parametrize("kind", ["same tensor", "overlap"])
def test_clip_grads_sharing_memory_like_clip_grad_norm(kind):
    n = 150_000  # several chunks for the parallel kernel

    def build():
        buf = torch.randn(n + n // 2, generator=torch.Generator().manual_seed(0))
        a, b = _holders([(n,), (n,)])
        a.grad = buf[:n]
        b.grad = a.grad if kind == "same tensor" else buf[n // 2:]
        return [a, b], buf

    for norm_type in (2.0, math.inf):
        ours, buf = build()
        theirs, ref = build()
        total = ts.clip_by_global_norm(ours, 0.5, norm_type=norm_type)
        expected = torch.nn.utils.clip_grad_norm_(theirs, 0.5, norm_type=norm_type,
                                                  foreach=False)
        torch.testing.assert_close(total, expected, rtol=1e-5, atol=0)
        torch.testing.assert_close(buf, ref, rtol=1e-5, atol=1e-12)


def test_fp16_grad_on_an_fp32_parameter():
    """``p.grad.data = half`` is what PyTorch allows without ``grad_dtype``."""
    ours, theirs = _holders([(4,)]), _holders([(4,)])
    for p in ours + theirs:
        p.grad = torch.zeros(4)
        p.grad.data = torch.tensor([3.0, 4.0, 0.0, 0.0], dtype=torch.float16)
    total = ts.clip_by_global_norm(ours, 0.1)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 0.1)
    assert total.dtype == expected.dtype == torch.float16
    torch.testing.assert_close(total, expected)
    torch.testing.assert_close(ours[0].grad, theirs[0].grad)
    before = ours[0].detach().clone(), ours[0].grad.clone()
    for cls in (ts.optim.SGD, ts.optim.AdamW):
        with pytest.raises(RuntimeError, match=r"dtype torch\.float16"):
            cls(ours, lr=0.1).step()
        assert torch.equal(ours[0], before[0]) and torch.equal(ours[0].grad, before[1])


@pytest.mark.skipif(not hasattr(torch.Tensor, "grad_dtype"), reason="no grad_dtype here")
def test_fp32_grads_on_bf16_parameters_through_grad_dtype():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(torch.bfloat16)
    for p in m.parameters():
        p.grad_dtype = torch.float32
    x = torch.randn(16, 4, dtype=torch.bfloat16)

    def loss_fn(model):
        return model(x).float().pow(2).sum()

    tree = ts.structural_grad(m, loss_fn)
    plain = torch.autograd.grad(loss_fn(m), list(m.parameters()))
    assert all(t.dtype == torch.float32 for t in ts.tree.leaves(tree))
    assert all(torch.equal(a, b) for a, b in zip(ts.tree.leaves(tree), plain))
    loss_fn(m).backward()
    grads = [p.grad.clone() for p in m.parameters()]
    total = ts.clip_by_global_norm(m, 0.1)
    clipped = [p.grad.clone() for p in m.parameters()]
    for p, g in zip(m.parameters(), grads):
        p.grad = g.clone()
    expected = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1)
    torch.testing.assert_close(total, expected)
    _same_grads(clipped, [p.grad for p in m.parameters()])
    before = [p.detach().clone() for p in m.parameters()]
    for cls in (ts.optim.SGD, ts.optim.AdamW):
        opt = cls(m.parameters(), lr=0.1)
        with pytest.raises(RuntimeError, match="expected the parameter's torch.bfloat16"):
            opt.step()
        assert not opt.state
    assert all(torch.equal(a, p) for a, p in zip(before, m.parameters()))


@pytest.mark.parametrize("kind", ["SGD", "AdamW"])
@pytest.mark.parametrize("max_grad_norm", [None, 0.1])
def test_optimizers_read_strided_and_expanded_grads_like_torch(kind, max_grad_norm):
    """Hooks and hand-set gradients can be transposed, strided or expanded: the optimizers
    read them (never write them) and step exactly as torch.optim after a clip by hand."""
    shapes = [(3, 4), (4, 3), (5,)]
    ours = [nn.Parameter(torch.ones(s)) for s in shapes]
    theirs = [nn.Parameter(torch.ones(s)) for s in shapes]
    extra = {"momentum": 0.9, "nesterov": True} if kind == "SGD" else {}
    opt = getattr(ts.optim, kind)(ours, lr=0.1, weight_decay=0.01,
                                  max_grad_norm=max_grad_norm, **extra)
    ref = getattr(torch.optim, kind)(theirs, lr=0.1, weight_decay=0.01, foreach=False, **extra)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        grads = [torch.randn(4, 3, generator=g).t(), torch.randn(4, 6, generator=g)[:, ::2],
                 torch.randn(1, generator=g).expand(5)]
        for p, q, gr in zip(ours, theirs, grads):
            p.grad = gr
            q.grad = gr.clone()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(theirs, max_grad_norm)
        opt.step()
        ref.step()
        assert all(p.grad is gr for p, gr in zip(ours, grads))  # not rewritten
        assert torch.equal(grads[2], grads[2][:1].expand(5))
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_clip_a_structural_grad_tree_with_non_contiguous_leaves():
    class Transposed(nn.Module):  # w used through w.t(): autograd returns its gradient transposed
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(3, 5))
            self.v = nn.Parameter(torch.randn(5, 3))

        def forward(self, x):
            return (x.unsqueeze(-1) * self.w.t()) @ self.v.t()

    torch.manual_seed(0)
    m = Transposed()
    x = torch.randn(4, 5)
    tree = ts.structural_grad(m, lambda model: model(x).pow(2).sum())
    assert not tree["w"].is_contiguous()
    m(x).pow(2).sum().backward()
    total = ts.clip_by_global_norm(tree, 0.1)
    expected = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1)
    torch.testing.assert_close(total, expected)
    for path, p in m.named_parameters():
        torch.testing.assert_close(ts.tree.to_flat_dict(tree)[path], p.grad)


class _Summed(nn.Module):
    """``weight = base + delta``: autograd hands the two parameters one gradient tensor."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.base = nn.Parameter(torch.randn(2, 3))
        self.delta = nn.Parameter(torch.randn(2, 3))

    def forward(self, x):
        return nn.functional.linear(x, self.base + self.delta)


def test_structural_grad_leaves_of_distinct_parameters_are_distinct_tensors():
    m = _Summed()
    x = torch.randn(4, 3)

    def loss_fn(model):
        return model(x).pow(2).sum()

    tree = ts.structural_grad(m, loss_fn)
    loss_fn(m).backward()
    true_norm = torch.cat([p.grad.flatten() for p in m.parameters()]).norm()
    torch.testing.assert_close(ts.global_norm(tree), true_norm)
    vec, _ = ts.tree.flatten(tree)
    assert vec.numel() == sum(p.numel() for p in m.parameters())
    total = ts.clip_by_global_norm(tree, 0.1)
    torch.testing.assert_close(total, true_norm)
    torch.testing.assert_close(
        torch.cat([t.flatten() for t in ts.tree.leaves(tree)]).norm(), torch.tensor(0.1))


def test_clip_a_structural_grad_tree_whose_leaf_autograd_expanded():
    class Offset(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.offset = nn.Parameter(torch.zeros(4, 3))

        def forward(self, x):
            return self.lin(x) + self.offset  # same shape: the sum's gradient passes as is

    torch.manual_seed(0)
    m = Offset()
    x = torch.randn(4, 3)
    tree = ts.structural_grad(m, lambda model: model(x).sum())
    m(x).sum().backward()
    expected = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1)
    torch.testing.assert_close(ts.clip_by_global_norm(tree, 0.1), expected)
    for path, p in m.named_parameters():
        torch.testing.assert_close(ts.tree.to_flat_dict(tree)[path], p.grad)


# =============================================================== a small transformers model
def test_tiny_gpt2_hooks_with_a_blocked_tied_embedding_and_structural_grad():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=40, n_positions=8, n_embd=16, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0)
    m = transformers.GPT2LMHeadModel(cfg).eval()
    assert m.lm_head.weight is m.transformer.wte.weight  # tied
    ref = copy.deepcopy(m)
    ids = torch.randint(0, 40, (2, 6), generator=torch.Generator().manual_seed(1))

    def loss_of(out):
        return out.logits.float().logsumexp(-1).mean()

    def hooked(model):
        log, handles = [], []
        for i, block in enumerate(model.transformer.h):
            handles.append(block.register_full_backward_hook(
                lambda _m, gi, go, i=i: log.append((str(i), "bw", [_c(g) for g in gi],
                                                    [_c(g) for g in go]))))
        return log, handles

    log, handles = hooked(m)
    try:
        with ts.stop_gradient(m, "transformer.wte"):
            out = m(ids)
        loss_of(out).backward()
    finally:
        _remove(handles)
    expected_log, handles = hooked(ref)
    try:
        wte = ref.transformer.wte.weight
        loss_of(torch.func.functional_call(
            ref, {"transformer.wte.weight": wte.detach()}, (ids,))).backward()
    finally:
        _remove(handles)
    _same_log(log, expected_log)
    assert m.transformer.wte.weight.grad is None
    _same_grads([p.grad for p in m.parameters()], [p.grad for p in ref.parameters()])

    # structural_grad of one block, with the hooks on: as autograd.grad with those flags
    m.zero_grad(set_to_none=True)
    log, handles = hooked(m)
    try:
        tree = ts.structural_grad(m, lambda model: loss_of(model(ids)), wrt="transformer.h.1")
    finally:
        _remove(handles)
    assert all(p.grad is None for p in m.parameters()) and all(flags(m))
    ref = copy.deepcopy(m)
    names = [n for n, _ in ref.named_parameters() if n.startswith("transformer.h.1.")]
    for n, p in ref.named_parameters():
        p.requires_grad_(n in names)
    params = dict(ref.named_parameters())
    expected_log, handles = hooked(ref)
    try:
        expected = torch.autograd.grad(loss_of(ref(ids)), [params[n] for n in names])
    finally:
        _remove(handles)
    _same_log(log, expected_log)
    assert list(ts.tree.to_flat_dict(tree)) == names
    _same_grads(ts.tree.leaves(tree), expected)
