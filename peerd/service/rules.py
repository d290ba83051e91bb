"""Volunteer rules that BOINC and Folding@home users expect, enforced on the daemon's pause gate.

- ``pause_when_cpu_busy_percent``: pause while *other* programs keep the CPU busy above a threshold (percent of
  all cores, averaged over ``cpu_busy_window_s``); resume once they are :data:`CPU_HYSTERESIS` points below it.
  This daemon's own processes (its DHT child and p2pd included) are not counted, so pausing does not feed back.
- ``pause_on_battery``: pause while the machine runs on battery.
- ``pause_while_programs``: pause while a listed program runs (games, video players: BOINC's exclusive apps).
- ``pause_while_user_active_s``: pause while the user touched keyboard or mouse that recently (input idle time, where
  the desktop exposes it).
- ``gpu``: :func:`effective_device` keeps a daemon with ``gpu = false`` on the CPU.
- "finish the round, then pause" lives in :class:`peerd.service.volunteer.VolunteerServices` (it needs the role's
  round events).

:class:`RuleEnforcer` is driven by :meth:`RuleEnforcer.step` with injected probes and clock, so tests run it
without a real CPU load or battery; :func:`psutil_probes` are the real ones.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from dataclasses import dataclass, replace
from typing import Any, Awaitable, Callable, Optional

logger = logging.getLogger(__name__)

CPU_REASON = "cpu_busy"
BATTERY_REASON = "battery"
PROGRAMS_REASON = "programs"
ACTIVE_REASON = "user_active"
SNOOZE_REASON = "snooze"
#: Local hour at which a snooze "until tomorrow" ends.
TOMORROW_HOUR = 6
#: Percentage points below the threshold at which a CPU-busy pause lifts.
CPU_HYSTERESIS = 5.0
#: Seconds between two samples of the probes.
SAMPLE_S = 2.0


@dataclass(frozen=True)
class VolunteerRules:
    """The runtime-editable rules (node config keys of the same names)."""

    pause_when_cpu_busy_percent: float = 0.0
    cpu_busy_window_s: float = 30.0
    pause_on_battery: bool = False
    pause_while_programs: tuple[str, ...] = ()
    pause_while_user_active_s: float = 0.0

    @classmethod
    def from_node(cls, node: Any) -> "VolunteerRules":
        return cls(node.pause_when_cpu_busy_percent, node.cpu_busy_window_s, node.pause_on_battery,
                   tuple(getattr(node, "pause_while_programs", ())),
                   float(getattr(node, "pause_while_user_active_s", 0.0)))

    def updated(self, changes: dict[str, Any]) -> "VolunteerRules":
        """These rules with ``changes`` applied. Raises ValueError naming a key that is unknown or out of range."""
        out = {}
        for key, value in changes.items():
            if key == "pause_when_cpu_busy_percent":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 100:
                    raise ValueError(f"{key} must be a number in [0, 100] (0 = off), got {value!r}")
                out[key] = float(value)
            elif key == "cpu_busy_window_s":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 3600:
                    raise ValueError(f"{key} must be a number of seconds in (0, 3600], got {value!r}")
                out[key] = float(value)
            elif key == "pause_on_battery":
                if not isinstance(value, bool):
                    raise ValueError(f"{key} must be true or false, got {value!r}")
                out[key] = value
            elif key == "pause_while_programs":
                if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
                    raise ValueError(f"{key} must be a list of program names, got {value!r}")
                out[key] = tuple(value)
            elif key == "pause_while_user_active_s":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 86400:
                    raise ValueError(f"{key} must be a number of seconds in [0, 86400] (0 = off), got {value!r}")
                out[key] = float(value)
            else:
                raise ValueError(f"unknown rule {key!r} (pause_when_cpu_busy_percent, cpu_busy_window_s, "
                                 "pause_on_battery, pause_while_programs, pause_while_user_active_s)")
        return replace(self, **out)


def snooze_deadline(spec: str, now: float) -> Optional[float]:
    """The Unix time a snooze given as ``spec`` ends: ``1h``, ``4h``, ``90m`` (any number of hours or minutes),
    ``tomorrow`` (TOMORROW_HOUR o'clock local time, the next day), or None for ``off`` (lift a snooze). Raises
    ValueError for anything else."""
    import datetime
    import re

    spec = spec.strip().lower()
    if spec == "off":
        return None
    if spec == "tomorrow":
        day = datetime.datetime.fromtimestamp(now).date() + datetime.timedelta(days=1)
        return datetime.datetime.combine(day, datetime.time(TOMORROW_HOUR)).timestamp()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([hm])", spec)
    if not match or not 0 < float(match.group(1)) <= (168 if match.group(2) == "h" else 10080):
        raise ValueError(f"snooze for 1h, 4h, 90m (up to a week), tomorrow, or off; got {spec!r}")
    return now + float(match.group(1)) * (3600 if match.group(2) == "h" else 60)


def effective_device(device: str, gpu: bool) -> str:
    """The device a daemon trains on: ``device`` unless ``gpu`` is off, which turns ``auto`` into ``cpu`` (the
    node config refuses ``cuda`` with ``gpu = false``)."""
    return "cpu" if not gpu and device == "auto" else device


@dataclass
class Probes:
    """``others_cpu_percent()``: CPU use of other programs, percent of all cores (None if unknown);
    ``on_battery()``: True on battery, False on mains, None without a battery."""

    others_cpu_percent: Callable[[], Optional[float]]
    on_battery: Callable[[], Optional[bool]]
    running_programs: Callable[[], set[str]] = lambda: set()
    """Names of the programs running now (lower case)."""
    input_idle_s: Callable[[], Optional[float]] = lambda: None
    """Seconds since the user last touched keyboard or mouse; None where the desktop does not say."""


def psutil_probes(pid: Optional[int] = None) -> Probes:
    """Probes reading psutil: system-wide CPU minus this process tree's share; ``sensors_battery``."""
    import psutil

    me = psutil.Process(pid or os.getpid())
    cores = psutil.cpu_count() or 1
    tracked: dict[int, Any] = {}
    psutil.cpu_percent(None)  # the first call only starts the measurement

    def own_percent() -> float:
        total = 0.0
        try:
            procs = [me] + me.children(recursive=True)
        except psutil.Error:
            procs = [me]
        alive = set()
        for proc in procs:
            proc = tracked.setdefault(proc.pid, proc)
            alive.add(proc.pid)
            try:
                total += proc.cpu_percent(None)  # percent of one core since the last call
            except psutil.Error:
                pass
        for pid_ in set(tracked) - alive:
            del tracked[pid_]
        return total / cores

    def others() -> Optional[float]:
        system = psutil.cpu_percent(None)
        return max(0.0, system - own_percent())

    def battery() -> Optional[bool]:
        sensors = getattr(psutil, "sensors_battery", None)
        info = sensors() if sensors else None
        if info is None or info.power_plugged is None:
            return None
        return not info.power_plugged

    def programs() -> set[str]:
        names = set()
        for proc in psutil.process_iter(["name"]):
            name = proc.info.get("name")
            if name:
                names.add(name.lower())
        return names

    own_percent()
    return Probes(others, battery, programs, x11_input_idle_s)


def x11_input_idle_s() -> Optional[float]:
    """Input idle time of the X11 session in ``$DISPLAY`` via ``xprintidle`` (milliseconds); None without either."""
    import shutil
    import subprocess

    if not os.environ.get("DISPLAY") or not shutil.which("xprintidle"):
        return None
    try:
        out = subprocess.run(["xprintidle"], capture_output=True, text=True, timeout=5)
        return int(out.stdout.strip()) / 1000.0 if out.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


class RuleEnforcer:
    """Pauses and resumes ``gate`` (reasons ``cpu_busy`` and ``battery``) by ``rules`` and ``probes``."""

    def __init__(self, rules: VolunteerRules, gate: Any, probes: Probes, clock: Callable[[], float] = time.monotonic):
        self.rules = rules
        self.gate = gate
        self.probes = probes
        self.clock = clock
        self.samples: collections.deque[tuple[float, float]] = collections.deque()
        self.others_cpu_percent: Optional[float] = None
        """Mean CPU use of other programs over the window (None before the first sample)."""
        self.on_battery: Optional[bool] = None
        self._idle_unknown_logged = False
        self.snoozed_until: Optional[float] = None
        """Unix time a snooze ends (None: not snoozed)."""
        self.wall: Callable[[], float] = time.time

    def snooze(self, until: Optional[float]) -> bool:
        """Pause until Unix time ``until`` (None lifts a snooze); True if the gate changed."""
        self.snoozed_until = until
        if until is None or until <= self.wall():
            self.snoozed_until = None
            return self.gate.resume(SNOOZE_REASON)
        when = time.strftime("%a %H:%M", time.localtime(until))
        return self.gate.pause(SNOOZE_REASON, f"snoozed until {when}")

    def set_rules(self, rules: VolunteerRules) -> None:
        """New rules; a rule switched off lifts its pause now."""
        self.rules = rules
        if not rules.pause_when_cpu_busy_percent:
            self.gate.resume(CPU_REASON)
        if not rules.pause_on_battery:
            self.gate.resume(BATTERY_REASON)
        if not rules.pause_while_programs:
            self.gate.resume(PROGRAMS_REASON)
        if not rules.pause_while_user_active_s:
            self.gate.resume(ACTIVE_REASON)

    def _programs_and_user(self) -> None:
        rules = self.rules
        if rules.pause_while_programs:
            wanted = {p.lower() for p in rules.pause_while_programs}
            running = sorted(wanted & self.probes.running_programs())
            if running:
                if self.gate.pause(PROGRAMS_REASON, f"{', '.join(running)} running"):
                    logger.info("%s running: pausing", ", ".join(running),
                                extra={"event": "rule_pause", "rule": PROGRAMS_REASON, "programs": running})
            elif self.gate.resume(PROGRAMS_REASON):
                logger.info("no listed program runs: training again",
                            extra={"event": "rule_resume", "rule": PROGRAMS_REASON})
        if rules.pause_while_user_active_s:
            idle = self.probes.input_idle_s()
            if idle is None:
                if not self._idle_unknown_logged:
                    self._idle_unknown_logged = True
                    logger.info("pause_while_user_active_s: this desktop does not tell the input idle time (X11 with "
                                "xprintidle does); the rule is inactive")
            elif idle < rules.pause_while_user_active_s:
                if self.gate.pause(ACTIVE_REASON, f"the computer is in use (input {idle:.0f} s ago)"):
                    logger.info("the computer is in use: pausing",
                                extra={"event": "rule_pause", "rule": ACTIVE_REASON, "idle_s": round(idle, 1)})
            elif self.gate.resume(ACTIVE_REASON):
                logger.info("the computer is idle (%.0f s): training again", idle,
                            extra={"event": "rule_resume", "rule": ACTIVE_REASON, "idle_s": round(idle, 1)})

    def step(self) -> None:
        """Take one sample of each probe and pause or resume the gate."""
        now = self.clock()
        rules = self.rules
        self.on_battery = self.probes.on_battery()
        if rules.pause_on_battery and self.on_battery:
            if self.gate.pause(BATTERY_REASON, "the machine runs on battery"):
                logger.info("on battery: pausing", extra={"event": "rule_pause", "rule": BATTERY_REASON})
        elif self.gate.resume(BATTERY_REASON):
            logger.info("on mains power: training again", extra={"event": "rule_resume", "rule": BATTERY_REASON})
        self._programs_and_user()
        if self.snoozed_until is not None and self.wall() >= self.snoozed_until:
            self.snoozed_until = None
            if self.gate.resume(SNOOZE_REASON):
                logger.info("the snooze is over: training again", extra={"event": "rule_resume",
                                                                        "rule": SNOOZE_REASON})
        value = self.probes.others_cpu_percent()
        if value is not None:
            self.samples.append((now, float(value)))
        while self.samples and self.samples[0][0] < now - rules.cpu_busy_window_s:
            self.samples.popleft()
        if not self.samples:
            return
        mean = sum(v for _, v in self.samples) / len(self.samples)
        self.others_cpu_percent = mean
        threshold = rules.pause_when_cpu_busy_percent
        if not threshold:
            self.gate.resume(CPU_REASON)
            return
        covered = now - self.samples[0][0] >= 0.5 * rules.cpu_busy_window_s  # not on one spike at start
        if covered and mean > threshold:
            if self.gate.pause(CPU_REASON, f"other programs use {mean:.0f}% of the CPU (limit {threshold:.0f}%)"):
                logger.info("other programs keep the CPU busy (%.0f%% > %.0f%%): pausing", mean, threshold,
                            extra={"event": "rule_pause", "rule": CPU_REASON, "percent": round(mean, 1)})
        elif mean <= threshold - CPU_HYSTERESIS and self.gate.resume(CPU_REASON):
            logger.info("the CPU is free again (%.0f%%): training again", mean,
                        extra={"event": "rule_resume", "rule": CPU_REASON, "percent": round(mean, 1)})

    async def run(self, sample_s: float = SAMPLE_S,
                  sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        """Sample every ``sample_s`` seconds until cancelled."""
        while True:
            try:
                self.step()
            except Exception:  # boundary: a probe failing (e.g. /proc unreadable) must not stop the daemon
                logger.debug("volunteer rule probe failed", exc_info=True)
            await sleep(sample_s)
