"""Suite-wide settings. Area fixtures live in tests/<area>/conftest.py."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
