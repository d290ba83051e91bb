"""The pause gate and active hours: parsing, window arithmetic, and the enforcer driven by a fake clock."""

import asyncio
from datetime import datetime, timedelta

import pytest

from peerd.service.pause import USER_REASON, PauseGate
from peerd.service.schedule import SCHEDULE_REASON, ActiveHours, enforce_active_hours

pytestmark = pytest.mark.timeout(30)

DAY = datetime(2026, 3, 14)


def at(hh: int, mm: int = 0, ss: int = 0, day: int = 0) -> datetime:
    return DAY + timedelta(days=day, hours=hh, minutes=mm, seconds=ss)


# ---------------------------------------------------------------------------------------------------------- parsing


@pytest.mark.parametrize("spec, windows", [
    ("22:00-07:00", ((1320, 420),)),
    ("09:00-12:00,18:00-23:30", ((540, 720), (1080, 1410))),
    (" 9:05 - 9:10 ", ((545, 550),)),
    ("00:00-24:00", ((0, 1440),)),
    ("18:00-24:00", ((1080, 1440),)),
])
def test_parse(spec, windows):
    assert ActiveHours.parse(spec).windows == windows


@pytest.mark.parametrize("spec, needle", [
    ("", "expected windows"),
    ("22-07", "'22-07'"),
    ("25:00-07:00", "25:00"),
    ("10:60-11:00", "10:60"),
    ("10:00-10:00", "empty"),
    ("24:00-03:00", "24:00"),
    ("24:30-03:00", "24:30"),
    ("09:00-12:00,nonsense", "'nonsense'"),
])
def test_parse_errors_name_the_bad_part(spec, needle):
    with pytest.raises(ValueError, match=needle):
        ActiveHours.parse(spec)


# ------------------------------------------------------------------------------------------------------ arithmetic


def test_window_inside_one_day():
    hours = ActiveHours.parse("09:00-17:00")
    assert not hours.is_active(at(8, 59, 59))
    assert hours.is_active(at(9)) and hours.is_active(at(16, 59, 59))
    assert not hours.is_active(at(17))
    assert hours.seconds_until_change(at(8)) == 3600
    assert hours.seconds_until_change(at(12)) == 5 * 3600
    assert hours.seconds_until_change(at(20)) == 13 * 3600  # tomorrow 09:00


def test_window_across_midnight():
    hours = ActiveHours.parse("22:00-07:00")
    assert hours.is_active(at(23)) and hours.is_active(at(0)) and hours.is_active(at(6, 59))
    assert not hours.is_active(at(7)) and not hours.is_active(at(21, 59, 59))
    assert hours.seconds_until_change(at(23)) == 8 * 3600
    assert hours.seconds_until_change(at(12)) == 10 * 3600


def test_several_windows_and_whole_day():
    hours = ActiveHours.parse("09:00-12:00,18:00-23:30")
    assert [hours.is_active(at(h)) for h in (8, 10, 13, 19, 23)] == [False, True, False, True, True]
    assert hours.seconds_until_change(at(12, 30)) == 5.5 * 3600
    always = ActiveHours.parse("00:00-24:00")
    assert always.is_active(at(0)) and always.is_active(at(23, 59, 59))
    assert always.seconds_until_change(at(5)) == float("inf")
    # adjacent windows that cover the day never change either
    assert ActiveHours.parse("00:00-12:00,12:00-24:00").seconds_until_change(at(11)) == float("inf")


# ------------------------------------------------------------------------------------------------------------- gate


def test_gate_reasons():
    async def main():
        gate = PauseGate(clock=lambda: 123.0)
        assert not gate.paused and gate.describe() == "running"
        assert gate.pause(USER_REASON, "by hand") is True
        assert gate.paused and gate.paused_since == 123.0
        assert gate.pause(SCHEDULE_REASON, "night") is False  # already paused
        assert gate.resume(USER_REASON) is False  # still paused by the schedule
        assert gate.paused and gate.reasons == {SCHEDULE_REASON: "night"}
        waiter = asyncio.ensure_future(gate.wait_running())
        await asyncio.sleep(0.01)
        assert not waiter.done()
        assert gate.resume(SCHEDULE_REASON) is True
        await asyncio.wait_for(waiter, 1)
        assert gate.resume(SCHEDULE_REASON) is False  # absent reason: no-op
        pauser = asyncio.ensure_future(gate.wait_paused())
        await asyncio.sleep(0.01)
        assert not pauser.done()
        gate.pause(USER_REASON, "again")
        await asyncio.wait_for(pauser, 1)

    asyncio.run(main())


# ------------------------------------------------------------------------------------------------------- enforcer


class FakeClock:
    """A clock that only moves when the enforcer sleeps; records every sleep and the gate after it."""

    def __init__(self, start: datetime, gate: PauseGate, until: datetime):
        self.now, self.gate, self.until = start, gate, until
        self.log: list[tuple[datetime, bool, float]] = []

    async def sleep(self, seconds: float) -> None:
        self.log.append((self.now, self.gate.paused, seconds))
        self.now += timedelta(seconds=seconds)
        if self.now >= self.until:
            raise asyncio.CancelledError
        await asyncio.sleep(0)


def test_enforcer_pauses_outside_and_resumes_inside_active_hours():
    async def main():
        gate = PauseGate()
        clock = FakeClock(at(20), gate, until=at(8, day=1))
        with pytest.raises(asyncio.CancelledError):
            await enforce_active_hours(ActiveHours.parse("22:00-07:00"), gate, now=lambda: clock.now,
                                       sleep=clock.sleep, max_sleep_s=3600)
        return clock.log

    log = asyncio.run(main())
    states = {when: paused for when, paused, _ in log}
    assert states[at(20)] is True  # 20:00: outside, paused
    assert states[at(21)] is True
    assert states[at(22)] is False  # the boundary itself: training
    assert states[at(7, day=1)] is True  # 07:00 next day: paused again
    assert all(seconds <= 3600 for _, _, seconds in log)
    # it wakes exactly at the boundaries, not somewhere after them
    assert at(22) in states and at(7, day=1) in states


def test_enforcer_leaves_a_user_pause_alone():
    async def main():
        gate = PauseGate()
        gate.pause(USER_REASON, "by hand")
        clock = FakeClock(at(23), gate, until=at(23, 30))
        with pytest.raises(asyncio.CancelledError):
            await enforce_active_hours(ActiveHours.parse("22:00-07:00"), gate, now=lambda: clock.now,
                                       sleep=clock.sleep, max_sleep_s=60)
        return gate

    gate = asyncio.run(main())
    assert gate.reasons == {USER_REASON: "by hand"}  # inside active hours, but the volunteer's pause stands
