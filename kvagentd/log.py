"""Logging: structlog over the standard library's logging.

One JSON object per line on stdout when stdout is not a terminal (journald stores each line),
readable colored console lines on a terminal. Exceptions are rendered as structured tracebacks
(`"exception": [{"exc_type", "exc_value", "frames": [...]}]`) in JSON. Records of libraries that
use the standard `logging` module (APScheduler, httpx) go through the same renderer.
"""

from __future__ import annotations

import logging
import sys
from typing import IO, Literal

import structlog

Format = Literal["auto", "json", "console"]

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR}

_HANDLER_NAME = "kvagentd"


def configure(level: str = "info", fmt: Format = "auto", stream: IO[str] | None = None) -> None:
    """(Re)configure logging for the whole process. Safe to call more than once."""
    stream = stream or sys.stdout
    tty = _isatty(stream)
    as_json = fmt == "json" or (fmt == "auto" and not tty)
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
    if as_json:
        tracebacks = structlog.processors.ExceptionRenderer(
            structlog.tracebacks.ExceptionDictTransformer(show_locals=False))
        final += [tracebacks, structlog.processors.JSONRenderer(default=str)]
    else:
        final += [structlog.dev.ConsoleRenderer(colors=tty)]
    formatter = structlog.stdlib.ProcessorFormatter(foreign_pre_chain=shared, processors=final)
    handler = logging.StreamHandler(stream)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for h in list(root.handlers):
        if h.get_name() == _HANDLER_NAME:
            root.removeHandler(h)
    root.addHandler(handler)
    set_level(level)
    # Chatty libraries: their INFO lines are per request / per job run.
    for name in ("apscheduler.executors.default", "httpx", "httpcore"):
        logging.getLogger(name).setLevel(max(LEVELS.get(level, logging.INFO), logging.WARNING))


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
