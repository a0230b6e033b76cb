"""Cost of a ``stop_gradient`` / ``swap`` block around a training step, against the same step
plain and inside a no-op ``TorchFunctionMode``.

A block works through a torch function mode: every torch call in it goes through Python. A
no-op mode is the floor of that design (PyTorch's own dispatch to a Python handler); the
block's handler adds one dictionary look-up per tensor argument. Target: a step in a block
costs at most 1.3 times the step in the no-op mode (the handler's own work is under a third
of PyTorch's dispatch cost), on a model small enough that per-op overhead dominates.

    python -m benchmarks.bench_blocks [--write] [--device cuda]
"""
from __future__ import annotations

import collections

import torch
from torch.overrides import TorchFunctionMode

import torchstruct as ts

from .common import TinyGPT, interleaved_medians, lm_loss, machine_description, paired_ratios, \
    time_once, token_batch
from .results import options, report


class _NoOp(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _Count(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls[func] += 1
        return func(*args, **(kwargs or {}))


def _steps(model, device):
    inputs, targets = (t.to(device) for t in token_batch(0, 0, 4, model.seq, model.vocab))
    # clones that require grad: the step's backward does the same work as the plain step's
    ema = {path: p.detach().clone().requires_grad_() for path, p in model.named_parameters()
           if path.startswith("blocks.0.")}

    def step():
        model.zero_grad(set_to_none=True)
        lm_loss(model(inputs), targets).backward()

    def noop():
        with _NoOp():
            step()

    def blocked():
        with ts.stop_gradient(model, "blocks.0"):
            step()

    def swapped():
        with ts.swap(model, ema):
            step()

    def entry():
        with ts.stop_gradient(model, "blocks.0"):
            pass

    return {"plain": step, "no-op mode": noop, "stop_gradient": blocked, "swap": swapped,
            "entry": entry}


def measure(model, device, rounds: int) -> tuple[dict, dict, int]:
    """Median seconds per call, paired ratios against the no-op mode, torch calls per step."""
    fns = _steps(model, device)
    with _Count() as count:
        fns["plain"]()
    calls = sum(count.calls.values())
    series = {name: [] for name in fns}
    for _ in range(3):
        for fn in fns.values():
            fn()
    for r in range(rounds):
        order = list(fns.items())
        for name, fn in (order if r % 2 == 0 else order[::-1]):
            series[name].append(time_once(fn, device, inner=3))
    medians = {name: sorted(s)[len(s) // 2] for name, s in series.items()}
    ratios = {name: paired_ratios(series[name], series["no-op mode"])
              for name in ("plain", "stop_gradient", "swap")}
    return medians, ratios, calls


def run(device: str, rounds: int) -> str:
    torch.manual_seed(0)
    cases = [("TinyGPT(layers=6, d=64, vocab=512, seq=32)", TinyGPT(6, 64, 4, 512, 32)),
             ("TinyGPT() (d=256, vocab 4096, seq 64)", TinyGPT())]
    rows = []
    for name, model in cases:
        model = model.to(device)
        t, ratio, calls = measure(model, device, rounds)
        per_call = (t["swap"] - t["no-op mode"]) / calls * 1e6
        rows.append(
            f"| {name} | {calls} | {t['plain'] * 1e3:.2f} | {t['no-op mode'] * 1e3:.2f} | "
            f"{t['stop_gradient'] * 1e3:.2f} | {t['swap'] * 1e3:.2f} | "
            f"{ratio['stop_gradient'][0]:.3f} ({ratio['stop_gradient'][1]:.3f}–"
            f"{ratio['stop_gradient'][2]:.3f}) | {ratio['swap'][0]:.3f} | {per_call:+.2f} | "
            f"{t['entry'] * 1e6:.0f} |")
        del model
    met = all(float(r.split("|")[col].split()[0]) <= 1.3 for r in rows for col in (7, 8))
    return "\n".join([
        f"{machine_description(device)}; one training step (forward + backward, batch 4) per "
        f"call, {rounds} rounds alternating the five cases in swapped order; medians, and "
        "medians of per-round ratios (first–third quartile).",
        "",
        "| model | torch calls per step | plain ms | no-op mode ms | stop_gradient ms | swap ms | "
        "stop_gradient / no-op (target ≤ 1.3) | swap / no-op (target ≤ 1.3) | swap − no-op, µs per "
        "torch call | "
        "block entry + exit µs |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        f"Targets {'met' if met else 'missed'}. The blocks select `blocks.0`; each call enters "
        "the block, runs the step and exits. `swap` puts in clones of its parameters that "
        "require grad, so its backward does the work of the plain step's; `stop_gradient` skips "
        "the weight gradients of `blocks.0`, which can make its step faster than the no-op "
        "mode's where the matrix products dominate (the larger model). "
        "The no-op mode is a `TorchFunctionMode` whose handler only calls the function: the "
        "floor of any block built on a mode. The swap − no-op column spreads the whole "
        "difference (block entry and exit included) over the torch calls of a step. Block entry + exit: `with ts.stop_gradient(model, "
        "\"blocks.0\"): pass` (selecting indexes the model).",
    ])


def main(argv=None) -> None:
    args = options(__doc__, argv, device="cpu", rounds=15)
    report(args, "blocks", "Blocks: stop_gradient and swap around a training step",
           run(args.device, args.rounds))


if __name__ == "__main__":
    main()
