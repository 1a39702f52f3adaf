"""Turns a scheduled batch into plain tensors, runs the model and the sampler.

Slot mappings and block tables are built with vectorised numpy ops (a loop over sequences,
never over tokens); the sampled tokens come back to the host in one transfer per step.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from picovllm.config import EngineConfig, ModelConfig
from picovllm.engine.block_manager import BlockManager
from picovllm.engine.cuda_graph import DecodeGraphs, MixedGraphs, packed_layout
from picovllm.engine.request import Request
from picovllm.engine.sampler import Sampler, SamplerOutput, SamplingTensors
from picovllm.engine.scheduler import ScheduledBatch
from picovllm.kernels.prefill_attention import BLOCK_M, num_work_items, prefill_work, work_block_m
from picovllm.model.layers.attention import AttentionMetadata
from picovllm.model.loader.model_loader import load_model

DEFAULT_CPU_KV_CACHE_MEMORY = 2 << 30


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor | None  # rows of the hidden states that are sampled (None: all)
    decode_rows: torch.Tensor | None = None  # decode: [4, B] = input_ids, positions, slots, context lens
    token_rows: torch.Tensor | None = None  # padded for a mixed-step graph: [3, T] = input_ids, positions, slots
    graph_inputs: torch.Tensor | None = None  # the packed upload: a mixed-step graph's inputs but the tables first


class Uploader:
    """Moves a step's int64 arrays to the device in one copy: they are packed into a pinned host
    buffer (cuda_graph.packed_layout) and copied with non_blocking; the tensors returned are views
    of one device buffer, and packed=True adds the whole packed buffer (a mixed-step graph copies
    its inputs from its start). On a CPU the arrays are used as they are, packed only if asked.
    Two buffer pairs take turns: with a step launched ahead (async scheduling) the host packs
    the next step while the previous copy may still be queued behind the running step; before
    a pair is reused, the copy that last read it is waited for (long done by then)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.slots = [[torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64), None] for _ in range(2)]
        self.turn = 0

    def __call__(self, *arrays: np.ndarray, packed: bool = False) -> list[torch.Tensor]:
        if self.device.type != "cuda" and not packed:
            return [torch.from_numpy(a) for a in arrays]
        offsets, total = packed_layout(a.size for a in arrays)
        if self.device.type != "cuda":
            host = dev = torch.zeros(total, dtype=torch.int64)
        else:
            slot = self.slots[self.turn]
            self.turn ^= 1
            host, dev, copied = slot
            if copied is not None:
                copied.synchronize()
            if host.numel() < total:
                size = max(total, 2 * host.numel(), 1 << 16)
                host = slot[0] = torch.empty(size, dtype=torch.int64, pin_memory=True)
                dev = slot[1] = torch.empty(size, dtype=torch.int64, device=self.device)
        staged = host.numpy()
        for a, offset in zip(arrays, offsets):
            staged[offset: offset + a.size] = a.ravel()
        if self.device.type == "cuda":
            dev[:total].copy_(host[:total], non_blocking=True)
            slot[2] = torch.cuda.Event()
            slot[2].record()
        return [dev[offset: offset + a.size].view(a.shape) for a, offset in zip(arrays, offsets)] + \
            ([dev[:total]] if packed else [])


def build_inputs(token_ids: list[list[int]], num_tokens: np.ndarray, query_lens: np.ndarray,
                 block_tables: list[list[int]], block_size: int, upload, pad_to: int | None = None,
                 sample: np.ndarray | None = None, pad_mixed: tuple[int, int, int] | None = None) -> ModelInputs:
    """Inputs for B sequences whose last query_lens[b] tokens (of num_tokens[b]) are computed.
    token_ids[b] holds those new tokens; sample[b] (default all) marks the sequences whose last
    new token is sampled.

    Padding for CUDA graphs: pad_to (decode only) adds inert sequences up to that batch size
    (token 0 at position 0, slot -1 so nothing is stored, a one-token context over block 0);
    pad_mixed = (T, S, W) pads any step to T tokens, S sequences and W prefill work items
    (padding tokens: slot -1, in no sequence; padding sequences: no tokens, no context; padding
    work items: -1), and packs them but the block tables as MixedGraphs lays a graph's inputs out
    (graph_inputs: one copy)."""
    num_seqs = len(query_lens)
    width = max(1, max(len(t) for t in block_tables))
    rows = pad_to or (pad_mixed[1] if pad_mixed else num_seqs)
    tables = np.zeros((rows, width), dtype=np.int64)
    for b, table in enumerate(block_tables):
        tables[b, : len(table)] = table
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    total = int(query_start_loc[-1])
    seq_of_token = np.repeat(np.arange(num_seqs), query_lens)
    positions = (np.arange(total) - query_start_loc[seq_of_token] + (num_tokens - query_lens)[seq_of_token])
    slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    input_ids = np.fromiter((t for ids in token_ids for t in ids), dtype=np.int64, count=total)
    decode = total == num_seqs and (sample is None or bool(sample.all()))
    last = query_start_loc[1:] - 1
    logits_indices = last if sample is None else last[sample]
    decode_rows = token_rows = graph_inputs = None
    block_m = BLOCK_M if pad_mixed is not None else work_block_m(int(query_lens.max()))
    work = None  # the prefill attention's work list (not for decode batches)
    if pad_mixed is not None or not decode:
        work = prefill_work(query_lens, block_m, capacity=pad_mixed[2] if pad_mixed else None)
    if pad_mixed is not None:  # the graph's inputs, padded, in MixedGraphs' packed order; then the rest
        size, seqs, _ = pad_mixed
        assert size >= total and seqs >= num_seqs, (pad_mixed, total, num_seqs)
        tokens = np.zeros((3, size), dtype=np.int64)
        tokens[2] = -1
        tokens[:, :total] = input_ids, positions, slots
        context_lens = np.zeros(seqs, dtype=np.int64)
        context_lens[:num_seqs] = num_tokens
        padded_qsl = np.full(seqs + 1, total, dtype=np.int64)
        padded_qsl[: num_seqs + 1] = query_start_loc
        token_rows, ctx_dev, qsl_dev, work_dev, tables_dev, logits_dev, graph_inputs = upload(
            tokens, context_lens, padded_qsl, work, tables, logits_indices, packed=True)
        input_ids_dev, positions_dev, slots_dev = token_rows
    elif decode:  # one [4, B] array (ids, positions, slots, context lens), which graphs copy at once
        vectors = np.zeros((4, rows), dtype=np.int64)
        vectors[2], vectors[3] = -1, 1
        vectors[:, :num_seqs] = input_ids, positions, slots, num_tokens
        decode_rows, tables_dev, qsl_dev = upload(vectors, tables, np.arange(rows + 1, dtype=np.int64))
        input_ids_dev, positions_dev, slots_dev, ctx_dev = decode_rows
        logits_dev = work_dev = None  # every row is sampled; no prefill attention
    else:
        assert pad_to is None, "only decode batches are padded to a batch size"
        input_ids_dev, positions_dev, slots_dev, ctx_dev, tables_dev, qsl_dev, logits_dev, work_dev = upload(
            input_ids, positions, slots, num_tokens.astype(np.int64), tables, query_start_loc, logits_indices, work)
    return ModelInputs(
        input_ids=input_ids_dev, positions=positions_dev,
        meta=AttentionMetadata(slot_mapping=slots_dev, block_tables=tables_dev, context_lens=ctx_dev,
                               query_start_loc=qsl_dev, max_query_len=int(query_lens.max()),
                               max_context_len=int(num_tokens.max()),
                               any_single_query=bool((query_lens == 1).any()), prefill_work=work_dev,
                               prefill_block_m=block_m),
        logits_indices=logits_dev, decode_rows=decode_rows, token_rows=token_rows, graph_inputs=graph_inputs,
    )


class ModelRunner:
    def __init__(self, engine_cfg: EngineConfig, model_cfg: ModelConfig, path: str | None,
                 dtype: torch.dtype, device: torch.device, max_model_len: int, eos_ids: set[int]):
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

    def kv_block_bytes(self) -> int:
        attn = self.model.attention_layers()[0]
        return BlockManager.bytes_per_block(self.block_size, len(self.model.attention_layers()),
                                            attn.num_kv_heads, attn.head_dim, self.dtype)

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
            raise ValueError("no memory left for the KV cache: lower the model size or raise "
                             "gpu_memory_utilization / kv_cache_memory")
        return blocks

    def bind_kv_cache(self, block_manager: BlockManager) -> None:
        for attn, (k, v) in zip(self.model.attention_layers(), block_manager.layer_caches()):
            attn.k_cache, attn.v_cache = k, v

    def capture_graphs(self, max_num_seqs: int, max_model_len: int, mixed_graph_tokens: int = 0) -> float:
        """Capture CUDA graphs (after the KV cache is bound: graphs keep its addresses): decode,
        and mixed steps of up to mixed_graph_tokens tokens when it is > 0. Returns seconds."""
        self.graphs = DecodeGraphs(self.model, max_num_seqs, max_model_len, self.block_size, self.device)
        seconds = self.graphs.capture()
        if mixed_graph_tokens > 0:
            self.mixed_graphs = MixedGraphs(self.model, mixed_graph_tokens, max_num_seqs, max_model_len,
                                            self.block_size, self.device)
            seconds += self.mixed_graphs.capture()
        return seconds

    def prepare(self, batch: ScheduledBatch, pending: torch.Tensor | None = None) -> ModelInputs:
        """pending: for a step launched ahead, the next input token of each of the batch's first
        len(pending) requests, on the device (sampled by the step before, not yet read by the
        host); those requests decode it."""
        reqs = batch.requests
        num_pending = 0 if pending is None else len(pending)
        token_ids, context, sample = [], [], []
        for i, (r, n) in enumerate(zip(reqs, batch.num_new_tokens)):
            end = r.num_computed_tokens + n
            token_ids.append([0] if i < num_pending else r.token_ids[end - n: end])
            context.append(end)
            sample.append(i < num_pending or end == len(r.token_ids))
        query_lens = np.array(batch.num_new_tokens, dtype=np.int64)
        num_tokens = np.array(context, dtype=np.int64)
        sample = np.array(sample)
        pad_to = pad_mixed = None
        if batch.is_decode:
            pad_to = self.graphs.padded_size(len(reqs)) if self.graphs is not None else None
        elif self.mixed_graphs is not None:
            size = self.mixed_graphs.padded_size(int(query_lens.sum()), len(reqs), num_work_items(query_lens))
            pad_mixed = None if size is None else (size, self.mixed_graphs.num_seqs(size),
                                                   self.mixed_graphs.work_capacity(size))
        inputs = build_inputs(token_ids, num_tokens, query_lens, [r.block_table for r in reqs],
                              self.block_size, self.upload, pad_to, sample, pad_mixed)
        if pending is not None:  # (the pending rows decode: their tokens come first)
            inputs.input_ids[:num_pending].copy_(pending)
        return inputs

    @staticmethod
    def sampling_requests(batch: ScheduledBatch, num_pending: int = 0) -> list[Request]:
        """The requests whose last token this step computes: each samples one token (the first
        num_pending decode a token not yet appended: see prepare)."""
        return [r for i, (r, n) in enumerate(zip(batch.requests, batch.num_new_tokens))
                if i < num_pending or r.num_computed_tokens + n == r.num_tokens]

    @torch.inference_mode()
    def logits(self, batch: ScheduledBatch, pending: torch.Tensor | None = None) -> torch.Tensor:
        """The raw logits of the positions that are sampled, one row per sampling request."""
        inputs = self.prepare(batch, pending)
        if inputs.decode_rows is not None and self.graphs is not None and self.graphs.padded_size(len(batch.requests)):
            hidden = self.graphs.run(inputs)[: len(batch.requests)]
        elif inputs.token_rows is not None:
            hidden = self.mixed_graphs.run(inputs)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        if inputs.logits_indices is not None:
            hidden = hidden[inputs.logits_indices]
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
    def run(self, batch: ScheduledBatch, pending: torch.Tensor | None = None) -> tuple[list[Request], SamplerOutput | None]:
        """One forward; the requests that sample and their samples (None when none samples).
        pending: see prepare()."""
        reqs = self.sampling_requests(batch, 0 if pending is None else len(pending))
        logits = self.logits(batch, pending)
        # The sampling parameters are built while the forward runs (a new request's: about 0.2 ms
        # of host time that a lone request's first token would otherwise wait for); they reach
        # the device through pinned memory, which never waits for the queued forward.
        tensors = self._sampling_tensors(reqs) if reqs else None
        return reqs, (self.sampler(logits, tensors) if reqs else None)
