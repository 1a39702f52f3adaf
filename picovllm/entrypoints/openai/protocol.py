"""Request bodies of the OpenAI-compatible API (pydantic), with vLLM's extra sampling fields.

Wire types are strict, as OpenAI's API is: no integer from a string or a float, no boolean from
0 or 1, no number from true (an integer is a number); a rejection is a 400 naming the field.
Unknown top-level fields are accepted and ignored, as vLLM does (each name logged once).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from picovllm.sampling_params import SamplingParams

logger = logging.getLogger("picovllm")
_STRICT = ConfigDict(strict=True)
_ignored_fields: set[str] = set()  # (logged once each)


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat; None means the server's default."""

    model_config = ConfigDict(strict=True, extra="allow")  # unknown fields are ignored, as vLLM does

    @model_validator(mode="after")
    def _log_ignored(self):
        for name in (self.model_extra or {}).keys() - _ignored_fields:
            _ignored_fields.add(name)
            logger.info("request field %r is not one this server knows: ignored", name)
        return self

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    min_tokens: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # disaggregated prefill (vLLM's field): {"do_remote_decode": true} to a prefill instance; its
    # answer's kv_transfer_params to a decode instance (engine/kv_handoff.py)
    kv_transfer_params: dict[str, Any] | None = None

    def sampling_params(self, defaults: dict[str, Any], max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ValueError naming the field for invalid values."""
        values = dict(defaults)
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "seed",
            "stop",
            "stop_token_ids",
            "min_tokens",
        ):
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        if max_tokens is not None:
            values["max_tokens"] = max_tokens
        return SamplingParams(
            n=self.n,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            **values,
        )


class CompletionRequest(_SamplingFields):
    # token ids tried first and strictly (no "12" -> 12): pydantic's default "smart" union tries
    # every member, several times slower on a long prompt, on the thread that streams tokens
    prompt: list[StrictInt] | str | list[str] | list[list[StrictInt]] = Field(union_mode="left_to_right")
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: only text is supported
            return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True


class TokenizeRequest(BaseModel):
    model_config = _STRICT

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = _STRICT

    model: str | None = None
    tokens: list[int]
