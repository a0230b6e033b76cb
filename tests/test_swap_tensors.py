"""Attached models convert as in plain PyTorch where PyTorch swaps tensors.

``torch.utils.swap_tensors`` (``module.to()``, ``.half()``, ``to_empty`` and ``load_state_dict``
under ``torch.__future__.set_swap_module_params_on_conversion(True)``, and ``module.to()`` of
tensor-subclass parameters such as DTensor) refuses a tensor that has a Python weak reference,
and keeps the parameter object (same ``id``, new contents). torchstruct holds no weak reference
to a parameter, and what it remembers of one (starting flag, the flag it wrote, a context's
decision, a model sharing it) follows the object across the swap. Every check compares with a
twin model that was never converted, or with plain PyTorch.
"""
import copy
import gc
import weakref

import pytest
import torch
from torch import nn

import torchstruct as ts
from _flags import flags, reads
from torchstruct import _state


def net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 4), nn.Linear(4, 1))


def x(dtype=torch.float32):
    return torch.randn(5, 3, dtype=dtype)


def no_weakrefs(*models):
    """Whether no parameter of ``models`` has a Python weak reference."""
    return all(weakref.getweakrefs(p) == [] for m in models for p in m.parameters())


def records(m):
    """torchstruct's starting flag of each parameter, as it stands now (None: not written)."""
    return [r[0] if (r := _state.current(p)) is not None else None for p in m.parameters()]


def convert(m, how, dtype=torch.float64):
    """Convert ``m`` in place one way; returns the dtype its floating parameters have then."""
    if how == "to":
        m.to(dtype)
        return dtype
    if how == "half":
        m.half()
        return torch.float16
    if how == "to_empty":
        state = {k: v.clone() for k, v in m.state_dict().items()}
        m.to_empty(device="cpu")
        m.load_state_dict(state)
        return torch.float32
    if how == "load_state_dict":
        twin = net(seed=7)
        m.load_state_dict(twin.state_dict())
        assert all(torch.equal(a, b) for a, b in zip(m.parameters(), twin.parameters()))
        return torch.float32
    raise AssertionError(how)


HOWS = ["to", "half", "to_empty", "load_state_dict"]


# ----------------------------------------------------------------------------- the xfail's case
@pytest.mark.parametrize("how", HOWS)
def test_plain_pytorch_swaps_and_so_does_an_attached_model(swapping, how):
    plain, attached = net(), net()
    ts.attach(attached)
    for m in (plain, attached):
        ids = [id(p) for p in m.parameters()]
        dtype = convert(m, how)
        assert [id(p) for p in m.parameters()] == ids  # swapped: the same objects
        assert all(p.dtype == dtype for p in m.parameters())
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(),
                                                  attached.state_dict().values()))
    assert no_weakrefs(attached)


# ----------------------------------------------------------------------------- contexts
@pytest.mark.parametrize("how", HOWS)
def test_conversion_inside_freeze_except_restores_flags_as_on_a_model_never_converted(
        swapping, how):
    m, twin = net(), net()
    for model in (m, twin):
        model[2].bias.requires_grad_(False)  # a starting flag the user set
    with ts.freeze_except(m, "2", "3"), ts.freeze_except(twin, "2", "3"):
        assert no_weakrefs(m, twin)
        dtype = convert(m, how)
        assert m[0].weight.dtype == dtype
        assert no_weakrefs(m)
        m[3].bias.requires_grad_(False)  # a write by hand inside the block stands after it
        twin[3].bias.requires_grad_(False)
        if dtype != torch.float16:  # no half-precision linear on every CPU build
            m(x(dtype)).sum().backward()
        twin(x()).sum().backward()
        assert flags(m) == flags(twin) == reads(m) == reads(twin)
        assert flags(m) == [False, False, False, False, True, False, True, False]
    assert flags(m) == flags(twin) == reads(m) == reads(twin)
    assert flags(m) == [True, True, True, True, True, False, True, False]
    assert records(m) == records(twin)
    assert no_weakrefs(m, twin)


def test_a_context_decision_follows_the_parameter_across_a_swap(swapping):
    """A callable selector is asked once per parameter: after the swap it is not asked again
    (the parameter is the same object), so what the block picked stays picked."""
    m, asked = net(), []

    def pick(path, p):
        asked.append(path)
        return p.requires_grad and path.startswith("0.")

    with ts.freeze(m, pick):
        before = flags(m)
        asked.clear()
        m.to(torch.float64)
        m.load_state_dict(net(seed=3).state_dict())
        m(x(torch.float64))
        ts.attach(m)
        assert asked == [] and flags(m) == before == reads(m)
    assert all(flags(m)) and no_weakrefs(m)


def test_a_bare_freeze_survives_conversion_and_the_next_forward(swapping):
    m = net()
    ts.freeze(m, "0", "1")
    m.to(torch.float64)
    m(x(torch.float64))
    assert flags(m) == [False] * 4 + [True] * 4 == reads(m)
    m.append(nn.Linear(1, 1, dtype=torch.float64))  # a registration: applied at the forward
    m(x(torch.float64))
    assert flags(m) == [False] * 4 + [True] * 6 == reads(m)
    ts.unfreeze(m, "0")
    assert flags(m) == [True, True, False, False] + [True] * 6
    assert no_weakrefs(m)


# ----------------------------------------------------------------------------- declarations
class Declared(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(3, 4)
        self.head = nn.Linear(4, 1)

    def trainable(self):
        return ["head"]

    def forward(self, inp):
        return self.head(self.body(inp))


@pytest.mark.parametrize("how", HOWS[:2])
def test_declarations_hold_across_conversion_and_lift_to_the_starting_flags(swapping, how):
    m = Declared()
    m.head.bias.requires_grad_(False)  # a starting flag
    inner = nn.Linear(4, 4)
    m.extra = inner
    ts.mark_trainable(inner, "bias")
    ts.attach(m)
    want = {"body.weight": False, "body.bias": False, "head.weight": True, "head.bias": False,
            "extra.weight": False, "extra.bias": False}  # extra: not listed by trainable()
    assert dict((n, p.requires_grad) for n, p in m.named_parameters()) == want
    convert(m, how)
    if how != "half":
        m(torch.randn(2, 3, dtype=torch.float64))
    assert dict((n, p.requires_grad) for n, p in m.named_parameters()) == want
    assert no_weakrefs(m)
    ts.mark_trainable(m, "head", "extra")
    ts.mark_trainable(inner, None)
    assert dict((n, p.requires_grad) for n, p in m.named_parameters()) == {
        **want, "extra.weight": True, "extra.bias": True}
    assert no_weakrefs(m)


# ----------------------------------------------------------------------------- shared
def test_a_parameter_shared_by_two_models_keeps_both_models_rules_across_a_swap(swapping):
    shared = nn.Linear(3, 3)
    a = nn.Sequential(shared, nn.Linear(3, 1))
    b = nn.Sequential(shared)
    ts.attach(a)
    ts.mark_trainable(b)  # b trains nothing: the shared layer is frozen for a too
    assert not shared.weight.requires_grad
    a.to(torch.float64)  # swaps the shared layer's parameters (b's too: the same objects)
    assert b[0].weight is shared.weight and shared.weight.dtype == torch.float64
    a(x(torch.float64))
    assert flags(a) == [False, False, True, True] == reads(a)
    assert not any(reads(b))
    ts.mark_trainable(b, None)
    assert all(flags(a)) and all(reads(a)) and all(reads(b))
    b.to(torch.float32)  # a's parameters too: the shared layer only
    with ts.freeze(b):
        assert flags(a) == [False, False, True, True]
    assert all(flags(a)) and no_weakrefs(a, b)


# ----------------------------------------------------------------------------- optimizers
def test_adamw_steps_after_conversion_as_torch_and_skips_frozen(swapping):
    m, twin = net(), net()
    ts.freeze(m, "0")
    twin[0].requires_grad_(False)
    opt = ts.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    for model in (m, twin):
        model.to(torch.float64)
    frozen = m[0].weight.detach().clone()
    torch.manual_seed(1)
    inp = x(torch.float64)
    for model, o in ((m, opt), (twin, ref)):
        for _ in range(3):
            o.zero_grad()
            model(inp).pow(2).sum().backward()
            o.step()
    assert torch.equal(m[0].weight, frozen) and m[0].weight not in opt.state
    for p, q in zip(m.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=0)
    assert no_weakrefs(m)


# ----------------------------------------------------------------------------- real subclass
def test_a_dtensor_model_converts_inside_a_context(one_process_group):
    """DTensor parameters: ``module.to()`` swaps them with no future flag set."""
    mesh, distribute_module = one_process_group
    m = net()
    distribute_module(m, mesh)
    ids = [id(p) for p in m.parameters()]
    kind = type(m[0].weight)
    with ts.freeze_except(m, "3"):
        assert no_weakrefs(m)
        m.to(torch.float64)
        assert [id(p) for p in m.parameters()] == ids
        assert type(m[0].weight) is kind and m[0].weight.dtype == torch.float64
        assert flags(m) == [False] * 6 + [True] * 2 == reads(m)
    assert all(flags(m)) and all(reads(m)) and no_weakrefs(m)


def test_fully_shard_after_a_context_frees_the_unsharded_parameters_at_the_next_forward(
        one_process_group):
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        pytest.skip("FSDP2 (fully_shard) is not available in this torch")
    m = net()
    with ts.freeze_except(m, "3"):
        unsharded = [_alive(p) for p in m.parameters()]
        for layer in (m[0], m[2], m[3]):
            fully_shard(layer)
        fully_shard(m)  # sharded parameters put in place without registration
        m(x()).sum().backward()
        gc.collect()
        assert all(t.expired() for t in unsharded)
        assert type(m[0].weight).__name__ == "DTensor"
        assert flags(m) == [False] * 6 + [True] * 2 == reads(m)
        assert m[0].weight.grad is None and m[3].weight.grad is not None
    assert all(flags(m)) and no_weakrefs(m)


def test_ddp_bookkeeping_holds_no_weak_reference(one_process_group):
    m = net()
    ddp = nn.parallel.DistributedDataParallel(m)
    assert no_weakrefs(m)
    with pytest.raises(RuntimeError, match="find_unused_parameters=False"):
        ts.freeze(m, "0")
    assert all(flags(m)) and no_weakrefs(m)
    del ddp
    gc.collect()
    from torchstruct import distributed
    assert all(hit[2] is not p for hit in distributed._wrapped.values() for p in m.parameters())


# ----------------------------------------------------------------------------- no weak references
def test_no_weak_reference_to_a_parameter_anywhere():
    m = net()
    checked = []

    def check(what):
        assert no_weakrefs(m), what
        checked.append(what)

    ts.attach(m)
    check("attach")
    ts.mark_trainable(m, "0", "1", "2", "3")
    check("declaration")
    with ts.freeze(m, "0"), ts.unfreeze(m, "0.bias"), ts.freeze_except(m, "0", "3"):
        check("contexts")
        with ts.stop_gradient(m, "3"):
            m(x()).sum().backward()
            check("stop_gradient")
        with ts.swap(m, {"3.weight": torch.zeros(1, 4)}):
            m(x())
            check("swap")
        with ts.constant(m, "1"):
            m(x())
            check("constant")
    schedule = ts.UnfreezeSchedule(m, {0: "3", 2: "2"})
    schedule.step()
    schedule.step()
    check("schedule")
    opt = ts.optim.AdamW(m.parameters(), lr=1e-3)
    m(x()).sum().backward()
    opt.step()
    check("ts.optim")
    tree = ts.structural_grad(m, lambda model: model(x()).sum())
    assert set(tree) == {"2", "3"}
    check("structural_grad")
    ts.clip_by_global_norm(m, 1.0)
    check("clip")
    assert len(checked) == 10


# ----------------------------------------------------------------------------- lifetime
def _alive(p):
    """A C++ weak reference to ``p``'s tensor (no Python weak reference on ``p``)."""
    return torch._C._WeakTensorRef(p)


def test_a_dropped_attached_model_is_collected_with_its_parameters(swapping):
    gc.collect()
    sizes = len(_state.records), len(_state.live_states())
    models, tensors = [], []
    for i in range(4):
        m = net(i)
        if i == 0:
            ts.mark_trainable(m, "3")
        elif i == 1:
            with ts.freeze_except(m, "2"):
                m.to(torch.float64)
        elif i == 2:
            ts.attach(m)
            m.half()
        else:  # last, so that no later context prunes it: a permanent context ends with m
            ts.freeze(m, "0")
        models.append(weakref.ref(m))
        tensors += [_alive(p) for p in m.parameters()]
        assert len(_state.records) == sizes[0] + 8
    del m
    gc.collect()
    assert [r() for r in models] == [None] * 4
    assert all(t.expired() for t in tensors)
    assert (len(_state.records), len(_state.live_states())) == sizes


def test_parameters_that_left_the_tree_are_freed_at_the_next_application():
    m = net()
    ts.freeze(m, "0")  # permanent: its decisions must not keep replaced parameters alive
    old = []
    for seed in range(3):
        state = {k: v.clone() for k, v in net(seed).state_dict().items()}
        old += [_alive(p) for p in m.parameters()]
        m.load_state_dict(state, assign=True)
        m(x())
        assert flags(m) == [False, False] + [True] * 6 == reads(m)
    gc.collect()
    assert all(t.expired() for t in old)
    entry = next(e for e in _state.entries if e.scope() is m)
    held = [v[0] for v in entry.decided.values() if isinstance(v[0], torch.Tensor)]
    assert sorted(map(id, held)) == sorted(id(p) for p in m.parameters())


def test_a_parameter_that_left_and_came_back_keeps_what_the_context_decided():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 1))
    ts.attach(m)
    said = pytest.warns(ts.RestoredFlagsWarning, match="'2.weight', '2.bias'")  # (a layer
    with said, ts.freeze(m, "1"):  # was added inside the block: leaving it says so)
        layer = m[1]
        del m[1]  # "1" now names the last layer, which the block did not pick
        ts.attach(m)  # an application: the layer left, it gets its flag back
        assert all(flags(layer)) and all(flags(m)) and no_weakrefs(layer)
        m.append(layer)  # back, at "2": still picked by the block
        m.to(torch.float64)
        ts.attach(m)
        assert flags(m) == [True, True, True, True, False, False] == reads(m)
    assert all(flags(m)) and no_weakrefs(m)


def test_a_deepcopy_of_an_attached_model_is_plain_pytorch_and_converts(swapping):
    m = net()
    ts.freeze(m, "0")
    clone = copy.deepcopy(m)  # plain PyTorch until attached itself
    assert no_weakrefs(clone) and records(clone) == [None] * 8
    clone.to(torch.float64)
    clone(x(torch.float64))
    assert flags(clone) == flags(m) == [False, False] + [True] * 6
    ts.unfreeze(clone)
    assert all(flags(clone)) and flags(m) == [False, False] + [True] * 6


def test_a_context_on_a_module_that_left_holds_its_parameters_only_while_it_can_end():
    m = net()
    ts.attach(m)
    sub = m[0]
    with ts.freeze(sub):
        m[0] = nn.Linear(3, 4)  # the block's module leaves the model
        m(x())
        assert not any(flags(sub)) and all(flags(m))
    assert all(flags(sub)) and no_weakrefs(sub)  # restored when the block ended
    tensors = [_alive(p) for p in sub.parameters()]
    del sub
    gc.collect()
    assert all(t.expired() for t in tensors)

    sub = m[0]
    ts.freeze(sub)  # permanent: ends with sub
    m[0] = nn.Linear(3, 4)
    m(x())  # sub's parameters left m; the context on sub holds them
    tensors = [_alive(p) for p in sub.parameters()]
    del sub
    gc.collect()
    ts.attach(m)  # m's next application forgets them
    gc.collect()
    assert all(t.expired() for t in tensors)
    assert all(flags(m)) and no_weakrefs(m)


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_a_model_collected_inside_a_torch_func_transform_releases_its_parameters_quietly():
    """The model dies inside ``torch.func.grad``, which refuses ``requires_grad_()``: the
    kept layer still gets its flags back, and nothing is raised from the collection."""
    kept = nn.Linear(3, 3)
    box = [nn.Sequential(kept, nn.Linear(3, 1))]
    ts.freeze(box[0], "0")
    assert not any(flags(kept))

    def loss(inp):
        box.clear()  # the model's last reference: collected here, inside the transform
        return inp.pow(2).sum()

    g = torch.func.grad(loss)(torch.ones(2))
    gc.collect()
    assert torch.equal(g, torch.full((2,), 2.0))
    assert all(flags(kept)) and _state.record(kept.weight) is None


def test_a_block_on_a_module_taken_out_of_a_collected_model_holds_until_it_ends():
    box = [net()]
    ts.attach(box[0])
    sub = box[0][0]
    with ts.freeze(sub):
        box[0][0] = nn.Linear(3, 4)
        box[0](x())  # sub left the model; the block still holds it
        box.clear()
        gc.collect()  # the model is collected while the block is active
        assert not any(flags(sub))
        sub(x())
        assert not any(flags(sub))
    assert all(flags(sub)) and no_weakrefs(sub)
    tensors = [_alive(p) for p in sub.parameters()]
    del sub
    gc.collect()
    assert all(t.expired() for t in tensors)


def test_a_block_on_a_part_of_a_collected_model_holds_the_part_until_it_ends():
    box = [net()]
    ts.attach(box[0])
    sub = box[0][0]
    with ts.freeze(sub):
        box.clear()
        gc.collect()  # the model is collected; its first layer lives on, inside the block
        assert not any(flags(sub))
    assert all(flags(sub)) and no_weakrefs(sub)
    tensors = [_alive(p) for p in sub.parameters()]
    del sub
    gc.collect()
    assert all(t.expired() for t in tensors)


@pytest.mark.parametrize("block", ["stop_gradient", "swap"])
@pytest.mark.parametrize("how", ["to", "load_state_dict"])
def test_conversion_inside_a_block_keeps_the_parameters_own_flags(swapping, block, how):
    """PyTorch builds the tensor swapped into a parameter with the parameter's flag; inside a
    block, whose stand-ins read ``requires_grad`` False, it must still be the parameter's."""
    m, twin = net(), net()
    for model in (m, twin):
        ts.freeze(model, "1")
        model[2].bias.requires_grad_(False)  # a write by hand: it stands
    with (ts.stop_gradient(m, "0", "2") if block == "stop_gradient"
          else ts.swap(m, {"0.weight": torch.zeros(4, 3)})):
        convert(m, how)  # (flags read here are the stand-ins')
    assert flags(m) == flags(twin) == reads(m) == reads(twin)
    assert records(m) == records(twin) and no_weakrefs(m)
    ts.unfreeze(m, "1")
    ts.unfreeze(twin, "1")
    assert flags(m) == flags(twin) == [True] * 5 + [False] + [True] * 2


def test_parameters_replaced_without_registration_are_freed_at_the_next_application():
    """FSDP2's ``fully_shard`` writes ``module._parameters`` directly: the hook does not see
    it; the next application takes the new objects as copies and lets go of the old ones."""
    m = net()
    with ts.freeze(m, "0"):
        old = [_alive(p) for p in m[0].parameters()]
        for name in ("weight", "bias"):  # copies carrying the flag torchstruct wrote (False)
            p = m[0]._parameters[name]
            m[0]._parameters[name] = nn.Parameter(p.detach().clone(), requires_grad=False)
        del p
        ts.attach(m)
        gc.collect()
        assert all(t.expired() for t in old)
        assert flags(m) == [False, False] + [True] * 6 == reads(m)
    assert all(flags(m)) and no_weakrefs(m)
