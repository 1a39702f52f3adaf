"""The paged KV cache's accounting: which blocks are free, and how many holders each has. The
blocks themselves (K and V tensors) are on every rank, in its model runner; their ids are
the same on every rank.

The BlockManager offers mechanisms (allocate, reference counts, free); the scheduler
decides policy (whom to admit, whom to preempt). It knows nothing of requests or of a prefix
tree: a block's reference count is the number of holders, and a block is free exactly when its
count is 0.

Invariants (check_invariants): every device block is either free (ref 0, in the free list
once) or used (ref >= 1); free + used = total.
"""

from __future__ import annotations

from collections import deque


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    """Free-list and reference counts for ``num_blocks`` blocks of one device."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_ids):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self.free_ids)} free")
        ids = [self.free_ids.popleft() for _ in range(n)]
        for i in ids:
            self.ref_counts[i] = 1
        return ids

    def inc_ref(self, ids: list[int]) -> None:
        """Another holder for blocks already in use (callers hold them; check_invariants verifies)."""
        refs = self.ref_counts
        for i in ids:
            refs[i] += 1

    def free(self, ids: list[int]) -> None:
        """Drop one reference to each block; blocks reaching 0 return to the free list."""
        for i in ids:
            assert self.ref_counts[i] > 0, f"double free of block {i}"
            self.ref_counts[i] -= 1
            if self.ref_counts[i] == 0:
                self.free_ids.append(i)

    def check_invariants(self) -> None:
        free = set(self.free_ids)
        assert len(free) == len(self.free_ids), "a block is in the free list twice"
        for i, ref in enumerate(self.ref_counts):
            assert ref >= 0, f"block {i} has negative ref count {ref}"
            assert (ref == 0) == (i in free), f"block {i}: ref {ref} but free-list membership {i in free}"


class BlockManager:
    """The blocks of the KV pool (num_blocks of block_size tokens) and their reference counts."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.gpu = BlockPool(num_blocks)

    @property
    def num_total_blocks(self) -> int:
        return self.gpu.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.gpu.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.gpu.num_blocks - self.gpu.num_free

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """n fresh device blocks, each with reference count 1."""
        return self.gpu.allocate(n)

    def inc_ref(self, ids: list[int]) -> None:
        self.gpu.inc_ref(ids)

    def free(self, ids: list[int]) -> None:
        self.gpu.free(ids)

    def ref_count(self, block_id: int) -> int:
        return self.gpu.ref_counts[block_id]

    def check_invariants(self) -> None:
        self.gpu.check_invariants()
