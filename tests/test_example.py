"""The main job (examples/finetune.py) runs end to end and its own checks pass."""
import importlib.util
import pathlib

import torch

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "finetune.py"


def _load():
    spec = importlib.util.spec_from_file_location("finetune_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_finetune_example_runs_and_keeps_frozen_weights(capsys):
    torch.manual_seed(0)
    assert _load().main(["--steps", "6", "--batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "trainable 50.5K of 205K" in out  # the summary of stage 1
    assert "old embedding rows bitwise unchanged: True" in out
    assert out.rstrip().endswith("bitwise unchanged")
