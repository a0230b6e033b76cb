"""ts.structural_grad, ts.value_and_grad, ts.grad_tree against torch.autograd references."""
import contextlib
import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.profiler import ProfilerActivity, profile

import torchstruct as ts


def mlp(seed=0, bias=True):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(4, 5, bias=bias), nn.Tanh(), nn.Linear(5, 6, bias=bias), nn.Tanh(),
        nn.Linear(6, 2, bias=bias),
    )


def data(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(7, 4, generator=g), torch.randn(7, 2, generator=g)


def mse(model, x, y):
    return ((model(x) - y) ** 2).mean()


def flat(tree):
    return ts.tree.to_flat_dict(tree)


def backward_reference(model, fn):
    """Gradients by .backward() on a deep copy: {path: grad} for params with a grad."""
    ref = copy.deepcopy(model)
    fn(ref).backward()
    return {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}


def assert_trees_close(tree, ref):
    got = flat(tree)
    assert list(got) == list(ref)
    for path in ref:
        torch.testing.assert_close(got[path], ref[path], rtol=1e-6, atol=1e-7, msg=path)


# ----------------------------------------------------------------------------- values
def test_default_matches_backward_for_tensor_and_callable():
    m, (x, y) = mlp(), data()
    ref = backward_reference(m, lambda r: mse(r, x, y))
    assert_trees_close(ts.structural_grad(m, mse(m, x, y)), ref)
    assert_trees_close(ts.structural_grad(m, lambda mm: mse(mm, x, y)), ref)


def test_matches_autograd_grad_and_tree_structure():
    m, (x, y) = mlp(), data()
    loss = mse(m, x, y)
    names = [n for n, _ in m.named_parameters()]
    ref = torch.autograd.grad(loss, list(m.parameters()), retain_graph=True)
    g = ts.structural_grad(m, loss)
    assert set(g) == {"0", "2", "4"} and set(g["2"]) == {"weight", "bias"}
    for n, r in zip(names, ref):
        torch.testing.assert_close(flat(g)[n], r, rtol=0, atol=0)


def test_default_follows_trainability():
    m, (x, y) = mlp(), data()
    with ts.freeze(m, "0"):
        g = ts.structural_grad(m, lambda mm: mse(mm, x, y))
    assert ts.tree.paths(g) == ["2.weight", "2.bias", "4.weight", "4.bias"]
    ts.mark_trainable(m, "4")
    try:
        assert ts.tree.paths(ts.structural_grad(m, mse(m, x, y))) == ["4.weight", "4.bias"]
    finally:
        ts.mark_trainable(m, None)


def test_wrt_tensor_loss_masks_per_call():
    m, (x, y) = mlp(), data()
    loss = mse(m, x, y)
    full = flat(ts.structural_grad(m, loss, retain_graph=True))
    for wrt in ["4", "0.weight", ["0.bias", m[2]], lambda path, p: p.dim() == 1]:
        g = flat(ts.structural_grad(m, loss, wrt=wrt, retain_graph=True))
        assert list(g) == [p for p, _ in ts.select(m, wrt)]
        for path, t in g.items():
            torch.testing.assert_close(t, full[path], rtol=0, atol=0)


def test_wrt_callable_masks_per_call_and_restores_flags():
    m, (x, y) = mlp(), data()
    ref = backward_reference(m, lambda r: mse(r, x, y))
    seen = []

    def loss(mm):
        seen.append([p.requires_grad for p in mm.parameters()])
        return mse(mm, x, y)

    g1 = ts.structural_grad(m, loss, wrt="0")
    g2 = ts.structural_grad(m, loss, wrt="4.weight")
    assert ts.tree.paths(g1) == ["0.weight", "0.bias"]
    assert ts.tree.paths(g2) == ["4.weight"]
    assert seen == [[True, True, False, False, False, False], [False] * 4 + [True, False]]
    assert all(p.requires_grad for p in m.parameters())
    for g in (g1, g2):
        for path, t in flat(g).items():
            torch.testing.assert_close(t, ref[path], rtol=1e-6, atol=1e-7)


def test_wrt_callable_turns_on_a_frozen_parameter_and_restores_it():
    m, (x, y) = mlp(), data()
    m[0].weight.requires_grad_(False)  # the user's own starting flag
    ref = backward_reference(m, lambda r: (r[0].weight.requires_grad_(True), mse(r, x, y))[1])
    g = ts.structural_grad(m, lambda mm: mse(mm, x, y), wrt="0.weight")
    torch.testing.assert_close(g["0"]["weight"], ref["0.weight"])
    assert not m[0].weight.requires_grad
    assert ts.tree.paths(ts.structural_grad(m, lambda mm: mse(mm, x, y)))[0] == "0.bias"


def test_callable_value_unchanged_with_batchnorm_in_train_mode():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 1))
    ref = copy.deepcopy(m)
    x = torch.randn(8, 4)
    (v, g) = ts.value_and_grad(lambda mm: mm(x).sum(), m, wrt="2")
    torch.testing.assert_close(v, ref(x).sum().detach())
    torch.testing.assert_close(m[1].running_mean, ref[1].running_mean)
    assert ts.tree.paths(g) == ["2.weight", "2.bias"]


@pytest.mark.parametrize("wrt", ["1", "1.weight", ["0", "1"], None])
def test_a_batchnorm_torchstruct_holds_stays_held_when_asked_for(wrt):
    """A BatchNorm frozen by torchstruct keeps its statistics in training forwards; asking for
    its parameters turns them on for the loss only, and the loss still sees the layer held:
    the value is loss(model), the statistics stay, and the gradient is that of the layer
    normalizing with its running statistics (brute force: a copy in eval mode)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    m[1].running_mean.normal_()
    m[1].running_var.uniform_(0.5, 2.0)
    ts.freeze(m, "1")
    x = torch.randn(6, 3)
    ref = copy.deepcopy(m)
    ref[1].eval()
    ref[1].requires_grad_(True)
    stats = (m[1].running_mean.clone(), m[1].running_var.clone(), m[1].num_batches_tracked.clone())
    value, g = ts.value_and_grad(lambda mm: mm(x).square().mean(), m, wrt=wrt)
    loss = ref(x).square().mean()
    want = dict(zip([n for n, _ in ref.named_parameters()],
                    torch.autograd.grad(loss, list(ref.parameters()))))
    torch.testing.assert_close(value, loss.detach(), rtol=0, atol=0)
    for buf, before in zip((m[1].running_mean, m[1].running_var, m[1].num_batches_tracked), stats):
        assert torch.equal(buf, before)
    paths = ts.tree.paths(g)
    assert paths == ({"1": ["1.weight", "1.bias"], "1.weight": ["1.weight"],
                      None: ["0.weight", "0.bias", "2.weight", "2.bias"]}.get(wrt)
                     if not isinstance(wrt, list) else
                     ["0.weight", "0.bias", "1.weight", "1.bias"])
    leaves = dict(zip(paths, ts.tree.leaves(g)))
    for path, leaf in leaves.items():
        torch.testing.assert_close(leaf, want[path], rtol=0, atol=0)
    assert m.training and m[1].training
    assert not m[1].weight.requires_grad and m[0].weight.requires_grad


def _apply_in_loss(how, mm):
    """An application of the model inside a structural_grad loss."""
    if how == "a context entered":
        return ts.freeze(mm, "2.bias")
    mm.append(nn.Identity())  # a registration: the forward applies it
    return contextlib.nullcontext()


@pytest.mark.parametrize("how", ["a context entered", "a registration"])
@pytest.mark.parametrize("bn", ["held, asked for", "trainable, not asked for"])
def test_an_application_inside_the_loss_leaves_the_batchnorm_as_loss_model_sees_it(how, bn):
    """Inside the loss the call's flags hold (the asked ones on, the others off); an
    application there (a context entered in the loss, a registration) must not take them for
    the model's: a held BatchNorm stays held, a trainable one keeps updating, in the loss and
    after the call."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    if bn.startswith("held"):
        ts.freeze(m, "1")
    else:
        ts.attach(m)
    x = torch.randn(6, 3)
    ref = copy.deepcopy(m)  # a copy is plain PyTorch: a held layer is an eval-mode one there
    ref[1].train(not bn.startswith("held"))
    wrt = ["0", "1"] if bn.startswith("held") else "0"

    def loss(mm):
        with _apply_in_loss(how, mm):
            return mm(x).square().mean()

    value, _ = ts.value_and_grad(loss, m, wrt=wrt)
    torch.testing.assert_close(value, ref(x).square().mean().detach(), rtol=0, atol=0)
    torch.testing.assert_close(m[1].running_mean, ref[1].running_mean, rtol=0, atol=0)
    m(x), ref(x)  # and after the call
    torch.testing.assert_close(m[1].running_mean, ref[1].running_mean, rtol=0, atol=0)
    moved = not torch.equal(m[1].running_mean, torch.zeros(4))
    assert moved is bn.startswith("trainable")


def test_a_batchnorm_unfrozen_by_hand_is_not_held_when_asked_for():
    """Unfrozen by hand since the last application: plain, in the loss as outside it."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    ts.freeze(m, "1")
    m[1].requires_grad_(True)
    x = torch.randn(6, 3)
    ref = copy.deepcopy(m)
    value, _ = ts.value_and_grad(lambda mm: mm(x).square().mean(), m, wrt="1")
    torch.testing.assert_close(value, ref(x).square().mean().detach(), rtol=0, atol=0)
    torch.testing.assert_close(m[1].running_mean, ref[1].running_mean, rtol=0, atol=0)
    assert not torch.equal(m[1].running_mean, torch.zeros(4))


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = mlp()
        self.extra = nn.Linear(3, 3).double()

    def forward(self, x):
        return self.body(x)


def test_unused_parameter_gets_zeros():
    m, (x, y) = WithUnused(), data()
    for loss in (mse(m, x, y), lambda mm: mse(mm, x, y)):
        g = ts.structural_grad(m, loss)
        for leaf, p in [(g["extra"]["weight"], m.extra.weight), (g["extra"]["bias"], m.extra.bias)]:
            assert leaf.shape == p.shape and leaf.dtype == torch.float64
            assert not leaf.any()
        assert g["body"]["0"]["weight"].abs().sum() > 0


# ----------------------------------------------------------------------------- no side effects
def test_no_grad_side_effects():
    m, (x, y) = mlp(), data()
    assert all(p.grad is None for p in m.parameters())
    ts.structural_grad(m, mse(m, x, y))
    ts.structural_grad(m, lambda mm: mse(mm, x, y), wrt="2")
    assert all(p.grad is None for p in m.parameters())
    stale = {p: torch.full_like(p, 3.0) for p in m.parameters()}
    for p, s in stale.items():
        p.grad = s
    ts.structural_grad(m, mse(m, x, y))
    assert all(p.grad is s and bool((s == 3.0).all()) for p, s in stale.items())


def test_unasked_parameter_hooks_never_fire():
    m, (x, y) = mlp(), data()
    fired = []
    m[0].weight.register_hook(lambda g: fired.append("0.weight"))
    m[2].bias.register_hook(lambda g: fired.append("2.bias"))
    ts.structural_grad(m, mse(m, x, y), wrt="4")  # tensor form: both require grad
    ts.structural_grad(m, lambda mm: mse(mm, x, y), wrt=["4", "2.weight"])
    assert fired == []
    ts.structural_grad(m, mse(m, x, y), wrt="0.weight")
    assert fired == ["0.weight"]


def hook_every_node(model, loss):
    """Label each backward node ("Kind:param path" for nodes next to a parameter) and record
    the labels of the nodes that run."""
    by_param = {torch.autograd.graph.get_gradient_edge(p).node: n for n, p in model.named_parameters()}
    ran, seen, stack = [], set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        near = [by_param[f] for f, _ in node.next_functions if f in by_param]
        label = by_param.get(node) or ":".join([node.name()] + near)
        node.register_prehook(lambda go, label=label: ran.append(label))
        stack.extend(f for f, _ in node.next_functions)
    return ran


def test_backward_stops_at_the_asked_parameters():
    m, (x, y) = mlp(), data()
    loss = mse(m, x, y)
    ran = hook_every_node(m, loss)
    ts.structural_grad(m, loss, wrt="4", retain_graph=True)
    assert "AddmmBackward0:4.bias" in ran and "TBackward0:4.weight" in ran
    assert not any("Tanh" in r or "0." in r or "2." in r for r in ran), ran
    ran.clear()
    ts.structural_grad(m, loss, wrt="2.weight")
    assert "TBackward0:2.weight" in ran and "TanhBackward0" in ran
    assert not any("0." in r for r in ran), ran


def count_mm(fn):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.name == "aten::mm" for e in prof.events())


@pytest.mark.parametrize("form", ["tensor", "callable"])
def test_weight_gradient_products_of_unasked_parameters_are_skipped(form):
    # three bias-free layers, input not requiring grad: backward of "all" is 3 weight-grad
    # products + 2 input-grad products; asking only the last layer needs 1, the first 3
    m, (x, _) = mlp(bias=False), data()
    counts = {}
    for wrt in [None, "4", "2", "0"]:
        loss = m(x).sum() if form == "tensor" else (lambda mm: mm(x).sum())
        counts[wrt] = count_mm(lambda: ts.structural_grad(m, loss, wrt=wrt))
    if form == "callable":  # the forward (3 products) runs inside the call
        counts = {k: v - 3 for k, v in counts.items()}
    assert counts[None] == 5
    assert counts["4"] == 1 and counts["2"] == 2 and counts["0"] == 3


# ----------------------------------------------------------------------------- create_graph
def test_create_graph_gradient_penalty_matches_autograd():
    m, (x, y) = mlp(), data()
    g = ts.structural_grad(m, lambda mm: mse(mm, x, y), create_graph=True)
    penalty = sum((t ** 2).sum() for t in ts.tree.leaves(g))
    got = ts.structural_grad(m, penalty)

    ref_m = copy.deepcopy(m)
    params = list(ref_m.parameters())
    grads = torch.autograd.grad(mse(ref_m, x, y), params, create_graph=True)
    ref = torch.autograd.grad(sum((t ** 2).sum() for t in grads), params)
    for (n, _), r in zip(ref_m.named_parameters(), ref):
        torch.testing.assert_close(flat(got)[n], r, rtol=1e-5, atol=1e-7)


def test_create_graph_hessian_vector_product_matches_functional_hvp():
    m, (x, y) = mlp(), data()
    names = [n for n, _ in m.named_parameters()]
    v = {n: torch.randn_like(p) for n, p in m.named_parameters()}

    g = ts.structural_grad(m, lambda mm: mse(mm, x, y), create_graph=True)
    gv = sum((t * v[n]).sum() for n, t in flat(g).items())
    hv = flat(ts.structural_grad(m, gv))

    def f(*ps):
        return mse(lambda inp: torch.func.functional_call(m, dict(zip(names, ps)), (inp,)), x, y)

    primals = tuple(p.detach() for p in m.parameters())
    _, ref = torch.autograd.functional.hvp(f, primals, tuple(v[n] for n in names))
    for n, r in zip(names, ref):
        torch.testing.assert_close(hv[n], r, rtol=1e-5, atol=1e-6)


def test_retain_graph():
    m, (x, y) = mlp(), data()
    loss = mse(m, x, y)
    a = ts.structural_grad(m, loss, retain_graph=True)
    b = ts.structural_grad(m, loss)
    for p, q in zip(ts.tree.leaves(a), ts.tree.leaves(b)):
        assert torch.equal(p, q)
    with pytest.raises(RuntimeError):
        ts.structural_grad(m, loss)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from(["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]),
                min_size=1, max_size=4, unique=True),
       st.booleans())
def test_any_wrt_matches_autograd(wrt, as_callable):
    m, (x, y) = mlp(), data()
    params = dict(m.named_parameters())
    order = [n for n in params if n in wrt]
    ref = torch.autograd.grad(mse(m, x, y), [params[n] for n in order])
    loss = (lambda mm: mse(mm, x, y)) if as_callable else mse(m, x, y)
    g = flat(ts.structural_grad(m, loss, wrt=wrt))
    assert list(g) == order
    for n, r in zip(order, ref):
        torch.testing.assert_close(g[n], r, rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- errors
def flags(m):
    return [p.requires_grad for p in m.parameters()]


@pytest.mark.parametrize("how", ["by hand", "ts.freeze", "no parameters"])
def test_error_nothing_trainable_without_wrt(how):
    """wrt=None asks for the trainable parameters; with none, an empty tree would hide the
    mistake (as a wrt selecting nothing does): a ValueError before the loss runs, for a
    callable, a tensor loss (even one that requires grad through its input) and
    value_and_grad; nothing changes, and wrt= still reaches the frozen parameters."""
    m, (x, _) = mlp(), data()
    if how == "by hand":
        m.requires_grad_(False)
    elif how == "ts.freeze":
        ts.freeze(m)
    else:
        m = nn.Sequential(nn.Tanh())
    xg = x.clone().requires_grad_(True)
    ran = []

    def loss_fn(mm):
        ran.append(1)
        return mm(xg).sum()

    before = flags(m)
    for call in (lambda: ts.structural_grad(m, loss_fn),
                 lambda: ts.structural_grad(m, m(xg).sum()),
                 lambda: ts.value_and_grad(loss_fn, m)):
        with pytest.raises(ValueError, match="no parameter of the model .* is trainable"):
            call()
    assert not ran and flags(m) == before and all(p.grad is None for p in m.parameters())
    if how != "no parameters":
        g = flat(ts.structural_grad(m, loss_fn, wrt="0"))
        assert list(g) == ["0.weight", "0.bias"] and flags(m) == before


def test_error_non_scalar_loss():
    m, (x, _) = mlp(), data()
    with pytest.raises(ValueError, match=r"scalar.*\(7, 2\)"):
        ts.structural_grad(m, m(x))
    with pytest.raises(ValueError, match="scalar"):
        ts.structural_grad(m, lambda mm: mm(x))
    assert all(flags(m)) and all(p.grad is None for p in m.parameters())


def test_error_loss_without_grad():
    m, (x, y) = mlp(), data()
    with torch.no_grad():
        loss = mse(m, x, y)
    with pytest.raises(ValueError, match="does not require grad"):
        ts.structural_grad(m, loss)


def test_error_frozen_parameter_in_wrt_names_path():
    m, (x, y) = mlp(), data()
    with ts.freeze(m, "2"):
        loss = mse(m, x, y)
        before = flags(m)
        with pytest.raises(ValueError, match=r"'2\.weight'.*callable"):
            ts.structural_grad(m, loss, wrt=["4", "2"])
        assert flags(m) == before
        # the callable form computes it
        g = ts.structural_grad(m, lambda mm: mse(mm, x, y), wrt="2")
        assert ts.tree.paths(g) == ["2.weight", "2.bias"] and flags(m) == before


def test_error_unknown_selector_and_bad_types():
    m, (x, y) = mlp(), data()
    with pytest.raises(ValueError, match="closest"):
        ts.structural_grad(m, lambda mm: mse(mm, x, y), wrt="5.weight")
    with pytest.raises(TypeError, match="loss"):
        ts.structural_grad(m, 3.0)
    with pytest.raises(TypeError, match="nn.Module"):
        ts.structural_grad("model", mse(m, x, y))
    assert all(flags(m))


def test_error_in_loss_callable_restores_flags():
    m, _ = mlp(), data()
    with ts.freeze(m, "0"):
        before = flags(m)

        def boom(mm):
            raise KeyError("inside")

        with pytest.raises(KeyError):
            ts.structural_grad(m, boom, wrt="4")
        assert flags(m) == before


# ----------------------------------------------------------------------------- value_and_grad
def test_value_and_grad():
    m, (x, y) = mlp(), data()
    value, g = ts.value_and_grad(mse, m, x, y)
    torch.testing.assert_close(value, mse(m, x, y).detach())
    assert value.grad_fn is None
    assert_trees_close(g, backward_reference(m, lambda r: mse(r, x, y)))


def test_value_and_grad_aux_and_wrt():
    m, (x, y) = mlp(), data()

    def fn(mm, x, y):
        out = mm(x)
        return ((out - y) ** 2).mean(), {"out": out}

    (value, aux), g = ts.value_and_grad(fn, m, x, y, has_aux=True, wrt="4.bias")
    assert ts.tree.paths(g) == ["4.bias"]
    torch.testing.assert_close(aux["out"], m(x))
    with pytest.raises(TypeError, match="pair"):
        ts.value_and_grad(mse, m, x, y, has_aux=True)
    with pytest.raises(TypeError, match="callable"):
        ts.value_and_grad(None, m)


# ----------------------------------------------------------------------------- grad_tree
def test_grad_tree():
    m, (x, y) = mlp(), data()
    assert ts.grad_tree(m) == {}
    m[0].weight.grad = torch.ones_like(m[0].weight)  # stale, and frozen below
    with ts.freeze(m, "0"):
        mse(m, x, y).backward()
        g = ts.grad_tree(m)
    assert ts.tree.paths(g) == ["2.weight", "2.bias", "4.weight", "4.bias"]
    assert g["2"]["weight"] is m[2].weight.grad
    m[4].bias.grad = None
    assert "bias" not in ts.grad_tree(m)["4"]


def test_error_parameter_switched_off_inside_the_callable():
    m, (x, y) = mlp(), data()

    def sneaky(mm):
        mm[4].bias.requires_grad_(False)
        return mse(mm, x, y)

    with pytest.raises(RuntimeError, match=r"'4\.bias' stopped requiring grad"):
        ts.structural_grad(m, sneaky, wrt="4")
    # the flags the call wrote are restored; the write made inside the loss stands, as a
    # write inside any torchstruct block does (docs/structural.md)
    assert flags(m) == [True] * 5 + [False]


class _NoWeightGrad(torch.autograd.Function):
    """Uses the weight, but its backward gives it no gradient (returns None for it)."""

    @staticmethod
    def forward(ctx, x, w):
        return x * w

    @staticmethod
    def backward(ctx, g):
        return g, None


def test_an_edge_whose_gradient_never_comes_counts_as_unreached():
    """A backward node with an edge to a parameter that returns no gradient for it (a custom
    function, a compiled graph's backward for a parameter used only through .detach()): asked
    alone, the parameter is unreachable (ValueError, as for .detach()); asked with a reached
    one, it is unused (zeros)."""
    model = nn.Module()
    model.lin = nn.Linear(3, 3)
    model.w = nn.Parameter(torch.randn(3))
    x = torch.randn(2, 3)

    def loss():
        return _NoWeightGrad.apply(model.lin(x), model.w).sum()

    assert torch.autograd.grad(loss(), [model.w], allow_unused=True) == (None,)  # torch agrees
    with pytest.raises(ValueError, match="reaches none of the asked parameters"):
        ts.structural_grad(model, loss(), wrt="w")
    tree = ts.structural_grad(model, loss(), wrt=["w", "lin.bias"])
    assert torch.equal(tree["w"], torch.zeros(3))
    assert torch.equal(tree["lin"]["bias"], torch.autograd.grad(loss(), model.lin.bias)[0])


def test_the_watch_hook_of_callable_losses_is_one_entry_and_gone_after_threads_and_nesting():
    """A callable loss runs with one global forward pre-hook on (under one key, whatever the
    number of calls, threads or nesting), and none is left after."""
    import threading

    from torch.nn.modules import module as module_mod

    from torchstruct.grad import _watch

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
    x = torch.randn(4, 3)
    want = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    keys, errors = set(), []

    def loss(m):
        keys.update(k for k, h in module_mod._global_forward_pre_hooks.items() if h is _watch)
        inner = ts.structural_grad(m, lambda mm: mm(x).sum())  # nested
        assert torch.equal(inner["0"]["weight"], want[0])
        return m(x).sum()

    def work():
        try:
            for _ in range(20):
                got = ts.tree.leaves(ts.structural_grad(model, loss))
                assert all(torch.equal(a, b) for a, b in zip(got, want))
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(keys) == 1
    assert not any(h is _watch for h in module_mod._global_forward_pre_hooks.values())


# ------------------------------------------------------------ leaves own their memory
class _Parts(nn.Module):
    """Two parameters combined into one weight, in the ways autograd hands back shared
    gradient memory: one tensor for both sides of a sum, views of one tensor, a cat."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.base = nn.Parameter(torch.randn(2, 3))
        self.delta = nn.Parameter(torch.randn(2, 3))
        self.offset = nn.Parameter(torch.randn(4, 2))

    def forward(self, x):
        if self.how == "sum":
            w = self.base + self.delta
        elif self.how == "views":
            w = (self.base.view(6) + self.delta.view(6)).view(2, 3)
        else:  # cat: narrow views of one gradient, side by side
            w = torch.cat([self.base, self.delta])[:2] + torch.cat([self.base, self.delta])[2:]
        return nn.functional.linear(x, w) + self.offset  # offset's gradient: expanded as is


def _memory_of(t):
    return t.untyped_storage().data_ptr(), t.storage_offset(), t.numel()


@pytest.mark.parametrize("how", ["sum", "views", "cat"])
def test_leaves_never_share_memory_and_norms_and_clips_equal_backward(how):
    torch.manual_seed(0)
    m = _Parts(how)
    x = torch.randn(4, 3)
    tree = ts.structural_grad(m, lambda mm: mm(x).sum())
    leaves = ts.tree.leaves(tree)
    for i, a in enumerate(leaves):
        assert torch._debug_has_internal_overlap(a) == 0
        for b in leaves[i + 1:]:
            assert a is not b
            if a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr():
                lo_a, lo_b = a.storage_offset(), b.storage_offset()
                assert lo_a + a.numel() <= lo_b or lo_b + b.numel() <= lo_a  # side by side
    # by hand: each gradient copied (backward() itself may leave two .grad fields sharing
    # memory here, which clip_grad_norm_ would then scale twice)
    ref = [g.clone() for g in torch.autograd.grad(m(x).sum(), list(m.parameters()))]
    norm = torch.cat([g.flatten() for g in ref]).norm()
    torch.testing.assert_close(ts.global_norm(tree), norm)
    torch.testing.assert_close(ts.clip_by_global_norm(tree, 0.1), norm)
    coef = 0.1 / (norm + 1e-6)
    for (path, _), g in zip(m.named_parameters(), ref):
        torch.testing.assert_close(ts.tree.to_flat_dict(tree)[path], g * coef)


def test_copied_leaves_stay_differentiable_with_create_graph():
    torch.manual_seed(0)
    m = _Parts("sum")
    x = torch.randn(4, 3)
    tree = ts.structural_grad(m, lambda mm: mm(x).pow(2).sum(), create_graph=True)
    assert tree["base"] is not tree["delta"]
    penalty = sum(g.pow(2).sum() for g in ts.tree.leaves(tree))
    got = torch.autograd.grad(penalty, [m.base, m.delta])
    g = torch.autograd.grad(m(x).pow(2).sum(), [m.base, m.delta, m.offset], create_graph=True)
    want = torch.autograd.grad(sum(t.pow(2).sum() for t in g), [m.base, m.delta])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_value_and_grad_leaves_are_distinct_too():
    m = _Parts("sum")
    _, tree = ts.value_and_grad(lambda mm, x: mm(x).sum(), m, torch.randn(4, 3))
    assert tree["base"] is not tree["delta"]
    tree["base"].zero_()
    assert tree["delta"].abs().sum() > 0
