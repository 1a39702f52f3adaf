"""Which cached node to evict next: the radix tree asks its policy, one per tier of the KV cache
(the GPU pool, and the host pool under it when the prefix cache offloads).

The tree offers a node whenever it may have become evictable in the tier (unlocked, no children
left there, just used) and pops candidates when it needs room; it checks a popped node itself
and skips one that is not evictable (it offers it again when that changes). A policy only
orders what it was offered. LRU is the one there is; another order is another class with the
same two methods.
"""

from __future__ import annotations

import heapq


class LRU:
    """Least recently used first, by the node's last_access (a logical clock the tree ticks).
    One heap entry per node offered; one whose node was used after it was queued goes back in
    line at the node's new time when it comes up, so each pop is O(log n) amortised."""

    def __init__(self):
        self._heap: list[tuple[int, int, object]] = []  # (last_access when queued, tie-break, node)
        self._queued: set[int] = set()  # id() of the nodes in the heap
        self._ties = 0

    def offer(self, node) -> None:
        if id(node) not in self._queued:
            self._queued.add(id(node))
            self._ties += 1
            heapq.heappush(self._heap, (node.last_access, self._ties, node))

    def pop(self):
        """The next node in LRU order, or None when nothing is queued."""
        while self._heap:
            stamp, _, node = heapq.heappop(self._heap)
            self._queued.discard(id(node))
            if stamp != node.last_access:
                self.offer(node)  # used since it was queued: in line again at its new time
                continue
            return node
        return None
