"""The engine's side of disaggregated prefill (EngineConfig.kv_role; the transport is the KV
transfer of the rank that holds the pool, distributed/kv_transfer/).

A prefill instance runs a request that asks for it (kv_transfer_params {"do_remote_decode": true},
max_tokens 1) as any other; when it finishes, its prompt's blocks stay held under a lease, and
its output's kv_transfer_params say where they are: the pool's agent, the block ids, the number of
tokens, the seconds the lease has left (remote_lease_s) and what the KV is (remote_compat: the
model's weights fingerprint, dtype, layout). A lease holds a reference on each block and a lock on
the prompt's node of the prefix cache, as a live request does, so eviction never counts its
blocks as free. It ends when the decode instance releases the request (LeaseNotice "pulled" or
"release"), when the request is aborted here (the router gives up on it), or kv_lease_s after it
was last renewed: then the blocks are freed (they stay in the prefix cache). Held blocks are the
bound on what awaits pickup: when they fill the pool, new prompts wait for a lease to end
(back-pressure). A "pulled" notice for a lease that has ended counts as a late pull.

A decode instance takes a request carrying those parameters with a deadline: the lease's time left
when it arrived. While the request waits here it renews the lease (a "renew" notice once a
third of that time has passed), so a queue does not outlast it. When the scheduler admits the request
(Scheduler._admit_pull: blocks for its whole prompt, its own prefix cache first) the blocks its
cache lacks, up to the prompt's last token, are pulled; once they land the request computes that
last token and samples from it, as if it had prefilled the prompt itself. A pull has a deadline:
kv_pull_timeout_s, and never later than LEASE_MARGIN before the lease's end. A request is
prefilled here instead when the prefill instance's KV is not this instance's (compat), when its
lease has too little time left to start, when its pull fails (the prefill instance gone), and
when its pull misses its deadline: then its blocks stay held (quarantined) until the transfer
ends, for it may still write into them, and the request gets fresh ones. An aborted request
releases its lease and ends at once (a pull in flight is quarantined the same way). With n > 1
the first completion pulls; the others wait for it (without holding back other requests) and
take its blocks from the prefix cache.
In sync mode a decode instance admits no request while a pull is in flight (the running ones go
on), and a prefill instance admits no prompt while a lease is held.

The deadlines rest on one assumption: the time from the prefill instance's answer to the decode
instance's arrival, plus a notice's delivery, is well under LEASE_MARGIN.

Invariants (LLMEngine.check_invariants): every leased block holds one reference of the lease and
every lease one lock on its node; every quarantined block one reference; a request being pulled
holds the blocks of its whole prompt.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from dataclasses import dataclass

from picovllm.config import EngineConfig, ModelConfig
from picovllm.distributed.kv_transfer import KVTransfer, LeaseNotice
from picovllm.engine.block_manager import BlockManager
from picovllm.engine.request import Request, RequestStatus
from picovllm.engine.scheduler import Scheduler
from picovllm.kv_transfer_params import KVTransferParams

logger = logging.getLogger("picovllm")

LEASE_MARGIN_S = 1.0  # a pull ends this long before the lease does (at most a quarter of the lease)


@dataclass
class _Lease:
    """A prefill instance's: a prompt's blocks held for a decode instance, and their tree lock."""

    blocks: list[int]
    node: object  # (the prefix cache's node it locks; None with the cache off)
    deadline: float  # time.monotonic()


@dataclass
class _Pending:
    """A decode instance's request whose prompt KV a prefill instance holds for it."""

    req: Request
    length: float  # the lease's time left when the request arrived: what a renewal adds
    renewed: float  # when the lease was last renewed (or the request arrived), time.monotonic()
    pull: _Pull | None = None

    @property
    def deadline(self) -> float:
        """The lease's end, as far as this side knows."""
        return self.renewed + self.length

    @property
    def margin(self) -> float:
        return min(LEASE_MARGIN_S, self.length / 4)


@dataclass
class _Pull:
    pull_id: str
    blocks: list[int]  # the local blocks it writes
    started: float  # time.perf_counter()
    deadline: float  # time.monotonic()


class KVHandoff:
    def __init__(self, config: EngineConfig, transfer: KVTransfer, scheduler: Scheduler, block_bytes: int, compat):
        self.role, self.sync, self.lease_s = config.kv_role, config.kv_transfer_mode == "sync", config.kv_lease_s
        self.pull_timeout_s = config.kv_pull_timeout_s
        self.transfer = transfer
        self.scheduler = scheduler
        self.bm: BlockManager = scheduler.block_manager
        self.compat = compat  # what this instance's KV is (kv_compat)
        self.leases: dict[str, _Lease] = {}  # prefill: request id -> its lease
        self.pending: dict[str, _Pending] = {}  # decode: request id -> its lease, and its pull
        self.pulls: dict[str, _Pending] = {}  # decode: pull id -> the request it is for
        self.quarantined: dict[str, list[int]] = {}  # decode: pull id -> blocks it may still write
        self._pull_ids = itertools.count()
        self.block_bytes = block_bytes  # one block, every layer's K and V
        self.metrics = dict.fromkeys(METRICS, 0)
        self.transfer_time = [0] * (len(TRANSFER_TIME_BUCKETS) + 1)  # completed pulls per bucket (last: +Inf)
        self.transfer_time_sum = 0.0

    def tick(self) -> None:
        """Once a step, before scheduling: the notices and leases (prefill), the pulls and the
        renewals (decode)."""
        if self.role == "prefill":
            self._end_leases()
        else:
            self._poll()
            self._renew()

    # ---- prefill side -----------------------------------------------------------------------

    def hold(self, req: Request) -> KVTransferParams:
        """Hold a finished request's prompt blocks for its decode instance; what to tell it."""
        blocks = req.block_table[: self.bm.blocks_needed(req.num_computed_tokens)]
        self.bm.inc_ref(blocks)
        node = req.lock_node
        if node is not None:
            self.scheduler.cache.tree.lock(node, +1)
        self.leases[req.request_id] = _Lease(blocks, node, time.monotonic() + self.lease_s)
        return KVTransferParams(
            remote_request_id=req.request_id,
            remote_agent=self.transfer.agent_info(),
            remote_block_ids=tuple(blocks),
            remote_num_tokens=req.num_computed_tokens,
            remote_lease_s=self.lease_s,
            remote_compat=self.compat,
        )

    def _end_leases(self) -> None:
        """Take the notices in, then free the leases that ran out."""
        for notice in self.transfer.notices():
            lease = self.leases.get(notice.request_id)
            if notice.kind == "renew":
                if lease is not None:
                    lease.deadline = time.monotonic() + self.lease_s
            elif lease is not None:
                self.end_lease(notice.request_id)
            elif notice.kind == "pulled":
                self.metrics["kv_late_pulls"] += 1
                logger.error("request %s: a decode instance read its KV after the lease had ended", notice.request_id)
        now = time.monotonic()
        for rid in [rid for rid, lease in self.leases.items() if lease.deadline < now]:
            self.metrics["kv_leases_expired"] += 1
            self.end_lease(rid)

    def end_lease(self, request_id: str) -> bool:
        """Free a lease's blocks and its lock (False: no such lease)."""
        lease = self.leases.pop(request_id, None)
        if lease is None:
            return False
        self.bm.free(lease.blocks)
        if lease.node is not None:
            self.scheduler.cache.tree.lock(lease.node, -1)
        return True

    @property
    def admission_paused(self) -> bool:
        """Sync mode: a prefill instance admits no prompt while it holds a lease, a decode instance
        no request while a pull is in flight."""
        return self.sync and bool(self.leases if self.role == "prefill" else self.pulls)

    # ---- decode side ------------------------------------------------------------------------

    def expect(self, req: Request) -> None:
        """A request arrived whose prompt KV a prefill instance holds (its lease's clock starts)."""
        self.pending[req.request_id] = _Pending(req, req.kv_transfer_params.remote_lease_s, time.monotonic())

    def _pull_deadline(self, p: _Pending, now: float) -> float | None:
        """When a pull of p's started now must have ended; None if that leaves it too little time
        (counted: p's request is to be prefilled here)."""
        deadline = min(now + self.pull_timeout_s, p.deadline - p.margin)
        if deadline - now >= p.margin:
            return deadline
        self.metrics["kv_pulls_skipped"] += 1
        logger.warning(
            "request %s: the prefill instance's lease ends too soon to pull: prefilling here", p.req.request_id
        )
        return None

    def _renew(self) -> None:
        """Renew the leases a third gone of the requests still here; a request not yet pulling
        whose lease is too close to its end to pull (it was not renewed: this engine did not run)
        is prefilled here."""
        now = time.monotonic()
        for p in list(self.pending.values()):
            if p.pull is None and self._pull_deadline(p, now) is None:
                self._prefill_here(p)
            elif now - p.renewed > p.length / 3:
                self._notify(p, "renew")
                p.renewed = now

    def start(self, req: Request) -> None:
        """Start pulling the blocks of req's prompt that its prefix cache lacks (up to its last
        token), or prefill it here (see the module's docstring)."""
        p = self.pending[req.request_id]
        params = req.kv_transfer_params
        first = req.num_computed_tokens // self.bm.block_size
        last = self.bm.blocks_needed(req.num_prompt_tokens - 1)
        problem = _compat_problem(params.remote_compat, self.compat)
        if problem is not None:
            self.metrics["kv_transfers_incompatible"] += 1
            logger.error(
                "request %s: the prefill instance's KV is not this instance's (%s): prefilling here",
                req.request_id,
                problem,
            )
            self._prefill_here(p)
        elif (deadline := self._pull_deadline(p, time.monotonic())) is None:
            self._prefill_here(p)
        elif first >= last:  # (its own prefix cache holds all of it)
            self._give_up(p, "release")
            self.scheduler.pulled(req)
        else:
            pull_id = f"{req.request_id}#{next(self._pull_ids)}"
            blocks = req.block_table[first:last]
            p.pull = _Pull(pull_id, blocks, time.perf_counter(), deadline)
            self.pulls[pull_id] = p
            remote = list(params.remote_block_ids[first:last])
            self.metrics["kv_transfers_started"] += 1
            self.metrics["kv_transfer_blocks"] += len(remote)
            self.metrics["kv_transfer_bytes"] += len(remote) * self.block_bytes
            self.transfer.pull(pull_id, params.remote_agent, remote, blocks, self.bm.written_in_flight(blocks))

    def _poll(self) -> None:
        """The pulls that ended since the last call, and those past their deadline: a request whose
        pull landed in time runs now; one whose pull failed or missed its deadline is prefilled
        here, as vLLM's "recompute" policy does."""
        if not (self.pulls or self.quarantined):
            return
        done, failed = self.transfer.poll()
        now = time.monotonic()
        for pull_id in done + list(failed):
            if pull_id in self.quarantined:  # (given up on: its blocks are free to use again)
                self.bm.free(self.quarantined.pop(pull_id))
                continue
            p = self.pulls.pop(pull_id)
            req, pull = p.req, p.pull
            p.pull = None
            if pull_id in failed or now > pull.deadline:
                self.metrics["kv_transfers_failed"] += 1
                why = failed.get(pull_id, "it ended past its deadline")
                logger.warning("request %s: KV pull failed (%s); prefilling it here", req.request_id, why)
                self._prefill_here(p)
                continue
            seconds = time.perf_counter() - pull.started
            self.transfer_time[bisect.bisect_left(TRANSFER_TIME_BUCKETS, seconds)] += 1
            self.transfer_time_sum += seconds
            self.metrics["kv_transfers_done"] += 1
            self._give_up(p, "pulled")
            self.scheduler.pulled(req)
        for p in [p for p in self.pulls.values() if now > p.pull.deadline]:
            self.metrics["kv_transfers_timed_out"] += 1
            logger.warning("request %s: KV pull past its deadline; prefilling it here", p.req.request_id)
            self._quarantine(p)
            self._prefill_here(p)

    def _prefill_here(self, p: _Pending) -> None:
        """p's request no longer waits for the prefill instance: release the lease and queue it
        (again) to prefill here."""
        self._give_up(p, "release")
        if p.req.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            self.scheduler.requeue(p.req)  # (its blocks back; it clears the parameters)
        else:
            p.req.kv_transfer_params = None

    def _quarantine(self, p: _Pending) -> None:
        """Keep the blocks of p's pull in flight held until the transfer ends (it may still write
        them); p's request no longer waits for it."""
        pull = p.pull
        del self.pulls[pull.pull_id]
        self.bm.inc_ref(pull.blocks)
        self.quarantined[pull.pull_id] = pull.blocks
        p.pull = None

    def _give_up(self, p: _Pending, kind: str) -> None:
        """Done with p's lease: tell the prefill instance ("pulled" or "release")."""
        del self.pending[p.req.request_id]
        self._notify(p, kind)

    def _notify(self, p: _Pending, kind: str) -> None:
        params = p.req.kv_transfer_params
        self.transfer.notify(params.remote_agent, LeaseNotice(kind, params.remote_request_id))

    def abort(self, req: Request) -> None:
        """Before req is finished as aborted: release its lease (a pull in flight quarantined)."""
        p = self.pending.get(req.request_id)
        if p is None or p.req is not req:
            return
        if p.pull is not None:
            self._quarantine(p)
        self._give_up(p, "release")

    # ---- both ---------------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Work to watch while no request is runnable: leases held, pulls in flight or quarantined."""
        return bool(self.leases or self.pending or self.quarantined)

    def held(self) -> list[tuple[list[int], object]]:
        """(blocks, tree node) of each holder outside requests: leases, quarantined pulls (no node)."""
        return [(lease.blocks, lease.node) for lease in self.leases.values()] + [
            (blocks, None) for blocks in self.quarantined.values()
        ]

    def get_metrics(self) -> dict:
        """METRICS and GAUGES by name, and the completed pulls' times: kv_transfer_time_buckets
        (counts per TRANSFER_TIME_BUCKETS bucket, then above the last) and kv_transfer_time_sum."""
        return {
            **self.metrics,
            **self.transfer.stats(),
            "kv_blocks_held_for_pickup": sum(len(lease.blocks) for lease in self.leases.values()),
            "kv_blocks_quarantined": sum(len(b) for b in self.quarantined.values()),
            "kv_transfer_time_buckets": list(self.transfer_time),
            "kv_transfer_time_sum": self.transfer_time_sum,
        }


METRICS = {  # LLMEngine.get_metrics' keys of a prefill or decode instance, and what they count
    "kv_transfers_started": "KV pulls started (decode instance).",
    "kv_transfers_done": "KV pulls completed (decode instance).",
    "kv_transfers_failed": "KV pulls failed; their requests prefilled locally (decode instance).",
    "kv_transfers_timed_out": "KV pulls past kv_pull_timeout_s or their lease; prefilled locally (decode instance).",
    "kv_transfers_incompatible": "Requests whose prefill instance's KV is not this instance's; prefilled locally "
    "(decode instance).",
    "kv_pulls_skipped": "Requests whose lease ended too soon to pull; prefilled locally (decode instance).",
    "kv_transfer_blocks": "KV blocks pulled (decode instance).",
    "kv_transfer_bytes": "KV bytes pulled (decode instance).",
    "kv_leases_expired": "Prompts whose KV no decode instance pulled in time (prefill instance).",
    "kv_late_pulls": "Pulls reported for leases that had ended (prefill instance).",
    "kv_transfers_cuda_ipc": "KV pulls copied through CUDA IPC, not NIXL (decode instance).",
}
GAUGES = {
    "kv_blocks_held_for_pickup": "KV blocks held for decode instances to pull (prefill instance).",
    "kv_blocks_quarantined": "KV blocks held until a pull given up on ends (decode instance).",
}
TRANSFER_TIME_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def kv_compat(
    model_fingerprint: str, dtype, model_config: ModelConfig, block_size: int, quantization: str | None, kv_dtype
) -> dict:
    """What a pool's KV is: two instances may exchange blocks only if theirs are equal (the same
    checkpoint quantized or not computes different KV; an FP8 pool's blocks are not a bf16 one's)."""
    from picovllm import __version__

    return {
        "model": model_fingerprint,
        "quantization": quantization,
        "dtype": str(dtype).removeprefix("torch."),
        "kv_cache_dtype": str(kv_dtype).removeprefix("torch."),
        "kv_layout": "layers,2,blocks,kv_heads,block_size,head_dim",
        "num_layers": model_config.num_hidden_layers,
        "num_kv_heads": model_config.num_key_value_heads,
        "head_dim": model_config.head_dim,
        "block_size": block_size,
        "version": __version__,
    }


def _compat_problem(remote, local: dict) -> str | None:
    if remote == local:
        return None
    if not isinstance(remote, dict):
        return "no description of its KV"
    return "; ".join(f"{k} {remote.get(k)!r} there, {v!r} here" for k, v in local.items() if remote.get(k) != v)
