"""PrefixCache: the only layer that talks to both the RadixTree and the BlockManager.

It rounds every match down to whole blocks (a partial block is never shared) and keeps the two
reference counts consistent:

    block ref (BlockManager) = live requests holding the block + 1 if the tree holds it
    node lock_ref (RadixTree) = live requests whose lock point is the node or below it

| event    | blocks                                   | locks                                   |
|----------|------------------------------------------|-----------------------------------------|
| acquire  | matched blocks +1, fresh blocks ref 1    | lock(matched node)                      |
| insert   | blocks newly held by the tree +1         | lock(new node), unlock(old) - a move    |
| release  | every block in req.block_table -1        | unlock(req.lock_node), saved at lock    |
| evict    | evicted blocks -1 (the tree's reference) | only lock_ref 0 leaves are removed      |

Release frees exactly the request's own block list and unlocks through the saved node pointer,
never by re-matching tokens (a split between match and release would misdirect a token walk).
With caching off, the same calls do plain allocate / free.
"""

from __future__ import annotations

from picovllm.engine.block_manager import BlockManager
from picovllm.engine.radix_tree import RadixTree
from picovllm.engine.request import Request


class PrefixCache:
    def __init__(self, block_manager: BlockManager, enabled: bool):
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.tree = RadixTree(self.block_size) if enabled else None
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.evicted_blocks = 0

    @property
    def enabled(self) -> bool:
        return self.tree is not None

    @property
    def num_cached_blocks(self) -> int:
        return self.tree.num_blocks if self.tree is not None else 0

    @property
    def num_available_blocks(self) -> int:
        """Free blocks plus blocks that eviction could free now."""
        evictable = self.tree.num_evictable_blocks if self.tree else 0
        return self.block_manager.num_free_blocks + evictable

    def acquire(self, req: Request) -> int:
        """Give req the cached full blocks of its longest cached prefix (leaving at least its
        last token to compute) and lock them; they count as computed. Returns how many more
        blocks it needs for all its tokens."""
        bm = self.block_manager
        if self.tree is not None:
            node, matched = self.tree.match_prefix(req.token_ids, req.num_tokens - 1)
            num_cached = matched // self.block_size * self.block_size
            blocks = self.tree.path_blocks(node, num_cached)
            bm.inc_ref(blocks)
            self.tree.lock(node, +1)
            req.lock_node, req.block_table, req.num_cached_tokens = node, blocks, num_cached
        req.num_computed_tokens = req.num_cached_tokens
        return bm.blocks_needed(req.num_tokens) - len(req.block_table)

    def allocate(self, req: Request, n: int) -> None:
        """Append n fresh blocks to req, evicting cached blocks if the free list is short."""
        bm = self.block_manager
        if n > bm.num_free_blocks and self.tree is not None:
            evicted = self.tree.evict(n - bm.num_free_blocks)
            self.evicted_blocks += len(evicted)
            bm.free(evicted)
        req.block_table += bm.allocate(n)

    def insert(self, req: Request, num_tokens: int) -> None:
        """Put the full blocks of req's first num_tokens tokens (whose KV is, or is being,
        computed) in the tree, and move req's lock to the node where they end."""
        if self.tree is None:
            return
        full = num_tokens // self.block_size * self.block_size
        node, new_blocks = self.tree.insert(req.token_ids, req.block_table, full)
        self.block_manager.inc_ref(new_blocks)
        self.tree.lock(node, +1)
        self.tree.lock(req.lock_node, -1)
        req.lock_node = node

    def release(self, req: Request) -> None:
        """Drop everything req holds: its blocks' references, its lock; it has nothing computed."""
        self.block_manager.free(req.block_table)
        req.block_table = []
        req.num_cached_tokens = req.num_computed_tokens = 0
        if req.lock_node is not None:
            self.tree.lock(req.lock_node, -1)
            req.lock_node = None

    def reset(self) -> None:
        """Evict everything that no live request uses."""
        if self.tree is not None:
            self.block_manager.free(self.tree.evict(self.tree.num_blocks))

    def record_query(self, num_prompt_tokens: int, num_cached: int) -> None:
        self.queried_tokens += num_prompt_tokens
        self.hit_tokens += num_cached

    def check_invariants(self, live: list[Request], held: list[list[int]] = ()) -> None:
        """Every block's ref = live requests holding it + other holders (`held`: one reference a
        list) + 1 if the tree holds it; every node's lock_ref = live requests locked at or below
        it; free + used = total."""
        bm = self.block_manager
        expected = [0] * bm.num_total_blocks
        for blocks in [r.block_table for r in live] + list(held):
            for b in blocks:
                expected[b] += 1
        if self.tree is not None:
            self.tree.check_invariants()
            for node in self.tree.nodes():
                for b in node.blocks:
                    expected[b] += 1
            locks: dict[int, int] = {}
            for req in live:
                node = req.lock_node
                while node is not None and node is not self.tree.root:
                    locks[id(node)] = locks.get(id(node), 0) + 1
                    node = node.parent
            for node in self.tree.nodes():
                assert node.lock_ref == locks.get(id(node), 0), "lock_ref differs from the live requests below"
        for b, ref in enumerate(expected):
            assert bm.ref_count(b) == ref, f"block {b}: ref count {bm.ref_count(b)}, holders {ref}"
        assert bm.num_free_blocks + bm.num_used_blocks == bm.num_total_blocks
        bm.check_invariants()
