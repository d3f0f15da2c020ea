"""Churn, the way volunteers' machines behave: for two minutes peers crash, freeze, leave, restart from their
checkpoint dirs and join, one event every 4 s on average, two at once sometimes, most aimed at a phase (forward,
backward, commit, standby pull, checkpoint write, move), while a client that connected at once trains with
sub-second steps. What must hold is not a speed but the promises: the training loop never sees an exception, no step
is lost unless two holders of a block were down at once (and then the loss is reported), and the adapter ends equal
to local peft on the same batches.
The same driver, longer and with a no-churn run beside it, is scripts/bench_churn.py.
"""

from __future__ import annotations

import pytest
from conftest import bench_churn

from swarm.chaos import MOVE, PHASES, ChurnStats, Outage, chaos_schedule


def test_a_schedule_comes_from_its_seed_alone_and_has_every_kind_of_fault():
    names = [f"peer{i}" for i in range(5)]
    schedule = chaos_schedule(4, 120.0, 4.0, names)
    assert schedule == chaos_schedule(4, 120.0, 4.0, names)
    assert schedule != chaos_schedule(5, 120.0, 4.0, names)
    assert all(0 < a.at < b.at < 120.0 for a, b in zip(schedule, schedule[1:], strict=False))
    assert {e.kind for e in schedule} == {"kill", "freeze", "term", "double-kill", "join"}
    assert {e.phase for e in schedule} == {None, *PHASES, MOVE}
    assert all(len(e.targets) == 2 and e.targets[0] != e.targets[1] for e in schedule if e.kind == "double-kill")
    assert 15 <= len(schedule) <= 45  # about one event per 4 s


def test_a_loss_is_excused_only_by_two_holders_of_a_block_down_at_once():
    stats = ChurnStats(outages=[Outage("a", range(0, 2), 1.0, 11, until=5.0), Outage("b", range(2, 4), 2.0, 12)])
    assert stats.shared_outages() == []  # no common block
    stats.outages.append(Outage("c", range(1, 3), 6.0, 13, until=9.0))  # shares block 1 with a, but a is back
    assert [(x.name, y.name) for x, y in stats.shared_outages()] == [("b", "c")]  # b, still down, shares block 2


@pytest.mark.swarm  # starts real processes: `pytest -m 'not swarm'` skips it
def test_two_minutes_of_churn_lose_nothing_unreported_and_end_equal_to_local_peft(tiny_models, tmp_path):
    run = bench_churn.run_churn(tiny_models["llama"], tmp_path, seconds=120, interval=4.0, seed=4, peers=5, span=2)
    print(bench_churn.report({"churn": run}))
    assert run.error is None, run.error
    kinds = {kind.split("@")[0] for kind in run.chaos.applied}
    assert {"kill", "freeze", "term", "double-kill", "join"} <= kinds, run.chaos.applied
    assert any("@" in kind for kind in run.chaos.applied), "no strike was aimed at a client request"
    assert run.steps >= 20, "training hardly moved"
    if run.steps_lost:
        assert run.excused, f"{run.steps_lost} step(s) lost, with never two holders of a block down at once"
        assert run.lost_reports
    else:
        assert run.parity, f"the adapter differs from local peft by {run.max_abs_diff} with no step reported lost"
