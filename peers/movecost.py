"""What a move costs this peer, as it measures it: seconds to load a block from disk, and the download rate of the
shards it fetched (a model from the hub), turned into the ``MoveCost`` its records announce for the balancer."""

from __future__ import annotations

from swarm.hub import ModelSource
from swarm.net.records import MoveCost, runs
from swarm.spec import ModelSpec

# Until this peer has downloaded something, its link is taken for a home link of 100 Mbit/s.
ASSUMED_DOWNLOAD_RATE = 12.5e6  # bytes/s
MIN_TIMED_BYTES = 1 << 20  # a download smaller than this says more about latency than about the link


class MoveTimer:
    """Load and download times as they are measured, the latest of each kept."""

    def __init__(self, source: ModelSource, spec: ModelSpec):
        self.source, self.spec = source, spec
        self.load_per_block = 0.0
        self.download_rate = ASSUMED_DOWNLOAD_RATE

    def loaded(self, blocks: int, seconds: float) -> None:
        if blocks > 0:
            self.load_per_block = seconds / blocks

    def downloaded(self, files: list[str], seconds: float) -> None:
        """``files`` (relative to the model's folder) came in ``seconds``."""
        nbytes = sum((self.source.folder / file).stat().st_size for file in files)
        if nbytes >= MIN_TIMED_BYTES and seconds > 0:
            self.download_rate = nbytes / seconds

    def cost(self) -> MoveCost:
        """What moving onto one more block costs now: its load, plus its shards' download where they are not on
        disk."""
        num_blocks = self.spec.num_blocks
        download = self.source.bytes_per_block(num_blocks) / self.download_rate
        on_disk = self.source.blocks_on_disk(self.spec.weight_files, num_blocks)
        return MoveCost(self.load_per_block, self.load_per_block + download, runs(on_disk))
