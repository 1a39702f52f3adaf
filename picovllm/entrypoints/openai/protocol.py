"""Request bodies of the OpenAI-compatible API (pydantic), with vLLM's extra sampling fields.

Wire types are strict, as OpenAI's API is: no integer from a string or a float, no boolean from
0 or 1, no number from true (an integer is a number); a rejection is a 400 naming the field.
Unknown top-level fields are accepted and ignored, as vLLM does (each name logged once).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from picovllm.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger("picovllm")
_STRICT = ConfigDict(strict=True)
_ignored_fields: set[str] = set()  # (logged once each)


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, populate_by_name=True)

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, any JSON object, or JSON under a schema."""

    model_config = _STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs its json_schema")
        return self


# the fields that constrain the output (_SamplingFields.structured), in the order a 400 names them
STRUCTURED_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


class StructuredOutputsFields(BaseModel):
    """vLLM's structured_outputs field: exactly one of these."""

    model_config = ConfigDict(strict=True, extra="forbid")

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


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
    logit_bias: dict[str, float] | None = None  # (token ids as strings, as OpenAI's)
    allowed_token_ids: list[int] | None = None  # (vLLM's)
    truncate_prompt_tokens: int | None = None  # (vLLM's)
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
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs, or the older guided_*
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsFields | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured(self) -> tuple[StructuredOutputsParams | None, str]:
        """(the request's constraint, the field it came in); ValueError naming the field when it
        is malformed, or when two fields give one."""
        given = self._constraints()
        if not given:
            return None, ""
        if len(given) > 1:
            raise ValueError(f"{given[0][0]} and {given[1][0]} both constrain the output: give one")
        name, kwargs = given[0]
        try:
            return StructuredOutputsParams(**kwargs), name
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None

    @property
    def structured_field(self) -> str:
        """The first field of STRUCTURED_FIELDS the request gives ("" if none): the one a 400
        about its constraint names."""
        rf = self.response_format
        given = (
            n
            for n in STRUCTURED_FIELDS
            if getattr(self, n) is not None and (n != "response_format" or rf.type != "text")
        )
        return next(given, "")

    def _constraints(self) -> list[tuple[str, dict]]:
        given = []
        rf = self.response_format
        if rf is not None and rf.type != "text":
            schema = rf.json_schema.json_schema if rf.type == "json_schema" else None
            given.append(("response_format", dict(json=schema) if schema is not None else dict(json_object=True)))
        if self.structured_outputs is not None:
            given.append(("structured_outputs", self.structured_outputs.model_dump(by_alias=True, exclude_none=True)))
        for kind in ("json", "regex", "choice", "grammar"):
            if (value := getattr(self, f"guided_{kind}")) is not None:
                given.append((f"guided_{kind}", {kind: value}))
        return given

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
            "allowed_token_ids",
            "truncate_prompt_tokens",
        ):
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        if max_tokens is not None:
            values["max_tokens"] = max_tokens
        if self.logit_bias is not None:
            values["logit_bias"] = _logit_bias(self.logit_bias)
        values["structured_outputs"] = self.structured()[0]
        return SamplingParams(
            n=self.n,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            **values,
        )


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias (token ids as strings) as SamplingParams'; biases beyond [-100, 100]
    are taken as its ends, as vLLM does."""
    try:
        return {int(token): min(100.0, max(-100.0, value)) for token, value in bias.items()}
    except ValueError:
        raise ValueError(f"logit_bias keys must be token ids, got {list(bias)!r}") from None


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
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's result: the call it answers
    name: str | None = None

    def for_template(self) -> dict:
        """The message as a chat template takes it (text content; tool fields when present)."""
        d = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            d["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            d["name"] = self.name
        return d

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: only text is supported
            return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
        return self.content or ""


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of its arguments


class ChatTool(BaseModel):
    model_config = _STRICT

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = _STRICT

    name: str


class NamedToolChoice(BaseModel):
    model_config = _STRICT

    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
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
