"""Audit: torchstruct against Hugging Face model surgery and PEFT adapter life cycles.

Tiny Llama / GPT-2 models are built from configs in code (nothing is downloaded). Every case
runs the same program twice -- once with torchstruct, once with the same flags written by hand
(or no torchstruct at all) -- and compares flags, ``ts.is_trainable`` reads, gradients and the
warnings torchstruct promises (docs/freezing.md, docs/schedule.md, docs/structural.md,
docs/groups.md, docs/checkpoint.md).

Covered:

- embedding surgery: ``resize_token_embeddings`` (tied and untied, ``pad_to_multiple_of``)
  inside ``freeze_except`` blocks with path, module and parameter selectors, under a bare
  ``freeze``, under an ``unfreeze`` of a hand-frozen head, with an ``UnfreezeSchedule``;
  ``set_input_embeddings`` + ``tie_weights`` inside ``freeze("*embed*")``; an optimizer built
  from ``ts.param_groups`` before the resize; ``ts.state_dict`` after it;
- PEFT: ``add_adapter`` / ``set_adapter`` / ``delete_adapter`` / ``disable_adapter()`` /
  ``disable_adapter_layers`` inside blocks, ``merge_and_unload`` and ``unload`` under a bare
  context, LoRA on embeddings and on a tied ``lm_head``, ``modules_to_save``, trainable tokens,
  ``prepare_model_for_kbit_training`` on a float model, adapter ``save_pretrained`` /
  ``PeftModel.from_pretrained``;
- ``gradient_checkpointing_enable`` (both ``use_reentrant`` values) with contexts around the
  forward (backward inside and after the block) and with ``ts.structural_grad(wrt=...)``,
  ``enable_input_require_grads`` / ``disable_input_require_grads``; ``train()`` / ``eval()``;
- ``save_pretrained`` / ``from_pretrained`` of attached models.

Tests whose names end in ``documented`` pin behaviour the docs describe that differs from the
plain program. A case where torchstruct goes wrong is kept, minimised, as a test marked
``@pytest.mark.xfail(strict=True, reason="BUG: ...")``.
"""
import os
import warnings

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import torchstruct as ts  # noqa: E402

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB = 40


# ----------------------------------------------------------------------------- helpers

def llama(seed=0, tie=False):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, max_position_embeddings=16,
                                   tie_word_embeddings=tie)
    return transformers.LlamaForCausalLM(cfg)


def gpt2(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=48, n_positions=16,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def lora(model, targets=("q_proj", "v_proj"), seed=3, **kw):
    torch.manual_seed(seed)
    pm = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=list(targets),
                                                    lora_dropout=0.0, **kw))
    with torch.no_grad():  # non-zero B so that every adapter weight has a gradient
        for path, p in pm.named_parameters():
            if "lora_B" in path or "lora_embedding_B" in path:
                p.normal_()
    return pm


def ids(vocab=VOCAB, seed=0):
    return torch.randint(0, vocab, (2, 6), generator=torch.Generator().manual_seed(seed))


def lm_loss(x):
    return lambda m: m(input_ids=x, labels=x).loss


def flags(model):
    return {n: p.requires_grad for n, p in model.named_parameters()}


def trained(model):
    return [n for n, p in model.named_parameters() if p.requires_grad]


def disagreeing(model):
    return [n for n, p in model.named_parameters() if ts.is_trainable(model, n) != p.requires_grad]


def adapters_training(model):
    """{'lora_A.default', ...}: which adapter tensors require grad."""
    return sorted({".".join(n.split(".")[-3:-1]) for n in trained(model) if "lora_" in n})


def grads_differ(model, ref):
    theirs = dict(ref.named_parameters())
    out = []
    for n, p in model.named_parameters():
        q = theirs[n]
        if (p.grad is None) != (q.grad is None):
            out.append(n)
        elif p.grad is not None and not torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6):
            out.append(n)
    return out


class Record:
    """Record every warning; ``.restored`` are the RestoredFlagsWarning messages."""

    def __enter__(self):
        self._cm = warnings.catch_warnings(record=True)
        self.caught = self._cm.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)

    @property
    def restored(self):
        return [str(w.message) for w in self.caught
                if issubclass(w.category, ts.RestoredFlagsWarning)]


@pytest.fixture(autouse=True)
def _quiet():
    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=UserWarning)
        yield


# ====================================================================== embedding surgery

@pytest.mark.parametrize("kind", ["path", "module", "parameter"])
def test_resize_untied_inside_freeze_except_head_keeps_new_head_trainable(kind):
    """HF replaces an untied lm_head with a new Linear copying the old flag; the block takes
    it as the old one's copy whatever the selector (docs/freezing.md, "A context decides once
    per parameter": "inherits what was decided for the one it replaces, whatever the selector
    (path, module or the old Parameter object)")."""
    model = llama()
    sel = {"path": "lm_head", "module": model.lm_head, "parameter": model.lm_head.weight}[kind]
    old_head = model.lm_head.weight
    with Record() as rec:
        with ts.freeze_except(model, sel):
            model.resize_token_embeddings(44, mean_resizing=False)
            assert model.lm_head.weight is not old_head
            assert ts.is_trainable(model, "lm_head.weight") and model.lm_head.weight.requires_grad
            model(input_ids=ids(44))
            assert trained(model) == ["lm_head.weight"] and disagreeing(model) == []
    assert all(flags(model).values()) and disagreeing(model) == []
    # a module was added inside the block: the warning is promised, naming the frozen ones
    assert len(rec.restored) == 1 and "'model.embed_tokens.weight'" in rec.restored[0]


def test_resize_untied_inside_freeze_head_and_unfreeze_of_hand_frozen_head():
    model = llama()
    with Record() as rec:
        with ts.freeze(model, "lm_head"):
            model.resize_token_embeddings(44, mean_resizing=False)
            assert not model.lm_head.weight.requires_grad
            assert not ts.is_trainable(model, "lm_head.weight")
            model(input_ids=ids(44))
            assert disagreeing(model) == []
    assert model.lm_head.weight.requires_grad                  # as a resize outside the block
    assert len(rec.restored) == 1

    model = llama()
    model.lm_head.weight.requires_grad_(False)                 # the user's own choice
    with Record() as rec:
        with ts.unfreeze(model, "lm_head"):
            model.resize_token_embeddings(44, mean_resizing=False)  # copies the True
            assert model.lm_head.weight.requires_grad and ts.is_trainable(model, "lm_head.weight")
            model(input_ids=ids(44))
            assert disagreeing(model) == []
    assert not model.lm_head.weight.requires_grad              # the user's choice again
    # its path holds its copy, which cannot be told apart from a head built there: named,
    # as the freeze case above names the head it turns back on
    assert len(rec.restored) == 1


def test_resize_tied_pad_to_multiple_of_under_a_bare_freeze():
    model = gpt2()
    ctx = ts.freeze(model, "*wte*")
    emb = model.transformer.wte.weight
    model.resize_token_embeddings(50, pad_to_multiple_of=16, mean_resizing=False)
    assert model.transformer.wte.weight is emb and emb.shape == (64, 16)
    assert model.lm_head.weight is emb and not emb.requires_grad
    assert not ts.is_trainable(model, "lm_head.weight") and disagreeing(model) == []
    model(input_ids=ids(64))
    assert disagreeing(model) == []
    ctx.__exit__(None, None, None)
    assert emb.requires_grad and all(flags(model).values())


@pytest.mark.parametrize("tie", [False, True])
def test_set_input_embeddings_and_tie_weights_inside_freeze_embed(tie):
    """A new embedding put in place of the frozen one, with its own (True) flag: judged by the
    block's selector at the next forward (frozen), its own flag again after the exit; the old
    one left the model frozen by the block and is named."""
    model = llama(tie=tie)
    old = model.model.embed_tokens.weight
    with Record() as rec:
        with ts.freeze(model, "*embed*"):
            new = nn.Embedding(VOCAB, 16)
            model.set_input_embeddings(new)
            if tie:
                model.tie_weights()
                assert model.lm_head.weight is new.weight
            model(input_ids=ids())
            assert not new.weight.requires_grad and disagreeing(model) == []
            assert not ts.is_trainable(model, new.weight)
    assert new.weight.requires_grad and old.requires_grad and all(flags(model).values())
    assert len(rec.restored) == 1 and "model.embed_tokens.weight" in rec.restored[0]


@pytest.mark.parametrize("kind", ["path", "module"])
def test_resize_with_an_unfreeze_schedule(kind):
    """A path selector follows the replaced lm_head through every stage; a module selector
    names an object that left the model: the next stage change that needs it raises, leaving
    step and flags as they were (docs/schedule.md, "Errors and DDP")."""
    model = llama()
    first = "lm_head" if kind == "path" else model.lm_head
    schedule = ts.UnfreezeSchedule(model, {0: first, 2: "model.layers.1", 4: None})
    x = ids()
    counts = []
    for step in range(5):
        if step == 1:
            model.resize_token_embeddings(45, pad_to_multiple_of=8, mean_resizing=False)
            assert model.lm_head.weight.shape == (48, 16)
        model(input_ids=x)
        assert disagreeing(model) == [] and model.lm_head.weight.requires_grad
        counts.append(len(trained(model)))
        if kind == "module" and step == 1:
            before = flags(model)
            with pytest.raises(ValueError, match="milestone 0.*not a submodule"):
                schedule.step()
            assert schedule.current_step == 1 and flags(model) == before
            schedule.close()
            return
        schedule.step()
    assert counts == [1, 1, 10, 10, 21]
    schedule.close()
    assert all(flags(model).values())


def test_optimizer_built_before_resize_untied_holds_the_old_head_like_torch():
    """Docs are silent on an optimizer built before surgery that *replaces* a parameter
    (groups.md only promises that frozen parameters are included). What happens is what
    torch.optim does: the old lm_head stays in the optimizer, the new one is in no group, and
    step() does not move it (no error). The kept embedding with state of the old shape is
    refused clearly (optimizers.md)."""
    x = ids(48)
    model, twin = llama(), llama()
    opt = ts.optim.AdamW(ts.param_groups(model), lr=1e-2)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2, foreach=False)
    for net, o in ((model, opt), (twin, ref)):
        net.resize_token_embeddings(48, mean_resizing=False)
        net(input_ids=x, labels=x).loss.backward()
        held = {id(p) for g in o.param_groups for p in g["params"]}
        assert [n for n, p in net.named_parameters() if id(p) not in held] == ["lm_head.weight"]
        head = net.lm_head.weight.detach().clone()
        o.step()
        assert torch.equal(net.lm_head.weight, head)           # silently not trained
    # with state of the old shape: a clear error naming the embedding
    model = llama()
    opt = ts.optim.AdamW(ts.param_groups(model), lr=1e-2)
    model(input_ids=ids(), labels=ids()).loss.backward()
    opt.step()
    opt.zero_grad()
    model.resize_token_embeddings(48, mean_resizing=False)
    model(input_ids=x, labels=x).loss.backward()
    with pytest.raises(RuntimeError, match=r"model\.embed_tokens\.weight"):
        opt.step()


def test_ts_state_dict_after_resize_and_loading_into_unresized_model_is_refused():
    model = llama()
    ts.freeze_except(model, "lm_head")
    model.resize_token_embeddings(44, mean_resizing=False)
    state = ts.state_dict(model)
    assert list(state) == ["lm_head.weight"] and state["lm_head.weight"].shape == (44, 16)
    fresh = llama(1)
    ts.freeze_except(fresh, "lm_head")
    head = fresh.lm_head.weight.detach().clone()
    with pytest.raises(ValueError, match=r"lm_head\.weight.*\(44, 16\).*\(40, 16\)"):
        ts.load_state_dict(fresh, state)
    assert torch.equal(fresh.lm_head.weight, head)
    fresh.resize_token_embeddings(44, mean_resizing=False)
    ts.load_state_dict(fresh, state)
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight)


# =============================================================================== PEFT life

def _two_adapters():
    pm = lora(llama())
    pm.add_adapter("other", peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    return pm


def _disable_ctx(pm):
    with pm.disable_adapter():
        pm(input_ids=ids())


@pytest.mark.parametrize("case", [
    ("add_adapter", lambda m: ts.freeze(m, "*lora_B*"),
     [lambda m: m.add_adapter("third", peft.LoraConfig(r=2, target_modules=["q_proj"]))]),
    ("set_and_delete", lambda m: ts.freeze(m, "*lora_A*"),
     [lambda m: m.set_adapter("other"), lambda m: m.delete_adapter("default")]),
    ("disable_adapter_ctx_A", lambda m: ts.freeze(m, "*lora_A*"), [_disable_ctx]),
    ("disable_adapter_ctx_B", lambda m: ts.freeze_except(m, "*lora_A*"), [_disable_ctx]),
    ("disable_enable_layers", lambda m: ts.freeze_except(m, "*lora_B*"),
     [lambda m: m.base_model.disable_adapter_layers(),
      lambda m: m.base_model.enable_adapter_layers()]),
], ids=lambda c: c[0])
def test_peft_adapter_life_inside_a_block_ends_as_without_it(case):
    """PEFT's own flag writes inside a block stand; at exit the flags are those of the same
    PEFT calls made without torchstruct, and reads agree inside and after."""
    _, block, actions = case
    model, plain = _two_adapters(), _two_adapters()
    with Record():
        with block(model):
            for act in actions:
                act(model)
            model(input_ids=ids())
            assert disagreeing(model) == []
    for act in actions:
        act(plain)
    assert flags(model) == flags(plain)
    assert disagreeing(model) == []


def test_disable_adapter_layers_inside_freeze_except_is_undone_at_exit_documented():
    """PEFT's disable_adapter_layers() writes requires_grad=False on every adapter. On the
    lora_A weights the block had frozen that is the block's own value: "The one write that
    cannot be seen ... is undone at exit" (docs/freezing.md). No module was added, so no
    warning is promised, and none comes: lora_A trains after the block, where the plain
    program trains nothing."""
    model, plain = _two_adapters(), _two_adapters()
    with Record() as rec:
        with ts.freeze_except(model, "*lora_B*"):
            model.base_model.disable_adapter_layers()
            assert trained(model) == [] and disagreeing(model) == []
    plain.base_model.disable_adapter_layers()
    assert trained(plain) == []
    assert adapters_training(model) == ["lora_A.default"]
    assert rec.restored == []
    assert disagreeing(model) == []


def test_bare_lora_fa_freeze_is_lifted_by_disable_adapter_context_documented():
    """A permanent ts.freeze(model, "*lora_A*") (LoRA-FA) followed by PEFT's
    ``with model.disable_adapter():`` (reference log-probs in DPO-style training): on leaving,
    PEFT writes requires_grad=True on the active adapter, a write by someone else which
    stands against the contexts active when it was written (docs/freezing.md). lora_A trains
    from then on -- exactly as with the freeze written by hand."""
    model, plain = lora(llama(), targets=["q_proj"]), lora(llama(), targets=["q_proj"])
    ts.freeze(model, "*lora_A*")
    for path, p in plain.named_parameters():
        if "lora_A" in path:
            p.requires_grad_(False)
    for net in (model, plain):
        assert adapters_training(net) == ["lora_B.default"]
        with net.disable_adapter():
            net(input_ids=ids())
        net(input_ids=ids())
        assert adapters_training(net) == ["lora_A.default", "lora_B.default"]
    assert disagreeing(model) == []


def test_delete_adapter_inside_a_block_warns_nothing():
    """docs/freezing.md promises the RestoredFlagsWarning when modules or parameters were
    *added* inside the block (naming what the exit turns back on), and for parameters *the
    block froze* that left the model. Deleting an inactive adapter (frozen by PEFT, not by the
    block) is neither; ``del model.b`` on a plain module rightly warns nothing."""
    model = _two_adapters()
    with Record() as rec:
        with ts.freeze(model, "*lora_B*"):
            model.delete_adapter("other")
    assert rec.restored == []


def test_container_delete_inside_a_block_warns_nothing_minimal():
    m = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2)})
    with Record() as rec:
        with ts.freeze(m, "a"):
            del m["b"]                     # b was never frozen by the block
    assert rec.restored == []


def test_plain_module_delete_inside_a_block_warns_nothing():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    m = Net()
    with Record() as rec:
        with ts.freeze(m, "a"):
            del m.b
    assert rec.restored == []


@pytest.mark.parametrize("op", ["merge_and_unload", "unload"])
def test_merge_and_unload_under_a_bare_context(op):
    def make():
        return lora(llama(), modules_to_save=["lm_head"])

    model = make()
    x = ids()
    expected = model(input_ids=x).logits
    with Record() as rec:
        ctx = ts.freeze_except(model, "*lora_B*", "*modules_to_save*")
        base = getattr(model, op)()
        plain = getattr(make(), op)()
        if op == "merge_and_unload":
            torch.testing.assert_close(base(input_ids=x).logits, expected)
        else:
            base(input_ids=x)
        assert flags(base) == flags(plain) and disagreeing(base) == []
        for p in base.parameters():                 # now train the whole merged model
            p.requires_grad_(True)
        base(input_ids=x)
        assert all(flags(base).values()) and disagreeing(base) == []
        ctx.__exit__(None, None, None)
    assert all(flags(base).values()) and disagreeing(base) == []
    with ts.freeze(base, "lm_head"):
        assert trained(base)[-1] == "model.norm.weight" and disagreeing(base) == []
    assert all(flags(base).values())
    # the lora_A weights the bare context froze left the model inside it: named, as promised
    assert len(rec.restored) == 1 and "left the model" in rec.restored[0]


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("cfg", [
    dict(targets=["embed_tokens", "q_proj"]),
    dict(targets=["embed_tokens", "lm_head"]),
    dict(targets=["q_proj"], modules_to_save=["lm_head"]),
], ids=["lora_embed", "lora_embed_and_head", "modules_to_save_head"])
def test_lora_on_embeddings_and_head_grads_inside_a_block_equal_hand_flags(tie, cfg):
    cfg = dict(cfg)
    targets = cfg.pop("targets")
    model, ref = lora(llama(tie=tie), targets, **cfg), lora(llama(tie=tie), targets, **cfg)
    x = ids()
    sel = "*lora_*B*"
    chosen = {n for n, _ in ts.select(ref, sel)}
    with ts.freeze(model, sel):
        loss = lm_loss(x)(model)
        tree = ts.tree.to_flat_dict(ts.structural_grad(model, lm_loss(x)))
        assert sorted(tree) == sorted(n for n, _ in ts.trainable_parameters(model))
    loss.backward()
    params = dict(ref.named_parameters())
    for n in chosen:
        params[n].requires_grad_(False)
    lm_loss(x)(ref).backward()
    for n in chosen:
        params[n].requires_grad_(True)
    assert grads_differ(model, ref) == []
    for n, g in tree.items():
        torch.testing.assert_close(g, params[n].grad, rtol=1e-5, atol=1e-6, msg=n)
    assert flags(model) == flags(ref) and disagreeing(model) == []
    assert ts.summary(model).counts[0] == model.get_nb_trainable_parameters()[0]


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("kind", ["trainable_tokens", "modules_to_save"])
def test_new_tokens_recipe_resize_then_peft(tie, kind):
    """Add tokens, resize, then train them with PEFT (trainable_token_indices or
    modules_to_save=[embed_tokens, lm_head]); a ts.freeze of the LoRA part gives the gradients
    of the same flags by hand; counts agree with PEFT's."""
    def make():
        m = llama(tie=tie)
        m.resize_token_embeddings(44, mean_resizing=False)
        extra = (dict(trainable_token_indices=[40, 41, 42, 43]) if kind == "trainable_tokens"
                 else dict(modules_to_save=["embed_tokens", "lm_head"]))
        pm = lora(m, ["q_proj"], **extra)
        with torch.no_grad():
            torch.manual_seed(4)
            for p in pm.parameters():
                if p.requires_grad:
                    p.add_(0.1 * torch.randn_like(p))
        return pm

    model, ref = make(), make()
    assert ts.summary(model).counts[0] == model.get_nb_trainable_parameters()[0]
    x = ids(44)
    with ts.freeze(model, "*lora*"):
        tree = ts.tree.to_flat_dict(ts.structural_grad(model, lm_loss(x)))
    for n, p in ref.named_parameters():
        if "lora" in n:
            p.requires_grad_(False)
    lm_loss(x)(ref).backward()
    params = dict(ref.named_parameters())
    assert sorted(tree) == sorted(n for n, p in params.items() if p.grad is not None)
    for n, g in tree.items():
        torch.testing.assert_close(g, params[n].grad, rtol=1e-5, atol=1e-6, msg=n)
    assert disagreeing(model) == []


# --------------------------------------------------------- prepare_model_for_kbit_training

def _kbit(model):
    model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    return lora(model, ["q_proj"], seed=1)


@pytest.mark.parametrize("setup", ["attached", "bare_freeze"])
def test_prepare_model_for_kbit_training_on_attached_model_matches_plain(setup):
    x = ids()
    model = llama()
    if setup == "attached":
        ts.attach(model)
    else:
        ts.freeze(model, "*embed*")
    model, ref = _kbit(model), _kbit(llama())
    assert flags(model) == flags(ref) and disagreeing(model) == []
    model.train(), ref.train()
    lm_loss(x)(model).backward()
    lm_loss(x)(ref).backward()
    assert grads_differ(model, ref) == []


def test_prepare_model_for_kbit_training_inside_a_block_is_undone_documented():
    """prepare_model_for_kbit_training freezes every parameter; the ones the block froze get
    the block's own value, "the one write that cannot be seen", undone at exit; nothing was
    added, so no warning is promised (docs/freezing.md): the base trains again after the
    block. Freezing again after the block, or preparing outside it, is the documented fix."""
    model = llama()
    with Record() as rec:
        with ts.freeze_except(model, "lm_head"):
            model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
            assert trained(model) == [] and disagreeing(model) == []
    assert trained(model) == [n for n, _ in model.named_parameters() if n != "lm_head.weight"]
    assert rec.restored == [] and disagreeing(model) == []


# ---------------------------------------------------------------------- adapters saved, loaded

@pytest.mark.parametrize("is_trainable", [False, True])
def test_peft_adapter_save_and_load(tmp_path, is_trainable):
    model = lora(llama(), modules_to_save=["lm_head"])
    x = ids()
    with ts.freeze(model, "*lora_A*"):                 # saving inside a block changes nothing
        model.save_pretrained(str(tmp_path))
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)
    plain = peft.PeftModel.from_pretrained(llama(), str(tmp_path), is_trainable=is_trainable)

    # loaded outside any block onto an attached base: PEFT's flags, reads agree
    base = llama()
    ts.attach(base)
    loaded = peft.PeftModel.from_pretrained(base, str(tmp_path), is_trainable=is_trainable)
    assert flags(loaded) == flags(plain) and disagreeing(loaded) == []
    torch.testing.assert_close(loaded(input_ids=x).logits, model(input_ids=x).logits)

    # loaded inside a block: the documented get_peft_model case (warning, base on again)
    base = llama()
    with Record() as rec:
        with ts.freeze_except(base, "lm_head"):
            inside = peft.PeftModel.from_pretrained(base, str(tmp_path),
                                                    is_trainable=is_trainable)
            inside(input_ids=x)
            assert disagreeing(inside) == []
            assert trained(inside) == (["base_model.model.lm_head.modules_to_save.default.weight"]
                                       if is_trainable else [])
    assert len(rec.restored) == 1 and "model.embed_tokens.weight" in rec.restored[0]
    assert inside.base_model.model.model.embed_tokens.weight.requires_grad
    assert disagreeing(inside) == []


def test_save_pretrained_from_pretrained_of_an_attached_model(tmp_path):
    """Flags are not part of a checkpoint (docs/checkpoint.md): the loaded model is plain HF,
    everything trains, and its outputs are the saved model's."""
    model = llama()
    ts.mark_trainable(model.model, "layers")
    x = ids()
    with ts.freeze(model, "lm_head"):
        model.save_pretrained(str(tmp_path))
        assert trained(model) == [n for n, _ in model.named_parameters()
                                  if n.startswith("model.layers.")]
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path))
    assert all(flags(loaded).values())
    assert len(list(ts.trainable_parameters(loaded))) == len(flags(loaded))
    assert torch.equal(loaded(input_ids=x).logits, model(input_ids=x).logits)
    assert not any(p.requires_grad for p in model.model.embed_tokens.parameters())  # still declared


# ================================================================== gradient checkpointing

@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("block", ["freeze_A", "freeze_except_B", "unfreeze_head"])
@pytest.mark.parametrize("when", ["inside", "after"])
def test_peft_checkpointing_with_a_block_around_forward_equals_hand_flags(reentrant, block, when):
    """docs/freezing.md, "Activation checkpointing": gradients are those of the same model
    without checkpointing with the block's flags during the forward (and after it, for a
    backward after the block)."""
    make = {"freeze_A": (ts.freeze, ("*lora_A*",)),
            "freeze_except_B": (ts.freeze_except, ("*lora_B*",)),
            "unfreeze_head": (ts.unfreeze, ("base_model.model.lm_head", "*layers.1.mlp*"))}
    fn, sel = make[block]
    x = ids()
    model, ref = lora(llama()), lora(llama())
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train(), ref.train()
    with fn(model, *sel):
        want = flags(model)
        loss = lm_loss(x)(model)
        if when == "inside":
            loss.backward()
    if when == "after":
        loss.backward()
    own = flags(ref)
    for n, p in ref.named_parameters():
        p.requires_grad_(want[n])
    loss = lm_loss(x)(ref)
    if when == "inside":
        loss.backward()
    for n, p in ref.named_parameters():
        p.requires_grad_(own[n])
    if when == "after":
        loss.backward()
    assert grads_differ(model, ref) == []
    assert flags(model) == own


@pytest.mark.parametrize("reentrant", [True, False])
def test_structural_grad_wrt_with_hf_checkpointing_and_frozen_embeddings(reentrant):
    x = ids()
    ref = llama()
    ref.train()
    lm_loss(x)(ref).backward()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    model = llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    for wrt in ("model.layers.0", "model.layers.1.mlp", "lm_head", None):
        with ts.freeze(model, "*embed*"):
            tree = ts.tree.to_flat_dict(ts.structural_grad(model, lm_loss(x), wrt=wrt))
        names = ([n for n, _ in ts.select(model, wrt)] if wrt is not None
                 else [n for n in grads if "embed" not in n])
        assert sorted(tree) == sorted(names)
        for n in names:
            torch.testing.assert_close(tree[n], grads[n], rtol=1e-5, atol=1e-6, msg=n)
        assert all(p.grad is None for p in model.parameters()) and all(flags(model).values())


def test_structural_grad_refuses_reentrant_checkpoint_without_input_grads():
    """docs/structural.md: a reentrant checkpoint none of whose inputs requires grad records
    nothing; an asked parameter inside it raises ValueError naming it, never a silent zero."""
    model = llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.disable_input_require_grads()
    model.train()
    with ts.freeze(model, "*embed*"):
        with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.gate_proj\.weight' is used "
                                             r"inside a reentrant activation checkpoint"):
            ts.structural_grad(model, lm_loss(ids()), wrt="model.layers.1.mlp")
    assert all(p.grad is None for p in model.parameters()) and all(flags(model).values())


@pytest.mark.parametrize("reentrant", [True, False])
def test_enable_input_require_grads_freeze_except_one_layer(reentrant):
    x = ids()
    model, ref = llama(), llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.enable_input_require_grads()
    model.train(), ref.train()
    for n, p in ref.named_parameters():
        p.requires_grad_(n.startswith("model.layers.1"))
    lm_loss(x)(ref).backward()
    with ts.freeze_except(model, "model.layers.1"):
        lm_loss(x)(model).backward()
    assert grads_differ(model, ref) == []
    assert all(flags(model).values())


def test_train_eval_switches_inside_blocks_layernorm_only():
    model = llama()
    model.eval()
    with ts.freeze(model):
        model.train()
        model(input_ids=ids())
        assert model.training and not any(flags(model).values())
        assert ts.summary(model).counts[0] == 0
        model.eval()
    assert not model.training and all(flags(model).values())
    with ts.freeze_except(model, "lm_head"):
        model.train()
        model(input_ids=ids())
        assert all(m.training for m in model.modules())
    assert all(flags(model).values())


# ================================================================== schedules and PEFT writes

def test_get_peft_model_while_a_schedule_holds_then_close_warns_documented():
    """Closing a schedule is leaving its context: get_peft_model froze the base with the
    schedule's own value (unseen), modules were added, so the exit names what it turns back on
    (docs/freezing.md)."""
    base = llama()
    schedule = ts.UnfreezeSchedule(base, {0: "lm_head", 1: None})
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    model(input_ids=ids())
    with Record() as rec:
        schedule.close()
    assert len(rec.restored) == 1 and "'model.embed_tokens.weight'" in rec.restored[0]


def test_schedule_stage_change_after_get_peft_model_warns_or_keeps_base_frozen():
    """docs/schedule.md: "A parameter frozen by PEFT ... stays frozen even after None", and
    the schedule "holds one permanent context ... and replaces it at each stage change";
    docs/freezing.md: when modules were added while a context held, the flags its exit turns
    back on are named by a RestoredFlagsWarning. Here 20 base weights start training with
    neither."""
    base = llama()
    schedule = ts.UnfreezeSchedule(base, {0: "lm_head", 1: None})
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    model(input_ids=ids())
    with Record() as rec:
        schedule.step()                                       # stage None
    base_training = [n for n in trained(model) if "lora_" not in n]
    assert base_training == [] or rec.restored != []
    # what the exit of a block would say: the stage change could not see PEFT's write
    assert len(rec.restored) == 1 and "stage of ts.UnfreezeSchedule" in rec.restored[0]
    assert "get_peft_model" in rec.restored[0] and "q_proj" in rec.restored[0]
    # built after get_peft_model, nothing added under it: the stage change says nothing
    model = peft.get_peft_model(llama(), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    schedule = ts.UnfreezeSchedule(model, {0: "*lm_head*", 1: None})
    model(input_ids=ids())
    with Record() as rec:
        schedule.step()
    assert rec.restored == []


def test_schedule_stage_change_after_add_and_set_adapter_matches_resumed_run():
    """Multi-adapter life under gradual unfreezing: the uninterrupted run and the run resumed
    with load_state_dict (docs/schedule.md, "Resuming") should train the same tensors."""
    model = lora(llama())
    schedule = ts.UnfreezeSchedule(model, {0: "*lora_B*", 2: None})
    model.add_adapter("other", peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    model.set_adapter("other")
    model(input_ids=ids())
    with Record() as rec:
        schedule.step()
        schedule.step()
    resumed = lora(llama())
    resumed.add_adapter("other", peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    resumed.set_adapter("other")
    again = ts.UnfreezeSchedule(resumed, {0: "*lora_B*", 2: None})
    again.load_state_dict(schedule.state_dict())
    assert adapters_training(resumed) == ["lora_A.other", "lora_B.other"]   # PEFT's choice
    assert adapters_training(model) == adapters_training(resumed) or rec.restored != []
