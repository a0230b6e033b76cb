"""Gradual unfreezing of a small transformer with torchstruct, side by side with plain PyTorch.

A teacher transformer labels random token sequences (nothing is downloaded) and a student with
the same architecture learns them in four stages; each stage adds a part to what trains:

1. ``head``         the classification head;
2. ``last blocks``  the last two encoder blocks;
3. ``adapters``     low-rank (LoRA-style) adapters around the feed-forward layers of the other
                    blocks; the adapter class declares what trains (``trainable()``), so the
                    weights it wraps stay frozen;
4. ``new tokens``   new embedding rows (tokens the teacher reads as old ones); an element mask
                    keeps the old rows, and their moments, bitwise unchanged.

With torchstruct the run has **one optimizer for all stages**: ``ts.optim.AdamW`` over
``ts.param_groups`` (no weight decay on biases and norms, timm's layer decay as ``lr_scale``, a
higher rate for the embedding), the global-norm clip folded into the update, the new rows by
``masks=``; a ``LambdaLR`` sets each stage's rate (the ratios survive it), and a
``ts.UnfreezeSchedule`` switches the stages. A step takes the gradient tree of the trainable part
with ``ts.structural_grad``; an EMA copy follows with ``ts.polyak_update`` and is evaluated in
place with ``ts.swap``. At the end a trainable-only checkpoint (``ts.state_dict``) is written,
loaded into a fresh copy of the starting model, and checked to reproduce the held-out loss;
its size is reported against the full ``state_dict``. After each stage every frozen parameter
and every masked-out embedding row is checked to be bitwise unchanged.

The same run is then repeated in plain PyTorch, the way it is written by hand today: flags set
with ``requires_grad_`` and the optimizer rebuilt at each stage over hand-made groups (its
moments start over), ``torch.nn.utils.clip_grad_norm_`` and ``torch.optim.AdamW(fused=True)``
(``foreach`` where no fused kernel exists), EMA and row masking by hand. Each run goes in a fresh
process: a short first pass (a few steps per stage) measures peak memory (CUDA's allocator
statistics on a GPU, the peak RSS on the CPU), then the full run is timed. A report compares
time, peak memory and losses, and the loss curves are drawn into a PNG when matplotlib is
installed. The exit code is non-zero when a check fails.

    bash run.sh example                              # from the repository root
    python examples/finetune.py --steps 40 --plot /tmp/losses.png
    python examples/finetune.py --no-compare         # the torchstruct run only, in this process
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import functools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

import torchstruct as ts

VOCAB = 64  # the teacher's vocabulary
NEW_TOKENS = 8  # added in the last stage; token VOCAB + k means what token k means
LAST_BLOCKS = 2  # how many encoder blocks train in stage 2
HELD_OUT = 256  # held-out sequences per stage
WEIGHT_DECAY = 0.01
LOSS = nn.CrossEntropyLoss()
RECIPES = ("torchstruct", "plain PyTorch")


# --------------------------------------------------------------------------- model and data
class TinyTransformer(nn.Module):
    """Embedding, a stack of encoder blocks, a final norm and a classification head."""

    def __init__(self, vocab: int = VOCAB, dim: int = 64, heads: int = 4, blocks: int = 4,
                 classes: int = 8):
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


class LowRankAdapter(nn.Module):
    """``base(x) + up @ down @ x``: a linear layer plus a trainable low-rank update.

    ``up`` starts at zero, so adding the adapter does not change what the model computes.
    """

    def __init__(self, base: nn.Linear, rank: int, generator: torch.Generator):
        super().__init__()
        self.base = base
        device = base.weight.device
        down = torch.randn(rank, base.in_features, generator=generator) / base.in_features**0.5
        self.down = nn.Parameter(down.to(device))
        self.up = nn.Parameter(torch.zeros(base.out_features, rank, device=device))

    def trainable(self):
        """What trains inside an adapter: its own factors; ``base`` stays frozen."""
        return ("down", "up")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.down), self.up)


def add_adapters(model: TinyTransformer, rank: int, seed: int) -> None:
    """Wrap both feed-forward layers of every block but the last ``LAST_BLOCKS`` (which train
    whole in stage 2) in a :class:`LowRankAdapter`."""
    generator = torch.Generator().manual_seed(seed)
    for block in model.blocks[:-LAST_BLOCKS]:
        block.linear1 = LowRankAdapter(block.linear1, rank, generator)
        block.linear2 = LowRankAdapter(block.linear2, rank, generator)


def adapters(model: nn.Module) -> list[LowRankAdapter]:
    return [m for m in model.modules() if isinstance(m, LowRankAdapter)]


def make_student(args) -> TinyTransformer:
    """The student: ``NEW_TOKENS`` more embedding rows than the teacher (unused, and masked
    out of every update, until the last stage), adapters in place from the start (their ``up``
    factor is zero: they change nothing until they train)."""
    student = TinyTransformer(vocab=VOCAB + NEW_TOKENS)
    add_adapters(student, args.rank, args.seed + 10)
    return student


@dataclass(frozen=True)
class Stage:
    number: int
    name: str
    steps: int
    lr: float


# (name, share of --steps, multiple of --lr) of each stage
STAGE_PLAN = (("head", 1.0, 3.0), ("last blocks", 1.0, 1.0), ("adapters", 1.0, 1.0),
              ("new tokens", 0.5, 1.0))
NEW_ROWS_LR_SCALE = 10.0  # the new embedding rows learn from scratch


def plan_stages(args) -> list[Stage]:
    return [Stage(i, name, max(1, round(share * args.steps)), scale * args.lr)
            for i, (name, share, scale) in enumerate(STAGE_PLAN, 1)]


def random_tokens(count: int, length: int, new_tokens: bool, generator: torch.Generator):
    tokens = torch.randint(0, VOCAB, (count, length), generator=generator)
    if new_tokens:  # half of the positions get one of the new tokens
        new = torch.randint(VOCAB, VOCAB + NEW_TOKENS, (count, length), generator=generator)
        tokens = torch.where(torch.rand(count, length, generator=generator) < 0.5, new, tokens)
    return tokens


@torch.no_grad()
def teacher_labels(teacher: nn.Module, tokens: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """The teacher's class for each sequence; it reads a new token as the old one it stands for."""
    old_ids = torch.where(tokens >= VOCAB, tokens - VOCAB, tokens)
    return torch.cat([teacher(part).argmax(dim=-1) for part in old_ids.split(chunk)])


def labelled(teacher: nn.Module, count: int, length: int, new_tokens: bool, generator, device):
    tokens = random_tokens(count, length, new_tokens, generator).to(device)
    return tokens, teacher_labels(teacher, tokens)


def make_data(teacher: nn.Module, stages: list[Stage], args, device) -> dict:
    """For each stage: its training batches and a held-out set, all made before training.

    Stages 1-3 share one held-out set; the last one has its own, with new tokens in it.
    """
    generator = torch.Generator().manual_seed(args.seed + 1)
    held_out = {new: labelled(teacher, HELD_OUT, args.length, new, generator, device)
                for new in (False, True)}
    data = {}
    for stage in stages:
        new = stage.name == "new tokens"
        tokens, labels = labelled(teacher, stage.steps * args.batch, args.length, new, generator,
                                  device)
        batches = list(zip(tokens.split(args.batch), labels.split(args.batch)))
        data[stage.name] = (batches, held_out[new])
    return data


# --------------------------------------------------------------------------- the two recipes
def trained_selectors(model: TinyTransformer, stage: Stage) -> list[str]:
    """What starts training at a stage (cumulative: earlier stages keep training)."""
    last = [f"blocks.{i}" for i in range(len(model.blocks))][-LAST_BLOCKS:]
    return {
        "head": ["head"],
        "last blocks": last,
        # the adapters' factors; each adapter's trainable() keeps its base frozen anyway
        "adapters": ["*.down", "*.up"],
        "new tokens": ["embed"],  # with a mask: only the new rows
    }[stage.name]


def new_rows_mask(model: TinyTransformer) -> torch.Tensor:
    mask = torch.zeros_like(model.embed.weight, dtype=torch.bool)
    mask[VOCAB:] = True
    return mask


def stage_at(stages: list[Stage], steps: list[int], step: int) -> Stage:
    """The stage that step ``step`` (0-based, over the whole run) belongs to."""
    for stage, start in zip(reversed(stages), reversed(starts(steps))):
        if step >= start:
            return stage
    return stages[0]


def starts(steps: list[int]) -> list[int]:
    """The first step of each stage, given the number of steps of each."""
    return [sum(steps[:i]) for i in range(len(steps))]


class TorchstructRun:
    """The whole run the torchstruct way: one optimizer over ``ts.param_groups`` (no decay on
    biases and norms, layer decay as ``lr_scale``), the stages driven by a
    ``ts.UnfreezeSchedule``, an LR scheduler for each stage's rate, structural gradients, the
    clip folded into AdamW, ``polyak_update`` and ``swap``, a trainable-only checkpoint."""

    def __init__(self, model: TinyTransformer, stages: list[Stage], steps: list[int], args):
        self.model, self.args = model, args
        self.ema = copy.deepcopy(model)  # a plain copy: every parameter follows the model's
        milestones = {start: trained_selectors(model, stage)
                      for stage, start in zip(stages, starts(steps))}
        self.milestones = milestones
        self.schedule = ts.UnfreezeSchedule(model, milestones)
        groups = ts.param_groups(  # the first rule that selects a parameter wins
            model, ("embed", {"lr_scale": NEW_ROWS_LR_SCALE, "name": "embedding"}),
            *ts.layer_decay(model, args.layer_decay, layers="blocks"), weight_decay=WEIGHT_DECAY)
        self.optimizer = ts.optim.AdamW(groups, lr=args.lr, max_grad_norm=args.clip,
                                        masks={model.embed.weight: new_rows_mask(model)})
        rate = {stage.name: stage.lr / args.lr for stage in stages}
        self.lr = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: rate[stage_at(stages, steps, step).name])

    def start_stage(self, stage: Stage) -> None:
        """Nothing to do: the schedule changed the flags at the stage's first step."""

    def step(self, loss: torch.Tensor) -> torch.Tensor:
        """Gradients of the trainable part only, one fused clip + AdamW pass; the grad norm."""
        for path, grad in ts.tree.to_flat_dict(ts.structural_grad(self.model, loss)).items():
            self.model.get_parameter(path).grad = grad
        self.optimizer.step()
        self.lr.step()
        self.schedule.step()
        return self.optimizer.last_grad_norm

    def update_ema(self) -> None:
        ts.polyak_update(self.ema, self.model, tau=self.args.ema)

    def ema_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        with ts.swap(self.model, ts.tree.from_module(self.ema)):  # EMA weights stand in, in place
            return self.model(tokens)

    def checkpoint(self, fresh: TinyTransformer, held_out) -> dict:
        """Save what training changed, load it into a fresh copy of the starting model (its
        schedule resumed at the last step), and check that it reproduces the held-out loss."""
        with tempfile.TemporaryDirectory() as tmp:
            small, full = os.path.join(tmp, "trainable.pt"), os.path.join(tmp, "full.pt")
            torch.save(ts.state_dict(self.model), small)
            torch.save(self.model.state_dict(), full)
            schedule = ts.UnfreezeSchedule(fresh, self.milestones)
            schedule.load_state_dict(self.schedule.state_dict())  # the same parts train
            ts.load_state_dict(fresh, torch.load(small))
            sizes = os.path.getsize(small), os.path.getsize(full)
        want, got = held_out_loss(self.model, held_out), held_out_loss(fresh, held_out)
        return dict(bytes=sizes[0], full_bytes=sizes[1], loss=want, reloaded_loss=got,
                    keys=len(ts.state_dict(self.model)))


@functools.lru_cache(maxsize=None)
def fused_adamw_available(device_type: str) -> bool:
    """Whether ``torch.optim.AdamW(fused=True)`` has kernels here (it says so at its first step)."""
    probe = nn.Parameter(torch.zeros(1, device=device_type))
    probe.grad = torch.zeros_like(probe)
    try:
        torch.optim.AdamW([probe], fused=True).step()
    except RuntimeError:
        return False
    return True


def plain_groups(model: TinyTransformer, lr: float, decay: float) -> list[dict]:
    """Param groups as written by hand today: a layer id from each name, lr scaled by
    ``decay ** (L + 1 - id)``, no weight decay for biases and norm weights."""
    blocks = len(model.blocks)
    groups = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        parts = name.split(".")
        layer = 0 if parts[0] == "embed" else int(parts[1]) + 1 if parts[0] == "blocks" else blocks + 1
        scale = NEW_ROWS_LR_SCALE if parts[0] == "embed" else decay ** (blocks + 1 - layer)
        no_decay = name.endswith("bias") or "norm" in name
        key = (layer, no_decay)
        if key not in groups:
            groups[key] = {"params": [], "lr": lr * scale,
                           "weight_decay": 0.0 if no_decay else WEIGHT_DECAY}
        groups[key]["params"].append(p)
    return list(groups.values())


class PlainRun:
    """The same run by hand: ``requires_grad_`` at each stage, the optimizer rebuilt over
    hand-made groups, backward, ``clip_grad_norm_`` + torch's AdamW, EMA with a foreach lerp,
    the old embedding rows put back after each step, evaluation with ``functional_call``."""

    def __init__(self, model: TinyTransformer, stages: list[Stage], steps: list[int], args):
        self.model, self.stages, self.args = model, stages, args
        self.ema = copy.deepcopy(model)
        self.selected: list[str] = []

    def start_stage(self, stage: Stage) -> None:
        model = self.model
        self.selected += trained_selectors(model, stage)
        model.requires_grad_(False)
        for name, p in model.named_parameters():
            parts = name.split(".")
            picked = any(name.startswith(s + ".") or (s.startswith("*.") and parts[-1] == s[2:])
                         for s in self.selected)
            adapter_base = ".base." in f".{name}"
            p.requires_grad_(picked and not adapter_base)
        groups = plain_groups(model, stage.lr, self.args.layer_decay)
        self.params = [p for g in groups for p in g["params"]]
        kind = {"fused": True} if fused_adamw_available(self.params[0].device.type) else {
            "foreach": True}
        self.optimizer = torch.optim.AdamW(groups, lr=stage.lr, **kind)  # moments start over
        self.ema_pairs = [(e, p) for e, p in zip(self.ema.parameters(), model.parameters())]
        self.old_rows = (model.embed.weight[:VOCAB].detach().clone()
                         if stage.name == "new tokens" else None)

    def step(self, loss: torch.Tensor) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.args.clip)
        self.optimizer.step()
        if self.old_rows is not None:
            with torch.no_grad():
                self.model.embed.weight[:VOCAB] = self.old_rows
        return norm

    @torch.no_grad()
    def update_ema(self) -> None:
        targets, sources = zip(*self.ema_pairs)
        torch._foreach_lerp_(list(targets), list(sources), self.args.ema)

    def ema_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(self.model, dict(self.ema.named_parameters()), (tokens,))

    def checkpoint(self, fresh, held_out) -> None:
        return None


RUNS = {"torchstruct": TorchstructRun, "plain PyTorch": PlainRun}


# --------------------------------------------------------------------------- progress bar
class Progress:
    """A one-line progress bar: redrawn with ``\\r`` on a terminal (cut to its width); on a pipe
    or a log file, a plain line every ``total / lines`` steps. ``close`` replaces it with a
    summary line."""

    def __init__(self, label: str, total: int, tty: bool, width: int = 16, lines: int = 4):
        self.label, self.total, self.tty, self.width = label, total, tty, width
        self.every = max(1, math.ceil(total / lines))
        self.columns = shutil.get_terminal_size().columns
        self.start = time.perf_counter()
        self.shown = 0  # length of the line on screen (terminal only)

    def update(self, step: int, text: str) -> None:
        rate = step / max(time.perf_counter() - self.start, 1e-9)
        if self.tty:
            done = self.width * step // self.total
            bar = "#" * done + "." * (self.width - done)
            line = f"{self.label} [{bar}] {step}/{self.total} {text} {rate:.0f} steps/s"
            self._redraw(line[: self.columns - 1])  # a wrapped line could not be redrawn
        elif step % self.every == 0 or step == self.total:
            print(f"{self.label} {step:>4}/{self.total} {text} {rate:.0f} steps/s", flush=True)

    def close(self, text: str) -> None:
        if self.tty:
            self._redraw(f"{self.label} {text}")
            print(flush=True)
        else:
            print(f"{self.label} {text}", flush=True)

    def _redraw(self, line: str) -> None:
        print("\r" + line.ljust(self.shown), end="", flush=True)
        self.shown = len(line)


class Silent(Progress):
    """No output (the short run that measures memory)."""

    def update(self, step: int, text: str) -> None:
        pass

    def close(self, text: str) -> None:
        pass


# --------------------------------------------------------------------------- training
@torch.no_grad()
def held_out_loss(logits_of, held_out) -> float:
    tokens, labels = held_out
    # The student stays in training mode (dropout is 0): eval mode would let the encoder layers
    # take PyTorch's fused inference path, which reads the wrapped linear weights directly.
    return LOSS(logits_of(tokens), labels).item()


def protected_tensors(model: nn.Module, stage: Stage) -> dict[str, tuple]:
    """What must not change in a stage (frozen parameters, the old embedding rows): for each, the
    live tensor and a copy on the CPU."""
    views = {path: p for path, p in model.named_parameters() if not p.requires_grad}
    if stage.name == "new tokens":
        views[f"embed.weight[:{VOCAB}]"] = model.embed.weight[:VOCAB]
    return {path: (view, view.detach().to("cpu", copy=True)) for path, view in views.items()}


def changed_tensors(protected: dict) -> list[str]:
    return [path for path, (view, before) in protected.items()
            if not torch.equal(view.detach().cpu(), before)]


def train_stage(recipe: str, run, model: nn.Module, stage: Stage, data, args,
                progress=Progress) -> dict:
    """Train one stage with one recipe's run; returns its losses, timings and check results."""
    batches, held_out = data
    start = time.perf_counter()
    run.start_stage(stage)
    protected = protected_tensors(model, stage)
    trainable = (sum(p.numel() for p in model.parameters())  # elements that may change
                 - sum(before.numel() for _, before in protected.values()))
    before = held_out_loss(model, held_out)
    label = f"{recipe:<13} {stage.number}/{len(STAGE_PLAN)} {stage.name:<11}"
    bar = progress(label, len(batches), args.tty)
    losses, step_seconds = [], []
    for step, (tokens, labels) in enumerate(batches, 1):
        tick = time.perf_counter()
        loss = LOSS(model(tokens), labels)
        grad_norm = run.step(loss)
        run.update_ema()
        losses.append(loss.item())  # waits for the device: the step is done
        step_seconds.append(time.perf_counter() - tick)
        bar.update(step, f"loss {losses[-1]:.4f} grad norm {grad_norm.item():7.4f}")
    after, ema = held_out_loss(model, held_out), held_out_loss(run.ema_logits, held_out)
    changed = changed_tensors(protected)
    seconds = time.perf_counter() - start
    bar.close(f"held-out loss {before:.4f} -> {after:.4f} (EMA {ema:.4f}); frozen tensors "
              f"bitwise unchanged: {len(protected) - len(changed)} of {len(protected)}")
    return dict(name=stage.name, trainable=trainable, losses=losses, held_out=[before, after],
                ema=ema, seconds=seconds, step_seconds=step_seconds, protected=len(protected),
                changed=changed)


def train_all_stages(recipe: str, model: nn.Module, data: dict, args, progress=Progress,
                     steps: int | None = None, fresh: nn.Module | None = None):
    """The staged fine-tuning, one run object for all stages; ``steps`` cuts every stage short.
    With ``fresh`` (a copy of the starting model), the run's checkpoint is checked at the end.
    Returns the stages' results and the checkpoint's (or None)."""
    stages = plan_stages(args)
    counts = [len(data[stage.name][0][:steps]) for stage in stages]
    run = RUNS[recipe](model, stages, counts, args)
    results = []
    for stage in stages:
        batches, held_out = data[stage.name]
        results.append(train_stage(recipe, run, model, stage, (batches[:steps], held_out), args,
                                   progress))
    checkpoint = None if fresh is None else run.checkpoint(fresh, data[stages[-1].name][1])
    return results, checkpoint


# --------------------------------------------------------------------------- measuring
MEMORY_STEPS = 3  # steps per stage of the short run that measures memory; a stage's memory
#                   peaks at its first step (optimizer state, EMA copy and one step's activations)


class PeakMemory:
    """Peak memory above the level at ``start()``: the CUDA allocator's statistics on a GPU; on
    the CPU, which has none, the peak RSS of this process above its RSS at ``start()``."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
        else:
            self.baseline = self.resident_bytes()

    def peak(self) -> int:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self.baseline
        return self.peak_resident_bytes() - self.baseline

    def method(self, fresh_process: bool, tuned_heap: bool) -> str:
        run = f"a first run of {MEMORY_STEPS} steps per stage"
        if self.cuda:
            return f"torch.cuda.max_memory_allocated above the allocation before training; {run}"
        where = "each run in a fresh process" if fresh_process else "in this process"
        heap = ", glibc's mmap threshold at 64 KiB" if tuned_heap else ""
        return (f"peak RSS (getrusage ru_maxrss) above the RSS right before training; {run}, "
                f"{where}{heap}")

    @classmethod
    def resident_bytes(cls) -> int:
        """The RSS now (Linux); elsewhere the peak so far."""
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            return cls.peak_resident_bytes()

    @staticmethod
    def peak_resident_bytes() -> int:
        import resource  # Unix only

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, else KiB


def set_mmap_threshold(nbytes: int) -> bool:
    """glibc only: blocks of ``nbytes`` or more get pages of their own, given back when freed.

    At 64 KiB the RSS follows the tensors alive, so two runs' peaks compare (glibc's default,
    adaptive threshold keeps freed memory in the heap, and one run's peak RSS varies by tens of
    MiB). It costs a system call per large tensor, so the timed run goes back to the heap.
    """
    try:
        return ctypes.CDLL(None).mallopt(-3, nbytes) == 1  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


@contextlib.contextmanager
def cpu_threads(count: int):
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def optimizer_label(recipe: str, args) -> str:
    if recipe == "torchstruct":
        return (f"one ts.optim.AdamW(ts.param_groups(...), max_grad_norm={args.clip}) for all "
                "stages, a ts.UnfreezeSchedule and a LambdaLR")
    fused = fused_adamw_available(torch.device(args.device).type)
    return (f"clip_grad_norm_(max_norm={args.clip}) + torch.optim.AdamW("
            + ("fused=True)" if fused else "foreach=True)") + ", rebuilt at each stage")


def run_recipe(recipe: str, args, fresh_process: bool = False) -> dict:
    """Fine-tune a fresh student with one recipe: first a short run on a copy that measures peak
    memory, then the full, timed run. In a fresh process (``fresh_process``) the CPU heap is
    tuned for the memory measurement (see :func:`set_mmap_threshold`)."""
    device = torch.device(args.device)
    with cpu_threads(args.threads if device.type == "cpu" else torch.get_num_threads()):
        tuned_heap = fresh_process and device.type == "cpu" and set_mmap_threshold(64 << 10)
        torch.manual_seed(args.seed)
        teacher = TinyTransformer().to(device).eval()
        student = make_student(args).to(device)
        data = make_data(teacher, plan_stages(args), args, device)
        del teacher
        memory = PeakMemory(device)
        memory.start()
        train_all_stages(recipe, copy.deepcopy(student), data, args, Silent, MEMORY_STEPS)
        peak = memory.peak()
        if tuned_heap:
            set_mmap_threshold(32 << 20)
        fresh = copy.deepcopy(student)  # the starting model, for the checkpoint check
        stages, checkpoint = train_all_stages(recipe, student, data, args, fresh=fresh)
        threads = torch.get_num_threads()
    return dict(recipe=recipe, device=str(device), threads=threads, stages=stages,
                checkpoint=checkpoint,
                seconds=sum(s["seconds"] for s in stages), peak_bytes=peak,
                memory_method=memory.method(fresh_process, tuned_heap),
                optimizer=optimizer_label(recipe, args))


# --------------------------------------------------------------------------- child processes
def run_in_child(recipe: str, argv: list[str], args) -> dict | None:
    """Run this file for one recipe in a fresh Python process; relay its output; its result."""
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        command = [sys.executable, os.path.abspath(__file__), *argv,
                   "--child", recipe, "--result", result] + (["--tty"] if args.tty else [])
        columns = str(shutil.get_terminal_size().columns)  # the child's output is a pipe
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 env={**os.environ, "COLUMNS": columns})
        for chunk in iter(lambda: child.stdout.read1(4096), b""):
            sys.stdout.write(chunk.decode(errors="replace"))
            sys.stdout.flush()
        if child.wait() != 0:
            print(f"FAILED: the {recipe} run exited with code {child.returncode}")
            return None
        with open(result) as f:
            return json.load(f)


# --------------------------------------------------------------------------- report and plot
def passed(result: dict) -> bool:
    c = result.get("checkpoint")
    reloaded = c is None or c["reloaded_loss"] == c["loss"]
    return reloaded and not any(stage["changed"] for stage in result["stages"])


def final_loss(result: dict, kind: str) -> float:
    last = result["stages"][-1]
    return last["held_out"][1] if kind == "held-out" else last["losses"][-1]


def median_step(result: dict) -> float:
    return statistics.median(t for stage in result["stages"] for t in stage["step_seconds"])


def short_count(n: int) -> str:
    return f"{n / 1000:.1f}K" if n >= 1000 else str(n)


def print_stage_table(results: list[dict]) -> None:
    """Per stage: trainable parameters, then held-out loss before -> after (EMA after) and time."""
    print(f"{'stage':<14} {'trainable':>9}" + "".join(
        f" | {r['recipe'] + ': held-out loss (EMA)':<34} {'time':>6}" for r in results))
    for i, stage in enumerate(results[0]["stages"]):
        cells = []
        for r in results:
            s = r["stages"][i]
            loss = f"{s['held_out'][0]:.4f} -> {s['held_out'][1]:.4f} ({s['ema']:.4f})"
            cells.append(f" | {loss:<34} {s['seconds']:>4.2f} s")
        print(f"{i + 1} {stage['name']:<12} {short_count(stage['trainable']):>9}" + "".join(cells))


def print_totals(results: list[dict]) -> None:
    """Time, median step, peak memory, final losses and checks; a ratio column for two runs."""
    rows = [
        ("time, all stages", lambda r: r["seconds"], lambda v: f"{v:.2f} s"),
        ("median step", median_step, lambda v: f"{1000 * v:.2f} ms"),
        ("peak memory", lambda r: r["peak_bytes"], lambda v: f"{v / 2**20:.1f} MiB"),
        ("final held-out loss", lambda r: final_loss(r, "held-out"), lambda v: f"{v:.4f}"),
        ("final training loss", lambda r: final_loss(r, "training"), lambda v: f"{v:.4f}"),
        ("frozen-weight checks", passed, lambda v: "passed" if v else "FAILED"),
    ]
    two = len(results) == 2
    print(f"{'':<22}" + "".join(f"{r['recipe']:>16}" for r in results)
          + (f"{'torchstruct / plain':>22}" if two else ""))
    for label, value, show in rows:
        values = [value(r) for r in results]
        line = f"{label:<22}" + "".join(f"{show(v):>16}" for v in values)
        if two and label in ("time, all stages", "median step", "peak memory") and values[1] > 0:
            line += f"{values[0] / values[1]:>21.2f}x"
        if two and label == "final held-out loss":
            line += f"{100 * abs(values[0] - values[1]) / values[1]:>15.2f}% apart"
        print(line)


def print_report(results: list[dict]) -> None:
    first = results[0]
    threads = f"{first['threads']} thread" + ("s" if first["threads"] != 1 else "")
    same = "; same model, data and stages" if len(results) > 1 else ""
    print(f"\n== Report: {' vs '.join(r['recipe'] for r in results)}{same} "
          f"({first['device']}, {threads}) ==")
    print_stage_table(results)
    print()
    print_totals(results)
    print(f"peak memory: {first['memory_method']}")
    print("time: the full run that follows (a step: forward, gradients, update, EMA)")
    for r in results:
        print(f"{r['recipe']} steps with {r['optimizer']}")
    for r in results:
        c = r.get("checkpoint")
        if c:
            same = "equal" if c["reloaded_loss"] == c["loss"] else "DIFFERENT"
            print(f"{r['recipe']} trainable-only checkpoint: {c['keys']} tensors, "
                  f"{c['bytes'] / 1024:.1f} KiB vs {c['full_bytes'] / 1024:.1f} KiB for the full "
                  f"state_dict ({100 * c['bytes'] / c['full_bytes']:.1f}%); reloaded into a fresh "
                  f"model: held-out loss {c['reloaded_loss']:.6f}, {same}")


def plot_losses(results: list[dict], path: str) -> None:
    """The training loss of every step, one curve per recipe, stages marked; a PNG at ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no loss plot (pip install matplotlib to get one)")
        return
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for result, style in zip(results, ("-", "--")):
        losses = [loss for stage in result["stages"] for loss in stage["losses"]]
        ax.plot(range(1, len(losses) + 1), losses, style, linewidth=1.2, label=result["recipe"])
    start = 0
    for i, stage in enumerate(results[0]["stages"], 1):
        ax.axvline(start + 0.5, color="grey", linestyle=":", linewidth=1)
        ax.annotate(f"{i} {stage['name']}", (start + 1, 1), xycoords=("data", "axes fraction"),
                    xytext=(2, -12), textcoords="offset points", fontsize=9)
        start += len(stage["losses"])
    ax.set(xlabel="step", ylabel="training loss (cross-entropy)",
           title="Gradual unfreezing: " + " vs ".join(r["recipe"] for r in results))
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"loss curves written to {path}")


# --------------------------------------------------------------------------- command line
def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="steps per stage (the last: half)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=16, help="tokens per sequence")
    parser.add_argument("--lr", type=float, default=3e-3, help="base learning rate")
    parser.add_argument("--clip", type=float, default=1.0, help="max global gradient norm")
    parser.add_argument("--ema", type=float, default=0.1, help="EMA rate tau of polyak_update")
    parser.add_argument("--rank", type=int, default=4, help="rank of the adapters")
    parser.add_argument("--layer-decay", type=float, default=0.75,
                        help="learning-rate ratio between neighbouring blocks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads per run (a model this small runs best on one)")
    parser.add_argument("--no-compare", action="store_true",
                        help="skip the plain-PyTorch run; train with torchstruct in this process")
    parser.add_argument("--plot", default="finetune_losses.png", metavar="PATH",
                        help="where to write the loss curves (PNG); '' for none")
    # set by the parent for the runs it starts in child processes
    parser.add_argument("--child", choices=RECIPES, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--tty", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def child_main(args) -> int:
    result = run_recipe(args.child, args, fresh_process=True)
    with open(args.result, "w") as f:
        json.dump(result, f)
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        return child_main(args)
    args.tty = sys.stdout.isatty()
    print(f"torchstruct {ts.__version__} (backend {ts.backend()}), torch {torch.__version__}, "
          f"device {args.device}")
    if args.no_compare:
        results = [run_recipe("torchstruct", args)]
    else:
        results = []
        for recipe in RECIPES:
            results.append(run_in_child(recipe, argv, args))
            if results[-1] is None:
                return 1
    print_report(results)
    if args.plot:
        plot_losses(results, args.plot)
    same_stages = all(r["stages"][i]["trainable"] == s["trainable"]
                      for r in results for i, s in enumerate(results[0]["stages"]))
    ok = same_stages and all(passed(r) for r in results)
    if not same_stages:
        print("FAILED: the runs trained different numbers of parameters in some stage")
    print("OK: every frozen parameter and every masked-out embedding row is bitwise unchanged"
          if ok else "FAILED: a frozen parameter or a masked-out embedding row changed")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
