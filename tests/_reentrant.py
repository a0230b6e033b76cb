"""Shared by the tests of structural_grad's exact path (reentrant activation checkpointing)."""
import pytest
import torch
from torch.utils.checkpoint import checkpoint

S = 7.0  # the sentinel every stale .grad holds

# what torch and its hooks say on the way, not what the tests look at
QUIET = pytest.mark.filterwarnings(
    "ignore:None of the inputs have requires_grad=True",
    "ignore:Full backward hook is firing",
    "ignore::FutureWarning",
)


def ck(fn, *args):
    return checkpoint(fn, *args, use_reentrant=True)


def leaf(*shape, dtype=torch.float32):
    """A tensor outside any model, requiring grad, with a sentinel .grad."""
    t = torch.randn(*shape, dtype=dtype, requires_grad=True)
    t.grad = torch.full_like(t, S)
    return t


def tiny_gpt2(pdrop: float):
    """A two-layer GPT-2 built from a config (seeded), HF's reentrant layer checkpoints on, in
    train mode, every dropout at ``pdrop``."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16,
                                  resid_pdrop=pdrop, embd_pdrop=pdrop, attn_pdrop=pdrop)
    model = transformers.GPT2LMHeadModel(cfg)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    return model


def ddp_grads(ddp, x, form: str, wrt):
    """structural_grad of ``ddp(x).sum()``-style losses on a DDP model: a callable, or a tensor
    loss computed inside ``no_sync``; as a flat dict."""
    import torchstruct as ts

    if form == "callable":
        got = ts.structural_grad(ddp, lambda d: d(x), wrt=wrt)
    else:
        with ddp.no_sync():
            got = ts.structural_grad(ddp, ddp(x), wrt=wrt)
    return ts.tree.to_flat_dict(got)
