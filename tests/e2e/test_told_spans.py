"""Issue 56, as it was seen: a bootstrap node and two peers told their spans (``--blocks 0:15``, ``--blocks 15:30``
of SmolLM2, 30 blocks) serving within a second of each other, TRL's SFTTrainer through ``swarm.SwarmSFTTrainer``.
Each peer used to move to 0:30 and back every 20-40 s, and every move cost the trainer a recovery. Now neither peer
moves and the trainer recovers from nothing. It passes beside two busy processes (``yes`` twice, by hand: 200 s
instead of 140; two earlier runs so loaded failed, once on a move over a live peer that missed its pings, since held
by the patient look's wait for a re-announcement), but CI runs it without them to keep its 40 minutes; the timing
that made told peers move is held in tests/integration/test_holding_still.py (a compute thread kept busy past the
ping), which CI runs as it is."""

from __future__ import annotations

import time

import datasets
import peft
import trl

import swarm
from swarm.spec import load_tokenizer
from swarm.testing import instructions
from swarm.testing.localswarm import LocalSwarm

TOLD = ("serving blocks", "moving", "announcing failed", "blocks have", "WARN")  # a failure's story, from the logs
QUIET_AFTER = 15.0  # seconds watched after training, with the client still connected (the first move came at 10 s)


def test_two_told_spans_train_with_sft_and_never_move(smollm2_dir, tmp_path):
    tokenizer = load_tokenizer(smollm2_dir)
    rows = instructions.read_rows()
    data = datasets.Dataset.from_list(
        [
            {
                "messages": [
                    {"role": "user", "content": r["instruction"]},
                    {"role": "assistant", "content": r["response"]},
                ]
            }
            for r in rows
        ]
    )
    with LocalSwarm(tmp_path / "swarm") as local:
        local.start_dht()
        peers = [
            local.start_peer(smollm2_dir, span, name=name, wait=False, extra=["--balance-interval", "2"])
            for name, span in (("low", "0:15"), ("high", "15:30"))
        ]
        model = swarm.SwarmModelForCausalLM.from_pretrained(  # while the peers still load
            smollm2_dir,
            initial_peers=local.initial_peers,
            adapter="told",
            lora_config=peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
            patience=300,
        )
        try:
            args = trl.SFTConfig(
                output_dir=str(tmp_path / "out"),
                max_steps=3,
                per_device_train_batch_size=2,
                gradient_accumulation_steps=2,
                learning_rate=2e-4,
                logging_steps=1,
                save_strategy="no",
                report_to=[],
                use_cpu=True,
                disable_tqdm=True,
            )
            swarm.SwarmSFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer).train()
            time.sleep(QUIET_AFTER)
            assert model.step == 3
            recoveries = list(model.recoveries)
        finally:
            model.shutdown()
        logs = {peer.name: peer.log.read_text().splitlines() for peer in peers}
    moved = {name: [line for line in lines if "moving from blocks" in line] for name, lines in logs.items()}
    story = {name: [line for line in lines if any(w in line for w in TOLD)] for name, lines in logs.items()}
    assert moved == {"low": [], "high": []}, story
    assert recoveries == [], recoveries
