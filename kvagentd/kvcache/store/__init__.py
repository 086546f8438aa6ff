"""The tiered store: `TieredKVStore` (`tiered`), the facade, and what only it uses: the block
table (`table`, `leases`), block states (`state`), the arenas (`pool`), room-making and moves
(`room`, `mover`, `migration`), the cold tier's link (`coldlink`), persistence across restarts
(`persist`) and write-behind (`writebehind`)."""

from kvagentd.kvcache.store.tiered import TieredKVStore

__all__ = ["TieredKVStore"]
