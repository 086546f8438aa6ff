"""Authorization from SO_PEERCRED: a child process drops to another uid/gid and connects."""

from __future__ import annotations

import grp
import os
from pathlib import Path

import pytest

from kvagentd.control.authz import AccessPolicy
from kvagentd.control.errors import Forbidden
from kvagentd.control.router import Peer
from tests.control.conftest import (NOBODY, make_config, request_as, start_harness,
                                    two_groups)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another uid needs root")


@pytest.fixture
def open_harness(short_dir: Path):
    """Socket and directory world-accessible, so that only the route authorization decides."""
    reader, operator = two_groups()
    cfg = make_config(short_dir, socket_mode=0o666, socket_group=reader.gr_name,
                      operator_group=operator.gr_name)
    (short_dir / "run").mkdir(mode=0o755)
    os.chmod(short_dir, 0o755)
    h = start_harness(cfg)
    yield h, reader.gr_gid, operator.gr_gid
    h.server.stop(1.0)


def test_stranger_gets_403_naming_who_may(open_harness) -> None:
    h, reader, operator = open_harness
    status, body = request_as(h.path, "GET", "/v1/status", uid=NOBODY, gid=NOBODY, groups=[])
    assert status == 403 and body["error"]["kind"] == "forbidden"
    msg = body["error"]["message"]
    assert "uid 65534" in msg and "root" in msg
    assert grp.getgrgid(reader).gr_name in msg
    status, body = request_as(h.path, "POST", "/v1/shutdown", uid=NOBODY, gid=NOBODY, groups=[])
    assert status == 403
    assert grp.getgrgid(operator).gr_name in body["error"]["message"]
    assert h.daemon.shutdown_requests == []
    assert h.alive()


def test_socket_group_member_may_read_but_not_change(open_harness) -> None:
    h, reader, operator = open_harness
    status, body = request_as(h.path, "GET", "/v1/status", uid=NOBODY, gid=NOBODY,
                               groups=[reader])
    assert status == 200 and body["version"] == "test"
    status, body = request_as(h.path, "POST", "/test/change", uid=NOBODY, gid=NOBODY,
                               groups=[reader])
    assert status == 403 and "changes daemon state" in body["error"]["message"]


def test_primary_gid_counts_as_membership(open_harness) -> None:
    h, reader, _ = open_harness
    status, _ = request_as(h.path, "GET", "/v1/livez", uid=NOBODY, gid=reader, groups=[])
    assert status == 200


def test_operator_may_change_and_read(open_harness) -> None:
    h, _, operator = open_harness
    status, body = request_as(h.path, "POST", "/v1/shutdown", uid=NOBODY, gid=NOBODY,
                               groups=[operator])
    assert status == 200 and body == {"stopping": True}
    assert h.daemon.shutdown_requests and "uid 65534" in h.daemon.shutdown_requests[0]
    status, _ = request_as(h.path, "GET", "/v1/config", uid=NOBODY, gid=NOBODY,
                            groups=[operator])
    assert status == 200


def test_default_permissions_keep_strangers_off_the_socket(short_dir: Path) -> None:
    os.chmod(short_dir, 0o755)
    h = start_harness(make_config(short_dir))  # socket 0660, directory 0750, root-owned
    try:
        status, _ = request_as(h.path, "GET", "/v1/status", uid=NOBODY, gid=NOBODY, groups=[])
        assert status == -1  # EACCES at connect(): the file system already says no
    finally:
        h.server.stop(1.0)


def test_policy_rules_without_sockets() -> None:
    policy = AccessPolicy(daemon_uid=998, read_gid=998, read_group="kvagent", operator_gid=999,
                          operator_group="kvagent-operators")
    root, daemon = Peer(1, 0, 0), Peer(1, 998, 998)
    reader, operator = Peer(1, 1000, 1000, frozenset({998})), Peer(1, 1001, 1001, frozenset({999}))
    stranger = Peer(1, 1002, 1002)
    for p in (root, daemon, reader, operator):
        assert policy.may_read(p)
    assert not policy.may_read(stranger)
    assert [policy.may_change(p) for p in (root, daemon, reader, operator, stranger)] == [
        True, True, False, True, False]
    with pytest.raises(Forbidden, match="kvagent-operators"):
        policy.check(reader, "POST", "/v1/defrag", change=True)
    no_ops = AccessPolicy(998, 998, "kvagent", None, "")
    assert not no_ops.may_change(operator)


def test_policy_from_config_with_missing_groups_allows_only_root_and_daemon() -> None:
    policy = AccessPolicy.from_config("no-such-group-kv", "no-such-group-ops", daemon_uid=998,
                                      daemon_gid=998)
    assert policy.read_gid is None and policy.operator_gid is None
    assert policy.may_change(Peer(1, 998, 998)) and policy.may_read(Peer(1, 0, 0))
    assert not policy.may_read(Peer(1, 1000, 998))
    own = AccessPolicy.from_config("", "", daemon_uid=998, daemon_gid=4242)
    assert own.read_gid == 4242 and own.may_read(Peer(1, 1000, 4242))


def test_an_operator_needs_only_the_operator_group(short_dir: Path) -> None:
    """Finding 4 of issue 13: with the default 0660 socket in a 0750 directory, a member of the
    operator group alone got EACCES; the daemon's ACL entry lets the group in."""
    reader, operator = two_groups()
    os.chmod(short_dir, 0o755)
    h = start_harness(make_config(short_dir, socket_group=reader.gr_name,
                                  operator_group=operator.gr_name))
    try:
        assert os.stat(h.path).st_mode & 0o777 == 0o660
        assert os.stat(h.path.parent).st_mode & 0o777 == 0o750
        status, body = request_as(h.path, "POST", "/test/change", uid=NOBODY, gid=NOBODY,
                                  groups=[operator.gr_gid])
        assert status == 200 and body == {"changed": True}
        status, _ = request_as(h.path, "GET", "/v1/status", uid=NOBODY, gid=NOBODY,
                               groups=[operator.gr_gid])
        assert status == 200
        status, _ = request_as(h.path, "GET", "/v1/status", uid=NOBODY, gid=NOBODY,
                               groups=[reader.gr_gid])
        assert status == 200
        status, _ = request_as(h.path, "GET", "/v1/status", uid=NOBODY, gid=NOBODY, groups=[])
        assert status == -1  # strangers still stop at the file system
    finally:
        h.server.stop(1.0)


def test_acl_entries_round_trip_and_keep_the_mode(tmp_path: Path) -> None:
    from kvagentd.control import acl

    f = tmp_path / "f"
    f.write_text("x")
    os.chmod(f, 0o640)
    acl.grant_group(f, 4242, acl.R | acl.W)
    assert acl.group_perm(f, 4242) == acl.R | acl.W
    assert os.stat(f).st_mode & 0o777 == 0o660  # the group bits show the mask
    acl.grant_group(f, 4343, acl.R)
    acl.grant_group(f, 4242, acl.R)  # replaced, not added
    entries = acl.read(f)
    assert entries[(acl.GROUP, 4242)] == acl.R and entries[(acl.GROUP, 4343)] == acl.R
    assert entries[(acl.GROUP_OBJ, acl.UNDEFINED_ID)] == acl.R
    assert entries[(acl.MASK, acl.UNDEFINED_ID)] == acl.R
    assert acl.decode(acl.encode(entries)) == entries
    with pytest.raises(ValueError):
        acl.decode(b"\x02\x00\x00\x00\x01")
