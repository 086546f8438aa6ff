"""Tiered KV cache: block pools, cold store, codecs, heat map, placement. Imports nothing else of kvagentd."""
