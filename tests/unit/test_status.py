"""peerd/status/records.py: status records that can evolve (a version field, unknown fields ignored, old records read)."""

import time

import pytest

from peerd.status.records import (
    KNOWN_STATUS_FIELDS,
    STATUS_FIELDS,
    STATUS_VERSION,
    StatusFilter,
    make_status,
    status_problem,
)

pytestmark = pytest.mark.timeout(10)

#: A record as peers wrote it before the version field existed (version 0).
OLD = {"role": "diloco", "outer_round": 3, "inner_step": 40, "loss": 2.5, "tokens_per_s": 900.0,
       "eval_nats_per_byte": None, "digest": "ab" * 8, "time": 1.7e9}


def test_records_carry_a_version_and_the_known_optional_instance():
    record = make_status(role="diloco", outer_round=1, instance="3f9a0c")
    assert record["v"] == STATUS_VERSION >= 1 and record["instance"] == "3f9a0c"
    assert set(record) == set(KNOWN_STATUS_FIELDS) | {"time", "v"} and status_problem(record) is None
    with pytest.raises(ValueError, match="hardware"):
        make_status(role="diloco", hardware="gpu")  # a writer sends only fields it knows


def test_records_may_carry_the_stage_a_swarm_server_serves():
    record = make_status(role="swarm", outer_round=0, stage=1)
    assert status_problem(record) is None and StatusFilter()({"p": record})["p"]["stage"] == 1
    assert StatusFilter()({"old": OLD})["old"]["stage"] is None  # records of peers that predate the field


def test_an_old_record_without_version_is_read():
    assert status_problem(OLD) is None
    kept = StatusFilter()({"old": OLD})
    assert kept["old"]["v"] == 0 and kept["old"]["instance"] is None
    assert {k: kept["old"][k] for k in OLD} == OLD


def test_a_record_with_an_unknown_field_is_read_and_the_field_ignored():
    newer = {**make_status(role="diloco", outer_round=2), "hardware": "gpu", "v": STATUS_VERSION + 1,
             "anything": {"nested": [1, 2]}}
    assert status_problem(newer) is None
    f = StatusFilter()
    kept = f({"new": newer})["new"]
    assert "hardware" not in kept and "anything" not in kept and kept["outer_round"] == 2
    assert f.dropped == 0


@pytest.mark.parametrize("field, value", [
    ("role", 5), ("outer_round", "2"), ("inner_step", -1), ("loss", float("nan")), ("digest", 12),
    ("instance", 12), ("instance", "x" * 65), ("stage", -1), ("stage", "0"), ("stage", True), ("time", "now"), ("v", 1.5), ("v", True),
    ("round_retries", {"model": [1]}), ("round_retries", {"model": [1, -1]}), ("round_retries", {}),
    ("round_retries", [[1, 1]]), ("round_retries", {"x" * 65: [1, 1]}),
    ("fragment_digests", []), ("fragment_digests", ["ab", 3]), ("fragment_digests", ["x" * 65]),
    ("fragment_digests", "0123"),
])
def test_a_record_with_a_wrong_typed_known_field_is_dropped(field, value):
    for base in (OLD, make_status(role="diloco")):
        bad = {**base, field: value}
        problem = status_problem(bad)
        assert problem is not None and field in problem
        f = StatusFilter()
        assert f({"p": bad}) == {} and f.dropped == 1


def test_a_record_missing_a_version_0_field_is_dropped():
    for name in STATUS_FIELDS + ("time",):
        bad = {k: v for k, v in OLD.items() if k != name}
        assert name in (status_problem(bad) or ""), name
    assert status_problem({k: v for k, v in make_status(role="x").items() if k != "instance"}) is None
    assert time.time() - make_status(role="x")["time"] < 5
