"""ts.clip_by_global_norm vs torch.nn.utils.clip_grad_norm_(foreach=True).

Cases, all in one run with interleaved medians (benchmarks/common.py):

1. 2000 parameters x 1k float32 grads (per-call and per-tensor overhead dominate);
2. the GPT-2 small parameter set (148 tensors, 124M floats, shapes from
   bench_global_norm.py): memory bound. The achieved bandwidth counts the bytes a clip
   must move at least: the grads read once for the norm, plus read and written once
   more when they are scaled. It is compared with the in-place bandwidth
   (x.mul_(1.0), read + write) measured in the same run;
3. time vs number of tensors (10 ... 10000) at a fixed total of 2^22 (~4.2M) float32
   elements, so that the growth is the per-tensor cost: a table and
   benchmarks/clip_scaling.png (matplotlib, the ``bench`` extra).

"clipping happens": max_norm = 0, so the coefficient is 0 on every call (the grads
stay exactly 0 after the first call: no decay into subnormals, and the full
read + read/write work is done each time by both libraries). "no clipping needed":
max_norm = 1e9, the coefficient is exactly 1; torch still multiplies, torchstruct's
CPU kernel skips the scale (the result is identical), reading the grads once.

    python -m benchmarks.bench_clip [--rounds 15] [--write] [--no-plot]
"""
from __future__ import annotations

import os
import pathlib

import torch
from torch.nn.utils import clip_grad_norm_

import torchstruct as ts
from torchstruct import _ops

from .bench_global_norm import gpt2_small_shapes
from .common import bytes_of, interleaved_medians, machine_description, memory_bandwidth
from .results import options, report

PLOT = pathlib.Path(__file__).with_name("clip_scaling.png")
CLIP, NO_CLIP = 0.0, 1e9


def make_params(shapes, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.empty(s, device=device))
        p.grad = torch.randn(s, generator=g).to(device)
        params.append(p)
    return params


def torch_clip(params, max_norm):
    return clip_grad_norm_(params, max_norm, foreach=True)


def ts_clip(params, max_norm):
    return ts.clip_by_global_norm(params, max_norm)


def check_same(shapes, device):
    """Both give the same norm and grads on this set (run before timing). The tolerance
    covers torch's float32 accumulation on 124M elements (~1e-3 relative, see the
    global_norm section); torchstruct accumulates in double."""
    a, b = make_params(shapes, device), make_params(shapes, device)
    na, nb = torch_clip(a, 1.0), ts_clip(b, 1.0)
    torch.testing.assert_close(nb, na, rtol=2e-3, atol=0.0)
    for x, y in zip(a, b):
        torch.testing.assert_close(y.grad, x.grad, rtol=2e-3, atol=1e-9)


def time_pair(shapes, device, max_norm, rounds, inner):
    pt, pts = make_params(shapes, device), make_params(shapes, device)
    med = interleaved_medians(
        {"torch": lambda: torch_clip(pt, max_norm), "ts": lambda: ts_clip(pts, max_norm)},
        device, rounds=rounds, inner=inner, warmup=3,
    )
    return med["torch"], med["ts"]


def main_cases(device, rounds, bandwidth):
    rows = []
    cases = [
        ("2000 × 1k fp32", [(1000,)] * 2000, 10),
        (f"GPT-2 small ({len(gpt2_small_shapes())} tensors)", gpt2_small_shapes(), 2),
    ]
    for name, shapes, inner in cases:
        check_same(shapes, device)
        nbytes = sum(4 * torch.Size(s).numel() for s in shapes)
        for label, max_norm, moved in [("clipping happens", CLIP, 3), ("no clipping needed", NO_CLIP, 1)]:
            t_torch, t_ts = time_pair(shapes, device, max_norm, rounds, inner)
            gbs = moved * nbytes / t_ts / 1e9
            rows.append(
                f"| {name}, {nbytes / 4e6:.1f}M floats | {label} | {t_torch * 1e3:.3f} | "
                f"{t_ts * 1e3:.3f} | **{t_torch / t_ts:.2f}×** | {gbs:.1f} | "
                f"{100 * gbs * 1e9 / bandwidth:.0f}% |"
            )
    return rows


SCALING_COUNTS = (10, 30, 100, 300, 1000, 3000, 10000)
SCALING_TOTAL = 1 << 22


def scaling(device, rounds):
    rows, series = [], {"torch": [], "torchstruct": []}
    for n in SCALING_COUNTS:
        size = SCALING_TOTAL // n
        shapes = [(size,)] * n
        inner = 3 if n <= 1000 else 1
        t_torch, t_ts = time_pair(shapes, device, CLIP, rounds, inner)
        series["torch"].append(t_torch)
        series["torchstruct"].append(t_ts)
        rows.append(f"| {n} | {size} | {t_torch * 1e3:.3f} | {t_ts * 1e3:.3f} | {t_torch / t_ts:.2f}× |")
    return rows, series


def plot(series, title):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): no plot")
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, values in series.items():
        ax.plot(SCALING_COUNTS, [v * 1e3 for v in values], marker="o", label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"number of tensors (total {SCALING_TOTAL / 1e6:.1f}M float32 elements)")
    ax.set_ylabel("time per clip (ms)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)
    plt.close(fig)
    return True


def run(device="cpu", rounds=15, make_plot=True):
    device = torch.device(device)
    if _ops.backend() != "compiled" or device.type not in _ops.compiled_device_types():
        raise SystemExit(
            f"the compiled backend has no {device.type} kernel (backend={_ops.backend()}, "
            f"built for {_ops.compiled_device_types()}); build the extension first"
        )
    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    description = machine_description(device)
    bandwidth = memory_bandwidth(device, kind="inplace")
    rows = main_cases(device, rounds, bandwidth)
    scale_rows, series = scaling(device, max(5, rounds // 2))
    plotted = make_plot and plot(series, f"clip by global norm, {device.type}")
    load_end = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return "\n".join([
        f"{description}; device {device.type}; norm_type 2; medians of {rounds} interleaved rounds "
        f"after warm-up; load average {load_start:.2f} at start, {load_end:.2f} at end.",
        "Baseline: `torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)`; torchstruct: "
        "`ts.clip_by_global_norm(params, max_norm)`, both on parameters with `.grad` "
        "(the Python-side `.grad` collection is timed for both). In-place memory bandwidth "
        f"(x.mul_(1.0) on 256 MB, read + write): {bandwidth / 1e9:.1f} GB/s.",
        "",
        "| case | | torch ms | torchstruct ms | torch / ts | ts GB/s (minimum bytes) | % of in-place bandwidth |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        "Minimum bytes: 4 B per element read for the norm, plus 8 B (read + write) when clipping "
        "happens. \"Clipping happens\" uses max_norm = 0 (coefficient 0 on every call); \"no "
        "clipping needed\" max_norm = 1e9 (coefficient exactly 1: torch multiplies by 1, "
        "torchstruct skips the scale, same result). The 2000 × 1k set (8 MB) fits in the "
        "last-level cache, so its GB/s can exceed the DRAM figure.",
        "",
        f"Time vs number of tensors, total fixed at {SCALING_TOTAL} float32 elements "
        f"({SCALING_TOTAL * 4 / 2**20:.0f} MiB), clipping happens, medians of "
        f"{max(5, rounds // 2)} rounds" + (f" (plot: `benchmarks/{PLOT.name}`)" if plotted else "") + ":",
        "",
        "| tensors | elements each | torch ms | torchstruct ms | torch / ts |",
        "|---|---|---|---|---|",
        *scale_rows,
    ])


def main(argv=None) -> None:
    args = options(__doc__, argv, device="cpu", rounds=15, no_plot=False)
    body = run(args.device, args.rounds, not args.no_plot)
    report(args, "clip", f"clip_by_global_norm ({torch.device(args.device).type})", body)


if __name__ == "__main__":
    main()
