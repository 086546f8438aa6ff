from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short directory (AF_UNIX paths are limited to 107 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="kvh", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(autouse=True)
def _quiet_logs() -> Iterator[None]:
    """In-process daemons must not write into the captured kvctl output."""
    structlog.configure(logger_factory=structlog.ReturnLoggerFactory())
    yield
    structlog.reset_defaults()
