"""CUDA-graph bookkeeping that needs no GPU: the batch-size ladder and the padding of a decode
batch into the static buffers. (Capture and replay run in scripts/gpu_check.sh.)"""
import numpy as np
import torch

from picovllm.engine.cuda_graph import DecodeBuffers, graph_batch_sizes
from picovllm.engine.model_runner import build_inputs


def test_batch_size_ladder():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 32]
    assert graph_batch_sizes(256)[-3:] == [224, 240, 256]
    assert graph_batch_sizes(10_000)[-1] == 512


def test_padding_rows_are_inert():
    buf = DecodeBuffers.allocate(8, max_blocks=5, device=torch.device("cpu"))
    buf.slot_mapping.fill_(99), buf.context_lens.fill_(99), buf.block_tables.fill_(7)  # stale values
    inputs = build_inputs([[11], [12], [13]], np.array([5, 9, 17]), np.ones(3, dtype=np.int64),
                          [[3, 4], [1, 2, 6], [0, 5, 8, 9, 10]], 4, torch.device("cpu"))
    buf.fill(inputs.input_ids, inputs.positions, inputs.meta, padded=4)
    assert buf.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert buf.positions[:4].tolist() == [4, 8, 16, 0]
    assert buf.slot_mapping[:4].tolist() == [4 * 4 + 0, 6 * 4 + 0, 10 * 4 + 0, -1]
    assert buf.context_lens[:4].tolist() == [5, 9, 17, 1]
    assert buf.block_tables[3].tolist() == [0] * 5 and buf.block_tables[0, :2].tolist() == [3, 4]
    meta = buf.meta(4, max_context_len=64)
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4] and meta.max_query_len == 1
