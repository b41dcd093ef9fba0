"""A calendar queue of timed items: what the simulator's event loop runs on, and where
Ripples' smart schedule keeps its workers' due times (so it lives below both)."""

from __future__ import annotations

from bisect import insort
from heapq import heapify, heappop, heappush


class TimeQueue:
    """A priority queue of tuples ordered as tuples, the first item a time (>= 0): a calendar
    of buckets of ``width`` seconds, the earliest one a heap and the others lists, so a push
    or pop costs about the same with 100,000 items as with 100 (a heap of them all would
    walk ``log2 n`` levels of objects scattered in memory at each). The order is a heap's:
    a later bucket holds only later times. Every so often (once the items then waiting have
    been taken) ``width`` is set anew, to about :attr:`PER_BUCKET` items a bucket. A bucket
    no width splits (many items at one time: workers that all step alike) is sorted and
    taken :attr:`CHUNK` items at a time, the rest waiting in order behind the heap."""

    PER_BUCKET = 32
    CHUNK = 256

    def __init__(self) -> None:
        self.width = 1.0
        self._inv = 1.0
        self.head: list[tuple] = []  # the earliest bucket's items (those of buckets up to _cur)
        self._cur = -1
        self._buckets: dict[int, list[tuple]] = {}
        self._ids: list[int] = []  # a heap of the other buckets' numbers
        #: the rest of a large current bucket, sorted, from ``_rest[_at]`` on: all after head's
        self._rest: list[tuple] = []
        self._at = 0
        self._taken = 0  # items moved to head so far, and at how many to look at the width again
        self._check_at = 0

    def __bool__(self) -> bool:
        return bool(self.head or self._ids or self._rest)

    def push(self, item: tuple) -> None:
        b = int(item[0] * self._inv)
        if b <= self._cur:
            rest = self._rest
            if rest and item > rest[self._at]:
                insort(rest, item, self._at)
            else:
                heappush(self.head, item)
            return
        bucket = self._buckets.get(b)
        if bucket is None:
            self._buckets[b] = [item]
            heappush(self._ids, b)
        else:
            bucket.append(item)

    def first(self) -> tuple:
        """The first item, left in the queue (which must not be empty)."""
        if not self.head:
            self.advance()
        return self.head[0]

    def pop(self) -> tuple:
        """The first item (the queue must not be empty)."""
        if not self.head:
            self.advance()
        return heappop(self.head)

    def advance(self) -> None:
        """With :attr:`head` empty: make the next items of the current bucket, or else the
        next bucket, the head."""
        rest = self._rest
        if not rest:
            if self._taken >= self._check_at:
                self._rescale()
            self._cur = heappop(self._ids)
            rest = self._buckets.pop(self._cur)
            if len(rest) <= 2 * self.CHUNK:
                heapify(rest)
                self.head = rest
                self._taken += len(rest)
                return
            rest.sort()
            self._rest, self._at = rest, 0
        at = self._at
        head = self.head = rest[at : at + self.CHUNK]  # (sorted: a heap)
        rest[at : at + self.CHUNK] = [None] * len(head)  # (so they are freed once taken from head)
        self._taken += len(head)
        if at + self.CHUNK < len(rest):
            self._at = at + self.CHUNK
        else:
            self._rest, self._at = [], 0

    def _rescale(self) -> None:
        items = [item for bucket in self._buckets.values() for item in bucket]
        self._check_at = self._taken + max(4096, len(items))
        lo, hi = min(item[0] for item in items), max(item[0] for item in items)
        if hi <= lo:
            return  # (ties: no width splits them)
        width = (hi - lo) / len(items) * self.PER_BUCKET
        if width * 4 < self.width or width > self.width * 4:
            self.width, self._inv = width, 1.0 / width
            self._buckets, self._ids, self._cur = {}, [], -1
            for item in items:
                self.push(item)
