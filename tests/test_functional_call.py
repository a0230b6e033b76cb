"""``torch.func.functional_call`` on an attached model whose tree changed (docs/freezing.md).

The model's forward under ``functional_call`` runs on stand-ins, which are never written; the
waiting change is applied to the model's own parameters before the call (as a forward would)
and once it has returned (a change made while it ran), except inside a ``torch.func``
transform, another ``functional_call`` or a backward, where it waits for the next forward or
call outside them. Every expectation is the flags a plain forward outside would give.
"""
import gc

import pytest
import torch
from torch import nn

import torchstruct as ts
from _flags import consistent, flags, reads
from torchstruct import _state

FROZEN_HEAD = [False, False, True, True, False, False]  # freeze_except("1") after an append


def grown():
    """A bare freeze_except("1") applied, then a head appended (frozen by it once applied,
    its own flags True until then)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    ts.freeze_except(m, "1")
    m(torch.randn(2, 3))
    m.append(nn.Linear(1, 1))
    assert flags(m) == [False, False, True, True, True, True]
    return m


def stand_ins(m, requires_grad=True):
    return {k: v.detach().clone().requires_grad_(requires_grad)
            for k, v in m.named_parameters()}


def plain_grads(m, params, x):
    """The same call on a plain copy of the model, every tensor a fresh leaf."""
    ref = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    torch.func.functional_call(m, ref, (x,)).pow(2).sum().backward()
    return {k: v.grad for k, v in ref.items()}


@pytest.mark.parametrize("as_parameters", [False, True])
def test_the_call_applies_the_change_to_the_model_and_leaves_the_stand_ins_alone(as_parameters):
    m = grown()
    own = list(m.parameters())
    params = stand_ins(m)
    if as_parameters:
        params = {k: nn.Parameter(v.detach()) for k, v in params.items()}
    x = torch.randn(4, 3)
    torch.func.functional_call(m, params, (x,)).pow(2).sum().backward()
    assert flags(m) == reads(m) == FROZEN_HEAD and consistent(m)
    assert all(a is b for a, b in zip(own, m.parameters()))  # the model's own, put back
    assert all(v.requires_grad and v.grad is not None for v in params.values())
    assert all(p.grad is None for p in m.parameters())
    assert not getattr(m, _state.CHANGED, False)
    want = plain_grads(m, params, x)
    for k, v in params.items():
        assert torch.equal(v.grad, want[k]), k


def test_an_invalid_declaration_is_raised_before_the_call_runs_and_writes_nothing():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    ts.unfreeze(m)  # bare: every parameter trains, an integer one cannot
    m(torch.randn(2, 3))
    m[0].requires_grad_(False)  # by hand: stands until the next application
    m.register_parameter("index", nn.Parameter(torch.zeros(2, dtype=torch.long),
                                               requires_grad=False))
    calls = []
    m[0].register_forward_hook(lambda *a: calls.append(1))
    before = flags(m)
    with pytest.raises(ValueError, match="index"):
        torch.func.functional_call(m, stand_ins(m, requires_grad=False), (torch.randn(2, 3),))
    assert not calls and flags(m) == before
    with pytest.raises(ValueError, match="index"):
        m(torch.randn(2, 3))  # the forward raises the same error
    assert not calls and flags(m) == before
    del m._parameters["index"]
    m(torch.randn(2, 3))
    assert consistent(m)


def test_a_call_that_raises_applies_before_it_and_writes_nothing_after():
    m = grown()

    def boom(*_):
        m[0].extra = nn.Linear(1, 1)  # a change made while the call runs
        raise KeyError("boom")

    handle = m[0].register_forward_hook(boom)
    with pytest.raises(KeyError):
        torch.func.functional_call(m, stand_ins(m), (torch.randn(2, 3),))
    handle.remove()
    # the head appended before the call got its flag; the layer added during it waits
    assert [p.requires_grad for n, p in m.named_parameters() if "extra" not in n] == FROZEN_HEAD
    assert m[0].extra.weight.requires_grad and m[0].extra.bias.requires_grad
    m(torch.randn(2, 3))
    assert not m[0].extra.weight.requires_grad and consistent(m)


def test_a_change_made_during_the_call_is_applied_as_it_returns():
    m = grown()
    handle = m[0].register_forward_hook(
        lambda *_: setattr(m[0], "extra", nn.Linear(1, 1)))  # a change while the call runs
    torch.func.functional_call(m, stand_ins(m), (torch.randn(2, 3),))
    handle.remove()
    assert flags(m) == reads(m) == [False, False, False, False, True, True, False, False]
    assert not getattr(m, _state.CHANGED, False)


def test_inside_a_torch_func_transform_the_change_waits_and_the_gradients_are_plain():
    m = grown()
    x = torch.randn(4, 3)
    params = stand_ins(m, requires_grad=False)
    g = torch.func.grad(lambda p: torch.func.functional_call(m, p, (x,)).pow(2).sum())(params)
    assert flags(m) == [False, False, True, True, True, True]  # requires_grad_ is refused there
    want = plain_grads(m, params, x)
    for k in params:
        torch.testing.assert_close(g[k], want[k])
    torch.func.functional_call(m, params, (x,))  # the next call outside applies
    assert flags(m) == reads(m) == FROZEN_HEAD


def test_vmap_over_stacked_ensemble_states_waits_and_matches_each_model():
    models = [grown() for _ in range(3)]
    stacked, _ = torch.func.stack_module_state(models)
    x = torch.randn(4, 3)
    out = torch.func.vmap(lambda p: torch.func.functional_call(models[0], p, (x,)))(stacked)
    for i, mm in enumerate(models):
        torch.testing.assert_close(out[i], mm(x))  # each model's own forward applies
        assert flags(mm) == FROZEN_HEAD
    assert flags(models[0]) == FROZEN_HEAD


def test_a_nested_call_waits_for_the_outermost_to_return():
    m = grown()
    ts.attach(m)
    m(torch.randn(2, 3))  # applied

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = m

        def forward(self, x):
            m.append(nn.Linear(1, 1))  # a change while the outer call runs
            inner = {k: v.detach().clone() for k, v in m.named_parameters()}
            seen.append(flags(m))
            y = torch.func.functional_call(m, inner, (x,))
            seen.append(flags(m))  # the outer call's stand-ins are in place: nothing written
            return y

    seen = []
    outer = Outer()
    params = {k: v.detach().clone().requires_grad_() for k, v in outer.named_parameters()}
    torch.func.functional_call(outer, params, (torch.randn(2, 3),))
    assert seen[0] == seen[1] == [True] * 6 + [True, True]  # the stand-ins' own flags
    assert all(v.requires_grad for v in params.values())
    assert flags(m) == reads(m) == FROZEN_HEAD + [False, False]


def test_a_call_on_another_model_applies_nothing_of_this_one_and_raises_none_of_its_errors():
    m = grown()
    m.register_parameter("index", nn.Parameter(torch.zeros(2, dtype=torch.long),
                                               requires_grad=False))
    other = nn.Sequential(nn.Linear(3, 1))
    ts.attach(other)
    torch.func.functional_call(other, stand_ins(other), (torch.randn(2, 3),))
    assert [p.requires_grad for n, p in m.named_parameters() if n != "index"] == [
        False, False, True, True, True, True]
    del m._parameters["index"]
    m(torch.randn(2, 3))
    assert flags(m) == FROZEN_HEAD


def test_a_call_on_a_wrapper_applies_the_attached_model_inside_it():
    m = grown()
    wrapper = nn.Sequential(m)
    torch.func.functional_call(wrapper, stand_ins(wrapper), (torch.randn(2, 3),))
    assert flags(m) == reads(m) == FROZEN_HEAD


def test_a_detached_model_is_left_as_plain_pytorch_leaves_it():
    m = grown()
    ts.detach_hooks(m)
    torch.func.functional_call(m, stand_ins(m), (torch.randn(2, 3),))
    assert flags(m) == [False, False, True, True, True, True]
    ts.attach(m)
    assert flags(m) == FROZEN_HEAD


def test_inside_a_backward_the_change_waits():
    m = grown()
    w = torch.randn(2, 3, requires_grad=True)
    got = []

    def hook(g):
        torch.func.functional_call(m, stand_ins(m), (torch.randn(2, 3),))
        got.append(flags(m))
        return g

    w.register_hook(hook)
    w.sum().backward()
    assert got == [[False, False, True, True, True, True]]
    m(torch.randn(2, 3))
    assert flags(m) == FROZEN_HEAD


def test_a_compiled_step_breaks_the_graph_once_then_runs_without_a_break():
    from torch._dynamo.testing import CompileCounter

    m = grown()
    counter = CompileCounter()
    tensors = stand_ins(m)

    @torch.compile(backend=counter)
    def step(p, x):
        return torch.func.functional_call(m, p, (x,)).sum()

    x = torch.randn(2, 3)
    counts = []
    for _ in range(4):
        step(tensors, x).backward()
        counts.append(counter.frame_count)
    assert flags(m) == reads(m) == FROZEN_HEAD
    assert counts[1] == counts[2] == counts[3]  # nothing is recompiled once it was applied
    assert all(t.grad is not None for t in tensors.values())


def test_a_shared_layer_freed_by_a_collection_during_the_call_trains_after_it():
    shared = nn.Linear(2, 2)
    a = nn.Sequential(shared, nn.Linear(2, 1))
    b = nn.Sequential(shared)
    ts.attach(a)
    ts.freeze(b, "0")  # b's declaration holds the shared layer
    a(torch.randn(1, 2))
    b(torch.randn(1, 2))
    assert flags(a) == [False, False, True, True]
    box = [b]
    del b
    handle = a[1].register_forward_hook(lambda *_: (box.clear(), gc.collect(), None)[-1])
    torch.func.functional_call(a, stand_ins(a), (torch.randn(1, 2),))
    handle.remove()
    assert flags(a) == reads(a) == [True] * 4


def test_hf_gpt2_with_a_module_added_under_functional_call():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_embd=8, n_layer=2, n_head=2, vocab_size=32, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    ts.freeze_except(model, "transformer.h.1")
    ids = torch.randint(0, 32, (2, 5))
    model(ids)
    model.transformer.h[0].adapter = nn.Linear(8, 8)  # added, unused: frozen once applied
    model.transformer.h[1].adapter = nn.Linear(8, 8)  # under the selector: trains
    params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    out = torch.func.functional_call(model, params, (ids,), {"labels": ids})
    out.loss.backward()
    assert consistent(model)
    assert not any(p.requires_grad for p in model.transformer.h[0].parameters())
    assert all(p.requires_grad for p in model.transformer.h[1].parameters())
    assert params["transformer.h.1.attn.c_attn.weight"].grad is not None


@pytest.mark.parametrize("strict", [False, True])
def test_an_export_tracing_the_call_leaves_the_change_to_the_next_forward(strict):
    # docs/freezing.md "Exporting": the traced program does not read flags; an eager
    # application would be a graph break, which strict export refuses
    m = grown()
    params = stand_ins(m, requires_grad=False)

    class Caller(nn.Module):
        def forward(self, x):
            return torch.func.functional_call(m, params, (x,))

    x = torch.randn(2, 3)
    program = torch.export.export(Caller(), (x,), strict=strict)
    assert flags(m) == [False, False, True, True, True, True]
    torch.testing.assert_close(program.module()(x), torch.func.functional_call(m, params, (x,)))
    assert flags(m) == reads(m) == FROZEN_HEAD


def _twin_change(m, change):
    """One change of the tree; returns the parameters that left it."""
    gone = []
    if change == "append":
        m.append(nn.Linear(1, 1))
    elif change == "del":
        gone = list(m[2].parameters())
        del m[2]
    elif change == "replace":
        gone = list(m[0].parameters())
        m[0] = nn.Linear(3, 3)
    elif change == "setattr":
        m[0].extra = nn.Linear(2, 2)
    elif change == "parameter":
        m[1].scale = nn.Parameter(torch.ones(1))
    return gone


@pytest.mark.parametrize("change", ["append", "del", "replace", "setattr", "parameter"])
def test_the_call_applies_exactly_what_a_forward_of_the_root_applies(change):
    def make():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1), nn.Linear(1, 1))
        m[2].weight.requires_grad_(False)  # a starting flag the departure gives back
        ts.mark_trainable(m, "1")
        m(torch.randn(2, 3))
        return m

    by_forward, by_call = make(), make()
    left = [_twin_change(m, change) for m in (by_forward, by_call)]
    by_forward(torch.randn(2, 3))
    torch.func.functional_call(by_call, stand_ins(by_call), (torch.randn(2, 3),))
    assert flags(by_call) == flags(by_forward) == reads(by_call)
    assert [p.requires_grad for p in left[1]] == [p.requires_grad for p in left[0]]
