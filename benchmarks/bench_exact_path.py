"""Cost of ``ts.structural_grad``'s exact path: a model with reentrant activation checkpoints.

A reentrant checkpoint (``use_reentrant=True``) refuses ``torch.autograd.grad``, so
``structural_grad`` runs a real backward, switching off what is not asked, saving and restoring
every ``.grad`` it could touch, watching each recomputation (nested checkpoints, hooks) before
its inner backward. This measures that machinery against PyTorch's own step on the same model:
the 12-block transformer of ``bench_structural_grad`` (10.0M parameters), each block in a
reentrant checkpoint. Cases, each one whole call (forward and backward):

- (p) PyTorch: ``loss_fn(model).backward()``, the ``.grad`` fields read and cleared;
- (a) ``structural_grad(model, loss_fn)``: every parameter;
- (b) ``structural_grad(model, loss_fn, wrt=...)``: the last block, the final norm and the head
  (the forward runs with only those requiring grad; the embedding's output is made to require
  grad, as HF's ``enable_input_require_grads`` does, so every checkpoint still records and is
  recomputed, its weight gradients skipped);
- (t) tensor form, every parameter: the loss computed untimed, then ``structural_grad(model,
  loss)`` timed, against ``loss.backward()`` timed the same way.

    python -m benchmarks.bench_exact_path [--write] [--rounds N]
"""
from __future__ import annotations

import statistics
import time

import torch
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

import torchstruct as ts

from .bench_structural_grad import BATCH, LAST, SEQ, VOCAB, Transformer
from .common import machine_description, targets_line
from .results import options, report


class Checkpointed(Transformer):
    """The same transformer, each block in a reentrant checkpoint; the embedding's output
    made to require grad when it does not (as HF's ``enable_input_require_grads``), so that
    every checkpoint records whatever part is trained."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens) + self.pos
        if not x.requires_grad:
            x.requires_grad_()
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=True)
        return self.head(self.ln_f(x))


def _torch_step(model, loss_fn) -> dict:
    loss_fn(model).backward()
    grads = {path: p.grad for path, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None
    return grads


CASES = {
    "(p) PyTorch: loss.backward(), .grad read": _torch_step,
    "(a) structural_grad, every parameter": lambda m, f: ts.structural_grad(m, f),
    "(b) structural_grad, last block + head": lambda m, f: ts.structural_grad(m, f, wrt=LAST),
}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _tensor_round(model, loss_fn) -> tuple[float, float]:
    """(structural_grad, .backward()) seconds of the backward of a loss computed untimed."""
    loss = loss_fn(model)
    ours = _timed(lambda: ts.structural_grad(model, loss))
    loss = loss_fn(model)
    theirs = _timed(loss.backward)
    for p in model.parameters():
        p.grad = None
    return ours, theirs


def run(rounds: int = 5) -> str:
    torch.manual_seed(0)
    model = Checkpointed()
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1))

    def loss_fn(m):
        logits = m(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    ref = _torch_step(model, loss_fn)
    got = ts.tree.to_flat_dict(ts.structural_grad(model, loss_fn))
    assert all(torch.equal(got[k], ref[k]) for k in got), "the exact path differs from backward"
    names = list(CASES)
    samples = {name: [] for name in names}
    tensor = []
    for name in names:  # warm-up
        CASES[name](model, loss_fn)
    for r in range(rounds):  # interleaved, order rotated
        for name in names[r % len(names):] + names[: r % len(names)]:
            samples[name].append(_timed(lambda name=name: CASES[name](model, loss_fn)))
        tensor.append(_tensor_round(model, loss_fn))
    med = {name: statistics.median(s) for name, s in samples.items()}
    t_ours, t_theirs = (statistics.median(x) for x in zip(*tensor))
    p = med[names[0]]
    n_params = sum(q.numel() for q in model.parameters())
    lines = [
        f"{machine_description()}. Model: the 12-block transformer of the structural_grad"
        f" section ({n_params / 1e6:.1f}M parameters), each block in a reentrant checkpoint;"
        f" medians of {rounds} interleaved rounds.",
        "",
        "| case | seconds (forward + backward) | vs (p) |",
        "|---|---:|---:|",
    ]
    lines += [f"| {name} | {med[name]:.3f} | {med[name] / p:.2f}x |" for name in names]
    lines += [
        f"| (t) tensor form, backward only: structural_grad vs loss.backward() |"
        f" {t_ours:.3f} vs {t_theirs:.3f} | {t_ours / t_theirs:.2f}x |",
    ]
    a, b = med[names[1]], med[names[2]]
    checks = [
        ("(a) <= 1.15x (p)", a <= 1.15 * p),
        ("(t) <= 1.15x loss.backward()", t_ours <= 1.15 * t_theirs),
        ("(b) below (a)", b < a),
    ]
    lines += [
        "",
        targets_line(checks),
        "",
        "The gradients of (a) are checked equal (torch.equal) to (p)'s before timing. (p) includes"
        " reading and clearing the .grad fields; (a) and (b) include building the tree and"
        " putting back every flag and .grad.",
    ]
    return "\n".join(lines)


def main(argv=None) -> None:
    args = options(__doc__, argv, rounds=5)
    report(args, "exact_path", "structural_grad through reentrant checkpoints (exact path)",
           run(args.rounds))


if __name__ == "__main__":
    main()
