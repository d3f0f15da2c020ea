"""The blocks a peer gave up lately, announced as leaving beside what it serves: its announcement is one value that
replaces the last (swarm/net/records.py), so what it leaves must be said in every announcement for a while, or a
reader would see the blocks only vanish (a client finishing its micro-batches there, a balancer counting a joining
span the peer switched from)."""

from __future__ import annotations

from collections.abc import Iterable

from swarm.net.records import ServerRecord, runs


def _runs(blocks: Iterable[int]) -> list[range]:
    return [range(start, stop) for start, stop in runs(list(blocks))]


class LeavingBlocks:
    """Blocks given up, each with the leaving record that says so, announced for ``ttl`` seconds (a record's
    lifetime: as long as a leaving record of a value per block lived) unless served or loaded again."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self.blocks: dict[int, tuple[ServerRecord, float]] = {}  # block -> its leaving record, announced until

    def announce(
        self, leaving: list[tuple[ServerRecord, range]], current: list[tuple[ServerRecord, range]], now: float
    ) -> list[tuple[ServerRecord, range]]:
        """The entries of an announcement at ``now``: ``current`` (what the peer serves and loads) without the blocks
        given up just now (``leaving``), then the leaving records of every block given up within ``ttl`` that it
        does not announce otherwise."""
        self.blocks = {block: kept for block, kept in self.blocks.items() if kept[1] > now}
        fresh = {block for _, blocks in leaving for block in blocks}
        for record, blocks in leaving:
            for block in blocks:
                self.blocks[block] = (record, now + self.ttl)
        entries = [(record, run) for record, blocks in current for run in _runs(b for b in blocks if b not in fresh)]
        held = {block for _, blocks in entries for block in blocks}
        by_record: dict[int, tuple[ServerRecord, list[int]]] = {}
        for block, (record, _) in sorted(self.blocks.items()):
            if block not in held:
                by_record.setdefault(id(record), (record, []))[1].append(block)
        return entries + [(record, run) for record, blocks in by_record.values() for run in _runs(blocks)]
