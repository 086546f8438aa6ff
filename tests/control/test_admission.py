"""Connection admission without sockets: per-uid share, rate, total cap, tarpit."""

from __future__ import annotations

import socket

from kvagentd.control.admission import Admission
from kvagentd.control.router import Peer


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_share_total_and_release() -> None:
    a = Admission(max_total=5, max_per_uid=3, rate_per_uid=1000.0, clock=Clock())
    alice, bob, carol = Peer(1, 1000, 1000), Peer(2, 1001, 1001), Peer(3, 1002, 1002)
    assert [a.admit(alice) for _ in range(3)] == [None] * 3
    r = a.admit(alice)
    assert r is not None and r.per_uid and "uid 1000" in r.message
    assert a.admit(bob) is None and a.admit(bob) is None
    r = a.admit(carol)  # the total is reached, carol holds nothing
    assert r is not None and not r.per_uid and "max_connections = 5" in r.message
    a.release(alice)
    assert a.admit(carol) is None
    assert a.held == 5 and a.held_by_uid() == {1000: 2, 1001: 2, 1002: 1}
    assert a.refused == 2 and a.refused_per_uid == 1


def test_connect_rate_per_uid() -> None:
    clock = Clock()
    a = Admission(max_total=100, max_per_uid=2, rate_per_uid=10.0, clock=clock)
    p = Peer(1, 1000, 1000)
    admitted = 0
    for _ in range(40):  # connect and hang up at once, in a loop
        if a.admit(p) is None:
            admitted += 1
            a.release(p)
    assert admitted == 12  # the burst: max_per_uid + one second of rate
    r = a.admit(p)
    assert r is not None and r.per_uid and "connect_rate_per_uid" in r.message
    clock.t += 0.5  # five tokens come back
    results = [a.admit(p) for _ in range(2)]
    assert results == [None, None]
    assert a.admit(Peer(2, 1001, 1001)) is None  # another uid is not affected


def test_tarpit_answers_after_the_delay() -> None:
    clock = Clock()
    a = Admission(max_total=10, max_per_uid=1, rate_per_uid=1000.0, delay_s=0.5, tarpit_max=2,
                  clock=clock)
    p = Peer(1, 1000, 1000)
    assert a.admit(p) is None
    pairs = [socket.socketpair() for _ in range(3)]
    for server_end, _ in pairs:
        r = a.admit(p)
        assert r is not None
        a.refuse(server_end, r)
    pairs[2][1].settimeout(1)
    assert b"503" in pairs[2][1].recv(4096)  # the tarpit was full: answered at once
    pairs[0][1].setblocking(False)
    a.reap()
    try:
        pairs[0][1].recv(4096)
        raise AssertionError("answered before the delay")
    except BlockingIOError:
        pass
    clock.t += 0.6
    a.reap()
    for _, client in pairs[:2]:
        client.settimeout(1)
        reply = client.recv(4096)
        assert reply.startswith(b"HTTP/1.1 503") and b"overloaded" in reply
        assert client.recv(4096) == b""  # and closed
    assert a.status()["tarpit"] == 0


def test_a_flooding_uid_is_shed_for_the_rest_of_its_window() -> None:
    """SHED_AFTER refusals within a window: that uid's connections are closed unanswered until
    the window ends; other uids are not touched; after it, the uid is judged again."""
    from kvagentd.control.admission import SHED_AFTER, SHED_WINDOW_S

    clock = Clock()
    a = Admission(max_total=100, max_per_uid=1, rate_per_uid=1.0, clock=clock)
    flooder, other = Peer(pid=1, uid=65534, gid=65534), Peer(pid=2, uid=1000, gid=1000)
    assert a.admit(flooder) is None  # its one slot
    refusals = 0
    while not a.shedding(flooder.uid):
        assert a.admit(flooder) is not None
        refusals += 1
        assert refusals <= SHED_AFTER
    assert refusals == SHED_AFTER and a.shed == 1
    assert not a.shedding(other.uid) and a.admit(other) is None
    assert a.shedding(flooder.uid) and a.shed == 2
    clock.t += SHED_WINDOW_S
    assert not a.shedding(flooder.uid)  # judged again: refused (and answered) first
    assert a.status()["shed"] == 2
