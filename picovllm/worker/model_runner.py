"""One rank's model runner: its shard of the model, its KV pool, its CUDA graphs, and (on rank 0)
the sampler. A step arrives as plain data (StepInputs, and on rank 0 a SamplingBatch: no Request
objects), becomes device tensors (worker/inputs.py), runs through the model (from a CUDA graph
when one serves the step), and rank 0 samples the rows that sample. Seeded requests draw from
generators kept here, by request id, until the engine says they finished.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable

import numpy as np
import torch

from picovllm.config import EngineConfig, ModelConfig, kv_cache_torch_dtype
from picovllm.distributed.communicator import tp_broadcast
from picovllm.distributed.kv_transfer import KVTransfer, block_runs
from picovllm.distributed.kv_transfer.nixl import NixlKVTransfer
from picovllm.distributed.parallel_state import get_tp_size
from picovllm.messages import SamplerOutput, SamplingBatch, StepInputs
from picovllm.model.layers.attention import prefill_work_items
from picovllm.model.layers.fp8 import FP8, quantize_linear_weights
from picovllm.model.layers.linear import UPCAST_ROWS, pack_weights
from picovllm.model.loader.model_loader import load_model
from picovllm.worker.cuda_graph import DecodeGraphs, MixedGraphs
from picovllm.worker.inputs import BlockTables, ModelInputs, Uploader, build_decode, build_eager, build_mixed_graph
from picovllm.worker.sampler import Sampler, SamplingTensors, pinned_to, token_logprobs

logger = logging.getLogger("picovllm")
# the relative error within which KV computed twice for the same tokens agrees, by element size
RECOMPUTED_KV_TOL = {4: 1e-4, 2: 2e-2, 1: 0.2}

DEFAULT_CPU_KV_CACHE_MEMORY = 2 << 30
PROMPT_ROWS = 512  # prompt tokens whose log-probabilities are computed at a time (a [rows, vocab] fp32 each)


def allocate_kv_pool(
    num_layers: int, num_blocks: int, block_size: int, num_heads: int, head_dim: int, dtype, device
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A KV pool, [layers, 2 (K, V), num_blocks, kv_heads, block_size, head_dim], and each layer's
    (K, V) as the attention kernels index them, [num_blocks, block_size, kv_heads, head_dim]
    (strided views of it). A block of one layer's K (or V) is contiguous, and within it each
    head's tokens: a transfer moves a run of blocks, or a run of heads of a block, as one piece.
    Zeros, not empty: padded reads of never-written slots must be finite for masked attention.
    An FP8 pool is held as bytes and viewed as e4m3 by the layers (the pool's copies between
    tiers, index_copy_ and equal among them, have no e4m3 kernels on the CPU)."""
    storage = torch.uint8 if dtype == FP8 else dtype
    pool = zeros((num_layers, 2, num_blocks, num_heads, block_size, head_dim), storage, device)
    return pool, [(layer[0].transpose(1, 2).view(dtype), layer[1].transpose(1, 2).view(dtype)) for layer in pool]


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device, pin_memory: bool = False) -> torch.Tensor:
    """torch.zeros; in host memory that is not pinned, calloc's (numpy's zeros): the system's zero
    pages, each committed when it is first written, so a CPU engine's 2 GiB pool takes no time to
    make or free and its memory grows with the blocks it uses (torch.zeros writes every byte)."""
    if torch.device(device).type != "cpu" or pin_memory:
        return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    return torch.from_numpy(np.zeros(nbytes, np.uint8)).view(dtype).view(shape)


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
        self.kv_dtype = kv_cache_torch_dtype(engine_cfg.kv_cache_dtype, dtype)
        fp8_weights = model_cfg.quantization == "fp8" or engine_cfg.quantization == "fp8"
        fp8 = fp8_weights or self.kv_dtype == FP8
        if fp8 and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            raise ValueError("FP8 weights or KV cache need a GPU of compute capability 8.9 or later (Ada, Hopper)")
        self.model = load_model(model_cfg, path, dtype, device, max_model_len, seed=engine_cfg.seed)
        if engine_cfg.quantization == "fp8" and model_cfg.quantization is None:  # (an FP8 checkpoint loads as it is)
            layers = quantize_linear_weights(self.model)
            size = sum(t.numel() * t.element_size() for t in self.model.parameters())
            logger.info("%d linear layers quantized to fp8 (weights now %.2f GiB)", layers, size / (1 << 30))
        if device.type == "cpu":
            self._pack_weights(dtype, fp8_weights)
        self.sampler = Sampler()
        if device.type == "cuda":  # (its kernels compiled before serving, graphed or eager)
            self.sampler.warm_up(model_cfg.vocab_size, device, dtype)
        self.upload = Uploader(device)
        self.block_tables = BlockTables()
        self._sampling_cache: tuple[SamplingBatch, SamplingTensors] | None = None
        self._deferred: tuple | None = None  # (run with defer: its logits, sampling tensors, prompt logprobs)
        self._prompt: tuple | None = None  # (the step's prompt logprobs, from step_logits to run)
        self._in_flight: torch.Tensor | None = None  # (the step's pending rows' tokens, from prepare to run)
        self._last_sample: tuple[torch.Tensor, torch.Tensor] | None = None  # (outputs read, tokens sampled)
        self.generators: dict[str, torch.Generator] = {}  # seeded requests' own, by request id
        self.kv_cache: torch.Tensor | None = None
        self.host_kv: torch.Tensor | None = None  # (the KV cache's host tier, kv_offload_memory)
        self.copy_stream: torch.cuda.Stream | None = None  # (its copies', on a GPU)
        self.kv_role, self.kv_transfer_backend = engine_cfg.kv_role, engine_cfg.kv_transfer_backend
        self.kv_transfer: KVTransfer | None = None  # a prefill or decode instance's, over its pool
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None
        self.tp_size = get_tp_size()

    def kv_block_bytes(self) -> int:
        """Bytes of one block of this rank's KV pool (its own KV heads), K and V of every layer."""
        layers = self.model.attention_layers()
        attn = layers[0]
        return 2 * len(layers) * self.block_size * attn.num_kv_heads * attn.head_dim * self.kv_dtype.itemsize

    def num_kv_blocks(self, engine_cfg: EngineConfig) -> int:
        """Blocks that fit the memory budget left after loading the model."""
        if engine_cfg.num_gpu_blocks_override is not None:
            return engine_cfg.num_gpu_blocks_override
        if engine_cfg.kv_cache_memory is not None:  # on any device (vLLM's kv_cache_memory_bytes)
            budget = engine_cfg.kv_cache_memory
        elif self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            # (vLLM's meaning: this instance's share of the GPU, so that instances can share one;
            # what another process holds counts only through what is free)
            budget = min(total * engine_cfg.gpu_memory_utilization - torch.cuda.memory_reserved(self.device), free)
            budget -= max(1 << 30, 0.1 * budget)  # headroom: activations, the CUDA context
        else:
            budget = DEFAULT_CPU_KV_CACHE_MEMORY
        blocks = int(budget // self.kv_block_bytes())
        if blocks < 1:
            raise ValueError(
                "no memory left for the KV cache: lower the model size or raise "
                "gpu_memory_utilization / kv_cache_memory"
            )
        return blocks

    def allocate_kv_cache(self, num_blocks: int, num_host_blocks: int = 0) -> None:
        """This rank's KV pool (allocate_kv_pool), bound to the model's attention layers, and its
        host pool when num_host_blocks > 0: [num_host_blocks, layers, 2, kv_heads, block_size,
        head_dim], a block's K and V of every layer in one piece (pinned when the pool is on a
        GPU)."""
        layers = self.model.attention_layers()
        attn = layers[0]
        self.kv_cache, views = allocate_kv_pool(
            len(layers), num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim, self.kv_dtype, self.device
        )
        for layer, (k, v) in zip(layers, views, strict=True):
            layer.k_cache, layer.v_cache = k, v
        if num_host_blocks:
            shape = (num_host_blocks, *self.kv_cache.shape[:2], *self.kv_cache.shape[3:])
            self.host_kv = zeros(shape, self.kv_cache.dtype, "cpu", pin_memory=self.device.type == "cuda")
            if self.device.type == "cuda":
                self.copy_stream = torch.cuda.Stream(self.device)
        if self.kv_role != "both":
            self.kv_transfer = NixlKVTransfer(attn.first_kv_head, cuda_ipc=self.kv_transfer_backend == "auto")
            self.kv_transfer.register(self.kv_cache)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB) on %s",
            num_blocks,
            self.block_size,
            num_blocks * self.kv_block_bytes() / (1 << 30),
            self.device,
        )

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

    def _pack_weights(self, dtype: torch.dtype, fp8_weights: bool) -> None:
        """A CPU's weights in oneDNN's layout where its GEMM pays (pack_weights), said at start-up;
        where oneDNN has no GEMM for a bf16 or fp16 model, that is said instead, with the way out."""
        packed = pack_weights(self.model)
        if packed:
            logger.info("%d linear weights packed into oneDNN's layout for its GEMM", packed)
        elif dtype in (torch.bfloat16, torch.float16) and not fp8_weights:
            name = str(dtype).removeprefix("torch.")
            logger.info(
                "this CPU's oneDNN has no %s GEMM: the linear layers run in torch's %s GEMM below %d rows "
                "and in fp32 from there; --dtype float32 may decode several requests at a time faster "
                "here, at twice the weights' memory",
                name,
                name,
                UPCAST_ROWS,
            )

    def free_graphs(self) -> None:
        """Drop the CUDA graphs (before the process group they captured collectives of is destroyed)."""
        self.graphs = self.mixed_graphs = None

    def prepare(
        self, step: StepInputs, pending: Callable[[], torch.Tensor | None] | None = None, num_pending: int = 0
    ) -> tuple[ModelInputs, DecodeGraphs | MixedGraphs | None]:
        """The step's inputs, and the graphs that replay it (None: it runs eagerly). pending()
        gives the num_pending tokens the step's first rows decode, on the device (on rank 0, which
        sampled them, else None: the other ranks receive them from it); it is called once the
        inputs are built and uploaded, so that what it waits for (Worker.execute_step's sampling
        of the step before) overlaps that work."""
        inputs, graphs = self._build(step)
        pending = pending() if pending is not None else None
        if num_pending:  # (the pending rows decode: their tokens come first)
            if self.tp_size > 1:
                if pending is None:
                    pending = torch.empty(num_pending, dtype=torch.long, device=self.device)
                tp_broadcast(pending)
            inputs.input_ids[:num_pending].copy_(pending)
        self._in_flight = pending if num_pending else None  # (rank 0's penalties count them: run)
        return inputs, graphs

    def _build(self, step: StepInputs) -> tuple[ModelInputs, DecodeGraphs | MixedGraphs | None]:
        if step.is_decode:
            size = self.graphs.padded_size(step.num_seqs) if self.graphs is not None else None
            inputs = build_decode(step, self.block_size, self.upload, size, self.block_tables)
            return inputs, self.graphs if size else None
        if self.mixed_graphs is not None:
            pad = self.mixed_graphs.padding(step.num_tokens, step.num_seqs, prefill_work_items(step.query_lens))
            if pad is not None:
                return build_mixed_graph(step, self.block_size, self.upload, pad, self.block_tables), self.mixed_graphs
        return build_eager(step, self.block_size, self.upload, self.block_tables), None

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[bool, list[int], list[int]]]) -> None:
        """Copy blocks between this rank's GPU and host pools: (to the host?, source ids,
        destination ids) each, in the order BlockManager.take_copies gives them. GPU blocks are
        read and written on the compute stream, in that order (a block this step writes may have
        been copied out just before; a fresh block may still be in use by the step in flight).
        The PCIe transfers run on a copy stream of their own (on a GPU), overlapping compute: a
        promotion's host-to-device copy goes first, into a staging buffer, beside the step in
        flight (unless it reads a host block that a demotion before it writes), and the compute
        stream then scatters it into its blocks; a demotion is gathered on the compute stream and
        copied to the host beside this step's forward."""
        written: set[int] = set()  # host blocks the demotions so far write
        staged = {}
        for i, (to_host, src, dst) in enumerate(copies):
            if to_host:
                written.update(dst)
            elif written.isdisjoint(src):
                staged[i] = self._stage(src)
        for i, (to_host, src, dst) in enumerate(copies):
            if to_host:
                self._to_host(src, dst)
            else:
                self._scatter(*(staged.pop(i) if i in staged else self._stage(src)), dst)

    def _stage(self, src: list[int]) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Host blocks copied into a staging buffer on the GPU (on the copy stream), and the event
        after the copy (None without a copy stream: done)."""
        side = self.copy_stream
        with self._on_copy_stream():
            staged = torch.empty((len(src), *self.host_kv.shape[1:]), dtype=self.host_kv.dtype, device=self.device)
            for i, start, count in block_runs(list(range(len(src))), src):
                staged[i : i + count].copy_(self.host_kv[start : start + count], non_blocking=True)
            done = side.record_event() if side is not None else None
        return staged, done

    def _scatter(self, staged: torch.Tensor, done: torch.cuda.Event | None, dst: list[int]) -> None:
        """A staged copy into its GPU blocks, on the compute stream once the copy is done."""
        if done is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(done)
            staged.record_stream(compute)  # (allocated on the copy stream, used on this one)
        self.kv_cache.index_copy_(2, torch.tensor(dst, device=self.device), staged.movedim(0, 2))

    def _to_host(self, src: list[int], dst: list[int]) -> None:
        """GPU blocks gathered on the compute stream, then copied to the host on the copy stream
        (one copy per run of consecutive host blocks)."""
        picked = self.kv_cache.index_select(2, torch.tensor(src, device=self.device)).movedim(2, 0).contiguous()
        side = self.copy_stream
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(self.device))  # (the gather)
            picked.record_stream(side)  # (its memory is not reused before the copy is done)
        with self._on_copy_stream():
            for i, start, count in block_runs(list(range(len(dst))), dst):
                self.host_kv[start : start + count].copy_(picked[i : i + count], non_blocking=True)

    def _on_copy_stream(self):
        """The copy stream as the current stream (in place without one: on the CPU)."""
        return torch.cuda.stream(self.copy_stream) if self.copy_stream is not None else contextlib.nullcontext()

    def check_host_copies(self, copied: list[tuple[int, int]], recomputed: list[tuple[int, int]]) -> None:
        """(GPU block, host block) pairs that must hold the same KV (PICOVLLM_CHECK_INVARIANTS): the
        very same bytes when one was copied from the other; the same tokens' KV computed again
        (in other prompt chunks), within rounding: a relative error under RECOMPUTED_KV_TOL of
        the pool's element size (another block's KV, or none, is off by about 1)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for gpu, host in copied:
            assert torch.equal(self.kv_cache[:, :, gpu].cpu(), self.host_kv[host]), (
                f"GPU block {gpu} != host block {host}"
            )
        tol = RECOMPUTED_KV_TOL[self.kv_cache.element_size()]
        for gpu, host in recomputed:
            a, b = self.kv_cache[:, :, gpu].cpu().float(), self.host_kv[host].float()
            error = float((a - b).norm() / a.norm().clamp(min=1e-30))
            assert error < tol, f"GPU block {gpu} and host block {host}, the same tokens' KV, differ by {error:.2g}"

    @torch.inference_mode()
    def step_logits(
        self, step: StepInputs, pending: Callable[[], torch.Tensor | None] | None = None, num_pending: int = 0
    ) -> torch.Tensor | None:
        """The forward of one step on this rank (after the step's copies between the KV pools):
        the logits of the sampled positions on rank 0, None on the others (see prepare for
        pending)."""
        if step.kv_copies:
            self.copy_blocks(step.kv_copies)
        inputs, graphs = self.prepare(step, pending, num_pending)
        if graphs is not None and graphs.computes_logits:  # a decode graph: every row samples, past its prompt
            assert not step.prompt_logprobs
            self._prompt = None
            logits = graphs.run(inputs)
            return None if logits is None else logits[: step.num_seqs]  # (its padding rows are not sampled)
        if graphs is not None:
            hidden = graphs.run(inputs)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        self._prompt = self._prompt_logprobs(hidden, step) if step.prompt_logprobs else None
        if inputs.logits_indices is not None:
            hidden = hidden[inputs.logits_indices]
        return self.model.compute_logits(hidden)

    def _prompt_logprobs(self, hidden: torch.Tensor, step: StepInputs) -> tuple | None:
        """StepInputs.prompt_logprobs: each target token's log-probability and rank under the
        logits of the token before it, and the top-k (the largest k of the step), as SamplerOutput's
        prompt_* tensors; PROMPT_ROWS rows at a time (a [rows, vocab] fp32 each). Every rank
        computes the logits (the LM head's gather); rank 0 returns them, the others None."""
        starts = np.concatenate([[0], np.cumsum(step.query_lens)[:-1]])
        rows = np.concatenate([np.arange(starts[b], starts[b] + len(t)) for b, _, t in step.prompt_logprobs])
        targets = torch.tensor([t for _, _, ts in step.prompt_logprobs for t in ts], device=self.device)
        k = max(k for _, k, _ in step.prompt_logprobs)
        parts = []
        for i in range(0, len(rows), PROMPT_ROWS):
            logits = self.model.compute_logits(hidden[torch.from_numpy(rows[i : i + PROMPT_ROWS]).to(self.device)])
            if logits is None:
                continue
            part = token_logprobs(targets[i : i + PROMPT_ROWS], torch.log_softmax(logits.float(), dim=-1), k)
            parts.append((part.sampled_logprobs, part.sampled_ranks, part.top_logprobs, part.top_ids))
        if not parts:
            return None
        return tuple(torch.cat(column) if column[0] is not None else None for column in zip(*parts))

    def _with_prompt(self, out: SamplerOutput | None, prompt: tuple | None) -> SamplerOutput | None:
        """The step's samples with its prompt log-probabilities (out None: it sampled nothing)."""
        if prompt is None:
            return out
        if out is None:
            out = SamplerOutput(torch.empty(0, dtype=torch.long, device=self.device), None, None, None, None)
        return dataclasses.replace(
            out,
            prompt_logprobs=prompt[0],
            prompt_ranks=prompt[1],
            prompt_top_logprobs=prompt[2],
            prompt_top_ids=prompt[3],
        )

    def _sampling_tensors(self, batch: SamplingBatch) -> SamplingTensors:
        """The batch's sampling tensors, its rows' tokens in flight counted (prepare). The engine
        decides what can be reused: it sends the very batch it sent last when the same requests
        sample again and nothing in them changes per step (StepLauncher._sampling_batch); then the
        tensors built for it serve again. A batch that continues the one before (the same
        requests, but their outputs or bans changed) keeps its parameters' tensors and only
        rebuilds what changes (SamplingTensors.from_batch)."""
        cached = self._sampling_cache  # (the batch last built, its tensors)
        if cached is not None and cached[0] is batch:
            return cached[1]
        self.free_requests(batch.finished_ids)
        before = cached[1] if cached is not None and batch.continues else None
        if before is not None:
            generators = before.generators
        else:
            seeds = zip(batch.request_ids, batch.seeds)
            generators = [None if seed is None else self._generator(rid, seed) for rid, seed in seeds]
        vocab_size = self.model_cfg.vocab_size
        grown = self._grown_outputs(batch, cached)
        tensors = SamplingTensors.from_batch(batch, generators, vocab_size, self.eos_ids, self.device, before, grown)
        if grown is None and tensors.output_ids is not None and self._in_flight is not None:  # (launched ahead)
            tensors = tensors.with_in_flight(self._in_flight, vocab_size)
        self._sampling_cache = (batch, tensors)
        return tensors

    def _grown_outputs(self, batch: SamplingBatch, cached: tuple | None) -> torch.Tensor | None:
        """The rows' outputs (penalties) on the device, when batch continues the batch before and
        each row's output is one token longer than then: the outputs the last sampling read, with
        the tokens it sampled; else None (the batch's lists serve). Either way a token still in
        flight is counted (it is one of those sampled)."""
        last = self._last_sample
        if not batch.continues or batch.output_ids is None or cached is None or last is None:
            return None
        if cached[1].output_ids is not last[0] or any(
            n != m + 1 for n, m in zip(batch.num_output_tokens, cached[0].num_output_tokens, strict=True)
        ):
            return None
        return torch.cat([last[0], last[1][:, None]], dim=1)

    def _sample(self, logits: torch.Tensor, tensors: SamplingTensors) -> SamplerOutput:
        """The sampler's samples; the outputs it read and its tokens are kept (_grown_outputs)."""
        out = self.sampler(logits, tensors)
        self._last_sample = None if tensors.output_ids is None else (tensors.output_ids, out.sampled)
        return out

    def free_requests(self, request_ids: list[str]) -> None:
        """Forget finished requests' generators."""
        for rid in request_ids:
            self.generators.pop(rid, None)

    def _generator(self, request_id: str, seed: int) -> torch.Generator:
        gen = self.generators.get(request_id)
        if gen is None:
            gen = self.generators[request_id] = torch.Generator(device=self.device).manual_seed(seed)
        return gen

    @torch.inference_mode()
    def run(
        self,
        step: StepInputs,
        sampling: SamplingBatch | None,
        pending: Callable[[], torch.Tensor | None] | None = None,
        num_pending: int = 0,
        defer: bool = False,
    ) -> SamplerOutput | None:
        """One forward and, when rows sample (sampling: one row per step.sample, on rank 0), their
        samples. pending, num_pending: see prepare(). defer: the samples wait for the bitmask of
        the rows' grammars (sample_deferred); the logits are kept until then."""
        logits = self.step_logits(step, pending, num_pending)
        prompt, self._prompt = self._prompt, None
        # The sampling parameters are built while the forward runs (host time that a lone
        # request's first token would otherwise wait for); they reach
        # the device through pinned memory, which never waits for the queued forward.
        if sampling is None or not sampling.num_rows:
            return self._with_prompt(None, prompt)
        tensors = self._sampling_tensors(sampling)
        if defer:
            self._deferred = (logits, tensors, prompt)
            return None
        return self._with_prompt(self._sample(logits, tensors), prompt)

    def sample_deferred(self, bitmask: torch.Tensor | None) -> SamplerOutput:
        """The samples of the step run with defer, under bitmask (its rows' grammars)."""
        (logits, tensors, prompt), self._deferred = self._deferred, None
        if bitmask is not None:
            tensors = dataclasses.replace(tensors, bitmask=pinned_to(bitmask, self.device))
        return self._with_prompt(self._sample(logits, tensors), prompt)
