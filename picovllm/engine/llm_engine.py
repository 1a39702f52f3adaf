"""LLMEngine: requests in, one scheduled forward per step(), RequestOutputs out.

batch = scheduler.schedule()                        # who runs, and how many tokens each
step, sampling = step_inputs(batch), sampling_batch(reqs)  # the batch as plain data
out = executor.execute_step(ExecuteStep(step), sampling)  # every rank's forward; rank 0 samples
outputs = self._process(reqs, tokens, out.sampled)  # append tokens, detokenize, finish, free
"""

from __future__ import annotations

import itertools
import logging
import operator
import time
from dataclasses import dataclass, fields
from typing import NamedTuple

import numpy as np

from picovllm import envs
from picovllm.config import EngineConfig, resolve_device, resolve_dtype, resolve_limits, resolve_max_model_len
from picovllm.engine.block_manager import BlockManager
from picovllm.engine.detokenizer import Detokenizer
from picovllm.engine.input_processor import PromptType, eos_token_ids, load_tokenizer, process_prompt, tokenizer_source
from picovllm.engine.kv_handoff import KVHandoff, check_kv_transfer_params, kv_compat
from picovllm.engine.request import Request
from picovllm.engine.scheduler import ScheduledBatch, Scheduler
from picovllm.executor.executor import Executor, WorkerError
from picovllm.kernels import triton_utils
from picovllm.messages import ExecuteStep, ModelRunnerOutput, SamplerOutput, SamplingBatch, StepInputs
from picovllm.model.loader.model_loader import resolve_model
from picovllm.outputs import CompletionOutput, Logprob, RequestOutput
from picovllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("picovllm")

_MAX_SEED = 2**63 - 1


class _Step(NamedTuple):
    """A launched forward: its batch, the requests that sample, their samples on the way to the
    host (None: no row samples), and its number (BlockManager.step_launched)."""

    batch: ScheduledBatch
    reqs: list[Request]
    out: ModelRunnerOutput | None
    number: int


OFFLOAD_METRICS = {  # LLMEngine.get_metrics' keys with a host tier (kv_offload_memory), and what they count
    "prefix_cache_host_hit_tokens": "Prompt tokens served by prefix-cache blocks promoted from the host tier.",
    "kv_offload_blocks_total": "Blocks of the host tier.",
    "kv_offload_blocks_free": "Free blocks of the host tier.",
    "kv_offload_demoted_blocks": "GPU blocks the prefix cache evicted to the host tier (no copy if already there).",
    "kv_offload_promoted_blocks": "Host-tier blocks the prefix cache brought back to the GPU on a hit.",
    "kv_offload_evicted_blocks": "Blocks the host tier evicted.",
    "kv_offload_bytes_to_host": "Bytes copied from the GPU to the host tier (per rank; demotions and swaps).",
    "kv_offload_bytes_to_gpu": "Bytes copied from the host tier to the GPU (per rank; promotions and swaps).",
    "num_swapped_out": "Preemptions that swapped the request's KV to the host tier (preemption_mode 'swap').",
}


def step_inputs(batch: ScheduledBatch, num_pending: int = 0, kv_copies: list | None = None) -> StepInputs:
    """A scheduled batch as plain data (what every rank's forward needs), with the copies between
    the KV pools to run first. The first num_pending requests decode a token sampled by the step
    before and not yet read by the host (a step launched ahead): their input token is a
    placeholder, filled on the device (ModelRunner.prepare)."""
    token_ids, context, sample = [], [], []
    for i, (r, n) in enumerate(zip(batch.requests, batch.num_new_tokens, strict=True)):
        end = r.num_computed_tokens + n
        token_ids.append([0] if i < num_pending else r.token_ids[end - n : end])
        context.append(end)
        sample.append(i < num_pending or end == len(r.token_ids))
    return StepInputs(
        token_ids,
        np.array(context, dtype=np.int64),
        np.array(batch.num_new_tokens, dtype=np.int64),
        [r.block_table for r in batch.requests],
        np.array(sample),
        kv_copies or [],
    )


def _reads_output(req: Request) -> bool:
    """Whether req's next sample depends on its output so far: penalties, or a min_tokens ban."""
    return req.params.has_penalties or req.num_output_tokens < req.params.min_tokens


def sampling_batch(reqs: list[Request], finished_ids: list[str]) -> SamplingBatch:
    """The sampling rows of the requests that sample, as plain data (a pending row's output so
    far lacks its token in flight: launching ahead is off with penalties or a min_tokens ban)."""
    penalties = any(r.params.has_penalties for r in reqs)
    return SamplingBatch(
        [r.request_id for r in reqs],
        [r.params for r in reqs],
        [r.seed for r in reqs],
        [r.num_output_tokens for r in reqs],
        [r.prompt_token_ids for r in reqs] if penalties else None,
        [r.output_token_ids for r in reqs] if penalties else None,
        finished_ids,
    )


@dataclass
class _Group:
    """The n completions of one user request."""

    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    arrival_time: float  # time.time(), as vLLM's RequestMetrics
    first_token_time: float | None = None
    kv_transfer_params: dict | None = None  # a prefill instance's answer: where the KV is held


class LLMEngine:
    def __init__(self, config: EngineConfig):
        config.validate()
        self.config = config
        self.device = resolve_device(config.device)
        self.model_config, path = resolve_model(config.model)
        self.dtype = resolve_dtype(config.dtype, self.model_config.torch_dtype)
        self.tokenizer_source = tokenizer_source(config, path)  # (a server's HTTP process loads it too)
        self.tokenizer = load_tokenizer(self.tokenizer_source) if self.tokenizer_source else None
        self.detokenizer = Detokenizer(self.tokenizer) if self.tokenizer is not None else None
        self.eos_token_ids = eos_token_ids(self.model_config, self.tokenizer)

        max_model_len = resolve_max_model_len(config, self.model_config)
        self.executor = Executor.get_class(config)(config, self.model_config, max_model_len, self.eos_token_ids)
        num_blocks = self.executor.num_kv_blocks()
        self.max_model_len, self.max_num_batched_tokens = resolve_limits(
            config, max_model_len, num_blocks * config.block_size
        )
        self.kv_block_bytes = self.executor.kv_block_bytes()  # (rank 0's: K and V of every layer)
        num_host_blocks = config.kv_offload_memory // self.kv_block_bytes
        if config.kv_offload_memory and not num_host_blocks:
            raise ValueError(f"kv_offload_memory {config.kv_offload_memory} holds no KV block")
        self.executor.allocate_kv_cache(num_blocks, num_host_blocks)
        self.block_manager = BlockManager(num_blocks, config.block_size, num_host_blocks)
        self.graph_capture_s = self._capture_graphs()
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            self.max_num_batched_tokens,
            config.enable_prefix_caching,
            config.enable_chunked_prefill,
            config.preemption_mode,
        )
        self.groups: dict[str, _Group] = {}
        mc = self.model_config
        self.kv_compat = kv_compat(  # (what this instance's KV is: disaggregated serving's peers must agree)
            self.executor.weights_fingerprint,
            self.dtype,
            mc.num_hidden_layers,
            mc.num_key_value_heads,
            mc.head_dim,
            config.block_size,
        )
        self.kv_handoff = None  # (a prefill or decode instance's: engine/kv_handoff.py)
        if config.kv_role != "both":
            self.kv_handoff = KVHandoff(
                config, self.executor.kv_transfer, self.scheduler, self.kv_block_bytes, self.kv_compat
            )
        self.debug_invariants = envs.check_invariants()
        self.host_time_s, self.num_steps = 0.0, 0
        self.async_scheduling = config.async_scheduling
        self._last_sampling: tuple[list[Request], SamplingBatch] | None = None  # (see _sampling_batch)
        self._inflight: _Step | None = None  # a step launched ahead, its tokens not read yet
        self.num_launched_ahead = self.num_dropped_ahead = 0  # steps launched ahead; tokens they computed in vain
        self._arrivals = itertools.count()
        self.failed: list[tuple[str, str]] = []  # (request id, why): see step
        self._auto_ids = itertools.count()

    def _capture_graphs(self) -> float | None:
        """CUDA graphs on a GPU unless enforce_eager (seconds of capture; None: none)."""
        if self.device.type != "cuda" or self.config.enforce_eager:
            return None
        if not self.executor.graphs_capturable:
            logger.warning("tensor-parallel ranks sharing a GPU talk over gloo, which graphs cannot capture: eager")
            return None
        if not (triton_utils.ENABLED and triton_utils.HAS_TRITON):
            # the PyTorch reference path syncs (nonzero, data-dependent shapes): not capturable
            logger.warning("CUDA graphs need the Triton kernels (disabled or missing): running eager")
            return None
        mixed_tokens = min(self.config.mixed_graph_tokens, self.max_num_batched_tokens)
        return self.executor.capture_graphs(self.config.max_num_seqs, self.max_model_len, mixed_tokens)

    @classmethod
    def from_engine_args(cls, **kwargs) -> LLMEngine:
        known = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(EngineConfig(**kwargs))

    # ---- requests in ------------------------------------------------------------------------

    def process_prompt(self, prompt: PromptType, params: SamplingParams) -> tuple[str | None, list[int]]:
        """Validate a prompt against this engine's model and limits (see process_prompt)."""
        return process_prompt(prompt, params, self.tokenizer, self.model_config.vocab_size, self.max_model_len)

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None) -> str:
        """Queue a request; returns its id. Raises ValueError (and queues nothing) on bad input."""
        params = SamplingParams() if params is None else params
        request_id = str(next(self._auto_ids)) if request_id is None else str(request_id)
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.process_prompt(prompt, params)
        self.add_validated_request(request_id, text, ids, params)
        return request_id

    def add_validated_request(
        self,
        request_id: str,
        text: str | None,
        ids: list[int],
        params: SamplingParams,
        kv_transfer_params: dict | None = None,
    ) -> None:
        """Queue a request whose prompt went through process_prompt (LLM.generate validates a
        whole batch first, then queues it, so that bad input queues nothing). kv_transfer_params:
        disaggregated prefill (engine/kv_handoff.py); ValueError if this instance's role does not
        take them."""
        if kv_transfer_params is not None:
            check_kv_transfer_params(kv_transfer_params, self.config.kv_role, self.config.block_size, ids, params.n)
        children = []
        for i in range(params.n):
            seed = None if params.seed is None else (params.seed + i * 1_000_003) % _MAX_SEED
            child_id = request_id if params.n == 1 else f"{request_id}-{i}"
            req = Request(
                child_id,
                request_id,
                i,
                text,
                ids,
                params,
                next(self._arrivals),
                seed,
                self.max_model_len,
                kv_transfer_params if i == 0 else None,
            )
            if kv_transfer_params is not None and i > 0:
                req.after = children[0]  # (it pulls; the others take its blocks from the prefix cache)
            if self.detokenizer is not None:
                self.detokenizer.start(req)
            children.append(req)
        if kv_transfer_params is not None and "remote_block_ids" in kv_transfer_params:
            self.kv_handoff.expect(children[0])
        self.groups[request_id] = _Group(text, ids, children, time.time())
        for req in children:
            self.scheduler.add(req)

    def abort_request(self, request_id: str | list[str]) -> None:
        """Stop requests (unknown or finished ids are ignored) and free their blocks; on a prefill
        instance a finished request's held KV too (its decode instance will not pull it)."""
        ids = [request_id] if isinstance(request_id, str) else request_id
        for rid in ids:
            group = self.groups.pop(rid, None)
            for req in group.children if group else []:
                if self.kv_handoff is not None:
                    self.kv_handoff.abort(req)
                self.scheduler.finish(req, "abort")
            if group is None and self.kv_handoff is not None:
                self.kv_handoff.end_lease(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self.groups)

    # ---- one step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one forward; return the outputs of the requests that changed (for streaming).

        A step that raises (other than a tensor-parallel worker gone: that is the engine's end)
        fails the requests that were running, which take_failed() then reports, and the engine
        goes on with the others (see _fail_running).

        With async_scheduling, a step launches the next one before reading its own tokens (see
        _launch_ahead): the next step's inputs take those tokens on the device, so the GPU has
        its next step queued while the host processes this one. A request that stops meanwhile
        has its extra token dropped.

        host_time_s accumulates the time the CPU spends in steps other than waiting for the
        device (on a GPU the forward is launched asynchronously and waited for at the one
        device-to-host copy of the sampled tokens)."""
        try:
            return self._step()
        except WorkerError:
            raise
        except Exception as e:
            logger.exception("a step failed: the requests that were running fail, the others go on")
            self._fail_running(f"the step failed: {type(e).__name__}: {e}")
            return []

    def _fail_running(self, message: str) -> None:
        """Finish every running request (their groups) as failed, with `message`, and drop the
        prefix cache: the failed step's blocks were in the tree before their KV was computed."""
        self._inflight, self._last_sampling = None, None
        for req in list(self.scheduler.running):
            group = self.groups.pop(req.parent_id, None)
            if group is None:  # (a sibling running too: its group is failed already)
                continue
            for child in group.children:
                self.scheduler.finish(child, "abort")
            self.failed.append((req.parent_id, message))
        self.executor.free_requests(self.scheduler.take_finished_ids())
        self.scheduler.cache.reset()

    def take_failed(self) -> list[tuple[str, str]]:
        """(request id, why) of the requests failed since the last call (a step that raised)."""
        failed, self.failed = self.failed, []
        return failed

    def _step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        if self.kv_handoff is not None:
            self.kv_handoff.tick()
        step = self._inflight
        if step is None:
            batch = self._schedule()
            if batch is None:
                return []
            step = self._launch(batch)
        self._inflight = self._launch_ahead(step) if self.async_scheduling else None
        launched = time.perf_counter()
        if step.out is not None:
            step.out.wait()  # the step's one device-to-host transfer
        if step.out is not None or self.device.type != "cuda":  # (its work, and all before it, has ended)
            self.block_manager.steps_done = step.number
        sampled = step.out.sampled if step.out is not None else None
        tokens = sampled.sampled.tolist() if step.reqs else []
        synced = time.perf_counter()
        outputs = self._process(step.reqs, tokens, sampled)
        if not self.groups:
            self._inflight = None  # nothing left to read from a step launched ahead
            self.executor.free_requests(self.scheduler.take_finished_ids())  # (no next step to say it)
            self._last_sampling = None
        if self.debug_invariants:
            self.check_invariants()
        self.host_time_s += (launched - start) + (time.perf_counter() - synced)
        self.num_steps += 1
        return outputs

    def _schedule(self, decodes: list[Request] | None = None) -> ScheduledBatch | None:
        """The scheduler's next batch (schedule_ahead with `decodes`); the pulls of the requests it
        admitted to wait for their KV start here."""
        handoff, sched = self.kv_handoff, self.scheduler
        if handoff is not None:
            sched.paused = handoff.admission_paused
        batch = sched.schedule() if decodes is None else sched.schedule_ahead(decodes)
        if handoff is not None:
            for req in sched.take_new_pulls():
                handoff.start(req)
        return batch

    @property
    def kv_busy(self) -> bool:
        """Transfers to watch while no request runs (a prefill instance's leases): poll with step()."""
        return self.kv_handoff is not None and self.kv_handoff.busy

    def _launch(self, batch: ScheduledBatch, num_pending: int = 0, pending_rows: list[int] | None = None) -> _Step:
        """Launch the batch's forward; its first num_pending rows decode the tokens the step
        before sampled (rows pending_rows of them; None: all), still on the device."""
        step = step_inputs(batch, num_pending, self.block_manager.take_copies())
        # the requests whose last token this step computes (step.sample): each samples one token
        reqs = [r for r, sample in zip(batch.requests, step.sample.tolist()) if sample]
        sampling = self._sampling_batch(reqs) if reqs else None
        out = self.executor.execute_step(ExecuteStep(step, num_pending, pending_rows), sampling)
        number = self.block_manager.step_launched()
        for req, n in zip(batch.requests, batch.num_new_tokens):
            req.num_computed_tokens += n
        return _Step(batch, reqs, out, number)

    def _sampling_batch(self, reqs: list[Request]) -> SamplingBatch:
        """The step's SamplingBatch: the previous step's when the same requests sample again, none
        has finished meanwhile and nothing in it changes per step (no penalties, min_tokens
        reached: the model runner then reuses its tensors too); else a new one."""
        finished = self.scheduler.take_finished_ids()
        last = self._last_sampling
        if not finished and last is not None and len(last[0]) == len(reqs) and all(map(operator.is_, last[0], reqs)):
            return last[1]
        batch = sampling_batch(reqs, finished)
        # (a batch is sent once with the ids of the requests finished before it)
        static = not finished and not any(map(_reads_output, reqs))
        self._last_sampling = (reqs, batch) if static else None
        return batch

    def _launch_ahead(self, step: _Step) -> _Step | None:
        """Launch the step that follows `step` before its tokens are read, when its schedule does
        not depend on them (Scheduler.schedule_ahead): the requests that sampled in `step` decode
        the tokens it sampled, the others' prompt chunks and new admissions follow; not when a
        request's sampling depends on its output so far (penalties, a min_tokens ban)."""
        sched, reqs = self.scheduler, step.reqs
        if not reqs:
            return None
        running = set(map(id, sched.running))
        if any(id(r) not in running or _reads_output(r) for r in reqs):
            return None
        # a request whose token in flight is its last (max_tokens, max_model_len) finishes
        # whatever that token is: it does not go on
        rows = [i for i, r in enumerate(reqs) if not self._at_length_limit(r, pending=1)]
        if not rows:
            return None
        batch = self._schedule([reqs[i] for i in rows])
        if batch is None:
            return None
        self.num_launched_ahead += 1
        return self._launch(batch, len(rows), rows if len(rows) < len(reqs) else None)

    @staticmethod
    def _at_length_limit(req: Request, pending: int = 0) -> bool:
        """Whether req has reached max_tokens or max_model_len, counting `pending` tokens that
        are sampled but not yet appended."""
        return len(req.token_ids) + pending >= req.max_num_tokens

    def _process(self, reqs: list[Request], tokens: list[int], out: SamplerOutput | None) -> list[RequestOutput]:
        """Append each sampling request's token; a step of prompt chunks alone samples nothing."""
        if out is None:
            return []
        logprob_rows = self._logprob_rows(out) if out.sampled_logprobs is not None else None
        changed: dict[str, None] = {}
        now = time.time()
        for i, (req, token) in enumerate(zip(reqs, tokens)):
            if req.is_finished:  # stopped or aborted after this step was launched ahead
                self.num_dropped_ahead += 1
                continue
            req.token_ids.append(token)
            if req.logprobs is not None:
                req.logprobs.append(self._logprob_dict(logprob_rows, i, token, req.params.logprobs))
                req.cumulative_logprob += req.logprobs[-1][token].logprob
            reason, stop_reason = self._check_finished(req, token)
            if reason is not None:
                req.stop_reason = stop_reason
                if req.kv_transfer_params is not None and req.kv_transfer_params.get("do_remote_decode"):
                    self.groups[req.parent_id].kv_transfer_params = self.kv_handoff.hold(req)
                self.scheduler.finish(req, reason)
            if req.num_output_tokens == 1 and (group := self.groups.get(req.parent_id)) is not None:
                group.first_token_time = group.first_token_time or now
            if req.params.output_kind is not RequestOutputKind.FINAL_ONLY or req.is_finished:
                changed[req.parent_id] = None
        outputs = []
        for rid in changed:
            group = self.groups.get(rid)
            if group is not None and (
                group.children[0].params.output_kind is not RequestOutputKind.FINAL_ONLY
                or all(r.is_finished for r in group.children)
            ):
                outputs.append(self._output(rid))
        return outputs

    def _check_finished(self, req: Request, token: int) -> tuple[str | None, int | str | None]:
        p = req.params
        past_min = req.num_output_tokens >= p.min_tokens
        if past_min and not p.ignore_eos and token in self.eos_token_ids:
            return "stop", None
        if past_min and token in p.stop_token_ids:
            return "stop", token
        detokenize = self.detokenizer is not None and p.detokenize
        if detokenize and (stop := self.detokenizer.step(req)) is not None:
            return "stop", stop
        if self._at_length_limit(req):
            if detokenize and (stop := self.detokenizer.flush(req)) is not None:
                return "stop", stop
            return "length", None
        return None, None

    @staticmethod
    def _logprob_rows(out: SamplerOutput) -> dict[str, list]:
        rows = {"chosen": out.sampled_logprobs.tolist(), "rank": out.sampled_ranks.tolist()}
        if out.top_ids is not None:
            rows["top_ids"], rows["top_logprobs"] = out.top_ids.tolist(), out.top_logprobs.tolist()
        return rows

    def _logprob_dict(self, rows: dict[str, list], i: int, token: int, k: int) -> dict[int, Logprob]:
        top = zip(rows["top_ids"][i][:k], rows["top_logprobs"][i][:k]) if "top_ids" in rows else ()
        entries = {tid: Logprob(lp, rank, self._decode_token(tid)) for rank, (tid, lp) in enumerate(top, start=1)}
        entries[token] = Logprob(rows["chosen"][i], rows["rank"][i], self._decode_token(token))
        return entries

    def _decode_token(self, token: int) -> str | None:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else None

    def _output(self, request_id: str) -> RequestOutput:
        group = self.groups[request_id]
        finished = all(r.is_finished for r in group.children)
        delta = group.children[0].params.output_kind is RequestOutputKind.DELTA
        outputs = []
        for r in group.children:
            tokens, text, logprobs = self._take_delta(r) if delta else (r.output_token_ids, r.output_text, r.logprobs)
            outputs.append(
                CompletionOutput(
                    index=r.index,
                    text=text,
                    token_ids=tokens,
                    cumulative_logprob=r.cumulative_logprob if r.logprobs is not None else None,
                    logprobs=logprobs,
                    finish_reason=r.finish_reason,
                    stop_reason=r.stop_reason,
                )
            )
        if finished:
            del self.groups[request_id]
        num_cached = group.children[0].num_prompt_cached_tokens or 0
        metrics = {"arrival_time": group.arrival_time}
        if group.first_token_time is not None:
            metrics["first_token_time"] = group.first_token_time
        if finished:
            metrics["finished_time"] = time.time()
        return RequestOutput(
            request_id,
            group.prompt,
            group.prompt_token_ids,
            outputs,
            finished,
            num_cached,
            metrics,
            group.kv_transfer_params if finished else None,
        )

    @staticmethod
    def _take_delta(r: Request) -> tuple[list[int], str, list | None]:
        """The tokens, text and logprobs r generated since its last output (RequestOutputKind.DELTA),
        marked as sent. Only final text is sent (Detokenizer.final_text_len)."""
        tokens = r.token_ids[r.num_prompt_tokens + r.num_output_sent :]
        logprobs = None if r.logprobs is None else r.logprobs[r.num_output_sent :]
        r.num_output_sent += len(tokens)
        end = max(r.text_sent, Detokenizer.final_text_len(r))
        text, r.text_sent = r.output_text[r.text_sent : end], end
        return tokens, text, logprobs

    # ---- introspection ----------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Block references (in both tiers), tree locks, block conservation; a request in a step
        launched ahead has computed all its tokens (the one being sampled is not appended yet);
        the host tier's copies equal their GPU blocks."""
        ahead = self._inflight.batch.requests if self._inflight is not None else []
        self.scheduler.check_invariants(ahead, self.kv_handoff.held() if self.kv_handoff else ())
        tree = self.scheduler.cache.tree
        if self.block_manager.host is not None and tree is not None and not self.block_manager.copies:
            # a node in both tiers holds the same KV in both (rank 0's pools; no copy pending)
            both = [(n.blocks, n.host) for n in tree.nodes() if n.blocks is not None and n.host is not None]
            self.executor.check_host_copies([p for gpu, host in both for p in zip(gpu, host)])

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block no running request uses; True if the cache is now empty."""
        self.scheduler.cache.reset()
        return self.scheduler.cache.num_cached_blocks == 0

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (also done when the engine is collected, and at exit)."""
        self.executor.shutdown()
        if self.kv_handoff is not None:
            self.kv_handoff.transfer.close()

    def get_metrics(self) -> dict[str, int]:
        bm, cache = self.block_manager, self.scheduler.cache
        return {
            "kv_blocks_total": bm.num_total_blocks,
            "kv_blocks_free": bm.num_free_blocks,
            "kv_blocks_cached": cache.num_cached_blocks,
            "prefix_cache_queried_tokens": cache.queried_tokens,
            "prefix_cache_hit_tokens": cache.hit_tokens,
            "prefix_cache_evicted_blocks": cache.evicted_blocks,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting) + len(self.scheduler.transferring),
            "num_preemptions": self.scheduler.num_preemptions,
            **(self._offload_metrics() if bm.host is not None else {}),
            **(self.kv_handoff.get_metrics() if self.kv_handoff is not None else {}),
        }

    def _offload_metrics(self) -> dict[str, int]:
        """The host tier's (kv_offload_memory): OFFLOAD_METRICS."""
        bm, cache = self.block_manager, self.scheduler.cache
        to_gpu, to_host = bm.copied_blocks
        return {
            "prefix_cache_host_hit_tokens": cache.host_hit_tokens,
            "kv_offload_blocks_total": bm.host.num_blocks,
            "kv_offload_blocks_free": bm.host.num_free,
            "kv_offload_demoted_blocks": cache.demoted_blocks,
            "kv_offload_promoted_blocks": cache.promoted_blocks,
            "kv_offload_evicted_blocks": cache.host_evicted_blocks,
            "kv_offload_bytes_to_host": to_host * self.kv_block_bytes,
            "kv_offload_bytes_to_gpu": to_gpu * self.kv_block_bytes,
            "num_swapped_out": self.scheduler.num_swapped_out,
        }
