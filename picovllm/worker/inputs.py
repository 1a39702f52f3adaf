"""A step's inputs: from plain per-sequence data (StepInputs) to the model's tensors (ModelInputs),
uploaded to the device in one copy. One builder per kind of step:

    build_decode        one token per sequence, every one sampled: the [4, B] rows a decode CUDA
                        graph copies in one go (padded to its batch size), or run eagerly
    build_mixed_graph   a step with prompt tokens replayed from a mixed-step CUDA graph: padded to
                        the graph's token count and packed in the order of the graph's buffer
                        (MixedGraphs.layout), so that the graph fills it with one copy
    build_eager         a step with prompt tokens run eagerly

Slot mappings are built with vectorised numpy ops (a loop over sequences, never over tokens); the
block tables' array is kept from step to step and updated where the tables grew (BlockTables).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from picovllm.messages import StepInputs
from picovllm.model.layers.attention import AttentionMetadata, prefill_work_list

PACK_ALIGN = 16  # elements: a step's arrays are packed for upload with each starting 128-byte aligned,
# so that Triton compiles one variant of each kernel (it specialises on pointer alignment)


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor | None  # rows of the hidden states that are sampled (None: all)
    graph_inputs: torch.Tensor | None = None  # what a CUDA graph copies into its buffer in one go


class MixedPadding(NamedTuple):
    """A mixed-step graph's shape: tokens, sequences and prefill work items it serves."""

    tokens: int
    seqs: int
    work_items: int


def packed_layout(sizes) -> tuple[list[int], int]:
    """Where arrays of these sizes (elements) start when packed one after another, PACK_ALIGN
    aligned, and the packed length."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // PACK_ALIGN) * PACK_ALIGN
    return offsets, total


class Uploader:
    """Moves a step's int64 arrays to the device in one copy: they are packed (packed_layout) into
    a pinned host buffer and copied with non_blocking; the tensors returned are views of one
    device buffer, and packed=True adds the whole packed buffer. On a CPU the arrays are used as
    they are, packed only if asked.
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
        for a, offset in zip(arrays, offsets, strict=True):
            staged[offset : offset + a.size] = a.ravel()
        if self.device.type == "cuda":
            dev[:total].copy_(host[:total], non_blocking=True)
            slot[2] = torch.cuda.Event()
            slot[2].record()
        return [dev[offset : offset + a.size].view(a.shape) for a, offset in zip(arrays, offsets, strict=True)] + (
            [dev[:total]] if packed else []
        )


class _Tokens(NamedTuple):
    """The per-token arrays of a step and its block tables (rows: sequences, padding included)."""

    input_ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    tables: np.ndarray
    query_start_loc: np.ndarray
    logits_indices: np.ndarray


class BlockTables:
    """A step's block tables as one [rows, width] array (rows: the step's padded sequences; padding
    rows and the ends of short tables: block 0), kept from step to step: when the step's tables
    continue the last step's (StepInputs.tables_continue: the same rows, each table the same or
    grown), only what the grown ones added is written, not every table. The array is this
    object's until the next call."""

    def __init__(self):
        self.array = np.zeros((0, 1), dtype=np.int64)
        self.lens = np.zeros(0, dtype=np.int64)  # each row's table length in the array

    def __call__(self, step: StepInputs, rows: int) -> np.ndarray:
        tables = step.block_tables
        lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
        width = max(1, int(lens.max()))
        same = step.tables_continue and self.array.shape[0] == rows and len(self.lens) == len(tables)
        if not same:
            self.array = np.zeros((rows, width), dtype=np.int64)
            for b, table in enumerate(tables):
                self.array[b, : len(table)] = table
        else:
            if width > self.array.shape[1]:
                self.array = np.pad(self.array, ((0, 0), (0, width - self.array.shape[1])))
            for b in np.flatnonzero(lens != self.lens).tolist():
                self.array[b, self.lens[b] : lens[b]] = tables[b][self.lens[b] :]
        self.lens = lens
        return self.array


def _tokens(step: StepInputs, block_size: int, rows: int, block_tables: BlockTables | None = None) -> _Tokens:
    num_seqs = step.num_seqs
    tables = (block_tables or BlockTables())(step, rows)
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(step.query_lens, out=query_start_loc[1:])
    total = int(query_start_loc[-1])
    seq_of_token = np.repeat(np.arange(num_seqs), step.query_lens)
    positions = np.arange(total) - query_start_loc[seq_of_token] + (step.context_lens - step.query_lens)[seq_of_token]
    slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    input_ids = np.fromiter((t for ids in step.token_ids for t in ids), dtype=np.int64, count=total)
    logits_indices = (query_start_loc[1:] - 1)[step.sample]
    return _Tokens(input_ids, positions, slots, tables, query_start_loc, logits_indices)


def _meta(step: StepInputs, slots, tables, context_lens, query_start_loc, work=None) -> AttentionMetadata:
    """The step's attention metadata; work: the prefill kernel's (prefill_work_list)."""
    return AttentionMetadata(
        slot_mapping=slots,
        block_tables=tables,
        context_lens=context_lens,
        query_start_loc=query_start_loc,
        max_query_len=int(step.query_lens.max()),
        max_context_len=int(step.context_lens.max()),
        any_single_query=bool((step.query_lens == 1).any()),
        prefill_work=work,
    )


def build_decode(
    step: StepInputs,
    block_size: int,
    upload: Uploader,
    batch_size: int | None = None,
    tables: BlockTables | None = None,
) -> ModelInputs:
    """A decode step, padded to batch_size when given (a decode graph's; padding rows: token 0 at
    position 0, slot -1 so nothing is stored, a one-token context over block 0). graph_inputs is
    DecodeGraphs' [4, B] layout: input ids, positions, slots, context lens."""
    rows = batch_size or step.num_seqs
    t = _tokens(step, block_size, rows, tables)
    vectors = np.zeros((4, rows), dtype=np.int64)
    vectors[2], vectors[3] = -1, 1
    vectors[:, : step.num_seqs] = t.input_ids, t.positions, t.slots, step.context_lens
    graph_inputs, tables, qsl = upload(vectors, t.tables, np.arange(rows + 1, dtype=np.int64))
    input_ids, positions, slots, context_lens = graph_inputs
    return ModelInputs(input_ids, positions, _meta(step, slots, tables, context_lens, qsl), None, graph_inputs)


def build_mixed_graph(
    step: StepInputs, block_size: int, upload: Uploader, pad: MixedPadding, tables: BlockTables | None = None
) -> ModelInputs:
    """A step with prompt tokens for a mixed-step graph of this padding: tokens [3, T] (input ids,
    positions, slots; padding tokens have slot -1 and belong to no sequence), context lens [S] and
    query_start_loc [S + 1] (padding sequences: no tokens, no context), the prefill work list [W]
    (padding items: -1), packed in that order (MixedGraphs.layout) as graph_inputs; the block
    tables and the sampled rows after them."""
    assert pad.tokens >= step.num_tokens and pad.seqs >= step.num_seqs, (pad, step.num_tokens, step.num_seqs)
    t = _tokens(step, block_size, pad.seqs, tables)
    total = step.num_tokens
    tokens = np.zeros((3, pad.tokens), dtype=np.int64)
    tokens[2] = -1
    tokens[:, :total] = t.input_ids, t.positions, t.slots
    context_lens = np.zeros(pad.seqs, dtype=np.int64)
    context_lens[: step.num_seqs] = step.context_lens
    qsl = np.full(pad.seqs + 1, total, dtype=np.int64)
    qsl[: step.num_seqs + 1] = t.query_start_loc
    work = prefill_work_list(step.query_lens, capacity=pad.work_items)
    token_rows, ctx, qsl, work, tables, logits, graph_inputs = upload(
        tokens, context_lens, qsl, work, t.tables, t.logits_indices, packed=True
    )
    input_ids, positions, slots = token_rows
    return ModelInputs(input_ids, positions, _meta(step, slots, tables, ctx, qsl, work), logits, graph_inputs)


def build_eager(step: StepInputs, block_size: int, upload: Uploader, tables: BlockTables | None = None) -> ModelInputs:
    """A step with prompt tokens, run eagerly: nothing padded."""
    t = _tokens(step, block_size, step.num_seqs, tables)
    work = prefill_work_list(step.query_lens)
    input_ids, positions, slots, ctx, tables, qsl, logits, work = upload(
        t.input_ids,
        t.positions,
        t.slots,
        step.context_lens.astype(np.int64),
        t.tables,
        t.query_start_loc,
        t.logits_indices,
        work,
    )
    return ModelInputs(input_ids, positions, _meta(step, slots, tables, ctx, qsl, work), logits)
