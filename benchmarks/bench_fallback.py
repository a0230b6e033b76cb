"""What a device without compiled kernels costs: the fallback against the kernels and torch.

On one device, in one run with interleaved medians (float32, random gradients), each op
three ways: torchstruct's compiled kernels (where built for the device), torchstruct's
fallback on PyTorch's multi-tensor and fused ops (what a GPU with a CPU-only build of the
extension runs), and plain PyTorch doing the same work:

* clip of 2000 gradients of 1k elements (per-tensor overhead);
* ``ts.optim.AdamW(max_grad_norm=1.0).step()`` on 96 tensors of 128k elements, against
  ``clip_grad_norm_(foreach=True)`` + ``torch.optim.AdamW(fused=True)``.

The fallback's results are checked against the compiled ones (or the reference) while
measuring.

    python -m benchmarks.bench_fallback [--device cpu|cuda] [--rounds 9] [--write]
"""
from __future__ import annotations


import torch

import torchstruct as ts
import torchstruct.optim as tso
from torchstruct import _ops

from .common import interleaved_medians, machine_description, torch_adamw
from .results import options, report


def _params(device, count, size, seed):
    g = torch.Generator().manual_seed(seed)
    params = []
    for _ in range(count):
        p = torch.nn.Parameter((torch.randn(size, generator=g) * 0.02).to(device))
        p.grad = (torch.randn(size, generator=g) * 1e-2).to(device)
        params.append(p)
    return params


def _backends(device):
    device_type = torch.device(device).type
    kernels = _ops.compiled_available() and device_type in _ops.compiled_device_types()
    return (["compiled"] if kernels else []) + ["fallback"]


def _clip_row(device, rounds):
    params = _params(device, 2000, 1000, 0)
    grads = [p.grad.clone() for p in params]

    def ours(name):
        def fn():
            for p, g in zip(params, grads):
                p.grad.copy_(g)
            with _ops.use_backend(name):
                return ts.clip_by_global_norm(params, 1.0)
        return fn

    def plain():
        for p, g in zip(params, grads):
            p.grad.copy_(g)
        return torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)

    names = _backends(device)
    want = plain()
    for name in names:
        torch.testing.assert_close(ours(name)(), want)
    fns = {name: ours(name) for name in names}
    fns["torch"] = plain
    return "clip, 2000 x 1k", interleaved_medians(fns, device, rounds=rounds, inner=3)


def _step_row(device, rounds):
    names = _backends(device)
    runs = {}
    for name in names:
        params = _params(device, 96, 128 * 1024, 1)
        opt = tso.AdamW(params, lr=1e-3, max_grad_norm=1.0)

        def step(opt=opt, name=name):
            with _ops.use_backend(name):
                opt.step()
        runs[name] = (params, step)
    theirs = _params(device, 96, 128 * 1024, 1)
    torch_opt, _ = torch_adamw(theirs, lr=1e-3)

    def plain():
        torch.nn.utils.clip_grad_norm_(theirs, 1.0, foreach=True)
        torch_opt.step()

    for _, step in runs.values():
        step()
    plain()
    base = runs[names[0]][0]
    for name in names[1:]:
        for a, b in zip(runs[name][0], base):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    fns = {name: step for name, (_, step) in runs.items()}
    fns["torch"] = plain
    return "AdamW + clip step, 96 x 128k", interleaved_medians(fns, device, rounds=rounds, inner=2)


def run(device="cpu", rounds=9) -> str:
    lines = [machine_description(device), "",
             "| case | compiled (ms) | fallback (ms) | torch (ms) | fallback / compiled | "
             "fallback / torch |", "|---|---|---|---|---|---|"]
    for label, times in (_clip_row(device, rounds), _step_row(device, rounds)):
        compiled = times.get("compiled")
        fallback, plain = times["fallback"], times["torch"]
        lines.append(
            f"| {label} | {'-' if compiled is None else f'{compiled * 1e3:.2f}'} | "
            f"{fallback * 1e3:.2f} | {plain * 1e3:.2f} | "
            f"{'-' if compiled is None else f'{fallback / compiled:.2f}'} | "
            f"{fallback / plain:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = options(__doc__, argv, device="cpu", rounds=9)
    table = run(args.device, args.rounds)
    report(args, "fallback", "A device without compiled kernels (fallback)", table)


if __name__ == "__main__":
    main()
