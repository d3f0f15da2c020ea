"""scripts/bench_gpu.sh, the one command meant for a CUDA machine, run here with ``--cpu`` (tiny shapes) so that it
cannot rot between the times a GPU is at hand: every part reports ok in one table, and nothing it started outlives
it. Without ``--cpu``, on a machine where torch sees no CUDA device, it refuses at once and says what to do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT = 1650.0  # three minutes alone on two cores, ten beside the seed's test; the parts' limits add up to 1600 s
MARKER = "SWARM_TEST_BENCH_GPU_RUN"  # in the environment of the run and of everything it starts (p2pd included)
EXPECTED = {
    ("parity", "fp32"),
    ("train", "nf4"),
    ("train", "bf16"),
    ("mixed", "cpu+cpu"),
    ("mixed", "nf4+bf16+fp32"),
    ("70b-block", "nf4"),
    ("70b-block", "bf16"),
}


def bench_gpu(*args: str, run_id: str, timeout: float) -> subprocess.CompletedProcess:
    """``bash scripts/bench_gpu.sh ARGS`` with this interpreter (no bootstrap), marked with ``run_id``; on a timeout,
    every process of the run is SIGKILLed by PID before the test fails."""
    env = {**os.environ, "SWARM_PYTHON": sys.executable, MARKER: run_id}
    process = subprocess.Popen(
        ["bash", str(ROOT / "scripts" / "bench_gpu.sh"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        for victim in of_run(run_id):
            try:
                victim.kill()
            except psutil.NoSuchProcess:
                pass  # gone meanwhile
        out, err = process.communicate()
        pytest.fail(f"bench_gpu.sh {' '.join(args)} ran past {timeout:.0f}s:\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def of_run(run_id: str) -> list[psutil.Process]:
    """The processes alive with the run's mark in their environment (other processes on the machine are left be)."""
    found = []
    for process in psutil.process_iter(["environ"]):
        if (process.info["environ"] or {}).get(MARKER) == run_id:
            found.append(process)
    return found


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_cpu_run_prints_one_table_with_every_part_ok(tmp_path):
    workdir = tmp_path / "bench"
    result = bench_gpu("--cpu", "--workdir", str(workdir), run_id=str(tmp_path), timeout=RUN_TIMEOUT)
    assert result.returncode == 0, (result.stdout, result.stderr[-5000:])
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["part", "mode", "result"])
    rows = [line.split()[:3] for line in lines[header + 1 :] if not line.startswith("total ")]
    assert {(part, mode) for part, mode, _ in rows} == EXPECTED, result.stdout
    assert all(status == "ok" for _, _, status in rows), result.stdout
    assert not of_run(str(tmp_path)), [p.cmdline() for p in of_run(str(tmp_path))]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: nothing to refuse")
def test_without_cuda_it_refuses_and_points_to_cpu(tmp_path):
    result = bench_gpu("--workdir", str(tmp_path), run_id=str(tmp_path), timeout=120)
    assert result.returncode == 2, (result.stdout, result.stderr[-3000:])
    assert "sees no CUDA device" in result.stderr and "--cpu" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not result.stdout, (result.stdout, result.stderr)
