"""The daemon drives services through start/stop/status/health/reload; absent ones are None."""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path
from typing import Any

import pytest

from kvagentd.config import load_config
from kvagentd.daemon.core import Daemon
from kvagentd.services import SERVICE_ORDER, Services
from kvagentd.daemon.systemd import Notifier


class FakeService:
    def __init__(self, name: str, journal: list[str], *, fail_status: bool = False,
                 health: str | None = None, fail_stop: bool = False) -> None:
        self.name, self.journal = name, journal
        self.fail_status, self.health_value, self.fail_stop = fail_status, health, fail_stop
        self.reloaded: list[Any] = []
        self.counters = {"lost": 0}  # what the health checks read of a store
        self.monitor = types.SimpleNamespace(last=None)  # ... and of maintenance

    def health(self) -> dict[str, Any] | None:
        if self.health_value is None:
            return None
        return {"status": self.health_value, "detail": f"{self.name} says so"}

    def start(self) -> None:
        self.journal.append(f"start {self.name}")

    def stop(self) -> None:
        self.journal.append(f"stop {self.name}")
        if self.fail_stop:
            raise RuntimeError("flush failed")

    def status(self) -> dict[str, Any]:
        if self.fail_status:
            raise RuntimeError("status exploded")
        return {"blocks": 3}

    def reload(self, config: Any) -> None:
        self.reloaded.append(config)


def _daemon(d: Path, agent_toml: str = "", **services: Any) -> Daemon:
    """A daemon on a tmp config whose composition root builds `services` (fakes)."""
    path = d / "c.toml"
    path.write_text(f"""
[daemon]
state_dir = "{d}/state"
cache_dir = "{d}/cache"
[control]
socket = "{d}/run/k.sock"
socket_group = ""
operator_group = ""
[model]
source = "none"
[kv]
cold_dir = "{d}/cold"
hot_bytes = "16MiB"
cold_capacity_bytes = "64MiB"
segment_bytes = "16MiB"
o_direct = false
[maintenance]
shadow_dir = "{d}/shm"
shadow_bytes = "16MiB"
health_status_file = "{d}/state/ssd-health.json"
[agent]
enabled = false
{agent_toml}
""")
    return Daemon(load_config(path, env={}), path, notifier=Notifier(env={}),
                  build=lambda cfg, ctx: Services(**services))


@pytest.fixture
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import tempfile
    return Path(tempfile.mkdtemp(prefix="kvs", dir="/tmp"))


def test_services_start_in_order_and_stop_in_reverse(tmp: Path) -> None:
    journal: list[str] = []
    d = _daemon(tmp, store=FakeService("store", journal),
                engine=FakeService("engine", journal, fail_stop=True),
                agent=FakeService("agent", journal))
    d.startup()
    assert d.ready
    d.shutdown()
    assert journal == ["start store", "start engine", "start agent",
                       "stop agent", "stop engine", "stop store"]  # a failing stop continues
    assert d.phase == "stopped"
    assert SERVICE_ORDER.index("store") < SERVICE_ORDER.index("engine") < SERVICE_ORDER.index(
        "agent")


def test_status_and_health_merge_present_services_only(tmp: Path) -> None:
    journal: list[str] = []
    d = _daemon(tmp, store=FakeService("store", journal, health="ok"),
                maintenance=FakeService("maintenance", journal, fail_status=True,
                                        health="degraded"))
    # the merge, not the hysteresis (tests/health/test_settle.py): a reading counts at once
    d.config = dataclasses.replace(d.config, health=dataclasses.replace(d.config.health,
                                                                        raise_after_s=0.0))
    d.startup()
    try:
        s = d.status()
        assert s["store"] == {"blocks": 3}
        assert s["maintenance"]["error"].startswith("RuntimeError")
        assert "engine" not in s and "agent" not in s
        assert s["services"] == ["store", "maintenance"]
        h = d.health()
        assert h["status"] == "degraded"
        assert {"name": "service:maintenance", "status": "degraded",
                "reason": "maintenance says so"} in h["checks"]
        assert {"name": "service:store", "status": "ok", "reason": "store says so"} \
            in h["checks"]
    finally:
        d.shutdown()


def test_reload_applies_reloadable_fields_and_hands_config_to_services(tmp: Path) -> None:
    journal: list[str] = []
    d = _daemon(tmp, "tick_interval_s = 3.0", agent=FakeService("agent", journal))
    d.startup()
    try:
        assert d.config_path is not None
        text = d.config_path.read_text().replace("tick_interval_s = 3.0", "tick_interval_s = 5.0")
        d.config_path.write_text(text.replace("o_direct = false",
                                              "o_direct = false\nblock_tokens = 32"))
        result = d.reload()
        assert result["applied"] == {"agent.tick_interval_s": [3.0, 5.0]}
        assert result["restart_required"] == ["kv.block_tokens"]
        assert d.config.agent.tick_interval_s == 5.0
        assert d.config.kv.block_tokens == 16  # not applied live
        assert d.services.agent.reloaded[-1].agent.tick_interval_s == 5.0
        d.config_path.write_text("[kv]\nhot_bytes = -1\n")
        bad = d.reload()
        assert "kv.hot_bytes" in bad["error"] and d.config.agent.tick_interval_s == 5.0
    finally:
        d.shutdown()


def test_placement_policy_and_tuning_reload_but_its_sizes_wait_for_a_restart(tmp: Path) -> None:
    """SIGHUP hands placement a new policy and factors (it applies them at its next round);
    the trace buffer and the store's prefetch queue are sized at start."""
    journal: list[str] = []
    d = _daemon(tmp, placement=FakeService("placement", journal))
    d.startup()
    try:
        assert d.config_path is not None
        d.config_path.write_text(d.config_path.read_text() + (
            '[placement]\npolicy = "heat+prefetch"\nhot_factor = 2.5\n'
            "headroom_fraction = 0.05\ntrace_capacity = 10\nprefetch_max_inflight = 4\n"))
        result = d.reload()
        assert result["applied"] == {"placement.policy": ["reuse", "heat+prefetch"],
                                     "placement.hot_factor": [1.8, 2.5],
                                     "placement.headroom_fraction": [0.03, 0.05]}
        assert result["restart_required"] == ["placement.prefetch_max_inflight",
                                              "placement.trace_capacity"]
        got = d.services.placement.reloaded[-1].placement
        assert (got.policy, got.hot_factor, got.headroom_fraction) == ("heat+prefetch", 2.5, 0.05)
        assert got.trace_capacity == 100_000 and got.prefetch_max_inflight == 8
    finally:
        d.shutdown()


def test_startup_failure_stops_started_services(tmp: Path) -> None:
    journal: list[str] = []
    class Broken(FakeService):
        def start(self) -> None:
            raise RuntimeError("model file is corrupt")

    d = _daemon(tmp, store=FakeService("store", journal), engine=Broken("engine", journal))
    assert d.run() == 70
    assert journal == ["start store", "stop store"]
    assert not Path(d.config.control.socket).exists()


def test_phase_transitions_are_checked(tmp: Path) -> None:
    from kvagentd.daemon.core import Phase
    d = _daemon(tmp)
    with pytest.raises(RuntimeError, match="illegal daemon phase change"):
        d._set_phase(Phase.STOPPED)
    d._set_phase(Phase.STOPPING)
    with pytest.raises(RuntimeError):
        d._set_phase(Phase.RUNNING)


def test_with_field_replaces_one_nested_leaf() -> None:
    from kvagentd.daemon.reload import with_field as _with_field
    a = load_config(None, env={})
    b = dataclasses.replace(a, daemon=dataclasses.replace(a.daemon, log_level="debug",
                                                          drain_timeout_s=1.0))
    merged = _with_field(a, ["daemon", "log_level"], b)
    assert merged.daemon.log_level == "debug" and merged.daemon.drain_timeout_s == 10.0


def test_socket_answers_during_a_slow_start_but_service_routes_wait(tmp: Path) -> None:
    import httpx

    seen: dict[str, Any] = {}

    class SlowEngine(FakeService):
        def start(self) -> None:  # runs while the daemon is starting: query it like kvctl
            with httpx.Client(transport=httpx.HTTPTransport(uds=str(d.config.control.socket)),
                              base_url="http://kvagentd", timeout=5) as c:
                seen["status"] = c.get("/v1/status").json()
                seen["readyz"] = c.get("/v1/readyz").status_code
                seen["sessions"] = c.get("/v1/probe").status_code

    d = _daemon(tmp, engine=SlowEngine("engine", []))
    d.router.route("GET", "/v1/probe")(lambda req: {"sessions": []})
    d.startup()
    try:
        assert seen["status"]["phase"] == "starting" and seen["status"]["ready"] is False
        assert (seen["readyz"], seen["sessions"]) == (503, 503)
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(d.config.control.socket)),
                          base_url="http://kvagentd", timeout=5) as c:
            assert c.get("/v1/probe").json() == {"sessions": []}
    finally:
        d.shutdown()


def test_watchdog_pings_only_while_the_loop_and_its_threads_live(tmp: Path) -> None:
    import socket as socketlib
    import threading
    import time

    listener = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_DGRAM)
    listener.bind(str(tmp / "notify.sock"))
    listener.settimeout(5)
    d = _daemon(tmp)
    d.notifier = Notifier(env={"NOTIFY_SOCKET": str(tmp / "notify.sock"),
                               "WATCHDOG_USEC": "100000"})
    d.startup()
    loop = threading.Thread(target=d.main_loop)
    loop.start()
    try:
        def next_watchdog() -> bool:
            end = time.monotonic() + 2
            while time.monotonic() < end:
                try:
                    if listener.recv(4096) == b"WATCHDOG=1":
                        return True
                except TimeoutError:
                    return False
            return False

        assert next_watchdog()
        assert d.server is not None
        d.server._server.shutdown()  # the accept thread dies
        listener.settimeout(0.2)
        while True:  # drop what was sent before the thread ended
            try:
                listener.recv(4096)
            except TimeoutError:
                break
        listener.settimeout(1.0)
        assert not next_watchdog()
    finally:
        d.request_shutdown("test")
        loop.join(10)
        d.shutdown()
        listener.close()


def test_host_arenas_that_do_not_fit_in_memory_are_a_config_error(tmp: Path) -> None:
    """The host arenas are taken at start, so a budget larger than the memory available now
    is refused with the field named (no allocation is tried)."""
    import torch

    from kvagentd.config import ConfigError
    from kvagentd.services import check_host_memory

    cfg = load_config(None)  # hot 18 GB (meant for a GPU), warm 35 % of it
    with pytest.raises(ConfigError, match=r"kv\.hot_bytes.*need 22\.\d GiB"):
        check_host_memory(cfg, torch.device("cpu"), available=16 << 30)
    check_host_memory(cfg, torch.device("cpu"), available=32 << 30)
    # with the hot tier on a GPU only the warm tier is host memory
    check_host_memory(cfg, torch.device("cuda"), available=8 << 30)
    with pytest.raises(ConfigError, match=r"kv\.warm_ratio"):
        check_host_memory(cfg, torch.device("cuda"), available=4 << 30)


def test_a_stop_during_a_slow_model_load_ends_the_start(tmp: Path) -> None:
    """A stop signal while the model loads (a bf16 check takes about a minute on 2 cores)
    is answered at the load's next step, exit 0, not after the whole start."""
    import threading
    import time

    from kvagentd.engine.model import LoadCancelled

    asked = threading.Event()

    def slow_build(cfg: Any, ctx: Any) -> Services:
        asked.set()
        for _ in range(600):  # a load that asks between its steps, as load_model does
            if ctx.cancelled():
                raise LoadCancelled("model load cancelled: a stop was asked for")
            time.sleep(0.05)
        raise AssertionError("the build was never told to stop")

    d = _daemon(tmp)
    d._build = slow_build  # type: ignore[method-assign]
    threading.Thread(target=lambda: (asked.wait(30), d.requests.stop("SIGTERM")),
                     daemon=True).start()
    t0 = time.monotonic()
    assert d.run() == 0
    assert time.monotonic() - t0 < 10
    assert d.phase == "stopped"


def test_load_model_and_the_precision_check_stop_when_cancelled(tmp: Path) -> None:
    from kvagentd.config import ModelConfig
    from kvagentd.engine.model import LoadCancelled, load_model
    from kvagentd.engine.precision import Calibration, greedy_answers
    from kvagentd.engine.tiny import tiny_model_dir

    root = Path(__file__).resolve().parents[2]
    model_dir = tiny_model_dir(root / "var" / "test-cache")
    cfg = ModelConfig(source="hf_dir", path=model_dir, device="cpu", dtype="float32", threads=1)
    with pytest.raises(LoadCancelled):
        load_model(cfg, tmp, cancelled=lambda: True)
    lm = load_model(cfg, tmp)
    seen: list[int] = []

    def before() -> None:
        seen.append(1)
        if len(seen) == 2:
            raise LoadCancelled("stop")

    prompts = [Calibration(system="s", text=f"q{i}", constraints=None, max_new_tokens=2)
               for i in range(3)]
    with pytest.raises(LoadCancelled):
        greedy_answers(lm.model, lm.tokenizer, prompts, before)
    assert len(seen) == 2  # the second prompt never ran
