"""Ways to reach the remote store: TLS with an ACL user and password, a cluster, bad credentials;
and the composition root's reading of the password from a file or a systemd credential."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvagentd.config import ConfigError, load_config
from kvagentd.kvcache.remote import LinkState, Outcome, RemoteLink
from kvagentd.services import remote_spec
from tests.redisd import make_tls, redis_fixture

from .conftest import compute, make_box, spec_for

IDS = list(range(300, 300 + 4 * 16))


def _round_trip(rdir: Path, spec) -> None:
    a = make_box(rdir / "a", spec)
    b = make_box(rdir / "b", spec)
    try:
        keys = compute(a, "s", IDS)
        assert a.remote.writer.flush(10.0)
        assert a.remote.status()["write_behind"]["written"] == 4, a.remote.status()
        res = b.store.ensure_resident(b.store.match_prefix(IDS).keys, "s")
        assert res.missing_from is None and len(res.slots) == len(keys) == 4
        b.store.release("s")
    finally:
        a.close()
        b.close()


def test_tls_with_acl_user_and_password(rdir: Path) -> None:
    tls = make_tls(rdir / "tls")
    for server in redis_fixture(rdir / "redis", tls=tls, users={"kvagent": "s3cret-pw"}):
        assert server.url.startswith("rediss://")
        _round_trip(rdir, spec_for(server, username="kvagent", password="s3cret-pw",
                                   tls_ca_file=tls.ca))

        # the wrong password is an answer of the server, not an outage: counted, never retried
        bad = RemoteLink(spec_for(server, username="kvagent", password="wrong",
                                  tls_ca_file=tls.ca))
        reply = bad.read(lambda c: c.ping())
        assert reply.outcome is Outcome.FAILED and "Authentication" in reply.error
        assert bad.state is LinkState.UP
        # a server certificate from an unknown CA is refused (no TLS without verification)
        untrusted = RemoteLink(spec_for(server, username="kvagent", password="s3cret-pw",
                                        tls_ca_file=None))
        assert untrusted.read(lambda c: c.ping()).outcome is Outcome.DOWN


def test_single_node_cluster(rdir: Path) -> None:
    for server in redis_fixture(rdir / "redis", cluster=True):
        _round_trip(rdir, spec_for(server, cluster=True))
        # a cluster with no reachable node: the client cannot even be built; an outage, not
        # an exception out of a request
        server.kill()
        link = RemoteLink(spec_for(server, cluster=True))
        reply = link.read(lambda c: c.exists("k"))
        assert reply.outcome is Outcome.DOWN and link.state is LinkState.DOWN
        assert not link.probe(force=True)


def _config(tmp: Path, extra: str) -> Path:
    p = tmp / "c.toml"
    p.write_text(f'[remote]\nurl = "rediss://127.0.0.1:6380/0"\nusername = "kv"\n{extra}\n')
    return p


def test_password_from_a_file_or_a_systemd_credential(tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("from-file\n")
    spec = remote_spec(load_config(_config(tmp_path, f'password_file = "{tmp_path}/pw"'),
                                   env={}), env={})
    assert spec is not None and spec.password == "from-file" and spec.username == "kv"
    assert "from-file" not in repr(spec)

    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "redis-password").write_text("from-credential")
    cfg = load_config(_config(tmp_path, 'password_credential = "redis-password"'), env={})
    spec = remote_spec(cfg, env={"CREDENTIALS_DIRECTORY": str(creds)})
    assert spec is not None and spec.password == "from-credential"

    with pytest.raises(ConfigError) as exc:
        remote_spec(cfg, env={})
    assert exc.value.path == "remote.password_credential"
    with pytest.raises(ConfigError) as exc:
        remote_spec(load_config(_config(tmp_path, f'password_file = "{tmp_path}/nope"'),
                                env={}), env={})
    assert exc.value.path == "remote.password_file"


@pytest.mark.parametrize("text,path", [
    ('[remote]\nurl = "http://x"', "remote.url"),
    ('[remote]\nurl = "redis://kv:secret@h:6379/0"', "remote.url"),
    ('[remote]\nurl = "redis://h:6379/0"\ntls_ca_file = "/etc/ca.pem"', "remote.url"),
    ('[remote]\nurl = "unix:///run/r.sock"\ncluster = true', "remote.cluster"),
    ('[remote]\nurl = "redis://h/0"\npassword_file = "/p"\npassword_credential = "c"',
     "remote.password_credential"),
    ('[remote]\nurl = "redis://h/0"\nbox_id = "a b"', "remote.box_id"),
    ('[remote]\nurl = "redis://h/0"\nbox_id = "edge:7"', "remote.box_id"),
    ('[remote]\nurl = "redis://h/0"\nread_timeout_s = 0', "remote.read_timeout_s"),
])
def test_bad_remote_config_names_the_field(tmp_path: Path, text: str, path: str) -> None:
    p = tmp_path / "c.toml"
    p.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_config(p, env={})
    assert exc.value.path == path
    assert "secret" not in str(exc.value)


def test_replies_parsed_by_hiredis_and_large_values_sent_unjoined(rdir: Path) -> None:
    """The remote extra installs hiredis (reply parsing); commands keep redis-py's Python
    packer, which sends a large value as it is; a record's bytes round-trip either way."""
    import redis.utils
    from redis.connection import PythonRespSerializer

    from kvagentd.kvcache.remote import make_client

    assert redis.utils.HIREDIS_AVAILABLE, "pip install 'kvagentd[remote]' installs hiredis"
    for server in redis_fixture(rdir / "redis"):
        client = make_client(spec_for(server), 2.0)
        try:
            packer = client.connection_pool.connection_kwargs["command_packer"]
            assert isinstance(packer, PythonRespSerializer)
            value = bytearray(range(256)) * 4096  # 1 MiB, past the cutoff
            chunks = packer.pack("SET", "k", value)
            assert any(c is value for c in chunks)  # not copied into a joined buffer
            pipe = client.pipeline(transaction=False)
            pipe.set("k", value)
            pipe.get("k")
            assert pipe.execute()[1] == bytes(value)
        finally:
            client.close()
