"""What a suspicious user compares: the flags PyTorch sees and torchstruct's reads."""
import pytest
import torch

import torchstruct as ts

TORCH = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
"""(major, minor) of the torch the tests run on, read here independently of torchstruct."""


def _apply_takes_keywords() -> bool:
    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b=None):
            return a.clone()

        @staticmethod
        def backward(ctx, g):
            return g, None

    try:
        Probe.apply(torch.ones(1), b=None)
    except TypeError:  # torch 2.4: "apply() takes no keyword arguments"
        return False
    return True


def fold(start, paths, active):
    """Brute force of the contract: the flags that ``active`` = [(kind, selector)], outermost
    first (the innermost wins), gives parameters at ``paths`` whose starting flags are
    ``start``. A selector is a path or module prefix, or None for the whole model."""
    cur = list(start)
    for kind, sel in active:
        for i, path in enumerate(paths):
            hit = sel is None or path == sel or path.startswith(sel + ".")
            if kind == "freeze" and hit:
                cur[i] = False
            elif kind == "freeze_except" and not hit:
                cur[i] = False
            elif kind == "unfreeze" and hit:
                cur[i] = True
    return cur


def entries_on(*models):
    """Active contexts scoped to ``models`` (other tests' models may still be alive)."""
    from torchstruct import _state

    return [e for e in _state.entries if any(e.scope() is m for m in models)]


def consistent(model) -> bool:
    """The read-only answer (``ts.trainable_parameters``) agrees with the flags actually set."""
    said = {id(p) for _, p in ts.trainable_parameters(model)}
    real = {id(p) for p in model.parameters() if p.requires_grad}
    return said == real


APPLY_TAKES_KEYWORDS = _apply_takes_keywords()
"""Whether ``torch.autograd.Function.apply`` accepts keyword arguments (newer torch)."""


def _optim_takes_names() -> bool:
    try:
        torch.optim.SGD([("w", torch.nn.Parameter(torch.zeros(1)))], lr=0.1)
    except TypeError:  # before torch 2.6: "optimizer can only optimize Tensors"
        return False
    return True


OPTIM_TAKES_NAMES = _optim_takes_names()
"""Whether ``torch.optim`` optimizers take ``named_parameters()`` (torch >= 2.6)."""

NEEDS_NAMED_OPTIM = pytest.mark.skipif(
    not OPTIM_TAKES_NAMES, reason="torch.optim takes named parameters from torch 2.6 on")


def flags(m):
    """``requires_grad`` of every parameter, in ``parameters()`` order."""
    return [p.requires_grad for p in m.parameters()]


def reads(m):
    """The same list as torchstruct reads it (``ts.trainable_parameters``)."""
    said = {id(p) for _, p in ts.trainable_parameters(m)}
    return [id(p) in said for p in m.parameters()]


def _stale_graphs_mark():
    from torchstruct._compile_caveats import RECHECKED, STALE

    return pytest.mark.xfail(STALE and not RECHECKED, strict=False, reason=(
        "torch before 2.5 keeps running graphs compiled for other requires_grad flags "
        "(pytorch/pytorch#139476, plain PyTorch as well, up to 2.11; torchstruct makes 2.5 to "
        "2.11 check their guards again when it changes flags); torchstruct warns once"))


STALE_GRAPHS = _stale_graphs_mark()
"""xfail on torch before 2.5 only: a compiled model whose trainable set changes."""

FULLGRAPH_HOLD = pytest.mark.xfail(TORCH < (2, 12), strict=False, reason=(
    "before torch 2.12 dynamo cannot trace the statistics hold of a norm layer under "
    "fullgraph=True (Unsupported: the pop of a module attribute; 2.11.0 seen): a clear error"))
"""xfail on torch before 2.12: fullgraph=True over a norm layer whose statistics are held."""
