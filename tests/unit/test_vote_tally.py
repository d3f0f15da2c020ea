"""The replicas' vote at a commit (swarm/client/votes.py): digests by peer in, verdict out."""

from __future__ import annotations

from swarm.client.votes import tally


def test_replicas_that_agree_are_unanimous_and_a_single_replica_too():
    assert tally({"a": "x", "b": "x", "c": "x"}).unanimous
    assert tally({"a": "x"}).unanimous
    assert tally({}).unanimous


def test_one_outvoted_by_two_that_agree_is_named():
    verdict = tally({"a": "x", "liar": "y", "b": "x"})
    assert verdict.outvoted == ("liar",) and verdict.majority == ("a", "b") and not verdict.undecided


def test_two_that_disagree_alone_or_a_tie_is_undecided():
    for digests in ({"a": "x", "b": "y"}, {"a": "x", "b": "x", "c": "y", "d": "y"}, {"a": "x", "b": "y", "c": "z"}):
        verdict = tally(digests)
        assert verdict.undecided and not verdict.outvoted and not verdict.majority, digests


def test_the_largest_group_wins_over_every_other_one():
    verdict = tally({"a": "x", "b": "x", "c": "x", "d": "y", "e": "y", "f": "z"})
    assert verdict.majority == ("a", "b", "c") and verdict.outvoted == ("d", "e", "f")


def test_a_missing_digest_counts_as_a_state_nobody_else_has():
    verdict = tally({"a": "x", "b": "x", "silent": ""})
    assert verdict.outvoted == ("silent",)
