"""Session hand-over between boxes through the remote store, fenced.

Every session this box publishes (`remote.publish_sessions`: the daemon's own by default) is
written after each turn as a *manifest* (a hash: token ids, block keys, turns, owner, the
holder box and its fencing token `epoch`) behind the blocks it names, in the same write-behind
queue; the TTL of those blocks is renewed with it (blocks the remote lost meanwhile are
counted, `blocks_missing`).

Another box with the same model adopts a session (`adopt`): one script raises the epoch and
names the new holder, atomically. From then on the manifest accepts writes only from that box
with that epoch (the PUBLISH script compares both), so the former holder never writes it
again, even when it comes back after a crash not knowing it lost it. This box learns that it
was fenced (and never writes the session locally again) when a write is refused, or earlier,
when a turn is about to start (`check_writable` asks the remote who holds the session).

Adopting pulls the manifest; the blocks follow through the remote tier (found by prefix
lookup, read, verified and kept locally), so the session resumes without recompute.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from kvagentd.engine.sessions import Session, SessionFenced, pack_ids, unpack_ids
from kvagentd.fleet.leases import LeaseBook
from kvagentd.kvcache.remote import Reply, RemoteStore, Task

log = structlog.get_logger(__name__)

KEY_BYTES = 16

# KEYS[1] manifest; ARGV: box, epoch (0: a session new to the fleet), ttl, field, value, ...
# Returns {1, box, epoch} when written, {0, holder, epoch} when another holder has it.
PUBLISH = """
local box = redis.call('HGET', KEYS[1], 'box')
local epoch = tonumber(redis.call('HGET', KEYS[1], 'epoch') or '0')
local mine = tonumber(ARGV[2])
if box then
  if box ~= ARGV[1] or epoch ~= mine then
    return {0, box, tostring(epoch)}
  end
elseif mine == 0 then
  epoch = 1
else
  epoch = mine
end
redis.call('HSET', KEYS[1], 'box', ARGV[1], 'epoch', epoch, unpack(ARGV, 4))
redis.call('EXPIRE', KEYS[1], ARGV[3])
return {1, ARGV[1], tostring(epoch)}
"""

# KEYS[1] manifest; ARGV: new holder box, ttl, now. Returns the manifest (HGETALL) after the
# epoch was raised and the holder set, or nil when there is no such session.
ADOPT = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  return nil
end
local prev = redis.call('HGET', KEYS[1], 'box') or ''
redis.call('HINCRBY', KEYS[1], 'epoch', 1)
redis.call('HSET', KEYS[1], 'box', ARGV[1], 'adopted_from', prev, 'updated', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[2])
return redis.call('HGETALL', KEYS[1])
"""


class HandoverError(RuntimeError):
    """An adoption that cannot happen: `kind` is unavailable, not_found or bad_manifest."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class Manifest:
    """A published session as the remote store holds it."""

    session: str
    token_ids: list[int]
    block_keys: list[bytes]
    turns: int
    created: float
    last_used: float
    owner: str  # "" for the daemon's own sessions, else the creating uid on its box
    asset: str  # the asset whose agent writes it ("" for none)
    box: str  # the holder
    epoch: int
    adopted_from: str = ""

    @classmethod
    def parse(cls, session: str, raw: dict[bytes, bytes], namespace: bytes) -> Manifest:
        """From HGETALL; raises HandoverError(bad_manifest) for anything malformed or of
        another namespace."""
        d = {k.decode(): v for k, v in raw.items()}
        try:
            if d["ns"].decode() != namespace.hex():
                raise ValueError("another model or KV layout (namespace differs)")
            ids, keys = d["ids"], d["keys"]
            if len(ids) % 4 or len(keys) % KEY_BYTES:
                raise ValueError("token ids or block keys truncated")
            return cls(session, unpack_ids(ids),
                       [keys[i:i + KEY_BYTES] for i in range(0, len(keys), KEY_BYTES)],
                       int(d["turns"]), float(d["created"]), float(d["last_used"]),
                       d.get("owner", b"").decode(), d.get("asset", b"").decode(),
                       d["box"].decode(), int(d["epoch"]), d.get("adopted_from", b"").decode())
        except (KeyError, ValueError, UnicodeDecodeError) as exc:
            raise HandoverError("bad_manifest", f"session {session!r}: bad manifest in the "
                                                f"remote store ({exc})") from None


def _fields(s: Session, namespace: bytes, asset: str) -> list[Any]:
    return ["ns", namespace.hex(), "ids", pack_ids(s.token_ids), "keys", b"".join(s.block_keys),
            "turns", s.turns, "created", s.created, "last_used", s.last_used,
            "owner", "" if s.owner is None else str(s.owner), "asset", asset,
            "updated", time.time()]


class AssetGate:
    """Which of this box's assets another box runs now: asset -> that box. The agent asks it
    before each tick's model turn (`Agent(llm_gate=...)`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._elsewhere: dict[str, str] = {}

    def __call__(self, asset: str) -> str | None:
        with self._lock:
            return self._elsewhere.get(asset)

    def held_by(self, asset: str, box: str | None) -> None:
        """`box` runs `asset` now (None: this box)."""
        with self._lock:
            if box is None:
                self._elsewhere.pop(asset, None)
            else:
                self._elsewhere[asset] = box

    def snapshot(self) -> dict[str, str]:
        with self._lock:
            return dict(self._elsewhere)


class SessionHandover:
    """The `SessionGuard` of the engine's session table, and adoption. `asset_of(session)`
    names the asset whose agent writes a session (None for others); `gate` learns which
    assets other boxes run (`refresh_asset`), at once when this box loses an asset's session."""

    def __init__(self, remote: RemoteStore, leases: LeaseBook, box: str, *, policy: str,
                 asset_of: Callable[[str], str | None], gate: AssetGate) -> None:
        self.remote = remote
        self.leases = leases
        self.box = box
        self.policy = policy
        self.asset_of = asset_of
        self.gate = gate
        self._lock = threading.Lock()
        self.counters = dict(published=0, fenced=0, publish_failed=0, refused_turns=0,
                             adopted=0, blocks_missing=0)

    def publishes(self, s: Session) -> bool:
        return self.policy == "all" or (self.policy == "daemon" and s.owner is None)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    # -- SessionGuard ----------------------------------------------------------------------
    def check_writable(self, session: Session) -> None:
        if not self.publishes(session):
            return
        sid = session.id
        lease = self.leases.get(sid)
        if lease is not None and not lease.held:
            self._refuse(sid, lease.fenced_by or "?")
        name = self.remote.names.session(sid)
        reply = self.remote.link.read(lambda c: c.hmget(name, ["box", "epoch"]))
        if not reply.ok or reply.value is None:
            return  # cannot ask now: the PUBLISH script still protects the remote copy
        box, epoch = reply.value
        if box is not None and box.decode() != self.box:
            self._fenced(sid, box.decode(), int(epoch or 0))
            self._refuse(sid, box.decode())

    def _refuse(self, sid: str, holder: str) -> None:
        self._count("refused_turns")
        raise SessionFenced(f"session {sid!r} is held by box {holder!r} now (handed over); "
                            f"this box ({self.box}) no longer writes it")

    def saved(self, session: Session) -> None:
        if not self.publishes(session):
            return
        lease = self.leases.get(session.id)
        if lease is not None and not lease.held:
            return
        snap = Session(session.id, list(session.token_ids), list(session.block_keys),
                       session.created, session.last_used, session.turns, session.owner)
        asset = self.asset_of(session.id) or ""
        nbytes = 4 * len(snap.token_ids) + KEY_BYTES * len(snap.block_keys) + 256
        self.remote.submit(Task(nbytes, lambda c: self._publish(c, snap, asset),
                                lambda r: self._published(snap.id, r)))

    def _publish(self, client: Any, s: Session, asset: str) -> Any:
        lease = self.leases.get(s.id)
        epoch = lease.epoch if lease is not None and lease.held else 0
        ttl = self.remote.ttl
        res = client.register_script(PUBLISH)(
            keys=[self.remote.names.session(s.id)],
            args=[self.box, epoch, ttl, *_fields(s, self.remote.namespace, asset)])
        if int(res[0]) != 1:
            return res
        # the session's blocks live as long as it does (shared ones were written long ago)
        pipe = client.pipeline(transaction=False)
        for k in s.block_keys:
            pipe.expire(self.remote.names.block(k), ttl)
        if asset:
            pipe.set(self.remote.names.asset(asset), s.id, ex=ttl)
        kept = pipe.execute()[:len(s.block_keys)]
        missing = sum(1 for x in kept if not x)
        if missing:
            self._count("blocks_missing", missing)
        return res

    def _published(self, sid: str, reply: Reply[Any]) -> None:
        if not reply.ok or reply.value is None:
            self._count("publish_failed")
            log.warning("session_publish_failed", session=sid, outcome=reply.outcome.value,
                        error=reply.error)
            return
        ok, box, epoch = int(reply.value[0]), reply.value[1].decode(), int(reply.value[2])
        if ok:
            self.leases.hold(sid, epoch)
            self._count("published")
        else:
            self._fenced(sid, box, epoch)

    def _fenced(self, sid: str, holder: str, epoch: int) -> None:
        self.leases.fence(sid, holder, epoch)
        self._count("fenced")
        log.warning("session_fenced", session=sid, holder=holder, epoch=epoch,
                    effect="this box no longer writes it")
        asset = self.asset_of(sid)
        if asset is not None:
            self.refresh_asset(asset)

    def refresh_asset(self, asset: str) -> None:
        """Ask the remote which box runs `asset` now (the holder of its current session) and
        tell the gate; nothing changes when the remote cannot say."""
        sid = self.asset_session(asset)
        held = self.holder(sid) if sid else None
        if held is not None:
            self.gate.held_by(asset, None if held[0] == self.box else held[0])

    # -- reading the fleet's sessions --------------------------------------------------------
    def holder(self, sid: str) -> tuple[str, int] | None:
        """(holder box, epoch) of a published session; None when unknown or unreachable."""
        name = self.remote.names.session(sid)
        reply = self.remote.link.read(lambda c: c.hmget(name, ["box", "epoch"]))
        if not reply.ok or reply.value is None or reply.value[0] is None:
            return None
        return reply.value[0].decode(), int(reply.value[1] or 0)

    def asset_session(self, asset: str) -> str | None:
        """The session the asset's agent writes now, as the fleet knows it."""
        name = self.remote.names.asset(asset)
        reply = self.remote.link.read(lambda c: c.get(name))
        return reply.value.decode() if reply.ok and reply.value is not None else None

    def adopt(self, sid: str) -> Manifest:
        """Take `sid` over: this box holds it from now on (fencing its former holder).
        Raises HandoverError."""
        name = self.remote.names.session(sid)
        ttl = self.remote.ttl
        reply = self.remote.link.write(
            lambda c: c.register_script(ADOPT)(keys=[name], args=[self.box, ttl, time.time()]))
        if not reply.ok:
            raise HandoverError("unavailable", f"the remote store cannot adopt {sid!r} now: "
                                               f"{reply.outcome.value} {reply.error}".rstrip())
        if reply.value is None:
            raise HandoverError("not_found", f"no session {sid!r} of this model in the remote "
                                             "store (expired, never published, or another model)")
        raw = dict(zip(reply.value[::2], reply.value[1::2]))
        m = Manifest.parse(sid, raw, self.remote.namespace)
        self.leases.hold(sid, m.epoch)
        self._count("adopted")
        log.warning("session_adopted", session=sid, previous_holder=m.adopted_from,
                    epoch=m.epoch, tokens=len(m.token_ids))
        return m

    def status(self) -> dict[str, Any]:
        held, fenced = self.leases.count()
        with self._lock:
            counters = dict(self.counters)
        return {"box": self.box, "policy": self.policy, "held": held, "fenced_sessions": fenced,
                **counters}
