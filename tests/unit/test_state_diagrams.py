"""The two state machines of a step, the client's commit (swarm/client/commit.py) and a peer's side of it
(peers/stepphase.py), are drawn in docs/ARCHITECTURE.md: each diagram must list exactly the moves of the table the
code checks every move against, and each table must refuse a move it does not list."""

from __future__ import annotations

import re
from enum import Enum
from pathlib import Path
from types import SimpleNamespace

import pytest

from peers import stepphase
from peers.stepphase import StepMark, StepPhase, StepPhaseError, StepPhases
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
        ("peers/stepphase.py TRANSITIONS", stepphase, stepphase.FIRST),
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


def test_a_peer_refuses_a_move_its_table_does_not_list():
    with pytest.raises(StepPhaseError, match="from HELD to APPLIED"):
        StepMark(4).to(StepPhase.APPLIED)


def test_a_block_goes_through_a_step_and_a_revert():
    phases = StepPhases()

    def at(block: int = 0) -> tuple[int, StepPhase]:
        mark = phases.of("a", block)
        return mark.step, mark.phase

    phases.held("a", [0, 1], 4)
    phases.fetched("a", [0], 4)
    assert at(0) == (4, StepPhase.PARTIAL) and at(1) == (4, StepPhase.HELD)
    phases.applied("a", [0, 1], 4)
    phases.acknowledged("a", [0, 1], 4)
    assert at(0) == at(1) == (4, StepPhase.ACKNOWLEDGED)
    phases.taken_back("a", [0], 4)
    phases.copied("a", [0, 1], 4)  # told after the revert: block 0 stays taken back
    assert at(0) == (4, StepPhase.HELD) and at(1) == (4, StepPhase.COPIED)
    phases.fetched("a", [1], 4)  # a second commit of a step applied here already: no move
    assert at(1) == (4, StepPhase.COPIED)
    phases.held("a", [1], 5)  # the next step begins
    assert at(1) == (5, StepPhase.HELD)
    phases.copied("a", [1], 4)  # late news of the step before: no move
    assert at(1) == (5, StepPhase.HELD)
