"""A bounded staging buffer in (pinned) host memory, allocated once, used as a ring.

The hook allocates a region per piece and copies device rows into it without waiting; writer threads
free regions when their piece file is written. Several writer threads finish in any order, so `free`
accepts regions out of allocation order: a freed region is marked, and the ring's tail advances over
the freed prefix. Memory becomes reusable only once every region allocated before it is freed too (a
slow write holds back the space behind it, never corrupts it). When the ring is full, `alloc` blocks the
caller (the scheduler) until the writers catch up: backpressure instead of unbounded host memory.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import torch

ALIGN = 256


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Region:
    start: int
    end: int
    ticket: int


class StagingRing:
    def __init__(self, capacity_bytes: int, pin: bool | None = None) -> None:
        if capacity_bytes < ALIGN:
            raise ValueError(f"staging capacity {capacity_bytes} bytes is below {ALIGN}")
        if pin is None:
            pin = torch.cuda.is_available()
        self.capacity = capacity_bytes
        self.buf = torch.empty(capacity_bytes, dtype=torch.uint8, pin_memory=pin)
        self._live: deque[Region] = deque()  # allocation order; [0] is the tail
        self._outstanding: set[int] = set()  # tickets allocated and not yet freed
        self._head = 0
        self._cond = threading.Condition()
        self._ticket = 0
        self.used = 0  # bytes of regions not yet reclaimed (freed ones behind a live one included)
        self.peak = 0  # high-water mark of `used`
        self.waits = 0  # how often alloc had to wait for the writers
        self.allocs = 0

    def _fit(self, n: int) -> int | None:
        if not self._live:
            return 0
        tail = self._live[0].start
        if self._head > tail:  # live data in [tail, head): free space [head, cap) and [0, tail)
            if self.capacity - self._head >= n:
                return self._head
            return 0 if tail >= n else None
        return self._head if tail - self._head >= n else None  # wrapped: free [head, tail)

    def alloc(self, nbytes: int, timeout_s: float | None = None) -> Region:
        n = _align(max(nbytes, 1))
        if n > self.capacity:
            raise ValueError(f"staging region of {nbytes} bytes exceeds the ring's {self.capacity}")
        with self._cond:
            pos = self._fit(n)
            if pos is None:
                self.waits += 1
                if not self._cond.wait_for(lambda: self._fit(n) is not None, timeout=timeout_s):
                    raise TimeoutError(f"staging ring full for {timeout_s} s (writer stalled?)")
                pos = self._fit(n)
            assert pos is not None
            self._ticket += 1
            r = Region(pos, pos + n, self._ticket)
            self._live.append(r)
            self._outstanding.add(r.ticket)
            self._head = r.end
            self.used += n
            self.peak = max(self.peak, self.used)
            self.allocs += 1
            return r

    def view(self, region: Region, offset: int, nbytes: int) -> torch.Tensor:
        lo = region.start + offset
        if lo + nbytes > region.end:
            raise ValueError("view past the end of its region")
        return self.buf[lo : lo + nbytes]

    def free(self, region: Region) -> None:
        """Release `region` (any order); the space is reclaimed once all older regions are freed too."""
        with self._cond:
            if region.ticket not in self._outstanding:
                raise RuntimeError(f"staging region {region} is not allocated (freed twice?)")
            self._outstanding.remove(region.ticket)
            reclaimed = False
            while self._live and self._live[0].ticket not in self._outstanding:
                r = self._live.popleft()
                self.used -= r.end - r.start
                reclaimed = True
            if not self._live:
                self._head = 0
            if reclaimed:
                self._cond.notify_all()
