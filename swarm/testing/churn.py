"""Churn, measured: a loopback swarm trains for a fixed time while a seeded chaos driver crashes, freezes, stops,
restarts and adds peers, side by side with a run of the same length without churn.

Each run starts its own bootstrap node and ``--peers`` peers (replication 2, each with a checkpoint dir and an
identity, choosing their spans as users' peers do); a client connects at once and trains a tiny Llama (or
``--model DIR``) with LoRA. Chaos events come at exponential intervals of mean ``--interval`` seconds: SIGKILL,
SIGSTOP then SIGCONT or SIGKILL, SIGTERM, two SIGKILLs at once, a new peer joining. Most strikes are aimed at a
phase: the peer the client calls with a forward, backward or commit, a peer pulling the standby copy the client
asked for, a peer applying a commit and writing its checkpoint, or a peer starting a move. Stricken peers restart
2 s later from their checkpoint dir. Printed per run: committed steps per minute (and the ratio to the run without
churn), steps lost (and whether a loss had an excuse: two holders of a block's state, servers or keepers of its
standby copies, down at once), the longest pauses between commits, moves and takeovers, checkpoint writes the strikes
tore, and whether the final adapter equals local peft trained on the same batches.

The runs and their table; ``scripts/bench_churn.py`` is the command, ``tests/e2e/test_churn.py`` runs it short.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import peft
import torch
from hivemind.p2p import PeerID
from safetensors.torch import load_file
from tqdm.auto import tqdm

import swarm
from swarm.client.calls import CallHook, Send
from swarm.net.message import Message
from swarm.net.protocol import method_of
from swarm.testing.chaos import (
    ChaosDriver,
    ChaosEvent,
    ChaosPeers,
    ChurnStats,
    Restart,
    ShadowStarts,
    chaos_schedule,
    count_moves,
)
from swarm.testing.faults import CallTap
from swarm.testing.localswarm import LocalSwarm

logger = logging.getLogger(__name__)
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "up_proj"])
HPARAMS = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
MICRO_BATCHES, SEED = 2, 11
PEER_FLAGS = ["--replication", "2", "--balance-interval", "2"]


def batches_for_step(step: int, vocab: int) -> list[dict[str, torch.Tensor]]:
    """The data of step ``step``, from the step alone: a step redone after a loss trains on the same batches."""
    g = torch.Generator().manual_seed(5000 + step)
    ids = [torch.randint(0, vocab, (2, 16), generator=g) for _ in range(MICRO_BATCHES)]
    return [dict(input_ids=i, attention_mask=torch.ones_like(i), labels=i) for i in ids]


@dataclass
class ChurnRun:
    """What one run measured."""

    seconds: float
    steps: int
    commit_times: list[float] = field(default_factory=list)
    steps_lost: int = 0
    lost_reports: list[str] = field(default_factory=list)
    recoveries: int = 0
    chaos: ChurnStats | None = None
    moves: int = 0
    takeovers: int = 0
    torn_writes: int = 0
    restarts: list[Restart] = field(default_factory=list)
    max_abs_diff: float | None = None
    dishonest: list[str] = field(default_factory=list)  # peers the client named dishonest
    error: str | None = None

    @property
    def steps_per_minute(self) -> float:
        return 60.0 * self.steps / max(self.seconds, 1e-9)

    @property
    def longest_pauses(self) -> list[float]:
        """The three longest waits between two commits (the first from the start), longest first."""
        times = [0.0, *self.commit_times]
        return sorted((b - a for a, b in zip(times, times[1:], strict=False)), reverse=True)[:3] or [self.seconds]

    def pauses_over(self, seconds: float) -> list[tuple[float, float]]:
        """Every wait between two commits longer than ``seconds``: (when it began, from the start; how long)."""
        times = [0.0, *self.commit_times]
        return [(a, b - a) for a, b in zip(times, times[1:], strict=False) if b - a > seconds]

    @property
    def parity(self) -> bool:
        """Equal to local peft (only expected when no step was lost: a lost step is an update some blocks missed)."""
        return self.max_abs_diff is not None and self.max_abs_diff <= 1e-4

    @property
    def excused(self) -> bool:
        """Whether two holders of one block's state (served or on standby) were down at once (the only failure a step
        may be lost to)."""
        return bool(self.chaos and self.chaos.shared_outages())


CLIENT_PATIENCE = 120.0
OTHER_KERNELS = {"ATEN_CPU_CAPABILITY": "default"}
LONG_PAUSE = 5.0  # seconds between two commits that the report lists one by one


AFTER_CHAOS = 300.0  # the most a run trains past its chaos window to reach its min_steps


def run_churn(
    model_dir: Path,
    workdir: Path,
    seconds: float,
    interval: float | None,
    seed: int = 0,
    peers: int = 5,
    span: int = 2,
    restart_nice: int = 0,
    min_copies: int = 2,
    shadow: bool = False,
    other_kernels: int = 0,
    min_steps: int = 0,
) -> ChurnRun:
    """Train for ``seconds`` under chaos at mean ``interval`` (None: no chaos); compare with local peft.
    ``min_steps``: train on past ``seconds`` (up to ``AFTER_CHAOS`` more) until the model has taken so many steps: on
    a slow machine restarts take longer than the schedule's gaps, and the chaos may leave too few steps to judge.
    ``restart_nice``: see ``ChaosPeers``; ``min_copies``: the client's (``from_pretrained``); ``shadow``: strike
    nothing, and start peers in a swarm of their own where the schedule would start them (``ShadowStarts``);
    ``other_kernels``: so many of the peers (every other one) run torch's portable CPU kernels
    (``ATEN_CPU_CAPABILITY=default``) in every life, as an older machine's would."""
    vocab = _vocab(model_dir)
    names = [f"peer{i}" for i in range(peers)]
    with LocalSwarm(workdir / "logs") as local, contextlib.ExitStack() as closing:
        closing.enter_context(_client_log(workdir / "logs" / "client.log"))
        fleet = _start_fleet(local, model_dir, workdir, names, span, restart_nice, other_kernels)
        schedule = chaos_schedule(seed, seconds, interval, names) if interval else []
        driver = ChaosDriver(fleet, [] if shadow else schedule, target_size=peers)
        closing.callback(driver.close)  # runs last: after the peers it restarted are stopped
        closing.callback(local.close)
        shadows = _shadow_starts(closing, workdir / "logs" / "shadow", model_dir, schedule if shadow else [], span)
        tap = CallTap()
        model = _connect(model_dir, local.initial_peers, seed, min_copies, tap)
        run = ChurnRun(seconds=0.0, steps=0)
        try:
            model.save_adapter(workdir / "initial")
            tap.arm(_strikes_see(driver))
            driver.start()
            shadows.start()
            started = time.monotonic()
            try:
                _train(model, vocab, started + seconds, run, started, min_steps)
            finally:
                run.seconds = time.monotonic() - started
                driver.stop()
                shadows.stop()
                _record_the_client(run, model)
            model.save_adapter(workdir / "final")
        except Exception:  # the boundary of a measured run: whatever ended the training loop is what it reports
            run.error = traceback.format_exc()
        finally:
            model.shutdown()
        run.chaos = driver.stats
        run.moves, run.takeovers, run.torn_writes = count_moves(fleet.logs())
        run.restarts = fleet.restart_times() + shadows.restart_times()
    if run.error is None:
        run.max_abs_diff = _diff_to_local(model_dir, workdir, run.steps, vocab)
    return run


def _start_fleet(
    local: LocalSwarm,
    model_dir: Path,
    workdir: Path,
    names: list[str],
    span: int,
    restart_nice: int,
    other_kernels: int,
) -> ChaosPeers:
    """The DHT, then every peer, ``other_kernels`` of them (every other one) on torch's portable CPU kernels."""
    local.start_dht()
    flags = [*PEER_FLAGS, "--num-blocks", str(span)]
    envs = dict.fromkeys(names[1::2][:other_kernels], OTHER_KERNELS)
    fleet = ChaosPeers(local, model_dir, flags, workdir / "peers", restart_nice, envs)
    for name in names:
        fleet.start(name)
    return fleet


def _connect(model_dir: Path, initial_peers: list[str], seed: int, min_copies: int, tap: CallTap):
    """The measured client, its calls seen by ``tap``."""
    return swarm.SwarmModelForCausalLM.from_pretrained(
        model_dir,
        initial_peers=initial_peers,
        adapter=f"churn-{seed}",
        lora_config=peft.LoraConfig(**LORA),
        seed=SEED,
        # Restarts take 25-40 s here (six peers and the client share two cores): a span whose servers are all
        # down twice in a row can outlast the default 60 s. The pause is reported (longest pauses).
        patience=CLIENT_PATIENCE,
        min_copies=min_copies,
        call_hook=tap,
    )


def _record_the_client(run: ChurnRun, model) -> None:
    """What the client saw: its steps, the steps it lost, its recoveries and the peers it found dishonest."""
    run.steps = model.step
    run.steps_lost = sum(e.steps for e in model.steps_lost)
    run.lost_reports = [str(e) for e in model.steps_lost]
    run.recoveries = len(model.recoveries)
    run.dishonest = [str(peer) for peer in model.dishonest]


def _shadow_starts(
    closing: contextlib.ExitStack, logs: Path, model_dir: Path, schedule: list[ChaosEvent], span: int
) -> ShadowStarts:
    """The starts of ``schedule`` in a swarm of their own (a bootstrap node of its own, only if there are any),
    closed with ``closing``."""
    local = closing.enter_context(LocalSwarm(logs))
    if schedule:
        local.start_dht()
    shadows = ShadowStarts(local, model_dir, schedule, f"0:{span}")
    closing.callback(shadows.stop)
    return shadows


@contextlib.contextmanager
def _client_log(path: Path):
    """The client's and the chaos driver's log lines (INFO and up) in ``path``, beside the peers' logs, so that a
    pause or a loss can be read back: which peer was struck when, and what the client did about it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    loggers = [logging.getLogger("swarm"), logging.getLogger("peers")]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.addHandler(handler)
        log.setLevel(min(log.getEffectiveLevel(), logging.INFO))
    try:
        yield
    finally:
        for log, level in zip(loggers, levels, strict=True):
            log.removeHandler(handler)
            log.setLevel(level)
        handler.close()


def _vocab(model_dir: Path) -> int:
    import transformers

    return transformers.AutoConfig.from_pretrained(model_dir).vocab_size


def _strikes_see(driver: ChaosDriver) -> CallHook:
    """Let phase-aimed strikes see each request the client is about to send."""

    def call(peer: PeerID, message: Message, send: Send) -> Message:
        driver.on_request(str(method_of(message.meta)), peer.to_base58())
        return send(message)

    return call


def _train(
    model: swarm.SwarmModelForCausalLM, vocab: int, deadline: float, run: ChurnRun, started: float, min_steps: int
) -> None:
    optimizer = swarm.RemoteOptimizer(model, **HPARAMS)
    with tqdm(desc="steps", unit="step", leave=False) as bar:
        while time.monotonic() < deadline or (model.step < min_steps and time.monotonic() < deadline + AFTER_CHAOS):
            for batch in batches_for_step(model.step, vocab):
                (model(**batch).loss / MICRO_BATCHES).backward()
            optimizer.step()
            optimizer.zero_grad()
            run.commit_times.append(time.monotonic() - started)
            bar.update(1)


def _diff_to_local(model_dir: Path, workdir: Path, steps: int, vocab: int) -> float:
    """Largest absolute difference between the swarm's adapter and local peft trained on the same batches."""

    # One thread: a second one spin-waits for a core the swarm's processes (or anything else) may hold, which slowed
    # hundreds of tiny steps 30-fold.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train_locally(model_dir, workdir, steps, vocab)
    finally:
        torch.set_num_threads(threads)


def _train_locally(model_dir: Path, workdir: Path, steps: int, vocab: int) -> float:
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    local = peft.PeftModel.from_pretrained(base, workdir / "initial", is_trainable=True)
    optimizer = torch.optim.AdamW([p for p in local.parameters() if p.requires_grad], **HPARAMS)
    for step in range(steps):
        for batch in batches_for_step(step, vocab):
            (local(**batch).loss / MICRO_BATCHES).backward()
        optimizer.step()
        optimizer.zero_grad()
    local.save_pretrained(workdir / "reference")
    ours = load_file(workdir / "final" / "adapter_model.safetensors")
    reference = load_file(workdir / "reference" / "adapter_model.safetensors")
    if ours.keys() != reference.keys():
        return float("inf")
    return max((ours[k] - reference[k]).abs().max().item() for k in ours)


def _restart_cell(run: ChurnRun) -> str:
    """Median and longest seconds from a restarted process's start to serving (and to joining the DHT)."""
    served = sorted(r.serving for r in run.restarts if r.serving is not None)
    joined = sorted(r.joined for r in run.restarts if r.joined is not None)
    if not served:
        return "-"
    return f"{statistics.median(served):.1f} ({statistics.median(joined):.1f}), max {served[-1]:.1f}"


def report(runs: dict[str, ChurnRun]) -> str:
    """The side-by-side table: one column per run."""
    base = runs.get("no churn")
    rows = {
        "minutes": lambda r: f"{r.seconds / 60:.1f}",
        "committed steps": lambda r: str(r.steps),
        "steps / minute": lambda r: f"{r.steps_per_minute:.1f}",
        "ratio to no churn": lambda r: f"{r.steps_per_minute / base.steps_per_minute:.2f}" if base else "-",
        "chaos events": lambda r: str(sum(r.chaos.applied.values())) if r.chaos else "0",
        "steps lost (reported)": lambda r: str(r.steps_lost),
        "unreported loss": lambda r: "none" if r.parity or r.steps_lost or r.error else "YES: differs from local",
        "2 holders down at once": lambda r: str(len(r.chaos.shared_outages())) if r.chaos else "0",
        "longest pauses (s)": lambda r: ", ".join(f"{p:.1f}" for p in r.longest_pauses),
        "client recoveries": lambda r: str(r.recoveries),
        "moves / takeovers": lambda r: f"{r.moves} / {r.takeovers}",
        "restart to serving (s)": _restart_cell,
        "torn checkpoint writes": lambda r: str(r.torn_writes),
        "max |swarm - local peft|": lambda r: f"{r.max_abs_diff:.2e}" if r.max_abs_diff is not None else "-",
        "equals local peft": lambda r: "yes" if r.parity else "NO",
        "training loop error": lambda r: "none" if r.error is None else r.error.strip().splitlines()[-1][:60],
    }
    width = max(len(k) for k in rows) + 2
    lines = ["".ljust(width) + "".join(name.rjust(24) for name in runs)]
    for label, cell in rows.items():
        lines.append(label.ljust(width) + "".join(cell(r).rjust(24) for r in runs.values()))
    for name, run in runs.items():
        if run.chaos:
            lines.append(f"{name}: events {dict(sorted(run.chaos.applied.items()))}")
        if pauses := run.pauses_over(LONG_PAUSE):
            listed = ", ".join(f"{length:.1f} s at {at:.0f} s" for at, length in pauses)
            lines.append(f"{name}: pauses over {LONG_PAUSE:g} s: {listed} (read the client's log at those times)")
    return "\n".join(lines)
