"""Timing helpers shared by the benchmarks.

* ``interleaved_medians``: median per-call time of several functions, measured
  in interleaved rounds (so drift in clock speed or background load hits all of
  them alike), after a warm-up; CUDA work is timed with events.
* ``memory_bandwidth``: the machine's achievable memory bandwidth, measured in
  the same run: ``x.mul_(1.0)`` in place (reads + writes every byte) or
  ``y.copy_(x)`` on a large tensor.
* ``machine_description``: torch version, CPU model, cores / GPU, for result files.
* ``TinyGPT``, ``token_batch``, ``lm_loss``: a small GPT-like model and its data, for the
  benchmarks of whole training steps; ``torch_adamw``: torch's fused AdamW (foreach where
  fused is unsupported).
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


# ----------------------------------------------------------------------------- a small GPT
class TinyGPT(torch.nn.Module):
    """A pre-norm decoder-only transformer (GPT-2 layout, untied head), for step benchmarks.

    ``TinyGPT()`` (6 blocks, d_model 256, 4 heads, MLP 1024, vocab 4096, context 64) has 6.9M
    parameters in 78 tensors.
    """

    def __init__(self, layers: int = 6, d: int = 256, heads: int = 4, vocab: int = 4096,
                 seq: int = 64) -> None:
        super().__init__()
        nn = torch.nn
        self.heads, self.seq, self.vocab = heads, seq, vocab
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(_GPTBlock(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class _GPTBlock(torch.nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        nn = torch.nn
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads)
                   .permute(2, 0, 3, 1, 4))
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln2(x))))


def token_batch(step: int, rank: int, batch: int, seq: int, vocab: int):
    """``(inputs, targets)`` of random tokens, the same for a given ``(step, rank)``."""
    g = torch.Generator().manual_seed(1_000_003 * rank + step)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             targets.reshape(-1))


def torch_adamw(params, lr: float, **kwargs):
    """``(torch.optim.AdamW(fused=True), "fused")``, or foreach where fused is unsupported."""
    params = list(params)
    try:
        return torch.optim.AdamW(params, lr=lr, fused=True, **kwargs), "fused"
    except (RuntimeError, ValueError, TypeError):
        return torch.optim.AdamW(params, lr=lr, foreach=True, **kwargs), "foreach"


def paired_ratios(numerators, denominators):
    """``(median, first quartile, third quartile)`` of the per-round ratios ``a_i / b_i`` of two
    interleaved series: a spread that shows how much of a ratio the machine's noise can move."""
    ratios = sorted(a / b for a, b in zip(numerators, denominators))
    if len(ratios) < 2:
        return ratios[0], ratios[0], ratios[0]
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return statistics.median(ratios), q1, q3


def targets_line(checks) -> str:
    """``checks``, pairs ``(target, met)``, as one line: ``Targets: target: met; ... .``"""
    return "Targets: " + "; ".join(f"{t}: {'met' if ok else 'MISSED'}" for t, ok in checks) + "."
