"""specfleet.engine.free_runs: a KV pool's free blocks as maximal runs, kept as blocks are taken and freed."""

from __future__ import annotations

import random

import pytest

from specfleet.engine.free_runs import FreeRuns


def runs_of(free) -> list[tuple[int, int]]:
    """The reference: (first block, length) of every maximal run of `free`, from a sort of every block."""
    runs: list[tuple[int, int]] = []
    for b in sorted(free):
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


def test_taking_splits_a_run_and_freeing_merges_it_with_both_neighbours():
    runs = FreeRuns()
    runs.add(range(1, 11))
    assert list(runs) == [(1, 10)]
    runs.remove([5])  # one block in the middle
    assert list(runs) == [(1, 4), (6, 5)]
    runs.remove(range(1, 3))  # a run's first blocks
    runs.remove([10])  # and its last
    assert list(runs) == [(3, 2), (6, 4)]
    runs.add([5])  # between two runs: one run again
    assert list(runs) == [(3, 7)]
    runs.add([12, 1, 10, 11, 2])  # a batch in any order: stretches either side of the run, each merged with it
    assert list(runs) == [(1, 12)]


def test_the_largest_run_that_holds_the_count_lowest_first_among_equals():
    runs = FreeRuns()
    runs.add([*range(1, 4), *range(10, 14), *range(20, 24), 30])
    assert runs.largest(1) == (10, 4) and runs.largest(4) == (10, 4) and runs.largest(5) is None
    runs.remove([10])
    assert runs.largest(3) == (20, 4)


def test_taking_a_block_that_is_not_free_is_refused():
    runs = FreeRuns()
    runs.add(range(4, 8))
    for blocks in ([3], [7, 8], range(1, 5)):
        with pytest.raises(ValueError):
            runs.remove(blocks)
    assert list(runs) == [(4, 4)]


@pytest.mark.parametrize("seed", range(4))
def test_random_batches_keep_the_runs_of_a_sort(seed):
    """Batches of blocks taken and freed at random, in stretches and scattered: the runs are always those a sort of
    the free blocks gives, and the largest is the one a walk over them picks."""
    rng = random.Random(seed)
    size = 200
    runs, free = FreeRuns(), set(range(1, size))
    runs.add(range(1, size))
    for _ in range(400):
        if rng.random() < 0.5 and free:
            start = rng.choice(sorted(free))
            stretch = [b for b in range(start, start + rng.randint(1, 12)) if b in free]
            batch = stretch if rng.random() < 0.7 else rng.sample(sorted(free), min(len(free), 5))
            runs.remove(batch)
            free.difference_update(batch)
        else:
            held = sorted(set(range(1, size)) - free)
            batch = rng.sample(held, min(len(held), rng.randint(1, 8)))
            runs.add(batch)
            free.update(batch)
        assert list(runs) == runs_of(free)
        count = rng.randint(1, 20)
        fitting = [r for r in runs_of(free) if r[1] >= count]
        assert runs.largest(count) == (max(fitting, key=lambda r: (r[1], -r[0])) if fitting else None)
