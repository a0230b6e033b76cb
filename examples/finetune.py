"""Fine-tune a small transformer with only its head and last block trainable.

The model and data are built here (no downloads): a teacher network labels random token
sequences, and a student with the same architecture learns them. Only the student's head and
last block train (``ts.freeze_except``). Each step takes the gradient tree of the trainable part
with ``ts.structural_grad`` and reports its global norm; an EMA copy of the student is kept with
``ts.polyak_update`` and evaluated with ``ts.swap``. At the end every frozen parameter is checked
to be bitwise unchanged.

    bash run.sh example            # or: python examples/finetune.py --steps 40
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
from torch import nn

import torchstruct as ts


class TinyTransformer(nn.Module):
    """Embedding, a stack of encoder blocks, a final norm and a classification head."""

    def __init__(self, vocab: int = 64, dim: int = 64, heads: int = 4, blocks: int = 4, classes: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True)
            for _ in range(blocks)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(dim=1))


def synthetic_batches(teacher: nn.Module, batch: int, length: int, vocab: int, seed: int):
    """Endless batches of random token sequences labelled by ``teacher``."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        tokens = torch.randint(0, vocab, (batch, length), generator=gen)
        with torch.no_grad():
            labels = teacher(tokens).argmax(dim=-1)
        yield tokens, labels


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ema", type=float, default=0.1, help="EMA rate tau of polyak_update")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    teacher, student = TinyTransformer().eval(), TinyTransformer()
    last = f"blocks.{len(student.blocks) - 1}"

    # Only the head and the last block train: permanent for this run (a bare call).
    ts.freeze_except(student, "head", last)
    print(ts.summary(student))

    frozen = {path: p.detach().clone() for path, p in student.named_parameters() if not p.requires_grad}
    trainable = dict(ts.trainable_parameters(student))
    opt = torch.optim.AdamW(trainable.values(), lr=args.lr, weight_decay=0.01)
    ema = copy.deepcopy(student)  # the EMA target: same trainable part, updated by polyak_update
    loss_fn = nn.CrossEntropyLoss()
    data = synthetic_batches(teacher, args.batch, args.length, 64, args.seed)
    held_out = next(synthetic_batches(teacher, 256, args.length, 64, args.seed + 1))

    start = time.perf_counter()
    first_loss = None
    for step in range(1, args.steps + 1):
        tokens, labels = next(data)
        loss = loss_fn(student(tokens), labels)
        grads = ts.structural_grad(student, loss)  # a tree of the trainable part only
        for path, g in ts.tree.to_flat_dict(grads).items():
            trainable[path].grad = g
        opt.step()
        ts.polyak_update(ema, student, tau=args.ema)
        first_loss = loss.item() if first_loss is None else first_loss
        rate = step / (time.perf_counter() - start)
        print(
            f"step {step:4d}/{args.steps}  loss {loss.item():.4f}  "
            f"grad norm {ts.global_norm(grads).item():.4f}  {rate:6.1f} steps/s",
            flush=True,
        )

    with torch.no_grad():
        plain = loss_fn(student(held_out[0]), held_out[1]).item()
        with ts.swap(student, ts.tree.from_module(ema)):  # evaluate the EMA weights in place
            averaged = loss_fn(student(held_out[0]), held_out[1]).item()
    print(f"held-out loss: weights {plain:.4f}, EMA weights {averaged:.4f}")

    changed = [path for path, before in frozen.items() if not torch.equal(before, student.get_parameter(path))]
    untouched = [p for p in student.parameters() if not p.requires_grad and p.grad is not None]
    print(f"loss {first_loss:.4f} -> {loss.item():.4f}")
    print(f"frozen parameters: {len(frozen)}, bitwise unchanged: {len(frozen) - len(changed)}")
    if changed or untouched:
        print("FAILED: frozen parameters changed or received gradients:", changed)
        return 1
    print("OK: every frozen parameter is bitwise unchanged")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
