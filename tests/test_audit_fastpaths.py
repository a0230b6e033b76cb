"""The recent fast paths of the core, tried as a suspicious outsider who wants them to break.

Audited: the recursive parameter index and the per-pattern glob cache of the selectors (order
and paths against ``named_parameters`` / ``named_modules``, shared and tied objects, ``None``
entries, deep nesting, odd keys and glob special characters, cache eviction, threads, no
reference cycle); the skipped declaration walk (declarations added late, shared modules in two
attached models); contexts finding other attached models through the governing root's members;
the optimizer's overlap check per memory and its contiguous fast path; structural gradients read
from the walked nodes and the one global dead-checkpoint watch; ``within_gradient`` under
compile on unusual tensors; normalization hooks kept on a layer once held; ``global_norm`` /
``clip_by_global_norm`` of a model through a compiler-disabled function.

Every answer is compared with plain PyTorch (``named_parameters``, ``torch.autograd.grad``,
``torch.optim``, a plain twin of a BatchNorm) or brute force (``fnmatch`` over every dotted
prefix, DESIGN.md §1's rule written out). A test marked ``xfail(strict=True)`` reproduces a case
that goes wrong today; its reason says what happens and what is expected.
"""
import copy
import fnmatch
import gc
import threading
import weakref

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import torchstruct as ts
from _flags import STALE_GRAPHS, TORCH
from torchstruct.select import index

T = ts.tree
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore:Complex modules")
_GLOBAL_PRE = torch.nn.modules.module._global_forward_pre_hooks


def flags(m):
    return [p.requires_grad for p in m.parameters()]


def prefixes(path):
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def brute_select(model, pattern):
    """DESIGN.md's glob rule written out: fnmatch over every dotted prefix of any path."""
    out, seen = [], set()
    for path, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        paths = [q for q, r in model.named_parameters(remove_duplicate=False) if r is p]
        if any(fnmatch.fnmatchcase(pre, pattern) for q in paths for pre in prefixes(q)):
            out.append(paths[0])
            seen.add(id(p))
    return out


def odd_model():
    """Shared submodule, tied weight, a None parameter and a None child, odd container keys."""
    shared = nn.Linear(2, 2)
    m = nn.Module()
    m.a = shared
    m.d = nn.ModuleDict({"x[1]": nn.Linear(2, 2), "y?": shared, "z*": nn.Linear(2, 2, bias=False),
                         "w-v": nn.Sequential(nn.Linear(2, 2), nn.Identity())})
    m.d["z*"].weight = m.d["x[1]"].weight  # tied
    m.pl = nn.ParameterList([nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(3))])
    m.register_parameter("nothing", None)
    m.gone = None
    m.b = nn.Sequential(shared, nn.Linear(2, 2))
    return m


# --- 1. the index and the selectors --------------------------------------------------------

def test_index_matches_named_parameters_and_named_modules():
    m = odd_model()
    idx = index(m)
    flat = [(q, p) for p, ps in zip(idx.params, idx.paths) for q in ps]
    ref = list(m.named_parameters(remove_duplicate=False))
    # the same (path, object) pairs; each object's first path is its first named_parameters one
    assert sorted((q, id(p)) for q, p in flat) == sorted((q, id(p)) for q, p in ref)
    assert [ps[0] for ps in idx.paths] == [q for q, _ in m.named_parameters()]
    assert all(a is b for a, b in zip(idx.params, (p for _, p in m.named_parameters())))
    assert list(idx.modules) == [q for q, _ in m.named_modules(remove_duplicate=False)][1:]
    assert [id(x) for x in idx.module_objects] == [id(x) for _, x in m.named_modules()]


@pytest.mark.parametrize("pattern", ["d.x[[]1]", "d.y[?]", "d.z[*].*", "*[?]*", "d.?[*]",
                                     "d.w-v.0", "*.[wx]*", "[!d]*", "d.*[]]*", "pl.?"])
def test_glob_special_characters_against_fnmatch(pattern):
    m = odd_model()
    want = brute_select(m, pattern)
    got = [q for q, _ in ts.select(m, pattern, strict=False)]
    assert got == want


def test_many_patterns_survive_cache_eviction():
    m = nn.Sequential(*[nn.Linear(1, 1) for _ in range(40)])
    pats = [f"{i}.weight" for i in range(40)] + [f"{i}*" for i in range(40)]
    pats += [f"[{i % 10}]{j}.*" for i in range(10) for j in range(30)]  # > 256 distinct
    for _ in range(2):
        for pat in pats:
            assert [q for q, _ in ts.select(m, pat, strict=False)] == brute_select(m, pat)


def test_threads_select_concurrently():
    m = odd_model()
    pats = ["d.*", "a", "b.1", "*.bias", "pl.*", "d.x[[]1]"] + [f"nope{i}*" for i in range(300)]
    want = {p: brute_select(m, p) for p in pats}
    bad = []

    def work(k):
        for i in range(3):
            for pat in pats[k::4]:
                got = [q for q, _ in ts.select(m, pat, strict=False)]
                if got != want[pat]:
                    bad.append((pat, got))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bad == []


def test_deep_nesting_300_levels():
    m = nn.Linear(2, 2)
    for _ in range(300):
        m = nn.Sequential(m)
    ref = [q for q, _ in m.named_parameters()]
    assert [q for q, _ in ts.select(m, "*.bias")] == [ref[1]]
    with ts.freeze(m, "*.weight"):
        assert flags(m) == [False, True]
    assert flags(m) == [True, True]


def test_model_freed_without_gc_after_selecting_and_contexts():
    was = gc.isenabled()
    gc.disable()
    try:
        m = odd_model()
        ts.select(m, "d.*")
        with ts.freeze_except(m, "b"):
            m.b(torch.ones(1, 2))
        ref = weakref.ref(m)
        del m
        assert ref() is None
    finally:
        if was:
            gc.enable()


# --- 2. declarations --------------------------------------------------------------------------

def brute_flags(models, starts):
    """DESIGN.md §1 with no context: start flag, and every declaration along some path of
    every attached model holding the parameter admits it."""
    def admitted(root, p):
        ok_any, seen_any = False, False
        for path, q in root.named_parameters(remove_duplicate=False):
            if q is not p:
                continue
            seen_any = True
            mod, ok = root, True
            for part in path.split("."):
                names = ts_declared(mod)
                if names is not None and part not in names:
                    ok = False
                mod = getattr(mod, part, None) if isinstance(mod, nn.Module) else None
            ok_any = ok_any or ok
        return ok_any if seen_any else True

    ps = {id(p): p for r in models for p in r.parameters()}
    return {i: starts[i] and all(admitted(r, p) for r in models) for i, p in ps.items()}


def ts_declared(mod):
    mark = mod.__dict__.get("_torchstruct_trainable")
    if mark is not None:
        return set(mark if isinstance(mark, frozenset) else mark[0])
    fn = getattr(type(mod), "trainable", None)
    return set(fn(mod)) if callable(fn) else None


def test_mark_trainable_on_a_shared_submodule_of_two_attached_models():
    shared = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    a = nn.Sequential(shared, nn.Linear(2, 1))
    b = nn.Sequential(nn.Linear(2, 2), shared)
    ts.attach(a)
    ts.attach(b)
    starts = {id(p): True for p in [*a.parameters(), *b.parameters()]}
    ts.mark_trainable(shared, "1")
    want = brute_flags([a, b], starts)
    assert {id(p): p.requires_grad for p in [*a.parameters(), *b.parameters()]} == want
    assert [p.requires_grad for p in shared.parameters()] == [False, False, True, True]
    ts.mark_trainable(shared, None)
    assert all(flags(a)) and all(flags(b))
    ts.detach_hooks(a)
    ts.detach_hooks(b)


def test_trainable_assigned_on_the_class_after_attach_is_read_by_the_next_context():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.u = nn.Linear(2, 2)
            self.v = nn.Linear(2, 2)

    m = nn.Sequential(Block(), nn.Linear(2, 1))
    ts.attach(m)
    assert all(flags(m))
    Block.trainable = lambda self: ["v"]
    try:
        with ts.freeze(m, "1"):  # a context recomputes the flags: the new method counts
            assert flags(m) == [False, False, True, True, False, False]
        assert flags(m) == [False, False, True, True, True, True]
    finally:
        del Block.trainable
        ts.detach_hooks(m)


def test_declaring_wrapper_inserted_behind_the_hooks_back_is_read():
    class Wrapper(nn.Module):  # declares that nothing of it trains
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def trainable(self):
            return []

    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    ts.attach(m)
    m._modules["0"] = Wrapper(m[0])  # no registration hook runs
    assert [q for q, _ in ts.trainable_parameters(m)] == ["1.weight", "1.bias"]
    with ts.freeze(m, "1"):
        assert flags(m) == [False] * 4
    assert flags(m) == [False, False, True, True]
    ts.detach_hooks(m)


# --- 3. contexts and other attached models -------------------------------------------------

def test_contexts_on_roots_sharing_layers_with_other_attached_models():
    shared = nn.Linear(2, 2)
    a = nn.Sequential(shared, nn.Linear(2, 2))
    b = nn.Sequential(nn.Linear(2, 2), shared)
    c = nn.Sequential(nn.Linear(2, 2))  # unrelated
    for x in (a, b, c):
        ts.attach(x)
    before = [flags(x) for x in (a, b, c)]
    with ts.freeze_except(a, "1"):
        assert flags(a) == [False, False, True, True]
        assert flags(b) == [True, True, False, False]  # one flag: both models see it frozen
        assert flags(c) == [True, True]
        with ts.unfreeze(b, "1"):
            assert flags(a)[:2] == [True, True]
        assert flags(a) == [False, False, True, True]
    assert [flags(x) for x in (a, b, c)] == before
    for x in (a, b, c):
        ts.detach_hooks(x)


def test_contexts_on_a_submodule_shared_by_two_attached_models():
    sub = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    a = nn.Sequential(sub, nn.Linear(2, 1))
    b = nn.Sequential(nn.Linear(2, 2), sub)
    ts.attach(a)
    ts.attach(b)
    with ts.freeze(sub, "0"):
        assert flags(a) == [False, False, True, True, True, True]
        assert flags(b) == [True, True, False, False, True, True]
        with ts.freeze_except(b, "0"):  # the inner one wins; the shared flags are one
            assert flags(a) == [False, False, False, False, True, True]
            assert flags(b) == [True, True, False, False, False, False]
        assert flags(b) == [True, True, False, False, True, True]
    assert all(flags(a)) and all(flags(b))
    ts.mark_trainable(sub, "1")
    with ts.unfreeze(a, "0.0"):  # an unfreeze does not override a declaration
        assert flags(a)[:2] == [False, False] and flags(b)[2:4] == [False, False]
    ts.mark_trainable(sub, None)
    assert all(flags(a)) and all(flags(b))
    ts.detach_hooks(a)
    ts.detach_hooks(b)


def test_context_on_root_after_a_shared_layer_was_added_without_a_forward():
    a = nn.Sequential(nn.Linear(2, 2))
    b = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    ts.attach(a)
    ts.attach(b)
    ts.mark_trainable(b, "0")  # b freezes its layer 1
    assert flags(b) == [True, True, False, False]
    a.add_module("1", b[1])  # a now holds b's frozen layer; no forward since
    with ts.freeze(a, "0"):
        assert flags(a) == [False, False, False, False]
    assert flags(a) == [True, True, False, False]  # b's declaration still excludes it
    ts.mark_trainable(b, None)
    assert all(flags(a)) and all(flags(b))
    ts.detach_hooks(a)
    ts.detach_hooks(b)


def test_parameter_tied_behind_the_hooks_back_still_obeys_the_other_model():
    lin = nn.Linear(2, 2)
    b = nn.Sequential(lin)
    ts.attach(b)
    ts.mark_trainable(b)  # b: nothing trains
    a = nn.Sequential(nn.Linear(2, 2))
    ts.attach(a)
    a[0]._parameters["weight"] = lin.weight  # no registration hook runs
    with ts.unfreeze(a, "0.weight"):
        assert not lin.weight.requires_grad  # one flag: b's declaration does not admit it
    assert not lin.weight.requires_grad and not lin.bias.requires_grad
    ts.mark_trainable(b, None)
    assert lin.weight.requires_grad
    ts.detach_hooks(a)
    ts.detach_hooks(b)


def test_contexts_on_different_models_from_threads():
    ms = [nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)) for _ in range(4)]
    ms[1][1] = ms[0][1]  # two of them share a layer: the context's selection keeps it on
    for x in ms:
        ts.attach(x)
    bad = []

    def work(x):
        for _ in range(100):
            with ts.freeze_except(x, "1"):
                if flags(x)[2:] != [True, True]:
                    bad.append("in")
        if not all(flags(x)[2:]):
            bad.append("out")

    threads = [threading.Thread(target=work, args=(x,)) for x in ms]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bad == [] and all(all(flags(x)) for x in ms)
    for x in ms:
        ts.detach_hooks(x)


def test_parameter_moved_between_models_inside_a_context_gets_its_flag_back():
    a = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    b = nn.Sequential(nn.Linear(2, 2))
    ts.attach(a)
    ts.attach(b)
    moved = a[0]
    with ts.freeze(a, "0"):
        assert not moved.weight.requires_grad
        b.add_module("1", moved)
        del a[0]
        b(torch.ones(1, 2))
        a(torch.ones(1, 2))
    assert moved.weight.requires_grad and moved.bias.requires_grad
    assert all(flags(a)) and all(flags(b))
    ts.detach_hooks(a)
    ts.detach_hooks(b)


def test_functional_call_inside_a_context_matches_autograd():
    m = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 1))
    x = torch.randn(4, 2)
    params = {k: v.detach().clone().requires_grad_() for k, v in m.named_parameters()}
    with ts.freeze(m, "0"):
        out = torch.func.functional_call(m, params, (x,)).sum()
        g = torch.autograd.grad(out, list(params.values()))
        assert flags(m) == [False, False, True, True]
    ref = torch.autograd.grad(torch.func.functional_call(m, params, (x,)).sum(),
                              list(params.values()))
    assert all(torch.equal(u, v) for u, v in zip(g, ref))
    assert all(flags(m))


# --- 4. optimizer planning --------------------------------------------------------------------

def test_overlapping_views_of_one_storage_are_refused_and_left_unchanged():
    base = torch.randn(10)
    p = nn.Parameter(base[:6])
    q = nn.Parameter(base[4:])
    for x in (p, q):
        x.grad = torch.ones_like(x)
    before = base.clone()
    opt = ts.optim.SGD([p, q], lr=0.1)
    with pytest.raises(RuntimeError, match="shares its memory"):
        opt.step()
    assert torch.equal(base, before) and opt.state == {}


def test_adjacent_and_zero_size_views_step_like_torch():
    views = [lambda b: b[:8], lambda b: b[8:8], lambda b: b[8:16].view(2, 4),
             lambda b: b[16:].view(4, 2).t().contiguous()]
    for cls, tcls, kw in [(ts.optim.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
                          (ts.optim.AdamW, torch.optim.AdamW, dict(lr=0.01))]:
        base = torch.randn(24)
        ps = [nn.Parameter(v(base)) for v in views]  # views of ONE storage (adjacent)
        qs = [nn.Parameter(v(base.clone()).clone()) for v in views]
        for p, q in zip(ps, qs):
            g = torch.randn_like(p)
            p.grad, q.grad = g.clone(), g.clone()
        o, r = cls(ps, **kw), tcls(qs, foreach=False, **kw)
        for _ in range(3):
            o.step()
            r.step()
        for p, q in zip(ps, qs):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_transposed_contiguous_span_is_its_byte_range():
    # a view that is contiguous with size-1 dims of odd strides, next to another view
    base = torch.randn(12)
    p = nn.Parameter(base[:4].as_strided((1, 4), (100, 1)))
    q = nn.Parameter(base[4:])
    r = nn.Parameter(base[3:5])  # overlaps both
    for x in (p, q, r):
        x.grad = torch.ones_like(x)
    ts.optim.SGD([p, q], lr=0.1).step()
    with pytest.raises(RuntimeError, match="shares its memory"):
        ts.optim.SGD([p, r], lr=0.1).step()


def test_dense_non_contiguous_views_step_like_torch_and_overlaps_are_refused():
    base = torch.randn(8 + 2 * 3 * 2 * 2 + 4)
    ps = [nn.Parameter(base[:8].view(2, 4).t()),  # transposed: dense, not contiguous
          nn.Parameter(base[8:32].view(2, 3, 2, 2).permute(0, 2, 3, 1)),  # channels-last-like
          nn.Parameter(base[32:])]
    qs = [nn.Parameter(p.detach().clone()) for p in ps]
    for p, q in zip(ps, qs):
        g = torch.randn_like(p)
        p.grad, q.grad = g.clone(), g.clone()
    o = ts.optim.AdamW(ps, lr=0.01)
    r = torch.optim.AdamW(qs, lr=0.01, foreach=False)
    for _ in range(2):
        o.step()
        r.step()
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    s = nn.Parameter(base[7:9])
    s.grad = torch.ones(2)
    before = base.clone()
    with pytest.raises(RuntimeError, match="shares its memory"):
        ts.optim.SGD([ps[0], s], lr=0.1).step()
    assert torch.equal(base, before)


def test_views_of_one_storage_in_two_dtypes():
    base = torch.randn(8)
    p = nn.Parameter(base[:4])  # bytes 0..16
    q = nn.Parameter(base.view(torch.bfloat16)[6:10])  # bytes 12..20: overlaps p
    r = nn.Parameter(base.view(torch.bfloat16)[8:12])  # bytes 16..24: adjacent to p
    for x in (p, q, r):
        x.grad = torch.ones_like(x)
    before = base.clone()
    with pytest.raises(RuntimeError, match="shares its memory"):
        ts.optim.SGD([p, q], lr=0.1).step()
    assert torch.equal(base, before)
    p2, r2 = (nn.Parameter(x.detach().clone()) for x in (p, r))
    p2.grad, r2.grad = torch.ones_like(p2), torch.ones_like(r2)
    ts.optim.SGD([p, r], lr=0.1).step()
    torch.optim.SGD([p2, r2], lr=0.1, foreach=False).step()
    assert torch.equal(p.detach(), p2.detach()) and torch.equal(r.detach(), r2.detach())


def test_meta_parameters_overlap_per_storage():
    a = nn.Parameter(torch.empty(4, device="meta"))
    b = nn.Parameter(torch.empty(4, device="meta"))  # another storage, same offsets
    for x in (a, b):
        x.grad = torch.empty_like(x)
    ts.optim.SGD([a, b], lr=0.1).step()  # distinct storages: no overlap
    base = torch.empty(8, device="meta")
    c, d = nn.Parameter(base[:5]), nn.Parameter(base[3:])
    for x in (c, d):
        x.grad = torch.empty_like(x)
    with pytest.raises(RuntimeError, match="shares its memory"):
        ts.optim.SGD([c, d], lr=0.1).step()


def test_expanded_parameter_is_refused():
    p = nn.Parameter(torch.randn(1, 3).expand(4, 3))
    p.grad = torch.ones(4, 3)
    with pytest.raises(RuntimeError, match="not dense"):
        ts.optim.SGD([p], lr=0.1).step()


def test_step_inside_a_swap_block_is_refused_then_steps_tied_once_like_torch():
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    m[1].weight = m[0].weight
    r = copy.deepcopy(m)
    for mod in (m, r):
        mod(torch.randn(3, 2)).sum().backward() if mod is m else None
    for p, q in zip(m.parameters(), r.parameters()):
        q.grad = p.grad.clone()
    o, t = ts.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(r.parameters(), lr=0.1)
    stand = {k: torch.zeros_like(v) for k, v in m.named_parameters()}
    before = [p.detach().clone() for p in m.parameters()]
    with ts.swap(m, stand):
        with pytest.raises(RuntimeError, match="swap block"):
            o.step()
    assert all(torch.equal(p, b) for p, b in zip(m.parameters(), before)) and o.state == {}
    o.step()
    t.step()
    for p, q in zip(m.parameters(), r.parameters()):
        assert torch.equal(p, q)


# --- 5. structural gradients and the dead-checkpoint watch ----------------------------------

class MyParam(nn.Parameter):
    pass


def test_structural_grad_tied_views_and_parameter_subclass_match_autograd():
    m = nn.Module()
    m.w = MyParam(torch.randn(3, 3))
    m.lin = nn.Linear(3, 3)
    m.lin2 = nn.Linear(3, 3)
    m.lin2.weight = m.lin.weight

    def loss(mod):
        x = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
        h = mod.lin2(mod.lin(x)) @ mod.w.t()[:, :2].expand(3, 2).contiguous()
        return h.pow(2).sum()

    tree = T.to_flat_dict(ts.structural_grad(m, loss))
    ref = torch.autograd.grad(loss(m), [m.w, m.lin.weight, m.lin.bias, m.lin2.bias])
    assert list(tree) == ["w", "lin.weight", "lin.bias", "lin2.bias"]
    assert all(torch.equal(a, b) for a, b in zip(tree.values(), ref))


def test_callable_that_raises_leaves_no_global_hook_and_user_hooks_survive():
    m = nn.Sequential(nn.Linear(2, 2))
    seen = []
    h = nn.modules.module.register_module_forward_pre_hook(lambda mod, a: seen.append(1))
    keys = list(_GLOBAL_PRE)
    try:
        def bad(mod):
            mod(torch.ones(1, 2))
            raise KeyError("boom")

        with pytest.raises(KeyError):
            ts.structural_grad(m, bad)
        assert list(_GLOBAL_PRE) == keys
        h2 = nn.modules.module.register_module_forward_pre_hook(lambda mod, a: seen.append(2))
        try:
            ts.structural_grad(m, lambda mod: mod(torch.ones(1, 2)).sum())
        finally:
            h2.remove()
        assert list(_GLOBAL_PRE) == keys
        assert seen == [1, 1, 1, 2, 1, 2]  # two modules per forward, in registration order
    finally:
        h.remove()


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
def test_reentrant_checkpoint_without_grad_inputs_still_raises_in_a_callable():
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))

    def loss(mod):
        x = torch.ones(1, 2)  # requires no grad: the reentrant checkpoint records nothing
        h = checkpoint(mod[0], x, use_reentrant=True)
        return mod[1](h).sum()

    with pytest.raises(ValueError, match="reentrant activation checkpoint"):
        ts.structural_grad(m, loss)
    assert not any(getattr(f, "__name__", "") == "_watch" for f in _GLOBAL_PRE.values())


def test_nested_and_threaded_callable_losses_match_autograd():
    m = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
    xs = [torch.randn(4, 3) for _ in range(6)]
    ref = [torch.autograd.grad(m(x).pow(2).sum(), list(m.parameters())) for x in xs]
    bad = []

    def outer(k):
        def loss(mod):
            inner = ts.structural_grad(mod, lambda q: q(xs[k]).pow(2).sum())  # nested
            got = T.leaves(inner)
            if not all(torch.equal(a, b) for a, b in zip(got, ref[k])):
                bad.append(("inner", k))
            return mod(xs[k]).pow(2).sum()
        for _ in range(3):
            tree = ts.structural_grad(m, loss)
            if not all(torch.equal(a, b) for a, b in zip(T.leaves(tree), ref[k])):
                bad.append(("outer", k))

    threads = [threading.Thread(target=outer, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bad == []
    assert not any(getattr(f, "__name__", "") == "_watch" for f in _GLOBAL_PRE.values())


# --- 6. within_gradient under compile ---------------------------------------------------------

def _eager_answer(t):
    return torch.is_grad_enabled() and t.requires_grad


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("kind", ["plain", "meta", "inference", "subclass", "int", "jagged"])
def test_within_gradient_compiled_on_unusual_tensors(backend, kind):
    torch._dynamo.reset()
    if kind == "plain":
        t = torch.randn(3, requires_grad=True)
    elif kind == "meta":
        t = torch.empty(3, device="meta", requires_grad=True)
    elif kind == "jagged":
        t = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], layout=torch.jagged,
                                       requires_grad=True)
    elif kind == "inference":
        with torch.inference_mode():
            t = torch.randn(3)
    elif kind == "subclass":
        t = MyParam(torch.randn(3))
    else:
        t = torch.arange(3)

    def f(x):
        return ts.within_gradient(x)

    cf = torch.compile(f, backend=backend)
    for ctx in (torch.enable_grad, torch.no_grad, torch.inference_mode):
        with ctx():
            want = f(t)
            assert want == (_eager_answer(t) and not torch.is_inference_mode_enabled())
            assert cf(t) == want


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_within_gradient_of_a_parameter_in_blocks_compiled_equals_eager(backend):
    torch._dynamo.reset()
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))

    def f(mod):
        return ts.within_gradient(mod[0].weight), ts.within_gradient(mod[1].weight)

    cf = torch.compile(f, backend=backend)
    assert cf(m) == f(m) == (True, True)
    with ts.stop_gradient(m, "0"):
        assert f(m) == (False, True)
        assert cf(m) == (False, True)
    with torch.no_grad():
        assert cf(m) == f(m) == (False, False)
    assert cf(m) == (True, True)


_UNVIEWABLE = {
    "sparse_coo": lambda: torch.randn(3, 3).to_sparse().requires_grad_(),
    "sparse_csr": lambda: torch.randn(3, 3).to_sparse_csr().requires_grad_(),
    "nested_strided": lambda: torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)],
                                                         requires_grad=True),
    "mkldnn": lambda: torch.randn(3, 3).to_mkldnn(),
}


_MKLDNN_UNDER_DYNAMO = pytest.mark.xfail(
    TORCH < (2, 14),
    strict=True, reason=(
    "under torch.compile a mkldnn tensor's fake reports layout torch.strided and is_mkldnn "
    "False, so within_gradient cannot tell it from a dense tensor and takes the identity view "
    "it probes dense tensors with (to see a block's stand-in), which mkldnn refuses: dynamo "
    "raises 'Mkldnn tensor does not support view' while tracing (an error, not a wrong "
    "answer). Expected: the eager answer. Torch 2.14's fake keeps the layout: it passes there"))


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("kind", [pytest.param(k, marks=_MKLDNN_UNDER_DYNAMO) if k == "mkldnn"
                                  else k for k in _UNVIEWABLE])
def test_within_gradient_compiled_on_tensors_without_view(kind):
    torch._dynamo.reset()
    t = _UNVIEWABLE[kind]()
    want = ts.within_gradient(t)
    assert want == t.requires_grad
    assert torch.compile(lambda x: ts.within_gradient(x), backend="eager")(t) == want


# --- 7. normalization hooks kept once held -----------------------------------------------------

def _bn_model(momentum=0.1):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3, momentum=momentum))


def _stats(bn):
    return [bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone()]


def _same_stats(a, b):
    return all(torch.equal(x, y) for x, y in zip(_stats(a), _stats(b)))


@pytest.mark.parametrize("momentum", [0.1, None])
def test_hold_unhold_rehold_matches_a_plain_twin(momentum):
    m = _bn_model(momentum)
    twin = copy.deepcopy(m)  # plain PyTorch: runs a train forward only when m is not held
    ts.attach(m)
    for step in range(6):
        x = torch.randn(5, 3)
        if step % 2:
            with ts.freeze(m, "1"):
                m(x)
                copy_in = copy.deepcopy(m)  # a copy behaves as plain PyTorch
                plain = copy.deepcopy(twin)
                copy_in(x)
                plain(x)
                assert _same_stats(copy_in[1], plain[1])
        else:
            m(x)
            twin(x)
        assert _same_stats(m[1], twin[1])
    assert len(m[1]._forward_pre_hooks) >= 1  # kept while in the tree
    ts.detach_hooks(m)
    assert len(m[1]._forward_pre_hooks) == 0 and len(m[1]._forward_hooks) == 0


def test_update_bn_between_holds_matches_a_plain_twin():
    m = _bn_model(momentum=None)
    twin = copy.deepcopy(m)
    ts.attach(m)
    data = [torch.randn(5, 3) for _ in range(3)]
    for _ in range(2):
        with ts.freeze(m, "1"):
            m(torch.randn(5, 3))  # held: nothing changes
        torch.optim.swa_utils.update_bn(data, m)  # not held: the kept hooks pass
        torch.optim.swa_utils.update_bn(data, twin)
        assert _same_stats(m[1], twin[1])
    ts.detach_hooks(m)


def test_layer_leaving_the_tree_after_an_unhold_runs_plain():
    m = _bn_model()
    ts.attach(m)
    with ts.freeze(m, "1"):
        m(torch.randn(4, 3))
    bn = m[1]
    other = nn.Sequential(bn)
    del m[1]
    m(torch.randn(4, 3))  # a deletion is not seen by the forward: the hooks stay, passing
    twin = copy.deepcopy(bn)
    x = torch.randn(4, 3)
    other(x)
    twin(x)
    assert _same_stats(bn, twin)
    with ts.freeze(m, "0"):  # the next application sees the layer gone
        pass
    assert len(bn._forward_pre_hooks) == 0 and len(bn._forward_hooks) == 0
    ts.detach_hooks(m)


def test_freeze_norm_stats_false_updates_like_plain():
    m = _bn_model()
    twin = copy.deepcopy(m)
    ts.attach(m, freeze_norm_stats=False)
    for _ in range(3):
        x = torch.randn(4, 3)
        with ts.freeze(m, "1"):
            m(x)
        twin(x)
        assert _same_stats(m[1], twin[1])
    ts.detach_hooks(m)


def test_torch_save_of_a_model_with_kept_hooks_runs_plain(tmp_path):
    m = _bn_model()
    ts.attach(m)
    with ts.freeze(m, "1"):
        m(torch.randn(4, 3))
    torch.save(m, tmp_path / "m.pt")
    with ts.freeze(m, "1"):
        torch.save(m, tmp_path / "held.pt")
        loaded = torch.load(tmp_path / "held.pt", weights_only=False)
    twin = copy.deepcopy(loaded)
    ts.detach_hooks(twin)
    x = torch.randn(4, 3)
    loaded(x)
    twin(x)
    assert _same_stats(loaded[1], twin[1])
    ts.detach_hooks(m)


@STALE_GRAPHS
def test_compiled_model_hold_unhold_matches_plain_twin():
    torch._dynamo.reset()
    m = _bn_model()
    twin = copy.deepcopy(m)
    ts.attach(m)
    cm = torch.compile(m, backend="eager")
    for step in range(4):
        x = torch.randn(5, 3)
        if step % 2:
            with ts.freeze(m, "1"):
                cm(x)
        else:
            cm(x)
            twin(x)
        assert _same_stats(m[1], twin[1])
    ts.detach_hooks(m)


# --- 8. norms and clipping of a model ---------------------------------------------------------

def _grads_model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    m(torch.randn(4, 3)).sum().backward()
    return m


def test_global_norm_inside_swap_reads_own_grads_eager_and_compiled():
    torch._dynamo.reset()
    m = _grads_model()
    want = torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(p.grad) for p in m.parameters()]))
    stand = {k: torch.zeros_like(v).requires_grad_() for k, v in m.named_parameters()}
    for v in stand.values():
        v.grad = torch.full_like(v, 7.0)
    cf = torch.compile(lambda mod: ts.global_norm(mod), backend="eager")
    with ts.swap(m, stand):
        torch.testing.assert_close(ts.global_norm(m), want)
        torch.testing.assert_close(cf(m), want)


@pytest.mark.parametrize("compiled", [False, True])
def test_clip_of_a_model_inside_swap_clips_the_parameters_own_grads(compiled):
    torch._dynamo.reset()
    m = _grads_model()
    r = copy.deepcopy(m)
    for p, q in zip(m.parameters(), r.parameters()):
        q.grad = p.grad.clone()
    stand = {k: v.detach().clone().requires_grad_() for k, v in m.named_parameters()}
    for v in stand.values():
        v.grad = torch.full_like(v, 7.0)
    f = lambda mod: ts.clip_by_global_norm(mod, 0.01)  # noqa: E731
    f = torch.compile(f, backend="eager") if compiled else f
    with ts.swap(m, stand):
        n = f(m)
    want = torch.nn.utils.clip_grad_norm_(list(r.parameters()), 0.01)
    torch.testing.assert_close(n, want)
    for p, q in zip(m.parameters(), r.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    assert all(torch.equal(v.grad, torch.full_like(v, 7.0)) for v in stand.values())


def test_compiled_global_norm_follows_contexts_between_calls():
    torch._dynamo.reset()
    m = _grads_model()
    ts.attach(m)
    cf = torch.compile(lambda mod: ts.global_norm(mod), backend="eager")

    def brute():
        return torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(p.grad) for p in m.parameters() if p.requires_grad]))

    for sel in ["0", "1", "0.weight", "1", "0"]:
        with ts.freeze(m, sel):
            torch.testing.assert_close(cf(m), brute())
        torch.testing.assert_close(cf(m), brute())
    ts.detach_hooks(m)


def test_compiled_clip_matches_torch_clip_under_a_context():
    torch._dynamo.reset()
    m = _grads_model()
    r = copy.deepcopy(m)
    for p, q in zip(m.parameters(), r.parameters()):
        q.grad = p.grad.clone()
    ts.attach(m)
    cf = torch.compile(lambda mod: ts.clip_by_global_norm(mod, 0.1), backend="eager")
    with ts.freeze(m, "1"):
        n = cf(m)
    want = torch.nn.utils.clip_grad_norm_(list(r[0].parameters()), 0.1)
    torch.testing.assert_close(n, want)
    for p, q in zip(m.parameters(), r.parameters()):
        assert torch.equal(p.grad, q.grad)
    ts.detach_hooks(m)
