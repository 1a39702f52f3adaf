"""SamplingParams: per-request sampling settings with vLLM's names, defaults and meanings."""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass

_GREEDY_EPS = 1e-5


MAX_LOGPROBS = 20  # the most top log-probabilities a token may ask for (vLLM's max_logprobs default)
MAX_N = 256  # the most completions of one prompt (each a sequence of its own: vLLM's max_num_seqs default)


class RequestOutputKind(enum.Enum):
    """When LLMEngine.step() reports a request (vLLM's names)."""

    CUMULATIVE = 0  # every step that adds a token, with everything generated so far (streaming)
    DELTA = 1  # every step that adds a token, with what it added (text a stop string may still cut: later)
    FINAL_ONLY = 2  # once, when it finishes (LLM.generate)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Output constrained to exactly one of (vLLM's names): a JSON schema (json: the schema, or
    its JSON text), any JSON object (json_object), a regular expression (regex), one of some
    strings (choice) or an EBNF grammar (grammar, xgrammar's dialect). The engine compiles it
    (engine/structured_output.py); a request under it ends when the output is complete."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [
            n for n in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, n) not in (None, False)
        ]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs takes exactly one of json, regex, choice, grammar or json_object, "
                f"got {', '.join(given) or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object), got {self.json!r}")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"structured_outputs.{name} must be a string, got {getattr(self, name)!r}")
        if self.choice is not None and not (
            isinstance(self.choice, (list, tuple)) and all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(f"structured_outputs.choice must be non-empty strings, got {self.choice!r}")

    @property
    def kind(self) -> str:
        return next(
            n for n in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, n) not in (None, False)
        )


@dataclass
class SamplingParams:
    """How to sample one request. Invalid values raise ValueError naming the field.

    temperature 0 means greedy; top_k 0 or -1 means off; top_p 1 and min_p 0 are off.
    Penalties follow vLLM: repetition_penalty multiplies down the logits of tokens seen in the
    prompt or output (1 = off); presence/frequency penalties subtract from the logits of tokens
    seen in the output (0 = off). ``logprobs=k`` returns the top-k log-probabilities (of the raw
    model distribution) at each step, plus the sampled token's; ``prompt_logprobs=k`` the same for
    each prompt token given the ones before it (RequestOutput.prompt_logprobs; the request's prompt
    is computed whole, without prefix-cache hits). structured_outputs constrains the output
    (StructuredOutputsParams). logit_bias adds its value to each of its token ids' logits before
    anything else reads them (the penalties, greedy's choice, the draw), as vLLM's and OpenAI's;
    allowed_token_ids (vLLM's) are the only tokens the request may take. truncate_prompt_tokens
    (vLLM's) keeps the prompt's last k tokens (-1: max_model_len's worth).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        def need(cond: bool, name: str, msg: str) -> None:
            if not cond:
                raise ValueError(f"{name} {msg}, got {getattr(self, name)!r}")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        need(is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"must be an integer in [1, {MAX_N}]")
        need(
            isinstance(self.temperature, (int, float)) and self.temperature >= 0, "temperature", "must be a number >= 0"
        )
        need(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        need(
            is_int(self.top_k) and (self.top_k >= 0 or self.top_k == -1),
            "top_k",
            "must be -1 (disable), 0 (disable) or a positive integer",
        )
        need(isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        need(
            isinstance(self.repetition_penalty, (int, float)) and self.repetition_penalty > 0,
            "repetition_penalty",
            "must be > 0",
        )
        need(
            isinstance(self.presence_penalty, (int, float)) and -2 <= self.presence_penalty <= 2,
            "presence_penalty",
            "must be in [-2, 2]",
        )
        need(
            isinstance(self.frequency_penalty, (int, float)) and -2 <= self.frequency_penalty <= 2,
            "frequency_penalty",
            "must be in [-2, 2]",
        )
        need(self.seed is None or is_int(self.seed), "seed", "must be an integer or None")
        need(
            self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1),
            "max_tokens",
            "must be an integer >= 1 or None",
        )
        need(is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "must be an integer >= 0")
        need(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be <= max_tokens ({self.max_tokens})",
        )
        need(
            self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
            "logprobs",
            f"must be an integer in [0, {MAX_LOGPROBS}] or None",
        )
        need(
            self.prompt_logprobs is None
            or (is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
            "prompt_logprobs",
            f"must be an integer in [0, {MAX_LOGPROBS}] or None",
        )
        need(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        need(isinstance(self.output_kind, RequestOutputKind), "output_kind", "must be a RequestOutputKind")
        need(
            self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs",
            "must be a StructuredOutputsParams",
        )
        need(all(is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be non-negative integers")
        need(
            self.logit_bias is None
            or isinstance(self.logit_bias, dict)
            and all(
                is_int(t) and t >= 0 and isinstance(b, (int, float)) and math.isfinite(b)
                for t, b in self.logit_bias.items()
            ),
            "logit_bias",
            "must map token ids (integers >= 0) to finite numbers",
        )
        need(
            self.allowed_token_ids is None
            or isinstance(self.allowed_token_ids, list)
            and self.allowed_token_ids
            and all(is_int(t) and t >= 0 for t in self.allowed_token_ids),
            "allowed_token_ids",
            "must be a non-empty list of token ids (integers >= 0) or None",
        )
        need(
            self.truncate_prompt_tokens is None
            or is_int(self.truncate_prompt_tokens)
            and (self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1),
            "truncate_prompt_tokens",
            "must be an integer >= 1, -1 (max_model_len) or None",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        """Whether sampling reads the tokens so far (repetition, presence or frequency penalty)."""
        return self.repetition_penalty != 1 or bool(self.presence_penalty) or bool(self.frequency_penalty)

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        """Build from a dict, rejecting unknown keys with a message that names them."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        if isinstance(d.get("structured_outputs"), dict):
            d = {**d, "structured_outputs": StructuredOutputsParams(**d["structured_outputs"])}
        return cls(**d)
