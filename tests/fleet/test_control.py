"""The fleet over the control socket: `kvctl sessions adopt` (refused from a live holder without
--force), `kvctl fleet`, and the former holder's refusal (409 session_fenced, kvctl exit 1), for
a user's session (`remote.publish_sessions = "all"`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvagentd.control.handlers import fleet as fleet_routes
from kvagentd.control.handlers import sessions as session_routes
from kvagentd.control.router import Router
from kvagentd.control.server import ControlServer
from kvctl.main import main as kvctl
from tests.control.conftest import FakeDaemon
from tests.redisd import RedisServer

from .conftest import Box, box_config

SID = "shift-log"


class Served:
    """A box's session and fleet routes on its control socket."""

    def __init__(self, box: Box) -> None:
        self.daemon = FakeDaemon(box.config)
        self.daemon.services.engine = box.engine
        self.daemon.services.remote = box.fleet
        router = Router()
        session_routes.register(router, self.daemon)
        fleet_routes.register(router, self.daemon)
        self.server = ControlServer(box.config.control, router)
        self.server.start()

    def kvctl(self, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = kvctl(["--socket", str(self.server.path), "--timeout", "120", *args])
        out = capsys.readouterr()
        return code, out.out, out.err

    def stop(self) -> None:
        self.server.stop(1.0)


def test_adopt_and_fleet_through_kvctl(fdir: Path, redis: RedisServer,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    a = Box(box_config(fdir, redis.url, "box-a", extra='publish_sessions = "all"'))
    b = Box(box_config(fdir, redis.url, "box-b", extra='publish_sessions = "all"'))
    sa, sb = Served(a), Served(b)
    try:
        code, _, _ = sa.kvctl(capsys, "ask", "--session", SID, "--new", "-n", "4",
                              "Line 1 shift log: pump 1 restarted at 06:10.")
        assert code == 0
        a.flush()
        a.fleet.beat()
        b.fleet.beat()

        code, out, _ = sb.kvctl(capsys, "--json", "fleet")
        assert code == 0
        boxes = {x["box"]: x for x in json.loads(out)["boxes"]}
        assert set(boxes) == {"box-a", "box-b"} and boxes["box-a"]["alive"]

        code, out, err = sb.kvctl(capsys, "sessions", "adopt", SID)
        assert code == 1 and "alive" in err and "force" in err  # exit 1: retrying cannot help

        code, out, _ = sb.kvctl(capsys, "--json", "sessions", "adopt", SID, "--force")
        assert code == 0
        got: dict[str, Any] = json.loads(out)
        assert got["from_box"] == "box-a" and got["epoch"] == 2
        assert got["blocks_found"] == got["blocks"] > 0

        assert b.engine.table.get(SID).owner == a.engine.table.get(SID).owner  # the adopter
        code, out, err = sa.kvctl(capsys, "ask", "--session", SID, "-n", "4", "Anything else?")
        assert code == 1 and "box-b" in err  # 409 session_fenced on the former holder
        with _client(sa) as c:
            r = c.post(f"/v1/sessions/{SID}/ask", json={"question": "again?", "stream": False})
        assert r.status_code == 409 and r.json()["error"]["kind"] == "session_fenced"

        code, out, err = sb.kvctl(capsys, "sessions", "adopt", "no-such-session", "--force")
        assert code == 1 and "no session 'no-such-session'" in err
    finally:
        sa.stop()
        sb.stop()
        a.stop()
        b.stop()


def _client(s: Served) -> Any:
    import httpx

    return httpx.Client(transport=httpx.HTTPTransport(uds=str(s.server.path)),
                        base_url="http://kvagentd", timeout=60)
