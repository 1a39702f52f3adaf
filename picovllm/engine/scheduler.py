"""Continuous batching: which requests run in the next forward.

Each step is either a prefill of newly admitted requests (FCFS, within max_num_seqs and
max_num_batched_tokens, while blocks last) or a decode of all running requests. When a running
request needs a block and none is free or evictable, the most recently admitted request is
preempted: its computed blocks go into the prefix cache (when on), its references are released,
and it goes back to the front of the queue, to be recomputed later, from the cache as far as its
blocks have not been evicted meanwhile.

Admission takes the longest cached prefix of a request's tokens (prefix_cache.py) and computes
only the rest; the admitted prompt's full blocks go into the tree at once, so a request admitted
later in the same step reuses them: within one forward every layer stores all new K/V before any
query attends, so the second request reads blocks the first is filling in the same step.

Invariant: a RUNNING request holds exactly blocks_needed(num_tokens - 1) blocks between steps
(its KV cache covers every token but the last sampled one), and scheduling it for decode tops
that up to blocks_needed(num_tokens); WAITING and FINISHED requests hold none.
"""
from __future__ import annotations

from collections import deque
from typing import NamedTuple

from picovllm.engine.block_manager import BlockManager
from picovllm.engine.prefix_cache import PrefixCache
from picovllm.engine.request import Request, RequestStatus


class ScheduledBatch(NamedTuple):
    requests: list[Request]
    is_prefill: bool


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_prefix_caching: bool = True):
        self.block_manager = block_manager
        self.cache = PrefixCache(block_manager, enable_prefix_caching)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def schedule(self) -> ScheduledBatch | None:
        batch = self._admit()
        if batch:
            return ScheduledBatch(batch, is_prefill=True)
        batch = self._decode_batch()
        return ScheduledBatch(batch, is_prefill=False) if batch else None

    def _admit(self) -> list[Request]:
        cache = self.cache
        batch: list[Request] = []
        num_tokens = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            needed = cache.acquire(req)
            # Keep one block per running request in reserve for its next decode step, so that a
            # new admission is not preempted straight away; an empty engine admits whatever fits.
            reserve = len(self.running)
            new_tokens = req.num_tokens - req.num_cached_tokens
            if num_tokens + new_tokens > self.max_num_batched_tokens or needed + reserve > cache.num_available_blocks:
                cache.release(req)
                req.num_cached_tokens = 0
                break
            self.waiting.popleft()
            cache.allocate(req, needed)
            cache.insert(req, req.num_tokens)
            if req.num_prompt_cached_tokens is None:
                req.num_prompt_cached_tokens = req.num_cached_tokens
                cache.record_query(req.num_prompt_tokens, req.num_cached_tokens)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            batch.append(req)
            num_tokens += new_tokens
        return batch

    def _decode_batch(self) -> list[Request]:
        bm, cache = self.block_manager, self.cache
        scheduled: list[Request] = []
        queue = deque(self.running)
        while queue:
            req = queue.popleft()
            missing = bm.blocks_needed(req.num_tokens) - len(req.block_table)
            while missing > cache.num_available_blocks:
                victim = queue.pop() if queue else req
                self._preempt(victim)
                if victim is req:
                    break
            else:
                if missing:
                    cache.allocate(req, missing)
                scheduled.append(req)
        self.running = scheduled
        return list(scheduled)  # a copy: finishing requests mutates self.running

    def _preempt(self, req: Request) -> None:
        self.cache.insert(req, req.num_tokens - 1)  # keep its computed blocks: recompute mostly hits
        self.cache.release(req)
        req.num_cached_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        """Mark a request finished, cache its computed blocks, release them (a no-op for
        finished requests)."""
        if req.is_finished:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            self.cache.insert(req, req.num_tokens - 1)  # the last sampled token has no KV yet
        else:
            self.waiting.remove(req)
        self.cache.release(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason

    def check_invariants(self) -> None:
        assert all(not r.block_table and r.lock_node is None and r.status == RequestStatus.WAITING
                   for r in self.waiting)
        assert all(r.status == RequestStatus.RUNNING for r in self.running)
        assert all(len(r.block_table) >= self.block_manager.blocks_needed(r.num_tokens - 1) for r in self.running)
        self.cache.check_invariants(self.running)
