"""Room-making and explicit moves as plans: pure functions from what the pools hold to an
ordered list of `Leg`s; the store executes a plan leg by leg (prepare -> copy -> complete).

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


class PoolState(NamedTuple):
    """What planning needs to know of one pool."""

    free: int
    idle: Callable[[int, set[BlockKey]], list[BlockKey]]  # up to n LRU idle blocks, excluding


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
