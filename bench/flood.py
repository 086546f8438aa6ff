"""Control socket under a flood by one uid: are another uid's probes still answered?

Needs root: the flooder and the prober are forked children that drop to two other uids (the
control server judges connections by SO_PEERCRED). Scenarios, each with a prober sending
`GET /v1/livez` on a fresh connection every 50 ms from uid 54321:

* `alone`: no flood (the reference latency);
* `reconnect`: the finding of issue 13: 40 idle clients from uid 65534 (nobody), each
  reconnecting as soon as the daemon closes it;
* `churn`: uid 65534 connects and closes as fast as one process can (no reply awaited);
* `burst`: 200 connects at once from uid 65534 (non-blocking: how many find the backlog full).

Configuration as shipped: control.max_connections 64, max_connections_per_uid 8,
listen_backlog 1024, header_timeout_s 5.

    python -m bench.flood [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import selectors
import signal
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import Goal, Result, print_table, write_result
from kvagentd.config import load_config
from kvagentd.control.authz import AccessPolicy
from kvagentd.control.router import Router
from kvagentd.control.server import ControlServer

FLOODER, PROBER, GROUP = 65534, 54321, 54321
FLOOD_CLIENTS = 40
BURST = 200


def _drop(uid: int) -> None:
    os.setgroups([GROUP])
    os.setgid(uid)
    os.setuid(uid)


def _child(fn: Any, *args: Any) -> tuple[int, int]:
    """Fork `fn(*args)` as a child; returns (pid, read end of its result pipe)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(r)
            out = json.dumps(fn(*args)).encode()
            while out:
                out = out[os.write(w, out):]
        except BaseException as exc:  # noqa: BLE001 - reported through the exit status
            print(f"bench.flood child: {exc!r}", file=sys.stderr)
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    return pid, r


def _collect(pid: int, r: int) -> Any:
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(data) if data else None


def _probe(path: str, seconds: float) -> list[tuple[int, float, int]]:
    _drop(PROBER)
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        status = 0
        tries = 0
        try:
            wait = 0.005
            while True:  # as kvctl does: a full accept queue (EAGAIN) is retried
                tries += 1
                try:
                    s.connect(path)
                    break
                except BlockingIOError:
                    if time.perf_counter() - t0 > 10:
                        raise
                    time.sleep(wait)
                    wait = min(wait * 2, 0.1)
            s.sendall(b"GET /v1/livez HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            reply = b""
            while chunk := s.recv(65536):
                reply += chunk
            status = int(reply.split(b" ", 2)[1]) if reply else 0
        except BlockingIOError:
            status = -11  # EAGAIN: the backlog was full
        except OSError:
            status = -1
        finally:
            s.close()
        out.append((status, time.perf_counter() - t0, tries))
        time.sleep(0.05)
    return out


def _reconnect_flood(path: str) -> None:
    _drop(FLOODER)
    sel = selectors.DefaultSelector()

    def connect() -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        sel.register(s, selectors.EVENT_READ)

    for _ in range(FLOOD_CLIENTS):
        connect()
    while True:
        for key, _ in sel.select():
            s = key.fileobj
            assert isinstance(s, socket.socket)
            try:
                data = s.recv(65536)
            except OSError:
                data = b""
            if not data:
                sel.unregister(s)
                s.close()
                connect()


def _churn_flood(path: str) -> None:
    _drop(FLOODER)
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(path)
        except OSError:
            pass  # backlog full: try again at once
        s.close()


def _burst(path: str) -> dict[str, int]:
    _drop(FLOODER)
    socks, eagain = [], 0
    request = b"GET /v1/livez HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    for _ in range(BURST):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(path)
            s.send(request)
            socks.append(s)
        except BlockingIOError:
            eagain += 1
            s.close()
    ok = refused = other = 0
    for s in socks:
        s.setblocking(True)
        s.settimeout(10)
        try:
            head = s.recv(65536).split(b"\r\n", 1)[0]
        except OSError:
            head = b""
        ok += b" 200 " in head
        refused += b" 503 " in head
        other += not head
        s.close()
    return {"connects": BURST, "eagain": eagain, "answered_200": ok, "answered_503": refused,
            "no_reply": other}


def _summary(probes: list[tuple[int, float, int]]) -> dict[str, Any]:
    ok = [t for st, t, _ in probes if st == 200]
    lat = sorted(ok) or [float("nan")]
    return {"probes": len(probes), "answered_200": len(ok),
            "answered_share": len(ok) / len(probes) if probes else 0.0,
            "statuses": {str(st): sum(1 for s, _, _ in probes if s == st) for st, _, _ in probes},
            "first_connect_share": sum(1 for _, _, n in probes if n == 1) / max(1, len(probes)),
            "p50_ms": statistics.median(lat) * 1000,
            "p99_ms": lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1000,
            "max_ms": lat[-1] * 1000}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.flood", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 s per scenario (smoke run)")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("bench.flood needs root: the flooder and the prober run as two other uids")
        return 1
    seconds = 2.0 if args.quick else 10.0
    d = Path(tempfile.mkdtemp(prefix="kvflood", dir="/tmp"))
    os.chmod(d, 0o755)
    cfg = load_config(None, env={})
    ctl = dataclasses.replace(cfg.control, socket=d / "k.sock", socket_mode=0o666,
                              socket_group="", operator_group="")
    router = Router()
    router.route("GET", "/v1/livez")(lambda req: {"alive": True})
    server = ControlServer(ctl, router, policy=AccessPolicy(0, GROUP, "bench", None, ""))
    server.start()
    path = str(ctl.socket)
    figures: dict[str, Any] = {"config": {"max_connections": ctl.max_connections,
                                          "max_connections_per_uid": ctl.max_connections_per_uid,
                                          "listen_backlog": ctl.listen_backlog,
                                          "header_timeout_s": ctl.header_timeout_s},
                               "seconds_per_scenario": seconds}
    try:
        for name, flood in (("alone", None), ("reconnect", _reconnect_flood),
                            ("churn", _churn_flood)):
            before = server.admission.status()
            fpid = _child(flood, path)[0] if flood is not None else None
            time.sleep(0.5 if fpid else 0.0)
            probes = _collect(*_child(_probe, path, seconds))
            if fpid is not None:
                os.kill(fpid, signal.SIGKILL)
                os.waitpid(fpid, 0)
            after = server.admission.status()
            figures[name] = {**_summary(probes),
                             "flood_refused": int(after["refused"]) - int(before["refused"])}
            time.sleep(0.5)
        figures["burst"] = _collect(*_child(_burst, path))
    finally:
        server.stop(1.0)
    rows = [[n, figures[n]["probes"], figures[n]["answered_200"],
             f"{100 * figures[n]['first_connect_share']:.0f} %", figures[n]["p50_ms"],
             figures[n]["p99_ms"], figures[n]["max_ms"], figures[n]["flood_refused"]]
            for n in ("alone", "reconnect", "churn")]
    print_table(["scenario", "probes", "answered 200", "first connect", "p50 ms", "p99 ms",
                 "max ms", "flood refused"], rows,
                title="Probes from uid 54321 while uid 65534 floods")
    b = figures["burst"]
    print_table(["burst connects", "EAGAIN", "200", "503 (uid share/rate)", "no reply"],
                [[b["connects"], b["eagain"], b["answered_200"], b["answered_503"],
                  b["no_reply"]]], title="Burst of requests from one uid")
    goals = [Goal("reconnect flood: probes answered", figures["reconnect"]["answered_share"],
                  ">=", 1.0),
             Goal("reconnect flood: probe p99", figures["reconnect"]["p99_ms"], "<=", 500.0,
                  " ms"),
             Goal("churn flood: probes answered", figures["churn"]["answered_share"], ">=", 0.95),
             Goal("burst of 200: connects refused (EAGAIN)", b["eagain"], "<=", 0),
             Goal("burst of 200: requests without a reply", b["no_reply"], "<=", 0)]
    result = Result("flood", "python -m bench.flood" + (" --quick" if args.quick else ""),
                    figures, goals)
    write_result(result)
    return 0 if all(g.passed for g in goals) else 1


if __name__ == "__main__":
    sys.exit(main())
