"""The Qwen2 / Qwen2.5 and Llama-architecture decoder, written from scratch.

One class serves both: Qwen2 has QKV bias, Llama (SmolLM2, Llama-3) none; heads may be tied to
the embedding or not. forward() takes tensors only and returns the residual stream after the
last layer; compute_logits() applies the final norm and the LM head to the positions that are
sampled. Each norm is handed to the projection that consumes it, and each sublayer adds its
output to the residual stream itself, so that at decode batch 1 on the GPU norm, projection,
activation and residual add are one kernel (model/layers/linear.py), and so are norm, QKV
projection, RoPE and the KV store (kernels/gemv.py).
"""

from __future__ import annotations

import torch
from torch import nn

from picovllm.config import ModelConfig
from picovllm.kernels import fp8_gemm
from picovllm.kernels.gemv import qkv_rope_store_triton
from picovllm.model.layers.attention import AttentionMetadata, PagedAttention
from picovllm.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from picovllm.model.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    one_row_gemm,
    one_row_on_gpu,
)
from picovllm.model.layers.norm import RMSNorm
from picovllm.model.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, bias=cfg.attention_bias
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.attn = PagedAttention(self.num_heads, cfg.head_dim, self.num_kv_heads, self.qkv_proj.first_kv_head)

    def forward(self, hidden: torch.Tensor, norm: RMSNorm, cos_sin: tuple, meta: AttentionMetadata) -> torch.Tensor:
        """hidden + attention(norm(hidden))"""
        if one_row_on_gpu(hidden):  # the projection, RoPE and the KV store in one kernel
            q = qkv_rope_store_triton(
                hidden, self.qkv_proj.weight, self.qkv_proj.bias, norm.weight, norm.eps, *cos_sin,
                self.attn.k_cache, self.attn.v_cache, meta.slot_mapping, self.num_heads, self.num_kv_heads,
                self.qkv_proj.weight_scale, *self.attn.kv_scales(),
            )  # fmt: skip
            return self.o_proj(self.attn.attend(q, meta).flatten(1), residual=hidden)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden, norm).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v, cos_sin, meta)
        return self.o_proj(out.flatten(1), residual=hidden)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, hidden: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """hidden + down(silu(gate(x)) * up(x)) with x = norm(hidden); FP8 from
        SILU_MUL_FUSED_MIN_ROWS rows, and at one row where gate_up takes the GEMM (a wide weight:
        model/layers/linear.py's one_row_gemm), takes SiLU*mul into the kernel that quantizes the down
        projection's input."""
        gate_up = self.gate_up_proj
        late = self.down_proj.weight_scale is not None and (
            hidden.shape[0] >= fp8_gemm.SILU_MUL_FUSED_MIN_ROWS
            or one_row_gemm(hidden, gate_up.weight, gate_up.weight_scale)
        )
        return self.down_proj(gate_up(hidden, norm, silu_mul=not late), residual=hidden, silu_mul_input=late)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, cos_sin: tuple, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.self_attn(hidden, self.input_layernorm, cos_sin, meta)
        return self.mlp(hidden, self.post_attention_layernorm)


class Model(nn.Module):
    def __init__(self, cfg: ModelConfig, max_position: int):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos_sin = self.rotary_emb(positions)
        meta = self.layers[0].self_attn.attn.prepare(meta)
        for layer in self.layers:
            hidden = layer(hidden, cos_sin, meta)
        return hidden


class Qwen2ForCausalLM(nn.Module):
    # checkpoint name -> (our fused parameter, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, max_position: int):
        super().__init__()
        self.config = cfg
        self.model = Model(cfg, max_position)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden, norm=self.model.norm)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]
