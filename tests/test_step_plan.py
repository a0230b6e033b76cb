"""The optimizers' step plan found in C++ (``torchstruct._C.step_plan``) against the checked
Python plan: the same parameters in the same groups whenever it answers, and no answer
(None) whenever the checked plan refuses the input or only it can read it."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import torchstruct.optim as tso
from torchstruct import _ops

pytestmark = pytest.mark.skipif(_ops._C is None, reason="the extension is not built")

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _outcome(fn):
    try:
        return "plan", [(id(group), [id(p) for p in params]) for group, params in fn()]
    except (RuntimeError, ValueError, TypeError) as err:
        return "error", type(err)


# One parameter of a drawn group: how it is made, and what its gradient is.
_KINDS = ("plain", "plain", "plain", "frozen", "no_grad", "tensor", "view_disjoint",
          "view_overlap", "gappy", "transposed_grad", "grad_dtype", "grad_shape", "int_frozen",
          "sparse_grad", "meta", "tied")


def _make(kind: str, dtype, base: torch.Tensor, earlier: list):
    if kind == "tied" and earlier:
        return earlier[0]
    if kind == "view_disjoint":
        p = nn.Parameter(base[len(earlier) * 4:len(earlier) * 4 + 4])
    elif kind == "view_overlap":
        p = nn.Parameter(base[2:10])
    elif kind == "gappy":
        p = nn.Parameter(base[::2])
    elif kind == "int_frozen":
        return nn.Parameter(torch.arange(4), requires_grad=False)
    elif kind == "meta":
        p = nn.Parameter(torch.empty(3, 2, device="meta", dtype=dtype))
    elif kind == "tensor":
        p = torch.randn(3, 2, dtype=torch.float64).to(dtype).requires_grad_()
    else:
        p = nn.Parameter(torch.randn(2, 3, dtype=torch.float64).to(dtype))
    if kind == "frozen":
        p.requires_grad_(False)
        p.grad = torch.zeros_like(p)  # a stale gradient: never read
    elif kind == "no_grad":
        pass
    elif kind == "transposed_grad":
        p.grad = torch.randn(p.shape[::-1], dtype=dtype).t()
    elif kind == "grad_dtype":  # torch refuses such a .grad; a later .data change makes one
        p.grad = torch.zeros_like(p)
        p.data = p.data.to(torch.float64 if dtype != torch.float64 else torch.float32)
    elif kind == "grad_shape":
        p.grad = torch.zeros_like(p)
        p.data = torch.zeros(p.shape[::-1], dtype=dtype, device=p.device)
    elif kind == "sparse_grad":
        p.grad = torch.zeros_like(p).to_sparse()
    else:
        p.grad = torch.ones_like(p)
    return p


@st.composite
def _groups(draw):
    base = nn.Parameter(torch.randn(64))  # shared memory of the view kinds (not listed itself)
    made: list = []
    groups = []
    for _ in range(draw(st.integers(1, 3))):
        params = []
        for kind in draw(st.lists(st.sampled_from(_KINDS), min_size=0, max_size=5)):
            p = _make(kind, draw(st.sampled_from(DTYPES)), base.detach(), made)
            made.append(p)
            params.append(p)
        group = {"params": params}
        if draw(st.booleans()) and draw(st.booleans()):
            group["lr_scale"] = 0.0
        groups.append(group)
    return groups


def _optimizer(groups):
    opt = tso.AdamW([{"params": [nn.Parameter(torch.zeros(1))]}], lr=0.1)
    opt.param_groups = []  # the drawn groups as they are: add_param_group refuses ties
    for group in groups:
        opt.param_groups.append({**opt.defaults, **group})
    return opt


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(groups=_groups())
def test_the_c_plan_agrees_with_the_checked_plan(groups):
    opt = _optimizer(groups)
    checked = _outcome(opt._plan_checked)
    fast = opt._plan_fast()
    if checked[0] == "error":
        assert fast is None, f"the checked plan raises {checked[1].__name__}, the C++ one answered"
    elif fast is not None:
        assert _outcome(lambda: fast) == checked


def test_plain_models_take_the_c_plan(monkeypatch):
    """Not a dead branch: ordinary parameters (ties, frozen ones, missing gradients, a
    group scaled to 0, every float dtype, channels_last) are planned in C++."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Linear(4, 4), nn.Linear(4, 4), nn.LayerNorm(4))
    model.to(memory_format=torch.channels_last)
    model[2].weight = model[1].weight
    model[3].half()
    model[3].bias.requires_grad_(False)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    model[1].bias.grad = None
    opt = tso.AdamW([{"params": list(model[:3].parameters())},
                     {"params": list(model[3].parameters()), "lr_scale": 0.5},
                     {"params": [nn.Parameter(torch.ones(2))], "lr_scale": 0}], lr=0.1)
    opt.param_groups[2]["params"][0].grad = torch.ones(2)
    fast = opt._plan_fast()
    assert fast is not None
    assert _outcome(lambda: fast) == _outcome(opt._plan_checked)
    assert [len(params) for _, params in fast] == [4, 1]  # lin1's bias has no gradient
    monkeypatch.setattr(type(opt), "_plan_checked", lambda self: pytest.fail("checked path"))
    opt.step()


def test_a_tensor_subclass_takes_the_checked_plan():
    class Marked(torch.Tensor):
        pass

    p = nn.Parameter(torch.ones(3))
    q = torch.ones(3).as_subclass(Marked).requires_grad_()
    for t in (p, q):
        t.grad = torch.ones(3)
    opt = tso.SGD([p, q], lr=0.1)
    assert opt._plan_fast() is None
    assert [len(params) for _, params in opt._plan_checked()] == [2]


def test_a_torch_function_mode_takes_the_checked_plan():
    """A mode may answer the plan's ``.grad`` and ``.requires_grad`` reads; C++ would not ask it."""
    from torch.overrides import TorchFunctionMode

    class Hides(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func == torch.Tensor.grad.__get__:  # (a new method-wrapper at each access)
                return None
            return func(*args, **(kwargs or {}))

    p = nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = tso.SGD([p], lr=0.1)
    with Hides():
        assert opt._plan_fast() is None
        assert opt._plan_checked() == []  # the checked plan asks the mode: no gradient
        opt.step()
    assert torch.equal(p.detach(), torch.ones(3))  # stepped as torch would: not at all
    assert [len(params) for _, params in opt._plan_fast()] == [1]


def test_partly_overlapping_parameters_are_refused_with_names():
    base = torch.zeros(10)
    a, b = nn.Parameter(base[0:6]), nn.Parameter(base[4:10])
    for p in (a, b):
        p.grad = torch.ones(6)
    opt = tso.SGD([{"params": [a, b], "param_names": ["a", "b"]}], lr=0.1)
    assert opt._plan_fast() is None
    with pytest.raises(RuntimeError, match="'b' .*shares its memory with .*'a'"):
        opt.step()
    assert torch.equal(base, torch.zeros(10))
    # in separate groups each is stepped once: allowed, as before
    opt = tso.SGD([{"params": [a]}, {"params": [b]}], lr=0.1)
    assert opt._plan_fast() is not None


def test_grads_are_read_in_cpp_only_when_laid_out_as_their_parameters():
    from torchstruct import _C

    a, b = nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(5))
    a.grad, b.grad = torch.randn(3, 4), torch.randn(5)
    grads = _C.grads_of([a, b])
    assert grads[0] is a.grad and grads[1] is b.grad
    a.grad = torch.randn(4, 3).t()  # same values' shape, another memory order
    assert _C.grads_of([a, b]) is None
    b.grad = None
    a.grad = torch.randn(3, 4)
    assert _C.grads_of([a, b]) is None
    assert _C.grads_of((a,)) is None  # a list only
    assert _C.grads_of([]) == []


def test_a_gradient_laid_out_unlike_its_parameter_steps_as_torch_does():
    w = nn.Parameter(torch.randn(3, 4))
    twin = nn.Parameter(w.detach().clone())
    g = torch.randn(4, 3)
    w.grad, twin.grad = g.t(), g.t().contiguous()
    ours, ref = tso.AdamW([w], lr=0.1, max_grad_norm=0.5), torch.optim.AdamW([twin], lr=0.1)
    ours.step()
    torch.nn.utils.clip_grad_norm_([twin], 0.5)
    ref.step()
    torch.testing.assert_close(w, twin)
    assert torch.equal(w.grad, g.t())  # read, not written


def test_one_device_is_found_in_cpp_and_several_are_split():
    from torchstruct import _C

    cpu = [torch.zeros(2), nn.Parameter(torch.zeros(3))]
    assert _C.common_device(cpu) == torch.device("cpu")
    assert _C.common_device(cpu + [torch.zeros(2, device="meta")]) is None
    assert _C.common_device([]) is None
    assert _C.common_device([torch.zeros(1), 1.0]) is None

    class Marked(torch.Tensor):
        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    marked = torch.Tensor._make_subclass(Marked, torch.zeros(2))
    assert _C.common_device(cpu + [marked]) is None


@pytest.mark.parametrize("make", [lambda ps: tso.AdamW(ps, lr=0.1, max_grad_norm=1.0),
                                  lambda ps: tso.SGD(ps, lr=0.1, momentum=0.9)])
def test_an_eager_step_calls_the_op_unboxed(monkeypatch, make):
    from torchstruct import _C

    name = "adamw_step_" if isinstance(make([nn.Parameter(torch.ones(1))]), tso.AdamW) else "sgd_step_"
    calls = []
    real = getattr(_C, name)
    monkeypatch.setattr(_C, name, lambda *args: calls.append(len(args[0])) or real(*args))
    model = nn.Linear(3, 2)
    twin = nn.Linear(3, 2)
    twin.load_state_dict(model.state_dict())
    ours, ref = make(model.parameters()), make(twin.parameters())
    for net in (model, twin):
        net(torch.ones(4, 3)).sum().backward()
    ours.step()
    assert calls == [2]
    with _ops.use_backend("reference"):
        ref.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)
