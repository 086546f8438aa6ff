"""Logging: structlog over the standard library's logging.

Where stdout is the journal (systemd's `JOURNAL_STREAM` names it), records go to journald
through its native protocol (`cysystemd`, the journal's own library in a wheel): each with its
PRIORITY (so `journalctl -p warning` works), a MESSAGE line (`event key=value ...`) and every
key as a field of its own (`ASSET=pump-1`, `CHECK=sensor:pump-1`, `SESSION=...`; `journalctl
ASSET=pump-1`). Without that library the same JSON lines as elsewhere go to stdout with a
`<N>` syslog priority prefix, which journald reads (`SyslogLevelPrefix=`, on by default).
Elsewhere: one JSON object per line when stdout is not a terminal, readable colored console
lines on a terminal. Exceptions are rendered as structured tracebacks
(`"exception": [{"exc_type", "exc_value", "frames": [...]}]`) in JSON. Records of libraries that
use the standard `logging` module (APScheduler, httpx) go through the same renderer.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from collections.abc import Callable
from typing import IO, Any, Literal

import structlog

from kvagentd.daemon.repeats import DropSchedulerSkips, RepeatLimiter

Format = Literal["auto", "json", "console", "journal"]

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR}

_HANDLER_NAME = "kvagentd"
_handler: logging.Handler | None = None
_repeats: RepeatLimiter | None = None
_as_json = True


def configure(level: str = "info", fmt: Format = "auto", stream: IO[str] | None = None,
              repeat_interval_s: float = 60.0) -> None:
    """(Re)configure logging for the whole process. Safe to call more than once.

    JSON logs stay pure JSON: progress bars of libraries (tqdm, huggingface_hub) are switched
    off through their environment switches, so call this before importing them;
    `route_library_logs()` sends transformers' own records through this handler too. The same
    warning again within `repeat_interval_s` is counted, not written (`kvagentd.daemon.repeats`)."""
    global _repeats, _handler, _as_json
    stream = stream or sys.stdout
    tty = _isatty(stream)
    journal = fmt == "journal" or (fmt == "auto" and stream is sys.stdout
                                   and stdout_is_journal())
    as_json = fmt == "json" or (fmt == "auto" and not tty) or journal
    _as_json = as_json
    if as_json:
        for name in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS"):
            os.environ.setdefault(name, "1")
    logging.captureWarnings(True)  # warnings.warn() -> the "py.warnings" logger, not stderr
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[structlog.stdlib.filter_by_level, *shared,
                    structlog.stdlib.PositionalArgumentsFormatter(),
                    structlog.processors.StackInfoRenderer(),
                    structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    final: list[structlog.types.Processor] = [
        structlog.stdlib.ProcessorFormatter.remove_processors_meta]
    native = journal and journal_send() is not None
    if native:
        final += [structlog.processors.format_exc_info,
                  structlog.processors.JSONRenderer(default=str)]
    elif as_json:
        tracebacks = structlog.processors.ExceptionRenderer(
            structlog.tracebacks.ExceptionDictTransformer(show_locals=False))
        final += [tracebacks, structlog.processors.JSONRenderer(default=str)]
    else:
        final += [structlog.dev.ConsoleRenderer(colors=tty)]
    formatter = structlog.stdlib.ProcessorFormatter(foreign_pre_chain=shared, processors=final)
    handler: logging.Handler = (JournalHandler() if native
                                else PrefixedStreamHandler(stream) if journal
                                else logging.StreamHandler(stream))
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(formatter)
    _repeats = RepeatLimiter(repeat_interval_s)
    handler.addFilter(DropSchedulerSkips())
    handler.addFilter(_repeats)
    _handler = handler
    root = logging.getLogger()
    for h in list(root.handlers):
        if h.get_name() == _HANDLER_NAME:
            root.removeHandler(h)
    root.addHandler(handler)
    set_level(level)
    # Chatty libraries: their INFO lines are per request / per job run.
    for name in ("apscheduler.executors.default", "httpx", "httpcore"):
        logging.getLogger(name).setLevel(max(LEVELS.get(level, logging.INFO), logging.WARNING))


def flush_repeats() -> int:
    """Write the count of warnings held back in windows that have ended; returns how many
    summaries were written (the daemon's main loop calls this every few seconds)."""
    if _repeats is None or _handler is None:
        return 0
    records = _repeats.flush()
    for rec in records:
        _handler.handle(rec)
    return len(records)


def set_repeat_interval(seconds: float) -> None:
    """Change the repeat window live (SIGHUP reload of daemon.log_repeat_interval_s)."""
    if _repeats is not None:
        _repeats.interval_s = seconds


def route_library_logs(progress_bars: bool = False) -> None:
    """Send transformers' records through the daemon's handler (it writes to stderr by
    itself otherwise) and, unless `progress_bars`, switch its progress bars off. Call it once
    transformers is about to be used (it imports transformers)."""
    from transformers.utils import logging as tf_logging

    tf_logging.disable_default_handler()
    tf_logging.enable_propagation()
    if not progress_bars:
        tf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # unannotated upstream


def progress_bars_wanted() -> bool:
    """True when logs are console lines on a terminal (progress bars are readable there)."""
    return not _as_json


def set_level(level: str) -> None:
    """Change the level live (SIGHUP reload of daemon.log_level)."""
    if level not in LEVELS:
        raise ValueError(f"log level {level!r}; allowed: {', '.join(LEVELS)}")
    logging.getLogger().setLevel(LEVELS[level])


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


# -- journald --------------------------------------------------------------------------------

# syslog priorities of the standard levels (RFC 5424)
PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3,
            logging.CRITICAL: 2}
_FIELD_BAD = re.compile(r"[^A-Z0-9_]")
# keys of the event dict that are the journal's own business or already in MESSAGE
_NOT_FIELDS = frozenset({"event", "level", "timestamp", "exception"})


def stdout_is_journal() -> bool:
    """stdout is connected to journald (systemd sets JOURNAL_STREAM to its `dev:inode`)."""
    want = os.environ.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return want == f"{st.st_dev}:{st.st_ino}"


def journal_send() -> Callable[..., Any] | None:
    """cysystemd's `send`, or None where it is not installed (the `<N>` prefix then)."""
    try:
        from cysystemd.journal import send
    except ImportError:
        return None
    return send  # type: ignore[no-any-return]


def journal_fields(event: dict[str, Any], levelno: int) -> dict[str, str]:
    """The journal entry of one rendered event: MESSAGE, PRIORITY, SYSLOG_IDENTIFIER and
    each key as an upper-case field (`asset` -> `ASSET`)."""
    pairs = " ".join(f"{k}={_short(v)}" for k, v in event.items()
                     if k not in _NOT_FIELDS and k != "logger")
    message = f"{event.get('event', '')} {pairs}".rstrip()
    if event.get("exception"):
        message += "\n" + str(event["exception"])
    out = {"MESSAGE": message, "PRIORITY": str(PRIORITY.get(levelno, 6)),
           "SYSLOG_IDENTIFIER": "kvagentd"}
    for k, v in event.items():
        if k in _NOT_FIELDS:
            continue
        name = _FIELD_BAD.sub("_", k.upper()).lstrip("_")
        if name and name not in out:
            out[name] = v if isinstance(v, str) else json.dumps(v, default=str)
    if event.get("exception"):
        out["EXCEPTION"] = str(event["exception"])
    return out


def _short(v: Any) -> str:
    text = v if isinstance(v, str) else json.dumps(v, default=str)
    return json.dumps(text) if (" " in text or not text) else text


class JournalHandler(logging.Handler):
    """Each record as one journal entry (`journal_fields`) through the native protocol."""

    def __init__(self) -> None:
        super().__init__()
        send = journal_send()
        if send is None:
            raise RuntimeError("cysystemd is not installed")
        self._send = send

    def emit(self, record: logging.LogRecord) -> None:
        try:
            event = json.loads(self.format(record))
            fields = journal_fields(event, record.levelno)
            # NOTE: else libsystemd names the binding's own send as the code location
            fields.update(CODE_FILE=record.pathname, CODE_LINE=str(record.lineno),
                          CODE_FUNC=record.funcName)
            self._send(**fields)
        except Exception:  # noqa: BLE001 - logging must never raise into the caller
            self.handleError(record)


class PrefixedStreamHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A JSON line prefixed with `<N>`, its syslog priority, for journald to read."""

    def format(self, record: logging.LogRecord) -> str:
        return f"<{PRIORITY.get(record.levelno, 6)}>{super().format(record)}"
