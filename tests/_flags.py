"""What a suspicious user compares: the flags PyTorch sees and torchstruct's reads."""
import torchstruct as ts


def flags(m):
    """``requires_grad`` of every parameter, in ``parameters()`` order."""
    return [p.requires_grad for p in m.parameters()]


def reads(m):
    """The same list as torchstruct reads it (``ts.trainable_parameters``)."""
    said = {id(p) for _, p in ts.trainable_parameters(m)}
    return [id(p) in said for p in m.parameters()]
