"""The bytes through a training client's own link: a client process that reads its network namespace's interface
counters around every training step, and a runner that starts it on a lab host (swarm.testing.netlab).

Counting at the interface, not in the transport, sees everything the link carries: hidden states, gradients,
commits, DHT lookups, libp2p framing, TCP acknowledgements. So the client must be alone in its namespace. It can
also watch other namespaces (a peer's, through any process in it: /proc/PID/net/dev), read at the same moments.

    python -m swarm.testing.linkmeter --model DIR --initial-peers MADDR [...] [--no-chain] [--steps 3] [--watch N=PID]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import peft
import torch

from swarm.net.compression import WireFormat
from swarm.testing.localswarm import LocalSwarm, Process
from swarm.testing.netlab import Host, NetLab
from swarm.testing.recipe import HPARAMS, LORA

if TYPE_CHECKING:
    from swarm.client.model import SwarmModelForCausalLM

logger = logging.getLogger(__name__)

MARKER = "linkmeter-report "
ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LinkMeterError(RuntimeError):
    """The measuring client failed or did not finish; the message carries the tail of its log."""


@dataclass(frozen=True)
class Counters:
    """Bytes received and sent, summed over a namespace's interfaces but loopback."""

    rx: int
    tx: int

    @property
    def total(self) -> int:
        return self.rx + self.tx

    def __sub__(self, other: Counters) -> Counters:
        return Counters(self.rx - other.rx, self.tx - other.tx)


def read_counters(pid: int | None = None) -> Counters:
    """The counters of the network namespace of ``pid`` (default: this process's), from /proc/PID/net/dev."""
    return parse_net_dev(Path(f"/proc/{pid or 'self'}/net/dev").read_text())


def parse_net_dev(text: str) -> Counters:
    """/proc/net/dev: two header lines, then ``NAME: rx_bytes ... (8 receive fields) tx_bytes ...`` per interface."""
    rx = tx = 0
    for line in text.splitlines()[2:]:
        name, _, fields = line.partition(":")
        if name.strip() != "lo":
            values = fields.split()
            rx, tx = rx + int(values[0]), tx + int(values[8])
    return Counters(rx, tx)


@dataclass(frozen=True)
class MeterConfig:
    """What the measuring client trains: one step is ``micro_batches`` of ``batch`` x ``seq`` random tokens (all in
    flight at once through ``train_step`` with ``pipelined``, else the ``loss.backward()`` loop), then a commit."""

    adapter: str = "linkmeter"
    chain: bool = True
    steps: int = 3
    warmup: int = 1
    batch: int = 4
    seq: int = 128
    micro_batches: int = 1
    pipelined: bool = True
    lora_rank: int = 0  # 0: the recipe's LoRA; else this rank on all seven projections (LoRA big enough to count)
    wire: str = "none"  # how hidden states and their gradients travel (WireFormat.parse)

    def lora_config(self) -> peft.LoraConfig:
        if not self.lora_rank:
            return peft.LoraConfig(**LORA)
        return peft.LoraConfig(r=self.lora_rank, lora_alpha=2 * self.lora_rank, target_modules=ALL_PROJECTIONS)

    @property
    def waves(self) -> int:
        """Micro-batch waves per step: groups of micro-batches that travel together."""
        return 1 if self.pipelined else self.micro_batches

    def to_args(self) -> list[str]:
        args = ["--adapter", self.adapter, "--steps", str(self.steps), "--warmup", str(self.warmup)]
        args += ["--batch", str(self.batch), "--seq", str(self.seq), "--micro-batches", str(self.micro_batches)]
        args += ["--lora-rank", str(self.lora_rank), "--wire", self.wire]
        return args + (["--no-chain"] if not self.chain else []) + (["--loop"] if not self.pipelined else [])


@dataclass
class LinkReport:
    """Per measured step: its wall time, the client's own bytes, and each watched namespace's bytes."""

    times: list[float] = field(default_factory=list)
    own: list[Counters] = field(default_factory=list)
    watched: dict[str, list[Counters]] = field(default_factory=dict)

    @property
    def median_step(self) -> float:
        return statistics.median(self.times)

    @property
    def bytes_per_step(self) -> float:
        """Median over steps of the bytes the client's link carried, both ways."""
        return statistics.median(c.total for c in self.own)

    def median(self, name: str | None = None) -> Counters:
        """Median bytes per step received and sent by the client (``name`` None) or a watched namespace."""
        steps = self.own if name is None else self.watched[name]
        return Counters(int(statistics.median(c.rx for c in steps)), int(statistics.median(c.tx for c in steps)))

    def mean(self, name: str) -> Counters:
        """Mean bytes per step received and sent by a watched namespace."""
        steps = self.watched[name]
        return Counters(sum(c.rx for c in steps) // len(steps), sum(c.tx for c in steps) // len(steps))

    def to_json(self) -> str:
        return json.dumps(
            {
                "times": self.times,
                "own": [asdict(c) for c in self.own],
                "watched": {name: [asdict(c) for c in steps] for name, steps in self.watched.items()},
            }
        )

    @classmethod
    def from_json(cls, text: str) -> LinkReport:
        data = json.loads(text)
        watched = {name: [Counters(**c) for c in steps] for name, steps in data["watched"].items()}
        return cls(data["times"], [Counters(**c) for c in data["own"]], watched)


def make_batches(vocab: int, config: MeterConfig, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """The step's micro-batches, the same every step."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(config.micro_batches):
        ids = torch.randint(0, vocab, (config.batch, config.seq), generator=generator)
        out.append(dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids.clone()))
    return out


def measure(model: SwarmModelForCausalLM, config: MeterConfig, watch: dict[str, int]) -> LinkReport:
    """Train ``config.warmup`` + ``config.steps`` steps; read the counters right before and after each measured one
    (the setup, the lease, the first opens and the warm-up are not counted)."""
    import swarm

    optimizer = swarm.RemoteOptimizer(model, **HPARAMS)
    batches = make_batches(model.spec.config.vocab_size, config)
    report = LinkReport(watched={name: [] for name in watch})
    for index in range(config.warmup + config.steps):
        own, others = read_counters(), {name: read_counters(pid) for name, pid in watch.items()}
        started = time.perf_counter()
        if config.pipelined:
            model.train_step(batches, max_in_flight=len(batches))
        else:
            for batch in batches:
                (model(**batch).loss / len(batches)).backward()
        optimizer.step()
        optimizer.zero_grad()
        elapsed, spent = time.perf_counter() - started, read_counters() - own
        if index >= config.warmup:
            report.times.append(elapsed)
            report.own.append(spent)
            for name, pid in watch.items():
                report.watched[name].append(read_counters(pid) - others[name])
        logger.info("step %d: %.3f s, %d bytes through the client's link", index, elapsed, spent.total)
    return report


def start_client(
    local: LocalSwarm,
    host: Host,
    model_dir: Path,
    config: MeterConfig,
    name: str = "client",
    watch: dict[str, int] | None = None,
) -> Process:
    """Start the measuring client on ``host`` as one of ``local``'s processes (so it dies with the swarm at the
    latest); ``watch``: name -> a PID in each other namespace to count as well."""
    args = ["--model", str(model_dir), "--initial-peers", *local.initial_peers, *config.to_args()]
    args += [f"--watch={key}={pid}" for key, pid in (watch or {}).items()]
    return local.start_module(name, "swarm.testing.linkmeter", args, prefix=host.command())


def collect(process: Process, timeout: float = 300.0) -> LinkReport:
    """Wait for a measuring client to finish; its report. A client still running after ``timeout`` is killed."""
    try:
        code = process.popen.wait(timeout)
    except subprocess.TimeoutExpired:
        process.stop()
        raise LinkMeterError(f"{process.name} did not finish within {timeout:.0f}s:\n{process.tail()}") from None
    process.stop()  # what is left of its group (p2pd)
    lines = [line for line in process.log.read_text(errors="replace").splitlines() if line.startswith(MARKER)]
    if code != 0 or not lines:
        raise LinkMeterError(f"{process.name} exited with {code}:\n{process.tail()}")
    report = LinkReport.from_json(lines[-1][len(MARKER) :])
    logger.info(
        "%s: %.3f s/step, %.0f bytes/step through its link", process.name, report.median_step, report.bytes_per_step
    )
    return report


def run_client(
    local: LocalSwarm,
    host: Host,
    model_dir: Path,
    config: MeterConfig,
    name: str = "client",
    watch: dict[str, int] | None = None,
    timeout: float = 300.0,
) -> LinkReport:
    """``start_client`` and ``collect``: one measured client, alone on the swarm."""
    return collect(start_client(local, host, model_dir, config, name, watch), timeout)


def transfer_bytes(config: MeterConfig, hidden: int) -> float:
    """What a step's three transfers weigh on ``config.wire``, from their shapes alone: the hidden states in and out
    (a delta wire's later passes: their changes) and the output's gradient, fp32 computed. The floor of the client's
    bytes per step: everything else its link carries (records, acks, framing) is overhead."""
    wire = WireFormat.parse(config.wire)
    values = config.micro_batches * config.batch * config.seq * hidden
    return values * (2 * wire.value_bytes(torch.float32) + wire.value_bytes(torch.float32, backward=True))


def measure_wires(
    lab: NetLab, model_dir: Path, spans: list[str], configs: dict[str, MeterConfig], workdir: Path
) -> dict[str, LinkReport]:
    """One swarm of a peer per span on the lab's public host; then one measuring client per config, one after the
    other, each alone on a host of its own (so its interface counts only its own traffic)."""
    peers_host = lab.public("swarm")
    reports = {}
    with LocalSwarm(workdir) as local:
        local.start_dht(host=peers_host.ip, prefix=peers_host.command())
        for index, span in enumerate(spans):
            flags = ["--leave-grace", "0.2"]
            local.start_peer(
                model_dir, span, f"peer{index}", flags, wait=False, host="0.0.0.0", prefix=peers_host.command()
            )
        for process in local.processes[1:]:
            process.wait_for_line("serving blocks", 300)
        for name, config in configs.items():
            reports[name] = run_client(local, lab.public(name), model_dir, config, name, timeout=600)
    return reports


def _watch_pair(text: str) -> tuple[str, int]:
    name, _, pid = text.partition("=")
    if not name or not pid.isdigit():
        raise argparse.ArgumentTypeError(f"expected NAME=PID, got {text!r}")
    return name, int(pid)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, MeterConfig]:
    defaults = MeterConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--adapter", default=defaults.adapter)
    parser.add_argument("--no-chain", action="store_true", help="client-driven hops (chain=False)")
    parser.add_argument("--loop", action="store_true", help="the loss.backward() loop, not train_step")
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--warmup", type=int, default=defaults.warmup)
    parser.add_argument("--batch", type=int, default=defaults.batch)
    parser.add_argument("--seq", type=int, default=defaults.seq)
    parser.add_argument("--micro-batches", type=int, default=defaults.micro_batches)
    parser.add_argument("--lora-rank", type=int, default=defaults.lora_rank, help="0: the recipe's LoRA")
    parser.add_argument("--wire", default=defaults.wire, help="wire format, e.g. bfloat16+hadamard4 (WireFormat.parse)")
    parser.add_argument("--watch", type=_watch_pair, action="append", default=[], metavar="NAME=PID")
    args = parser.parse_args(argv)
    if args.steps < 1 or min(args.batch, args.seq, args.micro_batches) < 1 or args.warmup < 0:
        parser.error("need --steps, --batch, --seq, --micro-batches >= 1 and --warmup >= 0")
    try:
        WireFormat.parse(args.wire)
    except ValueError as e:
        parser.error(f"--wire: {e}")
    shape = dict(steps=args.steps, warmup=args.warmup, batch=args.batch, seq=args.seq, micro_batches=args.micro_batches)
    config = MeterConfig(
        args.adapter,
        chain=not args.no_chain,
        pipelined=not args.loop,
        lora_rank=args.lora_rank,
        wire=WireFormat.parse(args.wire).spec,
        **shape,
    )
    return args, config


def main(argv: list[str] | None = None) -> None:
    """The measuring client: join, train, print the report as one marked JSON line."""
    import swarm

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args, config = parse_args(argv)
    wire = WireFormat.parse(config.wire)
    model = swarm.SwarmModelForCausalLM.from_pretrained(
        args.model,
        initial_peers=args.initial_peers,
        adapter=config.adapter,
        lora_config=config.lora_config(),
        seed=0,
        chain=config.chain,
        wire_dtype=wire.dtype,
        compression=wire.compression,
        grad_compression=wire.grad_compression,
    )
    try:
        report = measure(model, config, dict(args.watch))
    finally:
        model.shutdown()
    print(MARKER + report.to_json(), flush=True)


if __name__ == "__main__":
    main()
