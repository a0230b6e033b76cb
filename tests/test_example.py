"""The main job (examples/finetune.py) runs end to end: both runs, the report, the plot, the checks.

One small configuration is run once for the module (the torchstruct and the plain-PyTorch runs
each in a child process, as the default run does); the tests read its output.
"""
import contextlib
import importlib.util
import io
import pathlib
import re
import sys

import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "finetune.py"
SMALL = ["--steps", "6", "--batch", "16"]
RECIPES = ("torchstruct", "plain PyTorch")
STAGES = ("head", "last blocks", "adapters", "new tokens")
NUMBER = r"(\d+\.\d+)"


def _load():
    spec = importlib.util.spec_from_file_location("finetune_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _run(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = _load().main(argv)
    return code, out.getvalue()


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    png = tmp_path_factory.mktemp("plot") / "losses.png"
    code, out = _run([*SMALL, "--plot", str(png)])
    return code, out, png


def _stage_rows(out):
    """{stage: [(start, end, ema) per recipe]} from the report's stage table."""
    cell = rf"\| {NUMBER} -> {NUMBER} \({NUMBER}\)\s+{NUMBER} s"
    rows = {}
    for number, name in enumerate(STAGES, 1):
        match = re.search(rf"^{number} {name}\s+(\S+)\s+{cell}\s+{cell}$", out, re.M)
        assert match, f"no report row for stage {name!r} in:\n{out}"
        values = [float(v) for v in match.groups()[1:]]
        rows[name] = (match.group(1), [tuple(values[:3]), tuple(values[4:7])])
    return rows


def test_both_runs_finish_and_their_checks_pass(small_run):
    code, out, _ = small_run
    assert code == 0, out
    assert "== Report: torchstruct vs plain PyTorch; same model, data and stages" in out
    for recipe in RECIPES:
        for number, name in enumerate(STAGES, 1):
            match = re.search(rf"^{recipe}\s+{number}/4 {name}\s+held-out loss .*; frozen tensors "
                              rf"bitwise unchanged: (\d+) of (\d+)$", out, re.M)
            assert match, f"no end-of-stage line for {recipe} {name}"
            unchanged, protected = map(int, match.groups())
            assert unchanged == protected > 0
    assert re.search(r"^frozen-weight checks\s+passed\s+passed$", out, re.M)
    assert out.rstrip().endswith("OK: every frozen parameter and every masked-out embedding row "
                                 "is bitwise unchanged")


def test_the_stages_train_what_they_say(small_run):
    _, out, _ = small_run
    trainable = {name: row[0] for name, row in _stage_rows(out).items()}
    # cumulative: head 8x64+8; + two blocks of 50.2K; + 4 adapters of rank 4 (1280 each);
    # + 8 new embedding rows of 64 (the old rows are masked out)
    assert trainable == {"head": "520", "last blocks": "100.5K", "adapters": "105.6K",
                         "new tokens": "106.1K"}


def test_the_losses_of_both_runs_decrease_and_agree(small_run):
    _, out, _ = small_run
    rows = _stage_rows(out)
    for run in range(2):
        start = rows["head"][1][run][0]
        end_of_stage_3 = rows["adapters"][1][run][1]
        assert end_of_stage_3 < 0.8 * start  # one held-out set for stages 1-3
        new_start, new_end, _ = rows["new tokens"][1][run]
        assert new_end < new_start  # the last stage has its own, with new tokens
    finals = re.search(rf"^final held-out loss\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}% apart$", out, re.M)
    assert finals, out
    ts_loss, plain_loss, apart = map(float, finals.groups())
    assert abs(ts_loss - plain_loss) <= 0.05 * plain_loss and apart <= 5.0
    assert re.search(rf"^final training loss\s+{NUMBER}\s+{NUMBER}$", out, re.M)


def test_the_report_compares_time_and_memory(small_run):
    _, out, _ = small_run
    for label, unit in (("time, all stages", "s"), ("median step", "ms"), ("peak memory", "MiB")):
        match = re.search(rf"^{label}\s+{NUMBER} {unit}\s+{NUMBER} {unit}\s+{NUMBER}x$", out, re.M)
        assert match, f"no {label!r} row in:\n{out}"
        assert all(float(v) > 0 for v in match.groups())
    assert re.search(r"^peak memory: (peak RSS \(getrusage ru_maxrss\) above the RSS right before "
                     r"training; .*each run in a fresh process|torch\.cuda\.max_memory_allocated)",
                     out, re.M)
    assert "\ntime: the full run that follows" in out
    assert "plain PyTorch steps with clip_grad_norm_(max_norm=1.0) + torch.optim.AdamW(" in out


def test_the_trainable_only_checkpoint_reproduces_the_held_out_loss(small_run):
    _, out, _ = small_run
    match = re.search(r"^torchstruct trainable-only checkpoint: (\d+) tensors, ([\d.]+) KiB vs "
                      r"([\d.]+) KiB for the full state_dict \(([\d.]+)%\); reloaded into a fresh "
                      rf"model: held-out loss {NUMBER}, equal$", out, re.M)
    assert match, out
    tensors, small, full, share = (float(v) for v in match.groups()[:4])
    assert 0 < small < full and tensors > 0 and share < 100


def test_one_optimizer_and_a_schedule_drive_the_torchstruct_run(small_run):
    _, out, _ = small_run
    assert ("torchstruct steps with one ts.optim.AdamW(ts.param_groups(...), max_grad_norm=1.0) "
            "for all stages, a ts.UnfreezeSchedule and a LambdaLR") in out
    assert re.search(r"^plain PyTorch steps with .*, rebuilt at each stage$", out, re.M)


def test_the_loss_plot_is_written(small_run):
    pytest.importorskip("matplotlib")
    _, out, png = small_run
    assert f"loss curves written to {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_the_run_says_so(small_run):
    _, out, _ = small_run
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    assert ("matplotlib is not installed: no loss plot" in out) != has_matplotlib


def test_a_frozen_weight_that_changes_fails_the_run(monkeypatch):
    """The checks are real: a step that also nudges a frozen weight makes the exit code 1."""
    module = _load()
    step = module.TorchstructRun.step

    def leaky_step(self, loss):
        norm = step(self, loss)
        with module.torch.no_grad():
            self.model.norm.weight.add_(1e-3)  # the final norm never trains
        return norm

    monkeypatch.setattr(module.TorchstructRun, "step", leaky_step)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = module.main(["--steps", "2", "--batch", "4", "--no-compare", "--plot", ""])
    out = out.getvalue()
    assert code == 1
    assert re.search(r"^torchstruct\s+1/4 head\s+.*bitwise unchanged: 58 of 59$", out, re.M)
    assert re.search(r"^frozen-weight checks\s+FAILED$", out, re.M)
    assert out.rstrip().endswith("FAILED: a frozen parameter or a masked-out embedding row changed")
