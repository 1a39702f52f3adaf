"""Tiny random-weight Qwen2 / Llama checkpoints and a tiny byte-level BPE tokenizer, built in the
test run (no downloads), saved as Hugging Face directories."""

from __future__ import annotations

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "def add(a, b):\n    return a + b\n",
    "Hello world! Pico-vLLM is a small and fast inference engine.",
    "Zürich, Köln, Ελλάδα, 東京, 😀 emoji and accents: café, naïve.",
] * 4
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer(path: str, vocab_size: int = 300):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def build_model(
    path: str,
    arch: str = "qwen2",
    *,
    tie: bool = True,
    bias: bool = True,
    vocab_size: int = 307,
    hidden: int | None = None,
    heads: int = 6,
    kv_heads: int = 2,
    head_dim: int = 16,
    layers: int = 3,
    intermediate: int = 80,
    seed: int = 0,
    tokenizer: bool = True,
    init_std: float = 0.15,
    max_position: int = 1024,
):
    """Save a random model; returns the HF model (fp32, eval) for reference outputs. Qwen2's hidden
    size defaults to 64, not heads * head_dim (96); transformers' Llama insists on the product."""
    hidden = hidden or (64 if arch == "qwen2" else heads * head_dim)
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position,
        tie_word_embeddings=tie,
        rms_norm_eps=1e-6,
        initializer_range=init_std,
        eos_token_id=2,
        bos_token_id=0,
    )
    if arch == "qwen2":
        assert bias, "Qwen2 always has QKV bias"
        cfg, cls = Qwen2Config(rope_theta=10000.0, **common), Qwen2ForCausalLM
    else:
        cfg, cls = LlamaConfig(attention_bias=bias, rope_theta=10000.0, **common), LlamaForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    with torch.no_grad():  # biases and norms start at 0 and 1: randomise them so they matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    if tokenizer:
        build_tokenizer(path)
    return model
