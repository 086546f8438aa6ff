"""Fleet fixtures: boxes built by the composition root (`build_services`, as the daemon builds
them) on the tiny model, each with its own state directory, over one real redis-server."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch
from apscheduler.schedulers.background import BackgroundScheduler
from prometheus_client import CollectorRegistry

from kvagentd.config import Config, load_config
from kvagentd.engine.tiny import tiny_model_dir
from kvagentd.services import BuildContext, Services, build_services
from tests.redisd import RedisServer, redis_fixture

REPO = Path(__file__).resolve().parents[2]
torch.set_num_threads(1)


@pytest.fixture
def fdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kvf", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def redis(fdir: Path) -> Iterator[RedisServer]:
    yield from redis_fixture(fdir / "redis")


@pytest.fixture(autouse=True)
def _quiet_logs() -> Iterator[None]:
    structlog.configure(logger_factory=structlog.ReturnLoggerFactory())
    yield
    structlog.reset_defaults()


def box_config(d: Path, url: str, box: str, *, assets: str = "", extra: str = "") -> Config:
    model_dir = tiny_model_dir(REPO / "var" / "test-cache")
    agent = f"[agent]\nenabled = true\nassessment_max_tokens = 4\n{assets}" if assets \
        else "[agent]\nenabled = false"
    path = d / f"{box}.toml"
    path.write_text(f"""
[daemon]
state_dir = "{d}/{box}/state"
cache_dir = "{REPO}/var/test-cache"
[control]
socket = "{d}/{box}/run/k.sock"
socket_group = ""
operator_group = ""
[model]
source = "hf_dir"
path = "{model_dir}"
device = "cpu"
dtype = "float32"
threads = 1
[kv]
cold_dir = "{d}/{box}/cold"
hot_bytes = "8MiB"
warm_ratio = 1.0
cold_capacity_bytes = "64MiB"
segment_bytes = "8MiB"
o_direct = false
[maintenance]
shadow_dir = "{d}/{box}/shm"
shadow_bytes = "8MiB"
health_status_file = "{d}/{box}/state/ssd-health.json"
[remote]
url = "{url}"
box_id = "{box}"
read_timeout_s = 2.0
retry_max_s = 0.5
heartbeat_interval_s = 2.0
{extra}
{agent}
""")
    return load_config(path, env={})


class Box:
    """One daemon's services, started in order and stopped in reverse, as the daemon does."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.scheduler = BackgroundScheduler()
        self.scheduler.start(paused=True)  # jobs are registered, never run: tests drive ticks
        self.services: Services = build_services(config, BuildContext(
            self.scheduler, CollectorRegistry(),
            health=lambda: {"status": "ok", "checks": []}))
        self.started: list[Any] = []
        for _name, service in self.services.in_order():
            service.start()
            self.started.append(service)

    @property
    def engine(self) -> Any:
        return self.services.engine

    @property
    def fleet(self) -> Any:
        return self.services.remote

    @property
    def agent(self) -> Any:
        return self.services.agent

    def ask(self, session: str, text: str, n: int = 6) -> Any:
        return self.engine.ask(session, text, max_new_tokens=n, timeout=120)

    def flush(self) -> None:
        assert self.fleet.remote.writer.flush(20.0), self.fleet.status()

    def stop(self) -> None:
        for service in reversed(self.started):
            service.stop()
        self.started.clear()
        if self.scheduler.running:
            self.scheduler.shutdown(wait=False)
