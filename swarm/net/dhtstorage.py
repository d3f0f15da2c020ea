"""Records a DHT node keeps, without a heap that grows with every rewrite.

hivemind's ``TimedStorage`` (a node's records, and the subkeys of each dictionary record) pushes an entry on its
expiration heap at every store and drops a superseded entry only when it reaches the heap's root, that is when it
expires. A record rewritten every step with a far expiration (the trainer's committed step lives 30 days) so left one
entry per step on every node storing it: each DHT process grew by about 1 MB per 1000 steps, for as long as it ran.
``compact_on_store`` makes a store rebuild the heap from the live entries once it holds more than twice as many
(amortized constant time per store); what expires when is unchanged."""

from __future__ import annotations

import heapq

from hivemind.utils.timed_storage import TimedStorage

SLACK = 64  # superseded entries a heap may hold beyond its live ones before it is rebuilt


def compact(storage: TimedStorage) -> None:
    """Drop the heap entries no key points to any more (the superseded ones), if there are many."""
    if len(storage.expiration_heap) > 2 * len(storage.key_to_heap) + SLACK:
        storage.expiration_heap = list(storage.key_to_heap.values())
        heapq.heapify(storage.expiration_heap)


def compact_on_store() -> None:
    """Every ``TimedStorage`` of this process (and of DHT processes forked from it later) compacts after a store."""
    if getattr(TimedStorage.store, "compacts", False):
        return
    store = TimedStorage.store

    def store_then_compact(self: TimedStorage, key, value, expiration_time) -> bool:
        stored = store(self, key, value, expiration_time)
        compact(self)
        return stored

    store_then_compact.compacts = True
    TimedStorage.store = store_then_compact
