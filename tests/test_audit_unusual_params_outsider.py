"""An outside audit of torchstruct on unusual parameters and module features.

What is checked, every answer against plain PyTorch (a twin whose flags are set by hand,
``torch.autograd.grad``, ``torch.func.functional_call``, ``torch.nn.utils.clip_grad_norm_``,
``torch.optim`` with ``foreach=False``) or a brute force of the documented rule (docs/*.md):

* lazy modules (``nn.LazyLinear``, ``nn.LazyBatchNorm1d``): freezing, ``param_groups`` and a
  ``ts.optim`` optimizer built before the first forward, a context that spans the
  materialization, the read-only calls before it, and the calls that must refuse an
  uninitialized parameter (with a clear error naming its path): ``summary``, ``state_dict``,
  ``swap``, ``polyak_update``, optimizer masks, ``stop_gradient``, ``constant``, optimizer
  ``load_state_dict``;
* ``torch.nn.utils.parametrize`` (a parametrization with a parameter of its own),
  ``parametrizations.weight_norm`` / ``spectral_norm`` / ``orthogonal``, ``prune`` and the
  old ``torch.nn.utils.weight_norm``: real paths, structural gradients, freezing, clipping,
  ``swap`` and masks on the originals; a frozen batch norm with a parametrized weight is held;
* complex parameters (norms and clipping refuse complex gradients and change nothing;
  structural gradients and ``polyak_update`` are exact), float64 / fp16 / bf16, integer and
  bool parameters and buffers, zero-element parameters, non-contiguous, channels_last and
  gappy (strided-slice) gradients, parameters on the meta device and ``to_empty``;
* sparse gradients (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag``): a clear error from
  norms, clipping, flattening and the optimizers, nothing changed; a frozen sparse parameter
  is simply skipped;
* RNN / LSTM (projections, bidirectional) / GRU flat weights, ``nn.MultiheadAttention`` (also
  with ``kdim``/``vdim``, whose ``in_proj_weight`` is a ``None`` slot, and ``add_bias_kv``),
  ``nn.Transformer``, ``nn.Bilinear``, ``nn.Embedding`` with ``padding_idx``,
  ``nn.EmbeddingBag``, channels_last convolutions: ``swap`` with fast weights against
  ``functional_call``, ``structural_grad`` against ``torch.autograd.grad``, ``freeze``
  against a twin frozen by hand, ``clip_by_global_norm`` against ``clip_grad_norm_``;
* normalization variants (BatchNorm without running stats or affine, GroupNorm, LayerNorm
  without affine / bias, RMSNorm, InstanceNorm with running stats, ``momentum=None``,
  SyncBatchNorm) frozen: outputs and statistics against an eval/train twin, ``state_dict``
  contents and the ``no_decay="auto"`` split;
* parameters registered directly on the root, names with glob characters, spaces and
  non-ASCII letters, modules named by digits (``"1"`` against ``"10"``), ``ParameterList``,
  ``ParameterDict``, ``ModuleDict``; children named ``trainable`` / ``no_weight_decay``;
* a plain Python subclass of ``nn.Parameter`` through the whole API.

Convention: a test that exposes a defect is kept, minimized, and marked
``@pytest.mark.xfail(strict=True, reason="BUG: what happens; what is expected")``; once the
defect is fixed the test passes, the strict xfail turns into a failure, and the marker has to
go. Limits the documentation states are not treated as defects: the test asserts the
documented behaviour instead.
"""
from __future__ import annotations

import contextlib
import copy
import re
import warnings

import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.nn.utils import parametrizations, parametrize, prune

import torchstruct as ts


# ----------------------------------------------------------------------------- helpers

def flags(m):
    return [p.requires_grad for p in m.parameters()]


def holders_for(grads):
    """Fresh parameters carrying copies of ``grads``: what ``clip_grad_norm_`` is run on."""
    out = []
    for g in grads:
        h = nn.Parameter(torch.zeros_like(g))
        h.grad = g.clone()
        out.append(h)
    return out


def lazy_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.LazyLinear(2))


X3 = torch.randn(5, 3, generator=torch.Generator().manual_seed(7))


# ----------------------------------------------------------------------------- lazy modules

def test_lazy_frozen_and_optimizer_built_before_materialization_match_torch():
    """Freeze, param groups and an AdamW built on uninitialized parameters: after the first
    forward the run equals torch.optim.AdamW (foreach=False) on a twin frozen by hand."""
    m, t = lazy_mlp(), lazy_mlp()
    ts.freeze(m, "0.bias")
    groups = ts.param_groups(m, weight_decay=0.1)
    assert [g["param_names"] for g in groups] == [["0.weight", "2.weight"], ["0.bias", "2.bias"]]
    ours = ts.optim.AdamW(groups, lr=0.1)
    torch.manual_seed(1)
    m(X3)
    torch.manual_seed(1)
    t(X3)
    t[0].bias.requires_grad_(False)
    assert flags(m) == flags(t) == [True, False, True, True]
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), t.parameters()))
    theirs = torch.optim.AdamW([{"params": [t[0].weight, t[2].weight], "weight_decay": 0.1},
                                {"params": [t[0].bias, t[2].bias], "weight_decay": 0.0}],
                               lr=0.1, foreach=False)
    for _ in range(3):
        for mod, opt in ((m, ours), (t, theirs)):
            opt.zero_grad()
            mod(X3).pow(2).sum().backward()
            opt.step()
    for a, b in zip(m.parameters(), t.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert m[0].bias not in ours.state


@pytest.mark.parametrize("kind", ["freeze", "freeze_except"])
def test_lazy_context_spanning_materialization_restores_flags(kind):
    m = lazy_mlp()
    ctx = ts.freeze(m, "2") if kind == "freeze" else ts.freeze_except(m, "2.weight")
    with ctx:
        m(X3)
        inside = flags(m)
        reads = [ts.is_trainable(m, n) for n, _ in m.named_parameters()]
    assert inside == reads
    assert inside == ([True, True, False, False] if kind == "freeze" else [False, False, True, False])
    assert flags(m) == [True] * 4


def test_lazy_reads_and_refusals_before_materialization():
    m = lazy_mlp()
    ts.freeze(m, "0.bias")
    assert [n for n, _ in ts.trainable_parameters(m)] == ["0.weight", "2.weight", "2.bias"]
    assert not ts.is_trainable(m, "0.bias")
    for call in (lambda: ts.summary(m), lambda: ts.state_dict(m),
                 lambda: ts.swap(m, {"2.bias": torch.zeros(2)}),
                 lambda: ts.polyak_update(lazy_mlp(), m, 0.5)):
        with pytest.raises(ValueError, match=r"'(0|2)\.(weight|bias)'.*uninitialized lazy"):
            call()
    with pytest.raises(ValueError, match="'2.bias'"):
        ts.load_state_dict(m, {"2.bias": torch.zeros(2)}, strict=False)
    assert ts.global_norm(m).item() == 0.0  # no gradient anywhere yet
    m(X3)
    assert ts.summary(m).counts == (3 * 4 + 4 * 2 + 2, 3 * 4 + 4 + 4 * 2 + 2)


def test_lazy_batchnorm_frozen_before_first_forward_is_held():
    m = nn.Sequential(nn.Linear(3, 4), nn.LazyBatchNorm1d(), nn.Linear(4, 2))
    x = torch.randn(8, 3)
    with ts.freeze(m, "1"):
        y = m(x)
        assert torch.equal(m[1].running_mean, torch.zeros(4))
        assert int(m[1].num_batches_tracked) == 0
    twin = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    twin.load_state_dict(m.state_dict())
    twin[1].eval()
    torch.testing.assert_close(y, twin(x))


def test_lazy_set_mask_after_materialization_keeps_rows():
    m = lazy_mlp()
    opt = ts.optim.SGD(m.parameters(), lr=0.1)
    m(X3)
    mask = torch.zeros(4, 3, dtype=torch.bool)
    mask[0] = True
    opt.set_mask(m[0].weight, mask)
    before = m[0].weight.detach().clone()
    m(X3).pow(2).sum().backward()
    opt.step()
    assert torch.equal(m[0].weight[1:], before[1:])
    assert not torch.equal(m[0].weight[0], before[0])


def test_lazy_mask_at_construction_names_the_path():
    m = lazy_mlp()
    mask = torch.ones(4, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"'0\.weight'.*uninitialized lazy"):
        ts.optim.SGD(ts.param_groups(m), lr=0.1, masks={"0.weight": mask})
    opt = ts.optim.SGD(ts.param_groups(m), lr=0.1)  # the mask once the shape is known
    m(X3).sum().backward()
    opt.set_mask(m[0].weight, mask)
    opt.step()
    assert torch.equal(opt.masks[m[0].weight], mask)


def test_lazy_optimizer_load_state_dict_before_materialization():
    src = lazy_mlp()
    src_opt = torch.optim.AdamW(src.parameters(), lr=0.1, foreach=False)
    src(X3).pow(2).sum().backward()
    src_opt.step()
    saved = copy.deepcopy(src_opt.state_dict())

    ours_m, theirs_m = lazy_mlp(), lazy_mlp()
    ours = ts.optim.AdamW(ts.param_groups(ours_m, no_decay=None), lr=0.1)
    theirs = torch.optim.AdamW(theirs_m.parameters(), lr=0.1, foreach=False)
    theirs.load_state_dict(copy.deepcopy(saved))  # plain PyTorch loads it
    with pytest.raises(ValueError, match=r"'0\.weight'.*run one forward"):
        ours.load_state_dict(copy.deepcopy(saved))
    assert len(ours.state) == 0 and ours.param_groups[0]["lr"] == 0.1
    for mod in (ours_m, theirs_m):
        torch.manual_seed(3)
        mod(X3)
    ours.load_state_dict(copy.deepcopy(saved))  # after the first forward: as torch loads it
    for mod in (ours_m, theirs_m):
        torch.manual_seed(3)
        mod(X3)
    for mod, opt in ((ours_m, ours), (theirs_m, theirs)):
        opt.zero_grad()
        mod(X3).pow(2).sum().backward()
        opt.step()
    for a, b in zip(ours_m.parameters(), theirs_m.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_lazy_stop_gradient_before_first_forward():
    m = lazy_mlp()
    with pytest.raises(ValueError, match=r"'0\.weight'.*uninitialized lazy"):
        with ts.stop_gradient(m, "0"):
            m(X3)
    assert nn.parameter.is_lazy(m[0].weight)  # nothing ran
    m(X3)  # the first forward, outside: then the block works
    with ts.stop_gradient(m, "0"):
        y = m(X3).sum()
    grads = torch.autograd.grad(y, list(m.parameters()), allow_unused=True)
    assert [g is None for g in grads] == [True, True, False, False]


def test_lazy_constant_names_the_path():
    m = lazy_mlp()
    with pytest.raises(ValueError, match=r"'0\.weight'.*uninitialized lazy"):
        with ts.constant(m, "0"):
            m(X3)
    assert nn.parameter.is_lazy(m[0].weight)


# ----------------------------------------------------------------------------- parametrizations

def _parametrized(kind):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if kind == "weight_norm":
            parametrizations.weight_norm(m[0])
        elif kind == "spectral_norm":
            parametrizations.spectral_norm(m[0])
        elif kind == "orthogonal":
            parametrizations.orthogonal(m[2])
        elif kind == "old_weight_norm":
            torch.nn.utils.weight_norm(m[0])
        elif kind == "prune":
            prune.random_unstructured(m[0], "weight", 0.5)
    return m


PARAMETRIZED = {
    "weight_norm": ["0.bias", "0.parametrizations.weight.original0",
                    "0.parametrizations.weight.original1", "2.weight", "2.bias"],
    "spectral_norm": ["0.bias", "0.parametrizations.weight.original", "2.weight", "2.bias"],
    "orthogonal": ["0.weight", "0.bias", "2.bias", "2.parametrizations.weight.original"],
    "old_weight_norm": ["0.bias", "0.weight_g", "0.weight_v", "2.weight", "2.bias"],
    "prune": ["0.bias", "0.weight_orig", "2.weight", "2.bias"],
}


@pytest.mark.parametrize("kind", list(PARAMETRIZED))
def test_parametrized_modules_through_the_api(kind):
    m = _parametrized(kind)
    m.eval()  # spectral_norm: no power iteration, so repeated forwards agree
    x = torch.randn(5, 3)
    paths = [n for n, _ in m.named_parameters()]
    assert paths == PARAMETRIZED[kind]

    grads = ts.tree.to_flat_dict(ts.structural_grad(m, lambda mm: mm(x).pow(2).sum()))
    ref = torch.autograd.grad(m(x).pow(2).sum(), list(m.parameters()))
    assert list(grads) == paths
    for r, g in zip(ref, grads.values()):
        torch.testing.assert_close(g, r)

    first = [n for n in paths if n.startswith("0.")]
    with ts.freeze(m, "0"):
        assert [n for n, p in m.named_parameters() if not p.requires_grad] == first
        m(x).pow(2).sum().backward()
    assert all(flags(m))
    assert [n for n, p in m.named_parameters() if p.grad is None] == first

    got = [p.grad.clone() for p in m.parameters() if p.grad is not None]
    hold = holders_for(got)
    total = ts.clip_by_global_norm(m, 0.05)  # the model: frozen grads are gone, all trainable
    expected = torch.nn.utils.clip_grad_norm_(hold, 0.05)
    torch.testing.assert_close(total, expected)
    for p, h in zip([p for p in m.parameters() if p.grad is not None], hold):
        torch.testing.assert_close(p.grad, h.grad)

    fast = {n: torch.randn_like(p) for n, p in m.named_parameters()}
    twin = _parametrized(kind).eval()
    with torch.no_grad():
        for n, p in twin.named_parameters():
            p.copy_(fast[n])
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    with ts.swap(m, fast):
        swapped = m(x)
    torch.testing.assert_close(swapped, twin(x), rtol=1e-5, atol=1e-6)
    assert all(torch.equal(p, before[n]) for n, p in m.named_parameters())


@pytest.mark.parametrize("kind", ["prune", "old_weight_norm", "weight_norm"])
def test_mask_on_a_parametrization_original(kind):
    m = _parametrized(kind)
    name = {"prune": "0.weight_orig", "old_weight_norm": "0.weight_v",
            "weight_norm": "0.parametrizations.weight.original1"}[kind]
    mask = torch.zeros(4, 3, dtype=torch.bool)
    mask[0] = True
    opt = ts.optim.AdamW(ts.param_groups(m), lr=0.1, masks={name: mask})
    m(torch.randn(5, 3)).pow(2).sum().backward()
    w0 = m.get_parameter(name).detach().clone()
    opt.step()
    w1 = m.get_parameter(name)
    assert torch.equal(w1[1:], w0[1:]) and not torch.equal(w1[0], w0[0])
    assert opt.state[w1]["exp_avg"][1:].eq(0).all()


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.tensor(2.0))

    def forward(self, w):
        return w * self.s


def test_parametrization_with_its_own_parameter_and_norm_hold():
    m = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    parametrize.register_parametrization(m[1], "weight", Scale())
    assert [n for n, _ in m[1].named_parameters()] == [
        "bias", "parametrizations.weight.original", "parametrizations.weight.0.s"]
    x = torch.randn(8, 3)
    cases = [(["1"], True),
             (["1.bias", "1.parametrizations.weight.original"], False),  # s still trains
             (["1.bias", "1.parametrizations"], True)]
    for selectors, held in cases:
        rm = m[1].running_mean.clone()
        with ts.freeze(m, *selectors):
            m(x)
            assert torch.equal(rm, m[1].running_mean) is held
    groups = {g["name"]: g["param_names"] for g in ts.param_groups(m, weight_decay=0.1)}
    assert "1.parametrizations.weight.original" in groups["default (no decay)"]
    grads = ts.structural_grad(m, lambda mm: mm(x).sum(), wrt="1.parametrizations.weight.0")
    assert ts.tree.paths(grads) == ["1.parametrizations.weight.0.s"]
    ref, = torch.autograd.grad(m(x).sum(), m[1].parametrizations.weight[0].s)
    torch.testing.assert_close(grads["1"]["parametrizations"]["weight"]["0"]["s"], ref)


# ----------------------------------------------------------------------------- dtypes

class Complexish(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, dtype=torch.complex64))
        self.lin = nn.Linear(3, 1)

    def forward(self, x):
        return self.lin((x * self.w).abs())


def test_complex_parameters():
    torch.manual_seed(0)
    m = Complexish()
    x = torch.randn(2, 3)
    m(x).sum().backward()
    before = [p.grad.clone() for p in m.parameters()]
    for call in (lambda: ts.global_norm(m), lambda: ts.clip_by_global_norm(m, 1e-3),
                 lambda: ts.clip_by_global_norm(list(m.parameters()), 1e-3),
                 lambda: ts.global_norm([p.grad for p in m.parameters()])):
        with pytest.raises(TypeError, match="complex64"):
            call()
    assert all(torch.equal(p.grad, g) for p, g in zip(m.parameters(), before))
    for cls in (ts.optim.SGD, ts.optim.AdamW):
        with pytest.raises(TypeError, match="complex"):
            cls(m.parameters(), lr=0.1)

    grads = ts.structural_grad(m, lambda mm: mm(x).sum(), wrt="w")
    ref, = torch.autograd.grad(m(x).sum(), m.w)
    assert torch.equal(grads["w"], ref)

    target = Complexish()
    t0 = {n: p.detach().clone() for n, p in target.named_parameters()}
    ts.polyak_update(target, m, 0.25)
    for n, p in target.named_parameters():
        torch.testing.assert_close(p.detach(), t0[n] + 0.25 * (m.get_parameter(n).detach() - t0[n]))
    vec, spec = ts.tree.flatten({"w": m.w.detach()})
    assert vec.dtype == torch.complex64 and torch.equal(ts.tree.unflatten(vec, spec)["w"], m.w)


def test_flatten_round_trip_of_a_mixed_complex_tree():
    torch.manual_seed(0)
    tree = ts.tree.from_module(Complexish())
    vec, spec = ts.tree.flatten(tree)
    assert vec.dtype == torch.complex64 and vec.numel() == 7
    back = ts.tree.unflatten(vec, spec)
    assert back["lin"]["weight"].dtype == torch.float32
    assert torch.equal(back["lin"]["weight"], tree["lin"]["weight"])
    assert torch.equal(back["w"], tree["w"])


def _mixed_grads():
    torch.manual_seed(0)
    specs = [((3, 4), torch.float32, None), ((0, 5), torch.float32, None),
             ((2, 3, 4, 5), torch.float32, "cl"), ((5,), torch.float64, None),
             ((6,), torch.bfloat16, None), ((4, 3), torch.float16, "t"),
             ((3, 4), torch.float32, "gap")]
    ps = []
    for shape, dt, how in specs:
        p = nn.Parameter(torch.zeros(shape, dtype=dt))
        if how == "cl":
            g = torch.randn(shape).contiguous(memory_format=torch.channels_last)
        elif how == "t":
            g = torch.randn(shape[::-1]).to(dt).t()
        elif how == "gap":
            g = torch.randn(shape[0] * 2, shape[1])[::2]
        else:
            g = torch.randn(shape).to(dt)
        p.grad = g
        ps.append(p)
    return ps


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf"), 3.0, 0.5])
def test_clip_mixed_dtypes_layouts_and_empty_against_exact(norm_type):
    """The total against the exact float64 norm (torch rounds per-tensor fp16/bf16 norms,
    a documented difference), the clipped grads against the coefficient applied by hand, and
    every gradient's strides kept."""
    ps = _mixed_grads()
    exact64 = [p.grad.double().flatten().clone() for p in ps]
    exact = torch.linalg.vector_norm(torch.cat(exact64), norm_type)
    strides = [p.grad.stride() for p in ps]
    total = ts.clip_by_global_norm(ps, 0.5, norm_type=norm_type)
    assert total.dtype == torch.float64
    torch.testing.assert_close(total, exact, rtol=1e-5, atol=0)
    coef = min(0.5 / (exact.item() + 1e-6), 1.0)
    for p, g64 in zip(ps, exact64):
        want = (g64 * coef).to(p.grad.dtype).reshape(p.shape)
        torch.testing.assert_close(p.grad, want, rtol=1e-5 if p.grad.dtype in
                                   (torch.float32, torch.float64) else 1e-2, atol=1e-6)
    assert [p.grad.stride() for p in ps] == strides


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf"), 3.0])
def test_clip_and_norm_fp32_fp64_layouts_match_torch(norm_type):
    def make():
        ps = _mixed_grads()
        return [p for p in ps if p.dtype in (torch.float32, torch.float64) and p.numel()]
    a, b = make(), make()
    n1 = ts.clip_by_global_norm(a, 0.5, norm_type=norm_type)
    n2 = torch.nn.utils.clip_grad_norm_(b, 0.5, norm_type=norm_type, foreach=False)
    torch.testing.assert_close(n1, n2)
    for p, q in zip(a, b):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(ts.global_norm([p.grad for p in b], norm_type=norm_type),
                               torch.nn.utils.get_total_norm([p.grad for p in b], norm_type))


def _layout_params(dtype):
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(3, 4, dtype=dtype)),
            nn.Parameter(torch.randn(4, 5, dtype=dtype).t()),
            nn.Parameter(torch.randn(0, 3, dtype=dtype)),
            nn.Parameter(torch.randn(2, 3, 4, 5, dtype=dtype).contiguous(
                memory_format=torch.channels_last)),
            nn.Parameter(torch.randn((), dtype=dtype))]


def _set_grads(ps, seed):
    torch.manual_seed(seed)
    for i, p in enumerate(ps):
        if i == 0:  # a transposed gradient for a contiguous parameter
            p.grad = torch.randn(p.shape[::-1], dtype=p.dtype).t()
        else:
            p.grad = torch.randn_like(p)


OPTS = [(ts.optim.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01,
                                             nesterov=True)),
        (ts.optim.AdamW, torch.optim.AdamW, dict(lr=0.1, weight_decay=0.1)),
        (ts.optim.AdamW, torch.optim.AdamW, dict(lr=0.1, weight_decay=0.1, amsgrad=True))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("cls, tcls, kw", OPTS, ids=["sgd", "adamw", "amsgrad"])
def test_optimizers_on_unusual_layouts_match_torch(cls, tcls, kw, dtype):
    a, b = _layout_params(dtype), _layout_params(dtype)
    ours, theirs = cls(a, **kw), tcls(b, foreach=False, **kw)
    for s in range(3):
        _set_grads(a, s)
        _set_grads(b, s)
        ours.step()
        theirs.step()
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        assert p.stride() == q.stride()
    for k, v in ours.state[a[3]].items():
        if k != "step":
            assert v.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("cls, tcls, kw", OPTS[:2], ids=["sgd", "adamw"])
def test_masked_clipped_optimizers_on_unusual_layouts(cls, tcls, kw):
    """Masks and max_grad_norm on channels_last / transposed / empty parameters: torch with
    clip_grad_norm_ and the masked-out elements (and their moments) put back by hand."""
    a, b = _layout_params(torch.float32), _layout_params(torch.float32)
    torch.manual_seed(5)
    masks = {p: torch.rand(p.shape) > 0.5 for p in a}
    ours = cls(a, masks=masks, max_grad_norm=1.0, **kw)
    theirs = tcls(b, foreach=False, **kw)
    for s in range(3):
        _set_grads(a, s)
        _set_grads(b, s)
        grads = [p.grad.clone() for p in a]
        ours.step()
        assert all(torch.equal(p.grad, g) for p, g in zip(a, grads))
        torch.nn.utils.clip_grad_norm_(b, 1.0)
        kept = [q.detach().clone() for q in b]
        theirs.step()
        with torch.no_grad():
            for p, q, w in zip(a, b, kept):
                off = ~masks[p]
                q[off] = w[off]
                for v in theirs.state[q].values():
                    if torch.is_tensor(v) and v.shape == q.shape:
                        v[off] = 0
        for p, q in zip(a, b):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_sgd_momentum_is_fp32_math_rounded_once(dtype):
    """docs/optimizers.md: each step computed in float32 from the stored values, rounded once;
    state in the parameter's dtype."""
    torch.manual_seed(0)
    ps = [nn.Parameter(torch.randn(64, 33).to(dtype)), nn.Parameter(torch.randn(7).to(dtype))]
    ref = [p.detach().clone() for p in ps]
    bufs = [None, None]
    lr, mom, wd = 0.01, 0.9, 0.1
    opt = ts.optim.SGD(ps, lr=lr, momentum=mom, weight_decay=wd)
    for s in range(4):
        torch.manual_seed(s)
        for i, p in enumerate(ps):
            p.grad = torch.randn(p.shape).to(dtype)
            g = p.grad.float() + wd * ref[i].float()
            buf = g if bufs[i] is None else mom * bufs[i].float() + g
            bufs[i] = buf.to(dtype)
            ref[i] = (ref[i].float() - lr * buf).to(dtype)
        opt.step()
        for p, r, buf in zip(ps, ref, bufs):
            assert opt.state[p]["momentum_buffer"].dtype == dtype
            torch.testing.assert_close(p.detach(), r, rtol=0, atol=float(torch.finfo(dtype).eps) * 4)
            torch.testing.assert_close(opt.state[p]["momentum_buffer"], buf, rtol=0,
                                       atol=float(torch.finfo(dtype).eps) * 8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_adamw_matches_torch_fused(dtype):
    torch.manual_seed(0)
    a = [nn.Parameter(torch.randn(64, 33).to(dtype)), nn.Parameter(torch.randn(7).to(dtype))]
    b = [nn.Parameter(p.detach().clone()) for p in a]
    ours = ts.optim.AdamW(a, lr=0.01, weight_decay=0.1)
    theirs = torch.optim.AdamW(b, lr=0.01, weight_decay=0.1, fused=True)
    for s in range(4):
        torch.manual_seed(s)
        for p, q in zip(a, b):
            p.grad = torch.randn(p.shape).to(dtype)
            q.grad = p.grad.clone()
        ours.step()
        theirs.step()
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=0, atol=float(torch.finfo(dtype).eps))
        assert ours.state[p]["exp_avg"].dtype == dtype


class WithInts(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.idx = nn.Parameter(torch.tensor([1, 0]), requires_grad=False)
        self.flag = nn.Parameter(torch.tensor([True, False]), requires_grad=False)
        self.register_buffer("count", torch.tensor(3, dtype=torch.int32))

    def forward(self, x):
        return self.lin(x)[..., self.idx]


def test_integer_and_bool_parameters():
    m = WithInts()
    x = torch.randn(3, 2)
    assert [n for n, _ in ts.trainable_parameters(m)] == ["lin.weight", "lin.bias"]
    assert ts.summary(m).counts == (6, 10)
    for call in (lambda: ts.unfreeze(m), lambda: ts.unfreeze(m, "idx")):
        with pytest.raises(ValueError, match="'idx'.*int64"):
            call()
    assert flags(m) == [False, False, True, True]
    with pytest.raises(ValueError, match="'idx'"):
        ts.structural_grad(m, lambda mm: mm(x).sum(), wrt="idx")
    with ts.freeze_except(m, "idx"):
        assert flags(m) == [False, False, False, False]
    assert flags(m) == [False, False, True, True]
    groups = ts.param_groups(m)
    assert sum(len(g["params"]) for g in groups) == 4
    opt = ts.optim.AdamW(groups, lr=0.1)
    m(x).sum().backward()
    before = (m.idx.clone(), m.flag.clone())
    opt.step()
    assert torch.equal(m.idx, before[0]) and torch.equal(m.flag, before[1])
    assert m.idx not in opt.state
    # the root owns no trainable parameter: its buffer is not in the checkpoint
    assert list(ts.state_dict(m)) == ["lin.weight", "lin.bias"]
    ts.load_state_dict(m, {"idx": torch.tensor([0, 1])}, strict=False)
    assert m.idx.tolist() == [0, 1]
    with pytest.raises(ValueError, match="'idx'.*float32.*int64"):
        ts.load_state_dict(m, {"idx": torch.tensor([0.0, 1.0])}, strict=False)
    vec, spec = ts.tree.flatten(ts.tree.from_module(m))
    assert vec.dtype == torch.float32 and spec.numel == 10


class WithEmpty(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            self.z = nn.Linear(3, 0)
        self.e = nn.Parameter(torch.empty(0))

    def forward(self, x):
        return torch.cat([self.a(x), self.z(x)], -1).sum() + self.e.sum()


def test_zero_element_parameters():
    m = WithEmpty()
    x = torch.randn(4, 3)
    grads = ts.tree.to_flat_dict(ts.structural_grad(m, lambda mm: mm(x)))
    assert {k: tuple(v.shape) for k, v in grads.items()} == {
        "e": (0,), "a.weight": (2, 3), "a.bias": (2,), "z.weight": (0, 3), "z.bias": (0,)}
    m(x).backward()
    for nt in (2.0, 1.0, float("inf"), 0.5):
        ours = [p.grad.clone() for p in m.parameters()]
        total = ts.clip_by_global_norm(m, 0.1, norm_type=nt)
        expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g in ours]), nt)
        torch.testing.assert_close(total, expected)
    e = nn.Parameter(torch.empty(0))
    e.grad = torch.empty(0)
    assert ts.clip_by_global_norm([e], 1.0, norm_type=float("inf")).item() == 0.0
    with pytest.raises(ValueError, match="'e'"):
        ts.structural_grad(m, lambda mm: mm.a(x).sum(), wrt="e")
    opt = ts.optim.AdamW(m.parameters(), masks={m.e: torch.zeros(0, dtype=torch.bool)})
    opt.step()
    with ts.swap(m, {"e": torch.empty(0), "z.weight": torch.empty(0, 3)}):
        m(x)
    state = ts.state_dict(m)
    assert ts.load_state_dict(m, {k: v.clone() for k, v in state.items()}).missing_keys == []
    assert ts.summary(m).counts == (8, 8)


# ----------------------------------------------------------------------------- sparse gradients

def test_sparse_gradients_refused_everywhere_nothing_changed():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1))
    idx = torch.tensor([1, 2, 2])
    m(idx).sum().backward()
    assert m[0].weight.grad.layout == torch.sparse_coo
    grads = [p.grad.clone() for p in m.parameters()]
    weights = [p.detach().clone() for p in m.parameters()]
    for call in (lambda: ts.global_norm(m), lambda: ts.clip_by_global_norm(m, 0.1),
                 lambda: ts.clip_by_global_norm(list(m.parameters()), 0.1),
                 lambda: ts.global_norm([m[0].weight.grad])):
        with pytest.raises(TypeError, match="sparse"):
            call()
    for cls, kw in ((ts.optim.SGD, dict(lr=0.1, momentum=0.9)), (ts.optim.AdamW, dict(lr=0.1))):
        opt = cls(m.parameters(), **kw)
        with pytest.raises(RuntimeError, match="sparse"):
            opt.step()
        assert len(opt.state) == 0
    assert all(torch.equal(a.to_dense(), p.grad.to_dense()) for a, p in zip(grads, m.parameters()))
    assert all(torch.equal(a, p) for a, p in zip(weights, m.parameters()))

    tree = ts.structural_grad(m, lambda mm: mm(idx).sum())
    assert tree["0"]["weight"].layout == torch.sparse_coo
    for call in (lambda: ts.global_norm(tree), lambda: ts.clip_by_global_norm(tree, 0.1)):
        with pytest.raises(TypeError, match="'0.weight'"):
            call()
    with pytest.raises(TypeError, match="'0.weight'"):
        ts.tree.flatten(tree)

    with ts.freeze(m, "0"):  # a frozen sparse parameter is skipped, as torch skips it
        dense = [p for p in m[1].parameters()]
        total = ts.clip_by_global_norm(m, 0.1)
        torch.testing.assert_close(
            total, torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads[1:]])))
        ts.optim.SGD(m.parameters(), lr=0.1).step()
    assert torch.equal(m[0].weight, weights[0])
    assert all(not torch.equal(p, w) for p, w in zip(dense, weights[1:]))


def test_sparse_embedding_bag_clip_refused():
    eb = nn.EmbeddingBag(10, 3, mode="sum", sparse=True)
    eb(torch.tensor([[1, 2], [3, 3]])).sum().backward()
    with pytest.raises(TypeError, match="'weight'.*sparse"):
        ts.clip_by_global_norm(eb, 0.1)


# ----------------------------------------------------------------------------- module zoo

def _gen(seed):
    return torch.Generator().manual_seed(seed)


ZOO = {
    "lstm": (lambda: nn.LSTM(3, 4, num_layers=2, proj_size=2, bidirectional=True),
             lambda m: m(torch.randn(5, 2, 3, generator=_gen(1)))[0].sum()),
    "gru": (lambda: nn.GRU(3, 4, batch_first=True),
            lambda m: m(torch.randn(2, 5, 3, generator=_gen(1)))[0].pow(2).sum()),
    "rnn": (lambda: nn.RNN(3, 4, nonlinearity="relu"),
            lambda m: m(torch.randn(5, 2, 3, generator=_gen(1)))[0].sum()),
    "mha_kdim": (lambda: nn.MultiheadAttention(3, 1, kdim=2, vdim=5),
                 lambda m: m(torch.randn(4, 1, 3, generator=_gen(1)),
                             torch.randn(2, 1, 2, generator=_gen(2)),
                             torch.randn(2, 1, 5, generator=_gen(3)))[0].sum()),
    "mha_bias_kv": (lambda: nn.MultiheadAttention(4, 2, add_bias_kv=True),
                    lambda m: m(*(3 * [torch.randn(3, 1, 4, generator=_gen(1))]))[0].pow(2).sum()),
    "bilinear": (lambda: nn.Bilinear(3, 3, 2),
                 lambda m: m(torch.randn(4, 3, generator=_gen(1)),
                             torch.randn(4, 3, generator=_gen(2))).sum()),
    "embedding_pad": (lambda: nn.Embedding(10, 3, padding_idx=0),
                      lambda m: m(torch.tensor([0, 1, 1, 5])).pow(2).sum()),
    "embedding_bag": (lambda: nn.EmbeddingBag(10, 3, mode="max"),
                      lambda m: m(torch.tensor([[0, 1], [1, 5]])).pow(2).sum()),
    "transformer": (lambda: nn.Transformer(d_model=4, nhead=2, num_encoder_layers=1,
                                           num_decoder_layers=1, dim_feedforward=8,
                                           dropout=0.0),
                    lambda m: m(torch.randn(3, 1, 4, generator=_gen(1)),
                                torch.randn(2, 1, 4, generator=_gen(2))).sum()),
    "conv_channels_last": (lambda: nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last),
                           lambda m: m(torch.randn(2, 3, 6, 6, generator=_gen(1)).to(
                               memory_format=torch.channels_last)).pow(2).sum()),
}


@pytest.mark.parametrize("name", list(ZOO))
def test_module_zoo_against_plain_pytorch(name):
    make, loss = ZOO[name]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        m = make()
    names = [n for n, _ in m.named_parameters()]

    fast = {n: (p.detach() * 1.1).requires_grad_() for n, p in m.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with ts.swap(m, fast):
            ours = loss(m)
        g_ours = torch.autograd.grad(ours, list(fast.values()))

        class Call(nn.Module):
            def forward(self, *a):
                return functional_call(m, fast, a)

        theirs = loss(Call())
        g_theirs = torch.autograd.grad(theirs, list(fast.values()))
        torch.testing.assert_close(ours, theirs)
        for a, b in zip(g_ours, g_theirs):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

        tree = ts.tree.to_flat_dict(ts.structural_grad(m, loss))
        ref = torch.autograd.grad(loss(m), list(m.parameters()))
        assert list(tree) == names
        for a, b in zip(tree.values(), ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

        half = names[::2] if len(names) > 1 else []
        twin = copy.deepcopy(m)
        with (ts.freeze(m, *half) if half else contextlib.nullcontext()):
            loss(m).backward()
        for n, p in twin.named_parameters():
            if n in half:
                p.requires_grad_(False)
        loss(twin).backward()
    for p, q in zip(m.parameters(), twin.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    total = ts.clip_by_global_norm(m, 0.1)
    expected = torch.nn.utils.clip_grad_norm_([q for q in twin.parameters() if q.grad is not None],
                                              0.1)
    torch.testing.assert_close(total, expected)
    for p, q in zip(m.parameters(), twin.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_mha_none_parameter_slots():
    mha = nn.MultiheadAttention(4, 2, kdim=3, vdim=5, bias=False)
    assert mha._parameters["in_proj_weight"] is None
    paths = ["q_proj_weight", "k_proj_weight", "v_proj_weight", "out_proj.weight"]
    assert [n for n, _ in ts.trainable_parameters(mha)] == paths
    with pytest.raises(ValueError, match="'in_proj_weight'.*closest"):
        ts.select(mha, "in_proj_weight")
    with pytest.raises(ValueError, match="'in_proj_weight'"):
        ts.swap(mha, {"in_proj_weight": torch.zeros(12, 4)})
    assert ts.summary(mha).counts == (64, 64)
    with ts.freeze(mha, "q_proj_weight"):
        assert flags(mha) == [False, True, True, True]
    assert all(flags(mha))
    groups = ts.param_groups(nn.MultiheadAttention(4, 2, add_bias_kv=True), weight_decay=0.1)
    assert groups[1]["param_names"] == ["in_proj_bias", "bias_k", "bias_v", "out_proj.bias"]


NORMS = {
    "bn_no_stats": lambda: nn.BatchNorm1d(4, track_running_stats=False),
    "bn_no_affine": lambda: nn.BatchNorm1d(4, affine=False),
    "bn_bare": lambda: nn.BatchNorm1d(4, affine=False, track_running_stats=False),
    "group": lambda: nn.GroupNorm(2, 4),
    "ln_no_affine": lambda: nn.LayerNorm(4, elementwise_affine=False),
    "ln_no_bias": lambda: nn.LayerNorm(4, bias=False),
    "rms": lambda: nn.RMSNorm(4),
    "rms_no_affine": lambda: nn.RMSNorm(4, elementwise_affine=False),
    "bn_cumulative": lambda: nn.BatchNorm1d(4, momentum=None),
    "sync_bn": lambda: nn.SyncBatchNorm(4),
}


@pytest.mark.parametrize("name", list(NORMS))
def test_frozen_norm_variants_against_twin(name):
    torch.manual_seed(0)
    norm = NORMS[name]()
    m = nn.Sequential(nn.Linear(3, 4), norm, nn.Linear(4, 2))
    twin = copy.deepcopy(m)
    x = torch.randn(6, 3)
    has_params = bool(list(norm.parameters()))
    held = has_params and getattr(norm, "track_running_stats", False)
    with ts.freeze(m, "1", "2") if has_params else ts.freeze(m, "2"):
        y = m(x)
        frozen_sd = list(ts.state_dict(m))
    for p in list(twin[1].parameters()) + list(twin[2].parameters()):
        p.requires_grad_(False)
    if held:
        twin[1].eval()
    torch.testing.assert_close(y, twin(x))
    assert all(torch.equal(a, b) for a, b in zip(m[1].buffers(), twin[1].buffers()))
    stats = [f"1.{n}" for n, _ in norm.named_buffers()]
    # a norm whose parameters are frozen is left out; one without parameters keeps its stats
    expected = ["0.weight", "0.bias"] + ([] if has_params else stats)
    assert frozen_sd == expected
    no_decay = [g for g in ts.param_groups(m, weight_decay=0.1) if g["weight_decay"] == 0.0]
    assert no_decay[0]["param_names"] == ["0.bias"] + [f"1.{n}" for n, _ in norm.named_parameters()] + ["2.bias"]


def test_instance_norm_with_running_stats_is_held():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv1d(3, 4, 1), nn.InstanceNorm1d(4, affine=True,
                                                           track_running_stats=True),
                      nn.Conv1d(4, 2, 1))
    twin = copy.deepcopy(m)
    x = torch.randn(6, 3, 5)
    with ts.freeze(m, "1"):
        y = m(x)
    twin[1].requires_grad_(False)
    twin[1].eval()
    torch.testing.assert_close(y, twin(x))
    assert torch.equal(m[1].running_mean, torch.zeros(4))


# ----------------------------------------------------------------------------- meta device

def _meta_model():
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def test_meta_model_reads_and_to_empty():
    m = _meta_model()
    assert ts.summary(m).counts == (34, 34)
    assert list(ts.state_dict(m))[:2] == ["0.weight", "0.bias"]
    with pytest.raises(ValueError, match="'0.weight'.*meta"):
        ts.load_state_dict(m, {"0.weight": torch.zeros(4, 3)}, strict=False)
    ts.freeze(m, "0")
    m.to_empty(device="cpu")
    assert flags(m) == [False, False, True, True, True, True]
    assert [n for n, _ in ts.trainable_parameters(m)] == ["1.weight", "1.bias", "2.weight",
                                                         "2.bias"]
    m(torch.randn(5, 3))
    assert flags(m) == [False, False, True, True, True, True]

    m = _meta_model()
    with ts.freeze(m, "2"):
        m.to_empty(device="cpu")
        assert all(p.device.type == "cpu" for p in m.parameters())
        assert flags(m) == [True, True, True, True, False, False]
        m(torch.randn(5, 3))
        assert flags(m) == [True, True, True, True, False, False]
    assert all(flags(m))


# ----------------------------------------------------------------------------- names and containers

class OddNames(nn.Module):
    NAMES = ["w[0]", "w0", "a*b", "q?", "sp ace", "\u00fc"]

    def __init__(self):
        super().__init__()
        for i, n in enumerate(self.NAMES):
            self.register_parameter(n, nn.Parameter(torch.full((2,), float(i + 1))))
        self.add_module("1", nn.Linear(2, 2))
        self.add_module("10", nn.Linear(2, 2))
        self.add_module("mod-x", nn.Linear(2, 2))

    def forward(self, x):
        out = sum(getattr(self, n) for n in self.NAMES) * x
        return out + getattr(self, "1")(x) + getattr(self, "10")(x) + getattr(self, "mod-x")(x)


def test_odd_parameter_and_module_names():
    m = OddNames()
    sel = lambda s: [p for p, _ in ts.select(m, s)]  # noqa: E731
    # strings are fnmatch globs (DESIGN.md): "[0]" is a character class
    assert sel("w[0]") == ["w0"]
    assert sel(re.compile(re.escape("w[0]"))) == ["w[0]"]
    assert sel("w[[]0]") == ["w[0]"]
    assert sel("a*b") == ["a*b"] and sel("q?") == ["q?"] and sel("sp ace") == ["sp ace"]
    assert sel("\u00fc") == ["\u00fc"]
    assert sel("1") == ["1.weight", "1.bias"]
    assert sel("mod-x") == ["mod-x.weight", "mod-x.bias"]
    odd = getattr(m, "w[0]")
    # exact paths where a path is a key: masks, swap, checkpoints
    opt = ts.optim.SGD(ts.param_groups(m), lr=0.1, masks={"w[0]": torch.tensor([True, False])})
    assert list(opt.masks) == [odd]
    x = torch.randn(3, 2)
    with ts.swap(m, {"w[0]": torch.zeros(2)}):
        swapped = m(x)
    twin = copy.deepcopy(m)
    with torch.no_grad():
        getattr(twin, "w[0]").zero_()
    torch.testing.assert_close(swapped, twin(x))
    ts.load_state_dict(m, {"w[0]": torch.full((2,), 9.0)}, strict=False)
    assert odd.tolist() == [9.0, 9.0] and getattr(m, "w0").tolist() == [2.0, 2.0]
    grads = ts.structural_grad(m, lambda mm: mm(x).sum(), wrt=odd)
    assert ts.tree.paths(grads) == ["w[0]"]
    ref, = torch.autograd.grad(m(x).sum(), odd)
    torch.testing.assert_close(grads["w[0]"], ref)
    with ts.freeze(m, odd, "10"):
        assert [n for n, p in m.named_parameters() if not p.requires_grad] == [
            "w[0]", "10.weight", "10.bias"]
    assert all(flags(m))
    text = str(ts.summary(m))
    assert "w[0]: (2,)" in text and "sp ace" in text and text.endswith("trainable 30 of 30, 100.00%")


class Containers(nn.Module):
    def __init__(self):
        super().__init__()
        self.plist = nn.ParameterList([nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(3))])
        self.pdict = nn.ParameterDict({"alpha": nn.Parameter(torch.ones(2)),
                                       "bias": nn.Parameter(torch.zeros(2))})
        self.md = nn.ModuleDict({"0a": nn.Linear(2, 2), "b": nn.LayerNorm(2)})

    def forward(self, x):
        h = x * self.plist[0] + self.pdict["alpha"] + self.pdict["bias"]
        return self.md["b"](self.md["0a"](h)).sum() + self.plist[1].sum()


def test_parameter_containers():
    m = Containers()
    x = torch.randn(2)
    groups = {g["name"]: g["param_names"] for g in ts.param_groups(m, weight_decay=0.1)}
    assert groups == {"default": ["plist.0", "plist.1", "pdict.alpha", "md.0a.weight"],
                      "default (no decay)": ["pdict.bias", "md.0a.bias", "md.b.weight",
                                             "md.b.bias"]}
    twin = copy.deepcopy(m)
    with ts.freeze_except(m, "plist.1", "pdict"):
        m(x).backward()
    keep = {"plist.1", "pdict.alpha", "pdict.bias"}
    for n, p in twin.named_parameters():
        p.requires_grad_(n in keep)
    twin(x).backward()
    for (n, p), q in zip(m.named_parameters(), twin.parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad)
    tree = ts.structural_grad(m, lambda mm: mm(x), wrt=["plist", "md.0a.weight"])
    assert ts.tree.paths(tree) == ["plist.0", "plist.1", "md.0a.weight"]
    assert set(tree["plist"]) == {"0", "1"}
    ts.freeze(m, "plist")
    m.plist.append(nn.Parameter(torch.ones(1)))
    m.pdict["new"] = nn.Parameter(torch.ones(1))
    m(x)
    assert {n: p.requires_grad for n, p in m.named_parameters()}["plist.2"] is False
    assert {n: p.requires_grad for n, p in m.named_parameters()}["pdict.new"] is True


class RootParams(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(3))
        self.b = nn.Parameter(torch.randn(3, dtype=torch.float64))

    def forward(self, x):
        return (x * self.a).sum() + self.b.sum()


def test_parameters_on_the_root_only():
    r = RootParams()
    r(torch.ones(3)).backward()
    total = ts.global_norm(r)
    assert total.dtype == torch.float64
    torch.testing.assert_close(total, torch.nn.utils.get_total_norm([r.a.grad, r.b.grad]))
    hold = holders_for([r.a.grad, r.b.grad])
    torch.testing.assert_close(ts.clip_by_global_norm(r, 0.1),
                               torch.nn.utils.clip_grad_norm_(hold, 0.1))
    torch.testing.assert_close(r.a.grad, hold[0].grad)
    torch.testing.assert_close(r.b.grad, hold[1].grad)
    assert list(ts.state_dict(r)) == ["a", "b"]
    tree = ts.structural_grad(r, lambda mm: mm(torch.ones(3)))
    assert set(tree) == {"a", "b"} and tree["b"].dtype == torch.float64
    with pytest.raises(ValueError, match="layers="):
        ts.layer_decay(r, 0.5)


def test_root_parameter_registered_after_a_bare_freeze_except():
    class R(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(2))
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            out = self.lin(x * self.w)
            extra = self._parameters.get("extra")
            return out if extra is None else out + extra

    m = R()
    ts.freeze_except(m, "lin")
    m.register_parameter("extra", nn.Parameter(torch.zeros(1)))
    m(torch.randn(3, 2))
    assert {n: p.requires_grad for n, p in m.named_parameters()} == {
        "w": False, "extra": False, "lin.weight": True, "lin.bias": True}


def test_child_named_trainable_is_not_a_declaration():
    class T(nn.Module):
        def __init__(self):
            super().__init__()
            self.trainable = nn.Linear(2, 2)
            self.frozen = nn.Linear(2, 2)

        def forward(self, x):
            return self.frozen(self.trainable(x))

    m = T()
    assert len(list(ts.trainable_parameters(m))) == 4
    ts.attach(m)
    m(torch.randn(3, 2))
    with ts.freeze(m, "frozen"):
        assert flags(m) == [True, True, False, False]
    assert all(flags(m))


def test_parameter_named_no_weight_decay_is_not_the_timm_method():
    class N(nn.Module):
        def __init__(self):
            super().__init__()
            self.no_weight_decay = nn.Parameter(torch.ones(2))
            self.lin = nn.Linear(2, 2)

    groups = ts.param_groups(N(), weight_decay=0.1)
    assert groups[0]["param_names"] == ["no_weight_decay", "lin.weight"]


def test_child_module_named_no_weight_decay():
    class N(nn.Module):
        def __init__(self):
            super().__init__()
            self.no_weight_decay = nn.Linear(2, 2)

    groups = ts.param_groups(N(), weight_decay=0.1)
    assert [g["param_names"] for g in groups] == [["no_weight_decay.weight"],
                                                  ["no_weight_decay.bias"]]


# ----------------------------------------------------------------------------- Parameter subclass

class Tagged(nn.Parameter):
    def __new__(cls, data, requires_grad=True, tag=None):
        p = super().__new__(cls, data, requires_grad)
        p.tag = tag
        return p


def _tagged_model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    m[0].weight = Tagged(m[0].weight.detach().clone(), tag="a")
    return m


def test_parameter_subclass_through_the_api():
    m = _tagged_model()
    twin = copy.deepcopy(m)
    x = torch.randn(5, 3)
    with ts.freeze(m, "1"):
        m(x).sum().backward()
    twin[1].requires_grad_(False)
    twin(x).sum().backward()
    for p, q in zip(m.parameters(), twin.parameters()):
        assert (p.grad is None) == (q.grad is None)
    torch.testing.assert_close(ts.clip_by_global_norm(list(m.parameters()), 0.1),
                               torch.nn.utils.clip_grad_norm_(list(twin.parameters()), 0.1))
    ours = ts.optim.AdamW(m.parameters(), lr=0.1)
    theirs = torch.optim.AdamW(twin.parameters(), lr=0.1, foreach=False)
    ours.step()
    theirs.step()
    for p, q in zip(m.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)
    assert type(m[0].weight) is Tagged and m[0].weight.tag == "a"
    with ts.swap(m, {"0.weight": torch.zeros(4, 3)}):
        y = m(x)
    torch.testing.assert_close(y, m[1](m[0].bias.expand(5, 4)))
    with ts.stop_gradient(m, "0.weight"):
        y = m(x).sum()
    assert [g is None for g in torch.autograd.grad(y, list(m.parameters()), allow_unused=True)] \
        == [True, False, False, False]
    with pytest.raises(RuntimeError, match="'0.weight'"):
        with ts.constant(m, "0"):
            with torch.no_grad():
                m[0].weight.add_(1)


def test_parameter_subclass_checkpoint_round_trip():
    m = _tagged_model()
    saved = {k: v.clone() + 1 for k, v in ts.state_dict(m).items()}
    ts.load_state_dict(m, saved)
    assert torch.equal(m[0].weight, saved["0.weight"])
    assert type(m[0].weight) is Tagged


# ----------------------------------------------------------------------------- checkpoints

def test_checkpoint_with_layouts_and_integer_buffers():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
            self.t = nn.Parameter(torch.randn(4, 5).t())
            self.h = nn.Parameter(torch.randn(3).half())
            self.d = nn.Parameter(torch.randn(2, dtype=torch.float64))
            self.cx = nn.Parameter(torch.randn(2, dtype=torch.complex64))
            self.register_buffer("ib", torch.tensor([1, 2], dtype=torch.int32))
            self.register_buffer("bb", torch.tensor([True]))

    m = M()
    state = ts.state_dict(m)
    assert list(state) == ["t", "h", "d", "cx", "ib", "bb", "c.weight", "c.bias"]
    new = {k: (~v if v.dtype == torch.bool else
               v + 1 if not (v.is_floating_point() or v.is_complex()) else
               torch.randn_like(v)).contiguous() for k, v in state.items()}
    assert ts.load_state_dict(m, new).missing_keys == []
    after = ts.state_dict(m)
    assert all(torch.equal(after[k], new[k]) for k in new)
    assert m.c.weight.is_contiguous(memory_format=torch.channels_last)
    assert m.t.stride() == (1, 5)
    bad = dict(new)
    bad["ib"] = bad["ib"].long()
    with pytest.raises(ValueError, match="'ib'.*int64.*int32"):
        ts.load_state_dict(m, bad)
    assert torch.equal(m.ib, new["ib"])
