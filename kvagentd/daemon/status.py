"""Status providers: host (psutil) and GPU (NVML through nvidia-ml-py).

Nothing here raises for a missing GPU, driver or library: the GPU section is then `None` with a
reason (`gpu_reason`), as the daemon must run on CPU-only machines.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import psutil
import structlog

log = structlog.get_logger(__name__)

# One object, so that cpu_percent() measures the interval since the previous status call.
_PROCESS = psutil.Process()


def host_status(paths: Iterable[Path]) -> dict[str, Any]:
    """Memory, load, this process and free space of the file systems holding `paths`."""
    vm = psutil.virtual_memory()
    sw = psutil.swap_memory()
    proc = _PROCESS
    with proc.oneshot():
        process = {"rss_bytes": proc.memory_info().rss, "threads": proc.num_threads(),
                   "open_fds": proc.num_fds(), "cpu_percent": proc.cpu_percent(None)}
    try:
        load_1m: float | None = os.getloadavg()[0]
    except OSError:
        load_1m = None
    return {
        "hostname": socket.gethostname(),
        "cpu_count": psutil.cpu_count(),
        "load_1m": load_1m,
        "memory": {"total_bytes": vm.total, "available_bytes": vm.available,
                   "used_percent": vm.percent},
        "swap": {"total_bytes": sw.total, "used_bytes": sw.used, "used_percent": sw.percent},
        "process": process,
        "disks": disk_status(paths),
    }


def disk_status(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """One entry per distinct file system among `paths` (nearest existing ancestor is used)."""
    seen: set[int] = set()
    out = []
    for path in paths:
        existing = _existing_ancestor(Path(path))
        if existing is None:
            continue
        try:
            dev = existing.stat().st_dev
            usage = psutil.disk_usage(str(existing))
        except OSError as exc:
            out.append({"path": str(path), "error": exc.strerror})
            continue
        if dev in seen:
            continue
        seen.add(dev)
        out.append({"path": str(path), "total_bytes": usage.total, "free_bytes": usage.free,
                    "used_percent": usage.percent})
    return out


def _existing_ancestor(path: Path) -> Path | None:
    for p in (path, *path.parents):
        if p.exists():
            return p
    return None


class GpuProbe:
    """NVML access, initialised once. `sample()` -> (list of GPUs, None) or (None, reason)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._nvml: Any = None
        self._reason: str | None = None
        self._initialised = False

    def _init(self) -> None:
        self._initialised = True
        try:
            import pynvml  # nvidia-ml-py
        except ImportError:
            self._reason = "nvidia-ml-py (pynvml) is not installed"
            return
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            self._reason = f"NVML unavailable: {exc}"
            return
        try:
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as exc:
            self._reason = f"NVML device count failed: {exc}"
            return
        if count == 0:
            self._reason = "NVML reports no NVIDIA GPU"
            return
        self._nvml = pynvml
        log.info("nvml_ready", gpus=count)

    def sample(self) -> tuple[list[dict[str, Any]] | None, str | None]:
        with self._lock:
            if not self._initialised:
                self._init()
            if self._nvml is None:
                return None, self._reason
            nv = self._nvml
            try:
                count = nv.nvmlDeviceGetCount()
                return [self._device(nv, i) for i in range(count)], None
            except nv.NVMLError as exc:
                return None, f"NVML query failed: {exc}"

    @staticmethod
    def _device(nv: Any, index: int) -> dict[str, Any]:
        h = nv.nvmlDeviceGetHandleByIndex(index)

        def q(fn: Any, *args: Any) -> Any:
            try:
                return fn(h, *args)
            except nv.NVMLError:  # a field this GPU or driver does not report
                return None

        name = q(nv.nvmlDeviceGetName)
        mem = q(nv.nvmlDeviceGetMemoryInfo)
        util = q(nv.nvmlDeviceGetUtilizationRates)
        tx = q(nv.nvmlDeviceGetPcieThroughput, nv.NVML_PCIE_UTIL_TX_BYTES)
        rx = q(nv.nvmlDeviceGetPcieThroughput, nv.NVML_PCIE_UTIL_RX_BYTES)
        return {
            "index": index,
            "name": name.decode() if isinstance(name, bytes) else name,
            "memory_total_bytes": getattr(mem, "total", None),
            "memory_used_bytes": getattr(mem, "used", None),
            "memory_free_bytes": getattr(mem, "free", None),
            "utilization_gpu_percent": getattr(util, "gpu", None),
            "utilization_memory_percent": getattr(util, "memory", None),
            "temperature_c": q(nv.nvmlDeviceGetTemperature, nv.NVML_TEMPERATURE_GPU),
            "pcie": {
                "gen": q(nv.nvmlDeviceGetCurrPcieLinkGeneration),
                "width": q(nv.nvmlDeviceGetCurrPcieLinkWidth),
                "max_gen": q(nv.nvmlDeviceGetMaxPcieLinkGeneration),
                "max_width": q(nv.nvmlDeviceGetMaxPcieLinkWidth),
                "tx_kib_s": tx,
                "rx_kib_s": rx,
            },
        }

    def close(self) -> None:
        with self._lock:
            if self._nvml is not None:
                try:
                    self._nvml.nvmlShutdown()
                except self._nvml.NVMLError as exc:
                    log.debug("nvml_shutdown_failed", error=str(exc))
                self._nvml = None
            self._initialised = False
