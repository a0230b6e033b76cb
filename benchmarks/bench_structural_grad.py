"""Cost of ``ts.structural_grad`` when only part of a model is asked for.

A 12-block pre-norm transformer (d_model 256, 4 heads, MLP 1024, vocab 1000, sequence 128,
batch 8; 10.0M parameters) built here. Cases:

- (a) every parameter (``wrt=None``);
- (b) the last block, the final norm and the head;
- (c) the first block only;
- (d) naive: every gradient computed, then masked to (b)'s subset.

Each case is measured in two forms:

- **callable** ``structural_grad(model, loss_fn, wrt=...)``: the forward runs inside the call,
  with only the asked parameters requiring grad. Timed: the forward and the backward apart
  (split where the loss callable returns).
- **tensor** ``structural_grad(model, loss, wrt=...)`` with ``loss`` computed beforehand with
  every parameter requiring grad. Timed: the backward only (``torch.autograd.grad``); the
  forward is outside the timed region.

Memory, on CPU where torch keeps no allocator statistics:

- *peak*: the highest number of bytes allocated by torch ops and not yet freed, over one call
  in the callable form (forward + backward + result), relative to the start; taken from the
  ``torch.profiler`` memory records (``profile_memory=True``; an allocation counted when its op
  starts, a release when it ends);
- *saved*: the bytes autograd saved for the backward during the forward (every tensor handed to
  a ``saved_tensors_hooks`` pack hook, each storage once, parameters excluded);
- *grads*: the bytes of the returned tree.

    python -m benchmarks.bench_structural_grad [--write] [--rounds N]
"""
from __future__ import annotations

import statistics
import time

import torch
from torch import nn
from torch.nn import functional as F
from torch.profiler import ProfilerActivity, profile

import torchstruct as ts

from .common import bytes_of, machine_description, targets_line
from .results import options, report

D, HEADS, LAYERS, SEQ, BATCH, VOCAB = 256, 4, 12, 128, 8, 1000


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, D))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.pos = nn.Parameter(torch.randn(SEQ, D) * 0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


LAST = [f"blocks.{LAYERS - 1}", "ln_f", "head"]
CASES = {"(a) all": None, "(b) last block + head": LAST, "(c) first block": "blocks.0"}


NAIVE = "(d) naive: all, then masked to (b)"


def naive(model, loss, subset):
    """Every gradient, then masked: what a library without per-call masking does."""
    keep = {path for path, _ in ts.select(model, subset)}
    full = ts.tree.to_flat_dict(ts.structural_grad(model, loss))
    return ts.tree.from_flat_dict((p, g) for p, g in full.items() if p in keep)


def call(model, loss, name):
    """The measured call of case ``name``; ``loss`` a tensor or a callable."""
    if name == NAIVE:
        return naive(model, loss, LAST)
    return ts.structural_grad(model, loss, wrt=CASES[name])


def one_round(model, loss_fn, name) -> tuple[float, float, float]:
    """(callable forward, callable backward, tensor-form backward) seconds of one call each.

    Callable form: the forward's end is stamped inside the loss callable, so the call splits
    into the forward (with only the asked parameters requiring grad) and the backward.
    Tensor form: the loss is computed untimed with every parameter requiring grad.
    """
    stamp = []

    def timed_loss(m):
        loss = loss_fn(m)
        stamp.append(time.perf_counter())
        return loss

    t0 = time.perf_counter()
    call(model, timed_loss, name)
    t1 = time.perf_counter()
    loss = loss_fn(model)
    t2 = time.perf_counter()
    call(model, loss, name)
    t3 = time.perf_counter()
    return stamp[0] - t0, t1 - stamp[0], t3 - t2


def medians(model, loss_fn, rounds: int) -> dict[str, tuple[float, float, float]]:
    """Per case, the medians of :func:`one_round`; rounds interleave the cases (order rotated)."""
    names = list(CASES) + [NAIVE]
    samples = {name: [] for name in names}
    for name in names:  # warm-up
        one_round(model, loss_fn, name)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            samples[name].append(one_round(model, loss_fn, name))
    return {name: tuple(statistics.median(x) for x in zip(*s)) for name, s in samples.items()}


def peak_bytes(fn) -> int:
    """Peak bytes held by torch allocations during ``fn()``, from the profiler memory records."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    changes = []
    for e in prof.events():
        delta = e.self_cpu_memory_usage
        if delta > 0:
            changes.append((e.time_range.start, delta))
        elif delta < 0:
            changes.append((e.time_range.end, delta))
    changes.sort(key=lambda c: c[0])
    live = peak = 0
    for _, delta in changes:
        live += delta
        peak = max(peak, live)
    return peak


def saved_bytes(model, fn) -> int:
    """Bytes autograd saves during ``fn()`` (each storage once, parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def run(rounds: int = 5) -> str:
    torch.manual_seed(0)
    model = Transformer()
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1))

    def loss_fn(m):
        logits = m(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    times = medians(model, loss_fn, rounds)
    rows = []
    for name, (fwd, bwd, tensor_bwd) in times.items():
        fn = lambda name=name: call(model, loss_fn, name)  # noqa: E731
        grads = fn()
        rows.append(dict(name=name, fwd=fwd, bwd=bwd, tbwd=tensor_bwd, peak=peak_bytes(fn),
                         saved=saved_bytes(model, fn), grads=bytes_of(ts.tree.leaves(grads)),
                         leaves=len(ts.tree.paths(grads))))
    return _table(model, rows, rounds)


def _table(model, rows, rounds) -> str:
    a, mib = rows[0], 1 << 20
    n_params = sum(p.numel() for p in model.parameters())
    lines = [
        f"{machine_description()}. Model: {LAYERS}-block transformer, d_model {D}, {HEADS} heads,"
        f" vocab {VOCAB}, seq {SEQ}, batch {BATCH}, {n_params / 1e6:.1f}M parameters;"
        f" medians of {rounds} interleaved rounds.",
        "",
        "| case | leaves | backward (s) | vs (a) | forward (s) | fwd+bwd vs (a) |"
        " tensor-form backward (s) | vs (a) | peak (MiB) | vs (a) | autograd-saved (MiB) |"
        " grads (MiB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        total = (r["fwd"] + r["bwd"]) / (a["fwd"] + a["bwd"])
        lines.append(
            f"| {r['name']} | {r['leaves']} | {r['bwd']:.3f} | {r['bwd'] / a['bwd']:.2f}x |"
            f" {r['fwd']:.3f} | {total:.2f}x | {r['tbwd']:.3f} | {r['tbwd'] / a['tbwd']:.2f}x |"
            f" {r['peak'] / mib:.1f} | {r['peak'] / a['peak']:.2f}x | {r['saved'] / mib:.1f} |"
            f" {r['grads'] / mib:.1f} |"
        )
    b, c, d = rows[1], rows[2], rows[3]
    checks = [
        ("(b) backward <= 0.25x (a)", b["bwd"] <= 0.25 * a["bwd"]),
        ("(c) backward <= 0.75x (a)", c["bwd"] <= 0.75 * a["bwd"]),
        ("(b), (c) below (d) in backward time", max(b["bwd"], c["bwd"]) < d["bwd"]),
        ("(b), (c) below (d) in peak memory", max(b["peak"], c["peak"]) < d["peak"]),
    ]
    lines += [
        "",
        targets_line(checks),
        "",
        "Backward, forward: the callable form `structural_grad(model, loss_fn, wrt=...)`, split"
        " where the loss callable returns; its forward runs with only the asked parameters"
        " requiring grad. Tensor-form backward: the loss computed beforehand with every parameter"
        " requiring grad, then `structural_grad(model, loss, wrt=...)` timed. Peak: highest live"
        " bytes allocated by torch ops during one callable call (forward + backward + result),"
        " from `torch.profiler` memory records. Autograd-saved: bytes handed to"
        " `saved_tensors_hooks` during the forward, each storage once, parameters excluded."
        " Grads: bytes of the returned tree.",
    ]
    return "\n".join(lines)


def main(argv=None) -> None:
    args = options(__doc__, argv, rounds=5)
    report(args, "structural_grad", "structural_grad: asking for part of a model",
           run(args.rounds))


if __name__ == "__main__":
    main()
