"""swap: a tree's tensors stand in for the parameters inside a block."""
import copy

import pytest
import torch
from torch import nn

import torchstruct as ts
from torchstruct._compile_caveats import MODES_MISTRACED

# dynamo traces an active block's mode right (needed for fullgraph=True inside a block) from
# torch 2.13 on; before, the blocks' handler is left out of compiled code (test_compile.py)
TRACEABLE_MODES = pytest.mark.skipif(
    MODES_MISTRACED, reason="dynamo traces the blocks' mode right from torch 2.13")


def snapshot(m):
    return {path: (p, p.detach().clone(), p.data_ptr()) for path, p in m.named_parameters()}


def assert_untouched(m, before):
    now = dict(m.named_parameters())
    assert now.keys() == before.keys()
    for path, (obj, value, ptr) in before.items():
        assert now[path] is obj, path
        assert isinstance(now[path], nn.Parameter)
        assert torch.equal(obj.detach(), value) and obj.data_ptr() == ptr, path


def scaled_tree(m, factor):
    return ts.tree.map(lambda p: p.detach() * factor, ts.tree.from_module(m))


def loaded_copy(m, tree):
    """Reference: a deep copy of ``m`` holding ``tree``'s values."""
    other = copy.deepcopy(m)
    with torch.no_grad():
        for path, t in ts.tree.to_flat_dict(tree).items():
            other.get_parameter(path).copy_(t)
    return other


def test_linear_full_tree_and_originals_untouched():
    torch.manual_seed(0)
    m = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    before = snapshot(m)
    tree = {"weight": torch.ones(2, 3), "bias": torch.zeros(2)}
    with ts.swap(m, tree):
        inside = m(x)
    torch.testing.assert_close(inside, x.sum(1, keepdim=True).expand(4, 2))
    assert_untouched(m, before)
    torch.testing.assert_close(m(x), x @ m.weight.T + m.bias)


def test_partial_tree_swaps_only_given_paths():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
    x = torch.randn(4, 3)
    tree = {"2": {"bias": torch.tensor([10.0])}}
    with ts.swap(m, tree):
        got = m(x)
    torch.testing.assert_close(got, m(x) - m[2].bias + 10.0)


def test_tree_from_flat_dict():
    m = nn.Sequential(nn.Linear(2, 1))
    tree = ts.tree.from_flat_dict({"0.weight": torch.zeros(1, 2), "0.bias": torch.ones(1)})
    with ts.swap(m, tree):
        assert m(torch.randn(3, 2)).eq(1).all()


def test_embedding_and_multihead_attention():
    torch.manual_seed(0)
    att = nn.MultiheadAttention(8, 2, batch_first=True)
    m = nn.ModuleDict({"emb": nn.Embedding(7, 8), "att": att})

    def run(model, idx):
        h = model["emb"](idx)
        return model["att"](h, h, h)[0]

    idx = torch.tensor([[1, 2, 3], [4, 5, 6]])
    tree = scaled_tree(m, 0.5)
    want = run(loaded_copy(m, tree), idx)
    before = snapshot(m)
    with ts.swap(m, tree):
        got = run(m, idx)
        m.eval()
        with torch.no_grad():  # the fused inference path of MultiheadAttention too
            got_eval = run(m, idx)
        m.train()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_eval, want)
    assert_untouched(m, before)


def test_lstm():
    torch.manual_seed(0)
    lstm = nn.LSTM(3, 4, batch_first=True)
    x = torch.randn(2, 5, 3)
    tree = scaled_tree(lstm, -1.0)
    with ts.swap(lstm, tree):
        got = lstm(x)[0]
    torch.testing.assert_close(got, loaded_copy(lstm, tree)(x)[0])


def tied_model():
    torch.manual_seed(0)
    emb = nn.Embedding(6, 4)
    head = nn.Linear(4, 6, bias=False)
    head.weight = emb.weight
    return nn.ModuleDict({"emb": emb, "head": head})


def test_tied_parameter_swaps_all_uses():
    m = tied_model()
    idx = torch.tensor([0, 3, 5])
    new = torch.randn(6, 4)
    with ts.swap(m, {"emb": {"weight": new}}):
        got = m["head"](m["emb"](idx))
    torch.testing.assert_close(got, new[idx] @ new.T)
    with pytest.raises(ValueError, match="'head.weight' is a tied parameter.*'emb.weight'"):
        ts.swap(m, {"head": {"weight": new}})


def test_gradients_reach_swapped_tensors_not_originals():
    torch.manual_seed(0)
    m = nn.Linear(3, 1)
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(1, 3, requires_grad=True)
    with ts.swap(m, {"weight": w}):
        m(x).sum().backward()
    torch.testing.assert_close(w.grad, x.detach().sum(0, keepdim=True))
    torch.testing.assert_close(x.grad, w.detach().expand(4, 3))
    assert m.weight.grad is None and m.bias.grad is not None


@pytest.mark.parametrize("how", ["swap", "functional_call"])
@pytest.mark.parametrize("held", [True, False])
def test_a_normalization_layer_s_hold_follows_the_parameters_own_flags(held, how):
    """Fast weights swapped in with requires_grad=True (ts.swap, torch.func.functional_call)
    do not release a BatchNorm torchstruct holds (its statistics stay, it normalizes with them,
    and the stand-ins get the gradient of that eval-mode layer); stand-ins without grad do not
    hold a trainable one."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    with torch.no_grad():
        m[1].running_mean.normal_()
    if held:
        ts.freeze(m, "1")
    else:
        ts.attach(m)
    # the layer's stand-ins require grad (held) or not (trainable); the others all do
    fast = {k: (v.detach() * 1.5).requires_grad_(held or not k.startswith("1."))
            for k, v in m.named_parameters()}
    ref = copy.deepcopy(m)
    ts.detach_hooks(ref)
    ref.load_state_dict(fast, strict=False)
    for k, p in ref.named_parameters():
        p.requires_grad_(fast[k].requires_grad)
    ref[1].train(not held)  # a held layer is an eval-mode one
    start = m[1].running_mean.clone()
    x = torch.randn(6, 3)
    if how == "swap":
        with ts.swap(m, ts.tree.from_flat_dict(fast.items())):
            m(x).square().mean().backward()
    else:
        torch.func.functional_call(m, fast, (x,)).square().mean().backward()
    ref(x).square().mean().backward()
    assert torch.equal(m[1].running_mean, ref[1].running_mean) and m[1].training
    assert torch.equal(m[1].running_mean, start) is held
    for k, p in ref.named_parameters():
        if p.grad is None:
            assert fast[k].grad is None, k
        else:
            torch.testing.assert_close(fast[k].grad, p.grad, rtol=0, atol=0, msg=k)


def test_ema_evaluation_pattern():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 1))
    ema = scaled_tree(m, 1.0)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)  # training moved on
    x = torch.randn(2, 3)
    with torch.no_grad(), ts.swap(m, ema):
        got = m(x)
    torch.testing.assert_close(got, loaded_copy(m, ema)(x))


def test_block_raising_restores():
    m = nn.Linear(2, 1)
    before = snapshot(m)
    with pytest.raises(KeyError):
        with ts.swap(m, {"weight": torch.zeros(1, 2)}):
            raise KeyError("boom")
    assert_untouched(m, before)
    x = torch.ones(1, 2)
    torch.testing.assert_close(m(x), x @ m.weight.T + m.bias)  # the originals are used again


def test_nested_swaps_inner_wins():
    m = nn.Linear(1, 1, bias=False)
    x = torch.ones(1, 1)
    with ts.swap(m, {"weight": torch.full((1, 1), 2.0)}):
        with ts.swap(m, {"weight": torch.full((1, 1), 3.0)}):
            assert m(x).item() == 3.0
        assert m(x).item() == 2.0
    assert m(x).item() == m.weight.item()


def test_decorator_applies_per_call():
    m = nn.Linear(1, 1, bias=False)

    @ts.swap(m, {"weight": torch.full((1, 1), 5.0)})
    def f(x):
        return m(x)

    x = torch.ones(1, 1)
    assert m(x).item() == m.weight.item()  # decoration applied nothing
    assert f(x).item() == 5.0
    assert m(x).item() == m.weight.item()


@pytest.mark.parametrize(
    "tree, error, match",
    [
        ({"0": {"wieght": torch.zeros(2, 2)}}, ValueError, r"'0\.wieght' is not.*'0\.weight'"),
        ({"0": {"weight": torch.zeros(3, 2)}}, ValueError, r"shape mismatch at '0\.weight'"),
        ({"0": {"bias": torch.zeros(2, dtype=torch.float64)}}, ValueError, r"dtype mismatch"),
        ({"0": {"bias": torch.zeros(2, device="meta")}}, ValueError, r"device mismatch at '0"),
        ({"0": {"bias": [0.0, 0.0]}}, TypeError, r"0\.bias"),
        ([torch.zeros(2)], TypeError, "dict"),
    ],
)
def test_bad_trees_raise_and_change_nothing(tree, error, match):
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    before = snapshot(m)
    good = {"1": {"weight": torch.zeros(2, 2)}}  # a valid path as well
    with pytest.raises(error, match=match):
        ts.swap(m, {**good, **tree} if isinstance(tree, dict) else tree)
    assert_untouched(m, before)
    x = torch.ones(1, 2)
    torch.testing.assert_close(m(x), m[1](x @ m[0].weight.T + m[0].bias))


def test_not_a_module():
    with pytest.raises(TypeError, match="nn.Module"):
        ts.swap(torch.zeros(2), {})


@TRACEABLE_MODES
def test_under_compile():
    torch.manual_seed(0)
    m = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    tree = scaled_tree(m, 2.0)
    torch._dynamo.reset()
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    with ts.swap(m, tree):
        got = compiled(x)
    torch.testing.assert_close(got, loaded_copy(m, tree)(x))
    torch.testing.assert_close(compiled(x), m(x))
