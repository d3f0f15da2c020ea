"""A memory soak: a loopback swarm in every role a peer can have trains for thousands of steps while each process
tree's resident memory, open files and threads are sampled, to find state kept per step that is never released.

The swarm: a bootstrap node (it relays for the peer that serves through it), ``head`` alone on blocks 0:H (the only
server of its span and the chain's head), ``tail-a`` and ``tail-b`` replicas of H:N (the chain's tail), and
``relayed`` a third replica of H:N reached only through the bootstrap node's relay. Every peer keeps a checkpoint dir
and, by default, standby copies of the span it does not serve. Spans stay put (``--no-rebalance``), so every role is
held for the whole run. The client, this process, connects while the peers still load and trains with a plain loop
(micro-batches, global clipping, ``RemoteOptimizer``); it samples every process tree between steps.

``scripts/bench_soak.py`` is the command; ``tests/e2e/test_soak.py`` runs it short and fails on growth.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import peft
import torch
from tqdm.auto import tqdm

import swarm
from swarm.spec import load_spec
from swarm.testing.localswarm import LocalSwarm, Process
from swarm.usage import Usage, tree_usage

logger = logging.getLogger(__name__)
LORA = dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"])
CLIENT = "client"


@dataclass
class Sample:
    step: int
    seconds: float
    usage: dict[str, Usage]
    checkpoint_bytes: dict[str, int]


@dataclass
class SoakConfig:
    steps: int = 3000
    sample_every: int = 100
    micro_batches: int = 2
    batch: int = 2
    seq: int = 64
    vocab: int = 256
    head_blocks: int = 2  # blocks 0:head_blocks on the head; the rest on the three tail replicas
    seed: int = 11


@dataclass
class SoakResult:
    roles: dict[str, str]
    samples: list[Sample] = field(default_factory=list)

    def growth_per_1000(self, name: str, start: int | None = None, part: str | None = None) -> float:
        """Resident bytes gained per 1000 steps from ``start`` (default: the middle of the run) to the end: the
        least-squares slope, so one noisy sample moves it little. ``part``: of one kind of process in the tree only
        (``root``, ``children``: the DHT process, ``p2pd``)."""
        samples = self.after(start)
        points = [(s.step, s.usage[name].rss if part is None else s.usage[name].parts.get(part, 0)) for s in samples]
        return 1000 * _slope(points)

    def after(self, start: int | None = None) -> list[Sample]:
        first = self.samples[-1].step // 2 if start is None else start
        return [s for s in self.samples if s.step >= first]

    def at_middle(self) -> Sample:
        return self.after()[0]

    def table(self) -> str:
        """One row per process tree: memory at the middle and the end, growth per 1000 steps over the second half,
        and open files, threads and checkpoint bytes from the middle to the end."""
        middle, last = self.at_middle(), self.samples[-1]
        rows = [
            f"{'process tree':<10} {'roles':<52} {'RSS MB @' + str(middle.step):>13} {'@' + str(last.step):>9} "
            f"{'MB/1000 steps':>13} {'(root/DHT/p2pd)':>18} {'files':>7} {'threads':>8} {'ckpt MB':>9}"
        ]
        for name, roles in self.roles.items():
            mid, end = middle.usage[name], last.usage[name]
            ckpt = (
                f"{_mb(middle.checkpoint_bytes[name]):.1f}>{_mb(last.checkpoint_bytes[name]):.1f}"
                if name in last.checkpoint_bytes
                else "-"
            )
            rows.append(
                f"{name:<10} {roles:<52} {_mb(mid.rss):>13.1f} {_mb(end.rss):>9.1f} "
                f"{_mb(self.growth_per_1000(name)):>+13.2f} {self._split(name):>18} {mid.fds:>3}>{end.fds:<3} "
                f"{mid.threads:>3}>{end.threads:<4} {ckpt:>9}"
            )
        return "\n".join(rows)

    def _split(self, name: str) -> str:
        """Where a tree's growth is: its root process, its other children (a daemon's DHT process), its p2pd."""
        parts = [self.growth_per_1000(name, part=part) for part in ("root", "children", "p2pd")]
        return "/".join(f"{_mb(p):+.1f}" for p in parts)

    def to_csv(self, path: Path) -> Path:
        """Every sample: step, seconds, and per tree its resident bytes (whole, root, DHT process, p2pd), files and
        threads."""
        names = list(self.roles)
        header = ["step", "seconds"]
        for name in names:
            header += [f"{name}_{field}" for field in ("rss", "root", "children", "p2pd", "fds", "threads")]
        rows = [",".join(header)]
        for sample in self.samples:
            row = [str(sample.step), f"{sample.seconds:.1f}"]
            for name in names:
                usage = sample.usage[name]
                parts = [usage.parts.get(part, 0) for part in ("root", "children", "p2pd")]
                row += [str(x) for x in (usage.rss, *parts, usage.fds, usage.threads)]
            rows.append(",".join(row))
        path.write_text("\n".join(rows) + "\n")
        return path

    def plot(self, path: Path, title: str) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4.5))
        steps = [s.step for s in self.samples]
        for name in self.roles:
            first = self.samples[0].usage[name].rss
            ax.plot(steps, [_mb(s.usage[name].rss - first) for s in self.samples], label=name, marker=".")
        ax.set_xlabel("committed steps")
        ax.set_ylabel(f"resident memory gained since step {steps[0]} (MB)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path


def _mb(n: float) -> float:
    return n / 2**20


def _slope(points: list[tuple[int, int]]) -> float:
    if len(points) < 2:
        return 0.0
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    var = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / var if var else 0.0


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def start_roles(local: LocalSwarm, model_dir: Path, workdir: Path, head_blocks: int) -> dict[str, Process]:
    """The peers of the soak, started at once (the client does not wait for them)."""
    layers = load_spec(model_dir).num_blocks
    head, tail = f"0:{head_blocks}", f"{head_blocks}:{layers}"
    spans = {"head": (head, []), "tail-a": (tail, []), "tail-b": (tail, []), "relayed": (tail, ["--relay", "always"])}
    return {
        name: local.start_peer(
            model_dir,
            span,
            name=name,
            wait=False,
            extra=["--no-rebalance", "--checkpoint-dir", str(workdir / f"ckpt-{name}"), *extra],
        )
        for name, (span, extra) in spans.items()
    }


ROLES = {
    "dht": "bootstrap node, relay of `relayed`",
    "head": "only server of its span, chain head, standby holder",
    "tail-a": "replica, chain tail, standby holder",
    "tail-b": "replica, chain tail, standby holder",
    "relayed": "replica through a relay, chain tail, standby holder",
    CLIENT: "trainer (plain loop, clipping, RemoteOptimizer)",
}


def run_soak(model_dir: Path, workdir: Path, config: SoakConfig, progress: bool = True) -> SoakResult:
    """Train ``config.steps`` through the soak swarm, sampling every tree each ``sample_every`` steps."""
    workdir.mkdir(parents=True, exist_ok=True)
    result = SoakResult(roles=dict(ROLES))
    with LocalSwarm(workdir / "logs") as local:
        dht = local.start_dht()
        peers = start_roles(local, model_dir, workdir, config.head_blocks)
        trees = {"dht": dht.pid, **{name: peer.pid for name, peer in peers.items()}}
        model = swarm.SwarmModelForCausalLM.from_pretrained(
            model_dir,
            initial_peers=local.initial_peers,
            adapter="soak",
            lora_config=peft.LoraConfig(**LORA),
            seed=config.seed,
            patience=300.0,
        )
        try:
            optimizer = swarm.RemoteOptimizer(model, lr=1e-4)
            generator = torch.Generator().manual_seed(config.seed)
            started = time.monotonic()

            def sample() -> None:
                usage = {name: tree_usage(pid) for name, pid in trees.items()}
                usage[CLIENT] = tree_usage(os.getpid(), leave_out=trees.values())
                ckpt = {name: dir_bytes(workdir / f"ckpt-{name}") for name in peers}
                result.samples.append(Sample(model.step, time.monotonic() - started, usage, ckpt))

            bar = tqdm(total=config.steps, desc="soak", unit="step", disable=not progress, mininterval=5.0)
            while model.step < config.steps:
                for _ in range(config.micro_batches):
                    ids = torch.randint(0, config.vocab, (config.batch, config.seq), generator=generator)
                    (model(input_ids=ids, labels=ids).loss / config.micro_batches).backward()
                model.clip_grad_norm_(1.0)
                optimizer.step()
                optimizer.zero_grad()
                bar.update(1)
                if model.step % config.sample_every == 0:
                    sample()
            bar.close()
        finally:
            model.shutdown()
    return result
