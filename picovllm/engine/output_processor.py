"""Output processing: a step's sampled tokens into RequestOutputs. Each request's tokens and
logprobs appended, its stop checks (EOS, stop tokens, stop strings, max_tokens and the context
limit), its incremental text (detokenizer.py), and the n completions of one user request as one
output, in its output kind (DELTA: what each step added; CUMULATIVE; FINAL_ONLY). The engine
hands it the requests that sampled and their tokens; a request that stops is finished in the
scheduler here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from picovllm.engine.detokenizer import Detokenizer
from picovllm.engine.kv_handoff import KVHandoff
from picovllm.engine.request import Request
from picovllm.engine.scheduler import Scheduler
from picovllm.kv_transfer_params import KVTransferParams
from picovllm.messages import SamplerOutput
from picovllm.outputs import CompletionOutput, Logprob, RequestOutput
from picovllm.sampling_params import RequestOutputKind


def at_length_limit(req: Request, pending: int = 0) -> bool:
    """Whether req has reached max_tokens or max_model_len, counting `pending` tokens that are
    sampled but not yet appended."""
    return len(req.token_ids) + pending >= req.max_num_tokens


@dataclass
class RequestGroup:
    """The n completions of one user request."""

    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    arrival_time: float  # time.time(), as vLLM's RequestMetrics
    first_token_time: float | None = None
    kv_transfer_params: KVTransferParams | None = None  # a prefill instance's answer: where the KV is held
    prompt_logprobs_sent: bool = False  # (a DELTA stream's, sent with its first output)


class OutputProcessor:
    """The requests in flight, by user request (their groups), until their last output; a request
    that stops is finished in the scheduler (its blocks freed), a prefill instance's prompt KV
    held first for its decode instance (kv_handoff)."""

    def __init__(self, tokenizer, eos_token_ids: set[int], scheduler: Scheduler, kv_handoff: KVHandoff | None):
        self.tokenizer = tokenizer
        self.detokenizer = Detokenizer(tokenizer) if tokenizer is not None else None
        self.eos_token_ids, self.scheduler, self.kv_handoff = eos_token_ids, scheduler, kv_handoff
        self.groups: dict[str, RequestGroup] = {}
        self.num_dropped = 0  # tokens a step launched ahead computed for requests that had stopped

    def add(self, request_id: str, text: str | None, ids: list[int], children: list[Request]) -> None:
        if self.detokenizer is not None:
            for req in children:
                self.detokenizer.start(req)
        self.groups[request_id] = RequestGroup(text, ids, children, time.time())

    def process(
        self, reqs: list[Request], tokens: list[int], out: SamplerOutput | None, grammar_ends: list[str | None]
    ) -> list[RequestOutput]:
        """Append each sampling request's token (`tokens`: the step's samples, as a list); a step of
        prompt chunks alone samples nothing. grammar_ends: the finish reason each row's grammar
        gives it, once its matcher has taken the token (structured_output.accept_tokens)."""
        if out is None:
            return []
        logprob_rows = None
        if out.sampled_logprobs is not None:
            logprob_rows = self._logprob_rows(out.sampled_logprobs, out.sampled_ranks, out.top_ids, out.top_logprobs)
        changed: dict[str, None] = {}
        now = time.time()
        for i, (req, token) in enumerate(zip(reqs, tokens)):
            if req.is_finished:  # stopped or aborted after this step was launched ahead
                self.num_dropped += 1
                continue
            req.token_ids.append(token)
            if req.logprobs is not None:
                req.logprobs.append(self._logprob_dict(logprob_rows, i, token, req.params.logprobs))
                req.cumulative_logprob += req.logprobs[-1][token].logprob
            reason, stop_reason = grammar_ends[i], None
            if reason is None:
                reason, stop_reason = self._check_finished(req, token)
            if reason is not None:
                if reason != "length" and self.detokenizer is not None and req.params.detokenize:
                    self.detokenizer.stopped(req)
                req.stop_reason = stop_reason
                if req.kv_transfer_params is not None and req.kv_transfer_params.do_remote_decode:
                    self.groups[req.parent_id].kv_transfer_params = self.kv_handoff.hold(req)
                self.scheduler.finish(req, reason)
            if req.num_output_tokens == 1 and (group := self.groups.get(req.parent_id)) is not None:
                group.first_token_time = group.first_token_time or now
            if req.params.output_kind is not RequestOutputKind.FINAL_ONLY or req.is_finished:
                changed[req.parent_id] = None
        outputs = []
        for rid in changed:
            group = self.groups.get(rid)
            if group is not None and (
                group.children[0].params.output_kind is not RequestOutputKind.FINAL_ONLY
                or all(r.is_finished for r in group.children)
            ):
                outputs.append(self._output(rid))
        return outputs

    def _check_finished(self, req: Request, token: int) -> tuple[str | None, int | str | None]:
        p = req.params
        past_min = req.num_output_tokens >= p.min_tokens
        if past_min and not p.ignore_eos and token in self.eos_token_ids:
            return "stop", None
        if past_min and token in p.stop_token_ids:
            return "stop", token
        detokenize = self.detokenizer is not None and p.detokenize
        if detokenize and (stop := self.detokenizer.step(req)) is not None:
            return "stop", stop
        if at_length_limit(req):
            if detokenize and (stop := self.detokenizer.flush(req)) is not None:
                return "stop", stop
            return "length", None
        return None, None

    def add_prompt_logprobs(self, prompt_rows: list[tuple[Request, int, int]], out: SamplerOutput) -> None:
        """A step's prompt log-probabilities (StepLauncher's LaunchedStep.prompt_rows, in the order of
        out's prompt_* rows): token p of the step's first count of a request predicts prompt token
        p + 1. Positions a request already has (computed again after a preemption) are kept."""
        rows = self._logprob_rows(out.prompt_logprobs, out.prompt_ranks, out.prompt_top_ids, out.prompt_top_logprobs)
        i = 0
        for req, start, count in prompt_rows:
            for p in range(start + 1, start + 1 + count):
                if p == len(req.prompt_logprobs):
                    req.prompt_logprobs.append(
                        self._logprob_dict(rows, i, req.token_ids[p], req.params.prompt_logprobs)
                    )
                i += 1

    @staticmethod
    def _logprob_rows(chosen, ranks, top_ids, top_logprobs) -> dict[str, list]:
        """A step's logprob tensors (sampled or prompt tokens', SamplerOutput's) as lists."""
        rows = {"chosen": chosen.tolist(), "rank": ranks.tolist()}
        if top_ids is not None:
            rows["top_ids"], rows["top_logprobs"] = top_ids.tolist(), top_logprobs.tolist()
        return rows

    def _logprob_dict(self, rows: dict[str, list], i: int, token: int, k: int) -> dict[int, Logprob]:
        top = zip(rows["top_ids"][i][:k], rows["top_logprobs"][i][:k]) if "top_ids" in rows else ()
        entries = {tid: Logprob(lp, rank, self._decode_token(tid)) for rank, (tid, lp) in enumerate(top, start=1)}
        entries[token] = Logprob(rows["chosen"][i], rows["rank"][i], self._decode_token(token))
        return entries

    def _decode_token(self, token: int) -> str | None:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else None

    def _output(self, request_id: str) -> RequestOutput:
        group = self.groups[request_id]
        finished = all(r.is_finished for r in group.children)
        delta = group.children[0].params.output_kind is RequestOutputKind.DELTA
        outputs = []
        for r in group.children:
            tokens, text, logprobs = self._take_delta(r) if delta else (r.output_token_ids, r.output_text, r.logprobs)
            outputs.append(
                CompletionOutput(
                    index=r.index,
                    text=text,
                    token_ids=tokens,
                    cumulative_logprob=r.cumulative_logprob if r.logprobs is not None else None,
                    logprobs=logprobs,
                    finish_reason=r.finish_reason,
                    stop_reason=r.stop_reason,
                )
            )
        if finished:
            del self.groups[request_id]
        first = group.children[0]
        prompt_logprobs = None  # (once whole; a DELTA stream has them in one output)
        if first.prompt_logprobs is not None and not first.needs_prompt_logprobs and not group.prompt_logprobs_sent:
            prompt_logprobs, group.prompt_logprobs_sent = first.prompt_logprobs, delta
        num_cached = first.num_prompt_cached_tokens or 0
        metrics = {"arrival_time": group.arrival_time}
        if group.first_token_time is not None:
            metrics["first_token_time"] = group.first_token_time
        if finished:
            metrics["finished_time"] = time.time()
        return RequestOutput(
            request_id,
            group.prompt,
            group.prompt_token_ids,
            outputs,
            finished,
            num_cached,
            metrics,
            group.kv_transfer_params if finished else None,
            prompt_logprobs,
        )

    @staticmethod
    def _take_delta(r: Request) -> tuple[list[int], str, list | None]:
        """The tokens, text and logprobs r generated since its last output (RequestOutputKind.DELTA),
        marked as sent. Only final text is sent (Detokenizer.final_text_len)."""
        tokens = r.token_ids[r.num_prompt_tokens + r.num_output_sent :]
        logprobs = None if r.logprobs is None else r.logprobs[r.num_output_sent :]
        r.num_output_sent += len(tokens)
        end = max(r.text_sent, Detokenizer.final_text_len(r))
        text, r.text_sent = r.output_text[r.text_sent : end], end
        return tokens, text, logprobs
