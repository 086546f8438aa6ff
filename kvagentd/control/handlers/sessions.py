"""Session routes: ask (streamed), list, show, drop.

POST /v1/sessions/{id}/ask   {"question": str, "max_tokens"?: int, "system"?: str, "stream"?: bool}
    streamed (default): NDJSON lines {"text": piece} as tokens come, then
    {"done": true, "result": {...}}; "stream": false answers one JSON object.
GET  /v1/sessions            every session: tokens, blocks per tier, last use
GET  /v1/sessions/{id}       one session, with the tail of its text
DELETE /v1/sessions/{id}  |  POST /v1/sessions/{id}/drop
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kvagentd.control.errors import BadRequest, Busy, NotFound, require_service
from kvagentd.control.router import Request, Router


def register(router: Router, daemon: Any) -> None:
    def engine() -> Any:
        return require_service(daemon, "engine",
                               "no model is loaded (model.source = 'none', or still starting)")

    def session_id(req: Request) -> str:
        from kvagentd.engine.sessions import valid_session_id

        sid = req.params["id"]
        if not valid_session_id(sid):
            raise BadRequest(f"session id {sid!r}: use 1-128 of letters, digits, _ . : @ -")
        return sid

    @router.route("POST", "/v1/sessions/{id}/ask", change=False)
    def ask(req: Request) -> Any:
        from kvagentd.engine.executor import GenerationRequest, Priority, QueueFull

        eng = engine()
        sid = session_id(req)
        body = req.json_object()
        question = body.get("question")
        if not isinstance(question, str) or not question.strip():
            raise BadRequest("'question' must be a non-empty string")
        limit = daemon.config.executor.ask_max_tokens
        max_tokens = body.get("max_tokens", limit)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not (
                1 <= max_tokens <= limit):
            raise BadRequest(f"'max_tokens' must be an integer in [1, {limit}] "
                             f"(executor.ask_max_tokens)")
        system = body.get("system")
        if system is not None and not isinstance(system, str):
            raise BadRequest("'system' must be a string")
        try:
            job = eng.submit(GenerationRequest(sid, question, system, max_tokens, Priority.ASK))
        except QueueFull as exc:
            raise Busy(str(exc)) from None
        if body.get("stream", True) is False:
            try:
                return {"session": sid, "result": job.result().as_dict()}
            finally:
                job.cancel()  # no-op once done; stops the job if the wait was interrupted
        return _stream(job)

    @router.route("GET", "/v1/sessions", change=False)
    def list_sessions(req: Request) -> dict[str, Any]:
        return {"sessions": engine().sessions.list()}

    @router.route("GET", "/v1/sessions/{id}", change=False)
    def show(req: Request) -> dict[str, Any]:
        info = engine().sessions.get(session_id(req))
        if info is None:
            raise NotFound(f"no session {req.params['id']!r}")
        return info

    def drop(req: Request) -> dict[str, Any]:
        from kvagentd.engine.service import SessionBusy

        sid = session_id(req)
        try:
            dropped = engine().sessions.drop(sid)
        except SessionBusy as exc:
            raise Busy(str(exc)) from None
        if not dropped:
            raise NotFound(f"no session {sid!r}")
        return {"dropped": sid}

    router.add("DELETE", "/v1/sessions/{id}", drop, change=True)
    router.add("POST", "/v1/sessions/{id}/drop", drop, change=True)


def _stream(job: Any) -> Iterator[dict[str, Any]]:
    """NDJSON items of a running job; a client that goes away cancels it."""
    try:
        for piece in job.stream():
            yield {"text": piece}
        yield {"done": True, "result": job.result().as_dict()}
    finally:
        if not job.done():
            job.cancel()
