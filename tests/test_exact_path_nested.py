"""structural_grad's exact path (reentrant checkpoints) with a checkpoint nested in another:
judged when the outer one recomputes it in backward. A leaf input the call switched off is
switched back on for it (the numbers stay those of ``.backward()``); a nested checkpoint that
still records nothing where an asked parameter is used is a ValueError, also with a tensor
loss; afterwards every flag, ``.grad`` and torch's ``CheckpointFunction.apply`` are as before.
"""
import copy
import threading

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointFunction, checkpoint

import torchstruct as ts
from torchstruct.select import index

S = 7.0  # a sentinel .grad

pytestmark = pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True")


def ck(fn, *args):
    return checkpoint(fn, *args, use_reentrant=True)


class Nested(nn.Module):
    """``out(outer(h))`` where the outer checkpoint's function runs ``a`` in a nested
    checkpoint fed ``feed(self, e)`` (``e`` a tensor outside the model, or None)."""

    def __init__(self, feed, e=None):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(4))
        self.inp, self.a, self.out = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)
        self.feed, self.e = feed, e

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        z = ck(lambda u: u + ck(self.a, self.feed(self, self.e)), h)
        if self.e is not None:
            z = z * self.e  # the graph shows e: it is switched off before the backward
        return self.out(z).sum()


def outside():
    torch.manual_seed(1)
    e = torch.randn(4, requires_grad=True)
    e.grad = torch.full_like(e, S)
    return e


def reference(model, x, e=None):
    """{path: .grad} by .backward() on copies (e copied too)."""
    memo = {} if e is None else {id(e): e.detach().clone().requires_grad_()}
    ref = copy.deepcopy(model, memo)
    ref(x).backward()
    return {path: p.grad for path, p in index(ref)}


def sentinels(model):
    for p in model.parameters():
        p.grad = torch.full_like(p, S)
    return {p: p.grad for p in model.parameters()}


def assert_as_before(model, grads, flags, e=None):
    assert [p.requires_grad for p in model.parameters()] == flags
    for p, g in grads.items():
        assert p.grad is g and bool((g == S).all())
    if e is not None:
        assert e.requires_grad and bool((e.grad == S).all())
    assert "apply" not in CheckpointFunction.__dict__  # torch's own apply again


X = torch.randn(3, 4, requires_grad=True)  # the outer checkpoint records, whatever is asked


@pytest.mark.parametrize("loss_kind", ["callable", "tensor"])
def test_outside_leaf_fed_to_a_nested_checkpoint(loss_kind):
    e = outside()
    m = Nested(lambda self, e: e, e)
    ref = reference(m, X, e)
    grads, flags = sentinels(m), [p.requires_grad for p in m.parameters()]
    loss = (lambda mm: mm(X)) if loss_kind == "callable" else m(X)
    got = ts.tree.to_flat_dict(ts.structural_grad(m, loss, wrt=["a", "out"]))
    assert set(got) == {"a.weight", "a.bias", "out.weight", "out.bias"}
    assert ref["a.weight"].abs().sum() > 0
    for k, g in got.items():
        assert torch.equal(g, ref[k]), k
    assert_as_before(m, grads, flags, e)


def test_tensor_loss_parameter_not_asked_fed_to_a_nested_checkpoint():
    m = Nested(lambda self, e: self.w)
    ref = reference(m, X)
    loss = m(X)
    grads, flags = sentinels(m), [p.requires_grad for p in m.parameters()]
    got = ts.structural_grad(m, loss, wrt="a")
    assert torch.equal(got["a"]["weight"], ref["a.weight"])
    assert torch.equal(got["a"]["bias"], ref["a.bias"])
    assert_as_before(m, grads, flags)


def test_callable_with_wrt_parameter_not_asked_fed_to_a_nested_checkpoint_is_refused():
    """With wrt= and a callable, only the asked parameters require grad in the forward: the
    nested checkpoint fed w records nothing, as it would at top level (refused there too)."""
    m = Nested(lambda self, e: self.w)
    grads, flags = sentinels(m), [p.requires_grad for p in m.parameters()]
    with pytest.raises(ValueError, match=r"'a\.weight'.*nested in another one"):
        ts.structural_grad(m, lambda mm: mm(X), wrt="a")
    assert_as_before(m, grads, flags)
    got = ts.structural_grad(m, lambda mm: mm(X))  # all trainable: w requires grad, fine
    assert torch.equal(got["a"]["weight"], reference(m, X)["a.weight"])


@pytest.mark.parametrize("loss_kind", ["callable", "tensor"])
def test_input_computed_from_a_switched_off_leaf_is_refused(loss_kind):
    """``ck(a, e * 2)`` inside the outer function: e was switched off, so e * 2 does not
    require grad and cannot be switched back on: a clear error, nothing changed."""
    e = outside()
    m = Nested(lambda self, e: e * 2, e)
    grads, flags = sentinels(m), [p.requires_grad for p in m.parameters()]
    loss = (lambda mm: mm(X)) if loss_kind == "callable" else m(X)
    with pytest.raises(ValueError, match=r"'a\.weight'.*none of whose inputs requires grad"):
        ts.structural_grad(m, loss, wrt=["a", "out"])
    assert_as_before(m, grads, flags, e)


@pytest.mark.parametrize("loss_kind", ["callable", "tensor"])
def test_nested_checkpoint_on_a_constant_is_refused(loss_kind):
    m = Nested(lambda self, e: torch.ones(3, 4))
    grads, flags = sentinels(m), [p.requires_grad for p in m.parameters()]
    loss = (lambda mm: mm(X)) if loss_kind == "callable" else m(X)
    with pytest.raises(ValueError, match=r"'a\.weight'"):
        ts.structural_grad(m, loss)
    assert_as_before(m, grads, flags)


def test_nested_checkpoint_on_a_constant_not_using_an_asked_parameter_is_fine():
    m = Nested(lambda self, e: torch.ones(3, 4))
    ref = reference(m, X)
    got = ts.structural_grad(m, lambda mm: mm(X), wrt="out")
    assert torch.equal(got["out"]["weight"], ref["out.weight"])


def test_hooked_revived_leaf_is_refused():
    """A tensor hook on the revived leaf would run in the real backward: refused, as any
    tensor hook on a leaf not asked."""
    e = outside()
    calls = []
    e.register_hook(lambda g: calls.append(1))
    m = Nested(lambda self, e: e, e)
    grads, flags = sentinels(m), [p.requires_grad for p in m.parameters()]
    with pytest.raises(RuntimeError, match="gradient hook"):
        ts.structural_grad(m, lambda mm: mm(X), wrt="a")
    assert not calls
    assert_as_before(m, grads, flags, e)


def test_two_levels_of_nesting():
    """outer(u) -> middle(u, e) -> inner(e): each level revived in its own recomputation."""
    e = outside()

    class Deep(nn.Module):
        def __init__(self, e):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b, self.out = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)
            self.e = e

        def forward(self, x):
            def middle(v, t):
                return self.b(v) + ck(self.a, t)

            z = ck(lambda u: ck(middle, u, self.e), x.requires_grad_()) * self.e
            return self.out(z).sum()

    m = Deep(e)
    x = torch.randn(3, 4)
    ref = reference(m, x.clone(), e)
    got = ts.tree.to_flat_dict(ts.structural_grad(m, lambda mm: mm(x.clone()), wrt=["a", "b"]))
    for k, g in got.items():
        assert torch.equal(g, ref[k]), k
    assert e.requires_grad and bool((e.grad == S).all())
    assert "apply" not in CheckpointFunction.__dict__


def test_threads():
    """Two threads, each its own model and outside tensor: both exact."""
    results, errors = {}, []

    def run(i):
        try:
            e, x = outside(), X.detach().clone().requires_grad_()  # shared: see the docs
            m = Nested(lambda self, e: e, e)
            ref = reference(m, x, e)
            for _ in range(20):
                got = ts.structural_grad(m, lambda mm: mm(x), wrt="a")
                assert torch.equal(got["a"]["weight"], ref["a.weight"])
            results[i] = bool((e.grad == S).all()) and e.requires_grad
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results == {0: True, 1: True}
    assert "apply" not in CheckpointFunction.__dict__


def test_plain_nested_checkpoints_afterwards_are_torch_s_own():
    """Outside the call, a reentrant checkpoint on inputs not requiring grad behaves as in
    torch: it records nothing (no node), with torch's warning."""
    m = Nested(lambda self, e: e, outside())
    ts.structural_grad(m, lambda mm: mm(X), wrt="a")
    lin = nn.Linear(4, 4)
    with pytest.warns(UserWarning, match="None of the inputs"):
        y = ck(lin, torch.ones(2, 4))
    assert y.grad_fn is None


def test_tensor_loss_parameter_not_asked_fed_to_the_outer_checkpoint():
    """w feeds the outer checkpoint directly and, through its detached copy, a nested one
    alone: it requires grad for the backward (as in the forward), so the nested one records."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.w = nn.Parameter(torch.randn(4))
            self.a, self.out = nn.Linear(4, 4), nn.Linear(4, 1)

        def forward(self, x):
            return self.out(ck(lambda u, w: u + ck(self.a, w), x, self.w)).sum()

    m, x = M(), torch.randn(3, 4, requires_grad=True)
    ref = reference(m, x)
    loss = m(x)
    grads, flags = sentinels(m), [p.requires_grad for p in m.parameters()]
    got = ts.structural_grad(m, loss, wrt="a")
    assert ref["a.weight"].abs().sum() > 0
    assert torch.equal(got["a"]["weight"], ref["a.weight"])
    assert_as_before(m, grads, flags)


@pytest.mark.parametrize("retain", [False, True])
def test_refusal_during_the_backward_and_the_tensor_loss_graph(retain):
    """Refused while the backward runs: everything put back; the graph the backward went
    through is freed as after any failed backward, unless retain_graph=True."""
    m = Nested(lambda self, e: torch.ones(3, 4))
    loss = m(X)
    grads, flags = sentinels(m), [p.requires_grad for p in m.parameters()]
    with pytest.raises(ValueError, match=r"'a\.weight'"):
        ts.structural_grad(m, loss, retain_graph=retain)
    assert_as_before(m, grads, flags)
    got = ts.structural_grad(m, loss, wrt="out", retain_graph=True) if retain else None
    if retain:
        assert torch.equal(got["out"]["weight"], reference(m, X)["out.weight"])
    else:
        with pytest.raises(RuntimeError, match="second time"):
            ts.structural_grad(m, loss, wrt="out")


def test_the_outer_function_s_own_input_fed_to_a_nested_checkpoint_is_not_kept():
    """``ck(lambda u: ck(f, u), h)``, twice in a row: u is the outer checkpoint's detached
    input, a temporary; the call does not keep it alive once that checkpoint's backward is
    done (seen from the next recomputation: the earlier one's input is gone)."""
    import weakref

    seen, alive_then = [], []

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.out = nn.Linear(4, 4), nn.Linear(4, 1)

        def forward(self, x):
            def outer(u):
                if torch.is_grad_enabled():
                    alive_then.append(sum(r() is not None for r in seen))
                    seen.append(weakref.ref(u))
                return ck(self.a, u)

            return self.out(ck(outer, ck(outer, x))).sum()

    m, x = M(), torch.randn(3, 4, requires_grad=True)
    ref = reference(m, x)
    got = ts.structural_grad(m, lambda mm: mm(x), wrt="a")
    assert torch.equal(got["a"]["weight"], ref["a.weight"])
    assert alive_then == [0, 0, 0, 0]  # reference backward, then the call's


def test_under_no_grad_a_callable_loss_is_refused_for_the_no_grad():
    """A callable loss under torch.no_grad(): every checkpoint records nothing; the error says
    no_grad, not the checkpoint."""
    m = Nested(lambda self, e: self.w)
    with torch.no_grad(), pytest.raises(ValueError, match=r"torch\.no_grad\(\)"):
        ts.structural_grad(m, lambda mm: mm(X))
