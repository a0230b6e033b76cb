"""Clipping, global norms and the fused optimizers, tried as a suspicious PyTorch user would.

The promises (docs/clipping.md, docs/optimizers.md): ``ts.clip_by_global_norm`` is a drop-in for
``torch.nn.utils.clip_grad_norm_`` (same returned norm, same clipped gradients, bitwise where the
arithmetic is the same, within a tight tolerance where the accumulation differs);
``ts.optim.SGD`` / ``ts.optim.AdamW`` compute what ``torch.optim`` (foreach=False) computes, never
touch a frozen parameter, keep masked-out elements (and their state) bitwise, fold the clip into
the update without writing the gradients, work with ``torch.amp.GradScaler``, scale groups by
``lr_scale`` and keep their masks in ``state_dict``; bad input raises a clear error and leaves
gradients, parameters and optimizer state as they were. The compiled CPU kernels, the fallback
on PyTorch's own ops and the reference are tried where it matters (the ``backend`` fixture).

A test marked ``xfail(strict=True)`` reproduces a case that goes wrong today; its reason says
what happens and what is expected.
"""
import copy
import io
import math
import warnings

import pytest
import torch
from torch import nn

import torchstruct as ts
from _flags import NEEDS_NAMED_OPTIM

INF = float("inf")
NAN = float("nan")


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def holders(grads):
    """Fresh parameters whose ``.grad`` are copies of ``grads`` (None stays None)."""
    out = []
    for g in grads:
        if g is None:
            p = nn.Parameter(torch.zeros(2))
        else:
            p = nn.Parameter(torch.zeros(g.shape, dtype=g.dtype))
            p.grad = g.clone()
        out.append(p)
    return out


def clip_both(grads, *args, **kwargs):
    """(ours, theirs): (returned norm or exception, the gradients after) of
    ts.clip_by_global_norm and torch's clip_grad_norm_ on copies of ``grads``."""
    out = []
    for fn in (ts.clip_by_global_norm, torch.nn.utils.clip_grad_norm_):
        ps = holders(grads)
        try:
            result = fn(ps, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 -- compared below
            result = e
        out.append((result, [p.grad for p in ps]))
    return out


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.view(-1).view(torch.uint8) if a.numel() else a, b.view(-1).view(torch.uint8) if b.numel() else b)


def grads_of(dtypes, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(5,), (3, 4), (7,), (2, 3, 2)]
    return [(torch.randn(s, generator=g) * scale).to(d) for s, d in zip(shapes, dtypes)]


def snapshot(params, opt):
    """Bits of the parameters and of every state tensor (and the state's keys)."""
    ps = [p.detach().clone() for p in params]
    state = {id(p): {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
             for p, s in opt.state.items()}
    return ps, state


def assert_same_snapshot(a, b):
    (pa, sa), (pb, sb) = a, b
    assert len(pa) == len(pb) and all(same_bits(x, y) for x, y in zip(pa, pb))
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].keys() == sb[k].keys()
        for key in sa[k]:
            x, y = sa[k][key], sb[k][key]
            if torch.is_tensor(x):
                assert same_bits(x, y), key
            else:
                assert x == y, key


def data(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)) for _ in range(n)]


def small_net(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).to(dtype)


def train(model, opt, batches, *, clip=None, sched=None, maximize=False):
    for x, y in batches:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x.to(next(model.parameters()).dtype)),
                                      y.to(next(model.parameters()).dtype))
        (-loss if maximize else loss).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if sched is not None:
            sched.step()


def close(a_params, b_params, rtol=1e-6, atol=1e-7):
    for p, q in zip(a_params, b_params):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------
# clip_by_global_norm against torch.nn.utils.clip_grad_norm_
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("max_norm", [0.1, 100.0])
def test_clip_fp32_l2_is_the_correctly_rounded_norm(backend, max_norm):
    """fp32 and the 2-norm: torch combines per-tensor float32 norms, here partial sums are kept
    in float64 (documented), so the norm is within an ulp of the float64 norm (the fallback and
    the reference round it once; the compiled kernel may be one ulp off) and of torch's; the
    gradients are torch's to an ulp; nothing to clip keeps every bit."""
    grads = grads_of([torch.float32] * 4)
    (ours, g_ours), (theirs, g_theirs) = clip_both(grads, max_norm)
    exact = torch.linalg.vector_norm(torch.cat([g.double().flatten() for g in grads]))
    if backend == "compiled":
        torch.testing.assert_close(ours, exact.float(), rtol=2.5e-7, atol=0)
    else:
        assert same_bits(ours, exact.float())
    torch.testing.assert_close(ours, theirs, rtol=2.5e-7, atol=0)
    for a, b, g in zip(g_ours, g_theirs, grads):
        torch.testing.assert_close(a, b, rtol=2.5e-7, atol=0)
        if max_norm > 10:
            assert same_bits(a, g)


@pytest.mark.parametrize("norm_type", [1.0, 2.0, INF, 0.5, 3.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_clip_norm_types_match_torch(backend, norm_type, dtype):
    for max_norm in (0.05, 1e6):
        (ours, g_ours), (theirs, g_theirs) = clip_both(grads_of([dtype] * 4, seed=3), max_norm,
                                                       norm_type)
        assert ours.dtype == theirs.dtype == dtype and ours.shape == ()
        torch.testing.assert_close(ours, theirs, rtol=1e-6 if dtype == torch.float32 else 1e-12,
                                   atol=0)
        for a, b in zip(g_ours, g_theirs):
            torch.testing.assert_close(a, b, rtol=2e-6 if dtype == torch.float32 else 1e-12,
                                       atol=0)
        if max_norm > 1e3:  # nothing to clip: the gradients keep their bits
            assert all(same_bits(a, g) for a, g in zip(g_ours, grads_of([dtype] * 4, seed=3)))


@pytest.mark.parametrize("dtypes", [
    [torch.float16] * 4, [torch.bfloat16] * 4,
    [torch.float16, torch.bfloat16, torch.float32, torch.float64],
    [torch.float16, torch.bfloat16, torch.float16, torch.bfloat16],
])
@pytest.mark.parametrize("norm_type", [1.0, 2.0, INF, 3.0])
def test_clip_low_precision_and_mixed_dtypes(backend, dtypes, norm_type):
    """The returned dtype is torch's (the promotion of the gradient dtypes); the norm is
    accumulated in fp32 (fp64 with a float64 gradient), so it is the exact norm of the values,
    not torch's norm of per-tensor norms rounded to fp16 -- close to torch, exact against a
    float64 oracle."""
    grads = grads_of(dtypes, seed=5)
    (ours, g_ours), (theirs, g_theirs) = clip_both(grads, 0.1, norm_type)
    assert ours.dtype == theirs.dtype
    exact = torch.linalg.vector_norm(torch.cat([g.double().flatten() for g in grads]), norm_type)
    torch.testing.assert_close(ours.double(), exact.to(ours.dtype).double(), rtol=1e-6, atol=0)
    torch.testing.assert_close(ours.double(), theirs.double(), rtol=2e-2, atol=0)
    coef = min(0.1 / (exact.item() + 1e-6), 1.0)
    for g, a, b in zip(grads, g_ours, g_theirs):
        assert a.dtype == g.dtype
        torch.testing.assert_close(a.double(), (g.double() * coef).to(g.dtype).double(),
                                   rtol=1e-2, atol=1e-4)
        torch.testing.assert_close(a.double(), b.double(), rtol=2e-2, atol=1e-3)


def test_clip_fp16_overflow_accumulates_in_fp32(backend):
    """Per-element fp16 values whose sum of squares overflows fp16: torch's total is inf and
    it zeroes the gradients; here the total is exact (returned as inf in fp16, as torch reports
    it) and the gradients are clipped to the right norm, not zeroed (documented)."""
    grads = [torch.full((4,), 60000.0, dtype=torch.float16), torch.full((3,), -30000.0,
                                                                       dtype=torch.float16)]
    (ours, g_ours), (theirs, g_theirs) = clip_both(grads, 1.0)
    assert ours.dtype == theirs.dtype == torch.float16 and ours.item() == INF == theirs.item()
    clipped = torch.linalg.vector_norm(torch.cat([g.float() for g in g_ours]))
    assert abs(clipped.item() - 1.0) < 1e-2
    assert all(torch.isfinite(g).all() for g in g_ours)
    # and the raw norm in fp32: exact
    assert ts.global_norm(grads).item() == pytest.approx(math.sqrt(4 * 6e4 ** 2 + 3 * 3e4 ** 2),
                                                         rel=1e-6)
    # error_if_nonfinite: raises as torch does, gradients untouched
    ps = holders(grads)
    with pytest.raises(RuntimeError, match="non-finite"):
        ts.clip_by_global_norm(ps, 1.0, error_if_nonfinite=True)
    assert all(same_bits(p.grad, g) for p, g in zip(ps, grads))


@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_clip_nonfinite_like_torch(backend, value):
    grads = [torch.tensor([value, 1.0, -2.0]), torch.tensor([0.5])]
    (ours, g_ours), (theirs, g_theirs) = clip_both(grads, 1.0)
    assert same_bits(ours, theirs)
    for a, b in zip(g_ours, g_theirs):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    (ours, g_ours), (theirs, g_theirs) = clip_both(grads, 1.0, error_if_nonfinite=True)
    assert isinstance(ours, RuntimeError) and isinstance(theirs, RuntimeError)
    assert "non-finite" in str(ours) and "non-finite" in str(theirs)
    for a, g in zip(g_ours, grads):  # unchanged
        assert torch.equal(a.isnan(), g.isnan()) and torch.equal(a.nan_to_num(), g.nan_to_num())


def test_clip_max_norm_values(backend):
    g = [torch.tensor([3.0, 4.0])]
    for max_norm in (0.0, INF, torch.tensor(1.0), torch.tensor([1.0]), "1", 2):
        (ours, g_ours), (theirs, g_theirs) = clip_both(g, max_norm)
        assert same_bits(ours, theirs) and same_bits(g_ours[0], g_theirs[0]), max_norm
    # negative or NaN: torch flips / NaNs the gradients; here a ValueError, nothing written
    for max_norm in (-1.0, NAN, torch.tensor(-0.5)):
        (ours, g_ours), _ = clip_both(g, max_norm)
        assert isinstance(ours, ValueError) and "max_norm" in str(ours)
        assert same_bits(g_ours[0], g[0])


def test_clip_norm_type_outside_the_contract_raises(backend):
    """torch accepts -inf (the smallest |g|) and 0 (a count); the contract offers p > 0 and inf
    only, so those raise ValueError (never a different norm), gradients untouched."""
    for norm_type in (-INF, 0, -1.0, NAN):
        (ours, g_ours), _ = clip_both([torch.tensor([3.0, 4.0])], 1.0, norm_type)
        assert isinstance(ours, ValueError) and "norm_type" in str(ours)
        assert torch.equal(g_ours[0], torch.tensor([3.0, 4.0]))
        with pytest.raises(ValueError, match="norm_type"):
            ts.global_norm([torch.ones(2)], norm_type)


def test_clip_inputs_like_torch(backend):
    # the empty list, None gradients, all None
    assert same_bits(ts.clip_by_global_norm([], 1.0), torch.nn.utils.clip_grad_norm_([], 1.0))
    (ours, g_ours), (theirs, g_theirs) = clip_both([None, torch.tensor([3.0, 4.0]), None], 1.0)
    assert same_bits(ours, theirs) and g_ours[0] is None and same_bits(g_ours[1], g_theirs[1])
    (ours, _), (theirs, _) = clip_both([None], 1.0)
    assert same_bits(ours, theirs)
    # a single tensor
    p = holders([torch.tensor([3.0, 4.0])])[0]
    assert ts.clip_by_global_norm(p, 1.0).item() == 5.0
    torch.testing.assert_close(p.grad, torch.tensor([0.6, 0.8]))
    # a generator is consumed once; an empty one warns as torch does
    p = holders([torch.tensor([3.0, 4.0])])[0]
    assert ts.clip_by_global_norm((q for q in [p]), 1.0).item() == 5.0
    torch.testing.assert_close(p.grad, torch.tensor([0.6, 0.8]))
    with pytest.warns(UserWarning, match="empty generator"):
        assert ts.clip_by_global_norm((q for q in []), 1.0).item() == 0.0
    # foreach= is accepted (and makes no difference)
    for foreach in (None, True, False):
        (ours, g_ours), (theirs, g_theirs) = clip_both([torch.tensor([3.0, 4.0])], 1.0,
                                                       foreach=foreach)
        assert same_bits(ours, theirs) and same_bits(g_ours[0], g_theirs[0])


def test_clip_duplicates_counted_as_listed(backend):
    """A parameter listed twice counts twice and is scaled twice, exactly as torch does."""
    p, q = holders([torch.tensor([3.0, 4.0])] * 2)
    a = ts.clip_by_global_norm([p, p], 1.0)
    b = torch.nn.utils.clip_grad_norm_([q, q], 1.0)
    assert same_bits(a, b) and same_bits(p.grad, q.grad)


def test_clip_gradients_sharing_memory_like_torch(backend):
    """One gradient tensor held by two parameters, or overlapping views: counted and scaled as
    listed, exactly as torch does it."""
    for make in (lambda: (lambda g: (g, g))(torch.tensor([3.0, 4.0])),
                 lambda: (lambda b: (b[:2], b[1:]))(torch.tensor([3.0, 4.0, 12.0]))):
        results = []
        for fn in (ts.clip_by_global_norm, torch.nn.utils.clip_grad_norm_):
            g1, g2 = make()
            p, q = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
            p.grad, q.grad = g1, g2
            results.append((fn([p, q], 1.0), p.grad.clone(), q.grad.clone()))
        (n1, a1, b1), (n2, a2, b2) = results
        torch.testing.assert_close(n1, n2, rtol=2.5e-7, atol=0)
        torch.testing.assert_close(a1, a2, rtol=2.5e-7, atol=0)
        torch.testing.assert_close(b1, b2, rtol=2.5e-7, atol=0)


def test_clip_strided_and_zero_size_gradients(backend):
    base = torch.randn(6, 8, generator=torch.Generator().manual_seed(2))
    grads = [base.t(), base[::2, ::3], torch.zeros(0), torch.zeros(3, 0)]
    outside = base[1::2].clone()
    (ours, g_ours), (theirs, g_theirs) = clip_both(grads, 0.5)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    for a, b in zip(g_ours, g_theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
    # in place on the views themselves: the rest of the base is untouched
    p = nn.Parameter(torch.zeros(3, 3))
    p.grad = base[::2, ::3]
    ts.clip_by_global_norm([p], 0.5)
    assert torch.equal(base[1::2], outside)
    assert torch.linalg.vector_norm(base[::2, ::3]).item() == pytest.approx(0.5, rel=1e-5)


def test_clip_zero_size_inf_norm(backend):
    """torch refuses the inf-norm of an empty gradient; here it contributes nothing (doc)."""
    (ours, g_ours), (theirs, _) = clip_both([torch.zeros(0), torch.tensor([3.0, -4.0])], 1.0, INF)
    assert isinstance(theirs, RuntimeError)
    assert ours.item() == 4.0
    torch.testing.assert_close(g_ours[1], torch.tensor([3.0, -4.0]) / (4.0 + 1e-6))


def test_clip_bad_entries_change_nothing(backend):
    good = holders([torch.tensor([3.0, 4.0])])[0]
    sparse = nn.Parameter(torch.zeros(3))
    sparse.grad = torch.tensor([1.0, 0.0, 2.0]).to_sparse()
    cases = [([good, sparse], TypeError, "sparse"), ([good, 3], TypeError, "int"),
             ("abc", TypeError, "str"), (None, TypeError, "NoneType")]
    for params, error, word in cases:
        with pytest.raises(error, match=word):
            ts.clip_by_global_norm(params, 0.1)
        assert torch.equal(good.grad, torch.tensor([3.0, 4.0]))
    expanded = nn.Parameter(torch.zeros(3, 4))
    expanded.grad = torch.ones(4).expand(3, 4)
    with pytest.raises(RuntimeError, match="share memory"):
        ts.clip_by_global_norm([good, expanded], 0.1)
    assert torch.equal(good.grad, torch.tensor([3.0, 4.0]))
    for bad in (torch.tensor([3, 4]), torch.tensor([3 + 1j, 4])):
        tree = {"a": torch.tensor([3.0, 4.0]), "b": bad}
        with pytest.raises(TypeError, match="dtype"):
            ts.clip_by_global_norm(tree, 0.1)
        assert torch.equal(tree["a"], torch.tensor([3.0, 4.0]))


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        return self.head(torch.tanh(self.body(self.embed(x))))


def test_clip_model_trainable_tied_once(backend):
    torch.manual_seed(0)
    lm = TiedLM()
    lm(torch.tensor([1, 2, 3])).logsumexp(-1).sum().backward()
    with ts.freeze(lm, "body.weight"):
        frozen = lm.body.weight.grad.clone()
        trainable = [lm.embed.weight, lm.body.bias]
        ref = holders([p.grad for p in trainable])
        expected = torch.nn.utils.clip_grad_norm_(ref, 1e-2)
        torch.testing.assert_close(ts.global_norm(lm), expected, rtol=2.5e-7, atol=0)
        total = ts.clip_by_global_norm(lm, 1e-2)
    torch.testing.assert_close(total, expected, rtol=2.5e-7, atol=0)
    assert torch.equal(lm.body.weight.grad, frozen)
    for p, r in zip(trainable, ref):
        torch.testing.assert_close(p.grad, r.grad, rtol=2.5e-7, atol=0)


def test_clip_trees_and_flat_dicts(backend):
    shared = torch.tensor([3.0, 0.0])
    tree = {"a": {"w": shared, "b": None}, "c": {"d": shared}, "e": torch.tensor([4.0]), "f": {}}
    assert ts.global_norm(tree).item() == 5.0
    assert ts.clip_by_global_norm(tree, 1.0).item() == 5.0  # the shared tensor once
    torch.testing.assert_close(shared, torch.tensor([0.6, 0.0]))
    torch.testing.assert_close(tree["e"], torch.tensor([0.8]))
    flat = {"0.weight": torch.tensor([3.0]), "1.bias": torch.tensor([4.0])}
    assert ts.clip_by_global_norm(flat, 1.0).item() == 5.0
    torch.testing.assert_close(flat["1.bias"], torch.tensor([0.8]))
    with pytest.raises(TypeError, match="'b'"):
        ts.clip_by_global_norm({"a": torch.ones(2), "b": 3.0}, 1.0)


def test_clip_structural_grad_tree_against_torch(backend):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(5, 4)
    grads = ts.structural_grad(model, lambda m: m(x).pow(2).sum())
    leaves = [grads["0"]["weight"], grads["0"]["bias"], grads["2"]["weight"], grads["2"]["bias"]]
    ref = holders(leaves)
    expected = torch.nn.utils.clip_grad_norm_(ref, 0.1)
    torch.testing.assert_close(ts.clip_by_global_norm(grads, 0.1), expected, rtol=2.5e-7, atol=0)
    for a, r in zip(leaves, ref):
        torch.testing.assert_close(a, r.grad, rtol=2.5e-7, atol=0)


def test_alias_and_global_norm_dtypes():
    assert ts.clip_grad_norm_ is ts.clip_by_global_norm
    assert ts.global_norm([]).item() == 0.0
    assert ts.global_norm([torch.ones(4, dtype=torch.bfloat16)]).dtype == torch.float32
    assert ts.global_norm([torch.ones(4), torch.ones(1, dtype=torch.float64)]).dtype == \
        torch.float64
    with pytest.raises(TypeError, match="element 1"):
        ts.global_norm([torch.ones(2), None])


# ---------------------------------------------------------------------------
# optimizers against torch.optim (foreach=False)
# ---------------------------------------------------------------------------

SGD_OPTIONS = [dict(), dict(momentum=0.9), dict(momentum=0.9, dampening=0.3),
               dict(momentum=0.9, nesterov=True), dict(momentum=0.9, weight_decay=0.1),
               dict(momentum=0.8, weight_decay=0.01, maximize=True),
               dict(weight_decay=0.1, maximize=True)]
ADAMW_OPTIONS = [dict(), dict(amsgrad=True), dict(weight_decay=0.1, betas=(0.8, 0.95)),
                 dict(maximize=True), dict(amsgrad=True, maximize=True, weight_decay=0.0),
                 dict(eps=0.0), dict(eps=1e-3, weight_decay=0.5)]


@pytest.mark.parametrize("options", SGD_OPTIONS, ids=str)
def test_sgd_matches_torch(backend, options):
    """30 steps: bitwise with the compiled kernels and the reference (documented), 1e-6 rel on
    torch's fused op (the fallback)."""
    a, b = small_net(), small_net()
    oa = ts.optim.SGD(a.parameters(), lr=0.05, **options)
    ob = torch.optim.SGD(b.parameters(), lr=0.05, foreach=False, **options)
    batches = data(30)
    train(a, oa, batches, maximize=options.get("maximize", False))
    train(b, ob, batches, maximize=options.get("maximize", False))
    if backend == "fallback":
        close(a.parameters(), b.parameters())
    else:
        assert all(same_bits(p, q) for p, q in zip(a.parameters(), b.parameters()))
    if options.get("momentum"):
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(oa.state[p]["momentum_buffer"],
                                       ob.state[q]["momentum_buffer"], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("options", ADAMW_OPTIONS, ids=str)
def test_adamw_matches_torch(backend, options):
    a, b = small_net(), small_net()
    oa = ts.optim.AdamW(a.parameters(), lr=0.01, **options)
    ob = torch.optim.AdamW(b.parameters(), lr=0.01, foreach=False, **options)
    batches = data(30)
    train(a, oa, batches, maximize=options.get("maximize", False))
    train(b, ob, batches, maximize=options.get("maximize", False))
    close(a.parameters(), b.parameters())
    for p, q in zip(a.parameters(), b.parameters()):
        assert float(oa.state[p]["step"]) == float(ob.state[q]["step"]) == 30
        torch.testing.assert_close(oa.state[p]["exp_avg"], ob.state[q]["exp_avg"], rtol=1e-5,
                                   atol=1e-8)


def test_float64_and_tensor_lr_match_torch(backend):
    a, b = small_net(dtype=torch.float64), small_net(dtype=torch.float64)
    oa = ts.optim.AdamW(a.parameters(), lr=0.01, amsgrad=True)
    ob = torch.optim.AdamW(b.parameters(), lr=0.01, amsgrad=True, foreach=False)
    batches = data(15)
    train(a, oa, batches)
    train(b, ob, batches)
    close(a.parameters(), b.parameters(), rtol=1e-12, atol=1e-14)
    for cls, kw in ((ts.optim.SGD, dict(momentum=0.9)), (ts.optim.AdamW, dict())):
        a, b = small_net(), small_net()
        oa = cls(a.parameters(), lr=torch.tensor(0.02), **kw)
        ob = getattr(torch.optim, cls.__name__)(b.parameters(), lr=torch.tensor(0.02),
                                                foreach=False, **kw)
        sa = torch.optim.lr_scheduler.ExponentialLR(oa, 0.9)
        sb = torch.optim.lr_scheduler.ExponentialLR(ob, 0.9)
        train(a, oa, batches, sched=sa)
        train(b, ob, batches, sched=sb)
        close(a.parameters(), b.parameters())


def test_undocumented_torch_options_raise():
    """Options torch offers and these optimizers do not: a TypeError naming them, never silently
    ignored."""
    p = nn.Parameter(torch.ones(2))
    for cls in (ts.optim.SGD, ts.optim.AdamW):
        for option in ("foreach", "fused", "capturable", "differentiable",
                       "decoupled_weight_decay"):
            with pytest.raises(TypeError, match=option):
                cls([p], lr=0.1, **{option: True})


@pytest.mark.parametrize("cls", [ts.optim.SGD, ts.optim.AdamW])
def test_complex_and_integer_parameters(cls):
    c = nn.Parameter(torch.ones(2, dtype=torch.complex64))
    with pytest.raises(TypeError, match="complex"):
        cls([c], lr=0.1)
    opt = cls([nn.Parameter(torch.ones(2))], lr=0.1)
    with pytest.raises(TypeError, match="complex"):
        opt.add_param_group({"params": [c]})
    assert len(opt.param_groups) == 1


# ---------------------------------------------------------------------------
# the frozen rule, masks
# ---------------------------------------------------------------------------

OPTIMIZERS = [(ts.optim.SGD, dict(momentum=0.9, weight_decay=0.5, dampening=0.1)),
              (ts.optim.AdamW, dict(weight_decay=0.5, amsgrad=True))]


@pytest.mark.parametrize("cls,options", OPTIMIZERS, ids=["SGD", "AdamW"])
def test_frozen_with_stale_grad_untouched_and_out_of_the_norm(backend, cls, options):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    opt = cls(m.parameters(), lr=0.1, max_grad_norm=0.5, **options)
    m(torch.randn(4, 3)).sum().backward()
    m[0].weight.requires_grad_(False)  # frozen with a stale .grad
    w = m[0].weight.detach().clone()
    grads = [p.grad.clone() for p in m.parameters()]
    opt.step()
    assert same_bits(m[0].weight.detach(), w) and m[0].weight not in opt.state
    assert set(opt.state) == {m[0].bias, m[1].weight, m[1].bias}
    expected = torch.linalg.vector_norm(torch.cat([g.flatten() for i, g in enumerate(grads)
                                                   if i != 0]))
    torch.testing.assert_close(opt.last_grad_norm, expected)
    assert all(torch.equal(p.grad, g) for p, g in zip(m.parameters(), grads))  # never written
    # frozen again after it has state: its state keeps its bits too
    m[0].weight.requires_grad_(True)
    opt.step()
    assert m[0].weight in opt.state
    before = snapshot([m[0].weight], opt)[1][id(m[0].weight)]
    w = m[0].weight.detach().clone()
    m[0].weight.requires_grad_(False)
    opt.step()
    assert same_bits(m[0].weight.detach(), w)
    for k, v in opt.state[m[0].weight].items():
        assert same_bits(v, before[k])


@pytest.mark.parametrize("cls,options", OPTIMIZERS + [(ts.optim.SGD, dict(weight_decay=0.5))],
                         ids=["SGD", "AdamW", "SGD-plain"])
def test_masked_elements_keep_their_bits(backend, cls, options):
    torch.manual_seed(0)
    emb = nn.Embedding(6, 3)
    mask = torch.zeros(6, 3, dtype=torch.bool)
    mask[4:] = True
    mask[0, 1] = True
    opt = cls(emb.parameters(), lr=0.1, masks={emb.weight: mask}, max_grad_norm=0.5, **options)
    w = emb.weight.detach().clone()
    for _ in range(4):
        opt.zero_grad()
        emb(torch.tensor([0, 1, 4, 5])).pow(2).sum().backward()
        opt.step()
    keep = ~mask
    assert same_bits(emb.weight.detach()[keep], w[keep])
    assert not torch.equal(emb.weight.detach()[mask], w[mask])
    for key, value in opt.state[emb.weight].items():
        if value.dim():
            assert value[keep].eq(0).all() and value[keep].signbit().logical_not().all(), key


@pytest.mark.parametrize("cls,options", OPTIMIZERS, ids=["SGD", "AdamW"])
def test_masked_in_elements_follow_torch(backend, cls, options):
    """Fixed gradients (not depending on the parameters): the trained elements are torch's."""
    g = torch.Generator().manual_seed(4)
    start = torch.randn(4, 5, generator=g)
    mask = torch.rand(4, 5, generator=g) > 0.4
    p, q = nn.Parameter(start.clone()), nn.Parameter(start.clone())
    ours = cls([p], lr=0.05, masks={p: mask}, **options)
    theirs = getattr(torch.optim, cls.__name__)([q], lr=0.05, foreach=False, **options)
    for _ in range(10):
        grad = torch.randn(4, 5, generator=g)
        p.grad, q.grad = grad.clone(), grad.clone()
        ours.step()
        theirs.step()
    torch.testing.assert_close(p.detach()[mask], q.detach()[mask], rtol=1e-6, atol=1e-7)
    assert same_bits(p.detach()[~mask], start[~mask])


@NEEDS_NAMED_OPTIM
def test_mask_errors_change_nothing(backend):
    torch.manual_seed(0)
    m = nn.Linear(3, 2)
    good = torch.ones(2, 3, dtype=torch.bool)
    opt = ts.optim.AdamW(m.parameters(), lr=0.1, masks={m.weight: good})
    m(torch.randn(2, 3)).sum().backward()
    opt.step()
    m(torch.randn(2, 3)).sum().backward()
    for bad, word in ((torch.ones(3, 2, dtype=torch.bool), "shape"),
                      (torch.ones(2, 3), "dtype"), (torch.ones(2, 3, dtype=torch.uint8), "dtype"),
                      (torch.ones(2, 3, dtype=torch.bool, device="meta"), "meta"),
                      ([[True] * 3] * 2, "list")):
        with pytest.raises(ValueError, match=word):
            ts.optim.AdamW(m.parameters(), masks={m.weight: bad})
        with pytest.raises(ValueError, match=word):
            opt.set_mask(m.weight, bad)
        assert opt.masks[m.weight] is good
        before = snapshot(m.parameters(), opt)
        opt.masks[m.weight] = bad  # written by hand: refused at step, nothing changes
        with pytest.raises(ValueError, match=word):
            opt.step()
        assert_same_snapshot(before, snapshot(m.parameters(), opt))
        opt.masks[m.weight] = good
    with pytest.raises(ValueError, match="not a parameter of this optimizer"):
        ts.optim.SGD([m.weight], lr=0.1, masks={m.bias: torch.ones(2, dtype=torch.bool)})
    with pytest.raises(ValueError, match="closest: 'weight'"):
        ts.optim.SGD(m.named_parameters(), lr=0.1, masks={"weigth": good})


# ---------------------------------------------------------------------------
# max_grad_norm, GradScaler, lr_scale
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("cls,options", OPTIMIZERS, ids=["SGD", "AdamW"])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, INF])
def test_max_grad_norm_is_clip_then_step(backend, cls, options, norm_type):
    a, b = small_net(), small_net()
    oa = cls(a.parameters(), lr=0.05, max_grad_norm=0.05, norm_type=norm_type, **options)
    ob = getattr(torch.optim, cls.__name__)(b.parameters(), lr=0.05, foreach=False, **options)
    for x, y in data(10):
        for net, opt in ((a, oa), (b, ob)):
            opt.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
        grads = [p.grad.clone() for p in a.parameters()]
        total = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.05, norm_type)
        oa.step()
        ob.step()
        assert all(same_bits(p.grad, g) for p, g in zip(a.parameters(), grads))
        torch.testing.assert_close(oa.last_grad_norm, total, rtol=1e-6, atol=0)
    close(a.parameters(), b.parameters())


def scaled_run(cls, options, model, opt, batches, inf_at=(), clip=None):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=3)
    for i, (x, y) in enumerate(batches):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        if i in inf_at:
            model[0].weight.grad[0, 0] = INF
        if clip is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
    return scaler


@pytest.mark.parametrize("cls,options", OPTIMIZERS, ids=["SGD", "AdamW"])
def test_grad_scaler_with_autocast_matches_torch(backend, cls, options):
    a, b = small_net(), small_net()
    oa = cls(a.parameters(), lr=0.02, **options)
    ob = getattr(torch.optim, cls.__name__)(b.parameters(), lr=0.02, foreach=False, **options)
    batches = data(9)
    sa = scaled_run(cls, options, a, oa, batches, inf_at=(0, 4))
    sb = scaled_run(cls, options, b, ob, batches, inf_at=(0, 4))
    assert sa.get_scale() == sb.get_scale()
    close(a.parameters(), b.parameters())
    if cls is ts.optim.AdamW:
        assert float(oa.state[a[0].weight]["step"]) == 7
    # the unscale_ + clip recipe
    a, b = small_net(), small_net()
    oa = cls(a.parameters(), lr=0.02, **options)
    ob = getattr(torch.optim, cls.__name__)(b.parameters(), lr=0.02, foreach=False, **options)
    scaled_run(cls, options, a, oa, batches, inf_at=(2,), clip=0.1)
    scaled_run(cls, options, b, ob, batches, inf_at=(2,), clip=0.1)
    close(a.parameters(), b.parameters())


@pytest.mark.parametrize("cls,options", OPTIMIZERS, ids=["SGD", "AdamW"])
def test_found_inf_skips_bitwise_with_masks_and_clip(backend, cls, options):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    mask = torch.rand(6, 4) > 0.5
    opt = cls(m.parameters(), lr=0.05, masks={m[0].weight: mask}, max_grad_norm=0.3, **options)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for i, (x, y) in enumerate(data(4)):
        opt.zero_grad()
        scaler.scale(nn.functional.mse_loss(m(x), y)).backward()
        if i == 3:
            m[2].bias.grad[0] = NAN
            before = snapshot(m.parameters(), opt)
            grads = [p.grad.clone() for p in m.parameters()]
        scaler.step(opt)
        scaler.update()
    assert_same_snapshot(before, snapshot(m.parameters(), opt))
    for p, g in zip(m.parameters(), grads):
        assert torch.equal(p.grad.isnan(), g.isnan()) and torch.equal(p.grad.nan_to_num(),
                                                                       g.nan_to_num())


def test_first_step_skipped_creates_no_state(backend):
    for cls, options in OPTIMIZERS:
        torch.manual_seed(0)
        m = nn.Linear(3, 2)
        opt = cls(m.parameters(), lr=0.1, **options)
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(m(torch.randn(2, 3)).sum()).backward()
        m.bias.grad[0] = INF
        w = m.weight.detach().clone()
        scaler.step(opt)
        assert len(opt.state) == 0 and same_bits(m.weight.detach(), w)


@pytest.mark.parametrize("cls,options", OPTIMIZERS, ids=["SGD", "AdamW"])
def test_lr_scale(backend, cls, options):
    """lr_scale=0: bitwise unchanged, no state, not in the norm; 0.25: torch with lr/4 under
    any scheduler (the ratio survives)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    opt = cls([{"params": m[0].parameters(), "lr_scale": 0}, {"params": m[1].parameters()}],
              lr=0.1, max_grad_norm=1.0, **options)
    m(torch.randn(2, 3)).sum().backward()
    w = [p.detach().clone() for p in m[0].parameters()]
    opt.step()
    assert all(same_bits(p.detach(), q) for p, q in zip(m[0].parameters(), w))
    assert not any(p in opt.state for p in m[0].parameters())
    expected = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in m[1].parameters()]))
    torch.testing.assert_close(opt.last_grad_norm, expected)

    a, b = small_net(), small_net()
    oa = cls([{"params": a.parameters(), "lr_scale": 0.25}], lr=0.08, **options)
    ob = getattr(torch.optim, cls.__name__)(b.parameters(), lr=0.02, foreach=False, **options)
    sa = torch.optim.lr_scheduler.CosineAnnealingLR(oa, 12)
    sb = torch.optim.lr_scheduler.CosineAnnealingLR(ob, 12)
    batches = data(8)
    train(a, oa, batches, sched=sa)
    train(b, ob, batches, sched=sb)
    assert oa.param_groups[0]["lr_scale"] == 0.25
    assert oa.param_groups[0]["lr"] * 0.25 == pytest.approx(ob.param_groups[0]["lr"], rel=1e-12)
    close(a.parameters(), b.parameters())


# ---------------------------------------------------------------------------
# state_dict, add_param_group, zero_grad
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("cls,options", [
    (ts.optim.SGD, dict(momentum=0.9, weight_decay=0.1, nesterov=True)),
    (ts.optim.SGD, dict(momentum=0.9, dampening=0.5)),
    (ts.optim.AdamW, dict(amsgrad=True, weight_decay=0.1)),
], ids=["SGD-nesterov", "SGD-dampening", "AdamW"])
def test_resume_from_state_dict_is_bitwise(backend, cls, options):
    """Save after 4 steps (masks, a scheduler, the clip), load into a fresh model and a fresh
    optimizer built without masks: the rest of the run equals the uninterrupted one, bitwise."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    mask = torch.rand(5, 4) > 0.3
    batches = data(10)

    def fresh(net, masks):
        opt = cls(net.parameters(), lr=0.05, masks=masks, max_grad_norm=0.5, **options)
        return opt, torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)

    full = copy.deepcopy(model)
    opt, sched = fresh(full, {full[0].weight: mask})
    train(full, opt, batches, sched=sched)

    part = copy.deepcopy(model)
    opt_p, sched_p = fresh(part, {part[0].weight: mask})
    train(part, opt_p, batches[:4], sched=sched_p)
    buffer = io.BytesIO()
    torch.save({"model": part.state_dict(), "opt": opt_p.state_dict(),
                "sched": sched_p.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert set(saved["opt"]["masks"]) == {0}

    resumed = copy.deepcopy(model)
    resumed.load_state_dict(saved["model"])
    opt_r, sched_r = fresh(resumed, None)
    opt_r.load_state_dict(saved["opt"])
    sched_r.load_state_dict(saved["sched"])
    assert torch.equal(opt_r.masks[resumed[0].weight], mask)
    train(resumed, opt_r, batches[4:], sched=sched_r)
    assert all(same_bits(p, q) for p, q in zip(full.parameters(), resumed.parameters()))
    for p, q in zip(full.parameters(), resumed.parameters()):
        for key, value in opt.state[p].items():
            assert same_bits(value, opt_r.state[q][key]), key


def test_state_dict_interchange_with_torch(backend):
    torch.manual_seed(0)
    a = nn.Linear(3, 2)
    b = copy.deepcopy(a)
    theirs = torch.optim.AdamW(b.parameters(), lr=0.1, amsgrad=True, foreach=False)
    train_steps = [torch.randn(2, 3) for _ in range(6)]
    for x in train_steps[:3]:
        theirs.zero_grad()
        b(x).pow(2).sum().backward()
        theirs.step()
    a.load_state_dict(b.state_dict())
    ours = ts.optim.AdamW(a.parameters(), lr=0.1, amsgrad=True)
    ours.load_state_dict(copy.deepcopy(theirs.state_dict()))
    for x in train_steps[3:]:
        for net, opt in ((a, ours), (b, theirs)):
            opt.zero_grad()
            net(x).pow(2).sum().backward()
            opt.step()
    close(a.parameters(), b.parameters())
    back = torch.optim.AdamW(b.parameters(), lr=0.1, amsgrad=True, foreach=False)
    back.load_state_dict(copy.deepcopy(ours.state_dict()))  # torch ignores "masks"
    assert float(back.state[b.weight]["step"]) == 6


def test_bad_state_dict_changes_nothing():
    torch.manual_seed(0)
    m = nn.Linear(3, 2)
    opt = ts.optim.AdamW(m.parameters(), lr=0.1, masks={m.weight: torch.ones(2, 3,
                                                                                dtype=torch.bool)})
    m(torch.randn(2, 3)).sum().backward()
    opt.step()
    good = copy.deepcopy(opt.state_dict())
    edits = [
        (lambda sd: sd["state"][0].__setitem__("exp_avg", torch.zeros(5)), "shape"),
        # a 0-dim moment would broadcast over the parameter
        (lambda sd: sd["state"][0].__setitem__("exp_avg_sq", torch.tensor(0.5)), "shape"),
        (lambda sd: sd["masks"].__setitem__(0, torch.ones(3, 3, dtype=torch.bool)), "shape"),
        (lambda sd: sd["masks"].__setitem__(0, torch.ones(2, 3)), "dtype"),
        (lambda sd: sd["masks"].__setitem__(7, torch.ones(2, 3, dtype=torch.bool)), "index"),
        (lambda sd: sd.__setitem__("masks", [1]), "dict"),
    ]
    for edit, word in edits:
        sd = copy.deepcopy(good)
        edit(sd)
        before = snapshot(m.parameters(), opt)
        masks = dict(opt.masks)
        with pytest.raises(ValueError, match=word):
            opt.load_state_dict(sd)
        assert_same_snapshot(before, snapshot(m.parameters(), opt))
        assert opt.masks == masks


@pytest.mark.parametrize("cls", [ts.optim.SGD, ts.optim.AdamW])
def test_add_param_group_and_zero_grad(backend, cls):
    a, b = small_net(), small_net()
    oa = cls(a[0].parameters(), lr=0.05)
    ob = getattr(torch.optim, cls.__name__)(b[0].parameters(), lr=0.05, foreach=False)
    oa.add_param_group({"params": a[2].parameters(), "lr": 0.01, "weight_decay": 0.0})
    ob.add_param_group({"params": b[2].parameters(), "lr": 0.01, "weight_decay": 0.0})
    batches = data(5)
    train(a, oa, batches)
    train(b, ob, batches)
    close(a.parameters(), b.parameters())
    oa.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in a.parameters())
    oa.zero_grad()
    assert all(p.grad is None for p in a.parameters())
    w = [p.detach().clone() for p in a.parameters()]
    oa.step()  # no gradients: nothing happens
    assert all(same_bits(p.detach(), q) for p, q in zip(a.parameters(), w))


@pytest.mark.parametrize("cls", [ts.optim.SGD, ts.optim.AdamW])
def test_add_param_group_with_bad_options_adds_nothing(cls):
    """A group with a negative lr (or another bad option) is refused at add_param_group, and the
    optimizer keeps its groups (else every later step() would fail on it)."""
    opt = cls([nn.Parameter(torch.ones(2))], lr=0.1)
    bad = [dict(lr=-1.0), dict(lr_scale=-2), dict(weight_decay=-1.0), dict(lr="abc")]
    bad += [dict(momentum=-1.0), dict(nesterov=True)] if cls is ts.optim.SGD else \
        [dict(betas=(0.9, 2.0)), dict(eps=NAN)]
    for options in bad:
        q = nn.Parameter(torch.ones(2))
        q.grad = torch.ones(2)
        with pytest.raises(ValueError, match="param group 1"):
            opt.add_param_group({"params": [q], **options})
        assert len(opt.param_groups) == 1
    opt.param_groups[0]["params"][0].grad = torch.ones(2)
    opt.step()  # still works


def test_requires_grad_toggled_between_steps(backend):
    for cls, options in OPTIMIZERS:
        a, b = small_net(), small_net()
        oa = cls(a.parameters(), lr=0.05, **options)
        ob = getattr(torch.optim, cls.__name__)(b.parameters(), lr=0.05, foreach=False,
                                                **options)
        for i, (x, y) in enumerate(data(6)):
            for net, opt in ((a, oa), (b, ob)):
                trainable = i % 2 == 0
                net[0].weight.requires_grad_(trainable)
                opt.zero_grad()
                nn.functional.mse_loss(net(x), y).backward()
                opt.step()
        close(a.parameters(), b.parameters())


def test_sparse_gradient_refused_before_any_write(backend):
    for cls, options in OPTIMIZERS:
        torch.manual_seed(0)
        emb = nn.Embedding(5, 3, sparse=True)
        lin = nn.Linear(3, 1)
        opt = cls([{"params": lin.parameters()}, {"params": emb.parameters()}], lr=0.1, **options)
        lin(emb(torch.tensor([1, 2]))).sum().backward()
        before = snapshot(list(lin.parameters()) + list(emb.parameters()), opt)
        with pytest.raises(RuntimeError, match="sparse"):
            opt.step()
        assert_same_snapshot(before, snapshot(list(lin.parameters()) + list(emb.parameters()),
                                              opt))


@pytest.mark.parametrize("cls,options", OPTIMIZERS, ids=["SGD", "AdamW"])
def test_bad_hyper_parameters_at_step_change_nothing(backend, cls, options):
    """Values written into a param group later (by hand or by a scheduler) are checked before
    anything is written, whichever group they are in."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    opt = cls([{"params": m[0].parameters()}, {"params": m[1].parameters()}], lr=0.1, **options)
    for _ in range(2):
        m(torch.randn(2, 3)).sum().backward()
        opt.step()
    edits = [("lr", -0.1), ("lr", NAN), ("lr", torch.tensor([0.1, 0.2])), ("lr_scale", -1.0),
             ("lr_scale", INF), ("weight_decay", -0.5)]
    edits += [("momentum", -0.5)] if cls is ts.optim.SGD else [("betas", (0.9, 1.0)),
                                                               ("eps", NAN)]
    for key, value in edits:
        group = opt.param_groups[1]
        old = group.get(key, 1.0)
        group[key] = value
        before = snapshot(m.parameters(), opt)
        with pytest.raises(ValueError, match=key):
            opt.step()
        assert_same_snapshot(before, snapshot(m.parameters(), opt))
        group[key] = old


@pytest.mark.parametrize("cls,options", OPTIMIZERS, ids=["SGD", "AdamW"])
def test_max_grad_norm_set_later_is_checked(backend, cls, options):
    """``optimizer.max_grad_norm`` is a public attribute: a negative, NaN or non-number value
    written later raises ValueError at step() before anything changes (a negative threshold
    would flip every update)."""
    torch.manual_seed(0)
    m = nn.Linear(3, 2)
    opt = cls(m.parameters(), lr=0.1, max_grad_norm=1.0, **options)
    m(torch.randn(2, 3)).sum().backward()
    opt.step()
    for value in (-1.0, NAN, "abc", [1.0]):
        opt.max_grad_norm = value
        before = snapshot(m.parameters(), opt)
        with pytest.raises(ValueError, match="max_grad_norm"):
            opt.step()
        assert_same_snapshot(before, snapshot(m.parameters(), opt))
    opt.max_grad_norm = None
    opt.step()  # no clip: fine


@pytest.mark.parametrize("cls,options", OPTIMIZERS, ids=["SGD", "AdamW"])
def test_shared_memory_parameters_refused_before_any_write(backend, cls, options):
    """Two parameters of one group on the same memory: refused in the plan, so the earlier
    groups are not stepped and no state is created (the kernels refuse them too, but only when
    their group's turn comes)."""
    a = nn.Parameter(torch.ones(3))
    base = torch.zeros(4)
    b, c = nn.Parameter(base), nn.Parameter(base[:2])
    for p in (a, b, c):
        p.grad = torch.ones_like(p)
    opt = cls([{"params": [a]}, {"params": [b, c]}], lr=0.1, **options)
    with pytest.raises(RuntimeError, match="memory"):
        opt.step()
    assert torch.equal(a.detach(), torch.ones(3)) and len(opt.state) == 0


@pytest.mark.parametrize("cls,options", OPTIMIZERS, ids=["SGD", "AdamW"])
def test_non_dense_parameter_refused_without_state(backend, cls, options):
    """An expanded parameter: refused before its zero state is created (with state, a later
    step would no longer be a first step: SGD with dampening would differ)."""
    e = nn.Parameter(torch.ones(3).expand(2, 3))
    e.grad = torch.ones(2, 3)
    opt = cls([e], lr=0.1, **options)
    with pytest.raises(RuntimeError, match="dense"):
        opt.step()
    assert len(opt.state) == 0


@pytest.mark.parametrize("cls,options", OPTIMIZERS, ids=["SGD", "AdamW"])
def test_zero_size_and_disjoint_view_parameters_step(backend, cls, options):
    """What the memory check must not refuse: empty parameters (whatever their data_ptr) and
    parameters that are disjoint views of one tensor -- both stepped as torch steps them."""
    base, ref_base = torch.zeros(6), torch.zeros(6)
    ours = [nn.Parameter(torch.zeros(0)), nn.Parameter(torch.zeros(0, 3)),
            nn.Parameter(base[:3]), nn.Parameter(base[3:])]
    theirs = [nn.Parameter(torch.zeros(0)), nn.Parameter(torch.zeros(0, 3)),
              nn.Parameter(ref_base[:3]), nn.Parameter(ref_base[3:])]
    a = cls(ours, lr=0.1, **options)
    b = getattr(torch.optim, cls.__name__)(theirs, lr=0.1, foreach=False, **options)
    for step in range(3):
        for ps in (ours, theirs):
            for i, p in enumerate(ps):
                p.grad = torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) + step + i
        a.step()
        b.step()
    close(ours, theirs)
    assert not torch.equal(base, torch.zeros(6))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_parameters(dtype):
    """fp16/bf16: AdamW equals torch's fused AdamW (float32 compute, rounded once) bitwise; SGD
    gives the same bits on every backend; state stays in the parameter's dtype."""
    g = torch.Generator().manual_seed(0)
    start = torch.randn(300, generator=g).to(dtype)
    grads = [torch.randn(300, generator=g).to(dtype) for _ in range(5)]
    results = {}
    for backend in ("compiled", "fallback", "reference"):
        if backend == "compiled" and not ts._ops.compiled_available():
            continue
        with ts._ops.use_backend(backend), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            p, q, r = (nn.Parameter(start.clone()) for _ in range(3))
            ours = ts.optim.AdamW([p], lr=0.01, weight_decay=0.1, amsgrad=True)
            theirs = torch.optim.AdamW([q], lr=0.01, weight_decay=0.1, amsgrad=True, fused=True)
            sgd = ts.optim.SGD([r], lr=0.1, momentum=0.9, weight_decay=0.1, dampening=0.2)
            for grad in grads:
                p.grad, q.grad, r.grad = grad.clone(), grad.clone(), grad.clone()
                ours.step()
                theirs.step()
                sgd.step()
            assert same_bits(p.detach(), q.detach()), backend
            assert ours.state[p]["exp_avg"].dtype == dtype
            assert sgd.state[r]["momentum_buffer"].dtype == dtype
            results[backend] = r.detach().clone()
    assert all(same_bits(v, results["reference"]) for v in results.values())


@pytest.mark.parametrize("cls,options", OPTIMIZERS, ids=["SGD", "AdamW"])
def test_max_grad_norm_under_grad_scaler_is_unscale_clip_step(backend, cls, options):
    """No unscale_: the norm folded into the step is that of the unscaled gradients, so the run
    equals torch's unscale_ + clip_grad_norm_ + step recipe (the scaled gradients untouched)."""
    a, b = small_net(), small_net()
    oa = cls(a.parameters(), lr=0.02, max_grad_norm=0.1, **options)
    ob = getattr(torch.optim, cls.__name__)(b.parameters(), lr=0.02, foreach=False, **options)
    batches = data(6)
    sa = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    for x, y in batches:
        oa.zero_grad()
        sa.scale(nn.functional.mse_loss(a(x), y)).backward()
        scaled = [p.grad.clone() for p in a.parameters()]
        sa.step(oa)
        sa.update()
        assert all(same_bits(p.grad, g) for p, g in zip(a.parameters(), scaled))
    sb = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    for x, y in batches:
        ob.zero_grad()
        sb.scale(nn.functional.mse_loss(b(x), y)).backward()
        sb.unscale_(ob)
        total = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.1)
        sb.step(ob)
        sb.update()
    torch.testing.assert_close(oa.last_grad_norm, total, rtol=1e-5, atol=0)
    close(a.parameters(), b.parameters(), rtol=1e-5, atol=1e-7)


def test_max_grad_norm_with_masks_counts_full_gradients(backend):
    torch.manual_seed(0)
    emb = nn.Embedding(5, 3)
    mask = torch.zeros(5, 3, dtype=torch.bool)
    mask[4] = True
    opt = ts.optim.AdamW(emb.parameters(), lr=0.1, masks={emb.weight: mask}, max_grad_norm=0.1)
    emb(torch.tensor([0, 1, 4])).pow(2).sum().backward()
    expected = emb.weight.grad.norm()
    opt.step()
    torch.testing.assert_close(opt.last_grad_norm, expected)


def test_closure_and_repeated_parameter(backend):
    """step(closure) returns the closure's loss, computed with gradients on; a parameter listed
    twice is stepped once (documented; torch would step it twice)."""
    torch.manual_seed(0)
    m = nn.Linear(3, 1)
    opt = ts.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(4, 3)

    def closure():
        opt.zero_grad()
        loss = m(x).pow(2).mean()
        loss.backward()
        return loss

    with torch.no_grad():
        loss = opt.step(closure)
    assert loss.requires_grad and m.weight.grad is not None
    p = nn.Parameter(torch.ones(2))
    with pytest.warns(UserWarning, match="duplicate"):
        opt = ts.optim.SGD([p, p], lr=0.5)
    p.grad = torch.ones(2)
    opt.step()
    assert torch.equal(p.detach(), torch.full((2,), 0.5))


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_clip_gradients_that_carry_a_graph(backend):
    """Gradients from backward(create_graph=True) are clipped in place like torch clips them."""
    torch.manual_seed(0)
    a = nn.Linear(3, 2)
    b = copy.deepcopy(a)
    x = torch.randn(4, 3)
    for net in (a, b):
        net(x).pow(3).sum().backward(create_graph=True)
    ours = ts.clip_by_global_norm(a.parameters(), 0.1)
    theirs = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.1)
    torch.testing.assert_close(ours, theirs, rtol=2.5e-7, atol=0)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=2.5e-7, atol=0)


def test_error_if_nonfinite_on_models_and_trees(backend):
    m = nn.Linear(2, 1)
    m(torch.ones(1, 2)).sum().backward()
    m.weight.grad[0, 0] = INF
    before = m.bias.grad.clone()
    with pytest.raises(RuntimeError, match="non-finite"):
        ts.clip_by_global_norm(m, 1.0, error_if_nonfinite=True)
    assert torch.equal(m.bias.grad, before) and m.weight.grad[0, 0] == INF
    tree = {"a": torch.tensor([NAN]), "b": {"c": torch.tensor([2.0])}}
    with pytest.raises(RuntimeError, match="non-finite"):
        ts.clip_by_global_norm(tree, 1.0, error_if_nonfinite=True)
    assert tree["b"]["c"].item() == 2.0


def test_sgd_state_dict_interchange_with_torch(backend):
    """torch's SGD state (momentum buffers) continues here, and ours (with its "masks" key)
    continues in torch, step for step as torch alone would."""
    a, b = small_net(), small_net()
    theirs = torch.optim.SGD(b.parameters(), lr=0.05, momentum=0.9, nesterov=True,
                             weight_decay=0.01, foreach=False)
    batches = data(9)
    train(b, theirs, batches[:3])
    a.load_state_dict(b.state_dict())
    ours = ts.optim.SGD(a.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01,
                        masks={a[0].weight: torch.ones(6, 4, dtype=torch.bool)})
    ours.load_state_dict(copy.deepcopy(theirs.state_dict()))
    assert a[0].weight in ours.masks  # a state dict without "masks" keeps the current ones
    train(a, ours, batches[3:6])
    train(b, theirs, batches[3:6])
    assert all(same_bits(p, q) for p, q in zip(a.parameters(), b.parameters())) or \
        backend == "fallback"
    close(a.parameters(), b.parameters())
    back = torch.optim.SGD(b.parameters(), lr=0.05, momentum=0.9, nesterov=True,
                           weight_decay=0.01, foreach=False)
    b.load_state_dict(a.state_dict())
    back.load_state_dict(copy.deepcopy(ours.state_dict()))
    train(a, ours, batches[6:])
    train(b, back, batches[6:])
    close(a.parameters(), b.parameters())
