"""Outside-eyes checks of the rules on who sets which flag, what a context decides, shared
parameters, normalization statistics and the warnings, against PyTorch and a brute-force model
of the rules as docs/freezing.md states them."""
import copy
import gc
import os
import random
import threading
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.optim.swa_utils import update_bn

import torchstruct as ts
from _flags import flags, reads

os.environ["HF_HUB_OFFLINE"] = "1"


def restored_warnings(caught):
    return [str(w.message) for w in caught if issubclass(w.category, ts.RestoredFlagsWarning)]


# ----------------------------------------------------------------------------- a brute-force model
class Rules:
    """The documented rules, computed from scratch for two models A and B sharing a submodule S.

    Parameters (by name): a0w a0b (A only), sw sb (S: A's "1", B's "0"), b1w b1b (B only).
    A flag differing from the one torchstruct last wrote is someone else's write: it becomes the
    starting flag and the contexts entered and declarations made before it no longer apply to
    it; every write is read before a context is entered or a declaration made, and otherwise
    at the
    next application of a tree holding it (every context entry/exit applies both trees, as they
    share S; mark_trainable applies the trees that contain the declaring module).
    """

    PARAMS = ["a0w", "a0b", "sw", "sb", "b1w", "b1b"]
    SCOPE = {"A": {"a0w", "a0b", "sw", "sb"}, "B": {"sw", "sb", "b1w", "b1b"}}
    SELECT = {
        "A": {"0": {"a0w", "a0b"}, "1": {"sw", "sb"}, "*.weight": {"a0w", "sw"}, "1.bias": {"sb"}},
        "B": {"0": {"sw", "sb"}, "1": {"b1w", "b1b"}, "*.weight": {"sw", "b1w"}, "0.bias": {"sb"}},
    }
    # declarations: module -> names it declares (None: no declaration); what each admits
    ADMITS = {
        ("A", "0"): {"a0w", "a0b"}, ("A", "1"): {"sw", "sb"},
        ("B", "0"): {"sw", "sb"}, ("B", "1"): {"b1w", "b1b"},
        ("S", "weight"): {"sw"}, ("S", "bias"): {"sb"},
    }

    def __init__(self):
        self.flag = {p: True for p in self.PARAMS}  # the real bit
        self.written = dict(self.flag)  # what torchstruct last wrote
        self.base = dict(self.flag)
        self.override = {p: 0 for p in self.PARAMS}
        self.contexts = []  # (serial, kind, model, selected)
        self.serial = 0
        self.decl = {"A": None, "B": None, "S": None}

    def _seen(self):
        base, over = dict(self.base), dict(self.override)
        for p in self.PARAMS:
            if self.flag[p] is not self.written[p]:  # someone else wrote it
                base[p], over[p] = self.flag[p], self.serial
        return base, over

    def _admitted(self, p, over):
        for mod, made in self.decl.items():
            if made is None or made[1] <= over:  # none, or older than a write by hand
                continue
            names = made[0]
            if mod != "S" and p not in self.SCOPE[mod]:
                continue
            if mod == "S" and p not in ("sw", "sb"):
                continue
            if not any(p in self.ADMITS[(mod, n)] for n in names):
                return False
        return True

    def effective(self):
        base, over = self._seen()
        out = {}
        for p in self.PARAMS:
            f = base[p]
            for serial, kind, model, sel in self.contexts:
                if serial <= over[p] or p not in self.SCOPE[model]:
                    continue
                if kind == "freeze" and p in sel:
                    f = False
                elif kind == "freeze_except" and p not in sel:
                    f = False
                elif kind == "unfreeze" and p in sel:
                    f = True
            out[p] = f and self._admitted(p, over[p])
        return out

    def apply(self, trees=("A", "B")):
        """Write the flags of the parameters of ``trees`` (an application reads the writes of
        someone else to those parameters)."""
        eff = self.effective()
        base, over = self._seen()
        for p in set().union(*(self.SCOPE[t] for t in trees)):
            self.base[p], self.override[p] = base[p], over[p]
            self.flag[p] = self.written[p] = eff[p]

    def enter(self, kind, model, sel):
        self.base, self.override = self._seen()  # a write made before the context: read
        self.written = dict(self.flag)  # now, so that the new context applies on top of it
        self.serial += 1
        self.contexts.append((self.serial, kind, model, self.SELECT[model][sel]))
        self.apply()

    def exit(self, i):
        del self.contexts[i]
        self.apply()

    def declare(self, mod, names, trees):
        self.base, self.override = self._seen()  # every write is read before it is made
        self.written = dict(self.flag)
        self.serial += 1
        self.decl[mod] = None if names is None else (names, self.serial)
        self.apply(trees)


def _build():
    S = nn.Linear(2, 2)
    A = nn.Sequential(nn.Linear(2, 2), S)
    B = nn.Sequential(S, nn.Linear(2, 2))
    ts.attach(A)
    ts.attach(B)
    params = dict(zip(Rules.PARAMS, [A[0].weight, A[0].bias, S.weight, S.bias, B[1].weight,
                                     B[1].bias]))
    return A, B, S, params


_ops = st.one_of(
    st.tuples(st.just("enter"), st.sampled_from(["freeze", "freeze_except", "unfreeze"]),
              st.sampled_from(["A", "B"]), st.sampled_from(["0", "1", "*.weight", "bias"])),
    st.tuples(st.just("exit"), st.integers(0, 7)),
    st.tuples(st.just("write"), st.sampled_from(Rules.PARAMS), st.booleans()),
    st.tuples(st.just("module_write"), st.sampled_from(["A", "B", "S"]), st.booleans()),
    st.tuples(st.just("declare"), st.sampled_from(["A", "B", "S"]), st.integers(0, 2)),
    st.tuples(st.just("typo"), st.sampled_from(["A", "B"])),
    st.tuples(st.just("attach"), st.sampled_from(["A", "B"])),
    st.tuples(st.just("forward"), st.sampled_from(["A", "B"])),
)

_DECLS = {"A": [None, ("0",), ("1",)], "B": [None, ("0",), ("1",)],
          "S": [None, ("weight",), ("bias",)]}


def run_sequence(ops, check_reads=True):
    """Run ``ops`` on fresh models and on :class:`Rules`; assert flags (and reads) agree after
    every step."""
    A, B, S, params = _build()
    mods = {"A": A, "B": B, "S": S}
    rules = Rules()
    active = []
    try:
        for op in ops:
            what = op[0]
            if what == "enter":
                _, kind, model, sel = op
                if sel == "bias":
                    sel = "1.bias" if model == "A" else "0.bias"
                ctx = getattr(ts, kind)(mods[model], sel)
                active.append(ctx)
                rules.enter(kind, model, sel)
            elif what == "exit":
                if not active:
                    continue
                i = op[1] % len(active)
                active.pop(i).__exit__(None, None, None)
                rules.exit(i)
            elif what == "write":
                params[op[1]].requires_grad_(op[2])
                rules.flag[op[1]] = op[2]
            elif what == "module_write":
                mods[op[1]].requires_grad_(op[2])
                for name, p in params.items():
                    if any(p is q for q in mods[op[1]].parameters()):
                        rules.flag[name] = op[2]
            elif what == "declare":
                names = _DECLS[op[1]][op[2]]
                ts.mark_trainable(mods[op[1]], *(names if names is not None else (None,)))
                rules.declare(op[1], names, {"A": ("A",), "B": ("B",), "S": ("A", "B")}[op[1]])
            elif what == "typo":  # refused: nothing changes
                before = {n: p.requires_grad for n, p in params.items()}
                with pytest.raises(ValueError):
                    ts.freeze(mods[op[1]], "1.wieght")
                assert {n: p.requires_grad for n, p in params.items()} == before
            elif what == "attach":  # applies that model's tree at once
                ts.attach(mods[op[1]])
                rules.apply((op[1],))
            elif what == "forward":  # nothing registered: no application, nothing changes
                mods[op[1]](torch.randn(1, 2))
            got = {n: p.requires_grad for n, p in params.items()}
            assert got == rules.flag, (op, got, rules.flag)
            if check_reads:
                want = rules.effective()
                for root in (A, B):
                    for path, p in root.named_parameters():
                        name = next(n for n, q in params.items() if q is p)
                        assert ts.is_trainable(root, p) is want[name], (op, path, want)
                assert ts.summary(S).counts == (4 * want["sw"] + 2 * want["sb"], 6), op
    finally:
        for ctx in reversed(active):
            ctx.__exit__(None, None, None)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(_ops, max_size=14))
def test_random_sequences_agree_with_a_brute_force_model_of_the_rules(ops):
    run_sequence(ops)


def _random_ops(rng, n):
    ops = []
    for _ in range(n):
        what = rng.choice(["enter", "enter", "exit", "write", "module_write", "declare", "attach"])
        if what == "enter":
            ops.append(("enter", rng.choice(["freeze", "freeze_except", "unfreeze"]),
                        rng.choice("AB"), rng.choice(["0", "1", "*.weight", "bias"])))
        elif what == "exit":
            ops.append(("exit", rng.randrange(8)))
        elif what == "write":
            ops.append(("write", rng.choice(Rules.PARAMS), rng.random() < 0.5))
        elif what == "attach":
            ops.append(("attach", rng.choice("AB")))
        elif what == "module_write":
            ops.append(("module_write", rng.choice("ABS"), rng.random() < 0.5))
        else:
            ops.append(("declare", rng.choice("ABS"), rng.randrange(3)))
    return ops


def _one_write_between_reads(ops):
    """Another thread's context or declaration reads this thread's writes at any moment, so two
    writes between this thread's own reads (a context entered or left, a declaration) could
    cancel out or not: keep the first."""
    out, written = [], False
    for op in ops:
        if "write" in op[0]:
            if written:
                continue
            written = True
        elif op[0] in ("enter", "exit", "declare"):
            written = False
        out.append(op)
    return out


def test_random_sequences_in_four_threads_on_their_own_models_agree_with_the_model():
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        try:
            for _ in range(25):
                run_sequence(_one_write_between_reads(_random_ops(rng, 16)))
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


# ----------------------------------------------------------------------------- writes by someone else
def test_a_write_inside_nested_blocks_left_out_of_order():
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 1))
    a = ts.freeze(m, "0")
    b = ts.freeze(m, "1")
    m[0].weight.requires_grad_(True)  # against a: it stands, reads agree at once
    assert flags(m) == reads(m) == [True, False, False, False, True, True]
    c = ts.freeze(m, "0.weight")  # entered later: applies on top
    assert flags(m) == reads(m) == [False, False, False, False, True, True]
    a.__exit__(None, None, None)
    assert flags(m) == reads(m) == [False, True, False, False, True, True]
    c.__exit__(None, None, None)
    assert flags(m) == reads(m) == [True, True, False, False, True, True]
    b.__exit__(None, None, None)
    assert flags(m) == reads(m) == [True] * 6


def test_module_requires_grad_inside_freeze_except_stands_under_later_blocks():
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    with ts.freeze_except(m, "1"):
        m.requires_grad_(True)
        assert flags(m) == reads(m) == [True] * 4
        with ts.freeze(m, "1"):
            assert flags(m) == reads(m) == [True, True, False, False]
        assert flags(m) == reads(m) == [True] * 4
    assert flags(m) == reads(m) == [True] * 4


def test_a_declared_frozen_parameter_written_on_by_hand_agrees_with_the_reads_at_every_forward():
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    ts.mark_trainable(m, "1")
    m[0].weight.requires_grad_(True)
    m(torch.randn(1, 2))
    assert m[0].weight.requires_grad is ts.is_trainable(m, "0.weight")


def test_value_and_grad_and_structural_grad_follow_a_write_inside_a_block():
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    x = torch.randn(3, 2)
    with ts.freeze(m, "0"):
        m[0].weight.requires_grad_(True)
        _, tree = ts.value_and_grad(lambda mm, x: mm(x).sum(), m, x)
        assert sorted(ts.tree.to_flat_dict(tree)) == ["0.weight", "1.bias", "1.weight"]
        want = torch.autograd.grad(m(x).sum(), [m[0].weight])[0]
        assert torch.allclose(ts.tree.to_flat_dict(tree)["0.weight"], want)
        before = flags(m)
        wrt = ts.structural_grad(m, lambda mm: mm(x).sum(), wrt="0")
        assert sorted(ts.tree.to_flat_dict(wrt)) == ["0.bias", "0.weight"]
        assert flags(m) == before  # wrt= decided per call: no flag changed
    assert flags(m) == [True] * 4


def test_param_groups_and_ts_optim_step_a_parameter_unfrozen_by_hand_inside_a_block():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    opt = ts.optim.AdamW(ts.param_groups(m, weight_decay=0.1), lr=0.1)
    with ts.freeze(m, "0"):
        m[0].weight.requires_grad_(True)
        w, b = m[0].weight.detach().clone(), m[0].bias.detach().clone()
        m(torch.randn(3, 2)).sum().backward()
        opt.step()
        assert not torch.equal(w, m[0].weight)  # trains: the write stands
        assert torch.equal(b, m[0].bias) and m[0].bias not in opt.state  # frozen: untouched


# ----------------------------------------------------------------------------- shared parameters
def _two_models_sharing_a_layer_the_second_declares_frozen():
    shared = nn.Linear(2, 2)
    a = nn.Sequential(nn.Linear(2, 2), shared)
    b = nn.Sequential(shared, nn.Linear(2, 1))
    ts.attach(a)
    ts.mark_trainable(b, "1")  # b does not admit the shared layer
    return shared, a, b


def test_a_shared_parameter_trains_only_if_both_models_declarations_admit_it():
    shared, a, b = _two_models_sharing_a_layer_the_second_declares_frozen()
    assert flags(a) == reads(a) == [True, True, False, False]
    with ts.unfreeze(a):  # no context overrides a declaration, also another model's
        assert flags(a) == reads(a) == [True, True, False, False]
    ts.mark_trainable(shared, "bias")
    ts.mark_trainable(b, None)
    assert flags(a) == reads(a) == [True, True, False, True]
    assert flags(b) == reads(b) == [False, True, True, True]
    assert ts.summary(b).counts == (2 + 3, 6 + 3)
    ts.mark_trainable(shared, None)
    assert flags(a) == flags(b) == [True] * 4


def _a_and_b_that_freezes_their_shared_layer():
    shared = nn.Linear(2, 2)
    a = nn.Sequential(nn.Linear(2, 2), shared)
    b = nn.Sequential(shared)
    ts.attach(a)
    ts.mark_trainable(b)  # b trains nothing
    assert flags(a) == reads(a) == [True, True, False, False]
    return shared, a, b


def test_reads_agree_with_flags_when_the_model_whose_declaration_froze_a_shared_layer_dies():
    shared, a, b = _a_and_b_that_freezes_their_shared_layer()
    del b
    gc.collect()
    assert ts.is_trainable(a, "1.weight") is shared.weight.requires_grad


def test_the_survivor_applies_at_once_when_the_model_whose_declaration_froze_a_shared_layer_dies():
    shared, a, b = _a_and_b_that_freezes_their_shared_layer()
    del b
    gc.collect()
    assert flags(a) == reads(a) == [True] * 4
    assert [n for n, _ in ts.trainable_parameters(a)] == ["0.weight", "0.bias", "1.weight",
                                                         "1.bias"]


def test_a_collection_inside_a_locked_region_leaves_the_survivor_to_its_next_forward():
    from torchstruct import _state
    shared, a, b = _a_and_b_that_freezes_their_shared_layer()
    with _state.LOCK:  # a collection may start half-way through one of torchstruct's changes
        del b
        gc.collect()
        assert flags(a) == [True, True, False, False]  # nothing written from inside it
    a(torch.randn(1, 2))
    assert flags(a) == reads(a) == [True] * 4


def test_a_collection_inside_a_torch_func_transform_writes_no_flag_there():
    shared, a, b = _a_and_b_that_freezes_their_shared_layer()
    seen = []

    def loss(x):
        nonlocal b
        b = None
        gc.collect()
        seen.append(flags(a))
        return (x * 2).sum()

    torch.func.grad(loss)(torch.randn(3))
    assert seen == [[True, True, False, False]]
    a(torch.randn(1, 2))
    assert flags(a) == reads(a) == [True] * 4


def test_a_survivor_whose_declaration_fails_raises_at_its_next_forward_not_in_the_collection():
    shared, a, b = _a_and_b_that_freezes_their_shared_layer()
    calls = []

    class Failing(nn.Linear):
        def trainable(self):
            calls.append(1)
            if len(calls) > 1:
                raise RuntimeError("declaration broke")
            return ["weight", "bias"]

    c = Failing(2, 2)
    a.add_module("2", c)
    a(torch.randn(1, 2))  # applies: the declaration answers once
    before = flags(a)
    del b
    gc.collect()  # the survivor's application fails here: no error, no flag written
    assert flags(a) == before
    with pytest.raises(RuntimeError, match="declaration broke"):
        a(torch.randn(1, 2))


def test_a_model_sharing_nothing_applies_no_other_model_when_it_dies():
    from torchstruct import hooks
    a = ts.attach(nn.Sequential(nn.Linear(2, 2)))
    b = nn.Sequential(nn.Linear(2, 2))
    ts.mark_trainable(b)
    calls = []
    real = hooks.State.apply

    def counting(self, *args, **kwargs):
        calls.append(self)
        return real(self, *args, **kwargs)

    hooks.State.apply = counting
    try:
        del b
        gc.collect()
    finally:
        hooks.State.apply = real
    assert calls == [] and flags(a) == [True, True]


def test_a_context_on_the_survivor_holds_through_the_collection_and_restores_after():
    shared, a, b = _a_and_b_that_freezes_their_shared_layer()
    with ts.freeze(a, "0"):
        del b
        gc.collect()
        assert flags(a) == reads(a) == [False, False, True, True]
    assert flags(a) == reads(a) == [True] * 4


def test_a_parameter_added_to_a_shared_layer_follows_both_models_declarations():
    shared, a, b = _two_models_sharing_a_layer_the_second_declares_frozen()
    shared.weight = nn.Parameter(torch.randn(2, 2))  # e.g. a re-initialised weight
    a(torch.randn(1, 2))
    assert ts.is_trainable(a, "1.weight") is ts.is_trainable(b, "0.weight") is False
    assert not shared.weight.requires_grad


def test_assign_on_one_model_keeps_a_shared_layer_trainable_after_the_other_lifts_its_declaration():
    shared, a, b = _two_models_sharing_a_layer_the_second_declares_frozen()
    a.load_state_dict({k: v.clone() for k, v in a.state_dict().items()}, assign=True)
    a(torch.randn(1, 2))
    ts.mark_trainable(b, None)
    assert flags(a) == reads(a) == [True] * 4


def test_a_tied_weight_follows_some_path_in_one_model_and_every_model_across_models():
    """The documented rule (docs/freezing.md, "Effective trainability"): within one model a
    tied parameter trains when every declaration along *one* of its paths admits it (listing
    any owner of the tie admits it); across attached models sharing it, every model's
    declarations must admit it. Both answers agree between flags and reads."""
    def tie():
        emb = nn.Embedding(4, 2)
        head = nn.Linear(2, 4, bias=False)
        head.weight = emb.weight
        return emb, head

    emb, head = tie()
    a, b = nn.Sequential(emb), nn.Sequential(head)
    ts.attach(a)
    ts.attach(b)
    ts.mark_trainable(head)  # the head trains nothing: b does not admit the shared weight
    assert not emb.weight.requires_grad and not ts.is_trainable(a, emb.weight)
    assert not ts.is_trainable(b, head.weight)

    emb, head = tie()
    one = nn.ModuleDict({"emb": emb, "head": head})
    ts.attach(one)
    ts.mark_trainable(head)  # one path excluded, the other ("emb.weight") admitted
    assert ts.is_trainable(one, "head.weight") and ts.is_trainable(one, "emb.weight")
    assert emb.weight.requires_grad
    ts.mark_trainable(emb)  # now every path is excluded
    assert not emb.weight.requires_grad and not ts.is_trainable(one, "head.weight")


# ----------------------------------------------------------------------------- decided once
def test_load_state_dict_assign_inside_a_block_selected_by_parameter_object_keeps_the_decision():
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    old = m[0].weight
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ts.RestoredFlagsWarning)
        with ts.freeze(m, old):
            m.load_state_dict({k: v + 1 for k, v in m.state_dict().items()}, assign=True)
            assert m[0].weight is not old
            assert flags(m) == reads(m) == [False, True, True, True]
            with ts.unfreeze(m, "0.weight"):
                assert flags(m) == reads(m) == [True] * 4
            assert flags(m) == reads(m) == [False, True, True, True]
    assert flags(m) == reads(m) == [True] * 4


def test_a_write_by_hand_survives_load_state_dict_assign_whether_or_not_it_was_seen():
    results = []
    for seen in (False, True):
        m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ts.RestoredFlagsWarning)
            with ts.freeze(m, "0"):
                m[0].weight.requires_grad_(True)
                if seen:
                    ts.attach(m)  # an application reads the write
                m.load_state_dict({k: v.clone() for k, v in m.state_dict().items()},
                                  assign=True)
                m(torch.randn(1, 2))
                results.append((flags(m), reads(m)))
    assert results[0] == results[1] == ([True, False, True, True],) * 2


def test_to_empty_inside_freeze_except_by_module_object_keeps_the_decision():
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    with ts.freeze_except(m, m[1]):
        m.to_empty(device="cpu")
        assert flags(m) == reads(m) == [False, False, True, True]
        m(torch.randn(1, 2))
        assert flags(m) == [False, False, True, True]
    assert flags(m) == reads(m) == [True] * 4


def test_a_renumbered_sequential_and_a_head_added_inside_the_block():
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    second = m[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ts.RestoredFlagsWarning)
        with ts.freeze(m, "1"):
            del m[0]  # "1" now names the old third layer: the decision does not move
            m.append(nn.Linear(2, 2))  # a new "2": judged when first seen, not picked
            m(torch.randn(1, 2))
            assert [p.requires_grad for p in second.parameters()] == [False, False]
            assert flags(m) == reads(m) == [False, False, True, True, True, True]
    assert flags(m) == reads(m) == [True] * 6


# ----------------------------------------------------------------------------- normalization
def _bn_net(momentum=0.1):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3, momentum=momentum), nn.Linear(3, 1))


def test_a_batchnorm_unfrozen_by_hand_inside_the_block_updates_its_statistics():
    net = _bn_net()
    plain = copy.deepcopy(net)
    x = torch.randn(8, 3)
    with ts.freeze(net, "1"):
        net[1].requires_grad_(True)
        assert ts.is_trainable(net, "1.weight") and ts.is_trainable(net, "1.bias")
        net(x)
    plain(x)
    assert torch.allclose(net[1].running_mean, plain[1].running_mean)


def test_update_bn_recomputes_the_statistics_of_a_held_batchnorm_and_the_hold_resumes():
    net = _bn_net(momentum=0.1)
    plain = copy.deepcopy(net)
    data = [torch.randn(8, 3) for _ in range(3)]
    update_bn(data, plain)
    with ts.freeze_except(net, "2"):
        update_bn(data, net)
        assert torch.allclose(net[1].running_mean, plain[1].running_mean)
        assert torch.allclose(net[1].running_var, plain[1].running_var)
        held = net[1].running_mean.clone()
        net(torch.randn(8, 3))
        assert torch.equal(net[1].running_mean, held)  # held again
        assert net[1].momentum == 0.1


def test_update_bn_on_a_held_batchnorm_built_with_momentum_none_is_an_error():
    """update_bn cannot be told apart from a forward for such a layer: a clear error, never
    statistics silently left at their reset values; outside the block update_bn works."""
    net = _bn_net(momentum=None)
    plain = copy.deepcopy(net)
    data = [torch.randn(8, 3) for _ in range(3)]
    update_bn(data, plain)
    net(torch.randn(8, 3))  # statistics of its own before the hold
    with ts.freeze_except(net, "2"):
        held = net[1].running_mean.clone()
        net(torch.randn(8, 3))
        assert torch.equal(net[1].running_mean, held)  # held, no error without a reset
        with pytest.raises(RuntimeError, match=r"momentum=None.*update_bn"):
            update_bn(data, net)
        assert flags(net) == [False, False, False, False, True, True]
    update_bn(data, net)
    assert torch.allclose(net[1].running_mean, plain[1].running_mean)
    assert torch.allclose(net[1].running_var, plain[1].running_var)


def test_statistics_loaded_into_a_held_batchnorm_built_with_momentum_none_are_held():
    net = _bn_net(momentum=None)
    other = _bn_net(momentum=None)
    other(torch.randn(8, 3) * 3 + 1)
    with ts.freeze_except(net, "2"):
        net.load_state_dict(other.state_dict())  # a write, but not a reset: no error
        net(torch.randn(8, 3))
        assert torch.equal(net[1].running_mean, other[1].running_mean)  # held
        net[1].reset_running_stats()  # a reset by hand: the same signal as update_bn's
        with pytest.raises(RuntimeError, match="were reset while"):
            net(torch.randn(8, 3))


def test_update_bn_on_an_averaged_model_made_inside_a_block():
    net = _bn_net()
    data = [torch.randn(8, 3) for _ in range(3)]
    with ts.freeze_except(net, "2"):
        avg = torch.optim.swa_utils.AveragedModel(net)
        plain = copy.deepcopy(avg)
        ts.detach_hooks(plain)
        update_bn(data, avg)
        update_bn(data, plain)
        assert torch.allclose(avg.module[1].running_mean, plain.module[1].running_mean)
        assert flags(avg) == [p.requires_grad for p in plain.parameters()]
    assert flags(net) == [True] * 6
    assert flags(avg.module) == [False, False, False, False, True, True]  # plain PyTorch copy


def test_attach_option_nearest_ancestor_or_self_wins_and_applies_at_once_inside_a_block():
    bn = nn.BatchNorm1d(3)
    inner = nn.Sequential(nn.Linear(3, 3), bn)
    outer = nn.Sequential(inner, nn.Linear(3, 1))
    ts.attach(bn, freeze_norm_stats=True)  # the layer's own choice, given first
    ts.attach(outer, freeze_norm_stats=False)  # its ancestor's, given later
    x = torch.randn(4, 3)
    with ts.freeze(outer, "0"):
        held = bn.running_mean.clone()
        outer(x)
        assert torch.equal(bn.running_mean, held)  # own choice wins
        ts.attach(bn, freeze_norm_stats=False)
        outer(x)
        assert not torch.equal(bn.running_mean, held)  # at once, inside the block
        with pytest.raises(TypeError):
            ts.attach(bn, freeze_norm_stats=1)
        ts.attach(inner)  # no option: nothing stored changes
        moved = bn.running_mean.clone()
        outer(x)
        assert not torch.equal(bn.running_mean, moved)
    assert bn.__dict__.get("_torchstruct_freeze_norm_stats") is False


# ----------------------------------------------------------------------------- warnings and invalid declarations
def test_weight_norm_inside_a_block_names_its_new_frozen_parameters_at_the_users_line():
    from torch.nn.utils.parametrizations import weight_norm

    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ts.freeze(m, "0"):
            weight_norm(m[0])
    said = restored_warnings(caught)
    assert len(said) == 1
    assert "'0.parametrizations.weight.original0'" in said[0]
    assert "'0.parametrizations.weight.original1'" in said[0]
    assert all(w.filename == __file__ for w in caught
               if issubclass(w.category, ts.RestoredFlagsWarning))
    assert [n for n, p in m.named_parameters() if not p.requires_grad] == [
        "0.parametrizations.weight.original0", "0.parametrizations.weight.original1"]
    assert flags(m) == reads(m)


def test_restored_flags_warning_of_a_decorated_function_points_at_the_users_code():
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))

    @ts.freeze(m, "0")
    def grow():
        m.append(nn.Linear(1, 1))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grow()
    located = [w.filename for w in caught if issubclass(w.category, ts.RestoredFlagsWarning)]
    assert located == [__file__]


def test_no_warning_for_a_block_in_which_nothing_was_added():
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ts.freeze_except(m, "1"):
            m[0].weight.requires_grad_(False)  # same value as the block's
            m(torch.randn(1, 2))
    assert restored_warnings(caught) == []
    assert flags(m) == [True] * 4


def _tiny_gpt2():
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=16, n_positions=8,
                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg)


def test_tie_weights_inside_a_block_gives_no_restored_flags_warning():
    g = _tiny_gpt2()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ts.freeze(g, "lm_head"):
            g.tie_weights()
    assert restored_warnings(caught) == []


def test_assign_copies_of_hand_frozen_parameters_are_not_named_as_created_in_the_block():
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    m[0].requires_grad_(False)  # the user's own choice, before any block
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ts.freeze(m, "1"):
            m.load_state_dict({k: v.clone() for k, v in m.state_dict().items()}, assign=True)
    assert flags(m) == reads(m) == [False, False, True, True]
    assert not any("'0.weight'" in said for said in restored_warnings(caught))


def test_gpt2_tied_head_frozen_through_either_path_with_gradient_checkpointing():
    g = _tiny_gpt2()
    g.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    g.train()
    ids = torch.randint(0, 16, (2, 6))
    with ts.freeze(g, "lm_head"):
        assert g.transformer.wte.weight is g.lm_head.weight
        assert not g.transformer.wte.weight.requires_grad
        assert not ts.is_trainable(g, "transformer.wte.weight")
        assert ts.summary(g).counts[0] == sum(p.numel() for p in g.parameters() if p.requires_grad)
        g.transformer.wte.weight.requires_grad_(True)  # by hand: stands, through either path
        assert ts.is_trainable(g, g.lm_head.weight)
        g(ids, labels=ids).loss.backward()
        assert g.lm_head.weight.grad is not None
    assert all(flags(g))


def test_a_declaration_broken_by_an_attribute_error_inside_a_block_restores_then_raises():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(2, 2)
            self.heads = nn.ModuleDict({"h": nn.Linear(2, 2)})

        def trainable(self):
            return ["body"] + (["heads"] if len(self.heads) else [])

    m = Net()
    ts.attach(m)
    with pytest.raises(AttributeError):
        with ts.freeze(m, "body"):
            del m.heads
    assert flags(m) == [True, True]


def test_a_declaration_made_invalid_inside_nested_blocks_restores_then_raises_at_each_exit():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(2, 2)
            self.b = nn.Linear(2, 2)

        def trainable(self):
            return ["a", "b"]

    m = Net()
    outer = ts.freeze(m, "a.bias")
    with pytest.raises(ValueError, match="'b'"):
        with ts.freeze(m, "a.weight"):
            del m.b
    assert flags(m) == [True, False]  # the inner block's flags restored, the outer's kept
    with pytest.raises(ValueError):
        outer.__exit__(None, None, None)
    assert flags(m) == [True, True]  # 'a' still admitted by the invalid declaration
    with pytest.raises(ValueError):
        ts.freeze(m, "a")  # refused: nothing changes
    assert flags(m) == [True, True]


# ----------------------------------------------------------------------------- copies, schedules, PEFT
def test_a_deepcopy_made_inside_a_block_is_plain_pytorch_and_starts_from_its_own_flags():
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    with ts.freeze(m, "0"):
        c = copy.deepcopy(m)
        assert flags(c) == reads(c) == [False, False, True, True]
        ts.attach(c)  # from its own flags: the original's block is not its own
        assert flags(c) == reads(c) == [False, False, True, True]
        with ts.unfreeze(c, "0.weight"):
            assert flags(c) == [True, False, True, True]
            assert flags(m) == [False, False, True, True]
    assert flags(m) == [True] * 4
    assert flags(c) == reads(c) == [False, False, True, True]


def test_unfreeze_schedule_keeps_hand_frozen_parameters_and_refuses_a_stage_without_changes():
    m = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2), "head": nn.Linear(2, 1)})
    s = ts.UnfreezeSchedule(m, {0: "head", 1: "b", 2: None})
    m["head"].bias.requires_grad_(False)  # by hand, against nothing: stands for good
    s.step()
    assert flags(m) == reads(m) == [False, False, True, True, True, False]
    saved = s.state_dict()
    with ts.freeze(m, "b"):
        s.step()  # everything: applies on top of the block, leaves it as it is
        assert flags(m) == reads(m) == [True, True, False, False, True, False]
    assert flags(m) == reads(m) == [True, True, True, True, True, False]
    s.load_state_dict(saved)
    assert s.current_step == 1
    assert flags(m) == reads(m) == [False, False, True, True, True, False]
    with pytest.raises(ValueError):
        s.load_state_dict({"step": -1, "milestones": [0, 1, 2]})
    assert flags(m) == reads(m) == [False, False, True, True, True, False]

    m = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2), "head": nn.Linear(2, 1)})
    s = ts.UnfreezeSchedule(m, {0: "head", 1: "b"})
    del m["b"]  # the next stage's selector now matches nothing
    m["a"].weight.requires_grad_(True)  # by hand, not yet seen
    before = flags(m)
    with pytest.raises(ValueError, match="'b'"):
        s.step()
    assert flags(m) == reads(m) == before == [True, False, True, True]
    assert s.current_step == 0


def test_a_schedule_step_inside_a_later_unfreeze_block_does_not_override_the_block():
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 1))
    s = ts.UnfreezeSchedule(m, {0: "2", 1: "1"})
    with ts.unfreeze(m, "0"):
        assert flags(m) == [True, True, False, False, True, True]
        s.step()
        assert flags(m) == reads(m) == [True] * 6
    assert flags(m) == reads(m) == [False, False, True, True, True, True]


def test_peft_lora_block_with_a_base_weight_unfrozen_by_hand():
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    pytest.importorskip("transformers")
    from transformers import BertConfig, BertModel

    cfg = BertConfig(hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=16, vocab_size=32, max_position_embeddings=16)
    torch.manual_seed(0)
    pm = get_peft_model(BertModel(cfg), LoraConfig(r=2, target_modules=["query", "value"]))
    start = flags(pm)
    query = pm.base_model.model.encoder.layer[0].attention.self.query
    with ts.freeze_except(pm, "*lora_A*"):
        assert not query.lora_B["default"].weight.requires_grad
        query.base_layer.weight.requires_grad_(True)
        assert flags(pm) == reads(pm)
        assert ts.summary(pm).counts[0] == sum(p.numel() for p in pm.parameters() if p.requires_grad)
        pm(input_ids=torch.randint(0, 32, (2, 5))).last_hidden_state.sum().backward()
        assert query.base_layer.weight.grad is not None
        assert query.lora_B["default"].weight.grad is None
    changed = [n for (n, _), a, b in zip(pm.named_parameters(), start, flags(pm)) if a != b]
    assert changed == ["base_model.model.encoder.layer.0.attention.self.query.base_layer.weight"]


# ----------------------------------------------------------------------------- error paths
def test_refused_calls_after_an_unseen_write_change_no_flag_and_reads_install_nothing():
    shared = nn.Linear(2, 2)
    m = nn.Sequential(nn.Linear(2, 2), shared)
    other = nn.Sequential(shared, nn.Linear(2, 1))  # never attached
    m.register_parameter("steps", nn.Parameter(torch.zeros(1, dtype=torch.long),
                                               requires_grad=False))
    ctx = ts.freeze(m, "0", "1.bias")
    m[0].weight.requires_grad_(True)  # not yet seen by any application
    before, read_before = flags(m), reads(m)
    assert read_before == before == [False, True, False, True, False]
    refused = [
        lambda: ts.freeze(m, "0.wieght"),
        lambda: ts.freeze_except(m, []),
        lambda: ts.unfreeze(m, nn.Linear(1, 1)),
        lambda: ts.unfreeze(m, "steps"),  # an integer parameter cannot train
        lambda: ts.mark_trainable(m, "nope"),
        lambda: ts.mark_trainable(m, "0", 1),
        lambda: ts.attach(m, freeze_norm_stats="no"),
        lambda: ts.is_trainable(m, "2.weight"),
        lambda: ts.param_groups(m, ("nothing.*", {"lr": 1.0})),
    ]
    for call in refused:
        with pytest.raises((TypeError, ValueError)):
            call()
        assert flags(m) == before and reads(m) == read_before
    assert "_torchstruct_freeze_norm_stats" not in m.__dict__
    assert reads(other) == flags(other) == [True, False, True, True]
    assert len(other._forward_pre_hooks) == 0 and ts.hooks._state.state_of(other) is None
    ctx.__exit__(None, None, None)
    assert flags(m) == reads(m) == [False, True, True, True, True]


def test_a_decorated_generator_restores_flags_when_thrown_into_or_collected():
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    seen_in_finally = []

    @ts.freeze(m, "0")
    def batches():
        try:
            while True:
                yield flags(m)
        finally:
            seen_in_finally.append(flags(m))

    it = batches()
    assert next(it) == [False, False, True, True] and flags(m) == [True] * 4
    with pytest.raises(KeyError):
        it.throw(KeyError("stop"))
    assert flags(m) == [True] * 4
    it = batches()
    next(it)
    del it
    gc.collect()
    assert flags(m) == [True] * 4
    assert seen_in_finally == [[False, False, True, True]] * 2  # the body always ran frozen
