"""The adapters a peer holds and their training state: per block LoRA, AdamW state and step (served or standby), each
micro-batch's gradients until its step commits, the forwards kept for their backward, and the replicas' digests
(peers/state.py). The span's compute (peers/backend.py) runs forwards and backwards on it; a step's commit
(peers/commits.py), the moves of state in and out (peers/transfer.py) and what a peer reports of its gradients
(peers/reduction/reports.py) are collaborators made with the store."""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from peers.behaviour import Behaviour
from peers.state import (
    ActivationCache,
    Adapter,
    BlockAdapter,
    BlockState,
    KeptInputs,
    TokensInFlight,
    session_of,
    state_digests,
)
from peers.update import BlockOptimizer
from swarm.blocks import add_lora, lora_config_from_wire, spans_text
from swarm.net.errors import (
    FencedError,
    NotServedError,
    RequestError,
    StaleStepError,
    UnknownAdapterError,
    WeightsMismatchError,
)
from swarm.net.protocol import AdapterInfo, Group, lora_and_seed
from swarm.spec import ModelSpec
from swarm.weights import differing

logger = logging.getLogger(__name__)


class AdapterStore:
    """Every adapter this peer holds, on the blocks it serves and on standby. Not thread-safe: one caller at a time
    (the service's compute thread)."""

    def __init__(
        self,
        spec: ModelSpec,
        weight_digests: dict[int, str] | None = None,
        activation_cache_bytes: int = 1 << 30,
        kept_inputs_bytes: int = 4 << 30,
        max_tokens_in_flight: int = 1 << 20,
        behaviour: Behaviour | None = None,
    ):
        self.spec = spec
        self.behaviour = behaviour  # what it does to the gradients and updates it hands on (peers/behaviour.py)
        # block -> digest of the base weights this peer loads (swarm/weights.py)
        self.weight_digests = weight_digests or {}
        self.mismatched: dict[str, list[int]] = {}  # adapter -> the blocks whose weights differ from its pin
        self.served: dict[int, nn.Module] = {}  # the compute's loaded blocks: where the served LoRA lives
        self.by_name: dict[str, Adapter] = {}
        self.cache = ActivationCache(activation_cache_bytes)  # a training forward's graph, until its backward
        self.kept = KeptInputs(kept_inputs_bytes)  # a training forward's input, until its step commits
        self.in_flight_tokens = TokensInFlight(max_tokens_in_flight)  # forwarded here, backward pending
        self.last_trained = 0.0  # monotonic time of the last training forward or backward here

    # --- which blocks ---------------------------------------------------------------------------------------

    def serve(self, layers: dict[int, nn.Module]) -> None:
        """Blocks the compute starts serving: each adapter's state comes from its standby copy when this peer has
        one."""
        self.served.update(layers)
        for name, adapter in self.by_name.items():
            self._fill(name, adapter)

    def unserve(self, blocks: list[int]) -> None:
        """Blocks the compute stops serving: their adapter state stays here as standby copies (a peer that moves
        keeps them). Forwards kept for spans through other blocks stay: their micro-batches are in flight."""
        for block in blocks:
            self.served.pop(block, None)
            for adapter in self.by_name.values():
                state = adapter.blocks.pop(block, None)
                if state is not None:
                    adapter.standby[block] = BlockState.of(state)
        self.cache.drop_touching(set(blocks))
        self.kept.drop_touching(set(blocks))
        self.in_flight_tokens.drop_touching(set(blocks))

    def progress(self) -> int:
        """The newest committed step of any adapter on the blocks served here: it grows by one with each commit."""
        return max((state.step for adapter in self.by_name.values() for state in adapter.blocks.values()), default=0)

    def in_flight(self, blocks: list[int]) -> int:
        """How many things of the step in progress still count on ``blocks`` here: micro-batch gradients held until
        the step commits, and forwards kept for a backward. A move hands blocks over only once this is 0."""
        held = sum(len(a.blocks[b].grads) for a in self.by_name.values() for b in blocks if b in a.blocks)
        return held + self.kept.count_touching(set(blocks))

    def forget_forwards(self, name: str) -> None:
        """Drop the adapter's forward graphs and kept inputs: its step was applied, taken back or replaced, so no
        backward of them can count any more."""
        self.cache.drop_adapter(name)
        self.kept.drop_adapter(name)
        self.in_flight_tokens.drop_adapter(name)

    def _fill(self, name: str, adapter: Adapter) -> None:
        """Give every served block this adapter's LoRA: from the standby copy if any, else the deterministic init."""
        config = lora_config_from_wire(adapter.config_wire)
        for block, layer in self.served.items():
            if block in adapter.blocks:
                continue
            params = add_lora(layer, self.spec, block, name, config, adapter.seed)
            state = adapter.blocks[block] = BlockAdapter(params=params, optimizer=BlockOptimizer())
            standby = adapter.standby.pop(block, None)
            if standby is not None:
                standby.load_into(state)
                logger.info("adapter %r block %d starts from its standby copy at step %d", name, block, state.step)

    # --- adapters -------------------------------------------------------------------------------------------

    def ensure_adapter(self, name: str, config_wire: dict, seed: int) -> Adapter:
        """The adapter ``name``, created (deterministic init on served blocks) if new; its config must match."""
        adapter = self.by_name.get(name)
        if adapter is None:
            adapter = self.by_name[name] = Adapter(config_wire=config_wire, seed=seed)
            self._fill(name, adapter)
            logger.info("opened adapter %r on blocks %s", name, spans_text(sorted(self.served)))
        elif adapter.config_wire != config_wire or adapter.seed != seed:
            raise RequestError(f"adapter {name!r} exists here with another LoRA config or seed; pick a new name")
        return adapter

    def open_adapter(
        self,
        name: str,
        config_wire: dict,
        seed: int,
        session: str | None = None,
        weights: dict[int, str] | None = None,
    ) -> dict[int, int]:
        """Create an adapter on every block (deterministic init) or check it matches; a session claims it. An adapter
        pinned to other base weights (``weights``: block -> digest) than this peer's is refused, and logged once."""
        self.check_weights(name, weights or {})
        adapter = self.ensure_adapter(name, config_wire, seed)
        if session is not None and session != adapter.session:
            if adapter.session is not None:
                logger.info("adapter %r claimed by a new trainer session; dropping the old session's gradients", name)
            adapter.session = session
            for state in adapter.blocks.values():
                state.grads = {mb: g for mb, g in state.grads.items() if session_of(mb) == session}
                state.partials = {}
            self.forget_forwards(name)
        return adapter.steps()

    def check_weights(self, name: str, weights: dict[int, str]) -> None:
        differ = differing(self.weight_digests, weights, sorted(self.served))
        if not differ:
            return
        if self.mismatched.get(name) != differ:
            logger.error(
                "adapter %r was trained on other weights of blocks %s than this peer's %s: serving it nothing (this "
                "folder is another model under the same name; serve the adapter's model, or train a new adapter)",
                name,
                spans_text(differ),
                self.spec.path,
            )
        self.mismatched[name] = differ
        raise WeightsMismatchError(
            f"adapter {name!r} is pinned to other base weights of blocks {spans_text(differ)} than this peer's "
            f"(its folder {self.spec.name!r} holds another model under the same name); route elsewhere"
        )

    def adapter_infos(self) -> dict[str, AdapterInfo]:
        """What this peer holds of each adapter (its meta, served and standby steps): what it tells the swarm."""
        return {name: AdapterInfo(a.meta, a.steps(), a.standby_steps()) for name, a in self.by_name.items()}

    def adapter(self, name: str) -> Adapter:
        try:
            return self.by_name[name]
        except KeyError:
            raise UnknownAdapterError(f"unknown adapter {name!r}: open it first") from None

    def trained(self, name: str, micro_batch: str) -> Adapter:
        """The adapter, for a training request: fenced off from a trainer session that was replaced."""
        adapter = self.adapter(name)
        if adapter.session is not None and session_of(micro_batch) != adapter.session:
            raise FencedError(f"adapter {name!r} is held by another trainer session; this session was replaced")
        self.last_trained = time.monotonic()
        return adapter

    def states(self, adapter: Adapter, blocks: range, step: int, or_later: bool = False) -> dict[int, BlockAdapter]:
        """The blocks' states, all at ``step`` (for training); ``or_later``: all at one step, ``step`` or newer (a
        read: evaluation or generation, by a client that may lag the trainer's last commit)."""
        states = {block: adapter.blocks[block] for block in blocks}
        steps = sorted({state.step for state in states.values()})
        if steps != [step] and not (or_later and len(steps) == 1 and steps[0] > step):
            raise StaleStepError(f"blocks {blocks.start}:{blocks.stop} are at step {steps} here, not {step}")
        return states

    def hold_grads(self, states: dict[int, BlockAdapter], micro_batch: str, grads: list[torch.Tensor]) -> None:
        """A backward's LoRA gradients (``states``' params in order), kept per (micro-batch, block) until the step
        commits; counted once: a retried backward keeps the first."""
        for state in states.values():
            count = len(state.params)
            block_grads, grads = grads[:count], grads[count:]
            if micro_batch not in state.grads:
                held = [g.detach() for g in block_grads]
                state.grads[micro_batch] = held if self.behaviour is None else self.behaviour.held_grads(held)

    def ledger_states(self, name: str, step: int, ledger: dict[int, list[Group]]) -> dict[int, BlockAdapter]:
        """The blocks of the ledger that this peer holds, checked to be served here and at ``step`` or past it. A peer
        that restarted on other blocks may still hold the state of those it served before, one step behind or stale;
        a client whose records are older asks it to commit them: refused (``not_served``), never applied or voted."""
        if any(isinstance(group, str) for groups in ledger.values() for group in groups):
            raise TypeError("a ledger's groups are tuples of micro-batch ids (see ledger_groups), not ids")
        adapter = self.adapter(name)
        unserved = sorted(block for block in ledger if block not in self.served)
        if unserved:
            raise NotServedError(
                f"blocks {unserved} are not served here (this peer serves {spans_text(sorted(self.served))}); "
                "commit them on the peers that serve them"
            )
        states = {block: adapter.blocks[block] for block in ledger if block in adapter.blocks}
        behind = [block for block, state in states.items() if state.step < step]
        if behind:
            raise StaleStepError(f"blocks {behind} of adapter {name!r} are behind step {step}; sync them first")
        return states

    # --- state held -----------------------------------------------------------------------------------------

    def keep_standby(
        self,
        name: str,
        meta: dict,
        states: dict[int, BlockState],
        keep: set[int] | None,
        trainer_step: int | None = None,
    ) -> None:
        """Store newer standby copies of blocks; forget copies outside ``keep`` (None: forget nothing). A served
        block changes only as the trainer says: a copy at ``trainer_step`` (the step the trainer asked this peer to
        hold: a peer handing the block over is asked as a holder) replaces a served state behind it; any other
        copy leaves served blocks alone. A copy pulled in the background, or the newest state a move takes, may hold
        a step the trainer has since taken back: loaded into served blocks, it put a peer past the step the trainer
        replayed, behind its back, and the replay waited for that step until its patience ran out (an hour of churn
        stalled so). A block not served yet starts from its copy when it is installed."""
        adapter = self.by_name.get(name)
        created = adapter is None
        lora, seed = lora_and_seed(meta)
        if adapter is None:
            adapter = self.by_name[name] = Adapter(config_wire=lora, seed=seed)
        elif adapter.config_wire != lora or adapter.seed != seed:
            raise RequestError(f"adapter {name!r} exists here with another LoRA config or seed")
        before = sorted(adapter.standby)
        for block, state in states.items():
            served, held = adapter.blocks.get(block), adapter.standby.get(block)
            if served is None and (held is None or held.step <= state.step):
                adapter.standby[block] = state
            elif served is not None and state.step == trainer_step and served.step < state.step:
                state.load_into(served)
                self.forget_forwards(name)  # only then: a plain refresh must not drop graphs kept for backward
        if keep is not None:
            for block in [b for b in adapter.standby if b not in keep]:
                del adapter.standby[block]
        if sorted(adapter.standby) != before:  # what an operator (and the churn test) reads as this peer's copies
            logger.info("adapter %r: holding standby copies of blocks %s", name, spans_text(sorted(adapter.standby)))
        if created:
            self._fill(name, adapter)  # served blocks start from the copies just stored

    def snapshot(self, name: str) -> dict[int, BlockState]:
        """Every block state this peer holds for the adapter (served and standby), for a checkpoint."""
        adapter = self.adapter(name)
        states = dict(zip(adapter.blocks, BlockState.of_all(list(adapter.blocks.values())), strict=True))
        return {**adapter.standby, **states}

    def digests(self, name: str) -> dict[int, str]:
        """Each served block's state digest (the replicas' vote), from one copy of the span's state to the host."""
        blocks = self.adapter(name).blocks
        return dict(zip(blocks, state_digests([(s.step, s.entries()) for s in blocks.values()]), strict=True))
