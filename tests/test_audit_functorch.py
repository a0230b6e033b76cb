"""Audit: torchstruct with ``torch.func`` and higher-order autograd, as a suspicious user.

What is audited
- MAML-style inner loops: ``ts.structural_grad(..., create_graph=True)`` (tensor and callable
  loss, with and without ``wrt``), adapted trees fed through ``torch.func.functional_call``
  (nested trees via ``ts.tree.to_flat_dict``), ``ts.map_trainable`` for the fast weights,
  frozen parts, tied weights, two inner steps; second-order terms shown to be present by
  comparing with first-order MAML.
- Hessian-vector products and third derivatives through chained ``structural_grad`` calls,
  with frozen parameters and with ``ts.stop_gradient`` / ``ts.swap`` / ``ts.freeze`` blocks in
  the loss; nested ``structural_grad`` / ``value_and_grad`` calls inside a loss callable;
  differentiable gradient-norm penalties through ``ts.global_norm`` and ``ts.grad_tree``.
- ``torch.func`` transforms (``grad``, ``jacrev``, ``jacfwd``, ``hessian``, ``jvp``, ``vmap``)
  and ``torch.autograd.functional`` over functions that enter ``ts.swap`` / ``ts.stop_gradient``
  / ``ts.constant`` blocks, use ``ts.within_gradient``, ``ts.map_trainable``, ``ts.tree``
  flatten/unflatten and ``ts.global_norm``; ``stack_module_state`` ensembles evaluated through
  ``ts.swap`` under ``vmap``; ``functional_call`` while blocks are active (who wins);
  torchstruct entry points refused inside transforms leave every flag as it was.
- Forward-mode AD (``torch.autograd.forward_ad`` duals, ``torch.func.jvp``) through blocks,
  through ``structural_grad`` (forward-over-reverse), ``ts.tree`` and ``ts.global_norm``.

Oracles: plain ``torch.autograd.grad`` on hand-detached copies, ``torch.func.functional_call``
with the tensors put in by hand, ``torch.autograd.functional.hvp`` / ``hessian``,
``torch.func`` transforms of by-hand functions, ``torch.linalg.vector_norm``, and central
finite differences in float64 for the MAML meta-gradient.

Pinned after fixes: ``ts.global_norm`` under forward mode and ``vmap`` (the kernels gave a
zero tangent and no batching rule), ``ts.tree.flatten`` of duals sharing memory (one tangent
was lost), and what a ``within_gradient`` layer sees in ``structural_grad(wrt=)``'s forward.
"""
import copy

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import nn
from torch.func import (functional_call, grad, hessian, jacfwd, jacrev, jvp,
                        stack_module_state, vmap)

import torchstruct as ts

T = ts.tree
D = torch.float64
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning",
                                         "ignore::DeprecationWarning")


# ----------------------------------------------------------------------------- helpers
def mlp(seed=1, sizes=(3, 4, 2)):
    torch.manual_seed(seed)
    a, b, c = sizes
    return nn.Sequential(nn.Linear(a, b), nn.Tanh(), nn.Linear(b, c)).to(D)


def data(seed=0, n=5, i=3, o=2):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, i, generator=g, dtype=D), torch.randn(n, o, generator=g, dtype=D))


X, Y = data(0)
XQ, YQ = data(7)


def mse(m, x=X, y=Y):
    return F.mse_loss(m(x), y)


def flags(m):
    return [p.requires_grad for p in m.parameters()]


def close_seq(a, b, atol=1e-10, rtol=1e-7):
    a, b = list(a), list(b)
    return len(a) == len(b) and all(
        u.shape == v.shape and torch.allclose(u, v, atol=atol, rtol=rtol) for u, v in zip(a, b))


def close_tree(tree, ref, atol=1e-10):
    """``tree`` (nested or flat) equals the flat dict ``ref``: same paths, same values."""
    f = T.to_flat_dict(tree)
    return list(f) == list(ref) and close_seq(f.values(), ref.values(), atol=atol)


def dot(a, b):
    return sum((u * v).sum() for u, v in zip(a, b))


# ============================================================================ 1. MAML
ALPHA = 0.4


def maml_reference(m, first_order=False, frozen=()):
    """Meta-gradient of L_q(theta - alpha * grad L_s(theta)) with plain autograd."""
    names = [n for n, p in m.named_parameters() if n not in frozen]
    params = dict(m.named_parameters())
    inner = torch.autograd.grad(mse(m), [params[n] for n in names], create_graph=not first_order)
    fast = dict(params)
    fast.update({n: params[n] - ALPHA * g for n, g in zip(names, inner)})
    outer = F.mse_loss(functional_call(m, fast, (XQ,)), YQ)
    return dict(zip(names, torch.autograd.grad(outer, [params[n] for n in names])))


@pytest.mark.parametrize("form", ["callable", "tensor"])
def test_maml_nested_tree_through_functional_call_matches_autograd_and_differs_from_fomaml(form):
    m = mlp()
    inner = ts.structural_grad(m, mse if form == "callable" else mse(m), create_graph=True)
    assert all(t.requires_grad and t.grad_fn is not None for t in T.leaves(inner))
    fast = T.map(lambda p, g: p - ALPHA * g, T.from_module(m), inner)  # a nested tree
    assert isinstance(fast["0"], dict)
    outer = F.mse_loss(functional_call(m, T.to_flat_dict(fast), (XQ,)), YQ)
    meta = ts.structural_grad(m, outer)
    want = maml_reference(m)
    assert close_tree(meta, want)
    # first-order MAML (inner gradient detached) gives other numbers: the second-order
    # terms really are in the tree
    fo = maml_reference(m, first_order=True)
    assert not close_seq(fo.values(), want.values(), atol=1e-6)
    assert flags(m) == [True] * 4 and all(p.grad is None for p in m.parameters())


def test_maml_meta_gradient_equals_central_finite_differences_float64():
    m = mlp(seed=3, sizes=(2, 3, 1))
    x, y = data(1, n=6, i=2, o=1)
    xq, yq = data(2, n=6, i=2, o=1)
    names = [n for n, _ in m.named_parameters()]

    def meta_loss_of(values):
        """Outer loss as a plain function of the parameter values (no autograd involved
        in the oracle besides the inner gradient, computed fresh each time)."""
        with torch.no_grad():
            for p, v in zip(m.parameters(), values):
                p.copy_(v)
        inner = ts.structural_grad(m, lambda mm: F.mse_loss(mm(x), y))
        fast = ts.map_trainable(lambda p, g: (p - ALPHA * g).detach(), m, inner)
        return F.mse_loss(functional_call(m, T.to_flat_dict(fast), (xq,)), yq).item()

    base = [p.detach().clone() for p in m.parameters()]
    inner = ts.structural_grad(m, lambda mm: F.mse_loss(mm(x), y), create_graph=True)
    fast = ts.map_trainable(lambda p, g: p - ALPHA * g, m, inner)
    meta = T.to_flat_dict(ts.structural_grad(
        m, F.mse_loss(functional_call(m, T.to_flat_dict(fast), (xq,)), yq)))
    eps = 1e-6
    for k, name in enumerate(names):
        fd = torch.zeros_like(base[k])
        for idx in range(base[k].numel()):
            vals = [b.clone() for b in base]
            vals[k].view(-1)[idx] += eps
            up = meta_loss_of(vals)
            vals[k].view(-1)[idx] -= 2 * eps
            fd.view(-1)[idx] = (up - meta_loss_of(vals)) / (2 * eps)
        assert torch.allclose(meta[name], fd, atol=1e-7, rtol=1e-5), name
    with torch.no_grad():
        for p, b in zip(m.parameters(), base):
            p.copy_(b)


@pytest.mark.parametrize("form", ["callable", "tensor"])
def test_anil_head_only_inner_loop_keeps_the_body_second_order_terms(form):
    """ANIL: adapt only the head (wrt='2', create_graph=True); the meta-gradient of the body
    includes d(head gradient)/d(body), as torch.autograd.grad gives it."""
    m = mlp()
    g = ts.structural_grad(m, mse if form == "callable" else mse(m), wrt="2", create_graph=True)
    assert T.paths(g) == ["2.weight", "2.bias"]
    fast = T.to_flat_dict(T.map(lambda p, gr: p - ALPHA * gr, {"2": T.from_module(m)["2"]}, g))
    meta = ts.structural_grad(m, F.mse_loss(functional_call(m, fast, (XQ,)), YQ))
    want = maml_reference(m, frozen=("0.weight", "0.bias"))
    ps = dict(m.named_parameters())
    head = torch.autograd.grad(mse(m), [ps["2.weight"], ps["2.bias"]], create_graph=True)
    f2 = dict(ps)
    f2.update({"2.weight": ps["2.weight"] - ALPHA * head[0], "2.bias": ps["2.bias"] - ALPHA * head[1]})
    full = torch.autograd.grad(F.mse_loss(functional_call(m, f2, (XQ,)), YQ), list(ps.values()))
    assert close_tree(meta, dict(zip(ps, full)))
    assert close_seq([meta["2"]["weight"], meta["2"]["bias"]], want.values())
    # the body term with the head gradient detached is different
    f3 = dict(ps)
    f3.update({"2.weight": ps["2.weight"] - ALPHA * head[0].detach(),
               "2.bias": ps["2.bias"] - ALPHA * head[1].detach()})
    fo = torch.autograd.grad(F.mse_loss(functional_call(m, f3, (XQ,)), YQ), [ps["0.weight"]])[0]
    assert not torch.allclose(fo, meta["0"]["weight"], atol=1e-6)
    assert flags(m) == [True] * 4


def test_maml_with_a_permanently_frozen_layer_and_map_trainable_partial_tree():
    m = mlp()
    ts.freeze(m, "0")
    inner = ts.structural_grad(m, mse, create_graph=True)
    assert T.paths(inner) == ["2.weight", "2.bias"]
    fast = ts.map_trainable(lambda p, g: p - ALPHA * g, m, inner)
    outer = F.mse_loss(functional_call(m, T.to_flat_dict(fast), (XQ,)), YQ)  # partial dict
    meta = ts.structural_grad(m, outer)
    # twin in plain PyTorch: the same numbers with requires_grad_(False) written by hand
    twin = mlp()
    twin[0].requires_grad_(False)
    assert close_tree(meta, maml_reference(twin, frozen=("0.weight", "0.bias")))
    with pytest.raises(ValueError, match="0.weight"):
        ts.structural_grad(m, F.mse_loss(functional_call(m, T.to_flat_dict(fast), (XQ,)), YQ),
                           wrt="0.weight")
    assert flags(m) == [False, False, True, True]


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.emb = nn.Embedding(7, 4).to(D)
        self.mid = nn.Linear(4, 4).to(D)
        self.head = nn.Linear(4, 7, bias=False).to(D)
        self.head.weight = self.emb.weight

    def forward(self, t):
        return self.head(torch.tanh(self.mid(self.emb(t))))


def test_maml_on_tied_weights_through_functional_call_tie_weights():
    m = TiedLM()
    tok = torch.tensor([[1, 2, 3], [4, 5, 6]])
    lf = lambda mm: F.cross_entropy(mm(tok).flatten(0, 1), tok.flatten())
    inner = ts.structural_grad(m, lf, create_graph=True)
    assert T.paths(inner) == ["emb.weight", "mid.weight", "mid.bias"]
    fast = ts.map_trainable(lambda p, g: p - ALPHA * g, m, inner)
    # functional_call ties head.weight to the emb.weight entry (tie_weights=True)
    outer = F.cross_entropy(functional_call(m, T.to_flat_dict(fast), (tok.flip(1),)).flatten(0, 1),
                            tok.flip(1).flatten())
    meta = ts.structural_grad(m, outer)
    ps = dict(m.named_parameters())
    gi = torch.autograd.grad(lf(m), list(ps.values()), create_graph=True)
    f = {n: p - ALPHA * g for (n, p), g in zip(ps.items(), gi)}
    out = F.cross_entropy(functional_call(m, f, (tok.flip(1),)).flatten(0, 1), tok.flip(1).flatten())
    assert close_tree(meta, dict(zip(ps, torch.autograd.grad(out, list(ps.values())))))


def test_two_inner_steps_structural_grad_then_autograd_on_fast_weights():
    """Step 1 by structural_grad on the parameters, step 2 by autograd.grad on the fast
    tree (structural_grad differentiates parameters, not stand-ins), meta step by
    structural_grad of the outer loss: equal to a plain functional_call implementation."""
    m = mlp()
    g1 = ts.structural_grad(m, mse, create_graph=True)
    fast1 = T.to_flat_dict(T.map(lambda p, g: p - ALPHA * g, T.from_module(m), g1))
    l2 = F.mse_loss(functional_call(m, fast1, (X,)), Y)
    g2 = torch.autograd.grad(l2, list(fast1.values()), create_graph=True)
    fast2 = {n: w - ALPHA * g for (n, w), g in zip(fast1.items(), g2)}
    meta = ts.structural_grad(m, F.mse_loss(functional_call(m, fast2, (XQ,)), YQ))

    ps = dict(m.named_parameters())
    w = dict(ps)
    for _ in range(2):
        gs = torch.autograd.grad(F.mse_loss(functional_call(m, w, (X,)), Y), list(w.values()),
                                 create_graph=True)
        w = {n: v - ALPHA * g for (n, v), g in zip(w.items(), gs)}
    ref = torch.autograd.grad(F.mse_loss(functional_call(m, w, (XQ,)), YQ), list(ps.values()))
    assert close_tree(meta, dict(zip(ps, ref)))


def test_maml_purely_functional_map_trainable_inside_torch_func_grad():
    """torch.func.grad over a params dict, ts.map_trainable building the fast weights from
    wrapped tensors; a frozen bias is not adapted (trainability from the model)."""
    m = mlp()
    ts.freeze(m, "0.bias")
    params = {k: v.detach().clone() for k, v in m.named_parameters()}

    def outer(ps):
        inner = grad(lambda q: F.mse_loss(functional_call(m, q, (X,)), Y))(ps)
        fast = ts.map_trainable(lambda p, a, g: a - ALPHA * g, m, ps, inner)
        assert T.paths(fast) == ["0.weight", "2.weight", "2.bias"]
        return F.mse_loss(functional_call(m, {**ps, **T.to_flat_dict(fast)}, (XQ,)), YQ)

    def outer_ref(ps):
        inner = grad(lambda q: F.mse_loss(functional_call(m, q, (X,)), Y))(ps)
        fast = {k: ps[k] if k == "0.bias" else ps[k] - ALPHA * inner[k] for k in ps}
        return F.mse_loss(functional_call(m, fast, (XQ,)), YQ)

    assert close_tree(grad(outer)(params), grad(outer_ref)(params))
    # vmap over tasks: per-task fast weights from batched trees
    P = {k: torch.randn(3, *v.shape, dtype=D) for k, v in params.items()}
    G = {k: torch.randn(3, *v.shape, dtype=D) for k, v in params.items()}
    got = T.to_flat_dict(vmap(lambda p, g: ts.map_trainable(lambda q, a, b: a - b, m, p, g))(P, G))
    assert list(got) == ["0.weight", "2.weight", "2.bias"]
    assert all(torch.equal(got[k], P[k] - G[k]) for k in got)


# ============================================================================ 2. HVP, nesting
def param_names(m):
    return [n for n, _ in m.named_parameters()]


def hvp_by_structural_grad(m, loss, v):
    g = ts.structural_grad(m, loss, create_graph=True)
    return ts.structural_grad(m, dot(T.leaves(g), T.leaves(v)))


def test_hvp_with_a_frozen_layer_is_the_hvp_of_the_trainable_subset():
    m = mlp()
    v = {"2": {"weight": torch.randn(2, 4, dtype=D), "bias": torch.randn(2, dtype=D)}}
    with ts.freeze(m, "0"):
        hv = hvp_by_structural_grad(m, mse, v)
    assert T.paths(hv) == ["2.weight", "2.bias"]

    def f(w, b):
        return F.mse_loss(functional_call(m, {"2.weight": w, "2.bias": b}, (X,)), Y)

    _, ref = torch.autograd.functional.hvp(f, (m[2].weight.detach(), m[2].bias.detach()),
                                           tuple(T.leaves(v)))
    assert close_seq(T.leaves(hv), ref)
    assert flags(m) == [True] * 4


def test_hvp_with_stop_gradient_and_swap_blocks_inside_the_loss():
    m = mlp()
    names = param_names(m)
    teacher = T.map(lambda p: p.detach().clone() + 0.1, T.from_module(m))

    def loss(mm):
        with ts.stop_gradient(mm, "0"):
            a = mm(X)
        with ts.swap(mm, teacher):
            t = mm(XQ)
        return F.mse_loss(mm(X), Y) + (a * mm(X)).sum() + (mm(XQ) - t).pow(2).sum()

    def by_hand(*ps):
        d = dict(zip(names, ps))
        blocked = {k: (t.detach() if k.startswith("0.") else t) for k, t in d.items()}
        a = functional_call(m, blocked, (X,))
        t = functional_call(m, T.to_flat_dict(teacher), (XQ,))
        o = functional_call(m, d, (X,))
        return F.mse_loss(o, Y) + (a * o).sum() + (functional_call(m, d, (XQ,)) - t).pow(2).sum()

    v = T.map(torch.randn_like, T.from_module(m))
    hv = hvp_by_structural_grad(m, loss, v)
    _, ref = torch.autograd.functional.hvp(by_hand, tuple(p.detach() for p in m.parameters()),
                                           tuple(T.leaves(v)))
    assert close_seq(T.leaves(hv), ref)
    # the blocks changed something: without them the hvp differs
    full_hv = hvp_by_structural_grad(
        m, lambda mm: F.mse_loss(mm(X), Y) + (mm(X) * mm(X)).sum(), v)
    assert not close_seq(T.leaves(full_hv), ref, atol=1e-6)


def test_full_hessian_from_structural_grad_rows_equals_torch_func_hessian():
    m = mlp(sizes=(2, 2, 1))
    x, y = data(3, n=4, i=2, o=1)
    names = param_names(m)
    g = T.to_flat_dict(ts.structural_grad(m, lambda mm: F.mse_loss(mm(x), y), create_graph=True))
    flat_g = torch.cat([t.flatten() for t in g.values()])
    rows = []
    for i in range(flat_g.numel()):
        r = ts.structural_grad(m, flat_g[i], retain_graph=True)
        rows.append(torch.cat([t.flatten() for t in T.leaves(r)]))
    H = torch.stack(rows)
    params = {k: v.detach() for k, v in m.named_parameters()}
    ref = hessian(lambda ps: F.mse_loss(functional_call(m, ps, (x,)), y))(params)
    Href = torch.cat([torch.cat([ref[a][b].reshape(params[a].numel(), params[b].numel())
                                 for b in names], 1) for a in names], 0)
    assert torch.allclose(H, Href, atol=1e-10)
    assert torch.allclose(H, H.T, atol=1e-10)


def test_third_order_by_chained_structural_grad_equals_autograd():
    m = mlp()
    ps = list(m.parameters())
    torch.manual_seed(9)
    v1 = [torch.randn_like(p) for p in ps]
    v2 = [torch.randn_like(p) for p in ps]
    g1 = torch.autograd.grad(mse(m), ps, create_graph=True)
    h1 = torch.autograd.grad(dot(g1, v1), ps, create_graph=True)
    want = torch.autograd.grad(dot(h1, v2), ps)
    G = ts.structural_grad(m, mse, create_graph=True)
    H = ts.structural_grad(m, dot(T.leaves(G), v1), create_graph=True)
    assert all(t.requires_grad for t in T.leaves(H))
    got = ts.structural_grad(m, dot(T.leaves(H), v2))
    assert close_seq(T.leaves(got), want)


def test_nested_structural_grad_in_a_loss_callable_gradient_penalty():
    """outer wrt='2' whose loss adds ||d loss / d body||^2 computed by an inner
    structural_grad(wrt='0', create_graph=True); inner calls without wrt inside see every
    trainable parameter on; the outer flags come back after each inner call."""
    m = mlp()
    lam = 0.7
    seen = {}

    def outer(mm):
        seen["outer"] = flags(mm)
        for cg in (False, True):
            full = ts.structural_grad(mm, mse, create_graph=cg)
            seen[f"full{cg}"] = T.to_flat_dict(full)
            seen[f"after{cg}"] = flags(mm)
        g0 = ts.structural_grad(mm, mse, wrt="0", create_graph=True)
        seen["after_wrt"] = flags(mm)
        return mse(mm) + lam * sum(t.pow(2).sum() for t in T.leaves(g0))

    got = ts.structural_grad(m, outer, wrt="2")
    ps = list(m.parameters())
    ref_full = torch.autograd.grad(mse(m), ps)
    g0 = torch.autograd.grad(mse(m), ps[:2], create_graph=True)
    want = torch.autograd.grad(mse(m) + lam * sum(t.pow(2).sum() for t in g0), ps[2:])
    assert close_seq(T.leaves(got), want)
    assert seen["outer"] == [False, False, True, True]
    for cg in (False, True):
        assert close_seq(seen[f"full{cg}"].values(), ref_full)
        assert seen[f"after{cg}"] == [False, False, True, True]
    assert seen["after_wrt"] == [False, False, True, True]
    assert flags(m) == [True] * 4


def test_value_and_grad_inside_a_loss_callable_and_aux_returned_as_it_is():
    m = mlp()
    ps = list(m.parameters())
    ref = torch.autograd.grad(mse(m), ps)
    seen = {}

    def outer(mm):
        (v, aux), g = ts.value_and_grad(lambda q: (mse(q), q(X)), mm, has_aux=True, wrt="0")
        seen["g"], seen["v"], seen["aux"] = g, v, aux
        return mse(mm)

    got = ts.structural_grad(m, outer, wrt="2")
    assert close_seq(T.leaves(got), ref[2:])
    assert close_seq(T.leaves(seen["g"]), ref[:2])
    assert seen["v"].grad_fn is None and torch.allclose(seen["v"], mse(m))
    assert torch.allclose(seen["aux"], m(X))
    box = []

    def fn(q):
        out = q(X)
        box.append(out)
        return F.mse_loss(out, Y), {"out": out}

    (v, aux), g = ts.value_and_grad(fn, m, has_aux=True)
    assert aux["out"] is box[0]  # "aux is returned as it is"
    assert v.grad_fn is None and close_seq(T.leaves(g), ref)


def test_gradient_norm_penalty_through_global_norm_tree_and_grad_tree():
    m = mlp()
    ps = list(m.parameters())
    for p_norm in (2.0, 1.0, 3.0, float("inf")):
        g1 = torch.autograd.grad(mse(m), ps, create_graph=True)
        want = torch.autograd.grad(torch.cat([g.flatten() for g in g1]).norm(p_norm), ps)
        g = ts.structural_grad(m, mse, create_graph=True)
        pen = ts.global_norm(g, p_norm)
        assert pen.requires_grad
        assert close_seq(T.leaves(ts.structural_grad(m, pen)), want), p_norm
    # backward(create_graph=True) then grad_tree / global_norm(model) of the trainable grads
    with ts.freeze(m, "0"):
        g1 = torch.autograd.grad(mse(m), ps[2:], create_graph=True)
        want = torch.autograd.grad(torch.cat([g.flatten() for g in g1]).norm(), ps[2:])
        mse(m).backward(create_graph=True)
        assert T.paths(ts.grad_tree(m)) == ["2.weight", "2.bias"]
        got_model = torch.autograd.grad(ts.global_norm(m), ps[2:], retain_graph=True)
        got_tree = torch.autograd.grad(ts.global_norm(ts.grad_tree(m)), ps[2:])
    for p in ps:
        p.grad = None
    assert close_seq(got_model, want) and close_seq(got_tree, want)


def test_retain_graph_semantics_on_one_graph_with_create_graph():
    m = mlp()
    loss = mse(m)
    a = ts.structural_grad(m, loss, create_graph=True)  # retain_graph defaults to True
    b = ts.structural_grad(m, loss, create_graph=True)
    assert close_seq(T.leaves(a), T.leaves(b), atol=0)
    c = ts.structural_grad(m, loss, create_graph=True, retain_graph=False)
    assert close_seq(T.leaves(a), T.leaves(c), atol=0)
    with pytest.raises(RuntimeError, match="second time"):
        ts.structural_grad(m, loss)
    # plain PyTorch behaves the same with create_graph=True, retain_graph=False
    ref_loss = mse(m)
    ra = torch.autograd.grad(ref_loss, list(m.parameters()), create_graph=True, retain_graph=False)
    with pytest.raises(RuntimeError, match="second time"):
        torch.autograd.grad(ref_loss, list(m.parameters()))
    assert close_seq(T.leaves(a), ra)


def test_a_loss_with_a_jacobian_regularizer_from_torch_func():
    """The loss callable itself runs vmap(jacrev(model)) / jvp(model): structural_grad
    (tensor, callable, wrt, second order) equals torch.autograd.grad."""
    def jac_loss(mm):
        J = vmap(jacrev(mm))(X)
        return F.mse_loss(mm(X), Y) + 0.3 * J.pow(2).sum()

    def jvp_loss(mm):
        _, t = jvp(mm, (X,), (torch.ones_like(X),))
        return F.mse_loss(mm(X), Y) + 0.3 * t.pow(2).sum()

    for lf in (jac_loss, jvp_loss):
        m = mlp()
        ps = list(m.parameters())
        ref = torch.autograd.grad(lf(m), ps)
        assert close_seq(T.leaves(ts.structural_grad(m, lf)), ref)
        assert close_seq(T.leaves(ts.structural_grad(m, lf(m))), ref)
        assert close_seq(T.leaves(ts.structural_grad(m, lf, wrt="0")), ref[:2])
        g1 = torch.autograd.grad(lf(m), ps, create_graph=True)
        ref2 = torch.autograd.grad(sum(g.pow(2).sum() for g in g1), ps)
        g = ts.structural_grad(m, lf, create_graph=True)
        got = ts.structural_grad(m, sum(t.pow(2).sum() for t in T.leaves(g)))
        assert close_seq(T.leaves(got), ref2)
        assert flags(m) == [True] * 4


def test_reparametrized_weights_through_functional_call_reach_the_parameters():
    m = mlp()
    mask = (torch.arange(12).reshape(4, 3) % 2).to(D)
    out = functional_call(m, {"0.weight": m[0].weight * mask}, (X,))
    g = ts.structural_grad(m, F.mse_loss(out, Y))
    ps = list(m.parameters())
    ref = torch.autograd.grad(F.mse_loss(functional_call(m, {"0.weight": ps[0] * mask}, (X,)), Y), ps)
    assert close_seq(T.leaves(g), ref)
    assert torch.all(g["0"]["weight"][mask == 0] == 0)
    # copies that are not computed from the parameters: the documented error, no zeros
    copies = {k: v.detach().clone().requires_grad_() for k, v in m.named_parameters()}
    with pytest.raises(ValueError, match="reaches none"):
        ts.structural_grad(m, F.mse_loss(functional_call(m, copies, (X,)), Y))


def test_a_graph_recorded_inside_freeze_and_differentiated_after_it():
    m = mlp()
    with ts.freeze(m, "0"):
        g = ts.structural_grad(m, mse, create_graph=True)
    assert flags(m) == [True] * 4
    pen = sum(t.pow(2).sum() for t in T.leaves(g))
    got = T.to_flat_dict(ts.structural_grad(m, pen, retain_graph=True))
    ps = list(m.parameters())
    ps[0].requires_grad_(False)
    ps[1].requires_grad_(False)
    g1 = torch.autograd.grad(mse(m), ps[2:], create_graph=True)
    want = torch.autograd.grad(sum(t.pow(2).sum() for t in g1), ps[2:])
    ps[0].requires_grad_(True)
    ps[1].requires_grad_(True)
    # switched on after the forward: zeros (documented), the others exact
    assert torch.equal(got["0.weight"], torch.zeros(4, 3, dtype=D))
    assert close_seq([got["2.weight"], got["2.bias"]], want)
    with pytest.raises(ValueError, match="0.weight"):
        ts.structural_grad(m, pen, wrt="0")


# ============================================================================ 3. torch.func over blocks
W0 = torch.randn(4, 3, generator=torch.Generator().manual_seed(4), dtype=D)


def test_transforms_over_a_stand_in_entered_in_swap_inside_the_function():
    m = mlp()

    def via_swap(w):
        with ts.swap(m, {"0": {"weight": w}}):
            return F.mse_loss(m(X), Y)

    def via_fc(w):
        return F.mse_loss(functional_call(m, {"0.weight": w}, (X,)), Y)

    for tr in (grad, jacrev, jacfwd, hessian):
        assert torch.allclose(tr(via_swap)(W0), tr(via_fc)(W0), atol=1e-12), tr.__name__
    t = torch.randn_like(W0)
    assert torch.allclose(jvp(via_swap, (W0,), (t,))[1], jvp(via_fc, (W0,), (t,))[1])
    Ws = torch.randn(6, 4, 3, dtype=D)
    assert torch.allclose(vmap(via_swap)(Ws), vmap(via_fc)(Ws))
    assert torch.allclose(vmap(grad(via_swap))(Ws), vmap(grad(via_fc))(Ws))
    # torch.autograd.functional too (it differentiates plain tensors requiring grad)
    V = torch.randn_like(W0)
    AF = torch.autograd.functional
    assert torch.allclose(AF.hessian(via_swap, W0), AF.hessian(via_fc, W0))
    assert torch.allclose(AF.hessian(via_swap, W0, vectorize=True), AF.hessian(via_fc, W0))
    assert torch.allclose(AF.hvp(via_swap, W0, V)[1], AF.hvp(via_fc, W0, V)[1])
    assert torch.allclose(AF.vhp(via_swap, W0, V)[1], AF.vhp(via_fc, W0, V)[1])
    # nothing left behind: the model is plain again
    assert torch.equal(m(X), functional_call(m, {k: v.detach() for k, v in m.named_parameters()}, (X,)))


@pytest.mark.parametrize("order", ["swap>stop_gradient", "stop_gradient>swap"])
def test_nested_swap_and_stop_gradient_inside_transforms_over_the_parameters(order):
    m = mlp()
    params = dict(m.named_parameters())

    def blocks():
        s, g = ts.swap(m, {"0.weight": W0}), ts.stop_gradient(m, "0.weight")
        return (s, g) if order == "swap>stop_gradient" else (g, s)

    def loss(ps):
        a, b = blocks()
        with a, b:
            return functional_call(m, ps, (X,)).pow(3).sum()

    def by_hand(ps):
        q = dict(ps)
        q["0.weight"] = W0  # a constant: the swapped weight, its own use blocked anyway
        return functional_call(m, q, (X,)).pow(3).sum()

    for tr in (grad, jacrev, jacfwd):
        got, want = tr(loss)(params), tr(by_hand)(params)
        assert close_seq(got.values(), want.values()), tr.__name__
        assert torch.equal(got["0.weight"], torch.zeros(4, 3, dtype=D))
    tang = {k: torch.ones_like(v) for k, v in params.items()}
    assert torch.allclose(jvp(loss, (params,), (tang,))[1], jvp(by_hand, (params,), (tang,))[1])
    # stand-in as the transform variable, blocked by its own path: gives nothing
    def lw(w):
        with ts.swap(m, {"0.weight": w}), ts.stop_gradient(m, "0"):
            return m(X).pow(3).sum()
    assert torch.equal(grad(lw)(W0), torch.zeros(4, 3, dtype=D))
    assert jvp(lw, (W0,), (torch.ones_like(W0),))[1].item() == 0.0


def test_stop_gradient_entered_inside_a_transformed_function():
    m = mlp()
    params = dict(m.named_parameters())

    def f(ps):
        with ts.stop_gradient(m, "0"):
            h = functional_call(m, ps, (X,))
        return functional_call(m, ps, (X,)).pow(2).sum() + (h * h.sin()).sum()

    def ref(ps):
        d = {k: (v.detach() if k.startswith("0.") else v) for k, v in ps.items()}
        h = functional_call(m, d, (X,))
        return functional_call(m, ps, (X,)).pow(2).sum() + (h * h.sin()).sum()

    assert close_seq(grad(f)(params).values(), grad(ref)(params).values())
    sub = {k: params[k] for k in ("0.bias", "2.bias")}
    H = hessian(lambda s: f({**params, **s}))(sub)
    Hr = hessian(lambda s: ref({**params, **s}))(sub)
    assert all(torch.allclose(H[a][b], Hr[a][b]) for a in sub for b in sub)


def test_ensemble_via_stack_module_state_and_swap_under_vmap():
    torch.manual_seed(0)
    models = [mlp(seed=s) for s in range(3)]
    for mm in models:
        ts.freeze(mm, "0.bias")
    params, _ = stack_module_state(models)
    assert {k: v.requires_grad for k, v in params.items()} == {
        "0.weight": True, "0.bias": False, "2.weight": True, "2.bias": True}
    base = models[0]

    def with_swap(p):
        with ts.swap(base, p):
            return F.mse_loss(base(X), Y)

    def with_fc(p):
        return F.mse_loss(functional_call(base, p, (X,)), Y)

    got = vmap(with_swap)(params)
    want = vmap(with_fc)(params)
    assert torch.allclose(got, want)
    assert torch.allclose(want, torch.stack([mse(mm) for mm in models]))
    g_swap = torch.autograd.grad(got.sum(), [params["0.weight"], params["2.weight"]])
    g_fc = torch.autograd.grad(vmap(with_fc)(params).sum(), [params["0.weight"], params["2.weight"]])
    assert close_seq(g_swap, g_fc)
    # per-member gradients with vmap(grad) through the swap
    pg = vmap(grad(with_swap))(params)
    for i, mm in enumerate(models):
        ref = T.to_flat_dict(ts.structural_grad(mm, mse, wrt=lambda n, p: True))
        assert all(torch.allclose(pg[k][i], ref[k]) for k in ref)
    assert base[0].bias.requires_grad is False and flags(models[1]) == [True, False, True, True]


def test_constant_under_transforms_reads_pass_and_writes_are_refused():
    m = mlp()
    params = dict(m.named_parameters())
    before = [p.detach().clone() for p in m.parameters()]
    lf = lambda ps: functional_call(m, ps, (X,)).pow(2).sum()
    want = grad(lf)(params)
    with ts.constant(m):
        assert close_seq(grad(lf)(params).values(), want.values())
        assert torch.allclose(vmap(m)(X), m(X))
        assert torch.allclose(jvp(m, (X,), (X,))[1], jvp(lambda x: functional_call(
            m, {k: v.detach() for k, v in params.items()}, (x,)), (X,), (X,))[1])

        def writes(x):
            with torch.no_grad():
                m[0].weight.add_(x.sum())
            return m(x)

        with pytest.raises(RuntimeError, match="'0.weight'"):
            vmap(writes)(X)
    assert all(torch.equal(p, b) for p, b in zip(m.parameters(), before))


def test_within_gradient_inside_transforms_follows_the_blocks():
    m = mlp()
    params = dict(m.named_parameters())
    seen = {}

    def f(ps, block):
        if block:
            with ts.stop_gradient(m, "0"):
                out = functional_call(m, ps, (X,))
                seen["in"] = (ts.within_gradient(m[0]), ts.within_gradient(m[2]),
                              ts.within_gradient(m))
        out = functional_call(m, ps, (X,))
        seen["out"] = (ts.within_gradient(m[0]), ts.within_gradient(m[2]))
        return out.sum()

    grad(lambda ps: f(ps, True))(params)
    assert seen == {"in": (False, True, True), "out": (True, True)}
    seen.clear()
    tang = {k: torch.ones_like(v) for k, v in params.items()}
    jvp(lambda ps: f(ps, True), (params,), (tang,))
    assert seen == {"in": (False, True, True), "out": (True, True)}
    # a captured tensor not being differentiated is not "within gradient"
    plain = torch.randn(3, dtype=D)
    res = []
    grad(lambda u: (res.append((ts.within_gradient(u), ts.within_gradient(plain))), u.sum())[1])(plain)
    assert res == [(True, False)]


def test_functional_call_inside_blocks_who_wins():
    """Documented: tensors handed to functional_call that are not the parameters are left
    alone by the blocks; the parameters themselves are replaced."""
    m = mlp()
    A = torch.full((4, 3), 0.5, dtype=D, requires_grad=True)
    B = torch.full((4, 3), -0.25, dtype=D)
    with ts.swap(m, {"0.weight": B}):
        o_copy = functional_call(m, {"0.weight": A}, (X,))
        o_params = functional_call(m, dict(m.named_parameters()), (X,))
    assert torch.allclose(o_copy, functional_call(m, {"0.weight": A}, (X,)))
    assert torch.allclose(o_params, functional_call(m, {"0.weight": B}, (X,)))
    with ts.stop_gradient(m, "0"):
        o = functional_call(m, {"0.weight": A}, (X,))
    o.sum().backward()
    ref = torch.autograd.grad(functional_call(m, {"0.weight": A}, (X,)).sum(), A)[0]
    assert torch.allclose(A.grad, ref) and m[0].bias.grad is None and m[2].weight.grad is not None


def test_tree_flatten_unflatten_under_transforms():
    m = mlp()
    params = {k: v.detach().clone() for k, v in m.named_parameters()}

    def fl(ps):
        v, spec = T.flatten(ps)
        back = T.unflatten(v * 2, spec)
        return sum(t.pow(3).sum() for t in T.leaves(back)) + v.sin().sum()

    def fl_ref(ps):
        v = torch.cat([t.flatten() for t in ps.values()])
        return sum((2 * t).pow(3).sum() for t in ps.values()) + v.sin().sum()

    assert close_seq(grad(fl)(params).values(), grad(fl_ref)(params).values())
    P = {k: torch.randn(4, *v.shape, dtype=D) for k, v in params.items()}
    assert torch.allclose(vmap(fl)(P), vmap(fl_ref)(P))
    tang = {k: torch.randn_like(v) for k, v in params.items()}
    assert torch.allclose(jvp(fl, (params,), (tang,))[1], jvp(fl_ref, (params,), (tang,))[1])
    # two distinct tensors on the same memory under torch.func.grad: not tied (as in eager
    # autograd, where they require grad)
    w = params["0.weight"]
    f2 = lambda u: (T.flatten({"a": u, "b": u.view(u.shape)})[0] ** 2).sum()
    assert torch.allclose(grad(f2)(w), 4 * w)


def test_torchstruct_entry_points_refused_inside_transforms_leave_flags_as_they_were():
    m = mlp()

    def enters_freeze(x):
        with ts.freeze(m, "0"):
            return m(x).sum()

    def asks_wrt(x):
        ts.structural_grad(m, lambda mm: mm(x).sum(), wrt="2")
        return x.sum()

    for fn, tr in ((enters_freeze, grad), (enters_freeze, vmap), (asks_wrt, grad)):
        with pytest.raises(RuntimeError):
            tr(fn)(X)
        assert flags(m) == [True] * 4
        assert [n for n, _ in ts.trainable_parameters(m)] == param_names(m)
    with ts.freeze(m, "2"):  # contexts still work afterwards
        assert flags(m) == [True, True, False, False]
    assert flags(m) == [True] * 4


def test_a_pending_application_waits_through_vmap_and_functional_call():
    m = mlp()
    ts.mark_trainable(m, "2")
    assert flags(m) == [False, False, True, True]
    m.append(nn.Linear(2, 2).to(D))  # registered: applied at the next plain forward
    assert torch.allclose(vmap(m)(X), m[3](m[2](m[1](m[0](X)))))
    stand_ins = {k: v.detach().clone().requires_grad_() for k, v in m.named_parameters()}
    functional_call(m, stand_ins, (X,)).sum().backward()
    assert all(v.requires_grad and v.grad is not None for v in stand_ins.values())
    m(X)
    assert flags(m) == [False, False, True, True, False, False]



def test_captured_parameters_in_vmap_and_per_sample_jacobians_inside_stop_gradient():
    """vmap / vmap(jacrev) over inputs with the parameters captured, inside a block, then an
    ordinary backward: the blocked layer gets nothing, the rest what detach-by-hand gives."""
    m = mlp()
    with ts.stop_gradient(m, "0"):
        out = (vmap(m)(X).sum()
               + vmap(lambda x: functional_call(m, dict(m.named_parameters()), (x,)))(X).sum()
               + vmap(jacrev(m))(X).pow(2).sum())
    got = torch.autograd.grad(out, list(m.parameters()), allow_unused=True)
    d = {k: (v.detach() if k.startswith("0.") else v) for k, v in m.named_parameters()}
    f = lambda x: functional_call(m, d, (x,))
    ref = vmap(f)(X).sum() * 2 + vmap(jacrev(f))(X).pow(2).sum()
    want = torch.autograd.grad(ref, list(m.parameters()), allow_unused=True)
    assert got[0] is None and got[1] is None and want[0] is None
    assert close_seq(got[2:], want[2:])


def test_hvp_inside_unfreeze_of_a_parameter_frozen_by_hand():
    m = mlp()
    m[0].weight.requires_grad_(False)  # the user's own starting flag
    v = T.map(torch.randn_like, T.from_module(m))
    with ts.unfreeze(m, "0.weight"):
        hv = hvp_by_structural_grad(m, mse, v)
    assert not m[0].weight.requires_grad
    names = param_names(m)

    def f(*ps):
        return F.mse_loss(functional_call(m, dict(zip(names, ps)), (X,)), Y)

    _, ref = torch.autograd.functional.hvp(f, tuple(p.detach() for p in m.parameters()),
                                           tuple(T.leaves(v)))
    assert T.paths(hv) == names and close_seq(T.leaves(hv), ref)
    with pytest.raises(ValueError, match="0.weight"):  # outside the block: not asked by default
        ts.structural_grad(m, mse(m), wrt="0.weight")

# ============================================================================ 4. forward mode
def test_dual_inputs_through_blocks_have_the_plain_tangent():
    m = mlp()
    tx = torch.randn_like(X)
    want = jvp(m, (X,), (tx,))[1]
    for block in (lambda: ts.stop_gradient(m), lambda: ts.constant(m),
                  lambda: ts.swap(m, {"2.bias": m[2].bias.detach().clone()})):
        with fwAD.dual_level():
            d = fwAD.make_dual(X, tx)
            with block():
                out = m(d)
            t = fwAD.unpack_dual(out).tangent
        assert t is not None and torch.allclose(t, want)


def test_dual_stand_ins_in_swap_carry_their_tangent():
    m = mlp()
    t0 = torch.randn_like(W0)
    with fwAD.dual_level():
        d = fwAD.make_dual(W0, t0)
        with ts.swap(m, {"0.weight": d}):
            out = m(X)
        t = fwAD.unpack_dual(out).tangent
    want = jvp(lambda w: functional_call(m, {"0.weight": w}, (X,)), (W0,), (t0,))[1]
    assert t is not None and torch.allclose(t, want)


class Sum(nn.Module):
    """Gradients of base and delta are one tensor in autograd: structural_grad copies one."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.base = nn.Parameter(torch.randn(2, 3, dtype=D))
        self.delta = nn.Parameter(torch.randn(2, 3, dtype=D))
        self.bias = nn.Parameter(torch.randn(2, dtype=D))

    def forward(self, x):
        return torch.tanh(x @ (self.base + self.delta).T) + self.bias


@pytest.mark.parametrize("make", [mlp, Sum], ids=["mlp", "aliased-grads"])
@pytest.mark.parametrize("create_graph", [True, False])
def test_forward_over_reverse_structural_grad_of_a_dual_input(make, create_graph):
    m = make()
    tx = torch.randn_like(X)
    params = {k: v.detach() for k, v in m.named_parameters()}
    _, want = jvp(lambda x: grad(lambda ps: functional_call(m, ps, (x,)).pow(2).sum())(params),
                  (X,), (tx,))
    with fwAD.dual_level():
        d = fwAD.make_dual(X, tx)
        g = T.to_flat_dict(ts.structural_grad(m, lambda mm: mm(d).pow(2).sum(),
                                              create_graph=create_graph))
        tangents = {k: fwAD.unpack_dual(v).tangent for k, v in g.items()}
    assert list(tangents) == list(want)
    assert all(t is not None and torch.allclose(t, want[k]) for k, t in tangents.items())


def test_unflatten_of_a_dual_vector_keeps_the_tangents():
    tree = {"a": torch.randn(2, 3, dtype=D), "b": {"c": torch.randn(4, dtype=D)}}
    vec, spec = T.flatten(tree)
    tv = torch.arange(vec.numel(), dtype=D)
    with fwAD.dual_level():
        back = T.unflatten(fwAD.make_dual(vec, tv), spec)
        ta = fwAD.unpack_dual(back["a"]).tangent
        tc = fwAD.unpack_dual(back["b"]["c"]).tangent
    assert torch.equal(ta, tv[:6].view(2, 3)) and torch.equal(tc, tv[6:])


def test_global_norm_reverse_mode_transforms_match_vector_norm():
    tree = {"a": torch.randn(3, 4, dtype=D), "b": torch.randn(5, dtype=D)}
    ref = lambda t, p: torch.cat([t["a"].flatten(), t["b"].flatten()]).norm(p)
    for p in (2.0, 1.0, 3.0, float("inf")):
        got, want = grad(lambda t: ts.global_norm(t, p))(tree), grad(lambda t: ref(t, p))(tree)
        assert close_seq(got.values(), want.values()), p
    a = tree["a"]
    assert torch.allclose(jacrev(lambda u: ts.global_norm([u]))(a), jacrev(lambda u: u.norm())(a))
    assert torch.allclose(hessian(lambda u: ts.global_norm({"a": u, "b": tree["b"]}))(a),
                          hessian(lambda u: ref({"a": u, "b": tree["b"]}, 2.0))(a))
    A = torch.randn(3, 4, dtype=D)
    assert torch.allclose(vmap(grad(lambda u: ts.global_norm([u])))(A), A / A.norm(dim=1, keepdim=True))


# Forward mode and vmap: every backend hands such inputs to the differentiable reference (the
# compiled op once gave a zero tangent under jvp and None for a dual; vmap raised).
NORMS = [2.0, 1.0, 3.0, float("inf")]


def _cat_norm(parts, p):
    return torch.cat([t.flatten() for t in parts]).norm(p)


@pytest.mark.parametrize("p", NORMS)
@pytest.mark.parametrize("dtype", [torch.float32, D])
def test_global_norm_forward_mode_tangent(backend, p, dtype):
    a = torch.tensor([3.0, -4.0, 1.0], dtype=dtype)
    b = torch.tensor([[0.5, 2.0]], dtype=dtype)
    ta, tb = torch.tensor([1.0, 0.5, -2.0], dtype=dtype), torch.tensor([[3.0, -1.0]], dtype=dtype)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else {}
    _, want = jvp(lambda u, w: _cat_norm([u, w], p), (a, b), (ta, tb))
    _, got = jvp(lambda u, w: ts.global_norm({"a": u, "b": w}, p), (a, b), (ta, tb))
    assert torch.allclose(got, want, **tol), (got, want)
    assert not torch.equal(want, torch.zeros_like(want))  # a zero tangent cannot pass
    with fwAD.dual_level():
        out = ts.global_norm([fwAD.make_dual(a, ta), fwAD.make_dual(b, tb)], p)
        tangent = fwAD.unpack_dual(out).tangent
        assert tangent is not None and torch.allclose(tangent, want, **tol)
    _, alone = jvp(lambda u: _cat_norm([b, u], p), (a,), (ta,))
    with fwAD.dual_level():  # a dual among plain tensors, under no_grad (forward mode ignores it)
        with torch.no_grad():
            out = ts.global_norm([b, fwAD.make_dual(a, ta)], p)
        assert torch.allclose(fwAD.unpack_dual(out).tangent, alone, **tol)
    full = jacfwd(lambda u: ts.global_norm([u, b], p))(a)
    assert torch.allclose(full, jacrev(lambda u: _cat_norm([u, b], p))(a), **tol)


@pytest.mark.parametrize("p", NORMS)
def test_global_norm_under_vmap(backend, p):
    A = torch.randn(6, 3, 4, dtype=D)
    B = torch.randn(6, 5, dtype=D)
    got = vmap(lambda u, w: ts.global_norm({"a": u, "b": w}, p))(A, B)
    assert torch.allclose(got, torch.cat([A.flatten(1), B], 1).norm(p, dim=1))
    per_sample = vmap(grad(lambda u: ts.global_norm([u], p)))(A)
    assert torch.allclose(per_sample, vmap(grad(lambda u: u.norm(p)))(A))


def test_global_norm_plain_inputs_still_take_the_kernels(backend):
    """Outside every transform and dual level, the kernels still run (nothing routed away)."""
    from torchstruct import _ops

    xs = [torch.randn(5), torch.randn(3, 2)]
    with fwAD.dual_level():  # a level without a dual among the inputs changes nothing
        assert not _ops._needs_autograd(xs)
    assert not _ops._needs_autograd(xs)
    assert torch.allclose(ts.global_norm(xs), _cat_norm(xs, 2.0))


# Two duals of one primal (or a dual and its primal) are not tied: they may carry different
# tangents (a tie once kept only the first leaf's).
def test_flatten_does_not_tie_duals_with_different_tangents():
    w = torch.randn(2, 3, dtype=D)
    with fwAD.dual_level():
        d1 = fwAD.make_dual(w, torch.ones_like(w))
        d2 = fwAD.make_dual(w, 2 * torch.ones_like(w))
        vec, spec = T.flatten({"a": d1, "b": d2})
        tangent = fwAD.unpack_dual(vec).tangent
    assert vec.numel() == 12
    assert torch.equal(tangent, torch.cat([torch.ones(6, dtype=D), 2 * torch.ones(6, dtype=D)]))


# ============================================================================ 5. within_gradient + wrt
class Noisy(nn.Module):
    """The documented pattern: a layer that behaves differently while it is differentiated
    (``ts.within_gradient(self)``: any of its parameters)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3, dtype=D))

    def forward(self, x):
        y = self.w * x
        return y * 2.0 if ts.within_gradient(self) else y


class NoisyInput(nn.Module):
    """docs/stop_gradient.md's own example: switch on ``ts.within_gradient(x)``."""

    def forward(self, x):
        return x * torch.tensor([1.0, 0.0, 1.0], dtype=x.dtype) * 1.5 if ts.within_gradient(x) else x


# A layer that branches on ts.within_gradient sees the forward as it is: with a callable loss
# and wrt, only the asked parameters require grad (docs/structural.md), so a layer upstream of
# every asked parameter takes its not-differentiated branch, exactly as with the other
# parameters frozen by hand; the tensor form and create_graph=True keep loss(model)'s branch.
LAYOUTS = ["within_gradient(self) before the head", "within_gradient(x) between body and head"]


def _noisy_model(layout):
    torch.manual_seed(0)
    if layout.startswith("within_gradient(self)"):
        return nn.Sequential(Noisy(), nn.Linear(3, 1).to(D)), "1"
    return nn.Sequential(nn.Linear(3, 3).to(D), NoisyInput(), nn.Linear(3, 1).to(D)), "2"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_wrt_callable_runs_the_forward_of_the_asked_parameters_alone(layout):
    m, head = _noisy_model(layout)
    x = torch.randn(4, 3, dtype=D)
    fn = lambda mm: mm(x).pow(2).sum()
    asked = list(getattr(m, head).parameters())
    by_hand = copy.deepcopy(m)  # every parameter but the asked ones frozen by hand
    for name, p in by_hand.named_parameters():
        p.requires_grad_(name.startswith(head + "."))
    want_value = fn(by_hand)
    want_grad = torch.autograd.grad(want_value, [p for n, p in by_hand.named_parameters()
                                                 if n.startswith(head + ".")])
    assert not torch.allclose(want_value, fn(m))  # the branch differs: the test can tell
    value, g = ts.value_and_grad(fn, m, wrt=head)
    assert torch.equal(value, want_value.detach()) and close_seq(T.leaves(g), want_grad)
    assert close_seq(T.leaves(ts.structural_grad(m, fn, wrt=head)), want_grad)
    assert all(p.requires_grad for p in m.parameters())
    # the tensor form differentiates loss(model) as it was computed
    loss = fn(m)
    assert close_seq(T.leaves(ts.structural_grad(m, loss, wrt=head)),
                     torch.autograd.grad(fn(m), asked))


def test_wrt_with_create_graph_keeps_the_within_gradient_branch():
    """With create_graph=True the other flags stay on (documented), so the value is that of
    loss(model): the contrast to the test above."""
    torch.manual_seed(0)
    m = nn.Sequential(Noisy(), nn.Linear(3, 1).to(D))
    x = torch.randn(4, 3, dtype=D)
    fn = lambda mm: mm(x).pow(2).sum()
    want_grad = torch.autograd.grad(fn(m), list(m[1].parameters()))
    assert close_seq(T.leaves(ts.structural_grad(m, fn, wrt="1", create_graph=True)), want_grad)


# ============================================================================ 6. MAML as one callable
def maml_objective(mm):
    inner = ts.structural_grad(mm, mse, create_graph=True)
    fast = ts.map_trainable(lambda p, g: p - ALPHA * g, mm, inner)
    with ts.swap(mm, fast):
        return F.mse_loss(mm(XQ), YQ)


@pytest.mark.parametrize("wrt", [None, "2", "0.weight"])
def test_maml_objective_as_one_loss_callable_with_swap(wrt):
    """The whole MAML objective (inner structural_grad, fast weights by map_trainable, outer
    loss under ts.swap) handed to structural_grad as a callable, with and without wrt."""
    m = mlp()
    want = maml_reference(m)
    g = T.to_flat_dict(ts.structural_grad(m, maml_objective, wrt=wrt))
    names = [n for n in want if wrt is None or n.startswith(wrt)]
    assert list(g) == names
    assert close_seq(g.values(), [want[n] for n in names])
    assert flags(m) == [True] * 4
    (value, _), g2 = ts.value_and_grad(lambda mm: (maml_objective(mm), None), m, has_aux=True,
                                      wrt=wrt)
    assert close_seq(T.leaves(g2), [want[n] for n in names])
