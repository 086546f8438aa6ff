"""The shared remote tier on Redis / Valkey, below this box's cold tier: the link and its state
(`link.py`), key names (`names.py`), records in the cold format (`records.py`), the
write-behind queue (`writer.py`), the remote store as this box uses it (`store.py`) and the
`ColdTier` wrapper the block store sees (`tier.py`)."""

from kvagentd.kvcache.remote.link import (ClientFactory, LinkState, Outcome, RemoteLink, RemoteSpec,
                                          Reply, make_client)
from kvagentd.kvcache.remote.names import RemoteNames
from kvagentd.kvcache.remote.records import RemoteRecords
from kvagentd.kvcache.remote.store import RemoteStore
from kvagentd.kvcache.remote.tier import RemoteColdTier
from kvagentd.kvcache.remote.writer import Task, WriteBehind

__all__ = ["ClientFactory", "LinkState", "Outcome", "RemoteColdTier", "RemoteLink", "RemoteNames",
           "RemoteRecords", "RemoteSpec", "RemoteStore", "Reply", "Task", "WriteBehind",
           "make_client"]
