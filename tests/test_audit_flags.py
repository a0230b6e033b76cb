"""Flags, hooks and contexts tried as a suspicious user would, on real libraries.

Each test states what a user may rely on (DESIGN.md §1, Flags, §2, §Errors, docs/freezing.md).
A test marked ``xfail(strict=True)`` reproduces a case that gives a silently wrong flag or
statistic today; its reason says what goes wrong and what the contract asks for.
"""
import copy
import gc
import os
import warnings

import pytest
import torch
from torch import nn

import torchstruct as ts
from _flags import consistent, flags

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def x3():
    return torch.randn(8, 3)


def bn_net():
    return nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 1))



# --------------------------------------------------------------------------------- norm statistics
def test_a_batchnorm_shared_by_two_attached_models_keeps_its_training_mode():
    bn = nn.BatchNorm1d(3)
    a = nn.Sequential(nn.Linear(3, 3), bn)
    b = nn.Sequential(nn.Linear(3, 3), bn)
    ts.attach(a)
    ts.attach(b)
    with ts.freeze(a, "1"):
        a.train()
        a(x3())
        assert bn.training
    assert bn.training


def test_a_copy_frozen_itself_keeps_its_batchnorm_training_mode():
    net = bn_net()
    ts.freeze(net, "1")  # permanent: the layer's statistics are held
    cp = copy.deepcopy(net)
    ts.freeze(cp, "1")
    cp.train()
    cp(x3())
    assert cp[1].training


def test_held_batchnorm_restores_training_mode_after_each_forward_and_on_error():
    net = bn_net()
    with ts.freeze(net, "1"):
        net.train()
        net(x3())
        assert net[1].training
        with pytest.raises(RuntimeError):
            net[1](torch.randn(8, 4))  # shape error inside the held layer's own forward
        assert net[1].training
        net.eval()
        net(x3())
        assert not net[1].training
        net.train()
    before = net[1].running_mean.clone()
    net(x3())
    assert not torch.equal(before, net[1].running_mean)


def test_freeze_norm_stats_false_on_a_child_survives_attaching_the_parent():
    child = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    ts.attach(child, freeze_norm_stats=False)
    parent = nn.Sequential(child, nn.Linear(3, 1))
    ts.attach(parent)
    with ts.freeze(child, "1"):
        before = child[1].running_mean.clone()
        parent(x3())
        assert not torch.equal(before, child[1].running_mean)


def test_attaching_a_child_with_an_option_does_not_change_the_parent():
    child = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    other = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    parent = nn.Sequential(child, other)
    ts.attach(parent, freeze_norm_stats=False)
    ts.attach(child, freeze_norm_stats=True)
    with ts.freeze(parent):
        before = other[1].running_mean.clone()
        parent(x3())
        assert not torch.equal(before, other[1].running_mean)


# ----------------------------------------------------------------------------- the hook at forward
def test_a_head_added_after_a_bare_context_follows_it_at_the_next_forward_of_torch_compile():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    ts.freeze_except(m, "1")
    cm = torch.compile(m, backend="eager")
    m.append(nn.Linear(3, 1))
    cm(x3())
    assert not m[2].weight.requires_grad
    assert consistent(m)


def test_a_head_added_after_a_bare_context_follows_it_with_module_compile():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    ts.freeze_except(m, "1")
    m.compile(backend="eager")
    m.append(nn.Linear(3, 1))
    m(x3())
    assert not m[2].weight.requires_grad
    assert consistent(m)


def test_a_head_added_after_a_bare_context_follows_it_in_a_compiled_step_function():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    ts.freeze_except(m, "1")

    @torch.compile(backend="eager")
    def step(x):
        return m(x).sum()

    x = x3()
    step(x)
    m.append(nn.Linear(3, 1))
    for _ in range(2):
        step(x)
    assert not m[2].weight.requires_grad
    assert consistent(m)


def test_a_layer_inserted_into_a_sequential_follows_a_bare_context():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    keep = m[1]
    ts.freeze_except(m, keep)
    m.insert(0, nn.Linear(3, 3))
    m(x3())
    assert not m[0].weight.requires_grad
    assert consistent(m)


def test_a_layer_appended_to_a_module_list_follows_a_bare_context():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    keep = m[1]
    ts.freeze_except(m, keep)
    m.append(nn.Linear(1, 1))
    m(x3())
    assert not m[2].weight.requires_grad
    assert consistent(m)


def test_a_layer_added_to_a_submodule_follows_a_bare_context_at_the_submodule_forward():
    m = nn.Sequential(nn.Sequential(nn.Linear(3, 3)), nn.Linear(3, 1))
    ts.freeze(m, "0.*")
    m[0].append(nn.Linear(3, 3))
    m[0](x3())
    assert not m[0][1].weight.requires_grad
    assert consistent(m)


# ------------------------------------------------------------------------------- leaving the model
def test_a_module_deleted_under_a_bare_context_gets_its_flag_back_at_the_next_forward():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    ts.freeze(m)
    old = m[1]
    del m[1]
    m(x3())
    assert old.weight.requires_grad
    assert consistent(old)


def test_a_module_replaced_under_a_bare_context_gets_its_flag_back_at_the_next_forward():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    ts.freeze(m)
    old = m[1]
    m[1] = nn.Linear(3, 3)  # a registration: the tree changed
    m(x3())
    assert old.weight.requires_grad and consistent(old)
    assert not m[1].weight.requires_grad and consistent(m)


def test_a_bare_context_on_a_collected_model_releases_a_shared_submodule():
    lin = nn.Linear(3, 3)
    other = nn.Sequential(lin, nn.Linear(3, 1))
    ts.attach(other)
    tmp = nn.Sequential(lin)
    ts.freeze(tmp)
    assert not lin.weight.requires_grad
    del tmp
    gc.collect()
    other(x3())
    assert consistent(other)
    assert lin.weight.requires_grad


def test_a_with_block_on_a_model_sharing_a_submodule_restores_it_for_the_other():
    lin = nn.Linear(3, 3)
    other = nn.Sequential(lin, nn.Linear(3, 1))
    ts.attach(other)
    tmp = nn.Sequential(lin)
    with ts.freeze(tmp):
        assert not lin.weight.requires_grad
        assert not ts.is_trainable(other, "0.weight")
        other(x3())
        assert consistent(other)
    assert lin.weight.requires_grad and consistent(other)


def test_a_layer_moved_to_another_attached_model_inside_a_block_gets_its_flag_back():
    a = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    b = nn.Sequential(nn.Linear(3, 3))
    ts.attach(b)
    with ts.freeze(a, "1"):
        moved = a[1]
        b.append(moved)
        del a[1]
        b(x3())
        assert consistent(b)
    b(x3())
    assert moved.weight.requires_grad and consistent(b) and all(flags(a))


# -------------------------------------------------------------------------------- parametrizations
class _Symmetric(nn.Module):
    def forward(self, w):
        return w.triu() + w.triu(1).T


def test_a_declared_weight_renamed_by_a_parametrization_is_a_clear_error():
    """mark_trainable(lin, 'weight') then register_parametrization moves the weight to
    parametrizations.weight.original: the declaration's name is gone. It must not silently
    freeze the weight: the next application and every read raise, naming the name."""
    import torch.nn.utils.parametrize as parametrize

    lin = nn.Linear(3, 3)
    ts.mark_trainable(lin, "weight")
    parametrize.register_parametrization(lin, "weight", _Symmetric())
    with pytest.raises(ValueError, match=r"\['weight'\] no longer name"):
        lin(x3())
    with pytest.raises(ValueError, match="parametrization or pruning"):
        ts.trainable_parameters(lin)
    ts.mark_trainable(lin, "parametrizations")  # declared again: trains
    lin(x3())
    assert lin.parametrizations.weight.original.requires_grad


def test_parametrization_inside_a_block_keeps_the_same_object_and_its_flag():
    import torch.nn.utils.parametrize as parametrize

    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    w = m[0].weight
    with ts.freeze(m, "0"):
        parametrize.register_parametrization(m[0], "weight", _Symmetric())
        m(x3())
        assert m[0].parametrizations.weight.original is w
        assert not w.requires_grad and consistent(m)
    assert all(flags(m)) and consistent(m)


@pytest.mark.parametrize("norm", ["weight_norm", "spectral_norm"])
def test_old_style_weight_and_spectral_norm_inside_a_block(norm):
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    with ts.freeze(m, "0"):
        getattr(torch.nn.utils, norm)(m[0])
        m(x3())
        assert not any(p.requires_grad for p in m[0].parameters()) and consistent(m)
    assert all(flags(m)) and consistent(m)


def test_new_weight_norm_inside_a_block_trains_again_after_it():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ts.freeze(m, "0"):
            torch.nn.utils.parametrizations.weight_norm(m[0])
            m(x3())
    said = " ".join(
        str(w.message) for w in caught if issubclass(w.category, ts.RestoredFlagsWarning)
    )
    assert all(flags(m)) or "original0" in said


# ----------------------------------------------------------------------------- what PyTorch allows
def test_swap_module_params_on_conversion_works_on_an_attached_model():
    m = nn.Sequential(nn.Linear(3, 3))
    ts.attach(m)
    old = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        m.to(torch.float64)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(old)
    assert m[0].weight.dtype == torch.float64


@pytest.mark.parametrize("how", ["half", "to", "load_state_dict", "load_state_dict_assign"])
def test_conversions_inside_a_block_restore_the_flags(how):
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    other = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    state = {k: v.clone() for k, v in other.state_dict().items()}
    with ts.freeze(m, "0"):
        if how == "half":
            m.half()
            m.float()
        elif how == "to":
            m.to(torch.float64)
            m.to(torch.float32)
        else:
            m.load_state_dict(state, assign=how.endswith("assign"))
        m(x3())
        assert flags(m) == [False, False, True, True] and consistent(m)
    assert all(flags(m)) and consistent(m)


def test_freezing_an_unmaterialized_lazy_layer_holds_across_its_materialization():
    m = nn.Sequential(nn.Linear(3, 3), nn.LazyLinear(3))
    with ts.freeze(m):
        assert not any(flags(m))
        m(x3())  # materialized inside the block (the same parameter objects): still frozen
        assert not any(flags(m)) and consistent(m)
    assert all(flags(m)) and consistent(m)
    with ts.freeze(m):
        assert not any(flags(m))
    assert all(flags(m))


def test_lazy_layer_materialized_inside_a_block_on_other_parameters():
    m = nn.Sequential(nn.Linear(3, 3), nn.LazyLinear(1))
    with ts.freeze(m, "0"):
        m(x3())
        assert flags(m) == [False, False, True, True] and consistent(m)
    assert all(flags(m)) and consistent(m)


# ----------------------------------------------------------------------- selectors, evaluated when
def test_a_callable_selector_reading_the_flag_keeps_its_selection_in_nested_blocks():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    with ts.freeze(m, lambda path, p: p.requires_grad and path.endswith("bias")):
        assert flags(m) == [True, False, True, False]
        with ts.freeze(m, "1.weight"):
            assert flags(m) == [True, False, False, False]
    assert all(flags(m))


def test_a_glob_selector_does_not_move_to_another_layer_when_a_sequential_is_reindexed():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3))
    l1, l2 = m[1], m[2]
    with ts.freeze(m, "1"):
        del m[0]
        m.append(nn.Identity())  # any registration: the next forward re-applies
        m(x3())
        assert not l1.weight.requires_grad
        assert l2.weight.requires_grad


def test_a_glob_selector_covers_a_head_added_inside_the_block():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    with ts.freeze_except(m, "0"):
        m.append(nn.Linear(3, 1))
        m(x3())
        assert flags(m) == [True, True, False, False, False, False] and consistent(m)
    assert all(flags(m))


# ---------------------------------------------------------------------------- structural gradients
def test_value_and_grad_wrt_a_frozen_parameter_after_a_registration_before_the_call():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    ts.freeze(m, "0")
    m.append(nn.Identity())
    x = x3()
    _, tree = ts.value_and_grad(lambda mm: mm(x).sum(), m, wrt="0")
    assert set(ts.tree.to_flat_dict(tree)) == {"0.weight", "0.bias"}
    assert flags(m) == [False, False, True, True]


def test_value_and_grad_wrt_a_frozen_parameter_gives_its_gradient_and_changes_no_flag():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    ts.freeze(m, "0")
    m(x3())
    x = x3()
    _, tree = ts.value_and_grad(lambda mm: mm(x).sum(), m, wrt="0")
    plain = copy.deepcopy(m)
    ts.detach_hooks(plain)
    for p in plain.parameters():
        p.requires_grad_(True)
    plain(x).sum().backward()
    got = ts.tree.to_flat_dict(tree)
    assert torch.allclose(got["0.weight"], plain[0].weight.grad)
    assert flags(m) == [False, False, True, True] and consistent(m)


# --------------------------------------------------------------------------------------- swa_utils
def test_update_bn_on_a_model_with_frozen_batchnorm_recomputes_the_statistics():
    from torch.optim.swa_utils import update_bn

    net = bn_net()
    ts.freeze_except(net, "2")
    x = x3()
    update_bn([x], net)
    h = net[0](x).detach()
    assert torch.allclose(net[1].running_mean, h.mean(0), atol=1e-5)


def test_update_bn_on_an_averaged_copy_of_a_model_with_frozen_batchnorm():
    from torch.optim.swa_utils import AveragedModel, update_bn

    net = bn_net()
    with ts.freeze_except(net, "2"):
        swa = AveragedModel(net)
        x = x3()
        update_bn([x], swa)
        h = swa.module[0](x).detach()
        assert torch.allclose(swa.module[1].running_mean, h.mean(0), atol=1e-5)


# -------------------------------------------------------------------- norm layers frozen by others
def _tiny_resnet():
    pytest.importorskip("transformers")
    from transformers import ResNetConfig, ResNetForImageClassification

    cfg = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                       layer_type="basic", num_labels=3)
    torch.manual_seed(0)
    return ResNetForImageClassification(cfg).train()


def _stats_move(model, bns, *args, **kwargs):
    before = [m.running_mean.clone() for m in bns]
    model(*args, **kwargs)
    return [not torch.equal(b, m.running_mean) for b, m in zip(before, bns)]


def test_hf_resnet_batchnorm_held_inside_freeze_except_and_released_after():
    rn = _tiny_resnet()
    bns = [m for m in rn.modules() if isinstance(m, nn.BatchNorm2d)]
    img = torch.randn(2, 3, 32, 32)
    with ts.freeze_except(rn, "classifier"):
        assert not any(_stats_move(rn, bns, img))
        assert all(m.training for m in bns)
    assert all(_stats_move(rn, bns, img))


def test_a_block_elsewhere_does_not_hold_batchnorms_that_peft_froze():
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    pm = get_peft_model(_tiny_resnet(), LoraConfig(r=2, target_modules=["classifier.1"]))
    bns = [m for m in pm.modules() if isinstance(m, nn.BatchNorm2d)]
    img = torch.randn(2, 3, 32, 32)
    assert all(_stats_move(pm, bns, pixel_values=img))  # plain PEFT: statistics update
    with ts.freeze(pm, "*lora_A*"):
        pass
    assert all(_stats_move(pm, bns, pixel_values=img))


def test_a_block_elsewhere_does_not_hold_a_batchnorm_the_user_froze_by_hand():
    net = bn_net()
    net[1].requires_grad_(False)
    with ts.freeze(net, "2"):
        assert all(_stats_move(net, [net[1]], x3()))
    assert all(_stats_move(net, [net[1]], x3()))


# ------------------------------------------------------------------------ attaching a parent later
def test_attaching_the_parent_inside_a_childs_block_gives_no_spurious_warning():
    child = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    ts.attach(child)
    child.append(nn.Identity())
    child(x3())
    parent = nn.Sequential(child, nn.Linear(3, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ts.RestoredFlagsWarning)
        with ts.freeze(child, "0"):
            ts.attach(parent)
    assert all(flags(parent))


def test_attaching_the_parent_inside_a_childs_block_restores_every_flag():
    child = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    ts.attach(child)
    parent = nn.Sequential(child, nn.Linear(3, 1))
    with ts.freeze(child, "0"):
        ts.attach(parent)
        assert flags(parent) == [False, False, True, True, True, True] and consistent(parent)
        with ts.freeze(parent, "1"):
            assert flags(parent) == [False, False, True, True, False, False]
    assert all(flags(parent)) and consistent(parent)


# --------------------------------------------------------------------------------- cases that hold
def _tiny_gpt2():
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=16,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def test_gpt2_tied_head_and_embedding_freeze_and_unfreeze_together():
    g = _tiny_gpt2()
    assert g.lm_head.weight is g.transformer.wte.weight
    with ts.freeze(g, "lm_head"):
        assert not g.transformer.wte.weight.requires_grad
        assert not ts.is_trainable(g, "transformer.wte.weight") and consistent(g)
    assert all(flags(g))
    with ts.freeze_except(g, "transformer.h.1"):
        with ts.unfreeze(g, "lm_head"):
            assert g.transformer.wte.weight.requires_grad and consistent(g)
            names = [p for p, _ in ts.trainable_parameters(g)]
            assert "transformer.wte.weight" in names and "lm_head.weight" not in names
        assert not g.transformer.wte.weight.requires_grad and consistent(g)
    assert all(flags(g)) and consistent(g)


def test_gpt2_resize_token_embeddings_inside_a_block_keeps_the_tie_and_restores():
    g = _tiny_gpt2()
    ids = torch.randint(0, 50, (2, 8))
    with ts.freeze(g, "transformer.wte"):
        g.resize_token_embeddings(60)
        g(ids)
        assert g.lm_head.weight is g.transformer.wte.weight
        assert not g.transformer.wte.weight.requires_grad and consistent(g)
    assert all(flags(g)) and consistent(g)


def test_gpt2_summary_and_trainable_parameters_agree_with_the_flags_after_forward():
    g = _tiny_gpt2()
    ts.freeze_except(g, "transformer.h.1.*")
    g(torch.randint(0, 50, (2, 8)))
    assert consistent(g)
    assert ts.summary(g).trainable == sum(p.numel() for p in g.parameters() if p.requires_grad)


def test_gpt2_gradient_checkpointing_under_freeze_except_gives_grads_only_to_the_selected():
    g = _tiny_gpt2()
    g.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    g.train()
    ids = torch.randint(0, 50, (2, 8))
    with ts.freeze_except(g, "transformer.h.1"):
        g(ids, labels=ids).loss.backward()
    got = {n for n, p in g.named_parameters() if p.grad is not None}
    assert got and all(n.startswith("transformer.h.1.") for n in got)
    assert all(flags(g))


def test_peft_lora_contexts_restore_peft_flags():
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    pm = get_peft_model(_tiny_gpt2(), LoraConfig(r=2, target_modules=["c_attn"],
                                                 fan_in_fan_out=True))
    before = {n: p.requires_grad for n, p in pm.named_parameters()}
    ids = torch.randint(0, 50, (2, 8))
    with ts.freeze(pm, "*lora_A*"):
        pm(ids)
        assert all(p.requires_grad for n, p in pm.named_parameters() if "lora_B" in n)
        assert not any(p.requires_grad for n, p in pm.named_parameters() if "lora_A" in n)
        assert consistent(pm)
    with ts.unfreeze(pm, "*wte*"):
        assert consistent(pm)
    assert {n: p.requires_grad for n, p in pm.named_parameters()} == before
    with ts.freeze(pm):
        merged = pm.merge_and_unload()
    assert not any(flags(merged))  # PEFT's own flags on the base model stand


def test_mark_trainable_inside_a_block_outlives_it_and_its_removal_restores():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    with ts.freeze(m, "1"):
        ts.mark_trainable(m[0], "bias")
        assert flags(m) == [False, True, False, False] and consistent(m)
    assert flags(m) == [False, True, True, True] and consistent(m)
    ts.mark_trainable(m[0], None)
    assert all(flags(m)) and consistent(m)


def test_overlapping_contexts_left_out_of_order():
    m = nn.Sequential(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)), nn.Linear(3, 1))
    outer = ts.freeze_except(m, "1")
    inner = ts.unfreeze(m[0], "0")
    assert flags(m) == [True, True, False, False, True, True] and consistent(m)
    outer.__exit__(None, None, None)
    assert all(flags(m)) and consistent(m)
    inner.__exit__(None, None, None)
    assert all(flags(m)) and consistent(m)


def test_contexts_on_two_models_sharing_a_submodule():
    s = nn.Linear(3, 3)
    a = nn.Sequential(s, nn.Linear(3, 1))
    b = nn.Sequential(s, nn.Linear(3, 1))
    with ts.freeze(a, "0"):
        assert not s.weight.requires_grad and consistent(a) and consistent(b)
        with ts.unfreeze(b, "0"):  # the inner one wins
            assert s.weight.requires_grad and consistent(a) and consistent(b)
        assert not s.weight.requires_grad and consistent(b)
    assert s.weight.requires_grad and consistent(a) and consistent(b)


def test_a_generator_with_its_own_block_closed_inside_another_block():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))

    def gen():
        with ts.freeze(m, "0"):
            yield 1
            yield 2

    g = gen()
    next(g)
    with ts.freeze(m, "1"):
        assert not any(flags(m))
        g.close()  # leaves the generator's block, entered before this one
        assert flags(m) == [True, True, False, False]
    assert all(flags(m))


def test_a_frozen_layer_put_in_place_inside_a_block_is_named_when_turned_on():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    with pytest.warns(ts.RestoredFlagsWarning, match="0.weight"):
        with ts.freeze(m, "0"):
            m[0] = nn.Linear(3, 3).requires_grad_(False)
            m(x3())


def test_contexts_with_held_batchnorm_from_two_threads():
    import sys
    import threading

    a, b = bn_net(), bn_net()
    ts.attach(a)
    ts.attach(b)
    bad = []

    def work(m, sel, expect):
        x = x3()
        for _ in range(100):
            with ts.freeze(m, sel):
                before = m[1].running_mean.clone()
                m(x)
                if flags(m) != expect or not torch.equal(before, m[1].running_mean):
                    bad.append(flags(m))
            m(x)
            if not m[1].training:
                bad.append("eval")

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        ts_ = [
            threading.Thread(target=work, args=(a, "1", [True, True, False, False, True, True])),
            threading.Thread(target=work, args=(b, ["0", "1"], [False] * 4 + [True, True])),
        ]
        for t in ts_:
            t.start()
        for t in ts_:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert bad == []
    assert all(flags(a)) and all(flags(b))


# ------------------------------------------------------------------------- more renames and writes
def test_a_declared_weight_renamed_by_pruning_is_a_clear_error():
    """prune.l1_unstructured renames 'weight' to 'weight_orig' (the same object): a declaration
    naming 'weight' must raise, not silently freeze the pruned weight."""
    import torch.nn.utils.prune as prune

    lin = nn.Linear(3, 3)
    ts.mark_trainable(lin, "weight")
    prune.l1_unstructured(lin, "weight", amount=0.3)
    with pytest.raises(ValueError, match=r"\['weight'\] no longer name"):
        lin(x3())
    ts.mark_trainable(lin, "weight_orig")
    lin(x3())
    assert lin.weight_orig.requires_grad and not lin.bias.requires_grad


def test_pruning_inside_a_block_keeps_the_object_and_restores_its_flag():
    import torch.nn.utils.prune as prune

    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    w = m[0].weight
    with ts.freeze(m, "0"):
        prune.l1_unstructured(m[0], "weight", amount=0.3)
        m(x3())
        assert m[0].weight_orig is w and not w.requires_grad and consistent(m)
    assert w.requires_grad and all(flags(m)) and consistent(m)


def test_reads_and_flags_agree_after_a_module_requires_grad_write_inside_a_block():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    with ts.freeze(m, "0"):
        m.requires_grad_(True)
        m(x3())
        assert consistent(m)
    assert all(flags(m))


def test_module_requires_grad_false_inside_a_block_follows_the_documented_rule():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    with ts.freeze(m, "0"):
        m.requires_grad_(False)
        assert not any(flags(m)) and consistent(m)
    # m[1]'s write differs from the block's: it stands; m[0]'s equals the block's: undone
    assert flags(m) == [True, True, False, False] and consistent(m)


def test_contexts_under_inference_mode_and_inside_a_compiled_function():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    with torch.inference_mode():
        with ts.freeze(m, "0"):
            assert flags(m) == [False, False, True, True]
    assert all(flags(m))

    @torch.compile(backend="eager")
    def step(x):
        with ts.freeze(m, "0"):
            return m(x).sum()

    for _ in range(2):
        m.zero_grad(set_to_none=True)
        step(x3()).backward()
        assert [p.grad is not None for p in m.parameters()] == [False, False, True, True]
        assert all(flags(m))


# ------------------------------------------------------------------- shared and leaving submodules
def test_a_declaration_on_one_model_is_seen_by_another_sharing_the_submodule():
    s = nn.Linear(3, 3)
    a = nn.Sequential(s)
    b = nn.Sequential(s, nn.Linear(3, 1))
    ts.attach(b)
    ts.mark_trainable(a)
    assert not s.weight.requires_grad
    b.append(nn.Identity())  # a registration into b: its next forward re-applies
    b(x3())
    assert not s.weight.requires_grad
    assert consistent(b)


def test_a_block_on_a_submodule_holds_after_the_submodule_leaves_the_model():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    ts.attach(m)
    sub = m[0]
    with ts.freeze(sub):
        del m[0]
        m.append(nn.Identity())
        m(x3())
        assert not sub.weight.requires_grad
        assert consistent(sub)
    assert sub.weight.requires_grad


def test_a_context_on_one_model_is_seen_by_another_sharing_the_submodule():
    s = nn.Linear(3, 3)
    a = nn.Sequential(s)
    b = nn.Sequential(s, nn.Linear(3, 1))
    ts.attach(b)
    with ts.freeze(a):
        b.append(nn.Identity())
        b(x3())
        assert not s.weight.requires_grad and consistent(b)
    assert s.weight.requires_grad and consistent(b)


# --------------------------------------------------------------------------- errors change nothing
def test_value_and_grad_wrt_on_an_unmaterialized_lazy_model_leaves_the_flags():
    m = nn.Sequential(nn.Linear(3, 3), nn.LazyLinear(1))
    x = x3()
    with pytest.raises(ValueError):
        ts.value_and_grad(lambda mm: mm(x).sum(), m, wrt="0.weight")
    assert all(p.requires_grad for p in m[0].parameters())


def test_meta_and_to_empty_inside_and_under_contexts_keep_the_rules():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    with ts.freeze(m, "0"):
        m.to("meta")
        m.to_empty(device="cpu")  # new parameter objects, written into _parameters directly
        assert flags(m) == [False, False, True, True] and consistent(m)
    assert all(flags(m)) and consistent(m)

    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    ts.attach(m)
    m[0].requires_grad_(False)  # the user's own choice
    with ts.freeze(m, "1"):
        m.to("meta")
        m.to_empty(device="cpu")
    assert flags(m) == [False, False, True, True] and consistent(m)


# -------------------------------------------------------------------------------------- torch.func
def _grown_model():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    ts.freeze_except(m, "1")
    m.append(nn.Linear(1, 1))  # registered: the next forward applies the rule to it
    return m


def test_functional_call_on_a_model_with_a_pending_application():
    m = _grown_model()
    x = x3()
    tensors = {k: v.detach().clone().requires_grad_() for k, v in m.named_parameters()}
    torch.func.functional_call(m, tensors, (x,))
    assert all(t.requires_grad for t in tensors.values())
    m(x)
    assert not m[2].weight.requires_grad and consistent(m)


@pytest.mark.parametrize("compiled", [False, True])
def test_functional_call_with_parameter_stand_ins_on_a_model_with_a_pending_application(compiled):
    # stand-ins that are Parameters themselves are not the model's own: the change is applied
    # to the model's own parameters before the call (as a forward does), a hand write read
    # before stands, and the stand-ins are never written
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    ts.freeze_except(m, "1")
    m(x3())
    m[0].weight.requires_grad_(True)  # by hand: it stands
    m.append(nn.Linear(1, 1))  # frozen by the bare context at the next application
    before = flags(m)
    stand_ins = {k: nn.Parameter(v.detach().clone()) for k, v in m.named_parameters()}
    call = torch.func.functional_call
    if compiled:
        call = torch.compile(call, backend="eager")
    assert before == [True, False, True, True, True, True]
    call(m, stand_ins, (x3(),)).sum().backward()
    assert flags(m) == [True, False, True, True, False, False] and consistent(m)
    assert all(v.requires_grad and v.grad is not None for v in stand_ins.values())
    m(x3())
    assert flags(m) == [True, False, True, True, False, False] and consistent(m)


def test_torch_func_grad_over_functional_call_on_a_model_with_a_pending_application():
    m = _grown_model()
    x = x3()
    tensors = {k: v.detach().clone() for k, v in m.named_parameters()}
    g = torch.func.grad(lambda p: torch.func.functional_call(m, p, (x,)).sum())(tensors)
    assert set(g) == set(tensors)


def test_functional_call_and_torch_func_grad_on_a_clean_attached_model():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    ts.freeze_except(m, "1")
    m(x3())
    x = x3()
    tensors = {k: v.detach().clone().requires_grad_() for k, v in m.named_parameters()}
    torch.func.functional_call(m, tensors, (x,)).sum().backward()
    assert all(t.grad is not None for t in tensors.values())
    g = torch.func.grad(lambda p: torch.func.functional_call(m, p, (x,)).sum())(
        {k: v.detach() for k, v in tensors.items()})
    assert all(torch.allclose(g[k], tensors[k].grad) for k in g)
    assert flags(m) == [False, False, True, True] and consistent(m)


@pytest.mark.parametrize("name", ["orthogonal", "spectral_norm"])
def test_single_tensor_parametrizations_inside_a_block_restore(name):
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    w = m[0].weight
    with ts.freeze(m, "0"):
        getattr(torch.nn.utils.parametrizations, name)(m[0])
        m(x3())
        assert not w.requires_grad and consistent(m)
    assert m[0].parametrizations.weight.original is w
    assert all(flags(m)) and consistent(m)


# --------------------------------------------------------------------- against a brute-force model
def _declared(mod):
    from torchstruct.declare import declared

    return declared(mod)


def test_random_stacks_of_contexts_match_a_brute_force_fold():
    """Random contexts entered and left in random order (also out of order), declarations
    changed and flag writes by the user in between: the flags after every step equal a
    brute-force fold (starting flags, then the active contexts in entry order, then the
    declarations), and the reads agree with them.

    The documented rule for writes by others: at the next application, a flag that differs
    from the one torchstruct last wrote is the new starting flag, and the contexts active and
    declarations made when it was written no longer apply to it (the write stands; contexts
    entered and declarations made later apply on top); a flag equal to it (also after several
    writes that cancel out) is not seen."""
    import random

    rng = random.Random(0)
    selectors = ["0", "1", "1.0", "1.1.bias", "2.*", "*bias"]
    for _ in range(60):
        m = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)),
                          nn.Linear(2, 1))
        paths = [p for p, _ in m.named_parameters()]
        params = dict(m.named_parameters())
        start = {p: rng.random() < 0.8 for p in paths}
        for p in paths:
            params[p].requires_grad_(start[p])
        ts.attach(m)
        written = dict(start)
        active = []  # (kind, selected paths, ctx, serial)
        serial = 0  # of the newest context entered or declaration made
        over = {p: 0 for p in paths}  # contexts up to this serial do not apply to p
        made = {}  # id(module) -> serial of its declaration
        for _ in range(14):
            r = rng.random()
            if r < 0.2:  # the user writes a flag (seen, or not, at the next application)
                p = rng.choice(paths)
                params[p].requires_grad_(rng.random() < 0.5)
                continue
            for p in paths:  # what the next application sees
                if params[p].requires_grad is not written[p]:
                    start[p] = params[p].requires_grad
                    over[p] = serial
            if r < 0.3:  # a declaration changes (or is removed)
                target, names = rng.choice([(m[0], ["weight", "bias"]), (m[1], ["0", "1"]),
                                            (m, ["0", "1", "2"])])
                pick = [n for n in names if rng.random() < 0.5]
                serial += 1
                made[id(target)] = serial
                ts.mark_trainable(target, *(pick if rng.random() < 0.7 else [None]))
            elif r < 0.6 or not active:
                kind = rng.choice(["freeze", "freeze_except", "unfreeze"])
                sel = rng.choice(selectors)
                chosen = {p for p, _ in ts.select(m, sel)}
                serial += 1
                active.append((kind, chosen, getattr(ts, kind)(m, sel), serial))
            else:
                kind, chosen, ctx, _ = active.pop(rng.randrange(len(active)))
                ctx.__exit__(None, None, None)
            want = dict(start)
            for kind, chosen, _, since in active:
                for p in paths:
                    if over[p] >= since:
                        continue
                    if kind == "freeze" and p in chosen:
                        want[p] = False
                    elif kind == "freeze_except" and p not in chosen:
                        want[p] = False
                    elif kind == "unfreeze" and p in chosen:
                        want[p] = True
            for p in paths:  # every declaration along the path made after a write admits it
                mod = m
                for name in p.split("."):
                    names = _declared(mod)
                    if names is not None and name not in names and made[id(mod)] > over[p]:
                        want[p] = False
                    mod = getattr(mod, name, None) if isinstance(mod, nn.Module) else None
            assert {p: params[p].requires_grad for p in paths} == want
            assert consistent(m)
            written = want
        for p in paths:
            if params[p].requires_grad is not written[p]:
                start[p] = params[p].requires_grad
        for _, _, ctx, _ in reversed(active):
            ctx.__exit__(None, None, None)
        for target in (m, m[0], m[1]):
            ts.mark_trainable(target, None)
        assert {p: params[p].requires_grad for p in paths} == start
        assert consistent(m)


def test_random_contexts_on_two_models_sharing_a_submodule_match_a_brute_force_fold():
    import random

    rng = random.Random(1)
    for _ in range(60):
        s = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        a = nn.Sequential(s, nn.Linear(2, 2))
        b = nn.Sequential(nn.Linear(2, 2), s)
        for model in (a, b):
            if rng.random() < 0.5:
                ts.attach(model)
        every = {id(p): p for p in list(a.parameters()) + list(b.parameters())}
        active = []
        for _ in range(10):
            if rng.random() < 0.6 or not active:
                model = rng.choice([a, b, s])
                kind = rng.choice(["freeze", "freeze_except", "unfreeze"])
                sel = rng.choice(["0", "1", "*bias", "1.*"])
                try:
                    chosen = {id(p) for _, p in ts.select(model, sel)}
                except ValueError:  # a typo-like selector: nothing entered
                    continue
                active.append((kind, model, chosen, getattr(ts, kind)(model, sel)))
            else:
                *_, ctx = active.pop(rng.randrange(len(active)))
                ctx.__exit__(None, None, None)
            want = {i: True for i in every}
            for kind, model, chosen, _ in active:
                for p in model.parameters():
                    if kind == "freeze" and id(p) in chosen:
                        want[id(p)] = False
                    elif kind == "freeze_except" and id(p) not in chosen:
                        want[id(p)] = False
                    elif kind == "unfreeze" and id(p) in chosen:
                        want[id(p)] = True
            assert {i: p.requires_grad for i, p in every.items()} == want
            assert consistent(a) and consistent(b) and consistent(s)
        for *_, ctx in reversed(active):
            ctx.__exit__(None, None, None)
        assert all(p.requires_grad for p in every.values())


# -------------------------------------------------------------------------------- scripted modules
def test_a_context_on_a_scripted_module_behaves_the_same_every_time():
    sm = torch.jit.script(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)))

    def attempt():
        try:
            with ts.freeze(sm, "0"):
                inside = flags(sm)
        except RuntimeError as e:
            return ("error", str(e))
        return ("ok", inside, flags(sm))

    assert attempt() == attempt()


# ------------------------------------------------------------------ the root dies, a part lives on
def test_a_kept_submodule_of_a_dropped_model_behaves_as_plain_pytorch():
    model = nn.Sequential(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)), nn.Linear(3, 1))
    ts.freeze(model, "0")
    backbone = model[0]
    del model
    gc.collect()
    before = backbone[1].running_mean.clone()
    backbone(x3())
    assert not torch.equal(before, backbone[1].running_mean)
    assert all(flags(backbone)) and consistent(backbone)


# ---------------------------------------------------------------------- parameter objects replaced
def test_a_parameter_selector_follows_a_parameter_replaced_by_load_state_dict_assign():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    state = {k: v.clone() for k, v in m.state_dict().items()}
    with ts.freeze(m, m[0].weight):
        m.load_state_dict(state, assign=True)
        m(x3())
        assert flags(m) == [False, True, True, True]
    assert all(flags(m))


@pytest.mark.parametrize("sel", ["0.weight", "module"])
def test_path_and_module_selectors_follow_parameters_replaced_by_load_state_dict_assign(sel):
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    state = {k: v.clone() for k, v in m.state_dict().items()}
    with ts.freeze(m, m[0] if sel == "module" else sel):
        m.load_state_dict(state, assign=True)
        m(x3())
        want = [False, False, True, True] if sel == "module" else [False, True, True, True]
        assert flags(m) == want and consistent(m)
    assert all(flags(m)) and consistent(m)


def test_attach_after_detaching_a_child_puts_the_norm_hooks_back():
    parent = nn.Sequential(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)), nn.Linear(3, 1))
    with ts.freeze(parent, "0"):
        ts.detach_hooks(parent[0])
        ts.attach(parent)
        bn = parent[0][1]
        before = bn.running_mean.clone()
        parent(x3())
        assert torch.equal(before, bn.running_mean)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(2, 2)
        self.mlp = nn.Linear(2, 2)

    def trainable(self):
        return ["mlp", "attn"]


def test_an_invalid_declaration_at_exit_still_restores_the_blocks_flags():
    m = nn.Sequential(nn.Linear(2, 2), _Block())
    with pytest.raises(ValueError, match="mlp"):
        with ts.freeze(m, "0"):
            del m[1].mlp
    assert m[0].weight.requires_grad and m[0].bias.requires_grad
