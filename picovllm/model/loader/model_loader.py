"""Resolve a model name or path to a config and a weights directory, and load it straight into
the target dtype and device."""

from __future__ import annotations

import glob
import json
import os

import torch
from safetensors import safe_open
from torch import nn

from picovllm.config import ModelConfig
from picovllm.model.layers.linear import default_weight_loader
from picovllm.model.loader.builtin import BUILTIN_MODELS, DEFAULT_MODEL, DUMMY_CONFIGS, ensure_builtin, ensure_gguf
from picovllm.model.registry import MODEL_REGISTRY


def resolve_model(model: str | None) -> tuple[ModelConfig, str | None]:
    """Return (config, directory) for a path, a .gguf file, a built-in name or 'dummy:SHAPE'.
    The directory is None for dummy models (random weights, no tokenizer)."""
    model = model or DEFAULT_MODEL
    if model.startswith("dummy:"):
        shape = model.removeprefix("dummy:")
        if shape not in DUMMY_CONFIGS:
            raise ValueError(f"unknown dummy model shape {shape!r}; known: {', '.join(DUMMY_CONFIGS)}")
        return ModelConfig.from_dict(DUMMY_CONFIGS[shape]), None
    if model in BUILTIN_MODELS:
        path = ensure_builtin(model)
    elif os.path.isfile(model) and model.endswith(".gguf"):
        path = ensure_gguf(model)
    elif os.path.isdir(model):
        path = model
        ggufs = glob.glob(os.path.join(path, "*.gguf"))
        if not os.path.isfile(os.path.join(path, "config.json")) and len(ggufs) == 1:
            path = ensure_gguf(ggufs[0])
    else:
        raise ValueError(
            f"model {model!r} not found: it is not a local directory, a .gguf file, a built-in model "
            f"({', '.join(BUILTIN_MODELS)}) or dummy:SHAPE ({', '.join(DUMMY_CONFIGS)}). "
            "Pico-vLLM never downloads from a model hub."
        )
    cfg = ModelConfig.from_dir(path)
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            eos = json.load(f).get("eos_token_id")
        if eos is not None:
            eos_ids = set(eos if isinstance(eos, list) else [eos]) | set(cfg.eos_token_ids)
            cfg = ModelConfig.from_dict({**cfg.hf_config, "eos_token_id": sorted(eos_ids)})
    return cfg, path


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


def load_weights(model: nn.Module, path: str) -> None:
    """Copy every checkpoint tensor into its (possibly fused) parameter; fail on anything missing,
    unexpected or of the wrong shape."""
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules_mapping", {})
    loaded: set[str] = set()
    device = next(model.parameters()).device
    for file in _weight_files(path):
        with safe_open(file, framework="pt", device=str(device)) as f:
            for name in f.keys():
                if "rotary_emb.inv_freq" in name:
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
                tensor = f.get_tensor(name).to(param.dtype)
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
            f"weights missing from the checkpoint in {path!r}: {', '.join(missing[:8])}"
            + (" ..." if len(missing) > 8 else "")
        )


def _random_init(model: nn.Module, seed: int) -> None:
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        else:
            p.data.normal_(0.0, 0.02, generator=gen)


def load_model(
    cfg: ModelConfig, path: str | None, dtype: torch.dtype, device: torch.device, max_position: int, seed: int = 0
) -> nn.Module:
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = MODEL_REGISTRY[cfg.architecture](cfg, max_position)
    finally:
        torch.set_default_dtype(default_dtype)
    if path is None:
        _random_init(model, seed)
    else:
        load_weights(model, path)
    return model.eval()
