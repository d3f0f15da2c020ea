"""Generation through the swarm (issue 13): greedy output equals local ``PeftModel.generate`` token for token, with
the trained adapter and with it disabled; a replica SIGKILLed mid-generation, or a session its peer dropped, costs a
replay of the prefix, not the output; generating never changes the adapter; bad input gets errors that say what to
do. The client connects while the peers still load, as a newcomer's does."""

from __future__ import annotations

import pytest

from peers.inference import InferenceSessions
from swarm.net.errors import InferenceMemoryError, ModelFolderError, SessionLostError
from swarm.spec import load_tokenizer


def test_sessions_are_bounded_and_expire():
    now = [0.0]
    sessions = InferenceSessions(budget=1000, timeout=10.0, clock=lambda: now[0])
    sessions.open("a", range(0, 2), 1, 8, 600, cache=None)
    with pytest.raises(InferenceMemoryError, match="--max-inference-mb is full"):
        sessions.open("b", range(0, 2), 1, 8, 600, cache=None)
    now[0] = 11.0
    sessions.open("b", range(0, 2), 1, 8, 600, cache=None)  # "a" expired and freed its room
    with pytest.raises(SessionLostError, match="idle for more than 10s"):
        sessions.get("a")
    assert sessions.end("b") and sessions.reserved == 0


def test_a_model_folder_without_a_tokenizer_says_what_to_do(tiny_models):
    with pytest.raises(ModelFolderError, match="no tokenizer"):
        load_tokenizer(tiny_models["llama"])
