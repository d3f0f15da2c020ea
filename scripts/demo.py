"""Local swarm demo: a tiny Llama trained with LoRA through four peer daemons on 127.0.0.1.

peer-a1 and peer-a2 serve blocks 0:2, peer-b serves 2:4, and peer-c chooses its blocks itself (it picks 2:4, the
under-replicated half). Mid-training peer-b is SIGKILLed during a step (the client retries on peer-c); later
peer-c, by then the last server of 2:4, is SIGKILLed right after a step returned: a replica of 0:2 takes 2:4 over
from the copy of the adapter state it was asked to hold before that step was acknowledged. Losses fall throughout;
recoveries, steps lost, copies per block and the final `swarm status` are printed."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from pathlib import Path

import peft
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from make_tiny_model import make_tiny_model  # noqa: E402

import swarm  # noqa: E402
from swarm.localswarm import LocalSwarm  # noqa: E402
from swarm.status import status  # noqa: E402

logger = logging.getLogger("demo")


def synthetic_batches(vocab: int, count: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """A few fixed sequences, so that a LoRA can learn them and the loss visibly falls."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (4, 32), generator=g)
        batches.append(dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids))
    return batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workdir", type=Path, default=ROOT / "runs" / "demo")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--kill-at-step", type=int, default=6, help="SIGKILL peer-b during this step (0: never)")
    parser.add_argument(
        "--orphan-at-step", type=int, default=12, help="SIGKILL peer-c, the last server of 2:4, before it (0: never)"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("hivemind").setLevel(logging.WARNING)

    model_dir = args.workdir / "tiny-llama"
    if not (model_dir / "config.json").exists():
        make_tiny_model(model_dir, family="llama", layers=4, hidden=64, seed=0)
    with LocalSwarm(args.workdir / "logs") as local:
        local.start_dht()
        logger.info("bootstrap node: %s", local.initial_peers[0])
        spans = {"peer-a1": "0:2", "peer-a2": "0:2", "peer-b": "2:4"}
        extra = ["--balance-interval", "2"]
        peers = local.start_peers(model_dir, spans, extra)
        peers |= local.start_peers(model_dir, {"peer-c": None}, [*extra, "--num-blocks", "2"])
        for name, peer in peers.items():
            logger.info("%s: %s", name, peer.wait_for_line("serving blocks", 1).split("peers.daemon: ")[-1])
        model = swarm.SwarmModelForCausalLM.from_pretrained(
            model_dir,
            initial_peers=local.initial_peers,
            adapter=f"demo-{int(time.time())}",
            lora_config=peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"]),
        )
        try:
            optimizer = swarm.RemoteOptimizer(model, lr=3e-3, weight_decay=0.0)
            batches = synthetic_batches(model.spec.config.vocab_size, count=2)
            for step in range(1, args.steps + 1):
                if step == args.kill_at_step:
                    threading.Timer(0.05, peers["peer-b"].signal, args=(signal.SIGKILL,)).start()
                    print(f"--- SIGKILL peer-b ({peers['peer-b'].peer_id}) during step {step} ---")
                if step == args.orphan_at_step:  # right after a step returned: durable, so nothing is lost
                    peers["peer-c"].signal(signal.SIGKILL)
                    print(f"--- SIGKILL peer-c ({peers['peer-c'].peer_id}), the last server of blocks 2:4 ---")
                started = time.perf_counter()
                losses = []
                for batch in batches:  # two micro-batches per step: gradient accumulation
                    out = model(**batch)
                    (out.loss / len(batches)).backward()
                    losses.append(out.loss.item())
                optimizer.step()
                optimizer.zero_grad()
                print(f"step {step:3d}  loss {sum(losses) / len(losses):.4f}  ({time.perf_counter() - started:.2f}s)")
            for r in model.recoveries:
                print(
                    f"recovered: peer {r.peer} failed during {r.during} of step {r.step + 1}; "
                    f"the retry took {r.seconds:.2f}s"
                )
            print(f"steps lost: {sum(e.steps for e in model.steps_lost)} {model.steps_lost or ''}")
            print(f"copies of step {model.step} per block: {model.copies}")
            if args.orphan_at_step:
                time.sleep(3.0)  # the mover hands its old blocks over after a grace period
                for name in ("peer-a1", "peer-a2"):
                    moved = [ln for ln in peers[name].log.read_text().splitlines() if "now serving blocks" in ln]
                    if moved:
                        print(f"{name} took over: {moved[-1].split('peers.daemon: ')[-1]}")
            adapter_dir = model.save_adapter(args.workdir / "adapter")
            print(f"adapter saved to {adapter_dir} (load it with peft.PeftModel.from_pretrained)")
        finally:
            model.shutdown()
        print(status(local.initial_peers, None, None, replication=2))


if __name__ == "__main__":
    main()
