"""Differential fuzzing of ``ts.optim.SGD`` / ``ts.optim.AdamW`` against ``torch.optim``
(foreach=False), on every backend.

The oracle is a torch optimizer over twin parameters (same values, dtype and strides) run
over the whole trajectory. What ts adds on top of torch is replayed on the torch side by
brute force:

* frozen parameters / ``lr_scale == 0`` groups / parameters outside the optimizer: their torch
  twin gets ``grad = None`` for that step (torch then skips it, as ts must);
* ``lr_scale``: the torch group steps with ``lr * lr_scale`` (lr patched around the step);
* element masks: after each torch step, every masked-out element of the parameter *and of each
  per-element state tensor* is put back to its pre-step value (zero where the state did not
  exist before -- torch starts moments and, per docs/optimizers.md, ts starts a masked SGD
  momentum buffer, at zero).  Updates are elementwise, so this per-element replay is the exact
  expected trajectory, also when masks change between steps;
* ``max_grad_norm``: ``torch.nn.utils.clip_grad_norm_`` on the gradients of the parameters
  the step updates (tied once), then the step;
* ``grad_scale`` / ``found_inf``: the torch twin gets ``grad * float32(1/scale)`` (what
  ``GradScaler.unscale_`` computes) and skips the step when ``found_inf`` is set.
"""
from __future__ import annotations

import copy
import math
import os
import pickle
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn

import torchstruct as ts

# TS_FUZZ_EXAMPLES=500 for a longer hunt
FUZZ = settings(max_examples=int(os.environ.get("TS_FUZZ_EXAMPLES", "25")), deadline=None, derandomize=False,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow, HealthCheck.data_too_large])

INT_OF = {torch.float32: torch.int32, torch.float64: torch.int64,
          torch.float16: torch.int16, torch.bfloat16: torch.int16}

RTOL = {torch.float32: 1e-6, torch.float64: 1e-12}


# -- helpers -------------------------------------------------------------------------------

def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (tells -0.0 from 0.0 and compares NaN payloads)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    ia = a.detach().contiguous().reshape(-1).view(INT_OF[a.dtype])
    ib = b.detach().contiguous().reshape(-1).view(INT_OF[b.dtype])
    return torch.equal(ia, ib)


def twin(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with the same strides."""
    out = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype)
    out.copy_(t.detach())
    return out


def make_value(layout: str, dtype, gen) -> torch.Tensor:
    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)
    if layout == "contig":
        t = rnd(3, 4)
    elif layout == "vector":
        t = rnd(7)
    elif layout == "transposed":
        t = rnd(4, 3).t()
    elif layout == "permuted":
        t = rnd(2, 3, 4).permute(2, 0, 1)
    elif layout == "channels_last":
        t = rnd(2, 3, 2, 2).contiguous(memory_format=torch.channels_last)
    elif layout == "scalar":
        t = rnd(())
    elif layout == "empty":
        t = rnd(0, 3)
    else:
        raise AssertionError(layout)
    return t.to(dtype)  # keeps the strides


LAYOUTS = ["contig", "vector", "transposed", "permuted", "channels_last", "scalar", "empty"]


def rand_grad(p: torch.Tensor, gen, mag: float, like_param: bool) -> torch.Tensor:
    v = (torch.randn(p.shape, generator=gen, dtype=torch.float64) * mag).to(p.dtype)
    return twin_into(p, v) if like_param else v.contiguous()


def twin_into(p, v):
    out = torch.empty_strided(p.size(), p.stride(), dtype=p.dtype)
    out.copy_(v)
    return out


def rand_mask(p: torch.Tensor, gen, density: float, like_param: bool) -> torch.Tensor:
    m = torch.rand(p.shape, generator=gen, dtype=torch.float64) < density
    if like_param:
        out = torch.empty_strided(p.size(), p.stride(), dtype=torch.bool)
        out.copy_(m)
        return out
    return m


class NoopMode(torch.overrides.TorchFunctionMode):
    """An active torch function mode: ts takes its checked (Python) plan instead of C++."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def sgd_group_options():
    @st.composite
    def draw(d):
        momentum = d(st.sampled_from([0.0, 0.5, 0.9]))
        nesterov = momentum > 0 and d(st.booleans())
        dampening = 0.0 if nesterov else d(st.sampled_from([0.0, 0.1, 0.5]))
        opts = dict(lr=d(st.sampled_from([1e-3, 0.01, 0.1, 0.3])), momentum=momentum,
                    dampening=dampening, nesterov=nesterov,
                    weight_decay=d(st.sampled_from([0.0, 1e-2, 0.3])),
                    maximize=d(st.booleans()))
        scale = d(st.sampled_from([None, 1.0, 0.5, 0.0, 3.0]))
        if scale is not None:
            opts["lr_scale"] = scale
        return opts
    return draw()


def adamw_group_options():
    @st.composite
    def draw(d):
        opts = dict(lr=d(st.sampled_from([1e-3, 0.01, 0.1])),
                    betas=(d(st.sampled_from([0.0, 0.5, 0.9])),
                           d(st.sampled_from([0.0, 0.9, 0.999]))),
                    eps=d(st.sampled_from([1e-8, 1e-6, 1e-3])),
                    weight_decay=d(st.sampled_from([0.0, 1e-2, 0.5])),
                    amsgrad=d(st.booleans()), maximize=d(st.booleans()))
        scale = d(st.sampled_from([None, 1.0, 0.5, 0.0, 3.0]))
        if scale is not None:
            opts["lr_scale"] = scale
        return opts
    return draw()


CLASSES = {"SGD": (ts.optim.SGD, torch.optim.SGD, sgd_group_options),
           "AdamW": (ts.optim.AdamW, torch.optim.AdamW, adamw_group_options)}


# -- the differential harness ---------------------------------------------------------------

class Pair:
    """A ts optimizer over ``ps`` and a torch optimizer over twins ``qs`` (the oracle)."""

    def __init__(self, name, ps, group_idx, group_opts, masks, max_grad_norm, norm_type,
                 oracle_kwargs=None, tol=None, backend=None, emulate=False):
        self.name = name
        # emulate: the torch side runs in float32 on the float16/bfloat16 values, every
        # parameter and state value rounded back to the parameter's dtype after each step --
        # ts's documented arithmetic for float16/bfloat16 ("computed in float32 from the stored
        # values and rounded once to the parameter's dtype; state kept in its dtype")
        self.emulate = emulate
        self.backend = backend
        self.used_scale = False
        self.ts_cls, self.torch_cls, _ = CLASSES[name]
        self.ps = ps
        self.qs = [nn.Parameter(twin(p).float() if emulate else twin(p), requires_grad=True)
                   for p in ps]
        self.max_grad_norm = max_grad_norm
        self.norm_type = norm_type
        self.oracle_kwargs = oracle_kwargs if oracle_kwargs is not None else {"foreach": False}
        self.tol = tol
        self.opt = self.ts_cls([dict(opts, params=[ps[i] for i in idx])
                                for idx, opts in zip(group_idx, group_opts)],
                               masks={ps[i]: m for i, m in masks.items()},
                               max_grad_norm=max_grad_norm, norm_type=norm_type)
        self.ref = self.torch_cls([dict(opts, params=[self.qs[i] for i in idx])
                                   for idx, opts in zip(group_idx, group_opts)],
                                  **self.oracle_kwargs)
        self.ever_stepped = set()
        self.mag, self.peak, self.last = {}, {}, {}
        self.track()
        self.sched = None
        self.sched_kind = None

    def index(self, p):
        for i, q in enumerate(self.ps):
            if q is p:
                return i
        raise AssertionError("not one of ours")

    def add_group(self, idx, opts):
        self.opt.add_param_group(dict(opts, params=[self.ps[i] for i in idx]))
        self.ref.add_param_group(dict(opts, params=[self.qs[i] for i in idx]))
        if self.sched is not None:  # torch's schedulers do not follow add_param_group
            self.set_scheduler(self.sched_kind)

    def set_scheduler(self, kind):
        self.sched_kind = kind
        if kind == "step":
            self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=1, gamma=0.7)
        elif kind == "lambda":
            self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda e: 1.0 / (1 + e))
        else:
            self.sched = None

    def scheduler_step(self):
        if self.sched is not None:
            scales = [g.get("lr_scale") for g in self.opt.param_groups]
            self.sched.step()
            assert [g.get("lr_scale") for g in self.opt.param_groups] == scales

    def relayout(self, i):
        """``p.data`` = the same values in another memory layout, on both sides (as
        ``model.to(memory_format=...)`` does); ts converts the state at the next step."""
        p = self.ps[i]
        if p.dim() < 2:
            return
        if p.dim() == 4 and p.is_contiguous():
            new = p.detach().contiguous(memory_format=torch.channels_last)
        elif p.is_contiguous():
            new = p.detach().transpose(0, 1).contiguous().transpose(0, 1)
        else:
            new = p.detach().contiguous()
        with torch.no_grad():
            p.data = twin(new)
            self.qs[i].data = twin(new).to(self.qs[i].dtype)

    def roundtrip(self, source):
        """Continue with a fresh ts optimizer loaded from a state dict: our own (masks must
        travel in it) or the torch oracle's (masks given again)."""
        old = self.opt
        groups = [dict({k: v for k, v in g.items() if k != "params"}, params=list(g["params"]))
                  for g in old.param_groups]
        if source == "own":
            saved = copy.deepcopy(old.state_dict())
            new = self.ts_cls(groups, max_grad_norm=self.max_grad_norm,
                              norm_type=self.norm_type)
            new.load_state_dict(saved)
            assert set(map(id, new.masks)) == set(map(id, old.masks))
            for p, m in old.masks.items():
                assert torch.equal(new.masks[p], m)
        elif source == "pickle":
            # the optimizer pickled together with its parameters, like a checkpointed module
            blob = pickle.dumps((self.ps, old))
            ps, new = pickle.loads(blob)
            self.ps = ps
            assert new.max_grad_norm == self.max_grad_norm and new.norm_type == self.norm_type
            assert len(new.masks) == len(old.masks)
        else:
            saved = copy.deepcopy(self.ref.state_dict())
            new = self.ts_cls(groups, masks=dict(old.masks), max_grad_norm=self.max_grad_norm,
                              norm_type=self.norm_type)
            new.load_state_dict(saved)
        self.opt = new
        if self.sched is not None:
            sd = self.sched.state_dict()
            self.set_scheduler(self.sched_kind)
            self.sched.load_state_dict(sd)

    # ---------------------------------------------------------------------------------------

    def stepped(self):
        """Indices of the parameters a step must update (the spec: requires_grad, a grad, a
        group with lr_scale != 0; a tensor listed twice once)."""
        out, seen = [], set()
        for g in self.opt.param_groups:
            if g.get("lr_scale", 1.0) == 0:
                continue
            for p in g["params"]:
                if p.requires_grad and p.grad is not None and id(p) not in seen:
                    seen.add(id(p))
                    out.append(self.index(p))
        return out

    def step(self, grads, amp=None, mode=False):
        """One step on both sides, then every check. ``grads``: per parameter the raw
        ``.grad`` (None for none). ``amp``: None or (scale, found_inf)."""
        ps, qs, opt, ref = self.ps, self.qs, self.opt, self.ref
        for p, g in zip(ps, grads):
            p.grad = None if g is None else g.clone()
        grads_before = [None if p.grad is None else twin(p.grad) for p in ps]
        stepped = self.stepped()
        before_p = [twin(p) for p in ps]
        before_state = {i: {k: (v.clone() if torch.is_tensor(v) else v)
                            for k, v in opt.state[p].items()}
                        for i, p in enumerate(ps) if p in opt.state}
        masks_now = {self.index(p): m for p, m in opt.masks.items()}
        skipped = amp is not None and amp[1]

        # ---- the oracle
        inv = None
        if amp is not None:
            inv = torch.tensor(amp[0], dtype=torch.float32).double().reciprocal().float()
        for i, q in enumerate(qs):
            if i in stepped:
                g = grads[i].clone().to(q.dtype)
                q.grad = g if inv is None else g * inv.to(g.dtype)
            else:
                q.grad = None
        ref_before_p = [twin(q) for q in qs]
        ref_before_state = {i: {k: v.clone() for k, v in ref.state[q].items()}
                            for i, q in enumerate(qs) if q in ref.state}
        total = None
        if self.max_grad_norm is not None:
            # a zero-size gradient contributes nothing (torch refuses its inf-norm; documented)
            counted = [qs[i] for i in stepped if qs[i].numel()]
            if counted:
                total = torch.nn.utils.clip_grad_norm_(counted,
                                                       self.max_grad_norm, self.norm_type,
                                                       foreach=False)
            else:
                total = torch.zeros(())
        if not skipped:
            saved_lr = [g["lr"] for g in ref.param_groups]
            for rg, og in zip(ref.param_groups, opt.param_groups):
                for k, v in og.items():  # mirror every option ts steps with
                    if k not in ("params", "lr", "initial_lr", "foreach", "fused",
                                 "capturable", "differentiable", "decoupled_weight_decay",
                                 "param_names"):
                        rg[k] = v
                rg["lr"] = float(og["lr"]) * float(og.get("lr_scale", 1.0))
            ref.step()
            for i in stepped:
                self.terms(i)
            for rg, og, lr in zip(ref.param_groups, opt.param_groups, saved_lr):
                rg["lr"] = og["lr"]
            with torch.no_grad():
                for i in stepped:
                    m = masks_now.get(i)
                    if m is None:
                        continue
                    qs[i].copy_(torch.where(m, qs[i], ref_before_p[i]))
                    for k, v in ref.state[qs[i]].items():
                        if k == "step":
                            continue
                        old = ref_before_state.get(i, {}).get(k)
                        if old is None:
                            old = torch.zeros_like(v)
                        v.copy_(torch.where(m, v, old))
                if self.emulate:
                    for i in stepped:
                        qs[i].copy_(qs[i].to(ps[i].dtype).float())
                        for k, v in ref.state[qs[i]].items():
                            if k != "step":
                                v.copy_(v.to(ps[i].dtype).float())

        # ---- ts
        if amp is not None:
            self.used_scale = True
            opt.grad_scale = torch.tensor(amp[0], dtype=torch.float32)
            opt.found_inf = torch.tensor(1.0 if amp[1] else 0.0)
        try:
            if mode:
                with NoopMode():
                    opt.step()
            else:
                opt.step()
        finally:
            opt.__dict__.pop("grad_scale", None)
            opt.__dict__.pop("found_inf", None)
        if not skipped:
            self.ever_stepped.update(stepped)

        # ---- checks
        for i, p in enumerate(ps):  # gradients are read, never written
            if grads_before[i] is not None:
                assert bits_equal(p.grad, grads_before[i]), f"grad of param {i} was written"
        for i, p in enumerate(ps):
            state = opt.state.get(p)
            if i not in stepped or skipped:  # not touched at all: bitwise, state included
                assert bits_equal(p, before_p[i]), f"param {i} (not stepped) moved"
                if i in before_state:
                    assert set(state) == set(before_state[i])
                    for k, v in before_state[i].items():
                        assert bits_equal(state[k], v), f"state {k} of param {i} moved"
                else:
                    assert p not in opt.state, f"param {i} (not stepped) got state"
            if i not in self.ever_stepped:
                assert p not in opt.state, f"param {i}, never stepped, has state"
            m = masks_now.get(i)
            if m is not None and i in stepped and not skipped:
                keep = ~m
                assert bits_equal(p[keep], before_p[i][keep]), f"masked-out param {i} moved"
                for k, v in (state or {}).items():
                    if k == "step":
                        continue
                    old = before_state.get(i, {}).get(k)
                    if old is None:
                        assert bool((v[keep] == 0).all()), f"new state {k} of {i} not 0"
                    else:
                        assert bits_equal(v[keep], old[keep]), f"masked-out {k} of {i} moved"
        self.compare()
        if self.max_grad_norm is not None:
            assert opt.last_grad_norm is not None
            torch.testing.assert_close(opt.last_grad_norm.double(), total.double(),
                                       rtol=1e-6, atol=1e-12)

    def track(self):
        """Per element: ``peak``, the running max of |value|, and ``mag``, the sum of its
        changes and of the magnitudes of the terms each update combined (``terms``). Two
        implementations that round differently (one ulp of a gradient, of ``g + wd * p``)
        differ by rtol * these, also where the terms cancel to almost nothing."""
        for i, q in enumerate(self.qs):
            vals = {"param": q.detach()}
            vals.update({k: v for k, v in (self.ref.state.get(q) or {}).items() if k != "step"})
            for k, v in vals.items():
                v = v.double()
                old = self.last.get((i, k))
                peak = self.peak.get((i, k))
                self.peak[(i, k)] = v.abs() if peak is None else torch.maximum(peak, v.abs())
                if old is not None:
                    self.mag[(i, k)] = self.mag.get((i, k), 0) + (v - old).abs()
                self.last[(i, k)] = v.clone()

    def terms(self, i):
        """Add the magnitudes of the terms of param ``i``'s last torch update to ``mag``."""
        q = self.qs[i]
        group = next(g for g in self.ref.param_groups if any(x is q for x in g["params"]))
        lr, wd = float(group["lr"]), float(group["weight_decay"])
        g = q.grad.detach().double().abs()
        p = q.detach().double().abs()
        state = self.ref.state.get(q) or {}
        mag = self.mag

        def add(key, t):
            mag[(i, key)] = mag.get((i, key), 0) + t

        if self.name == "SGD":
            t = g + wd * p
            mom = float(group["momentum"])
            if mom:
                add("momentum_buffer", t)
                buf = mag[(i, "momentum_buffer")] + state["momentum_buffer"].double().abs()
                add("param", lr * (t + buf))
            else:
                add("param", lr * t)
        else:
            beta1, beta2 = group["betas"]
            step = float(state["step"])
            bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step
            add("exp_avg", g)
            add("exp_avg_sq", g * g)
            if "max_exp_avg_sq" in state:
                add("max_exp_avg_sq", g * g)
            v = state.get("max_exp_avg_sq", state["exp_avg_sq"]).double()
            m = mag[(i, "exp_avg")] + state["exp_avg"].double().abs()
            add("param", lr * (m / bc1) / ((v / bc2).sqrt() + float(group["eps"])) + lr * wd * p)

    def bound(self, i, key):
        return self.peak[(i, key)] + self.mag.get((i, key), 0)

    def rtol(self, p):
        if self.tol is not None:
            return self.tol
        if self.emulate:
            # SGD's float32 arithmetic is torch's to the bit, so is its one rounding; AdamW's
            # float32 may differ in the last bit (sqrt), which can flip one rounding
            # (with max_grad_norm the norm's float32 rounding may differ too)
            exact = self.name == "SGD" and self.max_grad_norm is None
            return 0.0 if exact else torch.finfo(p.dtype).eps
        if p.dtype == torch.float64 and self.max_grad_norm is not None and any(
                x.dtype == torch.float32 for x in self.ps):
            # the global norm of fp32 and fp64 gradients holds the fp32 part's rounding
            # (torch's and ts's fp32 partial norms differ in the last fp32 bits)
            return 1e-6
        if p.dtype == torch.float64 and self.backend == "fallback" and (
                self.max_grad_norm is not None or self.used_scale):
            # the fallback hands torch's fused ops the clip coefficient and grad scale as ONE
            # float32 divisor (grad_scale / clip_coef): an fp64 update carries fp32 rounding
            # there (documented: "same results within rounding")
            return 1e-6
        return RTOL[p.dtype]

    def compare(self):
        opt, ref = self.opt, self.ref
        self.track()
        for i, (p, q) in enumerate(zip(self.ps, self.qs)):
            rtol = self.rtol(p)
            assert p.stride() == q.stride() or p.numel() <= 1, (i, p.stride(), q.stride())
            assert_near(p.detach(), q.detach().to(p.dtype), self.bound(i, "param"), rtol, f"param {i}")
            rs = ref.state.get(q) or {}
            os_ = opt.state.get(p) or {}
            assert set(os_) == set(rs), (i, sorted(os_), sorted(rs))
            for k, v in rs.items():
                w = os_[k]
                if k == "step":
                    assert float(w) == float(v), (i, float(w), float(v))
                else:
                    assert w.dtype == p.dtype and w.shape == p.shape
                    assert_near(w, v.to(p.dtype), self.bound(i, k), rtol, f"state {k} of param {i}")


def assert_near(actual, expected, mag, rtol, what):
    """|actual - expected| <= rtol * (|expected| + mag) elementwise (mag: the running
    magnitude of the value and its updates)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    a, e = actual.detach().double(), expected.detach().double()
    bound = rtol * (e.abs() + mag) + 1e-30
    # the same value (an overflow to the same infinity included, where a - e is NaN), or
    # NaN where torch has NaN
    bad = ~((a == e) | ((a - e).abs() <= bound) | (a.isnan() & e.isnan()))
    if bad.any():
        k = int(bad.reshape(-1).nonzero()[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {a.numel()} elements off; first at flat index {k}: "
            f"ts {a.reshape(-1)[k].item()!r} vs torch {e.reshape(-1)[k].item()!r} "
            f"(magnitude {mag.reshape(-1)[k].item()!r}, rtol {rtol})")


# -- the scenarios ---------------------------------------------------------------------------

@st.composite
def scenario(draw, name, dtypes=(torch.float32, torch.float64), layouts=LAYOUTS):
    _, _, opt_strategy = CLASSES[name]
    opt_strategy = opt_strategy()
    n = draw(st.integers(1, 5))
    specs = [(draw(st.sampled_from(layouts)), draw(st.sampled_from(dtypes))) for _ in range(n)]
    n_groups = draw(st.integers(1, 3))
    assign = [draw(st.integers(0, n_groups - 1)) for _ in range(n)]
    late = draw(st.booleans()) and n >= 2  # the last group is added later
    groups = [[i for i in range(n) if assign[i] == k] for k in range(n_groups)]
    groups = [g for g in groups if g]
    if late and len(groups) < 2:
        late = False
    opts = [draw(opt_strategy) for _ in groups]
    n_steps = draw(st.integers(1, 5))
    return dict(
        seed=draw(st.integers(0, 2**31 - 1)),
        specs=specs, groups=groups, opts=opts, late=late,
        late_at=draw(st.integers(0, n_steps - 1)),
        masks={i: (draw(st.sampled_from([0.0, 0.5, 1.0])), draw(st.booleans()))
               for i in range(n) if draw(st.booleans())},
        max_grad_norm=draw(st.sampled_from([None, None, 0.05, 1.0, 100.0])),
        norm_type=draw(st.sampled_from([2.0, 1.0, math.inf, 0.5, 3.0])),
        scheduler=draw(st.sampled_from([None, "step", "lambda"])),
        steps=[dict(frozen={i for i in range(n) if draw(st.integers(0, 4)) == 0},
                    none={i for i in range(n) if draw(st.integers(0, 5)) == 0},
                    mag=draw(st.sampled_from([1e-3, 1.0, 50.0])),
                    grad_like_param=draw(st.booleans()),
                    amp=draw(st.sampled_from([None, None, (1024.0, False), (3.0, False),
                                              (65536.0, True)])),
                    mode=draw(st.booleans()),
                    remask=draw(st.sampled_from([None, None, None, "set", "clear"])),
                    remask_which=draw(st.integers(0, n - 1)),
                    relayout=draw(st.sampled_from([None, None, None] + list(range(n)))),
                    regroup=draw(st.sampled_from(
                        [None, None, None, ("lr_scale", 0.0), ("lr_scale", 1.0),
                         ("lr_scale", 0.25), ("weight_decay", 0.0), ("weight_decay", 0.1),
                         ("maximize", True), ("lr", 0.05)])),
                    regroup_which=draw(st.integers(0, 2)))
               for _ in range(n_steps)],
        roundtrip_at=draw(st.sampled_from([None, 0, 1, 2, 3])),
        roundtrip_source=draw(st.sampled_from(["own", "torch", "pickle"])),
    )


def run_scenario(name, sc, oracle_kwargs=None, tol=None, backend=None, emulate=False):
    gen = torch.Generator().manual_seed(sc["seed"])
    ps = [nn.Parameter(make_value(layout, dtype, gen)) for layout, dtype in sc["specs"]]
    groups, opts = sc["groups"], sc["opts"]
    first = groups[:-1] if sc["late"] else groups
    first_opts = opts[:-1] if sc["late"] else opts
    masks = {i: rand_mask(ps[i], gen, dens, like) for i, (dens, like) in sc["masks"].items()
             if any(i in g for g in first)}
    pair = Pair(name, ps, first, first_opts, masks, sc["max_grad_norm"], sc["norm_type"],
                oracle_kwargs=oracle_kwargs, tol=tol, backend=backend, emulate=emulate)
    pair.set_scheduler(sc["scheduler"])
    for k, st_ in enumerate(sc["steps"]):
        if sc["late"] and k == sc["late_at"]:
            pair.add_group(groups[-1], opts[-1])
        if sc["roundtrip_at"] == k:
            pair.roundtrip(sc["roundtrip_source"])
            ps = pair.ps
        members = {id(p) for g in pair.opt.param_groups for p in g["params"]}
        j = st_["remask_which"]
        if st_["remask"] == "set" and id(ps[j]) in members:
            pair.opt.set_mask(ps[j], rand_mask(ps[j], gen, 0.5, False))
        elif st_["remask"] == "clear" and id(ps[j]) in members:  # (a non-member is refused)
            pair.opt.set_mask(ps[j], None)
        if st_["regroup"] is not None:  # a group option rewritten between steps
            key, value = st_["regroup"]
            g = pair.opt.param_groups[st_["regroup_which"] % len(pair.opt.param_groups)]
            g[key] = value
        if st_["relayout"] is not None:  # the parameter's memory layout changes under its state
            pair.relayout(st_["relayout"])
        for i, p in enumerate(ps):
            p.requires_grad_(i not in st_["frozen"])
        grads = [None if i in st_["none"] else
                 rand_grad(p, gen, st_["mag"], st_["grad_like_param"])
                 for i, p in enumerate(ps)]
        pair.step(grads, amp=st_["amp"], mode=st_["mode"])
        pair.scheduler_step()
    return pair


@pytest.mark.parametrize("name", ["SGD", "AdamW"])
@FUZZ
@given(data=st.data())
def test_fuzz_against_torch(backend, name, data):
    sc = data.draw(scenario(name))
    run_scenario(name, sc, backend=backend)


@pytest.mark.parametrize("name", ["SGD", "AdamW"])
@FUZZ
@given(data=st.data())
def test_fuzz_low_precision(backend, name, data):
    """float16 / bfloat16 parameters (state in their dtype): each step in float32 from the
    stored values, rounded once, checked to one unit in the last place of the dtype."""
    sc = data.draw(scenario(name, dtypes=(torch.bfloat16, torch.float16)))
    run_scenario(name, sc, backend=backend, emulate=True)


@FUZZ
@given(data=st.data())
def test_fuzz_sgd_bitwise(backend, data):
    """docs/optimizers.md: "SGD: bitwise on CPU" (without the clip, whose norm rounds its own
    way). The fallback (torch's fused SGD, which divides by the grad scale) is held to the
    contract's 1e-6 instead."""
    sc = data.draw(scenario("SGD"))
    sc["max_grad_norm"] = None
    run_scenario("SGD", sc, backend=backend, tol=None if backend == "fallback" else 0.0)


# -- GradScaler end to end ---------------------------------------------------------------

@pytest.mark.parametrize("name", ["SGD", "AdamW"])
@FUZZ
@given(data=st.data())
def test_fuzz_grad_scaler(backend, name, data):
    """``torch.amp.GradScaler("cpu")`` driving ts (grad_scale / found_inf handed to the step;
    optionally ``unscale_`` first) against the same scaler driving torch (unscale_, clip,
    step), with overflows injected at random steps: same parameters, state and scale."""
    ts_cls, torch_cls, opt_strategy = CLASSES[name]
    opts = data.draw(opt_strategy())
    opts.pop("lr_scale", None)
    max_grad_norm = data.draw(st.sampled_from([None, 0.1, 10.0]))
    unscale_first = data.draw(st.booleans())
    infs = data.draw(st.lists(st.sampled_from([None, None, math.inf, -math.inf, math.nan]),
                              min_size=1, max_size=6))
    torch.manual_seed(data.draw(st.integers(0, 2**16)))
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    twin_model = copy.deepcopy(model)
    ours = ts_cls(model.parameters(), max_grad_norm=max_grad_norm, **opts)
    theirs = torch_cls(twin_model.parameters(), foreach=False, **opts)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=2)
               for _ in range(2)]
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    scalers[1].scale(torch.ones(()))  # its scale is made lazily, by scale()
    for bad in infs:
        # one backward (ours); the twin gets copies of the same scaled gradients, so that
        # rounding differences do not feed back through the forward pass
        ours.zero_grad()
        scalers[0].scale(nn.functional.mse_loss(model(x), y)).backward()
        if bad is not None:
            model[2].weight.grad[1, 3] = bad
        for p, q in zip(model.parameters(), twin_model.parameters()):
            q.grad = p.grad.clone()
        for net, opt, scaler in ((model, ours, scalers[0]), (twin_model, theirs, scalers[1])):
            if opt is ours:
                grads = [p.grad.clone() for p in net.parameters()]
                if unscale_first:
                    scaler.unscale_(opt)
                scaler.step(opt)
                if not unscale_first:  # the scaled gradients are read, never written
                    assert all(bits_equal(p.grad, g) for p, g in zip(net.parameters(), grads))
            else:
                scaler.unscale_(opt)
                if max_grad_norm is not None:
                    total = torch.nn.utils.clip_grad_norm_(net.parameters(), max_grad_norm,
                                                           foreach=False)
                scaler.step(opt)
            scaler.update()
        assert scalers[0].get_scale() == scalers[1].get_scale()
        if max_grad_norm is not None and bad is None:
            torch.testing.assert_close(ours.last_grad_norm.float(), total.float(),
                                       rtol=1e-6, atol=0)
        for p, q in zip(model.parameters(), twin_model.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
            sp, sq = ours.state.get(p) or {}, theirs.state.get(q) or {}
            assert set(sp) == set(sq)
            for k in sq:
                if k == "step":
                    assert float(sp[k]) == float(sq[k])
                else:
                    torch.testing.assert_close(sp[k], sq[k], rtol=1e-6, atol=1e-6)


# -- a parameter listed twice, in two groups, tied in a model ------------------------------

@pytest.mark.parametrize("name", ["SGD", "AdamW"])
@FUZZ
@given(data=st.data())
def test_fuzz_repeated_and_tied_parameters(backend, name, data):
    """A parameter listed twice in one group is stepped once (documented; torch steps it
    twice) and counted once in the max_grad_norm norm; in two groups it is refused, as torch
    refuses it, at construction and in add_param_group (nothing added)."""
    ts_cls, torch_cls, opt_strategy = CLASSES[name]
    opts = data.draw(opt_strategy())
    opts["lr_scale"] = data.draw(st.sampled_from([1.0, 0.5]))
    max_grad_norm = data.draw(st.sampled_from([None, 0.1, 10.0]))
    masked = data.draw(st.booleans())
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    p = nn.Parameter(make_value(data.draw(st.sampled_from(LAYOUTS)), torch.float32, gen))
    q = nn.Parameter(make_value("contig", torch.float32, gen))
    p2, q2 = nn.Parameter(twin(p)), nn.Parameter(twin(q))
    with pytest.raises(ValueError, match="more than one parameter group"):
        ts_cls([dict(opts, params=[p]), dict(opts, params=[p, q])])
    with pytest.raises(ValueError, match="more than one parameter group"):
        torch_cls([{"params": [p2]}, {"params": [p2, q2]}], foreach=False)
    mask = rand_mask(p, gen, 0.5, False)
    with pytest.warns(UserWarning, match="duplicate parameters"):
        ours = ts_cls([dict(opts, params=[p, q, p])], max_grad_norm=max_grad_norm,
                      masks={p: mask} if masked else None)
    theirs = torch_cls([dict(opts, lr=opts["lr"] * opts["lr_scale"], params=[p2, q2])],
                       foreach=False)
    with pytest.raises(ValueError, match="more than one parameter group"):
        ours.add_param_group({"params": [p]})
    assert len(ours.param_groups) == 1
    start = twin(p)
    for _ in range(3):
        for a, b in ((p, p2), (q, q2)):
            g = rand_grad(a, gen, 1.0, False)
            a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        if max_grad_norm is not None:
            total = torch.nn.utils.clip_grad_norm_([t for t in (p2, q2) if t.numel()],
                                                   max_grad_norm, foreach=False)
            torch.testing.assert_close(ours.last_grad_norm, total, rtol=1e-6, atol=0)
        theirs.step()
        if masked:
            with torch.no_grad():
                p2.copy_(torch.where(mask, p2, start))
                for k, v in (theirs.state.get(p2) or {}).items():
                    if k != "step":
                        v.copy_(torch.where(mask, v, torch.zeros_like(v)))
        for a, b in ((p, p2), (q, q2)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
            for k, v in (theirs.state.get(b) or {}).items():
                if k == "step":
                    assert float(ours.state[a][k]) == float(v)
                else:
                    torch.testing.assert_close(ours.state[a][k], v, rtol=1e-6, atol=1e-6)
        if masked:
            assert bits_equal(p[~mask], start[~mask])
    # the state dict: one entry per parameter with state, as torch numbers them
    sd = ours.state_dict()
    index = sd["param_groups"][0]["params"]
    assert index[0] == index[2] != index[1]
    expect = {index[0]} if theirs.state.get(p2) else set()
    expect |= {index[1]} if theirs.state.get(q2) else set()
    assert set(sd["state"]) == expect


@pytest.mark.parametrize("name", ["SGD", "AdamW"])
def test_repeated_parameter_mask_survives_state_dict(backend, name):
    ts_cls = CLASSES[name][0]
    kw = dict(momentum=0.9) if name == "SGD" else {}
    p, q = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    mask = torch.tensor([True, False, True])
    with pytest.warns(UserWarning, match="duplicate parameters"):
        opt = ts_cls([p, q, p], lr=0.1, masks={p: mask}, **kw)
    p.grad, q.grad = torch.ones(3), torch.ones(2)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    p_index = sd["param_groups"][0]["params"][0]
    # "masks" are keyed by the same parameter indices as "state" (docs/optimizers.md)
    assert set(sd["masks"]) == {p_index}
    assert "torchstruct_mask" in sd["state"][p_index]
    for saved in (sd, {"state": sd["state"], "param_groups": sd["param_groups"]}):
        with pytest.warns(UserWarning, match="duplicate parameters"):
            again = ts_cls([p, q, p], lr=0.1, **kw)
        again.load_state_dict(copy.deepcopy(saved))
        assert set(map(id, again.masks)) == {id(p)}
        before = p.detach().clone()
        p.grad, q.grad = torch.ones(3), torch.ones(2)
        again.step()
        assert bits_equal(p[1], before[1])  # the masked-out element keeps its bits


def test_tied_model_parameter_lives_once(backend):
    """A weight shared by two modules: ts.param_groups lists it once, its gradient is the sum
    over both uses, the step moves it once, as torch over model.parameters()."""
    torch.manual_seed(0)

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))

    for name in ("SGD", "AdamW"):
        ts_cls, torch_cls, _ = CLASSES[name]
        model = Tied()
        twin_model = copy.deepcopy(model)
        assert twin_model.b.weight is twin_model.a.weight
        groups = ts.param_groups(model, weight_decay=0.1)
        listed = [p for g in groups for p in g["params"]]
        assert len(listed) == len({id(p) for p in listed}) == 3
        ours = ts_cls(groups, lr=0.05, max_grad_norm=0.5)
        theirs = torch_cls([{"params": [p for p in twin_model.parameters()
                                        if p.dim() < 2], "weight_decay": 0.0},
                            {"params": [p for p in twin_model.parameters() if p.dim() >= 2],
                             "weight_decay": 0.1}], lr=0.05, foreach=False)
        x = torch.randn(5, 4)
        for _ in range(3):
            for net, opt in ((model, ours), (twin_model, theirs)):
                opt.zero_grad()
                net(x).pow(2).sum().backward()
                if opt is theirs:
                    torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5, foreach=False)
                opt.step()
        for (n1, a), (n2, b) in zip(model.named_parameters(), twin_model.named_parameters()):
            assert n1 == n2
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=n1)


# -- errors leave everything as it was ----------------------------------------------------

FAULTS = ["neg_lr", "nan_lr", "neg_lr_scale", "mask_shape", "mask_dtype", "sparse_grad",
          "grad_dtype", "nan_max_grad_norm", "str_max_grad_norm", "bad_option", "expanded"]


def snapshot(opt, ps):
    return dict(
        params=[twin(p) for p in ps],
        grads=[None if p.grad is None else twin(p.grad) for p in ps],
        state={id(p): {k: (twin(v) if torch.is_tensor(v) else v) for k, v in s.items()}
               for p, s in opt.state.items()},
        state_ids={id(p) for p in opt.state},
        norm=opt.last_grad_norm,
        norm_value=None if opt.last_grad_norm is None else opt.last_grad_norm.clone(),
        groups=[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])


def same_snapshot(a, b):
    assert all(bits_equal(x, y) for x, y in zip(a["params"], b["params"])), "params moved"
    assert a["state_ids"] == b["state_ids"], "state entries added or removed"
    for key, entry in a["state"].items():
        other = b["state"][key]
        assert set(entry) == set(other), "state keys changed"
        for k, v in entry.items():
            if torch.is_tensor(v):
                assert bits_equal(v, other[k]) and v.stride() == other[k].stride(), k
    assert a["norm"] is b["norm"], "last_grad_norm replaced"
    if a["norm_value"] is not None:
        assert bits_equal(a["norm_value"], b["norm_value"])


@pytest.mark.parametrize("name", ["SGD", "AdamW"])
@FUZZ
@given(data=st.data())
def test_fuzz_refused_step_changes_nothing(backend, name, data):
    """After a random history, a step with one bad input (on the last parameter a step would
    update, so a non-atomic step would already have written the others) raises, changes no
    parameter, state entry or last_grad_norm, drops grad_scale / found_inf; once the input is
    fixed the run goes on matching torch."""
    sc = data.draw(scenario(name))
    for s in sc["steps"]:
        s["amp"] = None if s["amp"] and s["amp"][1] else s["amp"]
    pair = run_scenario(name, sc, backend=backend)
    opt, ps = pair.opt, pair.ps
    for g in opt.param_groups:  # make sure something is stepped
        if g.get("lr_scale", 1.0) == 0:
            g["lr_scale"] = 1.0
    gen = torch.Generator().manual_seed(sc["seed"] + 1)
    for p in ps:
        p.requires_grad_(True)
    grads = [rand_grad(p, gen, 1.0, False) for p in ps]
    for p, g in zip(ps, grads):
        p.grad = g.clone()
    stepped = [i for i in pair.stepped() if ps[i].numel() > 1]
    kind = data.draw(st.sampled_from(FAULTS))
    if not stepped and kind in ("mask_shape", "mask_dtype", "sparse_grad", "grad_dtype",
                                "expanded"):
        kind = "neg_lr"
    target = ps[stepped[-1]] if stepped else None
    group = (next(g for g in opt.param_groups if any(x is target for x in g["params"]))
             if target is not None else opt.param_groups[-1])
    before = snapshot(opt, ps)
    undo = []
    if kind in ("neg_lr", "nan_lr", "neg_lr_scale"):
        key = "lr_scale" if kind == "neg_lr_scale" else "lr"
        old = group.get(key, _ABSENT)
        group[key] = {"neg_lr": -0.01, "nan_lr": math.nan, "neg_lr_scale": -1.0}[kind]
        undo.append(lambda: group.__setitem__(key, old) if old is not _ABSENT
                    else group.pop(key))
    elif kind in ("mask_shape", "mask_dtype"):
        old = opt.masks.get(target, _ABSENT)
        opt.masks[target] = (torch.ones(target.numel() + 1, dtype=torch.bool)
                             if kind == "mask_shape" else torch.ones(target.shape))
        undo.append(lambda: opt.masks.__setitem__(target, old) if old is not _ABSENT
                    else opt.masks.pop(target))
    elif kind == "sparse_grad":
        dense = target.grad
        target.grad = dense.to_sparse()
        undo.append(lambda: setattr(target, "grad", dense))
    elif kind == "grad_dtype":
        dense = target.grad
        target.grad = None
        other = torch.float32 if target.dtype == torch.float64 else torch.float64
        target.data, saved = target.data.to(other), target.data
        target.grad = dense.to(other)  # (torch checks a .grad against .data when set)
        target.data = saved

        def fix():
            target.grad = None
            target.grad = dense
        undo.append(fix)
    elif kind in ("nan_max_grad_norm", "str_max_grad_norm"):
        old = opt.max_grad_norm
        opt.max_grad_norm = math.nan if kind == "nan_max_grad_norm" else "1.0"
        undo.append(lambda: setattr(opt, "max_grad_norm", old))
    elif kind == "bad_option":
        key = "momentum" if name == "SGD" else "betas"
        old = group[key]
        group[key] = -0.5 if name == "SGD" else (1.0, 0.999)
        undo.append(lambda: group.__setitem__(key, old))
    elif kind == "expanded":
        saved = target.data
        grad = target.grad
        target.grad = None
        target.data = saved.reshape(-1)[:1].reshape([1] * saved.dim()).expand(saved.shape)
        target.grad = grad

        def restore():
            target.grad = None
            target.data = saved
            target.grad = grad
        undo.append(restore)
    opt.grad_scale = torch.tensor(2.0)
    opt.found_inf = torch.tensor(0.0)
    with pytest.raises((ValueError, RuntimeError, TypeError)):
        opt.step()
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
    for fn in undo:
        fn()
    same_snapshot(before, snapshot(opt, ps))
    # the run goes on as if the refused step had never been tried
    pair.step([rand_grad(p, gen, 1.0, True) for p in ps])


_ABSENT = object()
