"""The adapters a peer holds and their training state: per block LoRA, AdamW state and step (served or standby), each
micro-batch's gradients until its step commits, the forwards kept for their backward, commits (AdamW in canonical
order), the replicas' digests, and the moves of state in and out (peers/state.py). The span's compute
(peers/backend.py) runs forwards and backwards on it."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import replace

import torch
from torch import nn

from peers.behaviour import Behaviour
from peers.reduction import norms, sums
from peers.reduction.running import RunningSum
from peers.state import (
    ActivationCache,
    Adapter,
    BlockAdapter,
    BlockState,
    BlockUpdate,
    GradsByBlock,
    KeptInputs,
    TokensInFlight,
    Undo,
    session_of,
    state_digests,
)
from peers.update import BlockOptimizer, steps_done
from swarm.blocks import add_lora, lora_config_from_wire, spans_text
from swarm.net import hostsync
from swarm.net.errors import (
    FencedError,
    MissingGradientsError,
    NotServedError,
    RequestError,
    StaleStepError,
    UnknownAdapterError,
    WeightsMismatchError,
)
from swarm.net.gradhash import grad_hashes
from swarm.net.gradnorm import GradNorm, covers_digest
from swarm.net.protocol import AdapterInfo, Group, OptimizerHParams, lora_and_seed
from swarm.net.reduction import add_up, partial_sum
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

    def _forget_forwards(self, name: str) -> None:
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
            self._forget_forwards(name)
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

    # --- commit ---------------------------------------------------------------------------------------------

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

    def grad_norms(self, name: str, blocks: range, step: int) -> tuple[GradNorm, ...]:
        """What a backward's reply says of its blocks: each one's gradient summed over every micro-batch held here at
        ``step``, as a 2-norm and an inf-norm share, and which micro-batches those are."""
        held = self._holding(name, blocks, step)
        # one holder's sum: the step's, if it holds all; kept as the backwards come (peers/reduction/running.py)
        summed = [state.running.of(state.grads, tuple(state.grads)) for state in held.values()]
        return tuple(
            GradNorm(
                block,
                covers_digest(state.grads),
                math.fsum(two**2 for two, _ in by_tensor),
                max((inf for _, inf in by_tensor), default=0.0),
            )
            for (block, state), by_tensor in zip(held.items(), norms.tensor_norms(summed, (2.0, math.inf)), strict=True)
        )

    def grad_hashes(self, name: str, blocks: range, step: int, micro_batch: str) -> tuple[tuple[int, str], ...]:
        """What a backward's reply says of the micro-batch's gradients held here on each block: their hash (see
        swarm/net/gradhash.py), which the replicas fetching them at commit check."""
        held = {block: s.grads[micro_batch] for block, s in self._holding(name, blocks, step, micro_batch).items()}
        return tuple(zip(held, grad_hashes(list(held.values())), strict=True))

    def _holding(self, name: str, blocks: range, step: int, micro_batch: str | None = None) -> dict[int, BlockAdapter]:
        """The blocks holding gradients at ``step`` here (of ``micro_batch``, if given)."""
        at_step = {block: self.adapter(name).blocks.get(block) for block in blocks}
        return {
            block: state
            for block, state in at_step.items()
            if state is not None and state.step == step and (micro_batch in state.grads if micro_batch else state.grads)
        }

    def norm_parts(self, name: str, step: int, groups: dict[int, list[Group]], norm_type: float) -> dict[int, float]:
        """Per block of the ledger held here at ``step``, its share of the step's ``norm_type``-norm (see
        ``NormsRequest``); raises MissingGradientsError when some of the ledger's gradients are not here."""
        states = self.ledger_states(name, step, groups)
        missing = sums.missing(states, step, groups)
        if missing:
            raise MissingGradientsError(f"no gradients for {missing} at step {step}", missing)
        at_step = {block: state for block, state in states.items() if state.step == step}
        reduced = [sums.reduced(state, groups[block]) for block, state in at_step.items()]
        parts = {}
        for block, tensor_norms in zip(at_step, norms.tensor_norms(reduced, (norm_type,)), strict=True):
            if math.isinf(norm_type):
                parts[block] = max((n for (n,) in tensor_norms), default=0.0)
            else:
                parts[block] = math.fsum(n**norm_type for (n,) in tensor_norms)
        return parts

    def apply(
        self,
        name: str,
        step: int,
        groups: dict[int, list[Group]],
        hparams: OptimizerHParams,
        grad_scale: float = 1.0,
    ) -> dict[int, int]:
        """Apply step ``step``: per block, the ledger's gradients reduced (each holder's micro-batches summed in
        sorted order, then those partial sums in the order of ``groups``: see ``ledger_groups``), scaled by the step's
        global clipping factor, then one AdamW update. Idempotent: blocks already past ``step`` are left alone."""
        adapter = self.adapter(name)
        states = self.ledger_states(name, step, groups)
        missing = sums.missing(states, step, groups)
        if missing:
            raise MissingGradientsError(f"no gradients for {missing} at step {step}", missing)
        at_step = {block: state for block, state in states.items() if state.step == step}
        summed = {block: sums.reduced(state, groups[block]) for block, state in at_step.items()}
        for block, finite in zip(summed, norms.finite(list(summed.values())), strict=True):
            if not finite:
                raise RequestError(f"step {step} has non-finite gradients on block {block}; refusing to apply them")
        if grad_scale != 1.0:
            for grad in (g for grads in summed.values() for g in grads):
                grad.mul_(grad_scale)
        befores = BlockState.of_all(list(at_step.values()), with_before=False)
        bases = state_digests([(before.step, before.entries()) for before in befores])
        params = {block: [lp.param for lp in state.params] for block, state in at_step.items()}
        done = steps_done([(state.optimizer, params[block]) for block, state in at_step.items()])
        for (block, state), before, steps in zip(at_step.items(), befores, done, strict=True):
            state.undo = Undo(before, state.grads, state.last_update, state.partials)
            state.optimizer.step(params[block], summed[block], hparams, steps)
        host = iter(hostsync.to_host([g for grads in summed.values() for g in grads]))
        for state, base in zip(at_step.values(), bases, strict=True):
            grads = {lp.name: next(host) for lp in state.params}
            state.last_update = BlockUpdate(step, grads, hparams, base)
            state.grads, state.partials, state.reduced, state.running = {}, {}, None, RunningSum()
            state.step += 1
        moved = set(at_step)
        self._forget_forwards(name)
        if self.behaviour is not None:
            self.behaviour.updated([state for block, state in adapter.blocks.items() if block in moved])
        return adapter.steps()

    def revert(self, name: str, step: int) -> dict[int, int]:
        """Take blocks that applied ``step`` back to it (a commit that other replicas could not complete yet)."""
        adapter = self.adapter(name)
        for block, state in adapter.blocks.items():
            if state.step == step + 1 and state.take_back():
                logger.info("adapter %r block %d: step %d taken back, to be redone", name, block, step)
        self._forget_forwards(name)
        return adapter.steps()

    def tiebreak(
        self,
        name: str,
        step: int,
        groups: dict[int, list[Group]],
        grads: GradsByBlock,
        hparams: OptimizerHParams,
        grad_scale: float,
    ) -> dict[int, str]:
        """Two replicas disagree on ``step``: apply it, as ``apply`` would, to this peer's standby copies at ``step``
        (the ledger's gradients given, fetched from their holders), and return the digests. Nothing is kept."""
        adapter = self.adapter(name)
        digests = {}
        for block, block_groups in groups.items():
            held = adapter.standby.get(block)
            if held is None or held.step != step:
                raise StaleStepError(f"no standby copy of adapter {name!r} block {block} at step {step} here")
            by_mb = grads.get(block, {})
            missing = sorted({mb for group in block_groups for mb in group} - set(by_mb))
            if missing:
                raise MissingGradientsError(f"no gradients for {missing} at step {step}", {block: missing})
            names = list(held.tensors)
            dtypes = [held.tensors[n]["param"].dtype for n in names]
            by_mb = {mb: [g.to(d) for g, d in zip(tensors, dtypes, strict=True)] for mb, tensors in by_mb.items()}
            summed = add_up([partial_sum(by_mb, group) for group in block_groups])
            if grad_scale != 1.0:
                for grad in summed:
                    grad.mul_(grad_scale)
            update = BlockUpdate(step, dict(zip(names, summed, strict=True)), hparams)
            digests[block] = update.apply_to(held).digest()
        return digests

    # --- state ----------------------------------------------------------------------------------------------

    def export_state(
        self, name: str, blocks: range, held: dict[int, int] | None = None
    ) -> tuple[dict[int, BlockState], dict[int, BlockUpdate]]:
        """LoRA tensors, AdamW moments and step of each block, served or standby: what another peer needs. For a
        served block that the asking peer ``held`` one step behind, the last update instead (a third of the bytes)."""
        adapter = self.adapter(name)
        states: dict[int, BlockState | None] = {}  # None: a served block's, copied below
        updates, whole = {}, []
        for block in blocks:
            served = adapter.blocks.get(block)
            update = served.last_update if served is not None else None
            if update is not None and held is not None and held.get(block) == update.step == served.step - 1:
                updates[block] = replace(update, after=served.digest())  # what the asker's copy must reach
            elif served is not None:
                states[block] = None
                whole.append(served)
            elif block in adapter.standby:
                states[block] = adapter.standby[block]
        copies = iter(BlockState.of_all(whole))  # one copy to the host
        return {block: next(copies) if state is None else state for block, state in states.items()}, updates

    def import_state(self, name: str, states: dict[int, BlockState]) -> dict[int, int]:
        """Replace this peer's state of served blocks by a current replica's (gradients in progress are dropped)."""
        adapter = self.adapter(name)
        for block, incoming in states.items():
            if block in adapter.blocks:
                incoming.load_into(adapter.blocks[block])
        self._forget_forwards(name)
        return adapter.steps()

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
        for block, state in states.items():
            served, held = adapter.blocks.get(block), adapter.standby.get(block)
            if served is None and (held is None or held.step <= state.step):
                adapter.standby[block] = state
            elif served is not None and state.step == trainer_step and served.step < state.step:
                state.load_into(served)
                self._forget_forwards(name)  # only then: a plain refresh must not drop graphs kept for backward
        if keep is not None:
            for block in [b for b in adapter.standby if b not in keep]:
                del adapter.standby[block]
        if created:
            self._fill(name, adapter)  # served blocks start from the copies just stored

    def apply_updates(
        self,
        name: str,
        updates: dict[int, BlockUpdate],
        sources: Mapping[int, object] | None = None,
        own_lineage: bool = False,
    ) -> list[int]:
        """Bring standby copies one step forward with their servers' last updates; returns the blocks updated (a
        copy that is not at the update's step is left as it is: its holder pulls the whole state next time). A copy
        at the step but not in the server's bits (``BlockUpdate.fits``) is dropped, so the next pull brings it whole.
        A served block gets an update only where its caller asked for one (a span taken over from its deterministic
        init, a trainer's sync): it is brought forward the same way, or left as it is; with ``own_lineage``, also
        where its state is not the server's at the step (the server's state was found altered: see
        ``PeerService._sync``). Where the result is not the server's state (``BlockUpdate.reaches``), the server
        altered its adapter outside the step: the result made here is kept, and the server (``sources``: block ->
        who sent the update) named in the log."""
        adapter = self.adapter(name)
        done, diverged = [], []
        for block, update in updates.items():
            served = adapter.blocks.get(block)
            if served is not None:
                at_step = served.step == update.step
                advanced = self._advance_served(served, update, own_lineage) if at_step else None
                if advanced is not None:
                    self._forget_forwards(name)
            else:
                advanced = self._advance_copy(name, adapter, block, update)
            if advanced is not None:
                done.append(block)
                if not update.reaches(advanced):
                    diverged.append(block)
        for source in {(sources or {}).get(block) for block in diverged}:
            logger.error(
                "adapter %r blocks %s: the state of %s is not its own last update applied to the step before; "
                "refused (this peer applied the update to its own copy). It altered its adapter outside the step: "
                "the replicas' next vote outvotes it",
                name,
                sorted(b for b in diverged if (sources or {}).get(b) == source),
                source or "their server",
            )
        return done

    @staticmethod
    def _advance_copy(name: str, adapter: Adapter, block: int, update: BlockUpdate) -> BlockState | None:
        held = adapter.standby.get(block)
        if held is None or held.step != update.step:
            return None
        if not update.fits(held):
            logger.warning(
                "adapter %r block %d: the standby copy at step %d differs from its server's state; dropped, to be "
                "pulled whole",
                name,
                block,
                held.step,
            )
            del adapter.standby[block]
            return None
        advanced = adapter.standby[block] = update.apply_to(held)
        advanced.before = replace(held, before=None)  # revertible like the server's state
        return advanced

    @staticmethod
    def _advance_served(served: BlockAdapter, update: BlockUpdate, own_lineage: bool) -> BlockState | None:
        """A served block one step forward with another server's update, if it holds that server's bits at the
        step (or ``own_lineage``); it then hands the same update on itself."""
        held = BlockState.of(served, with_before=False)
        if not own_lineage and not update.fits(held):
            return None
        if own_lineage:
            update = replace(update, base=held.digest())
        advanced = update.apply_to(held)
        advanced.before = held  # revertible like the server's state
        advanced.load_into(served)
        served.last_update = replace(update, after="")
        return advanced

    def fast_forward(self, name: str, blocks: range, step: int) -> dict[int, int]:
        """Declare blocks whose newest surviving state is older than ``step`` current at ``step``: the updates
        between are lost. Returns the steps lost per block (reported by the caller, never silent)."""
        adapter = self.adapter(name)
        lost = {}
        for block in blocks:
            state = adapter.blocks.get(block)
            if state is not None and state.step < step:
                lost[block] = step - state.step
                logger.warning(
                    "adapter %r block %d: newest surviving state is step %d, the trainer is at %d: %d step(s) lost",
                    name,
                    block,
                    state.step,
                    step,
                    lost[block],
                )
                state.step = step
                state.grads.clear()
                state.last_update = state.undo = None
        self._forget_forwards(name)
        return lost

    def snapshot(self, name: str) -> dict[int, BlockState]:
        """Every block state this peer holds for the adapter (served and standby), for a checkpoint."""
        adapter = self.adapter(name)
        states = dict(zip(adapter.blocks, BlockState.of_all(list(adapter.blocks.values())), strict=True))
        return {**adapter.standby, **states}

    def lora_state(self, name: str) -> dict[int, dict[str, torch.Tensor]]:
        """LoRA tensors per block, named as inside a peft adapter file (``self_attn.q_proj.lora_A.weight``)."""
        adapter = self.adapter(name)
        return {
            block: {lp.name: lp.param.detach().cpu().clone() for lp in state.params}
            for block, state in adapter.blocks.items()
        }

    def digests(self, name: str) -> dict[int, str]:
        """Each served block's state digest (the replicas' vote), from one copy of the span's state to the host."""
        blocks = self.adapter(name).blocks
        return dict(zip(blocks, state_digests([(s.step, s.entries()) for s in blocks.values()]), strict=True))
