"""Generation through the swarm (issue 13): greedy output equals local ``PeftModel.generate`` token for token, with
the trained adapter and with it disabled; a replica SIGKILLed mid-generation, or a session its peer dropped, costs a
replay of the prefix, not the output; generating never changes the adapter; bad input gets errors that say what to
do. The client connects while the peers still load, as a newcomer's does."""

from __future__ import annotations

import signal
import time

import peft
import pytest
import torch
import transformers
from failover_helpers import (
    assert_matches_local_peft,
    connect,
    finish_client,
    instrument,
    start_client,
    start_replicated_swarm,
    train,
    wait_for_text,
)

import swarm
from swarm.net.errors import RemoteError
from swarm.testing.faults import CallTap
from swarm.testing.localswarm import LocalSwarm

PROMPTS = torch.tensor([[5, 17, 99, 3, 42, 7], [8, 1, 250, 31, 64, 2]])


NEW_TOKENS = 10


PADDED = torch.tensor([[0, 0, 0, 9, 33, 120], [14, 2, 77, 5, 61, 200]])


PADDED_MASK = (torch.arange(6) >= torch.tensor([[3], [0]])).long()


def local_generate(model_dir, adapter_dir, adapter_on: bool = True, padded: bool = False) -> torch.Tensor:
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model = peft.PeftModel.from_pretrained(base, adapter_dir)
    model.eval()
    inputs = dict(input_ids=PADDED, attention_mask=PADDED_MASK) if padded else dict(input_ids=PROMPTS)
    with torch.no_grad():
        if adapter_on:
            return model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
        with model.disable_adapter():
            return model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)


def test_greedy_generation_equals_local_peft_and_survives_a_replica_kill(tiny_models, tmp_path):
    model_dir = tiny_models["llama"]
    with LocalSwarm(tmp_path / "swarm") as local:
        peers = start_replicated_swarm(local, model_dir)
        by_id = {p.peer_id: p for p in peers.values()}
        tap = CallTap()
        model = connect(local, model_dir, adapter="generate", call_hook=tap)
        try:
            train(model, steps=2)
            model.save_adapter(tmp_path / "trained")
            digests = model.replica_digests()
            tokens = model.generate(PROMPTS, max_new_tokens=NEW_TOKENS, do_sample=False)
            with model.disable_adapter():
                base_tokens = model.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
            assert model.replica_digests() == digests, "generation changed adapter state"

            killed: list[str] = []
            calls: list[str] = []

            def kill_mid_chain(peer, message, send):
                # a few tokens in (both spans hold sessions), the second span's peer dies: the chain breaks after
                # the first span, whose peer answers with the failure
                meta = message.meta
                if meta["method"] == "infer":
                    calls.append(peer.to_base58())
                    if len(calls) == 5 and not killed:
                        victim = meta["route"][0][0] if meta["route"] else peer.to_base58()
                        killed.append(victim)
                        by_id[victim].signal(signal.SIGKILL)
                return send(message)

            tap.arm(kill_mid_chain)
            after_kill = model.generate(PROMPTS, max_new_tokens=NEW_TOKENS, do_sample=False)
            assert killed, "the fault was never injected"
            assert any(r.during == "generation" for r in model.recoveries), model.recoveries
            sampled = model.generate(PROMPTS, max_new_tokens=4, do_sample=True, temperature=0.7, top_p=0.9)
            train(model, steps=3)  # training goes on after generating, on the replicas left
        finally:
            model.shutdown()
    expected = local_generate(model_dir, tmp_path / "trained")
    assert torch.equal(tokens, expected), (tokens, expected)
    assert torch.equal(after_kill, expected), (after_kill, expected)
    assert torch.equal(base_tokens, local_generate(model_dir, tmp_path / "trained", adapter_on=False))
    assert not torch.equal(tokens, base_tokens), "the trained adapter should change what is generated"
    assert sampled.shape == (2, PROMPTS.shape[1] + 4) and torch.equal(sampled[:, : PROMPTS.shape[1]], PROMPTS)


def test_a_dropped_session_is_replayed_and_bad_input_is_refused_clearly(tiny_models, tmp_path):
    model_dir = tiny_models["llama"]
    with LocalSwarm(tmp_path / "swarm") as local:
        local.start_dht()
        extra = ["--max-tokens", "48", "--inference-timeout", "1"]
        for name, span in {"a": "0:2", "b": "2:4"}.items():
            local.start_peer(model_dir, span, name=name, extra=extra, wait=False)
        tap = CallTap()
        model = connect(local, model_dir, adapter="sessions", patience=120, call_hook=tap)
        try:
            model.save_adapter(tmp_path / "initial")
            paused: list[int] = []

            def pause_once(method: str, peer_id: str, step: int) -> None:
                if method == "infer" and not paused:
                    paused.append(1)
                elif method == "infer" and len(paused) == 1:
                    paused.append(2)
                    time.sleep(2.5)  # longer than --inference-timeout: the first span's session expires

            sent: list[tuple[int, int, int]] = []  # (first block, position, tokens sent) of each infer request

            def record(peer, message, send):
                meta = message.meta
                if meta["method"] == "infer":
                    sent.append((meta["start"], meta["position"], message.tensors[0].shape[1]))
                return send(message)

            tap.arm(record)
            expected = model.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
            prompt = PROMPTS.shape[1]
            # the prompt once, then one token per round, each one request to the first span, which passes it on:
            # the keys and values stay on the peers
            assert sent == [(0, 0, prompt)] + [(0, prompt + i, 1) for i in range(NEW_TOKENS - 1)], sent
            instrument(tap, model, pause_once)
            replayed = model.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
            assert any(r.during == "generation" for r in model.recoveries), "the expired session was not replayed"
            with pytest.raises(RemoteError, match="--max-tokens of 48; shorten the prompt or max_new_tokens"):
                model.generate(torch.zeros(2, 20, dtype=torch.long), max_new_tokens=10)
            padded = model.generate(PADDED, attention_mask=PADDED_MASK, max_new_tokens=NEW_TOKENS)
            with pytest.raises(ValueError, match="padded on the left"):
                model.generate(PROMPTS, attention_mask=torch.tensor([[1] * 5 + [0], [1] * 6]))
            with pytest.raises(ValueError, match="does not support"):
                model.generate(PROMPTS, num_beams=2)
        finally:
            model.shutdown()
    assert torch.equal(replayed, expected)
    assert torch.equal(expected, local_generate(model_dir, tmp_path / "initial"))
    assert torch.equal(padded, local_generate(model_dir, tmp_path / "initial", padded=True)), padded


def test_a_reader_generates_while_the_trainer_trains_and_changes_nothing(tiny_models, tmp_path):
    """A second client opens the adapter with ``is_trainable=False`` (no LoRA config needed: it is the adapter's)
    while its trainer, another process, trains: it generates with each newest committed step, claims nothing (the
    trainer is never fenced and ends equal to local peft), and after the last step it generates what local peft
    generates with the final adapter."""
    model_dir = tiny_models["llama"]
    steps = 6
    with LocalSwarm(tmp_path / "swarm") as local:
        start_replicated_swarm(local, model_dir)
        # a trainer that takes its time (a slow data pipeline): the reader generates while steps are in progress
        trainer = start_client(local, model_dir, tmp_path, "trainer", "shared", "--steps", str(steps), "--pause", "1")
        wait_for_text(tmp_path / "trainer.log", "committed step 1", trainer)
        reader = swarm.SwarmModelForCausalLM.from_pretrained(
            model_dir, initial_peers=local.initial_peers, adapter="shared", is_trainable=False
        )
        try:
            read_at = []
            while trainer.poll() is None:
                reader.generate(PROMPTS, max_new_tokens=4)
                read_at.append(reader.step)
            finish_client(trainer, tmp_path / "trainer.log")
            final = reader.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
            assert reader.step == steps
            with pytest.raises(ValueError, match="is_trainable=False"):
                reader(**{"input_ids": PROMPTS, "labels": PROMPTS}).loss.backward()
        finally:
            reader.shutdown()
        with pytest.raises(swarm.AdapterStateLostError, match="no committed step"):
            swarm.SwarmModelForCausalLM.from_pretrained(
                model_dir, initial_peers=local.initial_peers, adapter="never-trained", is_trainable=False
            )
    assert read_at and read_at[0] < steps, f"the reader never generated while the trainer trained: {read_at}"
    assert_matches_local_peft(model_dir, tmp_path, steps=steps)
    assert torch.equal(final, local_generate(model_dir, tmp_path / "final"))
