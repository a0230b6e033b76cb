"""One optimizer step with global-norm clipping on the GPT-2-small parameter set.

Compared, in one run with interleaved medians (float32, random gradients):

* ``ts.optim.AdamW(max_grad_norm=1.0).step()``: one pass reads the gradients for
  the global norm, one fused pass updates parameters and moments with the clip
  coefficient applied inside (gradients never written);
* ``torch.nn.utils.clip_grad_norm_(foreach=True)`` + ``torch.optim.AdamW(fused=True).step()``:
  norm pass, a pass rewriting the gradients, then torch's fused update;
* the same ts step with ~90% of the elements frozen (all but the trailing tensors:
  the head end of the model), against the all-trainable ts step.

Bytes moved per element (float32): ts 4 (norm) + 16 read + 12 written = 32;
torch 4 (norm) + 8 (gradient rewrite) + 28 (update) = 40. The achieved bandwidth
(bytes / time) is compared with the machine's in-place bandwidth (x.mul_(1.0),
read + write) measured in the same run.

A second table: the same ``ts.optim.AdamW`` step (no clip) with the parameters in 5 param
groups of different ``lr_scale`` (as ``ts.layer_decay`` makes them) against one group
(target: <= 1.05x).

    python -m benchmarks.bench_step [--device cpu] [--rounds 9] [--write] [--lr-scale-only]
"""
from __future__ import annotations


import torch

import torchstruct.optim as tso
from torchstruct import _ops

from .bench_global_norm import gpt2_small_shapes
from .common import interleaved_medians, machine_description, memory_bandwidth
from .results import options, report

TS_BYTES_PER_ELEM = 32
TORCH_BYTES_PER_ELEM = 40


def make_params(device, seed):
    g = torch.Generator().manual_seed(seed)
    params = []
    for shape in gpt2_small_shapes():
        p = torch.nn.Parameter((torch.randn(shape, generator=g) * 0.02).to(device))
        p.grad = (torch.randn(shape, generator=g) * 1e-3).to(device)
        params.append(p)
    return params


def trailing_trainable(params, fraction):
    """The longest run of trailing tensors holding at most ``fraction`` of all elements."""
    total = sum(p.numel() for p in params)
    count, keep = 0, 0
    for p in reversed(params):
        if count + p.numel() > fraction * total:
            break
        count += p.numel()
        keep += 1
    return params[len(params) - keep:], count / total


def run(device: str = "cpu", rounds: int = 9) -> str:
    device = torch.device(device)
    if _ops.backend() != "compiled" or device.type not in _ops.compiled_device_types():
        raise SystemExit(f"the compiled backend has no {device.type} kernel "
                         f"(backend={_ops.backend()}); build the extension first")
    bandwidth = memory_bandwidth(device, kind="inplace")

    ts_params = make_params(device, 0)
    torch_params = make_params(device, 0)
    frozen_params = make_params(device, 1)
    trainable, kept = trailing_trainable(frozen_params, 0.10)
    keep = {id(p) for p in trainable}
    for p in frozen_params:
        if id(p) not in keep:
            p.requires_grad_(False)
            p.grad = None
    numel = sum(p.numel() for p in ts_params)

    ts_opt = tso.AdamW(ts_params, lr=1e-4, max_grad_norm=1.0)
    frozen_opt = tso.AdamW(frozen_params, lr=1e-4, max_grad_norm=1.0)
    torch_opt = torch.optim.AdamW(torch_params, lr=1e-4, fused=True)

    def torch_step():
        torch.nn.utils.clip_grad_norm_(torch_params, 1.0, foreach=True)
        torch_opt.step()

    fns = {
        "ts": ts_opt.step,
        "torch": torch_step,
        "ts_frozen": frozen_opt.step,
    }
    t = interleaved_medians(fns, device, rounds=rounds, inner=1, warmup=2)

    def gbs(seconds, per_elem, n=numel):
        return per_elem * n / seconds / 1e9

    lines = [
        f"Machine: {machine_description(device)}; in-place bandwidth (x.mul_(1.0), read + "
        f"write) {bandwidth / 1e9:.1f} GB/s.",
        "",
        f"GPT-2-small parameter set: {len(ts_params)} float32 tensors, {numel / 1e6:.1f}M "
        f"elements, random gradients; AdamW, clip by global norm 1.0. Medians of {rounds} "
        f"interleaved rounds.",
        "",
        "| step | time (ms) | bytes / element | GB/s | of in-place bandwidth | ratio |",
        "|---|---:|---:|---:|---:|---:|",
        f"| `clip_grad_norm_(foreach=True)` + `torch.optim.AdamW(fused=True)` | "
        f"{t['torch'] * 1e3:.1f} | {TORCH_BYTES_PER_ELEM} | "
        f"{gbs(t['torch'], TORCH_BYTES_PER_ELEM):.1f} | "
        f"{gbs(t['torch'], TORCH_BYTES_PER_ELEM) * 1e9 / bandwidth:.0%} | 1.00 |",
        f"| `ts.optim.AdamW(max_grad_norm=1.0)` | {t['ts'] * 1e3:.1f} | {TS_BYTES_PER_ELEM} | "
        f"{gbs(t['ts'], TS_BYTES_PER_ELEM):.1f} | "
        f"{gbs(t['ts'], TS_BYTES_PER_ELEM) * 1e9 / bandwidth:.0%} | "
        f"**{t['torch'] / t['ts']:.2f}× faster** |",
        f"| same, {1 - kept:.1%} of the elements frozen ({len(trainable)} trailing tensors "
        f"train) | {t['ts_frozen'] * 1e3:.1f} | {TS_BYTES_PER_ELEM} (trained only) | "
        f"{gbs(t['ts_frozen'], TS_BYTES_PER_ELEM, kept * numel):.1f} | "
        f"{gbs(t['ts_frozen'], TS_BYTES_PER_ELEM, kept * numel) * 1e9 / bandwidth:.0%} | "
        f"**{t['ts_frozen'] / t['ts']:.3f}× the all-trainable ts step** |",
        "",
        "Targets: ts ≥ 1.3× faster than torch's clip + fused step; the 90%-frozen step "
        "≤ 0.12× the all-trainable one (it skips frozen tensors entirely: no read, no state).",
    ]
    return "\n".join(lines)


def run_lr_scale(device: str = "cpu", rounds: int = 9) -> str:
    """5 param groups of different ``lr_scale`` vs one group, same parameters and gradients."""
    device = torch.device(device)
    one_params = make_params(device, 0)
    five_params = make_params(device, 0)
    numel = sum(p.numel() for p in one_params)
    one = tso.AdamW(one_params, lr=1e-4)
    k = len(five_params)
    cuts = [round(i * k / 5) for i in range(6)]
    five = tso.AdamW([{"params": five_params[a:b], "lr_scale": 0.6 ** (4 - i)}
                      for i, (a, b) in enumerate(zip(cuts, cuts[1:]))], lr=1e-4)
    t = interleaved_medians({"one": one.step, "five": five.step}, device, rounds=rounds,
                            inner=1, warmup=2)
    return "\n".join([
        f"Machine: {machine_description(device)}.",
        "",
        f"GPT-2-small parameter set ({len(one_params)} float32 tensors, {numel / 1e6:.1f}M "
        f"elements), `ts.optim.AdamW.step()` without clip. Medians of {rounds} interleaved "
        f"rounds.",
        "",
        "| param groups | time (ms) | ratio |",
        "|---|---:|---:|",
        f"| 1 group | {t['one'] * 1e3:.1f} | 1.00 |",
        f"| 5 groups, `lr_scale` 0.6⁴ … 1 | {t['five'] * 1e3:.1f} | "
        f"**{t['five'] / t['one']:.3f}×** |",
        "",
        "Target: ≤ 1.05× (one fused op call per group; the scale is folded into the lr).",
    ])


def main(argv=None) -> None:
    args = options(__doc__, argv, helps={"lr_scale_only": (
        "run only the lr_scale table (5 groups vs one)")}, device="cpu", rounds=9,
        lr_scale_only=False)
    if not args.lr_scale_only:
        report(args, "step", "Optimizer step (AdamW + global-norm clip)",
               run(args.device, args.rounds))
    report(args, "lr_scale", "Optimizer step with 5 lr_scale groups vs one",
           run_lr_scale(args.device, args.rounds))


if __name__ == "__main__":
    main()
