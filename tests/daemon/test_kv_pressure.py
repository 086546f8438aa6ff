"""KV that does not fit, on a running daemon: a request larger than the hot pool gets a 4xx
naming the limit, and with a worn (read-only) SSD and a full warm tier requests keep being
answered: idle blocks are dropped for recompute instead of failing them."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from .conftest import DaemonProcess
from .test_full_daemon import _config


def _worn_ssd(status_file: Path) -> None:
    status_file.parent.mkdir(parents=True, exist_ok=True)
    status_file.write_text(json.dumps({
        "version": 1, "state": "worn", "written_at": time.time(), "device": "/dev/nvme0n1",
        "smart": {"source": "nvme-cli", "percent_used": 95, "media_errors": 0,
                  "critical_warning": 0, "available_spare": 100,
                  "available_spare_threshold": 10, "passed": None},
        "reasons": ["wear 95% >= 80.0%"], "error": None}))


def test_too_large_is_4xx_and_a_worn_ssd_with_full_warm_keeps_answering(short_dir: Path):
    config = _config(short_dir)
    text = config.read_text()
    text = text.replace('hot_bytes = "16MiB"\nwarm_ratio = 1.0', 'hot_bytes = "1MiB"\nwarm_ratio = 0.25')
    text = text.replace("[agent]\nenabled = true", "[executor]\nask_max_tokens = 4096\n\n"
                                                   "[agent]\nenabled = false")
    config.write_text(text)
    _worn_ssd(short_dir / "state" / "ssd-health.json")
    p = DaemonProcess(short_dir, config)
    try:
        p.notify.wait_for("READY=1", timeout=120)
        store = p.get("/v1/status")["store"]
        hot_blocks = store["tiers"]["hot"]["capacity"]
        assert store["tiers"]["cold"]["read_only"] is True
        with p.client() as c:
            c.timeout = 120
            # 1600 tokens of output alone need 100 blocks of 16 tokens; the hot pool has 64
            r = c.post("/v1/sessions/big/ask", json={"question": "Write a long report.",
                                                     "max_tokens": 1600, "stream": False})
            assert r.status_code == 413, r.text
            err = r.json()["error"]
            assert err["kind"] == "kv_capacity" and "kv.hot_bytes" in err["message"]
            assert hot_blocks == 64
            # sessions that together need more than hot + warm hold, one after another
            answers = []
            for i in range(6):
                r = c.post(f"/v1/sessions/s{i}/ask", json={
                    "question": f"Session {i}: describe the pump's condition in detail.",
                    "max_tokens": 200, "stream": False})
                assert r.status_code == 200, r.text
                answers.append(r.json()["result"])
            r = c.post("/v1/sessions/s0/ask", json={"question": "And now?", "max_tokens": 4,
                                                    "stream": False})
            assert r.status_code == 200, r.text
        store = p.get("/v1/status")["store"]
        assert store["dropped"] > 0
        assert store["tiers"]["cold"]["writes"] == 0  # nothing went to the worn SSD
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0
    finally:
        p.stop()
