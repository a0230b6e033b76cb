"""FSDP2 (``fully_shard``: DTensor parameters and gradients) with torchstruct, 2 gloo processes.

Every rank trains a sharded model on its half of a global batch and, in the same process, an
unsharded copy on the whole batch (same seeds); the sharded numbers, gathered with
``full_tensor()``, must equal the unsharded ones. Shards are uneven on purpose (7 rows over 2
ranks; a 1-element bias leaves one rank an empty shard).
"""
import pytest
import torch
from torch import nn

from _spawn import gloo_available, run
from _spawn import check as _check
from _spawn import close as _close
from _spawn import failed as _failed

if not gloo_available():
    pytest.skip("torch.distributed with the gloo backend is not available", allow_module_level=True)


def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        try:
            from torch.distributed._composable.fsdp import fully_shard
        except ImportError:
            return None
    return fully_shard


if _fully_shard() is None:
    pytest.skip("FSDP2 (fully_shard) is not available in this torch", allow_module_level=True)
if _fully_shard().__module__.startswith("torch.distributed._composable"):
    # torch 2.4's fully_shard initializes CUDA even for CPU tensors over gloo
    pytest.skip("FSDP2 on CPU tensors is tested from torch 2.6 on (fully_shard public)",
                allow_module_level=True)

BATCH = 8


# ----------------------------------------------------------------------------- helpers
def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6), nn.Tanh(), nn.Linear(6, 1))


def _sharded():
    """The same model, each Linear and the root sharded over the two ranks."""
    fully_shard = _fully_shard()
    model = _model()
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer)
    fully_shard(model)
    return model


def _batches(steps):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 5, generator=g), torch.randn(BATCH, 1, generator=g))
            for _ in range(steps)]


def _half(t, rank):
    n = BATCH // 2
    return t[rank * n:(rank + 1) * n]


def _backward(model, x, y):
    # The mean over the rank's half; FSDP2 averages the gradients over the ranks.
    nn.functional.mse_loss(model(x), y).backward()


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _grads(model):
    return {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}


# ----------------------------------------------------------------------------- scenarios
def scenario_norms_and_clip(rank, checks):
    import torchstruct as ts

    (x, y), = _batches(1)
    ref, model = _model(), _sharded()
    _backward(ref, x, y)
    _backward(model, _half(x, rank), _half(y, rank))
    _check(checks, "gradients are DTensors",
           all(type(p.grad).__name__ == "DTensor" for p in model.parameters()))
    _check(checks, "rank 1 has an empty shard of the 1-element bias",
           model[4].bias.grad.to_local().numel() == (1 if rank == 0 else 0))

    # the gradients as a tree: ts.grad_tree; structural_grad refuses, saying so
    tree = ts.grad_tree(model)
    want = _grads(ref)
    _check(checks, "grad_tree of the sharded model",
           sorted(ts.tree.to_flat_dict(tree)) == sorted(want)
           and all(_close(_full(g), want[n]) for n, g in ts.tree.to_flat_dict(tree).items()))
    try:
        ts.structural_grad(model, lambda m: m(_half(x, rank)).sum())
        refused = False
    except RuntimeError as err:
        refused = "grad_tree" in str(err) and "fully_shard" in str(err)
    _check(checks, "structural_grad on a sharded model: a clear error", refused)

    for p_norm in (2.0, 1.0, float("inf"), 3.0):
        got, want = ts.global_norm(model, p_norm), ts.global_norm(ref, p_norm)
        _check(checks, f"global_norm(model, {p_norm}) equals unsharded", _close(got, want),
               f"{float(got)} vs {float(want)}")
        _check(checks, f"global_norm(model, {p_norm}) is a plain tensor",
               type(got) is torch.Tensor)
    listed = ts.global_norm([p.grad for p in model.parameters()])
    _check(checks, "global_norm of the gradient list", _close(listed, ts.global_norm(ref)))

    # clip: the returned norm and every clipped gradient equal torch's on the unsharded model
    want_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    got_norm = ts.clip_by_global_norm(model.parameters(), 0.05)
    _check(checks, "clip returns the global norm", _close(got_norm, want_norm),
           f"{float(got_norm)} vs {float(want_norm)}")
    want, got = _grads(ref), _grads(model)
    for name in want:
        _check(checks, f"clipped gradient {name}", _close(got[name], want[name]))
    # a model argument: its trainable gradients, already clipped, so nothing changes
    again = ts.clip_by_global_norm(model, 1.0)
    _check(checks, "clip(model) after clipping", _close(again, ts.global_norm(ref)))

    # a non-finite gradient on one rank only: every rank refuses, nothing is written
    before = {n: g.clone() for n, g in _grads(model).items()}
    if rank == 1:
        model[2].weight.grad.to_local().view(-1)[0] = float("nan")
    try:
        ts.clip_by_global_norm(model, 0.01, error_if_nonfinite=True)
        raised = False
    except RuntimeError as err:
        raised = "non-finite" in str(err)
    _check(checks, "a NaN on one rank: error_if_nonfinite raises on every rank", raised)
    after = _grads(model)
    _check(checks, "the refused clip wrote nothing",
           all(_close(after[n], before[n]) for n in before if n != "2.weight"))


def scenario_placements(rank, checks):
    """Replicated, sharded on another dimension, and Partial DTensors, mixed with plain ones."""
    import torchstruct as ts
    from torch.distributed.device_mesh import init_device_mesh
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor import DTensor, Replicate, Shard, distribute_tensor

    try:
        from torch.distributed.tensor import Partial
    except ImportError:  # older spelling
        from torch.distributed.tensor.placement_types import Partial

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(3)
    a, b, c, d = torch.randn(5, 3), torch.randn(4, 7), torch.randn(6), torch.randn(2, 2)
    tensors = [distribute_tensor(a, mesh, [Shard(0)]), distribute_tensor(b, mesh, [Shard(1)]),
               distribute_tensor(c, mesh, [Replicate()]), d]
    for p_norm in (2.0, float("inf")):
        got = ts.global_norm(tensors, p_norm)
        want = ts.global_norm([a, b, c, d], p_norm)
        _check(checks, f"mixed placements, norm {p_norm}", _close(got, want),
               f"{float(got)} vs {float(want)}")
    # a 2-D mesh (as HSDP uses): each tensor is reduced over its sharded dimensions only
    mesh2 = init_device_mesh("cpu", (2, 1))
    e = torch.randn(3, 8)
    for placements in ([Shard(0), Replicate()], [Replicate(), Shard(1)], [Shard(1), Shard(0)]):
        got = ts.global_norm([distribute_tensor(e, mesh2, placements), c], 2.0)
        want = ts.global_norm([e, c], 2.0)
        _check(checks, f"2-D mesh {placements}", _close(got, want), f"{float(got)} vs {float(want)}")
    # Partial: each rank holds a summand; the norm is that of the sum
    summand = torch.full((3,), float(rank + 1))
    partial = DTensor.from_local(summand, mesh, [Partial()])
    got = ts.global_norm([partial])
    _check(checks, "partial DTensor", _close(got, torch.full((3,), 3.0).norm()), f"{float(got)}")


def scenario_optimizers(rank, checks):
    import torchstruct as ts

    batches = _batches(3)
    for name, make_ts, make_torch in (
        ("AdamW", lambda ps: ts.optim.AdamW(ps, lr=0.05, max_grad_norm=0.05),
         lambda ps: torch.optim.AdamW(ps, lr=0.05, foreach=False)),
        ("SGD", lambda ps: ts.optim.SGD(ps, lr=0.1, momentum=0.9, max_grad_norm=0.05),
         lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=False)),
    ):
        ref, model = _model(), _sharded()
        opt_ref, opt = make_torch(list(ref.parameters())), make_ts(list(model.parameters()))
        for x, y in batches:
            _backward(ref, x, y)
            want_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
            opt_ref.step()
            opt_ref.zero_grad()
            _backward(model, _half(x, rank), _half(y, rank))
            opt.step()
            opt.zero_grad()
            _check(checks, f"{name}: last_grad_norm", _close(opt.last_grad_norm, want_norm))
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            _check(checks, f"{name}: {n} after 3 steps", _close(_full(p), q),
                   f"max diff {(_full(p) - q).abs().max().item():.3g}")
        state = opt.state[model[0].weight]
        buffer = state["exp_avg"] if name == "AdamW" else state["momentum_buffer"]
        _check(checks, f"{name}: state is sharded like the parameter",
               type(buffer).__name__ == "DTensor"
               and tuple(buffer.placements) == tuple(model[0].weight.placements))

    # distributed checkpointing reads and restores the sharded state
    from torch.distributed.checkpoint import state_dict as dcp

    saved = dcp.get_optimizer_state_dict(model, opt)
    restored = ts.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    dcp.set_optimizer_state_dict(model, restored, saved)
    _check(checks, "DCP state dict round trip",
           all(torch.equal(_full(restored.state[p]["momentum_buffer"]),
                           _full(opt.state[p]["momentum_buffer"])) for p in model.parameters()))

    # masks: a DTensor mask sharded like its parameter; a plain mask is refused, nothing written
    from torch.distributed.tensor import distribute_tensor

    model = _sharded()
    w = model[0].weight
    keep = torch.zeros(7, 5, dtype=torch.bool)
    keep[:, :2] = True
    opt = ts.optim.AdamW(model.parameters(), lr=0.1)
    try:
        opt.set_mask(w, keep)
        refused = False
    except ValueError as err:
        refused = "distribute_tensor" in str(err)
    _check(checks, "a plain mask for a DTensor parameter is refused with the way out", refused)
    _check(checks, "the refused mask was not kept", not opt.masks)
    opt.set_mask(w, distribute_tensor(keep, w.device_mesh, w.placements))
    before = _full(w).clone()
    (x, y), = _batches(1)
    _backward(model, _half(x, rank), _half(y, rank))
    opt.step()
    after = _full(w)
    _check(checks, "masked-out elements bitwise unchanged", torch.equal(after[:, 2:], before[:, 2:]))
    _check(checks, "masked-in elements moved", not torch.equal(after[:, :2], before[:, :2]))


def scenario_freezing(rank, checks):
    import torchstruct as ts

    batches = _batches(4)

    # A context entered before sharding, left after it: flags return on the sharded parameters.
    model = ts.attach(_model())
    with ts.freeze_except(model, "4"):
        fully_shard = _fully_shard()
        for layer in (model[0], model[2], model[4]):
            fully_shard(layer)
        fully_shard(model)
        _check(checks, "inside: only the head trains",
               [n for n, _ in ts.trainable_parameters(model)] == ["4.weight", "4.bias"])
        _check(checks, "trainable_parameters gives the sharded parameters",
               all(type(p).__name__ == "DTensor" for _, p in ts.trainable_parameters(model)))
    _check(checks, "left after sharding: every parameter trains again",
           all(p.requires_grad for p in model.parameters()))

    # What trains changes between steps (after sharding): the same as the unsharded model.
    ref, model = _model(), _sharded()
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=0.05, foreach=False)
    opt = ts.optim.AdamW(model.parameters(), lr=0.05)
    for step, (x, y) in enumerate(batches):
        selector = ["4", "2.*", "0.weight", "4"][step]
        with ts.freeze_except(ref, selector), ts.freeze_except(model, selector):
            _backward(ref, x, y)
            want = {n for n, p in ref.named_parameters() if p.grad is not None}
            opt_ref.step()
            opt_ref.zero_grad(set_to_none=True)
            _backward(model, _half(x, rank), _half(y, rank))
            got = {n for n, p in model.named_parameters() if p.grad is not None}
            _check(checks, f"step {step} ({selector}): gradients exactly where trainable",
                   got == want and len(got) in (1, 2), f"{sorted(got)} vs {sorted(want)}")
            opt.step()
            opt.zero_grad(set_to_none=True)
        _check(checks, f"step {step}: flags restored",
               all(p.requires_grad for p in model.parameters()))
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        _check(checks, f"{n} after 4 steps with changing freezing", _close(_full(p), q))

    # Declarations made before sharding hold after it.
    model = _model()
    ts.mark_trainable(model, "4")
    fully_shard = _fully_shard()
    fully_shard(model)
    _check(checks, "a declaration survives sharding",
           [n for n, _ in ts.trainable_parameters(model)] == ["4.weight", "4.bias"])
    (x, y), = _batches(1)
    _backward(model, _half(x, rank), _half(y, rank))
    _check(checks, "declared-frozen parameters get no gradient",
           {n for n, p in model.named_parameters() if p.grad is not None} == {"4.weight", "4.bias"})


# ----------------------------------------------------------------------------- tests
def scenario_numbers(rank, checks):
    """One pair of processes for norms, placements and optimizers (start-up dominates)."""
    for prefix, scenario in (("norm: ", scenario_norms_and_clip), ("place: ", scenario_placements),
                             ("optim: ", scenario_optimizers)):
        part = []
        scenario(rank, part)
        checks.extend((prefix + n, ok, m) for n, ok, m in part)


@pytest.fixture(scope="module")
def numbers():
    return run(scenario_numbers)


def _part(per_rank, prefix):
    return {r: [c for c in checks if c[0].startswith(prefix)] for r, checks in per_rank.items()}


@pytest.mark.parametrize("prefix, at_least", [("norm: ", 19), ("place: ", 6), ("optim: ", 21)])
def test_sharded_numbers_equal_unsharded(numbers, prefix, at_least):
    per_rank = _part(numbers, prefix)
    assert all(len(c) >= at_least for c in per_rank.values()), {r: len(c) for r, c in per_rank.items()}
    assert not _failed(per_rank), "\n".join(_failed(per_rank))


def test_freezing_a_sharded_model():
    per_rank = run(scenario_freezing)
    assert all(len(c) >= 19 for c in per_rank.values()), {r: len(c) for r, c in per_rank.items()}
    assert not _failed(per_rank), "\n".join(_failed(per_rank))
