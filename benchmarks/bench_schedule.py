"""UnfreezeSchedule: the cost of a step that changes nothing, and of a stage change.

Targets: ``UnfreezeSchedule.step()`` with no milestone reached is O(1) and under 2 µs (for
scale: ``torch.optim.lr_scheduler.StepLR.step()``, measured in the same run). A stage change on
a 12-layer GPT-2-sized model (GPT-2 small's 148 parameter tensors, built on the meta device:
flags do not depend on the data) is reported next to what users write by hand, a loop of
``requires_grad_`` over the parameters.

    python -m benchmarks.bench_schedule [--write]
"""
from __future__ import annotations

import statistics
import time

import torch
from torch import nn

import torchstruct as ts

from .common import TinyGPT, machine_description
from .results import options, report


def gpt2_small_on_meta() -> tuple[nn.Module, str]:
    """GPT-2 small (124M parameters) without memory: transformers' model if installed."""
    with torch.device("meta"):
        try:
            import transformers

            cfg = transformers.GPT2Config()  # 12 layers, 768 wide, vocab 50257
            return transformers.GPT2LMHeadModel(cfg), "transformers GPT2LMHeadModel (GPT-2 small)"
        except ImportError:
            model = TinyGPT(layers=12, d=768, heads=12, vocab=50257, seq=1024)
            return model, "TinyGPT(12 layers, d 768) (transformers not installed)"


def per_call(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def idle_step(rounds: int) -> dict:
    """Median seconds of a step that reaches no milestone, and of StepLR.step()."""
    model = nn.Linear(4, 4)
    sched = ts.UnfreezeSchedule(model, {0: "weight", 10**12: None})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lr = torch.optim.lr_scheduler.StepLR(opt, step_size=10**12)
    opt.step()  # (no gradients: changes nothing) the order torch expects, so no warning
    got = {"schedule": [], "steplr": []}
    for _ in range(rounds):
        got["schedule"].append(per_call(sched.step, 20000))
        got["steplr"].append(per_call(lr.step, 2000))
    return {k: statistics.median(v) for k, v in got.items()}


def stage_change(rounds: int) -> tuple[dict, str, int]:
    """Median seconds of one stage change (unfreezing the last block) and of its inverse."""
    model, name = gpt2_small_on_meta()
    params = list(model.parameters())
    last = [p for n, p in model.named_parameters() if n.startswith(("transformer.h.11.",
                                                                      "blocks.11."))]
    paths = [n for n, _ in model.named_parameters()]
    top = "transformer.ln_f" if "transformer.ln_f.weight" in paths else "ln_f"
    block = "transformer.h.11" if top.startswith("transformer") else "blocks.11"
    sched = ts.UnfreezeSchedule(model, {0: top, 1: block})
    at0 = sched.state_dict()
    fwd, back, manual = [], [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        sched.step()  # stage 1 -> 2: the last block starts training
        fwd.append(time.perf_counter() - t0)
        assert all(p.requires_grad for p in last)
        t0 = time.perf_counter()
        sched.load_state_dict(at0)  # back to stage 1
        back.append(time.perf_counter() - t0)
        assert not any(p.requires_grad for p in last)
    sched.close()
    chosen = {id(p) for p in last}
    for _ in range(rounds):
        t0 = time.perf_counter()
        for p in params:  # by hand: every flag written
            p.requires_grad_(id(p) in chosen)
        manual.append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in
           {"step": fwd, "load": back, "manual": manual}.items()}
    return med, name, len(params)


def run(rounds: int) -> str:
    idle = idle_step(rounds)
    change, name, tensors = stage_change(rounds)
    us = 1e6
    target = "met" if idle["schedule"] < 2e-6 else "NOT met"
    return "\n".join([
        f"{machine_description()}; medians of {rounds} rounds.",
        "",
        "| case | time | for scale |",
        "|---|---:|---|",
        f"| `step()` reaching no milestone | {idle['schedule'] * us:.3f} µs | "
        f"`StepLR.step()`: {idle['steplr'] * us:.2f} µs "
        f"({idle['steplr'] / idle['schedule']:.0f}x) |",
        f"| `step()` at a milestone: last block unfrozen | {change['step'] * 1e3:.2f} ms | "
        f"`requires_grad_` loop over the {tensors} tensors: {change['manual'] * 1e3:.3f} ms |",
        f"| `load_state_dict` back one stage | {change['load'] * 1e3:.2f} ms | |",
        "",
        f"Target: `step()` with nothing to change under 2 µs: {target}. Stage change on "
        f"{name}, {tensors} parameter tensors on the meta device. A stage change exchanges "
        "the schedule's context for the next one in one application of the flags (the model "
        "indexed, the selectors resolved, every flag computed, the DDP rule checked, the "
        "changed flags written); it happens a few times per run.",
    ])


def main(argv=None) -> None:
    args = options(__doc__, argv, rounds=15)
    report(args, "schedule", "UnfreezeSchedule: idle step and stage change", run(args.rounds))


if __name__ == "__main__":
    main()
