"""Volunteer rules that BOINC and Folding@home users expect, enforced on the daemon's pause gate.

- ``pause_when_cpu_busy_percent``: pause while *other* programs keep the CPU busy above a threshold (percent of
  all cores, averaged over ``cpu_busy_window_s``); resume once they are :data:`CPU_HYSTERESIS` points below it.
  This daemon's own processes (its DHT child and p2pd included) are not counted, so pausing does not feed back.
- ``pause_on_battery``: pause while the machine runs on battery.
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

    @classmethod
    def from_node(cls, node: Any) -> "VolunteerRules":
        return cls(node.pause_when_cpu_busy_percent, node.cpu_busy_window_s, node.pause_on_battery)

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
            else:
                raise ValueError(f"unknown rule {key!r} (pause_when_cpu_busy_percent, cpu_busy_window_s, "
                                 "pause_on_battery)")
        return replace(self, **out)


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

    own_percent()
    return Probes(others, battery)


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

    def set_rules(self, rules: VolunteerRules) -> None:
        """New rules; a rule switched off lifts its pause now."""
        self.rules = rules
        if not rules.pause_when_cpu_busy_percent:
            self.gate.resume(CPU_REASON)
        if not rules.pause_on_battery:
            self.gate.resume(BATTERY_REASON)

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
            except Exception:  # a probe failing (e.g. /proc unreadable) must not stop the daemon
                logger.debug("volunteer rule probe failed", exc_info=True)
            await sleep(sample_s)
