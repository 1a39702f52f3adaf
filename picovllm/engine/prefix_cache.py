"""PrefixCache: the only layer that talks to both the RadixTree and the BlockManager.

It rounds every match down to whole blocks (a partial block is never shared) and keeps the
reference counts consistent:

    GPU block ref (BlockManager.gpu) = live requests holding the block + 1 if the tree holds it
    host block ref (BlockManager.host) = 1 if the tree holds it
    node lock_ref (RadixTree) = live requests whose lock point is the node or below it

| event    | blocks                                   | locks                                   |
|----------|------------------------------------------|-----------------------------------------|
| acquire  | matched blocks +1, fresh blocks ref 1    | lock(matched node)                      |
| insert   | blocks newly held by the tree +1         | lock(new node), unlock(old) - a move    |
| release  | every block in req.block_table -1        | unlock(req.lock_node), saved at lock    |
| evict    | evicted blocks -1 (the tree's reference) | only lock_ref 0 nodes leave the GPU     |

Release frees exactly the request's own block list and unlocks through the saved node pointer,
never by re-matching tokens (a split between match and release would misdirect a token walk).
With caching off, the same calls do plain allocate / free.

With a host pool (kv_offload_memory), a node evicted from the GPU is demoted: its blocks are
copied to host blocks (taken from the host's own evictions when it is full) and the GPU blocks
freed; only what the host pool cannot take is dropped. A match that reaches nodes on the host
promotes them into fresh GPU blocks before the request runs; they keep their host copy, so
demoting them again costs no copy. The copies are queued on the BlockManager in the order they
are decided and run at the start of the next step, before its forward (worker/model_runner.py).
"""

from __future__ import annotations

from picovllm.engine.block_manager import BlockManager
from picovllm.engine.radix_tree import RadixNode, RadixTree
from picovllm.engine.request import Request


class PrefixCache:
    def __init__(self, block_manager: BlockManager, enabled: bool):
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.tree = RadixTree(self.block_size) if enabled else None
        self.offload = enabled and block_manager.host is not None
        self.queried_tokens = 0
        self.hit_tokens = 0  # (host hits included)
        self.host_hit_tokens = 0
        self.evicted_blocks = 0  # GPU blocks the tree gave up (demoted or dropped)
        self.demoted_blocks = 0
        self.promoted_blocks = 0
        self.host_evicted_blocks = 0
        self._pinned: set[int] = set()  # id() of the host-only nodes a promotion is bringing back

    @property
    def enabled(self) -> bool:
        return self.tree is not None

    @property
    def num_cached_blocks(self) -> int:
        return self.tree.num_blocks if self.tree is not None else 0

    @property
    def num_available_blocks(self) -> int:
        """Free GPU blocks plus GPU blocks that eviction could free now."""
        evictable = self.tree.num_evictable_blocks if self.tree else 0
        return self.block_manager.num_free_blocks + evictable

    def acquire(self, req: Request) -> int:
        """Give req the cached full blocks of its longest cached prefix (leaving at least its
        last token to compute), promoting what of it is on the host, and lock them; they count
        as computed (req.num_host_cached_tokens of them came from the host); none for a request
        whose prompt's log-probabilities are still to be computed. Returns how many more blocks it
        needs for all its tokens."""
        bm = self.block_manager
        if self.tree is not None:
            node, matched = self.tree.match_prefix(
                req.token_ids, 0 if req.needs_prompt_logprobs else req.num_tokens - 1
            )
            num_cached = matched // self.block_size * self.block_size
            node, num_cached, from_host = self._promote(node, num_cached)
            blocks = self.tree.path_blocks(node, num_cached)
            bm.inc_ref(blocks)
            self.tree.lock(node, +1)
            req.lock_node, req.block_table, req.num_cached_tokens = node, blocks, num_cached
            req.num_host_cached_tokens = from_host
        req.num_computed_tokens = req.num_cached_tokens
        return bm.blocks_needed(req.num_tokens) - len(req.block_table)

    def _promote(self, node: RadixNode, num_cached: int) -> tuple[RadixNode, int, int]:
        """Bring the host-only nodes of the path to node back to the GPU, top down, while GPU
        blocks can be had. Returns the node and length the match now ends at, on the GPU, and
        how many of its tokens were on the host only."""
        path = self.tree.path(node)
        first = next((i for i, n in enumerate(path) if n.blocks is None), None)
        if first is None:
            return node, num_cached, 0
        held = path[first - 1] if first else self.tree.root  # (where the GPU part ends)
        if num_cached <= path[first].start:
            return held, num_cached, 0
        self.tree.lock(held, +1)  # (the GPU part of the path stays while room is made below it)
        self._pinned = {id(n) for n in path[first:]}  # (and the host part: no room on the host from it)
        for n in path[first:]:
            need = len(n.host)
            if n.start >= num_cached or need > self.num_available_blocks:
                break
            self._make_room(need)
            gpu = self.block_manager.allocate(need)
            self.block_manager.copy_to_gpu(n.host, gpu)
            self.tree.set_gpu(n, gpu)
            self.promoted_blocks += need
            self.tree.lock(n, +1)
            self.tree.lock(held, -1)
            held = n
        self._pinned = set()
        self.tree.lock(held, -1)
        end = min(num_cached, held.end) // self.block_size * self.block_size
        return held, end, max(0, end - path[first].start // self.block_size * self.block_size)

    def allocate(self, req: Request, n: int) -> None:
        """Append n fresh blocks to req, evicting cached blocks if the free list is short."""
        self._make_room(n)
        req.block_table += self.block_manager.allocate(n)

    def _make_room(self, n: int) -> None:
        """At least n free GPU blocks, if eviction can free them: the GPU policy's victims are
        demoted to the host (when it can take them), else dropped."""
        bm, tree = self.block_manager, self.tree
        while bm.num_free_blocks < n and tree is not None and (node := tree.gpu_victim()) is not None:
            host = self._host_room(len(node.blocks)) if self.offload and node.host is None else None
            if host is not None:
                bm.copy_to_host(node.blocks, host)
                tree.set_host(node, host)
            if node.host is not None:
                self.demoted_blocks += len(node.blocks)
            self.evicted_blocks += self._drop_gpu(node)

    def _host_room(self, n: int) -> list[int] | None:
        """n host blocks, evicting from the host (its policy's order) as needed; None if it cannot."""
        host, tree, skipped = self.block_manager.host, self.tree, []
        while host.num_free < n and tree is not None and (node := tree.host_victim()) is not None:
            if id(node) in self._pinned:
                skipped.append(node)
            else:
                self._free_host(tree.drop_host(node))
        for node in skipped:
            tree.offer(node)
        return host.allocate(n) if host.num_free >= n else None

    def _drop_gpu(self, node: RadixNode) -> int:
        """Take node off the GPU (RadixTree.drop_gpu), freeing its GPU blocks and the host blocks
        that go with it; returns how many GPU blocks it freed."""
        blocks, dropped = self.tree.drop_gpu(node)
        self.block_manager.free(blocks)
        self._free_host(dropped)
        return len(blocks)

    def _free_host(self, blocks: list[int]) -> None:
        if blocks:
            self.host_evicted_blocks += len(blocks)
            self.block_manager.host.free(blocks)

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

    def swap_out(self, req: Request) -> bool:
        """Copy the blocks of req's computed tokens to host blocks (evicting from the host as
        needed) and release its GPU blocks; False (nothing done) when the host cannot take them."""
        bm = self.block_manager
        n = bm.blocks_needed(req.num_computed_tokens)
        host = self._host_room(n)
        if host is None:
            return False
        bm.copy_to_host(req.block_table[:n], host)
        computed = req.num_computed_tokens
        self.release(req)
        req.host_blocks, req.num_swapped_tokens = host, computed
        return True

    def swap_in(self, req: Request, n: int) -> None:
        """Give a swapped-out req n GPU blocks, the first ones copied back from its host blocks
        (freed); its computed tokens are back. Its blocks are its own (no tree lock)."""
        bm = self.block_manager
        self._make_room(n)
        blocks = bm.allocate(n)
        bm.copy_to_gpu(req.host_blocks, blocks[: len(req.host_blocks)])
        bm.host.free(req.host_blocks)
        req.block_table, req.host_blocks = blocks, []
        req.num_computed_tokens, req.num_cached_tokens = req.num_swapped_tokens, 0
        req.lock_node = self.tree.root if self.tree is not None else None

    def release(self, req: Request) -> None:
        """Drop everything req holds: its blocks' references (host blocks too), its lock; it has
        nothing computed."""
        self.block_manager.free(req.block_table)
        if req.host_blocks:
            self.block_manager.host.free(req.host_blocks)
            req.host_blocks = []
        req.block_table = []
        req.num_cached_tokens = req.num_computed_tokens = 0
        if req.lock_node is not None:
            self.tree.lock(req.lock_node, -1)
            req.lock_node = None

    def reset(self) -> None:
        """Evict everything that no live request uses, in both tiers."""
        tree = self.tree
        if tree is None:
            return
        while (node := tree.gpu_victim()) is not None:
            self._drop_gpu(node)
        while (node := tree.host_victim()) is not None:
            self._free_host(tree.drop_host(node))

    def record_query(self, num_prompt_tokens: int, num_cached: int, num_host: int = 0) -> None:
        self.queried_tokens += num_prompt_tokens
        self.hit_tokens += num_cached
        self.host_hit_tokens += num_host

    def check_invariants(self, live: list[Request], held: list[tuple] = (), swapped: list[Request] = ()) -> None:
        """Every GPU block's ref = live requests holding it + other holders (`held`: (blocks, node)
        pairs, one reference on each block) + 1 if the tree holds it; every host block's = 1 if the
        tree or a swapped-out request holds it; every node's lock_ref = live requests and other
        holders locked at or below it; free + used = total in each pool."""
        bm = self.block_manager
        expected = [0] * bm.num_total_blocks
        expected_host = [0] * (bm.host.num_blocks if bm.host is not None else 0)
        for blocks in [r.block_table for r in live] + [blocks for blocks, _ in held]:
            for b in blocks:
                expected[b] += 1
        for r in swapped:
            for b in r.host_blocks:
                expected_host[b] += 1
        if self.tree is not None:
            self.tree.check_invariants()
            for node in self.tree.nodes():
                for b in node.blocks or ():
                    expected[b] += 1
                for b in node.host or ():
                    expected_host[b] += 1
            locks: dict[int, int] = {}
            for node in [req.lock_node for req in live] + [node for _, node in held]:
                while node is not None and node is not self.tree.root:
                    locks[id(node)] = locks.get(id(node), 0) + 1
                    node = node.parent
            for node in self.tree.nodes():
                assert node.lock_ref == locks.get(id(node), 0), "lock_ref differs from the live requests below"
        for b, ref in enumerate(expected):
            assert bm.ref_count(b) == ref, f"block {b}: ref count {bm.ref_count(b)}, holders {ref}"
        for b, ref in enumerate(expected_host):
            assert bm.host.ref_counts[b] == ref, f"host block {b}: ref count {bm.host.ref_counts[b]}, holders {ref}"
        assert bm.num_free_blocks + bm.num_used_blocks == bm.num_total_blocks
        bm.check_invariants()
