"""One numbering of outer rounds everywhere: round N (from 1) makes theta_outer version N. The logs' progress and
done lines, the failure lines, the group keys that the all-reduce logs, and the status column agree."""

import pytest

from peerd.events import CheckpointResumed, Evaluated, InnerProgress, Paused, RoundDone, RoundFailed, StateDownloaded
from peerd.roles.outer_sync import group_key
from protocols.moshpit import round_key

pytestmark = pytest.mark.timeout(30)


def _done(version: int) -> RoundDone:
    return RoundDone(version, 2, 10, 10, 0.1, {}, 1, 1.0, 1.0, 20, 100, "d" * 16, "allreduce", None, 0)


def test_the_round_a_peer_trains_is_the_round_its_keys_and_done_line_name():
    version = 1  # one round done: the peer trains round 2
    progress = InnerProgress(version, 1, 2.0, 100.0, round_quota=20).message()
    assert progress.startswith("round 2 step 1/20")
    assert group_key(version) == "round2" and group_key(version, retry=1) == "round2.retry1"
    assert round_key(version) == "moshpit.r2"
    assert RoundFailed(version, "timeout", "allreduce").message().startswith("round 2 failed")
    assert _done(version + 1).message().startswith("outer round 2 done")  # ... and it made version 2


def test_messages_about_a_version_say_how_many_rounds_are_done():
    assert Evaluated(0, 5.58, 100).message().startswith("eval before round 1:")
    assert Evaluated(2, 5.0, 100).message().startswith("eval after round 2:")
    assert "before round 1, 14 local steps" in CheckpointResumed(0, "d", "/x", 14).message()
    assert "after round 3" in StateDownloaded(3, "peer", "d", 1.0, 2.0).message()
    assert "after round 1" in Paused(1, {"user": "paused by the user"}).message()


def test_every_roles_round_keys_come_from_one_scheme():
    from protocols.group_keys import group_key as scheme

    for version in (0, 1, 41):
        assert group_key(version) == scheme(version) == f"round{version + 1}"
        assert group_key(version, 2, 3) == scheme(version, 2, 3) == f"round{version + 1}.retry2.attempt3"
        assert round_key(version) == scheme(version, prefix="moshpit.r") == f"moshpit.r{version + 1}"
