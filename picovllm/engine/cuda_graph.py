"""CUDA graphs for decode: one graph per batch size in a ladder (1, 2, 4, 8, then steps of 16),
captured at start-up in one shared memory pool over static input buffers. A step pads its batch
to the next captured size (padding rows: slot -1, so nothing is stored, and a one-token context)
and replays; larger batches run eagerly.

Inside a graph nothing may allocate new memory outside the pool, sync with the host, or depend on
data for control flow: the decode attention is launched with max_context_len = max_model_len
(partitions past a sequence's context exit at once) and max_query_len = 1.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from picovllm.model.layers.attention import AttentionMetadata

logger = logging.getLogger("picovllm")

MAX_GRAPH_BATCH = 512
_LADDER = [1, 2, 4, 8, *range(16, MAX_GRAPH_BATCH + 1, 16)]


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, 48, ... up to the first size that covers max_num_seqs (at most 512)."""
    target = min(max_num_seqs, MAX_GRAPH_BATCH)
    return [s for s in _LADDER if s < target] + [next(s for s in _LADDER if s >= target)]


@dataclass
class DecodeBuffers:
    """The static inputs every graph reads (slices of these tensors)."""

    input_ids: torch.Tensor  # [max_batch]
    positions: torch.Tensor  # [max_batch]
    slot_mapping: torch.Tensor  # [max_batch]
    context_lens: torch.Tensor  # [max_batch]
    block_tables: torch.Tensor  # [max_batch, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor  # [max_batch + 1] = arange

    @classmethod
    def allocate(cls, max_batch: int, max_blocks: int, device: torch.device) -> DecodeBuffers:
        long = dict(dtype=torch.int64, device=device)
        return cls(torch.zeros(max_batch, **long), torch.zeros(max_batch, **long),
                   torch.full((max_batch,), -1, **long), torch.ones(max_batch, **long),
                   torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device),
                   torch.arange(max_batch + 1, **long))

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, padded: int) -> None:
        """Copy a decode batch of B sequences into rows [0, B) and make rows [B, padded) inert."""
        b, width = input_ids.shape[0], meta.block_tables.shape[1]
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slot_mapping[:b].copy_(meta.slot_mapping)
        self.context_lens[:b].copy_(meta.context_lens)
        self.block_tables[:b, :width].copy_(meta.block_tables)
        self.input_ids[b:padded].zero_()
        self.positions[b:padded].zero_()
        self.slot_mapping[b:padded].fill_(-1)
        self.context_lens[b:padded].fill_(1)
        self.block_tables[b:padded].zero_()

    def meta(self, batch: int, max_context_len: int) -> AttentionMetadata:
        return AttentionMetadata(self.slot_mapping[:batch], self.block_tables[:batch], self.context_lens[:batch],
                                 self.query_start_loc[:batch + 1], max_query_len=1, max_context_len=max_context_len)


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, max_num_seqs: int, max_model_len: int, block_size: int,
                 device: torch.device):
        self.model = model
        self.max_model_len = max_model_len
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.buffers = DecodeBuffers.allocate(self.sizes[-1], -(-max_model_len // block_size), device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every size, largest first (smaller graphs reuse its pool); returns seconds."""
        start = time.perf_counter()
        pool = None
        buf = self.buffers
        for size in reversed(self.sizes):
            meta = buf.meta(size, self.max_model_len)
            self.model(buf.input_ids[:size], buf.positions[:size], meta)  # warm-up: compile kernels
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.model(buf.input_ids[:size], buf.positions[:size], meta)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        logger.info("captured %d CUDA graphs (decode batch sizes %d..%d) in %.1f s", len(self.sizes),
                    self.sizes[0], self.sizes[-1], elapsed)
        return elapsed

    def padded_size(self, batch: int) -> int | None:
        return next((s for s in self.sizes if s >= batch), None)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """Hidden states of a decode batch from its graph, or None when no graph is large enough."""
        batch = input_ids.shape[0]
        padded = self.padded_size(batch)
        if padded is None:
            return None
        self.buffers.fill(input_ids, positions, meta, padded)
        self.graphs[padded].replay()
        return self.outputs[padded][:batch]
