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
