"""The seed's story on one machine: six self-placing peers of 34 blocks (``--num-blocks 34``, no ``--blocks``,
replication 2, rebalancing on) on a random Llama of the seed model's 80 blocks (tiny width, so that 80 blocks run on
a couple of cores), a client that connects while they load and trains with pipelined micro-batches, and one peer
SIGKILLed after some steps.

What is watched, as the peers themselves see it: every ``every`` seconds a ``Watch`` reads the block records and pings
every peer they name (``swarm.net.view.observe``, through ``swarm status``'s ``Observer``) and counts, per block, the
live peers announcing it online; the moves come from the peers' logs ("moving from blocks"). From the samples: when
every block first had two servers, when the peers left after the kill got back to the best their spans allow, moves
per peer, and the step rate before the kill and after the recovery.

Five spans of 34 cannot put two servers on every one of 80 blocks: blocks 0 and 79 each need two spans of their own
([0:34] twice, [46:80] twice), which leaves one span for blocks 34-45. ``best_doubled`` counts what a number of spans
allows at most (68 of 80 blocks for five); a swarm after the kill is measured against that.

``scripts/bench_seed.py`` runs the whole story and prints its timeline; ``tests/e2e/test_seed.py`` runs it short.
"""

from __future__ import annotations

import logging
import signal
import statistics
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import peft
import torch
from safetensors.torch import load_file

from swarm.ops.status import Observer
from swarm.testing.chaos import MOVE_LINE
from swarm.testing.localswarm import LocalSwarm, Process

logger = logging.getLogger(__name__)

PEERS, SPAN, LAYERS, HIDDEN = 6, 34, 80, 32  # the seed case (docs/benchmarks/scale.md), at a tiny width
MOVED_LINE = "now serving blocks"  # a move that finished (peers/mover.py); "moving from blocks" starts one
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "up_proj"])
HPARAMS = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
MAX_GRAD_NORM, SEED = 1.0, 11


def peer_flags(span: int = SPAN, balance_interval: float = 5.0, replication: int = 2) -> list[str]:
    """A self-placing peer's flags: no ``--blocks``; rebalancing stays on (the default)."""
    return ["--num-blocks", str(span), "--replication", str(replication), "--balance-interval", str(balance_interval)]


def start_peers(local: LocalSwarm, model_dir: Path, peers: int, flags: list[str]) -> dict[str, Process]:
    """``peers`` peers started at once, without waiting for any of them to serve."""
    return {
        f"peer{i}": local.start_peer(model_dir, None, name=f"peer{i}", extra=flags, wait=False) for i in range(peers)
    }


def best_doubled(peers: int, span: int, layers: int) -> int:
    """The most blocks that ``peers`` spans of ``span`` blocks can give two servers each, over ``layers`` blocks.

    With the starts sorted, a block has two servers exactly where two consecutive spans overlap: the blocks with two
    servers are the union of [s(j+1), s(j) + span), whose two ends only grow with j. A dynamic program over the last
    two starts counts each overlap's new blocks."""
    span = min(span, layers)
    if peers < 2:
        return 0
    starts = range(layers - span + 1)
    best = {(a, b): max(0, a + span - b) for a in starts for b in starts if a <= b}
    for _ in range(peers - 2):
        grown: dict[tuple[int, int], int] = {}
        for (a, b), count in best.items():
            for c in range(b, layers - span + 1):
                total = count + max(0, b + span - max(c, a + span))
                if total > grown.get((b, c), -1):
                    grown[(b, c)] = total
        best = grown
    return max(best.values())


def moves_by_peer(peers: dict[str, Process]) -> dict[str, tuple[int, int]]:
    """Per peer, (moves started, moves finished) from its log: "moving from blocks" and "now serving blocks"."""
    out = {}
    for name, peer in peers.items():
        text = peer.log.read_text(errors="replace") if peer.log.exists() else ""
        out[name] = (len(MOVE_LINE.findall(text)), text.count(MOVED_LINE))
    return out


@dataclass(frozen=True)
class Sample:
    """One look at the swarm: seconds from the start, live peers, live online servers per block, moves begun so far
    (all peers), steps committed so far, and the step rate (steps a minute over the last ``RATE_WINDOW`` s; None
    before two commits)."""

    at: float
    alive: frozenset[str]  # peer ids (base58) that answered
    servers: tuple[int, ...]
    moves: int
    steps: int
    rate: float | None

    def blocks_with(self, servers: int, at_least: bool = False) -> int:
        return sum(1 for n in self.servers if (n >= servers if at_least else n == servers))

    @property
    def doubled(self) -> int:
        return self.blocks_with(2, at_least=True)

    def row(self) -> str:
        rate = f"{self.rate:6.1f}" if self.rate is not None else "     -"
        return (
            f"{self.at:7.1f} {len(self.alive):5d} {self.blocks_with(0):4d} {self.blocks_with(1):4d} {self.doubled:4d}"
            f" {self.moves:6d} {self.steps:6d} {rate}"
        )


# A peer that missed the first ping (3 s) gets a second, of this many seconds: on two loaded cores a busy peer can miss
# one, and the look would show its blocks short of a server (a dead peer's connection is closed: it fails at once).
RETRY = 5.0
HEADER = "      t peers   =0   =1  >=2  moves  steps  steps/min"
RATE_WINDOW = 30.0


@dataclass
class Watch:
    """Samples the swarm every ``every`` seconds in a thread of its own (see the module's docstring); ``events`` are
    the story's marks (connected, kill, ...), ``commits`` the seconds at which each step committed (the trainer
    appends them). ``echo``: called with each sample's row and each event, as they come."""

    local: LocalSwarm
    peers: dict[str, Process]
    num_blocks: int
    started: float = field(default_factory=time.monotonic)
    every: float = 2.0
    echo: Callable[[str], None] | None = None
    samples: list[Sample] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)
    commits: list[float] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def now(self) -> float:
        return time.monotonic() - self.started

    def start(self) -> Watch:
        # Its DHT process is forked here, not in the thread: forked from the thread while the client forked its own
        # DHT process, the client's child died and DHT.__init__ waited for it forever (a bench_seed run, once).
        observer = Observer(self.local.initial_peers, None)
        self._thread = threading.Thread(target=self._run, args=(observer,), name="seed-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30.0)

    def mark(self, text: str) -> float:
        at = self.now()
        self.events.append((at, text))
        if self.echo:
            self.echo(f"{at:7.1f}  -- {text}")
        return at

    def committed(self) -> None:
        self.commits.append(self.now())

    def rate(self, since: float, until: float | None = None) -> float | None:
        """Steps a minute committed in (since, until]: from the first commit in it to the last (None: under two)."""
        until = self.now() if until is None else until
        times = [t for t in self.commits if since < t <= until]
        if len(times) < 2:
            return None
        return 60.0 * (len(times) - 1) / max(times[-1] - times[0], 1e-9)

    def first(self, holds: Callable[[Sample], bool], since: float = 0.0) -> Sample | None:
        return next((s for s in self.samples if s.at >= since and holds(s)), None)

    def _run(self, observer: Observer) -> None:
        try:
            model = self._model_name(observer)
            while model is not None and not self._stop.is_set():
                began = time.monotonic()
                try:
                    view = observer.observe(model, self.num_blocks, committed=False, retry_timeout=RETRY).view
                except Exception as e:  # a look that failed (the DHT busy): the next one tries again
                    logger.warning("could not look at the swarm: %s", e)
                else:
                    self._add(view)
                self._stop.wait(max(0.0, self.every - (time.monotonic() - began)))
        finally:
            observer.close()

    def _model_name(self, observer: Observer) -> str | None:
        while not self._stop.is_set():
            models = {name for name, n in observer.models().items() if n == self.num_blocks}
            if models:
                return sorted(models)[0]
            self._stop.wait(0.5)
        return None

    def _add(self, view) -> None:
        servers = tuple(len(view.online(b)) for b in range(self.num_blocks))
        moves = sum(started for started, _ in moves_by_peer(self.peers).values())
        at = self.now()
        sample = Sample(
            at,
            frozenset(p.to_base58() for p in view.alive),
            servers,
            moves,
            len(self.commits),
            self.rate(at - RATE_WINDOW, at),
        )
        self.samples.append(sample)
        if self.echo:
            self.echo(sample.row())


def batches_for_step(step: int, vocab: int, micro_batches: int, tokens: int = 16) -> list[dict[str, torch.Tensor]]:
    """The data of step ``step``, from the step alone (a step redone after a loss trains on the same batches)."""
    g = torch.Generator().manual_seed(7000 + step)
    ids = [torch.randint(0, vocab, (2, tokens), generator=g) for _ in range(micro_batches)]
    return [dict(input_ids=i, attention_mask=torch.ones_like(i), labels=i) for i in ids]


def train_step(model, optimizer, vocab: int, micro_batches: int) -> float:
    """One pipelined step as README shows it: ``train_step`` (every micro-batch in flight), clip, commit."""
    loss = model.train_step(batches_for_step(model.step, vocab, micro_batches), max_in_flight=micro_batches)
    model.clip_grad_norm_(MAX_GRAD_NORM)
    optimizer.step()
    optimizer.zero_grad()
    return float(loss)


def diff_to_local(model_dir: Path, initial: Path, final: Path, steps: int, vocab: int, micro_batches: int) -> float:
    """Largest absolute difference between the adapter in ``final`` and local peft trained from ``initial`` on the
    same batches with the same recipe (transformers' token-weighted loss, global clipping, AdamW)."""
    import transformers

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a second thread spin-waits for a core the swarm's processes may hold
    try:
        base = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="sdpa"
        )
        local = peft.PeftModel.from_pretrained(base, initial, is_trainable=True)
        trainable = [p for p in local.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, **HPARAMS)
        for step in range(steps):
            batches = batches_for_step(step, vocab, micro_batches)
            items = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
            for batch in batches:
                local(**batch, num_items_in_batch=items).loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, MAX_GRAD_NORM)
            optimizer.step()
            optimizer.zero_grad()
        reference = {k: v for k, v in peft.get_peft_model_state_dict(local).items()}
    finally:
        torch.set_num_threads(threads)
    ours = load_file(final / "adapter_model.safetensors")
    if ours.keys() != reference.keys():
        logger.warning("keys differ: %s", sorted(ours.keys() ^ reference.keys())[:4])
        return float("inf")
    return max((ours[k] - reference[k]).abs().max().item() for k in ours)


@dataclass
class SeedRun:
    """What one run of the story measured (seconds from the start of the first peer)."""

    peers: int
    span: int
    layers: int
    samples: list[Sample]
    events: list[tuple[float, str]]
    commits: list[float]
    connected_at: float | None = None
    all_doubled_at: float | None = None  # every block with two live servers, first time
    window_at: float | None = None  # the measured window before the kill began
    killed_at: float | None = None
    victim: str | None = None
    victim_id: str = ""  # its peer id (base58)
    recovered_at: float | None = None  # the survivors at the best their spans allow, the victim gone from the view
    after_at: float | None = None  # the window after the recovery (or after the timeout) began
    moves: dict[str, tuple[int, int]] = field(default_factory=dict)
    steps: int = 0
    steps_lost: int = 0
    lost_reports: list[str] = field(default_factory=list)
    recoveries: int = 0
    max_abs_diff: float | None = None
    error: str | None = None

    @property
    def rate_before(self) -> float | None:
        return _rate(self.commits, self.window_at, self.killed_at)

    @property
    def rate_after(self) -> float | None:
        return _rate(self.commits, self.after_at, None)

    @property
    def best_after(self) -> int:
        return best_doubled(self.peers - 1, self.span, self.layers)

    def after_kill(self) -> list[Sample]:
        return [s for s in self.samples if self.killed_at is not None and s.at >= self.killed_at]

    def first_doubled_after(self) -> float | None:
        """When, after the kill, the view first showed the victim gone and every block with two servers."""
        found = next((s for s in self.after_kill() if self.victim_id not in s.alive and s.doubled == self.layers), None)
        return None if found is None else found.at


def _rate(commits: list[float], since: float | None, until: float | None) -> float | None:
    if since is None:
        return None
    times = [t for t in commits if t > since and (until is None or t <= until)]
    if len(times) < 2:
        return None
    return 60.0 * (len(times) - 1) / max(times[-1] - times[0], 1e-9)


def report(run: SeedRun) -> str:
    """The story's figures, one a line."""

    def at(t: float | None, since: float = 0.0) -> str:
        return "never" if t is None else f"{t - since:.1f} s"

    begun = sum(s for s, _ in run.moves.values())
    finished = sum(f for _, f in run.moves.values())
    lines = [
        f"peers {run.peers} x {run.span} blocks of {run.layers}, replication 2",
        f"client connected (from_pretrained returned): {at(run.connected_at)}",
        f"every block with 2 live servers, from the start: {at(run.all_doubled_at)}",
        "moves per peer (begun/finished): " + ", ".join(f"{n} {s}/{f}" for n, (s, f) in sorted(run.moves.items())),
        f"moves in all: {begun} begun, {finished} finished",
    ]
    if run.killed_at is not None:
        before = [s for s in run.samples if s.at < run.killed_at]
        left = run.peers - 1
        lines.append(f"moves after the kill: {max(0, begun - (before[-1].moves if before else 0))} begun")
        steps = _steps_by(run.commits, run.killed_at)
        lines.append(f"{run.victim} SIGKILLed at {at(run.killed_at)}, during step {steps + 1}")
        again = run.first_doubled_after()
        held = run.samples and run.samples[-1].doubled == run.layers
        again_text = "no" if again is None else f"after {at(again, run.killed_at)}{'' if held else ', not at the end'}"
        lines.append(f"the {left} left: every block at 2 again: {again_text}")
        best = "never" if run.recovered_at is None else f"after {at(run.recovered_at, run.killed_at)}"
        lines.append(
            f"the {left} left: the best {left} spans of {run.span} allow ({run.best_after} of {run.layers} blocks "
            f"at 2, none at 0) reached: {best}"
        )
        after = run.after_kill()
        if after:
            last = after[-1]
            lines.append(
                f"last look ({at(last.at)}): blocks at 0/1/>=2 servers: "
                f"{last.blocks_with(0)}/{last.blocks_with(1)}/{last.doubled}"
            )
    rb, ra = run.rate_before, run.rate_after
    ratio = f"{ra / rb:.2f}" if rb and ra else "-"
    after_what = "after the recovery" if run.recovered_at is not None else "after the kill (no recovery)"
    lines.append(f"steps/min before the kill: {_fmt(rb)}; {after_what}: {_fmt(ra)}; ratio {ratio} (goal >= 0.83)")
    lines.append(f"steps committed: {run.steps}; steps lost: {run.steps_lost} {run.lost_reports or ''}".rstrip())
    lines.append(f"client recoveries (failures routed around): {run.recoveries}")
    if run.max_abs_diff is not None:
        equal = "yes" if run.max_abs_diff <= 1e-4 else "NO"
        lines.append(f"max |swarm - local peft|: {run.max_abs_diff:.2e} (equal: {equal})")
    if run.error:
        lines.append(f"training loop error: {run.error.strip().splitlines()[-1]}")
    return "\n".join(lines)


def _fmt(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.1f}"


def _steps_by(commits: list[float], at: float | None) -> int:
    return sum(1 for t in commits if at is not None and t <= at)


def run_seed(
    model_dir: Path,
    workdir: Path,
    peers: int = PEERS,
    span: int = SPAN,
    balance_interval: float = 5.0,
    micro_batches: int = 4,
    steps_before: int = 10,
    steps_after: int = 10,
    kill_after: int | None = None,
    settle_timeout: float = 300.0,
    recover_timeout: float = 300.0,
    victim: int = 0,
    every: float = 2.0,
    patience: float = 300.0,
    compare: bool = True,
    echo: Callable[[str], None] | None = None,
) -> SeedRun:
    """The story: start the peers and, at once, the client; train until every block has two servers (at most
    ``settle_timeout`` s), then ``steps_before`` steps (the rate before the kill); SIGKILL peer ``victim`` halfway
    through the next step; train until the peers left are at the best their spans allow (at most ``recover_timeout``
    s), then ``steps_after`` steps (the rate after the recovery). ``kill_after``: kill after that many steps in all
    instead, settled or not (the rate before is then that of the last ``steps_before`` steps). ``compare``: train
    local peft on the same batches and report the largest difference."""
    import transformers

    import swarm

    config = transformers.AutoConfig.from_pretrained(model_dir)
    layers, vocab = config.num_hidden_layers, config.vocab_size
    run = SeedRun(peers, span, layers, [], [], [])
    with LocalSwarm(workdir / "logs") as local:
        procs, watch = _start_watched(local, model_dir, run, balance_interval, every, echo)
        model = None
        try:
            model = _connect(model_dir, local.initial_peers, patience)
            run.connected_at = watch.mark("client connected")
            model.save_adapter(workdir / "initial")
            optimizer = swarm.RemoteOptimizer(model, **HPARAMS)

            def step() -> None:
                train_step(model, optimizer, vocab, micro_batches)
                watch.committed()

            _train_to_the_kill(run, watch, model, step, settle_timeout, steps_before, kill_after)
            _kill_during_a_step(run, watch, procs, f"peer{victim}", step, steps_before)
            _train_to_recovery(run, watch, step, best_doubled(peers - 1, span, layers), recover_timeout, steps_after)
            _record_the_client(run, model)
            model.save_adapter(workdir / "final")
        except Exception:  # the boundary of a measured run: whatever ended the story is what it reports
            run.error = traceback.format_exc()
        finally:
            _end_the_story(run, watch, model, procs)
    if compare and run.error is None:
        run.max_abs_diff = diff_to_local(
            model_dir, workdir / "initial", workdir / "final", run.steps, vocab, micro_batches
        )
    return run


def _start_watched(
    local: LocalSwarm,
    model_dir: Path,
    run: SeedRun,
    balance_interval: float,
    every: float,
    echo: Callable[[str], None] | None,
) -> tuple[dict[str, Process], Watch]:
    """The DHT, then the peers at once, watched from the moment they start (the run's clock)."""
    local.start_dht()
    started = time.monotonic()
    procs = start_peers(local, model_dir, run.peers, peer_flags(run.span, balance_interval))
    watch = Watch(local, procs, run.layers, started, every, echo).start()
    run.samples, run.events, run.commits = watch.samples, watch.events, watch.commits
    watch.mark(f"{run.peers} peers started")
    return procs, watch


def _connect(model_dir: Path, initial_peers: list[str], patience: float):
    """The story's client: adapter "seed", connected while the peers still load."""
    import swarm

    return swarm.SwarmModelForCausalLM.from_pretrained(
        model_dir,
        initial_peers=initial_peers,
        adapter="seed",
        lora_config=peft.LoraConfig(**LORA),
        seed=SEED,
        patience=patience,
    )


def _end_the_story(run: SeedRun, watch: Watch, model, procs: dict[str, Process]) -> None:
    """Whatever ended it: the client shut down, the watch stopped, the peers' moves read from their logs."""
    if model is not None:
        model.shutdown()
    run.all_doubled_at = next((s.at for s in watch.samples if s.doubled == run.layers), None)
    watch.stop()
    run.moves = moves_by_peer(procs)


def _train_to_the_kill(
    run: SeedRun,
    watch: Watch,
    model,
    step: Callable[[], None],
    settle_timeout: float,
    steps_before: int,
    kill_after: int | None,
) -> None:
    """Train until every block has two servers (or ``kill_after`` steps), then the window before the kill."""
    if kill_after is not None:
        while model.step < kill_after:
            step()
        run.window_at = watch.commits[-steps_before - 1] if len(watch.commits) > steps_before else 0.0
        return

    def doubled(s: Sample) -> bool:
        return s.doubled == run.layers

    while watch.first(doubled) is None and watch.now() < settle_timeout:
        step()
    run.window_at = watch.mark("measuring: " + ("every block at 2" if watch.first(doubled) else "settle timeout"))
    for _ in range(steps_before):
        step()


def _kill_during_a_step(
    run: SeedRun, watch: Watch, procs: dict[str, Process], name: str, step: Callable[[], None], steps_before: int
) -> None:
    """SIGKILL peer ``name`` halfway through the next step (half the median step of the window before)."""
    run.victim, run.victim_id = name, procs[name].peer_id
    gap = median_step(watch.commits[-steps_before:]) or 1.0

    def kill() -> None:
        procs[name].signal(signal.SIGKILL)
        run.killed_at = watch.mark(f"{name} SIGKILLed")

    timer = threading.Timer(gap / 2, kill)
    timer.start()
    try:
        step()
    finally:
        timer.join()


def _train_to_recovery(
    run: SeedRun, watch: Watch, step: Callable[[], None], best: int, recover_timeout: float, steps_after: int
) -> None:
    """Train until the peers left are at ``best`` doubled blocks, the victim gone; then the window after."""

    def recovered(s: Sample) -> bool:
        return run.victim_id not in s.alive and s.blocks_with(0) == 0 and s.doubled >= best

    deadline = run.killed_at + recover_timeout
    while (found := watch.first(recovered, run.killed_at)) is None and watch.now() < deadline:
        step()
    run.recovered_at = None if found is None else found.at
    run.after_at = watch.mark("recovered" if found else "recovery timeout")
    for _ in range(steps_after):
        step()


def _record_the_client(run: SeedRun, model) -> None:
    """What the client saw: its steps, the steps it lost and its recoveries."""
    run.steps = model.step
    run.steps_lost = sum(e.steps for e in model.steps_lost)
    run.lost_reports = [str(e) for e in model.steps_lost]
    run.recoveries = len(model.recoveries)


def plot(run: SeedRun, path: Path) -> str:
    """The timeline as a PNG (matplotlib), or as a CSV beside it where matplotlib is missing; returns what was
    written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        csv = path.with_suffix(".csv")
        rows = ["t,peers,blocks_0,blocks_1,blocks_2plus,moves,steps,steps_per_min"]
        rows += [
            f"{s.at:.1f},{len(s.alive)},{s.blocks_with(0)},{s.blocks_with(1)},{s.doubled},{s.moves},{s.steps},"
            f"{'' if s.rate is None else f'{s.rate:.2f}'}"
            for s in run.samples
        ]
        csv.write_text("\n".join(rows) + "\n")
        return f"{csv} (CSV: matplotlib is not installed)"
    t = [s.at for s in run.samples]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(10, 6.5))
    top.stackplot(
        t,
        [s.blocks_with(0) for s in run.samples],
        [s.blocks_with(1) for s in run.samples],
        [s.doubled for s in run.samples],
        labels=["0 servers", "1 server", ">= 2 servers"],
        colors=["#d62728", "#ff7f0e", "#2ca02c"],
        step="post",
    )
    top.set_ylabel(f"blocks (of {run.layers})")
    top.set_ylim(0, run.layers)
    moves = top.twinx()
    moves.step(t, [s.moves for s in run.samples], where="post", color="k", label="moves begun")
    moves.set_ylabel("moves begun (all peers)")
    top.legend(loc="lower left", fontsize=8)
    moves.legend(loc="lower right", fontsize=8)
    rates = [float("nan") if s.rate is None else s.rate for s in run.samples]
    bottom.step(t, rates, where="post", label=f"steps/min (last {RATE_WINDOW:g} s)")
    bottom.set_ylabel("steps / minute")
    steps = bottom.twinx()
    steps.plot(t, [s.steps for s in run.samples], color="tab:purple", label="steps committed")
    steps.set_ylabel("steps committed")
    bottom.set_xlabel("seconds from the first peer's start")
    bottom.legend(loc="upper left", fontsize=8)
    for axis in (top, bottom):
        for at, text in run.events:
            axis.axvline(at, color="grey", linestyle="--", linewidth=0.8)
            if axis is top:
                axis.text(at, run.layers * 0.98, " " + text, rotation=90, va="top", fontsize=7)
    top.set_title(f"{run.peers} peers x {run.span} blocks of {run.layers}, one SIGKILLed")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def median_step(commits: list[float]) -> float | None:
    gaps = [b - a for a, b in zip(commits, commits[1:], strict=False)]
    return statistics.median(gaps) if gaps else None
