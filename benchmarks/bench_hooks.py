"""Forward time of a small model with torchstruct's hooks attached vs the same model plain.

Target: attached / plain <= 1.02 (the hook is a constant check when nothing changed).

    python -m benchmarks.bench_hooks [--write]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import torchstruct as ts
from torchstruct.declare import _pre_forward

from .results import write_section


def small_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(128, 256), nn.GELU(), nn.LayerNorm(256),
        nn.Linear(256, 256), nn.GELU(), nn.LayerNorm(256),
        nn.Linear(256, 10),
    )


def _per_call(f, inner: int) -> float:
    t0 = time.perf_counter()
    for _ in range(inner):
        f()
    return (time.perf_counter() - t0) / inner


def run(rounds: int = 40, inner: int = 100) -> str:
    """One model, timed alternately with hooks attached and detached (order swapped each round)."""
    torch.manual_seed(0)
    model = small_model()
    ts.freeze_except(model, "6")  # a declaration active
    x = torch.randn(32, 128)
    fwd = lambda: model(x)  # noqa: E731
    t_on, t_off, ratios = [], [], []
    with torch.no_grad():
        for _ in range(50):
            fwd()
        for r in range(rounds):
            pair = {}
            for hooked in ((True, False) if r % 2 else (False, True)):
                ts.attach(model) if hooked else ts.detach_hooks(model)
                pair[hooked] = _per_call(fwd, inner)
            t_on.append(pair[True])
            t_off.append(pair[False])
            ratios.append(pair[True] / pair[False])
    hook = _per_call(lambda: _pre_forward(model, (x,)), 100_000)
    t_on_m, t_off_m, ratio = statistics.median(t_on), statistics.median(t_off), statistics.median(ratios)
    verdict = "meets" if ratio <= 1.02 else "misses"
    return "\n".join([
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; model: 3 Linear + 2 LayerNorm,"
        f" batch 32; one model timed alternately with hooks attached and detached, {rounds} rounds",
        "",
        "| forward (no_grad) | detached (µs) | attached (µs) | median ratio attached/detached | target |",
        "|---|---|---|---|---|",
        f"| small MLP | {t_off_m * 1e6:.1f} | {t_on_m * 1e6:.1f} | {ratio:.3f} | ≤ 1.02 ({verdict}) |",
        "",
        f"The hook itself, when nothing changed: {hook * 1e9:.0f} ns per forward "
        f"({100 * hook / t_off_m:.2f}% of this forward).",
    ])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write the table into RESULTS.md")
    args = parser.parse_args(argv)
    table = run()
    print(table)
    if args.write:
        write_section("hooks", "Hook overhead", table)


if __name__ == "__main__":
    main()
