"""``ts.summary(model)``: the module tree with trainable/frozen marks and parameter counts."""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .declare import trainable_parameters

__all__ = ["summary", "Summary", "Row"]


@dataclass(frozen=True)
class Row:
    """One line of a summary: a module or a parameter.

    ``trainable``/``total`` count elements in the subtree, each parameter object once (a tied
    parameter counts where it first appears). ``mark`` is ``"trainable"``, ``"frozen"`` or
    ``"partial"``; ``tied_to`` is the first path of a tied parameter seen again.
    """

    path: str
    name: str
    kind: str
    depth: int
    trainable: int
    total: int
    mark: str
    tied_to: str | None = None
    is_param: bool = False


def _count(n: int) -> str:
    """Three significant digits with a unit: 999 -> '999', 999_999 -> '1M', 1.2e6 -> '1.2M'."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if float(f"{n:.3g}") >= size:  # decide on the rounded value: no '1e+03K'
            return f"{n / size:.3g}{unit}"
    return str(n)


def _mark(trainable: int, total: int) -> str:
    if not total:
        return "-"
    if trainable == total:
        return "trainable"
    return "partial" if trainable else "frozen"


@dataclass(frozen=True)
class Summary:
    """The result of :func:`summary`; ``str()`` (and the REPL) shows it as a tree."""

    rows: tuple[Row, ...]
    trainable: int
    total: int

    @property
    def fraction(self) -> float:
        return self.trainable / self.total if self.total else 0.0

    def totals(self) -> str:
        return (
            f"trainable {_count(self.trainable)} of {_count(self.total)}, "
            f"{100 * self.fraction:.2f}%"
        )

    def __str__(self) -> str:
        head = [f"{'module / parameter':<48} {'state':<10} {'trainable':>10} {'total':>10}"]
        lines = []
        for r in self.rows:
            label = "  " * r.depth + (f"{r.name}: {r.kind}" if r.name else r.kind)
            if r.tied_to is not None:
                lines.append(f"{label:<48} {'tied':<10} {'to ' + r.tied_to:>21}")
            else:
                lines.append(
                    f"{label:<48} {r.mark:<10} {_count(r.trainable):>10} {_count(r.total):>10}"
                )
        return "\n".join(head + lines + [self.totals()])

    __repr__ = __str__


def summary(model: nn.Module) -> Summary:
    """The module tree of ``model`` with trainable/frozen marks and counts per subtree.

    Arguments:
        model: the root module (attached implicitly).

    Returns:
        A :class:`Summary`: ``rows`` (modules and parameters, depth first), ``trainable`` and
        ``total`` element counts (tied parameters once), and ``str()`` as a printable tree
        ending in a line such as ``trainable 1.2M of 124M, 0.97%``.

    Example:
        >>> import torch.nn as nn, torchstruct as ts
        >>> m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
        >>> with ts.freeze(m, "0"):
        ...     s = ts.summary(m)
        >>> s.trainable, s.total
        (5, 25)
    """
    on_ids = {id(p) for _, p in trainable_parameters(model)}  # read-only
    first: dict[int, str] = {}  # id of a parameter or module -> its first path
    rows: list[Row] = []

    def walk(mod: nn.Module, path: str, name: str, depth: int) -> tuple[int, int]:
        if id(mod) in first:  # a module used twice: shown once, in full, where it first appears
            rows.append(Row(path, name, type(mod).__name__, depth, 0, 0, "", first[id(mod)]))
            return 0, 0
        first[id(mod)] = path
        at = len(rows)
        rows.append(None)  # placeholder, filled once the subtree is counted
        trainable = total = 0
        for pname, p in mod._parameters.items():
            if p is None:
                continue
            ppath = f"{path}.{pname}" if path else pname
            kind = f"{tuple(p.shape)} {str(p.dtype).replace('torch.', '')}"
            if id(p) in first:
                rows.append(Row(ppath, pname, kind, depth + 1, 0, 0, "", first[id(p)], True))
                continue
            first[id(p)] = ppath
            on = id(p) in on_ids
            n = p.numel()
            trainable, total = trainable + (n if on else 0), total + n
            rows.append(Row(ppath, pname, kind, depth + 1, n if on else 0, n, _mark(on, 1), None, True))
        for cname, child in mod._modules.items():
            if child is None:
                continue
            t, n = walk(child, f"{path}.{cname}" if path else cname, cname, depth + 1)
            trainable, total = trainable + t, total + n
        rows[at] = Row(path, name, type(mod).__name__, depth, trainable, total, _mark(trainable, total))
        return trainable, total

    trainable, total = walk(model, "", "", 0)
    return Summary(tuple(rows), trainable, total)
