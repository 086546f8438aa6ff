"""Who computes with several cores: the model worker owns torch's intra-op pool, alone.

torch's CPU build runs its intra-op parallelism on GNU OpenMP, and libgomp keeps one thread
team per OS thread that ever ran a parallel region. Once more libgomp threads exist than CPUs
(two teams of two on a two-core box), libgomp stops spinning between parallel regions and
every region pays a futex wake-up. A decode step is hundreds of small regions, so the same
forward measured 82 ms in a second thread against 54 ms in the first (SmolLM2, one sequence,
2 threads, 1,500 tokens; 150 one-row 576x1536 linears: 35 ms against 23 ms).

So the process keeps exactly one multi-threaded team:
- `single_threaded_default()` (at process start, before any torch work): every thread
  computes with one thread unless it owns the pool;
- `own_pool(threads)` in the model worker: that thread computes with `threads`;
- `in_pool(fn, threads)` runs heavy one-off work (model loading, a benchmark's reference
  run) in a short-lived thread, whose team goes away with it.

torch keeps the thread count per OS thread (OpenMP's `nthreads-var` and MKL's local setting);
its process-wide default only seeds threads that start later, which is why `own_pool` sets
the default back to one after taking its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")

_lock = threading.Lock()


def single_threaded_default() -> None:
    """Threads that do not own the pool compute single-threaded (call once, early)."""
    with _lock:
        torch.set_num_threads(1)


def own_pool(threads: int) -> int:
    """Make the calling thread compute with `threads` intra-op threads; every thread started
    afterwards keeps the single-threaded default. Returns the count in effect here."""
    with _lock:
        torch.zeros(1).add_(1)  # the per-thread lazy init runs now, not after the set below
        torch.set_num_threads(max(1, threads))
        got = torch.get_num_threads()
        # NOTE: set_num_threads also moved the process default; put it back without touching
        # this thread's own setting (a helper thread sets it for itself and exits).
        helper = threading.Thread(target=torch.set_num_threads, args=(1,),
                                  name="kvagentd-threads")
        helper.start()
        helper.join()
    return got


def in_pool(fn: Callable[[], T], threads: int, name: str = "kvagentd-pool") -> T:
    """`fn()` run in a new thread that owns `threads` intra-op threads; its OpenMP team ends
    with the thread. Exceptions propagate."""
    out: list[T] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            own_pool(threads)
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            err.append(exc)

    t = threading.Thread(target=run, name=name)
    t.start()
    t.join()
    if err:
        raise err[0]
    return out[0]
