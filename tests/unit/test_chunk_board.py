"""The board a reducer posts its chunks on (peers/reduction/scatter.py): a replica that asks before the chunk is reduced
gets it once it is posted, one that asks for a chunk nobody posts gets nothing within its wait, and the board forgets
chunks of steps long past and holds a bounded number of unanswered asks."""

from __future__ import annotations

import asyncio

import torch

from peers.reduction import scatter
from peers.reduction.scatter import ChunkBoard
from swarm.net.reduction import ChunkKey


def _key(step: int, chunk: int = 0, adapter: str = "a") -> ChunkKey:
    return ChunkKey(adapter, step, 0, "digest", chunk, 3)


def test_an_ask_before_the_post_gets_the_chunk_and_an_unposted_one_gets_nothing():
    async def run() -> tuple:
        board = ChunkBoard()
        early = asyncio.create_task(board.take(_key(5), wait=5.0))
        await asyncio.sleep(0.01)
        board.post(_key(5), torch.ones(4))
        unposted = await board.take(_key(5, chunk=1), wait=0.05)
        return await early, unposted, await board.take(_key(5), wait=0.0)

    early, unposted, late = asyncio.run(run())
    assert torch.equal(early, torch.ones(4)) and torch.equal(late, torch.ones(4))
    assert unposted is None


def test_old_steps_are_forgotten_and_unanswered_asks_are_bounded(monkeypatch):
    monkeypatch.setattr(scatter, "MAX_WAITING", 8)

    async def run() -> tuple:
        board = ChunkBoard()
        board.post(_key(1), torch.zeros(2))
        board.post(_key(1 + scatter.KEPT_STEPS + 1), torch.zeros(2))
        forgotten = await board.take(_key(1), wait=0.0)
        for step in range(100):
            await board.take(_key(step, adapter="stranger"), wait=0.0)
        return forgotten, len(board)

    forgotten, held = asyncio.run(run())
    assert forgotten is None
    assert held <= 8 + 1
