"""The registry's database outage log: one line per failure kind at most every `every_s`
seconds (with how many it left out), one line when the database is back; nothing else."""

from __future__ import annotations

import logging

import pytest

from shoal.services.registry.outage import OutageLog


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "outage-test"]


def test_one_line_per_kind_per_interval_and_one_when_back(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="outage-test")
    clock = _Clock()
    outage = OutageLog(logging.getLogger("outage-test"), every_s=30.0, clock=clock)
    refused = ConnectionRefusedError(111, "Connect call failed\n('127.0.0.1', 5432)")
    logged = [outage.failed("heartbeat", refused)]
    for _ in range(99):  # a heartbeat storm within the interval: nothing more
        clock.now += 0.1
        logged.append(outage.failed("heartbeat", refused))
    assert logged == [True] + [False] * 99
    assert outage.failed("registry requests", TimeoutError("timed out"))  # another kind
    clock.now = 100.0 + 30.0
    assert outage.failed("heartbeat", refused)  # the interval is over
    assert outage.down and outage.recovered() and not outage.recovered()  # once
    assert outage.failed("heartbeat", refused)  # a new outage is reported at once
    lines = _lines(caplog)
    assert lines == [
        "the database is unavailable: ConnectionRefusedError: [Errno 111] Connect call failed "
        "('127.0.0.1', 5432) (heartbeat)",
        "the database is unavailable: TimeoutError: timed out (registry requests)",
        "the database is unavailable: ConnectionRefusedError: [Errno 111] Connect call failed "
        "('127.0.0.1', 5432) (heartbeat; 99 more like it since the last report)",
        "the database is back after 30 s (102 failed calls)",
        "the database is unavailable: ConnectionRefusedError: [Errno 111] Connect call failed "
        "('127.0.0.1', 5432) (heartbeat)",
    ]
    assert all(r.exc_info is None for r in caplog.records)  # no traceback


def test_nothing_is_logged_without_an_outage(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="outage-test")
    outage = OutageLog(logging.getLogger("outage-test"), clock=_Clock())
    assert not outage.recovered() and not outage.down
    assert _lines(caplog) == []
