"""The warp-specialized kernel's synchronization protocol (csrc/kernels/conv_tma.cuh), checked
on a model that runs on any machine: a producer fills a ring of stages guarded by mbarriers,
copies land in any order, and consumer warps wait, read and release stages in every
interleaving a random scheduler picks. A read must find the stage holding its own k-tile (landed,
not yet overwritten) and nothing may hang. Both schedules are modelled: the cooperative one
(each tile read by both consumer warpgroups) and ping-pong (the consumers take tiles in turn,
waiting on each other's turn barrier, every thread arriving). Two broken variants of ping-pong
show that the model catches what it should: without turn barriers a consumer jumping a tile
ahead passes a parity wait a phase early; with one arrival per turn the barrier runs two phases
ahead of a lagging warp and the block hangs (both were written once, and found by this model).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import pytest

WARPS = 2  # warps per consumer warpgroup: enough to let one lag behind the other


class Barrier:
    """An mbarrier: a phase completes when its arrivals (and expected bytes) are in; a parity
    wait passes while the current phase's parity differs from the one waited for."""

    def __init__(self, count: int) -> None:
        self.count, self.pending, self.bytes, self.phase = count, count, 0, 0

    def arrive(self, expect_bytes: int = 0) -> None:
        self.bytes += expect_bytes
        self.pending -= 1
        assert self.pending >= 0, "more arrivals than the barrier expects"
        self._complete()

    def land(self, nbytes: int) -> None:
        self.bytes -= nbytes
        self._complete()

    def _complete(self) -> None:
        if self.pending == 0 and self.bytes == 0:
            self.phase, self.pending = self.phase + 1, self.count

    def passes(self, parity: int) -> bool:
        return self.phase % 2 != parity


class Broken(Exception):
    pass


Agent = Iterator[Callable[[], bool] | None]  # yields a condition to wait for, or None (a step)


def run(k_tiles: int, stages: int, tiles: int, schedule: str, seed: int) -> None:
    """One random interleaving; raises Broken on a stale read or a hang. `schedule`:
    "cooperative", "pingpong", "pingpong-no-turn" or "pingpong-one-arrival"."""
    rng = random.Random(seed)
    pingpong = schedule.startswith("pingpong")
    readers = WARPS if pingpong else 2 * WARPS
    full = [Barrier(1) for _ in range(stages)]
    empty = [Barrier(readers) for _ in range(stages)]
    turn = [Barrier(1 if schedule == "pingpong-one-arrival" else WARPS) for _ in range(2)]
    content: list[int | None] = [None] * stages  # the k-tile whose copies a stage holds
    in_flight: list[tuple[int, int]] = []  # (stage, position) of copies not yet landed
    positions = tiles * k_tiles

    def producer() -> Agent:
        for it in range(positions):
            s = it % stages
            yield lambda s=s, it=it: empty[s].passes((it // stages) % 2 ^ 1)
            content[s] = None  # being overwritten
            full[s].arrive(expect_bytes=2)
            in_flight.extend([(s, it), (s, it)])  # activations and filters, two copies

    def copy_engine() -> Agent:
        landed = 0
        while landed < 2 * positions:
            yield lambda: bool(in_flight)
            s, it = in_flight.pop(rng.randrange(len(in_flight)))
            landed += 1
            if not any(p == it for _, p in in_flight):
                content[s] = it
            full[s].land(1)

    def consumer_warp(consumer: int, warp: int) -> Agent:
        step = 2 if pingpong else 1
        for j in range(consumer if pingpong else 0, tiles, step):
            if schedule in ("pingpong", "pingpong-one-arrival") and j > 0:
                yield lambda j=j: turn[consumer].passes((j - 1) // 2 % 2)
            for kt in range(k_tiles):
                it = j * k_tiles + kt
                s = it % stages
                yield lambda s=s, it=it: full[s].passes(it // stages % 2)
                if content[s] != it:
                    raise Broken(f"consumer {consumer} read k-tile {it} from stage {s}, which "
                                 f"holds {content[s]}")
                yield None
                empty[s].arrive()
            if schedule == "pingpong" or (schedule == "pingpong-one-arrival" and warp == 0):
                turn[1 - consumer].arrive()
        yield None

    agents: list[tuple[Agent, Callable[[], bool] | None]] = [(producer(), None),
                                                             (copy_engine(), None)]
    agents += [(consumer_warp(c, w), None) for c in range(2) for w in range(WARPS)]
    while agents:
        ready = [i for i, (_, cond) in enumerate(agents) if cond is None or cond()]
        if not ready:
            raise Broken("hang: every agent waits")
        i = rng.choice(ready)
        agent, _ = agents[i]
        try:
            agents[i] = (agent, next(agent))
        except StopIteration:
            agents.pop(i)


CONFIGS = [(1, 5), (2, 5), (3, 4), (4, 4), (5, 5), (9, 5), (9, 7), (18, 5)]


@pytest.mark.parametrize("schedule", ["cooperative", "pingpong"])
@pytest.mark.parametrize("k_tiles,stages", CONFIGS)
def test_every_read_finds_its_k_tile_and_nothing_hangs(k_tiles: int, stages: int,
                                                       schedule: str) -> None:
    for tiles in range(1, 7):
        for seed in range(25):
            run(k_tiles, stages, tiles, schedule, seed)


@pytest.mark.parametrize("schedule,k_tiles,stages", [("pingpong-no-turn", 9, 5),
                                                     ("pingpong-one-arrival", 1, 5)])
def test_the_model_catches_the_broken_variants(schedule: str, k_tiles: int, stages: int) -> None:
    failures = 0
    for seed in range(200):
        try:
            run(k_tiles, stages, 4, schedule, seed)
        except Broken:
            failures += 1
    assert failures > 0


def test_halo_tiles_need_no_turn_barrier() -> None:
    # conv_tma's halo tiles: one stage a tile and two stages, so each consumer owns every other
    # stage and its parity waits cannot pass a phase early without the turn barriers.
    for tiles in range(1, 8):
        for seed in range(40):
            run(1, 2, tiles, "pingpong-no-turn", seed)
