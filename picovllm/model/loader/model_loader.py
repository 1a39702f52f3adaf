"""Load a model (its config and weights directory from model_source/) straight into the target
dtype and device: its checkpoint's tensors, or random ones of its shapes."""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import time
import zlib
from collections.abc import Iterable, Iterator

import torch
from safetensors import safe_open
from torch import nn

from picovllm.config import ModelConfig
from picovllm.model.layers.fp8 import fp8_parameters
from picovllm.model.layers.linear import default_weight_loader
from picovllm.model.registry import MODEL_REGISTRY

logger = logging.getLogger("picovllm")


def _weight_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, n) for n in names]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path!r}")
    return files


def _checkpoint_tensors(path: str, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    for file in _weight_files(path):
        with safe_open(file, framework="pt", device=str(device)) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def checkpoint_shapes(cfg: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The names and full (unsharded) shapes of a Hugging Face checkpoint of this architecture."""
    hidden, heads, kv_heads, head_dim = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    yield "model.embed_tokens.weight", (cfg.vocab_size, hidden)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for proj, rows in (
            ("q_proj", heads * head_dim),
            ("k_proj", kv_heads * head_dim),
            ("v_proj", kv_heads * head_dim),
        ):
            yield f"{p}self_attn.{proj}.weight", (rows, hidden)
            if cfg.attention_bias:
                yield f"{p}self_attn.{proj}.bias", (rows,)
        yield f"{p}self_attn.o_proj.weight", (hidden, heads * head_dim)
        if cfg.o_proj_bias:
            yield f"{p}self_attn.o_proj.bias", (hidden,)
        yield f"{p}mlp.gate_proj.weight", (cfg.intermediate_size, hidden)
        yield f"{p}mlp.up_proj.weight", (cfg.intermediate_size, hidden)
        yield f"{p}mlp.down_proj.weight", (hidden, cfg.intermediate_size)
        yield f"{p}input_layernorm.weight", (hidden,)
        yield f"{p}post_attention_layernorm.weight", (hidden,)
    yield "model.norm.weight", (hidden,)
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", (cfg.vocab_size, hidden)


def _dummy_tensors(cfg: ModelConfig, seed: int, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Random weights (load_format="dummy") as a full checkpoint, each tensor from its own seed, so
    that every tensor-parallel size loads the same model: norms 1, everything else N(0, 0.02)."""
    for name, shape in checkpoint_shapes(cfg):
        if name.endswith("norm.weight"):
            yield name, torch.ones(shape, device=device)
            continue
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        yield name, torch.empty(shape, device=device).normal_(0.0, 0.02, generator=gen)


def _tensor_digest(name: str, tensor: torch.Tensor) -> bytes:
    """A tensor's name, shape, dtype and 64 of its values spread over it."""
    flat = tensor.reshape(-1)
    n, k = flat.numel(), min(64, flat.numel())
    picks = torch.arange(k, device=flat.device) * (n - 1) // max(k - 1, 1)
    h = hashlib.sha256(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
    h.update(flat[picks].float().cpu().numpy().tobytes())
    return h.digest()


def load_weights(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
    """Copy every checkpoint tensor (each weight loader takes this rank's part) into its (possibly
    fused) parameter; fail on anything missing, unexpected or of the wrong shape. Sets
    model.weights_fingerprint: a digest of the whole checkpoint as loaded (every tensor, each in
    full before it is sharded: every tensor-parallel rank of any size gets the same one), which
    tells two instances of one model apart from instances of two (disaggregated serving's check)."""
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules_mapping", {})
    loaded: set[str] = set()
    digests: dict[str, bytes] = {}
    for name, tensor in tensors:
        if "rotary_emb.inv_freq" in name:
            continue
        if name.endswith(".input_scale") and model.config.quantization == "fp8":
            continue  # (an FP8 checkpoint's static activation scales: activations are quantized per token)
        if name.endswith((".self_attn.k_scale", ".self_attn.v_scale")):  # an FP8 KV cache's scales
            attention = model.get_submodule(name.rsplit(".", 1)[0] + ".attn")
            setattr(attention, name.rsplit(".", 1)[1], float(tensor.float().reshape(-1)[0]))
            digests[name] = _tensor_digest(name, tensor.float())
            continue
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue  # the tied head is the embedding
        target, shard = name, None
        for ckpt, (fused, shard_id) in packed.items():
            if f".{ckpt}." in name:
                target, shard = name.replace(ckpt, fused), shard_id
                break
        if target not in params:
            raise ValueError(f"checkpoint weight {name!r} has no place in the model")
        param = params[target]
        tensor = tensor.to(param.dtype)
        digests[name] = _tensor_digest(name, tensor)
        try:
            loader = getattr(param, "weight_loader", default_weight_loader)
            if shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        loaded.add(f"{target}:{shard}")
    shard_ids: dict[str, list] = {}
    for fused, shard_id in packed.values():
        shard_ids.setdefault(fused, []).append(shard_id)
    expected = set()
    for n in params:
        fused = next((f for f in shard_ids if f".{f}." in n), None)
        expected |= {f"{n}:{s}" for s in shard_ids.get(fused, [None])}
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(
            f"weights missing from the checkpoint in {source}: {', '.join(missing[:8])}"
            + (" ..." if len(missing) > 8 else "")
        )
    model.weights_fingerprint = hashlib.sha256(b"".join(digests[n] for n in sorted(digests))).hexdigest()[:16]


def load_model(
    cfg: ModelConfig, path: str | None, dtype: torch.dtype, device: torch.device, max_position: int, seed: int = 0
) -> nn.Module:
    start = time.perf_counter()
    source = "random weights" if path is None else path
    logger.info("loading %s (%s, %s) on %s", cfg.architecture, source, str(dtype).removeprefix("torch."), device)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = MODEL_REGISTRY[cfg.architecture](cfg, max_position)
    finally:
        torch.set_default_dtype(default_dtype)
    if cfg.quantization == "fp8":  # an FP8 checkpoint: its e4m3 weights and scales load as they are
        fp8_parameters(model)
    if path is None:
        load_weights(model, _dummy_tensors(cfg, seed, device), "dummy weights")
    else:
        load_weights(model, _checkpoint_tensors(path, device), repr(path))
    size = sum(t.numel() * t.element_size() for t in model.parameters())
    logger.info("weights loaded in %.1f s (%.2f GiB)", time.perf_counter() - start, size / (1 << 30))
    return model.eval()
