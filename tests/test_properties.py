"""Property tests: flags under random trees, declarations and context stacks vs brute force.

The reference below is written from the contract alone. For every parameter *object*:

- start from its starting flag (random here, or the last value set by hand);
- fold the active contexts in creation order, outermost first (the innermost wins):
  ``freeze`` turns the selected off, ``freeze_except`` turns the unselected parameters of its
  scope off, ``unfreeze`` turns the selected on. "Selected" means any path of the parameter
  (relative to the context's scope) matches; a glob matching a module path selects its subtree;
- then the declarations gate: the parameter is admitted iff along SOME of its paths from the
  root every declaring module lists the next name.
"""

import fnmatch
import os
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import torchstruct as ts

SETTINGS = settings(
    max_examples=int(os.environ.get("TORCHSTRUCT_PROPERTY_EXAMPLES", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
DICT_KEYS = ["enc", "dec", "head", "a", "b", "x0"]


class Custom(nn.Module):
    """A user module declaring what trains through a ``trainable()`` method."""

    def __init__(self):
        super().__init__()
        self.declared_names = []

    def trainable(self):
        return list(self.declared_names)


class Plain(nn.Module):
    """A user module with own parameters and no declaration."""


class Boom(Exception):
    pass


# ----------------------------------------------------------------------------- random trees
LEAVES = ["linear", "reuse", "transformer", "mha", "lstm", "bn", "param_only"]
CONTAINERS = ["seq", "dict", "list", "custom", "plain"]


def build(data, depth, pool, force_container=False):
    kinds = CONTAINERS if force_container else LEAVES + (CONTAINERS if depth < 3 else [])
    kind = data.draw(st.sampled_from(kinds), label="kind")
    if kind == "reuse" and not pool:
        kind = "linear"
    if kind == "linear":
        m = nn.Linear(2, 2, bias=data.draw(st.booleans(), label="bias"))
        pool.append(m)
        return m
    if kind == "reuse":  # the same module object inserted twice
        return data.draw(st.sampled_from(pool), label="reused")
    if kind == "transformer":
        return nn.TransformerEncoderLayer(4, 2, 4, dropout=0.0)
    if kind == "mha":
        return nn.MultiheadAttention(4, 2)
    if kind == "lstm":
        return nn.LSTM(2, 2)
    if kind == "bn":
        return nn.BatchNorm1d(2)
    if kind == "param_only":
        m = Plain()
        m.w = nn.Parameter(torch.zeros(2))
        return m
    n = data.draw(st.integers(1, 3), label="n_children")
    children = [build(data, depth + 1, pool) for _ in range(n)]
    if kind == "seq":
        return nn.Sequential(*children)
    if kind == "list":
        return nn.ModuleList(children)
    if kind == "dict":
        keys = data.draw(st.permutations(DICT_KEYS), label="keys")[:n]
        return nn.ModuleDict(dict(zip(keys, children)))
    m = Custom() if kind == "custom" else Plain()
    for i in range(data.draw(st.integers(0, 2), label="n_own")):
        setattr(m, f"p{i}", nn.Parameter(torch.zeros(i + 1)))
    for i, c in enumerate(children):
        setattr(m, f"c{i}", c)
    return m


def build_model(data):
    pool = []
    root = build(data, 0, pool, force_container=True)
    modules = [m for _, m in root.named_modules()]
    user = [m for m in modules if isinstance(m, (Custom, Plain))]
    # a weight assigned to two modules
    for i in range(data.draw(st.integers(0, 2), label="n_ties")):
        params = list(root.parameters())
        if not user or not params:
            break
        owner = data.draw(st.sampled_from(user), label="tie_owner")
        setattr(owner, f"t{i}", data.draw(st.sampled_from(params), label="tied"))
    linears = list({id(m): m for m in pool}.values())
    if len(linears) >= 2 and data.draw(st.booleans(), label="tie_linears"):
        a, b = data.draw(st.permutations(linears), label="lin_pair")[:2]
        b.weight = a.weight
    # declarations through trainable(): decided once the tree is final
    for m in modules:
        if isinstance(m, Custom):
            own = list(m._parameters) + list(m._modules)
            names = st.lists(st.sampled_from(own), unique=True) if own else st.just([])
            m.declared_names = data.draw(names, label="decl")
    # random starting flags
    for p in root.parameters():
        p.requires_grad_(data.draw(st.booleans(), label="start"))
    return root


# ----------------------------------------------------------------------------- the reference
class Reference:
    def __init__(self, root):
        self.root = root
        self.base = {id(p): p.requires_grad for p in root.parameters()}
        self.marks = {}  # id(module) -> (frozenset, serial), from mark_trainable
        self.stack = []  # active contexts: (kind, scope, selectors, serial), creation order
        self.serial = 0  # of the newest context entered or declaration made
        # id(p) -> contexts and declarations up to this serial no longer apply (a write by hand)
        self.over = {}

    def push(self, kind, scope, sels):
        self.serial += 1
        entry = (kind, scope, sels, self.serial)
        self.stack.append(entry)
        return entry

    def shared(self):
        """Ids of the parameters reachable by more than one path."""
        seen, out = set(), set()
        for _, p in self.root.named_parameters(remove_duplicate=False):
            (out if id(p) in seen else seen).add(id(p))
        return out

    # declarations
    def mark(self, mod, names):
        self.serial += 1
        if names is None:
            self.marks.pop(id(mod), None)
        else:
            self.marks[id(mod)] = (frozenset(names), self.serial)

    def declared(self, mod):
        """``(names, serial)``; a class's method is older (0) than anything made since."""
        if id(mod) in self.marks:
            return self.marks[id(mod)]
        if isinstance(mod, Custom):
            return frozenset(mod.declared_names), 0
        return None, 0

    def admitted(self, path, over=-1):
        mod = self.root
        for name in path.split("."):
            names, serial = self.declared(mod)
            if names is not None and name not in names and serial > over:
                return False
            mod = mod._modules[name] if name in mod._modules else None
        return True

    # selection
    @staticmethod
    def flat(sels):
        for s in sels:
            if isinstance(s, (list, tuple)):
                yield from Reference.flat(s)
            else:
                yield s

    @staticmethod
    def matches(sel, path, p):
        if isinstance(sel, str):
            parts = path.split(".")
            return any(fnmatch.fnmatchcase(".".join(parts[:k]), sel) for k in range(1, len(parts) + 1))
        if isinstance(sel, re.Pattern):
            return sel.fullmatch(path) is not None
        if isinstance(sel, nn.Parameter):
            return p is sel
        if isinstance(sel, nn.Module):
            return any(q is p for q in sel.parameters())
        return bool(sel(path, p))

    def selected(self, scope, sels):
        sels = list(self.flat(sels)) or [scope]
        out = set()
        for path, p in scope.named_parameters(remove_duplicate=False):
            if any(self.matches(s, path, p) for s in sels):
                out.add(id(p))
        return out

    def expected(self):
        flags = dict(self.base)
        for kind, scope, sels, serial in self.stack:
            inside = {id(p) for p in scope.parameters()}
            chosen = self.selected(scope, sels)
            for i in inside:
                if self.over.get(i, -1) >= serial:  # written by hand after it applied
                    continue
                if kind == "freeze" and i in chosen:
                    flags[i] = False
                elif kind == "freeze_except" and i not in chosen:
                    flags[i] = False
                elif kind == "unfreeze" and i in chosen:
                    flags[i] = True
        ok = {}
        for path, p in self.root.named_parameters(remove_duplicate=False):
            ok[id(p)] = ok.get(id(p), False) or self.admitted(path, self.over.get(id(p), -1))
        return {i: flags[i] and ok[i] for i in flags}

    def check(self, where, query=True):
        want = self.expected()
        for path, p in self.root.named_parameters():
            assert p.requires_grad is want[id(p)], f"{where}: {path} is {p.requires_grad}"
        if not query:  # trainable_parameters(root) would attach the root
            return
        got = [(path, id(p)) for path, p in ts.trainable_parameters(self.root)]
        canonical = [(path, id(p)) for path, p in self.root.named_parameters() if want[id(p)]]
        assert got == canonical, where


# ----------------------------------------------------------------------------- random selectors
STARS = ["*", "*.weight", "*bias", "*.0", "*.0.*", "*in_proj*", "c0*", "*norm*", "[ab]*", "?", "*.p?"]
REGEXES = [r".*weight.*", r"(c0|0)\..*", r"[^.]*", r".*\.(bias|p0)", r".*_l0"]


def draw_selector(data, scope, depth=0):
    params = list(scope.named_parameters(remove_duplicate=False))
    mods = [n for n, _ in scope.named_modules(remove_duplicate=False) if n]
    kinds = ["star", "regex_fixed", "callable", "module"]
    if params:
        kinds += ["param_path", "regex_path", "param"]
    if mods:
        kinds += ["module_path", "module_star"]
    if depth == 0:
        kinds += ["list"]
    kind = data.draw(st.sampled_from(kinds), label="sel_kind")
    if kind == "param_path":
        return data.draw(st.sampled_from(params), label="path")[0]
    if kind == "module_path":
        return data.draw(st.sampled_from(mods), label="mpath")
    if kind == "module_star":
        return data.draw(st.sampled_from(mods), label="mpath") + ".*"
    if kind == "star":
        return data.draw(st.sampled_from(STARS), label="star")
    if kind == "regex_path":
        return re.compile(re.escape(data.draw(st.sampled_from(params), label="path")[0]))
    if kind == "regex_fixed":
        return re.compile(data.draw(st.sampled_from(REGEXES), label="regex"))
    if kind == "callable":
        k = data.draw(st.integers(0, 2), label="mod")
        if data.draw(st.booleans(), label="by_shape"):
            return lambda path, p: p.dim() == 1
        return lambda path, p: (len(path) + k) % 3 == 0
    if kind == "module":
        return data.draw(st.sampled_from([m for m in scope.modules()]), label="module")
    if kind == "param":
        return data.draw(st.sampled_from(params), label="param")[1]
    items = [draw_selector(data, scope, depth + 1) for _ in range(data.draw(st.integers(1, 3)))]
    if len(items) > 1 and data.draw(st.booleans(), label="nest"):  # an empty list is an error
        items = [items[0], tuple(items[1:])]
    return items if data.draw(st.booleans(), label="as_list") else tuple(items)


# ----------------------------------------------------------------------------- programs
KINDS = {"freeze": ts.freeze, "freeze_except": ts.freeze_except, "unfreeze": ts.unfreeze}


def draw_mark(data, ref):
    mod = data.draw(st.sampled_from([m for m in ref.root.modules()]), label="mark_mod")
    own = list(mod._parameters) + list(mod._modules)
    if data.draw(st.booleans(), label="remove") or not own:
        ts.mark_trainable(mod, None)
        ref.mark(mod, None)
    else:
        names = data.draw(st.lists(st.sampled_from(own), unique=True), label="names")
        ts.mark_trainable(mod, *names)
        ref.mark(mod, names)


def run_program(data, ref, depth, sub_scopes, attached=True):
    ops = ["ctx", "ctx", "ctx", "mark", "manual", "bare"] if attached else ["ctx", "ctx", "bare"]
    for _ in range(data.draw(st.integers(1, 3), label="n_ops")):
        op = data.draw(st.sampled_from(ops), label="op")
        if op == "mark":
            draw_mark(data, ref)
            ref.check("after mark_trainable")
            continue
        if op == "manual":
            p = data.draw(st.sampled_from(list(ref.root.parameters())), label="manual_p")
            value = data.draw(st.booleans(), label="manual_v")
            if value != p.requires_grad:  # a change by hand: a new starting flag that stands
                ref.base[id(p)] = value  # against the contexts active now
                ref.over[id(p)] = ref.serial
            p.requires_grad_(value)
            ts.attach(ref.root)  # the next application picks it up
            ref.check("after manual requires_grad_")
            continue
        kind = data.draw(st.sampled_from(sorted(KINDS)), label="ctx_kind")
        scopes = [m for m in ref.root.modules()] if sub_scopes else [ref.root]
        if not attached:  # prefer scopes that hold a shared parameter: where subtrees overlap
            shared = ref.shared()
            scopes = [m for m in scopes if any(id(p) in shared for p in m.parameters())] or scopes
        scope = data.draw(st.sampled_from(scopes), label="scope")
        n_sel = data.draw(st.integers(0 if kind != "freeze_except" else 1, 2), label="n_sel")
        sels = [draw_selector(data, scope) for _ in range(n_sel)]
        ctx = KINDS[kind](scope, *sels, strict=False)
        entry = ref.push(kind, scope, sels)
        ref.check(f"after entering {kind}", attached)
        if op == "bare" or depth >= 2:  # permanent (a bare call) or an empty block
            if op != "bare":
                ctx.__exit__(None, None, None)
                ref.stack = [e for e in ref.stack if e is not entry]
                ref.check(f"after leaving {kind}", attached)
            continue
        raise_with = data.draw(st.sampled_from([None, None, Boom, KeyboardInterrupt]), label="raise")
        try:
            with ctx:
                run_program(data, ref, depth + 1, sub_scopes, attached)
                if raise_with is not None:
                    raise raise_with()
        except (Boom, KeyboardInterrupt):
            assert raise_with is not None
        ref.stack = [e for e in ref.stack if e is not entry]
        ref.check(f"after leaving {kind}", attached)


@pytest.mark.parametrize("sub_scopes", [False, True], ids=["root_scope", "any_scope"])
@SETTINGS
@given(data=st.data())
def test_flags_match_reference(sub_scopes, data):
    root = build_model(data)
    ref = Reference(root)
    for _ in range(data.draw(st.integers(0, 2), label="n_marks_before")):
        draw_mark(data, ref)
    ts.attach(root)
    ref.check("after attach")
    run_program(data, ref, 0, sub_scopes)


@SETTINGS
@given(data=st.data())
def test_flags_match_reference_contexts_on_subtrees_of_unattached_model(data):
    """Contexts on arbitrary submodules, the root never attached: each context then governs
    its own subtree, and subtrees may share parameters (a layer used twice, tied weights).
    Class declarations admit everything here, so only the contexts decide."""
    root = build_model(data)
    for m in root.modules():
        if isinstance(m, Custom):
            m.declared_names = list(m._parameters) + list(m._modules)
    ref = Reference(root)
    run_program(data, ref, 0, sub_scopes=True, attached=False)


@SETTINGS
@given(data=st.data())
def test_select_matches_reference(data):
    root = build_model(data)
    scope = data.draw(st.sampled_from([m for m in root.modules()]), label="scope")
    sels = [draw_selector(data, scope) for _ in range(data.draw(st.integers(1, 3)))]
    got = ts.select(scope, *sels, strict=False)
    want_ids = Reference(root).selected(scope, sels)
    first = {}
    for path, p in scope.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), (path, p))
    want = [(path, id(p)) for path, p in first.values() if id(p) in want_ids]
    assert [(path, id(p)) for path, p in got] == want


@SETTINGS
@given(data=st.data())
def test_summary_totals_match_reference(data):
    root = build_model(data)
    ref = Reference(root)
    for _ in range(data.draw(st.integers(0, 2), label="n_marks")):
        draw_mark(data, ref)
    sels = [draw_selector(data, root)]
    with ts.freeze(root, *sels, strict=False):
        ref.push("freeze", root, sels)
        want = ref.expected()
        s = ts.summary(root)
    unique = {id(p): p for p in root.parameters()}
    assert s.total == sum(p.numel() for p in unique.values())
    assert s.trainable == sum(p.numel() for i, p in unique.items() if want[i])
