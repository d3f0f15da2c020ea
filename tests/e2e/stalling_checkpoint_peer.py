"""`swarm peer` whose N-th checkpoint file write (N from SWARM_TEST_STALL_WRITE) stops half-way, so a test can
SIGKILL it in the middle of a checkpoint write. Everything else is the real peer."""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

from peers.checkpoints import CheckpointStore
from swarm.ops.cli import main

_calls = itertools.count(1)
_stall_at = int(os.environ["SWARM_TEST_STALL_WRITE"])


def _stalling_write(self, path: Path, data: bytes) -> None:
    if next(_calls) != _stall_at:
        return _real_write(self, path, data)
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
        f.flush()
    print(f"checkpoint write stalled: {path}", flush=True)
    time.sleep(3600)


_real_write = CheckpointStore._write_tmp
CheckpointStore._write_tmp = _stalling_write

if __name__ == "__main__":
    main()
