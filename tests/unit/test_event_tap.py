"""Log formats (human-readable by default, JSON lines for shippers) and the event bus that feeds logs, metrics and
health."""

import json
import logging
import re

import pytest

from peerd.events import EventBus, LogEvents, Paused, RoundDone, RoundFailed
from peerd.service.health import DaemonState
from peerd.runtime.telemetry import setup_logging

pytestmark = pytest.mark.timeout(30)


class Stderr:
    def __init__(self, capsys):
        self.capsys = capsys
        self.text = ""

    def getvalue(self) -> str:
        self.text += self.capsys.readouterr().err
        return self.text


@pytest.fixture
def stderr(capsys, monkeypatch):
    """What setup_logging's handler writes (to the sys.stderr of its call: capsys's); restores the root logger. The
    level is setup_logging's own default (INFO), whatever PEERD_LOGLEVEL the suite runs under."""
    monkeypatch.delenv("PEERD_LOGLEVEL", raising=False)
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, logging.getLogger("peerd").level)
    yield Stderr(capsys)
    root.handlers[:], root.level = saved[0], saved[1]
    logging.getLogger("peerd").setLevel(saved[2])


def test_text_is_the_default_and_human_readable(stderr):
    setup_logging()
    logging.getLogger("peerd.x").info("outer round %d done", 3, extra={"event": "outer_round", "outer_round": 3})
    line = stderr.getvalue().strip()
    assert re.fullmatch(r"\d\d:\d\d:\d\d INFO peerd\.x: outer round 3 done", line), line


def test_json_lines_carry_the_event_fields(stderr):
    setup_logging("json")
    logging.getLogger("peerd.x").info("paused", extra={"event": "paused", "reasons": {"user": "by hand"}})
    record = json.loads(stderr.getvalue())
    assert record["event"] == "paused" and record["reasons"] == {"user": "by hand"} and record["level"] == "INFO"


def _done(outer_round: int) -> RoundDone:
    return RoundDone(outer_round, group_size=3, bytes_sent=10, bytes_received=20, allreduce_s=0.5, excluded={},
                     attempts=1, round_s=1.5, weight=8.0, inner_steps=4, dp_equivalent_bytes=100, digest="ab" * 8,
                     method="allreduce", eval_nats_per_byte=None, tokens=64)


def test_bus_reaches_subscribers_even_when_the_user_asked_for_warnings_only(stderr):
    setup_logging("text", "WARNING")
    seen = []
    bus = EventBus(LogEvents(), seen.append, lambda event: 1 / 0)  # a broken subscriber breaks nothing
    bus.publish(_done(2))
    logging.getLogger("peerd.roles.x").info("no event here")
    bus.publish(_done(3))
    logging.getLogger("peerd.roles.x").warning("careful")
    assert [e.outer_round for e in seen] == [2, 3] and seen[0].group_size == 3
    lines = stderr.getvalue().strip().splitlines()
    assert len([l for l in lines if "careful" in l]) == 1
    assert len([l for l in lines if "event subscriber" in l and "failed" in l]) == 1  # said once, as a warning
    assert not [l for l in lines if "outer round" in l or "no event" in l]  # the user's level still holds


def test_log_subscriber_writes_the_events_fields_as_json_keys(stderr):
    setup_logging("json")
    bus = EventBus(LogEvents())
    bus.publish(_done(4))
    bus.publish(RoundFailed(4, "no group in time", "allreduce", "theta_outer unchanged"))
    bus.publish(Paused(4, {"user": "by hand"}, local_steps=2))
    done, failed, paused = (json.loads(line) for line in stderr.getvalue().strip().splitlines())
    assert done["event"] == "outer_round" and done["level"] == "INFO"
    for key, value in (("outer_round", 4), ("group_size", 3), ("bytes_sent", 10), ("allreduce_s", 0.5),
                       ("eval_nats_per_byte", None), ("digest", "ab" * 8), ("method", "allreduce")):
        assert done[key] == value, key
    assert done["message"].startswith("outer round 4 done: group 3")
    assert failed["event"] == "round_failed" and failed["level"] == "WARNING" and failed["reason"] == "no group in time"
    assert failed["message"] == "round 5 failed: no group in time; theta_outer unchanged"
    assert paused["event"] == "paused" and paused["reasons"] == {"user": "by hand"} and "local_steps" not in paused


def test_health_follows_typed_events():
    state = DaemonState(role="diloco", run_id="r", started_at=1000.0)
    bus = EventBus(lambda event: state.observe(event, now=1050.0))
    bus.publish(_done(1))
    assert state.rounds_completed == 1 and state.outer_round == 1 and state.last_round_at == 1050.0
