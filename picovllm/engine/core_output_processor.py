"""The engine's half of output processing: a step's sampled tokens appended to their requests
(with their log-probabilities, as numbers), the stops the engine sees (EOS, stop tokens,
max_tokens and the context limit, a grammar's end), a stopped request finished in the scheduler
(a prefill instance's prompt KV held first for its decode instance: kv_handoff), and what changed
as EngineCoreOutputs (messages.py). Text, stop strings and RequestOutputs are the other half's
(output_processor.py), where the outputs are read: a server's HTTP process, or LLMEngine.step.
"""

from __future__ import annotations

from picovllm.engine.kv_handoff import KVHandoff
from picovllm.engine.request import Request
from picovllm.engine.scheduler import Scheduler
from picovllm.kv_transfer_params import KVTransferParams
from picovllm.messages import CompletionDelta, EngineCoreOutput, SamplerOutput
from picovllm.sampling_params import RequestOutputKind


def at_length_limit(req: Request, pending: int = 0) -> bool:
    """Whether req has reached max_tokens or max_model_len, counting `pending` tokens that are
    sampled but not yet appended."""
    return len(req.token_ids) + pending >= req.max_num_tokens


class CoreOutputProcessor:
    """The requests in flight, by user request (groups: its n completions), until all of them
    have finished."""

    def __init__(self, eos_token_ids: set[int], scheduler: Scheduler, kv_handoff: KVHandoff | None):
        self.eos_token_ids, self.scheduler, self.kv_handoff = eos_token_ids, scheduler, kv_handoff
        self.groups: dict[str, list[Request]] = {}
        self._held: dict[str, KVTransferParams] = {}  # a prefill instance's answer, by request id
        self.num_dropped = 0  # tokens a step launched ahead computed for requests that had stopped

    def add(self, request_id: str, children: list[Request]) -> None:
        self.groups[request_id] = children

    def finish(self, request_id: str, reason: str) -> list[Request]:
        """Finish a request's completions (abort, a failed step); its completions (none if unknown)."""
        children = self.groups.pop(request_id, [])
        self._held.pop(request_id, None)
        for req in children:
            self.scheduler.finish(req, reason)
        return children

    def finish_completions(self, completions: list[tuple[str, int]]) -> None:
        """Completions a stop string ended (FinishRequest: (request id, index)); finished or
        unknown ones are ignored."""
        for request_id, index in completions:
            children = self.groups.get(request_id)
            if children is None or index >= len(children):
                continue
            self.scheduler.finish(children[index], "stop")
            if all(r.is_finished for r in children):
                del self.groups[request_id]
                self._held.pop(request_id, None)

    def process(
        self, reqs: list[Request], tokens: list[int], out: SamplerOutput | None, grammar_ends: list[str | None]
    ) -> list[EngineCoreOutput]:
        """Append each sampling request's token (`tokens`: the step's samples, as a list); a step of
        prompt chunks alone samples nothing. grammar_ends: the finish reason each row's grammar
        gives it, once its matcher has taken the token (structured_output.accept_tokens). A
        request whose text nothing reads before its end (FINAL_ONLY without stop strings) sends
        its first token, then the rest when it finishes."""
        if out is None:
            return []
        rows = None
        if out.sampled_logprobs is not None:
            rows = logprob_rows(out.sampled_logprobs, out.sampled_ranks, out.top_ids, out.top_logprobs)
        changed: dict[str, None] = {}
        for i, (req, token) in enumerate(zip(reqs, tokens)):
            if req.is_finished:  # stopped or aborted after this step was launched ahead
                self.num_dropped += 1
                continue
            req.token_ids.append(token)
            if req.logprobs is not None:
                req.logprobs.append(logprob_row(rows, i, req.params.logprobs))
            reason, stop_reason = grammar_ends[i], None
            if reason is None:
                reason, stop_reason = self._check_finished(req, token)
            if reason is not None:
                req.stop_reason = stop_reason
                if req.kv_transfer_params is not None and req.kv_transfer_params.do_remote_decode:
                    self._held[req.parent_id] = self.kv_handoff.hold(req)
                self.scheduler.finish(req, reason)
            p = req.params  # (FINAL_ONLY without stop strings: its first token (its time) and its end)
            if (
                reason is not None
                or p.output_kind is not RequestOutputKind.FINAL_ONLY
                or p.stop
                or len(req.token_ids) == req.num_prompt_tokens + 1
            ):
                changed[req.parent_id] = None
        return [self._output(rid) for rid in changed if rid in self.groups]

    def _check_finished(self, req: Request, token: int) -> tuple[str | None, int | None]:
        p = req.params
        past_min = req.num_output_tokens >= p.min_tokens
        if past_min and not p.ignore_eos and token in self.eos_token_ids:
            return "stop", None
        if past_min and token in p.stop_token_ids:
            return "stop", token
        if at_length_limit(req):
            return "length", None
        return None, None

    def add_prompt_logprobs(self, prompt_rows: list[tuple[Request, int, int]], out: SamplerOutput) -> None:
        """A step's prompt log-probabilities (StepLauncher's LaunchedStep.prompt_rows, in the order of
        out's prompt_* rows): token p of the step's first count of a request predicts prompt token
        p + 1. Positions a request already has (computed again after a preemption) are kept."""
        rows = logprob_rows(out.prompt_logprobs, out.prompt_ranks, out.prompt_top_ids, out.prompt_top_logprobs)
        i = 0
        for req, start, count in prompt_rows:
            for p in range(start + 1, start + 1 + count):
                if p == len(req.prompt_logprobs):
                    req.prompt_logprobs.append(logprob_row(rows, i, req.params.prompt_logprobs))
                i += 1

    def _output(self, request_id: str) -> EngineCoreOutput:
        children = self.groups[request_id]
        completions = []
        for r in children:
            new = r.token_ids[r.num_prompt_tokens + r.num_output_sent :]
            if new:
                logprobs = None if r.logprobs is None else r.logprobs[r.num_output_sent :]
                r.num_output_sent += len(new)
                completions.append(CompletionDelta(r.index, new, logprobs, r.finish_reason, r.stop_reason))
        finished = all(r.is_finished for r in children)
        held = None
        if finished:
            del self.groups[request_id]
            held = self._held.pop(request_id, None)
        first = children[0]
        prompt_logprobs = None  # (once whole)
        if first.prompt_logprobs is not None and not first.needs_prompt_logprobs and not first.prompt_logprobs_sent:
            prompt_logprobs, first.prompt_logprobs_sent = first.prompt_logprobs, True
        return EngineCoreOutput(
            request_id, completions, finished, first.num_prompt_cached_tokens or 0, held, prompt_logprobs
        )


def logprob_rows(chosen, ranks, top_ids, top_logprobs) -> dict[str, list]:
    """A step's logprob tensors (sampled or prompt tokens', SamplerOutput's) as lists."""
    rows = {"chosen": chosen.tolist(), "rank": ranks.tolist()}
    if top_ids is not None:
        rows["top_ids"], rows["top_logprobs"] = top_ids.tolist(), top_logprobs.tolist()
    return rows


def logprob_row(rows: dict[str, list], i: int, k: int) -> tuple:
    """Row i's (logprob, rank, top k ids, top k logprobs)."""
    if "top_ids" in rows:
        return rows["chosen"][i], rows["rank"][i], rows["top_ids"][i][:k], rows["top_logprobs"][i][:k]
    return rows["chosen"][i], rows["rank"][i], [], []
