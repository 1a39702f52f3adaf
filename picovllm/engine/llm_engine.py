"""LLMEngine: requests in, one scheduled forward per step(), RequestOutputs out.

step = launcher.next_step()      # scheduler.schedule() -> the batch as messages -> executor ->
                                 # every rank's forward, rank 0 samples (step_launcher.py)
step.out.wait()                  # rank 0's samples on the host
ends = launcher.take_tokens(step.reqs, tokens)  # grammars take them; the next bitmask fills meanwhile
core = core_outputs.process(step.reqs, tokens, sampled, ends)  # append, stop (EOS, length...), free
outputs, stopped = output_processor.process(core)  # text, stop strings, RequestOutputs

The last line is the reader's: a server's engine process stops at `core` (step_core) and its
HTTP process reads those (entrypoints/openai/async_engine.py).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import fields

from picovllm import envs
from picovllm.config import (
    EngineConfig,
    kv_cache_torch_dtype,
    resolve_device,
    resolve_dtype,
    resolve_limits,
    resolve_max_model_len,
)
from picovllm.engine.block_manager import BlockManager
from picovllm.engine.core_output_processor import CoreOutputProcessor
from picovllm.engine.input_processor import PromptType, eos_token_ids, load_tokenizer, process_prompt, tokenizer_source
from picovllm.engine.kv_handoff import KVHandoff, kv_compat
from picovllm.engine.output_processor import OutputProcessor
from picovllm.engine.request import Request
from picovllm.engine.scheduler import Scheduler
from picovllm.engine.stats import engine_stats
from picovllm.engine.step_launcher import StepLauncher
from picovllm.engine.structured_output import StructuredOutputManager, check_structured_outputs
from picovllm.executor.executor import Executor, WorkerError
from picovllm.kv_transfer_params import KVTransferParams
from picovllm.messages import EngineCoreOutput
from picovllm.model_source import resolve_model, sampling_defaults
from picovllm.outputs import RequestOutput
from picovllm.sampling_params import SamplingParams

logger = logging.getLogger("picovllm")

_MAX_SEED = 2**63 - 1


class LLMEngine:
    def __init__(self, config: EngineConfig):
        config.validate()
        start = time.perf_counter()
        self.config = config
        self.device = resolve_device(config.device)
        self.model_config, path = resolve_model(config.model)
        self.dtype = resolve_dtype(config.dtype, self.model_config.torch_dtype)
        self.tokenizer_source = tokenizer_source(config, path)  # (a server's HTTP process loads it too)
        self.tokenizer = load_tokenizer(self.tokenizer_source) if self.tokenizer_source else None
        self.eos_token_ids = eos_token_ids(self.model_config, self.tokenizer)
        self.sampling_defaults = sampling_defaults(config.generation_config, path)  # (by SamplingParams field)

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
        mixed_tokens = min(config.mixed_graph_tokens, self.max_num_batched_tokens)
        self.graph_capture_s = self.executor.capture_graphs(config.max_num_seqs, self.max_model_len, mixed_tokens)
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            self.max_num_batched_tokens,
            config.enable_prefix_caching,
            config.enable_chunked_prefill,
            config.preemption_mode,
        )
        # what this instance's KV is (disaggregated serving's peers must agree)
        self.kv_compat = kv_compat(
            self.executor.weights_fingerprint,
            self.dtype,
            self.model_config,
            config.block_size,
            config.quantization or self.model_config.quantization,
            kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype),
        )
        self.kv_handoff = None  # (a prefill or decode instance's: engine/kv_handoff.py)
        if config.kv_role != "both":
            self.kv_handoff = KVHandoff(
                config, self.executor.kv_transfer, self.scheduler, self.kv_block_bytes, self.kv_compat
            )
        self.core_outputs = CoreOutputProcessor(self.eos_token_ids, self.scheduler, self.kv_handoff)
        self.output_processor = OutputProcessor(self.tokenizer)  # (step's: a server reads step_core's outputs)
        self.structured = StructuredOutputManager(self.tokenizer, self.model_config, self.eos_token_ids, self.device)
        filler = self.structured.filler
        self.launcher = StepLauncher(self.scheduler, self.kv_handoff, self.executor, config.async_scheduling, filler)
        self.debug_invariants = envs.check_invariants()
        self.host_time_s, self.num_steps = 0.0, 0
        self._arrivals, self._auto_ids = itertools.count(), itertools.count()
        self.failed: list[tuple[str, str]] = []  # (request id, why): see step
        logger.info(
            "engine ready in %.1f s: max_model_len %d, up to %d sequences and %d tokens a step",
            time.perf_counter() - start, self.max_model_len, config.max_num_seqs, self.max_num_batched_tokens,
        )  # fmt: skip

    @classmethod
    def from_engine_args(cls, **kwargs) -> LLMEngine:
        known = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(EngineConfig(**kwargs))

    # ---- requests in ------------------------------------------------------------------------

    def process_prompt(self, prompt: PromptType, params: SamplingParams) -> tuple[str | None, list[int]]:
        """Validate a prompt against this engine's model and limits (see process_prompt), and its
        structured outputs' schema, regex or grammar."""
        text, ids = process_prompt(prompt, params, self.tokenizer, self.model_config.vocab_size, self.max_model_len)
        if params.structured_outputs is not None:
            check_structured_outputs(params.structured_outputs, self.tokenizer)
        return text, ids

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
        kv_transfer_params: KVTransferParams | None = None,
    ) -> None:
        """Queue a request whose prompt went through process_prompt (LLM.generate validates a
        whole batch first, then queues it, so that bad input queues nothing), for step() to
        report. kv_transfer_params: disaggregated prefill (engine/kv_handoff.py); ValueError if
        this instance's role does not take them."""
        self.add_core_request(request_id, text, ids, params, kv_transfer_params)
        self.output_processor.add(request_id, text, ids, params)

    def add_core_request(
        self,
        request_id: str,
        text: str | None,
        ids: list[int],
        params: SamplingParams,
        kv_transfer_params: KVTransferParams | None = None,
    ) -> None:
        """add_validated_request's engine half: for step_core, whose outputs another reader reads."""
        if kv_transfer_params is not None:
            kv_transfer_params.check(self.config.kv_role, self.config.block_size, len(ids), params)
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
            children.append(req)
        if kv_transfer_params is not None and kv_transfer_params.pulls:
            self.kv_handoff.expect(children[0])
        self.core_outputs.add(request_id, children)
        if params.structured_outputs is not None:  # (they wait for their grammar: take_ready)
            self.structured.add(params.structured_outputs, children)
        else:
            for req in children:
                self.scheduler.add(req)

    def abort_request(self, request_id: str | list[str]) -> None:
        """Stop requests (unknown or finished ids are ignored) and free their blocks; on a prefill
        instance a finished request's held KV too (its decode instance will not pull it)."""
        ids = [request_id] if isinstance(request_id, str) else request_id
        for rid in ids:
            self.output_processor.abort(rid)
            group = self.groups.get(rid)
            for req in group or []:
                if self.kv_handoff is not None:
                    self.kv_handoff.abort(req)
            self.core_outputs.finish(rid, "abort")
            if group is None and self.kv_handoff is not None:
                self.kv_handoff.end_lease(rid)

    def finish_completions(self, completions: list[tuple[str, int]]) -> None:
        """Stop computing completions whose reader found a stop string, (request id, index)."""
        self.core_outputs.finish_completions(completions)
        self._settle()

    def _settle(self) -> None:
        """With nothing left to run, nothing is left to read from a step launched ahead, and the
        model runner drops what it kept of the finished requests (no next step to tell it)."""
        if not self.groups:
            self.launcher.reset()
            self.executor.free_requests(self.scheduler.take_finished_ids())

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self.groups)

    # ---- one step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one forward; return the outputs of the requests that changed (for streaming): step_core,
        read by this engine's OutputProcessor, the completions a stop string ended finished (and a
        request whose output could not be read failed, as a step that raises fails its requests)."""
        outputs, stopped = self.output_processor.process(self.step_core())
        for request_id, why in self.output_processor.take_failed():  # (take_failed reports it)
            self.core_outputs.finish(request_id, "abort")
            self.failed.append((request_id, why))
        if stopped:
            self.finish_completions(stopped)
        return outputs

    def step_core(self) -> list[EngineCoreOutput]:
        """Run one forward; return what changed in the requests (their new tokens, EngineCoreOutputs).

        A step that raises (other than a tensor-parallel worker gone: that is the engine's end)
        fails the requests that were running, which take_failed() then reports, and the engine
        goes on with the others (see _fail_running).

        With async_scheduling, a step launches the next one before reading its own tokens
        (engine/step_launcher.py).

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
        self.launcher.reset()
        for req in list(self.scheduler.running):
            self._fail(req.parent_id, message)
        self.executor.free_requests(self.scheduler.take_finished_ids())
        self.scheduler.cache.reset()

    def _fail(self, request_id: str, message: str) -> None:
        """Finish a request's completions as failed (take_failed reports it); once per request."""
        self.output_processor.abort(request_id)
        if self.core_outputs.finish(request_id, "abort"):
            self.failed.append((request_id, message))

    def take_failed(self) -> list[tuple[str, str]]:
        """(request id, why) of the requests failed since the last call (a step that raised)."""
        failed, self.failed = self.failed, []
        return failed

    def _step(self) -> list[EngineCoreOutput]:
        start = time.perf_counter()
        if self.kv_handoff is not None:
            self.kv_handoff.tick()
        if self.structured.compiling:
            self._take_grammars()
        step = self.launcher.next_step()
        if step is None:
            self.structured.wait()  # (when only grammars being compiled are left)
            return []
        launched = time.perf_counter()
        if step.out is not None:
            step.out.wait()  # the step's one device-to-host transfer
        if step.out is not None or self.device.type != "cuda":  # (its work, and all before it, has ended)
            self.block_manager.steps_done = step.number
        sampled = step.out.sampled if step.out is not None else None
        tokens = sampled.sampled.tolist() if step.reqs else []
        synced = time.perf_counter()
        ends = self.launcher.take_tokens(step.reqs, tokens)
        if step.prompt_rows:
            self.core_outputs.add_prompt_logprobs(step.prompt_rows, sampled)
        outputs = self.core_outputs.process(step.reqs, tokens, sampled, ends)
        self._settle()
        if self.debug_invariants:
            self.check_invariants()
        self.host_time_s += (launched - start) + (time.perf_counter() - synced)
        self.num_steps += 1
        return outputs

    def _take_grammars(self) -> None:
        """Requests whose grammar has compiled go to the scheduler (engine/structured_output.py)."""
        ready, failed = self.structured.take_ready()
        for req in ready:
            self.scheduler.add(req)
        for request_id, why in failed:
            self._fail(request_id, why)

    @property
    def groups(self) -> dict[str, list[Request]]:
        """The requests in flight, by user request: its completions (CoreOutputProcessor.groups)."""
        return self.core_outputs.groups

    @property
    def kv_busy(self) -> bool:
        """Transfers to watch while no request runs (a prefill instance's leases): poll with step()."""
        return self.kv_handoff is not None and self.kv_handoff.busy

    # ---- introspection ----------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Block references (in both tiers), tree locks, block conservation; a request in a step
        launched ahead has computed all its tokens (the one being sampled is not appended yet);
        the host tier's copies equal their GPU blocks."""
        inflight = self.launcher.inflight
        ahead = inflight.batch.requests if inflight is not None else []
        self.scheduler.check_invariants(ahead, self.kv_handoff.held() if self.kv_handoff else ())
        tree = self.scheduler.cache.tree
        if self.block_manager.host is not None and tree is not None and not self.block_manager.copies:
            # a node in both tiers holds the same KV in both (rank 0's pools; no copy pending):
            # the same bytes where one was copied from the other, else within rounding
            both = [n for n in tree.nodes() if n.blocks is not None and n.host is not None]
            copied = [p for n in both if n.copied for p in zip(n.blocks, n.host)]
            self.executor.check_host_copies(copied, [p for n in both if not n.copied for p in zip(n.blocks, n.host)])

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block no running request uses; True if the cache is now empty."""
        self.scheduler.cache.reset()
        return self.scheduler.cache.num_cached_blocks == 0

    def shutdown(self) -> None:
        """Stop every rank (also done when the engine is collected, and at exit, with several):
        each frees its graphs and closes its KV transfer (Worker.shutdown)."""
        self.structured.shutdown()
        self.executor.shutdown()

    def get_metrics(self) -> dict[str, int]:
        """The engine's counters and gauges (engine/stats.py), with its steps and their host time
        (host_time_us: see step)."""
        stats = engine_stats(self.scheduler, self.kv_handoff, self.kv_block_bytes)
        return {**stats, "num_steps": self.num_steps, "host_time_us": round(1e6 * self.host_time_s)}
