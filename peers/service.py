"""RPC handlers of a peer: decode a request, validate it, run it on the backend (one at a time), encode the reply."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from hivemind.p2p import PeerID

from peers.backend import (
    BlockState,
    GradsByBlock,
    MissingGradientsError,
    OptimizerHParams,
    SpanBackend,
    pack_states,
    unpack_states,
)
from peers.doors import Doorkeeper, RequestError
from swarm.blocks import lora_config_from_wire
from swarm.security import SwarmKey
from swarm.transport import Transport
from swarm.wire import DEFAULT_MAX_PAYLOAD_BYTES, Message

logger = logging.getLogger(__name__)

FETCH_TIMEOUT = 3.0
SYNC_TIMEOUT = 60.0


class PeerService(Doorkeeper):
    """The doors of a peer. Every request is validated; a refused request never stops the peer."""

    def __init__(
        self,
        backend: SpanBackend,
        info: Callable[[], dict],
        transport: Transport,
        swarm_key: SwarmKey | None = None,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    ):
        super().__init__(swarm_key, max_payload_bytes)
        self.backend, self.info, self.transport = backend, info, transport
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        self.handlers.update(
            info=self._info,
            open=self._open,
            forward=self._forward,
            backward=self._backward,
            gather=self._gather,
            apply=self._apply,
            grads=self._grads,
            export=self._export,
            sync=self._sync,
            state=self._state,
            digest=self._digest,
            fast_forward=self._fast_forward,
            committed=self._committed,
            replicate=self._replicate,
        )
        self.after_commit: Callable[[str], Awaitable[None]] | None = None
        self.on_committed: Callable[[str, dict, dict[int, int], PeerID], Awaitable[None]] | None = None
        self.on_replicate: Callable[[str, dict, int, list[tuple[range, PeerID]]], Awaitable[dict[int, int]]] | None = (
            None
        )
        self._background: set[asyncio.Task] = set()

    async def compute(self, fn: Callable, *args):
        """Run backend work on the single compute thread, so requests never interleave on the blocks."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def _info(self, message: Message) -> Message:
        return Message(meta=self.info(), tensors=[])

    async def _open(self, message: Message) -> Message:
        meta = message.meta
        session = meta.get("session")
        if session is not None and not isinstance(session, str):
            raise RequestError("'session' must be a string")
        name, lora, seed = _str(meta, "adapter"), _dict(meta, "lora"), _int(meta, "seed")

        def open_adapter() -> tuple[dict[int, int], dict[int, int]]:
            return self.backend.open_adapter(name, lora, seed, session), self.backend.adapter(name).standby_steps()

        steps, standby = await self.compute(open_adapter)
        return Message(meta={"steps": _by_block(steps), "standby": _by_block(standby)}, tensors=[])

    async def _forward(self, message: Message) -> Message:
        meta = message.meta
        hidden, mask = _hidden_and_mask(message, extra=0)
        micro_batch = _str(meta, "micro_batch") if meta.get("micro_batch") is not None else None
        outputs = await self.compute(
            self.backend.forward, _str(meta, "adapter"), _blocks(meta), _int(meta, "step"), hidden, mask, micro_batch
        )
        return Message(meta={}, tensors=[outputs])

    async def _backward(self, message: Message) -> Message:
        meta = message.meta
        hidden, mask = _hidden_and_mask(message, extra=1)
        grad_inputs = await self.compute(
            self.backend.backward,
            _str(meta, "adapter"),
            _blocks(meta),
            _int(meta, "step"),
            _str(meta, "micro_batch"),
            hidden,
            mask,
            message.tensors[1],
        )
        return Message(meta={}, tensors=[grad_inputs])

    async def _gather(self, message: Message) -> Message:
        """Commit phase 1: fetch the micro-batch gradients this peer lacks from replicas; report any still missing."""
        meta = message.meta
        name, step, holders = _str(meta, "adapter"), _int(meta, "step"), _holders(meta)
        ledger = {block: sorted(by_mb) for block, by_mb in holders.items()}
        missing = await self.compute(self.backend.missing, name, step, ledger)
        wanted_from: dict[str, dict[int, list[str]]] = {}
        for block, mbs in missing.items():
            for mb in mbs:
                wanted_from.setdefault(holders[block][mb], {}).setdefault(block, []).append(mb)
        timeout = meta.get("fetch_timeout", FETCH_TIMEOUT)
        if not isinstance(timeout, (int, float)) or not 0 < timeout <= 600:
            raise RequestError("'fetch_timeout' must be a number of seconds in (0, 600]")
        fetched = await asyncio.gather(
            *(self._fetch(peer, name, step, wanted, timeout) for peer, wanted in wanted_from.items())
        )
        for grads in fetched:
            await self.compute(self.backend.add_grads, name, step, grads)
        still = await self.compute(self.backend.missing, name, step, ledger)
        if still:
            raise MissingGradientsError(f"gradients for {still} at step {step} could not be fetched", still)
        return Message(meta={"steps": _by_block(self.backend.adapter(name).steps())}, tensors=[])

    async def _fetch(
        self, peer: str, name: str, step: int, wanted: dict[int, list[str]], timeout: float
    ) -> GradsByBlock:
        """Ask a replica for gradients; a dead or silent replica just yields nothing (the client replays)."""
        meta = {"method": "grads", "adapter": name, "step": step, "wanted": _by_block(wanted)}
        try:
            reply = await self.transport.acall(PeerID.from_base58(peer), Message(meta, []), timeout=timeout)
        except Exception as e:
            logger.warning("could not fetch gradients from %s: %s", peer, e)
            return {}
        grads: GradsByBlock = {}
        tensors = iter(reply.tensors)
        for block, mb, count in reply.meta.get("index", []):
            grads.setdefault(int(block), {})[str(mb)] = [next(tensors) for _ in range(int(count))]
        return grads

    async def _grads(self, message: Message) -> Message:
        meta = message.meta
        wanted = {int(block): [str(mb) for mb in mbs] for block, mbs in _dict(meta, "wanted").items()}
        grads = await self.compute(self.backend.micro_batch_grads, _str(meta, "adapter"), _int(meta, "step"), wanted)
        index, tensors = [], []
        for block, by_mb in grads.items():
            for mb, block_grads in by_mb.items():
                index.append([block, mb, len(block_grads)])
                tensors.extend(block_grads)
        return Message(meta={"index": index}, tensors=tensors)

    async def _apply(self, message: Message) -> Message:
        """Commit phase 2: one AdamW update from the ledger's gradients, identical on every replica."""
        meta = message.meta
        ledger = {block: sorted(by_mb) for block, by_mb in _holders(meta).items()}
        name = _str(meta, "adapter")
        steps = await self.compute(self.backend.apply, name, _int(meta, "step"), ledger, _hparams(meta))
        if self.after_commit is not None:
            self.in_background(self.after_commit(name))  # queued on the compute thread before any next request
        return Message(meta={"steps": _by_block(steps)}, tensors=[])

    async def _export(self, message: Message) -> Message:
        states = await self.compute(self.backend.export_state, _str(message.meta, "adapter"), _blocks(message.meta))
        index, flat = pack_states(states)
        return Message(meta={"index": index}, tensors=[flat])

    async def _sync(self, message: Message) -> Message:
        """Pull the adapter state of some blocks from a current replica, so this peer can serve them again."""
        meta = message.meta
        name, blocks = _str(meta, "adapter"), _blocks(meta)
        source = _peer(meta, "source")
        states = await fetch_state(self.transport, source, name, blocks)
        steps = await self.compute(self.backend.import_state, name, states)
        logger.info("synced adapter %r blocks %s from %s: steps %s", name, sorted(states), source, steps)
        return Message(meta={"steps": _by_block(steps)}, tensors=[])

    async def _fast_forward(self, message: Message) -> Message:
        """No current copy of these blocks survived anywhere: the trainer declares the newest one current."""
        meta = message.meta
        name = _str(meta, "adapter")
        lost = await self.compute(self.backend.fast_forward, name, _blocks(meta), _int(meta, "step"))
        steps = self.backend.adapter(name).steps()
        return Message(meta={"steps": _by_block(steps), "lost": _by_block(lost)}, tensors=[])

    async def _committed(self, message: Message) -> Message:
        """A server of blocks this peer keeps on standby committed a step: pull the new state, in the background."""
        meta = message.meta
        if self.on_committed is not None:
            meta_adapter = {"lora": _dict(meta, "lora"), "seed": _int(meta, "seed")}
            try:
                steps = {int(block): int(step) for block, step in _dict(meta, "steps").items()}
            except (TypeError, ValueError):
                raise RequestError("'steps' must map block -> step") from None
            notice = self.on_committed(_str(meta, "adapter"), meta_adapter, steps, _peer(meta, "source"))
            self.in_background(notice)
        return Message(meta={}, tensors=[])

    async def _replicate(self, message: Message) -> Message:
        """The trainer asks this peer to hold a copy of some blocks' state at ``step`` (pulled from the named
        sources) before it acknowledges the step: what makes a committed step survive the loss of any one peer."""
        meta = message.meta
        if self.on_replicate is None:
            raise RequestError("this peer keeps no standby copies")
        adapter_meta = {"lora": _dict(meta, "lora"), "seed": _int(meta, "seed")}
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
        held = await self.on_replicate(_str(meta, "adapter"), adapter_meta, _int(meta, "step"), sources)
        return Message(meta={"steps": _by_block(held)}, tensors=[])

    def in_background(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _state(self, message: Message) -> Message:
        state = await self.compute(self.backend.lora_state, _str(message.meta, "adapter"))
        names = [[block, name] for block, tensors in state.items() for name in tensors]
        return Message(meta={"names": names}, tensors=[state[block][name] for block, name in names])

    async def _digest(self, message: Message) -> Message:
        digests = await self.compute(self.backend.digests, _str(message.meta, "adapter"))
        return Message(meta={"digests": _by_block(digests)}, tensors=[])


async def fetch_state(transport: Transport, peer: PeerID, name: str, blocks: range) -> dict[int, BlockState]:
    """The state of ``blocks`` (served or standby) as another peer holds it."""
    export = {"method": "export", "adapter": name, "start": blocks.start, "end": blocks.stop}
    reply = await transport.acall(peer, Message(export, []), timeout=SYNC_TIMEOUT)
    try:
        return unpack_states(reply.meta["index"], reply.tensors[0])
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
        raise RequestError(f"malformed state export from {peer}: {e}") from None


def _by_block(values: dict[int, object]) -> dict[str, object]:
    return {str(block): value for block, value in values.items()}


def _blocks(meta: dict) -> range:
    return range(_int(meta, "start"), _int(meta, "end"))


def _holders(meta: dict) -> dict[int, dict[str, str]]:
    """The commit ledger: block -> {micro-batch id: peer that holds its gradients}."""
    raw = meta.get("ledger")
    try:
        ledger = {int(block): {str(mb): str(peer) for mb, peer in by_mb.items()} for block, by_mb in raw.items()}
    except (AttributeError, TypeError, ValueError):
        raise RequestError("'ledger' must map block -> {micro-batch id: peer id}") from None
    if not ledger:
        raise RequestError("'ledger' must name at least one block")
    return ledger


def _hparams(meta: dict) -> OptimizerHParams:
    hp = _dict(meta, "hparams")
    try:
        return OptimizerHParams(
            lr=float(hp["lr"]),
            betas=(float(hp["betas"][0]), float(hp["betas"][1])),
            eps=float(hp["eps"]),
            weight_decay=float(hp["weight_decay"]),
        )
    except (KeyError, TypeError, ValueError, IndexError):
        raise RequestError("'hparams' needs lr, betas (two numbers), eps and weight_decay") from None


def _hidden_and_mask(message: Message, extra: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Tensors are [hidden, *extra, mask?]; the mask is present when meta says so."""
    has_mask = bool(message.meta.get("has_mask"))
    expected = 1 + extra + int(has_mask)
    if len(message.tensors) != expected:
        raise RequestError(f"expected {expected} tensors, got {len(message.tensors)}")
    mask = message.tensors[-1] if has_mask else None
    if mask is not None and (mask.is_floating_point() or mask.is_complex()):
        raise RequestError(f"attention_mask must be integer or bool, got {mask.dtype}")
    return message.tensors[0], mask


def _peer(meta: dict, key: str) -> PeerID:
    try:
        return PeerID.from_base58(_str(meta, key))
    except ValueError:
        raise RequestError(f"{key!r} must be a base58 peer id") from None


def _str(meta: dict, key: str) -> str:
    value = meta.get(key)
    if not isinstance(value, str) or not value:
        raise RequestError(f"{key!r} must be a non-empty string")
    return value


def _int(meta: dict, key: str) -> int:
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise RequestError(f"{key!r} must be a non-negative integer")
    return value


def _dict(meta: dict, key: str) -> dict:
    value = meta.get(key)
    if not isinstance(value, dict):
        raise RequestError(f"{key!r} must be a map")
    return value
