"""JSON log lines with structured ``extra`` fields, and the status records peers publish."""

import io
import json
import logging
import time

import pytest

from peerd.identity.namespace import RunNamespace
from peerd.status.records import KNOWN_STATUS_FIELDS, STATUS_VERSION, make_status
from peerd.runtime.telemetry import JsonFormatter

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def json_log():
    """A private logger writing JSON lines into a buffer; returns (logger, read_records)."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("peerd.test_telemetry")
    logger.handlers[:] = [handler]
    logger.setLevel(logging.DEBUG)
    logger.propagate = False

    def records():
        lines = stream.getvalue().splitlines()
        return [json.loads(line) for line in lines]

    yield logger, records
    logger.handlers.clear()
    logger.propagate = True


def test_one_json_object_per_record_with_extra_fields(json_log):
    logger, records = json_log
    before = time.time()
    logger.info("outer round %d done in %.1f s", 3, 2.25,
                extra={"event": "outer_round", "outer_round": 3, "group_size": 4, "digest": "ab12", "loss": None,
                       "peers": ["a", "b"]})
    logger.warning("banned %s", "peerX", extra={"event": "ban", "peer": "peerX"})
    logger.debug("plain line")
    out = records()
    assert len(out) == 3

    first = out[0]
    assert first["message"] == "outer round 3 done in 2.2 s"
    assert first["level"] == "INFO"
    assert first["logger"] == "peerd.test_telemetry"
    assert before - 1 <= first["time"] <= time.time() + 1
    assert {k: first[k] for k in ("event", "outer_round", "group_size", "digest", "loss", "peers")} == {
        "event": "outer_round", "outer_round": 3, "group_size": 4, "digest": "ab12", "loss": None, "peers": ["a", "b"]
    }

    # hivemind, once imported, renames WARNING to "WARN" process-wide; the formatter keeps the standard name
    assert out[1]["level"] == "WARNING"
    assert out[1]["event"] == "ban" and out[1]["peer"] == "peerX"
    assert out[1]["message"] == "banned peerX"
    # a record without extra has exactly the base fields
    assert set(out[2]) == {"time", "level", "logger", "message"} and out[2]["level"] == "DEBUG"


def test_standard_record_attributes_are_not_leaked(json_log):
    logger, records = json_log
    logger.info("hello %s", "world", extra={"event": "x"})
    (record,) = records()
    for internal in ("msg", "args", "levelno", "pathname", "lineno", "funcName", "created", "msecs", "thread",
                     "process", "module", "exc_info", "exc_text", "stack_info", "levelname", "name"):
        assert internal not in record
    assert set(record) == {"time", "level", "logger", "message", "event"}


def test_non_json_extra_values_are_stringified(json_log):
    logger, records = json_log

    class Peer:
        def __str__(self):
            return "<peer 12D3KooW>"

    logger.info("x", extra={"peer": Peer(), "ids": {7}, "raw": b"\x01"})
    (record,) = records()
    assert record["peer"] == "<peer 12D3KooW>"
    assert record["ids"] == "{7}"
    assert record["raw"] == str(b"\x01")


def test_exceptions_are_included(json_log):
    logger, records = json_log
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logger.exception("failed", extra={"event": "crash"})
    (record,) = records()
    assert record["level"] == "ERROR" and record["message"] == "failed" and record["event"] == "crash"
    assert "RuntimeError: boom" in record["exc"] and "Traceback" in record["exc"]


def test_each_record_is_a_single_line(json_log):
    logger, records = json_log
    logger.info("line one\nline two", extra={"text": "a\nb"})
    logger.info("next")
    out = records()
    assert len(out) == 2
    assert out[0]["message"] == "line one\nline two" and out[0]["text"] == "a\nb"


# -------------------------------------------------------------------------------------------------------------- status


def test_make_status_fills_missing_fields_with_none():
    before = time.time()
    record = make_status(role="worker", outer_round=2)
    assert set(record) == set(KNOWN_STATUS_FIELDS) | {"time", "v"} and record["v"] == STATUS_VERSION
    assert record["role"] == "worker" and record["outer_round"] == 2
    for name in KNOWN_STATUS_FIELDS:
        if name not in ("role", "outer_round"):
            assert record[name] is None, name
    assert before <= record["time"] <= time.time()


def test_make_status_with_every_field():
    values = {"role": "worker", "outer_round": 5, "inner_step": 7, "loss": 2.5, "tokens_per_s": 1000.0,
              "eval_nats_per_byte": 1.9, "digest": "0123456789abcdef", "instance": "fedcba9876543210", "stage": 1,
              "fragment_rounds": [3, 2], "fragment_digests": ["0123456789abcdef", "fedcba9876543210"],
              "history": {"loss": [[1.0, 100, 2.5, 1000.0]], "eval": [[1.0, 100, 1.9]]},
              "reachable": True, "relayed": False, "round_retries": {"model": [5, 1]}, "experts": [1, 4],
              "tokens_trained": 12800, "rounds_contributed": 5}
    assert set(values) == set(KNOWN_STATUS_FIELDS)
    record = make_status(**values)
    assert {k: record[k] for k in KNOWN_STATUS_FIELDS} == values
    assert isinstance(record["time"], float)


@pytest.mark.parametrize("unknown", [{"rolee": "worker"}, {"time": 1.0}, {"role": "w", "extra": 1, "other": 2}])
def test_make_status_rejects_unknown_fields(unknown):
    with pytest.raises(ValueError) as info:
        make_status(**unknown)
    for name in set(unknown) - set(KNOWN_STATUS_FIELDS):
        assert name in str(info.value)


def test_dht_keys_are_per_run():
    r1, r2 = RunNamespace.of("r1"), RunNamespace.of("r2")
    assert r1.status_key != r2.status_key and "r1" in r1.status_key
    assert r1.config_key != r1.status_key and "r1" in r1.config_key


def test_a_multi_line_message_is_one_log_line_with_its_time_and_level():
    """go-libp2p's dial errors list one address per line: each log record stays one line of the text log."""
    from peerd.runtime.telemetry import TextFormatter

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    log = logging.getLogger("peerd.test.multiline")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("stage 1 call to %s failed: %s", "12D3KooWabc", "failed to dial 12D3KooWabc:\n"
                    "  * [/ip4/127.0.0.1/tcp/4001] dial tcp4 127.0.0.1:4001: connect: connection refused\n"
                    "  * [/ip4/10.0.0.2/tcp/4001] dial backoff\n")
    finally:
        log.removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and " WARNING peerd.test.multiline: stage 1 call to 12D3KooWabc failed" in lines[0]
    assert lines[0].endswith("failed to dial 12D3KooWabc:; [/ip4/127.0.0.1/tcp/4001] dial tcp4 127.0.0.1:4001: "
                             "connect: connection refused; [/ip4/10.0.0.2/tcp/4001] dial backoff"), lines[0]
