"""torchstruct on modules it did not write: Transformer, MultiheadAttention, LSTM, tied
embeddings, ``torch.nn.utils.parametrize`` and LoRA-style adapters added after declarations."""
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils.parametrizations import orthogonal, weight_norm

import torchstruct as ts


def _grads(loss, params):
    """Reference gradients straight from autograd (``None`` where unused)."""
    return torch.autograd.grad(loss, list(params), allow_unused=True, retain_graph=True)


# ----------------------------------------------------------------------------- Transformer
def _transformer():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # enable_nested_tensor warning (batch_first=False)
        return nn.Transformer(
            d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
            dim_feedforward=16, dropout=0.0,
        )


def _seq2seq_loss(model):
    torch.manual_seed(1)
    src, tgt = torch.randn(5, 2, 8), torch.randn(4, 2, 8)
    return model(src, tgt).pow(2).mean()


def test_transformer_freeze_except_decoder_trains_only_the_decoder():
    model = _transformer()
    decoder_paths = [n for n, _ in model.named_parameters() if n.startswith("decoder.")]
    with ts.freeze_except(model, "decoder"):
        assert [path for path, _ in ts.trainable_parameters(model)] == decoder_paths
        for name, p in model.named_parameters():
            assert p.requires_grad is name.startswith("decoder."), name
        model.zero_grad(set_to_none=True)
        _seq2seq_loss(model).backward()
        for name, p in model.named_parameters():
            if name.startswith("decoder."):
                assert p.grad is not None, name
            else:
                assert p.grad is None, name
    assert all(p.requires_grad for p in model.parameters())


def test_transformer_structural_grad_paths_match_named_parameters():
    model = _transformer()
    names = [n for n, _ in model.named_parameters()]
    loss = _seq2seq_loss(model)
    g = ts.structural_grad(model, loss, retain_graph=True)
    assert ts.tree.paths(g) == names
    ref = _grads(loss, [p for _, p in model.named_parameters()])
    flat = ts.tree.to_flat_dict(g)
    for (name, _), r in zip(model.named_parameters(), ref):
        torch.testing.assert_close(flat[name], r if r is not None else torch.zeros_like(flat[name]))

    with ts.freeze_except(model, "decoder"):
        g = ts.structural_grad(model, _seq2seq_loss)
    assert ts.tree.paths(g) == [n for n in names if n.startswith("decoder.")]
    # The top-level key structure follows the module tree.
    assert list(g) == ["decoder"]
    assert "self_attn" in g["decoder"]["layers"]["0"]


# ----------------------------------------------------------------------------- MultiheadAttention
def _mha():
    torch.manual_seed(0)
    return nn.MultiheadAttention(embed_dim=8, num_heads=2, dropout=0.0)


def _mha_input():
    torch.manual_seed(1)
    return torch.randn(3, 2, 8, requires_grad=True)


def _mha_loss(m, x):
    out, _ = m(x, x, x)
    return out.pow(2).sum()


def test_mha_select_in_proj_weight():
    m = _mha()
    assert [path for path, _ in ts.select(m, "in_proj_weight")] == ["in_proj_weight"]
    assert ts.select(m, "in_proj_weight")[0][1] is m.in_proj_weight
    assert [path for path, _ in ts.select(m, "in_proj_*")] == ["in_proj_weight", "in_proj_bias"]


def test_mha_freeze_in_proj_weight():
    m = _mha()
    x = _mha_input()
    with ts.freeze(m, "in_proj_weight"):
        assert not ts.is_trainable(m, "in_proj_weight")
        _mha_loss(m, x).backward()
    assert m.in_proj_weight.requires_grad
    assert m.in_proj_weight.grad is None
    for name in ("in_proj_bias", "out_proj.weight", "out_proj.bias"):
        assert m.get_parameter(name).grad is not None, name
    assert x.grad is not None


def test_mha_stop_gradient_in_proj_weight():
    m = _mha()
    x = _mha_input()
    with torch.no_grad():
        expected, _ = m(x, x, x)
    with ts.stop_gradient(m, "in_proj_weight"):
        out, _ = m(x, x, x)
    torch.testing.assert_close(out, expected)
    out.pow(2).sum().backward()
    assert m.in_proj_weight.grad is None
    assert m.out_proj.weight.grad is not None and m.in_proj_bias.grad is not None
    assert x.grad is not None and x.grad.abs().sum() > 0

    # The input gradient is the one of a model whose in_proj_weight is a constant.
    x2 = x.detach().clone().requires_grad_(True)
    m.in_proj_weight.requires_grad_(False)
    try:
        _mha_loss(m, x2).backward()
    finally:
        m.in_proj_weight.requires_grad_(True)
    torch.testing.assert_close(x.grad, x2.grad)


def test_mha_structural_grad_in_proj_weight():
    m = _mha()
    x = _mha_input()
    loss = _mha_loss(m, x)
    (ref,) = _grads(loss, [m.in_proj_weight])
    g = ts.structural_grad(m, loss, wrt="in_proj_weight")
    assert ts.tree.paths(g) == ["in_proj_weight"]
    torch.testing.assert_close(g["in_proj_weight"], ref)
    assert m.in_proj_weight.grad is None  # no .grad side effect
    g2 = ts.structural_grad(m, lambda mod: _mha_loss(mod, x), wrt="in_proj_weight")
    torch.testing.assert_close(g2["in_proj_weight"], ref)


# ----------------------------------------------------------------------------- LSTM
def _lstm():
    torch.manual_seed(0)
    return nn.LSTM(input_size=3, hidden_size=4, num_layers=1)


def _lstm_input():
    torch.manual_seed(1)
    return torch.randn(5, 2, 3, requires_grad=True)


def test_lstm_freeze_weight_hh_gives_it_no_grad():
    m = _lstm()
    x = _lstm_input()
    with ts.freeze(m, "weight_hh_l0"):
        assert not m.weight_hh_l0.requires_grad
        # The flat-weights cache holds the very same parameter objects.
        assert any(w is m.weight_hh_l0 for w in m._flat_weights)
        out, _ = m(x)
        out.pow(2).sum().backward()
    assert m.weight_hh_l0.grad is None
    for name in ("weight_ih_l0", "bias_ih_l0", "bias_hh_l0"):
        g = m.get_parameter(name).grad
        assert g is not None and g.abs().sum() > 0, name
    assert x.grad is not None


def test_lstm_swap_weight_hh():
    m = _lstm()
    x = _lstm_input()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    zeros = torch.zeros_like(m.weight_hh_l0)
    with ts.swap(m, {"weight_hh_l0": zeros}):
        out, _ = m(x)
    ref = _lstm()
    with torch.no_grad():
        ref.weight_hh_l0.zero_()
    expected, _ = ref(x)
    torch.testing.assert_close(out, expected)
    for n, p in m.named_parameters():
        assert torch.equal(p, before[n]), n
    normal, _ = m(x)
    assert not torch.allclose(normal, out)


def test_lstm_stop_gradient_weight_hh():
    m = _lstm()
    x = _lstm_input()
    with torch.no_grad():
        expected, _ = m(x)
    with ts.stop_gradient(m, "weight_hh_l0"):
        out, _ = m(x)
    torch.testing.assert_close(out, expected)
    out.pow(2).sum().backward()
    assert m.weight_hh_l0.grad is None
    assert m.weight_ih_l0.grad is not None and m.bias_hh_l0.grad is not None
    assert x.grad is not None


# ----------------------------------------------------------------------------- tied embedding
class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.mid = nn.Linear(4, 4)
        self.out = nn.Linear(4, 10, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx):
        return self.out(torch.tanh(self.mid(self.emb(idx))))


def _tied():
    torch.manual_seed(0)
    return TiedLM()


def _tied_loss(m):
    return m(torch.tensor([[1, 2, 3], [4, 5, 1]])).logsumexp(-1).sum()


@pytest.mark.parametrize("path", ["emb.weight", "out.weight", "out", "emb"])
def test_tied_embedding_frozen_via_either_path(path):
    m = _tied()
    assert m.out.weight is m.emb.weight
    with ts.freeze(m, path):
        assert not m.emb.weight.requires_grad
        assert not ts.is_trainable(m, "emb.weight") and not ts.is_trainable(m, "out.weight")
        assert [p for p, _ in ts.trainable_parameters(m)] == ["mid.weight", "mid.bias"]
        _tied_loss(m).backward()
        assert m.emb.weight.grad is None and m.mid.weight.grad is not None
    assert m.emb.weight.requires_grad


def test_tied_embedding_gradient_is_summed_over_both_uses():
    m = _tied()
    w = m.emb.weight
    idx = torch.tensor([[1, 2, 3], [4, 5, 1]])
    g = ts.structural_grad(m, _tied_loss)
    assert ts.tree.paths(g) == ["emb.weight", "mid.weight", "mid.bias"]

    # Reference: the same computation with two independent copies of the weight.
    w_in = w.detach().clone().requires_grad_(True)
    w_out = w.detach().clone().requires_grad_(True)
    h = torch.tanh(m.mid(nn.functional.embedding(idx, w_in)))
    loss = (h @ w_out.t()).logsumexp(-1).sum()
    g_in, g_out = torch.autograd.grad(loss, [w_in, w_out])
    assert g_in.abs().sum() > 0 and g_out.abs().sum() > 0
    torch.testing.assert_close(g["emb"]["weight"], g_in + g_out)


def test_tied_embedding_summary_shows_tie():
    m = _tied()
    s = ts.summary(m)
    tied = [r for r in s.rows if r.tied_to is not None]
    assert [(r.path, r.tied_to) for r in tied] == [("out.weight", "emb.weight")]
    assert s.total == 10 * 4 + 4 * 4 + 4  # the tied weight counted once
    assert "tied" in str(s) and "to emb.weight" in str(s)
    with ts.freeze(m, "out.weight"):
        s = ts.summary(m)
    assert s.trainable == 4 * 4 + 4 and s.total == 10 * 4 + 4 * 4 + 4


# ----------------------------------------------------------------------------- parametrize
def _parametrized():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    weight_norm(m[0])
    orthogonal(m[2])
    return m


ORIGINALS = [
    "0.parametrizations.weight.original0",
    "0.parametrizations.weight.original1",
    "2.parametrizations.weight.original",
]


def _param_loss(m):
    torch.manual_seed(1)
    return m(torch.randn(6, 4)).pow(2).sum()


def test_parametrize_select_originals():
    m = _parametrized()
    assert [p for p, _ in ts.select(m, "*.original*")] == ORIGINALS
    assert ts.select(m, "*.original0")[0][1] is m[0].parametrizations.weight.original0


def test_parametrize_freeze_originals():
    m = _parametrized()
    with ts.freeze(m, "*.original*"):
        assert [p for p, _ in ts.trainable_parameters(m)] == ["0.bias", "2.bias"]
        _param_loss(m).backward()
        for path in ORIGINALS:
            assert m.get_parameter(path).grad is None, path
        assert m[0].bias.grad is not None and m[2].bias.grad is not None
    assert all(p.requires_grad for p in m.parameters())


def test_parametrize_freeze_except_originals():
    m = _parametrized()
    with ts.freeze_except(m, "*.original*"):
        _param_loss(m).backward()
        for path in ORIGINALS:
            assert m.get_parameter(path).grad is not None, path
        assert m[0].bias.grad is None and m[2].bias.grad is None


def test_parametrize_structural_grad_gives_originals():
    m = _parametrized()
    names = [n for n, _ in m.named_parameters()]
    loss = _param_loss(m)
    ref = dict(zip(names, _grads(loss, [p for _, p in m.named_parameters()])))
    g = ts.structural_grad(m, loss, wrt="*.original*")
    assert ts.tree.paths(g) == ORIGINALS
    flat = ts.tree.to_flat_dict(g)
    for path in ORIGINALS:
        assert ref[path] is not None
        torch.testing.assert_close(flat[path], ref[path])
    g_all = ts.structural_grad(m, _param_loss)
    assert sorted(ts.tree.paths(g_all)) == sorted(names)


def test_parametrization_registered_inside_a_context_follows_it():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    with ts.freeze_except(m, "*.bias", "0"):
        weight_norm(m[0])  # new parameters original0/original1, under the kept "0"
        orthogonal(m[2])  # "2.weight" becomes "2.parametrizations.weight.original"
        _param_loss(m).backward()
        for path in ORIGINALS[:2]:
            assert m.get_parameter(path).requires_grad, path
            assert m.get_parameter(path).grad is not None, path
        assert not m.get_parameter(ORIGINALS[2]).requires_grad
        assert m.get_parameter(ORIGINALS[2]).grad is None
        assert m[2].bias.grad is not None
    assert all(p.requires_grad for p in m.parameters())


# ----------------------------------------------------------------------------- LoRA adapters
class LoRA(nn.Module):
    """A Linear plus a low-rank update ``B @ A``."""

    def __init__(self, base: nn.Linear, rank: int = 2, names=("lora_A", "lora_B")):
        super().__init__()
        self.base = base
        self._a, self._b = names
        self.register_parameter(self._a, nn.Parameter(torch.randn(rank, base.in_features) * 0.1))
        self.register_parameter(self._b, nn.Parameter(torch.randn(base.out_features, rank) * 0.1))

    def forward(self, x):
        a, b = getattr(self, self._a), getattr(self, self._b)
        return self.base(x) + x @ a.t() @ b.t()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l0 = nn.Linear(4, 4)
        self.l1 = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)
        self.adapters = nn.ModuleDict()

    def forward(self, x):
        h = torch.tanh(self.l1(torch.tanh(self.l0(x))))
        for a in self.adapters.values():
            h = h + a(h)
        extra = self._modules.get("extra")
        if extra is not None:
            h = extra(h)
        return self.head(h)


def _net_loss(m):
    torch.manual_seed(1)
    return m(torch.randn(3, 4)).pow(2).sum()


def _trained(m):
    m.zero_grad(set_to_none=True)
    _net_loss(m).backward()
    return sorted(n for n, p in m.named_parameters() if p.grad is not None)


def test_lora_added_after_freeze_except_matching_selector_trains():
    torch.manual_seed(0)
    m = Net()
    m.l0 = LoRA(m.l0)  # one adapter exists, so the selector is not empty
    ctx = ts.freeze_except(m, "*.lora_*")  # permanent, until lifted
    try:
        assert _trained(m) == ["l0.lora_A", "l0.lora_B"]
        m.l1 = LoRA(m.l1)  # added afterwards: its lora_* train, its base stays frozen
        assert _trained(m) == ["l0.lora_A", "l0.lora_B", "l1.lora_A", "l1.lora_B"]
        assert not m.l1.base.weight.requires_grad
        assert [p for p, _ in ts.trainable_parameters(m)] == [
            "l0.lora_A", "l0.lora_B", "l1.lora_A", "l1.lora_B"]
    finally:
        ctx.__exit__(None, None, None)


def test_lora_added_after_freeze_except_not_matching_selector_is_frozen():
    torch.manual_seed(0)
    m = Net()
    m.l0 = LoRA(m.l0)
    with ts.freeze_except(m, "*.lora_*"):
        m.l1 = LoRA(m.l1, names=("down", "up"))  # does not match the kept selector
        assert m.l1.down.requires_grad  # its constructor's flag, until the next forward
        assert _trained(m) == ["l0.lora_A", "l0.lora_B"]
        assert not m.l1.down.requires_grad and not m.l1.up.requires_grad
    # Lifted: every flag back to its starting value, the late adapter's included.
    assert all(p.requires_grad for p in m.parameters())


def test_lora_added_after_mark_trainable():
    torch.manual_seed(0)
    m = Net()
    ts.mark_trainable(m, "adapters")  # only the (still empty) adapter dict trains
    try:
        assert list(ts.trainable_parameters(m)) == []
        assert not any(p.requires_grad for p in m.parameters())
        m.adapters["a"] = LoRA(nn.Linear(4, 4))  # under the admitted name: trains
        m.extra = LoRA(nn.Linear(4, 4))  # a new root child, not declared: frozen
        trained = _trained(m)
        assert trained == sorted(
            ["adapters.a.base.weight", "adapters.a.base.bias", "adapters.a.lora_A",
             "adapters.a.lora_B"]
        )
        assert not any(p.requires_grad for p in m.extra.parameters())
        # A declaration inside the adapter: only its low-rank factors train.
        ts.mark_trainable(m.adapters["a"], "lora_A", "lora_B")
        assert _trained(m) == ["adapters.a.lora_A", "adapters.a.lora_B"]
    finally:
        ts.mark_trainable(m, None)
    assert m.l0.weight.requires_grad and m.extra.lora_A.requires_grad
    assert not m.adapters["a"].base.weight.requires_grad  # its own declaration remains
