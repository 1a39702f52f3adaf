"""CUDA graphs, captured at start-up over static input buffers.

Decode: one graph per batch size in a ladder (1, 2, 4, 8, then steps of 16), in one shared
memory pool. A step's inputs come padded to the next captured size (padding rows: slot -1, so
nothing is stored, and a one-token context; inputs.build_decode), are copied into the buffers
with two device copies, and the graph replays; larger batches run eagerly. A decode step samples
every row, so its graph ends with the final norm and the LM head (the model's compute_logits)
and gives the logits, where the other steps give hidden states.

Mixed steps (prompt tokens, with or without decodes), when mixed_graph_tokens > 0: two graphs
per token count (mixed_graph_sizes: 16, 32, 48, 64, 80, ..., 1024, 1280, ..., each a quarter of
its octave above the one before, 16 at least, so that a step pads by at most a quarter or 16
tokens: a prompt's GEMMs cost as many tokens as its graph has) up to mixed_graph_tokens, each for
up to min(tokens, max_num_seqs) sequences of which up to MAX_GRAPH_PREFILLS have several tokens: one runs the
decode attention kernel for the sequences with one token, the other, for steps without such
sequences (a lone prompt, a prefix-cache hit), leaves it out (its programs would all exit, but
two kernels per layer still cost their launches). Padding tokens belong to no
sequence (slot -1, never attended to, their rows are never sampled); padding sequences have no
tokens and no context. A step with prompt tokens runs eagerly otherwise, paying one launch per
op, whatever the length (benchmarks/README.md has what that costs).

Inside a graph nothing may allocate new memory outside the pool, sync with the host, or depend on
data for control flow: the decode attention's grid depends on the batch size alone (each sequence
cuts its own context into that many splits) and max_query_len = 1; the prefill attention's grid
is its work list, padded to the graph's capacity with items that exit at once.
"""

from __future__ import annotations

import logging
import time

import torch

from picovllm.model.layers.attention import AttentionMetadata, prefill_work_capacity
from picovllm.worker.inputs import MixedPadding, ModelInputs, packed_layout

logger = logging.getLogger("picovllm")

MAX_GRAPH_BATCH = 512
MAX_GRAPH_PREFILLS = 8  # a mixed-step graph serves steps with up to this many multi-token sequences
_LADDER = [1, 2, 4, 8, *range(16, MAX_GRAPH_BATCH + 1, 16)]


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, 48, ... up to the first size that covers max_num_seqs (at most 512)."""
    target = min(max_num_seqs, MAX_GRAPH_BATCH)
    return [s for s in _LADDER if s < target] + [next(s for s in _LADDER if s >= target)]


class _GraphSet:
    """Graphs of one model over static input buffers, one graph per key (a size, or what keys()
    says), sharing one memory pool. Both families hold block tables for max_seqs sequences (a step
    copies the columns its contexts use; entries past a sequence's context are never read);
    fill() copies a step's padded inputs in and returns the key to replay."""

    kind = "?"
    computes_logits = False  # whether run() gives the logits (else the hidden states)

    def __init__(
        self,
        model: torch.nn.Module,
        sizes: list[int],
        max_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ):
        self.model = model
        self.sizes = sizes
        self.max_model_len = max_model_len
        self.block_tables = torch.zeros(max_seqs, -(-max_model_len // block_size), dtype=torch.int64, device=device)
        self.graphs: dict[object, torch.cuda.CUDAGraph] = {}  # by key (see keys())
        self.outputs: dict[object, torch.Tensor] = {}

    def keys(self) -> list:
        """The graphs to capture, largest first (smaller graphs reuse its pool)."""
        return list(reversed(self.sizes))

    def args(self, key) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids, positions, metadata) of the graph of this key, views of the buffers."""
        raise NotImplementedError

    def fill(self, inputs: ModelInputs):
        raise NotImplementedError

    def _fill_tables(self, block_tables: torch.Tensor) -> None:
        seqs, width = block_tables.shape
        self.block_tables[:seqs, :width].copy_(block_tables)

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every key of keys(); returns seconds."""
        start = time.perf_counter()
        pool = None
        for key in self.keys():
            args = self.args(key)
            self.forward(key, args)  # warm-up: compile kernels
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[key] = self.forward(key, args)
            pool = graph.pool()
            self.graphs[key] = graph
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        logger.info(
            "captured %d CUDA graphs (%s sizes %d..%d) in %.1f s",
            len(self.graphs),
            self.kind,
            self.sizes[0],
            self.sizes[-1],
            elapsed,
        )
        return elapsed

    def forward(self, key, args: tuple) -> torch.Tensor | None:
        """What the graph of this key computes from its buffers (args), captured or run as a warm-up."""
        return self.model(*args)

    def run(self, inputs: ModelInputs) -> torch.Tensor | None:
        """The outputs (all rows of the captured size: hidden states, or the logits where
        computes_logits) of a step padded for this family."""
        key = self.fill(inputs)
        self.graphs[key].replay()
        return self.outputs[key]


class DecodeGraphs(_GraphSet):
    """Decode, by batch size P; the graph of size P reads rows [:P].

    vectors [4, max_batch]: input ids, positions, slots, context lens (one copy per step fills
    them, from the [4, P] graph_inputs that inputs.build_decode uploads already padded).

    The graphs give logits, all of them in one buffer: the largest graph's output (captured
    first), into whose first rows each smaller graph copies its own (per-graph outputs would hold
    the sum of the sizes' logits, 0.7 GB at 256 sequences and a 152k vocabulary). On a
    tensor-parallel rank other than 0, which samples nothing, None."""

    kind = "decode batch"
    computes_logits = True

    def __init__(
        self, model: torch.nn.Module, max_num_seqs: int, max_model_len: int, block_size: int, device: torch.device
    ):
        sizes = graph_batch_sizes(max_num_seqs)
        super().__init__(model, sizes, sizes[-1], max_model_len, block_size, device)
        self.vectors = torch.zeros(4, sizes[-1], dtype=torch.int64, device=device)
        self.vectors[2], self.vectors[3] = -1, 1
        self.query_start_loc = torch.arange(sizes[-1] + 1, dtype=torch.int64, device=device)
        self.logits: torch.Tensor | None = None  # [largest size, vocab] (see above)

    def padded_size(self, batch: int) -> int | None:
        return next((s for s in self.sizes if s >= batch), None)

    def args(self, size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        ids, positions, slots, context_lens = self.vectors[:, :size]
        meta = AttentionMetadata(
            slots,
            self.block_tables[:size],
            context_lens,
            self.query_start_loc[: size + 1],
            max_query_len=1,
            max_context_len=self.max_model_len,
        )
        return ids, positions, meta

    def forward(self, size: int, args: tuple) -> torch.Tensor | None:
        logits = self.model.compute_logits(self.model(*args))
        if logits is None or not torch.cuda.is_current_stream_capturing():
            return logits
        if self.logits is None:  # (the largest graph)
            self.logits = logits
        else:
            self.logits[:size].copy_(logits)
        return self.logits[:size]

    def fill(self, inputs: ModelInputs) -> int:
        """A decode batch padded to P: two copies."""
        size = inputs.graph_inputs.shape[1]
        self.vectors[:, :size].copy_(inputs.graph_inputs)
        self._fill_tables(inputs.meta.block_tables)
        return size


def mixed_graph_sizes(max_tokens: int) -> list[int]:
    """16, 32, 48, 64, 80, 96, 112, 128, 160, ... up to the first that covers max_tokens: each
    octave [p, 2p) in quarters (16 tokens at least). Powers of two alone padded a 1,100-token prompt
    to 2,048 (benchmarks/README.md: time to first token by prompt length)."""
    sizes = [16]
    while sizes[-1] < max_tokens:
        octave = 1 << (sizes[-1].bit_length() - 1)  # (the power of two at or below)
        sizes.append(sizes[-1] + max(16, octave // 4))
    return sizes


class MixedGraphs(_GraphSet):
    """Steps with prompt tokens, by token count T (mixed_graph_sizes), for up to
    min(T, max_num_seqs) sequences and work_capacity(T) items of prefill attention work; keyed
    (T, decodes): decodes says whether the graph runs the decode kernel (some sequence has
    exactly one token).

    Each token count T has its inputs packed in one buffer (layout(T): tokens [3, T]: input ids,
    positions, slots; context_lens [S] and query_start_loc [S + 1] for S = num_seqs(T)
    sequences; the prefill attention's work list [work_capacity(T)]), which a step fills with one
    copy of what inputs.build_mixed_graph packed the same way; the block tables are shared by all
    sizes (a second copy)."""

    kind = "mixed step tokens"

    def __init__(
        self,
        model: torch.nn.Module,
        max_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ):
        sizes = mixed_graph_sizes(max_tokens)
        self.max_num_seqs = max_num_seqs
        seqs = self.num_seqs(sizes[-1])
        super().__init__(model, sizes, seqs, max_model_len, block_size, device)
        self.inputs = {}  # T -> (packed buffer, tokens, context_lens, query_start_loc, work)
        for size in sizes:
            lengths = self.layout(size)
            offsets, total = packed_layout(lengths)
            packed = torch.zeros(total, dtype=torch.int64, device=device)
            tokens, ctx, qsl, work = (packed[o : o + n] for o, n in zip(offsets, lengths))
            tokens = tokens.view(3, size)
            tokens[2], work[:] = -1, -1  # (what capture runs over: nothing stored, no prefill work)
            self.inputs[size] = (packed, tokens, ctx, qsl, work)

    def num_seqs(self, tokens: int) -> int:
        """Sequences the graph of this token count serves (each has at least one token)."""
        return min(tokens, self.max_num_seqs)

    @staticmethod
    def work_capacity(tokens: int) -> int:
        """Prefill attention work items (blocks of BLOCK_M queries of sequences with several) the
        graph of this token count serves: any step with at most MAX_GRAPH_PREFILLS such sequences."""
        return prefill_work_capacity(tokens, MAX_GRAPH_PREFILLS)

    def padding(self, num_tokens: int, num_seqs: int, work_items: int = 0) -> MixedPadding | None:
        """The shape of the smallest graph that serves a step of this size (None: none does)."""
        size = next(
            (
                s
                for s in self.sizes
                if s >= num_tokens and self.num_seqs(s) >= num_seqs and self.work_capacity(s) >= work_items
            ),
            None,
        )
        return None if size is None else MixedPadding(size, self.num_seqs(size), self.work_capacity(size))

    def layout(self, size: int) -> tuple[int, int, int, int]:
        """The lengths of the arrays packed in the buffer of token count `size`, in order: tokens
        [3, size] (input ids, positions, slots), context lens, query_start_loc, prefill work."""
        return 3 * size, self.num_seqs(size), self.num_seqs(size) + 1, self.work_capacity(size)

    def keys(self) -> list[tuple[int, bool]]:
        return [(size, decodes) for size in reversed(self.sizes) for decodes in (True, False)]

    def args(self, key: tuple[int, bool]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        size, decodes = key
        _, (ids, positions, slots), ctx, qsl, work = self.inputs[size]
        meta = AttentionMetadata(
            slots,
            self.block_tables[: self.num_seqs(size)],
            ctx,
            qsl,
            max_query_len=size,
            max_context_len=self.max_model_len,
            any_single_query=decodes,
            prefill_work=work,
        )
        return ids, positions, meta

    def fill(self, inputs: ModelInputs) -> tuple[int, bool]:
        """A step padded to T tokens and num_seqs(T) sequences; returns its key (T, whether some
        sequence decodes)."""
        size = inputs.input_ids.shape[0]
        assert inputs.meta.block_tables.shape[0] == self.num_seqs(size), (inputs.meta.block_tables.shape, size)
        packed = self.inputs[size][0]
        packed.copy_(inputs.graph_inputs[: packed.numel()])
        self._fill_tables(inputs.meta.block_tables)
        return size, inputs.meta.any_single_query
