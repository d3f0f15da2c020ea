"""The test suite's fork server (swarm/testing/zygote.py): a child is the process ``python -m swarm ARGS`` would have
been (its exit code, its own session and process group, its environment and log, SIGKILL's code), and a start whose
environment the server's imports could have read otherwise is not taken."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from swarm.testing.localswarm import LocalSwarm
from swarm.testing.zygote import SAME_ENV_EXCEPT, Forked, Zygote


@pytest.fixture(scope="module")
def server():
    forks = Zygote()
    yield forks
    forks.close()


def _wait_for_address(dht: Forked, log: Path, timeout: float = 60.0) -> None:
    """Until a forked ``swarm dht`` prints its address, it exits (a failure) or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while "/ip4/" not in log.read_text() and time.monotonic() < deadline:
        assert dht.poll() is None, log.read_text()
        time.sleep(0.1)


def test_a_child_runs_the_command_and_ends_with_its_code(server: Zygote, tmp_path: Path):
    env = {**server.base_env, "SWARM_MARK": "1"}
    keygen = server.start("swarm", ["keygen", str(tmp_path / "swarm.key")], env, tmp_path / "keygen.log")
    assert keygen.wait(60) == 0, (tmp_path / "keygen.log").read_text()
    assert (tmp_path / "swarm.key").stat().st_size > 0
    usage = server.start("swarm", ["peer"], env, tmp_path / "usage.log")
    assert usage.wait(60) == 2
    assert "--model" in (tmp_path / "usage.log").read_text()  # argparse's error, in the child's own log


def test_a_child_is_its_own_process_group_with_its_environment_and_dies_by_signal(server: Zygote, tmp_path: Path):
    dht = server.start("swarm", ["dht", "--host", "127.0.0.1"], server.base_env, tmp_path / "dht.log")
    try:
        _wait_for_address(dht, tmp_path / "dht.log")
        assert os.getpgid(dht.pid) == dht.pid and os.getsid(dht.pid) == dht.pid
        # the environment it was given is the one its code reads: status finds the DHT through SWARM_INITIAL_PEERS
        maddrs = [line for line in (tmp_path / "dht.log").read_text().splitlines() if line.startswith("/ip4/")]
        told = {**server.base_env, "SWARM_INITIAL_PEERS": " ".join(maddrs)}
        status = server.start("swarm", ["status"], told, tmp_path / "status.log")
        assert status.wait(120) == 0, (tmp_path / "status.log").read_text()
        untold = server.start("swarm", ["status"], server.base_env, tmp_path / "untold.log")
        assert untold.wait(60) == 2 and "SWARM_INITIAL_PEERS" in (tmp_path / "untold.log").read_text()
        os.killpg(dht.pid, signal.SIGKILL)
        assert dht.wait(30) == -signal.SIGKILL
    finally:
        if dht.poll() is None:
            os.killpg(dht.pid, signal.SIGKILL)


def test_a_child_killed_holding_hiveminds_lock_does_not_hang_the_next(server: Zygote, tmp_path: Path):
    """hivemind's MPFuture locks are semaphores made at import, in the server: each child gets its own."""
    holder = tmp_path / "hold.py"
    holder.write_text(
        "import time\nfrom hivemind.utils.mpfuture import MPFuture\n"
        "MPFuture._update_lock.acquire()\nprint('held', flush=True)\ntime.sleep(600)\n"
    )
    held = server.start_script(holder, [], server.base_env, tmp_path / "hold.log")
    deadline = time.monotonic() + 60
    while "held" not in (tmp_path / "hold.log").read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    os.killpg(held.pid, signal.SIGKILL)
    assert held.wait(30) == -signal.SIGKILL
    dht = server.start("swarm", ["dht", "--host", "127.0.0.1"], server.base_env, tmp_path / "dht.log")
    try:
        _wait_for_address(dht, tmp_path / "dht.log")
        assert "/ip4/" in (tmp_path / "dht.log").read_text(), "the DHT hung on a lock a killed child held"
    finally:
        if dht.poll() is None:
            os.killpg(dht.pid, signal.SIGKILL)


def test_only_what_the_imports_cannot_have_seen_differently_is_forked(server: Zygote):
    assert server.accepts(dict(server.base_env))
    assert server.accepts({**server.base_env, "SWARM_INITIAL_PEERS": "/ip4/127.0.0.1/tcp/1"})
    assert server.accepts({**server.base_env, "PYTEST_CURRENT_TEST": "another test (call)"})
    assert not server.accepts({**server.base_env, "ATEN_CPU_CAPABILITY": "default"})  # read by torch at import
    assert not server.accepts({**server.base_env, "HF_HOME": "/elsewhere"})  # read by huggingface_hub at import
    missing = dict(server.base_env)
    missing.pop("PATH", None)
    assert not server.accepts(missing)


def test_a_swarm_of_a_later_test_is_forked(server: Zygote, tmp_path: Path):
    """The server was started in an earlier test: this one's environment differs in what pytest names the current
    test, and its processes still come from the server."""
    assert os.environ.get("PYTEST_CURRENT_TEST") != server.base_env.get("PYTEST_CURRENT_TEST")
    with LocalSwarm(tmp_path, forks=server) as local:
        assert isinstance(local.start_dht().popen, Forked)


def test_no_earlier_test_left_a_variable_behind(first_environment: dict[str, str], tmp_path: Path):
    """In a whole run this module comes after every other: a variable an earlier test left in ``os.environ`` would
    show here, and would have sent every later start around the shared fork server (~12 s of imports each on 2
    cores). Where the run has the server (not SWARM_TEST_NO_FORKS=1), it still forks this test's start."""
    left = sorted(
        key
        for key in os.environ.keys() | first_environment.keys()
        if not key.startswith(SAME_ENV_EXCEPT) and os.environ.get(key) != first_environment.get(key)
    )
    assert not left, f"variables changed since the session started: {left}"
    with LocalSwarm(tmp_path) as local:
        if local.forks is not None:
            assert isinstance(local.start_dht().popen, Forked), local.forks.differing(dict(os.environ))
