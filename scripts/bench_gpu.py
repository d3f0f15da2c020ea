"""What a CUDA machine says about the swarm, in one command (issue 22): parity with local transformers + peft on the
device, LoRA training of SmolLM2 with nf4 and with bf16 base weights through a 4-peer local swarm on the one GPU,
and the 70B-shaped block benchmark there (2 blocks, NF4 and bf16, one micro-batch of 2048 tokens: seconds per block
forward, backward and commit; bytes per block and the span's peak against swarm/memory.py). Each part runs as a
process of its own under a time limit (a hung part is killed with every process it started, and the others still
run) and writes its summary rows as JSON; this driver prints them as one table and exits 1 if a part failed.

``--cpu`` runs the same parts on the CPU with tiny shapes (a random 4-block Llama instead of SmolLM2, on 2 peers
instead of 4, a small block of the 70B structure, fewer steps), in about two minutes on two cores:
tests/e2e/test_bench_gpu.py does, so that the command keeps working between the times a GPU is at hand. Without
``--cpu`` it refuses to start where torch sees no CUDA device.

Usage::

    bash scripts/bench_gpu.sh [--cpu] [--device cuda:N] [--workdir DIR] [--parts parity train mixed 70b-block]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
logger = logging.getLogger("bench_gpu")
PART_NAMES = ("parity", "train", "mixed", "70b-block")


@dataclass
class Part:
    """One benchmark process: what it runs, what it is expected to report, and how long it may take."""

    name: str
    modes: str  # the rows it reports, for the table when it reports none
    argv: list[str]
    timeout_s: float
    json: Path
    log: Path


@dataclass
class Row:
    """A line of the table."""

    part: str
    mode: str
    ok: bool
    figures: dict
    error: str | None
    wall_s: float


def plan(args: argparse.Namespace) -> list[Part]:
    """The parts with their command lines: CUDA shapes and step counts, or tiny ones with ``--cpu``. The time limits
    add up to 650 s on CUDA, with room above what each part needs (a lent GPU gives 15 minutes in all); on the CPU
    to 1600 s, for the suite's run beside other tests on two cores (there the mixed part once needed more than 90 s
    and the training part about 300 s; alone they take ~30 and ~60)."""
    device, cpu, work = ("cpu" if args.cpu else args.device), args.cpu, args.workdir
    python = [sys.executable]
    parts = {
        "parity": (
            "fp32",
            [
                *python,
                str(ROOT / "scripts" / "bench_gpu_parity.py"),
                *("--device", device, "--workdir", str(work / "parity")),
            ],
            300 if cpu else 90,
        ),
        "train": (
            "nf4 bf16",
            [
                *python,
                str(ROOT / "scripts" / "bench_gpu_train.py"),
                *("--device", device, "--model", "tiny" if cpu else "smollm2", "--steps", "3" if cpu else "5"),
                *("--replicas", "1" if cpu else "2"),  # on CPU, 2 peers instead of 4: the suite runs it on 2 cores
                *("--workdir", str(work / "train")),  # kept: the SmolLM2 folder is converted once
            ],
            600 if cpu else 200,
        ),
        "mixed": (
            "cpu+cuda nf4+bf16+fp32",
            [
                *python,
                str(ROOT / "scripts" / "bench_gpu_mixed.py"),
                *(["--cpu"] if cpu else ["--device", device]),
                *("--steps", "3" if cpu else "20", "--workdir", str(work / "mixed")),
            ],
            400 if cpu else 180,
        ),
        "70b-block": (
            "nf4 bf16",
            [
                *python,
                str(ROOT / "scripts" / "bench_70b_block.py"),
                *("--device", device, "--work-dir", str(work / "70b-block"), "--warmup", "1"),
                # on CPU 1 thread: the suite's 2 cores are shared, and a busy second thread slows each small op
                *(["--tiny", "--steps", "1", "--threads", "1"] if cpu else ["--seq", "2048", "--steps", "3"]),
            ],
            300 if cpu else 180,
        ),
    }
    out = []
    for name in args.parts:
        modes, argv, timeout_s = parts[name]
        result = work / f"{name}.json"
        out.append(Part(name, modes, [*argv, "--json", str(result)], timeout_s, result, work / "logs" / f"{name}.log"))
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL a part and everything it started (peers, their DHT processes and p2pd), each by its PID; the part
    first, so that it starts nothing more."""
    try:
        root = psutil.Process(pid)
        victims = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in victims:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass  # gone meanwhile
    psutil.wait_procs(victims, timeout=10)


def run_part(part: Part) -> list[Row]:
    """Run one part to its end or its time limit; its rows, or one failed row saying why there are none."""
    part.log.parent.mkdir(parents=True, exist_ok=True)
    part.json.unlink(missing_ok=True)
    logger.info("%s: %s (limit %d s; log %s)", part.name, " ".join(part.argv), part.timeout_s, part.log)
    started = time.monotonic()
    # this checkout first, for the part and the peers it starts (`python -m swarm`), whatever .venv's install points to
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with open(part.log, "wb") as log:
        process = subprocess.Popen(part.argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            code = process.wait(part.timeout_s)
            failure = None if code == 0 else f"exited with {code}; see {part.log}"
        except subprocess.TimeoutExpired:
            failure = f"timed out after {part.timeout_s:.0f} s; see {part.log}"
        finally:
            if process.poll() is None:  # past its limit, or the driver interrupted; not yet reaped, so still its PID
                kill_tree(process.pid)
    wall_s = time.monotonic() - started
    logger.info("%s: done in %.1f s%s", part.name, wall_s, f" ({failure})" if failure else "")
    if not part.json.exists():
        return [Row(part.name, part.modes, False, {}, failure or "wrote no results", wall_s)]
    return [
        Row(part.name, r["mode"], r["ok"] and failure is None, r["figures"], r.get("error") or failure, wall_s)
        for r in json.loads(part.json.read_text())
    ]


def figure(value: object) -> str:
    """Four significant digits (an exact 0 stays 0: parity's differences), thousands without a fraction."""
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value)


def table(rows: list[Row]) -> str:
    """Part, mode, result, the part's wall time and its figures (or why it failed), one row per line."""
    cells = [("part", "mode", "result", "part s", "figures")]
    for r in rows:
        text = ", ".join(f"{name} {figure(value)}" for name, value in r.figures.items())
        if r.error:
            text = f"{text}; {r.error.splitlines()[0]}" if text else r.error.splitlines()[0]
        cells.append((r.part, r.mode, "ok" if r.ok else "FAILED", f"{r.wall_s:.0f}", text))
    widths = [max(len(row[i]) for row in cells) for i in range(4)]
    lines = ("  ".join(c.ljust(w) for c, w in zip(row[:4], widths, strict=True)) + "  " + row[4] for row in cells)
    return "\n".join(lines)


def describe_device(args: argparse.Namespace) -> str:
    import torch

    if args.cpu:
        return f"cpu, tiny shapes ({os.cpu_count()} cores, torch {torch.__version__})"
    name = torch.cuda.get_device_name(args.device)
    return f"{args.device}: {name} (torch {torch.__version__}, CUDA {torch.version.cuda})"


def check_cuda(parser: argparse.ArgumentParser, device: str) -> None:
    """Refuse at once, saying why, where the parts could only fail: no CUDA device for this torch."""
    import torch

    if torch.cuda.is_available():
        return
    build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    parser.error(
        f"torch {torch.__version__} ({build}, {sys.executable}) sees no CUDA device, so there is nothing to run on "
        f"{device}. Run this on a CUDA machine with a CUDA build of torch (set SWARM_PYTHON to its interpreter for "
        "scripts/bench_gpu.sh), or pass --cpu for the tiny-shape run on the CPU."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run on the CPU with tiny shapes (the e2e test does)")
    parser.add_argument("--device", default="cuda", help="the CUDA device (without --cpu)")
    parser.add_argument("--workdir", type=Path, default=ROOT / "runs" / "bench-gpu", help="logs, results, models")
    parser.add_argument("--parts", nargs="+", choices=PART_NAMES, default=list(PART_NAMES))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if not args.cpu:
        check_cuda(parser, args.device)
    args.workdir = args.workdir.resolve()
    started = time.monotonic()
    rows = [row for part in plan(args) for row in run_part(part)]
    print(f"bench_gpu on {describe_device(args)}")
    print(table(rows))
    print(f"total {time.monotonic() - started:.0f} s; logs and results under {args.workdir}")
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
