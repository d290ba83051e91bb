"""Log formats (human-readable by default, JSON lines for shippers) and the event tap that feeds metrics and health."""

import json
import logging
import re

import pytest

from peerd.telemetry import EventTap, setup_logging

pytestmark = pytest.mark.timeout(30)


class Stderr:
    def __init__(self, capsys):
        self.capsys = capsys
        self.text = ""

    def getvalue(self) -> str:
        self.text += self.capsys.readouterr().err
        return self.text


@pytest.fixture
def stderr(capsys):
    """What setup_logging's handler writes (to the sys.stderr of its call: capsys's); restores the root logger."""
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


def test_tap_sees_info_events_even_when_the_user_asked_for_warnings_only(stderr):
    setup_logging("text", "WARNING")
    seen = []
    tap = EventTap(seen.append, lambda event: 1 / 0)  # a broken subscriber must not break logging or the others
    tap.attach()
    try:
        log = logging.getLogger("peerd.roles.x")
        log.info("round done", extra={"event": "outer_round", "outer_round": 2, "group_size": 3})
        log.info("no event here")
        log.info("round done again", extra={"event": "outer_round", "outer_round": 3, "group_size": 3})
        log.warning("careful")
    finally:
        tap.detach()
    assert [e["outer_round"] for e in seen] == [2, 3] and seen[0]["group_size"] == 3
    lines = stderr.getvalue().strip().splitlines()
    assert len([l for l in lines if "careful" in l]) == 1
    assert len([l for l in lines if "event subscriber" in l and "failed" in l]) == 1  # said once, as a warning
    assert not [l for l in lines if "round done" in l or "no event" in l]  # the user's level still holds
    assert logging.getLogger("peerd").level == logging.NOTSET  # detach restored it
