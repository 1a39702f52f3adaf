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
from picovllm.engine.cuda_graph import DecodeGraphs
from picovllm.engine.request import Request
from picovllm.engine.sampler import Sampler, SamplerOutput, SamplingTensors
from picovllm.model.layers.attention import AttentionMetadata
from picovllm.model.loader.model_loader import load_model

DEFAULT_CPU_KV_CACHE_MEMORY = 2 << 30


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the hidden states that are sampled


def build_inputs(token_ids: list[list[int]], num_tokens: np.ndarray, query_lens: np.ndarray,
                 block_tables: list[list[int]], block_size: int, device: torch.device) -> ModelInputs:
    """Inputs for B sequences whose last query_lens[b] tokens (of num_tokens[b]) are computed.
    token_ids[b] holds those new tokens."""
    num_seqs = len(query_lens)
    width = max(1, max(len(t) for t in block_tables))
    tables = np.zeros((num_seqs, width), dtype=np.int64)
    for b, table in enumerate(block_tables):
        tables[b, : len(table)] = table
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    seq_of_token = np.repeat(np.arange(num_seqs), query_lens)
    positions = (np.arange(query_start_loc[-1]) - query_start_loc[seq_of_token]
                 + (num_tokens - query_lens)[seq_of_token])
    slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    input_ids = np.fromiter((t for ids in token_ids for t in ids), dtype=np.int64, count=int(query_start_loc[-1]))

    def dev(a: np.ndarray, dtype=torch.int64) -> torch.Tensor:
        t = torch.from_numpy(a).to(dtype)
        if device.type == "cuda":
            return t.pin_memory().to(device, non_blocking=True)
        return t

    return ModelInputs(
        input_ids=dev(input_ids),
        positions=dev(positions),
        meta=AttentionMetadata(slot_mapping=dev(slots), block_tables=dev(tables, torch.int32),
                               context_lens=dev(num_tokens.astype(np.int64)),
                               query_start_loc=dev(query_start_loc), max_query_len=int(query_lens.max()),
                               max_context_len=int(num_tokens.max())),
        logits_indices=dev(query_start_loc[1:] - 1),
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
        self.graphs: DecodeGraphs | None = None

    def kv_block_bytes(self) -> int:
        attn = self.model.attention_layers()[0]
        return BlockManager.bytes_per_block(self.block_size, len(self.model.attention_layers()),
                                            attn.num_kv_heads, attn.head_dim, self.dtype)

    def num_kv_blocks(self, engine_cfg: EngineConfig) -> int:
        """Blocks that fit the memory budget left after loading the model."""
        if engine_cfg.num_gpu_blocks_override is not None:
            return engine_cfg.num_gpu_blocks_override
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            # headroom for activations: a tenth of what is left, at least 1 GiB
            budget = total * engine_cfg.gpu_memory_utilization - (total - free)
            budget -= max(1 << 30, 0.1 * budget)
        else:
            budget = engine_cfg.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY
        blocks = int(budget // self.kv_block_bytes())
        if blocks < 1:
            raise ValueError("no memory left for the KV cache: lower the model size or raise "
                             "gpu_memory_utilization / kv_cache_memory")
        return blocks

    def bind_kv_cache(self, block_manager: BlockManager) -> None:
        for attn, (k, v) in zip(self.model.attention_layers(), block_manager.layer_caches()):
            attn.k_cache, attn.v_cache = k, v

    def capture_graphs(self, max_num_seqs: int, max_model_len: int) -> float:
        """Capture decode CUDA graphs (after the KV cache is bound: graphs keep its addresses)."""
        self.graphs = DecodeGraphs(self.model, max_num_seqs, max_model_len, self.block_size, self.device)
        return self.graphs.capture()

    def prepare(self, reqs: list[Request], is_prefill: bool) -> ModelInputs:
        num_tokens = np.array([r.num_tokens for r in reqs], dtype=np.int64)
        if is_prefill:  # the leading num_cached_tokens already have KV in cached blocks
            query_lens = num_tokens - np.array([r.num_cached_tokens for r in reqs], dtype=np.int64)
            token_ids = [r.token_ids[r.num_cached_tokens:] for r in reqs]
        else:
            query_lens, token_ids = np.ones_like(num_tokens), [r.token_ids[-1:] for r in reqs]
        return build_inputs(token_ids, num_tokens, query_lens, [r.block_table for r in reqs],
                            self.block_size, self.device)

    @torch.inference_mode()
    def logits(self, reqs: list[Request], is_prefill: bool) -> torch.Tensor:
        """The raw logits of the positions that are sampled, one row per request."""
        inputs = self.prepare(reqs, is_prefill)
        hidden = None
        if not is_prefill and self.graphs is not None:
            hidden = self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
        if hidden is None:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        return self.model.compute_logits(hidden[inputs.logits_indices])

    @torch.inference_mode()
    def run(self, reqs: list[Request], is_prefill: bool) -> SamplerOutput:
        # Sampling parameters go to the device before the forward is queued: a host-to-device
        # copy from pageable memory would otherwise wait for the whole forward to finish.
        tensors = SamplingTensors.from_requests(reqs, self.model_cfg.vocab_size, self.eos_ids, self.device)
        return self.sampler(self.logits(reqs, is_prefill), tensors)
