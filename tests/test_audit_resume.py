"""Stopping and resuming training, and moving state between torchstruct and plain PyTorch.

What a user does when an existing training script switches to torchstruct mid-project, or a
run resumes on another set-up, tried with small models.

Optimizers. ``ts.optim.AdamW`` / ``ts.optim.SGD`` state dicts are loaded into
``torch.optim.AdamW`` / ``torch.optim.SGD`` and the other way round mid-training (moments,
momentum buffers, step counts, amsgrad, weight decay, nesterov, several param groups, a part
frozen for good that never gets state, stale gradients on it while torchstruct steps), always
through ``torch.save`` / ``torch.load(weights_only=True, map_location=...)``, into an optimizer
built over ``ts.param_groups`` of a freshly constructed model; the run that switched is compared
with a ``torch.optim`` run that never did (to 1e-6 relative, SGD bitwise), frozen parameters
bitwise. A torchstruct run resumed with ``lr_scale`` layer-decay groups, path-keyed element masks
(restored from the state dict, not given again), amsgrad and the folded clip continues bitwise
like the straight run, masked-out elements bitwise untouched. A float32 checkpoint resumes on a
float64 model as ``torch.optim`` resumes it, and a model given a new head after the checkpoint
resumes by loading and then ``add_param_group``, matching ``torch.optim`` doing the same.

Schedules. ``OneCycleLR`` (cycling AdamW's betas), ``CosineAnnealingLR``, ``LambdaLR`` and
``SequentialLR`` over ``lr_scale`` groups, saved and resumed: bitwise like the straight run,
and to 1e-6 like ``torch.optim.AdamW`` given the scaled learning rates explicitly. A
``ts.UnfreezeSchedule`` checkpointed before and after a milestone (the trainable set changes
between save and load) with a trainable-only ``ts.state_dict``, an LR scheduler and masks
resumes bitwise, also into a model built on the meta device and loaded with ``assign=True``
after the schedule was set up on it; a plain PyTorch script that froze by hand with
``torch.optim.AdamW`` is resumed mid-run on ``ts.optim.AdamW`` and a schedule set to the step it
stopped at, and matches the plain script run straight. ``torch.amp.GradScaler`` state travels
with ``ts.optim`` across a resume (skipped steps before and right after it), also when the first
half ran on ``torch.optim``. ``UnfreezeSchedule.load_state_dict`` refuses foreign states (an LR
scheduler's, an optimizer's, a GradScaler's, non-integer steps) and a closed schedule, changing
no flag.

Model checkpoints. ``ts.state_dict`` / ``ts.load_state_dict`` of a ``torch.compile`` wrapper
(``_orig_mod.`` keys), of an attached model with a declaration loaded into a plain one, of a
model with a tied weight, into a model with an extra head, and with ``map_location="meta"``:
compared with ``Module.load_state_dict``; bad keys, shapes and dtypes raise and write nothing.

Bad optimizer state on resume (another model's, a wrong group count, a resized embedding, a mask
of the wrong shape, state mapped to ``meta``) raises and leaves parameters, flags, optimizer
state and masks as they were; so does another optimizer type's state dict and one whose
``param_names`` disagree with the optimizer's. Masks follow a ``load_state_dict`` pre-hook that
remaps by name and survive ``torch.distributed.checkpoint.state_dict``, and a step refused inside
``GradScaler.step``, retried after the state was fixed, equals a clean one.

With Lightning: ``fit(ckpt_path=...)`` from the last (epoch-end) checkpoint, with ``lr_scale``
groups, a mask, a frozen block, the folded clip and a per-step LR scheduler, continues bitwise
like the straight run. With the HF convention: a ``torch.optim.AdamW`` over HF
``Trainer``-style decay groups continues on ``ts.optim.AdamW(ts.param_groups(...))`` like the
plain script (the ``Trainer``'s own checkpoint resume is in ``test_integrations_hf.py``).
"""
import copy
import io
import warnings

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as lrs

import torchstruct as ts
from _flags import NEEDS_NAMED_OPTIM, flags

INF = float("inf")
VOCAB, DIM = 12, 6
NEW_ROWS = slice(9, 12)  # the rows of the embedding a mask lets train


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self, seed=0, depth=3):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(depth))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        h = self.embed(idx)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(self.norm(h))


def loss_of(net, step):
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, VOCAB, (4, 5), generator=g)
    target = torch.randint(0, VOCAB, (4, 5), generator=g)
    return nn.functional.cross_entropy(net(idx).flatten(0, 1), target.flatten())


def rows_mask():
    mask = torch.zeros(VOCAB, DIM, dtype=torch.bool)
    mask[NEW_ROWS] = True
    return mask


def train(net, opt, steps, *, sched=None, schedule=None, scaler=None, stale=(), inf_at=(),
          before_step=None, log=None):
    """One optimizer step per entry of ``steps``; ``stale`` parameters get a stale gradient of
    ones before each step (torchstruct must ignore it: they are frozen)."""
    for step in steps:
        if before_step is not None:
            before_step(step)
        opt.zero_grad(set_to_none=True)
        loss = loss_of(net, step)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if step in inf_at:
            net.head.weight.grad[0, 0] = INF
        for p in stale:
            assert not p.requires_grad
            p.grad = torch.ones_like(p)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if log is not None:
            log.append([g["lr"] * g.get("lr_scale", 1.0) for g in opt.param_groups])
        if sched is not None:
            sched.step()
        if schedule is not None:
            schedule.step()


def roundtrip(obj, map_location="cpu"):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True, map_location=map_location)


def params_of(net):
    return {k: v.detach().clone() for k, v in net.named_parameters()}


def assert_same(a, b, *, exact, what=""):
    for (path, p), q in zip(a.named_parameters(), b.parameters()):
        if exact:
            assert p.dtype == q.dtype and torch.equal(p, q), f"{what} {path}"
        else:
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=f"{what} {path}")


def assert_states(a, opt_a, b, opt_b, *, exact):
    for (path, p), q in zip(a.named_parameters(), b.parameters()):
        sa, sb = opt_a.state.get(p, {}), opt_b.state.get(q, {})
        assert set(sa) == set(sb), (path, set(sa), set(sb))
        for key in sa:
            x, y = torch.as_tensor(sa[key]).float(), torch.as_tensor(sb[key]).float()
            if exact or key == "step":
                assert torch.equal(x, y), (path, key)
            else:
                torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7, msg=f"{path} {key}")


def opt_snapshot(opt):
    """Everything ``load_state_dict`` could change: groups, state (bits), masks."""
    groups = [{k: (list(map(id, v)) if k == "params" else copy.deepcopy(v)) for k, v in g.items()}
              for g in opt.param_groups]
    state = {id(p): {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
             for p, s in opt.state.items()}
    masks = {id(p): m.clone() for p, m in getattr(opt, "masks", {}).items()}
    return groups, state, masks


def assert_opt_unchanged(opt, snap):
    groups, state, masks = opt_snapshot(opt)
    assert groups == snap[0]
    assert state.keys() == snap[1].keys()
    for k, s in snap[1].items():
        assert state[k].keys() == s.keys()
        for key, v in s.items():
            assert torch.equal(torch.as_tensor(state[k][key]), torch.as_tensor(v)), key
    assert masks.keys() == snap[2].keys()
    assert all(torch.equal(masks[k], m) for k, m in snap[2].items())


# ---------------------------------------------------------------------------
# torch.optim <-> ts.optim, mid-training
# ---------------------------------------------------------------------------

KINDS = {
    "adamw": (torch.optim.AdamW, ts.optim.AdamW,
              dict(lr=0.02, betas=(0.8, 0.95), weight_decay=0.1, amsgrad=True)),
    "sgd": (torch.optim.SGD, ts.optim.SGD,
            dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
}
# per-group options both libraries read (lr_scale is torchstruct's only)
RULES = (("head", {"lr": 0.01}), ("blocks.0", {"weight_decay": 0.0}))


def build(cls, net, kw):
    extra = dict(foreach=False) if cls.__module__.startswith("torch.") else {}
    return cls(ts.param_groups(net, *RULES), **kw, **extra)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("direction", ["torch->ts", "ts->torch"])
def test_switch_between_torch_and_ts_mid_training_matches_an_unswitched_torch_run(kind,
                                                                                  direction):
    torch_cls, ts_cls, kw = KINDS[kind]
    first, second = (torch_cls, ts_cls) if direction == "torch->ts" else (ts_cls, torch_cls)

    straight = Net()
    ts.freeze(straight, "blocks.1")  # a bare call: frozen for good
    ref = build(torch_cls, straight, kw)
    train(straight, ref, range(7))

    net = Net()
    ts.freeze(net, "blocks.1")
    frozen = list(net.blocks[1].parameters())
    opt = build(first, net, kw)
    train(net, opt, range(3), stale=frozen if first is ts_cls else ())
    ckpt = roundtrip({"model": net.state_dict(), "optim": opt.state_dict()})
    if first is ts_cls:
        assert ckpt["optim"]["masks"] == {}
    resumed = Net(seed=1)
    ts.freeze(resumed, "blocks.1")
    resumed.load_state_dict(ckpt["model"])
    opt2 = build(second, resumed, kw)
    opt2.load_state_dict(ckpt["optim"])
    train(resumed, opt2, range(3, 7), stale=list(resumed.blocks[1].parameters())
          if second is ts_cls else ())

    assert_same(straight, resumed, exact=kind == "sgd")  # SGD: bitwise on the CPU
    assert_states(straight, ref, resumed, opt2, exact=kind == "sgd")
    for p, q in zip(Net().blocks[1].parameters(), resumed.blocks[1].parameters()):
        assert torch.equal(p, q) and q not in opt2.state


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_ts_resume_with_lr_scale_masks_clip_and_frozen_part_is_bitwise(kind):
    _, cls, kw = KINDS[kind]

    def make(net, masks):
        groups = ts.param_groups(net, *ts.layer_decay(net, 0.5, layers="blocks"))
        return cls(groups, **kw, max_grad_norm=0.5,
                   masks={"embed.weight": rows_mask()} if masks else None)

    straight = Net()
    ts.freeze(straight, "blocks.1")
    opt = make(straight, masks=True)
    train(straight, opt, range(6), stale=list(straight.blocks[1].parameters()))

    net = Net()
    ts.freeze(net, "blocks.1")
    opt1 = make(net, masks=True)
    train(net, opt1, range(3), stale=list(net.blocks[1].parameters()))
    ckpt = roundtrip({"model": net.state_dict(), "optim": opt1.state_dict()})
    resumed = Net(seed=1)
    resumed.load_state_dict(ckpt["model"])
    ts.freeze(resumed, "blocks.1")
    opt2 = make(resumed, masks=False)  # the masks come back from the state dict
    opt2.load_state_dict(ckpt["optim"])
    assert torch.equal(opt2.masks[resumed.embed.weight], rows_mask())
    assert [g["lr_scale"] for g in opt2.param_groups] == [g["lr_scale"] for g in opt.param_groups]
    train(resumed, opt2, range(3, 6), stale=list(resumed.blocks[1].parameters()))

    assert_same(straight, resumed, exact=True)
    assert_states(straight, opt, resumed, opt2, exact=True)
    torch.testing.assert_close(opt2.last_grad_norm, opt.last_grad_norm, rtol=0, atol=0)
    start = Net()
    keep = ~rows_mask()
    assert torch.equal(resumed.embed.weight[keep], start.embed.weight[keep])
    assert not torch.equal(resumed.embed.weight[NEW_ROWS], start.embed.weight[NEW_ROWS])
    for key in ("exp_avg", "momentum_buffer"):
        if key in opt2.state[resumed.embed.weight]:
            assert opt2.state[resumed.embed.weight][key][keep].eq(0).all()
    for p, q in zip(start.blocks[1].parameters(), resumed.blocks[1].parameters()):
        assert torch.equal(p, q) and q not in opt2.state


def test_state_of_a_float32_run_resumes_on_a_float64_model_like_torch():
    """Another set-up: the checkpoint of a float32 run resumed in float64. torch casts the
    loaded state to the parameters' dtype; torchstruct must continue as torch does."""
    net = Net()
    opt = ts.optim.AdamW(net.parameters(), lr=0.02, masks={net.embed.weight: rows_mask()})
    train(net, opt, range(3))
    ckpt = roundtrip({"model": net.state_dict(), "optim": opt.state_dict()})
    ours, theirs = Net(seed=1).double(), Net(seed=1).double()
    for m in (ours, theirs):
        m.load_state_dict(ckpt["model"])  # Module.load_state_dict casts to float64
    a = ts.optim.AdamW(ours.parameters(), lr=0.02)
    b = torch.optim.AdamW(theirs.parameters(), lr=0.02, foreach=False)
    # one copy each: torch's load_state_dict keeps the given tensors where no cast is needed
    # (the step counts here), so two optimizers loaded from one dict would share them
    a.load_state_dict(copy.deepcopy(ckpt["optim"]))
    b.load_state_dict(copy.deepcopy(ckpt["optim"]))
    assert torch.equal(a.masks[ours.embed.weight], rows_mask())
    idx = torch.randint(0, VOCAB, (4, 5), generator=torch.Generator().manual_seed(5))
    for step in range(3):
        for m, o in ((ours, a), (theirs, b)):
            o.zero_grad()
            m(idx).pow(2).mean().backward()
            if o is b:  # torch has no masks: the masked-out rows get no gradient there
                m.embed.weight.grad[~rows_mask()] = 0
            o.step()
            if o is b:
                with torch.no_grad():
                    m.embed.weight[~rows_mask()] = ckpt["model"]["embed.weight"].double()[
                        ~rows_mask()]
    for (path, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert p.dtype == torch.float64
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=path)
    assert a.state[ours.head.weight]["exp_avg"].dtype == torch.float64


def test_model_with_a_new_head_resumes_by_loading_then_add_param_group_like_torch():
    class Wider(Net):
        def __init__(self, seed=0):
            super().__init__(seed)
            torch.manual_seed(7)
            self.aux = nn.Linear(DIM, VOCAB)

        def forward(self, idx):
            return super().forward(idx) + self.aux(self.embed(idx))

    net = Net()
    opt = ts.optim.AdamW(ts.param_groups(net), lr=0.02)
    train(net, opt, range(3))
    ckpt = roundtrip({"model": net.state_dict(), "optim": opt.state_dict()})

    ours, theirs = Wider(seed=1), Wider(seed=1)
    # ts.load_state_dict: the new head's keys are missing (strict refuses, writing nothing);
    # strict=False reports them as Module.load_state_dict does
    before = params_of(ours)
    with pytest.raises(ValueError, match=r"missing 2 key.*'aux\.weight', 'aux\.bias'"):
        ts.load_state_dict(ours, ckpt["model"])
    assert all(torch.equal(before[k], v) for k, v in params_of(ours).items())
    got = ts.load_state_dict(ours, ckpt["model"], strict=False)
    assert got.missing_keys == theirs.load_state_dict(ckpt["model"], strict=False).missing_keys
    assert_same(ours, theirs, exact=True)
    # the groups of the whole new model do not match the saved ones: refused, nothing changed
    wrong = ts.optim.AdamW(ts.param_groups(ours), lr=0.02)
    snap = opt_snapshot(wrong)
    with pytest.raises(ValueError, match="size of optimizer's group"):
        wrong.load_state_dict(ckpt["optim"])
    assert_opt_unchanged(wrong, snap)

    def old_groups(m):  # the model's groups without the new head: the saved layout
        out = []
        for g in ts.param_groups(m):
            keep = [(n, p) for n, p in zip(g["param_names"], g["params"])
                    if not n.startswith("aux.")]
            out.append({**g, "params": [p for _, p in keep], "param_names": [n for n, _ in keep]})
        return out

    a = ts.optim.AdamW(old_groups(ours), lr=0.02)
    b = torch.optim.AdamW(old_groups(theirs), lr=0.02, foreach=False)
    for o, m in ((a, ours), (b, theirs)):
        o.load_state_dict(copy.deepcopy(ckpt["optim"]))  # one copy each (torch aliases)
        o.add_param_group({"params": [m.aux.weight, m.aux.bias],
                           "param_names": ["aux.weight", "aux.bias"], "weight_decay": 0.0})
    train(ours, a, range(3, 6))
    train(theirs, b, range(3, 6))
    assert_same(ours, theirs, exact=False)
    assert_states(ours, a, theirs, b, exact=False)
    assert float(a.state[ours.aux.weight]["step"]) == 3
    assert float(a.state[ours.head.weight]["step"]) == 6


# ---------------------------------------------------------------------------
# LR schedulers over lr_scale groups, across a resume
# ---------------------------------------------------------------------------

BASE_LR = 0.05


def make_sched(name, opt, scales):
    if name == "onecycle":  # cycles AdamW's beta1 too
        return lrs.OneCycleLR(opt, max_lr=[BASE_LR * s for s in scales], total_steps=8)
    if name == "cosine":
        return lrs.CosineAnnealingLR(opt, T_max=8)
    if name == "lambda":
        return lrs.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))
    warm = lrs.LinearLR(opt, start_factor=0.25, total_iters=3)
    return lrs.SequentialLR(opt, [warm, lrs.CosineAnnealingLR(opt, T_max=5)], milestones=[3])


@pytest.mark.parametrize("name", ["onecycle", "cosine", "lambda", "sequential"])
def test_lr_scheduler_over_lr_scale_groups_resumes_bitwise_and_matches_torch(name):
    def ours(net):
        groups = ts.param_groups(net, *ts.layer_decay(net, 0.5, layers="blocks"))
        opt = ts.optim.AdamW(groups, lr=BASE_LR, weight_decay=0.1)
        return opt, make_sched(name, opt, [1.0] * len(groups))

    straight = Net()
    opt, sched = ours(straight)
    log = []
    train(straight, opt, range(8), sched=sched, log=log)

    twin = Net()  # torch.optim.AdamW with the scaled learning rates given explicitly
    groups = ts.param_groups(twin, *ts.layer_decay(twin, 0.5, layers="blocks"))
    scales = [g.pop("lr_scale") for g in groups]
    for g, s in zip(groups, scales):
        g["lr"] = BASE_LR * s
    topt = torch.optim.AdamW(groups, lr=BASE_LR, weight_decay=0.1, foreach=False)
    tlog = []
    train(twin, topt, range(8), sched=make_sched(name, topt, scales), log=tlog)
    assert len(set(scales)) > 2
    torch.testing.assert_close(torch.tensor(log), torch.tensor(tlog), rtol=1e-12, atol=0)
    assert_same(straight, twin, exact=False)

    net = Net()
    opt1, sched1 = ours(net)
    train(net, opt1, range(3), sched=sched1)
    ckpt = roundtrip({"model": net.state_dict(), "optim": opt1.state_dict(),
                      "sched": sched1.state_dict()})
    resumed = Net(seed=1)
    resumed.load_state_dict(ckpt["model"])
    opt2, sched2 = ours(resumed)  # the scheduler first, then the states (torch's order)
    opt2.load_state_dict(ckpt["optim"])
    sched2.load_state_dict(ckpt["sched"])
    rlog = []
    train(resumed, opt2, range(3, 8), sched=sched2, log=rlog)
    assert rlog == log[3:]
    assert_same(straight, resumed, exact=True)
    assert_states(straight, opt, resumed, opt2, exact=True)


# ---------------------------------------------------------------------------
# UnfreezeSchedule across a resume
# ---------------------------------------------------------------------------

MILESTONES = {0: ["head", "norm"], 3: "blocks.2", 5: None}


@pytest.mark.parametrize("load", ["trainable-only", "meta+assign"])
@pytest.mark.parametrize("at", [2, 4])  # before / after the milestone at step 3
def test_unfreeze_schedule_checkpoint_resumes_bitwise(at, load):
    """trainable-only: ts.state_dict saved, ts.load_state_dict(strict=True) into the same
    pretrained model. meta+assign: the model built on the meta device, the schedule set up on
    it, then the full state dict loaded with assign=True (new parameter objects)."""
    def optimizer(net, masks):
        groups = ts.param_groups(net, *ts.layer_decay(net, 0.7, layers="blocks"))
        opt = ts.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=0.01,
                           masks={"embed.weight": rows_mask()} if masks else None)
        return opt, lrs.CosineAnnealingLR(opt, T_max=8)

    def setup(net, masks):
        return (ts.UnfreezeSchedule(net, MILESTONES), *optimizer(net, masks))

    straight = Net()
    schedule, opt, sched = setup(straight, masks=True)
    seen = []
    train(straight, opt, range(8), sched=sched, schedule=schedule,
          before_step=lambda s: seen.append(flags(straight)))
    schedule.close()

    net = Net()
    schedule1, opt1, sched1 = setup(net, masks=True)
    train(net, opt1, range(at), sched=sched1, schedule=schedule1)
    ckpt = roundtrip({"model": ts.state_dict(net) if load == "trainable-only" else
                      net.state_dict(), "optim": opt1.state_dict(),
                      "sched": sched1.state_dict(), "schedule": schedule1.state_dict()})
    if load == "trainable-only":
        assert set(ckpt["model"]) == {n for n, p in net.named_parameters() if p.requires_grad}
    schedule1.close()

    if load == "trainable-only":
        resumed = Net()  # the same pretrained weights; the checkpoint brings the trained part
        schedule2 = ts.UnfreezeSchedule(resumed, MILESTONES)
        schedule2.load_state_dict(ckpt["schedule"])  # flags first: strict loading checks them
        ts.load_state_dict(resumed, ckpt["model"])
    else:
        with torch.device("meta"):
            resumed = Net()
        schedule2 = ts.UnfreezeSchedule(resumed, MILESTONES)
        schedule2.load_state_dict(ckpt["schedule"])
        resumed.load_state_dict(ckpt["model"], assign=True)
        assert not any(p.is_meta for p in resumed.parameters())
    assert flags(resumed) == seen[at]
    opt2, sched2 = optimizer(resumed, masks=False)  # the mask comes from the state dict
    opt2.load_state_dict(ckpt["optim"])
    sched2.load_state_dict(ckpt["sched"])
    rseen = []
    train(resumed, opt2, range(at, 8), sched=sched2, schedule=schedule2,
          before_step=lambda s: rseen.append(flags(resumed)))
    schedule2.close()
    assert rseen == seen[at:]
    assert_same(straight, resumed, exact=True)
    assert_states(straight, opt, resumed, opt2, exact=True)
    start = Net()
    assert torch.equal(resumed.embed.weight[~rows_mask()], start.embed.weight[~rows_mask()])
    assert torch.equal(opt2.masks[resumed.embed.weight], rows_mask())
    assert all(p.requires_grad for p in resumed.parameters())


def test_plain_script_that_froze_by_hand_resumes_on_ts_with_a_schedule_like_torch():
    """Phase 1 is a plain PyTorch script (head trains, the rest frozen by hand until step 5,
    torch.optim.AdamW + StepLR); it is resumed at step 3 on ts.optim.AdamW and a
    ts.UnfreezeSchedule set to step 3. Reference: the plain script run straight."""
    U, AT = 5, 3

    def by_hand(net, step):
        for name, p in net.named_parameters():
            p.requires_grad_(name.startswith("head.") or step >= U)

    straight = Net()
    by_hand(straight, 0)
    ref = torch.optim.AdamW(straight.parameters(), lr=0.02, weight_decay=0.1, foreach=False)
    ref_sched = lrs.StepLR(ref, step_size=2, gamma=0.5)
    train(straight, ref, range(8), sched=ref_sched, before_step=lambda s: by_hand(straight, s))

    net = Net()
    by_hand(net, 0)
    opt = torch.optim.AdamW(net.parameters(), lr=0.02, weight_decay=0.1, foreach=False)
    sched = lrs.StepLR(opt, step_size=2, gamma=0.5)
    train(net, opt, range(AT), sched=sched)
    ckpt = roundtrip({"model": net.state_dict(), "optim": opt.state_dict(),
                      "sched": sched.state_dict()})
    assert len(ckpt["optim"]["state"]) == 2  # the head only

    resumed = Net(seed=1)
    resumed.load_state_dict(ckpt["model"])
    schedule = ts.UnfreezeSchedule(resumed, {0: "head", U: None})
    schedule.load_state_dict({"step": AT, "milestones": [0, U]})
    opt2 = ts.optim.AdamW(resumed.parameters(), lr=0.02, weight_decay=0.1)
    sched2 = lrs.StepLR(opt2, step_size=2, gamma=0.5)
    opt2.load_state_dict(ckpt["optim"])
    sched2.load_state_dict(ckpt["sched"])
    train(resumed, opt2, range(AT, 8), sched=sched2, schedule=schedule)
    schedule.close()
    assert_same(straight, resumed, exact=False)
    assert_states(straight, ref, resumed, opt2, exact=False)


# ---------------------------------------------------------------------------
# GradScaler across a resume
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("first", ["ts", "torch"])
def test_gradscaler_state_resumes_with_ts_optim_like_torch(first):
    def scaler():
        return torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)

    INF_AT = (1, 3)  # step 3 is the first after the resume: skipped

    def run(net, opt, sc, steps):
        scales = []
        for step in steps:
            train(net, opt, [step], scaler=sc, inf_at=INF_AT)
            scales.append(sc.get_scale())
        return scales

    ref_net = Net()
    ref_opt = torch.optim.AdamW(ref_net.parameters(), lr=0.02, amsgrad=True, foreach=False)
    ref_scales = run(ref_net, ref_opt, scaler(), range(7))
    assert ref_scales[1] == ref_scales[0] / 2  # the overflow halved the scale

    net = Net()
    opt = (ts.optim.AdamW(net.parameters(), lr=0.02, amsgrad=True) if first == "ts" else
           torch.optim.AdamW(net.parameters(), lr=0.02, amsgrad=True, foreach=False))
    sc = scaler()
    scales = run(net, opt, sc, range(3))
    ckpt = roundtrip({"model": net.state_dict(), "optim": opt.state_dict(),
                      "scaler": sc.state_dict()})
    resumed = Net(seed=1)
    resumed.load_state_dict(ckpt["model"])
    opt2 = ts.optim.AdamW(resumed.parameters(), lr=0.02, amsgrad=True)
    opt2.load_state_dict(ckpt["optim"])
    sc2 = scaler()
    sc2.load_state_dict(ckpt["scaler"])
    before = params_of(resumed)
    scales += run(resumed, opt2, sc2, range(3, 4))
    after = params_of(resumed)
    assert all(torch.equal(before[k], after[k]) for k in before)  # the skipped step
    scales += run(resumed, opt2, sc2, range(4, 7))
    assert scales == ref_scales
    assert_same(ref_net, resumed, exact=False)
    assert_states(ref_net, ref_opt, resumed, opt2, exact=False)
    assert float(opt2.state[resumed.head.weight]["step"]) == 5


# ---------------------------------------------------------------------------
# UnfreezeSchedule.load_state_dict: foreign and odd states
# ---------------------------------------------------------------------------


def foreign_states():
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    return {
        "lr scheduler": lrs.CosineAnnealingLR(opt, T_max=4).state_dict(),
        "optimizer": opt.state_dict(),
        "grad scaler": torch.amp.GradScaler("cpu").state_dict(),
        "float tensor step": {"step": torch.tensor(4.0), "milestones": [0, 3, 5]},
        "str step": {"step": "4", "milestones": [0, 3, 5]},
        "float milestone": {"step": 4, "milestones": [0, 3.0, 5]},
        "milestones as str": {"step": 4, "milestones": "035"},
        "two-element step": {"step": torch.tensor([4, 4]), "milestones": [0, 3, 5]},
    }


@pytest.mark.parametrize("which", sorted(foreign_states()))
def test_schedule_refuses_foreign_states_and_changes_nothing(which):
    state = foreign_states()[which]
    net = Net()
    schedule = ts.UnfreezeSchedule(net, MILESTONES)
    schedule.step()
    before = flags(net)
    with pytest.raises(ValueError, match="UnfreezeSchedule.load_state_dict"):
        schedule.load_state_dict(state)
    assert (schedule.current_step, schedule.stage) == (1, 1) and flags(net) == before
    schedule.close()


@pytest.mark.parametrize("step", [torch.tensor(4), torch.tensor([4]), 4])
def test_schedule_state_with_integer_steps_gives_the_flags_of_a_stepped_schedule(step):
    np = pytest.importorskip("numpy")
    brute = Net()
    s = ts.UnfreezeSchedule(brute, MILESTONES)
    for _ in range(4):
        s.step()
    want = flags(brute)
    s.close()
    for value in (step, np.int64(4)):
        net = Net()
        schedule = ts.UnfreezeSchedule(net, MILESTONES)
        schedule.load_state_dict(roundtrip({"step": value, "milestones": (0, 3, 5)})
                                 if torch.is_tensor(value) else
                                 {"step": value, "milestones": (0, 3, 5)})
        assert flags(net) == want and schedule.current_step == 4 and schedule.stage == 2
        schedule.close()


def test_closed_schedule_refuses_a_state_and_changes_nothing():
    net = Net()
    schedule = ts.UnfreezeSchedule(net, MILESTONES)
    state = schedule.state_dict()
    schedule.close()
    before = flags(net)
    assert all(before)
    with pytest.raises(RuntimeError, match="closed"):
        schedule.load_state_dict({"step": 4, "milestones": [0, 3, 5]})
    with pytest.raises(RuntimeError, match="closed"):
        schedule.load_state_dict(state)  # the same stage: still refused
    assert flags(net) == before


# ---------------------------------------------------------------------------
# ts.state_dict / ts.load_state_dict on models built differently
# ---------------------------------------------------------------------------


def test_compiled_wrapper_checkpoint_keys_and_loading_into_a_plain_model():
    net = Net()
    ts.freeze(net, "embed", "blocks.0")
    compiled = torch.compile(net)  # not run: only the wrapper's names matter here
    state = ts.state_dict(compiled)
    plain = ts.state_dict(net)
    assert list(state) == ["_orig_mod." + k for k in plain]
    # torch's own state dict of the wrapper carries the same prefix
    assert set(state) <= set(compiled.state_dict())

    fresh = Net(seed=1)
    ts.freeze(fresh, "embed", "blocks.0")
    before = params_of(fresh)
    with pytest.raises(ValueError,
                       match=r"'_orig_mod\.blocks\.1\.weight'.*closest: 'blocks\.1\.weight'"):
        ts.load_state_dict(fresh, state)
    after = params_of(fresh)
    assert all(torch.equal(before[k], after[k]) for k in before)
    # into the wrapper of a fresh model, and with the prefix stripped into the plain one
    other = Net(seed=2)
    ts.freeze(other, "embed", "blocks.0")
    ts.load_state_dict(torch.compile(other), roundtrip(state))
    ts.load_state_dict(fresh, {k.removeprefix("_orig_mod."): v for k, v in state.items()})
    for m in (fresh, other):
        for k, v in plain.items():
            assert torch.equal(m.get_parameter(k) if "running" not in k else m.get_buffer(k), v)
        assert torch.equal(m.embed.weight, Net(seed=1 if m is fresh else 2).embed.weight)


@NEEDS_NAMED_OPTIM
def test_optimizer_of_a_compiled_wrapper_resumes_on_the_plain_model_bitwise():
    straight = Net()
    opt = ts.optim.AdamW(ts.param_groups(torch.compile(straight)), lr=0.02,
                         masks={"_orig_mod.embed.weight": rows_mask()})
    train(straight, opt, range(5))

    net = Net()
    opt1 = ts.optim.AdamW(ts.param_groups(torch.compile(net)), lr=0.02,
                          masks={"_orig_mod.embed.weight": rows_mask()})
    train(net, opt1, range(2))
    ckpt = roundtrip({"model": net.state_dict(), "optim": opt1.state_dict()})
    resumed = Net(seed=1)
    resumed.load_state_dict(ckpt["model"])
    opt2 = ts.optim.AdamW(ts.param_groups(resumed), lr=0.02)
    opt2.load_state_dict(ckpt["optim"])
    assert torch.equal(opt2.masks[resumed.embed.weight], rows_mask())
    train(resumed, opt2, range(2, 5))
    assert_same(straight, resumed, exact=True)


def test_attached_model_with_a_declaration_loads_into_a_plain_model_like_torch():
    net = Net()
    ts.mark_trainable(net, "head", "norm")  # attaches; only head and norm train
    opt = ts.optim.AdamW(net.parameters(), lr=0.05)
    train(net, opt, range(3))
    state = roundtrip(ts.state_dict(net))
    assert set(state) == {"head.weight", "head.bias", "norm.weight", "norm.bias"}
    assert list(net.state_dict()) == list(Net().state_dict())  # attaching adds no keys

    plain = Net(seed=1)  # never attached, no declaration: everything trains
    before = params_of(plain)
    with pytest.raises(ValueError, match="missing 7 key"):
        ts.load_state_dict(plain, state)
    assert all(torch.equal(before[k], v) for k, v in params_of(plain).items())
    got = ts.load_state_dict(plain, state, strict=False)
    brute = Net(seed=1)
    torch_got = brute.load_state_dict(state, strict=False)
    assert sorted(got.missing_keys) == sorted(torch_got.missing_keys)
    assert_same(plain, brute, exact=True)
    assert torch.equal(plain.head.weight, net.head.weight)
    assert all(flags(plain))
    # a deepcopy mid-training: its checkpoint holds what its flags let train (brute force)
    copied = copy.deepcopy(net)
    assert set(ts.state_dict(copied, buffers=False)) == {
        n for n, p in copied.named_parameters() if p.requires_grad} == set(state)


def test_tied_weight_checkpoint_round_trip_and_bad_entries_write_nothing():
    class Tied(Net):
        def __init__(self, seed=0):
            super().__init__(seed)
            self.head.weight = self.embed.weight  # (VOCAB, DIM) both

    net = Tied()
    ts.freeze(net, "blocks")
    opt = ts.optim.AdamW(net.parameters(), lr=0.05)
    train(net, opt, range(3))
    state = roundtrip(ts.state_dict(net))
    assert "embed.weight" in state and "head.weight" not in state
    fresh = Tied(seed=1)
    ts.freeze(fresh, "blocks")
    ts.load_state_dict(fresh, state)
    assert fresh.head.weight is fresh.embed.weight
    assert torch.equal(fresh.head.weight, net.embed.weight)
    # the full torch state dict (both paths of the tied tensor) loads too
    full = roundtrip(net.state_dict())
    other = Tied(seed=2)
    ts.load_state_dict(other, full)
    assert_same(other, net, exact=True)

    bad_cases = {
        "other path differs": {**full, "head.weight": full["head.weight"] + 1},
        "dtype": {**state, "head.bias": state["head.bias"].double()},
        "shape": {**state, "norm.weight": torch.ones(DIM + 1)},
        "unknown key": {**state, "blocks.3.weight": torch.ones(DIM, DIM)},
        "meta": roundtrip(state, map_location="meta"),
    }
    for what, bad in bad_cases.items():
        target = Tied(seed=3)
        ts.freeze(target, "blocks")
        before = {k: v.clone() for k, v in target.state_dict().items()}
        with pytest.raises(ValueError, match="Nothing was written"):
            ts.load_state_dict(target, bad)
        after = target.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before), what


# ---------------------------------------------------------------------------
# bad optimizer state on resume: a clear error, nothing changed
# ---------------------------------------------------------------------------


def trained_ts(masks=True, seed=0, **kw):
    net = Net(seed)
    opt = ts.optim.AdamW(ts.param_groups(net), lr=0.02,
                         masks={"embed.weight": rows_mask()} if masks else None, **kw)
    train(net, opt, range(2))
    return net, opt


def bad_optimizer_states():
    _, opt = trained_ts()
    sd = roundtrip(opt.state_dict())

    class Other(nn.Module):  # another model with as many parameters per group
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB + 2, DIM)
            self.blocks = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(3))
            self.norm = nn.LayerNorm(DIM)
            self.head = nn.Linear(DIM, VOCAB + 2)

    other = Other()
    other_opt = ts.optim.AdamW(ts.param_groups(other), lr=0.02)
    for p in other.parameters():
        p.grad = torch.ones_like(p)
    other_opt.step()
    one_group = roundtrip(ts.optim.AdamW(Net().parameters()).state_dict())
    return {
        "another model": (roundtrip(other_opt.state_dict()), "shape"),
        "wrong group count": (one_group, "number of parameter groups"),
        "mask of the wrong shape": ({**sd, "masks": {0: torch.ones(VOCAB + 2, DIM,
                                                                   dtype=torch.bool)}}, "shape"),
        "state mapped to meta": (roundtrip(opt.state_dict(), map_location="meta"), "meta"),
    }


@pytest.mark.parametrize("which", ["another model", "wrong group count",
                                   "mask of the wrong shape", "state mapped to meta"])
def test_bad_optimizer_state_on_resume_raises_and_changes_nothing(which):
    state, words = bad_optimizer_states()[which]
    net, opt = trained_ts(masks=True, seed=1, max_grad_norm=1.0)
    before, snap, fl = params_of(net), opt_snapshot(opt), flags(net)
    with pytest.raises((ValueError, RuntimeError, NotImplementedError)) as info:
        opt.load_state_dict(state)
    assert words in str(info.value)
    assert_opt_unchanged(opt, snap)
    assert flags(net) == fl
    # and it still steps exactly like an untouched twin
    twin, twin_opt = trained_ts(masks=True, seed=1, max_grad_norm=1.0)
    train(net, opt, range(2, 4))
    train(twin, twin_opt, range(2, 4))
    assert_same(net, twin, exact=True)
    assert not all(torch.equal(before[k], v) for k, v in params_of(net).items())


def test_resized_embedding_between_save_and_load_is_refused():
    net, opt = trained_ts()
    sd = roundtrip(opt.state_dict())
    bigger = Net(seed=1)
    bigger.embed = nn.Embedding(VOCAB + 4, DIM)  # resize_token_embeddings-style growth
    bigger.head = nn.Linear(DIM, VOCAB + 4)
    target = ts.optim.AdamW(ts.param_groups(bigger), lr=0.02)
    snap = opt_snapshot(target)
    with pytest.raises(ValueError, match=r"embed\.weight|shape"):
        target.load_state_dict(sd)
    assert_opt_unchanged(target, snap)
    # torch.optim takes it and then broadcasts or fails somewhere in step(): the check matters
    theirs = torch.optim.AdamW(ts.param_groups(bigger), lr=0.02)
    with pytest.raises(RuntimeError):
        theirs.load_state_dict(sd)
        for p in bigger.parameters():
            p.grad = torch.ones_like(p)
        theirs.step()


@NEEDS_NAMED_OPTIM
def test_state_dict_with_other_param_names_is_refused():
    def model():
        torch.manual_seed(0)
        return nn.ModuleDict({"enc": nn.Linear(4, 4), "dec": nn.Linear(4, 4)})

    m = model()
    rules = (("enc", {"lr_scale": 0.1}), ("dec", {"lr_scale": 1.0}))
    opt = ts.optim.AdamW(ts.param_groups(m, *rules, no_decay=None), lr=0.1)
    m["dec"](m["enc"](torch.randn(3, 4))).sum().backward()
    opt.step()
    saved = roundtrip(opt.state_dict())

    other = ts.optim.AdamW(ts.param_groups(m, *rules[::-1], no_decay=None), lr=0.1)
    snap = opt_snapshot(other)
    with pytest.raises(ValueError, match="enc"):
        other.load_state_dict(saved)
    assert_opt_unchanged(other, snap)




@NEEDS_NAMED_OPTIM
def test_state_dict_names_with_wrapper_prefixes_or_without_names_load_by_position():
    net, opt = trained_ts()
    saved = roundtrip(opt.state_dict())
    for g in saved["param_groups"]:  # as saved from DDP(torch.compile(model))
        g["param_names"] = ["module._orig_mod." + n for n in g["param_names"]]
    unnamed = copy.deepcopy(saved)
    for g in unnamed["param_groups"]:  # torch.optim before it saved names
        del g["param_names"]
    for sd in (saved, unnamed):
        fresh = Net(seed=1)
        resumed = ts.optim.AdamW(ts.param_groups(fresh), lr=0.02)
        resumed.load_state_dict(sd)
        for p, q in zip(net.parameters(), fresh.parameters()):
            assert torch.equal(opt.state[p]["exp_avg"], resumed.state[q]["exp_avg"])
        assert torch.equal(resumed.masks[fresh.embed.weight], rows_mask())


def test_saved_masks_that_disagree_with_the_masks_in_the_state_are_refused():
    net, opt = trained_ts()
    saved = roundtrip(opt.state_dict())
    mask = next(iter(saved["masks"].values()))
    assert saved["state"][next(iter(saved["masks"]))]["torchstruct_mask"] is mask
    for k in saved["masks"]:  # a pre-hook that moved the state but not "masks" looks like this
        saved["state"][k] = {**saved["state"][k], "torchstruct_mask": ~mask}
    target = ts.optim.AdamW(ts.param_groups(Net(seed=1)), lr=0.02)
    snap = opt_snapshot(target)
    with pytest.raises(ValueError, match="disagree"):
        target.load_state_dict(saved)
    assert_opt_unchanged(target, snap)
@pytest.mark.parametrize("pair", ["sgd->adamw", "adamw->sgd"])
def test_state_dict_of_another_optimizer_type_is_refused_at_load(pair):
    net = Net()
    src_cls, dst_cls = ((torch.optim.SGD, ts.optim.AdamW) if pair == "sgd->adamw" else
                        (torch.optim.AdamW, ts.optim.SGD))
    src = src_cls(net.parameters(), lr=0.1, **({"momentum": 0.9} if src_cls is
                                               torch.optim.SGD else {}))
    train(net, src, range(2))
    dst = dst_cls(net.parameters(), lr=0.1, **({"momentum": 0.9} if dst_cls is
                                               ts.optim.SGD else {}))
    train(net, dst, range(1))
    snap = opt_snapshot(dst)
    with pytest.raises(ValueError):
        dst.load_state_dict(roundtrip(src.state_dict()))
    assert_opt_unchanged(dst, snap)


@NEEDS_NAMED_OPTIM
def test_saved_masks_follow_a_load_state_dict_pre_hook():
    def model():
        torch.manual_seed(0)
        return nn.ModuleDict({"enc": nn.Linear(4, 4), "dec": nn.Linear(4, 4)})

    mask = torch.zeros(4, 4, dtype=torch.bool)
    mask[0] = True
    m = model()
    opt = ts.optim.AdamW(ts.param_groups(m, ("enc", {"lr_scale": 0.5}), no_decay=None), lr=0.1,
                         masks={"enc.weight": mask})
    m["dec"](m["enc"](torch.randn(3, 4))).sum().backward()
    opt.step()
    saved = roundtrip(opt.state_dict())

    def by_name(optimizer, sd):  # remap the saved state to this optimizer's layout by name
        old = {n: i for g in sd["param_groups"] for n, i in zip(g["param_names"], g["params"])}
        options = {n: {k: v for k, v in g.items() if k not in ("params", "param_names")}
                   for g in sd["param_groups"] for n in g["param_names"]}
        groups, state, masks, i = [], {}, {}, 0
        for g in optimizer.param_groups:
            ids = []
            for n in g["param_names"]:
                if old[n] in sd["state"]:
                    state[i] = sd["state"][old[n]]
                if old[n] in sd["masks"]:
                    masks[i] = sd["masks"][old[n]]
                ids.append(i)
                i += 1
            groups.append({**options[g["param_names"][0]], "params": ids,
                           "param_names": list(g["param_names"])})
        return {"state": state, "param_groups": groups, "masks": masks}

    m2 = model()
    opt2 = ts.optim.AdamW(ts.param_groups(m2, ("dec", {}), ("enc", {"lr_scale": 0.5}),
                                          no_decay=None), lr=0.1)  # the groups in another order
    opt2.register_load_state_dict_pre_hook(by_name)
    opt2.load_state_dict(saved)
    assert torch.equal(opt2.state[m2["enc"].weight]["exp_avg"],
                       opt.state[m["enc"].weight]["exp_avg"])
    assert [n for n, p in m2.named_parameters() if p in opt2.masks] == ["enc.weight"]


def test_masks_survive_distributed_checkpoint_optimizer_state_dict():
    dcp_state = pytest.importorskip("torch.distributed.checkpoint.state_dict")
    net = Net()
    opt = ts.optim.AdamW(ts.param_groups(net), lr=0.02, masks={"embed.weight": rows_mask()})
    train(net, opt, range(2))
    saved = roundtrip(dcp_state.get_optimizer_state_dict(net, opt))
    resumed = Net(seed=1)
    resumed.load_state_dict(net.state_dict())
    opt2 = ts.optim.AdamW(ts.param_groups(resumed), lr=0.02)  # no masks=, as after load
    dcp_state.set_optimizer_state_dict(resumed, opt2, saved)
    train(resumed, opt2, range(2, 4))
    start = Net()
    assert torch.equal(resumed.embed.weight[~rows_mask()], start.embed.weight[~rows_mask()])


def test_step_refused_inside_gradscaler_step_leaves_no_stale_scale():
    def setup():
        net = Net()
        opt = ts.optim.AdamW(net.parameters(), lr=0.02)
        train(net, opt, range(2))
        return net, opt

    net, opt = setup()
    good = roundtrip(opt.state_dict())
    bad = roundtrip(opt.state_dict())
    bad["param_groups"][0]["lr"] = -0.02  # e.g. a corrupted checkpoint
    opt.load_state_dict(bad)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    opt.zero_grad()
    scaler.scale(loss_of(net, 2)).backward()
    with pytest.raises(ValueError, match="lr must be >= 0"):
        scaler.step(opt)
    opt.load_state_dict(good)  # fixed: retry the step
    scaler.step(opt)
    scaler.update()

    twin, twin_opt = setup()
    twin_opt.load_state_dict(roundtrip(twin_opt.state_dict()))
    twin_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    twin_opt.zero_grad()
    twin_scaler.scale(loss_of(twin, 2)).backward()
    twin_scaler.step(twin_opt)
    twin_scaler.update()
    assert_same(net, twin, exact=True)


# ---------------------------------------------------------------------------
# Lightning and the HF convention
# ---------------------------------------------------------------------------


def test_lightning_ckpt_path_resume_with_lr_scale_groups_mask_and_step_scheduler(tmp_path):
    L = pytest.importorskip("lightning.pytorch")
    PER_EPOCH = 3

    class Module(L.LightningModule):
        def __init__(self, masks):
            super().__init__()
            self.net = Net()
            self.masks = masks
            ts.freeze(self.net, "blocks.0")

        def training_step(self, batch, _idx):
            return loss_of(self.net, self.current_epoch * PER_EPOCH + int(batch[0]))

        def configure_optimizers(self):
            groups = ts.param_groups(self, *ts.layer_decay(self, 0.5, layers="net.blocks"))
            opt = ts.optim.AdamW(groups, lr=0.05, weight_decay=0.1, max_grad_norm=1.0,
                                 masks={"net.embed.weight": rows_mask()} if self.masks else None)
            sched = lrs.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def fit(module, epochs, root, ckpt_path=None):
        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(torch.arange(PER_EPOCH)), batch_size=1)
        ckpt = L.callbacks.ModelCheckpoint(dirpath=root / "ckpt", save_last=True, save_top_k=-1)
        trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False,
                            enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=root, callbacks=[ckpt])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, loader, ckpt_path=ckpt_path)
        return trainer

    straight = Module(masks=True)
    done = fit(straight, 3, tmp_path / "a")
    fit(Module(masks=True), 2, tmp_path / "b")
    resumed = Module(masks=False)  # the mask comes back from the checkpoint
    again = fit(resumed, 3, tmp_path / "c", ckpt_path=tmp_path / "b" / "ckpt" / "last.ckpt")
    opt = again.optimizers[0]
    assert torch.equal(opt.masks[resumed.net.embed.weight], rows_mask())
    assert again.lr_scheduler_configs[0].scheduler.last_epoch == 3 * PER_EPOCH
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in done.optimizers[0].param_groups]
    assert_same(straight, resumed, exact=True)
    assert_states(straight.net, done.optimizers[0], resumed.net, opt, exact=True)
    start = Net()
    assert torch.equal(resumed.net.embed.weight[~rows_mask()], start.embed.weight[~rows_mask()])
    assert torch.equal(resumed.net.blocks[0].weight, start.blocks[0].weight)


def test_hf_style_decay_groups_on_torch_adamw_continue_on_ts_param_groups(monkeypatch):
    """An HF script's AdamW (two groups from Trainer.get_decay_parameter_names) is resumed on
    ts.optim.AdamW(ts.param_groups(model, weight_decay=...)): the groups coincide, so the saved
    state loads and the run continues like the plain script."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")

    def bert():
        torch.manual_seed(0)
        config = transformers.BertConfig(
            vocab_size=30, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=16, max_position_embeddings=8, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, num_labels=2)
        return transformers.BertForSequenceClassification(config)

    def hf_groups(model):
        decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
        return [
            {"params": [p for n, p in model.named_parameters() if n in decay],
             "weight_decay": 0.01},
            {"params": [p for n, p in model.named_parameters() if n not in decay],
             "weight_decay": 0.0},
        ]

    def step(model, opt, i):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, 30, (4, 6), generator=g)
        labels = torch.randint(0, 2, (4,), generator=g)
        opt.zero_grad()
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()

    straight = bert()
    ref = torch.optim.AdamW(hf_groups(straight), lr=1e-2, foreach=False)
    for i in range(5):
        step(straight, ref, i)

    net = bert()
    opt = torch.optim.AdamW(hf_groups(net), lr=1e-2, foreach=False)
    for i in range(2):
        step(net, opt, i)
    ckpt = roundtrip({"model": net.state_dict(), "optim": opt.state_dict()})
    resumed = bert()
    resumed.load_state_dict(ckpt["model"])
    groups = ts.param_groups(resumed, weight_decay=0.01)
    assert [set(map(id, g["params"])) for g in groups] == [
        set(map(id, g["params"])) for g in hf_groups(resumed)]
    opt2 = ts.optim.AdamW(groups, lr=1e-2)
    opt2.load_state_dict(ckpt["optim"])
    for i in range(2, 5):
        step(resumed, opt2, i)
    for (path, p), q in zip(straight.named_parameters(), resumed.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=path)
