"""Stateful audit of the flag rule: long random programs against a brute-force model.

What it audits (DESIGN.md "Flags: who sets what", §1 Declaring, §2 Contexts, §6
UnfreezeSchedule; docs/freezing.md, docs/selecting.md, docs/schedule.md): a hypothesis
``RuleBasedStateMachine`` drives one small attached model

    Net: body = Sequential(Linear, BatchNorm1d, Linear, ...)   (grows, shrinks, is replaced)
         heads = ModuleDict({"h0": Linear, "h1": Linear, ...})  (grows, shrinks, is replaced)
         gate = Gate (a, b: Linear; scale: Parameter; ``trainable()`` lists "a" and "scale")
         out = Linear whose weight IS body[0].weight           (one tied parameter)

through random sequences of: ``with`` blocks of ``freeze`` / ``freeze_except`` / ``unfreeze``
(scoped to the root or a submodule; glob, regex, module, parameter, callable and list selectors)
kept open on a stack and left innermost-first or out of order; bare (permanent) contexts, lifted
later; ``ts.mark_trainable`` and its removal; ``requires_grad_()`` by hand; forwards, backwards and
``ts.optim.SGD`` steps; tree edits (append, replace, delete; inside and outside blocks); an
``UnfreezeSchedule`` (step, state_dict, load_state_dict, close); ``copy.deepcopy`` of the model
(plain PyTorch until attached); ``ts.attach`` again; bad selectors. Also (docs/freezing.md "Hooks",
"When the hook does not see a change", "Tensor swapping"): parameters replaced without a container
edit (``module.bias = nn.Parameter(...)``, ``del`` then ``register_parameter``,
``torch.utils.swap_tensors``, ``load_state_dict(sd, assign=True)`` with Parameters or tensors,
``model.to(dtype)`` by ``.data``, by swapping and by overwriting ``_parameters``);
``torch.nn.utils.parametrize`` register/remove on a body Linear (``Same``, ``weight_norm``);
forwards that must not apply (a part beside the change) and that must (a forward under
``checkpoint(..., use_reentrant=False)``, compared with the gradients without it; a forward of
the module registered into, or of one between it and the root; ``torch.func.functional_call`` of
the root, on stand-ins that are never written);
``ts.structural_grad`` with and without ``wrt`` (flags inside the call, every flag back after it,
the tree against ``torch.autograd.grad`` on a plain copy, normalization as outside the call);
``ts.stop_gradient`` and ``ts.swap`` blocks around a forward and backward (which parameters and
stand-ins get ``.grad``; the hook applies inside them on the parameters' own flags).

The oracle (``Reference`` below) is written from the contract text only, never from the
library's code. Per parameter *object* it keeps the starting flag, the flag torchstruct last
wrote and the serial of the newest context/declaration that existed when a hand write was read
(``over``); per active context its kind, scope, selector and the decision it made for each
parameter (decided once, docs/freezing.md "A context decides once per parameter"). At every
*application* (entering / leaving a context, a declaration, a schedule stage change or load,
``ts.attach``, a forward of the root after the tree changed) it does what the docs say the
library does: read hand writes (a flag that differs from the last written one becomes the
starting flag and overrides the contexts and declarations existing then), give parameters that
left the model their starting flag back, judge new parameters (a parameter put in place of one
that left, carrying the flag last written there, is taken as its copy), then fold the active
contexts outermost first (the innermost wins) and gate by the declarations (a tied parameter
needs one admitting path). Between applications flags move only by the user's own writes.

Invariants after every step: every flag equals the prediction (also the flags of removed
parameters and of deep copies); outside a pending tree change, ``ts.trainable_parameters``,
``ts.is_trainable`` and ``ts.summary(...).counts`` agree with the flags (tied once); after a
training forward a BatchNorm torchstruct froze keeps its statistics, a trainable one updates
them; a backward gives no gradient to a frozen parameter; ``ts.optim.SGD`` leaves frozen
parameters bitwise unchanged and without state; at teardown, leaving every block, then lifting
the bare contexts, the schedule and the declarations, restores exactly the predicted flags.

Modules that leave the model are dropped at once, so that new ones may reuse their addresses
(a module at the address of one that left must not be taken for it). Where the contract is
ambiguous the machine tests only what is pinned (comments say where: out-of-order exits, a
refused call with unread hand writes, attaching a copy, a new parameter put at the path of one
that left, reads of new parameters the hook has not applied yet, structural_grad with changes
or hand writes waiting). A bug it finds gets a plain reproduction in the test file of its
feature.

Longer hunts: ``TS_FUZZ_EXAMPLES=1500 TS_FUZZ_STEPS=80`` (about 10 minutes; the default,
200 x 40, is sized for CI), ``TS_FUZZ_SHRINK=0`` to report a failure at once (its program is in
the message).
"""
import copy
import fnmatch
import functools
import os
import re

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import HypothesisException
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)
from torch import nn
from torch.nn.utils import parametrize
from torch.utils.checkpoint import checkpoint

import torchstruct as ts

# The exits name the parameters they turn back on (docs/freezing.md): expected here.
pytestmark = pytest.mark.filterwarnings("ignore::torchstruct.RestoredFlagsWarning")
EXAMPLES = int(os.environ.get("TS_FUZZ_EXAMPLES", "200"))
STEPS = int(os.environ.get("TS_FUZZ_STEPS", "40"))
D = 3
KINDS = ("freeze", "freeze_except", "unfreeze")


# ------------------------------------------------------------------------------------ the model
class Gate(nn.Module):
    """A user module that declares what trains through ``trainable()``."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, D)
        self.b = nn.Linear(D, D)
        self.scale = nn.Parameter(torch.ones(D))

    def trainable(self):
        return ["a", "scale"]

    def forward(self, x):
        return self.b(self.a(x)) * self.scale


GATE_NAMES = ("a", "scale")


class Same(nn.Module):
    """A parametrization that changes nothing: the weight moves, its object stays."""

    def forward(self, w):
        return w


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D), nn.Linear(D, D))
        self.heads = nn.ModuleDict({"h0": nn.Linear(D, D), "h1": nn.Linear(D, D)})
        self.gate = Gate()
        self.out = nn.Linear(D, D)
        self.out.weight = self.body[0].weight  # tied: lives at "body.0.weight"

    def forward(self, x):
        h = self.body(x)
        for k in self.heads:
            h = h + self.heads[k](h)
        return self.out(self.gate(h))


def first_paths(model):
    """``(path, param)`` once per object, at its first path (named_parameters order)."""
    return list(model.named_parameters())


def all_paths(module):
    """id -> (param, [every path]) under ``module``."""
    out = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), (p, []))[1].append(n)
    return out


def prefixes(path):
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def judge(spec, paths, p):
    """Whether selector ``spec`` picks parameter ``p`` whose paths (relative to the scope) are
    ``paths`` — docs/selecting.md's table; a tied parameter is picked when any path is."""
    if spec is None:
        return True
    kind, v = spec
    if kind == "glob":  # fnmatch over parameter paths and module paths (a module: its subtree)
        return any(fnmatch.fnmatchcase(q, v) or any(fnmatch.fnmatchcase(m, v) for m in prefixes(q))
                   for q in paths)
    if kind == "regex":
        return any(v.fullmatch(q) is not None for q in paths)
    if kind == "module":
        return any(q is p for q in v.parameters())
    if kind == "param":
        return v is p
    if kind == "callable":
        return bool(v(paths[0], p))
    if kind == "list":
        return any(judge(s, paths, p) for s in v)
    raise AssertionError(kind)


def is_vector(path, p):
    """A callable selector: the 1-d parameters (biases, norm weights, the gate's scale)."""
    return p.ndim == 1


def bits(t):
    """The raw bits of ``t`` (a NaN equals itself: a diverged model's gradients compare)."""
    return t.detach().clone().view(torch.int64 if t.element_size() == 8 else torch.int32)


# --------------------------------------------------------------------------- the brute force
class Rec:
    """What the contract says torchstruct knows about one parameter object."""

    def __init__(self, p, start, over=-1):
        self.p = p
        self.start = start  # starting flag
        self.last = None  # flag torchstruct last wrote (the prediction at the last application)
        self.over = over  # contexts/declarations with serial <= over do not apply (a hand write)
        self.paths = []  # paths at the last application


class Ctx:
    def __init__(self, kind, scope, spec, serial, obj, label):
        self.kind, self.scope, self.spec, self.serial = kind, scope, spec, serial
        self.obj, self.label = obj, label
        self.decided = {}  # id -> (param, picked): decided once per parameter
        self.inscope = set()  # ids under ``scope`` at the last application


class Reference:
    def __init__(self, model):
        self.model = model
        self.recs = {}  # id -> Rec, the parameters present at the last application
        self.serial = 0  # newest context / declaration; trainable() methods count as 0
        self.active = []  # Ctx, outermost (oldest) first
        self.decl = {}  # id(module) -> (module, names, serial): mark_trainable declarations
        self.expect = {}  # id -> (param, flag): every flag the user can see, predicted
        self.pending = False  # the tree changed since the last application
        # the modules registered into since then ("a forward of the module it was registered
        # into, or of any module between it and the root, applies the change first")
        self.pending_regs = []
        # a change the hook does not see (a write straight into ``_parameters``): read at the
        # next application, never by a forward alone
        self.unseen = False
        self.known = []
        self.gone_log = []

    # -- the contract's rule --------------------------------------------------------------
    def declaration(self, mod):
        if isinstance(mod, Gate) and id(mod) not in self.decl:
            return GATE_NAMES, 0  # "a class's trainable() method counts as made before anything"
        d = self.decl.get(id(mod))
        return None if d is None else (d[1], d[2])

    def admitted(self, rec, paths):
        """Every declaration along SOME path (made after the parameter's hand write) lists the
        next name (§1; docs/freezing.md, a tied parameter needs one such path)."""
        for path in paths:
            mod, ok = self.model, True
            for name in path.split("."):
                d = self.declaration(mod)
                if d is not None and d[1] > rec.over and name not in d[0]:
                    ok = False
                    break
                mod = mod._modules.get(name)
                if mod is None:
                    break
            if ok:
                return True
        return False

    def effective(self, rec, paths):
        cur = rec.start
        for c in self.active:  # outermost first: the innermost wins
            if c.serial <= rec.over or id(rec.p) not in c.decided:
                continue
            if id(rec.p) not in c.inscope:
                # a context acts within its scope only: a copy put in place of a tied parameter
                # at a path outside the scope (the tie split in two) inherits its decision, but
                # is not under that context
                continue
            picked = c.decided[id(rec.p)][1]
            if c.kind == "freeze" and picked:
                cur = False
            elif c.kind == "freeze_except" and not picked:
                cur = False
            elif c.kind == "unfreeze" and picked:
                cur = True
        return cur and self.admitted(rec, paths)

    # -- an application, in two halves around the library's call --------------------------
    def plan(self):
        """What ``pre()`` would read, without reading it: the tree now, the parameters that left,
        and each new parameter with the one that left it is the copy of (or ``None``)."""
        cur = all_paths(self.model)
        gone = {i: r for i, r in self.recs.items() if i not in cur}
        new = {}
        for i, (p, paths) in cur.items():
            if i in self.recs:
                continue
            # "A parameter put in place of another with the flag torchstruct last wrote at its
            # path ... inherits what was decided for the one it replaces" (and keeps its
            # starting flag). We read "in place of another" as: the other one left the model.
            # A hand write not read yet on the one replaced is read first ("exactly as when
            # ts.attach(model) ran between the two"), so the flag compared is its flag now.
            new[i] = next((g for g in gone.values()
                           if set(g.paths) & set(paths) and p.requires_grad is g.p.requires_grad),
                          None)
        return cur, gone, new

    def pre(self):
        """What the library reads before it applies: hand writes, parameters that left, new
        parameters (with their own flags as they are now)."""
        cur, gone, new = self.plan()
        for rec in self.recs.values():  # a hand write becomes the starting flag and stands
            if rec.p.requires_grad is not rec.last:
                rec.start, rec.over = rec.p.requires_grad, self.serial
                # read: from now on it is the flag known at that parameter (what the copy
                # rule compares with, "exactly as when ts.attach(model) ran between")
                rec.last = rec.p.requires_grad
        self._gone = gone
        for i in gone:
            del self.recs[i]
        for i, g in new.items():
            p = cur[i][0]
            rec = Rec(p, p.requires_grad)
            if g is not None:
                rec.start, rec.over = g.start, g.over
                for c in self.active:
                    if id(g.p) in c.decided:
                        c.decided[i] = (p, c.decided[id(g.p)][1])
            self.recs[i] = rec

    def post(self):
        cur = all_paths(self.model)
        for c in self.active:  # judge what each active context has not seen yet
            scope = all_paths(c.scope)
            c.inscope = set(scope)
            for i, (p, paths) in scope.items():
                if i not in c.decided:
                    c.decided[i] = (p, judge(c.spec, paths, p))
        for i, rec in self.recs.items():
            rec.paths = cur[i][1]
            rec.last = self.effective(rec, rec.paths)
            self.expect[i] = (rec.p, rec.last)
        for i, g in self._gone.items():  # left: its starting flag back (or the hand write)
            self.expect[i] = (g.p, g.start)
            self.gone_log.append((g.p, g.start))
        self._gone = {}
        self.pending = False
        self.pending_regs = []
        self.unseen = False
        self.known = list(self.model.modules())  # the tree at the last application

    def drop_gone(self):
        for p, _ in self.gone_log:
            self.expect.pop(id(p), None)
        self.gone_log = []

    def written(self):
        """Hand writes not read yet."""
        return [r.p for r in self.recs.values() if r.p.requires_grad is not r.last]

    def new_serial(self):
        self.serial += 1
        return self.serial


# ------------------------------------------------------------------------- the state machine
def step(f):
    """A rule or invariant: a failure marks the machine broken (teardown then only cleans up)
    and carries the program so far, written as torchstruct calls."""
    @functools.wraps(f)
    def run(self, *args, **kwargs):
        self.broken = True
        try:
            out = f(self, *args, **kwargs)
        except AssertionError as e:
            if "program:" in str(e):
                raise
            raise AssertionError(f"{e}\n{self.trace_text()}") from None
        except HypothesisException:
            raise
        except Exception as e:  # an unexpected error: the program too
            raise AssertionError(f"{type(e).__name__}: {e}\n{self.trace_text()}") from e
        self.broken = False
        return out
    return run


class FlagMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.model = None
        self.broken = False

    # -- helpers ------------------------------------------------------------------------------
    def apply(self, call):
        self.ref.pre()
        out = call()
        return out

    def settle(self):
        self.ref.post()
        self.check_flags("after an application")
        self.ref.drop_gone()

    def check_flags(self, when):
        wrong = {}
        for i, (p, want) in self.ref.expect.items():
            if p.requires_grad is not want:
                wrong[self.name_of(p)] = (p.requires_grad, want)
        for c, snap in self.copies:
            for p, want in snap:
                if p.requires_grad is not want:
                    where = "" if any(q is p for q in c.parameters()) else "(not in it) "
                    where += "(in the model!) " if any(q is p for q in self.model.parameters()) else ""
                    wrong[f"<copy {id(c):#x}> {where}" + self.name_of(p, c)] = (p.requires_grad, want)
        assert not wrong, f"{when}: flags (got, want) {wrong}\n{self.trace_text()}"

    def name_of(self, p, model=None):
        for n, q in (model or self.model).named_parameters(remove_duplicate=False):
            if q is p:
                return n
        return f"<left the model, {tuple(p.shape)}>"

    def note_new(self, module, into):
        """``module`` was registered into ``into`` (a module of the tree)."""
        for p in module.parameters():
            self.ref.expect.setdefault(id(p), (p, p.requires_grad))
        self.note_present()
        self.ref.pending = True
        self.ref.pending_regs.append(into)

    def note_present(self):
        """Parameters put into the model by PyTorch itself: their own flags until applied."""
        for p in self.model.parameters():
            self.ref.expect.setdefault(id(p), (p, p.requires_grad))

    def in_model(self, mod):
        return any(m is mod for m in self.model.modules())

    def batch(self, dtype=None):
        return torch.randn(6, D, dtype=dtype or self.dtype, requires_grad=True)

    def bn_state(self):
        """'held' / 'free' / None (not pinned) for the body's BatchNorm, from the flags now:
        held while torchstruct froze all its parameters (§2, docs "Normalization statistics");
        trainable: PyTorch's behaviour. Mixed or frozen by a hand write: not pinned for this
        check (a hand-frozen layer keeps updating, but mixed cases are not). A parameter put in
        by a write the hook does not see, not applied yet: not pinned either."""
        bn = self.model.body[1]
        if any(id(p) not in self.ref.recs for p in bn.parameters()):
            return None
        recs = [self.ref.recs[id(p)] for p in bn.parameters()]
        if all(r.start and r.last is False and r.p.requires_grad is False for r in recs):
            return "held"
        if all(r.p.requires_grad for r in recs):
            return "free"
        return None

    def check_bn(self, state, mean, what="a forward"):
        bn = self.model.body[1]
        if state == "held":
            assert torch.equal(bn.running_mean, mean), f"a frozen BatchNorm updated ({what})"
        elif state == "free":
            assert not torch.equal(bn.running_mean, mean), f"a trainable BatchNorm did not update ({what})"
        assert bn.training

    def scopes(self):
        return [("model", self.model), ("model.body", self.model.body),
                ("model.heads", self.model.heads)]

    def draw_selector(self, data, scope, allow_list=True):
        paths = all_paths(scope)
        rel = [n for n, _ in scope.named_parameters(remove_duplicate=False)]
        mods = sorted({m for n in rel for m in prefixes(n)})
        kinds = ["glob", "glob", "regex", "module", "param", "callable"]
        if allow_list:
            kinds.append("list")
        kind = data.draw(st.sampled_from(kinds), label="selector kind")
        if kind == "glob":
            cands = mods + rel + ["*.bias", "*weight", "*.1*", "*.h0*", "gate.*", "heads.*",
                                  "body.*", "*scale"]
            cands = [g for g in cands if any(judge(("glob", g), ps, p) for p, ps in paths.values())]
            g = data.draw(st.sampled_from(cands), label="glob")
            return g, ("glob", g), repr(g)
        if kind == "regex":
            cands = [re.escape(n) for n in rel] + [r".*\.bias", r".*\.0\..*", r"(gate|out)\..*"]
            cands = [r for r in cands
                     if any(judge(("regex", re.compile(r)), ps, p) for p, ps in paths.values())]
            r = re.compile(data.draw(st.sampled_from(cands), label="regex"))
            return r, ("regex", r), f"re.compile({r.pattern!r})"
        if kind == "module":
            names = [m for m in mods]
            if not names:
                return self.draw_selector(data, scope, allow_list)
            n = data.draw(st.sampled_from(names), label="module")
            m = scope.get_submodule(n)
            return m, ("module", m), f"<module {n}>"
        if kind == "param":
            n = data.draw(st.sampled_from(rel), label="param")
            p = scope.get_parameter(n)
            return p, ("param", p), f"<param {n}>"
        if kind == "callable":
            return is_vector, ("callable", is_vector), "is_vector"
        parts = [self.draw_selector(data, scope, False)
                 for _ in range(data.draw(st.integers(1, 2), label="list length"))]
        return ([a for a, _, _ in parts], ("list", [b for _, b, _ in parts]),
                "[" + ", ".join(c for _, _, c in parts) + "]")

    def log(self, line):
        self.trace.append(line)

    def trace_text(self):
        return "program:\n  " + "\n  ".join(self.trace[-60:])

    # -- set-up ---------------------------------------------------------------------------
    @initialize(start=st.lists(st.booleans(), min_size=16, max_size=16))
    def setup(self, start):
        torch.manual_seed(0)
        self.model = Net().train()
        self.dtype = torch.float32
        for p, b in zip(self.model.parameters(), start):
            p.requires_grad_(b)
        self.ref = Reference(self.model)
        for p in self.model.parameters():
            self.ref.expect[id(p)] = (p, p.requires_grad)
        self.blocks = []  # Ctx entered as with-blocks, in entry order
        self.bares = []  # bare (permanent) contexts still in force
        self.schedule = None
        self.sched_ms = None
        self.sched_step = 0
        self.copies = []  # (copy, [(param, flag)])
        self.copy_decl = {}  # id(copy) -> {module path: names} it carries
        self.head_id = 2
        self.trace = [f"starting flags {start}"]
        self.opt = ts.optim.SGD(list(self.model.parameters()), lr=0.1, momentum=0.9,
                                weight_decay=0.1)
        self.opt_params = list(self.model.parameters())
        self.ever = set()
        self.apply(lambda: ts.attach(self.model))
        self.settle()

    def teardown(self):
        if self.model is None:
            return
        try:
            if not self.broken:
                for c in reversed(list(self.blocks)):  # every block left, innermost first
                    self._exit(c)
                self.blocks = []
                self.check_flags("after every block was left")
                for c in list(self.bares):
                    self._exit(c)
                self.bares = []
                if self.schedule is not None:
                    self.apply(self.schedule.close)
                    self.ref.active = [c for c in self.ref.active if c.label != "schedule"]
                    self.settle()
                    self.schedule = None
                for key, (mod, _, _) in list(self.ref.decl.items()):
                    self.apply(lambda: ts.mark_trainable(mod, None))
                    del self.ref.decl[key]
                    self.settle()
                assert not self.ref.active
                self.apply(lambda: ts.attach(self.model))  # read the last hand writes
                self.settle()
                # nothing left but trainable(): every flag is its starting flag (hand writes
                # included), and gate.b only where a hand write overrode the declaration
                wrong = {self.name_of(r.p): r.p.requires_grad for r in self.ref.recs.values()
                         if r.p.requires_grad is not (r.start and self.ref.admitted(r, r.paths))}
                assert not wrong, f"at the end, flags (got) {wrong}\n{self.trace_text()}"
        finally:
            for c in reversed(self.blocks + self.bares):
                try:
                    c.obj.__exit__(None, None, None)
                except Exception:
                    pass
            if self.schedule is not None:
                try:
                    self.schedule.close()
                except Exception:
                    pass
            for mod, _, _ in list(self.ref.decl.values()):
                try:
                    ts.mark_trainable(mod, None)
                except Exception:
                    pass
            ts.detach_hooks(self.model)
            for c, _ in self.copies:
                ts.detach_hooks(c)

    # -- invariants -------------------------------------------------------------------------
    @invariant()
    @step
    def flags_and_reads(self):
        if self.model is None:
            return
        self.check_flags("between applications (only hand writes move a flag)")
        if self.ref.pending:
            return  # reads judge a pending change at once; flags wait: compared after it
        if self.ref.plan()[2]:
            # a change the hook does not see put new parameters in: reads answer for them
            # already, their flags wait for the application (docs/freezing.md "Hooks"). Even a
            # copy's answer may differ from the flag it carries: a tie split in two by the
            # conversion leaves each copy only its own path for the declarations to admit.
            return
        named = first_paths(self.model)
        said = [(n, id(p)) for n, p in ts.trainable_parameters(self.model)]
        assert said == [(n, id(p)) for n, p in named if p.requires_grad], "trainable_parameters"
        for n, p in named:
            assert ts.is_trainable(self.model, p) is p.requires_grad, f"is_trainable(<{n}>)"
        for n, p in self.model.named_parameters(remove_duplicate=False):  # "out.weight" too
            assert ts.is_trainable(self.model, n) is p.requires_grad, f"is_trainable({n!r})"
        total = sum(p.numel() for _, p in named)
        trainable = sum(p.numel() for _, p in named if p.requires_grad)
        assert tuple(ts.summary(self.model).counts) == (trainable, total), "summary counts"
        self.check_flags("after the reads (read-only calls write no flag)")

    # -- contexts -----------------------------------------------------------------------------
    def _enter(self, data, bare):
        name, scope = data.draw(st.sampled_from(self.scopes()), label="scope")
        kind = data.draw(st.sampled_from(KINDS), label="kind")
        n = data.draw(st.integers(1 if kind == "freeze_except" else 0, 2), label="n selectors")
        sels = [self.draw_selector(data, scope) for _ in range(n)]
        spec = None if not sels else ("list", [s for _, s, _ in sels])
        text = f"ts.{kind}({name}{''.join(', ' + c for _, _, c in sels)})"
        self.log(("bare " if bare else "with ") + text)
        obj = self.apply(lambda: getattr(ts, kind)(scope, *[a for a, _, _ in sels]))
        if not bare:
            obj.__enter__()
        c = Ctx(kind, scope, spec, self.ref.new_serial(), obj, text)
        self.ref.active.append(c)
        (self.bares if bare else self.blocks).append(c)
        self.settle()

    def _exit(self, c):
        self.log(f"exit {c.label}")
        self.apply(lambda: c.obj.__exit__(None, None, None))
        self.ref.active.remove(c)
        self.settle()

    @rule(data=st.data())
    @step
    def enter_block(self, data):
        self._enter(data, bare=False)

    @rule(data=st.data())
    @step
    def bare_context(self, data):
        self._enter(data, bare=True)

    @precondition(lambda self: self.blocks)
    @rule()
    @step
    def exit_innermost(self):
        self._exit(self.blocks.pop())

    @precondition(lambda self: len(self.blocks) > 1)
    @rule(data=st.data())
    @step
    def exit_out_of_order(self, data):
        # Out-of-order exit of a flag context is not described in docs/freezing.md; §1 defines
        # effective trainability from the *active* contexts, so leaving one removes only it.
        i = data.draw(st.integers(0, len(self.blocks) - 2), label="which block")
        self._exit(self.blocks.pop(i))

    @precondition(lambda self: self.bares)
    @rule(data=st.data())
    @step
    def lift_bare(self, data):
        i = data.draw(st.integers(0, len(self.bares) - 1), label="which bare")
        self._exit(self.bares.pop(i))

    @precondition(lambda self: not self.ref.pending and not self.ref.unseen
                  and not self.ref.written())
    @rule(data=st.data())
    @step
    def bad_selector(self, data):
        # Errors: raise before anything changes. (Only without unread hand writes: whether a
        # refused call reads them is not said.)
        name, scope = data.draw(st.sampled_from(self.scopes()), label="scope")
        kind = data.draw(st.sampled_from(KINDS), label="kind")
        bad = data.draw(st.sampled_from(["typo", "foreign module", "foreign param", "empty"]))
        sel = {"typo": "gaet.zz", "foreign module": nn.Linear(1, 1),
               "foreign param": nn.Parameter(torch.zeros(1)), "empty": []}[bad]
        self.log(f"ts.{kind}({name}, <{bad}>)  # raises")
        with pytest.raises(ValueError):
            getattr(ts, kind)(scope, sel)
        self.check_flags("after a refused call")

    # -- declarations -------------------------------------------------------------------------
    def decl_targets(self):
        m = self.model
        return [("model", m, ["body", "heads", "gate", "out"]),
                ("model.body", m.body, [str(i) for i in range(len(m.body))]),
                ("model.heads", m.heads, list(m.heads.keys())),
                ("model.out", m.out, ["weight", "bias"]),
                ("model.gate.b", m.gate.b, ["weight", "bias"])]

    @rule(data=st.data())
    @step
    def mark(self, data):
        name, target, names = data.draw(st.sampled_from(self.decl_targets()), label="target")
        if id(target) in self.ref.decl and data.draw(st.booleans(), label="remove"):
            self.log(f"ts.mark_trainable({name}, None)")
            self.apply(lambda: ts.mark_trainable(target, None))
            del self.ref.decl[id(target)]
        else:
            pick = data.draw(st.lists(st.sampled_from(names), unique=True, max_size=len(names)),
                             label="names")
            self.log(f"ts.mark_trainable({name}, *{pick})")
            self.apply(lambda: ts.mark_trainable(target, *pick))
            self.ref.decl[id(target)] = (target, tuple(pick), self.ref.new_serial())
        self.settle()

    @rule()
    @step
    def attach_again(self):
        self.log("ts.attach(model)")
        self.apply(lambda: ts.attach(self.model))
        self.settle()

    # -- hand writes -------------------------------------------------------------------------
    @rule(data=st.data(), flag=st.booleans())
    @step
    def write_by_hand(self, data, flag):
        named = list(self.model.named_parameters())
        n, p = data.draw(st.sampled_from(named), label="param")
        self.log(f"model.get_parameter({n!r}).requires_grad_({flag})")
        p.requires_grad_(flag)
        self.ref.expect[id(p)] = (p, flag)

    # -- running ------------------------------------------------------------------------------
    def _forward(self):
        x = self.batch()
        bn = self.model.body[1]
        mean = bn.running_mean.clone()
        if self.ref.pending:
            self.ref.pre()
            y = self.model(x)
            self.settle()
        else:
            y = self.model(x)
        self.check_bn(self.bn_state(), mean)
        return y

    @rule()
    @step
    def forward(self):
        self.log("model(x)")
        self._forward()

    @rule()
    @step
    def backward(self):
        self.log("model(x).square().mean().backward()")
        before = {id(p): (None if p.grad is None else p.grad.clone()) for p in self.model.parameters()}
        y = self._forward()
        y.square().mean().backward()
        for n, p in self.model.named_parameters():
            g = before[id(p)]
            if not p.requires_grad:
                assert (p.grad is None) if g is None else torch.equal(bits(p.grad), bits(g)), \
                    f"frozen {n} got a gradient"
            else:
                assert p.grad is not None, f"trainable {n} got no gradient"

    @rule()
    @step
    def optimizer_step(self):
        self.log("opt.step()")
        snap = [(p, bits(p), p.requires_grad) for p in self.opt_params]
        self.opt.step()
        for p, b, flag in snap:
            if flag:
                self.ever.add(id(p))
            else:
                assert torch.equal(bits(p), b), f"frozen {self.name_of(p)} changed by ts.optim.SGD"
                if id(p) not in self.ever:
                    assert p not in self.opt.state, f"optimizer state for frozen {self.name_of(p)}"

    @rule()
    @step
    def rebuild_optimizer(self):
        self.log("opt = ts.optim.SGD(model.parameters(), ...)")
        self.opt_params = list(self.model.parameters())
        self.opt = ts.optim.SGD(self.opt_params, lr=0.1, momentum=0.9, weight_decay=0.1)
        self.ever = set()

    @rule()
    @step
    def zero_grad(self):
        self.log("opt.zero_grad()")
        self.opt.zero_grad()

    # -- tree edits ---------------------------------------------------------------------------
    def new_linear(self, data):
        lin = nn.Linear(D, D, dtype=self.dtype)
        if not data.draw(st.booleans(), label="new weight trains"):
            lin.weight.requires_grad_(False)
        return lin

    @rule(data=st.data())
    @step
    def append_body(self, data):
        lin = self.new_linear(data)
        self.log(f"model.body.append(Linear)  # weight rg={lin.weight.requires_grad}")
        self.model.body.append(lin)
        self.note_new(lin, self.model.body)

    @precondition(lambda self: len(self.model.body) > 2)
    @rule(data=st.data())
    @step
    def replace_body(self, data):
        i = data.draw(st.integers(2, len(self.model.body) - 1), label="index")
        lin = self.new_linear(data)
        self.log(f"model.body[{i}] = Linear  # weight rg={lin.weight.requires_grad}")
        self.model.body[i] = lin
        self.note_new(lin, self.model.body)

    @precondition(lambda self: len(self.model.body) > 2 and id(self.model.body) not in self.ref.decl)
    @rule(data=st.data())
    @step
    def delete_body(self, data):
        i = data.draw(st.integers(2, len(self.model.body) - 1), label="index")
        self.log(f"del model.body[{i}]")
        del self.model.body[i]
        self.ref.pending = True

    @rule(data=st.data())
    @step
    def replace_head(self, data):
        k = data.draw(st.sampled_from(list(self.model.heads.keys())), label="key")
        lin = self.new_linear(data)
        self.log(f"model.heads[{k!r}] = Linear  # weight rg={lin.weight.requires_grad}")
        self.model.heads[k] = lin
        self.note_new(lin, self.model.heads)

    @rule(data=st.data())
    @step
    def add_head(self, data):
        k = f"h{self.head_id}"
        self.head_id += 1
        lin = self.new_linear(data)
        self.log(f"model.heads[{k!r}] = Linear  # new key, weight rg={lin.weight.requires_grad}")
        self.model.heads[k] = lin
        self.note_new(lin, self.model.heads)

    @precondition(lambda self: len(self.model.heads) > 1 and id(self.model.heads) not in self.ref.decl)
    @rule(data=st.data())
    @step
    def delete_head(self, data):
        k = data.draw(st.sampled_from(list(self.model.heads.keys())), label="key")
        self.log(f"del model.heads[{k!r}]")
        del self.model.heads[k]
        self.ref.pending = True

    # -- UnfreezeSchedule ---------------------------------------------------------------------
    SCHED_SELS = ["out", "gate", "heads", "body.0", "body.1", "gate.a", "*.bias"]

    def sched_spec(self, step):
        reached = [s for m, s in sorted(self.sched_ms.items()) if m <= step]
        if any(s is None for s in reached):
            return None
        return ("list", [("glob", g) for s in reached for g in (s if isinstance(s, list) else [s])])

    def sched_stage(self, step):
        return sum(1 for m in self.sched_ms if m <= step)

    @precondition(lambda self: self.schedule is None)
    @rule(data=st.data())
    @step
    def schedule_new(self, data):
        a = data.draw(st.integers(1, 3), label="m1")
        b = data.draw(st.integers(a + 1, 6), label="m2")
        pick = lambda lab: data.draw(st.sampled_from(self.SCHED_SELS), label=lab)
        ms = {0: pick("s0"), a: [pick("s1a"), pick("s1b")],
              b: data.draw(st.sampled_from([None] + self.SCHED_SELS), label="s2")}
        self.sched_ms, self.sched_step = ms, 0
        self.log(f"s = ts.UnfreezeSchedule(model, {ms!r})")
        self.schedule = self.apply(lambda: ts.UnfreezeSchedule(self.model, ms))
        c = Ctx("freeze_except", self.model, self.sched_spec(0), self.ref.new_serial(),
                self.schedule, "schedule")
        self.ref.active.append(c)
        self.settle()
        assert (self.schedule.current_step, self.schedule.stage) == (0, 1)

    def _sched_ctx(self):
        return next(c for c in self.ref.active if c.label == "schedule")

    def _sched_goto(self, step, call):
        old = self.sched_stage(self.sched_step)
        # a stage change, and every load ("flags re-applied at once", also of the stage in force)
        if self.sched_stage(step) != old or call == "load":
            self.apply(lambda: None)  # pre(): the library reads before it applies
            (self.schedule.step() if call == "step" else self.schedule.load_state_dict(
                {"step": step, "milestones": sorted(self.sched_ms)}))
            c = self._sched_ctx()
            # "a schedule's stage change continues the stage it replaces": same place, same
            # serial, decided again for every parameter
            c.spec, c.decided = self.sched_spec(step), {}
            self.sched_step = step
            self.settle()
        else:  # a step that reaches no milestone: a counter increment, no application
            self.schedule.step()
            self.sched_step = step
        assert self.schedule.current_step == step
        assert self.schedule.stage == self.sched_stage(step)

    @precondition(lambda self: self.schedule is not None)
    @rule()
    @step
    def schedule_step(self):
        self.log("s.step()")
        self._sched_goto(self.sched_step + 1, "step")

    @precondition(lambda self: self.schedule is not None)
    @rule()
    @step
    def schedule_state_dict(self):
        self.log("s.state_dict()")
        sd = self.schedule.state_dict()
        assert sd["step"] == self.sched_step and list(sd["milestones"]) == sorted(self.sched_ms)

    # Only without unread hand writes: whether loading the stage already in force counts as
    # an application (it reads the writes) is not said; the rest is pinned ("applies its
    # flags at once").
    @precondition(lambda self: self.schedule is not None and not self.ref.written())
    @rule(data=st.data())
    @step
    def schedule_load(self, data):
        k = data.draw(st.integers(0, 8), label="load step")
        self.log(f"s.load_state_dict({{'step': {k}, ...}})")
        self._sched_goto(k, "load")

    @precondition(lambda self: self.schedule is not None)
    @rule()
    @step
    def schedule_close(self):
        self.log("s.close()")
        self.apply(self.schedule.close)
        self.ref.active.remove(self._sched_ctx())
        self.schedule = None
        self.settle()

    # -- copies -------------------------------------------------------------------------------
    @precondition(lambda self: len(self.copies) < 2)
    @rule()
    @step
    def deepcopy(self):
        c = copy.deepcopy(self.model)
        self.log(f"cp = copy.deepcopy(model)  # {id(c):#x}")
        orig = [p.requires_grad for p in self.model.parameters()]
        assert [p.requires_grad for p in c.parameters()] == orig
        # the declarations the copy carries, by module path (docs/freezing.md "Hooks")
        paths = {id(m): n for n, m in self.model.named_modules()}
        carried = {paths[i]: names for i, (_, names, _) in self.ref.decl.items() if i in paths}
        self.copies.append((c, [(p, p.requires_grad) for p in c.parameters()]))
        self.copy_decl[id(c)] = carried

    @precondition(lambda self: self.copies)
    @rule(data=st.data())
    @step
    def use_copy(self, data):
        """Plain PyTorch until attached: a forward changes no flag (also after a registration),
        and its BatchNorm updates its statistics in training mode."""
        c, snap = self.copies[data.draw(st.integers(0, len(self.copies) - 1), label="copy")]
        self.log(f"cp.body.append(Linear); cp(x)  # {id(c):#x}")
        lin = self.new_linear(data).to(next(c.parameters()).dtype)
        c.body.append(lin)
        snap.extend((p, p.requires_grad) for p in lin.parameters())
        mean = c.body[1].running_mean.clone()
        c.train()
        c(self.batch(next(c.parameters()).dtype))
        assert not torch.equal(c.body[1].running_mean, mean), "the copy's BatchNorm is held"
        self.check_flags("after a forward of an unattached copy")

    # attach() of a copy is no context or declaration: whether it reads the original's hand
    # writes is not said, so it runs only when there are none.
    @precondition(lambda self: self.copies and not self.ref.written())
    @rule(data=st.data())
    @step
    def attach_copy(self, data):
        i = data.draw(st.integers(0, len(self.copies) - 1), label="copy")
        c, snap = self.copies.pop(i)
        carried = self.copy_decl.pop(id(c))
        self.log("ts.attach(cp)")
        own = {id(p): p.requires_grad for p in c.parameters()}
        ts.attach(c)
        # "starting then from its own flags ... the declarations it carries apply afresh"
        want = {}
        for n, p in c.named_parameters(remove_duplicate=False):
            ok = True
            mod = c
            parts = n.split(".")
            for j, name in enumerate(parts):
                here = ".".join(parts[:j])
                names = GATE_NAMES if isinstance(mod, Gate) and here not in carried else carried.get(here)
                if names is not None and name not in names:
                    ok = False
                    break
                mod = mod._modules.get(name)
                if mod is None:
                    break
            want[id(p)] = want.get(id(p), False) or (own[id(p)] and ok)
        got = {n: p.requires_grad for n, p in c.named_parameters()}
        exp = {n: want[id(p)] for n, p in c.named_parameters()}
        assert got == exp, "an attached copy: own flags gated by the declarations it carries"
        ts.detach_hooks(c)
        self.check_flags("after attaching a copy")

    # -- parameters replaced without a container edit (docs/freezing.md "Hooks", "When the
    #    hook does not see a change", "Tensor swapping") ------------------------------------
    def replace_targets(self):
        """(label, module, name): parameters that are no tie and no parametrized weight."""
        m = self.model
        t = [("model.out", m.out, "bias"), ("model.gate", m.gate, "scale"),
             ("model.gate.b", m.gate.b, "weight"), ("model.gate.b", m.gate.b, "bias"),
             ("model.body[0]", m.body[0], "bias"), ("model.body[1]", m.body[1], "weight"),
             ("model.body[1]", m.body[1], "bias")]
        t += [(f"model.heads[{k!r}]", m.heads[k], n) for k in m.heads for n in ("weight", "bias")]
        t += [(f"model.body[{i}]", m.body[i], n) for i in range(2, len(m.body))
              for n in ("weight", "bias")]
        return [(lab, mod, n) for lab, mod, n in t
                if isinstance(mod._parameters.get(n), nn.Parameter)]

    @rule(data=st.data())
    @step
    def replace_param(self, data):
        label, mod, name = data.draw(st.sampled_from(self.replace_targets()), label="param")
        old = mod._parameters[name]
        how = data.draw(st.sampled_from(["setattr", "del+register", "swap_tensors"]), label="how")
        # the flag it carries: the old one's (a copy, as PyTorch's own replacements make it) or
        # the other one
        flag = old.requires_grad ^ data.draw(st.booleans(), label="flip")
        new = nn.Parameter(old.detach().clone() * 0.5, requires_grad=flag)
        if how == "setattr":
            self.log(f"{label}.{name} = nn.Parameter(..., requires_grad={flag})")
            setattr(mod, name, new)
            self.note_new(mod, mod)  # a registration into ``mod``
        elif how == "del+register":
            self.log(f"del {label}.{name}; {label}.register_parameter({name!r}, "
                     f"nn.Parameter(..., requires_grad={flag}))")
            delattr(mod, name)
            mod.register_parameter(name, new)
            self.note_new(mod, mod)
        else:
            # the same object, new contents: everything torchstruct remembers follows it
            # ("Tensor swapping"), so a flag that differs from the one torchstruct wrote is a
            # write by someone else, read as such at the next application
            self.log(f"torch.utils.swap_tensors({label}.{name}, "
                     f"nn.Parameter(..., requires_grad={flag}))")
            torch.utils.swap_tensors(old, new)
            assert mod._parameters[name] is old and old.requires_grad is flag
            self.ref.expect[id(old)] = (old, flag)

    @rule(data=st.data())
    @step
    def load_assign(self, data):
        """``load_state_dict(sd, assign=True)``: PyTorch gives each new tensor the flag of the
        parameter it replaces (a Parameter by ``requires_grad_``, a plain tensor wrapped with
        it), so every new parameter is the copy of the one at its path. Plain tensors at both
        keys of the tie make two parameters out of one: each is that one's copy."""
        form = data.draw(st.sampled_from(["Parameters", "tensors"]), label="form")
        sd, made = {}, {}
        for n, p in self.model.named_parameters(remove_duplicate=False):
            if form == "Parameters":  # one per object: the tie stays a tie
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(p.detach().clone(),
                                               requires_grad=data.draw(st.booleans(), label="rg"))
                sd[n] = made[id(p)]
            else:
                sd[n] = p.detach().clone()
        for n, b in self.model.named_buffers():
            sd[n] = b.clone()
        self.log(f"model.load_state_dict(<{form}>, assign=True)")
        self.model.load_state_dict(sd, assign=True)
        for mod in self.model.modules():
            if mod._parameters:
                self.note_new(mod, mod)  # setattr: a registration into each module

    @rule(data=st.data())
    @step
    def convert(self, data):
        """``model.to(dtype)`` in PyTorch's three ways: ``param.data = `` (the default) and the
        swap path keep every object ("Tensor swapping": nothing to apply); overwriting puts new
        Parameters straight into ``_parameters`` (each carrying the flag of the one it replaces,
        the tie split in two), which the hook does not see: the next application reads it."""
        how = data.draw(st.sampled_from(["set_data", "swap", "overwrite"]), label="how")
        dtype = torch.float64 if self.dtype == torch.float32 else torch.float32
        self.log(f"model.to({dtype})  # {how}")
        before = {id(p) for p in self.model.parameters()}
        fut = torch.__future__
        try:
            if how == "swap":
                fut.set_swap_module_params_on_conversion(True)
            elif how == "overwrite":
                fut.set_overwrite_module_params_on_conversion(True)
            self.model.to(dtype)
        finally:
            fut.set_swap_module_params_on_conversion(False)
            fut.set_overwrite_module_params_on_conversion(False)
        self.dtype = dtype
        now = {id(p) for p in self.model.parameters()}
        if how == "overwrite":
            assert not now & before
            self.note_present()
            self.ref.unseen = True
        else:
            assert now == before
        self.rebuild_optimizer.__wrapped__(self)  # its momentum buffers have the old dtype

    # -- forwards that must not apply, and forwards that must ------------------------------------
    @rule(data=st.data())
    @step
    def functional_forward(self, data):
        """``torch.func.functional_call``: a forward as plain PyTorch on the stand-ins, which
        are never written; a waiting change is applied to the model's own parameters (before
        the call, as a forward of the root does); they get no gradient."""
        form = data.draw(st.sampled_from(["Parameters", "tensors", "leaves"]), label="form")
        stand = {}
        for n, p in first_paths(self.model):
            t = p.detach().clone()
            if form == "Parameters":
                t = nn.Parameter(t, requires_grad=data.draw(st.booleans(), label="rg"))
            elif form == "leaves":
                t.requires_grad_(data.draw(st.booleans(), label="rg"))
            stand[n] = t
        self.log(f"torch.func.functional_call(model, <{form}>, x).sum().backward()")
        flags = {k: t.requires_grad for k, t in stand.items()}
        grads = {id(p): (None if p.grad is None else p.grad.clone()) for p in self.model.parameters()}
        objs = [p for _, p in self.model.named_parameters(remove_duplicate=False)]
        if self.ref.pending:
            self.ref.pre()
            y = torch.func.functional_call(self.model, stand, (self.batch(),))
            self.settle()
        else:
            y = torch.func.functional_call(self.model, stand, (self.batch(),))
        y.sum().backward()
        assert {k: t.requires_grad for k, t in stand.items()} == flags, "a stand-in was written"
        assert [p for _, p in self.model.named_parameters(remove_duplicate=False)] == objs
        for p in self.model.parameters():
            g = grads[id(p)]
            assert (p.grad is None) if g is None else torch.equal(bits(p.grad), bits(g)), \
                f"{self.name_of(p)} got a gradient through functional_call"

    @rule()
    @step
    def checkpointed_backward(self):
        """A forward of the root under ``checkpoint(model, x, use_reentrant=False)`` applies a
        waiting change as any forward of the root does, and its gradients are those of the same
        model without checkpointing (the recomputation sees the flags the forward saw)."""
        self.log("checkpoint(model, x, use_reentrant=False).square().mean() -> autograd.grad")
        x = self.batch()
        mean = self.model.body[1].running_mean.clone()
        if self.ref.pending:
            self.ref.pre()
            y = checkpoint(self.model, x, use_reentrant=False)
            self.settle()
        else:
            y = checkpoint(self.model, x, use_reentrant=False)
        state = self.bn_state()
        params = [p for _, p in first_paths(self.model) if p.requires_grad]
        got = torch.autograd.grad(y.square().mean(), params + [x])
        # the recomputation ran BatchNorm again: only the held case is pinned here
        self.check_bn("held" if state == "held" else None, mean, "checkpoint")
        self.check_flags("after a checkpointed backward")
        want = torch.autograd.grad(self.model(x).square().mean(), params + [x])
        for p, a, b in zip(params + [x], got, want):
            torch.testing.assert_close(a, b, msg=lambda m: f"{self.name_of(p)}: {m}")

    def part_targets(self):
        m = self.model
        t = [("model.body", m.body), ("model.gate", m.gate), ("model.gate.b", m.gate.b),
             ("model.out", m.out)]
        t += [(f"model.heads[{k!r}]", m.heads[k]) for k in m.heads]
        t += [(f"model.body[{i}]", m.body[i]) for i in range(2, len(m.body))]
        return t

    # Only while every module registered into is still in the model: whether a forward of a
    # module that was between it and the root applies once it left is not said.
    @precondition(lambda self: all(self.in_model(m) for m in self.ref.pending_regs))
    @rule(data=st.data())
    @step
    def forward_part(self, data):
        """docs/freezing.md "A model is often run through a part of it": after a registration
        below the root, a forward of the module it was registered into, or of any module between
        it and the root, applies (an application, of the whole model); a forward of a module
        beside it does not, nor does one after a container's del or a write the hook does not
        see (those wait for the root)."""
        name, mod = data.draw(st.sampled_from(self.part_targets()), label="part")
        applies = any(any(q is m for q in mod.modules()) for m in self.ref.pending_regs)
        self.log(f"{name}(x)  # {'applies' if applies else 'no application'}")
        mean = self.model.body[1].running_mean.clone()
        if applies:
            self.ref.pre()
            mod(self.batch())
            self.settle()
        else:
            mod(self.batch())
        if mod is self.model.body:
            self.check_bn(self.bn_state(), mean, name)

    # -- structural_grad, stop_gradient, swap ---------------------------------------------------
    @staticmethod
    def grads_on(model, asked, x, bn_mode):
        """``torch.autograd.grad`` on a copy (plain PyTorch until attached, docs/freezing.md
        "Hooks"), with exactly the asked parameters requiring grad."""
        c = copy.deepcopy(model)
        to_copy = dict(zip(map(id, model.parameters()), c.parameters()))
        ps = [to_copy[id(p)] for _, p in asked]
        for q in c.parameters():
            q.requires_grad_(any(q is r for r in ps))
        c.body[1].train(bn_mode == "train")  # held: it normalizes with its running statistics
        return torch.autograd.grad(c(x).square().mean(), ps)

    # Only with no change waiting and no hand write unread: whether the call reads them (is an
    # application) is not said, and "what it would be without the call" depends on it.
    @precondition(lambda self: not self.ref.pending and not self.ref.unseen
                  and not self.ref.written())
    @rule(data=st.data())
    @step
    def structural_grad(self, data):
        """docs/structural.md: with ``wrt``, exactly the asked parameters require grad while the
        loss runs, every flag is back afterwards, normalization layers behave as outside the
        call; without it the flags are the model's. The tree has one leaf per asked parameter
        at its first path, equal to ``torch.autograd.grad`` on them; no ``.grad`` is written."""
        if data.draw(st.booleans(), label="with wrt"):
            wrt, spec, text = self.draw_selector(data, self.model)
        else:
            wrt, spec, text = None, None, "None"
        self.log(f"ts.structural_grad(model, loss_fn, wrt={text})")
        named = first_paths(self.model)
        every = all_paths(self.model)
        if wrt is None:
            asked = [(n, p) for n, p in named if p.requires_grad]
        else:
            asked = [(n, p) for n, p in named if judge(spec, every[id(p)][1], p)]
        state = self.bn_state()
        original = copy.deepcopy(self.model)  # its parameters and statistics before the call
        x = torch.randn(6, D, dtype=self.dtype)
        mean = self.model.body[1].running_mean.clone()
        grads = {id(p): p.grad for p in self.model.parameters()}
        seen = {}

        def loss_fn(m):
            seen.update({id(p): p.requires_grad for p in m.parameters()})
            return m(x).square().mean()

        if not asked:
            # Nothing trains and wrt=None: an error, as a wrt selecting nothing is (an empty
            # tree would hide the mistake, docs/structural.md); the loss never runs
            with pytest.raises(ValueError, match="no parameter of the model"):
                ts.structural_grad(self.model, loss_fn, wrt=wrt)
            assert not seen, "the loss ran"
            self.check_flags("after structural_grad with nothing trainable")
            return
        tree = ts.structural_grad(self.model, loss_fn, wrt=wrt)
        if wrt is not None:
            want_in = {id(p): any(p is q for _, q in asked) for p in self.model.parameters()}
            assert seen == want_in, "inside structural_grad(wrt=...): only the asked require grad"
        else:
            assert seen == {id(p): p.requires_grad for p in self.model.parameters()}
        self.check_flags("after structural_grad")
        assert all(p.grad is grads[id(p)] for p in self.model.parameters()), ".grad written"
        self.check_bn(state, mean, "structural_grad")
        flat = ts.tree.to_flat_dict(tree)
        assert list(flat) == [n for n, _ in asked], "the tree's paths"
        asked_then = [(n, original.get_parameter(n)) for n, _ in asked]
        modes = {"held": ["eval"], "free": ["train"]}.get(state, ["train", "eval"])
        ok = False
        for mode in modes:
            want = self.grads_on(original, asked_then, x, mode)
            ok = ok or all(torch.allclose(flat[n], w, rtol=1e-4, atol=1e-6)
                           for (n, _), w in zip(asked, want))
        assert ok, "structural_grad differs from torch.autograd.grad"

    def _block_run(self, make):
        """Enter a block, run a training forward and backward inside it, leave it. A waiting
        change is applied by the forward (the hooks read and write the parameters' own flags
        inside the blocks, docs/stop_gradient.md "Limits"): the brute force reads the flags
        outside the block, before and after it, where nothing else moves them."""
        x = self.batch()
        mean = self.model.body[1].running_mean.clone()
        pending = self.ref.pending
        if pending:
            self.ref.pre()
        blk = make()  # a block applies at construction (docs/stop_gradient.md)
        try:
            self.model(x).square().mean().backward()
        finally:
            blk.__exit__(None, None, None)
        if pending:
            self.settle()
        self.check_flags("after a block (they change no flag)")
        # the hold follows the parameters' own flags, not a swap's stand-ins' (docs/freezing.md
        # "Normalization statistics")
        self.check_bn(self.bn_state(), mean, "inside a block")

    @rule(data=st.data())
    @step
    def stop_gradient_backward(self, data):
        n = data.draw(st.integers(0, 2), label="n selectors")
        sels = [self.draw_selector(data, self.model) for _ in range(n)]
        every = all_paths(self.model)
        spec = ("list", [b for _, b, _ in sels]) if sels else None
        self.log(f"with ts.stop_gradient(model{''.join(', ' + c for _, _, c in sels)}): "
                 "model(x).square().mean().backward()")
        before = {id(p): (None if p.grad is None else p.grad.clone()) for p in self.model.parameters()}
        self._block_run(lambda: ts.stop_gradient(self.model, *[a for a, _, _ in sels]))
        for n, p in self.model.named_parameters():
            g, blocked = before[id(p)], judge(spec, every[id(p)][1], p)
            if blocked or not p.requires_grad:
                assert (p.grad is None) if g is None else torch.equal(bits(p.grad), bits(g)), \
                    f"{'blocked' if blocked else 'frozen'} {n} got a gradient"
            else:
                assert p.grad is not None, f"trainable {n} got no gradient"

    @rule(data=st.data())
    @step
    def swap_backward(self, data):
        named = first_paths(self.model)
        keys = data.draw(st.lists(st.sampled_from([n for n, _ in named]), unique=True,
                                  min_size=1, max_size=4), label="swapped")
        tree = {}
        for n, p in named:
            if n in keys:
                tree[n] = p.detach().clone().requires_grad_(data.draw(st.booleans(), label="rg"))
        self.log(f"with ts.swap(model, {{{', '.join(f'{k!r}: rg={t.requires_grad}' for k, t in tree.items())}}}): "
                 "model(x).square().mean().backward()")
        before = {id(p): (None if p.grad is None else p.grad.clone()) for p in self.model.parameters()}
        self._block_run(lambda: ts.swap(self.model, tree))
        for n, p in named:
            g = before[id(p)]
            if n in tree or not p.requires_grad:
                assert (p.grad is None) if g is None else torch.equal(bits(p.grad), bits(g)), \
                    f"{'swapped' if n in tree else 'frozen'} {n} got a gradient"
            else:
                assert p.grad is not None, f"trainable {n} got no gradient"
        for n, t in tree.items():
            assert (t.grad is not None) is t.requires_grad, f"the stand-in for {n}"

    # -- torch.nn.utils.parametrize on a body Linear ---------------------------------------------
    def param_targets(self, registered):
        return [i for i in range(2, len(self.model.body))
                if isinstance(self.model.body[i], nn.Linear)
                and parametrize.is_parametrized(self.model.body[i], "weight") is registered]

    @precondition(lambda self: self.param_targets(False))
    @rule(data=st.data())
    @step
    def parametrize_register(self, data):
        """The weight moves to ``parametrizations.weight.original`` (the same object: nothing
        to copy); ``weight_norm`` puts two new parameters there instead, carrying the weight's
        flag as their own ("any other new parameter starts from its own flag"), and the weight
        leaves the model. A registration into the Linear."""
        i = data.draw(st.sampled_from(self.param_targets(False)), label="index")
        lin = self.model.body[i]
        kind = data.draw(st.sampled_from(["Same", "weight_norm"]), label="parametrization")
        self.log(f"parametrize {kind} on model.body[{i}].weight")
        if kind == "Same":
            w = lin.weight
            parametrize.register_parametrization(lin, "weight", Same())
            assert lin.parametrizations.weight.original is w
        else:
            torch.nn.utils.parametrizations.weight_norm(lin)
        self.note_new(lin, lin)

    @precondition(lambda self: self.param_targets(True))
    @rule(data=st.data())
    @step
    def parametrize_remove(self, data):
        i = data.draw(st.sampled_from(self.param_targets(True)), label="index")
        lin = self.model.body[i]
        if any(type(q) is type(lin) for c, _ in self.copies for q in c.modules()):
            # PyTorch's deepcopy shares the parametrized class, whose property the removal
            # deletes: the copy would break (plain PyTorch, nothing of torchstruct's)
            return
        plist = lin.parametrizations.weight
        if not plist.is_tensor and any(any(q is m for q in plist.modules())
                                       for m in self.ref.pending_regs):
            # whether weight_norm's removal leaves a Parameter depends on the flags the
            # application (computing the weight) gives its originals: read it first (a forward
            # of the parametrization, which applies), then decide
            self.log(f"model.body[{i}].weight  # a forward of the parametrization: applies")
            self.ref.pre()
            lin.weight
            self.settle()
        if plist.is_tensor:
            leave = data.draw(st.booleans(), label="leave_parametrized")
        elif any(p.requires_grad for p in plist.parameters()):
            leave = True  # the only way for weight_norm: a new Parameter at "weight"
        else:
            # it would register the weight as a buffer, which the hook is not said to see
            return
        # leave_parametrized=True computes the weight first: a forward of the parametrization's
        # modules, which applies a change registered into them (load_state_dict(assign=True)
        # registers into the ParametrizationList), before the tree changes
        applies = leave and any(any(q is m for q in plist.modules()) for m in self.ref.pending_regs)
        self.log(f"parametrize.remove_parametrizations(model.body[{i}], 'weight', "
                 f"leave_parametrized={leave})" + ("  # applies" if applies else ""))
        if applies:
            self.ref.pre()
            self.ref.post()  # on the tree as it is before the removal
        parametrize.remove_parametrizations(lin, "weight", leave_parametrized=leave)
        if applies:
            self.check_flags("after an application (the weight computed)")
            self.ref.drop_gone()
        assert isinstance(lin._parameters.get("weight"), nn.Parameter)
        self.note_new(lin, lin)

FlagMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None, database=None,
    suppress_health_check=list(HealthCheck),
    # the default run (the test suite's) replays one fixed set of programs; a longer hunt,
    # asked for with TS_FUZZ_EXAMPLES, draws new ones
    derandomize="TS_FUZZ_EXAMPLES" not in os.environ,
    # TS_FUZZ_SHRINK=0: report the first failure as found (its program is in the message)
    phases=[p for p in Phase if os.environ.get("TS_FUZZ_SHRINK", "1") != "0" or p != Phase.shrink])
TestFlagMachine = FlagMachine.TestCase
