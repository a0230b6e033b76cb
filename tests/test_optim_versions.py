"""The optimizers' writes are visible to autograd: every tensor a step writes (parameters,
state, step counts) has its version counter advanced, on every backend, so a backward
through a value saved before the step raises, as after torch.optim's default step, instead
of computing a gradient from the updated weights. Inference tensors are refused before
anything is written."""
import pytest
import torch
from torch import nn

import torchstruct.optim as tso
from torchstruct import _ops

OPTIMIZERS = {
    "sgd": lambda ps, **kw: tso.SGD(ps, lr=0.1, **kw),
    "sgd_momentum": lambda ps, **kw: tso.SGD(ps, lr=0.1, momentum=0.9, **kw),
    "adamw": lambda ps, **kw: tso.AdamW(ps, lr=0.1, **kw),
    "adamw_amsgrad": lambda ps, **kw: tso.AdamW(ps, lr=0.1, amsgrad=True, **kw),
}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("clip", [None, 1.0])
def test_a_step_between_forward_and_backward_is_caught(backend, name, clip):
    model = _model()
    opt = OPTIMIZERS[name](model.parameters(), max_grad_norm=clip)
    model(torch.randn(3, 4)).square().sum().backward()
    opt.step()  # state exists: the next step writes it too
    loss = model(torch.randn(3, 4)).square().sum()  # saves the weights
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_written_tensor_advances_its_version(backend, name):
    model = _model()
    opt = OPTIMIZERS[name](model.parameters())
    model(torch.randn(3, 4)).square().sum().backward()
    opt.step()
    written = [t for p in model.parameters()
               for t in [p, *(v for v in opt.state[p].values() if isinstance(v, torch.Tensor))]]
    before = [t._version for t in written]
    masked = next(iter(model.parameters()))
    opt.set_mask(masked, torch.zeros_like(masked, dtype=torch.bool))  # masked out: written too
    opt.step()
    assert all(t._version > v for t, v in zip(written, before))


def test_the_gradients_are_not_bumped(backend):
    """The clip folded into the step reads the gradients: they are not written."""
    model = _model()
    opt = tso.AdamW(model.parameters(), lr=0.1, max_grad_norm=1e-3)
    model(torch.randn(3, 4)).square().sum().backward()
    versions = [p.grad._version for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    assert [p.grad._version for p in model.parameters()] == versions
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


@pytest.mark.parametrize("name", ["sgd_momentum", "adamw", "adamw_amsgrad"])  # with state
def test_state_made_under_inference_mode_is_refused_outside_it(backend, name):
    """As torch.optim: a step inside ``torch.inference_mode()`` makes inference-tensor state,
    which a later step outside it cannot update in place. The refusal comes before any write,
    so no parameter or state moves."""
    model = _model()
    opt = OPTIMIZERS[name](model.parameters())
    model(torch.randn(3, 4)).square().sum().backward()
    with torch.inference_mode():
        opt.step()
    assert all(t.is_inference() for s in opt.state.values() for t in s.values()
               if isinstance(t, torch.Tensor))
    params = [p.detach().clone() for p in model.parameters()]
    state = {id(p): {k: v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)}
             for p, s in opt.state.items()}
    with pytest.raises(RuntimeError, match="inference tensor"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    for p, s in opt.state.items():
        for k, v in state[id(p)].items():
            assert torch.equal(s[k], v)


def test_the_unboxed_entry_raises_as_the_op_does():
    """``torchstruct._C.adamw_step_`` (what an eager step calls) against
    ``torch.ops.torchstruct.adamw_step_`` on the same bad input: the same error, nothing
    written."""
    if not _ops.compiled_available():
        pytest.skip("the extension is not built")
    from torchstruct import _C

    p, g = torch.zeros(3), torch.ones(4)
    args = ([p], [g], [torch.zeros(3)], [torch.zeros(3)], [], [torch.zeros(())], [],
            0.1, 0.9, 0.999, 0.0, 1e-8, False, False)
    with torch.no_grad():
        with pytest.raises(RuntimeError) as boxed:
            torch.ops.torchstruct.adamw_step_(*args)
        with pytest.raises(RuntimeError) as unboxed:
            _C.adamw_step_(*args, None, None, None)
        assert str(unboxed.value).splitlines()[0] == str(boxed.value).splitlines()[0]
        with pytest.raises(TypeError, match=r"grads\[0\] must be a tensor"):
            _C.adamw_step_([p], [1.0], *args[2:], None, None, None)
        with pytest.raises(ValueError, match="beta1"):
            _C.adamw_step_([p], [torch.ones(3)], *args[2:8], 1.5, *args[9:], None, None, None)
    assert torch.equal(p, torch.zeros(3))
