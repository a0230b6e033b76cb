"""An outside audit of recently changed behaviour, each answer against plain PyTorch.

What is checked:

* ``ts.swap``: ``nn.Module`` conversions inside the block (``.half()``, ``.double()``,
  ``.float()``, ``.type()``, ``.to()`` also on PyTorch's swap path, ``.share_memory()``,
  ``.to_empty()``) act on the parameters themselves, never writing a stand-in into the model;
  ``ts.state_dict`` inside the block holds the stand-ins (as ``model.state_dict()``) and
  ``ts.load_state_dict`` writes the parameters; forwards
  inside ``swap`` and ``stop_gradient`` equal ``torch.func.functional_call`` / a detached twin.
* ``ts.constant``: batch norm's running statistics held as parameters (module and every
  functional entry point), ``apply_`` / ``map_`` / ``map2_`` / ``share_memory_``, empty
  parameters, size/stride-only changes on the parameter (refused) and on an alias (allowed);
  read-only training and evaluation forwards and backwards of real models (a BatchNorm CNN,
  an LSTM, GPT-2 and BERT built from configs) pass and give the numbers they give outside.
* Contexts: a context refused because a ``trainable()`` declaration is invalid changes no flag;
  leaving ``unfreeze`` after the model grew warns naming the parameter turned back off; a
  function decorated with a context inside that context's ``with`` block keeps the block.
* Optimizers: torch's own AdamW / SGD state dicts (fused, foreach, capturable) load into
  ``ts.optim`` and the next step matches torch; ``add_param_group`` refuses fused / foreach /
  capturable / differentiable and AdamW's ``decoupled_weight_decay=False`` adding nothing;
  ``clip_by_global_norm`` refuses a tree of parameters and clips a tree of gradients as
  ``clip_grad_norm_`` does.
* ``ts.structural_grad`` does not raise (and equals ``torch.autograd.grad``) with ``.grad``
  already populated, tensor hooks, bf16 autocast, both kinds of activation checkpointing, HF
  GPT-2 with gradient checkpointing; it raises for a custom function running its own
  ``torch.autograd.backward`` and puts ``.grad`` back. ``ts.within_gradient`` inside
  ``torch.func.grad`` under ``no_grad`` / ``enable_grad`` / ``inference_mode`` agrees with
  whether the captured tensor is actually differentiated.
* ``ts.tree.from_module(buffers=True)`` in ``Module.state_dict()``'s order;
  ``flatten`` / ``unflatten`` round trips of conjugate and negative views in mixed trees.

Convention: a test that exposes a defect is kept, minimized, and marked
``@pytest.mark.xfail(strict=True, reason="BUG: what happens; what is expected")``. Limits the
documentation states are not treated as defects.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

import torchstruct as ts


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2))


def _standins(m, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) for k, v in m.named_parameters()}


# ---------------------------------------------------------------------------------------- swap


@pytest.mark.parametrize("conv", ["half", "double", "float", "type64", "to64", "to_same"])
def test_swap_module_conversion_acts_on_parameters(conv):
    m = _mlp().eval()
    twin = copy.deepcopy(m)
    x = torch.randn(5, 3)
    tree = _standins(m)
    fns = {
        "half": lambda mod: mod.half(),
        "double": lambda mod: mod.double(),
        "float": lambda mod: mod.float(),
        "type64": lambda mod: mod.type(torch.float64),
        "to64": lambda mod: mod.to(torch.float64),
        "to_same": lambda mod: mod.to("cpu"),
    }
    with ts.swap(m, tree):
        y = m(x)
        fns[conv](m)
    torch.testing.assert_close(y, functional_call(twin, tree, (x,)))
    fns[conv](twin)
    for (k, a), (_, b) in zip(m.named_parameters(), twin.named_parameters()):
        assert type(a) is nn.Parameter and a.dtype == b.dtype, k
        assert torch.equal(a, b), k
    for (k, a), (_, b) in zip(m.named_buffers(), twin.named_buffers()):
        assert a.dtype == b.dtype and torch.equal(a, b), k


def test_swap_module_conversion_on_torch_swap_path():
    m = _mlp().eval()
    twin = copy.deepcopy(m)
    tree = _standins(m)
    old = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with ts.swap(m, tree):
            m.double()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(old)
    twin.double()
    for (k, a), (_, b) in zip(m.named_parameters(), twin.named_parameters()):
        assert a.dtype == torch.float64 and torch.equal(a, b), k


def test_swap_share_memory_and_to_empty_keep_parameters():
    m = nn.Linear(3, 2)
    orig = {k: v.detach().clone() for k, v in m.named_parameters()}
    with ts.swap(m, {k: torch.zeros_like(v) for k, v in m.named_parameters()}):
        m.share_memory()
    for k, v in m.named_parameters():
        assert v.is_shared() and torch.equal(v, orig[k]), k
    m2 = nn.Linear(3, 2)
    tree = {k: torch.zeros_like(v) for k, v in m2.named_parameters()}
    with ts.swap(m2, tree):
        m2.to_empty(device="cpu")
    for k, v in m2.named_parameters():
        assert type(v) is nn.Parameter and v.shape == tree[k].shape
        assert all(v is not t for t in tree.values())
        assert v.untyped_storage().data_ptr() != tree[k].untyped_storage().data_ptr()


def test_swap_state_dict_holds_the_stand_ins_and_load_state_dict_writes_the_parameters():
    # docs/stop_gradient.md: ts.state_dict in the block holds what model.state_dict() holds
    # there (the stand-ins' values: saving EMA weights); ts.load_state_dict writes the
    # parameters themselves, never the tree's tensors
    m = _mlp()
    tree = _standins(m)
    with ts.swap(m, tree):
        sd = ts.state_dict(m)
        plain = m.state_dict()
    for k, v in sd.items():
        assert torch.equal(v, plain[k]), k
        if k in tree:  # (buffers are not swapped)
            assert torch.equal(v, tree[k]), k
    new = {k: torch.full_like(v, 0.5) for k, v in ts.state_dict(m).items()}
    x = torch.randn(4, 3)
    m.eval()
    with ts.swap(m, tree):
        ts.load_state_dict(m, new)
        y = m(x)
    torch.testing.assert_close(y, functional_call(copy.deepcopy(m), tree, (x,)))
    for k, v in m.named_parameters():
        assert torch.equal(v.detach(), new[k]), k
    for k, v in tree.items():
        assert not torch.equal(v, torch.full_like(v, 0.5)), k


def test_stop_gradient_forward_and_grads_match_detached_twin():
    m = _mlp()
    twin = copy.deepcopy(m)
    x = torch.randn(6, 3, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    with ts.stop_gradient(m, "0"):
        y = m(x)
    y.pow(2).sum().backward()
    params = {k: (v.detach() if k.startswith("0.") else v) for k, v in twin.named_parameters()}
    y2 = functional_call(twin, params, (x2,))
    y2.pow(2).sum().backward()
    torch.testing.assert_close(y, y2)
    torch.testing.assert_close(x.grad, x2.grad)
    assert m[0].weight.grad is None and m[0].bias.grad is None
    torch.testing.assert_close(m[3].weight.grad, twin[3].weight.grad)
    for a, b in zip(m.buffers(), twin.buffers()):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------ constant


def _bn_with_param_stats():
    bn = nn.BatchNorm1d(3)
    for name in ("running_mean", "running_var"):
        t = bn._buffers.pop(name)
        setattr(bn, name, nn.Parameter(t.clone(), requires_grad=False))
    return bn


def test_constant_batchnorm_param_stats_training_refused_eval_allowed():
    bn = _bn_with_param_stats()
    x = torch.randn(4, 3)
    before = [p.detach().clone() for p in bn.parameters()]
    with pytest.raises(RuntimeError, match="running_mean|running_var"):
        with ts.constant(bn):
            bn(x)
    assert all(torch.equal(p, b) for p, b in zip(bn.parameters(), before))
    bn.eval()
    with ts.constant(bn):
        y = bn(x)
    torch.testing.assert_close(y, F.batch_norm(x, before[2], before[3], before[0], before[1]))
    # only the weight selected: the statistics may update
    bn.train()
    ref = _bn_with_param_stats()
    with ts.constant(bn, "weight", "bias"):
        bn(x)
    ref(x)
    torch.testing.assert_close(bn.running_mean, ref.running_mean)


_BN_CALLS = {
    "F.batch_norm": lambda x, p, v: F.batch_norm(x, p, v, training=True),
    "F.instance_norm": lambda x, p, v: F.instance_norm(x.unsqueeze(-1).expand(4, 3, 5), p, v,
                                                       use_input_stats=True),
    "batch_norm_update_stats": lambda x, p, v: torch.batch_norm_update_stats(x, p, v, 0.1),
    "_native_batch_norm_legit": lambda x, p, v: torch._native_batch_norm_legit(
        x, None, None, p, v, True, 0.1, 1e-5),
    "_batch_norm_with_update": lambda x, p, v: torch.ops.aten._batch_norm_with_update(
        x, None, None, p, v, 0.1, 1e-5),
    "alias": lambda x, p, v: F.batch_norm(x, p.detach(), v[:], training=True),
}


@pytest.mark.parametrize("name", sorted(_BN_CALLS))
def test_constant_functional_batchnorm_into_parameters(name):
    m = nn.Module()
    m.p = nn.Parameter(torch.zeros(3), requires_grad=False)
    m.v = nn.Parameter(torch.ones(3), requires_grad=False)
    x = torch.randn(4, 3)
    with pytest.raises(RuntimeError, match="'p'|'v'"):
        with ts.constant(m):
            _BN_CALLS[name](x, m.p, m.v)
    assert torch.equal(m.p, torch.zeros(3)) and torch.equal(m.v, torch.ones(3))
    # the functional variant writes nothing and passes, as does evaluation
    with ts.constant(m):
        torch.ops.aten._native_batch_norm_legit_functional(x, None, None, m.p, m.v, True, 0.1, 1e-5)
        F.batch_norm(x, m.p, m.v, training=False)


_UNDECLARED = {
    "apply_": lambda p, q: p.apply_(lambda a: a + 1),
    "apply_ alias": lambda p, q: p.detach().apply_(lambda a: a + 1),
    "apply_ view": lambda p, q: p[1:].apply_(lambda a: a + 1),
    "map_": lambda p, q: p.map_(q, lambda a, b: a + b),
    "map_ data": lambda p, q: p.data.map_(q, lambda a, b: a + b),
    "map2_": lambda p, q: p.map2_(q, q, lambda a, b, c: a + b + c),
    "share_memory_": lambda p, q: p.share_memory_(),
    "t_": lambda p, q: p.t_(),
    "unsqueeze_": lambda p, q: p.unsqueeze_(0),
    "as_strided_": lambda p, q: p.as_strided_((3, 2), (1, 3)),
    "transpose_": lambda p, q: p.transpose_(0, 1),
}


@pytest.mark.parametrize("name", sorted(_UNDECLARED))
def test_constant_refuses_undeclared_writes_and_metadata_changes(name):
    m = nn.Module()
    m.p = nn.Parameter(torch.randn(2, 3), requires_grad=False)
    m.q = nn.Parameter(torch.randn(2, 3), requires_grad=False)
    before = (m.p.shape, m.p.stride(), m.p.detach().clone(), m.p.is_shared())
    with pytest.raises(RuntimeError, match="'p'"):
        with ts.constant(m, "p"), torch.no_grad():
            _UNDECLARED[name](m.p, m.q)
    assert (m.p.shape, m.p.stride(), m.p.is_shared()) == (before[0], before[1], before[3])
    assert torch.equal(m.p.detach(), before[2])
    # the same on the unselected parameter passes, as in plain PyTorch
    with ts.constant(m, "p"), torch.no_grad():
        _UNDECLARED[name](m.q, m.p)


@pytest.mark.parametrize("op", ["t_", "unsqueeze_", "as_strided_", "transpose_", "squeeze_view"])
def test_constant_metadata_change_of_alias_allowed(op):
    m = nn.Module()
    m.p = nn.Parameter(torch.randn(2, 3))
    plain = torch.randn(2, 3)
    fns = {
        "t_": lambda t: t.t_(),
        "unsqueeze_": lambda t: t.unsqueeze_(0),
        "as_strided_": lambda t: t.as_strided_((3, 2), (1, 3)),
        "transpose_": lambda t: t.transpose_(0, 1),
        "squeeze_view": lambda t: t[0:1].squeeze_(0),
    }
    before = (m.p.shape, m.p.stride(), m.p.detach().clone())
    with ts.constant(m):
        a = fns[op](m.p.detach())
        b = fns[op](m.p.data)
    expect = fns[op](plain.detach())
    assert a.shape == expect.shape == b.shape and a.stride() == expect.stride()
    assert (m.p.shape, m.p.stride()) == before[:2] and torch.equal(m.p.detach(), before[2])


@pytest.mark.parametrize("name", ["zero_", "copy_", "set_", "data=", "unsqueeze_", "t_2d"])
def test_constant_empty_parameter_protected(name):
    m = nn.Module()
    shape = (0, 3) if name == "t_2d" else (0,)
    m.p = nn.Parameter(torch.empty(shape))
    m.q = nn.Parameter(torch.randn(2))
    fns = {
        "zero_": lambda p: p.zero_(),
        "copy_": lambda p: p.copy_(torch.empty(0)),
        "set_": lambda p: p.set_(torch.ones(2)),
        "data=": lambda p: setattr(p, "data", torch.ones(2)),
        "unsqueeze_": lambda p: p.unsqueeze_(0),
        "t_2d": lambda p: p.t_(),
    }
    with pytest.raises(RuntimeError, match="'p'"):
        with ts.constant(m), torch.no_grad():
            fns[name](m.p)
    assert m.p.shape == shape
    # other empty tensors and the other parameter's reads stay free
    with ts.constant(m), torch.no_grad():
        torch.empty(0).zero_()
        torch.empty(0).resize_(4)
        m.p.detach().unsqueeze_(0)
        (m.q * 2).sum()


def test_constant_real_models_read_only_forwards_match():
    torch.manual_seed(0)
    cnn = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                        nn.Linear(4 * 4 * 4, 3))
    lstm = nn.LSTM(3, 5, num_layers=2, batch_first=True)
    xs = torch.randn(3, 2, 6, 6)
    xl = torch.randn(2, 4, 3)
    for train in (True, False):
        a, b = copy.deepcopy(cnn).train(train), copy.deepcopy(cnn).train(train)
        la, lb = copy.deepcopy(lstm).train(train), copy.deepcopy(lstm).train(train)
        with ts.constant(a), ts.constant(la):
            ya = a(xs)
            ya.sum().backward()
            oa = la(xl)[0]
            oa.sum().backward()
        yb = b(xs)
        yb.sum().backward()
        ob = lb(xl)[0]
        ob.sum().backward()
        assert torch.equal(ya, yb) and torch.equal(oa, ob)
        for p, q in zip(list(a.parameters()) + list(la.parameters()),
                        list(b.parameters()) + list(lb.parameters())):
            assert torch.equal(p.grad, q.grad)
        for p, q in zip(a.buffers(), b.buffers()):
            assert torch.equal(p, q)


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_constant_hf_models_read_only(kind):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=50, n_positions=16)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.BertConfig(num_hidden_layers=2, num_attention_heads=2, hidden_size=16,
                                      intermediate_size=32, vocab_size=50,
                                      max_position_embeddings=16)
        model = transformers.BertForMaskedLM(cfg)
    ids = torch.randint(0, 50, (2, 7))
    for train in (True, False):
        a = copy.deepcopy(model).train(train)
        b = copy.deepcopy(model).train(train)
        torch.manual_seed(1)
        with ts.constant(a):
            la = a(input_ids=ids, labels=ids).loss
            la.backward()
        torch.manual_seed(1)
        lb = b(input_ids=ids, labels=ids).loss
        lb.backward()
        assert torch.equal(la, lb)
        for (k, p), q in zip(a.named_parameters(), b.parameters()):
            assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), k


# ------------------------------------------------------------------------------------ contexts


def test_invalid_declaration_refusal_changes_no_flag():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(2, 2)
            self.b = nn.Linear(2, 2)

        def trainable(self):
            return ["a", "b"]

    m = Net()
    ts.attach(m)
    m.b.bias.requires_grad_(False)
    flags = [p.requires_grad for p in m.parameters()]
    del m.b
    flags = flags[:2]
    for ctx in (lambda: ts.freeze(m, "a.weight"), lambda: ts.unfreeze(m, "a"),
                lambda: ts.freeze_except(m, "a.bias")):
        with pytest.raises(Exception):
            with ctx():
                pass
        assert [p.requires_grad for p in m.parameters()] == flags


def test_unfreeze_exit_after_growth_warns_naming_parameter():
    m = nn.Sequential(nn.Linear(2, 2))
    m.requires_grad_(False)
    with pytest.warns(ts.RestoredFlagsWarning, match=r"requires_grad=False: '0\.weight', '0\.bias'"):
        with ts.unfreeze(m, "*"):
            m.append(nn.Linear(2, 2))
            m[1].requires_grad_(False)
            m(torch.randn(1, 2))
            m[1].requires_grad_(True)
    assert not any(p.requires_grad for p in m[0].parameters())


def test_decorating_inside_own_with_block_keeps_block():
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    ctx = ts.freeze(m, "0")
    with ctx:
        @ctx
        def f():
            return m[0].weight.requires_grad

        assert f() is False
        assert m[0].weight.requires_grad is False
        assert not ts.is_trainable(m, "0.weight")
        assert m[1].weight.requires_grad is True
    assert all(p.requires_grad for p in m.parameters())
    assert f() is False and m[0].weight.requires_grad is True


# ---------------------------------------------------------------------------------- optimizers


@pytest.mark.parametrize("kw", [dict(fused=True), dict(foreach=True), dict(foreach=False),
                                dict(capturable=True)])
def test_torch_adamw_state_dict_loads_and_steps_like_torch(kw):
    torch.manual_seed(0)
    m = nn.Linear(3, 2)
    if "capturable" in kw:
        o = torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.1, foreach=False)
    else:
        o = torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.1, **kw)
    m(torch.randn(4, 3)).sum().backward()
    o.step()
    sd = copy.deepcopy(o.state_dict())
    if "capturable" in kw:
        sd["param_groups"][0]["capturable"] = True
    ma, mb = copy.deepcopy(m), copy.deepcopy(m)
    ref = torch.optim.AdamW(ma.parameters(), lr=0.5, foreach=False)
    ref.load_state_dict(copy.deepcopy(sd))
    ref.param_groups[0].update(foreach=False, fused=None, capturable=False)
    t = ts.optim.AdamW(mb.parameters(), lr=0.5)
    t.load_state_dict(copy.deepcopy(sd))
    g = torch.randn(4, 3)
    for mm in (ma, mb):
        mm(g).sum().backward()
    ref.step()
    t.step()
    for a, b in zip(ma.parameters(), mb.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kw", [dict(fused=True), dict(foreach=True), dict(foreach=False)])
def test_torch_sgd_state_dict_loads_and_steps_like_torch(kw):
    torch.manual_seed(0)
    m = nn.Linear(3, 2)
    o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01, **kw)
    m(torch.randn(4, 3)).sum().backward()
    o.step()
    sd = copy.deepcopy(o.state_dict())
    ma, mb = copy.deepcopy(m), copy.deepcopy(m)
    ref = torch.optim.SGD(ma.parameters(), lr=0.5, momentum=0.9, foreach=False)
    ref.load_state_dict(copy.deepcopy(sd))
    ref.param_groups[0].update(foreach=False, fused=None)
    t = ts.optim.SGD(mb.parameters(), lr=0.5, momentum=0.9)
    t.load_state_dict(copy.deepcopy(sd))
    g = torch.randn(4, 3)
    for mm in (ma, mb):
        mm(g).sum().backward()
    ref.step()
    t.step()
    for a, b in zip(ma.parameters(), mb.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("cls,kw", [
    ("AdamW", dict(fused=True)), ("AdamW", dict(foreach=True)), ("AdamW", dict(capturable=True)),
    ("AdamW", dict(differentiable=True)), ("AdamW", dict(decoupled_weight_decay=False)),
    ("SGD", dict(fused=True)), ("SGD", dict(foreach=True)), ("SGD", dict(differentiable=True)),
])
def test_add_param_group_refuses_unoffered_options(cls, kw):
    m = nn.Linear(3, 2)
    extra = nn.Parameter(torch.randn(3))
    opt = getattr(ts.optim, cls)(m.parameters(), lr=0.1)
    groups = copy.deepcopy(opt.param_groups)
    with pytest.raises(TypeError):
        opt.add_param_group(dict(params=[extra], **kw))
    assert len(opt.param_groups) == 1
    assert [p for p in opt.param_groups[0]["params"]] == list(m.parameters())
    assert {k: v for k, v in opt.param_groups[0].items() if k != "params"} == {
        k: v for k, v in groups[0].items() if k != "params"}
    # the same group without the option is fine
    opt.add_param_group(dict(params=[extra]))
    assert len(opt.param_groups) == 2


def test_clip_refuses_parameter_tree_accepts_gradient_tree():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    (m(torch.randn(5, 3)) * 10).sum().backward()
    grads_before = [p.grad.clone() for p in m.parameters()]
    for bad in (dict(m.named_parameters()), ts.tree.from_module(m)):
        with pytest.raises(TypeError):
            ts.clip_by_global_norm(bad, 0.1)
    assert all(torch.equal(p.grad, g) for p, g in zip(m.parameters(), grads_before))
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), copy.deepcopy(list(m.parameters()))))
    tree = ts.structural_grad(m, lambda mod: (mod(torch.ones(2, 3)) * 10).sum())
    flat = [t.clone() for t in ts.tree.leaves(tree)]
    n = ts.clip_by_global_norm(tree, 0.1)
    ref = [t.clone() for t in flat]
    for t, r in zip(flat, ref):
        t.grad = r
    n_ref = torch.nn.utils.clip_grad_norm_(flat, 0.1)
    torch.testing.assert_close(n, n_ref)
    for a, b in zip(ts.tree.leaves(tree), flat):
        torch.testing.assert_close(a, b.grad)


# --------------------------------------------------------------------------- structural grads


def _agree(tree, model, lossf):
    ref = torch.autograd.grad(lossf(model), list(model.parameters()))
    got = ts.tree.leaves(tree)
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)


def test_structural_grad_with_existing_grad_hooks_amp_and_checkpoints():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(5, 3)
    m(x).sum().backward()
    old = [p.grad.clone() for p in m.parameters()]
    lossf = lambda mod: mod(x).pow(2).sum()
    _agree(ts.structural_grad(m, lossf), m, lossf)
    h = m[0].weight.register_hook(lambda g: g * 2)
    h2 = m[2].weight.register_post_accumulate_grad_hook(lambda p: None)
    _agree(ts.structural_grad(m, lossf), m, lossf)
    h.remove()
    h2.remove()
    xx = x.clone().requires_grad_()
    for reentrant in (False, True):
        f = lambda mod: checkpoint(mod, xx, use_reentrant=reentrant).pow(2).sum()
        _agree(ts.structural_grad(m, f), m, lambda mod: mod(xx).pow(2).sum())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        f = lambda mod: mod(x).float().pow(2).sum()
        _agree(ts.structural_grad(m, f), m, f)
    assert all(torch.equal(p.grad, o) for p, o in zip(m.parameters(), old))


@pytest.mark.parametrize("reentrant", [False, True])
def test_structural_grad_hf_gradient_checkpointing(reentrant):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=50, n_positions=16)
    model = transformers.GPT2LMHeadModel(cfg).train()
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
    model = transformers.GPT2LMHeadModel(cfg).train()
    twin = copy.deepcopy(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if reentrant:
        model.enable_input_require_grads()
    ids = torch.randint(0, 50, (2, 6))
    tree = ts.structural_grad(model, lambda mod: mod(input_ids=ids, labels=ids).loss)
    twin(input_ids=ids, labels=ids).loss.backward()
    flat = ts.tree.to_flat_dict(tree)
    for k, p in twin.named_parameters():
        if k in flat:
            torch.testing.assert_close(flat[k], p.grad, rtol=1e-4, atol=1e-6)
    assert all(p.grad is None for p in model.parameters())


def test_structural_grad_refuses_inner_backward_and_puts_grad_back():
    class Rev(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x)
            ctx.w = w
            return x * w.detach()

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            with torch.enable_grad():
                y = x.detach() * ctx.w
                torch.autograd.backward(y, g)
            return g * ctx.w.detach(), None

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))
            self.v = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return Rev.apply(x, self.w) * self.v

    m = M()
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="'w'"):
        ts.structural_grad(m, lambda mod: mod(x).sum())
    assert m.w.grad is None and m.v.grad is None and x.grad is None
    # a .grad accumulated in place cannot be put back: the error says so
    m.w.grad = torch.full((3,), 5.0)
    with pytest.raises(RuntimeError, match="accumulated in place"):
        ts.structural_grad(m, lambda mod: mod(x).sum())
    # plain backward gives the gradient the refusal protects
    m.w.grad = None
    m(x).sum().backward()
    assert torch.allclose(m.w.grad, x.detach())


@pytest.mark.parametrize("mode", ["no_grad", "enable_grad", "inference_mode"])
def test_within_gradient_captured_in_func_grad_matches_differentiation(mode):
    c = torch.randn(3, requires_grad=True)
    seen = {}

    def f(y):
        z = c * 2
        seen["c"] = ts.within_gradient(c)
        seen["y"] = ts.within_gradient(y)
        with torch.no_grad():
            seen["y_ng"] = ts.within_gradient(y)
        return (y * z).sum()

    ctx = getattr(torch, mode)
    with ctx():
        gy = torch.func.grad(f)(torch.randn(3))
    assert seen["y"] is True and seen["y_ng"] is False
    assert seen["c"] == gy.requires_grad == (mode == "enable_grad")


# -------------------------------------------------------------------------------------- trees


def test_from_module_buffers_in_state_dict_order():
    class Blk(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(2)
            self.lin = nn.Linear(2, 2)
            self.register_buffer("z", torch.ones(1))
            self.w = nn.Parameter(torch.ones(1))

    m = nn.Sequential(Blk(), nn.Linear(2, 2), Blk())
    m.register_buffer("top", torch.zeros(1))
    flat = ts.tree.to_flat_dict(ts.tree.from_module(m, buffers=True))
    sd = m.state_dict(keep_vars=True)
    assert list(flat) == list(sd)
    assert all(flat[k] is v for k, v in sd.items())


def test_flatten_unflatten_conj_neg_views_mixed_tree():
    torch.manual_seed(0)
    b = torch.randn(3, dtype=torch.complex64)
    tree = {"a": b, "c": b.conj(), "n": torch.ops.aten._neg_view(b), "im": b.imag,
            "r": torch.randn(2), "d": {"h": torch.randn(2, dtype=torch.float16)}}
    vec, spec = ts.tree.flatten(tree)
    assert vec.dtype == torch.complex64
    expect = torch.cat([t.resolve_conj().resolve_neg().reshape(-1).to(torch.complex64)
                        for t in (b, b.conj(), torch.ops.aten._neg_view(b), b.imag)] +
                       [tree["r"].to(torch.complex64), tree["d"]["h"].to(torch.complex64)])
    assert vec.numel() == expect.numel()
    back = ts.tree.unflatten(vec.clone(), spec)
    for k in ("a", "c", "n", "im", "r"):
        assert back[k].dtype == tree[k].dtype
        assert torch.equal(back[k].resolve_conj().resolve_neg(), tree[k].resolve_conj().resolve_neg()), k
    assert torch.equal(back["d"]["h"], tree["d"]["h"])
    bad = vec.clone()
    bad[-1] = bad[-1] + 1j
    with pytest.raises(TypeError):
        ts.tree.unflatten(bad, spec)
