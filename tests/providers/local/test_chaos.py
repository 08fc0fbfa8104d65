"""Which instance `petctl chaos` takes by default, as a pure decision over hosts, ranks and notices."""

from __future__ import annotations

import pytest

from petctl.core.errors import PetctlError
from petctl.providers.local.chaos import choose_target
from tests.support.hosts import host

# After a first notice to rank 1 (i-b): it left the round and runs until its reclaim; its replacement (i-c)
# is warming up outside the round. The only instance training is i-a.
AFTER_NOTICE = [host("i-a", launched=1), host("i-b", launched=2), host("i-c", launched=3)]
NOTICED = {"i-b": {"kind": "spot", "time": 1e10}}


def test_second_notice_goes_to_a_ranked_instance_without_a_notice() -> None:
    """It used to go to i-b again (outside the round counted as the highest rank): no capacity was taken
    away and i-b's reclaim time moved."""
    assert choose_target("j", AFTER_NOTICE, {"i-a": 0}, NOTICED, None, "notice").host_id == "i-a"


def test_default_is_the_highest_rank_of_the_round() -> None:
    hosts = [host("i-a"), host("i-b"), host("i-c", launched=9)]
    for mode in ("notice", "kill", "term", "freeze"):
        assert choose_target("j", hosts, {"i-a": 1, "i-b": 0}, {}, None, mode).host_id == "i-a"


def test_a_notice_to_an_instance_that_has_one_is_an_error() -> None:
    with pytest.raises(PetctlError, match="i-b of job 'j' already has a notice"):
        choose_target("j", AFTER_NOTICE, {"i-a": 0}, NOTICED, "i-b", "notice")
    # Killing it by name is still allowed: that is what a reclaim is.
    assert choose_target("j", AFTER_NOTICE, {"i-a": 0}, NOTICED, "i-b", "kill").host_id == "i-b"


def test_nothing_to_take_is_an_error_not_a_departing_instance() -> None:
    with pytest.raises(PetctlError, match="no running instance in its current round"):
        choose_target("j", AFTER_NOTICE, {"i-a": 0}, {**NOTICED, "i-a": {"time": 1e10}}, None, "notice")


def test_before_any_round_the_newest_instance_is_taken() -> None:
    hosts = [host("i-a", launched=1), host("i-b", launched=5)]
    assert choose_target("j", hosts, {}, {}, None, "kill").host_id == "i-b"


def test_unfreeze_takes_a_frozen_host_even_when_the_round_dropped_it() -> None:
    hosts = [host("i-a"), host("i-b", state="frozen", launched=4)]
    assert choose_target("j", hosts, {"i-a": 0}, {}, None, "unfreeze").host_id == "i-b"
