"""Maintenance routes: defrag, NVMe tuning, shadow failover, scrub.

`deps.services.maintenance` is the `Maintenance` service (or None until started).
`POST /v1/tune/apply` is refused with 403 when the daemon is not root (as under systemd, where
/sys is read-only for it): the root oneshot `kvagentd-tune.service` applies the settings at boot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from collections.abc import Iterator

import structlog

from kvagentd.control.deps import ControlDeps
from kvagentd.control.errors import BadRequest, Busy, Forbidden, Internal, require_service
from kvagentd.control.progress import stream_work
from kvagentd.control.router import Request, Router

if TYPE_CHECKING:
    from kvagentd.maintenance.service import Maintenance

log = structlog.get_logger(__name__)

TIERS = ("hot", "warm", "cold", "all")


def register(router: Router, deps: ControlDeps) -> None:

    def svc() -> Maintenance:
        return require_service(deps.services.maintenance, "maintenance service is not running")

    @router.route("GET", "/v1/defrag", change=False)
    def fragmentation(req: Request) -> dict[str, Any]:
        return svc().fragmentation()

    @router.route("POST", "/v1/defrag", change=True)
    def defrag(req: Request) -> Any:
        body = req.json_object()
        tier = body.get("tier", "all")
        dry_run = body.get("dry_run", False)
        if tier not in TIERS:
            raise BadRequest(f"tier must be one of {', '.join(TIERS)}, got {tier!r}")
        if not isinstance(dry_run, bool):
            raise BadRequest("dry_run must be true or false")
        m = svc()
        if not body.get("stream", False):
            return _run_defrag(m, tier, dry_run, None)
        return _stream_defrag(m, tier, dry_run)

    @router.route("GET", "/v1/tune", change=False)
    def tune(req: Request) -> dict[str, Any]:
        return svc().tune(apply=False)

    @router.route("POST", "/v1/tune/apply", change=True)
    def tune_apply(req: Request) -> dict[str, Any]:
        from kvagentd.maintenance.tune import TuneError, TunePermissionError

        try:
            return svc().tune(apply=True)
        except TunePermissionError as exc:
            raise Forbidden(str(exc), kind="tune_not_permitted") from None
        except TuneError as exc:
            raise Internal(str(exc), kind="tune_failed") from None

    @router.route("GET", "/v1/failover", change=False)
    def failover_status(req: Request) -> dict[str, Any]:
        return svc().failover_status()

    @router.route("POST", "/v1/failover/activate", change=True)
    def failover_activate(req: Request) -> dict[str, Any]:
        body = req.json_object()
        reason = str(body.get("reason") or f"operator request (uid {req.peer.uid})")
        return svc().failover_activate(reason)

    @router.route("POST", "/v1/failover/restore", change=True)
    def failover_restore(req: Request) -> dict[str, Any]:
        from kvagentd.kvcache.cold.failover import FailoverError

        body = req.json_object()
        reason = str(body.get("reason") or f"operator request (uid {req.peer.uid})")
        try:
            return svc().failover_restore(reason)
        except FailoverError as exc:
            raise Busy(str(exc), kind="restore_failed") from None

    @router.route("GET", "/v1/scrub", change=False)
    def scrub_status(req: Request) -> dict[str, Any]:
        return svc().scrub_status()

    @router.route("POST", "/v1/scrub", change=True)
    def scrub(req: Request) -> dict[str, Any]:
        """Start a checksum scrub of the cold tier at the configured rate (runs in background)."""
        return svc().scrub_in_background()


def _run_defrag(m: Maintenance, tier: str, dry_run: bool, progress: Any) -> dict[str, Any]:
    from kvagentd.maintenance.service import DefragBusy

    try:
        return m.defrag(tier, dry_run=dry_run, progress=progress)
    except DefragBusy as exc:
        raise Busy(str(exc)) from None


def _stream_defrag(m: Any, tier: str, dry_run: bool) -> Iterator[dict[str, Any]]:
    """NDJSON: {"progress": {tier, done, total}} lines, then {"result": ...} (or {"error": ...})."""

    def work(report: Any) -> dict[str, Any]:
        def progress(t: str, done: int, total: int) -> None:
            report({"tier": t, "done": done, "total": total})

        return _run_defrag(m, tier, dry_run, progress)

    return stream_work("defrag", work)
