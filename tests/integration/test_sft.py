"""``swarm.SwarmSFTTrainer`` against TRL's ``SFTTrainer`` on a local peft model (promise 9): chat data with
``assistant_only_loss=True`` (a chat template with ``{% generation %}`` markers), TRL's collator and its fused-head
loss, with gradient accumulation (pipelined), max_grad_norm=0 (no clipping, the norm still logged) and TRL's default
gradient_checkpointing=True. The labels mask every token but the assistant's, and the losses, grad norms, TRL's
metrics and the adapter equal the local run's."""

from __future__ import annotations

import datasets
import peft
import torch
import transformers
import trl
from safetensors.torch import load_file

import swarm
from swarm.testing.parity import LORA, local_peft
from swarm.testing.tiny import make_tiny_chat_tokenizer

STEPS = 3


def conversations(count: int, seed: int) -> datasets.Dataset:
    """One or two user/assistant exchanges of random words each."""
    g = torch.Generator().manual_seed(seed)

    def words() -> str:
        return " ".join(f"w{int(i)}" for i in torch.randint(7, 256, (int(torch.randint(1, 6, (1,), generator=g)),)))

    rows = []
    for _ in range(count):
        turns = int(torch.randint(1, 3, (1,), generator=g))
        messages = []
        for _ in range(turns):
            messages += [dict(role="user", content=words()), dict(role="assistant", content=words())]
        rows.append(dict(messages=messages))
    return datasets.Dataset.from_list(rows)


def sft_config(out) -> trl.SFTConfig:
    return trl.SFTConfig(
        output_dir=str(out),
        assistant_only_loss=True,
        max_steps=STEPS,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        warmup_steps=1,
        weight_decay=0.01,
        # LoRA's A gets its first gradients (B ~ lr after one update) near AdamW's eps, where g / (sqrt(v) + eps)
        # turns float rounding in g into a visible difference of the update (seen: 7e-6 on one element in 512, with
        # eps=1e-8); a larger eps, the same on both sides, keeps the comparison about the swarm, not about rounding
        adam_epsilon=1e-6,
        max_grad_norm=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        seed=0,
        disable_tqdm=True,
    )


def logged(trainer) -> dict[str, torch.Tensor]:
    keys = ("loss", "grad_norm", "learning_rate", "entropy", "mean_token_accuracy", "num_tokens")
    entries = [e for e in trainer.state.log_history if "loss" in e]
    return {k: torch.tensor([float(e[k]) for e in entries]) for k in keys}


def test_sft_trainer_equals_trl_on_local_peft(llama_pair, tiny_models, tmp_path):
    model_dir = tiny_models["llama"]
    tokenizer_dir = make_tiny_chat_tokenizer(tmp_path / "tokenizer")
    data = conversations(12, seed=4)
    model = swarm.SwarmModelForCausalLM.from_pretrained(
        model_dir, initial_peers=llama_pair.initial_peers, adapter="sft", lora_config=peft.LoraConfig(**LORA), seed=5
    )
    try:
        model.save_adapter(tmp_path / "initial")
        trainer = swarm.SwarmSFTTrainer(
            model=model,
            args=sft_config(tmp_path / "out"),
            train_dataset=data,
            processing_class=transformers.AutoTokenizer.from_pretrained(tokenizer_dir),
        )
        assert "forward" in vars(model)  # TRL patched the swarm model with its fused LM head, as any causal LM
        trainer.train()
        assert model.step == STEPS
        trainer.save_model(str(tmp_path / "final"))
    finally:
        model.shutdown()
    local = trl.SFTTrainer(
        model=local_peft(model_dir, tmp_path / "initial"),
        args=sft_config(tmp_path / "local-out"),
        train_dataset=data,
        processing_class=transformers.AutoTokenizer.from_pretrained(tokenizer_dir),
    )
    local.train()
    local.save_model(str(tmp_path / "local-final"))

    # The labels are the assistant's tokens (their end-of-turn token included), everything else -100
    tokenizer = trainer.processing_class
    assistant, end = tokenizer.convert_tokens_to_ids(["<|assistant|>", "<|end|>"])
    for row in trainer.train_dataset:
        ids, labels = row["input_ids"], row["labels"]
        inside, expected = False, []
        for token in ids:
            expected.append(token if inside else -100)
            inside = (inside or token == assistant) and not (inside and token == end)
        assert labels == expected, (ids, labels)
        assert -100 in labels and any(label != -100 for label in labels)
    assert trainer.train_dataset["labels"] == local.train_dataset["labels"]

    ours, theirs = logged(trainer), logged(local)
    assert len(ours["loss"]) == STEPS and all(theirs["grad_norm"] > 0)  # logged without clipping
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-4, atol=1e-6, msg=key)
    state, reference = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("final", "local-final"))
    assert state.keys() == reference.keys()
    for key in state:
        torch.testing.assert_close(state[key], reference[key], rtol=1e-4, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")
