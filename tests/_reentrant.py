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


IDS = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(2))


def hf_loss(m):
    """The language-model loss of a fixed batch of token ids (vocabulary of 100)."""
    return m(input_ids=IDS, labels=IDS).loss


def tiny_llama():
    """A two-layer Llama built from a config (grouped-query attention, vocabulary of 100)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=100, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(cfg)
