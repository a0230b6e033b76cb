"""Outside-eyes audit: unusual module trees and parameter conversions.

Trees tried: ``nn.ParameterList`` / ``nn.ParameterDict`` (keys with digits, dashes and glob
metacharacters ``[``, ``*``, ``?``; non-tensor entries; empty containers; one parameter twice),
parameters and buffers registered on the root, ``nn.ModuleDict`` keys that look like globs, one
MODULE reachable at two paths with declarations on different parents, one parameter tied across
a ``ParameterList`` and an ``nn.Linear``, ``torch.nn.utils.parametrize`` (a custom
parametrization with its own parameter, ``weight_norm``), old-style ``spectral_norm`` and lazy
modules. Conversions tried: ``.to(dtype)``, ``.half()``, ``.to_empty()`` after meta init, in
PyTorch's default mode and under ``torch.__future__.set_overwrite_module_params_on_conversion`` /
``set_swap_module_params_on_conversion`` (always restored).

Oracles are plain PyTorch and the contract's rules written out by hand:

* selection: ``fnmatch.fnmatchcase`` over ``named_parameters()`` paths and module paths (a
  module path selects its subtree), ``re.fullmatch``, identity;
* effective trainability of a declared tree: a brute force over
  ``named_parameters(remove_duplicate=False)`` (a parameter trains iff its starting flag is on and
  *some* path of it is admitted by every declaration along that path);
* counts: sums of ``numel()`` over ``named_parameters()`` (tied once); ``state_dict`` keys from
  the rule in docs/checkpoint.md applied by hand;
* gradients: ``torch.autograd.grad`` on the same loss.
"""
import fnmatch
import re
import warnings

import pytest
import torch
import torch.nn.utils.parametrize as parametrize
from torch import nn
from torch.nn.utils import parametrizations

import torchstruct as ts


# ----------------------------------------------------------------------------- helpers
def flags(m):
    return {n: p.requires_grad for n, p in m.named_parameters()}


def sel_paths(m, *sels, **kw):
    return [p for p, _ in ts.select(m, *sels, **kw)]


def glob_oracle(m, pattern):
    """docs/selecting.md: fnmatch over parameter paths and module paths (subtree), tied once at
    the first path in named_parameters() order."""
    picked = set()
    for path, p in m.named_parameters(remove_duplicate=False):
        parts = path.split(".")
        prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
        if any(fnmatch.fnmatchcase(q, pattern) for q in prefixes):
            picked.add(id(p))
    return [n for n, p in m.named_parameters() if id(p) in picked]


def declared_oracle(m, decls, start=None):
    """Brute force of DESIGN §1: ``decls`` maps a module object to the names it admits."""
    start = start or {}
    admitted = {}
    for path, p in m.named_parameters(remove_duplicate=False):
        parts = path.split(".")
        ok = True
        mod = m
        for comp in parts:
            if mod in decls and comp not in decls[mod]:
                ok = False
                break
            mod = getattr(mod, comp) if comp in mod._modules else None
            if mod is None:
                break
        admitted[id(p)] = admitted.get(id(p), False) or ok
    return {n: admitted[id(p)] and start.get(n, True) for n, p in m.named_parameters()}


def restored_warnings(caught):
    return [str(w.message) for w in caught if issubclass(w.category, ts.RestoredFlagsWarning)]


def grads_oracle(m, loss_fn, names):
    named = dict(m.named_parameters())
    got = torch.autograd.grad(loss_fn(m), [named[n] for n in names], allow_unused=True)
    # docs/structural.md: a parameter the loss does not use (while it reaches another) gets zeros
    return {n: torch.zeros_like(named[n]) if g is None else g for n, g in zip(names, got)}


def assert_tree_matches(tree, want):
    flat = ts.tree.to_flat_dict(tree)
    assert list(flat) == list(want)
    for k in want:
        torch.testing.assert_close(flat[k], want[k], msg=k)


@pytest.fixture
def conversion_mode(request):
    before = (torch.__future__.get_overwrite_module_params_on_conversion(),
              torch.__future__.get_swap_module_params_on_conversion())
    mode = request.param
    torch.__future__.set_overwrite_module_params_on_conversion(mode == "overwrite")
    torch.__future__.set_swap_module_params_on_conversion(mode == "swap")
    try:
        yield mode
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(before[0])
        torch.__future__.set_swap_module_params_on_conversion(before[1])


# ----------------------------------------------------------------------------- odd key trees
def odd_keys_model():
    m = nn.Module()
    m.pd = nn.ParameterDict()
    for k, n in [("a[1]", 2), ("a1", 3), ("w*", 4), ("x?", 5), ("xy", 1), ("0-1", 6), ("10", 7)]:
        m.pd[k] = nn.Parameter(torch.full((n,), float(n)))
    m.md = nn.ModuleDict({"*": nn.Linear(1, 1), "enc?": nn.Linear(1, 2), "[x]": nn.Linear(2, 1),
                          "x": nn.Linear(1, 1, bias=False), "enc1": nn.Linear(1, 1)})
    m.pl = nn.ParameterList([nn.Parameter(torch.ones(1)) for _ in range(12)])
    return m


GLOBS = ["pd.a[1]", "pd.w*", "pd.x?", "pd.0-1", "pd.1*", "pd.[0-9]*", "md.*", "md.enc?",
         "md.[x]", "md.x", "md.[*]", "*.bias", "pl.1", "pl.1?", "pl.?", "*[?]*", "md.enc[!?]"]


@pytest.mark.parametrize("pattern", GLOBS)
def test_glob_on_odd_keys_matches_fnmatch_oracle(pattern):
    m = odd_keys_model()
    want = glob_oracle(m, pattern)
    assert want, pattern  # every pattern here names something
    assert sel_paths(m, pattern) == want


def test_regex_and_identity_reach_the_literal_glob_character_keys():
    m = odd_keys_model()
    assert sel_paths(m, re.compile(re.escape("pd.a[1]"))) == ["pd.a[1]"]
    assert sel_paths(m, re.compile(r"md\.\[x\]\..*")) == ["md.[x].weight", "md.[x].bias"]
    assert sel_paths(m, m.pd["a[1]"]) == ["pd.a[1]"]
    assert sel_paths(m, m.md["*"]) == ["md.*.weight", "md.*.bias"]
    assert sel_paths(m, [m.md["[x]"], m.pd["w*"]]) == ["pd.w*", "md.[x].weight", "md.[x].bias"]


def test_exact_path_apis_read_glob_characters_literally():
    m = odd_keys_model()
    ts.freeze(m, m.pd["a1"], m.md["x"])  # permanent; by identity, no pattern involved
    assert ts.is_trainable(m, "pd.a[1]") is True and ts.is_trainable(m, "pd.a1") is False
    assert ts.is_trainable(m, "md.[x].weight") is True and ts.is_trainable(m, "md.x.weight") is False
    with pytest.raises(ValueError):
        ts.is_trainable(m, "pd.a*")  # a pattern is not a path
    sd = ts.state_dict(m)
    want = [n for n, p in m.named_parameters() if p.requires_grad]
    assert list(sd) == want
    # load by exact key: writes pd.a[1], not pd.a1 (which the glob "pd.a[1]" would pick)
    before = m.pd["a1"].detach().clone()
    ts.load_state_dict(m, {"pd.a[1]": torch.full((2,), -1.0), "md.[x].bias": torch.zeros(1)},
                       strict=False)
    assert torch.equal(m.pd["a[1]"].detach(), torch.full((2,), -1.0))
    assert torch.equal(m.pd["a1"].detach(), before)
    with pytest.raises(ValueError, match="closest"):
        ts.load_state_dict(m, {"pd.a*": torch.zeros(2)}, strict=False)
    tree = ts.tree.from_module(m)
    assert list(tree["pd"]) == list(m.pd.keys())
    assert tree["pd"]["w*"] is m.pd["w*"] and tree["md"]["enc?"]["weight"] is m.md["enc?"].weight


def test_summary_and_groups_on_odd_keys_count_by_hand():
    m = odd_keys_model()
    with ts.freeze(m, re.compile(r"pd\..*"), "pl.1?"):
        s = ts.summary(m)
        total = sum(p.numel() for p in m.parameters())
        train = sum(p.numel() for p in m.parameters() if p.requires_grad)
        assert s.counts == (train, total)
        assert train == total - sum(p.numel() for p in m.pd.values()) - 2  # pl.10, pl.11
        text = str(s)
        for key in ["a[1]", "w*", "x?", "0-1", "enc?", "[x]"]:
            assert key in text
        groups = ts.param_groups(m, ("md.[x]", {"lr": 0.5}), no_decay=None)
        seen = [n for g in groups for n in g["param_names"]]
        assert sorted(seen) == sorted(n for n, _ in m.named_parameters())
        assert groups[0]["param_names"] == ["md.x.weight"]  # "[x]" is a glob: picks md.x


def test_mark_trainable_names_on_containers_are_exact_not_patterns():
    m = odd_keys_model()
    ts.attach(m)
    ts.mark_trainable(m.pd, "a[1]")
    assert [k for k, p in m.pd.items() if p.requires_grad] == ["a[1]"]
    with pytest.raises(ValueError):
        ts.mark_trainable(m.pd, "a*")  # no such key: refused, not read as a pattern
    assert [k for k, p in m.pd.items() if p.requires_grad] == ["a[1]"]  # unchanged by the error
    ts.mark_trainable(m.pl, "1")
    assert [i for i, p in enumerate(m.pl) if p.requires_grad] == [1]
    ts.mark_trainable(m.pd, None)
    ts.mark_trainable(m.pl, None)
    assert all(p.requires_grad for p in m.parameters())


def test_parameter_list_with_non_tensor_entries_and_a_repeated_parameter():
    m = nn.Module()
    shared = nn.Parameter(torch.ones(3))
    m.pl = nn.ParameterList([shared, "note", nn.Parameter(torch.ones(2)), shared])
    assert [n for n, _ in m.named_parameters()] == ["pl.0", "pl.2"]
    with pytest.raises(ValueError, match="closest"):
        ts.select(m, "pl.1")  # a string entry: no parameter there
    assert sel_paths(m, "pl.1", strict=False) == []
    assert sel_paths(m, "pl.3") == ["pl.0"]  # the second path of the same parameter
    with ts.freeze(m, "pl.3"):
        assert not shared.requires_grad and m.pl[2].requires_grad
        assert ts.summary(m).counts == (2, 5)
        assert list(ts.state_dict(m)) == ["pl.2"]
    assert shared.requires_grad


@pytest.mark.parametrize("which", ["empty_pl", "empty_pd"])
def test_empty_parameter_containers_select_nothing_and_say_so(which):
    m = nn.Sequential(nn.Linear(2, 2))
    m.empty_pl = nn.ParameterList()
    m.empty_pd = nn.ParameterDict()
    for sel in (which, getattr(m, which)):
        with pytest.raises(ValueError):
            ts.freeze_except(m, sel)
        assert all(p.requires_grad for p in m.parameters())
    with ts.freeze_except(m, which, strict=False):
        assert not any(p.requires_grad for p in m.parameters())
    assert all(p.requires_grad for p in m.parameters())
    assert sel_paths(m, ["0", which]) == ["0.weight", "0.bias"]  # fine inside a list


# ----------------------------------------------------------------------------- ParameterList edits
class ListNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.pl = nn.ParameterList([nn.Parameter(torch.ones(2))])
        self.pd = nn.ParameterDict({"k-0": nn.Parameter(torch.ones(2))})

    def forward(self, x):
        y = self.lin(x)
        for p in self.pl:
            y = y * p
        for p in self.pd.values():
            y = y + p
        return y.sum()


def test_parameters_appended_to_containers_inside_a_block_follow_its_glob():
    m = ListNet()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ts.RestoredFlagsWarning)
        with ts.freeze(m, "pl.*", "pd.*"):
            m.pl.append(nn.Parameter(torch.ones(2)))
            m.pd["k-1"] = nn.Parameter(torch.ones(2))
            # reads already answer for the new parameters
            assert [n for n, _ in ts.trainable_parameters(m)] == ["lin.weight", "lin.bias"]
            m(torch.randn(1, 2))
            assert flags(m) == {"lin.weight": True, "lin.bias": True, "pl.0": False,
                                "pl.1": False, "pd.k-0": False, "pd.k-1": False}
            tree = ts.structural_grad(m, lambda mm: mm(torch.ones(1, 2)))
            assert ts.tree.paths(tree) == ["lin.weight", "lin.bias"]
    assert all(flags(m).values())


def test_a_frozen_start_in_a_parameter_dict_deleted_inside_unfreeze_gets_it_back():
    m = ListNet()
    m.pd["off"] = nn.Parameter(torch.ones(2), requires_grad=False)
    old = m.pd["off"]
    with ts.unfreeze(m, "pd"):
        assert old.requires_grad
        del m.pd["off"]
        m(torch.ones(1, 2))
    assert old.requires_grad is False
    assert all(flags(m).values())


# ----------------------------------------------------------------------------- tied across a list
def list_tied():
    m = nn.Module()
    m.lin = nn.Linear(3, 3)
    m.pl = nn.ParameterList([nn.Parameter(torch.randn(3)), m.lin.weight])
    m.root = nn.Parameter(torch.randn(3))
    return m


def list_first_tied():
    m = nn.Module()
    lin = nn.Linear(3, 3)
    m.pl = nn.ParameterList([nn.Parameter(torch.randn(3)), lin.weight])
    m.lin = lin
    return m


def list_loss(m):
    x = torch.arange(6.0).reshape(2, 3) / 7
    return (m.lin(x) * m.pl[0]).pow(2).sum() + (x @ m.pl[1]).sum()


@pytest.mark.parametrize("build", [list_tied, list_first_tied])
def test_tied_across_a_parameter_list_and_a_linear_lives_once(build):
    m = build()
    first = next(n for n, p in m.named_parameters() if p is m.lin.weight)
    later = "pl.1" if first == "lin.weight" else "lin.weight"
    assert sel_paths(m, later) == [first]
    assert [n for n, _ in ts.trainable_parameters(m)] == [n for n, _ in m.named_parameters()]
    total = sum(p.numel() for p in m.parameters())
    assert ts.summary(m).counts == (total, total)
    groups = ts.param_groups(m, (later, {"lr": 0.1}), no_decay=None)
    assert groups[0]["param_names"] == [first] and groups[0]["params"][0] is m.lin.weight
    assert sum(len(g["params"]) for g in groups) == len(list(m.parameters()))
    assert ts.tree.paths(ts.tree.from_module(m)) == [n for n, _ in m.named_parameters()]
    # load through the later path writes the one object
    ts.load_state_dict(m, {later: torch.zeros(3, 3)}, strict=False)
    assert torch.equal(m.pl[1].detach(), torch.zeros(3, 3))
    # gradients: the total over both uses, at the first path
    names = [n for n, _ in m.named_parameters()]
    want = grads_oracle(m, list_loss, names)
    assert_tree_matches(ts.structural_grad(m, list_loss), want)


def test_tied_across_a_parameter_list_admitted_by_either_owner():
    m = list_first_tied()
    ts.attach(m)
    for names in [("lin",), ("pl",), (), ("lin", "pl")]:
        ts.mark_trainable(m, *names)
        want = declared_oracle(m, {m: set(names)})
        assert flags(m) == want, names
        assert {n: ts.is_trainable(m, n) for n in want} == want
        assert [n for n, _ in ts.trainable_parameters(m)] == [n for n, f in want.items() if f]
        assert list(ts.state_dict(m)) == [n for n, f in want.items() if f]
    ts.mark_trainable(m, None)
    assert all(flags(m).values())


# ----------------------------------------------------------------------------- a module at two paths
class Wrap(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.own = nn.Linear(2, 2)

    def forward(self, x):
        return self.own(self.inner(x))


def two_path_model():
    shared = nn.Linear(2, 2)
    m = nn.Module()
    m.scale = nn.Parameter(torch.ones(2))
    m.a = Wrap(shared)
    m.b = Wrap(shared)
    return m, shared


DECLS = [
    {"a": ["own"]},
    {"b": ["own"]},
    {"a": ["own"], "b": ["own"]},
    {"a": [], "b": ["inner"]},
    {"root": ["b"], "a": []},
    {"root": ["a"], "b": ["inner"]},
    {"root": ["scale"]},
    {"inner": ["bias"], "a": ["inner"]},
]


@pytest.mark.parametrize("decl", DECLS, ids=lambda d: str(d))
def test_declarations_on_a_module_reachable_at_two_paths_match_the_brute_force(decl):
    m, shared = two_path_model()
    ts.attach(m)  # one model: every declaration below is part of it
    objs = {"a": m.a, "b": m.b, "root": m, "inner": shared}
    for k, names in decl.items():
        ts.mark_trainable(objs[k], *names)
    want = declared_oracle(m, {objs[k]: set(v) for k, v in decl.items()})
    assert flags(m) == want
    assert [n for n, _ in ts.trainable_parameters(m)] == [n for n, f in want.items() if f]
    for path in ["b.inner.weight", "b.inner.bias"]:  # later paths answer for the same object
        assert ts.is_trainable(m, path) == want[path.replace("b.", "a.", 1)]
    total = sum(p.numel() for p in m.parameters())
    train = sum(p.numel() for n, p in m.named_parameters() if want[n])
    assert ts.summary(m).counts == (train, total)
    x = torch.randn(3, 2)
    loss = lambda mm: (mm.b(mm.a(x)) * mm.scale).pow(2).sum()  # noqa: E731
    if any(want.values()):
        names = [n for n, f in want.items() if f]
        assert_tree_matches(ts.structural_grad(m, loss), grads_oracle(m, loss, names))
    for k in decl:
        ts.mark_trainable(objs[k], None)
    assert all(flags(m).values())


def test_contexts_through_the_later_path_of_a_shared_module():
    m, shared = two_path_model()
    with ts.freeze(m, "b.inner"):
        assert not shared.weight.requires_grad and m.a.own.weight.requires_grad
        assert "tied" in str(ts.summary(m))
        assert "a.inner.weight" not in ts.state_dict(m)
    with ts.freeze_except(m, "b"):
        assert flags(m) == {"scale": False, "a.inner.weight": True, "a.inner.bias": True,
                            "a.own.weight": False, "a.own.bias": False,
                            "b.own.weight": True, "b.own.bias": True}
    with ts.freeze_except(m, m.b.inner):
        assert [n for n, f in flags(m).items() if f] == ["a.inner.weight", "a.inner.bias"]
    assert all(flags(m).values())


# ----------------------------------------------------------------------------- root parameters
class RootNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(2))
        self.register_buffer("count", torch.zeros(()))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)
        self.body = nn.Linear(2, 2)
        self.body.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        return self.body(x) * self.scale


@pytest.mark.parametrize("frozen", [(), ("scale",), ("body",), ("body.weight",), ("scale", "body")])
def test_state_dict_buffers_of_the_root_follow_its_own_parameters(frozen):
    m = RootNet()
    ctx = ts.freeze(m, *frozen) if frozen else ts.unfreeze(m)
    with ctx:
        train = [n for n, p in m.named_parameters() if p.requires_grad]
        want = []
        # docs/checkpoint.md: trainable parameters + persistent buffers of modules directly
        # owning a trainable parameter, in Module.state_dict() order
        owners = {""} if "scale" in train else set()
        if any(n.startswith("body.") for n in train):
            owners.add("body")
        for key in m.state_dict():
            mod = key.rpartition(".")[0]
            if key in train or (key not in dict(m.named_parameters()) and mod in owners):
                want.append(key)
        assert list(ts.state_dict(m)) == want


def test_root_declaration_admits_a_root_parameter_tied_into_a_child():
    m = nn.Module()
    m.lin = nn.Linear(2, 2)
    m.w = m.lin.weight  # first path: "w" on the root
    m.other = nn.Linear(2, 2)
    ts.attach(m)
    for names in [("lin",), ("w",), ("other",), ()]:
        ts.mark_trainable(m, *names)
        want = declared_oracle(m, {m: set(names)})
        assert flags(m) == want, names
        assert ts.summary(m).counts == (sum(p.numel() for n, p in m.named_parameters() if want[n]),
                                        12)
    ts.mark_trainable(m, None)
    assert all(flags(m).values())


# ----------------------------------------------------------------------------- parametrizations
class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.full((1,), 2.0))

    def forward(self, w):
        return w * self.s


def test_custom_parametrization_with_its_own_parameter_registered_inside_freeze_except():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    w = m[0].weight
    x = torch.randn(4, 3)
    loss = lambda mm: mm(x).pow(2).sum()  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ts.RestoredFlagsWarning)
        with ts.freeze_except(m, w):  # by identity
            parametrize.register_parametrization(m[0], "weight", Scale())
            assert m[0].parametrizations.weight.original is w
            m(x)  # the new parameter is judged: not selected
            assert flags(m) == {"0.bias": False, "0.parametrizations.weight.original": True,
                                "0.parametrizations.weight.0.s": False, "1.weight": False,
                                "1.bias": False}
            assert [n for n, _ in ts.trainable_parameters(m)] == [
                "0.parametrizations.weight.original"]
            assert_tree_matches(ts.structural_grad(m, loss),
                                grads_oracle(m, loss, ["0.parametrizations.weight.original"]))
    assert all(flags(m).values())


def test_parametrized_tree_paths_groups_and_checkpoint_by_hand():
    m = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3), nn.Linear(3, 2))
    parametrize.register_parametrization(m[0], "weight", Scale())
    parametrize.register_parametrization(m[1], "weight", Scale())
    assert sel_paths(m, "0.parametrizations.weight") == ["0.parametrizations.weight.original",
                                                        "0.parametrizations.weight.0.s"]
    assert sel_paths(m, "*.original") == ["0.parametrizations.weight.original",
                                          "1.parametrizations.weight.original"]
    with pytest.raises(ValueError, match="closest"):
        ts.select(m, "0.weight")  # not a parameter path any more
    with ts.freeze(m, "*.0.s"):
        assert ts.summary(m).counts == (sum(p.numel() for p in m.parameters()) - 2,
                                        sum(p.numel() for p in m.parameters()))
        assert list(ts.state_dict(m)) == ["0.bias", "0.parametrizations.weight.original",
                                          "1.bias", "1.parametrizations.weight.original",
                                          "2.weight", "2.bias"]
    names = {g["name"]: g["param_names"] for g in ts.param_groups(m, weight_decay=0.1)}
    # the norm's weight, moved under parametrizations, is still the norm's: no decay
    assert "1.parametrizations.weight.original" in names["default (no decay)"]
    assert "0.parametrizations.weight.original" in names["default"]


def test_old_style_spectral_norm_checkpoint_holds_its_power_iteration_buffers():
    torch.manual_seed(0)
    make = lambda: nn.Sequential(nn.utils.spectral_norm(nn.Linear(3, 3)), nn.Linear(3, 2))  # noqa
    m = make()
    m(torch.randn(5, 3))
    assert list(ts.state_dict(m)) == ["0.bias", "0.weight_orig", "0.weight_u", "0.weight_v",
                                      "1.weight", "1.bias"]
    with ts.freeze(m, "0"):
        assert list(ts.state_dict(m)) == ["1.weight", "1.bias"]
    with ts.freeze(m, "0.weight_orig"):
        assert list(ts.state_dict(m)) == ["0.bias", "0.weight_u", "0.weight_v", "1.weight",
                                          "1.bias"]
    again = make()
    ts.load_state_dict(again, {k: v.clone() for k, v in ts.state_dict(m).items()})
    m.eval(), again.eval()
    x = torch.randn(2, 3)
    assert torch.equal(m(x), again(x))


def test_weight_norm_removed_inside_freeze_with_a_selector_names_the_originals():
    # the documented case (docs/freezing.md), here with a glob that covers the whole model
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    parametrizations.weight_norm(m[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ts.freeze(m, "*"):
            parametrize.remove_parametrizations(m[0], "weight", leave_parametrized=True)
    said = " ".join(restored_warnings(caught))
    assert "0.weight" not in dict(m.named_parameters())  # PyTorch made it a buffer
    assert "original0" in said and "original1" in said


def test_weight_norm_removed_inside_freeze_of_the_whole_model_names_the_originals():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    parametrizations.weight_norm(m[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ts.freeze(m):  # no selector: the whole model
            parametrize.remove_parametrizations(m[0], "weight", leave_parametrized=True)
    said = " ".join(restored_warnings(caught))
    assert "0.weight" not in dict(m.named_parameters())
    assert "original0" in said and "original1" in said


def test_a_frozen_parameter_turned_into_a_buffer_inside_a_block_is_named():
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ts.freeze(m, "1"):
            old = m[1].weight
            del m[1].weight
            m[1].register_buffer("weight", old.detach().clone())  # copies the block's flag
    assert old.requires_grad  # the object itself got its flag back ...
    assert not m[1].weight.requires_grad and "1.weight" not in dict(m.named_parameters())
    said = " ".join(restored_warnings(caught))
    assert "left the model" in said and "'1.weight'" in said  # ... but the model lost it: say so
    assert "the model changed inside the block" in said  # nothing was added: not said to be


@pytest.mark.parametrize("selectors", [(), ("*",), ("1",)])
def test_a_block_whose_model_kept_its_parameters_says_nothing(selectors):
    """Forwards, a buffer registered and a flag read inside the block: no parameter left, none
    was added, so the exit restores silently."""
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ts.freeze(m, *selectors):
            m(torch.ones(1, 2, requires_grad=True)).sum().backward()
            m[1].register_buffer("cache", torch.zeros(2))
    assert restored_warnings(caught) == []
    assert all(p.requires_grad for p in m.parameters())


@pytest.mark.parametrize("selectors", [(), ("*",), ("sub",)])
def test_a_frozen_submodule_deleted_inside_a_block_is_named(selectors):
    m = nn.Module()
    m.sub, m.head = nn.Linear(2, 2), nn.Linear(2, 1)
    gone = m.sub
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ts.freeze(m, *selectors):
            del m.sub
    said = " ".join(restored_warnings(caught))
    assert "'sub.weight'" in said and "'sub.bias'" in said and "'head" not in said
    assert all(p.requires_grad for p in gone.parameters()) and m.head.weight.requires_grad


# ----------------------------------------------------------------------------- conversions
class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))
        self.body = nn.Linear(3, 3)
        self.pd = nn.ParameterDict({"k-0": nn.Parameter(torch.ones(3)),
                                    "k[1]": nn.Parameter(torch.ones(3))})
        self.pl = nn.ParameterList([nn.Parameter(torch.ones(3), requires_grad=False),
                                    nn.Parameter(torch.ones(3))])
        self.register_buffer("count", torch.zeros(()))

    def trainable(self):
        return ["scale", "pd", "pl"]

    def forward(self, x):
        y = self.body(x) * self.scale * self.pd["k-0"] * self.pd["k[1]"]
        return (y * self.pl[0] * self.pl[1]).pow(2).sum()


OUTSIDE = {"scale": True, "body.weight": False, "body.bias": False, "pd.k-0": True,
           "pd.k[1]": True, "pl.0": False, "pl.1": True}


def _check_reads(m, want):
    assert flags(m) == want
    assert [n for n, _ in ts.trainable_parameters(m)] == [n for n, f in want.items() if f]
    assert {n: ts.is_trainable(m, n) for n in want} == want
    total = sum(p.numel() for p in m.parameters())
    assert ts.summary(m).counts == (sum(p.numel() for n, p in m.named_parameters() if want[n]),
                                    total)
    groups = ts.param_groups(m, ("pd", {"lr": 0.1}))
    objs = [p for g in groups for p in g["params"]]
    assert len(objs) == len(list(m.parameters()))
    assert {id(p) for p in objs} == {id(p) for p in m.parameters()}  # the current objects
    owners_root = want["scale"]
    assert list(ts.state_dict(m)) == (["scale", "count"] if owners_root else []) + [
        n for n, f in want.items() if f and n != "scale"]


@pytest.mark.parametrize("conversion_mode", ["default", "overwrite", "swap"], indirect=True)
@pytest.mark.parametrize("how", ["to64", "half_then_float", "meta_to_empty"])
def test_conversions_inside_a_block_under_a_class_declaration(conversion_mode, how):
    if how == "meta_to_empty":
        with torch.device("meta"):
            m = ConvNet()
    else:
        m = ConvNet()
    ts.attach(m)
    _check_reads(m, OUTSIDE)
    inside = dict(OUTSIDE, **{"pd.k-0": False})
    with ts.freeze(m, "pd.k-0"):
        if how == "to64":
            m.to(torch.float64)
        elif how == "half_then_float":
            m.half()
            assert all(p.dtype == torch.float16 for p in m.parameters())
            m.float()
        else:
            m.to_empty(device="cpu")
            for p in m.parameters():
                with torch.no_grad():
                    p.fill_(0.5)
        assert all(p.device.type == "cpu" for p in m.parameters())
        _check_reads(m, inside)
        dt = next(m.parameters()).dtype
        x = torch.linspace(-1, 1, 6, dtype=dt).reshape(2, 3)
        loss = lambda mm: mm(x)  # noqa: E731
        names = [n for n, f in inside.items() if f]
        assert_tree_matches(ts.structural_grad(m, loss), grads_oracle(m, loss, names))
        m(x)
        _check_reads(m, inside)
    _check_reads(m, OUTSIDE)


@pytest.mark.parametrize("conversion_mode", ["default", "overwrite", "swap"], indirect=True)
def test_tied_list_and_linear_converted_inside_freeze(conversion_mode):
    m = list_tied()
    with ts.freeze(m, "pl.1"):  # the later path of lin.weight
        m.to(torch.float64)
        tied_now = m.pl[1] is m.lin.weight
        # plain PyTorch: only the overwrite mode makes two objects of the tied parameter
        assert tied_now == (conversion_mode != "overwrite")
        names = [n for n, _ in m.named_parameters()]
        assert ("pl.1" in names) == (not tied_now)
        want = {n: n not in ("lin.weight", "pl.1") for n in names}
        assert flags(m) == want
        total = sum(p.numel() for p in m.parameters())
        assert ts.summary(m).counts == (total - 9 * (1 if tied_now else 2), total)
        assert all(p.dtype == torch.float64 for p in m.parameters())
    assert all(flags(m).values())


@pytest.mark.parametrize("conversion_mode", ["default", "swap"], indirect=True)
def test_a_shared_module_converted_under_declarations_on_both_parents(conversion_mode):
    m, shared = two_path_model()
    ts.attach(m)
    ts.mark_trainable(m.a, "own")
    ts.mark_trainable(m.b, "own")  # neither parent admits the shared module
    m.double()
    assert shared.weight.dtype == torch.float64 and m.a.inner is m.b.inner
    want = declared_oracle(m, {m.a: {"own"}, m.b: {"own"}})
    assert flags(m) == want and not want["a.inner.weight"]
    ts.mark_trainable(m.b, None)
    assert shared.weight.requires_grad  # admitted again through b
    ts.mark_trainable(m.a, None)
    assert all(flags(m).values())


# ----------------------------------------------------------------------------- lazy modules
def test_lazy_module_declared_before_materialization_inside_a_block_elsewhere():
    m = nn.Sequential(nn.LazyLinear(3), nn.Linear(3, 2))
    ts.mark_trainable(m[0], "bias")
    w = m[0].weight
    assert isinstance(w, nn.parameter.UninitializedParameter) and not w.requires_grad
    with pytest.raises(ValueError, match="0.weight"):
        ts.summary(m)  # nothing to count yet: named
    with ts.freeze(m, "1"):
        m(torch.randn(2, 5))
        assert m[0].weight is w and w.shape == (3, 5)
        assert flags(m) == {"0.weight": False, "0.bias": True, "1.weight": False,
                            "1.bias": False}
        assert ts.summary(m).counts == (3, 15 + 3 + 6 + 2)
    assert flags(m) == {"0.weight": False, "0.bias": True, "1.weight": True, "1.bias": True}
    assert list(ts.state_dict(m)) == ["0.bias", "1.weight", "1.bias"]
    ts.mark_trainable(m[0], None)
    assert all(flags(m).values())


# ----------------------------------------------------------------------------- more trees
def _summary_rows_oracle(m):
    """Per row path: (trainable, total) over the parameters whose FIRST path lies under it."""
    first = list(m.named_parameters())

    def under(path, name):
        return path == "" or name == path or name.startswith(path + ".")

    return lambda path: (sum(p.numel() for n, p in first if under(path, n) and p.requires_grad),
                         sum(p.numel() for n, p in first if under(path, n)))


def _shared_parametrization():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    scale = Scale()
    parametrize.register_parametrization(m[0], "weight", scale)
    parametrize.register_parametrization(m[1], "weight", scale)
    return m


TREES = {
    "odd_keys": odd_keys_model,
    "list_tied": list_tied,
    "list_first_tied": list_first_tied,
    "two_paths": lambda: two_path_model()[0],
    "root_net": RootNet,
    "conv_net": ConvNet,
    "shared_parametrization": _shared_parametrization,
}


@pytest.mark.parametrize("name", sorted(TREES))
def test_summary_rows_of_odd_trees_count_first_paths_by_hand(name):
    m = TREES[name]()
    names = [n for n, _ in m.named_parameters()]
    with ts.freeze(m, [n for i, n in enumerate(names) if i % 2]):
        s = ts.summary(m)
        oracle = _summary_rows_oracle(m)
        assert s.counts == oracle("")
        param_rows = [r.path for r in s.rows if r.is_param and r.tied_to is None]
        assert param_rows == names
        for r in s.rows:
            if r.tied_to is None:
                assert (r.trainable, r.total) == oracle(r.path), r.path
            else:
                assert (r.trainable, r.total) == (0, 0), r.path
        later = {n for n, _ in m.named_parameters(remove_duplicate=False)} - set(names)
        tied_param_rows = {r.path for r in s.rows if r.is_param and r.tied_to is not None}
        assert tied_param_rows <= later  # a tied row is always a later path


def test_shared_parametrization_module_is_one_tied_parameter():
    torch.manual_seed(0)
    m = _shared_parametrization()
    scale = m[0].parametrizations.weight[0]
    x = torch.randn(2, 3)
    loss = lambda mm: mm(x).pow(2).sum()  # noqa: E731
    assert sel_paths(m, "1.parametrizations.weight.0") == ["0.parametrizations.weight.0.s"]
    with ts.freeze_except(m, "1.parametrizations.weight.0"):  # selected through the later path
        assert [n for n, f in flags(m).items() if f] == ["0.parametrizations.weight.0.s"]
        got = ts.structural_grad(m, loss)
        (want,) = torch.autograd.grad(loss(m), [scale.s])
        assert_tree_matches(got, {"0.parametrizations.weight.0.s": want})
        assert list(ts.state_dict(m)) == ["0.parametrizations.weight.0.s"]
    assert all(flags(m).values())


@pytest.mark.filterwarnings("ignore::torchstruct.RestoredFlagsWarning")
def test_a_raising_selector_judging_a_parameter_added_later_changes_nothing():
    class Boom(Exception):
        pass

    def sel(path, p):
        if path.startswith("pd.new"):
            raise Boom(path)
        return path.startswith("lin")

    m = ListNet()
    with ts.freeze_except(m, sel):
        inside = flags(m)
        assert inside == {"lin.weight": True, "lin.bias": True, "pl.0": False, "pd.k-0": False}
        m.pd["new"] = nn.Parameter(torch.ones(2))
        with pytest.raises(Boom, match="pd.new"):
            m(torch.ones(1, 2))  # the selector is asked about the new path: its error comes out
        assert flags(m) == dict(inside, **{"pd.new": True})  # nothing half-applied
        del m.pd["new"]
        m(torch.ones(1, 2))
    assert all(flags(m).values())


@pytest.mark.parametrize("conversion_mode", ["default", "overwrite", "swap"], indirect=True)
@pytest.mark.parametrize("sel", ["lin", "pl.1", "pl.0"])
def test_to_empty_of_a_meta_model_tied_across_a_list_inside_freeze(conversion_mode, sel):
    with torch.device("meta"):
        m = list_tied()
    tied_weight_frozen = sel in ("lin", "pl.1")
    with ts.freeze(m, sel):
        m.to_empty(device="cpu")
        tied_now = m.pl[1] is m.lin.weight
        # plain PyTorch: meta -> cpu makes new objects per module unless tensors are swapped
        assert tied_now == (conversion_mode == "swap")
        want = {"root": True, "lin.weight": not tied_weight_frozen,
                "lin.bias": sel != "lin", "pl.0": sel != "pl.0"}
        if not tied_now:
            want["pl.1"] = not tied_weight_frozen
        assert flags(m) == want
        assert [n for n, _ in ts.trainable_parameters(m)] == [n for n, f in want.items() if f]
    assert all(flags(m).values())


@pytest.mark.parametrize("conversion_mode", ["default", "overwrite", "swap"], indirect=True)
def test_weight_norm_and_old_spectral_norm_converted_inside_freeze(conversion_mode):
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    parametrizations.weight_norm(m[0])
    nn.utils.spectral_norm(m[1])
    with ts.freeze(m, "0.parametrizations", "1.weight_orig"):
        m.to(torch.float64)
        m(torch.ones(1, 3, dtype=torch.float64))
        assert flags(m) == {"0.bias": True, "0.parametrizations.weight.original0": False,
                            "0.parametrizations.weight.original1": False, "1.bias": True,
                            "1.weight_orig": False}
        # module 1 still owns a trainable parameter (its bias): its buffers are in
        assert list(ts.state_dict(m)) == ["0.bias", "1.bias", "1.weight_u", "1.weight_v"]
        assert all(p.dtype == torch.float64 for p in m.parameters())
    assert all(flags(m).values())


def test_no_decay_names_on_parameter_dict_keys_and_norm_children_by_hand():
    class FooNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = nn.Parameter(torch.ones(2))
            self.pd = nn.ParameterDict({"w": nn.Parameter(torch.ones(2))})

    m = nn.Module()
    m.pd = nn.ParameterDict({k: nn.Parameter(torch.ones(1)) for k in
                             ["bias", "x_bias", "bias_x", "bias-1", "biases", "w"]})
    m.norm = FooNorm()
    m.ln = nn.LayerNorm(2)
    m.ln.extra = nn.ParameterList([nn.Parameter(torch.ones(2))])
    groups = {g["name"]: g["param_names"] for g in ts.param_groups(m, weight_decay=0.1)}
    # docs/groups.md: last component bias / *_bias / bias_*, or a DIRECT parameter of a norm
    no_decay = {"pd.bias", "pd.x_bias", "pd.bias_x", "norm.gain", "ln.weight", "ln.bias"}
    every = [n for n, _ in m.named_parameters()]
    assert groups["default (no decay)"] == [n for n in every if n in no_decay]
    assert groups["default"] == [n for n in every if n not in no_decay]


def test_a_normalization_layer_at_two_paths_checkpoints_once():
    bn, stats = nn.BatchNorm1d(2), nn.BatchNorm1d(2, affine=False)
    m = nn.ModuleDict({"a": nn.Sequential(nn.Linear(2, 2), bn, stats),
                       "b": nn.Sequential(bn, stats, nn.Linear(2, 2))})
    want = ["a.0.weight", "a.0.bias", "a.1.weight", "a.1.bias", "a.1.running_mean",
            "a.1.running_var", "a.1.num_batches_tracked", "a.2.running_mean", "a.2.running_var",
            "a.2.num_batches_tracked", "b.2.weight", "b.2.bias"]
    assert list(ts.state_dict(m)) == want
    with ts.freeze(m, "b.0"):  # the norm, through its later path
        assert list(ts.state_dict(m)) == [k for k in want if not k.startswith("a.1.")]
    ts.load_state_dict(m, {"b.0.running_mean": torch.full((2,), 3.0)}, strict=False)
    assert torch.equal(bn.running_mean, torch.full((2,), 3.0))
    round_trip = {k: v.clone() for k, v in ts.state_dict(m).items()}
    got = ts.load_state_dict(m, round_trip)
    assert list(got.missing_keys) == [] and list(got.unexpected_keys) == []


def test_declarations_naming_empty_slots_follow_what_is_put_there_later():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(2, 2)
            self.register_module("head", None)
            self.register_parameter("temp", None)

        def trainable(self):
            return ["head", "temp"]

        def forward(self, x):
            y = self.body(x)
            if self.head is not None:
                y = self.head(y)
            if self.temp is not None:
                y = y * self.temp
            return y.sum()

    m = Net()
    ts.attach(m)
    assert flags(m) == {"body.weight": False, "body.bias": False}
    assert ts.summary(m).counts == (0, 6)
    m.head = nn.Linear(2, 2)
    m.temp = nn.Parameter(torch.ones(1))
    m(torch.ones(1, 2))
    assert flags(m) == {"temp": True, "body.weight": False, "body.bias": False,
                        "head.weight": True, "head.bias": True}
    lin = nn.Linear(2, 2, bias=False)
    ts.mark_trainable(lin, "bias")  # the empty slot of a Linear without bias
    assert not lin.weight.requires_grad
    lin.bias = nn.Parameter(torch.zeros(2))
    lin(torch.ones(1, 2))
    assert lin.bias.requires_grad and not lin.weight.requires_grad
    ts.mark_trainable(lin, None)
    assert lin.weight.requires_grad


class _TwoPathRoot(nn.Module):
    def __init__(self, shared):
        super().__init__()
        self.a = Wrap(shared)
        self.b = Wrap(shared)
        self.lst = nn.ModuleList([shared])

    def forward(self, x):
        if hasattr(self, "a"):
            x = self.a(x)
        for layer in self.lst:
            x = layer(x)
        return self.b(x)


def test_a_shared_module_loses_its_admitting_paths_one_by_one():
    shared = nn.Linear(2, 2)
    m = _TwoPathRoot(shared)
    ts.attach(m)
    ts.mark_trainable(m.b, "own")  # b excludes the shared module; a and lst still admit it
    assert shared.weight.requires_grad and ts.is_trainable(m, shared.weight)
    m.lst.pop(0)  # a container's own method: seen at the root's next forward
    m(torch.ones(1, 2))
    assert shared.weight.requires_grad  # still admitted through a
    del m.a  # not a container: the reads answer at once, the flag at the next application
    assert ts.is_trainable(m, shared.weight) is False
    ts.attach(m)
    assert not shared.weight.requires_grad
    assert [n for n, _ in ts.trainable_parameters(m)] == ["b.own.weight", "b.own.bias"]
    m.a = Wrap(shared)  # a registration: applied at the next forward
    m(torch.ones(1, 2))
    assert shared.weight.requires_grad and ts.is_trainable(m, "a.inner.weight")
    ts.mark_trainable(m.b, None)
    assert all(p.requires_grad for p in m.parameters())


def test_a_block_on_a_part_names_only_its_own_parameters_that_left():
    """``ts.freeze(part)`` without selectors froze the part only: a deletion elsewhere in the
    model is not its business, one inside the part is."""
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    ts.attach(m)
    part = m[1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ts.freeze(part):
            del m[2].bias  # another part: left alone by the block
    assert restored_warnings(caught) == []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ts.freeze(part):
            del part.bias
    said = " ".join(restored_warnings(caught))
    assert "'1.bias'" in said and "'1.weight'" not in said and "'0." not in said
