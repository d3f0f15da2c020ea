"""swarm's command line: options that take numbers refuse what cannot be one."""

from __future__ import annotations

import pytest

from swarm.ops.cli import build_parser


def test_a_peer_may_announce_the_throughput_it_is_told_and_nothing_but_a_positive_one():
    args = build_parser().parse_args(["peer", "--model", "m", "--throughput", "250.5"])
    assert args.throughput == 250.5
    assert build_parser().parse_args(["peer", "--model", "m"]).throughput is None  # measured at start
    for wrong in ("0", "-3", "nan", "inf", "fast"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["peer", "--model", "m", "--throughput", wrong])


def test_the_monitor_refreshes_every_positive_number_of_seconds():
    assert build_parser().parse_args(["monitor", "--refresh", "0.5"]).refresh == 0.5
    with pytest.raises(SystemExit):
        build_parser().parse_args(["monitor", "--refresh", "0"])
