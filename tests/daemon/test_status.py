from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from kvagentd.daemon.status import GpuProbe, disk_status, host_status


class _NVMLError(Exception):
    pass


def _fake_pynvml(*, init_error: bool = False, count: int = 1) -> types.ModuleType:
    m = types.ModuleType("pynvml")
    m.NVMLError = _NVMLError
    m.NVML_PCIE_UTIL_TX_BYTES, m.NVML_PCIE_UTIL_RX_BYTES, m.NVML_TEMPERATURE_GPU = 0, 1, 0

    def init() -> None:
        if init_error:
            raise _NVMLError("NVML Shared Library Not Found")

    def unsupported(h: object, counter: int) -> None:
        raise _NVMLError("Not Supported")

    m.nvmlInit = init
    m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetCount = lambda: count
    m.nvmlDeviceGetHandleByIndex = lambda i: f"h{i}"
    m.nvmlDeviceGetName = lambda h: b"NVIDIA GeForce RTX 4090"
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=24 << 30, used=18 << 30,
                                                                free=6 << 30)
    m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=35, memory=20)
    m.nvmlDeviceGetTemperature = lambda h, s: 61
    m.nvmlDeviceGetCurrPcieLinkGeneration = lambda h: 4
    m.nvmlDeviceGetCurrPcieLinkWidth = lambda h: 16
    m.nvmlDeviceGetMaxPcieLinkGeneration = lambda h: 4
    m.nvmlDeviceGetMaxPcieLinkWidth = lambda h: 16
    m.nvmlDeviceGetPcieThroughput = unsupported
    return m


def test_gpu_fields_from_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    gpus, reason = GpuProbe().sample()
    assert reason is None and len(gpus) == 1
    g = gpus[0]
    assert g["name"] == "NVIDIA GeForce RTX 4090"
    assert g["memory_used_bytes"] == 18 << 30 and g["utilization_gpu_percent"] == 35
    assert g["pcie"]["gen"] == 4 and g["pcie"]["width"] == 16
    assert g["pcie"]["tx_kib_s"] is None  # unsupported field: None, not an error


def test_no_nvml_library_is_a_reason_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(init_error=True))
    assert GpuProbe().sample() == (None, "NVML unavailable: NVML Shared Library Not Found")


def test_no_gpu_and_no_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(count=0))
    assert GpuProbe().sample() == (None, "NVML reports no NVIDIA GPU")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    gpus, reason = GpuProbe().sample()
    assert gpus is None and "not installed" in reason


def test_real_probe_never_raises() -> None:
    gpus, reason = GpuProbe().sample()
    assert (gpus is None) == (reason is not None)


def test_host_status_and_disks(tmp_path: Path) -> None:
    h = host_status([tmp_path, tmp_path / "not" / "yet"])
    assert h["memory"]["total_bytes"] > 0 and h["process"]["rss_bytes"] > 0
    assert len(h["disks"]) == 1  # same file system counted once
    assert disk_status([Path("/definitely/not/here")])[0]["path"] == "/definitely/not/here"
