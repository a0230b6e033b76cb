"""structural_grad through reentrant activation checkpointing touches nothing but its answer.

Its exact path runs a real backward (the checkpoint refuses ``torch.autograd.grad``). These
tests hold it to what ``autograd.grad`` would do: no ``.grad`` written outside the asked
parameters, also into a tensor that only the checkpoint's recomputation reaches (a tensor the
checkpointed function closes over, another model's parameter, one fed to a nested
checkpoint); no hook run that ``autograd.grad`` would not run (a hook on a gradient accumulator
node, a tensor hook on a leaf not asked, a post-accumulate-grad hook, a hook or retain_grad()
on a non-leaf tensor off the asked paths, a module's full backward hook there), refused with flags,
``.grad`` fields and the graph as they were. Compared with ``.backward()`` on deep copies.
"""
import copy
import warnings

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

import torchstruct as ts
import torchstruct._ops as ops

SENTINEL = 7.0


def ck(fn, *args):
    return checkpoint(fn, *args, use_reentrant=True)


class Outside(nn.Module):
    """A checkpointed middle whose function reaches tensors outside the model: ``how`` says
    which (``closure``: a tensor it closes over; ``teacher``: another model called inside;
    ``bound``: the same, closed over; ``nested``: a tensor fed to a checkpoint nested in it; ``after``: a tensor used after the
    checkpoint, visible in the graph; ``fed``: the input itself, a leaf)."""

    def __init__(self, how, extra, teacher):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.mid, self.out = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)
        self.how, self.extra, self.teacher = how, [extra], [teacher]

    def forward(self, x):
        extra, teacher = self.extra[0], self.teacher[0]
        h = x if self.how == "fed" else torch.tanh(self.inp(x))
        if self.how == "closure":
            z = ck(lambda u: self.mid(u) * extra, h)
        elif self.how == "teacher":  # reached through self: out of sight until recomputed
            z = ck(lambda u: self.teacher[0](self.mid(u)), h)
        elif self.how == "bound":  # a module the function closes over: switched off up front
            z = ck(lambda u: teacher(self.mid(u)), h)
        elif self.how == "nested":
            z = ck(lambda u: ck(lambda v, e: self.mid(v) * e, u, extra), h)
        elif self.how == "after":
            z = ck(self.mid, h) * extra
        else:
            z = ck(self.mid, h)
        return self.out(torch.tanh(z)).sum()


HOWS = ["closure", "teacher", "bound", "nested", "after", "fed"]


def build(how):
    extra = torch.randn(4, requires_grad=True)
    teacher = nn.Linear(4, 4)
    x = torch.randn(3, 4)
    if how == "fed":
        x.requires_grad_()
    m = Outside(how, extra, teacher)
    outside = [extra, *teacher.parameters()] + ([x] if how == "fed" else [])
    for t in outside:
        t.grad = torch.full_like(t, SENTINEL)
    return m, x, outside


def reference(m, x, asked):
    """{path: .grad} of the asked parameters by .backward() on copies of everything."""
    ref = copy.deepcopy(m)
    ts.detach_hooks(ref)
    ref.extra = [m.extra[0].detach().clone().requires_grad_()]
    ref.teacher = [copy.deepcopy(m.teacher[0])]
    xr = x.detach().clone().requires_grad_(x.requires_grad)
    ref(xr).backward()
    return {k: p.grad for k, p in ref.named_parameters() if any(k.startswith(a) for a in asked)}


def untouched(m, outside):
    """The model's .grad fields empty and flags on; every outside tensor still requiring grad
    with its sentinel .grad."""
    assert all(p.grad is None and p.requires_grad for p in m.parameters())
    for t in outside:
        assert t.requires_grad
        assert torch.equal(t.grad, torch.full_like(t, SENTINEL))


@pytest.mark.parametrize("wrt", [["inp"], ["mid"], ["out"], ["inp", "mid", "out"]])
@pytest.mark.parametrize("how", HOWS)
def test_gradients_equal_backward_and_outside_tensors_keep_their_grad(how, wrt):
    m, x, outside = build(how)
    if how == "fed" and "inp" in wrt:
        pytest.skip("the fed form does not use inp")
    if how != "fed" and wrt == ["mid"]:
        wrt = ["mid", "inp"]  # the checkpoint's input must require grad (else: ValueError)
    got = ts.tree.to_flat_dict(ts.structural_grad(m, lambda mm: mm(x), wrt=wrt))
    want = reference(m, x, wrt)
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
    untouched(m, outside)


@pytest.mark.parametrize("how", HOWS)
def test_a_tensor_loss_with_retain_graph_leaves_the_graph_as_backward_needs_it(how):
    """The checkpoint functions wrapped for the exact path are put back: a later .backward()
    of the retained graph accumulates into the outside tensors as plain PyTorch does."""
    m, x, outside = build(how)
    loss = m(x)
    ts.structural_grad(m, loss, wrt="out", retain_graph=True)
    untouched(m, outside)
    for t in outside:
        t.grad = None
    loss.backward()
    ref_m, ref_x, ref_outside = build(how)
    for t in ref_outside:
        t.grad = None
    ref_m(ref_x).backward()
    assert any(r.grad is not None for r in ref_outside)
    for t, r in zip(outside, ref_outside):
        torch.testing.assert_close(t.grad, r.grad, rtol=0, atol=0)


def _accumulator(t):
    return t.view_as(t).grad_fn.next_functions[0][0]


def _hook(kind, t, calls, keep):
    """Register a hook of ``kind`` on ``t``; ``keep`` holds what must stay alive."""
    if kind == "tensor":
        t.register_hook(lambda g: calls.append(kind))
    elif kind == "post-accumulate":
        t.register_post_accumulate_grad_hook(lambda p: calls.append(kind))
    else:
        acc = _accumulator(t)
        keep.append(acc)  # the accumulator lives as long as someone holds it
        register = acc.register_hook if kind == "node" else acc.register_prehook
        register(lambda *a: calls.append(kind))


KINDS = ["node", "node-pre", "tensor", "post-accumulate"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("how", HOWS)
def test_a_hook_on_an_outside_tensor_is_refused_and_changes_nothing(how, kind):
    m, x, outside = build(how)
    calls, keep = [], []
    teacher = how in ("teacher", "bound")
    hooked = m.teacher[0].weight if teacher else (x if how == "fed" else m.extra[0])
    _hook(kind, hooked, calls, keep)
    flags = [t.requires_grad for t in outside]
    wrt = ["inp", "out"] if how != "fed" else "out"
    if how == "bound":
        # its parameters stop requiring grad before the backward (the function is seen to be
        # bound to it), also while a flag context elsewhere makes recomputations restore the
        # forward's flags: the recomputation records nothing for them, no hook runs
        got = ts.structural_grad(m, lambda mm: mm(x), wrt=wrt)
        assert sorted(got) == ["inp", "out"]
    else:
        with pytest.raises(RuntimeError, match="outside the model has a .*hook"):
            ts.structural_grad(m, lambda mm: mm(x), wrt=wrt)
    assert calls == []
    untouched(m, outside)
    assert [t.requires_grad for t in outside] == flags
    m(x).backward()  # plain PyTorch afterwards: the graph and its functions as they were
    assert calls, "the hook was expected to run in a plain backward"


@pytest.mark.parametrize("kind", ["node", "node-pre", "post-accumulate"])
def test_a_hook_on_an_asked_parameter_s_accumulator_is_refused(kind):
    m, x, outside = build("closure")
    calls, keep = [], []
    _hook(kind, m.inp.weight, calls, keep)
    with pytest.raises(RuntimeError, match="'inp.weight' has a .*hook"):
        ts.structural_grad(m, lambda mm: mm(x), wrt=["inp", "out"])
    assert calls == []
    untouched(m, outside)


def test_a_tensor_hook_on_an_asked_parameter_runs_as_autograd_grad_runs_it():
    """autograd.grad calls the tensor hooks of its inputs: the exact path does so once too,
    and the gradient is the hook's."""
    m, x, outside = build("closure")
    calls = []
    m.inp.weight.register_hook(lambda g: calls.append(1) or g * 2)
    got = ts.structural_grad(m, lambda mm: mm(x), wrt="inp")
    assert calls == [1]
    want = reference(m, x, ["inp"])
    torch.testing.assert_close(got["inp"]["weight"], want["inp.weight"] * 2, rtol=0, atol=0)
    untouched(m, outside)


def test_a_tensor_hook_on_a_parameter_not_asked_is_refused_with_a_tensor_loss():
    """A tensor loss was recorded with every trainable parameter: the real backward would run
    the hook of one not asked, which autograd.grad would not."""
    m, x, outside = build("closure")
    calls = []
    m.inp.weight.register_hook(lambda g: calls.append(1))
    loss = m(x)
    with pytest.raises(RuntimeError, match="'inp.weight' has a gradient hook"):
        ts.structural_grad(m, loss, wrt="out")
    assert calls == []
    untouched(m, outside)


def test_a_removed_hook_is_no_reason_to_refuse():
    m, x, outside = build("closure")
    acc = _accumulator(m.extra[0])
    handles = [acc.register_hook(lambda *a: None), acc.register_prehook(lambda *a: None)]
    for h in handles:
        h.remove()
    assert ops.accumulator_hooks(m.extra[0]) == (0, 0)
    got = ts.structural_grad(m, lambda mm: mm(x), wrt=["inp", "out"])
    assert sorted(got) == ["inp", "out"]
    untouched(m, outside)


def test_accumulator_hooks_counts_what_is_registered():
    t = torch.randn(3, requires_grad=True)
    assert ops.accumulator_hooks(t) == (0, 0)
    acc = _accumulator(t)
    assert ops.accumulator_hooks(t) == (0, 0)
    a = acc.register_hook(lambda *g: None)
    acc.register_prehook(lambda *g: None)
    acc.register_prehook(lambda *g: None)
    assert ops.accumulator_hooks(t) == (3, 0)
    a.remove()
    assert ops.accumulator_hooks(t) == (2, 0)
    t.register_hook(lambda g: g)  # a tensor hook is not the node's
    assert ops.accumulator_hooks(t) == (2, 0)
    assert ops.accumulator_hooks(t * 2) == (0, 0)  # no accumulator: not a leaf
    with pytest.raises(TypeError):
        ops.accumulator_hooks(3)


def test_ddp_reducer_hooks_are_allowed_a_python_one_is_not(group):
    m, x, outside = build("closure")
    ddp = DDP(m)
    assert ops.accumulator_hooks(m.inp.weight) == (0, 1)  # the reducer's, in C++
    got = ts.structural_grad(ddp, lambda d: d(x), wrt=["module.inp", "module.out"])
    want = reference(m, x, ["inp", "out"])
    assert sorted(ts.tree.to_flat_dict(got)) == sorted("module." + k for k in want)
    for k, g in want.items():
        torch.testing.assert_close(ts.tree.to_flat_dict(got)["module." + k], g, rtol=0, atol=0)
    untouched(m, outside)
    calls, keep = [], []
    _hook("node", m.out.bias, calls, keep)
    with pytest.raises(RuntimeError, match="'module.out.bias' has a hook on its gradient acc"):
        ts.structural_grad(ddp, lambda d: d(x), wrt=["module.inp", "module.out"])
    assert calls == []
    untouched(m, outside)


def test_without_the_compiled_extension_the_exact_path_warns(monkeypatch):
    m, x, outside = build("closure")
    monkeypatch.setattr(ops, "_C", None)
    assert ops.accumulator_hooks(m.extra[0]) is None
    with pytest.warns(RuntimeWarning, match="hooks on gradient accumulator nodes, and those on branches"):
        got = ts.structural_grad(m, lambda mm: mm(x), wrt=["inp", "out"])
    assert sorted(got) == ["inp", "out"]
    untouched(m, outside)
    with warnings.catch_warnings():  # no reentrant checkpoint: autograd.grad, nothing to say
        warnings.simplefilter("error")
        plain = nn.Linear(2, 1)
        ts.structural_grad(plain, lambda mm: mm(torch.randn(3, 2)).sum())


def test_a_hook_on_a_non_leaf_of_a_branch_to_no_asked_parameter_is_refused():
    """A non-leaf tensor's hook on a branch that leads to no asked parameter: the real backward
    would run it, autograd.grad would not. Refused before anything runs (read by the compiled
    extension); a hook on a branch to an asked parameter runs, as under autograd.grad."""
    m, x, outside = build("closure")
    extra = m.extra[0]
    calls = []

    def loss(mm):
        e2 = extra * 2
        e2.register_hook(lambda g: calls.append(1))
        return mm(x) + e2.sum()

    with pytest.raises(RuntimeError, match="MulBackward0 has a gradient hook.*no asked"):
        ts.structural_grad(m, loss, wrt=["inp", "out"])
    assert calls == []
    untouched(m, outside)

    def hooked_on_the_asked_path(mm):
        y = mm(x)
        y.register_hook(lambda g: calls.append(2))
        return y

    got = ts.structural_grad(m, hooked_on_the_asked_path, wrt=["inp", "out"])
    assert calls == [2]
    want = reference(m, x, ["inp", "out"])
    for k, g in ts.tree.to_flat_dict(got).items():
        torch.testing.assert_close(g, want[k], rtol=0, atol=0)
    untouched(m, outside)


# ------------------------------------------------------------------ hooks off the asked paths
class Hooked(nn.Module):
    """inp -> checkpoint(mid) -> out, a hook of kind ``how`` placed where ``where`` says:
    ``before`` (on inp's output, a branch leading only to inp's parameters and the input) or
    ``inside`` (in the checkpointed function, on ``side`` applied to a tensor outside the
    model: a branch leading only to ``side``'s parameters and that tensor)."""

    def __init__(self, how, where):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.mid, self.side, self.out = (nn.Linear(4, 4), nn.Linear(4, 4),
                                                   nn.Linear(4, 4), nn.Linear(4, 1))
        self.how, self.where, self.calls = how, where, []
        self.e = [torch.randn(4, requires_grad=True)]
        if how == "module":  # a full backward hook on the hooked module
            target = self.inp if where == "before" else self.side
            target.register_full_backward_hook(lambda *a: self.calls.append("module"))

    def hook(self, t):
        if self.how == "tensor":
            t.register_hook(lambda g: self.calls.append("tensor"))
        elif self.how == "retain":
            t.retain_grad()
            self.calls.append(t)  # the tensor, to look at its .grad afterwards
        elif self.how == "node":
            t.grad_fn.register_hook(lambda *a: self.calls.append("node"))
        elif self.how == "prehook":
            t.grad_fn.register_prehook(lambda *a: self.calls.append("prehook"))
        return t

    def forward(self, x):
        h = self.inp(x)
        if self.where == "before":
            h = self.hook(h)

        def fn(u):
            if self.where != "inside":
                return self.mid(u)
            s = self.side(self.e[0])
            if torch.is_grad_enabled():  # the recomputation (the forward runs under no_grad)
                s = self.hook(s)
            return self.mid(u) + s

        return self.out(torch.tanh(ck(fn, h))).sum()


HOOKS = ["tensor", "retain", "node", "prehook", "module"]


def ran(m):
    """What ran: hook calls, or a retained tensor whose .grad was written."""
    return [c for c in m.calls if isinstance(c, str) or c.grad is not None]


@pytest.mark.filterwarnings("ignore:Full backward hook")
@pytest.mark.parametrize("how", HOOKS)
@pytest.mark.parametrize("where", ["before", "inside"])
def test_a_hook_off_the_asked_paths_is_refused_and_nothing_runs(how, where):
    m, x = Hooked(how, where), torch.randn(3, 4, requires_grad=True)
    x.grad = torch.full_like(x, SENTINEL)
    wrt = ["mid", "out"]
    flags = [p.requires_grad for p in m.parameters()]
    kind = "retain_grad" if how == "retain" else "a gradient hook"
    with pytest.raises(RuntimeError, match=f"has {kind}.*leads to no asked parameter"):
        ts.structural_grad(m, lambda mm: mm(x), wrt=wrt)
    assert ran(m) == []
    assert [p.requires_grad for p in m.parameters()] == flags
    assert all(p.grad is None for p in m.parameters())
    assert x.requires_grad and torch.equal(x.grad, torch.full_like(x, SENTINEL))


@pytest.mark.filterwarnings("ignore:Full backward hook")
@pytest.mark.parametrize("how", HOOKS)
@pytest.mark.parametrize("where", ["before", "inside"])
def test_a_hook_on_an_asked_path_runs_as_under_autograd_grad(how, where):
    """The same hooks with their branch asked (and the input not requiring grad: a module's
    backward hook on it would otherwise wait for the input's gradient, which autograd.grad
    does not compute): they run, and the answer is .backward()'s."""
    m, x = Hooked(how, where), torch.randn(3, 4)
    m.e[0].requires_grad_(False)
    wrt = ["inp", "mid", "out"] + (["side"] if where == "inside" else [])
    got = ts.tree.to_flat_dict(ts.structural_grad(m, lambda mm: mm(x), wrt=wrt))
    assert ran(m)
    m.calls.clear()
    ref = copy.deepcopy(m)
    ts.detach_hooks(ref)
    ref(x).backward()
    for k in got:
        assert torch.equal(got[k], ref.get_parameter(k).grad), k


def test_a_removed_hook_is_not_refused():
    """A hook whose handle was removed leaves an empty holder on the node: nothing runs."""
    m, x = Hooked("none", "before"), torch.randn(3, 4, requires_grad=True)

    def loss(mm):
        h = mm.inp(x)
        h.register_hook(lambda g: g).remove()
        h.grad_fn.register_prehook(lambda g: g).remove()
        return mm.out(ck(mm.mid, h)).sum()

    got = ts.structural_grad(m, loss, wrt="out")
    assert set(ts.tree.to_flat_dict(got)) == {"out.weight", "out.bias"}


@pytest.mark.filterwarnings("ignore:Full backward hook")
def test_a_module_backward_hook_waiting_for_an_input_gradient_not_asked_is_refused():
    """A module's full backward hook whose input requires grad: its input-side node leads to
    the input only, which autograd.grad (asked for parameters) does not differentiate; the
    real backward would run it: refused, also with the module's own parameters asked."""
    m, x = Hooked("module", "before"), torch.randn(3, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="BackwardHookFunctionBackward has a gradient hook"):
        ts.structural_grad(m, lambda mm: mm(x), wrt=["inp", "mid", "out"])
    assert ran(m) == []
    got = ts.structural_grad(m, lambda mm: mm(x.detach()), wrt=["inp", "mid", "out"])
    assert ran(m) == ["module"] and set(ts.tree.to_flat_dict(got)) >= {"inp.weight"}


def test_an_asked_parameter_s_hook_sees_each_part_as_under_backward():
    """Used inside a checkpoint and outside it: the hook runs once per part (as under
    .backward()), the parts summing to the gradient autograd.grad hands its hook once."""
    torch.manual_seed(0)
    m, x = nn.Linear(4, 4), torch.randn(3, 4, requires_grad=True)
    seen = []
    m.weight.register_hook(lambda g: seen.append(g.clone()))
    got = ts.structural_grad(m, lambda mm: (ck(mm, x) * 2 + mm(x)).sum())
    assert len(seen) == 2
    whole = ts.structural_grad(m, lambda mm: (mm(x) * 2 + mm(x)).sum())
    assert len(seen) == 3
    torch.testing.assert_close(seen[0] + seen[1], seen[2])
    torch.testing.assert_close(got["weight"], whole["weight"])


@pytest.mark.parametrize("kind", KINDS)
def test_a_bound_module_stays_switched_off_while_a_flag_context_is_active(kind):
    """A flag context active on another model makes every reentrant checkpoint recompute with
    the flags its forward ran with: the exact path's own choices (a bound module's parameters
    switched off) stand in its recomputations, so the hooked teacher is never reached."""
    other = nn.Linear(2, 2)
    with ts.freeze(other):
        m, x, outside = build("bound")
        calls, keep = [], []
        _hook(kind, m.teacher[0].weight, calls, keep)
        got = ts.structural_grad(m, lambda mm: mm(x), wrt=["inp", "out"])
        want = reference(m, x, ["inp", "out"])
        for k, g in ts.tree.to_flat_dict(got).items():
            assert torch.equal(g, want[k]), k
        assert calls == []
        untouched(m, outside)


def test_a_hooked_outside_tensor_is_described_in_the_refusal():
    m, x, outside = build("closure")
    m.extra[0].register_hook(lambda g: g)
    with pytest.raises(RuntimeError, match=r"outside the model has a gradient hook \(that tensor: "
                                           r"shape \(4,\), dtype torch\.float32, device cpu\)"):
        ts.structural_grad(m, lambda mm: mm(x), wrt=["inp", "out"])
    untouched(m, outside)
