"""CUDA-graph bookkeeping that needs no GPU: the batch-size ladder and the padding of a decode
batch into the static buffers. (Capture and replay run in scripts/gpu_check.sh.)"""
import numpy as np
import torch

from picovllm.engine.cuda_graph import DecodeBuffers, graph_batch_sizes
from picovllm.engine.model_runner import Uploader, build_inputs


def test_batch_size_ladder():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 32]
    assert graph_batch_sizes(256)[-3:] == [224, 240, 256]
    assert graph_batch_sizes(10_000)[-1] == 512


def test_padding_rows_are_inert():
    """A decode batch of 3 padded to 4 on the host, then copied over stale buffer contents."""
    buf = DecodeBuffers(8, max_blocks=5, device=torch.device("cpu"))
    buf.vectors.fill_(99), buf.block_tables.fill_(7)  # stale values
    inputs = build_inputs([[11], [12], [13]], np.array([5, 9, 17]), np.ones(3, dtype=np.int64),
                          [[3, 4], [1, 2, 6], [0, 5, 8, 9, 10]], 4, Uploader(torch.device("cpu")), pad_to=4)
    assert inputs.logits_indices is None and inputs.meta.max_query_len == 1
    assert buf.fill(inputs) == 4
    ids, positions, meta = buf.args(4, max_context_len=64)
    assert ids.tolist() == [11, 12, 13, 0]
    assert positions.tolist() == [4, 8, 16, 0]
    assert meta.slot_mapping.tolist() == [4 * 4 + 0, 6 * 4 + 0, 10 * 4 + 0, -1]
    assert meta.context_lens.tolist() == [5, 9, 17, 1]
    assert meta.block_tables[3].tolist() == [0] * 5 and meta.block_tables[0].tolist() == [3, 4, 0, 0, 0]
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4] and meta.max_query_len == 1
    assert buf.vectors[:, 4:].eq(99).all()  # rows past the batch are not touched


def test_prefill_inputs_sample_the_last_token_of_each_sequence():
    inputs = build_inputs([[5, 6, 7], [8]], np.array([3, 6]), np.array([3, 1]), [[2], [4, 1]], 4,
                          Uploader(torch.device("cpu")))
    assert inputs.positions.tolist() == [0, 1, 2, 5]
    assert inputs.meta.slot_mapping.tolist() == [8, 9, 10, 1 * 4 + 1]
    assert inputs.logits_indices.tolist() == [2, 3] and inputs.decode_rows is None
