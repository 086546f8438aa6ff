"""Storage fault injection around the cold store's file operations (tests, drills, the soak).

`FaultyFileIO(inner, plan)` implements `FileOps` by forwarding every operation to `inner` (by
default `FileIO`, the real `os` calls) and, per `FaultPlan`, makes it fail the way a dying SSD
does:
- `read_eio_rate` / `write_eio_rate`: reads / writes (and fsyncs) raise EIO with that probability;
- `enospc`: every write raises ENOSPC; `erofs`: every write, fsync, truncate, rename, unlink
  and every open for writing raises EROFS;
- `torn_write_rate`: a write lands only its first part, then raises EIO (`torn_silent=True`:
  it reports full success instead, as after a power cut; the record's checksum catches it);
- `latency_s`: every operation sleeps first.
The plan can be swapped at run time (`set(...)`, `clear()`); `counts` tells what was injected.
Seeded: the same seed and operation sequence inject the same faults. The daemon builds the plan
from its `[debug]` config section (all off by default: the cold store gets plain `FileIO`).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvagentd.kvcache.fileio import FileIO, FileOps

T = TypeVar("T")

READ_OPS = frozenset({"preadv"})
WRITE_OPS = frozenset({"pwrite"})
SYNC_OPS = frozenset({"fsync"})
META_WRITE_OPS = frozenset({"rename", "unlink", "makedirs"})
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


def _err(code: int, op: str) -> OSError:
    return OSError(code, f"{os.strerror(code)} (injected on {op})")


class FaultyFileIO:
    """`FileOps` that injects faults into `inner`'s operations. Thread-safe."""

    O_DIRECT = FileIO.O_DIRECT

    def __init__(self, inner: FileOps | None = None, plan: FaultPlan | None = None, *,
                 seed: int = 0) -> None:
        self.inner: FileOps = FileIO() if inner is None else inner
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
            mutates = bool(int(args[1]) & _WRITE_FLAGS)
        if p.erofs and mutates:
            self._count("erofs")
            raise _err(errno.EROFS, op)
        if p.enospc and is_write:
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

    def _call(self, op: str, fn: Callable[..., T], *args: Any) -> T:
        self._before(op, args, {})
        return fn(*args)

    # ---- FileOps -------------------------------------------------------------------------
    def open(self, path: str, flags: int, mode: int = 0o640) -> int:
        return self._call("open", self.inner.open, path, flags, mode)

    def close(self, fd: int) -> None:
        self._call("close", self.inner.close, fd)

    def pwrite(self, fd: int, data: memoryview | bytes, offset: int) -> int:
        self._before("pwrite", (fd, data, offset), {})
        if self._roll(self.plan.torn_write_rate):
            return int(self._torn("pwrite", self.inner.pwrite, (fd, data, offset), {}))
        return self.inner.pwrite(fd, data, offset)

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        return self._call("preadv", self.inner.preadv, fd, buffers, offset)

    def fsync(self, fd: int) -> None:
        self._call("fsync", self.inner.fsync, fd)

    def fsync_dir(self, path: str) -> None:
        self._call("fsync_dir", self.inner.fsync_dir, path)

    def unlink(self, path: str) -> None:
        self._call("unlink", self.inner.unlink, path)

    def rename(self, src: str, dst: str) -> None:
        self._call("rename", self.inner.rename, src, dst)

    def size(self, path: str) -> int:
        return self._call("size", self.inner.size, path)

    def makedirs(self, path: str) -> None:
        self._call("makedirs", self.inner.makedirs, path)
