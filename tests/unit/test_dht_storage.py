"""A DHT node's records do not grow with rewrites (swarm/net/dhtstorage.py): the committed step, rewritten at every
step with a 30-day expiration, once left one heap entry per step on every node storing it."""

from __future__ import annotations

from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.utils import get_dht_time
from hivemind.utils.timed_storage import TimedStorage

from swarm.net.dhtstorage import SLACK, compact_on_store


def test_a_record_rewritten_thousands_of_times_keeps_a_small_heap_and_its_newest_value():
    compact_on_store()
    compact_on_store()  # twice changes nothing
    far = get_dht_time() + 30 * 24 * 3600
    storage = DHTLocalStorage()
    for step in range(5000):
        storage.store(b"committed", f"step {step}".encode(), far + step)
        storage.store(b"announcement", b"peer", get_dht_time() + 30)
    assert len(storage.expiration_heap) <= 2 * 2 + SLACK
    assert storage.get(b"committed").value == b"step 4999"
    subkeys = DictionaryDHTValue()  # a dictionary record (subkey = the writer) is a TimedStorage too
    for step in range(5000):
        subkeys.store(b"trainer", f"step {step}".encode(), far + step)
    assert len(subkeys.expiration_heap) <= 2 + SLACK and subkeys.get(b"trainer").value == b"step 4999"


def test_what_expires_still_expires_and_a_heap_of_live_entries_is_left_alone():
    compact_on_store()
    storage = TimedStorage()
    now = get_dht_time()
    storage.store("gone", 1, now + 0.05)
    for index in range(3 * SLACK):
        storage.store(f"live {index}", index, now + 3600)
    assert len(storage.expiration_heap) == 3 * SLACK + 1  # live entries only: nothing to compact
    while get_dht_time() < now + 0.1:
        pass
    assert storage.get("gone") is None and storage.get("live 0").value == 0
