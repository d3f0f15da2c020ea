"""The link meter's arithmetic (swarm/testing/linkmeter.py): what it reads from /proc/net/dev, what it reports, and
the client's command line; the measurement itself runs in tests/e2e/test_client_link.py."""

from __future__ import annotations

import dataclasses

from swarm.testing.linkmeter import Counters, LinkReport, MeterConfig, parse_args, parse_net_dev

NET_DEV = """Inter-|   Receive                                                |  Transmit
 face |bytes packets errs drop fifo frame compressed multicast|bytes packets errs drop fifo colls carrier compressed
    lo: 9999999 100 0 0 0 0 0 0 9999999 100 0 0 0 0 0 0
  eth0:    1500  10 0 0 0 0 0 0    2500  20 0 0 0 0 0 0
  eth1:     500   5 0 0 0 0 0 0     100   1 0 0 0 0 0 0
"""


def test_the_counters_sum_every_interface_but_loopback():
    assert parse_net_dev(NET_DEV) == Counters(rx=2000, tx=2600)
    assert (Counters(10, 20) - Counters(4, 5)).total == 21


def test_a_report_survives_its_json_line_and_takes_medians_per_direction():
    report = LinkReport(
        times=[1.0, 3.0, 2.0],
        own=[Counters(10, 100), Counters(30, 300), Counters(20, 200)],
        watched={"peer0": [Counters(1, 2), Counters(3, 4), Counters(5, 6)]},
    )
    back = LinkReport.from_json(report.to_json())
    assert back == report
    assert (back.median_step, back.bytes_per_step) == (2.0, 220)
    assert back.median() == Counters(20, 200) and back.median("peer0") == Counters(3, 4)


def test_the_client_command_line_gives_back_the_config():
    config = MeterConfig(adapter="a", chain=False, steps=5, warmup=0, batch=2, seq=16, micro_batches=3, pipelined=False)
    wire = dataclasses.replace(config, wire="bfloat16+hadamard4/hadamard3")
    for wanted in (config, MeterConfig(), dataclasses.replace(config, chain=True, pipelined=True), wire):
        args, parsed = parse_args(["--model", "m", "--initial-peers", "/ip4/1.2.3.4/tcp/1", *wanted.to_args()])
        assert parsed == wanted
    args, _ = parse_args(["--model", "m", "--initial-peers", "x", "--watch=peer0=12", "--watch=peer1=34"])
    assert dict(args.watch) == {"peer0": 12, "peer1": 34}
    assert (MeterConfig(micro_batches=4).waves, MeterConfig(micro_batches=4, pipelined=False).waves) == (1, 4)
