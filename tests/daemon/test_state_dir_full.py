"""A full state directory while the daemon runs: every route that writes answers 507
`insufficient_storage` naming the path (never 500), and all of them work again once space
returns, without a restart."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.mounts import small_disk

from .conftest import DaemonProcess
from .test_full_daemon import _ask, _config


def _post(p: DaemonProcess, path: str, body: dict[str, object]) -> tuple[int, dict[str, object]]:
    with p.client() as c:
        c.timeout = 60
        r = c.post(path, json=body)
    return r.status_code, r.json()


def test_a_full_state_dir_is_507_naming_it_and_recovers(short_dir: Path) -> None:
    config = _config(short_dir)
    config.write_text(config.read_text().replace("[agent]\nenabled = true",
                                                 "[agent]\nenabled = false"))
    state = short_dir / "state"
    p = DaemonProcess(short_dir, config, mounts=[small_disk(state, "16m")])
    try:
        p.notify.wait_for("READY=1", timeout=120)
        assert _ask(p, "op-1", "How is pump-1 doing?")["new_tokens"] > 0
        # the daemon's own view of the state dir (its private mount namespace)
        seen = Path(f"/proc/{p.proc.pid}/root") / str(state).lstrip("/")
        filler = seen / "filler"
        subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=64k"], capture_output=True)
        routes = [("/v1/sessions/op-1/ask", {"question": "And now?", "max_tokens": 4,
                                              "stream": False}),
                  ("/v1/sessions/op-2/ask", {"question": "A new one?", "max_tokens": 4,
                                              "stream": False}),
                  ("/v1/sessions/op-1/fork", {"question": "Fork?", "session": "op-3",
                                               "max_tokens": 4, "stream": False}),
                  ("/v1/trace/dump", {})]
        for path, body in routes:
            status, reply = _post(p, path, body)
            assert status == 507, (path, status, reply, p.output()[-3000:])
            err = reply["error"]
            assert isinstance(err, dict) and err["kind"] == "insufficient_storage"
            assert str(state) in str(err["message"]), err
        filler.unlink()
        assert _ask(p, "op-1", "And now?")["new_tokens"] > 0
        status, reply = _post(p, "/v1/sessions/op-1/fork", {"question": "Fork?",
                                                             "session": "op-3", "max_tokens": 4,
                                                             "stream": False})
        assert status == 200, reply
        status, reply = _post(p, "/v1/trace/dump", {})
        assert status == 200, reply
    finally:
        p.stop()
