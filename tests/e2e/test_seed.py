"""The seed's story, short (issue 56): six self-placing peers of 34 blocks (``--num-blocks 34``, no ``--blocks``,
replication 2, rebalancing on) on a tiny random Llama of the seed model's 80 blocks; the client connects right after
starting them, while they load, and trains with pipelined micro-batches; one peer is SIGKILLed mid-step and training
goes on. What must hold: no step lost, the adapter equal to local peft on the same batches, the six put two live
servers on every block within a bounded time, the five left get back within a bounded time to the best their spans
allow, and no peer moves more than a few times.

Five spans of 34 cannot give all 80 blocks two servers (blocks 0 and 79 need two spans each, [0:34] and [46:80], which
leaves one span for blocks 34-45), so after the kill the goal is the most that five spans allow
(``swarm.testing.seed.best_doubled``: 68 blocks at 2, none at 0); with spans of 40 or more it is every block at 2.
The same story, longer and with its timeline printed, is scripts/bench_seed.py.
"""

from __future__ import annotations

import pytest

from swarm.testing import seed
from swarm.testing.tiny import make_tiny_model

BALANCE_INTERVAL = 2.0
# seconds from the first peer's start until the six put two servers on every block (two cores, loaded); 250.7 s was
# measured once, in a suite run 35 % slower than usual on this machine (the whole test: 354 s, 184 s on a quiet day)
SETTLE = 300.0
RECOVER = 60.0  # seconds from the kill until the five left are at the best their spans allow
PATIENCE = 150.0  # the client's: it connects while the peers load, and waits out blocks without a server
MAX_MOVES = 3  # moves a peer may begin: one to settle, and a takeover's growth and shrink back after the kill


@pytest.mark.slow
def test_six_peers_of_34_blocks_settle_lose_one_and_train_on(tmp_path):
    model_dir = make_tiny_model(
        tmp_path / "model", layers=seed.LAYERS, hidden=seed.HIDDEN, intermediate=2 * seed.HIDDEN, seed=1
    )
    run = seed.run_seed(
        model_dir,
        tmp_path,
        balance_interval=BALANCE_INTERVAL,
        micro_batches=2,
        steps_before=2,
        steps_after=2,
        settle_timeout=SETTLE,
        recover_timeout=RECOVER,
        patience=PATIENCE,
        echo=print,
    )
    print(seed.report(run))
    assert run.error is None, run.error
    assert run.killed_at is not None
    best = seed.best_doubled(seed.PEERS - 1, seed.SPAN, seed.LAYERS)
    last = run.samples[-1]
    too_many = {name: begun for name, (begun, _) in run.moves.items() if begun > MAX_MOVES}
    # Every promise checked, each failure named: one run shows where the whole story stands.
    problems = []
    if run.steps_lost:
        problems.append(f"steps lost: {run.lost_reports}")
    if run.max_abs_diff is None or run.max_abs_diff > 1e-4:
        problems.append(f"the adapter differs from local peft by {run.max_abs_diff}")
    if run.all_doubled_at is None or run.all_doubled_at > SETTLE:
        problems.append(f"six peers did not give every block 2 servers within {SETTLE:g} s: {run.all_doubled_at}")
    if run.recovered_at is None or run.recovered_at - run.killed_at > RECOVER:
        took = "never" if run.recovered_at is None else f"after {run.recovered_at - run.killed_at:.0f} s"
        problems.append(f"the five left did not reach {best} blocks at 2 (none at 0) within {RECOVER:g} s: {took}")
    if last.blocks_with(0) or last.doubled < best:
        problems.append(f"the last look is short of {best} blocks at 2: {last.row()}")
    if too_many:
        problems.append(f"peers that began more than {MAX_MOVES} moves: {too_many}")
    assert not problems, "\n".join(problems)
