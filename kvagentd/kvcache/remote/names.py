"""Names of the keys kvagentd keeps in the remote store.

    <prefix>:kv:<ns>:<block key hex>        one block: a cold record (cold/record.py format)
    <prefix>:session:<ns>:<session id>      one session's manifest (a hash; fleet/handover.py)
    <prefix>:asset:<ns>:<asset>             the session an asset's agent writes now
    <prefix>:box:<box id>                   one box's heartbeat (JSON, expires)
    <prefix>:fleet                          sorted set: box id -> last heartbeat (unix s)

`<ns>` is the first 16 hex digits of the KV namespace (model fingerprint, dtype, block size,
layout version), so boxes with another model never see these blocks and sessions; the full
namespace is checked again in every record read. Every command names one key, so the same
names work on a Redis / Valkey Cluster (no cross-slot operations).
"""

from __future__ import annotations

from kvagentd.kvcache.base import BlockKey


class RemoteNames:
    def __init__(self, prefix: str, namespace: bytes) -> None:
        self.prefix = prefix
        self.ns = namespace.hex()[:16]

    def block(self, key: BlockKey) -> str:
        return f"{self.prefix}:kv:{self.ns}:{key.hex()}"

    def session(self, session_id: str) -> str:
        return f"{self.prefix}:session:{self.ns}:{session_id}"

    def asset(self, asset: str) -> str:
        return f"{self.prefix}:asset:{self.ns}:{asset}"

    def box(self, box_id: str) -> str:
        return f"{self.prefix}:box:{box_id}"

    @property
    def fleet(self) -> str:
        return f"{self.prefix}:fleet"
