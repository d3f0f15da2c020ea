"""Safe defaults: a public swarm spot-checks where a vote can decide; a private one checks only when asked."""

from __future__ import annotations

import pytest

from swarm.client.trust import PUBLIC_SPOT_CHECK, VOTERS, spot_check_policy


def test_a_public_swarm_checks_by_default_where_three_replicas_can_vote():
    assert spot_check_policy(None, private=False) == (PUBLIC_SPOT_CHECK, VOTERS)
    assert 0 < PUBLIC_SPOT_CHECK <= 0.05 and VOTERS == 3


def test_a_private_swarm_checks_nothing_unless_asked_and_a_rate_given_is_kept():
    assert spot_check_policy(None, private=True)[0] == 0.0
    assert spot_check_policy(0.5, private=True) == (0.5, 2)
    assert spot_check_policy(0.0, private=False) == (0.0, 2)


@pytest.mark.parametrize("rate", [-0.1, 1.5])
def test_a_rate_outside_zero_to_one_is_refused(rate):
    with pytest.raises(ValueError, match="fraction"):
        spot_check_policy(rate, private=False)
