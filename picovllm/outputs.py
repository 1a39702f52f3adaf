"""What generate() and LLMEngine.step() return, with vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass, field

from picovllm.kv_transfer_params import KVTransferParams


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the top-k and the sampled token).
SampleLogprobs = list[dict[int, Logprob]]
# One per prompt token: None for the first (nothing before it), then token id -> Logprob (the top-k
# and the prompt's token).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # 'stop' | 'length' | 'abort' | None while running
    stop_reason: int | str | None = None  # the stop string or stop token that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    kv_transfer_params: KVTransferParams | None = None  # a prefill instance's: where a decode instance pulls the KV
    prompt_logprobs: PromptLogprobs | None = (
        None  # (SamplingParams.prompt_logprobs; a DELTA stream: in its first output)
    )

    def add(self, later: RequestOutput, aggregate: bool) -> None:
        """Take a later output of the same request into this one (vLLM's RequestOutput.add), so that
        a reader that fell behind reads one output: with aggregate (DELTA outputs) each completion's
        new text, tokens and logprobs are appended to its own; otherwise (CUMULATIVE) the later
        completion replaces it."""
        for c in later.outputs:
            mine = next((i for i, o in enumerate(self.outputs) if o.index == c.index), None)
            if mine is None:
                self.outputs.append(c)
            elif not aggregate:
                self.outputs[mine] = c
            else:
                o = self.outputs[mine]
                o.text += c.text
                # (a DELTA output's lists are its own: extended in place, a merge costs its own tokens)
                o.token_ids.extend(c.token_ids)
                if c.logprobs is not None:
                    o.logprobs = o.logprobs if o.logprobs is not None else []
                    o.logprobs.extend(c.logprobs)
                o.cumulative_logprob = c.cumulative_logprob
                o.finish_reason, o.stop_reason = c.finish_reason, c.stop_reason
        self.finished = later.finished
        self.num_cached_tokens, self.metrics = later.num_cached_tokens, later.metrics
        self.kv_transfer_params = later.kv_transfer_params or self.kv_transfer_params
        self.prompt_logprobs = self.prompt_logprobs or later.prompt_logprobs
