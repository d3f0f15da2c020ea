"""``swarm.SwarmTrainer`` against ``transformers.Trainer`` on a local peft model (promise 9, issue 23): the same
TrainingArguments and data give the same logged losses, grad norms and learning rates, the same adapter and the same
eval loss; checkpoints are peft adapter folders; a resume continues at the swarm's committed step to the adapter of
an uninterrupted run, and a checkpoint that does not match the swarm is refused with a clear error."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import datasets
import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file

import swarm
from swarm.client.trainer import SWARM_CHECKPOINT
from swarm.testing.faults import CallTap
from swarm.testing.parity import LORA, local_peft

MAX_STEPS, SAVE_STEPS = 4, 2


def examples(count: int, seed: int) -> datasets.Dataset:
    """Rows of different lengths with a prompt of 0-3 tokens masked in the labels, and a text column the model does
    not take (remove_unused_columns must drop it)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(count):
        length = int(torch.randint(4, 13, (1,), generator=g))
        ids = torch.randint(0, 256, (length,), generator=g).tolist()
        prompt = int(torch.randint(0, 4, (1,), generator=g))
        rows.append(dict(input_ids=ids, labels=[-100] * prompt + ids[prompt:], text=f"example {i}"))
    return datasets.Dataset.from_list(rows)


def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Right padding: micro-batches of different token counts."""
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n], mask[i, :n], labels[i, :n] = torch.tensor(r["input_ids"]), 1, torch.tensor(r["labels"])
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def training_args(out: Path, **overrides) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(
        **overrides,
        output_dir=str(out),
        max_steps=MAX_STEPS,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=3,
        gradient_accumulation_steps=3,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        warmup_steps=1,
        weight_decay=0.01,
        adam_beta2=0.99,
        max_grad_norm=0.02,  # below every step's norm: clipping engages
        logging_steps=1,
        save_steps=SAVE_STEPS,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )


class StopAt(transformers.TrainerCallback):
    """Stops training after ``step`` (as a trainer that crashed just then), after that step's checkpoint if any."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def make_trainer(cls, model, out: Path, callbacks=(), **overrides) -> transformers.Trainer:
    return cls(
        model=model,
        args=training_args(out, **overrides),
        train_dataset=examples(24, seed=1),
        eval_dataset=examples(6, seed=2),
        data_collator=collate,
        callbacks=list(callbacks),
    )


def train_logs(trainer: transformers.Trainer) -> list[dict]:
    keys = ("step", "loss", "grad_norm", "learning_rate")
    return [{k: e[k] for k in keys} for e in trainer.state.log_history if "loss" in e]


def assert_same_logs(logs: list[dict], reference: list[dict]) -> None:
    assert [e["step"] for e in logs] == [e["step"] for e in reference]
    for key in ("loss", "grad_norm", "learning_rate"):
        got, want = torch.tensor([e[key] for e in logs]), torch.tensor([e[key] for e in reference])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=key)


def assert_same_adapter(adapter_dir: Path, reference_dir: Path) -> None:
    state, reference = (load_file(d / "adapter_model.safetensors") for d in (adapter_dir, reference_dir))
    assert state.keys() == reference.keys()
    for key in state:
        torch.testing.assert_close(state[key], reference[key], rtol=1e-4, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")


def calls_in_flight(tap: CallTap) -> list[int]:
    """How many requests of this client (``tap``: its call hook) were in flight at once, recorded at each request's
    start."""
    seen, active, lock = [], [0], threading.Lock()

    def call(peer, message, send):
        with lock:
            active[0] += 1
            seen.append(active[0])
        try:
            return send(message)
        finally:
            with lock:
                active[0] -= 1

    tap.arm(call)
    return seen


def connect(swarm_, model_dir, adapter: str, **client) -> swarm.SwarmModelForCausalLM:
    return swarm.SwarmModelForCausalLM.from_pretrained(
        model_dir,
        initial_peers=swarm_.initial_peers,
        adapter=adapter,
        lora_config=peft.LoraConfig(**LORA),
        seed=5,
        **client,
    )


@pytest.fixture(scope="module")
def reference(llama_pair, tiny_models, tmp_path_factory) -> dict:
    """The local run: transformers.Trainer on a local peft model with the swarm adapter's initial weights."""
    root = tmp_path_factory.mktemp("reference")
    model = connect(llama_pair, tiny_models["llama"], "trainer-init")
    try:
        model.save_adapter(root / "initial")
    finally:
        model.shutdown()
    trainer = make_trainer(transformers.Trainer, local_peft(tiny_models["llama"], root / "initial"), root / "out")
    trainer.train()
    trainer.save_model(str(root / "final"))
    return dict(
        initial=root / "initial",
        out=root / "out",
        final=root / "final",
        logs=train_logs(trainer),
        eval=trainer.evaluate()["eval_loss"],
    )


def test_trainer_equals_local_trainer(llama_pair, tiny_models, reference, tmp_path):
    """Four steps of three micro-batches (pipelined) with padding and masked prompts, clipping that engages, linear
    warmup and decay, weight decay: the logs, the adapter (saved with save_model and at each checkpoint) and the
    eval loss equal the local Trainer's; a checkpoint folder loads with peft and gives the local model's logits."""
    model_dir = tiny_models["llama"]
    tap = CallTap()
    model = connect(llama_pair, model_dir, "trainer", call_hook=tap)
    try:
        model.save_adapter(tmp_path / "initial")
        assert_same_adapter(tmp_path / "initial", reference["initial"])
        trainer = make_trainer(swarm.SwarmTrainer, model, tmp_path / "out")
        in_flight = calls_in_flight(tap)
        assert isinstance(trainer.optimizer or trainer.create_optimizer(), swarm.RemoteOptimizer)
        trainer.train()
        assert model.step == MAX_STEPS
        trainer.save_model(str(tmp_path / "final"))
        eval_loss = trainer.evaluate()["eval_loss"]
    finally:
        model.shutdown()
    logs = train_logs(trainer)
    assert max(in_flight) > 1, in_flight  # the accumulation's micro-batches were pipelined through the swarm
    assert all(e["grad_norm"] > 0.02 for e in reference["logs"])  # clipping engaged at every step
    assert len({e["learning_rate"] for e in reference["logs"]}) == MAX_STEPS  # warmup, then decay
    assert_same_logs(logs, reference["logs"])
    assert_same_adapter(tmp_path / "final", reference["final"])
    assert eval_loss == pytest.approx(reference["eval"], rel=1e-5)

    checkpoint = tmp_path / "out" / f"checkpoint-{SAVE_STEPS}"
    files = {p.name for p in checkpoint.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "trainer_state.json", "scheduler.pt"} <= files
    assert {"rng_state.pth", "training_args.bin", SWARM_CHECKPOINT} <= files
    assert not files & {"model.safetensors", "optimizer.pt", "pytorch_model.bin"}, files  # no embeddings, no AdamW
    saved = json.loads((checkpoint / SWARM_CHECKPOINT).read_text())
    assert (saved["swarm_step"], saved["global_step"], saved["adapter"]) == (SAVE_STEPS, SAVE_STEPS, "trainer")
    assert saved["base_model"] == model_dir.name and saved["lora_config"]["r"] == LORA["r"]
    batch = collate([examples(2, seed=3)[i] for i in range(2)])
    ours, theirs = (
        local_peft(model_dir, folder).eval() for folder in (checkpoint, reference["out"] / f"checkpoint-{SAVE_STEPS}")
    )
    with torch.no_grad():
        got = ours(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        want = theirs(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("stop_at", [SAVE_STEPS, SAVE_STEPS + 1], ids=["swarm-at-checkpoint", "swarm-ahead"])
def test_resume_continues_at_the_swarms_step_to_the_uninterrupted_adapter(
    llama_pair, tiny_models, reference, tmp_path, stop_at, caplog
):
    """A trainer stops after step ``stop_at`` (checkpoint at step 2); a new one resumes from the last checkpoint
    with ``resume_from_checkpoint=True``: at the checkpoint's step, or, when the swarm committed a step past it, at
    the swarm's step (data and LR schedule skipped to it). Both end with the uninterrupted run's adapter and logs."""
    model = connect(llama_pair, tiny_models["llama"], f"trainer-resume-{stop_at}")
    try:
        make_trainer(swarm.SwarmTrainer, model, tmp_path / "out", callbacks=[StopAt(stop_at)]).train()
        assert model.step == stop_at
        assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [f"checkpoint-{SAVE_STEPS}"]
        resumed = make_trainer(swarm.SwarmTrainer, model, tmp_path / "out")
        with caplog.at_level("WARNING", logger="swarm.client.trainer"):
            resumed.train(resume_from_checkpoint=True)
        assert model.step == MAX_STEPS
        model.save_adapter(tmp_path / "final")
    finally:
        model.shutdown()
    ahead = [r.getMessage() for r in caplog.records if "past" in r.getMessage()]
    assert bool(ahead) == (stop_at > SAVE_STEPS), ahead
    assert_same_adapter(tmp_path / "final", reference["final"])
    assert_same_logs(train_logs(resumed)[-(MAX_STEPS - stop_at) :], reference["logs"][stop_at:])


def test_a_checkpoint_that_does_not_match_the_swarm_is_refused(llama_pair, tiny_models, tmp_path):
    """Steps lost in the swarm (the checkpoint is past the swarm's step), another adapter, another LoRA config, or
    a folder that is no SwarmTrainer checkpoint: each refused, naming both sides, before anything trains."""
    model = connect(llama_pair, tiny_models["llama"], "trainer-mismatch")
    try:
        trainer = make_trainer(swarm.SwarmTrainer, model, tmp_path / "out", callbacks=[StopAt(SAVE_STEPS)])
        trainer.train()
        good = tmp_path / "out" / f"checkpoint-{SAVE_STEPS}"
        saved = json.loads((good / SWARM_CHECKPOINT).read_text())
        cases = {
            "lost": ({"swarm_step": 7}, r"saved at swarm step 7 but adapter 'trainer-mismatch' is at step 2 .* 5 "),
            "adapter": ({"adapter": "other"}, r"adapter 'other' but this model has 'trainer-mismatch'"),
            "lora": ({"lora_config": {**saved["lora_config"], "r": 8}}, r"LoRA config .*'r': 8.* but this model has"),
            "base": ({"base_model": "llama-70b"}, r"base model 'llama-70b' but this model has"),
        }
        for name, (change, message) in cases.items():
            bad = tmp_path / name
            shutil.copytree(good, bad)
            (bad / SWARM_CHECKPOINT).write_text(json.dumps({**saved, **change}))
            with pytest.raises(ValueError, match=message):
                make_trainer(swarm.SwarmTrainer, model, tmp_path / "out").train(resume_from_checkpoint=str(bad))
        (tmp_path / "lost" / SWARM_CHECKPOINT).unlink()
        with pytest.raises(ValueError, match="not saved by a SwarmTrainer"):
            make_trainer(swarm.SwarmTrainer, model, tmp_path / "out").train(
                resume_from_checkpoint=str(bad.parent / "lost")
            )
        assert model.step == SAVE_STEPS  # nothing trained
    finally:
        model.shutdown()


def test_a_bf16_recipe_computes_the_blocks_under_the_clients_autocast(llama_pair, tiny_models, tmp_path):
    """``bf16=True`` (TRL's SFTConfig turns it on by default) autocasts the model's forward: locally every block's
    matmuls run in bf16. The peers compute the blocks under the autocast the client's forward runs under (each
    request carries it), so the swarm's losses, grad norms and adapter are the local Trainer's, not an fp32 run's."""
    model_dir = tiny_models["llama"]
    model = connect(llama_pair, model_dir, "trainer-bf16")
    try:
        model.save_adapter(tmp_path / "initial")
        trainer = make_trainer(swarm.SwarmTrainer, model, tmp_path / "out", bf16=True)
        trainer.train()
        trainer.save_model(str(tmp_path / "final"))
    finally:
        model.shutdown()
    initial = tmp_path / "initial"
    local = make_trainer(transformers.Trainer, local_peft(model_dir, initial), tmp_path / "local", bf16=True)
    local.train()
    local.save_model(str(tmp_path / "local-final"))
    fp32 = make_trainer(transformers.Trainer, local_peft(model_dir, initial), tmp_path / "fp32")
    fp32.train()
    logs, want, unlike = train_logs(trainer), train_logs(local), train_logs(fp32)
    # The first step, from the same adapter, is the local bf16 step to fp32 rounding; an fp32 run is 2.5e-4 away.
    for key in ("loss", "grad_norm"):
        assert logs[0][key] == pytest.approx(want[0][key], rel=1e-6, abs=1e-6), (key, logs[0], want[0])
        assert abs(unlike[0][key] - want[0][key]) > 1e-4, (key, unlike[0], want[0])  # bf16 changes the step
    # Later steps start from adapters a few fp32 ulps apart (this update and torch's AdamW round differently),
    # which bf16's 8-bit mantissa can turn into one rounding step: within bf16 tolerance, not fp32's.
    for key in ("loss", "grad_norm"):
        got, ref = torch.tensor([e[key] for e in logs]), torch.tensor([e[key] for e in want])
        torch.testing.assert_close(got, ref, rtol=2e-3, atol=1e-6, msg=key)
    # Adam moves a weight with a near-zero gradient by about lr either way, so elementwise the adapters may differ
    # by a few lr where such a sign flipped; as a whole, the swarm's training differs from the local bf16 run's by
    # far less than the fp32 run's does.
    fp32.save_model(str(tmp_path / "fp32-final"))
    start, swarm_end, bf16_end, fp32_end = (
        load_file(d / "adapter_model.safetensors")
        for d in (initial, tmp_path / "final", tmp_path / "local-final", tmp_path / "fp32-final")
    )

    def apart(a: dict, b: dict) -> float:
        moved = sum(float((bf16_end[k] - start[k]).norm() ** 2) for k in start) ** 0.5
        return sum(float((a[k] - b[k]).norm() ** 2) for k in start) ** 0.5 / moved

    print("swarm vs local bf16", apart(swarm_end, bf16_end), "fp32 vs local bf16", apart(fp32_end, bf16_end))
    assert apart(swarm_end, bf16_end) < 0.5 * apart(fp32_end, bf16_end)
