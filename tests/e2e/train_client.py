"""A training client as its own process, so a test can SIGKILL it mid-step and start it again."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from failover_helpers import HPARAMS, MAX_GRAD_NORM, MICRO_BATCHES, batches_for_step, connect  # noqa: E402

import swarm  # noqa: E402
from swarm.testing.localswarm import LocalSwarm  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--adapter", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--hang-in-step", type=int, default=None, help="stop (forever) after one micro-batch of it")
    parser.add_argument("--pause", type=float, default=0.0, help="seconds to wait after each micro-batch (mid-step)")
    args = parser.parse_args()
    local = LocalSwarm(args.out, initial_peers=args.initial_peers)
    model = connect(local, args.model, args.adapter, trainer="test-trainer")
    print(f"resumed at step {model.step}", flush=True)
    if model.step == 0:
        model.save_adapter(args.out / "initial")
    optimizer = swarm.RemoteOptimizer(model, **HPARAMS)
    while model.step < args.steps:
        for index, batch in enumerate(batches_for_step(model.step)):
            (model(**batch).loss / MICRO_BATCHES).backward()
            time.sleep(args.pause)
            if model.step == args.hang_in_step and index == 0:
                print("hanging mid-step", flush=True)
                time.sleep(3600)
        model.clip_grad_norm_(MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad()
        print(f"committed step {model.step}", flush=True)
    model.save_adapter(args.out / "final")
    print(f"steps lost: {model.steps_lost}", flush=True)
    model.shutdown()
    print("done", flush=True)


if __name__ == "__main__":
    main()
