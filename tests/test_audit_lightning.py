"""Audit: torchstruct inside PyTorch Lightning training, used the way a Lightning user would.

What is audited (black box, from README.md, docs/*.md and ../shared/DESIGN.md):

- Lightning's own fine-tuning callbacks (`BaseFinetuning`, `BackboneFinetuning`) next to ts
  declarations (`trainable()`, `ts.mark_trainable`), contexts, `ts.param_groups` and ts.optim,
  including a resume through `Trainer.fit(ckpt_path=...)`;
- `LightningModule.freeze()` / `unfreeze()` / `toggle_optimizer()` (flag writes by someone else)
  against ts contexts, declarations and `ts.UnfreezeSchedule`;
- `Trainer(gradient_clip_val=..., gradient_clip_algorithm=...)`, `accumulate_grad_batches`,
  `precision="bf16-mixed"` / `"bf16-true"` / a CPU fp16 `GradScaler`, manual optimization with
  `self.clip_gradients` and `ts.structural_grad`, a `ts.freeze`-decorated `training_step`;
- checkpointing: `ModelCheckpoint` + `Trainer.fit(ckpt_path=...)` resuming `lr_scale` groups, an
  epoch-interval LR scheduler and a `ts.UnfreezeSchedule` saved by the module's own
  `on_save_checkpoint` / `on_load_checkpoint` (full and trainable-only checkpoints);
- `Trainer.validate` / `test` / `predict` and the validation loop inside `fit` while contexts are
  active (flags unchanged, BatchNorm statistics held under `freeze_norm_stats`), an EMA
  evaluated through `ts.swap` in the validation hooks;
- Lightning's `ModelSummary` and `LearningRateMonitor` against `ts.summary` / group names;
- `Tuner.lr_find`, `StochasticWeightAveraging`, `load_from_checkpoint`, `ts.constant` around
  `fit` (Lightning steps with a closure), and two CPU ranks with `ddp_spawn` (a schedule built
  after the wrap with find_unused_parameters, and the documented refusal before it).

Oracles: the same training written with plain `requires_grad` flags and `torch.optim` inside
Lightning, or by hand outside Lightning, compared bitwise (SGD: "bitwise on CPU") or to the
documented 1e-6 relative tolerance (AdamW, folded clip); frozen parameters bitwise unchanged;
`ts.is_trainable` agreeing with the flags at every batch; documented errors and warnings.
"""
import copy
import logging
import warnings

import pytest
import torch
from torch import nn

import torchstruct as ts

L = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.callbacks import (  # noqa: E402
    BackboneFinetuning,
    BaseFinetuning,
    LearningRateMonitor,
    ModelCheckpoint,
)

logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
logging.getLogger("lightning.fabric").setLevel(logging.ERROR)

RTOL, ATOL = 1e-6, 1e-7


# --------------------------------------------------------------------------- helpers

def loader(n=16, batch_size=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    data = torch.utils.data.TensorDataset(torch.randn(n, 4, generator=g),
                                          torch.randn(n, 2, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=batch_size)


def make_backbone(bn=False):
    layers = [nn.Linear(4, 8)] + ([nn.BatchNorm1d(8)] if bn else []) + [
        nn.Tanh(), nn.Linear(8, 8), nn.Tanh()]
    return nn.Sequential(*layers)


def sgd(m, **kw):
    return ts.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01, **kw)


def torch_sgd(m):
    return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01,
                           foreach=False)


class Net(L.LightningModule):
    """backbone -> head; the optimizer comes from `make_opt(self)`."""

    def __init__(self, make_opt=sgd, bn=False, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.backbone = make_backbone(bn)
        self.head = nn.Linear(8, 2)
        self.make_opt = make_opt

    def forward(self, x):
        return self.head(self.backbone(x))

    def training_step(self, batch, _idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return self.make_opt(self)


class DeclaredNet(Net):
    """The class declares that only the head trains."""

    def trainable(self):
        return ["head"]


def fit(module, data=None, ckpt_path=None, val=None, **kw):
    opts = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, max_epochs=1)
    opts.update(kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = L.Trainer(**opts)
        trainer.fit(module, data if data is not None else loader(), val, ckpt_path=ckpt_path)
    return trainer


def snap(m):
    return {n: t.detach().clone() for n, t in m.state_dict().items()}


def flags(m):
    return [p.requires_grad for p in m.parameters()]


def reads(m):
    return [ts.is_trainable(m, n) for n, _ in m.named_parameters()]


def assert_same(a, b, exact=True):
    sa, sb = snap(a), snap(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        if exact:
            assert torch.equal(sa[k], sb[k]), k
        else:
            torch.testing.assert_close(sa[k], sb[k], rtol=RTOL, atol=ATOL, msg=k)


class Recorder(L.Callback):
    """Flags and ts's reads of them at every training batch."""

    def __init__(self):
        self.seen = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append((trainer.current_epoch, flags(pl_module), reads(pl_module)))


# --------------------------------------------------------------------------- BaseFinetuning

class FreezeBackbone(BaseFinetuning):
    def __init__(self, at=1, lr=None, train_bn=True):
        super().__init__()
        self.at, self.lr, self.train_bn = at, lr, train_bn

    def freeze_before_training(self, pl_module):
        self.freeze(pl_module.backbone, train_bn=self.train_bn)

    def finetune_function(self, pl_module, epoch, optimizer):
        if epoch == self.at:
            self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, lr=self.lr,
                                              train_bn=self.train_bn)


def with_ts(how):
    """A Net whose backbone ts already keeps frozen, in one of the documented ways."""
    if how == "trainable()":
        net = DeclaredNet()
        ts.attach(net)
    else:
        net = Net()
        if how == "mark_trainable":
            ts.mark_trainable(net, "head")
        elif how == "freeze_except":
            ts.freeze_except(net, "head")  # a bare call: permanent
        elif how == "freeze":
            ts.freeze(net, "backbone")
    return net


@pytest.mark.parametrize("how", ["trainable()", "mark_trainable", "freeze_except", "freeze"])
def test_basefinetuning_unfreeze_wins_over_ts_and_matches_a_plain_twin(how):
    """BaseFinetuning freezes the backbone (a write of the value ts already wrote: unseen) and
    unfreezes it at epoch 1 (a write by someone else: "it stands ... wins over the contexts
    active and the declarations made when it was written"). The run equals the same callback on
    a plain module with torch.optim.SGD, bitwise, and ts's reads follow the flags at every
    batch."""
    ours, twin = with_ts(how), Net(make_opt=torch_sgd)
    assert flags(ours) == [False] * 4 + [True, True]
    rec, twin_rec = Recorder(), Recorder()
    fit(ours, callbacks=[FreezeBackbone(), rec], max_epochs=3)
    fit(twin, callbacks=[FreezeBackbone(), twin_rec], max_epochs=3)
    assert [f for _, f, _ in rec.seen] == [f for _, f, _ in twin_rec.seen]
    for epoch, f, r in rec.seen:
        assert f == r, (epoch, f, r)
        assert f == ([False] * 4 + [True, True] if epoch == 0 else [True] * 6)
    assert_same(ours, twin)
    assert reads(ours) == flags(ours) == [True] * 6
    ours(torch.randn(2, 4))  # a forward changes nothing: the write stands
    assert reads(ours) == flags(ours) == [True] * 6


def test_basefinetuning_train_bn_keeps_batchnorm_training_under_a_ts_freeze():
    """train_bn=True: BaseFinetuning makes the BatchNorm parameters trainable inside the
    backbone that ts froze. A layer with a parameter requiring grad at the forward is not held
    (docs/freezing.md), so its statistics and affine parameters train as in the plain twin."""
    ours = Net(bn=True)
    ts.freeze(ours, "backbone")
    twin = Net(bn=True, make_opt=torch_sgd)
    start = snap(ours)
    fit(ours, callbacks=[FreezeBackbone(at=5)], max_epochs=2)
    fit(twin, callbacks=[FreezeBackbone(at=5)], max_epochs=2)
    assert_same(ours, twin)
    now = snap(ours)
    assert not torch.equal(now["backbone.1.running_mean"], start["backbone.1.running_mean"])
    assert not torch.equal(now["backbone.1.weight"], start["backbone.1.weight"])
    assert torch.equal(now["backbone.0.weight"], start["backbone.0.weight"])
    assert reads(ours) == flags(ours)


def test_basefinetuning_with_ts_param_groups_adds_no_group_and_ignores_its_lr_trap():
    """ts.param_groups puts the frozen backbone in the optimizer from the start (DESIGN §6), so
    BaseFinetuning's unfreeze_and_add_param_group finds it there: Lightning warns, adds no
    group, and the lr it was given is not used: the backbone trains at its group's lr. Checked
    against a hand loop with the same flags and one lr."""
    net = Net(make_opt=lambda m: ts.optim.SGD(ts.param_groups(m), lr=0.1, momentum=0.9))
    start = copy.deepcopy(Net())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, max_epochs=2,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[FreezeBackbone(lr=1e-4)])
        trainer.fit(net, loader())
    assert any("already exist within another group" in str(w.message) for w in caught)
    opt = trainer.optimizers[0]
    assert [g["name"] for g in opt.param_groups] == ["default", "default (no decay)"]
    # the oracle: epoch 0 head only, epoch 1 everything, all at lr 0.1
    twin = start
    theirs = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9, foreach=False)
    for epoch in range(2):
        for p in twin.backbone.parameters():
            p.requires_grad_(epoch == 1)
        for x, y in loader():
            theirs.zero_grad()
            nn.functional.mse_loss(twin(x), y).backward()
            theirs.step()
    assert_same(net, twin)


def test_basefinetuning_into_a_named_ts_param_groups_optimizer_is_torchs_documented_error():
    """An optimizer over the head only, built by ts.param_groups (groups with param_names):
    BaseFinetuning adds a group without names, which torch refuses (docs/groups.md: "torch's
    add_param_group wants all groups of an optimizer with names or all without")."""
    net = Net(make_opt=lambda m: ts.optim.SGD(ts.param_groups(m.head), lr=0.1))
    with pytest.raises(ValueError, match="names"):
        fit(net, callbacks=[FreezeBackbone()], max_epochs=2)


def test_backbone_finetuning_with_ts_param_groups_rewrites_the_last_groups_lr_trap():
    """BackboneFinetuning assumes the backbone's group is the optimizer's last one. With
    ts.param_groups no group is added, so from the epoch after the unfreeze it rewrites the lr
    of the last existing group ("default (no decay)": the head's bias too)."""
    net = Net(make_opt=lambda m: ts.optim.SGD(ts.param_groups(m, weight_decay=0.01), lr=0.1))
    cb = BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_lr=0.01,
                            should_align=False)
    trainer = fit(net, callbacks=[cb], max_epochs=3)
    groups = trainer.optimizers[0].param_groups
    assert [g["name"] for g in groups] == ["default", "default (no decay)"]
    assert groups[0]["lr"] == 0.1
    assert groups[1]["lr"] == pytest.approx(0.02)  # 2 * 0.01, meant for the backbone
    assert "head.bias" in groups[1]["param_names"]
    assert all(flags(net)) and reads(net) == flags(net)


ROWS = torch.zeros(2, 8, dtype=torch.bool)
ROWS[1] = True


def test_backbone_finetuning_resume_before_the_unfreeze_restores_groups_and_masks(tmp_path):
    """Lightning's documented pattern (optimizer over the parameters that require grad,
    BackboneFinetuning adding the backbone's group) with ts.optim.SGD and an element mask on the
    head: a run checkpointed after epoch 0 and resumed with ckpt_path (BaseFinetuning replaces
    the optimizer's param_groups in on_fit_start, then the optimizer state loads) equals the
    straight run bitwise, and the mask comes back without masks=."""
    def make(masks):
        return lambda m: ts.optim.SGD(filter(lambda p: p.requires_grad, m.parameters()), lr=0.1,
                                      momentum=0.9, masks={m.head.weight: ROWS} if masks else None)

    def callback():
        return BackboneFinetuning(unfreeze_backbone_at_epoch=2, backbone_initial_lr=0.01)

    straight = Net(make_opt=make(True))
    fit(straight, callbacks=[callback()], max_epochs=4)
    first = Net(make_opt=make(True))
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    fit(first, callbacks=[callback(), ckpt], max_epochs=1, enable_checkpointing=True,
        default_root_dir=tmp_path)
    again = Net(make_opt=make(False))
    trainer = fit(again, callbacks=[callback()], max_epochs=4,
                  ckpt_path=tmp_path / "last.ckpt")
    opt = trainer.optimizers[0]
    assert [len(g["params"]) for g in opt.param_groups] == [2, 4]
    assert torch.equal(opt.masks[again.head.weight], ROWS)
    assert_same(straight, again)
    assert torch.equal(again.head.weight[0], Net().head.weight[0])  # masked row never moved


# --------------------------------------------------------------------------- LightningModule.freeze

def test_lightning_freeze_unfreeze_over_a_permanent_ts_freeze():
    """`model.freeze()` then `model.unfreeze()`: Lightning writes True on every parameter. The
    write to the backbone ts froze is someone else's: it stands, also when the bare context is
    lifted later, and ts's reads agree with the flags at once and after a forward."""
    net = Net()
    ctx = ts.freeze(net, "backbone")
    net.freeze()
    assert not net.training and flags(net) == reads(net) == [False] * 6
    net.unfreeze()
    assert net.training and flags(net) == reads(net) == [True] * 6
    net(torch.randn(2, 4))
    assert flags(net) == reads(net) == [True] * 6
    ctx.__exit__(None, None, None)
    assert flags(net) == reads(net) == [True] * 6
    with ts.freeze(net, "head"):                        # contexts entered later apply on top
        assert flags(net) == reads(net) == [True] * 4 + [False] * 2
    assert flags(net) == reads(net) == [True] * 6


def test_lightning_freeze_inside_a_ts_block_documented_unseen_write():
    """docs/freezing.md, "The one write that cannot be seen": `model.freeze()` inside
    `ts.freeze_except(model, "head")` writes False on the backbone, the value the block wrote:
    undone at exit. Its write on the head (True -> False) is seen and stands."""
    net = Net()
    with ts.freeze_except(net, "head"):
        net.freeze()
        assert flags(net) == reads(net) == [False] * 6
    assert flags(net) == reads(net) == [True] * 4 + [False] * 2
    net.unfreeze()
    assert flags(net) == reads(net) == [True] * 6


def test_lightning_unfreeze_overrides_a_trainable_declaration_and_later_declarations_apply():
    """A class's `trainable()` counts as made before anything else: `model.unfreeze()` wins over
    it (flags and reads), the hooks do not turn it back at the next forward, and a
    `ts.mark_trainable` made afterwards applies on top."""
    net = ts.attach(DeclaredNet())
    assert flags(net) == reads(net) == [False] * 4 + [True] * 2
    net.unfreeze()
    net(torch.randn(2, 4))
    assert flags(net) == reads(net) == [True] * 6
    ts.mark_trainable(net.backbone, "2")
    assert flags(net) == reads(net) == [False, False, True, True, True, True]
    ts.mark_trainable(net.backbone, None)
    assert flags(net) == reads(net) == [True] * 6


def test_lightning_unfreeze_during_an_unfreeze_schedule_survives_stage_changes():
    """A schedule's stage change "continues the stage it replaces": a `model.unfreeze()` made at
    stage 0 still stands after the next milestones, reads included."""
    net = Net()
    schedule = ts.UnfreezeSchedule(net, {0: "head", 2: "backbone.2", 4: None})
    assert flags(net) == [False] * 4 + [True] * 2
    net.unfreeze()
    for step in range(5):
        schedule.step()
        net(torch.randn(2, 4))
        assert flags(net) == reads(net) == [True] * 6, step
    assert schedule.stage == 3
    schedule.close()
    assert flags(net) == reads(net) == [True] * 6


def test_lightning_freeze_with_held_batchnorm_then_unfreeze_trains_statistics_again():
    """`model.freeze()` is eval mode too; `unfreeze()` goes back to train mode. A BatchNorm ts
    held (frozen by ts) keeps its statistics; once Lightning's write made it trainable again it
    is not held: its statistics update as in plain PyTorch."""
    net = Net(bn=True)
    ts.freeze(net, "backbone")
    bn = net.backbone[1]
    before = bn.running_mean.clone()
    net(torch.randn(8, 4))
    assert torch.equal(bn.running_mean, before) and bn.training
    net.freeze()
    net(torch.randn(8, 4))
    assert torch.equal(bn.running_mean, before) and not bn.training
    net.unfreeze()
    net(torch.randn(8, 4))
    assert bn.training and not torch.equal(bn.running_mean, before)


# --------------------------------------------------------------------------- clipping, accumulation

@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_lightning_clipping_and_accumulation_with_ts_sgd_match_torch_sgd_bitwise(algorithm):
    """Trainer(gradient_clip_val, gradient_clip_algorithm, accumulate_grad_batches=2) with
    ts.optim.SGD on a model ts froze in part equals the same Trainer on a plain twin (flags by
    hand, torch.optim.SGD foreach=False): SGD is "bitwise on CPU". The frozen layer keeps its
    bits and gets no state."""
    ours = Net()
    ts.freeze(ours, "backbone.0")
    twin = Net(make_opt=torch_sgd)
    for p in twin.backbone[0].parameters():
        p.requires_grad_(False)
    start = snap(ours)
    opts = dict(max_epochs=2, gradient_clip_val=0.05, gradient_clip_algorithm=algorithm,
                accumulate_grad_batches=2)
    trainer = fit(ours, **opts)
    fit(twin, **opts)
    assert trainer.global_step == 4
    assert_same(ours, twin)
    assert torch.equal(ours.backbone[0].weight, start["backbone.0.weight"])
    assert ours.backbone[0].weight not in trainer.optimizers[0].state
    assert flags(ours) == reads(ours) == flags(twin)


def test_lightning_norm_clip_and_folded_clip_together_equal_two_clips_by_hand():
    """gradient_clip_val=0.5 (Lightning clips the gradients) and max_grad_norm=0.02 (ts folds a
    second clip into the update) give clip_grad_norm_(0.5) then clip_grad_norm_(0.02) then the
    step (DESIGN §4 (c): the result of clip_grad_norm_ followed by the step)."""
    ours = Net(make_opt=lambda m: sgd(m, max_grad_norm=0.02))
    ts.freeze_except(ours, "head", "backbone.2")
    twin = Net()
    theirs = torch_sgd(twin)
    for p in twin.backbone[0].parameters():
        p.requires_grad_(False)
    trainer = fit(ours, gradient_clip_val=0.5, max_epochs=2)
    for _ in range(2):
        for x, y in loader():
            theirs.zero_grad()
            nn.functional.mse_loss(twin(x), y).backward()
            live = [p for p in twin.parameters() if p.requires_grad]
            torch.nn.utils.clip_grad_norm_(live, 0.5)
            last = torch.nn.utils.clip_grad_norm_(live, 0.02)
            theirs.step()
    assert_same(ours, twin, exact=False)
    torch.testing.assert_close(trainer.optimizers[0].last_grad_norm, last, rtol=1e-5, atol=0)
    assert torch.equal(ours.backbone[0].weight, Net().backbone[0].weight)


def test_lightning_clip_with_element_mask_equals_the_folded_clip():
    """docs/optimizers.md: with masks, the folded clip's norm is that of the full gradients of
    the stepped parameters (masked-out elements included), exactly clip_grad_norm_. Lightning's
    gradient_clip_val + a masked ts.optim.AdamW equals max_grad_norm= on the same optimizer."""
    def make(folded):
        return lambda m: ts.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1,
                                        masks={m.head.weight: ROWS},
                                        max_grad_norm=0.05 if folded else None)
    a, b = Net(make_opt=make(False)), Net(make_opt=make(True))
    fit(a, gradient_clip_val=0.05, max_epochs=2)
    fit(b, max_epochs=2)
    assert_same(a, b, exact=False)
    assert torch.equal(a.head.weight[0], Net().head.weight[0])


# --------------------------------------------------------------------------- precision

def test_bf16_mixed_with_ts_freeze_and_folded_clip_matches_torch_adamw_with_lightning_clip():
    ours = Net(make_opt=lambda m: ts.optim.AdamW(m.parameters(), lr=0.01, max_grad_norm=0.1))
    ts.freeze_except(ours, "head", "backbone.2")
    twin = Net(make_opt=lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, foreach=False))
    for p in twin.backbone[0].parameters():
        p.requires_grad_(False)
    fit(ours, precision="bf16-mixed", max_epochs=2)
    fit(twin, precision="bf16-mixed", gradient_clip_val=0.1, max_epochs=2)
    assert_same(ours, twin, exact=False)
    assert torch.equal(ours.backbone[0].weight, Net().backbone[0].weight)
    assert ours.head.weight.dtype == torch.float32


class RoundOnceSGD(torch.optim.Optimizer):
    """The oracle of docs/optimizers.md for low-precision parameters: SGD with momentum and
    weight decay computed in float32, rounded once to the parameter's dtype."""

    def __init__(self, params, lr=0.1, momentum=0.9, weight_decay=0.01):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            with torch.enable_grad():
                closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                d = p.grad.float() + group["weight_decay"] * p.float()
                state = self.state[p]
                if "momentum_buffer" in state:
                    d = group["momentum"] * state["momentum_buffer"].float() + d
                state["momentum_buffer"] = d.to(p.dtype)
                p.copy_((p.float() - group["lr"] * d).to(p.dtype))


@pytest.mark.parametrize("precision", ["bf16-true", "64-true"])
def test_true_precision_converts_a_frozen_model_and_keeps_flags_and_context(precision):
    """Lightning converts the module (`module.to(dtype)`) inside `fit`, after a permanent
    ts.freeze_except: the flags and ts's decisions follow the parameter objects, the frozen
    layer keeps its (converted) bits, ts.optim.SGD matches torch.optim.SGD, and lifting the
    context afterwards restores every flag."""
    dtype = {"bf16-true": torch.bfloat16, "64-true": torch.float64}[precision]
    ours = Net()
    ctx = ts.freeze_except(ours, "head")
    # docs/optimizers.md: a bf16 step is computed in float32 from the stored values and rounded
    # once (state kept in the parameter's dtype); float64 is torch's foreach=False step
    rounded = precision == "bf16-true"
    twin = Net(make_opt=lambda m: RoundOnceSGD(m.parameters()) if rounded else torch_sgd(m))
    for p in twin.backbone.parameters():
        p.requires_grad_(False)
    fit(ours, precision=precision, max_epochs=2)
    fit(twin, precision=precision, max_epochs=2)
    assert ours.head.weight.dtype == dtype
    assert flags(ours) == reads(ours) == [False] * 4 + [True] * 2
    assert torch.equal(ours.backbone[0].weight, Net().backbone[0].weight.to(dtype))
    assert not torch.equal(ours.head.weight, Net().head.weight.to(dtype))
    assert_same(ours, twin)
    ctx.__exit__(None, None, None)
    assert flags(ours) == reads(ours) == [True] * 6


def fp16_plugin():
    from lightning.pytorch.plugins.precision import MixedPrecision
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** 16))


def overflow_loader():
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g)
    x[8:12] *= 1e5                                     # fp16 overflow in the third batch
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


def test_fp16_gradscaler_plugin_on_cpu_with_ts_adamw_matches_torch_adamw():
    """Lightning's MixedPrecision plugin with a GradScaler: ts.optim says it unscales inside the
    step (`_step_supports_amp_scaling`), so Lightning does not call unscale_; the folded clip
    takes the unscaled norm; an overflowed batch is skipped. Oracle: torch.optim.AdamW with
    Lightning's own unscale_ + gradient_clip_val under the same plugin."""
    ours = Net(make_opt=lambda m: ts.optim.AdamW(m.parameters(), lr=0.01, max_grad_norm=0.5))
    ts.freeze(ours, "backbone.0")
    twin = Net(make_opt=lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, foreach=False))
    for p in twin.backbone[0].parameters():
        p.requires_grad_(False)
    a = fit(ours, overflow_loader(), plugins=[fp16_plugin()], max_epochs=2)
    b = fit(twin, overflow_loader(), plugins=[fp16_plugin()], gradient_clip_val=0.5,
            max_epochs=2)
    assert a.precision_plugin.scaler.get_scale() == b.precision_plugin.scaler.get_scale() < 2 ** 16
    opt = a.optimizers[0]
    assert float(opt.state[ours.head.weight]["step"]) == 6     # 8 batches, 2 overflowed
    assert_same(ours, twin, exact=False)
    assert torch.equal(ours.backbone[0].weight, Net().backbone[0].weight)


def test_fp16_gradscaler_plugin_refuses_gradient_clip_val_with_ts_optim():
    """A trap (Lightning's rule, not stated in torchstruct's docs): ts.optim unscales inside
    its step, so Lightning refuses gradient_clip_val under a GradScaler (its error hints at
    'fused' optimizers); max_grad_norm= is the way to clip there."""
    net = Net(make_opt=lambda m: ts.optim.AdamW(m.parameters(), lr=0.01))
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        fit(net, plugins=[fp16_plugin()], gradient_clip_val=0.5)


# --------------------------------------------------------------------------- manual optimization

class Manual(Net):
    def __init__(self, how, **kw):
        super().__init__(**kw)
        self.how = how
        self.automatic_optimization = False

    def training_step(self, batch, _idx):
        opt = self.optimizers()
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        if self.how == "backward":
            self.manual_backward(loss)
        else:
            grads = ts.tree.to_flat_dict(ts.structural_grad(self, loss))
            params = dict(self.named_parameters())
            for path, g in grads.items():
                params[path].grad = g
            assert set(grads) == {p for p, _ in ts.trainable_parameters(self)}
        if self.how == "structural + ts clip":
            ts.clip_by_global_norm(self, 0.05)
        else:
            self.clip_gradients(opt, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("how", ["structural", "structural + ts clip"])
def test_manual_optimization_with_structural_grad_matches_manual_backward(how):
    """automatic_optimization=False: gradients from ts.structural_grad (trainable parameters
    only, no .grad side effects) put in .grad, clipped with self.clip_gradients (or
    ts.clip_by_global_norm on the model, a drop-in), then opt.step(): equal to the
    manual_backward run (bitwise with Lightning's clip)."""
    runs = []
    for mode in ("backward", how):
        net = Manual(mode)
        ts.freeze(net, "backbone.0")
        trainer = fit(net, max_epochs=2)
        assert trainer.global_step == 8
        runs.append(net)
    assert_same(*runs, exact=how == "structural")
    assert torch.equal(runs[1].backbone[0].weight, Net().backbone[0].weight)
    assert runs[1].backbone[0].weight.grad is None


# --------------------------------------------------------------------------- decorated training_step

class Decorated(Net):
    def __init__(self, context, *selectors, **kw):
        super().__init__(**kw)
        inner = self.training_step
        self.training_step = context(self, *selectors)(inner)   # per call, not at decoration


def test_freeze_decorated_training_step_backward_after_the_block_matches_frozen_twin():
    """docs/freezing.md: "a loss computed inside a block and backpropagated after it (a
    decorated training step, as Lightning's automatic optimization runs it) gives the gradients
    of the block's flags". Lightning's backward runs after training_step returned: the backbone
    gets no gradient and keeps its bits; the flags are back after every step."""
    ours = Decorated(ts.freeze, "backbone")
    assert all(flags(ours))
    twin = Net(make_opt=torch_sgd)
    for p in twin.backbone.parameters():
        p.requires_grad_(False)
    rec = Recorder()
    fit(ours, callbacks=[rec], max_epochs=2)
    fit(twin, max_epochs=2)
    assert all(f == [True] * 6 for _, f, _ in rec.seen)
    assert_same(ours, twin)
    assert torch.equal(ours.backbone[0].weight, Net().backbone[0].weight)


def test_unfreeze_decorated_training_step_trains_nothing_documented():
    """The documented limit: a parameter the block turned on is off again when Lightning runs
    the backward after training_step, so it gets no .grad and does not train."""
    ours = Decorated(ts.unfreeze, "backbone")
    ts.freeze(ours, "backbone")
    fit(ours, max_epochs=1)
    assert torch.equal(ours.backbone[0].weight, Net().backbone[0].weight)
    assert ours.backbone[0].weight.grad is None
    assert not torch.equal(ours.head.weight, Net().head.weight)


# --------------------------------------------------------------------------- two optimizers, toggle

class GAN(L.LightningModule):
    """Manual optimization with Lightning's toggle_optimizer / untoggle_optimizer (flag writes by
    Lightning) around each optimizer's step."""

    def __init__(self, use_ts, g_block="toggle"):
        super().__init__()
        torch.manual_seed(0)
        self.gen = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 4))
        self.disc = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.use_ts, self.g_block = use_ts, g_block
        self.automatic_optimization = False
        self.seen = []
        if use_ts:
            ts.mark_trainable(self.gen, "2")             # the generator's first layer is frozen
        else:
            for p in self.gen[0].parameters():
                p.requires_grad_(False)

    def training_step(self, batch, _idx):
        opt_g, opt_d = self.optimizers()
        real, z = batch[0], batch[1][:, :3]
        self.toggle_optimizer(opt_d)
        fake = self.gen(z).detach()
        loss_d = (nn.functional.softplus(-self.disc(real)).mean()
                  + nn.functional.softplus(self.disc(fake)).mean())
        self.manual_backward(loss_d)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        if self.g_block == "toggle":
            self.toggle_optimizer(opt_g)
            loss_g = nn.functional.softplus(-self.disc(self.gen(z))).mean()
            self.manual_backward(loss_g)
            opt_g.step()
            opt_g.zero_grad()
            self.untoggle_optimizer(opt_g)
        else:                                            # the same step with a ts block
            with ts.freeze(self, "disc"):
                loss_g = nn.functional.softplus(-self.disc(self.gen(z))).mean()
                self.manual_backward(loss_g)
                opt_g.step()
                opt_g.zero_grad()
        self.seen.append((flags(self), reads(self) if self.use_ts else flags(self)))

    def configure_optimizers(self):
        make = ((lambda ps: ts.optim.SGD(ps, lr=0.05, momentum=0.5, weight_decay=0.01))
                if self.use_ts else
                (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.5, weight_decay=0.01,
                                            foreach=False)))
        return make(self.gen.parameters()), make(self.disc.parameters())


def gan_loader():
    g = torch.Generator().manual_seed(5)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4, generator=g) + 1,
                                          torch.randn(16, 4, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=4)


@pytest.mark.parametrize("g_block", ["toggle", "ts.freeze"])
def test_toggle_optimizer_gan_with_a_declaration_matches_plain_twin(g_block):
    """Lightning's toggle_optimizer writes False on the other optimizer's parameters and
    untoggle_optimizer writes back what it recorded, around a ts declaration that froze the
    generator's first layer (and, in one variant, a ts.freeze block in place of the second
    toggle). Equal to the plain twin bitwise; flags, reads and the twin's flags agree after
    every step; the declared-frozen layer keeps its bits."""
    ours, twin = GAN(True, g_block), GAN(False)
    fit(ours, gan_loader(), max_epochs=2)
    fit(twin, gan_loader(), max_epochs=2)
    assert len(ours.seen) == 8
    for (f, r), (tf, _) in zip(ours.seen, twin.seen):
        assert f == r == tf
    assert_same(ours, twin)
    assert torch.equal(ours.gen[0].weight, GAN(False).gen[0].weight)
    assert flags(ours) == [False, False] + [True] * 6


# --------------------------------------------------------------------------- validate / test / predict

class Evaluated(Net):
    def validation_step(self, batch, _idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def test_step(self, batch, _idx):
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self(x), y))

    def predict_step(self, batch, _idx):
        return self(batch[0])


def evaluate(net, what, **kw):
    opts = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                enable_model_summary=False, enable_checkpointing=False)
    opts.update(kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = L.Trainer(**opts)
        return getattr(trainer, what)(net, loader())


def test_validate_test_predict_inside_contexts_change_no_flag_and_no_statistic():
    """Trainer.validate / test / predict (inference mode, eval) while a permanent
    ts.freeze_except holds the backbone's BatchNorm: flags and reads unchanged, statistics
    unchanged, predictions equal those of the plain model in eval mode."""
    net = Evaluated(bn=True)
    twin = Evaluated(bn=True)
    ts.freeze_except(net, "head")
    stats = snap(net)
    before = flags(net)
    for what in ("validate", "test", "predict"):
        out = evaluate(net, what)
        assert flags(net) == reads(net) == before, what
        assert all(torch.equal(v, stats[k]) for k, v in snap(net).items()), what
        assert net.training and net.backbone[1].training, what
    twin.eval()
    with torch.no_grad():
        want = torch.cat([twin(x) for x, _ in loader()])
    assert torch.equal(torch.cat(out), want)


def test_fit_with_validation_holds_frozen_batchnorm_like_an_eval_mode_twin():
    """A validation loop inside fit (eval, inference mode, back to train): the BatchNorm frozen
    by ts stays held (statistics bitwise unchanged, normalizing with them, as a frozen
    eval-mode layer), its training flag is what Lightning left, and the run equals a plain twin
    whose frozen BatchNorm is put in eval mode at every batch."""
    class EvalBN(Evaluated):
        def on_train_batch_start(self, batch, idx):
            self.backbone[1].eval()

    ours = Evaluated(bn=True, make_opt=lambda m: ts.optim.SGD(m.parameters(), lr=0.1))
    ts.freeze(ours, "backbone.0", "backbone.1")
    twin = EvalBN(bn=True, make_opt=lambda m: torch.optim.SGD(m.parameters(), lr=0.1,
                                                                 foreach=False))
    for p in [*twin.backbone[0].parameters(), *twin.backbone[1].parameters()]:
        p.requires_grad_(False)
    stats = ours.backbone[1].running_mean.clone()
    opts = dict(max_epochs=2, val_check_interval=2, num_sanity_val_steps=1)
    fit(ours, val=loader(), **opts)
    fit(twin, val=loader(), **opts)
    assert torch.equal(ours.backbone[1].running_mean, stats)
    assert int(ours.backbone[1].num_batches_tracked) == 0
    assert ours.backbone[1].training
    assert_same(ours, twin)


def test_predict_applies_a_pending_tree_change_inside_inference_mode():
    """A head added after a permanent ts.freeze_except is frozen by the hook at the next
    forward of the root (docs/freezing.md). That forward is Trainer.predict's, under
    torch.inference_mode: the change applies there, and training afterwards leaves the new
    layer untouched."""
    net = Evaluated()
    ts.freeze_except(net, "head")
    net.extra = nn.Linear(2, 2)

    def forward(x):
        return net.extra(net.head(net.backbone(x)))
    net.forward = forward  # the root's hooks still run: Lightning calls net(...)
    evaluate(net, "predict")
    assert not net.extra.weight.requires_grad
    assert reads(net) == flags(net)
    extra = net.extra.weight.detach().clone()
    fit(net, max_epochs=1)
    assert torch.equal(net.extra.weight, extra)


class EMA(Evaluated):
    """Keeps a Polyak average of the trainable parameters; validation runs on it via ts.swap."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.ema = copy.deepcopy(nn.ModuleDict({"backbone": self.backbone, "head": self.head}))
        self.swapped = None
        self.val_losses = []

    def on_train_batch_end(self, outputs, batch, idx):
        ts.polyak_update(self.ema, nn.ModuleDict({"backbone": self.backbone, "head": self.head}),
                         tau=0.5)

    def on_validation_start(self):
        tree = ts.tree.from_module(self.ema)
        self.swapped = ts.swap(self, tree)
        self.swapped.__enter__()

    def validation_step(self, batch, _idx):
        x, y = batch
        self.val_losses.append(nn.functional.mse_loss(self(x), y))

    def on_validation_end(self):
        self.swapped.__exit__(None, None, None)


def test_ema_validation_through_swap_in_lightning_hooks():
    """An EMA evaluated by entering ts.swap in on_validation_start and leaving it in
    on_validation_end: validation losses are those of the EMA weights, the trained weights are
    back untouched after each validation, and training equals a run without the EMA."""
    net = EMA(make_opt=lambda m: ts.optim.SGD([*m.backbone.parameters(),
                                               *m.head.parameters()], lr=0.1))
    ts.freeze(net, "backbone.0")
    plain = Net(make_opt=lambda m: ts.optim.SGD(m.parameters(), lr=0.1))
    ts.freeze(plain, "backbone.0")
    fit(net, val=loader(), max_epochs=2, num_sanity_val_steps=0)
    fit(plain, max_epochs=2)
    for k in ("backbone.0.weight", "backbone.2.weight", "head.weight"):
        assert torch.equal(snap(net)[k], snap(plain)[k]), k
    ema = nn.Sequential(*net.ema["backbone"], net.ema["head"])  # the EMA as a model
    with torch.no_grad():
        want = torch.stack([nn.functional.mse_loss(ema(x), y) for x, y in loader()])
    torch.testing.assert_close(torch.stack(net.val_losses[-4:]), want)
    assert not torch.equal(net.head.weight, net.ema["head"].weight)
    assert flags(net)[:2] == [False, False]


# --------------------------------------------------------------------------- checkpoint and resume

MILESTONES = {0: "head", 5: "backbone.3", 9: None}   # 4 batches an epoch (bn=True)


class Scheduled(Net):
    """The schedule lives in the module and travels through its own checkpoint hooks; param
    groups with an lr_scale and an epoch-interval StepLR; optionally a trainable-only
    checkpoint (docs/coming_from.md: ts.state_dict in on_save_checkpoint, strict_loading=False)."""

    def __init__(self, trainable_only=False, restore=True, masks=True):
        super().__init__(bn=True)
        self.schedule = ts.UnfreezeSchedule(self, MILESTONES)
        self.trainable_only, self.restore, self.masks = trainable_only, restore, masks
        self.strict_loading = not trainable_only
        self.seen = []

    def configure_optimizers(self):
        groups = ts.param_groups(self, ("backbone", {"lr_scale": 0.5}), weight_decay=0.05)
        opt = ts.optim.AdamW(groups, lr=0.02, max_grad_norm=1.0,
                             masks={"head.weight": ROWS} if self.masks else None)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}

    def on_train_batch_start(self, batch, idx):
        self.seen.append((self.global_step, self.schedule.current_step, flags(self)))

    def on_train_batch_end(self, outputs, batch, idx):
        self.schedule.step()

    def on_save_checkpoint(self, checkpoint):
        checkpoint["unfreeze"] = self.schedule.state_dict()
        if self.trainable_only:
            checkpoint["state_dict"] = ts.state_dict(self)

    def on_load_checkpoint(self, checkpoint):
        if self.restore:
            self.schedule.load_state_dict(checkpoint["unfreeze"])


@pytest.fixture(scope="module")
def scheduled_straight():
    net = Scheduled()
    trainer = fit(net, max_epochs=4)
    return net, trainer


def scheduled_resume(tmp_path, **kw):
    first = Scheduled(**kw)
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    fit(first, max_epochs=2, callbacks=[ckpt], enable_checkpointing=True,
        default_root_dir=tmp_path)
    again = Scheduled(**{**kw, "masks": False})
    trainer = fit(again, max_epochs=4, ckpt_path=tmp_path / "last.ckpt")
    return again, trainer, torch.load(tmp_path / "last.ckpt", weights_only=False)


@pytest.mark.parametrize("trainable_only", [False, True])
def test_resume_with_schedule_in_module_hooks_epoch_scheduler_and_lr_scale(
        tmp_path, scheduled_straight, trainable_only):
    """Trainer.fit(ckpt_path=...) after 2 of 4 epochs: the module's on_load_checkpoint puts the
    schedule back at step 8 (between milestones 5 and 9) before the optimizer state (masks
    included) and the epoch-interval scheduler load; the resumed run equals the straight one
    bitwise, parameters, statistics, optimizer state and lrs."""
    net, done = scheduled_straight
    again, trainer, ckpt = scheduled_resume(tmp_path, trainable_only=trainable_only)
    assert ckpt["unfreeze"] == {"step": 8, "milestones": [0, 5, 9]}
    if trainable_only:
        assert "backbone.0.weight" not in ckpt["state_dict"]
        assert "backbone.3.weight" in ckpt["state_dict"]
    assert [s for _, s, _ in again.seen] == list(range(8, 16))
    assert again.seen == net.seen[8:]
    opt, want = trainer.optimizers[0], done.optimizers[0]
    assert torch.equal(opt.masks[again.head.weight], ROWS)
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in want.param_groups]
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 4
    assert_same(net, again)
    for (path, p), q in zip(net.named_parameters(), again.parameters()):
        s, t = want.state.get(p, {}), opt.state.get(q, {})
        assert s.keys() == t.keys(), path
        for k in s:
            assert torch.equal(torch.as_tensor(s[k]), torch.as_tensor(t[k])), (path, k)
    assert int(again.backbone[1].num_batches_tracked) == 16 - 9  # held until step 9


def test_resume_without_the_schedule_state_differs(tmp_path, scheduled_straight):
    """The control: the same resume with the schedule left at step 0 trains otherwise."""
    net, _ = scheduled_straight
    again, _, _ = scheduled_resume(tmp_path, restore=False)
    assert again.seen[0][1] == 0
    assert not torch.equal(again.backbone[3].weight, net.backbone[3].weight)


class StepCounting(L.Callback):
    """A callback stepping the schedule once per batch in on_train_batch_end."""

    def __init__(self):
        self.schedule = None

    def setup(self, trainer, pl_module, stage):
        if self.schedule is None:
            self.schedule = ts.UnfreezeSchedule(pl_module, {0: "head", 4: None})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.schedule.step()


class GlobalStepCounting(StepCounting):
    """The callback of docs/coming_from.md: one schedule step per optimizer step."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        while self.schedule.current_step < trainer.global_step:
            self.schedule.step()


def test_documented_schedule_callback_counts_optimizer_steps_under_accumulation():
    """With accumulate_grad_batches=2, on_train_batch_end runs after every micro-batch: a
    callback stepping there once per call counts batches (its milestones come twice as early);
    the docs' callback follows trainer.global_step, the optimizer steps."""
    per_batch, documented = StepCounting(), GlobalStepCounting()
    t1 = fit(Net(), callbacks=[per_batch], accumulate_grad_batches=2, max_epochs=2)
    t2 = fit(Net(), callbacks=[documented], accumulate_grad_batches=2, max_epochs=2)
    assert t1.global_step == t2.global_step == 4
    assert per_batch.schedule.current_step == 8
    assert documented.schedule.current_step == 4


# --------------------------------------------------------------------------- summaries, monitors

def test_model_summary_counts_agree_with_ts_summary_once_attached():
    """Lightning's ModelSummary reads requires_grad; ts.summary computes the effective set.
    Attached (declarations written as flags), under a context, and with a tied parameter, the
    trainable and total counts agree."""
    from lightning.pytorch.utilities.model_summary import ModelSummary

    net = ts.attach(DeclaredNet())
    for check in range(3):
        if check == 1:
            ctx = ts.unfreeze(net, "backbone.2")   # a declaration is not overridden by unfreeze
        if check == 2:
            ctx.__exit__(None, None, None)
            net.head.weight = nn.Parameter(torch.randn(2, 8))
            net.backbone[2].weight = net.backbone[2].weight  # no-op assignment
            net.tied = nn.Linear(8, 2)
            net.tied.weight = net.head.weight                # a tied parameter
            ts.attach(net)
        s, ms = ts.summary(net), ModelSummary(net, max_depth=1)
        assert (ms.trainable_parameters, ms.total_parameters) == s.counts, check
        assert reads(net) == flags(net), check


def test_model_summary_callback_at_fit_start_sees_the_schedules_stage():
    class Capture(L.callbacks.ModelSummary):
        counts = None

        @staticmethod
        def summarize(summary_data, total_parameters, trainable_parameters, *a, **kw):
            Capture.counts = (trainable_parameters, total_parameters)

    net = Net()
    fit(net, callbacks=[StepCounting(), Capture()], enable_model_summary=True)
    assert Capture.counts == (18, 130)


def test_unattached_trainable_method_is_plain_pytorch_in_lightning_trap():
    """Documented, but easy to miss in Lightning: a `trainable()` method alone writes no flag (a
    model torchstruct never attached stays plain PyTorch; reads compute the declared answer).
    Without ts.attach, Lightning's ModelSummary and the optimizer train the whole model while
    ts.summary says only the head trains."""
    from lightning.pytorch.utilities.model_summary import ModelSummary

    net = DeclaredNet()
    assert ts.summary(net).counts == (18, 130)
    assert ModelSummary(net).trainable_parameters == 130
    fit(net)
    assert not torch.equal(net.backbone[0].weight, Net().backbone[0].weight)
    ts.attach(net)
    assert ModelSummary(net).trainable_parameters == 18


def test_learning_rate_monitor_uses_the_group_names(tmp_path):
    """docs/groups.md: the group "name"s show up in Lightning's LearningRateMonitor. It logs
    `lr` (the scheduler's value), not lr * lr_scale."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    def make(m):
        opt = ts.optim.AdamW(ts.param_groups(m, ("backbone", {"lr_scale": 0.1}),
                                             weight_decay=0.01), lr=0.02)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    net = Net(make_opt=make)
    fit(net, logger=CSVLogger(tmp_path, name="", version=""), log_every_n_steps=1,
        callbacks=[LearningRateMonitor(logging_interval="step")])
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    keys = {k for r in rows for k, v in r.items() if v}
    assert {"lr-AdamW/backbone", "lr-AdamW/backbone (no decay)", "lr-AdamW/default",
            "lr-AdamW/default (no decay)"} <= keys
    assert [float(r["lr-AdamW/backbone"]) for r in rows if r.get("lr-AdamW/backbone")] == [
        0.02, 0.02, 0.01, 0.01]


# --------------------------------------------------------------------------- DDP (spawned, CPU)

class SpawnedSchedule(L.Callback):
    """Builds the schedule in `setup` (before Lightning wraps the model in DDP) or in
    `on_fit_start` (after); each rank writes its flags, reads and whether the ranks agree."""

    def __init__(self, out, when):
        self.out, self.when, self.schedule, self.events = str(out), when, None, []

    def _build(self, pl_module):
        self.schedule = ts.UnfreezeSchedule(pl_module, {0: "head", 2: None})

    def setup(self, trainer, pl_module, stage):
        if self.when == "setup":
            self._build(pl_module)

    def on_fit_start(self, trainer, pl_module):
        if self.when == "on_fit_start":
            self._build(pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.events.append((trainer.global_step, flags(pl_module), reads(pl_module)))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.schedule.step()

    def on_train_end(self, trainer, pl_module):
        import json
        import os
        same = True
        if trainer.world_size > 1:
            w = torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()])
            ws = [torch.zeros_like(w) for _ in range(trainer.world_size)]
            torch.distributed.all_gather(ws, w)
            same = all(torch.equal(ws[0], v) for v in ws)
        with open(os.path.join(self.out, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump({"events": self.events, "same": same}, f)


def test_ddp_spawn_schedule_after_wrapping_with_find_unused_parameters(tmp_path):
    """docs/schedule.md: wrap once with everything requiring grad and
    find_unused_parameters=True, then build the schedule (Lightning: on_fit_start, after the
    strategy wrapped the model). Two CPU ranks seeing the same batches
    (use_distributed_sampler=False) agree bitwise with each other and with the single-process
    run (the average of two equal gradients is exact); the frozen backbone moves only from
    step 2; reads follow flags on every rank."""
    import json

    out = tmp_path / "ddp"
    out.mkdir()
    net = Net()
    fit(net, strategy="ddp_spawn_find_unused_parameters_true", devices=2, max_epochs=2,
        use_distributed_sampler=False, callbacks=[SpawnedSchedule(out, "on_fit_start")])
    one = Net()
    fit(one, max_epochs=2, callbacks=[SpawnedSchedule(tmp_path, "on_fit_start")])
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    single = json.loads((tmp_path / "rank0.json").read_text())
    assert ranks[0]["same"]
    for r in ranks:
        assert r["events"] == single["events"]
        assert all(f == rd for _, f, rd in r["events"])
    assert [e[1] for e in single["events"][:3]] == [[False] * 4 + [True] * 2] * 2 + [[True] * 6]
    assert_same(net, one)                       # rank 0's weights, copied back by Lightning


def test_ddp_spawn_stage_change_after_wrapping_is_refused_clearly(tmp_path):
    """The schedule built before the wrap (a callback's setup): DDP synchronizes only the head,
    so the stage that unfreezes the backbone is refused on every rank with the documented
    RuntimeError (never a hang), naming the parameter and DistributedDataParallel."""
    out = tmp_path / "ddp"
    out.mkdir()
    with pytest.raises(Exception, match="DistributedDataParallel") as info:
        fit(Net(), strategy="ddp_spawn", devices=2, max_epochs=2,
            callbacks=[SpawnedSchedule(out, "setup")])
    assert "backbone.0.weight" in str(info.value)


# --------------------------------------------------------------------------- closures, tuner, SWA

class StepsInside(Net):
    """Changes what trains inside training_step, i.e. inside the closure Lightning passes to
    optimizer.step(closure): ts through a schedule stepped there, the twin by hand."""

    def __init__(self, use_ts, **kw):
        super().__init__(**kw)
        self.use_ts, self.calls = use_ts, 0
        if use_ts:
            self.schedule = ts.UnfreezeSchedule(self, {0: "head", 2: None})
        else:
            for p in self.backbone.parameters():
                p.requires_grad_(False)

    def training_step(self, batch, idx):
        if self.use_ts and self.calls > 0:
            self.schedule.step()
        elif not self.use_ts and self.calls == 2:
            for p in self.backbone.parameters():
                p.requires_grad_(True)
        self.calls += 1
        return super().training_step(batch, idx)


def test_flags_changed_inside_the_closure_are_the_ones_the_step_reads():
    """Lightning runs training_step inside optimizer.step(closure). A stage change made there
    (the backbone starts training at step 2) is seen by ts.optim's step (frozen rule and folded
    clip's norm read after the closure): equal to torch.optim.SGD with Lightning's clip and the
    same flags written by hand."""
    ours = StepsInside(True, make_opt=lambda m: ts.optim.SGD(m.parameters(), lr=0.1,
                                                             momentum=0.9, max_grad_norm=0.5))
    twin = StepsInside(False, make_opt=lambda m: torch.optim.SGD(
        m.parameters(), lr=0.1, momentum=0.9, foreach=False))
    fit(ours, max_epochs=1)
    fit(twin, max_epochs=1, gradient_clip_val=0.5)
    assert_same(ours, twin, exact=False)
    assert not torch.equal(ours.backbone[0].weight, Net().backbone[0].weight)


def test_lr_find_restores_the_schedule_flags_and_weights():
    """Lightning's Tuner.lr_find trains a few steps (the module's schedule passes both
    milestones) and then restores the model from its own checkpoint, through the module's
    on_load_checkpoint: the schedule goes back to step 0 and its flags are applied at once
    (backwards: re-freezing), weights and BatchNorm statistics are back bitwise."""
    from lightning.pytorch.tuner import Tuner

    net = Scheduled()
    start = snap(net)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=False,
                            max_epochs=4)
        Tuner(trainer).lr_find(net, loader(), num_training=12, update_attr=False,
                               early_stop_threshold=None)
    assert net.seen[-1][1] >= 9 and net.seen[-1][2] == [True] * 8  # passed both milestones
    assert net.schedule.current_step == 0 and net.schedule.stage == 1
    assert flags(net) == reads(net) == [False] * 6 + [True] * 2
    assert all(torch.equal(v, start[k]) for k, v in snap(net).items())


def test_stochastic_weight_averaging_with_a_held_batchnorm_matches_plain_twin():
    """Lightning's StochasticWeightAveraging averages a deepcopy (inert hooks), copies the
    average back and recomputes BatchNorm statistics with momentum=None on the module itself
    (the update_bn case of docs/freezing.md: a held layer whose momentum was switched to None is
    recomputing on purpose and is not held). Equal to a plain twin whose frozen BatchNorm is in
    eval mode except while momentum is None; the frozen layers keep their bits."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    class Twin(Net):
        def on_train_batch_start(self, batch, idx):
            bn = self.backbone[1]
            bn.train(bn.momentum is None)

    ours = Net(bn=True)
    ts.freeze(ours, "backbone.0", "backbone.1")
    twin = Twin(bn=True, make_opt=torch_sgd)
    for p in [*twin.backbone[0].parameters(), *twin.backbone[1].parameters()]:
        p.requires_grad_(False)
    start = snap(ours)
    for m in (ours, twin):
        fit(m, max_epochs=3, callbacks=[StochasticWeightAveraging(swa_lrs=0.05,
                                                                  swa_epoch_start=1)])
    assert_same(ours, twin)
    assert torch.equal(ours.backbone[0].weight, start["backbone.0.weight"])
    assert not torch.equal(ours.backbone[1].running_mean, start["backbone.1.running_mean"])
    assert ours.backbone[1].momentum == 0.1
    assert flags(ours) == reads(ours) == [False] * 4 + [True] * 4


def test_load_from_checkpoint_of_a_trainable_only_checkpoint(tmp_path):
    """LightningModule.load_from_checkpoint with the module's strict_loading=False: the schedule
    is restored by on_load_checkpoint, the trained part by the checkpoint, the frozen part from
    the constructor; the result equals the model that wrote it."""
    first = Scheduled(trainable_only=True)
    fit(first, max_epochs=2, callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)],
        enable_checkpointing=True, default_root_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = Scheduled.load_from_checkpoint(tmp_path / "last.ckpt", trainable_only=True)
    assert loaded.schedule.current_step == 8
    assert flags(loaded) == flags(first) == reads(loaded)
    assert_same(first, loaded)


def test_layer_added_to_the_root_applies_at_its_own_forward_when_training_step_skips_the_root():
    """Lightning's training_step is not a forward of the root. A layer registered into the
    LightningModule after a permanent freeze_except("head"), used by a training_step that calls
    submodules directly (never self(x)): its own first forward applies the change
    (docs/freezing.md), so it stays frozen for the whole fit and the reads agree."""
    class Direct(Net):
        def training_step(self, batch, _idx):
            x, y = batch
            return nn.functional.mse_loss(self.extra(self.head(self.backbone(x))), y)

    net = Direct()
    ts.freeze_except(net, "head")
    net.extra = nn.Linear(2, 2)
    w = net.extra.weight.detach().clone()
    fit(net)
    assert not net.extra.weight.requires_grad and not ts.is_trainable(net, "extra.weight")
    assert torch.equal(net.extra.weight, w)
    assert flags(net) == reads(net)


# --------------------------------------------------------------------------- ts.constant around fit

def test_fit_inside_constant_refuses_the_step_naming_the_path_and_moves_nothing():
    """DESIGN §2: any in-place change of a selected parameter inside a ts.constant block raises
    RuntimeError naming its path. Lightning's automatic step (optimizer.step(closure)) with
    ts.optim.SGD: refused, nothing moved."""
    net = Net()
    start = snap(net)
    with pytest.raises(RuntimeError, match="'backbone.2.weight'"):
        with ts.constant(net, "backbone.2"):
            fit(net)
    assert all(torch.equal(v, start[k]) for k, v in snap(net).items())


def test_fit_inside_constant_leaves_ts_optim_state_and_last_grad_norm_as_they_were():
    """docs/stop_gradient.md: a step that would update a protected parameter "is refused before
    it starts, so its own state (momentum buffers, moments) is unchanged too"; docs/optimizers.md:
    "a refused (or interrupted) step undoes the state it created or converted, and leaves
    last_grad_norm as it was". Lightning always steps with a closure, so the gradient appears
    inside step(). Found by this audit (xfail until b628280): the refusal came from the op, after
    ts.optim had created zero state for every parameter and written last_grad_norm."""
    net = Net(make_opt=lambda m: ts.optim.AdamW(m.parameters(), lr=0.01, max_grad_norm=0.5))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=False,
                            max_epochs=1)
        with pytest.raises(RuntimeError, match="'backbone.2.weight'"):
            with ts.constant(net, "backbone.2"):
                trainer.fit(net, loader())
    opt = trainer.optimizers[0]
    assert opt.last_grad_norm is None
    assert len(opt.state) == 0


def test_closure_step_refused_by_constant_then_continued_equals_a_fresh_optimizer():
    """Regression (found by this audit, fixed in b628280): a refused closure step left zero
    momentum buffers; with dampening, SGD's first step takes the gradient as it is and a later
    one (1 - dampening) times it, so the next step after the refusal was not a first step."""
    def run(refuse_first):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
        opt = ts.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, dampening=0.5)
        x = torch.randn(4, 3)

        def closure():
            opt.zero_grad()
            loss = net(x).sum()
            loss.backward()
            return loss

        if refuse_first:
            with pytest.raises(RuntimeError, match="'1.weight'"):
                with ts.constant(net, "1"):
                    opt.step(closure)
        opt.step(closure)
        return net

    assert_same(run(False), run(True))


def test_fit_inside_constant_with_torch_sgd_moves_no_parameter():
    """docs/stop_gradient.md: "An optimizer step (any torch.optim.Optimizer, ts.optim included)
    that would update a protected parameter — one with a gradient — is refused before it
    starts". With Lightning's closure the gradient only exists once step() runs the closure.
    Found by this audit (xfail until b628280): torch.optim.SGD (foreach=False) updated backbone.0
    before the write to the protected backbone.2 was refused, a half-applied step."""
    net = Net(make_opt=torch_sgd)
    start = snap(net)
    with pytest.raises(RuntimeError, match="'backbone.2.weight'"):
        with ts.constant(net, "backbone.2"):
            fit(net)
    assert all(torch.equal(v, start[k]) for k, v in snap(net).items())


# --------------------------------------------------------------------------- more loops

class AlternatingBlock(Net):
    """Odd micro-batches run inside a ts.freeze block (the twin: the backbone under no_grad)."""

    def __init__(self, use_ts, **kw):
        super().__init__(**kw)
        self.use_ts = use_ts

    def training_step(self, batch, idx):
        x, y = batch
        if idx % 2 == 0:
            return nn.functional.mse_loss(self(x), y)
        if self.use_ts:
            with ts.freeze(self, "backbone"):
                return nn.functional.mse_loss(self(x), y)
        with torch.no_grad():
            h = self.backbone(x)
        return nn.functional.mse_loss(self.head(h), y)


def test_accumulation_with_a_freeze_block_on_every_other_micro_batch_matches_no_grad_twin():
    """accumulate_grad_batches=2, the second micro-batch of each window computed inside a
    ts.freeze block (backward after it, by Lightning): the backbone's gradient is the first
    micro-batch's only, as with the backbone run under no_grad; flags back after each block."""
    ours, twin = AlternatingBlock(True), AlternatingBlock(False, make_opt=torch_sgd)
    fit(ours, accumulate_grad_batches=2, max_epochs=2)
    fit(twin, accumulate_grad_batches=2, max_epochs=2)
    assert_same(ours, twin)
    assert flags(ours) == reads(ours) == [True] * 6


def test_fp16_gradscaler_overflow_on_the_first_step_sgd_momentum_matches_torch():
    """docs/optimizers.md: with SGD momentum an overflowed first step creates no buffer and the
    next step is a first step, as in torch. Under Lightning's GradScaler plugin on the CPU,
    the first batch overflows; ts.optim.SGD(max_grad_norm) equals torch.optim.SGD with
    Lightning's clip."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g)
    x[:4] *= 1e5

    def data():
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)

    ours = Net(make_opt=lambda m: ts.optim.SGD(m.parameters(), lr=0.1, momentum=0.9,
                                               max_grad_norm=0.5))
    twin = Net(make_opt=lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9,
                                                  foreach=False))
    a = fit(ours, data(), plugins=[fp16_plugin()])
    b = fit(twin, data(), plugins=[fp16_plugin()], gradient_clip_val=0.5)
    assert a.precision_plugin.scaler.get_scale() == b.precision_plugin.scaler.get_scale() == 2 ** 15
    assert_same(ours, twin, exact=False)
