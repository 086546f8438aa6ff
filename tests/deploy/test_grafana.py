"""deploy/grafana/kvagentd.json: every PromQL expression of the dashboard parses (promtool
checks them as recording rules, Grafana's variables replaced by values of their kind), every
metric it names is one the daemon exports, and it has the sections an operator looks for."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.conftest import DEPLOY, sample_names
from tests.deploy.test_prometheus import METRIC, PROMETHEUS_MADE, run_promtool

DASHBOARD = DEPLOY / "grafana" / "kvagentd.json"
LABEL_VALUES = re.compile(r"^label_values\((.+),\s*([a-zA-Z_]\w*)\)$")


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in panels:
        yield p
        yield from _panels(p.get("panels", []))


def _exprs() -> list[tuple[str, str]]:
    """(where, expression) of every query: panel targets and the variables' label_values."""
    out = []
    for p in _panels(_dashboard()["panels"]):
        for t in p.get("targets", []):
            out.append((f"panel {p['id']} {p['title']!r} {t['refId']}", t["expr"]))
    for v in _dashboard()["templating"]["list"]:
        if v["type"] == "query":
            m = LABEL_VALUES.match(v["query"]["query"])
            assert m, f"variable {v['name']}: not label_values(selector, label)"
            out.append((f"variable {v['name']}", m.group(1)))
    return out


def _promql(expr: str) -> str:
    """Grafana's variables as promtool would see them after Grafana's substitution."""
    expr = re.sub(r"\$__(rate_interval|interval|range)\b", "5m", expr)
    return re.sub(r"\$\{?\w+\}?", "x", expr)


def test_every_query_parses(tmp_path: Path) -> None:
    exprs = _exprs()
    assert len(exprs) > 40
    rules = [{"record": f"dashboard:query_{i}", "expr": _promql(e)}
             for i, (_, e) in enumerate(exprs)]
    path = tmp_path / "dashboard.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = run_promtool("check", "rules", path)
    where = {f"dashboard:query_{i}": w for i, (w, _) in enumerate(exprs)}
    assert r.returncode == 0, "\n".join(
        [r.stdout + r.stderr] + [f"{k}: {v}" for k, v in where.items() if k in r.stdout + r.stderr])


def test_a_query_that_does_not_parse_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "d", "rules": [
        {"record": "dashboard:query_0",
         "expr": _promql('sum by (instance (rate(kvagentd_kv_blocks{instance=~"$instance"}'
                         '[$__rate_interval]))')}]}]}))
    assert run_promtool("check", "rules", path).returncode != 0


def test_every_metric_named_is_exported(exposition: str) -> None:
    exported = sample_names(exposition) | PROMETHEUS_MADE
    missing = {(w, m) for w, e in _exprs() for m in METRIC.findall(e) if m not in exported}
    assert not missing, sorted(missing)


def test_sections_and_variables() -> None:
    d = _dashboard()
    rows = [p["title"] for p in d["panels"] if p["type"] == "row"]
    assert rows == ["Fleet overview", "Per-asset vibration", "Zone and fault timeline",
                    "Tiers: occupancy and I/O", "Engine: batch and latency", "Health checks"]
    assert [v["name"] for v in d["templating"]["list"]] == ["datasource", "instance", "asset"]
    ids = [p["id"] for p in _panels(d["panels"])]
    assert len(ids) == len(set(ids))
    for p in _panels(d["panels"]):
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
