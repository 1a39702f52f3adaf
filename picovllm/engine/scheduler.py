"""Continuous batching: which requests run in the next forward.

Each step is either a prefill of newly admitted requests (FCFS, within max_num_seqs and
max_num_batched_tokens, while blocks last) or a decode of all running requests. When a running
request needs a block and none is free, the most recently admitted request is preempted: its
blocks are freed and it goes back to the front of the queue, to be recomputed later.

Invariant: a RUNNING request holds exactly blocks_needed(num_tokens - 1) blocks between steps
(its KV cache covers every token but the last sampled one), and scheduling it for decode
tops that up to blocks_needed(num_tokens); WAITING and FINISHED requests hold none.
"""
from __future__ import annotations

from collections import deque
from typing import NamedTuple

from picovllm.engine.block_manager import BlockManager
from picovllm.engine.request import Request, RequestStatus


class ScheduledBatch(NamedTuple):
    requests: list[Request]
    is_prefill: bool


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        batch = self._admit()
        if batch:
            return ScheduledBatch(batch, is_prefill=True)
        batch = self._decode_batch()
        return ScheduledBatch(batch, is_prefill=False) if batch else None

    def _admit(self) -> list[Request]:
        bm = self.block_manager
        batch: list[Request] = []
        num_tokens = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            needed = bm.blocks_needed(req.num_tokens)
            # Keep one block per running request in reserve for its next decode step, so that a
            # new admission is not preempted straight away; an empty engine admits whatever fits.
            reserve = len(self.running) if self.running else 0
            if num_tokens + req.num_tokens > self.max_num_batched_tokens or not bm.can_allocate(needed + reserve):
                break
            self.waiting.popleft()
            req.block_table = bm.allocate(needed)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            batch.append(req)
            num_tokens += req.num_tokens
        return batch

    def _decode_batch(self) -> list[Request]:
        bm = self.block_manager
        scheduled: list[Request] = []
        queue = deque(self.running)
        while queue:
            req = queue.popleft()
            missing = bm.blocks_needed(req.num_tokens) - len(req.block_table)
            while not bm.can_allocate(missing):
                victim = queue.pop() if queue else req
                self._preempt(victim)
                if victim is req:
                    break
            else:
                if missing:
                    req.block_table += bm.allocate(missing)
                scheduled.append(req)
        self.running = scheduled
        return list(scheduled)  # a copy: finishing requests mutates self.running

    def _preempt(self, req: Request) -> None:
        self.block_manager.free(req.block_table)
        req.block_table = []
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        """Mark a request finished and release its blocks (a no-op for finished requests)."""
        if req.is_finished:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.block_manager.free(req.block_table)
        req.block_table = []
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason

    def check_invariants(self) -> None:
        bm = self.block_manager
        held = [b for r in self.running for b in r.block_table]
        assert all(not r.block_table and r.status == RequestStatus.WAITING for r in self.waiting)
        assert all(r.status == RequestStatus.RUNNING for r in self.running)
        # without shared blocks (prefix caching), every used block has exactly one holder
        assert sorted(held) == sorted(set(held)), "a block is held twice"
        assert len(held) == bm.num_used_blocks, f"{len(held)} blocks held, {bm.num_used_blocks} used"
        assert bm.num_free_blocks + bm.num_used_blocks == bm.num_total_blocks
        bm.check_invariants()
