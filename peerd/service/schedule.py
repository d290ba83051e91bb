"""Active hours: the local-time windows in which a volunteer's peer trains.

A pure core (:class:`ActiveHours`: parse, ``is_active``, ``seconds_until_change``; no clock of its own) and a small
async enforcer that pauses and resumes a :class:`peerd.service.pause.PauseGate` on a clock it is handed, so tests drive it
with a fake clock.
"""

from __future__ import annotations

import asyncio
import logging
import re
from datetime import datetime
from typing import Any, Awaitable, Callable

from peerd.node_values import ActiveHours  # noqa: F401 (the windows it enforces; re-exported)

logger = logging.getLogger(__name__)

SCHEDULE_REASON = "schedule"


async def enforce_active_hours(
    hours: ActiveHours,
    gate: Any,
    now: Callable[[], datetime] = datetime.now,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    max_sleep_s: float = 60.0,
) -> None:
    """Forever: pause ``gate`` (reason ``"schedule"``) outside ``hours`` and lift that pause inside them.

    Re-checks at each window boundary and at least every ``max_sleep_s`` (a suspended laptop or a clock change).
    """
    while True:
        when = now()
        if hours.is_active(when):
            if gate.resume(SCHEDULE_REASON):
                logger.info("inside active hours %s: training again", hours.spec)
        elif gate.pause(SCHEDULE_REASON, f"outside active hours {hours.spec}"):
            logger.info("outside active hours %s: leaving rounds and pausing", hours.spec)
        await sleep(min(max_sleep_s, max(1.0, hours.seconds_until_change(when))))
