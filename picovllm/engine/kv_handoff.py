"""The engine's side of disaggregated prefill (EngineConfig.kv_role; the transport is the KV
transfer of the rank that holds the pool, distributed/kv_transfer.py).

A prefill instance runs a request that asks for it (kv_transfer_params {"do_remote_decode": true},
max_tokens 1) as any other; when it finishes, its prompt's blocks stay held under a lease, and
its output's kv_transfer_params say where they are: the pool's agent, the block ids, the number of
tokens. The lease ends when the decode instance releases the request (after its pull, or when it
gives up on it), or after kv_lease_s: then the blocks are freed (they stay in the prefix cache).
Held blocks are the bound on what awaits pickup: when they fill the pool, new prompts wait for a
lease to end (back-pressure), and nothing else is held.

A decode instance admits a request carrying those parameters (Scheduler._admit_pull) with blocks
for its whole prompt, its own prefix cache first; the blocks its cache lacks, up to the prompt's
last token, are pulled; once they land the request computes that last token and samples from it,
as if it had prefilled the prompt itself. A failed pull (the prefill instance gone) frees its
blocks and the request prefills here instead; an aborted request's blocks are freed once its
pull has ended (the pull writes into them). With n > 1 the first completion pulls; the others
wait for it and take its blocks from the prefix cache.
In sync mode each pull completes before the engine goes on, and a prefill instance admits no
prompt while a lease is held.

Invariants (LLMEngine.check_invariants): every leased block holds one reference of the lease; a
request being pulled holds the blocks of its whole prompt.
"""

from __future__ import annotations

import bisect
import logging
import time

from picovllm.config import EngineConfig
from picovllm.distributed.kv_transfer import KVTransfer
from picovllm.engine.block_manager import BlockManager
from picovllm.engine.request import Request
from picovllm.engine.scheduler import Scheduler

logger = logging.getLogger("picovllm")


class KVHandoff:
    def __init__(self, config: EngineConfig, transfer: KVTransfer, scheduler: Scheduler, block_bytes: int):
        self.role, self.sync, self.lease_s = config.kv_role, config.kv_transfer_mode == "sync", config.kv_lease_s
        self.transfer = transfer
        self.scheduler = scheduler
        self.bm: BlockManager = scheduler.block_manager
        self.leases: dict[str, tuple[list[int], float]] = {}  # request id -> (blocks held, deadline)
        self.pulling: dict[str, Request] = {}  # request id -> request, its pull in flight
        self.aborted: set[str] = set()  # pulls in flight whose requests were aborted
        self.started: dict[str, float] = {}  # pull id -> when it started
        self.block_bytes = block_bytes  # one block, every layer's K and V
        self.metrics = dict.fromkeys(METRICS, 0)
        self.transfer_time = [0] * (len(TRANSFER_TIME_BUCKETS) + 1)  # completed pulls per bucket (last: +Inf)
        self.transfer_time_sum = 0.0

    # ---- prefill side -----------------------------------------------------------------------

    def hold(self, req: Request) -> dict:
        """Hold a finished request's prompt blocks for its decode instance; what to tell it."""
        blocks = req.block_table[: self.bm.blocks_needed(req.num_computed_tokens)]
        self.bm.inc_ref(blocks)
        self.leases[req.request_id] = (blocks, time.monotonic() + self.lease_s)
        return {
            "remote_agent": self.transfer.agent_info(),
            "remote_request_id": req.request_id,
            "remote_block_ids": blocks,
            "remote_num_tokens": req.num_computed_tokens,
        }

    def end_leases(self) -> None:
        """Free the blocks decode instances released, and those whose lease ran out."""
        for rid in self.transfer.released():
            self._free_lease(rid)
        now = time.monotonic()
        for rid in [rid for rid, (_, deadline) in self.leases.items() if deadline < now]:
            self.metrics["kv_leases_expired"] += 1
            self._free_lease(rid)

    def _free_lease(self, request_id: str) -> None:
        lease = self.leases.pop(request_id, None)
        if lease is not None:
            self.bm.free(lease[0])

    @property
    def admission_paused(self) -> bool:
        """Sync mode on a prefill instance: no new prompt while a transfer is pending."""
        return self.sync and self.role == "prefill" and bool(self.leases)

    # ---- decode side ------------------------------------------------------------------------

    def start(self, req: Request) -> None:
        """Start pulling the blocks of req's prompt that its prefix cache lacks (up to its last
        token); in sync mode, wait for it (see poll)."""
        params = req.kv_transfer_params
        first = req.num_computed_tokens // self.bm.block_size
        last = self.bm.blocks_needed(req.num_prompt_tokens - 1)
        if first >= last:
            self._release(req)
            self.scheduler.pulled(req)
            return
        remote = params["remote_block_ids"][first:last]
        self.pulling[req.request_id] = req
        self.metrics["kv_transfers_started"] += 1
        self.metrics["kv_transfer_blocks"] += len(remote)
        self.metrics["kv_transfer_bytes"] += len(remote) * self.block_bytes
        self.started[req.request_id] = time.perf_counter()
        self.transfer.pull(req.request_id, params["remote_agent"], remote, req.block_table[first:last])
        while self.sync and req.request_id in self.pulling:
            self.poll()

    def poll(self) -> None:
        """The pulls that ended since the last call: their requests run now. A failed pull puts
        its request back in the queue to prefill here, as vLLM's "recompute" policy does; an
        aborted request is finished once its pull has ended."""
        if not self.pulling:
            return
        done, failed = self.transfer.poll()
        for rid in done + list(failed):
            req = self.pulling.pop(rid)
            seconds = time.perf_counter() - self.started.pop(rid)
            if rid not in failed:
                self.transfer_time[bisect.bisect_left(TRANSFER_TIME_BUCKETS, seconds)] += 1
                self.transfer_time_sum += seconds
            self._release(req)
            self.metrics["kv_transfers_failed" if rid in failed else "kv_transfers_done"] += 1
            if rid in self.aborted:
                self.aborted.discard(rid)
                self.scheduler.finish(req, "abort")
            elif rid in failed:
                logger.warning("request %s: KV pull failed (%s); prefilling it here", rid, failed[rid])
                self.scheduler.requeue(req)
            else:
                self.scheduler.pulled(req)

    def abort(self, req: Request) -> bool:
        """True if req's pull is in flight: it is finished when the pull ends (its blocks are
        being written), not now."""
        if req.request_id in self.pulling:
            self.aborted.add(req.request_id)
            return True
        return False

    def _release(self, req: Request) -> None:
        params = req.kv_transfer_params
        self.transfer.release(params["remote_agent"], params["remote_request_id"])

    # ---- both ---------------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Work that needs polling while no request is runnable: pulls in flight, leases held."""
        return bool(self.pulling or self.leases)

    def held_blocks(self) -> list[list[int]]:
        return [blocks for blocks, _ in self.leases.values()]

    def get_metrics(self) -> dict:
        """METRICS and GAUGES by name, and the completed pulls' times: kv_transfer_time_buckets
        (counts per TRANSFER_TIME_BUCKETS bucket, then above the last) and kv_transfer_time_sum."""
        held = sum(len(b) for b in self.held_blocks())
        return {
            **self.metrics,
            **self.transfer.stats(),
            "kv_blocks_held_for_pickup": held,
            "kv_transfer_time_buckets": list(self.transfer_time),
            "kv_transfer_time_sum": self.transfer_time_sum,
        }


METRICS = {  # LLMEngine.get_metrics' keys of a prefill or decode instance, and what they count
    "kv_transfers_started": "KV pulls started (decode instance).",
    "kv_transfers_done": "KV pulls completed (decode instance).",
    "kv_transfers_failed": "KV pulls failed; their requests prefilled locally (decode instance).",
    "kv_transfer_blocks": "KV blocks pulled (decode instance).",
    "kv_transfer_bytes": "KV bytes pulled (decode instance).",
    "kv_leases_expired": "Prompts whose KV no decode instance pulled in time (prefill instance).",
    "kv_transfers_cuda_ipc": "KV pulls copied through CUDA IPC, not NIXL (decode instance).",
}
GAUGES = {"kv_blocks_held_for_pickup": "KV blocks held for decode instances to pull (prefill instance)."}
TRANSFER_TIME_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def check_kv_transfer_params(kv, role: str, block_size: int, ids: list[int], n: int) -> None:
    """A request's kv_transfer_params against this instance's role and the prompt: ValueError
    ("kv_transfer_params: ...") when they do not fit."""
    problem = _kv_params_problem(kv, role, block_size, ids, n)
    if problem is not None:
        raise ValueError(f"kv_transfer_params: {problem}")


def _kv_params_problem(kv, role: str, block_size: int, ids: list[int], n: int) -> str | None:
    if not isinstance(kv, dict):
        return "must be an object"
    if kv.get("do_remote_decode"):
        if role != "prefill":
            return f"do_remote_decode needs a prefill instance (this one: {role})"
        return None if n == 1 else "a prefill instance's request computes one completion (n=1)"
    if "remote_block_ids" not in kv:
        return "need do_remote_decode, or a prefill instance's answer"
    if role != "decode":
        return f"remote blocks need a decode instance (this one: {role})"
    if kv.get("remote_num_tokens") != len(ids):
        return (
            f"the prefill instance computed {kv.get('remote_num_tokens')} prompt tokens, "
            f"this prompt has {len(ids)}: not the same prompt"
        )
    blocks = kv.get("remote_block_ids")
    if not isinstance(blocks, list) or len(blocks) * block_size < len(ids) - 1:
        return "remote_block_ids do not cover the prompt"
    if not isinstance(kv.get("remote_agent"), dict) or not isinstance(kv.get("remote_request_id"), str):
        return "remote_agent or remote_request_id missing"
    return None
