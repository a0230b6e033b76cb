"""Outside-eyes audit: non-reentrant activation checkpoints (``use_reentrant=False``) whose
forward ran inside ``stop_gradient`` / ``swap`` blocks (and flag contexts) recompute, in
backward, the forward again, wherever and whenever the backward runs.

Oracle: the same code without ``torch.utils.checkpoint`` (bitwise-equal gradients), or plain
PyTorch (``functional_call``, ``.detach()``). All layers are square (4x4), so a recomputation
that saved other tensors would pass torch's own check (shapes, dtypes, devices) and only the
values can tell. After every backward: the flags are what they were, no torch function mode is
left on the stack, and ``ts.is_trainable`` agrees with the flags.
"""
import threading

import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import torchstruct as ts


# ----------------------------------------------------------------------------- helpers
def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))


def rand(*shape, seed, grad=True):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return t.requires_grad_(grad)


def call(ck, fn, *args):
    return checkpoint(fn, *args, use_reentrant=False) if ck else fn(*args)


def loss_of(y):
    return torch.tanh(y).pow(2).sum()


def flags(m):
    return [p.requires_grad for p in m.parameters()]


def stack():
    return torch.overrides._get_current_function_mode_stack()


def clean(m, before):
    """Flags back, nothing left on the mode stack, is_trainable agrees with the flags."""
    assert stack() == []
    assert flags(m) == before
    for name, p in m.named_parameters():
        assert ts.is_trainable(m, name) == p.requires_grad, name


def collected(m, extra=()):
    """The ``.grad`` of every parameter of ``m`` and of ``extra`` (clones, None kept)."""
    return [None if t.grad is None else t.grad.clone() for t in (*m.parameters(), *extra)]


def same(a, b):
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        assert (u is None) == (v is None), i
        if u is not None:
            torch.testing.assert_close(u, v, rtol=0, atol=0, msg=f"gradient {i} differs")


def block(kind, m, sel):
    """A ``stop_gradient`` over the paths in ``sel`` or a ``swap`` of them for fixed stand-ins
    that require grad (the stand-ins are returned too)."""
    if kind == "stop_gradient":
        return ts.stop_gradient(m, *sel), []
    params = dict(m.named_parameters())
    tree = {p: rand(*params[p].shape, seed=100 + i) for i, p in enumerate(sel)}
    return ts.swap(m, tree), list(tree.values())


def both(scenario):
    """``scenario(ck)`` run without and with checkpointing: the two results, bitwise equal."""
    want, got = scenario(False), scenario(True)
    same(got, want)
    return got


@pytest.fixture(autouse=True)
def _no_leak_across_tests():
    """A failing test must not leave its modes to the next one (the tests check the stack
    themselves, after every backward)."""
    assert stack() == []
    yield
    while torch._C._len_torch_function_stack():
        torch._C._pop_torch_function_stack()


KINDS = ["stop_gradient", "swap"]
SELECTIONS = {"one": ["0.weight"], "several": ["0.weight", "2.bias", "4.weight"]}


# ----------------------------------------------------------------------------- after the block
@pytest.mark.parametrize("how", ["backward", "autograd.grad"])
@pytest.mark.parametrize("sel", list(SELECTIONS))
@pytest.mark.parametrize("kind", KINDS)
def test_backward_after_the_block(kind, sel, how):
    def scenario(ck):
        m, x = mlp(), rand(3, 4, seed=1)
        before = flags(m)
        blk, stand_ins = block(kind, m, SELECTIONS[sel])
        with blk:
            y = call(ck, m, x)
        assert stack() == []
        if how == "backward":
            loss_of(y).backward()
            out = collected(m, [x, *stand_ins])
        else:
            ins = [x, *m.parameters(), *stand_ins]
            out = list(torch.autograd.grad(loss_of(y), ins, allow_unused=True))
        clean(m, before)
        return out

    got = both(scenario)
    if how == "backward":  # the blocked / swapped parameters got nothing
        params = dict(mlp().named_parameters())
        for i, name in enumerate(params):
            assert (got[i] is None) == (name in SELECTIONS[sel]), name
        if kind == "swap":
            assert all(g is not None for g in got[len(params) + 1:])


@pytest.mark.parametrize("kind", KINDS)
def test_backward_inside_the_block(kind):
    def scenario(ck):
        m, x = mlp(), rand(3, 4, seed=1)
        before = flags(m)
        blk, stand_ins = block(kind, m, SELECTIONS["several"])
        with blk:
            loss_of(call(ck, m, x)).backward()
            assert len(stack()) == 1  # the block itself, nothing else
        clean(m, before)
        return collected(m, [x, *stand_ins])

    both(scenario)


@pytest.mark.parametrize("later", KINDS)
@pytest.mark.parametrize("first", KINDS)
def test_backward_inside_a_later_block_on_the_same_parameters(first, later):
    """The forward in one block; the backward inside another (same model, overlapping
    selection, same or other kind): the recomputation runs in the forward's block only."""
    def scenario(ck):
        m, x = mlp(), rand(3, 4, seed=1)
        before = flags(m)
        blk, stand_ins = block(first, m, ["0.weight", "2.weight"])
        with blk:
            y = call(ck, m, x)
        other, others = block(later, m, ["2.weight", "4.weight"])
        with other:
            loss_of(y).backward()
        clean(m, before)
        return collected(m, [x, *stand_ins, *others])

    both(scenario)


@pytest.mark.parametrize("how", ["backward", "autograd.grad"])
@pytest.mark.parametrize("kind", KINDS)
def test_retain_graph_and_a_second_backward_elsewhere(kind, how):
    """First backward after the block (retain_graph), second inside another block: both
    recomputations are the forward again."""
    def scenario(ck):
        m, x = mlp(), rand(3, 4, seed=1)
        before = flags(m)
        blk, stand_ins = block(kind, m, SELECTIONS["several"])
        with blk:
            y = call(ck, m, x)
        loss = loss_of(y)
        ins = [x, *m.parameters(), *stand_ins]
        if how == "backward":
            loss.backward(retain_graph=True)
            first = collected(m, [x, *stand_ins])
            with ts.stop_gradient(m, "2.weight"):
                loss.backward()
            out = first + collected(m, [x, *stand_ins])
        else:
            first = torch.autograd.grad(loss, ins, allow_unused=True, retain_graph=True)
            with ts.swap(m, {"4.weight": torch.zeros(4, 4)}):  # (it would replace a
                # parameter named in inputs by its stand-in: ask for the others only)
                second = torch.autograd.grad(loss, [x, *stand_ins], allow_unused=True)
            out = [*first, *second]
        clean(m, before)
        return out

    both(scenario)


@pytest.mark.parametrize("kind", KINDS)
def test_nested_blocks_of_both_kinds_on_one_parameter_keep_their_order(kind):
    """swap and stop_gradient over the same parameter: which wins depends on which is on top
    (the top one replaces the parameter first). The recomputation after both exited must push
    them back in the forward's order."""
    def scenario(ck):
        m, x = mlp(), rand(3, 4, seed=1)
        before = flags(m)
        v = rand(4, 4, seed=7)
        outer = ts.swap(m, {"0.weight": v}) if kind == "swap" else ts.stop_gradient(m, "0.weight")
        inner = ts.stop_gradient(m, "0.weight") if kind == "swap" else ts.swap(m, {"0.weight": v})
        with outer, inner:
            y = call(ck, m, x)
        loss_of(y).backward()
        clean(m, before)
        return collected(m, [x, v])

    got = both(scenario)
    # inner stop_gradient over an outer swap: the parameter's value, detached; inner swap:
    # the stand-in, which gets a gradient
    assert (got[-1] is None) == (kind == "swap")


def test_bare_blocks_exited_out_of_order_before_the_backward():
    def scenario(ck):
        m, x = mlp(), rand(3, 4, seed=1)
        before = flags(m)
        v = rand(4, 4, seed=7)
        a = ts.stop_gradient(m, "0.weight")
        b = ts.swap(m, {"0.weight": v, "2.weight": rand(4, 4, seed=8)})
        try:
            y = call(ck, m, x)
            a.__exit__(None, None, None)  # the lower one first
            loss = loss_of(y)
            g = torch.autograd.grad(loss, [x, v], retain_graph=True)  # inside b only
        finally:
            a.__exit__(None, None, None)
            b.__exit__(None, None, None)
        g2 = torch.autograd.grad(loss, [x, v])  # after both
        clean(m, before)
        return [*g, *g2]

    both(scenario)


# ----------------------------------------------------------------------------- flag contexts
@pytest.mark.parametrize("after", [False, True])
@pytest.mark.parametrize("first", ["context", "block"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_bare_freeze_on_another_model_in_either_order(kind, first, after):
    """A bare freeze elsewhere makes checkpoints remember flags: the flags remembered and set
    back are the parameters' own, not the stand-ins' (a swap's stand-in here does not require
    grad where its parameter does, and the reverse)."""
    def scenario(ck):
        other = nn.Linear(2, 2)
        m, x = mlp(), rand(3, 4, seed=1)
        m[2].weight.requires_grad_(False)
        before = flags(m)
        tree = {"0.weight": rand(4, 4, seed=5, grad=False), "2.weight": rand(4, 4, seed=6)}
        blk = ts.stop_gradient(m, "0.weight", "4.bias") if kind == "stop_gradient" else \
            ts.swap(m, tree)
        hold = ts.freeze(other) if first == "context" else None
        try:
            with blk:
                hold = hold or ts.freeze(other)
                y = call(ck, m, x)
                if not after:
                    loss_of(y).backward()
            if after:
                loss_of(y).backward()
            assert flags(m) == before and not any(flags(other))
        finally:
            hold.__exit__(None, None, None)
        assert all(flags(other))
        clean(m, before)
        return collected(m, [x, *tree.values()])

    both(scenario)


@pytest.mark.parametrize("context", ["freeze", "unfreeze"])
def test_a_context_entered_after_the_forward_with_another_context_active(context):
    """A freeze elsewhere was active at the forward, so the checkpoint remembered its flags;
    the backward runs inside a freeze / unfreeze of the checkpointed model entered after the
    forward: the recomputation is undone to the forward's flags (docs/freezing.md)."""
    def scenario(ck):
        other = nn.Linear(2, 2)
        m, x = mlp(), rand(3, 4, seed=1)
        if context == "unfreeze":
            m[2].requires_grad_(False)
        before = flags(m)
        hold = ts.freeze(other)
        try:
            with ts.stop_gradient(m, "0.weight"):
                y = call(ck, m, x)
            ctx = ts.freeze(m, "2") if context == "freeze" else ts.unfreeze(m, "2")
            with ctx:
                inside = flags(m)
                loss_of(y).backward()
                assert flags(m) == inside
        finally:
            hold.__exit__(None, None, None)
        clean(m, before)
        return collected(m, [x])

    both(scenario)


FLAG_CONTEXTS = {
    "freeze": lambda m: ts.freeze(m, "0"),
    "freeze_except": lambda m: ts.freeze_except(m, "2", "4"),
    "unfreeze": lambda m: ts.unfreeze(m, "2.bias"),  # (0 frozen by hand, 2.bias too)
}


@pytest.mark.parametrize("context", list(FLAG_CONTEXTS))
@pytest.mark.parametrize("kind", KINDS)
def test_a_flag_context_active_at_the_forward_and_a_block_backward_after_both(kind, context):
    def scenario(ck):
        m, x = mlp(), rand(3, 4, seed=1)
        if context == "unfreeze":
            m[0].requires_grad_(False)
            m[2].bias.requires_grad_(False)
        before = flags(m)
        blk, stand_ins = block(kind, m, ["2.weight", "4.bias"])
        with FLAG_CONTEXTS[context](m), blk:
            y = call(ck, m, x)
        loss_of(y).backward()
        clean(m, before)
        return collected(m, [x, *stand_ins])

    got = both(scenario)
    assert got[0] is None and got[1] is None  # "0" was frozen at the forward
    assert got[2] is None and got[5] is None  # blocked / swapped
    # 2.bias: trained under freeze / freeze_except; under unfreeze its flag is False again at
    # the backward, and torch's AccumulateGrad drops it (documented; see the test below)
    assert (got[3] is None) == (context == "unfreeze")


@pytest.mark.parametrize("ck", [False, True])
def test_decorated_unfreeze_step_backward_after_return_as_pytorch_by_hand(ck):
    """Documented limit (docs/freezing.md): a parameter the block turned on is off again when
    the backward runs after the block, and torch's AccumulateGrad skips a leaf that no longer
    requires grad: no .grad for it, exactly as the same flag writes by hand give."""
    m = mlp()
    m[2].requires_grad_(False)  # frozen by hand; the step trains it

    @ts.unfreeze(m, "2")
    def step(x):
        return loss_of(call(ck, m, x))

    x = rand(3, 4, seed=1)
    step(x).backward()
    assert flags(m) == [True, True, False, False, True, True]
    ref, x2 = mlp(), rand(3, 4, seed=1)
    loss = loss_of(ref(x2))  # the block's flags by hand: everything on at the forward
    ref[2].requires_grad_(False)  # then off again before the backward
    loss.backward()
    assert m[2].weight.grad is None and ref[2].weight.grad is None
    same(collected(m, [x]), collected(ref, [x2]))


def test_decorated_training_step_backward_after_return():
    m, v = mlp(), rand(4, 4, seed=9)

    def make(ck):
        @ts.freeze(m, "0")
        @ts.swap(m, {"2.weight": v})
        @ts.stop_gradient(m, "4.weight")
        def step(x):
            return loss_of(call(ck, m, x))
        return step

    def scenario(ck):
        m.zero_grad(set_to_none=True)
        v.grad = None
        before = flags(m)
        x = rand(3, 4, seed=1)
        make(ck)(x).backward()
        clean(m, before)
        return collected(m, [x, v])

    got = both(scenario)
    assert got[0] is None and got[2] is None and got[4] is None and got[-1] is not None


def test_decorated_freeze_except_with_a_block_inside_backward_after_return():
    m = mlp()

    def scenario(ck):
        m.zero_grad(set_to_none=True)
        before = flags(m)

        @ts.freeze_except(m, "2", "4")
        def step(x):
            with ts.stop_gradient(m, "2.weight"):
                h = call(ck, m[:3], x)
            return loss_of(call(ck, m[3:], h))

        x = rand(3, 4, seed=1)
        step(x).backward()
        clean(m, before)
        return collected(m, [x])

    got = both(scenario)
    assert [g is None for g in got[:6]] == [True, True, True, False, False, False]


# ----------------------------------------------------------------------------- threads
@pytest.mark.parametrize("still_open", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_backward_in_another_thread(kind, still_open):
    def scenario(ck):
        m, x = mlp(), rand(3, 4, seed=1)
        before = flags(m)
        blk, stand_ins = block(kind, m, SELECTIONS["several"])
        errors, stacks = [], []

        def run(loss):
            try:
                loss.backward()
                stacks.append(stack())
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)

        with blk:
            y = call(ck, m, x)
            loss = loss_of(y)
            if still_open:
                t = threading.Thread(target=run, args=(loss,))
                t.start()
                t.join()
                assert len(stack()) == 1
        if not still_open:
            t = threading.Thread(target=run, args=(loss,))
            t.start()
            t.join()
        assert not errors, errors
        assert stacks == [[]]  # nothing left on the thread's stack either
        clean(m, before)
        return collected(m, [x, *stand_ins])

    both(scenario)


def test_forward_in_a_thread_inside_its_block_backward_in_the_main_thread():
    def scenario(ck):
        m, x = mlp(), rand(3, 4, seed=1)
        before = flags(m)
        v = rand(4, 4, seed=3)
        out = []

        def fwd():
            with ts.swap(m, {"2.weight": v}), ts.stop_gradient(m, "0.weight"):
                out.append(call(ck, m, x))

        t = threading.Thread(target=fwd)
        t.start()
        t.join()
        loss_of(out[0]).backward()
        clean(m, before)
        return collected(m, [x, v])

    both(scenario)


# ----------------------------------------------------------------------------- structure
@pytest.mark.parametrize("kind", KINDS)
def test_nested_checkpoints(kind):
    def scenario(ck):
        m, x = mlp(), rand(3, 4, seed=1)
        before = flags(m)
        blk, stand_ins = block(kind, m, ["0.weight", "4.weight"])

        def outer(h):
            h = m[1](m[0](h))
            h = call(ck, m[2:4], h)  # a checkpoint inside the checkpointed function
            return m[4](h)

        with blk:
            y = call(ck, outer, x)
        loss_of(y).backward()
        clean(m, before)
        return collected(m, [x, *stand_ins])

    both(scenario)


def test_nested_checkpoints_with_the_inner_one_in_its_own_block():
    def scenario(ck):
        m, x = mlp(), rand(3, 4, seed=1)
        before = flags(m)
        v = rand(4, 4, seed=4)

        def outer(h):
            h = m[1](m[0](h))
            with ts.swap(m, {"2.weight": v}):
                h = call(ck, m[2:4], h)
            return m[4](h)

        with ts.stop_gradient(m, "0.weight", "2.weight"):
            y = call(ck, outer, x)
        loss_of(y).backward()
        clean(m, before)
        return collected(m, [x, v])

    got = both(scenario)
    assert got[2] is None and got[-1] is not None  # the inner swap (on top) replaces first


def test_checkpoints_inside_and_outside_blocks_in_one_forward():
    """Seed 004: one forward, different partitions blocked in different parts, the same
    module checkpointed in each part."""
    def scenario(ck):
        m, x = mlp(), rand(3, 4, seed=1)
        before = flags(m)
        v = rand(4, 4, seed=2)
        with ts.stop_gradient(m, "0.weight"):
            a = call(ck, m, x)
        b = call(ck, m, x)  # no block
        with ts.swap(m, {"0.weight": v}):
            c = call(ck, m, x)
        with ts.stop_gradient(m, "2"):
            d = call(ck, m, x)
        loss_of(a + 2 * b + 3 * c + 4 * d).backward()
        clean(m, before)
        return collected(m, [x, v])

    both(scenario)


def test_a_block_entered_inside_the_checkpointed_function_with_an_outer_block():
    def scenario(ck):
        m, x = mlp(), rand(3, 4, seed=1)
        before = flags(m)
        v = rand(4, 4, seed=2)

        def fn(h):
            with ts.stop_gradient(m, "2.weight"):
                h = m[:3](h)
            return m[3:](h)

        with ts.swap(m, {"0.weight": v}):
            y = call(ck, fn, x)
        with ts.stop_gradient(m, "4"):  # backward in another block entered later
            loss_of(y).backward()
        clean(m, before)
        return collected(m, [x, v])

    got = both(scenario)
    assert got[0] is None and got[2] is None and got[4] is not None


def test_checkpoint_sequential_and_a_selective_checkpoint_policy():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return (CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default
                else CheckpointPolicy.PREFER_RECOMPUTE)

    def scenario(ck):
        m, x = mlp(), rand(3, 4, seed=1)
        before = flags(m)
        v = rand(4, 4, seed=2)
        with ts.swap(m, {"2.weight": v}), ts.stop_gradient(m, "4.weight"):
            if ck:
                a = checkpoint_sequential(m, 2, x, use_reentrant=False)
                b = checkpoint(m, x, use_reentrant=False,
                               context_fn=lambda: create_selective_checkpoint_contexts(policy))
            else:
                a = b = m(x)
        loss_of(a + b).backward()
        clean(m, before)
        return collected(m, [x, v])

    both(scenario)


# ----------------------------------------------------------------------------- stand-ins
def test_swap_with_non_leaf_stand_ins_second_order():
    """MAML: the fast weights are a differentiable function of the parameters; the meta
    gradient flows through them, the recomputation after the block included."""
    def scenario(ck):
        m, x = mlp(), rand(3, 4, seed=1)
        before = flags(m)
        names = ["0.weight", "2.weight"]
        params = dict(m.named_parameters())
        inner = loss_of(m(x))
        g = torch.autograd.grad(inner, [params[n] for n in names], create_graph=True)
        fast = {n: params[n] - 0.1 * gi for n, gi in zip(names, g)}
        with ts.swap(m, fast):
            y = call(ck, m, x)
        loss_of(y).backward()
        clean(m, before)
        return collected(m, [x])

    got = both(scenario)
    assert all(t is not None for t in got)


def test_create_graph_through_the_recomputation_after_the_block():
    """A gradient penalty: the first gradient (which recomputes) is differentiated again."""
    def scenario(ck):
        m, x = mlp(), rand(3, 4, seed=1)
        before = flags(m)
        v = rand(4, 4, seed=2)
        with ts.swap(m, {"2.weight": v}), ts.stop_gradient(m, "0.weight"):
            y = call(ck, m, x)
        gx, = torch.autograd.grad(loss_of(y), x, create_graph=True)
        gx.pow(2).sum().backward()
        clean(m, before)
        return collected(m, [v])

    both(scenario)


def test_swap_stand_in_changed_in_place_after_the_block_is_read_as_it_is_then():
    """Documented: a swap's tensors are read at the recomputation, as a checkpoint reads any
    tensor it closes over. Same result as torch's checkpoint over functional_call with the
    tensor closed over; the code without checkpoint refuses (version counter)."""
    def run(use_ts):
        m, x = mlp(), rand(3, 4, seed=1)
        before = flags(m)
        v = rand(4, 4, seed=2)
        if use_ts:
            with ts.swap(m, {"2.weight": v}):
                y = checkpoint(m, x, use_reentrant=False)
        else:
            y = checkpoint(lambda t: functional_call(m, {"2.weight": v}, (t,)), x,
                           use_reentrant=False)
        with torch.no_grad():
            v.mul_(2)
        loss_of(y).backward()
        clean(m, before)
        return collected(m, [x, v])

    same(run(True), run(False))
    m, x, v = mlp(), rand(3, 4, seed=1), rand(4, 4, seed=2)
    with ts.swap(m, {"2.weight": v}):
        y = m(x)
    with torch.no_grad():
        v.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss_of(y).backward()
    assert stack() == []


def test_parameter_changed_in_place_after_a_stop_gradient_block():
    """The stand-in is made from the parameter at each use: the recomputation reads the
    parameter as it is then, as torch's checkpoint over ``p.detach()`` does."""
    def run(use_ts):
        m, x = mlp(), rand(3, 4, seed=1)
        before = flags(m)
        w = m[2].weight
        if use_ts:
            with ts.stop_gradient(m, "2.weight"):
                y = checkpoint(m, x, use_reentrant=False)
        else:
            y = checkpoint(lambda t: functional_call(m, {"2.weight": w.detach()}, (t,)), x,
                           use_reentrant=False)
        with torch.no_grad():
            w.add_(1)  # an optimizer step between forward and backward
        loss_of(y).backward()
        clean(m, before)
        return collected(m, [x])

    same(run(True), run(False))


def test_structural_grad_of_a_loss_recorded_in_blocks_called_after_them():
    def scenario(ck):
        m, x = mlp(), rand(3, 4, seed=1)
        before = flags(m)
        with ts.stop_gradient(m, "0.weight"), ts.swap(m, {"2.weight": rand(4, 4, seed=2)}):
            y = call(ck, m, x)
        tree = ts.structural_grad(m, loss_of(y), wrt=["2.bias", "4"])
        clean(m, before)
        return [tree["2"]["bias"], tree["4"]["weight"], tree["4"]["bias"]]

    both(scenario)


def test_nested_checkpoints_with_a_flag_context_and_blocks_backward_after():
    def scenario(ck):
        m, x = mlp(), rand(3, 4, seed=1)
        before = flags(m)
        v = rand(4, 4, seed=2)

        def outer(h):
            h = call(ck, m[:2], h)
            return m[4](call(ck, m[2:4], h))

        with ts.freeze(m, "2.bias", "4.weight"), ts.swap(m, {"0.weight": v}), \
                ts.stop_gradient(m, "2.weight"):
            y = call(ck, outer, x)
        loss_of(y).backward()
        clean(m, before)
        return collected(m, [x, v])

    got = both(scenario)
    assert [g is None for g in got[:6]] == [True, False, True, True, True, False]


def test_without_early_stop_and_under_a_device_context():
    from torch.utils.checkpoint import set_checkpoint_early_stop

    def scenario(ck):
        m, x = mlp(), rand(3, 4, seed=1)
        before = flags(m)
        v = rand(4, 4, seed=2)
        with set_checkpoint_early_stop(False), torch.device("cpu"):
            with ts.swap(m, {"2.weight": v}), ts.stop_gradient(m, "0.weight"):
                y = call(ck, m, x)
            loss_of(y).backward()
        clean(m, before)
        return collected(m, [x, v])

    both(scenario)


def test_fsdp_style_checkpoint_wrapper_after_the_blocks():
    """``torch.distributed.algorithms._checkpoint.checkpoint_wrapper`` (FSDP, torchtitan) goes
    through ``torch.utils.checkpoint.checkpoint``: recomputed inside the blocks."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                             checkpoint_wrapper)

    def scenario(ck):
        m, x = mlp(), rand(4, 4, seed=1)
        before = flags(m)
        v = rand(4, 4, seed=2)
        if ck:
            m[0] = checkpoint_wrapper(m[0], checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        p = "0._checkpoint_wrapped_module.weight" if ck else "0.weight"
        with ts.swap(m, {p: v}), ts.stop_gradient(m, "2.weight"):
            y = m(x)
        loss_of(y).backward()
        clean(m, before)
        return collected(m, [x, v])

    both(scenario)


@pytest.mark.parametrize("kind", KINDS)
def test_composable_checkpoint_recomputed_after_the_block(kind):
    from torch.distributed._composable import checkpoint as composable_checkpoint

    def scenario(ck):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 4))
        if ck:
            composable_checkpoint(m[0])
        x, v = rand(4, 4, seed=1), rand(4, 4, seed=2)
        blk = ts.swap(m, {"0.weight": v}) if kind == "swap" else ts.stop_gradient(m, "0.weight")
        with blk:
            y = m(x)
        loss_of(y).backward()
        assert stack() == []
        return collected(m, [x, v])

    both(scenario)


def test_composable_checkpoint_recomputed_after_a_flag_context():
    """A decorated step frozen in part, its backward after return: torch's composable
    checkpoint recomputes with the forward's flags too (docs/freezing.md)."""
    from torch.distributed._composable import checkpoint as composable_checkpoint

    def scenario(ck):
        m = mlp()
        if ck:
            composable_checkpoint(m[2])

        @ts.freeze(m, "2")
        def step(x):
            return loss_of(m(x))

        x = rand(3, 4, seed=1)
        step(x).backward()
        assert all(flags(m)) and stack() == []
        return collected(m, [x])

    both(scenario)


def test_tied_parameter_swapped_at_its_canonical_path():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.b.weight = self.a.weight

        def forward(self, h):
            return self.b(torch.tanh(self.a(h)))

    def scenario(ck):
        m, x = Tied(), rand(3, 4, seed=1)
        before = flags(m)
        v = rand(4, 4, seed=2)
        with ts.swap(m, {"a.weight": v}):
            y = call(ck, m, x)
        loss_of(y).backward()
        clean(m, before)
        return collected(m, [x, v])

    got = both(scenario)
    assert got[0] is None and got[-1] is not None


def test_the_recomputation_keeps_nothing_alive_once_the_graph_is_gone():
    import gc
    import weakref

    m, x, v = mlp(), rand(3, 4, seed=1), rand(4, 4, seed=2)
    with ts.swap(m, {"2.weight": v}), ts.stop_gradient(m, "0.weight"):
        y = checkpoint(m, x, use_reentrant=False)
    loss_of(y).backward()
    gone_v, gone_m = weakref.ref(v), weakref.ref(m)
    del m, v, y
    gc.collect()
    assert gone_v() is None and gone_m() is None


# ----------------------------------------------------------------------------- failures
def test_a_recomputation_that_raises_leaves_nothing_behind():
    other = nn.Linear(2, 2)
    m, x = mlp(), rand(3, 4, seed=1)
    before = flags(m)
    calls = []

    def fn(h):
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("boom in the recomputation")
        return m(h)

    hold = ts.freeze(other)
    try:
        with ts.freeze(m, "4"), ts.stop_gradient(m, "0.weight"), ts.swap(
                m, {"2.weight": rand(4, 4, seed=2)}):
            y = checkpoint(fn, x, use_reentrant=False)
        with pytest.raises(ValueError, match="boom"):
            loss_of(y).backward()
    finally:
        hold.__exit__(None, None, None)
    clean(m, before)
    assert len(calls) == 2


# ----------------------------------------------------------------------------- HF-like
class Encoder(nn.Module):
    def __init__(self, ck):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.1, batch_first=True)
            for _ in range(2))
        self.head = nn.Linear(8, 8)
        self.ck = ck

    def forward(self, x):
        for layer in self.layers:  # per layer, as HF's gradient_checkpointing_enable does
            x = checkpoint(layer.__call__, x, use_reentrant=False) if self.ck else layer(x)
        return self.head(x)


@pytest.mark.parametrize("when", ["after", "inside", "other thread"])
def test_transformer_encoder_layers_checkpointed_per_layer(when):
    def scenario(ck):
        enc, x = Encoder(ck), rand(2, 5, 8, seed=1)
        before = flags(enc)
        ema = {n: (p.detach() * 0.9).requires_grad_() for n, p in enc.named_parameters()
               if n.startswith("layers.1.linear")}
        torch.manual_seed(3)  # dropout
        with ts.freeze(enc, "head.bias"), ts.stop_gradient(enc, "layers.0.self_attn"), \
                ts.swap(enc, ema):
            y = enc(x)
            if when == "inside":
                loss_of(y).backward()
        if when == "after":
            loss_of(y).backward()
        elif when == "other thread":
            t = threading.Thread(target=loss_of(y).backward)
            t.start()
            t.join()
        clean(enc, before)
        return collected(enc, [x, *ema.values()])

    got = both(scenario)
    names = [n for n, _ in Encoder(False).named_parameters()]
    for n, g in zip(names, got):
        blocked = n.startswith(("layers.0.self_attn", "layers.1.linear")) or n == "head.bias"
        assert (g is None) == blocked, n


# ----------------------------------------------------------------------------- more shapes of use
def test_a_context_entered_only_after_the_forward_is_a_documented_limit():
    """docs/freezing.md: a context entered only after the forward (none active at it) is not
    undone for the recomputation. Here it makes the recomputation save other tensors, which
    torch's own check catches (an error, not a silent gradient); everything is put back."""
    m, x = mlp(), rand(3, 4, seed=1)
    before = flags(m)
    with ts.stop_gradient(m, "0.weight"):
        y = checkpoint(m, x, use_reentrant=False)
    with ts.freeze(m, "2"):
        with pytest.raises(torch.utils.checkpoint.CheckpointError, match="different number"):
            loss_of(y).backward()
    clean(m, before)


@pytest.mark.parametrize("kind", KINDS)
def test_parameters_handed_to_checkpoint_as_inputs(kind):
    """``checkpoint(F.linear, h, w, b)``: the checkpoint saves the inputs with a custom
    function (which passes through no mode), so the recomputation gets the parameters
    themselves: the block pushed again must replace them."""
    def scenario(ck):
        m, x = mlp(), rand(3, 4, seed=1)
        before = flags(m)
        blk, stand_ins = block(kind, m, ["0.weight", "2.bias"])
        f = nn.functional.linear
        with blk:
            h = torch.tanh(call(ck, f, x, m[0].weight, m[0].bias))
            y = call(ck, f, h, m[2].weight, m[2].bias)
        loss_of(y).backward()
        clean(m, before)
        return collected(m, [x, *stand_ins])

    both(scenario)


@pytest.mark.parametrize("context_elsewhere", [False, True])
def test_swap_two_parameters_for_each_other(context_elsewhere):
    """One of them frozen by hand: with a context active elsewhere the checkpoint remembers
    flags; read through the swap, 2.weight would read 0.weight's flag (False) and be frozen
    for the recomputation, where it stands in for 0.weight."""
    def scenario(ck):
        other = nn.Linear(2, 2)
        m, x = mlp(), rand(3, 4, seed=1)
        m[0].weight.requires_grad_(False)
        before = flags(m)
        hold = ts.freeze(other) if context_elsewhere else None
        try:
            with ts.swap(m, {"0.weight": m[2].weight, "2.weight": m[0].weight}):
                y = call(ck, m, x)
            loss_of(y).backward()
        finally:
            if hold is not None:
                hold.__exit__(None, None, None)
        clean(m, before)
        return collected(m, [x])

    got = both(scenario)
    assert got[0] is None and got[2] is not None


def test_flag_context_left_inside_the_block_backward_still_inside_it():
    def scenario(ck):
        m, x = mlp(), rand(3, 4, seed=1)
        before = flags(m)
        with ts.stop_gradient(m, "0.weight"):
            with ts.freeze(m, "2"):
                y = call(ck, m, x)
            loss_of(y).backward()
        clean(m, before)
        return collected(m, [x])

    got = both(scenario)
    assert got[0] is None and got[2] is None and got[3] is None and got[4] is not None


def test_under_autocast():
    def scenario(ck):
        m, x = mlp(), rand(3, 4, seed=1)
        before = flags(m)
        v = rand(4, 4, seed=2)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with ts.swap(m, {"2.weight": v}), ts.stop_gradient(m, "4.weight"):
                y = call(ck, m, x)
        loss_of(y.float()).backward()
        clean(m, before)
        return collected(m, [x, v])

    both(scenario)


class _Lin(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.t() @ x


def test_custom_function_handed_a_parameter_directly_recomputed_after_stop_gradient():
    def scenario(ck):
        m, x = mlp(), rand(3, 4, seed=1)
        before = flags(m)

        def fn(h):
            return m[2:](torch.tanh(_Lin.apply(h, m[0].weight) + m[0].bias))

        with ts.stop_gradient(m, "0.weight"):
            y = call(ck, fn, x)
        loss_of(y).backward()
        clean(m, before)
        return collected(m, [x])

    got = both(scenario)
    assert got[0] is None and got[1] is not None


@pytest.mark.parametrize("kind", KINDS)
def test_structural_grad_with_a_loss_callable_inside_the_block(kind):
    def scenario(ck):
        m, x = mlp(), rand(3, 4, seed=1)
        before = flags(m)
        blk, _ = block(kind, m, ["0.weight", "2.weight"])
        with blk:
            tree = ts.structural_grad(m, lambda mm: loss_of(call(ck, mm, x)), wrt=["2", "4"])
            assert len(stack()) == 1
        clean(m, before)
        return ts.tree.leaves(tree)

    both(scenario)


def test_nothing_of_torch_stays_patched_once_every_block_and_context_is_gone():
    import torch.utils.checkpoint as tuc

    from torchstruct import _checkpoints

    m, x = mlp(), rand(3, 4, seed=1)
    with ts.freeze(m, "4"), ts.stop_gradient(m, "0.weight"):
        y = checkpoint(m, x, use_reentrant=False)
    with pytest.raises(KeyError):  # a block whose body raises is left as well
        with ts.swap(m, {"2.weight": rand(4, 4, seed=2)}):
            raise KeyError("body")
    loss_of(y).backward()
    assert getattr(tuc, _checkpoints._GENERATOR_NAME) is _checkpoints._GENERATOR
    assert tuc.CheckpointFunction.__dict__["forward"] is _checkpoints._FORWARD


def test_a_block_left_active_in_a_thread_that_ended_does_not_keep_torch_patched():
    """A generator suspended inside a block and closed from another thread leaves the block in
    the thread that entered it (documented); once that thread has ended, the next block to
    exit anywhere finds no block active and puts torch back."""
    import threading

    import torch.utils.checkpoint as tuc

    from torchstruct import _checkpoints

    m = mlp()

    def owner():
        def g():
            with ts.stop_gradient(m, "0.weight"):
                yield
        gen = g()
        next(gen)
        closer = threading.Thread(target=lambda: pytest.raises(RuntimeError, gen.close))
        closer.start()
        closer.join()

    t = threading.Thread(target=owner)
    t.start()
    t.join()
    with ts.swap(m, {"2.weight": rand(4, 4, seed=2)}):
        assert getattr(tuc, _checkpoints._GENERATOR_NAME) is not _checkpoints._GENERATOR
    assert getattr(tuc, _checkpoints._GENERATOR_NAME) is _checkpoints._GENERATOR


transformers = None
try:
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
except ImportError:  # pragma: no cover
    pass


@pytest.mark.skipif(transformers is None, reason="transformers is not installed")
@pytest.mark.parametrize("when", ["after", "inside"])
def test_hf_bert_gradient_checkpointing_non_reentrant(when):
    def tiny(ck):
        torch.manual_seed(0)
        config = transformers.BertConfig(
            vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=16, max_position_embeddings=16, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, num_labels=2)
        model = transformers.BertForSequenceClassification(config).train()
        if ck:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        return model

    ids = torch.randint(1, 40, (2, 6), generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 1])

    def scenario(ck):
        model = tiny(ck)
        before = flags(model)
        ema = {n: p.detach() * 0.5 for n, p in model.named_parameters()
               if n.startswith("bert.encoder.layer.1.intermediate")}

        @ts.freeze(model, "bert.embeddings")
        def step():
            with ts.stop_gradient(model, "bert.encoder.layer.0.attention"), ts.swap(model, ema):
                out = model(input_ids=ids, labels=labels).loss
                if when == "inside":
                    out.backward()
                return out

        loss = step()
        if when == "after":
            loss.backward()
        clean(model, before)
        return collected(model)

    got = both(scenario)
    assert sum(g is not None for g in got) > 0 and sum(g is None for g in got) > 0
