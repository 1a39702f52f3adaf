"""Convert a GGUF file (dequantized with the `gguf` package) into a Hugging Face directory:
config.json, model.safetensors (bf16), generation_config.json and tokenizer files. It takes tens
of seconds, once: each stage says so on stderr as it starts, beside tqdm's bars."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch
from tqdm.auto import tqdm

_ARCHS = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>")
# Two quantizations of one tied matrix differ by a few percent; independent matrices by ~140%.
_TIED_REL_DIFF = 0.2


def _hf_name(gguf_name: str) -> str | None:
    parts = gguf_name.split(".")
    if parts[0] == "token_embd":
        return "model.embed_tokens.weight"
    if parts[0] == "output_norm":
        return "model.norm.weight"
    if parts[0] == "output":
        return "lm_head.weight"
    if parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None  # e.g. rope_freqs: recomputed by the model


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row permutation of Q and K (llama architecture only)."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _config(fields: dict, arch: str, vocab_size: int, tied: bool) -> dict:
    def get(key, default=None):
        return fields.get(f"{arch}.{key}", default)

    hidden, heads = get("embedding_length"), get("attention.head_count")
    eos = [fields["tokenizer.ggml.eos_token_id"]] if "tokenizer.ggml.eos_token_id" in fields else []
    return {
        "architectures": [_ARCHS[arch]],
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length", hidden // heads),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": get("rope.freq_base", 10000.0),
        "max_position_embeddings": get("context_length", 4096),
        "tie_word_embeddings": tied,
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos[0] if eos else None,
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
        "attention_bias": arch == "qwen2",
    }


def convert_gguf(gguf_path: str, out_dir: str, desc: str | None = None) -> str:
    """Write the HF directory for ``gguf_path`` to ``out_dir`` (atomically) and return it."""
    import gguf
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    start = time.perf_counter()
    tqdm.write(f"reading {os.path.basename(gguf_path)}...", file=sys.stderr)
    reader = gguf.GGUFReader(gguf_path)
    fields = {
        name: f.contents()
        for name, f in reader.fields.items()
        if not name.startswith("tokenizer.ggml.") or name.endswith("_token_id")
    }
    arch = fields.get("general.architecture")
    if arch not in _ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(_ARCHS)})")
    heads = fields[f"{arch}.attention.head_count"]
    kv_heads = fields.get(f"{arch}.attention.head_count_kv", heads)

    tensors: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc=desc or f"converting {os.path.basename(gguf_path)}", unit="tensor"):
        name = _hf_name(t.name)
        if name is None:
            continue
        w = dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = _unpermute(w, heads if "q_proj" in name else kv_heads)
        tensors[name] = torch.from_numpy(np.array(w, dtype=np.float32))  # a writable copy

    embed, head = tensors["model.embed_tokens.weight"], tensors.get("lm_head.weight")
    tied = head is None or float((head - embed).norm() / embed.norm()) < _TIED_REL_DIFF
    if head is not None and tied:
        tensors["model.embed_tokens.weight"] = head  # the higher-precision copy of the tied matrix
    if tied:
        tensors.pop("lm_head.weight", None)
    tensors = {k: v.to(torch.bfloat16) for k, v in tensors.items()}
    vocab_size = embed.shape[0]

    tqdm.write(f"writing the bf16 weights and the tokenizer into {out_dir}...", file=sys.stderr)
    os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(os.path.abspath(out_dir)), prefix=".converting-")
    try:
        save_file(tensors, os.path.join(tmp, "model.safetensors"))
        del tensors
        tokenizer = _tokenizer(gguf_path, arch)
        tokenizer.save_pretrained(tmp)
        config = _config(fields, arch, vocab_size, tied)
        vocab = tokenizer.get_vocab()
        eos_ids = sorted({config["eos_token_id"], *(vocab[t] for t in _STOP_TOKENS if t in vocab)} - {None})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        with open(os.path.join(tmp, "generation_config.json"), "w") as f:
            json.dump({"bos_token_id": config["bos_token_id"], "eos_token_id": eos_ids}, f, indent=2)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    tqdm.write(
        f"converted in {time.perf_counter() - start:.0f} s (once: later runs load it from there)", file=sys.stderr
    )
    return out_dir


def _tokenizer(gguf_path: str, arch: str):
    from tokenizers import normalizers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(
        os.path.dirname(os.path.abspath(gguf_path)), gguf_file=os.path.basename(gguf_path)
    )
    if arch == "qwen2":  # upstream Qwen2 normalizes to NFC; the GGUF conversion dropped it
        tok.backend_tokenizer.normalizer = normalizers.NFC()
    return tok
