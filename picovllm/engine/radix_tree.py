"""Token-granularity radix tree over paged KV blocks.

Edges are labelled with token runs and split at any token. A node whose edge covers the absolute
token range [start, end) holds the full blocks that end inside (start, end]: block indices
[start // block_size, end // block_size). Every full block of an inserted sequence therefore
belongs to exactly one node on its path, and a partial trailing block to none.

lock_ref of a node = number of live requests whose lock point is the node or below it; only
nodes with lock_ref 0 can be evicted, leaves first, least recently used first. The tree knows
nothing of block reference counts: PrefixCache (prefix_cache.py) pairs the two.
"""

from __future__ import annotations

import heapq
import itertools


class RadixNode:
    __slots__ = ("parent", "children", "tokens", "start", "blocks", "lock_ref", "last_access", "_stamp")

    def __init__(self, parent: RadixNode | None, tokens: list[int], start: int, blocks: list[int]):
        self.parent = parent
        self.children: dict[int, RadixNode] = {}
        self.tokens = tokens
        self.start = start
        self.blocks = blocks
        self.lock_ref = 0
        self.last_access = 0
        self._stamp = -1  # time of this node's live entry in the eviction heap; -1: none

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def __lt__(self, other: RadixNode) -> bool:  # heap ties
        return id(self) < id(other)


class RadixTree:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self.root = RadixNode(None, [], 0, [])
        self.root.lock_ref = 1  # never evicted
        self._clock = itertools.count(1)
        self._heap: list[tuple[int, RadixNode]] = []  # eviction candidates, lazily invalidated
        self.num_blocks = 0  # blocks held by the tree
        self.num_locked_blocks = 0  # blocks held by nodes with lock_ref > 0

    # ---- queries ------------------------------------------------------------------------------

    def match_prefix(self, tokens: list[int], limit: int | None = None) -> tuple[RadixNode, int]:
        """The deepest node the longest common prefix of tokens[:limit] reaches (possibly partway
        along its edge) and the prefix length in tokens. Touches the path for LRU."""
        return self._walk(tokens, len(tokens) if limit is None else limit, split=False)

    def _walk(self, tokens: list[int], limit: int, split: bool) -> tuple[RadixNode, int]:
        """Follow tokens[:limit] down the tree, touching each node for LRU. Where the tokens leave
        an edge partway, stop on that node, or (split=True) split the edge there and stop on the
        new head, so that the returned node ends exactly where the match does."""
        node, pos = self.root, 0
        now = next(self._clock)
        while pos < limit:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = _common_len(child.tokens, tokens, pos, limit)
            if n < len(child.tokens):
                if not split:
                    child.last_access = now
                    return child, pos + n
                child = self._split(child, n)
            node, pos = child, pos + n
            node.last_access = now
        return node, pos

    def path_blocks(self, node: RadixNode, length: int) -> list[int]:
        """Blocks covering the first length // block_size full blocks of the path to node, where
        length lies within node's edge."""
        path = []
        while node is not self.root:
            path.append(node)
            node = node.parent
        blocks: list[int] = []
        for n in reversed(path):
            if length >= n.end:
                blocks += n.blocks
            else:
                blocks += n.blocks[: length // self.block_size - n.start // self.block_size]
                break
        return blocks

    # ---- updates ------------------------------------------------------------------------------

    def insert(self, tokens: list[int], blocks: list[int], limit: int | None = None) -> tuple[RadixNode, list[int]]:
        """Insert tokens[:limit], whose full blocks are blocks[:limit // block_size]. Returns the
        node at which the sequence ends and the blocks the tree newly holds (the caller takes a
        reference for the tree on each). Where the tree already has the tokens, it keeps its own
        blocks. Never changes lock_ref (a split copies it)."""
        limit = len(tokens) if limit is None else limit
        assert len(blocks) >= limit // self.block_size
        node, pos = self._walk(tokens, limit, split=True)
        if pos == limit:
            return node, []
        bs = self.block_size
        leaf = RadixNode(node, tokens[pos:limit], pos, blocks[pos // bs : limit // bs])
        leaf.last_access = next(self._clock)
        node.children[tokens[pos]] = leaf
        self.num_blocks += len(leaf.blocks)
        self._maybe_candidate(leaf)
        return leaf, list(leaf.blocks)

    def _split(self, node: RadixNode, offset: int) -> RadixNode:
        """Cut node's edge after `offset` tokens; the new parent takes the head and the blocks
        ending in it, copies lock_ref and last access; node keeps the tail."""
        bs = self.block_size
        keep = (node.start + offset) // bs - node.start // bs
        head = RadixNode(node.parent, node.tokens[:offset], node.start, node.blocks[:keep])
        head.lock_ref, head.last_access = node.lock_ref, node.last_access
        node.parent.children[node.tokens[0]] = head
        node.tokens, node.start, node.blocks = node.tokens[offset:], node.start + offset, node.blocks[keep:]
        node.parent = head
        head.children[node.tokens[0]] = node
        return head

    def lock(self, node: RadixNode, delta: int) -> None:
        """Add delta (+1 / -1) to the lock of node and every ancestor."""
        while node is not self.root:
            before = node.lock_ref
            node.lock_ref += delta
            assert node.lock_ref >= 0, "lock_ref underflow"
            if before == 0 and node.lock_ref > 0:
                self.num_locked_blocks += len(node.blocks)
            elif before > 0 and node.lock_ref == 0:
                self.num_locked_blocks -= len(node.blocks)
                self._maybe_candidate(node)
            node = node.parent

    def evict(self, num_blocks: int) -> list[int]:
        """Remove least recently used unlocked leaves until num_blocks blocks are released (or
        nothing is evictable). Each eviction is O(log n): candidates sit in a heap and entries
        made stale by later accesses, locks or new children are skipped when popped."""
        freed: list[int] = []
        while len(freed) < num_blocks and self._heap:
            stamp, node = heapq.heappop(self._heap)
            if stamp != node._stamp:
                continue  # superseded entry
            node._stamp = -1
            if not self._evictable(node):
                continue  # locked or given children since; re-queued when that changes
            if stamp != node.last_access:
                self._maybe_candidate(node)  # used since it was queued: queue it at its new time
                continue
            del node.parent.children[node.tokens[0]]
            self.num_blocks -= len(node.blocks)
            freed += node.blocks
            self._maybe_candidate(node.parent)
        return freed

    @property
    def num_evictable_blocks(self) -> int:
        return self.num_blocks - self.num_locked_blocks

    def _evictable(self, node: RadixNode) -> bool:
        return (
            node is not self.root
            and node.lock_ref == 0
            and not node.children
            and node.parent.children.get(node.tokens[0]) is node
        )  # still attached

    def _maybe_candidate(self, node: RadixNode) -> None:
        if node._stamp == -1 and self._evictable(node):
            node._stamp = node.last_access
            heapq.heappush(self._heap, (node.last_access, node))

    # ---- checks -------------------------------------------------------------------------------

    def nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack += node.children.values()

    def check_invariants(self) -> None:
        bs = self.block_size
        total = locked = 0
        for node in self.nodes():
            assert node.tokens, "empty edge"
            assert node.parent.children[node.tokens[0]] is node
            assert node.start == node.parent.end, "edge does not continue its parent"
            assert len(node.blocks) == node.end // bs - node.start // bs, "block count off for the edge"
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), "child locks exceed parent's"
            total += len(node.blocks)
            locked += len(node.blocks) if node.lock_ref else 0
        assert total == self.num_blocks and locked == self.num_locked_blocks


def _common_len(edge: list[int], tokens: list[int], pos: int, limit: int) -> int:
    """Length of the common prefix of edge and tokens[pos:limit], by slice comparisons (C speed):
    one when the whole edge matches, a binary search for the first mismatch otherwise."""
    n = min(len(edge), limit - pos)
    if (edge if n == len(edge) else edge[:n]) == tokens[pos : pos + n]:
        return n
    lo, hi = 0, n  # edge[:lo] matches, edge[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if edge[lo:mid] == tokens[pos + lo : pos + mid]:
            lo = mid
        else:
            hi = mid
    return lo
