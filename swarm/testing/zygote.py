"""A fork server for the test suite's processes: one Python that has imported torch, transformers, peft and hivemind
once, and forks a child for each ``swarm ...`` (or ``python -m MODULE ...``, ``python SCRIPT ...``) a test starts.

Each child is a real process, as ``python -m swarm ARGS`` would be: its own PID, session and process group (SIGKILL
and SIGSTOP reach it and its DHT process and p2pd), its own log, the environment it was given, and it dies with the
server, which dies with the test run. What it skips is ~5 s of imports per start on two cores, most of an e2e test's
start-up. Only what the imports cannot have seen differently goes through it: a start whose environment differs from
the server's in anything but ``SWARM_*`` variables and pytest's name of the current test (other CPU kernels, another
Hugging Face cache or endpoint: read at import), or that runs inside a network namespace, is started the ordinary way
(``LocalSwarm`` decides).

The protocol is JSON lines over the server's stdin and stdout: a request ``{"module" or "script", "argv", "env", "log",
"cwd"}`` is answered ``{"pid"}``; each child's end is told ``{"exit", "code"}`` (the code as ``Popen.returncode``: -N
for signal N)."""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import runpy
import selectors
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

# What the server imports before it forks: the modules every swarm process spends its start-up on.
PRELOAD = ("torch", "transformers", "peft", "hivemind", "peers.daemon", "swarm.ops.cli", "swarm.client.model")
# Variables a child may have otherwise: read when used, never at import (pytest sets the current test's name).
SAME_ENV_EXCEPT = ("SWARM_", "PYTEST_CURRENT_TEST")
REAP_EVERY = 0.05  # seconds between the server's looks for children that ended


def die_with_parent() -> None:
    """In a child: get SIGKILL if the process that started it dies (Linux), so no swarm outlives its owner. Linux
    sends it when the starting *thread* ends: start processes from threads that outlive them."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


# --- the server (python -m swarm.testing.zygote) -------------------------------------------------------------------


def _child(request: dict, ready: int) -> None:
    """In the forked child: become the process the request asks for, then exit with its code. Once it has its own
    session and its log it says so on ``ready`` (the server answers the pid only then: a test may SIGKILL the group at
    once). Its stdin and stdout, the server's channel, become /dev/null and the log; ``random`` reseeds itself at a
    fork, torch is reseeded here."""
    code = 1
    try:
        os.setsid()
        die_with_parent()
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(devnull)
        os.write(ready, b"1")
        os.close(ready)
        import torch
        from hivemind.utils.mpfuture import MPFuture

        torch.seed()
        MPFuture.reset_backend()  # its locks are semaphores shared by every fork: one child killed holding one
        # would hang the DHT start of every later child
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        if "script" in request:  # python SCRIPT ARGS: its folder first on the path, as the interpreter puts it
            sys.argv = [request["script"], *request["argv"]]
            sys.path.insert(0, str(Path(request["script"]).resolve().parent))
            runpy.run_path(request["script"], run_name="__main__")
        else:
            sys.argv = [request["module"], *request["argv"]]
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:  # the child's own crash: printed to its log, as a process's would be
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    """Import, then fork a child per request line on stdin; tell each child's pid, then its end."""
    die_with_parent()
    for module in PRELOAD:
        __import__(module)
    requests, replies = sys.stdin.fileno(), sys.stdout.fileno()
    os.set_blocking(requests, False)
    selector = selectors.DefaultSelector()
    selector.register(requests, selectors.EVENT_READ)
    pending, children = b"", set()

    def tell(message: dict) -> None:
        os.write(replies, (json.dumps(message) + "\n").encode())

    tell({"ready": True})
    while True:
        if selector.select(REAP_EVERY):
            chunk = os.read(requests, 1 << 16)
            if not chunk:
                break  # the test run closed its end: it is over
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                ready_in, ready_out = os.pipe()
                pid = os.fork()
                if pid == 0:
                    os.close(ready_in)
                    _child(json.loads(line), ready_out)
                os.close(ready_out)
                os.read(ready_in, 1)  # b"" if it died before
                os.close(ready_in)
                children.add(pid)
                tell({"pid": pid})
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                tell({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


# --- the client, in the test run ------------------------------------------------------------------------------------


class Forked:
    """A child of the server, as much of ``subprocess.Popen`` as the harness uses: ``pid``, ``poll``, ``wait``,
    ``returncode``."""

    def __init__(self, server: Zygote, pid: int, args: list[str]):
        self.server, self.pid, self.args = server, pid, args

    @property
    def returncode(self) -> int | None:
        return self.server.ended.get(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode


class Zygote:
    """The server process and the thread that reads its replies."""

    def __init__(self) -> None:
        self.base_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.base_env.setdefault("OMP_NUM_THREADS", "2")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "swarm.testing.zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=self.base_env,
            preexec_fn=die_with_parent,
        )
        self.ended: dict[int, int] = {}
        self.lock = threading.Lock()
        self.started: list[int] = []
        self.arrived = threading.Condition()
        self.ready = threading.Event()
        threading.Thread(target=self._read, name="zygote-replies", daemon=True).start()
        if not self.ready.wait(120):
            self.close()
            raise RuntimeError("the fork server did not start within 120 s")

    def _read(self) -> None:
        for line in self.process.stdout:
            message = json.loads(line)
            with self.arrived:
                if "ready" in message:
                    self.ready.set()
                elif "pid" in message:
                    self.started.append(message["pid"])
                else:
                    self.ended[message["exit"]] = message["code"]
                self.arrived.notify_all()

    def differing(self, env: dict[str, str]) -> list[str]:
        """The variables in which ``env`` differs from the server's where imports may read them: a child with any is
        not the process its own interpreter would have been."""
        keys = {k for k in env.keys() | self.base_env.keys() if not k.startswith(SAME_ENV_EXCEPT)}
        return sorted(k for k in keys if env.get(k) != self.base_env.get(k))

    def accepts(self, env: dict[str, str]) -> bool:
        """Whether a child with ``env`` is the process its own interpreter would have been."""
        return self.process.poll() is None and not self.differing(env)

    def start(self, module: str, argv: list[str], env: dict[str, str], log: Path) -> Forked:
        """``python -m MODULE ARGV`` with ``env``, its output to ``log``."""
        return self._start({"module": module}, argv, env, log, [sys.executable, "-m", module, *argv])

    def start_script(self, script: str | Path, argv: list[str], env: dict[str, str], log: Path) -> Forked:
        """``python SCRIPT ARGV`` with ``env``, its output to ``log``."""
        return self._start({"script": str(script)}, argv, env, log, [sys.executable, str(script), *argv])

    def _start(self, what: dict, argv: list[str], env: dict[str, str], log: Path, args: list[str]) -> Forked:
        request = {**what, "argv": argv, "env": env, "log": str(log), "cwd": os.getcwd()}
        with self.lock, self.arrived:
            self.process.stdin.write((json.dumps(request) + "\n").encode())
            self.process.stdin.flush()
            if not self.arrived.wait_for(lambda: self.started or self.process.poll() is not None, 60):
                raise RuntimeError("the fork server did not answer within 60 s")
            if not self.started:
                raise RuntimeError(f"the fork server exited with {self.process.returncode}")
            pid = self.started.pop(0)
        return Forked(self, pid, args)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


_shared: Zygote | None = None
_enabled = False


def enable() -> None:
    """Let ``LocalSwarm`` start its processes through one shared server (the test suite does, at its start)."""
    global _enabled
    _enabled = True


def shared() -> Zygote | None:
    """The shared server, started at the first use once enabled; None when not enabled."""
    global _shared
    if not _enabled:
        return None
    if _shared is None or _shared.process.poll() is not None:
        _shared = Zygote()
        atexit.register(_shared.close)
    return _shared


if __name__ == "__main__":
    serve()
