"""The `remote` service: this box in a fleet that shares one remote store.

- status and health of the remote tier (link, write-behind, reads) and of session hand-over;
- a heartbeat every `remote.heartbeat_interval_s` (the fleet view, `kvctl fleet`);
- adoption of sessions (`kvctl sessions adopt ID`), and of assets moved here in the config:
  at start, an asset configured here whose current session another box holds is adopted when
  that box is gone or no longer runs the asset; while a live box runs it, this box runs the
  asset's ticks without the model (`AssetGate`), so two boxes never write one asset.

Started after the engine (it writes the engine's session table) and before the agent (which it
tells where to continue); stopped before both, with a last heartbeat saying "stopped".
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from kvagentd.engine.sessions import Session
from kvagentd.fleet.handover import AssetGate, HandoverError, Manifest, SessionHandover
from kvagentd.fleet.heartbeat import Heartbeat
from kvagentd.fleet.leases import LeaseBook

if TYPE_CHECKING:
    from kvagentd.engine.service import Engine
    from kvagentd.kvcache.remote import RemoteStore

log = structlog.get_logger(__name__)

HEARTBEAT_JOB = "remote.heartbeat"
STOP_FLUSH_S = 5.0  # at stop, how long queued remote writes may take while the remote is up


class AssetSessions(Protocol):
    """What the fleet needs of the agent."""

    def resume_session(self, asset: str, session: str, tokens: int) -> None: ...

    def status(self) -> dict[str, Any]: ...


class AdoptRefused(RuntimeError):
    """An adoption the caller must confirm or retry: `kind` is alive, busy or held."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class FleetService:
    def __init__(self, remote: RemoteStore, leases: LeaseBook, handover: SessionHandover,
                 heartbeat: Heartbeat, gate: AssetGate, *, engine: Engine | None, scheduler: Any,
                 assets: tuple[str, ...] = (),
                 agent: AssetSessions | None = None,
                 health: Callable[[], dict[str, Any]] | None = None) -> None:
        self.remote = remote
        self.leases = leases
        self.handover = handover
        self.heartbeat = heartbeat
        self.gate = gate
        self.engine = engine
        self.scheduler = scheduler
        self.assets = assets
        self.agent = agent
        self.daemon_health = health
        self.started_at: float | None = None
        self._about: dict[str, Any] = {}

    @property
    def box(self) -> str:
        return self.handover.box

    # -- service -----------------------------------------------------------------------------
    def start(self) -> None:
        self.remote.link.probe(force=True)
        self._claim_assets()
        if self.scheduler is not None:
            self.scheduler.add_job(self.beat, "interval", seconds=self.heartbeat.interval_s,
                                   id=HEARTBEAT_JOB, name="fleet heartbeat", max_instances=1,
                                   coalesce=True, replace_existing=True)
        self.beat()
        self.started_at = time.time()
        log.info("fleet_started", box=self.box, url=self.remote.spec.display_url(),
                 link=self.remote.link.state.value, assets_elsewhere=self.gate.snapshot())

    def stop(self) -> None:
        if self.scheduler is not None and self.scheduler.get_job(HEARTBEAT_JOB) is not None:
            self.scheduler.remove_job(HEARTBEAT_JOB)
        # NOTE: the agent (and its event log) stopped before this service: the last heartbeat
        # repeats what the previous one said, marked stopped
        self.heartbeat.beat(self._about, stopping=True)
        # manifests still queued record their fencing token in the lease book when sent: send
        # them while it is open (the remote store itself closes after this service)
        if self.remote.link.up and not self.remote.writer.flush(STOP_FLUSH_S):
            log.warning("remote_writes_left_at_stop", queued=self.remote.writer.status()["queued"])
        self.leases.close()

    def reload(self, config: object) -> None:
        """Nothing of `[remote]` is reloadable (the connection is made at start)."""

    def status(self) -> dict[str, Any]:
        return {**self.remote.status(), "sessions": self.handover.status(),
                "fleet": {**self.heartbeat.status(),
                          "assets_elsewhere": self.gate.snapshot()}}

    def health(self) -> dict[str, Any]:
        h = self.remote.health()
        elsewhere = self.gate.snapshot()
        if elsewhere and h["status"] == "ok":
            runs = ", ".join(f"{a} on {b}" for a, b in sorted(elsewhere.items()))
            return {"status": "ok", "detail": f"{h['detail']}; configured assets run by other "
                                              f"boxes (no model turns here): {runs}"}
        return h

    # -- the heartbeat -------------------------------------------------------------------------
    def beat(self) -> None:
        """One heartbeat, after refreshing which configured assets other boxes run."""
        self._refresh_gate()
        self._about = self.describe()
        self.heartbeat.beat(self._about)

    def describe(self) -> dict[str, Any]:
        """What this box publishes in its heartbeat (besides id, time and state)."""
        from kvagentd import __version__

        out: dict[str, Any] = {"version": __version__}
        if self.engine is not None:
            e = self.engine.status()
            out["model"] = {"name": e["model"], "fingerprint": e["fingerprint"],
                            "dtype": e["dtype"], "sessions": e["sessions"]}
            tiers: Any = self.engine.store.stats().get("tiers", {})
            out["tiers"] = {t: {"blocks": v.get("blocks", 0), "bytes": v.get("bytes", 0)}
                            for t, v in tiers.items()}
        if self.agent is not None:
            out["assets"] = {name: {k: a.get(k) for k in ("session", "last_zone", "ticks",
                                                           "skipped_ticks", "llm_held_by")}
                             for name, a in self.agent.status().get("assets", {}).items()}
        wb = self.remote.writer.status()
        out["remote"] = {"queued_bytes": wb["queued_bytes"], "dropped": wb["dropped"]}
        if self.daemon_health is not None:
            h = self.daemon_health()
            out["health"] = {"status": h["status"],
                             "not_ok": [f"{c['name']}: {c['reason']}" for c in h["checks"]
                                        if c["status"] != "ok"]}
        return out

    def boxes(self) -> list[dict[str, Any]] | None:
        return self.heartbeat.boxes()

    # -- assets --------------------------------------------------------------------------------
    def _refresh_gate(self) -> None:
        for asset in self.assets:
            self.handover.refresh_asset(asset)

    def _claim_assets(self) -> None:
        """At start: adopt the current session of each configured asset whose holder box is
        gone or no longer runs it; leave the assets a live box runs to that box."""
        for asset in self.assets:
            sid = self.handover.asset_session(asset)
            held = self.handover.holder(sid) if sid else None
            if sid is None or held is None or held[0] == self.box:
                continue
            other = self.heartbeat.get(held[0])
            runs = (other or {}).get("assets", {}).get(asset)
            if other is not None and other.get("state") == "running" and runs is not None \
                    and runs.get("llm_held_by") is None:
                self.gate.held_by(asset, held[0])
                log.warning("asset_runs_elsewhere", asset=asset, box=held[0],
                            effect="ticks here run without the model")
                continue
            try:
                m = self.adopt(sid, force=True, uid=None)
            except (HandoverError, AdoptRefused) as exc:
                log.error("asset_adopt_failed", asset=asset, session=sid, error=str(exc))
                continue
            log.warning("asset_moved_here", asset=asset, session=sid, previous=m["from_box"])

    # -- adoption ------------------------------------------------------------------------------
    def adopt(self, sid: str, *, force: bool, uid: int | None) -> dict[str, Any]:
        """Take session `sid` over from the box that holds it; pull its manifest into the
        engine's session table and its blocks through the remote tier; continue it in the
        agent when it is an asset's session here. Refuses (`AdoptRefused`) a session a live
        box holds unless `force`, and one with a request in progress here. `uid`: the owner
        of an adopted user session (a daemon session stays the daemon's)."""
        if self.engine is None:
            raise HandoverError("unavailable", "no model is loaded: nothing can resume a session")
        if self.engine.executor.session_busy(sid):
            raise AdoptRefused("busy", f"session {sid!r} has a request in progress here")
        held = self.handover.holder(sid)
        if held is not None and held[0] == self.box:
            lease = self.leases.get(sid)
            if lease is not None and lease.held and self.engine.table.get(sid) is not None:
                raise AdoptRefused("held", f"this box ({self.box}) holds session {sid!r} already")
        if held is not None and held[0] != self.box and not force:
            other = self.heartbeat.get(held[0])
            if other is not None and other.get("state") == "running":
                age = time.time() - float(other.get("t", 0))
                raise AdoptRefused("alive", f"session {sid!r} is held by box {held[0]!r}, which "
                                            f"is alive (heartbeat {age:.0f} s ago); force to "
                                            "take it anyway (that box will stop writing it)")
        m = self.handover.adopt(sid)
        found = self._import(m, uid)
        asset = m.asset if m.asset in self.assets else None
        if asset is not None and self.agent is not None:
            self.agent.resume_session(asset, sid, len(m.token_ids))
            self.gate.held_by(asset, None)
        return {"session": sid, "from_box": m.adopted_from or None, "epoch": m.epoch,
                "tokens": len(m.token_ids), "turns": m.turns, "blocks": len(m.block_keys),
                "blocks_found": found, "asset": asset}

    def _import(self, m: Manifest, uid: int | None) -> int:
        """The manifest as this box's session; its blocks known to the store (found in the
        remote tier past what this box has) and pulled to warm before this returns, in large
        pipelined reads (a background pull moves a few blocks per read, and the session's first
        turn, which usually follows at once, would wait on each of them). Returns how many of
        its blocks are readable now."""
        assert self.engine is not None
        store = self.engine.store
        expect = store.block_keys(m.token_ids)[:len(m.block_keys)]
        if expect != m.block_keys:
            raise HandoverError("bad_manifest", f"session {m.session!r}: its block keys do not "
                                                "follow from its token ids here (another model?)")
        owner = None if not m.owner else uid
        self.engine.table.replace(Session(m.session, list(m.token_ids), list(m.block_keys),
                                          m.created, m.last_used, m.turns, owner))
        found = store.match_prefix(m.token_ids).keys
        if found:
            from kvagentd.kvcache.base import Tier

            store.promote(found, Tier.WARM)
        return len(found)
