"""Outside-eyes audit: what torchstruct holds of parameters, and for how long.

torchstruct holds no weak reference to a parameter (``torch.utils.swap_tensors`` refuses a
tensor that has a Python one, and its C++ check refuses a C++ weak reference to the tensor
too). Every check compares with plain PyTorch (a twin never attached) or with what
docs/freezing.md promises: a dropped model is collected; a parameter that leaves a tree is
held until the tree's next application; loops never accumulate parameters or records.
"""
import copy
import gc
import io
import threading
import warnings
import weakref

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

import torchstruct as ts
from _flags import flags, reads
from torchstruct import _state


def net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def x():
    return torch.randn(5, 3)


def live_parameters():
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, nn.Parameter))


def counts():
    gc.collect()
    return (len(_state.records), len(_state.live_states()), live_parameters(),
            len([e for e in _state.entries if e.scope() is not None]),
            len([k for k, v in _state.frozen_norms.items() if v[0]() is not None]))


def no_weakrefs(*models):
    return all(weakref.getweakrefs(t) == [] for m in models
               for t in [*m.parameters(), *m.buffers()])


# ----------------------------------------------------------------------------- leaks
def _drop_permanent(_):
    m = net()
    ts.freeze(m, "0")
    m(x())


def _drop_inside_with(_):
    m = net()
    with ts.freeze(m, "0"):
        m(x()).sum().backward()


def _drop_schedule(_):
    m = net()
    s = ts.UnfreezeSchedule(m, {0: "2", 2: None})
    for _ in range(3):
        m(x())
        s.step()


def _drop_optim(_):
    m = net()
    ts.freeze(m, "0")
    opt = ts.optim.AdamW(m.parameters())
    m(x()).sum().backward()
    opt.step()


def _drop_structural_grad(_):
    m = net()
    ts.freeze_except(m, "2")
    ts.structural_grad(m, lambda mm: mm(x()).sum())


class Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = net()

    def forward(self, t):
        return self.body(t)


def _nested_inner_dies(_):
    outer = Holder()
    inner = net(1)
    with ts.freeze(outer, "body.0"):
        with ts.freeze(inner):
            outer.extra = inner
            outer(x())
            del outer.extra
            del inner
        outer(x())


def _generator_dropped(_):
    m = net()

    def gen():
        with ts.freeze(m, "0"):
            yield m(x())
            yield m(x())

    g = gen()
    next(g)


def _exception(_):
    m = net()
    try:
        with ts.freeze(m, "0"), ts.stop_gradient(m, "2"):
            m(x())
            raise ValueError("boom")
    except ValueError:
        pass


def _threads(_):
    def run():
        m = net()
        with ts.freeze(m, "0"):
            m(x()).sum().backward()

    ts_ = [threading.Thread(target=run) for _ in range(3)]
    for t in ts_:
        t.start()
    for t in ts_:
        t.join()


def _drop_blocks(_):
    m = net()
    with ts.freeze(m, "1"), ts.stop_gradient(m, "0"), ts.swap(m, {"2.bias": torch.zeros(2)}):
        with ts.constant(m, "2"):
            m.train()(x()).sum().backward()


def _drop_generator_with_blocks(_):
    m = net()

    def gen():
        with ts.freeze(m, "1"), ts.swap(m, {"2.bias": torch.zeros(2)}):
            yield m(x())
            yield m(x())

    g = gen()
    next(g)
    g.close()


def _drop_frozen_norm(_):
    m = net()
    ts.freeze(m, "1")
    m.train()(x())


LOOPS = [_drop_blocks, _drop_generator_with_blocks, _drop_frozen_norm, _drop_permanent, _drop_inside_with, _drop_schedule, _drop_optim, _drop_structural_grad,
         _nested_inner_dies, _generator_dropped, _exception, _threads]


@pytest.mark.filterwarnings("ignore::torchstruct.RestoredFlagsWarning")
@pytest.mark.parametrize("loop", LOOPS, ids=[f.__name__ for f in LOOPS])
def test_models_made_and_dropped_in_a_loop_leave_nothing_behind(loop):
    loop(0)  # warm up (lazily made tables)
    before = counts()
    for i in range(12):
        loop(i)
    after = counts()
    # a leak grows a count; one may shrink when objects of earlier tests (held by caches that
    # let go later, such as compiled code's) are freed during the loop
    assert all(a <= b for a, b in zip(after, before)), (after, before)


def _deepcopy(m):
    return copy.deepcopy(m)


def _averaged(m):
    a = AveragedModel(m)
    a.update_parameters(m)
    return a


def _saved(m):
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("copy_", [_deepcopy, _averaged, _saved])
def test_a_copy_made_each_epoch_is_plain_pytorch_and_leaves_nothing(copy_):
    m = net()
    ts.freeze(m, "0")
    m(x())
    before = counts()
    for _ in range(8):
        c = copy_(m)
        c(x())
        assert no_weakrefs(c) and _state.record(next(c.parameters())) is None
        del c
    assert counts() == before


def _replace_head(m):
    m[2] = nn.Linear(4, 2)


def _assign(m):
    m.load_state_dict({k: v.clone() for k, v in m.state_dict().items()}, assign=True)


@pytest.mark.parametrize("forward", [False, True])
@pytest.mark.parametrize("change", [_replace_head, _assign])
@pytest.mark.parametrize("context", ["none", "with", "permanent"])
def test_layers_replaced_every_step_hold_a_bounded_number_of_parameters(change, forward,
                                                                         context):
    m = net()
    ts.attach(m)
    if context == "permanent":
        ts.freeze(m, "2")
    ctx = ts.freeze(m, "0") if context == "with" else None
    change(m)
    m(x())
    before = counts()
    for _ in range(25):
        change(m)
        if forward:
            m(x())
    after = counts()
    # held until the next application: at most the parameters replaced since the last one
    assert after[0] <= before[0] and after[1:] == (before[1], before[2] + (
        0 if forward else (6 if change is _assign else 2)), *before[3:])
    if ctx is not None:
        ctx.__exit__(None, None, None)
    entries = [e for e in _state.entries if e.scope() is m]
    assert all(len(e.decided) <= 2 * len(list(m.parameters())) + 64 for e in entries)


def test_contexts_entered_and_left_on_models_that_come_and_go():
    keep = net()
    ts.attach(keep)
    before = counts()
    for i in range(20):
        m = Holder()
        m.body[0] = keep[0]
        with ts.freeze(m, "body.0"), ts.unfreeze(keep):
            m(x())
            keep(x())
        with ts.swap(m, {"body.2.weight": torch.zeros(2, 4)}):
            m(x())
        del m
    assert counts() == before
    assert all(flags(keep)) and reads(keep) == flags(keep)


# ----------------------------------------------------------------------------- swap path
def test_a_layer_taken_out_inside_a_context_converts_on_the_swap_path(swapping):
    """It left every attached tree: the context keeps what it decided without a weak
    reference of any kind (PyTorch's C++ swap check refuses a C++ weak reference too)."""
    m = net()
    twin = copy.deepcopy(m[2])
    with ts.freeze(m, "2"):
        old = m[2]
        m[2] = nn.Linear(4, 2)
        m(x())  # the application: `old` is let go, its flags back
        old.half()
        twin.half()
        old.load_state_dict(twin.state_dict())
        assert flags(old) == flags(twin) == [True, True]
        assert old.weight.dtype == torch.float16 and torch.equal(old.weight, twin.weight)
        old.float()
        m[2] = old  # back inside the block, swapped meanwhile: judged again ("2" picks it)
        m(x())
        assert flags(m) == [True] * 4 + [False, False] == reads(m)
    assert all(flags(m)) and no_weakrefs(m, old)


def test_a_parameter_back_then_converted_keeps_the_decision_swap_or_not(swapping):
    for swap in (True, False):
        torch.__future__.set_swap_module_params_on_conversion(swap)
        m = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 1))
        with pytest.warns(ts.RestoredFlagsWarning), ts.freeze(m, "1"):
            layer = m[1]
            del m[1]
            ts.attach(m)
            m.append(layer)  # back at "2": still the block's pick, whatever "1" names now
            m.to(torch.float64)
            ts.attach(m)
            assert flags(m) == [True, True, True, True, False, False] == reads(m)
        assert all(flags(m)) and no_weakrefs(m)


def test_data_replaced_while_out_is_judged_again_as_documented():
    """docs/freezing.md: new contents while out of every attached model: judged again."""
    m = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 1))
    with ts.freeze(m, "1"):
        layer = m[1]
        del m[1]
        ts.attach(m)
        layer.double()  # plain .data conversion while out
        layer.float()
        m.append(layer)  # at "2": "1" (the block's selector) does not pick it now
        ts.attach(m)
        assert flags(m) == [True] * 6 == reads(m)
    assert all(flags(m))


def test_optimizer_state_keyed_by_the_parameter_survives_a_swap_as_in_pytorch(swapping):
    plain, ours = net(), net()
    ts.freeze(ours, "0")
    for p in plain[0].parameters():
        p.requires_grad_(False)
    ots = ts.optim.AdamW(ours.parameters(), lr=0.1)
    opl = torch.optim.AdamW(plain.parameters(), lr=0.1, foreach=False)
    data = x()
    for model, opt in ((plain, opl), (ours, ots)):
        model(data).sum().backward()
        opt.step()
        ids = [id(p) for p in model.parameters()]
        cdata = [p._cdata for p in model.parameters()]
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
        assert [id(p) for p in model.parameters()] == ids
        assert all(p._cdata != c for p, c in zip(model.parameters(), cdata))  # swapped
        model(data).sum().backward()
        opt.step()
    assert len(ots.state) == len(opl.state) == 4
    for a, b in zip(plain.parameters(), ours.parameters()):
        assert a.requires_grad == b.requires_grad
        torch.testing.assert_close(a, b)
    assert no_weakrefs(ours)


@pytest.mark.parametrize("block", ["stop_gradient", "swap", "constant", "none"])
def test_buffers_and_parameters_load_under_the_future_flag_inside_blocks(swapping, block):
    m, twin = net(), net(3)
    ts.freeze(m, "1")
    m(x())
    ctx = {"stop_gradient": lambda: ts.stop_gradient(m, "2"),
           "swap": lambda: ts.swap(m, {"2.weight": torch.zeros(2, 4)}),
           "constant": lambda: ts.freeze(m, "0"),  # constant refuses swaps of its selection
           "none": lambda: ts.freeze(m, "2")}[block]
    with ctx():
        m.load_state_dict(twin.state_dict())
        m.train()(x())
    assert no_weakrefs(m)
    for a, b in zip(m.state_dict().values(), twin.state_dict().values()):
        assert torch.equal(a, b)
    assert flags(m) == [True, True, False, False, True, True] == reads(m)


# ----------------------------------------------------------------------------- flags
def test_a_shared_layer_follows_the_surviving_model_when_the_other_dies():
    shared = nn.Linear(3, 4)
    a = nn.Sequential(shared, nn.Linear(4, 1))
    b = nn.Sequential(shared, nn.Linear(4, 2))
    ts.attach(b)
    ts.freeze(a, "0")
    assert flags(shared) == [False, False] and reads(b) == flags(b)
    ref = weakref.ref(a)
    del a
    gc.collect()
    assert ref() is None
    b(x())
    assert all(flags(b)) and reads(b) == flags(b)
    assert no_weakrefs(b)


def test_a_parameter_moved_to_another_model_follows_its_new_model():
    a, b = net(), net(1)
    ts.attach(b)
    ts.freeze(a, "0")
    w = a[0].weight
    a[0].weight = nn.Parameter(torch.randn(4, 3))
    b[0].weight = w
    a(x())
    b(x())
    assert w.requires_grad and reads(b) == flags(b) == [True] * 6
    assert flags(a) == [False, False, True, True, True, True] == reads(a)


def test_functional_call_leaves_nothing_and_flags_stand():
    m = net()
    ts.freeze(m, "0")
    m(x())
    before = counts()
    for _ in range(5):
        params = {k: v.detach().clone().requires_grad_() for k, v in m.named_parameters()}
        torch.func.functional_call(m, params, (x(),))
    assert counts() == before
    assert flags(m) == [False, False, True, True, True, True] == reads(m)


def test_a_module_deleted_then_added_again_keeps_the_permanent_rule():
    m = net()
    ts.freeze(m, "2")
    layer = m[2]
    del m[2]
    ts.attach(m)
    assert all(flags(layer))  # left: its starting flag back
    m.append(layer)
    m(x())
    assert flags(m) == [True] * 4 + [False, False] == reads(m)


def test_a_new_parameter_at_the_id_of_one_that_left_and_died_is_judged_anew():
    m = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    with ts.freeze(m, "1.weight"):
        old = m[1].weight
        key = id(old)
        m[1].weight = nn.Parameter(torch.randn(1, 4))
        ts.attach(m)  # `old` left: the block keeps its decision without holding it
        del old
        gc.collect()
        pool, found = [], None
        for _ in range(20000):
            q = nn.Parameter(torch.empty(1, 4))
            if id(q) == key:
                found = q
                break
            pool.append(q)
        if found is None:
            pytest.skip("the id was not reused")
        del pool
        m.add_module("z", nn.Linear(4, 1))
        m.z.weight = found
        ts.attach(m)
        assert found.requires_grad and reads(m) == flags(m)  # "z.weight" is not picked
        assert flags(m) == [True, True, False, True, True, True]


def test_a_dtensor_layer_taken_out_inside_a_context_converts_and_comes_back(one_process_group):
    mesh, distribute_module = one_process_group
    m = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 1))
    distribute_module(m, mesh)
    with ts.freeze(m, "1"):
        old = m[1]
        m[1] = nn.Linear(4, 4)
        distribute_module(m[1], mesh)
        ts.attach(m)
        assert all(flags(old))
        old.to(torch.float64)  # DTensor parameters swap without the future flag
        old.to(torch.float32)
        assert type(old.weight).__name__ == "DTensor" and no_weakrefs(old)
        m[1] = old  # swapped while out: judged again; "1" picks it
        ts.attach(m)
        assert flags(m) == [True, True, False, False, True, True] == reads(m)
    assert all(flags(m)) and no_weakrefs(m)


def test_ddp_wrappers_rebuilt_each_epoch_hold_only_the_newest(one_process_group):
    from torchstruct import distributed
    m = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    ts.attach(m)
    for _ in range(5):
        ddp = nn.parallel.DistributedDataParallel(m)
        ddp(torch.randn(2, 3)).sum().backward()
        gc.collect()
        mine = [h for h in distributed._wrapped.values() if any(h[2] is p for p in m.parameters())]
        assert len(mine) == 4 and all(h[0]() is ddp for h in mine) and no_weakrefs(m)
        assert [r() for r, a in distributed._agreements.items()
                if any(q is p for _, q in a.pairs for p in m.parameters())] == [ddp]
    with pytest.raises(RuntimeError, match="find_unused_parameters"):
        ts.freeze(m, "0")
    assert all(flags(m))
    del ddp
    gc.collect()
    assert all(h[2] is not p for h in distributed._wrapped.values() for p in m.parameters())
    assert all(q is not p for a in distributed._agreements.values() for _, q in a.pairs
               for p in m.parameters())
    ts.freeze(m, "0")
    assert flags(m) == [False, False, True, True] == reads(m)


def test_ddp_wrappers_with_find_unused_parameters_rebuilt_leave_one_hook_per_parameter(
        one_process_group):
    """The check that the ranks agree on what trains hooks each synchronized parameter once
    per wrapper; a collected wrapper's hooks go with it."""
    from torchstruct import distributed
    m = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))

    def hooks():
        return [len(p._post_accumulate_grad_hooks or {}) for p in m.parameters()]

    for _ in range(4):
        ddp = nn.parallel.DistributedDataParallel(m, find_unused_parameters=True)
        for _ in range(2):
            ddp(torch.randn(2, 3)).sum().backward()
        gc.collect()
        assert hooks() == [1, 1, 1, 1]
    del ddp
    gc.collect()
    assert hooks() == [0, 0, 0, 0] and not [
        a for a in distributed._agreements.values() if any(q is m[0].weight for _, q in a.pairs)]


def test_a_collection_that_would_start_an_unsynchronized_parameter_training_writes_nothing(
        one_process_group):
    """The other model's declaration froze a shared layer before the survivor was wrapped: DDP
    does not synchronize it, so the survivor's application at the collection is refused (no
    flag written, no warning from garbage collection) and its next forward raises the DDP
    refusal, as it did before the collection could apply at once."""
    shared = nn.Linear(2, 2)
    a = nn.Sequential(nn.Linear(2, 2), shared)
    b = nn.Sequential(shared)
    ts.attach(a)
    ts.mark_trainable(b)
    ddp = nn.parallel.DistributedDataParallel(a)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        del b
        gc.collect()
    assert flags(a) == [True, True, False, False] and not seen, [str(w.message) for w in seen]
    with pytest.raises(RuntimeError, match="would start training"):
        ddp(torch.randn(1, 2))
    assert flags(a) == [True, True, False, False]


def test_an_inner_model_sharing_a_layer_dies_inside_the_outer_context():
    shared = nn.Linear(3, 3)
    outer = nn.Sequential(shared, nn.Linear(3, 1))
    data = torch.randn(2, 3)
    with ts.freeze(outer, "1"):
        inner = nn.Sequential(shared, nn.Linear(3, 2))
        ts.freeze(inner)  # permanent, on the inner model only
        outer(data)
        assert flags(outer) == [False] * 4 == reads(outer)
        ref = weakref.ref(inner)
        del inner
        gc.collect()
        assert ref() is None
        assert reads(outer) == [True, True, False, False]  # reads at once (docs)
        outer(data)  # flags at the survivor's next forward
        assert flags(outer) == [True, True, False, False] == reads(outer)
    assert all(flags(outer)) and all(reads(outer)) and no_weakrefs(outer)


def test_a_context_of_a_dead_model_on_a_shared_layer_lifts_for_the_survivor():
    shared = nn.Linear(3, 3)
    outer = nn.Sequential(shared, nn.Linear(3, 1))
    ts.attach(outer)
    inner = nn.Sequential(shared, nn.Linear(3, 2))
    ctx = ts.freeze(inner, "0")
    outer(torch.randn(2, 3))
    assert flags(outer) == [False, False, True, True] == reads(outer)
    before = len(_state.records)
    del inner, ctx
    gc.collect()
    outer(torch.randn(2, 3))
    assert all(flags(outer)) and all(reads(outer))
    assert len(_state.records) == before - 2  # the dead model's own layer is let go


@pytest.mark.parametrize("first", ["source", "target"])
def test_a_parameter_moved_between_attached_models_inside_a_context(first):
    a = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    b = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    ts.attach(b)
    data = torch.randn(2, 3)
    with ts.freeze(a, "0"):
        w = a[0].weight
        b[0].weight = w  # out of the block's model: its own flag back
        a[0].weight = nn.Parameter(torch.randn(3, 3))  # a new weight at "0": picked
        for m in ((a, b) if first == "source" else (b, a)):
            m(data)
        assert flags(a) == [False, False, True, True] == reads(a)
        assert all(flags(b)) and all(reads(b))
    assert all(flags(a)) and all(flags(b)) and no_weakrefs(a, b)


class SparseHolder(nn.Module):
    def __init__(self, layout):
        super().__init__()
        torch.manual_seed(0)
        dense = torch.randn(3, 3)
        self.w = nn.Parameter(dense.to_sparse() if layout == "coo" else dense.to_sparse_csr())

    def forward(self, t):
        return t


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_a_sparse_layer_taken_out_inside_a_context_converts_on_the_swap_path(swapping, layout):
    plain = SparseHolder(layout)
    plain.double()  # what PyTorch does with it
    m = nn.Sequential(nn.Linear(3, 3), SparseHolder(layout))
    with ts.freeze(m, "1"):
        old = m[1]
        m[1] = SparseHolder(layout)
        ts.attach(m)
        old.double()
        assert old.w.dtype == plain.w.dtype == torch.float64 and old.w.requires_grad
        assert torch.equal(old.w.to_dense(), plain.w.to_dense())
        m[1] = old  # swapped while out: judged again, "1" picks it
        ts.attach(m)
        assert flags(m) == [True, True, False] == reads(m)
    assert all(flags(m))


@pytest.mark.filterwarnings("ignore::torchstruct.RestoredFlagsWarning")
def test_threads_replacing_layers_and_re_adding_them_inside_contexts():
    errors = []
    models = [net(i) for i in range(3)]
    for m in models:
        ts.attach(m)

    def run(m):
        try:
            for _ in range(15):
                with ts.freeze(m, "2"):
                    old = m[2]
                    m[2] = nn.Linear(4, 2)
                    m(x())
                    assert all(flags(old)) and flags(m)[-2:] == [False, False]
                    m[2] = old  # back: the block's decision for it (picked)
                    m(x())
                    assert flags(m) == [True] * 4 + [False, False] == reads(m)
                assert all(flags(m))
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    before = counts()
    threads = [threading.Thread(target=run, args=(m,)) for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert counts() == before and no_weakrefs(*models)


def test_a_parameter_that_left_is_held_exactly_until_the_next_application():
    m = net()
    ts.freeze(m, "2")
    m(x())
    old = m[2]
    alive = [torch._C._WeakTensorRef(p) for p in old.parameters()]
    m[2] = nn.Linear(4, 2)
    del old
    gc.collect()
    assert not any(r.expired() for r in alive)  # held (docs: until the next application)
    m(x())
    gc.collect()
    assert all(r.expired() for r in alive)


def swappable(*models):
    """Whether every parameter and buffer swaps with a copy of itself (and back): PyTorch's
    own check, which refuses a Python or a C++ weak reference to the tensor."""
    for m in models:
        for t in [*m.parameters(), *m.buffers()]:
            other = (nn.Parameter(t.detach().clone(), t.requires_grad)
                     if isinstance(t, nn.Parameter) else t.detach().clone())
            try:
                torch.utils.swap_tensors(t, other)
                torch.utils.swap_tensors(t, other)
            except RuntimeError:
                return False
    return True


@pytest.mark.filterwarnings("ignore::torchstruct.RestoredFlagsWarning")
def test_every_tensor_of_an_attached_model_swaps_in_every_situation():
    m = net()
    shared = net(1)
    shared[0] = m[0]
    ts.attach(shared)
    assert swappable(m)
    with ts.freeze(m, "0"), ts.unfreeze(m, "0.bias"):
        m(x())
        assert swappable(m, shared)
        old = m[2]
        m[2] = nn.Linear(4, 2)
        m(x())
        assert swappable(m, old)
        m[2] = old
        with ts.stop_gradient(m, "2"), ts.swap(m, {"0.bias": torch.zeros(4)}):
            m(x()).sum().backward()
            assert swappable(old)
        m(x())
        assert swappable(m, shared)
    sched = ts.UnfreezeSchedule(m, {0: "2", 1: None})
    opt = ts.optim.AdamW(m.parameters())
    m(x()).sum().backward()
    opt.step()
    sched.step()
    assert swappable(m, shared)
    assert flags(m) == reads(m) and flags(shared) == reads(shared)


def _grads_and_step(model, opt):
    for p in model.parameters():
        p.grad = torch.ones_like(p) if p.requires_grad else None
    opt.step()


@pytest.mark.parametrize("block", ["stop_gradient", "swap", "freeze"])
def test_a_dtensor_model_converts_inside_blocks_and_its_optimizer_state_follows(
        one_process_group, block):
    mesh, distribute_module = one_process_group
    m, plain = net(), net()
    for model in (m, plain):
        distribute_module(model, mesh)
    ts.freeze(m, "0")
    for p in plain[0].parameters():
        p.requires_grad_(False)
    opt = ts.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    opl = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9, foreach=False)
    _grads_and_step(m, opt)
    _grads_and_step(plain, opl)
    ctx = {"stop_gradient": lambda: ts.stop_gradient(m, "2"),
           "swap": lambda: ts.swap(m, {"2.bias": torch.zeros_like(m[2].bias)}),
           "freeze": lambda: ts.freeze(m, "2")}[block]
    ids = [id(p) for p in m.parameters()]
    with ctx():
        m.to(torch.float64)  # DTensor parameters swap
        assert [id(p) for p in m.parameters()] == ids and no_weakrefs(m)
    m.to(torch.float32)  # docs/stop_gradient.md: a conversion converts the parameters
    plain.to(torch.float64)  # themselves inside swap too, never their stand-ins
    plain.to(torch.float32)
    assert flags(m) == flags(plain) == reads(m) == [False, False, True, True, True, True]
    _grads_and_step(m, opt)
    _grads_and_step(plain, opl)
    assert len(opt.state) == len(opl.state) == 4
    for a, b in zip(m.parameters(), plain.parameters()):
        torch.testing.assert_close(a.full_tensor(), b.full_tensor())


def test_permanent_contexts_on_submodules_replaced_each_step_leave_nothing():
    m = net()
    ts.attach(m)
    m(x())
    before = counts()
    for _ in range(10):
        ts.freeze(m[2])  # permanent, on the layer only
        m(x())
        assert flags(m)[-2:] == [False, False] == reads(m)[-2:]
        m[2] = nn.Linear(4, 2)  # the layer, with its context, goes away
        m(x())
        assert all(flags(m)) and all(reads(m))
    assert counts() == before


@pytest.mark.parametrize("reentrant", [None, True, False])
def test_a_collection_inside_a_backward_applies_the_survivor_as_the_backward_ends(reentrant):
    """A model sharing a layer with an attached one is collected half-way through a backward
    (here from a gradient hook): the survivor's flags do not change during the backward (a
    checkpoint's recomputation later in it must record what the forward did) and agree with
    the reads once it has ended."""
    shared = nn.Linear(2, 2)
    a = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), shared)
    b = nn.Sequential(shared)
    ts.attach(a)
    ts.mark_trainable(b)  # trains nothing: the shared layer is frozen in a too, while b lives
    assert flags(a) == [True, True, False, False]
    box, seen = [b], []
    del b
    x = torch.randn(3, 2, requires_grad=True)
    y = a(x) if reentrant is None else torch.utils.checkpoint.checkpoint(
        a, x, use_reentrant=reentrant)

    def hook(grad):
        box.clear()
        gc.collect()
        seen.append(flags(a))
        return grad

    y.register_hook(hook)
    ref = copy.deepcopy(a)
    ts.detach_hooks(ref)
    ref[2].requires_grad_(False)
    y.sum().backward()
    ref(x.detach()).sum().backward()
    assert seen == [[True, True, False, False]]  # unchanged inside the backward
    assert flags(a) == reads(a) == [True] * 4  # applied as it ended
    for p, q in zip(a.parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if q.grad is not None:
            assert torch.equal(p.grad, q.grad)
