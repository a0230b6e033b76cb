"""An outside audit of ``ts.structural_grad``, ``ts.value_and_grad``, ``ts.grad_tree``,
``ts.map_trainable`` and the ``ts.tree`` helpers, read against DESIGN.md §3 / "Errors" and
docs/structural.md, docs/trees.md, docs/selecting.md.

What is checked, every answer against plain PyTorch (``torch.autograd.grad`` over a brute-force
set of parameters, ``.backward()`` into ``.grad``, ``torch.autograd.functional.hvp``):

* hypothesis-generated module trees (nesting, modules tied at two paths, weights tied across
  modules, hand-frozen subsets, modules registered but not called) with ``wrt`` selectors of
  every kind (glob naming a module or a parameter, ``re.Pattern``, callable, module object,
  parameter object, list of them), the asked set and every leaf compared with a brute force
  of the selecting rules and ``torch.autograd.grad``; tensor and callable loss forms agree;
* computing only what was asked for: a custom ``autograd.Function`` counts its backward calls
  and ``saved_tensors_hooks`` counts the activations recorded by the callable form with ``wrt``;
* ``create_graph=True``: a WGAN-GP gradient penalty (parameters and input), a Hessian-vector
  product, second-order terms through parameters not asked, ``retain_graph`` defaulting to
  ``create_graph`` as in ``torch.autograd.grad``;
* the loss forms: tensor loss reused without ``retain_graph``, callable raising (flags left as
  before), non-scalar loss, loss not requiring grad, loss from another model (paths named),
  a parameter only used under ``torch.no_grad`` (zeros / error), a loss that is a parameter;
* ``value_and_grad`` with ``has_aux`` (aux holding tensors that require grad), value detached,
  wrong arities; ``grad_tree`` after ``.backward()`` and under ``ts.freeze``;
* activation checkpointing (``use_reentrant`` False and True, ``checkpoint_sequential``),
  HF GPT-2 with ``gradient_checkpointing_enable`` built from a config, a PEFT LoRA model,
  ``torch.func.functional_call`` with the model's own tensors or copies, weight_norm
  parametrizations;
* gradients on complex, fp16, non-contiguous and expanded parameters, tied modules, leaves
  that own their memory (``w = base + delta``);
* ``ts.tree``: flatten / unflatten round trips with mixed dtypes (promotion), tied leaves,
  scalars and empty leaves; ``to_flat_dict`` / ``from_flat_dict`` with odd keys; ``map`` with
  mismatched trees; ``reduce``; ``map_trainable`` with a tree missing a leaf, carrying an
  extra one, a wrong shape, tied parameters.

Convention: a test that exposes a defect is kept, minimized, and marked
``@pytest.mark.xfail(strict=True, reason="BUG: what happens; what is expected")``; once the
defect is fixed the test passes, the strict xfail turns into a failure, and the marker has to
go. Limits the documentation states are not treated as defects: the test asserts the
documented behaviour instead.
"""
from __future__ import annotations

import fnmatch
import re
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import torchstruct as ts

T = ts.tree


# ----------------------------------------------------------------------------- helpers

def flat(tree):
    return T.to_flat_dict(tree)


def reference_grads(loss, pairs):
    """``torch.autograd.grad`` over unique ``pairs``; None -> zeros (the documented rule)."""
    got = torch.autograd.grad(loss, [p for _, p in pairs], allow_unused=True)
    return {path: (torch.zeros_like(p) if g is None else g) for (path, p), g in zip(pairs, got)}


class Leafy(nn.Module):
    """A module tree built from a list of slots; each slot is a Linear used in order."""

    def __init__(self, spec, d=3):
        super().__init__()
        self.slots = []  # (module, used)
        made = []
        for i, (depth, tie_mod, tie_w, used) in enumerate(spec):
            parent = self
            for level in range(depth):
                name = f"g{level}"
                if not hasattr(parent, name):
                    parent.add_module(name, nn.Module())
                parent = getattr(parent, name)
            if tie_mod is not None and made:
                lin = made[tie_mod % len(made)]
            else:
                lin = nn.Linear(d, d)
                if tie_w is not None and made:
                    lin.weight = made[tie_w % len(made)].weight
                made.append(lin)
            parent.add_module(f"l{i}", lin)
            self.slots.append((lin, used))

    def forward(self, x):
        h = x
        for lin, used in self.slots:
            if used:
                h = torch.tanh(lin(h))
        return h.pow(2).sum()


def brute_select(model, sel):
    """The selecting rules of docs/selecting.md, written out over every path."""
    everything = list(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules(remove_duplicate=False))

    def hit(path, p, s):
        if isinstance(s, (list, tuple)):
            return any(hit(path, p, one) for one in s)
        if isinstance(s, str):
            parts = path.split(".")
            prefixes = [".".join(parts[:k]) for k in range(1, len(parts) + 1)]
            return any(fnmatch.fnmatchcase(pre, s) for pre in prefixes)
        if isinstance(s, re.Pattern):
            return s.fullmatch(path) is not None
        if isinstance(s, nn.Parameter):
            return p is s
        if isinstance(s, nn.Module):
            return any(p is q for q in s.parameters())
        return bool(s(path, p))

    chosen = {id(p) for path, p in everything if hit(path, p, sel)}
    del modules
    return [(path, p) for path, p in model.named_parameters() if id(p) in chosen]


@st.composite
def model_and_selector(draw):
    n = draw(st.integers(2, 6))
    spec = []
    for i in range(n):
        depth = draw(st.integers(0, 2))
        tie_mod = draw(st.one_of(st.none(), st.integers(0, 5))) if i and draw(st.booleans()) else None
        tie_w = draw(st.one_of(st.none(), st.integers(0, 5))) if i and tie_mod is None else None
        used = draw(st.booleans()) if i else True
        spec.append((depth, tie_mod, tie_w, used))
    torch.manual_seed(draw(st.integers(0, 1000)))
    model = Leafy(spec)
    unique = list(model.named_parameters())
    frozen = draw(st.lists(st.sampled_from(range(len(unique))), max_size=len(unique) - 1, unique=True))
    for k in frozen:
        unique[k][1].requires_grad_(False)
    all_paths = [path for path, _ in model.named_parameters(remove_duplicate=False)]
    mod_paths = [path for path, _ in model.named_modules() if path]

    def one():
        kind = draw(st.sampled_from(["glob_param", "glob_module", "glob_star", "regex", "callable",
                                     "module", "param"]))
        if kind == "glob_param":
            return draw(st.sampled_from(all_paths))
        if kind == "glob_module":
            return draw(st.sampled_from(mod_paths))
        if kind == "glob_star":
            return draw(st.sampled_from(["*.bias", "*weight", "g0.*", "*l1*"]))
        if kind == "regex":
            return re.compile(re.escape(draw(st.sampled_from(all_paths))))
        if kind == "callable":
            return draw(st.sampled_from([lambda path, p: path.endswith("bias"),
                                         lambda path, p: p.ndim == 2,
                                         lambda path, p: "g1" in path]))
        if kind == "module":
            return model.get_submodule(draw(st.sampled_from(mod_paths)))
        return model.get_parameter(draw(st.sampled_from(all_paths)))

    sel = draw(st.one_of(st.none(), st.just("one"), st.just("list")))
    if sel == "one":
        sel = one()
    elif sel == "list":
        sel = [one(), one()]
    return model, sel


# ----------------------------------------------------------------------------- random trees

@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(model_and_selector(), st.booleans())
def test_random_trees_match_autograd(ms, callable_form):
    model, sel = ms
    x = torch.randn(2, 3)
    flags = [p.requires_grad for p in model.parameters()]
    if sel is None:
        asked = [(path, p) for path, p in model.named_parameters() if p.requires_grad]
    else:
        try:
            asked = brute_select(model, sel)
        except Exception:  # a str selector naming nothing is impossible here
            raise
    if not asked:
        with pytest.raises(ValueError):
            ts.structural_grad(model, lambda m: m(x), wrt=sel)
        return
    # reference: the asked parameters switched on for one forward, as the callable form does
    saved = [p.requires_grad for p in model.parameters()]
    for _, p in asked:
        p.requires_grad_(True)
    if sel is not None:
        keep = {id(p) for _, p in asked}
        for p in model.parameters():
            if id(p) not in keep:
                p.requires_grad_(False)
    ref_loss = model(x)
    reachable = ref_loss.requires_grad
    ref = reference_grads(ref_loss, asked) if reachable else None
    for p, f in zip(model.parameters(), saved):
        p.requires_grad_(f)
    if ref is not None and all(float(g.abs().sum()) == 0 for g in ref.values()):
        # maybe every asked parameter is unused: the loss reaches none of them
        used = {id(q) for lin, u in model.slots if u for q in lin.parameters()}
        if not any(id(p) in used for _, p in asked):
            ref = None
    if ref is None:
        with pytest.raises(ValueError):
            ts.structural_grad(model, lambda m: m(x), wrt=sel)
        assert [p.requires_grad for p in model.parameters()] == flags
        return
    if callable_form or any(not p.requires_grad for _, p in asked):
        got = flat(ts.structural_grad(model, lambda m: m(x), wrt=sel))
    else:
        got = flat(ts.structural_grad(model, model(x), wrt=sel))
    assert list(got) == [path for path, _ in asked]
    for path in got:
        torch.testing.assert_close(got[path], ref[path], rtol=1e-5, atol=1e-6)
    assert [p.requires_grad for p in model.parameters()] == flags
    assert all(p.grad is None for p in model.parameters())


# ----------------------------------------------------------------------------- only what is asked

class CountingMul(torch.autograd.Function):
    calls: list = []

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        CountingMul.calls.append(ctx.needs_input_grad)
        return (g @ w if ctx.needs_input_grad[0] else None,
                g.t() @ x if ctx.needs_input_grad[1] else None)


class WithCustom(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.randn(3, 4))
        self.head = nn.Linear(3, 1)

    def forward(self, x):
        return self.head(CountingMul.apply(torch.tanh(self.a(x)), self.w)).sum()


def test_unasked_branch_is_not_differentiated():
    torch.manual_seed(0)
    m, x = WithCustom(), torch.randn(2, 4)
    for loss in (lambda mm: mm(x), m(x)):
        CountingMul.calls.clear()
        g = ts.structural_grad(m, loss, wrt="head", retain_graph=True)
        assert list(flat(g)) == ["head.weight", "head.bias"]
        assert CountingMul.calls == []  # the backward below the head never ran
    CountingMul.calls.clear()
    ts.structural_grad(m, lambda mm: mm(x), wrt="w")
    assert CountingMul.calls == [(False, True)]  # the callable form records only w's branch


def test_callable_with_wrt_saves_nothing_for_unasked():
    torch.manual_seed(0)
    m, x = WithCustom(), torch.randn(2, 4)
    count = [0]

    def pack(t):
        count[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ts.structural_grad(m, lambda mm: mm(x), wrt="head.bias")
        only_bias = count[0]
        count[0] = 0
        ts.structural_grad(m, lambda mm: mm(x))
        everything = count[0]
    assert only_bias == 0 and everything > 0


def test_mm_count_for_last_layer_tensor_loss():
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    x = torch.randn(5, 8)

    def mms(fn):
        with torch.profiler.profile() as prof:
            fn()
        return sum(e.count for e in prof.key_averages() if e.key in ("aten::mm", "aten::addmm"))

    loss = m(x).sum()
    some = mms(lambda: ts.structural_grad(m, loss, wrt="3.weight", retain_graph=True))
    full = mms(lambda: torch.autograd.grad(loss, list(m.parameters())))
    assert some == 1 and full > some


# ----------------------------------------------------------------------------- create_graph

def test_gradient_penalty_and_input_grad_match_torch():
    torch.manual_seed(0)
    D = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    xi = torch.randn(5, 4, requires_grad=True)
    g = ts.structural_grad(D, lambda m: m(xi).sum(), create_graph=True)
    pen = sum((t ** 2).sum() for t in T.leaves(g))
    hp = flat(ts.structural_grad(D, pen, retain_graph=True))
    gx = torch.autograd.grad(pen, xi)[0]
    params = list(D.named_parameters())
    g2 = torch.autograd.grad(D(xi).sum(), [p for _, p in params], create_graph=True)
    pen2 = sum((t ** 2).sum() for t in g2)
    ref = reference_grads(pen2, params)
    for path in ref:
        torch.testing.assert_close(hp[path], ref[path])
    torch.testing.assert_close(gx, torch.autograd.grad(
        sum((t ** 2).sum() for t in torch.autograd.grad(D(xi).sum(), [p for _, p in params],
                                                       create_graph=True)), xi)[0])


def test_second_order_through_unasked_parameters():
    torch.manual_seed(0)
    D = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    xi = torch.randn(5, 4)
    g = ts.structural_grad(D, lambda m: m(xi).sum(), wrt="2", create_graph=True)
    pen = sum((t ** 2).sum() for t in T.leaves(g))
    got = flat(ts.structural_grad(D, pen, wrt="0"))
    g2 = torch.autograd.grad(D(xi).sum(), [D[2].weight, D[2].bias], create_graph=True)
    ref = reference_grads(sum((t ** 2).sum() for t in g2), [("0.weight", D[0].weight),
                                                             ("0.bias", D[0].bias)])
    for path in ref:
        torch.testing.assert_close(got[path], ref[path])
    assert got["0.weight"].abs().sum() > 0


def test_hvp_matches_torch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    x, y = torch.randn(7, 3), torch.randn(7, 2)
    v = T.map(torch.randn_like, T.from_module(model))
    g = ts.structural_grad(model, lambda m: nn.functional.mse_loss(m(x), y), create_graph=True)
    gv = sum((a * b).sum() for a, b in zip(T.leaves(g), T.leaves(v)))
    hv = T.leaves(ts.structural_grad(model, gv))
    names = T.paths(g)

    def f(*ps):
        return nn.functional.mse_loss(torch.func.functional_call(model, dict(zip(names, ps)), (x,)), y)

    _, ref = torch.autograd.functional.hvp(f, tuple(p.detach() for p in model.parameters()),
                                           tuple(T.leaves(v)))
    for a, b in zip(hv, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_retain_graph_defaults_like_torch():
    torch.manual_seed(0)
    D = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    x = torch.randn(3, 4)
    loss = D(x).sum()
    ts.structural_grad(D, loss)
    with pytest.raises(RuntimeError, match="second time"):
        ts.structural_grad(D, loss)
    loss = D(x).sum()
    ts.structural_grad(D, loss, create_graph=True)  # retain_graph defaults to create_graph
    again = ts.structural_grad(D, loss)
    assert T.paths(again) == [p for p, _ in D.named_parameters()]
    loss = D(x).sum()
    ts.structural_grad(D, loss, create_graph=True, retain_graph=False)
    with pytest.raises(RuntimeError, match="second time"):
        ts.structural_grad(D, loss)
    with pytest.raises(TypeError, match="retain_graph"):
        ts.structural_grad(D, lambda m: m(x).sum(), retain_graph=1)
    with pytest.raises(TypeError, match="create_graph"):
        ts.structural_grad(D, lambda m: m(x).sum(), create_graph="yes")


# ----------------------------------------------------------------------------- loss forms

def small():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))


def test_bad_losses_leave_flags_and_grads():
    m, x = small(), torch.randn(3, 4)
    m[0].weight.requires_grad_(False)
    before = [p.requires_grad for p in m.parameters()]

    def boom(mm):
        mm(x)
        raise KeyError("boom")

    with pytest.raises(KeyError):
        ts.structural_grad(m, boom, wrt="0")
    with pytest.raises(ValueError, match=r"scalar.*\(3, 2\)"):
        ts.structural_grad(m, lambda mm: mm(x), wrt="0")
    with pytest.raises(ValueError, match="does not require grad"):
        ts.structural_grad(m, lambda mm: mm(x).sum().detach(), wrt="2")
    with pytest.raises(TypeError):
        ts.structural_grad(m, lambda mm: 1.0)
    with pytest.raises(ValueError, match="'0.weight'"):
        ts.structural_grad(m, m(x).sum(), wrt="0.weight")  # frozen, tensor loss
    with pytest.raises(ValueError, match="callable"):
        ts.structural_grad(m, m(x).sum(), wrt="0.weight")
    assert [p.requires_grad for p in m.parameters()] == before
    assert all(p.grad is None for p in m.parameters())


def test_loss_from_another_model_names_paths():
    m, x = small(), torch.randn(3, 4)
    other = small()
    with pytest.raises(ValueError, match=r"reaches none of the asked parameters \('0.weight'"):
        ts.structural_grad(m, other(x).sum())
    copies = {k: v.detach().clone().requires_grad_() for k, v in m.named_parameters()}
    with pytest.raises(ValueError, match="'2.bias'"):
        ts.structural_grad(m, lambda mm: torch.func.functional_call(mm, copies, (x,)).sum(),
                           wrt="2.bias")
    own = dict(m.named_parameters())
    got = flat(ts.structural_grad(m, lambda mm: torch.func.functional_call(mm, own, (x,)).sum()))
    ref = reference_grads(m(x).sum(), list(m.named_parameters()))
    for path in ref:
        torch.testing.assert_close(got[path], ref[path])


class NoGradFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 1)

    def forward(self, x):
        with torch.no_grad():
            h = self.a(x)
        return self.b(h).sum()


def test_parameter_used_only_under_no_grad():
    m, x = NoGradFirst(), torch.randn(2, 3)
    g = flat(ts.structural_grad(m, lambda mm: mm(x)))
    assert torch.equal(g["a.weight"], torch.zeros(3, 3))  # unused by the graph: zeros
    assert g["b.weight"].abs().sum() > 0
    with pytest.raises(ValueError):  # only the unreached ones asked: an error, not zeros
        ts.structural_grad(m, lambda mm: mm(x) + mm.b.weight.sum() * 0 + 0, wrt="a")


class ScalarParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.tensor(2.0))
        self.lin = nn.Linear(2, 1)


def test_loss_that_is_a_parameter():
    m = ScalarParam()
    got = flat(ts.structural_grad(m, lambda mm: mm.s, wrt="s"))
    assert torch.equal(got["s"], torch.tensor(1.0))
    got = flat(ts.structural_grad(m, m.s))
    assert torch.equal(got["s"], torch.tensor(1.0)) and not got["lin.weight"].any()
    with pytest.raises(ValueError, match="lin.weight"):  # the loss reaches none of these
        ts.structural_grad(m, m.s, wrt="lin")


def test_loss_that_is_a_view_of_a_parameter():
    m = ScalarParam()
    got = flat(ts.structural_grad(m, lambda mm: mm.s.view(1)))
    assert torch.equal(got["s"], torch.tensor(1.0))
    assert torch.equal(got["lin.weight"], torch.zeros(1, 2))


def test_callable_under_no_grad_is_refused_tensor_loss_is_not():
    m, x = small(), torch.randn(3, 4)
    loss = m(x).sum()
    with torch.no_grad():
        got = flat(ts.structural_grad(m, loss))
        with pytest.raises(ValueError, match="does not require grad"):
            ts.structural_grad(m, lambda mm: mm(x).sum())
    ref = reference_grads(m(x).sum(), list(m.named_parameters()))
    for path in ref:
        torch.testing.assert_close(got[path], ref[path])


def test_flag_written_inside_loss_stands():
    m, x = small(), torch.randn(3, 4)
    m[0].weight.requires_grad_(False)

    def turn_on(mm):
        mm[0].weight.requires_grad_(True)
        return mm(x).sum()

    ts.structural_grad(m, turn_on, wrt="2")
    assert m[0].weight.requires_grad


def test_nested_call_inside_loss_restores_outer_flags():
    m, x = small(), torch.randn(3, 4)

    def outer(mm):
        inner = ts.structural_grad(mm, lambda q: q(x).pow(2).sum(), wrt="0.bias")
        assert not mm[0].weight.requires_grad  # still the outer call's flags
        return mm(x).sum() + 0 * inner["0"]["bias"].sum()

    got = flat(ts.structural_grad(m, outer, wrt="2"))
    assert list(got) == ["2.weight", "2.bias"]
    assert all(p.requires_grad for p in m.parameters())


# ----------------------------------------------------------------------------- value_and_grad / grad_tree

def test_value_and_grad_aux():
    m, x = small(), torch.randn(3, 4)

    def fn(mm, inp):
        out = mm(inp)
        return out.pow(2).sum(), {"out": out, "n": 3}

    (value, aux), g = ts.value_and_grad(fn, m, x, has_aux=True, wrt="2")
    assert value.grad_fn is None and not value.requires_grad
    assert aux["n"] == 3 and aux["out"].requires_grad  # returned as it is
    ref = reference_grads(m(x).pow(2).sum(), [("2.weight", m[2].weight), ("2.bias", m[2].bias)])
    for path, r in ref.items():
        torch.testing.assert_close(flat(g)[path], r)
    torch.testing.assert_close(value, m(x).pow(2).sum().detach())
    with pytest.raises(TypeError, match="pair"):
        ts.value_and_grad(lambda mm: mm(x).sum(), m, has_aux=True)
    with pytest.raises(TypeError):
        ts.value_and_grad(lambda mm: (mm(x).sum(), 1), m)
    with pytest.raises(TypeError, match="has_aux"):
        ts.value_and_grad(lambda mm: (mm(x).sum(), 1), m, has_aux=1)
    with pytest.raises(TypeError, match="fn"):
        ts.value_and_grad(None, m)
    assert all(p.requires_grad and p.grad is None for p in m.parameters())


def test_grad_tree_reads_grads():
    m, x = small(), torch.randn(3, 4)
    assert ts.grad_tree(m) == {}
    m(x).sum().backward()
    gt = ts.grad_tree(m)
    assert gt["0"]["weight"] is m[0].weight.grad
    with ts.freeze(m, "0"):
        assert T.paths(ts.grad_tree(m)) == ["2.weight", "2.bias"]
    with pytest.raises(TypeError):
        ts.grad_tree({"a": 1})


# ----------------------------------------------------------------------------- checkpointing / ecosystem

class Ck(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.a, self.mid, self.out = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)
        self.reentrant = reentrant

    def forward(self, x):
        return self.out(checkpoint(self.mid, torch.tanh(self.a(x)),
                                   use_reentrant=self.reentrant)).sum()


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_matches_backward(reentrant):
    torch.manual_seed(0)
    m, x = Ck(reentrant), torch.randn(3, 4)
    for wrt in (None, "mid", ["a.bias", "out"]):
        if reentrant and wrt == "mid":
            continue
        got = flat(ts.structural_grad(m, lambda mm: mm(x), wrt=wrt))
        assert all(p.grad is None for p in m.parameters())
        m(x).backward()
        for path, g in got.items():
            assert torch.equal(g, m.get_parameter(path).grad), path
        m.zero_grad(set_to_none=True)


def test_reentrant_checkpoint_recording_nothing_is_an_error_naming_path():
    torch.manual_seed(0)
    m, x = Ck(True), torch.randn(3, 4)
    with pytest.raises(ValueError, match="'mid.weight'"):
        ts.structural_grad(m, lambda mm: mm(x), wrt="mid")
    m.a.requires_grad_(False)
    with pytest.raises(ValueError, match="'mid.weight'"):
        ts.structural_grad(m, lambda mm: mm(x))
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        m.a.requires_grad_(True)
        ts.structural_grad(m, lambda mm: mm(x), create_graph=True)
    assert all(p.requires_grad and p.grad is None for p in m.parameters())


def test_checkpoint_sequential_reentrant_input_grad_untouched():
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    xi = torch.randn(3, 4, requires_grad=True)
    got = flat(ts.structural_grad(
        seq, lambda m: checkpoint_sequential(m, 2, xi, use_reentrant=True).sum()))
    assert xi.grad is None
    checkpoint_sequential(seq, 2, xi, use_reentrant=True).sum().backward()
    for path, p in seq.named_parameters():
        assert torch.equal(got[path], p.grad)


@pytest.mark.parametrize("reentrant", [False, True])
def test_hf_gpt2_gradient_checkpointing(reentrant):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=16,
                                  resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, bos_token_id=0,
                                  eos_token_id=0)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gpt = transformers.GPT2LMHeadModel(cfg).train()
        gpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ids = torch.randint(0, 50, (2, 8))

    def lf(m):
        return m(input_ids=ids, labels=ids).loss

    for wrt in (None, "transformer.h.1", "lm_head", ["transformer.wpe", "transformer.h.0.mlp"]):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = flat(ts.structural_grad(gpt, lf, wrt=wrt))
            lf(gpt).backward()
        if wrt == "lm_head":
            assert list(got) == ["transformer.wte.weight"]  # tied: at the first path
        for path, g in got.items():
            torch.testing.assert_close(g, gpt.get_parameter(path).grad, rtol=1e-5, atol=1e-6)
        gpt.zero_grad(set_to_none=True)
    assert all(p.requires_grad for p in gpt.parameters())


def test_peft_lora_only_adapters():
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bert = transformers.BertForSequenceClassification(transformers.BertConfig(
            hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
            vocab_size=50, max_position_embeddings=16, num_labels=2))
        pm = peft.get_peft_model(bert, peft.LoraConfig(r=2, target_modules=["query", "value"]))
    pm.eval()
    ids, lab = torch.randint(0, 50, (2, 8)), torch.tensor([0, 1])

    def pl(m):
        return m(input_ids=ids, labels=lab).loss

    trainable = [(n, p) for n, p in pm.named_parameters() if p.requires_grad]
    got = flat(ts.structural_grad(pm, pl))
    assert sorted(got) == sorted(n for n, _ in trainable)
    ref = reference_grads(pl(pm), trainable)
    for path in ref:
        torch.testing.assert_close(got[path], ref[path])
    one = flat(ts.structural_grad(pm, pl, wrt="*query.lora_B*"))
    assert all("query.lora_B" in k for k in one) and len(one) == 2
    assert sorted(n for n, p in pm.named_parameters() if p.requires_grad) == sorted(got)


def test_weight_norm_parametrization():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    nn.utils.parametrizations.weight_norm(m[0])
    x = torch.randn(3, 4)
    got = flat(ts.structural_grad(m, lambda mm: mm(x).sum()))
    ref = reference_grads(m(x).sum(), list(m.named_parameters()))
    assert list(got) == list(ref)
    for path in ref:
        torch.testing.assert_close(got[path], ref[path])


# ----------------------------------------------------------------------------- parameter kinds

class Kinds(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Parameter(torch.randn(3, dtype=torch.complex64))
        self.nc = nn.Parameter(torch.randn(4, 3).t())
        self.ex = nn.Parameter(torch.randn(1).expand(3))
        self.h = nn.Parameter(torch.randn(3, dtype=torch.float16))

    def forward(self, x):
        return ((self.c * x).abs().sum() + (self.nc * torch.arange(12.).reshape(3, 4)).sum()
                + (self.ex * x).sum() + (self.h.float() * x).pow(2).sum())


def test_odd_parameter_kinds_match_autograd():
    torch.manual_seed(0)
    m, x = Kinds(), torch.randn(3)
    got = flat(ts.structural_grad(m, lambda mm: mm(x)))
    ref = reference_grads(m(x), list(m.named_parameters()))
    for path in ref:
        assert got[path].dtype == m.get_parameter(path).dtype
        assert got[path].shape == m.get_parameter(path).shape
        torch.testing.assert_close(got[path], ref[path])


class Sum2(nn.Module):
    def __init__(self):
        super().__init__()
        self.base = nn.Parameter(torch.randn(3, 4))
        self.delta = nn.Parameter(torch.zeros(3, 4))

    def forward(self):
        return (self.base + self.delta).sum()


def test_leaves_own_their_memory():
    m = Sum2()
    g = ts.structural_grad(m, lambda mm: mm())
    assert g["base"].data_ptr() != g["delta"].data_ptr()
    assert torch._debug_has_internal_overlap(g["base"]) == 0
    ts.clip_by_global_norm(g, 1.0)
    torch.testing.assert_close(ts.global_norm(g), torch.tensor(1.0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g["base"], g["delta"])


class TiedTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = self.a
        self.c = nn.Linear(3, 3)
        self.c.weight = self.a.weight

    def forward(self, x):
        return self.c(self.b(self.a(x))).sum()


def test_tied_via_two_paths():
    torch.manual_seed(0)
    m, x = TiedTwice(), torch.randn(2, 3)
    ref = reference_grads(m(x), list(m.named_parameters()))
    for wrt in (None, "b.weight", "c.weight", m.c, re.compile(r"c\..*")):
        got = flat(ts.structural_grad(m, lambda mm: mm(x), wrt=wrt))
        assert "b.weight" not in got and "c.weight" not in got
        for path in got:
            torch.testing.assert_close(got[path], ref[path])
    vec, spec = T.flatten(ts.structural_grad(m, lambda mm: mm(x)))
    assert vec.numel() == sum(p.numel() for p in m.parameters())


def test_integer_parameter_in_wrt_named():
    m = nn.Linear(2, 1)
    m.register_parameter("steps", nn.Parameter(torch.zeros(1, dtype=torch.long),
                                               requires_grad=False))
    with pytest.raises(ValueError, match="'steps'"):
        ts.structural_grad(m, lambda mm: mm(torch.ones(1, 2)).sum(), wrt="steps")


def test_selector_errors():
    m, x = small(), torch.randn(3, 4)
    L = lambda mm: mm(x).sum()  # noqa: E731
    with pytest.raises(ValueError, match="'2.weight'"):
        ts.structural_grad(m, L, wrt="2.wieght")
    with pytest.raises(ValueError):
        ts.structural_grad(m, L, wrt=[])
    with pytest.raises(ValueError):
        ts.structural_grad(m, L, wrt=nn.Linear(2, 2))
    with pytest.raises(ValueError):
        ts.structural_grad(m, L, wrt=nn.Parameter(torch.ones(2)))
    with pytest.raises(ValueError):
        ts.structural_grad(m, L, wrt="1")  # Tanh: no parameter
    with pytest.raises(ValueError):
        ts.structural_grad(m, L, wrt=lambda path, p: False)
    with pytest.raises(TypeError):
        ts.structural_grad(m, L, wrt=torch.ones(2))
    with pytest.raises(ValueError):
        ts.structural_grad(nn.Tanh(), lambda mm: torch.ones(1, requires_grad=True).sum())
    assert all(p.requires_grad for p in m.parameters())


# ----------------------------------------------------------------------------- ts.tree

def test_flatten_promotes_and_round_trips():
    t = {"h": torch.tensor([1.5, -2.0], dtype=torch.float16),
         "b": {"x": torch.tensor([[0.25]], dtype=torch.bfloat16)},
         "i": torch.tensor(3), "z": torch.ones(2, 0), "f64": torch.tensor([0.1], dtype=torch.float64)}
    vec, spec = T.flatten(t)
    assert vec.dtype == torch.float64 and vec.numel() == 5
    back = T.unflatten(vec, spec)
    for path, leaf in T.to_flat_dict(t).items():
        got = T.to_flat_dict(back)[path]
        assert got.dtype == leaf.dtype and got.shape == leaf.shape and torch.equal(got, leaf)
    v2, _ = T.flatten({"a": torch.tensor([1, 2], dtype=torch.int32), "b": torch.tensor([True])})
    assert v2.dtype == torch.int32
    v3, _ = T.flatten({"a": torch.ones(2, dtype=torch.float16), "b": torch.ones(1, dtype=torch.bfloat16)})
    assert v3.dtype == torch.float32
    empty, espec = T.flatten({})
    assert empty.dtype == torch.float32 and empty.numel() == 0 and T.unflatten(empty, espec) == {}
    with pytest.raises(ValueError, match="6"):
        T.unflatten(torch.zeros(6), spec)
    with pytest.raises(TypeError):  # a non-zero imaginary part for real leaves
        T.unflatten(torch.full((5,), 1j, dtype=torch.complex64), spec)
    back = T.unflatten(vec.to(torch.complex128), spec)  # a zero one: cast back exactly
    assert all(torch.equal(T.to_flat_dict(back)[k], v) for k, v in T.to_flat_dict(t).items())


def test_flatten_tied_and_views():
    p = torch.ones(3, requires_grad=True)
    vec, spec = T.flatten({"a": p, "b": p})
    assert vec.numel() == 3 and spec.entries[1].alias_of == "a"
    back = T.unflatten(vec * 2, spec)
    assert back["a"] is back["b"]
    w = torch.arange(4.0)
    assert T.flatten({"a": w[:2], "b": w[:2]})[0].numel() == 2  # same view, no grad: once
    assert T.flatten({"a": w[:2], "b": w[2:]})[0].numel() == 4
    assert T.flatten({"a": w, "b": w.view(2, 2)})[0].numel() == 8
    (vec * torch.arange(3.0)).sum().backward()
    assert torch.equal(p.grad, torch.arange(3.0))  # differentiable w.r.t. the leaf


def test_flat_dict_and_odd_keys():
    a = torch.arange(3.0)
    assert T.paths({"a.b": a, "a": {"c": a}}) == ["a.b", "a.c"]
    for bad in ({"": a}, {"a.": a}, {".a": a}, {"a..b": a}, {"a.b": a, "a": {"b": a}}, {1: a}):
        with pytest.raises(ValueError):
            T.paths(bad)
    with pytest.raises(TypeError, match="'a'"):
        T.paths({"a": [a]})
    with pytest.raises(TypeError):
        T.paths([a])
    with pytest.raises(ValueError, match="'fc'"):
        T.from_flat_dict({"fc": a, "fc.bias": a})
    with pytest.raises(ValueError):
        T.from_flat_dict([("a", a), ("a", a)])
    with pytest.raises(TypeError):
        T.from_flat_dict("ab")
    tree = T.from_flat_dict([("x.y", a), ("x.z", None), ("w", a)])
    assert T.paths(tree) == ["x.y", "w"] and T.to_flat_dict(tree)["x.y"] is a
    mixed = {"x.a": a, "y": {"b": a.clone()}}
    assert list(T.map(lambda t: t * 2, mixed)) == ["x.a", "y"]
    vec, spec = T.flatten(mixed)
    assert list(T.unflatten(vec, spec)) == ["x.a", "y"]


def test_map_and_reduce():
    a = torch.arange(3.0)
    with pytest.raises(ValueError, match="'b'"):
        T.map(torch.add, {"a": a}, {"a": a, "b": a})
    with pytest.raises(ValueError, match="'b'"):
        T.map(torch.add, {"a": a, "b": a}, {"a": a})
    with pytest.raises(ValueError, match="'b'"):
        T.map(torch.add, {"a": a, "b": a}, {"a": a, "b": None})
    with pytest.raises(TypeError):
        T.map(torch.add, {"a": a}, a)
    with pytest.raises(TypeError, match="'a'"):
        T.map(lambda t: 1, {"a": a})
    nested = T.map(torch.add, {"x": {"a": a}}, {"x.a": a})
    assert torch.equal(T.to_flat_dict(nested)["x.a"], 2 * a)
    dropped = T.map(lambda t: None, {"x": {"a": a}, "y": a})
    assert dropped == {}
    assert T.reduce(lambda acc, t: acc + t.numel(), {"a": a, "b": {"c": a}}, 0) == 6
    assert T.reduce(lambda acc, t: acc + 1, {}, 5) == 5
    with pytest.raises(TypeError):
        T.reduce(None, {"a": a}, 0)


def test_map_trainable_tree_checks():
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    full = T.to_flat_dict(T.map(torch.ones_like, T.from_module(m)))
    assert list(T.to_flat_dict(ts.map_trainable(lambda p, g: g * 2, m, full))) == list(full)
    miss = {k: v for k, v in full.items() if k != "1.bias"}
    with pytest.raises(ValueError, match="'1.bias'"):
        ts.map_trainable(lambda p, g: g, m, miss)
    with pytest.raises(ValueError, match="'2.weight'"):
        ts.map_trainable(lambda p, g: g, m, {**full, "2.weight": torch.ones(1)})
    with pytest.raises(ValueError, match="'1.bias'"):
        ts.map_trainable(lambda p, g: g, m, {**full, "1.bias": torch.ones(())})
    with pytest.raises(ValueError, match="'1.bias'"):
        ts.map_trainable(lambda p, g: g, m, {**full, "1.bias": None})
    with ts.freeze(m, "0"):
        part = {k: v for k, v in full.items() if not k.startswith("0")}
        assert T.paths(ts.map_trainable(lambda p, g: g, m, part)) == ["1.weight", "1.bias"]
        with pytest.raises(ValueError, match="'0.weight'"):
            ts.map_trainable(lambda p, g: g, m, {**full, "0.weight": torch.ones(3)})
    with pytest.raises(TypeError, match="f"):
        ts.map_trainable(3, m, full)
    tied = TiedTwice()
    tree = T.map(torch.ones_like, T.from_module(tied))
    assert T.paths(ts.map_trainable(lambda p, g: g, tied, tree)) == T.paths(tree)
    with pytest.raises(ValueError, match="'a.weight'"):
        ts.map_trainable(lambda p, g: g, tied, {**T.to_flat_dict(tree),
                                                "c.weight": torch.zeros(3, 3)})


class NoneForSecond(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, w):
        return a * w.sum()

    @staticmethod
    def backward(ctx, g):
        return g, None


def test_edge_without_gradient_counts_as_unreached():
    torch.manual_seed(0)
    m, x = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)), torch.ones(1, 2)

    def loss(mm):
        return NoneForSecond.apply(mm[1](x).sum(), mm[0].weight)

    with pytest.raises(ValueError, match="'0.weight'"):
        ts.structural_grad(m, loss, wrt="0.weight")
    got = flat(ts.structural_grad(m, loss, wrt=["0.weight", "1.bias"]))
    assert torch.equal(got["0.weight"], torch.zeros(2, 2))
    assert torch.equal(got["1.bias"], torch.ones(1))
    assert all(p.requires_grad and p.grad is None for p in m.parameters())
