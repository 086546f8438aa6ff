"""What a person reads: times, sizes and durations instead of raw numbers, no Python reprs,
progress lines only on a terminal, shell completion."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

from kvctl import render
from kvctl.cmd_agent import jobs_list
from kvctl.cmd_core import render_config, render_status
from kvctl.cmd_maintenance import render_defrag, render_failover

ROOT = Path(__file__).resolve().parents[2]


def test_times_sizes_and_durations_by_key() -> None:
    now = time.time()
    text = render.kv({"since": now - 62, "shadow_bytes": 3 << 20, "uptime_s": 3725.0,
                      "ttft_s": 0.012, "fragmentation": 0.25, "count": 7,
                      "next_run": "2026-12-01T14:43:03.917101+00:00",
                      "nested": {"written_at": now - 5, "bytes": 2048}})
    assert "e+0" not in text and "1.7" not in text.split("since:")[1].split("\n")[0][:4]
    assert "(1m 2s ago)" in text and "3.0 MiB" in text and "1h 2m" in text
    assert "12 ms" in text and "25.0%" in text and "count:         7" in text
    assert "2026-12-01" in text and "T14:43" not in text and "2.0 KiB" in text
    assert render.cell(1.796e9) == "1796000000" and render.cell(0.1234567) == "0.1235"
    assert render.cell({"a": 1, "b_bytes": 1024}) == "a 1, b_bytes 1.0 KiB"


def test_failover_and_defrag_read_as_sentences() -> None:
    fo = render_failover({"serving": "shadow", "since": time.time() - 90, "reason": "ENOSPC",
                          "shadow_blocks": 3, "shadow_bytes": 1 << 20,
                          "shadow_capacity_bytes": 16 << 20, "shadow_fill": 0.0625,
                          "good_probes": 1, "failback_after": 3})
    assert "e+09" not in fo and "(1m 30s ago)" in fo
    d = render_defrag({"dry_run": False, "results": [
        {"tier": "cold", "before": {"segments": {"sealed": 3}, "live_bytes": 10 << 20,
                                    "dead_bytes": 30 << 20},
         "after": {"segments": {"sealed": 1}, "live_bytes": 10 << 20, "dead_bytes": 0},
         "compaction": 30 << 20}]})
    assert "{" not in d and "'" not in d
    assert "reclaimed 30.0 MiB; before 3 segments, 10.0 MiB live, 30.0 MiB dead" in d


def test_config_show_writes_modes_in_octal_and_sizes_readably() -> None:
    out = render_config({"path": "/etc/kvagentd/kvagentd.toml", "reloadable": [],
                         "config": {"control": {"socket_mode": 0o660},
                                    "kv": {"hot_bytes": 268435456}}})
    assert "socket_mode = 0o660" in out and "432" not in out
    assert "hot_bytes = 268435456  # 256.0 MiB" in out
    assert tomllib.loads(out) == {"control": {"socket_mode": 432},
                                  "kv": {"hot_bytes": 268435456}}


def test_jobs_list_shows_schedules_and_local_times(monkeypatch, capsys) -> None:
    from apscheduler.schedulers.background import BackgroundScheduler

    from kvagentd.scheduling import jobs
    from kvagentd.scheduling.cron import trigger

    s = BackgroundScheduler(timezone="UTC")
    s.add_job(print, "interval", seconds=3, id="agent.tick.p")
    s.add_job(print, trigger("0 6 * * 1"), id="agent.weekly.p")
    s.start(paused=True)
    try:
        reply = {"jobs": jobs.list_jobs(s)}
    finally:
        s.shutdown(wait=False)
    assert [j["schedule"] for j in reply["jobs"]] == ["every 3 s", "cron 0 6 * * mon"]
    monkeypatch.setattr("kvctl.cmd_agent.call", lambda *a, **k: reply)
    jobs_list(None)  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert "every 3 s" in out and "cron 0 6 * * mon" in out
    assert "interval[" not in out and "day_of_week=" not in out and "+00:00" not in out


def test_progress_only_on_a_terminal() -> None:
    off = io.StringIO()
    with render.Progress("verifying", False, stream=off) as p:
        p.update(done=5, total=10)
    assert off.getvalue() == ""
    on = io.StringIO()
    with render.Progress("verifying", True, stream=on) as p:
        p.update(done=5, total=10)
        assert "[############............] 5/10" in p.line()
    text = on.getvalue()
    assert "\rverifying  [############............] 5/10" in text
    assert text.endswith("\r")  # the line is cleared at the end


def test_shell_completion_is_on() -> None:
    env = {**os.environ, "_KVCTL_COMPLETE": "complete_bash", "COMP_WORDS": "kvctl health ",
           "COMP_CWORD": "2"}
    r = subprocess.run([sys.executable, "-m", "kvctl.main"], env=env, capture_output=True,
                       text=True, cwd=ROOT, timeout=60)
    assert "ack" in r.stdout.split()
    # NOTE: --show-completion finds the shell among its parent processes (an operator's
    # shell); run it from bash, so the test does not depend on how pytest was started
    shown = subprocess.run(["bash", "-c", f"{sys.executable} -m kvctl.main "
                            "--show-completion; true"],
                           capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert shown.returncode == 0 and "_KVCTL_COMPLETE" in shown.stdout


def test_status_says_how_many_cold_records_capacity_evicted() -> None:
    """Capacity eviction is routine once the cold tier is full: it is a count in the status
    (the log says it at debug level only), not a line every few writes."""
    text = render_status({"version": "x", "phase": "running", "store": {
        "tiers": {"hot": {"blocks": 1, "capacity": 4}, "warm": {"blocks": 0, "capacity": 4},
                  "cold": {"blocks": 530, "bytes_used": 512 << 20, "capacity_bytes": 512 << 20,
                           "codec": "raw", "evicted": 1234}}}})
    (line,) = [x for x in text.splitlines() if x.startswith("cold ")]
    assert "530 blocks" in line and "evicted 1234" in line and "512.0 MiB of 512.0 MiB" in line


def test_a_velocity_key_is_not_read_as_seconds() -> None:
    lines = dict(line.split(":", 1) for line in
                 render.kv({"rms_mm_s": 0.94, "ttft_s": 0.5, "peak_m_s2": 12.0}).splitlines())
    assert lines["rms_mm_s"].strip() == "0.94 mm/s"  # it read "0.9s" (a duration)
    assert lines["ttft_s"].strip() == "0.5s"  # a duration stays one
    assert lines["peak_m_s2"].strip() == "12 m/s²"


def test_status_shows_the_ssd_write_budget() -> None:
    text = render_status({"version": "x", "phase": "running", "store": {
        "tiers": {"cold": {"blocks": 1}},
        "write_budget": {"bytes_per_day": 10 * 1000**3, "available_bytes": 1 << 20,
                         "written_bytes": 5 << 20, "written_per_day_bytes": 2 * 1000**3,
                         "refused_bytes": 3 << 20}}})
    (line,) = [x for x in text.splitlines() if x.startswith("ssd ")]
    assert "written 5.0 MiB" in line and "budget 9.3 GiB/day" in line
    assert "1.0 MiB left now" in line and "refused 3.0 MiB" in line
