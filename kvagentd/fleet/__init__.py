"""This box in a fleet sharing one remote store: session hand-over (`handover.py`, fenced by
the leases in `leases.py`), heartbeats and the fleet view (`heartbeat.py`), the `remote`
service (`service.py`) and its metrics (`metrics.py`)."""
