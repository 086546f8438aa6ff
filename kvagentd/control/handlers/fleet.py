"""Fleet routes (with `[remote]`): the boxes sharing the remote store, and session adoption.

GET  /v1/fleet                      every box the remote store knows: heartbeat, alive, assets
POST /v1/sessions/{id}/adopt        {"force"?: bool}  change route: take the session over from
    the box that holds it (refused while that box is alive, unless forced); it resumes here
    from the remote tier, and the former holder never writes it again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvagentd.control.deps import ControlDeps
from kvagentd.control.errors import BadRequest, Busy, Conflict, NotFound, NotReady, require_service
from kvagentd.control.router import Request, Router

if TYPE_CHECKING:
    from kvagentd.fleet.service import FleetService

NO_REMOTE = "no remote store is configured ([remote] url), or no model is loaded"


def register(router: Router, deps: ControlDeps) -> None:
    def fleet() -> FleetService:
        return require_service(deps.services.remote, NO_REMOTE)

    @router.route("GET", "/v1/fleet", change=False)
    def boxes(req: Request) -> dict[str, Any]:
        f = fleet()
        listing = f.boxes()
        if listing is None:
            raise NotReady(f"the remote store cannot be asked now: {f.remote.health()['detail']}")
        return {"box": f.box, "boxes": listing}

    @router.route("POST", "/v1/sessions/{id}/adopt", change=True)
    def adopt(req: Request) -> dict[str, Any]:
        from kvagentd.engine.sessions import valid_session_id
        from kvagentd.fleet.handover import HandoverError
        from kvagentd.fleet.service import AdoptRefused

        sid = req.params["id"]
        if not valid_session_id(sid):
            raise BadRequest(f"session id {sid!r}: use 1-128 of letters, digits, _ . : @ -")
        force = req.json_object().get("force", False)
        if not isinstance(force, bool):
            raise BadRequest("'force' must be true or false")
        try:
            return fleet().adopt(sid, force=force, uid=req.peer.uid)
        except AdoptRefused as exc:
            if exc.kind == "busy":
                raise Busy(str(exc)) from None
            raise Conflict(str(exc), kind="held_alive" if exc.kind == "alive" else None) from None
        except HandoverError as exc:
            if exc.kind == "not_found":
                raise NotFound(str(exc)) from None
            if exc.kind == "unavailable":
                raise NotReady(str(exc)) from None
            raise Conflict(str(exc), kind=exc.kind) from None
