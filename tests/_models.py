"""Small models shared by the tests of tree changes: containers of every kind, and a tree run
through a part of it."""
import torch
from torch import nn


class Net(nn.Module):
    """A ``ModuleList``, a ``ModuleDict`` and a ``Sequential`` under one root."""

    def __init__(self, n=4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(3, 3) for _ in range(n))
        self.extra = nn.ModuleDict({"a": nn.Linear(3, 3), "b": nn.Linear(3, 3)})
        self.head = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        for layer in self.extra.values():
            x = layer(x)
        return self.head(x).sum()


class EncDec(nn.Module):
    """An encoder (nested ``Sequential``) a user may run on its own, and a decoder."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(3, 3), nn.Sequential(nn.Linear(3, 3)))
        self.decoder = nn.Linear(3, 1)

    def forward(self, x):
        return self.decoder(self.encoder(x)).sum()


def trainable(model):
    """Sorted names of the parameters whose ``requires_grad`` is on."""
    return sorted(n for n, p in model.named_parameters() if p.requires_grad)


class Checkpointed(nn.Module):
    """An input layer, a middle run through ``torch.utils.checkpoint`` (``mode``: None for no
    checkpoint, else ``use_reentrant``), a head."""

    def __init__(self, mode):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 4)
        self.mid = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        self.out = nn.Linear(4, 1)
        self.mode = mode

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = torch.tanh(self.inp(x))
        h = self.mid(h) if self.mode is None else checkpoint(self.mid, h, use_reentrant=self.mode)
        return self.out(h)


def grads(model):
    """``{path: copy of .grad or None}``."""
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def same_grads(a, b):
    """Two results of :func:`grads` are equal: the same paths without a gradient, the others
    bitwise."""
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] is None) == (b[k] is None), k
        if a[k] is not None:
            assert torch.equal(a[k], b[k]), k


class Grows(nn.Module):
    """Declares ``a`` and ``b`` trainable until a module named ``head`` joins ``extra``, then
    ``a`` and ``extra``: a registration into ``extra`` freezes ``b`` at the next application.
    Square layers: with a batch of 3, a recomputation with ``b`` frozen saves tensors of the
    same shapes, so only the values would tell."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)
        self.extra = nn.ModuleDict()

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))

    def trainable(self):
        return ["a", "extra"] if "head" in self.extra else ["a", "b"]


def holders(grads):
    """Fresh parameters (zeros) whose ``.grad`` are copies of ``grads``."""
    out = []
    for g in grads:
        w = nn.Parameter(torch.zeros_like(g))
        w.grad = g.clone()
        out.append(w)
    return out


class TiedLM(nn.Module):
    """An embedding tied to the output head (``head.weight is embed.weight``)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        return self.head(self.body(self.embed(x)))
