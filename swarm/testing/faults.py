"""Failures injected at chosen calls, in torchft's manner, through hooks the code takes at construction: nothing is
patched. A peer is built with a ``FaultInjector`` (``PeerDaemon(config, faults=...)``), a test arms ``Fault``s on it,
and at the chosen call of a method the peer dies, loses the reply, freezes in the handler, or the handler has a bug:
the peer's own doors run every handler through the injector (``swarm.net.servicer.FaultHook``), so what fails is the
real code path a real failure takes. A client is built with a ``CallTap`` (``from_pretrained(call_hook=...)``), on
which a test arms hooks that see each request before it goes (to record it, or kill its peer at that moment). Peers
that lie are built with a behaviour (``swarm.testing.dishonest``), slow disks and scripted moves with a
``peers.daemon.PlanHook``."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from hivemind.p2p import PeerID

from swarm.client.calls import CallHook, Send
from swarm.net.servicer import DroppedReply, MessageHandler
from swarm.net.wire import Message

logger = logging.getLogger(__name__)


class Action(str, Enum):
    KILL = "kill"  # the peer dies like a crashed machine: its connections drop, the request dies with it
    DROP = "drop"  # the handler runs (its effect stays), the reply is lost: the caller sees a broken call
    FREEZE = "freeze"  # the handler waits until released (or ``freeze_for`` seconds), then runs, late
    BUG = "bug"  # the handler raises TypeError, as a bug in the peer's own code would


@dataclass
class Fault:
    """One failure, at the ``nth`` call of ``method`` whose request meta ``when`` accepts (every call by default).
    Armed on several peers' injectors, it counts their calls together (the nth ``export`` anywhere in the swarm).
    ``after`` (a kill only): the handler runs first, and the peer dies before it replies."""

    action: Action
    method: str
    nth: int = 1
    when: Callable[[dict], bool] = lambda meta: True
    after: bool = False
    freeze_for: float = 30.0
    seen: int = 0
    fired: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if self.after and self.action is not Action.KILL:
            raise ValueError("after= is for kills: a dropped reply always follows its handler, a freeze precedes it")
        if self.nth < 1:
            raise ValueError(f"nth counts from 1, got {self.nth}")

    def due(self, method: str, meta: dict) -> bool:
        """Whether this call is the one (each fault fires once; peers call this from their own threads)."""
        if method != self.method or not self.when(meta):
            return False
        with self._lock:
            self.seen += 1
            if self.seen != self.nth:
                return False
        self.fired.set()
        return True

    def release(self) -> None:
        """Let a frozen handler go on."""
        self.released.set()

    def wait_fired(self, timeout: float) -> bool:
        return self.fired.wait(timeout)


class FaultInjector:
    """One peer's armed faults, and how many calls of each method it handled. ``kill`` makes the peer die."""

    def __init__(self, kill: Callable[[], None]):
        self.kill = kill
        self.armed: list[Fault] = []
        self.calls: Counter[str] = Counter()
        self._lock = threading.Lock()

    def arm(self, fault: Fault) -> Fault:
        with self._lock:
            self.armed.append(fault)
        return fault

    def release(self) -> None:
        """Let every frozen handler go on (before the peer stops: a leave waits for in-flight work)."""
        with self._lock:
            for fault in self.armed:
                fault.release()

    async def around(self, method: str, handler: MessageHandler, message: Message) -> Message:
        with self._lock:
            self.calls[method] += 1
            armed = list(self.armed)
        fault = next((f for f in armed if f.due(method, message.meta)), None)
        if fault is None:
            return await handler(message)
        logger.warning("injecting a fault: %s at %s call %d", fault.action.value, method, fault.nth)
        if fault.action is Action.FREEZE:
            await asyncio.to_thread(fault.released.wait, fault.freeze_for)
            return await handler(message)
        if fault.action is Action.BUG:
            raise TypeError(f"an injected bug in this peer's {method} handler")
        if fault.action is Action.DROP or fault.after:
            await handler(message)
        if fault.action is Action.KILL:
            self.kill()
        raise DroppedReply(f"{method}: the reply was lost to an injected {fault.action.value}")


class CallTap:
    """A client's call hook (``from_pretrained(call_hook=tap)``) that a test arms as it goes, as it arms faults on a
    peer: each hook armed sees every request sent from then on (the latest armed first), until it is disarmed."""

    def __init__(self) -> None:
        self._hooks: tuple[CallHook, ...] = ()
        self._lock = threading.Lock()

    def arm(self, hook: CallHook) -> CallHook:
        with self._lock:
            self._hooks = (*self._hooks, hook)
        return hook

    def disarm(self, hook: CallHook) -> None:
        with self._lock:
            self._hooks = tuple(h for h in self._hooks if h is not hook)

    def __call__(self, peer: PeerID, message: Message, send: Send) -> Message:
        for hook in self._hooks:  # each wraps those armed before it
            send = _through(hook, peer, send)
        return send(message)


def _through(hook: CallHook, peer: PeerID, send: Send) -> Send:
    return lambda message: hook(peer, message, send)
