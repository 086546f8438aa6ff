"""Schedules: crontab expressions (weekday numbers as crontab means them), the short form, and
the errors that name the field; check-config refuses a bad schedule with exit 78."""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from kvagentd.scheduling import cron
from kvagentd.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
MONDAY = datetime(2026, 11, 30).astimezone()  # a Monday, 00:00 local


def _fires(text: str, n: int = 3) -> list[datetime]:
    trig = cron.trigger(text)
    out, prev = [], None
    now = MONDAY
    for _ in range(n):
        t = trig.get_next_fire_time(prev, now)
        assert t is not None
        out.append(t)
        prev, now = t, t + timedelta(seconds=1)
    return out


@pytest.mark.parametrize("text,weekday,hour,minute", [
    ("0 6 * * 1", 0, 6, 0),      # crontab 1 = Monday (APScheduler 3 alone would say Tuesday)
    ("30 18 * * 5", 4, 18, 30),
    ("0 6 * * 0", 6, 6, 0),      # 0 and 7 are Sunday
    ("0 6 * * 7", 6, 6, 0),
    ("0 6 * * mon", 0, 6, 0),
    ("mon 06:00", 0, 6, 0),      # the short form
    ("sun 23:59", 6, 23, 59),
])
def test_weekday_numbers_follow_crontab(text: str, weekday: int, hour: int, minute: int) -> None:
    for t in _fires(text):
        assert (t.weekday(), t.hour, t.minute) == (weekday, hour, minute)


def test_ranges_lists_and_steps() -> None:
    assert {t.weekday() for t in _fires("0 6 * * 1-5", 10)} == {0, 1, 2, 3, 4}
    assert {t.weekday() for t in _fires("0 6 * * 5-0", 6)} == {4, 5, 6}
    assert {t.weekday() for t in _fires("0 6 * * */2", 8)} == {6, 1, 3, 5}  # sun tue thu sat
    assert [t.minute for t in _fires("*/15 6 * * *", 4)] == [0, 15, 30, 45]
    assert all(t.day == 1 and t.month == 1 for t in _fires("0 0 1 jan *", 2))


@pytest.mark.parametrize("text,field", [
    ("mon 25:00", "hour"),
    ("61 6 * * 1", "minute"),
    ("0 6 32 * *", "day of month"),
    ("0 6 * 13 *", "month"),
    ("0 6 * * 8", "day of week"),
    ("0 6 * * funday", "day of week"),
    ("0 6 * *", "fields"),
    ("every monday", "fields"),
    ("", "empty"),
])
def test_bad_schedules_say_which_field(text: str, field: str) -> None:
    with pytest.raises(cron.CronError, match=field):
        cron.trigger(text)


def test_config_checks_the_schedule_at_load(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text('[agent]\nweekly_report_cron = "0 6 * * 1"\n')
    assert str(load_config(p, env={}).agent.weekly_report_cron) == "0 6 * * 1"
    p.write_text('[agent]\nweekly_report_cron = "mon 25:00"\n')
    with pytest.raises(ConfigError) as exc:
        load_config(p, env={})
    assert exc.value.path == "agent.weekly_report_cron" and "hour" in exc.value.allowed
    with pytest.raises(ConfigError, match="agent.weekly_report_cron"):
        load_config(None, env={"KVAGENTD_AGENT__WEEKLY_REPORT_CRON": '"0 6 * *"'})


def test_check_config_exits_78_naming_the_field(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    for text, code in (('"0 6 * * 1"', 0), ('"mon 25:00"', 78), ('"0 6 * * 9"', 78)):
        # a hot tier this machine holds, so that only the schedule decides
        p.write_text(f"[kv]\nhot_bytes = \"64MiB\"\n[agent]\nweekly_report_cron = {text}\n")
        r = subprocess.run([sys.executable, "-m", "kvagentd", "check-config", str(p)],
                           capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert r.returncode == code, r.stderr
        if code:
            assert "agent.weekly_report_cron" in r.stderr
