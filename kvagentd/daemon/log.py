"""Logging: structlog over the standard library's logging.

One JSON object per line on stdout when stdout is not a terminal (journald stores each line),
readable colored console lines on a terminal. Exceptions are rendered as structured tracebacks
(`"exception": [{"exc_type", "exc_value", "frames": [...]}]`) in JSON. Records of libraries that
use the standard `logging` module (APScheduler, httpx) go through the same renderer.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import IO, Literal

import structlog

from kvagentd.daemon.repeats import DropSchedulerSkips, RepeatLimiter

Format = Literal["auto", "json", "console"]

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
    as_json = fmt == "json" or (fmt == "auto" and not tty)
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
