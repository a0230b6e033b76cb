"""An outside audit: the ``nn.Parameter`` objects themselves are replaced or re-created while
declarations, contexts or an ``UnfreezeSchedule`` are active, and after they end.

Replacements tried: conversions under ``torch.__future__.set_overwrite_module_params_on_conversion``
(new ``Parameter`` objects written straight into ``_parameters``) and under
``set_swap_module_params_on_conversion`` (same objects, new contents), ``load_state_dict(assign=
True)``, ``to_empty`` on a meta model, lazy modules, pruning, parametrizations, conv-bn fusion,
dynamic quantization, plain re-assignment, ``torch.func``, ``nn.LSTM`` and a tiny GPT-2.

Every expectation is written by hand (the flags a demanding user expects) and, for gradients,
checked against plain PyTorch with ``requires_grad`` set by hand.
"""
import copy
import warnings

import pytest
import torch
import torch.nn.utils.parametrize as parametrize
import torch.nn.utils.prune as prune
from torch import nn
from torch.nn.utils import parametrizations

import torchstruct as ts

CONVERSIONS = {
    "double": lambda m: m.double(),
    "half": lambda m: m.half(),
    "to64": lambda m: m.to(torch.float64),
}


# ----------------------------------------------------------------------------- helpers
def flags(m):
    return [p.requires_grad for p in m.parameters()]


def named_flags(m):
    """Every path, tied ones included (``remove_duplicate=False``)."""
    return {n: p.requires_grad for n, p in m.named_parameters(remove_duplicate=False)}


def reads(m):
    said = {id(p) for _, p in ts.trainable_parameters(m)}
    return [id(p) in said for p in m.parameters()]


def agree(m):
    """Flags, ``trainable_parameters``, ``is_trainable`` and ``summary`` all say the same."""
    real = flags(m)
    assert reads(m) == real
    assert [ts.is_trainable(m, p) for p in m.parameters()] == real
    s = ts.summary(m)
    assert s.trainable == sum(p.numel() for p in m.parameters() if p.requires_grad)
    assert s.total == sum(p.numel() for p in m.parameters())
    return real


def grads(m):
    return {n: None if p.grad is None else p.grad.clone() for n, p in m.named_parameters()}


def same_grads(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] is None) == (b[k] is None), k
        if a[k] is not None:
            torch.testing.assert_close(a[k], b[k], msg=k)


def plain_twin(m, trainable_paths):
    """A plain-PyTorch copy of ``m`` (no torchstruct hooks) with flags set by hand."""
    twin = copy.deepcopy(m)
    ts.detach_hooks(twin)
    for n, p in twin.named_parameters():
        p.grad = None
        p.requires_grad_(n in trainable_paths)
    return twin


def restored_warnings(caught):
    return [str(w.message) for w in caught if issubclass(w.category, ts.RestoredFlagsWarning)]


@pytest.fixture
def overwrite():
    """Module conversions make new Parameter objects (``_parameters[key] = Parameter(...)``)."""
    before = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    yield
    torch.__future__.set_overwrite_module_params_on_conversion(before)


def two_layers():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))


def tied_model():
    torch.manual_seed(0)
    m = nn.ModuleDict({"emb": nn.Embedding(5, 3), "body": nn.Linear(3, 3),
                       "head": nn.Linear(3, 5, bias=False)})
    m["head"].weight = m["emb"].weight
    return m


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(3, 3)
        self.fc = nn.Linear(3, 1)

    def forward(self, x):
        return self.fc(torch.tanh(self.enc(x)))


# ----------------------------------------------------------------------------- sanity of torch
def test_torch_rules_this_audit_relies_on(overwrite):
    """The overwrite flag makes new Parameter objects copying the flag; assign=True gives the
    new parameter the old one's flag (also when the loaded value is a Parameter)."""
    m = two_layers()
    m[0].weight.requires_grad_(False)
    w = m[0].weight
    m.double()
    assert m[0].weight is not w and not m[0].weight.requires_grad and m[1].weight.requires_grad
    torch.__future__.set_overwrite_module_params_on_conversion(False)
    m = two_layers()
    m[0].weight.requires_grad_(False)
    sd = {k: nn.Parameter(v.detach().clone()) for k, v in m.state_dict().items()}
    m.load_state_dict(sd, assign=True)
    assert m[0].weight is sd["0.weight"] and not m[0].weight.requires_grad


# ----------------------------------------------------------------------------- overwrite path
@pytest.mark.parametrize("how", sorted(CONVERSIONS))
def test_overwrite_conversion_inside_freeze_except(overwrite, how):
    m = two_layers()
    old = list(m.parameters())
    with ts.freeze_except(m, "1"):
        CONVERSIONS[how](m)
        new = list(m.parameters())
        assert all(a is not b for a, b in zip(old, new))  # really new objects
        assert agree(m) == [False, False, True, True]
        if how != "half":  # no fp16 matmul on every CPU build
            x = torch.randn(4, 3, dtype=new[0].dtype)
            m(x).sum().backward()
            assert agree(m) == [False, False, True, True]
            twin = plain_twin(m, {"1.weight", "1.bias"})
            twin(x).sum().backward()
            same_grads(grads(m), grads(twin))
    assert all(p is q for p, q in zip(m.parameters(), new))
    assert agree(m) == [True, True, True, True]
    assert [ts.is_trainable(m, path) for path in ("0.weight", "0.bias")] == [True, True]
    assert all(p.requires_grad for p in old)  # the replaced objects got their flag back too
    opt = torch.optim.SGD(ts.trainable_parameters(m), lr=0.1)
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in new}


def test_overwrite_conversion_selector_by_parameter_and_module(overwrite):
    m = two_layers()
    with ts.freeze(m, m[0].weight):
        m.double()
        assert agree(m) == [False, True, True, True]
        m(torch.randn(2, 3, dtype=torch.float64))
        assert agree(m) == [False, True, True, True]
    assert agree(m) == [True] * 4
    m = two_layers()
    with ts.freeze(m, m[1]):
        m.half()
        assert agree(m) == [True, True, False, False]
    assert agree(m) == [True] * 4


def test_overwrite_conversion_inside_unfreeze_restores_a_frozen_start(overwrite):
    m = two_layers()
    m[0].weight.requires_grad_(False)  # the user's starting flag
    with ts.unfreeze(m):
        m.double()
        assert agree(m) == [True] * 4
    assert agree(m) == [False, True, True, True]


def test_overwrite_conversion_keeps_hand_writes_made_inside_the_block(overwrite):
    m = two_layers()
    with ts.freeze(m, "0"):
        m[1].weight.requires_grad_(False)  # the user's own writes: they stand
        m[0].bias.requires_grad_(True)
        m.double()
        assert agree(m) == [False, True, False, True]
    assert agree(m) == [True, True, False, True]


def test_overwrite_conversion_in_nested_contexts(overwrite):
    m = two_layers()
    m[1].bias.requires_grad_(False)
    with ts.freeze(m, "0"):
        with ts.unfreeze(m, "1.bias"):
            m.half()
            assert agree(m) == [False, False, True, True]
        assert agree(m) == [False, False, True, False]
        m.float()
        assert agree(m) == [False, False, True, False]
    assert agree(m) == [True, True, True, False]


def test_overwrite_conversion_under_a_declaration_then_forward_then_lift(overwrite):
    m = two_layers()
    ts.mark_trainable(m, "1")
    m.to(torch.float64)
    x = torch.randn(4, 3, dtype=torch.float64)
    m(x).sum().backward()
    assert agree(m) == [False, False, True, True]
    twin = plain_twin(m, {"1.weight", "1.bias"})
    twin(x).sum().backward()
    same_grads(grads(m), grads(twin))
    ts.mark_trainable(m, None)
    assert agree(m) == [True] * 4


def test_overwrite_conversion_under_a_schedule(overwrite):
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 1))

    m = make()
    sched = ts.UnfreezeSchedule(m, {0: ["2"], 1: ["1"], 2: None})
    m.double()
    assert agree(m) == [False, False, False, False, True, True]
    sched.step()
    assert agree(m) == [False, False, True, True, True, True]
    m.half()
    assert agree(m) == [False, False, True, True, True, True]
    state = sched.state_dict()
    sched.step()
    assert agree(m) == [True] * 6
    other = make()
    resumed = ts.UnfreezeSchedule(other, {0: ["2"], 1: ["1"], 2: None})
    other.double()
    resumed.load_state_dict(state)
    assert agree(other) == [False, False, True, True, True, True]


def test_overwrite_conversion_then_ts_optim_leaves_frozen_bitwise(overwrite):
    m = two_layers()
    with ts.freeze_except(m, "1"):
        m.double()
        opt = ts.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.1)
        before = [p.detach().clone() for p in m.parameters()]
        for p in m.parameters():  # stale gradients on the frozen ones too
            p.grad = torch.ones_like(p)
        opt.step()
        after = list(m.parameters())
        assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])
        assert not torch.equal(after[2], before[2])
        assert sorted(id(p) for p in opt.state) == sorted([id(after[2]), id(after[3])])


def test_overwrite_conversion_keeps_norm_statistics_held(overwrite):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 1))
    net(torch.randn(8, 3))  # trained statistics
    with ts.freeze_except(net, "2"):
        net.double()
        before = net[1].running_mean.clone()
        net(torch.randn(8, 3, dtype=torch.float64))
        assert torch.equal(net[1].running_mean, before) and net[1].training
    net(torch.randn(8, 3, dtype=torch.float64))
    assert not torch.equal(net[1].running_mean, before)


def test_overwrite_conversion_of_a_submodule_under_a_context_on_it(overwrite):
    m = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), nn.Linear(2, 1))
    ts.attach(m)
    with ts.freeze(m[0], "1"):
        m.double()
        assert agree(m) == [True, True, False, False, True, True]
        m(torch.randn(1, 2, dtype=torch.float64))
        assert agree(m) == [True, True, False, False, True, True]
    assert agree(m) == [True] * 6


def test_constant_refuses_a_rebinding_conversion_without_the_future_flags():
    m = two_layers()
    with ts.constant(m, "0"):
        with pytest.raises(RuntimeError, match="'0.weight'"):
            m.double()
    assert m[0].weight.dtype == torch.float32


# PyTorch unties a tied parameter on the paths that make new Parameter objects (overwrite flag,
# to_empty, assign=True): each copy, at each of the tied paths, is the copy of the one it
# replaces and gets its flag back when the block or declaration ends


def test_tied_parameter_converted_inside_freeze_gets_its_flag_back(overwrite):
    m = tied_model()
    with ts.freeze(m, "emb"):
        m.double()
        assert named_flags(m) == {"emb.weight": False, "body.weight": True,
                                  "body.bias": True, "head.weight": False}
    # plain PyTorch unties here (both copies train); every flag was True before the block
    assert named_flags(m) == dict.fromkeys(named_flags(m), True)


def test_tied_parameter_converted_under_a_declaration_gets_its_flag_back(overwrite):
    m = tied_model()
    ts.mark_trainable(m, "body")
    m.double()
    m["body"](torch.randn(1, 3, dtype=torch.float64))
    ts.mark_trainable(m, None)
    assert named_flags(m) == dict.fromkeys(named_flags(m), True)


def test_tied_meta_model_to_empty_inside_freeze_gets_its_flag_back():
    with torch.device("meta"):
        m = tied_model()
    with ts.freeze(m, "emb"):
        m.to_empty(device="cpu")  # no future flag needed: meta -> cpu always re-creates
    assert named_flags(m) == dict.fromkeys(named_flags(m), True)


def test_tied_parameter_assigned_inside_freeze_gets_its_flag_back():
    m = tied_model()
    sd = {k: v.detach().clone() for k, v in m.state_dict().items()}
    sd["head.weight"] = sd["emb.weight"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ts.RestoredFlagsWarning)
        with ts.freeze(m, "emb"):
            m.load_state_dict(sd, assign=True)
    assert named_flags(m) == dict.fromkeys(named_flags(m), True)


def test_tied_parameter_converted_on_the_swap_path_stays_exact(swapping):
    m = tied_model()
    w = m["emb"].weight
    with ts.freeze(m, "emb"):
        m.double()
        assert m["head"].weight is w is m["emb"].weight and w.dtype == torch.float64
        assert not w.requires_grad and agree(m) == [False, True, True]
    assert agree(m) == [True, True, True]


# ----------------------------------------------------------------------------- swap path
@pytest.mark.parametrize("how", sorted(CONVERSIONS))
def test_swap_path_conversion_inside_freeze_except(swapping, how):
    m = two_layers()
    old = list(m.parameters())
    with ts.freeze_except(m, "1"):
        CONVERSIONS[how](m)
        assert all(a is b for a, b in zip(old, m.parameters()))
        assert agree(m) == [False, False, True, True]
    assert agree(m) == [True] * 4
    assert old[0].dtype != torch.float32


def test_swap_path_conversion_under_declaration_schedule_and_hand_writes(swapping):
    m = two_layers()
    ts.mark_trainable(m, "1")
    m.double()
    m(torch.randn(1, 3, dtype=torch.float64))
    assert agree(m) == [False, False, True, True]
    ts.mark_trainable(m, None)
    assert agree(m) == [True] * 4

    m = two_layers()
    sched = ts.UnfreezeSchedule(m, {0: ["1"], 2: ["0"]})
    m.double()
    assert agree(m) == [False, False, True, True]
    sched.step()
    sched.step()
    assert agree(m) == [True] * 4

    m = two_layers()
    with ts.freeze(m, "0"):
        m[1].weight.requires_grad_(False)
        m[0].bias.requires_grad_(True)
        m.half()
        assert agree(m) == [False, True, False, True]
    assert agree(m) == [True, True, False, True]


def test_swap_path_conversion_inside_stop_gradient_keeps_blocking(swapping):
    m = two_layers()
    x = torch.randn(4, 3, dtype=torch.float64)
    with ts.stop_gradient(m, "0"):
        m.double()
        y = m(x).sum()
    y.backward()
    twin = plain_twin(m, {"1.weight", "1.bias"})
    twin(x).sum().backward()
    same_grads(grads(m), grads(twin))
    assert agree(m) == [True] * 4


def test_swap_path_conversion_inside_constant_is_refused(swapping):
    m = two_layers()
    with ts.constant(m, "0"):
        with pytest.raises(RuntimeError):
            m.double()
    assert m[0].weight.dtype == torch.float32


# ----------------------------------------------------------------------------- assign / to_empty
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("kind", ["tensor", "param", "param_no_grad"])
def test_load_state_dict_assign_inside_freeze_except(swap, kind):
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        m = two_layers()
        src = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
        make = {"tensor": lambda v: v.detach().clone(),
                "param": lambda v: nn.Parameter(v.detach().clone()),
                "param_no_grad": lambda v: nn.Parameter(v.detach().clone(), requires_grad=False)}
        sd = {k: make[kind](v) for k, v in src.state_dict().items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ts.RestoredFlagsWarning)
            with ts.freeze_except(m, "1"):
                m.load_state_dict(sd, assign=True)
                assert agree(m) == [False, False, True, True]
                x = torch.randn(2, 3)
                m(x).sum().backward()
                assert agree(m) == [False, False, True, True]
                twin = plain_twin(m, {"1.weight", "1.bias"})
                twin(x).sum().backward()
                same_grads(grads(m), grads(twin))
        assert agree(m) == [True] * 4
        assert torch.equal(m[0].weight, src[0].weight)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def test_to_empty_on_a_meta_model_inside_contexts_and_declarations():
    with torch.device("meta"):
        m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    with ts.freeze_except(m, "1"):
        m.to_empty(device="cpu")
        assert m[0].weight.device.type == "cpu"
        assert agree(m) == [False, False, True, True]
    assert agree(m) == [True] * 4

    with torch.device("meta"):
        m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    ts.mark_trainable(m, "1")
    m.to_empty(device="cpu")
    m(torch.randn(1, 2))
    assert agree(m) == [False, False, True, True]
    ts.mark_trainable(m, None)
    assert agree(m) == [True] * 4

    with torch.device("meta"):
        m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    sched = ts.UnfreezeSchedule(m, {0: ["1"], 1: None})
    m.to_empty(device="cpu")
    assert agree(m) == [False, False, True, True]
    sched.step()
    assert agree(m) == [True] * 4


# ----------------------------------------------------------------------------- lazy modules
@pytest.mark.parametrize("mode", ["plain", "swap", "overwrite"])
def test_lazy_module_materialized_inside_a_context(mode):
    saved = (torch.__future__.get_swap_module_params_on_conversion(),
             torch.__future__.get_overwrite_module_params_on_conversion())
    torch.__future__.set_swap_module_params_on_conversion(mode == "swap")
    torch.__future__.set_overwrite_module_params_on_conversion(mode == "overwrite")
    try:
        m = nn.Sequential(nn.LazyLinear(2), nn.Linear(2, 1))
        with ts.freeze(m, "0"):
            x = torch.ones(3, 3)
            m(x).sum().backward()
            assert agree(m) == [False, False, True, True]
            assert m[0].weight.grad is None and m[1].weight.grad is not None
            if mode != "plain":
                m.double()
                assert agree(m) == [False, False, True, True]
        assert agree(m) == [True] * 4

        m = nn.Sequential(nn.LazyLinear(2), nn.Linear(2, 1))
        with ts.freeze_except(m, "1"):
            pass  # entered and left before materialization
        m(torch.ones(1, 3))
        assert agree(m) == [True] * 4

        m = nn.Sequential(nn.LazyLinear(2), nn.Linear(2, 1))
        ts.mark_trainable(m, "1")
        m(torch.ones(1, 3))
        assert agree(m) == [False, False, True, True]
        ts.mark_trainable(m, None)
        assert agree(m) == [True] * 4
    finally:
        torch.__future__.set_swap_module_params_on_conversion(saved[0])
        torch.__future__.set_overwrite_module_params_on_conversion(saved[1])


# ----------------------------------------------------------------------------- pruning
@pytest.mark.parametrize("selector,inside", [
    ("0", [False, False, True, True]),
    ("0.weight", [True, False, True, True]),
])
def test_prune_inside_freeze(selector, inside):
    m = two_layers()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ts.RestoredFlagsWarning)
        with ts.freeze(m, selector):
            prune.l1_unstructured(m[0], "weight", amount=0.5)
            assert [n for n, _ in m.named_parameters()][:2] == ["0.bias", "0.weight_orig"]
            x = torch.randn(4, 3)
            m(x).sum().backward()
            assert agree(m) == inside
            names = [n for n, _ in m.named_parameters()]
            twin = plain_twin(m, {n for n, f in zip(names, inside) if f})
            twin(x).sum().backward()
            same_grads(grads(m), grads(twin))
    assert agree(m) == [True] * 4


def test_prune_inside_freeze_except_of_the_pruned_weight():
    m = two_layers()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ts.RestoredFlagsWarning)
        with ts.freeze_except(m, "0.weight"):
            prune.l1_unstructured(m[0], "weight", amount=0.5)
            m(torch.randn(2, 3))
            assert agree(m) == [False, True, False, False]  # 0.bias, 0.weight_orig, 1.*
            prune.remove(m[0], "weight")
            m(torch.randn(2, 3))
            assert agree(m) == [False, True, False, False]  # 0.bias, 0.weight, 1.*
    assert agree(m) == [True] * 4


def test_prune_under_a_declaration_naming_weight_is_a_clear_error_and_changes_nothing():
    m = two_layers()
    ts.mark_trainable(m[0], "weight")
    prune.l1_unstructured(m[0], "weight", amount=0.5)
    before = named_flags(m)
    assert before == {"0.bias": False, "0.weight_orig": True, "1.weight": True, "1.bias": True}
    with pytest.raises(ValueError, match="weight"):
        m(torch.randn(1, 3))
    with pytest.raises(ValueError, match="weight"):
        list(ts.trainable_parameters(m))
    assert named_flags(m) == before
    ts.mark_trainable(m[0], "weight_orig")  # the new name: accepted
    assert agree(m) == [False, True, True, True]


def test_prune_and_remove_under_a_declaration_naming_bias():
    m = two_layers()
    ts.mark_trainable(m[0], "bias")
    prune.l1_unstructured(m[0], "weight", amount=0.5)
    m(torch.randn(1, 3))
    assert agree(m) == [True, False, True, True]
    prune.remove(m[0], "weight")
    m(torch.randn(1, 3))
    assert agree(m) == [True, False, True, True]
    ts.mark_trainable(m[0], None)
    assert agree(m) == [True] * 4


# ----------------------------------------------------------------------------- parametrizations
class _Sym(nn.Module):
    def forward(self, x):
        return x.triu() + x.triu(1).T


PARAMETRIZE = {
    "register": lambda lin: parametrize.register_parametrization(lin, "weight", _Sym()),
    "orthogonal": parametrizations.orthogonal,
    "spectral_norm": parametrizations.spectral_norm,
}


@pytest.mark.parametrize("name", sorted(PARAMETRIZE))
@pytest.mark.parametrize("selector", ["0", "1"])
def test_parametrization_added_inside_freeze_is_restored(name, selector):
    m = two_layers()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ts.RestoredFlagsWarning)
        with ts.freeze(m, selector):
            PARAMETRIZE[name](m[0])
            x = torch.randn(2, 3)
            m(x).sum().backward()
            want = [selector != "0"] * 2 + [selector != "1"] * 2
            assert agree(m) == want
            names = [n for n, _ in m.named_parameters()]
            twin = plain_twin(m, {n for n, f in zip(names, want) if f})
            twin(x).sum().backward()
            same_grads(grads(m), grads(twin))
    assert agree(m) == [True] * 4


def test_weight_norm_added_inside_freeze_warns_about_the_originals_it_created_frozen():
    m = two_layers()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ts.freeze(m, "0"):
            parametrizations.weight_norm(m[0])
    said = " ".join(restored_warnings(caught))
    assert "0.parametrizations.weight.original0" in said
    assert "0.parametrizations.weight.original1" in said
    assert named_flags(m)["0.bias"] and named_flags(m)["1.weight"]


@pytest.mark.parametrize("name", ["orthogonal", "spectral_norm"])
def test_remove_parametrizations_inside_freeze_keeps_the_parameter(name):
    m = two_layers()
    PARAMETRIZE[name](m[0])
    w = m[0].parametrizations.weight.original
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ts.RestoredFlagsWarning)
        with ts.freeze(m, "0"):
            parametrize.remove_parametrizations(m[0], "weight", leave_parametrized=True)
            assert m[0].weight is w
            m(torch.randn(2, 3))
            assert agree(m) == [False, False, True, True]
    assert agree(m) == [True] * 4


def test_remove_weight_norm_inside_freeze_does_not_silently_lose_the_weight():
    m = two_layers()
    parametrizations.weight_norm(m[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ts.freeze(m, "0"):
            parametrize.remove_parametrizations(m[0], "weight", leave_parametrized=True)
            m(torch.randn(2, 3))
    said = " ".join(restored_warnings(caught))
    trains = "0.weight" in dict(m.named_parameters()) and m[0].weight.requires_grad
    assert trains or "0.weight" in said or "original0" in said


# ----------------------------------------------------------------------------- fusion, quantization
def test_fuse_conv_bn_under_a_declaration_and_inside_a_block():
    from torch.nn.utils.fusion import fuse_conv_bn_eval

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(2, 2, 3), nn.BatchNorm2d(2), nn.Conv2d(2, 1, 1)).eval()

    m = make()
    ts.mark_trainable(m, "2")
    m[0] = fuse_conv_bn_eval(m[0], m[1])
    m[1] = nn.Identity()
    m(torch.randn(1, 2, 5, 5))
    assert agree(m) == [False, False, True, True]
    ts.mark_trainable(m, None)
    assert agree(m) == [True] * 4

    m = make()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ts.RestoredFlagsWarning)
        with ts.freeze_except(m, "2"):
            fused = fuse_conv_bn_eval(m[0], m[1])
            assert not fused.weight.requires_grad  # torch copied the block's flag
            m[0], m[1] = fused, nn.Identity()
            x = torch.randn(1, 2, 5, 5)
            m(x).sum().backward()
            assert agree(m) == [False, False, True, True]
            assert m[0].weight.grad is None and m[2].weight.grad is not None
    assert agree(m) == [True] * 4


def test_quantize_dynamic_of_a_declared_model():
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    ts.mark_trainable(m, "2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = torch.ao.quantization.quantize_dynamic(m, {nn.Linear}, dtype=torch.qint8)
        out = q(torch.randn(1, 4))
    assert out.shape == (1, 2) and list(q.parameters()) == []
    assert ts.summary(q).total == 0
    assert agree(m) == [False, False, True, True]  # the original is untouched


# ----------------------------------------------------------------------------- re-assignment
@pytest.mark.parametrize("ctx", ["freeze_except_enc", "freeze_fc"])
@pytest.mark.parametrize("what", ["weight", "module"])
def test_reassignment_inside_a_block(ctx, what):
    torch.manual_seed(0)
    m = Net()
    old = [m.fc.weight] if what == "weight" else list(m.fc.parameters())  # what leaves
    enter = (lambda: ts.freeze_except(m, "enc")) if ctx == "freeze_except_enc" else (
        lambda: ts.freeze(m, "fc"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with enter():
            if what == "weight":
                m.fc.weight = nn.Parameter(torch.randn(1, 3))
            else:
                m.fc = nn.Linear(3, 1)
            # reads already answer for the new parameter; its flag follows at the forward
            assert reads(m) == [True, True, False, False]
            x = torch.randn(4, 3)
            m(x).sum().backward()
            assert agree(m) == [True, True, False, False]
            twin = plain_twin(m, {"enc.weight", "enc.bias"})
            twin(x).sum().backward()
            same_grads(grads(m), grads(twin))
            # left the model: its starting flag back at the next application (the forward)
            assert all(p.requires_grad for p in old)
    assert agree(m) == [True] * 4
    assert all(p.requires_grad for p in old)  # left the model inside the block: restored
    assert restored_warnings(caught)  # the model changed inside the block: said


def test_reassignment_under_a_permanent_declaration_follows_at_the_next_forward():
    m = Net()
    ts.mark_trainable(m, "fc")
    m.enc = nn.Linear(3, 3)
    m.fc.weight = nn.Parameter(torch.randn(1, 3))
    assert reads(m) == [False, False, True, True]
    m(torch.randn(1, 3))
    assert agree(m) == [False, False, True, True]


def test_direct_parameters_write_is_applied_at_the_exit():
    m = Net()
    with ts.freeze_except(m, "enc"):
        m.fc._parameters["weight"] = nn.Parameter(torch.randn(1, 3))  # bypasses registration
        assert reads(m) == [True, True, False, False]
        ts.attach(m)
        assert agree(m) == [True, True, False, False]
    assert agree(m) == [True] * 4


# ----------------------------------------------------------------------------- torch.func
def test_stack_module_state_and_vmap_follow_declarations():
    from torch.func import functional_call, stack_module_state, vmap

    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)) for _ in range(3)]
    for mm in models:
        ts.mark_trainable(mm, "1")
    params, buffers = stack_module_state(models)
    assert {k: v.requires_grad for k, v in params.items()} == {
        "0.weight": False, "0.bias": False, "1.weight": True, "1.bias": True}
    base = copy.deepcopy(models[0]).to("meta")
    x = torch.randn(4, 2)
    out = vmap(lambda p, b, x: functional_call(base, (p, b), (x,)), in_dims=(0, 0, None))(
        params, buffers, x)
    out.sum().backward()
    assert {k: v.grad is not None for k, v in params.items()} == {
        "0.weight": False, "0.bias": False, "1.weight": True, "1.bias": True}
    for mm in models:
        assert agree(mm) == [False, False, True, True]


def test_functional_call_inside_freeze_and_func_grad_under_a_declaration():
    from torch.func import functional_call, grad

    m = two_layers()
    x = torch.randn(4, 3)
    with ts.freeze(m, "0"):
        y = functional_call(m, dict(m.named_parameters()), (x,))
        y.sum().backward()
        assert [p.grad is not None for p in m.parameters()] == [False, False, True, True]
        assert agree(m) == [False, False, True, True]
    assert agree(m) == [True] * 4

    m = two_layers()
    ts.mark_trainable(m, "1")
    detached = {k: v.detach() for k, v in m.named_parameters()}
    g = grad(lambda p: functional_call(m, p, (x,)).sum())(detached)
    assert set(g) == set(detached)  # torch.func differentiates what it is handed
    assert agree(m) == [False, False, True, True]  # and no flag was written


# ----------------------------------------------------------------------------- LSTM
@pytest.mark.parametrize("convert", [None, "overwrite", "swap"])
def test_lstm_under_freeze_gets_the_gradients_of_plain_pytorch(convert):
    saved = (torch.__future__.get_swap_module_params_on_conversion(),
             torch.__future__.get_overwrite_module_params_on_conversion())
    torch.__future__.set_swap_module_params_on_conversion(convert == "swap")
    torch.__future__.set_overwrite_module_params_on_conversion(convert == "overwrite")
    try:
        torch.manual_seed(0)
        lstm = nn.LSTM(3, 4, num_layers=2)
        x = torch.randn(5, 2, 3)
        with ts.freeze(lstm, "*_l0"):
            if convert is not None:
                lstm.double()
                x = x.double()
            lstm.flatten_parameters()
            assert all(a is getattr(lstm, n)
                       for a, n in zip(lstm._flat_weights, lstm._flat_weights_names))
            lstm(x)[0].sum().backward()
            want = {n for n, _ in lstm.named_parameters() if n.endswith("_l1")}
            assert agree(lstm) == [n in want for n, _ in lstm.named_parameters()]
            twin = plain_twin(lstm, want)
            twin(x)[0].sum().backward()
            same_grads(grads(lstm), grads(twin))
        assert agree(lstm) == [True] * 8
        with ts.freeze_except(lstm, "*_l0"):  # flags flipped the other way: still exact
            for p in lstm.parameters():
                p.grad = None
            lstm(x)[0].sum().backward()
            assert [p.grad is not None for p in lstm.parameters()] == [True] * 4 + [False] * 4
    finally:
        torch.__future__.set_swap_module_params_on_conversion(saved[0])
        torch.__future__.set_overwrite_module_params_on_conversion(saved[1])


# ----------------------------------------------------------------------------- transformers
def _gpt2(tie=True):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100,
                                  n_positions=16, tie_word_embeddings=tie)
    return transformers.GPT2LMHeadModel(cfg)


@pytest.mark.parametrize("tie", [True, False])
def test_gpt2_resize_token_embeddings_inside_freeze_except(tie):
    m = _gpt2(tie)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ts.freeze_except(m, "transformer.wte"):
            m.resize_token_embeddings(120, mean_resizing=False)
            wte = m.transformer.wte.weight
            assert wte.shape[0] == 120
            assert (m.lm_head.weight is wte) == tie
            ids = torch.randint(0, 120, (2, 5))
            m(ids, labels=ids).loss.backward()
            want = {"transformer.wte.weight"}
            assert sorted(n for n, _ in ts.trainable_parameters(m)) == sorted(want)
            assert sorted(n for n, p in m.named_parameters() if p.requires_grad) == sorted(want)
            assert sorted(n for n, p in m.named_parameters() if p.grad is not None) == sorted(
                want)
    assert all(flags(m)) and agree(m) == [True] * len(flags(m))


def test_gpt2_converted_with_new_parameters_inside_freeze_of_the_tied_embedding(overwrite):
    m = _gpt2()
    with ts.freeze(m, "transformer.wte"):
        m.to(torch.float64)  # PyTorch unties wte / lm_head on this path
    assert sorted(n for n, p in m.named_parameters() if not p.requires_grad) == []
