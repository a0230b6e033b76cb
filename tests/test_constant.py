"""constant: in-place writes to selected parameters raise before the write."""
import copy

import pytest
import torch
from torch import nn

import torchstruct as ts


@pytest.fixture
def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def snapshot(m):
    return {path: p.detach().clone() for path, p in m.named_parameters()}


def assert_unchanged(m, before):
    for path, p in m.named_parameters():
        assert torch.equal(p.detach(), before[path]), path


WRITES = {
    "add_": lambda p: p.add_(1.0),
    "mul_": lambda p: p.mul_(2.0),
    "copy_": lambda p: p.copy_(torch.zeros_like(p)),
    "setitem": lambda p: p.__setitem__(0, 1.0),
    "setitem_slice": lambda p: p.__setitem__((slice(None), 0), torch.tensor(3.0)),
    "data_add_": lambda p: p.data.add_(1.0),
    "detach_zero_": lambda p: p.detach().zero_(),
    "view_fill_": lambda p: p.view(-1)[1:].fill_(5.0),
    "out_kwarg": lambda p: torch.add(p, 1.0, out=p.data),
    "init": lambda p: nn.init.normal_(p),
    "foreach_add_": lambda p: torch._foreach_add_([p], 1.0),
    "set_": lambda p: p.data.set_(torch.zeros_like(p)),
}


@pytest.mark.parametrize("write", list(WRITES))
def test_each_in_place_write_raises_naming_the_path(model, write):
    before = snapshot(model)
    with ts.constant(model, "2"):
        with torch.no_grad(), pytest.raises(RuntimeError, match=r"'2\.weight'"):
            WRITES[write](model[2].weight)
    assert_unchanged(model, before)


@pytest.mark.parametrize("foreach", [False, True])
def test_optimizer_step_raises_and_changes_nothing(model, foreach):
    model(torch.randn(5, 3)).sum().backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=foreach)
    before = snapshot(model)
    with ts.constant(model):
        with pytest.raises(RuntimeError, match="constant:.*'0.weight'"):
            opt.step()
    assert_unchanged(model, before)
    opt.step()  # outside the block the step works
    assert not torch.equal(model[0].weight.detach(), before["0.weight"])


def test_reads_forward_backward_and_unselected_writes_pass(model):
    x = torch.randn(5, 3, requires_grad=True)
    before = snapshot(model)
    with ts.constant(model, "0"):
        out = model(x).sum()  # reads and out-of-place ops
        out.backward()  # accumulating .grad is not a parameter write
        with torch.no_grad():
            model[2].bias.add_(1.0)  # not selected
        model[0].weight.grad.zero_()  # gradients are not the parameter
    assert torch.equal(model[0].weight.detach(), before["0.weight"])
    assert torch.equal(model[2].bias.detach(), before["2.bias"] + 1.0)
    assert x.grad is not None


def test_protection_is_by_memory_not_by_storage():
    flat = torch.zeros(10)
    m = nn.Module()
    m.a = nn.Parameter(flat[:4])  # two parameters in one buffer
    m.b = nn.Parameter(flat[4:])
    assert m.a.untyped_storage().data_ptr() == m.b.untyped_storage().data_ptr()
    with ts.constant(m, "a"), torch.no_grad():
        m.b.add_(1.0)  # same storage, other bytes: allowed
        with pytest.raises(RuntimeError, match="'a'"):
            flat[3:5].fill_(2.0)  # overlaps a
    assert torch.equal(flat, torch.tensor([0.0] * 4 + [1.0] * 6))


def test_tied_parameter_named_by_canonical_path():
    emb = nn.Embedding(5, 3)
    head = nn.Linear(3, 5, bias=False)
    head.weight = emb.weight
    m = nn.ModuleDict({"emb": emb, "head": head})
    with ts.constant(m, "head"), torch.no_grad():
        with pytest.raises(RuntimeError, match="'emb.weight'"):
            m["head"].weight.zero_()


def test_exit_restores_writes_and_block_raising(model):
    with pytest.raises(KeyError):
        with ts.constant(model):
            raise KeyError("boom")
    with torch.no_grad():
        model[0].bias.add_(1.0)  # allowed again


def test_nested_blocks(model):
    with ts.constant(model, "0"), ts.constant(model, "2"), torch.no_grad():
        for p in model.parameters():
            with pytest.raises(RuntimeError):
                p.add_(1.0)
    with ts.constant(model, "0"), torch.no_grad():
        model[2].weight.add_(1.0)


def test_decorator_applies_per_call(model):
    @ts.constant(model)
    def train_step():
        with torch.no_grad():
            model[0].bias.add_(1.0)

    with torch.no_grad():
        model[0].bias.add_(1.0)  # decoration applied nothing
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="'0.bias'"):
        train_step()
    assert_unchanged(model, before)


def test_bad_input_changes_nothing(model):
    with pytest.raises(ValueError, match="closest"):
        ts.constant(model, "3.weight")
    with pytest.raises(TypeError):
        ts.constant(torch.zeros(2))
    with torch.no_grad():
        model[0].weight.add_(1.0)  # no guard left behind


def test_compiled_code_is_guarded(model):
    def step(x):
        with torch.no_grad():
            model[0].bias.add_(1.0)
        return x * 2

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager")
    before = snapshot(model)
    with ts.constant(model):
        with pytest.raises(RuntimeError, match="'0.bias'"):
            compiled(torch.ones(2))
    assert_unchanged(model, before)


# ----------------------------------------------------------------------------- swap path
@pytest.mark.parametrize("how", ["double", "half", "load_state_dict"])
def test_conversions_swapping_tensors_are_refused_for_selected_parameters(swapping, how):
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    before = {k: v.detach().clone() for k, v in m.named_parameters()}
    objects = [p for p in m.parameters()]
    new_state = {k: v + 1 for k, v in m.state_dict().items()}
    convert = {"double": m.double, "half": m.half,
               "load_state_dict": lambda: m.load_state_dict(new_state)}[how]
    with ts.constant(m, "0"):
        with pytest.raises(RuntimeError) as info:
            convert()
        said = str(info.value) + str(info.value.__cause__)
        assert "'0.weight'" in said and "ts.constant" in said
    assert [p for p in m.parameters()] == objects
    for k, p in m.named_parameters():
        if k.startswith("0."):
            assert p.dtype == torch.float32 and torch.equal(p, before[k]), k
    convert()  # after the block: PyTorch's conversion, unchanged
    assert m[0].weight.dtype == {"double": torch.float64, "half": torch.float16}.get(how, torch.float32)


def test_swapping_conversions_that_change_nothing_or_other_layers_pass(swapping):
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    w = m[0].weight.detach().clone()
    with ts.constant(m, "0"):
        m.float()  # float already: the same values swapped in
        m[1].double()  # not selected
    assert torch.equal(m[0].weight, w) and m[1].weight.dtype == torch.float64


# ----------------------------------------------------------------------------- optimizer steps
@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.Adam(ps, lr=0.1),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=False),
    lambda ps: ts.optim.AdamW(ps, lr=0.1),
])
def test_a_step_over_a_protected_parameter_is_refused_before_any_state_changes(make):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    opt = make(m.parameters())
    m(torch.randn(3, 2)).sum().backward()
    opt.step()  # state exists
    m(torch.randn(3, 2)).sum().backward()
    state, params = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in m.parameters()]
    with ts.constant(m, "1"):
        with pytest.raises(RuntimeError, match=r"constant: .*step would update parameter '1\.weight'"):
            opt.step()
    assert str(opt.state_dict()) == str(state)
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), params))
    with ts.constant(m, "1"):
        m[1].zero_grad(set_to_none=True)  # no gradient: the step leaves it alone
        opt.step()
    assert torch.equal(m[1].weight, params[2]) and not torch.equal(m[0].weight, params[0])


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.Adam(ps, lr=0.1),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.5, foreach=False),
    lambda ps: torch.optim.LBFGS(ps, lr=0.1, max_iter=3),
    lambda ps: ts.optim.AdamW(ps, lr=0.1, max_grad_norm=1.0),
    lambda ps: ts.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.5),
], ids=["Adam", "SGD", "LBFGS", "ts.AdamW", "ts.SGD"])
@pytest.mark.parametrize("how", ["positional", "keyword"])
def test_a_step_whose_closure_computes_the_gradients_is_refused_before_any_change(make, how):
    """The gradients come from the closure the step runs (Lightning's training loop, LBFGS):
    the step is checked again when the closure returns, before it updates anything."""
    def run(refuse_first):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        opt = make(m.parameters())
        x = torch.randn(3, 2)

        def closure():
            opt.zero_grad()
            loss = m(x).pow(2).sum()
            loss.backward()
            return loss

        step = (lambda: opt.step(closure)) if how == "positional" else (
            lambda: opt.step(closure=closure))
        if refuse_first:
            params = [p.detach().clone() for p in m.parameters()]
            with ts.constant(m, "1"):
                with pytest.raises(RuntimeError, match=r"step would update parameter '1\.weight'"):
                    step()
            assert all(torch.equal(p, q) for p, q in zip(m.parameters(), params))
            # LBFGS sets its counters (at 0) before it calls the closure: what a fresh one has
            state = [v for v in opt.state.values() if v != {"func_evals": 0, "n_iter": 0}]
            assert state == [] and getattr(opt, "last_grad_norm", None) is None
        step()  # the same as a first step: the refused one left nothing behind
        return [p.detach().clone() for p in m.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))


def test_a_closure_step_is_left_as_it_is_without_a_block():
    m = nn.Linear(2, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    seen = []

    def closure():
        seen.append(closure)
        return m(torch.ones(1, 2)).sum()

    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(args[1]))
    opt.step(closure)
    assert seen == [closure, closure]  # the hook saw the user's own closure, not a wrapper


def test_a_step_in_another_thread_is_not_this_threads_block():
    import threading
    m = nn.Linear(2, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m(torch.randn(3, 2)).sum().backward()
    before = m.weight.detach().clone()
    errors = []
    with ts.constant(m):
        t = threading.Thread(target=lambda: errors.append(None) if opt.step() is None else None)
        t.start()
        t.join()
    assert errors == [None] and not torch.equal(m.weight, before)
