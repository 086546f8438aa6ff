"""Core routes: liveness, readiness, status, health, config, metrics, shutdown."""

from __future__ import annotations

from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvagentd.config import RELOADABLE, config_to_dict
from kvagentd.control.deps import ControlDeps
from kvagentd.control.errors import BadRequest, NotReady
from kvagentd.control.router import Request, Response, Router


def register(router: Router, deps: ControlDeps) -> None:

    @router.route("GET", "/v1/livez", change=False, before_ready=True)
    def livez(req: Request) -> dict[str, Any]:
        return {"alive": True}

    @router.route("GET", "/v1/readyz", change=False, before_ready=True)
    def readyz(req: Request) -> dict[str, Any]:
        """Ready: running and no health check failing (degraded still serves)."""
        if not deps.ready:
            raise NotReady(f"kvagentd is {deps.phase}")
        report = deps.health()
        failing = [f"{c['name']}: {c['reason']}" for c in report["checks"]
                   if c["status"] == "failing"]
        if failing:
            raise NotReady("health failing: " + "; ".join(failing), kind="unhealthy")
        return {"ready": True, "health": report["status"]}

    @router.route("GET", "/v1/status", change=False, before_ready=True)
    def status(req: Request) -> dict[str, Any]:
        return deps.status()

    @router.route("GET", "/v1/health", change=False, before_ready=True)
    def health(req: Request) -> Response:
        report = deps.health()
        return Response(report, status=503 if report["status"] == "failing" else 200)

    @router.route("POST", "/v1/health/ack", change=True, before_ready=True)
    def health_ack(req: Request) -> dict[str, Any]:
        """{"checks": [names]} (default: every check that counts faults)."""
        names = req.json_object().get("checks", [])
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise BadRequest("'checks' must be a list of check names")
        try:
            return dict(deps.ack_health(names))
        except KeyError as exc:
            raise BadRequest(str(exc.args[0])) from None

    @router.route("GET", "/v1/config", change=False, before_ready=True)
    def config(req: Request) -> dict[str, Any]:
        return {"path": str(deps.config_path) if deps.config_path else None,
                "reloadable": sorted(RELOADABLE),
                "config": config_to_dict(deps.config)}

    @router.route("GET", "/v1/metrics", change=False, before_ready=True)
    def metrics(req: Request) -> Response:
        return Response(generate_latest(deps.metrics), content_type=CONTENT_TYPE_LATEST)

    @router.route("POST", "/v1/shutdown", change=True, before_ready=True)
    def shutdown(req: Request) -> dict[str, Any]:
        deps.request_shutdown(f"api request from uid {req.peer.uid} pid {req.peer.pid}")
        return {"stopping": True}
