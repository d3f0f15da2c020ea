"""A peer's adapter state, apart from compute: per-block LoRA + AdamW + step, its transferable form and packing,
the adapters a peer holds (served and standby), the activation cache kept between forward and backward, and the span
inputs kept until the step commits."""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import torch

from peers.reduction.running import RunningSum
from peers.update import BlockOptimizer, adamw_, new_moments
from swarm.blocks import LoraParam
from swarm.net import hostsync
from swarm.net.errors import KeptInputsFullError, RequestError, TokensInFlightError
from swarm.net.protocol import Group, OptimizerHParams, adapter_meta

GradsByBlock = dict[int, dict[str, list[torch.Tensor]]]
Entries = list[tuple[str, torch.Tensor, dict[str, torch.Tensor]]]  # per LoRA tensor: its name, value and moments


def session_of(micro_batch: str) -> str:
    """Micro-batch ids are ``session:step:counter``."""
    return micro_batch.split(":", 1)[0]


@dataclass(frozen=True)
class Reduced:
    """A block's reduced gradient of a step, gathered from its reducers' chunks, and the groups it is the sum of."""

    groups: tuple[Group, ...]
    grads: list[torch.Tensor]


@dataclass
class BlockAdapter:
    """One adapter on one block: LoRA tensors, AdamW state, committed step and this step's gradients."""

    params: list[LoraParam]
    optimizer: BlockOptimizer
    step: int = 0
    grads: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    partials: dict[Group, list[torch.Tensor]] = field(default_factory=dict)  # other holders' sums, fetched at commit
    reduced: Reduced | None = None  # the step's whole reduced gradient, gathered in chunks at commit
    last_update: BlockUpdate | None = None  # what took the state from step - 1 to step, for copies one step behind
    undo: Undo | None = None  # the block as it was before its last apply
    running: RunningSum = field(default_factory=RunningSum)  # its own micro-batches' sum so far

    def take_back(self) -> bool:
        """Undo the last apply exactly (state, gradients, last update): a commit that reached this replica but
        must wait for gradients replayed elsewhere. Redoing it yields the same bits. False if there is none. A state
        that came from elsewhere (a move, a sync, a checkpoint) takes back to the state before, without the
        micro-batch gradients: a redo fetches them or has them replayed."""
        undo, self.undo = self.undo, None
        if undo is None:
            return False
        undo.state.load_into(self)
        self.grads, self.partials, self.last_update = undo.grads, undo.partials, undo.last_update
        return True

    def digest(self) -> str:
        """Hash of everything that must agree between replicas: step, LoRA tensors, AdamW moments."""
        return state_digests([(self.step, self.entries())])[0]

    def entries(self) -> Entries:
        return [(lp.name, lp.param, self.optimizer.state.get(lp.param, {})) for lp in self.params]


def state_digests(states: list[tuple[int, Entries]]) -> list[str]:
    """The digest of each block's state (step; per LoRA tensor: its name, value and AdamW moments), served or a
    copy: the bytes of them all copied to the host at once (swarm/net/hostsync.py), then hashed block by block."""
    order = [[(name, param), *sorted(moments.items())] for _, entries in states for name, param, moments in entries]
    flat = hostsync.flat_bytes([tensor for fields in order for _, tensor in fields]).numpy()
    digests, offset, fields = [], 0, iter(order)
    for step, entries in states:
        h = hashlib.sha256(str(step).encode())
        for _ in entries:
            for label, tensor in next(fields):
                size = tensor.numel() * tensor.element_size()
                h.update(label.encode())
                h.update(memoryview(flat[offset : offset + size]))
                offset += size
        digests.append(h.hexdigest())
    return digests


@dataclass
class Undo:
    """A block before an apply: its state, the micro-batch gradients and partial sums applied, and the update before
    that one."""

    state: BlockState
    grads: dict[str, list[torch.Tensor]]
    last_update: BlockUpdate | None
    partials: dict[Group, list[torch.Tensor]] = field(default_factory=dict)


BEFORE = "before."  # the fields of BlockState.before, beside the state's own, on the wire and in checkpoints


@dataclass
class BlockState:
    """A block's adapter state in transferable form: step, and per LoRA tensor its value and AdamW moments.
    ``before``: the state before the block's last apply, while that apply may still have to be taken back. It
    travels with the state, so a copy (a move's, a sync's, a restart's from its checkpoint) can take the step back
    like the replica it came from: a client replaying gradients lost in the middle of a commit needs every block of
    the replay's chain at the step, and the only holders of some block may be such copies."""

    step: int
    tensors: dict[str, dict[str, torch.Tensor]]
    before: BlockState | None = None

    @classmethod
    def of(cls, state: BlockAdapter, with_before: bool = True) -> BlockState:
        return cls.of_all([state], with_before)[0]

    @classmethod
    def of_all(cls, states: list[BlockAdapter], with_before: bool = True) -> list[BlockState]:
        """Host copies of blocks' states, for one copy from the device (swarm/net/hostsync.py)."""
        fields = [
            [(name, [("param", param), *moments.items()]) for name, param, moments in state.entries()]
            for state in states
        ]
        host = iter(hostsync.to_host([t for block in fields for _, entry in block for _, t in entry]))
        copies = []
        for state, block in zip(states, fields, strict=True):
            tensors = {name: {key: next(host) for key, _ in entry} for name, entry in block}
            before = state.undo.state if with_before and state.undo is not None else None
            copies.append(cls(step=state.step, tensors=tensors, before=before))
        return copies

    def fields(self) -> dict[str, dict[str, torch.Tensor]]:
        """Per LoRA tensor its fields, those of ``before`` among them under the prefix ``BEFORE``: one flat form."""
        merged = {name: dict(entry) for name, entry in self.tensors.items()}
        for name, entry in (self.before.tensors if self.before is not None else {}).items():
            merged.setdefault(name, {}).update({BEFORE + key: tensor for key, tensor in entry.items()})
        return merged

    @classmethod
    def from_fields(
        cls, step: int, fields: dict[str, dict[str, torch.Tensor]], before_step: int | None = None
    ) -> BlockState:
        """The inverse of ``fields``: ``before_step`` says whether there is a state before, and its step."""

        def part(before: bool) -> dict[str, dict[str, torch.Tensor]]:
            picked = {
                name: {key.removeprefix(BEFORE): t for key, t in entry.items() if key.startswith(BEFORE) == before}
                for name, entry in fields.items()
            }
            return {name: entry for name, entry in picked.items() if entry}

        before = None if before_step is None else cls(before_step, part(before=True))
        return cls(step, part(before=False), before)

    def digest(self) -> str:
        """The same digest as the served block's (``BlockAdapter.digest``) holding this state."""
        return state_digests([(self.step, self.entries())])[0]

    def entries(self) -> Entries:
        return [(n, e["param"], {k: v for k, v in e.items() if k != "param"}) for n, e in self.tensors.items()]

    def load_into(self, state: BlockAdapter) -> None:
        names = {lp.name for lp in state.params}
        if set(self.tensors) != names:
            raise RequestError(f"state names {sorted(self.tensors)} do not match this block's LoRA {sorted(names)}")
        with torch.no_grad():
            for lp in state.params:
                entry = self.tensors[lp.name]
                if entry["param"].shape != lp.param.shape:
                    raise RequestError(f"state tensor {lp.name} has shape {list(entry['param'].shape)}")
                lp.param.copy_(entry["param"])
                # the step count stays on the host, as torch's AdamW keeps it: read there without a device's sync
                moments = {
                    k: v.clone() if k == "step" else v.to(lp.param.device) for k, v in entry.items() if k != "param"
                }
                if moments:
                    state.optimizer.state[lp.param] = moments
                else:
                    state.optimizer.state.pop(lp.param, None)
        state.step = self.step
        state.grads.clear()
        state.partials.clear()
        state.last_update = None
        revertible = self.before is not None and self.before.step == self.step - 1
        state.undo = Undo(self.before, {}, None) if revertible else None


@dataclass
class BlockUpdate:
    """What takes a block's state from ``step`` to ``step + 1``: the step's summed LoRA gradients and the optimizer
    settings applied with them. A third of the bytes of a state: a peer whose copy is at ``step`` applies it itself,
    with the same update (peers/update.py), and gets the same bits as the servers, on any device."""

    step: int
    grads: dict[str, torch.Tensor]
    hparams: OptimizerHParams
    base: str = ""  # the digest of the state it was applied to on its server ("": not known, not checked)
    # the digest of its server's state when it handed the update on: what that server serves and votes with
    after: str = ""

    def fits(self, state: BlockState) -> bool:
        """Whether ``state``, at the update's step, holds the server's bits (when the base is known). A copy at the
        right step from another lineage (a step the server took back and redid with other gradients) would silently
        drift from the servers, and its holder break a vote when it takes over."""
        return not self.base or state.digest() == self.base

    def reaches(self, state: BlockState) -> bool:
        """Whether ``state``, this update applied to a copy that fits, is the server's state (when it was sent). A
        server whose state is not its own update applied to the state before altered it outside the step: the copy
        made here is the honest one, and the server's state is refused (issue 59: a liar that served a span first
        must not seed its replicas)."""
        return not self.after or state.digest() == self.after

    def explains(self, state: BlockState) -> bool:
        """Whether ``state`` (a server's, with the state before its last step) is this update applied to that state
        before: a server that altered its adapter outside the step holds a state its own update does not give."""
        before = state.before
        if before is None or before.step != self.step or state.step != self.step + 1 or not self.fits(before):
            return False
        return self.apply_to(replace(before, before=None)).digest() == state.digest()

    def apply_to(self, state: BlockState) -> BlockState:
        if state.step != self.step or set(state.tensors) != set(self.grads):
            raise RequestError(f"an update from step {self.step} does not fit a copy at step {state.step}")
        tensors = {}
        for name, entry in state.tensors.items():
            param = entry["param"].clone()
            moments = {k: v.clone() for k, v in entry.items() if k != "param"} or new_moments(param)
            adamw_(param, self.grads[name], moments, self.hparams)
            tensors[name] = {"param": param, **moments}
        return BlockState(self.step + 1, tensors)

    def as_state(self) -> BlockState:
        """Packable like a state: the gradients under the key ``grad``, at the step they start from."""
        return BlockState(self.step, {name: {"grad": grad} for name, grad in self.grads.items()})

    @classmethod
    def from_state(cls, state: BlockState, hparams: OptimizerHParams, base: str = "", after: str = "") -> BlockUpdate:
        return cls(state.step, {name: entry["grad"] for name, entry in state.tensors.items()}, hparams, base, after)


STATE_DTYPES = ("float32", "bfloat16", "float16")


def pack_states(states: dict[int, BlockState]) -> tuple[list, torch.Tensor]:
    """Block states as one flat float32 tensor plus an index (block, step, name, key, shape, dtype): serializing
    one tensor costs a fraction of serializing hundreds of small ones, and float32 holds bf16/fp16 exactly. A block
    without LoRA tensors (left out by ``layers_to_transform``) still travels, as one empty entry named "". A state's
    ``before`` travels beside it, its keys prefixed ``BEFORE``."""
    index, parts = [], []
    for block, state in sorted(states.items()):
        parts_of = [(state, "")] + ([(state.before, BEFORE)] if state.before is not None else [])
        for part, prefix in parts_of:
            if not part.tensors:
                index.append([block, part.step, "", prefix, [0], "float32"])
            for name, entry in sorted(part.tensors.items()):
                for key, tensor in sorted(entry.items()):
                    dtype = str(tensor.dtype).removeprefix("torch.")
                    index.append([block, part.step, name, prefix + key, list(tensor.shape), dtype])
                    parts.append(tensor.detach().reshape(-1).to(torch.float32))
    return index, torch.cat(parts) if parts else torch.zeros(0)


def unpack_states(index: list, flat: torch.Tensor) -> dict[int, BlockState]:
    counts = [math.prod(int(x) for x in shape) for *_, shape, _ in index]
    if sum(counts) != flat.numel() or any(dtype not in STATE_DTYPES for *_, dtype in index):
        raise ValueError(f"a state index of {sum(counts)} values in {STATE_DTYPES} for a tensor of {flat.numel()}")
    steps: dict[int, int] = {}
    before_steps: dict[int, int] = {}
    fields: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
    offset = 0
    for (block, step, name, key, shape, dtype), count in zip(index, counts, strict=True):
        tensor = flat[offset : offset + count].reshape(shape).to(getattr(torch, dtype)).clone()
        offset += count
        block, key = int(block), str(key)
        (before_steps if key.startswith(BEFORE) else steps)[block] = int(step)
        by_name = fields.setdefault(block, {})
        if name != "":
            by_name.setdefault(str(name), {})[key] = tensor
    if set(fields) != set(steps):
        raise ValueError(f"a state index with a state before but none of its own for blocks {set(fields) - set(steps)}")
    return {
        block: BlockState.from_fields(steps[block], by_name, before_steps.get(block))
        for block, by_name in fields.items()
    }


@dataclass
class Adapter:
    """An adapter as this peer holds it: its identity, the trainer session that holds it, the live state of the
    blocks it serves, and standby copies of blocks it may have to take over (state only, no base weights)."""

    config_wire: dict
    seed: int
    blocks: dict[int, BlockAdapter] = field(default_factory=dict)
    standby: dict[int, BlockState] = field(default_factory=dict)
    session: str | None = None

    def steps(self) -> dict[int, int]:
        return {block: state.step for block, state in self.blocks.items()}

    def standby_steps(self) -> dict[int, int]:
        return {block: state.step for block, state in self.standby.items()}

    @property
    def meta(self) -> dict:
        """What a checkpoint or another peer needs to rebuild this adapter: its LoRA config and seed."""
        return adapter_meta(self.config_wire, self.seed)


class SavedBytes:
    """While inside: the bytes autograd keeps for backward, each storage counted once, the blocks' own weights
    (``exclude``: their storages) left out: what a block's graph holds, for a Llama block about 22 times its output
    (attention and the wider MLP keep several tensors each). Peers no longer keep graphs between forward and
    backward (the ``ActivationCache`` keeps block inputs); this measures one where wanted."""

    def __init__(self, exclude: set[int]):
        self.exclude, self.seen, self.bytes = exclude, set(), 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """Count the tensor and keep it detached: a hooked node holding a saved output itself (RMSNorm's rsqrt) forms
        a cycle through C++ that Python's gc cannot see, so a graph whose backward skipped that node (a backward for
        the LoRA gradients only, as at a chain's head) would never be freed, and the peer grows with every step."""
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in self.exclude and pointer not in self.seen:
            self.seen.add(pointer)
            self.bytes += storage.nbytes()
        return tensor.detach()

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


class ActivationCache:
    """Training forwards' block inputs (and the mask), kept for the backward of the same micro-batch, which
    recomputes one block at a time from them (peers/backend.py); bounded in bytes (oldest dropped: its backward
    rebuilds them from the kept span input). The bound counts what an entry really holds: each storage once."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple, tuple[list[torch.Tensor], torch.Tensor | None, int]] = OrderedDict()
        self.bytes = 0

    @staticmethod
    def size(tensors: Iterable[torch.Tensor | None]) -> int:
        """The bytes ``tensors`` hold, each storage counted once (a view keeps its whole storage)."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
        return sum(storages.values())

    def put(self, key: tuple, block_inputs: list[torch.Tensor], mask: torch.Tensor | None) -> None:
        """Keep a forward's block inputs (the span's first block's first) and its attention mask."""
        size = self.size([*block_inputs, mask])
        if size > self.max_bytes:
            return
        self.pop(key)
        self.entries[key] = (list(block_inputs), mask, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, _, dropped) = self.entries.popitem(last=False)
            self.bytes -= dropped

    def pop(self, key: tuple) -> tuple[list[torch.Tensor], torch.Tensor | None] | None:
        entry = self.entries.pop(key, None)
        if entry is None:
            return None
        self.bytes -= entry[2]
        return entry[0], entry[1]

    def drop_adapter(self, adapter: str) -> None:
        for key in [k for k in self.entries if k[0] == adapter]:
            self.pop(key)

    def drop_touching(self, blocks: set[int]) -> None:
        """Drop the graphs of spans that run through any of ``blocks`` (blocks no longer served)."""
        for key in [k for k in self.entries if touches(k, blocks)]:
            self.pop(key)


def touches(key: tuple, blocks: set[int]) -> bool:
    """Whether a kept forward's key (adapter, micro-batch, start, stop) runs through any of ``blocks``."""
    return any(b in blocks for b in range(key[2], key[3]))


class KeptInputs:
    """The span inputs (and masks) of the step's training micro-batches, in host memory until the step commits: a
    chained backward brings no hidden states, and a forward graph may have been dropped from the activation cache.
    Bounded in bytes; past the bound a forward is refused with what to do (a silent drop would lose a backward)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: dict[tuple, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.bytes = 0
        self.peak = 0

    @staticmethod
    def _size(hidden: torch.Tensor, mask: torch.Tensor | None) -> int:
        sizes = [t.numel() * t.element_size() for t in (hidden, mask) if t is not None]
        return sum(sizes)

    def put(self, key: tuple, hidden: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Keep a micro-batch's span input (a copy on the host); KeptInputsFullError past the bound."""
        self.pop(key)
        size = self._size(hidden, mask)
        if self.bytes + size > self.max_bytes:
            raise KeptInputsFullError(
                f"this peer keeps {self.bytes >> 20} MiB of span inputs for the step in progress and a micro-batch "
                f"needs {max(1, size >> 20)} MiB more, past its --kept-inputs-mb of {self.max_bytes >> 20}; commit "
                "more often (fewer micro-batches per optimizer step) or restart the peer with a larger --kept-inputs-mb"
            )
        self.entries[key] = (hidden.detach().to("cpu", copy=True), None if mask is None else mask.to("cpu", copy=True))
        self.bytes += size
        self.peak = max(self.peak, self.bytes)

    def get(self, key: tuple) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        return self.entries.get(key)

    def pop(self, key: tuple) -> None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.bytes -= self._size(*entry)

    def drop_adapter(self, adapter: str) -> None:
        for key in [k for k in self.entries if k[0] == adapter]:
            self.pop(key)

    def drop_touching(self, blocks: set[int]) -> None:
        """Drop the inputs of spans that run through any of ``blocks`` (blocks no longer served)."""
        for key in [k for k in self.entries if touches(k, blocks)]:
            self.pop(key)

    def count_touching(self, blocks: set[int]) -> int:
        return sum(1 for k in self.entries if touches(k, blocks))


class TokensInFlight:
    """The tokens of training micro-batches forwarded here whose backward has not run, against the peer's bound
    (``--max-tokens-in-flight``: by default what memory they fill first, the device's room for block inputs or the
    host's for span inputs, swarm/memory.py ``default_tokens_in_flight``). A forward past the bound is refused,
    unless nothing is in flight (one micro-batch within ``--max-tokens`` always runs: a bound below one would lock
    the peer). An entry ends with its backward, or with its step (applied, taken back, replaced) or its blocks (no
    longer served), as the kept inputs do."""

    def __init__(self, bound: int):
        self.bound = bound
        self.entries: dict[tuple, int] = {}
        self.tokens = 0
        self.peak = 0

    def admit(self, key: tuple, tokens: int) -> None:
        """Count a forward of ``key`` (its tokens again, for a forward sent again); TokensInFlightError past the
        bound."""
        self.end(key)
        if self.tokens and self.tokens + tokens > self.bound:
            raise TokensInFlightError(
                f"this peer has {self.tokens} tokens of micro-batches in flight (forwarded, backward pending) and a "
                f"micro-batch of {tokens} more would pass its --max-tokens-in-flight of {self.bound}; send fewer "
                "micro-batches at once (max_in_flight) or fewer tokens per micro-batch, or route to another replica"
            )
        self.entries[key] = tokens
        self.tokens += tokens
        self.peak = max(self.peak, self.tokens)

    def end(self, key: tuple) -> None:
        self.tokens -= self.entries.pop(key, 0)

    def drop_adapter(self, adapter: str) -> None:
        for key in [k for k in self.entries if k[0] == adapter]:
            self.end(key)

    def drop_touching(self, blocks: set[int]) -> None:
        for key in [k for k in self.entries if touches(k, blocks)]:
            self.end(key)
