"""Benchmark one LoRA training step through a loopback swarm against local transformers + peft, side by side.

A step is forward + ``loss.backward()`` + ``optimizer.step()`` + ``zero_grad()``, timed with
``time.perf_counter``. The local run goes first, in this process; then a bootstrap DHT and the peers start
on 127.0.0.1, a swarm client trains the same model, batch and LoRA, and the swarm is always closed.

With ``--clip MAX_NORM`` (the default, 1.0, as transformers' Trainer clips) each side also trains the same steps
with global gradient clipping before ``optimizer.step()`` (torch's ``clip_grad_norm_`` locally,
``model.clip_grad_norm_`` in the swarm), and the cost of clipping is printed: its own phase, the step with and
without it, and how many norms requests the swarm sent (none when the backward replies carried the norm).
``--replicas 2`` serves every span twice, so that a step's micro-batches may be spread over replicas.
``--spot-check`` (needs ``--replicas 3``) also trains the same steps with every micro-batch spot-checked (each hop
recomputed on other replicas and compared), and prints what a check costs and what the public-swarm default rate
(``PUBLIC_SPOT_CHECK``) adds to a step: rate x (checked step / unchecked step - 1).

Usage::

    python scripts/bench_step.py [--hidden 512] [--layers 8] [--heads 8] [--kv-heads 8] [--intermediate 1376]
        [--vocab 1024] [--batch 4] [--seq 128] [--peers 2] [--replicas 1] [--micro-batches 1] [--pipelined]
        [--clip 1.0] [--spot-check] [--steps 10] [--warmup 2] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import peft
import torch
import transformers
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import swarm  # noqa: E402
from swarm.client.trust import PUBLIC_SPOT_CHECK, VOTERS  # noqa: E402
from swarm.net.protocol import InfoRequest, Method, method_of  # noqa: E402
from swarm.testing.faults import CallTap  # noqa: E402
from swarm.testing.localswarm import LocalSwarm  # noqa: E402
from swarm.testing.tiny import make_tiny_model  # noqa: E402

logger = logging.getLogger("bench_step")

TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_R, LORA_ALPHA = 8, 16
HPARAMS = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
GOAL_RATIO = 1.15
PHASES = ("forward", "backward", "clip", "optimizer")


@dataclass
class StepStats:
    """Per measured step: wall time, time per phase, and the (mean micro-batch) loss."""

    name: str
    times: list[float] = field(default_factory=list)
    phases: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PHASES})
    losses: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def best(self) -> float:
        return min(self.times)

    def phase_median(self, phase: str) -> float:
        return statistics.median(self.phases[phase])


def lora_config() -> peft.LoraConfig:
    """LoRA r=8 alpha=16 on every linear projection of a Llama block."""
    return peft.LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, target_modules=list(TARGET_MODULES), lora_dropout=0.0)


def make_batches(vocab: int, batch: int, seq: int, micro_batches: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``micro_batches`` random batches of ``batch`` x ``seq`` tokens, reused every step (so the loss falls)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(micro_batches):
        ids = torch.randint(0, vocab, (batch, seq), generator=generator)
        out.append(dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids.clone()))
    return out


def train(
    name: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[dict],
    steps: int,
    warmup: int,
    pipelined: bool = False,
    clip: Callable[[], object] | None = None,
) -> StepStats:
    """Run ``warmup`` untimed steps then ``steps`` timed ones; return their timings and losses. ``pipelined``: the
    swarm's ``model.train_step`` (micro-batches in flight together) instead of the loop. ``clip``: called between
    the last backward and the optimizer step (gradient clipping)."""
    stats = StepStats(name)
    for index in tqdm(range(warmup + steps), desc=name, unit="step"):
        phases = dict.fromkeys(PHASES, 0.0)
        loss_sum = 0.0
        started = time.perf_counter()
        if pipelined:  # forward and backward of every micro-batch, several in flight: one phase
            loss_sum = model.train_step(batches).item() * len(batches)
            phases["backward"] = time.perf_counter() - started
        for batch in [] if pipelined else batches:
            t0 = time.perf_counter()
            loss = model(**batch).loss
            t1 = time.perf_counter()
            (loss / len(batches)).backward()
            t2 = time.perf_counter()
            phases["forward"] += t1 - t0
            phases["backward"] += t2 - t1
            loss_sum += loss.item()
        t_clip = time.perf_counter()
        if clip is not None:
            clip()
        t3 = time.perf_counter()
        phases["clip"] = t3 - t_clip
        optimizer.step()
        optimizer.zero_grad()
        ended = time.perf_counter()
        phases["optimizer"] = ended - t3
        if index >= warmup:
            stats.times.append(ended - started)
            stats.losses.append(loss_sum / len(batches))
            for phase, seconds in phases.items():
                stats.phases[phase].append(seconds)
    logger.info("%s step times (s): %s", name, " ".join(f"{t:.3f}" for t in stats.times))
    return stats


def run_local(model_dir: Path, batches: list[dict], steps: int, warmup: int, max_norm: float = 0.0) -> list[StepStats]:
    """Train with transformers + peft in this process (then again with clipping, given a ``max_norm``)."""
    logger.info("local: loading %s with peft (torch threads: %d)", model_dir, torch.get_num_threads())
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model = peft.get_peft_model(base, lora_config())
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, **HPARAMS)
    runs = [train("local peft", model, optimizer, batches, steps, warmup)]
    if max_norm > 0:
        clip = lambda: torch.nn.utils.clip_grad_norm_(trainable, max_norm)  # noqa: E731
        runs.append(train("local clipped", model, optimizer, batches, steps, warmup, clip=clip))
    return runs


def ping(model: swarm.SwarmModelForCausalLM, count: int = 20) -> dict[str, float]:
    """Median round trip of an empty ``info`` call to each peer of the route, in seconds."""
    result = {}
    for hop in model.session.router.route():
        times = []
        for _ in range(count):
            started = time.perf_counter()
            model.session.transport.ask(hop.peer_id, InfoRequest(), 30.0)
            times.append(time.perf_counter() - started)
        result[f"{hop.start}:{hop.end}"] = statistics.median(times)
    return result


def split_blocks(layers: int, peers: int) -> list[str]:
    """``START:END`` spans that split ``layers`` blocks as evenly as possible over ``peers`` peers."""
    bounds = [round(i * layers / peers) for i in range(peers + 1)]
    return [f"{a}:{b}" for a, b in zip(bounds, bounds[1:], strict=False)]


def count_norms_requests(tap: CallTap) -> list[int]:
    """A counter (in a list) of the norms requests the client sends from now on (``tap``: its call hook)."""
    counter = [0]

    def call(peer, message, send):
        counter[0] += method_of(message.meta) == Method.NORMS
        return send(message)

    tap.arm(call)
    return counter


def run_swarm(
    model_dir: Path,
    workdir: Path,
    peers: int,
    batches: list[dict],
    steps: int,
    warmup: int,
    pipelined: bool = False,
    replicas: int = 1,
    max_norm: float = 0.0,
    spot_check: bool = False,
) -> tuple[list[StepStats], dict[str, float], int]:
    """Start a DHT and ``peers`` peers on 127.0.0.1 (``replicas`` per span), train through them (then again with
    clipping, given a ``max_norm``; then with every micro-batch spot-checked, given ``spot_check``), and always close
    them. Returns the runs, the round trips and the norms requests of the clipped run."""
    local_swarm = LocalSwarm(workdir)
    model = None
    try:
        logger.info("swarm: starting dht (logs in %s)", workdir)
        local_swarm.start_dht()
        layers = transformers.AutoConfig.from_pretrained(model_dir).num_hidden_layers
        for index, span in enumerate(split_blocks(layers, peers) * replicas):
            logger.info("swarm: starting peer%d for blocks %s", index, span)
            local_swarm.start_peer(model_dir, span, name=f"peer{index}")
        tap = CallTap()
        model = swarm.SwarmModelForCausalLM.from_pretrained(
            model_dir,
            initial_peers=local_swarm.initial_peers,
            adapter="bench",
            lora_config=lora_config(),
            dtype=torch.float32,
            seed=0,
            spot_check=0.0,  # the unchecked baseline, whatever the public default
            call_hook=tap,
        )
        optimizer = swarm.RemoteOptimizer(model, **HPARAMS)
        runs = [train("swarm", model, optimizer, batches, steps, warmup, pipelined)]
        norms_requests = count_norms_requests(tap)
        if max_norm > 0:
            clip = lambda: model.clip_grad_norm_(max_norm)  # noqa: E731
            runs.append(train("swarm clipped", model, optimizer, batches, steps, warmup, pipelined, clip=clip))
        if spot_check:
            hops = model.session.hops
            hops.trust.spot_check, hops.trust.min_voters = 1.0, VOTERS
            runs.append(train("swarm checked", model, optimizer, batches, steps, warmup, pipelined))
            logger.info("spot checks banned %d peer(s) (honest peers: expect none)", len(model.dishonest))
        try:
            rtts = ping(model)
        except Exception as e:  # a diagnostic only: never lose the timings over it
            logger.warning("could not ping the peers: %s: %s", type(e).__name__, e)
            rtts = {}
        return runs, rtts, norms_requests[0]
    finally:
        if model is not None:
            try:
                model.shutdown()
            except Exception:
                logger.exception("could not shut the swarm client down")
        local_swarm.close()


def report(
    args: argparse.Namespace,
    peers_desc: str,
    locals_: list[StepStats],
    remotes: list[StepStats],
    rtts: dict,
    asked: int,
) -> None:
    """Print the side-by-side table, the phase breakdown, what clipping costs and the loss sanity check."""
    local, remote = locals_[0], remotes[0]
    ratio = remote.median / local.median
    print()
    print(
        f"config: hidden={args.hidden} layers={args.layers} batch={args.batch}x{args.seq} fp32 "
        f"lora r={LORA_R} all-linear, {peers_desc}, {args.micro_batches} micro-batch(es)/step, "
        f"{args.steps} steps after {args.warmup} warmup"
    )
    for stats in (*locals_, *remotes):
        print(f"{stats.name:<14} median {stats.median:.3f} s/step  (min {stats.best:.3f})")
    print(f"ratio swarm/local: {ratio:.2f}  (goal <= {GOAL_RATIO:.2f})")
    by_name = {stats.name: stats for stats in remotes}
    if len(locals_) == 2 and "swarm clipped" in by_name:
        measured, clipped = args.steps + args.warmup, by_name["swarm clipped"]
        print(
            f"clipping (max_norm {args.clip}): local clip phase {locals_[1].phase_median('clip') * 1e3:.1f} ms, "
            f"step {locals_[1].median / local.median:.3f}x unclipped; swarm clip phase "
            f"{clipped.phase_median('clip') * 1e3:.1f} ms, step {clipped.median / remote.median:.3f}x unclipped, "
            f"{asked} norms request(s) in {measured} steps"
        )
    if "swarm checked" in by_name:
        per_check = by_name["swarm checked"].median / remote.median - 1
        print(
            f"spot checks: a step with every micro-batch checked takes {per_check + 1:.2f}x an unchecked one; at the "
            f"public default rate ({PUBLIC_SPOT_CHECK:.0%} of micro-batches) that adds "
            f"{PUBLIC_SPOT_CHECK * per_check:.1%} per step (goal <= 5%)"
        )
    print()
    print("median per phase (s):      " + "  ".join(f"{p:>9}" for p in PHASES))
    for stats in (*locals_, *remotes):
        print(f"  {stats.name:<24}" + "  ".join(f"{stats.phase_median(p):9.3f}" for p in PHASES))
    if rtts:
        print(
            "peer round trip (empty info call): " + ", ".join(f"blocks {k} {v * 1e3:.2f} ms" for k, v in rtts.items())
        )
    print()
    for stats in (*locals_, *remotes):
        falls = "falls" if stats.losses[-1] < stats.losses[0] else "DOES NOT FALL"
        print(f"loss {stats.name:<12} first {stats.losses[0]:.5f}  last {stats.losses[-1]:.5f}  ({falls})")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse command-line arguments."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=1376)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--peers", type=int, default=2, help="peers that split the blocks evenly")
    parser.add_argument("--replicas", type=int, default=1, help="peers serving each span")
    parser.add_argument("--clip", type=float, default=1.0, help="max_norm of the clipped runs (0: none)")
    parser.add_argument("--spot-check", action="store_true", help="also time fully spot-checked steps (3 replicas)")
    parser.add_argument("--micro-batches", type=int, default=1, help="micro-batches of --batch rows per step")
    parser.add_argument("--pipelined", action="store_true", help="swarm: model.train_step (micro-batches in flight)")
    parser.add_argument("--steps", type=int, default=10, help="measured steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before the measured ones")
    parser.add_argument("--workdir", type=Path, default=None, help="model and peer logs (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.micro_batches < 1 or not 1 <= args.peers <= args.layers:
        parser.error("need --steps >= 1, --warmup >= 0, --micro-batches >= 1 and 1 <= --peers <= --layers")
    if args.replicas < 1 or args.clip < 0:
        parser.error("need --replicas >= 1 and --clip >= 0")
    if args.spot_check and args.replicas < VOTERS:
        parser.error(f"--spot-check needs --replicas {VOTERS}: a vote needs that many replicas of a span")
    return args


def main(argv: list[str] | None = None) -> None:
    """Run the local and the swarm benchmark and print the comparison."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_step_") as tmp:
        workdir = args.workdir or Path(tmp)
        model_dir = make_tiny_model(
            workdir / "bench-model",
            family="llama",
            layers=args.layers,
            hidden=args.hidden,
            heads=args.heads,
            kv_heads=args.kv_heads,
            intermediate=args.intermediate,
            vocab=args.vocab,
            seed=0,
        )
        batches = make_batches(args.vocab, args.batch, args.seq, args.micro_batches)
        locals_ = run_local(model_dir, batches, args.steps, args.warmup, args.clip)
        remotes, rtts, asked = run_swarm(
            model_dir,
            workdir / "swarm",
            args.peers,
            batches,
            args.steps,
            args.warmup,
            args.pipelined,
            args.replicas,
            args.clip,
            args.spot_check,
        )
        spans = split_blocks(args.layers, args.peers)
        sizes = {int(b) - int(a) for a, b in (s.split(":") for s in spans)}
        peers_desc = f"{args.peers} peers x {sizes.pop()} blocks" if len(sizes) == 1 else f"peers {' '.join(spans)}"
        if args.replicas > 1:
            peers_desc += f", {args.replicas} replicas each"
        report(args, peers_desc, locals_, remotes, rtts, asked)
        if args.workdir is None:
            logger.info("peer logs were in the temp dir %s (now removed); pass --workdir to keep them", tmp)


if __name__ == "__main__":
    main()
