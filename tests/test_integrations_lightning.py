"""Lightning: ts.optim in configure_optimizers, a ts.UnfreezeSchedule driven from a callback.

A run interrupted at a checkpoint and resumed from it must reproduce the straight run exactly:
the schedule's step travels in the callback's state, the optimizer state in Lightning's.
"""
import os
import warnings

import pytest
import torch
from torch import nn

import torchstruct as ts

L = pytest.importorskip("lightning.pytorch")

MILESTONES = {0: "head", 3: "body.2", 6: ["body.0", "body.1"], 10: None}
BATCHES = 4  # per epoch


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(3, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.body(self.embed(x)))

    def training_step(self, batch, _idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return ts.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


class Unfreezing(L.Callback):
    """Builds the schedule when fitting starts; steps it after every optimizer step."""

    def __init__(self, milestones):
        self.milestones = milestones
        self.schedule = None
        self.seen = []  # (global step, trainable paths) at every batch

    def setup(self, trainer, pl_module, stage):
        if self.schedule is None:
            self.schedule = ts.UnfreezeSchedule(pl_module, self.milestones)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        paths = tuple(p for p, _ in ts.trainable_parameters(pl_module))
        self.seen.append((trainer.global_step, self.schedule.current_step, paths))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.schedule.step()

    def state_dict(self):
        return {"schedule": self.schedule.state_dict()}

    def load_state_dict(self, state):
        self.schedule.load_state_dict(state["schedule"])


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCHES * 4, 3, generator=g)
    y = torch.randn(BATCHES * 4, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


def trainer(tmp_path, epochs, callbacks):
    return L.Trainer(
        max_epochs=epochs, accelerator="cpu", devices=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=True,
        default_root_dir=tmp_path, callbacks=callbacks, deterministic=True,
    )


def fit(tmp_path, epochs, ckpt_path=None, restore_schedule=True):
    net, cb = Net(), Unfreezing(MILESTONES)
    if not restore_schedule:
        cb.load_state_dict = lambda state: None
    ckpt = L.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1,
                                       every_n_epochs=1, save_last=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        warnings.filterwarnings("ignore", ".*number of training batches.*")
        trainer(tmp_path, epochs, [cb, ckpt]).fit(net, data(), ckpt_path=ckpt_path)
    return net, cb


def params(net):
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return fit(tmp_path_factory.mktemp("straight"), epochs=4)


def test_straight_run_follows_the_schedule(straight):
    net, cb = straight
    assert [g for g, _, _ in cb.seen] == list(range(4 * BATCHES))
    assert all(g == s for g, s, _ in cb.seen)  # the schedule steps with the optimizer
    by_step = {g: set(paths) for g, _, paths in cb.seen}
    assert by_step[0] == by_step[2] == {"head.weight", "head.bias"}
    assert by_step[3] == {"head.weight", "head.bias", "body.2.weight", "body.2.bias"}
    assert "body.0.weight" in by_step[6] and "embed.weight" not in by_step[9]
    assert by_step[10] == {p for p, _ in net.named_parameters()}
    # parameters frozen for a while moved only once unfrozen
    fresh = Net()
    assert not torch.equal(net.embed.weight, fresh.embed.weight)


def test_resume_from_checkpoint_reproduces_the_straight_run(straight, tmp_path):
    net, cb = straight
    first, _ = fit(tmp_path, epochs=2)  # stops at step 8, between milestones 6 and 10
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    assert ckpt.exists()
    saved = torch.load(ckpt, weights_only=False)
    assert {"schedule": {"step": 8, "milestones": [0, 3, 6, 10]}} in saved["callbacks"].values()
    resumed, rcb = fit(tmp_path / "again", epochs=4, ckpt_path=ckpt)
    assert [s for _, s, _ in rcb.seen] == list(range(8, 16))
    assert [paths for _, _, paths in rcb.seen] == [paths for _, _, paths in cb.seen[8:]]
    want, got = params(net), params(resumed)
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_resume_without_the_schedule_state_differs(straight, tmp_path):
    # the control: the same resume with the schedule restarted from step 0 trains otherwise
    net, _ = straight
    fit(tmp_path, epochs=2)
    resumed, rcb = fit(tmp_path / "again", epochs=4, ckpt_path=tmp_path / "ckpt" / "last.ckpt",
                       restore_schedule=False)
    assert rcb.seen[0][2] == ("head.weight", "head.bias")
    assert not torch.equal(resumed.embed.weight, net.embed.weight)
