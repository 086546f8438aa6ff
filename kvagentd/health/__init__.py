"""Health as named checks: facts gathered from the daemon and its services (`facts`), judged
by pure functions against `[health]` thresholds (`checks`), with the counters an operator has
acknowledged (`acks`). `kvctl health`, `/v1/health`, `/v1/readyz` and the systemd STATUS
line all read the same `Report`."""

from kvagentd.health.acks import Acknowledgements
from kvagentd.health.checks import assess
from kvagentd.health.facts import DaemonFacts, Facts, gather
from kvagentd.health.report import Check, Level, Report

__all__ = ["Acknowledgements", "Check", "DaemonFacts", "Facts", "Level", "Report", "assess",
           "gather"]
