"""Engine and model configuration (dataclasses); user-facing options are validated here."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

import torch

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192

logger = logging.getLogger("picovllm")

SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "LlamaForCausalLM")

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the model needs, read from a Hugging Face config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on the Q, K and V projections
    o_proj_bias: bool  # bias on the output projection (Llama's attention_bias; never in Qwen2)
    rope_scaling: dict | None = None
    torch_dtype: str = "bfloat16"
    eos_token_ids: tuple[int, ...] = ()
    hf_config: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, cfg: dict) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported model architecture {archs or cfg.get('model_type')!r}; "
                f"Pico-vLLM supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None:  # transformers 5 moves rope settings into rope_parameters
            rope_params = cfg.get("rope_parameters") or {}
            rope_theta = rope_params.get("rope_theta", 10000.0)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        if cfg.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")
        dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            o_proj_bias=arch == "LlamaForCausalLM" and bool(cfg.get("attention_bias", False)),
            rope_scaling=rope_scaling,
            torch_dtype=str(dtype).replace("torch.", ""),
            eos_token_ids=eos_ids,
            hf_config=cfg,
        )

    @classmethod
    def from_dir(cls, path: str) -> ModelConfig:
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"{path!r} has no config.json: not a Hugging Face model directory")
        with open(cfg_path) as f:
            return cls.from_dict(json.load(f))


def resolve_dtype(dtype: str | torch.dtype, model_dtype: str) -> torch.dtype:
    """'auto' takes the checkpoint's dtype (fp32 checkpoints stay fp32)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use float32, float16 or bfloat16")
        return dtype
    name = model_dtype if dtype == "auto" else dtype
    if name not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use auto, float32, float16 or bfloat16")
    return _DTYPES[name]


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is not supported; use auto, cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but no CUDA GPU is available")
    return dev


@dataclass
class EngineConfig:
    """Everything the engine needs besides the model weights. Names follow vLLM's EngineArgs."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    block_size: int = 16
    max_num_seqs: int = 256
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = (
        None  # bytes for the KV pool; set, it overrides gpu_memory_utilization (default on CPU: 2 GiB)
    )
    num_gpu_blocks_override: int | None = None
    load_format: str = "auto"  # 'auto' or 'dummy' (random weights, for benchmarks)
    skip_tokenizer_init: bool = False
    enable_prefix_caching: bool = True
    # Prompts longer than what a step's token budget has left are prefilled over several steps,
    # mixed with the decodes of running requests (vLLM's default).
    enable_chunked_prefill: bool = True
    # CUDA graphs for decode are captured at start-up (GPU only) unless this is set, as in vLLM.
    enforce_eager: bool = False
    # Steps with prompt tokens of up to this many tokens replay CUDA graphs too (token counts 16,
    # 32, ... up to it, like vLLM's capture sizes up to 512); 0: they run eagerly
    # (worker/cuda_graph.py).
    mixed_graph_tokens: int = 512
    # Launch each step before the previous one's tokens are read (on the device), so the
    # host's work overlaps the GPU's (vLLM's --async-scheduling); outputs are the same.
    async_scheduling: bool = True
    # Ranks the model is split over (Megatron: attention heads and MLP columns; one all-reduce
    # after each), each a process on its own GPU (or CPU); rank 0 is the engine's process.
    tensor_parallel_size: int = 1
    # Disaggregated prefill (engine/kv_handoff.py): "prefill" computes prompts and holds their KV
    # blocks for a decode instance to pull; "decode" pulls a prompt's KV before decoding it; "both"
    # does everything itself. kv_transfer_mode: "async" overlaps transfers with other work, "sync"
    # admits nothing new while one is pending. A prefill instance frees blocks nobody pulled or
    # renewed for kv_lease_s seconds; a decode instance gives up on a pull (and prefills the
    # prompt itself) after kv_pull_timeout_s.
    kv_role: str = "both"
    kv_transfer_mode: str = "async"
    kv_lease_s: float = 30.0
    kv_pull_timeout_s: float = 10.0
    # "auto": a decode instance copies through CUDA IPC from a prefill instance whose pool is on a
    # GPU of the same machine, else over NIXL; "nixl": always over NIXL
    kv_transfer_backend: str = "auto"
    # Bytes of host memory (per rank) for a second tier of the KV cache (engine/prefix_cache.py):
    # blocks the prefix cache evicts from the GPU are demoted there and promoted back on a hit;
    # 0: off. preemption_mode "swap" (vLLM's) moves a preempted request's blocks there and back
    # instead of recomputing them ("recompute", the default).
    kv_offload_memory: int = 0
    preemption_mode: str = "recompute"

    def validate(self) -> None:
        def need(cond: bool, name: str, msg: str) -> None:
            if not cond:
                raise ValueError(f"{name} {msg}, got {getattr(self, name)!r}")

        need(isinstance(self.block_size, int) and self.block_size >= 1, "block_size", "must be an integer >= 1")
        need(isinstance(self.max_num_seqs, int) and self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        need(self.max_model_len is None or self.max_model_len >= 1, "max_model_len", "must be >= 1")
        need(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "must be in (0, 1]")
        need(self.kv_cache_memory is None or self.kv_cache_memory > 0, "kv_cache_memory", "must be > 0")
        need(
            self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 1,
            "num_gpu_blocks_override",
            "must be >= 1",
        )
        need(isinstance(self.async_scheduling, bool), "async_scheduling", "must be True or False")
        need(
            isinstance(self.mixed_graph_tokens, int) and 0 <= self.mixed_graph_tokens <= 8192,
            "mixed_graph_tokens",
            "must be an integer in [0, 8192]",
        )
        need(self.load_format in ("auto", "dummy"), "load_format", "must be 'auto' or 'dummy'")
        need(
            isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
            "tensor_parallel_size",
            "must be an integer >= 1",
        )
        need(self.kv_role in ("prefill", "decode", "both"), "kv_role", "must be 'prefill', 'decode' or 'both'")
        need(self.kv_transfer_mode in ("async", "sync"), "kv_transfer_mode", "must be 'async' or 'sync'")
        need(self.kv_lease_s > 0, "kv_lease_s", "must be > 0")
        need(self.kv_pull_timeout_s > 0, "kv_pull_timeout_s", "must be > 0")
        need(self.kv_transfer_backend in ("auto", "nixl"), "kv_transfer_backend", "must be 'auto' or 'nixl'")
        need(
            isinstance(self.kv_offload_memory, int) and self.kv_offload_memory >= 0, "kv_offload_memory", "must be >= 0"
        )
        need(self.preemption_mode in ("recompute", "swap"), "preemption_mode", "must be 'recompute' or 'swap'")
        need(
            self.preemption_mode == "recompute" or self.kv_offload_memory > 0,
            "preemption_mode",
            "'swap' needs host memory to swap to (kv_offload_memory > 0)",
        )
        need(
            self.kv_offload_memory == 0 or self.kv_role == "both",
            "kv_offload_memory",
            "is not supported on a prefill or decode instance (kv_role 'both' only)",
        )


def resolve_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    """The context limit before the KV cache is sized: max_model_len, else the model's."""
    max_position = model_config.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > max_position:
        raise ValueError(
            f"max_model_len {config.max_model_len} exceeds the model's max_position_embeddings {max_position}"
        )
    return config.max_model_len or max_position


def resolve_limits(config: EngineConfig, max_model_len: int, kv_capacity: int) -> tuple[int, int]:
    """(max_model_len, max_num_batched_tokens) once the KV cache holds kv_capacity tokens: a
    max_model_len left to its default is lowered to what the cache holds (one asked for that
    does not fit is an error); the step budget defaults to 8192 (at least max_num_seqs, and
    without chunked prefill at least max_model_len, since a prompt must then fit one step)."""
    if max_model_len > kv_capacity:
        if config.max_model_len is not None:
            raise ValueError(
                f"max_model_len {max_model_len} needs more KV cache than the pool holds "
                f"({kv_capacity} tokens); lower max_model_len or give the KV cache more memory"
            )
        logger.warning("max_model_len lowered from %d to %d, what the KV cache holds", max_model_len, kv_capacity)
        max_model_len = kv_capacity
    default_budget = DEFAULT_MAX_NUM_BATCHED_TOKENS
    if not config.enable_chunked_prefill:
        default_budget = max(default_budget, max_model_len)
    budget = config.max_num_batched_tokens or max(default_budget, config.max_num_seqs)
    if not config.enable_chunked_prefill and budget < max_model_len:
        raise ValueError(
            f"max_num_batched_tokens ({budget}) must be >= max_model_len "
            f"({max_model_len}) without chunked prefill: prompts are prefilled in one step"
        )
    if budget < config.max_num_seqs:
        raise ValueError(
            f"max_num_batched_tokens ({budget}) must be >= max_num_seqs "
            f"({config.max_num_seqs}): every running request decodes a token per step"
        )
    return max_model_len, budget


def check_tp_heads(num_heads: int, num_kv_heads: int, tp_size: int) -> None:
    """tp_size must divide the query heads, and it and the KV heads must divide one into the other."""
    if num_heads % tp_size:
        raise ValueError(f"tensor_parallel_size {tp_size} does not divide the model's {num_heads} attention heads")
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size {tp_size} and the model's {num_kv_heads} KV heads must divide one into the other"
        )
