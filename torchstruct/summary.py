"""``ts.summary(model)``: the module tree with trainable/frozen marks and parameter counts.

Read-only: it asks :func:`~torchstruct.trainable_parameters` which parameters train and writes
no flag, installs no hook.

Repeated blocks are shown once: consecutive children of an ``nn.ModuleList`` or
``nn.Sequential`` whose subtrees are identical (module types, parameter names, shapes, dtypes,
marks) become one row, ``0–11: Block ×12``. That row and the rows under it count all the
repeated blocks together; the rows under it are those of the first block.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from torch import nn

from ._checks import as_int, refuse_lazy
from .declare import trainable_parameters

__all__ = ["summary", "Summary", "Row"]


@dataclass(frozen=True)
class Row:
    """One line of a summary: a module or a parameter.

    ``trainable``/``total`` count elements in the subtree, each parameter object once (a tied
    parameter counts where it first appears). ``mark`` is ``"trainable"``, ``"frozen"`` or
    ``"partial"``: for a module, whether every parameter of its subtree with elements trains,
    none does, or some do — tied parameters counted elsewhere included, so a module holding a
    frozen tied weight is never "trainable" (``"-"``: no parameter with elements); ``tied_to`` is the first path of a tied parameter seen again. ``repeat`` is
    how many identical consecutive blocks the row stands for (``path`` is the first one's);
    its counts cover all of them, and so do the counts of the rows under it (the first block's
    rows, standing for the same part of every block).
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
    repeat: int = 1


def _count(n: int) -> str:
    """Three significant digits with a unit: 999 -> '999', 999_999 -> '1M', 1.2e6 -> '1.2M'
    (trillions past 999T in full: '1,234T')."""
    if float(f"{n:.3g}") >= 1e15:
        return f"{n / 1e12:,.0f}T"
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if float(f"{n:.3g}") >= size:  # decide on the rounded value: no '1e+03K'
            return f"{n / size:.3g}{unit}"
    return str(n)


def _mark(trainable: int, total: int) -> str:
    if not total:
        return "-"
    if trainable == total:
        return "trainable"
    return "partial" if trainable else "frozen"


def _module_mark(on: bool, off: bool) -> str:
    """A module's mark from whether some parameter of its subtree trains (``on``) and whether
    some does not (``off``): tied parameters counted elsewhere included."""
    if on and off:
        return "partial"
    return "trainable" if on else ("frozen" if off else "-")


def _percent(trainable: int, total: int) -> str:
    """The trainable share with two decimals, never rounded to all or to nothing."""
    text = f"{100 * trainable / total:.2f}%" if total else "0.00%"
    if text == "100.00%" and trainable < total:
        return ">99.99%"
    if text == "0.00%" and trainable > 0:
        return "<0.01%"
    return text


@dataclass(frozen=True)
class Summary:
    """The result of :func:`summary`; ``str()`` (and the REPL) shows it as a tree.

    ``counts`` is the pair ``(trainable, total)`` of element counts (also ``trainable`` and
    ``total``); ``fraction`` their ratio.
    """

    rows: tuple[Row, ...]
    trainable: int
    total: int

    @property
    def counts(self) -> tuple[int, int]:
        """``(trainable, total)``: element counts over the whole model, tied parameters once."""
        return self.trainable, self.total

    @property
    def fraction(self) -> float:
        return self.trainable / self.total if self.total else 0.0

    def totals(self) -> str:
        return (
            f"trainable {_count(self.trainable)} of {_count(self.total)}, "
            f"{_percent(self.trainable, self.total)}"
        )

    def __str__(self) -> str:
        head = [f"{'module / parameter':<48} {'state':<10} {'trainable':>10} {'total':>10}"]
        lines = []
        for r in self.rows:
            kind = f"{r.kind} ×{r.repeat}" if r.repeat > 1 else r.kind
            label = "  " * r.depth + (f"{r.name}: {kind}" if r.name else kind)
            if r.tied_to is not None:
                lines.append(f"{label:<48} {'tied':<10} {'to ' + r.tied_to:>21}")
            else:
                lines.append(
                    f"{label:<48} {r.mark:<10} {_count(r.trainable):>10} {_count(r.total):>10}"
                )
        return "\n".join(head + lines + [self.totals()])

    __repr__ = __str__


@dataclass
class _Node:
    row: Row
    children: list[_Node] = field(default_factory=list)
    sig: object = None  # what makes two subtrees "identical" (their own names excluded)
    # some parameter of the subtree (with elements) trains / does not, tied ones included
    on: bool = False
    off: bool = False
    repeats: bool = False  # a ModuleList / Sequential, whose runs of identical blocks fold


def _tree(model: nn.Module) -> _Node:
    """The uncollapsed tree of rows, each node with its structural signature."""
    on = {id(p) for _, p in trainable_parameters(model)}
    first: dict[int, str] = {}  # id of a parameter or module -> its first path

    def states(params) -> tuple[bool, bool]:
        sized = [id(p) in on for p in params if p.numel()]
        return any(sized), not all(sized)

    def walk(mod: nn.Module, path: str, name: str, depth: int) -> _Node:
        if id(mod) in first:  # a module used twice: shown once, in full, where it first appears
            row = Row(path, name, type(mod).__name__, depth, 0, 0, "", first[id(mod)])
            return _Node(row, [], ("used twice", first[id(mod)]), *states(mod.parameters()))
        first[id(mod)] = path
        children, sigs = [], []
        trainable = total = 0
        own = [p for p in mod._parameters.values() if p is not None]
        for pname, p in mod._parameters.items():
            if p is None:
                continue
            ppath = f"{path}.{pname}" if path else pname
            refuse_lazy("summary", [(ppath, p)])  # its size is not known yet
            kind = f"{tuple(p.shape)} {str(p.dtype).replace('torch.', '')}"
            if id(p) in first:
                row = Row(ppath, pname, kind, depth + 1, 0, 0, "", first[id(p)], True)
                children.append(_Node(row, sig=("tied", first[id(p)])))
                sigs.append((pname, "tied", first[id(p)]))
                continue
            first[id(p)] = ppath
            n, t = p.numel(), (p.numel() if id(p) in on else 0)
            trainable, total = trainable + t, total + n
            row = Row(ppath, pname, kind, depth + 1, t, n, _mark(t, n), None, True)
            children.append(_Node(row, sig=(kind, row.mark)))
            sigs.append((pname, kind, row.mark))
        for cname, child in mod._modules.items():
            if child is None:
                continue
            node = walk(child, f"{path}.{cname}" if path else cname, cname, depth + 1)
            trainable, total = trainable + node.row.trainable, total + node.row.total
            children.append(node)
            sigs.append((cname, node.sig))
        on_, off_ = states(own)
        on_ = on_ or any(c.on for c in children)
        off_ = off_ or any(c.off for c in children)
        row = Row(path, name, type(mod).__name__, depth, trainable, total,
                  _module_mark(on_, off_))
        return _Node(row, children, (type(mod), tuple(sigs)), on_, off_,
                     isinstance(mod, (nn.ModuleList, nn.Sequential)))

    root = walk(model, "", "", 0)
    _fold(root, {r.tied_to for r in _rows(root, None)} - {None})
    return root


def _fold(node: _Node, referred: set[str]) -> bool:
    """Collapse the runs of identical blocks below ``node``, bottom up, except blocks showing a
    row in ``referred`` (the first path of a parameter or module met again later: every
    ``tied_to`` names a row shown); whether ``node``'s subtree shows such a row."""
    pinned = [_fold(child, referred) for child in node.children]
    if node.repeats:
        node.children = _collapse(node.children, pinned)
    return node.row.path in referred or any(pinned)


def _scaled(node: _Node, n: int) -> _Node:
    """``node``'s subtree standing for ``n`` identical copies: counts times ``n``."""
    row = replace(node.row, trainable=node.row.trainable * n, total=node.row.total * n)
    return _Node(row, [_scaled(c, n) for c in node.children], node.sig, node.on, node.off,
                 node.repeats)


def _collapse(children: list[_Node], pinned: list[bool]) -> list[_Node]:
    """Runs of consecutive child modules with equal signatures -> one node per run; a
    ``pinned`` child is never part of a run."""
    out: list[_Node] = []
    i = 0
    while i < len(children):
        j = i + 1
        while (
            j < len(children)
            and not children[i].row.is_param
            and children[i].row.tied_to is None
            and not pinned[i] and not pinned[j]
            and children[j].sig == children[i].sig
        ):
            j += 1
        if j - i == 1:
            out.append(children[i])
        else:
            head = _scaled(children[i], j - i)
            name = f"{children[i].row.name}–{children[j - 1].row.name}"
            out.append(replace(head, row=replace(head.row, name=name, repeat=j - i)))
        i = j
    return out


def _rows(node: _Node, max_depth: int | None) -> list[Row]:
    if max_depth is not None and node.row.depth > max_depth:
        return []
    return [node.row] + [r for c in node.children for r in _rows(c, max_depth)]


def summary(model: nn.Module, max_depth: int | None = None) -> Summary:
    """The module tree of ``model`` with trainable/frozen marks and counts per subtree.

    Read-only: no flag is written, no hook installed. Identical consecutive blocks of an
    ``nn.ModuleList`` / ``nn.Sequential`` are shown as one row (``h.0–11 ×12``).

    Arguments:
        model: the root module.
        max_depth: show rows down to this depth (0: the root only, 1: its children, ...);
            deeper rows are hidden, their counts still included above. ``None``: everything.

    Returns:
        A :class:`Summary`: ``rows`` (modules and parameters, depth first), ``counts`` =
        ``(trainable, total)`` element counts (tied parameters once), and ``str()`` as a
        printable tree ending in a line such as ``trainable 1.2M of 124M, 0.97%`` (a share
        that would round to 100.00% or 0.00% without being all or nothing reads ``>99.99%`` /
        ``<0.01%``).

    Raises:
        TypeError: ``model`` is not a module, or ``max_depth`` not an integer >= 0 or None.
        ValueError: a parameter is an uninitialized lazy parameter (its path named): its
            size is not known before the module's first forward.

    Example:
        >>> import torch.nn as nn, torchstruct as ts
        >>> m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1))
        >>> with ts.freeze(m, "3"):
        ...     s = ts.summary(m, max_depth=1)
        >>> s.counts
        (60, 65)
        >>> print(s)  # doctest: +NORMALIZE_WHITESPACE
        module / parameter                               state       trainable      total
        Sequential                                       partial            60         65
          0–2: Linear ×3                                 trainable          60         60
          3: Linear                                      frozen              0          5
        trainable 60 of 65, 92.31%
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"summary: expected an nn.Module, got {type(model).__name__}")
    depth = None if max_depth is None else as_int(max_depth)
    if max_depth is not None and (depth is None or depth < 0):
        raise TypeError(f"summary: max_depth must be an integer >= 0 or None, got {max_depth!r}")
    max_depth = depth
    root = _tree(model)
    return Summary(tuple(_rows(root, max_depth)), root.row.trainable, root.row.total)
