"""Outside audit: torchstruct on modules that other PyTorch tools transformed or rebuilt.

Checked, each against plain PyTorch (``torch.autograd.grad``, ``clip_grad_norm_``, parameters
frozen by hand) or a brute force of the documented behaviour (docs/*.md):

- ``torch.fx``: ``symbolic_trace``'d ``GraphModule`` s (another parameter order, a traced-through
  class turned into a plain ``nn.Module``), ``add_submodule`` + ``recompile`` under a permanent
  context, ``torch.fx.experimental.optimization.fuse`` (a copy with fused conv weights);
- ``torch.jit.script`` / ``torch.jit.trace``: read-only calls, structural gradients, norms and
  clipping agree with the eager model; every entry point that must write hooks or
  declarations refuses a ``ScriptModule`` with a clear error and changes no flag, and so do
  ``stop_gradient`` / ``swap`` over a scripted part's parameters and freezing a scripted
  batch norm that could not be held; ``no_decay="auto"`` finds scripted norms by their
  ``original_name``; traced programs follow flag changes;
- ``torch.export.export(...).module()`` (shares the parameters) and ``torch.export.unflatten``
  (a copy): contexts, module-object selectors, structural gradients, checkpoints;
- ``torch.func``: ``functional_call`` over the trainable dict + ``torch.func.grad`` against
  ``ts.structural_grad``, flat-dict ``global_norm`` / ``clip_by_global_norm`` against
  ``clip_grad_norm_``, ``stack_module_state`` + ``vmap`` ensembles with ``ts.global_norm`` per
  member;
- ``set_submodule`` / ``register_module`` of transformed or copied submodules inside contexts;
- ``torch.nn.utils.prune`` and ``parametrize`` (``orthogonal``, ``weight_norm``): the old path
  (``fc.weight``) is refused, the real paths are exact, checkpoints round-trip and a checkpoint
  of the other layout is refused with nothing written;
- ``torch.ao.quantization.prepare_qat`` (learnable fake quantization adds parameters) inside
  and under freeze contexts;
- bad input on such models leaves flags, values and optimizer state unchanged.

Convention: a test that exposes a defect is kept, minimized, and marked
``@pytest.mark.xfail(strict=True, reason="BUG: what happens; what is expected")``. Behaviour
the docs state as a limit is asserted as documented.
"""
import copy
import fnmatch
import gc
import warnings

import pytest
import torch
import torch.fx
import torch.nn.functional as F
import torch.nn.utils.prune as prune
from torch import nn
from torch.nn.utils import parametrizations

import torchstruct as ts


# ----------------------------------------------------------------------------- helpers
def _flags(m):
    return [(n, p.requires_grad) for n, p in m.named_parameters()]


def _assert_reads_agree(m):
    """The flags PyTorch sees equal every read torchstruct offers."""
    flags = _flags(m)
    assert [(n, ts.is_trainable(m, p)) for n, p in m.named_parameters()] == flags
    assert [(n, ts.is_trainable(m, n)) for n, _ in m.named_parameters()] == flags
    on = [n for n, b in flags if b]
    assert [n for n, _ in ts.trainable_parameters(m)] == on
    named = dict(m.named_parameters())
    assert ts.summary(m).counts == (sum(named[n].numel() for n in on),
                                    sum(p.numel() for p in named.values()))


def _glob_paths(m, pattern):
    """Brute force of a glob selector: a parameter path, or a module path prefix of it."""
    out = []
    for n, _ in m.named_parameters():
        parts = n.split(".")
        if any(fnmatch.fnmatchcase(".".join(parts[:i]), pattern) for i in range(1, len(parts) + 1)):
            out.append(n)
    return out


def _autograd(model, loss_fn, names):
    """Plain PyTorch: ``torch.autograd.grad`` of ``loss_fn(model)`` for ``names``."""
    named = dict(model.named_parameters())
    return dict(zip(names, torch.autograd.grad(loss_fn(model), [named[n] for n in names])))


def _flat(tree):
    return ts.tree.to_flat_dict(tree)


def _assert_close_dicts(a, b, **kw):
    assert list(a) == list(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], **kw)


def _snapshot(m):
    return {n: (p.detach().clone(), p.requires_grad) for n, p in m.named_parameters()}


def _same_snapshot(a, b):
    return list(a) == list(b) and all(torch.equal(a[k][0], b[k][0]) and a[k][1] == b[k][1]
                                      for k in a)


class Block(nn.Module):
    """Uses its child's parameters functionally: fx traces through it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 4))

    def forward(self, x):
        return F.linear(x, self.lin.weight, self.lin.bias) * self.scale


class Net(nn.Module):
    def __init__(self, bn=True):
        super().__init__()
        self.enc = nn.Sequential(Block(), nn.Tanh(), Block())
        self.conv = nn.Conv2d(2, 3, 3)
        self.bn = nn.BatchNorm2d(3) if bn else nn.Identity()
        self.head = nn.Linear(4, 2)

    def forward(self, x, img):
        y = self.bn(self.conv(img)).mean((1, 2, 3))
        return self.head(self.enc(x)) + y[:, None]


def _net(bn=True, seed=0):
    torch.manual_seed(seed)
    return Net(bn)


X = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
IMG = torch.randn(5, 2, 6, 6, generator=torch.Generator().manual_seed(2))


def _loss(m):
    return m(X, IMG).pow(2).mean()


# ----------------------------------------------------------------------------- torch.fx
def test_fx_graph_module_selection_order_contexts_and_grads_against_autograd():
    m = _net().eval()
    gm = torch.fx.symbolic_trace(m)
    # fx registers the parameters of a traced-through class in order of use: another order
    assert [n for n, _ in gm.named_parameters()] != [n for n, _ in m.named_parameters()]
    assert sorted(n for n, _ in gm.named_parameters()) == sorted(n for n, _ in m.named_parameters())
    for pattern in ["enc", "enc.*.lin", "*.scale", "head.weight"]:
        assert [n for n, _ in ts.select(gm, pattern)] == _glob_paths(gm, pattern)
        assert {id(p) for _, p in ts.select(gm, pattern)} == {id(p) for _, p in ts.select(m, pattern)}
    with ts.freeze_except(gm, "head", "enc.2"):
        on = _glob_paths(gm, "head") + _glob_paths(gm, "enc.2")
        assert [n for n, b in _flags(gm) if b] == [n for n in dict(gm.named_parameters()) if n in on]
        # the original shares the parameter objects: plain PyTorch sees the same flags
        assert sorted(n for n, b in _flags(m) if b) == sorted(on)
        _assert_reads_agree(gm)
        g = _flat(ts.structural_grad(gm, _loss))
        assert list(g) == [n for n, _ in ts.trainable_parameters(gm)]
        _assert_close_dicts(g, _autograd(m, _loss, list(g)))
        assert all(p.grad is None for p in m.parameters())
    assert all(b for _, b in _flags(m))
    assert all(b for _, b in _flags(gm))


def test_fx_trace_drops_a_trainable_method_and_the_survivor_applies_when_the_original_dies():
    class Declared(Block):
        def trainable(self):
            return ["lin"]

    torch.manual_seed(0)
    m = nn.Sequential(Declared(), nn.Linear(4, 2))
    ts.attach(m)
    assert dict(_flags(m))["0.scale"] is False
    gm = torch.fx.symbolic_trace(m)
    assert type(gm.get_submodule("0")) is nn.Module  # the class (and its declaration) is gone
    ts.attach(gm)
    # one flag per parameter object: the attached original's declaration still holds it
    assert dict(_flags(gm))["0.scale"] is False
    _assert_reads_agree(gm)
    with ts.freeze(gm, "1"):
        assert [n for n, b in _flags(gm) if b] == ["0.lin.weight", "0.lin.bias"]
    assert dict(_flags(gm)) == {"0.scale": False, "0.lin.weight": True, "0.lin.bias": True,
                                "1.weight": True, "1.bias": True}
    # docs/freezing.md: when the attached model whose declaration froze a shared layer is
    # collected, the survivor applies at once
    del m
    gc.collect()
    assert all(b for _, b in _flags(gm))
    _assert_reads_agree(gm)


def test_graph_module_add_submodule_and_recompile_follow_a_permanent_freeze_except():
    torch.manual_seed(0)
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
    ctx = ts.freeze_except(gm, "2")
    assert [b for _, b in _flags(gm)] == [False, False, True, True]
    gm.add_submodule("post.lin", nn.Linear(2, 2))  # nested: creates "post" too
    gm.add_submodule("2x", nn.Linear(2, 2))         # "2x" does not match the glob "2"
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        a = gm.graph.call_module("post.lin", (out.args[0],))
        b = gm.graph.call_module("2x", (a,))
    out.args = (b,)
    gm.recompile()
    x = torch.randn(3, 4)
    y = gm(x)  # the forward after the registrations applies the rule to the new layers
    expected = gm.get_submodule("2x")(gm.post.lin(gm.get_submodule("2")(torch.relu(gm.get_submodule("0")(x)))))
    torch.testing.assert_close(y, expected)
    assert dict(_flags(gm)) == {"0.weight": False, "0.bias": False, "2.weight": True,
                                "2.bias": True, "post.lin.weight": False, "post.lin.bias": False,
                                "2x.weight": False, "2x.bias": False}
    _assert_reads_agree(gm)
    g = _flat(ts.structural_grad(gm, lambda mm: mm(x).sum()))
    _assert_close_dicts(g, _autograd(gm, lambda mm: mm(x).sum(), ["2.weight", "2.bias"]))
    # docs/freezing.md: parameters were added inside the block, so the exit names the
    # parameters it turns back on
    with pytest.warns(ts.RestoredFlagsWarning, match="post.lin.weight"):
        ctx.__exit__(None, None, None)
    assert all(b for _, b in _flags(gm))
    _assert_reads_agree(gm)


def test_fx_fuse_of_an_attached_model_inside_freeze_is_a_plain_copy():
    from torch.fx.experimental.optimization import fuse

    m = _net().eval()
    m(X, IMG)
    ts.attach(m)
    with ts.freeze(m, "conv"):
        f = fuse(m)
    # the fused copy carries the flags copied at fusion (plain PyTorch), the original is restored
    assert all(b for _, b in _flags(m))
    assert dict(_flags(f))["conv.weight"] is False and dict(_flags(f))["conv.bias"] is False
    assert "bn.weight" not in dict(f.named_parameters())
    assert not any(p is q for p in f.parameters() for q in m.parameters())
    torch.testing.assert_close(f(X, IMG), m(X, IMG), atol=1e-5, rtol=1e-5)
    before = _flags(f)
    with ts.freeze(m, "head", "enc"):  # contexts on the original do not reach the copy
        assert _flags(f) == before
    # read-only calls on the copy start from its own flags
    assert [n for n, _ in ts.trainable_parameters(f)] == [n for n, b in before if b]
    with ts.unfreeze(f):
        assert all(b for _, b in _flags(f))
        g = _flat(ts.structural_grad(f, _loss, wrt="conv"))
        _assert_close_dicts(g, _autograd(f, _loss, ["conv.weight", "conv.bias"]))
    assert _flags(f) == before
    _assert_reads_agree(f)


# ----------------------------------------------------------------------------- torch.jit
def _scripted():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    return m, torch.jit.script(m)


def test_scripting_an_attached_model_raises_and_detach_hooks_makes_it_scriptable():
    # docs/freezing.md: torch.jit.script needs ts.detach_hooks(model) (scripting refuses hooks)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    ctx = ts.freeze(m, "0")
    with pytest.raises(RuntimeError, match="(?i)hook"):
        torch.jit.script(m)
    ts.detach_hooks(m)
    s = torch.jit.script(m)
    assert [b for _, b in _flags(s)] == [False, False, True, True]
    ctx.__exit__(None, None, None)  # the bare context still restores the shared flags
    assert all(b for _, b in _flags(s))


_HOOK_WRITERS = {
    "attach": lambda s: ts.attach(s),
    "freeze": lambda s: ts.freeze(s, "0"),
    "freeze_with": lambda s: ts.freeze(s, "0").__enter__(),
    "freeze_except": lambda s: ts.freeze_except(s, "2"),
    "unfreeze": lambda s: ts.unfreeze(s),
    "schedule": lambda s: ts.UnfreezeSchedule(s, {0: "2", 3: None}),
}


@pytest.mark.parametrize("call", list(_HOOK_WRITERS))
def test_every_flag_writing_entry_point_refuses_a_script_module_and_changes_nothing(call):
    m, s = _scripted()
    m[0].bias.requires_grad_(False)  # a flag of the user's own, shared with the script module
    before = _flags(s)
    with pytest.raises(RuntimeError, match="ScriptModule"):
        _HOOK_WRITERS[call](s)
    assert _flags(s) == before == _flags(m)
    _assert_reads_agree(s)
    # nothing was left behind: the eager original can still be frozen and the scripted forward
    # follows the shared flags
    with ts.freeze(m, "2"):
        s(X).sum().backward()
        assert [p.grad is not None for p in m.parameters()] == [True, False, True, True, False, False]
    assert _flags(s) == before


def test_mark_trainable_on_a_script_module_is_a_clear_error():
    s = torch.jit.script(nn.Linear(3, 3))
    with pytest.raises(TypeError, match="mark_trainable: a TorchScript module"):
        ts.mark_trainable(s, "weight")
    assert all(b for _, b in _flags(s))


def test_read_only_calls_on_a_script_module_match_the_eager_original():
    import re
    m, s = _scripted()
    m[2].bias.requires_grad_(False)
    with ts.freeze(m, "1"):  # a context on the eager original, entered after scripting
        for sel in ["1", "*.bias", re.compile(r"[02]\.weight"), lambda path, p: p.ndim == 2]:
            assert [n for n, _ in ts.select(s, sel)] == [n for n, _ in ts.select(m, sel)]
            assert [p for _, p in ts.select(s, sel)] == [p for _, p in ts.select(m, sel)]
        assert [n for n, _ in ts.trainable_parameters(s)] == ["0.weight", "0.bias", "2.weight"]
        _assert_reads_agree(s)
        assert ts.summary(s).counts == ts.summary(m).counts == (16 + 4 + 8, 16 + 4 + 8 + 8 + 2)
        sd_s, sd_m = ts.state_dict(s), ts.state_dict(m)
        assert list(sd_s) == list(sd_m) == ["0.weight", "0.bias", "2.weight"]
        assert all(sd_s[k] is sd_m[k] or torch.equal(sd_s[k], sd_m[k]) for k in sd_s)
    with pytest.raises(ValueError, match="'1.weight'"):
        ts.select(s, "1.wieght")


def test_structural_grad_value_and_grad_norm_and_clip_on_a_script_module_match_autograd():
    m, s = _scripted()
    loss = lambda mm: mm(X).pow(2).sum()  # noqa: E731
    names = [n for n, _ in m.named_parameters()]
    g = _flat(ts.structural_grad(s, loss))
    _assert_close_dicts(g, _autograd(m, loss, names))
    # wrt writes the shared flags for its call only
    g2 = _flat(ts.structural_grad(s, loss, wrt="2"))
    _assert_close_dicts(g2, _autograd(m, loss, ["2.weight", "2.bias"]))
    assert all(b for _, b in _flags(s))
    (v, aux), g3 = ts.value_and_grad(lambda mm, x: (mm(x).pow(2).sum(), 7), s, X, has_aux=True,
                                     wrt="0.weight")
    torch.testing.assert_close(v, loss(m))
    assert aux == 7 and list(_flat(g3)) == ["0.weight"]
    # a tensor loss with a parameter that did not require grad: an error naming it, unchanged
    m[1].weight.requires_grad_(False)
    with pytest.raises(ValueError, match="'1.weight'"):
        ts.structural_grad(s, loss(s), wrt="1.weight")
    assert dict(_flags(s))["1.weight"] is False
    m[1].weight.requires_grad_(True)
    # norms and clipping read the scripted model's .grad exactly as torch does
    loss(s).backward()
    twin = [p.grad.detach().clone() for p in m.parameters()]
    dummies = [torch.zeros_like(t, requires_grad=True) for t in twin]
    for d, t in zip(dummies, twin):
        d.grad = t.clone()
    expected_total = torch.nn.utils.clip_grad_norm_(dummies, 0.5)
    torch.testing.assert_close(ts.global_norm(s), expected_total)
    total = ts.clip_by_global_norm(s, 0.5)
    torch.testing.assert_close(total, expected_total)
    for p, d in zip(s.parameters(), dummies):
        torch.testing.assert_close(p.grad, d.grad)


def test_a_scripted_batchnorm_frozen_in_an_attached_model_is_held_or_refused():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), torch.jit.script(nn.BatchNorm1d(4)), nn.Linear(4, 2))
    ts.attach(m)
    before = m[1].running_mean.clone()
    with pytest.raises(RuntimeError, match="cannot freeze the TorchScript BatchNorm1d at '1'"):
        with ts.freeze(m, "1"):
            m(torch.randn(8, 4))
    assert torch.equal(m[1].running_mean, before)
    assert all(p.requires_grad for p in m.parameters())
    # declared frozen instead: refused by the declaration, which does not stand
    with pytest.raises(RuntimeError, match="cannot freeze the TorchScript"):
        ts.mark_trainable(m, "0", "2")
    m(torch.randn(8, 4))
    assert all(p.requires_grad for p in m.parameters())
    before = m[1].running_mean.clone()
    with ts.freeze(m, "1", freeze_norm_stats=False):  # the context's opt-out
        assert [p.requires_grad for p in m.parameters()] == [True, True, False, False, True, True]
    # opted out of the hold: frozen, and PyTorch's own rule updates the statistics
    ts.attach(m, freeze_norm_stats=False)
    with ts.freeze(m, "1"):
        assert [p.requires_grad for p in m.parameters()] == [True, True, False, False, True, True]
        m(torch.randn(8, 4))
    assert not torch.equal(m[1].running_mean, before)
    assert all(p.requires_grad for p in m.parameters())


def test_param_groups_of_a_script_module_match_the_eager_original():
    m, s = _scripted()
    by_name = lambda groups: {g["name"]: g["param_names"] for g in groups}  # noqa: E731
    assert by_name(ts.param_groups(s, weight_decay=0.1)) == by_name(ts.param_groups(m, weight_decay=0.1))


def test_a_traced_batchnorm_frozen_in_an_attached_model_is_refused_too():
    """A traced module keeps no constants (no ``track_running_stats``): it is known by its
    ``running_mean`` buffer, and freezing it is refused as for a scripted one."""
    m = nn.Sequential(nn.Linear(3, 3), torch.jit.trace(nn.BatchNorm1d(3), torch.randn(4, 3)))
    before = m[1].running_mean.clone()
    with pytest.raises(RuntimeError, match="cannot freeze the TorchScript BatchNorm1d at '1'"):
        ts.freeze(m, "1")
    m.train()
    m(torch.randn(8, 3))
    assert all(p.requires_grad for p in m.parameters())
    assert not torch.equal(m[1].running_mean, before)  # plain PyTorch: it trains


@pytest.mark.parametrize("where", ["root", "below"])
def test_a_scripted_module_put_into_an_attached_model_is_registered_as_any_module(where):
    """A ScriptModule takes no Python hooks: registered into an attached model (at the root or
    below it), the hooks go on its eager parents, and the next forward applies as usual."""
    m = nn.Sequential(nn.Sequential(nn.Linear(2, 2)), nn.Linear(2, 2))
    ts.attach(m)
    with ts.freeze_except(m, "1"):
        part = torch.jit.script(nn.Linear(2, 2))
        if where == "root":
            m.append(part)
        else:
            m[0].append(part)
        m(torch.randn(3, 2))
        assert not part.weight.requires_grad  # frozen by the block at the forward
        assert [p.requires_grad for p in m[1].parameters()] == [True, True]
    assert part.weight.requires_grad


def _jit_variant(kind):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    if kind == "script":
        return m, torch.jit.script(m)
    if kind == "trace":
        return m, torch.jit.trace(m, (X,))
    outer = nn.Sequential(torch.jit.script(m[0]), m[1], m[2])  # a scripted part in an eager model
    return m, outer


@pytest.mark.parametrize("kind", ["script", "trace", "scripted_part"])
def test_stop_gradient_on_a_jit_module_blocks_or_refuses(kind):
    """TorchScript runs without Python torch-function modes: the block refuses at entry."""
    m, t = _jit_variant(kind)
    with pytest.raises(RuntimeError, match="stop_gradient: parameter '0.weight' is used by"):
        with ts.stop_gradient(t, "0"):
            pass
    if kind == "scripted_part":  # the eager parts' parameters: the block acts
        with ts.stop_gradient(t, "2"):
            y = t(X)
        y.sum().backward()
        assert m[2].weight.grad is None and m[0].weight.grad is not None


@pytest.mark.parametrize("kind", ["script", "trace", "scripted_part"])
def test_swap_on_a_jit_module_stands_in_or_refuses(kind):
    m, t = _jit_variant(kind)
    torch.manual_seed(5)
    other = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    with pytest.raises(RuntimeError, match="swap: parameter '0.weight' is used by"):
        with ts.swap(t, ts.tree.from_module(other)):
            pass
    torch.testing.assert_close(t(X), m(X))
    if kind == "scripted_part":  # the eager parts' parameters: swapped
        with ts.swap(t, {"2.weight": other[2].weight, "2.bias": other[2].bias}):
            torch.testing.assert_close(t(X), other[2](m[1](m[0](X))))


@pytest.mark.parametrize("kind", ["fx", "export"])
def test_block_contexts_on_fx_and_exported_modules_act_like_on_the_original(kind):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = torch.fx.symbolic_trace(m) if kind == "fx" else torch.export.export(m, (X,)).module()
    torch.manual_seed(5)
    other = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    with ts.swap(t, ts.tree.from_module(other)):
        torch.testing.assert_close(t(X), other(X))
    torch.testing.assert_close(t(X), m(X))
    xi = X.clone().requires_grad_()
    with ts.stop_gradient(t, "0"):
        y = t(xi)
    y.sum().backward()
    assert m[0].weight.grad is None and m[2].weight.grad is not None and xi.grad is not None
    ref = xi.detach().clone().requires_grad_()
    torch.testing.assert_close(xi.grad, torch.autograd.grad(m(ref).sum(), ref)[0])
    with pytest.raises(RuntimeError, match="'0.weight'"):
        with ts.constant(t, "0"), torch.no_grad():
            t.get_submodule("0").weight.add_(1.0)
    torch.testing.assert_close(t(X), m(X))


def test_jit_traced_program_follows_flag_changes_between_calls():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    tr = torch.jit.trace(m, (X,))
    plan = [("freeze", "0"), (None, None), ("freeze_except", "0"), ("freeze", "0"), (None, None)]
    for kind, sel in plan:
        ctx = getattr(ts, kind)(m, sel) if kind else None
        try:
            expected_on = [p.requires_grad for p in m.parameters()]
            m.zero_grad(set_to_none=True)
            tr(X).pow(2).sum().backward()
            got = [None if p.grad is None else p.grad.clone() for p in m.parameters()]
            assert [t is not None for t in got] == expected_on
            if any(expected_on):
                on = [n for (n, _), b in zip(m.named_parameters(), expected_on) if b]
                ref = _autograd(m, lambda mm: mm(X).pow(2).sum(), on)
                for (n, _), t in zip(m.named_parameters(), got):
                    if t is not None:
                        torch.testing.assert_close(t, ref[n])
                g = _flat(ts.structural_grad(tr, lambda t: t(X).pow(2).sum()))
                _assert_close_dicts(g, ref)
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)
    assert all(p.requires_grad for p in m.parameters())


# ----------------------------------------------------------------------------- torch.export
def _exported(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.export.export(model, (X, IMG))


def test_exported_module_under_contexts_matches_autograd_on_the_shared_original():
    m = _net().eval()
    em = _exported(m).module()
    assert all(any(p is q for q in m.parameters()) for p in em.parameters())
    assert [n for n, _ in ts.select(em, "enc")] == _glob_paths(em, "enc")
    with ts.freeze_except(em, "head", "enc.2"):
        on = set(_glob_paths(em, "head") + _glob_paths(em, "enc.2"))
        assert {n for n, b in _flags(m) if b} == on  # the original's flags: the same objects
        _assert_reads_agree(em)
        assert ts.summary(em).counts == ts.summary(m).counts
        g = _flat(ts.structural_grad(em, _loss))
        assert set(g) == on
        _assert_close_dicts(g, _autograd(m, _loss, list(g)))
        # module objects of the exported tree select by identity, frozen ones included
        g2 = _flat(ts.structural_grad(em, _loss, wrt=em.get_submodule("enc.0")))
        assert set(g2) == set(_glob_paths(em, "enc.0"))
        assert {n for n, b in _flags(m) if b} == on
    assert all(b for _, b in _flags(m)) and all(b for _, b in _flags(em))
    _assert_close_dicts(g2, _autograd(m, _loss, list(g2)))


def test_unflattened_export_is_an_independent_copy_with_module_selectors_and_checkpoints():
    m = _net().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        u = torch.export.unflatten(_exported(m))
    assert not any(p is q for p in u.parameters() for q in m.parameters())
    with ts.freeze(u, u.get_submodule("enc")):
        assert all(b for _, b in _flags(m))  # a copy: the original is untouched
        assert [n for n, b in _flags(u) if not b] == _glob_paths(u, "enc")
        _assert_reads_agree(u)
        g = _flat(ts.structural_grad(u, _loss))
        assert list(g) == [n for n, b in _flags(u) if b]
        _assert_close_dicts(g, _autograd(m, _loss, list(g)))
    assert all(b for _, b in _flags(u))
    # a checkpoint of the original loads into the copy: same keys, and then the same outputs
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.25)
    state = ts.state_dict(m)
    ts.load_state_dict(u, state)
    torch.testing.assert_close(u(X, IMG), m(X, IMG))
    # a bad entry anywhere: an error naming it, nothing written
    before = _snapshot(u)
    bad = dict(state)
    bad["head.bias"] = bad["head.bias"] + 1
    bad["enc.0.lin.weight"] = torch.zeros(4, 5)
    with pytest.raises(ValueError, match="enc.0.lin.weight"):
        ts.load_state_dict(u, bad)
    assert _same_snapshot(_snapshot(u), before)


# ----------------------------------------------------------------------------- torch.func
def test_func_grad_over_functional_call_of_the_trainable_dict_matches_structural_grad_and_clip():
    from torch.func import functional_call, grad

    m = _net().eval()
    gm = torch.fx.symbolic_trace(m)
    with ts.freeze_except(gm, "enc.2", "head"):
        train = {k: v.detach() for k, v in ts.trainable_parameters(gm)}
        rest = {k: v for k, v in gm.named_parameters() if k not in train}
        g = grad(lambda t: functional_call(gm, {**rest, **t}, (X, IMG)).pow(2).mean())(train)
        sg = _flat(ts.structural_grad(gm, _loss))
    assert list(sg) == list(g)
    _assert_close_dicts(sg, g)
    # flat path-keyed dicts are trees (docs: Conventions)
    everything = torch.cat([t.reshape(-1) for t in g.values()])
    for p in (2.0, 1.0, float("inf"), 3.0):
        torch.testing.assert_close(ts.global_norm(g, norm_type=p),
                                   torch.linalg.vector_norm(everything, p))
    dummies = [torch.zeros_like(t, requires_grad=True) for t in g.values()]
    for d, t in zip(dummies, g.values()):
        d.grad = t.clone()
    expected = torch.nn.utils.clip_grad_norm_(dummies, 0.05)
    clipped = {k: v.clone() for k, v in g.items()}
    torch.testing.assert_close(ts.clip_by_global_norm(clipped, 0.05), expected)
    for d, t in zip(dummies, clipped.values()):
        torch.testing.assert_close(t, d.grad)
    assert all(b for _, b in _flags(m))


def test_vmap_ensemble_grads_and_per_member_global_norm_match_each_model():
    from torch.func import functional_call, grad, stack_module_state, vmap

    models = []
    for seed in range(3):
        torch.manual_seed(seed)
        mm = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        ts.freeze_except(mm, "2")
        models.append(mm)
    x = torch.randn(6, 3)
    params, buffers = stack_module_state(models)
    names = [n for n, _ in ts.trainable_parameters(models[0])]
    assert names == ["2.weight", "2.bias"]
    train = {k: params[k] for k in names}
    frozen = {k: v for k, v in params.items() if k not in train}
    base = copy.deepcopy(models[0]).to("meta")

    def loss(t, f, xx):
        return functional_call(base, ({**f, **t}, buffers), (xx,)).pow(2).sum()

    grads = vmap(grad(loss), in_dims=(0, 0, None))(train, frozen, x)
    trees = [_flat(ts.structural_grad(mm, lambda q: q(x).pow(2).sum())) for mm in models]
    for i, tree in enumerate(trees):
        _assert_close_dicts({k: v[i] for k, v in grads.items()}, tree)
    for p in (2.0, 1.0, float("inf")):
        per = vmap(lambda g: ts.global_norm(g, norm_type=p))(grads)
        torch.testing.assert_close(per, torch.stack([ts.global_norm(t, norm_type=p) for t in trees]))
    torch.testing.assert_close(ts.global_norm(grads),
                               torch.linalg.vector_norm(torch.stack([ts.global_norm(t) for t in trees])))
    for mm in models:
        _assert_reads_agree(mm)
        assert [b for _, b in _flags(mm)] == [False, False, True, True]


# ----------------------------------------------------------------------------- submodule swaps
def test_set_submodule_with_a_traced_view_of_the_same_parameters_inside_freeze():
    m = _net().eval()
    ts.attach(m)
    with pytest.warns(ts.RestoredFlagsWarning, match="'enc.0.scale'") as caught, \
            ts.freeze(m, "enc"):
        old = list(m.enc.parameters())
        m.set_submodule("enc", torch.fx.symbolic_trace(m.enc))
        assert isinstance(m.enc, torch.fx.GraphModule)
        m(X, IMG)
        assert all(any(p is q for q in old) for p in m.enc.parameters())
        assert [n for n, b in _flags(m) if not b] == _glob_paths(m, "enc")
        _assert_reads_agree(m)
        g = _flat(ts.structural_grad(m, _loss))
        assert list(g) == [n for n, b in _flags(m) if b]
        _assert_close_dicts(g, _autograd(m, _loss, list(g)))
    # docs/freezing.md: a module was added inside the block, so the exit names what it turns
    # back on; the same parameter objects are still in the model: none "left" it
    assert not any("left the model" in str(w.message) for w in caught)
    assert all(b for _, b in _flags(m))
    # the GraphModule as a module-object selector
    with ts.freeze(m, m.enc):
        assert [n for n, b in _flags(m) if not b] == _glob_paths(m, "enc")
    assert all(b for _, b in _flags(m))


def test_copies_put_in_place_and_registered_inside_freeze_except_then_exit():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    ts.attach(m)
    x = torch.randn(3, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ts.freeze_except(m, "2"):
            # a copy of the frozen layer at its own path carries the flag the block wrote: it
            # is taken as that layer's copy (docs/freezing.md)
            m.set_submodule("0", copy.deepcopy(m[0]))
            # a copy of the trainable head under a new name that the glob "2" does not match
            m.register_module("3", copy.deepcopy(m[2]))
            assert m[3].weight.requires_grad  # copied flag, until the next forward applies
            m(x)
            assert [b for _, b in _flags(m)] == [False, False, True, True, False, False]
            _assert_reads_agree(m)
            g = _flat(ts.structural_grad(m, lambda q: q(x).sum()))
            _assert_close_dicts(g, _autograd(m, lambda q: q(x).sum(), ["2.weight", "2.bias"]))
    assert all(b for _, b in _flags(m))
    _assert_reads_agree(m)
    said = [str(w.message) for w in caught if issubclass(w.category, ts.RestoredFlagsWarning)]
    # docs/freezing.md: modules were added inside the block, so the exit names what it turns
    # back on; the copy at layer 0's path is that layer's copy: nothing "left" the model and
    # nothing created frozen stays frozen
    assert len(said) == 1 and "'3.weight'" in said[0] and "'0.weight'" in said[0]
    assert "left the model" not in said[0] and "stay frozen" not in said[0]


# ----------------------------------------------------------------------------- pruning
def _pruned(seed=0):
    torch.manual_seed(seed)
    m = nn.Sequential()
    m.add_module("fc", nn.Linear(4, 4))
    m.add_module("act", nn.Tanh())
    m.add_module("head", nn.Linear(4, 2))
    prune.l1_unstructured(m.fc, "weight", amount=0.5)
    prune.random_unstructured(m.head, "bias", amount=0.5)
    return m


def test_pruned_weight_old_path_is_refused_and_the_real_path_is_exact():
    m = _pruned()
    assert [n for n, _ in m.named_parameters()] == ["fc.bias", "fc.weight_orig", "head.weight",
                                                     "head.bias_orig"]
    before = _flags(m)
    with pytest.raises(ValueError, match="'fc.weight_orig'"):
        ts.select(m, "fc.weight")
    for call in (lambda: ts.freeze(m, "fc.weight"), lambda: ts.freeze_except(m, "head.bias"),
                 lambda: ts.structural_grad(m, lambda q: q(X).sum(), wrt="fc.weight")):
        with pytest.raises(ValueError, match="closest"):
            call()
        assert _flags(m) == before
    with pytest.raises(ValueError):
        ts.is_trainable(m, "fc.weight")
    with pytest.raises(ValueError, match="not a parameter"):
        ts.is_trainable(m, m.fc.weight)  # the masked product is a plain tensor
    with pytest.raises(TypeError):
        ts.select(m, m.fc.weight)
    assert _flags(m) == before
    loss = lambda q: q(X).pow(2).sum()  # noqa: E731
    with ts.freeze(m, "fc.weight_orig", "head.bias_orig"):
        assert [n for n, b in _flags(m) if b] == ["fc.bias", "head.weight"]
        _assert_reads_agree(m)
        g = _flat(ts.structural_grad(m, loss, wrt=["fc", "head"]))  # frozen ones included
        assert [n for n, b in _flags(m) if b] == ["fc.bias", "head.weight"]
    _assert_close_dicts(g, _autograd(m, loss, [n for n, _ in m.named_parameters()]))
    # the gradient of a pruned entry is exactly zero, as the mask makes it
    assert torch.all(g["fc.weight_orig"][m.fc.weight_mask == 0] == 0)
    groups = {gr["name"]: gr["param_names"] for gr in ts.param_groups(m, weight_decay=0.1)}
    assert groups == {"default": ["fc.weight_orig", "head.weight"],
                      "default (no decay)": ["fc.bias", "head.bias_orig"]}


def test_pruned_checkpoint_round_trip_and_the_other_layout_is_refused_unchanged():
    a, b = _pruned(0), _pruned(1)
    with ts.freeze(a, "head"):
        state = ts.state_dict(a)
        # trainable parameters and the persistent buffers of the modules that own one
        assert list(state) == ["fc.bias", "fc.weight_orig", "fc.weight_mask"]
    state = ts.state_dict(a)
    assert list(state) == ["fc.bias", "fc.weight_orig", "fc.weight_mask", "head.weight",
                           "head.bias_orig", "head.bias_mask"]
    ts.load_state_dict(b, state)
    torch.testing.assert_close(b(X), a(X))
    # a checkpoint from before pruning (the layout "fc.weight") is refused, nothing written
    torch.manual_seed(3)
    plain = nn.Sequential()
    plain.add_module("fc", nn.Linear(4, 4))
    plain.add_module("act", nn.Tanh())
    plain.add_module("head", nn.Linear(4, 2))
    before = _snapshot(b), {k: v.clone() for k, v in b.named_buffers()}
    with pytest.raises(ValueError, match="'fc.weight'"):
        ts.load_state_dict(b, ts.state_dict(plain))
    assert _same_snapshot(_snapshot(b), before[0])
    assert all(torch.equal(v, before[1][k]) for k, v in b.named_buffers())
    plain_before = _snapshot(plain)
    with pytest.raises(ValueError, match="weight_orig"):
        ts.load_state_dict(plain, state)
    assert _same_snapshot(_snapshot(plain), plain_before)
    # strict=False skips unknown keys rather than writing them elsewhere
    ts.load_state_dict(b, {"fc.bias": state["fc.bias"] * 0}, strict=False)
    assert torch.equal(b.fc.bias, torch.zeros(4))


# ----------------------------------------------------------------------------- parametrizations
def _parametrized(kind):
    torch.manual_seed(0)
    m = nn.Sequential()
    m.add_module("fc", nn.Linear(4, 4))
    m.add_module("act", nn.Tanh())
    m.add_module("head", nn.Linear(4, 2))
    if kind == "orthogonal":
        parametrizations.orthogonal(m.fc)
    else:
        parametrizations.weight_norm(m.fc)
    return m


@pytest.mark.parametrize("kind", ["orthogonal", "weight_norm"])
def test_parametrized_weight_old_path_and_tensor_are_refused_real_paths_exact(kind):
    m = _parametrized(kind)
    originals = [n for n, _ in m.named_parameters() if n.startswith("fc.parametrizations.weight.")]
    assert originals == (["fc.parametrizations.weight.original"] if kind == "orthogonal" else
                         ["fc.parametrizations.weight.original0",
                          "fc.parametrizations.weight.original1"])
    before = _flags(m)
    with pytest.raises(ValueError, match="fc.parametrizations.weight"):
        ts.select(m, "fc.weight")
    with pytest.raises(ValueError):
        ts.freeze(m, "fc.weight")
    with pytest.raises(ValueError):
        ts.is_trainable(m, m.fc.weight)
    with pytest.raises(TypeError):
        ts.freeze(m, m.fc.weight)  # a computed tensor, not an nn.Parameter
    assert _flags(m) == before
    assert [n for n, _ in ts.select(m, "fc.parametrizations.weight")] == originals
    assert [n for n, _ in ts.select(m, m.fc.parametrizations.weight)] == originals
    loss = lambda q: q(X).pow(2).sum()  # noqa: E731
    with ts.freeze_except(m, m.fc.parametrizations.weight):
        assert [n for n, b in _flags(m) if b] == originals
        _assert_reads_agree(m)
        g = _flat(ts.structural_grad(m, loss))
        _assert_close_dicts(g, _autograd(m, loss, originals))
        # torch.func over the same dict gives the same numbers
        from torch.func import functional_call, grad
        named = dict(m.named_parameters())
        gf = grad(lambda t: functional_call(m, t, (X,)).pow(2).sum())(
            {k: named[k].detach() for k in originals})
        _assert_close_dicts(g, gf)
    assert _flags(m) == before


# ----------------------------------------------------------------------------- quantization
def _qat_net():
    torch.manual_seed(0)

    class QNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.act, self.head = nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)

        def forward(self, x):
            return self.head(self.act(self.fc(x)))

    return QNet().train()


def test_prepare_qat_with_learnable_fake_quant_inside_a_block_as_documented():
    tq = pytest.importorskip("torch.ao.quantization")
    from torch.ao.quantization._learnable_fake_quantize import _LearnableFakeQuantize as LFQ

    m = _qat_net()
    ts.attach(m)
    obs = tq.MovingAverageMinMaxObserver
    m.qconfig = tq.QConfig(
        activation=LFQ.with_args(observer=obs, quant_min=0, quant_max=255, scale=0.1,
                                 zero_point=0.0, use_grad_scaling=True),
        weight=LFQ.with_args(observer=obs, quant_min=-128, quant_max=127, dtype=torch.qint8,
                             qscheme=torch.per_tensor_symmetric, scale=0.1, zero_point=0.0,
                             use_grad_scaling=True))
    x = torch.randn(8, 4)
    loss = lambda q: q(x).pow(2).sum()  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ts.RestoredFlagsWarning)  # see the test below
        with ts.freeze_except(m, "head"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                tq.prepare_qat(m, inplace=True)
            m.apply(tq.disable_observer)  # deterministic scales for the comparison below
            # the new fake-quant parameters are judged by the block: reads give the contract
            expected = [n for n, _ in m.named_parameters() if n.startswith("head.")]
            assert [n for n, _ in ts.trainable_parameters(m)] == expected
            # prepare_qat writes module slots directly (documented: ts.attach applies at once)
            ts.attach(m)
            assert [n for n, b in _flags(m) if b] == expected
            _assert_reads_agree(m)
            g = _flat(ts.structural_grad(m, loss))
            _assert_close_dicts(g, _autograd(m, loss, expected))
    assert all(b for _, b in _flags(m))
    _assert_reads_agree(m)


def test_parameters_added_by_a_direct_slot_write_inside_a_block_warn_at_the_exit():
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    ts.attach(m)
    with pytest.warns(ts.RestoredFlagsWarning, match="'0.weight'"):
        with ts.freeze_except(m, "1"):
            m[0]._modules["extra"] = nn.Linear(4, 4)  # as prepare_qat's convert writes slots
            ts.attach(m)  # documented: applies a write that bypassed registration
            assert [b for _, b in _flags(m)] == [False, False, False, False, True, True]
    assert all(b for _, b in _flags(m))


def test_qat_model_under_freeze_except_matches_a_twin_frozen_by_hand():
    tq = pytest.importorskip("torch.ao.quantization")
    m = _qat_net()
    m.qconfig = tq.get_default_qat_qconfig("fbgemm")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        tq.prepare_qat(m, inplace=True)
    m(torch.randn(8, 4))  # observers see some data
    twin = copy.deepcopy(m)
    for n, p in twin.named_parameters():
        p.requires_grad_(n.startswith("head."))
    x = torch.randn(8, 4)
    with ts.freeze_except(m, "head"):
        out = m(x)
        out.pow(2).sum().backward()
        state = ts.state_dict(m)
        assert list(state) == ["head.weight", "head.bias"]  # head owns no buffer itself
    ref = twin(x)
    ref.pow(2).sum().backward()
    torch.testing.assert_close(out, ref)
    for (n, p), (_, q) in zip(m.named_parameters(), twin.named_parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad)
    for (n, b), (_, c) in zip(m.named_buffers(), twin.named_buffers()):
        assert torch.equal(b, c), n  # the observers saw the same data
    assert all(b for _, b in _flags(m))


# ----------------------------------------------------------------------------- bad input
def test_bad_input_on_a_pruned_and_parametrized_model_changes_nothing_optimizer_included():
    def build():
        m = _pruned()
        parametrizations.orthogonal(m.head)
        return m

    m, twin = build(), build()
    opt = ts.optim.AdamW(ts.param_groups(m, weight_decay=0.1), lr=0.01)
    opt_twin = ts.optim.AdamW(ts.param_groups(twin, weight_decay=0.1), lr=0.01)
    x = torch.randn(6, 4)

    def step(model, o):
        o.zero_grad(set_to_none=True)
        model(x).pow(2).sum().backward()
        o.step()

    for _ in range(2):
        step(m, opt)
        step(twin, opt_twin)
    m(x).pow(2).sum().backward()  # gradients present for clip to refuse
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    before, opt_before = _snapshot(m), copy.deepcopy(opt.state_dict())
    state = ts.state_dict(m)
    bad_shape = dict(state)
    bad_shape["fc.bias"] = torch.zeros(3)
    calls = [
        (ValueError, lambda: ts.freeze(m, "fc.weight")),
        (ValueError, lambda: ts.freeze_except(m, "head.weight")),
        (ValueError, lambda: ts.unfreeze(m, [])),
        (ValueError, lambda: ts.structural_grad(m, lambda q: q(x).sum(), wrt="head.weight")),
        (ValueError, lambda: ts.load_state_dict(m, {"fc.weight": torch.zeros(4, 4)})),
        (ValueError, lambda: ts.load_state_dict(m, bad_shape)),
        (ValueError, lambda: ts.clip_by_global_norm(m, -1.0)),
        (ValueError, lambda: ts.mark_trainable(m.fc, "weight")),
        (ValueError, lambda: ts.param_groups(m, ("fc.weight", {"lr": 1.0}))),
    ]
    for exc, call in calls:
        with pytest.raises(exc):
            call()
        assert _same_snapshot(_snapshot(m), before)
        assert all(torch.equal(p.grad, grads[n]) for n, p in m.named_parameters())
    after = opt.state_dict()
    assert after["param_groups"] == opt_before["param_groups"]
    assert all(torch.equal(v, opt_before["state"][i][k])
               for i, st in after["state"].items() for k, v in st.items())
    # and training goes on exactly like the twin that saw none of it
    step(m, opt)
    step(twin, opt_twin)
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), twin.parameters()))
