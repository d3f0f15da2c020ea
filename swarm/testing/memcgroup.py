"""A peer with a memory limit of its own: a cgroup (v1 ``memory`` controller) that its process tree runs in, whose
usage and peak the kernel counts and whose limit it enforces (past it, reclaim, then the OOM killer). How a test
holds a peer to the memory the model says it needs. Needs root and the v1 memory controller."""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)

ROOT = Path("/sys/fs/cgroup/memory")
# glibc returns freed memory to the system at once and keeps one arena, so that the group's usage follows the
# tensors alive (else freed blocks stay resident and are reused: scripts/bench_memory.py measures the same way)
TIGHT_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0", "MALLOC_ARENA_MAX": "1"}


def unavailable() -> str | None:
    """Why a memory group cannot be made here (None: it can)."""
    if os.geteuid() != 0:
        return "memory limits need root (cgroups)"
    if not (ROOT / "memory.limit_in_bytes").exists():
        return f"no cgroup v1 memory controller at {ROOT}"
    return None


class MemoryGroup:
    """One cgroup for one process tree: started through ``launcher()``, limited with ``limit()``, read with
    ``usage()`` and ``peak()``; ``close()`` removes it once its processes are gone."""

    def __init__(self, name: str):
        self.path = ROOT / f"swarm-{os.getpid()}-{name}"
        self.path.mkdir()

    def launcher(self) -> list[str]:
        """A command prefix that runs ``python -m swarm ...`` inside the group: the shell moves itself in, then
        becomes the process (its children, the DHT process and p2pd, inherit the group)."""
        return [
            "sh",
            "-c",
            'echo $$ > "$0" && exec "$@"',
            str(self.path / "cgroup.procs"),
            sys.executable,
            "-m",
            "swarm",
        ]

    def _read(self, name: str) -> int:
        return int((self.path / name).read_text())

    def usage(self) -> int:
        return self._read("memory.usage_in_bytes")

    def peak(self) -> int:
        return self._read("memory.max_usage_in_bytes")

    def reset_peak(self) -> None:
        (self.path / "memory.max_usage_in_bytes").write_text("0")

    def failures(self) -> int:
        """How many times the group hit its limit."""
        return self._read("memory.failcnt")

    def limit(self, nbytes: int) -> None:
        (self.path / "memory.limit_in_bytes").write_text(str(int(nbytes)))

    def close(self, timeout: float = 10.0) -> None:
        """Remove the group; retried until ``timeout`` while its processes exit."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as e:
                if time.monotonic() > deadline:
                    logger.warning("could not remove cgroup %s: %s", self.path, e)
                    return
                time.sleep(0.2)
