"""Token-granularity radix tree over paged KV blocks, in two tiers: the GPU pool and (when the
prefix cache offloads) a host pool under it.

Edges are labelled with token runs and split at any token. A node whose edge covers the absolute
token range [start, end) holds the full blocks that end inside (start, end]: block indices
[start // block_size, end // block_size). Every full block of an inserted sequence therefore
belongs to exactly one node on its path, and a partial trailing block to none. A node holds
them on the GPU (`blocks`), on the host (`host`), or both: the same tokens' KV, the very same
bytes when one tier's copy was copied from the other's (`copied`), else within rounding (a
request computed again, in its own prompt chunks, what the host held: insert); a node with
neither is removed.

lock_ref of a node = number of live requests whose lock point is the node or below it. Locked
nodes are on the GPU, and so is the parent of every node on the GPU: the GPU part of the tree is
a subtree at the root, the host-only part hangs below it. Eviction from the GPU takes unlocked
nodes with no child on the GPU, from the host nodes with no child at all or a GPU copy too; in
each tier the order is its eviction policy's (eviction_policy.py). The tree knows nothing of
block reference counts or copies: PrefixCache (prefix_cache.py) pairs it with the pools.

An edge's tokens are a tuple, not a list: the tree holds every cached token for as long as the
server runs, and the garbage collector walks each item of every list in the generation it
collects (the engine's step waits), but stops looking at a tuple of ints after its first
collection. A walk takes the tokens it follows as a tuple, once.
"""

from __future__ import annotations

import itertools

from picovllm.engine.eviction_policy import LRU


class RadixNode:
    __slots__ = ("parent", "children", "tokens", "start", "blocks", "host", "copied", "lock_ref", "last_access")

    def __init__(self, parent: RadixNode | None, tokens: tuple[int, ...], start: int, blocks: list[int] | None):
        self.parent = parent
        self.children: dict[int, RadixNode] = {}
        self.tokens = tokens
        self.start = start
        self.blocks = blocks  # GPU block ids (None: not on the GPU)
        self.host: list[int] | None = None  # host block ids (None: not on the host)
        self.copied = True  # (in both tiers: one copied from the other, byte for byte; see the module's doc)
        self.lock_ref = 0
        self.last_access = 0

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


class RadixTree:
    def __init__(self, block_size: int, gpu_policy=None, host_policy=None):
        self.block_size = block_size
        self.root = RadixNode(None, (), 0, [])
        self.root.lock_ref = 1  # never evicted
        self._clock = itertools.count(1)
        self.gpu_policy = gpu_policy or LRU()
        self.host_policy = host_policy or LRU()
        self.num_blocks = 0  # GPU blocks held by the tree
        self.num_locked_blocks = 0  # GPU blocks held by nodes with lock_ref > 0
        self.num_host_blocks = 0  # host blocks held by the tree

    # ---- queries ------------------------------------------------------------------------------

    def match_prefix(self, tokens: list[int], limit: int | None = None) -> tuple[RadixNode, int]:
        """The deepest node the longest common prefix of tokens[:limit] reaches (possibly partway
        along its edge) and the prefix length in tokens. Touches the path for LRU."""
        limit = len(tokens) if limit is None else limit
        return self._walk(tuple(tokens[:limit]), split=False)

    def _walk(self, key: tuple[int, ...], split: bool) -> tuple[RadixNode, int]:
        """Follow key down the tree, touching each node for LRU. Where the key leaves an edge
        partway, stop on that node, or (split=True) split the edge there and stop on the new head,
        so that the returned node ends exactly where the match does."""
        node, pos = self.root, 0
        now = next(self._clock)
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            n = _common_len(child.tokens, key, pos)
            if n < len(child.tokens):
                if not split:
                    child.last_access = now
                    return child, pos + n
                child = self._split(child, n)
            node, pos = child, pos + n
            node.last_access = now
        return node, pos

    def path(self, node: RadixNode) -> list[RadixNode]:
        """The nodes from the root's child down to node."""
        path = []
        while node is not self.root:
            path.append(node)
            node = node.parent
        return path[::-1]

    def path_blocks(self, node: RadixNode, length: int) -> list[int]:
        """GPU blocks covering the first length // block_size full blocks of the path to node,
        where length lies within node's edge (the path on the GPU)."""
        blocks: list[int] = []
        for n in self.path(node):
            if length >= n.end:
                blocks += n.blocks
            else:
                blocks += n.blocks[: length // self.block_size - n.start // self.block_size]
                break
        return blocks

    # ---- updates ------------------------------------------------------------------------------

    def insert(self, tokens: list[int], blocks: list[int], limit: int | None = None) -> tuple[RadixNode, list[int]]:
        """Insert tokens[:limit], whose full blocks are blocks[:limit // block_size] on the GPU.
        Returns the node at which the sequence ends and the GPU blocks the tree newly holds (the
        caller takes a reference for the tree on each). Where the tree already has the tokens on
        the GPU, it keeps its own blocks; where it has them on the host only, it takes these as
        their GPU copy. Never changes lock_ref (a split copies it)."""
        limit = len(tokens) if limit is None else limit
        bs = self.block_size
        assert len(blocks) >= limit // bs
        key = tuple(tokens[:limit])
        node, pos = self._walk(key, split=True)
        taken: list[int] = []
        for n in self.path(node) if self.num_host_blocks else ():  # (the host-only part, at its end)
            if n.blocks is None:
                n.blocks, n.copied = blocks[n.start // bs : n.end // bs], False
                self.num_blocks += len(n.blocks)
                taken += n.blocks
                self.offer(n)
        if pos == limit:
            return node, taken
        leaf = RadixNode(node, key[pos:limit], pos, blocks[pos // bs : limit // bs])
        leaf.last_access = next(self._clock)
        node.children[key[pos]] = leaf
        self.num_blocks += len(leaf.blocks)
        self.offer(leaf)
        return leaf, taken + leaf.blocks

    def _split(self, node: RadixNode, offset: int) -> RadixNode:
        """Cut node's edge after `offset` tokens; the new parent takes the head and the blocks
        ending in it (in each tier), copies lock_ref and last access; node keeps the tail."""
        keep = (node.start + offset) // self.block_size - node.start // self.block_size
        head = RadixNode(node.parent, node.tokens[:offset], node.start, _head(node.blocks, keep))
        head.host, head.copied = _head(node.host, keep), node.copied
        head.lock_ref, head.last_access = node.lock_ref, node.last_access
        node.parent.children[node.tokens[0]] = head
        node.tokens, node.start = node.tokens[offset:], node.start + offset
        node.blocks, node.host = _tail(node.blocks, keep), _tail(node.host, keep)
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
                assert node.blocks is not None, "locking a node that is not on the GPU"
                self.num_locked_blocks += len(node.blocks)
            elif before > 0 and node.lock_ref == 0:
                self.num_locked_blocks -= len(node.blocks)
                self.offer(node)
            node = node.parent

    # ---- tiers --------------------------------------------------------------------------------

    def gpu_victim(self) -> RadixNode | None:
        """The next node to leave the GPU (the GPU policy's order): unlocked, no child on the GPU."""
        return self._victim(self.gpu_policy, self._gpu_evictable)

    def host_victim(self) -> RadixNode | None:
        """The next node to leave the host: no child, or on the GPU too."""
        return self._victim(self.host_policy, self._host_evictable)

    def _victim(self, policy, evictable) -> RadixNode | None:
        while (node := policy.pop()) is not None:
            if evictable(node):
                return node  # (else offered again when that changes)
        return None

    def drop_gpu(self, node: RadixNode) -> tuple[list[int], list[int]]:
        """Take node's GPU copy away: (its GPU blocks, host blocks freed with it). A node with no
        host copy leaves the tree, and with it the host-only nodes below it."""
        blocks, node.blocks = node.blocks, None
        self.num_blocks -= len(blocks)
        self.offer(node.parent)
        if node.host is not None:
            self.offer(node)
            return blocks, []
        host: list[int] = []
        stack = list(node.children.values())
        while stack:  # (host-only, all of them: the GPU part is a subtree at the root)
            n = stack.pop()
            stack += n.children.values()
            host += n.host
            self.num_host_blocks -= len(n.host)
            n.host = None  # (gone: no policy may offer it again)
        del node.parent.children[node.tokens[0]]
        return blocks, host

    def drop_host(self, node: RadixNode) -> list[int]:
        """Take node's host copy away (its host blocks); a node on the host only leaves the tree."""
        host, node.host = node.host, None
        self.num_host_blocks -= len(host)
        if node.blocks is None:
            del node.parent.children[node.tokens[0]]
            self.offer(node.parent)
        return host

    def set_host(self, node: RadixNode, host: list[int]) -> None:
        """node's blocks are (being) copied to these host blocks."""
        assert node.host is None and len(host) == len(node.blocks)
        node.host, node.copied = host, True
        self.num_host_blocks += len(host)
        self.offer(node)

    def set_gpu(self, node: RadixNode, blocks: list[int]) -> None:
        """node's host blocks are (being) copied to these GPU blocks (its parent is on the GPU)."""
        assert node.blocks is None and len(blocks) == len(node.host) and node.parent.blocks is not None
        node.blocks, node.copied = blocks, True
        self.num_blocks += len(blocks)
        self.offer(node)

    @property
    def num_evictable_blocks(self) -> int:
        """GPU blocks that eviction could free now."""
        return self.num_blocks - self.num_locked_blocks

    def attached(self, node: RadixNode) -> bool:
        return node is not self.root and node.parent.children.get(node.tokens[0]) is node

    def _gpu_evictable(self, node: RadixNode) -> bool:
        return (
            node.blocks is not None
            and node.lock_ref == 0
            and self.attached(node)
            and all(c.blocks is None for c in node.children.values())
        )

    def _host_evictable(self, node: RadixNode) -> bool:
        return node.host is not None and self.attached(node) and (node.blocks is not None or not node.children)

    def offer(self, node: RadixNode) -> None:
        """Offer node to each tier's policy where it is evictable now."""
        if self._gpu_evictable(node):
            self.gpu_policy.offer(node)
        if self._host_evictable(node):
            self.host_policy.offer(node)

    # ---- checks -------------------------------------------------------------------------------

    def nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack += node.children.values()

    def check_invariants(self) -> None:
        bs = self.block_size
        total = locked = host = 0
        for node in self.nodes():
            assert node.tokens, "empty edge"
            assert node.parent.children[node.tokens[0]] is node
            assert node.start == node.parent.end, "edge does not continue its parent"
            span = node.end // bs - node.start // bs
            assert node.blocks is not None or node.host is not None, "a node in neither tier"
            for ids in (node.blocks, node.host):
                assert ids is None or len(ids) == span, "block count off for the edge"
            assert node.blocks is None or node.parent.blocks is not None, "on the GPU below a node that is not"
            assert node.lock_ref == 0 or node.blocks is not None, "a locked node not on the GPU"
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), "child locks exceed parent's"
            total += len(node.blocks or ())
            locked += len(node.blocks) if node.lock_ref else 0
            host += len(node.host or ())
        assert total == self.num_blocks and locked == self.num_locked_blocks and host == self.num_host_blocks


def _head(ids: list[int] | None, n: int) -> list[int] | None:
    return None if ids is None else ids[:n]


def _tail(ids: list[int] | None, n: int) -> list[int] | None:
    return None if ids is None else ids[n:]


def _common_len(edge: tuple[int, ...], key: tuple[int, ...], pos: int) -> int:
    """Length of the common prefix of edge and key[pos:], by slice comparisons (C speed): one
    when the whole edge matches, a binary search for the first mismatch otherwise."""
    n = min(len(edge), len(key) - pos)
    if (edge if n == len(edge) else edge[:n]) == key[pos : pos + n]:
        return n
    lo, hi = 0, n  # edge[:lo] matches, edge[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if edge[lo:mid] == key[pos + lo : pos + mid]:
            lo = mid
        else:
            hi = mid
    return lo
