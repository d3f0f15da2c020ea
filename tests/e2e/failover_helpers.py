"""The e2e side of the fault tests' recipe (swarm.testing.recipe): swarms of real processes, clients as processes of
their own, and what their logs say."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from hivemind.p2p import PeerID

import swarm
from swarm.client.calls import Send
from swarm.net.message import Message
from swarm.testing.faults import CallTap
from swarm.testing.localswarm import LocalSwarm, Process
from swarm.testing.recipe import (
    HPARAMS,
    LORA,
    MAX_GRAD_NORM,
    MICRO_BATCHES,
    STEPS,
    assert_matches_local_peft,
    assert_replicas_identical,
    batches_for_step,
    connect,
    reference_adapter,
    train,
)
from swarm.testing.zygote import Forked

__all__ = [  # the recipe, for the e2e tests that import it from here
    "HPARAMS",
    "LORA",
    "MAX_GRAD_NORM",
    "MICRO_BATCHES",
    "STEPS",
    "assert_matches_local_peft",
    "assert_replicas_identical",
    "batches_for_step",
    "connect",
    "reference_adapter",
    "train",
]


def start_swarm(
    local: LocalSwarm, model_dir: Path, spans: dict[str, str], extra: list[str] | None = None
) -> dict[str, Process]:
    """Bootstrap + one peer per name -> START:END, started in parallel; returns once all serve."""
    local.start_dht()
    peers = {
        name: local.start_peer(model_dir, blocks, name=name, extra=extra, wait=False) for name, blocks in spans.items()
    }
    for peer in peers.values():
        peer.wait_for_line("serving blocks", 180)
    return peers


def start_replicated_swarm(local: LocalSwarm, model_dir: Path) -> dict[str, Process]:
    """Two replicas of each half of the tiny model's 4 blocks."""
    return start_swarm(local, model_dir, {"a1": "0:2", "a2": "0:2", "b1": "2:4", "b2": "2:4"})


def start_client(
    local: LocalSwarm, model_dir: Path, out: Path, name: str, adapter: str, *extra: str, prefix: list[str] = ()
) -> subprocess.Popen | Forked:
    """tests/train_client.py as its own process (so it can be SIGKILLed), training ``adapter`` to step 4, its log
    ``OUT/NAME.log``; after ``prefix`` if given (``ip netns exec NS``)."""
    args = [
        "--model",
        str(model_dir),
        "--initial-peers",
        *local.initial_peers,
        "--adapter",
        adapter,
        "--steps",
        "4",
        "--out",
        str(out),
        *extra,
    ]
    script = Path(__file__).with_name("train_client.py")
    return local.start_script(name, script, args, prefix=list(prefix) or None, log=out / f"{name}.log").popen


def finish_client(client: subprocess.Popen | Forked, log: Path, timeout: float = 240) -> str:
    """Wait for a client to exit 0 (killing it if it does not) and return its log."""
    try:
        assert client.wait(timeout) == 0, log.read_text()[-3000:]
    finally:
        if client.poll() is None:
            os.killpg(client.pid, signal.SIGKILL)
    return log.read_text()


def wait_for_text(log: Path, needle: str, process: subprocess.Popen | Forked, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while needle not in (log.read_text() if log.exists() else ""):
        assert process.poll() is None, f"client exited early:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"client never printed {needle!r}:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


Hook = Callable[[str, str, int], None]


def instrument(tap: CallTap, model: swarm.SwarmModelForCausalLM, hook: Hook, next_hop: bool = False) -> None:
    """Call ``hook(method, peer_id, step)`` just before each request ``model`` sends from now on (``tap``: its call
    hook), to time a fault; with ``next_hop``, ``peer_id`` is the hop after the one called, named in the request's
    route (a chain's second peer, which only the first calls), and requests without a route are not shown."""

    def call(peer: PeerID, message: Message, send: Send) -> Message:
        meta = message.meta
        if not next_hop:
            hook(meta["method"], peer.to_base58(), model.step)
        elif meta.get("route"):
            hook(meta["method"], meta["route"][0][0], model.step)
        return send(message)

    tap.arm(call)


def moved_to(*peers: Process, span: str, timeout: float = 30) -> list[Process]:
    """The peers that finished moving to ``span`` (a move completes a grace period after it is announced)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        movers = [p for p in peers if f"now serving blocks {span}" in p.log.read_text()]
        if movers:
            return movers
        time.sleep(0.2)
    return []


def swarm_status(local: LocalSwarm, prefix: list[str] = (), options: list[str] = ()) -> str:
    """What `swarm status [options]` prints for this swarm, run as a user runs it (after ``prefix``: elsewhere)."""
    status = subprocess.run(
        [*prefix, sys.executable, "-m", "swarm", "status", *options, "--initial-peers", *local.initial_peers],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert status.returncode == 0, status.stderr
    return status.stdout


def status_groups(table: str) -> dict[int, str]:
    """Block -> the lines of its row in a `swarm status` table (a row covers a run of blocks, "0-1", and the
    standby and copies lines under it)."""
    groups: dict[int, str] = {}
    blocks: list[int] = []
    for line in table.splitlines():
        label = line.split()[0] if line.strip() else ""
        if label[:1].isdigit():
            first, _, last = label.partition("-")
            blocks = list(range(int(first), int(last or first) + 1))
            groups.update(dict.fromkeys(blocks, line))
        elif line.startswith(" ") and blocks:
            groups.update({b: f"{groups[b]}\n{line}" for b in blocks})
        else:
            blocks = []
    return groups
