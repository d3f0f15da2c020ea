"""Peers of different speeds on one machine: each in a cgroup of its own with a CPU quota (a fraction of one core).

Processes sharing the same cores run at whatever speed the scheduler gives them; a quota makes a peer slow on purpose
and by a known factor, so a benchmark can give a swarm fast and slow replicas and add compute by adding peers (as long
as the quotas add up to fewer cores than the machine has). Needs root and the cgroup ``cpu`` controller (v1 or v2).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)

V1_ROOT = Path("/sys/fs/cgroup/cpu")
V2_ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 10_000  # a short period: a quota-limited peer is slow on every request, not fast then stalled for 100 ms


class CpuQuotaError(RuntimeError):
    """No cgroup CPU controller this process may use."""


def _v2_has_cpu() -> bool:
    controllers = V2_ROOT / "cgroup.controllers"
    return controllers.exists() and "cpu" in controllers.read_text(errors="replace").split()


class CpuQuotas:
    """Cgroups under one parent, one per quota asked; ``close()`` removes them (once their processes are gone)."""

    def __init__(self, name: str):
        if os.geteuid() != 0:
            raise CpuQuotaError("CPU quotas need root (cgroups); run the benchmark as root")
        if (V1_ROOT / "cpu.cfs_quota_us").exists():
            self.parent, self.v2 = V1_ROOT / name, False
        elif _v2_has_cpu():
            self.parent, self.v2 = V2_ROOT / name, True
        else:
            raise CpuQuotaError("no cgroup cpu controller found (neither /sys/fs/cgroup/cpu nor cgroup v2 with cpu)")
        self.parent.mkdir(exist_ok=True)
        if self.v2:
            (self.parent / "cgroup.subtree_control").write_text("+cpu")
        self.groups: list[Path] = []

    def launcher(self, cores: float) -> list[str]:
        """A command prefix that runs ``python -m swarm ...`` inside a new cgroup limited to ``cores`` of one core's
        time: the shell moves itself into the group, then becomes the process (its children inherit the group)."""
        if not cores > 0:
            raise ValueError(f"a CPU quota must be positive, got {cores}")
        group = self.parent / f"q{len(self.groups)}"
        group.mkdir(exist_ok=True)
        quota = max(1000, int(cores * PERIOD_US))
        if self.v2:
            (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        else:
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(quota))
        self.groups.append(group)
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(group / "cgroup.procs"), sys.executable, "-m", "swarm"]

    def close(self, timeout: float = 10.0) -> None:
        """Remove the groups; a group whose processes have not exited yet is retried until ``timeout``."""
        deadline = time.monotonic() + timeout
        for group in [*self.groups, self.parent]:
            while True:
                try:
                    group.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if time.monotonic() > deadline:
                        logger.warning("could not remove cgroup %s: %s", group, e)
                        break
                    time.sleep(0.2)

    def __enter__(self) -> CpuQuotas:
        return self

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(OSError):
            self.close()
