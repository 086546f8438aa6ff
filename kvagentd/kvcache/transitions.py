"""State machines with explicit tables of allowed transitions, and their one error.

Block states (`state.py`), the cold tier's serving device (`cold/failover.py`) and the daemon's
phase each keep a table `{state: frozenset(next states)}`; a change outside it is a bug in the
caller and raises `IllegalTransition`. Imports nothing heavy, so the daemon can use it before
any service loads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

S = TypeVar("S")


class IllegalTransition(RuntimeError):
    """A state change outside its table of allowed transitions: a bug in the caller."""


def check_transition(table: Mapping[S, frozenset[S]], old: S, new: S, what: str) -> None:
    """Raise `IllegalTransition` unless `old -> new` is in `table`."""
    if new not in table[old]:
        raise IllegalTransition(f"illegal {what} change {_name(old)} -> {_name(new)}")


def _name(s: object) -> str:
    return str(getattr(s, "value", s))
