"""Timing helpers shared by the benchmarks.

* ``interleaved_medians``: median per-call time of several functions, measured
  in interleaved rounds (so drift in clock speed or background load hits all of
  them alike), after a warm-up; CUDA work is timed with events.
* ``memory_bandwidth``: the machine's achievable memory bandwidth, measured in
  the same run: ``x.mul_(1.0)`` in place (reads + writes every byte) or
  ``y.copy_(x)`` on a large tensor.
* ``machine_description``: torch version, CPU model, cores / GPU, for result files.
"""
from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Callable, Dict, Mapping

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_once(fn: Callable[[], object], device: torch.device, inner: int = 1) -> float:
    """Seconds per call of ``fn`` averaged over ``inner`` back-to-back calls."""
    device = torch.device(device)
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / inner
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def interleaved_medians(
    fns: Mapping[str, Callable[[], object]],
    device="cpu",
    rounds: int = 15,
    inner: int = 5,
    warmup: int = 3,
) -> Dict[str, float]:
    """Median seconds per call of each function; rounds alternate between them."""
    device = torch.device(device)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    _sync(device)
    samples: Dict[str, list] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(time_once(fn, device, inner))
    return {name: statistics.median(values) for name, values in samples.items()}


def median_time(fn: Callable[[], object], device="cpu", rounds: int = 15, inner: int = 5,
                warmup: int = 3) -> float:
    """Median seconds per call of one function."""
    return interleaved_medians({"fn": fn}, device, rounds, inner, warmup)["fn"]


def memory_bandwidth(device="cpu", nbytes: int = 256 << 20, kind: str = "inplace",
                     rounds: int = 9) -> float:
    """Achievable memory bandwidth in bytes/s, counting bytes read + written.

    ``kind="inplace"``: ``x.mul_(1.0)`` on an ``nbytes`` float32 tensor (2 * nbytes
    per call). ``kind="copy"``: ``y.copy_(x)`` between two such tensors.
    """
    device = torch.device(device)
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    if kind == "inplace":
        fn = lambda: x.mul_(1.0)  # noqa: E731
    elif kind == "copy":
        y = torch.empty_like(x)
        fn = lambda: y.copy_(x)  # noqa: E731
    else:
        raise ValueError(f"kind must be 'inplace' or 'copy', got {kind!r}")
    seconds = median_time(fn, device, rounds=rounds, inner=2, warmup=2)
    return 2 * x.numel() * x.element_size() / seconds


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_description(device="cpu") -> str:
    device = torch.device(device)
    cores = os.cpu_count()
    text = (f"torch {torch.__version__}, {cpu_model()}, {cores} cores, "
            f"{torch.get_num_threads()} intra-op threads")
    if device.type == "cuda":
        text += f", GPU {torch.cuda.get_device_name(device)}"
    if hasattr(os, "getloadavg"):
        text += f", load average {os.getloadavg()[0]:.1f} at start"
    return text


def bytes_of(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
