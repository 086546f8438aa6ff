"""kvctl ask [--fork] | sessions [show ID [--transcript] | drop ID | adopt ID [--force]]."""

from __future__ import annotations

import getpass
import json
from typing import Annotated, Any

import typer

from kvctl import completion, render
from kvctl.common import (EX_FAILURE, JsonOpt, SocketOpt, TimeoutOpt, call, fail, opts,
                          progress_wanted, stream, usage_error)

ASK_TIMEOUT_S = 300.0


def register(app: typer.Typer) -> None:
    app.command("ask")(ask)
    sessions_app = typer.Typer(help="LLM sessions: tokens, blocks per tier, last use.",
                               invoke_without_command=True)
    sessions_app.callback()(sessions_list)
    sessions_app.command("show")(sessions_show)
    sessions_app.command("drop")(sessions_drop)
    sessions_app.command("adopt")(sessions_adopt)
    app.add_typer(sessions_app, name="sessions")


def default_session() -> str:
    """`ask-<user>`: each user's own session unless --session names another."""
    try:
        return f"ask-{getpass.getuser()}"
    except (KeyError, OSError):
        return "ask"


def ask(ctx: typer.Context,
        question: Annotated[str, typer.Argument(help="the question")],
        session: Annotated[str | None, typer.Option(
            "--session", "-S", help="session id [default: ask-<your user name>]",
            autocompletion=completion.sessions)] = None,
        fork: Annotated[bool, typer.Option(
            "--fork", help="ask about SESSION in a new session of yours that starts from its "
                           "history (the only way to ask about the agent's sessions; operators)")
        ] = False,
        fork_as: Annotated[str | None, typer.Option(
            "--as", help="id of the new session with --fork [default: <user>@SESSION]")] = None,
        asset: Annotated[str | None, typer.Option(
            "--asset", "-a", autocompletion=completion.assets,
            help="ask about this asset: its latest measured diagnosis is the context, and the "
                 "answer is shown only if it agrees with it (in the daemon's session "
                 "ASSET:ask:<your user name>)")
        ] = None,
        max_tokens: Annotated[int | None, typer.Option(
            "--max-tokens", "-n", min=1, help="answer length limit [default: the daemon's]")
        ] = None,
        new: Annotated[bool, typer.Option(
            "--new", help="start SESSION when it does not exist (without it a --session that "
                          "names no session is refused, so a typo starts nothing)")] = False,
        socket: SocketOpt = None, json_out: JsonOpt = False, timeout: TimeoutOpt = None) -> None:
    """Ask a question in a session of yours; prints the answer as it is generated. With
    --asset the asset's measured diagnosis comes first and the answer is checked against it."""
    o = opts(ctx, socket, json_out, timeout if timeout is not None else ASK_TIMEOUT_S)
    sid = session or default_session()
    if session is not None and not new and asset is None:
        found = call(o, "GET", f"/v1/sessions/{sid}", ok=(404,))
        if isinstance(found, dict) and (found.get("error") or {}).get("kind") == "not_found":
            fail(o, EX_FAILURE, "not_found", f"no session {sid!r}",
                 "kvctl sessions lists them; --new starts a session of that name")
    body: dict[str, Any] = {"question": question}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if asset is not None:
        if session is not None or fork:
            usage_error(o, "--asset asks in the daemon's session for you and that asset; "
                           "it takes no --session or --fork")
        render.emit(o, call(o, "POST", f"/v1/assets/{asset}/ask", body=body), _render_asset_ask)
        return
    if fork_as is not None:
        body["session"] = fork_as
    route = f"/v1/sessions/{sid}/fork" if fork else f"/v1/sessions/{sid}/ask"
    final: dict[str, Any] | None = None
    # Until the first token: queued behind ticks, then the prompt's prefill (a long one on a
    # cold session) -- say so on a terminal instead of sitting silent.
    with render.Progress("waiting for the first token", progress_wanted(o)) as waiting:
        for item in stream(o, "POST", route, body=body):
            if not isinstance(item, dict):
                continue
            if "text" in item or "error" in item or item.get("done"):
                waiting.clear()
            if "error" in item:
                err = item["error"]
                fail(o, EX_FAILURE, str(err.get("kind", "error")),
                     str(err.get("message", err)))
            if "forked_from" in item and not o.json:
                typer.echo(f"[asking in {item['session']}, forked from {item['forked_from']}]",
                           err=True)
            if "text" in item and not o.json:
                typer.echo(item["text"], nl=False)
            if item.get("done"):
                final = item.get("result")
    if o.json:
        typer.echo(json.dumps(final, indent=2, sort_keys=True))
        return
    typer.echo("")
    if final is not None:
        typer.echo(_ask_footer(final), err=True)


def _render_asset_ask(r: dict[str, Any]) -> str:
    d = r.get("diagnosis") or {}
    lines = [f"{r['asset']}: {d.get('summary') or 'no measurement yet'}"]
    if d.get("action"):
        lines.append(f"what to do: {d['action']}")
    if r.get("commentary"):
        lines.append(f"commentary (model): {r['commentary']}")
    else:
        lines.append(f"commentary withheld: {r.get('reason')}")
    return "\n".join(lines)


def _ask_footer(r: dict[str, Any]) -> str:
    return (f"[{r.get('new_tokens', 0)} tokens, first after {r.get('ttft_s', 0.0) * 1000:.0f} ms; "
            f"prompt {r.get('prompt_tokens', 0)} tokens, {r.get('reused_tokens', 0)} reused, "
            f"{r.get('recomputed_tokens', 0)} recomputed; {r.get('finish_reason', '')}]")


def sessions_list(ctx: typer.Context, socket: SocketOpt = None, json_out: JsonOpt = False,
                  timeout: TimeoutOpt = None) -> None:
    """Every session: tokens, blocks per tier, last use."""
    if ctx.invoked_subcommand is not None:
        return
    o = opts(ctx, socket, json_out, timeout)
    render.emit(o, call(o, "GET", "/v1/sessions"), render_sessions)


def sessions_show(ctx: typer.Context,
                  session: Annotated[str, typer.Argument(
                      help="session id", autocompletion=completion.sessions)],
                  transcript: Annotated[bool, typer.Option(
                      "--transcript", help="the whole conversation")] = False,
                  raw: Annotated[bool, typer.Option(
                      "--raw", help="the text with the chat template's markers")] = False,
                  socket: SocketOpt = None, json_out: JsonOpt = False,
                  timeout: TimeoutOpt = None) -> None:
    """One session (owner, tokens, blocks), with the end of its conversation as turns
    (--raw: the text as the model sees it, template markers included)."""
    o = opts(ctx, socket, json_out, timeout)
    if transcript:
        render.emit(o, call(o, "GET", f"/v1/sessions/{session}/transcript"),
                    lambda d: _conversation(d.get("conversation"), str(d.get("text", "")), raw))
        return
    render.emit(o, call(o, "GET", f"/v1/sessions/{session}"), lambda d: _show(d, raw))


def _show(d: dict[str, Any], raw: bool) -> str:
    turns, tail = d.get("last_turns"), d.get("tail")
    rest = {k: v for k, v in d.items() if k not in ("last_turns", "tail")}
    head = render.kv(rest)
    if tail is None and turns is None:
        return head
    return head + "\n\n" + _conversation(turns, str(tail or ""), raw)


def _conversation(turns: Any, text: str, raw: bool) -> str:
    """Turns as `role: text` paragraphs; the raw text with --raw or when the daemon could
    not read the template's turns."""
    if raw or not isinstance(turns, list):
        return text
    return "\n\n".join(f"{t.get('role', '?')}: {str(t.get('text', '')).strip()}"
                        for t in turns if isinstance(t, dict))


def sessions_drop(ctx: typer.Context,
                  session: Annotated[str, typer.Argument(
                      help="session id", autocompletion=completion.sessions)],
                  socket: SocketOpt = None, json_out: JsonOpt = False,
                  timeout: TimeoutOpt = None) -> None:
    """Forget a session and release its blocks."""
    o = opts(ctx, socket, json_out, timeout)
    render.emit(o, call(o, "DELETE", f"/v1/sessions/{session}"),
                lambda d: f"dropped session {d['dropped']}")


def sessions_adopt(ctx: typer.Context,
                   session: Annotated[str, typer.Argument(
                      help="session id", autocompletion=completion.sessions)],
                   force: Annotated[bool, typer.Option(
                       "--force", help="take it even from a box that is alive (that box stops "
                                       "writing it)")] = False,
                   socket: SocketOpt = None, json_out: JsonOpt = False,
                   timeout: TimeoutOpt = None) -> None:
    """Take a session over from the box that holds it, through the remote store; it resumes
    here without recompute, and the other box never writes it again (operators)."""
    o = opts(ctx, socket, json_out, timeout)
    render.emit(o, call(o, "POST", f"/v1/sessions/{session}/adopt", body={"force": force}),
                _adopted)


def _adopted(d: dict[str, Any]) -> str:
    src = d.get("from_box") or "?"
    line = (f"adopted session {d['session']} from box {src} (epoch {d.get('epoch')}): "
            f"{d.get('tokens', 0)} tokens, {d.get('blocks_found', 0)} of {d.get('blocks', 0)} "
            "blocks in the remote tier")
    if d.get("asset"):
        line += f"; the agent continues asset {d['asset']} in it"
    return line


def render_sessions(data: dict[str, Any]) -> str:
    rows = []
    for s in data.get("sessions", []):
        t = s.get("blocks_by_tier", {})
        rows.append({**s, "hot": t.get("hot", 0), "warm": t.get("warm", 0),
                     "cold": t.get("cold", 0), "missing": t.get("missing", 0)})
    return render.table(rows, [("id", "session"), ("owner", "owner"), ("tokens", "tokens"),
                               ("turns", "turns"),
                               ("hot", "hot"), ("warm", "warm"), ("cold", "cold"),
                               ("missing", "missing"), ("last_used", "last use")],
                        {"last_used": _ago})


def _ago(ts: Any) -> str:
    import time

    if not isinstance(ts, int | float):
        return "-"
    return render.duration(max(0.0, time.time() - ts)) + " ago"
