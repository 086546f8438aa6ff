from __future__ import annotations

import io
import json
import logging

import structlog

import pytest

from kvagentd.daemon import log as logsetup


@pytest.fixture(autouse=True)
def _restore_logging():
    yield
    root = logging.getLogger()
    for h in list(root.handlers):
        if h.get_name() == "kvagentd":
            root.removeHandler(h)
    root.setLevel(logging.WARNING)
    structlog.reset_defaults()


def _lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_lines_with_structured_traceback_and_stdlib_records() -> None:
    out = io.StringIO()
    logsetup.configure("info", "auto", stream=out)  # StringIO is not a tty -> JSON
    log = structlog.get_logger("kvagentd.test")
    log.info("block_moved", key="ab", tier="warm")
    log.debug("hidden")
    try:
        raise ValueError("bad block")
    except ValueError as exc:
        log.error("verify_failed", exc_info=exc)
    logging.getLogger("apscheduler.scheduler").warning("job %s missed", "tick")
    lines = _lines(out)
    assert lines[0]["event"] == "block_moved" and lines[0]["tier"] == "warm"
    assert lines[0]["level"] == "info" and lines[0]["logger"] == "kvagentd.test"
    assert "timestamp" in lines[0]
    assert all(line["event"] != "hidden" for line in lines)
    exc = lines[1]["exception"][0]
    assert exc["exc_type"] == "ValueError" and exc["exc_value"] == "bad block"
    assert exc["frames"] and "locals" not in exc["frames"][0]
    assert lines[2] == {**lines[2], "event": "job tick missed", "logger": "apscheduler.scheduler"}


def test_set_level_changes_live() -> None:
    out = io.StringIO()
    logsetup.configure("warning", "json", stream=out)
    log = structlog.get_logger("kvagentd.test")
    log.info("before")
    logsetup.set_level("debug")
    log.debug("after")
    assert [line["event"] for line in _lines(out)] == ["after"]


def test_console_format_is_not_json() -> None:
    out = io.StringIO()
    logsetup.configure("info", "console", stream=out)
    structlog.get_logger("kvagentd.test").info("hello", n=1)
    text = out.getvalue()
    assert "hello" in text and "n=1" in text and not text.startswith("{")


def test_configure_twice_keeps_one_handler() -> None:
    logsetup.configure("info", "json", stream=io.StringIO())
    logsetup.configure("info", "json", stream=io.StringIO())
    assert sum(h.get_name() == "kvagentd" for h in logging.getLogger().handlers) == 1
