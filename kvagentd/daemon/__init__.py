"""The daemon: its lifecycle (`core.Daemon`), what the main loop is asked (`loop_requests`),
reload, exit codes, systemd notify, status probes, logging and its rate limiting (`log`,
`repeats`) and the host-specific install files (`deploy`).

NOTE: nothing is imported here, so the engine and the composition root can import `log`
without loading the daemon's lifecycle (and everything it builds)."""
