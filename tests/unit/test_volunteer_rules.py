"""Volunteer rules on the pause gate (CPU busy with hysteresis, battery, GPU off, "finish the round, then pause"),
driven with fake probes and clocks; and the compact history that status records carry."""

import asyncio
import math

import pytest

from peerd.config import ConfigError, NodeConfig
from peerd.events import InnerProgress, RoundDone, RoundFailed, Evaluated, Paused
from peerd.status.history import MAX_POINTS, RecentHistory, history_problem, thin
from peerd.service.pause import PauseGate
from peerd.service.rules import (BATTERY_REASON, CPU_REASON, Probes, RuleEnforcer, VolunteerRules,
                                 effective_device)
from peerd.service.volunteer import VolunteerServices
from peerd.status.records import StatusFilter, make_status, status_problem

pytestmark = pytest.mark.timeout(30)


class Machine:
    """Fake probes: what other programs use of the CPU, and whether we run on battery."""

    def __init__(self):
        self.cpu = 0.0
        self.battery = None
        self.t = 0.0

    def probes(self):
        return Probes(lambda: self.cpu, lambda: self.battery)


def _enforcer(machine, **rules):
    gate = PauseGate(clock=lambda: machine.t)
    return gate, RuleEnforcer(VolunteerRules(**rules), gate, machine.probes(), clock=lambda: machine.t)


def _run(machine, enforcer, seconds, cpu=None):
    if cpu is not None:
        machine.cpu = cpu
    for _ in range(int(seconds / 2)):
        machine.t += 2.0
        enforcer.step()


def test_pause_while_other_programs_keep_the_cpu_busy():
    machine = Machine()
    gate, rules = _enforcer(machine, pause_when_cpu_busy_percent=50.0, cpu_busy_window_s=20.0)
    _run(machine, rules, 30, cpu=20.0)
    assert not gate.paused and rules.others_cpu_percent == 20.0
    _run(machine, rules, 4, cpu=95.0)  # a short spike: the window's mean stays below the limit
    assert not gate.paused
    _run(machine, rules, 20, cpu=95.0)
    assert gate.paused and CPU_REASON in gate.reasons and "95%" in gate.reasons[CPU_REASON]
    _run(machine, rules, 30, cpu=48.0)  # below the limit, not below limit - hysteresis: stays paused
    assert gate.paused
    _run(machine, rules, 30, cpu=30.0)
    assert not gate.paused
    # the rule switched off lifts its pause at once
    _run(machine, rules, 30, cpu=99.0)
    assert gate.paused
    rules.set_rules(rules.rules.updated({"pause_when_cpu_busy_percent": 0}))
    assert not gate.paused
    _run(machine, rules, 30)
    assert not gate.paused


def test_pause_on_battery_and_rules_keep_other_reasons():
    machine = Machine()
    gate, rules = _enforcer(machine, pause_on_battery=True)
    _run(machine, rules, 4)
    assert not gate.paused  # no battery at all: never pauses
    machine.battery = True
    _run(machine, rules, 2)
    assert gate.reasons == {BATTERY_REASON: "the machine runs on battery"}
    gate.pause("user", "paused by the volunteer")
    machine.battery = False
    _run(machine, rules, 2)
    assert gate.reasons == {"user": "paused by the volunteer"}  # mains power lifts only its own reason
    gate.resume("user")
    off = Machine()
    gate2, rules2 = _enforcer(off, pause_on_battery=False)
    off.battery = True
    _run(off, rules2, 4)
    assert not gate2.paused and rules2.on_battery is True


def test_rule_values_are_checked():
    rules = VolunteerRules()
    assert rules.updated({"pause_when_cpu_busy_percent": 70, "pause_on_battery": True}) == VolunteerRules(70.0, 30.0, True)
    for bad in ({"pause_when_cpu_busy_percent": 101}, {"pause_when_cpu_busy_percent": True},
                {"pause_on_battery": "yes"}, {"cpu_busy_window_s": 0}, {"gpu": False}):
        with pytest.raises(ValueError):
            rules.updated(bad)
    with pytest.raises(ConfigError, match="pause_when_cpu_busy_percent"):
        NodeConfig(pause_when_cpu_busy_percent=150.0)


def test_gpu_off_keeps_the_daemon_on_the_cpu():
    assert effective_device("auto", gpu=False) == "cpu"
    assert effective_device("auto", gpu=True) == "auto"
    assert effective_device("cpu", gpu=False) == "cpu"
    with pytest.raises(ConfigError, match="gpu"):
        NodeConfig(gpu=False, device="cuda")


def _round_done(r):
    return RoundDone(r, 3, 10, 10, 0.1, {}, 1, 1.0, 80.0, 10, 100, "d" * 64, "allreduce", 3.0, 1000)


def test_finish_the_round_then_pause_and_set_rules_through_the_control_handler(tmp_path):
    async def main():
        node = NodeConfig(checkpoint_dir=str(tmp_path), pause_when_cpu_busy_percent=0.0)
        services = VolunteerServices(node, "diloco", asyncio.Event(), run_id="r", environ={},
                                     probes=Machine().probes())
        reply = await services.handle({"cmd": "pause_after_round"})
        assert reply["ok"] and reply["pause_after_round"] and not services.gate.paused
        assert (await services.handle({"cmd": "status"}))["pause_after_round"]
        services.events.publish(InnerProgress(0, 5, 3.0, 100.0, 10))
        assert not services.gate.paused  # the round goes on
        services.events.publish(_round_done(1))
        assert services.gate.paused and "user" in services.gate.reasons and not services.pause_after_round
        assert (await services.handle({"cmd": "resume"}))["changed"]
        # a failed round ends the round too; a resume in between cancels the request
        await services.handle({"cmd": "pause_after_round"})
        await services.handle({"cmd": "resume"})
        services.events.publish(RoundFailed(1, "timeout", "allreduce"))
        assert not services.gate.paused
        await services.handle({"cmd": "pause_after_round"})
        services.events.publish(RoundFailed(1, "timeout", "allreduce"))
        assert services.gate.paused
        await services.handle({"cmd": "resume"})
        reply = await services.handle({"cmd": "set_rules", "rules": {"pause_on_battery": True}})
        assert reply["ok"] and reply["rules"]["pause_on_battery"] and services.rules.rules.pause_on_battery
        assert not (await services.handle({"cmd": "set_rules", "rules": {"pause_on_battery": 1}}))["ok"]
        status = await services.handle({"cmd": "status"})
        assert status["rules"]["pause_on_battery"] and status["rules"]["gpu"] is True
        assert status["limits"]["device"] == "auto"
        boot = VolunteerServices(node, "bootstrap", asyncio.Event(), environ={}, probes=Machine().probes())
        assert not (await boot.handle({"cmd": "pause_after_round"}))["ok"]

    asyncio.run(main())


def test_recent_history_from_events_fits_in_a_status_record():
    clock = [1000.0]
    history = RecentHistory(max_points=8, clock=lambda: clock[0])
    history(Evaluated(0, 5.5, 0))
    for i in range(40):
        clock[0] += 1.0
        history(InnerProgress(i // 10, i % 10, 5.0 - i * 0.05, 100.0, 10))
        if i % 10 == 9:
            history(_round_done(i // 10 + 1))
    history(Paused(4, {"user": "x"}, 0))
    clock[0] += 100.0  # paused: no tokens counted
    history(InnerProgress(4, 1, 3.0, 100.0, 10))
    compact = history.compact()
    assert len(compact["loss"]) == 8 and len(compact["eval"]) == 5
    assert compact["loss"][0][0] == 1001.0 and compact["loss"][-1][2] == 3.0  # first and last kept
    assert compact["eval"][0] == [1000.0, 0, 5.5] and compact["eval"][-1][1] == 1000
    assert compact["loss"][-1][1] < 1000 + 100 * 2  # the pause's 100 s did not count as training
    assert history_problem(compact) is None
    record = make_status(role="diloco", history=compact)
    assert status_problem(record) is None
    assert StatusFilter()({"p": record})["p"]["history"] == compact


def test_a_bad_history_drops_only_that_record():
    good = make_status(role="diloco", history={"loss": [[1.0, None, 2.0, None]], "eval": [], "later": "ok"})
    assert status_problem(good) is None
    bad = {"loss": [[1.0, 2, math.nan, 3.0]]}, {"loss": "x"}, {"eval": [[1.0, 2]]}, [1], {"loss": [[None, 1, 2, 3]]}
    for value in bad:
        assert history_problem(value) is not None
        assert status_problem({**good, "history": value}) is not None
    kept = StatusFilter()({"good": good, "bad": {**good, "history": {"loss": "x"}}})
    assert list(kept) == ["good"] and kept["good"]["history"] == {"loss": [[1.0, None, 2.0, None]], "eval": []}


def test_thin_spreads_points_over_the_span():
    points = [[float(t)] for t in range(100)]
    kept = thin(points, 10)
    assert len(kept) == 10 and kept[0] == [0.0] and kept[-1] == [99.0]
    gaps = [b[0] - a[0] for a, b in zip(kept, kept[1:])]
    assert max(gaps) <= 3 * min(gaps)
    assert MAX_POINTS <= 64


def test_pause_while_listed_programs_run_or_the_user_is_active():
    from peerd.service.rules import ACTIVE_REASON, PROGRAMS_REASON

    machine = Machine()
    running, idle = {"bash", "python3"}, [None]
    probes = Probes(lambda: 0.0, lambda: None, lambda: set(running), lambda: idle[0])
    gate = PauseGate(clock=lambda: machine.t)
    rules = RuleEnforcer(VolunteerRules(pause_while_programs=("Steam", "vlc"), pause_while_user_active_s=180.0), gate,
                         probes, clock=lambda: machine.t)
    rules.step()
    assert not gate.paused  # no listed program; the idle time unknown here: that rule is inactive
    running.add("vlc")
    rules.step()
    assert gate.reasons == {PROGRAMS_REASON: "vlc running"}
    running.discard("vlc")
    idle[0] = 12.0
    rules.step()
    assert list(gate.reasons) == [ACTIVE_REASON] and "in use" in gate.reasons[ACTIVE_REASON]
    idle[0] = 200.0
    rules.step()
    assert not gate.paused
    idle[0] = 1.0
    rules.step()
    rules.set_rules(rules.rules.updated({"pause_while_user_active_s": 0}))  # switched off: lifted at once
    assert not gate.paused
    with pytest.raises(ValueError, match="pause_while_programs"):
        rules.rules.updated({"pause_while_programs": "steam"})
    with pytest.raises(ConfigError, match="pause_while_user_active_s"):
        NodeConfig(pause_while_user_active_s=-1)
    node = NodeConfig(pause_while_programs=("steam",), pause_while_user_active_s=180)
    assert VolunteerRules.from_node(node).pause_while_programs == ("steam",)


def test_snooze_pauses_until_its_time_and_says_until_when():
    import datetime

    from peerd.service.rules import SNOOZE_REASON, snooze_deadline

    now = datetime.datetime(2026, 3, 2, 20, 15).timestamp()
    assert snooze_deadline("1h", now) == now + 3600 and snooze_deadline("4h", now) == now + 4 * 3600
    assert snooze_deadline("90m", now) == now + 5400 and snooze_deadline("off", now) is None
    assert snooze_deadline("tomorrow", now) == datetime.datetime(2026, 3, 3, 6, 0).timestamp()
    for bad in ("", "1", "soon", "0h", "200h"):
        with pytest.raises(ValueError):
            snooze_deadline(bad, now)
    machine, wall = Machine(), [now]
    gate, rules = _enforcer(machine)
    rules.wall = lambda: wall[0]
    assert rules.snooze(now + 3600)
    assert gate.reasons == {SNOOZE_REASON: f"snoozed until {datetime.datetime.fromtimestamp(now + 3600):%a %H:%M}"}
    gate.pause("user", "paused by the volunteer")
    wall[0] = now + 3599
    rules.step()
    assert SNOOZE_REASON in gate.reasons
    wall[0] = now + 3600
    rules.step()
    assert gate.reasons == {"user": "paused by the volunteer"} and rules.snoozed_until is None  # only its own reason
    rules.snooze(now + 7200)
    assert SNOOZE_REASON in gate.reasons
    rules.snooze(None)
    assert gate.reasons == {"user": "paused by the volunteer"}


def test_snooze_through_the_control_handler(tmp_path):
    from peerd.service.rules import SNOOZE_REASON

    async def main():
        node = NodeConfig(checkpoint_dir=str(tmp_path), device="cpu")
        services = VolunteerServices(node, "diloco", asyncio.Event(), run_id="r", environ={},
                                     probes=Machine().probes())
        bad = await services.handle({"cmd": "snooze", "for": "soon"})
        reply = await services.handle({"cmd": "snooze", "for": "4h"})
        status = await services.handle({"cmd": "status"})
        lifted = await services.handle({"cmd": "snooze", "for": "off"})
        return bad, reply, status, lifted

    bad, reply, status, lifted = asyncio.run(main())
    assert not bad["ok"] and "1h, 4h" in bad["error"]
    assert reply["ok"] and reply["paused"] and SNOOZE_REASON in reply["pause_reasons"]
    assert status["snoozed_until"] == reply["snoozed_until"] and reply["snoozed_until"] > 0
    assert lifted["ok"] and not lifted["paused"] and lifted["snoozed_until"] is None
