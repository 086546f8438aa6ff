"""Room-making and explicit moves as plans: pure functions from what the pools hold to an
ordered list of `Leg`s; the store executes a plan leg by leg (prepare -> copy -> complete).

When no lower tier takes a pool's victims (the cold tier is read-only or refuses, warm is
full), `plan_drop` plans room by dropping the least recently used idle blocks instead
(`Drop`): a block is the KV of its session's token ids, so its tokens are recomputed when
next used. Pinned blocks and blocks in use are never idle, so never dropped.

A leg moves blocks between two tiers in one batch. `route` is the one place that decides
whether a move between hot and cold stages through warm (it must when the hot pool is on a
GPU: GPU <-> SSD always goes through host memory); every plan gets its legs from it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

from kvagentd.kvcache.base import BlockKey, Tier

ROUNDS = 4
"""How many plan -> apply rounds an operation tries when concurrent requests take the room it
made (or move a block it waits for) before it reports what it got."""


class Leg(NamedTuple):
    """Move `keys` from `src` to `dst` (tiers adjacent on the route, or direct)."""

    src: Tier
    dst: Tier
    keys: tuple[BlockKey, ...]


def route(src: Tier, dst: Tier, *, staged: bool) -> list[tuple[Tier, Tier]]:
    """The hops of a move from `src` to `dst`: through warm between hot and cold when
    `staged`, else direct."""
    if staged and {src, dst} == {Tier.HOT, Tier.COLD}:
        return [(src, Tier.WARM), (Tier.WARM, dst)]
    return [(src, dst)]


def _nothing(_n: int, _exclude: set[BlockKey]) -> list[BlockKey]:
    return []


class PoolState(NamedTuple):
    """What planning needs to know of one pool."""

    free: int
    idle: Callable[[int, set[BlockKey]], list[BlockKey]]  # up to n LRU idle blocks, excluding
    # up to n LRU idle blocks that have a cold copy (they can go to cold without a write)
    copied: Callable[[int, set[BlockKey]], list[BlockKey]] = _nothing


def plan_room(tier: Tier, need: int, pools: Mapping[Tier, PoolState], *, has_cold: bool,
              staged: bool, exclude: set[BlockKey] | frozenset[BlockKey] = frozenset()
              ) -> list[Leg] | None:
    """Legs that free `need` slots in `tier` (hot or warm) by demoting its least recently used
    idle blocks one tier down, first making room below for them in the same way. `[]` when
    there is room already; None when no idle block can go (nothing to demote, or nowhere).

    Hot victims go to warm as far as warm has (or can make) room; the rest go straight to cold
    where the route allows it. Warm victims go to cold.
    """
    short = need - pools[tier].free
    if short <= 0:
        return []
    ex = set(exclude)
    victims = pools[tier].idle(short, ex)
    if not victims:
        return None
    if tier is Tier.WARM:
        return [Leg(Tier.WARM, Tier.COLD, tuple(victims))] if has_cold else None
    legs: list[Leg] = []
    warm_room = pools[Tier.WARM].free
    if len(victims) > warm_room and has_cold:
        below = pools[Tier.WARM].idle(len(victims) - warm_room, ex)
        if below:
            legs.append(Leg(Tier.WARM, Tier.COLD, tuple(below)))
            warm_room += len(below)
    to_warm, rest = victims[:warm_room], victims[warm_room:]
    if to_warm:
        legs.append(Leg(Tier.HOT, Tier.WARM, tuple(to_warm)))
    if rest and has_cold and route(Tier.HOT, Tier.COLD, staged=staged) == [(Tier.HOT, Tier.COLD)]:
        legs.append(Leg(Tier.HOT, Tier.COLD, tuple(rest)))
    return legs or None


class Drop(NamedTuple):
    """Give up the slots of `keys` in `tier` (idle, unpinned blocks): one with a cold copy
    stays in the cold tier, the others are forgotten and recomputed when next used."""

    tier: Tier
    keys: tuple[BlockKey, ...]


def plan_drop(tier: Tier, need: int, pools: Mapping[Tier, PoolState],
              exclude: set[BlockKey] | frozenset[BlockKey] = frozenset()
              ) -> list[Leg | Drop] | None:
    """Steps that free `need` slots in `tier` (hot or warm) when nothing can be written below
    it. Idle blocks with a cold copy go first (to the cold tier, without a write); then warm
    drops its least recently used idle blocks; hot demotes its victims into warm, into room
    made there the same way (warm holds the colder blocks), and drops the rest. `[]` when
    there is room already; None when no idle block is left."""
    short = need - pools[tier].free
    if short <= 0:
        return []
    ex = set(exclude)
    steps: list[Leg | Drop] = []
    free_moves = pools[tier].copied(short, ex)
    if free_moves:
        steps.append(Drop(tier, tuple(free_moves)))
        short -= len(free_moves)
        ex.update(free_moves)
    victims = pools[tier].idle(short, ex) if short > 0 else []
    if not victims:
        return steps or None
    if tier is Tier.WARM:
        return [*steps, Drop(Tier.WARM, tuple(victims))]
    room = pools[Tier.WARM].free
    if len(victims) > room:
        want = len(victims) - room
        below = pools[Tier.WARM].copied(want, ex)
        below += pools[Tier.WARM].idle(want - len(below), ex | set(below)) \
            if len(below) < want else []
        if below:
            steps.append(Drop(Tier.WARM, tuple(below)))
            room += len(below)
    n_warm = min(len(victims), room)
    if n_warm:
        steps.append(Leg(Tier.HOT, Tier.WARM, tuple(victims[:n_warm])))
    if n_warm < len(victims):
        steps.append(Drop(Tier.HOT, tuple(victims[n_warm:])))
    return steps


def plan_moves(where: Iterable[tuple[BlockKey, Tier]], dst: Tier, *, staged: bool) -> list[Leg]:
    """Legs that move each `(key, current tier)` to `dst` along its route: every first hop
    before any second hop, one leg per (src, dst) pair, keys in the given order."""
    hops: list[dict[tuple[Tier, Tier], list[BlockKey]]] = [{}, {}]
    for key, src in where:
        if src is dst:
            continue
        for i, (a, b) in enumerate(route(src, dst, staged=staged)):
            hops[i].setdefault((a, b), []).append(key)
    return [Leg(a, b, tuple(keys)) for stage in hops for (a, b), keys in stage.items()]


def counts(legs: Sequence[Leg]) -> dict[tuple[Tier, Tier], int]:
    """Blocks per (src, dst) of a plan (for logs and tests)."""
    out: dict[tuple[Tier, Tier], int] = {}
    for leg in legs:
        out[(leg.src, leg.dst)] = out.get((leg.src, leg.dst), 0) + len(leg.keys)
    return out
