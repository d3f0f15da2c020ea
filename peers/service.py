"""RPC handlers of a peer: decode a request, run it on the backend (one at a time), encode the reply."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator  # noqa: UP035 -- hivemind's servicer reads typing's alias to spot streams

import torch
from hivemind.p2p import P2PContext, ServicerBase
from hivemind.proto import runtime_pb2

from peers.backend import OptimizerHParams, RequestError, SpanBackend
from swarm.wire import DEFAULT_MAX_PAYLOAD_BYTES, Message, WireError, collect, decode, encode, error_message

logger = logging.getLogger(__name__)


class PeerService(ServicerBase):
    """The doors of a peer. Every request is validated; a refused request never stops the peer."""

    def __init__(
        self, backend: SpanBackend, info: Callable[[], dict], max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    ):
        self.backend = backend
        self.info = info
        self.max_payload_bytes = max_payload_bytes
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        self.handlers: dict[str, Callable[[Message], Message]] = {
            "info": self._info,
            "open": self._open,
            "forward": self._forward,
            "backward": self._backward,
            "commit": self._commit,
            "state": self._state,
            "digest": self._digest,
        }
        self.busy_seconds = 0.0

    async def rpc_call(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertRequest:
        if request.ByteSize() > self.max_payload_bytes:
            return encode(error_message("too_large", f"request exceeds the {self.max_payload_bytes}-byte limit"))[0]
        parts = encode(await self._handle([request], context))
        if len(parts) > 1:
            return encode(error_message("too_large", "reply too large for a unary call; use the stream door"))[0]
        return parts[0]

    async def rpc_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertRequest]:
        try:
            parts = await collect(requests, self.max_payload_bytes)
            reply = await self._handle(parts, context)
        except WireError as e:
            reply = error_message("bad_request", str(e))
        for part in encode(reply):
            yield part

    async def _handle(self, parts: list[runtime_pb2.ExpertRequest], context: P2PContext) -> Message:
        try:
            message = decode(parts)
            method = message.meta.get("method")
            handler = self.handlers.get(method) if isinstance(method, str) else None
            if handler is None:
                raise RequestError(f"unknown method {method!r}; known: {sorted(self.handlers)}")
            started = time.perf_counter()
            reply = await asyncio.get_running_loop().run_in_executor(self.executor, handler, message)
            self.busy_seconds += time.perf_counter() - started
            return reply
        except (RequestError, WireError) as e:
            logger.info("refused a request from %s: %s", context.remote_id, e)
            return error_message(getattr(e, "kind", "bad_request"), str(e))
        except Exception as e:
            logger.exception("request from %s failed", context.remote_id)
            return error_message("internal", f"{type(e).__name__}: {e}")

    def _info(self, message: Message) -> Message:
        return Message(meta=self.info(), tensors=[])

    def _open(self, message: Message) -> Message:
        meta = message.meta
        steps = self.backend.open_adapter(_str(meta, "adapter"), _dict(meta, "lora"), _int(meta, "seed"))
        return Message(meta={"steps": _by_block(steps)}, tensors=[])

    def _forward(self, message: Message) -> Message:
        meta = message.meta
        hidden, mask = _hidden_and_mask(message, extra=0)
        cache_key = (_int(meta, "step"), _str(meta, "micro_batch")) if meta.get("train") else None
        outputs = self.backend.forward(_str(meta, "adapter"), _blocks(meta), hidden, mask, cache_key)
        return Message(meta={}, tensors=[outputs])

    def _backward(self, message: Message) -> Message:
        meta = message.meta
        hidden, mask = _hidden_and_mask(message, extra=1)
        grad_inputs = self.backend.backward(
            _str(meta, "adapter"),
            _blocks(meta),
            _int(meta, "step"),
            _str(meta, "micro_batch"),
            hidden,
            mask,
            message.tensors[1],
        )
        return Message(meta={}, tensors=[grad_inputs])

    def _commit(self, message: Message) -> Message:
        meta = message.meta
        ledger = _ledger(meta)
        hp = _dict(meta, "hparams")
        try:
            hparams = OptimizerHParams(
                lr=float(hp["lr"]),
                betas=(float(hp["betas"][0]), float(hp["betas"][1])),
                eps=float(hp["eps"]),
                weight_decay=float(hp["weight_decay"]),
            )
        except (KeyError, TypeError, ValueError, IndexError):
            raise RequestError("commit 'hparams' needs lr, betas (two numbers), eps and weight_decay") from None
        steps = self.backend.commit(_str(meta, "adapter"), _int(meta, "step"), ledger, hparams)
        return Message(meta={"steps": _by_block(steps)}, tensors=[])

    def _state(self, message: Message) -> Message:
        state = self.backend.lora_state(_str(message.meta, "adapter"))
        names = [[block, name] for block, tensors in state.items() for name in tensors]
        return Message(meta={"names": names}, tensors=[state[block][name] for block, name in names])

    def _digest(self, message: Message) -> Message:
        return Message(meta={"digests": _by_block(self.backend.digests(_str(message.meta, "adapter")))}, tensors=[])


def _by_block(values: dict[int, object]) -> dict[str, object]:
    return {str(block): value for block, value in values.items()}


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


def _blocks(meta: dict) -> range:
    return range(_int(meta, "start"), _int(meta, "end"))


def _ledger(meta: dict) -> dict[int, list[str]]:
    """The commit ledger: block -> ids of the micro-batches whose backward passed through it."""
    raw = meta.get("ledger")
    try:
        ledger = {int(block): list(mbs) for block, mbs in raw.items()}
    except (AttributeError, TypeError, ValueError):
        raise RequestError("commit needs 'ledger': a map from block to a list of micro-batch ids") from None
    if not ledger or not all(isinstance(mb, str) for mbs in ledger.values() for mb in mbs):
        raise RequestError("commit 'ledger' must name at least one block, with string micro-batch ids")
    return ledger


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
