"""Suite-wide settings. Area fixtures live in tests/<area>/conftest.py."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import structlog

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _structlog_defaults_after_each_test() -> Iterator[None]:
    """A test that configures structlog (the daemon's own set-up, or a quiet ReturnLogger)
    does not leave it to the next: after a stdlib set-up, a test that only swaps the logger
    factory would run the stdlib processors over a ReturnLogger and fail."""
    yield
    structlog.reset_defaults()


def pytest_collection_modifyitems(config, items):  # noqa: ANN001 (pytest hook)
    """Tests marked `cuda` run only where a CUDA device is present; elsewhere they are
    deselected (not skipped) and the run says how many."""
    import torch

    if torch.cuda.is_available():
        return
    cuda = [it for it in items if it.get_closest_marker("cuda") is not None]
    if cuda:
        config.hook.pytest_deselected(items=cuda)
        items[:] = [it for it in items if it.get_closest_marker("cuda") is None]
        config._kvagentd_cuda_deselected = len(cuda)


def pytest_report_header(config):  # noqa: ANN001 (pytest hook)
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device: tests marked `cuda` (tests/engine/test_cuda.py) are deselected"
    return None
