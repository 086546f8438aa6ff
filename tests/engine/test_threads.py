"""The model worker owns torch's intra-op pool alone (`engine/threads.py`)."""

from __future__ import annotations

import threading

import pytest
import torch

from kvagentd.engine.threads import in_pool, own_pool


def test_the_owner_computes_with_its_threads_and_later_threads_with_one() -> None:
    seen: dict[str, int] = {}
    owned = threading.Event()
    done = threading.Event()

    def owner() -> None:
        seen["owner"] = own_pool(2)
        owned.set()
        done.wait(10)
        seen["owner_after"] = torch.get_num_threads()

    def other() -> None:
        seen["other"] = torch.get_num_threads()

    t = threading.Thread(target=owner)
    t.start()
    assert owned.wait(10)
    o = threading.Thread(target=other)
    o.start()
    o.join()
    done.set()
    t.join()
    assert seen == {"owner": 2, "other": 1, "owner_after": 2}


def test_in_pool_returns_and_raises_in_the_caller() -> None:
    assert in_pool(torch.get_num_threads, 2) == 2
    with pytest.raises(ZeroDivisionError):
        in_pool(lambda: 1 / 0, 2)
