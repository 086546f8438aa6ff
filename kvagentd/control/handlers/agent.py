"""Agent routes: the event log, reports and scheduler jobs.

`deps.services.agent` is the agent (None when it is not running); `deps.scheduler` is the
APScheduler the jobs live in.

    GET  /v1/events?asset=&since=&anomalies=&limit=   event rows, newest first
    GET  /v1/reports                                  report list, newest first
    GET  /v1/reports/{id}                             one report (JSON doc + Markdown)
    POST /v1/reports/run {kind: weekly|replay, asset|event}   starts one; 202-like {id, state}
    POST /v1/assets/{asset}/ask {question, max_tokens?}   a question about an asset, answered
         with its latest diagnosis as context in the daemon's session <asset>:ask:<caller's
         user name>; the answer is checked against the diagnosis
         ({asset, session, diagnosis, commentary | null, withheld, reason, result})
    GET  /v1/jobs                                     every scheduler job
    POST /v1/jobs/{id}/run|pause|resume
`since` is unix seconds or a relative age such as "15m", "2h", "7d".
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Any

from kvagentd.control.authz import ask_user
from kvagentd.control.deps import ControlDeps
from kvagentd.control.errors import BadRequest, Busy, NotFound, NotReady, Storage, require_service
from kvagentd.control.router import Request, Router

if TYPE_CHECKING:
    from kvagentd.agent.agent import Agent

_AGE_RE = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_EVENT_ID = 2**63  # event ids are SQLite INTEGERs (signed 64-bit)


def parse_since(text: str | None, now: float) -> float | None:
    """Unix seconds, or an age ("90s", "15m", "2h", "7d") before `now`; raises BadRequest."""
    if text is None or text == "":
        return None
    m = _AGE_RE.match(text.strip())
    if m:
        return now - float(m.group(1)) * _UNIT[m.group(2)]
    try:
        return float(text)
    except ValueError:
        raise BadRequest(f"since must be unix seconds or an age like 15m/2h/7d, got {text!r}") \
            from None


EVENT_KINDS = ("tick", "bad_data")  # the kinds the agent writes (agent/events.py)


def register(router: Router, deps: ControlDeps) -> None:
    from kvagentd.scheduling import jobs
    from kvagentd.agent.reports import ReportError

    def agent() -> Agent:
        return require_service(deps.services.agent, "the agent is not running")

    @router.route("GET", "/v1/events", change=False)
    def events(req: Request) -> dict[str, Any]:
        a = agent()
        asset = req.query.get("asset") or None
        if asset is not None and asset not in a.assets:
            raise NotFound(f"unknown asset {asset!r}; known: {', '.join(a.assets)}")
        kind = req.query.get("kind") or None
        if kind is not None and kind not in EVENT_KINDS:
            raise BadRequest(f"'kind' must be one of {', '.join(EVENT_KINDS)}, got {kind!r}")
        after = req.query.get("after")
        rows = a.events.query(asset=asset, since=parse_since(req.query.get("since"), a.clock()),
                              anomalies=req.query_bool("anomalies"), kind=kind,
                              after_id=req.query_int("after", 0, lo=0, hi=2**62)
                              if after is not None else None,
                              newest_first=after is None,
                              limit=req.query_int("limit", 100, lo=1, hi=100_000))
        return {"events": rows, "count": len(rows)}

    @router.route("GET", "/v1/events/{id}", change=False)
    def event(req: Request) -> dict[str, Any]:
        raw = req.params["id"]
        if not re.fullmatch(r"[0-9]{1,18}", raw):
            raise BadRequest(f"an event id is a number, got {raw!r}")
        row = agent().events.get(int(raw))
        if row is None:
            raise NotFound(f"no event {raw}")
        return {"event": row}

    @router.route("GET", "/v1/reports", change=False)
    def reports(req: Request) -> dict[str, Any]:
        return {"reports": agent().reports.list()}

    @router.route("GET", "/v1/reports/{id}", change=False)
    def report(req: Request) -> dict[str, Any]:
        doc = agent().reports.get(req.params["id"])
        if doc is None:
            raise NotFound(f"no report {req.params['id']!r}")
        return doc

    @router.route("POST", "/v1/reports/run", change=True)
    def run_report(req: Request) -> dict[str, Any]:
        body = req.json_object()
        kind = body.get("kind")
        event = body.get("event")
        if kind == "replay" and (isinstance(event, bool) or not isinstance(event, int)
                                 or not 0 < event < MAX_EVENT_ID):
            raise BadRequest(f"replay needs an 'event' id: an integer in [1, {MAX_EVENT_ID - 1}]")
        if kind == "weekly" and not isinstance(body.get("asset"), str):
            raise BadRequest("weekly needs an 'asset' name")
        try:
            rid = agent().reports.start(str(kind), asset=body.get("asset"), event=event)
        except ReportError as exc:
            raise (NotFound if "unknown asset" in str(exc) or "unknown event" in str(exc)
                   else BadRequest)(str(exc)) from None
        except OSError as exc:  # the reports directory cannot be written (a full disk ...)
            raise Storage(f"cannot write the report in {agent().reports.dir}: "
                          f"{exc.strerror or exc}"
                          + (f" ({exc.filename})" if exc.filename else "")) from None
        return {"id": rid, "state": "running", "started": time.time()}

    @router.route("POST", "/v1/assets/{asset}/ask", change=False)
    def ask_asset(req: Request) -> dict[str, Any]:
        from kvagentd.engine.executor import QueueFull

        a = agent()
        name = req.params["asset"]
        if name not in a.assets:
            raise NotFound(f"unknown asset {name!r}; known: {', '.join(a.assets)}")
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
        if "session" in body:
            raise BadRequest("an asset question is asked in the daemon's session for the "
                             "caller and that asset; 'session' is not accepted")
        # NOTE: one daemon-owned session per asset and caller (authz.SessionRules reserves
        # <asset>:ask:*), so nobody writes into another user's or the agent's sessions here.
        session = f"{name}:ask:{ask_user(req.peer.uid)}"
        try:
            return dict(a.ask(name, question, session=session, max_tokens=max_tokens))
        except LookupError as exc:
            raise NotReady(str(exc)) from None
        except QueueFull as exc:
            raise Busy(str(exc)) from None

    @router.route("GET", "/v1/jobs", change=False)
    def list_jobs(req: Request) -> dict[str, Any]:
        return {"jobs": jobs.list_jobs(deps.scheduler)}

    @router.route("POST", "/v1/jobs/{id}/{action}", change=True)
    def job_action(req: Request) -> dict[str, Any]:
        action = req.params["action"]
        fn = {"run": jobs.run_job, "pause": jobs.pause_job, "resume": jobs.resume_job}.get(action)
        if fn is None:
            raise NotFound(f"no job action {action!r} (run, pause, resume)")
        try:
            return {"job": fn(deps.scheduler, req.params["id"]), "action": action}
        except jobs.UnknownJob:
            raise NotFound(f"no job {req.params['id']!r}") from None
