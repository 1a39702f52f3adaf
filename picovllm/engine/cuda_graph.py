"""CUDA graphs for decode: one graph per batch size in a ladder (1, 2, 4, 8, then steps of 16),
captured at start-up in one shared memory pool over static input buffers. A step's inputs come
padded to the next captured size (padding rows: slot -1, so nothing is stored, and a one-token
context; model_runner.build_inputs), are copied into the buffers with two device copies, and the
graph replays; larger batches run eagerly.

Inside a graph nothing may allocate new memory outside the pool, sync with the host, or depend on
data for control flow: the decode attention's grid depends on the batch size alone (each sequence
cuts its own context into that many splits) and max_query_len = 1.
"""
from __future__ import annotations

import logging
import time
import torch

from picovllm.model.layers.attention import AttentionMetadata

logger = logging.getLogger("picovllm")

MAX_GRAPH_BATCH = 512
_LADDER = [1, 2, 4, 8, *range(16, MAX_GRAPH_BATCH + 1, 16)]


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, 48, ... up to the first size that covers max_num_seqs (at most 512)."""
    target = min(max_num_seqs, MAX_GRAPH_BATCH)
    return [s for s in _LADDER if s < target] + [next(s for s in _LADDER if s >= target)]


class DecodeBuffers:
    """The static inputs every graph reads: the graph of batch size P reads rows [:P].

    vectors [4, max_batch]: input ids, positions, slots, context lens (one copy per step fills
    them, from the [4, P] array that build_inputs uploads already padded);
    block_tables [max_batch, max_blocks]: a step copies the columns its contexts use; entries
    past a sequence's context are never read."""

    def __init__(self, max_batch: int, max_blocks: int, device: torch.device):
        self.vectors = torch.zeros(4, max_batch, dtype=torch.int64, device=device)
        self.vectors[2], self.vectors[3] = -1, 1
        self.block_tables = torch.zeros(max_batch, max_blocks, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int64, device=device)

    def fill(self, inputs) -> int:
        """Copy a padded decode batch (ModelInputs with decode_rows) in; returns its size P."""
        padded, width = inputs.decode_rows.shape[1], inputs.meta.block_tables.shape[1]
        self.vectors[:, :padded].copy_(inputs.decode_rows)
        self.block_tables[:padded, :width].copy_(inputs.meta.block_tables)
        return padded

    def args(self, batch: int, max_context_len: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids, positions, metadata) of the graph of this batch size."""
        ids, positions, slots, context_lens = self.vectors[:, :batch]
        meta = AttentionMetadata(slots, self.block_tables[:batch], context_lens, self.query_start_loc[:batch + 1],
                                 max_query_len=1, max_context_len=max_context_len)
        return ids, positions, meta


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, max_num_seqs: int, max_model_len: int, block_size: int,
                 device: torch.device):
        self.model = model
        self.max_model_len = max_model_len
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.buffers = DecodeBuffers(self.sizes[-1], -(-max_model_len // block_size), device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every size, largest first (smaller graphs reuse its pool); returns seconds."""
        start = time.perf_counter()
        pool = None
        buf = self.buffers
        for size in reversed(self.sizes):
            args = buf.args(size, self.max_model_len)
            self.model(*args)  # warm-up: compile kernels
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.model(*args)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        logger.info("captured %d CUDA graphs (decode batch sizes %d..%d) in %.1f s", len(self.sizes),
                    self.sizes[0], self.sizes[-1], elapsed)
        return elapsed

    def padded_size(self, batch: int) -> int | None:
        return next((s for s in self.sizes if s >= batch), None)

    def run(self, inputs) -> torch.Tensor:
        """Hidden states of a decode batch already padded to a captured size (all P rows)."""
        padded = self.buffers.fill(inputs)
        self.graphs[padded].replay()
        return self.outputs[padded]
