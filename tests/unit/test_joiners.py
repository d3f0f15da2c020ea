"""Replicas that joined since the last vote are compared with those they join at the step's start
(swarm/client/joiners.py): the outvoted is banned before any micro-batch runs through it."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

from swarm.client.joiners import judge_joiners

SPANS = {"head": range(0, 2), "liar": range(2, 4), "honest-1": range(2, 4), "honest-2": range(2, 4)}
HONEST = {0: "h0", 1: "h1", 2: "s2", 3: "s3"}


class FakeSwarm:
    """The parts judge_joiners uses: the current replicas, their digests, the bans; the asked peers recorded."""

    def __init__(self, spans: dict[str, range], digests: dict[str, dict[int, str]]):
        self.spans, self.digests, self.asked, self.banned = spans, digests, [], []
        self.calls = SimpleNamespace(adapter="a", ask=self.ask)
        self.standby: dict[str, dict[int, int]] = {peer: {} for peer in spans}

    def ask(self, peer: str, request: object) -> SimpleNamespace:
        self.asked.append(peer)
        return SimpleNamespace(digests=self.digests[peer])

    def ban_dishonest(self, peer: str, reason: str) -> None:
        self.banned.append(peer)

    def peers(self, step: int) -> dict[str, range]:
        return {p: span for p, span in self.spans.items() if p not in self.banned}

    def each(self, ask: Callable[[str], object], peers: list[str]) -> list[object]:
        return [ask(peer) for peer in peers]

    def realign(self, block: int, step: int, opinions: dict[str, str]) -> dict[str, str]:
        """As ReplicaSet.realign, with ``declared`` (block -> peer) standing for the survivors declared at the step."""
        source = getattr(self, "declared", {}).get(block)
        if source not in opinions:
            return {}
        stale = [p for p, digest in opinions.items() if digest != opinions[source]]
        for peer in stale:
            self.digests[peer] = {**self.digests[peer], block: opinions[source]}
        return {peer: opinions[source] for peer in stale}


def _swarm(liar_digest: str, spans: dict[str, range] = SPANS) -> FakeSwarm:
    digests = {peer: {b: HONEST[b] for b in span} for peer, span in spans.items()}
    digests["liar"] = {2: liar_digest, 3: HONEST[3]}
    return FakeSwarm(spans, digests)


def test_a_replica_outvoted_by_two_joiners_is_banned_and_only_the_joined_blocks_are_asked():
    swarm = _swarm(liar_digest="altered")
    judged = judge_joiners(swarm, swarm, step=1, judged={"head", "liar"}).judged
    assert swarm.banned == ["liar"] and "liar" not in swarm.standby
    assert sorted(swarm.asked) == ["honest-1", "honest-2", "liar"]  # the head's blocks had no joiner
    assert judged == {"head", "honest-1", "honest-2"}


def test_nothing_is_asked_when_nobody_joined_and_replicas_that_agree_stay():
    swarm = _swarm(liar_digest=HONEST[2])
    assert judge_joiners(swarm, swarm, step=1, judged=set(SPANS)).judged == set(SPANS)
    assert swarm.asked == []
    assert judge_joiners(swarm, swarm, step=1, judged={"head"}).judged == set(SPANS)
    assert swarm.banned == []


def test_two_that_disagree_alone_ban_nobody():
    swarm = _swarm(liar_digest="altered", spans={p: span for p, span in SPANS.items() if p != "honest-2"})
    judgement = judge_joiners(swarm, swarm, step=1, judged={"head", "liar"})
    assert judgement.judged == {"head", "liar", "honest-1"} and judgement.undecided == [2]
    assert swarm.banned == []


def test_two_that_disagree_where_a_survivor_was_declared_take_its_state_and_nobody_is_banned():
    """The client declared ``liar`` (here an honest survivor) current for block 2 after a loss; honest-1 came back
    with the state lost before: it takes the survivor's state, and the tie is gone without a ban."""
    swarm = _swarm(liar_digest="declared", spans={p: span for p, span in SPANS.items() if p != "honest-2"})
    swarm.declared = {2: "liar"}
    judgement = judge_joiners(swarm, swarm, step=1, judged={"head", "liar"})
    assert judgement.undecided == [] and swarm.banned == []
    assert swarm.digests["honest-1"][2] == "declared"
