"""A swarm of real processes on 127.0.0.1 (bootstrap DHT + peer daemons), for the demo, tests and benchmarks."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from swarm.testing.zygote import Forked, Zygote, die_with_parent
from swarm.testing.zygote import shared as shared_zygote

logger = logging.getLogger(__name__)
LEAVING = "leaving: announcing it"  # what a peer logs once it has begun to leave (peers/daemon.py)


class LocalSwarmError(RuntimeError):
    """A local process did not start; the message carries the tail of its log."""


@dataclass
class Process:
    """A child process with its log file."""

    name: str
    popen: subprocess.Popen | Forked  # Forked: a child of the fork server (swarm/testing/zygote.py)
    log: Path
    peer: bool = False  # a `swarm peer` daemon: it leaves with a grace, which a second SIGTERM skips

    @property
    def pid(self) -> int:
        return self.popen.pid

    def tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_for_line(self, needle: str, timeout: float) -> str:
        """Block until the log has a line containing ``needle``; raise with the log tail if it dies or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log.read_text(errors="replace") if self.log.exists() else ""
            for line in text.splitlines():
                if needle in line:
                    return line
            if self.popen.poll() is not None:
                raise LocalSwarmError(f"{self.name} exited with {self.popen.returncode}:\n{self.tail()}")
            time.sleep(0.1)
        raise LocalSwarmError(f"{self.name} did not print {needle!r} within {timeout:.0f}s:\n{self.tail()}")

    def signal(self, sig: int) -> None:
        """SIGKILL, SIGSTOP and SIGCONT hit the whole process group (the daemon, its DHT process and their p2pd),
        like a machine failing or freezing; other signals go to the daemon itself, which shuts its children down."""
        if self.popen.poll() is None:
            if sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCONT):
                os.killpg(self.pid, sig)
            else:
                os.kill(self.pid, sig)

    @property
    def peer_id(self) -> str:
        """The peer id a daemon printed once serving (``... serving blocks S:E of MODEL as PEER_ID``)."""
        return self.wait_for_line("serving blocks", timeout=0.1).rsplit(" as ", 1)[1].split()[0]

    def ask_to_leave(self) -> None:
        """SIGTERM (a frozen process is thawed first so it can leave)."""
        if self.popen.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL to the whole group."""
        self.ask_to_leave()
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.pid, signal.SIGKILL)  # whatever is left of the group, p2pd included
        except ProcessLookupError:
            pass
        self.popen.wait(timeout)


@dataclass
class LocalSwarm:
    """Starts and owns processes; ``close()`` kills every one of them by PID."""

    workdir: Path
    processes: list[Process] = field(default_factory=list)
    initial_peers: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    forks: Zygote | None = field(default_factory=shared_zygote)  # a fork server to start processes from, if any

    def _spawn(
        self,
        name: str,
        args: list[str],
        launcher: list[str] | None = None,
        prefix: list[str] | None = None,
        env: dict[str, str] | None = None,
        log: Path | None = None,
    ) -> Process:
        """Start ``swarm ARGS`` (or ``launcher ARGS``), after ``prefix`` if given (``ip netns exec NS``: the process
        keeps its PID, so it is still killed by PID), with ``env`` added to the swarm's environment. With a fork
        server (``forks``), ``swarm`` and ``python -m MODULE`` outside namespaces are forked from it when their
        environment is the server's (swarm/testing/zygote.py). Its output goes to ``log`` (default: ``NAME.log`` in
        the workdir)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = log or self.workdir / f"{name}.log"
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
            **self.env,
            **(env or {}),
        }
        launcher = launcher or [sys.executable, "-m", "swarm"]
        forked = self._fork(launcher, args, env, log) if prefix is None else None
        if forked is not None:
            process = Process(name, forked, log)
            self.processes.append(process)
            return process
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                [*(prefix or []), *launcher, *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        process = Process(name, popen, log)
        self.processes.append(process)
        return process

    def _fork(self, launcher: list[str], args: list[str], env: dict[str, str], log: Path) -> Forked | None:
        """``launcher ARGS`` from the fork server, if there is one and it takes it: ``python -m MODULE`` or
        ``python SCRIPT``, in the server's environment."""
        if self.forks is None or launcher[0] != sys.executable:
            return None
        if not self.forks.accepts(env):
            differing = self.forks.differing(env)
            why = f"its environment differs in {', '.join(differing)}" if differing else "the server has exited"
            logger.info("%s starts without the fork server (its imports take seconds): %s", args[:1], why)
            return None
        if len(launcher) == 3 and launcher[1] == "-m":
            return self.forks.start(launcher[2], args, env, log)
        if len(launcher) == 2 and launcher[1].endswith(".py"):
            return self.forks.start_script(launcher[1], args, env, log)
        return None

    def start_dht(
        self,
        extra: list[str] | None = None,
        timeout: float = 180.0,
        host: str = "127.0.0.1",
        prefix: list[str] | None = None,
    ) -> Process:
        dht = self._spawn("dht", ["dht", "--host", host, *(extra or [])], prefix=prefix)
        dht.wait_for_line("/ip4/", timeout)
        wanted = "/ip4/" if host == "0.0.0.0" else f"/ip4/{host}/"
        self.initial_peers = [ln for ln in dht.log.read_text().splitlines() if ln.startswith(wanted)]
        return dht

    def start_module(self, name: str, module: str, args: list[str], prefix: list[str] | None = None) -> Process:
        """``python -m MODULE ARGS`` as one of this swarm's processes (killed with it by ``close()``): a client, a
        link emulator; after ``prefix`` if given (``ip netns exec NS``)."""
        return self._spawn(name, args, [sys.executable, "-m", module], prefix)

    def start_script(
        self, name: str, script: str | Path, args: list[str], prefix: list[str] | None = None, log: Path | None = None
    ) -> Process:
        """``python SCRIPT ARGS`` as one of this swarm's processes (its output to ``log``, default ``NAME.log`` in
        the workdir)."""
        return self._spawn(name, args, [sys.executable, str(script)], prefix, log=log)

    def start_monitor(self, port: int = 0, refresh: float = 2.0, timeout: float = 180.0) -> tuple[Process, str]:
        """``swarm monitor`` on 127.0.0.1 (``port`` 0: any free one); returns it and the page's URL (no trailing
        slash)."""
        monitor = self._spawn(
            "monitor",
            ["monitor", "--initial-peers", *self.initial_peers, "--port", str(port), "--refresh", str(refresh)],
        )
        line = monitor.wait_for_line("swarm monitor on ", timeout)
        return monitor, line.split(" on ", 1)[1].split()[0].rstrip("/")

    def start_peer(
        self,
        model: str | Path,
        blocks: str | None,
        name: str | None = None,
        extra: list[str] | None = None,
        wait: bool = True,
        timeout: float = 300.0,
        launcher: list[str] | None = None,
        host: str = "127.0.0.1",
        prefix: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> Process:
        """Start ``swarm peer`` on 127.0.0.1 serving ``blocks`` (START:END, or None: the peer chooses); by default
        wait until it serves.

        ``launcher`` replaces ``python -m swarm`` (a test can start a patched peer this way); ``prefix`` runs it
        elsewhere (``ip netns exec NS``), listening on ``host``; ``env``: its own variables (other CPU kernels:
        ``ATEN_CPU_CAPABILITY=default``)."""
        name = name or f"peer{len(self.processes)}"
        args = [
            "peer",
            "--model",
            str(model),
            *(["--blocks", blocks] if blocks else []),
            "--host",
            host,
            "--initial-peers",
            *self.initial_peers,
            *(extra or []),
        ]
        peer = self._spawn(name, args, launcher, prefix, env)
        peer.peer = True
        if wait:
            peer.wait_for_line("serving blocks", timeout)
        return peer

    def start_peers(
        self, model: str | Path, spans: dict[str, str | None], extra: list[str] | None = None, timeout: float = 300.0
    ) -> dict[str, Process]:
        """Start one peer per name -> START:END (None: it chooses) at once; return when all serve."""
        peers = {name: self.start_peer(model, span, name=name, extra=extra, wait=False) for name, span in spans.items()}
        for peer in peers.values():
            peer.wait_for_line("serving blocks", timeout)
        return peers

    def close(self) -> None:
        """Ask every process to leave at once (clients first), then wait for each and SIGKILL what is left. No
        client is left to notice a peer's leave, so each peer is told twice: it skips its grace."""
        for process in reversed(self.processes):
            try:
                process.ask_to_leave()
            except OSError:  # already gone
                pass
        self._hurry([process for process in self.processes if process.peer])
        for process in reversed(self.processes):
            try:
                process.stop()
            except (OSError, subprocess.TimeoutExpired):  # already gone, or deaf to SIGKILL's wait: stop the rest
                logger.exception("could not stop %s (pid %d)", process.name, process.pid)

    @staticmethod
    def _hurry(peers: list[Process], timeout: float = 3.0) -> None:
        """SIGTERM again each peer that has begun to leave (a second signal before the first is handled would be
        the same one), within ``timeout``; a peer still starting leaves at its own pace."""
        waiting, deadline = list(peers), time.monotonic() + timeout
        while waiting and time.monotonic() < deadline:
            for process in list(waiting):
                if process.popen.poll() is not None:
                    waiting.remove(process)
                elif LEAVING in (process.log.read_text(errors="replace") if process.log.exists() else ""):
                    waiting.remove(process)
                    try:
                        os.kill(process.pid, signal.SIGTERM)
                    except ProcessLookupError:  # gone meanwhile
                        pass
            time.sleep(0.05)

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
