"""Storage fault injection around the cold store's `file_io` (tests, drills, the soak).

`FaultyFileIO(inner, plan)` forwards every file operation to `inner` (by default the cold
store's `kvagentd.kvcache.fileio.FileIO`, the real `os` calls) and, per `FaultPlan`, makes it
fail the way a dying SSD does:
- `read_eio_rate` / `write_eio_rate`: reads / writes (and fsyncs) raise EIO with that probability;
- `enospc`: every write raises ENOSPC; `erofs`: every write, fsync, truncate, rename, unlink
  and every open for writing raises EROFS;
- `torn_write_rate`: a write lands only its first part, then raises EIO (`torn_silent=True`:
  it reports full success instead, as after a power cut; the record's checksum catches it);
- `latency_s`: every operation sleeps first.
The plan can be swapped at run time (`set(...)`, `clear()`); `counts` tells what was injected.
Seeded: the same seed and operation sequence inject the same faults.

`from_debug_config(cfg.debug)` builds the plan of the `[debug]` config section (all off by
default, in which case the cold store gets the plain `file_io`).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from kvagentd.config import DebugConfig
from kvagentd.kvcache.fileio import FileIO

READ_OPS = frozenset({"pread", "read", "preadv", "readv", "readinto"})
WRITE_OPS = frozenset({"pwrite", "write", "pwritev", "writev"})
SYNC_OPS = frozenset({"fsync", "fdatasync", "sync_file_range"})
META_WRITE_OPS = frozenset({"ftruncate", "truncate", "fallocate", "posix_fallocate", "rename",
                            "replace", "unlink", "remove", "mkdir", "makedirs", "link",
                            "symlink", "write_bytes", "write_text"})
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


@dataclass(frozen=True, slots=True)
class FaultPlan:
    read_eio_rate: float = 0.0
    write_eio_rate: float = 0.0
    enospc: bool = False
    erofs: bool = False
    torn_write_rate: float = 0.0
    torn_silent: bool = False
    latency_s: float = 0.0

    @property
    def active(self) -> bool:
        return any((self.read_eio_rate, self.write_eio_rate, self.enospc, self.erofs,
                    self.torn_write_rate, self.latency_s))


def from_debug_config(d: DebugConfig) -> FaultPlan:
    return FaultPlan(read_eio_rate=d.fault_read_eio_rate, write_eio_rate=d.fault_write_eio_rate,
                     enospc=d.fault_enospc, erofs=d.fault_erofs,
                     torn_write_rate=d.fault_torn_write_rate, latency_s=d.fault_latency_s)


def _err(code: int, op: str) -> OSError:
    return OSError(code, f"{os.strerror(code)} (injected on {op})")


class FaultyFileIO:
    """A `file_io` that injects faults into `inner`'s operations. Thread-safe."""

    def __init__(self, inner: Any = None, plan: FaultPlan | None = None, *, seed: int = 0) -> None:
        self.inner = FileIO() if inner is None else inner
        self.plan = plan or FaultPlan()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()

    # ---- control -------------------------------------------------------------------------
    def set(self, **changes: Any) -> None:
        """Change the plan now, e.g. `set(write_eio_rate=1.0)`."""
        with self._lock:
            self.plan = dataclasses.replace(self.plan, **changes)

    def clear(self) -> None:
        with self._lock:
            self.plan = FaultPlan()

    def _roll(self, rate: float) -> bool:
        if rate <= 0.0:
            return False
        with self._lock:
            return self._rng.random() < rate

    def _count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    # ---- the injection -------------------------------------------------------------------
    def _before(self, op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        p = self.plan
        if p.latency_s > 0:
            time.sleep(p.latency_s)
        is_write = op in WRITE_OPS
        mutates = is_write or op in SYNC_OPS or op in META_WRITE_OPS
        if op == "open":
            flags = args[1] if len(args) > 1 else kwargs.get("flags", os.O_RDONLY)
            mode = args[1] if len(args) > 1 and isinstance(args[1], str) else kwargs.get("mode", "")
            mutates = (isinstance(flags, int) and bool(flags & _WRITE_FLAGS)) or (
                isinstance(mode, str) and any(c in mode for c in "wax+"))
        if p.erofs and mutates:
            self._count("erofs")
            raise _err(errno.EROFS, op)
        if p.enospc and (is_write or op in ("fallocate", "posix_fallocate")):
            self._count("enospc")
            raise _err(errno.ENOSPC, op)
        if op in READ_OPS and self._roll(p.read_eio_rate):
            self._count("read_eio")
            raise _err(errno.EIO, op)
        if (is_write or op in SYNC_OPS) and self._roll(p.write_eio_rate):
            self._count("write_eio")
            raise _err(errno.EIO, op)

    def _torn(self, op: str, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A write of which only the first part lands."""
        fd, data = args[0], args[1]
        view = memoryview(data).cast("B")
        with self._lock:
            cut = self._rng.randrange(0, max(1, len(view)))
        cut -= cut % 4096  # O_DIRECT needs aligned lengths
        rest = args[2:]
        if cut > 0:
            fn(fd, view[:cut], *rest, **kwargs)
        self._count("torn_write")
        if self.plan.torn_silent:
            return len(view)
        raise _err(errno.EIO, f"{op} (torn after {cut} of {len(view)} bytes)")

    def __getattr__(self, name: str) -> Any:
        target = getattr(self.inner, name)
        if not callable(target):
            return target

        def call(*args: Any, **kwargs: Any) -> Any:
            self._before(name, args, kwargs)
            if (name in ("pwrite", "write") and len(args) >= 2
                    and self._roll(self.plan.torn_write_rate)):
                return self._torn(name, target, args, kwargs)
            return target(*args, **kwargs)

        call.__name__ = name
        return call
