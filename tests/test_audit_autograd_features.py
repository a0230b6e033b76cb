"""torchstruct under PyTorch's less common autograd features (an outside-eyes audit).

What is audited, each against plain PyTorch running the same computation with the flags set by
hand (``requires_grad_``) or the blocked parameters detached by hand (``.detach()``, or
``torch.func.functional_call`` with the tree for ``ts.swap``), compared bitwise
(``torch.equal``) where the arithmetic is the same:

- ``Tensor.backward(inputs=...)`` / ``torch.autograd.backward(inputs=...)`` and
  ``torch.autograd.grad`` with ``allow_unused`` / ``materialize_grads`` / ``is_grads_batched``
  around ``ts.freeze`` / ``ts.unfreeze`` / ``ts.stop_gradient``; ``retain_graph`` with one
  backward inside a block and one after its exit;
- saved-tensor hooks: ``saved_tensors_hooks`` whose unpack runs torch ops, ``save_on_cpu``, a
  forward under ``swap`` then the originals changed in place before the backward, a backward run
  inside a block for a forward made outside it, what ``structural_grad(wrt=)`` packs, and
  ``disable_saved_tensors_hooks`` (torchstruct must not need them);
- hooks: ``Tensor.register_hook`` / ``register_post_accumulate_grad_hook`` on parameters used
  inside ``stop_gradient`` (also through a custom ``autograd.Function``, where the block cuts
  the node's gradient), hooks registered *inside* a block (documented to go to the parameter),
  ``register_multi_grad_hook``, forward pre/post hooks with ``prepend=True`` /
  ``with_kwargs=True`` / ``always_call=True``, global module forward hooks, a user pre-hook that
  replaces a parameter while a context is active, hooks that enter and leave blocks themselves,
  a forward-hook feature extractor, and ``RemovableHandle`` order with ``ts.attach`` /
  ``ts.detach_hooks``;
- grad modes: ``set_detect_anomaly``, ``set_multithreading_enabled(False)``,
  ``inference_mode`` / ``no_grad`` / ``enable_grad`` around and inside blocks, and the hooks'
  application of a tree change under them;
- custom ``autograd.Function`` (a returned input, a view output, ``mark_non_differentiable`` +
  ``once_differentiable``, ``set_materialize_grads(False)``) and ``torch.library.custom_op``
  with ``register_autograd`` (and a mutating custom op under ``ts.constant``).

Two cases once went wrong and are pinned: ``backward(inputs=[p])`` naming a blocked parameter
inside ``stop_gradient`` (the detached alias went to the engine), and the hooks of a parameter
handed straight to a custom Function inside ``stop_gradient``: they see what they see when the
function's backward returns None for it (the documented cut), where the oracle is that function.
"""
import contextlib
import copy
import warnings

import pytest
import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.overrides import _get_current_function_mode_stack
from torch.utils.checkpoint import checkpoint

import torchstruct as ts

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


# --------------------------------------------------------------------------------- helpers
def flags(m):
    return [p.requires_grad for p in m.parameters()]


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))


def rand(*shape, seed=1, grad=False):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g)
    return t.requires_grad_() if grad else t


def same(a, b):
    """Both None, or both tensors bitwise equal."""
    if a is None or b is None:
        return a is None and b is None
    return torch.equal(a, b)


def same_all(xs, ys):
    xs, ys = list(xs), list(ys)
    return len(xs) == len(ys) and all(same(a, b) for a, b in zip(xs, ys))


def grads(m):
    return [None if p.grad is None else p.grad.clone() for p in m.parameters()]


def detached_call(model, blocked, x):
    """The model run with the parameters at ``blocked`` paths detached by hand."""
    params = {n: (p.detach() if n in blocked else p) for n, p in model.named_parameters()}
    return torch.func.functional_call(model, params, (x,))


def no_modes():
    return len(_get_current_function_mode_stack()) == 0


# ================================================================ backward(inputs=), grad()
@pytest.mark.parametrize("where", ["inside", "after"])
def test_backward_inputs_with_freeze_equals_hand_flags(where):
    """``loss.backward(inputs=[...])`` for a loss computed in ``freeze``: inside the block a
    frozen parameter among the inputs is PyTorch's own error; after the exit it requires grad
    again but the graph has no edge to it: left at None, exactly as with flags set by hand."""
    m, ref = mlp(), mlp()
    x = rand(5, 3)
    ref[2].requires_grad_(False)
    loss_ref = ref(x).pow(2).sum()
    with ts.freeze(m, "2"):
        loss = m(x).pow(2).sum()
        if where == "inside":
            with pytest.raises(RuntimeError) as ours:
                loss.backward(inputs=[m[2].weight, m[4].weight], retain_graph=True)
            with pytest.raises(RuntimeError) as plain:
                loss_ref.backward(inputs=[ref[2].weight, ref[4].weight], retain_graph=True)
            assert str(ours.value) == str(plain.value)
    ref[2].requires_grad_(True)
    loss.backward(inputs=[m[0].bias, m[2].weight, m[4].weight])
    loss_ref.backward(inputs=[ref[0].bias, ref[2].weight, ref[4].weight])
    assert same_all(grads(m), grads(ref))
    assert m[2].weight.grad is None and m[4].weight.grad is not None and m[0].weight.grad is None
    assert all(flags(m))


def test_autograd_grad_options_on_a_stop_gradient_forward_equal_the_hand_detached_one():
    """allow_unused / materialize_grads / the 'not used' error / is_grads_batched."""
    m = mlp()
    x = rand(5, 3, grad=True)
    with ts.stop_gradient(m, "2"):
        y = m(x)
    yr = detached_call(m, {"2.weight", "2.bias"}, x)
    ins = [x, m[0].weight, m[2].weight, m[2].bias, m[4].bias]

    got = torch.autograd.grad(y.sum(), ins, allow_unused=True, retain_graph=True)
    want = torch.autograd.grad(yr.sum(), ins, allow_unused=True, retain_graph=True)
    assert same_all(got, want) and got[2] is None and got[3] is None

    got = torch.autograd.grad(y.sum(), ins, allow_unused=True, materialize_grads=True,
                              retain_graph=True)
    want = torch.autograd.grad(yr.sum(), ins, allow_unused=True, materialize_grads=True,
                               retain_graph=True)
    assert same_all(got, want) and torch.equal(got[2], torch.zeros(4, 4))

    with pytest.raises(RuntimeError) as ours:
        torch.autograd.grad(y.sum(), ins, retain_graph=True)
    with pytest.raises(RuntimeError) as plain:
        torch.autograd.grad(yr.sum(), ins, retain_graph=True)
    assert str(ours.value) == str(plain.value)

    basis = torch.eye(2).unsqueeze(1).expand(2, 5, 2)
    got = torch.autograd.grad(y, [x, m[4].weight], basis, is_grads_batched=True,
                              retain_graph=True)
    want = torch.autograd.grad(yr, [x, m[4].weight], basis, is_grads_batched=True)
    assert same_all(got, want)
    assert all(flags(m)) and no_modes()


def test_autograd_grad_inside_stop_gradient_differentiates_the_parameter_itself():
    """Inside the block ``torch.autograd.grad(loss, [p])`` gives ``p`` the gradient of its
    uses outside the block (the parameter, not the detached alias, is differentiated), and
    ``backward(inputs=)`` naming an input or an unselected parameter works there."""
    m = mlp()
    x = rand(5, 3, grad=True)
    out = m(x).pow(2).sum()
    with ts.stop_gradient(m, "0"):
        loss = out + m(x).pow(2).sum()
        g = torch.autograd.grad(loss, [m[0].weight, m[2].weight], retain_graph=True)
        loss.backward(inputs=[x, m[2].weight], retain_graph=True)
        assert m[0].weight.grad is None
    xr = x.detach().requires_grad_()
    ref = m(xr).pow(2).sum() + detached_call(m, {"0.weight", "0.bias"}, xr).pow(2).sum()
    want = torch.autograd.grad(ref, [m[0].weight, m[2].weight, xr])
    assert same_all(g, want[:2])
    assert same(m[2].weight.grad, want[1]) and same(x.grad, want[2])


@pytest.mark.parametrize("call", ["method", "function"])
@pytest.mark.parametrize("where", ["outside", "inside"])
def test_backward_inputs_naming_a_blocked_parameter_inside_stop_gradient(call, where):
    """``inputs=`` names the parameters whose ``.grad`` the backward fills, and ``p.grad`` in
    the block is the parameter's own: the parameter itself is meant (the detached alias once
    went to the engine, which raised)."""
    lin = nn.Linear(2, 1)
    x = torch.tensor([[1.0, 2.0]])
    back = ((lambda loss, inputs: loss.backward(inputs=inputs)) if call == "method"
            else (lambda loss, inputs: torch.autograd.backward(loss, inputs=inputs)))
    loss = lin(x).sum() if where == "outside" else None
    with ts.stop_gradient(lin, "weight"):
        if loss is None:  # inside: the weight is a constant here, the bias still is not
            loss = lin(x).sum() + (lin.weight * 3).sum()
        back(loss, [lin.weight, lin.bias])
        inside = lin.weight.grad
    if where == "outside":
        assert torch.equal(inside, x) and torch.equal(lin.bias.grad, torch.ones(1))
    else:  # a constant in every use: no gradient, as with lin.weight.detach() by hand
        assert inside is None and torch.equal(lin.bias.grad, torch.ones(1))
    assert lin.weight.requires_grad and lin.bias.requires_grad


def test_backward_inputs_naming_a_parameter_inside_swap_fill_the_stand_in():
    """Inside ``swap`` the tree's tensor stands in for the parameter in ``inputs=`` as in
    ``p.grad``: the backward fills the stand-in's gradient and the parameter gets none."""
    lin = nn.Linear(2, 1)
    x = torch.tensor([[1.0, 2.0]])
    tree = {"weight": torch.full((1, 2), 2.0, requires_grad=True),
            "bias": torch.zeros(1, requires_grad=True)}
    with ts.swap(lin, tree):
        lin(x).sum().backward(inputs=[lin.weight])
        assert torch.equal(lin.weight.grad, x)
    assert torch.equal(tree["weight"].grad, x) and lin.weight.grad is None


@pytest.mark.parametrize("kind", ["stop_gradient", "freeze", "swap"])
def test_retain_graph_one_backward_in_the_block_one_after_its_exit(kind):
    """The graph is the forward's: two backwards, across the exit, give the same gradient."""
    m = mlp()
    x = rand(5, 3, grad=True)
    tree = {"2": {"weight": rand(4, 4, seed=3, grad=True)}}
    ctx = {"stop_gradient": lambda: ts.stop_gradient(m, "2"),
           "freeze": lambda: ts.freeze(m, "2"),
           "swap": lambda: ts.swap(m, tree)}[kind]
    with ctx():
        loss = m(x).pow(2).sum()
        loss.backward(retain_graph=True)
    first = grads(m) + [x.grad.clone()]
    loss.backward()
    second = grads(m) + [x.grad]

    ref = mlp()
    xr = x.detach().requires_grad_()
    if kind == "swap":
        stand_in = tree["2"]["weight"]
        with torch.no_grad():
            ref[2].weight.copy_(stand_in)
        assert torch.equal(stand_in.grad, 2 * torch.autograd.grad(
            ref(xr).pow(2).sum(), [ref[2].weight])[0])
    ref[2].weight.requires_grad_(False)
    if kind != "swap":
        ref[2].bias.requires_grad_(False)
    ref(xr).pow(2).sum().backward()
    want = grads(ref) + [xr.grad]
    assert same_all(first, want)
    assert same_all(second, [None if g is None else 2 * g for g in want])
    assert all(flags(m)) and no_modes()


def test_retain_graph_across_an_unfreeze_exit_skips_the_leaf_as_hand_flags_do():
    """Documented (freezing.md, activation checkpointing): a parameter the block turned on is
    off again after it, and the backward after the exit skips it, as the same writes by hand."""
    m, ref = mlp(), mlp()
    for mod in (m, ref):
        mod[0].requires_grad_(False)
    x = rand(5, 3)
    with ts.unfreeze(m, "0"):
        loss = m(x).pow(2).sum()
        loss.backward(retain_graph=True)
    loss.backward()
    ref[0].requires_grad_(True)
    loss_ref = ref(x).pow(2).sum()
    loss_ref.backward(retain_graph=True)
    ref[0].requires_grad_(False)
    loss_ref.backward()
    assert same_all(grads(m), grads(ref))
    assert m[0].weight.grad is not None and not m[0].weight.requires_grad


# ======================================================================= saved-tensor hooks
def test_swap_forward_saves_the_stand_ins_so_in_place_changes_of_the_originals_are_safe():
    """What is packed under swap is what functional_call with the tree packs; changing the
    originals in place before the backward raises no version error and changes nothing."""
    m = mlp()
    x = rand(5, 3, grad=True)
    tree = ts.tree.map(lambda p: p.detach() * 0.5 + 0.1, ts.tree.from_module(m))

    def packed(fn):
        log = []

        def pack(t):
            log.append((tuple(t.shape), t.dtype, isinstance(t, nn.Parameter)))
            return t.clone()

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn()
        return log, out

    log, y = packed(lambda: _in_swap(m, tree, x))
    xr = x.detach().requires_grad_()
    ref = copy.deepcopy(m)
    want_log, yr = packed(lambda: torch.func.functional_call(
        ref, ts.tree.to_flat_dict(tree), (xr,)))
    assert log == want_log and not any(is_param for *_, is_param in log)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(3.0)
    y.pow(2).sum().backward()
    yr.pow(2).sum().backward()
    assert torch.equal(x.grad, xr.grad)
    assert all(p.grad is None for p in m.parameters())


def _in_swap(m, tree, x):
    with ts.swap(m, tree):
        return m(x)


@pytest.mark.parametrize("hooks", ["unpack_clone", "unpack_mul", "save_on_cpu"])
@pytest.mark.parametrize("block", ["swap", "stop_gradient", "constant"])
def test_unpack_hooks_running_inside_a_block_for_a_forward_made_outside(hooks, block):
    """The backward runs inside the block; the unpack hooks' own torch ops must get the saved
    parameters, not stand-ins: the gradients are those of the plain forward."""
    m = mlp()
    x = rand(5, 3, grad=True)
    ref = copy.deepcopy(m)
    xr = x.detach().requires_grad_()
    ref(xr).pow(2).sum().backward()
    make = {
        "unpack_clone": lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t,
                                                                         lambda t: t.clone()),
        "unpack_mul": lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t,
                                                                       lambda t: t * 1),
        "save_on_cpu": lambda: torch.autograd.graph.save_on_cpu(),
    }[hooks]
    tree = ts.tree.map(lambda p: torch.full_like(p, 7.0), ts.tree.from_module(m))
    ctx = {"swap": lambda: ts.swap(m, tree), "stop_gradient": lambda: ts.stop_gradient(m),
           "constant": lambda: ts.constant(m)}[block]
    with make():
        loss = m(x).pow(2).sum()
    with ctx():
        loss.backward()
    assert torch.equal(x.grad, xr.grad)
    assert same_all(grads(m), grads(ref))


@pytest.mark.parametrize("wrt", ["4", "2.weight", "0.bias"])
def test_structural_grad_wrt_packs_what_the_same_flags_by_hand_pack(wrt):
    m = mlp()
    x = rand(5, 3)

    def packs(fn):
        log = []
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: (log.append((tuple(t.shape), t.requires_grad)), t)[1], lambda t: t):
            out = fn()
        return log, out

    log, tree = packs(lambda: ts.structural_grad(m, lambda mm: mm(x).pow(2).sum(), wrt=wrt))
    names = list(ts.tree.to_flat_dict(tree))
    ref = copy.deepcopy(m)
    for n, p in ref.named_parameters():
        p.requires_grad_(n in names)
    params = dict(ref.named_parameters())
    want_log, want = packs(lambda: torch.autograd.grad(ref(x).pow(2).sum(),
                                                       [params[n] for n in names]))
    assert log == want_log
    assert same_all(ts.tree.leaves(tree), want)
    assert all(flags(m))


@pytest.mark.parametrize("kind", ["freeze", "stop_gradient", "swap", "constant", "sg_wrt"])
def test_contexts_need_no_saved_tensor_hooks(kind):
    """Under ``disable_saved_tensors_hooks`` (what some frameworks set) the contexts, blocks
    and structural_grad work as in plain PyTorch."""
    m = mlp()
    x = rand(5, 3)
    ref = copy.deepcopy(m)
    with torch.autograd.graph.disable_saved_tensors_hooks("audit: no saved tensor hooks"):
        if kind == "sg_wrt":
            tree = ts.structural_grad(m, lambda mm: mm(x).pow(2).sum(), wrt="2")
            ref[0].requires_grad_(False)
            ref[4].requires_grad_(False)
            want = torch.autograd.grad(ref(x).pow(2).sum(), list(ref[2].parameters()))
            assert same_all(ts.tree.leaves(tree), want)
        else:
            ctx = {"freeze": lambda: ts.freeze(m, "2"),
                   "stop_gradient": lambda: ts.stop_gradient(m, "2"),
                   "swap": lambda: ts.swap(m, {"2.bias": torch.zeros(4)}),
                   "constant": lambda: ts.constant(m, "2")}[kind]
            with ctx():
                loss = m(x).pow(2).sum()
            loss.backward()
            if kind == "swap":
                with torch.no_grad():
                    ref[2].bias.zero_()
            if kind == "swap":
                ref[2].bias.requires_grad_(False)
            elif kind in ("freeze", "stop_gradient"):
                ref[2].requires_grad_(False)
            ref(x).pow(2).sum().backward()
            assert same_all(grads(m), grads(ref))
    assert all(flags(m)) and no_modes()


def test_selective_checkpoint_under_freeze_backward_after_the_exit():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return (CheckpointPolicy.MUST_SAVE if op in (torch.ops.aten.mm.default,
                                                     torch.ops.aten.addmm.default)
                else CheckpointPolicy.PREFER_RECOMPUTE)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 1)

        def forward(self, x, ck=True):
            h = torch.tanh(self.a(x))
            f = lambda t: torch.tanh(self.b(torch.sin(t)))  # noqa: E731
            if ck:
                h = checkpoint(f, h, use_reentrant=False,
                               context_fn=lambda: create_selective_checkpoint_contexts(policy))
            else:
                h = f(h)
            return self.c(h)

    torch.manual_seed(0)
    m = Net()
    ref = copy.deepcopy(m)
    x = rand(4, 3, grad=True)
    with ts.freeze(m, "b"):
        loss = m(x).pow(2).sum()
    loss.backward()
    ref.b.requires_grad_(False)
    xr = x.detach().requires_grad_()
    ref(xr, ck=False).pow(2).sum().backward()
    assert same_all(grads(m), grads(ref)) and torch.equal(x.grad, xr.grad)
    assert m.b.weight.grad is None and all(flags(m))


# ================================================================================== hooks
class Scale(torch.autograd.Function):
    """A fused-kernel stand-in: the parameter is handed straight to ``apply``."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, g * x


def test_parameter_hooks_fire_only_for_uses_outside_stop_gradient():
    """Module forward (no custom function): a tensor hook and a post-accumulate-grad hook on a
    parameter used inside and outside the block get exactly the hand-detached gradient."""
    m = mlp()
    x = rand(5, 3)
    log = []
    w = m[2].weight
    w.register_hook(lambda g: log.append(("hook", g.clone())))
    w.register_post_accumulate_grad_hook(lambda p: log.append(("post", p.grad.clone())))
    with ts.stop_gradient(m, "2"):
        inside = m(x).pow(2).sum()
    (inside + m(x).sum()).backward()
    ref = copy.deepcopy(m)
    ref.zero_grad(set_to_none=True)
    want = torch.autograd.grad(detached_call(ref, {"2.weight", "2.bias"}, x).pow(2).sum()
                               + ref(x).sum(), [ref[2].weight])[0]
    assert [k for k, _ in log] == ["hook", "post"]
    assert torch.equal(log[0][1], want) and torch.equal(log[1][1], want)

    log.clear()
    m.zero_grad(set_to_none=True)
    with ts.stop_gradient(m, "2"):
        only_inside = m(x).pow(2).sum()
    only_inside.backward()
    assert log == [] and w.grad is None


# The cut of a parameter handed straight to a custom Function's ``apply`` is, for the
# parameter's and the node's hooks, exactly the function's backward returning None for it
# (docs/stop_gradient.md): PyTorch then calls the parameter's tensor hooks with None and runs
# its post-accumulate-grad hooks, and a node hook may not put a gradient where None was. The
# oracle is the same function whose backward returns None for the weight, in plain PyTorch.
class ScaleNoWeightGrad(Scale):
    @staticmethod
    def backward(ctx, g):
        return Scale.backward(ctx, g)[0], None


def _hooked_run(cut: bool):
    """Hooks on the weight, a backward through the custom function: what the hooks saw."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 3)
    x = torch.randn(3, 3, requires_grad=True)
    seen = []
    lin.weight.register_hook(lambda g: seen.append(("tensor hook", g)))
    lin.weight.register_post_accumulate_grad_hook(lambda p: seen.append(("post", p.grad)))
    if cut:
        with ts.stop_gradient(lin):
            y = Scale.apply(x, lin.weight).sum()
    else:
        y = ScaleNoWeightGrad.apply(x, lin.weight).sum()
    y.backward()
    return seen, lin.weight.grad, x.grad


def test_hooks_on_a_parameter_cut_in_a_custom_function_see_a_none_gradient():
    ours, plain = _hooked_run(cut=True), _hooked_run(cut=False)
    assert ours[0] == plain[0] == [("tensor hook", None), ("post", None)]
    assert ours[1] is None and plain[1] is None and torch.equal(ours[2], plain[2])


def test_node_hook_on_a_cut_custom_function_sees_none_where_the_parameter_was():
    def run(fn):
        lin = nn.Linear(3, 3)
        x = torch.randn(3, 3, requires_grad=True)
        with (ts.stop_gradient(lin) if fn is Scale else contextlib.nullcontext()):
            y = fn.apply(x, lin.weight)
        seen = []
        y.grad_fn.register_hook(lambda gi, go: seen.append([g is None for g in gi]))
        y.sum().backward(retain_graph=True)
        y.grad_fn.register_hook(lambda gi, go: (gi[0] * 2, torch.ones(3, 3)))
        with pytest.raises(RuntimeError) as caught:
            y.sum().backward()
        return seen, str(caught.value)

    # the recording hook runs in both backwards, before the replacing one raises
    assert run(Scale) == run(ScaleNoWeightGrad) == ([[False, True]] * 2,
                                                    "can't replace a None gradient with a "
                                                    "non-None value")


def test_custom_function_cut_with_grad_options_matches_the_hand_detached_call():
    lin = nn.Linear(3, 3)
    w = lin.weight
    x = rand(3, 3, grad=True)
    with ts.stop_gradient(lin):
        y = Scale.apply(x, lin.weight).sum()
    yr = Scale.apply(x, w.detach()).sum()
    for kw in ({"allow_unused": True}, {"allow_unused": True, "materialize_grads": True}):
        got = torch.autograd.grad(y, [x, w], retain_graph=True, **kw)
        want = torch.autograd.grad(yr, [x, w], retain_graph=True, **kw)
        assert same_all(got, want)
    with pytest.raises(RuntimeError) as ours:
        torch.autograd.grad(y, [x, w], retain_graph=True)
    with pytest.raises(RuntimeError) as plain:
        torch.autograd.grad(yr, [x, w], retain_graph=True)
    assert str(ours.value) == str(plain.value)
    y.backward(inputs=[w, x], retain_graph=True)
    assert w.grad is None and torch.equal(x.grad, w.detach())
    fired = []
    h = torch.autograd.graph.register_multi_grad_hook(
        [x, w], lambda gs: fired.append([g is None for g in gs]))
    try:
        y.backward(retain_graph=True)
        yr.backward()
    finally:
        h.remove()
    assert fired == [[False, True], [False, True]]
    # the cut is the forward's: it holds for a backward after the exit, and a forward made
    # outside the block is not cut by a backward run inside one
    y.backward()
    assert w.grad is None
    y2 = Scale.apply(x, w).sum()
    with ts.stop_gradient(lin):
        y2.backward()
    assert torch.equal(w.grad, x.detach())


def test_hooks_registered_inside_blocks_go_to_the_parameter():
    """Documented: methods that write a hook go to the parameter inside swap/stop_gradient."""
    lin = nn.Linear(3, 2)
    x = rand(4, 3)
    log = []
    stand_in = torch.zeros(2, 3, requires_grad=True)
    with ts.swap(lin, {"weight": stand_in}):
        lin.weight.register_hook(lambda g: log.append(("swap-hook", g.clone())))
        lin.weight.register_post_accumulate_grad_hook(
            lambda p: log.append(("swap-post", p is lin.weight)))
        lin(x).sum().backward()          # only the stand-in is used: the hooks stay silent
    assert log == [] and stand_in.grad is not None and lin.weight.grad is None
    with ts.stop_gradient(lin):
        lin.weight.register_post_accumulate_grad_hook(lambda p: log.append(("sg-post", True)))
    lin(x).sum().backward()
    assert [k for k, _ in log] == ["swap-hook", "swap-post", "sg-post"]
    assert torch.equal(log[0][1], x.sum(0).expand(2, 3)) and log[1][1] is True


def test_multi_grad_hook_over_inputs_and_a_blocked_parameter():
    m = mlp()
    x = rand(5, 3, grad=True)
    fired = []

    def record(gs):
        fired.append([None if g is None else g.clone() for g in gs])

    h = torch.autograd.graph.register_multi_grad_hook([x, m[0].weight, m[4].weight], record)
    try:
        with ts.stop_gradient(m, "0"):
            y = m(x).pow(2).sum()
        y.backward()
    finally:
        h.remove()
    xr = x.detach().requires_grad_()
    h = torch.autograd.graph.register_multi_grad_hook([xr, m[0].weight, m[4].weight], record)
    try:
        m.zero_grad(set_to_none=True)
        detached_call(m, {"0.weight", "0.bias"}, xr).pow(2).sum().backward()
    finally:
        h.remove()
    assert len(fired) == 2 and same_all(fired[0], fired[1]) and fired[0][1] is None


def test_user_forward_pre_hooks_after_a_tree_change_see_the_applied_flags():
    """Hooks registered after attach (plain and with_kwargs) run after torchstruct's and see
    the new head frozen; whatever a prepend=True hook saw, the forward itself runs with the
    declared flags (the new head gets no gradient)."""
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    ts.freeze_except(m, "1")                  # permanent
    seen = []

    def read(tag):
        return lambda mod, *a: seen.append((tag, mod[2].weight.requires_grad)
                                           if len(mod) > 2 else (tag, None))

    m.register_forward_pre_hook(read("plain"))
    m.register_forward_pre_hook(read("kwargs"), with_kwargs=True)
    m.register_forward_pre_hook(read("prepend"), prepend=True)
    m.append(nn.Linear(2, 2))                 # a new head after the declaration
    m(rand(4, 3)).sum().backward()
    assert [t for t, _ in seen] == ["prepend", "plain", "kwargs"]
    assert dict(seen)["plain"] is False and dict(seen)["kwargs"] is False
    assert m[2].weight.grad is None and m[1].weight.grad is not None
    assert flags(m) == [False, False, True, True, False, False]


@pytest.mark.parametrize("how", ["root_hook", "global_hook"])
def test_a_pre_hook_that_replaces_a_parameter_inside_freeze(how):
    """A user pre-hook (on the root, after attach; or a global one) puts a new Parameter in
    place of a frozen one: it is frozen at its forward (no gradient), and after the exit it
    has its own starting flag."""
    m = mlp()
    x = rand(5, 3)
    new = []

    def replace(mod, args):
        if mod is m and not new:
            mod[2].weight = nn.Parameter(torch.ones(4, 4))
            new.append(mod[2].weight)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ts.freeze(m, "2"):
            h = (m.register_forward_pre_hook(replace) if how == "root_hook"
                 else torch.nn.modules.module.register_module_forward_pre_hook(replace))
            try:
                m(x).pow(2).sum().backward()
            finally:
                h.remove()
            assert not new[0].requires_grad and new[0].grad is None
            assert m[4].weight.grad is not None
    assert new[0].requires_grad and all(flags(m))


@pytest.mark.parametrize("kind", ["stop_gradient", "freeze"])
def test_hooks_that_enter_and_leave_a_block_around_a_submodule(kind):
    """A hook-based tool: a pre-hook enters a bare block on the submodule, its forward hook
    (always_call) leaves it. Equal to the submodule's parameters frozen by hand."""
    m, ref = mlp(), mlp()
    x = rand(5, 3, grad=True)
    state = {}
    make = ts.stop_gradient if kind == "stop_gradient" else ts.freeze
    def enter(mod, args):
        state["c"] = make(mod)

    def leave(mod, args, out):
        state.pop("c").__exit__(None, None, None)   # returns None: the output stands

    m[2].register_forward_pre_hook(enter)
    m[2].register_forward_hook(leave, always_call=True)
    m(x).pow(2).sum().backward()
    ref[2].requires_grad_(False)
    xr = x.detach().requires_grad_()
    ref(xr).pow(2).sum().backward()
    assert same_all(grads(m), grads(ref)) and torch.equal(x.grad, xr.grad)
    assert all(flags(m)) and no_modes() and not state
    with pytest.raises(RuntimeError):         # a forward that raises inside the submodule
        m[2](rand(5, 7))
    assert all(flags(m)) and no_modes() and not state


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("kind", ["stop_gradient", "freeze"])
def test_hook_entered_blocks_inside_an_activation_checkpoint(kind, reentrant):
    """The recomputation runs the submodule's hooks again (entering the block again): the
    gradients equal the submodule frozen by hand, without checkpointing."""
    m, ref = mlp(), mlp()
    x = rand(5, 3, grad=True)
    state = []
    make = ts.stop_gradient if kind == "stop_gradient" else ts.freeze

    def enter(mod, args):
        state.append(make(mod))

    def leave(mod, args, out):
        state.pop().__exit__(None, None, None)

    m[2].register_forward_pre_hook(enter)
    m[2].register_forward_hook(leave, always_call=True)
    h = checkpoint(lambda t: m[3](m[2](m[1](m[0](t)))), x, use_reentrant=reentrant)
    m[4](h).pow(2).sum().backward()
    ref[2].requires_grad_(False)
    xr = x.detach().requires_grad_()
    ref(xr).pow(2).sum().backward()
    assert same_all(grads(m), grads(ref)) and torch.equal(x.grad, xr.grad)
    assert not state and all(flags(m)) and no_modes()


@pytest.mark.parametrize("where", ["inside", "after"])
@pytest.mark.parametrize("kind", ["stop_gradient", "swap", "freeze"])
def test_backward_in_another_thread_recomputes_a_checkpoint_made_in_a_block(kind, where):
    """What a CUDA backward does (the engine's device thread): a non-reentrant checkpoint made
    inside a block, backpropagated from another thread, inside the block or after its exit."""
    import threading

    m, ref = mlp(), mlp()
    x = rand(5, 3, grad=True)
    stand = rand(4, 4, seed=7)
    ctx = {"stop_gradient": lambda: ts.stop_gradient(m, "2"),
           "swap": lambda: ts.swap(m, {"2.weight": stand}),
           "freeze": lambda: ts.freeze(m, "2")}[kind]
    errors = []

    def backward(loss):
        try:
            loss.backward()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def in_thread(loss):
        t = threading.Thread(target=backward, args=(loss,))
        t.start()
        t.join()

    with ctx():
        h = checkpoint(lambda t: m[3](m[2](m[1](m[0](t)))), x, use_reentrant=False)
        loss = m[4](h).pow(2).sum()
        if where == "inside":
            in_thread(loss)
    if where == "after":
        in_thread(loss)
    assert not errors, errors
    if kind == "swap":
        with torch.no_grad():
            ref[2].weight.copy_(stand)
        ref[2].weight.requires_grad_(False)
    else:
        ref[2].requires_grad_(False)
    xr = x.detach().requires_grad_()
    ref(xr).pow(2).sum().backward()
    assert same_all(grads(m), grads(ref)) and torch.equal(x.grad, xr.grad)
    assert all(flags(m)) and no_modes()


def test_a_user_pre_hook_that_writes_flags_at_every_forward():
    """A write by someone else (a user's hook, at each forward) stands against the active
    context, and the flags after the exit are what the hook wrote (docs/freezing.md)."""
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))

    def freeze_first(mod, args):
        mod[0].requires_grad_(False)

    m.register_forward_pre_hook(freeze_first)
    ts.attach(m)
    m(rand(3, 2))
    assert flags(m) == [False, False, True, True] and not ts.is_trainable(m, "0.weight")
    with ts.unfreeze(m):
        assert all(flags(m))                      # entered after the write: applies on top
        m(rand(3, 2)).sum().backward()            # the hook writes again: it stands
        assert flags(m) == [False, False, True, True] and m[0].weight.grad is None
        assert not ts.is_trainable(m, "0.weight")
    assert flags(m) == [False, False, True, True]

    m2 = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))

    def unfreeze_head(mod, args):
        mod[1].requires_grad_(True)

    m2.register_forward_pre_hook(unfreeze_head)
    with ts.freeze(m2):
        assert not any(flags(m2))
        m2(rand(3, 2)).sum().backward()
        assert flags(m2) == [False, False, True, True] and m2[1].weight.grad is not None
        assert [ts.is_trainable(m2, n) for n, _ in m2.named_parameters()] == flags(m2)
    assert all(flags(m2))


def test_swap_entered_by_hooks_with_kwargs_is_left_when_the_forward_raises():
    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x, boom=False):
            y = self.lin(x)
            if boom:
                raise ValueError("boom")
            return y

    m = Boom()
    state = {}
    zeros = torch.zeros(2, 2)
    def enter(mod, args, kwargs):
        state["c"] = ts.swap(mod, {"lin.weight": zeros})

    def leave(mod, args, kwargs, out):
        state.pop("c").__exit__(None, None, None)

    m.register_forward_pre_hook(enter, with_kwargs=True)
    m.register_forward_hook(leave, with_kwargs=True, always_call=True)
    x = rand(3, 2)
    assert torch.equal(m(x), torch.nn.functional.linear(x, zeros, m.lin.bias))
    with pytest.raises(ValueError):
        m(x, boom=True)
    assert no_modes() and not state
    assert torch.equal(m.lin(x), torch.nn.functional.linear(x, m.lin.weight, m.lin.bias))


@pytest.mark.parametrize("kind", ["swap", "stop_gradient"])
def test_forward_hook_feature_extractor_inside_blocks(kind):
    """Activations stored by forward hooks (module and global) inside a block; a loss built
    from them after the exit has the hand-made computation's values and gradients."""
    m = mlp()
    x = rand(5, 3, grad=True)
    tree = {"2": {"weight": rand(4, 4, seed=5), "bias": rand(4, seed=6)}}
    feats, glob = {}, []
    handles = [m[1].register_forward_hook(lambda mod, a, o: feats.__setitem__("h1", o)),
               m[3].register_forward_hook(lambda mod, a, o: feats.__setitem__("h3", o))]
    handles.append(torch.nn.modules.module.register_module_forward_hook(
        lambda mod, a, o: glob.append(o) if mod is m[2] else None))
    try:
        with (ts.swap(m, tree) if kind == "swap" else ts.stop_gradient(m, "2")):
            m(x)
    finally:
        for h in handles:
            h.remove()
    loss = feats["h1"].pow(2).sum() + feats["h3"].pow(2).sum() + glob[0].sum()

    ref = copy.deepcopy(m)
    xr = x.detach().requires_grad_()
    if kind == "swap":
        params = dict(ref.named_parameters())
        params.update(ts.tree.to_flat_dict(tree))
    else:
        params = {n: (p.detach() if n.startswith("2.") else p)
                  for n, p in ref.named_parameters()}
    h1 = torch.tanh(torch.func.functional_call(ref[0], {"weight": params["0.weight"],
                                                        "bias": params["0.bias"]}, (xr,)))
    h2 = torch.nn.functional.linear(h1, params["2.weight"], params["2.bias"])
    ref_loss = h1.pow(2).sum() + torch.tanh(h2).pow(2).sum() + h2.sum()
    assert torch.equal(loss, ref_loss)
    loss.backward()
    ref_loss.backward()
    assert torch.equal(x.grad, xr.grad) and same_all(grads(m), grads(ref))


def test_removable_handles_and_attach_detach_keep_user_hooks_in_order():
    m = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Linear(2, 1))
    log = []
    h1 = m.register_forward_pre_hook(lambda mod, a: log.append("u1"))
    ts.attach(m)
    ts.attach(m)                                  # attaching twice adds nothing
    n_attached = len(m._forward_pre_hooks)
    assert n_attached == 2
    h2 = m.register_forward_pre_hook(lambda mod, a: log.append("u2"))
    h3 = m[1].register_forward_hook(lambda mod, a, o: log.append("bn"))
    with ts.freeze(m, "0", "1"):
        stats = m[1].running_mean.clone()
        m(rand(4, 2))
        assert torch.equal(stats, m[1].running_mean)       # held
    assert log == ["u1", "u2", "bn"]
    h1.remove()                                   # a user handle leaves torchstruct's hook
    m.append(nn.Linear(1, 1))
    with ts.freeze_except(m, "2"):
        pass
    ts.freeze(m, "3")                             # permanent, then a new layer
    m.append(nn.Linear(1, 1))
    m(rand(4, 2))
    assert not m[3].weight.requires_grad and m[4].weight.requires_grad  # "3" only
    log.clear()
    ts.detach_hooks(m)                            # removes torchstruct's hooks only
    m(rand(4, 2))
    assert log == ["u2", "bn"] and len(m._forward_pre_hooks) == 1
    assert len(m[1]._forward_pre_hooks) == 0 and len(m[1]._forward_hooks) == 1
    h2.remove()
    h3.remove()
    assert not m._forward_pre_hooks and not m[1]._forward_hooks


# ============================================================================= grad modes
@pytest.mark.parametrize("kind", ["stop_gradient", "swap"])
def test_detect_anomaly_in_blocks_matches_plain(kind):
    m = mlp()
    x = rand(5, 3, grad=True)
    tree = {"0": {"weight": rand(4, 3, seed=4)}}

    def block():
        return ts.stop_gradient(m, "0") if kind == "stop_gradient" else ts.swap(m, tree)

    def ref_call(xx):
        if kind == "stop_gradient":
            return detached_call(m, {"0.weight", "0.bias"}, xx)
        params = dict(m.named_parameters())
        params["0.weight"] = tree["0"]["weight"]
        return torch.func.functional_call(m, params, (xx,))

    with torch.autograd.set_detect_anomaly(True):
        with block():
            y = m(x).pow(2).sum()
        y.backward()
        xr = x.detach().requires_grad_()
        g_m = grads(m)
        m.zero_grad(set_to_none=True)
        ref_call(xr).pow(2).sum().backward()
        assert torch.equal(x.grad, xr.grad) and same_all(g_m, grads(m))
        with block():   # sqrt(0) in backward: NaN, found by anomaly mode
            bad = (m(x) - m(x).detach()).pow(2).sum().sqrt()
        with pytest.raises(RuntimeError) as ours:
            bad.backward()
        with pytest.raises(RuntimeError) as plain:
            (ref_call(xr) - ref_call(xr).detach()).pow(2).sum().sqrt().backward()
        assert str(ours.value) == str(plain.value) and "nan" in str(ours.value)
    assert not torch.is_anomaly_enabled() and no_modes()


@pytest.mark.parametrize("kind", ["stop_gradient", "freeze", "swap"])
def test_multithreading_disabled_checkpoint_recompute_after_the_exit(kind):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 1)

        def forward(self, x, ck=True):
            h = torch.tanh(self.a(x))
            f = lambda t: torch.tanh(self.b(t))  # noqa: E731
            h = checkpoint(f, h, use_reentrant=False) if ck else f(h)
            return self.c(h)

    torch.manual_seed(0)
    m = Net()
    ref = copy.deepcopy(m)
    x = rand(4, 3, grad=True)
    stand = {"b": {"weight": rand(3, 3, seed=8)}}
    ctx = {"stop_gradient": lambda: ts.stop_gradient(m, "b"), "freeze": lambda: ts.freeze(m, "b"),
           "swap": lambda: ts.swap(m, stand)}[kind]
    with torch.autograd.grad_mode.set_multithreading_enabled(False):
        with ctx():
            loss = m(x).pow(2).sum()
        loss.backward()
    if kind == "swap":
        with torch.no_grad():
            ref.b.weight.copy_(stand["b"]["weight"])
        ref.b.weight.requires_grad_(False)
    else:
        ref.b.requires_grad_(False)
    xr = x.detach().requires_grad_()
    ref(xr, ck=False).pow(2).sum().backward()
    assert torch.equal(x.grad, xr.grad) and same_all(grads(m), grads(ref))


def test_grad_modes_inside_blocks():
    """inference_mode and no_grad inside swap / stop_gradient give the stand-ins' values;
    enable_grad inside no_grad inside swap still reaches the stand-in."""
    m = mlp()
    x = rand(5, 3)
    tree = ts.tree.map(lambda p: p.detach() * 0.5, ts.tree.from_module(m))
    want = torch.func.functional_call(m, ts.tree.to_flat_dict(tree), (x,))
    with ts.swap(m, tree):
        with torch.inference_mode():
            a = m(x)
        with torch.no_grad():
            b = m(x)
    with torch.inference_mode(), ts.swap(m, tree):
        c = m(x)
    assert torch.equal(a, want) and torch.equal(b, want) and torch.equal(c, want)
    assert a.is_inference() and not b.requires_grad

    stand = rand(4, 4, seed=9, grad=True)
    with torch.no_grad(), ts.swap(m, {"2.weight": stand}):
        with torch.enable_grad():
            y = m(x).pow(2).sum()
    y.backward()
    params = dict(m.named_parameters())
    params["2.weight"] = stand.detach().requires_grad_()
    ref = torch.func.functional_call(m, params, (x,)).pow(2).sum()
    ref_g = torch.autograd.grad(ref, [params["2.weight"]])[0]
    assert torch.equal(stand.grad, ref_g) and m[2].weight.grad is None
    assert m[0].weight.grad is not None                      # unswapped: trained as usual

    with ts.stop_gradient(m, "2"), torch.inference_mode():
        d = m(x)
    assert torch.equal(d, m(x).detach())
    assert all(flags(m)) and no_modes()


def test_swap_with_a_tree_made_under_inference_mode_behaves_as_functional_call():
    m = mlp()
    x = rand(5, 3)
    with torch.inference_mode():
        tree = ts.tree.map(lambda p: p * 0.5, ts.tree.from_module(m))
    want = torch.func.functional_call(m, ts.tree.to_flat_dict(tree), (x,))
    with torch.no_grad(), ts.swap(m, tree):
        assert torch.equal(m(x), want)
    xg = x.clone().requires_grad_()
    with pytest.raises(RuntimeError) as plain:
        torch.func.functional_call(m, ts.tree.to_flat_dict(tree), (xg,))
    with pytest.raises(RuntimeError) as ours:
        with ts.swap(m, tree):
            m(xg)
    assert str(ours.value) == str(plain.value)
    assert all(flags(m)) and no_modes()


def test_flop_counter_sees_the_work_of_the_hand_made_computation():
    """FlopCounterMode (a dispatch mode) around a stop_gradient step and a structural_grad
    with wrt counts exactly the products plain PyTorch with those flags runs."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    x = rand(4, 8, grad=True)

    def count(fn):
        with FlopCounterMode(display=False) as fc:
            fn()
        return {str(k): v for k, v in fc.get_flop_counts()["Global"].items()}

    def ours():
        with ts.stop_gradient(m, "2"):
            y = m(x).sum()
        y.backward()

    def plain():
        r = copy.deepcopy(m)
        r[2].requires_grad_(False)
        r(x.detach().requires_grad_()).sum().backward()

    assert count(ours) == count(plain)

    def ours_sg():
        ts.structural_grad(m, lambda mm: mm(x).sum(), wrt="4")

    def plain_sg():
        r = copy.deepcopy(m)
        r[0].requires_grad_(False)
        r[2].requires_grad_(False)
        torch.autograd.grad(r(x).sum(), list(r[4].parameters()))

    assert count(ours_sg) == count(plain_sg)
    with ts.constant(m, "0"):                    # a dispatch mode inside constant
        with FlopCounterMode(display=False) as fc:
            m(x)
    assert fc.get_total_flops() == 2 * 4 * (8 * 8 + 8 * 8 + 8 * 1)  # the forward addmms
    assert all(flags(m)) and no_modes()


def test_a_user_function_mode_entered_after_a_bare_block_survives_its_exit():
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    lin = nn.Linear(2, 2)
    x = rand(3, 2)
    blk = ts.stop_gradient(lin)
    user = Count()
    user.__enter__()
    try:
        y1 = lin(x)
        blk.__exit__(None, None, None)          # the block leaves; the user's mode stays
        assert [type(mo) for mo in _get_current_function_mode_stack()] == [Count]
        before = Count.n
        y2 = lin(x)
        assert Count.n > before
    finally:
        user.__exit__(None, None, None)
    assert no_modes() and not y1.requires_grad and y2.requires_grad
    y2.sum().backward()
    assert torch.equal(lin.weight.grad, x.sum(0).expand(2, 2))


def test_hooks_reading_flags_during_a_structural_grad_wrt_forward():
    """Documented: during the callable, exactly the asked parameters require grad; module
    (with_kwargs) and global forward pre-hooks read that, and every flag is back afterwards."""
    m = mlp()
    seen = []

    def on_root(mod, args, kwargs):
        seen.append(("root", flags(mod)))

    def on_any(mod, args):
        if isinstance(mod, nn.Linear) and mod is m[4]:
            seen.append(("global", [p.requires_grad for p in mod.parameters(recurse=False)]))

    handles = [m.register_forward_pre_hook(on_root, with_kwargs=True),
               torch.nn.modules.module.register_module_forward_pre_hook(on_any)]
    try:
        ts.structural_grad(m, lambda mm: mm(rand(4, 3)).sum(), wrt="4.bias")
    finally:
        for h in handles:
            h.remove()
    assert seen == [("root", [False] * 5 + [True]), ("global", [False, True])]
    assert all(flags(m))


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad", "enable_grad"])
def test_the_hook_applies_a_tree_change_at_a_forward_under_any_grad_mode(mode):
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    ts.freeze_except(m, "1")
    m.append(nn.Linear(1, 1))
    with getattr(torch, mode)():
        m(rand(3, 2))
    assert flags(m) == [False, False, True, True, False, False]


# =========================================================== custom functions and ops
class ReturnsInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, x):
        ctx.save_for_backward(x)
        return w, w * x

    @staticmethod
    def backward(ctx, g1, g2):
        x, = ctx.saved_tensors
        return g1 + g2 * x, None


class ViewOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w):
        return w.view(-1)

    @staticmethod
    def backward(ctx, g):
        return g.view(3, 3)


class NonDiff(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, x):
        i = w.argmax(0)
        ctx.mark_non_differentiable(i)
        ctx.save_for_backward(x)
        return (w * x).sum(0), i

    @staticmethod
    @once_differentiable
    def backward(ctx, g, gi):
        x, = ctx.saved_tensors
        return g.expand_as(x) * x, g.expand_as(x)


class NoMaterialize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, x):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(w, x)
        return w * x, x.clone()

    @staticmethod
    def backward(ctx, g, g2):
        w, x = ctx.saved_tensors
        gw = None if g is None else g * x
        gx = None if g is None else g * w
        if g2 is not None:
            gx = g2 if gx is None else gx + g2
        return gw, gx


def _custom_loss(fn, w, x):
    if fn is ReturnsInput:
        a, b = ReturnsInput.apply(w, x)
        return (a * 2 + b).pow(2).sum()
    if fn is ViewOut:
        return (ViewOut.apply(w) * x.reshape(-1)).pow(2).sum()
    if fn is NonDiff:
        a, i = NonDiff.apply(w, x)
        return a.pow(2).sum() + i.float().sum()
    a, _ = NoMaterialize.apply(w, x)
    return a.pow(2).sum()


@pytest.mark.parametrize("fn", [ReturnsInput, ViewOut, NonDiff, NoMaterialize],
                         ids=lambda f: f.__name__)
def test_unusual_custom_functions_inside_stop_gradient_equal_the_hand_detached_call(fn):
    lin = nn.Linear(3, 3)
    x0 = rand(3, 3, seed=2)
    x = x0.clone().requires_grad_()
    with ts.stop_gradient(lin):
        loss = _custom_loss(fn, lin.weight, x)
    if loss.requires_grad:
        loss.backward()
    xr = x0.clone().requires_grad_()
    ref = _custom_loss(fn, lin.weight.detach(), xr)
    if ref.requires_grad:
        ref.backward()
    assert torch.equal(loss, ref) and loss.requires_grad == ref.requires_grad
    assert lin.weight.grad is None and same(x.grad, xr.grad)


@torch.library.custom_op("tsauditautograd::mylinear", mutates_args=())
def _mylinear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.t()


@_mylinear.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[0])


def _mylinear_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _mylinear_backward(ctx, g):
    x, w = ctx.saved_tensors
    return g @ w, g.t() @ x


_mylinear.register_autograd(_mylinear_backward, setup_context=_mylinear_setup)


@torch.library.custom_op("tsauditautograd::scale_", mutates_args=("w",))
def _scale_(w: torch.Tensor, s: float) -> None:
    w.mul_(s)


class OpNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        return _mylinear(torch.tanh(_mylinear(x, self.a.weight)), self.b.weight)


def test_library_custom_op_with_register_autograd_in_stop_gradient_and_swap():
    torch.manual_seed(0)
    m = OpNet()
    x = rand(5, 3, grad=True)
    with ts.stop_gradient(m, "a"):
        y = m(x).pow(2).sum()
    y.backward()
    xr = x.detach().requires_grad_()
    ref = _mylinear(torch.tanh(_mylinear(xr, m.a.weight.detach())), m.b.weight)
    g = torch.autograd.grad(ref.pow(2).sum(), [xr, m.b.weight])
    assert m.a.weight.grad is None and torch.equal(x.grad, g[0])
    assert torch.equal(m.b.weight.grad, g[1])

    m.zero_grad(set_to_none=True)
    stand = rand(2, 4, seed=4, grad=True)
    with ts.swap(m, {"b.weight": stand}):
        y = m(x.detach()).pow(2).sum()
    y.backward()
    s2 = stand.detach().requires_grad_()
    ref = _mylinear(torch.tanh(_mylinear(x.detach(), m.a.weight)), s2).pow(2).sum()
    assert torch.equal(y, ref)
    g = torch.autograd.grad(ref, [s2, m.a.weight])
    assert torch.equal(stand.grad, g[0]) and torch.equal(m.a.weight.grad, g[1])
    assert m.b.weight.grad is None and no_modes()


def test_a_mutating_library_custom_op_is_refused_by_constant():
    net = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    before = [p.detach().clone() for p in net.parameters()]
    with ts.constant(net, "0"):
        with pytest.raises(RuntimeError, match="'0.weight'"):
            _scale_(net[0].weight.detach(), 2.0)
        with pytest.raises(RuntimeError, match="'0.bias'"):
            torch.ops.tsauditautograd.scale_(net[0].bias.data, 3.0)
        _scale_(net[1].weight.detach(), 2.0)          # not selected: allowed
    after = [p.detach() for p in net.parameters()]
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])
    assert torch.equal(after[2], 2 * before[2]) and torch.equal(after[3], before[3])
