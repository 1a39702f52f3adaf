"""Continuous batching: which requests run in the next forward, and how many tokens each.

A step mixes decodes and prefills under one token budget (max_num_batched_tokens), as vLLM's
scheduler does: running requests come first, in admission order (one token each for decodes,
the next chunk for a prompt still being prefilled), then waiting requests are admitted FCFS
while the budget, max_num_seqs and the blocks last. With chunked prefill on, a prompt longer
than what is left of the budget is prefilled over several steps; off, it waits for a step with
room for all of it. A request samples a token only in the step that computes its last token.

When a running request needs a block and none is free or evictable, the most recently admitted
request is preempted and goes back to the front of the queue. With preemption_mode "recompute"
its computed blocks go into the prefix cache (when on), its references are released, and it is
recomputed later, from the cache as far as its blocks have not been evicted meanwhile. With
"swap" its blocks are copied to the host pool (SWAPPED) and back when it resumes; when the host
pool cannot take them, it is recomputed.

Admission takes the longest cached prefix of a request's tokens (prefix_cache.py) and computes
only the rest. The full blocks a step computes go into the tree when the step is scheduled, so
a request admitted later in the same step reuses them: within one forward every layer stores
all new K/V before any query attends, so the second request reads blocks the first is filling
in the same step. Blocks that a later chunk will compute are not inserted before it runs.

Invariant: between steps a RUNNING request holds blocks_needed(num_computed_tokens) blocks or
more (its KV cache covers its first num_computed_tokens tokens; a decoding request's cover all
but the last sampled token); WAITING and FINISHED requests hold none.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from picovllm.engine.block_manager import BlockManager
from picovllm.engine.prefix_cache import PrefixCache
from picovllm.engine.request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # computed this step, from num_computed_tokens
    is_decode: bool = True  # every request computes one token and samples: a graph step

    def add(self, req: Request, n: int) -> None:
        self.requests.append(req)
        self.num_new_tokens.append(n)
        self.is_decode = self.is_decode and n == 1 and req.num_computed_tokens == req.num_tokens - 1


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        preemption_mode: str = "recompute",
    ):
        self.block_manager = block_manager
        self.cache = PrefixCache(block_manager, enable_prefix_caching)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.swap = preemption_mode == "swap"
        self.num_swapped_out = 0  # preemptions that swapped (the others recomputed)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0
        self.finished_ids: list[str] = []
        self.transferring: list[Request] = []  # WAITING_FOR_REMOTE_KV (a decode instance's)
        self.new_pulls: list[Request] = []  # admitted this step, their pulls to start (engine)
        self.paused = False  # admit nothing (a sync-mode prefill instance holding a transfer)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def schedule(self) -> ScheduledBatch | None:
        batch = ScheduledBatch()
        budget = self._schedule_running(batch, self.max_num_batched_tokens)
        self._admit(batch, budget)
        return batch if batch.requests else None

    def schedule_ahead(self, decodes: list[Request]) -> ScheduledBatch | None:
        """The step after one whose sampled tokens are still on the device (async scheduling):
        `decodes`, running requests that sampled in it, decode those tokens (the batch's first
        rows; their KV covers every token they hold, so each needs room for one more); the other
        running requests' prompt chunks follow, then admissions, as schedule() orders them. None
        when blocks run short: preemption waits for the synchronous schedule."""
        bm, cache = self.block_manager, self.cache
        ahead = set(map(id, decodes))
        plan = [(r, 1) for r in decodes]
        budget = self.max_num_batched_tokens - len(decodes)
        for r in self.running:
            n = min(r.num_tokens - r.num_computed_tokens, budget)
            if id(r) not in ahead and n > 0:  # (n = 0: a request whose last token is on the device)
                plan.append((r, n))
                budget -= n
        missing = [bm.blocks_needed(r.num_computed_tokens + n) - len(r.block_table) for r, n in plan]
        if sum(missing) > cache.num_available_blocks:
            return None
        batch = ScheduledBatch(list(decodes), [1] * len(decodes))
        for (r, n), m in zip(plan, missing):
            if id(r) in ahead:
                if m:
                    cache.allocate(r, m)
            else:
                self._schedule(batch, r, n, m)
        self._admit(batch, budget)
        return batch

    def _schedule(self, batch: ScheduledBatch, req: Request, n: int, missing: int) -> None:
        """Give a running request the `missing` blocks its next n tokens need, and the batch those tokens."""
        if missing:
            self.cache.allocate(req, missing)
        if n > 1:  # a prompt chunk: its full blocks become shareable now (decodes wait for finish)
            self.cache.insert(req, req.num_computed_tokens + n)
        batch.add(req, n)

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        bm, cache = self.block_manager, self.cache
        queue = deque(self.running)
        kept: list[Request] = []
        while queue and budget > 0:
            req = queue.popleft()
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            missing = bm.blocks_needed(req.num_computed_tokens + n) - len(req.block_table)
            while missing > 0 and missing > cache.num_available_blocks:
                victim = queue.pop() if queue else req
                self._preempt(victim)
                if victim is req:
                    break
            else:
                self._schedule(batch, req, n, missing)
                kept.append(req)
                budget -= n
        self.running = kept + list(queue)  # those past the budget stay running, unscheduled this step
        return budget

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        """Admit waiting requests FCFS while they fit; a request is taken off the queue only once
        its blocks are its own. A sibling waiting for its first completion's pull (n > 1) stays
        queued without holding back the requests behind it."""
        cache, skipped = self.cache, []
        try:
            while (
                not self.paused
                and self.waiting
                and budget > 0
                and len(self.running) + len(self.transferring) < self.max_num_seqs
            ):
                req = self.waiting[0]
                if req.after is not None and req.after.status in _NOT_YET_PULLED:
                    skipped.append(self.waiting.popleft())  # (its blocks come with the sibling's)
                    continue
                if req.status == RequestStatus.SWAPPED:
                    if not self._swap_in(batch, req, budget):
                        break
                    budget -= batch.num_new_tokens[-1]
                    continue
                cache.acquire(req)
                if _pulls(req):
                    if not self._admit_pull(req):
                        break
                    continue
                remaining = req.num_tokens - req.num_computed_tokens
                n = min(remaining, budget) if self.enable_chunked_prefill else remaining
                needed = self.block_manager.blocks_needed(req.num_computed_tokens + n) - len(req.block_table)
                # Keep one block per running request in reserve for its next decode step, so that a
                # new admission is not preempted straight away; an empty engine admits whatever fits.
                reserve = len(self.running)
                if n > budget or needed + reserve > cache.num_available_blocks:
                    cache.release(req)
                    break
                self._allocate(req, needed)
                self.waiting.popleft()
                cache.insert(req, req.num_computed_tokens + n)
                self._count_prompt_hits(req)
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                batch.add(req, n)
                budget -= n
        finally:
            self.waiting.extendleft(reversed(skipped))

    def _allocate(self, req: Request, n: int) -> None:
        """n more blocks for a request being admitted; if they cannot be had (num_available_blocks
        promised them), it gives back what it holds and the error goes on."""
        try:
            self.cache.allocate(req, n)
        except Exception:
            self.cache.release(req)
            raise

    def _swap_in(self, batch: ScheduledBatch, req: Request, budget: int) -> bool:
        """Resume a swapped-out request: its blocks back from the host, and its next tokens in
        the batch. False when the blocks are short (as for an admission, one is kept in reserve
        for each running request)."""
        remaining = req.num_tokens - req.num_swapped_tokens
        n = min(remaining, budget) if self.enable_chunked_prefill else remaining
        needed = self.block_manager.blocks_needed(req.num_swapped_tokens + n)
        if n > budget or needed + len(self.running) > self.cache.num_available_blocks:
            return False
        self.cache.swap_in(req, needed)
        self.waiting.popleft()
        self.cache.insert(req, req.num_computed_tokens + n)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        batch.add(req, n)
        return True

    def _admit_pull(self, req: Request) -> bool:
        """Admit a request whose prompt's KV a prefill instance holds: blocks for the whole prompt
        (its cached prefix found already), then it waits for the pull (the engine starts it) and
        takes no step budget. False when the blocks are short."""
        cache = self.cache
        needed = self.block_manager.blocks_needed(req.num_prompt_tokens) - len(req.block_table)
        if needed + len(self.running) > cache.num_available_blocks:
            cache.release(req)
            return False
        self._allocate(req, needed)
        self.waiting.popleft()
        self._count_prompt_hits(req)
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.transferring.append(req)
        self.new_pulls.append(req)
        return True

    def _count_prompt_hits(self, req: Request) -> None:
        """At a request's first admission: the prompt tokens its cache hit serves (reported, and
        in the hit rate); a readmission after preemption does not count again."""
        if req.num_prompt_cached_tokens is None:
            req.num_prompt_cached_tokens = req.num_cached_tokens
            self.cache.record_query(req.num_prompt_tokens, req.num_cached_tokens, req.num_host_cached_tokens)

    def take_new_pulls(self) -> list[Request]:
        pulls, self.new_pulls = self.new_pulls, []
        return pulls

    def pulled(self, req: Request) -> None:
        """req's prompt KV has landed (all but its last token, which it computes and samples from)."""
        self.transferring.remove(req)
        req.kv_transfer_params = None
        req.num_computed_tokens = req.num_prompt_tokens - 1
        self.cache.insert(req, req.num_computed_tokens)
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def requeue(self, req: Request) -> None:
        """req's pull failed: it gives its blocks back and waits to be prefilled here."""
        self.transferring.remove(req)
        self.cache.release(req)
        req.kv_transfer_params = None
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def _preempt(self, req: Request) -> None:
        if self.swap and req.num_computed_tokens > 0 and self.cache.swap_out(req):
            req.status = RequestStatus.SWAPPED
            self.num_swapped_out += 1
        else:
            self.cache.insert(req, req.num_computed_tokens)  # keep its computed blocks: recompute mostly hits
            self.cache.release(req)
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
            self.cache.insert(req, req.num_computed_tokens)
        elif req.status == RequestStatus.WAITING_FOR_REMOTE_KV:  # (its pull has ended: the engine waits for that)
            self.transferring.remove(req)
        elif req.status == RequestStatus.WAITING_FOR_GRAMMAR:  # (not here yet: StructuredOutputManager)
            pass
        else:
            self.waiting.remove(req)
        self.cache.release(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.finished_ids.append(req.request_id)

    def take_finished_ids(self) -> list[str]:
        """The requests finished since the last call (the model runner drops what it kept of them)."""
        ids, self.finished_ids = self.finished_ids, []
        return ids

    def check_invariants(self, ahead: list[Request] = (), held: list[tuple[list[int], object]] = ()) -> None:
        """`ahead`: requests in a step launched before the last one's tokens were read; they have
        computed every token they hold (the next one is on the device). `held`: (blocks, tree
        node) of holders other than requests (engine/kv_handoff.py: leases, quarantined pulls):
        one reference on each block, one lock on the node (None: no lock)."""
        ahead_ids = set(map(id, ahead))
        assert all(not r.block_table and r.lock_node is None for r in self.waiting)
        assert all(
            (r.status == RequestStatus.SWAPPED) == bool(r.host_blocks)
            and r.status in (RequestStatus.WAITING, RequestStatus.SWAPPED)
            for r in self.waiting
        )
        assert all(r.status == RequestStatus.RUNNING for r in self.running)
        assert all(
            len(r.block_table) >= self.block_manager.blocks_needed(r.num_computed_tokens)
            and 0 < r.num_computed_tokens <= r.num_tokens - (id(r) not in ahead_ids)
            for r in self.running
        )
        assert all(
            r.status == RequestStatus.WAITING_FOR_REMOTE_KV
            and len(r.block_table) == self.block_manager.blocks_needed(r.num_prompt_tokens)
            for r in self.transferring
        )
        swapped = [r for r in self.waiting if r.status == RequestStatus.SWAPPED]
        self.cache.check_invariants(self.running + self.transferring, held, swapped)


_NOT_YET_PULLED = (RequestStatus.WAITING, RequestStatus.WAITING_FOR_REMOTE_KV)


def _pulls(req: Request) -> bool:
    """Whether req's prompt KV is to be pulled from a prefill instance (a decode instance's request)."""
    return req.kv_transfer_params is not None and req.kv_transfer_params.pulls
