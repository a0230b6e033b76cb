"""An outside look at torchstruct under DistributedDataParallel, on two gloo processes.

What is audited, each against plain PyTorch DDP (same seeds, same data per rank) or a
single-process full-batch reference:

- ``ts.clip_by_global_norm`` + ``ts.optim.AdamW`` training under several wrapper options
  (default, ``gradient_as_bucket_view``, ``static_graph``, ``find_unused_parameters``), with
  ``no_sync`` gradient accumulation, with freezing contexts around the forward and backward,
  and with element masks: the norms and the weights match the single-process run, and the
  ranks stay bitwise identical (weights and optimizer state);
- ``UnfreezeSchedule`` under DDP, the two ways the docs allow (one ``find_unused_parameters``
  wrap with the schedule built after it; dropping and rebuilding the wrapper at each stage);
- ``structural_grad`` / ``value_and_grad`` on the wrapper and on ``.module``: the averaged
  gradient, bitwise what ``backward()`` leaves, also inside freezing contexts and ``no_sync``;
- every refusal the docs promise after wrapping (a clear message, no flag or gradient changed,
  and the wrapper training on normally afterwards);
- an error raised on one rank only: every rank must hear of it, and nobody may hang. Scenarios
  that risk a hang run their collectives in a process group with a few seconds' timeout, so a
  hang shows as a timeout error instead of blocking; ``tests/_spawn.py`` bounds every run.

Everything runs in one pair of processes (starting interpreters dominates the cost); each test
reads its checks by prefix. A test marked ``xfail(strict=True)`` reproduces a case that goes
wrong today; its reason says what happens and what is expected, and it starts passing (and so
failing as xfail) once fixed.
"""
import contextlib
import datetime
import time

import pytest
import torch
from torch import nn

import torchstruct as ts
from _spawn import batch, check, close, failed, gloo_available, half, run, small_model

needs_gloo = pytest.mark.skipif(not gloo_available(), reason="gloo is not available")

LR, WD, MAX_NORM = 0.05, 0.1, 0.05


def _mse(out, y):
    return nn.functional.mse_loss(out, y)


def _flags(m):
    return [p.requires_grad for p in m.parameters()]


def _bitwise_same(tensors):
    """Whether ``tensors`` are bitwise the same on both ranks (a collective)."""
    import torch.distributed as dist

    t = torch.cat([x.detach().reshape(-1).double() for x in tensors])
    both = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(both, t)
    return all(torch.equal(both[0], o) for o in both[1:])


def _every_rank(ok):
    import torch.distributed as dist

    t = torch.tensor([1.0 if ok else 0.0])
    dist.all_reduce(t)
    return t.item() == dist.get_world_size()


def _short_group(seconds=4):
    """A gloo group over both ranks whose collectives time out after ``seconds``: a rank left
    waiting there shows as an error instead of a hang (every rank must call this alike)."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=seconds))


def _state_tensors(opt):
    return [t for st in opt.state.values() for t in st.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0]


def _refused(checks, label, fn, model, words, kind=RuntimeError):
    """``fn()`` raises ``kind`` naming ``words``; no flag or ``.grad`` of ``model`` changed."""
    flags = _flags(model)
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    msg = None
    try:
        fn()
    except kind as e:
        msg = str(e)
    except Exception as e:  # noqa: BLE001 - the wrong kind is a failed check
        msg = f"wrong kind: {e!r}"
    check(checks, f"{label}: refused with a clear message",
          msg is not None and not msg.startswith("wrong kind")
          and all(w in msg for w in words), str(msg))
    check(checks, f"{label}: no flag changed", _flags(model) == flags,
          f"{flags} -> {_flags(model)}")
    check(checks, f"{label}: no gradient changed", all(
        (a is None and p.grad is None) or (a is not None and p.grad is not None
                                           and torch.equal(a, p.grad))
        for a, p in zip(grads, model.parameters())))


# ----------------------------------------------------------------------------- references
def _reference(steps, contexts=None):
    """Single process, full batch: torch's clip_grad_norm_ and torch.optim.AdamW. ``contexts``:
    a function ``(model, step) -> context manager`` around each step's forward/backward/step."""
    x, y = batch()
    m = small_model()
    opt = torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=WD, foreach=False)
    norms = []
    for i in range(steps):
        with (contexts(m, i) if contexts else contexts_none()):
            opt.zero_grad(set_to_none=True)
            _mse(m(x), y).backward()
            norms.append(torch.nn.utils.clip_grad_norm_(
                [p for p in m.parameters() if p.requires_grad and p.grad is not None],
                MAX_NORM))
            opt.step()
    return m, norms


def contexts_none():
    return contextlib.nullcontext()


def _ddp_train(ddp, m, rank, steps, contexts=None, micro=1, opt=None, target=None):
    """DDP: ``micro`` micro-batches per rank (all but the last under ``no_sync``), then
    ``ts.clip_by_global_norm(target)`` and ``ts.optim.AdamW``."""
    x, y = batch()
    xs, ys = half(x, rank), half(y, rank)
    opt = opt or ts.optim.AdamW(m.parameters(), lr=LR, weight_decay=WD)
    norms = []
    n = xs.shape[0] // micro
    for i in range(steps):
        with (contexts(m, i) if contexts else contexts_none()):
            opt.zero_grad(set_to_none=True)
            for k in range(micro):
                a, b = xs[k * n:(k + 1) * n], ys[k * n:(k + 1) * n]
                with (ddp.no_sync() if k < micro - 1 else contexts_none()):
                    (_mse(ddp(a), b) / micro).backward()
            norms.append(ts.clip_by_global_norm(ddp if target is None else target, MAX_NORM))
            opt.step()
    return opt, norms


def _compare(checks, label, m, opt, norms, ref, ref_norms):
    check(checks, f"{label}: norms as one process", len(norms) == len(ref_norms) and all(
        close(a, b, rtol=1e-4) for a, b in zip(norms, ref_norms)),
        f"{[float(a) for a in norms]} vs {[float(b) for b in ref_norms]}")
    check(checks, f"{label}: weights as one process", all(
        close(p, q, rtol=1e-4, atol=1e-5) for p, q in zip(m.parameters(), ref.parameters())),
        str([float((p - q).abs().max()) for p, q in zip(m.parameters(), ref.parameters())]))
    check(checks, f"{label}: weights and optimizer state bitwise the same on both ranks",
          _bitwise_same(list(m.parameters()) + _state_tensors(opt) + list(norms)))


# ----------------------------------------------------------------------------- training
def _part_training(rank, checks):
    from torch.nn.parallel import DistributedDataParallel as DDP

    steps = 3
    ref, ref_norms = _reference(steps)
    options = {
        "default": {}, "bucket_view": {"gradient_as_bucket_view": True},
        "static_graph": {"static_graph": True}, "fup": {"find_unused_parameters": True},
        "fup+bucket_view": {"find_unused_parameters": True, "gradient_as_bucket_view": True},
    }
    for name, kw in options.items():
        m = small_model()
        ddp = DDP(m, **kw)
        opt, norms = _ddp_train(ddp, m, rank, steps)
        _compare(checks, f"clip+AdamW [{name}]", m, opt, norms, ref, ref_norms)
    # the same through the module rather than the wrapper, and AdamW's folded clip
    m = small_model()
    ddp = DDP(m)
    opt, norms = _ddp_train(ddp, m, rank, steps, target=m)
    _compare(checks, "clip(model)+AdamW", m, opt, norms, ref, ref_norms)
    m = small_model()
    ddp = DDP(m)
    opt = ts.optim.AdamW(m.parameters(), lr=LR, weight_decay=WD, max_grad_norm=MAX_NORM)
    x, y = batch()
    got = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        _mse(ddp(half(x, rank)), half(y, rank)).backward()
        opt.step()
        got.append(opt.last_grad_norm.clone())
    _compare(checks, "AdamW(max_grad_norm)", m, opt, got, ref, ref_norms)

    # no_sync accumulation: two micro-batches per rank, the first local
    for name, kw in (("default", {}), ("bucket_view", {"gradient_as_bucket_view": True}),
                     ("fup", {"find_unused_parameters": True})):
        m = small_model()
        ddp = DDP(m, **kw)
        opt, norms = _ddp_train(ddp, m, rank, steps, micro=2)
        _compare(checks, f"no_sync accumulation [{name}]", m, opt, norms, ref, ref_norms)

    # freezing contexts around forward+backward+step, changing at every step (allowed with
    # find_unused_parameters=True when every rank makes the same change)
    def on_module(mm, i):  # (a bare call applies at once: build only the one used)
        return [contextlib.nullcontext, lambda: ts.freeze(mm, "2"),
                lambda: ts.freeze_except(mm, "4"), lambda: ts.freeze(mm, ["0.bias", "4"])][i]()

    steps4 = 4
    ref4, ref4_norms = _reference(steps4, on_module)
    for name, kw in (("fup", {"find_unused_parameters": True}),
                     ("fup+bucket_view", {"find_unused_parameters": True,
                                          "gradient_as_bucket_view": True})):
        for micro in (1, 2):
            m = small_model()
            ddp = DDP(m, **kw)
            try:
                opt, norms = _ddp_train(ddp, m, rank, steps4, on_module, micro=micro)
                _compare(checks, f"freezing contexts [{name}, micro={micro}]", m, opt, norms,
                         ref4, ref4_norms)
                check(checks, f"freezing contexts [{name}, micro={micro}]: flags restored",
                      all(_flags(m)))
            except RuntimeError as e:
                check(checks, f"freezing contexts [{name}, micro={micro}]: trains", False, str(e))

    # the same selections made on the wrapper (paths "module....")
    def on_wrapper(ddp):
        return lambda mm, i: [contextlib.nullcontext, lambda: ts.freeze(ddp, "module.2"),
                              lambda: ts.freeze_except(ddp, "module.4"),
                              lambda: ts.freeze(ddp, ["module.0.bias", "module.4"])][i]()

    m = small_model()
    ddp = DDP(m, find_unused_parameters=True)
    opt, norms = _ddp_train(ddp, m, rank, steps4, on_wrapper(ddp))
    _compare(checks, "freezing contexts on the wrapper", m, opt, norms, ref4, ref4_norms)
    # a layer frozen at one step is left bitwise alone by that step (weight decay included)
    m = small_model()
    ddp = DDP(m, find_unused_parameters=True, gradient_as_bucket_view=True)
    opt = ts.optim.AdamW(m.parameters(), lr=LR, weight_decay=WD)
    _ddp_train(ddp, m, rank, 1, opt=opt)
    before = m[2].weight.detach().clone()
    _ddp_train(ddp, m, rank, 1, lambda mm, i: ts.freeze(mm, "2"), opt=opt)
    check(checks, "a layer frozen for a step is bitwise unchanged by it",
          torch.equal(before, m[2].weight))

    # element masks: keyed by the wrapper's paths ("module.0.weight")
    mask = torch.zeros(8, 4, dtype=torch.bool)
    mask[::2] = True
    ref = small_model()
    ref_opt = ts.optim.AdamW(ref.named_parameters(), lr=LR, weight_decay=WD,
                             masks={"0.weight": mask}, max_grad_norm=MAX_NORM)
    m = small_model()
    ddp = DDP(m)
    opt = ts.optim.AdamW(ddp.named_parameters(), lr=LR, weight_decay=WD,
                         masks={"module.0.weight": mask}, max_grad_norm=MAX_NORM)
    start = m[0].weight.detach().clone()
    x, y = batch()
    norms, ref_norms = [], []
    for _ in range(steps):
        for o, call, a, b, ns in ((opt, ddp, half(x, rank), half(y, rank), norms),
                                  (ref_opt, ref, x, y, ref_norms)):
            o.zero_grad(set_to_none=True)
            _mse(call(a), b).backward()
            o.step()
            ns.append(o.last_grad_norm.clone())
    _compare(checks, "masks keyed by the wrapper's paths", m, opt, norms, ref, ref_norms)
    check(checks, "masks: masked-out rows bitwise unchanged",
          torch.equal(m[0].weight[1::2], start[1::2]) and not torch.equal(
              m[0].weight[::2], start[::2]))
    plain = small_model()
    plain_opt = ts.optim.AdamW(plain.named_parameters(), lr=LR, weight_decay=WD)
    try:
        plain_opt.load_state_dict(opt.state_dict())
        check(checks, "masks: the wrapper's optimizer state loads into a plain model's",
              torch.equal(plain_opt.masks.get(plain[0].weight, torch.zeros(1)), mask)
              if isinstance(plain_opt.masks, dict) else False, repr(plain_opt.masks)[:200])
    except Exception as e:  # noqa: BLE001
        check(checks, "masks: the wrapper's optimizer state loads into a plain model's", False,
              repr(e))


# ----------------------------------------------------------------------------- schedules
def _part_schedule(rank, checks):
    from torch.nn.parallel import DistributedDataParallel as DDP

    milestones = {0: "4", 1: "2", 3: None}
    x, y = batch()
    xs, ys = half(x, rank), half(y, rank)
    steps = 4

    def one_process():
        m = small_model()
        sched = ts.UnfreezeSchedule(m, milestones)
        opt = ts.optim.AdamW(m.parameters(), lr=LR, weight_decay=WD, max_grad_norm=MAX_NORM)
        norms = []
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            _mse(m(x), y).backward()
            opt.step()
            norms.append(opt.last_grad_norm.clone())
            sched.step()
        return m, norms

    ref, ref_norms = one_process()

    # (a) one wrap of everything with find_unused_parameters=True, the schedule built after it
    m = small_model()
    ddp = DDP(m, find_unused_parameters=True)
    sched = ts.UnfreezeSchedule(m, milestones)
    opt = ts.optim.AdamW(m.parameters(), lr=LR, weight_decay=WD, max_grad_norm=MAX_NORM)
    norms = []
    try:
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            _mse(ddp(xs), ys).backward()
            opt.step()
            norms.append(opt.last_grad_norm.clone())
            sched.step()
        _compare(checks, "schedule after a find_unused_parameters wrap", m, opt, norms, ref,
                 ref_norms)
    except RuntimeError as e:
        check(checks, "schedule after a find_unused_parameters wrap: trains", False, str(e))

    # a checkpointed schedule loaded after such a wrap: jumps to its stage, and training goes
    # on as one process resumed the same way
    m, r = small_model(), small_model()
    ddp = DDP(m, find_unused_parameters=True)
    scheds = [ts.UnfreezeSchedule(mm, milestones) for mm in (m, r)]
    try:
        for sc in scheds:
            sc.load_state_dict({"step": 1, "milestones": [0, 1, 3]})
        check(checks, "schedule load_state_dict after a find_unused_parameters wrap",
              _flags(m) == _flags(r) == [False, False, True, True, True, True], str(_flags(m)))
        opt = ts.optim.AdamW(m.parameters(), lr=LR, weight_decay=WD)
        ropt = ts.optim.AdamW(r.parameters(), lr=LR, weight_decay=WD)
        for _ in range(3):
            for o, call, a, b, sc in ((opt, ddp, xs, ys, scheds[0]), (ropt, r, x, y, scheds[1])):
                o.zero_grad(set_to_none=True)
                _mse(call(a), b).backward()
                o.step()
                sc.step()
        _compare(checks, "schedule resumed after a find_unused_parameters wrap", m, opt, [], r,
                 [])
    except RuntimeError as e:
        check(checks, "schedule load_state_dict after a find_unused_parameters wrap", False,
              str(e))

    # (b) the schedule built before wrapping: a stage change refused while wrapped (nothing
    # changes), then drop the wrapper, step, wrap again; the optimizer carries on
    m = small_model()
    sched = ts.UnfreezeSchedule(m, milestones)
    opt = ts.optim.AdamW(m.parameters(), lr=LR, weight_decay=WD, max_grad_norm=MAX_NORM)
    ddp = DDP(m)
    norms = []
    refusals = 0
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        _mse(ddp(xs), ys).backward()
        opt.step()
        norms.append(opt.last_grad_norm.clone())
        flags, at = _flags(m), sched.current_step
        try:
            sched.step()
        except RuntimeError as e:
            refusals += 1
            check(checks, "schedule stepped while wrapped: nothing changed",
                  _flags(m) == flags and sched.current_step == at and "wrap" in str(e), str(e))
            del ddp
            sched.step()
            ddp = DDP(m)
    check(checks, "schedule stepped while wrapped: refused at each unfreeze", refusals == 2,
          str(refusals))
    _compare(checks, "schedule with a new wrapper at each stage", m, opt, norms, ref, ref_norms)


# ----------------------------------------------------------------------------- gradients
def _part_gradients(rank, checks):
    from torch.nn.parallel import DistributedDataParallel as DDP

    x, y = batch()
    xs, ys = half(x, rank), half(y, rank)
    flat = ts.tree.to_flat_dict

    def loss(mm):
        return _mse(mm(xs), ys)

    twin = DDP(small_model())
    local_loss = loss(twin)
    local_loss.backward()
    want = {n: p.grad.clone() for n, p in twin.module.named_parameters()}

    m = small_model()
    ddp = DDP(m)
    value, g = ts.value_and_grad(loss, ddp)
    g = flat(g)
    check(checks, "value_and_grad(wrapper): this rank's loss", torch.equal(value, local_loss.detach()),
          f"{value} vs {local_loss}")
    check(checks, "value_and_grad(wrapper): the averaged .grad, bitwise",
          sorted(g) == sorted("module." + n for n in want)
          and all(torch.equal(g["module." + n], w) for n, w in want.items()))
    (value, aux), g = ts.value_and_grad(lambda mm, a: (loss(mm), a * rank), m, 3.0, has_aux=True)
    g = flat(g)
    check(checks, "value_and_grad(module, has_aux): the averaged .grad, bitwise",
          aux == 3.0 * rank and sorted(g) == sorted(want)
          and all(torch.equal(g[n], w) for n, w in want.items()))
    check(checks, "value_and_grad left no .grad", all(p.grad is None for p in m.parameters()))
    g = flat(ts.structural_grad(m[2], lambda sub: loss(m), wrt=None))
    check(checks, "structural_grad(a submodule of the wrapped model): averaged",
          sorted(g) == ["bias", "weight"] and torch.equal(g["weight"], want["2.weight"]),
          str(sorted(g)))

    # inside freezing contexts, on a find_unused_parameters wrapper: the averaged gradient of
    # the trainable parameters, bitwise what the twin's backward() leaves
    twin = DDP(small_model(), find_unused_parameters=True)
    m = small_model()
    ddp = DDP(m, find_unused_parameters=True)
    for sel in ("2", ["0", "4.bias"]):
        twin.module.zero_grad(set_to_none=True)
        with ts.freeze(twin.module, sel):
            loss(twin).backward()
        with ts.freeze(m, sel):
            g = flat(ts.structural_grad(ddp, loss))
            trainable = [n for n, _ in ts.trainable_parameters(m)]
        tw = {n: p.grad for n, p in twin.module.named_parameters() if p.grad is not None}
        check(checks, f"structural_grad inside freeze({sel!r}): the trainable ones, averaged",
              sorted(g) == sorted("module." + n for n in trainable) == sorted(
                  "module." + n for n in tw)
              and all(torch.equal(g["module." + n], t) for n, t in tw.items()), str(sorted(g)))
    # wrt= a parameter frozen by a context (a find_unused_parameters wrapper): averaged too
    with ts.freeze(m, "0"):
        g = flat(ts.structural_grad(ddp, loss, wrt="module.0.weight"))
        check(checks, "wrt= a parameter frozen by a context: averaged, flag kept",
              torch.equal(g["module.0.weight"], want["0.weight"])
              and not m[0].weight.requires_grad)

    # inside no_sync accumulation: this rank's local .grad is left as it is, and the synced
    # step after it is exactly the twin's
    twin = DDP(small_model())
    m = small_model()
    ddp = DDP(m)
    for net in (twin, ddp):
        with net.no_sync():
            _mse(net(xs[:2]), ys[:2]).backward()
    local = [p.grad.clone() for p in m.parameters()]
    with ddp.no_sync():
        g = flat(ts.structural_grad(ddp, loss(ddp)))
    check(checks, "no_sync: tensor loss averaged", all(
        torch.equal(g["module." + n], w) for n, w in want.items()))
    g = flat(ts.structural_grad(ddp, loss))
    check(checks, "no_sync pending: callable averaged", all(
        torch.equal(g["module." + n], w) for n, w in want.items()))
    check(checks, "no_sync: the local accumulated .grad untouched",
          all(torch.equal(a, p.grad) for a, p in zip(local, m.parameters())))
    for net in (twin, ddp):
        _mse(net(xs[2:]), ys[2:]).backward()
    check(checks, "no_sync: the synced step afterwards is the twin's, bitwise",
          all(torch.equal(p.grad, q.grad) for p, q in zip(m.parameters(), twin.parameters()))
          and _bitwise_same([p.grad for p in m.parameters()]))

    # global_norm of the wrapper, of the module and of a list agree, on both ranks
    n1, n2 = ts.global_norm(ddp), ts.global_norm(m)
    n3 = ts.global_norm([p.grad for p in m.parameters()])
    check(checks, "global_norm: wrapper, module and gradient list agree",
          torch.equal(n1, n2) and close(n1, n3) and _bitwise_same([n1]))


# ----------------------------------------------------------------------------- refusals
def _part_refusals(rank, checks):
    from torch.nn.parallel import DistributedDataParallel as DDP

    x, y = batch()
    xs, ys = half(x, rank), half(y, rank)

    def loss(mm):
        return _mse(mm(xs), ys)

    # find_unused_parameters=False: whatever would stop a synchronized parameter is refused
    m = small_model()
    ddp = DDP(m)
    loss(ddp).backward()
    for label, fn in (
            ("freeze(model)", lambda: ts.freeze(m, "0")),
            ("freeze(wrapper)", lambda: ts.freeze(ddp, "module.0")),
            ("with freeze_except(model)", lambda: ts.freeze_except(m, "4").__enter__()),
            ("mark_trainable", lambda: ts.mark_trainable(m[0], "bias")),
            ("UnfreezeSchedule built after wrapping", lambda: ts.UnfreezeSchedule(m, {0: "4"})),
    ):
        _refused(checks, f"fup=False {label}", fn, m, ["find_unused_parameters"])
    twin = DDP(small_model())
    loss(twin).backward()
    m.zero_grad(set_to_none=True)
    twin.zero_grad(set_to_none=True)
    loss(ddp).backward()
    loss(twin).backward()
    check(checks, "fup=False: trains on after the refusals, as a twin",
          all(torch.equal(p.grad, q.grad) for p, q in zip(m.parameters(), twin.parameters())))

    # a parameter frozen when DDP was built may not start training (any wrapper options)
    for name, kw in (("fup", {"find_unused_parameters": True}), ("default", {})):
        m = small_model()
        ts.freeze(m, "0")
        ddp = DDP(m, **kw)
        _refused(checks, f"[{name}] unfreeze of an unsynchronized parameter",
                 lambda: ts.unfreeze(m, "0").__enter__(), m, ["'0.weight'", "start training"])
        _refused(checks, f"[{name}] unfreeze(wrapper) of an unsynchronized parameter", lambda:
                 ts.unfreeze(ddp, "module.0.bias").__enter__(), m, ["0.bias'", "start training"])
        d = small_model()
        ts.mark_trainable(d, "2", "4")  # a declaration made before wrapping
        kept = DDP(d, **kw)  # noqa: F841 - the wrapper must stay alive
        _refused(checks, f"[{name}] mark_trainable(None) lifting a declaration", lambda:
                 ts.mark_trainable(d, None), d, ["start training"])
        check(checks, f"[{name}] mark_trainable(None) refused: the declaration stays",
              [n for n, _ in ts.trainable_parameters(d)] == ["2.weight", "2.bias", "4.weight",
                                                             "4.bias"])

    # static_graph=True with find_unused_parameters=True: refused after the first step
    m = small_model()
    ddp = DDP(m, find_unused_parameters=True, static_graph=True)
    loss(ddp).backward()
    _refused(checks, "static_graph freeze", lambda: ts.freeze(m, "2"), m, ["static_graph=True"])

    # structural_grad refusals: nothing changed, and the wrapper trains on as a twin
    m = small_model()
    ddp = DDP(m)
    twin = DDP(small_model())
    loss(ddp).backward()
    loss(twin).backward()
    pending = loss(ddp)
    _refused(checks, "structural_grad of a synchronized tensor loss",
             lambda: ts.structural_grad(ddp, pending), m, ["no_sync"], ValueError)
    pending.backward()
    _refused(checks, "structural_grad create_graph=True",
             lambda: ts.structural_grad(ddp, loss, create_graph=True), m, ["create_graph"],
             ValueError)
    loss(twin).backward()
    check(checks, "structural_grad refusals: the pending backward still reduces as a twin's",
          all(torch.equal(p.grad, q.grad) for p, q in zip(m.parameters(), twin.parameters())))

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    m = small_model()
    hooked = DDP(m)
    hooked.register_comm_hook(None, default_hooks.fp16_compress_hook)
    loss(hooked).backward()
    _refused(checks, "structural_grad with a compression hook",
             lambda: ts.structural_grad(hooked, loss), m, ["communication hook"])
    static = DDP(small_model(), static_graph=True)
    _refused(checks, "structural_grad static_graph before a step",
             lambda: ts.structural_grad(static, loss), static.module, ["static_graph=True"])


# ----------------------------------------------------------------------------- one rank fails
def _part_one_rank(rank, checks):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    x, y = batch()
    xs, ys = half(x, rank), half(y, rank)

    # a torchstruct error inside rank 1's loss callable: every rank raises, promptly
    pg = _short_group()
    m = small_model()
    ddp = DDP(m, process_group=pg)

    def loss(mm):
        if rank == 1:
            with ts.freeze(mm, "no.such.layer"):
                pass
        return _mse(mm(xs), ys)

    t0, msg = time.monotonic(), None
    try:
        ts.structural_grad(ddp, loss)
    except Exception as e:  # noqa: BLE001
        msg = f"{type(e).__name__}: {e}"
    took = time.monotonic() - t0
    check(checks, "one rank's loss raises: an error on every rank, at once",
          msg is not None and took < 3.0
          and (("no.such.layer" in msg) if rank == 1 else ("another rank" in msg)),
          f"{took:.1f}s {msg}")
    check(checks, "one rank's loss raises: flags unchanged, no .grad",
          all(_flags(m)) and all(p.grad is None for p in m.parameters()))
    ddp2 = DDP(small_model())  # the default group still works, and training goes on
    _mse(ddp2(xs), ys).backward()
    check(checks, "one rank's loss raises: training goes on",
          _bitwise_same([p.grad for p in ddp2.parameters()]))

    # a freeze on rank 0 only, with find_unused_parameters=True (the guard lets it through):
    # the backward raises on every rank, and no optimizer step follows; nothing drifts
    pg = _short_group()
    m = small_model()
    ddp = DDP(m, find_unused_parameters=True, process_group=pg)
    opt = ts.optim.AdamW(m.parameters(), lr=LR, weight_decay=WD, max_grad_norm=MAX_NORM)
    msg = None
    t0 = time.monotonic()
    try:
        with (ts.freeze(m, "2") if rank == 0 else contexts_none()):
            _mse(ddp(xs), ys).backward()
            opt.step()
    except RuntimeError as e:
        msg = str(e)
    took = time.monotonic() - t0
    check(checks, "one-rank freeze: an error on every rank naming the layer, at once",
          msg is not None and "'2.weight'" in msg and took < 3.0, f"{took:.1f}s {msg}")
    check(checks, "one-rank freeze: weights the same on both ranks, flags restored",
          _bitwise_same(list(m.parameters())) and all(_flags(m)))

    # a refusal on one rank only, caught there: nothing changed, so the ranks still train the
    # same parameters and the next steps keep them bitwise in sync
    pg = _short_group()
    m = small_model()
    ddp = DDP(m, process_group=pg)
    opt = ts.optim.AdamW(m.parameters(), lr=LR, weight_decay=WD, max_grad_norm=MAX_NORM)
    refused = False
    if rank == 0:
        try:
            ts.freeze(m, "0")
        except RuntimeError:
            refused = True
    try:
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            _mse(ddp(xs), ys).backward()
            opt.step()
        ok, msg = True, ""
    except RuntimeError as e:
        ok, msg = False, str(e)
    check(checks, "a refusal caught on one rank: training goes on in sync",
          ok and refused == (rank == 0) and all(_flags(m))
          and _bitwise_same(list(m.parameters())), msg)

    # clip_by_global_norm refusing on one rank only: DDP already averaged, so the other rank
    # is not left waiting in a collective
    m = small_model()
    ddp = DDP(m)
    _mse(ddp(xs), ys).backward()
    t0, msg = time.monotonic(), None
    try:
        ts.clip_by_global_norm(ddp, -1.0 if rank == 1 else MAX_NORM)
    except ValueError as e:
        msg = str(e)
    check(checks, "clip refused on one rank: the other does not wait",
          time.monotonic() - t0 < 3.0 and ((msg is not None and "max_norm" in msg)
                                           if rank == 1 else msg is None), str(msg))
    dist.barrier()

    # structural_grad: a wrt= selector that fails on one rank only
    pg = _short_group()
    ddp = DDP(small_model(), process_group=pg)
    t0, msg = time.monotonic(), None
    try:
        ts.structural_grad(ddp, lambda mm: _mse(mm(xs), ys),
                           wrt="module.9" if rank == 1 else "module.2")
    except Exception as e:  # noqa: BLE001
        msg = f"{type(e).__name__}: {e}"
    took = time.monotonic() - t0
    own = msg is not None and (msg.startswith("ValueError") if rank == 1 else
                               msg.startswith("RuntimeError: structural_grad: another rank"))
    check(checks, "typo wrt on one rank: every rank raises a torchstruct error at once",
          took < 3.0 and own and "Timed out" not in msg, f"{took:.1f}s {msg}")
    dist.barrier()

    # structural_grad: ranks asking for different parameters whose count, positions' sum and
    # sum of squares and total size happen to agree
    class Seven(nn.Module):
        def __init__(self):
            super().__init__()
            self.ps = nn.ParameterList(nn.Parameter(torch.zeros(3)) for _ in range(7))

        def forward(self, t):
            return sum((i + 1) * (p * t).sum() for i, p in enumerate(self.ps))

    seven = DDP(Seven())
    wrt = ["module.ps.0", "module.ps.4", "module.ps.5"] if rank == 0 else \
        ["module.ps.1", "module.ps.2", "module.ps.6"]
    msg = None
    try:
        g = ts.tree.to_flat_dict(ts.structural_grad(seven, lambda mm: mm(torch.ones(3)),
                                                    wrt=wrt))
        msg = str({k: v.tolist() for k, v in g.items()})
    except RuntimeError as e:
        check(checks, "different wrt on the ranks: an error on every rank",
              "different parameters" in str(e), str(e))
    else:
        check(checks, "different wrt on the ranks: an error on every rank", False,
              f"no error; silently averaged gradients of different parameters: {msg}")
    dist.barrier()


# ----------------------------------------------------------------------------- FSDP2
def _part_fsdp(rank, checks):
    """FSDP2 (``fully_shard``) on CPU over gloo, as docs/distributed.md describes it."""
    from torch.distributed.fsdp import fully_shard

    x, y = batch()
    xs, ys = half(x, rank), half(y, rank)

    def sharded():
        m = small_model()
        for i in (0, 2, 4):
            fully_shard(m[i])
        fully_shard(m)
        return m

    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    # what trains changes between steps (a context per step); clip + AdamW as one process
    def ctx(mm, i):
        return [contextlib.nullcontext, lambda: ts.freeze_except(mm, "4"),
                lambda: ts.freeze(mm, "0")][i]()

    ref, ref_norms = _reference(3, ctx)
    m = sharded()
    opt = ts.optim.AdamW(m.parameters(), lr=LR, weight_decay=WD)
    norms = []
    for i in range(3):
        with ctx(m, i):
            opt.zero_grad(set_to_none=True)
            _mse(m(xs), ys).backward()
            norms.append(ts.clip_by_global_norm(m, MAX_NORM))
            opt.step()
    check(checks, "contexts + clip + AdamW: norms as one process, plain tensors",
          all(type(n) is torch.Tensor and close(n, r, rtol=1e-4) for n, r in zip(norms, ref_norms)),
          f"{[float(n) for n in norms]} vs {[float(r) for r in ref_norms]}")
    check(checks, "contexts + clip + AdamW: weights as one process", all(
        close(full(p), q, rtol=1e-4, atol=1e-5) for p, q in zip(m.parameters(), ref.parameters())))
    check(checks, "contexts + clip + AdamW: flags restored", all(_flags(m)))
    # structural_grad is refused clearly, changing nothing
    m = sharded()
    _refused(checks, "structural_grad refused", lambda: ts.structural_grad(
        m, lambda mm: _mse(mm(xs), ys)), m, ["loss.backward()"], (RuntimeError, ValueError))


# ----------------------------------------------------------------------------- the run
_PARTS = (("train: ", _part_training), ("schedule: ", _part_schedule),
          ("grad: ", _part_gradients), ("refuse: ", _part_refusals),
          ("one-rank: ", _part_one_rank), ("fsdp: ", _part_fsdp))


def scenario(rank, checks):
    """Every part in one pair of processes; an exception in a part is one failed check."""
    import traceback

    for prefix, fn in _PARTS:
        part = []
        try:
            fn(rank, part)
        except Exception:  # noqa: BLE001 - reported as a failed check, the others still run
            part.append(("raised", False, traceback.format_exc()[-1500:]))
        checks.extend((prefix + n, ok, msg) for n, ok, msg in part)


@pytest.fixture(scope="module")
def per_rank():
    return run(scenario)


def _select(per_rank, prefix, xfail=False):
    return {r: [c for c in cs if c[0].startswith(prefix) and ("xfail" in c[0]) == xfail]
            for r, cs in per_rank.items()}


def _assert_ok(per_rank, prefix, at_least, xfail=False):
    part = _select(per_rank, prefix, xfail)
    assert all(len(c) >= at_least for c in part.values()), {r: len(c) for r, c in part.items()}
    assert not failed(part), "\n".join(failed(part))


@needs_gloo
def test_clip_and_adamw_under_ddp_options_match_one_process_and_keep_ranks_bitwise(per_rank):
    _assert_ok(per_rank, "train: clip+AdamW", 15)
    _assert_ok(per_rank, "train: clip(model)", 3)
    _assert_ok(per_rank, "train: AdamW(max_grad_norm)", 3)


@needs_gloo
def test_no_sync_accumulation_matches_the_full_batch(per_rank):
    _assert_ok(per_rank, "train: no_sync accumulation", 9)


@needs_gloo
def test_freezing_contexts_around_find_unused_parameters_steps(per_rank):
    _assert_ok(per_rank, "train: freezing contexts", 16)
    _assert_ok(per_rank, "train: a layer frozen", 1)


@needs_gloo
def test_masks_keyed_by_wrapper_paths(per_rank):
    _assert_ok(per_rank, "train: masks", 5)


@needs_gloo
def test_no_part_raised_unexpectedly(per_rank):
    _assert_ok(per_rank, "", 60)
    assert not any(n.endswith("raised") for cs in per_rank.values() for n, _, _ in cs)


@needs_gloo
def test_unfreeze_schedule_the_two_documented_ways(per_rank):
    _assert_ok(per_rank, "schedule: ", 8)


@needs_gloo
def test_structural_grad_and_value_and_grad_are_the_averaged_gradients(per_rank):
    _assert_ok(per_rank, "grad: ", 12)


@needs_gloo
def test_refusals_after_wrapping_say_what_to_do_and_change_nothing(per_rank):
    _assert_ok(per_rank, "refuse: ", 30)


@needs_gloo
def test_an_error_on_one_rank_is_an_error_on_every_rank_without_waiting(per_rank):
    _assert_ok(per_rank, "one-rank: ", 9)


@needs_gloo
def test_fsdp2_contexts_clip_and_adamw_as_one_process(per_rank):
    _assert_ok(per_rank, "fsdp: ", 6)
