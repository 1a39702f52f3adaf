"""From a user's prompt to validated token ids, before the engine sees it: the tokenizer, the
prompt's checks against the model (vocabulary, context) and the sampling parameters. Needs no
model weights: the server's HTTP process and the CLI run it before (or without) the engine.
"""

from __future__ import annotations

import array

import numpy as np

from picovllm.config import EngineConfig, ModelConfig
from picovllm.sampling_params import SamplingParams

PromptType = str | dict | list[int]


def import_tokenizer_library() -> None:
    """transformers' AutoTokenizer imported, which takes a few seconds of a small CPU: a server's
    process does it while its engine process starts, not once the engine is ready."""
    from transformers import AutoTokenizer  # noqa: F401


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises many kinds; the user needs to know which model
        raise ValueError(
            f"could not load a tokenizer from {path!r} ({e}); pass skip_tokenizer_init=True to run on token ids only"
        ) from e


def process_prompt(
    prompt: PromptType, params: SamplingParams, tokenizer, vocab_size: int, max_model_len: int
) -> tuple[str | None, list[int]]:
    """Validate a prompt (string, token ids or {"prompt_token_ids"/"prompt": ...}) against a
    model (its tokenizer, vocabulary and context) and params; return its text and token ids (the
    last params.truncate_prompt_tokens of them; the text is the prompt's as given, as vLLM's).
    Raises ValueError. Needs no model weights: a server's front end runs it."""
    if isinstance(prompt, dict):
        unknown = set(prompt) - {"prompt", "prompt_token_ids"}
        if unknown or not prompt:
            raise ValueError(f"a prompt dict takes 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        prompt = prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else prompt["prompt"]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(
                "a text prompt needs a tokenizer, and the engine has none (a dummy: model, or "
                "skip_tokenizer_init): give token ids ({'prompt_token_ids': [...]}) or a tokenizer"
            )
        text, ids = prompt, tokenizer.encode(prompt)
    elif isinstance(prompt, (list, tuple)):
        text, ids, vocab = None, list(prompt), vocab_size
        # The common case checked in C: array() takes integers only (anything with __index__),
        # numpy its range (faster than set(map(type)), min() and max(), and far faster than a
        # Python loop); the first offender is looked for only when there is one.
        try:
            ok = not ids or 0 <= (a := np.frombuffer(array.array("q", ids), dtype=np.int64)).min() <= a.max() < vocab
        except (TypeError, OverflowError):
            ok = False
        if not ok:
            bad = next(t for t in ids if not hasattr(t, "__index__") or not 0 <= t < vocab)
            raise ValueError(f"prompt token id {bad!r} is out of range [0, {vocab})")
    else:
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")
    if not ids:
        raise ValueError("the prompt is empty")
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
    if (keep := params.truncate_prompt_tokens) is not None:
        keep = max_model_len if keep == -1 else keep
        if keep > max_model_len:
            raise ValueError(f"truncate_prompt_tokens ({keep}) is more than max_model_len ({max_model_len})")
        ids = ids[-keep:]
    if len(ids) >= max_model_len:
        raise ValueError(
            f"the prompt has {len(ids)} tokens; max_model_len is {max_model_len}, which leaves no room to generate"
        )
    if params.max_tokens is not None and len(ids) + params.max_tokens > max_model_len:
        raise ValueError(
            f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds max_model_len ({max_model_len})"
        )
    for name, tokens in (
        ("stop_token_ids", params.stop_token_ids),
        ("logit_bias", params.logit_bias or ()),
        ("allowed_token_ids", params.allowed_token_ids or ()),
    ):
        bad = next((t for t in tokens if t >= vocab_size), None)
        if bad is not None:  # (the sampler indexes the logits with them: a min_tokens ban, a bias, a mask)
            raise ValueError(f"{name}: token id {bad} is out of range [0, {vocab_size})")
    if params.stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer (the engine was started without one)")
    return text, ids


def tokenizer_source(config: EngineConfig, model_path: str | None) -> str | None:
    """Where the engine's tokenizer comes from (None: it runs on token ids only; a dummy model
    has none unless one is given)."""
    if config.skip_tokenizer_init:
        return None
    return config.tokenizer or model_path


def eos_token_ids(model_config: ModelConfig, tokenizer) -> set[int]:
    """The model's end-of-sequence ids: its config's, and its tokenizer's."""
    ids = set(model_config.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
