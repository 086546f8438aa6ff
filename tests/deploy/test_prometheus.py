"""deploy/prometheus: the alert rules pass `promtool check rules` and their unit tests
(`promtool test rules`), the scrape config passes `promtool check config`, and every metric the
rules and their test series name is one the daemon exports."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.conftest import DEPLOY, promtool, sample_names

PROM = DEPLOY / "prometheus"
RULES = PROM / "kvagentd.rules.yml"
METRIC = re.compile(r"\b((?:kvagentd|process)_[a-z0-9_]+)\b")
# Made by Prometheus itself, not by the daemon.
PROMETHEUS_MADE = {"up"}


def run_promtool(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=120, check=False)


def _rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def test_rules_pass_promtool_check() -> None:
    r = run_promtool("check", "rules", RULES)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in r.stdout


def test_rule_unit_tests_pass() -> None:
    tests = sorted((PROM / "tests").glob("*.yml"))
    assert tests, "no promtool unit tests under deploy/prometheus/tests"
    r = run_promtool("test", "rules", *tests)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("SUCCESS") == len(tests), r.stdout


def test_every_alert_has_a_unit_test_that_fires_it() -> None:
    fired: set[str] = set()
    for path in (PROM / "tests").glob("*.yml"):
        for case in yaml.safe_load(path.read_text())["tests"]:
            for t in case.get("alert_rule_test", ()):
                if t.get("exp_alerts"):
                    fired.add(t["alertname"])
    alerts = {r["alert"] for r in _rules() if "alert" in r}
    assert alerts - fired == set()


def test_a_broken_rule_is_refused(tmp_path: Path) -> None:
    """The checks above can fail: promtool refuses an expression that does not parse and a
    unit test whose expected alert does not fire."""
    bad = tmp_path / "bad.rules.yml"
    bad.write_text("groups:\n  - name: x\n    rules:\n      - alert: X\n"
                   "        expr: sum(rate(kvagentd_agent_ticks_total[5m])\n")
    assert run_promtool("check", "rules", bad).returncode != 0
    unit = tmp_path / "t.yml"
    unit.write_text(f"rule_files: [{RULES}]\nevaluation_interval: 1m\ntests:\n"
                    "  - interval: 1m\n    input_series:\n"
                    "      - series: 'kvagentd_asset_zone{asset=\"p\"}'\n        values: '1x10'\n"
                    "    alert_rule_test:\n      - eval_time: 10m\n        alertname: KvagentdZoneD\n"
                    "        exp_alerts: [{exp_labels: {severity: critical, asset: p}}]\n")
    r = run_promtool("test", "rules", unit)
    assert r.returncode != 0 and "FAILED" in r.stdout + r.stderr


def test_scrape_config_passes_promtool_check() -> None:
    r = run_promtool("check", "config", PROM / "prometheus.yml", cwd=PROM)
    assert r.returncode == 0, r.stdout + r.stderr
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    assert "kvagentd.rules.yml" in config["rule_files"]
    # the rules select job="kvagentd": the example's job must be that one
    assert [j["job_name"] for j in config["scrape_configs"]] == ["kvagentd"]


def test_rules_and_their_tests_name_only_exported_metrics(exposition: str) -> None:
    exported = sample_names(exposition)
    named = {m for r in _rules() for m in METRIC.findall(r["expr"])}
    for path in (PROM / "tests").glob("*.yml"):
        for case in yaml.safe_load(path.read_text())["tests"]:
            named |= {m for s in case.get("input_series", ()) for m in METRIC.findall(s["series"])}
    assert named, "no metric found in the rules"
    assert named - exported == set()


def test_rules_use_the_label_values_the_daemon_exports(exposition: str) -> None:
    """Label values a rule matches on exist: the cold tier's `shadow`, the SSD states, fault
    kinds other than `none`, and `sensor:` checks."""
    for line in ('kvagentd_cold_serving{tier="shadow"}', 'kvagentd_ssd_health{state="worn"}',
                 'kvagentd_ssd_health{state="failed"}', 'kvagentd_asset_fault{asset="pump-1",'
                 'kind="none"}', 'kvagentd_health_check_status{check="sensor:pump-1"}'):
        assert line in exposition, line


def test_the_exposition_has_no_created_series(exposition: str) -> None:
    assert "kvagentd_agent_ticks_total" in exposition
    assert "_created" not in exposition
