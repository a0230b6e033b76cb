"""Fine-tune a small transformer with only its head and last block trainable.

The model and data are built here (no downloads): a teacher network labels random token
sequences, and a student with the same architecture learns them. Only the student's head and
last block train (``ts.freeze_except``). Each step takes the gradient tree of the trainable part
with ``ts.structural_grad``, reports its global norm, and steps ``ts.optim.AdamW`` with the global
norm clip folded into the update; an EMA copy of the student is kept with ``ts.polyak_update``
and evaluated with ``ts.swap``. Then the vocabulary grows, and only the new embedding rows train
(``masks=``). Every frozen parameter and every masked-out element is checked to be bitwise
unchanged at the end of each stage.

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


VOCAB = 64
LOSS = nn.CrossEntropyLoss()


def synthetic_batches(teacher: nn.Module, batch: int, length: int, vocab: int, seed: int):
    """Endless batches of random token sequences labelled by ``teacher``."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        tokens = torch.randint(0, vocab, (batch, length), generator=gen)
        with torch.no_grad():
            labels = teacher(tokens).argmax(dim=-1)
        yield tokens, labels


def stage_head_and_last_block(student, teacher, args) -> bool:
    """Stage 1: only the head and the last block train; fused clip + AdamW; EMA via swap."""
    last = f"blocks.{len(student.blocks) - 1}"
    with ts.freeze_except(student, "head", last):
        print(ts.summary(student))
        frozen = {p: p.detach().clone() for p in student.parameters() if not p.requires_grad}
        trainable = dict(ts.trainable_parameters(student))
        # The global-norm clip is folded into the update: grads are read, never rewritten.
        opt = ts.optim.AdamW(trainable.values(), lr=args.lr, weight_decay=0.01, max_grad_norm=1.0)
        ema = copy.deepcopy(student)  # the EMA target: same trainable part, updated by polyak_update
        data = synthetic_batches(teacher, args.batch, args.length, VOCAB, args.seed)
        held_out = next(synthetic_batches(teacher, 256, args.length, VOCAB, args.seed + 1))

        start, losses = time.perf_counter(), []
        for step in range(1, args.steps + 1):
            tokens, labels = next(data)
            loss = LOSS(student(tokens), labels)
            grads = ts.structural_grad(student, loss)  # a tree of the trainable part only
            for path, g in ts.tree.to_flat_dict(grads).items():
                trainable[path].grad = g
            opt.step()
            ts.polyak_update(ema, student, tau=args.ema)
            losses.append(loss.item())
            rate = step / (time.perf_counter() - start)
            print(
                f"[1] step {step:4d}/{args.steps}  loss {losses[-1]:.4f}  "
                f"grad norm {ts.global_norm(grads).item():.4f}  {rate:6.1f} steps/s",
                flush=True,
            )

        with torch.no_grad():
            plain = LOSS(student(held_out[0]), held_out[1]).item()
            with ts.swap(student, ts.tree.from_module(ema)):  # evaluate the EMA weights in place
                averaged = LOSS(student(held_out[0]), held_out[1]).item()
    print(f"[1] loss {losses[0]:.4f} -> {losses[-1]:.4f}; held-out: weights {plain:.4f}, EMA {averaged:.4f}")
    changed = [p for p, before in frozen.items() if not torch.equal(before, p)]
    print(f"[1] frozen parameters: {len(frozen)}, bitwise unchanged: {len(frozen) - len(changed)}")
    return not changed


def stage_new_embedding_rows(student, teacher, args, new_rows: int = 8) -> bool:
    """Stage 2: the vocabulary grows; only the new rows of the embedding train (``masks=``)."""
    old = student.embed
    student.embed = nn.Embedding(VOCAB + new_rows, old.embedding_dim)
    with torch.no_grad():
        student.embed.weight[:VOCAB] = old.weight  # keep what was learned for the old tokens
    old_rows = student.embed.weight[:VOCAB].detach().clone()
    rest = {p: p.detach().clone() for n, p in student.named_parameters() if not n.startswith("embed")}

    # New token VOCAB + k means the same as token k: the teacher sees the old id.
    def batches():
        gen = torch.Generator().manual_seed(args.seed + 2)
        while True:
            shape = (args.batch, args.length)
            old_ids = torch.randint(0, VOCAB, shape, generator=gen)
            new_ids = torch.randint(VOCAB, VOCAB + new_rows, shape, generator=gen)
            tokens = torch.where(torch.rand(shape, generator=gen) < 0.5, new_ids, old_ids)
            with torch.no_grad():
                labels = teacher(torch.where(tokens >= VOCAB, tokens - VOCAB, tokens)).argmax(-1)
            yield tokens, labels

    with ts.freeze_except(student, "embed"):
        weight = student.embed.weight
        mask = torch.zeros_like(weight, dtype=torch.bool)
        mask[VOCAB:] = True  # only the new rows; weight decay never reaches the old ones
        opt = ts.optim.AdamW([weight], lr=10 * args.lr, weight_decay=0.01, masks={weight: mask})
        data, losses = batches(), []
        for step in range(1, args.steps // 2 + 1):
            tokens, labels = next(data)
            loss = LOSS(student(tokens), labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            print(f"[2] step {step:4d}/{args.steps // 2}  loss {losses[-1]:.4f}", flush=True)
    same_old = torch.equal(student.embed.weight[:VOCAB], old_rows)
    same_rest = all(torch.equal(before, p) for p, before in rest.items())
    print(f"[2] loss {losses[0]:.4f} -> {losses[-1]:.4f}; old embedding rows bitwise unchanged: "
          f"{same_old}; every other parameter bitwise unchanged: {same_rest}")
    return same_old and same_rest


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
    print(f"torchstruct {ts.__version__}, backend {ts.backend()}, torch {torch.__version__}")
    ok = stage_head_and_last_block(student, teacher, args)
    ok = stage_new_embedding_rows(student, teacher, args) and ok
    print("OK: every frozen parameter and every masked-out element is bitwise unchanged" if ok
          else "FAILED: a frozen parameter or a masked-out element changed")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
