"""A KV pool's free blocks as maximal runs of consecutive blocks, kept as blocks are taken and freed.

On a CPU every new session, and every session that moves to grow, asks the pool for the largest run of free
blocks (`KVPool.gap_for`). A pool grown to its KV budget holds thousands of free blocks but only about as many
runs as sessions, so the runs are kept up to date batch by batch rather than found by sorting every free block.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator


class FreeRuns:
    """Maximal runs of free blocks: `add` merges freed blocks with the runs beside them, `remove` splits the run
    taken blocks lie in. A batch costs a sort of its blocks plus a binary search and a list insertion (a copy of
    the runs' starts, one pointer each) per consecutive stretch of it: a session's blocks are one stretch on a CPU."""

    def __init__(self) -> None:
        self._starts: list[int] = []  # each run's first block, ascending
        self._length: dict[int, int] = {}  # a run's first block -> how many blocks it holds

    def __iter__(self) -> Iterator[tuple[int, int]]:
        """(first block, length) of every run, in order."""
        return ((s, self._length[s]) for s in self._starts)

    def __len__(self) -> int:
        return len(self._starts)

    def add(self, blocks: Iterable[int]) -> None:
        """These blocks (none of them free) are free now."""
        for first, last in _stretches(blocks):
            self._add(first, last)

    def remove(self, blocks: Iterable[int]) -> None:
        """These blocks (each free) are taken now."""
        for first, last in _stretches(blocks):
            self._remove(first, last)

    def largest(self, count: int) -> tuple[int, int] | None:
        """(first block, length) of the longest run holding at least `count` blocks, the lowest first among equals;
        None where no run does."""
        best_start, best_length = None, count - 1
        for start in self._starts:
            length = self._length[start]
            if length > best_length:
                best_start, best_length = start, length
        return None if best_start is None else (best_start, best_length)

    def _add(self, first: int, last: int) -> None:
        starts, lengths = self._starts, self._length
        i = bisect_left(starts, first)  # no run starts within [first, last]: those blocks were taken
        end = last + 1
        after = lengths.pop(end, 0)  # a run starting right after: merged into this one
        if after:
            del starts[i]
            end += after
        if i > 0 and starts[i - 1] + lengths[starts[i - 1]] == first:  # a run ending right before: this one extends it
            lengths[starts[i - 1]] = end - starts[i - 1]
        else:
            starts.insert(i, first)
            lengths[first] = end - first

    def _remove(self, first: int, last: int) -> None:
        starts, lengths = self._starts, self._length
        i = bisect_right(starts, first) - 1  # the run holding them: consecutive free blocks lie in one run
        start = starts[i] if i >= 0 else first
        end = start + lengths.get(start, 0)
        if last >= end:
            raise ValueError(f"blocks {first}-{last} are not all free")
        if first > start:  # the run's blocks before them stay free
            lengths[start] = first - start
            i += 1
        else:
            del starts[i], lengths[start]
        if last + 1 < end:  # and so do the blocks after them
            starts.insert(i, last + 1)
            lengths[last + 1] = end - last - 1


def _stretches(blocks: Iterable[int]) -> Iterator[tuple[int, int]]:
    """(first, last) of each stretch of consecutive blocks, ascending."""
    first = last = None
    for b in sorted(blocks):
        if last is not None and b == last + 1:
            last = b
            continue
        if first is not None:
            yield first, last
        first = last = b
    if first is not None:
        yield first, last
