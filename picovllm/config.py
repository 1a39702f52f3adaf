"""Engine and model configuration (dataclasses); user-facing options are validated here."""

from __future__ import annotations

import functools
import json
import logging
import os
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Literal

import torch

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048

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
    quantization: str | None = None  # the checkpoint's: "fp8" (its linear weights in e4m3 with their scales)
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
        quant = cfg.get("quantization_config")
        if quant is not None:
            if quant.get("quant_method") != "fp8":
                raise ValueError(
                    f"quantization_config.quant_method {quant.get('quant_method')!r} is not supported (supported: fp8)"
                )
            if quant.get("weight_block_size"):
                raise ValueError("block-wise FP8 (quantization_config.weight_block_size) is not supported")
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
            quantization="fp8" if quant is not None else None,
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


def kv_cache_torch_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The KV pool's element type: the model's dtype ('auto'), or float8 e4m3 ('fp8', 'fp8_e4m3')."""
    return torch.float8_e4m3fn if kv_cache_dtype.startswith("fp8") else dtype


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


KVRole = Literal["prefill", "decode", "both"]  # disaggregated prefill (engine/kv_handoff.py)
KVTransferMode = Literal["async", "sync"]
KVTransferBackend = Literal["auto", "nixl"]
PreemptionMode = Literal["recompute", "swap"]
Quantization = Literal["fp8"]
KVCacheDtype = Literal["auto", "fp8", "fp8_e4m3"]
LoadFormat = Literal["auto", "dummy"]


@dataclass(frozen=True)
class Bounds:
    """A number's range: [low, high], or (low, high] with low_open."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False

    def admits(self, value: float) -> bool:
        below = self.low is not None and (value <= self.low if self.low_open else value < self.low)
        return not below and (self.high is None or value <= self.high)

    def __str__(self) -> str:
        if self.high is None:
            return f"must be {'>' if self.low_open else '>='} {self.low}"
        return f"must be in {'(' if self.low_open else '['}{self.low}, {self.high}]"


def option(
    default, help: str | None = None, *, bounds: Bounds | None = None, check=None, flags: tuple = (), scope="engine"
):
    """An EngineConfig field, declared with everything its checks and its command-line flag need:
    help (None: not on the command line), bounds (a number's), check (value -> what is wrong with
    it, or None), flags (default: --the-name), scope ("engine": every command's; "serve": the
    server's alone). entrypoints/args.py builds the parser from these (so a value is refused as
    the command line is parsed), docs/options.md is made from them, EngineConfig.validate checks them."""
    metadata = {"help": help, "bounds": bounds, "check": check, "flags": flags, "scope": scope}
    return field(default=default, metadata=metadata)


def _dtype_problem(value) -> str | None:
    if isinstance(value, torch.dtype) and value in _DTYPES.values() or value == "auto" or value in _DTYPES:
        return None
    return "must be auto, bfloat16, float16 or float32 (or bf16, fp16, half, fp32, float)"


def _device_problem(value) -> str | None:
    if str(value) == "auto":
        return None
    try:
        if torch.device(value).type in ("cpu", "cuda"):
            return None
    except (RuntimeError, TypeError):
        pass
    return "must be auto, cpu or cuda (cuda:N for one GPU)"


def _generation_config_problem(value) -> str | None:
    if value in ("auto", "vllm") or os.path.isfile(os.path.join(str(value), "generation_config.json")):
        return None
    return "must be auto, vllm or a directory with a generation_config.json"


@dataclass
class EngineConfig:
    """Everything the engine needs besides the model weights. Names follow vLLM's EngineArgs;
    each field's option() is its one declaration (type, range, help, flag)."""

    model: str | None = option(
        None,
        "a local Hugging Face directory, a .gguf file, a built-in model name (see `picovllm models`) or "
        "dummy:SHAPE for random weights (default: qwen2.5-coder-0.5b-instruct)",
        flags=("--model", "-m"),
    )
    tokenizer: str | None = option(
        None, "a directory to load the tokenizer from (default: the model's; a dummy model has none unless given)"
    )
    generation_config: str = option(
        "auto",
        "requests' default sampling settings: auto, those of the model's generation_config.json (temperature, "
        "top_p, top_k, min_p, repetition_penalty; its max_new_tokens is the default max_tokens, and the server's "
        "bound on every request's), as vLLM's; vllm: none, SamplingParams' own; or a directory with a "
        "generation_config.json",
        check=_generation_config_problem,
    )
    dtype: str = option("auto", "auto, bfloat16, float16 or float32 (auto: the checkpoint's)", check=_dtype_problem)
    device: str = option("auto", "auto, cpu or cuda (auto: cuda when available)", check=_device_problem)
    quantization: Quantization | None = option(
        None,
        "fp8: the linear layers' weights quantized at load to float8 e4m3 with a scale per output channel, "
        "their inputs per token as they run (vLLM's W8A8 with dynamic scales; embeddings, norms and the LM head "
        "stay in --dtype); a GPU needs compute capability 8.9 or later",
    )
    kv_cache_dtype: KVCacheDtype = option(
        "auto",
        "auto: the KV cache in --dtype; fp8 (fp8_e4m3): in float8 e4m3, scaled by the checkpoint's k_scale and "
        "v_scale or 1.0 (vLLM's default), twice the tokens in the same memory; a GPU needs compute capability 8.9 "
        "or later",
    )
    seed: int = option(0)  # (the command line's is the sampling option --seed)
    block_size: int = option(16, "tokens per KV-cache block", bounds=Bounds(1))
    max_num_seqs: int = option(256, "most requests in a batch", bounds=Bounds(1))
    max_model_len: int | None = option(
        None, "longest prompt + output, in tokens (default: the model's, or what the KV cache holds)", bounds=Bounds(1)
    )
    max_num_batched_tokens: int | None = option(
        None,
        f"token budget of a step, decodes and prefill chunks together (default {DEFAULT_MAX_NUM_BATCHED_TOKENS})",
        bounds=Bounds(1),
    )
    gpu_memory_utilization: float = option(
        0.9,
        "this instance's fraction of GPU memory, for weights, activations and KV cache (instances sharing a "
        "GPU: fractions that add up to at most 1)",
        bounds=Bounds(0, 1, low_open=True),
    )
    kv_cache_memory: int | None = option(
        None, "bytes of KV cache; overrides --gpu-memory-utilization (default on CPU: 2 GiB)", bounds=Bounds(1)
    )
    num_gpu_blocks_override: int | None = option(None, bounds=Bounds(1))
    load_format: LoadFormat = option("auto")  # 'dummy': random weights, for benchmarks
    skip_tokenizer_init: bool = option(False)
    enable_prefix_caching: bool = option(
        True, "reuse the KV of prompts' shared prefixes (--no-prefix-caching: off)", flags=("--no-prefix-caching",)
    )
    enable_chunked_prefill: bool = option(
        True, "prefill long prompts over several steps, mixed with the decodes of running requests"
    )
    enforce_eager: bool = option(
        False, "run every step eagerly instead of replaying CUDA graphs captured at start-up (GPU only)"
    )
    mixed_graph_tokens: int = option(
        DEFAULT_MAX_NUM_BATCHED_TOKENS,
        "replay steps with prompt tokens of up to this many tokens from CUDA graphs too (token counts 16, 32, "
        "48, ..., 1024, 1280, ...: a quarter of each octave apart, 16 at least; 0: they run eagerly)",
        bounds=Bounds(0, 8192),
    )
    async_scheduling: bool = option(
        True,
        "launch each step before the previous one's tokens are read (on the device), so the host's work "
        "overlaps the GPU's; outputs are the same",
    )
    tensor_parallel_size: int = option(
        1,
        "split the model over this many GPUs (or CPU processes), one process each; rank 0 is the engine's",
        bounds=Bounds(1),
        flags=("--tensor-parallel-size", "-tp"),
    )
    kv_role: KVRole = option(
        "both",
        "disaggregated serving (behind `picovllm router`): prefill computes prompts and holds their KV for a "
        "decode instance to pull; decode pulls it and generates; both does everything",
        flags=("--role",),
        scope="serve",
    )
    kv_transfer_mode: KVTransferMode = option(
        "async",
        "async: transfers overlap other work; sync: nothing new is admitted while one is pending",
        scope="serve",
    )
    kv_lease_s: float = option(
        30.0,
        "a prefill instance frees KV blocks that no decode instance pulled or renewed for this many seconds",
        bounds=Bounds(0, low_open=True),
        scope="serve",
    )
    kv_pull_timeout_s: float = option(
        10.0,
        "a decode instance gives up on a KV pull after this many seconds and prefills the prompt itself",
        bounds=Bounds(0, low_open=True),
        scope="serve",
    )
    kv_transfer_backend: KVTransferBackend = option(
        "auto",
        "auto: a decode instance copies through CUDA IPC from a prefill instance on a GPU of the same machine, "
        "else over NIXL; nixl: always over NIXL",
        scope="serve",
    )
    kv_offload_memory: int = option(
        0,
        "bytes of host memory (per rank) for a second tier of the KV cache: the prefix cache demotes what it "
        "evicts from the GPU there and promotes it back on a hit (0: off)",
        bounds=Bounds(0),
    )
    preemption_mode: PreemptionMode = option(
        "recompute",
        "a preempted request's KV: recomputed when it resumes, or swapped to the host tier and back (needs "
        "--kv-offload-memory)",
    )

    def validate(self) -> None:
        """Each field against its type and bounds, then the options that depend on each other."""
        for f in fields(self):
            problem = field_problem(f, getattr(self, f.name))
            if problem is not None:
                raise ValueError(f"{f.name} {problem}, got {getattr(self, f.name)!r}")

        def need(cond: bool, name: str, msg: str) -> None:
            if not cond:
                raise ValueError(f"{name} {msg}, got {getattr(self, name)!r}")

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


def field_type(f) -> tuple[object, bool]:
    """(an EngineConfig field's type, whether None is allowed): int, float, bool, str, or a Literal."""
    hint = _hints()[f.name]
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Union or isinstance(hint, types.UnionType):
        return next(a for a in args if a is not type(None)), type(None) in args
    return hint, False


@functools.cache
def _hints() -> dict:
    return typing.get_type_hints(EngineConfig)


def choices(kind) -> tuple | None:
    """A Literal's values (None for other types)."""
    return typing.get_args(kind) if typing.get_origin(kind) is Literal else None


def field_problem(f, value) -> str | None:
    """What is wrong with value for EngineConfig field f ("must be ..."), or None."""
    kind, optional = field_type(f)
    if value is None:
        return None if optional else "must be set"
    if (values := choices(kind)) is not None:
        names = [repr(v) for v in values]
        said = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
        return None if value in values else f"must be {said}"
    if kind is bool:
        return None if isinstance(value, bool) else "must be True or False"
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        return "must be an integer"
    if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
        return "must be a number"
    if (check := f.metadata.get("check")) is not None:
        return check(value)
    if kind is str and not isinstance(value, str):
        return "must be a string"
    bounds = f.metadata.get("bounds")
    return None if bounds is None or bounds.admits(value) else str(bounds)


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
    does not fit is an error); the step budget defaults to 2048 (at least max_num_seqs, and
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
