"""Placement routes: policy and heat status, trace dump and trace stream.

`deps.services.placement` is the `PlacementService` (None until started).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvagentd.control.deps import ControlDeps
from kvagentd.control.dumps import DumpDir, DumpDirUnsafe, DumpExists, DumpNameError
from kvagentd.control.errors import BadRequest, Conflict, Storage, require_service
from kvagentd.control.router import NDJSON_TYPE, Request, Response, Router
from kvagentd.kvcache.placement.trace_recorder import iter_jsonl, write_trace_to

if TYPE_CHECKING:
    from kvagentd.kvcache.placement import PlacementService

TRACE_FORMATS = ("jsonl", "npz")


def register(router: Router, deps: ControlDeps) -> None:

    def placement() -> PlacementService:
        return require_service(deps.services.placement, "placement is not running")

    @router.route("GET", "/v1/placement", change=False)
    def get_placement(req: Request) -> dict[str, Any]:
        """Policy, last round (moves, decision time) and heat statistics."""
        return placement().status()

    dumps = DumpDir(Path(deps.config.daemon.state_dir) / "dumps")

    @router.route("POST", "/v1/trace/dump", change=True)
    def dump_trace(req: Request) -> dict[str, Any]:
        """Write the trace ring to `<state_dir>/dumps/` as {"name"?: plain name, "format"?:
        "jsonl" | "npz"}; the daemon picks the name when none is given (see control.dumps)."""
        body = req.json_object()
        if "path" in body:
            raise BadRequest(f"the daemon writes dumps only under {dumps.path}; give 'name' "
                             "(a plain file name) or nothing")
        name, fmt = body.get("name"), body.get("format")
        if fmt is not None and fmt not in TRACE_FORMATS:
            raise BadRequest(f"'format' must be one of {', '.join(TRACE_FORMATS)}, got {fmt!r}")
        if name is None:
            name = dumps.new_name("trace", "." + (fmt or "jsonl"))
        elif not isinstance(name, str):
            raise BadRequest("'name' must be a string")
        else:
            try:
                dumps.check_name(name, tuple("." + f for f in TRACE_FORMATS))
            except DumpNameError as exc:
                raise BadRequest(str(exc)) from None
            if fmt is not None and not name.endswith("." + fmt):
                raise BadRequest(f"'name' {name!r} does not end in .{fmt}")
        svc = placement()
        svc.ingest()  # accesses the prefetcher has seen and the trace not yet (heat+prefetch)
        trace = svc.trace
        events = trace.events()
        try:
            path = dumps.write(name, lambda f: write_trace_to(
                f, events, npz=name.endswith(".npz"), block_size=trace.block_size))
        except DumpExists as exc:
            raise Conflict(str(exc)) from None
        except DumpDirUnsafe as exc:  # the directory, not the request: the path named
            raise Storage(str(exc)) from None
        except OSError as exc:  # a full or failing state disk
            raise Storage(f"cannot write {dumps.path / name}: {exc.strerror or exc}") from None
        return {"path": str(path), "name": name, "events": len(events)}

    @router.route("GET", "/v1/trace", change=False)
    def get_trace(req: Request) -> Any:
        """`?format=summary` (default): counts; `?format=ndjson`: the events as JSON lines."""
        fmt = req.query.get("format", "summary")
        p = placement()
        p.ingest()  # accesses the prefetcher has seen and the trace not yet (heat+prefetch)
        if fmt == "summary":
            return p.trace.stats()
        if fmt == "ndjson":
            events = p.trace.events()  # a copy: the ring keeps recording while this streams

            def chunks() -> Iterator[str]:
                yield from iter_jsonl(events, p.trace.block_size)
            return Response(chunks(), content_type=NDJSON_TYPE)
        raise BadRequest("'format' must be 'summary' or 'ndjson'")
