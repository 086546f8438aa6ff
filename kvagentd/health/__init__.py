"""Health as named checks: facts gathered from the daemon and its services (`facts`), judged
by pure functions against `[health]` thresholds (`checks`), with the counters an operator has
acknowledged (`acks`), then held to their levels by the daemon's one `settle.Settled`
(hysteresis). `kvctl health`, `/v1/health`, `/v1/readyz`, the metrics and the systemd STATUS
line all read the same settled `Report`."""

from kvagentd.health.acks import Acknowledgements
from kvagentd.health.checks import assess, commentaries
from kvagentd.health.facts import DaemonFacts, Facts, gather
from kvagentd.health.report import Check, Commentary, Level, Report
from kvagentd.health.settle import Settled

__all__ = ["Acknowledgements", "Check", "Commentary", "DaemonFacts", "Facts", "Level", "Report",
           "Settled", "assess", "commentaries", "gather"]
