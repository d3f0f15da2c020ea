"""Promise 12 at three replicas, on real peers in this process: a block whose step's gradients are held by three or more
replicas is reduced in chunks (peers/reduction/scatter.py), each replica reducing one chunk and gathering the others,
and every replica applies the bits the direct exchange would: the adapter equals local peft, the replicas agree. A
replica that hands the others a wrong reduced chunk poisons nothing: the vote finds the disagreement, the step is
committed again the direct way, and the adapter still equals local peft. Under two busy processes where a liar is in the
swarm (``cpu_load``)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

import swarm
from swarm.testing.dishonest import CorruptReducedChunks
from swarm.testing.recipe import (
    HPARAMS,
    MAX_GRAD_NORM,
    MICRO_BATCHES,
    assert_matches_local_peft,
    assert_replicas_identical,
    batches_for_step,
    connect,
)

STEPS = 3
REPLICAS = {"r1": "0:2", "r2": "0:2", "r3": "0:2", "tail": "2:4"}


def _rows(step: int) -> list[dict[str, torch.Tensor]]:
    """The recipe's micro-batches of ``step`` cut into one-row micro-batches: the same gradient once each is weighted
    by its share, and enough micro-batches in flight at once for the three replicas of blocks 0:2 to each hold some."""
    return [
        {key: value[row : row + 1] for key, value in batch.items()}
        for batch in batches_for_step(step)
        for row in (0, 1)
    ]


def _train(model: swarm.SwarmModelForCausalLM, check_replicas: bool = True) -> None:
    optimizer = swarm.RemoteOptimizer(model, **HPARAMS)
    while model.step < STEPS:
        rows = _rows(model.step)
        model.train_step(rows, accumulation=len(rows), max_in_flight=len(rows))
        model.clip_grad_norm_(MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad()
        if check_replicas:
            assert_replicas_identical(model)


def _wait_all_serve(model: swarm.SwarmModelForCausalLM, count: int, timeout: float = 30.0) -> None:
    router, deadline = model.session.calls.router, time.monotonic() + timeout
    while len(router.live_servers()) < count:
        assert time.monotonic() < deadline, f"the client did not see {count} servers in {timeout:.0f}s"
        time.sleep(0.2)
        router.refresh()


def _train_and_save(local, model_dir: Path, adapter: str, tmp_path: Path) -> None:
    """Connect once every peer serves, save the initial adapter, train the steps, save the final one."""
    model = connect(local, model_dir, adapter=adapter)
    try:
        _wait_all_serve(model, len(REPLICAS))
        model.save_adapter(tmp_path / "initial")
        _train(model)
        model.save_adapter(tmp_path / "final")
    finally:
        model.shutdown()


def test_three_replicas_reduce_a_blocks_gradient_in_chunks_to_the_bits_of_local_peft(
    inprocess_swarm, tiny_models, tmp_path
):
    model_dir = tiny_models["llama"]
    local = inprocess_swarm()
    peers = local.start_peers(REPLICAS)
    _train_and_save(local, model_dir, "chunked", tmp_path)
    gathered = {
        name: peers[name].daemon.standing.parts.service.reduction.chunked.gathered for name in ("r1", "r2", "r3")
    }
    assert sum(gathered.values()) > 0, f"no replica gathered a reduced gradient in chunks: {gathered}"
    assert_matches_local_peft(model_dir, tmp_path, steps=STEPS)
    assert MICRO_BATCHES * 2 == len(_rows(0))


def test_a_replica_handing_on_a_wrong_reduced_chunk_poisons_nothing(inprocess_swarm, tiny_models, tmp_path, cpu_load):
    """The liar reduces its chunk honestly and applies it, but hands the other two replicas a perturbed one: they
    apply the same wrong gradient and outvote it, so a vote alone would keep the poisoned step; the disagreement
    sends the step round again with every partial sum fetched and audited (the direct exchange), and every step ends
    with the replicas agreeing on the honest bits: the adapter equals local peft."""
    model_dir = tiny_models["llama"]
    local = inprocess_swarm()
    local.start_peers(REPLICAS, behaviours={"r2": CorruptReducedChunks()})
    _train_and_save(local, model_dir, "lying-chunk", tmp_path)
    assert_matches_local_peft(model_dir, tmp_path, steps=STEPS)
