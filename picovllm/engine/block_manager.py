"""The paged KV cache's accounting: which blocks are free, and how many holders each has, in the
GPU pool and (with kv_offload_memory) the host pool under it. The blocks themselves (K and V
tensors) are on every rank, in its model runner; their ids are the same on every rank.

The BlockManager offers mechanisms (allocate, reference counts, free, copies between the pools);
the scheduler and the prefix cache decide policy (whom to admit, whom to preempt, what to
demote). It knows nothing of requests or of a prefix tree: a block's reference count is the
number of holders, and a block is free exactly when its count is 0. Copies are queued in the
order they are asked for (take_copies hands them to the next step, which runs them before its
forward): a block freed after its copy was queued may be reused at once.

Invariants (check_invariants): in each pool every block is either free (ref 0, in the free list
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
        self.epoch = 0  # (BlockManager's steps launched)
        self.freed_at = [0] * num_blocks  # each block's epoch when it was last freed

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
                self.freed_at[i] = self.epoch

    def check_invariants(self) -> None:
        free = set(self.free_ids)
        assert len(free) == len(self.free_ids), "a block is in the free list twice"
        for i, ref in enumerate(self.ref_counts):
            assert ref >= 0, f"block {i} has negative ref count {ref}"
            assert (ref == 0) == (i in free), f"block {i}: ref {ref} but free-list membership {i in free}"


class BlockManager:
    """The blocks of the KV pool (num_blocks of block_size tokens) and their reference counts;
    num_host_blocks > 0: a host pool too (`host`), and the copies between the two."""

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0):
        self.block_size = block_size
        self.gpu = BlockPool(num_blocks)
        self.host = BlockPool(num_host_blocks) if num_host_blocks else None
        self.copies: list[tuple[bool, list[int], list[int]]] = []  # (to the host?, source ids, destination ids)
        self.copied_blocks = [0, 0]  # blocks copied to the GPU, to the host
        self.steps_done = 0  # the steps launched so far whose work has ended (see written_in_flight)

    def step_launched(self) -> int:
        """A step was launched: its number (1, 2, ...)."""
        self.gpu.epoch += 1
        return self.gpu.epoch

    def written_in_flight(self, ids: list[int]) -> bool:
        """Whether a step may still be writing one of these blocks: one launched before the block
        was freed whose work has not ended (steps_done, which the engine advances as it reads
        the steps' tokens). Only what the device does apart from the steps needs to know (a KV
        pull: steps are ordered among themselves)."""
        freed_at, done = self.gpu.freed_at, self.steps_done
        return any(freed_at[i] > done for i in ids)

    def copy_to_host(self, gpu_ids: list[int], host_ids: list[int]) -> None:
        self._copy(True, gpu_ids, host_ids)

    def copy_to_gpu(self, host_ids: list[int], gpu_ids: list[int]) -> None:
        self._copy(False, host_ids, gpu_ids)

    def _copy(self, to_host: bool, src: list[int], dst: list[int]) -> None:
        """Queue a copy, joined to the one before when it goes the same way and writes none of
        the blocks that one writes (a copy reads all its sources before it writes)."""
        assert len(src) == len(dst)
        if not src:
            return
        self.copied_blocks[to_host] += len(src)
        last = self.copies[-1] if self.copies else None
        if last is not None and last[0] == to_host and not set(dst) & set(last[2]):
            last[1].extend(src)
            last[2].extend(dst)
        else:
            self.copies.append((to_host, list(src), list(dst)))

    def take_copies(self) -> list[tuple[bool, list[int], list[int]]]:
        copies, self.copies = self.copies, []
        return copies

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
        if self.host is not None:
            self.host.check_invariants()
