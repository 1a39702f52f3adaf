"""Runs a scheduled batch: its inputs (engine/inputs.py), the model (from a CUDA graph when one
serves the step), the sampler. The sampled tokens come back to the host in one transfer per step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from picovllm.config import EngineConfig, ModelConfig
from picovllm.distributed.communicator import tp_broadcast
from picovllm.distributed.parallel_state import get_tp_size
from picovllm.engine.block_manager import BlockManager
from picovllm.engine.cuda_graph import DecodeGraphs, MixedGraphs
from picovllm.engine.inputs import ModelInputs, StepInputs, Uploader, build_decode, build_eager, build_mixed_graph
from picovllm.engine.request import Request
from picovllm.engine.sampler import Sampler, SamplerOutput, SamplingTensors
from picovllm.engine.scheduler import ScheduledBatch
from picovllm.kernels.prefill_attention import num_work_items
from picovllm.model.loader.model_loader import load_model

logger = logging.getLogger("picovllm")

DEFAULT_CPU_KV_CACHE_MEMORY = 2 << 30


class ModelRunner:
    def __init__(
        self,
        engine_cfg: EngineConfig,
        model_cfg: ModelConfig,
        path: str | None,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        eos_ids: set[int],
    ):
        self.model_cfg = model_cfg
        self.device = device
        self.dtype = dtype
        self.block_size = engine_cfg.block_size
        self.eos_ids = eos_ids
        self.model = load_model(model_cfg, path, dtype, device, max_model_len, seed=engine_cfg.seed)
        self.sampler = Sampler()
        self.upload = Uploader(device)
        self._sampling_cache: tuple[list[Request], SamplingTensors] | None = None
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None
        self.tp_size = get_tp_size()
        self.publish_step: Callable[[StepInputs, int], None] | None = None

    def kv_block_bytes(self) -> int:
        attn = self.model.attention_layers()[0]
        return BlockManager.bytes_per_block(
            self.block_size, len(self.model.attention_layers()), attn.num_kv_heads, attn.head_dim, self.dtype
        )

    def num_kv_blocks(self, engine_cfg: EngineConfig) -> int:
        """Blocks that fit the memory budget left after loading the model."""
        if engine_cfg.num_gpu_blocks_override is not None:
            return engine_cfg.num_gpu_blocks_override
        if engine_cfg.kv_cache_memory is not None:  # on any device (vLLM's kv_cache_memory_bytes)
            budget = engine_cfg.kv_cache_memory
        elif self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            # headroom for activations: a tenth of what is left, at least 1 GiB
            budget = total * engine_cfg.gpu_memory_utilization - (total - free)
            budget -= max(1 << 30, 0.1 * budget)
        else:
            budget = DEFAULT_CPU_KV_CACHE_MEMORY
        blocks = int(budget // self.kv_block_bytes())
        if blocks < 1:
            raise ValueError(
                "no memory left for the KV cache: lower the model size or raise "
                "gpu_memory_utilization / kv_cache_memory"
            )
        return blocks

    def allocate_kv_cache(self, num_blocks: int) -> BlockManager:
        """The KV pool of num_blocks blocks, bound to the model's attention layers."""
        layers = self.model.attention_layers()
        block_manager = BlockManager(
            num_blocks,
            self.block_size,
            len(layers),
            layers[0].num_kv_heads,
            layers[0].head_dim,
            self.dtype,
            self.device,
        )
        for attn, (k, v) in zip(layers, block_manager.layer_caches(), strict=True):
            attn.k_cache, attn.v_cache = k, v
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB) on %s",
            num_blocks,
            self.block_size,
            num_blocks * self.kv_block_bytes() / (1 << 30),
            self.device,
        )
        return block_manager

    def capture_graphs(self, max_num_seqs: int, max_model_len: int, mixed_graph_tokens: int = 0) -> float:
        """Capture CUDA graphs (after the KV cache is bound: graphs keep its addresses): decode,
        and mixed steps of up to mixed_graph_tokens tokens when it is > 0. Returns seconds."""
        self.graphs = DecodeGraphs(self.model, max_num_seqs, max_model_len, self.block_size, self.device)
        seconds = self.graphs.capture()
        if mixed_graph_tokens > 0:
            self.mixed_graphs = MixedGraphs(
                self.model, mixed_graph_tokens, max_num_seqs, max_model_len, self.block_size, self.device
            )
            seconds += self.mixed_graphs.capture()
        return seconds

    @staticmethod
    def step_inputs(batch: ScheduledBatch, num_pending: int = 0) -> StepInputs:
        """A scheduled batch as plain data (what every rank's forward needs). The first num_pending
        requests decode a token sampled by the step before and not yet read by the host (a step
        launched ahead): their input token is a placeholder, filled on the device (prepare)."""
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
        )

    def prepare(
        self, step: StepInputs, pending: torch.Tensor | None = None, num_pending: int = 0
    ) -> tuple[ModelInputs, DecodeGraphs | MixedGraphs | None]:
        """The step's inputs, and the graphs that replay it (None: it runs eagerly). pending: the
        num_pending tokens the step's first rows decode, on the device (on rank 0, which sampled
        them; the other ranks receive them from it)."""
        inputs, graphs = self._build(step)
        if num_pending:  # (the pending rows decode: their tokens come first)
            if self.tp_size > 1:
                if pending is None:
                    pending = torch.empty(num_pending, dtype=torch.long, device=self.device)
                tp_broadcast(pending)
            inputs.input_ids[:num_pending].copy_(pending)
        return inputs, graphs

    def _build(self, step: StepInputs) -> tuple[ModelInputs, DecodeGraphs | MixedGraphs | None]:
        if step.is_decode:
            size = self.graphs.padded_size(step.num_seqs) if self.graphs is not None else None
            return build_decode(step, self.block_size, self.upload, size), self.graphs if size else None
        if self.mixed_graphs is not None:
            pad = self.mixed_graphs.padding(step.num_tokens, step.num_seqs, num_work_items(step.query_lens))
            if pad is not None:
                return build_mixed_graph(step, self.block_size, self.upload, pad), self.mixed_graphs
        return build_eager(step, self.block_size, self.upload), None

    @torch.inference_mode()
    def logits(self, batch: ScheduledBatch, pending: torch.Tensor | None = None) -> torch.Tensor:
        """The raw logits of the positions that are sampled, one row per sampling request."""
        num_pending = 0 if pending is None else len(pending)
        return self.step_logits(self.step_inputs(batch, num_pending), pending, num_pending)

    @torch.inference_mode()
    def step_logits(
        self, step: StepInputs, pending: torch.Tensor | None = None, num_pending: int = 0
    ) -> torch.Tensor | None:
        """The forward of one step on this rank: the logits of the sampled positions on rank 0,
        None on the others (see prepare for pending)."""
        inputs, graphs = self.prepare(step, pending, num_pending)
        if graphs is not None:
            hidden = graphs.run(inputs)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        if inputs.logits_indices is not None:
            hidden = hidden[inputs.logits_indices]
        elif graphs is not None:  # a decode graph's padding rows are not sampled
            hidden = hidden[: step.num_seqs]
        return self.model.compute_logits(hidden)

    def _sampling_tensors(self, reqs: list[Request]) -> SamplingTensors:
        """The batch's sampling tensors, reused from the previous step when the same requests
        sample again and nothing in them changes per step (no penalties, no min_tokens ban)."""
        cached = self._sampling_cache  # (the very Request objects, in order; their tensors)
        if cached is not None and len(cached[0]) == len(reqs) and all(a is b for a, b in zip(cached[0], reqs)):
            return cached[1]
        tensors = SamplingTensors.from_requests(reqs, self.model_cfg.vocab_size, self.eos_ids, self.device)
        static = tensors.banned is None and tensors.prompt_ids is None
        self._sampling_cache = (list(reqs), tensors) if static else None
        return tensors

    @torch.inference_mode()
    def run(
        self, batch: ScheduledBatch, pending: torch.Tensor | None = None
    ) -> tuple[list[Request], SamplerOutput | None]:
        """One forward; the requests that sample and their samples (None when none samples).
        pending: see prepare()."""
        num_pending = 0 if pending is None else len(pending)
        step = self.step_inputs(batch, num_pending)
        # the requests whose last token this step computes (step.sample): each samples one token
        reqs = [r for r, sample in zip(batch.requests, step.sample.tolist()) if sample]
        if self.publish_step is not None:  # the other ranks' copy of the step (engine/executor.py)
            self.publish_step(step, num_pending)
        logits = self.step_logits(step, pending, num_pending)
        # The sampling parameters are built while the forward runs (a new request's: about 0.2 ms
        # of host time that a lone request's first token would otherwise wait for); they reach
        # the device through pinned memory, which never waits for the queued forward.
        tensors = self._sampling_tensors(reqs) if reqs else None
        return reqs, (self.sampler(logits, tensors) if reqs else None)
