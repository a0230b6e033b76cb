"""Tests for ts.summary: per-subtree counts, tied rows, totals line, str/repr."""

import re

import pytest
import torch
from torch import nn

import torchstruct as ts

TOTALS = re.compile(r"^trainable (\d+(?:\.\d+)?[KMB]?) of (\d+(?:\.\d+)?[KMB]?), (\d+\.\d\d)%$")


def brute_counts(model):
    """{module path: (trainable, total)}: each parameter object once, at its first path."""
    first = {}
    for path, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), (path, p))
    out = {}
    for mpath, _ in model.named_modules(remove_duplicate=False):
        prefix = mpath + "." if mpath else ""
        t = n = 0
        for path, p in first.values():
            if path.startswith(prefix):
                n += p.numel()
                t += p.numel() if p.requires_grad else 0
        out[mpath] = (t, n)
    return out


def module_rows(s):
    return {r.path: r for r in s.rows if not r.is_param}


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        self.shared = nn.Linear(4, 4)
        self.again = self.shared  # a module used twice
        self.out = nn.Linear(4, 10, bias=False)
        self.out.weight = self.embed.weight  # a tied parameter


def test_counts_per_subtree_match_brute_force():
    m = Tied()
    ts.mark_trainable(m, "block", "again", "out")
    with ts.freeze(m, "block.1"):
        s = ts.summary(m)
        want = brute_counts(m)
        trainable_now = sum(p.numel() for p in m.parameters() if p.requires_grad)
    rows = module_rows(s)
    for path, row in rows.items():
        if row.tied_to is None:
            assert (row.trainable, row.total) == want[path], path
    assert (s.trainable, s.total) == want[""]
    assert s.total == sum(p.numel() for p in m.parameters())
    assert s.trainable == trainable_now


def test_counts_on_a_transformer_match_brute_force():
    torch.manual_seed(0)
    m = nn.Sequential(
        nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), nn.LSTM(8, 4), nn.BatchNorm1d(4)
    )
    m[0].norm1.weight.requires_grad_(False)
    with ts.freeze_except(m, "0.self_attn", "1.weight_ih_l0", "2"):
        s = ts.summary(m)
        want = brute_counts(m)
    for path, row in module_rows(s).items():
        assert (row.trainable, row.total) == want[path], path
    params = dict(m.named_parameters())
    for r in s.rows:
        if r.is_param:
            p = params[r.path]
            assert r.total == p.numel()
            assert r.trainable == (p.numel() if r.mark == "trainable" else 0)


def test_parameter_rows_and_marks():
    m = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    with ts.freeze(m, "0.bias", "1"):
        s = ts.summary(m)
    by_path = {r.path: r for r in s.rows}
    assert by_path["0.weight"].mark == "trainable" and by_path["0.weight"].is_param
    assert by_path["0.bias"].mark == "frozen"
    assert by_path["0"].mark == "partial"
    assert by_path["1"].mark == "frozen"
    assert by_path[""].mark == "partial"
    assert [r.path for r in s.rows] == ["", "0", "0.weight", "0.bias", "1", "1.weight", "1.bias"]
    assert [r.depth for r in s.rows] == [0, 1, 2, 2, 1, 2, 2]


def test_tied_parameter_and_module_used_twice_shown_once_with_tied_row():
    m = Tied()
    s = ts.summary(m)
    text = str(s)
    tied = [r for r in s.rows if r.tied_to is not None]
    assert {(r.path, r.tied_to) for r in tied} == {("again", "shared"), ("out.weight", "embed.weight")}
    for r in tied:
        assert (r.trainable, r.total) == (0, 0)
    # shown once: the module used twice is not expanded a second time
    paths = [r.path for r in s.rows]
    assert not any(p.startswith("again.") for p in paths)
    assert paths.count("shared.weight") == 1
    # the tied lines say so
    tied_lines = [line for line in text.splitlines() if "tied" in line]
    assert len(tied_lines) == 2
    assert any("again" in line and "shared" in line for line in tied_lines)
    assert any("weight" in line and "embed.weight" in line for line in tied_lines)
    # counted once
    assert s.total == sum(p.numel() for p in m.parameters())


def test_totals_line_format():
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    with ts.freeze(m, "0"):
        s = ts.summary(m)
    assert (s.trainable, s.total) == (5, 25)
    assert s.totals() == "trainable 5 of 25, 20.00%"
    assert str(s).splitlines()[-1] == "trainable 5 of 25, 20.00%"
    assert s.fraction == pytest.approx(0.2)


def test_totals_line_with_large_counts():
    # parameters on the meta device: the counts are real, no memory is used
    m = nn.Module()
    m.big = nn.Parameter(torch.empty(124_000_000 - 1_200_000, device="meta"), requires_grad=False)
    m.small = nn.Parameter(torch.empty(1_200_000, device="meta"))
    s = ts.summary(m)
    assert s.totals() == "trainable 1.2M of 124M, 0.97%"


@pytest.mark.parametrize("n", [1, 999, 1000, 1500, 999_499, 999_999, 1_000_000, 54_321_000, 999_999_999,
                               3_000_000_000])
def test_totals_numbers_are_plain_counts(n):
    m = nn.Module()
    m.w = nn.Parameter(torch.empty(n, device="meta"))
    line = ts.summary(m).totals()
    got = TOTALS.match(line)
    assert got, line
    unit = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9}
    for text in got.group(1, 2):
        value = float(text.rstrip("KMB")) * unit[text[-1] if text[-1] in "KMB" else ""]
        assert value == pytest.approx(n, rel=0.01), (line, text)
    assert got.group(3) == "100.00"


def test_empty_and_all_frozen_models():
    s = ts.summary(nn.ReLU())
    assert (s.trainable, s.total) == (0, 0)
    assert s.totals() == "trainable 0 of 0, 0.00%"
    m = nn.Linear(2, 2)
    with ts.freeze(m):
        s = ts.summary(m)
    assert s.totals() == "trainable 0 of 6, 0.00%"
    assert s.rows[0].mark == "frozen"


def test_str_and_repr():
    m = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    ts.mark_trainable(m, "0")
    s = ts.summary(m)
    text = str(s)
    assert repr(s) == text
    lines = text.splitlines()
    assert "trainable" in lines[0] and "total" in lines[0]
    assert lines[1].startswith("Sequential")
    assert any(line.startswith("  0: Linear") for line in lines)
    assert any(line.startswith("    weight: (2, 2) float32") for line in lines)
    assert any(line.startswith("  1: ReLU") for line in lines)
    assert lines[-1] == "trainable 6 of 6, 100.00%"


def test_summary_reflects_pending_changes():
    m = nn.Sequential(nn.Linear(2, 2))
    ts.mark_trainable(m, "0")
    m.append(nn.Linear(2, 1))  # not declared: frozen; summary refreshes before counting
    s = ts.summary(m)
    assert (s.trainable, s.total) == (6, 9)


def test_summary_of_submodule():
    m = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 3)))
    with ts.freeze(m, "1.0.bias"):
        s = ts.summary(m[1])
    assert (s.trainable, s.total) == (6, 9)
    assert [r.path for r in s.rows] == ["", "0", "0.weight", "0.bias"]


# ----------------------------------------------------------------------------- collapsing
def tiny_gpt2(layers=12):
    import os

    os.environ["HF_HUB_OFFLINE"] = "1"
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=16, n_head=2, vocab_size=64,
                                  n_positions=16, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def check_sums(s):
    """Every visible module row counts what the rows right under it count (a full summary)."""
    rows = list(s.rows)
    for i, r in enumerate(rows):
        if r.is_param or r.tied_to is not None:
            continue
        kids = []
        for q in rows[i + 1:]:
            if q.depth <= r.depth:
                break
            if q.depth == r.depth + 1:
                kids.append(q)
        if kids:
            assert (r.trainable, r.total) == (sum(k.trainable for k in kids),
                                              sum(k.total for k in kids)), r.path


def test_twelve_layer_gpt2_prints_a_short_summary():
    m = tiny_gpt2()
    s = ts.summary(m)
    text = str(s)
    lines = text.splitlines()
    assert len(lines) < 45, text
    assert sum(p.numel() for p in m.parameters()) == s.total
    assert s.counts == (s.total, s.total)
    head = [r for r in s.rows if r.repeat > 1]
    assert len(head) == 1 and head[0].repeat == 12 and head[0].path == "transformer.h.0"
    assert any(line.strip().startswith("0–11: GPT2Block ×12") for line in lines)
    block = sum(p.numel() for p in m.transformer.h[0].parameters())
    assert head[0].total == 12 * block
    assert not any(r.path.startswith("transformer.h.1") for r in s.rows)
    check_sums(s)


def test_marks_split_a_run_of_blocks():
    m = tiny_gpt2()
    with ts.freeze_except(m, "transformer.h.11", "transformer.h.5.ln_1"):
        s = ts.summary(m)
        want = sum(p.numel() for p in m.parameters() if p.requires_grad)
    runs = [(r.name, r.repeat, r.mark) for r in s.rows if r.path.startswith("transformer.h.")
            and r.depth == 3]
    assert runs == [("0–4", 5, "frozen"), ("5", 1, "partial"), ("6–10", 5, "frozen"),
                    ("11", 1, "trainable")]
    assert s.trainable == want
    check_sums(s)


def test_only_identical_consecutive_children_of_lists_collapse():
    m = nn.Sequential(
        nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 8), nn.Linear(4, 4),  # shape breaks the run
        nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2)}),  # not a list: no collapse
        nn.ModuleList([nn.ReLU(), nn.ReLU(), nn.ReLU()]),
    )
    s = ts.summary(m)
    top = [(r.name, r.repeat) for r in s.rows if r.depth == 1]
    assert top == [("0–1", 2), ("2", 1), ("3", 1), ("4", 1), ("5", 1)]
    inner = [(r.name, r.repeat) for r in s.rows if r.path.startswith("5.")]
    assert inner == [("0–2", 3)]
    assert [r.name for r in s.rows if r.path.startswith("4.") and r.depth == 2] == ["a", "b"]
    check_sums(s)


def test_dtype_and_tied_parameters_break_a_run():
    m = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2).double(), nn.Linear(2, 2),
                       nn.Linear(2, 2)])
    m[3].weight = m[0].weight  # block 3 reuses block 0's weight: not identical to block 2
    s = ts.summary(m)
    assert [(r.name, r.repeat) for r in s.rows if r.depth == 1] == [
        ("0", 1), ("1", 1), ("2", 1), ("3", 1)]
    assert s.total == 3 * 6 + 2
    reused = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    m = nn.Sequential(reused[0], reused[0], reused[0])  # one module three times: not collapsed
    s = ts.summary(m)
    assert [r.tied_to for r in s.rows if r.depth == 1] == [None, "0", "0"]


def test_the_block_owning_a_tied_parameter_breaks_the_run_too():
    m = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))
    m[3].weight = m[1].weight  # block 1 owns it, block 3 reuses it
    s = ts.summary(m)
    assert [(r.name, r.repeat) for r in s.rows if r.depth == 1] == [
        ("0", 1), ("1", 1), ("2", 1), ("3", 1)]
    assert [r.tied_to for r in s.rows if r.tied_to] == ["1.weight"]
    assert "1.weight" in {r.path for r in s.rows}
    check_sums(s)


@pytest.mark.parametrize("seed", range(40))
def test_every_tie_names_a_shown_row_and_counts_match_brute_force(seed):
    """Random nested lists of identical blocks, some parameters tied and some modules reused
    across them, some frozen: every ``tied_to`` names a row shown, and every module row shown
    counts what a brute force counts (a run's row: all the blocks it stands for)."""
    g = torch.Generator().manual_seed(seed)

    def pick(n):
        return int(torch.randint(n, (), generator=g))

    def block():
        return nn.Sequential(nn.Linear(3, 3), nn.ModuleList(nn.Linear(3, 3) for _ in range(3)))

    m = nn.ModuleList(block() for _ in range(2 + pick(4)))
    linears = [x for x in m.modules() if isinstance(x, nn.Linear)]
    for _ in range(pick(3)):
        a, b = linears[pick(len(linears))], linears[pick(len(linears))]
        b.weight = a.weight
    for _ in range(pick(2)):
        i, j = pick(len(m)), pick(len(m))
        m[j][1][pick(3)] = m[i][0]  # a module reused in another block
    for p in list(m.parameters())[: pick(3)]:
        p.requires_grad_(False)
    s = ts.summary(m)
    shown = {r.path for r in s.rows}
    assert all(r.tied_to in shown for r in s.rows if r.tied_to is not None), str(s)
    brute = brute_counts(m)
    real = {-1: [""]}  # depth -> the real module paths the last row at that depth stands for
    for r in s.rows:  # a row under a run's row stands for its place in every block of the run
        name = r.path.rsplit(".", 1)[-1]
        names = [str(int(name) + k) for k in range(r.repeat)] if r.repeat > 1 else [name]
        real[r.depth] = [f"{q}.{n}" if q else n for q in real[r.depth - 1] for n in names]
        if r.is_param or r.tied_to is not None or r.depth == 0:
            continue
        want = [sum(c) for c in zip(*(brute[q] for q in real[r.depth]))]
        assert [r.trainable, r.total] == want, (r.path, real[r.depth])
    assert s.counts == brute[""]
    check_sums(s)


def test_nested_repeats_count_every_copy():
    def block():
        return nn.Sequential(nn.ModuleList([nn.Linear(3, 3) for _ in range(4)]), nn.LayerNorm(3))

    m = nn.ModuleList([block() for _ in range(5)])
    s = ts.summary(m)
    rows = {(r.path, r.name): r for r in s.rows}
    outer = rows[("0", "0–4")]
    inner = rows[("0.0.0", "0–3")]
    assert (outer.repeat, inner.repeat) == (5, 4)
    assert inner.total == 5 * 4 * 12 and outer.total == 5 * (4 * 12 + 6) == s.total
    assert "0–3: Linear ×4" in str(s)
    check_sums(s)


def test_max_depth_hides_deeper_rows_but_keeps_their_counts():
    m = tiny_gpt2(layers=3)
    full = ts.summary(m)
    for depth in (0, 1, 2, 3):
        s = ts.summary(m, max_depth=depth)
        assert all(r.depth <= depth for r in s.rows)
        assert s.counts == full.counts
        assert [r for r in full.rows if r.depth <= depth] == list(s.rows)
    assert len(ts.summary(m, max_depth=0).rows) == 1


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_bad_max_depth(bad):
    with pytest.raises(TypeError, match="max_depth"):
        ts.summary(nn.Linear(2, 2), max_depth=bad)


def test_not_a_module():
    with pytest.raises(TypeError, match="nn.Module"):
        ts.summary([nn.Linear(2, 2)])


def test_summary_is_read_only():
    m = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    m[0].bias.requires_grad_(False)
    s = ts.summary(m)
    assert s.counts == (8, 10)
    assert not any(mod._forward_pre_hooks or mod._forward_hooks for mod in m.modules())
    assert [p.requires_grad for p in m.parameters()] == [True, False, True, True]
    assert not any(k.startswith("_torchstruct") for p in m.parameters() for k in vars(p))
