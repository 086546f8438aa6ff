"""Placement routes: policy and heat status, trace dump and trace stream.

`daemon.placement` is a `kvagentd.kvcache.placement.PlacementService` (None until started).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from kvagentd.control.errors import BadRequest, require_service
from kvagentd.control.router import Request, Response, Router, NDJSON_TYPE
from kvagentd.kvcache.trace import iter_jsonl


def register(router: Router, daemon: Any) -> None:

    def placement() -> Any:
        return require_service(daemon, "placement", "placement is not running")

    @router.route("GET", "/v1/placement", change=False)
    def get_placement(req: Request) -> dict[str, Any]:
        """Policy, last round (moves, decision time) and heat statistics."""
        return placement().status()

    @router.route("POST", "/v1/trace/dump", change=True)
    def dump_trace(req: Request) -> dict[str, Any]:
        """Write the trace ring to {"path": ABSOLUTE} (.npz: numpy archive, else JSON lines)."""
        body = req.json_object()
        path = body.get("path")
        if not isinstance(path, str) or not path:
            raise BadRequest("'path' must be a non-empty string")
        p = Path(path)
        if not p.is_absolute():
            raise BadRequest("'path' must be absolute (it is written by the daemon)")
        try:
            n = placement().trace.dump(p)
        except OSError as exc:
            raise BadRequest(f"cannot write {p}: {exc.strerror or exc}") from None
        return {"path": str(p), "events": n}

    @router.route("GET", "/v1/trace", change=False)
    def get_trace(req: Request) -> Any:
        """`?format=summary` (default): counts; `?format=ndjson`: the events as JSON lines."""
        fmt = req.query.get("format", "summary")
        p = placement()
        if fmt == "summary":
            return p.trace.stats()
        if fmt == "ndjson":
            events = p.trace.events()  # a copy: the ring keeps recording while this streams

            def chunks() -> Iterator[str]:
                yield from iter_jsonl(events)
            return Response(chunks(), content_type=NDJSON_TYPE)
        raise BadRequest("'format' must be 'summary' or 'ndjson'")
