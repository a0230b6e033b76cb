"""Host-side cost per call: torchstruct's Python work against PyTorch's, on tensors so small
that the arithmetic costs next to nothing.

On a GPU the kernels of a step run while the host prepares the next launch; a step whose host
work takes longer than its kernels waits on the host. These cases measure that host work:

- an optimizer step with clipping over GPT-2 small's 148 parameter tensors, each of 16
  elements: ``ts.optim.AdamW(max_grad_norm=1.0)`` against ``clip_grad_norm_(foreach=True)`` +
  ``torch.optim.AdamW(fused=True)``; target: torchstruct's host time at most torch's; the
  same over 1000 tensors, and the cost per tensor from the two;
- ``ts.clip_by_global_norm`` against ``clip_grad_norm_(foreach=True)`` on the same tensors;
- ``ts.structural_grad`` against ``torch.autograd.grad`` over every parameter, both on one
  retained graph of a small GPT-like model (the difference is torchstruct's walk of the
  graph, its checks and the tree it builds).

    python -m benchmarks.bench_host [--write]
"""
from __future__ import annotations

import torch

import torchstruct as ts

from .common import TinyGPT, interleaved_medians, lm_loss, machine_description, token_batch
from .results import options, report


def _tiny_parameters(n: int = 148, size: int = 16) -> list:
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(size, generator=g)) for _ in range(n)]
    for p in params:
        p.grad = torch.randn(size, generator=g)
    return params


def _steps(n: int, rounds: int, inner: int) -> dict:
    """Medians of an AdamW step with clipping over ``n`` tensors of 16 elements: torch's
    ``clip_grad_norm_(foreach=True)`` + fused AdamW, and torchstruct's folded one."""
    params = _tiny_parameters(n)
    torch_opt = torch.optim.AdamW(params, lr=1e-6, fused=True)
    ts_opt = ts.optim.AdamW(params, lr=1e-6, max_grad_norm=1.0)

    def torch_step():
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        torch_opt.step()

    return interleaved_medians({"torch": torch_step, "ts": ts_opt.step}, rounds=rounds,
                               inner=inner)


def run(rounds: int) -> str:
    params = _tiny_parameters()
    steps = _steps(148, rounds, inner=20)
    many = _steps(1000, rounds, inner=3)
    clips = interleaved_medians(
        {"torch": lambda: torch.nn.utils.clip_grad_norm_(params, 1e9, foreach=True),
         "ts": lambda: ts.clip_by_global_norm(params, 1e9)}, rounds=rounds, inner=20)

    torch.manual_seed(0)
    model = TinyGPT(6, 64, 4, 512, 32)
    inputs, targets = token_batch(0, 0, 4, model.seq, model.vocab)
    loss = lm_loss(model(inputs), targets)
    every = list(model.parameters())
    grads = interleaved_medians(
        {"torch": lambda: torch.autograd.grad(loss, every, retain_graph=True),
         "ts": lambda: ts.structural_grad(model, loss, retain_graph=True)},
        rounds=rounds, inner=5)

    def row(name, t, target=None):
        verdict = "" if target is None else (" (met)" if t["ts"] <= t["torch"] else " (missed)")
        return (f"| {name} | {t['torch'] * 1e6:.0f} | {t['ts'] * 1e6:.0f} | "
                f"{t['torch'] / t['ts']:.2f}{verdict} | {(t['ts'] - t['torch']) * 1e6:+.0f} |")

    return "\n".join([
        f"{machine_description()}; medians of {rounds} interleaved rounds.",
        "",
        "| case | torch µs | torchstruct µs | torch / ts | ts − torch µs |",
        "|---|---:|---:|---:|---:|",
        row("AdamW step with clip, 148 tensors of 16 elements (target torch / ts ≥ 1)", steps,
            target=True),
        row("same step, 1000 tensors of 16 elements", many),
        row("clip by global norm, 148 tensors of 16 elements (no clipping needed)", clips),
        row(f"gradients of all {len(every)} parameters, TinyGPT(layers=6, d=64), one retained "
            "graph: `structural_grad` vs `autograd.grad`", grads),
        "",
        "The arithmetic on 16-element tensors is negligible, so these times are the host work "
        "per call. torch's step is `clip_grad_norm_(foreach=True)` then "
        "`torch.optim.AdamW(fused=True).step()`; torchstruct's is "
        "`ts.optim.AdamW(max_grad_norm=1.0).step()` (checks every parameter and its gradient "
        "at every step, then one fused op call). The gradient row includes the backward itself "
        "for both; its difference is torchstruct's own work. Per tensor of the step, from the "
        f"148- and 1000-tensor rows: torch {_per_tensor(steps, many, 'torch'):.2f} µs, "
        f"torchstruct {_per_tensor(steps, many, 'ts'):.2f} µs.",
    ])


def _per_tensor(small: dict, large: dict, key: str) -> float:
    return (large[key] - small[key]) / (1000 - 148) * 1e6


def main(argv=None) -> None:
    args = options(__doc__, argv, rounds=15)
    report(args, "host", "Host-side cost per call", run(args.rounds))


if __name__ == "__main__":
    main()
