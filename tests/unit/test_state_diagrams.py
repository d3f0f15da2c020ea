"""The client's commit of a step (swarm/client/commit.py) is a state machine drawn in docs/ARCHITECTURE.md: the
diagram must list exactly the moves of the table the code checks every move against, and the code must refuse a move
the table does not list."""

from __future__ import annotations

import re
from enum import Enum
from pathlib import Path
from types import SimpleNamespace

import pytest

from swarm.client import commit
from swarm.client.commit import Stage, _Commit

ARCHITECTURE = Path(__file__).resolve().parents[2] / "docs" / "ARCHITECTURE.md"
EDGE = re.compile(r"^\s*(\[\*\]|\w+)\s*-->\s*(\[\*\]|\w+)\s*(?::.*)?$", re.M)


def _drawn(marker: str) -> set[tuple[str, str]]:
    """The edges of the one mermaid state diagram of ARCHITECTURE.md that names ``marker`` in a comment."""
    blocks = re.findall(r"```mermaid\n(.*?)```", ARCHITECTURE.read_text(), re.S)
    found = [block for block in blocks if f"%% {marker}" in block]
    assert len(found) == 1, f"ARCHITECTURE.md should draw one diagram marked '%% {marker}'"
    assert found[0].lstrip().startswith("stateDiagram-v2")
    return set(EDGE.findall(found[0]))


def _coded(transitions: dict[Enum, frozenset[Enum]], first: Enum) -> set[tuple[str, str]]:
    """The table's edges, with the start (``[*] --> first``) and an end from each state with no move out."""
    edges = {(a.name, b.name) for a, targets in transitions.items() for b in targets}
    edges.add(("[*]", first.name))
    edges |= {(a.name, "[*]") for a, targets in transitions.items() if not targets}
    return edges


@pytest.mark.parametrize(
    "marker, module, first",
    [
        ("swarm/client/commit.py TRANSITIONS", commit, commit.FIRST),
    ],
)
def test_the_diagram_draws_exactly_the_moves_the_code_checks(marker, module, first):
    assert set(module.TRANSITIONS) == set(type(first)), "every state has its row"
    assert _drawn(marker) == _coded(module.TRANSITIONS, first)


def _commit_of(num_blocks: int = 2) -> _Commit:
    calls = SimpleNamespace(router=SimpleNamespace(num_blocks=num_blocks), patience=1.0)
    return _Commit(SimpleNamespace(calls=calls), None, SimpleNamespace(step=3), None)


def test_every_stage_but_the_last_has_its_transition():
    assert set(_commit_of().transitions) == set(Stage) - {Stage.DONE}


def test_the_commit_refuses_a_move_its_table_does_not_list():
    run = _commit_of()
    run.transitions[Stage.REFRESHING] = lambda state: state.to(Stage.VOTING)
    with pytest.raises(RuntimeError, match="from REFRESHING to VOTING"):
        run.run()
