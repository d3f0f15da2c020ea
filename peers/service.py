"""RPC handlers of a peer: decode a request, validate it, run it on the backend (one at a time), encode the reply."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch
from hivemind.p2p import PeerID

from peers.backend import SpanBackend
from peers.compute import Compute
from peers.state import BlockState, BlockUpdate, GradsByBlock, pack_states, unpack_states
from swarm.blocks import lora_config_from_wire
from swarm.net.compression import COMPRESSIONS
from swarm.net.errors import PEER_ERRORS, RequestError, SourceUnavailableError
from swarm.net.protocol import (
    SYNC_TIMEOUT,
    CommitRequest,
    InferRequest,
    Method,
    OpenReply,
    OpenRequest,
    OptimizerHParams,
    SpanRequest,
    by_block,
    read_dict,
    read_int,
    read_peer,
    read_session,
    read_steps,
    read_str,
)
from swarm.net.security import SwarmKey
from swarm.net.servicer import Doorkeeper, FaultHook
from swarm.net.transport import Transport
from swarm.net.wire import DEFAULT_MAX_PAYLOAD_BYTES, Message

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeerHooks:
    """What the daemon does around requests, given to the service when it is made: checkpoint after a commit (and
    tell standby holders) or a revert (so that the checkpoint is not left ahead), pull a standby copy when its
    server commits, hold the copies a trainer asks for."""

    after_commit: Callable[[str], Awaitable[None]]
    after_revert: Callable[[str], Awaitable[None]]
    on_committed: Callable[[str, dict, dict[int, int], PeerID], Awaitable[None]]
    on_replicate: Callable[[str, dict, int, list[tuple[range, PeerID]]], Awaitable[dict[int, int]]]


class PeerService(Doorkeeper):
    """The doors of a peer. Every request is validated; a refused request never stops the peer."""

    def __init__(
        self,
        backend: SpanBackend,
        compute: Compute,
        info: Callable[[], dict],
        transport: Transport,
        hooks: PeerHooks,
        swarm_key: SwarmKey | None = None,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        faults: FaultHook | None = None,
    ):
        super().__init__(swarm_key, max_payload_bytes, faults=faults)
        self.backend, self.info, self.transport = backend, info, transport
        self.compute, self.hooks = compute, hooks
        self.handlers.update(
            {
                Method.INFO: self._info,
                Method.OPEN: self._open,
                Method.FORWARD: self._forward,
                Method.BACKWARD: self._backward,
                Method.COMMIT: self._commit,
                Method.REVERT: self._revert,
                Method.GRADS: self._grads,
                Method.EXPORT: self._export,
                Method.SYNC: self._sync,
                Method.STATE: self._state,
                Method.DIGEST: self._digest,
                Method.FAST_FORWARD: self._fast_forward,
                Method.COMMITTED: self._committed,
                Method.REPLICATE: self._replicate,
                Method.INFER: self._infer,
                Method.END_SESSION: self._end_session,
            }
        )
        self._background: set[asyncio.Task] = set()

    async def _info(self, message: Message) -> Message:
        return Message(meta=self.info(), tensors=[])

    async def _open(self, message: Message) -> Message:
        request = OpenRequest.from_meta(message.meta)

        def open_adapter() -> OpenReply:
            steps = self.backend.open_adapter(request.adapter, request.lora, request.seed, request.session)
            return OpenReply(steps, self.backend.adapter(request.adapter).standby_steps())

        return Message(meta=(await self.compute(open_adapter)).to_meta(), tensors=[])

    async def _forward(self, message: Message) -> Message:
        request = SpanRequest.from_meta(message.meta)
        hidden, mask = _hidden_and_mask(message, extra=0)
        outputs = await self.compute(
            self.backend.forward, request.adapter, request.blocks, request.step, hidden, mask, request.micro_batch
        )
        return Message(meta={}, tensors=[outputs], compression=COMPRESSIONS[request.compression])

    async def _backward(self, message: Message) -> Message:
        request = SpanRequest.from_meta(message.meta)
        if request.has_hidden:
            hidden, mask = _hidden_and_mask(message, extra=1)
            grad = message.tensors[1]
        else:
            (grad, mask), hidden = _hidden_and_mask(message, extra=0), None
        grad_inputs = await self.compute(
            self.backend.backward,
            request.adapter,
            request.blocks,
            request.step,
            request.micro_batch,
            hidden,
            mask,
            grad,
            request.input_grad,
        )
        tensors = [] if grad_inputs is None else [grad_inputs]
        return Message(meta={}, tensors=tensors, compression=COMPRESSIONS[request.compression])

    async def _infer(self, message: Message) -> Message:
        request = InferRequest.from_meta(message.meta)
        hidden, mask = _hidden_and_mask(message, extra=0)
        outputs = await self.compute(self.backend.infer, request, hidden, mask)
        return Message(meta={}, tensors=[outputs], compression=COMPRESSIONS[request.compression])

    async def _end_session(self, message: Message) -> Message:
        session = read_session(message.meta)
        return Message(meta={"ended": await self.compute(self.backend.sessions.end, session)}, tensors=[])

    async def _commit(self, message: Message) -> Message:
        """Commit a step in one call: fetch the micro-batch gradients this peer lacks from the replicas holding them
        (peer to peer, all at once), then one AdamW update from the ledger's gradients, identical on every replica.
        Gradients nobody could provide are reported (``missing_gradients``) and nothing is applied: the client
        replays them and asks again. Idempotent: blocks already past the step are left alone."""
        request = CommitRequest.from_meta(message.meta)
        name, step, ledger = request.adapter, request.step, request.micro_batches()
        missing = await self.compute(self.backend.missing, name, step, ledger)
        wanted_from: dict[str, dict[int, list[str]]] = {}
        for block, mbs in missing.items():
            for mb in mbs:
                wanted_from.setdefault(request.ledger[block][mb], {}).setdefault(block, []).append(mb)
        fetched = await asyncio.gather(
            *(self._fetch(peer, name, step, wanted, request.fetch_timeout) for peer, wanted in wanted_from.items())
        )
        for grads in fetched:
            await self.compute(self.backend.add_grads, name, step, grads)
        steps = await self.compute(self.backend.apply, name, step, ledger, request.hparams)
        self.in_background(self.hooks.after_commit(name))  # queued on the compute thread before the next
        return Message(meta={"steps": by_block(steps)}, tensors=[])

    async def _revert(self, message: Message) -> Message:
        meta = message.meta
        name = read_str(meta, "adapter")
        steps = await self.compute(self.backend.revert, name, read_int(meta, "step"))
        self.in_background(self.hooks.after_revert(name))
        return Message(meta={"steps": by_block(steps)}, tensors=[])

    async def _fetch(
        self, peer: str, name: str, step: int, wanted: dict[int, list[str]], timeout: float
    ) -> GradsByBlock:
        """Ask a replica for gradients; a dead or silent replica just yields nothing (the client replays)."""
        meta = {"method": Method.GRADS, "adapter": name, "step": step, "wanted": by_block(wanted)}
        try:
            reply = await self.transport.acall(PeerID.from_base58(peer), Message(meta, []), timeout=timeout)
        except PEER_ERRORS as e:
            logger.warning("could not fetch gradients from %s: %s", peer, e)
            return {}
        grads: GradsByBlock = {}
        tensors = iter(reply.tensors)
        for block, mb, count in reply.meta.get("index", []):
            grads.setdefault(int(block), {})[str(mb)] = [next(tensors) for _ in range(int(count))]
        return grads

    async def _grads(self, message: Message) -> Message:
        meta = message.meta
        wanted = {int(block): [str(mb) for mb in mbs] for block, mbs in read_dict(meta, "wanted").items()}
        grads = await self.compute(
            self.backend.micro_batch_grads, read_str(meta, "adapter"), read_int(meta, "step"), wanted
        )
        index, tensors = [], []
        for block, by_mb in grads.items():
            for mb, block_grads in by_mb.items():
                index.append([block, mb, len(block_grads)])
                tensors.extend(block_grads)
        return Message(meta={"index": index}, tensors=tensors)

    async def _export(self, message: Message) -> Message:
        """State of blocks; with ``held`` (block -> the step of the asker's copy), the last update of served blocks
        held one step behind instead of their whole state."""
        meta = message.meta
        held = read_steps(meta, "held") if meta.get("held") is not None else None
        states, updates = await self.compute(self.backend.export_state, read_str(meta, "adapter"), _blocks(meta), held)
        index, flat = pack_states(states)
        update_index, update_flat = pack_states({block: u.as_state() for block, u in updates.items()})
        hparams = {str(block): u.hparams.to_meta() for block, u in updates.items()}
        reply = {"index": index, "update_index": update_index, "hparams": hparams}
        return Message(meta=reply, tensors=[flat, update_flat])

    async def _sync(self, message: Message) -> Message:
        """Pull the adapter state of some blocks from a current replica, so this peer can serve them again."""
        meta = message.meta
        name, blocks = read_str(meta, "adapter"), _blocks(meta)
        source = read_peer(meta, "source")
        try:
            states = await fetch_state(self.transport, source, name, blocks)
        except (*PEER_ERRORS, RequestError) as e:  # the source's failure (or bad reply): the client picks another
            raise SourceUnavailableError(
                f"could not pull blocks {blocks.start}:{blocks.stop} from {source}: {e}", source.to_base58()
            ) from None
        steps = await self.compute(self.backend.import_state, name, states)
        logger.info("synced adapter %r blocks %s from %s: steps %s", name, sorted(states), source, steps)
        return Message(meta={"steps": by_block(steps)}, tensors=[])

    async def _fast_forward(self, message: Message) -> Message:
        """No current copy of these blocks survived anywhere: the trainer declares the newest one current."""
        meta = message.meta
        name = read_str(meta, "adapter")
        lost = await self.compute(self.backend.fast_forward, name, _blocks(meta), read_int(meta, "step"))
        steps = self.backend.adapter(name).steps()
        return Message(meta={"steps": by_block(steps), "lost": by_block(lost)}, tensors=[])

    async def _committed(self, message: Message) -> Message:
        """A server of blocks this peer keeps on standby committed a step: pull the new state, in the background."""
        meta = message.meta
        meta_adapter = {"lora": read_dict(meta, "lora"), "seed": read_int(meta, "seed")}
        try:
            steps = {int(block): int(step) for block, step in read_dict(meta, "steps").items()}
        except (TypeError, ValueError):
            raise RequestError("'steps' must map block -> step") from None
        notice = self.hooks.on_committed(read_str(meta, "adapter"), meta_adapter, steps, read_peer(meta, "source"))
        self.in_background(notice)
        return Message(meta={}, tensors=[])

    async def _replicate(self, message: Message) -> Message:
        """The trainer asks this peer to hold a copy of some blocks' state at ``step`` (pulled from the named
        sources) before it acknowledges the step: what makes a committed step survive the loss of any one peer."""
        meta = message.meta
        adapter_meta = {"lora": read_dict(meta, "lora"), "seed": read_int(meta, "seed")}
        try:
            lora_config_from_wire(adapter_meta["lora"])
        except (ValueError, TypeError) as e:
            raise RequestError(f"'lora' is not a LoRA config this swarm can train: {e}") from None
        raw = meta.get("sources")
        try:
            sources = [(range(int(start), int(end)), PeerID.from_base58(str(peer))) for start, end, peer in raw]
        except (TypeError, ValueError):
            raise RequestError("'sources' must be a list of [start, end, peer id]") from None
        num_blocks = self.backend.spec.num_blocks
        if not sources or any(not 0 <= blocks.start < blocks.stop <= num_blocks for blocks, _ in sources):
            raise RequestError(f"'sources' must name non-empty block ranges within the model's 0:{num_blocks}")
        held = await self.hooks.on_replicate(read_str(meta, "adapter"), adapter_meta, read_int(meta, "step"), sources)
        return Message(meta={"steps": by_block(held)}, tensors=[])

    def in_background(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _state(self, message: Message) -> Message:
        state = await self.compute(self.backend.lora_state, read_str(message.meta, "adapter"))
        names = [[block, name] for block, tensors in state.items() for name in tensors]
        return Message(meta={"names": names}, tensors=[state[block][name] for block, name in names])

    async def _digest(self, message: Message) -> Message:
        digests = await self.compute(self.backend.digests, read_str(message.meta, "adapter"))
        return Message(meta={"digests": by_block(digests)}, tensors=[])


async def fetch_state(transport: Transport, peer: PeerID, name: str, blocks: range) -> dict[int, BlockState]:
    """The state of ``blocks`` (served or standby) as another peer holds it."""
    states, _ = await fetch_state_or_updates(transport, peer, name, blocks, held=None)
    return states


async def fetch_state_or_updates(
    transport: Transport, peer: PeerID, name: str, blocks: range, held: dict[int, int] | None
) -> tuple[dict[int, BlockState], dict[int, BlockUpdate]]:
    """The state of ``blocks`` as another peer holds it, or, for blocks this peer ``held`` one step behind a server,
    that server's last update (to apply with ``BlockUpdate.apply_to``)."""
    export = {"method": Method.EXPORT, "adapter": name, "start": blocks.start, "end": blocks.stop}
    if held is not None:
        export["held"] = by_block(held)
    reply = await transport.acall(peer, Message(export, []), timeout=SYNC_TIMEOUT)
    try:
        states = unpack_states(reply.meta["index"], reply.tensors[0])
        if len(reply.tensors) < 2:
            return states, {}
        packed = unpack_states(reply.meta["update_index"], reply.tensors[1])
        hparams = reply.meta["hparams"]
        updates = {b: BlockUpdate.from_state(u, OptimizerHParams.from_meta(hparams[str(b)])) for b, u in packed.items()}
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
        raise RequestError(f"malformed state export from {peer}: {e}") from None
    return states, updates


def _blocks(meta: dict) -> range:
    return range(read_int(meta, "start"), read_int(meta, "end"))


def _hidden_and_mask(message: Message, extra: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Tensors are [hidden (or the output gradient), *extra, mask?]; the mask is present when meta says so."""
    has_mask = bool(message.meta.get("has_mask"))
    expected = 1 + extra + int(has_mask)
    if len(message.tensors) != expected:
        raise RequestError(f"expected {expected} tensors, got {len(message.tensors)}")
    mask = message.tensors[-1] if has_mask else None
    if mask is not None and (mask.is_floating_point() or mask.is_complex()):
        raise RequestError(f"attention_mask must be integer or bool, got {mask.dtype}")
    return message.tensors[0], mask
