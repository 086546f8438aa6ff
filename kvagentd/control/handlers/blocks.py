"""Block store routes: per-tier and per-session views, migrate, pin / unpin, cold verify.

`deps.services.store` is the `TieredKVStore` (None until started).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvagentd.control.deps import ControlDeps
from kvagentd.control.errors import BadRequest, NotFound, require_service
from kvagentd.control.progress import stream_work
from kvagentd.control.router import Request, Router
from kvagentd.kvcache.base import Tier
from kvagentd.kvcache.keys import parse_key

if TYPE_CHECKING:
    from kvagentd.kvcache.store import TieredKVStore

MIGRATE_CHUNK = 64  # blocks moved per step of a migration (a progress line each)


def register(router: Router, deps: ControlDeps) -> None:

    def store() -> TieredKVStore:
        return require_service(deps.services.store, "the block store is not running")

    def target_keys(s: TieredKVStore, body: dict[str, Any]) -> list[bytes]:
        """Keys named by {"session": ID} or {"block": HEX}; exactly one of them."""
        session, block = body.get("session"), body.get("block")
        if (session is None) == (block is None):
            raise BadRequest("give exactly one of 'session' or 'block'")
        if session is not None:
            if not isinstance(session, str) or not session:
                raise BadRequest("'session' must be a non-empty string")
            keys = s.keys_of_session(session)
            if not keys:
                raise NotFound(f"no blocks for session {session!r}")
            return keys
        try:
            key = parse_key(str(block))
        except ValueError as exc:
            raise BadRequest(f"'block' must be a 32-digit hex key: {exc}") from None
        if not any(b.key == key for b in s.snapshot()):
            raise NotFound(f"no block {key.hex()}")
        return [key]

    @router.route("GET", "/v1/blocks", change=False)
    def blocks(req: Request) -> dict[str, Any]:
        s = store()
        st = s.stats()
        tiers = {}
        for name, t in st["tiers"].items():
            tiers[name] = {k: t.get(k) for k in ("blocks", "bytes", "capacity", "used", "free",
                                                 "largest_free_run", "fragmentation", "bytes_used",
                                                 "capacity_bytes", "read_only", "codec") if k in t}
        sessions = [{"session": name, **counts, "total": sum(counts.values())}
                    for name, counts in sorted(s.session_blocks().items())]
        out = {"block_bytes": st["block_bytes"], "blocks": st["blocks"], "states": st["states"],
               "pinned": st["pinned"], "in_use": st["in_use"], "lost": st["lost"],
               "tiers": tiers, "sessions": sessions}
        only = req.query.get("session")
        if only:
            rows = [b for b in s.snapshot() if only in b.sessions]
            if not rows:
                raise NotFound(f"no blocks for session {only!r}")
            out["session_blocks"] = [{"key": b.key.hex(), "tier": b.tier.value if b.tier else None,
                                      "pinned": b.pinned, "in_use": b.in_use,
                                      "last_access": b.last_access} for b in rows]
        return out

    @router.route("POST", "/v1/blocks/migrate", change=True)
    def migrate(req: Request) -> Any:
        """{"session"|"block", "to", "stream"?}; streamed: {"progress": {done, total}} lines
        (blocks handled), then {"result": ...}."""
        body = req.json_object()
        to = body.get("to")
        try:
            tier = Tier(to)
        except ValueError:
            raise BadRequest(f"'to' must be one of hot, warm, cold; got {to!r}") from None
        s = store()
        keys = target_keys(s, body)
        if body.get("stream", False) is True:
            return stream_work("migrate", lambda report: _migrate(s, keys, tier, report))
        return _migrate(s, keys, tier, None)

    def _migrate(s: Any, keys: list[bytes], tier: Tier, report: Any) -> dict[str, Any]:
        where = {b.key: b.tier for b in s.snapshot()}
        moved = 0
        for i in range(0, len(keys), MIGRATE_CHUNK):
            chunk = keys[i:i + MIGRATE_CHUNK]
            up = [k for k in chunk if where.get(k) is not None and tier.above(where[k])]
            down = [k for k in chunk if where.get(k) is not None and where[k].above(tier)]
            moved += (s.promote(up, tier) if up else 0) + (s.demote(down, tier) if down else 0)
            if report is not None:
                report({"done": min(len(keys), i + MIGRATE_CHUNK), "total": len(keys),
                        "moved": moved})
        already = sum(1 for k in keys if where.get(k) is tier)
        return {"to": tier.value, "requested": len(keys), "moved": moved, "already": already,
                "skipped": len(keys) - moved - already}

    @router.route("POST", "/v1/blocks/pin", change=True)
    def pin(req: Request) -> dict[str, Any]:
        s = store()
        keys = target_keys(s, req.json_object())
        s.pin(keys)
        return {"pinned": len(keys)}

    @router.route("POST", "/v1/blocks/unpin", change=True)
    def unpin(req: Request) -> dict[str, Any]:
        s = store()
        keys = target_keys(s, req.json_object())
        s.unpin(keys)
        return {"unpinned": len(keys)}

    @router.route("POST", "/v1/verify", change=True)
    def verify(req: Request) -> Any:
        """{"repair"?, "stream"?}; streamed: {"progress": {done, total}} lines (records read),
        then {"result": ...}."""
        body = req.json_object()
        repair = body.get("repair", False)
        if not isinstance(repair, bool):
            raise BadRequest("'repair' must be true or false")
        s = store()
        if body.get("stream", False) is True:
            return stream_work("verify", lambda report: s.verify(
                repair=repair, progress=lambda done, total: report({"done": done,
                                                                    "total": total})))
        return s.verify(repair=repair)
