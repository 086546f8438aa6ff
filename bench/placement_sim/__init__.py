"""The placement simulator: tooling, not part of the daemon.

Replays request traces (synthetic workloads, a trace dumped by `kvctl trace dump`, or request
traces as JSON lines) against the daemon's own placement service over a simulated store.
"""
