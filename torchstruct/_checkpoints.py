"""Reentrant activation checkpoints (``torch.utils.checkpoint`` with ``use_reentrant=True``)
seen from the autograd graph: their backward recomputes the function and runs an inner backward
out of sight of the graph, so the parameters the function uses have no edge from the node.
Used by structural gradients and by the DDP check of blocks."""
from __future__ import annotations

import functools

from torch import nn


def is_reentrant_checkpoint(node) -> bool:
    """A custom autograd function named like a checkpoint (``torch.utils.checkpoint`` with
    ``use_reentrant=True``, and the implementations modelled on it): its backward recomputes
    the forward and runs an inner backward that writes ``.grad``, out of sight of this graph."""
    cls = getattr(node, "_forward_cls", None)
    return cls is not None and "checkpoint" in cls.__name__.lower()


def modules_behind(fn, depth: int = 4):
    """The modules a checkpointed function is bound to, as far as they can be seen: a module,
    a bound method's object, a partial's function and arguments, a closure's cells, lists."""
    if depth < 0:
        return
    if isinstance(fn, nn.Module):
        yield fn
    elif isinstance(fn, (list, tuple)):
        for f in fn:
            yield from modules_behind(f, depth - 1)
    elif isinstance(fn, functools.partial):
        for f in (fn.func, *fn.args, *fn.keywords.values()):
            yield from modules_behind(f, depth - 1)
    elif callable(fn):
        yield from modules_behind(getattr(fn, "__self__", None), depth - 1)
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                yield from modules_behind(cell.cell_contents, depth - 1)
            except ValueError:  # an empty cell
                pass
