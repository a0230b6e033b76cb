"""With the real libraries: an HF Trainer driving ts.optim.AdamW over ts.param_groups (layer
decay, no decay on norms and biases, an element mask) saves a checkpoint and resumes bitwise;
a PEFT LoRA model trains with LoRA+ style groups (a higher lr for lora_B)."""
import copy
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

import torchstruct as ts  # noqa: E402

transformers = pytest.importorskip("transformers")


def tiny_bert(seed=0):
    torch.manual_seed(seed)
    config = transformers.BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=2)
    return transformers.BertForSequenceClassification(config)


def dataset(n=16, length=8):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 40, (n, length), generator=g)
    labels = torch.randint(0, 2, (n,), generator=g)
    return [{"input_ids": ids[i], "attention_mask": torch.ones(length, dtype=torch.long),
             "labels": labels[i]} for i in range(n)]


NEW_ROWS = slice(30, 40)


def optimizer_and_scheduler(model, masks=True):
    groups = ts.param_groups(model, *ts.layer_decay(model, 0.8), weight_decay=0.01)
    mask = torch.zeros(40, 16, dtype=torch.bool)
    mask[NEW_ROWS] = True  # only the new rows of the word embeddings train
    opt = ts.optim.AdamW(
        groups, lr=1e-2,
        masks={"bert.embeddings.word_embeddings.weight": mask} if masks else None)
    sched = transformers.get_linear_schedule_with_warmup(opt, 2, 8)
    return opt, sched


def trainer(model, out, opt, sched, steps=8):
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=4, save_steps=4,
        save_strategy="steps", logging_strategy="no", report_to=[], use_cpu=True, seed=0,
        data_seed=0, dataloader_num_workers=0, disable_tqdm=True)
    return transformers.Trainer(model=model, args=args, train_dataset=dataset(),
                                optimizers=(opt, sched))


def test_hf_trainer_trains_saves_and_resumes_bitwise(tmp_path):
    straight = tiny_bert()
    initial = copy.deepcopy(straight.state_dict())
    opt, sched = optimizer_and_scheduler(straight)
    trainer(straight, tmp_path / "a", opt, sched).train()
    assert float(opt.state[straight.bert.encoder.layer[0].output.dense.weight]["step"]) == 8
    names = [g["name"] for g in opt.param_groups]
    assert "layer 0" in names and "layer 0 (no decay)" in names and "layer 3" in names
    emb = straight.bert.embeddings.word_embeddings.weight
    start = initial["bert.embeddings.word_embeddings.weight"]
    assert torch.equal(emb[:30], start[:30])
    assert not torch.equal(emb[NEW_ROWS], start[NEW_ROWS])

    checkpoint = tmp_path / "a" / "checkpoint-4"
    assert (checkpoint / "optimizer.pt").exists()
    resumed = tiny_bert(seed=1)  # other weights: the checkpoint brings them back
    opt2, sched2 = optimizer_and_scheduler(resumed, masks=False)  # masks come from the checkpoint
    trainer(resumed, tmp_path / "b", opt2, sched2).train(resume_from_checkpoint=str(checkpoint))
    assert opt2.masks  # restored from optimizer.pt
    for (path, p), q in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), path
    assert sched2.last_epoch == sched.last_epoch == 8


def test_peft_lora_plus_groups():
    peft = pytest.importorskip("peft")
    base = tiny_bert()
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                             target_modules=["query", "value"])
    model = peft.get_peft_model(base, config)
    with torch.no_grad():  # lora_B starts at zero: give it values so both groups matter
        for path, p in model.named_parameters():
            if "lora_B" in path:
                p.normal_(0, 0.1)
    twin = copy.deepcopy(model)
    frozen_before = {path: p.detach().clone() for path, p in model.named_parameters()
                     if not p.requires_grad}

    groups = ts.param_groups(model, ("*lora_B*", {"lr_scale": 16.0, "name": "lora_B"}),
                             weight_decay=0.0)
    assert [g["name"] for g in groups][0] == "lora_B"
    assert all("lora_B" in n for n in groups[0]["param_names"])
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    ours = ts.optim.AdamW(groups, lr=1e-3)
    lora_b = [p for path, p in twin.named_parameters() if "lora_B" in path]
    rest = [p for path, p in twin.named_parameters() if p.requires_grad and "lora_B" not in path]
    theirs = torch.optim.AdamW([{"params": lora_b, "lr": 1e-3 * 16.0}, {"params": rest}],
                               lr=1e-3, weight_decay=0.0, foreach=False)
    data = dataset(8)
    batch = {k: torch.stack([d[k] for d in data]) for k in data[0]}
    for _ in range(3):
        for net, opt in ((model, ours), (twin, theirs)):
            opt.zero_grad()
            net(**batch).loss.backward()
            opt.step()
    for (path, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=path)
    for path, p in model.named_parameters():
        if path in frozen_before:
            assert torch.equal(p, frozen_before[path]) and p not in ours.state
