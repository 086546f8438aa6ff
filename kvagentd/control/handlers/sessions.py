"""Session routes: ask (streamed), fork, list, show, transcript, drop.

Who may do what is `authz.SessionRules`: readers ask in sessions they created, operators in
any user's session; the daemon's own sessions (the agent's, reports') are never written from
here: `fork` asks about one in a new session of the caller that starts from its token ids.

POST /v1/sessions/{id}/ask   {"question": str, "max_tokens"?: int, "system"?: str, "stream"?: bool}
    streamed (default): NDJSON lines {"text": piece} as tokens come, then
    {"done": true, "result": {...}}; "stream": false answers one JSON object.
    A new id creates the session, owned by the caller.
POST /v1/sessions/{id}/fork  {"question": str, "session"?: new id, "max_tokens"?: int, ...}
    change route: a new session owned by the caller, starting from {id}'s token ids, asked
    `question`; the first streamed line is {"session": new id, "forked_from": id}.
GET  /v1/sessions            every session: owner, tokens, blocks per tier, last use
GET  /v1/sessions/{id}       one session, with the tail of its text where the caller may read it
GET  /v1/sessions/{id}/transcript   the whole conversation as text
DELETE /v1/sessions/{id}  |  POST /v1/sessions/{id}/drop   (its owner, or operators)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kvagentd.control.authz import SessionRules, name_of_uid
from kvagentd.control.deps import ControlDeps
from kvagentd.control.errors import (BadRequest, Busy, Conflict, Forbidden, NotFound,
                                     require_service)
from kvagentd.control.router import Request, Router

if TYPE_CHECKING:
    from kvagentd.engine.service import Engine

DAEMON_OWNER = "daemon"


def register(router: Router, deps: ControlDeps) -> None:
    rules = SessionRules.from_config(deps.config)

    def engine() -> Engine:
        return require_service(deps.services.engine,
                               "no model is loaded (model.source = 'none', or still starting)")

    def valid_id(sid: str) -> str:
        from kvagentd.engine.sessions import valid_session_id

        if not valid_session_id(sid):
            raise BadRequest(f"session id {sid!r}: use 1-128 of letters, digits, _ . : @ -")
        return sid

    def session_id(req: Request) -> str:
        return valid_id(req.params["id"])

    def describe(d: dict[str, Any]) -> dict[str, Any]:
        uid = d.get("owner_uid")
        d["owner"] = DAEMON_OWNER if uid is None else name_of_uid(uid)
        d["daemon_session"] = rules.is_daemon_session(d["id"], True, uid)
        return d

    def ask_body(req: Request) -> tuple[str, int, str | None, bool]:
        body = req.json_object()
        question = body.get("question")
        if not isinstance(question, str) or not question.strip():
            raise BadRequest("'question' must be a non-empty string")
        limit = deps.config.executor.ask_max_tokens
        max_tokens = body.get("max_tokens", limit)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not (
                1 <= max_tokens <= limit):
            raise BadRequest(f"'max_tokens' must be an integer in [1, {limit}] "
                             f"(executor.ask_max_tokens)")
        system = body.get("system")
        if system is not None and not isinstance(system, str):
            raise BadRequest("'system' must be a string")
        return question, max_tokens, system, body.get("stream", True) is not False

    def run(eng: Any, sid: str, question: str, max_tokens: int, system: str | None,
            stream: bool, created: bool, head: dict[str, Any] | None = None) -> Any:
        from kvagentd.engine.executor import GenerationRequest, Priority, QueueFull

        try:
            job = eng.submit(GenerationRequest(sid, question, system, max_tokens, Priority.ASK))
        except QueueFull as exc:
            if created:
                eng.sessions.discard_empty(sid)
            raise Busy(str(exc)) from None
        if not stream:
            try:
                return {**(head or {}), "session": sid, "result": job.result().as_dict()}
            finally:
                _end(eng, job, sid, created)
        return _stream(eng, job, sid, created, head)

    @router.route("POST", "/v1/sessions/{id}/ask", change=False)
    def ask(req: Request) -> Any:
        eng = engine()
        sid = session_id(req)
        question, max_tokens, system, stream = ask_body(req)
        record = eng.sessions.record(sid)
        rules.check_ask(req.peer, req.operator, sid, record is not None,
                        record.owner if record else None)
        created = False
        if record is None:
            created = eng.sessions.create(sid, req.peer.uid)
            if not created:  # another request created it just now: judge that one
                record = eng.sessions.record(sid)
                rules.check_ask(req.peer, req.operator, sid, record is not None,
                                record.owner if record else None)
        return run(eng, sid, question, max_tokens, system, stream, created)

    @router.route("POST", "/v1/sessions/{id}/fork", change=True)
    def fork(req: Request) -> Any:
        eng = engine()
        src = session_id(req)
        question, max_tokens, system, stream = ask_body(req)
        record = eng.sessions.record(src)
        if record is None:
            raise NotFound(f"no session {src!r}")
        new = req.json_object().get("session")
        if new is not None:
            if not isinstance(new, str):
                raise BadRequest("'session' must be a session id")
            new = valid_id(new)
            if rules.reserved(new):
                raise BadRequest(f"session id {new!r} is reserved for the daemon's sessions")
            if not eng.sessions.create(new, req.peer.uid, token_ids=record.token_ids,
                                       turns=record.turns):
                raise Conflict(f"session {new!r} exists; choose another id")
        else:
            new = _fork_id(eng, rules, src, req.peer.uid, record)
        head = {"session": new, "forked_from": src}
        return run(eng, new, question, max_tokens, system, stream, False, head)

    @router.route("GET", "/v1/sessions", change=False)
    def list_sessions(req: Request) -> dict[str, Any]:
        return {"sessions": [describe(d) for d in engine().sessions.list()]}

    @router.route("GET", "/v1/sessions/{id}", change=False)
    def show(req: Request) -> dict[str, Any]:
        sid = session_id(req)
        info = engine().sessions.get(sid)
        if info is None:
            raise NotFound(f"no session {sid!r}")
        info = describe(info)
        if not rules.may_read_text(req.peer, req.operator, sid, info["owner_uid"]):
            info.pop("tail", None)
            info.pop("last_turns", None)
            info["tail_hidden"] = "the text of a user's session is for its owner and operators"
        return info

    @router.route("GET", "/v1/sessions/{id}/transcript", change=False)
    def transcript(req: Request) -> dict[str, Any]:
        eng = engine()
        sid = session_id(req)
        record = eng.sessions.record(sid)
        if record is None:
            raise NotFound(f"no session {sid!r}")
        if not rules.may_read_text(req.peer, req.operator, sid, record.owner):
            raise Forbidden(f"session {sid!r} belongs to {name_of_uid(record.owner or 0)}; its "
                            "text is for its owner and operators", kind="not_owner")
        return describe({"id": sid, "owner_uid": record.owner, "tokens": len(record.token_ids),
                         "turns": record.turns, "text": eng.sessions.text(sid),
                         "conversation": eng.sessions.conversation(sid)})

    def drop(req: Request) -> dict[str, Any]:
        from kvagentd.engine.executor import SessionBusy

        eng = engine()
        sid = session_id(req)
        record = eng.sessions.record(sid)
        if record is None:
            raise NotFound(f"no session {sid!r}")
        rules.check_drop(req.peer, req.operator, sid, record.owner)
        try:
            dropped = eng.sessions.drop(sid)
        except SessionBusy as exc:
            raise Busy(str(exc)) from None
        if not dropped:
            raise NotFound(f"no session {sid!r}")
        return {"dropped": sid}

    # NOTE: not change routes: a reader may drop a session of their own (checked in `drop`).
    router.add("DELETE", "/v1/sessions/{id}", drop, change=False)
    router.add("POST", "/v1/sessions/{id}/drop", drop, change=False)


def _fork_id(eng: Any, rules: SessionRules, src: str, uid: int, record: Any) -> str:
    """Create the fork `<user>@<src>[.n]` (the first free n) and return its id."""
    from kvagentd.engine.sessions import valid_session_id

    base = f"{name_of_uid(uid)}@{src}"
    for n in range(1, 10_000):
        new = base if n == 1 else f"{base}.{n}"
        if not valid_session_id(new) or rules.reserved(new):
            break
        if eng.sessions.create(new, uid, token_ids=record.token_ids, turns=record.turns):
            return new
    raise Conflict(f"no free fork id for session {src!r}; name one with 'session'")


def _end(eng: Any, job: Any, sid: str, created: bool) -> None:
    """Stop a job whose client left; forget a session this request created if no turn ran."""
    if not job.done():
        job.cancel()  # no-op once done; stops the job if the wait was interrupted
    if created and job.done():
        eng.sessions.discard_empty(sid)


def _stream(eng: Any, job: Any, sid: str, created: bool,
            head: dict[str, Any] | None) -> Iterator[dict[str, Any]]:
    """NDJSON items of a running job; a client that goes away cancels it."""
    try:
        if head:
            yield head
        for piece in job.stream():
            yield {"text": piece}
        yield {"done": True, "result": job.result().as_dict()}
    finally:
        _end(eng, job, sid, created)
